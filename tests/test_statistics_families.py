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


# ---- parameters through elementwise functions and broadcasts -----------------

class L2NormScale(chainer.Chain):
    """A detector-style head: channels L2-normalized, then a learned
    per-channel scale, indexed to (1, C, 1, 1) and multiplied by
    broadcast, before a convolution."""

    def __init__(self, c=4):
        super(L2NormScale, self).__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(3, c, 3, pad=1)
            self.scale = chainer.Parameter(
                numpy.linspace(0.5, 2, c).astype(chainer.config.dtype))
            self.head = L.Convolution2D(c, 2, 1)
            self.out = L.Linear(None, 3)

    def forward(self, x):
        h = F.normalize(F.relu(self.conv(x)), axis=1)
        h = h * F.broadcast_to(self.scale[None, :, None, None], h.shape)
        return self.out(self.head(h))


class MaskedConv(chainer.Chain):
    """A pruned convolution: its weight times a constant mask (and a
    constant factor, and a cast), then ``F.convolution_2d``."""

    def __init__(self):
        super(MaskedConv, self).__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(3, 4, 3)
            self.out = L.Linear(None, 3)
        rng = numpy.random.default_rng(3)
        self.mask = (rng.uniform(size=(4, 3, 3, 3)) > 0.4).astype(
            chainer.config.dtype)

    def forward(self, x):
        w = F.cast(self.conv.W * self.mask * 0.5, x.dtype)
        h = F.convolution_2d(x, w, self.conv.b)
        return self.out(F.relu(h))


class Binarize(chainer.FunctionNode):
    """A user's binarizing function with a straight-through backward
    (gradient 1 where |w| <= 1), declared elementwise."""

    is_elementwise = True

    def forward(self, inputs):
        self.retain_inputs((0,))
        (w,) = inputs
        xp = chainer.backend.get_array_module(w)
        return xp.where(w >= 0, 1, -1).astype(w.dtype),

    def backward(self, indexes, grad_outputs):
        (w,) = self.get_retained_inputs()
        keep = (abs(w.array) <= 1).astype(w.dtype)
        return grad_outputs[0] * keep,


class BinaryLinear(chainer.Chain):
    def __init__(self):
        super(BinaryLinear, self).__init__()
        with self.init_scope():
            self.lin = L.Linear(4, 5)
            self.out = L.Linear(5, 3)
        self.lin.W.array[0, 0] = 3.0  # outside the straight-through range

    def forward(self, x):
        w = Binarize().apply((self.lin.W,))[0]
        return self.out(F.tanh(F.linear(x, w, self.lin.b)))


class BroadcastFamily(chainer.Chain):
    """L.Scale and L.Bias (with their own W and b), PReLU, and a learned
    positional embedding added by broadcast to (B, T, C) tokens."""

    def __init__(self, t=3, c=4):
        super(BroadcastFamily, self).__init__()
        with self.init_scope():
            self.inp = L.Linear(2, c)
            self.pos = chainer.Parameter(numpy.linspace(
                -1, 1, t * c).reshape(1, t, c).astype(chainer.config.dtype))
            self.scale = L.Scale(axis=1, W_shape=(c,), bias_term=True)
            self.bias = L.Bias(axis=1, shape=(c,))
            self.prelu = L.PReLU((c,))
            self.out = L.Linear(None, 3)
        self.t, self.c = t, c

    def forward(self, x):
        b = x.shape[0]
        h = F.reshape(self.inp(F.reshape(x, (b * self.t, 2))),
                      (b, self.t, self.c))
        h = h + self.pos
        h = F.reshape(h, (b * self.t, self.c))
        h = self.prelu(self.bias(self.scale(h)) - 0.3)
        return self.out(F.reshape(h, (b, -1)))


def test_a_per_channel_scale_through_an_index_and_a_broadcast(dtype):
    rng = numpy.random.default_rng(21)
    numpy.random.seed(21)
    model = L2NormScale()
    x = _data(rng, dtype, 4, 3, 5, 5)
    t = rng.integers(0, 3, 4).astype(numpy.int32)
    got = check(model, _cross_entropy(model), (x, t), dtype)
    assert got[[n for n, _ in model.namedparams()].index('/scale')].any()


def test_a_masked_convolution_weight(dtype):
    rng = numpy.random.default_rng(22)
    numpy.random.seed(22)
    model = MaskedConv()
    x = _data(rng, dtype, 4, 3, 6, 6)
    t = rng.integers(0, 3, 4).astype(numpy.int32)
    got = check(model, _cross_entropy(model), (x, t), dtype)
    w = got[[n for n, _ in model.namedparams()].index('/conv/W')]
    assert (w[model.mask == 0] == 0).all() and w[model.mask == 1].all()


def test_a_users_elementwise_function_of_a_weight(dtype):
    rng = numpy.random.default_rng(23)
    numpy.random.seed(23)
    model = BinaryLinear()
    x = _data(rng, dtype, 5, 4)
    t = rng.integers(0, 3, 5).astype(numpy.int32)
    got = check(model, _cross_entropy(model), (x, t), dtype)
    w = got[[n for n, _ in model.namedparams()].index('/lin/W')]
    assert w[0, 0] == 0 and w.any()


def test_scale_bias_prelu_and_a_positional_embedding(dtype):
    rng = numpy.random.default_rng(24)
    numpy.random.seed(24)
    model = BroadcastFamily()
    model.prelu.W.array[...] = rng.uniform(0.1, 0.5, 4)
    x = _data(rng, dtype, 5, 3, 2)
    t = rng.integers(0, 3, 5).astype(numpy.int32)
    got = check(model, _cross_entropy(model), (x, t), dtype)
    names = [n for n, _ in model.namedparams()]
    for name in ('/pos', '/scale/W', '/scale/bias/b', '/bias/b',
                 '/prelu/W'):
        assert got[names.index(name)].any(), name


class Coupled(chainer.Chain):
    """A weight used by a matrix product over the rows (attention-like
    mixing of the batch): truly couples examples."""

    def __init__(self):
        super(Coupled, self).__init__()
        with self.init_scope():
            self.w = chainer.Parameter(numpy.ones((3, 3), numpy.float32))

    def forward(self, x):
        return F.sum(F.matmul(F.matmul(x, x, transb=True), x) * 1.0
                     + F.matmul(x, self.w) * 2.0)


def test_what_couples_examples_is_still_refused():
    rng = numpy.random.default_rng(25)
    model = Coupled()
    x = _data(rng, numpy.float32, 4, 3)
    with pytest.raises(UncoveredParameterError, match='MatMul'):
        PerSampleSquares(model).backward(model(x), batch=(x,))


# ---- a Transformer encoder-decoder --------------------------------------------

def test_transformer_encoder_decoder_every_parameter_exact():
    """Every parameter of a Transformer (written here: padded blocks,
    Linear over batch x length rows, LayerNorm, a tied embedding used by
    EmbedID and by the output projection, a positional embedding added by
    broadcast, the loss divided by the token count) against brute force,
    with dropout off; with dropout on, the statistics run without a
    refusal."""
    from chainer_vgc.harness.models import Transformer
    from chainer_vgc.harness.models import padded_pairs_task
    with chainer.using_config('dtype', numpy.float64):
        numpy.random.seed(31)
        model = Transformer(9, d=8, heads=2, layers=1, max_length=5)
    source, target = padded_pairs_task(4, 9, 5, seed=3)
    assert (source < 0).any() and (target < 0).any()  # padding in both
    count = int((target >= 0).sum())

    def loss_fn(s, t):
        # the batch's token count, fixed: the mean over the examples of
        # this on each example alone is the batch's loss (brute force)
        return model.loss(s, t, normalizer=count * len(s) / len(source))
    with chainer.using_config('train', False):
        got = check(model, loss_fn, (source, target), numpy.float64)
    names = [n for n, _ in model.namedparams()]
    assert len(names) > 30 and all(g is not None for g in got)
    for name in ('/embed/W', '/pos', '/encoder/0/norm1/gamma',
                 '/decoder/0/cross/q/W'):
        assert got[names.index(name)].any(), name
    with chainer.using_config('train', True):
        model.cleargrads()
        PerSampleSquares(model).backward(loss_fn(source, target),
                                         batch=(source, target))


def test_batch_renormalization_slices_against_numpy(dtype):
    """BatchRenormalization in training couples the examples as BN does;
    its per-example contribution is the example's slice of the batch
    gradient, here recomputed with NumPy from the definition (x_hat from
    the batch statistics, r and d clipped against the running ones taken
    before the update), and the slices add up to Chainer's gradient."""
    rng = numpy.random.default_rng(16)
    brn = L.BatchRenormalization(3, rmax=1.5, dmax=0.5)
    brn.avg_mean[...] = rng.normal(0, 0.5, 3)
    brn.avg_var[...] = rng.uniform(0.5, 2, 3)
    brn.gamma.array[...] = rng.normal(1, 0.3, 3)
    x = _data(rng, dtype, 6, 3, 4, 4)
    w = _data(rng, dtype, 6, 3, 4, 4)
    mean, var = brn.avg_mean.copy(), brn.avg_var.copy()
    brn.cleargrads()  # (a Parameter's first grad is NaN-filled)
    with chainer.using_config('train', True):
        got = PerSampleSquares([('gamma', brn.gamma), ('beta', brn.beta)],
                               batch_size=6).backward(F.sum(brn(x) * w) / 6)
    mu = x.mean(axis=(0, 2, 3))
    std = numpy.sqrt(x.var(axis=(0, 2, 3)) + brn.eps)
    sigma = numpy.sqrt(var + brn.eps)
    r = numpy.clip(std / sigma, 1 / 1.5, 1.5)
    d = numpy.clip((mu - mean) / sigma, -0.5, 0.5)
    e = (None, slice(None), None, None)
    hat = (x - mu[e]) / std[e] * r[e] + d[e]
    gamma_z = (w / 6 * hat).sum(axis=(2, 3))
    beta_z = (w / 6).sum(axis=(2, 3))
    rtol = 1e-9 if dtype == numpy.float64 else 1e-4
    numpy.testing.assert_allclose(gamma_z.sum(axis=0), brn.gamma.grad,
                                  rtol=rtol)
    numpy.testing.assert_allclose(got[0], (gamma_z ** 2).sum(axis=0),
                                  rtol=rtol)
    numpy.testing.assert_allclose(got[1], (beta_z ** 2).sum(axis=0),
                                  rtol=rtol)


class IndexedWeight(chainer.Chain):
    """A weight through a transpose with negative axes, an index whose
    advanced entries are split by a slice (numpy moves those axes first),
    or a basic index (a view: slices, a reversed one, None, an int,
    Ellipsis), then multiplied into the batch by broadcast."""

    def __init__(self, kind):
        super(IndexedWeight, self).__init__()
        self.kind = kind
        with self.init_scope():
            self.w = chainer.Parameter(numpy.linspace(
                -1, 1, 24).reshape(2, 3, 4).astype(chainer.config.dtype))

    def forward(self, x):
        if self.kind == 'transpose':
            s = F.transpose(self.w, (0, -1, 1))  # (2, 4, 3)
        elif self.kind == 'split':
            s = self.w[1, :, [0, 2]]  # (2, 3): the advanced axis first
        elif self.kind == 'basic':  # a view: placed for all examples
            s = self.w[::-1, None, 1:, -1]  # (2, 1, 2)
        elif self.kind == 'ellipsis':
            s = self.w[..., 1::2]  # (2, 3, 2)
        else:
            s = self.w[[0, 1, 1, 0, 1], :, [1, 1, 0, 2, 2]]  # (5, 3)
        return F.sum(F.tanh(x * F.broadcast_to(s, x.shape)),
                     axis=tuple(range(1, x.ndim)))


@pytest.mark.parametrize('kind,shape', [('transpose', (4, 3)),
                                        ('split', (3,)),
                                        ('repeated', (3,)),
                                        ('basic', (1, 2)),
                                        ('ellipsis', (3, 2))])
@pytest.mark.parametrize('b', [2, 3, 5])
def test_transposes_and_split_advanced_indices_of_a_weight(kind, shape, b):
    rng = numpy.random.default_rng(26)
    with chainer.using_config('dtype', numpy.float64):
        model = IndexedWeight(kind)
        lead = {'transpose': (2,), 'split': (2,), 'repeated': (5,),
                'basic': (2,), 'ellipsis': (2,)}[kind]
        x = rng.normal(size=(b,) + lead + shape)
        t = rng.normal(size=(b,))
        check(model, lambda x, t: F.mean_squared_error(model(x), t),
              (x, t), numpy.float64)


def test_small_uses_squared_after_the_pass_give_the_same_bits(monkeypatch):
    """The single uses whose arrays are small wait for the end of the
    backward pass (hook.DEFER_BYTES): the sums are the very bits of
    squaring each use at once, and the arrays kept never exceed the bound
    (a bound of a few uses defers those and squares the rest at once)."""
    from chainer_vgc.harness.models import Transformer
    from chainer_vgc.harness.models import padded_pairs_task
    from chainer_vgc.statistics import hook
    numpy.random.seed(32)
    model = Transformer(9, d=8, heads=2, layers=1, max_length=5)
    source, target = padded_pairs_task(4, 9, 5, seed=4)
    kept = []
    real = hook._Pass.defer

    def defer(self, *args):
        taken = real(self, *args)
        kept.append((taken, self.deferred_bytes, self.defer_bytes))
        return taken

    monkeypatch.setattr(hook._Pass, 'defer', defer)
    runs = {}
    for bound in (0, 3000, hook.DEFER_BYTES):
        monkeypatch.setattr(hook, 'DEFER_BYTES', bound)
        del kept[:]
        model.cleargrads()
        with chainer.using_config('train', False):
            loss = model(source, target)
        runs[bound] = [None if s is None else s.copy() for s in
                       PerSampleSquares(model).backward(
                           loss, batch=(source, target))]
        assert all(held <= limit for _, held, limit in kept)
        runs[bound, 'deferred'] = sum(t for t, _, _ in kept)
    assert runs[0, 'deferred'] == 0
    assert 0 < runs[3000, 'deferred'] < runs[hook.DEFER_BYTES, 'deferred']
    for bound in (3000, hook.DEFER_BYTES):
        for got, want in zip(runs[bound], runs[0]):
            numpy.testing.assert_array_equal(got, want)


class PooledSum(chainer.Chain):
    """A Linear's output added to an average pooling with
    ``pad_value=None``, whose backward divides its own output gradient in
    place: Add hands that same array to the Linear, whose use, kept for
    the pass's end (or, applied twice, for its second use), must not see
    the division."""

    def __init__(self, twice):
        super(PooledSum, self).__init__()
        self.twice = twice
        with self.init_scope():
            self.lin = L.Linear(3, 5)

    def forward(self, x, x2):
        h = self.lin(x)
        if self.twice:
            h = h + self.lin(F.tanh(x))
        # (a variable that needs its gradient, so that the pooling's
        # backward runs, as over a layer's activations)
        pooled = F.average_pooling_nd(chainer.Variable(x2), 2,
                                      pad_value=None)
        y = h + F.reshape(pooled, h.shape)
        return F.sum(y * y) / len(x)


@pytest.mark.parametrize('twice', [False, True])
def test_uses_kept_past_their_node_own_their_output_gradient(dtype, twice):
    rng = numpy.random.default_rng(33)
    numpy.random.seed(33)
    model = PooledSum(twice)
    x, x2 = _data(rng, dtype, 4, 3), _data(rng, dtype, 4, 5, 2)
    got = check(model, model, (x, x2), dtype)
    assert all(g is not None and g.any() for g in got)
