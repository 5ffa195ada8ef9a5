"""The method's state for one model: what compression remembers between
steps.

The question this module answers: what does the method hold for one model
from step to step, and which of the model's parameters does it compress in
this step?  A :class:`MethodState` is paper Alg. 1's worker state for one
model on one rank: the rule (vgc, hybrid, ...), the residuals of every
compressed parameter (r, and v for vgc: the error feedback of Sec. 3,
kept by its :class:`~chainer_vgc.compressor.GradientCompressor`), the dense
group, the warm-up and the alpha ramp, the run totals and the figures of
the last exchange.

It moves no bytes: the communicator does
(:mod:`chainer_vgc.chainermn.collectives`), one exchange is
:mod:`chainer_vgc.exchange.run`'s, and snapshots are :mod:`chainer_vgc.exchange.snapshot`'s.
The checks that every rank agrees are handed the communicator's
collectives.
"""

import json
import warnings

import numpy

from chainer_vgc.backends import arrays
from chainer_vgc import reporting
from chainer_vgc.exchange import elastic
from chainer_vgc.exchange import fallback
from chainer_vgc.exchange import settings
from chainer_vgc.engines.native import bindings
from chainer_vgc.compressor import GradientCompressor
from chainer_vgc.params import model_params
from chainer_vgc.params import some_of
from chainer_vgc.rules import CompressionRule

#: ``uncovered``: what to do with parameters the statistics do not cover
UNCOVERED = ('error', 'bruteforce', 'dense')


class MethodState(object):
    """The compression method's state for one model on one rank.

    Args:
        method: a rule name (``'vgc'``, ``'hybrid'``, ``'strom'``,
            ``'qsgd'``, ``'none'``) or a
            :class:`~chainer_vgc.rules.CompressionRule` object.
        rank: this rank (QSGD: its own random stream).
        **hyperparams: the rule's, with a method name.

    ``exclude``, ``min_size``, ``warmup``, ``alpha_ramp``, ``dense_dtype``,
    ``uncovered``, ``max_memory``, ``examples``, ``spare_residuals``,
    ``resume_other_method`` and ``resume_residuals`` are as in
    :class:`~chainer_vgc.chainermn.communicator.VGCCommunicator`.  Every argument is
    checked here, on construction.
    """

    def __init__(self, method='vgc', rank=0, exclude=None, min_size=0,
                 warmup=0, alpha_ramp=None, dense_dtype=None,
                 uncovered='error', max_memory=None, examples=None,
                 spare_residuals=False, resume_other_method=False,
                 dense_fallback=None, resume_residuals='own',
                 **hyperparams):
        if uncovered not in UNCOVERED:
            raise ValueError("uncovered must be 'error', 'bruteforce' or "
                             "'dense', got {!r}".format(uncovered))
        self.base_rule = settings.make_rule(method, hyperparams)
        #: None, or the :class:`~chainer_vgc.exchange.fallback.DenseFallback`
        self.fallback = fallback.make(dense_fallback)
        self.dense_fallback = dense_fallback
        if self.fallback is not None and \
                type(self.base_rule).count is CompressionRule.count:
            raise ValueError(
                'dense_fallback needs a rule that counts what it would send '
                '(CompressionRule.count: vgc, hybrid, strom, dgc); {!r} does '
                'not{}'.format(self.base_rule.name, (
                    " (powersgd sends the same factors every step: compare "
                    "its step with method='none' once instead)"
                    if self.base_rule.exchange == 'allreduce_factors'
                    else '')))
        self.method = self.base_rule.name
        self.hyperparams = dict(hyperparams)
        self.method_arg = method
        #: this rank's rule (QSGD: its own random stream)
        self.rule = self.base_rule.for_rank(rank)
        self.exclude = settings.check_exclude(exclude)
        self.min_size = settings.check_count('min_size', min_size)
        self.warmup = settings.check_count('warmup', warmup)
        self.alpha_ramp = settings.check_ramp(alpha_ramp, self.base_rule)
        self.dense_dtype = settings.check_dense_dtype(dense_dtype)
        self.uncovered = uncovered
        self.max_memory = max_memory
        if examples is not None and not callable(examples):
            raise ValueError('examples must be a function of the '
                             "update's arguments returning the minibatch's "
                             'examples (e.g. chainer_vgc.sentence_pairs), '
                             'got {!r}'.format(examples))
        self.examples = examples
        self.spare_residuals = bool(spare_residuals)
        #: count the elements each parameter sends (all ranks summed, into
        #: elements_by_parameter {name: elements}): set by
        #: CompressionReport(..., by_parameter=True); it reads every
        #: received message's groups on the host
        self.count_by_parameter = False
        self.elements_by_parameter = {}
        #: {name: elements} of the parameters counted
        self.parameter_sizes = {}
        self.resume_other_method = bool(resume_other_method)
        #: what a snapshot of another rank or world size does
        #: (:func:`chainer_vgc.exchange.elastic.check_resume_residuals`)
        self.resume_residuals = elastic.check_resume_residuals(
            resume_residuals)
        #: the compressed group's compressor and residuals (by setup())
        self.compressor = None
        self.names = None
        self.dense = set()
        #: parameters the statistics did not cover (uncovered='dense')
        self.uncovered_dense = set()
        #: a snapshot's residuals, installed by the next setup()
        self.loaded = None
        #: running totals since construction (or the snapshot's)
        self.totals = reporting.new_totals()
        #: figures of the last exchange (aggregated over ranks)
        self.last = {}
        #: whether the last exchange was skipped (a rank's gradients were
        #: not finite)
        self.skipped = False
        #: seconds of the last exchange's phases on this rank
        self.last_timing = {}
        #: the model's name in reports, when a communicator serves several
        #: models (None: one model, reported as ``vgc/...``; by default
        #: ``model<index>``, ``index`` the order the communicator met the
        #: model in; yours: ``comm.state(model).label = 'gen'``): see
        #: :func:`chainer_vgc.reporting.report`
        self.label = None
        self.index = 0

    def settings(self):
        """The arguments that make an equal, fresh state."""
        return dict(self.hyperparams, method=self.method_arg,
                    exclude=self.exclude, min_size=self.min_size,
                    warmup=self.warmup, alpha_ramp=self.alpha_ramp,
                    dense_dtype=self.dense_dtype, uncovered=self.uncovered,
                    max_memory=self.max_memory, examples=self.examples,
                    spare_residuals=self.spare_residuals,
                    resume_other_method=self.resume_other_method,
                    dense_fallback=self.dense_fallback,
                    resume_residuals=self.resume_residuals)

    # -- what this step does --------------------------------------------------
    @property
    def warming_up(self):
        """Whether the next exchange is a warm-up (dense) one."""
        return self.totals['steps'] < self.warmup

    @property
    def needs_sqsum(self):
        """Whether the next exchange needs the per-sample statistics."""
        return self.needs_sqsum_after(self.totals['steps'])

    def names_and_dense(self):
        """``(names, dense)``: the parameters of the whole model this state
        exchanges and its dense group (names None before the first
        exchange); a node's state answers for the whole model, not its
        shard (:class:`chainer_vgc.nodes.run.NodeMethodState`)."""
        return self.names, self.dense

    def needs_sqsum_after(self, steps):
        """Whether an exchange that starts when ``steps`` exchanges have
        completed may need the per-sample statistics (not during the
        warm-up, nor for a rule that does not use them, nor when every
        parameter of the model is dense): the one place this is
        decided, for flat and node runs alike."""
        names, dense = self.names_and_dense()
        everything_dense = names is not None and len(dense) == len(names)
        return (self.rule.needs_sqsum and self.rule.exchange != 'allreduce'
                and steps >= self.warmup and not everything_dense)

    def dense_group(self, model):
        """Names of ``model``'s initialized parameters exchanged densely
        (allreduce): see :func:`chainer_vgc.exchange.settings.dense_group`."""
        return settings.dense_group(model, self.rule, self.exclude,
                                    self.min_size, self.uncovered_dense)

    def statistics(self, model, hook=None):
        """A per-sample statistics hook for ``model``: ``hook`` when it
        still fits the model, else a new
        :class:`~chainer_vgc.statistics.PerSampleSquares`; the dense group
        is skipped."""
        from chainer_vgc.statistics import DEFAULT_MAX_MEMORY
        from chainer_vgc.statistics import PerSampleSquares
        names, _ = model_params(model)
        if hook is None or hook.names != names:
            hook = PerSampleSquares(
                model, uncovered=self.uncovered,
                max_memory=self.max_memory or DEFAULT_MAX_MEMORY,
                examples=self.examples)
        hook.skip = self.dense_group(model)
        return hook

    def split(self, model, steps):
        """(compressed, dense) lists of (index in ``model_params(model)``,
        param) of the initialized parameters, for an exchange after
        ``steps`` exchanges (a warm-up one: everything dense)."""
        warm = steps < self.warmup
        compressed, dense = [], []
        for i, (n, p) in enumerate(zip(*model_params(model))):
            if p.array is not None:
                (dense if warm or n in self.dense else compressed).append(
                    (i, p))
        return compressed, dense

    def ramp_alpha(self, steps):
        """The rule's alpha on the ``alpha_ramp`` schedule, after ``steps``
        exchanges."""
        if self.alpha_ramp is None:
            return
        alpha0, length = self.alpha_ramp
        done = max(0.0, steps - self.warmup)
        frac = min(1.0, done / length) if length else 1.0
        self.rule.alpha = alpha0 + (self.base_rule.alpha - alpha0) * frac

    def note_uncovered(self, names, collectives):
        """With ``uncovered='dense'``: parameters a backward could not cover
        join the dense group, on every rank (one allgather; one warning
        listing them)."""
        if self.uncovered != 'dense':
            return
        mine = sorted(set(names or ()) - self.uncovered_dense)
        # every rank's (a branch may run on some ranks only): the dense
        # group must be the same everywhere before any exchange
        new = set().union(*collectives.allgather_obj(mine))
        if not new:
            return
        # a new set: the main thread may be reading the old one
        self.uncovered_dense = self.uncovered_dense | new
        warnings.warn(
            "chainer_vgc: per-sample statistics do not cover {} "
            "parameter(s): {}; with uncovered='dense' they are sent "
            'uncompressed (dense allreduce)'.format(len(new),
                                                    some_of(sorted(new))))

    def commit(self, totals, last, skipped, timing):
        """A completed exchange's totals and figures become the state's."""
        self.totals, self.last = totals, last
        self.skipped, self.last_timing = skipped, timing

    # -- set-up and consistency ----------------------------------------------
    def setup(self, model, collectives, ranks_here=None):
        """Build the compressor for ``model`` and check that every rank has
        the same model (names, shapes, dtypes), method, transport, dense
        group and warm-up (one allgather of ``collectives``).
        ``ranks_here``: the ranks sharing this rank's cores (default:
        ``collectives.intra_size``), which divide the native threads.

        Raises ValueError on every rank otherwise.  Called by every
        exchange (a no-op while nothing changed) and before loading state.
        """
        names, params = initialized_params(model)
        # (a node's shard averages over the nodes)
        self.rule.workers = self.workers or collectives.size
        dense = self.dense_group(model)
        if (self.names == names and self.dense == dense
                and self.compressor is not None):
            return
        self.check_ranks(names, params, dense, collectives)
        if self.dense_dtype == numpy.float16:
            # (during a warm-up every parameter is in the dense group)
            wide = [n for n, p in zip(names, params)
                    if (n in dense or self.warmup)
                    and p.dtype == numpy.float64]
            if wide:
                raise ValueError(
                    "dense_dtype='float16' would round the float64 "
                    'parameters {} of the dense group to float16; use '
                    'dense_dtype=None for this model'.format(wide))
        self._build(names, params, dense,
                    ranks_here or collectives.intra_size)

    def check_ranks(self, names, params, dense, collectives):
        """Every rank of ``collectives`` has the same model (``names``,
        ``params``' shapes and dtypes), method, transport, dense group and
        warm-up: one allgather; ValueError on every rank otherwise."""
        signature = ((self.method, hyperparams_record(
                         self.base_rule.hyperparams())),
                     collectives.transport_settings(),
                     [(n, tuple(p.shape), str(p.dtype))
                      for n, p in zip(names, params)],
                     (sorted(dense), self.warmup, self.alpha_ramp,
                      str(self.dense_dtype), self.uncovered,
                      self.fallback and self.fallback.describe()))
        everyone = collectives.allgather_obj(signature)
        diffs = [r for r, sig in enumerate(everyone) if sig != everyone[0]]
        if diffs:
            label, mine, theirs = _first_difference(everyone[0],
                                                    everyone[diffs[0]])
            raise ValueError(
                'chainer_vgc: ranks {} differ from rank 0 in {}: rank 0 has '
                '{} but rank {} has {}. Every rank must build the same model '
                'and communicator'.format(diffs, label, mine, diffs[0],
                                          theirs))

    def _build(self, names, params, dense, intra_size):
        # residuals are kept per parameter name: a parameter initialized
        # later (a branch reached mid-run) starts fresh, the others go on
        kept = {}
        if self.compressor is not None:
            kept = {n: st for n, st in zip(self.compressor.names,
                                           self.compressor.states)
                    if st is not None}
        pairs = [(n, p) for n, p in zip(names, params) if n not in dense]
        self.compressor = GradientCompressor(
            self.rule, [n for n, _ in pairs], [p.shape for _, p in pairs],
            [p.dtype for _, p in pairs],
            spare_residuals=self.spare_residuals)
        if self.compressor.backend == 'native':
            # the cores of this node, shared by its ranks (OMP_NUM_THREADS
            # wins where set)
            threads = bindings.default_threads(intra_size)
            if threads:
                bindings.set_num_threads(threads)
        for i, (name, p) in enumerate(pairs):
            with arrays.device_scope(p.array):
                fresh = self.compressor.new_state(i, p.xp)
            old = kept.get(name)
            if old is not None and sorted(old) == sorted(fresh) and all(
                    old[k].size == a.size and old[k].dtype == a.dtype
                    for k, a in fresh.items()):
                fresh = old
            self.compressor.states[i] = fresh
        self.names, self.dense = names, dense
        if self.loaded is not None:
            self._install_loaded([p for _, p in pairs])

    def _install_loaded(self, params):
        loaded, self.loaded = self.loaded, None
        for i, (name, p) in enumerate(zip(self.compressor.names, params)):
            for key, arr in loaded.get(name, {}).items():
                state = self.compressor.states[i][key]
                if arr.size != state.size:
                    raise ValueError(
                        'residual state {!r} of parameter {!r} has {} '
                        'elements in the snapshot, the model has {}'.format(
                            key, name, arr.size, state.size))
                with arrays.device_scope(state):
                    state[...] = p.xp.asarray(arr).reshape(
                        state.shape).astype(state.dtype)

    @property
    def compressed_elements(self):
        """Elements of the compressed group (0 before the first set-up)."""
        return self.compressor.n_params if self.compressor is not None \
            else 0

    @property
    def workers(self):
        """How many workers the exchange averages over (None: the
        communicator's ranks; a node's shard: the nodes)."""
        return None

    def residuals(self):
        """{parameter name: {state key: array}} of the residuals held (or,
        loaded from a snapshot and not installed yet, those)."""
        if self.compressor is not None:
            return {n: st for n, st in zip(self.compressor.names,
                                           self.compressor.states) if st}
        return dict(self.loaded or {})


def initialized_params(model):
    """(names, params) of the initialized parameters, sorted by name.

    As ChainerMN's communicators do, a lazily initialized parameter that has
    not been initialized yet (no forward pass reached it) is left out."""
    names, params = model_params(model)
    pairs = [(n, p) for n, p in zip(names, params) if p.array is not None]
    return [n for n, _ in pairs], [p for _, p in pairs]


def hyperparams_record(params):
    """Hyperparameters as a sorted list of [name, value] pairs, as JSON
    gives them back (tuples become lists, NumPy values plain), so that a
    record compares equal to itself after a snapshot."""
    return json.loads(json.dumps(sorted([k, v] for k, v in params.items()),
                                 default=plain_json))


def plain_json(value):
    """JSON for NumPy values among the hyperparameters (anything else that
    JSON cannot hold: its repr)."""
    if isinstance(value, (numpy.generic, numpy.ndarray)):
        return value.tolist()
    return repr(value)


def _first_difference(a, b):
    labels = ('method', 'allgatherv, chunk_words and CPU backend')
    for label, x, y in zip(labels, a[:2], b[:2]):
        if x != y:
            return label, x, y
    pa, pb = a[2], b[2]
    for x, y in zip(pa, pb):
        if x != y:
            return 'a parameter', x, y
    if len(pa) != len(pb):
        return 'the number of parameters', len(pa), len(pb)
    return ('the dense group, warmup, alpha_ramp, dense_dtype and '
            'uncovered', a[3], b[3])
