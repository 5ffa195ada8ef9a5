"""The powersgd rule (chainer_vgc/rules/powersgd.py) and the exchange by
allreduce of factors: the simulation's workers (the exchange itself over
in-process collectives) against the paper's Algorithm 1 written in
tests/reference.py, bit for bit at 2 and 4 workers; which tensors it
compresses; its figures; faults and overflows leave every state as it
was; its arguments and the controls it refuses.  The mpiexec runs are
tests/mpi/check_methods.py (tests/test_mpi.py)."""

import chainer
import chainer.functions as F
import numpy
import pytest

import reference
from chainer_vgc import GradientCompressor
from chainer_vgc import faults
from chainer_vgc import create_communicator
from chainer_vgc.harness.simulation import SimulatedWorkers
from chainer_vgc.rules import PowerSGD
from chainer_vgc.rules.powersgd import orthogonalize

# on both stacks (make test): BLAS and NumPy's sums give its bits
pytestmark = pytest.mark.stack


class Linear3(chainer.Chain):
    """Three parameters whose gradients are the batch itself: loss =
    sum(W * x) + sum(K * y) + sum(b * z), so d loss / d W = x exactly."""

    def __init__(self, dtype=numpy.float32):
        super(Linear3, self).__init__()
        with self.init_scope():
            self.W = chainer.Parameter(numpy.zeros((30, 20), dtype))
            self.K = chainer.Parameter(numpy.zeros((8, 4, 3, 3), dtype))
            self.b = chainer.Parameter(numpy.zeros(30, dtype))

    def __call__(self, x, y, z):
        return (F.sum(self.W * x) + F.sum(self.K * y)
                + F.sum(self.b * z))


def worker_grads(step, worker, dtype=numpy.float32):
    """Worker ``worker``'s gradients (W, K, b) of ``step``: low-rank
    signal plus noise, so that the factors carry something."""
    rng = numpy.random.default_rng(100 * step + worker)
    u = rng.normal(size=(30, 2)) @ rng.normal(size=(2, 20))
    return (
        (u + 0.1 * rng.normal(size=(30, 20))).astype(dtype),
        rng.normal(size=(8, 4, 3, 3)).astype(dtype),
        rng.normal(size=30).astype(dtype))


def tree_mean(parts):
    """The mean in MPI's recursive-doubling order: ((a0 + a1) + (a2 +
    a3)), then / p."""
    while len(parts) > 1:
        parts = [parts[k] + parts[k + 1] for k in range(0, len(parts), 2)]
    return parts[0]


@pytest.mark.parametrize('workers', [2, 4])
@pytest.mark.parametrize('rank', [1, 2, 3])
def test_the_simulation_equals_algorithm_1_bit_for_bit(workers, rank):
    steps = 6
    model = Linear3()
    opt = chainer.optimizers.SGD(0.01).setup(model)
    sim = SimulatedWorkers(model, opt, workers, 'powersgd',
                           matrix_rank=rank, seed=7)
    # the compressed group, in model_params order (sorted by name): K, W
    refs = [reference.PowerSGDWorker([(8, 4, 3, 3), (30, 20)], rank, 7)
            for _ in range(workers)]
    for step in range(steps):
        batches = [worker_grads(step, w) for w in range(workers)]
        sim.update(model, batches)
        if step == 0:
            continue  # (the first update broadcasts)
        k_mean, w_mean = _lockstep(refs, [[b[1], b[0]] for b in batches])
        numpy.testing.assert_array_equal(model.K.grad,
                                         k_mean.reshape(8, 4, 3, 3))
        numpy.testing.assert_array_equal(model.W.grad, w_mean)
        # b is a vector: the dense group (MPI's order, then / p)
        numpy.testing.assert_array_equal(
            model.b.grad, tree_mean([b[2] for b in batches])
            * numpy.float32(1.0 / workers))
    assert sim.totals['steps'] == steps - 1
    n, m = 30 * 20 + 8 * 36, (30 + 20) * rank + (8 + 36) * rank
    assert sim.last['vgc/compression'] == pytest.approx(
        (n + 30) / (m + 30))


def _lockstep(refs, grads):
    """The reference workers' steps together: each call of ``mean``
    returns the recursive-doubling mean of what every worker passed to
    its call of the same turn.  Returns worker 0's updates (all equal)."""
    import threading
    p = len(refs)
    slots = [None] * p
    barrier = threading.Barrier(p)
    out = [None] * p

    def run(w):
        def mean(x):
            slots[w] = x
            barrier.wait()
            got = tree_mean(list(slots)) / x.dtype.type(p)
            barrier.wait()
            return got
        out[w] = refs[w].step(grads[w], mean)
    threads = [threading.Thread(target=run, args=(w,)) for w in range(p)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for o in out[1:]:
        for a, b in zip(out[0], o):
            numpy.testing.assert_array_equal(a, b)
    return out[0]


def test_gram_schmidt_gives_orthonormal_columns_and_keeps_zero_ones():
    rng = numpy.random.default_rng(3)
    p = rng.normal(size=(50, 4))
    q = orthogonalize(p.copy())
    numpy.testing.assert_allclose(q.T @ q, numpy.eye(4), atol=1e-7)
    # each column spans what the columns before it and itself spanned
    assert numpy.linalg.matrix_rank(numpy.hstack([p[:, :2], q[:, :2]])) == 2
    z = numpy.zeros((10, 2))
    z[:, 1] = 1.0
    out = orthogonalize(z.copy())
    assert not numpy.isnan(out).any()
    assert (out[:, 0] == 0).all()
    numpy.testing.assert_allclose(out[:, 1], 1 / (numpy.sqrt(10) + 1e-8))


@pytest.mark.parametrize('shape,rank,rate,dense', [
    ((30,), 1, 2.0, True),           # a vector
    ((30, 20), 2, 2.0, False),       # 600 >= 2 * 50 * 2
    ((10, 10), 3, 2.0, True),        # 100 < 2 * 20 * 3
    ((10, 10), 3, 1.0, False),
    ((8, 4, 3, 3), 2, 2.0, False),   # 8 x 36: 288 >= 176
    ((3, 1, 1, 1), 1, 0.0, False)])
def test_which_tensors_it_keeps_dense(shape, rank, rate, dense):
    rule = PowerSGD(matrix_rank=rank, min_compression_rate=rate)
    assert rule.keeps_dense(shape) is dense


def test_the_communicator_sends_vectors_and_small_matrices_dense():
    model = Linear3()
    comm = create_communicator('powersgd', abort_on_exception=False,
                               matrix_rank=2)
    assert comm.dense_group(model) == {'/b'}
    comm = create_communicator('powersgd', abort_on_exception=False,
                               matrix_rank=4)  # K: 288 < 2 * 44 * 4
    assert comm.dense_group(model) == {'/b', '/K'}


def compressor(dtype=numpy.float32, **kw):
    return GradientCompressor(PowerSGD(**kw), ['K', 'W'],
                              [(8, 4, 3, 3), (30, 20)], [dtype, dtype])


def test_one_worker_is_the_reference_with_itself():
    comp = compressor(matrix_rank=2, seed=1)
    ref = reference.PowerSGDWorker([(8, 4, 3, 3), (30, 20)], 2, 1)
    for step in range(4):
        w, k, _ = worker_grads(step, 0)
        got = comp.reduce([k, w])
        want = ref.step([k, w], lambda x: x / x.dtype.type(1))
        numpy.testing.assert_array_equal(got[0], want[0].reshape(k.shape))
        numpy.testing.assert_array_equal(got[1], want[1])
    assert comp.last_sent == (8 + 36) * 2 + (30 + 20) * 2
    assert comp.last_sent_by_tensor == {0: 88, 1: 100}
    assert comp.last_bytes == 4 * comp.last_sent  # P and Q, float32


@pytest.mark.parametrize('warm_start', [True, False])
def test_one_worker_with_and_without_warm_start(warm_start):
    """Without warm start, step s (from 2 on) starts from the draw of
    (seed, tensor, s) instead of the last Q."""
    comp = compressor(matrix_rank=2, warm_start=warm_start, seed=5)
    ref = reference.PowerSGDWorker([(8, 4, 3, 3), (30, 20)], 2, 5,
                                   warm_start=warm_start)
    for step in range(4):
        w, k, _ = worker_grads(step, 0)
        got = comp.reduce([k, w])
        want = ref.step([k, w], lambda x: x / x.dtype.type(1))
        numpy.testing.assert_array_equal(got[1], want[1])
    assert comp.rule.steps == 4


def test_a_non_finite_gradient_or_an_overflow_changes_no_state():
    """Neither the states nor the rule's own step count move on a step
    refused before the rounds (a NaN gradient) or after them (an
    overflow); the next good step is the one that would have come."""
    comp = compressor(matrix_rank=2, warm_start=False)
    ref = compressor(matrix_rank=2, warm_start=False)
    w, k, _ = worker_grads(0, 0)
    comp.reduce([k, w])
    ref.reduce([k, w])
    before = [{key: a.copy() for key, a in st.items()} for st in comp.states]
    bad = w.copy()
    bad[3, 4] = numpy.nan
    with pytest.raises(faults.InputFault,
                       match="gradient of parameter 'W' contains NaN"):
        comp.reduce([k, bad])
    huge = numpy.full_like(w, 3e38)
    with pytest.raises(FloatingPointError,
                       match="parameter 'W' overflowed.*unchanged"):
        comp.reduce([k, huge])
    assert comp.rule.steps == 1
    for st, old in zip(comp.states, before):
        for key in old:
            numpy.testing.assert_array_equal(st[key], old[key])
    w1, k1, _ = worker_grads(1, 0)
    for a, b in zip(comp.reduce([k1, w1]), ref.reduce([k1, w1])):
        numpy.testing.assert_array_equal(a, b)


def test_its_compress_points_at_reduce():
    with pytest.raises(TypeError, match='reduce'):
        compressor().compress([None, None])


@pytest.mark.parametrize('kw,match', [
    (dict(matrix_rank=0), 'matrix_rank'),
    (dict(matrix_rank=2.5), 'matrix_rank'),
    (dict(min_compression_rate=-1), 'min_compression_rate'),
    (dict(warm_start='yes'), 'warm_start'),
    (dict(seed=-1), 'seed')])
def test_bad_arguments_name_themselves(kw, match):
    with pytest.raises(ValueError, match=match):
        PowerSGD(**kw)


def test_the_controls_it_does_not_take_say_why():
    with pytest.raises(ValueError, match='allreduce, whose traffic'):
        create_communicator('powersgd', hierarchy='node',
                            abort_on_exception=False)
    with pytest.raises(ValueError, match='dense_fallback'):
        create_communicator('powersgd', dense_fallback=True,
                            abort_on_exception=False)


def test_elastic_resume_merges_e_and_keeps_q():
    rule = PowerSGD()
    saved = [{'r': numpy.full(4, float(i), numpy.float32),
              'q': numpy.arange(6, dtype=numpy.float32)} for i in range(4)]
    out = rule.share_residuals(saved)
    numpy.testing.assert_array_equal(out['r'], numpy.full(4, 1.5))
    numpy.testing.assert_array_equal(out['q'], saved[0]['q'])
    assert out['q'] is not saved[0]['q']


def test_the_gpu_path_through_the_fake_runs_on_the_device(device):
    """CuPy gradients (tests/fake_cupy.py): the same CuPy code, its state
    and means on the device, the allreduce's buffer through the host
    (Collectives.allreduce_sum); with the fake's NumPy arithmetic, the
    CPU's bits (a real GPU's cuBLAS sums in its own order: every rank
    still gets the same mean, from the same allreduce)."""
    from mpi4py import MPI
    from chainer_vgc.chainermn.collectives import Collectives
    fake = device
    one = Collectives(MPI.COMM_SELF)  # MPI's own Allreduce, of one rank
    host, dev = compressor(matrix_rank=2), compressor(matrix_rank=2)
    for step in range(3):
        w, k, _ = worker_grads(step, 0)
        want = host.reduce([k, w], one.allreduce_sum)
        on_device = [fake.asarray(k), fake.asarray(w)]
        fake.reset()
        got = dev.reduce(on_device, one.allreduce_sum)
        # each round's buffer went through the host and back, once (the
        # first step also uploads the two drawn Qs)
        assert fake.count('download') == 2
        assert fake.count('upload') == (2 if step else 4)
        for a, b in zip(want, got):
            assert isinstance(b, fake.ndarray)
            numpy.testing.assert_array_equal(a, fake.asnumpy(b))
    assert all(isinstance(a, fake.ndarray) for st in dev.states
               for a in st.values())
