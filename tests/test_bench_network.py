"""The emulated-network benchmark's set-up and clean-up logic, without root
(dry run and a fake command runner)."""

import os
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


@pytest.mark.parametrize('method', ['naive', 'vgc', 'vgc+db'])
def test_network_step_times_the_exchange(method):
    """network_step.py (one rank per emulated host) on loopback, 2 ranks,
    a small MLP: the exchange it times is the one the optimizer calls
    (chainer_vgc's optimizer calls comm.exchange, not
    multi_node_mean_grad: timing the latter reported nan)."""
    import json
    mpiexec = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    name, _, db = method.partition('+')
    cmd = [mpiexec, '-n', '2', sys.executable,
           os.path.join(ROOT, 'benchmarks', 'network_step.py'),
           '--method', name, '--units', '64', '--data', 'synthetic',
           '--steps', '3', '--warmup', '2'] + (
               ['--double-buffering'] if db else [])
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
        assert set(phases) == {'compress', 'agree', 'transport', 'decode'}
        # each phase of the slowest rank within the exchange it is part of
        assert all(0 <= t for t in phases.values())
        if not db:
            assert max(phases.values()) <= res['exchange_s'] * 1.5 + 0.01


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
