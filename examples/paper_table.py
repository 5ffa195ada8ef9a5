#!/usr/bin/env python
"""The grid of the paper's Table 1, on MNIST, with p simulated workers.

    python examples/paper_table.py --workers 4 --epoch 1 --seeds 1

Runs no compression, Strom (tau 0.001, 0.01, 0.1), VGC (alpha 1, 1.5, 2),
hybrid (tau 0.01, 0.1; alpha 2) and QSGD (2 bit d=128, 3 bit d=512, 4 bit
d=512), plus VGC alpha 2 with a 0.1-epoch dense warm-up and the biases sent
uncompressed (not in the paper; the grid trains one epoch, so a longer
warm-up would leave nothing compressed), with Adam and with momentum SGD, each for
``--seeds`` seeds, with the p workers simulated in this process
(:class:`chainer_vgc.harness.simulation.SimulatedWorkers`, shown identical to an
``mpiexec -n p`` run of train_mnist.py by tests/test_examples.py).  Writes
``OUT/results.csv`` (every run), ``OUT/table.md`` (medians over seeds, in
the layout of Table 1) and ``OUT/scatter.png`` (accuracy vs compression,
log x, as the paper's Appendix C).

``--dataset fashion`` trains on Fashion-MNIST (Debian's
``dataset-fashion-mnist``), ``--model vgg --width W`` the App. D conv-BN
network on 28x28x1 input (see example_common.make_network) instead of the
MLP; the
per-sample statistics of its convolutions and batch normalizations are the
exact ones of chainer_vgc.statistics.

``--exclude-small N`` (parameters of fewer than N elements uncompressed) and
``--warmup-epochs E`` (the first E epochs dense) apply to every row; by
default (0) the rows are the paper's.  A row's own settings (its fourth
element) take precedence over ``--warmup-epochs``; its exclusions add to
``--exclude-small``.
"""

import argparse
import csv
import os
import time

import chainer
from chainer.dataset import convert
import chainer.functions as F

from chainer_vgc.harness import datasets
from chainer_vgc.reporting import run_summary
from chainer_vgc.harness.simulation import SimulatedWorkers
import example_common as common


def biases_dense(name, param):
    """The 1-D parameters (biases, batch normalization): sent
    uncompressed."""
    return param.ndim == 1


GRID = [
    ('no compression', 'none', {}),
    ('Strom, tau=0.001', 'strom', dict(tau=0.001)),
    ('Strom, tau=0.01', 'strom', dict(tau=0.01)),
    ('Strom, tau=0.1', 'strom', dict(tau=0.1)),
    ('our method, alpha=1', 'vgc', dict(alpha=1.0)),
    ('our method, alpha=1.5', 'vgc', dict(alpha=1.5)),
    ('our method, alpha=2.0', 'vgc', dict(alpha=2.0)),
    # (label, method, hyperparameters, dense group and warm-up settings)
    ('our method, alpha=2.0, 0.1-epoch warm-up, biases dense', 'vgc',
     dict(alpha=2.0), dict(warmup_epochs=0.1, exclude=[biases_dense])),
    ('hybrid, tau=0.01, alpha=2.0', 'hybrid', dict(tau=0.01, alpha=2.0)),
    ('hybrid, tau=0.1, alpha=2.0', 'hybrid', dict(tau=0.1, alpha=2.0)),
    ('QSGD (2bit, d=128)', 'qsgd', dict(bits=2, bucket=128)),
    ('QSGD (3bit, d=512)', 'qsgd', dict(bits=3, bucket=512)),
    ('QSGD (4bit, d=512)', 'qsgd', dict(bits=4, bucket=512)),
]
TINY = [GRID[0], GRID[4], GRID[5], GRID[6], GRID[7]]
COLUMNS = ['optimizer', 'label', 'method', 'hyperparameters', 'seed',
           'workers', 'iterations', 'accuracy', 'compression',
           'bytes_per_rank', 'dense_bytes_per_rank', 'seconds',
           'statistics', 'compute_ms', 'exchange_ms']


def row_parts(row):
    """(label, method, hyperparameters, settings) of a GRID row; settings
    ({} for the paper's rows): ``exclude``, ``min_size``,
    ``warmup_epochs``."""
    label, method, kw = row[:3]
    return label, method, kw, (row[3] if len(row) > 3 else {})


def group_settings(args, settings, train, seed):
    """SimulatedWorkers' ``exclude``, ``min_size`` and ``warmup`` (in
    exchanges) for a row: its ``settings`` over the global
    ``--exclude-small`` and ``--warmup-epochs``."""
    settings = dict(settings or {})
    unknown = set(settings) - {'exclude', 'min_size', 'warmup_epochs'}
    if unknown:
        raise ValueError('unknown row settings {}'.format(sorted(unknown)))
    epochs = settings.get('warmup_epochs',
                          getattr(args, 'warmup_epochs', 0.0))
    return dict(
        exclude=list(settings.get('exclude', ())) or None,
        min_size=max(getattr(args, 'exclude_small', 0),
                     settings.get('min_size', 0)),
        warmup=common.epoch_steps(epochs, train, args.workers,
                                  args.batchsize, seed))


def simulate(method, kw, optimizer, seed, args, train, settings=None):
    """Train like ``mpiexec -n workers train_mnist.py`` would, in this
    process; returns (model, SimulatedWorkers, iterations).  ``settings``:
    a row's dense group and warm-up (see :func:`group_settings`)."""
    model = common.make_network(args, seed)
    opt, wd = common.make_optimizer(optimizer, args.lr, args.weight_decay,
                                    method)
    common.setup_optimizer(opt, wd, model)
    sim = SimulatedWorkers(model, opt, args.workers, method,
                           **group_settings(args, settings, train, seed),
                           **common.with_optimizer(method, kw, optimizer))
    iters = [datasets.iterator(
        datasets.shard(train, w, args.workers, seed), args.batchsize, w, seed)
        for w in range(args.workers)]
    n_iter = args.iterations or args.epoch * len(iters[0].dataset) \
        // args.batchsize
    reporter = chainer.reporter.Reporter()
    reporter.add_observer('main', model)
    for _ in range(n_iter):
        batches = [convert.concat_examples(it.next()) for it in iters]
        with reporter.scope({}):
            sim.update(model, batches)
    return model, sim, n_iter


def run(method, kw, optimizer, seed, args, train, test, settings=None):
    """One simulated training run; returns a CSV row (dict)."""
    t0 = time.time()
    kw = common.with_seed(method, kw, seed)
    model, sim, n_iter = simulate(method, kw, optimizer, seed, args, train,
                                  settings)
    summary = run_summary(sim.totals, sim.compressor, args.workers)
    return dict(
        optimizer=optimizer, method=method, seed=seed,
        hyperparameters=common.hyperparameter_text(kw),
        workers=args.workers, iterations=n_iter,
        accuracy=accuracy(model.predictor, test),
        compression=summary['vgc/total_compression'],
        bytes_per_rank=summary['vgc/total_bytes'],
        dense_bytes_per_rank=summary['vgc/dense_bytes'],
        seconds=round(time.time() - t0, 1), **timing(sim))


def timing(sim):
    """The CSV's time columns: ``statistics`` (share of worker steps
    whose backward computed the per-sample statistics), ``compute_ms``
    (forward + backward, with those statistics, per worker step) and
    ``exchange_ms`` (compress all workers, combine, update, per step)."""
    clock = sim.seconds
    steps = max(1, clock['worker_steps'])
    return dict(
        statistics=round(clock['statistics_steps'] / steps, 3),
        compute_ms=round(1e3 * clock['compute'] / steps, 2),
        exchange_ms=round(1e3 * clock['exchange'] * sim.size / steps, 2))


_SHARED = {}


def _run_task(task):
    """One run in a worker process (the data and arguments are inherited
    through fork, in _SHARED)."""
    i, (o, k, seed) = task
    grid, args, train, test = (_SHARED[key] for key in
                               ('grid', 'args', 'train', 'test'))
    label, method, kw, settings = row_parts(grid[k])
    return i, dict(run(method, kw, o, seed, args, train, test, settings),
                   label=label)


def run_tasks(tasks, ids, grid, args, train, test):
    """Yield (id, CSV row) for every (optimizer, grid index, seed) task,
    in ``args.jobs`` processes (each run is independent and seeded, so the
    rows are the same for any number of jobs)."""
    _SHARED.update(grid=grid, args=args, train=train, test=test)
    work = list(zip(ids, tasks))
    jobs = min(getattr(args, 'jobs', 1), len(work))
    if jobs <= 1:
        for item in work:
            yield _run_task(item)
        return
    import multiprocessing
    with multiprocessing.get_context('fork').Pool(jobs) as pool:
        for result in pool.imap_unordered(_run_task, work):
            yield result


def accuracy(predictor, test, batch=1000):
    x, t = convert.concat_examples(test[:])
    hits = 0
    with chainer.using_config('train', False), chainer.no_backprop_mode():
        for i in range(0, len(x), batch):
            y = predictor(x[i:i + batch])
            hits += int((F.argmax(y, axis=1).array == t[i:i + batch]).sum())
    return hits / len(x)


def median_rows(rows):
    """{(optimizer, label): (median accuracy, compression of that run)}.

    As in the paper, the compression is the one of the run whose accuracy
    is reported (the median run; lower middle for an even count)."""
    out = {}
    keys = sorted({(r['optimizer'], r['label']) for r in rows})
    for key in keys:
        runs = sorted((r for r in rows if (r['optimizer'], r['label']) ==
                       key), key=lambda r: float(r['accuracy']))
        mid = runs[(len(runs) - 1) // 2]
        out[key] = (float(mid['accuracy']), float(mid['compression']))
    return out


def write_table(rows, grid, optimizers, path, setting):
    med = median_rows(rows)
    lines = ['Setting: ' + setting, '',
             '| Method | ' + ' | '.join(
                 '{0} Accuracy | {0} Compression'.format(o.capitalize())
                 for o in optimizers) + ' |',
             '|---|' + '---:|---:|' * len(optimizers)]
    for row in grid:
        label = row[0]
        cells = []
        for o in optimizers:
            acc, comp = med.get((o, label), (float('nan'), float('nan')))
            cells += ['{:.1f}'.format(100 * acc), '{:,.1f}'.format(comp)]
        lines.append('| {} | {} |'.format(label, ' | '.join(cells)))
    overhead = statistics_overhead(rows)
    if overhead:
        lines += ['', 'Forward + backward per worker step, median over the '
                  'runs (range): {:.1f} ms ({:.1f}-{:.1f}) with the '
                  'per-sample statistics, {:.1f} ms ({:.1f}-{:.1f}) without; '
                  'the statistics add {:+.0f} % (medians of runs that may '
                  'have shared the machine differently).'.format(*overhead)]
    with open(path, 'w') as f:
        f.write('\n'.join(lines) + '\n')
    return '\n'.join(lines)


def statistics_overhead(rows):
    """(median, min, max compute_ms of the runs whose backward computed
    the per-sample statistics, the same of those that did not, percent the
    first median adds to the second), or None where the rows lack either
    kind."""
    import statistics
    timed = [r for r in rows if str(r.get('compute_ms', '')) != '']
    used = [float(r['compute_ms']) for r in timed
            if float(r['statistics']) == 1.0]
    plain = [float(r['compute_ms']) for r in timed
             if float(r['statistics']) == 0.0]
    if not used or not plain:
        return None
    a, b = statistics.median(used), statistics.median(plain)
    return (a, min(used), max(used), b, min(plain), max(plain),
            100.0 * (a / b - 1.0))


def write_plot(rows, optimizers, path, variants=(), title='MNIST MLP'):
    """Accuracy vs compression per optimizer; the rows labelled in
    ``variants`` (with a dense group or warm-up) in hollow markers."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(optimizers), figsize=(
        5.5 * len(optimizers), 4), squeeze=False)
    styles = {'none': ('black', 'o', 'no compression'),
              'strom': ('tab:red', 's', 'Strom'),
              'vgc': ('tab:blue', '^', 'variance (ours)'),
              'hybrid': ('tab:green', 'D', 'hybrid'),
              'qsgd': ('tab:orange', 'v', 'QSGD')}
    for ax, o in zip(axes[0], optimizers):
        for method, (color, marker, name) in styles.items():
            for variant in (False, True):
                pts = [(float(r['compression']), 100 * float(r['accuracy']))
                       for r in rows if r['optimizer'] == o and
                       r['method'] == method and
                       (r['label'] in variants) == variant]
                if not pts:
                    continue
                xs, ys = zip(*pts)
                if variant:
                    ax.scatter(xs, ys, marker=marker, facecolors='none',
                               edgecolors=color,
                               label=name + ', warm-up / dense group')
                else:
                    ax.scatter(xs, ys, c=color, marker=marker, label=name)
        ax.set_xscale('log')
        ax.set_xlabel('compression ratio (log)')
        ax.set_ylabel('test accuracy (%)')
        ax.set_title('{}, {}'.format(title, o))
        ax.grid(True, which='both', alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--workers', type=int, default=4)
    p.add_argument('--epoch', type=int, default=1)
    p.add_argument('--iterations', type=int, default=0,
                   help='iterations per run (overrides --epoch)')
    p.add_argument('--batchsize', type=int, default=32,
                   help='minibatch per worker')
    p.add_argument('--unit', type=int, default=200)
    p.add_argument('--lr', type=float, default=0.05,
                   help='momentum SGD learning rate')
    p.add_argument('--weight-decay', type=float, default=0.0)
    p.add_argument('--seeds', type=int, default=1)
    p.add_argument('--optimizers', default='adam,momentum')
    p.add_argument('--grid', choices=('full', 'tiny'), default='full')
    p.add_argument('--exclude-small', type=common.count, default=0,
                   metavar='N', help='every row: parameters of fewer than N '
                   'elements uncompressed (0: none)')
    p.add_argument('--warmup-epochs', type=common.epochs, default=0.0,
                   metavar='E', help='every row (unless it sets its own): '
                   'the first E epochs dense (0: none)')
    p.add_argument('--jobs', type=common.count, default=1,
                   help='runs at a time, each in its own process (on a '
                   'multi-core machine; set OPENBLAS_NUM_THREADS=1 so '
                   'they do not share the cores twice)')
    common.add_data_args(p)
    p.add_argument('--out', default='result/paper_table')
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    grid = GRID if args.grid == 'full' else TINY
    optimizers = args.optimizers.split(',')
    train, test = common.load_data(args)
    width = max(30, max(len(row[0]) for row in grid))
    path = os.path.join(args.out, 'results.csv')
    # (optimizer, grid row, seed) in the table's order; runs are handed out
    # row by row so that both optimizers' columns fill up together
    tasks = [(o, k, seed) for o in optimizers for k in range(len(grid))
             for seed in range(args.seeds)]
    order = sorted(range(len(tasks)), key=lambda i: (tasks[i][1], i))
    done = {}
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for i, row in run_tasks([tasks[i] for i in order], order, grid,
                                args, train, test):
            done[i] = row
            writer.writerow(row)  # as it finishes: a cut run keeps it
            f.flush()
            print('{:<9} {:<{}} seed {} acc {:.4f} compression '
                  '{:>10,.1f} ({}s)'.format(
                      row['optimizer'], row['label'], width, row['seed'],
                      row['accuracy'], row['compression'], row['seconds']),
                  flush=True)
    rows = [done[i] for i in range(len(tasks))]
    with open(path, 'w', newline='') as f:  # again, in the table's order
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    setting = ('{0}, {1} simulated workers x batch {2}, {3} iterations, '
               'median of {4} seed(s)'.format(
                   common.describe(args), args.workers, args.batchsize,
                   rows[0]['iterations'], args.seeds))
    if args.exclude_small:
        setting += ', parameters under {} elements uncompressed'.format(
            args.exclude_small)
    if args.warmup_epochs:
        setting += ', {:g}-epoch dense warm-up'.format(args.warmup_epochs)
    print(write_table(rows, grid, optimizers,
                      os.path.join(args.out, 'table.md'), setting))
    write_plot(rows, optimizers, os.path.join(args.out, 'scatter.png'),
               {row_parts(r)[0] for r in grid if row_parts(r)[3]},
               title=common.describe(args).split(' (')[0])


if __name__ == '__main__':
    main()
