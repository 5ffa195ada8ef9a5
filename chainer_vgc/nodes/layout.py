"""Which node each rank is on, and which local rank owns which parameter.

The question this module answers: how does the hierarchical exchange
(issue 27) see the job?  A :class:`NodeLayout` splits an MPI communicator
into the ranks of one node (``intra_comm``: MPI's shared-memory split,
``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``, or groups of
``ranks_per_node`` consecutive ranks, which tests use to emulate nodes) and
the ranks of the same local index on every node (``inter_comm``, ordered
by node).  :func:`owners` gives each parameter to one local rank, the same
on every rank: that local rank runs VGC on it for its node.
"""


class NodeLayout(object):
    """The nodes of ``mpi_comm`` (collective: every rank calls it).

    ``ranks_per_node``: None (the ranks that share memory form a node) or
    k (ranks ``n*k .. n*k+k-1`` form node n).  Every node must have the
    same number of ranks.  Attributes: ``nodes`` (q), ``ranks_per_node``
    (k), ``node`` (this rank's node, 0..q-1), ``local_rank`` (0..k-1),
    ``intra_comm``, ``inter_comm``, ``node_of`` (each world rank's node)
    and ``peers`` (the world ranks of ``inter_comm``, in its order).
    """

    def __init__(self, mpi_comm, ranks_per_node=None):
        if ranks_per_node is None:
            from mpi4py import MPI
            intra = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED,
                                        key=mpi_comm.rank)
        else:
            k = _check_ranks_per_node(ranks_per_node, mpi_comm.size)
            intra = mpi_comm.Split(mpi_comm.rank // k, mpi_comm.rank)
        # a node is known by its first rank; nodes are ordered by it
        leader = intra.bcast(mpi_comm.rank, root=0)
        everyone = mpi_comm.allgather((leader, intra.rank, intra.size))
        sizes = sorted(set(size for _, _, size in everyone))
        if len(sizes) > 1:
            intra.Free()
            raise ValueError(
                "hierarchy='node' needs the same number of ranks on every "
                'node; these nodes have {} ranks. Start as many ranks per '
                'node everywhere, or use the flat communicator '
                '(hierarchy=None)'.format(sizes))
        leaders = sorted(set(lead for lead, _, _ in everyone))
        self.intra_comm = intra
        self.inter_comm = mpi_comm.Split(intra.rank, leaders.index(leader))
        self.nodes, self.ranks_per_node = len(leaders), intra.size
        self.node, self.local_rank = leaders.index(leader), intra.rank
        self.node_of = [leaders.index(lead) for lead, _, _ in everyone]
        self.peers = [r for r, (_, local, _) in enumerate(everyone)
                      if local == intra.rank]
        self.peers.sort(key=lambda r: self.node_of[r])

    def describe(self):
        """The layout in words, as snapshots record it."""
        return '{} nodes x {} ranks'.format(self.nodes, self.ranks_per_node)

    def duplicate(self):
        """The same layout on duplicates of both communicators (collective:
        for a background exchange)."""
        dup = object.__new__(NodeLayout)
        dup.__dict__.update(self.__dict__)
        dup.intra_comm = self.intra_comm.Dup()
        dup.inter_comm = self.inter_comm.Dup()
        return dup

    def free(self):
        for comm in (self.intra_comm, self.inter_comm):
            try:
                comm.Free()
            except Exception:  # (MPI finalized, or freed already)
                pass


def _check_ranks_per_node(k, size):
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError('ranks_per_node must be a positive int or None '
                         '(MPI finds the nodes), got {!r}'.format(k))
    if size % k:
        raise ValueError(
            'ranks_per_node={} does not divide the {} ranks into whole '
            'nodes'.format(k, size))
    return k


def owners(nbytes, k):
    """The local rank (0..k-1) that owns each parameter, given their sizes
    in bytes (in ``model_params`` order): the largest first, each to the
    least loaded local rank (the lowest on a tie).  Pure, so the same on
    every rank."""
    load = [0] * k
    owner = [0] * len(nbytes)
    for i in sorted(range(len(nbytes)), key=lambda i: (-nbytes[i], i)):
        j = min(range(k), key=lambda j: (load[j], j))
        owner[i] = j
        load[j] += nbytes[i]
    return owner
