#!/usr/bin/env python
"""One rank of the emulated-network benchmark (started by bench_network.py).

Trains a model with a given exchange method for some steps and prints, on
rank 0, one JSON line with the median step time, the median exchange time,
the compression, the bytes this rank's interface sent/received (read from
/sys/class/net inside its network namespace) and what was expected.  With
``--double-buffering`` the exchange is timed on its background thread.
"""

import argparse
import json
import os

import chainer
import chainer.links as L
import chainermn
import numpy
from mpi4py import MPI

import chainer_vgc
from chainer_vgc import datasets
from chainer_vgc.models import MLP
from chainer_vgc.models import VGG

from bench_common import default
from bench_common import hyperparameters
from bench_common import timed

#: the phases of the compressed exchange (chainer_vgc's result.timing):
#: 'agree' is the fault codes' allgathers inside compress, split out of it
#: because it is mostly waiting for the slowest rank
PHASES = ('compress', 'agree', 'transport', 'decode')


def iface_bytes(iface):
    if not iface:
        return 0, 0
    base = '/sys/class/net/{}/statistics/'.format(iface)
    with open(base + 'tx_bytes') as f:
        tx = int(f.read())
    with open(base + 'rx_bytes') as f:
        rx = int(f.read())
    return tx, rx


def main():
    p = argparse.ArgumentParser()
    p.add_argument('--method', default='vgc',
                   help="'naive' (ChainerMN dense allreduce) or a "
                   'chainer_vgc method')
    p.add_argument('--alpha', type=float, default=default('alpha'))
    p.add_argument('--tau', type=float, default=default('tau'))
    p.add_argument('--model', choices=('mlp', 'vgg'), default='mlp')
    p.add_argument('--units', type=int, default=2500)
    p.add_argument('--batchsize', type=int, default=32)
    p.add_argument('--warmup', type=int, default=4)
    p.add_argument('--data', choices=('mnist', 'synthetic'), default='mnist',
                   help='MLP inputs: MNIST (each rank its own shard) or '
                   'random inputs labelled by a random linear teacher')
    p.add_argument('--steps', type=int, default=8)
    p.add_argument('--index-coding', default=None,
                   help="vgc/hybrid/strom: 'auto' (default), 'fixed' or "
                   "'gap'")
    p.add_argument('--double-buffering', action='store_true',
                   help='chainer_vgc methods: create_multi_node_optimizer('
                   '..., double_buffering=True)')
    p.add_argument('--iface', default=os.environ.get('FI_TCP_IFACE', ''))
    args = p.parse_args()

    world = MPI.COMM_WORLD
    if args.method == 'naive':
        comm = chainermn.create_communicator('naive', world)
        make_opt = chainermn.create_multi_node_optimizer
    else:
        kw = hyperparameters(args.method, alpha=args.alpha, tau=args.tau)
        if args.index_coding is not None:
            kw['index_coding'] = args.index_coding
        comm = chainer_vgc.create_communicator(args.method, world, **kw)
        def make_opt(opt, comm):
            return chainer_vgc.create_multi_node_optimizer(
                opt, comm, double_buffering=args.double_buffering)
    numpy.random.seed(0)
    rng = numpy.random.default_rng(world.rank)
    if args.model == 'mlp':
        model = L.Classifier(MLP((args.units,) * 3, 10))
        if args.data == 'mnist':
            train, _ = datasets.get_mnist()
            part = datasets.shard(train, world.rank, world.size)
            n = min(len(part), args.batchsize * (args.warmup + args.steps))
            x, t = (numpy.asarray(a) for a in
                    chainer.dataset.concat_examples(part[:n]))
        else:
            x = rng.normal(size=(args.batchsize * 8, 1024)).astype(
                numpy.float32)
    else:
        model = L.Classifier(VGG(10))
        x = rng.normal(size=(args.batchsize * 8, 3, 32, 32)).astype(
            numpy.float32)
    if args.model != 'mlp' or args.data != 'mnist':
        teacher = numpy.random.RandomState(1).normal(
            size=(x[0].size, 10)).astype(numpy.float32)
        t = (x.reshape(len(x), -1) @ teacher).argmax(axis=1).astype(
            numpy.int32)
    model(x[:1], t[:1])
    n_params = sum(q.size for q in model.params())
    opt = make_opt(chainer.optimizers.MomentumSGD(lr=0.01), comm)
    opt.setup(model)

    exchange, phases = [], []
    # chainer_vgc's exchanges, now or in the background, run
    # step.run_exchange (ChainerMN's optimizer calls multi_node_mean_grad):
    # time whichever the step runs
    if hasattr(comm, 'exchange_async'):
        from chainer_vgc import step as owner
        name = 'run_exchange'
    else:
        owner, name = comm, 'multi_node_mean_grad'
    inner = getattr(owner, name)

    def timed_exchange(*a, **k):
        result, seconds, _ = timed(inner, *a, **k)
        exchange.append(seconds)
        phases.append(dict(getattr(result, 'timing', None) or {}))
        return result
    setattr(owner, name, timed_exchange)

    steps = []
    before = None
    for k in range(args.warmup + args.steps):
        if k == args.warmup:
            exchange.clear()
            phases.clear()
            world.Barrier()
            before = iface_bytes(args.iface)
            totals = dict(getattr(comm, 'totals', {}))
        i = (k * args.batchsize) % len(x)
        world.Barrier()
        steps.append(timed(opt.update, model, x[i:i + args.batchsize],
                           t[i:i + args.batchsize])[1])
    world.Barrier()
    after = iface_bytes(args.iface)
    steps = steps[args.warmup:]
    tx, rx = after[0] - before[0], after[1] - before[1]
    info = dict(rank=world.rank, step=float(numpy.median(steps)),
                exchange=float(numpy.median(exchange)), tx=tx, rx=rx)
    for key in PHASES:
        if phases and key in phases[0]:
            info[key] = float(numpy.median([ph[key] for ph in phases]))
    if args.method != 'naive':  # over the measured steps only
        info['wire'] = comm.totals['bytes'] - totals['bytes']
        info['elements'] = comm.totals['elements'] - totals['elements']
        info['vgc_steps'] = comm.totals['steps'] - totals['steps']
    everyone = world.gather(info)
    if world.rank == 0:
        pmax = max(everyone, key=lambda r: r['step'])
        method = args.method + ('' if args.index_coding is None
                                else ':' + args.index_coding) + (
            '+db' if args.double_buffering else '')
        out = dict(method=method, workers=world.size, params=n_params,
                   model=args.model, batchsize=args.batchsize,
                   data=args.data if args.model == 'mlp' else 'synthetic',
                   warmup=args.warmup, steps=args.steps, step_s=pmax['step'],
                   exchange_s=max(r['exchange'] for r in everyone),
                   phases_s={key: max(r[key] for r in everyone)
                             for key in PHASES if key in everyone[0]},
                   tx_bytes_per_rank=sum(r['tx'] for r in everyone) /
                   world.size / args.steps,
                   rx_bytes_per_rank=sum(r['rx'] for r in everyone) /
                   world.size / args.steps)
        if args.method != 'naive':
            elements = everyone[0]['elements'] / world.size  # per rank
            out['compression'] = (n_params * everyone[0]['vgc_steps'] /
                                  elements if elements else float('inf'))
            out['wire_bytes_per_rank'] = everyone[0]['wire'] / \
                everyone[0]['vgc_steps']
        else:
            out['compression'] = 1.0
            out['wire_bytes_per_rank'] = 2 * (world.size - 1) * 4 * \
                n_params / world.size
        print('RESULT ' + json.dumps(out), flush=True)


if __name__ == '__main__':
    main()
