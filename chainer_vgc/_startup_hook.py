"""The start-up hook as ``chainer_vgc`` uses it: :mod:`_chainer_vgc_compat`
(``chainer_vgc/_startup/``), and an import of Chainer whose failure says
what happened and how to fix it.

An installed chainer-vgc provides ``_chainer_vgc_compat`` as a top-level
module; a source checkout on ``PYTHONPATH`` does not, so it is then loaded
from its file here, under the same name.
"""

import importlib.util
import os
import sys

#: NumPy versions the two tested stacks use (docs/stacks.md)
TESTED_NUMPY = ('1.23.5', '2.5.5')


def compat_module():
    """The ``_chainer_vgc_compat`` module, installed or from the source."""
    try:
        import _chainer_vgc_compat
    except ImportError:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                            '_startup', '_chainer_vgc_compat.py')
        spec = importlib.util.spec_from_file_location('_chainer_vgc_compat',
                                                      path)
        module = importlib.util.module_from_spec(spec)
        sys.modules['_chainer_vgc_compat'] = module
        spec.loader.exec_module(module)
        return module
    return _chainer_vgc_compat


def _numpy_failure(e):
    """Whether ``e`` (raised by ``import chainer``) is NumPy lacking a name
    or module: an AttributeError on the numpy module, or an ImportError of
    a ``numpy.*`` module or name.  A missing Chainer or dependency of it is
    not: that error is already clear."""
    if isinstance(e, AttributeError):  # NumPy 2: "`np.sctypes` was removed
        return 'numpy' in str(e) or 'np.' in str(e)  # in the NumPy 2.0 ..."
    name = getattr(e, 'name', None) or ''
    return name == 'numpy' or name.startswith('numpy.') or (
        not isinstance(e, ModuleNotFoundError) and 'numpy' in str(e))


def prepare_chainer_import():
    """Run the hook's preparation, then import Chainer; a NumPy name or
    module Chainer still misses (one the hook does not know) is re-raised
    as an ImportError naming it and the fix.  Other import errors (Chainer
    or one of its dependencies not installed) propagate unchanged."""
    compat = compat_module()
    compat.prepare_chainer_import()
    try:
        import chainer  # noqa: F401
    except (AttributeError, ImportError) as e:
        if not _numpy_failure(e):
            raise
        import numpy
        raise ImportError(
            'chainer_vgc: Chainer 7.8.1 failed to import with NumPy {} '
            '({}: {}).  chainer-vgc puts back the NumPy names it knows '
            'Chainer uses ({}; put back here: {}), so this is a name or '
            'module it does not know.  Fix: install a tested NumPy '
            "(pip install 'numpy=={}' on Python 3.11, or 'numpy=={}' on "
            'Python 3.12), and report the message above.'.format(
                numpy.__version__, type(e).__name__, e,
                ', '.join('numpy.' + n for n in compat.NUMPY_NAMES),
                ', '.join(compat.added_names()) or 'none',
                TESTED_NUMPY[0], TESTED_NUMPY[1])) from e
