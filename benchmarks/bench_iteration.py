#!/usr/bin/env python
"""A whole training iteration as ChainerMN's examples run it, with the
README's two-line change against ChainerMN's own 'naive' communicator, at
the ranks ``mpiexec`` gives (issue 38: "vgc / plain per iteration").

Each rank builds the model twice from the same seed: one copy with
``chainermn.create_communicator('naive')`` and
``chainermn.create_multi_node_optimizer``, one with
``chainer_vgc.create_communicator('vgc', alpha=...)`` and
``chainer_vgc.create_multi_node_optimizer``; both are driven by Chainer's
``StandardUpdater`` over an iterator of synthetic labelled data (each rank
its own).  After warm-up iterations of both, they alternate, one iteration
at a time, with a barrier before each; an iteration's time is the slowest
rank's.  Printed: the medians, their ratio and vgc's compression.

Models (``--model``): ``vgg-cifar`` (the App. D VGG at full width with
dropout, batch 16 of 32x32x3: ChainerMN's CIFAR example's shape),
``resnet50`` (``BottleneckResNet``, batch 4 of 224x224x3: its ImageNet
example's shape) and ``transformer`` (``examples/train_transformer.py``'s
encoder-decoder, batch 16 of padded sentence pairs)::

    OPENBLAS_NUM_THREADS=1 mpiexec -n 2 python benchmarks/bench_iteration.py
"""

import argparse
import time

import chainer
import chainer.links as L
from chainer import training
import chainermn
from mpi4py import MPI
import numpy

import chainer_vgc
from chainer_vgc.reporting import run_summary
from chainer_vgc.harness.models import BottleneckResNet
from chainer_vgc.harness.models import Transformer
from chainer_vgc.harness.models import VGG
from chainer_vgc.harness.models import padded_pairs_task

from bench_common import machine

MODELS = {
    'vgg-cifar': (lambda: VGG(10, width=1.0, dropout=True), (3, 32, 32), 16,
                  10),
    'resnet50': (lambda: BottleneckResNet(1000), (3, 224, 224), 4, 1000),
    # examples/train_transformer.py's defaults: padded (B, T) token blocks
    'transformer': (lambda: Transformer(40, d=64, heads=4, layers=2,
                                        max_length=10), None, 16, 40),
}


def _updater(name, rank, comm, make_optimizer):
    make, shape, batch, classes = MODELS[name]
    numpy.random.seed(0)  # the same initial weights for both
    rng = numpy.random.default_rng(1 + rank)
    if shape is None:  # a sequence model: its own loss, padded pairs
        model = make()
        data = chainer.datasets.TupleDataset(*padded_pairs_task(
            8 * batch, classes, 10, 1 + rank))
    else:
        model = L.Classifier(make())
        data = chainer.datasets.TupleDataset(
            rng.normal(size=(8 * batch,) + shape).astype(numpy.float32),
            rng.integers(0, classes, 8 * batch).astype(numpy.int32))
    optimizer = make_optimizer(
        chainer.optimizers.MomentumSGD(lr=0.01), comm)
    optimizer.setup(model)
    it = chainer.iterators.SerialIterator(data, batch, shuffle=True)
    return training.updaters.StandardUpdater(it, optimizer)


def run(name, args, world):
    naive = chainermn.create_communicator('naive')
    vgc = chainer_vgc.create_communicator('vgc', alpha=args.alpha)
    updaters = {
        'naive': _updater(name, world.rank, naive,
                          chainermn.create_multi_node_optimizer),
        'vgc': _updater(name, world.rank, vgc,
                        chainer_vgc.create_multi_node_optimizer)}
    times = {k: [] for k in updaters}
    for i in range(args.warmup + args.iterations):
        for key, updater in updaters.items():
            world.Barrier()
            t0 = time.perf_counter()
            updater.update()
            spent = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            if i >= args.warmup:
                times[key].append(spent)
    naive_s, vgc_s = (float(numpy.median(times[k])) for k in ('naive',
                                                              'vgc'))
    st = vgc.state(updaters['vgc'].get_optimizer('main').target)
    compression = run_summary(st.totals, st.compressor, world.size)[
        'vgc/total_compression']
    return dict(model=name, naive=naive_s, vgc=vgc_s, ratio=vgc_s / naive_s,
                compression=compression)


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--model', choices=tuple(MODELS) + ('all',),
                   default='all')
    p.add_argument('--iterations', type=int, default=5,
                   help='timed iterations of each (median)')
    p.add_argument('--warmup', type=int, default=2)
    p.add_argument('--alpha', type=float, default=1.5)
    args = p.parse_args()
    world = MPI.COMM_WORLD
    names = tuple(MODELS) if args.model == 'all' else (args.model,)
    rows = [run(n, args, world) for n in names]
    if world.rank:
        return
    print('machine: {}, {} rank(s); median of {} iterations of each, '
          'alternating, after {} of warm-up; the slowest rank counts'.format(
              machine(chainer=True, mpi=True), world.size, args.iterations,
              args.warmup))
    print('| model | naive s | vgc s | vgc / naive | vgc compression |')
    print('|---|---:|---:|---:|---:|')
    for r in rows:
        print('| {model} | {naive:.3f} | {vgc:.3f} | {ratio:.2f} | '
              '{compression:,.1f} |'.format(**r))


if __name__ == '__main__':
    main()
