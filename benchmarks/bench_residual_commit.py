#!/usr/bin/env python
"""The native compress in place (the default) against spare residuals and
against a memory copy, side by side, for every rule with a native pass.

    OPENBLAS_NUM_THREADS=1 python benchmarks/bench_residual_commit.py

One process, the generated gradient stream of ``bench_compress.py``
(``--params`` float32 parameters in VGG-like tensors, a small mean plus
the noise of a 64-example batch).  For each rule (vgc, hybrid, strom,
none) and index coding ('auto', 'fixed'; none has one format), two
compressors take their steps in turn, one step each, so that this VM's
drifting bandwidth falls on both alike:

- ``GradientCompressor(...)``, the default, which ``create_communicator``
  builds: every input checked by one read-only pass, then the state
  updated in place;
- ``GradientCompressor(..., spare_residuals=True)``: each step's state
  written into a second set, swapped in when no tensor faulted.

Prints the median of each, in place / spare and in place /
``numpy.copyto`` of the gradient bytes, and the targets of issue 48
(in place <= 1.1x spare and <= 3x copyto).
"""

import argparse
import os

# as bench_compress.py: keep the OpenMP threads on distinct cores
os.environ.setdefault('OMP_PROC_BIND', 'close')

import numpy  # NOQA: E402

from chainer_vgc.engines.native import bindings  # NOQA: E402

from bench_common import hyperparameters  # NOQA: E402
from bench_common import machine  # NOQA: E402
from bench_common import median_time  # NOQA: E402
from bench_compress import Stream  # NOQA: E402
from bench_compress import interleaved_compress  # NOQA: E402

#: (rule, index coding or None) in the order printed
RUNS = [('vgc', 'auto'), ('vgc', 'fixed'), ('hybrid', 'auto'),
        ('hybrid', 'fixed'), ('strom', 'auto'), ('strom', 'fixed'),
        ('none', None)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('--params', type=int, default=25_000_000)
    ap.add_argument('--draws', type=int, default=4)
    ap.add_argument('--warmup', type=int, default=10)
    ap.add_argument('--repeat', type=int, default=9)
    args = ap.parse_args()
    stream = Stream(args.params, args.draws)
    src = numpy.concatenate([g.ravel() for g in stream.draws[0]])
    dst = numpy.empty_like(src)
    copy_t = median_time(lambda: numpy.copyto(dst, src), 2 * args.repeat)
    print('machine: {}; native build: {}, {} threads'.format(
        machine(processor=True), bindings.isa(), bindings.num_threads()))
    print('{:,} float32 parameters in {} tensors ({:.0f} MB); '
          'numpy.copyto of the gradient bytes {:.1f} ms; {} warm-up steps, '
          'medians of {} steps taken in turn'.format(
              args.params, len(stream.shapes), src.nbytes / 1e6,
              1e3 * copy_t, args.warmup, args.repeat))
    print()
    print('| rule | coding | in place ms | spare ms | in place / spare | '
          'in place / copyto | spare / copyto |')
    print('|---|---|---:|---:|---:|---:|---:|')
    worst_spare = worst_copy = 0.0
    for method, coding in RUNS:
        kw = hyperparameters(method)
        if coding is not None:
            kw['index_coding'] = coding
        comps = [stream.compressor(method, 'native', **kw),
                 stream.compressor(method, 'native', spare_residuals=True,
                                   **kw)]
        assert not comps[0].spare_residuals, 'the default is in place'
        in_place, spare = interleaved_compress(stream, comps, args.warmup,
                                               args.repeat)
        worst_spare = max(worst_spare, in_place / spare)
        worst_copy = max(worst_copy, in_place / copy_t)
        print('| {} | {} | {:.1f} | {:.1f} | {:.2f} | {:.2f} | {:.2f} |'
              .format(method, coding or '-', 1e3 * in_place, 1e3 * spare,
                      in_place / spare, in_place / copy_t, spare / copy_t),
              flush=True)
    print()
    print('worst in place / spare:  {:.2f} (target <= 1.10)'.format(
        worst_spare))
    print('worst in place / copyto: {:.2f} (target <= 3)'.format(worst_copy))


if __name__ == '__main__':
    main()
