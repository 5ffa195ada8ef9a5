"""p data-parallel workers in one process (for the paper harness on 2 cores).

The question this module answers: what would p ranks compute, without MPI?
In synchronous data parallelism every worker holds the same parameters, so
one model suffices: each step, every simulated worker runs forward/backward
on its own minibatch with its own compressor (its own residual state), and
the workers' messages are combined exactly as
:class:`~chainer_vgc.chainermn.communicator.VGCCommunicator` combines the messages it
gathers (the same functions of :mod:`chainer_vgc.exchange.mean`, same rank
order; settings and groups from :mod:`chainer_vgc.exchange.settings`, figures from
:mod:`chainer_vgc.reporting`), then one optimizer update is applied.  As
with ChainerMN's multi-node optimizer, the first step only "broadcasts" (no
update).  ``tests/test_examples.py`` checks that this gives the same
parameters, bit for bit, as a real ``mpiexec`` run.  Nothing here imports
ChainerMN or MPI.
"""

import time

import chainer

from chainer_vgc.exchange import mean as exchange_mean
from chainer_vgc import reporting
from chainer_vgc.exchange import settings
from chainer_vgc.compressor import GradientCompressor
from chainer_vgc.rules import NoCompression
from chainer_vgc.rules.base import float32_update
from chainer_vgc.statistics import PerSampleSquares
from chainer_vgc.statistics import model_params


class SimulatedWorkers(object):
    """``size`` workers sharing ``model`` and ``optimizer`` (a plain Chainer
    optimizer set up on ``model``).

    ``method``: a rule name or rule object; ``exclude``, ``min_size`` and
    ``warmup`` as in :func:`chainer_vgc.create_communicator` (the dense
    group is averaged as the communicator's allreduce: summed in MPI's
    recursive-doubling order, then times 1/size)."""

    def __init__(self, model, optimizer, size, method='vgc',
                 zero_fill=True, exclude=None, min_size=0, warmup=0,
                 **hyperparams):
        self.model, self.optimizer, self.size = model, optimizer, size
        self.rule = settings.make_rule(method, hyperparams)
        float32_update(optimizer, self.rule)  # as the multi-node optimizer
        self.method, self.zero_fill = self.rule.name, zero_fill
        self.exclude = settings.check_exclude(exclude)
        self.min_size = settings.check_count('min_size', min_size)
        self.warmup = settings.check_count('warmup', warmup)
        self.names, self.params = model_params(model)
        self._rules = [self.rule.for_rank(rank) for rank in range(size)]
        self._groups = {}
        self.stats = PerSampleSquares(model)
        self.steps = 0
        self.last = {}
        self.totals = reporting.new_totals()
        #: wall seconds summed over updates after the first: ``'compute'``
        #: (every worker's forward and backward, with the per-sample
        #: statistics where the rule needs them), ``'exchange'`` (compress,
        #: combine, optimizer update) and ``'statistics_steps'`` (worker
        #: steps whose backward computed the statistics), ``'worker_steps'``
        self.seconds = dict(compute=0.0, exchange=0.0, worker_steps=0,
                            statistics_steps=0)
        #: count the elements each parameter sends
        #: (:attr:`elements_by_parameter`, all workers summed, dense group
        #: included); off by default: it decodes every message on the host
        self.count_by_parameter = False
        self.elements_by_parameter = [0] * len(self.names)

    def state_dict(self):
        """What a resumed run needs, as host arrays and plain values (for
        pickle): the step count, the totals, the per-parameter counts
        and every worker's residual state, per group.  Rules with a
        random stream of their own (QSGD) are refused: their stream is
        not part of it."""
        if self.rule.name == 'qsgd':
            raise NotImplementedError(
                "SimulatedWorkers.state_dict: QSGD's random streams are not "
                'saved; resume is for the deterministic rules')
        host = chainer.backend.CpuDevice()
        groups = {}
        for key, (_, comps) in self._groups.items():
            groups[key] = [[None if st is None else
                            {k: host.send(v) for k, v in st.items()}
                            for st in comp.states] for comp in comps]
        return {'steps': self.steps, 'totals': dict(self.totals),
                'elements_by_parameter': list(self.elements_by_parameter),
                'seconds': dict(self.seconds), 'groups': groups}

    def load_state_dict(self, state):
        """Install a :meth:`state_dict` (on the parameters' device)."""
        self.steps = state['steps']
        self.totals = dict(state['totals'])
        self.elements_by_parameter = list(state['elements_by_parameter'])
        self.seconds = dict(state['seconds'])
        device = chainer.backend.get_device_from_array(self.params[0].array)
        for (names, dense), states in state['groups'].items():
            _, comps = self._group(list(names), dense)
            for comp, saved in zip(comps, states):
                comp.states = [None if st is None else
                               {k: device.send(v) for k, v in st.items()}
                               for st in saved]

    def _group(self, names, dense):
        """Per-worker compressors over ``names`` (kept per name set): the
        rule's, or NoCompression for the dense group."""
        key = (tuple(names), dense)
        if key not in self._groups:
            idx = [self.names.index(n) for n in names]
            comps = []
            for rank in range(self.size):
                rule = NoCompression() if dense else self._rules[rank]
                comp = GradientCompressor(
                    rule, list(names), [self.params[i].shape for i in idx],
                    [self.params[i].dtype for i in idx])
                for k, i in enumerate(idx):
                    p = self.params[i]
                    comp.states[k] = rule.init_state(p.size, p.dtype, p.xp)
                comps.append(comp)
            self._groups[key] = (idx, comps)
        return self._groups[key]

    @property
    def compressor(self):
        """Worker 0's compressor of the compressed group (all parameters
        before the first update)."""
        dense = settings.dense_group(self.model, self.rule, self.exclude,
                                     self.min_size)
        return self._group([n for n in self.names if n not in dense],
                           False)[1][0]

    def update(self, lossfun, batches):
        """One synchronous step; ``batches[w]`` is worker w's tuple of
        arrays, ``lossfun(*batch)`` its mean loss."""
        if len(batches) != self.size:
            raise ValueError('expected {} batches, got {}'.format(
                self.size, len(batches)))
        self.steps += 1
        if self.steps == 1:
            return  # ChainerMN's first update broadcasts rank 0's params
        warm = self.totals['steps'] < self.warmup
        dense = settings.dense_group(self.model, self.rule, self.exclude,
                                     self.min_size)
        if warm:
            dense = set(self.names)
        c_idx, c_comps = self._group(
            [n for n in self.names if n not in dense], False)
        d_idx, d_comps = self._group(
            [n for n in self.names if n in dense], True)
        self.stats.skip = dense
        c_msgs, d_msgs = [], []
        clock = self.seconds
        for rank, batch in enumerate(batches):
            t0 = time.perf_counter()
            self.model.cleargrads()
            loss = lossfun(*batch)
            sqsums = None
            if self.rule.needs_sqsum and c_idx:
                sqsums = self.stats.backward(loss, batch=batch)
                clock['statistics_steps'] += 1
            else:
                loss.backward()
            t1 = time.perf_counter()
            clock['compute'] += t1 - t0
            clock['worker_steps'] += 1
            grads, sqsums = exchange_mean.local_gradients(
                self.params, sqsums, self.zero_fill)
            if c_idx:
                c_msgs.append(c_comps[rank].compress(
                    [grads[i] for i in c_idx],
                    None if sqsums is None else [sqsums[i] for i in c_idx]))
            if d_idx:
                d_msgs.append(d_comps[rank].compress(
                    [grads[i] for i in d_idx]))
            clock['exchange'] += time.perf_counter() - t1
        if self.count_by_parameter:
            self._count(c_idx, c_msgs, d_idx)
        t1 = time.perf_counter()
        elements = None
        if c_idx:
            elements = exchange_mean.mean_gradients(
                c_msgs, c_comps[0], [self.params[i] for i in c_idx],
                [grads[i] for i in c_idx], self.size, self.zero_fill, False)
        n_dense, wire = 0, 0.0
        if d_idx:
            dparams = [self.params[i] for i in d_idx]
            exchange_mean.mean_gradients(d_msgs, d_comps[0], dparams,
                                         [grads[i] for i in d_idx],
                                         self.size, self.zero_fill, True)
            n_dense = sum(p.size for p in dparams)
            wire = reporting.allreduce_wire(dparams, self.size)
        self.optimizer.update()
        clock['exchange'] += time.perf_counter() - t1
        self.last = reporting.report_step(
            c_msgs, sum(q.size for q in self.params), self.totals, elements,
            sum(q.size * q.dtype.itemsize for q in self.params),
            size=self.size, dense_elements=n_dense * self.size,
            dense_wire=wire,
            n_compressed=sum(self.params[i].size for i in c_idx))

    def _count(self, c_idx, c_msgs, d_idx):
        """Add this step's elements per parameter: the compressed group's
        from the workers' messages, the dense group's whole."""
        if c_idx:
            sizes = [self.params[i].size for i in c_idx]
            dtypes = [self.params[i].dtype for i in c_idx]
            for msg in c_msgs:
                for t, n in reporting.elements_by_tensor(
                        msg, sizes, dtypes).items():
                    self.elements_by_parameter[c_idx[t]] += n
        for i in d_idx:
            self.elements_by_parameter[i] += self.params[i].size * self.size
