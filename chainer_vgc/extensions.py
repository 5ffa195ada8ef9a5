"""Reporting: what the communicator sent, for Chainer trainers.

Every step :class:`~chainer_vgc.communicator.VGCCommunicator` reports, with
``chainer.reporter``, figures aggregated over all ranks:

``vgc/compression``  parameters / average elements sent per rank in
                     this step (the paper's definition, Sec. 6; over an
                     interval use ``vgc/interval_compression`` below, not
                     LogReport's mean of this ratio)
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
    ``vgc/dense_bytes`` (what a dense ring allreduce of the same steps
    would have sent per rank, 2 (p - 1) / p * N * bytes per element of
    each gradient's dtype a step)."""
    # parameters x steps, dense group included (runs from before this
    # total existed: the compressor's parameters x steps)
    n_steps = totals.get('param_elements') or (
        (compressor.n_params if compressor is not None else 0)
        * totals['steps'])
    per_rank = totals['elements'] / size
    return {
        'vgc/total_compression': (n_steps / per_rank
                                  if per_rank else float('inf')),
        'vgc/total_bytes': totals['bytes'],
        'vgc/dense_bytes': totals['dense_bytes'],
    }


class CompressionReport(extension.Extension):
    """Reports :func:`run_summary` of a VGCCommunicator at each trigger,
    and ``vgc/interval_compression``: the paper's ratio over the steps since
    the previous report (LogReport's mean of the per-step
    ``vgc/compression`` is a mean of ratios, which overstates it)."""

    trigger = 1, 'epoch'
    priority = extension.PRIORITY_WRITER + 1  # before LogReport reads

    def __init__(self, communicator, trigger=(1, 'epoch')):
        self.communicator = communicator
        self.trigger = trigger
        self._last = None

    def summary(self):
        return run_summary(self.communicator.totals,
                           self.communicator.compressor,
                           self.communicator.size)

    def __call__(self, trainer):
        out = self.summary()
        tot = self.communicator.totals
        now = (tot['steps'], tot['elements'], tot.get('param_elements', 0))
        before = self._last or (0.0, 0.0, 0.0)
        self._last = now
        steps, elements, params = (a - b for a, b in zip(now, before))
        if steps:
            per_rank = elements / self.communicator.size
            out['vgc/interval_compression'] = (
                params / per_rank if per_rank else float('inf'))
        chainer.reporter.report(out)
