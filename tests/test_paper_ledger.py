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


@pytest.mark.parametrize('only', ['VGC, alpha=2', 'Strom, tau=0.1'])
def test_interrupted_run_resumes_bit_for_bit(tmp_path, capsys, only):
    tmp = str(tmp_path)
    whole = ledger_run(tmp, 'whole', only)
    # the same run, cut after its first epoch, then resumed
    cut = ledger_run(tmp, 'cut', only, '--max-epochs', '1')
    assert not os.path.exists(cut)  # no row for an unfinished run
    ledger_run(tmp, 'cut', only)
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
    ledger_run(tmp, 'cut', only)
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
