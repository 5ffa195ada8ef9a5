"""What the example scripts share (train_mnist.py, train_cifar.py,
paper_table.py, demo_core.py; train_seq2seq.py and train_transformer.py
their run and summary).

- The compression method's flags, built from the rule registry
  (:data:`chainer_vgc.RULES`): ``--method`` is one of its names, and every
  argument of a rule's constructor is a flag (``--alpha``, ``--tau``, ...;
  a boolean that defaults to True is ``--no-NAME``, one that defaults to
  False is ``--NAME``).  A rule added to the registry is an option of every
  script with no edit here.
- The communicator's dense group and warm-up flags (``--exclude``,
  ``--exclude-small``, ``--uncovered``, ``--warmup``, ``--warmup-epochs``,
  ``--alpha-ramp``, ``--dense-dtype``).
- The run: its flags, the MNIST model, the optimizers, the trainer and its
  reports, per-rank snapshots and ``--resume``, and the summary table.

The example scripts import it as a sibling module (``python
examples/train_mnist.py`` puts ``examples/`` on the path).
"""

import argparse
import ast
import inspect
import math
import os

import chainer
from chainer import training
from chainer.training import extensions
import chainer.links as L
import chainermn
import numpy

import chainer_vgc
from chainer_vgc.harness import datasets
from chainer_vgc.extensions import CompressionReport
from chainer_vgc.reporting import run_summary
from chainer_vgc.harness.models import MLP
from chainer_vgc.harness.models import VGG

# -- the compression method, from the registry --------------------------------

#: ``--method``'s default; where rules share an argument, the flag's
#: default is this rule's (vgc's alpha 1.5, not hybrid's 2.0)
DEFAULT_METHOD = 'vgc'
#: rule arguments that take the run's flag of the same name (QSGD's
#: generator is seeded with ``--seed``) instead of a flag of their own
RUN_ARGUMENTS = ('seed',)
#: help for the arguments of the registered rules (any other argument gets
#: a generic one)
HELP = {
    'alpha': 'criterion r^2 > alpha v (eq. 4)',
    'zeta': 'variance decay',
    'tau': 'threshold',
    'density': 'fraction of each tensor sent a step (top-k)',
    'momentum_factor': 'momentum correction factor (0: plain top-k)',
    'momentum_masking': 'momentum factor masking off',
    'density_warmup_steps': 'steps per warm-up stage (25%% falling 4x a '
    'stage; 0: none)',
    'bits': 'bits',
    'bucket': 'bucket size',
    'quantize': 'send exact values instead of 4-bit ones',
    'keep_unrepresentable': 'keep a selected value that 4 bits cannot '
    'represent in the residual instead of dropping it',
    'index_coding': "indices on the wire: 'fixed' (the paper's 32-bit "
    "words), 'gap' (gap-coded, FMT_GAP) or 'auto' (the smaller, per tensor "
    'and step)',
}
OPTIMIZERS = ('adam', 'momentum')


def rule_arguments(method):
    """The names of ``RULES[method]``'s constructor arguments, in order."""
    sig = inspect.signature(chainer_vgc.RULES[method].__init__)
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD,
             inspect.Parameter.KEYWORD_ONLY)
    return [name for name, q in sig.parameters.items()
            if name != 'self' and q.kind in kinds]


def hyperparameter_flags():
    """{argument: (flag default, methods taking it)} over every registered
    rule: the default method's arguments first, then the others' (rules in
    sorted order).  The default is the default method's where it takes the
    argument, else that of the first rule that has one (None: none has)."""
    empty = inspect.Parameter.empty
    order = sorted(chainer_vgc.RULES, key=lambda m: (m != DEFAULT_METHOD, m))
    flags = {}
    for method in order:
        params = inspect.signature(
            chainer_vgc.RULES[method].__init__).parameters
        for name in rule_arguments(method):
            default, methods = flags.get(name, (empty, []))
            if default is empty:
                default = params[name].default
            flags[name] = (default, methods + [method])
    return {name: (None if default is empty else default, methods)
            for name, (default, methods) in flags.items()}


def _literal(text):
    """A flag value of an argument without a typed default: a Python
    literal (number, tuple, ...) or else the text itself."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def add_compression_args(p):
    """``--method``, its hyperparameters (one flag per rule argument of the
    registry), ``--allgatherv`` and the dense group and warm-up flags."""
    p.add_argument('--method', choices=sorted(chainer_vgc.RULES),
                   default=DEFAULT_METHOD)
    for name, (default, methods) in hyperparameter_flags().items():
        if name in RUN_ARGUMENTS:
            continue
        flag = '--' + name.replace('_', '-')
        if isinstance(default, bool):  # a switch: --no-NAME or --NAME
            what = HELP.get(name, 'turn {} {}'.format(
                name, 'off' if default else 'on'))
            kw = dict(dest=name, action=('store_false' if default
                                         else 'store_true'))
            if default:
                flag = '--no-' + flag[2:]
        else:
            what = HELP.get(name, 'argument {} of the rule'.format(name))
            kw = dict(dest=name, default=default, type=(
                type(default) if isinstance(default, (int, float, str))
                else _literal))
        p.add_argument(flag, help='{}: {}'.format('/'.join(methods), what),
                       **kw)
    p.add_argument('--allgatherv', choices=('ring', 'mpi'), default='ring')
    add_group_args(p)


def rule_kwargs(args, method=None):
    """Hyperparameters of ``method`` (default ``args.method``) from the
    parsed arguments, in flag order.  Left out: an argument whose flag is
    None (not given, and no rule has a default) and a switch that is off by
    default and was not given; the rule's own default applies to them."""
    method = args.method if method is None else method
    taken = set(rule_arguments(method))
    kw = {}
    for name, (default, _) in hyperparameter_flags().items():
        if name not in taken:
            continue
        value = getattr(args, name, None)
        if value is None or (value is False and default is False):
            continue
        kw[name] = value
    return kw


def with_seed(method, kw, seed):
    """``kw`` plus ``seed=seed`` if the rule of ``method`` takes a seed."""
    kw = dict(kw)
    if 'seed' in rule_arguments(method):
        kw['seed'] = seed
    return kw


def hyperparameter_text(kw):
    """``'alpha=2.0 tau=0.01'``: the hyperparameters but the seed."""
    return ' '.join('{}={}'.format(k, v) for k, v in kw.items()
                    if k != 'seed')


# -- the dense group and the warm-up ------------------------------------------

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


def count(text):
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError('must be >= 0, got {}'.format(text))
    return value


def epochs(text):
    """argparse type: a finite number of epochs >= 0."""
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
    g.add_argument('--exclude-small', type=count, default=0, metavar='N',
                   help='send parameters of fewer than N elements '
                   'uncompressed (biases, batch normalization); 0: none')
    g.add_argument('--uncovered', choices=('error', 'bruteforce', 'dense'),
                   default='error',
                   help='parameters the per-sample statistics do not cover: '
                   'fail, compute them exactly one example at a time, or '
                   'send them uncompressed')
    w = g.add_mutually_exclusive_group()
    w.add_argument('--warmup', type=count, default=0, metavar='K',
                   help='the first K exchanges (steps) dense for every '
                   'parameter')
    w.add_argument('--warmup-epochs', type=epochs, default=0.0,
                   metavar='E', help='warm-up of E epochs of a rank\'s '
                   'shard: ceil(E x shard / batchsize) exchanges')
    g.add_argument('--alpha-ramp', nargs=2, action=_AlphaRamp, default=None,
                   metavar=('ALPHA0', 'STEPS'),
                   help='vgc/hybrid: after the warm-up, alpha goes linearly '
                   'from ALPHA0 to --alpha over STEPS exchanges')
    g.add_argument('--dense-dtype', choices=('float16',), default=None,
                   help='send the dense group in float16 (one allreduce)')
    g.add_argument('--hierarchy', choices=('node',), default=None,
                   help="node: each node's ranks act as one worker of "
                   'their joint batch (dense inside the node, compressed '
                   'between nodes)')
    g.add_argument('--ranks-per-node', type=count, default=None,
                   metavar='K', help='with --hierarchy node: groups of K '
                   "consecutive ranks are the nodes (default: MPI's "
                   'shared-memory split)')
    g.add_argument('--dense-fallback', default=None, metavar='BANDWIDTH',
                   help="send a step dense when Sec. 5 predicts it faster "
                   "on links of BANDWIDTH ('1Gbit'; 'measure': measured "
                   'at the first exchange)')


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
                dense_dtype=args.dense_dtype, **_layout_kwargs(args))


def _layout_kwargs(args):
    """--hierarchy, --ranks-per-node and --dense-fallback, where given
    (a flat run without them passes none, as before)."""
    kw = {}
    if getattr(args, 'hierarchy', None):
        kw['hierarchy'] = args.hierarchy
        kw['ranks_per_node'] = args.ranks_per_node
    elif getattr(args, 'ranks_per_node', None):
        raise ValueError('--ranks-per-node needs --hierarchy node')
    fallback = getattr(args, 'dense_fallback', None)
    if fallback:
        kw['dense_fallback'] = True if fallback == 'measure' else fallback
    return kw


# -- the run ------------------------------------------------------------------

def add_run_args(p, epoch, batchsize, out):
    """Length, batch, seed, output, resume and device flags."""
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
    p.add_argument('--no-plot', dest='plot', action='store_false',
                   help='no loss, accuracy and compression plots (rank 0 '
                   'draws them at every report otherwise: about 2 s of a '
                   'short run, matplotlib imported and 9 PNGs drawn)')
    p.add_argument('--double-buffering', action='store_true',
                   help='apply the previous step\'s mean while this '
                   "step's exchange runs in the background (one step stale)")


def start(args, train=None):
    """The communicator of ``args.method`` and the device to train on
    (``train``: the whole training set, for ``--warmup-epochs``)."""
    from mpi4py import MPI
    mpi_comm = MPI.COMM_WORLD
    comm = chainer_vgc.create_communicator(
        args.method, mpi_comm=mpi_comm, allgatherv=args.allgatherv,
        **group_kwargs(args, train, mpi_comm.Get_size()),
        **with_optimizer(args.method, rule_kwargs(args),
                         getattr(args, 'optimizer', None)))
    device = chainer.get_device(args.gpu if args.gpu >= 0 else '@numpy')
    if args.gpu >= 0:
        device.use()
    return comm, device


def make_classifier(predictor, in_shape, seed):
    """``L.Classifier(predictor())`` with its parameters initialized from
    ``seed`` (Chainer's initializers draw from numpy.random) by a forward
    pass of one example of ``in_shape``.  The pass runs in test mode, so
    it leaves batch normalization's running statistics as initialized (a
    training-mode pass would fold a one-example batch into them, with
    Chainer's warning) and draws no dropout masks."""
    numpy.random.seed(seed)
    model = L.Classifier(predictor())
    with chainer.using_config('train', False), \
            chainer.using_config('enable_backprop', False):
        model(numpy.zeros((1,) + tuple(in_shape), numpy.float32),
              numpy.zeros(1, numpy.int32))
    return model


def make_model(units, seed):
    """The MNIST MLP 784-units-units-10."""
    return make_classifier(lambda: MLP((units, units), 10), (784,), seed)


def make_network(args, seed):
    """``--model mlp``: the MLP 784-unit-unit-10; ``--model vgg``: the
    App. D network (13 conv3-BN-ReLU layers, 5 max-pools, dropout, fc-BN,
    fc) on 28x28x1 input: the first convolution takes 1 channel, and the
    pools map 28 -> 14 -> 7 -> 4 -> 2 -> 1 (Chainer's cover_all), so the
    classifier sees 512 x width features as on CIFAR's 32x32; ``--width``
    scales every channel count; ``--no-dropout`` leaves out App. D's
    dropout layers (at width 1/8 they keep the network near chance level
    for the first hundred steps: the 8-channel maps lose 30-40 % of their
    units, and batch normalization's running statistics, gathered with
    dropout, do not fit the test-time activations)."""
    if getattr(args, 'model', 'mlp') == 'vgg':
        dropout = not getattr(args, 'no_dropout', False)
        return make_classifier(
            lambda: VGG(10, width=args.width, dropout=dropout),
            (1, 28, 28), seed)
    return make_model(args.unit, seed)


def load_data(args):
    """(train, test) of ``--dataset`` in the shape ``--model`` takes."""
    ndim = 3 if args.model == 'vgg' else 1
    if args.dataset == 'fashion':
        return datasets.get_fashion_mnist(ndim=ndim)
    return datasets.get_mnist(ndim=ndim)


def describe(args):
    """The data and network, for the table's setting and the plot."""
    data = 'Fashion-MNIST' if args.dataset == 'fashion' else 'MNIST'
    if args.model == 'vgg':
        return '{} App. D VGG (width {:g}, 28x28x1 input{})'.format(
            data, args.width,
            ', no dropout' if getattr(args, 'no_dropout', False) else '')
    return '{0} MLP 784-{1}-{1}-10'.format(data, args.unit)


def add_data_args(p):
    """``--dataset``, ``--model``, ``--width`` (:func:`load_data`,
    :func:`make_network`)."""
    p.add_argument('--dataset', choices=('mnist', 'fashion'), default='mnist',
                   help="'fashion': Fashion-MNIST from Debian's "
                   'dataset-fashion-mnist (chainer_vgc.harness.datasets)')
    p.add_argument('--model', choices=('mlp', 'vgg'), default='mlp',
                   help="'vgg': the App. D conv-BN network on 28x28x1")
    p.add_argument('--width', type=float, default=0.25,
                   help='channel scale of --model vgg (1: the paper\'s)')
    p.add_argument('--no-dropout', action='store_true',
                   help="--model vgg without App. D's dropout layers")


def with_optimizer(method, kw, optimizer):
    """The rule arguments of ``method`` under ``optimizer``: DGC's
    momentum correction (momentum_factor 0.9) is momentum SGD's momentum
    moved into the rule (:func:`make_optimizer` then gives plain SGD);
    under Adam, whose moments are its own, DGC is top-k with error
    feedback (momentum_factor 0).  Other methods: ``kw`` as given."""
    if method != 'dgc' or optimizer not in OPTIMIZERS:
        return kw
    return dict(kw, momentum_factor=0.9 if optimizer == 'momentum' else 0.0)


def make_optimizer(name, lr=0.05, weight_decay=0.0, method=None):
    """(optimizer ``name``, weight decay) for :func:`setup_optimizer`; the
    learning rate is momentum SGD's (Adam keeps its default).  With
    ``method`` 'dgc', momentum SGD's momentum is the rule's
    (:func:`with_optimizer`): plain SGD at that learning rate."""
    if name == 'adam':
        opt = chainer.optimizers.Adam()
    elif name == 'momentum' and method == 'dgc':
        opt = chainer.optimizers.SGD(lr=lr)
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


def add_extensions(trainer, comm, model, test_iter, device, every, stop,
                   progress, plot=True):
    """Multi-node evaluation, compression report and per-rank snapshots
    (at ``stop``) on every rank; log, print and (``plot``) plots on rank
    0.  Returns the evaluator."""
    evaluator = chainermn.create_multi_node_evaluator(
        extensions.Evaluator(test_iter, model, device=device), comm)
    trainer.extend(evaluator, trigger=every)
    trainer.extend(CompressionReport(comm), trigger=every)
    add_snapshot(trainer, comm, stop)
    if comm.rank == 0:
        trainer.extend(extensions.LogReport(trigger=every))
        trainer.extend(extensions.PrintReport(
            ['epoch', 'iteration', 'main/loss', 'validation/main/accuracy',
             'vgc/interval_compression', 'vgc/total_compression',
             'vgc/total_bits_per_element', 'elapsed_time']))
        plots = ((['main/loss', 'validation/main/loss'], 'loss'),
                 (['main/accuracy', 'validation/main/accuracy'], 'accuracy'),
                 (['vgc/interval_compression', 'vgc/total_compression'],
                  'compression'))
        for keys, name in plots if plot else ():
            trainer.extend(extensions.PlotReport(
                keys, x_key=every[1], trigger=every,
                filename=name + '.png'))
        if progress:
            trainer.extend(extensions.ProgressBar(update_interval=10))
    return evaluator


# -- snapshots and resume -----------------------------------------------------

def snapshot_name(rank):
    return 'snapshot_rank{}'.format(rank)


def add_snapshot(trainer, comm, trigger):
    """Every rank saves its own trainer state (model, optimizer, residuals
    and run totals of the communicator) as ``OUT/snapshot_rank<r>``."""
    trainer.extend(extensions.snapshot(filename=snapshot_name(comm.rank)),
                   trigger=trigger)


def resume(args, comm, trainer):
    """Load this rank's snapshot from ``--resume DIR``, if given.  Every
    rank first checks that every rank has its file, so a snapshot of a run
    with fewer ranks fails on all of them with a message, not on some with
    FileNotFoundError while the others wait."""
    if not args.resume:
        return
    path = os.path.join(args.resume, snapshot_name(comm.rank))
    present = comm.mpi_comm.allgather(os.path.isfile(path))
    if not all(present):
        raise SystemExit(
            '--resume {}: snapshot files exist for ranks {} of {}; resume '
            'with as many ranks as the run that saved them'.format(
                args.resume, [r for r, ok in enumerate(present) if ok],
                comm.size))
    chainer.serializers.load_npz(path, trainer)


# -- the summary --------------------------------------------------------------

def controls(state):
    """A model's dense group and warm-up settings (``state``:
    ``comm.state(model)``) that differ from the defaults, as plain values
    (for the summary)."""
    out = {}
    if state.exclude:
        out['exclude'] = [e if isinstance(e, str) else repr(e)
                          for e in state.exclude]
    if state.min_size:
        out['min_size'] = state.min_size
    if state.uncovered != 'error':
        out['uncovered'] = state.uncovered
    if state.warmup:
        out['warmup'] = state.warmup
    if state.alpha_ramp is not None:
        out['alpha_ramp'] = list(state.alpha_ramp)
    if state.dense_dtype is not None:
        out['dense_dtype'] = str(state.dense_dtype)
    return out


def compressed_group_summary(state, workers, n_params):
    """The compressed group's figures over the run, from a model's totals
    (``state``: ``comm.state(model)``; ``workers``: the workers its
    exchange averages over): {} when every exchange compressed every parameter or none was
    ever compressed (``none``), else ``compressed_parameters``,
    ``dense_fraction`` (of the parameters, after the warm-up),
    ``compressed_exchanges`` (after the warm-up) and
    ``compression_compressed``: the compressed group's parameters x those
    exchanges / the average elements it sent per rank (None if the run
    ended in the warm-up).  Assumes the dense group did not change after
    the warm-up (exclusions and sizes are fixed; parameters are all
    initialized before training)."""
    tot = state.totals
    steps = int(tot['steps'])
    n_c = state.compressed_elements
    if not steps or not n_c or (n_c == n_params and not state.warmup):
        return {}
    warm = min(state.warmup, steps)
    exchanges = steps - warm
    # every rank sends its whole gradient in a warm-up exchange, and the
    # dense group's in the others
    dense = workers * (warm * n_params + exchanges * (n_params - n_c))
    per_rank = (tot['elements'] - dense) / workers
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
    optimizer = trainer.updater.get_optimizer('main')
    wait = getattr(optimizer, 'wait', None)
    if wait is not None:  # double buffering: the last exchange, counted
        wait()
    result = evaluator(trainer)
    model = optimizer.target
    state = comm.state(model)  # (the model's state: totals, settings)
    workers = state.workers or comm.size  # (hierarchy='node': the nodes)
    summary = run_summary(state.totals, state.compressor, workers)
    n_params = sum(p.size for p in model.params() if p.array is not None)
    report = {
        'method': args.method, 'hyperparameters': rule_kwargs(args),
        'workers': comm.size, 'optimizer': args.optimizer,
        'iterations': trainer.updater.iteration,
        'test_accuracy': float(result['validation/main/accuracy']),
        'compression': summary['vgc/total_compression'],
        'bytes_sent_per_rank': summary['vgc/total_bytes'],
        'dense_allreduce_bytes_per_rank': summary['vgc/dense_bytes'],
        'bits_per_element': summary.get('vgc/total_bits_per_element'),
        'parameters': n_params,
        'exchanges': int(state.totals['steps']),
        'controls': controls(state),
    }
    if getattr(args, 'double_buffering', False):
        report['controls'] = dict(report['controls'] or {},
                                  double_buffering=True)
    report.update(compressed_group_summary(state, workers, n_params))
    return report


def print_summary(r):
    """The report of :func:`final_report` as a Markdown table."""
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
    if r.get('bits_per_element'):
        print('| message bits per element sent (headers included) | {:.1f} '
              '|'.format(r['bits_per_element']))
    print('| bytes sent per rank | {:,.0f} |'.format(sent))
    print('| dense ring allreduce would send | {:,.0f} |'.format(dense))
    print('| traffic saved | {} |'.format(
        '{:,.1f}x'.format(dense / sent) if sent else 'n/a (1 worker)'
        if not dense else 'all'))


# -- the sequence examples' run (train_seq2seq.py, train_transformer.py) ----

def add_sequence_args(p, out):
    """The sequence examples' flags: the communicator (``vgc`` or
    ChainerMN's ``naive``), the method and its alpha, the run, the model's
    size, the synthetic task and ``--by-parameter``."""
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
    p.add_argument('--out', default=out)


def train_and_summarize(updater, comm, model, args):
    """Run ``updater`` for ``args.iterations`` with a log every fifth of
    the run (the loss; with vgc the interval's compression and, with
    ``args.by_parameter``, each parameter's share and density), then print
    on rank 0 the JSON summary the sequence examples end with: the loss of
    the last interval, seconds per iteration, the compression of the last
    interval and of the whole run, each parameter's density in the last
    interval where asked, and the parameters sent dense."""
    import json
    import time
    trainer = training.Trainer(updater, (args.iterations, 'iteration'),
                               out=args.out)
    every = (max(1, args.iterations // 5), 'iteration')
    log = extensions.LogReport(trigger=every)
    trainer.extend(log)
    keys = ['iteration', 'main/loss']
    if args.communicator == 'vgc':
        trainer.extend(CompressionReport(
            comm, trigger=every, by_parameter=args.by_parameter))
        keys.append('vgc/interval_compression')
    if comm.rank == 0:
        trainer.extend(extensions.PrintReport(keys), trigger=every)
    start = time.perf_counter()
    trainer.run()
    seconds = time.perf_counter() - start
    last = log.log[-1] if log.log else {}
    summary = {'communicator': args.communicator, 'ranks': comm.size,
               'iterations': args.iterations,
               'seconds_per_iteration': seconds / args.iterations,
               'loss': last.get('main/loss')}
    if args.communicator == 'vgc':
        state = comm.state(model)
        per_rank = state.totals['elements'] / comm.size
        summary['compression_run'] = (state.totals['param_elements'] /
                                      per_rank if per_rank else None)
        summary['compression_last'] = last.get('vgc/interval_compression')
        if args.by_parameter and last:
            summary['density_last'] = {
                k[len('vgc/density'):]: v for k, v in last.items()
                if k.startswith('vgc/density')}
        summary['dense'] = sorted(state.dense)
    if comm.rank == 0:
        print('summary ' + json.dumps(summary, sort_keys=True))
    return summary
