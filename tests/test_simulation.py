"""The one-process simulation's collectives (chainer_vgc.harness.simulation):
the dense group's mean against a hand-written recursive-doubling sum, the
messages gathered in rank order, and a worker's error raised instead of
the other workers waiting forever.  (That the whole simulation equals an
``mpiexec`` run bit for bit: tests/test_examples.py.)"""

import threading
import types

import chainer
import chainer.functions as F
import chainer.links as L
import numpy
import pytest

from chainer_vgc.harness import simulation


def _on_threads(size, work):
    """``work(collectives)`` on ``size`` threads; results in rank order."""
    meet = simulation._Rendezvous(size)
    out = [None] * size

    def run(rank):
        out[rank] = work(simulation.InProcessCollectives(meet, rank))
    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    return out


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float16])
def test_dense_mean_is_mpis_recursive_doubling_order(dtype):
    rng = numpy.random.default_rng(0)
    grads = [rng.normal(0, 1, 257).astype(dtype) for _ in range(4)]
    wide = [g.astype(numpy.float32) for g in grads]
    want = ((wide[0] + wide[1]) + (wide[2] + wide[3])).astype(dtype)
    want *= dtype(0.25)

    def work(coll):
        p = chainer.Parameter(numpy.zeros(257, dtype))
        p.grad = grads[coll.rank].copy()
        n, wire = coll.dense_mean([p], True)
        return p.grad, n, wire
    for got, n, wire in _on_threads(4, work):
        assert got.dtype == dtype and n == 257 and wire > 0
        assert numpy.array_equal(got.view(numpy.uint8), want.view(
            numpy.uint8))


def test_allgatherv_gives_every_message_in_rank_order():
    msgs = [numpy.arange(r * 3, dtype=numpy.uint32) + 100 * r
            for r in range(3)]
    for blocks, counts in _on_threads(
            3, lambda coll: coll.allgatherv_words(msgs[coll.rank])):
        assert list(counts) == [0, 3, 6]
        for b, m in zip(blocks, msgs):
            assert numpy.array_equal(b, m)


def test_a_workers_error_is_raised_and_no_worker_waits_forever():
    class Net(chainer.Chain):
        def __init__(self):
            super(Net, self).__init__()
            with self.init_scope():
                self.l1 = L.Linear(4, 3)

        def forward(self, x, t):
            return F.softmax_cross_entropy(self.l1(x), t)
    model = Net()
    sim = simulation.SimulatedWorkers(
        model, chainer.optimizers.SGD().setup(model), 3, 'vgc', alpha=1.0)
    x = numpy.ones((2, 4), numpy.float32)
    t = numpy.zeros(2, numpy.int32)
    sim.update(model, [(x, t)] * 3)  # (the first update only broadcasts)
    sim.update(model, [(x, t)] * 3)
    state = sim.states[1]
    broken = types.SimpleNamespace(**{
        k: getattr(state, k) for k in dir(state) if not k.startswith('__')})

    def setup(model, collectives):
        raise RuntimeError('worker 1 fails')
    broken.setup = setup
    broken.note_uncovered = state.note_uncovered
    sim.states[1] = broken
    done = []

    def update():
        with pytest.raises(RuntimeError, match='worker 1 fails'):
            sim.update(model, [(x, t)] * 3)
        done.append(True)
    runner = threading.Thread(target=update)
    runner.start()
    runner.join(60)
    assert done, 'the other workers kept waiting'
