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
    from chainer_vgc.backends.cuda import support as _cuda_support
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


class HostStaging(object):
    """One reusable host buffer for copies made every step whose size
    changes from step to step (:func:`host_buffer` is for one-off buffers).

    Why: CuPy's pinned memory pool hands a freed block out again only for
    the same size (rounded to 512 bytes) and keeps every freed block, so a
    new pinned buffer a step, of a size that changes each step, pins more
    host memory (memory the OS cannot swap out) step after step.  This
    class keeps one allocation (pinned where :func:`host_buffer` can pin,
    ordinary memory otherwise) and hands out views of it.

    Growth rule: a request of ``need`` bytes larger than the capacity ``c``
    allocates ``max(need, 2 * c)`` bytes (the old buffer is dropped); a
    request that fits reuses the buffer.  Bounds, R being the largest
    request so far and r the first one:

    * capacity <= 2 R: it grows only when need > c, so 2 c < 2 need <= 2 R,
      and need <= R;
    * allocations <= ceil(log2(R / r)) + 1: the k-th capacity is at least
      2**(k-1) r (it at least doubles) and, for k >= 2, less than 2 R, so
      2**(k-1) r < 2 R, k < 2 + log2(R / r), and k, an integer, is at
      most ceil(log2(R / r)) + 1;
    * bytes ever allocated (what a pool that keeps freed blocks may hold)
      < 2 x the last capacity <= 4 R: the capacities at least double, so
      the earlier ones add up to less than the last.

    The buffer must not be rewritten while a copy that reads it may still
    be queued: give :meth:`hold_until` an event recorded after that copy
    (:func:`upload_fence`), and :meth:`view` waits for it before handing
    the buffer out again.
    """

    def __init__(self, pinned=True):
        self.pinned = pinned
        #: bytes held (0: nothing allocated yet)
        self.capacity = 0
        #: allocations made so far
        self.allocations = 0
        self._raw = None
        self._busy = None

    def view(self, n, dtype):
        """A 1-D host array of ``n`` elements of ``dtype``: a view of the
        buffer (its contents are whatever was written before), after the
        copy given to :meth:`hold_until` has completed."""
        dtype = numpy.dtype(dtype)
        need = int(n) * dtype.itemsize
        if need == 0:
            return numpy.empty(0, dtype)
        if self._busy is not None:
            self._busy.synchronize()
            self._busy = None
        if need > self.capacity:
            grown = max(need, 2 * self.capacity)
            self._raw, self.capacity = None, 0  # dropped first
            self._raw = host_buffer(grown, numpy.uint8, self.pinned)
            self.capacity = grown
            self.allocations += 1
        return self._raw[:need].view(dtype)

    def hold_until(self, event):
        """Hand the buffer out again only once ``event`` (an event recorded
        after the copy that reads the last view, or None: nothing queued)
        has completed."""
        self._busy = event


def upload_fence(a):
    """For the CuPy array ``a`` just copied from a host buffer: an event
    recorded on the current stream after that copy, to give
    :meth:`HostStaging.hold_until`.  None for anything else, and where the
    CuPy in use records no events (the tests' stand-in): its copies are
    done when they return.

    Why: CuPy (14, cupy/_core/core.pyx ``_array_default``) copies a NumPy
    array that lives in pinned memory asynchronously: ``cupy.asarray``
    queues the copy on the current stream and returns, and the buffer is
    read when the stream gets there."""
    if cupy is None or not isinstance(a, cupy.ndarray) or \
            getattr(cupy.cuda, 'Event', None) is None:
        return None
    return stream_marker(a)


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
    found = _STATE_DTYPES.get(dtype)
    if found is not None:
        return found
    dtype = numpy.dtype(dtype)
    if dtype.kind != 'f':
        raise TypeError('chainer_vgc: expected a floating-point dtype, got '
                        '{}'.format(dtype))
    found = _STATE_DTYPES[dtype] = numpy.dtype(
        numpy.float64 if dtype == numpy.float64 else numpy.float32)
    return found


#: {floating dtype: its state dtype}, as :func:`state_dtype` found them
#: (the statistics ask for every use of every step)
_STATE_DTYPES = {}
