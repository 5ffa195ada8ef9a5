"""FMT_SPARSE (beyond the paper): unquantized values at gap-coded indices,
the message of top-k methods (``dgc``).

``a`` = x, an int32 exponent; ``b`` = flags (bit 0,
:data:`.SPARSE_FLOAT32`: the values are float32, else float16; the other
bits 0).  Body: FMT_GAP's index part (a param word with the Rice
parameter k and the restart flag, its SIGN_ONLY bit and span 0; ``G``; the
restart table; ``G`` words of gap codes: :mod:`chainer_vgc.codec.gap`),
then the values, ``ceil(count / 2)`` words of float16 (element j in bits
``16 (j mod 2)`` and up of word ``j // 2``, a zero half after an odd
count) or ``count`` words of float32.  Element value: the wire value
times ``2**x``, computed in the receiving state dtype, where it must be
finite.

The encoder (:func:`sparse_group`) picks x so that the largest value
sent, divided by ``2**x``, lies in [2**14, 2**15): float16 holds it with
its full 11 bits and never overflows.  The value a rule sends is then not
its own: :func:`sparse_group` returns what the receivers will decode,
for the rule to keep the difference (DGC keeps it in its residual, so the
rounding is fed back like everything not sent).
"""

import numpy

from chainer_vgc.backends import arrays
from chainer_vgc.codec.constants import (
    FMT_SPARSE, GAP_PARAM_WORDS, GAP_RESTART_WORDS, GAP_SIGN_ONLY,
    GAP_SPAN_SHIFT, HEADER_WORDS, LOG2_ZERO, SPARSE_FLOAT32)
from chainer_vgc.codec import gap
from chainer_vgc.codec.header import (
    Group, WireFormat, WireFormatError, where)
from chainer_vgc.codec.pow2 import floor_log2
from chainer_vgc.codec.restarts import gap_restarts

#: float16 holds the largest value sent, scaled, in [2**14, 2**15)
FLOAT16_TOP = 14


def sparse_value_words(count, flags):
    """Words of the values of a FMT_SPARSE group of ``count`` elements."""
    return count if flags & SPARSE_FLOAT32 else -(-count // 2)


def sparse_scale(values):
    """x, the exponent of a float16 group's scale, for ``values`` (state
    dtype, nonzero): floor(log2 max ``|v|``) - 14; None when every value is
    zero or subnormal in its dtype."""
    e = floor_log2(numpy.abs(values).max())
    return None if e == LOG2_ZERO else e - FLOAT16_TOP


def sparse_group(tensor_id, index, values, size, float32=False):
    """``(group, sent)``: a FMT_SPARSE group of ``values`` (state dtype)
    at the sorted unique ``index`` of a tensor of ``size`` elements, and
    the values its receivers decode, in the state dtype (equal to
    ``values`` with ``float32`` and float32 values; else rounded).
    Elements whose value rounds to zero are left out of both (``sent``
    is zero there): ``(None, sent)`` when none is left.  NumPy arrays
    (a CuPy rule sends its arrays through the host)."""
    xp = arrays.get_array_module(values)
    index = arrays.to_numpy(index).astype(numpy.int64).reshape(-1)
    values = arrays.to_numpy(values).reshape(-1)
    dtype = values.dtype
    if float32 and dtype == numpy.float32:
        x, wire = 0, values.astype(numpy.float32)
    else:
        x = sparse_scale(values) if values.size else None
        if x is None:  # nothing representable: nothing sent
            return None, xp.zeros(values.shape, dtype)
        with numpy.errstate(over='ignore', under='ignore'):
            scaled = numpy.ldexp(values, -x)
            wire = scaled.astype(numpy.float32 if float32 else numpy.float16)
    sent = numpy.ldexp(wire.astype(dtype), x).astype(dtype)
    keep = wire != 0
    flags = SPARSE_FLOAT32 if float32 else 0
    if not keep.any():
        return None, xp.asarray(numpy.zeros_like(sent))
    if not keep.all():
        sent = numpy.where(keep, sent, dtype.type(0))
        index, wire = index[keep], wire[keep]
    count = int(index.size)
    if float32:
        value_words = wire.view(numpy.uint32)
    else:
        halves = numpy.zeros(2 * sparse_value_words(count, flags),
                             numpy.uint16)
        halves[:count] = wire.view(numpy.uint16)
        value_words = halves.view('<u4').astype(numpy.uint32)
    body = gap.gap_index_words(index, gap.rice_parameter(count, size), 0,
                               value_words)
    return (Group(int(tensor_id), FMT_SPARSE, count, int(x) & 0xFFFFFFFF,
                  flags, body), xp.asarray(sent))


def sparse_max_words(size, float32):
    """The most words (header included) :func:`sparse_group` gives for a
    tensor of ``size`` elements (a fast path's ``max_words``): the gap
    codes take less than 2.4 bits per tensor element with the encoder's k
    (:func:`chainer_vgc.codec.index_coding.pow2_max_words` says why),
    the restart table 4 words per 1,024 elements, the values one or half
    a word each."""
    return (HEADER_WORDS + GAP_PARAM_WORDS + 2 + (3 * size + 31) // 32
            + GAP_RESTART_WORDS * gap_restarts(size)
            + sparse_value_words(size, SPARSE_FLOAT32 if float32 else 0))


# ---- the format's functions (see chainer_vgc.codec.header) ------------------

def _int32(a):
    return int(a) - (1 << 32) if int(a) & 0x80000000 else int(a)


def _sparse_check(g, size):
    if g.b & ~SPARSE_FLOAT32:
        raise WireFormatError(where(g) + 'unknown FMT_SPARSE flags')


def _sparse_body_words(g, head):
    if len(head) < GAP_PARAM_WORDS:
        raise WireFormatError(where(g) + 'truncated in the FMT_SPARSE '
                              'param words')
    return (GAP_PARAM_WORDS + GAP_RESTART_WORDS * gap_restarts(g.count)
            + int(head[1]) + sparse_value_words(g.count, g.b))


def sparse_decode_body(g, size):
    """``(index int64, wire values)`` of a FMT_SPARSE group read from a
    message (host words): its param word, the values' padding, then its
    codes checked (the order of the specification's rule V27)."""
    body = numpy.asarray(arrays.to_numpy(g.body), dtype=numpy.uint32)
    if body.size and int(body[0]) & (GAP_SIGN_ONLY | (0xFFFFFF <<
                                                      GAP_SPAN_SHIFT)):
        raise WireFormatError(where(g) + 'FMT_SPARSE param word with the '
                              'SIGN_ONLY bit or a span')
    n_values = sparse_value_words(g.count, g.b)
    words = numpy.ascontiguousarray(body[body.size - n_values:], '<u4') \
        if body.size >= n_values else numpy.zeros(0, '<u4')
    if not g.b & SPARSE_FLOAT32 and g.count % 2 and words.size and \
            int(words[-1]) >> 16:
        raise WireFormatError(where(g) + 'nonzero padding after the values')
    index, first = gap.gap_decode_indices(
        body, g.count, size, n_values, where(g) + 'FMT_SPARSE body: ')
    if g.b & SPARSE_FLOAT32:
        return index, words.view(numpy.float32)
    return index, words.view(numpy.uint16)[:g.count].view(numpy.float16)


def _sparse_values(g, size, dtype, xp):
    """(index, value in ``dtype``): the wire value times 2**x."""
    index, wire = sparse_decode_body(g, size)
    with numpy.errstate(over='ignore', invalid='ignore', under='ignore'):
        value = numpy.ldexp(wire.astype(dtype), _int32(g.a)).astype(dtype)
    return index, value, wire


def _sparse_decode(g, size, dtype, xp):
    """Every value must be finite as sent and times 2**x in ``dtype``."""
    index, value, wire = _sparse_values(g, size, dtype, xp)
    if not (numpy.isfinite(wire).all() and numpy.isfinite(value).all()):
        raise WireFormatError(
            where(g) + 'a FMT_SPARSE value is not finite as sent or times '
            '2**{} in {}'.format(_int32(g.a), numpy.dtype(dtype)))
    return xp.asarray(index), xp.asarray(value)


FORMAT = WireFormat(
    FMT_SPARSE, 'sparse', a='x (int32): the values are scaled by 2**x',
    b='flags: SPARSE_FLOAT32 (float32 values, else float16)',
    body="FMT_GAP's param word (k, restarts; no SIGN_ONLY, span 0), G, "
         'the restart table, G words of gap codes, then the values: '
         'float16 (two a word) or float32',
    body_words=_sparse_body_words, check=_sparse_check,
    decode=_sparse_decode, values=None)
