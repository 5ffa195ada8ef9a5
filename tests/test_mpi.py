"""Multi-rank behaviour, with real mpiexec runs (each under a timeout so a
hang fails the test instead of stalling CI)."""

import os
import subprocess

import numpy
import pytest

import conftest
from mpirun import run
from mpirun import run_ok

# multi-rank runs oversubscribe the cores: under pytest-xdist they run one
# after the other, on one worker, beside the single-process tests
pytestmark = pytest.mark.xdist_group('mpiexec')

#: the checks that share one launch per world size (tests/mpi/
#: check_suite.py): the test's name -> its script with arguments, and the
#: line that script prints when every check passed.  Separate launches
#: remain where a test needs the job to abort or fail, a thread level of
#: its own, a fresh process (resume) or a long run of its own.
SUITE = {
    'test_communicator': ('communicator', 'communicator OK at p={p}'),
    'test_nonfinite_steps_and_loss_scaling': ('nonfinite:scaling',
                                              'nonfinite OK at p={p}'),
    'test_residuals_per_name_and_snapshot_records': ('state',
                                                     'state OK at p={p}'),
    'test_rule_objects_dense_groups_and_warmup': ('groups',
                                                  'groups OK at p={p}'),
    'test_strength_against_independent_oracles': ('strength',
                                                  'strength OK at p={p}'),
    'test_double_buffering_equals_a_one_step_delayed_loop': (
        'double_buffering:oracle', 'double buffering OK at p={p}'),
    'test_dense_fallback': ('fallback', 'fallback OK at p={p}'),
    'test_dgc_and_powersgd_against_their_references': (
        'methods', 'methods OK at p={p}'),
    'test_hierarchical_exchange_equals_flat_run_of_node_workers': (
        'hierarchy:{k}', 'hierarchy OK at p={p}'),
}
_launched = {}


def _spec(item):
    """(world size, script spec) of a collected SUITE test, else None."""
    if item.module.__name__ != __name__ or item.originalname not in SUITE:
        return None
    params = item.callspec.params
    return params['p'], SUITE[item.originalname][0].format(**params)


def check_in_suite(request):
    """Runs this test's script in the one launch at its world size (made
    at the first such test, with the scripts of every selected SUITE test
    at that size, in SUITE's order) and asserts that its part printed its
    OK line; a failure in another script fails only the tests whose line
    is missing."""
    p, spec = _spec(request.node)
    if p not in _launched:
        order = list(SUITE)
        specs = sorted({(order.index(i.originalname), s[1])
                        for i, s in ((i, _spec(i))
                                     for i in request.session.items)
                        if s and s[0] == p})
        try:
            _launched[p] = run(p, 'check_suite.py', *(s for _, s in specs),
                               timeout=600)[0]
        except subprocess.TimeoutExpired as e:  # (fails each, once)
            _launched[p] = e
    proc = _launched[p]
    if isinstance(proc, subprocess.TimeoutExpired):
        pytest.fail('the launch at p={} timed out: {}'.format(p, proc))
    out = proc.stdout
    head = '== {}\n'.format(spec.replace(':', ' '))
    assert head in out, ('{} did not run: '.format(spec)
                         + out[-3000:] + proc.stderr[-3000:])
    part = out[out.index(head) + len(head):].split('\n== ')[0]
    expect = SUITE[request.node.originalname][1].format(p=p)
    assert expect in part, part[-3000:] + proc.stderr[-3000:]


def test_multi_rank_tests_run_on_the_worker_of_their_group(request):
    """Under ``--dist loadgroup`` (make test) this module's tests carry
    their xdist group in their id, so the scheduler sends them all to one
    worker (tests/conftest.py)."""
    assert 'mpiexec' in conftest.xdist_groups(request.node)
    if getattr(request.config.option, 'loadgroup', False):  # (a worker's)
        assert request.node.nodeid.endswith('@mpiexec'), request.node.nodeid


@pytest.mark.parametrize('world,sizes', [(4, [1, 2, 3, 4]),
                                         (8, [5, 6, 7, 8])])
def test_ring_and_mpi_allgatherv_match_mpi(world, sizes):
    """p = 1 ... 8 ranks, each size on a sub-communicator of one launch."""
    proc = run_ok(world, 'check_allgatherv.py', 12 if world > 4 else 25,
                  *sizes, expect='allgatherv OK')
    for p in sizes:
        assert 'cases at p={}\n'.format(p) in proc.stdout, proc.stdout


@pytest.mark.parametrize('method', ['ring', 'mpi'])
@pytest.mark.parametrize('bad', [
    lambda n: numpy.empty(n, numpy.int32),            # another dtype
    lambda n: numpy.empty(n + 1, numpy.uint32),       # another size
    lambda n: numpy.empty(2 * n, numpy.uint32)[::2],  # not contiguous
    lambda n: [0] * n])                               # not an array
def test_a_receive_buffer_of_the_wrong_kind_is_refused(method, bad):
    """allgatherv's ``into`` must give a C-contiguous 1-D uint32 host array
    of the words asked: anything else is refused, naming it, before MPI
    writes anything (one rank: MPI_COMM_SELF)."""
    from mpi4py import MPI
    from chainer_vgc.chainermn import transport
    with pytest.raises(ValueError, match='into'):
        transport.allgatherv(MPI.COMM_SELF,
                             numpy.arange(5, dtype=numpy.uint32),
                             method=method, into=bad)


@pytest.mark.stack  # (MPI's buffers on this stack's NumPy)
@pytest.mark.parametrize('p', [2, 4])
def test_communicator(request, p):
    check_in_suite(request)


@pytest.mark.parametrize('p', [2, 4])
def test_nonfinite_steps_and_loss_scaling(request, p):
    """'none' passes NaN through as naive does; compressing methods skip a
    step with a NaN/Inf on any rank collectively (residuals untouched,
    gradients NaN, vgc/skipped, no abort, ValueError in debug mode); loss
    scaling is undone before the rule (a static power-of-two scale gives
    the unscaled run exactly); float16 with dynamic loss scaling trains to
    within 0.03 of float32, with a provoked overflow skipped."""
    check_in_suite(request)


@pytest.mark.parametrize('p', [2, 4])
def test_residuals_per_name_and_snapshot_records(request, p):
    """A branch initialized mid-run starts fresh while the other residuals
    are kept; a snapshot saved on rank 0 only runs no collective and
    changes nothing; a snapshot of another method, hyperparameter, model
    or rank count is refused with an error naming both settings, unless
    resume_other_method=True (fresh residuals, a warning); rank 0's
    snapshot loaded on the other ranks is refused there, naming the
    per-rank pattern and ChainerMN's checkpointer (rank 0 itself loads
    it), and with resume_residuals='fresh' their residuals start empty
    with a warning while rank 0's come back."""
    check_in_suite(request)


def test_exception_on_one_rank_ends_the_job(tmp_path):
    """Rank 2 raises mid-run; the job ends non-zero within seconds and no
    rank runs on.  Which rank failed, and why, is read from the files the
    ranks write: MPICH may drop a rank's last stderr when the job is
    aborted (seen once, in a clean-clone CI run under load)."""
    proc, elapsed = run(4, 'check_abort.py', 2, tmp_path, timeout=60)
    out = proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.returncode != 0, out
    assert elapsed < 30, elapsed
    records = sorted(os.listdir(tmp_path))
    assert records == ['failed.2'], (records, out)
    assert (tmp_path / 'failed.2').read_text() == \
        'deliberate failure on rank 2'


@pytest.mark.parametrize('saved,resumed', [(2, 4), (4, 2)])
def test_elastic_resume_shares_what_the_saved_ranks_held(tmp_path, saved,
                                                         resumed):
    """Every rank of a run at one world size saves its own snapshot; a run
    at another loads them with resume_residuals=ElasticResume(files): each
    rank's residuals are the NumPy oracle's share of the saved ones (r
    their mean, v their variance, bit for bit) for vgc, hybrid, strom and
    none, the model and optimizer as saved, and training goes on alike on
    every rank; the default refuses the snapshot naming the option,
    'fresh' starts the residuals empty with a warning, and a missing
    saved rank is refused (tests/mpi/check_elastic.py)."""
    methods = 'vgc,hybrid,strom,none'
    run_ok(saved, 'check_elastic.py', 'save', str(tmp_path), methods,
           expect='elastic OK: save at p={}'.format(saved))
    run_ok(resumed, 'check_elastic.py', 'resume', str(tmp_path), methods,
           expect='elastic OK: resume at p={}'.format(resumed))


#: the methods of the resume test, per world size: 'topk' a rule object
#: defined in the test script, not the package; 'vgc-groups' vgc with a
#: warm-up ending after the snapshot, an excluded parameter and a min_size
#: dense group; '+db' with double buffering (the snapshot holds the mean in
#: flight); '+f16' a float16 model, updated in float32 (the snapshot holds
#: the float32 master weights, which Chainer's own serialization leaves out)
RESUMED = {2: ['vgc', 'qsgd', 'hybrid', 'topk', 'vgc-groups', 'vgc+db',
               'qsgd+db', 'hybrid+f16', 'vgc+db+f16', 'dgc', 'powersgd+db'],
           4: ['vgc', 'vgc-groups+db', 'powersgd']}


def _params(out, method, mode, rank):
    return numpy.load(os.path.join(out, method, 'params_{}_rank{}.npz'
                                   .format(mode, rank)))


@pytest.mark.parametrize('p', sorted(RESUMED))
def test_snapshot_resume_is_bit_identical(tmp_path, p):
    """Parameters and the communicator's run totals (in params_*.npz) of a
    run resumed in a new process from a snapshot at half time equal the
    uninterrupted run, for every method of RESUMED.  At p = 2 also a
    snapshot loaded and saved again at once, before any update (issue 24,
    finding 2): with double buffering the mean loaded, not yet applied, is
    saved again, so resuming from the second snapshot equals the
    uninterrupted run too.  Three launches (straight and half; resume and
    resave; resume the resaved), each running every method."""
    out, methods = str(tmp_path), RESUMED[p]
    launches = [('straight,half', 2), ('resume,resave', 2),
                ('resume-resaved', 1)] if p == 2 else \
        [('straight,half', 2), ('resume', 1)]
    for modes, runs in launches:
        run_ok(p, 'check_resume.py', modes, 20, out, ','.join(methods),
               expect='resume runs OK: {}'.format(runs * len(methods)))
    compared = 0
    for method in methods:
        for r in range(p):
            straight = _params(out, method, 'straight', r)
            half = _params(out, method, 'half', r)
            assert any((straight[k] != half[k]).any() for k in straight.files)
            for mode in ('resume', 'resume-resaved')[:1 + (p == 2)]:
                resumed = _params(out, method, mode, r)
                assert sorted(straight.files) == sorted(resumed.files)
                for k in straight.files:
                    assert (straight[k] == resumed[k]).all(), (method, mode,
                                                               r, k)
                compared += 1
    assert compared == p * len(methods) * (1 + (p == 2))


@pytest.mark.parametrize('p', [2, 4])
def test_rule_objects_dense_groups_and_warmup(request, p):
    """A rule defined outside the package trains through
    create_communicator and reports compression; exclude (names,
    predicates) and min_size send parameters through ChainerMN's naive
    allreduce, bit for bit, with both compression figures reported;
    uncovered='dense' takes a matmul-used parameter there with one warning;
    warmup=K equals 'none' for K updates, then compresses; float16 dense
    group within float16 rounding at half the bytes; bad arguments raise
    naming them."""
    check_in_suite(request)


@pytest.mark.parametrize('p', [2, 4])
def test_strength_against_independent_oracles(request, p):
    """tests/mpi/check_strength.py: vgc/bytes, the totals and the bytes
    each rank really sends against the ring algorithm and the messages;
    vgc/compression against the elements of the messages; the mean against
    the decoded messages / p; allgatherv='mpi' and chunk_words=7 equal to
    the default ring; ranks with different hyperparameters fail at the
    first step naming them, on every rank; zero_fill=False with a branch
    on some ranks only gives every rank the oracle's mean."""
    check_in_suite(request)


@pytest.mark.parametrize('p', [2, 4])
def test_double_buffering_equals_a_one_step_delayed_loop(request, p):
    """``double_buffering=True``: parameters, residuals and totals equal,
    bit for bit, a synchronous loop that applies step t-1's mean at step t
    (every rule, a dense group with a warm-up, float16 with dynamic loss
    scaling and a provoked overflow skipped coherently); figures reported
    are those of the applied exchange; a parameter set change broadcasts."""
    check_in_suite(request)


def test_double_buffering_needs_thread_multiple():
    run_ok(2, 'check_double_buffering.py', 'thread-level',
           expect='thread level refused OK', timeout=60)


def test_user_finalize_waits_for_the_exchange_in_flight():
    """The user's own ``MPI.Finalize()`` while rank 0's exchange waits in
    a collective (issue 24, finding 4): the exchange ends first and the
    job exits cleanly, instead of MPI being used after finalizing."""
    proc, _ = run(2, 'check_double_buffering.py', 'user-finalize',
                  timeout=90)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert 'finalized with an exchange in flight OK' in proc.stdout, out
    assert 'after finalizing' not in out, out[-3000:]


def test_live_communicators_stay_bounded_while_optimizers_come_and_go():
    """300 double-buffered optimizers made and dropped in one process
    (issue 24, finding 3): dropped, closed or ended by a ``with`` block,
    on one communicator or on their own; each frees its duplicate MPI
    communicator, so the slots MPI hands out stop growing (MPICH runs out
    after about 2,000 kept; tests/mpi/check_double_buffering.py)."""
    run_ok(2, 'check_double_buffering.py', 'lifecycle', 300,
           expect='lifecycle OK: 300 optimizers', timeout=240)


@pytest.mark.parametrize('mode', ['exchange-error', 'main-error',
                                  'last-exchange-error'])
def test_double_buffering_error_ends_the_job(tmp_path, mode):
    """An error on rank 2's background exchange (raised on its main
    thread at the next step, or at exit for the exchange still in flight
    when training ends) or on its main thread while an exchange is in
    flight: the whole job ends, non-zero, without a hang."""
    said = tmp_path / 'why'
    proc, elapsed = run(4, 'check_double_buffering.py', mode, 2, said,
                        timeout=90)
    assert proc.returncode != 0
    assert said.read_text() == 'deliberate failure on rank 2'
    assert 'the job went on' not in proc.stderr
    assert elapsed < 60, elapsed


@pytest.mark.parametrize('p,k', [(2, 2), (4, 2), (4, 1), (8, 4)])
def test_hierarchical_exchange_equals_flat_run_of_node_workers(request, p,
                                                               k):
    """hierarchy='node' with nodes of k emulated ranks: every rule, a dense
    group, warm-up, loss scaling, a non-finite step and background
    exchanges give, bit for bit, the flat run of p/k workers fed their
    nodes' g and s; the node's g and s equal those of one batch of kB."""
    check_in_suite(request)


@pytest.mark.parametrize('p', [2, 4])
def test_dense_fallback(request, p):
    """Steps predicted slower compressed (Sec. 5, this step's counts,
    emulated workers) are sent dense as warm-up steps: bit for bit the
    run of 'vgc' on the other steps and 'none' on these; a tiny c
    against 1024 workers is a warm-up of every step; hierarchical
    shards and the measured link agree on every rank."""
    check_in_suite(request)


@pytest.mark.parametrize('p', [2, 4])
def test_dgc_and_powersgd_against_their_references(request, p):
    """tests/mpi/check_methods.py: powersgd's mean on every rank is the
    paper's Algorithm 1 (tests/reference.py) whose allreduce is MPI's own,
    at matrix ranks 1 to 4, with its figures; dgc's is the rank-order mean
    of every rank's element-by-element reference (clipping, float16 and
    float32 values)."""
    check_in_suite(request)
