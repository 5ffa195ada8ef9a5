"""The CuPy kernels' source, compiled for the GPU and executed on the CPU.

Every entry of chainer_vgc.kernels.SPECS is (1) compiled to PTX with nvcc,
exactly as generated for the device, and (2) compiled with the host C++
compiler from the same kernels/vgc_numerics.cuh and operation strings, run
element by element, and compared bit for bit with the NumPy path.
"""

import numpy
import pytest

import kernel_harness
from chainer_vgc import GradientCompressor
from chainer_vgc import backend
from chainer_vgc import codec
from chainer_vgc import kernels
from chainer_vgc.backend import state_dtype
from chainer_vgc.rules import Hybrid
from chainer_vgc.rules import QSGD
from chainer_vgc.rules import Strom
from chainer_vgc.rules import VGC

from reference import assert_bitwise
from reference import edge_values

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
    if name == 'vgc_cast' and not float_ops:  # f16 conversions: CuPy's
        assert 'cvt.' in ptx  # header converts in inline asm of its own
    # (the codec kernels work on the bits only: no float instruction)
    assert not [op for op in float_ops if '.ftz' in op or 'fma' in op], \
        float_ops


@needs_cupy
def test_cupy_options_flush_plain_operators():
    """The control: the same pipeline on plain C operators does emit .ftz
    (so the test above can fail), and -ftz=true is CuPy's last option."""
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
    """The GPU decoder (codec.add_validated) on an uploaded message."""
    codec.unpack(message, comp.sizes, comp.dtypes)  # validated first
    outs = [fake.zeros(n, state_dtype(dt)) for n, dt in zip(comp.sizes,
                                                           comp.dtypes)]
    codec.add_validated(message, fake.asarray(message), outs, comp.sizes)
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
        assert (backend.to_numpy(comp.state(2)['r']) == 0).all()
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
