"""The built wheel carries the CUDA sources and finds them when installed."""

import os
import subprocess
import sys
import zipfile

import pytest

from chainer_vgc.engines.native import bindings

# on both stacks (make test): its results depend on NumPy, the native
# build or the installed packages (docs/contributing.md)
pytestmark = pytest.mark.stack

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_wheel_ships_kernel_sources_and_finds_them(tmp_path):
    subprocess.run([sys.executable, '-m', 'pip', 'wheel', '-q', '--no-deps',
                    '--no-build-isolation', '-w', str(tmp_path), ROOT],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = [f for f in os.listdir(tmp_path) if f.endswith('.whl')]
    site = tmp_path / 'site'
    with zipfile.ZipFile(str(tmp_path / wheel)) as z:
        names = z.namelist()
        z.extractall(str(site))
    assert 'chainer_vgc/kernel_src/vgc_numerics.cuh' in names
    # every source of the native backend ships (native.source_hash() reads
    # them to tell a stale build)
    for name in bindings.SOURCES:
        assert 'chainer_vgc/kernel_src/' + name in names, name
    assert 'chainer_vgc/rules/vgc.py' in names
    out = subprocess.run(
        [sys.executable, '-c', 'import chainer_vgc.backends.cuda.kernels as k; '
         'print(k.source_dir()); print(len(k.source()))'],
        cwd=str(tmp_path), env=dict(os.environ, PYTHONPATH=str(site)),
        check=True, capture_output=True, text=True, timeout=120).stdout
    src_dir, length = out.split()
    assert src_dir == str(site / 'chainer_vgc' / 'kernel_src')
    with open(os.path.join(ROOT, 'kernels', 'vgc_numerics.cuh')) as f:
        assert int(length) == len(f.read())
