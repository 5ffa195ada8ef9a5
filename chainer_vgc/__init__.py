"""chainer-vgc: Variance-based Gradient Compression for ChainerMN.

Tsuzuku, Imachi, Akiba, "Variance-based Gradient Compression for Efficient
Distributed Deep Learning", ICLR 2018 workshop.

The package by concept (``docs/layout.md``), in data-flow order:
:mod:`~chainer_vgc.statistics` (per-sample sums of squares),
:mod:`~chainer_vgc.rules` (vgc, hybrid, strom, qsgd, none),
:mod:`~chainer_vgc.codec` (the wire formats),
:class:`~chainer_vgc.compressor.GradientCompressor` (one rule over a
model) on the :mod:`~chainer_vgc.backends` (NumPy, the native CPU
backend, the GPU path), :mod:`~chainer_vgc.exchange` (one model's
exchange: state, run, the mean), :mod:`~chainer_vgc.chainermn` (the
communicator, the transport, the optimizer wrapper),
:mod:`~chainer_vgc.nodes` (nodes of k ranks) and
:mod:`~chainer_vgc.harness` (the paper's experiments in one process).

``import chainer_vgc`` imports neither Chainer nor MPI: the names below are
loaded when first used (PEP 562).  The core -- :mod:`~chainer_vgc.codec`,
:mod:`~chainer_vgc.backends.cuda.kernels`, :mod:`~chainer_vgc.rules`,
:mod:`~chainer_vgc.compressor`, :mod:`~chainer_vgc.exchange.mean`,
:mod:`~chainer_vgc.chainermn.transport` -- needs NumPy only (CuPy where
present).
The first use of a name that needs Chainer (the communicator, the
optimizer) prepares Chainer's import first (NumPy 2: the start-up hook,
:mod:`chainer_vgc._startup_hook`), and of one that needs MPI loads MPI with
an error that says how to get an MPI library
(:func:`chainer_vgc.chainermn.mpi_support.import_mpi`).
"""

import importlib
import sys

# Chainer 7.8.1 on NumPy 2: the removed NumPy names it uses go back before it
# is imported (chainer_vgc/_startup/_chainer_vgc_compat.py; the installed
# .pth does the same at start-up).  Cheap: the hook runs when `chainer` is
# first imported, whoever imports it; were Chainer imported already (without
# the .pth, e.g. python -S), the names it uses at call time go back now.
from chainer_vgc import _startup_hook

if 'chainer' in sys.modules:
    _startup_hook.compat_module().prepare_chainer_import()
else:
    _startup_hook.compat_module().install()

__version__ = '0.1.0'

#: public name -> (module, needs Chainer, needs MPI)
_LAZY = {
    'create_communicator': ('factory', True, True),
    'VGCCommunicator': ('chainermn.communicator', True, True),
    'HierarchicalCommunicator': ('nodes.communicator', True, True),
    'create_multi_node_optimizer': ('optimizer', True, True),
    'GradientCompressor': ('compressor', False, False),
    'WireFormatError': ('codec', False, False),
    'create_rule': ('rules', False, False),
    'sentence_pairs': ('statistics.rows', True, False),
    'ElasticResume': ('exchange.elastic', False, False),
    'RULES': ('rules', False, False),
}

#: submodules that import Chainer (and MPI), loaded as attributes
#: (``chainer_vgc.chainermn.communicator``) like the names above
_SUBMODULES = {
    'chainermn': (True, True),
    'nodes': (True, True),
    'factory': (True, True),
    'optimizer': (True, True),
    'extensions': (True, False),
    'harness': (True, False),
    'statistics': (True, False),
}

__all__ = sorted(_LAZY)


def _prepare(needs_chainer, needs_mpi):
    if needs_chainer:
        _startup_hook.prepare_chainer_import()
    if needs_mpi:
        from chainer_vgc.chainermn import mpi_support
        mpi_support.import_mpi()


def __getattr__(name):
    if name in _LAZY:
        module, needs_chainer, needs_mpi = _LAZY[name]
        _prepare(needs_chainer, needs_mpi)
        value = getattr(importlib.import_module(__name__ + '.' + module),
                        name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        _prepare(*_SUBMODULES[name])
        return importlib.import_module(__name__ + '.' + name)
    if not name.startswith('_'):
        # any other submodule (chainer-free): chainer_vgc.codec, .native, ...
        try:
            return importlib.import_module(__name__ + '.' + name)
        except ModuleNotFoundError as e:
            if e.name != __name__ + '.' + name:
                raise
    raise AttributeError('module {!r} has no attribute {!r}'.format(
        __name__, name))


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))
