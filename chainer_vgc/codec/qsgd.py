"""FMT_QSGD: ``a`` = number of bucket records, ``b`` =
``levels << 24 | bucket_size``; body: records ``bucket_id, count, float64
scale`` then ``count`` words ``sign(1) | level(8) | offset-in-bucket(23)``;
value = ``sign * level * scale``."""

import numpy

from chainer_vgc.backends import arrays
from chainer_vgc.codec.constants import (
    FMT_QSGD, MAX_QSGD_BUCKET, QSGD_OFFSET_BITS, QSGD_RECORD_WORDS)
from chainer_vgc.codec.header import (
    Group, WireFormat, WireFormatError, check_finite, check_index, where)


def qsgd_group(tensor_id, level, negative, scales, bucket_size, levels):
    """Pack QSGD levels (0..levels) of one tensor, bucket by bucket.

    ``level``/``negative`` are per element (flattened tensor), ``scales`` the
    per-bucket ``norm / levels`` (sent as float64).
    """
    xp = arrays.get_array_module(level)
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


# ---- the format's functions (see chainer_vgc.codec.header) ------------------

def _qsgd_check(g, size):
    if (g.a == 0 or g.a > g.count or (g.b & 0xFFFFFF) == 0
            or (g.b >> 24) == 0):
        raise WireFormatError(where(g) + 'bad QSGD header')


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
    host = arrays.to_numpy(rec)
    ids, counts = host[:, 0].astype(numpy.int64), host[:, 1].astype(numpy.int64)
    scales = numpy.ascontiguousarray(host[:, 2:]).view(numpy.float64)[:, 0]
    if (int(counts.sum()) != g.count or (counts == 0).any()
            or (numpy.diff(ids) <= 0).any() or ids[-1] * bucket >= size
            or not (numpy.isfinite(scales) & (scales > 0)).all()):
        raise WireFormatError(where(g) + 'bad QSGD bucket records')
    if bool((offset >= bucket).any()) or bool((level > levels).any()):
        raise WireFormatError(where(g) + 'QSGD offset or level out of range')
    per_word = xp.asarray(numpy.repeat(numpy.arange(g.a), counts))
    index = xp.asarray(ids)[per_word] * bucket + offset
    # level * scale in float64, then cast: both steps may overflow
    with numpy.errstate(over='ignore', invalid='ignore'):
        mag = level * xp.asarray(scales)[per_word]
        value = xp.where(negative, -mag, mag)
        value = value.astype(dtype)
    check_finite(value, None, g, dtype, xp)
    check_index(index, size, g)
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


FORMAT = WireFormat(
    FMT_QSGD, 'qsgd',
    a='number of bucket records',
    b='levels << 24 | bucket size',
    body='records (bucket id, count, float64 scale), then count '
         'words sign(1) | level(8) | offset-in-bucket(23); value '
         '= sign * level * scale',
    body_words=_qsgd_body_words, check=_qsgd_check,
    decode=_qsgd_decode, values=_qsgd_values)
