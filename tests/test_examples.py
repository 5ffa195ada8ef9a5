"""Smoke runs of the examples at 2 ranks, the paper harness on a tiny grid,
and the one-process simulation against a real mpiexec run."""

import argparse
import csv
import json
import os
import subprocess
import sys

import numpy
import pytest

from mpirun import run
from mpirun import run_ok

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, 'examples')
sys.path.insert(0, EXAMPLES)

import paper_table  # NOQA: E402
from chainer_vgc.harness import datasets  # NOQA: E402

# multi-rank runs oversubscribe the cores: under pytest-xdist they run one
# after the other, on one worker, beside the single-process tests
pytestmark = pytest.mark.xdist_group('mpiexec')


#: the examples that draw plots on rank 0 unless told --no-plot
PLOTTING = ('train_mnist.py', 'train_cifar.py')


def example(n, script, *args, expect, plot=False):
    """Run an example on ``n`` ranks; its plots only where ``plot`` (the
    tests that look at them: drawing them is about 3 s of CPU a run)."""
    if script in PLOTTING and not plot:
        args += ('--no-plot',)
    return run_ok(n, os.path.join(EXAMPLES, script), *args, expect=expect,
                  timeout=400)


@pytest.mark.stack  # (Chainer trains on this stack's NumPy, with MPI)
def test_train_mnist_smoke(tmp_path):
    out = str(tmp_path)
    proc = example(2, 'train_mnist.py', '--iterations', 10, '--unit', 32,
                   '--batchsize', 16, '--out', out,
                   expect='| test accuracy |', plot=True)
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


@pytest.mark.parametrize('db', [[], ['--double-buffering']])
def test_train_gan_shares_one_communicator(tmp_path, db):
    """examples/train_gan.py at 2 ranks: the generator and the
    discriminator on one communicator report apart (gen/vgc/compression,
    dis/vgc/compression) and end with the parameters of a communicator
    each, bit for bit (issue 24, finding 1)."""
    outs = [str(tmp_path / 'shared'), str(tmp_path / 'own')]
    shared = example(2, 'train_gan.py', '--iterations', 8, '--units', 32,
                     '--out', outs[0], *db, expect='| dis |')
    example(2, 'train_gan.py', '--iterations', 8, '--units', 32, '--out',
            outs[1], '--communicator-per-model', *db, expect='| dis |')
    assert 'gen/vgc/compression' in shared.stdout
    assert 'dis/vgc/compression' in shared.stdout
    log = json.load(open(os.path.join(outs[0], 'log')))
    assert numpy.isfinite(log[-1]['gen/vgc/compression'])
    assert numpy.isfinite(log[-1]['dis/vgc/compression'])
    for r in range(2):
        a, b = (numpy.load(os.path.join(o, 'params_rank{}.npz'.format(r)))
                for o in outs)
        assert sorted(a.files) == sorted(b.files) and len(a.files) == 8
        for k in a.files:
            assert (a[k] == b[k]).all(), (r, k)


def test_train_mnist_double_buffering(tmp_path):
    """--double-buffering through the Trainer, LogReport, evaluator and
    per-rank snapshots at 2 ranks: the log has the applied exchanges'
    figures (none of the private running-total keys), the summary counts
    every exchange (the last one too: final_report waits for it)."""
    out = str(tmp_path)
    proc = example(2, 'train_mnist.py', '--iterations', 12, '--unit', 32,
                   '--batchsize', 16, '--double-buffering', '--out', out,
                   expect='| test accuracy |')
    assert 'double_buffering=True' in proc.stdout
    summary = json.load(open(os.path.join(out, 'summary.json')))
    assert summary['exchanges'] == 11  # the first update broadcasts
    assert numpy.isfinite(summary['test_accuracy'])
    log = json.load(open(os.path.join(out, 'log')))
    assert numpy.isfinite(log[-1]['vgc/compression'])
    assert not [k for entry in log for k in entry if '/_' in k or
                k.startswith('_')]
    for r in range(2):
        assert os.path.isfile(os.path.join(out, 'snapshot_rank{}'.format(r)))
    # run with --no-plot (example()): the log without its plots
    assert not [f for f in os.listdir(out) if f.endswith('.png')]


def test_train_mnist_dense_group_and_warmup(tmp_path):
    """--exclude-small, --warmup and --dense-dtype reach the communicator:
    the biases (< 100 elements) go dense in float16, the first 3 exchanges
    are dense for every parameter, and the compression over all parameters
    is below the compressed group's."""
    out = str(tmp_path)
    proc = example(2, 'train_mnist.py', '--iterations', 10, '--unit', 32,
                   '--batchsize', 16, '--exclude-small', 100, '--warmup', 3,
                   '--dense-dtype', 'float16', '--out', out,
                   expect='| compressed group: compression')
    n_params = 784 * 32 + 32 + 32 * 32 + 32 + 32 * 10 + 10
    n_dense = 32 + 32 + 10  # the biases
    log = json.load(open(os.path.join(out, 'log')))
    # reports every 2 iterations; iteration 1 broadcasts, iterations 2-4
    # are the warm-up's 3 dense exchanges
    assert [e['iteration'] for e in log] == [2, 4, 6, 8, 10]
    for e in log[:2]:
        assert e['vgc/compression'] == 1.0 and e['vgc/dense_fraction'] == 1.0
    for e in log[2:]:
        assert e['vgc/dense_fraction'] == pytest.approx(n_dense / n_params)
        assert 0 < e['vgc/dense_fraction'] < 1
        assert numpy.isfinite(e['vgc/compression_compressed'])
        assert 1 < e['vgc/compression'] < e['vgc/compression_compressed']
    summary = json.load(open(os.path.join(out, 'summary.json')))
    assert summary['controls'] == dict(min_size=100, warmup=3,
                                       dense_dtype='float16')
    assert summary['parameters'] == n_params
    assert summary['compressed_parameters'] == n_params - n_dense
    assert summary['exchanges'] == 9
    assert summary['compressed_exchanges'] == 6
    assert 1 < summary['compression'] < summary['compression_compressed']
    assert 'min_size=100, warmup=3, dense_dtype=float16' in proc.stdout
    assert 'the 6 of 9 exchanges after the warm-up' in proc.stdout


def test_warmup_epochs_flag_conflicts_and_conversion():
    import subprocess
    script = os.path.join(EXAMPLES, 'train_mnist.py')
    proc = subprocess.run(
        [sys.executable, script, '--warmup', '2', '--warmup-epochs', '1'],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert 'not allowed with argument' in proc.stderr
    import train_mnist
    train, _ = datasets.get_mnist()
    # 50,000 images: shards of 25,000 (2 ranks), 16,667 (3 ranks)
    assert train_mnist.epoch_steps(1, train, 2, 32) == 782  # 781.25
    assert train_mnist.epoch_steps(0.5, train, 2, 50) == 250
    assert train_mnist.epoch_steps(1, train, 3, 1) == 16667
    assert train_mnist.epoch_steps(0, train, 2, 32) == 0


def test_resume_with_other_ranks_or_method_fails_on_every_rank(tmp_path):
    """Snapshots of a 2-rank vgc run: resuming on 3 ranks fails on every
    rank with a message (no FileNotFoundError on some, no hang); resuming
    with another method fails naming both methods."""
    out = str(tmp_path)
    example(2, 'train_mnist.py', '--iterations', 4, '--unit', 16,
            '--batchsize', 8, '--out', out, expect='| test accuracy |')
    script = os.path.join(EXAMPLES, 'train_mnist.py')
    out3 = fails_saying(3, script, '--iterations', 8, '--unit', 16,
                        '--batchsize', 8, '--out', str(tmp_path / 'r3'),
                        '--resume', out, saying=[
                            'snapshot files exist for ranks [0, 1] of 3'])
    assert 'FileNotFoundError' not in out3
    fails_saying(2, script, '--method', 'hybrid', '--iterations', 8,
                 '--unit', 16, '--batchsize', 8, '--out', str(tmp_path / 'h'),
                 '--resume', out, saying=["saved with method 'vgc'",
                                          "this run uses 'hybrid'"])


def fails_saying(n, script, *args, saying):
    """Run a job that must fail (non-zero), and whose output must say each
    of ``saying``; returns the output.  When one rank's MPI_Abort kills
    the others, mpiexec may cut their stderr short, and sometimes the
    first rank's message is among what is cut: up to three runs, each
    must fail, one must carry the whole message."""
    for attempt in range(3):
        proc, _ = run(n, script, *args, timeout=120)
        text = proc.stdout + proc.stderr
        assert proc.returncode != 0, text[-3000:]
        if all(s in text for s in saying):
            return text
    raise AssertionError('no run said {!r}: {}'.format(saying, text[-3000:]))


def test_train_seq2seq_compresses_variable_length_sentences(tmp_path):
    """examples/train_seq2seq.py at 2 ranks (ChainerMN's seq2seq shape:
    NStepLSTM with dropout, 2B sentences per update, the one documented
    option examples=chainer_vgc.sentence_pairs): it trains with every
    parameter covered and sends fewer elements than it has."""
    proc = example(2, 'train_seq2seq.py', '--iterations', 12, '--batchsize',
                   8, '--units', 16, '--out', str(tmp_path),
                   expect='summary ')
    line = [x for x in proc.stdout.splitlines() if x.startswith('summary ')]
    summary = json.loads(line[-1][len('summary '):])
    assert summary['ranks'] == 2 and summary['iterations'] == 12
    assert numpy.isfinite(summary['loss'])
    assert summary['compression_run'] > 2, summary


def test_train_transformer_with_the_two_lines_and_no_option(tmp_path):
    """examples/train_transformer.py at 2 ranks: a Transformer (LayerNorm,
    a tied embedding, a positional embedding added by broadcast, dropout,
    a decoder input built with NumPy) trains with the README's two lines
    and no option, every parameter compressed (none dense), sending fewer
    elements than it has; --by-parameter gives every parameter's
    density."""
    proc = example(2, 'train_transformer.py', '--iterations', 12,
                   '--batchsize', 8, '--units', 16, '--layers', 1,
                   '--by-parameter', '--out', str(tmp_path),
                   expect='summary ')
    line = [x for x in proc.stdout.splitlines() if x.startswith('summary ')]
    summary = json.loads(line[-1][len('summary '):])
    assert summary['ranks'] == 2 and summary['iterations'] == 12
    assert numpy.isfinite(summary['loss'])
    assert summary['dense'] == [], summary['dense']
    assert summary['compression_run'] > 2, summary
    density = summary['density_last']
    assert '/embed/W' in density and '/encoder/0/norm1/gamma' in density
    assert all(0 <= d <= 1 for d in density.values()), density


def test_train_cifar_synthetic_smoke(tmp_path):
    out = str(tmp_path)
    example(2, 'train_cifar.py', '--synthetic', '--iterations', 4,
            '--batchsize', 8, '--width', 0.125, '--optimizer', 'momentum',
            '--out', out, expect='| compression', plot=True)
    log = json.load(open(os.path.join(out, 'log')))
    for key in ('main/loss', 'validation/main/accuracy', 'vgc/compression'):
        assert numpy.isfinite(log[-1][key]), key
    assert os.path.isfile(os.path.join(out, 'compression.png'))


@pytest.mark.parametrize('method,flags,kw,group', [
    ('vgc', ['--alpha', '1.0'], dict(alpha=1.0, zeta=0.999, quantize=True),
     {}),
    ('none', [], {}, {}),
    ('qsgd', ['--bits', '3', '--bucket', '64'],
     dict(bits=3, bucket=64, seed=0), {}),
    # the methods users pick instead (issue 51): dgc's momentum in the rule
    # (plain SGD), powersgd's allreduces of P and Q
    ('dgc', ['--density', '0.01', '--density-warmup-steps', '3'],
     dict(density=0.01, density_warmup_steps=3), {}),
    ('powersgd', ['--matrix-rank', '2'], dict(matrix_rank=2, seed=0), {}),
    # 0.001 epoch of a 25,000-image shard in batches of 8: 4 dense
    # exchanges of the 7, then the biases dense
    ('vgc', ['--alpha', '2.0', '--exclude-small', '100', '--warmup-epochs',
             '0.001'], dict(alpha=2.0, zeta=0.999, quantize=True),
     dict(exclude_small=100, warmup_epochs=0.001)),
])
def test_simulation_matches_mpiexec_bit_for_bit(tmp_path, method, flags, kw,
                                                group):
    """The harness's one-process mode gives the parameters of a real
    ``mpiexec -n 2`` run of train_mnist.py (with a dense group and a
    warm-up in epochs too)."""
    out = str(tmp_path)
    example(2, 'train_mnist.py', '--method', method, *flags,
            '--iterations', 8, '--unit', 24, '--batchsize', 8,
            '--optimizer', 'momentum', '--out', out,
            expect='| test accuracy |')
    real = numpy.load(os.path.join(out, 'params.npz'))
    args = argparse.Namespace(unit=24, lr=0.05, weight_decay=0.0,
                              workers=2, batchsize=8, iterations=8, epoch=0,
                              **group)
    train, _ = datasets.get_mnist()
    model, sim, _ = paper_table.simulate(method, kw, 'momentum', 0, args,
                                         train)
    params = dict(model.namedparams())
    assert sorted(params) == sorted(real.files)
    for name in real.files:
        assert (params[name].array == real[name]).all(), name
    assert sim.totals['steps'] == 7  # the first iteration broadcasts
    summary = json.load(open(os.path.join(out, 'summary.json')))
    assert summary['compression'] == pytest.approx(
        paper_table.run_summary(sim.totals, sim.compressor,
                                2)['vgc/total_compression'])
    if group:
        assert sim.warmup == 4 and summary['controls']['warmup'] == 4
        assert summary['compressed_exchanges'] == 3
        assert 0 < sim.last['vgc/dense_fraction'] < 1
    # both sides above average with the same code: the simulation's mean
    # against one computed here from every worker's decoded update (a
    # message's; powersgd's factors are tests/test_powersgd.py's)
    if method != 'powersgd':
        check_simulated_mean(method, kw, min_size=6 if group else 0)


def check_simulated_mean(method, kw, min_size):
    """One exchange of SimulatedWorkers (2 workers): ``param.grad`` must be
    the mean of the workers' updates, each decoded here (tests/reference)
    from a compressor of the same rule fed the same gradients; parameters
    of fewer than ``min_size`` elements go dense (their update is the
    gradient)."""
    import chainer
    import chainer.links as L
    import reference
    from chainer_vgc import GradientCompressor
    from chainer_vgc import create_rule
    from chainer_vgc.harness.simulation import SimulatedWorkers
    from chainer_vgc.statistics import PerSampleSquares
    from chainer_vgc.statistics import model_params
    numpy.random.seed(0)
    model = L.Classifier(chainer.Sequential(
        L.Linear(6, 5), chainer.functions.relu, L.Linear(5, 3)))
    rng = numpy.random.default_rng(0)
    batches = [(rng.normal(size=(8, 6)).astype(numpy.float32),
                rng.integers(0, 3, 8).astype(numpy.int32))
               for _ in range(2)]
    sim = SimulatedWorkers(model, chainer.optimizers.SGD(lr=0.1).setup(
        model), 2, method=method, min_size=min_size, **kw)
    sim.update(model, batches)  # the first update only "broadcasts"
    names, params = model_params(model)
    rule = create_rule(method, **kw)
    dense = [p.size < min_size or rule.keeps_dense(p.shape) for p in params]
    compressed = [k for k, d in enumerate(dense) if not d]
    total = [numpy.zeros(p.size) for p in params]
    for rank, batch in enumerate(batches):
        model.cleargrads()
        loss = model(*batch)
        stats = PerSampleSquares(model)
        stats.skip = {n for n, d in zip(names, dense) if d}
        sq = (stats.backward(loss, batch=batch) if rule.needs_sqsum
              else loss.backward())
        comp = GradientCompressor(
            rule.for_rank(rank), [names[k] for k in compressed],
            [params[k].shape for k in compressed],
            [params[k].dtype for k in compressed])
        msg = comp.compress([params[k].grad for k in compressed],
                            None if sq is None else
                            [sq[k] for k in compressed])
        decoded = reference.decode_message(
            msg, [params[k].size for k in compressed])
        for k, update in zip(compressed, decoded):
            total[k] += update
        for k, d in enumerate(dense):
            if d:
                total[k] += params[k].grad.reshape(-1)
    before = [p.array.copy() for p in params]
    sim.update(model, batches)
    # (the two biases: by min_size, or dgc's vectors)
    assert sum(dense) == (2 if min_size or method == 'dgc' else 0)
    for name, p, t, b in zip(names, params, total, before):
        numpy.testing.assert_allclose(p.grad.reshape(-1), t / 2, rtol=1e-6,
                                      atol=1e-30, err_msg=name)
        assert (p.array != b).any() or not t.any(), name


def test_paper_harness_row_settings():
    """The extra row: warm-up converted from epochs to exchanges, the 1-D
    parameters dense afterwards; the global flags add to a row's."""
    label, method, kw, settings = paper_table.row_parts(paper_table.GRID[7])
    assert method == 'vgc' and kw == dict(alpha=2.0)
    assert 'warm-up' in label and 'biases dense' in label
    assert settings['warmup_epochs'] == 0.1
    assert all(paper_table.row_parts(r)[3] == {}
               for r in paper_table.GRID if r is not paper_table.GRID[7])
    train, _ = datasets.get_mnist()
    args = argparse.Namespace(unit=16, lr=0.05, weight_decay=0.0, workers=2,
                              batchsize=25000, iterations=6, epoch=0,
                              exclude_small=0, warmup_epochs=0.0)
    # batches of a whole shard: 0.1 epoch rounds up to 1 exchange
    model, sim, _ = paper_table.simulate(method, kw, 'adam', 0, args,
                                         train, settings)
    assert sim.warmup == 1 and sim.totals['steps'] == 5
    biases = sum(p.size for p in model.params() if p.ndim == 1)
    n = sum(p.size for p in model.params())
    assert sim.last['vgc/dense_fraction'] == pytest.approx(biases / n)
    assert (sim.last['vgc/compression'] <
            sim.last['vgc/compression_compressed'])
    got = paper_table.group_settings(
        argparse.Namespace(exclude_small=300, warmup_epochs=2.0, workers=2,
                           batchsize=25000), settings, train, 0)
    assert got['min_size'] == 300 and got['warmup'] == 1
    assert got['exclude'] == [paper_table.biases_dense]
    got = paper_table.group_settings(
        argparse.Namespace(exclude_small=0, warmup_epochs=2.0, workers=2,
                           batchsize=25000), {}, train, 0)
    assert got == dict(exclude=None, min_size=0, warmup=2)


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
    vgc = [float(r['compression']) for r in rows if r['method'] == 'vgc'
           and 'warm-up' not in r['label']]
    assert vgc == sorted(vgc) and len(set(vgc)) == 3  # alpha 1 < 1.5 < 2
    assert float(rows[0]['compression']) == 1.0
    # the 0.1-epoch warm-up (79 exchanges) covers all 39: every parameter
    # dense, the run of no compression
    warm = rows[-1]
    assert 'warm-up' in warm['label'] and warm['method'] == 'vgc'
    assert float(warm['compression']) == 1.0
    assert warm['accuracy'] == rows[0]['accuracy']
    assert warm['hyperparameters'] == 'alpha=2.0'
    for r in rows:
        assert 0 <= float(r['accuracy']) <= 1
    table = open(os.path.join(out, 'table.md')).read()
    assert '| our method, alpha=1.5 |' in table
    assert os.path.getsize(os.path.join(out, 'scatter.png')) > 1000


def test_paper_harness_runs_the_conv_bn_network_on_fashion_mnist(
        tmp_path, monkeypatch):
    """``--dataset fashion --model vgg``: the App. D network on 28x28x1
    Fashion-MNIST (idx files written here) trains in the harness with
    the exact per-sample statistics of every Convolution2D and
    BatchNormalization (error mode: an uncovered parameter would raise, and
    none goes to brute force), and the CLI writes the table and plot."""
    import fashion_files
    fashion_files.fake_package(str(tmp_path / 'fm'), n_train=48, n_test=16)
    monkeypatch.setenv(datasets.FASHION_ENV, str(tmp_path / 'fm'))
    args = argparse.Namespace(unit=0, lr=0.05, weight_decay=0.0, workers=2,
                              batchsize=4, iterations=3, epoch=0,
                              exclude_small=0, warmup_epochs=0.0,
                              dataset='fashion', model='vgg', width=1 / 16)
    train, test = paper_table.common.load_data(args)
    assert train[0][0].shape == (1, 28, 28) and len(test) == 16
    model, sim, n = paper_table.simulate('vgc', dict(alpha=1.0), 'momentum',
                                         0, args, train)
    kinds = {type(link).__name__ for link in model.links()}
    assert {'Convolution2D', 'BatchNormalization'} <= kinds
    assert sim.stats.uncovered == 'error' and not sim.stats.uncovered_names
    assert all(s is not None for s in sim.stats.sqsums)
    assert sim.totals['steps'] == n - 1 and sim.last['vgc/compression'] > 1
    # the time columns: every worker step of vgc ran the statistics
    clock = sim.seconds
    assert clock['worker_steps'] == clock['statistics_steps'] == 2 * (n - 1)
    assert clock['compute'] > 0 and clock['exchange'] > 0
    cols = paper_table.timing(sim)
    assert cols['statistics'] == 1.0 and cols['compute_ms'] > 0
    _, plain, _ = paper_table.simulate('qsgd', dict(bits=2, bucket=128),
                                       'momentum', 0, args, train)
    assert plain.seconds['statistics_steps'] == 0
    assert plain.seconds['worker_steps'] == 2 * (n - 1)
    assert paper_table.timing(plain)['statistics'] == 0.0
    # --no-dropout: App. D's network without its dropout layers
    assert model.predictor.dropout
    args.no_dropout = True
    fresh = paper_table.common.make_network(args, 0)
    assert not fresh.predictor.dropout
    # the initializing pass leaves batch normalization as initialized
    norms = [l for l in fresh.links()
             if type(l).__name__ == 'BatchNormalization']
    assert norms and all(
        l.N == 0 and not l.avg_mean.any() and (l.avg_var == 1).all()
        for l in norms)
    assert 'no dropout' in paper_table.common.describe(args)
    # the same network and data with 2 MPI ranks: one code path
    run = str(tmp_path / 'mpi')
    example(2, 'train_mnist.py', '--dataset', 'fashion', '--model', 'vgg',
            '--width', '0.0625', '--iterations', 3, '--batchsize', 4,
            '--optimizer', 'momentum', '--out', run,
            expect='| test accuracy |')
    summary = json.load(open(os.path.join(run, 'summary.json')))
    assert summary['iterations'] == 3 and summary['compression'] > 1
    real = numpy.load(os.path.join(run, 'params.npz'))
    assert any(n.endswith('/bn/gamma') for n in real.files)
    out = str(tmp_path / 'out')
    example(1, 'paper_table.py', '--dataset', 'fashion', '--model', 'vgg',
            '--width', '0.0625', '--grid', 'tiny', '--workers', 2,
            '--iterations', 2, '--batchsize', 4, '--optimizers', 'adam',
            '--no-dropout', '--out', out,
            expect='Fashion-MNIST App. D VGG (width 0.0625, 28x28x1 input, '
            'no dropout)')
    assert {'results.csv', 'table.md', 'scatter.png'} <= set(os.listdir(out))


def test_paper_harness_jobs_give_the_rows_of_one_process(tmp_path):
    """``--jobs 2`` runs the grid in two processes: the same rows (every
    run is seeded), written in the table's order; the time columns say
    which runs computed the statistics."""
    rows = {}
    for jobs in (1, 2):
        out = str(tmp_path / str(jobs))
        proc = subprocess.run(
            [sys.executable, os.path.join(EXAMPLES, 'paper_table.py'),
             '--grid', 'tiny', '--iterations', '6', '--workers', '2',
             '--unit', '16', '--jobs', str(jobs), '--out', out],
            capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert '| our method, alpha=1.5 |' in proc.stdout
        with open(os.path.join(out, 'results.csv')) as f:
            rows[jobs] = list(csv.DictReader(f))
    same = ('optimizer', 'label', 'seed', 'accuracy', 'compression',
            'bytes_per_rank', 'statistics')
    assert len(rows[1]) == 2 * len(paper_table.TINY)
    assert [[r[k] for k in same] for r in rows[2]] == \
        [[r[k] for k in same] for r in rows[1]]
    for r in rows[2]:
        used = r['method'] == 'vgc' and 'warm-up' not in r['label']
        assert float(r['statistics']) == (1.0 if used else 0.0), r
        assert float(r['compute_ms']) > 0
    table = open(os.path.join(str(tmp_path / '2'), 'table.md')).read()
    assert 'the statistics add' in table


def test_statistics_overhead_is_the_ratio_of_medians():
    rows = [dict(statistics='1.0', compute_ms='12'),
            dict(statistics='1.0', compute_ms='15'),
            dict(statistics='1.0', compute_ms='30'),
            dict(statistics='0.0', compute_ms='10'),
            dict(statistics='0.0', compute_ms='9'),
            dict(statistics='0.5', compute_ms='99'),  # neither kind
            dict(statistics='', compute_ms='')]       # an older CSV row
    assert paper_table.statistics_overhead(rows) == (
        15.0, 12.0, 30.0, 9.5, 9.0, 10.0, 100 * (15 / 9.5 - 1))
    assert paper_table.statistics_overhead(rows[3:5]) is None
