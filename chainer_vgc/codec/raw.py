"""FMT_RAW, quantization off (``none``, ``vgc`` with ``quantize=False``):
``a`` = flags (bit 0, :data:`.RAW_DENSE`: dense, no index words; bit 1,
:data:`.RAW_FLOAT64`: float64 values); body: ``count`` index words (unless
dense), then the values as float32 (1 word) or float64 (2 words, copied
out on decode for alignment)."""

import numpy

from chainer_vgc.backends import arrays
from chainer_vgc.codec.constants import FMT_RAW, RAW_DENSE, RAW_FLOAT64
from chainer_vgc.codec.header import (
    Group, WireFormat, WireFormatError, check_finite, check_index, where)


def raw_group(tensor_id, index, values, size):
    """Unquantized values; dense (no index words) when all ``size`` are sent.

    ``values`` must be float32 or float64; ``index`` sorted, unique.
    """
    xp = arrays.get_array_module(values)
    values = xp.ascontiguousarray(values)
    f64 = values.dtype == numpy.float64
    if not f64 and values.dtype != numpy.float32:
        raise TypeError('raw_group: values must be float32 or float64, got '
                        '{}'.format(values.dtype))
    dense = int(values.size) == int(size)
    parts = []
    if not dense:
        parts.append(index.astype(numpy.uint32))
    parts.append(values.reshape(-1).view(numpy.uint32))
    flags = (RAW_DENSE if dense else 0) | (RAW_FLOAT64 if f64 else 0)
    return Group(int(tensor_id), FMT_RAW, int(values.size), flags, 0,
                 xp.concatenate(parts))


# ---- the format's functions (see chainer_vgc.codec.header) ------------------

def _raw_check(g, size):
    if g.a & ~(RAW_DENSE | RAW_FLOAT64):
        raise WireFormatError(where(g) + 'unknown raw flags')
    if g.a & RAW_DENSE and size is not None and g.count != size:
        raise WireFormatError(where(g) + 'dense group with {} of {} '
                              'elements'.format(g.count, size))


def _raw_body_words(g, head):
    return (0 if g.a & RAW_DENSE else g.count) + g.count * (
        2 if g.a & RAW_FLOAT64 else 1)


def _raw_values(g, size, dtype, xp):
    """(index words as int64, or None when dense; the values as sent)."""
    if g.a & RAW_DENSE:
        index, vals = None, g.body
    else:
        index, vals = g.body[:g.count].astype(numpy.int64), g.body[g.count:]
    # copy: a float64 view must start on an 8-byte boundary (GPUs fault on
    # misaligned loads) and the body may start at any word
    wire = vals.copy().view(numpy.float64 if g.a & RAW_FLOAT64
                            else numpy.float32)
    return index, wire  # cast by the caller


def _raw_decode(g, size, dtype, xp):
    """Every value must be finite on the wire and once cast to ``dtype``
    (1e300 sent as float64 overflows float32)."""
    index, wire = _raw_values(g, size, dtype, xp)
    with numpy.errstate(over='ignore', invalid='ignore'):
        value = wire.astype(dtype, copy=False)
    check_finite(value, wire, g, dtype, xp)
    if index is None:
        index = xp.arange(size, dtype=numpy.int64)
    else:
        check_index(index, size, g)
    return index, value


FORMAT = WireFormat(
    FMT_RAW, 'raw',
    a='flags: RAW_DENSE (no index words), RAW_FLOAT64', b='0',
    body='count index words (unless dense), then count float32 '
         'or float64 values',
    body_words=_raw_body_words, check=_raw_check,
    decode=_raw_decode, values=_raw_values)
