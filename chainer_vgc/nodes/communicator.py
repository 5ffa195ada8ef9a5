"""The hierarchical communicator: nodes of k ranks, each node one VGC worker.

The question this module answers: what does a job on nodes of several GPUs
hold to run VGC between nodes only (issue 27)?  A
:class:`HierarchicalCommunicator` is a
:class:`~chainer_vgc.chainermn.communicator.VGCCommunicator` over all the ranks,
with a :class:`~chainer_vgc.nodes.layout.NodeLayout` (the ranks of each
node, found by MPI's shared-memory split) and, for the ranks of its local
index on the other nodes, :class:`~chainer_vgc.chainermn.collectives.Collectives`
(``inter``).  Its exchange is :func:`chainer_vgc.nodes.run.
run_node_exchange`: a dense reduce-scatter inside the node, VGC on each
shard between nodes, an allgather inside the node, as ChainerMN's
``two_dimensional`` communicator does for dense allreduce.  Because VGC's
statistics add up (Sec. 4.1), the result is VGC with p/k workers of batch
kB.  ``create_communicator(..., hierarchy='node')`` makes one.
"""


from chainer_vgc.nodes import run as node_run
from chainer_vgc.exchange import snapshot
from chainer_vgc.chainermn.collectives import Collectives
from chainer_vgc.chainermn.collectives import free_mpi_comm
from chainer_vgc.chainermn.communicator import VGCCommunicator
from chainer_vgc.nodes.layout import NodeLayout


class NodeCollectives(Collectives):
    """Collectives over every rank with the node ``layout`` and the
    ``inter`` collectives of this rank's local index: what
    :func:`~chainer_vgc.nodes.run.run_node_exchange` runs on (a
    :class:`HierarchicalCommunicator` or its duplicate, for a background
    exchange)."""

    def __init__(self, mpi_comm, layout, allgatherv, chunk_words,
                 cuda_aware_mpi):
        super(NodeCollectives, self).__init__(mpi_comm, allgatherv,
                                              chunk_words, cuda_aware_mpi)
        self.layout = layout
        self.inter = Collectives(layout.inter_comm, allgatherv, chunk_words,
                                 cuda_aware_mpi)

    def duplicate(self):
        return _duplicate_nodes(self)


def _duplicate_nodes(comm):
    """:class:`NodeCollectives` over duplicates of ``comm``'s MPI
    communicator and node layout (``comm``: a :class:`NodeCollectives` or
    a :class:`HierarchicalCommunicator`; collective), freed with them."""
    dup = NodeCollectives(comm.mpi_comm.Dup(), comm.layout.duplicate(),
                          comm.allgatherv_method, comm.chunk_words,
                          comm.cuda_aware_mpi)
    dup.free_when_collected(_free_node, dup.mpi_comm, dup.layout)
    return dup


def _free_node(mpi_comm, layout):
    free_mpi_comm(mpi_comm)
    layout.free()


class HierarchicalCommunicator(VGCCommunicator):
    """A :class:`~chainer_vgc.chainermn.communicator.VGCCommunicator` whose nodes of
    k ranks each act as one VGC worker of batch kB (see the module).

    Args:
        mpi_comm: an mpi4py communicator.
        ranks_per_node: None (MPI's shared-memory split finds the nodes) or
            k: ranks ``n*k .. n*k+k-1`` form node n (to emulate nodes).
        **kwargs: as :class:`~chainer_vgc.chainermn.communicator.VGCCommunicator`.

    Every rule, dense groups, warm-up, loss scaling, non-finite skips and
    double buffering work as in the flat communicator; the residuals of
    each rank are those of the parameters it owns, and a snapshot records
    the layout (resuming needs the same one).  ``vgc/bytes`` are the bytes
    each rank sends between nodes; ``vgc/inter_node_bytes`` per node and
    ``vgc/intra_node_bytes`` per rank inside its node are reported too.
    """

    _State = node_run.NodeMethodState

    def __init__(self, mpi_comm, ranks_per_node=None, **kwargs):
        super(HierarchicalCommunicator, self).__init__(mpi_comm, **kwargs)
        self.ranks_per_node = ranks_per_node
        self.layout = NodeLayout(mpi_comm, ranks_per_node)
        self.inter = Collectives(self.layout.inter_comm,
                                 self.allgatherv_method, self.chunk_words,
                                 self.cuda_aware_mpi)

    @property
    def _run(self):
        # looked up at each exchange (a benchmark may wrap it)
        return node_run.run_node_exchange

    def setup(self, model):
        self._current = self.state(model)
        self._current.setup_node(model, self)

    def duplicate(self):
        return _duplicate_nodes(self)

    def split(self, color, key):
        return self.__class__(
            mpi_comm=self.mpi_comm.Split(color, key),
            ranks_per_node=self.ranks_per_node,
            allgatherv=self.allgatherv_method, chunk_words=self.chunk_words,
            cuda_aware_mpi=self.cuda_aware_mpi, **self._current.settings())

    def serialize_state(self, model, serializer, state=None):
        """As :meth:`VGCCommunicator.serialize_state
        <chainer_vgc.chainermn.communicator.VGCCommunicator.serialize_state>`, with
        this rank's shard and the layout recorded (a snapshot of another
        layout, or of another local rank, is refused)."""
        if state is None:
            state = self.state(model)
        self._current = state
        snapshot.serialize(state, model, serializer, self.size,
                           layout='{}, local rank {}'.format(
                               self.layout.describe(),
                               self.layout.local_rank),
                           rank=self.rank)
