#!/usr/bin/env python
"""The native compress with spare residuals against in place, side by side.

    OPENBLAS_NUM_THREADS=1 python benchmarks/bench_residual_commit.py

One process, the same gradients and sums of squares (``--tensors`` of
``--size`` float32 elements each; default 9 x 2.9M, about 26M), VGC
alpha 2: ``GradientCompressor(..., spare_residuals=True)`` writes each
step's r and v into a second set and swaps it in when no tensor faulted;
``spare_residuals=False`` (the communicator's default) checks every input
first and updates r and v in place.  Prints the minimum and median of the
steps after two warm-ups, and a memory copy of the gradients for scale.
"""

import argparse
import time

import numpy

from chainer_vgc import GradientCompressor


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--tensors', type=int, default=9)
    ap.add_argument('--size', type=int, default=2_900_000)
    ap.add_argument('--steps', type=int, default=8)
    args = ap.parse_args()
    rng = numpy.random.default_rng(0)
    shapes = [(args.size,)] * args.tensors
    gs = [(rng.normal(size=s) * 0.01).astype(numpy.float32) for s in shapes]
    ss = [(rng.random(s) * 1e-4).astype(numpy.float32) for s in shapes]
    names = [str(i) for i in range(len(shapes))]
    times = {}
    for spare in (True, False):
        comp = GradientCompressor('vgc', names, shapes,
                                  [numpy.float32] * len(shapes),
                                  backend='native', spare_residuals=spare,
                                  alpha=2.0)
        ts = []
        for _ in range(args.steps + 2):
            t = time.perf_counter()
            comp.compress(gs, ss, copy=False)
            ts.append(time.perf_counter() - t)
        times[spare] = ts[2:]
    flat = numpy.concatenate(gs)
    dst = numpy.empty_like(flat)
    copies = []
    for _ in range(5):
        t = time.perf_counter()
        numpy.copyto(dst, flat)
        copies.append(time.perf_counter() - t)
    print('{} x {:,} float32 ({:.0f} MB)'.format(
        args.tensors, args.size, flat.nbytes / 1e6))
    for spare, label in ((True, 'spare residuals'), (False, 'in place')):
        print('  {:<16} min {:6.1f} ms  median {:6.1f} ms  ({:.1f}x a '
              'copy)'.format(label, 1e3 * min(times[spare]),
                             1e3 * numpy.median(times[spare]),
                             min(times[spare]) / min(copies)))
    print('  in place / spare: {:.2f}x (min)'.format(
        min(times[False]) / min(times[True])))


if __name__ == '__main__':
    main()
