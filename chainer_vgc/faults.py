"""A step's faults: what the workers agree on before any state changes.

The question this module answers: what happens when some worker's gradients
are not finite, or its accumulated residual overflows?  Every worker checks
its inputs and sends one fault code (:data:`OK`, :data:`NONFINITE`,
:data:`OVERFLOW`) in one small allgather before any residual changes
(:meth:`GradientCompressor.compress
<chainer_vgc.compressor.GradientCompressor.compress>`'s ``agree``);
:func:`settle` turns every worker's code into the same decision on every
rank: go on, skip the step everywhere (:class:`SkippedStep`: the residuals
of paper Alg. 1 stay as they were), or fail with an error that says what
to do.
"""

import numpy


#: fault codes exchanged by :meth:`GradientCompressor.compress`'s ``agree``
OK, NONFINITE, OVERFLOW = 0, 1, 2


class SkippedStep(Exception):
    """Some worker's gradients held NaN or Inf: no worker compressed this
    step, every residual state is as it was.  ``ranks``: the workers whose
    gradients were not finite."""

    def __init__(self, message, ranks):
        super(SkippedStep, self).__init__(message)
        self.ranks = ranks


class DenseStep(Exception):
    """Every rank's counts predict the compressed exchange slower than
    a dense allreduce (:mod:`chainer_vgc.exchange.fallback`): raised at the first
    agreement, before any state moves; the step is sent dense.
    ``choice``: the prediction."""

    def __init__(self, choice):
        super(DenseStep, self).__init__('sent dense: {}'.format(choice))
        self.choice = choice


class InputFault(FloatingPointError):
    """A NaN/Inf gradient or sum of squares (not an overflow)."""


def settle(codes, error):
    """Act on every worker's fault codes: continue, skip, or fail."""
    codes = list(codes)
    # a non-finite gradient anywhere skips the step on every rank (no state
    # was committed), even where another rank's residual overflowed
    worst = NONFINITE if NONFINITE in codes else max(codes or [OK])
    if worst == OK:
        return
    bad = [r for r, c in enumerate(codes) if c == worst]
    if worst == NONFINITE:
        raise SkippedStep(
            'chainer_vgc: gradients of rank(s) {} hold NaN or Inf ({}); this '
            'step is skipped on every rank and no residual changed'.format(
                bad, error if error is not None else 'not this rank'), bad)
    if error is not None and not isinstance(error, InputFault):
        raise error
    raise FloatingPointError(
        'chainer_vgc: the accumulated residual state of rank(s) {} '
        'overflowed; scale the loss down'.format(bad))


def bad_gradient(name):
    return InputFault(
        'gradient of parameter {!r} contains NaN or Inf; nothing was '
        'compressed and the residual state is unchanged'.format(name))


def bad_sqsum(name):
    return InputFault(
        'per-sample sum of squares of parameter {!r} contains NaN, Inf or '
        'negative values; the residual state is unchanged'.format(name))


def overflow(key, name, dtype, unchanged=False):
    return FloatingPointError(
        'the accumulated {} of parameter {!r} overflowed {} (finite '
        'gradients too large to sum); scale the loss down{}'.format(
            key, name, numpy.dtype(dtype),
            '; the residual state is unchanged' if unchanged else ''))


def all_finite(a):
    """No NaN/Inf in ``a``, without a temporary of its size.

    A finite sum of squares (one BLAS dot) proves it; otherwise (a NaN, an
    infinity, or finite values whose squares overflow) min and max decide:
    NaN makes both NaN and an infinity shows up in one of them.
    """
    if a.size == 0:
        return True
    flat = a.reshape(-1)
    if a.dtype in (numpy.float32, numpy.float64):
        with numpy.errstate(over='ignore', invalid='ignore'):
            if numpy.isfinite(flat.dot(flat)):
                return True
    return bool(numpy.isfinite(float(a.min())) and
                numpy.isfinite(float(a.max())))
