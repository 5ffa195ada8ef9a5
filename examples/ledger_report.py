"""The long runs' write-up from the ledger (examples/paper_ledger.py
--report): the table (mean and range over seeds), accuracy against
compression, compression over the epochs, and density per layer over the
epochs for each method."""

import json
import os

import numpy


def _groups(rows):
    """{(optimizer, label): [rows]} in the ledger's order of labels."""
    out = {}
    for r in rows:
        out.setdefault((r['optimizer'], r['label']), []).append(r)
    return out


def _mean_range(values, fmt):
    values = numpy.asarray(values, float)
    if len(values) == 1:
        return fmt.format(values[0])
    return '{} ({}–{})'.format(fmt.format(values.mean()),
                               fmt.format(values.min()),
                               fmt.format(values.max()))


def table(rows):
    """Markdown: one line per (optimizer, method)."""
    lines = ['| optimizer | method | seeds | test accuracy % | compression '
             '| epoch 1 | last epoch | bits/element |',
             '|---|---|---:|---:|---:|---:|---:|---:|']
    for (opt, label), rs in _groups(rows).items():
        acc = [100 * float(r['accuracy']) for r in rs]
        comp = [float(r['compression']) for r in rs]
        first = [json.loads(r['epoch_compression'])[0] for r in rs]
        last = [json.loads(r['epoch_compression'])[-1] for r in rs]
        bits = [float(r['bits_per_element']) for r in rs
                if r['bits_per_element'] not in ('', None)]
        lines.append('| {} | {} | {} | {} | {} | {} | {} | {} |'.format(
            opt, label, len(rs), _mean_range(acc, '{:.2f}'),
            _mean_range(comp, '{:,.1f}'), _mean_range(first, '{:,.1f}'),
            _mean_range(last, '{:,.1f}'),
            _mean_range(bits, '{:.1f}') if bits else '–'))
    return '\n'.join(lines)


def density_by_layer(rows):
    """{(optimizer, label): (names, densities: epochs x parameters)}: the
    fraction of each parameter's elements sent per step, averaged over
    seeds."""
    out = {}
    for key, rs in _groups(rows).items():
        per_seed = []
        for r in rs:
            sizes = json.loads(r['param_sizes'])
            names = list(sizes)
            counts = numpy.asarray(json.loads(r['epoch_param_elements']),
                                   float)
            steps = int(r['iterations']) / int(r['epochs'])
            per_seed.append(counts / (steps * numpy.asarray(
                [sizes[n] for n in names], float)))
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
        f.write(table(rows) + '\n')
    print(table(rows))
    groups = _groups(rows)
    colors = {'none': 'black', 'vgc': 'tab:blue', 'strom': 'tab:red',
              'hybrid': 'tab:green'}
    markers = ['o', '^', 's', 'D', 'v', 'P']
    labels = list(dict.fromkeys(label for _, label in groups))
    optimizers = list(dict.fromkeys(opt for opt, _ in groups))
    def scatter(ax, k, rs):
        if rs:
            ax.scatter([float(r['compression']) for r in rs],
                       [100 * float(r['accuracy']) for r in rs],
                       color=colors.get(rs[0]['method'], 'gray'),
                       marker=markers[k % len(markers)], label=labels[k])

    def curves(ax, k, rs):
        if not rs or rs[0]['method'] == 'none':
            return
        ys = numpy.array([json.loads(r['epoch_compression']) for r in rs],
                         float)
        epochs = numpy.arange(1, ys.shape[1] + 1)
        color = colors.get(rs[0]['method'], 'gray')
        ax.plot(epochs, ys.mean(axis=0), color=color,
                marker=markers[k % len(markers)], label=labels[k])
        if len(rs) > 1:
            ax.fill_between(epochs, ys.min(axis=0), ys.max(axis=0),
                            alpha=0.15, color=color)

    for draw, scale, xlabel, ylabel, name in (
            (scatter, 'x', 'compression over the run (log)',
             'final test accuracy (%)', 'long_accuracy_vs_compression.png'),
            (curves, 'y', 'epoch', 'compression in the epoch (log)',
             'long_compression_by_epoch.png')):
        fig, axes = plt.subplots(1, len(optimizers), squeeze=False,
                                 figsize=(5.5 * len(optimizers), 4))
        for ax, opt in zip(axes[0], optimizers):
            for k, label in enumerate(labels):
                draw(ax, k, groups.get((opt, label), []))
            (ax.set_xscale if scale == 'x' else ax.set_yscale)('log')
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.set_title(opt)
            ax.grid(True, which='both', alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
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
