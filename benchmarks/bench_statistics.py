#!/usr/bin/env python
"""Training-step time and peak memory with per-sample statistics vs without.

The VGG-like network of the paper's Appendix D, batch 64 of generated
32x32x3 input, momentum SGD, on the CPU (NumPy).  One step = forward,
backward, update; the statistics step uses PerSampleSquares.backward in
place of loss.backward.  Steps alternate between the two so that both see
the same machine state; the medians and their ratio are printed, with the
peak of traced allocations (tracemalloc, which sees NumPy's buffers).
"""

import argparse
import tracemalloc

import chainer
import chainer.functions as F
import numpy

from chainer_vgc.models import VGG
from chainer_vgc.statistics import DEFAULT_MAX_MEMORY
from chainer_vgc.statistics import PerSampleSquares

from bench_common import machine
from bench_common import timed


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--batchsize', type=int, default=64)
    p.add_argument('--steps', type=int, default=5)
    p.add_argument('--width', type=float, default=1.0,
                   help='channel multiplier (1.0 = the paper network)')
    p.add_argument('--max-memory', type=int, default=DEFAULT_MAX_MEMORY)
    args = p.parse_args()
    rng = numpy.random.default_rng(0)
    numpy.random.seed(0)
    model = VGG(width=args.width)
    opt = chainer.optimizers.MomentumSGD(lr=0.01)
    opt.setup(model)
    b = args.batchsize
    x = rng.normal(size=(b, 3, 32, 32)).astype(numpy.float32)
    t = rng.integers(0, 10, b).astype(numpy.int32)
    model(x)
    n_params = sum(p.size for p in model.params())
    stats = PerSampleSquares(model, max_memory=args.max_memory)

    def step(with_stats):
        model.cleargrads()
        loss = F.softmax_cross_entropy(model(x), t)
        if with_stats:
            stats.backward(loss, batch=(x,))
        else:
            loss.backward()
        opt.update()

    for mode in (False, True):  # warm up both
        step(mode)
    times = {False: [], True: []}
    peaks = {False: 0, True: 0}
    tracemalloc.start()
    for _ in range(args.steps):
        for mode in (False, True):
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            times[mode].append(timed(step, mode)[1])
            peaks[mode] = max(peaks[mode],
                              tracemalloc.get_traced_memory()[1] - base)
    tracemalloc.stop()
    plain, with_stats = (float(numpy.median(times[m])) for m in (False, True))
    print('machine: ' + machine(chainer=True))
    print('VGG-like (App. D, width {}), {:,} parameters, batch {}, '
          '32x32x3, {} steps each (median), max_memory {} MiB'.format(
              args.width, n_params, b, args.steps, args.max_memory >> 20))
    print('| step | seconds | peak traced MiB |')
    print('|---|---:|---:|')
    print('| plain | {:.3f} | {:.0f} |'.format(plain, peaks[False] / 2 ** 20))
    print('| with statistics | {:.3f} | {:.0f} |'.format(
        with_stats, peaks[True] / 2 ** 20))
    print('time ratio: {:.2f}x; extra peak memory: {:.0f} MiB'.format(
        with_stats / plain, max(0, peaks[True] - peaks[False]) / 2 ** 20))


if __name__ == '__main__':
    main()
