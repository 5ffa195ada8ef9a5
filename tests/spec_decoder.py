"""A decoder and validator of the wire format written from
docs/wire_format.md alone (it imports nothing of chainer_vgc), element by
element and slowly: the test oracle that the specification is enough to
implement the format from (tests/test_wire_spec.py compares it with
chainer_vgc.codec.unpack on real and corrupted messages).

:func:`decode` returns ``[(tensor_id, indices, values)]`` in message order
(a FMT_GAP group spanning tensors gives one entry per tensor it reaches),
values in each tensor's state dtype, or raises :class:`Invalid`.
"""

import math
import struct

import numpy

# the constants table of the specification (Sec. 3)
MAGIC = 0x31434756
FMT_POW2, FMT_RAW, FMT_QSGD, FMT_GAP, FMT_SPARSE = 1, 2, 3, 4, 5
SPARSE_FLOAT32 = 1
RAW_DENSE, RAW_FLOAT64 = 1, 2
GAP_ESCAPE = 16
GAP_SIGN_ONLY = 0x40
GAP_RESTARTS = 0x80  # param bit 7: a restart table follows (Sec. 4.5)
GAP_SPAN_SHIFT = 8
GAP_RESTART_CODES = 1024


class Invalid(Exception):
    """The message breaks a validation rule of the specification."""


def f32(word):
    return struct.unpack('<f', struct.pack('<I', word))[0]


def f64(low, high):
    """A float64 stored low word first."""
    return struct.unpack('<d', struct.pack('<II', low, high))[0]


def state_dtype(dtype):
    """float16 tensors decode into float32 (Sec. 5.1)."""
    return numpy.float64 if numpy.dtype(dtype) == numpy.float64 \
        else numpy.float32


def bit(words, p):
    """Bit p of an LSB-first bit string (Sec. 2)."""
    return (words[p >> 5] >> (p & 31)) & 1


def field(words, p, n):
    """The n-bit field at bit p, its first bit the least significant."""
    return sum(bit(words, p + i) << i for i in range(n))


def pow2_table(a, b, dtype):
    """The 16 values of a FMT_POW2 / FMT_GAP group: entry sign << 3 | d is
    (-1)**sign * scale * 2**(e_k - d), every one finite and nonzero."""
    e_k = a - (1 << 32) if a >= 1 << 31 else a
    scale = numpy.float32(f32(b))
    info = numpy.finfo(dtype)
    if not (numpy.isfinite(scale) and scale > 0
            and info.minexp <= e_k <= info.maxexp - 1):
        raise Invalid('e_k or scale')
    with numpy.errstate(all='ignore'):
        half = [numpy.ldexp(dtype(scale), e_k - d) for d in range(8)]
    table = half + [-v for v in half]
    if not all(numpy.isfinite(v) and v != 0 for v in table):
        raise Invalid('value table')
    return table


def check_indices(index, size):
    if any(j <= i for i, j in zip(index, index[1:])) or (
            index and index[-1] >= size):
        raise Invalid('indices not increasing or out of range')


def restart_points(count):
    """R, the restart points of a FMT_GAP group (Sec. 4.5): one every 1024
    codes, none before the first."""
    return (count - 1) // GAP_RESTART_CODES


def gap_indices(stream, count, k, size, table=()):
    """The indices of a gap stream (Sec. 4.5): per element, q in unary
    (q zeros and a one) or, after GAP_ESCAPE zeros, Elias gamma of
    q - GAP_ESCAPE + 1; then k low bits; gap = q << k | low.  ``table``:
    the restart table's words; code 1024 m must start at bit P_m, after
    index I_m (V26)."""
    n_bits, p, prev, index = 32 * len(stream), 0, -1, []
    for j in range(count):
        if j and j % GAP_RESTART_CODES == 0:
            e = table[4 * (j // GAP_RESTART_CODES - 1):]
            if (e[0] + (e[1] << 32), e[2] + (e[3] << 32)) != (p, prev):
                raise Invalid('restart point not where its code starts')
        zeros = 0
        while True:
            if p + zeros >= n_bits:
                raise Invalid('a code runs past the stream')
            if bit(stream, p + zeros):
                break
            zeros += 1
        p += zeros + 1
        if zeros < GAP_ESCAPE:
            q = zeros
        else:
            n = zeros - GAP_ESCAPE
            if n >= 64:
                raise Invalid('gamma prefix of 64 zeros or more')
            if p + n > n_bits:
                raise Invalid('a code runs past the stream')
            q = ((1 << n) | field(stream, p, n)) - 1 + GAP_ESCAPE
            p += n
        if p + k > n_bits:
            raise Invalid('a code runs past the stream')
        gap = (q << k) | field(stream, p, k)
        p += k
        if prev + 1 + gap >= size:
            raise Invalid('index past the span')
        prev += 1 + gap
        index.append(prev)
    if -(-p // 32) != len(stream) or any(bit(stream, i)
                                         for i in range(p, n_bits)):
        raise Invalid('stream not the exact words, or padding not zero')
    return index


def body_length(m, pos, fmt, count, a, b, size):
    if fmt == FMT_POW2:
        return count
    if fmt == FMT_RAW:
        if a & ~(RAW_DENSE | RAW_FLOAT64):
            raise Invalid('raw flags')
        if a & RAW_DENSE and count != size:
            raise Invalid('dense count')
        return (0 if a & RAW_DENSE else count) + count * (
            2 if a & RAW_FLOAT64 else 1)
    if fmt == FMT_QSGD:
        if a == 0 or a > count or b & 0xffffff == 0 or b >> 24 == 0:
            raise Invalid('qsgd header')
        return 4 * a + count
    if fmt == FMT_GAP:
        value_bits = 1 if m[pos] & GAP_SIGN_ONLY else 4
        return (2 + 4 * restart_points(count) + m[pos + 1]
                + -(-count * value_bits // 32))
    if fmt == FMT_SPARSE:  # (Sec. 4.8: FMT_GAP's codes, then V values)
        if b & ~SPARSE_FLOAT32:
            raise Invalid('sparse flags')
        if pos + 2 > len(m):
            raise Invalid('truncated body')
        return (2 + 4 * restart_points(count) + m[pos + 1]
                + (count if b & SPARSE_FLOAT32 else -(-count // 2)))
    raise Invalid('format code')


def decode(message, sizes, dtypes):
    m = [int(w) for w in message]
    if len(m) < 2 or m[0] != MAGIC:
        raise Invalid('magic')
    pos, last, out = 2, -1, []
    for _ in range(m[1]):
        if pos + 5 > len(m):
            raise Invalid('truncated header')
        tid, fmt, count, a, b = m[pos:pos + 5]
        pos += 5
        if tid <= last:
            raise Invalid('tensor ids not increasing')
        span = 0
        if fmt == FMT_GAP:
            if pos + 2 > len(m):
                raise Invalid('truncated body')
            span = m[pos] >> GAP_SPAN_SHIFT
        last = tid + span
        if last >= len(sizes):
            raise Invalid('no such tensor')
        size = sum(sizes[tid:last + 1])
        if count == 0 or count > size:
            raise Invalid('count')
        length = body_length(m, pos, fmt, count, a, b, size)
        if pos + length > len(m):
            raise Invalid('truncated body')
        body = m[pos:pos + length]
        pos += length
        dtype = state_dtype(dtypes[tid])
        if fmt == FMT_POW2:
            table = pow2_table(a, b, dtype)
            index = [w & 0xfffffff for w in body]
            check_indices(index, size)
            out.append((tid, index, [table[w >> 28] for w in body]))
        elif fmt == FMT_RAW:
            out.append(_raw(tid, body, count, a, size, dtype))
        elif fmt == FMT_QSGD:
            out.append(_qsgd(tid, body, count, a, b, size, dtype))
        elif fmt == FMT_SPARSE:
            out.append(_sparse(tid, body, count, a, b, size, dtype))
        else:
            out.extend(_gap(tid, last, body, count, a, b, sizes, dtypes))
    if pos != len(m):
        raise Invalid('words after the last group')
    return out


def _raw(tid, body, count, a, size, dtype):
    index = list(range(size)) if a & RAW_DENSE else body[:count]
    values = body[0 if a & RAW_DENSE else count:]
    if a & RAW_FLOAT64:
        wire = [f64(values[2 * j], values[2 * j + 1]) for j in range(count)]
    else:
        wire = [f32(w) for w in values]
    if not all(math.isfinite(v) for v in wire):
        raise Invalid('raw value not finite')
    with numpy.errstate(all='ignore'):
        cast = [dtype(v) for v in wire]
    if not all(numpy.isfinite(v) for v in cast):
        raise Invalid('raw value overflows the state dtype')
    check_indices(index, size)
    return tid, index, cast


def _qsgd(tid, body, count, a, b, size, dtype):
    """Records (bucket id, count, float64 scale: 4 words each) first, then
    the element words, assigned to the records in order."""
    levels, bucket = b >> 24, b & 0xffffff
    records = [body[4 * r:4 * r + 4] for r in range(a)]
    ids = [r[0] for r in records]
    counts = [r[1] for r in records]
    scales = [f64(r[2], r[3]) for r in records]
    if (sum(counts) != count or 0 in counts
            or any(j <= i for i, j in zip(ids, ids[1:]))
            or ids[-1] * bucket >= size
            or not all(math.isfinite(s) and s > 0 for s in scales)):
        raise Invalid('qsgd records')
    words, j, index, values = body[4 * a:], 0, [], []
    for bucket_id, n, scale in zip(ids, counts, scales):
        for w in words[j:j + n]:
            offset, level = w & 0x7fffff, (w >> 23) & 0xff
            if offset >= bucket or level > levels:
                raise Invalid('qsgd offset or level')
            with numpy.errstate(all='ignore'):
                v = dtype(-(level * scale) if w >> 31 else level * scale)
            if not numpy.isfinite(v):
                raise Invalid('qsgd value overflows the state dtype')
            index.append(bucket_id * bucket + offset)
            values.append(v)
        j += n
    check_indices(index, size)
    return tid, index, values


def _gap(tid, last, body, count, a, b, sizes, dtypes):
    param, n_stream = body[0], body[1]
    if bool(param & GAP_RESTARTS) != (restart_points(count) > 0):
        raise Invalid('param bit 7 disagrees with the restart table')
    k, sign_only = param & 63, param & GAP_SIGN_ONLY
    size = sum(sizes[tid:last + 1])
    t = 4 * restart_points(count)
    index = gap_indices(body[2 + t:2 + t + n_stream], count, k, size,
                        body[2:2 + t])
    value_words, width = body[2 + t + n_stream:], 1 if sign_only else 4
    nibbles = [field(value_words, width * j, width) << (3 if sign_only
                                                        else 0)
               for j in range(count)]
    if any(bit(value_words, i)
           for i in range(width * count, 32 * len(value_words))):
        raise Invalid('value padding not zero')
    out, offset = [], 0
    for t in range(tid, last + 1):
        mine = [(i - offset, n) for i, n in zip(index, nibbles)
                if offset <= i < offset + sizes[t]]
        if mine:  # each tensor reached is checked in its own state dtype
            table = pow2_table(a, b, state_dtype(dtypes[t]))
            out.append((t, [i for i, _ in mine], [table[n] for _, n in mine]))
        offset += sizes[t]
    return out


def _sparse(tid, body, count, a, b, size, dtype):
    """FMT_SPARSE (Sec. 4.8): FMT_GAP's param word (no SIGN_ONLY, no
    span), G, restart table and codes, then float16 (two a word, padding
    0) or float32 values; each times 2**x (``a``) in the state dtype."""
    param, G = body[0], body[1]
    if param & GAP_SIGN_ONLY or param >> GAP_SPAN_SHIFT:
        raise Invalid('sparse param word')
    if bool(param & GAP_RESTARTS) != (count > GAP_RESTART_CODES):
        raise Invalid('restart flag')
    r = restart_points(count)
    stream = body[2 + 4 * r:2 + 4 * r + G]
    if G < 1:
        raise Invalid('a code runs past the stream')
    values = body[2 + 4 * r + G:]
    if b & SPARSE_FLOAT32:
        wire = [f32(w) for w in values]
    else:
        halves = [(w >> (16 * (j & 1))) & 0xFFFF
                  for j, w in ((j, values[j >> 1]) for j in range(count))]
        if count % 2 and values[-1] >> 16:
            raise Invalid('value padding')
        wire = [struct.unpack('<e', struct.pack('<H', h))[0]
                for h in halves]
    index = gap_indices(stream, count, param & 63, size, body[2:2 + 4 * r])
    x = a - (1 << 32) if a >= 1 << 31 else a
    if not all(math.isfinite(w) for w in wire):
        raise Invalid('sparse value not finite')
    with numpy.errstate(all='ignore'):
        value = [numpy.ldexp(dtype(w), x) for w in wire]
    if not all(numpy.isfinite(v) for v in value):
        raise Invalid('sparse value out of range')
    return tid, index, value
