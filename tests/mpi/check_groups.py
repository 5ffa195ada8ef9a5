"""Run under mpiexec: pluggable rules, dense groups, warm-up (issue 12).

Prints 'groups OK at p=P'."""

import warnings

import chainer
import chainer.functions as F
import chainer.links as L
import chainermn
import numpy
from mpi4py import MPI

import chainer_vgc
from chainer_vgc.rules import CompressionRule

import runner
from topk_rule import TopK

world = MPI.COMM_WORLD


class Attention(chainer.Link):
    """A parameter used through F.matmul: not covered by the statistics
    (on the ranks in ``ranks`` only; None: on every rank)."""

    def __init__(self, n, ranks=None):
        super(Attention, self).__init__()
        self.ranks = ranks
        with self.init_scope():
            self.M = chainer.Parameter(
                numpy.random.normal(0, 0.3, (n, n)).astype(numpy.float32))

    def forward(self, x):
        if self.ranks is not None and world.rank not in self.ranks:
            return x
        return x + F.matmul(x, self.M)


def make(seed=0, attention=False):
    numpy.random.seed(seed)
    layers = [L.Linear(6, 32), F.relu]
    if attention:
        layers.append(Attention(32))
    layers.append(L.Linear(32, 3))
    model = L.Classifier(chainer.Sequential(*layers))
    model(numpy.zeros((1, 6), numpy.float32), numpy.zeros(1, numpy.int32))
    return model


def data(step, n=16):
    rng = numpy.random.default_rng(1000 * step + world.rank)
    x = rng.normal(size=(n, 6)).astype(numpy.float32)
    t = ((x[:, 0] + x[:, 1] > 0).astype(numpy.int32) +
         (x[:, 2] > 1)).astype(numpy.int32)
    return x, t


def reporter(model):
    rep = chainer.Reporter()
    rep.add_observer('main', model)
    return rep


def train(comm, model, steps, first=0):
    opt = getattr(comm, 'test_optimizer', None)  # go on with it
    if opt is None:
        opt = comm.test_optimizer = chainer_vgc.create_multi_node_optimizer(
            chainer.optimizers.Adam(), comm).setup(model)
    reports = []
    for step in range(first, first + steps):
        x, t = data(step)
        observed = {}
        with reporter(model).scope(observed):
            opt.update(model, x, t)
        reports.append(dict(observed))
    return reports


def params(model):
    return {n: p.array.copy() for n, p in model.namedparams()}


def same(a, b):
    return all(numpy.array_equal(a[k].view(numpy.uint32),
                                 b[k].view(numpy.uint32)) for k in a)


def check_plugin_rule():
    """A rule object defined here, through create_communicator: trains,
    reports compression, keeps its residuals."""
    comm = chainer_vgc.create_communicator(TopK(0.1))
    assert comm.state().method == 'topk_test'
    model = make()
    reports = train(comm, model, 12)
    ratios = [r['vgc/compression'] for r in reports if 'vgc/compression' in r]
    assert ratios and min(ratios) > 5, ratios
    assert any(st['r'].any() for st in comm.state(model).compressor.states)
    # hyperparameters with a rule object are refused, naming the argument
    try:
        chainer_vgc.create_communicator(TopK(0.1), alpha=2)
    except ValueError as e:
        assert 'rule object' in str(e)
    else:
        raise AssertionError('hyperparameters with a rule object accepted')


def check_dense_group_equals_naive():
    """exclude (a name and a predicate) and min_size: the dense group's
    means equal ChainerMN's naive communicator bit for bit; the rest is
    compressed; both figures are reported."""
    naive = chainermn.create_communicator('naive')
    comm = chainer_vgc.create_communicator(
        'vgc', alpha=1.0, exclude=['/predictor/0/W',
                                   lambda name, p: name.endswith('1/W')],
        min_size=10)
    model, twin = make(), make()
    for step in range(3):
        x, t = data(step)
        for m in (model, twin):
            m.cleargrads()
            loss = m(x, t)
            if m is model:
                comm.set_sqsums(comm.statistics(m).backward(
                    loss, batch=(x, t)))
            else:
                loss.backward()
        observed = {}
        with reporter(model).scope(observed):
            comm.multi_node_mean_grad(model, True)
        naive.multi_node_mean_grad(twin, True)
        dense = comm.dense_group(model)
        # by name, by predicate, and /predictor/1/b (3 < 10 elements)
        assert dense == {'/predictor/0/W', '/predictor/1/W',
                         '/predictor/1/b'}, dense
        theirs = dict(twin.namedparams())
        for n, p in model.namedparams():
            if n in dense:
                assert numpy.array_equal(p.grad, theirs[n].grad), n
        assert 'vgc/compression_compressed' in observed
        assert 0 < observed['vgc/dense_fraction'] < 1
    return comm


def check_uncovered_dense():
    """uncovered='dense': the matmul-used parameter goes to the dense group
    with one warning listing it; training goes on."""
    comm = chainer_vgc.create_communicator('vgc', alpha=1.0,
                                           uncovered='dense')
    model = make(attention=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        train(comm, model, 4)
    msgs = [str(w.message) for w in caught if 'uncovered' in str(w.message)]
    assert len(msgs) == 1 and '/predictor/2/M' in msgs[0], msgs
    assert '/predictor/2/M' in comm.dense_group(model)
    # and the default names the fix
    comm = chainer_vgc.create_communicator('vgc')
    try:
        train(comm, make(attention=True), 2)
    except Exception as e:
        assert "uncovered='dense'" in str(e), e
    else:
        raise AssertionError('uncovered parameter accepted')


def check_uncovered_on_some_ranks():
    """A parameter only some ranks find uncovered: every rank moves it to
    the dense group (no mismatched collectives)."""
    numpy.random.seed(0)
    model = L.Classifier(chainer.Sequential(
        L.Linear(6, 32), F.relu, Attention(32, ranks=(1,)),
        L.Linear(32, 3)))
    model(numpy.zeros((1, 6), numpy.float32), numpy.zeros(1, numpy.int32))
    comm = chainer_vgc.create_communicator('vgc', alpha=1.0,
                                           uncovered='dense')
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        train(comm, model, 4)
    dense = comm.dense_group(model)
    assert any(n.endswith('/M') for n in dense), dense


def check_warmup():
    """warmup=K: the first K updates equal 'none' exactly; then the
    residuals start empty and compression is reported."""
    k = 3
    a, b = make(), make()
    comm = chainer_vgc.create_communicator('vgc', alpha=1.0, warmup=k)
    reference = chainer_vgc.create_communicator('none')
    # the first update broadcasts: k + 1 updates are k exchanges
    ra = train(comm, a, k + 1)
    train(reference, b, k + 1)
    assert same(params(a), params(b))
    assert all(r['vgc/compression'] == 1.0 for r in ra[1:])
    assert all(not st['r'].any() for st in comm.state(a).compressor.states)
    more = train(comm, a, 3, first=k + 1)
    assert all(r['vgc/compression'] > 1.0 for r in more), more
    # alpha ramp: alpha0 -> alpha over 4 steps after the warm-up
    comm = chainer_vgc.create_communicator('vgc', alpha=2.0, warmup=1,
                                           alpha_ramp=(0.5, 4))
    model = make()
    train(comm, model, 4)
    rule = comm.state(model).rule
    assert 0.5 < rule.alpha < 2.0, rule.alpha


def check_float16_dense():
    """dense_dtype='float16': one float16 allreduce, half the bytes; the
    means within float16 rounding of the exact ones."""
    comm = chainer_vgc.create_communicator('none', dense_dtype='float16')
    exact = chainer_vgc.create_communicator('none')
    a, b = make(), make()
    x, t = data(0)
    for m, c in ((a, comm), (b, exact)):
        m.cleargrads()
        m(x, t).backward()
        observed = {}
        with reporter(m).scope(observed):
            c.multi_node_mean_grad(m, True)
        c.figures = dict(observed)
    for (n, p), q in zip(sorted(a.namedparams()),
                         [q for _, q in sorted(b.namedparams())]):
        numpy.testing.assert_allclose(p.grad, q.grad, rtol=4e-3,
                                      atol=1e-4 * abs(q.grad).max() + 1e-7)
    if world.size > 1:
        assert comm.figures['vgc/bytes'] * 2 == exact.figures['vgc/bytes']


def float64_refused(method, **kw):
    """A float16 dense exchange of float64 parameters is refused, naming
    dense_dtype and float64."""
    comm = chainer_vgc.create_communicator(method, dense_dtype='float16',
                                           **kw)
    with chainer.using_config('dtype', numpy.float64):
        numpy.random.seed(0)
        model = L.Classifier(L.Linear(6, 3))
        x, t = data(0)
        model(x.astype(numpy.float64), t).backward()
    try:
        comm.multi_node_mean_grad(model, True)
    except ValueError as e:
        assert 'dense_dtype' in str(e) and 'float64' in str(e), e
    else:
        raise AssertionError('float16 exchange of float64 accepted: {} '
                             '{}'.format(method, kw))


def check_bad_input():
    """Clear errors naming the argument, on every rank, before any
    exchange."""
    def refused(exc, words, **kw):
        try:
            comm = chainer_vgc.create_communicator(
                kw.pop('method', 'vgc'), **kw)
            train(comm, make(), 2)
        except exc as e:
            assert all(w in str(e) for w in words), (words, e)
        else:
            raise AssertionError('accepted: {}'.format(kw))
    refused(ValueError, ['exclude', '/no/such'], exclude=['/no/such'])
    refused(ValueError, ['warmup'], warmup=-1)
    refused(ValueError, ['dense_dtype'], dense_dtype='int8')
    refused(ValueError, ['min_size'], min_size=-3)
    refused(ValueError, ['uncovered'], uncovered='skip')
    refused(TypeError, ['method', 'compress'],
            method=type('Broken', (CompressionRule,), {'name': 'broken'})())
    refused(TypeError, ['method'], method=object())
    # a float16 warm-up (every parameter dense) of a float64 model
    float64_refused('vgc', warmup=2)
    # float16 dense group with a float64 parameter
    float64_refused('none')


CHECKS = [check_plugin_rule, check_dense_group_equals_naive,
          check_uncovered_dense, check_uncovered_on_some_ranks,
          check_warmup, check_float16_dense, check_bad_input]


def main():
    runner.run(CHECKS, 'groups')


if __name__ == '__main__':
    main()
