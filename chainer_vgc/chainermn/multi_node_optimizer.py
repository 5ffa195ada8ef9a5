"""The multi-node optimizer: the backward pass, its per-sample statistics
and the compressed exchange of one step, in that order.

The question this module answers: what does one ``optimizer.update`` of a
data-parallel run do with compression?  Same semantics as ChainerMN's
``_MultiNodeOptimizer`` (the first update broadcasts the parameters of
rank 0; later updates average gradients through the communicator), so
``StandardUpdater`` + ``Trainer`` code works unchanged.  The compressor's
residual state is part of the optimizer's serialized state (trainer
snapshots).  Double buffering is :mod:`chainer_vgc.chainermn.double_buffering`.
"""

import chainer
import numpy

from chainer_vgc.backends import arrays
from chainer_vgc.chainermn.communicator import VGCCommunicator
from chainer_vgc.params import model_params
from chainer_vgc.rules.base import float32_update


class VGCMultiNodeOptimizer(object):
    """Wraps ``actual_optimizer``; one :meth:`update` is one step:

    1. ``lossfun(*args)``, then the backward pass: with the per-sample
       statistics when the communicator needs them
       (the model's :attr:`MethodState.needs_sqsum
       <chainer_vgc.exchange.state.MethodState.needs_sqsum>`), else
       ``loss.backward``;
    2. the first update broadcasts rank 0's parameters (ChainerMN), unless
       every rank resumed from a snapshot;
    3. otherwise :meth:`VGCCommunicator.exchange` with this step's sums of
       squares and loss scale, then the actual optimizer's update (none
       when the exchange was skipped and no dynamic loss scaler will skip
       the NaN update).

    With a compressing method, float16 parameters are updated in float32
    (:func:`chainer_vgc.rules.base.float32_update`).

    Mirrors ``chainermn.optimizers._MultiNodeOptimizer`` (ChainerMN 7.8.1):
    attributes not defined here are read from and written to the actual
    optimizer, ``is_changed`` decides the broadcast, and ``cleargrads`` /
    ``zerograds`` follow ``_use_cleargrads``.
    """

    #: attributes of the wrapper itself (everything else is forwarded)
    _OWN = ('communicator', 'actual_optimizer', 'zero_fill', 'target_params',
            '_first_update_done', '_resumed')

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
        rule = communicator.state().base_rule
        rule.check_optimizer(actual_optimizer)
        float32_update(actual_optimizer, rule)

    def __getattr__(self, name):
        return getattr(self.actual_optimizer, name)

    def __setattr__(self, name, value):
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.actual_optimizer, name, value)

    def setup(self, link):
        """The actual optimizer's ``setup``; the communicator then knows
        the model (with several models on one communicator, each reports
        under its own name from the first step)."""
        self.actual_optimizer.setup(link)
        self.communicator.state(link)
        return self

    @property
    def method_state(self):
        """The target's :class:`~chainer_vgc.exchange.state.MethodState`
        (the communicator keeps one per model)."""
        return self.communicator.state(self.target)

    def _uncovered(self):
        """What the last backward's statistics left uncovered."""
        return self.communicator.uncovered_names(self.target)

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
        ``loss.backward``, with the per-sample statistics when the
        communicator needs them (returned; None otherwise).  The forward
        pass runs inside the statistics hook's
        :meth:`~chainer_vgc.statistics.PerSampleSquares.forward`, which
        records where the minibatch's per-example arrays enter the graph."""
        target = self.target
        scale = self.actual_optimizer._loss_scale
        hook = None
        if self._needs_sqsum():
            # (the communicator holds the hook: one per model, in one place)
            hook = self.communicator.statistics(target)
        if hook is None:
            loss = lossfun(*args, **kwds)
            self._clear_grads(target)
            loss.backward(loss_scale=scale)
            return None
        with hook.forward(args, kwds) as batch:
            loss = lossfun(*args, **kwds)
        self._clear_grads(target)
        # (again: a lazily initialized link has its parameters only now,
        # and a new hook for them reads the same record)
        hook = self.communicator.statistics(target)
        _, loss_fn = _batch_of(lossfun, args, kwds)
        return hook.backward(loss, loss_fn=loss_fn, batch=batch,
                             loss_scale=scale)

    def _clear_grads(self, target):
        if getattr(self, '_use_cleargrads', True):
            target.cleargrads()
        else:
            target.zerograds()

    def _needs_sqsum(self):
        """Whether this step's backward computes the statistics."""
        return self.method_state.needs_sqsum

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
                              for name, param in zip(*model_params(target))]
        return previous != self.target_params

    def close(self):
        """Release what this optimizer holds beyond the actual optimizer
        (double buffering: its duplicate MPI communicator); none here.
        ``with create_multi_node_optimizer(...) as opt:`` closes it at the
        end of the block."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def serialize(self, serializer):
        self.actual_optimizer.serialize(serializer)
        serialize_fp32_masters(self.target, serializer['vgc_fp32'])
        self.communicator.serialize_state(self.target,
                                          serializer['vgc_state'])
        if isinstance(serializer, chainer.serializer.Deserializer):
            # resumed: if every rank loaded its snapshot, the next update
            # is an update, not the initial broadcast (decided collectively
            # at the first update; the model may be loaded after us)
            self._resumed = True
            self._first_update_done = False


def serialize_fp32_masters(target, serializer):
    """Save or load the float32 master copies of ``target``'s float16
    parameters updated in float32 (``use_fp32_update``, which the
    compressing methods turn on), which Chainer's own serialization
    leaves out: a resumed run continues from the same float32 weights,
    bit for bit, not from their float16 rounding.  Loading also casts an
    optimizer state saved in float16 (before float32 updates were turned
    on) to float32, as the update now keeps it."""
    loading = isinstance(serializer, chainer.serializer.Deserializer)
    for name, param in zip(*model_params(target)):
        rule = getattr(param, 'update_rule', None)
        if (rule is None or param.dtype != numpy.float16
                or not getattr(rule, '_use_fp32_update', False)):
            continue
        key = name.lstrip('/')
        if not loading:
            master = getattr(rule, '_fp32_param', None)
            if master is not None and master.array is not None:
                serializer(key, master.array)
            continue
        try:
            saved = serializer(key, None)
        except KeyError:  # none saved (before the first update, or older)
            saved = None
        if saved is not None:
            with arrays.device_scope(param.array):
                rule._fp32_param = chainer.Parameter(
                    param.xp.asarray(saved, dtype=numpy.float32),
                    name=param.name)
        for k, value in list((rule.state or {}).items()):
            if getattr(value, 'dtype', None) == numpy.float16:
                rule.state[k] = value.astype(numpy.float32)


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
