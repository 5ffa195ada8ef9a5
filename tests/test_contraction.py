"""The statistics' fast products (chainer_vgc/statistics/contraction.py)
against their readable reference (each example's contribution, squared
and summed: ``_Use.reference_sqsum``, ``_reference_combined_sqsum``), in
float64 to rtol 1e-9, for both formulations (Gram, blocked per-example),
every convolution option, Linear with several rows per example, shared
weights, chunk and block sizes; and the workspace's reuse."""

import chainer
import chainer.functions as F
import chainer.links as L
import numpy
import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from chainer_vgc.statistics import PerSampleSquares
from chainer_vgc.statistics import contraction
from chainer_vgc.statistics import handlers
from chainer_vgc.statistics import normalizations
from chainer_vgc.statistics import uses as use_module

# on both stacks (make test): its results depend on NumPy, the native
# build or the installed packages (docs/contributing.md)
pytestmark = pytest.mark.stack

RTOL = 1e-9


class Recorder(chainer.FunctionHook):
    """Each covered weight use of one backward pass: (use, rows per
    example, parameter)."""

    name = 'Recorder'

    def __init__(self, params, b, dtype=numpy.float64):
        self.index = {id(p.node): p for p in params}
        self.b, self.dtype = b, numpy.dtype(dtype)
        self.uses = []

    def backward_postprocess(self, function, in_data, out_grad):
        for k, node in enumerate(function.inputs):
            p = self.index.get(id(node))
            if p is None or k != 1 or not handlers._supported(function, k):
                continue
            use = handlers._uses_of(function, k, in_data, out_grad[0],
                                    self.dtype, numpy)
            if use.operands is not None:
                self.uses.append((use, use.rows // self.b, p))


def record(model, loss, b):
    params = [p for _, p in model.namedparams()]
    rec = Recorder(params, b)
    model.cleargrads()
    with rec:
        loss.backward()
    assert rec.uses, 'no product uses recorded'
    return rec.uses


@pytest.fixture(params=['gram', 'blocked', 'auto'])
def formulation(request, monkeypatch):
    """Force either formulation (or leave the choice to the shape)."""
    if request.param == 'gram':
        monkeypatch.setattr(contraction, 'GRAM_MAX_POSITIONS', 10 ** 6)
    elif request.param == 'blocked':
        monkeypatch.setattr(contraction, 'GRAM_MAX_POSITIONS', 0)
    return request.param


def assert_close(got, want, what):
    assert got.shape == want.shape and got.dtype == want.dtype, what
    numpy.testing.assert_allclose(got, want, rtol=RTOL,
                                  atol=RTOL * abs(want).max(), err_msg=what)


class ConvPair(chainer.Chain):
    def __init__(self, stride, pad, dilate, groups, ksize):
        super(ConvPair, self).__init__()
        with self.init_scope():
            self.c = L.Convolution2D(4, 6, ksize, stride=stride, pad=pad,
                                     dilate=dilate, groups=groups)
            self.d = L.Deconvolution2D(6, 4, ksize, stride=stride, pad=pad,
                                       dilate=dilate, groups=groups)

    def forward(self, x):
        return F.tanh(self.d(F.relu(self.c(x))))


@settings(deadline=None, max_examples=25)
@given(b=st.integers(1, 5), stride=st.integers(1, 2), pad=st.integers(0, 2),
       dilate=st.integers(1, 2), groups=st.sampled_from([1, 2]),
       ksize=st.sampled_from([1, 2, 3, (2, 3)]), size=st.integers(3, 8),
       mem=st.sampled_from([1, 700, 2 ** 30]), seed=st.integers(0, 99))
def test_convolutions_match_the_reference(b, stride, pad, dilate, groups,
                                          ksize, size, mem, seed):
    rng = numpy.random.default_rng(seed)
    with chainer.using_config('dtype', numpy.float64):
        numpy.random.seed(seed)
        model = ConvPair(stride, pad, dilate, groups, ksize)
        x = rng.normal(size=(b, 4, size, size))
        try:
            y = model(x)
        except (AssertionError, ValueError, TypeError):
            return  # a configuration Chainer itself refuses
        uses = record(model, F.sum(y * y) / b, b)
    for formulation in ('gram', 'blocked'):
        limit = 10 ** 6 if formulation == 'gram' else 0
        saved = contraction.GRAM_MAX_POSITIONS
        contraction.GRAM_MAX_POSITIONS = limit
        try:
            for use, rows, p in uses:
                work = contraction.Workspace()
                got = use.sqsum(rows, mem, work=work)
                want = use.reference_sqsum(rows, mem)
                assert_close(got, want, '{} {}'.format(formulation,
                                                       p.shape))
        finally:
            contraction.GRAM_MAX_POSITIONS = saved


def test_small_blocks_and_chunks_match(formulation, monkeypatch):
    """Row blocks and example blocks of the blocked product, and chunks
    of one example, cut the same sums."""
    monkeypatch.setattr(contraction, 'BLOCK_BYTES', 200)
    rng = numpy.random.default_rng(1)
    with chainer.using_config('dtype', numpy.float64):
        numpy.random.seed(1)
        model = ConvPair(1, 1, 1, 1, 3)
        x = rng.normal(size=(7, 4, 5, 5))
        uses = record(model, F.sum(model(x) ** 2) / 7, 7)
    for use, rows, p in uses:
        for mem in (1, 3000, 2 ** 30):
            got = use.sqsum(rows, mem, work=contraction.Workspace())
            assert_close(got, use.reference_sqsum(rows, 2 ** 30), str(mem))


def test_linear_rows_per_example(formulation):
    """F.linear with n_batch_axes=2: T rows per example join the
    positions (T = 1, 3, 6: Gram and blocked by shape)."""
    rng = numpy.random.default_rng(2)
    for t in (1, 3, 6):
        with chainer.using_config('dtype', numpy.float64):
            lin = L.Linear(5, 4)
            x = rng.normal(size=(6, t, 5))
            y = lin(x, n_batch_axes=2)
            uses = record(lin, F.sum(F.tanh(y)) / 6, 6)
        for use, rows, p in uses:
            assert rows == t
            assert_close(use.sqsum(rows, 2 ** 30),
                         use.reference_sqsum(rows, 2 ** 30), 'T={}'.format(t))


class Siamese(chainer.Chain):
    """One convolution and one Linear applied to two inputs (as a
    discriminator to real and generated images), and a Linear reused on
    rows of different counts."""

    def __init__(self):
        super(Siamese, self).__init__()
        with self.init_scope():
            self.c = L.Convolution2D(3, 5, 3, pad=1)
            self.fc = L.Linear(5 * 6 * 6, 2)

    def forward(self, x1, x2):
        h1, h2 = F.relu(self.c(x1)), F.relu(self.c(F.tanh(x2)))
        return self.fc(h1) + self.fc(h2) * 0.5


def test_shared_uses_concatenate_as_the_reference(formulation):
    rng = numpy.random.default_rng(3)
    with chainer.using_config('dtype', numpy.float64):
        numpy.random.seed(3)
        model = Siamese()
        x1, x2 = rng.normal(size=(2, 4, 3, 6, 6))
        loss = F.sum(model(x1, x2) ** 2) / 4
        uses = record(model, loss, 4)
    by_param = {}
    for use, rows, p in uses:
        by_param.setdefault(id(p), []).append((use, rows))
    assert sorted(len(v) for v in by_param.values()) == [2, 2]
    want = {}
    for key, use_list in by_param.items():
        got = use_module._combined_sqsum(use_list, 4, 2 ** 30, None,
                                         contraction.Workspace())
        want[key] = use_module._reference_combined_sqsum(use_list, 4, 2 ** 30)
        assert_close(got, want[key], str(got.shape))
    # the hook runs the combined path itself when the backward is over
    stats = PerSampleSquares(model, batch_size=4)
    model.cleargrads()
    with chainer.using_config('dtype', numpy.float64):
        sums = stats.backward(F.sum(model(x1, x2) ** 2) / 4)
    checked = 0
    for p, s in zip(stats.params, sums):
        if id(p) in want:
            assert_close(s, want[id(p)], 'hook ' + str(p.shape))
            checked += 1
    assert checked == 2


def test_gram_results_are_never_negative():
    """Where the exact value is 0 (contributions that cancel), rounding in
    the Gram sum may fall below 0: it is clamped."""
    rng = numpy.random.default_rng(4)
    a = rng.normal(size=(3, 1, 2, 4))
    a[..., 1] = -a[..., 0]   # two positions that cancel
    b = numpy.repeat(rng.normal(size=(3, 1, 1, 5)), 4, axis=2)
    b[:, :, 2:] = 0
    op = contraction.Operands(numpy, numpy.float64, 1, 2, 5, 4,
                              lambda z0, z1, w: (a[z0:z1], b[z0:z1]), (2, 5))
    got = contraction.sum_squared_products(op, 3, 2 ** 30,
                                           contraction.Workspace())
    assert (got >= 0).all()
    numpy.testing.assert_allclose(got, 0, atol=1e-12)


def test_workspace_is_reused_from_step_to_step():
    """A second step of the same shapes allocates no new buffer, and the
    sums are the same."""
    rng = numpy.random.default_rng(5)
    numpy.random.seed(5)
    model = ConvPair(2, 1, 1, 2, 3)
    x = rng.normal(size=(6, 4, 8, 8)).astype(numpy.float32)
    stats = PerSampleSquares(model, batch_size=6)
    runs = []
    for step in range(3):
        model.cleargrads()
        runs.append([s.copy() for s in stats.backward(
            F.sum(model(x) ** 2) / 6)])
        if step == 0:
            buffers = {k: v for k, v in stats.work._buffers.items()}
            held = stats.work.nbytes
            assert held > 0
    assert stats.work.nbytes == held
    assert all(stats.work._buffers[k] is v for k, v in buffers.items())
    for later in runs[1:]:
        for a, b in zip(runs[0], later):
            numpy.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('shape', [(6, 3, 4, 5), (6, 7)])
def test_batch_normalization_gamma_without_x_hat(shape):
    """gamma's per-example slice, inv_std * (sum gy x - mean sum gy),
    equals the definition sum gy * x_hat to rtol 1e-9 (float64), also for
    inputs far from zero mean."""
    rng = numpy.random.default_rng(6)
    with chainer.using_config('dtype', numpy.float64):
        bn = L.BatchNormalization(shape[1])
        x = 5.0 + rng.normal(size=shape)
        y = bn(x)
        rec = []

        class Hook(chainer.FunctionHook):
            name = 'bn'

            def backward_postprocess(self, fn, in_data, out_grad):
                if type(fn).__name__ == 'BatchNormalization':
                    rec.append((fn, in_data, out_grad[0]))
        with Hook():
            F.sum(F.tanh(y) * rng.normal(size=shape)).backward()
    (fn, in_data, gy), = rec
    use = normalizations.bn_gamma(fn, in_data, gy, numpy.dtype('f8'), numpy)
    axes = tuple(a for a in fn.axis if a != 0)
    x_hat = (in_data[0] - fn.mean[fn.expander]) * fn.inv_std[fn.expander]
    want = (gy * x_hat).sum(axis=axes) if axes else gy * x_hat
    assert_close(use.per_example(0, shape[0]), want, 'gamma slices')
    assert_close(use.sqsum(1, 2 ** 30), (want ** 2).sum(axis=0), 'gamma')


@pytest.fixture
def own_im2col(monkeypatch):
    """The image shapes of the statistics' own im2col calls, in order."""
    made = []
    original = handlers.im2col

    def counting(*args):
        made.append(args[1].shape)
        return original(*args)
    monkeypatch.setattr(handlers, 'im2col', counting)
    return made


def test_convolutions_take_chainers_own_columns(monkeypatch, own_im2col):
    """On the CPU the statistics of a convolution or deconvolution used
    once reuse the im2col Chainer made for its weight gradient: the
    statistics make no im2col of their own, and the sums equal the
    reference.  (With Chainer's own weight gradient: by default a
    convolution of this size takes its gradient from the statistics'
    products, and Chainer makes no columns for it; test_weight_gradient.)"""
    from chainer_vgc.statistics import im2col as im2col_module
    rng = numpy.random.default_rng(7)
    with chainer.using_config('dtype', numpy.float64):
        numpy.random.seed(7)
        model = ConvPair(2, 1, 1, 2, 3)
        x = rng.normal(size=(5, 4, 9, 9))
        stats = PerSampleSquares(model, batch_size=5,
                                 fused_weight_gradient=False)
        model.cleargrads()
        sums = stats.backward(F.sum(model(x) ** 2) / 5)
        uses = record(model, F.sum(model(x) ** 2) / 5, 5)
    assert own_im2col == []
    want = {id(p): use.reference_sqsum(rows, 2 ** 30)
            for use, rows, p in uses}
    for p, s in zip(stats.params, sums):
        if id(p) in want:
            assert_close(s, want[id(p)], str(p.shape))
    assert len(want) == 2
    # without the capture, the statistics make their own
    monkeypatch.setattr(im2col_module.ColumnCapture, 'take',
                        lambda *a: None)
    model.cleargrads()
    with chainer.using_config('dtype', numpy.float64):
        again = stats.backward(F.sum(model(x) ** 2) / 5)
    assert len(own_im2col) == 2
    for a, b in zip(sums, again):
        assert_close(a, b, 'own im2col')


def test_column_capture_hands_over_only_the_same_image_and_geometry():
    from chainer.utils import conv as conv_utils
    from chainer_vgc.statistics.im2col import ColumnCapture
    rng = numpy.random.default_rng(8)
    img = rng.normal(size=(2, 3, 6, 6))

    class Node(object):
        sy = sx = 1
        ph = pw = 1
        dy = dx = 1
        cover_all = False

    capture = ColumnCapture()
    with capture:
        col = conv_utils.im2col_cpu(img, 3, 3, 1, 1, 1, 1)
        assert capture.take(img, Node, 3, 3) is col
        assert capture.take(img, Node, 3, 3) is None   # one slot, taken
        conv_utils.im2col_cpu(img, 3, 3, 1, 1, 1, 1)
        assert capture.take(img.copy(), Node, 3, 3) is None
        conv_utils.im2col_cpu(img, 3, 3, 2, 1, 1, 1)
        assert capture.take(img, Node, 3, 3) is None   # another stride
    assert conv_utils.im2col_cpu is not None
    assert getattr(conv_utils.im2col_cpu, '__name__') == 'im2col_cpu'


@pytest.mark.parametrize('max_memory', [2 ** 30, 1])
def test_shared_convolutions_keep_chainers_columns_within_max_memory(
        own_im2col, max_memory):
    """The two uses of a shared convolution keep Chainer's columns until
    the second is seen, when they fit in max_memory (no im2col of the
    statistics' own); with max_memory = 1 byte they make their own.  The
    sums equal the reference either way."""
    rng = numpy.random.default_rng(9)
    with chainer.using_config('dtype', numpy.float64):
        numpy.random.seed(9)
        model = Siamese()
        x1, x2 = rng.normal(size=(2, 4, 3, 6, 6))
        stats = PerSampleSquares(model, batch_size=4, max_memory=max_memory)
        model.cleargrads()
        sums = stats.backward(F.sum(model(x1, x2) ** 2) / 4)
        uses = record(model, F.sum(model(x1, x2) ** 2) / 4, 4)
    # 1 byte: chunks of one example, an im2col per use and example
    assert len(own_im2col) == (0 if max_memory > 1 else 2 * 4)
    by_param = {}
    for use, rows, p in uses:
        by_param.setdefault(id(p), []).append((use, rows))
    for p, s in zip(stats.params, sums):
        if id(p) in by_param:
            want = use_module._reference_combined_sqsum(by_param[id(p)], 4,
                                                        2 ** 30)
            assert_close(s, want, str(p.shape))


def test_column_capture_binds_either_signature(monkeypatch):
    """im2col_gpu has no ``pval``: its third-from-last positional argument
    is cover_all, not pval.  The capture wraps both as Chainer calls them
    (positionally and by keyword), here with a CPU stand-in of the GPU
    function's signature; a non-zero pval (CPU) is not kept."""
    from chainer.utils import conv as conv_utils
    from chainer_vgc.statistics.im2col import ColumnCapture

    def im2col_gpu(img, kh, kw, sy, sx, ph, pw, cover_all=False, dy=1,
                   dx=1, out_h=None, out_w=None):
        return conv_utils.im2col_cpu(img, kh, kw, sy, sx, ph, pw,
                                     cover_all=cover_all, dy=dy, dx=dx,
                                     out_h=out_h, out_w=out_w)
    monkeypatch.setattr(conv_utils, 'im2col_gpu', im2col_gpu)
    img = numpy.random.default_rng(10).normal(size=(2, 3, 7, 7))

    class Node(object):
        sy, sx, ph, pw, dy, dx, cover_all = 2, 2, 1, 1, 1, 1, True

    with ColumnCapture() as capture:
        col = conv_utils.im2col_gpu(img, 3, 3, 2, 2, 1, 1, True, 1, 1)
        assert capture.take(img, Node, 3, 3) is col
        col = conv_utils.im2col_gpu(img, 3, 3, 2, 2, 1, 1, cover_all=True)
        assert capture.take(img, Node, 3, 3) is col
        conv_utils.im2col_gpu(img, 3, 3, 2, 2, 1, 1, False)
        assert capture.take(img, Node, 3, 3) is None   # not cover_all
        col = conv_utils.im2col_cpu(img, 3, 3, 2, 2, 1, 1, 0, True)
        assert capture.take(img, Node, 3, 3) is col
        conv_utils.im2col_cpu(img, 3, 3, 2, 2, 1, 1, -1.0, True)
        assert capture.take(img, Node, 3, 3) is None   # padded with -1
    assert conv_utils.im2col_gpu is im2col_gpu


def test_linear_one_row_is_the_earlier_shortcut_bit_for_bit():
    """The MLP's statistics (Linear, one row per example: the demo) are the
    very numbers of the shortcut before issue 26, (gy**2)^T (x**2) by one
    dot per chunk, so `make demo`'s figures do not move."""
    rng = numpy.random.default_rng(11)
    lin = L.Linear(784, 200)
    x = rng.normal(size=(32, 784)).astype(numpy.float32)
    uses = record(lin, F.sum(F.tanh(lin(x))) / 32, 32)
    (use, rows, p), = uses
    got = use.sqsum(rows, 64 * 2 ** 20, work=contraction.Workspace())
    gy, xs = use.gy, use.x
    numpy.testing.assert_array_equal(got, numpy.dot((gy * gy).T, xs * xs))


@pytest.mark.parametrize('t,m,n', [(10, 4, 5), (6, 7, 3), (2, 5, 5)])
def test_linear_one_block_is_the_blocked_product_bit_for_bit(t, m, n):
    """Rows of T tokens per example whose products fit one block take
    _LinearW._one_block: the same matmul and square-sum as the general
    blocked loop of sum_squared_products, so the same bits; past a block
    (a tiny max_memory) it is not taken and the general loop runs."""
    rng = numpy.random.default_rng(40 + t)
    b = 6
    x = rng.normal(size=(b * t, n)).astype(numpy.float32)
    gy = rng.normal(size=(b * t, m)).astype(numpy.float32)
    use = handlers._LinearW(numpy, numpy.dtype(numpy.float32), x, gy)
    work = contraction.Workspace()
    fast = use._one_block(t, 2 ** 30, None, work)
    if contraction.uses_gram(numpy, t):
        assert fast is None  # few tokens: the Gram formulation instead
        return
    general = contraction.sum_squared_products(
        use.operands(), b, 2 ** 30, contraction.Workspace(), rows=t)
    numpy.testing.assert_array_equal(fast, general)
    numpy.testing.assert_array_equal(use.sqsum(t, 2 ** 30, work=work),
                                     general)
    assert use._one_block(t, 16, None, work) is None
    want = use.reference_sqsum(t, 2 ** 30)
    numpy.testing.assert_allclose(use.sqsum(t, 16), want, rtol=1e-5)


def _embed_use(rng, ids_shape, vocab, d, ignore):
    ids = rng.integers(0, vocab, ids_shape).astype(numpy.int32)
    if ignore is not None:
        ids.reshape(-1)[::3] = ignore
    gy = rng.normal(size=ids_shape + (d,))
    return handlers._EmbedW(numpy, numpy.dtype(numpy.float64), ids, gy,
                            (vocab, d), ignore)


@pytest.mark.parametrize('ids_shape,group', [((8,), 1), ((4, 5), 1),
                                             ((12,), 3)])
@pytest.mark.parametrize('ignore', [None, -1])
def test_embed_one_hot_operands_are_its_sparse_sums(ids_shape, group,
                                                    ignore):
    """EmbedID's one-hot product (the one a tied output projection
    concatenates with) gives the sums of its sparse path and of the
    definition, with ignored tokens and rows of several examples."""
    rng = numpy.random.default_rng(41)
    use = _embed_use(rng, ids_shape, 7, 3, ignore)
    b = use.rows // group
    want = use.reference_sqsum(group, 2 ** 30)
    assert_close(use.sqsum(group, 2 ** 30), want, 'sparse')
    for mem in (2 ** 30, 200):
        got = contraction.sum_squared_products(
            use.operands(), b, mem, contraction.Workspace(), rows=group)
        assert_close(got, want, 'one-hot, max_memory {}'.format(mem))


def test_embed_alone_stays_sparse_and_tied_uses_take_the_product(
        monkeypatch):
    """Two EmbedID uses of one table are combined by the readable
    definition (no dense one-hot product of a large vocabulary); with a
    tied output projection, by the concatenated product; both equal the
    definition."""
    rng = numpy.random.default_rng(42)
    a = _embed_use(rng, (4, 5), 7, 3, -1)
    b = _embed_use(rng, (4, 2), 7, 3, None)
    taken = []
    real = contraction.concatenate
    monkeypatch.setattr(contraction, 'concatenate',
                        lambda parts: taken.append(len(parts)) or
                        real(parts))
    pair = [(a, 1), (b, 1)]
    assert_close(use_module._combined_sqsum(pair, 4, 2 ** 30),
                 use_module._reference_combined_sqsum(pair, 4, 2 ** 30),
                 'two embeddings')
    assert taken == []
    h = rng.normal(size=(4 * 6, 3))
    g_logits = rng.normal(size=(4 * 6, 7))  # the projection F.linear(h, W)
    proj = handlers._LinearW(numpy, numpy.dtype(numpy.float64), h, g_logits)
    tied = [(a, 1), (b, 1), (proj, 6)]
    assert_close(use_module._combined_sqsum(tied, 4, 2 ** 30, None,
                                            contraction.Workspace()),
                 use_module._reference_combined_sqsum(tied, 4, 2 ** 30),
                 'tied')
    assert taken == [3]
