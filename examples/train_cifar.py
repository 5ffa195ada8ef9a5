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
``--alpha-ramp``, ``--dense-dtype``, ``--uncovered``) and the method's
flags are train_mnist.py's (example_common.py), e.g. ``--exclude-small
1000`` sends the biases and batch normalization parameters uncompressed.
"""

import argparse

import chainer
from chainer.training import extensions

import chainer_vgc
from chainer_vgc.harness import datasets
from chainer_vgc.harness.models import VGG
from example_common import add_compression_args
from example_common import add_extensions
from example_common import add_run_args
from example_common import final_report
from example_common import make_classifier
from example_common import make_optimizer
from example_common import make_trainer
from example_common import OPTIMIZERS
from example_common import print_summary
from example_common import resume
from example_common import setup_optimizer
from example_common import start


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    add_compression_args(p)
    p.add_argument('--optimizer', choices=OPTIMIZERS, default='adam')
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
    model = make_classifier(lambda: VGG(10, width=args.width), (3, 32, 32),
                            args.seed)
    model.to_device(device)
    lr = args.lr if args.lr is not None else 0.05 * comm.size
    opt, wd = make_optimizer(args.optimizer, lr, args.weight_decay,
                             args.method)
    optimizer = setup_optimizer(
        chainer_vgc.create_multi_node_optimizer(
            opt, comm, double_buffering=args.double_buffering), wd, model)

    trainer, test_iter, stop, every = make_trainer(
        args, comm, optimizer, train, test, device, test_batch=256,
        reports=2)
    if args.optimizer == 'momentum':
        trainer.extend(extensions.ExponentialShift('lr', 0.5),
                       trigger=(args.lr_halving, 'epoch'))
    evaluator = add_extensions(trainer, comm, model, test_iter, device,
                               every, every, args.progress,
                               args.plot)
    resume(args, comm, trainer)
    trainer.run()
    report = final_report(evaluator, trainer, comm, args)
    if comm.rank == 0:
        print_summary(report)


if __name__ == '__main__':
    main()
