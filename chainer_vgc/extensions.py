"""Chainer trainer extensions: the exchange's figures in a trainer's
reports.

``trainer.extend(chainer_vgc.extensions.CompressionReport(comm))`` reports
the run's totals (:func:`chainer_vgc.reporting.run_summary`) at each
trigger beside the per-step figures the communicator reports every step
(:data:`REPORT_KEYS`, for ``PrintReport`` and ``PlotReport``; the
arithmetic of both: :mod:`chainer_vgc.reporting`).
"""

from chainer.training import extension

from chainer_vgc.reporting import REPORT_KEYS  # NOQA: F401 (for trainers)
from chainer_vgc.reporting import report
from chainer_vgc.reporting import run_summary


class CompressionReport(extension.Extension):
    """Reports :func:`run_summary` of a VGCCommunicator at each trigger,
    and ``vgc/interval_compression``: the paper's ratio over the steps since
    the previous report (LogReport's mean of the per-step
    ``vgc/compression`` is a mean of ratios, which overstates it).

    ``by_parameter=True`` (flat communicators) also counts the elements
    each parameter sends and reports, for the interval, ``vgc/share<name>``
    (its share of the elements sent) and ``vgc/density<name>`` (the
    fraction of its elements sent per rank and step), e.g.
    ``vgc/share/predictor/l1/W``; counting reads every received message's
    groups on the host, a cost of its own."""

    trigger = 1, 'epoch'
    priority = extension.PRIORITY_WRITER + 1  # before LogReport reads

    def __init__(self, communicator, trigger=(1, 'epoch'), model=None,
                 by_parameter=False):
        self.communicator = communicator
        self.trigger = trigger
        self.by_parameter = by_parameter
        self._last_counts = {}
        #: whose totals (None: the model exchanged last); with several
        #: models on one communicator, one CompressionReport per model,
        #: reported under the model's name as its per-step figures
        self.model = model
        self._last = None

    def _state(self):
        # (model None: the model exchanged last)
        return self.communicator.state(self.model)

    def _workers(self, st):
        # (hierarchy='node': the nodes are the workers)
        return getattr(st, 'workers', None) or self.communicator.size

    def summary(self):
        st = self._state()
        return run_summary(st.totals, st.compressor, self._workers(st))

    def __call__(self, trainer):
        out = self.summary()
        st = self._state()
        tot = st.totals
        now = (tot['steps'], tot['elements'], tot.get('param_elements', 0))
        before = self._last or (0.0, 0.0, 0.0)
        self._last = now
        steps, elements, params = (a - b for a, b in zip(now, before))
        if steps:
            per_rank = elements / self._workers(st)
            out['vgc/interval_compression'] = (
                params / per_rank if per_rank else float('inf'))
        if self.by_parameter:
            out.update(self._by_parameter(st, steps))
        label = getattr(st, 'label', None)
        # (the trainer's name of the model, as its per-step figures)
        report(out, self.model, label)

    def initialize(self, trainer):
        if self.by_parameter:
            self._state().count_by_parameter = True

    def _by_parameter(self, st, steps):
        """The interval's share and density of each parameter."""
        st.count_by_parameter = True
        counts = dict(st.elements_by_parameter)
        part = {n: c - self._last_counts.get(n, 0) for n, c in counts.items()}
        self._last_counts = counts
        total = sum(part.values())
        sizes = st.parameter_sizes
        out = {}
        workers = self._workers(st)
        for name, n in sorted(part.items()):
            out['vgc/share' + name] = n / total if total else 0.0
            if name in sizes and steps:
                out['vgc/density' + name] = n / (sizes[name] * steps
                                                 * workers)
        return out
