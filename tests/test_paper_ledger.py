"""examples/paper_ledger.py (issue 39): a run interrupted after an epoch
resumes to the same row and parameters, bit for bit, as an uninterrupted
one; a finished row is never run again; the per-parameter counts are the
known ones where every element is sent."""

import csv
import os
import sys

import numpy
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'examples'))

import paper_ledger  # NOQA

# on both stacks: the rows are NumPy's arithmetic
pytestmark = pytest.mark.stack

TINY = ['--dataset', 'mnist', '--model', 'mlp', '--unit', '8',
        '--workers', '2', '--batchsize', '8', '--epochs', '2',
        '--iterations-per-epoch', '3', '--train-size', '200',
        '--seeds', '0', '--momentum-seeds', '']


def rows(path):
    with open(path, newline='') as f:
        return list(csv.DictReader(f))


def ledger_run(tmp, name, only, *extra):
    ledger = os.path.join(tmp, name + '.csv')
    paper_ledger.main(TINY + ['--only', only, '--ledger', ledger,
                              '--state', os.path.join(tmp, name + '_state'),
                              '--keep-state'] + list(extra))
    return ledger


def final_params(tmp, name):
    state = os.path.join(tmp, name + '_state')
    (sub,) = os.listdir(state)
    with numpy.load(os.path.join(state, sub, 'model.npz')) as f:
        return {k: f[k].copy() for k in f.files}


@pytest.mark.parametrize('only,extra', [
    ('VGC, alpha=2', ()), ('Strom, tau=0.1', ()),
    # the rule's own state too: DGC's step count (its density warm-up
    # changes at the epoch), PowerSGD's Q; DGC's momentum rows run SGD
    ('DGC, density=0.001', ('--seeds', '', '--momentum-seeds', '0')),
    ('PowerSGD, rank=2', ())])
def test_interrupted_run_resumes_bit_for_bit(tmp_path, capsys, only, extra):
    tmp = str(tmp_path)
    whole = ledger_run(tmp, 'whole', only, *extra)
    # the same run, cut after its first epoch, then resumed
    cut = ledger_run(tmp, 'cut', only, '--max-epochs', '1', *extra)
    assert not os.path.exists(cut)  # no row for an unfinished run
    ledger_run(tmp, 'cut', only, *extra)
    (a,), (b,) = rows(whole), rows(cut)
    for column in paper_ledger.COLUMNS:
        if column != 'seconds':
            assert a[column] == b[column], column
    assert len(eval(a['epoch_accuracy'])) == 2
    pa = final_params(tmp, 'whole')
    pb = final_params(tmp, 'cut')
    assert sorted(pa) == sorted(pb) and pa
    for k in pa:
        numpy.testing.assert_array_equal(pa[k], pb[k], err_msg=k)
    # a finished row is never run again
    capsys.readouterr()
    ledger_run(tmp, 'cut', only, *extra)
    assert '0 to run' in capsys.readouterr().out
    assert len(rows(cut)) == 1


def test_per_parameter_counts_are_every_element_without_compression(
        tmp_path):
    """'none' sends every element: each parameter's elements per epoch are
    its size times the steps (the first step only broadcasts), and its
    share of the message is its share of the parameters."""
    tmp = str(tmp_path)
    ledger = ledger_run(tmp, 'none', 'no compression')
    (row,) = rows(ledger)
    import json
    sizes = json.loads(row['param_sizes'])
    counts = json.loads(row['epoch_param_elements'])
    names = list(sizes)
    assert names == ['/predictor/layers/{}/{}'.format(k, p)
                     for k in range(3) for p in 'Wb']
    steps = [2, 3]  # epoch 1: 3 updates, the first a broadcast
    for e, per_epoch in enumerate(counts):
        assert per_epoch == [float(sizes[n] * steps[e]) for n in names]
    import ledger_report
    share = ledger_report.shares(counts)
    total = sum(sizes.values())
    numpy.testing.assert_allclose(share[1], [sizes[n] / total
                                             for n in names])
    assert float(row['compression']) == 1.0


def test_traffic_table_by_hand():
    """Two seeds of a hand-made ledger whose parameters are listed out of
    the model's order (block10 before block2, as a dict sorted by name
    gives them): the densities come back in the model's order and the last
    epoch's shares by kind of layer and per parameter are the means over
    the seeds of the hand-computed ones."""
    import json
    import ledger_report
    sizes = {'/predictor/block10/conv/W': 100,
             '/predictor/block2/bn/gamma': 10,
             '/predictor/block2/conv/W': 50, '/predictor/fc1/W': 40}

    def row(seed, last):
        return {'optimizer': 'adam', 'label': 'VGC, alpha=2', 'method': 'vgc',
                'seed': seed, 'iterations': '20', 'epochs': '2',
                'param_sizes': json.dumps(sizes),
                'epoch_param_elements': json.dumps([[1.0, 1.0, 1.0, 1.0],
                                                    last])}

    # per step: 10 steps an epoch; seed 0 sends 60 elements in the last
    # epoch (30 block10, 10 gamma, 0 block2 W, 20 fc), seed 1 sends 100
    rows_ = [row(0, [30.0, 10.0, 0.0, 20.0]), row(1, [50.0, 0.0, 25.0, 25.0])]
    names, dens = ledger_report.density_by_layer(rows_)[
        ('adam', 'VGC, alpha=2')]
    assert names == ['/predictor/block2/bn/gamma', '/predictor/block2/conv/W',
                     '/predictor/block10/conv/W', '/predictor/fc1/W']
    numpy.testing.assert_allclose(dens[1], [
        (10 / 10 + 0) / 2 / 10, (0 + 25 / 50) / 2 / 10,
        (30 / 100 + 50 / 100) / 2 / 10, (20 / 40 + 25 / 40) / 2 / 10])
    text = ledger_report.traffic(rows_).splitlines()
    assert len(text) == 3
    # shares: seed 0 (1/2, 1/6, 0, 1/3), seed 1 (1/2, 0, 1/4, 1/4)
    conv, bn, fc = (1 / 2 + 0 + 1 / 2 + 1 / 4) / 2, 1 / 12, (1 / 3 + 1 / 4) / 2
    assert text[2].startswith('| adam | VGC, alpha=2 | {:.0%} | {:.0%} | '
                              '{:.0%} | block10/conv/W (50%, '.format(
                                  conv, bn, fc)), text[2]
    assert 'fc1/W (29%, 5.6e-02), block2/conv/W (12%, 2.5e-02) |' in text[2]
    assert [ledger_report.layer_kind(n) for n in names] == [
        'BN', 'conv', 'conv', 'fc']


def test_paired_gaps_take_each_seeds_own_baseline():
    """The gap to no compression is taken seed by seed (a run without its
    seed's baseline has none), per optimizer."""
    import ledger_report

    def row(opt, method, label, seed, acc):
        return {'optimizer': opt, 'method': method, 'label': label,
                'seed': str(seed), 'accuracy': str(acc)}
    rows_ = [row('adam', 'none', 'no compression', 0, 0.90),
             row('adam', 'none', 'no compression', 1, 0.80),
             row('adam', 'vgc', 'VGC', 0, 0.91),
             row('adam', 'vgc', 'VGC', 1, 0.79),
             row('adam', 'vgc', 'VGC', 2, 0.50),
             row('momentum', 'vgc', 'VGC', 0, 0.85)]
    gaps = ledger_report.paired_gaps(rows_)
    numpy.testing.assert_allclose(gaps[('adam', 'VGC')], [1.0, -1.0])
    assert gaps[('momentum', 'VGC')] == []
    assert gaps[('adam', 'no compression')] == [0.0, 0.0]


def test_report_of_the_committed_ledger(tmp_path):
    """``--report`` on docs/ledger.csv writes the table (one line per
    optimizer and method, the no-compression mean taken from the rows
    directly) and the four plots."""
    ledger = rows(os.path.join(ROOT, 'docs', 'ledger.csv'))
    paper_ledger.main(['--report', '--ledger',
                       os.path.join(ROOT, 'docs', 'ledger.csv'),
                       '--report-dir', str(tmp_path)])
    text = open(tmp_path / 'results_long_table.md').read()
    groups = {(r['optimizer'], r['label']) for r in ledger}
    lines = text.split('\n\n')[0].splitlines()[2:]
    assert len(lines) == len(groups)
    order = {}
    for line in lines:
        optimizer, label = line.split(' | ')[:2]
        order.setdefault(optimizer.strip('| '), []).append(label)
    assert all(labels == order['adam'][:len(labels)]
               for labels in order.values())
    base = [100 * float(r['accuracy']) for r in ledger
            if r['optimizer'] == 'adam' and r['method'] == 'none']
    assert '| adam | no compression | {} | {:.2f} '.format(
        len(base), numpy.mean(base)) in text
    for name in ('long_accuracy_vs_compression', 'long_compression_by_epoch',
                 'long_accuracy_by_epoch', 'long_density_by_layer'):
        with open(tmp_path / (name + '.png'), 'rb') as f:
            assert f.read(8) == b'\x89PNG\r\n\x1a\n', name


def test_a_ledger_of_fewer_columns_gets_the_new_ones_empty(tmp_path):
    """A row appended to a ledger written before a column existed
    rewrites it with today's header first: its old rows keep every value
    and get the new columns empty."""
    path = str(tmp_path / 'old.csv')
    old = paper_ledger.COLUMNS[:-1]
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=old)
        writer.writeheader()
        writer.writerow({c: 'old ' + c for c in old})
    paper_ledger.append_row(path, {c: 'new ' + c
                                   for c in paper_ledger.COLUMNS})
    with open(path, newline='') as f:
        assert next(csv.reader(f)) == paper_ledger.COLUMNS
    first, second = rows(path)
    assert first == dict({c: 'old ' + c for c in old},
                         **{paper_ledger.COLUMNS[-1]: ''})
    assert second == {c: 'new ' + c for c in paper_ledger.COLUMNS}
