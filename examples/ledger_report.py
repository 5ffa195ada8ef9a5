"""The long runs' write-up from the ledger (examples/paper_ledger.py
--report): the table (mean and range over seeds), accuracy against
compression in bytes on the wire, compression over the epochs, density per
layer over the epochs for each method (the layers from input to output),
and which layers carry the last epoch's traffic."""

import functools
import json
import os
import re

import numpy


def _groups(rows):
    """{(optimizer, label): [rows]}, optimizers and labels each in the
    order they first appear in the ledger (so every optimizer lists its
    methods in one order, whichever of its runs finished first)."""
    out = {}
    for r in rows:
        out.setdefault((r['optimizer'], r['label']), []).append(r)
    opts = list(dict.fromkeys(r['optimizer'] for r in rows))
    labels = list(dict.fromkeys(r['label'] for r in rows))
    return {key: out[key] for key in sorted(
        out, key=lambda k: (opts.index(k[0]), labels.index(k[1])))}


def _mean_range(values, fmt):
    values = numpy.asarray(values, float)
    if len(values) == 1:
        return fmt.format(values[0])
    return '{} ({}–{})'.format(fmt.format(values.mean()),
                               fmt.format(values.min()),
                               fmt.format(values.max()))


def paired_gaps(rows):
    """{(optimizer, label): [accuracy - no compression's accuracy, in
    points, for each seed that both have]}: the seed's own baseline (the
    same data order and initial weights) takes most of a seed's noise out
    of the comparison."""
    base = {(r['optimizer'], r['seed']): 100 * float(r['accuracy'])
            for r in rows if r['method'] == 'none'}
    out = {}
    for (opt, label), rs in _groups(rows).items():
        out[(opt, label)] = [
            100 * float(r['accuracy']) - base[(opt, r['seed'])]
            for r in rs if (opt, r['seed']) in base]
    return out


def wire_compression(row):
    """What a dense ring allreduce of the run's steps would have sent per
    rank over the bytes each rank sent (messages, factors and dense
    group): the row's ``wire_compression``.  Rows from before the column
    existed are allgatherv runs without a dense group, whose ring sends
    (p - 1) / p of every message: (2 (p - 1) / p) 4 N over (p - 1) N
    b / (8 C), that is 64 C / (p b), C the compression in elements and b
    the bits per element (1 for no compression)."""
    if row.get('wire_compression') not in ('', None):
        return float(row['wire_compression'])
    if row['method'] == 'none':
        return 1.0
    return (64 * float(row['compression'])
            / (int(row['workers']) * float(row['bits_per_element'])))


def table(rows):
    """Markdown: one line per (optimizer, method)."""
    lines = ['| optimizer | method | seeds | test accuracy % | '
             'minus no compression, same seed (points) | compression '
             '| in bytes on the wire | epoch 1 | last epoch | '
             'bits/element |',
             '|---|---|---:|---:|---:|---:|---:|---:|---:|---:|']
    gaps = paired_gaps(rows)
    for (opt, label), rs in _groups(rows).items():
        acc = [100 * float(r['accuracy']) for r in rs]
        comp = [float(r['compression']) for r in rs]
        first = [json.loads(r['epoch_compression'])[0] for r in rs]
        last = [json.loads(r['epoch_compression'])[-1] for r in rs]
        bits = [float(r['bits_per_element']) for r in rs
                if r['bits_per_element'] not in ('', None)]
        gap = gaps[(opt, label)]
        wire = [wire_compression(r) for r in rs]
        lines.append('| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |'
                     .format(
            opt, label, len(rs), _mean_range(acc, '{:.2f}'),
            '–' if rs[0]['method'] == 'none' else
            _mean_range(gap, '{:+.2f}') if gap else 'no baseline',
            _mean_range(comp, '{:,.1f}'), _mean_range(wire, '{:,.1f}'),
            _mean_range(first, '{:,.1f}'),
            _mean_range(last, '{:,.1f}'),
            _mean_range(bits, '{:.1f}') if bits else '–'))
    return '\n'.join(lines)


def model_order(names):
    """Parameter names with their numbers compared as numbers (block2
    before block10), so a plot lists the layers from input to output."""
    return sorted(names, key=lambda n: [int(t) if t.isdigit() else t
                                        for t in re.split(r'(\d+)', n)])


def layer_kind(name):
    """'conv' (convolution weights and biases), 'BN' (gamma and beta) or
    'fc' (the fully connected layers), from a parameter's name."""
    if name.rsplit('/', 1)[-1] in ('gamma', 'beta'):
        return 'BN'
    return 'conv' if '/conv/' in name else 'fc'


def traffic(rows, top=3):
    """Markdown: which layers carry the traffic in the last epoch, per
    (optimizer, method): the share of the elements sent by kind of layer,
    and the parameters with the largest shares (mean over seeds) with
    their density (the fraction of their elements sent per step)."""
    lines = ['| optimizer | method | conv | BN | fc | largest shares '
             '(share, density) |', '|---|---|---:|---:|---:|---|']
    for (opt, label), rs in _groups(rows).items():
        if rs[0]['method'] == 'none':
            continue
        names, dens = density_by_layer(rs)[(opt, label)]
        last = numpy.mean([shares(_counts_by_name(r, names))[-1]
                           for r in rs], axis=0)
        kinds = {}
        for n, s in zip(names, last):
            kinds[layer_kind(n)] = kinds.get(layer_kind(n), 0.0) + s
        largest = ', '.join('{} ({:.0%}, {:.1e})'.format(
            names[i].replace('/predictor/', ''), last[i], dens[-1][i])
            for i in numpy.argsort(-last, kind='stable')[:top])
        lines.append('| {} | {} | {:.0%} | {:.0%} | {:.0%} | {} |'.format(
            opt, label, kinds.get('conv', 0.0), kinds.get('BN', 0.0),
            kinds.get('fc', 0.0), largest))
    return '\n'.join(lines)


def _counts_by_name(row, names):
    """The row's elements sent per epoch (epochs x parameters), its
    columns in the order of ``names``."""
    ledger_names = list(json.loads(row['param_sizes']))
    counts = numpy.asarray(json.loads(row['epoch_param_elements']), float)
    return counts[:, [ledger_names.index(n) for n in names]]


def density_by_layer(rows):
    """{(optimizer, label): (names, densities: epochs x parameters)}: the
    fraction of each parameter's elements sent per step, averaged over
    seeds; the parameters in the model's order (:func:`model_order`)."""
    out = {}
    for key, rs in _groups(rows).items():
        sizes = json.loads(rs[0]['param_sizes'])
        names = model_order(sizes)
        per_seed = [_counts_by_name(r, names) / (
            int(r['iterations']) / int(r['epochs']) *
            numpy.asarray([sizes[n] for n in names], float)) for r in rs]
        out[key] = (names, numpy.mean(per_seed, axis=0))
    return out


def shares(counts):
    """Each parameter's share of the elements sent (rows: epochs)."""
    counts = numpy.asarray(counts, float)
    total = counts.sum(axis=1, keepdims=True)
    return numpy.divide(counts, total, out=numpy.zeros_like(counts),
                        where=total > 0)


def write(rows, out_dir):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, 'results_long_table.md'), 'w') as f:
        f.write(table(rows) + '\n\nWhich layers carry the traffic '
                '(last epoch):\n\n' + traffic(rows) + '\n')
    print(table(rows))
    print(traffic(rows))
    groups = _groups(rows)
    colors = {'none': 'black', 'vgc': 'tab:blue', 'strom': 'tab:red',
              'hybrid': 'tab:green', 'dgc': 'tab:purple',
              'powersgd': 'tab:orange'}
    markers = ['o', '^', 's', 'D', 'v', 'P', 'X', '*', 'h']
    labels = list(dict.fromkeys(label for _, label in groups))
    optimizers = list(dict.fromkeys(opt for opt, _ in groups))
    def scatter(ax, k, rs):
        if rs:
            ax.scatter([wire_compression(r) for r in rs],
                       [100 * float(r['accuracy']) for r in rs],
                       color=colors.get(rs[0]['method'], 'gray'),
                       marker=markers[k % len(markers)], label=labels[k])

    def curves(ax, k, rs, column, scale=1, skip_none=False):
        if not rs or (skip_none and rs[0]['method'] == 'none'):
            return
        ys = scale * numpy.array([json.loads(r[column]) for r in rs], float)
        epochs = numpy.arange(1, ys.shape[1] + 1)
        color = colors.get(rs[0]['method'], 'gray')
        ax.plot(epochs, ys.mean(axis=0), color=color,
                marker=markers[k % len(markers)], label=labels[k])
        if len(rs) > 1:
            ax.fill_between(epochs, ys.min(axis=0), ys.max(axis=0),
                            alpha=0.15, color=color)

    for draw, scale, xlabel, ylabel, name in (
            (scatter, 'x', 'compression in bytes on the wire (log):\n'
             'dense ring allreduce / bytes sent per rank',
             'final test accuracy (%)', 'long_accuracy_vs_compression.png'),
            (functools.partial(curves, column='epoch_compression',
                               skip_none=True),
             'y', 'epoch', 'compression in the epoch (log)',
             'long_compression_by_epoch.png'),
            (functools.partial(curves, column='epoch_accuracy', scale=100),
             None, 'epoch', 'test accuracy after the epoch (%)',
             'long_accuracy_by_epoch.png')):
        fig, axes = plt.subplots(1, len(optimizers), squeeze=False,
                                 figsize=(5.5 * len(optimizers) + 2, 4))
        legend = {}  # one legend for the figure, beside the panels: in
        # a panel it hid points (no compression's, at the left edge)
        for ax, opt in zip(axes[0], optimizers):
            for k, label in enumerate(labels):
                draw(ax, k, groups.get((opt, label), []))
            if scale:
                (ax.set_xscale if scale == 'x' else ax.set_yscale)('log')
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.set_title(opt)
            ax.grid(True, which='both', alpha=0.3)
            for handle, label in zip(*ax.get_legend_handles_labels()):
                legend.setdefault(label, handle)
        right = 1 - 2 / fig.get_figwidth()
        shown = [k for k in labels if k in legend]  # (the grid's order)
        fig.legend([legend[k] for k in shown], shown, fontsize=8,
                   loc='center left', bbox_to_anchor=(right, 0.5))
        fig.tight_layout(rect=(0, 0, right, 1))
        fig.savefig(os.path.join(out_dir, name), dpi=100)
        plt.close(fig)
    dens = density_by_layer(rows)
    methods = [key for key in dens if groups[key][0]['method'] != 'none']
    if methods:
        fig, axes = plt.subplots(len(methods), 1, squeeze=False,
                                 figsize=(9, 2.6 * len(methods)))
        for ax, key in zip(axes[:, 0], methods):
            names, d = dens[key]
            image = ax.imshow(numpy.log10(numpy.maximum(d, 1e-7)).T,
                              aspect='auto', cmap='viridis',
                              vmin=-6, vmax=0)
            ax.set_yticks(range(len(names)))
            ax.set_yticklabels(names, fontsize=4)
            ax.set_xlabel('epoch')
            ax.set_title('{}, {}: log10 density per parameter'.format(*key),
                         fontsize=8)
            fig.colorbar(image, ax=ax)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, 'long_density_by_layer.png'),
                    dpi=100)
        plt.close(fig)
