"""The native CPU backend against the NumPy reference, bit for bit.

Both builds of ``kernels/vgc_host.cpp`` (baseline and AVX2, where the
processor has it) run every rule on the same inputs as the NumPy path
(``backend='numpy'``): messages, residual states and decoded gradients must
be identical, byte for byte, including float16/float64 parameters, edge
values, empty and full selections, missing gradients, one and several
threads, and tensors large enough to be split between threads.  Faults
(NaN/Inf gradients, bad sums of squares, overflow, corrupt messages) must
raise what the reference raises and leave the state unchanged.
"""

import collections
import contextlib
import os
import subprocess
import sys

import chainer
from hypothesis import given
from hypothesis import strategies as st
import numpy
import pytest

from chainer_vgc.backends import arrays
from chainer_vgc import codec
from chainer_vgc.codec.gap import bits_to_words
from chainer_vgc.codec.header import f32_bits
from chainer_vgc.codec.message import walk
from chainer_vgc.exchange import mean as exchange_mean
from chainer_vgc import GradientCompressor
from chainer_vgc.engines.native import bindings
from chainer_vgc.engines.native import gap as native_gap
from chainer_vgc import WireFormatError
from wire_messages import random_message

# on both stacks (make test): its results depend on NumPy, the native
# build or the installed packages (docs/contributing.md)
pytestmark = pytest.mark.stack

DTYPES = [numpy.float16, numpy.float32, numpy.float64]
METHODS = [
    ('vgc', dict(alpha=1.5)),
    ('vgc', dict(alpha=1.0, quantize=False)),
    ('vgc', dict(alpha=1.0, keep_unrepresentable=True)),
    ('hybrid', dict(alpha=1.5, tau=1e-3)),
    ('strom', dict(tau=1e-3)),
    ('none', {}),
    ('qsgd', dict(bits=3, bucket=5, seed=3)),
]
ISAS = ['baseline'] + (['avx2'] if bindings.library_path('avx2') else [])
#: the builds this processor runs (the AVX2 one where it has AVX2)
RUNNABLE_ISAS = [i for i in ISAS
                 if i != 'avx2' or bindings.load().vgc_native_cpu_has_avx2()]
#: every build x one and two threads: the costly families compute their
#: NumPy reference once and check each of these against it
VARIANTS = [(i, t) for i in RUNNABLE_ISAS for t in (1, 2)]


#: each build opened (and checked: its signatures, source hash and
#: constants) once, by bindings._open, then reused: the library is the
#: same copy at every dlopen anyway
_OPENED = {}


@contextlib.contextmanager
def native_build(isa, threads=None):
    """Within the block, the native backend runs the build ``isa`` of the
    library with ``threads`` threads (None: as it was); both restored on
    leaving, also after a failure."""
    lib, before = bindings._lib, bindings.num_threads()
    if isa != bindings.isa():
        if isa not in _OPENED:
            _OPENED[isa] = bindings._open(isa)
        bindings._lib = _OPENED[isa]
    try:
        assert bindings.isa() == isa
        if threads is not None:
            bindings.set_num_threads(threads)
        yield
    finally:  # (on both builds: a later dlopen of one gets the same copy)
        bindings.set_num_threads(before)
        bindings._lib = lib
        bindings.set_num_threads(before)


@pytest.fixture(params=ISAS)
def isa(request):
    """Runs the test once with each build of the native library."""
    if request.param not in RUNNABLE_ISAS:
        pytest.skip('this processor has no AVX2')
    with native_build(request.param):
        yield request.param


@pytest.fixture(params=[1, 2])
def threads(request):
    before = bindings.num_threads()
    bindings.set_num_threads(request.param)
    yield request.param
    bindings.set_num_threads(before)


def test_variants_cover_every_build_and_two_threads():
    """The families that loop over VARIANTS instead of parametrizing run
    each build of the library this machine can run, with 1 and 2 threads;
    native_build switches the build and restores it."""
    assert {i for i, _ in VARIANTS} == set(RUNNABLE_ISAS) >= {'baseline'}
    assert {t for _, t in VARIANTS} == {1, 2}
    lib, threads = bindings._lib, bindings.num_threads()
    for i, t in VARIANTS:
        with native_build(i, t):
            assert bindings.isa() == i and bindings.num_threads() == t
    assert bindings._lib is lib and bindings.num_threads() == threads


def _bytes(a):
    return None if a is None else numpy.ascontiguousarray(a).view(numpy.uint8)


def _assert_same(a, b, what):
    assert (a is None) == (b is None), what
    if a is not None:
        assert a.dtype == b.dtype and a.shape == b.shape, what
        assert numpy.array_equal(_bytes(a), _bytes(b)), what


def _every_build_decodes_as(want, blocks, sizes, dtypes, what):
    """Each build of the native decoder (RUNNABLE_ISAS) on ``blocks``:
    with ``want`` (the reference's sums) it accepts them and sums to
    ``want`` bit for bit; with ``want`` None (the reference refused) it
    refuses and writes nothing."""
    for isa in RUNNABLE_ISAS:
        with native_build(isa):
            outs = [numpy.full(n, 5, dt) for n, dt in zip(sizes, dtypes)]
            result = bindings.decode_mean(blocks, sizes, dtypes, outs,
                                          [False] * len(sizes), 1.0)
        if want is None:
            assert result is None, (what, isa)
            assert all((o == 5).all() for o in outs), (what, isa)
            continue
        assert result is not None, (what, isa)
        for o, w in zip(outs, want):
            _assert_same(o, w, (what, isa))


def _edge_values(rng, n, dtype):
    """Gradients mixing ordinary values with zeros, subnormals, powers of
    two, ties 1.5 * 2**e, huge and tiny magnitudes."""
    fi = numpy.finfo(dtype)
    special = numpy.array(
        [0.0, -0.0, fi.tiny, -fi.tiny, fi.tiny / 4, 1.0, -1.0, 1.5, -1.5,
         3.0 * 2.0 ** -20, 2.0 ** -126, float(numpy.sqrt(fi.max)) / 4,
         1e-30, 1e-8],
        dtype=numpy.float64)
    x = rng.normal(size=n) * 10.0 ** rng.integers(-9, 1, size=n)
    pick = rng.random(n) < 0.2
    x[pick] = rng.choice(special, size=int(pick.sum()))
    with numpy.errstate(over='ignore', under='ignore'):
        return x.astype(dtype)


def _compressors(method, kw, shapes, dtype):
    names = ['p{}'.format(i) for i in range(len(shapes))]
    return [GradientCompressor(method, names, shapes, [dtype] * len(shapes),
                               backend=b, **kw) for b in ('numpy', 'native')]


def _step(rng, shapes, dtype, missing=()):
    sdt = arrays.state_dtype(dtype)
    grads = [_edge_values(rng, int(numpy.prod(s)), dtype).reshape(s)
             for s in shapes]
    sqsums = [(g.astype(numpy.float64) ** 2 * rng.uniform(0.2, 4, g.shape)
               ).astype(sdt) for g in grads]
    for i in missing:
        grads[i] = sqsums[i] = None
    return grads, sqsums


def test_a_group_table_that_does_not_add_up_is_refused(monkeypatch):
    """The group table the validating walk returns accounts for every
    element of every message; a library that left it empty (built before
    the table existed: the extra arguments ignored) is refused, naming the
    fix, instead of giving the device decode empty descriptors."""
    sizes = [50, 7]
    comp = GradientCompressor('vgc', ['a', 'b'], [(50,), (7,)],
                              [numpy.float32] * 2, alpha=0.1)
    rng = numpy.random.default_rng(0)
    gs = [rng.normal(0, 1, n).astype(numpy.float32) for n in sizes]
    blocks = [comp.compress(gs, [g * g for g in gs]).copy()] * 2
    sdts = [numpy.float32] * 2
    got = bindings.decode_mean(blocks, sizes, sdts, [None] * 2, [0] * 2, 1.0,
                               table=True)
    assert got[2][:, 3].sum() == sum(got[1]) > 0  # (count column)
    lib = bindings.load()

    class Stale(object):
        def __getattr__(self, name):
            return getattr(lib, name)

        def vgc_native_decode(self, *args):
            return lib.vgc_native_decode(*args[:-2], None, args[-1])
    stale = Stale()
    monkeypatch.setattr(bindings, 'load', lambda: stale)
    with pytest.raises(bindings.NativeBackendError, match='rebuild'):
        bindings.decode_mean(blocks, sizes, sdts, [None] * 2, [0] * 2, 1.0,
                             table=True)


@pytest.mark.parametrize('method,kw', METHODS)
@pytest.mark.parametrize('dtype', DTYPES)
def test_compress_is_bit_identical_to_numpy(method, kw, dtype):
    """Messages and states over several steps, on tensors of 0 to 200,003
    elements (split between threads), with missing gradients: every build
    with 1 and 2 threads (VARIANTS) against one NumPy reference."""
    rng = numpy.random.default_rng(hash((method, str(kw), str(dtype))) % 2**32)
    shapes = [(0,), (1,), (17,), (5, 7), (70001,), (200003,)]
    ref_comp = _compressors(method, kw, shapes, dtype)[0]
    natives = {v: _compressors(method, kw, shapes, dtype)[1]
               for v in VARIANTS}
    assert not ref_comp.uses_native([None])
    for step in range(5):
        grads, sqsums = _step(rng, shapes, dtype,
                              missing=(2,) if step == 3 else ())
        with numpy.errstate(all='ignore'):
            ref = ref_comp.compress(grads, sqsums)
        for v, comp in natives.items():
            assert comp.uses_native([None])
            with native_build(*v):
                got = comp.compress(grads, sqsums)
            _assert_same(ref, got, (method, dtype, step, v, 'message'))
            assert ref_comp.last_sent == comp.last_sent
            assert ref_comp.last_bytes == comp.last_bytes
            for i, (a, b) in enumerate(zip(ref_comp.states, comp.states)):
                assert (a is None) == (b is None)
                for key in (a or {}):
                    _assert_same(a[key], b[key], (method, step, v, i, key))


@given(seed=st.integers(0, 2 ** 31), n=st.integers(1, 300),
       alpha=st.sampled_from([1e-30, 0.5, 1.0, 2.0, 1e30]),
       tau=st.sampled_from([1e-30, 1e-3, 1.0, 1e30]),
       dtype=st.sampled_from(DTYPES))
def test_compress_matches_numpy_on_hypothesis_data(seed, n, alpha, tau,
                                                   dtype):
    """Empty and full selections (alpha, tau tiny or huge) included."""
    rng = numpy.random.default_rng(seed)
    for method, kw in [('vgc', dict(alpha=alpha)),
                       ('vgc', dict(alpha=alpha, quantize=False)),
                       ('hybrid', dict(alpha=alpha, tau=tau)),
                       ('strom', dict(tau=tau))]:
        comps = _compressors(method, kw, [(n,)], dtype)
        for _ in range(3):
            grads, sqsums = _step(rng, [(n,)], dtype)
            with numpy.errstate(all='ignore'):
                ref = comps[0].compress(grads, sqsums)
            _assert_same(ref, comps[1].compress(grads, sqsums), method)
            for key in comps[0].states[0]:
                _assert_same(comps[0].states[0][key],
                             comps[1].states[0][key], key)


@pytest.mark.parametrize('bucket', [1, 7, 8, 127, 128, 129, 1000, 8192, 8193,
                                    20000, 65537])
@pytest.mark.parametrize('dtype', DTYPES)
def test_qsgd_bucket_norms_round_as_numpy(bucket, dtype):
    """The bucket norms reproduce NumPy's pairwise summation, including its
    8192-element pieces and the zero padding of the last bucket."""
    rng = numpy.random.default_rng(bucket)
    shapes = [(2 * bucket + 3,), (3,)]
    comps = _compressors('qsgd', dict(bits=4, bucket=bucket, seed=1),
                         shapes, dtype)
    for _ in range(2):
        grads = [(rng.normal(size=s) * 10.0 ** rng.integers(-6, 3, size=s))
                 .astype(dtype) for s in shapes]
        _assert_same(comps[0].compress(grads), comps[1].compress(grads),
                     bucket)


def test_qsgd_bad_gradient_draws_nothing():
    """A NaN in the second tensor: no tensor is quantized, the generator
    does not move (the next step equals the reference's)."""
    comps = _compressors('qsgd', dict(seed=2), [(5,), (6,)], numpy.float32)
    good = [numpy.ones(5, numpy.float32), numpy.ones(6, numpy.float32)]
    bad = [good[0], numpy.full(6, numpy.nan, numpy.float32)]
    for c in comps:
        with pytest.raises(FloatingPointError, match="'p1'"):
            c.compress(bad)
    _assert_same(comps[0].compress(good), comps[1].compress(good), 'next')


def test_full_and_empty_selection_formats():
    """alpha tiny sends every element (dense raw group without index
    words); alpha huge sends nothing (no group at all)."""
    g = [numpy.arange(1, 9, dtype=numpy.float32)]
    s = [numpy.ones(8, numpy.float32)]
    full = GradientCompressor('vgc', ['w'], [(8,)], [numpy.float32],
                              backend='native', alpha=1e-30, quantize=False)
    msg = full.compress(g, s)
    assert msg[3] == codec.FMT_RAW and msg[5] & codec.RAW_DENSE
    assert numpy.array_equal(msg[7:].view(numpy.float32), g[0])
    none = GradientCompressor('vgc', ['w'], [(8,)], [numpy.float32],
                              backend='native', alpha=1e30)
    assert none.compress(g, s).tolist() == [codec.MAGIC, 0]


class _Param(object):
    """What mean_gradients needs of a chainer.Parameter."""

    def __init__(self, shape, dtype):
        self.array = numpy.zeros(shape, dtype)
        self.shape, self.dtype, self.size = shape, numpy.dtype(dtype), \
            self.array.size
        self.grad = None


def _mean(blocks, comp, shapes, dtype, grads, zero_fill, dense=False):
    params = [_Param(s, dtype) for s in shapes]
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.copy()
    elements = exchange_mean.mean_gradients(
        blocks, comp, params, [p.grad for p in params], len(blocks),
        zero_fill, dense)
    return [p.grad for p in params], elements


@pytest.mark.parametrize('method,kw', METHODS)
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('ranks', [1, 3, 4])
def test_decode_mean_is_bit_identical_to_numpy(method, kw, dtype, ranks):
    """mean_gradients on the native backend, every build with 1 and 2
    threads (VARIANTS), equals the NumPy backend's, with and without
    zero_fill, a parameter without gradient on this rank."""
    rng = numpy.random.default_rng(ranks)
    shapes = [(3,), (1,), (70001,), (6, 5), (133333,)]
    workers = [_compressors(method, kw, shapes, dtype)[1]
               for _ in range(ranks)]
    for step in range(3):
        blocks = [w.compress(*_step(rng, shapes, dtype)) for w in workers]
        local = [rng.normal(size=s).astype(dtype) for s in shapes]
        local[1] = None  # a parameter without gradient on this rank
        for zero_fill in (False, True):
            workers[0].backend = 'numpy'
            want = _mean(blocks, workers[0], shapes, dtype, local,
                         zero_fill, dense=method == 'none')
            workers[0].backend = 'native'
            for v in VARIANTS:
                with native_build(*v):
                    got = _mean(blocks, workers[0], shapes, dtype, local,
                                zero_fill, dense=method == 'none')
                what = (method, dtype, ranks, zero_fill, v)
                for a, c in zip(want[0], got[0]):
                    _assert_same(a, c, what)
                assert list(want[1]) == list(got[1]), what


def test_decode_mean_without_scale_and_counts():
    """The low-level call: sums in rank order, elements per message."""
    sizes = [4, 70000]
    a = codec.pack([codec.raw_group(0, numpy.array([1, 3]),
                                    numpy.array([1.0, 2.0], numpy.float32),
                                    4)])
    b = codec.pack([codec.raw_group(0, numpy.array([3]),
                                    numpy.array([0.5], numpy.float32), 4),
                    codec.raw_group(1, numpy.array([69999]),
                                    numpy.array([7.0], numpy.float32),
                                    70000)])
    outs = [numpy.full(4, 9, numpy.float32), numpy.full(70000, 9,
                                                        numpy.float32)]
    touched, elements = bindings.decode_mean(
        [a, b], sizes, [numpy.float32] * 2, outs, [False, True], 0.5)
    assert outs[0].tolist() == [0, 1, 0, 2.5]
    assert outs[1][69999] == 3.5 and not outs[1][:69999].any()
    assert touched.tolist() == [3, 1] and elements.tolist() == [2, 2]


def _corrupt(rng, msg):
    bad = msg.copy()
    how = int(rng.integers(0, 5))
    if how == 0 and bad.size:
        bad = bad[:int(rng.integers(0, bad.size))]
    elif how == 1 and bad.size:
        pos = int(rng.integers(0, bad.size))
        bad[pos] ^= numpy.uint32(1 << int(rng.integers(0, 32)))
    elif how == 2:
        bad = numpy.append(bad, rng.integers(0, 2 ** 32, size=int(
            rng.integers(1, 4)), dtype=numpy.uint32))
    elif how == 3 and bad.size > 3:
        i, j = rng.choice(bad.size, 2, replace=False)
        bad[[i, j]] = bad[[j, i]]
    elif bad.size:
        bad[int(rng.integers(0, bad.size))] = rng.integers(
            0, 2 ** 32, dtype=numpy.uint32)
    return bad


@pytest.mark.parametrize('state_dtype', [numpy.float32, numpy.float64])
def test_corrupt_messages_are_rejected_as_the_reference_rejects(state_dtype):
    """Thousands of corruptions: every build of the native decoder accepts
    exactly the messages the reference accepts, decodes them to the same
    sums, and mean_gradients raises the reference's WireFormatError for
    the others, leaving the gradients untouched."""
    rng = numpy.random.default_rng(7)
    sizes = [7, 1, 33, 100, 5]
    dtypes = [state_dtype] * len(sizes)
    comp = GradientCompressor('vgc', [str(i) for i in sizes],
                              [(n,) for n in sizes], dtypes)
    rejected = 0
    for trial in range(1500):
        good, _ = random_message(rng, sizes, pow2_scale=0.75)
        bad = _corrupt(rng, good)
        blocks = [good, bad] if trial % 2 else [bad]
        try:
            for blk in blocks:
                codec.unpack(blk, sizes, dtypes)
            ref_error = None
        except WireFormatError as e:
            ref_error = str(e)
        want = None
        if ref_error is None:
            want = [numpy.zeros(n, state_dtype) for n in sizes]
            for blk in blocks:
                codec.decode_into(blk, want, sizes)
        else:
            rejected += 1
        for isa in RUNNABLE_ISAS:
            with native_build(isa):
                outs = [numpy.full(n, 5, state_dtype) for n in sizes]
                result = bindings.decode_mean(blocks, sizes, dtypes, outs,
                                              [False] * len(sizes), 1.0)
                if ref_error is None:
                    assert result is not None, (trial, isa)
                    for o, w in zip(outs, want):
                        _assert_same(o, w, (trial, isa))
                    continue
                assert result is None, (trial, isa, ref_error)
                assert all((o == 5).all() for o in outs)  # nothing written
                params = [_Param((n,), state_dtype) for n in sizes]
                grads = [numpy.full(n, 5, state_dtype) for n in sizes]
                for p, g in zip(params, grads):
                    p.grad = g
                with pytest.raises(WireFormatError) as info:
                    exchange_mean.mean_gradients(blocks, comp, params, grads,
                                                 len(blocks), True, False)
                assert str(info.value) == ref_error
                assert all((g == 5).all() for g in grads)
    assert rejected > 500


@pytest.mark.parametrize('method', ['vgc', 'hybrid', 'strom', 'none'])
@pytest.mark.parametrize('where,bad', [('grad', numpy.nan),
                                       ('grad', -numpy.inf),
                                       ('sqsum', numpy.nan),
                                       ('sqsum', -1.0)])
def test_faults_raise_like_numpy_and_keep_state(method, where, bad):
    rng = numpy.random.default_rng(0)
    shapes = [(4,), (70001,)]
    comps = _compressors(method, dict(alpha=1.0) if method != 'none' and
                         method != 'strom' else {}, shapes, numpy.float32)
    grads, sqsums = _step(rng, shapes, numpy.float32)
    for c in comps:
        c.compress(grads, sqsums)
    before = [{k: a.copy() for k, a in (st or {}).items()}
              for st in comps[1].states]
    grads, sqsums = _step(rng, shapes, numpy.float32)
    (grads if where == 'grad' else sqsums)[1][12345] = bad
    needs = comps[0].rule.needs_sqsum
    if where == 'sqsum' and not needs:
        return
    errors = []
    for c in comps:
        with pytest.raises(FloatingPointError) as info:
            c.compress(grads, sqsums)
        errors.append(str(info.value))
    assert errors[0] == errors[1] and "'p1'" in errors[0]
    for st, old in zip(comps[1].states, before):
        for key in old:
            _assert_same(st[key], old[key], key)


def test_overflow_leaves_native_state_unchanged():
    """With spare residuals, even an overflow the passes find leaves the
    state as it was (in place, the default, it is raised and further steps
    are refused: tests/test_faults.py)."""
    comp = GradientCompressor('strom', ['w'], [(3,)], [numpy.float32],
                              backend='native', tau=1e30,
                              spare_residuals=True)
    big = numpy.float32(3e38)
    comp.compress([numpy.array([big, 1, 1], numpy.float32)])
    before = comp.states[0]['r'].copy()
    with pytest.raises(FloatingPointError, match="accumulated r of "
                       "parameter 'w' overflowed.*unchanged"):
        comp.compress([numpy.array([big, 1, 1], numpy.float32)])
    _assert_same(comp.states[0]['r'], before, 'r')


def test_message_view_is_reused_only_without_copy():
    comp = GradientCompressor('vgc', ['w'], [(8,)], [numpy.float32],
                              backend='native', alpha=1e-30)
    g, s = [numpy.ones(8, numpy.float32)], [numpy.ones(8, numpy.float32)]
    kept = comp.compress(g, s)
    view = comp.compress(g, s, copy=False)
    assert not numpy.shares_memory(kept, view)
    first = view.copy()
    comp.compress([2 * g[0]], s, copy=False)
    assert not numpy.array_equal(first, view)  # overwritten, as documented


def test_constants_match_codec_and_source_hash():
    lib = bindings.load()
    bindings._check_constants(lib)
    assert lib.vgc_native_source_hash().decode() == bindings.source_hash()


def test_missing_or_stale_build_is_reported_with_the_fix(monkeypatch):
    monkeypatch.setattr(bindings, '_lib', None)
    monkeypatch.setattr(bindings, 'source_hash', lambda: 'f' * 64)
    with pytest.raises(bindings.NativeBackendError,
                       match='stale build.*pip install.*CHAINER_VGC_BACKEND'):
        bindings.load()
    monkeypatch.setattr(bindings, 'library_path', lambda isa='baseline': None)
    with pytest.raises(bindings.NativeBackendError,
                       match='not built.*pip install.*CHAINER_VGC_BACKEND'
                       '=numpy'):
        GradientCompressor('vgc', ['w'], [(2,)], [numpy.float32])
    # the NumPy reference needs no build
    GradientCompressor('vgc', ['w'], [(2,)], [numpy.float32],
                       backend='numpy')


def test_backend_choice(monkeypatch):
    monkeypatch.setenv('CHAINER_VGC_BACKEND', 'numpy')
    assert GradientCompressor('vgc', ['w'], [(2,)],
                              [numpy.float32]).backend == 'numpy'
    monkeypatch.setenv('CHAINER_VGC_BACKEND', 'fortran')
    with pytest.raises(ValueError, match='CHAINER_VGC_BACKEND.*fortran'):
        GradientCompressor('vgc', ['w'], [(2,)], [numpy.float32])
    monkeypatch.delenv('CHAINER_VGC_BACKEND')
    assert GradientCompressor('vgc', ['w'], [(2,)],
                              [numpy.float32]).backend == 'native'
    monkeypatch.setenv('CHAINER_VGC_NATIVE_ISA', 'sse9')
    monkeypatch.setattr(bindings, '_lib', None)
    with pytest.raises(bindings.NativeBackendError,
                       match='CHAINER_VGC_NATIVE_ISA'):
        bindings.load()


def test_default_threads_divide_the_cores(monkeypatch):
    monkeypatch.delenv('OMP_NUM_THREADS', raising=False)
    cores = len(os.sched_getaffinity(0))
    assert bindings.default_threads(1) == cores
    assert bindings.default_threads(cores * 2) == 1
    monkeypatch.setenv('OMP_NUM_THREADS', '3')
    assert bindings.default_threads(1) is None


def test_omp_num_threads_is_respected():
    code = ('from chainer_vgc.engines.native import bindings; '
            'print(bindings.num_threads())')
    env = dict(os.environ, OMP_NUM_THREADS='3')
    out = subprocess.run([sys.executable, '-c', code], env=env, check=True,
                         capture_output=True, text=True).stdout
    assert out.strip() == '3'


def test_trainer_step_identical_on_both_backends():
    """One Chainer model, two optimizer steps through SimulatedWorkers on
    each backend: the parameters end identical."""
    from chainer_vgc.harness.models import MLP
    from chainer_vgc.harness.simulation import SimulatedWorkers
    import chainer.links as L
    results = []
    for b in ('numpy', 'native'):
        os.environ['CHAINER_VGC_BACKEND'] = b
        try:
            numpy.random.seed(0)
            model = L.Classifier(MLP((16,), 3))
            model(numpy.zeros((1, 6), numpy.float32),
                  numpy.zeros(1, numpy.int32))  # initialize lazy params
            opt = chainer.optimizers.Adam()
            opt.setup(model)
            sim = SimulatedWorkers(model, opt, 3, 'vgc', alpha=1.0)
            rng = numpy.random.default_rng(1)
            for _ in range(4):
                batches = [(rng.normal(size=(5, 6)).astype(numpy.float32),
                            rng.integers(0, 3, 5).astype(numpy.int32))
                           for _ in range(3)]
                sim.update(model, batches)
            assert sim.compressor.backend == b
            assert 0 < sim.totals['elements'] < 3 * 4 * sum(
                p.size for p in model.params())  # compressed, not empty
            results.append([p.array.copy() for p in model.params()])
        finally:
            del os.environ['CHAINER_VGC_BACKEND']
    for a, c in zip(*results):
        _assert_same(a, c, 'param')


def _qsgd_message(scale, level):
    """One FMT_QSGD group (3 elements, one bucket, element 1 at
    ``level`` times the float64 ``scale``)."""
    return codec.pack([codec.qsgd_group(
        0, numpy.array([0, level, 0]), numpy.array([False, True, False]),
        numpy.array([scale], numpy.float64), 3, 3)])


@pytest.mark.parametrize('msg,rejecting', [
    (_qsgd_message(2e38, 3), [numpy.float32]),
    (_qsgd_message(1e308, 2), [numpy.float32, numpy.float64]),
    (codec.pack([codec.raw_group(0, numpy.array([2]),
                                 numpy.array([1e300]), 3)]),
     [numpy.float32]),
])
def test_values_that_overflow_the_state_dtype_are_rejected(msg, rejecting,
                                                           isa):
    """Finite on the wire, not finite once decoded into the state dtype:
    both decoders reject it; in a dtype where it is finite both decode it
    to the same values."""
    for dtype in (numpy.float32, numpy.float64):
        out = numpy.full(3, 5, dtype)
        result = bindings.decode_mean([msg], [3], [dtype], [out], [False], 1.0)
        if dtype in rejecting:
            with pytest.raises(WireFormatError, match='value out of range'):
                codec.unpack(msg, [3], [dtype])
            assert result is None and (out == 5).all()
        else:
            want = numpy.zeros(3, dtype)
            codec.decode_into(msg, [want], [3])
            assert result is not None and numpy.isfinite(out).all()
            _assert_same(out, want, dtype)


def _float64_fields(groups):
    """Message positions of the high words (sign, exponent) of the float64
    fields of ``groups`` packed: QSGD scales and float64 raw values, as
    (position, format)."""
    fields, pos = [], 2
    for g in groups:
        pos += codec.HEADER_WORDS
        if g.fmt == codec.FMT_QSGD:
            fields += [(pos + codec.QSGD_RECORD_WORDS * k + 3, g.fmt)
                       for k in range(g.a)]
        elif g.fmt == codec.FMT_RAW and g.a & codec.RAW_FLOAT64:
            start = pos + (0 if g.a & codec.RAW_DENSE else g.count)
            fields += [(start + 2 * j + 1, g.fmt) for j in range(g.count)]
        pos += int(g.body.size)
    return fields


def _set_exponent(rng, msg, groups):
    """Sets the exponent field of a float64 scale or raw value: half the
    time one of the top four (1e307 .. Inf/NaN), else one that overflows
    float32 once multiplied by a level.  Returns (message, format) or
    (message, None) where the message has no float64 field."""
    fields = _float64_fields(groups)
    if not fields:
        return _corrupt(rng, msg), None
    pos, fmt = fields[int(rng.integers(0, len(fields)))]
    e = (2047 - int(rng.integers(0, 4)) if rng.random() < 0.5
         else int(rng.integers(1100, 2047)))
    bad = msg.copy()
    bad[pos] = (bad[pos] & numpy.uint32(0x800FFFFF)) | numpy.uint32(e << 20)
    return bad, fmt


@pytest.mark.parametrize('state_dtype', [numpy.float32, numpy.float64])
def test_no_corrupt_message_decodes_to_non_finite_values(state_dtype):
    """Thousands of corruptions of messages of every format (truncations,
    bit flips, random, appended and swapped words, exponent fields of
    float64 scales and values set high): every message the reference
    accepts decodes to finite values in the state dtype, every build of the
    native decoder accepts exactly those, with the same finite sums, and writes nothing
    for the others.  Scales and values finite on the wire whose decoded
    value overflows the state dtype must occur and be rejected."""
    rng = numpy.random.default_rng(11)
    sizes = [7, 1, 33, 100, 5]
    dtypes = [state_dtype] * len(sizes)
    overflow = collections.Counter()
    accepted = set()
    for trial in range(3000):
        good, groups = random_message(rng, sizes)
        fmt = None
        if trial % 2:
            bad, fmt = _set_exponent(rng, good, groups)
        else:
            bad = _corrupt(rng, good)
        try:
            decoded = codec.unpack(bad, sizes, dtypes)
            error = None
        except WireFormatError as e:
            error = str(e)
        if error is not None:
            _every_build_decodes_as(None, [bad], sizes, dtypes,
                                    (trial, error))
            if 'value out of range for' in error:
                overflow[fmt] += 1
            continue
        want = [numpy.zeros(n, state_dtype) for n in sizes]
        codec.decode_into(bad, want, sizes)
        for d in decoded:
            assert d.value.dtype == state_dtype
            assert numpy.isfinite(d.value).all(), (trial, d)
            accepted.add(_format_of(bad, d.tensor_id))
        for w in want:
            assert numpy.isfinite(w).all(), trial
        _every_build_decodes_as(want, [bad], sizes, dtypes, trial)
    assert accepted == {codec.FMT_POW2, codec.FMT_RAW, codec.FMT_QSGD}
    assert overflow[codec.FMT_QSGD] >= 20, overflow
    if state_dtype == numpy.float32:
        assert overflow[codec.FMT_RAW] >= 20, overflow


def _format_of(msg, tensor_id):
    """Format of the group of ``tensor_id`` in a valid message."""
    return next(g.fmt for g in walk(msg, None)
                if g.tensor_id == tensor_id)


# ---- FMT_GAP: the native encoder and decoder against codec's reference ------

CODING_CODES = {name: code for code, name in enumerate(codec.CODINGS)}
GAP_RULES = ['vgc', 'vgc-keep', 'hybrid', 'strom']


def _gap_patterns(rng, size, count):
    """Sorted unique indices of ``count`` of ``size``: uniform, clustered
    (runs with huge gaps between them) and the extremes."""
    yield numpy.sort(rng.choice(size, count, replace=False))
    runs = max(1, count // 7)
    starts = numpy.sort(rng.choice(max(1, size - 8), runs, replace=False))
    clustered = numpy.unique((starts[:, None] + numpy.arange(8)).ravel())
    clustered = clustered[clustered < size][:count]
    if clustered.size:
        yield clustered
    yield numpy.arange(count)  # first elements, gaps 0
    yield numpy.arange(size - count, size)  # one big first gap


def test_gap_body_and_decode_match_codec(isa):
    """native_gap.gap_encode / gap_decode / rice_parameter equal codec's
    gap_body / gap_decode_body / rice_parameter on uniform, clustered and
    extreme index patterns, every k (escapes included), 4-bit and
    sign-only values, tensors up to 2**40 elements."""
    rng = numpy.random.default_rng(14)
    sizes = [1, 2, 3, 31, 32, 33, 100, 1000, 4099, 2 ** 20, 2 ** 40]
    for size in sizes:
        for count in sorted({1, 2, 3, 17, 64, 65, 500} & set(
                range(1, min(size, 500) + 1)) | {min(size, 500)}):
            assert native_gap.rice_parameter(count, size) == \
                codec.rice_parameter(count, size)
            for index in _gap_patterns(rng, size, count):
                n = index.size
                nib = rng.integers(0, 16, n).astype(numpy.uint8)
                for sign_only in (False, True):
                    if sign_only:
                        nib = nib & numpy.uint8(8)
                    ks = {codec.rice_parameter(n, size), 0, 1,
                          int(rng.integers(0, 64)), 63}
                    for k in ks:
                        want = codec.gap_body(index, nib, k, sign_only)
                        got = native_gap.gap_encode(index, nib, k, sign_only)
                        _assert_same(want, got, (size, n, k, sign_only))
                        ix, nb = native_gap.gap_decode(got, n, size)
                        assert numpy.array_equal(ix, index)
                        assert numpy.array_equal(nb, nib)
    assert native_gap.gap_encode([3, 4, 40], [1, 8, 2], 4, False).tolist() == \
        [4, 1, 0x7027, 0x281]  # the worked example of the spec
    with pytest.raises(ValueError):
        native_gap.gap_encode([3, 3], [0, 0], 0, False)
    with pytest.raises(ValueError):
        native_gap.gap_encode([1], [0], 64, False)


def _gap_body_corruptions(rng, body):
    """A FMT_GAP body with one fault, and what it is."""
    bad = body.copy()
    how = int(rng.integers(0, 9))
    if how == 0:  # a bit anywhere
        pos = int(rng.integers(0, bad.size))
        bad[pos] ^= numpy.uint32(1 << int(rng.integers(0, 32)))
    elif how == 1:  # the restart flag (bit 7) or a span bit
        bad[0] |= numpy.uint32(1 << int(rng.integers(7, 32)))
    elif how == 2:  # k
        bad[0] = (bad[0] & ~numpy.uint32(63)) | numpy.uint32(
            rng.integers(0, 64))
    elif how == 3:  # G off by one, the body length kept or not
        bad[1] = numpy.uint32((int(bad[1]) + int(rng.choice([-1, 1])))
                              % 2 ** 32)
        if rng.random() < 0.5:
            bad = numpy.append(bad, numpy.uint32(0))
    elif how == 4:  # a padding bit after the last code / value
        pos = int(rng.integers(1, bad.size)) if bad.size > 2 else 0
        bad[pos] |= numpy.uint32(0x80000000)
    elif how == 5:  # the sign-only flag
        bad[0] ^= numpy.uint32(codec.GAP_SIGN_ONLY)
    elif how == 6:  # truncated or extended
        bad = (bad[:int(rng.integers(0, bad.size))] if rng.random() < 0.5
               else numpy.append(bad, rng.integers(0, 2 ** 32, 2,
                                                   dtype=numpy.uint32)))
    elif how == 7:  # stream words zeroed (escapes of >= 64 zeros)
        g = int(body[1])
        if g:
            a = int(rng.integers(0, g))
            bad[2 + a:2 + a + int(rng.integers(1, 4))] = 0
    else:  # random words
        pos = int(rng.integers(0, bad.size))
        bad[pos] = rng.integers(0, 2 ** 32, dtype=numpy.uint32)
    return bad, how


def test_gap_decode_rejects_what_codec_rejects(isa):
    """native_gap.gap_decode accepts exactly the bodies codec.gap_decode_body
    accepts (with the same result), over thousands of corruptions, among
    them every decoder check of the format."""
    rng = numpy.random.default_rng(41)
    rejected = collections.Counter()
    for trial in range(4000):
        size = int(rng.choice([1, 5, 40, 300, 5000, 2 ** 33]))
        count = int(rng.integers(1, min(size, 60) + 1))
        index = list(_gap_patterns(rng, size, count))[trial % 2]
        count = index.size
        sign_only = bool(trial % 3 == 0)
        nib = rng.integers(0, 16, count).astype(numpy.uint8)
        if sign_only:
            nib &= numpy.uint8(8)
        k = (codec.rice_parameter(count, size) if trial % 4
             else int(rng.integers(0, 64)))
        body = codec.gap_body(index, nib, k, sign_only)
        bad, how = _gap_body_corruptions(rng, body)
        bad_count = count if trial % 5 else int(rng.integers(0, count + 2))
        try:
            want = codec.gap_decode_body(bad, bad_count, size)
        except WireFormatError:
            want = None
        got = native_gap.gap_decode(bad, bad_count, size)
        if want is None:
            rejected[how] += 1
            assert got is None, (trial, how)
        else:
            assert got is not None, (trial, how)
            assert numpy.array_equal(got[0], want[0])
            assert numpy.array_equal(got[1], want[1])
    assert all(rejected[how] >= 50 for how in range(9)), rejected


def test_gap_decode_extreme_codes(isa):
    """Hand-made streams: an Elias-gamma prefix of 63 zeros (largest
    allowed) that overruns any tensor, one of 64 zeros, gaps that land on
    the last element or one past it, k = 63."""
    def body(bits, count, vbits=4, param=None, k=0):
        stream = bits_to_words(numpy.array(bits, numpy.uint8))
        values = numpy.zeros(-(-count * vbits // 32), numpy.uint32)
        p = k if param is None else param
        return numpy.concatenate([numpy.array([p, stream.size],
                                              numpy.uint32), stream, values])

    def both(b, count, size):
        try:
            want = codec.gap_decode_body(b, count, size)
        except WireFormatError:
            want = None
        got = native_gap.gap_decode(b, count, size)
        assert (want is None) == (got is None)
        if want is not None:
            assert numpy.array_equal(want[0], got[0])
        return got

    esc = [0] * codec.GAP_ESCAPE
    # escape, n = 63: v = 2**63 | 1 -> q = v + 15: past any tensor
    b = body(esc + [0] * 63 + [1] + [1] + [0] * 62, 1)
    assert both(b, 1, 2 ** 62) is None
    # n = 64 zeros: refused
    assert both(body(esc + [0] * 64 + [1] + [0] * 64, 1), 1, 2 ** 62) is None
    # gap q = 16 (escape, n = 0): index 16, fine in 17, not in 16
    b = body(esc + [1], 1)
    assert both(b, 1, 17)[0].tolist() == [16]
    assert both(b, 1, 16) is None
    # k = 63: gap 2**62 in a tensor of 2**62 + 1
    b = body([1] + [0] * 62 + [1], 1, k=63)
    assert both(b, 1, 2 ** 62 + 1)[0].tolist() == [2 ** 62]
    assert both(b, 1, 2 ** 62) is None
    # a code running past the stream; an empty stream
    assert both(body([0] * 32, 1), 1, 100) is None
    assert both(body([], 1), 1, 100) is None


def _run_rule(rule, coding, g, s, state, kw, ws):
    """One native compress of ``rule`` with ``coding`` on copies of the
    state; returns (group words, elements, new state)."""
    sdt = arrays.state_dtype(g.dtype)
    n = g.size
    out = numpy.zeros(codec.pow2_max_words(n, coding), numpy.uint32)
    new = {key: numpy.empty(n, sdt) for key in state}
    old = {key: a.copy() for key, a in state.items()}
    code = CODING_CODES[coding]
    if rule.startswith('vgc'):
        words, count, flags = bindings.compress_vgc(
            ws, 3, g, s, old['r'], old['v'], new['r'], new['v'],
            kw['alpha'], kw['zeta'], True, rule == 'vgc-keep', out,
            coding=code)
    elif rule == 'hybrid':
        words, count, flags = bindings.compress_hybrid(
            ws, 3, g, s, old['r'], old['v'], new['r'], new['v'],
            kw['alpha'], kw['zeta'], kw['tau'], out, coding=code)
    else:
        words, count, flags = bindings.compress_strom(
            ws, 3, g, old['r'], new['r'], kw['tau'], out, coding=code)
    assert flags == 0
    for key in state:  # the old state is never written
        _assert_same(old[key], state[key], key)
    return out[:words], count, new


def _rule_inputs(rng, rule, n, dtype, density, clustered):
    """Gradient, sum of squares, state and parameters selecting about
    ``density`` of ``n`` elements (in runs, if ``clustered``)."""
    sdt = arrays.state_dtype(dtype)
    g = _edge_values(rng, n, dtype)
    with numpy.errstate(over='ignore'):
        g64 = g.astype(numpy.float64)
    # criterion r**2 > alpha * v with r = g, v = g**2 * u, alpha = 1
    u = rng.uniform(0, 1 / density, n)
    if clustered:
        u = numpy.full(n, 2.0)
        for start in rng.integers(0, n, max(1, int(n * density / 10))):
            u[start:start + 10] = 0.5
    with numpy.errstate(over='ignore'):
        s = numpy.minimum(g64 ** 2 * u, numpy.finfo(sdt).max).astype(sdt)
    state = {'r': numpy.zeros(n, sdt), 'v': numpy.zeros(n, sdt)}
    kw = dict(alpha=1.0, zeta=0.999, tau=1e-30)
    if rule == 'strom':
        del state['v']
        mag = numpy.abs(g64) if not clustered else numpy.where(
            u < 1, numpy.abs(g64), 0.0)
        kw['tau'] = float(numpy.quantile(mag, 1 - density)) if n > 1 else 0.0
        state['r'] = (rng.normal(size=n) * 1e-3).astype(sdt)
    return g, s, state, kw


def _reference_group(fixed_words, coding, size, sign_only):
    """What codec.pow2_best_group builds from the FMT_POW2 group the native
    'fixed' coding wrote (equal to the NumPy rules': the tests above)."""
    if fixed_words.size == 0:
        return fixed_words
    tid, fmt, count, a, b = (int(x) for x in fixed_words[:5])
    assert fmt == codec.FMT_POW2 and count == fixed_words.size - 5
    words = fixed_words[5:]
    index = (words & numpy.uint32(codec.MAX_INDEX - 1)).astype(numpy.int64)
    e_k = int(numpy.uint32(a).view(numpy.int32))
    scale = float(numpy.uint32(b).view(numpy.float32))
    group = codec.pow2_best_group(tid, words, index, e_k, scale, size,
                                  coding=coding, sign_only=sign_only)
    return codec.pack([group])[2:]


@pytest.mark.parametrize('rule', GAP_RULES)
@pytest.mark.parametrize('dtype', DTYPES)
def test_index_codings_match_the_reference(rule, dtype):
    """For every coding, the native group equals codec.pow2_best_group of
    the same elements (FMT_POW2 of 'fixed' checked against the NumPy rules
    above), on every build with 1 and 2 threads (VARIANTS); the new state
    does not depend on the coding.  Densities from
    1 in 1000 to all, uniform and clustered, tensors split between
    threads: 'auto' gives both formats."""
    rng = numpy.random.default_rng(hash((rule, str(dtype))) % 2 ** 32)
    ws = bindings.Workspace()
    formats = collections.Counter()
    for n in (1, 17, 1000, 70001, 200003):
        for density in (0.001, 0.02, 0.2, 1.0):
            for clustered in (False, True):
                g, s, state, kw = _rule_inputs(rng, rule, n, dtype, density,
                                               clustered)
                wants = None
                for v in VARIANTS:
                    with native_build(*v):
                        runs = {c: _run_rule(rule, c, g, s, state, kw, ws)
                                for c in codec.CODINGS}
                    fixed = runs['fixed']
                    if wants is None:  # (fixed: checked against NumPy above)
                        wants = {c: _reference_group(
                            fixed[0], c, n, rule in ('hybrid', 'strom'))
                            for c in codec.CODINGS}
                        first = fixed
                    _assert_same(first[0], fixed[0], (rule, n, v))
                    for c in codec.CODINGS:
                        words, count, new = runs[c]
                        _assert_same(wants[c], words,
                                     (rule, n, density, c, v))
                        assert count == fixed[1], (rule, n, c, v)
                        for key in new:
                            _assert_same(new[key], fixed[2][key], (key, v))
                        if words.size:
                            formats[c, int(words[1])] += 1
    assert formats['auto', codec.FMT_GAP] and formats['auto', codec.FMT_POW2]
    assert not formats['fixed', codec.FMT_GAP]
    assert not formats['gap', codec.FMT_POW2]


@pytest.mark.parametrize('state_dtype', [numpy.float32, numpy.float64])
@pytest.mark.parametrize('ranks', [1, 3])
def test_decode_mean_of_gap_messages_matches_codec(state_dtype, ranks, isa,
                                                   threads):
    """Messages mixing FMT_GAP (4-bit and sign-only) and FMT_POW2 groups:
    the native sums in rank order equal codec's decode, bit for bit."""
    rng = numpy.random.default_rng(ranks)
    sizes = [5, 1, 70001, 1000, 133333]
    dtypes = [state_dtype] * len(sizes)
    for trial in range(6):
        blocks = []
        for _ in range(ranks):
            groups = []
            for tid, size in enumerate(sizes):
                if rng.random() < 0.2:
                    continue
                count = int(rng.integers(1, max(2, size // int(
                    rng.choice([1, 10, 300]))) + 1))
                count = min(count, size)
                index = numpy.sort(rng.choice(size, count, replace=False))
                sign_only = bool(rng.random() < 0.5)
                if sign_only:
                    vals = rng.choice([-1.0, 1.0], count).astype(state_dtype)
                    e_k, scale = 0, 1e-3
                else:
                    vals = rng.normal(size=count).astype(state_dtype)
                    e_k, scale = codec.floor_log2(numpy.abs(vals).max()), 1.0
                words, ok = codec.pow2_encode(vals, index, e_k)
                if not ok.any():
                    continue
                groups.append(codec.pow2_best_group(
                    tid, words[ok], index[ok], e_k, scale, size,
                    coding=str(rng.choice(codec.CODINGS)),
                    sign_only=sign_only))
            blocks.append(codec.pack(groups))
        want = [numpy.zeros(n, state_dtype) for n in sizes]
        for blk in blocks:
            codec.decode_into(blk, want, sizes)
        outs = [numpy.full(n, 7, state_dtype) for n in sizes]
        touched, elements = bindings.decode_mean(
            blocks, sizes, dtypes, outs, [False] * len(sizes), 1.0)
        for o, w in zip(outs, want):
            _assert_same(o, w, trial)
        assert list(elements) == [codec.message_count(b) for b in blocks]


@pytest.mark.parametrize('state_dtype', [numpy.float32, numpy.float64])
def test_corrupt_gap_messages_are_rejected_as_the_reference_rejects(
        state_dtype):
    """Corruptions of the FMT_GAP bodies and headers of messages: every
    build of the native decoder accepts exactly what codec.unpack accepts, with the
    same sums, and writes nothing otherwise."""
    rng = numpy.random.default_rng(5)
    sizes = [7, 300, 1, 5000]
    dtypes = [state_dtype] * len(sizes)
    rejected = accepted = 0
    for trial in range(1500):
        groups = []
        for tid, size in enumerate(sizes):
            count = int(rng.integers(1, min(size, 40) + 1))
            index = list(_gap_patterns(rng, size, count))[trial % 2]
            nib = rng.integers(0, 16, index.size).astype(numpy.uint8)
            sign_only = bool(rng.random() < 0.4)
            if sign_only:
                nib &= numpy.uint8(8)
            words = (nib.astype(numpy.uint32) << numpy.uint32(28)) | \
                index.astype(numpy.uint32)
            groups.append(codec.pow2_best_group(
                tid, words, index, int(rng.integers(-3, 3)), 1.0, size,
                coding='gap', sign_only=sign_only))
        good = codec.pack(groups)
        bad = good.copy()
        pos = 2
        target = int(rng.integers(0, len(groups)))
        for g in groups[:target]:
            pos += codec.HEADER_WORDS + g.body.size
        g = groups[target]
        body, how = _gap_body_corruptions(rng, g.body)
        if how == 6 or rng.random() < 0.1:  # or the header's count
            head = good[pos:pos + codec.HEADER_WORDS].copy()
            if how != 6:
                head[2] = numpy.uint32(rng.integers(0, g.count + 3))
            bad = numpy.concatenate([good[:pos], head, body,
                                     good[pos + codec.HEADER_WORDS
                                          + g.body.size:]])
        else:
            bad = numpy.concatenate([good[:pos + codec.HEADER_WORDS], body,
                                     good[pos + codec.HEADER_WORDS
                                          + g.body.size:]])
        try:
            codec.unpack(bad, sizes, dtypes)
            error = None
        except WireFormatError as e:
            error = str(e)
        if error is not None:
            rejected += 1
            _every_build_decodes_as(None, [good, bad], sizes, dtypes,
                                    (trial, how, error))
            continue
        accepted += 1
        want = [numpy.zeros(n, state_dtype) for n in sizes]
        for blk in (good, bad):
            codec.decode_into(blk, want, sizes)
        _every_build_decodes_as(want, [good, bad], sizes, dtypes,
                                (trial, how))
    assert rejected > 700 and accepted > 50, (rejected, accepted)


@pytest.mark.skipif(not os.environ.get('CHAINER_VGC_LARGE_TESTS'),
                    reason='needs ~4 GiB; set CHAINER_VGC_LARGE_TESTS=1')
def test_tensor_over_2_28_elements_is_gap_coded():
    """A tensor of 2**28 + 1000 elements (more than FMT_POW2 addresses):
    Strom's signs are gap-coded in 'auto' and 'gap' with their full
    indices, decoded back; 'fixed' refuses it with a clear error."""
    n = (1 << 28) + 1000
    g = numpy.zeros(n, numpy.float16)
    index = numpy.array([0, 5, 1 << 27, (1 << 28) - 1, 1 << 28, n - 2,
                         n - 1])
    g[index] = numpy.array([1, -1, 1, 1, -1, -1, 1], numpy.float16)
    r = numpy.zeros(n, numpy.float32)
    r_out = numpy.empty(n, numpy.float32)
    ws = bindings.Workspace()
    before = bindings.num_threads()
    for coding, threads in (('auto', 1), ('gap', 2)):
        # one thread: two chunks (a chunk has at most 2**28 elements)
        bindings.set_num_threads(threads)
        out = numpy.zeros(codec.pow2_max_words(n, coding), numpy.uint32)
        try:
            words, count, flags = bindings.compress_strom(
                ws, 0, g, r, r_out, 0.5, out, coding=CODING_CODES[coding])
        finally:
            bindings.set_num_threads(before)
        assert (count, flags) == (index.size, 0)
        assert out[1] == codec.FMT_GAP
        want = codec.pow2_best_group(
            0, numpy.zeros(count, numpy.uint32) | (
                (g[index] < 0).astype(numpy.uint32) << numpy.uint32(31)),
            index, 0, 0.5, n, coding=coding, sign_only=True)
        _assert_same(codec.pack([want])[2:], out[:words], coding)
        got = native_gap.gap_decode(out[5:words], count, n)
        assert got[0].tolist() == index.tolist()
    # 'fixed' cannot address it: the pass flags it, and a compressor
    # refuses the tensor when it is made
    _, _, flags = bindings.compress_strom(ws, 0, g, r, r_out, 0.5, out,
                                          coding=CODING_CODES['fixed'])
    assert flags & bindings.UNENCODABLE
    with pytest.raises(ValueError, match='2\\*\\*28'):
        GradientCompressor('strom', ['big'], [(n,)], [numpy.float16],
                           backend='native', tau=0.5, index_coding='fixed')
    msg = codec.pack([want])
    dec = numpy.full(n, 3, numpy.float32)
    touched, _ = bindings.decode_mean([msg], [n], [numpy.float32], [dec],
                                      [False], 1.0)
    assert touched.tolist() == [index.size]
    expect = numpy.where(g[index] < 0, -0.5, 0.5).astype(numpy.float32)
    assert numpy.array_equal(dec[index], expect)
    dec[index] = 0
    assert not dec.any()


# ---- FMT_GAP spans (addendum v2): one group over consecutive tensors -------

SPAN_SIZES = [5, 1, 70001, 3, 1000, 1, 133333, 40, 7]
#: parameter dtypes cycle float16, float32, float64: state float32 / float64
SPAN_DTYPES = [(numpy.float32, numpy.float32, numpy.float64)[i % 3]
               for i in range(len(SPAN_SIZES))]


def _span_group(tid, parts, sizes, e_k, scale, sign_only=False, k=None):
    """A FMT_GAP group over tensors tid..max(parts) built by hand (not by
    codec.merge_spans): ``parts`` {tensor: (index, nibbles)}, tensors
    missing from it receive nothing."""
    last = max(parts)
    offsets = numpy.cumsum([0] + list(sizes[tid:last + 1]))
    index = numpy.concatenate([numpy.asarray(parts[t][0], numpy.int64)
                               + offsets[t - tid] for t in sorted(parts)])
    nib = numpy.concatenate([numpy.asarray(parts[t][1], numpy.uint8)
                             for t in sorted(parts)])
    k = codec.rice_parameter(index.size, int(offsets[-1])) if k is None \
        else k
    body = codec.gap_body(index, nib, k, sign_only, span=last - tid)
    return codec.Group(tid, codec.FMT_GAP, int(index.size),
                       int(numpy.int32(e_k).view(numpy.uint32)),
                       f32_bits(scale), body)


def _random_parts(rng, sizes, tensors, sign_only, empty=0.3):
    parts = {}
    for t in tensors:
        if rng.random() < empty and t != tensors[-1]:
            continue
        size = sizes[t]
        count = int(rng.integers(1, min(size, int(rng.choice([3, 40, 400])))
                                 + 1))
        index = list(_gap_patterns(rng, size, count))[int(rng.integers(0, 2))]
        nib = rng.integers(0, 16, index.size).astype(numpy.uint8)
        if sign_only:
            nib &= numpy.uint8(8)
        parts[t] = (index, nib)
    return parts


def _span_message(rng, sizes, merge=True):
    """A message of FMT_POW2 / FMT_GAP groups sharing a few (e_k, scale)
    headers in runs, tensors skipped here and there, merged into spans by
    codec.merge_spans; or (merge False) spans built by hand next to
    ordinary groups."""
    heads = [(0, 1.0), (-2, 0.5), (3, 1e-3)]
    groups, t = [], 0
    head = heads[0]
    while t < len(sizes):
        if rng.random() < 0.3:
            head = heads[int(rng.integers(0, len(heads)))]
        sign_only = bool(rng.random() < 0.4)
        if not merge and rng.random() < 0.5:
            last = min(len(sizes) - 1, t + int(rng.integers(0, 4)))
            parts = _random_parts(rng, sizes, list(range(t, last + 1)),
                                  sign_only)
            groups.append(_span_group(t, parts, sizes, *head,
                                      sign_only=sign_only))
            t = last + 1 + int(rng.random() < 0.3)
            continue
        if rng.random() < 0.2:
            t += 1
            continue
        index, nib = _random_parts(rng, sizes, [t], sign_only)[t]
        words = (nib.astype(numpy.uint32) << numpy.uint32(28)) | \
            index.astype(numpy.uint32)
        groups.append(codec.pow2_best_group(
            t, words, index, head[0], head[1], sizes[t],
            coding=str(rng.choice(codec.CODINGS)), sign_only=sign_only))
        t += 1
    msg = codec.pack(groups)
    return codec.merge_spans(msg, sizes) if merge else msg


def _spans_of(msg, sizes):
    return [g.span for g in walk(msg, sizes) if g.fmt == codec.FMT_GAP]


def _reference_sums(blocks, sizes, dtypes):
    want = [numpy.zeros(n, dt) for n, dt in zip(sizes, dtypes)]
    for blk in blocks:
        codec.decode_into(blk, want, sizes)
    return want


@pytest.mark.parametrize('ranks', [1, 3])
def test_decode_mean_of_span_messages_matches_codec(ranks, isa, threads):
    """Messages whose FMT_GAP groups span several tensors (from
    codec.merge_spans and by hand: float32 and float64 state dtypes in one
    span, middle tensors without elements, spans next to ordinary groups):
    the native sums equal codec's decode bit for bit, elements per
    message and per tensor as codec counts them."""
    rng = numpy.random.default_rng(20 + ranks)
    sizes, dtypes = SPAN_SIZES, SPAN_DTYPES
    spans = collections.Counter()
    for trial in range(8):
        blocks = [_span_message(rng, sizes, merge=trial % 2 == 0)
                  for _ in range(ranks)]
        for blk in blocks:
            spans.update(s > 0 for s in _spans_of(blk, sizes))
        want = _reference_sums(blocks, sizes, dtypes)
        outs = [numpy.full(n, 7, dt) for n, dt in zip(sizes, dtypes)]
        touched, elements = bindings.decode_mean(
            blocks, sizes, dtypes, outs, [False] * len(sizes), 1.0)
        for o, w in zip(outs, want):
            _assert_same(o, w, trial)
        assert list(elements) == [codec.message_count(b) for b in blocks]
        per_tensor = numpy.zeros(len(sizes), numpy.int64)
        for blk in blocks:
            for dec in codec.unpack(blk, sizes, dtypes):
                per_tensor[dec.tensor_id] += dec.index.size
        assert touched.tolist() == per_tensor.tolist()
    assert spans[True] >= 6, spans


def test_span_value_table_is_checked_per_receiving_dtype(isa):
    """e_k = 200 fits float64, not float32: a span over a float32 and a
    float64 tensor decodes while only the float64 tensor receives
    elements, and is refused as soon as the float32 one receives one (as
    codec.unpack decides)."""
    sizes = [10, 20, 30]
    dtypes = [numpy.float64, numpy.float32, numpy.float64]
    nib = numpy.array([1, 9], numpy.uint8)
    for parts, ok in (({0: ([2, 7], nib), 2: ([0, 29], nib)}, True),
                      ({0: ([2, 7], nib), 1: ([3], nib[:1]),
                        2: ([0, 29], nib)}, False)):
        msg = codec.pack([_span_group(0, parts, sizes, 200, 1.0)])
        try:
            want = _reference_sums([msg], sizes, dtypes)
        except WireFormatError:
            want = None
        assert (want is not None) == ok
        outs = [numpy.full(n, 7, dt) for n, dt in zip(sizes, dtypes)]
        got = bindings.decode_mean([msg], sizes, dtypes, outs,
                                   [False] * len(sizes), 1.0)
        assert (got is not None) == ok
        if ok:
            for o, w in zip(outs, want):
                _assert_same(o, w, parts)
            assert o[0] == 2.0 ** 199 and o[29] == -2.0 ** 199


def _span_corruptions(rng, msg, sizes):
    """A span message with one fault in a FMT_GAP group (the span past the
    model, over the next group's tensor, one shorter so that its last
    indices overrun, count above span_size, a body fault) or anywhere."""
    groups = list(walk(msg, sizes))
    pos, where = 2, []
    for g in groups:
        if g.fmt == codec.FMT_GAP:
            where.append((pos, g))
        pos += codec.HEADER_WORDS + g.body.size
    how = int(rng.integers(0, 7))
    if how == 6 or not where:
        return _corrupt(rng, msg), 'message'
    pos, g = where[int(rng.integers(0, len(where)))]
    body_at = pos + codec.HEADER_WORDS
    bad = msg.copy()
    span_size = sum(sizes[g.tensor_id:g.tensor_id + g.span + 1])

    def set_span(span):
        bad[body_at] = (bad[body_at] & numpy.uint32(255)) | numpy.uint32(
            span << codec.GAP_SPAN_SHIFT)
    if how == 0:  # past the model
        set_span(len(sizes) - g.tensor_id + int(rng.integers(0, 3)))
        return bad, 'past the model'
    if how == 1:  # one more: over the next group's tensor, if any
        set_span(g.span + 1)
        return bad, 'one more'
    if how == 2:  # one less: the last tensor's indices overrun
        if not g.span:
            return bad, 'unchanged'
        set_span(g.span - 1)
        return bad, 'one less'
    if how == 3:  # count above span_size (or just off)
        bad[pos + 2] = numpy.uint32(min(2 ** 32 - 1, span_size + int(
            rng.integers(0, 2)) if rng.random() < 0.7 else
            int(rng.integers(0, g.count + 3))))
        return bad, 'count'
    body, kind = _gap_body_corruptions(rng, numpy.array(g.body))
    return numpy.concatenate([bad[:body_at], body,
                              bad[body_at + g.body.size:]]), 'body'


def test_corrupt_span_messages_are_rejected_as_the_reference_rejects():
    """Faults in span messages: every build of the native decoder accepts
    exactly what
    codec.unpack accepts (WireFormatError otherwise), with the same sums,
    and writes nothing when it refuses."""
    rng = numpy.random.default_rng(77)
    sizes, dtypes = SPAN_SIZES[:6] + [40, 7], SPAN_DTYPES[:8]
    sizes[2] = 700
    seen = collections.Counter()
    for trial in range(1500):
        good = _span_message(rng, sizes, merge=trial % 3 != 0)
        bad, how = _span_corruptions(rng, good, sizes)
        try:
            codec.unpack(bad, sizes, dtypes)
            error = None
        except WireFormatError as e:
            error = str(e)
        seen[how, error is None] += 1
        want = (None if error is not None else
                _reference_sums([good, bad], sizes, dtypes))
        _every_build_decodes_as(want, [good, bad], sizes, dtypes,
                                (trial, how, error))
    for how in ('past the model', 'one more', 'one less', 'count', 'body'):
        assert seen[how, False] >= 20, seen
    assert seen['one less', True] + seen['one more', True] >= 5, seen


def test_span_fast_paths_equal_the_reference():
    """native_gap.gap_decode ignores the span bits (8..31) as
    codec.gap_decode_body does (bit 7 must match the restart table);
    codec.merge_spans
    with native_gap.gap_decode / gap_encode as its fast decoder and encoder
    writes the reference's message."""
    index, nib = numpy.array([3, 4, 40]), numpy.array([1, 8, 2], numpy.uint8)
    for span in (0, 1, 2 ** 24 - 1):
        body = codec.gap_body(index, nib, 4, False, span=span)
        want = codec.gap_decode_body(body, 3, 100)
        got = native_gap.gap_decode(body, 3, 100)
        assert numpy.array_equal(got[0], want[0])
        assert numpy.array_equal(got[1], want[1])
        body[0] |= numpy.uint32(codec.GAP_RESTARTS)
        with pytest.raises(WireFormatError):
            codec.gap_decode_body(body, 3, 100)
        assert native_gap.gap_decode(body, 3, 100) is None
    rng = numpy.random.default_rng(3)
    for _ in range(20):
        msg = codec.pack(list(walk(_span_message(rng, SPAN_SIZES,
                                                 merge=False),
                                   SPAN_SIZES)))
        raw = _span_message(rng, SPAN_SIZES, merge=True)
        for m in (msg, raw):
            want = codec.merge_spans(m, SPAN_SIZES)
            got = codec.merge_spans(m, SPAN_SIZES, native_gap.gap_decode,
                                    native_gap.gap_encode)
            _assert_same(want, got, 'merge_spans')


def test_a_native_refusal_the_reference_does_not_share_is_reported(
        monkeypatch):
    """The one fallback after a fast decoder refused (codec.name_the_fault),
    from each caller: a message the native decoder refuses and the
    reference accepts (a bug) stops with an error that names the
    workaround, and nothing is written; one the reference refuses too
    raises the reference's WireFormatError."""
    import types
    shapes, dtypes = [(50,), (7,)], [numpy.float32] * 2
    comp = GradientCompressor('vgc', ['a', 'b'], shapes, dtypes, alpha=1.0,
                              backend='native')
    rng = numpy.random.default_rng(0)
    msg = comp.compress([rng.normal(0, 1, s).astype(numpy.float32)
                         for s in shapes],
                        [numpy.ones(s, numpy.float32) for s in shapes]).copy()
    monkeypatch.setattr(bindings, 'decode_mean', lambda *a, **k: None)
    outs = [numpy.zeros(s, numpy.float32) for s in shapes]
    with pytest.raises(RuntimeError, match="backend='numpy'"):
        comp.decode_into(msg, outs)
    assert all((o == 0).all() for o in outs)
    params = [types.SimpleNamespace(array=o, grad=o.copy(), dtype=o.dtype,
                                    shape=o.shape, size=o.size) for o in outs]
    with pytest.raises(RuntimeError, match='CHAINER_VGC_BACKEND=numpy'):
        exchange_mean.mean_gradients([msg], comp, params,
                                     [p.grad for p in params], 1, True, False)
    with pytest.raises(RuntimeError, match='CHAINER_VGC_BACKEND=numpy'):
        comp.engine.validate([msg], dtypes)
    bad = msg.copy()
    bad[4] = 0xFFFFFFF  # the first group's count: beyond the tensor
    with pytest.raises(codec.WireFormatError):
        comp.decode_into(bad, outs)


def test_a_rule_declares_its_fused_pass_from_its_own_module():
    """docs/contributing.md's native fast path: a rule's module declares
    its pass with bindings.fused_pass (no entry in bindings.py), here
    Strom's symbol declared again: the same message and state, bit for bit,
    as the shipped wrapper; a symbol the library lacks is named."""
    import ctypes
    vp = ctypes.c_void_p
    declared = bindings.fused_pass(
        'strom', [vp, vp, ctypes.c_int64, ctypes.c_double, ctypes.c_int, vp])
    rng = numpy.random.default_rng(3)
    g = rng.normal(0, 1, 5000).astype(numpy.float32)
    ws = bindings.Workspace()
    outs = []
    for fn in (bindings.compress_strom, declared):
        r = numpy.full(5000, 0.3, numpy.float32)
        r_out = numpy.empty_like(r)
        out = numpy.zeros(8000, numpy.uint32)
        args = (r, r_out, g.size, 0.5, CODING_CODES['gap'], out)
        result = fn(ws, 0, g, *args) if fn is declared else \
            fn(ws, 0, g, r, r_out, 0.5, out, coding=CODING_CODES['gap'])
        outs.append((result, out.copy(), r_out.copy()))
    (res_a, out_a, r_a), (res_b, out_b, r_b) = outs
    assert res_a == res_b and res_a[1] > 0
    _assert_same(out_a, out_b, 'message')
    _assert_same(r_a, r_b, 'r')
    with pytest.raises(AttributeError, match='vgc_native_no_such_rule'):
        bindings.fused_pass('no_such_rule', [vp])


@pytest.mark.parametrize('state_dtype', [numpy.float32, numpy.float64])
def test_corrupt_sparse_messages_are_rejected_as_the_reference_rejects(
        state_dtype):
    """FMT_SPARSE (dgc's messages, issue 51): float16 and float32 values
    with exponents across the state dtype's range (values that overflow
    it, subnormal ones), their bodies and headers corrupted; every build
    of the native decoder accepts exactly what codec.unpack accepts, with
    the same sums, and writes nothing otherwise."""
    rng = numpy.random.default_rng(11)
    sizes = [9, 400, 1, 3000]
    dtypes = [state_dtype] * len(sizes)
    seen = {True: 0, False: 0}
    for trial in range(1200):
        groups = []
        for tid, size in enumerate(sizes):
            count = int(rng.integers(1, min(size, 1500) + 1))
            index = list(_gap_patterns(rng, size, count))[trial % 2]
            values = _edge_values(rng, index.size, state_dtype)
            values[values == 0] = 1.0
            g, _ = codec.sparse_group(tid, index, values, size,
                                      float32=bool(rng.random() < 0.4))
            if g is not None:
                groups.append(g)
        good = codec.pack(groups)
        target = int(rng.integers(0, len(groups)))
        pos = 2 + sum(codec.HEADER_WORDS + g.body.size
                      for g in groups[:target])
        g = groups[target]
        body, how = _gap_body_corruptions(rng, g.body)
        head = good[pos:pos + codec.HEADER_WORDS].copy()
        what = rng.random()
        if what < 0.15:  # x: values overflow or vanish in the state dtype
            head[3] = numpy.uint32(int(rng.integers(-1200, 1200)) % 2 ** 32)
            body = g.body
        elif what < 0.25:  # the flags
            head[4] ^= numpy.uint32(1 << int(rng.integers(0, 3)))
            body = g.body
        elif what < 0.3:  # the count
            head[2] = numpy.uint32(rng.integers(0, g.count + 3))
        bad = numpy.concatenate([good[:pos], head, body,
                                 good[pos + codec.HEADER_WORDS
                                      + g.body.size:]])
        blocks = [good, bad] if trial % 3 == 0 else [bad]
        try:
            want = [numpy.zeros(n, state_dtype) for n in sizes]
            for blk in blocks:
                codec.decode_into(blk, want, sizes)
        except WireFormatError:
            want = None
        _every_build_decodes_as(want, blocks, sizes, dtypes, (trial, how))
        seen[want is not None] += 1
    assert seen[True] > 100 and seen[False] > 300, seen
