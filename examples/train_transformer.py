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

import chainer
from chainer import training
import numpy

import chainer_vgc
from chainer_vgc.harness.models import Transformer
from chainer_vgc.harness.models import padded_pairs_task
from example_common import add_sequence_args
from example_common import train_and_summarize


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    add_sequence_args(p, 'result_transformer')
    p.add_argument('--heads', type=int, default=4)
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
    train_and_summarize(updater, comm, model, args)


if __name__ == '__main__':
    main()
