"""Which rule runs, and which parameters it compresses.

The question this module answers: given a method and the controls
(``exclude``, ``min_size``, ``warmup``, ``alpha_ramp``, ``dense_dtype``),
which rule runs, are the settings valid, and which of a model's parameters
go to the dense group (exchanged uncompressed, as ChainerMN's allreduce)
rather than to the rule?  :class:`~chainer_vgc.chainermn.communicator.VGCCommunicator`
and the one-process :class:`~chainer_vgc.harness.simulation.SimulatedWorkers` make
and check their settings here, the same way; nothing here needs MPI.
"""

import inspect
import numbers

import numpy

from chainer_vgc.rules import CompressionRule
from chainer_vgc.rules import RULES
from chainer_vgc.rules import create_rule
from chainer_vgc.statistics import model_params


def dense_group(model, rule, exclude=(), min_size=0, also=()):
    """Names of ``model``'s initialized parameters exchanged densely: all
    of them for a rule whose ``exchange`` is ``'allreduce'`` (``none``),
    else those named in ``exclude`` or selected by its predicates
    ``f(name, param)``, those of fewer than ``min_size`` elements, those
    the rule keeps dense (:meth:`~chainer_vgc.rules.CompressionRule.
    keeps_dense`: DGC's and PowerSGD's vectors), and the names in
    ``also``.  An unknown name in ``exclude`` raises ValueError."""
    all_names, all_params = model_params(model)
    if rule.exchange == 'allreduce':
        return {n for n, p in zip(all_names, all_params)
                if p.array is not None}
    known = set(all_names)
    unknown = sorted(n for n in exclude if isinstance(n, str)
                     and n not in known)
    if unknown:
        raise ValueError(
            'exclude: the model has no parameter named {}; its parameters '
            'are {}'.format(unknown, sorted(known)))
    tests = [f for f in exclude if callable(f)]
    names = {n for n in exclude if isinstance(n, str)} | set(also)
    return {n for n, p in zip(all_names, all_params)
            if p.array is not None and (
                n in names or p.size < min_size or
                rule.keeps_dense(p.shape) or
                any(f(n, p) for f in tests))}


def make_rule(method, hyperparams):
    """The rule a communicator runs: made from a name, or a rule object
    checked for what the communicator calls."""
    if isinstance(method, str):
        return create_rule(method, **hyperparams)
    if hyperparams:
        raise ValueError('method: hyperparameters {} given with a rule '
                         'object; set them on the rule'.format(
                             sorted(hyperparams)))
    if not isinstance(method, CompressionRule):
        raise TypeError(
            'method must be a rule name ({}) or a '
            'chainer_vgc.rules.CompressionRule object, got {!r}'.format(
                ', '.join(sorted(RULES)), method))
    needs = ('reduce',) if method.exchange == 'allreduce_factors' else \
        ('compress',)
    missing = [m for m in needs
               if getattr(type(method), m) is getattr(CompressionRule, m)]
    init = type(method).__init__
    takes = [] if init is object.__init__ else [
        n for n in inspect.signature(init).parameters if n != 'self']
    if takes and not method.hyperparameters:
        missing.append('hyperparameters (the names of its settings, '
                       'e.g. hyperparameters = {!r})'.format(tuple(takes)))
    if not isinstance(method.name, str) or not method.name:
        missing.insert(0, 'name (a string)')
    if method.exchange not in ('allgatherv', 'allreduce',
                               'allreduce_factors'):
        missing.append("exchange ('allgatherv', 'allreduce' or "
                       "'allreduce_factors')")
    if missing:
        raise TypeError('method: the rule object {!r} does not define {}; '
                        'see chainer_vgc.rules.CompressionRule'.format(
                            method, ', '.join(missing)))
    return method


def check_exclude(exclude):
    """``exclude`` as a tuple of names and predicates."""
    if exclude is None:
        return ()
    if isinstance(exclude, str) or callable(exclude):
        exclude = [exclude]
    try:
        items = tuple(exclude)
    except TypeError:
        raise TypeError('exclude must be parameter names and/or predicates '
                        'f(name, param) -> bool, got {!r}'.format(exclude))
    for item in items:
        if not (isinstance(item, str) or callable(item)):
            raise TypeError('exclude: {!r} is neither a parameter name nor a '
                            'predicate f(name, param) -> bool'.format(item))
    return items


def check_count(name, value):
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
            or value < 0):
        raise ValueError('{} must be an integer >= 0, got {!r}'.format(
            name, value))
    return int(value)


def check_ramp(ramp, rule):
    if ramp is None:
        return None
    try:
        alpha0, steps = ramp
        alpha0 = float(alpha0)
    except (TypeError, ValueError):
        raise ValueError('alpha_ramp must be (alpha0, steps), got {!r}'
                         .format(ramp))
    if not hasattr(rule, 'alpha'):
        raise ValueError('alpha_ramp: method {!r} has no alpha'.format(
            rule.name))
    if not alpha0 > 0:
        raise ValueError('alpha_ramp: alpha0 must be > 0, got {!r}'.format(
            alpha0))
    return (alpha0, check_count('alpha_ramp steps', steps))


def check_dense_dtype(dtype):
    if dtype is None:
        return None
    try:
        dt = numpy.dtype(dtype)
    except TypeError:
        dt = None
    if dt != numpy.float16:
        raise ValueError("dense_dtype must be None (the parameters' own "
                         "dtypes) or 'float16', got {!r}".format(dtype))
    return dt
