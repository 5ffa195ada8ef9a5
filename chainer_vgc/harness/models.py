"""Models of the paper's experiments (used by examples, tests, benchmarks)."""

import chainer
import chainer.functions as F
import chainer.links as L
import numpy

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


class DCGANGenerator(chainer.Chain):
    """A DCGAN generator shaped like ChainerMN's DCGAN example (not from the
    paper; the benchmark of the statistics' cost on deconvolutions): a
    ``n_hidden``-dim noise vector, a Linear to ``ch`` maps of 4x4, then
    three stride-2 Deconvolution2D (4x4 kernels) halving the channels, each
    with BatchNormalization and ReLU, and a 3x3 Deconvolution2D to
    ``out_channels`` 32x32 maps with a tanh."""

    def __init__(self, n_hidden=100, ch=512, out_channels=3):
        super(DCGANGenerator, self).__init__()
        self.n_hidden, self.ch = n_hidden, ch
        w = chainer.initializers.Normal(0.02)
        with self.init_scope():
            self.fc = L.Linear(n_hidden, 4 * 4 * ch, initialW=w)
            self.up1 = L.Deconvolution2D(ch, ch // 2, 4, 2, 1, initialW=w)
            self.up2 = L.Deconvolution2D(ch // 2, ch // 4, 4, 2, 1,
                                         initialW=w)
            self.up3 = L.Deconvolution2D(ch // 4, ch // 8, 4, 2, 1,
                                         initialW=w)
            self.out = L.Deconvolution2D(ch // 8, out_channels, 3, 1, 1,
                                         initialW=w)
            self.bn0 = L.BatchNormalization(4 * 4 * ch)
            self.bn1 = L.BatchNormalization(ch // 2)
            self.bn2 = L.BatchNormalization(ch // 4)
            self.bn3 = L.BatchNormalization(ch // 8)

    def make_hidden(self, batchsize, rng):
        """Noise of shape (batchsize, n_hidden, 1, 1), uniform in [-1, 1),
        from the NumPy generator ``rng``."""
        return rng.uniform(-1, 1, (batchsize, self.n_hidden, 1, 1)).astype(
            'f')

    def forward(self, z):
        h = F.relu(self.bn0(self.fc(z)))
        h = F.reshape(h, (len(z), self.ch, 4, 4))
        h = F.relu(self.bn1(self.up1(h)))
        h = F.relu(self.bn2(self.up2(h)))
        h = F.relu(self.bn3(self.up3(h)))
        return F.tanh(self.out(h))


class DCGANDiscriminator(chainer.Chain):
    """The matching discriminator: seven Convolution2D (3x3 stride 1 and
    4x4 stride 2 in turn, channels ``ch // 8`` up to ``ch``), all but the
    first with BatchNormalization, leaky ReLU, and a Linear to one logit."""

    def __init__(self, ch=512, in_channels=3):
        super(DCGANDiscriminator, self).__init__()
        w = chainer.initializers.Normal(0.02)
        plan = [(in_channels, ch // 8, 3, 1), (ch // 8, ch // 4, 4, 2),
                (ch // 4, ch // 4, 3, 1), (ch // 4, ch // 2, 4, 2),
                (ch // 2, ch // 2, 3, 1), (ch // 2, ch, 4, 2),
                (ch, ch, 3, 1)]
        self.depth = len(plan)
        with self.init_scope():
            for k, (cin, cout, size, stride) in enumerate(plan):
                setattr(self, 'c{}'.format(k), L.Convolution2D(
                    cin, cout, size, stride, 1, initialW=w))
                if k:
                    setattr(self, 'bn{}'.format(k),
                            L.BatchNormalization(cout, use_gamma=False))
            self.fc = L.Linear(4 * 4 * ch, 1, initialW=w)

    def forward(self, x):
        h = x
        for k in range(self.depth):
            h = getattr(self, 'c{}'.format(k))(h)
            if k:
                h = getattr(self, 'bn{}'.format(k))(h)
            h = F.leaky_relu(h)
        return self.fc(h)


class Bottleneck(chainer.Chain):
    """ResNet-50's block: a 1x1 convolution that reduces the channels (with
    the block's stride), a 3x3 one, a 1x1 one that expands them, batch
    normalization after each, and a shortcut that is the input, or a
    strided 1x1 convolution with batch normalization where the shape
    changes."""

    def __init__(self, in_channels, mid, out_channels, stride):
        super(Bottleneck, self).__init__()
        with self.init_scope():
            self.reduce = L.Convolution2D(in_channels, mid, 1, stride, 0,
                                          nobias=True)
            self.bn_reduce = L.BatchNormalization(mid)
            self.conv = L.Convolution2D(mid, mid, 3, 1, 1, nobias=True)
            self.bn_conv = L.BatchNormalization(mid)
            self.expand = L.Convolution2D(mid, out_channels, 1, 1, 0,
                                          nobias=True)
            self.bn_expand = L.BatchNormalization(out_channels)
            if stride != 1 or in_channels != out_channels:
                self.project = L.Convolution2D(in_channels, out_channels, 1,
                                               stride, 0, nobias=True)
                self.bn_project = L.BatchNormalization(out_channels)

    def forward(self, x):
        h = F.relu(self.bn_reduce(self.reduce(x)))
        h = F.relu(self.bn_conv(self.conv(h)))
        h = self.bn_expand(self.expand(h))
        shortcut = (self.bn_project(self.project(x))
                    if hasattr(self, 'project') else x)
        return F.relu(h + shortcut)


class BottleneckResNet(chainer.Chain):
    """A network of ResNet-50's shape (He et al. 2016, Table 1): a 7x7
    stride-2 convolution and 3x3 max pooling, stages of (3, 4, 6, 3)
    bottleneck blocks of 64, 128, 256 and 512 middle channels (times
    ``width``) expanding four times, the later stages starting with a
    stride of 2; global average pooling and a linear classifier.  At
    width 1, 25.6M parameters for 1000 classes."""

    def __init__(self, n_class=1000, width=1.0, blocks=(3, 4, 6, 3)):
        super(BottleneckResNet, self).__init__()
        base = max(1, int(64 * width))
        with self.init_scope():
            self.stem = L.Convolution2D(3, base, 7, 2, 3, nobias=True)
            self.bn_stem = L.BatchNormalization(base)
            self.stages = chainer.ChainList()
            channels = base
            for k, n in enumerate(blocks):
                mid = base * 2 ** k
                for j in range(n):
                    self.stages.append(Bottleneck(
                        channels, mid, 4 * mid,
                        2 if j == 0 and k > 0 else 1))
                    channels = 4 * mid
            self.fc = L.Linear(channels, n_class)

    def forward(self, x):
        h = F.relu(self.bn_stem(self.stem(x)))
        h = F.max_pooling_2d(h, 3, 2, 1)
        for block in self.stages:
            h = block(h)
        return self.fc(F.average(h, axis=(2, 3)))


def sequence_embed(embed, xs):
    """Embed the sentences ``xs`` in one call: their tokens concatenated,
    then split back into sentences."""
    sections = numpy.cumsum([len(x) for x in xs[:-1]])
    return F.split_axis(embed(F.concat(xs, axis=0)), sections, 0,
                        force_tuple=True)


class Seq2seq(chainer.Chain):
    """The shape of ChainerMN's seq2seq example (written here): the
    sentences concatenated before ``EmbedID``, an ``NStepLSTM`` encoder
    and decoder (dropout), one output projection over every time step, an
    EOS constant (word 0) in the decoder's input and target.
    ``forward(*sentences)`` takes that example's converter's layout (the B
    sources, then the B targets); ``loss(sources, targets)`` two lists."""

    def __init__(self, layers, source_vocab, target_vocab, units,
                 dropout=0.1):
        super(Seq2seq, self).__init__()
        with self.init_scope():
            self.embed_x = L.EmbedID(source_vocab, units)
            self.embed_y = L.EmbedID(target_vocab, units)
            self.encoder = L.NStepLSTM(layers, units, units, dropout)
            self.decoder = L.NStepLSTM(layers, units, units, dropout)
            self.out = L.Linear(units, target_vocab)

    def loss(self, sources, targets):
        sources = [x[::-1] for x in sources]
        eos = self.xp.zeros(1, numpy.int32)
        decoder_in = [F.concat([eos, y], axis=0) for y in targets]
        decoder_out = F.concat([F.concat([y, eos], axis=0)
                                for y in targets], axis=0)
        h, c, _ = self.encoder(None, None,
                               sequence_embed(self.embed_x, sources))
        _, _, outputs = self.decoder(h, c,
                                     sequence_embed(self.embed_y, decoder_in))
        logits = self.out(F.concat(outputs, axis=0))
        loss = F.sum(F.softmax_cross_entropy(logits, decoder_out,
                                             reduce='no')) / len(sources)
        chainer.report({'loss': loss}, self)
        return loss

    def forward(self, *sentences):
        half = len(sentences) // 2
        return self.loss(sentences[:half], sentences[half:])


def sentence_pairs_task(n, vocab, max_length, seed):
    """n (source, target) pairs of a synthetic translation task: a source
    of 2..max_length words from 1..vocab-1 (0 is EOS), its target the
    source reversed with each word w mapped to ``perm[w]``."""
    rng = numpy.random.RandomState(seed)
    perm = numpy.concatenate([[0], 1 + rng.permutation(vocab - 1)])
    pairs = []
    for _ in range(n):
        x = rng.randint(1, vocab, rng.randint(2, max_length + 1))
        pairs.append((x.astype(numpy.int32),
                      perm[x[::-1]].astype(numpy.int32)))
    return pairs



class MultiHeadAttention(chainer.Chain):
    """Scaled dot-product attention with ``heads`` heads (written here, in
    the usual Chainer style): query, key (no bias), value and output
    projections are ``L.Linear`` over ``batch x length`` rows
    (``n_batch_axes=2``);
    the heads' products are ``F.matmul`` of activations, masked with
    ``F.where`` (a constant mask: padding, causality)."""

    def __init__(self, d, heads):
        super(MultiHeadAttention, self).__init__()
        self.heads = heads
        with self.init_scope():
            self.q = L.Linear(d, d)
            # (a key bias shifts every score of a query alike: the
            # softmax gives it no gradient but rounding)
            self.k = L.Linear(d, d, nobias=True)
            self.v = L.Linear(d, d)
            self.o = L.Linear(d, d)

    def forward(self, x, memory, mask):
        """x (B, Tq, d) attends to memory (B, Tk, d) where mask (B, Tq,
        Tk) is True."""
        b, tq, d = x.shape
        tk, h = memory.shape[1], self.heads

        def heads(a, t):  # (B, t, d) -> (B * h, t, d / h)
            a = F.transpose(F.reshape(a, (b, t, h, d // h)), (0, 2, 1, 3))
            return F.reshape(a, (b * h, t, d // h))
        q = heads(self.q(x, n_batch_axes=2), tq)
        k = heads(self.k(memory, n_batch_axes=2), tk)
        v = heads(self.v(memory, n_batch_axes=2), tk)
        scores = F.matmul(q, k, transb=True) * (1.0 / numpy.sqrt(d // h))
        xp = self.xp
        keep = xp.broadcast_to(mask[:, None], (b, h, tq, tk)).reshape(
            b * h, tq, tk)
        scores = F.where(keep, scores,
                         xp.full(scores.shape, -1e9, scores.dtype))
        out = F.matmul(F.softmax(scores, axis=2), v)
        out = F.reshape(F.transpose(F.reshape(out, (b, h, tq, d // h)),
                                    (0, 2, 1, 3)), (b, tq, d))
        return self.o(out, n_batch_axes=2)


class TransformerLayer(chainer.Chain):
    """Post-norm residual blocks: self-attention, cross-attention (a
    decoder layer, ``cross=True``) and a ReLU feed-forward, each followed
    by dropout and ``L.LayerNormalization`` over the ``batch x length``
    rows."""

    def __init__(self, d, heads, cross=False, dropout=0.1):
        super(TransformerLayer, self).__init__()
        self.dropout = dropout
        with self.init_scope():
            self.attend = MultiHeadAttention(d, heads)
            self.norm1 = L.LayerNormalization(d)
            if cross:
                self.cross = MultiHeadAttention(d, heads)
                self.norm2 = L.LayerNormalization(d)
            self.ff1 = L.Linear(d, 4 * d)
            self.ff2 = L.Linear(4 * d, d)
            self.norm3 = L.LayerNormalization(d)

    def _norm(self, norm, x, sub):
        b, t, d = x.shape
        h = x + F.dropout(sub, self.dropout)
        return F.reshape(norm(F.reshape(h, (b * t, d))), (b, t, d))

    def forward(self, x, mask, memory=None, memory_mask=None):
        x = self._norm(self.norm1, x, self.attend(x, x, mask))
        if memory is not None:
            x = self._norm(self.norm2, x,
                           self.cross(x, memory, memory_mask))
        ff = self.ff2(F.relu(self.ff1(x, n_batch_axes=2)), n_batch_axes=2)
        return self._norm(self.norm3, x, ff)


class Transformer(chainer.Chain):
    """An encoder-decoder Transformer in the usual Chainer style (written
    here): padded blocks of token ids (``-1``: padding) of shape (B, T);
    one ``EmbedID`` shared by source, target and the output projection
    (tied: ``F.linear(h, embed.W)``), scaled by sqrt(d), plus a learned
    positional embedding (a parameter of shape (1, max_length, d),
    indexed to the length and added by broadcast); ``layers`` encoder and
    decoder layers; the loss is the cross entropy of the target tokens
    divided by their count (``normalizer``; a fixed number keeps the loss
    a sum of per-example terms, as brute force needs).  Token 0 starts
    the decoder's input."""

    def __init__(self, vocab, d=32, heads=4, layers=2, max_length=16,
                 dropout=0.1):
        super(Transformer, self).__init__()
        self.d = d
        with self.init_scope():
            self.embed = L.EmbedID(vocab, d, ignore_label=-1)
            self.pos = chainer.Parameter(
                chainer.initializers.Normal(0.1), (1, max_length + 1, d))
            self.encoder = chainer.ChainList(*[
                TransformerLayer(d, heads, dropout=dropout)
                for _ in range(layers)])
            self.decoder = chainer.ChainList(*[
                TransformerLayer(d, heads, cross=True, dropout=dropout)
                for _ in range(layers)])

    def _embed(self, ids):
        t = ids.shape[1]
        return self.embed(ids) * numpy.sqrt(self.d) + self.pos[:, :t]

    def loss(self, source, target, normalizer=None):
        xp = self.xp
        b = source.shape[0]
        start = xp.zeros((b, 1), numpy.int32)
        decoder_in = xp.concatenate([start, xp.where(
            target[:, :-1] < 0, 0, target[:, :-1])], axis=1)
        ts, tt = source.shape[1], target.shape[1]
        source_keys = (source >= 0)[:, None, :]
        enc_mask = xp.broadcast_to(source_keys, (b, ts, ts))
        causal = xp.tril(xp.ones((tt, tt), bool))[None]
        dec_mask = xp.broadcast_to(causal, (b, tt, tt))
        mem_mask = xp.broadcast_to(source_keys, (b, tt, ts))
        h = self._embed(source)
        for layer in self.encoder:
            h = layer(h, enc_mask)
        y = self._embed(decoder_in)
        for layer in self.decoder:
            y = layer(y, dec_mask, h, mem_mask)
        logits = F.linear(F.reshape(y, (b * tt, self.d)), self.embed.W)
        token_loss = F.softmax_cross_entropy(
            logits, target.reshape(-1), reduce='no', ignore_label=-1)
        if normalizer is None:
            normalizer = max(1, int((target >= 0).sum()))
        loss = F.sum(token_loss) / normalizer
        chainer.report({'loss': loss}, self)
        return loss

    def forward(self, source, target):
        return self.loss(source, target)


def padded_pairs_task(n, vocab, max_length, seed):
    """(sources, targets) of :func:`sentence_pairs_task` as padded int32
    blocks (n, max_length), ``-1`` after each sentence's end."""
    pairs = sentence_pairs_task(n, vocab, max_length, seed)
    blocks = numpy.full((2, n, max_length), -1, numpy.int32)
    for i, (x, y) in enumerate(pairs):
        blocks[0, i, :len(x)] = x
        blocks[1, i, :len(y)] = y
    return blocks[0], blocks[1]
