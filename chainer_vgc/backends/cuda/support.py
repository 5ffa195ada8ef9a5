"""CuPy version check, NVRTC preloading and a CUDA status report.

Chainer 7.8.1 declares support for CuPy < 8, but no CuPy of that age
targets CUDA 12 or 13; chainer-vgc pairs Chainer 7.8.1 with CuPy 13 or 14,
one per stack, as the ``cuda`` extra (``pip install 'chainer-vgc[cuda]'``)
selects them by ``python_version`` marker:

* Python < 3.12 (NumPy 1.x): ``cupy-cuda12x>=13,<14`` (CUDA 12), with NVRTC
  from the ``nvidia-cuda-nvrtc-cu12`` wheel
  (``nvidia/cuda_nvrtc/lib/libnvrtc.so.12``);
* Python >= 3.12 (NumPy 2): ``cupy-cuda13x>=14,<15`` (CUDA 13), with NVRTC
  from the ``nvidia-cuda-nvrtc`` 13.x wheel
  (``nvidia/cu13/lib/libnvrtc.so.13``).

:func:`check_cupy` turns any other CuPy major version into one clear error,
naming this interpreter's fix, instead of a failure deep inside a kernel
launch.

NVRTC is the runtime compiler that builds the kernels of
:mod:`chainer_vgc.backends.cuda.kernels` on their first call.  Neither CuPy wheel bundles
it.  CuPy 13 does not look for it in the NVIDIA wheel: it loads
``libnvrtc.so.12`` by name.  CuPy 14 looks for it through ``cuda-pathfinder``
(site-packages first).  :func:`preload_nvrtc` loads the wheel's library for
the CUDA major version the installed CuPy was built for (12 or 13, never
another) into the process (``RTLD_GLOBAL``), so that CuPy finds it loaded
already; call it before the first kernel is compiled.  :func:`find_nvrtc`
only locates it.

``python -m chainer_vgc.backends.cuda.support`` prints :func:`status`.
"""

import ctypes
import glob
import importlib.util
import os
import re
import sys
import threading

#: Supported CuPy major versions, ``[SUPPORTED_CUPY[0], SUPPORTED_CUPY[1])``:
#: CuPy 13 (CUDA 12, NumPy 1.x) and CuPy 14 (CUDA 13, NumPy 2).
SUPPORTED_CUPY = (13, 15)

#: The NVIDIA wheel that carries NVRTC for each CUDA major version:
#: ``cuda_major`` -> (its distribution name, the directory of the library
#: below the ``nvidia`` package).  The library is
#: ``libnvrtc.so.<cuda_major>``.
NVRTC_WHEELS = {
    12: ('nvidia-cuda-nvrtc-cu12', os.path.join('cuda_nvrtc', 'lib')),
    13: ('nvidia-cuda-nvrtc', os.path.join('cu13', 'lib')),
}

_VERSION_RE = re.compile(r'^\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?')

_lock = threading.Lock()
_nvrtc = {'path': None, 'handle': None, 'error': None}


def stack_requirements(python_version=None):
    """``(CuPy, NVRTC wheel, CUDA runtime headers wheel)`` requirements
    that ``pip install 'chainer-vgc[cuda]'`` installs on Python
    ``python_version`` (a ``(major, minor)`` tuple; default: this
    interpreter), as setup.cfg's ``cuda`` extra chooses by
    ``python_version`` marker: CuPy 13 for CUDA 12 (with NumPy 1.x) below
    Python 3.12, CuPy 14 for CUDA 13 (with NumPy 2) from 3.12 on.  The
    headers wheel serves where no CUDA toolkit is installed: CuPy compiles
    every kernel with ``cuda_fp16.h``."""
    version = tuple(python_version or sys.version_info[:2])
    if version < (3, 12):
        return ('cupy-cuda12x>=13,<14', 'nvidia-cuda-nvrtc-cu12>=12,<13',
                'nvidia-cuda-runtime-cu12>=12,<13')
    return ('cupy-cuda13x>=14,<15', 'nvidia-cuda-nvrtc>=13,<14',
            'nvidia-cuda-runtime>=13,<14')


def install_hint(python_version=None):
    """What to run to get a supported CuPy (with its NVRTC and CUDA
    headers) on Python ``python_version`` (default: this interpreter)."""
    return ("pip install 'chainer-vgc[cuda]' (or pip install {})".format(
        ' '.join("'{}'".format(r)
                 for r in stack_requirements(python_version))))


#: What to run to get a supported CuPy on this interpreter.
INSTALL_HINT = install_hint()


def supported_range():
    """The supported CuPy versions as a requirement string, ``'>=13,<15'``."""
    return '>={},<{}'.format(*SUPPORTED_CUPY)


def parse_version(text):
    """``(major, minor, patch)`` of a version string such as ``'13.6.0'``,
    ``'13.0.0rc1'`` or ``'14.0.0a1'`` (pre-release and local suffixes are
    dropped; missing parts are 0).  ``ValueError`` if it has no leading
    number."""
    m = _VERSION_RE.match(str(text))
    if m is None:
        raise ValueError('not a version: {!r}'.format(text))
    return tuple(int(part or 0) for part in m.groups())


def check_cupy(cupy_module):
    """The version tuple of ``cupy_module`` if its major version is in
    :data:`SUPPORTED_CUPY`; else ``RuntimeError`` naming the installed
    version, the supported range and the fix for this interpreter."""
    raw = getattr(cupy_module, '__version__', None)
    try:
        version = parse_version(raw)
    except ValueError:
        version = None
    lo, hi = SUPPORTED_CUPY
    if version is None or not lo <= version[0] < hi:
        raise RuntimeError(
            'chainer_vgc: CuPy {} is installed, but chainer-vgc (with Chainer '
            '7.8.1) supports CuPy {} only (CuPy 13 for CUDA 12 with NumPy '
            '1.x on Python < 3.12, CuPy 14 for CUDA 13 with NumPy 2 on '
            'Python >= 3.12).  Fix: {}'.format(
                raw if raw is not None else '(unknown version)',
                supported_range(), INSTALL_HINT))
    return version


def cupy_cuda_major():
    """The CUDA major version the installed CuPy was built for (12 for
    ``cupy-cuda12x``, 13 for ``cupy-cuda13x``), which is the NVRTC major
    version it loads; ``None`` if CuPy is not importable.  (No GPU is
    needed: this is a constant of the build.)"""
    try:
        from cupy_backends.cuda.api import driver
        return int(driver.get_build_version()) // 1000
    except Exception:  # ImportError, or a CUDA library missing at import
        return None


def _nvidia_dirs():
    """The directories of the ``nvidia`` package, in import order: those
    ``import nvidia`` would search (a namespace package spread over
    several ``sys.path`` entries, or one directory where some wheel made
    it a regular package), then ``nvidia`` in every ``sys.path`` entry
    (which a regular package would hide).  Nothing is imported."""
    dirs = []
    try:
        spec = importlib.util.find_spec('nvidia')
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        dirs.extend(spec.submodule_search_locations or ())
    dirs.extend(os.path.join(entry or os.curdir, 'nvidia')
                for entry in sys.path if isinstance(entry, str))
    out = []
    for d in dirs:
        d = os.path.abspath(d)
        if d not in out and os.path.isdir(d):
            out.append(d)
    return out


def find_nvrtc(cuda_major=None):
    """Path of ``libnvrtc.so.<cuda_major>`` in its NVIDIA wheel
    (:data:`NVRTC_WHEELS`: ``nvidia/cuda_nvrtc/lib`` for CUDA 12,
    ``nvidia/cu13/lib`` for CUDA 13), or ``None``.  ``cuda_major``
    defaults to :func:`cupy_cuda_major`.  A library of another major
    version is never returned; a versioned file
    (``libnvrtc.so.12.9.86``) stands in for a missing soname file."""
    if cuda_major is None:
        cuda_major = cupy_cuda_major()
    if cuda_major not in NVRTC_WHEELS:
        return None
    soname = 'libnvrtc.so.{}'.format(cuda_major)
    libdir = NVRTC_WHEELS[cuda_major][1]
    for d in _nvidia_dirs():
        preferred = os.path.join(d, libdir, soname)
        if os.path.isfile(preferred):
            return preferred
        versioned = [p for p in glob.glob(os.path.join(d, libdir,
                                                       soname + '.*'))
                     if os.path.isfile(p)]
        if versioned:
            return max(versioned, key=_soname_key)
    return None


def _soname_key(path):
    """Sort key of ``libnvrtc.so.X.Y.Z``: the numeric suffix parts."""
    suffix = os.path.basename(path).split('.so.', 1)[1]
    return tuple(int(p) if p.isdigit() else -1 for p in suffix.split('.'))


def _missing_nvrtc_reason(cuda_major):
    if cuda_major is None:
        return ('CuPy is not importable, so the NVRTC it needs is unknown; '
                'nothing was loaded')
    if cuda_major not in NVRTC_WHEELS:
        return ('CuPy is built for CUDA {}, for which chainer-vgc knows no '
                'NVRTC wheel; nothing was loaded (supported: CUDA {})'.format(
                    cuda_major, ', '.join(str(m) for m in NVRTC_WHEELS)))
    wheel, libdir = NVRTC_WHEELS[cuda_major]
    return ('{} is not installed (no nvidia/{}/libnvrtc.so.{} on sys.path), '
            'the NVRTC that CuPy (built for CUDA {}) needs; fix: {}'.format(
                wheel, libdir, cuda_major, cuda_major, INSTALL_HINT))


def preload_nvrtc():
    """Load NVRTC for the installed CuPy (:func:`find_nvrtc`: the
    ``nvidia-cuda-nvrtc-cu12`` wheel's ``libnvrtc.so.12`` for a CUDA 12
    CuPy, the ``nvidia-cuda-nvrtc`` wheel's ``libnvrtc.so.13`` for a CUDA
    13 CuPy) with ``RTLD_GLOBAL`` and return its path; ``None`` if CuPy is
    not importable, the wheel is missing or the library does not load (the
    reason is in :func:`status`).  Idempotent: the library is loaded once
    per process."""
    with _lock:
        if _nvrtc['handle'] is not None:
            return _nvrtc['path']
        cuda_major = cupy_cuda_major()
        path = find_nvrtc(cuda_major)
        if path is None:
            _nvrtc['error'] = _missing_nvrtc_reason(cuda_major)
            return None
        try:
            handle = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            _nvrtc['error'] = '{}: {}'.format(type(e).__name__, e)
            return None
        _nvrtc.update(path=path, handle=handle, error=None)
        return path


def status():
    """A dict describing the CUDA setup, for bug reports and docs/gpu.md:

    ``cupy_version`` (``None`` if CuPy does not import, with the reason in
    ``cupy_import_error``), ``cupy_supported``, ``cupy_supported_range``
    and ``cupy_check_error``, ``cupy_cuda_major`` (the CUDA major version
    CuPy was built for, which NVRTC must match),
    ``chainer_cuda_available`` (``chainer.backends.cuda.available``),
    ``chainer_cuda_error`` (its ``_resolution_error``, as text, where CUDA
    is not available), ``chainer_cudnn_enabled`` (CuPy 14 has no cuDNN:
    False there),
    ``nvrtc_path`` (from :func:`preload_nvrtc`, which this calls) and
    ``nvrtc_error``.
    """
    info = {'cupy_version': None, 'cupy_import_error': None,
            'cupy_supported': False,
            'cupy_supported_range': supported_range(),
            'cupy_check_error': None, 'cupy_cuda_major': None,
            'chainer_cuda_available': None, 'chainer_cuda_error': None,
            'chainer_cudnn_enabled': None,
            'nvrtc_path': None, 'nvrtc_error': None}
    try:
        import cupy
    except Exception as e:  # ImportError, or a CUDA library missing
        info['cupy_import_error'] = '{}: {}'.format(type(e).__name__, e)
    else:
        info['cupy_version'] = getattr(cupy, '__version__', None)
        info['cupy_cuda_major'] = cupy_cuda_major()
        try:
            check_cupy(cupy)
            info['cupy_supported'] = True
        except RuntimeError as e:
            info['cupy_check_error'] = str(e)
    try:
        from chainer.backends import cuda
    except Exception as e:
        info['chainer_cuda_error'] = 'chainer.backends.cuda: {}: {}'.format(
            type(e).__name__, e)
    else:
        info['chainer_cuda_available'] = bool(cuda.available)
        info['chainer_cudnn_enabled'] = bool(getattr(cuda, 'cudnn_enabled',
                                                     False))
        err = getattr(cuda, '_resolution_error', None)
        # with CUDA available, the error left there is cuDNN's (CuPy 14
        # has no cupy.cuda.cudnn): chainer_cudnn_enabled says that
        if err is not None and not cuda.available:
            info['chainer_cuda_error'] = '{}: {}'.format(
                type(err).__name__, err)
    info['nvrtc_path'] = preload_nvrtc()
    info['nvrtc_error'] = _nvrtc['error']
    return info


def _main():
    for key, value in status().items():
        print('{}: {}'.format(key, value))


if __name__ == '__main__':
    _main()
