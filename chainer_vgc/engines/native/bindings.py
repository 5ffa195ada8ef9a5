"""The native CPU backend: ctypes bindings of ``kernels/vgc_host.cpp``.

The library is compiled by the normal install (``setup.py``) from
``kernels/vgc_host.cpp``, which includes ``kernels/vgc_numerics.cuh``, the
source of the CuPy ElementwiseKernels: the per-element arithmetic of the GPU
and of this backend is one text.  It fuses each rule's step into one pass
over g, s, r, v per tensor, encodes the selected elements straight into the
message buffer, and decodes the p messages of a step straight into the
gradient arrays with the 1/p mean (see the comment at the top of the C++
file).  Results equal the NumPy reference (``CHAINER_VGC_BACKEND=numpy``)
bit for bit; ``tests/test_native.py`` checks it.

The library is loaded with ``ctypes`` (which releases the GIL during each
call).  A missing, unloadable or stale build raises
:class:`NativeBackendError` saying how to fix it; nothing falls back to the
NumPy path silently.

Threads: OpenMP, ``OMP_NUM_THREADS`` when set, else the cores this process
may run on (:func:`set_num_threads` overrides; the communicator divides the
cores among the ranks of a node).
"""

import ctypes
import hashlib
import importlib.machinery
import os
import threading

import numpy

from chainer_vgc.backends.cuda import kernels

#: the sources the library is built from (hash compiled in by setup.py,
#: whose NATIVE_SOURCES names the same files in the same order):
#: vgc_host.cpp, the one translation unit, and the headers it includes
SOURCES = ('vgc_host.cpp', 'vgc_host_common.h', 'vgc_gap_coder.h',
           'vgc_blocks.h', 'vgc_passes.h', 'vgc_decode.h', 'vgc_numerics.cuh')

#: dtype codes of the C++ side
DTYPE_CODES = {numpy.dtype(numpy.float16): 0, numpy.dtype(numpy.float32): 1,
               numpy.dtype(numpy.float64): 2}

#: flags returned by the compress functions
BAD_GRAD, BAD_SQSUM, OVERFLOW_R, OVERFLOW_V = 1, 2, 4, 8
#: the group cannot be written (more than 2**32 - 1 elements, or a tensor
#: over 2**28 elements with coding 'fixed'); :func:`_compress` raises
UNENCODABLE = 16

#: the ``coding`` argument of the compress functions: the position in
#: ``codec.CODINGS`` ('auto', 'fixed', 'gap')
CODING_AUTO, CODING_FIXED, CODING_GAP = 0, 1, 2

_FIX = ('rebuild it with the package (`pip install --no-build-isolation '
        '--no-deps -e .` in a source checkout, `make venv` with the Makefile; '
        'a C++ compiler with OpenMP such as g++ is needed), or select the '
        'slow NumPy reference with CHAINER_VGC_BACKEND=numpy')

_lock = threading.Lock()
_lib = None


class NativeBackendError(RuntimeError):
    """The native CPU backend is not built, cannot be loaded, or is stale."""


#: builds of the one source: ``'baseline'`` (any processor) and
#: ``'avx2'`` (x86-64 with AVX2 and F16C; no FMA), chosen at load time
ISAS = {'baseline': '_vgc_native', 'avx2': '_vgc_native_avx2'}


def library_path(isa='baseline'):
    """Path of the compiled library of ``isa`` in the package's folder
    (``chainer_vgc/``, where setup.py builds it), or None."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(here, ISAS[isa] + suffix)
        if os.path.isfile(path):
            return path
    return None


def requested_isa():
    """``CHAINER_VGC_NATIVE_ISA``: ``'auto'`` (default: AVX2 where the
    processor has it), ``'baseline'`` or ``'avx2'``."""
    isa = os.environ.get('CHAINER_VGC_NATIVE_ISA') or 'auto'
    if isa != 'auto' and isa not in ISAS:
        raise NativeBackendError(
            "chainer_vgc: CHAINER_VGC_NATIVE_ISA must be 'auto', 'baseline' "
            "or 'avx2', got {!r}".format(isa))
    return isa


def source_hash():
    """sha256 of the native sources as shipped (as setup.py computes it);
    None where they are not present."""
    h = hashlib.sha256()
    try:
        base = kernels.source_dir()
        for name in SOURCES:
            with open(os.path.join(base, name), 'rb') as f:
                h.update(f.read())
    except (OSError, RuntimeError):
        return None
    return h.hexdigest()


def _signatures(lib):
    vp, i32, i64, f64 = (ctypes.c_void_p, ctypes.c_int, ctypes.c_int64,
                         ctypes.c_double)
    table = {
        'vgc_native_abi': (i32, []),
        'vgc_native_isa': (ctypes.c_char_p, []),
        'vgc_native_cpu_has_avx2': (i32, []),
        'vgc_native_source_hash': (ctypes.c_char_p, []),
        'vgc_native_constants': (None, [vp]),
        'vgc_native_set_threads': (None, [i32]),
        'vgc_native_threads': (i32, []),
        'vgc_native_workspace_new': (vp, []),
        'vgc_native_workspace_free': (None, [vp]),
        'vgc_native_vgc': (i64, [vp, i32, i32] + [vp] * 6 +
                           [i64, f64, f64, i32, i32, i32, vp, vp]),
        'vgc_native_hybrid': (i64, [vp, i32, i32] + [vp] * 6 +
                              [i64, f64, f64, f64, i32, vp, vp]),
        'vgc_native_strom': (i64, [vp, i32, i32, vp, vp, vp, i64, f64, i32,
                                   vp, vp]),
        'vgc_native_none': (i64, [vp, i32, i32, vp, i64, vp, vp]),
        'vgc_native_check_inputs': (None, [vp, i32, vp, vp, vp, vp, vp]),
        'vgc_native_qsgd': (i64, [vp, i32, i32, vp, vp, i64, i64, i32, vp,
                                  vp]),
        'vgc_native_decode': (i32, [i32, vp, vp, i32, vp, vp, vp, vp, f64,
                                    i32, vp, vp, vp, vp, vp]),
        'vgc_native_rice_parameter': (i32, [i64, i64]),
        'vgc_native_gap_encode': (i64, [vp, vp, i64, i32, i32, vp]),
        'vgc_native_gap_decode': (i32, [vp, i64, i64, i64, vp, vp]),
    }
    table.update(_DECLARED)
    for name, (res, args) in table.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args


#: the fused passes declared by the rules' modules (:func:`fused_pass`):
#: symbol -> (result type, argument types)
_DECLARED = {}


def fused_pass(rule, arg_types):
    """Declare a rule's fused pass, the library's ``extern "C"
    vgc_native_<rule>(workspace, tensor_id, dtype code, g, ..., info)``
    (``kernels/vgc_host.cpp``), from the rule's own module: ``arg_types``,
    the ctypes types of its arguments between the gradient's address and
    the info array (an array is passed as ``ctypes.c_void_p``, its
    address).  Returns ``compress(ws, tensor_id, g, *args)`` ->
    ``(words, elements, flags)``, as the shipped ``compress_<rule>``
    wrappers; the symbol is looked up (and a missing one reported) when
    the library loads, or now if it is loaded."""
    vp = ctypes.c_void_p
    symbol = 'vgc_native_' + rule
    signature = (ctypes.c_int64, [vp, ctypes.c_int, ctypes.c_int, vp]
                 + list(arg_types) + [vp])
    if _lib is not None:  # (a symbol it lacks: AttributeError, naming it)
        fn = getattr(_lib, symbol)
        fn.restype, fn.argtypes = signature
    _DECLARED[symbol] = signature

    def compress(ws, tensor_id, g, *args):
        return _compress(rule, ws, tensor_id, g, *args)
    return compress


def _open(isa):
    path = library_path(isa)
    if path is None:
        raise NativeBackendError(
            'chainer_vgc: the native CPU backend (chainer_vgc/{}{}) is not '
            'built; {}'.format(ISAS[isa],
                               importlib.machinery.EXTENSION_SUFFIXES[0],
                               _FIX))
    try:
        lib = ctypes.CDLL(path)
        _signatures(lib)
    except (OSError, AttributeError) as e:
        raise NativeBackendError(
            'chainer_vgc: cannot load the native CPU backend {}: {}; {}'
            .format(path, e, _FIX))
    built = lib.vgc_native_source_hash().decode()
    current = source_hash()
    if current is not None and built != current:
        raise NativeBackendError(
            'chainer_vgc: the native CPU backend {} was built from other '
            'sources than {} (stale build); {}'.format(
                path, kernels.source_dir(), _FIX))
    _check_constants(lib)
    return lib


def load():
    """The loaded library (ctypes.CDLL); NativeBackendError if unusable.

    The baseline build is loaded first; it tells whether the processor runs
    the AVX2 build, which is then used (``CHAINER_VGC_NATIVE_ISA`` chooses
    explicitly)."""
    global _lib
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        isa = requested_isa()
        lib = _open('baseline')
        has_avx2 = bool(lib.vgc_native_cpu_has_avx2())
        if isa == 'avx2' and not has_avx2:
            raise NativeBackendError(
                'chainer_vgc: CHAINER_VGC_NATIVE_ISA=avx2 but this processor '
                'lacks AVX2 or F16C; unset it')
        if isa == 'avx2' or (isa == 'auto' and has_avx2
                             and library_path('avx2') is not None):
            lib = _open('avx2')
        _lib = lib
    return _lib


def isa():
    """The instruction set of the loaded build (``'baseline'``/``'avx2'``)."""
    return load().vgc_native_isa().decode()


#: what ``vgc_native_constants()`` writes, in order (``kernels/vgc_host.cpp``
#: and the ``vgc_numerics.cuh`` it includes), by their names in
#: :data:`chainer_vgc.codec.C_CONSTANTS`
CONSTANTS = ('VGC_MAGIC', 'VGC_FMT_POW2', 'VGC_FMT_RAW', 'VGC_FMT_QSGD',
             'VGC_HEADER_WORDS', 'VGC_INDEX_BITS', 'VGC_MAX_D',
             'VGC_LOG2_ZERO', 'VGC_RAW_DENSE', 'VGC_RAW_FLOAT64',
             'VGC_QSGD_OFFSET_BITS', 'VGC_QSGD_RECORD_WORDS', 'VGC_FMT_GAP',
             'VGC_GAP_ESCAPE', 'VGC_GAP_SIGN_ONLY', 'VGC_GAP_PARAM_WORDS',
             'VGC_GAP_RESTART_CODES', 'VGC_GAP_RESTART_WORDS',
             'VGC_FMT_SPARSE', 'VGC_SPARSE_FLOAT32')


def _check_constants(lib):
    """The wire-format constants compiled into the library equal codec's."""
    from chainer_vgc import codec
    got = numpy.zeros(len(CONSTANTS), dtype=numpy.int64)
    lib.vgc_native_constants(got.ctypes.data)
    want = [codec.C_CONSTANTS[name] for name in CONSTANTS]
    if got.tolist() != want:
        raise NativeBackendError(
            'chainer_vgc: wire-format constants of the native backend {} '
            'differ from chainer_vgc.codec {}; {}'.format(
                got.tolist(), want, _FIX))


def set_num_threads(n):
    """Threads of the native passes (``None`` or 0: OpenMP's default)."""
    load().vgc_native_set_threads(int(n or 0))


def num_threads():
    return int(load().vgc_native_threads())


def default_threads(ranks_on_node=1):
    """Cores for one of ``ranks_on_node`` ranks sharing this node, or None
    where OMP_NUM_THREADS is set (OpenMP then reads it)."""
    if os.environ.get('OMP_NUM_THREADS'):
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, int(ranks_on_node)))


class Workspace(object):
    """Per-compressor staging buffers of the C++ side (grown, never
    shrunk, reused every step)."""

    def __init__(self):
        self._lib = load()
        self.handle = self._lib.vgc_native_workspace_new()

    def __del__(self):
        handle, self.handle = getattr(self, 'handle', None), None
        if handle:
            self._lib.vgc_native_workspace_free(handle)


def _compress(rule, ws, tensor_id, g, *args):
    """``vgc_native_<rule>(workspace, tensor_id, dtype code of g, g, *args,
    info)``, arrays passed by address; returns (words, elements, flags)."""
    info = numpy.zeros(3, dtype=numpy.int64)
    getattr(load(), 'vgc_native_' + rule)(
        ws.handle, tensor_id, DTYPE_CODES[g.dtype], g.ctypes.data,
        *[a.ctypes.data if isinstance(a, numpy.ndarray) else a
          for a in args], info.ctypes.data)
    words, elements, flags = (int(x) for x in info)
    return words, elements, flags  # UNENCODABLE: the compressor raises


def _codings():
    """``codec.CODINGS`` (codec imports this module's neighbours, so it
    is read when needed)."""
    from chainer_vgc import codec
    return codec.CODINGS


def _coding(coding):
    """The int code of ``coding`` (an int code or a name of
    ``codec.CODINGS``)."""
    if isinstance(coding, str):
        names = _codings()
        if coding not in names:
            raise ValueError('index coding must be one of {}, got {!r}'
                             .format(names, coding))
        return names.index(coding)
    coding = int(coding)
    if coding not in (CODING_AUTO, CODING_FIXED, CODING_GAP):
        raise ValueError('index coding code must be 0, 1 or 2, got {}'
                         .format(coding))
    return coding


def compress_vgc(ws, tensor_id, g, s, r, v, r_out, v_out, alpha, zeta,
                 quantize, keep_unrepresentable, out, coding=CODING_AUTO):
    """Fig. "Basic" on one tensor; returns (words, elements, flags).
    ``coding`` (quantized groups): 0 'auto' (FMT_GAP where it is shorter
    or the tensor exceeds 2**28 elements, else FMT_POW2), 1 'fixed'
    (FMT_POW2), 2 'gap' (FMT_GAP, 4-bit values)."""
    return _compress('vgc', ws, tensor_id, g, s, r, v, r_out, v_out, g.size,
                     alpha, zeta, int(quantize), int(keep_unrepresentable),
                     _coding(coding), out)


def compress_hybrid(ws, tensor_id, g, s, r, v, r_out, v_out, alpha, zeta,
                    tau, out, coding=CODING_AUTO):
    """Fig. "Hybrid" on one tensor; returns (words, elements, flags).
    ``coding`` as for :func:`compress_vgc` (FMT_GAP with SIGN_ONLY)."""
    return _compress('hybrid', ws, tensor_id, g, s, r, v, r_out, v_out,
                     g.size, alpha, zeta, tau, _coding(coding), out)


def compress_strom(ws, tensor_id, g, r, r_out, tau, out, coding=CODING_AUTO):
    """Strom's threshold on one tensor; returns (words, elements, flags).
    ``coding`` as for :func:`compress_hybrid`."""
    return _compress('strom', ws, tensor_id, g, r, r_out, g.size, tau,
                     _coding(coding), out)


def compress_qsgd(ws, tensor_id, g, u, bucket, levels, out):
    """QSGD levels of one tensor from the uniform draws ``u`` (state dtype);
    returns (words, elements, flags)."""
    return _compress('qsgd', ws, tensor_id, g, u, g.size, bucket, levels,
                     out)


def compress_none(ws, tensor_id, g, out):
    """The dense gradient as a FMT_RAW group; (words, elements, flags)."""
    return _compress('none', ws, tensor_id, g, g.size, out)


def check_inputs(ws, grads, sqsums):
    """The input checks of the fused passes, read-only, over every tensor
    of a step (the last first, so that the first ones, which the passes
    compress first, are left in the cache): a list of flags
    (:data:`BAD_GRAD`, :data:`BAD_SQSUM`) per tensor.  ``grads[k]``: a flat
    C-contiguous array or None (not checked, flags 0); ``sqsums[k]``: a
    flat C-contiguous array in its state dtype, or None (not checked)."""
    n = len(grads)
    flags = numpy.zeros(max(n, 1), dtype=numpy.int32)
    codes = numpy.array([0 if g is None else DTYPE_CODES[g.dtype]
                         for g in grads] or [0], dtype=numpy.int32)
    sizes = numpy.array([0 if g is None else g.size for g in grads] or [0],
                        dtype=numpy.int64)
    g_ptrs = (ctypes.c_void_p * max(n, 1))(
        *[None if g is None else g.ctypes.data for g in grads])
    s_ptrs = (ctypes.c_void_p * max(n, 1))(
        *[None if s is None else s.ctypes.data for s in sqsums])
    load().vgc_native_check_inputs(
        ws.handle, n, codes.ctypes.data, ctypes.cast(g_ptrs, ctypes.c_void_p),
        ctypes.cast(s_ptrs, ctypes.c_void_p), sizes.ctypes.data,
        flags.ctypes.data)
    return [int(f) for f in flags[:n]]


#: words of a row of the group table (``VGC_ROW_WORDS``,
#: kernels/vgc_decode.h): tensor id, format, count, a, b, the body's first
#: word in its message, span
ROW_WORDS = 7


def decode_mean(blocks, sizes, state_dtypes, outs, apply_scale, scale,
                accumulate=False, table=False, gap_codes=True):
    """Validate the messages ``blocks``, then write into each ``outs[t]``
    (flat, C-contiguous, state dtype; None: skip) the sum of their elements
    in rank order, times ``scale`` where ``apply_scale[t]``.
    ``accumulate=True``: add the elements to ``outs[t]``'s own values
    instead (``out[i] + v_0 + v_1 ...``, the indices not sent untouched,
    as :func:`chainer_vgc.codec.decode_into` adds); nothing is scaled.

    Returns ``(touched, elements)``: elements written per tensor and
    elements carried per message; or ``None`` if a message is invalid
    (then nothing was written; the caller names the fault).  With
    ``table``, ``(touched, elements, rows)``: ``rows`` (int64 [groups,
    :data:`ROW_WORDS`] plus a first column, the message) lists every
    message's groups in order, as the validating walk read them.
    ``gap_codes=False`` (no outs): all but the FMT_GAP groups' codes are
    checked (the device decode checks those, ``vgc_model_gap_expand``)."""
    lib = load()
    p, n = len(blocks), len(sizes)
    blocks = [numpy.ascontiguousarray(b, dtype=numpy.uint32) for b in blocks]
    ptrs = (ctypes.c_void_p * max(p, 1))(*[b.ctypes.data for b in blocks])
    lens = numpy.array([b.size for b in blocks], dtype=numpy.int64)
    sizes_a = numpy.asarray(sizes, dtype=numpy.int64)
    codes = numpy.array([DTYPE_CODES[numpy.dtype(d)] for d in state_dtypes],
                        dtype=numpy.int32)
    out_ptrs = (ctypes.c_void_p * max(n, 1))(
        *[None if o is None else o.ctypes.data for o in outs])
    apply_a = numpy.asarray(apply_scale, dtype=numpy.int32)
    touched, bad = (numpy.zeros(k, numpy.int64) for k in (max(n, 1), 1))
    elements, n_rows = (numpy.zeros(max(p, 1), numpy.int64) for _ in '12')
    rows = numpy.empty((p * n if table else 0, ROW_WORDS), numpy.int64)
    if accumulate and any(apply_scale):
        raise ValueError('decode_mean: accumulate=True adds without scaling '
                         '(apply_scale must be all False)')
    for o, size, dt in zip(outs, sizes, state_dtypes):
        if o is not None and (o.size != size or o.dtype != dt or not (
                o.dtype in (numpy.float32, numpy.float64) and gap_codes
                and o.flags.c_contiguous)):
            raise ValueError(
                'decode_mean: output arrays must be C-contiguous, of the '
                'tensor sizes, in the state dtypes (float32 or float64); '
                'none with gap_codes=False (it validates only)')
    rc = lib.vgc_native_decode(
        p, ctypes.cast(ptrs, ctypes.c_void_p), lens.ctypes.data, n,
        sizes_a.ctypes.data, codes.ctypes.data,
        ctypes.cast(out_ptrs, ctypes.c_void_p), apply_a.ctypes.data,
        float(scale), int(bool(accumulate)) | (0 if gap_codes else 2),
        touched.ctypes.data,
        elements.ctypes.data, bad.ctypes.data,
        rows.ctypes.data if table else None, n_rows.ctypes.data)
    if rc != 0:
        return None
    if not table:
        return touched[:n], elements[:p]
    # each message's rows, from row b * n on, with b before them
    mine = (numpy.arange(p * n) % max(n, 1)) < numpy.repeat(n_rows[:p], n)
    msg = numpy.repeat(numpy.arange(p, dtype=numpy.int64), n)[mine]
    rows = rows[mine]
    # every element the walk counted is in the table (a stale build: none)
    if not numpy.array_equal(numpy.bincount(msg, rows[:, 2], p),
                             elements[:p]):
        raise NativeBackendError(
            'chainer_vgc: the native backend {} returned a group table that '
            'does not add up to the messages; {}'.format(library_path(isa()),
                                                         _FIX))
    return touched[:n], elements[:p], numpy.column_stack([msg, rows])
