"""Multi-node optimizers: ``chainermn.create_multi_node_optimizer``'s
drop-in.

The question this module answers: which optimizer wrapper does a run get?
:class:`~chainer_vgc.chainermn.multi_node_optimizer.VGCMultiNodeOptimizer` (one
exchange per update, synchronously) or, with ``double_buffering=True``,
:class:`~chainer_vgc.chainermn.double_buffering.VGCDoubleBufferingOptimizer`.
"""

from chainer_vgc.chainermn.double_buffering import VGCDoubleBufferingOptimizer
from chainer_vgc.chainermn.multi_node_optimizer import VGCMultiNodeOptimizer


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
