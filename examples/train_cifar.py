#!/usr/bin/env python
"""Data-parallel training of the paper's VGG-like network (Appendix D) on
CIFAR-10 with compressed gradient exchange (ChainerMN).

    mpiexec -n 8 python examples/train_cifar.py --method vgc --alpha 2 \\
        --optimizer momentum --gpu 0
    mpiexec -n 2 python examples/train_cifar.py --synthetic --iterations 4

CIFAR-10 is downloaded by Chainer (needs the network); ``--synthetic``
generates CIFAR-shaped data for offline smoke runs.  Defaults follow Sec.
6.1: weight decay 5e-4 (both optimizers), 300 epochs, batch 64 per worker;
with ``--optimizer momentum`` the learning rate is 0.05 times the number of
workers, halved every 25 epochs.  The dense group and warm-up flags
(``--exclude``, ``--exclude-small``, ``--warmup``, ``--warmup-epochs``,
``--alpha-ramp``, ``--dense-dtype``, ``--uncovered``) are train_mnist.py's,
e.g. ``--exclude-small 1000`` sends the biases and batch normalization
parameters uncompressed.
"""

import argparse

import chainer
from chainer.training import extensions
import chainer.links as L
import numpy

import chainer_vgc
from chainer_vgc import datasets
from chainer_vgc.models import VGG
from train_mnist import add_compression_args
from train_mnist import add_extensions
from train_mnist import add_run_args
from train_mnist import final_report
from train_mnist import make_trainer
from train_mnist import print_summary
from train_mnist import resume
from train_mnist import start


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    add_compression_args(p)
    p.add_argument('--optimizer', choices=('adam', 'momentum'),
                   default='adam')
    p.add_argument('--lr', type=float, default=None,
                   help='momentum SGD learning rate (default 0.05 x workers)')
    p.add_argument('--lr-halving', type=int, default=25,
                   help='halve the momentum SGD learning rate every N epochs')
    p.add_argument('--weight-decay', type=float, default=5e-4)
    add_run_args(p, epoch=300, batchsize=64, out='result/cifar')
    p.add_argument('--width', type=float, default=1.0,
                   help='channel multiplier (1.0 = the paper network)')
    p.add_argument('--synthetic', action='store_true',
                   help='generated CIFAR-shaped data (offline)')
    args = p.parse_args()

    if args.synthetic:
        train, test = datasets.synthetic_cifar(seed=args.seed)
    else:
        try:
            train, test = chainer.datasets.get_cifar10()
        except Exception as e:
            raise SystemExit('CIFAR-10 could not be downloaded ({}); use '
                             '--synthetic for an offline run'.format(e))
    comm, device = start(args, train)
    numpy.random.seed(args.seed)
    model = L.Classifier(VGG(10, width=args.width))
    model(numpy.zeros((1, 3, 32, 32), numpy.float32),
          numpy.zeros(1, numpy.int32))
    model.to_device(device)
    if args.optimizer == 'adam':
        opt = chainer.optimizers.Adam()
    else:
        lr = args.lr if args.lr is not None else 0.05 * comm.size
        opt = chainer.optimizers.MomentumSGD(lr=lr, momentum=0.9)
    optimizer = chainer_vgc.create_multi_node_optimizer(opt, comm)
    optimizer.setup(model)
    if args.weight_decay:
        optimizer.add_hook(chainer.optimizer_hooks.WeightDecay(
            args.weight_decay))

    trainer, test_iter, stop, every = make_trainer(
        args, comm, optimizer, train, test, device, test_batch=256,
        reports=2)
    if args.optimizer == 'momentum':
        trainer.extend(extensions.ExponentialShift('lr', 0.5),
                       trigger=(args.lr_halving, 'epoch'))
    evaluator = add_extensions(trainer, comm, model, test_iter, device,
                               every, every, args.progress)
    resume(args, comm, trainer)
    trainer.run()
    report = final_report(evaluator, trainer, comm, args)
    if comm.rank == 0:
        print_summary(report)


if __name__ == '__main__':
    main()
