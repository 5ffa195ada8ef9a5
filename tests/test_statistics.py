"""PerSampleSquares against brute force (one backward per example) and, for
batch-coupled models, against per-example slices of the batch backward
computed with Chainer's own functions."""

import chainer
import chainer.functions as F
import chainer.links as L
import numpy
import pytest
from hypothesis import given
from hypothesis import strategies as st

from chainer_vgc.harness.models import MLP
from chainer_vgc.harness.models import VGG
from chainer_vgc.statistics import PerSampleSquares
from chainer_vgc.statistics import UncoveredParameterError
from chainer_vgc.statistics import bruteforce_sqsum
from chainer_vgc.statistics import model_params
import reference

# on both stacks (make test): its results depend on NumPy, the native
# build or the installed packages (docs/contributing.md)
pytestmark = pytest.mark.stack

RTOL = {numpy.float64: 1e-5, numpy.float32: 1e-3}


def check(model, loss_fn, batch, dtype, **kw):
    """Component vs brute force; also checks grads are the plain ones:
    bit for bit with ``fused_weight_gradient=False``, and by default for
    every parameter but the convolution weights whose gradient came from
    the statistics' products (to rounding there); the sums are the same
    bit for bit either way.  Returns the sums."""
    names, params = model_params(model)
    want = bruteforce_sqsum(loss_fn, params, *batch)
    model.cleargrads()
    loss_fn(*batch).backward()
    plain = [None if p.grad is None else p.grad.copy() for p in params]
    runs = []
    for fused in (True, False):
        model.cleargrads()
        hook = PerSampleSquares(model, fused_weight_gradient=fused, **kw)
        got = hook.backward(loss_fn(*batch), loss_fn=loss_fn, batch=batch)
        runs.append((got, [None if p.grad is None else p.grad.copy()
                           for p in params], set(hook._fused.done)))
    (got, grads, fused), (unfused, exact, none) = runs
    assert none == set()
    for i, (name, p, g, w, pg) in enumerate(zip(names, params, got, want,
                                                plain)):
        if w is None:
            assert g is None and unfused[i] is None, name
            continue
        assert g.shape == p.shape and g.dtype == w.dtype, name
        numpy.testing.assert_allclose(g, w, rtol=RTOL[dtype],
                                      atol=RTOL[dtype] * abs(w).max() * 1e-3,
                                      err_msg=name)
        numpy.testing.assert_array_equal(g, unfused[i], err_msg=name)
        numpy.testing.assert_array_equal(exact[i], pg, err_msg=name)
        if i in fused:
            eps = numpy.finfo(dtype).eps
            numpy.testing.assert_allclose(
                grads[i], pg, rtol=0, atol=64 * eps * abs(pg).max(),
                err_msg=name)
        else:
            numpy.testing.assert_array_equal(grads[i], pg, err_msg=name)
    return got


@pytest.fixture(params=[numpy.float64, numpy.float32])
def dtype(request):
    with chainer.using_config('dtype', request.param):
        yield request.param


def _data(rng, dtype, b, *shape):
    return rng.normal(size=(b,) + shape).astype(dtype)


# ---- models without batch coupling: brute force oracle ------------------------

@given(b=st.integers(1, 6), n_in=st.integers(1, 6),
       hidden=st.lists(st.integers(1, 7), min_size=1, max_size=2),
       seed=st.integers(0, 1000))
def test_mlp(b, n_in, hidden, seed):
    rng = numpy.random.default_rng(seed)
    with chainer.using_config('dtype', numpy.float64):
        numpy.random.seed(seed)
        model = MLP(hidden, 3)
        x = _data(rng, numpy.float64, b, n_in)
        t = rng.integers(0, 3, b).astype(numpy.int32)
        check(model, lambda x, t: F.softmax_cross_entropy(model(x), t),
              (x, t), numpy.float64)


class ConvNet(chainer.Chain):
    def __init__(self, stride, pad, dilate, groups, nobias):
        super(ConvNet, self).__init__()
        with self.init_scope():
            self.c1 = L.Convolution2D(4, 6, 3, stride=stride, pad=pad,
                                      dilate=dilate, groups=groups,
                                      nobias=nobias)
            self.c2 = L.Convolution2D(6, 4, (2, 3), pad=(pad, 1),
                                      groups=groups)
            self.d1 = L.Deconvolution2D(4, 6, 3, stride=stride, pad=pad,
                                        groups=groups, nobias=nobias)
            self.d2 = L.Deconvolution2D(6, 2, 2, stride=(1, 2),
                                        dilate=dilate)
            self.out = L.Linear(None, 3)

    def forward(self, x):
        h = F.relu(self.c2(F.relu(self.c1(x))))
        h = F.tanh(self.d2(F.relu(self.d1(h))))
        return self.out(h)


@given(b=st.integers(1, 4), stride=st.integers(1, 2), pad=st.integers(0, 2),
       dilate=st.integers(1, 2), groups=st.sampled_from([1, 2]),
       nobias=st.booleans(), size=st.integers(7, 10),
       seed=st.integers(0, 1000))
def test_convolution_and_deconvolution_options(b, stride, pad, dilate,
                                               groups, nobias, size, seed):
    rng = numpy.random.default_rng(seed)
    with chainer.using_config('dtype', numpy.float64):
        numpy.random.seed(seed)
        model = ConvNet(stride, pad, dilate, groups, nobias)
        x = _data(rng, numpy.float64, b, 4, size, size)
        t = rng.integers(0, 3, b).astype(numpy.int32)
        check(model, lambda x, t: F.softmax_cross_entropy(model(x), t),
              (x, t), numpy.float64)


def test_cnn_float32(dtype):
    rng = numpy.random.default_rng(0)
    numpy.random.seed(0)
    model = ConvNet(2, 1, 2, 2, False)
    x = _data(rng, dtype, 5, 4, 9, 9)
    t = rng.integers(0, 3, 5).astype(numpy.int32)
    check(model, lambda x, t: F.softmax_cross_entropy(model(x), t), (x, t),
          dtype)


class EmbedNet(chainer.Chain):
    def __init__(self, vocab, dim, ignore_label):
        super(EmbedNet, self).__init__()
        with self.init_scope():
            self.embed = L.EmbedID(vocab, dim, ignore_label=ignore_label)
            self.out = L.Linear(dim, 3)

    def forward(self, ids):
        return self.out(F.sum(self.embed(ids), axis=1))


@pytest.mark.parametrize('ignore_label', [None, -1])
def test_embed_id_with_repeated_tokens(dtype, ignore_label):
    rng = numpy.random.default_rng(1)
    numpy.random.seed(1)
    model = EmbedNet(7, 4, ignore_label)
    ids = rng.integers(0, 7, (6, 5)).astype(numpy.int32)
    ids[:, 1] = ids[:, 0]  # the same word twice in an example
    if ignore_label is not None:
        ids[::2, 3] = ignore_label
    t = rng.integers(0, 3, 6).astype(numpy.int32)
    check(model, lambda i, t: F.softmax_cross_entropy(model(i), t),
          (ids, t), dtype)


class SharedNet(chainer.Chain):
    """RNN-style reuse: the recurrent Linear is applied T times; the
    embedding matrix is also the output layer (tied weights)."""

    def __init__(self, vocab=6, dim=4):
        super(SharedNet, self).__init__()
        with self.init_scope():
            self.embed = L.EmbedID(vocab, dim)
            self.rec = L.Linear(dim, dim)
            self.inp = L.Linear(dim, dim, nobias=True)

    def forward(self, ids):
        h = None
        for t in range(ids.shape[1]):
            e = self.inp(self.embed(ids[:, t]))
            h = F.tanh(e if h is None else e + self.rec(h))
        return F.linear(h, self.embed.W)


def test_shared_weights_add_before_squaring(dtype):
    rng = numpy.random.default_rng(2)
    numpy.random.seed(2)
    model = SharedNet()
    ids = rng.integers(0, 6, (5, 4)).astype(numpy.int32)
    t = rng.integers(0, 6, 5).astype(numpy.int32)
    check(model, lambda i, t: F.softmax_cross_entropy(model(i), t),
          (ids, t), dtype)


def test_linear_n_batch_axes(dtype):
    """F.linear reshapes (B, T, in) to (B*T, in): rows are grouped by
    example (B comes from the batch given to backward)."""
    rng = numpy.random.default_rng(3)
    numpy.random.seed(3)
    lin = L.Linear(3, 2)

    def loss(x):
        return F.sum(F.tanh(lin(x, n_batch_axes=2))) / len(x)
    x = _data(rng, dtype, 4, 5, 3)
    lin(x, n_batch_axes=2)
    check(lin, loss, (x,), dtype)


# ---- batch normalization and the Appendix D network --------------------------

class SliceOracle(chainer.FunctionHook):
    """Records each function's inputs/output gradient during a batch
    backward, then recomputes per-example contributions by applying
    Chainer's own functions to single examples (conv/linear) or the
    definition with batch statistics computed here (BN)."""

    name = 'SliceOracle'

    def __init__(self):
        self.records = []

    def backward_postprocess(self, function, in_data, out_grad):
        self.records.append((function, in_data, out_grad[0]))

    def sums(self, params):
        node_index = {id(p.node): i for i, p in enumerate(params)}
        out = [None] * len(params)
        for fn, in_data, gy in self.records:
            ks = [k for k, n in enumerate(fn.inputs) if id(n) in node_index]
            for k in ks:
                i = node_index[id(fn.inputs[k])]
                per_ex = [self._one(fn, in_data, gy, k, z)
                          for z in range(len(gy))]
                sq = sum(g * g for g in per_ex)
                out[i] = sq if out[i] is None else out[i] + sq
        return out

    @staticmethod
    def _one(fn, in_data, gy, k, z):
        name = type(fn).__name__
        x = in_data[0][z:z + 1]
        if name == 'BatchNormalization':
            xs = in_data[0].astype(numpy.float64)
            axes = tuple(fn.axis)
            mean = xs.mean(axis=axes, keepdims=True)
            var = xs.var(axis=axes, keepdims=True)
            x_hat = ((xs - mean) / numpy.sqrt(var + fn.eps))[z:z + 1]
            g = gy[z:z + 1].astype(numpy.float64)
            sub = tuple(a for a in axes)
            return (g * x_hat).sum(axis=sub) if k == 1 else g.sum(axis=sub)
        w = chainer.Variable(in_data[1])
        b = chainer.Variable(numpy.zeros(gy.shape[1], gy.dtype))
        if name == 'Convolution2DFunction':
            y = F.convolution_2d(x, w, b, stride=(fn.sy, fn.sx),
                                 pad=(fn.ph, fn.pw), cover_all=fn.cover_all,
                                 dilate=(fn.dy, fn.dx), groups=fn.groups)
        elif name == 'LinearFunction':
            y = F.linear(x, w, b)
        else:
            raise AssertionError(name)
        gw, gb = chainer.grad([y], [w, b], grad_outputs=[gy[z:z + 1]])
        return (gw if k == 1 else gb).array.astype(numpy.float64)


def _hook_and_slices(model, x, t):
    """(names, the hook's sums, the per-example slices' sums) of one
    softmax cross-entropy backward of ``model`` on ``(x, t)``."""
    model(x)
    names, params = model_params(model)
    oracle = SliceOracle()
    with oracle:
        F.softmax_cross_entropy(model(x), t).backward()
    want = oracle.sums(params)
    model.cleargrads()
    got = PerSampleSquares(model).backward(
        F.softmax_cross_entropy(model(x), t), batch=(x, t))
    return names, got, want


def _assert_close_to_slices(names, got, want):
    for name, g, w in zip(names, got, want):
        assert w is not None, name
        numpy.testing.assert_allclose(g, w, rtol=1e-5,
                                      atol=1e-12 * abs(w).max(),
                                      err_msg=name)


def test_vgg_appendix_d_against_per_example_slices():
    rng = numpy.random.default_rng(4)
    with chainer.using_config('dtype', numpy.float64):
        numpy.random.seed(4)
        model = VGG(width=1 / 16, dropout=False)
        x = _data(rng, numpy.float64, 3, 3, 32, 32)
        t = rng.integers(0, 10, 3).astype(numpy.int32)
        names, got, want = _hook_and_slices(model, x, t)
    assert len(names) == 13 + 13 * 2 + 1 + 2 + 2  # conv W, BN, fc1, bn, fc2
    _assert_close_to_slices(names, got, want)


def test_bottleneck_resnet_against_per_example_slices():
    """ResNet-50's shape (issue 38), small: bottleneck blocks with batch
    normalization everywhere, identity shortcuts and stride-2 1x1
    projections, a 7x7 stride-2 stem, max and average pooling; every
    parameter's sums equal the per-example slices."""
    from chainer_vgc.harness.models import BottleneckResNet
    rng = numpy.random.default_rng(5)
    with chainer.using_config('dtype', numpy.float64):
        numpy.random.seed(5)
        model = BottleneckResNet(10, width=1 / 16, blocks=(2, 1))
        x = _data(rng, numpy.float64, 3, 3, 32, 32)
        t = rng.integers(0, 10, 3).astype(numpy.int32)
        names, got, want = _hook_and_slices(model, x, t)
    # the stem's conv and BN (3), 3 blocks of 3 convs and 3 BNs (9 each),
    # a projection and its BN (3) in the first block of each stage (it
    # changes the shape), the classifier (2)
    assert sum('project' in n for n in names) == 6
    assert len(names) == 3 + 9 * 3 + 3 * 2 + 2, names
    _assert_close_to_slices(names, got, want)



def test_batch_normalization_slices_add_up_to_batch_gradient(dtype):
    """The documented BN definition: slices of the batch gradient.  Their
    sum is the batch gradient; their squares are what we return."""
    rng = numpy.random.default_rng(5)
    bn = L.BatchNormalization(3)
    x = _data(rng, dtype, 6, 3, 4, 4)
    w = _data(rng, dtype, 6, 3, 4, 4)

    def loss():
        return F.sum(bn(x) * w) / 6
    oracle = SliceOracle()
    bn.cleargrads()
    with oracle:
        loss().backward()
    want = oracle.sums([bn.gamma, bn.beta])
    (rec,) = [r for r in oracle.records
              if type(r[0]).__name__ == 'BatchNormalization']
    per_ex_beta = [oracle._one(rec[0], rec[1], rec[2], 2, z)
                   for z in range(6)]
    numpy.testing.assert_allclose(sum(per_ex_beta).ravel(), bn.beta.grad,
                                  rtol=RTOL[dtype])
    bn.cleargrads()
    got = PerSampleSquares([('gamma', bn.gamma), ('beta', bn.beta)],
                           batch_size=6).backward(loss())
    for g, w_ in zip(got, want):
        numpy.testing.assert_allclose(g, w_.ravel(), rtol=RTOL[dtype])


# ---- memory chunks, options, errors ------------------------------------------

def test_result_does_not_depend_on_chunk_size():
    rng = numpy.random.default_rng(6)
    with chainer.using_config('dtype', numpy.float64):
        numpy.random.seed(6)
        model = SharedNet()
        cnn = ConvNet(1, 1, 1, 2, False)
        ids = rng.integers(0, 6, (7, 3)).astype(numpy.int32)
        x = _data(rng, numpy.float64, 7, 4, 8, 8)
        results = []
        for mem in (1, 4096, 2 ** 30):
            out = []
            for m, loss in ((model, lambda: F.sum(model(ids) ** 2) / 7),
                            (cnn, lambda: F.sum(cnn(x) ** 2) / 7)):
                m.cleargrads()
                out += PerSampleSquares(m, max_memory=mem,
                                        batch_size=7).backward(loss())
            results.append(out)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            numpy.testing.assert_allclose(a, b, rtol=1e-12, atol=0)


class MatmulNet(chainer.Chain):
    def __init__(self):
        super(MatmulNet, self).__init__()
        with self.init_scope():
            self.W = chainer.Parameter(chainer.initializers.Normal(), (3, 2))
            self.lin = L.Linear(2, 2)
            self.unused = L.Linear(2, 2)

    def forward(self, x):
        return self.lin(F.matmul(x, self.W))


def test_uncovered_parameters_error_or_bruteforce():
    rng = numpy.random.default_rng(7)
    with chainer.using_config('dtype', numpy.float64):
        numpy.random.seed(7)
        model = MatmulNet()
        x = _data(rng, numpy.float64, 4, 3)

        def loss_fn(x):
            return F.sum(model(x) ** 2) / len(x)
        model.cleargrads()
        with pytest.raises(UncoveredParameterError,
                           match=r"/W \(used by MatMul\).*bruteforce"):
            PerSampleSquares(model).backward(loss_fn(x), batch=(x,))
        assert model.W.grad is None  # refused before any backward
        got = check(model, loss_fn, (x,), numpy.float64,
                    uncovered='bruteforce')
        assert model.W.grad is not None  # the usual gradient is there
        names, params = model_params(model)
        assert got[names.index('/unused/W')] is None  # no gradient: None
        # check() compares with bruteforce_sqsum, which shares the
        # per-example passes of uncovered='bruteforce': an independent loop
        # of ordinary backward passes too
        want = reference.per_example_sqsum(params, loss_fn, x)
        for name, g, w in zip(names, got, want):
            assert (g is None) == (w is None), name
            if w is not None:
                numpy.testing.assert_allclose(g, w, rtol=1e-10, atol=0,
                                              err_msg=name)
        model.cleargrads()
        with pytest.raises(ValueError, match='needs loss_fn and batch'):
            PerSampleSquares(model, uncovered='bruteforce').backward(
                loss_fn(x), batch=(x,))


def test_bad_arguments_and_batch_axis_mismatch():
    lin = L.Linear(3, 2)
    with pytest.raises(ValueError, match='uncovered'):
        PerSampleSquares(lin, uncovered='ignore')
    with pytest.raises(ValueError, match='max_memory'):
        PerSampleSquares(lin, max_memory=0)
    x = numpy.ones((6, 3), numpy.float32)
    with pytest.raises(ValueError, match='not a multiple of the batch size '
                       '4') as info:
        PerSampleSquares(lin, batch_size=4).backward(F.sum(lin(x)))
    # (where the fix goes: the option and the call that takes it)
    assert "create_communicator(..., exclude=['/W'])" in str(info.value)
    assert 'batch_size=' in str(info.value)


def test_uncovered_error_names_the_option_the_call_and_a_few_names():
    """Many uncovered parameters (32 weights used through F.matmul, which
    the handlers do not cover): the error lists three with a count, names
    the option and the call that takes it, and keeps every name in
    ``.names``; the 'dense' warning lists as few."""
    from chainer_vgc.params import some_of
    assert some_of(['/a', '/b']) == '/a, /b'
    assert some_of(['/a', '/b', '/c', '/d', '/e']) == '/a, /b, /c and 2 more'
    model = chainer.ChainList(*[chainer.Link() for _ in range(32)])
    for link in model:
        with link.init_scope():
            link.W = chainer.Parameter(numpy.eye(3, dtype=numpy.float32))
    h = numpy.ones((2, 3), numpy.float32)
    for link in model:
        h = F.matmul(h, link.W)
    loss = F.sum(h)
    with pytest.raises(UncoveredParameterError) as info:
        PerSampleSquares(model, batch_size=2).backward(loss)
    text = str(info.value)
    names, _ = model_params(model)
    assert sorted(info.value.names) == sorted(names) and len(names) == 32
    assert 'for 32 parameter(s)' in text and 'and 29 more' in text
    assert "chainer_vgc.create_communicator(..., uncovered='dense')" in text
    assert sum(n in text for n in names) == 3, text
    assert len(text) < 900, len(text)


def test_float16_parameters_give_float32_sums():
    """float16 model vs the float64 oracle on the same weights."""
    rng = numpy.random.default_rng(8)
    with chainer.using_config('dtype', numpy.float16):
        numpy.random.seed(8)
        model = MLP((5,), 3)
        x = _data(rng, numpy.float16, 4, 6)
        model(x)
        got = PerSampleSquares(model).backward(F.sum(model(x)) / 4,
                                               batch=(x,))
    model64 = model.copy(mode='copy')
    for p in model64.params():
        p.array = p.array.astype(numpy.float64)
    _, params64 = model_params(model64)
    want = bruteforce_sqsum(lambda x: F.sum(model64(x)) / len(x), params64,
                            x.astype(numpy.float64))
    for g, w in zip(got, want):
        assert g.dtype == numpy.float32
        numpy.testing.assert_allclose(g, w, rtol=2e-2, atol=1e-3 * w.max())


def test_batch_size_is_required():
    lin = L.Linear(3, 2)
    x = numpy.ones((4, 3), numpy.float32)
    with pytest.raises(ValueError, match='needs the number of examples'):
        PerSampleSquares(lin).backward(F.sum(lin(x)))


def test_rows_that_are_not_examples_are_refused():
    """A constant table and a batch-axis concatenation (Siamese) feeding a
    covered function: per-example contributions are undefined -> error."""
    rng = numpy.random.default_rng(9)
    lin = L.Linear(3, 2)
    x = _data(rng, numpy.float32, 4, 3)
    table = _data(rng, numpy.float32, 4, 3)  # 4 rows, not examples
    with pytest.raises(ValueError, match='constant array'):
        PerSampleSquares(lin).backward(F.sum(lin(table) * F.sum(lin(x))),
                                       batch=(x,))
    x2 = _data(rng, numpy.float32, 4, 3)
    with pytest.raises(ValueError, match='do not come from an example-major'):
        PerSampleSquares(lin).backward(F.sum(lin(F.concat([x, x2], axis=0))),
                                       batch=(x, x2))
    # a time-major transpose before merging the axes is refused too
    seq = _data(rng, numpy.float32, 4, 5, 3)
    with pytest.raises(ValueError, match='example-major'):
        h = F.reshape(F.transpose(seq, (1, 0, 2)), (20, 3))
        PerSampleSquares(lin).backward(F.sum(lin(h)), batch=(seq,))


def test_bruteforce_refuses_batch_normalization_in_training():
    class Net(chainer.Chain):
        def __init__(self):
            super(Net, self).__init__()
            with self.init_scope():
                self.bn = L.BatchNormalization(3)
                self.S = chainer.Parameter(numpy.ones((3, 2), numpy.float32))

        def forward(self, x):
            return F.matmul(self.bn(x), self.S)
    net = Net()
    x = numpy.random.default_rng(10).normal(size=(5, 3)).astype(
        numpy.float32)
    with pytest.raises(ValueError, match='BatchNormalization in training'):
        PerSampleSquares(net, uncovered='bruteforce').backward(
            F.sum(net(x)), loss_fn=lambda x: F.sum(net(x)), batch=(x,))


def test_hook_cannot_be_used_as_a_plain_context():
    lin = L.Linear(3, 2)
    hook = PerSampleSquares(lin)
    with pytest.raises(TypeError, match='backward'):
        with hook:
            pass


def test_zero_gradient_through_every_use_gives_zeros():
    lin = L.Linear(3, 2)
    x = numpy.ones((4, 3), numpy.float32)
    (w, b) = PerSampleSquares([('W', lin.W), ('b', lin.b)]).backward(
        F.sum(lin(x) * 0), batch=(x,))
    assert w.shape == (2, 3) and not w.any() and not b.any()


# ---- brute force: loss scaling, random noise, reporting ---------------------

class TwinNet(chainer.Chain):
    """Two layers computed either with F.linear (covered: the exact hook)
    or with F.matmul + broadcast bias (uncovered: brute force), on the same
    parameters, so the two paths must give the same sums."""

    def __init__(self, n_in=3, hidden=4, n_out=2, dropout=0.0):
        super(TwinNet, self).__init__()
        self.covered = True
        self.dropout = dropout
        with self.init_scope():
            self.l1 = L.Linear(n_in, hidden)
            self.l2 = L.Linear(hidden, n_out)

    def _layer(self, lin, x):
        if self.covered:
            return lin(x)
        return F.matmul(x, lin.W, transb=True) + F.broadcast_to(
            lin.b, (len(x), lin.b.shape[0]))

    def forward(self, x):
        h = F.tanh(self._layer(self.l1, x))
        if self.dropout:
            h = F.dropout(h, self.dropout)
        return self._layer(self.l2, h)


def _exact_and_brute(net, loss_fn, batch, **backward_kwargs):
    out = []
    for covered in (True, False):
        net.covered = covered
        net.cleargrads()
        hook = PerSampleSquares(net, uncovered='bruteforce')
        out.append(hook.backward(loss_fn(*batch), loss_fn=loss_fn,
                                 batch=batch, **backward_kwargs))
        if not covered:  # the weights by brute force (F.matmul); the
            # biases, added by broadcast, by the hook
            assert sorted(hook.covered_names) == ['/l1/b', '/l2/b']
    return out


@pytest.mark.parametrize('kind', ['mean', 'sum', 'scaled_sum',
                                  'scaled_mean', 'sum_per_example_terms'])
@pytest.mark.parametrize('loss_scale', [None, 256.0])
def test_bruteforce_is_exact_for_any_loss_scaling(kind, loss_scale):
    """Brute force (uncovered F.matmul path) == the exact hook (F.linear
    path) on the same parameters, for mean, sum and scaled losses, and for
    backward(loss_scale=...)."""
    rng = numpy.random.default_rng(11)
    with chainer.using_config('dtype', numpy.float64):
        numpy.random.seed(11)
        net = TwinNet()
        x = _data(rng, numpy.float64, 5, 3)
        t = _data(rng, numpy.float64, 5, 2)

        def loss_fn(x, t):
            y = net(x)
            if kind == 'mean':
                return F.mean_squared_error(y, t)
            if kind == 'sum':
                return F.sum((y - t) ** 2)
            if kind == 'scaled_sum':
                return F.sum((y - t) ** 2) * 1024
            if kind == 'scaled_mean':
                return F.mean_squared_error(y, t) * 1024
            # a sum of per-example terms, each a different function
            return F.sum(F.sum((y - t) ** 2, axis=1) + F.sum(F.tanh(y), 1))
        kw = {} if loss_scale is None else {'loss_scale': loss_scale}
        exact, brute = _exact_and_brute(net, loss_fn, (x, t), **kw)
    for name, e, b in zip(model_params(net)[0], exact, brute):
        numpy.testing.assert_allclose(b, e, rtol=1e-9, err_msg=name)


def test_bruteforce_exact_when_per_example_gradients_cancel():
    """At a stationary point of the batch loss the per-example gradients
    cancel (their sum is ~0, so it cannot give the scaling): the losses do,
    and the result is still exact, for a sum as for a mean."""
    with chainer.using_config('dtype', numpy.float64):
        net = TwinNet()
        for p in net.params():
            p.array[...] = 0
        x = numpy.ones((2, 3))
        t = numpy.array([[1.0, -2.0], [-1.0, 2.0]])  # optimum: output 0
        for loss_fn in (lambda x, t: F.sum((net(x) - t) ** 2),
                        lambda x, t: F.mean_squared_error(net(x), t)):
            exact, brute = _exact_and_brute(net, loss_fn, (x, t))
            assert abs(brute[model_params(net)[0].index('/l2/b')]).max() > 0
            for e, b in zip(exact, brute):
                numpy.testing.assert_allclose(b, e, rtol=1e-12, atol=0)


def test_bruteforce_refuses_loss_not_linear_in_examples():
    """A per-example weighting (per-token normalization) or a nonlinear
    function of the batch mean is not c * sum_z loss_fn(example z)."""
    rng = numpy.random.default_rng(12)
    with chainer.using_config('dtype', numpy.float64):
        numpy.random.seed(12)
        net = TwinNet()
        net.covered = False
        x = _data(rng, numpy.float64, 4, 3)
        t = _data(rng, numpy.float64, 4, 2)

        def squared_mean(x, t):
            return F.mean_squared_error(net(x), t) ** 2

        def weighted(x, t):  # weights that depend on the batch composition
            w = numpy.arange(1, len(x) + 1, dtype=numpy.float64)
            return F.sum(F.sum((net(x) - t) ** 2, axis=1) * w)

        for loss_fn in (squared_mean, weighted):
            net.cleargrads()
            with pytest.raises(ValueError, match='c \\* sum_z loss_fn'):
                PerSampleSquares(net, uncovered='bruteforce').backward(
                    loss_fn(x, t), loss_fn=loss_fn, batch=(x, t))
            assert all(p.grad is None for p in net.params())


def test_bruteforce_refuses_active_dropout():
    rng = numpy.random.default_rng(13)
    numpy.random.seed(13)
    net = TwinNet(dropout=0.5)
    net.covered = False
    x = _data(rng, numpy.float32, 4, 3)
    t = _data(rng, numpy.float32, 4, 2)

    def loss_fn(x, t):
        return F.mean_squared_error(net(x), t)
    net.cleargrads()
    with chainer.using_config('train', True):
        with pytest.raises(ValueError, match=r'Dropout active.*'
                           r"using_config\('train', False\).*/l1/W"):
            PerSampleSquares(net, uncovered='bruteforce').backward(
                loss_fn(x, t), loss_fn=loss_fn, batch=(x, t))
        assert all(p.grad is None for p in net.params())
        with pytest.raises(ValueError, match='Dropout'):
            bruteforce_sqsum(loss_fn, list(net.params()), x, t)
    # the exact hook itself is fine with dropout (it reads the real pass)
    net.covered = True
    PerSampleSquares(net).backward(loss_fn(x, t), batch=(x, t))
    # without dropout (evaluation mode), brute force runs and is exact
    with chainer.using_config('train', False):
        exact, brute = _exact_and_brute(net, loss_fn, (x, t))
    for e, b in zip(exact, brute):
        numpy.testing.assert_allclose(b, e, rtol=1e-4)


def test_bruteforce_reports_nothing():
    """L.Classifier reports main/loss and main/accuracy; after backward the
    observation holds the real (batch) pass's values only."""
    rng = numpy.random.default_rng(14)
    numpy.random.seed(14)
    net = TwinNet(n_out=3)
    net.covered = False
    model = L.Classifier(net)
    x = _data(rng, numpy.float32, 6, 3)
    t = rng.integers(0, 3, 6).astype(numpy.int32)
    reporter = chainer.Reporter()
    reporter.add_observer('main', model)
    observation = {}
    with reporter.scope(observation):
        loss = model(x, t)
        before = {k: float(v.array) for k, v in observation.items()}
        assert sorted(before) == ['main/accuracy', 'main/loss']
        sums = PerSampleSquares(model, uncovered='bruteforce').backward(
            loss, loss_fn=model, batch=(x, t))
        assert reporter.observation is observation
    after = {k: float(v.array) for k, v in observation.items()}
    assert after == before
    assert after['main/loss'] == float(loss.array)
    assert all(s is not None for s in sums)


@pytest.mark.parametrize('mem', [1, 2 ** 30])
def test_sums_are_written_into_one_arena_unchanged(monkeypatch, mem):
    """The reductions write the sums into one array, end to end in
    ``names`` order (what a GPU compressor then reads in place, issue 25);
    each sum equals, bit for bit, the one computed into its own array, on
    every path: the linear shortcut, convolution, shared weights added
    before squaring, embeddings, and chunks of one example
    (``max_memory=1``: partial sums added into the arena)."""
    rng = numpy.random.default_rng(8)
    with chainer.using_config('dtype', numpy.float32):
        numpy.random.seed(8)
        shared, cnn = SharedNet(), ConvNet(1, 1, 1, 2, False)
        embed = EmbedNet(7, 4, None)  # one use each: the shortcuts
        ids = rng.integers(0, 6, (5, 3)).astype(numpy.int32)
        x = _data(rng, numpy.float32, 5, 4, 8, 8)
        cases = ((shared, lambda: F.sum(shared(ids) ** 2) / 5),
                 (cnn, lambda: F.sum(cnn(x) ** 2) / 5),
                 (embed, lambda: F.sum(embed(ids) ** 2) / 5))
        for model, loss in cases:
            runs = []
            for arena in (True, False):
                if not arena:
                    monkeypatch.setattr(PerSampleSquares, '_arena_views',
                                        lambda self: None)
                model.cleargrads()
                runs.append(PerSampleSquares(model, max_memory=mem,
                                             batch_size=5).backward(loss()))
            monkeypatch.undo()
            with_arena, alone = runs
            base = with_arena[0].base
            assert base is not None and base.ndim == 1
            at = base.__array_interface__['data'][0]
            for s in with_arena:
                assert s.base is base and s.flags.c_contiguous
                assert s.__array_interface__['data'][0] == at
                at += s.nbytes
            assert at == base.__array_interface__['data'][0] + base.nbytes
            for a, b in zip(with_arena, alone):
                assert b.base is None or b.base is not base
                assert a.dtype == b.dtype and a.shape == b.shape
                numpy.testing.assert_array_equal(a, b)
