"""Run under mpiexec with p ranks and argv[1] = k ranks per node: the
hierarchical communicator (nodes of k emulated ranks) against its oracle,
the flat communicator run by q = p/k workers whose gradients and sums of
squares are their nodes' (g = sum g_i / k, s = sum s_i / k**2: one worker
of batch kB).  Prints 'hierarchy OK at p=P'.  With VGC_CHECK_DEVICE (a
Chainer device, '@cupy:0': the GPU runbook) the models and gradients of
the exchange checks live there."""

import os
import sys

import chainer
import chainer.links as L
import numpy
from mpi4py import MPI

import chainer_vgc
from chainer_vgc.nodes.transfer import node_mean
from chainer_vgc.params import model_params
from chainer_vgc.statistics import PerSampleSquares

world = MPI.COMM_WORLD
K = int(sys.argv.pop(1))  # (the rest: check names, for runner.run)
Q = world.size // K
NODE, LOCAL = world.rank // K, world.rank % K
STEPS = 9
DEVICE = os.environ.get('VGC_CHECK_DEVICE')
NAN_STEP = 5  # a NaN on the last rank: every rank skips it


class Net(chainer.Chain):
    def __init__(self):
        super(Net, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(20, 12)
            self.l2 = L.Linear(12, 8)
            self.l3 = L.Linear(8, 3)
            self.l4 = L.Linear(3, 300, nobias=True)

    def forward(self, x):
        return self.l3(chainer.functions.relu(self.l2(self.l1(x))))


def make():
    numpy.random.seed(0)
    net = Net()
    if DEVICE:
        net.to_device(DEVICE)
        assert net.l1.W.xp is not numpy, DEVICE  # (really there)
    return net


def host(a):
    return chainer.backend.CpuDevice().send(a)


def rank_inputs(rank, step):
    """Rank ``rank``'s gradients and sums of squares at ``step`` (every
    rank can make anybody's)."""
    names, params = model_params(make())
    g, s = {}, {}
    for i, (n, p) in enumerate(zip(names, params)):
        rng = numpy.random.default_rng([rank, step, i])
        a = rng.normal(size=p.shape).astype(numpy.float32) * (i + 1)
        g[n] = a
        s[n] = (a * a * rng.uniform(0.2, 3, size=p.shape)).astype(
            numpy.float32)
    if step == NAN_STEP and rank == world.size - 1:
        g['/l2/W'][1, 2] = numpy.nan
    return g, s


def node_inputs(node, step):
    parts = [rank_inputs(node * K + j, step) for j in range(K)]
    g = {n: node_mean([gi[n] for gi, _ in parts], K) for n in parts[0][0]}
    s = {n: node_mean([si[n] for _, si in parts], K * K)
         for n in parts[0][1]}
    return g, s


def exchange(comm, model, inputs, step, background):
    g, s = inputs
    names, params = model_params(model)
    for n, p in zip(names, params):
        p.grad = p.xp.array(g[n])
    sqsums = [p.xp.asarray(s[n]) for n, p in zip(names, params)]
    handle = comm.exchange_async(model, sqsums=sqsums,
                                 loss_scale=8.0 if step % 3 == 1 else None,
                                 background=background)
    result = handle.wait()
    if step % 3 == 1:  # (the mean comes back times the loss scale)
        for p in params:
            p.grad /= 8.0
    return result


def sgd(model):
    for _, p in model.namedparams():
        if bool(p.xp.isfinite(p.grad).all()):
            p.array -= 0.1 * p.grad


def check_equals_flat_run_of_node_workers():
    """Every rule, a dense group, warm-up, loss scaling, a non-finite step,
    background exchanges: the parameters equal the flat run's bit for bit
    after every step, on every rank of the node."""
    flat_comm = world.Split(0 if LOCAL == 0 else MPI.UNDEFINED, world.rank)
    cases = [('vgc', dict(min_size=20, warmup=2)),
             ('vgc', dict(alpha=0.7, index_coding='gap')),
             ('hybrid', dict(min_size=20)), ('strom', dict(tau=0.5)),
             ('dgc', dict(density=0.05, density_warmup_steps=2)),
             ('none', {})]
    for method, kw in cases:
        hier = chainer_vgc.create_communicator(
            method, hierarchy='node', ranks_per_node=K, **kw)
        model = make()
        flat = flat_model = None
        if LOCAL == 0:
            flat = chainer_vgc.create_communicator(method, flat_comm, **kw)
            flat_model = make()
        for t in range(STEPS):
            rh = exchange(hier, model, rank_inputs(world.rank, t), t,
                          background=t % 2 == 1)
            skipped = world.allgather(rh.skipped)
            assert skipped == [t == NAN_STEP and method != 'none'] * \
                world.size, (method, t, skipped)
            if flat is not None:
                rf = exchange(flat, flat_model, node_inputs(NODE, t), t,
                              background=False)
                assert rf.skipped == rh.skipped
                for (n, a), (_, b) in zip(sorted(model.namedparams()),
                                          sorted(flat_model.namedparams())):
                    assert numpy.array_equal(host(a.grad), host(b.grad),
                                             equal_nan=True), (method, t, n)
                if not rh.skipped and method != 'none':
                    fh, ff = rh.figures, rf.figures
                    assert fh['vgc/compression'] == ff['vgc/compression']
                    # the same elements, in k messages a node instead of 1
                    assert ff['vgc/bytes'] <= fh['vgc/inter_node_bytes'] \
                        <= ff['vgc/bytes'] + 4 * 64 * K * Q, (fh, ff)
            sgd(model)
            if flat_model is not None:
                sgd(flat_model)
            sums = world.allgather([host(p.array).tobytes() for _, p in
                                    sorted(model.namedparams())])
            assert all(x == sums[0] for x in sums), (method, t)
        # (a skipped step is not counted)
        tot = hier.state(model).totals
        assert tot['steps'] == STEPS - (method != 'none')
        if flat is not None:
            assert tot['skipped'] == flat.state(flat_model).totals['skipped']


def check_node_statistics_are_those_of_the_node_batch():
    """The oracle's premise: the hook's g and s of k batches of B, put
    together as the hierarchical exchange does, are those of one batch of
    kB (to rounding)."""
    rng = numpy.random.default_rng(7)
    x = rng.normal(size=(K * 5, 20)).astype(numpy.float32)
    t = rng.integers(0, 3, size=K * 5).astype(numpy.int32)

    def stats(xs, ts):
        model = L.Classifier(make())
        model.cleargrads()
        loss = model(xs, ts)
        sq = PerSampleSquares(model).backward(loss, batch=(xs,))
        names, params = model_params(model)
        return ({n: None if p.grad is None else p.grad.copy()
                 for n, p in zip(names, params)},
                dict(zip(names, [None if a is None else numpy.asarray(a)
                                 for a in sq])))
    parts = [stats(x[j * 5:(j + 1) * 5], t[j * 5:(j + 1) * 5])
             for j in range(K)]
    whole_g, whole_s = stats(x, t)
    for n in whole_g:
        if whole_g[n] is None:
            continue
        g = node_mean([gi[n] for gi, _ in parts], K)
        s = node_mean([si[n] for _, si in parts], K * K)
        numpy.testing.assert_allclose(g, whole_g[n], rtol=1e-5, atol=1e-7)
        numpy.testing.assert_allclose(s, whole_s[n], rtol=1e-5, atol=1e-9)


def check_snapshot_resumes_on_its_layout_only():
    """A snapshot holds this rank's shard: resuming on the same layout
    continues bit for bit; a flat run or another layout is refused,
    naming both."""
    kw = dict(min_size=20)

    def steps(comm, model, ts):
        for t in ts:
            exchange(comm, model, rank_inputs(world.rank, t), t, False)
            sgd(model)
    comm = chainer_vgc.create_communicator('vgc', hierarchy='node',
                                           ranks_per_node=K, **kw)
    model = make()
    steps(comm, model, range(4))
    saved = chainer.serializers.DictionarySerializer()
    comm.serialize_state(model, saved)
    # (Chainer's DictionarySerializer keeps the residual arrays, not copies)
    saved = {k: numpy.array(host(v), copy=True)
             for k, v in saved.target.items()}
    arrays = {n: host(p.array).copy() for n, p in model.namedparams()}
    steps(comm, model, range(6, 9))

    def load(comm2, model2):
        comm2.serialize_state(model2, chainer.serializers.NpzDeserializer(
            saved))
    again = make()
    for n, p in again.namedparams():
        p.array[...] = p.xp.asarray(arrays[n])
    comm2 = chainer_vgc.create_communicator('vgc', hierarchy='node',
                                            ranks_per_node=K, **kw)
    load(comm2, again)
    steps(comm2, again, range(6, 9))
    for (n, a), (_, b) in zip(sorted(model.namedparams()),
                              sorted(again.namedparams())):
        assert numpy.array_equal(host(a.array), host(b.array)), n
    here = '{} nodes x {} ranks, local rank {}'.format(Q, K, LOCAL)
    others = [chainer_vgc.create_communicator('vgc', **kw)]
    if K > 1:
        others.append(chainer_vgc.create_communicator(
            'vgc', hierarchy='node', ranks_per_node=1, **kw))
    for other in others:
        try:
            load(other, make())
        except ValueError as e:
            assert here in str(e) and 'same layout' in str(e), str(e)
        else:
            raise AssertionError('a snapshot of {} loaded on {}'.format(
                here, type(other).__name__))


def check_trains_with_statistics_and_double_buffering():
    """The optimizer wrappers drive it as the flat communicator (per-sample
    statistics from the backward; double buffering): the ranks stay
    equal, the loss falls, and the figures name inter- and intra-node
    bytes."""
    for double in (False, True):
        comm = chainer_vgc.create_communicator(
            'vgc', hierarchy='node', ranks_per_node=K, alpha=1.0)
        model = L.Classifier(make())
        opt = chainer_vgc.create_multi_node_optimizer(
            chainer.optimizers.Adam(0.01), comm,
            double_buffering=double).setup(model)
        rng = numpy.random.default_rng(world.rank)
        losses, obs = [], {}
        reporter = chainer.reporter.Reporter()
        reporter.add_observer('main', model)
        for t in range(30):
            x = rng.normal(size=(8, 20)).astype(numpy.float32)
            y = (x[:, 0] > 0).astype(numpy.int32) + (x[:, 1] > 1)
            with reporter.scope(obs):
                opt.update(model, x, y)
            losses.append(float(model.loss.array))
        if double:
            opt.wait()
        assert numpy.mean(losses[-5:]) < numpy.mean(losses[:5]), losses
        sums = world.allgather([p.array.tobytes() for _, p in
                                sorted(model.namedparams())])
        assert all(x == sums[0] for x in sums)
        assert obs['vgc/inter_node_bytes'] > 0 or Q == 1, obs
        assert (obs['vgc/intra_node_bytes'] > 0) == (K > 1), obs
        # the run's figures count the nodes as the workers
        st = comm.state(model)
        assert st.workers == Q
        assert st.compressed_elements == sum(
            p.size for _, p in model.namedparams())


def main():
    import runner
    runner.run([check_node_statistics_are_those_of_the_node_batch,
                check_equals_flat_run_of_node_workers,
                check_snapshot_resumes_on_its_layout_only,
                check_trains_with_statistics_and_double_buffering],
               'hierarchy')


if __name__ == '__main__':
    main()
