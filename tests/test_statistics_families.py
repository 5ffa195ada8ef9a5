"""PerSampleSquares against brute force (one backward per example, noise
off) for the parameter families of issue 49: normalizations that couple no
examples (LayerNorm over tokens, GroupNorm, batch normalization with fixed
statistics), parameters used through elementwise functions and broadcasts,
and rows that come from constant arrays.  The models are written here."""

import chainer
import chainer.functions as F
import chainer.links as L
import numpy
import pytest

from chainer_vgc.statistics import PerSampleSquares
from chainer_vgc.statistics import UncoveredParameterError
from test_statistics import _data
from test_statistics import check

pytestmark = pytest.mark.stack


@pytest.fixture(params=[numpy.float64, numpy.float32])
def dtype(request):
    with chainer.using_config('dtype', request.param):
        yield request.param


def _cross_entropy(model):
    return lambda x, t: F.softmax_cross_entropy(model(x), t)


# ---- normalizations that couple no examples -----------------------------------

class TokenNorm(chainer.Chain):
    """(B, T, C) tokens through Linear and LayerNorm over ``B * T`` rows,
    then a per-example readout: the rows of every covered function are B
    groups of T tokens."""

    def __init__(self, c=5, t=3, n_out=3):
        super(TokenNorm, self).__init__()
        self.t = t
        with self.init_scope():
            self.inp = L.Linear(4, c)
            self.norm = L.LayerNormalization(c)
            self.out = L.Linear(c * t, n_out)

    def forward(self, x):
        b = x.shape[0]
        h = self.inp(F.reshape(x, (b * self.t, 4)))
        h = F.tanh(self.norm(h))
        return self.out(F.reshape(h, (b, -1)))


def test_layer_normalization_over_tokens(dtype):
    rng = numpy.random.default_rng(11)
    numpy.random.seed(11)
    model = TokenNorm()
    # gamma and beta away from 1 and 0, so that both are exercised
    model.norm.gamma.array[...] = rng.normal(1, 0.5, 5)
    model.norm.beta.array[...] = rng.normal(0, 0.5, 5)
    x = _data(rng, dtype, 5, 3, 4)
    t = rng.integers(0, 3, 5).astype(numpy.int32)
    got = check(model, _cross_entropy(model), (x, t), dtype)
    assert all(g is not None and g.any() for g in got)


class GroupNormNet(chainer.Chain):
    def __init__(self, groups=2):
        super(GroupNormNet, self).__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(3, 4, 3, pad=1)
            self.norm = L.GroupNormalization(groups, 4)
            self.out = L.Linear(None, 3)

    def forward(self, x):
        return self.out(F.relu(self.norm(self.conv(x))))


def test_group_normalization(dtype):
    rng = numpy.random.default_rng(12)
    numpy.random.seed(12)
    model = GroupNormNet()
    model.norm.gamma.array[...] = rng.normal(1, 0.5, 4)
    x = _data(rng, dtype, 4, 3, 5, 5)
    t = rng.integers(0, 3, 4).astype(numpy.int32)
    check(model, _cross_entropy(model), (x, t), dtype)


class FrozenBNNet(chainer.Chain):
    def __init__(self):
        super(FrozenBNNet, self).__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(3, 4, 3)
            self.bn = L.BatchNormalization(4)
            self.out = L.Linear(None, 3)

    def forward(self, x):
        return self.out(F.relu(self.bn(self.conv(x))))


def test_batch_normalization_with_fixed_statistics(dtype):
    """Fine-tuning with frozen statistics: BN in test mode, or
    ``finetune``-free ``config.train=False``, normalizes with the running
    averages; the examples are not coupled and brute force applies."""
    rng = numpy.random.default_rng(13)
    numpy.random.seed(13)
    model = FrozenBNNet()
    model.bn.avg_mean[...] = rng.normal(0, 0.3, 4)
    model.bn.avg_var[...] = rng.uniform(0.5, 2, 4)
    model.bn.gamma.array[...] = rng.normal(1, 0.5, 4)
    x = _data(rng, dtype, 4, 3, 5, 5)
    t = rng.integers(0, 3, 4).astype(numpy.int32)
    with chainer.using_config('train', False):
        check(model, _cross_entropy(model), (x, t), dtype)


# ---- rows from constant arrays ----------------------------------------------

class ZeroStateRNN(chainer.Chain):
    """An LSTM cell unrolled over T steps whose initial state is a constant
    array (``xp.zeros((B, n))``, as users write it) fed to the lateral
    Linear, and a learned non-zero constant start (``ones``) too."""

    def __init__(self, n=4, start=0.0):
        super(ZeroStateRNN, self).__init__()
        self.n, self.start = n, start
        with self.init_scope():
            self.up = L.Linear(3, 4 * n)
            self.lateral = L.Linear(n, 4 * n, nobias=True)
            self.out = L.Linear(n, 3)

    def forward(self, xs):
        b = xs.shape[0]
        h = self.xp.full((b, self.n), self.start, dtype=xs.dtype)
        c = self.xp.zeros((b, self.n), dtype=xs.dtype)
        for t in range(xs.shape[1]):
            c, h = F.lstm(c, self.up(xs[:, t]) + self.lateral(h))
        return self.out(h)


@pytest.mark.parametrize('start', [0.0, 0.5])
def test_lstm_with_a_constant_initial_state(dtype, start):
    rng = numpy.random.default_rng(14)
    numpy.random.seed(14)
    model = ZeroStateRNN(start=start)
    x = _data(rng, dtype, 5, 3, 3)
    t = rng.integers(0, 3, 5).astype(numpy.int32)
    got = check(model, _cross_entropy(model), (x, t), dtype)
    assert got[[n for n, _ in model.namedparams()].index(
        '/lateral/W')].any()


def test_constant_rows_combined_with_no_examples_are_refused():
    """A constant table through Linear whose output meets the minibatch only
    through a reduction over the batch: neither side says whose rows they
    are."""
    rng = numpy.random.default_rng(15)
    lin = L.Linear(3, 2)
    x = _data(rng, numpy.float32, 4, 3)
    table = _data(rng, numpy.float32, 4, 3)
    summed = F.broadcast_to(F.sum(lin(x)), (4, 2))
    with pytest.raises(ValueError, match='constant array'):
        PerSampleSquares(lin).backward(F.sum(lin(table) + summed),
                                       batch=(x,))
    with pytest.raises(ValueError, match='constant array'):
        PerSampleSquares(lin).backward(F.sum(lin(table) * F.sum(lin(x))),
                                       batch=(x,))
    assert UncoveredParameterError  # (the error type of uncovered uses)
