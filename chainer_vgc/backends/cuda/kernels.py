"""CuPy ElementwiseKernels built from the CUDA source in ``kernels/``.

Device primitives only: this module knows nothing of the wire format (it
imports no part of :mod:`chainer_vgc.codec`, which builds on it: the
FMT_GAP body on the device is :func:`chainer_vgc.codec.gap.device_gap_body`).

Every kernel body is one call into ``kernels/vgc_numerics.cuh``; that file is
the kernels' ``preamble``.  :data:`SPECS` is the one table of kernel
signatures and operation strings: :func:`get_kernel` turns an entry into a
``cupy.ElementwiseKernel``, and the test suite compiles the same entries with
``nvcc`` to PTX and, with the host C++ compiler, runs them element by element
on the CPU against the NumPy path (``tests/kernel_harness.py``).

Type placeholders: ``G`` gradient dtype, ``H`` dtype of the per-sample sum of
squares, ``S`` state dtype (float32 for float16/float32 parameters, float64
for float64 parameters), ``I`` index dtype.
"""

import collections
import functools
import os

import numpy

from chainer_vgc.backends import arrays

KernelSpec = collections.namedtuple(
    'KernelSpec', ['in_params', 'out_params', 'operation'])

#: name -> KernelSpec.  Output parameters that are also read (r, v) are
#: passed as existing arrays.
SPECS = collections.OrderedDict([
    # Fig. "Basic": accumulate, criterion (eq. 4), decay of unselected v.
    ('vgc_basic_select', KernelSpec(
        'G g, H s, S alpha, S zeta', 'S r, S v, bool sel',
        'sel = vgc_basic_select<S>(vgc_to<S>(g), vgc_to<S>(s), alpha, zeta, '
        'r, v)')),
    # Fig. "Hybrid".
    ('vgc_hybrid_step', KernelSpec(
        'G g, H s, S alpha, S zeta, S tau', 'S r, S v, int8 sign',
        'sign = vgc_hybrid_step<S>(vgc_to<S>(g), vgc_to<S>(s), alpha, zeta, '
        'tau, r, v)')),
    # Strom's threshold method.
    ('vgc_strom_step', KernelSpec(
        'G g, S tau', 'S r, int8 sign',
        'sign = vgc_strom_step<S>(vgc_to<S>(g), tau, r)')),
    # Sec. 4.2 quantization + 32-bit word encoding.
    ('vgc_pow2_encode', KernelSpec(
        'S x, I index, int32 e_k', 'uint32 word, bool ok',
        'ok = vgc_pow2_encode<S>(x, e_k, (long long)index, word)')),
    # Its exact inverse.
    ('vgc_pow2_decode', KernelSpec(
        'uint32 word, int32 e_k, S scale', 'int64 index, S value',
        'value = vgc_pow2_decode<S>(word, e_k, scale, index)')),
    # Arithmetic of the decoder, the mean and the loss scaling on the
    # device, by the subnormal rule (CuPy's own kernels flush subnormals):
    # y = x cast to y's dtype
    ('vgc_cast', KernelSpec('T x', 'S y', 'y = vgc_to<S>(x)')),
    # acc += x
    ('vgc_add_to', KernelSpec('S x', 'S acc', 'acc = vgc_add(acc, x)')),
    # y = x * k
    ('vgc_scale', KernelSpec('S x, S k', 'S y', 'y = vgc_mul(x, k)')),
    # y = x / k
    ('vgc_divide', KernelSpec('S x, S k', 'S y', 'y = vgc_div(x, k)')),
    # FMT_GAP (issue 14), integers only; see
    # chainer_vgc.codec.gap.device_gap_body.  Element i of the
    # sorted indices: its gap (index[i] - index[i-1] - 1, index[-1] = -1)
    # and the bit length of its code with Rice parameter k.
    ('vgc_gap_lengths', KernelSpec(
        'raw I index, int32 k', 'int64 gap, int64 length',
        'length = vgc_gap_length(index, i, k, gap)')),
    # The code of each gap ORed (atomically) into the zeroed uint32 stream,
    # ending at bit `end` (inclusive prefix sum of the lengths).
    ('vgc_gap_write', KernelSpec(
        'int64 gap, int64 end, int32 k', 'raw uint32 stream',
        'vgc_gap_write(stream, gap, end, k)')),
    # Value word i: the 4-bit fields (sign << 3 | d) of elements 8i..8i+7,
    # or with sign_only the sign bits of elements 32i..32i+31.
    ('vgc_gap_values', KernelSpec(
        'raw N nibbles, int64 count, bool sign_only', 'uint32 word',
        'word = vgc_gap_value_word(nibbles, count, sign_only, i)')),
    # The whole-model step (issue 25; chainer_vgc.engines.cuda.compress): every
    # tensor of a dtype group in one launch, laid end to end (offsets:
    # n_tensors + 1 element offsets; active: the tensors with a gradient
    # this step).  The select passes write the next state into r2, v2, and
    # ok (int64) which elements are sent: scanned in place it becomes pos,
    # the inclusive scan the later passes read (an element's ok is
    # pos[i] - pos[i - 1]; a code's length ends[j] - ends[j - 1]).
    # The start of a step: a tensor's fault flags and largest selected |r|
    # cleared (one thread a tensor)
    ('vgc_model_clear', KernelSpec(
        'int32 n_tensors', 'uint32 flags, raw uint64 maxbits',
        'vgc_model_clear(i, flags, maxbits)')),
    # the arrays of every tensor gathered end to end (the gradients, the
    # sums of squares) through a table of their device addresses (0: zeros,
    # 1: another dtype's launch), `like` an array of their dtype G
    ('vgc_model_gather', KernelSpec(
        'raw uint64 table, raw G like, raw int64 offsets, int32 n_tensors',
        'T out',
        'vgc_model_gather<T, G>(i, table, offsets, n_tensors, out)')),
    ('vgc_model_vgc_select', KernelSpec(
        'G g, H s, S r, S v, raw int64 offsets, int32 n_tensors, '
        'raw bool active, S alpha, S zeta',
        'S r2, S v2, int8 sel, raw uint32 flags, raw uint64 maxbits',
        'vgc_model_vgc_select<S>(i, vgc_to<S>(g), s, r, v, offsets, '
        'n_tensors, active, alpha, zeta, r2, v2, sel, flags, maxbits)')),
    ('vgc_model_keep', KernelSpec(
        'S r2, int8 sel, raw uint64 maxbits, raw int64 offsets, '
        'int32 n_tensors', 'int64 ok',
        'ok = vgc_model_keep<S>(i, r2, sel, maxbits, offsets, n_tensors)')),
    ('vgc_model_hybrid_step', KernelSpec(
        'G g, H s, S r, S v, raw int64 offsets, int32 n_tensors, '
        'raw bool active, S alpha, S zeta, S tau',
        'S r2, S v2, int8 sign, int64 ok, raw uint32 flags',
        'vgc_model_hybrid_step<S>(i, vgc_to<S>(g), s, r, v, offsets, '
        'n_tensors, active, alpha, zeta, tau, r2, v2, sign, ok, flags)')),
    ('vgc_model_strom_step', KernelSpec(
        'G g, S r, raw int64 offsets, int32 n_tensors, raw bool active, '
        'S tau', 'S r2, int8 sign, int64 ok, raw uint32 flags',
        'vgc_model_strom_step<S>(i, vgc_to<S>(g), r, offsets, n_tensors, '
        'active, tau, r2, sign, ok, flags)')),
    # one thread (`done`: one element): headers, each group's base word
    # and e_k
    ('vgc_model_layout', KernelSpec(
        'raw int64 pos, raw int64 offsets, int32 n_tensors, bool from_max, '
        'uint32 scale, bool is_f64',
        'int32 done, raw uint64 maxbits, raw int64 base, raw int64 ek, '
        'raw uint32 msg, raw uint32 info',
        'vgc_model_layout(pos, offsets, n_tensors, maxbits, from_max, '
        'scale, base, ek, msg, info, is_f64); done = 1')),
    ('vgc_model_vgc_write', KernelSpec(
        'int8 sel, raw int64 pos, raw int64 offsets, '
        'int32 n_tensors, raw int64 base, raw int64 ek, raw bool active, '
        'bool keep', 'S r2, S v2, raw uint32 msg, raw uint32 flags',
        'vgc_model_vgc_write<S>(i, sel, pos, offsets, n_tensors, base, '
        'ek, active, keep, r2, v2, msg, flags)')),
    # 'none': dense FMT_RAW groups of the gradients (in the state dtype)
    ('vgc_model_none_layout', KernelSpec(
        'raw int64 offsets, int32 n_tensors, raw bool active, bool is_f64',
        'int32 done, raw int64 base, raw uint32 msg, raw uint32 info',
        'vgc_model_none_layout(offsets, n_tensors, active, is_f64, base, '
        'msg, info); done = 1')),
    ('vgc_model_none_write', KernelSpec(
        'G g, raw int64 offsets, int32 n_tensors, raw int64 base',
        'raw uint32 msg, raw uint32 flags',
        'vgc_model_none_write(i, vgc_to<typename vgc_state<G>::type>(g), '
        'offsets, n_tensors, base, msg, flags)')),
    # decode + mean of every rank's message, one thread per element of
    # the model (chainer_vgc.engines.cuda.decode)
    ('vgc_model_decode_mean', KernelSpec(
        'raw uint32 buf, raw uint64 gaps, raw int64 offsets, raw int64 tids, '
        'int32 n_local, int32 n_tensors, int32 ranks, bool dense, '
        'bool rescaled, float64 inv, float64 rescale, float32 k16',
        'D mean',
        'mean = vgc_model_mean<D>(i, buf, gaps, offsets, tids, n_local, '
        'n_tensors, ranks, dense, rescaled, inv, rescale, k16)')),
    # ... or (without the dense tree) by scatter: the sums in acc from
    # +0.0, one launch per rank in rank order, then the means
    ('vgc_model_scatter', KernelSpec(
        'raw uint32 buf, raw uint64 gaps, raw int64 item_ends, '
        'raw int64 item_tids, int32 n_items, int32 rank, int32 n_tensors, '
        'raw int64 bounds, raw int64 acc_at',
        'int32 done, raw uint32 acc',
        'vgc_model_scatter(i, buf, gaps, item_ends, item_tids, n_items, '
        'rank, n_tensors, bounds, acc_at, acc); done = 1')),
    ('vgc_model_finish', KernelSpec(
        'raw uint32 acc, raw int64 acc_at, raw int64 offsets, '
        'raw int64 tids, int32 n_local, bool rescaled, float64 inv, '
        'float64 rescale, float32 k16',
        'D mean',
        'mean = vgc_model_finish<D>(i, acc, acc_at, offsets, tids, n_local, '
        'rescaled, inv, rescale, k16)')),
    # FMT_GAP bodies decoded and checked on the device, one thread per
    # block of codes from its restart point (chainer_vgc.engines.cuda.decode)
    ('vgc_model_gap_expand', KernelSpec(
        'raw uint32 buf, raw int64 starts, raw int64 groups, '
        'int32 n_groups', 'int32 done, raw uint64 out, raw uint32 errs',
        'vgc_model_gap_expand(i, buf, starts, groups, n_groups, out, errs); '
        'done = 1')),
    # FMT_GAP on the device ('gap', 'auto'): ranks compacted, code
    # lengths, a one-thread layout, every message word assembled
    ('vgc_model_vgc_compact', KernelSpec(
        'int8 sel, raw int64 pos, raw int64 offsets, '
        'int32 n_tensors, raw uint64 maxbits, raw bool active, bool keep',
        'S r2, S v2, raw uint32 cw, raw int32 ct, raw uint32 flags',
        'vgc_model_vgc_compact<S>(i, sel, pos, offsets, n_tensors, '
        'maxbits, active, keep, r2, v2, cw, ct, flags)')),
    ('vgc_model_sign_compact', KernelSpec(
        'int8 sign, raw int64 pos, raw int64 offsets, int32 n_tensors',
        'raw uint32 cw, raw int32 ct',
        'vgc_model_sign_compact(i, sign, pos, offsets, n_tensors, cw, ct)')),
    ('vgc_model_gap_lengths', KernelSpec(
        'raw uint32 cw, raw int32 ct, raw int64 pos, raw int64 offsets, '
        'int32 n_tensors', 'int64 len',
        'len = vgc_model_gap_length(i, cw, ct, pos, offsets, n_tensors)')),
    ('vgc_model_gap_layout', KernelSpec(
        'raw int64 pos, raw int64 ends, raw int64 offsets, int32 n_tensors, '
        'bool from_max, bool is_f64, bool always_gap, bool sign_only',
        'int32 done, raw uint64 maxbits, raw int64 rec, raw uint32 info',
        'vgc_model_gap_layout(pos, ends, offsets, n_tensors, maxbits, '
        'from_max, is_f64, always_gap, sign_only, rec, info); done = 1')),
    ('vgc_model_gap_assemble', KernelSpec(
        'raw int64 rec, int32 n_tensors, raw uint32 cw, raw int64 pos, '
        'raw int64 offsets, raw int64 ends, uint32 scale, bool sign_only',
        'uint32 word',
        'vgc_model_gap_assemble(i, rec, n_tensors, cw, pos, offsets, ends, '
        'scale, sign_only, word)')),
    ('vgc_model_sign_write', KernelSpec(
        'int8 sign, raw int64 pos, raw int64 offsets, int32 n_tensors, '
        'raw int64 base', 'raw uint32 msg',
        'vgc_model_sign_write(i, sign, pos, offsets, n_tensors, base, '
        'msg)')),
])

#: ReductionKernels: name -> ReductionSpec.
ReductionSpec = collections.namedtuple(
    'ReductionSpec', ['in_params', 'out_params', 'map_expr', 'reduce_expr',
                      'post_map_expr', 'identity'])
REDUCTION_SPECS = collections.OrderedDict([
    # the statistics' per-sample sum of squares, sum_z g_z**2 over axis 0
    # (chainer_vgc.statistics), without a temporary of g's size
    ('vgc_sum_squares', ReductionSpec(
        'T g', 'T y', 'vgc_mul(g, g)', 'vgc_add(a, b)', 'y = a', '0')),
])

#: Compiler options: no FMA contraction, so that device results equal the
#: host and NumPy results bit for bit (CuPy appends -ftz=true; the
#: numerics avoid it, see kernels/vgc_numerics.cuh).
NVRTC_OPTIONS = ('--fmad=false',)

_SOURCE_NAME = 'vgc_numerics.cuh'


def source_dir():
    """Directory that holds the CUDA sources (installed or source tree)."""
    # the package's folder (this file is chainer_vgc/backends/cuda/...)
    here = os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    candidates = [os.path.join(here, 'kernel_src'),
                  os.path.join(os.path.dirname(here), 'kernels')]
    for path in candidates:
        if os.path.isfile(os.path.join(path, _SOURCE_NAME)):
            return path
    raise RuntimeError(
        'chainer_vgc: CUDA source {} not found in {}; reinstall the package '
        '(pip install chainer-vgc) or run from a source checkout'.format(
            _SOURCE_NAME, ' or '.join(candidates)))


@functools.lru_cache(maxsize=None)
def source():
    """Text of ``kernels/vgc_numerics.cuh``."""
    with open(os.path.join(source_dir(), _SOURCE_NAME)) as f:
        return f.read()


@functools.lru_cache(maxsize=None)
def get_kernel(name):
    """The ``cupy.ElementwiseKernel`` (:data:`SPECS`) or
    ``cupy.ReductionKernel`` (:data:`REDUCTION_SPECS`) named ``name``.

    Checks the CuPy version first and loads NVRTC of CuPy's CUDA major from
    its NVIDIA wheel where it is installed (``nvidia-cuda-nvrtc-cu12`` for
    CuPy 13, ``nvidia-cuda-nvrtc`` 13 for CuPy 14;
    :mod:`chainer_vgc.backends.cuda.support`)."""
    import cupy
    from chainer_vgc.backends.cuda import support as cuda_support
    cuda_support.check_cupy(cupy)
    cuda_support.preload_nvrtc()
    if name in REDUCTION_SPECS:
        spec = REDUCTION_SPECS[name]
        return cupy.ReductionKernel(
            spec.in_params, spec.out_params, spec.map_expr, spec.reduce_expr,
            spec.post_map_expr, spec.identity, name, preamble=source(),
            options=NVRTC_OPTIONS)
    spec = SPECS[name]
    return cupy.ElementwiseKernel(
        spec.in_params, spec.out_params, spec.operation, name,
        preamble=source(), options=NVRTC_OPTIONS)


def scan(xp, a):
    """The inclusive scan of the int64 array ``a`` (on the device), in
    place; returns ``a``.  CUB's single-pass scan where CuPy has it
    (``cupy.cuda.cub.cub_scan``: two launches and no cast pass, for fewer
    than 2**31 elements), else ``cupy.cumsum`` into ``a`` (a copy, then
    about 2 log_512(N) + 1 launches without CUB)."""
    cub = getattr(getattr(xp, 'cuda', None), 'cub', None)
    if cub is not None and 0 < a.size < 2 ** 31 and \
            cub.cub_scan(a, cub.CUPY_CUB_CUMSUM) is not None:
        return a
    return xp.cumsum(a, out=a) if a.size else a


# ---- device arithmetic by the subnormal rule ---------------------------------
# CuPy compiles its own kernels (astype, +, *, /) with -ftz=true, flushing
# float32 subnormals; these helpers run the kernels above on CuPy arrays and
# are the plain NumPy operations otherwise.

def cast(x, dtype):
    """``x`` as ``dtype`` (``x`` itself when it already is)."""
    dtype = numpy.dtype(dtype)
    if x.dtype == dtype or not arrays.is_cupy(arrays.get_array_module(x)):
        return x.astype(dtype, copy=False)
    out = arrays.get_array_module(x).empty(x.shape, dtype=dtype)
    get_kernel('vgc_cast')(x, out)
    return out


def add_into(acc, x):
    """``acc += x`` (same dtype and shape)."""
    if arrays.is_cupy(arrays.get_array_module(acc)):
        get_kernel('vgc_add_to')(x, acc)
    else:
        acc += x
    return acc


def add(a, b, out=None):
    """``a + b`` (same dtype and shape); a new array, or written into
    ``out`` (an array of that dtype and shape) and returned."""
    if arrays.is_cupy(arrays.get_array_module(a)):
        if out is None:
            return add_into(a.copy(), b)
        out[...] = a
        return add_into(out, b)
    return numpy.add(a, b, out=out)


def scale(x, k):
    """``x * k`` in x's dtype, ``k`` a scalar of that dtype; a new array."""
    return _with_scalar('vgc_scale', x, k, numpy.multiply)


def divide(x, k):
    """``x / k`` in x's dtype, ``k`` a scalar of that dtype; a new array."""
    return _with_scalar('vgc_divide', x, k, numpy.divide)


def _with_scalar(name, x, k, host_op):
    k = x.dtype.type(k)
    if arrays.is_cupy(arrays.get_array_module(x)):
        out = arrays.get_array_module(x).empty(x.shape, dtype=x.dtype)
        get_kernel(name)(x, k, out)
        return out
    return host_op(x, k)
