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
                batch = tuple(a for a in args if hasattr(a, 'shape'))
                sqsums = comm.statistics(target).backward(
                    loss, loss_fn=lambda *a: lossfun(*a, **kwds),
                    batch=batch, loss_scale=scale)
                comm.set_sqsums(sqsums)
            else:
                loss.backward(loss_scale=scale)
            del loss
        if self.__dict__.get('_resumed'):
            object.__setattr__(self, '_resumed', False)
            self.is_changed(target)
        if self.is_changed(target):
            self.communicator.bcast_data(target)
            if hasattr(comm, 'set_sqsums'):
                comm.set_sqsums(None)  # this step's gradients are unused
        else:
            self.communicator.multi_node_mean_grad(target, self.zero_fill)
            self.actual_optimizer.update(None, *args, **kwds)

    def serialize(self, serializer):
        self.actual_optimizer.serialize(serializer)
        comm = self.communicator
        if hasattr(comm, 'serialize_state'):
            comm.serialize_state(self.target, serializer['vgc_state'])
        if isinstance(serializer, chainer.serializer.Deserializer):
            # resumed: every rank loaded the same parameters, so the next
            # update is an update, not the initial broadcast (the model may
            # be loaded after the optimizer: record it at the next update)
            object.__setattr__(self, '_resumed', True)


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
