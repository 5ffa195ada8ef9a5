"""Reporting: what the communicator sent, for Chainer trainers.

Every step :class:`~chainer_vgc.communicator.VGCCommunicator` reports, with
``chainer.reporter``, figures aggregated over all ranks:

``vgc/compression``  parameters / average elements sent per rank (the
                     paper's definition, Sec. 6)
``vgc/density``      its inverse
``vgc/bytes``        bytes on the wire per rank (message words * 4)

so ``LogReport``, ``PrintReport(['epoch', 'main/loss', 'vgc/compression',
...])`` and ``PlotReport(['vgc/compression'])`` show them directly.
:class:`CompressionReport` adds the totals since the start of the run.
"""

import chainer
from chainer.training import extension

#: the per-step keys, for PrintReport / PlotReport
REPORT_KEYS = ['vgc/compression', 'vgc/density', 'vgc/bytes']


class CompressionReport(extension.Extension):
    """Reports run totals of a VGCCommunicator at each trigger.

    Keys: ``vgc/total_compression`` (parameters x steps / average elements
    sent per rank), ``vgc/total_bytes`` (bytes sent per rank),
    ``vgc/dense_bytes`` (what a dense float32 exchange of the same steps
    would have sent per rank).
    """

    trigger = 1, 'epoch'
    priority = extension.PRIORITY_WRITER + 1  # before LogReport reads

    def __init__(self, communicator, trigger=(1, 'epoch')):
        self.communicator = communicator
        self.trigger = trigger

    def summary(self):
        tot = self.communicator.totals
        comp = self.communicator.compressor
        size = self.communicator.size
        n = comp.n_params if comp is not None else 0
        per_rank = tot['elements'] / size
        return {
            'vgc/total_compression': (n * tot['steps'] / per_rank
                                      if per_rank else float('inf')),
            'vgc/total_bytes': tot['bytes'] / size,
            'vgc/dense_bytes': tot['dense_bytes'] / size,
        }

    def __call__(self, trainer):
        chainer.reporter.report(self.summary())
