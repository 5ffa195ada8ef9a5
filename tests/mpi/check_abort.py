"""Run under mpiexec: rank 1 raises at its 4th step while the others are in
the exchange.  With chainer_vgc's communicator (ChainerMN's global except
hook) the whole job must end, non-zero, within seconds."""

import sys

import chainer
import chainer.links as L
import numpy

import chainer_vgc
from chainer_vgc.models import MLP


def main():
    comm = chainer_vgc.create_communicator('vgc')
    numpy.random.seed(0)
    model = L.Classifier(MLP((8,), 3))
    opt = chainer_vgc.create_multi_node_optimizer(
        chainer.optimizers.SGD(), comm).setup(model)
    x = numpy.random.rand(8, 5).astype(numpy.float32)
    t = numpy.zeros(8, numpy.int32)
    model(x, t)
    for step in range(1000):
        if comm.rank == int(sys.argv[1]) and step == 3:
            why = 'deliberate failure on rank {}'.format(comm.rank)
            # said before raising: mpiexec may cut the traceback short
            # when the abort kills the job
            print(why, file=sys.stderr, flush=True)
            raise RuntimeError(why)
        opt.update(model, x, t)


if __name__ == '__main__':
    main()
