"""The message: a 1-D ``uint32`` array ``MAGIC, n_groups, group_0,
group_1, ...`` (:func:`pack` writes it, :func:`walk` reads and checks its
structure), decoded with every field checked (:func:`unpack`,
:func:`decode_into`) or, once validated, added on the device
(:func:`add_validated`, after :func:`expand_gap`); :func:`merge_spans`
re-encodes runs of small groups as one FMT_GAP group."""

import numpy

from chainer_vgc.backends import arrays
from chainer_vgc.backends.cuda import kernels
from chainer_vgc.codec.constants import (
    FMT_GAP, FMT_INDEXED, FMT_POW2, FMT_SPARSE, GAP_PARAM_WORDS,
    GAP_SPAN_SHIFT,
    HEADER_WORDS, INDEX_BITS, MAGIC, MAX_COUNT, MAX_GAP_SPAN,
    MERGE_MAX_COUNT)
from chainer_vgc.codec.formats import FORMATS, INTERNAL_FORMATS
from chainer_vgc.codec.gap import gap_body, rice_parameter, span_parts
from chainer_vgc.codec.header import Decoded, Group, WireFormatError, where
from chainer_vgc.codec.pow2 import checked_pow2_table, pow2_header
from chainer_vgc.codec.raw import raw_group


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
    if arrays.is_cupy(xp) and bodies:
        with arrays.device_scope(bodies[0]):
            # (a host body, from a model partly on the CPU, is uploaded)
            flat = xp.concatenate([xp.asarray(b).astype(numpy.uint32,
                                                        copy=False)
                                   for b in bodies])
        staged = arrays.host_buffer(flat.size, numpy.uint32)
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
    return sum(g.count for g in walk(arrays.to_numpy(message), None))


def unpack(message, sizes, dtypes):
    """Decode a message for a model whose tensors have ``sizes``/``dtypes``.

    Returns a list of :class:`.Decoded` ``(tensor_id, index, value)``; values
    are in the state dtype of each tensor, as sent: a -0.0 element is
    listed as -0.0, and the decoders that add into tensors
    (:func:`decode_into`, the exchange) give ``out + value`` (+0.0 from a
    +0.0 start; the wire format's Sec. 5.2).  CuPy messages are decoded on
    the device (headers are read on the host).
    """
    xp = arrays.get_array_module(message)
    out = []
    for g in walk(arrays.to_numpy(message), sizes, message):
        if g.fmt == FMT_GAP:  # decoded on the host, split over its span
            e_k, scale = pow2_header(g)
            for t, index, nibbles in span_parts(g, sizes):
                table = checked_pow2_table(
                    g, e_k, scale, arrays.state_dtype(dtypes[t]))
                out.append(Decoded(t, xp.asarray(index),
                                   xp.asarray(table[nibbles])))
            continue
        index, value = FORMATS[g.fmt].decode(
            g, sizes[g.tensor_id], arrays.state_dtype(dtypes[g.tensor_id]),
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
    xp = arrays.get_array_module(device)
    n = 0
    for g in walk(host, sizes, device, internal=True):
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


def name_the_fault(blocks, sizes, dtypes, decoder='the native decoder',
                   workaround='CHAINER_VGC_BACKEND=numpy'):
    """After a fast decoder (the native backend's, the device's) refused
    one of ``blocks``: the reference decoder names the fault (:func:`unpack`
    of each raises its :class:`~.header.WireFormatError`).  Should it
    accept them all, the two decoders disagree, a bug: a RuntimeError says
    so and names the ``workaround`` (the reference backend).  Never
    returns; the one place this fallback is written."""
    for block in blocks:
        unpack(block, sizes, dtypes)
    raise RuntimeError(
        'chainer_vgc: {} rejected a message the reference decoder accepts; '
        'please report this, with {} as the workaround'.format(decoder,
                                                               workaround))


def merge_spans(message, sizes, decoder=None, encoder=None):
    """The message with each maximal run of consecutive FMT_POW2/FMT_GAP
    groups of at most :data:`.MERGE_MAX_COUNT` elements each that share
    ``a`` and ``b`` (e_k and scale: one value table) re-encoded as one
    FMT_GAP group over the tensors from the run's first to its last (its
    span), when that is strictly shorter; ``message`` itself when nothing
    got shorter.  The group's header costs 7 words or
    more: at hybrid's and Strom's late-run densities (a few dozen elements
    a tensor) that is several bits per element, which one group per
    message saves.  SIGN_ONLY when every element has d = 0.
    ``decoder``/``encoder``: fast equivalents of :func:`.gap_decode_body`
    and :func:`.gap_body` (the native backend's)."""
    groups = list(walk(message, sizes))
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
        for t, i, n in span_parts(g, sizes, decoder):
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
    FMT_INDEXED (pow2 words and int64 indices) and every FMT_SPARSE group
    as FMT_RAW (its values times 2**x in float64, where they are exact:
    the device casts them to the state dtype, one rounding, as the
    reference's): what the device adds from, see :func:`add_validated`;
    ``message`` itself when it has neither.  ``decoder(body, count,
    size) -> (index, nibbles)``: default :func:`.gap_decode_body` (the
    native backend passes its own)."""
    groups = list(walk(message, sizes))
    if not any(g.fmt in (FMT_GAP, FMT_SPARSE) for g in groups):
        return message
    out = []
    for g in groups:
        if g.fmt == FMT_SPARSE:
            index, value = FORMATS[FMT_SPARSE].decode(
                g, sizes[g.tensor_id], numpy.float64, numpy)
            out.append(raw_group(g.tensor_id, index, value,
                                 sizes[g.tensor_id]))
            continue
        if g.fmt != FMT_GAP:
            out.append(g)
            continue
        for t, index, nibbles in span_parts(g, sizes, decoder):
            words = nibbles.astype(numpy.uint32) << numpy.uint32(INDEX_BITS)
            out.append(Group(t, FMT_INDEXED, int(index.size), g.a, g.b,
                             numpy.concatenate([words, numpy.ascontiguousarray(
                                 index, dtype='<i8').view(numpy.uint32)])))
    return pack(out)


def walk(m, sizes, words=None, internal=False):
    """Validate the structure of the host message ``m``; yield a
    :class:`.Group` per group, its body a view of ``words`` (the same
    message, e.g. on the device; default ``m``).  ``internal``: accept the
    formats of :data:`.INTERNAL_FORMATS` too (:func:`add_validated`)."""
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
            raise WireFormatError(where(g) + 'tensor ids not increasing')
        span = 0
        if g.fmt == FMT_GAP:  # the param word says how many tensors
            if pos >= m.size:
                raise WireFormatError(where(g) + 'truncated in the FMT_GAP '
                                      'param words')
            span = int(m[pos]) >> GAP_SPAN_SHIFT
        last = g.tensor_id + span
        if sizes is not None and last >= len(sizes):
            raise WireFormatError(
                where(g) + 'the model has only {} tensors; sender and '
                'receiver must use the same model'.format(len(sizes)))
        size = (sum(sizes[g.tensor_id:last + 1]) if sizes is not None
                else None)
        if g.count == 0 or (size is not None and g.count > size):
            raise WireFormatError(where(g) + 'count {} invalid for a tensor '
                                  'of {} elements'.format(g.count, size))
        form = FORMATS.get(g.fmt)
        if form is None and internal:
            form = INTERNAL_FORMATS.get(g.fmt)
        if form is None:
            raise WireFormatError(where(g) + 'unknown format {}'.format(
                g.fmt))
        form.check(g, size)
        length = form.body_words(g, m[pos:pos + GAP_PARAM_WORDS])
        if pos + length > m.size:
            raise WireFormatError(where(g) + 'body of {} words runs past the '
                                  'end of the message ({} words); truncated'
                                  .format(length, m.size))
        yield g._replace(body=words[pos:pos + length], span=span)
        pos += length
    if pos != m.size:
        raise WireFormatError('chainer_vgc wire message: {} trailing words '
                              'after {} groups'.format(m.size - pos, n_groups))
