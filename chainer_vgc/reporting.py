"""Reporting: what the exchange sent, step by step and over the run.

The question this module answers: how much did the ranks send, compared
with a dense allreduce, and what do Chainer's reporter and trainers see?
The arithmetic is here (the trainer extension,
:class:`chainer_vgc.extensions.CompressionReport`, reads it): :func:`figures` computes a step's figures from its counts
for flat runs (:func:`step_figures` counts the messages) and hierarchical
ones (``chainer_vgc.nodes.run`` sums a node's counts first),
:func:`record` adds them to the run totals and reports them,
:func:`run_summary` sums up the run.  It is shared by
:class:`~chainer_vgc.chainermn.communicator.VGCCommunicator`, the
hierarchical communicator and the one-process
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
:class:`~chainer_vgc.extensions.CompressionReport` adds the totals since
the start of the run.
"""

import chainer

from chainer_vgc import codec

#: the per-step keys, for PrintReport / PlotReport
REPORT_KEYS = ['vgc/compression', 'vgc/density', 'vgc/bytes',
               'vgc/bits_per_element']


# -- one step ---------------------------------------------------------------
def figures(n_params, workers, sent, message_bytes, wire, dense_elements=0.0,
            param_bytes=None, ranks=None, n_compressed=None):
    """Figures of one exchange from its counts, the same on every rank; the
    one place where they are computed, for flat runs (:func:`step_figures`)
    and hierarchical ones (``chainer_vgc.nodes.run.report_node_step``).

    ``workers``: the workers whose messages were exchanged (the ranks, or
    the nodes); ``sent``: the elements their messages carried, together;
    ``message_bytes``: the bytes of those messages; ``wire``: the bytes
    each rank sends on the wire, on average; ``dense_elements``: elements
    of the dense group over all workers; ``ranks``: the MPI ranks (default
    ``workers``), for what a dense ring allreduce would send,
    2 (ranks - 1) / ranks * ``param_bytes`` per rank (Sec. 5;
    ``param_bytes`` = sum of size * itemsize, default 4 N).

    ``vgc/compression``: parameters / average elements sent per worker
    (the paper's definition), over all parameters (a dense group's
    elements count as sent); ``vgc/density``: its inverse;
    ``vgc/bytes``: ``wire``; ``vgc/skipped``: 0 (an exchange took place; a
    skipped step reports 1); ``vgc/bits_per_element``: 8 x
    ``message_bytes`` / ``sent`` (when the messages carry any).  With a
    dense group (``n_compressed`` < ``n_params``), also
    ``vgc/dense_fraction`` (of the parameters) and, when some parameters
    are compressed, ``vgc/compression_compressed`` (that group alone).
    Keys with '_' feed the run totals (:func:`record`)."""
    if param_bytes is None:
        param_bytes = 4 * n_params
    ranks = ranks or workers
    per_worker = (sent + dense_elements) / workers
    out = {
        'vgc/compression': (n_params / per_worker if per_worker
                            else float('inf')),
        'vgc/density': per_worker / n_params if n_params else 0.0,
        'vgc/bytes': wire,
        'vgc/skipped': 0.0,  # an exchange took place
        '_elements': sent + dense_elements,
        '_bytes': wire,
        '_dense_bytes': 2 * (ranks - 1) * param_bytes / ranks,
        '_message_bits': 8.0 * message_bytes,
        '_message_elements': float(sent),
    }
    if sent:
        out['vgc/bits_per_element'] = 8.0 * message_bytes / sent
    if n_compressed is not None and n_compressed < n_params:
        out['vgc/dense_fraction'] = (n_params - n_compressed) / n_params
        if n_compressed:  # (none during a warm-up)
            out['vgc/compression_compressed'] = (
                n_compressed * workers / sent if sent else float('inf'))
    return out


def step_figures(blocks, n_params, elements=None, param_bytes=None,
                 size=None, dense_elements=0, dense_wire=0.0,
                 n_compressed=None, allreduced_bytes=None):
    """:func:`figures` of one flat exchange of the messages ``blocks``
    (one per rank, ``size`` ranks, default len(blocks)), sent with the
    ring allgatherv: each rank sends (p - 1) / p of all messages, plus
    ``dense_wire`` for the dense group's allreduce.  ``elements``: per
    message, when already counted.  ``allreduced_bytes``: the bytes each
    rank put into allreduces instead of messages (PowerSGD's factors,
    ``elements`` then per rank): a ring allreduce sends 2 (p - 1) / p
    of them."""
    p = size or len(blocks)
    if elements is None:
        elements = [codec.message_count(b) for b in blocks]
    if allreduced_bytes is not None:
        total_bytes = p * allreduced_bytes
        wire = 2 * (p - 1) * allreduced_bytes / p
    else:
        total_bytes = 4 * sum(int(b.size) for b in blocks)
        wire = (p - 1) * total_bytes / p
    return figures(n_params, p, sum(elements), total_bytes,
                   wire + dense_wire, dense_elements, param_bytes, p,
                   n_compressed)


def new_totals():
    """Run totals: steps, elements (all ranks), bytes and dense_bytes (per
    rank), skipped exchanges, param_elements (parameters x steps),
    message_bits and message_elements (all ranks' messages, and the
    elements they carried), dense_steps (sent dense by the fallback)."""
    return {'steps': 0.0, 'elements': 0.0, 'bytes': 0.0, 'dense_bytes': 0.0,
            'skipped': 0.0, 'param_elements': 0.0, 'message_bits': 0.0,
            'dense_steps': 0.0,
            'message_elements': 0.0}


def record(figures, n_params, totals, observer=None, label=None):
    """Add one exchange's ``figures`` to ``totals`` (its '_' keys, one
    step, ``n_params`` parameters), report them with ``chainer.reporter``
    (:func:`report`: ``observer``, ``label``) and return them."""
    for key, value in figures.items():
        if key.startswith('_'):  # (totals of older snapshots lack some)
            totals[key[1:]] = totals.get(key[1:], 0.0) + value
    totals['steps'] += 1
    totals['param_elements'] += n_params
    report(figures, observer, label)
    return figures


def elements_by_tensor(message, sizes, dtypes):
    """{tensor index: elements} a message carries (its groups decoded on
    the host: gap-coded groups may span several tensors)."""
    from chainer_vgc.codec.message import unpack
    out = {}
    for part in unpack(message, sizes, dtypes):
        out[part.tensor_id] = out.get(part.tensor_id, 0) + int(
            part.index.size)
    return out


def count_sent(counts, sizes, sent, compressor, model, size):
    """Add one flat exchange's elements per parameter to ``counts`` ({name:
    elements}, all ranks): the compressed group's from every rank's
    message (``sent.blocks``), the dense group's whole; ``sizes`` ({name:
    elements of the parameter}) gets every parameter's size."""
    from chainer_vgc.params import model_params
    names, params = model_params(model)
    for name, p in zip(names, params):
        if p.array is not None:
            sizes[name] = int(p.size)
    for block in sent.blocks:
        for t, n in elements_by_tensor(block, compressor.sizes,
                                       compressor.dtypes).items():
            name = compressor.names[t]
            counts[name] = counts.get(name, 0) + n
    if sent.allreduced_bytes is not None:  # factors: each rank the same
        for t, n in compressor.last_sent_by_tensor.items():
            name = compressor.names[t]
            counts[name] = counts.get(name, 0) + n * size
    if sent.dense_indices:
        for i in sent.dense_indices:
            counts[names[i]] = counts.get(names[i], 0) + params[i].size * size


def report_step(blocks, n_params, totals, elements=None, param_bytes=None,
                observer=None, label=None, extra=None, **dense):
    """:func:`record` the :func:`step_figures` of one flat exchange
    (``elements``: per message, when already counted; ``param_bytes`` and
    ``dense``: see :func:`step_figures`; ``extra``: more figures, '_' keys
    adding to the totals too)."""
    out = step_figures(blocks, n_params, elements, param_bytes, **dense)
    out.update(extra or {})
    return record(out, n_params, totals, observer, label)


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
