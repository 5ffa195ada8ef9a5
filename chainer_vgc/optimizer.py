"""Multi-node optimizer that feeds the backward pass's per-sample statistics
to a :class:`~chainer_vgc.communicator.VGCCommunicator`.

Same signature and semantics as ``chainermn.create_multi_node_optimizer``
(the first update broadcasts the parameters of rank 0; later updates average
gradients through the communicator), so ``StandardUpdater`` + ``Trainer`` code
works unchanged.  The compressor's residual state is part of the optimizer's
serialized state (trainer snapshots).
"""

import chainer
from chainermn import optimizers as _mn_optimizers


class _VGCMultiNodeOptimizer(_mn_optimizers._MultiNodeOptimizer):

    def update(self, lossfun=None, *args, **kwds):
        target = self.target
        comm = self.communicator
        if lossfun is not None:
            loss = lossfun(*args, **kwds)
            if getattr(self, '_use_cleargrads', True):
                target.cleargrads()
            else:
                target.zerograds()
            scale = self.actual_optimizer._loss_scale
            if getattr(comm, 'needs_sqsum', False):
                batch, loss_fn = _batch_of(lossfun, args, kwds)
                sqsums = comm.statistics(target).backward(
                    loss, loss_fn=loss_fn, batch=batch, loss_scale=scale)
                comm.set_sqsums(sqsums)
            else:
                loss.backward(loss_scale=scale)
            del loss
        if not self.__dict__.get('_first_update_done'):
            # the first update broadcasts rank 0's parameters (ChainerMN),
            # unless every rank resumed from its own snapshot; a collective
            # decision, so ranks that did and did not load agree
            object.__setattr__(self, '_first_update_done', True)
            resumed = int(bool(self.__dict__.get('_resumed')))
            if comm.mpi_comm.allreduce(resumed, op=_mpi_min()):
                self.is_changed(target)  # record: no broadcast now
            elif hasattr(comm, 'sync_run'):
                comm.sync_run()  # the same step counts (warm-up) everywhere
        if self.is_changed(target):
            self.communicator.bcast_data(target)
            if hasattr(comm, 'set_sqsums'):
                comm.set_sqsums(None)  # this step's gradients are unused
        else:
            if hasattr(comm, 'set_loss_scale'):
                comm.set_loss_scale(self.actual_optimizer._loss_scale)
            self.communicator.multi_node_mean_grad(target, self.zero_fill)
            opt = self.actual_optimizer
            if (getattr(comm, 'skipped', False)
                    and not opt._loss_scaling_is_dynamic):
                # a rank's gradients were not finite and no loss scaler will
                # skip the NaN update: keep the parameters (vgc/skipped)
                return
            opt.update(None, *args, **kwds)

    def serialize(self, serializer):
        self.actual_optimizer.serialize(serializer)
        comm = self.communicator
        if hasattr(comm, 'serialize_state'):
            comm.serialize_state(self.target, serializer['vgc_state'])
        if isinstance(serializer, chainer.serializer.Deserializer):
            # resumed: if every rank loaded its snapshot, the next update
            # is an update, not the initial broadcast (decided collectively
            # at the first update; the model may be loaded after us)
            object.__setattr__(self, '_resumed', True)
            object.__setattr__(self, '_first_update_done', False)


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

    ``double_buffering`` is not supported with compression (it overlaps the
    exchange with the next step, which needs this step's residual).
    """
    if double_buffering:
        raise ValueError('double_buffering is not supported by chainer_vgc; '
                         'use double_buffering=False')
    return _VGCMultiNodeOptimizer(actual_optimizer, communicator, zero_fill)
