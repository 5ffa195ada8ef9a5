"""Run under mpiexec: double buffering (issue 16).

    check_double_buffering.py oracle          # prints 'double buffering OK'
    check_double_buffering.py thread-level    # MPI_THREAD_SERIALIZED: error
    check_double_buffering.py exchange-error R FILE  # rank R's 4th exchange
                                                     # fails (says so in FILE)
    check_double_buffering.py main-error R FILE      # rank R raises at step 4
    check_double_buffering.py last-exchange-error R FILE  # the exchange in
                                                     # flight at exit fails
    check_double_buffering.py user-finalize   # MPI.Finalize() by the user
                                              # with an exchange in flight
    check_double_buffering.py lifecycle N     # N optimizers made, dropped

'oracle': for every rule, a dense group with a warm-up, float16 with
dynamic loss scaling and a provoked overflow, the parameters, residuals and
run totals of ``create_multi_node_optimizer(..., double_buffering=True)``
equal, bit for bit, those of a synchronous loop written here: exchange step
t's gradients with an ordinary communicator, apply the mean of step t-1
(rescaled to the current loss scale), nothing at the first exchange.
"""

import sys

if len(sys.argv) > 1 and sys.argv[1] == 'thread-level':
    import mpi4py
    mpi4py.rc.thread_level = 'serialized'

import chainer  # NOQA: E402
import chainer.functions as F  # NOQA: E402
import chainer.links as L  # NOQA: E402
import numpy  # NOQA: E402
from mpi4py import MPI  # NOQA: E402

import chainer_vgc  # NOQA: E402

world = MPI.COMM_WORLD

CASES = [
    ('vgc', dict(alpha=1.0), {}),
    ('hybrid', dict(tau=0.001, alpha=1.0), {}),
    ('strom', dict(tau=0.001), {}),
    ('qsgd', dict(seed=1), {}),
    ('none', {}, {}),
    ('vgc', dict(alpha=1.0, warmup=3, min_size=10,
                 exclude=['/predictor/0/W']), {}),
    ('vgc', dict(alpha=2.0, alpha_ramp=(1.0, 6)), {}),
    ('vgc', dict(alpha=1.0, uncovered='dense'), dict(matmul=True)),
    ('vgc', dict(alpha=1.5), dict(dtype=numpy.float16, scaling=True)),
    ('hybrid', dict(tau=0.001), dict(dtype=numpy.float16, scaling=True)),
]
STEPS = 12
OVERFLOW_STEP = 5


class MatmulLast(chainer.Link):
    """A weight used through F.matmul: no per-sample statistics, so
    uncovered='dense' sends it densely."""

    def __init__(self, n):
        super(MatmulLast, self).__init__()
        with self.init_scope():
            self.W = chainer.Parameter(numpy.eye(n, dtype=chainer.config.dtype))

    def forward(self, x):
        return F.matmul(x, self.W)


def make(dtype, matmul=False):
    """matmul=True: a MatmulLast link last."""
    numpy.random.seed(0)
    with chainer.using_config('dtype', dtype):
        layers = [L.Linear(6, 32), F.relu, L.Linear(32, 3)]
        if matmul:
            layers.append(MatmulLast(3))
        model = L.Classifier(chainer.Sequential(*layers))
        model(numpy.zeros((1, 6), dtype), numpy.zeros(1, numpy.int32))
    return model


def data(step, dtype):
    rng = numpy.random.default_rng(1000 * step + world.rank)
    x = rng.normal(size=(16, 6))
    t = (x[:, 0] + x[:, 1] > 0).astype(numpy.int32) + (x[:, 2] > 1)
    if step == OVERFLOW_STEP and dtype == numpy.float16:
        x = x * 300  # gradients overflow float16 at the scale 2**14
    return x.astype(dtype), t.astype(numpy.int32)


def setup(inner, model, dtype, scaling):
    if dtype == numpy.float16:
        inner.use_fp32_update()
    if scaling:
        inner.loss_scaling(interval=2, scale=None)
        inner._loss_scale = 2.0 ** 14


def params(model):
    return [p for _, p in sorted(model.namedparams())]


def run_double_buffered(method, kw, dtype=numpy.float32, scaling=False,
                        matmul=False):
    comm = chainer_vgc.create_communicator(method, world, **kw)
    model = make(dtype, matmul)
    inner = chainer.optimizers.Adam(alpha=0.01)
    opt = chainer_vgc.create_multi_node_optimizer(
        inner, comm, double_buffering=True).setup(model)
    setup(inner, model, dtype, scaling)
    scales = []
    for step in range(STEPS):
        opt.update(model, *data(step, dtype))
        scales.append(inner._loss_scale)
    opt.wait()
    return model, comm, scales


def run_oracle(method, kw, dtype=numpy.float32, scaling=False, matmul=False,
               figures=None):
    """``figures``: a list that gets each exchange's reported figures."""
    comm = chainer_vgc.create_communicator(method, world, **kw)
    model = make(dtype, matmul)
    inner = chainer.optimizers.Adam(alpha=0.01)
    inner.setup(model)
    setup(inner, model, dtype, scaling)
    pending = None  # (mean of the last step, its loss scale, skipped)
    scales = []
    for step in range(STEPS):
        x, t = data(step, dtype)
        scale = inner._loss_scale
        model.cleargrads()
        loss = model(x, t)
        if step == 0:  # the broadcast: every rank has rank 0's params
            scales.append(scale)
            continue
        sq = None
        if comm.state(model).needs_sqsum:
            sq = comm.statistics(model).backward(loss, batch=(x, t),
                                                 loss_scale=scale)
        else:
            loss.backward(loss_scale=scale)
        comm.exchange(model, True, sqsums=sq, loss_scale=scale)
        if figures is not None:
            figures.append({k: v for k, v in comm.state(model).last.items()
                            if not k.startswith('_')})
        mean = [None if p.grad is None else p.grad.copy()
                for p in params(model)]
        now = (mean, scale, comm.state(model).skipped)
        if pending is not None:
            grads, then, skipped = pending
            for p, g in zip(params(model), grads):
                p.grad = g
            if not skipped or inner._loss_scaling_is_dynamic:
                for p in params(model):  # Chainer divides by the scale
                    p._loss_scale = then  # the mean was made at
                inner.update()
        pending = now
        scales.append(inner._loss_scale)
    return model, comm, scales


def check_against_oracle(method, kw, settings):
    a, comm_a, scales_a = run_double_buffered(method, kw, **settings)
    b, comm_b, scales_b = run_oracle(method, kw, **settings)
    assert scales_a == scales_b, (scales_a, scales_b)
    for (n, p), (_, q) in zip(sorted(a.namedparams()),
                              sorted(b.namedparams())):
        assert numpy.array_equal(p.array, q.array), (method, kw, n)
    st_a, st_b = comm_a.state(a), comm_b.state(b)
    for sa, sb in zip(st_a.compressor.states, st_b.compressor.states):
        for key in sa or {}:
            assert numpy.array_equal(sa[key], sb[key]), (method, key)
    assert st_a.totals == st_b.totals, (st_a.totals, st_b.totals)
    if settings.get('scaling'):
        assert st_a.totals['skipped'] >= 1, 'no overflow was provoked'
    if settings.get('matmul'):
        weight = a.predictor[-1].W
        assert comm_a.dense_group(a) == {n for n, p in a.namedparams()
                                         if p is weight}
    # the parameters moved: the check is not of an idle run
    assert not numpy.array_equal(params(a)[0].array, params(make(
        settings.get('dtype', numpy.float32)))[0].array)
    if world.rank == 0:
        print('{} {} {}: {} exchanges, {} skipped, identical'.format(
            method, kw, settings.get('dtype', numpy.float32).__name__,
            int(st_a.totals['steps']), int(st_a.totals['skipped'])),
            flush=True)


def check_reports():
    """The figures reported at update t are those of step t-1's exchange
    (the one whose mean the update applies), as the synchronous loop
    computes them, without the private running-total keys."""
    comm = chainer_vgc.create_communicator('vgc', world, alpha=1.0)
    model = make(numpy.float32)
    opt = chainer_vgc.create_multi_node_optimizer(
        chainer.optimizers.Adam(alpha=0.01), comm, double_buffering=True)
    opt.setup(model)
    reporter = chainer.reporter.Reporter()
    reporter.add_observer('main', model)
    seen = []
    for step in range(STEPS):
        obs = {}
        with reporter.scope(obs):
            opt.update(model, *data(step, numpy.float32))
        seen.append({k: v for k, v in obs.items()  # all but the model's
                     if not k.startswith('main/')})
    opt.wait()
    expected = []
    run_oracle('vgc', dict(alpha=1.0), figures=expected)
    # update 0 broadcasts, update 1 starts the first exchange: update t
    # (t >= 2) reports exchange t - 2 of the loop's (its step t - 1)
    assert seen[:2] == [{}, {}], seen[:2]
    assert seen[2:] == expected[:STEPS - 2], (seen, expected)
    assert len({f['vgc/compression'] for f in expected}) > 2  # they vary


class Branchy(chainer.Chain):
    """A layer reached only from step 4 on (its parameters uninitialized
    before, lazily initialized then with this rank's random draw)."""

    def __init__(self):
        super(Branchy, self).__init__()
        self.late = False
        with self.init_scope():
            self.a = L.Linear(6, 8)
            self.b = L.Linear(8, 3)
            self.extra = L.Linear(None, 3)

    def forward(self, x):
        h = self.b(F.relu(self.a(x)))
        return h + self.extra(x) if self.late else h


def check_parameter_set_change():
    """A parameter initialized mid-run: the exchange in flight completes
    and is dropped, rank 0's parameters are broadcast, as without double
    buffering."""
    comm = chainer_vgc.create_communicator('vgc', world, alpha=1.0)
    numpy.random.seed(0)
    model = L.Classifier(Branchy())
    opt = chainer_vgc.create_multi_node_optimizer(
        chainer.optimizers.SGD(0.1), comm, double_buffering=True)
    opt.setup(model)
    for step in range(4):
        opt.update(model, *data(step, numpy.float32))
    numpy.random.seed(100 + world.rank)  # ranks draw different weights
    model.predictor.late = True
    for step in range(4, 8):
        opt.update(model, *data(step, numpy.float32))
    opt.wait()
    for _, p in sorted(model.namedparams()):
        every = world.allgather(p.array)
        assert all(numpy.array_equal(every[0], w) for w in every)
    comp = comm.state(model).compressor
    assert comp is not None and any(n.endswith('extra/W')
                                    for n in comp.names)


def check_user_finalize():
    """The user's own ``MPI.Finalize()`` while an exchange is in flight
    (issue 24, finding 4): rank 0's exchange waits in a collective for the
    other ranks, which come 0.5 s later; the finalization lets it end
    first, and every process exits cleanly.  No exchange thread may still
    be running once ``MPI_Finalize`` itself starts (MPICH turns its locks
    off before its first callback; a thread inside a collective then can
    leave a mutex held, and the finalization aborts, about one run in
    twenty): a ``MPI_COMM_SELF`` attribute set after chainer_vgc's own
    records what runs when its delete callback, one of the first steps of
    ``MPI_Finalize``, is called."""
    import threading
    import time
    comm = chainer_vgc.create_communicator('vgc', world, alpha=1.0)
    model = make(numpy.float32)
    opt = chainer_vgc.create_multi_node_optimizer(
        chainer.optimizers.SGD(), comm, double_buffering=True).setup(model)
    for step in range(2):
        opt.update(model, *data(step, numpy.float32))
    seen = []

    def at_finalize(comm_, keyval, value):
        seen.append(sum(t.name == 'chainer_vgc exchange'
                        for t in threading.enumerate()))
        return MPI.SUCCESS
    MPI.COMM_SELF.Set_attr(MPI.Comm.Create_keyval(delete_fn=at_finalize), 1)
    rank = world.rank
    if rank == 0:
        assert opt._handle is not None
    else:
        time.sleep(0.5)
    opt.update(model, *data(2, numpy.float32))
    if rank == 0:
        # still in flight: the other ranks have not started theirs
        assert not opt._handle.done()
    MPI.Finalize()
    assert MPI.Is_finalized()
    assert seen == [0], ('exchange threads running when MPI_Finalize '
                         'began: %s' % seen)
    if rank == 0:
        print('finalized with an exchange in flight OK', flush=True)


def _probe_handle():
    """The handle MPI gives a new communicator now (freed at once): MPI
    reuses the slots of freed communicators, so while none leak the probes
    stay among the handles seen before; each leaked one takes a new slot."""
    probe = world.Dup()
    handle = probe.py2f()
    probe.Free()
    return handle


def check_lifecycle(n):
    """``n`` double-buffered optimizers made and dropped in one process
    (issue 24, finding 3), each after a background exchange (its
    duplicate MPI communicator exists): dropped, closed, or ended by a
    ``with`` block, on one communicator or on a communicator of their own
    (the communicator's own duplicate, of ``exchange_async(...,
    background=True)``, goes with it).  The live MPI communicators stay
    bounded: after the first tenth, a probe communicator made after each
    garbage collection takes no slot the first tenth did not use (each
    cycle leaking a duplicate would take ``n`` new ones; MPICH runs out
    after about 2,000)."""
    import gc
    # (Strom's rule and no backward: zero gradients, zero_fill; what is
    # checked is the duplicates' life, not the means)
    shared = chainer_vgc.create_communicator('strom', world, tau=0.01)
    model = make(numpy.float32)
    first, later = set(), []
    for i in range(n):
        own, how = i % 2, (i // 2) % 3  # (half on communicators of their own)
        comm = shared if not own else chainer_vgc.create_communicator(
            'strom', world, tau=0.01, abort_on_exception=False)
        opt = chainer_vgc.create_multi_node_optimizer(
            chainer.optimizers.SGD(), comm, double_buffering=True)
        opt.setup(model)
        if how == 2:
            with opt:
                for step in range(2):
                    opt.update()
        else:
            for step in range(2):
                opt.update()
            opt.wait()
            if how == 1:
                opt.close()
            elif own:  # and the communicator's own duplicate
                comm.exchange_async(model, True, background=True).wait()
        del opt, comm
        if i % 6 == 5:  # (every way, own and shared, once)
            gc.collect()
            if i < n // 10:
                first.add(_probe_handle())
            else:
                later.append(_probe_handle())
    new = set(later) - first
    assert first and len(later) >= 10, (first, later)
    assert len(new) <= 1, ('live MPI communicators grow: {} new slots in '
                           '{} probes after the first {} optimizers'.format(
                               len(new), len(later), n // 10))
    if world.rank == 0:
        print('lifecycle OK: {} optimizers'.format(n))


def main():
    mode = sys.argv[1]
    if mode == 'thread-level':
        comm = chainer_vgc.create_communicator('vgc', world)
        try:
            chainer_vgc.create_multi_node_optimizer(
                chainer.optimizers.SGD(), comm, double_buffering=True)
        except ValueError as e:
            text = str(e)
            assert 'MPI_THREAD_MULTIPLE' in text, text
            assert 'MPI_THREAD_SERIALIZED' in text, text
        else:
            raise AssertionError('no error at MPI_THREAD_SERIALIZED')
        if world.rank == 0:
            print('thread level refused OK')
        return
    if mode in ('exchange-error', 'main-error', 'last-exchange-error'):
        bad = int(sys.argv[2])
        comm = chainer_vgc.create_communicator('vgc', world)
        model = make(numpy.float32)
        opt = chainer_vgc.create_multi_node_optimizer(
            chainer.optimizers.SGD(), comm, double_buffering=True)
        opt.setup(model)
        why = 'deliberate failure on rank {}'.format(bad)

        def say():  # (mpiexec may cut stderr short when the abort kills)
            print(why, file=sys.stderr, flush=True)
            with open(sys.argv[3], 'w') as f:
                f.write(why)
        last = mode == 'last-exchange-error'
        if mode != 'main-error' and world.rank == bad:
            from chainer_vgc.exchange import run as exchange_run
            real, calls = exchange_run.run_exchange, []

            def failing(*args, **kwds):
                calls.append(1)
                if len(calls) == (6 if last else 4):
                    say()
                    raise RuntimeError(why)
                return real(*args, **kwds)
            exchange_run.run_exchange = failing
        if last:  # 7 updates: exchanges 1..6, the 6th in flight at exit
            for step in range(7):
                opt.update(model, *data(step, numpy.float32))
            return
        for step in range(1000):
            if mode == 'main-error' and world.rank == bad and step == 4:
                say()
                raise RuntimeError(why)
            opt.update(model, *data(step % 7, numpy.float32))
        raise AssertionError('the job went on')
    if mode == 'user-finalize':
        return check_user_finalize()
    if mode == 'lifecycle':
        return check_lifecycle(int(sys.argv[2]))
    assert mode == 'oracle', mode
    for method, kw, settings in CASES:
        check_against_oracle(method, kw, settings)
    check_reports()
    check_parameter_set_change()
    world.Barrier()
    if world.rank == 0:
        print('double buffering OK at p={}'.format(world.size))


if __name__ == '__main__':
    main()
