"""The CuPy kernels' source, compiled for the GPU and executed on the CPU.

Every entry of chainer_vgc.backends.cuda.kernels.SPECS is (1) compiled to PTX with nvcc,
exactly as generated for the device, and (2) compiled with the host C++
compiler from the same kernels/vgc_numerics.cuh and operation strings, run
element by element, and compared bit for bit with the NumPy path.
"""

import numpy
import pytest

import kernel_harness
from chainer_vgc import GradientCompressor
from chainer_vgc.backends import arrays
from chainer_vgc import codec
from chainer_vgc.backends.cuda import kernels
from chainer_vgc.codec.gap import device_gap_body
from chainer_vgc.backends.arrays import state_dtype
from chainer_vgc.rules import Hybrid
from chainer_vgc.rules import QSGD
from chainer_vgc.rules import Strom
from chainer_vgc.rules import VGC

from reference import assert_bitwise
from reference import edge_values

# on both stacks (make test): its results depend on NumPy, the native
# build or the installed packages (docs/contributing.md)
pytestmark = pytest.mark.stack

F16, F32, F64 = numpy.float16, numpy.float32, numpy.float64


def instances():
    """One instantiation per kernel and parameter dtype combination."""
    out = []
    for gdt in (F16, F32, F64):
        sdt = state_dtype(gdt).type
        g = numpy.zeros(2, gdt)
        r = numpy.zeros(2, sdt)
        out += [
            ('vgc_basic_select', (g, g, sdt(1), sdt(1), r, r,
                                  numpy.zeros(2, bool))),
            ('vgc_hybrid_step', (g, g, sdt(1), sdt(1), sdt(1), r, r,
                                 numpy.zeros(2, numpy.int8))),
            ('vgc_strom_step', (g, sdt(1), r, numpy.zeros(2, numpy.int8))),
        ]
    for gdt, hdt in ((F32, F64), (F64, F32), (F64, F16)):
        # a sum of squares in another dtype than the state's
        sdt = state_dtype(gdt).type
        g, s, r = (numpy.zeros(2, gdt), numpy.zeros(2, hdt),
                   numpy.zeros(2, sdt))
        out += [
            ('vgc_basic_select', (g, s, sdt(1), sdt(1), r, r,
                                  numpy.zeros(2, bool))),
            ('vgc_hybrid_step', (g, s, sdt(1), sdt(1), sdt(1), r, r,
                                 numpy.zeros(2, numpy.int8))),
        ]
    for src, dst in ((F64, F32), (F32, F64), (F32, F16), (F16, F32),
                     (F64, F16)):
        out.append(('vgc_cast', (numpy.zeros(2, src), numpy.zeros(2, dst))))
    for sdt in (F32, F64):
        x = numpy.zeros(2, sdt)
        out += [
            ('vgc_add_to', (x, x)),
            ('vgc_scale', (x, sdt(1), x)),
            ('vgc_divide', (x, sdt(1), x)),
        ]
    for sdt in (F32, F64):
        x = numpy.zeros(2, sdt)
        out += [
            ('vgc_pow2_encode', (x, numpy.zeros(2, numpy.int64),
                                 numpy.int32(0), numpy.zeros(2, numpy.uint32),
                                 numpy.zeros(2, bool))),
            ('vgc_pow2_decode', (numpy.zeros(2, numpy.uint32), numpy.int32(0),
                                 sdt(1), numpy.zeros(2, numpy.int64), x)),
        ]
    i64 = numpy.zeros(2, numpy.int64)
    for idt in (numpy.int64, numpy.int32):  # FMT_GAP (integers only)
        out.append(('vgc_gap_lengths', (numpy.zeros(2, idt), numpy.int32(0),
                                        i64, i64)))
    out.append(('vgc_gap_write', (i64, i64, numpy.int32(0),
                                  numpy.zeros(3, numpy.uint32))))
    for ndt in (numpy.uint8, numpy.int32, numpy.uint32):
        out.append(('vgc_gap_values', (numpy.zeros(5, ndt),
                                       numpy.int64(5), False,
                                       numpy.zeros(2, numpy.uint32))))
    return out + model_instances()


def model_instances():
    """The whole-model step's kernels (chainer_vgc.engines.cuda.compress)."""
    out = []
    i64, u32 = numpy.zeros(3, numpy.int64), numpy.zeros(3, numpy.uint32)
    u64, on = numpy.zeros(3, numpy.uint64), numpy.ones(2, bool)
    i8, n = numpy.zeros(2, numpy.int8), numpy.int32(2)
    ok = numpy.zeros(2, numpy.int64)  # (non-raw: the elements' size)
    for gdt, hdt in ((F16, F16), (F32, F32), (F64, F64), (F32, F64)):
        sdt = state_dtype(gdt).type
        g, s, r = (numpy.zeros(2, gdt), numpy.zeros(2, hdt),
                   numpy.zeros(2, sdt))
        out += [
            ('vgc_model_vgc_select', (g, s, r, r, i64, n, on, sdt(1),
                                      sdt(1), r, r, i8, u32, u64)),
            ('vgc_model_hybrid_step', (g, s, r, r, i64, n, on, sdt(1),
                                       sdt(1), sdt(1), r, r, i8, ok, u32)),
            ('vgc_model_strom_step', (g, r, i64, n, on, sdt(1), r, i8, ok,
                                      u32)),
        ]
    for sdt in (F32, F64):
        r = numpy.zeros(2, sdt)
        out += [
            ('vgc_model_keep', (r, i8, u64, i64, n, ok)),
            ('vgc_model_vgc_write', (i8, i64, i64, n, i64, i64, on,
                                     False, r, r, u32, u32)),
            ('vgc_model_vgc_compact', (i8, i64, i64, n, u64, on, False,
                                       r, r, u32,
                                       numpy.zeros(3, numpy.int32), u32)),
        ]
    out += [
        ('vgc_model_layout', (i64, i64, n, True, numpy.uint32(0), False,
                              numpy.zeros(1, numpy.int32), u64, i64, i64,
                              u32, u32)),
        ('vgc_model_sign_write', (i8, i64, i64, n, i64, u32)),
        ('vgc_model_sign_compact', (i8, i64, i64, n, u32,
                                    numpy.zeros(3, numpy.int32))),
        ('vgc_model_gap_lengths', (u32, numpy.zeros(3, numpy.int32), i64,
                                   i64, n, numpy.zeros(2, numpy.int64))),
        ('vgc_model_gap_layout', (i64, i64, i64, n, True, False, False,
                                  False, numpy.zeros(1, numpy.int32), u64,
                                  i64, u32)),
        ('vgc_model_gap_assemble', (i64, n, u32, i64, i64, i64,
                                    numpy.uint32(0), False, u32)),
        ('vgc_model_none_layout', (i64, n, on, False,
                                   numpy.zeros(1, numpy.int32), i64, u32,
                                   u32)),
    ]
    for gdt in (F16, F32, F64):
        out.append(('vgc_model_none_write', (numpy.zeros(2, gdt), i64, n,
                                             i64, u32, u32)))
        out.append(('vgc_model_decode_mean', (
            u32, u64, i64, i64, n, n, n, False, False, numpy.float64(1),
            numpy.float64(1), numpy.float32(1), numpy.zeros(2, gdt))))
    out.append(('vgc_model_gap_expand', (u32, i64, i64, n,
                                         numpy.zeros(1, numpy.int32), u64,
                                         u32)))
    out.append(('vgc_model_scatter', (u32, u64, i64, i64, n, n, n, i64, i64,
                                      numpy.zeros(1, numpy.int32), u32)))
    for gdt in (F16, F32, F64):
        out.append(('vgc_model_finish', (
            u32, i64, i64, i64, n, False, numpy.float64(1),
            numpy.float64(1), numpy.float32(1), numpy.zeros(2, gdt))))
    out.append(('vgc_model_clear', (n, u32, u64)))
    for gdt in (F16, F32, F64):  # every input dtype into float32 ...
        out.append(('vgc_model_gather', (u64, numpy.zeros(1, gdt), i64, n,
                                         numpy.zeros(2, F32))))
    out.append(('vgc_model_gather', (u64, numpy.zeros(1, F16), i64, n,
                                     numpy.zeros(2, F16))))  # ... and f16
    return out


def test_every_kernel_compiles_to_ptx_without_fma(tmp_path):
    """nvcc, with -ftz=true after the kernels' options as CuPy adds it."""
    if kernel_harness.find_nvcc() is None:
        pytest.skip('nvcc not found: the CUDA sources were not compiled '
                    '(install the CUDA toolkit to run this check)')
    insts = instances()
    ptx = kernel_harness.compile_ptx(insts, str(tmp_path))
    entries = kernel_harness.ptx_entries(ptx)
    assert entries == ['{}_{}_kernel'.format(name, k)
                       for k, (name, _) in enumerate(insts)]
    assert {name for name, _ in insts} == set(kernels.SPECS)
    assert 'fma.' not in ptx  # same rounding as host/NumPy
    assert '.ftz' not in ptx  # subnormals kept, as on the host


needs_cupy = pytest.mark.skipif(
    not kernel_harness.cupy_available(),
    reason='CuPy or the nvidia-cuda-nvrtc wheel is missing (make test '
           'installs both): the kernels were not compiled as CuPy does')


@needs_cupy
@pytest.mark.parametrize('k', range(len(instances())))
def test_kernel_as_cupy_compiles_it_keeps_subnormals_and_has_no_fma(k):
    """The subnormal rule (kernels/vgc_numerics.cuh): CuPy's own generated
    source, CuPy's option list with the -ftz=true it appends, NVRTC: no
    flushing (.ftz) and no fused multiply-add in the PTX."""
    name, args = instances()[k]
    source = kernel_harness.cupy_generated_source(name, args)
    assert '__global__ void {}('.format(name) in source
    ptx = kernel_harness.nvrtc_ptx(source,
                                   kernel_harness.cupy_compile_options())
    float_ops = kernel_harness.ptx_float_instructions(ptx)
    if name.endswith(('_select', '_step')):  # the arithmetic kernels
        assert any(op.startswith('setp.gt.f') for op in float_ops), float_ops
    if name in ('vgc_add_to', 'vgc_scale', 'vgc_divide'):
        assert float_ops, 'no floating-point instruction found'
    if name == 'vgc_gap_write':  # codes sharing a word: atomic ORs
        assert 'atom.global.or.b32' in ptx
    if name.startswith('vgc_gap_'):  # integers only
        assert not float_ops, float_ops
    if name == 'vgc_cast' and not float_ops:  # f16 conversions: CuPy's
        assert 'cvt.' in ptx  # header converts in inline asm of its own
    # (the codec kernels work on the bits only: no float instruction)
    assert not [op for op in float_ops if '.ftz' in op or 'fma' in op], \
        float_ops


@needs_cupy
def test_cupy_options_flush_plain_operators():
    """The control: the same pipeline on plain C operators does emit .ftz
    (so the test above can fail), and CuPy's option list has -ftz=true
    (appended by _compile_with_cache_cuda, in CuPy 13 and 14)."""
    options = kernel_harness.cupy_compile_options()
    assert '-ftz=true' in options and '--fmad=false' in options
    source = ('extern "C" __global__ void plain(float *x, float a) '
              '{ x[0] = x[0] * a + a; x[1] = x[0] > a ? 1.0f : 0.0f; }')
    ptx = kernel_harness.nvrtc_ptx(source, options)
    assert any('.ftz' in op for op in
               kernel_harness.ptx_float_instructions(ptx))


@pytest.mark.parametrize('sdt', [F32, F64])
def test_subnormal_state_is_kept_by_kernels_and_numpy(host_kernels, sdt):
    """Subnormal gradients and sums of squares: r += g, v += s, the
    criterion and v *= zeta in the kernels (which the device runs without
    flushing) equal NumPy bit for bit, and nothing is flushed to zero."""
    tiny = numpy.finfo(sdt).tiny
    g = numpy.array([tiny / 4, -tiny / 2, tiny * 0.75, tiny / 1024,
                     -tiny / 3, tiny * 3], sdt)
    s = numpy.abs(g[::-1]).copy()
    rule = VGC(alpha=1.0, zeta=0.5)
    st = rule.init_state(g.size, sdt, numpy)
    r, v = numpy.zeros(g.size, sdt), numpy.zeros(g.size, sdt)
    sel = numpy.zeros(g.size, bool)
    host_kernels('vgc_basic_select', g, s, sdt(1.0), sdt(0.5), r, v, sel)
    want = rule.select(g, s, st)
    assert (sel == want).all()
    assert_bitwise(r, st['r'])
    assert_bitwise(v, st['v'])
    assert (r != 0).all() and (v != 0).all()  # nothing flushed
    hyb = Hybrid(tau=float(tiny / 8), alpha=1.0, zeta=0.5)
    st = hyb.init_state(g.size, sdt, numpy)
    r, v = numpy.zeros(g.size, sdt), numpy.zeros(g.size, sdt)
    sign = numpy.zeros(g.size, numpy.int8)
    host_kernels('vgc_hybrid_step', g, s, sdt(1.0), sdt(0.5),
                 sdt(tiny / 8), r, v, sign)
    # (r**2 underflows to 0: the criterion holds nowhere, on every path)
    assert (sign == hyb.step(g, s, st)).all()
    assert_bitwise(r, st['r'])
    assert_bitwise(v, st['v'])
    assert (r != 0).all() and (v != 0).all()


def test_placeholders_are_deduced_from_arrays_only(host_kernels):
    """The harness refuses what CuPy refuses: a placeholder type that only
    a scalar carries (the codec passes outputs for vgc_pow2_decode)."""
    with pytest.raises(TypeError, match='placeholder S'):
        host_kernels('vgc_pow2_decode', numpy.zeros(3, numpy.uint32),
                     numpy.int32(0), numpy.float32(1))


# ---- kernel vs NumPy, one kernel at a time -----------------------------------

def _stream(rng, dtype, n, steps):
    """Gradients mixing random values with the codec's edge values."""
    edges = edge_values(dtype)
    with numpy.errstate(over='ignore'):
        for _ in range(steps):
            g = rng.normal(0, 1, n).astype(dtype)
            g[rng.integers(0, n, n // 4)] = rng.choice(edges, n // 4)
            g[:3] = 0
            s = numpy.abs(rng.normal(0, 1, n)).astype(dtype) ** 2
            s[rng.integers(0, n, n // 8)] = 0
            yield g, s


@pytest.mark.parametrize('gdt', [F16, F32, F64])
def test_basic_select_kernel_matches_numpy(host_kernels, gdt):
    rng = numpy.random.default_rng(0)
    n = 501
    rule = VGC(alpha=1.5, zeta=0.999)
    sdt = state_dtype(gdt)
    st = rule.init_state(n, gdt, numpy)
    r, v = numpy.zeros(n, sdt), numpy.zeros(n, sdt)
    with numpy.errstate(all='ignore'):
        for g, s in _stream(rng, gdt, n, 20):
            sel = numpy.zeros(n, bool)
            host_kernels('vgc_basic_select', g, s, sdt.type(1.5),
                         sdt.type(0.999), r, v, sel)
            want = rule.select(g, s, st)
            assert (sel == want).all()
            assert_bitwise(r, st['r'])
            assert_bitwise(v, st['v'])
            # what the rule does after encoding: reset the selected state
            r[sel] = v[sel] = st['r'][sel] = st['v'][sel] = 0


@pytest.mark.parametrize('gdt', [F16, F32, F64])
def test_hybrid_and_strom_kernels_match_numpy(host_kernels, gdt):
    rng = numpy.random.default_rng(1)
    n = 403
    sdt = state_dtype(gdt)
    hyb, strom = Hybrid(tau=0.1, alpha=2.0, zeta=0.99), Strom(tau=0.1)
    st_h, st_s = hyb.init_state(n, gdt, numpy), strom.init_state(n, gdt,
                                                                 numpy)
    r, v, rs = numpy.zeros(n, sdt), numpy.zeros(n, sdt), numpy.zeros(n, sdt)
    tau = sdt.type(numpy.float32(0.1))
    with numpy.errstate(all='ignore'):
        for g, s in _stream(rng, gdt, n, 20):
            sign = numpy.zeros(n, numpy.int8)
            host_kernels('vgc_hybrid_step', g, s, sdt.type(2.0),
                         sdt.type(0.99), tau, r, v, sign)
            assert (sign == hyb.step(g, s, st_h)).all()
            assert_bitwise(r, st_h['r'])
            assert_bitwise(v, st_h['v'])
            host_kernels('vgc_strom_step', g, tau, rs, sign)
            assert (sign == strom.step(g, st_s)).all()
            assert_bitwise(rs, st_s['r'])


@pytest.mark.parametrize('sdt', [F32, F64])
def test_pow2_encode_kernel_matches_numpy_on_edge_values(host_kernels, sdt):
    x = edge_values(sdt)
    x = numpy.concatenate([x, numpy.random.default_rng(2).normal(
        0, 10, 1000).astype(sdt)])
    index = numpy.arange(x.size, dtype=numpy.int64) * 7919 % (2 ** 28)
    for e_k in (-20, -1, 0, 1, 5, 10, 127, 200):
        words, ok = host_kernels('vgc_pow2_encode', x, index,
                                 numpy.int32(e_k))
        want_words, want_ok = codec.pow2_encode(x, index, e_k)
        assert (ok == want_ok).all()
        assert_bitwise(words, want_words)
        # and decode inverts encode, in both implementations
        n_ok = int(ok.sum())
        idx, val = host_kernels('vgc_pow2_decode', words[ok],
                                numpy.int32(e_k), sdt(1),
                                numpy.empty(n_ok, numpy.int64),
                                numpy.empty(n_ok, sdt))
        want_idx, want_val = codec.pow2_decode(words[ok], e_k, 1.0, sdt)
        assert (idx == want_idx).all() and (idx == index[ok]).all()
        assert_bitwise(val, want_val)


@pytest.mark.parametrize('sdt', [F32, F64])
def test_pow2_decode_kernel_matches_numpy_on_all_fields(host_kernels, sdt):
    rng = numpy.random.default_rng(3)
    words = rng.integers(0, 2 ** 32, 4096, dtype=numpy.uint64).astype(
        numpy.uint32)
    for e_k, scale in ((0, 1.0), (5, 1.0), (-130, 1.0), (0, 0.1), (3, 0.37)):
        idx, val = host_kernels('vgc_pow2_decode', words, numpy.int32(e_k),
                                sdt(numpy.float32(scale)),
                                numpy.empty(words.size, numpy.int64),
                                numpy.empty(words.size, sdt))
        want_idx, want_val = codec.pow2_decode(words, e_k, scale, sdt)
        assert (idx == want_idx).all()
        assert_bitwise(val, want_val)


# ---- the whole GPU code path, end to end, on the CPU -------------------------

RULE_ARGS = [
    ('none', {}),
    ('qsgd', dict(bits=3, bucket=16, seed=0)),
    ('vgc', dict(alpha=1.5)),
    ('vgc', dict(alpha=1.0, keep_unrepresentable=True)),
    ('vgc', dict(alpha=2.0, quantize=False)),
    ('hybrid', dict(alpha=2.0, tau=0.05)),
    ('strom', dict(tau=0.05)),
]


@pytest.mark.parametrize('method,kw', RULE_ARGS)
def test_gpu_code_path_matches_numpy_path(request, method, kw):
    """Runs GradientCompressor twice over the same stream: once on the CPU,
    once on "device" arrays (tests/fake_cupy.py), where the rules' CuPy
    branches drive the host-compiled kernels.  Messages, states and the
    device decoder's sums must be identical."""
    shapes = [(17, 3), (5,), (0,), (64,)]
    dtypes = [F16, F32, F32, F64]
    rng = numpy.random.default_rng(4)
    steps = []
    for _ in range(15):
        gs = [rng.normal(0, 1, s).astype(d) for s, d in zip(shapes, dtypes)]
        ss = [(g.astype(F64) ** 2 * rng.random(g.shape) * 2).astype(g.dtype)
              for g in gs]
        steps.append((gs, ss))
    numpy_msgs, numpy_comp = _run(method, kw, shapes, dtypes, steps)
    fake = request.getfixturevalue('device')
    on_device = [([fake.asarray(g) for g in gs], [fake.asarray(s) for s in ss])
                 for gs, ss in steps]
    kernel_msgs, kernel_comp = _run(method, kw, shapes, dtypes, on_device)
    sent = 0
    for a, b in zip(numpy_msgs, kernel_msgs):
        assert isinstance(b, numpy.ndarray)  # assembled in host memory
        assert_bitwise(a, b)
        sent += codec.message_count(a)
    assert sent > 0
    for sa, sb in zip(numpy_comp.states, kernel_comp.states):
        for k in sa:
            assert isinstance(sb[k], fake.ndarray)
            assert_bitwise(sa[k], fake.asnumpy(sb[k]))
    decoded = device_decode(fake, kernel_comp, kernel_msgs[-1])
    want = numpy_comp.decode(numpy_msgs[-1])
    for a, b in zip(decoded, want):
        assert_bitwise(a.ravel(), b.ravel())


def device_decode(fake, comp, message):
    """The GPU decoder (codec.add_validated) on an uploaded message, its
    gap-coded groups expanded on the host first (as exchange does)."""
    codec.unpack(message, comp.sizes, comp.dtypes)  # validated first
    host = codec.expand_gap(message, comp.sizes)
    outs = [fake.zeros(n, state_dtype(dt)) for n, dt in zip(comp.sizes,
                                                            comp.dtypes)]
    codec.add_validated(host, fake.asarray(host), outs, comp.sizes)
    return [fake.asnumpy(o) for o in outs]


class _GpuStreamQSGD(QSGD):
    """QSGD drawing from the GPU path's stream on the CPU as well (a
    generator from (entropy, step), new each step), so that both paths
    round with the same uniforms and must send the same words."""

    def _rng(self, xp):
        if xp is not numpy:  # the GPU path: the rule's own code
            return super(_GpuStreamQSGD, self)._rng(xp)
        step, rng = self._rngs.get('gpu_stream', (None, None))
        if step != self._step:
            rng = numpy.random.default_rng(numpy.random.SeedSequence(
                self._entropy, spawn_key=(self._step,)))
            self._rngs['gpu_stream'] = (self._step, rng)
        return rng


def _run(method, kw, shapes, dtypes, steps):
    rule = _GpuStreamQSGD(**kw) if method == 'qsgd' else method
    comp = GradientCompressor(rule, ['a', 'b', 'c', 'd'], shapes, dtypes,
                              **({} if method == 'qsgd' else kw))
    return [comp.compress(gs, ss).copy() for gs, ss in steps], comp


@pytest.mark.parametrize('dtype', [F16, F32, F64])
def test_edge_tensors_through_both_paths(request, dtype):
    """All-zero tensor, subnormal-only tensor, maximum exactly a power of
    two, mid-points: NumPy path and kernel path send the same words, and the
    decoded values are what the paper's quantizer gives."""
    tiny = numpy.finfo(dtype).tiny
    tensors = [
        numpy.zeros(5, dtype),
        numpy.full(4, tiny / 4, dtype) if dtype != F16 else
        numpy.zeros(4, dtype),
        numpy.array([8.0, -6.0, 5.9, 0.75, 1 / 16, -1 / 32, 1 / 64],
                    dtype),
        numpy.array([1.5, -3.0, 0.046875, 0.0], dtype),
    ]
    shapes = [t.shape for t in tensors]
    zeros = [numpy.zeros(s, dtype) for s in shapes]
    msgs = []
    for use_kernels in (False, True):
        comp = GradientCompressor('vgc', list('abcd'), shapes,
                                  [dtype] * 4, alpha=1.0)
        if use_kernels:
            fake = request.getfixturevalue('device')
            msgs.append(comp.compress([fake.asarray(t) for t in tensors],
                                      [fake.asarray(z) for z in zeros]))
            out = device_decode(fake, comp, msgs[-1])
        else:
            msgs.append(comp.compress(tensors, zeros).copy())
            out = comp.decode(msgs[-1])
        assert (out[0] == 0).all() and (out[1] == 0).all()
        # 8 = 2**3 is the maximum: e_k = 3; 6 -> 8 (tie 1.5*4 rounds up,
        # truncated to 2**e_k); 5.9 -> 4; 0.75 -> 1; 1/16 -> d = 7;
        # 1/32 and 1/64 have d > 7 and are not sent
        assert out[2].tolist() == [8, -8, 4, 1, 1 / 16, 0, 0]
        # max 3 -> e_k = 1; 1.5 -> 2; 0.046875 = 1.5 * 2**-5 -> 2**-4 (d 5)
        assert out[3].tolist() == [2, -2, 1 / 16, 0]
        # dropped by d > 7 (paper)
        assert (arrays.to_numpy(comp.state(2)['r']) == 0).all()
    assert_bitwise(msgs[0], msgs[1])


@pytest.mark.parametrize('dtype', [F32, F64])
def test_sum_squares_reduction_kernel_matches_numpy(host_kernels, dtype):
    """vgc_sum_squares, run row after row on the CPU: NumPy's sum of g*g
    over axis 0 bit for bit, subnormal squares included."""
    rng = numpy.random.default_rng(8)
    g = rng.normal(0, 1, (37, 5, 3)).astype(dtype)
    g[3] = numpy.finfo(dtype).tiny * 2 ** 10  # squares far below tiny
    g[7, 0] = numpy.sqrt(numpy.finfo(dtype).tiny) / 4  # subnormal square
    got = host_kernels.reduce_axis0('vgc_sum_squares', g)
    assert got.shape == (5, 3)
    assert_bitwise(got.ravel(), (g * g).sum(axis=0).ravel())
    assert_bitwise(got.ravel(), numpy.einsum('i...,i...->...', g,
                                             g).ravel())


@needs_cupy
@pytest.mark.parametrize('dtype', [F32, F64])
def test_sum_squares_as_cupy_compiles_it_keeps_subnormals(dtype):
    """The reduction kernel from CuPy's own generated source, CuPy's option
    list (-ftz=true) and NVRTC: no .ftz, no fma."""
    source = kernel_harness.cupy_reduction_source('vgc_sum_squares', dtype)
    assert '__global__ void vgc_sum_squares(' in source
    ptx = kernel_harness.nvrtc_ptx(source,
                                   kernel_harness.cupy_compile_options())
    ops = kernel_harness.ptx_float_instructions(ptx)
    assert any(op.startswith('mul.rn.f') for op in ops), ops
    assert any(op.startswith('add.rn.f') for op in ops), ops
    assert not [op for op in ops if '.ftz' in op or 'fma' in op], ops


@pytest.mark.parametrize('src,dst', [(F64, F32), (F32, F64), (F32, F16),
                                     (F16, F32), (F64, F16)])
def test_cast_kernel_matches_numpy_on_edge_values(host_kernels, src, dst):
    """vgc_cast (the device decoder's and the mean's casts): NumPy's astype
    bit for bit, subnormal and overflowing values included."""
    x = numpy.concatenate([edge_values(src), numpy.random.default_rng(9)
                           .normal(0, 1e-3, 500).astype(src)])
    out = numpy.empty(x.size, dst)
    host_kernels('vgc_cast', x, out)
    with numpy.errstate(over='ignore'):
        assert_bitwise(out, x.astype(dst))


@pytest.mark.parametrize('sdt', [F32, F64])
def test_add_scale_divide_kernels_match_numpy(host_kernels, sdt):
    """vgc_add_to, vgc_scale, vgc_divide: NumPy's +, * and / bit for bit,
    subnormal operands and results included."""
    rng = numpy.random.default_rng(10)
    tiny = numpy.finfo(sdt).tiny
    a = numpy.concatenate([edge_values(sdt), rng.normal(0, 1, 300).astype(
        sdt), (rng.normal(0, 1, 200) * tiny).astype(sdt)])
    b = numpy.roll(a, 7)
    acc = a.copy()
    host_kernels('vgc_add_to', b, acc)
    with numpy.errstate(all='ignore'):
        assert_bitwise(acc, a + b)
        for k in (0.25, 1 / 3, 1024.0, 3e-39):
            k = sdt(k)
            got = numpy.empty_like(a)
            host_kernels('vgc_scale', a, k, got)
            assert_bitwise(got, a * k)
            host_kernels('vgc_divide', a, k, got)
            assert_bitwise(got, a / k)


# ---- FMT_GAP (issue 14): the gap-coded index body on the device ------------

def gap_body_reference(index, nibbles, k, sign_only):
    """The FMT_GAP body straight from the spec, a bit list at a time (an
    oracle independent of the kernels and of chainer_vgc.codec)."""
    bits, prev, table = [], -1, []
    for j, i in enumerate(int(x) for x in index):
        if j and j % 1024 == 0:  # restart point: bit, index before (u64)
            table += [len(bits) & 0xFFFFFFFF, len(bits) >> 32,
                      prev & 0xFFFFFFFF, prev >> 32]
        gap, prev = i - prev - 1, i
        q, low = gap >> k, gap & ((1 << k) - 1)
        if q < codec.GAP_ESCAPE:
            bits += [0] * q + [1]
        else:
            v = q - codec.GAP_ESCAPE + 1
            n = v.bit_length() - 1
            bits += [0] * (codec.GAP_ESCAPE + n) + [1]
            bits += [(v >> b) & 1 for b in range(n)]
        bits += [(low >> b) & 1 for b in range(k)]
    vbits = 1 if sign_only else 4
    values = []
    for x in (int(x) for x in nibbles):
        values += [(x >> 3) & 1] if sign_only else [(x >> b) & 1
                                                    for b in range(4)]

    def words(bit_list):
        n = -(-len(bit_list) // 32)
        padded = numpy.zeros(32 * n, numpy.uint8)
        padded[:len(bit_list)] = bit_list
        return numpy.packbits(padded, bitorder='little').view('<u4')

    stream = words(bits)
    assert len(values) == len(index) * vbits
    head = [k | (codec.GAP_SIGN_ONLY if sign_only else 0)
            | (0x80 if table else 0), stream.size]  # bit 7: a table
    return numpy.concatenate([numpy.array(head + table, numpy.uint32),
                              stream, words(values)]).astype(numpy.uint32)


def rice_parameter(count, size):
    """k of the spec (integers only)."""
    t = (11 * (size - count)) // (16 * count)
    return min(t.bit_length() - 1 if t >= 1 else 0, 62)


def _gap_cases():
    """(size, index, nibbles, k, sign_only): densities from one element to
    all, the first and last index, escapes, gaps past 2**32 and 2**62, k
    from 0 to 62."""
    rng = numpy.random.default_rng(14)
    cases = []
    for size in (1, 7, 100, 1000, 5000):
        for count in sorted({min(c, size) for c in (
                1, 2, size // 100, size // 10, size // 2, size - 1,
                size) if c}):
            index = numpy.sort(rng.choice(size, count, replace=False))
            cases.append((size, index))
    cases += [(100, numpy.array([0])), (100, numpy.array([99])),
              (100, numpy.array([0, 99])), (5000, numpy.arange(5000)),
              (5000, numpy.arange(0, 5000, 37)),
              (2 ** 40, numpy.array([0, 2 ** 32 + 5, 2 ** 33 + 7,
                                     2 ** 40 - 1])),
              (2 ** 63 - 1, numpy.array([2 ** 62, 2 ** 63 - 2])),
              (2 ** 63 - 1, numpy.array([2 ** 63 - 2])),
              (2 ** 36, numpy.sort(rng.choice(2 ** 36, 300,
                                              replace=False)))]
    out = []
    for n, (size, index) in enumerate(cases):
        index = index.astype(numpy.int64)
        nibbles = rng.integers(0, 16, index.size).astype(numpy.uint8)
        ks = {rice_parameter(index.size, size), 0, 1, 5}
        if n % 3 == 0:
            ks |= {17, 33, 62}
        for k in sorted(ks):
            out.append((size, index, nibbles, k, n % 2 == 0))
            out.append((size, index, nibbles, k, n % 2 == 1))
    return out


def test_gap_reference_worked_example():
    """The oracle reproduces the spec's worked example (and the lead's
    codec.gap_body too, once it exists)."""
    index = numpy.array([3, 4, 40], numpy.int64)
    nibbles = numpy.array([0b0001, 0b1000, 0b0010], numpy.uint8)
    assert rice_parameter(3, 100) == 4
    want = [4, 1, 0x7027, 0x281]
    assert gap_body_reference(index, nibbles, 4, False).tolist() == want
    if hasattr(codec, 'gap_body'):
        assert codec.gap_body(index, nibbles, 4, False).tolist() == want
        assert device_gap_body(index, nibbles, 4, False).tolist() == want


def test_gap_reference_agrees_with_codec():
    """Where chainer_vgc.codec has its NumPy FMT_GAP reference, it is the
    same function as the oracle above (so the kernels agree with it)."""
    for size, index, nibbles, k, sign_only in _gap_cases()[::5]:
        if sign_only:
            nibbles = nibbles & 8
        assert_bitwise(codec.gap_body(index, nibbles, k, sign_only),
                       gap_body_reference(index, nibbles, k, sign_only))
        if hasattr(codec, 'rice_parameter'):
            assert codec.rice_parameter(index.size, size) == \
                rice_parameter(index.size, size)


def test_gap_length_kernel_matches_the_spec(host_kernels):
    """vgc_gap_lengths on the CPU: the gaps (index[i-1] read through the
    raw parameter) and the code lengths of the spec, from gap 0 to
    2**63 - 1 (Elias-gamma prefixes up to 62 zero bits), k 0..63."""
    index = numpy.array([0, 1, 2, 4, 19, 20, 36, 2 ** 31, 2 ** 32 + 1,
                         2 ** 40, 2 ** 62, 2 ** 63 - 2], numpy.int64)
    tops = numpy.array([2 ** 63 - 1], numpy.int64)  # gap 2**63 - 1
    for idx in (index, tops):
        want_gap = numpy.diff(numpy.concatenate([[-1], idx])) - 1
        for k in list(range(64)):
            gap = numpy.full(idx.size, -5, numpy.int64)
            length = numpy.full(idx.size, -5, numpy.int64)
            host_kernels('vgc_gap_lengths', idx, numpy.int32(k), gap,
                         length)
            assert (gap == want_gap).all()
            for g, n in zip(want_gap.tolist(), length.tolist()):
                q = g >> k
                esc = codec.GAP_ESCAPE
                want = (q + 1 if q < esc else
                        esc + 2 * ((q - esc + 1).bit_length() - 1) + 1) + k
                assert n == want, (g, k)
    small = numpy.array([5, 9], numpy.int32)  # int32 indices
    gap, length = _gap_lengths(host_kernels, small, 0)
    assert gap.tolist() == [5, 3] and length.tolist() == [6, 4]
    # as CuPy, the loop size is the non-raw arrays': the outputs here
    with pytest.raises(ValueError, match='cannot be deduced'):
        host_kernels('vgc_gap_lengths', small, numpy.int32(0))


def test_harness_parses_raw_params():
    params = kernel_harness.parse_params('raw I index, int32 k')
    assert params == [('I', 'index', True), ('int32', 'k', False)]
    with pytest.raises(ValueError):
        kernel_harness.parse_params('raw raw I index')


def _gap_lengths(host_kernels, index, k):
    gap = numpy.empty(index.size, numpy.int64)
    length = numpy.empty(index.size, numpy.int64)
    host_kernels('vgc_gap_lengths', index, numpy.int32(k), gap, length)
    return gap, length


def _host_gap_body(host_kernels, index, nibbles, k, sign_only):
    """device_gap_body's steps with the host-compiled kernels on NumPy
    arrays (the scan by numpy.cumsum)."""
    count = index.size
    gap, length = _gap_lengths(host_kernels, index, k)
    end = numpy.cumsum(length)
    g = -(-int(end[-1]) // 32)
    v = -(-count * (1 if sign_only else 4) // 32)
    t = 4 * codec.gap_restarts(count)  # the restart table, gathered
    body = numpy.zeros(2 + t + g + v, numpy.uint32)
    body[:2] = [k | (64 if sign_only else 0) | (0x80 if t else 0), g]
    last = numpy.arange(1, t // 4 + 1) * codec.GAP_RESTART_CODES - 1
    body[2:2 + t] = numpy.stack([end[last], index[last]], axis=1).astype(
        numpy.uint64).view(numpy.uint32).reshape(-1)
    host_kernels('vgc_gap_write', gap, end, numpy.int32(k),
                 body[2 + t:2 + t + g])
    host_kernels('vgc_gap_values', nibbles, numpy.int64(count),
                 bool(sign_only), body[2 + t + g:])
    return body


def test_gap_kernels_on_the_host_match_the_reference(host_kernels):
    """The three FMT_GAP kernels, run element by element on the CPU from
    kernels/vgc_numerics.cuh: bodies bit-identical to the spec's."""
    cases = _gap_cases()
    for size, index, nibbles, k, sign_only in cases:
        got = _host_gap_body(host_kernels, index, nibbles, k, sign_only)
        want = gap_body_reference(index, nibbles, k, sign_only)
        assert got.tolist() == want.tolist(), (size, index.size, k,
                                               sign_only)
    assert len(cases) > 100


def test_gap_write_keeps_the_neighbours_bits(host_kernels):
    """Codes spanning up to several words (an escape of 16 + 125 bits and a
    62-bit low part), written in any element order, give the same stream:
    each thread only ORs its own bits in."""
    index = numpy.array([2 ** 62 - 1, 2 ** 62, 2 ** 63 - 2], numpy.int64)
    for k in (0, 3, 31, 62):
        gap, length = _gap_lengths(host_kernels, index, k)
        end = numpy.cumsum(length)
        g = -(-int(end[-1]) // 32)
        want = gap_body_reference(index, numpy.zeros(3, numpy.uint8), k,
                                  False)[2:2 + g]
        for order in ([0, 1, 2], [2, 1, 0], [1, 2, 0]):
            stream = numpy.zeros(g, numpy.uint32)
            for j in order:
                host_kernels('vgc_gap_write', gap[j:j + 1].copy(),
                             end[j:j + 1].copy(), numpy.int32(k), stream)
            assert stream.tolist() == want.tolist(), (k, order)


@pytest.mark.parametrize('ndt', [numpy.uint8, numpy.int32, numpy.uint32])
def test_gap_values_kernel_fields_and_padding(host_kernels, ndt):
    """vgc_gap_values: one thread per value word; 4-bit nibbles or sign
    bits (bit 3), LSB-first, the padding past count 0, from nibbles of any
    integer dtype."""
    rng = numpy.random.default_rng(3)
    for count in (1, 7, 8, 9, 31, 32, 33, 100):
        nib = rng.integers(0, 16, count).astype(ndt)
        for sign_only in (False, True):
            per = 32 if sign_only else 8
            words = numpy.full(-(-count // per), 0xFFFFFFFF, numpy.uint32)
            host_kernels('vgc_gap_values', nib, numpy.int64(count),
                         sign_only, words)
            want = gap_body_reference(numpy.arange(count), nib, 0,
                                      sign_only)
            assert words.tolist() == want[-words.size:].tolist()


def test_gap_body_on_the_device_matches_the_reference(device):
    """device_gap_body end to end on (fake) device arrays, its kernels
    run host-compiled: the spec's body bit for bit, built on the device
    with one scalar read (the total bit count) and no other transfer."""
    for n, (size, index, nibbles, k, sign_only) in enumerate(_gap_cases()):
        idt = numpy.int32 if n % 4 == 1 and size < 2 ** 31 else numpy.int64
        ndt = (numpy.uint8, numpy.int32, numpy.uint32)[n % 3]
        d_index = device.asarray(index.astype(idt))
        d_nib = device.asarray(nibbles.astype(ndt))
        device.reset()
        body = device_gap_body(d_index, d_nib, k, sign_only)
        assert isinstance(body, device.ndarray)
        assert body.dtype == numpy.uint32
        assert device.log == [('scalar', 8, 'int')], device.log
        device.reset()
        want = gap_body_reference(index, nibbles, k, sign_only)
        assert device.asnumpy(body).tolist() == want.tolist(), (
            size, index.size, k, sign_only)


def test_gap_body_on_the_device_edge_arguments(device):
    """No element: the empty body [param, 0] without any read; a bad k or
    a nibble count that differs from the index count: ValueError."""
    empty = device.zeros(0, numpy.int64)
    device.reset()
    body = device_gap_body(empty, device.zeros(0, numpy.uint8), 3, True)
    assert device.asnumpy(body).tolist() == [3 | 64, 0]
    assert device.count('scalar') == 0
    index = device.asarray(numpy.arange(3))
    with pytest.raises(ValueError):
        device_gap_body(index, device.zeros(3, numpy.uint8), 64, False)
    with pytest.raises(ValueError):
        device_gap_body(index, device.zeros(2, numpy.uint8), 1, False)
