"""The start-up hook (chainer_vgc/_startup/_chainer_vgc_compat.py): Chainer
7.8.1 imports on NumPy 2 whatever is imported first, with exactly the
removed names put back, and nothing else touched; a no-op on numpy 1.23.

Run on both stacks by `make test`.  Subprocess tests start a fresh
interpreter of this venv (where the .pth file is installed) with the
warning filters cleared, so a warning on stderr fails them.
"""

import os
import subprocess
import sys
import textwrap
import warnings

import numpy
import pytest

import _chainer_vgc_compat as compat

# on both stacks (make test): its results depend on NumPy, the native
# build or the installed packages (docs/contributing.md)
pytestmark = pytest.mark.stack

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUMPY2 = int(numpy.__version__.split('.')[0]) >= 2

#: numpy.sctypes as numpy 1.23.5 has it on x86-64 Linux, by dtype name (the
#: np1 stack also checks the rebuild against the real dict, object for object)
SCTYPES_X86_64_LINUX = {
    'int': ['int8', 'int16', 'int32', 'int64'],
    'uint': ['uint8', 'uint16', 'uint32', 'uint64'],
    'float': ['float16', 'float32', 'float64', 'float128'],
    'complex': ['complex64', 'complex128', 'complex256'],
}


def python(code, extra_path=None, timeout=300):
    """Run ``code`` in a fresh interpreter of this venv, outside the
    checkout (so that only the installed package and hook are seen), with
    no warning filter from the environment."""
    env = {k: v for k, v in os.environ.items()
           if k not in ('PYTHONWARNINGS', 'PYTHONPATH')}
    if extra_path:
        env['PYTHONPATH'] = extra_path
    return subprocess.run([sys.executable, '-c', textwrap.dedent(code)],
                          cwd='/', env=env, capture_output=True, text=True,
                          timeout=timeout)


def by_name(types):
    return {kind: [numpy.dtype(t).name for t in ts]
            for kind, ts in types.items() if kind != 'others'}


def test_sctypes_rebuilt_by_numpy1s_rule():
    rebuilt = compat.numpy1_sctypes(numpy)
    if not NUMPY2:
        # the independent oracle: numpy 1.x's own dict, object for object
        assert rebuilt == numpy.sctypes
    if sys.platform.startswith('linux') and os.uname().machine == 'x86_64':
        assert by_name(rebuilt) == SCTYPES_X86_64_LINUX
    assert rebuilt['others'] == [bool, object, bytes, str, numpy.void]


def test_missing_names_per_stack():
    import chainer  # noqa: F401  (the hook has run by now)
    if NUMPY2:
        assert numpy.float is float
        if os.uname().machine == 'x86_64':  # NumPy 1.x's dict, by name
            assert by_name(numpy.sctypes) == SCTYPES_X86_64_LINUX
        assert numpy.sctypes['others'] == [bool, object, bytes, str,
                                           numpy.void]
        assert set(compat.added_names()) >= {'float', 'sctypes'}
        # never a name NumPy 2 defines again
        assert numpy.bool is numpy.bool_
    else:  # numpy 1.23: nothing is missing, nothing was added
        assert compat.missing_numpy_names(numpy) == []
        assert compat.added_names() == ()
        with warnings.catch_warnings():
            warnings.simplefilter('ignore', DeprecationWarning)
            assert numpy.float is float  # numpy 1.23's own alias


def test_restore_is_a_no_op_when_nothing_is_missing():
    import chainer  # noqa: F401  (the hook has run by now)
    with warnings.catch_warnings():  # numpy 1.23: numpy.float deprecated
        warnings.simplefilter('ignore', DeprecationWarning)
        before = {n: getattr(numpy, n) for n in ('float', 'sctypes',
                                                 'bool_')}
        assert compat.restore_numpy_names() == ()
        for n, v in before.items():
            assert getattr(numpy, n) is v


def test_distutils_stand_in_only_where_numpy_has_none():
    proc = python('''
        import sys, numpy, warnings
        warnings.simplefilter('ignore')
        try:
            import numpy.distutils.system_info
            had = True
        except ImportError:
            had = False
        import chainer
        import numpy.distutils.system_info as si
        stand_in = 'stand-in' in (si.__doc__ or '')
        print(had, stand_in, si.get_info('blas_opt') == {} if stand_in
              else None)
    ''')
    assert proc.returncode == 0, proc.stderr
    had, stand_in, empty = proc.stdout.split()
    assert stand_in == str(had == 'False')
    if stand_in == 'True':
        assert empty == 'True'


#: the start-up hook taken off sys.meta_path: chainer_vgc must act alone
WITHOUT_HOOK = ('import sys; sys.meta_path[:] = [f for f in sys.meta_path '
                "if type(f).__name__ != 'ChainerImportHook']; ")


@pytest.mark.parametrize('code', [
    'import chainer, chainer_vgc',
    'import chainer_vgc, chainer',
    WITHOUT_HOOK + 'import chainer_vgc, chainer',
    'import chainer',
    'import chainer.functions as F; import numpy; '
    'x = numpy.arange(16, dtype=numpy.float32).reshape(1, 1, 4, 4); '
    'F.resize_images(x, (2, 2))',  # numpy.float at call time
], ids=['chainer-first', 'chainer_vgc-first', 'chainer_vgc-first-no-hook',
        'chainer-alone', 'resize_images'])
def test_imports_in_either_order_print_nothing(code):
    proc = python(code)
    assert proc.returncode == 0, proc.stderr
    # no warning at all: not NCCL's, not pkg_resources', not NumPy's
    assert proc.stderr == ''


def test_hook_is_installed_at_start_up_and_imports_little():
    """Every interpreter of the venv runs the .pth: it loads no NumPy and
    not importlib.abc (a dozen modules on Python 3.12)."""
    proc = python('''
        import sys
        hooks = [type(f).__name__ for f in sys.meta_path]
        print('ChainerImportHook' in hooks, 'numpy' in sys.modules,
              'importlib.abc' in sys.modules)
        import chainer
        print('ChainerImportHook' in [type(f).__name__
                                      for f in sys.meta_path])
    ''')
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ['True', 'False', 'False', 'False']


def test_without_the_hook_chainer_alone_fails_on_numpy2():
    """The control for the import tests: with the hook taken off before
    anything else, `import chainer` fails on NumPy 2 (and works on numpy
    1.23, where nothing is missing)."""
    proc = python(WITHOUT_HOOK + 'import chainer')
    if NUMPY2:
        assert proc.returncode != 0
        assert ('AttributeError: `np.sctypes` was removed in the NumPy 2.0 '
                'release' in proc.stderr)
    else:
        assert proc.returncode == 0, proc.stderr


def test_cudnn_advice_filtered_only_where_cupy_has_no_cudnn():
    """CuPy 14 has no cupy.cuda.cudnn: Chainer's "reinstall CuPy" advice is
    filtered (that message, from chainer.backends.cuda); CuPy 13 has the
    module, and its warning stays."""
    proc = python('''
        import importlib.util, warnings
        import chainer
        has = importlib.util.find_spec('cupy.cuda.cudnn') is not None
        filtered = [f for f in warnings.filters if f[0] == 'ignore' and
                    f[1] is not None and f[1].pattern == 'cuDNN is not enabled'
                    and f[3].pattern == r'chainer\\.backends\\.cuda']
        print(has, len(filtered))
    ''')
    assert proc.returncode == 0, proc.stderr
    cupy_major = int(__import__('cupy').__version__.split('.')[0])
    assert proc.stdout.split() == (['False', '1'] if cupy_major >= 14
                                   else ['True', '0'])


def test_pkg_resources_stand_in_where_setuptools_has_none():
    proc = python('''
        import importlib.abc, sys

        class NoPkgResources(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == 'pkg_resources' or name.startswith(
                        'pkg_resources.'):
                    raise ModuleNotFoundError("No module named "
                                              "'pkg_resources'")
        sys.meta_path.insert(0, NoPkgResources())
        import chainer
        pr = chainer._environment_check.pkg_resources
        print(type(pr).__name__, 'pkg_resources' in sys.modules)
        print(pr.require('numpy>=1.0')[0].project_name)
        for req in ('numpy<1.0', 'no-such-distribution-vgc'):
            try:
                pr.require(req)
            except (pr.VersionConflict, pr.DistributionNotFound) as e:
                print(type(e).__name__)
    ''')
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ''
    assert proc.stdout.split() == ['_PkgResourcesStandIn', 'False', 'numpy',
                                   'VersionConflict', 'DistributionNotFound']


def test_chainer_missing_a_dependency_is_reported_unchanged(tmp_path):
    """Not a NumPy name: the import error propagates as it is."""
    fake = tmp_path / 'chainer'
    fake.mkdir()
    (fake / '__init__.py').write_text('import six_vgc_missing\n')
    proc = python('import chainer_vgc; chainer_vgc.create_communicator',
                  extra_path=str(tmp_path))
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1] == (
        "ModuleNotFoundError: No module named 'six_vgc_missing'")


def test_chainer_failing_anyway_says_what_and_how_to_fix(tmp_path):
    fake = tmp_path / 'chainer'
    fake.mkdir()
    (fake / '__init__.py').write_text(
        "raise AttributeError(\"module 'numpy' has no attribute "
        "'some_future_removal'\")\n")
    proc = python('import chainer_vgc; chainer_vgc.create_communicator',
                  extra_path=str(tmp_path))
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith('ImportError: chainer_vgc: Chainer 7.8.1 failed '
                           'to import with NumPy ' + numpy.__version__)
    assert 'some_future_removal' in last
    assert 'numpy.float, numpy.sctypes, numpy.distutils.system_info' in last
    assert "pip install 'numpy==1.23.5'" in last
    assert "'numpy==2.5.5'" in last


def test_source_checkout_without_install_loads_the_hook_from_its_file():
    """chainer_vgc on PYTHONPATH only (as gpu_check and the fake-mpi4py
    tests use it): chainer_vgc._startup_hook loads the module by path."""
    proc = python('''
        import sys
        sys.modules['_chainer_vgc_compat'] = None  # as if not installed
        from chainer_vgc import _startup_hook
        m = _startup_hook.compat_module()
        print(m.__file__.endswith('_startup/_chainer_vgc_compat.py'))
    ''', extra_path=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ['True']
