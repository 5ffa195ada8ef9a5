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
import json
import time

import chainer
from chainer import training
from chainer.training import extensions
import numpy

import chainer_vgc
from chainer_vgc.harness.models import Seq2seq
from chainer_vgc.harness.models import sentence_pairs_task

def convert(batch, device=None):
    """ChainerMN's seq2seq converter's layout: the B sources, then the B
    targets, as one tuple of 2B arrays."""
    sources = [chainer.dataset.to_device(device, x) for x, _ in batch]
    targets = [chainer.dataset.to_device(device, y) for _, y in batch]
    return tuple(sources + targets)


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
    p.add_argument('--vocab', type=int, default=40)
    p.add_argument('--max-length', type=int, default=10)
    p.add_argument('--examples', type=int, default=4000,
                   help='sentence pairs in the training set')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--by-parameter', action='store_true',
                   help="each parameter's share of the elements sent and "
                   'its density, in the log and the summary')
    p.add_argument('--out', default='result_seq2seq')
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
    if comm.rank == 0:
        print('summary ' + json.dumps(summary, sort_keys=True))


if __name__ == '__main__':
    main()
