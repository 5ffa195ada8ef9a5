"""A Transformer encoder-decoder, data parallel with compressed gradients,
with the README's two lines and no option: padded blocks of token ids
(B, T) through Chainer's default converter, ``L.Linear`` over batch x
length rows, ``L.LayerNormalization``, a tied embedding, a learned
positional embedding added by broadcast, dropout, the loss divided by the
token count (``chainer_vgc.harness.models.Transformer``, written here).

    mpiexec -n 2 python examples/train_transformer.py --iterations 300
    mpiexec -n 2 python examples/train_transformer.py --communicator naive

The change from a ChainerMN script is the two lines::

    comm = chainer_vgc.create_communicator('vgc', alpha=2)
    optimizer = chainer_vgc.create_multi_node_optimizer(
        chainer.optimizers.Adam(), comm)

The task is ``padded_pairs_task``: a source of 2..``--max-length`` words
from ``--vocab``; its target the source reversed with each word mapped by
a fixed permutation, both padded with -1.  Every parameter's per-sample
statistics are exact (``tests/test_statistics_families.py`` checks them
against brute force).  Rank 0 prints a JSON summary: the loss of the last
interval, seconds per iteration, and the compression of the last interval
and of the whole run, per parameter where ``--by-parameter`` asks.
"""

import argparse
import json
import time

import chainer
from chainer import training
from chainer.training import extensions
import numpy

import chainer_vgc
from chainer_vgc.harness.models import Transformer
from chainer_vgc.harness.models import padded_pairs_task


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--communicator', choices=('vgc', 'naive'),
                   default='vgc')
    p.add_argument('--method', default='vgc')
    p.add_argument('--alpha', type=float, default=2.0)
    p.add_argument('--iterations', type=int, default=300)
    p.add_argument('--batchsize', type=int, default=16,
                   help='sentence pairs per rank and step')
    p.add_argument('--layers', type=int, default=2)
    p.add_argument('--units', type=int, default=64)
    p.add_argument('--heads', type=int, default=4)
    p.add_argument('--vocab', type=int, default=40)
    p.add_argument('--max-length', type=int, default=10)
    p.add_argument('--examples', type=int, default=4000,
                   help='sentence pairs in the training set')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--by-parameter', action='store_true',
                   help="each parameter's share of the elements sent")
    p.add_argument('--out', default='result_transformer')
    args = p.parse_args()

    if args.communicator == 'naive':
        import chainermn
        comm = chainermn.create_communicator('naive')
    else:
        kw = {'alpha': args.alpha} if args.method in ('vgc', 'hybrid') \
            else {}
        comm = chainer_vgc.create_communicator(args.method, **kw)
    numpy.random.seed(args.seed)  # the same initial model on every rank
    model = Transformer(args.vocab, d=args.units, heads=args.heads,
                        layers=args.layers, max_length=args.max_length)
    if args.communicator == 'naive':
        import chainermn
        optimizer = chainermn.create_multi_node_optimizer(
            chainer.optimizers.Adam(), comm)
    else:
        optimizer = chainer_vgc.create_multi_node_optimizer(
            chainer.optimizers.Adam(), comm)
    optimizer.setup(model)

    source, target = padded_pairs_task(args.examples, args.vocab,
                                       args.max_length, args.seed)
    data = chainer.datasets.TupleDataset(source, target)
    shard = data[comm.rank::comm.size]
    it = chainer.iterators.SerialIterator(shard, args.batchsize)
    updater = training.StandardUpdater(it, optimizer)
    trainer = training.Trainer(updater, (args.iterations, 'iteration'),
                               out=args.out)
    every = (max(1, args.iterations // 5), 'iteration')
    log = extensions.LogReport(trigger=every)
    trainer.extend(log)
    keys = ['iteration', 'main/loss']
    if args.communicator == 'vgc':
        trainer.extend(chainer_vgc.extensions.CompressionReport(
            comm, trigger=every, by_parameter=args.by_parameter))
        keys.append('vgc/interval_compression')
    if comm.rank == 0:
        trainer.extend(extensions.PrintReport(keys), trigger=every)
    start = time.perf_counter()
    trainer.run()
    seconds = time.perf_counter() - start
    summary = {'communicator': args.communicator, 'ranks': comm.size,
               'iterations': args.iterations,
               'seconds_per_iteration': seconds / args.iterations,
               'loss': log.log[-1].get('main/loss') if log.log else None}
    if args.communicator == 'vgc':
        totals = comm.state(model).totals
        per_rank = totals['elements'] / comm.size
        summary['compression_run'] = (totals['param_elements'] / per_rank
                                      if per_rank else None)
        summary['compression_last'] = log.log[-1].get(
            'vgc/interval_compression') if log.log else None
        if args.by_parameter and log.log:  # the last interval's
            summary['density_last'] = {
                k[len('vgc/density'):]: v for k, v in log.log[-1].items()
                if k.startswith('vgc/density')}
        summary['dense'] = sorted(comm.state(model).dense)
    if comm.rank == 0:
        print('summary ' + json.dumps(summary, sort_keys=True))


if __name__ == '__main__':
    main()
