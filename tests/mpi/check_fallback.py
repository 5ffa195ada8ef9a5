"""Run under mpiexec: the dense fallback (chainer_vgc.exchange.fallback).  A step
predicted slower compressed is sent dense as a warm-up step is (every
gradient allreduced, every residual as it was): the run equals, bit for
bit, an oracle of two communicators, 'vgc' for the compressed steps and
'none' (dense allreduce) for the others.  Prints 'fallback OK at p=P'."""

import chainer.links as L
import numpy
from mpi4py import MPI

import chainer_vgc
from chainer_vgc.params import model_params

import runner

world = MPI.COMM_WORLD
STEPS = 8


def make():
    numpy.random.seed(0)
    return L.Linear(40, 30)


def inputs(step):
    """Steps 0-2: a clear signal (most elements pass the criterion); then
    noise (few do)."""
    names, params = model_params(make())
    rng = numpy.random.default_rng([world.rank, step])
    g, s = {}, {}
    for n, p in zip(names, params):
        a = rng.normal(size=p.shape).astype(numpy.float32)
        g[n] = a
        ratio = 0.05 if step < 3 else 50.0
        s[n] = (a * a * ratio).astype(numpy.float32)
    return g, s


def exchange(comm, model, step):
    g, s = inputs(step)
    names, params = model_params(model)
    for n, p in zip(names, params):
        p.grad = g[n].copy()
    return comm.exchange(model, sqsums=[s[n] for n in names])


def sgd(model):
    for _, p in model.namedparams():
        p.array -= 0.1 * p.grad


def check_steps_predicted_slow_are_sent_dense():
    """16 emulated workers: a step is dense when more than 1/8 of the
    elements would be sent (2 s / (p e) with e = s = 32)."""
    fb = dict(bandwidth='1Gbit', workers=16, bits_per_element=32)
    for method, kw in (('vgc', dict(alpha=1.0, quantize=False)),
                       ('vgc', dict(alpha=1.0)),
                       ('hybrid', dict(alpha=1.0, tau=1e-3))):
        comm = chainer_vgc.create_communicator(method, dense_fallback=fb,
                                               **kw)
        compressing = chainer_vgc.create_communicator(method, **kw)
        dense = chainer_vgc.create_communicator('none')
        model, oracle = make(), make()
        dense_steps = []
        for t in range(STEPS):
            r = exchange(comm, model, t)
            was_dense = r.figures['vgc/dense_steps'] == 1.0
            dense_steps.append(was_dense)
            exchange(dense if was_dense else compressing, oracle, t)
            for (n, a), (_, b) in zip(sorted(model.namedparams()),
                                      sorted(oracle.namedparams())):
                assert numpy.array_equal(a.grad, b.grad), (method, t, n)
            assert r.figures['vgc/predicted_dense_s'] > 0
            sgd(model)
            sgd(oracle)
        # the signal steps went dense (the residuals stay empty), the
        # noise steps compressed
        assert dense_steps == [t < 3 for t in range(STEPS)], \
            (method, dense_steps)
        tot = comm.state(model).totals
        assert tot['dense_steps'] == 3 and tot['steps'] == STEPS
        # the residuals are those of the compressed steps only
        for a, b in zip(comm.state(model).compressor.states,
                        compressing.state(oracle).compressor.states):
            for key in a:
                assert numpy.array_equal(a[key], b[key]), key
        all_steps = world.allgather(dense_steps)
        assert all(x == all_steps[0] for x in all_steps)


def check_dgc_goes_dense_while_its_warmup_density_is_high():
    """dgc's density warm-up (25 %, then 6.25 %, then its density) with
    the same 1/8 limit: the 25 % steps go dense (the fallback's steps
    still move the warm-up), the later ones compress; each step's mean
    is the dense allreduce's or dgc's own."""
    fb = dict(bandwidth='1Gbit', workers=16, bits_per_element=32)
    kw = dict(density=0.01, density_warmup_steps=2, momentum_factor=0.0)
    comm = chainer_vgc.create_communicator('dgc', dense_fallback=fb, **kw)
    dense = chainer_vgc.create_communicator('none')
    compressing = chainer_vgc.create_communicator('dgc', **kw)
    model, oracle = make(), make()
    went = []
    for t in range(6):
        r = exchange(comm, model, t)
        went.append(r.figures['vgc/dense_steps'] == 1.0)
        if went[-1]:
            exchange(dense, oracle, t)
            compressing.state(oracle).rule.steps += 1  # (as dense_step)
        else:
            exchange(compressing, oracle, t)
        for (n, a), (_, b) in zip(sorted(model.namedparams()),
                                  sorted(oracle.namedparams())):
            assert numpy.array_equal(a.grad, b.grad), (t, n, went)
    assert went == [True, True, False, False, False, False], went
    assert comm.state(model).rule.steps == 6


def check_every_step_dense_is_a_warmup_run():
    """A tiny c (alpha 1e-6: nearly every element would be sent)
    against 1024 workers: every step dense, the run equal to a warm-up of
    every step."""
    fb = dict(bandwidth=1e9, workers=1024)
    comm = chainer_vgc.create_communicator('vgc', dense_fallback=fb,
                                           alpha=1e-6)
    warm = chainer_vgc.create_communicator('vgc', warmup=STEPS, alpha=1e-6)
    model, oracle = make(), make()
    for t in range(STEPS):
        r = exchange(comm, model, t)
        assert r.figures['vgc/dense_steps'] == 1.0
        exchange(warm, oracle, t)
        for (n, a), (_, b) in zip(sorted(model.namedparams()),
                                  sorted(oracle.namedparams())):
            assert numpy.array_equal(a.grad, b.grad), (t, n)
        sgd(model)
        sgd(oracle)
    assert comm.state(model).totals['dense_steps'] == STEPS
    for st in comm.state(model).compressor.states:
        assert st is None or not any(a.any() for a in st.values())


def check_hierarchical_shards_choose_alike():
    """With nodes of 2 ranks, every rank of a shard's ring takes the same
    choice and the ranks stay equal."""
    if world.size % 2:
        return
    comm = chainer_vgc.create_communicator(
        'vgc', hierarchy='node', ranks_per_node=2, alpha=1.0,
        dense_fallback=dict(bandwidth='1Gbit', workers=16))
    model = make()
    for t in range(STEPS):
        exchange(comm, model, t)
        sgd(model)
        sums = world.allgather([p.array.tobytes() for _, p in
                                sorted(model.namedparams())])
        assert all(x == sums[0] for x in sums), t
    assert comm.state(model).totals['dense_steps'] > 0


def check_link_measured_once():
    """dense_fallback=True: the link is measured at the first exchange,
    the same on every rank."""
    comm = chainer_vgc.create_communicator('vgc', dense_fallback=True)
    model = make()
    exchange(comm, model, 1)
    fb = comm.state(model).fallback
    links = world.allgather((fb.latency, fb.bandwidth))
    assert all(x == links[0] for x in links) and links[0][1] > 0, links


if __name__ == '__main__':
    runner.run([check_steps_predicted_slow_are_sent_dense,
                check_dgc_goes_dense_while_its_warmup_density_is_high,
                check_every_step_dense_is_a_warmup_run,
                check_hierarchical_shards_choose_alike,
                check_link_measured_once], 'fallback')
