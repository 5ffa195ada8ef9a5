"""p data-parallel workers in one process (for the paper harness on 2 cores).

The question this module answers: what would p ranks compute, without MPI?
In synchronous data parallelism every worker holds the same parameters, so
one model suffices for the forward and backward passes: each step, every
simulated worker runs them on its own minibatch, in rank order, and keeps
its gradients (and, where the rule needs them, its per-sample sums of
squares).  Then the p workers run **the exchange itself**
(:func:`chainer_vgc.exchange.run.exchange_async`, with one
:class:`~chainer_vgc.exchange.state.MethodState` per worker: its rule, its
residuals, its dense group, warm-up and totals), each on a thread of its
own, over :class:`InProcessCollectives`: the collectives the exchange
calls (the agreement's allgather, the messages' allgatherv, the dense
group's allreduce), in rank order among the threads instead of over MPI.
So the messages, the means and the figures are those of an ``mpiexec``
run by construction (``tests/test_examples.py`` checks the parameters bit
for bit against one).  The workers' means are equal; worker 0's become
the model's gradients, and one optimizer update is applied.  As with
ChainerMN's multi-node optimizer, the first step only "broadcasts" (no
update).  Nothing here imports ChainerMN or MPI.
"""

import threading
import time

import chainer
import numpy

from chainer_vgc.backends import arrays
from chainer_vgc.chainermn import transport
from chainer_vgc.engines import reference
from chainer_vgc.exchange import run as exchange_run
from chainer_vgc.exchange import settings
from chainer_vgc.exchange.state import MethodState
from chainer_vgc import reporting
from chainer_vgc.rules.base import float32_update
from chainer_vgc.statistics import PerSampleSquares
from chainer_vgc.params import with_gradients
from chainer_vgc.statistics import model_params


class _Rendezvous(object):
    """Where the p threads of one step meet: :meth:`gather` hands every
    thread every thread's object, in rank order, once all have arrived; a
    thread that fails calls :meth:`abort`, and the others' ``gather``
    raises instead of waiting forever (the exchange's threads report
    nothing: Chainer's reporters are per thread)."""

    def __init__(self, size):
        self.size = size
        self._slots = [None] * size
        self._barrier = threading.Barrier(size)

    def gather(self, rank, obj):
        self._slots[rank] = obj
        self._barrier.wait()
        out = list(self._slots)
        self._barrier.wait()  # every thread has read before the next write
        return out

    def abort(self):
        self._barrier.abort()


class InProcessCollectives(object):
    """The collectives the exchange calls
    (:class:`~chainer_vgc.chainermn.collectives.Collectives`'), for one of
    the p threads of :class:`SimulatedWorkers`: ``rank`` among ``size``,
    meeting at a :class:`_Rendezvous`.  No fault or dense-fallback link
    measurement needs MPI here (``mpi_comm`` is None: a dense fallback is
    refused by :class:`SimulatedWorkers`)."""

    #: the ranks sharing this process's cores (the native threads are not
    #: divided among the simulated workers)
    intra_size = 1
    mpi_comm = None

    def __init__(self, rendezvous, rank):
        self.rendezvous, self.rank = rendezvous, rank
        self.size = rendezvous.size

    def transport_settings(self):
        return ('in-process', arrays.cpu_backend())

    def allgather_obj(self, obj):
        """Every rank's ``obj``, in rank order."""
        return self.rendezvous.gather(self.rank, obj)

    def allgatherv_words(self, message, into=None):
        """Every rank's uint32 message in rank order, ``(blocks,
        counts)``, in one buffer (``into(words)``'s where given), as
        :func:`chainer_vgc.chainermn.transport.mpi_allgatherv` returns
        them."""
        everyone = self.allgather_obj(numpy.ascontiguousarray(message))
        counts = numpy.array([m.size for m in everyone], numpy.int64)
        words = int(counts.sum())
        buf = numpy.empty(words, numpy.uint32) if into is None else \
            into(words)
        pos = 0
        for m in everyone:
            buf[pos:pos + m.size] = m
            pos += m.size
        return transport.split_blocks(buf, counts), counts

    def allreduce_sum(self, buffer):
        """Sum ``buffer`` over the ranks in place, in MPI's
        recursive-doubling order (:func:`chainer_vgc.engines.reference.
        tree_sum`), as :meth:`Collectives.allreduce_sum
        <chainer_vgc.chainermn.collectives.Collectives.allreduce_sum>`."""
        everyone = self.allgather_obj(buffer.copy())
        buffer[...] = reference.tree_sum([[b] for b in everyone])[0]
        return buffer

    def dense_mean(self, params, zero_fill, dense_dtype=None):
        """The dense group's mean, as the allreduce of
        :meth:`Collectives.dense_mean
        <chainer_vgc.chainermn.collectives.Collectives.dense_mean>` makes
        it: every rank's gradient (in its state dtype) summed in MPI's
        recursive-doubling order (:func:`chainer_vgc.engines.reference.
        tree_sum`), then times 1/p in the parameter's dtype
        (:func:`~chainer_vgc.engines.reference.finish_mean`).  Returns
        (elements per rank, bytes each rank sends with a ring
        allreduce)."""
        if dense_dtype is not None:
            raise ValueError('SimulatedWorkers: dense_dtype is not '
                             'simulated; use dense_dtype=None')
        grads = with_gradients(params, zero_fill)
        mine = [q.grad.astype(arrays.state_dtype(q.dtype)) for q in grads]
        everyone = self.allgather_obj(mine)
        if not grads:
            return 0, 0.0
        for q, total in zip(grads, reference.tree_sum(everyone)):
            with arrays.device_scope(q.array):
                q.grad = reference.finish_mean(total.copy(), q.dtype,
                                               self.size, None)
        wire = reporting.allreduce_wire(grads, self.size)
        return sum(q.size for q in grads), (wire if self.size > 1 else 0.0)


class _WorkerModel(object):
    """One worker's view of the shared model for its exchange: a
    parameter of its own for each of the model's (its gradient this
    worker's), sharing the model's arrays."""

    def __init__(self, model):
        self.model = model
        self.params = {}

    def sync(self, grads=None):
        """The model's arrays (an optimizer may replace them), and
        ``grads`` ({name: array}) as the gradients."""
        for name, shared in self.model.namedparams():
            own = self.params.get(name)
            if own is None:
                own = self.params[name] = chainer.Parameter()
            if shared.array is not None and own.array is not shared.array:
                own.array = shared.array
            if grads is not None:
                own.grad = grads.get(name)

    def namedparams(self, include_uninit=True):
        for name, shared in self.model.namedparams(include_uninit):
            yield name, self.params[name]


class SimulatedWorkers(object):
    """``size`` workers sharing ``model`` and ``optimizer`` (a plain Chainer
    optimizer set up on ``model``).

    ``method``: a rule name or rule object; ``exclude``, ``min_size``,
    ``warmup`` and the rule's ``**hyperparams`` as in
    :func:`chainer_vgc.create_communicator` (each worker's exchange state is
    the communicator's, :class:`~chainer_vgc.exchange.state.MethodState`;
    the dense group is averaged as the communicator's allreduce:
    :meth:`InProcessCollectives.dense_mean`)."""

    def __init__(self, model, optimizer, size, method='vgc',
                 zero_fill=True, exclude=None, min_size=0, warmup=0,
                 **hyperparams):
        self.model, self.optimizer, self.size = model, optimizer, size
        self.rule = settings.make_rule(method, hyperparams)
        self.rule.check_optimizer(optimizer)  # as the multi-node optimizer
        float32_update(optimizer, self.rule)
        self.method, self.zero_fill = self.rule.name, zero_fill
        self._settings = dict(hyperparams, method=method, exclude=exclude,
                              min_size=min_size, warmup=warmup)
        self.exclude = settings.check_exclude(exclude)
        self.min_size = settings.check_count('min_size', min_size)
        self.warmup = settings.check_count('warmup', warmup)
        self.names, self.params = model_params(model)
        #: each worker's exchange state (rule, residuals, totals)
        self.states = [self._new_state(rank) for rank in range(size)]
        self._views = [_WorkerModel(model) for _ in range(size)]
        self.stats = PerSampleSquares(model)
        self.steps = 0
        self.last = {}
        #: wall seconds summed over updates after the first: ``'compute'``
        #: (every worker's forward and backward, with the per-sample
        #: statistics where the rule needs them), ``'exchange'`` (the
        #: workers' exchange, the optimizer update) and
        #: ``'statistics_steps'`` (worker steps whose backward computed the
        #: statistics), ``'worker_steps'``
        self.seconds = dict(compute=0.0, exchange=0.0, worker_steps=0,
                            statistics_steps=0)

    def _new_state(self, rank):
        return MethodState(rank=rank, **self._settings)

    @property
    def totals(self):
        """The run totals (every worker's are the same)."""
        return self.states[0].totals

    @property
    def count_by_parameter(self):
        """Whether the elements each parameter sends are counted
        (:attr:`elements_by_parameter`); off by default: it reads every
        message's groups on the host."""
        return self.states[0].count_by_parameter

    @count_by_parameter.setter
    def count_by_parameter(self, value):
        self.states[0].count_by_parameter = bool(value)

    @property
    def elements_by_parameter(self):
        """Elements each parameter sent (all workers summed, the dense
        group included), in :attr:`names` order."""
        counts = self.states[0].elements_by_parameter
        return [counts.get(n, 0) for n in self.names]

    def state_dict(self):
        """What a resumed run needs, as host arrays and plain values (for
        pickle): the step count, the totals, the per-parameter counts,
        every worker's residuals by parameter name and its rule's own
        state (DGC's and PowerSGD's step counts).  Rules with a
        random stream of their own (QSGD) are refused: their stream is
        not part of it."""
        if self.rule.name == 'qsgd':
            raise NotImplementedError(
                "SimulatedWorkers.state_dict: QSGD's random streams are not "
                'saved; resume is for the deterministic rules')
        host = chainer.backend.CpuDevice()
        return {'steps': self.steps, 'totals': dict(self.totals),
                'elements_by_parameter': dict(
                    self.states[0].elements_by_parameter),
                'seconds': dict(self.seconds),
                'residuals': [
                    {name: {k: host.send(v) for k, v in st.items()}
                     for name, st in state.residuals().items()}
                    for state in self.states],
                'rules': [state.rule.get_extra_state()
                          for state in self.states]}

    def load_state_dict(self, state):
        """Install a :meth:`state_dict`: fresh workers with its totals,
        installing its residuals at their next exchange."""
        if 'residuals' not in state:
            raise ValueError('SimulatedWorkers.load_state_dict: this state '
                             'was saved by an older chainer_vgc (residuals '
                             'per group); start the run afresh')
        self.steps = state['steps']
        self.seconds = dict(state['seconds'])
        counting = self.count_by_parameter
        self.states = [self._new_state(rank) for rank in range(self.size)]
        self.count_by_parameter = counting
        for st, saved in zip(self.states, state['residuals']):
            st.totals = dict(state['totals'])
            st.loaded = saved
        for st, extra in zip(self.states, state.get('rules', ())):
            st.rule.set_extra_state(extra)
        self.states[0].elements_by_parameter = dict(
            state['elements_by_parameter'])

    @property
    def compressor(self):
        """Worker 0's compressor of the compressed group (set up now, if
        no exchange has run yet)."""
        if self.states[0].compressor is None:
            self._each_worker(lambda st, view, coll: st.setup(view, coll))
        return self.states[0].compressor

    def _each_worker(self, step, grads=None):
        """``step(state, view, collectives)`` for every worker, each on a
        thread, meeting in the exchange's collectives; the results in rank
        order.  A worker's error is raised here (the others' waits are
        released)."""
        meet = _Rendezvous(self.size)
        results = [None] * self.size
        errors = []

        def work(rank):
            try:
                view = self._views[rank]
                view.sync(None if grads is None else grads[rank])
                results[rank] = step(self.states[rank], view,
                                     InProcessCollectives(meet, rank))
            except threading.BrokenBarrierError:
                pass  # another worker failed first
            except BaseException as e:
                errors.append(e)
                meet.abort()
        threads = [threading.Thread(target=work, args=(rank,),
                                    name='chainer_vgc worker {}'.format(rank))
                   for rank in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results

    def update(self, lossfun, batches):
        """One synchronous step; ``batches[w]`` is worker w's tuple of
        arrays, ``lossfun(*batch)`` its mean loss."""
        if len(batches) != self.size:
            raise ValueError('expected {} batches, got {}'.format(
                self.size, len(batches)))
        self.steps += 1
        if self.steps == 1:
            return  # ChainerMN's first update broadcasts rank 0's params
        state = self.states[0]
        dense = settings.dense_group(self.model, self.rule, self.exclude,
                                     self.min_size)
        warm = state.totals['steps'] < self.warmup
        self.stats.skip = set(self.names) if warm else dense
        statistics = self.rule.needs_sqsum and not warm and any(
            n not in dense for n in self.names)
        clock = self.seconds
        grads, sqsums = [], []
        for batch in batches:
            t0 = time.perf_counter()
            self.model.cleargrads()
            loss = lossfun(*batch)
            if statistics:
                sqsums.append(self.stats.backward(loss, batch=batch))
                clock['statistics_steps'] += 1
            else:
                loss.backward()
                sqsums.append(None)
            clock['compute'] += time.perf_counter() - t0
            clock['worker_steps'] += 1
            grads.append({n: p.grad for n, p in zip(self.names,
                                                    self.params)})
        t1 = time.perf_counter()

        def exchange(st, view, collectives):
            rank = collectives.rank
            return exchange_run.exchange_async(
                collectives, st, view, self.zero_fill, sqsums[rank]).wait()
        results = self._each_worker(exchange, grads)
        mine = self._views[0].params
        for name, p in zip(self.names, self.params):
            p.grad = mine[name].grad
        self.optimizer.update()
        clock['exchange'] += time.perf_counter() - t1
        self.last = results[0].figures
        reporting.report(self.last)
