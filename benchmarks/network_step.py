#!/usr/bin/env python
"""One rank of the emulated-network benchmark (started by bench_network.py).

Trains a model with a given exchange method for some steps and prints, on
rank 0, one JSON line with the median step time, the median exchange time,
the compression, the bytes this rank's interface sent/received (read from
/sys/class/net inside its network namespace) and what was expected.  With
``--double-buffering`` the exchange is timed on its background thread.

With ``--ranks-per-node K`` the ranks r // K share one interface (one
emulated node): the bytes are also reported per node, from the counters
its first rank read, beside the nodes MPI itself sees
(``MPI_Comm_split_type(SHARED)``) and each rank's host name.  ``--hierarchy
node`` gives the chainer_vgc communicator ``hierarchy='node'``.

``--to-accuracy A`` trains instead until the accuracy on the MNIST test set
(``--eval-examples`` of it, a fixed seeded subset) reaches A, evaluating
every ``--eval-every`` steps outside the timed region, or until
``--max-steps`` or ``--max-seconds`` of timed training; the final accuracy
is then measured on the whole test set.
"""

import argparse
import json
import os
import socket
import sys
import time

import chainer
import chainer.links as L
import chainermn
import numpy
from mpi4py import MPI

import chainer_vgc
from chainer_vgc.harness import datasets
from chainer_vgc.harness.models import MLP
from chainer_vgc.harness.models import VGG

from bench_common import default
from bench_common import hyperparameters
from bench_common import timed
from bench_network import to_accuracy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), 'examples'))
from example_common import make_optimizer as make_example_optimizer  # NOQA
from example_common import with_optimizer  # NOQA: E402

#: the phases of the compressed exchange (chainer_vgc's result.timing):
#: 'agree' is the fault codes' allgathers inside compress, split out of it
#: because it is mostly waiting for the slowest rank
PHASES = ('compress', 'agree', 'transport', 'decode')
#: 'agree' split by :func:`agreement_split`: 'agree_spread' (the last
#: rank's arrival at each agreement minus the first's: the ranks'
#: imbalance) and 'agree_itself' (the last rank's departure minus the last
#: arrival: the collective once everyone is there)
AGREE_SPLIT = ('agree_spread', 'agree_itself')


def agreement_split(spans_by_rank):
    """Medians over the steps of the two parts of the agreements (see
    :data:`AGREE_SPLIT`), summed over the agreements of a step, from
    ``spans_by_rank[r][step]`` = that step's ``[(arrived, left), ...]`` on
    rank r.  The ranks of an emulated network run on one machine, so their
    ``perf_counter`` (CLOCK_MONOTONIC) is one clock."""
    steps = min(len(s) for s in spans_by_rank)
    if not steps:
        return {}
    spread, itself = [], []
    for k in range(steps):
        calls = [s[k] for s in spans_by_rank]
        n = min(len(c) for c in calls)
        arrive = [[c[j][0] for c in calls] for j in range(n)]
        leave = [[c[j][1] for c in calls] for j in range(n)]
        spread.append(sum(max(a) - min(a) for a in arrive))
        itself.append(sum(max(d) - max(a) for a, d in zip(arrive, leave)))
    return dict(zip(AGREE_SPLIT, (float(numpy.median(spread)),
                                  float(numpy.median(itself)))))


def iface_bytes(iface):
    """(tx, rx) bytes of interface ``iface`` so far ((0, 0) without one:
    loopback runs of the tests)."""
    if not iface or not os.path.exists('/sys/class/net/' + iface):
        return 0, 0
    base = '/sys/class/net/{}/statistics/'.format(iface)
    with open(base + 'tx_bytes') as f:
        tx = int(f.read())
    with open(base + 'rx_bytes') as f:
        rx = int(f.read())
    return tx, rx


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument('--method', default='vgc',
                   help="'naive' (ChainerMN dense allreduce) or a "
                   'chainer_vgc method')
    p.add_argument('--hierarchy', choices=('node',), default=None,
                   help="chainer_vgc methods: create_communicator(..., "
                   "hierarchy='node')")
    p.add_argument('--ranks-per-node', type=int, default=1,
                   help='ranks r // K share one interface (the launch '
                   'layout), for the bytes per node')
    p.add_argument('--alpha', type=float, default=default('alpha'))
    p.add_argument('--tau', type=float, default=default('tau'))
    p.add_argument('--model', choices=('mlp', 'vgg'), default='mlp')
    p.add_argument('--units', type=int, default=2500)
    p.add_argument('--batchsize', type=int, default=32)
    p.add_argument('--optimizer', choices=('momentum', 'adam'),
                   default='momentum',
                   help='momentum SGD (momentum 0.9, --lr) or Adam (its '
                   'default step size, as examples/train_mnist.py)')
    p.add_argument('--lr', type=float, default=0.01,
                   help='momentum SGD learning rate')
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
    p.add_argument('--spare-residuals', action='store_true',
                   help='chainer_vgc methods: create_communicator(..., '
                   'spare_residuals=True) (default: the residuals updated '
                   'in place, as create_communicator builds it)')
    p.add_argument('--iface', default=os.environ.get('FI_TCP_IFACE', ''))
    p.add_argument('--to-accuracy', type=float, default=None,
                   help='train until this test accuracy (0..1) instead')
    p.add_argument('--eval-every', type=int, default=50)
    p.add_argument('--eval-examples', type=int, default=10000,
                   help='test examples of each evaluation (a seeded '
                   'subset; 10000: all of them)')
    p.add_argument('--max-steps', type=int, default=3000)
    p.add_argument('--max-seconds', type=float, default=600,
                   help='cap on the timed training seconds')
    args = p.parse_args(argv)
    if (args.hierarchy or args.spare_residuals) and args.method == 'naive':
        p.error('--hierarchy and --spare-residuals are for chainer_vgc '
                'methods, not naive')
    if args.to_accuracy is not None and (args.model, args.data) != (
            'mlp', 'mnist'):
        p.error('--to-accuracy trains the MLP on MNIST')
    return args


def label(args):
    """The method as bench_network.py names it: vgc-node:fixed+db."""
    return args.method + ('-' + args.hierarchy if args.hierarchy else '') + (
        '' if args.index_coding is None else ':' + args.index_coding) + (
        '+db' if args.double_buffering else '') + (
        '+spare' if args.spare_residuals else '')


def make_communicator(args, world):
    """(communicator, function making the multi-node optimizer)."""
    if args.method == 'naive':
        return (chainermn.create_communicator('naive', world),
                chainermn.create_multi_node_optimizer)
    kw = with_optimizer(args.method, hyperparameters(
        args.method, alpha=args.alpha, tau=args.tau), args.optimizer)
    if args.index_coding is not None:
        kw['index_coding'] = args.index_coding
    if args.hierarchy is not None:
        kw['hierarchy'] = args.hierarchy
    if args.spare_residuals:
        kw['spare_residuals'] = True
    comm = chainer_vgc.create_communicator(args.method, world, **kw)

    def make_opt(opt, comm):
        return chainer_vgc.create_multi_node_optimizer(
            opt, comm, double_buffering=args.double_buffering)
    return comm, make_opt


def make_data(args, rank, size):
    """The model (initialized) and this rank's training inputs/labels."""
    numpy.random.seed(0)
    rng = numpy.random.default_rng(rank)
    if args.model == 'mlp':
        model = L.Classifier(MLP((args.units,) * 3, 10))
        if args.data == 'mnist':
            train, _ = datasets.get_mnist()
            part = datasets.shard(train, rank, size)
            n = len(part) if args.to_accuracy is not None else min(
                len(part), args.batchsize * (args.warmup + args.steps))
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
    return model, x, t


def make_optimizer(args):
    """Adam, or momentum SGD (dgc: plain SGD, the momentum being the
    rule's; examples/example_common.py's make_optimizer)."""
    return make_example_optimizer(args.optimizer, args.lr,
                                  method=args.method)[0]


def time_exchanges(comm):
    """Wrap the exchange the step runs; returns the lists of its wall
    seconds and of its phases, appended to at every exchange."""
    exchange, phases = [], []
    # chainer_vgc's exchanges, now or in the background, run
    # step.run_exchange, or the communicator's own (_run: the hierarchical
    # one's node_step.run_node_exchange), each looked up at every exchange;
    # ChainerMN's optimizer calls multi_node_mean_grad: time whichever the
    # step runs
    if getattr(comm, '_run', None) is not None:
        owner = sys.modules[comm._run.__module__]
        name = comm._run.__name__
    elif hasattr(comm, 'exchange_async'):
        from chainer_vgc.exchange import run as owner
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
    return exchange, phases


def layout(world):
    """This rank's host name and the world rank of the first rank of its
    MPI node (MPI_Comm_split_type SHARED), with that node's size."""
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    leader = node.bcast(world.rank)
    size = node.size
    node.Free()
    return dict(host=socket.gethostname(), leader=leader, node_size=size)


def node_bytes(everyone, k, steps):
    """Per node of ``k`` consecutive ranks, the bytes/step its interface
    sent and received, read by its first rank."""
    firsts = everyone[::k]
    return ([r['tx'] / steps for r in firsts],
            [r['rx'] / steps for r in firsts])


def main():
    args = parse_args()
    world = MPI.COMM_WORLD
    if world.size % args.ranks_per_node:
        raise SystemExit('network_step: {} ranks are not nodes of {}'
                         .format(world.size, args.ranks_per_node))
    comm, make_opt = make_communicator(args, world)
    model, x, t = make_data(args, world.rank, world.size)
    n_params = sum(q.size for q in model.params())
    opt = make_opt(make_optimizer(args), comm)
    opt.setup(model)
    exchange, phases = time_exchanges(comm)
    where = layout(world)
    out = dict(method=label(args), workers=world.size, params=n_params,
               model=args.model, batchsize=args.batchsize,
               data=args.data if args.model == 'mlp' else 'synthetic',
               ranks_per_node=args.ranks_per_node,
               optimizer=args.optimizer)
    if args.to_accuracy is not None:
        accuracy_run(args, world, comm, model, opt, x, t, exchange, out,
                     where)
    else:
        timing_run(args, world, comm, model, opt, x, t, exchange, phases,
                   out, where)


def timing_run(args, world, comm, model, opt, x, t, exchange, phases, out,
               where):
    steps = []
    before = None
    for k in range(args.warmup + args.steps):
        if k == args.warmup:
            exchange.clear()
            phases.clear()
            world.Barrier()
            before = iface_bytes(args.iface)
            lo_before = iface_bytes('lo')
            totals = dict(run_totals(comm, model) or {})
        i = (k * args.batchsize) % len(x)
        world.Barrier()
        steps.append(timed(opt.update, model, x[i:i + args.batchsize],
                           t[i:i + args.batchsize])[1])
    world.Barrier()
    after = iface_bytes(args.iface)
    lo_after = iface_bytes('lo')
    steps = steps[args.warmup:]
    tx, rx = after[0] - before[0], after[1] - before[1]
    info = dict(where, rank=world.rank, step=float(numpy.median(steps)),
                exchange=float(numpy.median(exchange)), tx=tx, rx=rx,
                lo=lo_after[0] - lo_before[0])
    for key in PHASES:
        if phases and key in phases[0]:
            info[key] = float(numpy.median([ph[key] for ph in phases]))
    if phases and 'agree_spans' in phases[0]:
        info['agree_spans'] = [ph['agree_spans'] for ph in phases]
    if args.method != 'naive':  # over the measured steps only
        now = run_totals(comm, model)
        info['wire'] = now['bytes'] - totals['bytes']
        info['elements'] = now['elements'] - totals['elements']
        info['vgc_steps'] = now['steps'] - totals['steps']
        for key in ('message_bits', 'message_elements'):
            info[key] = now.get(key, 0) - totals.get(key, 0)
    everyone = world.gather(info)
    if world.rank != 0:
        return
    pmax = max(everyone, key=lambda r: r['step'])
    tx_node, rx_node = node_bytes(everyone, args.ranks_per_node, args.steps)
    out.update(warmup=args.warmup, steps=args.steps, step_s=pmax['step'],
               exchange_s=max(r['exchange'] for r in everyone),
               phases_s=dict({key: max(r[key] for r in everyone)
                              for key in PHASES if key in everyone[0]},
                             **(agreement_split(
                                 [r['agree_spans'] for r in everyone])
                                if 'agree_spans' in everyone[0] else {})),
               tx_bytes_per_rank=sum(r['tx'] for r in everyone) /
               world.size / args.steps,
               rx_bytes_per_rank=sum(r['rx'] for r in everyone) /
               world.size / args.steps,
               tx_bytes_by_node=tx_node, rx_bytes_by_node=rx_node,
               tx_bytes_per_node=sum(tx_node) / len(tx_node),
               rx_bytes_per_node=sum(rx_node) / len(rx_node),
               lo_bytes_by_node=[r['lo'] / args.steps
                                 for r in everyone[::args.ranks_per_node]],
               hosts=[r['host'] for r in everyone],
               mpi_leaders=[r['leader'] for r in everyone])
    if args.method != 'naive':
        elements = everyone[0]['elements'] / world.size  # per rank
        out['compression'] = (out['params'] * everyone[0]['vgc_steps'] /
                              elements if elements else float('inf'))
        out['wire_bytes_per_rank'] = everyone[0]['wire'] / \
            everyone[0]['vgc_steps']
        if everyone[0]['message_elements']:
            out['bits_per_element'] = (everyone[0]['message_bits'] /
                                       everyone[0]['message_elements'])
    else:
        out['compression'] = 1.0
        out['wire_bytes_per_rank'] = 2 * (world.size - 1) * 4 * \
            out['params'] / world.size
    print('RESULT ' + json.dumps(out), flush=True)


def test_subset(n, seed=0):
    """The MNIST test set's examples used for the evaluations: the first
    ``n`` of a seeded permutation (all 10000 in their order for n >=
    10000), as arrays."""
    _, test = datasets.get_mnist()
    x, t = (numpy.asarray(a) for a in chainer.dataset.concat_examples(
        test))
    if n < len(x):
        keep = numpy.random.RandomState(seed).permutation(len(x))[:n]
        x, t = x[keep], t[keep]
    return x, t


def evaluate(model, x, t, world, batch=500):
    """Accuracy of ``model`` on (x, t), each rank classifying its slice
    (the replicas are equal), the counts summed over the ranks."""
    bounds = numpy.linspace(0, len(x), world.size + 1).astype(int)
    lo, hi = bounds[world.rank], bounds[world.rank + 1]
    correct = 0
    with chainer.using_config('train', False), chainer.no_backprop_mode():
        for i in range(lo, hi, batch):
            y = model.predictor(x[i:min(i + batch, hi)]).array
            correct += int((y.argmax(axis=1) == t[i:min(i + batch, hi)])
                           .sum())
    return world.allreduce(correct) / float(len(x))


def replicas_agree(model, world):
    """Whether every rank holds the same parameters (a checksum)."""
    total = float(sum(numpy.asarray(q.array, numpy.float64).sum()
                      for q in model.params()))
    return len(set(world.allgather(total))) == 1


def run_totals(comm, model):
    """``model``'s run totals on ``comm`` (None for ChainerMN's dense
    communicator, which keeps none)."""
    if not isinstance(comm, chainer_vgc.VGCCommunicator):
        return None
    return comm.state(model).totals


def compression(comm, model, params, size):
    """Parameters / elements sent per rank over the whole run (1 for a
    dense communicator)."""
    totals = run_totals(comm, model)
    if not totals or not totals.get('steps'):
        return 1.0
    elements = totals['elements'] / float(size)
    return params * totals['steps'] / elements if elements else float('inf')


def accuracy_run(args, world, comm, model, opt, x, t, exchange, out, where):
    ex, et = test_subset(args.eval_examples)
    rng = numpy.random.RandomState(1 + 7919 * world.rank)
    state = dict(order=rng.permutation(len(x)), pos=0, epochs=0)
    b = args.batchsize

    def train(n):
        """n training steps; the slowest rank's wall seconds."""
        world.Barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            if state['pos'] + b > len(x):
                state.update(order=rng.permutation(len(x)), pos=0,
                             epochs=state['epochs'] + 1)
            idx = state['order'][state['pos']:state['pos'] + b]
            state['pos'] += b
            opt.update(model, x[idx], t[idx])
        world.Barrier()
        return world.allreduce(time.perf_counter() - t0, op=MPI.MAX)

    t_eval = [0.0]

    def check():
        t0 = time.perf_counter()
        acc = evaluate(model, ex, et, world)
        t_eval[0] += time.perf_counter() - t0
        return acc

    run = to_accuracy(train, check, args.to_accuracy, args.eval_every,
                      args.max_steps, args.max_seconds)
    if args.eval_examples < 10000:
        final = evaluate(model, *test_subset(10000), world=world)
    else:
        final = run['accuracy']
    agree = replicas_agree(model, world)
    ex_median = float(numpy.median(exchange)) if exchange else 0.0
    ex_all = world.gather(ex_median)
    if world.rank != 0:
        return
    out.update(run, target=args.to_accuracy, eval_every=args.eval_every,
               eval_examples=min(args.eval_examples, 10000),
               max_steps=args.max_steps, max_seconds=args.max_seconds,
               final_accuracy=final, replicas_agree=agree,
               eval_s=t_eval[0], exchange_s=max(ex_all),
               epochs=(run['steps'] * b * world.size) / 60000.0,
               compression=compression(comm, model, out['params'],
                                       world.size))
    print('RESULT ' + json.dumps(out), flush=True)


if __name__ == '__main__':
    main()
