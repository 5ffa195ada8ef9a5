"""Double buffering: step t applies step t-1's mean while step t's
exchange runs on a background thread.

The question this module answers: how is the exchange hidden behind the
next forward and backward pass, and what does that cost?  One step of
staleness (as ChainerMN's ``_DoubleBufferingOptimizer``), a shadow copy
of the model's gradients, and a duplicate MPI communicator per optimizer
(freed by ``close()``, a ``with`` block, or garbage collection).
"""

import copy
import json

import chainer
import numpy

from chainer_vgc.backends import arrays
from chainer_vgc import reporting
from chainer_vgc.chainermn.multi_node_optimizer import VGCMultiNodeOptimizer


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
        '_shadow', '_handle', '_flight_scale', '_ready', '_loaded',
        '_collectives')

    def __init__(self, actual_optimizer, communicator, zero_fill=True):
        super(VGCDoubleBufferingOptimizer, self).__init__(
            actual_optimizer, communicator, zero_fill)
        check_thread_level()
        self._shadow = None
        self._handle = None   # the exchange running (ExchangeHandle)
        self._flight_scale = None   # its loss scale
        self._ready = None    # {'scale', 'skipped', 'last'}: mean to apply
        self._loaded = None   # a snapshot's mean, installed at next update
        self._collectives = None  # its duplicate MPI communicator

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
            reporting.report(ready['last'], target,
                             self.method_state.label)
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
                with arrays.device_scope(p.array):
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
        """Step t's exchange, on the shadow model, in the background, on
        this optimizer's duplicate of the MPI communicator (made at the
        first exchange: every rank is there)."""
        if self._collectives is None:
            self._collectives = self.communicator.duplicate()
        self._handle = self.communicator.exchange_async(
            self._shadow, self.zero_fill, sqsums=sqsums, loss_scale=scale,
            uncovered=uncovered, state=self.method_state, background=True,
            collectives=self._collectives)
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
                       'last': reporting.reported(result.figures)}

    def _pending(self):
        """The mean the next update applies, as saved in a snapshot:
        ({'scale', 'skipped', 'last'} or None, {name: mean}): the completed
        exchange's, or a loaded snapshot's not yet installed (a snapshot
        saved right after loading one keeps it)."""
        if self._loaded is not None:
            loaded = self._loaded
            return ({k: loaded[k] for k in ('scale', 'skipped', 'last')},
                    loaded['means'])
        if self._ready is None or self._shadow is None:
            return None, {}
        return self._ready, {n: p.grad for n, p in self._shadow.namedparams()
                             if p.grad is not None}

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

    def close(self):
        """The end of this optimizer's training (collective: every rank
        calls it at the same update): complete the exchange in flight and
        free the duplicate MPI communicator.  The pending mean stays for
        the next update or snapshot; an update after ``close()`` makes a
        new duplicate.  An optimizer garbage-collected with nothing in
        flight frees its duplicate too."""
        try:
            self._complete()
        finally:
            if self._collectives is not None:
                self._collectives.free()
                self._collectives = None

    def serialize(self, serializer):
        key = 'vgc_double_buffering/'
        if not isinstance(serializer, chainer.serializer.Deserializer):
            self._complete()
            ready, means = self._pending()
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
                    'means': {n: numpy.asarray(arrays.to_numpy(
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
