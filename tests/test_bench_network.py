"""The emulated-network benchmark's set-up and clean-up logic, without root
(dry run and a fake command runner)."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))

import bench_network  # NOQA: E402

# multi-rank runs oversubscribe the cores: under pytest-xdist they run one
# after the other, on one worker, beside the single-process tests
pytestmark = pytest.mark.xdist_group('mpiexec')


def test_plan_builds_isolated_hosts_shaped_links_and_mpmd_launch():
    plan = bench_network.Plan(4, tag=123)
    setup = [' '.join(c) for c in plan.setup()]
    assert setup[0] == 'ip netns add vgcb123_sw'
    for i in range(4):
        assert 'ip netns add vgcb123_{}'.format(i) in setup
        assert ('ip link add vh{0} netns vgcb123_sw type veth peer name vb{0} '
                'netns vgcb123_{0}'.format(i)) in setup
        assert ('ip netns exec vgcb123_{0} ip addr add 10.77.0.{1}/24 dev '
                'vb{0}'.format(i, i + 1)) in setup
    shape = [' '.join(c) for c in plan.shape('1gbit')]
    assert len(shape) == 8  # both ends of 4 links
    assert all('tbf rate 1gbit' in c for c in shape)
    teardown = [' '.join(c) for c in plan.teardown()]
    created = [c.split()[-1] for c in setup if c.startswith('ip netns add')]
    assert sorted(c.split()[-1] for c in teardown) == sorted(created)
    cmd = plan.mpiexec('mpiexec', 'python', ['--method', 'vgc'])
    assert cmd.count(':') == 3
    for i in range(4):
        k = cmd.index('vb{}'.format(i))
        assert cmd[k - 2:k] == ['-env', 'FI_TCP_IFACE']
    text = ' '.join(cmd)
    for k, v in bench_network.MPI_ENV.items():
        assert text.count('-env {} {}'.format(k, v)) == 4
    assert text.count('ip netns exec vgcb123_') == 4


class FailingRunner(object):
    def __init__(self, fail_at):
        self.fail_at, self.calls = fail_at, []

    def __call__(self, cmd, check=True, timeout=60, capture=False):
        self.calls.append(' '.join(cmd))
        if len(self.calls) == self.fail_at and check:
            raise RuntimeError('boom')
        return ''


@pytest.mark.parametrize('fail_at', [1, 2, 9, 20])
def test_failed_setup_tears_down_everything(fail_at):
    plan = bench_network.Plan(3, tag=7)
    run = FailingRunner(fail_at)
    with pytest.raises(RuntimeError, match='boom'):
        bench_network.build(plan, run)
    deleted = [c for c in run.calls if c.startswith('ip netns del')]
    assert sorted(deleted) == sorted(' '.join(c) for c in plan.teardown())


def test_teardown_runs_once():
    plan = bench_network.Plan(2, tag=8)
    run = FailingRunner(fail_at=-1)
    teardown = bench_network.build(plan, run)
    teardown()
    teardown()
    assert sum(c.startswith('ip netns del') for c in run.calls) == 3


def test_stale_namespaces_of_dead_runs_are_removed():
    calls = []

    def run(cmd, check=True, timeout=60, capture=False):
        calls.append(' '.join(cmd))
        if cmd[:3] == ['ip', 'netns', 'list']:
            return ('vgcb{0}_0 (id: 3)\nvgcb999999999_1\nother\n'
                    .format(os.getpid()))
        return ''
    bench_network.remove_stale(run)
    assert calls[1:] == ['ip netns del vgcb999999999_1']


def test_dry_run_prints_setup_launch_and_teardown():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, 'benchmarks', 'bench_network.py'),
         '--dry-run', '--workers', '2', '--rates', '1gbit,10gbit',
         '--methods', 'naive,vgc'], capture_output=True, text=True,
        timeout=120, check=True).stdout
    lines = out.splitlines()
    assert sum('mpiexec' in ln for ln in lines) == 4  # 2 rates x 2 methods
    assert sum('tbf rate 10gbit' in ln for ln in lines) == 4
    assert lines[-1].startswith('$ ip netns del')
    assert sum(ln.startswith('$ ip netns del') for ln in lines) == 3


@pytest.mark.parametrize('method', ['naive', 'vgc', 'vgc+db', 'vgc+spare',
                                    'dgc', 'powersgd'])
def test_network_step_times_the_exchange(method):
    """network_step.py (one rank per emulated host) on loopback, 2 ranks,
    a small MLP: the exchange it times is the one the optimizer calls
    (chainer_vgc's optimizer calls comm.exchange, not
    multi_node_mean_grad: timing the latter reported nan)."""
    import json
    mpiexec = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    name, _, suffix = method.partition('+')
    db = suffix == 'db'
    cmd = [mpiexec, '-n', '2', sys.executable,
           os.path.join(ROOT, 'benchmarks', 'network_step.py'),
           '--method', name, '--units', '64', '--data', 'synthetic',
           '--steps', '3', '--warmup', '2'] + (
               ['--double-buffering'] if db else []) + (
               ['--spare-residuals'] if suffix == 'spare' else [])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith('RESULT ')]
    res = json.loads(lines[-1][len('RESULT '):])
    assert res['method'] == method
    if db:  # timed on the background thread: may outlast the step
        assert 0 < res['exchange_s'] and 0 < res['step_s']
        assert res['compression'] > 1
    else:
        assert 0 < res['exchange_s'] < res['step_s']
    if method != 'naive':
        phases = res['phases_s']
        assert set(phases) == {'compress', 'agree', 'transport', 'decode',
                               'agree_spread', 'agree_itself'}
        # each phase of the slowest rank within the exchange it is part of
        assert all(0 <= t for t in phases.values())
        if not db:
            assert max(phases.values()) <= res['exchange_s'] * 1.5 + 0.01


def test_agreement_split_by_hand():
    """Two ranks, two steps of two agreements each: the spread is the
    last arrival minus the first, the agreement itself the last departure
    minus the last arrival, each summed over a step's agreements, then the
    median over the steps."""
    sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
    import network_step
    rank0 = [[(1.0, 3.0), (4.0, 4.2)], [(10.0, 10.5), (11.0, 11.1)]]
    rank1 = [[(2.5, 3.1), (4.1, 4.25)], [(10.2, 10.4), (11.05, 11.3)]]
    got = network_step.agreement_split([rank0, rank1])
    # step 0: spread 1.5 + 0.1, itself 0.6 + 0.15;
    # step 1: spread 0.2 + 0.05, itself 0.3 + 0.25
    assert got['agree_spread'] == pytest.approx((1.6 + 0.25) / 2)
    assert got['agree_itself'] == pytest.approx((0.75 + 0.55) / 2)
    assert network_step.agreement_split([[], []]) == {}


def test_overlap_report_pairs_each_double_buffered_run_with_its_base(
        capsys):
    """step(+db) / max(step - exchange, exchange) of the same method and
    rate without double buffering."""
    results = [
        dict(rate='1gbit', method='vgc', step_s=0.25, exchange_s=0.10),
        dict(rate='1gbit', method='vgc+db', step_s=0.18, exchange_s=0.11),
        dict(rate='10gbit', method='vgc+db', step_s=0.1, exchange_s=0.1),
        dict(rate='1gbit', method='hybrid', step_s=0.2, exchange_s=0.15),
        dict(rate='1gbit', method='hybrid+db', step_s=0.3, exchange_s=0.15)]
    bench_network.overlap_report(results)
    rows = [ln for ln in capsys.readouterr().out.splitlines()
            if ln.startswith('| 1gbit')]
    # vgc: compute 0.15 > exchange 0.10: 0.18 / 0.15 = 1.20, 0.25 / 0.18
    assert rows[0] == ('| 1gbit | vgc | 0.250 | 0.150 | 0.100 | 0.180 | '
                       '1.20 | 1.39x |')
    # hybrid: exchange 0.15 > compute 0.05: 0.3 / 0.15 = 2.00
    assert rows[1] == ('| 1gbit | hybrid | 0.200 | 0.050 | 0.150 | 0.300 | '
                       '2.00 | 0.67x |')
    assert len(rows) == 2  # the 10gbit +db run has no base: not shown


# -- nodes (issue 27) --------------------------------------------------------
def test_node_plan_shares_a_namespace_link_and_host_name_per_node():
    """--nodes 2 --ranks-per-node 2: two host namespaces, one shaped veth
    each; hydra gets one host per node (MPICH's node map), each node's
    ranks run under its UTS host name on its interface, and MPICH may use
    shared memory inside a node (no MPIR_CVAR_NOLOCAL)."""
    plan = bench_network.Plan(4, tag=5, ranks_per_node=2)
    setup = [' '.join(c) for c in plan.setup()]
    assert [c for c in setup if c.startswith('ip netns add')] == [
        'ip netns add vgcb5_sw', 'ip netns add vgcb5_0',
        'ip netns add vgcb5_1']
    assert sum(' type veth ' in c for c in setup) == 2
    for n in range(2):
        assert ('ip netns exec vgcb5_{0} ip addr add 10.77.0.{1}/24 dev '
                'vb{0}'.format(n, n + 1)) in setup
    shape = [' '.join(c) for c in plan.shape('1gbit')]
    assert len(shape) == 4  # both ends of 2 links
    assert sorted(c.split()[-1] for c in
                  (' '.join(c) for c in plan.teardown())) == [
        'vgcb5_0', 'vgcb5_1', 'vgcb5_sw']
    cmd = plan.mpiexec('mpiexec', 'python', ['--method', 'vgc'])
    assert cmd[:5] == ['mpiexec', '-launcher', 'fork', '-hosts',
                       'node0:2,node1:2']
    segments, cur = [], []
    for word in cmd[5:]:
        if word == ':':
            segments.append(cur)
            cur = []
        else:
            cur.append(word)
    segments.append(cur)
    assert len(segments) == 2
    for n, seg in enumerate(segments):
        assert seg[:2] == ['-n', '2']
        env = {seg[i + 1]: seg[i + 2] for i, w in enumerate(seg)
               if w == '-env'}
        assert env == dict(bench_network.NODE_MPI_ENV,
                           FI_TCP_IFACE='vb{}'.format(n),
                           OPENBLAS_NUM_THREADS='1')
        assert 'MPIR_CVAR_NOLOCAL' not in env
        k = seg.index('ip')
        assert seg[k:k + 10] == [
            'ip', 'netns', 'exec', 'vgcb5_{}'.format(n), 'unshare',
            '--uts', 'sh', '-c', 'hostname "$0" && exec "$@"',
            'node{}'.format(n)]
        assert seg[k + 10] == 'python'
        assert seg[k + 11].endswith('network_step.py')
        assert seg[-4:] == ['--method', 'vgc', '--ranks-per-node', '2']


def test_flat_plan_keeps_one_host_per_rank_and_nolocal():
    cmd = bench_network.Plan(2, tag=6).mpiexec('mpiexec', 'python', [])
    assert '-launcher' not in cmd and 'unshare' not in cmd
    assert ' '.join(cmd).count('-env MPIR_CVAR_NOLOCAL 1') == 2
    assert '--ranks-per-node' not in cmd


def test_every_rank_gets_one_blas_thread_unless_the_caller_chose(
        monkeypatch):
    """The command as the README prints it (no OPENBLAS_NUM_THREADS) gives
    each rank one BLAS thread; a value the caller set is kept."""
    monkeypatch.delenv('OPENBLAS_NUM_THREADS', raising=False)
    for plan in (bench_network.Plan(2, tag=6),
                 bench_network.Plan(4, ranks_per_node=2, tag=6)):
        text = ' '.join(plan.mpiexec('mpiexec', 'python', []))
        assert text.count('-env OPENBLAS_NUM_THREADS 1 ') == 2, text
    monkeypatch.setenv('OPENBLAS_NUM_THREADS', '3')
    text = ' '.join(bench_network.Plan(2, tag=6).mpiexec('mpiexec', 'py',
                                                         []))
    assert text.count('-env OPENBLAS_NUM_THREADS 3 ') == 2, text


def test_the_shell_sets_the_host_name_and_runs_the_command_unchanged():
    """The word list after `unshare --uts` as sh runs it (without the
    unshare: `hostname` is then only printed)."""
    out = subprocess.run(
        ['sh', '-c', 'echo "$0" && exec "$@"', 'node1', 'printf', '%s|',
         'a b', '$x', "'q'"], capture_output=True, text=True, check=True)
    assert out.stdout == "node1\na b|$x|'q'|"


def test_check_nodes_compares_what_mpi_saw_with_the_plan():
    plan = bench_network.Plan(4, tag=5, ranks_per_node=2)
    good = dict(mpi_leaders=[0, 0, 2, 2],
                hosts=['node0', 'node0', 'node1', 'node1'])
    assert plan.check_nodes(good) == ''
    # one node of 4 (MPICH ignoring the host names) and a wrong name
    bad = dict(mpi_leaders=[0, 0, 0, 0],
               hosts=['node0', 'node0', 'vm', 'node1'])
    text = plan.check_nodes(bad)
    assert '[0, 0, 0, 0] instead of [0, 0, 2, 2]' in text
    assert 'host names' in text
    flat = bench_network.Plan(2, tag=5)
    assert flat.check_nodes(dict(mpi_leaders=[0, 1], hosts=['vm', 'vm'])) \
        == ''
    assert 'instead of [0, 1]' in flat.check_nodes(dict(mpi_leaders=[0, 0]))


@pytest.mark.parametrize('kw, want', [
    (dict(), (4, 4, 1)),
    (dict(workers=2), (2, 2, 1)),
    (dict(nodes=2, ranks_per_node=2), (4, 2, 2)),
    (dict(nodes=3, ranks_per_node=2, workers=6), (6, 3, 2)),
    (dict(workers=8, ranks_per_node=4), (8, 2, 4)),
])
def test_layout(kw, want):
    assert bench_network.check_layout(**kw) == want


@pytest.mark.parametrize('kw, error', [
    (dict(nodes=2), '--nodes needs --ranks-per-node'),
    (dict(workers=6, ranks_per_node=4), '6 workers are not nodes of 4'),
    (dict(ranks_per_node=2), 'needs --nodes'),
    (dict(nodes=2, ranks_per_node=2, workers=6),
     '--workers 6 is not --nodes 2 x --ranks-per-node 2'),
    (dict(nodes=0, ranks_per_node=2), '--nodes must be at least 1'),
    (dict(workers=0), '--workers must be at least 1'),
])
def test_layout_errors(kw, error):
    with pytest.raises(ValueError, match=error):
        bench_network.check_layout(**kw)
    with pytest.raises(ValueError, match='not nodes of 2'):
        bench_network.Plan(3, ranks_per_node=2)


@pytest.mark.parametrize('argv, error', [
    (['--nodes', '2'], '--nodes needs --ranks-per-node'),
    (['--nodes', '2', '--ranks-per-node', '2', '--workers', '3'],
     'is not --nodes 2'),
    (['--workers', '3', '--ranks-per-node', '2'], 'not nodes of 2'),
    (['--methods', 'vgc-node'], 'a hierarchical method needs --nodes'),
    (['--nodes', '2', '--ranks-per-node', '2', '--methods', 'naive-node'],
     'for chainer_vgc methods'),
    (['--methods', 'vgc+xy'], r'unknown suffix \+xy'),
    (['--to-accuracy', '97.5'], 'fraction'),
    (['--to-accuracy', '0.9', '--model', 'vgg'], 'MLP on MNIST'),
])
def test_argument_errors(argv, error, capsys):
    with pytest.raises(SystemExit) as e:
        bench_network.parse_args(argv)
    assert e.value.code == 2
    assert re.search(error, capsys.readouterr().err)


def test_defaults_of_the_modes():
    args = bench_network.parse_args([])
    assert (args.workers, args.n_nodes, args.k) == (4, 4, 1)
    # the default (in place) and spare_residuals=True side by side
    assert args.methods == 'naive,vgc,hybrid,vgc+spare,hybrid+spare'
    assert [m['spare'] for m in args.parsed] == [False] * 3 + [True] * 2
    assert (args.units, args.optimizer, args.timeout) == (2500, 'momentum',
                                                          900)
    args = bench_network.parse_args(['--nodes', '2', '--ranks-per-node', '2',
                                     '--to-accuracy', '0.975'])
    assert args.methods == 'naive,vgc,hybrid,vgc-node'
    assert (args.units, args.optimizer) == (1000, 'adam')
    assert args.timeout == 2 * args.max_seconds + 300
    step = bench_network.step_args(args, args.parsed[-1])
    assert step[:4] == ['--method', 'vgc', '--hierarchy', 'node']
    assert step[step.index('--to-accuracy') + 1] == '0.975'
    assert '--steps' not in step


def test_method_names():
    parse = bench_network.parse_method
    assert parse('vgc-node:fixed+db', nodes=True) == dict(
        name='vgc', hierarchy='node', coding='fixed', db=True, spare=False)
    assert parse('hybrid') == dict(name='hybrid', hierarchy=None,
                                   coding=None, db=False, spare=False)
    assert bench_network.method_args(parse('vgc+spare+db')) == [
        '--method', 'vgc', '--double-buffering', '--spare-residuals']
    for bad in ('vgc+fast', 'vgc+db+db', 'naive+spare'):
        with pytest.raises(ValueError):
            parse(bad)
    assert bench_network.method_args(parse('hybrid-node:gap', True)) == [
        '--method', 'hybrid', '--hierarchy', 'node', '--index-coding',
        'gap']
    assert bench_network.method_args(parse('vgc+db')) == [
        '--method', 'vgc', '--double-buffering']
    with pytest.raises(ValueError, match='empty method'):
        parse('-node', nodes=True)


def test_dry_run_with_nodes():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, 'benchmarks', 'bench_network.py'),
         '--dry-run', '--nodes', '2', '--ranks-per-node', '2', '--rates',
         '1gbit', '--methods', 'naive,vgc-node'], capture_output=True,
        text=True, timeout=120, check=True).stdout
    launches = [ln for ln in out.splitlines() if 'mpiexec' in ln]
    assert len(launches) == 2
    assert all('-launcher fork -hosts node0:2,node1:2' in ln
               for ln in launches)
    assert "'hostname \"$0\" && exec \"$@\"'" in launches[0]  # quoted
    assert '--hierarchy node' in launches[1]
    assert 'NOLOCAL' not in out
    assert sum(ln.startswith('$ ip netns del') for ln in out.splitlines()) \
        == 3


def test_node_report_models_the_bytes_each_node_sends(capsys):
    """2 nodes x 2 ranks: dense sends 2 (q - 1) / q N s per node with a
    node-aware allreduce (2 (p - 1) / p N s as one flat ring); vgc the
    p - 1 messages of a flat ring, vgc-node the q - 1 of a node, whose
    compression per node-worker is the per-rank one over k."""
    n = 1000000
    base = dict(rate='1gbit', params=n, model='mlp', data='mnist',
                batchsize=32, warmup=3, steps=8, mpi_leaders=[0, 0, 2, 2],
                hosts=['node0', 'node0', 'node1', 'node1'])
    results = [
        dict(base, method='naive', step_s=1.0, exchange_s=0.5,
             compression=1.0, tx_bytes_per_node=4e6,
             lo_bytes_by_node=[10.0, 14.0]),
        dict(base, method='vgc', step_s=0.5, exchange_s=0.1,
             compression=10.0, bits_per_element=8.0,
             tx_bytes_per_node=3e5),
        dict(base, method='vgc-node', step_s=0.5, exchange_s=0.25,
             compression=20.0, bits_per_element=8.0,
             tx_bytes_per_node=1e5, phases_s=dict(compress=0.1))]
    bench_network.node_report(results, 4, 2, '10gbit')
    rows = [ln.split(' | ') for ln in capsys.readouterr().out.splitlines()
            if ln.startswith('| 1gbit')]
    naive, vgc, node = rows[:3]
    assert naive[9:11] == ['6,000,000', '4,000,000']  # 1.5 N s, N s bytes
    # vgc: c = 10, 8 bits an element: 100,000 bytes a message
    assert vgc[5] == '10.0' and vgc[9:11] == ['300,000', '100,000']
    assert node[5] == '10.0' and node[9:11] == ['300,000', '100,000']
    assert naive[13] == '1.00x' and vgc[13] == '5.00x' and node[13] == \
        '2.00x'
    assert naive[8] == '12' and vgc[8] == 'nan'  # loopback inside nodes
    assert rows[3][:3] == ['| 1gbit', 'vgc-node', '0.100 |']


# -- time to accuracy ---------------------------------------------------------
class FakeTraining(object):
    """A clock, steps costing `step_s` each and evaluations costing
    `eval_s` each, the accuracy a function of the steps."""

    def __init__(self, curve, step_s=0.5, eval_s=100.0):
        self.curve, self.step_s, self.eval_s = curve, step_s, eval_s
        self.clock, self.steps, self.segments = 0.0, 0, []

    def train(self, n):
        self.segments.append(n)
        self.steps += n
        self.clock += n * self.step_s
        return n * self.step_s

    def evaluate(self):
        self.clock += self.eval_s
        return self.curve(self.steps)


def test_to_accuracy_stops_at_the_first_evaluation_that_reaches_it():
    fake = FakeTraining(lambda s: min(0.99, s / 1000.0))
    run = bench_network.to_accuracy(fake.train, fake.evaluate, 0.975,
                                    eval_every=100, max_steps=5000,
                                    max_seconds=1e9)
    assert run['reached'] and run['stop'] == 'reached'
    assert (run['steps'], run['accuracy']) == (1000, 0.99)
    assert run['wall_s'] == 500.0  # the 10 evaluations (1000 s) not timed
    assert fake.clock == 1500.0
    assert [h[0] for h in run['history']] == list(range(100, 1001, 100))
    assert run['history'][-1] == (1000, 500.0, run['accuracy'])


def test_to_accuracy_noisy_curve_stops_at_the_first_crossing():
    values = {50: 0.9, 100: 0.976, 150: 0.96}
    fake = FakeTraining(lambda s: values[s])
    run = bench_network.to_accuracy(fake.train, fake.evaluate, 0.975, 50,
                                    150, 1e9)
    assert (run['steps'], run['accuracy'], run['stop']) == (100, 0.976,
                                                            'reached')


def test_to_accuracy_step_cap_shortens_the_last_segment():
    fake = FakeTraining(lambda s: 0.5)
    run = bench_network.to_accuracy(fake.train, fake.evaluate, 0.975,
                                    eval_every=40, max_steps=100,
                                    max_seconds=1e9)
    assert fake.segments == [40, 40, 20]
    assert (run['steps'], run['reached'], run['stop']) == (100, False,
                                                           'step cap')
    assert run['wall_s'] == 50.0


def test_to_accuracy_time_cap_counts_training_only():
    fake = FakeTraining(lambda s: 0.5, step_s=1.0, eval_s=1000.0)
    run = bench_network.to_accuracy(fake.train, fake.evaluate, 0.975,
                                    eval_every=10, max_steps=10 ** 6,
                                    max_seconds=35)
    assert (run['steps'], run['wall_s'], run['stop']) == (40, 40.0,
                                                          'time cap')
    # reaching the target at the evaluation where a cap is hit counts
    fake = FakeTraining(lambda s: 0.98 if s >= 40 else 0.5, step_s=1.0)
    run = bench_network.to_accuracy(fake.train, fake.evaluate, 0.975, 10,
                                    40, 35)
    assert run['stop'] == 'reached' and run['reached']
    with pytest.raises(ValueError):
        bench_network.to_accuracy(fake.train, fake.evaluate, 0.9, 0, 10, 1)


@pytest.mark.parametrize('accuracy, steps, wall, want', [
    (0.975, 10, 1.0, 'reached'),
    (0.974, 100, 1.0, 'step cap'),
    (0.974, 99, 60.0, 'time cap'),
    (0.974, 99, 59.9, None),
])
def test_stop_reason(accuracy, steps, wall, want):
    assert bench_network.stop_reason(accuracy, 0.975, steps, 100, wall,
                                     60.0) == want


def test_speedup_text():
    dense = dict(reached=True, wall_s=300.0)
    assert bench_network.speedup(dense, dict(reached=True, wall_s=100.0)) \
        == '3.00'
    assert bench_network.speedup(dict(reached=False, wall_s=300.0),
                                 dict(reached=True, wall_s=100.0)) == \
        '>= 3.00'
    assert bench_network.speedup(dense, dict(reached=False, wall_s=1.0)) \
        == 'n/a'


def test_accuracy_report(capsys):
    base = dict(rate='1gbit', target=0.975, workers=4, ranks_per_node=1,
                model='mlp', params=10, optimizer='adam', batchsize=32,
                eval_every=50, eval_examples=10000, max_steps=1500,
                max_seconds=420.0, exchange_s=0.1, compression=1.0,
                final_accuracy=0.976, epochs=1.0)
    results = [dict(base, method='naive', stop='reached', reached=True,
                    steps=500, wall_s=150.0, accuracy=0.976),
               dict(base, method='vgc', stop='reached', reached=True,
                    steps=800, wall_s=100.0, accuracy=0.977),
               dict(base, method='hybrid', stop='step cap', reached=False,
                    steps=1500, wall_s=200.0, accuracy=0.97)]
    bench_network.accuracy_report(results)
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith('| 1gbit')]
    assert rows[0].endswith('| 1.00 |') and rows[1].endswith('| 1.50 |')
    assert rows[2].endswith('| n/a |') and '| step cap |' in rows[2]
    assert '| 0.300 |' in rows[0]  # seconds per step
    assert '1gbit: dense / vgc time to 97.50%: 1.50' in out


def test_network_step_trains_to_accuracy():
    """network_step.py --to-accuracy on loopback, 2 ranks, a small MLP on
    MNIST: stops at the target or a cap, the replicas equal."""
    import json
    mpiexec = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    cmd = [mpiexec, '-n', '2', sys.executable,
           os.path.join(ROOT, 'benchmarks', 'network_step.py'),
           '--method', 'vgc', '--units', '32', '--optimizer', 'adam',
           '--to-accuracy', '0.8', '--eval-every', '10', '--max-steps',
           '60', '--eval-examples', '1000']
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         cwd=ROOT, env=dict(os.environ,
                                            OPENBLAS_NUM_THREADS='1'))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith('RESULT ')]
    res = json.loads(lines[-1][len('RESULT '):])
    assert res['method'] == 'vgc' and res['target'] == 0.8
    assert res['stop'] in ('reached', 'step cap')
    assert res['reached'] == (res['accuracy'] >= 0.8)
    assert res['steps'] <= 60 and res['steps'] % 10 == 0
    assert [h[0] for h in res['history']] == list(
        range(10, res['steps'] + 1, 10))
    assert 0 < res['wall_s'] and res['eval_s'] > 0
    assert 0 < res['final_accuracy'] <= 1 and res['replicas_agree']
    assert res['compression'] > 1 and res['eval_examples'] == 1000


def test_network_step_times_the_hierarchical_exchange():
    """--hierarchy node on loopback, 4 ranks that MPICH splits into two
    nodes of 2 (its debugging cliques): the exchange timed is the
    hierarchical one, and the nodes MPI saw are reported."""
    import json
    mpiexec = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    cmd = [mpiexec, '-n', '4', '-env', 'MPIR_CVAR_NUM_CLIQUES', '2',
           '-env', 'MPIR_CVAR_CLIQUES_BY_BLOCK', '1', sys.executable,
           os.path.join(ROOT, 'benchmarks', 'network_step.py'),
           '--method', 'vgc', '--hierarchy', 'node', '--ranks-per-node',
           '2', '--units', '64', '--data', 'synthetic', '--steps', '3',
           '--warmup', '2']
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         cwd=ROOT, env=dict(os.environ,
                                            OPENBLAS_NUM_THREADS='1'))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith('RESULT ')]
    res = json.loads(lines[-1][len('RESULT '):])
    assert res['method'] == 'vgc-node'
    assert res['mpi_leaders'] == [0, 0, 2, 2]
    assert 0 < res['exchange_s'] < res['step_s']
    assert len(res['tx_bytes_by_node']) == 2
