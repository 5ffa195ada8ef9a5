"""The GPU conformance suite (``tests/gpu_check.py``) as tests.

``gpu_check.py record DIR`` computes deterministic inputs and the NumPy
reference path's messages, states, sums, means and kernel outputs;
``gpu_check.py check DIR`` runs the same on CuPy arrays and compares every
result bit for bit (its record/check modes stay: record here, copy, check on
a GPU machine without network; docs/gpu_runbook.md).

- On a machine with a CUDA GPU and CuPy (marked ``gpu``; skipped without
  one): the whole check on the device, timings left out.
- Everywhere: the kernel checks through the fake CuPy (the kernels compiled
  for the host, ``tests/fake_cupy.py``), and the control that a corrupted
  reference makes every one of them fail (a check that cannot fail is not
  one).
"""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
GPU_CHECK = os.path.join(HERE, 'gpu_check.py')


def has_gpu():
    """Whether CuPy is importable and sees a CUDA device."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def gpu_check(*args, timeout=600):
    env = dict(os.environ, OPENBLAS_NUM_THREADS='1')
    env.pop('OUT', None)  # (the device tool's output folder)
    return subprocess.run([sys.executable, GPU_CHECK] + list(args),
                          capture_output=True, text=True, timeout=timeout,
                          env=env)


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
    """The recorded references (about 16 MB, 10 s)."""
    path = str(tmp_path_factory.mktemp('gpu_ref'))
    proc = gpu_check('record', path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return path


def results(path):
    with open(os.path.join(path, 'gpu_check.json')) as f:
        return json.load(f)


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason='needs a CUDA GPU and CuPy')
def test_every_check_passes_on_the_gpu(reference):
    proc = gpu_check('check', reference, '--no-timing', timeout=1800)
    out = results(reference)
    failed = [r['name'] for r in out['checks'] if r['status'] == 'FAIL']
    assert proc.returncode == 0 and not failed, failed or proc.stdout[-3000:]
    assert out['counts']['PASS'] > 200


def test_kernel_checks_pass_through_the_fake_cupy(reference):
    proc = gpu_check('check', reference, '--fake-cupy', '--small',
                     '--no-timing', '--only', '^kernel/')
    out = results(reference)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert out['counts']['FAIL'] == 0
    assert out['counts']['PASS'] > 50, out['counts']


def test_a_corrupted_reference_fails_every_kernel_check(reference):
    proc = gpu_check('check', reference, '--fake-cupy', '--small',
                     '--no-timing', '--only', '^kernel/', '--corrupt')
    out = results(reference)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert out['corrupt'] and out['counts']['PASS'] == 0, out['counts']
    assert out['counts']['FAIL'] > 50
