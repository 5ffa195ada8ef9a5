"""The interface every compression rule implements, and argument checks.

A rule is the method: its state, its declared hyperparameters and its
``compress``, in plain NumPy (and CuPy).  The wire formats are the codec's
(:data:`chainer_vgc.codec.FORMATS`); a backend's faster step for a rule is
registered with :func:`chainer_vgc.backends.registry.register`.

A rule turns one parameter's minibatch gradient (and, for the variance-based
rules, the per-sample sum of squares) plus its own per-parameter state into
the elements to send, as a :class:`chainer_vgc.codec.Group`.  Rules see flat
(1-D) arrays; state arrays are in :func:`chainer_vgc.backends.arrays.state_dtype`.
"""

import copy
import math
import numbers

from chainer_vgc.backends import arrays
from chainer_vgc import codec


class CompressionRule(object):
    """Base class: per-parameter state in, elements to send out."""

    #: name used by :func:`chainer_vgc.rules.create_rule`
    name = None
    #: whether :meth:`compress` needs the per-sample sum of squares
    needs_sqsum = False
    #: the names of the rule's hyperparameters, declared: the settings
    #: that define the method, recorded with snapshots and compared across
    #: ranks (:meth:`hyperparams`)
    hyperparameters = ()
    #: how the indices of the rule's FMT_POW2 words go on the wire
    #: (:data:`chainer_vgc.codec.CODINGS`: ``'fixed'`` limits tensors to
    #: 2**28 elements); None: the rule sends no FMT_POW2 words.  Lossless,
    #: so not a hyperparameter: ranks and resumed runs may differ in it
    index_coding = None
    #: how workers combine what they send: ``'allgatherv'`` (every worker's
    #: message to every worker, decoded and averaged, paper Sec. 4.3;
    #: the rule's :meth:`compress`), ``'allreduce'`` (the gradients are
    #: not compressed: a dense MPI allreduce, as ChainerMN's naive
    #: communicator) or ``'allreduce_factors'`` (dense factors of the
    #: gradients summed by allreduces, one after the other, PowerSGD's;
    #: the rule's :meth:`reduce`)
    exchange = 'allgatherv'

    def init_state(self, size, dtype, xp):
        """Fresh per-parameter state: dict of flat arrays (may be empty)."""
        return {}

    def tensor_state(self, tensor_id, shape, dtype, xp):
        """Fresh state of tensor ``tensor_id`` (its position in the
        compressor's list, the same on every worker) of ``shape``: what
        every caller makes a tensor's state with.  By default
        :meth:`init_state` of its size; a rule whose state depends on the
        tensor's shape or position (PowerSGD's Q) overrides this."""
        return self.init_state(int(math.prod(shape)), dtype, xp)

    def keeps_dense(self, shape):
        """Whether a parameter of ``shape`` goes to the dense group
        (allreduce, uncompressed) rather than to this rule, whatever the
        communicator's ``exclude`` and ``min_size`` say: DGC's and
        PowerSGD's vectors, PowerSGD's matrices that its rank would not
        compress.  False by default."""
        return False

    #: the number of workers whose messages are averaged, set by the
    #: exchange before the first step (1 for a compressor used alone); a
    #: rule whose step depends on it reads it (DGC's local clipping)
    workers = 1

    def reduce(self, tensors, mean):
        """One step of a rule whose :attr:`exchange` is
        ``'allreduce_factors'``: ``tensors`` is ``[(tensor_id, shape,
        grad, state)]`` (flat gradients in the state dtype, the states
        not to be changed here), ``mean(buffers)`` the mean over the
        workers of a list of flat arrays (one allreduce, the same calls on
        every worker).  Returns ``(means, new_states, elements)``, a list
        of each: each tensor's mean update (flat, state dtype), its next
        state (swapped in by the compressor once every worker's step went
        well) and the elements this worker sent for it."""
        raise NotImplementedError(
            'rule {!r} exchanges by {!r}, not by allreduce of factors'
            .format(self.name, self.exchange))

    #: the per-parameter state keys that are delayed gradient (Alg. 1's
    #: r: what was accumulated and not yet sent) and those that are its
    #: variance (Alg. 1's v); :meth:`share_residuals` merges these two
    #: kinds, and a rule with other state says how it merges its own
    residual_keys = ('r',)
    variance_keys = ('v',)

    def share_residuals(self, saved):
        """One new rank's state of one parameter when a run resumes at
        another world size (``chainer_vgc.ElasticResume``): ``saved`` the
        states the saved ranks held, ``[{key: flat array}]`` in rank
        order.  The mean over the ranks of r is what the averaged update
        still owes the model, ``(1 / p) sum_j r_j`` (Sec. 4.3: the update
        is the mean of what the ranks send), so every new rank starts from
        the saved ranks' mean r, ``R / p_old``: the update owes the same
        at any world size.  Its variance, with the ranks' accumulations
        independent, is ``sum_j v_j / p_old**2``, which keeps each
        element's ratio r**2 / v (the criterion's) that of the merged sum.
        Summed in rank order, in the state dtype."""
        p = len(saved)
        out = {}
        for key in (saved[0] if saved else ()):
            total = saved[0][key].copy()
            for st in saved[1:]:
                total += st[key]
            if key in self.residual_keys:
                total /= total.dtype.type(p)
            elif key in self.variance_keys:
                total /= total.dtype.type(p * p)
            else:
                raise ValueError(
                    'chainer_vgc: rule {!r} keeps per-parameter state {!r}, '
                    'which is neither a residual (residual_keys) nor its '
                    'variance (variance_keys): it does not say how its '
                    'state merges at another world size. Override '
                    'CompressionRule.share_residuals, or resume with '
                    "resume_residuals='fresh'".format(self.name, key))
            out[key] = total
        return out

    def get_extra_state(self):
        """State of the rule itself (not per parameter) as {name: str},
        saved with snapshots; empty for deterministic rules."""
        return {}

    def set_extra_state(self, state):
        """Restore what :meth:`get_extra_state` returned."""

    def hyperparams(self):
        """The rule's settings as {name: value}, those that
        :attr:`hyperparameters` declares: recorded with snapshots and
        compared across ranks."""
        return {k: getattr(self, k) for k in self.hyperparameters}

    def for_rank(self, rank):
        """The rule worker ``rank`` runs (its own copy).  Default: a copy of
        this one; a randomized rule gives each rank its own stream."""
        return copy.deepcopy(self)

    def check_optimizer(self, optimizer):
        """Raise ValueError, naming the fix, when the Chainer optimizer
        that applies this rule's mean would undo the method (DGC's
        momentum correction under a momentum optimizer: momentum twice).
        Called by the multi-node optimizer; nothing by default."""

    def prepare(self, grads):
        """Called once per step by the compressor with every gradient
        (None where a parameter has none), after every worker's inputs
        were accepted and before :meth:`begin_step`: for a rule whose step
        depends on the whole gradient (DGC's local clipping by its norm;
        say so with :attr:`reads_every_gradient`).  Nothing by default."""

    #: whether :meth:`prepare` needs every gradient of the worker (a
    #: hierarchical run's ranks each hold a shard of the model, so such a
    #: rule is refused there)
    reads_every_gradient = False

    def begin_step(self):
        """Called once per step by the compressor, after every worker's
        inputs were accepted and before the first tensor is compressed."""

    def dense_step(self):
        """Called instead of :meth:`begin_step` for a step the dense
        fallback sent uncompressed (no state moved): a rule whose schedule
        counts steps (DGC's density warm-up) counts it too."""

    def compress(self, tensor_id, grad, sqsum, state):
        """Update ``state`` in place; return a Group, or None if nothing is
        sent.  ``grad`` is the minibatch gradient sum_z grad_z / B, ``sqsum``
        is sum_z (grad_z / B)**2 (or None when :attr:`needs_sqsum` is
        False)."""
        raise NotImplementedError

    def count(self, grad, sqsum, state):
        """How many elements :meth:`compress` would send now, without
        changing ``state`` (None: this rule cannot tell; a dense fallback,
        :mod:`chainer_vgc.exchange.fallback`, then needs one that can)."""
        return None

    def __repr__(self):
        args = ', '.join('{}={!r}'.format(k, v)
                         for k, v in sorted(self.hyperparams().items()))
        return '{}({})'.format(type(self).__name__, args)


def check_real(name, value, low=None, high=None, low_open=True,
               high_open=False, hint=''):
    """Return ``float(value)``; ValueError naming ``name`` and the range."""
    interval = '{}{}, {}{}'.format('(' if low_open else '[',
                                   '-inf' if low is None else low,
                                   'inf' if high is None else high,
                                   ')' if high_open or high is None else ']')
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError('{} must be a real number in {}, got {!r}{}'.format(
            name, interval, value, hint))
    v = float(value)
    bad = math.isnan(v) or math.isinf(v)
    if low is not None:
        bad = bad or (v <= low if low_open else v < low)
    if high is not None:
        bad = bad or (v >= high if high_open else v > high)
    if bad:
        raise ValueError('{} must be in {}, got {!r}{}'.format(
            name, interval, value, hint))
    return v


def check_coding(coding):
    """An ``index_coding`` argument: one of ``'auto'`` (the smaller of the
    paper's 32-bit words and gap-coded indices, per tensor and step),
    ``'fixed'`` (the paper's words only), ``'gap'`` (gap-coded only)."""
    if coding not in codec.CODINGS:
        raise ValueError('index_coding must be one of {}, got {!r}'.format(
            ', '.join(repr(c) for c in codec.CODINGS), coding))
    return coding


def check_int(name, value, low, high):
    """Return ``int(value)``; ValueError naming ``name`` and the range."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
            or not low <= value <= high):
        raise ValueError('{} must be an integer in {}..{}, got {!r}'.format(
            name, low, high, value))
    return int(value)


def accumulated(grad, sqsum, state):
    """(r + grad, v + sqsum) as new arrays in the state's dtype, the state
    unchanged (v: None without a sum of squares or a v)."""
    r = state['r']
    r = r + grad.reshape(-1).astype(r.dtype, copy=False)
    v = state.get('v')
    if v is not None and sqsum is not None:
        v = v + sqsum.reshape(-1).astype(v.dtype, copy=False)
    return r, v


def residual_state(size, dtype, xp, names):
    """Zero-filled state arrays ``names`` in the state dtype of ``dtype``."""
    sdt = arrays.state_dtype(dtype)
    return {n: xp.zeros(size, dtype=sdt) for n in names}


def float32_update(optimizer, rule):
    """Have ``optimizer`` (a Chainer optimizer, before or after its
    ``setup``) update float16 parameters in float32, with float32 master
    weights and state (Chainer's ``use_fp32_update``; other dtypes are not
    affected), unless ``rule`` sends the gradients themselves
    (:attr:`~CompressionRule.exchange` ``'allreduce'``: 'none' stays
    ChainerMN's).  The multi-node optimizer and the simulation call it.

    A compressing rule's mean is not sized like the gradient: hybrid and
    Strom send sign(r) * tau (paper Fig. "Hybrid", Sec. 4.5), so each
    element is a multiple of tau / p however large the local gradients
    are.  Chainer keeps an optimizer's state in the parameter's dtype:
    Adam's v = (1 - beta2) g**2 = 1e-3 * (0.01 / 2)**2 = 2.5e-8 (tau =
    0.01, 2 ranks) rounds to 0 in float16, below half its smallest
    subnormal 2**-24, and the step alpha_t m / (sqrt(v) + eps) is
    3.2e-4 * 5e-4 / 1e-8 = 15.8 instead of about alpha (issue 24).  To
    keep float16 updates all the same, call
    ``param.update_rule.use_fp32_update(False)`` for each parameter after
    ``setup``.
    """
    if rule.exchange != 'allreduce' and hasattr(optimizer,
                                                'use_fp32_update'):
        optimizer.use_fp32_update()


def raw_max_words(size, dtype, indexed):
    """The most words of a FMT_RAW group of a tensor of ``size`` elements
    of ``dtype`` (values in its state dtype): header, index words (unless
    dense), values; a fast path's ``max_words``."""
    value_words = arrays.state_dtype(dtype).itemsize // 4
    return codec.HEADER_WORDS + (size if indexed else 0) + size * value_words
