#!/usr/bin/env python
"""What vgc costs in memory over the plain run, and where it goes.

    OPENBLAS_NUM_THREADS=1 python benchmarks/bench_memory.py [--model ...]

For each model, two fresh processes train it for a few exchanges (after
the first update, which broadcasts the parameters as ChainerMN's does) through
``create_communicator`` + ``create_multi_node_optimizer`` (one rank, the
whole exchange included; Momentum SGD): one with ``'none'``, one with
``'vgc'`` (alpha = 2).  Printed per model: the parameter bytes, each run's
peak resident memory (``ru_maxrss``) and what NumPy held at the end of the
steps (tracemalloc: it sees NumPy's buffers), the extra of vgc over none,
and the extra split by role, from ``GradientCompressor.memory()`` and
``PerSampleSquares.memory()``:

* ``residuals``: the rule's state (VGC: r and v, 2 x 4 bytes per float32
  parameter);
* ``spare``: the native backend's second set of residuals, with
  ``spare_residuals=True`` only (each step writes the next state there
  and swaps it in only when no tensor faulted; by default the residuals
  are updated in place after the inputs are checked: 0);
* ``message``: the native backend's message buffer, sized for the largest
  message the settings allow;
* ``sums``: the per-sample sums of squares s (4 bytes per parameter);
* ``workspace``: the statistics' buffers kept between passes (bounded by
  ``max_memory``);
* ``other``: the rest of the extra NumPy memory at the end of the steps
  (``held`` difference less the above); the peak during a step adds the
  step's temporaries on top (the ``peak`` columns).

Models: ``mlp`` (the demo's 784-200-200-10, batch 32), ``vgg`` (the App. D
VGG at full width, 32x32x3, batch 16) and ``resnet50``
(``BottleneckResNet``: ResNet-50's shape, 224x224x3, batch 4, as
``bench_statistics.py --model resnet50``: the ChainerMN ImageNet example's
network).  Figures and the reading:
docs/benchmarks.md ("Memory").
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tracemalloc

MODELS = ('mlp', 'vgg', 'resnet50')
ROLES = ('residuals', 'spare', 'message', 'sums', 'workspace')


def build(name):
    """(model, x, t) of one named setting, seeded."""
    import chainer.links as L
    import numpy
    from chainer_vgc.harness.models import MLP, VGG, BottleneckResNet
    numpy.random.seed(0)
    rng = numpy.random.default_rng(0)
    if name == 'mlp':
        model = L.Classifier(MLP((200, 200), 10))
        x = rng.random((32, 784), numpy.float32)
        t = rng.integers(0, 10, 32).astype(numpy.int32)
    elif name == 'vgg':
        model = L.Classifier(VGG(10, 1.0, dropout=False))
        x = rng.random((16, 3, 32, 32), numpy.float32)
        t = rng.integers(0, 10, 16).astype(numpy.int32)
    else:
        model = L.Classifier(BottleneckResNet(1000))
        x = rng.random((4, 3, 224, 224), numpy.float32)
        t = rng.integers(0, 1000, 4).astype(numpy.int32)
    return model, x, t


def child(name, method, steps):
    """One run; prints its figures as JSON."""
    tracemalloc.start()
    import chainer
    import chainer_vgc
    model, x, t = build(name)
    kw = {'alpha': 2.0} if method == 'vgc' else {}
    comm = chainer_vgc.create_communicator(method, **kw)
    opt = chainer_vgc.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(0.01), comm).setup(model)
    before = tracemalloc.get_traced_memory()[0]
    for _ in range(1 + steps):  # (the first update broadcasts, as ChainerMN's)
        opt.update(model, x, t)
    held, peak = tracemalloc.get_traced_memory()
    out = {'params': int(sum(p.size * p.dtype.itemsize
                             for p in model.params())),
           'maxrss': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
           * 1024, 'held': held - before, 'peak': peak - before}
    if method != 'none':
        mem = comm.state(model).compressor.memory()
        hook = comm.statistics_hook(model).memory()
        out.update(residuals=mem['residuals'],
                   spare=mem['spare_residuals'], message=mem['message'],
                   sums=hook['sums'], workspace=hook['workspace'])
    print('RESULT ' + json.dumps(out), flush=True)


def run(name, method, steps):
    env = dict(os.environ, OPENBLAS_NUM_THREADS=os.environ.get(
        'OPENBLAS_NUM_THREADS') or '1')
    proc = subprocess.run([sys.executable, os.path.abspath(__file__),
                           '--child', name, method, str(steps)],
                          capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines()
             if ln.startswith('RESULT ')]
    if proc.returncode or not lines:
        raise SystemExit('{} {} failed:\n{}'.format(
            name, method, (proc.stdout + proc.stderr)[-3000:]))
    return json.loads(lines[-1][len('RESULT '):])


def report(name, none, vgc):
    """The table rows of one model (MB, and multiples of the parameter
    bytes)."""
    mb = 2.0 ** 20
    n = float(vgc['params'])
    extra = vgc['held'] - none['held']
    parts = {r: vgc[r] for r in ROLES}
    parts['other'] = extra - sum(parts.values())
    rows = ['{}: {:,.1f} MB of parameters'.format(name, n / mb),
            '  peak RSS   none {:8.1f} MB  vgc {:8.1f} MB  extra {:8.1f} MB'
            ' ({:.2f}x the parameters)'.format(
                none['maxrss'] / mb, vgc['maxrss'] / mb,
                (vgc['maxrss'] - none['maxrss']) / mb,
                (vgc['maxrss'] - none['maxrss']) / n),
            '  NumPy held none {:8.1f} MB  vgc {:8.1f} MB  extra {:8.1f} MB'
            ' ({:.2f}x); peak in a step: none {:.1f} MB, vgc {:.1f} MB'
            .format(none['held'] / mb, vgc['held'] / mb, extra / mb,
                    extra / n, none['peak'] / mb, vgc['peak'] / mb)]
    rows += ['  {:10s} {:8.1f} MB  {:5.2f}x the parameters'.format(
        r, v / mb, v / n) for r, v in parts.items()]
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--model', nargs='*', choices=MODELS,
                    default=list(MODELS))
    ap.add_argument('--steps', type=int, default=3,
                    help='exchanges after the first update (>= 1)')
    ap.add_argument('--child', nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.steps < 1:
        ap.error('--steps must be at least 1 (an exchange)')
    if args.child:
        name, method, steps = args.child
        return child(name, method, int(steps))
    for name in args.model:
        none = run(name, 'none', args.steps)
        vgc = run(name, 'vgc', args.steps)
        print('\n'.join(report(name, none, vgc)), flush=True)


if __name__ == '__main__':
    main()
