"""NumPy/CuPy dispatch helpers (CuPy is optional)."""

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
