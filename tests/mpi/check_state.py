"""Run under mpiexec: residual state across model changes and snapshots
(issue 10).  Prints 'state OK at p=P'."""

import warnings

import chainer
import chainer.functions as F
import chainer.links as L
import numpy
from mpi4py import MPI

import chainer_vgc

world = MPI.COMM_WORLD


class Net(chainer.Chain):
    """An MLP with a lazily initialized branch used only from some step."""

    def __init__(self, width=16):
        super(Net, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(6, width)
            self.l2 = L.Linear(width, 3)
            self.branch = L.Linear(None, 3)
        self.use_branch = False

    def forward(self, x):
        h = F.relu(self.l1(x))
        y = self.l2(h)
        if self.use_branch:
            y = y + self.branch(h)
        return y


def make(width=16):
    numpy.random.seed(0)
    model = L.Classifier(Net(width))
    model(numpy.zeros((1, 6), numpy.float32), numpy.zeros(1, numpy.int32))
    return model


def data(step, n=16):
    rng = numpy.random.default_rng(1000 * step + world.rank)
    x = rng.normal(size=(n, 6)).astype(numpy.float32)
    return x, ((x[:, 0] > 0) + (x[:, 1] > 1)).astype(numpy.int32)


def setup(method='vgc', width=16, **kw):
    kw = kw or dict(alpha=1.0)
    comm = chainer_vgc.create_communicator(method, world,
                                           abort_on_exception=False, **kw)
    model = make(width)
    opt = chainer_vgc.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(0.05), comm).setup(model)
    return comm, model, opt


def states(comm, model):
    comp = comm.state(model).compressor
    return {n: {k: a.copy() for k, a in st.items()}
            for n, st in zip(comp.names, comp.states) if st is not None}


def check_branch_reached_mid_run_keeps_residuals():
    comm, model, opt = setup()
    for step in range(5):
        opt.update(model, *data(step))
    # (the branch's bias is not lazy: already there)
    before = states(comm, model)
    assert '/predictor/branch/W' not in before and '/predictor/l1/W' in before
    model.predictor.use_branch = True
    model(*data(5))  # initializes the branch's parameters
    comm.setup(model)  # what the next exchange does first
    after = states(comm, model)
    assert set(after) == set(before) | {'/predictor/branch/W'}
    for name, st in before.items():  # kept, not wiped
        for key in st:
            assert numpy.array_equal(st[key], after[name][key]), name
            if name.startswith('/predictor/l'):  # something to keep
                assert st[key].any(), name
    assert all(not a.any() for a in after['/predictor/branch/W'].values())
    for step in range(5, 9):
        opt.update(model, *data(step))
    assert all(numpy.isfinite(p.array).all() for p in model.params())


def check_rank0_only_snapshot_neither_hangs_nor_changes_anything():
    runs = []
    for save in (False, True):
        comm, model, opt = setup('hybrid', tau=0.001)
        for step in range(6):
            if save and world.rank == 0 and step in (0, 3):
                # no collective: the other ranks are not in this call
                ser = chainer.serializers.DictionarySerializer()
                ser.save(opt)
                assert 'vgc_state/meta' in ser.target
            opt.update(model, *data(step))
        runs.append([p.array.copy() for p in model.params()
                     if p.array is not None])
    for a, b in zip(*runs):
        assert numpy.array_equal(a, b)


def snapshot(opt):
    ser = chainer.serializers.DictionarySerializer()
    ser.save(opt)
    return ser.target


def load(target, opt):
    # strict=False: Chainer's own optimizer state has no entry for the
    # never-initialized lazy branch
    chainer.serializers.NpzDeserializer(target, strict=False).load(opt)


def expect_error(fn, *words):
    try:
        fn()
    except ValueError as e:
        for w in words:
            assert w in str(e), (w, str(e))
    else:
        raise AssertionError('no ValueError; expected ' + ' '.join(words))


def check_snapshot_of_other_settings_is_refused():
    comm, model, opt = setup('vgc', alpha=1.0)
    for step in range(4):
        opt.update(model, *data(step))
    saved = snapshot(opt)
    # same settings: loads, and the residuals come back
    comm2, model2, opt2 = setup('vgc', alpha=1.0)
    load(saved, opt2)
    comm2.setup(model2)
    for name, st in states(comm, model).items():
        for key in st:
            assert numpy.array_equal(st[key], states(comm2, model2)[name][key])
    # another method or hyperparameter: an error naming both
    for method, kw, words in [
            ('hybrid', dict(tau=0.01), ("'vgc'", "'hybrid'", 'tau')),
            ('qsgd', dict(seed=1), ("'vgc'", "'qsgd'")),
            ('vgc', dict(alpha=2.0), ("'alpha': 1.0", "'alpha': 2.0"))]:
        _, _, other = setup(method, **kw)
        expect_error(lambda: load(saved, other), *words)
    # another model: an error naming the parameter
    _, _, wide = setup('vgc', width=32, alpha=1.0)
    expect_error(lambda: load(saved, wide), '/predictor/l1/W', '[16, 6]',
                 '[32, 6]')
    # switching method explicitly: residuals start fresh, with a warning
    switch = chainer_vgc.create_communicator(
        'hybrid', world, abort_on_exception=False, tau=0.01,
        resume_other_method=True)
    model3 = make()
    opt3 = chainer_vgc.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(0.05), switch).setup(model3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        load(saved, opt3)
    assert any('start fresh' in str(w.message) for w in caught)
    opt3.update(model3, *data(9))
    # another number of ranks: every rank of a smaller communicator fails
    sub = chainer_vgc.create_communicator(
        'vgc', world.Split(world.rank, 0), abort_on_exception=False,
        alpha=1.0)
    opt4 = chainer_vgc.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(0.05), sub).setup(make())
    if world.size > 1:
        expect_error(lambda: load(saved, opt4),
                     'saved by a run of {} ranks'.format(world.size),
                     'this run has 1')


def check_rank0_snapshot_is_rank0s_own():
    """ChainerCV's detection script saves a snapshot on rank 0 only and
    resumes every rank from it: the residuals in it are rank 0's."""
    comm, model, opt = setup('vgc', alpha=1.0)
    for step in range(4):
        opt.update(model, *data(step))
    held = states(comm, model)
    saved = world.bcast(snapshot(opt) if world.rank == 0 else None)
    _, _, plain = setup('vgc', alpha=1.0)
    if world.rank == 0:
        load(saved, plain)  # its own
    else:
        expect_error(lambda: load(saved, plain), 'saved by rank 0',
                     'this is rank {}'.format(world.rank),
                     "snapshot_rank{}_iter", 'create_multi_node_checkpointer',
                     "resume_residuals='fresh'")
    comm2, model2, opt2 = setup('vgc', alpha=1.0, resume_residuals='fresh')
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        load(saved, opt2)
    comm2.setup(model2)
    got = states(comm2, model2)
    if world.rank == 0:
        assert not caught, [str(w.message) for w in caught]
        for name, st in held.items():
            for key in st:
                assert numpy.array_equal(st[key], got[name][key])
    else:
        assert any('start fresh' in str(w.message) for w in caught)
        assert all(not a.any() for st in got.values() for a in st.values())
    for step in range(4, 7):  # and the run goes on, alike on every rank
        opt2.update(model2, *data(step))
    mine = [p.array.copy() for _, p in sorted(model2.namedparams())
            if p.array is not None]
    for a, b in zip(mine, world.bcast(mine)):
        assert numpy.array_equal(a, b)
    # a snapshot from before format 3 records no rank: it loads (as
    # before), with a warning that says what cannot be checked
    import json
    old = dict(saved)
    meta = json.loads(str(old['vgc_state/meta']))
    del meta['rank']
    old['vgc_state/meta'] = numpy.array(json.dumps(meta))
    _, _, legacy = setup('vgc', alpha=1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        load(old, legacy)
    assert any('records no rank' in str(w.message) and
               'create_multi_node_checkpointer' in str(w.message)
               for w in caught) == (world.size > 1), [
        str(w.message) for w in caught]
    try:
        setup('vgc', resume_residuals='all')
    except ValueError as e:
        assert 'resume_residuals' in str(e) and 'ElasticResume' in str(e)
    else:
        raise AssertionError('resume_residuals=all accepted')


def check_bcast_through_host_equals_chainermn():
    """The first update's broadcast, staged through one host buffer,
    equals ChainerMN's bcast_data bit for bit (float32 and float16)."""
    import chainermn
    got = []
    for comm in (chainermn.create_communicator('naive', world),
                 chainer_vgc.create_communicator('vgc', world,
                                                 abort_on_exception=False)):
        model = make()
        model.predictor.l2.W.array = model.predictor.l2.W.array.astype(
            numpy.float16)
        for p in model.params():  # different parameters on each rank
            if p.array is not None:
                p.array += p.array.dtype.type(world.rank)
        comm.bcast_data(model)
        got.append([p.array.copy() for p in model.params()
                    if p.array is not None])
    for a, b in zip(*got):
        assert a.dtype == b.dtype and numpy.array_equal(a, b)
    ref = world.bcast(got[1])  # and every rank holds rank 0's
    for a, b in zip(ref, got[1]):
        assert numpy.array_equal(a, b)
    if world.rank:  # it did replace this rank's own parameters
        mine = [p.array for p in make().params() if p.array is not None]
        assert not numpy.array_equal(got[1][0], mine[0] + world.rank)


def main():
    check_bcast_through_host_equals_chainermn()
    check_branch_reached_mid_run_keeps_residuals()
    check_rank0_only_snapshot_neither_hangs_nor_changes_anything()
    check_snapshot_of_other_settings_is_refused()
    check_rank0_snapshot_is_rank0s_own()
    world.Barrier()
    if world.rank == 0:
        print('state OK at p={}'.format(world.size))


if __name__ == '__main__':
    main()
