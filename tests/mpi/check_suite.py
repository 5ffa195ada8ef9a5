"""Run under mpiexec: several check scripts of this folder in one launch,
so that MPI and Chainer start once per world size instead of once per
script.

    check_suite.py SCRIPT[:ARG[:ARG...]] [SCRIPT[:ARG...] ...]

runs each ``check_SCRIPT.py`` as its own ``__main__`` (fresh globals, its
``sys.argv`` the ARGs), one after the other, with a barrier between; each
prints its own 'OK' line, which tests/test_mpi.py looks for.  A failure
ends the job, as it would end the script's own launch.
"""

import os
import runpy
import sys
import traceback

from mpi4py import MPI

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    world = MPI.COMM_WORLD
    for spec in sys.argv[1:]:
        name, *args = spec.split(':')
        path = os.path.join(HERE, 'check_{}.py'.format(name))
        if world.rank == 0:
            print('== ' + ' '.join([name] + args), flush=True)
        sys.argv = [path] + args
        try:
            runpy.run_path(path, run_name='__main__')
        except BaseException:  # (no rank left waiting in a collective)
            traceback.print_exc()
            sys.stderr.flush()
            world.Abort(1)
        sys.stdout.flush()
        world.Barrier()


if __name__ == '__main__':
    main()
