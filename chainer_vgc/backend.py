"""NumPy/CuPy dispatch helpers (CuPy is optional) and the CPU backend choice."""

import contextlib
import os

import numpy

try:  # pragma: no cover - exercised only where CuPy is installed
    import cupy
    import cupyx
except Exception:  # ImportError, or a CUDA library missing at import
    cupy = cupyx = None
else:
    # NVRTC from its wheel before CuPy compiles anything (CuPy's own
    # kernels included); a no-op where the wheel is absent
    from chainer_vgc import cuda_support as _cuda_support
    _cuda_support.preload_nvrtc()


def get_array_module(*arrays):
    """``cupy`` if any argument is a CuPy array, else ``numpy``."""
    if cupy is not None:
        for a in arrays:
            if isinstance(a, cupy.ndarray):
                return cupy
    return numpy


def is_cupy(xp):
    return cupy is not None and xp is cupy


def device_scope(a):
    """The context in which new arrays land on ``a``'s device: the CuPy
    array's device, a no-op for anything else.  State and buffers follow
    the parameters' device, not whichever device is current."""
    if cupy is not None and isinstance(a, cupy.ndarray):
        return a.device
    return contextlib.nullcontext()


def stream_marker(a):
    """For a CuPy array: an event recorded on the current stream (the work
    queued so far, e.g. a backward pass); None otherwise."""
    if cupy is not None and isinstance(a, cupy.ndarray):
        with a.device:
            event = cupy.cuda.Event(disable_timing=True)
            event.record()
            return event
    return None


def wait_marker(event):
    """Make this thread's current stream wait for :func:`stream_marker`'s
    event (another thread's queued work)."""
    if event is not None:
        cupy.cuda.get_current_stream().wait_event(event)


def finish_stream(a):
    """For a CuPy array: wait until this thread's current stream has run
    everything queued (before another thread reads the results)."""
    if cupy is not None and isinstance(a, cupy.ndarray):
        cupy.cuda.get_current_stream().synchronize()


def host_buffer(n, dtype, pinned=True):
    """A 1-D host array of ``n`` elements for device<->host copies:
    page-locked (pinned) memory where CuPy is installed and ``pinned``, so
    that the copy runs at full bus speed; ordinary memory otherwise (also
    where CuPy cannot pin memory: no GPU or driver)."""
    if pinned and cupyx is not None:
        try:
            return cupyx.empty_pinned((int(n),), dtype=dtype)
        except Exception:  # cupy's CUDARuntimeError without a driver
            pass
    return numpy.empty(int(n), dtype=dtype)


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
