"""FMT_POW2, the paper's one word per element (VGC quantization, Strom,
hybrid): ``a`` = e_k (int32), ``b`` = float32 bits of ``scale``; body:
``count`` words ``sign(1) | d(3) | index(28)``; element value =
``sign * scale * 2**(e_k - d)`` (VGC: scale 1; Strom/hybrid: e_k 0, d 0,
scale tau).  The 28-bit index limits a tensor to 2**28 elements.

Also the quantization itself (Sec. 4.2, 4.4: :func:`floor_log2`,
:func:`pow2_encode` and its inverse) and FMT_INDEXED, the internal form of
FMT_GAP groups the device adds from (pow2 words and int64 indices).
"""

import numpy

from chainer_vgc.backends import arrays
from chainer_vgc.backends.cuda import kernels
from chainer_vgc.codec.constants import (
    FMT_INDEXED, FMT_POW2, INDEX_BITS, LOG2_ZERO, MAX_D, MAX_INDEX)
from chainer_vgc.codec.header import (
    Group, WireFormat, WireFormatError, check_index, f32_bits, no_check,
    where)

_TRAITS = {
    # dtype: (unsigned view, mantissa bits, bias, sign shift)
    numpy.dtype(numpy.float32): (numpy.uint32, 23, 127, 31),
    numpy.dtype(numpy.float64): (numpy.uint64, 52, 1023, 63),
}


def _traits(dtype):
    dtype = numpy.dtype(dtype)
    try:
        return _TRAITS[dtype]
    except KeyError:
        raise TypeError('chainer_vgc.codec: quantization works on float32 or '
                        'float64 state, got {}'.format(dtype))


def _bit_fields(x):
    """(unsigned bits, exponent-field mask, top mantissa bit, traits)."""
    u, mant, bias, sign_shift = _traits(x.dtype)
    bits = x.view(u)
    exp_mask = u(((1 << (sign_shift - mant)) - 1) << mant)
    top = u(1 << (mant - 1))
    return bits, exp_mask, top, (u, mant, bias, sign_shift)


def floor_log2(x):
    """``floor(log2 |x|)`` of a scalar by truncating the mantissa (Sec. 4.4).

    Returns :data:`.LOG2_ZERO` for 0 and subnormal values.  A device scalar
    is read as one value (no array download).
    """
    if not isinstance(x, (numpy.ndarray, numpy.generic, float, int)):
        x = numpy.asarray(x.item(), dtype=x.dtype)  # a CuPy 0-d array
    x = numpy.asarray(x)
    if x.dtype not in _TRAITS:
        x = x.astype(numpy.float32)
    x = x.reshape(1)
    bits, exp_mask, _, (u, mant, bias, _) = _bit_fields(x)
    field = int((bits[0] & exp_mask) >> u(mant))
    return LOG2_ZERO if field == 0 else field - bias


# ---- FMT_POW2: quantization and group builders ------------------------------

def pow2_encode(values, index, e_k):
    """Quantize ``values`` against e_k and pack them with ``index``.

    Each ``|value|`` above 2**e_k is truncated to 2**e_k, any other is rounded
    to the nearer power of two by the float bit trick (add the mantissa's top
    bit, mask the mantissa; ties 1.5 * 2**e round up), and
    ``d = e_k - log2 |value'|``.  Returns ``(words, ok)``: ``ok`` is False
    where d > 7 or the value is 0 or subnormal; such elements get word 0 and
    must not be sent.  CuPy input runs the ``vgc_pow2_encode`` kernel.
    """
    xp = arrays.get_array_module(values)
    if arrays.is_cupy(xp):
        return kernels.get_kernel('vgc_pow2_encode')(values, index, e_k)
    bits, exp_mask, top, (u, mant, bias, sign_shift) = _bit_fields(values)
    mag = bits & u(~(1 << sign_shift) & ((1 << (sign_shift + 1)) - 1))
    zero = (mag & exp_mask) == 0
    e = (((mag + top) & exp_mask) >> u(mant)).astype(numpy.int64) - bias
    numpy.minimum(e, e_k, out=e)
    d = e_k - e
    ok = ~zero & (d <= MAX_D)
    negative = (bits >> u(sign_shift)).astype(numpy.uint32)
    words = ((negative << numpy.uint32(31))
             | (d.astype(numpy.uint32) << numpy.uint32(INDEX_BITS))
             | (index.astype(numpy.uint32) & numpy.uint32(MAX_INDEX - 1)))
    words[~ok] = 0
    return words.astype(numpy.uint32, copy=False), ok


def pow2_decode(words, e_k, scale, dtype):
    """Exact inverse of :func:`pow2_encode`: ``(index, value)``.

    value = sign * scale * 2**(e_k - d) in ``dtype`` (float32 or float64).
    """
    dtype = numpy.dtype(dtype)
    _traits(dtype)
    scale = wire_scale(scale, dtype)
    xp = arrays.get_array_module(words)
    if arrays.is_cupy(xp):
        # S appears only on a scalar: CuPy needs the outputs to deduce it
        index = xp.empty(words.shape, dtype=numpy.int64)
        value = xp.empty(words.shape, dtype=dtype)
        return kernels.get_kernel('vgc_pow2_decode')(words, e_k, scale,
                                                     index, value)
    index = (words & numpy.uint32(MAX_INDEX - 1)).astype(numpy.int64)
    # the top 4 bits (sign, d) select one of 16 values: one gather per word
    value = pow2_table(e_k, scale, dtype)[words >> numpy.uint32(INDEX_BITS)]
    return index, value


def pow2_table(e_k, scale, dtype):
    """The 16 values a FMT_POW2 word can stand for, indexed by its top 4
    bits (sign, d): ``sign * scale * 2**(e_k - d)`` in ``dtype``."""
    dtype = numpy.dtype(dtype)
    mags = numpy.ldexp(numpy.full(8, wire_scale(scale, dtype), dtype=dtype),
                       e_k - numpy.arange(8, dtype=numpy.int32))
    return numpy.concatenate([mags, -mags])


def wire_scale(scale, dtype):
    """A FMT_POW2 ``scale`` as receivers decode it (float32, the header
    word), in ``dtype``: what a sender that keeps a residual subtracts."""
    return numpy.dtype(dtype).type(numpy.float32(scale))


def pow2_group(tensor_id, words, e_k, scale=1.0):
    """A FMT_POW2 group from words made by :func:`pow2_encode`."""
    return Group(int(tensor_id), FMT_POW2, int(words.size),
                 int(e_k) & 0xFFFFFFFF, f32_bits(scale), words)


# ---- the format's functions (see chainer_vgc.codec.header) ------------------

def pow2_header(g):
    """(e_k, float32 scale) of a FMT_POW2 header."""
    return (int(numpy.uint32(g.a).view(numpy.int32)),
            numpy.uint32(g.b).view(numpy.float32))


def _pow2_decode(g, size, dtype, xp):
    e_k, scale = pow2_header(g)
    checked_pow2_table(g, e_k, scale, dtype)
    index, value = pow2_decode(g.body, e_k, scale, dtype)
    check_index(index, size, g)
    return index, value


def checked_pow2_table(g, e_k, scale, dtype):
    """The 16 values of a FMT_POW2 or FMT_GAP group in ``dtype``, all
    finite and nonzero (else :class:`~chainer_vgc.codec.header.WireFormatError`)."""
    fi = numpy.finfo(dtype)
    if not (numpy.isfinite(scale) and scale > 0
            and fi.minexp <= e_k <= fi.maxexp - 1):
        raise WireFormatError(where(g) + 'exponent {} or scale {} out of '
                              'range for {}'.format(e_k, scale, dtype))
    # every value is one of these 16: check them, not each value
    table = pow2_table(e_k, scale, dtype)
    if not (numpy.isfinite(table).all() and (table != 0).all()):
        raise WireFormatError(where(g) + 'values out of range')
    return table


def _pow2_values(g, size, dtype, xp):
    e_k, scale = pow2_header(g)
    return pow2_decode(g.body, e_k, scale, dtype)


def _indexed_body_words(g, head):
    return 3 * g.count


def _indexed_values(g, size, dtype, xp):
    """FMT_INDEXED (internal): count FMT_POW2 words (index bits 0), then
    count int64 indices; the values by the FMT_POW2 decoder."""
    e_k, scale = pow2_header(g)
    _, value = pow2_decode(g.body[:g.count], e_k, scale, dtype)
    # a copy: an int64 view must start on an 8-byte boundary
    index = g.body[g.count:].copy().view(numpy.int64)
    return index, value


def _not_on_the_wire(g, size, dtype, xp):
    raise WireFormatError(where(g) + 'internal format on the wire')


FORMAT = WireFormat(
    FMT_POW2, 'pow2', a='e_k (int32)', b='float32 bits of scale',
    body='count words sign(1) | d(3) | index(28); value = '
         'sign * scale * 2**(e_k - d)',
    body_words=lambda g, head: g.count, check=no_check,
    decode=_pow2_decode, values=_pow2_values)

#: never sent, refused on the wire
INDEXED_FORMAT = WireFormat(
    FMT_INDEXED, 'indexed (internal)', a='e_k (int32)',
    b='float32 bits of scale',
    body='count FMT_POW2 words (index bits 0), then count int64 indices',
    body_words=_indexed_body_words, check=no_check,
    decode=_not_on_the_wire, values=_indexed_values)
