"""FMT_GAP (issue 14): gap-coded indices, Golomb-Rice with an Elias-gamma
escape, 4-bit or 1-bit values, against an independent oracle.

The oracle below is written from the format description alone (not from
``chainer_vgc.codec``): one bit at a time, Python integers, one loop per
code.  It is slow and meant to be obviously right.  The codec (NumPy
reference) and, where present, the native backend must produce the same
words and decode every message the oracle accepts to the same elements, and
reject (with :class:`codec.WireFormatError`, nothing else) every message the
oracle rejects.

Format, as the oracle reads it.  A FMT_GAP group is the 5-word header
``tensor_id, 4, count, e_k (int32 bits), float32 bits of scale`` and the body

    word 0   param: bits 0..5 = k, bit 6 = SIGN_ONLY, bit 7 = a restart
             table follows (exactly when count > 1024), bits 8..31 the
             span
    word 1   G: words of the gap stream
    4R words restart table (issue 25): R = (count - 1) // 1024 entries;
             entry m is the bit where code 1024 m starts in the stream and
             the index of element 1024 m - 1, two 64-bit numbers, each as
             two words, low word first
    G words  gap stream (LSB-first bit string)
    V words  values, V = ceil(count * vbits / 32), vbits = 1 if SIGN_ONLY
             else 4; the field of element j is at bit j * vbits: the nibble
             ``sign << 3 | d`` (4 bits) or the sign (1 bit, d = 0)

Gaps: gap_0 = i_0, gap_j = i_j - i_{j-1} - 1.  Code of a gap:
q = gap >> k; q < 16: q zeros and a one; else 16 zeros and the Elias-gamma
code of v = q - 15 (n = floor(log2 v) zeros, a one, the low n bits of v
LSB-first); then the low k bits of the gap (LSB-first).  Bits after the last
code and after the last value must be zero; G = ceil(code bits / 32).
"""

import collections
import contextlib
import random
import signal
import tracemalloc

import hypothesis
import numpy
import pytest
from hypothesis import assume
from hypothesis import given
from hypothesis import strategies as st

from chainer_vgc import codec
from chainer_vgc.codec.message import walk

from reference import ESC  # NOQA: F401 (the oracle, tests/reference.py)
from reference import SIGN_ONLY
from reference import Reject
from reference import body_words_needed
from reference import code_bits
from reference import gap_span
from reference import gap_code
from reference import gaps_of
from reference import oracle_decode_body
from reference import oracle_encode
from reference import restarts
from reference import rice_k
from reference import split_index
from reference import to_words  # NOQA: F401

# on both stacks (make test): its results depend on NumPy, the native
# build or the installed packages (docs/contributing.md)
pytestmark = pytest.mark.stack

FMT_POW2 = 1
FMT_GAP = 4
MAGIC = 0x31434756
INDEX_MASK = (1 << 28) - 1
MAX_POW2_SIZE = 1 << 28

#: the fuzz tests are cheap: several times the profile's examples
# (tests/conftest.py; VGC_EXAMPLES scales them all)
FUZZ = hypothesis.settings(
    max_examples=8 * hypothesis.settings.default.max_examples)

#: thousands of elements through the bit-at-a-time oracle: fewer examples
SLOW = hypothesis.settings(
    max_examples=max(5, hypothesis.settings.default.max_examples // 5),
    deadline=None)



class Unsupported(Exception):
    """A format the oracle does not model (FMT_RAW, FMT_QSGD)."""


def oracle_values(nibbles, e_k, scale_bits, dtype):
    """The values sign * scale * 2**(e_k - d) in ``dtype``, with the header
    checks of FMT_POW2 (scale finite and > 0, e_k in the dtype's exponent
    range, all 16 values finite and nonzero)."""
    dtype = numpy.dtype(dtype)
    scale = numpy.uint32(scale_bits).view(numpy.float32)
    fi = numpy.finfo(dtype)
    if not (numpy.isfinite(scale) and scale > 0
            and fi.minexp <= e_k <= fi.maxexp - 1):
        raise Reject('e_k or scale out of range')
    s = dtype.type(scale)
    with numpy.errstate(over='ignore', under='ignore'):
        table = {}
        for d in range(8):
            mag = s * numpy.ldexp(dtype.type(1), e_k - d)
            table[d], table[8 | d] = mag, -mag
    for x in table.values():
        if not numpy.isfinite(x) or x == 0:
            raise Reject('value out of range')
    return [table[n] for n in nibbles]


def oracle_unpack(message, sizes, dtypes):
    """[(tensor_id, indices, values)] of a message of FMT_GAP and FMT_POW2
    groups, one entry per tensor that receives an element (a FMT_GAP span
    group gives one per such tensor of its span), or raises
    :class:`Reject` / :class:`Unsupported`."""
    m = [int(w) for w in message]
    if len(m) < 2 or m[0] != MAGIC:
        raise Reject('header')
    pos, last, out = 2, -1, []
    for _ in range(m[1]):
        if pos + 5 > len(m):
            raise Reject('truncated header')
        tid, fmt, count, a, b = m[pos:pos + 5]
        pos += 5
        if fmt not in (FMT_POW2, FMT_GAP):
            raise Unsupported(fmt)
        if tid <= last or tid >= len(sizes):
            raise Reject('tensor id')
        span = 0
        if fmt == FMT_GAP:
            if pos + 2 > len(m):
                raise Reject('truncated param words')
            span = gap_span(m[pos])
            if tid + span >= len(sizes):
                raise Reject('span past the model')
        last = tid + span  # the next group's id must be > t0 + span
        size = sum(sizes[tid:tid + span + 1])
        if count == 0 or count > size:
            raise Reject('count')
        if fmt == FMT_GAP:
            n = body_words_needed(m[pos], m[pos + 1], count)
        else:
            n = count
        if pos + n > len(m):
            raise Reject('truncated body')
        body = m[pos:pos + n]
        pos += n
        if fmt == FMT_GAP:
            index, nibbles = oracle_decode_body(body, count, size)
        else:
            index = [w & INDEX_MASK for w in body]
            nibbles = [w >> 28 for w in body]
            if any(j <= i for i, j in zip(index, index[1:])):
                raise Reject('indices not increasing')
            if index[-1] >= size:
                raise Reject('index out of range')
        e_k = a - (1 << 32) if a >> 31 else a
        for t, part in split_index(tid, index, sizes, span):
            if not part:  # no element: no value table for its dtype
                continue
            values = oracle_values(
                [nibbles[j] for j, _ in part], e_k, b,
                numpy.float64 if numpy.dtype(dtypes[t]) == numpy.float64
                else numpy.float32)
            out.append((t, [i for _, i in part], values))
    if pos != len(m):
        raise Reject('trailing words')
    return out


def gap_message(groups):
    """A message from ``(tensor_id, count, e_k, scale, body)`` tuples, or
    ``(tensor_id, fmt, count, a, b, body)``, laid out by hand."""
    m = [MAGIC, len(groups)]
    for g in groups:
        if len(g) == 5:
            tid, count, e_k, scale, body = g
            g = (tid, FMT_GAP, count, e_k & 0xFFFFFFFF, f32_bits(scale), body)
        m += list(g[:5]) + [int(w) for w in g[5]]
    return numpy.array(m, dtype=numpy.uint32)


def f32_bits(x):
    return int(numpy.array(x, dtype=numpy.float32).view(numpy.uint32))


# ---- the oracle checks itself -----------------------------------------------

WORKED_BODY = [4, 1, 0x7027, 0x281]
WORKED_INDEX = [3, 4, 40]
WORKED_NIBBLES = [0b0001, 0b1000, 0b0010]


def test_oracle_worked_example():
    assert rice_k(3, 100) == 4
    assert [gap_code(g, 4) for g in gaps_of(WORKED_INDEX)] == [
        [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [0, 0, 1, 1, 1, 0, 0]]
    assert oracle_encode(WORKED_INDEX, WORKED_NIBBLES, 4, False) == \
        WORKED_BODY
    assert oracle_decode_body(WORKED_BODY, 3, 100) == (WORKED_INDEX,
                                                       WORKED_NIBBLES)
    ((tid, index, values),) = oracle_unpack(
        gap_message([(0, 3, 0, 1.0, WORKED_BODY)]), [100], [numpy.float32])
    assert (tid, index) == (0, WORKED_INDEX)
    assert values == [0.5, -1.0, 0.25]
    with pytest.raises(Reject):  # 40 does not fit in 40 elements
        oracle_decode_body(WORKED_BODY, 3, 40)
    oracle_decode_body(WORKED_BODY, 3, 41)


def test_oracle_escape_codes_by_hand():
    # k = 0, gap 16: q = 16 -> 16 zeros, v = 1 (n = 0): one bit '1'
    assert gap_code(16, 0) == [0] * 16 + [1]
    # gap 17: v = 2, n = 1: '0', '1', then bit 0 of v = 0
    assert gap_code(17, 0) == [0] * 16 + [0, 1, 0]
    # gap 18: v = 3 -> '0', '1', '1'
    assert gap_code(18, 0) == [0] * 16 + [0, 1, 1]
    # gap 15: still unary
    assert gap_code(15, 0) == [0] * 15 + [1]
    # k = 2, gap 0b1000110: q = 17 (v = 2), low = 0b10 -> LSB first 0, 1
    assert gap_code(0b1000110, 2) == [0] * 16 + [0, 1, 0] + [0, 1]
    for gap in list(range(200)) + [2 ** 40, 2 ** 63 - 1]:
        for k in (0, 1, 3, 7, 62):
            assert len(gap_code(gap, k)) == code_bits(gap, k)


def test_oracle_rice_parameter_by_hand():
    assert rice_k(1, 1) == 0
    assert rice_k(5, 10) == 0            # t = 55 // 80 = 0
    assert rice_k(1, 3) == 0             # t = 22 // 16 = 1 -> k = 0
    assert rice_k(1, 4) == 1             # t = 33 // 16 = 2
    assert rice_k(1, 2 ** 70) == 62      # capped


@given(st.data())
def test_oracle_round_trip(data):
    size = data.draw(st.integers(1, 2 ** 40))
    index = sorted(data.draw(st.sets(st.integers(0, size - 1), min_size=1,
                                     max_size=20)))
    sign_only = data.draw(st.booleans())
    k = data.draw(st.integers(0, 63))
    nibbles = [n << 3 if sign_only else n for n in data.draw(
        st.lists(st.integers(0, 1 if sign_only else 15),
                 min_size=len(index), max_size=len(index)))]
    body = oracle_encode(index, nibbles, k, sign_only)
    bits = sum(code_bits(g, k) for g in gaps_of(index))
    assert body[1] == (bits + 31) // 32
    assert oracle_decode_body(body, len(index), size) == (index, nibbles)
    with pytest.raises(Reject):
        oracle_decode_body(body, len(index), index[-1])


# ---- strategies -------------------------------------------------------------

@st.composite
def selections(draw, kind='small'):
    """(size, sorted unique indices), first and last element at will:
    'small': any density of a tensor of up to 300 elements;
    'medium': up to 200 elements of a tensor of up to 2**28;
    'huge': a few elements of a tensor of up to 2**40 (escapes, gaps over
    2**32); 'restarts': 1,024 to 3,100 elements (up to three restart
    points) of a tensor of up to 2**34."""
    rnd = random.Random(draw(st.integers(0, 2 ** 32)))
    if kind == 'restarts':
        count = draw(st.sampled_from([1024, 1025, 2048, 2049, 3100]))
        size = draw(st.sampled_from([count, count + 1, 5000, 2 ** 20,
                                     2 ** 34]))
        size = max(size, count)
        idx = set(rnd.sample(range(size), count)) if size < 2 ** 21 else \
            set(rnd.randrange(size) for _ in range(count))
    elif kind == 'huge':
        size = draw(st.integers(1, 2 ** 40))
        idx = set(draw(st.lists(st.integers(0, size - 1), min_size=1,
                                max_size=6)))
    else:
        size = draw(st.integers(1, 300 if kind == 'small' else MAX_POW2_SIZE))
        count = draw(st.integers(1, min(size, 300 if kind == 'small'
                                        else 200)))
        idx = set(rnd.sample(range(size), count))
    if draw(st.booleans()):
        idx.add(0)
    if draw(st.booleans()):
        idx.add(size - 1)
    return size, sorted(idx)


@st.composite
def gap_cases(draw, kind=None, forced_k=None):
    """(size, index, nibbles, k, sign_only): ``kind`` of selection (one or
    several, see :func:`selections`); k the format's or, when ``forced_k``,
    any of 0..62 (at random when None)."""
    if kind is None:
        kind = ('small', 'medium', 'huge')
    if not isinstance(kind, str):  # one of several
        kind = draw(st.sampled_from(kind))
    size, index = draw(selections(kind))
    sign_only = draw(st.booleans())
    if forced_k is None:
        forced_k = draw(st.booleans())
    k = draw(st.integers(0, 62)) if forced_k else rice_k(len(index), size)
    if sign_only:
        nibbles = [s << 3 for s in draw(st.lists(
            st.integers(0, 1), min_size=len(index), max_size=len(index)))]
    else:
        nibbles = draw(st.lists(st.integers(0, 15), min_size=len(index),
                                max_size=len(index)))
    return size, index, nibbles, k, sign_only


def pow2_words(index, nibbles):
    """FMT_POW2 words (index field truncated to 28 bits for big tensors)."""
    return numpy.array([(n << 28) | (i & INDEX_MASK)
                        for i, n in zip(index, nibbles)], dtype=numpy.uint32)


# ---- worked example against the codec ---------------------------------------

def test_codec_constants():
    assert codec.FMT_GAP == FMT_GAP
    assert codec.GAP_ESCAPE == ESC
    assert codec.GAP_SIGN_ONLY == SIGN_ONLY
    assert codec.GAP_PARAM_WORDS == 2
    assert codec.CODINGS == ('auto', 'fixed', 'gap')


def test_codec_worked_example():
    assert codec.rice_parameter(3, 100) == 4
    body = codec.gap_body(numpy.array(WORKED_INDEX, dtype=numpy.int64),
                          numpy.array(WORKED_NIBBLES, dtype=numpy.uint8),
                          4, False)
    assert body.dtype == numpy.uint32
    assert body.tolist() == WORKED_BODY
    index, nibbles = codec.gap_decode_body(
        numpy.array(WORKED_BODY, dtype=numpy.uint32), 3, 100)
    assert index.tolist() == WORKED_INDEX
    assert nibbles.tolist() == WORKED_NIBBLES
    msg = gap_message([(0, 3, 0, 1.0, WORKED_BODY)])
    (dec,) = codec.unpack(msg, [100], [numpy.float32])
    assert dec.tensor_id == 0
    assert dec.index.tolist() == WORKED_INDEX
    assert dec.value.dtype == numpy.float32
    assert dec.value.tolist() == [0.5, -1.0, 0.25]
    out = numpy.zeros(100, dtype=numpy.float32)
    assert codec.decode_into(msg, [out]) == 3
    assert out[WORKED_INDEX].tolist() == [0.5, -1.0, 0.25]
    assert numpy.count_nonzero(out) == 3
    # built by the encoder: auto sends FMT_POW2 (3 words < the 4-word gap
    # body), forced 'gap' the worked example's body
    g = codec.pow2_best_group(
        0, pow2_words(WORKED_INDEX, WORKED_NIBBLES),
        numpy.array(WORKED_INDEX, dtype=numpy.int64), 0, 1.0, 100)
    assert g.fmt == codec.FMT_POW2
    g = codec.pow2_best_group(
        0, pow2_words(WORKED_INDEX, WORKED_NIBBLES),
        numpy.array(WORKED_INDEX, dtype=numpy.int64), 0, 1.0, 100,
        coding='gap')
    assert (g.fmt, g.count, g.a, g.b) == (FMT_GAP, 3, 0, f32_bits(1.0))
    assert numpy.asarray(g.body).tolist() == WORKED_BODY
    assert codec.pack([g]).tolist() == msg.tolist()


# ---- round trips ------------------------------------------------------------

def _check_encoder(encode, index, nibbles, k, sign_only):
    """``encode`` (codec.gap_body, native_gap.gap_encode) gives the oracle's
    words; returns them."""
    want = oracle_encode(index, nibbles, k, sign_only)
    body = encode(numpy.array(index, dtype=numpy.int64),
                  numpy.array(nibbles, dtype=numpy.uint8), k, sign_only)
    assert body.dtype == numpy.uint32
    assert body.tolist() == want
    return want


def _check_body_round_trip(size, index, nibbles, k, sign_only):
    want = _check_encoder(codec.gap_body, index, nibbles, k, sign_only)
    assert oracle_decode_body(want, len(index), size) == (index, nibbles)
    got_index, got_nibbles = codec.gap_decode_body(
        numpy.array(want, dtype=numpy.uint32), len(index), size)
    assert got_index.tolist() == index
    assert got_nibbles.tolist() == nibbles
    lengths = codec.gap_code_lengths(
        numpy.array(gaps_of(index), dtype=numpy.int64), k)
    assert lengths.tolist() == [code_bits(g, k) for g in gaps_of(index)]
    return want


@given(gap_cases('small'))
def test_body_round_trip_small_tensors(case):
    _check_body_round_trip(*case)


@given(gap_cases('huge'))
def test_body_round_trip_huge_gaps(case):
    _check_body_round_trip(*case)


@SLOW
@given(gap_cases('restarts'))
def test_body_round_trip_across_restart_points(case):
    """Groups of more than 1,024 elements carry a restart table (issue
    25): the encoders write the oracle's, the decoder reads it back."""
    body = _check_body_round_trip(*case)
    assert len(body) >= 2 + 4 * restarts(len(case[1]))


def test_restart_table_by_hand():
    """1,024 elements have no restart point; 1,025 have one: where code
    1,024 starts (every code here is 2 bits: gap 1 with k = 0 is a zero, a
    one) and the index of element 1,023."""
    for count in (1024, 1025, 2049):
        index = list(range(1, 2 * count, 2))
        body = codec.gap_body(numpy.array(index), numpy.zeros(count, 'u1'),
                              0, True).tolist()
        assert body == oracle_encode(index, [0] * count, 0, True)
        table = body[2:2 + 4 * restarts(count)]
        want = []
        for m in range(1, restarts(count) + 1):
            want += [2 * 1024 * m, 0, index[1024 * m - 1], 0]
        assert table == want
        assert body[1] == -(-2 * count // 32)  # G: the codes only
        # param bit 7 says so (an older decoder refuses it: it was reserved)
        assert bool(body[0] & codec.GAP_RESTARTS) == (count > 1024)


def _restart_faults(body, count):
    """Bodies with one restart-table word changed, or the table cut."""
    out = []
    for w in range(2, 2 + 4 * restarts(count)):
        for change in (1, -1, 1 << 31, 2 ** 32 - 1):
            bad = list(body)
            bad[w] = (bad[w] + change) % 2 ** 32
            out.append(bad)
    t = 2 + 4 * restarts(count)
    out.append(body[:2] + body[t - 4:t] + body[2:t - 4] + body[t:])  # order
    out.append(body[:t - 4] + body[t:])  # an entry missing
    out.append(body[:2] + body[t:])  # no table
    out.append([body[0] & ~0x80] + body[1:2] + body[t:])  # as before 25
    out.append([body[0] & ~0x80] + body[1:])  # the flag alone cleared
    return out


def test_malformed_restart_table_rejected():
    """A restart point that is not where its code starts, or not after
    the element it names, a table in another order or too short: both
    decoders refuse it with WireFormatError (the native one: None), as
    the oracle does."""
    rnd = random.Random(25)
    count, size = 3000, 40000
    index = sorted(rnd.sample(range(size), count))
    for sign_only in (False, True):
        nibbles = [rnd.randrange(2) << 3 if sign_only else rnd.randrange(16)
                   for _ in index]
        body = oracle_encode(index, nibbles, rice_k(count, size), sign_only)
        assert body_agree(body, count, size)
        for bad in _restart_faults(body, count):
            with pytest.raises(Reject):
                oracle_decode_body(bad, count, size)
            with pytest.raises(codec.WireFormatError):
                codec.gap_decode_body(numpy.array(bad, dtype=numpy.uint32),
                                      count, size)
            assert native_agree(bad, count, size) is False


@SLOW
@given(gap_cases('restarts'), st.data())
def test_mutated_bodies_with_restart_points_agree(case, data):
    size, index, nibbles, k, sign_only = case
    body = oracle_encode(index, nibbles, k, sign_only)
    for _ in range(data.draw(st.integers(1, 2))):
        # a table word half the time, else any bit
        if restarts(len(index)) and data.draw(st.booleans()):
            w = data.draw(st.integers(2, 1 + 4 * restarts(len(index))))
            body[w] ^= 1 << data.draw(st.integers(0, 31))
        else:
            p = data.draw(st.integers(0, 32 * len(body) - 1))
            body[p >> 5] ^= 1 << (p & 31)
    body_agree(body, len(index), size)
    native_agree(body, len(index), size)


@pytest.mark.parametrize('k', list(range(63)))
def test_body_round_trip_every_k(k):
    rnd = random.Random(k)
    size = 2 ** 40
    index = sorted(set([0, 1, 2, 17, 2 ** 32 + 5, 2 ** 39, size - 1]
                       + [rnd.randrange(size) for _ in range(5)]))
    for sign_only in (False, True):
        nibbles = [rnd.randrange(2) << 3 if sign_only else rnd.randrange(16)
                   for _ in index]
        _check_body_round_trip(size, index, nibbles, k, sign_only)


def test_gap_code_lengths_escapes():
    gaps = [0, 15, 16, 17, 31, 32, 2 ** 32, 2 ** 40, 2 ** 62, 2 ** 63 - 1]
    for k in (0, 1, 5, 31, 62):
        got = codec.gap_code_lengths(numpy.array(gaps, dtype=numpy.int64), k)
        assert got.tolist() == [code_bits(g, k) for g in gaps], k


@given(st.integers(1, 2 ** 48), st.data())
def test_rice_parameter(size, data):
    count = data.draw(st.integers(1, min(size, 2 ** 32 - 1)))
    assert codec.rice_parameter(count, size) == rice_k(count, size)


@pytest.mark.parametrize('count,size', [
    (1, 1), (1, 2), (1, 3), (1, 4), (3, 100), (2 ** 32 - 1, 2 ** 32 - 1),
    (1, 2 ** 62), (1, 2 ** 63 - 1), (7, 2 ** 40), (2 ** 20, 2 ** 28 + 5)])
def test_rice_parameter_edges(count, size):
    assert codec.rice_parameter(count, size) == rice_k(count, size)


@given(gap_cases(), st.sampled_from([numpy.float32, numpy.float64]),
       st.data())
def test_message_round_trip(case, dtype, data):
    """pack([pow2_best_group(...)]) decodes to what the oracle decodes."""
    size, index, nibbles, k, sign_only = case
    e_k = data.draw(st.integers(-20, 20))
    scale = data.draw(st.sampled_from([1.0, 1e-3, 0.75, 3.0e5]))
    if sign_only:
        e_k = 0
    coding = data.draw(st.sampled_from(['auto', 'gap']
                                       + (['fixed'] if size <= MAX_POW2_SIZE
                                          else [])))
    g = codec.pow2_best_group(
        3, pow2_words(index, nibbles), numpy.array(index, dtype=numpy.int64),
        e_k, scale, size, coding=coding, sign_only=sign_only)
    if g.fmt == FMT_GAP:
        assert numpy.asarray(g.body).tolist() == oracle_encode(
            index, nibbles, rice_k(len(index), size), sign_only)
    msg = codec.pack([g])
    sizes, dtypes = [5, 7, 1, size], [dtype] * 4
    ((tid, o_index, o_values),) = oracle_unpack(msg, sizes, dtypes)
    assert (tid, o_index) == (3, index)
    (dec,) = codec.unpack(msg, sizes, dtypes)
    assert dec.tensor_id == 3
    assert dec.index.tolist() == index
    assert dec.value.dtype == dtype
    assert dec.value.tolist() == [float(v) for v in o_values]
    # the values are sign * scale * 2**(e_k - d), exactly
    for nib, v in zip(nibbles, dec.value.tolist()):
        mag = float(dtype(numpy.float32(scale))) * 2.0 ** (e_k - (nib & 7))
        assert v == (-mag if nib >> 3 else mag)
    # a forced k (any 0..62) decodes the same way
    body = oracle_encode(index, nibbles, k, sign_only)
    msg = gap_message([(3, len(index), e_k, scale, body)])
    (dec2,) = codec.unpack(msg, sizes, dtypes)
    assert dec2.index.tolist() == index
    assert dec2.value.tolist() == dec.value.tolist()


# ---- corrupt and truncated messages -----------------------------------------

class Hang(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds=10):
    def fire(signum, frame):
        raise Hang('codec.unpack ran for more than {} s'.format(seconds))
    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def agree(message, sizes, dtypes):
    """codec.unpack and the oracle accept and reject the same messages and
    decode the same elements.  Returns True when accepted."""
    message = numpy.asarray(message, dtype=numpy.uint32)
    try:
        want = oracle_unpack(message, sizes, dtypes)
    except Unsupported:
        return None  # a mutation into FMT_RAW/FMT_QSGD: not this format
    except Reject as e:
        want = e
    try:
        with deadline():
            got = codec.unpack(message, sizes, dtypes)
    except codec.WireFormatError as e:
        assert isinstance(want, Reject), (
            'codec rejects ({}) a message the oracle accepts: {}'.format(
                e, message.tolist()))
        return False
    assert not isinstance(want, Reject), (
        'codec accepts a message the oracle rejects ({}): {}'.format(
            want, message.tolist()))
    for dec in got:
        want_dtype = (numpy.float64 if numpy.dtype(dtypes[dec.tensor_id])
                      == numpy.float64 else numpy.float32)
        assert dec.value.dtype == want_dtype
    # a span group may or may not give an empty entry for a tensor of its
    # span that receives nothing
    got = [d for d in got if d.index.size]
    assert [d.tensor_id for d in got] == [w[0] for w in want]
    for dec, (tid, index, values) in zip(got, want):
        assert dec.tensor_id == tid
        assert dec.index.tolist() == index
        assert dec.value.tolist() == [float(v) for v in values]
    return True


@st.composite
def messages(draw):
    """(message, sizes, dtypes): 1 to 3 groups, FMT_GAP (any k, 1 or 4
    value bits) or FMT_POW2, some on huge tensors."""
    n = draw(st.integers(1, 3))
    groups, sizes = [], []
    for tid in range(n):
        size, index, nibbles, k, sign_only = draw(gap_cases(
            draw(st.sampled_from(['small', 'small', 'medium', 'huge']))))
        size = max(size, index[-1] + 1)
        sizes.append(size)
        e_k = draw(st.integers(-3, 3))
        if size <= MAX_POW2_SIZE and draw(st.integers(0, 3)) == 0:
            groups.append((tid, FMT_POW2, len(index), e_k & 0xFFFFFFFF,
                           f32_bits(1.0), pow2_words(index, nibbles)))
        else:
            groups.append((tid, len(index), e_k, 0.5,
                           oracle_encode(index, nibbles, k, sign_only)))
    dtypes = [draw(st.sampled_from([numpy.float32, numpy.float64]))
              for _ in sizes]
    return gap_message(groups), sizes, dtypes


def _mutate(m, data):
    m = m.copy()
    kind = data.draw(st.sampled_from(['bits', 'word', 'insert', 'delete']))
    if kind == 'bits':
        for _ in range(data.draw(st.integers(1, 3))):
            p = data.draw(st.integers(0, 32 * m.size - 1))
            m[p >> 5] ^= numpy.uint32(1 << (p & 31))
    elif kind == 'word':
        p = data.draw(st.integers(0, m.size - 1))
        m[p] = data.draw(st.sampled_from(
            [0, 1, 0xFFFFFFFF, 0x80000000, int(m[p]) + 1, int(m[p]) - 1,
             data.draw(st.integers(0, 2 ** 32 - 1))])) & 0xFFFFFFFF
    elif kind == 'insert':
        p = data.draw(st.integers(0, m.size))
        m = numpy.insert(m, p, numpy.uint32(
            data.draw(st.integers(0, 2 ** 32 - 1))))
    else:
        p = data.draw(st.integers(0, m.size - 1))
        m = numpy.delete(m, p)
    return m


@given(messages(), st.data())
def test_valid_messages_agree(msg, data):
    message, sizes, dtypes = msg
    assert agree(message, sizes, dtypes)


@FUZZ
@given(messages(), st.data())
def test_mutated_messages_agree(msg, data):
    message, sizes, dtypes = msg
    for _ in range(data.draw(st.integers(1, 3))):
        message = _mutate(message, data)
    agree(message, sizes, dtypes)


@given(messages())
def test_truncated_messages_rejected(msg):
    message, sizes, dtypes = msg
    assert agree(message, sizes, dtypes)
    for n in range(message.size):
        assert agree(message[:n], sizes, dtypes) is False, n


def body_agree(body, count, size):
    """codec.gap_decode_body and the oracle agree on one body."""
    try:
        want = oracle_decode_body(body, count, size)
    except Reject as e:
        want = e
    try:
        with deadline():
            got = codec.gap_decode_body(
                numpy.array(body, dtype=numpy.uint32), count, size)
    except codec.WireFormatError as e:
        assert isinstance(want, Reject), (
            'codec rejects ({}) a body the oracle accepts: count {} size {} '
            'body {}'.format(e, count, size, body))
        return False
    assert not isinstance(want, Reject), (
        'codec accepts a body the oracle rejects ({}): count {} size {} '
        'body {}'.format(want, count, size, body))
    assert got[0].tolist() == want[0]
    assert got[1].tolist() == want[1]
    return True


@FUZZ
@given(gap_cases(), st.data())
def test_mutated_bodies_agree(case, data):
    """codec.gap_decode_body on bodies with flipped bits, changed or
    missing words, another count or another tensor size."""
    size, index, nibbles, k, sign_only = case
    body = oracle_encode(index, nibbles, k, sign_only)
    count = len(index)
    for _ in range(data.draw(st.integers(1, 3))):
        kind = data.draw(st.sampled_from(
            ['bits', 'bits', 'stream', 'word', 'insert', 'delete', 'count',
             'size']))
        if kind in ('bits', 'stream'):
            lo = 64 if kind == 'stream' and len(body) > 2 else 0
            p = data.draw(st.integers(lo, 32 * len(body) - 1))
            body[p >> 5] ^= 1 << (p & 31)
        elif kind == 'word':
            p = data.draw(st.integers(0, len(body) - 1))
            body[p] = data.draw(st.sampled_from(
                [0, 1, 2 ** 32 - 1, body[p] ^ 0xFFFFFFFF,
                 data.draw(st.integers(0, 2 ** 32 - 1))]))
        elif kind == 'insert':
            body.insert(data.draw(st.integers(0, len(body))),
                        data.draw(st.sampled_from([0, 1, 2 ** 32 - 1])))
        elif kind == 'delete' and len(body) > 1:
            del body[data.draw(st.integers(0, len(body) - 1))]
        elif kind == 'count':
            count = max(1, count + data.draw(st.sampled_from([-2, -1, 1, 2])))
        elif kind == 'size':
            size = max(count, data.draw(st.integers(1, max(1, index[-1] + 1))))
    body_agree(body, count, size)


def test_mutation_coverage():
    """The mutations above produce both kinds of outcome (a fuzzer that
    only ever makes garbage checks nothing about accepted messages)."""
    rnd = random.Random(7)
    seen = {True: 0, False: 0}
    for trial in range(400):
        size = rnd.choice([50, 1000, 2 ** 20, 2 ** 40])
        index = sorted(rnd.sample(range(size), rnd.randrange(1, 30)))
        sign_only = rnd.random() < 0.5
        nibbles = [rnd.randrange(2) << 3 if sign_only else rnd.randrange(16)
                   for _ in index]
        k = rnd.choice([rice_k(len(index), size), rnd.randrange(63)])
        body = oracle_encode(index, nibbles, k, sign_only)
        p = rnd.randrange(32 * len(body))
        body[p >> 5] ^= 1 << (p & 31)
        seen[body_agree(body, len(index), size)] += 1
    assert seen[True] > 20 and seen[False] > 20, seen


def _msg(body, count, e_k=0, scale=1.0):
    return gap_message([(0, count, e_k, scale, body)])


def test_every_single_bit_flip():
    """Every bit of a two-group message flipped, one at a time."""
    sizes = [1000, 2 ** 33]
    g0 = oracle_encode([0, 1, 2, 40, 41, 700, 999], [1, 8, 0, 15, 7, 2, 9],
                       6, False)
    idx1 = [5, 2 ** 20, 2 ** 32 + 1, 2 ** 33 - 1]
    g1 = oracle_encode(idx1, [8, 0, 0, 8], 2, True)
    message = gap_message([(0, 7, 1, 1.0, g0), (1, 4, 0, 0.25, g1)])
    dtypes = [numpy.float32, numpy.float64]
    assert agree(message, sizes, dtypes)
    accepted = 0
    for p in range(32 * message.size):
        m = message.copy()
        m[p >> 5] ^= numpy.uint32(1 << (p & 31))
        accepted += bool(agree(m, sizes, dtypes))
    assert accepted > 0  # some flips (values, e_k) stay valid


def test_reserved_param_bits_rejected():
    """Bit 7 says a restart table follows (issue 25), so it must be 0 for
    3 elements; bits 8..31 are the span (ADDENDUM v2): in a one-tensor
    model any span runs past the model.  gap_decode_body leaves the span
    field to its caller and rejects bit 7 alone."""
    body = list(WORKED_BODY)
    for bit in range(7, 32):
        b = list(body)
        b[0] |= 1 << bit
        assert agree(_msg(b, 3), [100], [numpy.float32]) is False, bit
        if bit == 7:
            with pytest.raises(codec.WireFormatError):
                codec.gap_decode_body(numpy.array(b, dtype=numpy.uint32), 3,
                                      100)
        else:
            got = codec.gap_decode_body(numpy.array(b, dtype=numpy.uint32),
                                        3, 100)
            assert got[0].tolist() == WORKED_INDEX


def test_changed_G_rejected():
    index = [0, 5, 900, 4000, 4001, 70000]
    nib = [1, 2, 3, 4, 5, 6]
    body = oracle_encode(index, nib, 0, False)  # k = 0: long codes
    G = body[1]
    assert G >= 2
    for newG in [0, 1, G - 1, G + 1, G + 2, 2 ** 31, 2 ** 32 - 1]:
        b = list(body)
        b[1] = newG
        if newG < G:  # a shorter stream, the values kept
            b = b[:2 + newG] + b[2 + G:]
        elif newG - G < 10:  # zero words added to the stream
            b = b[:2 + G] + [0] * (newG - G) + b[2 + G:]
        # else: the body runs past the end of the message
        assert agree(_msg(b, 6), [70001], [numpy.float32]) is False, newG


def test_nonzero_padding_rejected():
    # worked example: 17 code bits: bits 17..31 of the gap word are padding;
    # 12 value bits: bits 12..31 of the value word are padding
    for word, first in ((2, 17), (3, 12)):  # the gap word, the value word
        for p in range(first, 32):
            b = list(WORKED_BODY)
            b[word] |= 1 << p
            assert agree(_msg(b, 3), [100], [numpy.float32]) is False, p
            with pytest.raises(codec.WireFormatError):
                codec.gap_decode_body(numpy.array(b, dtype=numpy.uint32), 3,
                                      100)
    # sign-only: 3 value bits
    body = oracle_encode([3, 4, 40], [0, 8, 0], 4, True)
    assert body[3] == 0b010
    assert agree(_msg(body, 3), [100], [numpy.float32])
    for p in range(3, 32):
        b = list(body)
        b[3] |= 1 << p
        assert agree(_msg(b, 3), [100], [numpy.float32]) is False, p
    # a whole extra zero (or nonzero) gap word
    for extra in (0, 1, 0x80000000):
        b = WORKED_BODY[:1] + [2, WORKED_BODY[2], extra, WORKED_BODY[3]]
        assert agree(_msg(b, 3), [100], [numpy.float32]) is False, extra


def test_gap_overrun_rejected():
    for size in (41, 100, 2 ** 40):
        for k in (0, 4, 30, 62):
            body = oracle_encode([3, 4, size], [1, 2, 3], k, False)
            assert agree(_msg(body, 3), [size], [numpy.float32]) is False
            assert agree(_msg(body, 3), [size + 1], [numpy.float32])
            with pytest.raises(codec.WireFormatError):
                codec.gap_decode_body(numpy.array(body, dtype=numpy.uint32),
                                      3, size)
    # first gap alone overruns; the largest gaps (q near 2**63 and beyond)
    for gap in (2 ** 40, 2 ** 62, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1,
                2 ** 64, 2 ** 70):
        for k in (0, 1, 62, 63):
            body = oracle_encode([gap], [1], k, False)
            assert agree(_msg(body, 1), [2 ** 40], [numpy.float32]) is False


def _eg_body(n_zeros, tail_bits=80, k=0):
    """One code: ESC zeros, then ``n_zeros`` zeros, a one and ``tail_bits``
    ones (more than enough for the field and the low bits)."""
    bits = [0] * ESC + [0] * n_zeros + [1] + [1] * tail_bits
    gw = to_words(bits)
    return [k, len(gw)] + gw + [1]


def test_elias_gamma_prefix_of_64_zeros_rejected():
    for n in (62, 63, 64, 65, 100, 300):
        for k in (0, 1, 63):
            body = _eg_body(n, tail_bits=n + k, k=k)
            assert agree(_msg(body, 1), [2 ** 62], [numpy.float32]) is False
            with pytest.raises(codec.WireFormatError):
                codec.gap_decode_body(numpy.array(body, dtype=numpy.uint32),
                                      1, 2 ** 62)
    # all zeros: the prefix runs to the end of the stream
    for G in (1, 2, 3, 5):
        body = [0, G] + [0] * G + [0]
        assert agree(_msg(body, 1), [2 ** 62], [numpy.float32]) is False


def test_count_larger_than_codes_rejected():
    index = [0, 1, 2, 3, 9, 33]
    for k in (0, 2, 5):
        for sign_only in (False, True):
            nib = [8 * (i % 2) for i in range(6)]
            body = oracle_encode(index, nib, k, sign_only)
            assert agree(_msg(body, 6), [34], [numpy.float32])
            for count in (7, 8, 9, 33, 34, 35, 2 ** 32 - 1):
                assert agree(_msg(body, count), [34], [numpy.float32]) is False
                # values padded to the new count: only the codes are missing
                vb = 1 if sign_only else 4
                need = (count * vb + 31) // 32
                if need < 10:
                    b = body[:2 + body[1]] + (
                        body[2 + body[1]:] + [0] * need)[:need]
                    assert agree(_msg(b, count), [40], [numpy.float32]) \
                        is False, count


def _peak_bytes(f, *args):
    """Peak memory (tracemalloc: NumPy's buffers and Python's objects) of
    ``f(*args)``, which must raise WireFormatError; and its message."""
    tracemalloc.start()
    try:
        with pytest.raises(codec.WireFormatError) as e:
            f(*args)
        return tracemalloc.get_traced_memory()[1], str(e.value)
    finally:
        tracemalloc.stop()


def test_corrupt_stream_length_costs_no_more_than_the_message():
    """Issue 24, finding 6: a 4 MB message of one FMT_GAP group claiming one
    element, its stream all-ones words, is refused at once: the decoder
    checks G against the words one code can fill before decoding (it
    used to turn every bit of the stream into a Python int first: 1.5 GB
    and seconds here, about 25 GB for a 64 MB message)."""
    words = (4 << 20) // 4
    G = words - 2 - 5 - 3
    body = numpy.full(2 + G + 1, 0xFFFFFFFF, dtype=numpy.uint32)
    body[0], body[1], body[-1] = 0, G, 0  # k = 0, values: one zero word
    message = _msg(body, 1)
    assert message.nbytes == 4 << 20
    sizes, dtypes = [2 ** 20], [numpy.float32]
    peak, text = _peak_bytes(codec.unpack, message, sizes, dtypes)
    assert 'gap stream longer than its codes' in text
    assert peak < 4 * message.nbytes, peak  # unpack copies the body once
    peak, text = _peak_bytes(codec.gap_decode_body, body, 1, 2 ** 20)
    assert 'gap stream longer than its codes' in text
    assert peak < body.nbytes // 8, peak
    # the native decoder refuses it too (and the reference names why)
    from chainer_vgc.engines.native import gap as native_gap
    assert native_gap.gap_decode(body, 1, 2 ** 20) is None


@given(gap_cases())
def test_valid_streams_lie_within_the_length_bounds(case):
    """Every valid stream fills between count * (1 + k) bits and
    count * (GAP_LONGEST_CODE + k) bits (in words: gap_stream_words)."""
    size, index, nibbles, k, sign_only = case
    body = oracle_encode(index, nibbles, k, sign_only)
    least, most = codec.gap.gap_stream_words(len(index), k)
    assert least <= body[1] <= most


def test_stream_length_bounds_are_checked_first():
    """A G outside gap_stream_words is refused before any code is read,
    by V21 (too short) or V24 (too long); the bounds refuse no valid
    stream: the longest code the decoder reads (gamma prefix of 63 zeros,
    GAP_LONGEST_CODE + k bits) still fits and is refused as an overrun,
    and the longest accepted one (prefix of 62) decodes."""
    assert codec.gap.GAP_LONGEST_CODE == ESC + 63 + 1 + 63
    for count, k in ((1, 0), (1, 63), (3, 5), (40, 0), (40, 62)):
        least, most = codec.gap.gap_stream_words(count, k)
        assert least == -(-count * (1 + k) // 32)
        assert most == -(-count * (ESC + 127 + k) // 32)
        values = [0] * (-(-count * 4 // 32))
        for G, why in ((least - 1, 'code {} runs past'.format(
                32 * (least - 1) // (1 + k))),
                       (most + 1, 'gap stream longer than its codes')):
            if G < 0:
                continue
            body = numpy.array([k, G] + [0xFFFFFFFF] * G + values,
                               dtype=numpy.uint32)
            with pytest.raises(codec.WireFormatError, match=why):
                codec.gap_decode_body(body, count, 2 ** 62)
            assert agree(_msg(body, count), [2 ** 62], [numpy.float64]) \
                is False
    for n, k, size, ok in ((63, 0, 2 ** 62, False), (63, 5, 2 ** 62, False),
                           (62, 0, 2 ** 62 + 16, True)):
        bits = [0] * ESC + [0] * n + [1] + [0] * n + [0] * k
        assert len(bits) == codec.gap.GAP_LONGEST_CODE + k - 2 * (63 - n)
        stream = to_words(bits)
        assert len(stream) <= codec.gap.gap_stream_words(1, k)[1]
        body = numpy.array([k, len(stream)] + stream + [0],
                           dtype=numpy.uint32)
        if ok:  # gap 2**62 + 15: v = 2**62, q = v + 15
            index, _ = codec.gap_decode_body(body, 1, size)
            assert index.tolist() == [2 ** 62 + 15]
        else:
            with pytest.raises(codec.WireFormatError, match='overruns'):
                codec.gap_decode_body(body, 1, size)


@pytest.mark.filterwarnings('ignore:overflow encountered:RuntimeWarning')
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
@pytest.mark.parametrize('sign_only', [False, True])
def test_exponent_and_scale_checks(dtype, sign_only):
    """e_k and scale are checked as for FMT_POW2: scale finite and > 0,
    e_k in the state dtype's exponent range, all 16 values finite and
    nonzero in the state dtype."""
    fi = numpy.finfo(dtype)
    nibbles = [8, 0, 8] if sign_only else [1, 8, 15]
    body = oracle_encode([3, 4, 40], nibbles, 4, sign_only)
    accepted = 0
    for e_k in (fi.minexp - 1, fi.minexp, fi.minexp + 1, -1, 0, 1,
                fi.maxexp - 2, fi.maxexp - 1, fi.maxexp, -2 ** 31,
                2 ** 31 - 1):
        for scale in (1.0, 0.5, 1.5, 0.0, -0.0, -1.0, float('inf'),
                      float('nan'), 1e-45, 1e-40, 1.17e-38, 3.4e38):
            ok = agree(_msg(body, 3, e_k, scale), [41], [dtype])
            accepted += ok
            if scale == 1.0 and e_k in (fi.minexp, 0, fi.maxexp - 1):
                assert ok, (e_k, scale)
            if e_k in (fi.minexp - 1, fi.maxexp) or not scale > 0:
                assert not ok, (e_k, scale)
    assert accepted > 10


def test_decoder_accepts_k_63():
    """k is a 6-bit field: 63 is a valid parameter (gaps < 2**63)."""
    for index in ([0], [5], [2 ** 62, 2 ** 62 + 1]):
        body = oracle_encode(index, [2] * len(index), 63, False)
        size = index[-1] + 1
        assert agree(_msg(body, len(index)), [size], [numpy.float32])
        got_index, _ = codec.gap_decode_body(
            numpy.array(body, dtype=numpy.uint32), len(index), size)
        assert got_index.tolist() == index


# ---- tensors beyond FMT_POW2's 2**28 elements -------------------------------

def _large_case(size, index, coding='auto'):
    index = numpy.asarray(index, dtype=numpy.int64)
    rnd = numpy.random.default_rng(int(size) % 1000)
    nibbles = rnd.integers(0, 16, size=index.size).astype(numpy.uint32)
    words = (nibbles << numpy.uint32(28)) | (
        index & INDEX_MASK).astype(numpy.uint32)
    g = codec.pow2_best_group(0, words, index, 1, 1.0, size, coding=coding)
    assert g.fmt == FMT_GAP
    msg = codec.pack([g])
    walked = list(walk(msg, [size]))
    assert len(walked) == 1 and walked[0].fmt == FMT_GAP
    assert walked[0].count == index.size
    (dec,) = codec.unpack(msg, [size], [numpy.float32])
    assert numpy.array_equal(dec.index, index)
    want = numpy.ldexp(numpy.float32(1), 1 - (nibbles & 7).astype(numpy.int32))
    want = numpy.where(nibbles >> 3 != 0, -want, want).astype(numpy.float32)
    assert numpy.array_equal(dec.value, want)
    with pytest.raises(codec.WireFormatError):  # the last index is too big
        codec.unpack(msg, [int(index[-1])], [numpy.float32])
    return g, nibbles, msg


@pytest.mark.parametrize('size', [2 ** 28 + 5, 2 ** 32 + 3, 2 ** 40])
def test_large_tensor_few_elements(size):
    """Few elements: the gap body is longer than FMT_POW2's count words,
    but FMT_POW2 cannot address the tensor: FMT_GAP anyway."""
    index = [0, 2 ** 28 - 1, 2 ** 28, 2 ** 28 + 1, size - 1]
    for idx in ([size - 1], index):
        g, nibbles, msg = _large_case(size, idx)
        body = oracle_encode(idx, nibbles.tolist(), rice_k(len(idx), size),
                             False)
        assert numpy.asarray(g.body).tolist() == body
        assert oracle_unpack(msg, [size], [numpy.float32])[0][1] == idx
        assert agree(msg, [size], [numpy.float32])


@pytest.mark.parametrize('size', [2 ** 28 + 5, 2 ** 32 + 7])
def test_large_tensor_dense_selection(size):
    """A dense-ish selection (runs of consecutive elements around 2**28 and
    at the end) still gives FMT_GAP for a tensor FMT_POW2 cannot address."""
    index = numpy.unique(numpy.concatenate([
        numpy.arange(0, 20000, 2), numpy.arange(2 ** 28 - 3000, 2 ** 28 + 3),
        numpy.arange(size - 4000, size)]))
    g, nibbles, msg = _large_case(size, index)
    body = oracle_encode(index.tolist(), nibbles.tolist(),
                         rice_k(index.size, size), False)
    assert numpy.asarray(g.body).tolist() == body
    assert g.body.size < index.size  # shorter than FMT_POW2 would be, too
    # ~100000 elements spread over the whole tensor
    _large_case(size, numpy.arange(0, size, size // 100000,
                                   dtype=numpy.int64))


@pytest.mark.parametrize('size', [2 ** 28 + 1, 2 ** 32 + 3])
def test_large_tensor_fixed_coding_refused(size):
    index = numpy.array([0, 5, size - 1], dtype=numpy.int64)
    words = (index & INDEX_MASK).astype(numpy.uint32)
    with pytest.raises(ValueError) as e:
        codec.pow2_best_group(0, words, index, 0, 1.0, size, coding='fixed')
    assert not isinstance(e.value, codec.WireFormatError)
    text = str(e.value)
    assert str(size) in text or '2**28' in text or str(2 ** 28) in text, text
    # 2**28 itself is addressable
    index = numpy.array([0, 2 ** 28 - 1], dtype=numpy.int64)
    g = codec.pow2_best_group(0, (index & INDEX_MASK).astype(numpy.uint32),
                              index, 0, 1.0, 2 ** 28, coding='fixed')
    assert g.fmt == codec.FMT_POW2


# ---- the encoder's choice ---------------------------------------------------

def _choose(size, index, nibbles, sign_only, coding):
    index = numpy.asarray(index, dtype=numpy.int64)
    return codec.pow2_best_group(
        0, pow2_words(index.tolist(), nibbles), index, 0,
        1.0, size, coding=coding, sign_only=sign_only)


def gap_body_len(size, index, sign_only):
    k = rice_k(len(index), size)
    bits = sum(code_bits(g, k) for g in gaps_of(index))
    return (2 + 4 * restarts(len(index)) + (bits + 31) // 32
            + (len(index) * (1 if sign_only else 4) + 31) // 32)


@given(gap_cases(('small', 'medium'), forced_k=False))
def test_auto_never_longer_than_pow2(case):
    size, index, nibbles, _, sign_only = case
    g = _choose(size, index, nibbles, sign_only, 'auto')
    n_gap = gap_body_len(size, index, sign_only)
    assert g.body.size <= len(index)
    if n_gap < len(index):
        assert g.fmt == FMT_GAP
        assert g.body.size == n_gap
    else:
        assert g.fmt == FMT_POW2
        assert g.body.tolist() == pow2_words(index, nibbles).tolist()
    assert _choose(size, index, nibbles, sign_only, 'gap').fmt == FMT_GAP
    assert _choose(size, index, nibbles, sign_only, 'fixed').fmt == FMT_POW2


def _tie(count, sign_only, seed):
    """A selection whose gap body is exactly ``count`` words."""
    rnd = random.Random(seed)
    for _ in range(20000):
        size = rnd.randrange(count, min(count * 2 ** rnd.randrange(1, 40),
                                        MAX_POW2_SIZE + 1))
        index = sorted(rnd.sample(range(size), count))
        if gap_body_len(size, index, sign_only) == count:
            return size, index
    raise AssertionError('no tie found')


@pytest.mark.parametrize('count', [4, 5, 8, 12, 16])
@pytest.mark.parametrize('sign_only', [False, True])
def test_ties_go_to_pow2(count, sign_only):
    size, index = _tie(count, sign_only, count)
    nibbles = [8 * (i % 2) for i in range(count)]
    assert _choose(size, index, nibbles, sign_only, 'auto').fmt == FMT_POW2
    g = _choose(size, index, nibbles, sign_only, 'gap')
    assert g.fmt == FMT_GAP and g.body.size == count


def test_coding_argument():
    index, nibbles = [2, 3, 4, 5], [0, 1, 2, 3]
    for size in (6, 100, 2 ** 28):
        assert _choose(size, index, nibbles, False, 'fixed').fmt == FMT_POW2
        assert _choose(size, index, nibbles, False, 'gap').fmt == FMT_GAP


# ---- the native backend -----------------------------------------------------



def native_agree(body, count, size):
    """native_gap.gap_decode (None: invalid) and the oracle agree on one body.
    Returns True when accepted."""
    from chainer_vgc.engines.native import gap as native_gap
    try:
        want = oracle_decode_body(body, count, size)
    except Reject as e:
        want = e
    with deadline():
        got = native_gap.gap_decode(numpy.array(body, dtype=numpy.uint32),
                                    count, size)
    if got is None:
        assert isinstance(want, Reject), (
            'native rejects a body the oracle accepts: count {} size {} '
            'body {}'.format(count, size, body))
        return False
    assert not isinstance(want, Reject), (
        'native accepts a body the oracle rejects ({}): count {} size {} '
        'body {}'.format(want, count, size, body))
    assert numpy.asarray(got[0]).tolist() == want[0]
    assert numpy.asarray(got[1]).tolist() == want[1]
    return True


@given(gap_cases())
def test_native_gap_codec_matches_oracle(case):
    from chainer_vgc.engines.native import gap as native_gap
    size, index, nibbles, k, sign_only = case
    want = _check_encoder(native_gap.gap_encode, index, nibbles, k, sign_only)
    assert native_agree(want, len(index), size)


def test_native_worked_example_and_k_63():
    from chainer_vgc.engines.native import gap as native_gap
    body = native_gap.gap_encode(numpy.array(WORKED_INDEX), numpy.array(
        WORKED_NIBBLES, dtype=numpy.uint8), 4, False)
    assert body.tolist() == WORKED_BODY
    assert native_agree(WORKED_BODY, 3, 100)
    for index in ([0], [5], [2 ** 62, 2 ** 62 + 1]):
        body = oracle_encode(index, [2] * len(index), 63, False)
        assert native_gap.gap_encode(numpy.array(index), numpy.array(
            [2] * len(index), dtype=numpy.uint8), 63, False).tolist() == body
        assert native_agree(body, len(index), index[-1] + 1)


@FUZZ
@given(gap_cases(), st.data())
def test_native_gap_decode_agrees_on_mutated_bodies(case, data):
    size, index, nibbles, k, sign_only = case
    body = oracle_encode(index, nibbles, k, sign_only)
    for _ in range(data.draw(st.integers(1, 3))):
        p = data.draw(st.integers(0, 32 * len(body) - 1))
        body[p >> 5] ^= 1 << (p & 31)
    count = len(index) + data.draw(st.sampled_from([0, 0, 0, 1, -1]))
    assume(count >= 1)
    size = data.draw(st.sampled_from([size, size, index[-1], size + 1]))
    native_agree(body, count, size)


def test_native_gap_decode_rejects_crafted_bodies():
    """The hand-made faults of the codec tests above, on the native
    decoder."""
    bad = []
    for bit in (7,):  # the reserved param bit (8..31: the caller's span)
        bad.append(([WORKED_BODY[0] | 1 << bit] + WORKED_BODY[1:], 3, 100))
    for p in range(17, 32):  # gap stream padding
        bad.append((WORKED_BODY[:2] + [WORKED_BODY[2] | 1 << p]
                    + WORKED_BODY[3:], 3, 100))
    for p in range(12, 32):  # value padding
        bad.append((WORKED_BODY[:3] + [WORKED_BODY[3] | 1 << p], 3, 100))
    bad.append((WORKED_BODY[:1] + [2, WORKED_BODY[2], 0, WORKED_BODY[3]],
                3, 100))  # an extra zero gap word
    bad.append((WORKED_BODY, 3, 40))  # overrun
    bad.append((WORKED_BODY, 4, 100))  # a code missing
    for G in (0, 2, 2 ** 32 - 1):
        bad.append((WORKED_BODY[:1] + [G] + WORKED_BODY[2:], 3, 100))
    for n in (62, 63, 64, 65, 300):  # Elias-gamma prefixes
        for k in (0, 63):
            bad.append((_eg_body(n, tail_bits=n + k, k=k), 1, 2 ** 62))
    for gap in (2 ** 40, 2 ** 63 - 1, 2 ** 63, 2 ** 64, 2 ** 70):
        for k in (0, 1, 62, 63):
            bad.append((oracle_encode([gap], [1], k, False), 1, 2 ** 40))
    for G in (1, 2, 5):
        bad.append(([0, G] + [0] * G + [0], 1, 2 ** 62))
    for n in range(len(WORKED_BODY)):  # truncated
        bad.append((WORKED_BODY[:n], 3, 100))
    for body, count, size in bad:
        assert native_agree(body, count, size) is False, (body, count, size)


# ---- ADDENDUM v2: FMT_GAP groups spanning several tensors -------------------
#
# Param word bits 8..31 = span: the group covers tensors t0 .. t0 + span
# (all in the model), their index spaces concatenated in id order; count
# <= span_size (the sum of their sizes), k = rice_k(count, span_size); the
# values are made in each tensor's state dtype; the next group's id must be
# > t0 + span; bit 7 stays reserved.  codec.merge_spans re-encodes maximal
# runs of consecutive FMT_POW2/FMT_GAP groups with equal a and b as one
# span group when that is strictly shorter (reference.oracle_merge_spans).

import reference  # NOQA: E402 (the oracle module, for the merge rule)

SPAN_DTYPES = [numpy.float16, numpy.float32, numpy.float64]

#: the worked span example: sizes [3, 0, 5], tensor 0 gets element 2,
#: tensor 1 (empty) nothing, tensor 2 elements 0 and 4: indices 2, 3, 7 of
#: the 8-element span, count 3, k = rice_k(3, 8) = 0 ((11 * 5) // 48 = 1);
#: gaps 2, 0, 3: codes 001 | 1 | 0001 -> bits 2, 3, 7 set = 0x8C; nibbles
#: 1, 8, 2 -> 0x281; param = span 2 << 8
SPAN_SIZES = [3, 0, 5]
SPAN_BODY = [0x200, 1, 0x8C, 0x281]


def span_message(groups):
    """A message from ``(t0, count, e_k, scale, body)`` or full
    ``(tensor_id, fmt, count, a, b, body)`` groups (as :func:`gap_message`;
    the span is in the body's param word)."""
    return gap_message(groups)


def test_oracle_span_worked_example():
    assert rice_k(3, 8) == 0
    assert oracle_encode([2, 3, 7], [1, 8, 2], 0, False, span=2) == SPAN_BODY
    assert gap_span(SPAN_BODY[0]) == 2
    assert oracle_decode_body(SPAN_BODY, 3, 8) == ([2, 3, 7], [1, 8, 2])
    msg = span_message([(0, 3, 0, 1.0, SPAN_BODY)])
    got = oracle_unpack(msg, SPAN_SIZES, [numpy.float32] * 3)
    assert got == [(0, [2], [0.5]), (2, [0, 4], [-1.0, 0.25])]
    for sizes in ([3, 0], [3, 0, 4], [3, 0, 5, 1]):  # past / too small / ok
        try:
            oracle_unpack(msg, sizes, [numpy.float32] * len(sizes))
            ok = True
        except Reject:
            ok = False
        assert ok == (len(sizes) == 4)
    # reference.py's whole-message decoders
    assert reference.parse_message(msg) == [(0, FMT_GAP, 3, 0, f32_bits(1.0),
                                             SPAN_BODY)]
    dense = reference.decode_message(msg, SPAN_SIZES)
    assert [d.tolist() for d in dense] == [[0, 0, 0.5], [],
                                           [-1.0, 0, 0, 0, 0.25]]
    assert reference.split_group(0, FMT_GAP, 3, 0, f32_bits(1.0), SPAN_BODY,
                                 SPAN_SIZES) == [(0, [2], [0.5]),
                                                 (2, [0, 4], [-1.0, 0.25])]
    # values in each tensor's state dtype: float64 keeps 2**-1000
    e_k = -1000
    msg = span_message([(0, 3, e_k, 1.0, SPAN_BODY)])
    with pytest.raises(Reject):
        oracle_unpack(msg, SPAN_SIZES, [numpy.float64, numpy.float64,
                                        numpy.float32])
    with pytest.raises(Reject):
        oracle_unpack(msg, SPAN_SIZES, [numpy.float32, numpy.float64,
                                        numpy.float64])
    got = oracle_unpack(msg, SPAN_SIZES, [numpy.float64, numpy.float32,
                                          numpy.float64])  # tensor 1: empty
    assert got[0] == (0, [2], [2.0 ** (e_k - 1)])


def test_oracle_merge_rule_by_hand():
    """Two FMT_POW2 groups with equal a and b (tensors 0 and 2; tensor 1
    sends nothing): 8 + 7 = 15 words; one span group over 0..2: count 5,
    span_size 100 + 7 + 50, k = rice_k(5, 157) = 4 ((11 * 152) // 80 =
    20); gaps 3, 0, 35, 59 + 7 + 0 = 66, 9: 5 + 5 + 7 + 9 + 5 = 31 bits
    (G = 1); 20 value bits: a 9-word group."""
    sizes = [100, 7, 50]
    g0 = (0, FMT_POW2, 3, 0, f32_bits(1.0), pow2_words([3, 4, 40],
                                                       [1, 8, 2]))
    g2 = (2, FMT_POW2, 2, 0, f32_bits(1.0), pow2_words([0, 10], [0, 9]))
    msg = span_message([g0, g2])
    assert rice_k(5, 157) == 4
    idx = [3, 4, 40, 107, 117]
    assert sum(code_bits(g, 4) for g in gaps_of(idx)) == 31
    body = oracle_encode(idx, [1, 8, 2, 0, 9], 4, False, span=2)
    want = [MAGIC, 1, 0, FMT_GAP, 5, 0, f32_bits(1.0)] + body
    assert len(want) == 2 + 9 and body[0] == 4 | 2 << 8
    assert reference.oracle_merge_spans(msg, sizes) == want
    # another scale on tensor 2: two runs of one group, left alone
    g2b = g2[:4] + (f32_bits(0.5),) + g2[5:]
    msg2 = span_message([g0, g2b])
    assert reference.oracle_merge_spans(msg2, sizes) == msg2.tolist()
    # all d = 0 -> SIGN_ONLY
    g0s = g0[:5] + (pow2_words([3, 4, 40], [0, 8, 0]),)
    g2s = g2[:5] + (pow2_words([0, 10], [8, 8]),)
    m = reference.oracle_merge_spans(span_message([g0s, g2s]), sizes)
    assert m[7] == 4 | SIGN_ONLY | 2 << 8
    assert len(m) == 2 + 5 + 4  # 1 value word (5 bits)
    # a run that does not shrink: one element with d = 1 (6 words) before
    # 1000 sign-only elements (5 + 2 + 32 + 32 words): one group needs
    # 4-bit values for all 1001 (5 + 2 + 32 + 126 words)
    big, m = _no_shrink_run()
    assert reference.oracle_merge_spans(m, big) == m.tolist()
    # two FMT_POW2 elements at the ends of 2**28-element tensors: 12 words,
    # the span group 5 + 2 + 2 + 1
    ga = (0, FMT_POW2, 1, 0, f32_bits(1.0), pow2_words([0], [1]))
    gb = (1, FMT_POW2, 1, 0, f32_bits(1.0), pow2_words([2 ** 28 - 1], [1]))
    m = reference.oracle_merge_spans(span_message([ga, gb]), [2 ** 28] * 2)
    assert len(m) == 2 + 10 and m[2] == 0 and gap_span(m[7]) == 1


def _no_shrink_run():
    sizes = [1, 1000]
    ga = (0, FMT_POW2, 1, 0, f32_bits(1.0), pow2_words([0], [1]))
    gb = (1, 1000, 0, 1.0, oracle_encode(list(range(1000)), [8] * 1000,
                                         rice_k(1000, 1000), True))
    return sizes, span_message([ga, gb])


def test_codec_span_worked_example():
    assert codec.GAP_SPAN_SHIFT == 8
    assert codec.MAX_GAP_SPAN == 2 ** 24 - 1
    body = codec.gap_body(numpy.array([2, 3, 7], dtype=numpy.int64),
                          numpy.array([1, 8, 2], dtype=numpy.uint8), 0,
                          False, span=2)
    assert body.tolist() == SPAN_BODY
    dtypes = [numpy.float32, numpy.float16, numpy.float64]
    msg = span_message([(0, 3, 0, 1.0, SPAN_BODY)])
    assert agree(msg, SPAN_SIZES, dtypes)
    outs = [numpy.zeros(n, dtype=d) for n, d in zip(SPAN_SIZES, dtypes)]
    assert codec.decode_into(msg, outs) == 3
    assert [o.tolist() for o in outs] == [[0, 0, 0.5], [],
                                          [-1.0, 0, 0, 0, 0.25]]
    assert outs[2].dtype == numpy.float64
    for sizes in ([3, 0], [3, 0, 4], [2, 0, 5], [1, 1, 5]):
        assert agree(msg, sizes, [numpy.float32] * len(sizes)) is False
    # the same 8-element space cut elsewhere
    assert [d.tensor_id for d in codec.unpack(msg, [3, 1, 4], [numpy.float32]
                                              * 3) if d.index.size] == [0, 1,
                                                                        2]
    assert agree(msg, [3, 1, 4], [numpy.float32] * 3)
    assert agree(msg, [3, 0, 5, 9], [numpy.float32] * 4)
    assert agree(msg, [4, 0, 4], [numpy.float32] * 3)  # same space


@given(st.data())
def test_gap_body_with_span_matches_oracle(data):
    size, index, nibbles, k, sign_only = data.draw(gap_cases())
    span = data.draw(st.sampled_from([0, 1, 7, 255, 256, 2 ** 24 - 1]))
    want = oracle_encode(index, nibbles, k, sign_only, span=span)
    body = codec.gap_body(numpy.array(index, dtype=numpy.int64),
                          numpy.array(nibbles, dtype=numpy.uint8), k,
                          sign_only, span=span)
    assert body.tolist() == want
    got = codec.gap_decode_body(body, len(index), size)
    assert got[0].tolist() == index and got[1].tolist() == nibbles


# ---- strategies: models and span messages -----------------------------------

@st.composite
def span_models(draw, max_tensors=8):
    """(sizes, dtypes, selections): 1 to ``max_tensors`` tensors of mixed
    dtypes, sizes 1 .. 2**40 (mostly small), each with a sorted selection
    (some empty) and its nibbles (some all with d = 0)."""
    n = draw(st.integers(1, max_tensors))
    rnd = random.Random(draw(st.integers(0, 2 ** 32)))
    sizes, dtypes, sels = [], [], []
    for _ in range(n):
        kind = draw(st.sampled_from(['one', 'small', 'small', 'small',
                                     'medium', 'huge', 'zero']))
        size = {'one': 1, 'zero': 0, 'small': rnd.randrange(1, 200),
                'medium': rnd.randrange(1, 2 ** 22),
                'huge': rnd.randrange(2 ** 28 + 1, 2 ** 40)}[kind]
        sizes.append(size)
        dtypes.append(draw(st.sampled_from(SPAN_DTYPES)))
        if size == 0 or draw(st.integers(0, 3)) == 0:
            sels.append(([], []))
            continue
        count = rnd.randrange(1, min(size, 40) + 1)
        if size <= 2 ** 22:
            index = sorted(rnd.sample(range(size), count))
        else:
            index = sorted(set(rnd.randrange(size) for _ in range(count))
                           | ({size - 1} if rnd.random() < 0.3 else set()))
        sign_only = draw(st.integers(0, 2)) == 0
        nibbles = [rnd.randrange(2) << 3 if sign_only else rnd.randrange(16)
                   for _ in index]
        sels.append((index, nibbles))
    return sizes, dtypes, sels


#: e_k, scale pairs: few, so that neighbours often share them
TABLES = [(0, 1.0), (0, 0.5), (-3, 1.0), (2, 0.75)]


@st.composite
def span_messages(draw, max_tensors=8):
    """(message, sizes, dtypes): a model and a message of FMT_POW2, FMT_GAP
    and FMT_GAP span groups (spans over runs of tensors, some of them
    empty, any k)."""
    sizes, dtypes, sels = draw(span_models(max_tensors))
    groups, t, n = [], 0, len(sizes)
    while t < n:
        span = draw(st.integers(0, n - 1 - t))
        if draw(st.booleans()):
            span = 0
        cover = range(t, t + span + 1)
        elements, base = [], 0
        for u in cover:
            elements += [(base + i, nib) for i, nib in zip(*sels[u])]
            base += sizes[u]
        t += span + 1
        if not elements:
            continue
        index = [i for i, _ in elements]
        nibbles = [nib for _, nib in elements]
        e_k, scale = draw(st.sampled_from(TABLES))
        if span == 0 and base <= MAX_POW2_SIZE and draw(st.booleans()):
            groups.append((cover[0], FMT_POW2, len(index), e_k & 0xFFFFFFFF,
                           f32_bits(scale), pow2_words(index, nibbles)))
            continue
        sign_only = all(nib & 7 == 0 for nib in nibbles) and draw(
            st.booleans())
        k = (draw(st.integers(0, 62)) if draw(st.integers(0, 3)) == 0
             else rice_k(len(index), base))
        groups.append((cover[0], len(index), e_k, scale, oracle_encode(
            index, nibbles, k, sign_only, span=span)))
    assume(groups)
    return span_message(groups), sizes, dtypes


def oracle_dense(message, sizes, dtypes):
    """Dense arrays in the given dtypes of what the oracle decodes (each
    value made in the state dtype, then cast to the tensor's)."""
    outs = [numpy.zeros(n, dtype=d) for n, d in zip(sizes, dtypes)]
    for tid, index, values in oracle_unpack(message, sizes, dtypes):
        for i, v in zip(index, values):
            outs[tid][i] = numpy.array(v).astype(dtypes[tid])
    return outs


def check_decoders(message, sizes, dtypes):
    """codec.unpack, codec.decode_into and expand_gap + add_validated all
    give the oracle's elements (models of up to 2**22-element tensors:
    dense outputs)."""
    assert agree(message, sizes, dtypes)
    want = oracle_dense(message, sizes, dtypes)
    outs = [numpy.zeros(n, dtype=d) for n, d in zip(sizes, dtypes)]
    n = codec.decode_into(message, outs)
    assert n == sum(len(x[1]) for x in oracle_unpack(message, sizes, dtypes))
    for o, w in zip(outs, want):
        assert o.dtype == w.dtype
        reference.assert_bitwise(o, w)
    # the device path's host side: expand_gap, then add_validated into
    # accumulators of the state dtype
    sdt = [numpy.float64 if numpy.dtype(d) == numpy.float64
           else numpy.float32 for d in dtypes]
    want = oracle_dense(message, sizes, sdt)
    expanded = codec.expand_gap(message, sizes)
    outs2 = [numpy.zeros(n, dtype=d) for n, d in zip(sizes, sdt)]
    assert codec.add_validated(expanded, expanded, outs2, sizes) == n
    for o, w in zip(outs2, want):
        reference.assert_bitwise(o, w)


def _small(sizes):
    return max(sizes) <= 2 ** 22


@given(span_messages())
def test_span_messages_decode_like_the_oracle(msg):
    message, sizes, dtypes = msg
    if _small(sizes):
        check_decoders(message, sizes, dtypes)
    else:
        assert agree(message, sizes, dtypes)
    # reference.decode_message (used by other tests) agrees with unpack
    if _small(sizes):
        dense = reference.decode_message(message, sizes)
        for tid, index, values in oracle_unpack(message, sizes, dtypes):
            assert dense[tid][index].tolist() == [float(v) for v in values]


def _merge_input(draw, sizes, sels):
    """Single-tensor groups (FMT_POW2 or FMT_GAP, sometimes a FMT_RAW that
    breaks runs) for the nonempty tensors, tables from :data:`TABLES` (the
    first few only, so that runs form)."""
    tables = TABLES[:draw(st.integers(1, 3))]
    groups = []
    for t, (index, nibbles) in enumerate(sels):
        if not index:
            continue
        e_k, scale = draw(st.sampled_from(tables))
        choice = draw(st.sampled_from(['pow2', 'gap', 'gap', 'raw']
                                      if sizes[t] <= MAX_POW2_SIZE
                                      else ['gap']))
        if choice == 'raw' and draw(st.integers(0, 3)) == 0:
            g = codec.raw_group(t, numpy.array(index, dtype=numpy.int64),
                                numpy.ones(len(index), dtype=numpy.float32),
                                sizes[t])
            groups.append(tuple(g[:5]) + (numpy.asarray(g.body),))
        elif choice == 'pow2' or choice == 'raw':
            groups.append((t, FMT_POW2, len(index), e_k & 0xFFFFFFFF,
                           f32_bits(scale), pow2_words(index, nibbles)))
        else:
            sign_only = all(n & 7 == 0 for n in nibbles) and draw(
                st.booleans())
            groups.append((t, len(index), e_k, scale, oracle_encode(
                index, nibbles, rice_k(len(index), sizes[t]), sign_only)))
    assume(groups)
    return span_message(groups)


def _dense_of(message, sizes):
    return [d.tolist() for d in reference.decode_message(message, sizes)]


@given(span_models(), st.data())
def test_merge_spans_matches_the_oracle(model, data):
    sizes, dtypes, sels = model
    message = _merge_input(data.draw, sizes, sels)
    want = reference.oracle_merge_spans(message, sizes)
    got = codec.merge_spans(message, sizes)
    assert got.dtype == numpy.uint32
    assert got.tolist() == want
    assert got.size <= message.size  # never longer
    # merged groups only where a and b agree, spans only of FMT_GAP
    before = reference.parse_message(message)
    for tid, fmt, count, a, b, body in reference.parse_message(got):
        if fmt == FMT_GAP and gap_span(body[0]):
            inside = [g for g in before
                      if tid <= g[0] <= tid + gap_span(body[0])]
            assert len(inside) >= 2
            assert all((g[3], g[4]) == (a, b) for g in inside)
            assert all(g[1] in (FMT_POW2, FMT_GAP) for g in inside)
    # the same elements, and idempotent
    if _small(sizes) and all(g[1] != codec.FMT_RAW for g in before):
        assert _dense_of(got, sizes) == _dense_of(message, sizes)
        check_decoders(got, sizes, dtypes)
    else:
        assert agree(got, sizes, dtypes) is not False
    assert codec.merge_spans(got, sizes).tolist() == want


@given(span_messages())
def test_merge_spans_of_span_messages(msg):
    """Input groups that already span tensors: the rule still holds (a
    group's last tensor is t0 + span)."""
    message, sizes, dtypes = msg
    want = reference.oracle_merge_spans(message, sizes)
    got = codec.merge_spans(message, sizes)
    assert got.tolist() == want
    assert got.size <= message.size


def test_merge_spans_leaves_short_messages_alone():
    sizes = [100, 7, 50]
    g0 = (0, FMT_POW2, 3, 0, f32_bits(1.0), pow2_words([3, 4, 40],
                                                       [1, 8, 2]))
    g2 = (2, FMT_POW2, 2, 0, f32_bits(0.5), pow2_words([0, 10], [0, 9]))
    for groups in ([g0], [g0, g2], [g2]):
        m = span_message(groups)
        assert codec.merge_spans(m, sizes).tolist() == m.tolist()
    big, m = _no_shrink_run()
    assert codec.merge_spans(m, big).tolist() == m.tolist()
    empty = numpy.array([MAGIC, 0], dtype=numpy.uint32)
    assert codec.merge_spans(empty, sizes).tolist() == [MAGIC, 0]


def test_merge_spans_takes_groups_of_at_most_1024_elements():
    """A group of 1025 elements ends a run (re-encoding big groups costs
    more time than their 7-word overhead is worth); 1024 joins one."""
    assert codec.MERGE_MAX_COUNT == reference.MERGE_MAX == 1024
    sizes = [5000, 3, 5000]
    for n, merged in ((1024, True), (1025, False)):
        index = numpy.arange(0, 4 * n, 4)
        big = codec.pow2_best_group(0, numpy.full(n, 8 << 28, numpy.uint32),
                                    index, 0, 0.5, 5000, coding='gap',
                                    sign_only=True)
        small = codec.pow2_best_group(
            2, numpy.array([8 << 28, 0], numpy.uint32), numpy.array([1, 9]),
            0, 0.5, 5000, coding='gap', sign_only=True)
        m = codec.pack([big, small])
        got = codec.merge_spans(m, sizes)
        assert got.tolist() == reference.oracle_merge_spans(m, sizes)
        assert (int(got[1]) == 1) == merged
        assert got.size <= m.size


# ---- span messages: corrupt, truncated, crafted -----------------------------

@FUZZ
@given(span_messages(max_tensors=5), st.data())
def test_mutated_span_messages_agree(msg, data):
    message, sizes, dtypes = msg
    if data.draw(st.integers(0, 2)) == 0:  # the span field / bit 7 first
        pos = 2
        for tid, fmt, count, a, b, body in reference.parse_message(message):
            if fmt == FMT_GAP and data.draw(st.booleans()):
                message = message.copy()
                message[pos + 5] ^= numpy.uint32(1 << data.draw(
                    st.integers(7, 31)))
                break
            pos += 5 + len(body)
    for _ in range(data.draw(st.integers(0, 3))):
        message = _mutate(message, data)
    agree(message, sizes, dtypes)


@given(span_messages(max_tensors=4))
def test_truncated_span_messages_rejected(msg):
    message, sizes, dtypes = msg
    assert agree(message, sizes, dtypes)
    for n in range(message.size):
        assert agree(message[:n], sizes, dtypes) is False, n
    # and with fewer tensors in the model
    for m in range(len(sizes)):
        agree(message, sizes[:m], dtypes[:m])


def _span_group(t0, span, index, nibbles, sizes, k=None, e_k=0, scale=1.0,
                count=None, sign_only=False):
    size = sum(sizes[t0:t0 + span + 1])
    k = rice_k(len(index), max(size, len(index))) if k is None else k
    body = oracle_encode(index, nibbles, k, sign_only, span=span)
    return (t0, len(index) if count is None else count, e_k, scale, body)


def test_crafted_span_faults():
    f32 = numpy.float32
    sizes = [10, 0, 1, 20, 5]
    dtypes = [f32, numpy.float16, numpy.float64, f32, numpy.float64]
    good = _span_group(0, 3, [0, 9, 10, 11, 30], [1, 2, 3, 4, 5], sizes)
    assert agree(span_message([good]), sizes, dtypes)
    cases = []
    # spans past the model
    for span in (5, 6, 2 ** 24 - 1):
        cases.append([_span_group(0, span, [0, 9], [1, 2], sizes)])
    cases.append([_span_group(4, 1, [0], [1], sizes)])
    cases.append([_span_group(3, 2, [0], [1], sizes)])
    # overlapping ids: the next group starts at or before t0 + span
    for t in (0, 1, 2, 3):
        cases.append([good, _span_group(t, 0, [0], [1], sizes)
                      if sizes[t] else (t, FMT_POW2, 1, 0, f32_bits(1.0),
                                        [0])])
    cases.append([good, (3, FMT_POW2, 1, 0, f32_bits(1.0), pow2_words([0],
                                                                      [1]))])
    cases.append([_span_group(0, 0, [0], [1], sizes),
                  _span_group(0, 1, [0], [1], sizes)])
    # count > span_size (11 elements in tensors 0..2)
    for count in (12, 13, 31):
        idx = list(range(11))
        b = _span_group(0, 2, idx, [1] * 11, sizes)
        # codes for 11, values padded for the count
        body = list(b[4])
        G = body[1]
        need = (count * 4 + 31) // 32
        body = body[:2 + G] + (body[2 + G:] + [0] * need)[:need]
        cases.append([(0, count, 0, 1.0, body)])
    # a gap past span_size (the last index = span_size)
    for span in (0, 1, 2, 3, 4):
        size = sum(sizes[:span + 1])
        cases.append([_span_group(0, span, [0, size], [1, 2], sizes,
                                  k=rice_k(2, size + 1))])
    # bit 7 set in a span group
    b = list(good[4])
    b[0] |= 0x80
    cases.append([good[:4] + (b,)])
    # a span group whose count is 0
    cases.append([(0, FMT_GAP, 0, 0, f32_bits(1.0), [3 << 8, 0])])
    for groups in cases:
        assert agree(span_message(groups), sizes, dtypes) is False, groups
    # and a few that are fine: spans over the empty tensor 1, the next
    # group right after a span, the whole model in one group
    ok = [[_span_group(1, 1, [0], [1], sizes)],
          [_span_group(0, 1, [9], [1], sizes)],
          [_span_group(0, 1, [9], [1], sizes),
           _span_group(2, 2, [0, 1, 25], [8, 8, 0], sizes, sign_only=True)],
          [_span_group(0, 4, list(range(36)), [n % 16 for n in range(36)],
                       sizes)]]
    for groups in ok:
        assert agree(span_message(groups), sizes, dtypes), groups


@pytest.mark.filterwarnings('ignore:overflow encountered:RuntimeWarning')
def test_span_value_table_per_dtype():
    """e_k valid for float64 only: accepted iff every tensor that receives
    an element is float64 (the addendum's "simplest" rule: tensors of the
    span with no element do not need the table)."""
    sizes = [4, 4, 4]
    for e_k in (200, -1000):
        for dtypes, elements, ok in [
                ([numpy.float64] * 3, [0, 5, 9], True),
                ([numpy.float64, numpy.float32, numpy.float64], [0, 9], True),
                ([numpy.float64, numpy.float16, numpy.float64], [0, 9], True),
                ([numpy.float64, numpy.float32, numpy.float64], [0, 5],
                 False),
                ([numpy.float32, numpy.float64, numpy.float64], [0, 5],
                 False)]:
            g = _span_group(0, 2, elements, [1] * len(elements), sizes,
                            e_k=e_k)
            assert agree(span_message([g]), sizes, dtypes) is ok, (
                e_k, dtypes, elements)


# ---- the compressor: 'fixed' never merges, 'auto'/'gap' merge -------------

@pytest.mark.parametrize('rule,kw', [('vgc', {}), ('strom', {'tau': 0.25}),
                                     ('hybrid', {'tau': 0.25})])
def test_compressor_merges_per_the_rule(rule, kw):
    """Same gradients through index_coding 'fixed', 'auto' and 'gap': the
    same elements; 'fixed' sends FMT_POW2 groups only; 'auto' and 'gap'
    send what the oracle's merge rule makes of their per-tensor choice
    (the 'fixed' groups re-coded)."""
    from chainer_vgc import GradientCompressor
    shapes = [(30,), (1,), (3, 50), (7,), (400,), (2,)]
    dtypes = [numpy.float32, numpy.float16, numpy.float64, numpy.float32,
              numpy.float32, numpy.float64]
    sizes = [int(numpy.prod(s)) for s in shapes]
    comps = {c: GradientCompressor(rule, list('abcdef'), shapes, dtypes,
                                   backend='numpy', index_coding=c, **kw)
             for c in codec.CODINGS}
    rng = numpy.random.default_rng(5)
    merged = 0
    for step in range(8):
        grads = [(rng.standard_normal(s) * rng.choice([0.01, 1.0])
                  ).astype(d) for s, d in zip(shapes, dtypes)]
        sq = [(g.astype(numpy.float64) ** 2 * rng.uniform(0, 2, size=g.shape)
               ).astype(d) for g, d in zip(grads, dtypes)]
        if step % 3 == 1:
            grads[2] = None
            sq[2] = None
        msgs = {c: comps[c].compress(grads, sq) for c in codec.CODINGS}
        fixed = reference.parse_message(msgs['fixed'])
        assert all(g[1] == FMT_POW2 for g in fixed)
        for c in ('auto', 'gap'):
            assert _dense_of(msgs[c], sizes) == _dense_of(msgs['fixed'],
                                                          sizes), c
            singles = []
            sign_only = rule != 'vgc'
            for tid, fmt, count, a, b, body in fixed:
                index = [w & INDEX_MASK for w in body]
                nib = [w >> 28 for w in body]
                gap = oracle_encode(index, nib, rice_k(count, sizes[tid]),
                                    sign_only)
                if c == 'gap' or len(gap) < count:
                    singles.append((tid, FMT_GAP, count, a, b, gap))
                else:
                    singles.append((tid, fmt, count, a, b, body))
            want = reference.oracle_merge_spans(span_message(singles), sizes)
            assert msgs[c].tolist() == want, (c, step)
            merged += any(g[1] == FMT_GAP and gap_span(g[5][0])
                          for g in reference.parse_message(msgs[c]))
            assert msgs[c].size <= span_message(singles).size
    assert merged > 0


def test_every_single_bit_flip_of_a_span_message():
    """Every bit of a message with two span groups (one over an empty
    tensor, one sign-only over a float64 and a float16 tensor) and a
    FMT_POW2 group, flipped one at a time."""
    sizes = [40, 0, 9, 1, 300, 2, 77]
    dtypes = [numpy.float32, numpy.float32, numpy.float64, numpy.float16,
              numpy.float64, numpy.float16, numpy.float32]
    g0 = _span_group(0, 2, [0, 1, 39, 40, 48], [1, 8, 15, 7, 2], sizes,
                     e_k=1)
    g1 = (3, FMT_POW2, 1, 0, f32_bits(0.5), pow2_words([0], [9]))
    g2 = _span_group(4, 1, [5, 299, 300, 301], [8, 0, 0, 8], sizes,
                     sign_only=True, scale=0.25)
    g3 = _span_group(6, 0, [3, 76], [0, 11], sizes, k=5)
    message = span_message([g0, g1, g2, g3])
    assert agree(message, sizes, dtypes)
    seen = collections.Counter()
    for p in range(32 * message.size):
        m = message.copy()
        m[p >> 5] ^= numpy.uint32(1 << (p & 31))
        seen[agree(m, sizes, dtypes)] += 1
    assert seen[True] > 20 and seen[False] > 200, seen


def test_merge_spans_with_the_native_gap_codec():
    """merge_spans with the native backend's decoder and encoder (what the
    compressor passes on the native backend) gives the oracle's words."""
    from chainer_vgc.engines.native import gap as native_gap
    rnd = random.Random(3)
    for trial in range(60):
        n = rnd.randrange(2, 7)
        sizes = [rnd.choice([1, 5, 60, 1000, 2 ** 30]) for _ in range(n)]
        groups = []
        for t, size in enumerate(sizes):
            if rnd.random() < 0.25:
                continue
            index = sorted(set(rnd.randrange(size) for _ in range(
                rnd.randrange(1, 30))))
            sign_only = rnd.random() < 0.4
            nib = [rnd.randrange(2) << 3 if sign_only else rnd.randrange(16)
                   for _ in index]
            e_k, scale = rnd.choice(TABLES[:2])
            if size <= MAX_POW2_SIZE and rnd.random() < 0.5:
                groups.append((t, FMT_POW2, len(index), e_k & 0xFFFFFFFF,
                               f32_bits(scale), pow2_words(index, nib)))
            else:
                groups.append((t, len(index), e_k, scale, oracle_encode(
                    index, nib, rice_k(len(index), size), sign_only)))
        if not groups:
            continue
        message = span_message(groups)
        want = reference.oracle_merge_spans(message, sizes)
        got = codec.merge_spans(message, sizes, native_gap.gap_decode,
                                native_gap.gap_encode)
        assert got.tolist() == want, trial
