"""Snapshots: a method state's residuals and run totals, saved and loaded.

The question this module answers: what of compression is part of a
training run's snapshot, and when may a snapshot be resumed?  The
residuals are the error feedback of paper Sec. 3 (Alg. 1's r and v):
dropping them at a resume would lose every delayed gradient element, so
they are saved with the optimizer (``serializer['vgc_state']``), with a
record of the method, its hyperparameters, the rank count and the model
(its class, its name in reports and its parameters), and the run totals (the warm-up, the alpha ramp and the reports count
steps).  Loading checks that record against the run.
"""

import json
import warnings

import chainer
import numpy

from chainer_vgc.exchange.state import hyperparams_record
from chainer_vgc.exchange.state import initialized_params
from chainer_vgc.exchange.state import plain_json
from chainer_vgc.params import model_params
from chainer_vgc.rules import RULES
from chainer_vgc.rules import create_rule

#: the snapshot record's format (1: the arguments given were recorded)
FORMAT = 2


def serialize(state, model, serializer, ranks, layout=None):
    """Save or load ``state`` (a :class:`~chainer_vgc.exchange.state.
    MethodState`) for ``model`` in a run of ``ranks`` ranks.

    Saving runs no collective (a snapshot taken on one rank only cannot
    hang): it writes what this rank holds.  Loading checks the record
    against the state and the model (a mismatch raises ValueError naming
    both, unless ``resume_other_method`` allows a different method: its
    residuals then start fresh) and may happen before the model's
    parameters are initialized (trainer snapshots load the optimizer
    before the model), so loaded arrays are kept and installed by the
    state's next ``setup``.  ``layout``: the hierarchical communicator's
    nodes and local rank, in words (None: flat); loading needs the same.
    """
    if isinstance(serializer, chainer.serializer.Deserializer):
        return _load(state, model, serializer, ranks, layout)
    states = state.residuals()
    meta = _meta(state, model, sorted(states), ranks)
    if layout is not None:
        meta['layout'] = layout
    serializer('meta', json.dumps(meta, default=plain_json))
    _serialize_run(state, serializer)
    for name in sorted(states):
        for key in sorted(states[name]):
            serializer(_state_key(name, key), states[name][key])


def _meta(state, model, state_names, ranks):
    return {'format': FORMAT, 'method': state.method,
            'hyperparams': hyperparams_record(state.base_rule.hyperparams()),
            'ranks': ranks, 'model': _model_record(model),
            'model_name': type(model).__name__, 'label': state.label,
            'states': state_names}


def _load(state, model, serializer, ranks, layout=None):
    keys = sorted(state.rule.init_state(0, numpy.float32, numpy))
    try:
        text = str(serializer('meta', ''))
    except KeyError:  # a snapshot from before the record existed
        text = ''
    meta = json.loads(text) if text else None
    fresh = False
    if meta is not None:
        _check_layout(meta, ranks, layout)
        fresh = _check_meta(state, meta, model, ranks)
    if not fresh:
        _serialize_run(state, serializer, meta)
    loaded = {}
    if meta is None:
        names, _ = model_params(model)
    else:
        names = [] if fresh else meta['states']
    for name in names:
        for key in keys:
            try:  # absent: the parameter was not initialized then
                arr = serializer(_state_key(name, key), None)
            except KeyError:
                arr = None
            if arr is not None:
                loaded.setdefault(name, {})[key] = arr
    if meta is None and keys and names and not loaded:
        raise ValueError(
            'the snapshot has no residual state for method {!r} '
            '(was it saved with another method?)'.format(state.method))
    state.loaded = loaded
    state.compressor = None  # installed by the next setup()


def _check_layout(meta, ranks, layout):
    """A hierarchical run's residuals are those of one rank's shard: it
    resumes only on the same nodes, ranks per node and local rank."""
    saved = meta.get('layout')
    if saved == layout:
        return
    flat = 'flat ({} ranks)'
    raise ValueError(
        'chainer_vgc: the snapshot was saved by a run laid out as {}; this '
        'run is {}. Resume with the same layout (hierarchy and '
        'ranks_per_node), each rank loading its own snapshot'.format(
            saved or flat.format(meta.get('ranks')),
            layout or flat.format(ranks)))


def _check_meta(state, meta, model, ranks):
    """Compare a snapshot's record with this run; returns True when the
    method differs and ``resume_other_method`` allows it."""
    saved_params = meta['hyperparams']
    if meta.get('format', 1) == 1 and meta['method'] in RULES:
        # format 1 recorded the arguments given: the rule they make
        try:
            saved_params = hyperparams_record(create_rule(
                meta['method'], **dict(saved_params)).hyperparams())
        except ValueError:
            pass
    if meta['method'] == state.method:
        # a name the rule no longer declares was not a setting (format 2
        # recorded vgc's derived uses_index_words)
        declared = set(state.base_rule.hyperparams())
        saved_params = [kv for kv in saved_params if kv[0] in declared]
    saved = (meta['method'], [tuple(kv) for kv in saved_params])
    here = (state.method, [tuple(kv) for kv in hyperparams_record(
        state.base_rule.hyperparams())])
    if meta['ranks'] != ranks:
        raise ValueError(
            'chainer_vgc: the snapshot was saved by a run of {} ranks; '
            'this run has {}. Resume with the same number of ranks'
            .format(meta['ranks'], ranks))
    _check_model(meta, model)
    ours = {n: (s, d) for n, s, d in _model_record(model)}
    if ours:  # loaded before the model's lazy params: setup() checks
        for n, s, d in meta['model']:
            if n in ours and ours[n] != (s, d):
                raise ValueError(
                    'chainer_vgc: the snapshot was saved for a model ({}) '
                    'whose parameter {} has shape {} dtype {}; this model '
                    '({}) has shape {} dtype {}{}'.format(
                        _saved_name(meta), n, s, d, type(model).__name__,
                        *ours[n], _OWN_SNAPSHOT
                        if _another_class(meta, model) else ''))
    if saved != here:
        if saved[0] != here[0] and state.resume_other_method:
            warnings.warn(
                'chainer_vgc: resuming a {!r} snapshot with method {!r}: '
                'its residuals start fresh (resume_other_method=True)'
                .format(saved[0], here[0]))
            return True
        raise ValueError(
            'chainer_vgc: the snapshot was saved with method {!r} {} but '
            'this run uses {!r} {}; resume with the same settings{}'
            .format(saved[0], dict(saved[1]), here[0], dict(here[1]),
                    '' if saved[0] == here[0] else
                    ' (or, to switch method and start the residuals '
                    'fresh, create_communicator(..., '
                    'resume_other_method=True))'))
    return False


def _check_model(meta, model):
    """A snapshot of a model of another class must name only parameters
    this model has (initialized or not): with several models on one
    communicator, each optimizer must load its own model's snapshot."""
    if not _another_class(meta, model):
        return  # (a parameter added after construction may be missing)
    names = set(n for n, _ in model.namedparams())
    foreign = [n for n, _, _ in meta['model'] if n not in names]
    if foreign:
        raise ValueError(
            'chainer_vgc: the snapshot was saved for another model ({}, '
            'with parameter {}) than this one ({}, which has no such '
            'parameter){}'.format(_saved_name(meta), foreign[0],
                                  type(model).__name__, _OWN_SNAPSHOT))


def _another_class(meta, model):
    """Whether the record names a model class other than ``model``'s
    (records from before issue 24 name none)."""
    return meta.get('model_name', type(model).__name__) != \
        type(model).__name__


_OWN_SNAPSHOT = ("; with several models on one communicator, load each "
                 "optimizer's own snapshot")


def _saved_name(meta):
    """The saved model's class (and name in reports), as a record says."""
    name = meta.get('model_name', 'a model')
    if meta.get('label'):
        name += ', reported as {!r}'.format(meta['label'])
    return name


def _serialize_run(state, serializer, meta=None):
    """Run totals and the rule's own state (QSGD's generator).  ``meta``:
    the record of a snapshot being loaded."""
    totals = state.totals
    for key in sorted(totals):
        try:
            totals[key] = float(serializer('totals/' + key,
                                           float(totals[key])))
        except KeyError:  # a snapshot from before this total existed
            if key == 'param_elements' and meta is not None:
                # every step exchanged the recorded model
                totals[key] = totals['steps'] * sum(
                    int(numpy.prod(shape)) for _, shape, _ in meta['model'])
    extra = state.rule.get_extra_state()
    for key in sorted(extra):
        try:
            extra[key] = str(serializer('rule/' + key, extra[key]))
        except KeyError:  # a snapshot from before this state existed
            pass
    state.rule.set_extra_state(extra)


def _model_record(model):
    """[name, shape, dtype] of each initialized parameter (JSON-ready)."""
    names, params = initialized_params(model)
    return [[n, list(p.shape), str(p.dtype)] for n, p in zip(names, params)]


def _state_key(name, key):
    return name.lstrip('/') + '/' + key
