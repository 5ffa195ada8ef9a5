"""CuPy version check, NVRTC preloading and a CUDA status report.

Chainer 7.8.1 declares support for CuPy < 8, but no CuPy of that age
targets CUDA 12; chainer-vgc pairs Chainer 7.8.1 with CuPy 13
(``cupy-cuda12x>=13,<14``, the ``cuda`` extra).  :func:`check_cupy` turns
any other CuPy into one clear error instead of a failure deep inside a
kernel launch.

``cupy-cuda12x`` does not bundle NVRTC, the runtime compiler that builds the
kernels of :mod:`chainer_vgc.kernels` on their first call, and does not look
for it in the ``nvidia-cuda-nvrtc-cu12`` wheel.  :func:`preload_nvrtc` loads
that wheel's ``libnvrtc.so`` into the process (``RTLD_GLOBAL``) so that
CuPy's own ``dlopen('libnvrtc.so.12')`` finds it; call it before the first
kernel is compiled.

``python -m chainer_vgc.cuda_support`` prints :func:`status`.
"""

import ctypes
import glob
import os
import re
import threading

#: Supported CuPy major versions, ``[SUPPORTED_CUPY[0], SUPPORTED_CUPY[1])``.
SUPPORTED_CUPY = (13, 14)

#: What to run to get a supported CuPy.
INSTALL_HINT = ("pip install 'chainer-vgc[cuda]' (or pip install "
                "'cupy-cuda12x>={},<{}')".format(*SUPPORTED_CUPY))

_VERSION_RE = re.compile(r'^\s*v?(\d+)(?:\.(\d+))?(?:\.(\d+))?')

_lock = threading.Lock()
_nvrtc = {'path': None, 'handle': None, 'error': None}


def supported_range():
    """The supported CuPy versions as a requirement string, ``'>=13,<14'``."""
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
    version, the supported range and the fix."""
    raw = getattr(cupy_module, '__version__', None)
    try:
        version = parse_version(raw)
    except ValueError:
        version = None
    lo, hi = SUPPORTED_CUPY
    if version is None or not lo <= version[0] < hi:
        raise RuntimeError(
            'chainer_vgc: CuPy {} is installed, but chainer-vgc (with Chainer '
            '7.8.1) supports CuPy {} only.  Fix: {}'.format(
                raw if raw is not None else '(unknown version)',
                supported_range(), INSTALL_HINT))
    return version


def _soname_key(path):
    """Sort key of ``libnvrtc.so.X.Y``: the numeric suffix parts."""
    suffix = os.path.basename(path).split('.so.', 1)[1]
    return tuple(int(p) if p.isdigit() else -1 for p in suffix.split('.'))


def find_nvrtc():
    """Path of ``libnvrtc.so.12`` (else the highest ``libnvrtc.so.*``) in
    the ``nvidia-cuda-nvrtc-cu12`` wheel, or ``None``."""
    try:
        import nvidia.cuda_nvrtc as pkg
    except ImportError:
        return None
    # nvidia.* are namespace packages: no __file__, only __path__
    dirs = list(getattr(pkg, '__path__', []))
    if getattr(pkg, '__file__', None):
        dirs.append(os.path.dirname(pkg.__file__))
    for d in dirs:
        libdir = os.path.join(d, 'lib')
        preferred = os.path.join(libdir, 'libnvrtc.so.12')
        if os.path.isfile(preferred):
            return preferred
        found = [p for p in glob.glob(os.path.join(libdir, 'libnvrtc.so.*'))
                 if os.path.isfile(p)]
        if found:
            return max(found, key=_soname_key)
    return None


def preload_nvrtc():
    """Load NVRTC from the ``nvidia-cuda-nvrtc-cu12`` wheel with
    ``RTLD_GLOBAL`` and return its path; ``None`` if the wheel is missing or
    the library does not load (the reason is in :func:`status`).
    Idempotent: the library is loaded once per process."""
    with _lock:
        if _nvrtc['handle'] is not None:
            return _nvrtc['path']
        path = find_nvrtc()
        if path is None:
            _nvrtc['error'] = ('nvidia-cuda-nvrtc-cu12 is not installed (or '
                               'has no lib/libnvrtc.so.*)')
            return None
        try:
            handle = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            _nvrtc['error'] = '{}: {}'.format(type(e).__name__, e)
            return None
        _nvrtc.update(path=path, handle=handle, error=None)
        return path


def status():
    """A dict describing the CUDA setup, for bug reports and the README:

    ``cupy_version`` (``None`` if CuPy does not import, with the reason in
    ``cupy_import_error``), ``cupy_supported`` and ``cupy_supported_range``,
    ``chainer_cuda_available`` (``chainer.backends.cuda.available``) and
    ``chainer_cuda_error`` (its ``_resolution_error``, as text),
    ``nvrtc_path`` (from :func:`preload_nvrtc`, which this calls) and
    ``nvrtc_error``.
    """
    info = {'cupy_version': None, 'cupy_import_error': None,
            'cupy_supported': False,
            'cupy_supported_range': supported_range(),
            'cupy_check_error': None,
            'chainer_cuda_available': None, 'chainer_cuda_error': None,
            'nvrtc_path': None, 'nvrtc_error': None}
    try:
        import cupy
    except Exception as e:  # ImportError, or a CUDA library missing
        info['cupy_import_error'] = '{}: {}'.format(type(e).__name__, e)
    else:
        info['cupy_version'] = getattr(cupy, '__version__', None)
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
        err = getattr(cuda, '_resolution_error', None)
        if err is not None:
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
