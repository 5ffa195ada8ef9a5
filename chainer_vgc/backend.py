"""NumPy/CuPy dispatch helpers (CuPy is optional) and the CPU backend choice."""

import os

import numpy

try:  # pragma: no cover - exercised only where CuPy is installed
    import cupy
except Exception:  # ImportError, or a CUDA library missing at import
    cupy = None


def get_array_module(*arrays):
    """``cupy`` if any argument is a CuPy array, else ``numpy``."""
    if cupy is not None:
        for a in arrays:
            if isinstance(a, cupy.ndarray):
                return cupy
    return numpy


def is_cupy(xp):
    return cupy is not None and xp is cupy


def to_numpy(a):
    """Host copy of an array (no copy for NumPy input)."""
    if cupy is not None and isinstance(a, cupy.ndarray):
        return cupy.asnumpy(a)
    return numpy.asarray(a)


#: CPU implementations: the fused C++ passes (default) and the NumPy
#: reference they are tested against bit for bit
CPU_BACKENDS = ('native', 'numpy')


def cpu_backend(name=None):
    """The CPU backend to use: ``name``, else the environment variable
    ``CHAINER_VGC_BACKEND``, else ``'native'``."""
    chosen = name or os.environ.get('CHAINER_VGC_BACKEND') or 'native'
    if chosen not in CPU_BACKENDS:
        raise ValueError(
            'chainer_vgc: CPU backend must be one of {} (argument backend= or '
            'environment variable CHAINER_VGC_BACKEND), got {!r}'.format(
                ', '.join(CPU_BACKENDS), chosen))
    return chosen


def state_dtype(dtype):
    """dtype of the residual state for a parameter of ``dtype``.

    float16 parameters keep their residual and variance in float32: small
    gradients accumulated over many steps would otherwise vanish in float16.
    """
    dtype = numpy.dtype(dtype)
    if dtype.kind != 'f':
        raise TypeError('chainer_vgc: expected a floating-point dtype, got '
                        '{}'.format(dtype))
    return numpy.dtype(numpy.float64 if dtype == numpy.float64
                       else numpy.float32)
