"""What Chainer 7.8.1 needs from today's stack, given before it is imported.

Chainer 7.8.1 (2022) uses three NumPy names that NumPy 2 removed, and it
imports ``pkg_resources``, which setuptools 82 removed (81 warns):

* ``numpy.float`` (``chainer/functions/array/resize_images.py``, at call
  time): the builtin :class:`float`, which the name meant before NumPy 1.24;
* ``numpy.sctypes`` (``chainer/functions/array/as_strided.py``, at import
  time): the dict of scalar types by kind that NumPy 1.x built, rebuilt by
  the same rule from the sized types this NumPy has (``int``: int8 to
  int64, ``uint``, ``float``: float16 to float64 and float96/128 where the
  platform has it, ``complex``, ``others``: bool, object, bytes, str,
  numpy.void);
* ``numpy.distutils.system_info`` (``chainer/_environment_check.py``, at
  import time), only where ``numpy.distutils`` cannot be imported (NumPy 2
  on Python >= 3.12): a module whose one function, ``get_info(name)``,
  returns ``{}`` ("nothing known"); Chainer calls it on macOS only, to warn
  about Accelerate.

:func:`restore_numpy_names` puts back exactly the names the installed NumPy
lacks, as module attributes (and ``sys.modules`` entries for the distutils
stand-in); with NumPy 1.23 it adds nothing, and it never replaces a name
NumPy defines (``numpy.bool``, which NumPy 2 defines again as
``numpy.bool_``, is left alone).

``pkg_resources`` (``chainer/_environment_check.py``, for its optional
dependency check): where setuptools still provides it, it is imported here
once with its own deprecation warning silenced (that warning is about
Chainer's use of it); where it is gone, Chainer's environment check is
given :class:`_PkgResourcesStandIn` (``require``, ``get_distribution`` and
the two exceptions, over :mod:`importlib.metadata`) while it is imported,
and ``sys.modules`` is left without it.

CuPy's "nccl library could not be loaded" warning (``cupy._environment``,
when ``cupy.cuda.nccl`` is first imported, which ``import chainer`` does)
is not shown: that module is imported here first, with that one warning
silenced.  chainer-vgc never uses NCCL; a ChainerMN NCCL communicator still
fails with its own error where NCCL is missing.  Likewise, where CuPy has
no cuDNN module at all (CuPy 14 dropped ``cupy.cuda.cudnn``), Chainer's
"cuDNN is not enabled ... reinstall CuPy" warning at the first use of a
GPU is filtered (that one message, from ``chainer.backends.cuda``): its
advice cannot be followed there, and Chainer then uses its own
convolutions.

How it runs: the installed ``chainer_vgc_compat.pth`` imports this module
at interpreter start-up and calls :func:`install`, which puts
:class:`ChainerImportHook` at the front of ``sys.meta_path``.  The hook
does nothing until a module named ``chainer`` is imported; then it runs
:func:`prepare_chainer_import`, removes itself and lets the import go on.
``import chainer_vgc`` installs the hook as well (or, were Chainer
imported already, calls :func:`prepare_chainer_import`), so the order of
imports does not matter, and neither do ``python -S`` runs that import
chainer_vgc first.  This module imports nothing at start-up
beyond ``sys`` and ``importlib.util`` (its finder and loader are plain
classes: ``importlib.abc`` would pull in a dozen modules at every start);
NumPy is imported only when Chainer is.

This file is installed as the top-level module ``_chainer_vgc_compat``
(the ``.pth`` imports it at every start-up, before any package).  docs/stacks.md lists the same names.
"""

import importlib.util
import sys

#: the names Chainer 7.8.1 uses that a NumPy may lack, in the order they
#: are put back
NUMPY_NAMES = ('float', 'sctypes', 'distutils.system_info')

#: CuPy's warning at import when NCCL is missing (chainer-vgc never uses it)
_NCCL_WARNING = r'\s*nccl library could not be loaded'
#: Chainer's warning where CuPy has no cuDNN (CuPy 14 has none at all)
_CUDNN_WARNING = r'cuDNN is not enabled'

_state = {'prepared': False, 'added': ()}


# -- NumPy --------------------------------------------------------------------

def _has(numpy, name):
    import warnings
    with warnings.catch_warnings():  # numpy 1.20-1.23 warn on numpy.float
        warnings.simplefilter('ignore', DeprecationWarning)
        try:  # NumPy 2's module __getattr__ raises for removed names
            getattr(numpy, name)
        except AttributeError:
            return False
    return True


def _distutils_importable():
    try:
        import numpy.distutils  # noqa: F401
    except ImportError:
        return False
    return True


def missing_numpy_names(numpy=None):
    """The names of :data:`NUMPY_NAMES` the installed NumPy lacks."""
    if numpy is None:
        import numpy
    missing = [name for name in ('float', 'sctypes') if not _has(numpy, name)]
    if 'numpy.distutils' not in sys.modules:
        import warnings
        with warnings.catch_warnings():  # its DeprecationWarning
            warnings.simplefilter('ignore')
            if not _distutils_importable():
                missing.append('distutils.system_info')
    return missing


def numpy1_sctypes(numpy):
    """``numpy.sctypes`` as NumPy 1.x built it (``_set_array_types`` in
    ``numpy/core/numerictypes.py``): for each kind, the sized scalar types
    this NumPy has, in increasing size; ``others`` as NumPy 1.x listed it.
    """
    def sized(prefix, bits):
        return [getattr(numpy, '{}{}'.format(prefix, b)) for b in bits
                if _has(numpy, '{}{}'.format(prefix, b))]
    ibits = [8 * b for b in (1, 2, 4, 8, 16, 32, 64)]
    fbits = [8 * b for b in (2, 4, 8, 10, 12, 16, 32, 64)]
    types = {'int': sized('int', ibits), 'uint': sized('uint', ibits),
             'float': sized('float', fbits),
             'complex': sized('complex', [2 * b for b in fbits]),
             'others': [bool, object, bytes, str, numpy.void]}
    intp, uintp = numpy.dtype(numpy.intp).type, numpy.dtype(numpy.uintp).type
    if intp not in types['int']:  # as NumPy 1.x: intp among the ints,
        size = numpy.dtype(intp).itemsize  # placed by its size
        k = len([t for t in types['int'] if numpy.dtype(t).itemsize < size])
        types['int'].insert(k, intp)
        types['uint'].insert(k, uintp)
    return types


def _distutils_stand_in():
    import types
    package = types.ModuleType(
        'numpy.distutils',
        "chainer-vgc's stand-in for numpy.distutils, which this NumPy does "
        'not have; it holds only system_info.get_info, which Chainer 7.8.1 '
        'imports (see _chainer_vgc_compat).')
    package.__path__ = []
    system_info = types.ModuleType(
        'numpy.distutils.system_info',
        "chainer-vgc's stand-in: get_info(name) returns {} (no build "
        'information is known without numpy.distutils).')

    def get_info(name, notfound_action=0):
        """No build information: ``{}`` for every ``name``."""
        return {}
    system_info.get_info = get_info
    package.system_info = system_info
    return package, system_info


def restore_numpy_names():
    """Put back the names of :data:`NUMPY_NAMES` the installed NumPy lacks
    (see the module docstring); return those names.  Idempotent."""
    import numpy
    missing = missing_numpy_names(numpy)
    if 'float' in missing:
        numpy.float = float
    if 'sctypes' in missing:
        numpy.sctypes = numpy1_sctypes(numpy)
    if 'distutils.system_info' in missing:
        package, system_info = _distutils_stand_in()
        sys.modules['numpy.distutils'] = package
        sys.modules['numpy.distutils.system_info'] = system_info
        numpy.distutils = package
    _state['added'] = tuple(_state['added']) + tuple(
        m for m in missing if m not in _state['added'])
    return tuple(missing)


def added_names():
    """What this process's :func:`restore_numpy_names` calls put back."""
    return tuple(_state['added'])


# -- pkg_resources ------------------------------------------------------------

class _PkgResourcesStandIn(object):
    """The part of ``pkg_resources`` Chainer 7.8.1's environment check uses
    (``require``, ``get_distribution``, ``DistributionNotFound``,
    ``VersionConflict``), over :mod:`importlib.metadata`.  Used only where
    setuptools no longer provides ``pkg_resources``."""

    class DistributionNotFound(Exception):
        pass

    class VersionConflict(Exception):
        pass

    class _Distribution(object):
        def __init__(self, name, version):
            self.project_name, self.version = name, version

    def __init__(self):
        self.__name__ = 'pkg_resources'

    @staticmethod
    def _split(requirement):
        import re
        m = re.match(r'\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(.*)$', requirement)
        if m is None:
            raise ValueError('not a requirement: {!r}'.format(requirement))
        return m.group(1), m.group(2).strip()

    def get_distribution(self, requirement):
        from importlib import metadata
        name, _ = self._split(requirement)
        try:
            return self._Distribution(name, metadata.version(name))
        except metadata.PackageNotFoundError:
            raise self.DistributionNotFound(name)

    def require(self, requirement):
        dist = self.get_distribution(requirement)
        _, spec = self._split(requirement)
        if spec:
            try:
                from packaging.specifiers import SpecifierSet
            except ImportError:  # no checker: found, version unchecked
                return [dist]
            if not SpecifierSet(spec).contains(dist.version,
                                               prereleases=True):
                raise self.VersionConflict(dist.project_name, spec)
        return [dist]


def _pkg_resources():
    """The real ``pkg_resources`` if setuptools provides it (imported here
    with its deprecation warnings silenced), else ``None``."""
    if 'pkg_resources' in sys.modules:
        return sys.modules['pkg_resources']
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        try:
            import pkg_resources
        except ImportError:
            return None
    return pkg_resources


class _WithModules(object):
    """A loader running another loader's ``exec_module`` with extra
    ``sys.modules`` entries that are removed again afterwards."""

    def __init__(self, loader, modules):
        self._loader, self._modules = loader, modules

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        added = [n for n in self._modules if n not in sys.modules]
        sys.modules.update((n, self._modules[n]) for n in added)
        try:
            self._loader.exec_module(module)
        finally:
            for n in added:
                if sys.modules.get(n) is self._modules[n]:
                    del sys.modules[n]

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _EnvironmentCheckHook(object):
    """Gives ``chainer._environment_check`` the pkg_resources stand-in."""

    NAME = 'chainer._environment_check'

    def find_spec(self, name, path=None, target=None):
        if name != self.NAME:
            return None
        _remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _WithModules(
                spec.loader, {'pkg_resources': _PkgResourcesStandIn()})
        return spec


# -- the hook -----------------------------------------------------------------

def _quiet_cupy_warnings():
    """Import ``cupy.cuda.nccl``, where CuPy is installed, with its NCCL
    warning silenced (CuPy warns once, when that module is first imported;
    it then stays imported with ``available = False``); where CuPy has no
    ``cupy.cuda.cudnn``, filter Chainer's cuDNN advice (module
    docstring)."""
    if ('cupy.cuda.nccl' in sys.modules
            or importlib.util.find_spec('cupy') is None):
        return
    import warnings
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', message=_NCCL_WARNING,
                                category=UserWarning)
        try:
            import cupy.cuda.nccl  # noqa: F401
        except Exception:  # Chainer reports a broken CuPy itself
            return
    try:
        has_cudnn = importlib.util.find_spec('cupy.cuda.cudnn') is not None
    except (ImportError, ValueError):
        has_cudnn = False
    if not has_cudnn:
        warnings.filterwarnings('ignore', message=_CUDNN_WARNING,
                                category=UserWarning,
                                module=r'chainer\.backends\.cuda')


def prepare_chainer_import():
    """Everything Chainer 7.8.1 needs before its import (module
    docstring).  Idempotent; cheap after the first call (a retry after a
    failed ``import chainer`` gets the pkg_resources stand-in again)."""
    if (_EnvironmentCheckHook.NAME not in sys.modules
            and 'chainer' not in sys.modules
            and not any(isinstance(f, _EnvironmentCheckHook)
                        for f in sys.meta_path)
            and _pkg_resources() is None):
        sys.meta_path.insert(0, _EnvironmentCheckHook())
    if _state['prepared']:
        return
    restore_numpy_names()
    _quiet_cupy_warnings()
    _state['prepared'] = True


class ChainerImportHook(object):
    """Runs :func:`prepare_chainer_import` when ``chainer`` is first
    imported, then removes itself; finds nothing itself."""

    def find_spec(self, name, path=None, target=None):
        if name != 'chainer':
            return None
        _remove(self)
        prepare_chainer_import()
        return None


def _remove(finder):
    try:
        sys.meta_path.remove(finder)
    except ValueError:
        pass


def install():
    """Called by ``chainer_vgc_compat.pth`` at start-up: put
    :class:`ChainerImportHook` first on ``sys.meta_path`` unless Chainer is
    already imported or the hook is there."""
    if 'chainer' in sys.modules or any(
            isinstance(f, ChainerImportHook) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, ChainerImportHook())
