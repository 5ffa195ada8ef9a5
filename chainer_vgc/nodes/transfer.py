"""Inside a node: the dense reduce-scatter and allgather of the
hierarchical exchange (issue 27).

The question this module answers: how do a node's k ranks turn their
gradients into the node's g and s, and the shards' means back into every
rank's ``param.grad``?  By point-to-point messages between the ranks of
the node (``layout.intra_comm``, shared memory on a real node), straight
from and into the arrays: each parameter's gradient (and sum of squares)
goes to the local rank that owns it (:func:`chainer_vgc.nodes.layout.
owners`), which sums the k parts in local-rank order (:func:`node_mean`,
the one definition); the owner's mean goes back to the k - 1 others.  A
small allgather first tells every rank which ranks have which gradient.
Device arrays travel through host memory.
"""

import numpy

from chainer_vgc.backends import arrays


def node_mean(parts, divisor):
    """(parts[0] + parts[1] + ...) / divisor, summed in this order in the
    parts' dtype: the one definition of a node's g (divisor k) and s
    (divisor k**2); :func:`reduce_to_owners` computes it in place and the
    tests' flat runs call it."""
    total = numpy.array(parts[0], copy=True)
    for part in parts[1:]:
        total += part
    total /= total.dtype.type(divisor)
    return total


def _host(array, dtype):
    """``array`` as a contiguous host array of ``dtype`` (itself when it
    already is one)."""
    return numpy.ascontiguousarray(arrays.to_numpy(array), dtype=dtype)


def _bytes(a):
    from mpi4py import MPI
    return [a.reshape(-1).view(numpy.uint8), MPI.BYTE]


class NodeWork(object):
    """Receive buffers kept from step to step (one per parameter, part and
    sending rank), so a loop of fixed shapes allocates nothing large after
    its first step."""

    def __init__(self):
        self.buffers = {}

    def get(self, key, p):
        buf = self.buffers.get(key)
        if buf is None or buf.size != p.size or buf.dtype != p.dtype:
            buf = self.buffers[key] = numpy.empty(p.size, p.dtype)
        return buf


def _sum_in_order(parts, me, out, k, divisor):
    """node_mean of ``parts`` (local-rank order) into ``out``, which holds
    ``parts[me]`` on entry (or is a free buffer when ``me`` is None)."""
    if me is not None and me > 1:  # (out is needed as an input later)
        parts = list(parts)
        parts[me] = parts[me].copy()
    if me == 0:
        start = 1
    else:
        numpy.add(parts[0], parts[1], out=out) if k > 1 else \
            numpy.copyto(out, parts[0])
        start = 2
    for part in parts[start:]:
        out += part
    out /= out.dtype.type(divisor)
    return out


def reduce_to_owners(layout, params, owner, sqsums, need_s, zero_fill,
                     work):
    """Each owned ``param.grad`` becomes the node's g; returns (the node's
    s per parameter, None where not owned or not needed; which ranks of
    the node had each gradient; bytes this rank sent).  A gradient missing
    on a rank counts as zeros; one missing on every rank stays None unless
    ``zero_fill``."""
    from mpi4py import MPI
    k, me, comm = layout.ranks_per_node, layout.local_rank, layout.intra_comm
    has = tuple(p.grad is not None for p in params)
    flags = comm.allgather(has) if k > 1 else [has]
    out = [None] * len(params)
    requests, keep, sent = [], [], 0
    for i, p in enumerate(params):
        sources = [('g', p.grad)]
        if need_s[i]:
            sources.append(('s', sqsums[i]))
        if owner[i] != me:
            if has[i]:
                for n, (part, a) in enumerate(sources):
                    host = _host(a if a is not None else
                                 numpy.zeros(p.shape, p.dtype), p.dtype)
                    keep.append(host)
                    requests.append(comm.Isend(_bytes(host), owner[i],
                                               2 * i + n))
                    sent += host.nbytes
            continue
        for r in range(k):
            if r != me and flags[r][i]:
                for n, (part, _) in enumerate(sources):
                    requests.append(comm.Irecv(
                        _bytes(work.get((i, part, r), p)), r, 2 * i + n))
    MPI.Request.Waitall(requests)
    del keep
    for i, p in enumerate(params):
        if owner[i] != me:
            continue
        present = [flags[r][i] for r in range(k)]
        if not any(present):
            if not zero_fill:
                p.grad = None
                continue
        zeros = None

        def parts(part, mine):
            nonlocal zeros
            got = []
            for r in range(k):
                if r == me:
                    got.append(mine)
                elif present[r]:
                    got.append(work.get((i, part, r), p))
                else:
                    if zeros is None:
                        zeros = numpy.zeros(p.size, p.dtype)
                    got.append(zeros)
            return got
        g = p.grad
        on_host = isinstance(g, numpy.ndarray) and g.flags.c_contiguous
        own = g.reshape(-1) if on_host else (
            _host(g, p.dtype).reshape(-1) if g is not None else
            numpy.zeros(p.size, p.dtype))
        own = _sum_in_order(parts('g', own), me, own, k, k)
        if not on_host:
            with arrays.device_scope(p.array):
                p.grad = p.xp.asarray(own.reshape(p.shape))
        if need_s[i]:
            s = sqsums[i]
            mine = numpy.zeros(p.size, p.dtype) if s is None else \
                _host(s, p.dtype).reshape(-1)
            node_s = _sum_in_order(parts('s', mine), None,
                                   work.get((i, 's', me), p), k, k * k)
            with arrays.device_scope(p.array):
                out[i] = p.xp.asarray(node_s.reshape(p.shape))
    return out, flags, sent


def gather_means(layout, params, owner, flags, zero_fill):
    """Every owner's mean into ``param.grad`` on the other ranks of the
    node (in place where it is a host array); returns the bytes this rank
    sent."""
    from mpi4py import MPI
    k, me, comm = layout.ranks_per_node, layout.local_rank, layout.intra_comm
    if k == 1:
        return 0
    requests, keep, fill, sent = [], [], [], 0
    for i, p in enumerate(params):
        j = owner[i]
        if not zero_fill and not any(f[i] for f in flags):
            if j != me:
                p.grad = None
            continue
        if j == me:
            host = _host(p.grad, p.dtype)
            keep.append(host)
            for r in range(k):
                if r != me:
                    requests.append(comm.Isend(_bytes(host), r, i))
                    sent += host.nbytes
            continue
        g = p.grad
        if isinstance(g, numpy.ndarray) and g.flags.c_contiguous and \
                g.dtype == p.dtype:
            buf = g
        else:
            buf = numpy.empty(p.shape, p.dtype)
            fill.append((p, buf))
        requests.append(comm.Irecv(_bytes(buf), j, i))
    MPI.Request.Waitall(requests)
    for p, buf in fill:
        with arrays.device_scope(p.array):
            p.grad = p.xp.asarray(buf)
    return sent
