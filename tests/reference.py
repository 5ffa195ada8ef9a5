"""Independent oracles shared by the tests.

Everything here is written from the paper and the documented formats, in
plain Python loops over elements, without calling the chainer_vgc functions
it checks:

- :func:`vgc_step`: the paper's Fig. "Basic" for one tensor, with the
  Sec. 4.2 quantization (e_k = floor(log2 max |r|) over the *selected*
  elements, g' = nearest power of two, ties up, truncated at 2**e_k,
  d = e_k - log2 g', d > 7 not sent);
- :func:`decode_group`: the wire format of ``chainer_vgc/codec``'s
  module docstring, one word at a time;
- :func:`parse_message`: the message structure (magic, groups, counts);
- :func:`ring_simulation`: the pipelined ring allgatherv of
  ``chainer_vgc/chainermn/transport.py``'s docstring, word by word with labels;
- :func:`per_example_sqsum`: sum_z (grad_z / B)**2 with one ordinary
  ``loss.backward()`` per example.
"""

import math
import struct

import numpy

MAGIC = 0x31434756  # b'VGC1' little-endian
FMT_POW2, FMT_RAW, FMT_QSGD, FMT_GAP, FMT_SPARSE = 1, 2, 3, 4, 5
MAX_D = 7


# ---- quantization (Sec. 4.2, App. B) ----------------------------------------

def floor_log2(m):
    """floor(log2 m) of a positive finite float, exactly (frexp)."""
    _, ex = math.frexp(float(m))  # m = mant * 2**ex, mant in [0.5, 1)
    return ex - 1


def is_tiny(x, dtype):
    """Zero or subnormal in ``dtype``: never sent."""
    return abs(float(x)) < numpy.finfo(dtype).tiny


def quantize(x, e_k, dtype):
    """The value sent for ``x`` against ``e_k``, or None if not sent.

    |x| is rounded to the nearer of 2**e and 2**(e + 1) (e = floor(log2
    |x|); the tie 1.5 * 2**e goes up), truncated at 2**e_k; d = e_k - its
    exponent must be <= 7.
    """
    if is_tiny(x, dtype):
        return None
    a = abs(float(x))
    e = floor_log2(a)
    if a >= 1.5 * 2.0 ** e:  # exact in binary floating point
        e += 1
    e = min(e, e_k)
    if e_k - e > MAX_D:
        return None
    return math.copysign(2.0 ** e, float(x))


# ---- Fig. "Basic" -----------------------------------------------------------

def vgc_step(g, s, r, v, alpha, zeta, quantize_values=True,
             keep_unrepresentable=False, info=None):
    """One step of Fig. "Basic" on one tensor, element by element.

    ``r``, ``v``: Python lists of NumPy scalars of the state dtype (float32
    for float16/float32 parameters, float64 for float64), updated in place.
    Returns ``(sent, e_k)``: the dense list of values sent (0.0 where
    nothing) and the exponent of the group (None if nothing was selected
    or quantization is off).  ``info`` (a dict): receives ``'r'`` (the
    residuals after accumulation, floats) and ``'selected'`` (indices).
    """
    T = type(r[0])
    alpha, zeta = T(alpha), T(zeta)
    selected = []
    for i in range(len(r)):
        r[i] = T(r[i] + T(g[i]))
        v[i] = T(v[i] + T(s[i]))
        if r[i] * r[i] > alpha * v[i]:  # eq. (4)
            selected.append(i)
        else:
            v[i] = T(v[i] * zeta)
    if info is not None:
        info['r'] = [float(x) for x in r]
        info['selected'] = list(selected)
    sent = [0.0] * len(r)
    if not selected:
        return sent, None
    if not quantize_values:
        for i in selected:
            sent[i] = float(r[i])
            r[i] = v[i] = T(0)
        return sent, None
    biggest = max(abs(float(r[i])) for i in selected)  # selected ones only
    e_k = None if is_tiny(biggest, T) else floor_log2(biggest)
    for i in selected:
        q = None if e_k is None else quantize(r[i], e_k, T)
        if q is not None:
            sent[i] = q
            r[i] = v[i] = T(0)
        elif keep_unrepresentable:
            v[i] = T(v[i] * zeta)  # stays in r, decays like an unselected
        else:
            r[i] = v[i] = T(0)  # the paper's Encode(): dropped
    return sent, e_k


class VGCOracle(object):
    """:func:`vgc_step` over several tensors of one worker (state per
    tensor; a tensor without gradient this step keeps its state)."""

    def __init__(self, sizes, state_dtype, alpha=1.5, zeta=0.999,
                 quantize_values=True, keep_unrepresentable=False):
        T = numpy.dtype(state_dtype).type
        self.r = [[T(0)] * n for n in sizes]
        self.v = [[T(0)] * n for n in sizes]
        self.kw = dict(alpha=alpha, zeta=zeta,
                       quantize_values=quantize_values,
                       keep_unrepresentable=keep_unrepresentable)

    def step(self, grads, sqsums):
        """Dense float64 arrays sent per tensor (None for no gradient);
        ``last_e_k``: each tensor's e_k (None: no group)."""
        out = []
        self.last_e_k = []
        self.last_info = []
        for k, (g, s) in enumerate(zip(grads, sqsums)):
            if g is None:
                out.append(None)
                self.last_e_k.append(None)
                self.last_info.append(None)
                continue
            info = {}
            sent, e_k = vgc_step(numpy.ravel(g).tolist(),
                                 numpy.ravel(s).tolist(), self.r[k],
                                 self.v[k], info=info, **self.kw)
            self.last_info.append(info)
            self.last_e_k.append(e_k if any(sent) else None)
            out.append(numpy.array(sent, dtype=numpy.float64))
        return out


# ---- wire format ------------------------------------------------------------

def _f32(word):
    return struct.unpack('<f', struct.pack('<I', int(word)))[0]


def _f64(lo, hi):
    return struct.unpack('<d', struct.pack('<II', int(lo), int(hi)))[0]


def decode_group(tensor_id, fmt, count, a, b, body, size, sizes=None):
    """(indices, values) of one group, word by word, from the format in
    ``chainer_vgc.codec``'s docstring (values as Python floats, before any cast).

    A FMT_GAP group spanning several tensors (param word bits 8..31, see
    :func:`gap_span`) needs ``sizes`` (the model's tensor sizes; ``size``
    is then unused): its indices are in the concatenated index space of
    tensors ``tensor_id .. tensor_id + span`` (:func:`split_group` maps
    them back to tensors)."""
    body = [int(w) for w in body]
    index, value = [], []
    if fmt in (FMT_POW2, FMT_GAP):
        e_k = struct.unpack('<i', struct.pack('<I', a))[0]
        scale = _f32(b)
        if fmt == FMT_GAP:  # the same elements as FMT_POW2, gap-coded
            span = gap_span(body[0])
            if span:
                assert sizes is not None, 'a span group needs the sizes'
                assert tensor_id + span < len(sizes), 'span past the model'
                size = sum(sizes[tensor_id:tensor_id + span + 1])
            index, nibbles = oracle_decode_body(body, count, size)
        else:
            assert len(body) == count
            index = [w & ((1 << 28) - 1) for w in body]
            nibbles = [w >> 28 for w in body]
        for nib in nibbles:
            sign = -1.0 if nib >> 3 else 1.0
            value.append(sign * scale * 2.0 ** (e_k - (nib & 7)))
    elif fmt == FMT_RAW:
        dense, f64 = a & 1, a & 2
        if dense:
            index = list(range(size))
            vals = body
        else:
            index = body[:count]
            vals = body[count:]
        if f64:
            assert len(vals) == 2 * count
            value = [_f64(vals[2 * i], vals[2 * i + 1]) for i in range(count)]
        else:
            assert len(vals) == count
            value = [_f32(w) for w in vals]
    elif fmt == FMT_SPARSE:  # FMT_GAP's codes, then float16/32 values
        x = struct.unpack('<i', struct.pack('<I', a))[0]
        assert not body[0] & (SIGN_ONLY | 0xFFFFFF00)  # no span
        words = sparse_value_words(count, b)
        index, vals = oracle_decode_codes(body, count, size, words)
        if b & 1:
            wire = [_f32(w) for w in vals]
        else:
            halves = [(w >> s) & 0xFFFF for w in vals for s in (0, 16)]
            assert not halves[count:] or halves[count] == 0
            wire = [struct.unpack('<e', struct.pack('<H', h))[0]
                    for h in halves[:count]]
        try:  # (Python floats: the cast to the state dtype is the caller's)
            value = [math.ldexp(w, x) for w in wire]
        except OverflowError:
            raise Reject('FMT_SPARSE value out of range')
        if not all(math.isfinite(v) for v in value):
            raise Reject('FMT_SPARSE value not finite')
    elif fmt == FMT_QSGD:
        n_rec, bucket = a, b & 0xFFFFFF
        words = body[4 * n_rec:]
        pos = 0
        for k in range(n_rec):
            bid, n, lo, hi = body[4 * k:4 * k + 4]
            scale = _f64(lo, hi)
            for w in words[pos:pos + n]:
                sign = -1.0 if w >> 31 else 1.0
                level = (w >> 23) & 0xFF
                index.append(bid * bucket + (w & ((1 << 23) - 1)))
                value.append(sign * level * scale)
            pos += n
        assert pos == count == len(words)
    else:
        raise AssertionError('unknown format {}'.format(fmt))
    return index, value


def parse_message(words):
    """[(tensor_id, fmt, count, a, b, body words)] of a message, read from
    the layout MAGIC, n_groups, then per group a 5-word header and a body
    whose length follows from the format."""
    words = [int(w) for w in words]
    assert words[0] == MAGIC, hex(words[0])
    pos, out = 2, []
    for _ in range(words[1]):
        tid, fmt, count, a, b = words[pos:pos + 5]
        pos += 5
        length = body_length(fmt, count, a, words[pos:pos + 2], b)
        out.append((tid, fmt, count, a, b, words[pos:pos + length]))
        pos += length
    assert pos == len(words)
    return out


def body_length(fmt, count, a, head, b=0):
    """Words of a group's body, from its header fields and ``head``, the
    first two body words (FMT_GAP, FMT_SPARSE: param word and gap-stream
    length)."""
    if fmt == FMT_POW2:
        return count
    if fmt == FMT_GAP:
        return body_words_needed(head[0], head[1], count)
    if fmt == FMT_SPARSE:
        return 2 + 4 * restarts(count) + head[1] + sparse_value_words(
            count, b)
    if fmt == FMT_RAW:
        return (0 if a & 1 else count) + count * (2 if a & 2 else 1)
    return 4 * a + count


def message_elements(words):
    """Elements a message carries (sum of its groups' counts)."""
    return sum(g[2] for g in parse_message(words))


def covered(tensor_id, fmt, body):
    """The tensor ids a group covers (one, or a FMT_GAP span's run)."""
    span = gap_span(body[0]) if fmt == FMT_GAP and len(body) else 0
    return list(range(tensor_id, tensor_id + span + 1))


def split_index(tensor_id, index, sizes, span):
    """[(tensor id, [(position in the group, local index)])] of indices in
    the concatenated index space of tensors tensor_id .. tensor_id + span,
    one entry per covered tensor (empty lists included)."""
    out, base, j = [], 0, 0
    for t in range(tensor_id, tensor_id + span + 1):
        part = []
        while j < len(index) and index[j] < base + sizes[t]:
            part.append((j, index[j] - base))
            j += 1
        out.append((t, part))
        base += sizes[t]
    assert j == len(index), 'index past the span'
    return out


def split_group(tensor_id, fmt, count, a, b, body, sizes):
    """[(tensor id, indices, values)] of one group, one entry per tensor
    that receives an element (a span group may leave some out)."""
    span = gap_span(int(body[0])) if fmt == FMT_GAP else 0
    index, value = decode_group(tensor_id, fmt, count, a, b, body,
                                sizes[tensor_id], sizes)
    out = []
    for t, part in split_index(tensor_id, index, sizes, span):
        if part:
            out.append((t, [i for _, i in part], [value[j] for j, _ in part]))
    return out


def decode_message(words, sizes):
    """Dense float64 arrays, one per tensor, of what a message carries."""
    outs = [numpy.zeros(n) for n in sizes]
    for group in parse_message(words):
        for tid, index, value in split_group(*group, sizes=sizes):
            for i, x in zip(index, value):
                outs[tid][i] += x
    return outs


# ---- the pipelined ring -----------------------------------------------------

def ring_simulation(counts, chunk_words):
    """The pipelined ring allgatherv with labelled words.

    Rank r's stream to rank r + 1 is its own block, then the blocks it
    receives from r - 1 in the order they arrive, stopping before the block
    of r + 1 (which r + 1 already has).  Every round each rank sends the
    next words of its stream that it already holds (held at the start of
    the round), at most ``chunk_words``.

    Returns ``(rounds, received)``: the words each rank sends per round
    (tuples; no all-zero round) and, per rank, the labels ``(origin,
    offset)`` it received, in order.
    """
    p = len(counts)
    if p < 2:
        return [], [[] for _ in range(p)]
    stream = []
    for r in range(p):
        labels = []
        for k in range(p - 1):  # r, r-1, ..., r-(p-2) = r+2
            origin = (r - k) % p
            labels += [(origin, j) for j in range(counts[origin])]
        stream.append(labels)
    held = [set((r, j) for j in range(counts[r])) for r in range(p)]
    received = [[] for _ in range(p)]
    sent = [0] * p
    rounds = []
    while True:
        s = []
        for r in range(p):
            n = 0
            while (n < chunk_words and sent[r] + n < len(stream[r])
                   and stream[r][sent[r] + n] in held[r]):
                n += 1
            s.append(n)
        if not any(s):
            break
        for r in range(p):
            words = stream[r][sent[r]:sent[r] + s[r]]
            dest = (r + 1) % p
            received[dest] += words
            sent[r] += s[r]
        for r in range(p):
            held[r].update(received[r])
        rounds.append(tuple(s))
    assert sent == [len(x) for x in stream], 'the ring stalled'
    return rounds, received


def ring_bytes_sent(counts, chunk_words=1):
    """Bytes each rank sends in the ring allgatherv of blocks of ``counts``
    32-bit words (from :func:`ring_simulation`)."""
    rounds, _ = ring_simulation(list(counts), chunk_words)
    return [4 * sum(s[r] for s in rounds) for r in range(len(counts))]


# ---- per-sample statistics --------------------------------------------------

def per_example_sqsum(params, loss_fn, *batch):
    """sum_z (grad_z / B)**2 in float64, with one ordinary backward pass
    per example (``loss_fn`` gives the mean loss of the examples it is
    given; ``.grad`` of the parameters is overwritten).  None where no
    example gave the parameter a gradient."""
    n = len(batch[0])
    out = [None] * len(params)
    for z in range(n):
        for p in params:
            p.cleargrad()
        loss_fn(*[a[z:z + 1] for a in batch]).backward()
        for k, p in enumerate(params):
            if p.grad is None:
                continue
            g = numpy.asarray(p.grad, dtype=numpy.float64) / n
            out[k] = g * g if out[k] is None else out[k] + g * g
    for p in params:
        p.cleargrad()
    return out


# ---- an independent reference of the quantizer (exact float arithmetic) ----

def ref_floor_log2(m):
    mant, ex = math.frexp(abs(float(m)))
    return ex - 1


def ref_quantize(x, e_k, dtype):
    """(negative, d) or None if not sent, from the paper's definition."""
    a = abs(float(x))
    if a < numpy.finfo(dtype).tiny:  # zero or subnormal: not sent
        return None
    mant, ex = math.frexp(a)  # a = mant * 2**ex, mant in [0.5, 1)
    e = ex - 1
    if 2 * mant >= 1.5:  # nearer to 2**(e+1); ties go up
        e += 1
    e = min(e, e_k)  # |x| > 2**e_k is truncated to 2**e_k
    d = e_k - e
    return (math.copysign(1.0, float(x)) < 0, d) if d <= 7 else None


def edge_values(dtype):
    """Zeros, subnormals, powers of two, mid-points 1.5*2**e and neighbours."""
    dtype = numpy.dtype(dtype)
    fi = numpy.finfo(dtype)
    vals = [0.0, -0.0, fi.tiny, fi.tiny / 2, fi.tiny / 4, fi.tiny * 0.75,
            fi.max, fi.max / 2]
    for e in (-20, -3, -1, 0, 1, 2, 5, 10):
        for base in (2.0 ** e, 1.5 * 2.0 ** e):
            b = dtype.type(base)
            vals += [b, numpy.nextafter(b, dtype.type(numpy.inf)),
                     numpy.nextafter(b, dtype.type(0))]
    arr = numpy.array(vals, dtype=dtype)
    return numpy.concatenate([arr, -arr])


# ---- comparisons ------------------------------------------------------------

def bits(a):
    """Bit pattern view, so that NaN == NaN and -0.0 != 0.0."""
    a = numpy.ascontiguousarray(a)
    return a.view({1: numpy.uint8, 2: numpy.uint16, 4: numpy.uint32,
                   8: numpy.uint64}[a.dtype.itemsize])


def assert_bitwise(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    diff = numpy.nonzero(bits(a) != bits(b))[0]
    assert diff.size == 0, 'first differences at {}: {} vs {}'.format(
        diff[:5], a[diff[:5]], b[diff[:5]])

# ---- FMT_GAP (issue 14), from the format's description alone ---------------

ESC = 16
SIGN_ONLY = 64
SPAN_SHIFT = 8  # param bits 8..31: further tensors the group covers
MAX_SPAN = (1 << 24) - 1
RESTART = 1024  # codes between restart points (issue 25)


def restarts(count):
    """Restart points of a group of count codes: codes 1024, 2048, ...
    below count."""
    return max(count - 1, 0) // RESTART


class Reject(Exception):
    """The oracle finds the message malformed."""


def rice_k(count, size):
    """The Rice parameter, as the format defines it (integers only)."""
    t = (11 * (size - count)) // (16 * count)
    k = t.bit_length() - 1 if t >= 1 else 0
    return min(k, 62)


def gaps_of(index):
    gaps, prev = [], -1
    for i in index:
        i = int(i)
        assert i > prev
        gaps.append(i - prev - 1)
        prev = i
    return gaps


def code_bits(gap, k):
    """Length of one code, counted from the description of the code."""
    q = gap >> k
    if q < ESC:
        return q + 1 + k
    n = (q - ESC + 1).bit_length() - 1
    return ESC + n + 1 + n + k


def put_field(bits, x, n):
    for i in range(n):
        bits.append((x >> i) & 1)


def gap_code(gap, k):
    """The bits of one code, in writing order."""
    bits = []
    q = gap >> k
    if q < ESC:
        bits += [0] * q + [1]
    else:
        v = q - ESC + 1
        n = v.bit_length() - 1
        bits += [0] * ESC + [0] * n + [1]
        put_field(bits, v, n)  # the low n bits of v
    put_field(bits, gap & ((1 << k) - 1), k)
    return bits


def to_words(bits):
    words = [0] * ((len(bits) + 31) // 32)
    for p, b in enumerate(bits):
        if b:
            words[p >> 5] |= 1 << (p & 31)
    return words


def gap_span(param):
    """The span field of a FMT_GAP param word (ADDENDUM v2)."""
    return int(param) >> SPAN_SHIFT


def oracle_encode(index, nibbles, k, sign_only, span=0):
    """Body words (Python ints) of the elements ``index`` (strictly
    increasing) with the 4-bit ``nibbles`` (sign << 3 | d); ``span``: the
    param word's span field (indices then in the span's index space)."""
    assert 0 <= span <= MAX_SPAN
    stream, table, prev = [], [], -1
    for j, gap in enumerate(gaps_of(index)):
        if j and j % RESTART == 0:  # bit and index as two 64-bit words
            for x in (len(stream), prev):
                table += [x & 0xFFFFFFFF, x >> 32]
        stream += gap_code(gap, k)
        prev = int(index[j])
    values = []
    for nib in nibbles:
        nib = int(nib)
        if sign_only:
            assert nib & 7 == 0, 'sign-only values have d = 0'
            put_field(values, nib >> 3, 1)
        else:
            put_field(values, nib, 4)
    gap_words = to_words(stream)
    flag = 0x80 if table else 0  # param bit 7: a restart table follows
    return ([k | (SIGN_ONLY if sign_only else 0) | flag | span << SPAN_SHIFT,
             len(gap_words)] + table + gap_words + to_words(values))


class BitReader(object):

    def __init__(self, words, end):
        self.words, self.end, self.pos = words, end, 0

    def bit(self):
        if self.pos >= self.end:
            raise Reject('read past the end of the gap stream')
        b = (self.words[self.pos >> 5] >> (self.pos & 31)) & 1
        self.pos += 1
        return b

    def field(self, n):
        x = 0
        for i in range(n):
            x |= self.bit() << i
        return x


def body_words_needed(param, G, count):
    vbits = 1 if param & SIGN_ONLY else 4
    return 2 + 4 * restarts(count) + G + (count * vbits + 31) // 32


def sparse_value_words(count, flags):
    """FMT_SPARSE's value words: float32 (flag bit 0) one an element,
    float16 two a word."""
    return count if flags & 1 else (count + 1) // 2


def oracle_decode_body(body, count, size):
    """(indices, nibbles) as lists of ints, or raises :class:`Reject`.
    ``body`` must be exactly the group's body.  Sign-only nibbles are
    ``sign << 3`` (d = 0).  ``size``: of the group's index space (a span
    group's: the sum of its tensors' sizes); the span field (param bits
    8..31) is the caller's to check, bit 7 says a restart table follows
    (exactly when count > 1024)."""
    body = [int(w) for w in body]
    if len(body) < 2:
        raise Reject('no param/G words')
    sign_only = bool(body[0] & SIGN_ONLY)
    vbits = 1 if sign_only else 4
    index, vals = oracle_decode_codes(body, count, size,
                                      (count * vbits + 31) // 32)
    v = BitReader(vals, 32 * len(vals))
    nibbles = []
    for _ in range(count):
        x = v.field(vbits)
        nibbles.append(x << 3 if sign_only else x)
    while v.pos < 32 * len(vals):
        if v.bit():
            raise Reject('nonzero padding after the last value')
    return index, nibbles


def oracle_decode_codes(body, count, size, value_words):
    """(indices, the value words) of a body of gap codes (FMT_GAP's and
    FMT_SPARSE's) followed by ``value_words`` words, or raises
    :class:`Reject`; as :func:`oracle_decode_body`."""
    body = [int(w) for w in body]
    if len(body) < 2:
        raise Reject('no param/G words')
    param, G = body[0], body[1]
    if bool(param & 0x80) != bool(restarts(count)):
        raise Reject('param bit 7 must say whether a restart table follows')
    k = param & 63
    if len(body) != 2 + 4 * restarts(count) + G + value_words:
        raise Reject('body length')
    t = 4 * restarts(count)
    table = body[2:2 + t]
    r = BitReader(body[2 + t:2 + t + G], 32 * G)
    index, prev = [], -1
    for j in range(count):
        if j and j % RESTART == 0:
            e = table[4 * (j // RESTART - 1):4 * (j // RESTART)]
            if (e[0] | e[1] << 32, e[2] | e[3] << 32) != (r.pos, prev):
                raise Reject('restart point does not match the codes')
        q = None
        for zeros in range(ESC):
            if r.bit():
                q = zeros
                break
        if q is None:  # escape: Elias-gamma
            n = 0
            while not r.bit():
                n += 1
                if n >= 64:
                    raise Reject('Elias-gamma prefix of 64 zeros')
            v = (1 << n) | r.field(n)
            q = v - 1 + ESC
        gap = (q << k) | r.field(k)
        if prev + 1 + gap >= size:
            raise Reject('gap overruns the tensor')
        prev = prev + 1 + gap
        index.append(prev)
    if (r.pos + 31) // 32 != G:
        raise Reject('extra gap words')
    while r.pos < 32 * G:
        if r.bit():
            raise Reject('nonzero padding after the last code')
    return index, body[2 + t + G:]


# ---- FMT_GAP spans (ADDENDUM v2): the encoder's merge rule ------------------

def group_elements(tensor_id, fmt, count, a, b, body, sizes):
    """(first tensor, last tensor, [(tensor id, local index, nibble)]) of a
    FMT_POW2 or FMT_GAP group (any span), from the words."""
    body = [int(w) for w in body]
    if fmt == FMT_POW2:
        return tensor_id, tensor_id, [
            (tensor_id, w & ((1 << 28) - 1), w >> 28) for w in body]
    assert fmt == FMT_GAP
    span = gap_span(body[0])
    size = sum(sizes[tensor_id:tensor_id + span + 1])
    index, nibbles = oracle_decode_body(body, count, size)
    out = []
    for t, part in split_index(tensor_id, index, sizes, span):
        out += [(t, i, nibbles[j]) for j, i in part]
    return tensor_id, tensor_id + span, out


def span_group(first, last, elements, a, b, sizes):
    """(tensor_id, FMT_GAP, count, a, b, body) of one group over tensors
    first..last carrying ``elements`` [(tensor id, local index, nibble)]
    (in tensor, index order): Rice k of the span, SIGN_ONLY iff every d is
    0."""
    offset, base = {}, 0
    for t in range(first, last + 1):
        offset[t] = base
        base += sizes[t]
    index = [offset[t] + i for t, i, _ in elements]
    nibbles = [n for _, _, n in elements]
    sign_only = all(n & 7 == 0 for n in nibbles)
    body = oracle_encode(index, nibbles, rice_k(len(index), base), sign_only,
                         span=last - first)
    return (first, FMT_GAP, len(index), a, b, body)


MERGE_MAX = 1024  # groups of more elements stay as they are


def oracle_merge_spans(words, sizes):
    """The message (list of ints) the ADDENDUM's encoder rule makes of
    ``words``: each maximal run of consecutive FMT_POW2/FMT_GAP groups
    (message order) of at most MERGE_MAX (1024) elements each, with equal
    ``a`` and ``b``, becomes one FMT_GAP group
    over the run's first to last tensor when that group has strictly fewer
    words (header included) than the run; runs of one group, and runs that
    would not shrink, stay as they are."""
    groups = parse_message(words)
    runs = []

    def joins(g):  # a FMT_POW2/FMT_GAP group of at most MERGE_MAX elements
        return g[1] in (FMT_POW2, FMT_GAP) and g[2] <= MERGE_MAX
    for g in groups:
        tid, fmt, count, a, b, body = g
        if (runs and joins(g) and joins(runs[-1][-1])
                and (runs[-1][0][3], runs[-1][0][4]) == (a, b)):
            runs[-1].append(g)
        else:
            runs.append([g])
    out = []
    for run in runs:
        if len(run) > 1:
            elements, first, last = [], None, None
            for g in run:
                lo, hi, el = group_elements(*g, sizes=sizes)
                first = lo if first is None else first
                last = hi
                elements += el
            merged = span_group(first, last, elements, run[0][3], run[0][4],
                                sizes)
            if 5 + len(merged[5]) < sum(5 + len(g[5]) for g in run):
                run = [merged]
        out += run
    m = [MAGIC, len(out)]
    for g in out:
        m += [int(w) for w in g[:5]] + [int(w) for w in g[5]]
    return m


# ---- PowerSGD (Vogels, Karimireddy, Jaggi 2019) ------------------------------

def powersgd_first_q(seed, tensor_id, m, r, dtype, step=0):
    """The Q a tensor starts from (the rule's docstring): m x r standard
    normal from NumPy's RandomState seeded with [seed, tensor, step]."""
    draw = numpy.random.RandomState([seed, tensor_id, step])
    return draw.standard_normal(m * r).astype(dtype).reshape(m, r)


def gram_schmidt(p, eps=1e-8):
    """The columns of ``p`` orthonormalized in order, as the paper's code
    does: each divided by its norm plus ``eps``, then its projection
    taken off every later column (a new array)."""
    p = p.copy()
    for i in range(p.shape[1]):
        col = p[:, i:i + 1]
        col /= numpy.sqrt(numpy.sum(col * col)) + p.dtype.type(eps)
        for j in range(i + 1, p.shape[1]):
            other = p[:, j:j + 1]
            other -= numpy.sum(col * other, axis=0) * col
    return p


class PowerSGDWorker(object):
    """One worker of the paper's Algorithm 1 with error feedback (its
    Algorithm 2), tensor by tensor.  Bit for bit needs the same
    operations in the same order, so its Gram-Schmidt (the paper's code)
    and the first Q's draw are the rule's by construction: what this
    checks independently is the rest (the rounds, the allreduce and its
    mean, error feedback with the averaged Q, warm start, which tensors);
    test_powersgd.py checks the orthonormalization against its
    definition.  ``shapes`` of the compressed tensors
    (each seen as its first axis against the rest), rank ``r``;
    :meth:`step` takes this worker's gradients and ``mean(x)``, the mean
    of ``x`` over the workers, and returns the update every worker
    applies."""

    def __init__(self, shapes, r, seed, dtype=numpy.float32,
                 warm_start=True):
        self.r, self.seed, self.dtype = r, seed, dtype
        self.warm_start, self.steps = warm_start, 0
        self.mats = [(s[0], int(numpy.prod(s[1:]))) for s in shapes]
        self.e = [numpy.zeros(nm, dtype) for nm in self.mats]
        self.q = [powersgd_first_q(seed, t, m, r, dtype)
                  for t, (_, m) in enumerate(self.mats)]

    def step(self, grads, mean):
        self.steps += 1
        if not self.warm_start and self.steps > 1:
            self.q = [powersgd_first_q(self.seed, t, m, self.r, self.dtype,
                                       self.steps)
                      for t, (_, m) in enumerate(self.mats)]
        out = []
        ms = [g.reshape(nm) + e for g, nm, e in zip(grads, self.mats, self.e)]
        ps = [mean(m @ q) for m, q in zip(ms, self.q)]
        p_hats = [gram_schmidt(p) for p in ps]
        qs = [mean(m.T @ p_hat) for m, p_hat in zip(ms, p_hats)]
        for t, (m, p_hat, q) in enumerate(zip(ms, p_hats, qs)):
            update = p_hat @ q.T
            self.e[t] = m - update
            self.q[t] = q
            out.append(update)
        return out
