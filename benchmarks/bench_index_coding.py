#!/usr/bin/env python
"""Bits per sent element of the index codes, on the indices real training
selects.

Trains the ``make demo`` setting (MNIST MLP 784-200-200-10, 4 workers x 32
examples, Adam, VGC alpha = 2, 10 epochs) and the hybrid tau = 0.1 setting
in the one-process simulation (chainer_vgc.SimulatedWorkers: the messages of
an ``mpiexec -n 4`` run, bit for bit), keeps every worker's message of every
step, and prices the same elements with each code, side by side:

``fixed``          the paper's 32-bit word per element (FMT_POW2)
``sent``           what chainer-vgc sent (index_coding='auto': per tensor and
                   step the smaller of FMT_POW2 and FMT_GAP)
``rice``           FMT_GAP for every tensor (no spans): Rice codes, k from
                   the density
``rice best k``    Rice codes with each group's best k (an oracle: k is
                   chosen after seeing the gaps)
``exp-Golomb``     exponential Golomb codes with each group's best order
``gamma``          Elias-gamma codes of gap + 1 (no parameter)
``subset bound``   log2 C(size, count) per element: the information in
                   *which* elements were sent, whatever the code

Every code column adds the same value bits (4 per element; 1 with hybrid:
the sign) and headers, so the columns differ in the index code alone; the
last column adds the value bits to the bound.  Over the run and over its
last epoch.

    python benchmarks/bench_index_coding.py [--epochs 10]
"""

import argparse
import math
import os
import sys
import time

import chainer
import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), 'examples'))

from chainer_vgc import codec  # NOQA: E402
from chainer_vgc.codec.gap import bit_length  # NOQA: E402
from chainer_vgc.codec.gap import index_gaps  # NOQA: E402
from chainer_vgc.codec.gap import span_parts  # NOQA: E402
from chainer_vgc.codec.message import walk  # NOQA: E402
from chainer_vgc.harness import datasets  # NOQA: E402
from chainer_vgc import GradientCompressor  # NOQA: E402
from chainer_vgc.harness.simulation import SimulatedWorkers  # NOQA: E402

from bench_common import machine  # NOQA: E402
from example_common import make_model  # NOQA: E402

RUNS = [('vgc', dict(alpha=2.0), 'the make demo run'),
        ('hybrid', dict(alpha=2.0, tau=0.1), 'hybrid tau = 0.1')]
CODES = ('fixed', 'sent', 'rice', 'rice best k', 'exp-Golomb', 'gamma',
         'subset bound')


def groups_of(message, sizes):
    """(size, index, nibbles) per tensor of every pow2/gap group of a
    message (a FMT_GAP group spanning tensors split over them)."""
    return [(sizes[t], index, nib)
            for g in walk(message, sizes)
            if g.fmt in (codec.FMT_POW2, codec.FMT_GAP)
            for t, index, nib in span_parts(g, sizes)]


def _floor_log2(v):
    return bit_length(v) - 1


def index_bits(size, index):
    """{code: bits of the index part} of one group."""
    gaps = index_gaps(index)
    count = gaps.size
    bits = {}
    bits['rice'] = int(codec.gap_code_lengths(
        gaps, codec.rice_parameter(count, size)).sum())
    bits['rice best k'] = min(int(codec.gap_code_lengths(gaps, k).sum())
                              for k in range(0, 40))
    bits['exp-Golomb'] = min(
        int((2 * _floor_log2(gaps + (1 << k)) - k + 1).sum())
        for k in range(0, 40))
    bits['gamma'] = int((2 * _floor_log2(gaps + 1) + 1).sum())
    bits['subset bound'] = (math.lgamma(size + 1) - math.lgamma(count + 1)
                            - math.lgamma(size - count + 1)) / math.log(2)
    return bits


def price(messages, sizes, sign_only):
    """{code: bits} of a list of messages, and the elements they carry."""
    total = dict.fromkeys(CODES, 0.0)
    elements = 0
    for m in messages:
        total['sent'] += 32 * m.size
        fixed = 32 * 2
        groups = groups_of(m, sizes)
        for size, index, nib in groups:
            count = index.size
            elements += count
            fixed += 32 * (codec.HEADER_WORDS + count)
            values = count * (1 if sign_only else 4)
            # header, param words and word padding of a FMT_GAP group
            overhead = 32 * (codec.HEADER_WORDS + codec.GAP_PARAM_WORDS) + 32
            for code, b in index_bits(size, index).items():
                total[code] += b + values + (0 if code == 'subset bound'
                                             else overhead)
        total['fixed'] += fixed
        for code in ('rice', 'rice best k', 'exp-Golomb', 'gamma'):
            total[code] += 64  # the message header
    return total, elements


def train(method, kw, epochs, workers=4, batch=32, seed=0):
    """Per step, the workers' messages of the simulated run."""
    train_set, _ = datasets.get_mnist()
    model = make_model(200, seed)  # the demo's model and initial values
    opt = chainer.optimizers.Adam()
    opt.setup(model)
    sim = SimulatedWorkers(model, opt, workers, method, **kw)
    steps_per_epoch = len(train_set) // (workers * batch)
    shards = [datasets.shard(train_set, r, workers, seed)
              for r in range(workers)]
    recorded = []
    original = GradientCompressor.compress

    def recording(comp, *a, **k):  # keep every message the workers send
        m = original(comp, *a, **k)
        recorded[-1].append(numpy.array(m, copy=True))
        return m
    GradientCompressor.compress = recording
    try:
        for step in range(epochs * steps_per_epoch):
            recorded.append([])
            i = (step % steps_per_epoch) * batch
            batches = [chainer.dataset.concat_examples(s[i:i + batch])
                       for s in shards]
            sim.update(model, batches)
    finally:
        GradientCompressor.compress = original
    return recorded, steps_per_epoch, sim


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--epochs', type=int, default=10)
    args = p.parse_args()
    print('machine: {}'.format(machine()))
    rows = []
    for method, kw, what in RUNS:
        t0 = time.time()
        recorded, per_epoch, sim = train(method, kw, args.epochs)
        sizes = sim.compressor.sizes
        sign_only = method != 'vgc'
        for scope, steps in (('run', recorded),
                             ('last epoch', recorded[-per_epoch:])):
            msgs = [m for step in steps for m in step]
            total, elements = price(msgs, sizes, sign_only)
            density = elements / (len(msgs) * sum(sizes))
            rows.append((what, scope, 1 / density if density else 0,
                         {c: total[c] / elements for c in CODES}))
        print('{} ({} {}): {} steps in {:.0f} s'.format(
            what, method, kw, len(recorded), time.time() - t0), flush=True)
    print('\nBits per sent element (headers and values included), 4 workers, '
          '{} epochs:\n'.format(args.epochs))
    print('| run | scope | 1 element in | ' + ' | '.join(CODES) + ' |')
    print('|---|---|---:|' + '---:|' * len(CODES))
    for what, scope, inv, bits in rows:
        print('| {} | {} | {:,.0f} | '.format(what, scope, inv)
              + ' | '.join('{:.1f}'.format(bits[c]) for c in CODES) + ' |')


if __name__ == '__main__':
    main()
