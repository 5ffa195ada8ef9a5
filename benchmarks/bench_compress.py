#!/usr/bin/env python
"""Compress + encode and decode vs a memory copy, in one run, through the
public API.

Runs ``GradientCompressor`` over N float32 parameters (default 25M, split
into VGG-like tensors) and times, as a user calls them:

- ``compress`` (accumulate, criterion, decay, quantize, encode into the
  message) for vgc with each index coding ('fixed', 'gap', 'auto') and for
  hybrid, whose tau is tuned to send as many elements as vgc does (the
  same density, so the two passes do the same encoding work);
- ``decode_into`` of one message into the gradients;
- decode + mean of 4 such messages (as from 4 ranks) into the gradients,
  the communicator's step (:func:`chainer_vgc.exchange.mean.mean_gradients`);

each compressor as ``create_communicator`` builds it by default (the
residuals updated in place after one read-only check of the inputs); the
ratios at the end add ``spare_residuals=True`` beside it, step by step.
Then the methods users pick instead (issue 51): dgc at ``--dgc-density``
(its top-k, FMT_SPARSE with float16 values) with the same three rows,
and powersgd's step at ranks 2 and 4 on the tensors it compresses (one
worker: its products, orthogonalization and error feedback, no
allreduce), each against the same copyto.
Each against ``numpy.copyto`` of the gradient bytes, at one density per
``--alphas`` entry (vgc's alpha: 2 sends about 10-15 % of this
noise-dominated stream, 10 about 2 %).  Prints medians of ``--repeat``
runs, the ratios to copyto and the ratios the issue-25 targets name.
``--backends native,numpy`` adds the NumPy reference's rows.
"""

import argparse
import os

# One process, all cores: keep the OpenMP threads on distinct cores (on
# some machines the scheduler otherwise leaves two on one core, halving
# the speed of a whole run).  Set before the native library loads.
os.environ.setdefault('OMP_PROC_BIND', 'close')

import chainer  # NOQA: E402
import numpy  # NOQA: E402

from chainer_vgc import GradientCompressor  # NOQA: E402
from chainer_vgc.exchange import mean as exchange_mean  # NOQA: E402
from chainer_vgc.engines.native import bindings  # NOQA: E402

from bench_common import machine  # NOQA: E402
from bench_common import median_time  # NOQA: E402
from bench_common import shapes_for  # NOQA: E402
from bench_common import timed  # NOQA: E402

CODINGS = ('fixed', 'gap', 'auto')


class Stream(object):
    """Minibatch gradients: a small per-element mean plus the noise of a
    batch of B = 64 examples (per-example std 1e-2); ``sqs`` is the
    expected sum_z (grad_z / B)**2.  Steps cycle through ``draws`` noise
    draws."""

    def __init__(self, n_params, draws):
        self.shapes = shapes_for(n_params)
        rng = numpy.random.default_rng(0)
        batch, sigma = 64, 1e-2
        mus = [rng.normal(0, 2e-4, s).astype(numpy.float32)
               for s in self.shapes]
        self.sqs = [(mu * mu + sigma ** 2) / batch for mu in mus]
        self.draws = [[mu + rng.normal(0, sigma / batch ** 0.5, mu.shape)
                       .astype(numpy.float32) for mu in mus]
                      for _ in range(draws)]
        self.names = [str(i) for i in range(len(self.shapes))]

    def compressor(self, method, backend, **kw):
        return GradientCompressor(method, self.names, self.shapes,
                                  [numpy.float32] * len(self.shapes),
                                  backend=backend, **kw)

    def step(self, k):
        return self.draws[k % len(self.draws)]


def run_compress(stream, comp, warmup, repeat):
    """(median s, density, message bytes, the last 4 messages)."""
    for k in range(warmup):  # allocate state, reach the steady state
        comp.compress(stream.step(k), stream.sqs, copy=False)
    times, sent, nbytes, msgs = [], [], [], []
    for k in range(repeat):
        m, wall, _ = timed(comp.compress, stream.step(warmup + k),
                           stream.sqs, copy=False)
        times.append(wall)
        sent.append(comp.last_sent)
        nbytes.append(comp.last_bytes)
        msgs.append(m.copy())
    return (float(numpy.median(times)), numpy.mean(sent) / comp.n_params,
            float(numpy.mean(nbytes)), (msgs * 4)[-4:])


def interleaved_compress(stream, comps, warmup, repeat):
    """Median compress seconds of each of ``comps``, their steps taken in
    turn (one step of each, then the next), so that the machine's drift
    over the run (this VM's bandwidth moves by 10 %) falls on all alike:
    the side-by-side ratio of codings that do nearly the same work."""
    for k in range(warmup):
        for comp in comps:
            comp.compress(stream.step(k), stream.sqs, copy=False)
    times = [[] for _ in comps]
    for k in range(warmup, warmup + repeat):
        for comp, t in zip(comps, times):
            t.append(timed(comp.compress, stream.step(k), stream.sqs,
                           copy=False)[1])
    return [float(numpy.median(t)) for t in times]


def density_of(stream, method, warmup, repeat, **kw):
    """Elements sent per parameter in the steps :func:`run_compress` times
    (after ``warmup`` steps, ``repeat`` steps; native backend)."""
    comp = stream.compressor(method, 'native', **kw)
    sent = []
    for k in range(warmup + repeat):
        comp.compress(stream.step(k), stream.sqs, copy=False)
        sent.append(comp.last_sent)
    return numpy.mean(sent[warmup:]) / comp.n_params


def matching_tau(stream, alpha, target, warmup, repeat, rounds=12):
    """Hybrid's tau (bisected in log space) at which it sends ``target``
    elements per parameter, as near as ``rounds`` halvings get."""
    lo, hi = numpy.log(1e-7), numpy.log(1e-1)
    for _ in range(rounds):  # the density falls as tau grows
        mid = (lo + hi) / 2
        d = density_of(stream, 'hybrid', warmup, repeat, alpha=alpha,
                       tau=float(numpy.exp(mid)))
        lo, hi = (mid, hi) if d > target else (lo, mid)
    return float(numpy.exp((lo + hi) / 2))


def run_decode(stream, comp, messages, repeat):
    """(decode_into of one message s, decode + mean of 4 s)."""
    outs = [numpy.zeros(s, numpy.float32) for s in stream.shapes]
    one = median_time(lambda: comp.decode_into(messages[0], outs), repeat)
    params = [chainer.Parameter(numpy.zeros(s, numpy.float32))
              for s in stream.shapes]
    local = [numpy.ones(s, numpy.float32) for s in stream.shapes]

    def mean():
        for p, g in zip(params, local):
            p.grad = g
        exchange_mean.mean_gradients(messages, comp, params, local, 4, True,
                                     False)
    return one, median_time(mean, repeat)


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--params', type=int, default=25_000_000)
    p.add_argument('--repeat', type=int, default=5)
    p.add_argument('--draws', type=int, default=4)
    p.add_argument('--warmup', type=int, default=20)
    p.add_argument('--alphas', default='2,10',
                   help="vgc's alpha, one density each (comma separated)")
    p.add_argument('--backends', default='native',
                   help="'native', or 'native,numpy' to add the NumPy "
                   "reference (slow: its gap decoder is Python)")
    p.add_argument('--no-hybrid', action='store_true',
                   help='skip hybrid (and its tau search)')
    p.add_argument('--dgc-density', type=float, default=0.001)
    p.add_argument('--no-others', action='store_true',
                   help='skip dgc and powersgd')
    args = p.parse_args()
    stream = Stream(args.params, args.draws)
    src = numpy.concatenate([g.ravel() for g in stream.draws[0]])
    dst = numpy.empty_like(src)
    copy_t = median_time(lambda: numpy.copyto(dst, src), args.repeat)
    print('machine: {}; native build: {}, {} threads, OMP_PROC_BIND={}'
          .format(machine(processor=True), bindings.isa(),
                  bindings.num_threads(), os.environ.get('OMP_PROC_BIND')))
    print('{:,} float32 parameters in {} tensors ({:.0f} MB); numpy.copyto '
          'of the gradient bytes: {:.1f} ms; {} warm-up steps, medians of '
          '{}'.format(args.params, len(stream.shapes), src.nbytes / 1e6,
                      copy_t * 1e3, args.warmup, args.repeat))
    print()
    print('| alpha | method | backend | density sent | bits/element | '
          'compress+encode ms | x copyto | decode_into ms | x copyto | '
          'decode+mean of 4 ms | x copyto |')
    print('|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|')
    targets = []
    for alpha in [float(a) for a in args.alphas.split(',')]:
        runs = [('vgc:' + c, 'vgc', dict(alpha=alpha, index_coding=c))
                for c in CODINGS]
        tau = None
        rows = {}
        for label, method, kw in runs:
            for backend in args.backends.split(','):
                rows[label, backend] = measure(stream, method, backend, kw,
                                               args, copy_t, alpha, label)
            if label == 'vgc:auto' and not args.no_hybrid:
                tau = matching_tau(stream, alpha,
                                   rows[label, 'native']['density'],
                                   args.warmup, args.repeat)
                for c in ('fixed', 'auto'):
                    runs.append(('hybrid:{} (tau {:.3g})'.format(c, tau),
                                 'hybrid', dict(alpha=alpha, tau=tau,
                                                index_coding=c)))
        nat = {label.split(' ')[0]: rows[label, 'native']
               for label, _, _ in runs}
        side = interleaved_compress(
            stream, [stream.compressor('vgc', 'native', alpha=alpha,
                                       index_coding=c) for c in CODINGS],
            args.warmup, 3 * args.repeat)
        side = dict(zip(CODINGS, side))
        commit = interleaved_compress(
            stream, [stream.compressor('vgc', 'native', alpha=alpha,
                                       index_coding='auto',
                                       spare_residuals=spare)
                     for spare in (False, True)],
            args.warmup, 3 * args.repeat)
        targets.append(
            ('alpha {:g}, density {:.2%}'.format(
                alpha, nat['vgc:auto']['density']),
             [("'fixed' compress+encode / copyto (<= 3)",
               nat['vgc:fixed']['compress'] / copy_t),
              ("'gap' compress+encode / copyto (<= 4)",
               nat['vgc:gap']['compress'] / copy_t),
              ("'auto' compress+encode / copyto (<= 4)",
               nat['vgc:auto']['compress'] / copy_t),
              ("'auto' / the cheaper of 'fixed' and 'gap' (<= 1.10)",
               side['auto'] / min(side['fixed'], side['gap'])),
              ("'auto' / 'gap' (the coding it picks at this density)",
               side['auto'] / side['gap']),
              ("'auto' in place (the default) / spare_residuals=True "
               '(<= 1.10)', commit[0] / commit[1]),
              ("decode_into of one 'auto' message / copyto (<= 2)",
               nat['vgc:auto']['one'] / copy_t),
              ("decode+mean of 4 'auto' messages / copyto (<= 5)",
               nat['vgc:auto']['mean'] / copy_t)] +
             ([("hybrid / vgc compress+encode, 'auto', same density "
                '(<= 1.3)', nat['hybrid:auto']['compress'] /
                nat['vgc:auto']['compress']),
               ("hybrid / vgc compress+encode, 'fixed', same density "
                '(<= 1.3)', nat['hybrid:fixed']['compress'] /
                nat['vgc:fixed']['compress'])] if tau else [])))
    if not args.no_others:
        targets.append(others(stream, args, copy_t))
    print('\nThe ratios of the issue-25, issue-48 and issue-51 targets '
          "(native backend; the 'auto' ratios from compressors run in "
          'turn, step by step, {} steps each):\n'.format(3 * args.repeat))
    for title, pairs in targets:
        print(title)
        for what, ratio in pairs:
            print('  {:<62} {:.2f}'.format(what, ratio))


def others(stream, args, copy_t):
    """dgc's rows (at ``--dgc-density``, every tensor) and powersgd's step
    (ranks 2 and 4, the tensors it would compress); the issue-51 ratios."""
    from chainer_vgc.rules import PowerSGD
    print('\n| method | backend | density sent | bits/element | '
          'compress+encode ms | x copyto | decode_into ms | x copyto | '
          'decode+mean of 4 ms | x copyto |')
    print('|---|---|---|---:|---:|---:|---:|---:|---:|---:|')
    label = 'dgc (density {:g})'.format(args.dgc_density)
    rows = {}
    for backend in args.backends.split(','):
        comp = stream.compressor('dgc', backend, density=args.dgc_density)
        t, density, nbytes, messages = run_compress(stream, comp,
                                                    args.warmup, args.repeat)
        one, mean = run_decode(stream, comp, messages, args.repeat)
        print('| {} | {} | {:.3%} | {:.1f} | {:.1f} | {:.2f} | {:.1f} | '
              '{:.2f} | {:.1f} | {:.2f} |'.format(
                  label, backend, density,
                  8 * nbytes / max(density * comp.n_params, 1), t * 1e3,
                  t / copy_t, one * 1e3, one / copy_t, mean * 1e3,
                  mean / copy_t), flush=True)
        rows[backend] = t
    print('\n| method | tensors compressed | numbers sent / elements | '
          'step ms | x copyto (of every gradient) |')
    print('|---|---:|---:|---:|---:|')
    ratios = [("dgc compress+encode / copyto at {:g} density (<= 3)".format(
        args.dgc_density), rows['native'] / copy_t)]
    # the stream's tensors as the layers' matrices (output channels
    # against the rest, as a convolution's W): powers of two of at least
    # 32 rows, no more rows than columns; the rest stay vectors
    matrices = [_as_matrix(s[0]) for s in stream.shapes]
    for rank in (2, 4):
        rule = PowerSGD(matrix_rank=rank)
        which = [i for i, s in enumerate(matrices)
                 if not rule.keeps_dense(s)]
        comp = GradientCompressor(
            rule, [stream.names[i] for i in which],
            [matrices[i] for i in which], [numpy.float32] * len(which))

        def step(k):
            grads = stream.step(k)
            return comp.reduce([grads[i].reshape(matrices[i])
                                for i in which])
        for k in range(2):
            step(k)
        t = median_time(lambda: step(2), args.repeat)
        print('| powersgd (rank {}) | {} of {} ({:.1%} of the elements) | '
              '{:.4%} | {:.1f} | {:.2f} |'.format(
                  rank, len(which), len(stream.shapes),
                  comp.n_params / sum(s.size for s in stream.step(0)),
                  comp.last_sent / comp.n_params, t * 1e3, t / copy_t),
              flush=True)
        ratios.append(('powersgd rank {} step / copyto'.format(rank),
                       t / copy_t))
    return 'the methods users pick instead', ratios


def _as_matrix(n):
    rows = 0
    for r in (32, 64, 128, 256, 512, 1024):
        if n % r == 0 and n // r >= r:
            rows = r
    return (rows, n // rows) if rows else (n,)


def measure(stream, method, backend, kw, args, copy_t, alpha, label):
    """Times one compressor; prints its row; returns its figures."""
    comp = stream.compressor(method, backend, **kw)
    t, density, nbytes, messages = run_compress(stream, comp, args.warmup,
                                                args.repeat)
    one, mean = run_decode(stream, comp, messages, args.repeat)
    print('| {:g} | {} | {} | {:.2%} | {:.1f} | {:.1f} | {:.2f} | {:.1f} | '
          '{:.2f} | {:.1f} | {:.2f} |'.format(
              alpha, label, backend, density,
              8 * nbytes / max(density * comp.n_params, 1), t * 1e3,
              t / copy_t, one * 1e3, one / copy_t, mean * 1e3,
              mean / copy_t), flush=True)
    return dict(compress=t, density=density, one=one, mean=mean)


if __name__ == '__main__':
    main()
