"""Runs the CuPy ElementwiseKernels of chainer_vgc without a GPU.

Each entry of :data:`chainer_vgc.backends.cuda.kernels.SPECS` is turned into a C++ loop
that binds the parameters element by element, as CuPy's ElementwiseKernel
does (inputs by value, outputs by reference), and pastes the *same*
operation string after ``#include``-ing the same ``kernels/vgc_numerics.cuh``.
The host build uses ``-ffp-contract=off``; the CuPy kernels use
``--fmad=false``; so results must match the NumPy path bit for bit.

``raw T name`` parameters (CuPy's ``raw``: the whole array, not bound to
the element) are passed as pointers, indexed in the operation as
``name[j]``; the loop variable is ``i``, CuPy's element number.  The loop
runs over the non-raw arrays' elements (all of equal size).

The same generated code, as ``__global__`` functions, is what
:func:`compile_ptx` feeds to ``nvcc``.

The checked mode (``HostKernels(checked=True)``) passes each raw array as
its pointer and its element count instead, bound in the generated function
to a ``vgc_bounded<T>`` (:data:`CHECKED_PRELUDE`): its ``name[j]`` is the
element where ``0 <= j < count``, else a counter of the library is
incremented and a zeroed dummy element stands in, so that the run goes on
without touching memory outside the array.  ``HostKernels.__call__``
clears the counter before the run and raises ``AssertionError`` when it is
not zero after it.  Only the raw arrays are checked: the others are read
at ``i`` by the generated loop, which is within their size by construction
(and an address a kernel reads through, ``vgc_model_gather``'s table, is
not an array of the harness's).

Compiled libraries are kept by the hash of what they are built from (the
generated source, the kernels' header, the mode, the compiler and its
flags): in the harness's work folder, and where ``VGC_HOST_KERNEL_CACHE``
names a folder (tests/conftest.py sets ``build/host_kernels`` of the
checkout) also there, shared by every process of a test run (the pytest
workers, both stacks, the GPU runbook's dry run), so that each kernel is
compiled once, not once a process.
"""

import collections
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile

import numpy

from chainer_vgc.backends.cuda import kernels

_HOST_TYPES = {
    numpy.dtype(numpy.float16): ('_Float16', None),
    numpy.dtype(numpy.float32): ('float', ctypes.c_float),
    numpy.dtype(numpy.float64): ('double', ctypes.c_double),
    numpy.dtype(numpy.bool_): ('bool', ctypes.c_bool),
    numpy.dtype(numpy.int8): ('signed char', ctypes.c_int8),
    numpy.dtype(numpy.uint8): ('unsigned char', ctypes.c_uint8),
    numpy.dtype(numpy.int32): ('int', ctypes.c_int32),
    numpy.dtype(numpy.int64): ('long long', ctypes.c_int64),
    numpy.dtype(numpy.uint32): ('unsigned int', ctypes.c_uint32),
    numpy.dtype(numpy.uint64): ('unsigned long long', ctypes.c_uint64),
}
_DEVICE_TYPES = dict((k, v[0]) for k, v in _HOST_TYPES.items())
_DEVICE_TYPES[numpy.dtype(numpy.float16)] = '__half'
_CONCRETE = {'bool': numpy.bool_, 'int8': numpy.int8, 'uint8': numpy.uint8,
             'int32': numpy.int32,
             'int64': numpy.int64, 'uint32': numpy.uint32,
             'uint64': numpy.uint64,
             'float16': numpy.float16, 'float32': numpy.float32,
             'float64': numpy.float64}

HOST_FLAGS = ['-std=c++14', '-O2', '-ffp-contract=off', '-fno-fast-math',
              '-fPIC', '-shared']


#: The checked mode's code in front of the kernels (after the include): a
#: raw array as pointer and element count, whose out-of-range elements
#: count in ``vgc_harness_oob`` (one counter per library, read and cleared
#: through the two ``extern "C"`` functions) and read and write a dummy
#: element, zeroed at each such access.  ``T`` is ``const`` for inputs.
CHECKED_PRELUDE = r'''#include <type_traits>
static long long vgc_harness_oob = 0;
extern "C" long long vgc_harness_oob_count(void) { return vgc_harness_oob; }
extern "C" void vgc_harness_oob_reset(void) { vgc_harness_oob = 0; }
template <typename T> struct vgc_bounded {
    T *p;
    long long n;
    T &operator[](long long j) const {
        if (j >= 0 && j < n) return p[j];
        ++vgc_harness_oob;
        static typename std::remove_const<T>::type dummy;
        dummy = typename std::remove_const<T>::type();
        return dummy;
    }
};'''


#: one kernel parameter: ``raw`` ones are whole arrays, indexed in the
#: operation by an element number (CuPy's ``raw T name``, a CArray there)
Param = collections.namedtuple('Param', ['type', 'name', 'raw'])


def parse_params(text):
    """'G g, raw S alpha' -> [Param(type, name, raw), ...] (CuPy's
    parameter syntax)."""
    out = []
    for item in text.split(','):
        words = item.split()
        raw = bool(words) and words[0] == 'raw'
        if raw:
            words = words[1:]
        if len(words) != 2 or words[0] == 'raw':
            raise ValueError('harness supports "TYPE name" and "raw TYPE '
                             'name" params only: {!r}'.format(item))
        out.append(Param(words[0], words[1], raw))
    return out


def _deduce(params, args):
    """Bind type placeholders as CuPy does: from array arguments only
    (raw ones included; CuPy treats scalars, NumPy scalars included, as
    untyped)."""
    binding = {}
    for (typ, name, raw), a in zip(params, args):
        if typ not in _CONCRETE and isinstance(a, numpy.ndarray):
            binding.setdefault(typ, a.dtype)
    for typ, name, raw in params:
        if typ not in _CONCRETE and typ not in binding:
            raise TypeError('type placeholder {} (parameter {}) cannot be '
                            'deduced: CuPy needs an array argument of that '
                            'type'.format(typ, name))
    return binding


def _resolve(spec, args):
    """Bind placeholders to dtypes; returns (params, dtypes, is_array,
    binding).  A raw parameter must be given an array."""
    params = parse_params(spec.in_params) + parse_params(spec.out_params)
    if len(args) != len(params):
        raise TypeError('expected {} arguments, got {}'.format(
            len(params), len(args)))
    binding = _deduce(params, args)
    dtypes, is_array = [], []
    for (typ, name, raw), a in zip(params, args):
        dtypes.append(numpy.dtype(_CONCRETE[typ]) if typ in _CONCRETE
                      else binding[typ])
        is_array.append(raw or isinstance(a, numpy.ndarray) and a.ndim > 0)
        if raw and not isinstance(a, numpy.ndarray):
            raise TypeError('raw parameter {} needs an array'.format(name))
    return params, dtypes, is_array, binding


def _body(name, spec, params, dtypes, is_array, binding, device,
          checked=False):
    """One kernel instantiation: the function's signature, then per element
    ``i`` its non-raw parameters bound and the operation.  ``checked``
    (host only): each raw array comes as ``name_p, name_n`` (pointer,
    element count) and is bound before the loop to a ``vgc_bounded``."""
    types = _DEVICE_TYPES if device else {k: v[0] for k, v in
                                          _HOST_TYPES.items()}
    n_in = len(parse_params(spec.in_params))
    lines = ['namespace {} {{'.format(name)]
    for ph, dt in sorted(binding.items()):
        lines.append('typedef {} {};'.format(types[dt], ph))
    sig, bind, bounded = ['long long n'], [], []
    for k, ((typ, pname, raw), dt, arr) in enumerate(zip(params, dtypes,
                                                         is_array)):
        ctype = types[dt]
        if raw and checked:  # pointer and count, bound to vgc_bounded
            const = 'const ' if k < n_in else ''
            sig.append('{}{} *{}_p, long long {}_n'.format(const, ctype,
                                                           pname, pname))
            bounded.append('  vgc_bounded<{}{}> {} = {{{}_p, {}_n}};'.format(
                const, ctype, pname, pname, pname))
        elif raw:  # the whole array, indexed in the operation as name[j]
            sig.append('{}{} *{}'.format('const ' if k < n_in else '',
                                         ctype, pname))
        elif k >= n_in:
            sig.append('{} *{}_p'.format(ctype, pname))
            bind.append('{} &{} = {}_p[i];'.format(ctype, pname, pname))
        elif arr:
            sig.append('const {} *{}_p'.format(ctype, pname))
            bind.append('const {} {} = {}_p[i];'.format(ctype, pname, pname))
        else:
            sig.append('{} {}'.format(ctype, pname))
    if device:
        lines.append('extern "C" __global__ void {}_kernel({}) {{'.format(
            name, ', '.join(sig)))
        lines.append('  for (long long i = blockIdx.x * (long long)blockDim.x'
                     ' + threadIdx.x; i < n; i += (long long)blockDim.x * '
                     'gridDim.x) {')
    else:
        lines.append('extern "C" void {}_run({}) {{'.format(
            name, ', '.join(sig)))
        lines.extend(bounded)
        lines.append('  for (long long i = 0; i < n; ++i) {')
    lines.extend('    ' + b for b in bind)
    lines.append('    {};'.format(spec.operation))
    lines.append('  }\n}\n}')
    return '\n'.join(lines)


def generated_source(instances, device, checked=False):
    """C++/CUDA translation unit for [(kernel name, args), ...];
    ``checked`` (host only): with :data:`CHECKED_PRELUDE` and bounded raw
    arrays (:func:`_body`)."""
    if checked and device:
        raise ValueError('the checked mode is for the host build only')
    header = ['#include <cuda_fp16.h>'] if device else []
    header.append('#include "{}"'.format(
        os.path.join(kernels.source_dir(), 'vgc_numerics.cuh')))
    if checked:
        header.append(CHECKED_PRELUDE)
    parts = header[:]
    for k, (kname, args) in enumerate(instances):
        spec = kernels.SPECS[kname]
        params, dtypes, is_array, binding = _resolve(spec, args)
        parts.append(_body('{}_{}'.format(kname, k), spec, params, dtypes,
                           is_array, binding, device, checked))
    return '\n\n'.join(parts) + '\n'


class HostKernels(object):
    """Compiles and runs kernel instantiations with the host compiler.

    ``checked``: every raw array is bounds-checked (the module's docstring):
    a call whose kernel indexes one outside its elements raises
    ``AssertionError`` after the run, which went on with a dummy element
    in place of each such access; :meth:`oob` is the number of those
    accesses in the last call.
    """

    def __init__(self, cxx=None, workdir=None, checked=False, cache=None):
        self.cxx = cxx or os.environ.get('CXX') or shutil.which('g++')
        if self.cxx is None:
            raise RuntimeError('no host C++ compiler (g++) found')
        self.workdir = workdir or tempfile.mkdtemp(prefix='vgc_host_')
        #: the folder of libraries shared between processes (None: none)
        self.cache = cache or os.environ.get('VGC_HOST_KERNEL_CACHE') or None
        self.checked = bool(checked)
        self._libs = {}
        self._last = None  # the library of the last call (checked mode)
        self._compiler = None

    def _key(self, src):
        """The cache key of a library: its source, the kernels' header,
        the mode (a suffix in the checked mode only), the compiler (its
        version) and its flags."""
        if self._compiler is None:
            self._compiler = subprocess.run(
                [self.cxx, '--version'], capture_output=True,
                text=True).stdout + ' '.join(HOST_FLAGS)
        text = src + kernels.source() + ('\0checked' if self.checked
                                         else '') + '\0' + self._compiler
        return hashlib.sha1(text.encode()).hexdigest()

    def oob(self):
        """Out-of-bounds accesses to raw arrays counted in the last kernel
        call (its library's counter; cleared by the next call): 0 when
        no call has run yet or in the unchecked mode."""
        if self._last is None:
            return 0
        return self._last.vgc_harness_oob_count()

    def reset_oob(self):
        """Clear the counter of the last call's library (each call clears
        its own before it runs)."""
        if self._last is not None:
            self._last.vgc_harness_oob_reset()

    def _build(self, key, src):
        """Compile ``src`` with the host flags (or take the library the
        shared cache holds for ``key``); the loaded library."""
        so = os.path.join(self.workdir, key + '.so')
        shared = None if self.cache is None else os.path.join(
            self.cache, key + '.so')
        if shared is not None and os.path.exists(shared):
            # loaded where it lies: a file is only ever renamed into place,
            # whole and with the same bytes, never written there
            return ctypes.CDLL(shared)
        cpp = os.path.join(self.workdir, key + '.cpp')
        with open(cpp, 'w') as f:
            f.write(src)
        subprocess.run([self.cxx] + HOST_FLAGS + [cpp, '-o', so],
                       check=True, capture_output=True, text=True)
        if shared is not None:  # (written whole, then renamed: atomic)
            os.makedirs(self.cache, exist_ok=True)
            partial = '{}.{}.part'.format(shared, os.getpid())
            shutil.copyfile(so, partial)
            os.replace(partial, shared)
        return ctypes.CDLL(so)

    def _library(self, kname, args):
        """(library, function, dtypes, is_array) of kernel ``kname`` for
        arguments like ``args``, compiled once per generated source (in the
        checked mode, a raw array takes a pointer and a count)."""
        spec = kernels.SPECS[kname]
        params, dtypes, is_array, binding = _resolve(spec, args)
        src = generated_source([(kname, args)], device=False,
                               checked=self.checked)
        key = self._key(src)
        if key not in self._libs:
            lib = self._build(key, src)
            fn = getattr(lib, '{}_0_run'.format(kname))
            argtypes = [ctypes.c_longlong]
            for p, dt, arr in zip(params, dtypes, is_array):
                argtypes.append(ctypes.c_void_p if arr
                                else _HOST_TYPES[dt][1])
                if p.raw and self.checked:
                    argtypes.append(ctypes.c_longlong)
            fn.argtypes = argtypes
            fn.restype = None
            if self.checked:
                lib.vgc_harness_oob_count.argtypes = []
                lib.vgc_harness_oob_count.restype = ctypes.c_longlong
                lib.vgc_harness_oob_reset.argtypes = []
                lib.vgc_harness_oob_reset.restype = None
            self._libs[key] = (lib, fn, dtypes, is_array)
        return self._libs[key]

    @staticmethod
    def _allocate(spec, inputs):
        in_params = parse_params(spec.in_params)
        out_params = parse_params(spec.out_params)
        if any(p.raw for p in out_params):
            raise TypeError('a raw output parameter must be given (its '
                            'size is not the kernel\'s)')
        size = None
        for p, a in zip(in_params, inputs):
            if isinstance(a, numpy.ndarray) and a.ndim and not p.raw:
                size = a.size
        if size is None:
            raise ValueError('the outputs\' size cannot be deduced: no '
                             'non-raw input array (pass the outputs)')
        binding = _deduce(in_params + [
            p for p in out_params if p.type in _CONCRETE],
            list(inputs) + [None] * 8)
        return tuple(numpy.empty(size, dtype=_CONCRETE.get(p.type) or
                                 binding[p.type])
                     for p in out_params)

    def reduce_axis0(self, kname, x):
        """Run reduction kernel ``kname`` over axis 0 of ``x`` (no raw
        array: the same code in both modes, the harness's own indexing)."""
        x = numpy.ascontiguousarray(x)
        src = reduction_source(kname, x.dtype)
        key = self._key(src)
        if key not in self._libs:
            lib = self._build(key, src)
            fn = getattr(lib, kname + '_run')
            fn.argtypes = [ctypes.c_longlong, ctypes.c_longlong,
                           ctypes.c_void_p, ctypes.c_void_p]
            fn.restype = None
            self._libs[key] = (lib, fn, None, None)
        fn = self._libs[key][1]
        rows = x.shape[0] if x.ndim else 1
        out = numpy.empty(x.shape[1:], dtype=x.dtype)
        fn(rows, out.size, x.ctypes.data_as(ctypes.c_void_p),
           out.ctypes.data_as(ctypes.c_void_p))
        return out

    def __call__(self, kname, *args):
        """Run kernel ``kname``: inputs then (preallocated) outputs.

        Array arguments must be 1-D, contiguous and, except the ``raw``
        ones (any size), of equal size: the kernel runs once per element
        of those, with ``i`` the element number; outputs are written in
        place and returned.  In the checked mode each raw array is passed
        with its size, the library's counter is cleared before the run, and
        ``AssertionError`` names the kernel, the count and the raw arrays'
        sizes when it is not zero after it (the outputs as the run left
        them).
        """
        spec = kernels.SPECS[kname]
        params = parse_params(spec.in_params) + parse_params(
            spec.out_params)
        n_in = len(parse_params(spec.in_params))
        if len(args) == n_in:  # CuPy allocates outputs that are not given
            args = args + self._allocate(spec, args)
        lib, fn, dtypes, is_array = self._library(kname, args)
        n = None
        cargs = []
        for k, (a, dt, arr, p) in enumerate(zip(args, dtypes, is_array,
                                                params)):
            if arr:
                if a.dtype != dt or not a.flags.c_contiguous or a.ndim != 1:
                    raise TypeError('argument {} must be a contiguous 1-D {} '
                                    'array'.format(k, dt))
                if p.raw:
                    cargs.append(a.ctypes.data_as(ctypes.c_void_p))
                    if self.checked:  # its element count, the bound
                        cargs.append(a.size)
                    continue
                if n is not None and a.size != n:
                    raise ValueError('array arguments differ in size')
                n = a.size
                cargs.append(a.ctypes.data_as(ctypes.c_void_p))
            else:
                if k >= n_in:
                    raise TypeError('outputs must be arrays')
                cargs.append(dt.type(a).item() if dt.kind != 'b'
                             else bool(a))
        if not self.checked:
            fn(n or 0, *cargs)
            return args[n_in:]
        self._last = lib
        lib.vgc_harness_oob_reset()
        fn(n or 0, *cargs)
        count = lib.vgc_harness_oob_count()
        if count:
            raise AssertionError(
                'kernel {} read or wrote out of bounds {} times (raw arrays: '
                '{})'.format(kname, count, ', '.join(
                    '{}[{}]'.format(p.name, a.size)
                    for p, a in zip(params, args) if p.raw)))
        return args[n_in:]


def reduction_source(kname, dtype):
    """C++ for ``kernels.REDUCTION_SPECS[kname]`` over axis 0 of a
    C-contiguous (rows, cols) array: for each column, a = identity, then
    a = reduce(a, map(row)) row after row, then the post-map.  CuPy's order
    of the rows differs (a tree); the map and reduce are the same text."""
    spec = kernels.REDUCTION_SPECS[kname]
    (tin, xin, _), = parse_params(spec.in_params)
    (tout, yout, _), = parse_params(spec.out_params)
    ctype = _HOST_TYPES[numpy.dtype(dtype)][0]
    return '\n'.join([
        '#include "{}"'.format(os.path.join(kernels.source_dir(),
                                            'vgc_numerics.cuh')),
        'typedef {} {};'.format(ctype, tin),
        'extern "C" void {}_run(long long rows, long long cols, '
        'const {} *in_p, {} *out_p) {{'.format(kname, tin, tout),
        '  for (long long j = 0; j < cols; ++j) {',
        '    {} a = ({})({});'.format(tin, tin, spec.identity),
        '    for (long long i = 0; i < rows; ++i) {',
        '      const {} {} = in_p[i * cols + j];'.format(tin, xin),
        '      {} b = {};'.format(tin, spec.map_expr),
        '      a = {};'.format(spec.reduce_expr),
        '    }',
        '    {} &{} = out_p[j];'.format(tout, yout),
        '    {};'.format(spec.post_map_expr),
        '  }',
        '}', ''])


def find_nvcc():
    return shutil.which('nvcc')


def compile_ptx(instances, workdir, arch='compute_80', extra=('-ftz=true',)):
    """Compile instantiations with nvcc to PTX; returns the PTX text.
    ``extra`` follows the kernels' options, as CuPy appends ``-ftz=true``."""
    cu = os.path.join(workdir, 'vgc_kernels_check.cu')
    ptx = os.path.join(workdir, 'vgc_kernels_check.ptx')
    with open(cu, 'w') as f:
        f.write(generated_source(instances, device=True))
    cmd = [find_nvcc(), '-ptx', '-arch=' + arch, '-std=c++14',
           '-o', ptx, cu] + list(kernels.NVRTC_OPTIONS) + list(extra)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError('nvcc failed:\n' + proc.stderr)
    with open(ptx) as f:
        return f.read()


def ptx_entries(ptx):
    return re.findall(r'\.entry\s+(\w+)', ptx)


# ---- the kernels as CuPy 13 and 14 generate and compile them ----------------

def cupy_available():
    """CuPy importable (it imports without a GPU) and NVRTC loadable for it
    (``cuda_support.preload_nvrtc``: the CUDA 12 wheel for CuPy 13, the
    CUDA 13 wheel for CuPy 14)."""
    try:
        from chainer_vgc.backends.cuda import support as cuda_support
        if cuda_support.preload_nvrtc() is None:
            return False
        import cupy  # noqa: F401
        from cupy._core import _kernel  # noqa: F401
        from cupy.cuda import compiler  # noqa: F401
        from cupy_backends.cuda.libs import nvrtc  # noqa: F401
    except Exception:
        return False
    return True


class _NVRTCCallRecorded(Exception):
    """Stops CuPy's compile pipeline at its NVRTC call (cupy_nvrtc_input)."""


def cupy_nvrtc_input(code, options, arch='compute_80'):
    """``(source, options)`` that CuPy 13 and 14 hand NVRTC when a kernel
    whose generated code is ``code`` and whose own options are ``options``
    is first called: CuPy's own pipeline, ``cupy._core.core.
    compile_with_cache`` (what ElementwiseKernel and ReductionKernel call
    with their code and options), run up to ``nvrtcCompileProgram`` on the
    kernel's source, which is recorded instead of made.

    No GPU is needed: CuPy's choice of the architecture, which asks the
    current device, is replaced.  CuPy passes ``-arch=sm_<cc>`` (SASS)
    where NVRTC knows the device's compute capability, else
    ``-arch=compute_<cc>`` (PTX); here it is ``-arch=<arch>`` with PTX
    output, so that the PTX can be read.  The rest is CuPy's, in its
    order; for our kernels (options ``--fmad=false``):

    * ``core.assemble_cupy_compiler_options``: ``-I`` the CCCL headers
      bundled in CuPy (``.../cupy/_core/include/cupy/_cccl/{cub,thrust,
      libcudacxx}``), the kernel's options, the default standard (CuPy 13:
      ``--std=c++11``, CuPy 14: ``--std=c++17``), ``-I`` CuPy's headers
      (``.../cupy/_core/include``), then CUDA headers.  CuPy 13 adds its
      bundled ``.../cupy/_cuda/cuda-12`` only with NVRTC 12.0 and 12.1
      (not with 12.2 and later, such as the pinned 12.9), then
      ``<CUDA root>/include``, the root being ``CUDA_PATH``, else the
      parent of the directory of ``nvcc`` on ``PATH``, else
      ``/usr/local/cuda``.  CuPy 14 bundles no CUDA headers (its wheel has
      no ``cupy/_cuda``): it adds cudart's include directory as
      ``cuda.pathfinder.find_nvidia_header_directory('cudart')`` finds it
      (a CUDA toolkit's, or a cudart wheel's), and refuses to compile
      ("Failed to find CUDA headers") where there is none;
    * ``-ftz=true``, which ``cupy.cuda.compiler._compile_with_cache_cuda``
      appends in CuPy 13 and 14 (why kernels/vgc_numerics.cuh has its
      subnormal rule);
    * CuPy 13 with NVRTC >= 12.2 only: ``-I`` the include directory of the
      ``nvidia-cuda-runtime-cu12`` wheel where one of NVRTC's minor
      version is installed;
    * ``-arch=...`` and ``--device-as-default-execution-space``, which the
      NVRTC call appends in CuPy 13 (with NVRTC >= 12) and 14 (and, in
      CuPy 14, ``--pch`` where ``CUPY_NVRTC_USE_PCH`` is set, with NVRTC
      >= 12.8).

    Every CuPy kernel includes ``cupy/carray.cuh``, which includes
    ``cuda_fp16.h``: one of those directories must hold it, or no kernel
    compiles.  The source is CuPy's header includes
    (``core._cupy_header_list``) followed by ``code``.
    ``CUPY_CACHE_IN_MEMORY`` is set meanwhile, so that no disk cache is
    read or written.
    """
    from unittest import mock

    from chainer_vgc.backends.cuda import support as cuda_support
    from cupy._core import core
    from cupy.cuda import compiler
    cuda_support.preload_nvrtc()  # CuPy 13 needs it for its empty-file run
    recorded = []

    class Recorder(compiler._NVRTCProgram):
        def compile(self, options=(), log_stream=None):
            if not self.src:  # CuPy's empty-file run (its cache key)
                return super().compile(options, log_stream)
            recorded.append((self.src, tuple(options)))
            raise _NVRTCCallRecorded()

    def arch_option(arch_number=None):  # CuPy's asks the current device
        return '-arch=' + arch, 'ptx'

    with mock.patch.object(compiler, '_NVRTCProgram', Recorder), \
            mock.patch.object(compiler, '_get_arch_for_options_for_nvrtc',
                              arch_option), \
            mock.patch.dict(os.environ, {'CUPY_CACHE_IN_MEMORY': '1'}):
        try:
            core.compile_with_cache(code, tuple(options),
                                    arch=arch.rsplit('_', 1)[-1])
        except _NVRTCCallRecorded:
            pass
    if len(recorded) != 1:
        raise RuntimeError('CuPy\'s compile_with_cache made {} NVRTC calls '
                           'on the kernel source, not 1'.format(len(recorded)))
    return recorded[0]


def cupy_generated_source(kname, args):
    """The translation unit CuPy 13 and 14 compile for
    ``kernels.get_kernel(kname)`` called with arrays/scalars like ``args``:
    CuPy's own code generator (``_kernel._get_elementwise_kernel_code``,
    the same signature in both) on the kernel object, then CuPy's header
    includes in front (:func:`cupy_nvrtc_input`)."""
    import cupy
    from cupy._core import _carray
    from cupy._core import _kernel
    from cupy._core import _scalar
    spec = kernels.SPECS[kname]
    params, dtypes, is_array, binding = _resolve(spec, args)
    infos = []
    for dt, arr in zip(dtypes, is_array):
        if arr:  # a contiguous 1-D array: CuPy reduces it to one axis
            infos.append(_kernel._ArgInfo(1, cupy.ndarray, dt, 1, True, True))
        else:  # a scalar, cast to the parameter's type
            infos.append(_kernel._ArgInfo(3, _scalar.CScalar, dt, 0, True,
                                          True))
    infos.append(_kernel._ArgInfo(2, _carray.Indexer, None, 1, True, True))
    type_map = _kernel._TypeMap(tuple(sorted(binding.items())))
    kern = kernels.get_kernel(kname)
    options = tuple(kern.kwargs.get('options', ()))
    code = _kernel._get_elementwise_kernel_code(
        tuple(infos), type_map, kern.params, kern.operation, kern.name,
        kern.preamble, '', '', options)
    return cupy_nvrtc_input(code, options)[0]


def cupy_reduction_source(kname, dtype, block_size=512):
    """The translation unit CuPy 13 and 14 compile for the ReductionKernel
    ``kname`` reducing axis 0 of a C-contiguous 2-D array of ``dtype`` to
    1-D: CuPy's own generator (``_reduction.
    _ReductionKernel_get_cached_function_code``, the same signature in
    both) with the kernel object's parameters, then CuPy's header includes
    in front (:func:`cupy_nvrtc_input`)."""
    import cupy
    from cupy._core import _carray
    from cupy._core import _kernel
    from cupy._core import _reduction
    from cupy._core import _scalar
    kern = kernels.get_kernel(kname)
    dt = numpy.dtype(dtype)
    infos = (_kernel._ArgInfo(1, cupy.ndarray, dt, 2, True, True),
             _kernel._ArgInfo(1, cupy.ndarray, dt, 1, True, True),
             _kernel._ArgInfo(2, _carray.Indexer, None, 2, True, True),
             _kernel._ArgInfo(2, _carray.Indexer, None, 1, True, True),
             _kernel._ArgInfo(3, _scalar.CScalar, numpy.dtype(numpy.int32),
                              0, True, True))
    (typ, _, _), = parse_params(kernels.REDUCTION_SPECS[kname].in_params)
    code = _reduction._ReductionKernel_get_cached_function_code(
        1, 1, kern._params, infos,
        _kernel._TypeMap(((typ, dt), ('IndexT', numpy.dtype(numpy.int32)))),
        kern.name, block_size, typ, kern.identity, kern.map_expr,
        kern.reduce_expr, kern.post_map_expr, kern.preamble, kern.options)
    return cupy_nvrtc_input(code, kern.options)[0]


def cupy_compile_options(arch='compute_80'):
    """The option list CuPy 13 and 14 hand NVRTC for our kernels (their
    options are ``kernels.NVRTC_OPTIONS``), with ``-arch=<arch>``: see
    :func:`cupy_nvrtc_input`."""
    return cupy_nvrtc_input('', kernels.NVRTC_OPTIONS, arch)[1]


def nvrtc_ptx(source, options):
    """Compile with NVRTC (the compiler CuPy uses at run time); PTX text."""
    from cupy_backends.cuda.libs import nvrtc
    prog = nvrtc.createProgram(source, 'vgc_check.cu', (), ())
    try:
        try:
            nvrtc.compileProgram(prog, list(options))
        except nvrtc.NVRTCError:
            raise RuntimeError('NVRTC failed with options {}:\n{}'.format(
                ' '.join(options), nvrtc.getProgramLog(prog)))
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


def ptx_float_instructions(ptx):
    """Floating-point instructions of a PTX text (one per line)."""
    return [line.strip() for line in ptx.splitlines()
            if re.search(r'\b(add|sub|mul|div|fma|setp|cvt|neg|abs|min|max)'
                         r'\.[a-z.]*f(16|32|64)\b', line)]
