"""Run under mpiexec: the methods users pick instead of VGC (issue 51)
against their references, bit for bit, at the job's world size.

- powersgd: every rank's mean equals the paper's Algorithm 1 with error
  feedback (tests/reference.py's PowerSGDWorker) whose allreduce is MPI's
  own (an independent oracle of the sum), at ranks 1..4 of the matrix
  rank; the figures count (n + m) r numbers a tensor and the bytes of a
  ring allreduce of them; an overflow on one rank raises the same error
  on every rank, and no state or step count moves anywhere;
- dgc: every rank's mean equals the mean, in rank order, of what each
  rank's element-by-element reference (tests/test_dgc.py's) sends.

Prints 'methods OK at p=P'."""

import os
import sys

import chainer
import chainer.functions as F
import numpy
from mpi4py import MPI

import chainer_vgc

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import reference  # NOQA: E402
import runner  # NOQA: E402
import test_dgc  # NOQA: E402

world = MPI.COMM_WORLD


class Net(chainer.Chain):
    """A matrix, a convolution-shaped kernel and a vector, each gradient
    set by hand."""

    def __init__(self):
        super(Net, self).__init__()
        with self.init_scope():
            self.W = chainer.Parameter(numpy.zeros((30, 20), numpy.float32))
            self.K = chainer.Parameter(numpy.zeros((8, 4, 3, 3),
                                                   numpy.float32))
            self.b = chainer.Parameter(numpy.zeros(30, numpy.float32))

    def forward(self, x):
        return F.sum(self.W * x)


def grads_of(step, rank):
    rng = numpy.random.default_rng(1000 * step + rank)
    u = rng.normal(size=(30, 2)) @ rng.normal(size=(2, 20))
    return {'/W': (u + 0.1 * rng.normal(size=(30, 20))).astype(numpy.float32),
            '/K': rng.normal(size=(8, 4, 3, 3)).astype(numpy.float32),
            '/b': rng.normal(size=30).astype(numpy.float32)}


def exchange(comm, model, grads):
    for name, p in model.namedparams():
        p.grad = grads[name].copy()
    reporter = chainer.reporter.Reporter()
    obs = {}
    with reporter.scope(obs):
        comm.multi_node_mean_grad(model)
    return {name: p.grad.copy() for name, p in model.namedparams()}, obs


def mpi_mean(x):
    buf = numpy.ascontiguousarray(x).copy()
    world.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    return buf / buf.dtype.type(world.size)


def same_everywhere(a):
    for other in world.allgather(a):
        assert numpy.array_equal(a, other)


def check_powersgd_is_algorithm_1():
    for r in (1, 2, 3, 4):
        comm = chainer_vgc.create_communicator(
            'powersgd', world, abort_on_exception=False, matrix_rank=r,
            min_compression_rate=1.0, seed=11)
        model = Net()
        ref = reference.PowerSGDWorker([(8, 4, 3, 3), (30, 20)], r, 11)
        for step in range(5):
            grads = grads_of(step, world.rank)
            got, obs = exchange(comm, model, grads)
            k, w = ref.step([grads['/K'], grads['/W']], mpi_mean)
            assert numpy.array_equal(got['/K'], k.reshape(8, 4, 3, 3)), r
            assert numpy.array_equal(got['/W'], w), r
            same_everywhere(got['/W'])
            # the vector: ChainerMN's mean (its allreduce, times 1 / p)
            b = grads['/b'].copy()
            world.Allreduce(MPI.IN_PLACE, b, op=MPI.SUM)
            assert numpy.array_equal(got['/b'],
                                     b * numpy.float32(1.0 / world.size))
        sent = (8 + 36) * r + (30 + 20) * r  # numbers a rank sends
        n = 600 + 288 + 30
        p = world.size
        assert obs['vgc/compression'] == n / (sent + 30), obs
        assert obs['vgc/bytes'] == 2 * (p - 1) / p * 4 * (sent + 30), obs


def check_powersgd_overflow_on_one_rank_moves_nothing_anywhere():
    """Rank 0's gradient overflows its factors: every rank raises the
    same error, and no rank's state (E, Q) or step count moved."""
    comm = chainer_vgc.create_communicator('powersgd', world,
                                           abort_on_exception=False)
    model = Net()
    for step in range(2):
        exchange(comm, model, grads_of(step, world.rank))
    st = comm.state(model)
    before = [{k: a.copy() for k, a in s.items()}
              for s in st.compressor.states]
    steps = st.rule.steps
    grads = grads_of(2, world.rank)
    if world.rank == 0:
        grads['/W'][:] = numpy.float32(3e38)
    try:
        exchange(comm, model, grads)
    except FloatingPointError as e:
        error = str(e)
    else:
        error = None
    errors = world.allgather(error)
    assert errors[0] is not None and "parameter '/W'" in errors[0], errors
    assert all(e == errors[0] for e in errors), errors
    assert st.rule.steps == steps
    for s, old in zip(st.compressor.states, before):
        for k in old:
            assert numpy.array_equal(s[k], old[k]), k


def check_dgc_is_the_reference_mean():
    steps, density = 5, 0.05
    for values in ('float16', 'float32'):
        comm = chainer_vgc.create_communicator(
            'dgc', world, abort_on_exception=False, density=density,
            momentum_factor=0.9, clip_norm=20.0, value_dtype=values)
        model = Net()
        sent = {}
        for name in ('/K', '/W'):
            # every rank's messages, each from its own gradients, the
            # clipping factor from its whole compressed gradient
            sent[name] = []
            for rank in range(world.size):
                grads = [grads_of(s, rank) for s in range(steps)]
                sent[name].append(_reference_sends(grads, name, density,
                                                   values))
        for step in range(steps):
            got, _ = exchange(comm, model, grads_of(step, world.rank))
            for name, shape in (('/K', (8, 4, 3, 3)), ('/W', (30, 20))):
                total = numpy.zeros(int(numpy.prod(shape)), numpy.float32)
                for rank in range(world.size):
                    index, vals = sent[name][rank][step]
                    total[index] += numpy.array(vals, numpy.float32)
                want = total * numpy.float32(1.0 / world.size)
                assert numpy.array_equal(got[name].reshape(-1), want), \
                    (values, name, step)


def _reference_sends(grads, name, density, values):
    """Every step's (index, values) of ``name`` from one rank's
    element-by-element reference (test_dgc's), its gradients clipped by
    the norm over both compressed tensors."""
    factors = [test_dgc._clip_factor([g['/K'], g['/W']], 20.0, world.size)
               for g in grads]
    sent, _, _ = test_dgc._reference(
        [g[name].reshape(-1) for g in grads], density, 0.9, True, 0,
        numpy.float32, float32=values == 'float32', clip_factors=factors)
    return sent


if __name__ == '__main__':
    runner.run([check_powersgd_is_algorithm_1,
                check_powersgd_overflow_on_one_rank_moves_nothing_anywhere,
                check_dgc_is_the_reference_mean], 'methods')
