"""Run under mpiexec: ring and MPI allgatherv agree bit for bit with
MPI's Allgatherv on random, uneven and zero-length blocks.

    check_allgatherv.py TRIALS P [P ...]

checks each group size P on the communicator of the world's first P ranks
(MPI_Comm_split; the other ranks wait), TRIALS trials each; rank 0 prints
'allgatherv OK: N cases at p=P' for each."""

import sys

import numpy
from mpi4py import MPI

from chainer_vgc.chainermn import transport


def main():
    world = MPI.COMM_WORLD
    trials = int(sys.argv[1])
    for p in map(int, sys.argv[2:]):
        assert 1 <= p <= world.size, (p, world.size)
        sub = world.Split(int(world.rank < p), world.rank)
        if world.rank < p:
            check(sub, trials)
        sub.Free()
        world.Barrier()


def check(comm, trials):
    rng = numpy.random.default_rng(1234)  # same draws on every rank
    cases = 0
    for trial in range(trials):
        kind = trial % 5
        if kind == 0:
            sizes = numpy.zeros(comm.size, dtype=int)  # everyone empty
        elif kind == 1:
            sizes = rng.integers(0, 2, comm.size) * rng.integers(1, 50,
                                                                 comm.size)
        else:
            sizes = rng.integers(0, 3000, comm.size)
        chunk = int(rng.choice([1, 7, 64, 1000, 16384]))
        if chunk == 1:
            # one-word chunks: blocks of at most 60 words (still many
            # chunks per block, uneven, the zeros kept), not of thousands:
            # a ring step per word made these few trials nine tenths of
            # the check's time on oversubscribed cores (the other chunk
            # sizes keep the blocks of up to 3000 words)
            sizes = sizes % 61
        data = [rng.integers(0, 2 ** 32, s, dtype=numpy.uint64).astype(
            numpy.uint32) for s in sizes]
        mine = data[comm.rank]
        want = numpy.concatenate(data) if len(data) else numpy.zeros(
            0, numpy.uint32)
        ring, counts = transport.ring_allgatherv(comm, mine,
                                                 chunk_words=chunk)
        mpi, counts2 = transport.mpi_allgatherv(comm, mine)
        # into: the blocks received into a given buffer (a slice of a
        # larger one), its words only
        outer = numpy.full(int(sizes.sum()) + 6, 7, numpy.uint32)
        given = []

        def into(words):
            given.append(outer[3:3 + words])
            return given[-1]
        method = ('ring', 'mpi')[trial % 2]
        into_blocks, _ = transport.allgatherv(comm, mine, method=method,
                                              chunk_words=chunk, into=into)
        assert len(given) == 1 and given[0].size == int(sizes.sum())
        assert all(b.size == 0 or numpy.shares_memory(b, outer)
                   for b in into_blocks)
        assert (outer[:3] == 7).all() and (outer[-3:] == 7).all()
        # the oracle: MPI's Allgatherv called directly
        oracle = numpy.empty(int(sizes.sum()), numpy.uint32)
        displs = numpy.concatenate([[0], numpy.cumsum(sizes)[:-1]])
        comm.Allgatherv([mine, MPI.UINT32_T], [oracle, sizes.tolist(),
                                               displs.tolist(),
                                               MPI.UINT32_T])
        assert (oracle == want).all()
        assert counts.tolist() == sizes.tolist() == counts2.tolist()
        for got in (ring, mpi, into_blocks):
            assert len(got) == comm.size
            flat = numpy.concatenate(got) if got else oracle[:0]
            assert flat.dtype == numpy.uint32
            assert (flat == oracle).all(), trial
        cases += 1
    comm.Barrier()
    if comm.rank == 0:
        print('allgatherv OK: {} cases at p={}'.format(cases, comm.size))


if __name__ == '__main__':
    main()
