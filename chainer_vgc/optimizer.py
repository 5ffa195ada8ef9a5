"""Multi-node optimizer: the backward pass, its per-sample statistics and
the compressed exchange of one step, in that order.

Same signature and semantics as ``chainermn.create_multi_node_optimizer``
(the first update broadcasts the parameters of rank 0; later updates average
gradients through the communicator), so ``StandardUpdater`` + ``Trainer`` code
works unchanged.  The compressor's residual state is part of the optimizer's
serialized state (trainer snapshots).
"""

import copy
import json

import chainer
import numpy

from chainer_vgc import backend
from chainer_vgc import extensions
from chainer_vgc.communicator import VGCCommunicator


class VGCMultiNodeOptimizer(object):
    """Wraps ``actual_optimizer``; one :meth:`update` is one step:

    1. ``lossfun(*args)``, then the backward pass: with the per-sample
       statistics when the communicator needs them
       (:attr:`VGCCommunicator.needs_sqsum`), else ``loss.backward``;
    2. the first update broadcasts rank 0's parameters (ChainerMN), unless
       every rank resumed from a snapshot;
    3. otherwise :meth:`VGCCommunicator.exchange` with this step's sums of
       squares and loss scale, then the actual optimizer's update (none
       when the exchange was skipped and no dynamic loss scaler will skip
       the NaN update).

    Mirrors ``chainermn.optimizers._MultiNodeOptimizer`` (ChainerMN 7.8.1):
    attributes not defined here are read from and written to the actual
    optimizer, ``is_changed`` decides the broadcast, and ``cleargrads`` /
    ``zerograds`` follow ``_use_cleargrads``.
    """

    #: attributes of the wrapper itself (everything else is forwarded)
    _OWN = ('communicator', 'actual_optimizer', 'zero_fill', 'target_params',
            '_first_update_done', '_resumed', '_stats')

    def __init__(self, actual_optimizer, communicator, zero_fill=True):
        if not isinstance(communicator, VGCCommunicator):
            raise TypeError(
                'communicator must be a chainer_vgc communicator '
                '(chainer_vgc.create_communicator), got {!r}; for a ChainerMN '
                'communicator use chainermn.create_multi_node_optimizer'
                .format(type(communicator).__name__))
        self.communicator = communicator
        self.actual_optimizer = actual_optimizer
        self.zero_fill = zero_fill
        self.target_params = []
        self._first_update_done = False
        self._resumed = False
        #: the per-sample statistics hook of the target (ours)
        self._stats = None

    def __getattr__(self, name):
        return getattr(self.actual_optimizer, name)

    def __setattr__(self, name, value):
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.actual_optimizer, name, value)

    def setup(self, link):
        self.actual_optimizer.setup(link)
        return self

    @property
    def method_state(self):
        """The target's :class:`~chainer_vgc.method_state.MethodState`
        (the communicator keeps one per model)."""
        return self.communicator.state(self.target)

    def _uncovered(self):
        """What the last backward's statistics left uncovered."""
        return tuple(getattr(self._stats, 'uncovered_names', ()) or ())

    def update(self, lossfun=None, *args, **kwds):
        target = self.target
        comm = self.communicator
        sqsums = None
        if lossfun is not None:
            sqsums = self._loss_backward(lossfun, args, kwds)
        if self._broadcast_now(target):
            comm.bcast_data(target)
            return
        opt = self.actual_optimizer
        result = comm.exchange(target, self.zero_fill, sqsums=sqsums,
                               loss_scale=opt._loss_scale,
                               uncovered=self._uncovered())
        if result.skipped and not opt._loss_scaling_is_dynamic:
            # a rank's gradients were not finite and no loss scaler will
            # skip the NaN update: keep the parameters (vgc/skipped)
            return
        opt.update(None, *args, **kwds)

    def _loss_backward(self, lossfun, args, kwds):
        """The loss of this step's minibatch, cleared gradients, then
        :meth:`_backward`; returns its sums of squares (or None)."""
        target = self.target
        loss = lossfun(*args, **kwds)
        if getattr(self, '_use_cleargrads', True):
            target.cleargrads()
        else:
            target.zerograds()
        return self._backward(loss, lossfun, args, kwds)

    def _needs_sqsum(self):
        """Whether this step's backward computes the statistics."""
        return self.method_state.needs_sqsum

    def _backward(self, loss, lossfun, args, kwds):
        """``loss.backward``, with the per-sample statistics when the
        communicator needs them (returned; None otherwise)."""
        scale = self.actual_optimizer._loss_scale
        if not self._needs_sqsum():
            loss.backward(loss_scale=scale)
            return None
        batch, loss_fn = _batch_of(lossfun, args, kwds)
        self._stats = self.method_state.statistics(self.target, self._stats)
        return self._stats.backward(loss, loss_fn=loss_fn, batch=batch,
                                    loss_scale=scale)

    def _broadcast_now(self, target):
        """ChainerMN's rule (broadcast while the parameter set changes),
        except at the first update when every rank resumed from its own
        snapshot: a collective decision, so that ranks that did and did
        not load agree (those that did not get rank 0's step counts)."""
        if not self._first_update_done:
            self._first_update_done = True
            resumed = int(self._resumed)
            if self.communicator.mpi_comm.allreduce(resumed, op=_mpi_min()):
                self.is_changed(target)  # record: no broadcast now
            else:
                self.communicator.sync_run(target)
        return self.is_changed(target)

    def is_changed(self, target):
        """Whether the parameter set changed since the last call (as
        ChainerMN's: names and which ones are initialized)."""
        previous = self.target_params
        self.target_params = [(name, param.data is not None)
                              for name, param in sorted(target.namedparams())]
        return previous != self.target_params

    def serialize(self, serializer):
        self.actual_optimizer.serialize(serializer)
        self.communicator.serialize_state(self.target,
                                          serializer['vgc_state'])
        if isinstance(serializer, chainer.serializer.Deserializer):
            # resumed: if every rank loaded its snapshot, the next update
            # is an update, not the initial broadcast (decided collectively
            # at the first update; the model may be loaded after us)
            self._resumed = True
            self._first_update_done = False


class VGCDoubleBufferingOptimizer(VGCMultiNodeOptimizer):
    """``double_buffering=True``: step t applies the mean gradient of step
    t-1 while step t's exchange (compress, ring allgatherv, decode, dense
    allreduce) runs on a background thread, as ChainerMN's
    ``_DoubleBufferingOptimizer`` does with its allreduce.

    One :meth:`update` (step t):

    1. forward and backward of step t into ``param.grad`` (with the
       per-sample statistics unless the exchange is surely a warm-up one;
       the exchange of step t-1 may still be running meanwhile);
    2. the first update (and any update after the parameter set changed)
       broadcasts rank 0's parameters, as without double buffering, and
       drops what was in flight;
    3. wait for step t-1's exchange (its error, if any, is raised here: on
       this rank's main thread, which aborts the job as any error does);
       its mean becomes ``param.grad`` and step t's gradients go to a
       shadow copy of the model (swapped, not copied);
    4. start step t's exchange on the shadow, on the background thread;
    5. the actual optimizer's update with step t-1's mean: none at the
       first exchange (step 2 of a run), so parameters lag one step.
       The mean was made at step t-1's loss scale, so Chainer divides it
       by that scale (the parameters' ``_loss_scale``), not by the current
       one.  A skipped exchange (a rank's
       gradients were not finite) is applied as NaN, so that dynamic loss
       scaling skips it and lowers the scale on every rank at the same
       step; without a dynamic scaler the update is skipped.

    Only the background thread touches the residual state, between steps
    3 and 3 of the next update; a snapshot (:meth:`serialize`) first waits
    for the exchange in flight, then holds the parameters, the residuals
    after it and its mean, which the next update applies: a resumed run
    continues bit for bit as the uninterrupted one, with the same setting.
    The background exchange runs its collectives on a duplicate of the MPI
    communicator (MPI must allow threads: ``MPI_THREAD_MULTIPLE``), on its
    own copy of the run totals; the reported figures are those of the
    exchange whose mean the update applies.  :meth:`wait` completes the
    exchange in flight (its mean is then applied by the next update); at
    exit it is completed so that no rank is left in a collective.
    """

    _OWN = VGCMultiNodeOptimizer._OWN + (
        '_shadow', '_handle', '_flight_scale', '_ready', '_loaded')

    def __init__(self, actual_optimizer, communicator, zero_fill=True):
        super(VGCDoubleBufferingOptimizer, self).__init__(
            actual_optimizer, communicator, zero_fill)
        check_thread_level()
        self._shadow = None
        self._handle = None   # the exchange running (ExchangeHandle)
        self._flight_scale = None   # its loss scale
        self._ready = None    # {'scale', 'skipped', 'last'}: mean to apply
        self._loaded = None   # a snapshot's mean, installed at next update

    def update(self, lossfun=None, *args, **kwds):
        target = self.target
        opt = self.actual_optimizer
        scale = opt._loss_scale
        sqsums = None
        if lossfun is not None:
            sqsums = self._loss_backward(lossfun, args, kwds)
        # what the statistics left uncovered, read here: the next
        # backward rewrites it while the exchange runs
        uncovered = self._uncovered()
        if self._broadcast_now(target):
            self._complete()  # (a collective: every rank has it in flight)
            self._ready, self._loaded, self._shadow = None, None, None
            self.communicator.bcast_data(target)
            return
        self._complete()
        ready, self._ready = self._ready, None
        ready = self._swap(target) or ready
        self._start(sqsums, scale, uncovered)
        if ready is None:
            return  # the first exchange: nothing to apply yet
        if ready['last']:
            chainer.reporter.report(ready['last'])
        if ready['skipped'] and not opt._loss_scaling_is_dynamic:
            return  # (vgc/skipped reported)
        # Chainer divides each gradient by its parameter's _loss_scale (set
        # by the last backward): here, the scale the mean was made at
        for _, p in target.namedparams():
            p._loss_scale = ready['scale']
        opt.update(None, *args, **kwds)

    def _needs_sqsum(self):
        """The statistics are computed unless the coming exchange is surely
        a warm-up one (the exchange in flight may not have counted yet)."""
        st = self.method_state
        return st.needs_sqsum_after(st.totals['steps'] +
                                    (self._handle is not None))

    def _swap(self, target):
        """Step t's gradients to the shadow model, its completed mean (or
        a loaded one) to ``target``."""
        if self._shadow is None:
            self._shadow = copy.deepcopy(target)
            self._shadow.cleargrads()
        mine = dict(target.namedparams())
        theirs = dict(self._shadow.namedparams())
        if self._loaded is not None:
            loaded, self._loaded = self._loaded, None
            for name, arr in loaded['means'].items():
                p = mine[name]
                with backend.device_scope(p.array):
                    theirs[name].grad = p.xp.asarray(arr).astype(p.dtype)
            ready = {'scale': loaded['scale'], 'skipped': loaded['skipped'],
                     'last': loaded['last']}
        else:
            ready = None
        for name, p in mine.items():
            q = theirs[name]
            p.grad, q.grad = q.grad, p.grad
        return ready

    def _start(self, sqsums, scale, uncovered):
        """Step t's exchange, on the shadow model, in the background."""
        self._handle = self.communicator.exchange_async(
            self._shadow, self.zero_fill, sqsums=sqsums, loss_scale=scale,
            uncovered=uncovered, state=self.method_state, background=True)
        self._flight_scale = scale

    def _complete(self):
        """Wait for the exchange in flight: raise its error, or commit its
        totals and keep its mean for the next update."""
        handle, self._handle = self._handle, None
        if handle is None:
            return
        result = handle.wait()
        self._ready = {'scale': self._flight_scale,
                       'skipped': result.skipped,
                       'last': extensions.reported(result.figures)}

    def _drop(self):
        """Wait for the exchange in flight and forget it (its totals are
        not committed): a snapshot is being loaded over this run."""
        handle, self._handle = self._handle, None
        if handle is not None:
            handle.discard()
        self._ready, self._shadow = None, None

    def wait(self):
        """Complete the exchange in flight (ChainerMN's ``wait``); its mean
        is applied by the next update."""
        self._complete()

    def serialize(self, serializer):
        key = 'vgc_double_buffering/'
        if not isinstance(serializer, chainer.serializer.Deserializer):
            self._complete()
            ready = self._ready
            means = {}
            if ready is not None and self._shadow is not None:
                means = {n: p.grad for n, p in self._shadow.namedparams()
                         if p.grad is not None}
            serializer(key + 'pending', int(ready is not None))
            serializer(key + 'scale', float((ready or {}).get('scale') or 0))
            serializer(key + 'skipped', int(bool((ready or {}).get(
                'skipped'))))
            serializer(key + 'names', json.dumps(sorted(means)))
            serializer(key + 'last', json.dumps((ready or {}).get('last')
                                                or {}))
            for name in sorted(means):
                serializer(key + 'mean' + name, means[name])
        else:
            try:
                pending = int(serializer(key + 'pending', 0))
            except KeyError:  # saved without double buffering
                pending = 0
            self._drop()
            self._loaded = None
            if pending:
                names = json.loads(str(serializer(key + 'names', '')))
                scale = float(serializer(key + 'scale', 0.0))
                self._loaded = {
                    'scale': scale or None,
                    'skipped': bool(int(serializer(key + 'skipped', 0))),
                    'last': json.loads(str(serializer(key + 'last', '{}'))),
                    'means': {n: numpy.asarray(backend.to_numpy(
                        serializer(key + 'mean' + n, None))) for n in names}}
        super(VGCDoubleBufferingOptimizer, self).serialize(serializer)


def check_thread_level():
    """Double buffering calls MPI from two threads at once."""
    from mpi4py import MPI
    provided = MPI.Query_thread()
    if provided < MPI.THREAD_MULTIPLE:
        names = {MPI.THREAD_SINGLE: 'MPI_THREAD_SINGLE',
                 MPI.THREAD_FUNNELED: 'MPI_THREAD_FUNNELED',
                 MPI.THREAD_SERIALIZED: 'MPI_THREAD_SERIALIZED'}
        raise ValueError(
            'double_buffering=True runs the exchange on a background thread '
            'and needs MPI initialized with MPI_THREAD_MULTIPLE, but this '
            'MPI provides {}. Leave mpi4py.rc.thread_level at its default '
            "('multiple') before importing mpi4py.MPI, and use an MPI "
            'built with thread support; or use double_buffering=False'
            .format(names.get(provided, provided)))


def _mpi_min():
    from mpi4py import MPI
    return MPI.MIN


def _batch_of(lossfun, args, kwds):
    """The minibatch arrays of an update call and a loss function of them
    (positional arrays, or keyword arrays as StandardUpdater passes a dict
    batch)."""
    batch = tuple(a for a in args if hasattr(a, 'shape'))
    if batch or not kwds:
        return batch, lambda *a: lossfun(*a, **kwds)
    keys = [k for k, v in kwds.items() if hasattr(v, 'shape')]
    rest = {k: v for k, v in kwds.items() if k not in keys}

    def loss_fn(*arrays):
        return lossfun(*args, **dict(rest, **dict(zip(keys, arrays))))
    return tuple(kwds[k] for k in keys), loss_fn


def create_multi_node_optimizer(actual_optimizer, communicator,
                                double_buffering=False, zero_fill=True):
    """Drop-in for ``chainermn.create_multi_node_optimizer``.

    ``double_buffering=True``: each step applies the previous step's mean
    gradient while its own exchange runs in the background
    (:class:`VGCDoubleBufferingOptimizer`: one step of staleness, the
    exchange hidden behind the next forward and backward).
    """
    if double_buffering:
        return VGCDoubleBufferingOptimizer(actual_optimizer, communicator,
                                           zero_fill)
    return VGCMultiNodeOptimizer(actual_optimizer, communicator, zero_fill)
