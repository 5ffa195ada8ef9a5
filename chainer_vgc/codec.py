"""Codec: quantization (Sec. 4.2, 4.4), packing into 32-bit words, unpacking.

Wire message (a 1-D ``uint32`` array, little-endian words)::

    MAGIC, n_groups, group_0, group_1, ...

Only tensors that send something have a group.  Each group is a 5-word header
``tensor_id, format, count, a, b`` followed by a body whose length follows
from the header:

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

:func:`unpack` checks every field against the receiving model (tensor ids,
counts, body lengths, exponents and scales, indices in range and strictly
increasing, levels, and every value it would write finite in the receiving
state dtype: a finite float64 raw value or QSGD ``level * scale`` may
overflow float32) and raises :class:`WireFormatError` instead of reading out
of bounds or decoding garbage.
"""

import collections

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
LOG2_ZERO = -(1 << 30)  # same sentinel as VGC_LOG2_ZERO in the kernels

_TRAITS = {
    # dtype: (unsigned view, mantissa bits, bias, sign shift)
    numpy.dtype(numpy.float32): (numpy.uint32, 23, 127, 31),
    numpy.dtype(numpy.float64): (numpy.uint64, 52, 1023, 63),
}


class WireFormatError(ValueError):
    """A received message is truncated, corrupt or from another model."""


Group = collections.namedtuple(
    'Group', ['tensor_id', 'fmt', 'count', 'a', 'b', 'body'])
Group.__doc__ = 'One tensor\'s part of a message (header fields + body).'

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


# ---- FMT_POW2 ---------------------------------------------------------------

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
    scale = dtype.type(numpy.float32(scale))
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
    mags = numpy.ldexp(numpy.full(8, dtype.type(numpy.float32(scale)),
                                  dtype=dtype),
                       e_k - numpy.arange(8, dtype=numpy.int32))
    return numpy.concatenate([mags, -mags])


def pow2_group(tensor_id, words, e_k, scale=1.0):
    """A FMT_POW2 group from words made by :func:`pow2_encode`."""
    return Group(int(tensor_id), FMT_POW2, int(words.size),
                 int(e_k) & 0xFFFFFFFF, _f32_bits(scale), words)


# ---- FMT_RAW ----------------------------------------------------------------

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


# ---- FMT_QSGD ---------------------------------------------------------------

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
        last = g.tensor_id
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
    host = backend.to_numpy(message)
    out = []
    for g in _walk(host, sizes):
        dtype = backend.state_dtype(dtypes[g.tensor_id])
        body = message[g.body[0]:g.body[1]]
        size = sizes[g.tensor_id]
        if g.fmt == FMT_POW2:
            e_k = int(numpy.uint32(g.a).view(numpy.int32))
            scale = numpy.uint32(g.b).view(numpy.float32)
            fi = numpy.finfo(dtype)
            if not (numpy.isfinite(scale) and scale > 0
                    and fi.minexp <= e_k <= fi.maxexp - 1):
                raise WireFormatError(_where(g) + 'exponent {} or scale {} '
                                      'out of range for {}'.format(
                                          e_k, scale, dtype))
            table = pow2_table(e_k, scale, dtype)
            # every value is one of these 16: check them, not each value
            if not (numpy.isfinite(table).all() and (table != 0).all()):
                raise WireFormatError(_where(g) + 'values out of range')
            index, value = pow2_decode(body, e_k, scale, dtype)
        elif g.fmt == FMT_RAW:
            index, value = _raw_decode(body, g, size, dtype, xp)
        else:
            index, value = _qsgd_decode(body, g, size, dtype, xp)
        if g.fmt != FMT_RAW or not g.a & RAW_DENSE:
            _check_index(index, size, g)
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
        flat[dec.index] += dec.value.astype(flat.dtype, copy=False)
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
    for g in _walk(host, sizes):
        out = outs[g.tensor_id]
        body = device[g.body[0]:g.body[1]]
        if g.fmt == FMT_POW2:
            e_k = int(numpy.uint32(g.a).view(numpy.int32))
            scale = numpy.uint32(g.b).view(numpy.float32)
            index, value = pow2_decode(body, e_k, scale, out.dtype)
        elif g.fmt == FMT_RAW:
            index, value = _raw_values(body, g, sizes[g.tensor_id], xp)
        else:
            index, value = _qsgd_values(body, g, xp)
        value = kernels.cast(value, out.dtype)
        if g.fmt == FMT_RAW and g.a & RAW_DENSE:
            kernels.add_into(out, value)
        else:  # indices are unique: gather, add, scatter back
            part = out[index]
            kernels.add_into(part, value)
            out[index] = part
        n += g.count
    return n



def _raw_values(body, g, size, xp):
    """(index, value as sent) of a FMT_RAW body."""
    if g.a & RAW_DENSE:
        index = xp.arange(size, dtype=numpy.int64)
        vals = body
    else:
        index = body[:g.count].astype(numpy.int64)
        vals = body[g.count:]
    wire = vals.copy().view(numpy.float64 if g.a & RAW_FLOAT64
                            else numpy.float32)
    return index, wire  # cast by the caller


def _qsgd_values(body, g, xp):
    """(index, float64 value) of a FMT_QSGD body, computed where the body
    lives (no record is read back): value = sign * level * scale, cast to
    the state dtype by the caller, as :func:`_qsgd_decode` does."""
    n_rec, bucket = g.a, g.b & 0xFFFFFF
    rec = body[:QSGD_RECORD_WORDS * n_rec].reshape(n_rec, QSGD_RECORD_WORDS)
    words = body[QSGD_RECORD_WORDS * n_rec:]
    ids = rec[:, 0].astype(numpy.int64)
    ends = xp.cumsum(rec[:, 1].astype(numpy.int64))
    # a copy: the float64 view must start on an 8-byte boundary (the body
    # may start at any word; a GPU faults on a misaligned load)
    scales = rec[:, 2:].copy().view(numpy.float64).reshape(-1)
    per_word = xp.searchsorted(ends, xp.arange(g.count, dtype=numpy.int64),
                               side='right')
    offset = (words & numpy.uint32(MAX_QSGD_BUCKET - 1)).astype(numpy.int64)
    level = ((words >> numpy.uint32(QSGD_OFFSET_BITS))
             & numpy.uint32(0xFF)).astype(numpy.int64)
    index = ids[per_word] * bucket + offset
    mag = level * scales[per_word]  # float64: no flushing on a GPU
    return index, xp.where((words >> numpy.uint32(31)) != 0, -mag, mag)


_Span = collections.namedtuple(
    '_Span', ['tensor_id', 'fmt', 'count', 'a', 'b', 'body'])


def _where(g):
    return 'chainer_vgc wire message, group for tensor {}: '.format(
        g.tensor_id)


def _walk(m, sizes):
    """Validate the message structure; yield header fields and body spans."""
    if m.ndim != 1 or m.dtype != numpy.uint32:
        raise WireFormatError('chainer_vgc wire message must be a 1-D uint32 '
                              'array, got shape {} dtype {}'.format(
                                  m.shape, m.dtype))
    if m.size < 2 or int(m[0]) != MAGIC:
        raise WireFormatError('chainer_vgc wire message: missing header '
                              '(bad magic or fewer than 2 words); the buffer '
                              'is truncated or not a chainer_vgc message')
    n_groups = int(m[1])
    pos, last = 2, -1
    for _ in range(n_groups):
        if pos + HEADER_WORDS > m.size:
            raise WireFormatError('chainer_vgc wire message truncated in a '
                                  'group header at word {}'.format(pos))
        tid, fmt, count, a, b = (int(w) for w in m[pos:pos + HEADER_WORDS])
        pos += HEADER_WORDS
        g = _Span(tid, fmt, count, a, b, None)
        if tid <= last:
            raise WireFormatError(_where(g) + 'tensor ids not increasing')
        last = tid
        if sizes is not None and tid >= len(sizes):
            raise WireFormatError(
                _where(g) + 'the model has only {} tensors; sender and '
                'receiver must use the same model'.format(len(sizes)))
        size = sizes[tid] if sizes is not None else None
        if count == 0 or (size is not None and count > size):
            raise WireFormatError(_where(g) + 'count {} invalid for a tensor '
                                  'of {} elements'.format(count, size))
        if fmt == FMT_POW2:
            length = count
        elif fmt == FMT_RAW:
            if a & ~(RAW_DENSE | RAW_FLOAT64):
                raise WireFormatError(_where(g) + 'unknown raw flags')
            if a & RAW_DENSE and size is not None and count != size:
                raise WireFormatError(_where(g) + 'dense group with {} of {} '
                                      'elements'.format(count, size))
            length = (0 if a & RAW_DENSE else count) + count * (
                2 if a & RAW_FLOAT64 else 1)
        elif fmt == FMT_QSGD:
            bucket = b & 0xFFFFFF
            if a == 0 or a > count or bucket == 0 or (b >> 24) == 0:
                raise WireFormatError(_where(g) + 'bad QSGD header')
            length = QSGD_RECORD_WORDS * a + count
        else:
            raise WireFormatError(_where(g) + 'unknown format {}'.format(fmt))
        if pos + length > m.size:
            raise WireFormatError(_where(g) + 'body of {} words runs past the '
                                  'end of the message ({} words); truncated'
                                  .format(length, m.size))
        yield g._replace(body=(pos, pos + length))
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


def _raw_decode(body, g, size, dtype, xp):
    """(index, value in ``dtype``); every value must be finite on the wire
    and once cast to ``dtype`` (1e300 sent as float64 overflows float32)."""
    count = g.count
    if g.a & RAW_DENSE:
        index = xp.arange(size, dtype=numpy.int64)
        vals = body
    else:
        index = body[:count].astype(numpy.int64)
        vals = body[count:]
    # copy: a float64 view must start on an 8-byte boundary (GPUs fault on
    # misaligned loads) and the body may start at any word
    wire = vals.copy().view(numpy.float64 if g.a & RAW_FLOAT64
                            else numpy.float32)
    with numpy.errstate(over='ignore', invalid='ignore'):
        value = wire.astype(dtype, copy=False)
    _check_finite(value, wire, g, dtype, xp)
    return index, value


def _qsgd_decode(body, g, size, dtype, xp):
    n_rec = g.a
    levels, bucket = g.b >> 24, g.b & 0xFFFFFF
    rec = body[:QSGD_RECORD_WORDS * n_rec].reshape(n_rec, QSGD_RECORD_WORDS)
    words = body[QSGD_RECORD_WORDS * n_rec:]
    host = backend.to_numpy(rec)
    ids, counts = host[:, 0].astype(numpy.int64), host[:, 1].astype(numpy.int64)
    scales = numpy.ascontiguousarray(host[:, 2:]).view(numpy.float64)[:, 0]
    if (int(counts.sum()) != g.count or (counts == 0).any()
            or (numpy.diff(ids) <= 0).any() or ids[-1] * bucket >= size
            or not (numpy.isfinite(scales) & (scales > 0)).all()):
        raise WireFormatError(_where(g) + 'bad QSGD bucket records')
    offset = (words & numpy.uint32(MAX_QSGD_BUCKET - 1)).astype(numpy.int64)
    level = ((words >> numpy.uint32(QSGD_OFFSET_BITS))
             & numpy.uint32(0xFF)).astype(numpy.int64)
    if bool((offset >= bucket).any()) or bool((level > levels).any()):
        raise WireFormatError(_where(g) + 'QSGD offset or level out of range')
    per_word = xp.asarray(numpy.repeat(numpy.arange(n_rec), counts))
    index = xp.asarray(ids)[per_word] * bucket + offset
    # level * scale in float64, then cast: both steps may overflow
    with numpy.errstate(over='ignore', invalid='ignore'):
        mag = level * xp.asarray(scales)[per_word]
        value = xp.where((words >> numpy.uint32(31)) != 0, -mag, mag)
        value = value.astype(dtype)
    _check_finite(value, None, g, dtype, xp)
    return index, value


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
