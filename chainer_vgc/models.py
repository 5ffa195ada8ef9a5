"""Models of the paper's experiments (used by examples, tests, benchmarks)."""

import chainer
import chainer.functions as F
import chainer.links as L

# Appendix D, Table "network architecture for CIFAR-10": (channels, dropout
# after the conv or None); 'M' = max pooling.  Every conv is followed by
# batch normalization and ReLU.
VGG_LAYERS = [(64, 0.3), (64, None), 'M',
              (128, 0.4), (128, None), 'M',
              (256, 0.4), (256, 0.4), (256, None), 'M',
              (512, 0.4), (512, 0.4), (512, None), 'M',
              (512, 0.4), (512, 0.4), (512, None), 'M']


class ConvBNReLU(chainer.Chain):
    def __init__(self, out_channels):
        super(ConvBNReLU, self).__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(None, out_channels, 3, pad=1,
                                        nobias=True)
            self.bn = L.BatchNormalization(out_channels)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class VGG(chainer.Chain):
    """The VGG-like network of the paper's Appendix D (Chainer's CIFAR
    example): 13 conv3 layers with BN + ReLU and dropout, 5 max-pools, then
    dropout 0.5, fc 512, BN, ReLU, dropout 0.5, fc ``n_class``.

    ``width`` scales every channel count (1.0 = the paper's network);
    ``dropout=False`` disables dropout (for exact tests).
    """

    def __init__(self, n_class=10, width=1.0, dropout=True):
        super(VGG, self).__init__()
        self.dropout = dropout
        self.plan = []
        with self.init_scope():
            k = 0
            for item in VGG_LAYERS:
                if item == 'M':
                    self.plan.append(('pool', None))
                    continue
                ch, ratio = item
                name = 'block{}'.format(k)
                setattr(self, name, ConvBNReLU(max(1, int(ch * width))))
                self.plan.append((name, ratio))
                k += 1
            self.fc1 = L.Linear(None, max(1, int(512 * width)), nobias=True)
            self.bn_fc1 = L.BatchNormalization(max(1, int(512 * width)))
            self.fc2 = L.Linear(None, n_class)

    def _drop(self, h, ratio):
        return F.dropout(h, ratio) if self.dropout and ratio else h

    def forward(self, x):
        h = x
        for name, ratio in self.plan:
            if name == 'pool':
                h = F.max_pooling_2d(h, 2, 2)
            else:
                h = self._drop(getattr(self, name)(h), ratio)
        h = self._drop(h, 0.5)
        h = F.relu(self.bn_fc1(self.fc1(h)))
        h = self._drop(h, 0.5)
        return self.fc2(h)


class MLP(chainer.Chain):
    """Multi-layer perceptron with ReLU (the MNIST examples)."""

    def __init__(self, n_units=(1000, 1000), n_out=10):
        super(MLP, self).__init__()
        with self.init_scope():
            self.layers = chainer.ChainList(
                *[L.Linear(None, n) for n in list(n_units) + [n_out]])

    def forward(self, x):
        h = x
        for k, layer in enumerate(self.layers):
            h = layer(h)
            if k < len(self.layers) - 1:
                h = F.relu(h)
        return h
