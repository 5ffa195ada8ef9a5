"""One hierarchical exchange: a node of k ranks acts as one VGC worker.

The question this module answers: in what order does one exchange run
when ranks share nodes (issue 27)?  VGC's statistics are additive: a node
whose k ranks computed g_i (each the mean over its B examples) and s_i
(the sum of squares of its per-example gradients / B, paper Sec. 4.1) is
exactly one worker of batch kB, with

    g = (g_0 + ... + g_{k-1}) / k,    s = (s_0 + ... + s_{k-1}) / k**2.

So, on every rank:

1. every rank checks that all ranks have the same model and settings,
   and the parameters are given to the local ranks (:func:`chainer_vgc.
   nodes.layout.owners`: whole parameters, so that each tensor is
   quantized as the flat exchange would, Sec. 4.2);
2. inside the node, one dense reduce-scatter (``Alltoallv``, then the sum
   in local-rank order): each local rank holds its node's g and s of the
   parameters it owns (:func:`chainer_vgc.nodes.transfer.
   reduce_to_owners`);
3. each local rank runs the flat exchange (:func:`chainer_vgc.exchange.run.
   exchange_parameters`) on its shard, with its shard's residuals, among the
   ranks of the same local index on the q = p/k nodes: allgatherv of the
   compressed group, allreduce of the dense group.  The ranks agree on
   faults over every rank (one small allgather, as the flat exchange),
   so a non-finite gradient anywhere skips the step everywhere;
4. inside the node, an allgather of the shards' means
   (:func:`chainer_vgc.nodes.transfer.gather_means`).

The result is VGC with q workers of batch kB, bit for bit
(tests/mpi/check_hierarchy.py).  Reported: the flat figures over the q
node-workers, plus ``vgc/inter_node_bytes`` (bytes each node sends to the
others) and ``vgc/intra_node_bytes`` (bytes each rank sends inside its
node).
"""

import time

from chainer_vgc import reporting
from chainer_vgc import faults
from chainer_vgc.nodes import layout as node_layout
from chainer_vgc.nodes import transfer as node_transfer
from chainer_vgc.exchange import run as exchange_run
from chainer_vgc.exchange.state import MethodState
from chainer_vgc.exchange.state import initialized_params
from chainer_vgc.params import model_params


class ShardView(object):
    """The parameters of ``model`` that one local rank owns, seen as a
    model (``namedparams``); ``whole`` is the model."""

    def __init__(self, model, names):
        self.whole = model
        self.names = frozenset(names)

    def namedparams(self, include_uninit=True):
        for name, p in self.whole.namedparams(include_uninit):
            if name in self.names:
                yield name, p


class NodeMethodState(MethodState):
    """A :class:`~chainer_vgc.exchange.state.MethodState` whose compressor
    holds the residuals of this rank's shard only; the dense group and the
    need for statistics are those of the whole model."""

    def __init__(self, *args, **kwargs):
        super(NodeMethodState, self).__init__(*args, **kwargs)
        if self.base_rule.exchange == 'allreduce_factors':
            raise ValueError(
                "hierarchy='node' makes each node one worker, so that the "
                'allgatherv of the messages grows with the nodes rather '
                "than the ranks; method {!r} sums its factors by "
                'allreduce, whose traffic does not grow with the workers: '
                'use the flat communicator (hierarchy=None)'.format(
                    self.method))
        if self.base_rule.reads_every_gradient:
            raise ValueError(
                "hierarchy='node': each rank of a node compresses a shard "
                "of the model, and {!r} needs the norm of the node's whole "
                'gradient (its clip_norm): clip before the exchange '
                '(chainer.optimizer_hooks.GradientClipping on the local '
                'gradient), or use the flat communicator'.format(
                    self.base_rule))
        self.whole = None  # (names, dense) of the whole model
        self.view = None
        self.owners = None  # each initialized parameter's local rank
        self.node_work = node_transfer.NodeWork()
        self._whole_compressed, self._nodes = 0, None

    def dense_group(self, model):
        whole = getattr(model, 'whole', None)
        if whole is None:
            return super(NodeMethodState, self).dense_group(model)
        return super(NodeMethodState, self).dense_group(whole) & \
            model.names

    def names_and_dense(self):
        """The whole model's names and dense group (every shard's), once
        set up; before, as a flat state."""
        if self.whole is None:
            return super(NodeMethodState, self).names_and_dense()
        return self.whole

    @property
    def compressed_elements(self):
        """Elements of the whole model's compressed group (every shard's)."""
        return self._whole_compressed

    @property
    def workers(self):
        return self._nodes

    def setup_node(self, model, collectives):
        """Check the whole model on every rank (one allgather, when it
        changed), give its parameters to the local ranks, and set up this
        rank's shard on the ranks of its local index."""
        names, params = initialized_params(model)
        dense = self.dense_group(model)
        if self.whole != (names, dense):
            self.check_ranks(names, params, dense, collectives)
            layout = collectives.layout
            self.owners = node_layout.owners(
                [p.size * p.dtype.itemsize for p in params],
                layout.ranks_per_node)
            self.view = ShardView(model, [
                n for n, j in zip(names, self.owners)
                if j == layout.local_rank])
            self.whole = (names, dense)
            self._whole_compressed = sum(
                p.size for n, p in zip(names, params) if n not in dense)
            self._nodes = layout.nodes
        # (the ranks of this node share its cores: those of the shard's
        # collectives are on other nodes)
        self.setup(self.view, collectives.inter,
                   collectives.layout.ranks_per_node)


def run_node_exchange(collectives, state, model, zero_fill, sqsums,
                      loss_scale, uncovered, totals):
    """The hierarchical exchange (see the module's steps); same arguments
    and result as :func:`chainer_vgc.exchange.run.run_exchange`, ``collectives``
    being a hierarchical communicator (or its duplicate)."""
    layout = collectives.layout
    state.note_uncovered(uncovered, collectives)
    state.setup_node(model, collectives)
    result = exchange_run.ExchangeResult(totals)
    names, params = initialized_params(model)
    warm = totals['steps'] < state.warmup
    dense = state.whole[1]
    compressed = [not warm and n not in dense for n in names]
    if sqsums is not None:  # aligned with model_params(model)
        by_name = dict(zip(model_params(model)[0], sqsums))
        sqsums = [by_name[n] for n in names]
    need_s = [c and sqsums is not None for c in compressed]
    t0 = time.perf_counter()
    shard_s, flags, intra = node_transfer.reduce_to_owners(
        layout, params, state.owners, sqsums, need_s, zero_fill,
        state.node_work)
    t1 = time.perf_counter()
    view_names = model_params(state.view)[0]
    by_name = dict(zip(names, shard_s))
    view_s = [by_name.get(n) for n in view_names]

    def agree_on(obj):
        """Every rank's fault code, the worst of each node given to that
        node's rank of this shard: all shards decide alike."""
        everyone = collectives.allgather_obj(obj)
        worst = [0] * layout.nodes
        for r, entry in enumerate(everyone):
            node = layout.node_of[r]
            worst[node] = max(worst[node], entry[0])
        return [(worst[layout.node_of[r]],) + tuple(everyone[r][1:])
                for r in layout.peers]

    done = _exchange_shard(collectives, state, names, compressed, view_s,
                           zero_fill, loss_scale, result, model, agree_on)
    t2 = time.perf_counter()
    if done is None:  # skipped on every rank
        exchange_run.nan_grads(params)
        return result
    intra += node_transfer.gather_means(layout, params, state.owners, flags,
                                        zero_fill)
    t3 = time.perf_counter()
    result.figures = report_node_step(collectives, done, intra, totals,
                                      model, state.label, result.choice)
    result.timing = dict(result.timing, node_reduce=t1 - t0,
                         node_gather=t3 - t2)
    return result


def _exchange_shard(collectives, state, names, compressed, view_s,
                    zero_fill, loss_scale, result, model, agree_on):
    """Step 3, the flat exchange of this rank's shard among the ranks of
    its local index (:func:`chainer_vgc.exchange.run.exchange_parameters`,
    its :class:`~chainer_vgc.exchange.run.Sent` or None when skipped).  A
    shard without a compressed parameter still takes part in the
    agreement on faults first, as every shard's compressor does, so that
    a non-finite gradient anywhere skips the step everywhere."""
    mine = [n for n, c in zip(names, compressed) if c and
            n in state.view.names]
    if any(compressed) and not mine:
        try:  # no compressed parameter here: agree all the same
            faults.settle([c[0] for c in agree_on((faults.OK, (), None))],
                          None)
        except faults.SkippedStep as e:
            exchange_run.skip_step(
                [p for _, p in state.view.namedparams()], e, result, state,
                model)
            return None
    return exchange_run.exchange_parameters(
        collectives.inter, state, state.view, zero_fill, view_s,
        loss_scale, result, agree_on)


# -- the figures --------------------------------------------------------------
def report_node_step(collectives, done, intra_bytes, totals, model, label,
                     choice=None):
    """The step's figures over the whole model (one small allgather inside
    the node): the flat figures of q workers, the node being the worker,
    with ``vgc/bytes`` the bytes each rank sends between nodes.  With a
    dense fallback (``choice``: this shard's), ``vgc/dense_steps`` is the
    fraction of the node's shards sent dense."""
    layout = collectives.layout
    q, k = layout.nodes, layout.ranks_per_node
    sent = float(sum(done.elements or ()))
    wire = 4.0 * sum(int(b.size) for b in done.blocks)
    mine = (sent, wire, float(done.n_dense), float(done.dense_wire),
            float(done.n_params), float(done.n_compressed),
            float(done.param_bytes), float(intra_bytes),
            float(choice is not None and choice.dense))
    sums = [sum(col) for col in zip(*layout.intra_comm.allgather(mine))]
    sent, wire, n_dense, dense_wire, n_params, n_comp, pbytes, intra, \
        dense_shards = sums
    inter = (q - 1) * wire / q + dense_wire  # each node sends
    figures = reporting.figures(
        n_params, q, sent, wire, inter / k, dense_elements=n_dense * q,
        param_bytes=pbytes, ranks=q * k, n_compressed=n_comp)
    figures['vgc/inter_node_bytes'] = inter
    figures['vgc/intra_node_bytes'] = intra / k
    if choice is not None:
        figures['vgc/dense_steps'] = figures['_dense_steps'] = \
            dense_shards / k
    return reporting.record(figures, n_params, totals, model, label)
