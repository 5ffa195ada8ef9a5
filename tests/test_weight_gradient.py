"""chainer_vgc.statistics.weight_gradient (issue 38, part 5): on the CPU a
convolution whose statistics form every example's weight gradient takes
Chainer's batch gradient from those products.  Which weights do (and which
must not), the gradient against Chainer's and against a sum of per-example
gradients by brute force, the sums unchanged bit for bit, and Chainer's own
function restored whatever happens."""

import chainer
from chainer.functions.connection import convolution_2d as conv_module
import chainer.functions as F
import chainer.links as L
import numpy
import pytest

from chainer_vgc.statistics import PerSampleSquares

# the gradient's arithmetic is NumPy's
pytestmark = pytest.mark.stack


class Net(chainer.Chain):
    """c1: 3x3 on 8x8 (64 positions: blocked, fused); c2: stride 4 to 2x2
    (4 positions: Gram, not fused); c3 applied twice (shared: not fused)."""

    def __init__(self):
        super(Net, self).__init__()
        with self.init_scope():
            self.c1 = L.Convolution2D(3, 5, 3, pad=1)
            self.c2 = L.Convolution2D(5, 4, 4, stride=4)
            self.c3 = L.Convolution2D(5, 5, 3, pad=1)
            self.out = L.Linear(None, 3)

    def forward(self, x):
        h = F.relu(self.c1(x))
        h = F.relu(self.c3(F.relu(self.c3(h)))) + h
        return self.out(F.relu(self.c2(h)))


def _step(model, x, t, **kw):
    model.cleargrads()
    hook = PerSampleSquares(model, **kw)
    sums = hook.backward(F.softmax_cross_entropy(model(x), t), batch=(x, t))
    return (hook, [None if s is None else s.copy() for s in sums],
            {n: p.grad.copy() for n, p in model.namedparams()})


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
def test_which_weights_and_their_gradient(dtype):
    rng = numpy.random.default_rng(3)
    with chainer.using_config('dtype', dtype):
        numpy.random.seed(3)
        model = Net()
        x = rng.normal(size=(6, 3, 8, 8)).astype(dtype)
        t = rng.integers(0, 3, 6).astype(numpy.int32)
        hook, sums, grads = _step(model, x, t)
        _, exact_sums, exact = _step(model, x, t, fused_weight_gradient=False)
        model.cleargrads()
        F.softmax_cross_entropy(model(x), t).backward()
        plain = {n: p.grad.copy() for n, p in model.namedparams()}
        # brute force: the sum of every example's own gradient
        brute = {n: numpy.zeros_like(g) for n, g in plain.items()}
        for z in range(6):
            model.cleargrads()
            (F.softmax_cross_entropy(model(x[z:z + 1]), t[z:z + 1]) / 6
             ).backward()
            for n, p in model.namedparams():
                brute[n] += p.grad
    assert {hook.names[i] for i in hook._fused.done} == {'/c1/W'}
    assert hook._fused._marked == {}  # nothing held after the pass
    for a, b in zip(sums, exact_sums):
        numpy.testing.assert_array_equal(a, b)
    eps = numpy.finfo(dtype).eps
    for n in plain:
        numpy.testing.assert_array_equal(exact[n], plain[n], err_msg=n)
        if n == '/c1/W':
            scale = abs(plain[n]).max()
            assert not numpy.array_equal(grads[n], numpy.zeros_like(
                grads[n]))
            numpy.testing.assert_allclose(grads[n], plain[n], rtol=0,
                                          atol=64 * eps * scale)
            numpy.testing.assert_allclose(grads[n], brute[n], rtol=0,
                                          atol=256 * eps * scale)
        else:
            numpy.testing.assert_array_equal(grads[n], plain[n], err_msg=n)
    assert conv_module.Convolution2DGradW.forward_cpu is ORIGINAL


ORIGINAL = conv_module.Convolution2DGradW.forward_cpu


def test_float16_weights_keep_chainers_gradient():
    """The statistics of float16 weights are float32: the gradient stays
    Chainer's float16 one."""
    rng = numpy.random.default_rng(4)
    with chainer.using_config('dtype', numpy.float16):
        numpy.random.seed(4)
        model = Net()
        x = rng.normal(size=(4, 3, 8, 8)).astype(numpy.float16)
        t = rng.integers(0, 3, 4).astype(numpy.int32)
        hook, _, _ = _step(model, x, t)
    assert hook._fused.done == set()


def test_chainers_function_is_restored_after_an_error():
    rng = numpy.random.default_rng(6)
    model = Net()
    x = rng.normal(size=(4, 3, 8, 8)).astype(numpy.float32)
    t = rng.integers(0, 3, 4).astype(numpy.int32)
    hook = PerSampleSquares(model)
    loss = F.softmax_cross_entropy(model(x), t)

    def fail(*args, **kwargs):
        raise RuntimeError('planted')
    import chainer_vgc.statistics.contraction as contraction
    original = contraction.sum_squared_products
    contraction.sum_squared_products = fail
    try:
        with pytest.raises(RuntimeError, match='planted'):
            hook.backward(loss, batch=(x, t))
    finally:
        contraction.sum_squared_products = original
    assert conv_module.Convolution2DGradW.forward_cpu is ORIGINAL
    assert not hook._fused.active


class Options(chainer.Chain):
    """One convolution (``F.convolution_2d``, which takes ``cover_all``)
    with the options of a case, on ``rows`` rows per example (the
    example's rows stacked on the batch axis and summed back after the
    layer)."""

    def __init__(self, rows, groups=1, nobias=False, **conv):
        super(Options, self).__init__()
        self.rows, self.groups, self.conv = rows, groups, conv
        with self.init_scope():
            self.W = chainer.Parameter(chainer.initializers.Normal(0.3),
                                       (6, 4 // groups, 3, 3))
            self.b = None if nobias else chainer.Parameter(0.1, (6,))
            self.out = L.Linear(None, 3)

    def forward(self, x):
        b = x.shape[0]
        h = F.convolution_2d(F.reshape(x, (b * self.rows,) + x.shape[2:]),
                             self.W, self.b, groups=self.groups, **self.conv)
        h = F.sum(F.reshape(h, (b, self.rows) + h.shape[1:]), axis=1)
        return self.out(F.tanh(h))


@pytest.mark.parametrize('rows, conv, max_memory', [
    (1, dict(stride=2, pad=1, dilate=2, groups=2), 2 ** 26),
    (1, dict(stride=3, pad=0, cover_all=True), 2 ** 26),
    (1, dict(pad=1, nobias=True), 3000),         # a chunk of one example
    (3, dict(pad=1), 2 ** 26),                   # 3 rows per example
    (2, dict(stride=2, groups=2, dilate=2), 5000),
])
def test_options_chunks_and_rows_per_example(rows, conv, max_memory):
    """Stride, padding, dilation, groups, cover_all, chunks of the batch
    under a small max_memory, several rows per example: the fused gradient
    equals Chainer's to rounding and the sums are the unfused ones bit for
    bit (float64)."""
    rng = numpy.random.default_rng(7)
    with chainer.using_config('dtype', numpy.float64):
        numpy.random.seed(7)
        model = Options(rows, **conv)
        x = rng.normal(size=(5, rows, 4, 11, 11))
        t = rng.integers(0, 3, 5).astype(numpy.int32)
        hook, sums, grads = _step(model, x, t, max_memory=max_memory)
        _, exact_sums, _ = _step(model, x, t, max_memory=max_memory,
                                 fused_weight_gradient=False)
        model.cleargrads()
        F.softmax_cross_entropy(model(x), t).backward()
    assert {hook.names[i] for i in hook._fused.done} == {'/W'}
    for a, b in zip(sums, exact_sums):
        numpy.testing.assert_array_equal(a, b)
    for n, p in model.namedparams():
        scale = abs(p.grad).max()
        numpy.testing.assert_allclose(grads[n], p.grad, rtol=0,
                                      atol=64 * numpy.finfo(float).eps * scale,
                                      err_msg=n)


def test_an_input_of_another_dtype_keeps_chainers_gradient():
    """Chainer computes the weight gradient in its input's dtype; the
    products are in the weight's: with a float64 input to a float32 weight
    the gradient stays Chainer's, and the done set of the last pass does
    not outlive the next one."""
    rng = numpy.random.default_rng(8)
    model = chainer.Chain()
    with model.init_scope():
        model.W = chainer.Parameter(
            rng.normal(size=(6, 3, 3, 3)).astype(numpy.float32))
    x = rng.normal(size=(4, 3, 9, 9))
    hook = PerSampleSquares(model, batch_size=4)
    hook.backward(F.sum(F.convolution_2d(x, model.W, pad=1) ** 2))
    assert hook._fused.done == set()
    model.cleargrads()
    hook.backward(F.sum(F.convolution_2d(x.astype(numpy.float32), model.W,
                                         pad=1) ** 2))
    assert hook._fused.done == {0}
    model.cleargrads()
    hook.fused_weight_gradient = False
    hook.backward(F.sum(F.convolution_2d(x.astype(numpy.float32), model.W,
                                         pad=1) ** 2))
    assert hook._fused.done == set()
