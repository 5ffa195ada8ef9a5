"""The communicator a training script makes: flat or by nodes.

The question this module answers: which communicator does
``chainer_vgc.create_communicator`` return?  The flat
:class:`~chainer_vgc.chainermn.communicator.VGCCommunicator` (every rank one VGC
worker, paper Alg. 1), or with ``hierarchy='node'`` the
:class:`~chainer_vgc.nodes.communicator.HierarchicalCommunicator` (every node one
worker of batch kB, issue 27).
"""

from chainer_vgc.chainermn.communicator import VGCCommunicator
from chainer_vgc.nodes.communicator import HierarchicalCommunicator


def create_communicator(method='vgc', mpi_comm=None, allgatherv='ring',
                        abort_on_exception=True, exclude=None, min_size=0,
                        uncovered='error', warmup=0, alpha_ramp=None,
                        dense_dtype=None, hierarchy=None,
                        ranks_per_node=None, **kwargs):
    """A :class:`~chainer_vgc.chainermn.communicator.VGCCommunicator` on ``mpi_comm``
    (default COMM_WORLD); with ``hierarchy='node'``, a
    :class:`~chainer_vgc.nodes.communicator.HierarchicalCommunicator`: each node
    (MPI's shared-memory split; ``ranks_per_node=k``: groups of k
    consecutive ranks) acts as one VGC worker between nodes.

    ``method``: a rule name or a
    :class:`~chainer_vgc.rules.CompressionRule` object.  The controls (see
    :class:`~chainer_vgc.chainermn.communicator.VGCCommunicator` for the details):

    - ``exclude``: parameter names and/or predicates ``f(name, param)``
      sent uncompressed (dense allreduce); ``min_size``: parameters of
      fewer elements too;
    - ``uncovered``: ``'error'``, ``'bruteforce'`` or ``'dense'`` for the
      parameters the per-sample statistics cannot cover;
    - ``warmup``: dense exchanges before compression starts;
      ``alpha_ramp=(alpha0, steps)``: alpha from alpha0 to its value;
    - ``dense_dtype``: None or ``'float16'`` for the dense group.

    The rule's hyperparameters (``alpha``, ``tau``, ...) are further keyword
    arguments.  ``abort_on_exception`` installs ChainerMN's global except
    hook, so an uncaught exception on one rank aborts the whole job instead
    of leaving the others waiting in a collective.
    """
    if hierarchy not in (None, 'node'):
        raise ValueError("hierarchy must be None (flat) or 'node', got "
                         '{!r}'.format(hierarchy))
    if hierarchy is None and ranks_per_node is not None:
        raise ValueError("ranks_per_node is for hierarchy='node'; a flat "
                         'communicator has no nodes')
    if mpi_comm is None:
        from mpi4py import MPI
        mpi_comm = MPI.COMM_WORLD
    if abort_on_exception:
        import sys
        from chainermn import global_except_hook
        if sys.excepthook is not global_except_hook._global_except_hook:
            global_except_hook.add_hook()
    if hierarchy == 'node':
        kwargs['ranks_per_node'] = ranks_per_node
        cls = HierarchicalCommunicator
    else:
        cls = VGCCommunicator
    return cls(mpi_comm, method=method, allgatherv=allgatherv,
               exclude=exclude, min_size=min_size, uncovered=uncovered,
               warmup=warmup, alpha_ramp=alpha_ramp,
               dense_dtype=dense_dtype, **kwargs)
