#!/usr/bin/env python
"""Ring allgatherv vs MPI_Allgatherv vs dense MPI_Allreduce, side by side.

Run under mpiexec, e.g. ``mpiexec -n 4 python benchmarks/bench_allgatherv.py``.
For each message size (bytes each rank contributes) it times, in the same
run and interleaved, chainer_vgc's pipelined ring allgatherv, MPI's
Allgatherv (both gather p blocks of that size) and a dense float32
Allreduce of that size (what an uncompressed exchange of the same bytes
costs).  Prints medians and the ratios ring/MPI and allreduce/ring.
"""

import argparse

import numpy
from mpi4py import MPI

from chainer_vgc.chainermn import transport

from bench_common import machine
from bench_common import median_time


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--min-bytes', type=int, default=1024)
    p.add_argument('--max-bytes', type=int, default=64 * 2 ** 20)
    p.add_argument('--repeat', type=int, default=5)
    p.add_argument('--chunk-words', type=int,
                   default=transport.DEFAULT_CHUNK_WORDS)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    if comm.rank == 0:
        print('p={} ranks on {}, chunk {} words'.format(
            comm.size, machine(numpy_version=False, mpi=True),
            args.chunk_words))
        print('| bytes/rank | ring ms | MPI Allgatherv ms | Allreduce ms | '
              'ring / MPI | allreduce / ring |')
        print('|---:|---:|---:|---:|---:|---:|')
    size = args.min_bytes
    while size <= args.max_bytes:
        words = size // 4
        repeat = args.repeat if size < 2 ** 24 else max(2, args.repeat // 2)
        send = numpy.arange(words, dtype=numpy.uint32) + comm.rank
        dense = numpy.ones(words, dtype=numpy.float32)
        counts = transport.exchange_counts(comm, words)
        # each repetition: the slowest rank's time
        ring = median_time(lambda: transport.ring_allgatherv(
            comm, send, args.chunk_words, counts=counts), repeat, comm)
        mpi = median_time(lambda: transport.mpi_allgatherv(
            comm, send, counts=counts), repeat, comm)
        red = median_time(lambda: comm.Allreduce(MPI.IN_PLACE, dense),
                          repeat, comm)
        if comm.rank == 0:
            print('| {:,} | {:.3f} | {:.3f} | {:.3f} | {:.2f} | {:.2f} |'
                  .format(size, ring * 1e3, mpi * 1e3, red * 1e3,
                          ring / mpi, red / ring))
        size *= 4


if __name__ == '__main__':
    main()
