"""Run under mpiexec: non-finite gradients and loss scaling (issue 10).

Prints 'nonfinite OK at p=P'."""

import sys

import chainer
import chainer.functions as F
import chainer.links as L
import chainermn
import numpy
from mpi4py import MPI

import chainer_vgc
from chainer_vgc.statistics import model_params

world = MPI.COMM_WORLD


def make(seed=0, dtype=numpy.float32, sizes=(6, 32, 3)):
    """A classifier MLP of ``sizes`` (in, hidden, out) in ``dtype``."""
    n_in, hidden, n_out = sizes
    numpy.random.seed(seed)
    with chainer.using_config('dtype', dtype):
        model = L.Classifier(chainer.Sequential(
            L.Linear(n_in, hidden), F.relu, L.Linear(hidden, n_out)))
        model(numpy.zeros((1, n_in), dtype), numpy.zeros(1, numpy.int32))
    return model


def data(step, n=16, dtype=numpy.float32, seed=0):
    rng = numpy.random.default_rng(100000 * seed + 1000 * step + world.rank)
    x = rng.normal(size=(n, 6))
    t = (x[:, 0] + x[:, 1] > 0).astype(numpy.int32) + (x[:, 2] > 1)
    return x.astype(dtype), t.astype(numpy.int32)


def states(comm, model):
    return [{k: a.copy() for k, a in (st or {}).items()}
            for st in comm.state(model).compressor.states]


def grads_after_exchange(comm, model, nan_rank, step):
    """One backward on this rank's batch, a NaN planted on ``nan_rank``,
    then the communicator's exchange; returns the gradients."""
    x, t = data(step)
    model.cleargrads()
    stats = getattr(comm, 'statistics', None)
    loss = model(x, t)
    if stats is not None and comm.state(model).needs_sqsum:
        comm.set_sqsums(stats(model).backward(loss, batch=(x, t)))
    else:
        loss.backward()
    if world.rank == nan_rank:
        model.predictor[0].W.grad[1, 2] = numpy.nan
    comm.multi_node_mean_grad(model, True)
    return [None if p.grad is None else p.grad.copy()
            for p in model.params()]


def expect_diverged_in_debug_mode(comm, model):
    """With chainer.set_debug(True) a NaN gradient raises ValueError."""
    chainer.set_debug(True)
    try:
        grads_after_exchange(comm, model, 0, 20)
    except ValueError as e:
        assert 'diverged' in str(e)
    else:
        raise AssertionError('no ValueError in debug mode')
    finally:
        chainer.set_debug(False)


def check_none_passes_nonfinite_like_naive():
    naive = chainermn.create_communicator('naive', world)
    ours = chainer_vgc.create_communicator('none', world,
                                           abort_on_exception=False)
    a = grads_after_exchange(naive, make(), 0, 1)
    b = grads_after_exchange(ours, make(), 0, 1)
    for x, y in zip(a, b):
        assert numpy.array_equal(x, y, equal_nan=True)
    assert numpy.isnan(b[0]).any()  # the NaN went through, as with naive
    for comm in (naive, ours):  # then both raise ChainerMN's ValueError
        expect_diverged_in_debug_mode(comm, make())


def check_compressed_step_is_skipped_collectively(method, kw):
    comm = chainer_vgc.create_communicator(method, world,
                                           abort_on_exception=False, **kw)
    model = make()
    opt = chainer_vgc.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(0.1), comm).setup(model)
    for step in range(4):
        x, t = data(step)
        opt.update(model, x, t)
    before = states(comm, model)
    params = [p.array.copy() for p in model.params()]
    reporter = chainer.reporter.Reporter()
    reporter.add_observer('main', model)
    obs = {}
    with reporter.scope(obs):
        grads = grads_after_exchange(comm, model, world.size - 1, 9)
    # every rank: skipped, residuals untouched, gradients NaN, reported
    st = comm.state(model)
    assert st.skipped and obs['vgc/skipped'] == 1.0
    assert all(numpy.isnan(g).all() for g in grads)
    for a, b in zip(before, states(comm, model)):
        for key in a:
            assert numpy.array_equal(a[key], b[key]), key
    # through the optimizer: no update without a loss scaler, no abort
    x, t = data(10)
    model.cleargrads()
    loss = model(x, t)
    sq = comm.statistics(model).backward(loss, batch=(x, t)) \
        if st.needs_sqsum else None
    if sq is None:
        loss.backward()
    comm.set_sqsums(sq)
    if world.rank == 0:  # the last parameter the method compresses
        name = [n for n, _ in sorted(model.namedparams())
                if n not in comm.dense_group(model)][-1]
        dict(model.namedparams())[name].grad.reshape(-1)[0] = numpy.inf
    comm.multi_node_mean_grad(model, True)
    assert st.skipped
    assert st.totals['skipped'] == 2
    # training goes on
    for step in range(11, 14):
        x, t = data(step)
        opt.update(model, x, t)
    assert not st.skipped
    for p, old in zip(model.params(), params):
        assert numpy.isfinite(p.array).all()
        assert not numpy.array_equal(p.array, old)  # it did train after
    # debug mode: a ValueError on every rank, as ChainerMN's
    expect_diverged_in_debug_mode(comm, model)


def check_optimizer_keeps_params_on_a_bad_step():
    comm = chainer_vgc.create_communicator('vgc', world,
                                           abort_on_exception=False)
    model = make()
    opt = chainer_vgc.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(0.1), comm).setup(model)
    for step in range(3):
        opt.update(model, *data(step))
    kept = [p.array.copy() for p in model.params()]

    def lossfun(x, t):
        loss = model(x, t)
        if world.rank == 1 % world.size:
            loss = loss * numpy.float32(numpy.inf)
        return loss
    opt.update(lossfun, *data(5))
    assert comm.state(model).skipped
    for p, old in zip(model.params(), kept):
        assert numpy.array_equal(p.array, old)


def train_scaled(method, dtype, dynamic, steps=60, seed=0, **kw):
    """Train with dynamic (True), static (False) or no (None) loss scaling;
    returns (accuracy on held-out data, skipped exchanges, the scale after
    each step, the model's method state)."""
    comm = chainer_vgc.create_communicator(method, world,
                                           abort_on_exception=False, **kw)
    model = make(seed, dtype)
    inner = chainer.optimizers.Adam(alpha=0.01)
    opt = chainer_vgc.create_multi_node_optimizer(inner, comm).setup(model)
    if dtype == numpy.float16:
        inner.use_fp32_update()  # float32 master weights, as usual
    if dynamic:
        # start near float16's limit so that an overflow is provoked
        inner.loss_scaling(interval=2, scale=None)
        inner._loss_scale = 2.0 ** 14
    elif dynamic is not None:
        inner.loss_scaling(scale=128.0)
    scales = []
    for step in range(steps):
        x, t = data(step, 32, dtype, seed)
        if dynamic and step == 5:
            x = x * dtype(300)  # gradients overflow float16 at this scale
        opt.update(model, x, t)
        scales.append(inner._loss_scale)
    x, t = data(10 ** 6, 2000, dtype, seed)
    with chainer.using_config('train', False):
        acc = float(F.accuracy(model.predictor(x), t).array)
    st = comm.state(model)
    return acc, st.totals['skipped'], scales, st


def check_loss_scaling(method, kw):
    ref, _, _, _ = train_scaled(method, numpy.float32, None, **kw)
    # static S = 128, a power of two: g / S, s / S**2 and the mean * S are
    # exact, so the run is the unscaled one (tau, residuals in gradient
    # units)
    static, skipped, _, _ = train_scaled(method, numpy.float32, False,
                                         **kw)
    assert skipped == 0 and static == ref, (static, ref)
    half, skipped, scales, st = train_scaled(method, numpy.float16, True,
                                             **kw)
    assert skipped >= 1, 'no overflow was provoked'
    # the scaler saw the NaN gradients and halved the scale
    assert any(b == a / 2 for a, b in zip(scales, scales[1:])), scales
    scale = scales[-1]
    assert abs(half - ref) < 0.03, (half, ref)
    for each in st.compressor.states:
        for a in (each or {}).values():
            assert numpy.isfinite(a).all()
    if world.rank == 0:
        print('{} {}: float32 {:.3f}, float16 dynamic {:.3f} ({} skipped, '
              'final scale {:g})'.format(method, kw, ref, half, int(skipped),
                                         scale))


def check_unscaled_residuals():
    """With a static scale S the residual equals the unscaled run's."""
    results = []
    for scale in (None, 256.0):
        comm = chainer_vgc.create_communicator(
            'hybrid', world, abort_on_exception=False, tau=0.01)
        model = make()
        inner = chainer.optimizers.SGD(0.1)
        opt = chainer_vgc.create_multi_node_optimizer(inner,
                                                      comm).setup(model)
        if scale:
            inner.loss_scaling(scale=scale)
        for step in range(6):
            opt.update(model, *data(step))
        results.append((states(comm, model), [p.array.copy()
                                              for p in model.params()]))
    (s0, p0), (s1, p1) = results
    for a, b in zip(s0, s1):
        for key in a:  # S = 256 is a power of two: exact
            assert numpy.array_equal(a[key], b[key]), key
    for a, b in zip(p0, p1):
        assert numpy.allclose(a, b, rtol=1e-6, atol=1e-7)


def main():
    check_none_passes_nonfinite_like_naive()
    for method, kw in [('vgc', dict(alpha=1.5)),
                       ('hybrid', dict(tau=0.001)),
                       ('strom', dict(tau=0.001)), ('qsgd', dict(seed=1)),
                       # (top-k under the test's momentum SGD)
                       ('dgc', dict(density=0.1, momentum_factor=0.0)),
                       ('powersgd', dict(matrix_rank=1))]:
        check_compressed_step_is_skipped_collectively(method, kw)
    check_optimizer_keeps_params_on_a_bad_step()
    check_unscaled_residuals()
    if len(sys.argv) > 1 and sys.argv[1] == 'scaling':
        for method, kw in [('vgc', dict(alpha=1.5)),
                           ('hybrid', dict(tau=0.001))]:
            check_loss_scaling(method, kw)
    world.Barrier()
    if world.rank == 0:
        print('nonfinite OK at p={}'.format(world.size))


if __name__ == '__main__':
    main()
