"""chainer-vgc: Variance-based Gradient Compression for ChainerMN.

Tsuzuku, Imachi, Akiba, "Variance-based Gradient Compression for Efficient
Distributed Deep Learning", ICLR 2018 workshop.

Modules, in data-flow order: :mod:`~chainer_vgc.statistics` (per-sample sums
of squares), :mod:`~chainer_vgc.rules` (vgc, hybrid, strom, qsgd, none),
:mod:`~chainer_vgc.codec` (quantize/pack/unpack), with
:mod:`~chainer_vgc.kernels` (the CuPy kernels built from ``kernels/``) and
:class:`~chainer_vgc.compressor.GradientCompressor` tying them together.
"""

# Chainer 7.8.1 on NumPy 2: the removed NumPy names it uses go back before it
# is imported (chainer_vgc/_startup/_chainer_vgc_compat.py; the installed
# .pth does the same when `import chainer` comes first)
from chainer_vgc import _startup_hook
_startup_hook.prepare_chainer_import()

# ChainerMN (imported by .communicator) loads mpi4py.MPI, which needs an MPI
# library: without one, fail here with a message that says how to get it
from chainer_vgc import mpi_support as _mpi_support
_mpi_support.import_mpi()

from chainer_vgc.codec import WireFormatError  # NOQA
from chainer_vgc.communicator import create_communicator  # NOQA
from chainer_vgc.communicator import VGCCommunicator  # NOQA
from chainer_vgc.optimizer import create_multi_node_optimizer  # NOQA
from chainer_vgc.compressor import GradientCompressor  # NOQA
from chainer_vgc.rules import create_rule  # NOQA
from chainer_vgc.rules import RULES  # NOQA

__version__ = '0.1.0'
