"""Codec: quantization (Sec. 4.2, 4.4), packing into 32-bit words, unpacking.

Wire message (a 1-D ``uint32`` array, little-endian words)::

    MAGIC, n_groups, group_0, group_1, ...

Only tensors that send something are in a group (one group per tensor,
except that a FMT_GAP group may span several consecutive tensors).  Each
group is a 5-word header ``tensor_id, format, count, a, b`` followed by a
body whose length follows from the header (FMT_GAP: and its first two body
words).  The formats are the entries of :data:`FORMATS` (one
:class:`WireFormat` each: code, meaning of ``a`` and ``b``, body length,
header checks, checked decoder, unchecked device decoder):

``FMT_POW2`` (VGC quantization, Strom, hybrid)
    ``a`` = e_k (int32), ``b`` = float32 bits of ``scale``; body: ``count``
    words ``sign(1) | d(3) | index(28)``.  Element value =
    ``sign * scale * 2**(e_k - d)`` (VGC: scale 1; Strom/hybrid: e_k 0,
    d 0, scale tau).  This is the paper's one word per element; the 28-bit
    index limits a tensor to 2**28 elements.
``FMT_RAW`` (quantization off, ``none``)
    ``a`` = flags (bit 0: dense, no index words; bit 1: float64 values);
    body: ``count`` index words (unless dense), then the values as float32
    (1 word) or float64 (2 words, copied out on decode for alignment).
``FMT_QSGD``
    ``a`` = number of bucket records, ``b`` = ``levels << 24 | bucket_size``;
    body: records ``bucket_id, count, float64 scale`` then ``count`` words
    ``sign(1) | level(8) | offset-in-bucket(23)``; value =
    ``sign * level * scale``.
``FMT_GAP`` (the elements of ``FMT_POW2``, indices gap-coded; beyond the
    paper)
    ``a``, ``b`` as ``FMT_POW2``; body: a param word (bits 0-5: the Rice
    parameter k; bit 6, :data:`GAP_SIGN_ONLY`: one value bit, the sign,
    and d = 0; bit 7: 0; bits 8-31: the span, the number of tensors after
    ``tensor_id`` the group also covers, in one index space, their
    concatenation, see :func:`merge_spans`), ``G``, then ``G`` words of
    gap codes, then the values, ``ceil(count * vbits / 32)`` words of 4-bit fields
    ``sign << 3 | d`` (the top 4 bits of the ``FMT_POW2`` word) or 1-bit
    signs.  Bit strings are LSB-first: bit p is ``(w[p >> 5] >> (p & 31))
    & 1``.  Gap j is ``i_j - i_{j-1} - 1`` (``i_{-1} = -1``), coded with
    ``q = gap >> k``: q zeros and a one (q < :data:`GAP_ESCAPE`), or
    GAP_ESCAPE zeros then the Elias-gamma code of ``q - GAP_ESCAPE + 1``
    (n zeros, a one, the n bits below its top bit); then the k low bits of
    the gap.  ``G`` is exactly the words the codes fill, padding bits are
    0: for given k, value width and span, the elements have one encoding
    (:func:`gap_body`).  No limit on the tensor size; at most 2**32 - 1
    elements per group.

:func:`unpack` checks every field against the receiving model (tensor ids,
counts, body lengths, exponents and scales, indices in range and strictly
increasing, levels, and every value it would write finite in the receiving
state dtype: a finite float64 raw value or QSGD ``level * scale`` may
overflow float32) and raises :class:`WireFormatError` instead of reading out
of bounds or decoding garbage.

The constants the C++/CUDA sources also define (``#define VGC_...``) are
listed once, in :data:`C_CONSTANTS`; :func:`check_kernel_constants` compares
a source text with them, and the native backend compares its compiled ones.
"""

import ast
import bisect
import collections
import re

import numpy

from chainer_vgc import backend
from chainer_vgc import kernels

MAGIC = 0x31434756  # b'VGC1' read as a little-endian uint32
FMT_POW2 = 1
FMT_RAW = 2
FMT_QSGD = 3
HEADER_WORDS = 5

INDEX_BITS = 28
MAX_INDEX = 1 << INDEX_BITS  # elements per tensor in FMT_POW2
MAX_D = 7
RAW_DENSE = 1
RAW_FLOAT64 = 2
QSGD_OFFSET_BITS = 23
MAX_QSGD_BUCKET = 1 << QSGD_OFFSET_BITS
QSGD_RECORD_WORDS = 4  # bucket id, count, float64 scale
FMT_GAP = 4
GAP_PARAM_WORDS = 2  # param word (k, flags), gap-stream length
GAP_K_MASK = 0x3F
GAP_SIGN_ONLY = 1 << 6  # param flag: one value bit (the sign), d = 0
GAP_RESERVED = 1 << 7  # param bit that must be 0
GAP_SPAN_SHIFT = 8  # param bits 8-31: further tensors the group covers
MAX_GAP_SPAN = (1 << 24) - 1
#: groups of more elements are never merged into spans (their 7-word
#: overhead is under 0.25 bit an element; re-encoding them would cost more
#: time than it saves wire)
MERGE_MAX_COUNT = 1024
GAP_ESCAPE = 16  # unary zeros before the Elias-gamma escape
GAP_MAX_K = 62
MAX_COUNT = (1 << 32) - 1  # the header's count is one word
#: index codings of the pow2 elements (``index_coding`` of vgc, hybrid,
#: strom); the native backend takes the position in this tuple
CODINGS = ('auto', 'fixed', 'gap')
LOG2_ZERO = -(1 << 30)  # same sentinel as VGC_LOG2_ZERO in the kernels

#: the constants above under the names the C++/CUDA sources ``#define``
#: them (``kernels/vgc_host.cpp``, ``kernels/vgc_numerics.cuh``)
C_CONSTANTS = collections.OrderedDict([
    ('VGC_MAGIC', MAGIC),
    ('VGC_FMT_POW2', FMT_POW2),
    ('VGC_FMT_RAW', FMT_RAW),
    ('VGC_FMT_QSGD', FMT_QSGD),
    ('VGC_HEADER_WORDS', HEADER_WORDS),
    ('VGC_INDEX_BITS', INDEX_BITS),
    ('VGC_INDEX_MASK', MAX_INDEX - 1),
    ('VGC_MAX_D', MAX_D),
    ('VGC_LOG2_ZERO', LOG2_ZERO),
    ('VGC_RAW_DENSE', RAW_DENSE),
    ('VGC_RAW_FLOAT64', RAW_FLOAT64),
    ('VGC_QSGD_OFFSET_BITS', QSGD_OFFSET_BITS),
    ('VGC_QSGD_RECORD_WORDS', QSGD_RECORD_WORDS),
    ('VGC_FMT_GAP', FMT_GAP),
    ('VGC_GAP_ESCAPE', GAP_ESCAPE),
    ('VGC_GAP_SIGN_ONLY', GAP_SIGN_ONLY),
    ('VGC_GAP_PARAM_WORDS', GAP_PARAM_WORDS),
    ('VGC_GAP_RESERVED', GAP_RESERVED),
    ('VGC_GAP_SPAN_SHIFT', GAP_SPAN_SHIFT),
])
#: the ones ``kernels/vgc_numerics.cuh`` (the CuPy kernels' source) defines
KERNEL_CONSTANTS = ('VGC_LOG2_ZERO', 'VGC_INDEX_BITS', 'VGC_INDEX_MASK',
                    'VGC_MAX_D', 'VGC_GAP_ESCAPE')

_TRAITS = {
    # dtype: (unsigned view, mantissa bits, bias, sign shift)
    numpy.dtype(numpy.float32): (numpy.uint32, 23, 127, 31),
    numpy.dtype(numpy.float64): (numpy.uint64, 52, 1023, 63),
}


class WireFormatError(ValueError):
    """A received message is truncated, corrupt or from another model."""


Group = collections.namedtuple(
    'Group', ['tensor_id', 'fmt', 'count', 'a', 'b', 'body', 'span'],
    defaults=(0,))
Group.__doc__ = (
    'One tensor\'s part of a message (or, FMT_GAP, a span of tensors): the '
    'header fields and the body words '
    '(built by the ``*_group`` functions for :func:`pack`; a view of the '
    'received message when read back; ``span``: the further tensors a '
    'FMT_GAP group covers, as read back).')

Decoded = collections.namedtuple('Decoded', ['tensor_id', 'index', 'value'])


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
    """floor(log2 |x|) of a scalar by truncating the mantissa (Sec. 4.4).

    Returns :data:`LOG2_ZERO` for 0 and subnormal values.  A device scalar
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


# ---- FMT_POW2: quantization and group builders -------------------------------

def pow2_encode(values, index, e_k):
    """Quantize ``values`` against e_k and pack them with ``index``.

    Each |value| above 2**e_k is truncated to 2**e_k, any other is rounded
    to the nearer power of two by the float bit trick (add the mantissa's top
    bit, mask the mantissa; ties 1.5 * 2**e round up), and
    ``d = e_k - log2 |value'|``.  Returns ``(words, ok)``: ``ok`` is False
    where d > 7 or the value is 0 or subnormal; such elements get word 0 and
    must not be sent.  CuPy input runs the ``vgc_pow2_encode`` kernel.
    """
    xp = backend.get_array_module(values)
    if backend.is_cupy(xp):
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
    xp = backend.get_array_module(words)
    if backend.is_cupy(xp):
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
                 int(e_k) & 0xFFFFFFFF, _f32_bits(scale), words)


def pow2_sign_group(tensor_id, sign, tau, dtype, coding='auto'):
    """The group of ``sign * tau`` (e_k 0, d 0, scale tau: Strom, hybrid)
    for the nonzero entries of ``sign`` (+1, -1, 0), or None when there is
    none; ``dtype`` is the state dtype, ``coding`` as
    :func:`pow2_best_group` (gap-coded: one value bit per element)."""
    xp = backend.get_array_module(sign)
    index = xp.nonzero(sign)[0]
    if index.size == 0:
        return None
    words, _ = pow2_encode(sign[index].astype(dtype), index, 0)
    return pow2_best_group(tensor_id, words, index, 0, tau, sign.size,
                           coding=coding, sign_only=True)


# ---- FMT_RAW and FMT_QSGD group builders ------------------------------------

def raw_group(tensor_id, index, values, size):
    """Unquantized values; dense (no index words) when all ``size`` are sent.

    ``values`` must be float32 or float64; ``index`` sorted, unique.
    """
    xp = backend.get_array_module(values)
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


def qsgd_group(tensor_id, level, negative, scales, bucket_size, levels):
    """Pack QSGD levels (0..levels) of one tensor, bucket by bucket.

    ``level``/``negative`` are per element (flattened tensor), ``scales`` the
    per-bucket ``norm / levels`` (sent as float64).
    """
    xp = backend.get_array_module(level)
    nz = xp.nonzero(level)[0]
    bucket = nz // bucket_size
    offset = (nz - bucket * bucket_size).astype(numpy.uint32)
    ids, counts = _run_lengths(bucket, xp)
    records = xp.concatenate(
        [ids.astype(numpy.uint32)[:, None], counts.astype(numpy.uint32)[:, None],
         scales[ids].astype(numpy.float64).view(numpy.uint32).reshape(-1, 2)],
        axis=1).reshape(-1)
    words = ((negative[nz].astype(numpy.uint32) << numpy.uint32(31))
             | (level[nz].astype(numpy.uint32) << numpy.uint32(
                 QSGD_OFFSET_BITS))
             | offset)
    return Group(int(tensor_id), FMT_QSGD, int(nz.size), int(ids.size),
                 (int(levels) << 24) | int(bucket_size),
                 xp.concatenate([records, words]))


def _run_lengths(sorted_values, xp):
    if sorted_values.size == 0:
        empty = xp.zeros(0, dtype=numpy.int64)
        return empty, empty
    starts = xp.concatenate([xp.ones(1, dtype=bool),
                             sorted_values[1:] != sorted_values[:-1]])
    pos = xp.nonzero(starts)[0]
    counts = xp.diff(xp.concatenate(
        [pos, xp.full(1, sorted_values.size, dtype=pos.dtype)]))
    return sorted_values[pos], counts


# ---- FMT_GAP: gap-coded indices (beyond the paper) ---------------------------
# The paper's word spends 28 bits on the index; at the densities VGC reaches
# (1 element in 200-5000) a gap carries ~8-12 bits of information.  A
# Golomb-Rice code with the parameter set from the tensor's density is the
# optimal prefix code for geometric gaps (Gallager & van Voorhis 1975); the
# Elias-gamma escape bounds the cost of the rare huge gap (clustered
# selections) to O(log gap) bits.  These functions are the readable
# reference; the native backend and the CuPy kernels produce the same words.

def rice_parameter(count, size):
    """The Rice parameter k of a tensor of ``size`` elements sending
    ``count``: floor(log2(ln 2 * mean gap)), the optimum for geometric gaps,
    in integers (11/16 for ln 2) so that every backend picks the same k."""
    count, size = int(count), int(size)
    if not 0 < count <= size:
        raise ValueError('rice_parameter: need 0 < count <= size, got {} '
                         'and {}'.format(count, size))
    t = (11 * (size - count)) // (16 * count)
    return min(t.bit_length() - 1, GAP_MAX_K) if t >= 1 else 0


def _bit_length(v):
    """Elementwise bit length of non-negative int64 ``v`` (0 for 0)."""
    v = numpy.array(v, dtype=numpy.int64)
    n = numpy.zeros(v.shape, dtype=numpy.int64)
    for shift in (32, 16, 8, 4, 2, 1):
        big = v >= (numpy.int64(1) << shift)
        n[big] += shift
        v[big] >>= shift
    return n + (v > 0)


def _gaps(index):
    index = numpy.asarray(index, dtype=numpy.int64).reshape(-1)
    return numpy.diff(index, prepend=numpy.int64(-1)) - 1


def gap_code_lengths(gaps, k):
    """Bits of each gap's code (unary or escape, then k low bits)."""
    q = numpy.asarray(gaps, dtype=numpy.int64) >> k
    n = _bit_length(numpy.maximum(q - GAP_ESCAPE + 1, 1)) - 1
    return numpy.where(q < GAP_ESCAPE, q + 1, GAP_ESCAPE + 2 * n + 1) + k


def _bits_to_words(bits):
    """uint32 words of an LSB-first bit string (0/1 uint8), zero-padded."""
    nwords = -(-bits.size // 32)
    padded = numpy.zeros(32 * nwords, dtype=numpy.uint8)
    padded[:bits.size] = bits
    return numpy.packbits(padded, bitorder='little').view('<u4').astype(
        numpy.uint32)


def _words_to_bits(words):
    return numpy.unpackbits(
        numpy.ascontiguousarray(words, dtype='<u4').view(numpy.uint8),
        bitorder='little')


def gap_body(index, nibbles, k, sign_only, span=0):
    """The FMT_GAP body of sorted unique ``index`` with value fields
    ``nibbles`` (``sign << 3 | d``; ``sign_only``: d must be 0 and only the
    sign is sent), Rice parameter ``k``; ``span``: further tensors the
    indices run over (param bits 8-31).  CuPy input runs the kernels
    (:func:`chainer_vgc.kernels.gap_body`)."""
    if not 0 <= int(span) <= MAX_GAP_SPAN:
        raise ValueError('gap_body: span must be in 0..2**24 - 1')
    if backend.is_cupy(backend.get_array_module(index)):
        body = kernels.gap_body(index, nibbles, k, sign_only)
        if span:
            body[:1] |= numpy.uint32(int(span) << GAP_SPAN_SHIFT)
        return body
    k = int(k)
    if not 0 <= k <= GAP_K_MASK:
        raise ValueError('gap_body: k must be in 0..63, got {}'.format(k))
    gaps = _gaps(index)
    if gaps.size and int(gaps.min()) < 0:
        raise ValueError('gap_body: indices must be sorted and unique')
    q = gaps >> k
    escaped = q >= GAP_ESCAPE
    lengths = gap_code_lengths(gaps, k)
    starts = numpy.cumsum(lengths) - lengths
    bits = numpy.zeros(int(lengths.sum()), dtype=numpy.uint8)
    # unary codes: q zeros, a one
    bits[(starts + q)[~escaped]] = 1
    # escapes: GAP_ESCAPE zeros, then n zeros, a one, the n bits below v's
    # top bit (v = q - GAP_ESCAPE + 1); rare, so one at a time
    for j in numpy.flatnonzero(escaped):
        v = int(q[j]) - GAP_ESCAPE + 1
        n = v.bit_length() - 1
        at = int(starts[j]) + GAP_ESCAPE + n
        bits[at] = 1
        for b in range(n):
            bits[at + 1 + b] = (v >> b) & 1
    # the k low bits end every code
    low_at = starts + lengths - k
    for b in range(k):
        bits[low_at + b] = (gaps >> b) & 1
    stream = _bits_to_words(bits)
    nib = numpy.asarray(nibbles).astype(numpy.uint8).reshape(-1)
    if sign_only:
        vbits = (nib >> 3) & 1
    else:
        vbits = ((nib[:, None] >> numpy.arange(4, dtype=numpy.uint8))
                 & 1).reshape(-1)
    values = _bits_to_words(vbits.astype(numpy.uint8))
    if stream.size > 0xFFFFFFFF:
        raise ValueError('gap_body: {} words of gap codes; a group holds at '
                         'most 2**32 - 1'.format(stream.size))
    param = (k | (GAP_SIGN_ONLY if sign_only else 0)
             | int(span) << GAP_SPAN_SHIFT)
    return numpy.concatenate([
        numpy.array([param, stream.size], dtype=numpy.uint32), stream,
        values])


def _gap_value_words(count, param):
    vbits = 1 if param & GAP_SIGN_ONLY else 4
    return -(-count * vbits // 32)


def gap_decode_body(body, count, size):
    """Decode and check a FMT_GAP body (host words) of ``count`` elements
    of a tensor of ``size``: ``(index int64, nibbles uint8)``.  Raises
    :class:`WireFormatError` on reserved bits, a code running past the
    stream, an Elias-gamma prefix of 64 zeros or more, a gap past the end
    of the tensor, a stream longer than its codes or nonzero padding.
    ``size``: of the group's index space (its span's total; the span bits
    of the param word are the caller's)."""
    body = numpy.asarray(body, dtype=numpy.uint32).reshape(-1)
    where = 'chainer_vgc wire message, FMT_GAP body: '
    if body.size < GAP_PARAM_WORDS:
        raise WireFormatError(where + 'truncated')
    param, n_stream = int(body[0]), int(body[1])
    if param & GAP_RESERVED:
        raise WireFormatError(where + 'reserved bit set in the param word')
    k = param & GAP_K_MASK
    n_values = _gap_value_words(count, param)
    if body.size != GAP_PARAM_WORDS + n_stream + n_values:
        raise WireFormatError(where + '{} words, the header says {}'.format(
            body.size, GAP_PARAM_WORDS + n_stream + n_values))
    stream = body[GAP_PARAM_WORDS:GAP_PARAM_WORDS + n_stream]
    nbits = 32 * n_stream
    bits = _words_to_bits(stream)
    ones = numpy.flatnonzero(bits).tolist()
    padded = stream.tolist() + [0, 0, 0]

    def field(at, n):  # the n bits (n < 64) from bit `at`, LSB first
        w, shift = at >> 5, at & 31
        x = padded[w] | (padded[w + 1] << 32) | (padded[w + 2] << 64)
        return (x >> shift) & ((1 << n) - 1)

    index = numpy.empty(count, dtype=numpy.int64)
    pos, prev = 0, -1
    for j in range(count):
        t = bisect.bisect_left(ones, pos)
        one = ones[t] if t < len(ones) else nbits
        if one >= nbits:
            raise WireFormatError(where + 'code {} runs past the gap stream'
                                  .format(j))
        zeros = one - pos
        if zeros < GAP_ESCAPE:
            q, pos = zeros, one + 1
        else:
            n = zeros - GAP_ESCAPE
            if n >= 64:
                raise WireFormatError(where + 'Elias-gamma prefix of {} '
                                      'zeros'.format(n))
            if one + 1 + n > nbits:
                raise WireFormatError(where + 'code {} runs past the gap '
                                      'stream'.format(j))
            q = ((1 << n) | field(one + 1, n)) - 1 + GAP_ESCAPE
            pos = one + 1 + n
        if pos + k > nbits:
            raise WireFormatError(where + 'code {} runs past the gap stream'
                                  .format(j))
        gap = (q << k) | field(pos, k)
        pos += k
        if gap >= size - prev - 1:
            raise WireFormatError(where + 'gap {} overruns the tensor of {} '
                                  'elements'.format(j, size))
        prev += 1 + gap
        index[j] = prev
    if -(-pos // 32) != n_stream or bits[pos:].any():
        raise WireFormatError(where + 'gap stream longer than its codes or '
                              'nonzero padding (non-canonical)')
    vbits = _words_to_bits(body[GAP_PARAM_WORDS + n_stream:])
    if param & GAP_SIGN_ONLY:
        used = count
        nibbles = vbits[:count] << 3
    else:
        used = 4 * count
        nibbles = (vbits[:used].reshape(count, 4)
                   << numpy.arange(4, dtype=numpy.uint8)).sum(
                       axis=1, dtype=numpy.uint8)
    if vbits[used:].any():
        raise WireFormatError(where + 'nonzero padding after the values')
    return index, nibbles.astype(numpy.uint8)


def pow2_max_words(size, coding):
    """Most words (header included) :func:`pow2_best_group` gives for a
    tensor of ``size`` elements.  FMT_GAP's codes take at most
    ``count * (k + 2) + (size - count) / 2**k`` bits (an escape is never
    more than one bit longer than the unary code it replaces), which the
    k of :func:`rice_parameter` keeps below 2.4 bits per tensor element;
    the value fields take at most 4."""
    fixed = HEADER_WORDS + size
    gap = HEADER_WORDS + GAP_PARAM_WORDS + 2 + (7 * size + 31) // 32
    if coding == 'fixed':
        return fixed
    if coding == 'auto' and size <= MAX_INDEX:
        return fixed  # FMT_GAP only when shorter
    return gap


def pow2_best_group(tensor_id, words, index, e_k, scale, size,
                    coding='auto', sign_only=False):
    """The group of FMT_POW2 ``words`` (from :func:`pow2_encode`; only their
    top 4 bits are read when gap-coded) at ``index`` (sorted, unique,
    int64: any tensor size) of a tensor of ``size`` elements.

    ``coding``: ``'fixed'`` (the paper's word, FMT_POW2), ``'gap'``
    (FMT_GAP) or ``'auto'``: FMT_GAP when its body is shorter, or when
    ``size`` exceeds the 28-bit index (ties go to FMT_POW2).
    ``sign_only``: every d is 0 (Strom, hybrid), one value bit per element.
    """
    if coding not in CODINGS:
        raise ValueError('index_coding must be one of {}, got {!r}'.format(
            CODINGS, coding))
    count = int(words.size)
    if count > MAX_COUNT:
        raise ValueError('{} elements sent from one tensor in one step; the '
                         'wire format carries at most 2**32 - 1'.format(count))
    if coding == 'fixed':
        if size > MAX_INDEX:
            raise ValueError('index_coding=\'fixed\' addresses at most '
                             '2**28 elements per tensor, got {}'.format(size))
        return pow2_group(tensor_id, words, e_k, scale)
    nibbles = words >> numpy.uint32(INDEX_BITS)
    body = gap_body(index, nibbles, rice_parameter(count, size), sign_only)
    if coding == 'auto' and size <= MAX_INDEX and body.size >= count:
        return pow2_group(tensor_id, words, e_k, scale)
    return Group(int(tensor_id), FMT_GAP, count, int(e_k) & 0xFFFFFFFF,
                 _f32_bits(scale), body)


# ---- the wire formats --------------------------------------------------------
# Each format's functions take a Group ``g`` read from a message (``g.body``:
# its body words, host or device):
#   body_words(g, head)        body length in words, from the header and
#                              ``head``: the first body words present (at
#                              most GAP_PARAM_WORDS; fewer if truncated)
#   check(g, size)             header checks (``size``: the receiving tensor's
#                              elements, a FMT_GAP span's total, None when
#                              unknown)
#   decode(g, size, dtype, xp) (index, value in ``dtype``), every word and
#                              value checked (:func:`unpack`; None: FMT_GAP,
#                              which unpack decodes and splits itself)
#   values(g, size, dtype, xp) (index or None when the group is dense, value
#                              in ``dtype`` or as sent), nothing checked and
#                              nothing read back (:func:`add_validated`;
#                              None: FMT_GAP, expanded first by expand_gap)

WireFormat = collections.namedtuple(
    'WireFormat', ['code', 'name', 'a', 'b', 'body', 'body_words', 'check',
                   'decode', 'values'])
WireFormat.__doc__ = ('One wire format: its code and name, the meaning of '
                      'header fields ``a``, ``b`` and of the body, and its '
                      'functions (see the comment above this class).')


def _where(g):
    return 'chainer_vgc wire message, group for tensor {}: '.format(
        g.tensor_id)


def _no_check(g, size):
    pass


def _pow2_header(g):
    """(e_k, float32 scale) of a FMT_POW2 header."""
    return (int(numpy.uint32(g.a).view(numpy.int32)),
            numpy.uint32(g.b).view(numpy.float32))


def _pow2_decode(g, size, dtype, xp):
    e_k, scale = _pow2_header(g)
    _checked_pow2_table(g, e_k, scale, dtype)
    index, value = pow2_decode(g.body, e_k, scale, dtype)
    _check_index(index, size, g)
    return index, value


def _checked_pow2_table(g, e_k, scale, dtype):
    """The 16 values of a FMT_POW2 or FMT_GAP group in ``dtype``, all
    finite and nonzero (else :class:`WireFormatError`)."""
    fi = numpy.finfo(dtype)
    if not (numpy.isfinite(scale) and scale > 0
            and fi.minexp <= e_k <= fi.maxexp - 1):
        raise WireFormatError(_where(g) + 'exponent {} or scale {} out of '
                              'range for {}'.format(e_k, scale, dtype))
    # every value is one of these 16: check them, not each value
    table = pow2_table(e_k, scale, dtype)
    if not (numpy.isfinite(table).all() and (table != 0).all()):
        raise WireFormatError(_where(g) + 'values out of range')
    return table


def _pow2_values(g, size, dtype, xp):
    e_k, scale = _pow2_header(g)
    return pow2_decode(g.body, e_k, scale, dtype)


def _raw_check(g, size):
    if g.a & ~(RAW_DENSE | RAW_FLOAT64):
        raise WireFormatError(_where(g) + 'unknown raw flags')
    if g.a & RAW_DENSE and size is not None and g.count != size:
        raise WireFormatError(_where(g) + 'dense group with {} of {} '
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
    _check_finite(value, wire, g, dtype, xp)
    if index is None:
        index = xp.arange(size, dtype=numpy.int64)
    else:
        _check_index(index, size, g)
    return index, value


def _qsgd_check(g, size):
    if (g.a == 0 or g.a > g.count or (g.b & 0xFFFFFF) == 0
            or (g.b >> 24) == 0):
        raise WireFormatError(_where(g) + 'bad QSGD header')


def _qsgd_body_words(g, head):
    return QSGD_RECORD_WORDS * g.a + g.count


def _qsgd_split(g):
    """(records as rows of 4 words, offset and level (int64), negative
    (bool)) of a FMT_QSGD body."""
    n_rec = g.a
    rec = g.body[:QSGD_RECORD_WORDS * n_rec].reshape(n_rec,
                                                     QSGD_RECORD_WORDS)
    words = g.body[QSGD_RECORD_WORDS * n_rec:]
    offset = (words & numpy.uint32(MAX_QSGD_BUCKET - 1)).astype(numpy.int64)
    level = ((words >> numpy.uint32(QSGD_OFFSET_BITS))
             & numpy.uint32(0xFF)).astype(numpy.int64)
    return rec, offset, level, (words >> numpy.uint32(31)) != 0


def _qsgd_decode(g, size, dtype, xp):
    levels, bucket = g.b >> 24, g.b & 0xFFFFFF
    rec, offset, level, negative = _qsgd_split(g)
    host = backend.to_numpy(rec)
    ids, counts = host[:, 0].astype(numpy.int64), host[:, 1].astype(numpy.int64)
    scales = numpy.ascontiguousarray(host[:, 2:]).view(numpy.float64)[:, 0]
    if (int(counts.sum()) != g.count or (counts == 0).any()
            or (numpy.diff(ids) <= 0).any() or ids[-1] * bucket >= size
            or not (numpy.isfinite(scales) & (scales > 0)).all()):
        raise WireFormatError(_where(g) + 'bad QSGD bucket records')
    if bool((offset >= bucket).any()) or bool((level > levels).any()):
        raise WireFormatError(_where(g) + 'QSGD offset or level out of range')
    per_word = xp.asarray(numpy.repeat(numpy.arange(g.a), counts))
    index = xp.asarray(ids)[per_word] * bucket + offset
    # level * scale in float64, then cast: both steps may overflow
    with numpy.errstate(over='ignore', invalid='ignore'):
        mag = level * xp.asarray(scales)[per_word]
        value = xp.where(negative, -mag, mag)
        value = value.astype(dtype)
    _check_finite(value, None, g, dtype, xp)
    _check_index(index, size, g)
    return index, value


def _qsgd_values(g, size, dtype, xp):
    """value = sign * level * scale in float64, computed where the body
    lives (no record is read back), cast to the state dtype by the caller,
    as :func:`_qsgd_decode` does."""
    bucket = g.b & 0xFFFFFF
    rec, offset, level, negative = _qsgd_split(g)
    ids = rec[:, 0].astype(numpy.int64)
    ends = xp.cumsum(rec[:, 1].astype(numpy.int64))
    # a copy: the float64 view must start on an 8-byte boundary (the body
    # may start at any word; a GPU faults on a misaligned load)
    scales = rec[:, 2:].copy().view(numpy.float64).reshape(-1)
    per_word = xp.searchsorted(ends, xp.arange(g.count, dtype=numpy.int64),
                               side='right')
    index = ids[per_word] * bucket + offset
    mag = level * scales[per_word]  # float64: no flushing on a GPU
    return index, xp.where(negative, -mag, mag)


def _gap_body_words(g, head):
    if len(head) < GAP_PARAM_WORDS:
        raise WireFormatError(_where(g) + 'truncated in the FMT_GAP param '
                              'words')
    return (GAP_PARAM_WORDS + int(head[1])
            + _gap_value_words(g.count, int(head[0])))


def _indexed_body_words(g, head):
    return 3 * g.count


def _indexed_values(g, size, dtype, xp):
    """FMT_INDEXED (internal): count FMT_POW2 words (index bits 0), then
    count int64 indices; the values by the FMT_POW2 decoder."""
    e_k, scale = _pow2_header(g)
    _, value = pow2_decode(g.body[:g.count], e_k, scale, dtype)
    # a copy: an int64 view must start on an 8-byte boundary
    index = g.body[g.count:].copy().view(numpy.int64)
    return index, value


def _not_on_the_wire(g, size, dtype, xp):
    raise WireFormatError(_where(g) + 'internal format on the wire')


#: code -> :class:`WireFormat`
FORMATS = collections.OrderedDict((f.code, f) for f in [
    WireFormat(FMT_POW2, 'pow2',
               a='e_k (int32)', b='float32 bits of scale',
               body='count words sign(1) | d(3) | index(28); value = '
                    'sign * scale * 2**(e_k - d)',
               body_words=lambda g, head: g.count, check=_no_check,
               decode=_pow2_decode, values=_pow2_values),
    WireFormat(FMT_RAW, 'raw',
               a='flags: RAW_DENSE (no index words), RAW_FLOAT64', b='0',
               body='count index words (unless dense), then count float32 '
                    'or float64 values',
               body_words=_raw_body_words, check=_raw_check,
               decode=_raw_decode, values=_raw_values),
    WireFormat(FMT_QSGD, 'qsgd',
               a='number of bucket records',
               b='levels << 24 | bucket size',
               body='records (bucket id, count, float64 scale), then count '
                    'words sign(1) | level(8) | offset-in-bucket(23); value '
                    '= sign * level * scale',
               body_words=_qsgd_body_words, check=_qsgd_check,
               decode=_qsgd_decode, values=_qsgd_values),
    WireFormat(FMT_GAP, 'gap',
               a='e_k (int32)', b='float32 bits of scale',
               body='param word (k | SIGN_ONLY | span << 8), G, G words of '
                    'gap codes, then the value fields (4-bit sign << 3 | d, '
                    'or 1-bit sign); value as FMT_POW2',
               body_words=_gap_body_words, check=_no_check,
               # unpack decodes it itself (a group may span tensors) and
               # the device adds it once expand_gap made it FMT_INDEXED
               decode=None, values=None),
])

#: FMT_GAP groups as the GPU decoder receives them (:func:`expand_gap`):
#: never sent, refused on the wire
FMT_INDEXED = 0x100 | FMT_GAP
INTERNAL_FORMATS = {FMT_INDEXED: WireFormat(
    FMT_INDEXED, 'indexed (internal)', a='e_k (int32)',
    b='float32 bits of scale',
    body='count FMT_POW2 words (index bits 0), then count int64 indices',
    body_words=_indexed_body_words, check=_no_check,
    decode=_not_on_the_wire, values=_indexed_values)}


# ---- message ----------------------------------------------------------------

def pack(groups, xp=numpy):
    """Concatenate groups (tensor ids strictly increasing) into a message.

    The message is always a host (NumPy) array: it is what MPI sends.  Groups
    with CuPy bodies are assembled in host memory with one download: the
    bodies are concatenated on the device and copied once into a pinned
    buffer; the headers are written on the host.
    """
    last = -1
    for g in groups:
        if g.tensor_id <= last:
            raise ValueError('pack: tensor ids must increase, got {} after '
                             '{}'.format(g.tensor_id, last))
        last = g.tensor_id + g.span
    total = 2 + sum(HEADER_WORDS + int(g.body.size) for g in groups)
    message = numpy.empty(total, dtype=numpy.uint32)
    message[0], message[1] = MAGIC, len(groups)
    bodies = [g.body for g in groups if g.body.size]
    if backend.is_cupy(xp) and bodies:
        with backend.device_scope(bodies[0]):
            # (a host body, from a model partly on the CPU, is uploaded)
            flat = xp.concatenate([xp.asarray(b).astype(numpy.uint32,
                                                        copy=False)
                                   for b in bodies])
        staged = backend.host_buffer(flat.size, numpy.uint32)
        flat.get(out=staged)
        bodies, start = [], 0
        for g in groups:
            bodies.append(staged[start:start + g.body.size])
            start += g.body.size
    else:
        bodies = [g.body for g in groups]
    pos = 2
    for g, body in zip(groups, bodies):
        message[pos:pos + HEADER_WORDS] = (g.tensor_id, g.fmt, g.count, g.a,
                                           g.b)
        pos += HEADER_WORDS
        message[pos:pos + body.size] = body
        pos += body.size
    return message


def message_count(message):
    """Number of elements a message carries (sum of group counts)."""
    return sum(g.count for g in _walk(backend.to_numpy(message), None))


def unpack(message, sizes, dtypes):
    """Decode a message for a model whose tensors have ``sizes``/``dtypes``.

    Returns a list of :class:`Decoded` ``(tensor_id, index, value)``; values
    are in the state dtype of each tensor.  CuPy messages are decoded on the
    device (headers are read on the host).
    """
    xp = backend.get_array_module(message)
    out = []
    for g in _walk(backend.to_numpy(message), sizes, message):
        if g.fmt == FMT_GAP:  # decoded on the host, split over its span
            e_k, scale = _pow2_header(g)
            for t, index, nibbles in _span_parts(g, sizes):
                table = _checked_pow2_table(
                    g, e_k, scale, backend.state_dtype(dtypes[t]))
                out.append(Decoded(t, xp.asarray(index),
                                   xp.asarray(table[nibbles])))
            continue
        index, value = FORMATS[g.fmt].decode(
            g, sizes[g.tensor_id], backend.state_dtype(dtypes[g.tensor_id]),
            xp)
        out.append(Decoded(g.tensor_id, index, value))
    return out


def decode_into(message, outs, sizes=None):
    """Add every element of ``message`` into the flat arrays ``outs``.

    Returns the number of elements added.
    """
    sizes = [o.size for o in outs] if sizes is None else sizes
    n = 0
    for i, o in enumerate(outs):
        if not o.flags.c_contiguous:
            raise ValueError('decode_into: output array {} is not '
                             'C-contiguous; pass contiguous arrays'.format(i))
    for dec in unpack(message, sizes, [o.dtype for o in outs]):
        flat = outs[dec.tensor_id].reshape(-1)
        # indices are unique: gather, add, scatter back, by the subnormal
        # rule on a GPU (CuPy's own += and astype flush subnormals)
        part = flat[dec.index]
        kernels.add_into(part, kernels.cast(dec.value, flat.dtype))
        flat[dec.index] = part
        n += int(dec.index.size)
    return n


def add_validated(host, device, outs, sizes):
    """Add every element of a message into the flat arrays ``outs`` on the
    device, reading the headers from the host copy ``host`` and the bodies
    from ``device`` (the same words, uploaded once).  The message must have
    been validated first (:func:`unpack` or the native decoder): nothing is
    checked here, so no device value is read back.  The sums are those of
    :func:`decode_into`, bit for bit.  Returns the number of elements."""
    xp = backend.get_array_module(device)
    n = 0
    for g in _walk(host, sizes, device, internal=True):
        out = outs[g.tensor_id]
        form = FORMATS.get(g.fmt) or INTERNAL_FORMATS[g.fmt]
        if form.values is None:
            raise ValueError('add_validated: {} groups are decoded on the '
                             'host first; pass the message through '
                             'expand_gap'.format(form.name))
        index, value = form.values(g, sizes[g.tensor_id], out.dtype, xp)
        value = kernels.cast(value, out.dtype)
        if index is None:  # dense
            kernels.add_into(out, value)
        else:  # indices are unique: gather, add, scatter back
            part = out[index]
            kernels.add_into(part, value)
            out[index] = part
        n += g.count
    return n


def _span_parts(g, sizes, decoder=None):
    """``[(tensor_id, index, nibbles)]`` of a FMT_GAP group read by
    :func:`_walk`, its indices (in the concatenation of the tensors of its
    span) split over those tensors, local to each; tensors without
    elements are left out.  A FMT_POW2 group is one part, read from its
    words.  ``decoder``: see :func:`expand_gap`."""
    if g.fmt == FMT_POW2:
        return [(g.tensor_id,
                 (g.body & numpy.uint32(MAX_INDEX - 1)).astype(numpy.int64),
                 (g.body >> numpy.uint32(INDEX_BITS)).astype(numpy.uint8))]
    body = numpy.array(backend.to_numpy(g.body), dtype=numpy.uint32)
    body[0] &= numpy.uint32((1 << GAP_SPAN_SHIFT) - 1)  # the span is ours
    tids = range(g.tensor_id, g.tensor_id + g.span + 1)
    bounds = numpy.cumsum([0] + [sizes[t] for t in tids])
    got = (decoder or gap_decode_body)(body, g.count, int(bounds[-1]))
    if got is None:  # a fast decoder refused it: the reference says why
        got = gap_decode_body(body, g.count, int(bounds[-1]))
    index, nibbles = got
    cuts = numpy.searchsorted(index, bounds)
    return [(t, index[lo:hi] - base, nibbles[lo:hi])
            for t, lo, hi, base in zip(tids, cuts[:-1], cuts[1:], bounds)
            if hi > lo]


def merge_spans(message, sizes, decoder=None, encoder=None):
    """The message with each maximal run of consecutive FMT_POW2/FMT_GAP
    groups of at most :data:`MERGE_MAX_COUNT` elements each that share
    ``a`` and ``b`` (e_k and scale: one value table) re-encoded as one
    FMT_GAP group over the tensors from the run's first to its last (its
    span), when that is strictly shorter; ``message`` itself when nothing
    got shorter.  The group's header costs 7 words or
    more: at hybrid's and Strom's late-run densities (a few dozen elements
    a tensor) that is several bits per element, which one group per
    message saves.  SIGN_ONLY when every element has d = 0.
    ``decoder``/``encoder``: fast equivalents of :func:`gap_decode_body`
    and :func:`gap_body` (the native backend's)."""
    groups = list(_walk(message, sizes))
    runs, changed = [], False
    def mergeable(g):
        return g.fmt in (FMT_POW2, FMT_GAP) and g.count <= MERGE_MAX_COUNT
    for g in groups:
        if (runs and mergeable(g) and mergeable(runs[-1][-1])
                and (g.a, g.b) == (runs[-1][-1].a, runs[-1][-1].b)):
            runs[-1].append(g)
        else:
            runs.append([g])
    out = []
    for run in runs:
        merged = _merged(run, sizes, decoder, encoder) if len(run) > 1 \
            else None
        if merged is None:
            out.extend(run)
        else:
            out.append(merged)
            changed = True
    return pack(out) if changed else message


def _merged(run, sizes, decoder, encoder):
    """One FMT_GAP group for ``run`` (see :func:`merge_spans`), or None when
    it would not be shorter."""
    first, last = run[0].tensor_id, run[-1].tensor_id + run[-1].span
    offsets = numpy.cumsum([0] + list(sizes[first:last + 1]))
    index, nibbles = [], []
    for g in run:
        for t, i, n in _span_parts(g, sizes, decoder):
            index.append(i + offsets[t - first])
            nibbles.append(n)
    index, nibbles = numpy.concatenate(index), numpy.concatenate(nibbles)
    count = int(index.size)
    if count > MAX_COUNT or last - first > MAX_GAP_SPAN:
        return None
    sign_only = not (nibbles & 7).any()
    k = rice_parameter(count, int(offsets[-1]))
    body = (encoder or gap_body)(index, nibbles, k, sign_only)
    body[0] |= numpy.uint32((last - first) << GAP_SPAN_SHIFT)
    if HEADER_WORDS + body.size >= sum(HEADER_WORDS + g.body.size
                                       for g in run):
        return None
    return Group(first, FMT_GAP, count, run[0].a, run[0].b, body,
                 last - first)


def expand_gap(message, sizes, decoder=None):
    """A validated host ``message`` with every FMT_GAP group rewritten as
    FMT_INDEXED (pow2 words and int64 indices: what the device adds from,
    see :func:`add_validated`); ``message`` itself when it has none.
    ``decoder(body, count, size) -> (index, nibbles)``: default
    :func:`gap_decode_body` (the native backend passes its own)."""
    groups = list(_walk(message, sizes))
    if not any(g.fmt == FMT_GAP for g in groups):
        return message
    out = []
    for g in groups:
        if g.fmt != FMT_GAP:
            out.append(g)
            continue
        for t, index, nibbles in _span_parts(g, sizes, decoder):
            words = nibbles.astype(numpy.uint32) << numpy.uint32(INDEX_BITS)
            out.append(Group(t, FMT_INDEXED, int(index.size), g.a, g.b,
                             numpy.concatenate([words, numpy.ascontiguousarray(
                                 index, dtype='<i8').view(numpy.uint32)])))
    return pack(out)


def _walk(m, sizes, words=None, internal=False):
    """Validate the structure of the host message ``m``; yield a
    :class:`Group` per group, its body a view of ``words`` (the same
    message, e.g. on the device; default ``m``).  ``internal``: accept the
    formats of :data:`INTERNAL_FORMATS` too (:func:`add_validated`)."""
    if m.ndim != 1 or m.dtype != numpy.uint32:
        raise WireFormatError('chainer_vgc wire message must be a 1-D uint32 '
                              'array, got shape {} dtype {}'.format(
                                  m.shape, m.dtype))
    if m.size < 2 or int(m[0]) != MAGIC:
        raise WireFormatError('chainer_vgc wire message: missing header '
                              '(bad magic or fewer than 2 words); the buffer '
                              'is truncated or not a chainer_vgc message')
    words = m if words is None else words
    n_groups = int(m[1])
    pos, last = 2, -1
    for _ in range(n_groups):
        if pos + HEADER_WORDS > m.size:
            raise WireFormatError('chainer_vgc wire message truncated in a '
                                  'group header at word {}'.format(pos))
        g = Group(*(int(w) for w in m[pos:pos + HEADER_WORDS]), body=None)
        pos += HEADER_WORDS
        if g.tensor_id <= last:
            raise WireFormatError(_where(g) + 'tensor ids not increasing')
        span = 0
        if g.fmt == FMT_GAP:  # the param word says how many tensors
            if pos >= m.size:
                raise WireFormatError(_where(g) + 'truncated in the FMT_GAP '
                                      'param words')
            span = int(m[pos]) >> GAP_SPAN_SHIFT
        last = g.tensor_id + span
        if sizes is not None and last >= len(sizes):
            raise WireFormatError(
                _where(g) + 'the model has only {} tensors; sender and '
                'receiver must use the same model'.format(len(sizes)))
        size = (sum(sizes[g.tensor_id:last + 1]) if sizes is not None
                else None)
        if g.count == 0 or (size is not None and g.count > size):
            raise WireFormatError(_where(g) + 'count {} invalid for a tensor '
                                  'of {} elements'.format(g.count, size))
        form = FORMATS.get(g.fmt)
        if form is None and internal:
            form = INTERNAL_FORMATS.get(g.fmt)
        if form is None:
            raise WireFormatError(_where(g) + 'unknown format {}'.format(
                g.fmt))
        form.check(g, size)
        length = form.body_words(g, m[pos:pos + GAP_PARAM_WORDS])
        if pos + length > m.size:
            raise WireFormatError(_where(g) + 'body of {} words runs past the '
                                  'end of the message ({} words); truncated'
                                  .format(length, m.size))
        yield g._replace(body=words[pos:pos + length], span=span)
        pos += length
    if pos != m.size:
        raise WireFormatError('chainer_vgc wire message: {} trailing words '
                              'after {} groups'.format(m.size - pos, n_groups))


def _check_finite(value, wire, g, dtype, xp):
    """``value`` (what the decoder writes, in the state ``dtype``) must be
    finite; ``wire`` (the values as sent, or None) tells a non-finite value
    on the wire from one that overflows ``dtype``."""
    if bool(xp.isfinite(value).all()):
        return
    if wire is not None and not bool(xp.isfinite(wire).all()):
        raise WireFormatError(_where(g) + 'non-finite value')
    raise WireFormatError(_where(g) + 'value out of range for {}'.format(
        numpy.dtype(dtype)))


def _check_index(index, size, g):
    """Indices must be in range and strictly increasing (senders emit them
    sorted and unique; a duplicate would silently lose an addition)."""
    if index.size > 1 and not bool((index[1:] > index[:-1]).all()):
        raise WireFormatError(_where(g) + 'indices not strictly increasing '
                              '(duplicate or unsorted)')
    # increasing, so the last index is the largest
    if index.size and int(index[-1]) >= size:
        raise WireFormatError(_where(g) + 'index {} out of range for a tensor '
                              'of {} elements'.format(int(index[-1]), size))


def _f32_bits(x):
    return int(numpy.array(x, dtype=numpy.float32).view(numpy.uint32))


# ---- constants shared with the C++/CUDA sources ------------------------------

_DEFINE = re.compile(r'^[ \t]*#[ \t]*define[ \t]+(VGC_\w+)[ \t]+(.*)$',
                     re.MULTILINE)
_C_INT = re.compile(r'\b(0[xX][0-9a-fA-F]+|[0-9]+)[uUlL]*\b')
_C_OPS = {
    ast.USub: lambda x: -x, ast.UAdd: lambda x: x, ast.Invert: lambda x: ~x,
    ast.Add: lambda x, y: x + y, ast.Sub: lambda x, y: x - y,
    ast.Mult: lambda x, y: x * y, ast.LShift: lambda x, y: x << y,
    ast.RShift: lambda x, y: x >> y, ast.BitOr: lambda x, y: x | y,
    ast.BitAnd: lambda x, y: x & y, ast.BitXor: lambda x, y: x ^ y,
}


def _c_literal(m):
    digits = m.group(1)
    if digits[:2] in ('0x', '0X'):
        return str(int(digits, 16))
    return str(int(digits, 8 if digits[0] == '0' else 10))


def _c_int(expr):
    """Value of a C integer constant expression (literals with ``u``/``l``
    suffixes, parentheses, unary and binary arithmetic and bit operators,
    taken as mathematical integers), or None for anything else."""
    expr = re.sub(r'/\*.*?\*/|//.*$', ' ', expr).strip()
    try:
        tree = ast.parse(_C_INT.sub(_c_literal, expr), mode='eval').body
    except (SyntaxError, ValueError):  # ValueError: a bad octal literal
        return None

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _C_OPS:
            return _C_OPS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _C_OPS:
            return _C_OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(node)
    try:
        return value(tree)
    except ValueError:
        return None


def check_kernel_constants(source_text, names=KERNEL_CONSTANTS):
    """Check the ``#define VGC_...`` lines of a C++/CUDA source against
    codec: ``source_text`` (``kernels/vgc_numerics.cuh``, as
    :func:`chainer_vgc.kernels.source` reads it, for the default ``names``)
    must define each of ``names`` (keys of :data:`C_CONSTANTS`) as an
    integer constant expression equal to codec's value, every time it
    defines it.

    Returns ``{name: value}``; raises RuntimeError listing every constant
    that is missing, not an integer expression, or different.
    """
    found = collections.OrderedDict()
    problems = []
    for m in _DEFINE.finditer(source_text):
        name, value = m.group(1), _c_int(m.group(2))
        if name not in names:
            continue
        want = C_CONSTANTS[name]
        if value is None:
            problems.append('{} is not an integer constant ({!r})'.format(
                name, m.group(2).strip()))
        elif value != want:
            problems.append('{} = {}, chainer_vgc.codec has {}'.format(
                name, value, want))
        found[name] = value
    problems += ['{} is not defined'.format(n) for n in names
                 if n not in found]
    if problems:
        raise RuntimeError(
            'chainer_vgc: the kernel source and chainer_vgc.codec disagree '
            'on wire-format constants: {}'.format('; '.join(problems)))
    return found
