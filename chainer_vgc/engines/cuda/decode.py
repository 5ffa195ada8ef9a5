"""The whole-model decode + mean on a GPU: one upload, a fixed number of
launches per step whatever the number of tensors (one a rank), one flag
read back (issues 25, 36).

The question this module answers: how do every rank's messages become
the parameters' gradients on the device without a launch per tensor,
and without the host decoding anything twice?  The host checks each
message's structure where MPI left it (headers, lengths, value tables;
a bad one is refused before anything moves), not the FMT_GAP codes.  A
descriptor per (rank, tensor) (body offset, count, kind, e_k, scale),
the bodies as they were sent, each rank's groups (items), and a row per
gap-coded group (FMT_GAP: where its body is, its codes, its index
space) go up in one copy, from a host buffer kept from step to step
(:class:`~chainer_vgc.backends.arrays.HostStaging`: pinned memory that grows a
few times, then stays); nothing on the host is per block or per code.
Then ``vgc_model_gap_expand`` decodes the blocks of
:data:`~chainer_vgc.codec.GAP_RESTART_CODES` codes, one thread each from
its entry of the group's restart table (docs/wire_format.md Sec. 4.5),
with every check of the sequential decoder, into one uint64 an element
(index | nibble << 60), and flags a message whose codes fail.  The sums: with the dense tree ('none'), one
``vgc_model_decode_mean`` thread per element looks up each rank's value
(binary search) and adds them in MPI's rank-order tree; otherwise one
``vgc_model_scatter`` launch per rank, in rank order, adds each element
its message carries to the element's sum (from +0.0: the rank order
of the reference), and ``vgc_model_finish`` writes the means.  Only
then are the flags read: a flagged message leaves every gradient as it
was (:data:`REFUSED`); else each ``param.grad`` becomes a view of one
new array a dtype.  The means equal
:func:`chainer_vgc.engines.reference.sum_messages` + ``write_mean`` bit for bit
(``tests/test_device_step.py``, ``tests/test_device_decode_checks.py``).
Applies when every parameter has a gradient, the tensors have at most
2**28 elements and no message carries FMT_QSGD or FMT_SPARSE
(:data:`TENSOR_BY_TENSOR`); otherwise the GPU engine
(:mod:`chainer_vgc.engines.cuda.engine`) decodes tensor by tensor."""

import numpy

from chainer_vgc.backends import arrays
from chainer_vgc import codec
from chainer_vgc.backends.cuda import kernels
from chainer_vgc.codec.message import walk

#: words of a (rank, tensor) descriptor, int64 of a FMT_GAP group's row
#: for vgc_model_gap_expand, and the body kinds (kernels/vgc_numerics.cuh)
DESC_WORDS = 8
GAP_ROW = 5
POW2, RAW32, RAW64, DENSE32, DENSE64, GAP = 1, 2, 3, 4, 5, 6
#: ranks the dense tree adds in registers (more: tensor by tensor)
TREE_MAX = 64
#: the formats this decode has no descriptor for (FMT_QSGD's records,
#: FMT_SPARSE's values): a message carrying one is decoded tensor by tensor
#: (:mod:`chainer_vgc.engines.cuda.engine`, after
#: :func:`chainer_vgc.codec.expand_gap`)
TENSOR_BY_TENSOR = (codec.FMT_QSGD, codec.FMT_SPARSE)
#: what :func:`mean` returns when a message's FMT_GAP codes failed the
#: device's checks (no gradient written)
REFUSED = type('Refused', (), {'__repr__': lambda _: 'REFUSED'})()


def applies(blocks, sizes, params, grads, dense):
    """Whether :func:`mean` can decode this step (before reading any
    message: the formats are checked by :func:`mean` itself); ``sizes``:
    the model's tensor sizes."""
    if any(g is None for g in grads) or not params:
        return False
    if any(n > codec.MAX_INDEX for n in sizes):
        return False
    return not (dense and len(blocks) > TREE_MAX)


def group_rows(blocks, sizes):
    """The group table of validated host messages (int64 [groups, 8]:
    message, tensor id, format, count, a, b, the body's first word in the
    message, span), as the native validation returns it
    (:func:`chainer_vgc.engines.native.bindings.decode_mean` with ``table``); here from
    :func:`~chainer_vgc.codec.message.walk`, a Python step per group, for
    the NumPy backend."""
    rows = []
    for b, block in enumerate(blocks):
        for g in walk(block, sizes):
            rows.append((b, g.tensor_id, g.fmt, g.count, g.a, g.b,
                         (_address(g.body) - _address(block)) // 4, g.span))
    return numpy.array(rows, numpy.int64).reshape(-1, 8)


def _address(a):
    return a.__array_interface__['data'][0]


def _blocks_of(count):
    """Blocks of FMT_GAP groups of ``count`` (>= 1) codes: one before the
    first restart point and one from each (:func:`codec.gap_restarts`)."""
    return (count - 1) // codec.GAP_RESTART_CODES + 1


def _split(x):
    """int64 -> its (low, high) uint32 words."""
    x = numpy.asarray(x, numpy.int64)
    return x & 0xFFFFFFFF, x >> 32


def _descriptors(rows, bounds, p, starts):
    """(descriptors uint32 [ranks, tensors, DESC_WORDS], the FMT_GAP rows,
    each one's first element in the expanded array, elements expanded)
    from the group table ``rows``, the messages starting at words
    ``starts`` of the upload (``bounds``: the model's tensor offsets, end
    to end): NumPy over the whole table, no Python step per group."""
    n = len(bounds) - 1
    desc = numpy.zeros((p, n, DESC_WORDS), numpy.uint32)
    msg, tid, fmt, count, a, b, off, span = rows.T
    lo, hi = _split(starts[msg] + off)  # the body's word in the upload
    pow2 = fmt == codec.FMT_POW2
    desc[msg[pow2], tid[pow2], :6] = numpy.stack(
        [lo[pow2], hi[pow2], count[pow2], numpy.full(pow2.sum(), POW2),
         a[pow2], b[pow2]], axis=1)
    raw = fmt == codec.FMT_RAW
    f64, dense = (a[raw] & codec.RAW_FLOAT64) != 0, \
        (a[raw] & codec.RAW_DENSE) != 0
    kind = numpy.where(dense, numpy.where(f64, DENSE64, DENSE32),
                       numpy.where(f64, RAW64, RAW32))
    desc[msg[raw], tid[raw], :4] = numpy.stack(
        [lo[raw], hi[raw], count[raw], kind], axis=1)
    gap = rows[fmt == codec.FMT_GAP]
    first = numpy.concatenate([[0], numpy.cumsum(gap[:, 3])]).astype(
        numpy.int64)
    # a descriptor for each tensor of each FMT_GAP group's span
    reps = gap[:, 7] + 1
    j = numpy.repeat(numpy.arange(len(gap)), reps)
    t = gap[j, 1] + numpy.arange(reps.sum()) - numpy.repeat(
        numpy.cumsum(reps) - reps, reps)
    e_lo, e_hi = _split(first[j])
    at_lo, at_hi = _split(bounds[t] - bounds[gap[j, 1]])
    desc[gap[j, 0], t] = numpy.stack(
        [e_lo, e_hi, gap[j, 3], numpy.full(j.size, GAP), gap[j, 4],
         gap[j, 5], at_lo, at_hi], axis=1)
    return desc, gap, first[:-1], int(first[-1])


def _gap_groups(gap, first, starts, bounds):
    """What ``vgc_model_gap_expand`` needs of the FMT_GAP groups ``gap``
    (rows of the group table), one row each, no block read here: each
    group's first block (cumulative, int64 [groups + 1]; a block per
    restart point and one before them) and its row (int64 [groups,
    GAP_ROW]: its body's first word in the upload, its codes, its first
    element's place in the expanded array, ``first``, its index space,
    its message).  ``starts``: where each message starts in the upload;
    ``bounds``: the model's tensor offsets, end to end."""
    nb = _blocks_of(gap[:, 3])
    block_starts = numpy.concatenate([[0], numpy.cumsum(nb)]).astype(
        numpy.int64)
    span_size = bounds[gap[:, 1] + gap[:, 7] + 1] - bounds[gap[:, 1]]
    rows = numpy.stack([starts[gap[:, 0]] + gap[:, 6], gap[:, 3], first,
                        span_size, gap[:, 0]], axis=1).astype(numpy.int64)
    return block_starts, rows


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


def _prefix(params, sizes, ranks):
    """The upload's first words, before the descriptors: each dtype's
    offsets and tensor ids, the model's offsets (bounds) and the sums'
    offsets (acc_at) for the scatter, and room for each rank's items (its
    groups' cumulative counts and first tensors: at most a group a
    tensor); all int64.  Returns (the dtype groups, bounds, acc_at, the
    words before the descriptors, the descriptors' words)."""
    groups = _dtype_groups(params, sizes)
    n = len(sizes)
    bounds = numpy.concatenate([[0], numpy.cumsum(sizes)]).astype(
        numpy.int64)
    wide = numpy.array([numpy.dtype(p.dtype) == numpy.float64
                        for p in params], numpy.int64)
    acc_at = numpy.concatenate([[0], numpy.cumsum(
        numpy.asarray(sizes, numpy.int64) * (1 + wide))]).astype(numpy.int64)
    head = sum(2 * tab.size for _, _, tab in groups) + \
        2 * (2 * (n + 1) + ranks * (2 * n + 1))
    return groups, bounds, acc_at, head, ranks * n * DESC_WORDS


def _gap_words(groups):
    """Words of ``groups`` FMT_GAP rows and their block starts (int64)."""
    return 2 * (groups + 1 + GAP_ROW * groups)


def receive_into(sizes, staging, params, ranks):
    """For :func:`chainer_vgc.chainermn.transport.allgatherv`'s ``into``: MPI
    receives the ``ranks`` messages straight into the upload's buffer
    (``staging``, the :class:`~chainer_vgc.backends.arrays.HostStaging`
    :func:`mean` uploads from), after the room the tables and descriptors
    take and with room after them for the FMT_GAP groups' rows (at most a
    group a tensor a rank), so :func:`mean` copies no message."""
    n = len(sizes)
    head, d_words = _prefix(params, sizes, ranks)[3:]
    at = head + d_words

    def into(words):
        room = 2 + _gap_words(ranks * n)  # (a word of padding at most)
        return staging.view(
            at + words + room, numpy.uint32)[at:at + words]
    return into


def _items(rows, p, n):
    """Each rank's items for the scatter (int64 [p, 2 n + 1]: its groups'
    cumulative element counts from 0, then their first tensors), and how
    many groups and elements each rank has."""
    items = numpy.zeros((p, 2 * n + 1), numpy.int64)
    msg = rows[:, 0]
    per = numpy.bincount(msg, minlength=p)[:p]
    first = numpy.concatenate([[0], numpy.cumsum(per)[:-1]])
    r = numpy.arange(len(rows)) - numpy.repeat(first, per)  # row in rank
    ends = numpy.cumsum(rows[:, 3]) - numpy.repeat(
        numpy.concatenate([[0], numpy.cumsum(rows[:, 3])])[first], per)
    items[msg, r + 1] = ends
    items[msg, n + 1 + r] = rows[:, 1]
    counts = numpy.bincount(msg, rows[:, 3], minlength=p)[:p].astype(
        numpy.int64)
    return items, per, counts


def mean(blocks, sizes, staging, params, size, dense, rescale, rows=None):
    """``param.grad`` = the mean of the ``blocks`` for every parameter
    (validated on the host, the FMT_GAP codes perhaps excepted: they are
    checked here, by ``vgc_model_gap_expand``); ``sizes``: the model's
    tensor sizes; ``staging``: the upload's
    :class:`~chainer_vgc.backends.arrays.HostStaging`, kept from step to
    step (the upload's size changes every step, and a new pinned buffer a
    step would pin more memory each step).  Returns False (nothing done) when
    a message carries a format of :data:`TENSOR_BY_TENSOR` (FMT_QSGD,
    FMT_SPARSE); :data:`REFUSED` (nothing written) when a
    message's codes failed the device's checks.  ``rows``: their group
    table, as the validation read it (default: :func:`group_rows`).
    Messages that MPI received into the upload's buffer
    (:func:`receive_into`) are uploaded where they are."""
    if rows is None:
        rows = group_rows(blocks, sizes)
    if numpy.isin(rows[:, 2], TENSOR_BY_TENSOR).any():
        return False
    p, n = len(blocks), len(sizes)
    xp = arrays.get_array_module(params[0].array)
    # [each dtype's offsets and tensor ids, bounds, acc_at, each rank's
    # items (int64)][descriptors][the messages as received][FMT_GAP
    # groups' first blocks and rows (int64)]: one upload, from a host
    # buffer kept from step to step
    groups, bounds, acc_at, head, d_words = _prefix(params, sizes, p)
    lens = numpy.array([blk.size for blk in blocks], numpy.int64)
    n_gap = int((rows[:, 2] == codec.FMT_GAP).sum())
    tail = head + d_words + int(lens.sum())
    tail += tail % 2 if n_gap else 0  # (int64 from here)
    total = tail + (_gap_words(n_gap) if n_gap else 0)
    staged = staging.view(total, numpy.uint32)
    buf_host = staged[head:]  # the words the descriptors count from
    # where each message starts in it: where MPI put it, else one after
    # the other behind the descriptors (copied there)
    starts = (numpy.array([_address(blk) for blk in blocks], numpy.int64)
              - _address(buf_host)) // 4
    in_place = bool(p) and (starts >= d_words).all() and (
        starts + lens <= d_words + lens.sum()).all()
    if not in_place:
        if any(numpy.may_share_memory(blk, staged) for blk in blocks):
            blocks = [blk.copy() for blk in blocks]  # (never overwrite one)
        starts = d_words + numpy.concatenate([[0], numpy.cumsum(lens)[:-1]]) \
            if p else numpy.zeros(0, numpy.int64)
        for blk, at in zip(blocks, starts):  # a copy a message
            buf_host[at:at + blk.size] = blk
    desc, gap, first, expanded = _descriptors(rows, bounds, p, starts)
    items, per, counts = _items(rows, p, n)
    pos = 0
    for tab in [tab for _, _, tab in groups] + [bounds, acc_at, items]:
        tab = numpy.ascontiguousarray(tab).reshape(-1).view(numpy.uint32)
        staged[pos:pos + tab.size] = tab
        pos += tab.size
    buf_host[:d_words] = desc.reshape(-1)
    n_blocks = 0
    if n_gap:
        block_starts, gap_rows = _gap_groups(gap, first, starts, bounds)
        n_blocks = int(block_starts[-1])
        staged[tail:total] = numpy.concatenate(
            [block_starts, gap_rows.reshape(-1)]).view(numpy.uint32)
    with arrays.device_scope(params[0].array):
        uploaded = xp.asarray(staged)
        # CuPy queues the copy from pinned memory on the current stream
        # and returns: the buffer is handed out again (next step) only
        # once this event, recorded after the copy, has completed
        staging.hold_until(arrays.upload_fence(uploaded))
        buf = uploaded[head:]  # body offsets count from here
        gaps = xp.empty(max(expanded, 1), numpy.uint64)
        errs = None
        if n_gap:
            errs = xp.zeros(p, numpy.uint32)
            gap_tab = uploaded[tail:total].view(numpy.int64)
            kernels.get_kernel('vgc_model_gap_expand')(
                buf, gap_tab[:n_gap + 1], gap_tab[n_gap + 1:],
                numpy.int32(n_gap), xp.empty(n_blocks, numpy.int32), gaps,
                errs)
        tables = uploaded[:head - 2 * items.size].view(numpy.int64)
        rescaled = rescale not in (None, 1)
        args = (rescaled, numpy.float64(1.0 / size),
                numpy.float64(rescale if rescaled else 1.0),
                numpy.float32(numpy.float16(1.0 / size)))
        if dense:  # each element's values found by binary search
            means = _mean_by_lookup(xp, groups, tables, buf, gaps, n, p,
                                    args)
        else:  # each rank's elements added to their sums, in rank order
            means = _mean_by_scatter(xp, groups, tables, uploaded, head,
                                     items, per, counts, buf, gaps, n, p,
                                     int(acc_at[-1]), args)
        if errs is not None and errs.get().any():  # (waits for the device)
            return REFUSED
        for (dtype, tids, tab), out in zip(groups, means):
            ends = tab[:len(tids) + 1]
            for t, lo, hi in zip(tids, ends[:-1], ends[1:]):
                params[t].grad = out[lo:hi].reshape(params[t].shape)
    return True


def _local_tables(groups, tables):
    """Each dtype group's (offsets, tensor ids) on the device."""
    at = 0
    for _, tids, tab in groups:
        table = tables[at:at + tab.size]
        at += tab.size
        yield table[:len(tids) + 1], table[len(tids) + 1:]


def _mean_by_lookup(xp, groups, tables, buf, gaps, n, p, args):
    """``vgc_model_decode_mean``: a thread per element, one launch per
    parameter dtype (the dense tree's order)."""
    means = []
    for (dtype, tids, tab), (offsets, ids) in zip(
            groups, _local_tables(groups, tables)):
        out = xp.empty(int(tab[len(tids)]), dtype)
        kernels.get_kernel('vgc_model_decode_mean')(
            buf, gaps, offsets, ids, numpy.int32(len(tids)), numpy.int32(n),
            numpy.int32(p), True, *(args + (out,)))
        means.append(out)
    return means


def _mean_by_scatter(xp, groups, tables, uploaded, head, items, per, counts,
                     buf, gaps, n, p, acc_words, args):
    """The sums from +0.0 (one zeroed array), one ``vgc_model_scatter``
    launch per rank with elements, in rank order, then one
    ``vgc_model_finish`` per parameter dtype."""
    at = sum(tab.size for _, _, tab in groups)
    bounds, acc_at = tables[at:at + n + 1], tables[at + n + 1:at + 2 * n + 2]
    item_tab = uploaded[head - 2 * items.size:head].view(numpy.int64)
    acc = xp.zeros(max(acc_words, 1), numpy.uint32)
    done = xp.empty(max(int(counts.max()) if p else 0, 1), numpy.int32)
    for b in range(p):
        if not counts[b]:
            continue
        row = item_tab[b * items.shape[1]:(b + 1) * items.shape[1]]
        kernels.get_kernel('vgc_model_scatter')(
            buf, gaps, row[:int(per[b]) + 1], row[n + 1:n + 1 + int(per[b])],
            numpy.int32(per[b]), numpy.int32(b), numpy.int32(n), bounds,
            acc_at, done[:int(counts[b])], acc)
    means = []
    for (dtype, tids, tab), (offsets, ids) in zip(
            groups, _local_tables(groups, tables)):
        out = xp.empty(int(tab[len(tids)]), dtype)
        kernels.get_kernel('vgc_model_finish')(
            acc, acc_at, offsets, ids, numpy.int32(len(tids)),
            *(args + (out,)))
        means.append(out)
    return means
