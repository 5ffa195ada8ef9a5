"""The built wheel carries the CUDA sources and finds them when installed;
built without a C++ compiler, it still installs, and its native backend
says how to fix that.  (The compiled wheel is tests/test_install.py's: the
README's recipe builds, installs and loads it.)"""

import os
import subprocess
import sys
import zipfile

import pytest

from chainer_vgc.engines.native import bindings
from source_tree import copy_source_tree

# on both stacks (make test): its results depend on NumPy, the native
# build or the installed packages (docs/contributing.md)
pytestmark = pytest.mark.stack

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_wheel_ships_kernel_sources_and_finds_them(tmp_path):
    # a copy without build outputs (a build/ with an up-to-date library
    # would be packed without compiling), built with CC and CXX a command
    # that fails: setup.py's extensions are optional
    src = tmp_path / 'src'
    copy_source_tree(str(src))
    env = dict(os.environ, CC='false', CXX='false')
    subprocess.run([sys.executable, '-m', 'pip', 'wheel', '-q', '--no-deps',
                    '--no-build-isolation', '-w', str(tmp_path), str(src)],
                   check=True, capture_output=True, timeout=300, env=env)
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
    # no compiler, no library: the wheel has none, and using the native
    # backend raises the error that names the fixes
    assert not [n for n in names if n.endswith('.so')], names
    proc = subprocess.run(
        [sys.executable, '-c', 'from chainer_vgc.engines.native import '
         'bindings; bindings.load()'],
        cwd=str(tmp_path), env=dict(os.environ, PYTHONPATH=str(site)),
        capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith('chainer_vgc.engines.native.bindings.'
                           'NativeBackendError: '), last
    for words in ('is not built', 'a C++ compiler with OpenMP',
                  'CHAINER_VGC_BACKEND=numpy'):
        assert words in last, (words, last)
