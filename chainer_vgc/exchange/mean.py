"""The exchange arithmetic of one step: from every rank's message to the mean.

The question this module answers: once every rank holds every rank's
message, what does ``param.grad`` become, bit for bit?  The data flow of one
step runs one way (paper Sec. 4.3):

1. this worker's gradients (:func:`local_gradients`; missing ones as zeros
   with ``zero_fill``), divided by the loss scale (:func:`unscaled`), go to
   the compressor, which makes one uint32 message;
2. the transport (an allgatherv, :mod:`chainer_vgc.chainermn.transport`) gives every
   rank every rank's message; nothing is re-compressed;
3. every message is decoded and the messages are summed in rank order
   (indices may overlap), then multiplied by 1/p as ChainerMN's naive
   communicator does, into ``param.grad`` (:func:`mean_gradients`: the
   reference :func:`sum_messages` + :func:`write_mean`, or the native
   backend's one fused call, equal to it bit for bit).

On a GPU the whole model is decoded at once where it can be
(:mod:`chainer_vgc.engines.cuda.decode`): the messages' structure is checked on
the host (:func:`validate_messages` with ``codes=False``), the messages go
up as received in one copy, and the device decodes and checks the
gap-coded groups (FMT_GAP) from their restart points and sums the
messages, reading back only the flags of those checks.  Otherwise
(FMT_QSGD) the messages are checked on the host, their FMT_GAP groups
expanded to indices there (:func:`chainer_vgc.codec.expand_gap`),
uploaded in one copy (:func:`upload_blocks`) and decoded tensor by
tensor on the device.  A dense group (method
``'none'``, the simulation's dense group) is summed in a rank-order pairwise
tree, MPI's recursive-doubling order, so that 2^k ranks reproduce a dense
allreduce bit for bit.

No MPI here: :class:`~chainer_vgc.chainermn.communicator.VGCCommunicator` and the
one-process :class:`~chainer_vgc.harness.simulation.SimulatedWorkers` call the same
functions in the same rank order, which is why the simulation matches an
``mpiexec`` run bit for bit.
"""

import functools

import numpy

from chainer_vgc.backends import arrays as backend
from chainer_vgc import codec
from chainer_vgc.engines.cuda import decode as device_decode
from chainer_vgc.backends.cuda import kernels
from chainer_vgc.engines.native import bindings as native


# -- this worker: what goes into the compressor ----------------------------
def local_gradients(params, sqsums, zero_fill):
    """This worker's gradients and sums of squares for the compressor.

    With ``zero_fill`` (ChainerMN's default) a missing gradient counts as
    zeros, as in ChainerMN's communicators.
    """
    grads = [p.grad for p in params]
    if sqsums is not None:
        sqsums = [None if g is None else s for g, s in zip(grads, sqsums)]
    if zero_fill:
        def zeros(p):
            with backend.device_scope(p.array):
                return p.xp.zeros_like(p.array)
        if sqsums is not None:
            sqsums = [zeros(p) if g is None else s
                      for p, g, s in zip(params, grads, sqsums)]
        grads = [zeros(p) if g is None else g
                 for p, g in zip(params, grads)]
    return grads, sqsums


def unscaled(grads, sqsums, loss_scale):
    """g / S and s / S**2 in the state dtypes (unchanged without S)."""
    if loss_scale in (None, 1):
        return grads, sqsums
    scale = float(loss_scale)

    def div(a, by):
        if a is None:
            return None
        sdt = backend.state_dtype(a.dtype)
        with backend.device_scope(a):  # (the subnormal rule on a GPU)
            return kernels.divide(kernels.cast(a, sdt), by)
    grads = [div(g, scale) for g in grads]
    if sqsums is not None:
        sqsums = [div(s, scale * scale) for s in sqsums]
    return grads, sqsums


# -- every rank: the gathered messages to param.grad -----------------------
def mean_gradients(blocks, compressor, params, grads, size, zero_fill,
                   dense, rescale=None, present=None):
    """``param.grad`` = (sum of every worker's elements) * (1 / size).

    On the native backend one call validates the messages and writes the
    sums, in rank order, straight into the gradient arrays with the mean
    applied (float16 parameters through a float32 buffer); elsewhere, and
    for the rank-order tree of ``dense`` ('none'), the reference
    :func:`sum_messages` + :func:`write_mean`, which it equals bit for bit.
    ``rescale``: the loss scale to multiply back (:func:`_finish_mean`).
    ``present[i]``: whether any worker had a gradient for parameter i
    (with ``zero_fill=False`` such a parameter gets the mean, zeros
    included, on every worker; without ``present``, a gradient-less
    parameter gets it only where something was sent).
    Returns the number of elements each message carries.
    """
    if _on_device(params):
        return _device_mean(blocks, compressor, params, grads, size,
                            zero_fill, dense, rescale, present)
    if dense or not _native_decode_applies(blocks, compressor):
        write_mean(params, grads,
                   sum_messages(blocks, compressor, params, dense), size,
                   zero_fill, rescale, present)
        return [codec.message_count(b) for b in blocks]
    scale = 1.0 / size
    sdts = [backend.state_dtype(p.dtype) for p in params]
    outs, direct = [], []
    for i, (p, g, sdt) in enumerate(zip(params, grads, sdts)):
        grad = p.grad
        ok = (grad is not None and g is not None and grad.dtype == sdt
              and grad.dtype == p.dtype and grad.flags.c_contiguous
              and grad.size == compressor.sizes[i])
        outs.append(grad.reshape(-1) if ok else compressor.decode_buffer(i))
        direct.append(ok)
    result = native.decode_mean(blocks, compressor.sizes, sdts, outs, direct,
                                scale)
    if result is None:  # name the fault as the reference decoder does
        codec.name_the_fault(blocks, compressor.sizes,
                             [p.dtype for p in params])
    touched, elements = result
    for i, (p, g, out, ok, n) in enumerate(zip(params, grads, outs, direct,
                                               touched)):
        if ok:
            if rescale not in (None, 1):
                p.grad *= p.grad.dtype.type(rescale)
            continue
        if _stays_none(g, zero_fill, present, i,
                       lambda: bool(n and out.any())):
            continue  # nothing (or a zero sum) for a gradient-less param
        p.grad = _finish_mean(out.reshape(p.shape).copy(), p.dtype, size,
                              rescale)
    return [int(e) for e in elements]


def sum_messages(blocks, compressor, params, dense):
    """Decode every worker's message and add them up, in rank order.

    ``dense`` (method 'none'): a rank-order pairwise tree, the order of
    MPI's recursive doubling, so that 2^k ranks reproduce a dense allreduce
    bit for bit (two ranks: any order does).
    """
    xp = backend.get_array_module(blocks[0]) if blocks else numpy
    adders = [functools.partial(codec.decode_into, block,
                                sizes=compressor.sizes) for block in blocks]
    return _rank_order_sum(adders, lambda: _zero_sums(params, xp), dense)


def _zero_sums(params, xp):
    """Zeros of each parameter's shape in its state dtype, on its device."""
    out = []
    for p in params:
        with backend.device_scope(p.array):
            out.append(xp.zeros(p.shape, dtype=backend.state_dtype(p.dtype)))
    return out


def _rank_order_sum(adders, zeros, dense):
    """Every worker's elements added up in rank order: ``adders[r](outs)``
    adds worker r's message into ``outs``, fresh ``zeros()``; ``dense``:
    each worker into its own zeros, then the pairwise tree
    (:func:`_tree_sum`)."""
    if dense:
        per_rank = []
        for add in adders:
            per_rank.append(zeros())
            add(per_rank[-1])
        return _tree_sum(per_rank)
    outs = zeros()
    for add in adders:
        add(outs)
    return outs


def _stays_none(g, zero_fill, present, i, received):
    """Whether parameter i, without a gradient here, keeps ``grad = None``:
    only with ``zero_fill`` off, and when no worker had a gradient for it
    (``present``, the workers' agreement) or, without that, when nothing
    nonzero was received (``received()``)."""
    if g is not None or zero_fill:
        return False
    return not (present[i] if present is not None else received())


def write_mean(params, grads, sums, size, zero_fill, rescale=None,
               present=None):
    """param.grad = sum * (1 / size) in the parameter dtype (as ChainerMN);
    ``rescale`` (the loss scale): times it, in the sum's dtype before the
    cast to a float16 parameter's dtype (see :func:`_finish_mean`);
    ``present``: see :func:`mean_gradients`."""
    for i, (p, g, total) in enumerate(zip(params, grads, sums)):
        if _stays_none(g, zero_fill, present, i,
                       lambda: bool((total != 0).any())):
            continue  # nobody sent anything for a gradient-less param
        with backend.device_scope(p.array):
            p.grad = _finish_mean(total, p.dtype, size, rescale)


def _finish_mean(total, dtype, size, rescale):
    """The mean in ``dtype`` of a sum (ours to reuse): the sum cast to
    ``dtype`` times 1/size (as ChainerMN); with a loss scale S, the sum
    times 1/size times S in its own (state) dtype, then the cast, so that a
    float16 gradient is neither rounded unscaled nor multiplied by an S
    that float16 cannot hold."""
    dtype = numpy.dtype(dtype)
    if backend.get_array_module(total) is not numpy:
        return _device_finish_mean(total, dtype, size, rescale)
    if rescale in (None, 1):
        mean = total.astype(dtype, copy=False)
        mean *= 1.0 / size
        return mean
    total *= total.dtype.type(1.0 / size)
    total *= total.dtype.type(rescale)
    return total.astype(dtype, copy=False)


def _device_finish_mean(total, dtype, size, rescale):
    """:func:`_finish_mean` with the subnormal rule's kernels, the same
    values: float16 products are taken in float32 (exact for two float16
    numbers) and rounded once to float16, as NumPy's float16 multiply
    does."""
    if rescale not in (None, 1):
        total = kernels.scale(kernels.scale(total, 1.0 / size), rescale)
        return kernels.cast(total, dtype)
    mean = kernels.cast(total, dtype)
    if dtype == numpy.float16:
        k = numpy.float32(numpy.float16(1.0 / size))
        return kernels.cast(kernels.scale(kernels.cast(mean, numpy.float32),
                                          k), dtype)
    return kernels.scale(mean, 1.0 / size)


# -- checks before a decode that trusts its input --------------------------
def validate_messages(blocks, compressor, dtypes, table=False, codes=True):
    """Check every host message against the model, as :func:`codec.unpack`
    does (the native decoder's walk where it applies: same checks, no
    output); returns the elements each carries, and with ``table`` also
    the group table that walk read (None without the native backend; see
    :func:`chainer_vgc.engines.cuda.decode.group_rows`).  A fault raises
    :class:`~chainer_vgc.codec.WireFormatError` as the reference names
    it.  ``codes=False`` (with the native backend): the FMT_GAP groups'
    codes are left unchecked, for the device decode, which checks them
    (:func:`chainer_vgc.engines.cuda.decode.mean`); a message refused even so
    is checked in full, which names the fault."""
    sizes = compressor.sizes
    sdts = [backend.state_dtype(d) for d in dtypes]
    if _native_decode_applies(blocks, compressor):
        result = native.decode_mean(blocks, sizes, sdts, [None] * len(sizes),
                                    [0] * len(sizes), 1.0, table=table,
                                    gap_codes=codes)
        if result is None and not codes:
            result = native.decode_mean(blocks, sizes, sdts,
                                        [None] * len(sizes),
                                        [0] * len(sizes), 1.0, table=table)
        if result is not None:
            elements = [int(e) for e in result[1]]
            return (elements, result[2]) if table else elements
        codec.name_the_fault(blocks, sizes, dtypes)
    counts = [sum(int(d.index.size) for d in codec.unpack(block, sizes,
                                                           dtypes))
              for block in blocks]
    return (counts, None) if table else counts


def receive_into(compressor, params, grads, size):
    """Where MPI should receive this step's ``size`` messages
    (:func:`chainer_vgc.chainermn.transport.allgatherv`'s ``into``): for parameters
    on a GPU that the whole-model decode takes, the buffer it uploads from
    (:func:`chainer_vgc.engines.cuda.decode.receive_into`); else None, a new host
    array."""
    if not _on_device(params) or not device_decode.applies(
            [None] * size, compressor, params, grads, False):
        return None
    return device_decode.receive_into(compressor, params, size)


def _native_decode_applies(blocks, compressor):
    return (compressor.backend == 'native'
            and all(isinstance(b, numpy.ndarray) for b in blocks)
            and all(d in native.DTYPE_CODES for d in compressor.dtypes))


def _on_device(params):
    return any(backend.get_array_module(p.array) is not numpy
               for p in params if p.array is not None)


# -- the GPU path: one upload, decode and sum on the device ----------------
def upload_blocks(blocks, xp, like, staging=None):
    """Every rank's message on ``like``'s device with one host-to-device
    copy (through one pinned buffer: ``staging``'s, a
    :class:`~chainer_vgc.backends.arrays.HostStaging` kept from step to step, or a
    new one); returns a device view per block."""
    sizes = [int(b.size) for b in blocks]
    staging = staging or backend.HostStaging()
    staged = staging.view(sum(sizes), numpy.uint32)
    pos = 0
    for b, n in zip(blocks, sizes):
        staged[pos:pos + n] = b
        pos += n
    with backend.device_scope(like):
        device = xp.asarray(staged)
        staging.hold_until(backend.upload_fence(device))
    views, pos = [], 0
    for n in sizes:
        views.append(device[pos:pos + n])
        pos += n
    return views


def _device_mean(blocks, compressor, params, grads, size, zero_fill, dense,
                 rescale, present=None):
    """:func:`mean_gradients` for parameters on a GPU.  The messages are
    validated on the host (where MPI left them; for the whole-model decode
    all but the FMT_GAP codes, which it checks on the device), uploaded
    once, decoded and summed on the device (in rank order; ``dense``: in
    the rank-order tree of :func:`sum_messages`): the reference's sums bit
    for bit.  (Parameters on several devices: the blocks are uploaded to
    the first one's device and read from there.)"""
    dtypes = [p.dtype for p in params]
    whole = device_decode.applies(blocks, compressor, params, grads, dense)
    # the whole-model decode checks the FMT_GAP codes itself
    elements, rows = validate_messages(blocks, compressor, dtypes, True,
                                       codes=not whole)
    if whole:
        done = device_decode.mean(blocks, compressor, params, size, dense,
                                  rescale, rows)
        if done is device_decode.REFUSED:
            # a message's codes failed the device's checks (nothing was
            # written): the reference names the fault
            codec.name_the_fault(blocks, compressor.sizes, dtypes,
                                 'the device decode')
        if done:
            return elements
        validate_messages(blocks, compressor, dtypes)  # (codes too, now)
    # gap-coded indices are sequential codes: decoded here, on the host
    decoder, _ = compressor.gap_codec()
    blocks = [codec.expand_gap(b, compressor.sizes, decoder) for b in blocks]
    arrays = [p.array for p in params if p.array is not None]
    xp = backend.get_array_module(*arrays)
    first = next(a for a in arrays if backend.get_array_module(a) is xp)
    device = upload_blocks(blocks, xp, first, device_decode.upload_staging(
        compressor, 'fallback'))  # (the blocks may be in the other)

    def adder(host, dev):
        def add(outs):
            codec.add_validated(host, dev, [o.reshape(-1) for o in outs],
                                compressor.sizes)
        return add
    with backend.device_scope(first):
        sums = _rank_order_sum([adder(h, d) for h, d in zip(blocks, device)],
                               lambda: _zero_sums(params, xp), dense)
    write_mean(params, grads, sums, size, zero_fill, rescale, present)
    return elements


# -- the dense rank-order tree ---------------------------------------------
def _tree_sum(per_rank):
    """Pairwise sums of per-rank lists of arrays in rank order (MPI's
    recursive doubling), added with :func:`chainer_vgc.backends.cuda.kernels.add_into`."""
    while len(per_rank) > 1:
        nxt = [[kernels.add_into(a.copy(), b)
                for a, b in zip(per_rank[k], per_rank[k + 1])]
               for k in range(0, len(per_rank) - 1, 2)]
        if len(per_rank) % 2:
            nxt.append(per_rank[-1])
        per_rank = nxt
    return per_rank[0]
