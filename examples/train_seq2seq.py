"""A sequence-to-sequence model over variable-length sentences, data
parallel with compressed gradients: the shape of ChainerMN's seq2seq
example (``NStepLSTM`` encoder and decoder with dropout 0.1, ``EmbedID``
over the concatenated sentences, one output projection over all time
steps, a converter that passes the B source sentences and then the B
target sentences as 2B arrays), on a synthetic translation task.

    mpiexec -n 2 python examples/train_seq2seq.py --iterations 300
    mpiexec -n 2 python examples/train_seq2seq.py --communicator naive

The change from a ChainerMN script is the README's two lines plus one
option, because this converter's 2B arrays do not say which ones belong
together::

    comm = chainer_vgc.create_communicator(
        'vgc', alpha=2, examples=chainer_vgc.sentence_pairs)
    optimizer = chainer_vgc.create_multi_node_optimizer(
        chainer.optimizers.Adam(), comm)

(a converter returning ``{'xs': [...], 'ys': [...]}``, lists of one array
per example, needs no option).  The per-sample statistics trace each
token's row through the concatenations, the LSTMs' time steps and their
stacked weights to its sentence pair (``chainer_vgc.statistics.rows``).

The model and the task are ``chainer_vgc.harness.models.Seq2seq`` and
``sentence_pairs_task``: a source sentence of 2..``--max-length`` tokens
from a vocabulary of ``--vocab`` words; its translation is the sentence
reversed, each word mapped by a fixed permutation.  ``--communicator naive`` runs
ChainerMN's own naive communicator for comparison.  Rank 0 prints a JSON
summary: the loss of the last interval, seconds per iteration, and the
compression of the last interval and of the whole run.
"""

import argparse

import chainer
from chainer import training
import numpy

import chainer_vgc
from chainer_vgc.harness.models import Seq2seq
from chainer_vgc.harness.models import sentence_pairs_task
from example_common import add_sequence_args
from example_common import train_and_summarize

def convert(batch, device=None):
    """ChainerMN's seq2seq converter's layout: the B sources, then the B
    targets, as one tuple of 2B arrays."""
    sources = [chainer.dataset.to_device(device, x) for x, _ in batch]
    targets = [chainer.dataset.to_device(device, y) for _, y in batch]
    return tuple(sources + targets)


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    add_sequence_args(p, 'result_seq2seq')
    args = p.parse_args()

    if args.communicator == 'naive':
        import chainermn
        comm = chainermn.create_communicator('naive')
    else:
        kw = {'alpha': args.alpha} if args.method in ('vgc', 'hybrid') \
            else {}
        comm = chainer_vgc.create_communicator(
            args.method, examples=chainer_vgc.sentence_pairs, **kw)
    numpy.random.seed(args.seed)  # the same initial model on every rank
    model = Seq2seq(args.layers, args.vocab, args.vocab, args.units)
    if args.communicator == 'naive':
        import chainermn
        optimizer = chainermn.create_multi_node_optimizer(
            chainer.optimizers.Adam(), comm)
    else:
        optimizer = chainer_vgc.create_multi_node_optimizer(
            chainer.optimizers.Adam(), comm)
    optimizer.setup(model)

    pairs = sentence_pairs_task(args.examples, args.vocab, args.max_length,
                                args.seed)
    shard = pairs[comm.rank::comm.size]
    it = chainer.iterators.SerialIterator(shard, args.batchsize)
    updater = training.StandardUpdater(it, optimizer, converter=convert)
    train_and_summarize(updater, comm, model, args)


if __name__ == '__main__':
    main()
