"""Run under mpiexec: one rank (argv[1]) raises at its 4th step while the
others are in the exchange.  With chainer_vgc's communicator (ChainerMN's
global except hook) the whole job must end, non-zero, within seconds.

argv: the failing rank, then a folder where each rank records what
happened to it (MPICH forwards a rank's stderr on a best-effort basis once
the job is aborted, so the test reads these files, not mpiexec's output):
``failed.<rank>`` before the raise, ``finished.<rank>`` if a rank ever
left the loop (it must not: the others wait in the exchange)."""

import os
import sys

import chainer
import chainer.links as L
import numpy

import chainer_vgc
from chainer_vgc.harness.models import MLP


def record(folder, name, rank, text):
    path = os.path.join(folder, '{}.{}'.format(name, rank))
    with open(path, 'w') as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def main():
    failing, folder = int(sys.argv[1]), sys.argv[2]
    comm = chainer_vgc.create_communicator('vgc')
    numpy.random.seed(0)
    model = L.Classifier(MLP((8,), 3))
    opt = chainer_vgc.create_multi_node_optimizer(
        chainer.optimizers.SGD(), comm).setup(model)
    x = numpy.random.rand(8, 5).astype(numpy.float32)
    t = numpy.zeros(8, numpy.int32)
    model(x, t)
    for step in range(1000):
        if comm.rank == failing and step == 3:
            why = 'deliberate failure on rank {}'.format(comm.rank)
            record(folder, 'failed', comm.rank, why)
            # said before raising: mpiexec may cut the traceback short
            # when the abort kills the job
            print(why, file=sys.stderr, flush=True)
            raise RuntimeError(why)
        opt.update(model, x, t)
    record(folder, 'finished', comm.rank, 'left the loop')


if __name__ == '__main__':
    main()
