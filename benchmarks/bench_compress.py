#!/usr/bin/env python
"""Compress + encode and decode + mean vs a memory copy, in one run.

Runs GradientCompressor over N float32 parameters (default 25M, split into
VGG-like tensors) and times one full step (accumulate, criterion, decay,
quantize, pack into the message) against numpy.copyto of the gradient
bytes, on the native backend and on the NumPy reference side by side; then
decodes 4 such messages (as from 4 ranks) into the gradients with the 1/4
mean (chainer_vgc.exchange.mean_gradients).  Prints medians of
--repeat runs and the ratios to copyto.
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
from chainer_vgc import exchange  # NOQA: E402
from chainer_vgc import native  # NOQA: E402

from bench_common import hyperparameters  # NOQA: E402
from bench_common import machine  # NOQA: E402
from bench_common import median_time  # NOQA: E402
from bench_common import shapes_for  # NOQA: E402
from bench_common import timed  # NOQA: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--params', type=int, default=25_000_000)
    p.add_argument('--repeat', type=int, default=5)
    p.add_argument('--methods', default='vgc:fixed,vgc,hybrid:fixed,hybrid,'
                   'strom', help="comma separated; METHOD:CODING sets the "
                   "index_coding ('vgc:fixed': the paper's 32-bit words; "
                   "plain 'vgc': the default, 'auto')")
    p.add_argument('--draws', type=int, default=4)
    p.add_argument('--warmup', type=int, default=20)
    p.add_argument('--alpha', type=float, default=None,
                   help='alpha of vgc and hybrid (default: bench_common\'s '
                   '2.0); a larger alpha sends fewer elements of this '
                   'noise-dominated stream, nearer training densities')
    args = p.parse_args()
    shapes = shapes_for(args.params)
    rng = numpy.random.default_rng(0)
    # minibatch gradients: a small per-element mean plus the noise of a
    # batch of B = 64 examples (per-example std 1e-2); s is the expected
    # sum_z (grad_z / B)**2.  Steps cycle through --draws noise draws.
    batch, sigma = 64, 1e-2
    mus = [rng.normal(0, 2e-4, s).astype(numpy.float32) for s in shapes]
    sqs = [(mu * mu + sigma ** 2) / batch for mu in mus]
    draws = [[mu + rng.normal(0, sigma / batch ** 0.5, mu.shape).astype(
        numpy.float32) for mu in mus] for _ in range(args.draws)]
    grads = draws[0]
    src = numpy.concatenate([g.ravel() for g in grads])
    dst = numpy.empty_like(src)
    copy_t = median_time(lambda: numpy.copyto(dst, src), args.repeat)
    print('machine: {}; native build: {}, {} threads, OMP_PROC_BIND={}'
          .format(machine(processor=True), native.isa(),
                  native.num_threads(), os.environ.get('OMP_PROC_BIND')))
    print('{:,} float32 parameters in {} tensors ({:.0f} MB)'.format(
        args.params, len(shapes), src.nbytes / 1e6))
    print('numpy.copyto of the gradient bytes: {:.1f} ms'.format(
        copy_t * 1e3))
    print('warm-up: {} steps per method before timing'.format(args.warmup))
    print()
    names = [str(i) for i in range(len(shapes))]
    methods = args.methods.split(',')

    def compressor(spec, backend):
        method, _, coding = spec.partition(':')
        kw = hyperparameters(method, **({} if args.alpha is None
                                        else {'alpha': args.alpha}))
        if coding:
            kw['index_coding'] = coding
        return GradientCompressor(method, names, shapes,
                                  [numpy.float32] * len(shapes),
                                  backend=backend, **kw)

    def time_compress(method, backend):
        """(median s, CPU s / wall s, density, message bytes, 4
        messages)."""
        comp = compressor(method, backend)
        for k in range(args.warmup):  # allocate state, steady state
            comp.compress(draws[k % len(draws)], sqs, copy=False)
        times, cpu, sent, msgs, nbytes = [], [], [], [], []
        for k in range(args.repeat):
            g = draws[k % len(draws)]
            m, wall, busy = timed(comp.compress, g, sqs, copy=False)
            times.append(wall)
            cpu.append(busy)
            sent.append(comp.last_sent)
            nbytes.append(comp.last_bytes)
            msgs.append(m.copy())
        return (float(numpy.median(times)),
                float(numpy.median(cpu) / numpy.median(times)),
                numpy.mean(sent) / args.params, numpy.mean(nbytes),
                (msgs * 4)[:4])

    # the local gradients, as backward left them (written in place)
    params = [chainer.Parameter(numpy.zeros(s, numpy.float32))
              for s in shapes]
    local = [numpy.ones(s, numpy.float32) for s in shapes]

    def time_decode(method, backend, messages):
        """decode + mean of 4 messages into the gradients."""
        comp = compressor(method, backend)

        def decode():
            for p, g in zip(params, local):
                p.grad = g
            exchange.mean_gradients(messages, comp, params, local, 4,
                                        True, False)
        return median_time(decode, args.repeat)

    # the native backend first, for every method, then the reference
    res = {}
    for backend in ('native', 'numpy'):
        for method in methods:
            t, busy, density, nbytes, messages = time_compress(method,
                                                               backend)
            res[method, backend] = dict(
                compress=t, busy=busy, density=density, nbytes=nbytes,
                decode=time_decode(method, backend, messages))
    print('| method | step | native ms | x copyto | numpy ms | x copyto | '
          'density sent | message bytes | bits/element | native CPU/wall |')
    print('|---|---|---:|---:|---:|---:|---:|---:|---:|---:|')
    for method in methods:
        nat, ref = res[method, 'native'], res[method, 'numpy']
        print('| {} | compress+encode | {:.1f} | {:.2f} | {:.1f} | {:.1f} | '
              '{:.2%} | {:,.0f} | {:.1f} | {:.2f} |'.format(
                  method, nat['compress'] * 1e3, nat['compress'] / copy_t,
                  ref['compress'] * 1e3, ref['compress'] / copy_t,
                  nat['density'], nat['nbytes'],
                  8 * nat['nbytes'] / (nat['density'] * args.params),
                  nat['busy']))
        print('| {} | decode+mean of 4 | {:.1f} | {:.2f} | {:.1f} | {:.1f} '
              '| | | | |'.format(method, nat['decode'] * 1e3,
                               nat['decode'] / copy_t, ref['decode'] * 1e3,
                               ref['decode'] / copy_t))

if __name__ == '__main__':
    main()
