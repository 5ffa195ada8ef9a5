"""The whole-model decode + mean on a GPU: one upload and at most two
kernel launches per step, whatever the number of tensors and ranks
(issue 25).

The question this module answers: how do every rank's messages become
the parameters' gradients on the device without a launch per tensor?
The messages are validated on the host, where MPI left them (a bad one is
refused before anything moves).  A descriptor per (rank, tensor) (body
offset, count, kind, e_k, scale), the bodies as they were sent, and for
the gap-coded groups (FMT_GAP) a record per block of
:data:`~chainer_vgc.codec.GAP_RESTART_CODES` codes (read from the group's
restart table, docs/wire_format.md Sec. 4.5: where the block starts in
the stream and the index before it) go up in one copy.  Then
``vgc_model_gap_expand`` decodes the blocks, one thread each, into one
uint64 an element (index | nibble << 60), and one
``vgc_model_decode_mean`` thread per element of the model finds what each
rank sent for it (binary search in each rank's group), adds the values in
rank order from +0.0 (``dense``: MPI's rank-order tree), and writes the
mean in the parameter dtype into one new array; each ``param.grad``
becomes a view of it.  The sums and means equal
:func:`chainer_vgc.exchange.sum_messages` + ``write_mean`` bit for bit
(``tests/test_device_step.py``).

Parameters of several dtypes (float16 weights with float32 batch
normalization, as Chainer's mixed16 makes them) take one mean launch per
dtype, each over its tensors.  Applies when every parameter has a
gradient, the tensors have at most 2**28 elements and no message carries
FMT_QSGD; otherwise :mod:`chainer_vgc.exchange` decodes tensor by
tensor.
"""

import numpy

from chainer_vgc import backend
from chainer_vgc import codec
from chainer_vgc import kernels
from chainer_vgc.codec.message import walk

#: words of a (rank, tensor) descriptor, of a FMT_GAP block record, and
#: the body kinds (kernels/vgc_numerics.cuh)
DESC_WORDS = 8
BLOCK_WORDS = 16
POW2, RAW32, RAW64, DENSE32, DENSE64, GAP = 1, 2, 3, 4, 5, 6
#: ranks the dense tree adds in registers (more: tensor by tensor)
TREE_MAX = 64


def applies(blocks, compressor, params, grads, dense):
    """Whether :func:`mean` can decode this step (before reading any
    message: the formats are checked by :func:`mean` itself)."""
    if any(g is None for g in grads) or not params:
        return False
    if any(n > codec.MAX_INDEX for n in compressor.sizes):
        return False
    return not (dense and len(blocks) > TREE_MAX)


def _gap_blocks(body, count, at, first):
    """The block records (uint32, :data:`BLOCK_WORDS` each) of a FMT_GAP
    body at word ``at`` of the upload, its elements going to ``first`` on
    of the expanded array: one block per restart point and one before
    them, read from the restart table (no code is decoded here)."""
    restarts = codec.gap_restarts(count)
    param, stream_words = int(body[0]), int(body[1])
    table = numpy.ascontiguousarray(
        body[2:2 + codec.GAP_RESTART_WORDS * restarts]).view(
        numpy.uint64).reshape(-1, 2)
    j0 = numpy.arange(restarts + 1, dtype=numpy.uint64) * numpy.uint64(
        codec.GAP_RESTART_CODES)
    stream = at + codec.GAP_PARAM_WORDS + codec.GAP_RESTART_WORDS * restarts
    kw = (param & codec.GAP_K_MASK) | (
        256 if param & codec.GAP_SIGN_ONLY else 0)
    rec = numpy.empty((restarts + 1, BLOCK_WORDS // 2), numpy.uint64)
    rec[:, 0] = stream
    rec[:, 1] = stream_words
    rec[0, 2:4] = 0, 2 ** 64 - 1  # bit 0, after index -1
    rec[1:, 2:4] = table
    codes = numpy.minimum(numpy.uint64(count) - j0,
                          codec.GAP_RESTART_CODES)
    rec[:, 4] = codes | numpy.uint64(kw << 32)
    rec[:, 5] = stream + stream_words  # the value fields
    rec[:, 6] = j0
    rec[:, 7] = numpy.uint64(first) + j0
    return rec.view(numpy.uint32).reshape(-1)


def _bodies(blocks, sizes):
    """(descriptors uint32 [ranks, tensors, DESC_WORDS], bodies, FMT_GAP
    block records, elements of the FMT_GAP groups) of the validated
    messages, or None when one carries FMT_QSGD."""
    n = len(sizes)
    bounds = numpy.concatenate([[0], numpy.cumsum(sizes)]).astype(int)
    desc = numpy.zeros((len(blocks), n, DESC_WORDS), numpy.uint32)
    parts, records, pos, expanded = [], [], desc.size, 0
    for b, block in enumerate(blocks):
        for g in walk(block, sizes):
            body = g.body
            if g.fmt == codec.FMT_QSGD:
                return None
            if g.fmt == codec.FMT_GAP:  # as sent: decoded on the device
                for t in range(g.tensor_id, g.tensor_id + g.span + 1):
                    at = int(bounds[t] - bounds[g.tensor_id])
                    desc[b, t] = (expanded & 0xFFFFFFFF, expanded >> 32,
                                  g.count, GAP, g.a, g.b, at & 0xFFFFFFFF,
                                  at >> 32)
                records.append(_gap_blocks(body, g.count, pos, expanded))
                expanded += g.count
            elif g.fmt == codec.FMT_RAW:
                dense = bool(g.a & codec.RAW_DENSE)
                f64 = bool(g.a & codec.RAW_FLOAT64)
                kind = (DENSE64 if f64 else DENSE32) if dense else (
                    RAW64 if f64 else RAW32)
                desc[b, g.tensor_id, :4] = (pos & 0xFFFFFFFF, pos >> 32,
                                            g.count, kind)
            else:  # FMT_POW2
                desc[b, g.tensor_id, :6] = (pos & 0xFFFFFFFF, pos >> 32,
                                            body.size, POW2, g.a, g.b)
            parts.append(body)
            pos += body.size
    return desc, parts, records, expanded


def _dtype_groups(params, sizes):
    """``[(dtype, tensor ids, int64 [their offsets end to end, then their
    ids])]``: the tensors of each parameter dtype, one mean launch each."""
    groups = {}
    for t, p in enumerate(params):
        groups.setdefault(numpy.dtype(p.dtype), []).append(t)
    out = []
    for dtype, tids in groups.items():
        ends = numpy.cumsum([0] + [sizes[t] for t in tids])
        out.append((dtype, tids, numpy.concatenate([ends, tids]).astype(
            numpy.int64)))
    return out


def mean(blocks, compressor, params, size, dense, rescale):
    """``param.grad`` = the mean of the (validated) ``blocks`` for every
    parameter; False (nothing done) when a message carries FMT_QSGD."""
    got = _bodies(blocks, compressor.sizes)
    if got is None:
        return False
    desc, parts, records, expanded = got
    xp = backend.get_array_module(params[0].array)
    groups = _dtype_groups(params, compressor.sizes)
    # [each dtype's offsets and tensor ids (int64)][descriptors][bodies]
    # [FMT_GAP block records]: one upload
    head = sum(2 * tab.size for _, _, tab in groups)
    staged = backend.host_buffer(
        head + desc.size + sum(b.size for b in parts)
        + sum(r.size for r in records), numpy.uint32)
    pos = 0
    for body in [tab.view(numpy.uint32) for _, _, tab in groups] + [
            desc.reshape(-1)] + parts + records:
        staged[pos:pos + body.size] = body
        pos += body.size
    n_blocks = sum(r.size for r in records) // BLOCK_WORDS
    with backend.device_scope(params[0].array):
        uploaded = xp.asarray(staged)
        buf = uploaded[head:]  # body offsets count from here
        gaps = xp.empty(max(expanded, 1), numpy.uint64)
        if n_blocks:
            kernels.get_kernel('vgc_model_gap_expand')(
                buf, uploaded[pos - BLOCK_WORDS * n_blocks:],
                xp.empty(n_blocks, numpy.int32), gaps)
        rescaled = rescale not in (None, 1)
        at = 0
        for dtype, tids, tab in groups:  # one launch a parameter dtype
            table = uploaded[at:at + 2 * tab.size].view(numpy.int64)
            at += 2 * tab.size
            ends = tab[:len(tids) + 1]
            out = xp.empty(int(ends[-1]), dtype)
            kernels.get_kernel('vgc_model_decode_mean')(
                buf, gaps, table[:len(tids) + 1], table[len(tids) + 1:],
                numpy.int32(len(tids)), numpy.int32(len(compressor.sizes)),
                numpy.int32(len(blocks)), bool(dense), rescaled,
                numpy.float64(1.0 / size),
                numpy.float64(rescale if rescaled else 1.0),
                numpy.float32(numpy.float16(1.0 / size)), out)
            for t, lo, hi in zip(tids, ends[:-1], ends[1:]):
                params[t].grad = out[lo:hi].reshape(params[t].shape)
    return True
