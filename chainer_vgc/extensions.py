"""Reporting: what the communicator sent, for Chainer trainers.

Every step :class:`~chainer_vgc.communicator.VGCCommunicator` reports, with
``chainer.reporter``, figures aggregated over all ranks:

``vgc/compression``  parameters / average elements sent per rank (the
                     paper's definition, Sec. 6)
``vgc/density``      its inverse
``vgc/bytes``        bytes each rank sends on the wire (ring allgatherv:
                     (p - 1) / p of all messages)

so ``LogReport``, ``PrintReport(['epoch', 'main/loss', 'vgc/compression',
...])`` and ``PlotReport(['vgc/compression'])`` show them directly.
:class:`CompressionReport` adds the totals since the start of the run.
"""

import chainer
from chainer.training import extension

#: the per-step keys, for PrintReport / PlotReport
REPORT_KEYS = ['vgc/compression', 'vgc/density', 'vgc/bytes']


def run_summary(totals, compressor, size):
    """Run totals: ``vgc/total_compression`` (parameters x steps / average
    elements sent per rank), ``vgc/total_bytes`` (bytes each rank sent),
    ``vgc/dense_bytes`` (what a dense float32 ring allreduce of the same
    steps would have sent per rank, 2 (p - 1) / p * 4 N a step)."""
    n = compressor.n_params if compressor is not None else 0
    per_rank = totals['elements'] / size
    return {
        'vgc/total_compression': (n * totals['steps'] / per_rank
                                  if per_rank else float('inf')),
        'vgc/total_bytes': totals['bytes'],
        'vgc/dense_bytes': totals['dense_bytes'],
    }


class CompressionReport(extension.Extension):
    """Reports :func:`run_summary` of a VGCCommunicator at each trigger."""

    trigger = 1, 'epoch'
    priority = extension.PRIORITY_WRITER + 1  # before LogReport reads

    def __init__(self, communicator, trigger=(1, 'epoch')):
        self.communicator = communicator
        self.trigger = trigger

    def summary(self):
        return run_summary(self.communicator.totals,
                           self.communicator.compressor,
                           self.communicator.size)

    def __call__(self, trainer):
        chainer.reporter.report(self.summary())
