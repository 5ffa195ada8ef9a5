"""Smoke runs of the examples at 2 ranks, the paper harness on a tiny grid,
and the one-process simulation against a real mpiexec run."""

import argparse
import csv
import json
import os
import sys

import numpy
import pytest

from test_mpi import run
from test_mpi import run_ok

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, 'examples')
sys.path.insert(0, EXAMPLES)

import paper_table  # NOQA: E402
from chainer_vgc import datasets  # NOQA: E402


def example(n, script, *args, expect):
    return run_ok(n, os.path.join(EXAMPLES, script), *args, expect=expect,
                  timeout=400)


def test_train_mnist_smoke(tmp_path):
    out = str(tmp_path)
    proc = example(2, 'train_mnist.py', '--iterations', 10, '--unit', 32,
                   '--batchsize', 16, '--out', out,
                   expect='| test accuracy |')
    summary = json.load(open(os.path.join(out, 'summary.json')))
    for key in ('test_accuracy', 'compression', 'bytes_sent_per_rank',
                'dense_allreduce_bytes_per_rank'):
        assert numpy.isfinite(summary[key]), key
    assert summary['workers'] == 2 and summary['iterations'] == 10
    log = json.load(open(os.path.join(out, 'log')))
    for key in ('main/loss', 'validation/main/accuracy', 'vgc/compression',
                'vgc/interval_compression', 'vgc/total_compression'):
        assert numpy.isfinite(log[-1][key]), key
    for name in ('loss.png', 'accuracy.png', 'compression.png',
                 'snapshot_rank0', 'snapshot_rank1'):
        assert os.path.isfile(os.path.join(out, name)), name
    assert 'traffic saved' in proc.stdout


def test_resume_with_other_ranks_or_method_fails_on_every_rank(tmp_path):
    """Snapshots of a 2-rank vgc run: resuming on 3 ranks fails on every
    rank with a message (no FileNotFoundError on some, no hang); resuming
    with another method fails naming both methods."""
    out = str(tmp_path)
    example(2, 'train_mnist.py', '--iterations', 4, '--unit', 16,
            '--batchsize', 8, '--out', out, expect='| test accuracy |')
    script = os.path.join(EXAMPLES, 'train_mnist.py')
    proc, _ = run(3, script, '--iterations', 8, '--unit', 16, '--batchsize',
                  8, '--out', str(tmp_path / 'r3'), '--resume', out,
                  timeout=120)
    assert proc.returncode != 0
    assert 'snapshot files exist for ranks [0, 1] of 3' in proc.stdout + \
        proc.stderr
    assert 'FileNotFoundError' not in proc.stdout + proc.stderr
    proc, _ = run(2, script, '--method', 'hybrid', '--iterations', 8,
                  '--unit', 16, '--batchsize', 8, '--out',
                  str(tmp_path / 'h'), '--resume', out, timeout=120)
    assert proc.returncode != 0
    assert "saved with method 'vgc'" in proc.stdout + proc.stderr
    assert "this run uses 'hybrid'" in proc.stdout + proc.stderr


def test_train_cifar_synthetic_smoke(tmp_path):
    out = str(tmp_path)
    example(2, 'train_cifar.py', '--synthetic', '--iterations', 4,
            '--batchsize', 8, '--width', 0.125, '--optimizer', 'momentum',
            '--out', out, expect='| compression')
    log = json.load(open(os.path.join(out, 'log')))
    for key in ('main/loss', 'validation/main/accuracy', 'vgc/compression'):
        assert numpy.isfinite(log[-1][key]), key
    assert os.path.isfile(os.path.join(out, 'compression.png'))


@pytest.mark.parametrize('method,flags,kw', [
    ('vgc', ['--alpha', '1.0'], dict(alpha=1.0, zeta=0.999, quantize=True)),
    ('none', [], {}),
    ('qsgd', ['--bits', '3', '--bucket', '64'],
     dict(bits=3, bucket=64, seed=0)),
])
def test_simulation_matches_mpiexec_bit_for_bit(tmp_path, method, flags, kw):
    """The harness's one-process mode gives the parameters of a real
    ``mpiexec -n 2`` run of train_mnist.py."""
    out = str(tmp_path)
    example(2, 'train_mnist.py', '--method', method, *flags,
            '--iterations', 8, '--unit', 24, '--batchsize', 8,
            '--optimizer', 'momentum', '--out', out,
            expect='| test accuracy |')
    real = numpy.load(os.path.join(out, 'params.npz'))
    args = argparse.Namespace(unit=24, lr=0.05, weight_decay=0.0,
                              workers=2, batchsize=8, iterations=8, epoch=0)
    train, _ = datasets.get_mnist()
    model, sim, _ = paper_table.simulate(method, kw, 'momentum', 0, args,
                                         train)
    params = dict(model.namedparams())
    assert sorted(params) == sorted(real.files)
    for name in real.files:
        assert (params[name].array == real[name]).all(), name
    assert sim.totals['steps'] == 7  # the first iteration broadcasts


def test_paper_harness_tiny_grid(tmp_path):
    import subprocess
    out = str(tmp_path)
    run = os.path.join(EXAMPLES, 'paper_table.py')
    proc = subprocess.run(
        [sys.executable, run, '--grid', 'tiny', '--iterations', '40',
         '--workers', '2', '--unit', '32', '--optimizers', 'adam',
         '--out', out], capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(out, 'results.csv')) as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == paper_table.COLUMNS
    assert [r['label'] for r in rows] == [g[0] for g in paper_table.TINY]
    vgc = [float(r['compression']) for r in rows if r['method'] == 'vgc']
    assert vgc == sorted(vgc) and len(set(vgc)) == 3  # alpha 1 < 1.5 < 2
    assert float(rows[0]['compression']) == 1.0
    for r in rows:
        assert 0 <= float(r['accuracy']) <= 1
    table = open(os.path.join(out, 'table.md')).read()
    assert '| our method, alpha=1.5 |' in table
    assert os.path.getsize(os.path.join(out, 'scatter.png')) > 1000
