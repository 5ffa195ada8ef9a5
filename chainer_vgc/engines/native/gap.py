"""The native CPU backend's FMT_GAP coder: ctypes bindings of
``kernels/vgc_gap_coder.h`` (compiled into the library of
:mod:`chainer_vgc.engines.native.bindings`).

The fast paths of :func:`chainer_vgc.codec.gap_body` (encode) and
:func:`chainer_vgc.codec.gap_decode_body` (decode, with every check of the
format), equal to them bit for bit (``tests/test_gap_format.py``).
"""

import numpy

from chainer_vgc.engines.native.bindings import NativeBackendError
from chainer_vgc.engines.native.bindings import load


def rice_parameter(count, size):
    """``codec.rice_parameter`` computed by the library (for the tests)."""
    return int(load().vgc_native_rice_parameter(int(count), int(size)))


def gap_encode(index, nibbles, k, sign_only):
    """The FMT_GAP body (uint32) of the elements at ``index`` (strictly
    increasing, >= 0) with table entries ``nibbles`` (sign << 3 | d; with
    ``sign_only`` only the sign, ``nibbles >> 3``, is written) and Rice
    parameter ``k``: the fast path of ``codec.gap_body``.  ValueError for
    invalid arguments."""
    lib = load()
    index = numpy.ascontiguousarray(index, dtype=numpy.int64).reshape(-1)
    nibbles = numpy.ascontiguousarray(nibbles, dtype=numpy.uint8).reshape(-1)
    if index.size != nibbles.size:
        raise ValueError('gap_encode: index and nibbles differ in length')
    args = (index.ctypes.data, nibbles.ctypes.data, index.size, int(k),
            int(bool(sign_only)))
    words = lib.vgc_native_gap_encode(*args, None)
    if words < 0:
        raise ValueError('gap_encode: indices must be strictly increasing '
                         'and >= 0, nibbles < 16, k in 0..63')
    body = numpy.empty(words, dtype=numpy.uint32)
    lib.vgc_native_gap_encode(*args, body.ctypes.data)
    return body


def gap_decode(body, count, size):
    """``(index int64, nibbles uint8)`` of the FMT_GAP body ``body`` (exactly
    the body's words) of a group of ``count`` elements over one index space
    of ``size`` elements (a group spanning tensors: its span_size, the
    indices in their concatenation), every decoder check of the format
    applied; None if it is invalid (the fast path of
    ``codec.gap_decode_body``, which names the fault).  The span (param
    word bits 8..31) is the caller's and ignored here, as by codec; bit 7
    must say whether a restart table follows.  ``nibbles`` are the value-table entries sign << 3 | d
    (d = 0 for SIGN_ONLY)."""
    lib = load()
    body = numpy.ascontiguousarray(body, dtype=numpy.uint32).reshape(-1)
    count, size = int(count), int(size)
    if count < 0 or count >= 2 ** 32 or size < 0:
        return None
    index = numpy.empty(count, dtype=numpy.int64)
    nibbles = numpy.empty(count, dtype=numpy.uint8)
    rc = lib.vgc_native_gap_decode(body.ctypes.data, body.size, count, size,
                                   index.ctypes.data, nibbles.ctypes.data)
    if rc != 0:
        return None
    return index, nibbles
