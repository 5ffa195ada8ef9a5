"""Snapshots: a method state's residuals and run totals, saved and loaded.

The question this module answers: what of compression is part of a
training run's snapshot, and when may a snapshot be resumed?  The
residuals are the error feedback of paper Sec. 3 (Alg. 1's r and v):
dropping them at a resume would lose every delayed gradient element, so
they are saved with the optimizer (``serializer['vgc_state']``), with a
record of the method, its hyperparameters, the rank count and the model
(its class, its name in reports and its parameters), the rank that saved
it, and the run totals (the warm-up, the alpha ramp and the reports count
steps).  Loading checks that record against the run.

A rank's residuals are its own: the elements of *its* gradients it has not
sent yet.  A snapshot saved on rank 0 only and loaded on every rank would
apply rank 0's delayed gradients p times and lose the others', so a
snapshot of another rank, or of another world size, is refused unless
``resume_residuals`` says otherwise
(:func:`~chainer_vgc.exchange.elastic.check_resume_residuals`):
``'fresh'`` (the residuals start empty, with a warning) or an
:class:`~chainer_vgc.exchange.elastic.ElasticResume` over the saved ranks'
files, which merges what they held
(:meth:`chainer_vgc.rules.CompressionRule.share_residuals`).
"""

import json
import warnings

import chainer
import numpy

from chainer_vgc.exchange.elastic import PER_RANK
from chainer_vgc.exchange.elastic import SAVE_PER_RANK
from chainer_vgc.exchange.elastic import ElasticResume
from chainer_vgc.exchange.state import hyperparams_record
from chainer_vgc.exchange.state import initialized_params
from chainer_vgc.exchange.state import plain_json
from chainer_vgc.params import model_params
from chainer_vgc.rules import RULES
from chainer_vgc.rules import create_rule

#: the snapshot record's format (1: the arguments given were recorded;
#: 3: the rank that saved it)
FORMAT = 3

def serialize(state, model, serializer, ranks, layout=None, rank=0):
    """Save or load ``state`` (a :class:`~chainer_vgc.exchange.state.
    MethodState`) for ``model`` on rank ``rank`` of a run of ``ranks``
    ranks.

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
        return _load(state, model, serializer, ranks, layout, rank)
    states = state.residuals()
    meta = _meta(state, model, sorted(states), ranks)
    meta['rank'] = rank
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


def _load(state, model, serializer, ranks, layout=None, rank=0):
    keys = sorted(state.rule.init_state(0, numpy.float32, numpy))
    try:
        text = str(serializer('meta', ''))
    except KeyError:  # a snapshot from before the record existed
        text = ''
    meta = json.loads(text) if text else None
    fresh = False
    foreign = None
    if meta is not None:
        _check_layout(meta, ranks, layout)
        fresh = _check_meta(state, meta, model)
        foreign = _foreign(meta, rank, ranks)
    if foreign is not None and not fresh:
        whose, fix = foreign
        mode = state.resume_residuals
        if isinstance(mode, ElasticResume):
            _serialize_run(state, serializer, meta, rule_state=False)
            state.loaded = _merged(state, mode, model, ranks, keys)
            state.compressor = None
            return
        if mode != 'fresh':
            raise ValueError('chainer_vgc: {}. {}'.format(whose, fix))
        warnings.warn(
            'chainer_vgc: {}. Its residuals are not loaded: they start '
            "fresh on this rank (resume_residuals='fresh')".format(whose))
        _serialize_run(state, serializer, meta, rule_state=False)
        fresh = True
    elif not fresh:
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


def _foreign(meta, rank, ranks):
    """None when the snapshot was saved by this rank in a run of this
    world size (or records no rank: saved before format 3, which at more
    than one rank is said in a warning); else ``(whose, fix)``: whose
    snapshot it is, and what to do."""
    if meta['ranks'] != ranks:
        return ('the snapshot was saved by a run of {} ranks; this run has '
                '{}'.format(meta['ranks'], ranks),
                'Resume with the same number of ranks, or merge what the '
                "saved ranks held: create_communicator(..., resume_residuals="
                "chainer_vgc.ElasticResume([every saved rank's snapshot "
                "file])) ({}); resume_residuals='fresh' starts the "
                'residuals empty'.format(SAVE_PER_RANK))
    saved = meta.get('rank')
    if saved is None and ranks > 1:
        warnings.warn(
            'chainer_vgc: the snapshot records no rank (saved before '
            'format 3), so whose residuals it holds cannot be checked: if '
            'it was saved on one rank only and every rank loads it, that '
            "rank's delayed gradients are applied {} times and the others' "
            'lost. {}'.format(ranks, PER_RANK))
    if saved is None or saved == rank:
        return None
    return ('the snapshot was saved by rank {} of {}; this is rank '
            '{}'.format(saved, ranks, rank),
            'Its residuals are the gradient elements rank {} had not sent '
            'yet: loaded on every rank they would be applied {} times and '
            "this rank's own lost. {}; or create_communicator(..., "
            "resume_residuals='fresh') starts this rank's residuals empty, "
            'with a warning'.format(saved, ranks, PER_RANK))


def _merged(state, elastic, model, ranks, keys):
    """This rank's ``loaded`` residuals from every saved rank's snapshot
    (:class:`ElasticResume`): their records checked against this run and
    against one another (each saved rank once), then each parameter's
    :meth:`~chainer_vgc.rules.CompressionRule.share_residuals`."""
    records = elastic.records(_state_key)
    saved = records[0][0]['ranks']
    for meta, _, path in records:
        if _check_meta(state, meta, model):
            raise ValueError(
                'chainer_vgc: ElasticResume merges residuals of the same '
                'method; {} was saved with {!r}'.format(path, meta['method']))
        if meta['ranks'] != saved or meta.get('rank') is None:
            raise ValueError(
                'chainer_vgc: ElasticResume needs the snapshots of one run, '
                'each recording its rank; {} was saved by rank {} of {} '
                '(the first file: of {})'.format(
                    path, meta.get('rank'), meta['ranks'], saved))
    found = sorted(meta['rank'] for meta, _, _ in records)
    if found != list(range(saved)):
        raise ValueError(
            'chainer_vgc: ElasticResume needs the snapshot of every saved '
            'rank, each once: the run had {} ranks and the files are of '
            'ranks {} ({})'.format(saved, found, elastic.paths))
    held_by = {meta['rank']: states for meta, states, _ in records}
    by_rank = [held_by[r] for r in range(saved)]
    names = sorted(set().union(*[set(st) for st in by_rank]))
    loaded = {}
    for name in names:
        held = [st.get(name) for st in by_rank]
        if any(h is None or sorted(h) != keys for h in held):
            continue  # not initialized on every saved rank: starts fresh
        loaded[name] = state.rule.share_residuals(held)
    return loaded


def _check_meta(state, meta, model):
    """Compare a snapshot's record with this run (not its ranks:
    :func:`_foreign`); returns True when the method differs and
    ``resume_other_method`` allows it."""
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


def _serialize_run(state, serializer, meta=None, rule_state=True):
    """Run totals and the rule's own state (QSGD's generator; not with
    ``rule_state=False``: another rank's, which this rank keeps its own
    of).  ``meta``: the record of a snapshot being loaded."""
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
    if not rule_state:
        return
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
