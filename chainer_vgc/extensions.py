"""Reporting: what the exchange sent, step by step and over the run.

The question this module answers: how much did the ranks send, compared
with a dense allreduce, and how do Chainer trainers see it?  The arithmetic
(:func:`step_figures`, :func:`report_step`, :func:`new_totals`,
:func:`run_summary`) is shared by
:class:`~chainer_vgc.chainermn.communicator.VGCCommunicator` and the one-process
:class:`~chainer_vgc.harness.simulation.SimulatedWorkers`; it needs no MPI.

Every step the communicator reports, with ``chainer.reporter``, figures
aggregated over all ranks:

- ``vgc/compression``: parameters / average elements sent per rank in
  this step (the paper's definition, Sec. 6; over an interval use
  ``vgc/interval_compression`` below, not LogReport's mean of this ratio);
- ``vgc/density``: its inverse;
- ``vgc/bytes``: bytes each rank sends on the wire (ring allgatherv:
  (p - 1) / p of all messages);
- ``vgc/bits_per_element``: bits of the messages per element they carry,
  headers included (the paper's word: 32 and a little more; gap-coded
  indices, FMT_GAP: fewer); absent in a step that sent nothing;

so ``LogReport``, ``PrintReport(['epoch', 'main/loss', 'vgc/compression',
...])`` and ``PlotReport(['vgc/compression'])`` show them directly.
:class:`CompressionReport` adds the totals since the start of the run.
"""

import chainer
from chainer.training import extension

from chainer_vgc import codec

#: the per-step keys, for PrintReport / PlotReport
REPORT_KEYS = ['vgc/compression', 'vgc/density', 'vgc/bytes',
               'vgc/bits_per_element']


# -- one step ---------------------------------------------------------------
def step_figures(blocks, n_params, elements=None, param_bytes=None,
                 size=None, dense_elements=0, dense_wire=0.0,
                 n_compressed=None):
    """Figures of one exchange, the same on every rank.

    ``vgc/compression``: parameters / average elements sent per rank (the
    paper's definition), over all parameters (a dense group's elements
    count as sent); ``vgc/density``: its inverse; ``vgc/bytes``: bytes each
    rank sends on the wire, on average: (p - 1) / p of all messages with the
    ring, plus ``dense_wire`` for the dense group's allreduce;
    ``vgc/skipped``: 0 (an exchange took place; a skipped step reports 1);
    ``vgc/bits_per_element``: 32 x the messages' words / the elements they
    carry (when they carry any).
    With a dense group (``n_compressed`` < ``n_params``), also
    ``vgc/dense_fraction`` (of the parameters) and, when some parameters
    are compressed, ``vgc/compression_compressed`` (that group alone).
    Keys with '_' feed the run totals, with ``dense_bytes`` what a dense
    ring allreduce of the gradients in their own dtypes would send per
    rank, 2 (p - 1) / p * ``param_bytes`` (Sec. 5; ``param_bytes`` = sum of
    size * itemsize, default 4 N).  ``dense_elements``: elements of the
    dense group over all ranks; ``size``: the number of ranks (default:
    len(blocks)).
    """
    if param_bytes is None:
        param_bytes = 4 * n_params
    p = size or len(blocks)
    if elements is None:
        elements = [codec.message_count(b) for b in blocks]
    sent = sum(elements)
    total_bytes = 4 * sum(int(b.size) for b in blocks)
    per_rank = (sent + dense_elements) / p
    wire = (p - 1) * total_bytes / p + dense_wire
    figures = {
        'vgc/compression': n_params / per_rank if per_rank else float('inf'),
        'vgc/density': per_rank / n_params if n_params else 0.0,
        'vgc/bytes': wire,
        'vgc/skipped': 0.0,  # an exchange took place
        '_elements': sent + dense_elements,
        '_bytes': wire,
        '_dense_bytes': 2 * (p - 1) * param_bytes / p,
        '_message_bits': 8.0 * total_bytes,
        '_message_elements': float(sent),
    }
    if sent:
        figures['vgc/bits_per_element'] = 8.0 * total_bytes / sent
    if n_compressed is not None and n_compressed < n_params:
        figures['vgc/dense_fraction'] = (n_params - n_compressed) / n_params
        if n_compressed:  # (none during a warm-up)
            figures['vgc/compression_compressed'] = (
                n_compressed * p / sent if sent else float('inf'))
    return figures


def new_totals():
    """Run totals: steps, elements (all ranks), bytes and dense_bytes (per
    rank), skipped exchanges, param_elements (parameters x steps),
    message_bits and message_elements (all ranks' messages, and the
    elements they carried), dense_steps (sent dense by the fallback)."""
    return {'steps': 0.0, 'elements': 0.0, 'bytes': 0.0, 'dense_bytes': 0.0,
            'skipped': 0.0, 'param_elements': 0.0, 'message_bits': 0.0,
            'dense_steps': 0.0,
            'message_elements': 0.0}


def report_step(blocks, n_params, totals, elements=None, param_bytes=None,
                observer=None, label=None, extra=None, **dense):
    """Add one exchange to ``totals``, report its figures with
    ``chainer.reporter`` (:func:`report`: ``observer``, ``label``) and
    return them (``elements``: per message, when already counted;
    ``param_bytes`` and ``dense``: see :func:`step_figures`; ``extra``:
    more figures, '_' keys adding to the totals too)."""
    figures = step_figures(blocks, n_params, elements, param_bytes, **dense)
    figures.update(extra or {})
    for key, value in figures.items():
        if key.startswith('_'):  # (totals of older snapshots lack some)
            totals[key[1:]] = totals.get(key[1:], 0.0) + value
    totals['steps'] += 1
    totals['param_elements'] += n_params
    report(figures, observer, label)
    return figures


def report(figures, observer=None, label=None):
    """Report the :func:`reported` figures of one model's exchange with
    ``chainer.reporter``: as ``vgc/...`` when ``label`` is None (a
    communicator serving one model); else under the model's name, so that
    two models on one communicator (a GAN's generator and discriminator)
    report apart: the trainer's name of ``observer`` (the optimizer's
    name, ``gen/vgc/compression``) when the reporter knows it, otherwise
    ``label/vgc/...``."""
    values = reported(figures)
    if label is None:
        chainer.reporter.report(values)
        return
    if observer is not None:
        try:
            chainer.reporter.report(values, observer)
            return
        except KeyError:  # not an observer of the current reporter
            pass
    chainer.reporter.report({label + '/' + k: v for k, v in values.items()})


def reported(figures):
    """The figures of :func:`step_figures` that are reported (its
    '_'-prefixed keys feed the run totals only)."""
    return {k: v for k, v in figures.items() if not k.startswith('_')}


def allreduce_wire(params, size, float16=False):
    """Bytes each of ``size`` ranks sends in a ring allreduce of the
    ``params``' gradients, 2 (p - 1) / p of them: ChainerMN's naive
    exchange, one allreduce per parameter (float16 summed in float32: at
    least 4 bytes an element), or with ``float16`` one allreduce of the
    whole group in float16 (2 bytes an element)."""
    p = size
    if float16:
        n = sum(q.size for q in params)
        return 2 * (p - 1) * 2 * n / p
    return sum(2 * (p - 1) * max(4, q.dtype.itemsize) * q.size / p
               for q in params)


# -- the run ----------------------------------------------------------------
def run_summary(totals, compressor, size):
    """Run totals: ``vgc/total_compression`` (parameters x steps / average
    elements sent per rank), ``vgc/total_bytes`` (bytes each rank sent),
    ``vgc/dense_bytes`` (what a dense ring allreduce of the same steps
    would have sent per rank, 2 (p - 1) / p * N * bytes per element of
    each gradient's dtype a step), ``vgc/total_bits_per_element`` (the
    messages' bits per element carried, since the run or the snapshot
    format that first counted them began)."""
    # parameters x steps, dense group included (runs from before this
    # total existed: the compressor's parameters x steps)
    n_steps = totals.get('param_elements') or (
        (compressor.n_params if compressor is not None else 0)
        * totals['steps'])
    per_rank = totals['elements'] / size
    out = {
        'vgc/total_compression': (n_steps / per_rank
                                  if per_rank else float('inf')),
        'vgc/total_bytes': totals['bytes'],
        'vgc/dense_bytes': totals['dense_bytes'],
    }
    if totals.get('message_elements'):
        out['vgc/total_bits_per_element'] = (totals['message_bits']
                                             / totals['message_elements'])
    return out


class CompressionReport(extension.Extension):
    """Reports :func:`run_summary` of a VGCCommunicator at each trigger,
    and ``vgc/interval_compression``: the paper's ratio over the steps since
    the previous report (LogReport's mean of the per-step
    ``vgc/compression`` is a mean of ratios, which overstates it)."""

    trigger = 1, 'epoch'
    priority = extension.PRIORITY_WRITER + 1  # before LogReport reads

    def __init__(self, communicator, trigger=(1, 'epoch'), model=None):
        self.communicator = communicator
        self.trigger = trigger
        #: whose totals (None: the model exchanged last); with several
        #: models on one communicator, one CompressionReport per model,
        #: reported under the model's name as its per-step figures
        self.model = model
        self._last = None

    def _state(self):
        if self.model is None:
            return self.communicator
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
        label = getattr(st, 'label', None)
        # (the trainer's name of the model, as its per-step figures)
        report(out, self.model, label)
