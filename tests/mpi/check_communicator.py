"""Run under mpiexec: VGCCommunicator against ChainerMN's naive communicator
and against the invariants of the paper.  Prints 'communicator OK'."""

import json

import chainer
import chainer.functions as F
import chainer.links as L
import chainermn
import numpy
from mpi4py import MPI

import chainer_vgc
from chainer_vgc.statistics import model_params

import runner

comm_world = MPI.COMM_WORLD


class Net(chainer.Chain):
    """Small MLP with a float16 layer and a layer that gets no gradient."""

    def __init__(self, half=False):
        super(Net, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(6, 16)
            self.l2 = L.Linear(16, 3)
            self.unused = L.Linear(3, 2)
            if half:
                self.h = L.Linear(3, 3)
                for p in self.h.params():
                    p.array = p.array.astype(numpy.float16)
        self.half = half

    def forward(self, x):
        y = self.l2(F.relu(self.l1(x)))
        if self.half:
            y = y + F.cast(self.h(F.cast(y, numpy.float16)), numpy.float32)
        return y


def make(seed=0, half=False):
    numpy.random.seed(seed)
    model = L.Classifier(Net(half))
    model(numpy.zeros((1, 6), numpy.float32), numpy.zeros(1, numpy.int32))
    return model


def data(step, n=16):
    rng = numpy.random.default_rng(1000 * step + comm_world.rank)
    x = rng.normal(size=(n, 6)).astype(numpy.float32)
    t = (x[:, 0] + x[:, 1] > 0).astype(numpy.int32) + (x[:, 2] > 1)
    return x, t.astype(numpy.int32)


def train(comm, steps, model=None, optimizer=None, create=None, obs=None):
    """``steps`` updates; ``obs`` (dict) receives the last observation."""
    model = model or make()
    create = create or chainer_vgc.create_multi_node_optimizer
    opt = create(optimizer or chainer.optimizers.Adam(), comm).setup(model)
    reporter = chainer.reporter.Reporter()
    reporter.add_observer('main', model)
    for step in range(steps):
        with reporter.scope(obs if obs is not None else {}):
            opt.update(model, *data(step))
    return model


def params_of(model):
    return [p.array.copy() for _, p in sorted(model.namedparams())]


def check_none_equals_naive():
    """method='none': 20 Adam steps give exactly the naive run's params."""
    naive = chainermn.create_communicator('naive', comm_world)
    ours = chainer_vgc.create_communicator('none', comm_world)
    a = train(naive, 21, create=chainermn.create_multi_node_optimizer)
    b = train(ours, 21)
    for (name, pa), pb in zip(sorted(a.namedparams()), params_of(b)):
        assert (pa.array == pb).all(), name
    # ranks agree
    for arr in params_of(b):
        assert (comm_world.bcast(arr) == arr).all()


def check_vgc_alpha_tiny_equals_mean_gradient():
    """vgc with (effectively) alpha = 0 and quantization off sends every
    nonzero element: the mean gradient equals naive's (up to summation
    order of 4 ranks)."""
    comm = chainer_vgc.create_communicator('vgc', comm_world, alpha=1e-30,
                                           quantize=False)
    naive = chainermn.create_communicator('naive', comm_world)
    model = make()
    names, params = model_params(model)
    x, t = data(0)
    model.cleargrads()
    sq = comm.statistics(model).backward(model(x, t), batch=(x,))
    grads = [None if p.grad is None else p.grad.copy() for p in params]
    comm.set_sqsums(sq)
    comm.multi_node_mean_grad(model)
    ours = [None if p.grad is None else p.grad.copy() for p in params]
    for p, g in zip(params, grads):
        p.grad = None if g is None else g.copy()
    naive.multi_node_mean_grad(model)
    for name, p, o in zip(names, params, ours):
        if p.grad is None:
            assert o is None, name
            continue
        numpy.testing.assert_allclose(o, p.grad, rtol=1e-6, atol=1e-9,
                                      err_msg=name)
    assert comm.state(model).last['vgc/compression'] < 1.5


def check_conservation_across_ranks():
    """quantize=False: sum of mean gradients over steps = mean over ranks of
    (sum of local gradients - local residual)."""
    comm = chainer_vgc.create_communicator('vgc', comm_world, alpha=2.0,
                                           quantize=False)
    model = make()
    names, params = model_params(model)
    applied = [numpy.zeros(p.shape) for p in params]
    local = [numpy.zeros(p.shape) for p in params]
    for step in range(60):
        x, t = data(step)
        model.cleargrads()
        comm.set_sqsums(comm.statistics(model).backward(model(x, t),
                                                        batch=(x,)))
        for acc, p in zip(local, params):
            if p.grad is not None:
                acc += p.grad
        comm.multi_node_mean_grad(model)
        for acc, p in zip(applied, params):
            if p.grad is not None:
                acc += p.grad
    sent_any = False
    for name, a, loc, st in zip(names, applied, local,
                                comm.state(model).compressor.states):
        want = (loc - st['r'].reshape(loc.shape)) / comm_world.size
        want = comm_world.allreduce(want)
        numpy.testing.assert_allclose(a, want, rtol=1e-4, atol=1e-5,
                                      err_msg=name)
        sent_any = sent_any or bool(a.any())
    assert sent_any
    assert comm.state(model).totals['elements'] > 0


def check_empty_sends_mixed_dtypes_and_no_grads():
    """Nothing selected anywhere (huge alpha): no hang, zero gradients;
    float16 parameters; a link with no gradient (zero_fill=True, the
    default, gives zeros as in ChainerMN; zero_fill=False keeps None, see
    check_vgc_alpha_tiny_equals_mean_gradient)."""
    comm = chainer_vgc.create_communicator('vgc', comm_world, alpha=1e12)
    model = make(half=True)
    obs = {}
    train(comm, 5, model=model, obs=obs)
    names, params = model_params(model)
    for name, p in zip(names, params):  # zero_fill=True: zeros, as naive
        assert p.grad is not None and not p.grad.any(), name
    assert model.predictor.h.W.dtype == numpy.float16
    assert comm.state(model).totals['elements'] == 0
    assert obs['vgc/compression'] == float('inf')
    # and some real traffic with every method, float16 included
    for method, kw in (('vgc', {}), ('hybrid', dict(tau=0.001)),
                       ('strom', dict(tau=0.001)), ('qsgd', dict(seed=1)),
                       ('none', {})):
        comm = chainer_vgc.create_communicator(method, comm_world, **kw)
        obs = {}
        model = train(comm, 4, model=make(half=True), obs=obs)
        for key in ('vgc/compression', 'vgc/density', 'vgc/bytes'):
            assert numpy.isfinite(obs[key]), (method, key)
        assert comm.state(model).totals['elements'] > 0, method
        for arr in params_of(model):
            assert numpy.isfinite(arr).all()
            assert (comm_world.bcast(arr) == arr).all(), method


def check_split_and_bcast():
    comm = chainer_vgc.create_communicator('hybrid', comm_world, tau=0.01)
    sub = comm.split(comm.rank % 2, comm.rank)
    assert isinstance(sub, chainer_vgc.VGCCommunicator)
    st = sub.state()
    assert st.method == 'hybrid' and st.rule.tau == 0.01
    value = comm.bcast_obj('hello' if comm.rank == 0 else None)
    assert value == 'hello'
    # gradients exchanged on the split communicator equal naive's there
    none_sub = chainer_vgc.create_communicator('none', comm_world).split(
        comm.rank % 2, comm.rank)
    naive_sub = chainermn.create_communicator('naive', comm_world).split(
        comm.rank % 2, comm.rank)
    a = train(none_sub, 5)
    b = train(naive_sub, 5, create=chainermn.create_multi_node_optimizer)
    for pa, pb in zip(params_of(a), params_of(b)):
        assert (pa == pb).all()
    model = make()
    naive_sub.bcast_data(model)  # inherited bcast_data keeps working
    sub.bcast_data(model)


def check_float16_none_equals_naive():
    naive = chainermn.create_communicator('naive', comm_world)
    ours = chainer_vgc.create_communicator('none', comm_world)
    for opt in (chainer.optimizers.Adam, chainer.optimizers.MomentumSGD):
        a = train(naive, 6, model=make(half=True), optimizer=opt(),
                  create=chainermn.create_multi_node_optimizer)
        b = train(ours, 6, model=make(half=True), optimizer=opt())
        for pa, pb in zip(params_of(a), params_of(b)):
            assert pa.dtype == pb.dtype and (pa == pb).all()


def check_mismatched_models_fail_on_every_rank():
    comm = chainer_vgc.create_communicator('vgc', comm_world)
    model = make()
    if comm.rank == comm.size - 1 and comm.size > 1:
        model.predictor.add_link('extra', L.Linear(2, 2))
        model.predictor.extra(numpy.zeros((1, 2), numpy.float32))
    x, t = data(0)
    model.cleargrads()
    comm.set_sqsums(comm.statistics(model).backward(model(x, t),
                                                    batch=(x,)))
    try:
        comm.multi_node_mean_grad(model)
    except ValueError as e:
        assert 'differ from rank 0' in str(e), str(e)
        ok = True
    else:
        ok = comm.size == 1
    assert all(comm_world.allgather(ok))


def check_trainer_reports():
    """LogReport sees the per-step keys and CompressionReport's totals."""
    from chainer import training
    from chainer.training import extensions
    from chainer_vgc.extensions import CompressionReport
    from chainer_vgc.extensions import REPORT_KEYS
    import tempfile
    comm = chainer_vgc.create_communicator('vgc', comm_world, alpha=1.0)
    model = make()
    opt = chainer_vgc.create_multi_node_optimizer(
        chainer.optimizers.Adam(), comm).setup(model)
    x, t = data(0, 64)
    it = chainer.iterators.SerialIterator(
        chainer.datasets.TupleDataset(x, t), 8, shuffle=False)
    out = tempfile.mkdtemp()
    trainer = training.Trainer(training.StandardUpdater(it, opt), (6,
                               'iteration'), out=out)
    trainer.extend(extensions.LogReport(trigger=(2, 'iteration')))
    trainer.extend(CompressionReport(comm, trigger=(2, 'iteration')))
    trainer.run()
    log = trainer.get_extension('LogReport').log
    assert len(log) == 3
    for key in REPORT_KEYS + ['vgc/total_compression', 'vgc/total_bytes',
                              'vgc/dense_bytes', 'vgc/interval_compression']:
        assert numpy.isfinite(log[-1][key]), key
    # over an interval, the paper's ratio is 1 / mean density
    assert abs(log[-1]['vgc/interval_compression'] *
               log[-1]['vgc/density'] - 1) < 1e-9
    n = comm.state(model).compressor.n_params
    p = comm.size
    steps = comm.state(model).totals['steps']
    assert steps == 5  # 6 iterations, the first one broadcasts
    assert log[-1]['vgc/dense_bytes'] == steps * 2 * (p - 1) * 4 * n / p
    assert (log[-1]['vgc/total_bytes'] > 0) == (p > 1)
    everyone = comm_world.allgather(log[-1]['vgc/compression'])
    assert len(set(everyone)) == 1  # aggregated over ranks: same value


def check_dict_batch_and_lazy_unused_params():
    """StandardUpdater with a DictDataset passes the batch as keywords;
    a lazily initialized link that is never reached stays uninitialized."""
    from chainer import training
    comm = chainer_vgc.create_communicator('vgc', comm_world, alpha=1.0)
    numpy.random.seed(0)
    net = Net()
    with net.init_scope():
        net.aux = L.Linear(None, 2)  # never called
    model = L.Classifier(net, label_key='t')
    x, t = data(0, 64)
    model(x=x[:1], t=t[:1])
    opt = chainer_vgc.create_multi_node_optimizer(
        chainer.optimizers.Adam(), comm).setup(model)
    it = chainer.iterators.SerialIterator(
        chainer.datasets.DictDataset(x=x, t=t), 8, shuffle=False)
    trainer = training.Trainer(training.StandardUpdater(it, opt),
                               (4, 'iteration'), out='/tmp')
    trainer.run()
    assert model.predictor.aux.W.array is None
    tot = comm.state(model).totals
    assert tot['steps'] == 3 and tot['elements'] > 0
    w = model.predictor.l1.W.array
    assert (comm_world.bcast(w) == w).all()


def residuals_of(comm, model):
    st = comm.state(model).compressor.states
    return [{k: a.copy() for k, a in sorted((x or {}).items())} for x in st]


def check_two_models_keep_their_own_states():
    """Two models of one structure trained through one communicator,
    updates interleaved, with and without double buffering, with and
    without a warm-up step: each keeps its own residuals and totals, bit
    for bit those of a communicator of its own (issue 24, finding 1)."""
    for db, warmup in ((False, 0), (True, 0), (True, 1), (False, 1)):
        def create(opt, comm):
            return chainer_vgc.create_multi_node_optimizer(
                opt, comm, double_buffering=db)
        shared = chainer_vgc.create_communicator('vgc', comm_world,
                                                 alpha=1.0, warmup=warmup)
        own = [chainer_vgc.create_communicator('vgc', comm_world, alpha=1.0,
                                               warmup=warmup)
               for _ in range(2)]
        runs = []
        for comms in ([shared, shared], own):
            models = [make(seed=s) for s in (0, 1)]
            opts = [create(chainer.optimizers.SGD(0.1), c).setup(m)
                    for c, m in zip(comms, models)]
            for step in range(5):
                for k, (o, m) in enumerate(zip(opts, models)):
                    o.update(m, *data(3 * step + k))
            for o in opts:
                getattr(o, 'wait', lambda: None)()
            runs.append([(params_of(m), residuals_of(c, m),
                          dict(c.state(m).totals))
                         for c, m in zip(comms, models)])
        for (pa, ra, ta), (pb, rb, tb) in zip(*runs):
            assert ta == tb and ta['steps'] == 4, (ta, tb)
            for a, b in zip(pa, pb):
                assert (a == b).all()
            for a, b in zip(ra, rb):
                assert sorted(a) == sorted(b)
                for key in a:
                    assert (a[key] == b[key]).all()
        # the two models' states differ (they were not one state)
        (pa, ra, _), (pb, rb, _) = runs[0]
        assert any((a['r'] != b['r']).any() for a, b in zip(ra, rb) if a)
        shared.finalize()


class Generator(chainer.Chain):
    def __init__(self):
        super(Generator, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(4, 12)
            self.l2 = L.Linear(12, 6)

    def forward(self, z):
        return F.tanh(self.l2(F.relu(self.l1(z))))


class Discriminator(chainer.Chain):
    def __init__(self):
        super(Discriminator, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(6, 12)
            self.l2 = L.Linear(12, 1)

    def forward(self, x):
        return self.l2(F.leaky_relu(self.l1(x)))


def train_gan(comms, db, steps=6, obs=None):
    """A GAN's alternating updates (as ChainerMN's DCGAN example): the
    discriminator on real and generated samples, then the generator
    through the discriminator; ``comms``: (generator's, discriminator's)
    communicator, one shared or two.  Returns both models."""
    numpy.random.seed(5)
    gen, dis = Generator(), Discriminator()
    opts = [chainer_vgc.create_multi_node_optimizer(
        chainer.optimizers.Adam(1e-2), c, double_buffering=db).setup(m)
        for c, m in zip(comms, (gen, dis))]
    reporter = chainer.reporter.Reporter()
    reporter.add_observer('gen', gen)
    reporter.add_observer('dis', dis)

    def loss_dis(x_real, z):
        fake = gen(z)  # (its gradients are cleared by gen's update)
        n = len(x_real)
        return (F.sum(F.softplus(-dis(x_real))) +
                F.sum(F.softplus(dis(fake)))) / n

    def loss_gen(z):
        return F.sum(F.softplus(-dis(gen(z)))) / len(z)
    for step in range(steps):
        rng = numpy.random.default_rng(100 * step + comm_world.rank)
        x_real = numpy.tanh(rng.normal(1.0, 0.5, (8, 6))).astype(
            numpy.float32)
        z = rng.normal(size=(8, 4)).astype(numpy.float32)
        with reporter.scope(obs if obs is not None else {}):
            opts[1].update(loss_dis, x_real, z)
            opts[0].update(loss_gen, z)
    for o in opts:
        o.wait() if db else None
        o.close()
    return gen, dis


def check_gan_on_one_communicator():
    """A GAN's generator and discriminator (two models, other structures)
    through one communicator train exactly as through one each, with and
    without double buffering; each reports under its trainer name
    (``gen/vgc/compression``), and a model's snapshot is refused by the
    other's state, naming both (issue 24, finding 1)."""
    for db in (False, True):
        shared = chainer_vgc.create_communicator('vgc', comm_world,
                                                 alpha=1.0)
        own = [chainer_vgc.create_communicator('vgc', comm_world, alpha=1.0)
               for _ in range(2)]
        obs = {}
        a = train_gan([shared, shared], db, obs=obs)
        b = train_gan(own, db)
        for ma, mb, c in zip(a, b, own):
            for pa, pb in zip(params_of(ma), params_of(mb)):
                assert (pa == pb).all()
            assert shared.state(ma).totals == c.state(mb).totals
            assert shared.state(ma).totals['steps'] == 5
        for name in ('gen', 'dis'):
            assert name + '/vgc/compression' in obs, sorted(obs)
        assert 'vgc/compression' not in obs, sorted(obs)
        assert [shared.state(m).label for m in a] == ['model0', 'model1']
        # the run totals of one model, under its trainer name as well
        reporter = chainer.reporter.Reporter()
        reporter.add_observer('gen', a[0])
        totals = {}
        with reporter.scope(totals):
            chainer_vgc.extensions.CompressionReport(shared, model=a[0])(None)
        assert 'gen/vgc/total_compression' in totals, sorted(totals)
        assert c.state(mb).label is None  # (one model: 'vgc/...')
    # a sweep: a model made after the last one was dropped reports as one
    import gc
    sweep = chainer_vgc.create_communicator('vgc', comm_world, alpha=1.0)
    for trial in range(3):
        model, obs = make(seed=trial), {}
        train(sweep, 3, model=model, obs=obs)
        assert sweep.state(model).label is None
        assert 'vgc/compression' in obs, sorted(obs)
        del model  # (its optimizer's reference cycle keeps it: no collect)
    # labels follow the order met (three models so far): two alive at
    # once are model3 and model4, and a model met after one of them was
    # dropped is model5, never a second model4
    fourth, fifth = make(seed=7), make(seed=8)
    assert sweep.state(fourth).label is None
    assert sweep.state(fifth).label == 'model4'
    assert sweep.state(fourth).label == 'model3'
    del fourth
    sixth = make(seed=9)
    assert sweep.state(sixth).label == 'model5'
    del fifth, sixth
    gc.collect()
    alive = [make(seed=s) for s in (0, 1)]
    states = [sweep.state(m) for m in alive]
    assert [st.label for st in states] == ['model6', 'model7']
    # the discriminator's snapshot into the generator's state
    saved = {}
    serializer = chainer.serializers.DictionarySerializer(saved)
    shared.serialize_state(a[1], serializer)
    meta = json.loads(str(saved['meta']))
    assert meta['model_name'] == 'Discriminator', meta
    try:
        shared.serialize_state(
            a[0], chainer.serializers.NpzDeserializer(saved))
    except ValueError as e:
        text = str(e)
        assert 'Discriminator' in text and 'Generator' in text, text
    else:
        raise AssertionError("a discriminator's snapshot loaded into the "
                             "generator's state")


def check_exchange_async_handle():
    """``exchange_async(background=True)`` then ``wait()``: the mean, the
    figures and the totals of a synchronous exchange, bit for bit; the
    result is committed once however often ``wait()`` is called."""
    means, figures = [], []
    for background in (False, True):
        comm = chainer_vgc.create_communicator('vgc', comm_world, alpha=1.0)
        model = make()
        x, t = data(7)
        model.cleargrads()
        sq = comm.statistics(model).backward(model(x, t), batch=(x,))
        handle = comm.exchange_async(model, True, sqsums=sq,
                                     background=background)
        result = handle.wait()
        assert handle.wait() is result and handle.done()
        st = comm.state(model)
        assert st.totals['steps'] == 1 and not result.skipped
        assert st.last == result.figures
        means.append(params_grads(model))
        figures.append(result.figures)
        comm.finalize()
    assert figures[0] == figures[1]
    for a, b in zip(*means):
        assert (a == b).all()


def params_grads(model):
    return [p.grad.copy() for _, p in sorted(model.namedparams())
            if p.grad is not None]


def check_gradient_on_some_ranks_nothing_sent():
    """``zero_fill=False``, a parameter with a gradient on rank 0 only and
    nothing sent for it by anyone (Strom with a huge tau): every rank ends
    with the same gradient for it, the mean of what was sent (zeros), by
    the ranks' agreement on which parameters have a gradient somewhere (a
    rank's own view would leave it None on the other ranks)."""
    comm = chainer_vgc.create_communicator('strom', comm_world, tau=1e30)
    model = make()
    x, t = data(0)
    model.cleargrads()
    model(x, t).backward()  # 'unused' gets no gradient
    if comm_world.rank == 0:
        for p in model.predictor.unused.params():
            p.grad = numpy.ones_like(p.array)
    comm.multi_node_mean_grad(model, zero_fill=False)
    # (nothing sent but headers)
    assert comm.state(model).last['vgc/bytes'] < 100
    grads = [(n, None if p.grad is None else p.grad.copy())
             for n, p in sorted(model.namedparams())]
    everyone = comm_world.allgather(grads)
    for other in everyone[1:]:
        for (n, a), (m, b) in zip(everyone[0], other):
            assert n == m and (a is None) == (b is None), (n, a, b)
            if a is not None:
                assert (a == b).all(), n
    unused = [g for n, g in grads if '/unused/' in n]
    assert len(unused) == 2
    assert all(g is not None and not g.any() for g in unused), unused


CHECKS = [check_none_equals_naive, check_float16_none_equals_naive,
          check_dict_batch_and_lazy_unused_params,
          check_trainer_reports, check_vgc_alpha_tiny_equals_mean_gradient,
          check_conservation_across_ranks,
          check_empty_sends_mixed_dtypes_and_no_grads, check_split_and_bcast,
          check_mismatched_models_fail_on_every_rank,
          check_two_models_keep_their_own_states,
          check_gan_on_one_communicator,
          check_exchange_async_handle,
          check_gradient_on_some_ranks_nothing_sent]


def main():
    runner.run(CHECKS, 'communicator')


if __name__ == '__main__':
    main()
