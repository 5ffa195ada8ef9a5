"""The main of an MPI check script: run the named checks (all by default,
``sys.argv[1:]`` to pick) with a barrier after each, then rank 0 prints
'<label> OK at p=P', which tests/test_mpi.py looks for."""

import sys

from mpi4py import MPI


def run(checks, label):
    world = MPI.COMM_WORLD
    names = sys.argv[1:] or [c.__name__ for c in checks]
    for check in checks:
        if check.__name__ in names:
            check()
            world.Barrier()
    if world.rank == 0:
        print('{} OK at p={}'.format(label, world.size))
