"""FMT_GAP (the elements of FMT_POW2, indices gap-coded; beyond the paper).

``a``, ``b`` as FMT_POW2; body: a param word (bits 0-5: the Rice parameter
k; bit 6, :data:`.GAP_SIGN_ONLY`: one value bit, the sign, and d = 0; bit 7,
:data:`.GAP_RESTARTS`: a restart table follows; bits 8-31: the span, the
number of tensors after ``tensor_id`` the group also covers, in one index
space, their concatenation, see :func:`chainer_vgc.codec.message.merge_spans`),
``G``, the restart table when there are more than
:data:`.GAP_RESTART_CODES` elements (:mod:`chainer_vgc.codec.restarts`: where
a decoder can start), ``G`` words of gap codes, then the values,
``ceil(count * vbits / 32)`` words of 4-bit fields ``sign << 3 | d`` (the
top 4 bits of the FMT_POW2 word) or 1-bit signs.  Bit strings are
LSB-first: bit p is ``(w[p >> 5] >> (p & 31)) & 1``.  Gap j is ``i_j -
i_{j-1} - 1`` (``i_{-1} = -1``), coded with ``q = gap >> k``: q zeros and a
one (q < :data:`.GAP_ESCAPE`), or GAP_ESCAPE zeros then the Elias-gamma
code of ``q - GAP_ESCAPE + 1`` (n zeros, a one, the n bits below its top
bit); then the k low bits of the gap.  ``G`` is exactly the words the codes
fill, padding bits are 0: for given k, value width and span, the elements
have one encoding (:func:`gap_body`).  No limit on the tensor size; at most
2**32 - 1 elements per group.

The body is built by :func:`gap_body`: the NumPy reference here, or on the
device (CuPy input) by the kernels of :mod:`chainer_vgc.backends.cuda.kernels`
(:func:`device_gap_body`); the native backend produces the same words.
"""

import numpy

from chainer_vgc.backends import arrays
from chainer_vgc.backends.cuda import kernels
from chainer_vgc.codec.constants import (
    FMT_GAP, FMT_POW2, GAP_ESCAPE, GAP_K_MASK, GAP_MAX_K, GAP_PARAM_WORDS,
    GAP_RESTARTS, GAP_RESTART_CODES, GAP_RESTART_WORDS, GAP_SIGN_ONLY,
    GAP_SPAN_SHIFT, INDEX_BITS, MAX_GAP_SPAN, MAX_INDEX)
from chainer_vgc.codec.header import (
    WireFormat, WireFormatError, no_check, where)
from chainer_vgc.codec.restarts import gap_restarts, restart_table

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


def bit_length(v):
    """Elementwise bit length of non-negative int64 ``v`` (0 for 0)."""
    v = numpy.array(v, dtype=numpy.int64)
    n = numpy.zeros(v.shape, dtype=numpy.int64)
    for shift in (32, 16, 8, 4, 2, 1):
        big = v >= (numpy.int64(1) << shift)
        n[big] += shift
        v[big] >>= shift
    return n + (v > 0)


def index_gaps(index):
    index = numpy.asarray(index, dtype=numpy.int64).reshape(-1)
    return numpy.diff(index, prepend=numpy.int64(-1)) - 1


def gap_code_lengths(gaps, k):
    """Bits of each gap's code (unary or escape, then k low bits)."""
    q = numpy.asarray(gaps, dtype=numpy.int64) >> k
    n = bit_length(numpy.maximum(q - GAP_ESCAPE + 1, 1)) - 1
    return numpy.where(q < GAP_ESCAPE, q + 1, GAP_ESCAPE + 2 * n + 1) + k


def bits_to_words(bits):
    """uint32 words of an LSB-first bit string (0/1 uint8), zero-padded."""
    nwords = -(-bits.size // 32)
    padded = numpy.zeros(32 * nwords, dtype=numpy.uint8)
    padded[:bits.size] = bits
    return numpy.packbits(padded, bitorder='little').view('<u4').astype(
        numpy.uint32)


def gap_body(index, nibbles, k, sign_only, span=0):
    """The FMT_GAP body of sorted unique ``index`` with value fields
    ``nibbles`` (``sign << 3 | d``; ``sign_only``: d must be 0 and only the
    sign is sent), Rice parameter ``k``; ``span``: further tensors the
    indices run over (param bits 8-31).  CuPy input runs the kernels
    (:func:`device_gap_body`)."""
    if not 0 <= int(span) <= MAX_GAP_SPAN:
        raise ValueError('gap_body: span must be in 0..2**24 - 1')
    if arrays.is_cupy(arrays.get_array_module(index)):
        body = device_gap_body(index, nibbles, k, sign_only)
        if span:
            body[:1] |= numpy.uint32(int(span) << GAP_SPAN_SHIFT)
        return body
    nib = numpy.asarray(nibbles).astype(numpy.uint8).reshape(-1)
    if sign_only:
        vbits = (nib >> 3) & 1
    else:
        vbits = ((nib[:, None] >> numpy.arange(4, dtype=numpy.uint8))
                 & 1).reshape(-1)
    values = bits_to_words(vbits.astype(numpy.uint8))
    return gap_index_words(index, k, (GAP_SIGN_ONLY if sign_only else 0)
                           | int(span) << GAP_SPAN_SHIFT, values)


def gap_index_words(index, k, flags, values):
    """A body of gap-coded indices (FMT_GAP's, and FMT_SPARSE's): the
    param word (``k``, ``flags``, the restart flag when the table is
    there), ``G``, the restart table and the ``G`` words of gap codes of
    the sorted unique ``index`` (NumPy), then the words ``values``."""
    k = int(k)
    if not 0 <= k <= GAP_K_MASK:
        raise ValueError('gap_body: k must be in 0..63, got {}'.format(k))
    gaps = index_gaps(index)
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
    stream = bits_to_words(bits)
    if stream.size > 0xFFFFFFFF:
        raise ValueError('gap_body: {} words of gap codes; a group holds at '
                         'most 2**32 - 1'.format(stream.size))
    param = (k | int(flags)
             | (GAP_RESTARTS if gap_restarts(index.size) else 0))
    return numpy.concatenate([
        numpy.array([param, stream.size], dtype=numpy.uint32),
        restart_table(starts, index), stream, values])


def gap_value_words(count, param):
    vbits = 1 if param & GAP_SIGN_ONLY else 4
    return -(-count * vbits // 32)


#: the bits of the longest code the decoder reads, less its k low bits:
#: GAP_ESCAPE zeros, then an Elias-gamma code of 63 zeros, a one and 63
#: bits (a longer gamma prefix is refused)
GAP_LONGEST_CODE = GAP_ESCAPE + 63 + 1 + 63


def gap_stream_words(count, k):
    """``(least, most)``: the words that a gap stream of ``count`` codes
    with Rice parameter ``k`` can fill, from 1 + k bits a code (a one and
    the low bits) to :data:`GAP_LONGEST_CODE` + k bits a code."""
    return (-(-count * (1 + k) // 32),
            -(-count * (GAP_LONGEST_CODE + k) // 32))


def gap_decode_body(body, count, size):
    """Decode and check a FMT_GAP body (host words) of ``count`` elements
    of a tensor of ``size``: ``(index int64, nibbles uint8)``.  Raises
    :class:`~chainer_vgc.codec.header.WireFormatError` on a restart flag
    (param bit 7) that disagrees with ``count``, a
    code running past the stream, an Elias-gamma prefix of 64 zeros or
    more, a gap past the end of the tensor, a stream longer than its codes
    or nonzero padding.  ``size``: of the group's index space (its span's
    total; the span bits of the param word are the caller's).

    ``G`` is checked against the words ``count`` codes can fill
    (:func:`gap_stream_words`) before anything is decoded, so a corrupt
    ``G`` costs nothing; then each code is read from a window of the
    stream as one Python int, and at each restart point the bit reached
    and the index before it must be the ones the restart table gives.
    Beyond its output the decoder holds one copy of the stream's bytes and
    a byte a value field."""
    body = numpy.asarray(body, dtype=numpy.uint32).reshape(-1)
    where = 'chainer_vgc wire message, FMT_GAP body: '
    if body.size < GAP_PARAM_WORDS:
        raise WireFormatError(where + 'truncated')
    param = int(body[0])
    index, first = gap_decode_indices(body, count, size,
                                      gap_value_words(count, param), where)
    # a byte a value field: element j's is bits 4j..4j+3 (SIGN_ONLY: bit
    # j) of the value words, a bit string too
    values = numpy.ascontiguousarray(body[first:], dtype='<u4').view(
        numpy.uint8)
    if param & GAP_SIGN_ONLY:
        fields = numpy.unpackbits(values, bitorder='little') << 3
    else:
        fields = numpy.stack([values & 15, values >> 4], axis=1).reshape(-1)
    if fields[count:].any():
        raise WireFormatError(where + 'nonzero padding after the values')
    return index, fields[:count].copy()


def gap_decode_indices(body, count, size, n_values, where):
    """The gap-coded indices of a body of gap codes (FMT_GAP's,
    FMT_SPARSE's: uint32 host words) of ``count`` elements in an index
    space of ``size``, followed by ``n_values`` value words, decoded and
    checked as :func:`gap_decode_body` says: ``(index int64, the word
    where the values start)``.  ``where`` begins its error messages."""
    if body.size < GAP_PARAM_WORDS:
        raise WireFormatError(where + 'truncated')
    param, n_stream = int(body[0]), int(body[1])
    if bool(param & GAP_RESTARTS) != bool(gap_restarts(count)):
        raise WireFormatError(
            where + 'param bit 7 (restart table) is {} for {} elements: it is '
            'set exactly when there are more than {}'.format(
                int(bool(param & GAP_RESTARTS)), count, GAP_RESTART_CODES))
    k = param & GAP_K_MASK
    n_table = GAP_RESTART_WORDS * gap_restarts(count)
    if body.size != GAP_PARAM_WORDS + n_table + n_stream + n_values:
        raise WireFormatError(where + '{} words, the header says {}'.format(
            body.size, GAP_PARAM_WORDS + n_table + n_stream + n_values))
    table = numpy.ascontiguousarray(
        body[GAP_PARAM_WORDS:GAP_PARAM_WORDS + n_table], dtype='<u4').view(
        '<u8').reshape(-1, 2)
    restarts = {GAP_RESTART_CODES * (m + 1): (int(b), int(i))
                for m, (b, i) in enumerate(table)}
    nbits = 32 * n_stream
    least, most = gap_stream_words(count, k)
    if n_stream < least:  # the codes before code j fill the stream
        raise WireFormatError(where + 'code {} runs past the gap stream'
                              .format(nbits // (1 + k)))
    if n_stream > most:
        raise WireFormatError(where + 'gap stream longer than its codes or '
                              'nonzero padding (non-canonical)')
    first = GAP_PARAM_WORDS + n_table
    stream = body[first:first + n_stream]
    # bit p of the stream is bit p & 7 of byte p >> 3
    data = numpy.ascontiguousarray(stream, dtype='<u4').tobytes()

    def bits(at, n):  # the n bits from bit `at`, LSB first (0 past the end)
        first = at >> 3
        x = int.from_bytes(data[first:first + ((at & 7) + n + 7) // 8],
                           'little')
        return (x >> (at & 7)) & ((1 << n) - 1)

    def next_one(at):
        """The first one bit (nbits: none) after a window of zeros from
        `at`, so past the word of `at`: the long runs, refused anyway."""
        later = stream[(at >> 5) + 1:] != 0
        if not later.any():
            return nbits
        w = (at >> 5) + 1 + int(later.argmax())
        word = int(stream[w])
        return 32 * w + (word & -word).bit_length() - 1

    window = GAP_LONGEST_CODE + k  # the longest code the decoder reads
    index = numpy.empty(count, dtype=numpy.int64)
    pos, prev = 0, -1
    for j in range(count):
        if j in restarts and restarts[j] != (pos, prev):
            raise WireFormatError(
                where + 'restart point {} (code {}) gives bit {} and index '
                '{}; the codes before it end at bit {}, index {}'.format(
                    j // GAP_RESTART_CODES, j, restarts[j][0],
                    restarts[j][1], pos, prev))
        x = bits(pos, window)  # code j, if it is one, lies in x
        zeros = (x & -x).bit_length() - 1 if x else next_one(pos) - pos
        if pos + zeros >= nbits:
            raise WireFormatError(where + 'code {} runs past the gap stream'
                                  .format(j))
        if zeros < GAP_ESCAPE:
            q, used = zeros, zeros + 1
        else:
            n = zeros - GAP_ESCAPE
            if n >= 64:
                raise WireFormatError(where + 'Elias-gamma prefix of {} '
                                      'zeros'.format(n))
            used = zeros + 1 + n
            if pos + used > nbits:
                raise WireFormatError(where + 'code {} runs past the gap '
                                      'stream'.format(j))
            field = (x >> (zeros + 1)) & ((1 << n) - 1)
            q = ((1 << n) | field) - 1 + GAP_ESCAPE
        if pos + used + k > nbits:
            raise WireFormatError(where + 'code {} runs past the gap stream'
                                  .format(j))
        gap = (q << k) | ((x >> used) & ((1 << k) - 1))
        pos += used + k
        if gap >= size - prev - 1:
            raise WireFormatError(where + 'gap {} overruns the tensor of {} '
                                  'elements'.format(j, size))
        prev += 1 + gap
        index[j] = prev
    if -(-pos // 32) != n_stream or bits(pos, nbits - pos):
        raise WireFormatError(where + 'gap stream longer than its codes or '
                              'nonzero padding (non-canonical)')
    return index, first + n_stream


# ---- the body on the device (CuPy) ------------------------------------------

def device_gap_body(index, nibbles, k, sign_only):
    """The uint32 FMT_GAP body ``[param, G, restart table, stream (G
    words), values]`` of the sorted unique ``index`` (int64 or int32) and their value nibbles
    (``sign << 3 | d``; with ``sign_only`` only the sign bit 3 is sent),
    Rice parameter ``k``.

    NumPy input: :func:`gap_body`, the reference.  CuPy input (the arrays
    of ``chainer_vgc.backends.arrays``'s array module): built on the device by three
    kernels and one scan, reading back one scalar (the total code bit count,
    which sizes the body):

    1. ``vgc_gap_lengths``: each element's gap and code length;
    2. ``cupy.cumsum`` of the lengths (int64, so exact in any summation
       order): element i's code ends at bit ``end[i]``; the total is
       ``end[-1]``, the one scalar read; the restart table is gathered from
       ``end`` and ``index`` (little-endian words, as the host);
    3. ``vgc_gap_write``: each code ORed into the zeroed stream at
       ``end[i] - length[i]`` (so the padding bits stay 0);
    4. ``vgc_gap_values``: one thread per value word gathers its fields.
    """
    xp = arrays.get_array_module(index)
    if not arrays.is_cupy(xp):
        return gap_body(index, nibbles, k, sign_only)
    k = int(k)
    if not 0 <= k <= 63:
        raise ValueError('Rice parameter k must be in 0..63, got {}'.format(
            k))
    index = xp.ascontiguousarray(index.reshape(-1))
    nibbles = xp.ascontiguousarray(nibbles.reshape(-1))
    count = index.size
    if nibbles.size != count:
        raise ValueError('{} nibbles for {} indices'.format(nibbles.size,
                                                            count))
    if count:
        gap = xp.empty(count, dtype=numpy.int64)
        length = xp.empty(count, dtype=numpy.int64)
        kernels.get_kernel('vgc_gap_lengths')(index, numpy.int32(k), gap,
                                              length)
        end = xp.cumsum(length)
        total = int(end[-1])  # the one device-to-host read
    else:
        total = 0
    stream_words = -(-total // 32)
    value_words = -(-count * (1 if sign_only else 4) // 32)
    n_restarts = gap_restarts(count)
    start = GAP_PARAM_WORDS + GAP_RESTART_WORDS * n_restarts
    body = xp.zeros(start + stream_words + value_words, dtype=numpy.uint32)
    body[0] = (k | (GAP_SIGN_ONLY if sign_only else 0)
               | (GAP_RESTARTS if n_restarts else 0))
    body[1] = stream_words
    if n_restarts:  # code m N starts where code m N - 1 ends
        last = (xp.arange(1, n_restarts + 1) * GAP_RESTART_CODES) - 1
        pairs = xp.stack([end[last], index[last].astype(numpy.int64)],
                         axis=1).astype(numpy.uint64)
        body[GAP_PARAM_WORDS:start] = pairs.view(numpy.uint32).reshape(-1)
    if count:
        kernels.get_kernel('vgc_gap_write')(
            gap, end, numpy.int32(k), body[start:start + stream_words])
        kernels.get_kernel('vgc_gap_values')(
            nibbles, numpy.int64(count), bool(sign_only),
            body[start + stream_words:])
    return body


# ---- reading groups back ----------------------------------------------------

def _gap_body_words(g, head):
    if len(head) < GAP_PARAM_WORDS:
        raise WireFormatError(where(g) + 'truncated in the FMT_GAP param '
                              'words')
    return (GAP_PARAM_WORDS + GAP_RESTART_WORDS * gap_restarts(g.count)
            + int(head[1]) + gap_value_words(g.count, int(head[0])))


def span_parts(g, sizes, decoder=None):
    """``[(tensor_id, index, nibbles)]`` of a FMT_GAP group read by
    :func:`chainer_vgc.codec.message.walk`, its indices (in the
    concatenation of the tensors of its span) split over those tensors,
    local to each; tensors without elements are left out.  A FMT_POW2
    group is one part, read from its words.  ``decoder``: see
    :func:`chainer_vgc.codec.message.expand_gap`."""
    if g.fmt == FMT_POW2:
        return [(g.tensor_id,
                 (g.body & numpy.uint32(MAX_INDEX - 1)).astype(numpy.int64),
                 (g.body >> numpy.uint32(INDEX_BITS)).astype(numpy.uint8))]
    body = numpy.array(arrays.to_numpy(g.body), dtype=numpy.uint32)
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


FORMAT = WireFormat(
    FMT_GAP, 'gap', a='e_k (int32)', b='float32 bits of scale',
    body='param word (k | SIGN_ONLY | span << 8), G, G words of '
         'gap codes, then the value fields (4-bit sign << 3 | d, '
         'or 1-bit sign); value as FMT_POW2',
    body_words=_gap_body_words, check=no_check,
    # unpack decodes it itself (a group may span tensors) and
    # the device adds it once expand_gap made it FMT_INDEXED
    decode=None, values=None)
