"""Brute force: the exact sums by one backward pass per example, and when
is that exact?

The reference for the per-sample statistics s = sum_z (grad_z / B)**2
(paper Sec. 4.1), and the generic fallback for parameters no handler of
:mod:`chainer_vgc.statistics.handlers` covers (``uncovered='bruteforce'``;
slow, which is why the paper, Sec. 5, wants the per-sample gradients from
the one ordinary backward pass).  The loss may have any scaling (mean, sum,
times a loss scale, ``backward(loss_scale=...)``): it must be
``c * sum_z loss_fn(example z)`` for one unknown constant c, which is
inferred and checked (:func:`_loss_scaling`).  Models whose per-example
passes cannot reproduce the batch pass are refused: batch normalization in
training mode, active dropout and other random-noise functions.  The
per-example passes report nothing to the current reporter.
"""

import contextlib
import math

import chainer
from chainer import backend as chainer_backend
from chainer.functions.noise import dropout as _dropout
from chainer.functions.noise import gaussian as _gaussian
from chainer.functions.noise import simplified_dropconnect as _dropconnect
from chainer.functions.noise import zoneout as _zoneout
from chainer.functions.normalization import batch_normalization as _bn
import numpy

from chainer_vgc.backends import arrays
from chainer_vgc.statistics.graph import _functions_of


def bruteforce_sqsum(loss_fn, params, *batch):
    """Exact sum_z (grad_z f / B)**2 by per-example backward passes.

    The reference, and the generic fallback.  The model must not couple
    examples (no batch normalization in training mode) and must be
    deterministic: active dropout (and the other random-noise functions of
    ``chainer.functions.noise``) in a per-example pass raises ValueError.
    Gradients are taken with ``chainer.grad``, so no parameter's ``.grad``
    is touched; whatever ``loss_fn`` reports (``chainer.report``) is
    discarded.

    Args:
        loss_fn: ``loss_fn(*arrays)`` -> scalar Variable, the *mean* loss of
            the examples given.
        params: the :class:`chainer.Parameter` objects to report.
        batch: arrays whose first axis is the batch (B examples).

    Returns:
        list of arrays (None for a parameter that gets no gradient), in the
        state dtype.
    """
    n = len(batch[0])
    if n == 0:
        raise ValueError('bruteforce_sqsum: empty batch')
    passes = _per_example_passes(loss_fn, list(params), batch)
    scale = 1.0 / (n * n)
    return [None if a is None else a * a.dtype.type(scale)
            for a in passes.sqsum]


def _uncovered_sqsums(params, listing, functions, loss_fn, batch, loss,
                      loss_scale):
    """The sums of ``params`` (the uncovered parameters of a batch loss
    ``loss`` whose graph has the function nodes ``functions``), for
    :meth:`PerSampleSquares.backward`: per-example passes of ``loss_fn``,
    scaled by the inferred c**2.  ``listing`` names the parameters in the
    error messages."""
    if loss_fn is None or not len(batch):
        raise ValueError(
            "uncovered='bruteforce' needs loss_fn and batch to recompute "
            'per-example losses for: ' + listing)
    coupled = sorted({type(fn).__name__ for fn in functions
                      if isinstance(fn, _bn.BatchNormalization)})
    if coupled:
        raise ValueError(
            "uncovered='bruteforce' recomputes each example alone, which "
            'is not exact with {} in training mode (it couples the '
            'examples); uncovered parameters: {}'.format(
                ', '.join(coupled), listing))
    noise = _random_functions(functions)
    if noise:
        raise ValueError(
            "uncovered='bruteforce' recomputes each example in a separate "
            'forward pass, which is not exact with {} active: it draws '
            'new random numbers (dropout masks) in every pass, unlike the '
            'batch pass. Compute the statistics with the noise off (e.g. '
            "build the loss under chainer.using_config('train', False), "
            'or a dropout ratio of 0), or use only layers '
            'PerSampleSquares covers for these parameters; uncovered '
            'parameters: '
            '{}'.format(', '.join(noise), listing))
    seed = _batch_seed(loss, loss_scale)
    batch_grads = chainer.grad(
        [loss], params, grad_outputs=[chainer.Variable(
            seed, requires_grad=False)])
    batch_grads = [None if g is None else g.array.astype(numpy.float64)
                   for g in batch_grads]
    loss_value = float((loss.array.astype(numpy.float64)
                        * seed.astype(numpy.float64)).sum())
    passes = _per_example_passes(loss_fn, params, batch)
    eps = max([numpy.finfo(loss.dtype).eps]
              + [numpy.finfo(p.dtype).eps for p in params]
              + [numpy.finfo(a.dtype).eps for a in batch
                 if getattr(a, 'dtype', numpy.dtype(int)).kind == 'f'])
    c = _loss_scaling(loss_value, batch_grads, passes, float(eps), listing)
    return [None if a is None else a * a.dtype.type(c * c)
            for a in passes.sqsum]


class _Passes(object):
    """What the per-example passes give, g_z = grad of loss_fn(example z):
    ``sqsum[k]`` sum_z g_z**2 (state dtype, None if no example has a
    gradient), ``total[k]`` sum_z g_z (float64), ``norm_sum`` sum_z
    ||g_z|| over all the parameters, ``values`` the losses loss_fn(example
    z)."""

    def __init__(self, n_params):
        self.sqsum = [None] * n_params
        self.total = [None] * n_params
        self.norm_sum = 0.0
        self.values = []


def _per_example_passes(loss_fn, params, batch):
    n = len(batch[0])
    out = _Passes(len(params))
    with _reports_discarded():
        for z in range(n):
            loss = loss_fn(*[a[z:z + 1] for a in batch])
            noise = _random_functions(_functions_of(loss))
            if noise:
                raise ValueError(
                    'brute force: the per-example loss uses {}, which '
                    'draws new random numbers in every pass, so the '
                    'per-example passes do not reproduce the batch pass; '
                    'turn the noise off (dropout, zoneout, dropconnect: '
                    "chainer.using_config('train', False); gaussian: pass "
                    'eps=)'.format(', '.join(noise)))
            out.values.append(float(loss.array.astype(numpy.float64).sum()))
            grads = chainer.grad([loss], params)
            norm2 = 0.0
            for k, (p, g) in enumerate(zip(params, grads)):
                if g is None:
                    continue
                g = g.array.astype(arrays.state_dtype(p.dtype))
                gg = g * g
                norm2 += float(gg.sum(dtype=numpy.float64))
                out.sqsum[k] = gg if out.sqsum[k] is None else \
                    out.sqsum[k] + gg
                g64 = g.astype(numpy.float64)
                out.total[k] = g64 if out.total[k] is None else \
                    out.total[k] + g64
            out.norm_sum += math.sqrt(norm2)
    return out


@contextlib.contextmanager
def _reports_discarded():
    """Make ``chainer.report`` write to a throwaway dict: the current
    reporter (observers stay registered) with a fresh observation."""
    try:
        current = chainer.get_current_reporter()
    except IndexError:  # no reporter: chainer.report does nothing
        current = None
    if current is None:
        yield
    else:
        with current.scope({}):
            yield


_RANDOM = (_dropout.Dropout, _gaussian.Gaussian, _zoneout.Zoneout,
           _dropconnect.SimplifiedDropconnect)


def _random_functions(functions):
    """Sorted names of the function nodes that drew random numbers (only
    present in a graph when active: e.g. F.dropout adds no node when
    ``chainer.config.train`` is False).  Dropout with ratio 0 is exact."""
    names = set()
    for fn in functions:
        if not isinstance(fn, _RANDOM):
            continue
        if isinstance(fn, _dropout.Dropout) and fn.dropout_ratio == 0:
            continue
        names.add(type(fn).__name__)
    return sorted(names)


def _batch_seed(loss, loss_scale):
    """The initial gradient ``loss.backward(loss_scale=...)`` starts from
    (as Variable.backward forms it)."""
    if loss.grad is not None:
        return loss.grad
    xp = chainer_backend.get_array_module(loss.array)
    seed = xp.ones_like(loss.array)
    if loss_scale is not None and loss.array.size == 1:
        seed *= loss_scale
    return seed


def _dot(a, b):
    return float((a * b).sum())


def _loss_scaling(loss_value, batch_grads, passes, eps, listing):
    """c such that the batch loss is c * sum_z v_z and the batch gradient
    is c * sum_z grad v_z (v_z = loss_fn(example z)).

    c is read from the better conditioned of the two equations (the losses
    when the per-example gradients cancel, the gradients when the losses
    do), then both are checked up to rounding (``tol`` relative to the
    magnitude of the terms summed)."""
    tol = 10 * math.sqrt(eps)
    total = passes.total
    g_norm = math.sqrt(sum(_dot(g, g) for g in batch_grads if g is not None))
    s_norm = math.sqrt(sum(_dot(t, t) for t in total if t is not None))
    v_sum = math.fsum(passes.values)
    v_abs = math.fsum(abs(v) for v in passes.values)

    def fail(why):
        return ValueError(
            "uncovered='bruteforce' assumes the loss is c * sum_z "
            'loss_fn(example z) for one constant c (a mean, a sum, times a '
            'loss scale) and that loss_fn(*batch) is the loss given; {}. '
            'Uncovered parameters: {}'.format(why, listing))

    if passes.norm_sum == 0:  # no example has a gradient: s = 0 for any c
        if g_norm > 0:
            raise fail('the per-example gradients are all zero but the '
                       'batch gradient is not')
        return 1.0
    candidates = []
    if s_norm > 0:
        gs = math.fsum(_dot(g, t) for g, t in zip(batch_grads, total)
                       if g is not None and t is not None)
        candidates.append((passes.norm_sum / s_norm, gs / s_norm ** 2))
    if v_sum != 0:
        candidates.append((v_abs / abs(v_sum), loss_value / v_sum))
    if not candidates or min(candidates)[0] * eps > tol:
        raise fail('the per-example losses and the per-example gradients '
                   'both sum to (nearly) zero, so c cannot be inferred')
    c = min(candidates)[1]
    res2 = 0.0
    for g, t in zip(batch_grads, total):
        if g is None and t is None:
            continue
        d = (g if g is not None else 0) - c * (t if t is not None else 0)
        res2 += _dot(d, d)
    scale = g_norm + abs(c) * passes.norm_sum
    if math.sqrt(res2) > tol * scale:
        raise fail('the batch gradient differs from c * (sum of the '
                   'per-example gradients) beyond rounding (c = {:.6g}, '
                   'difference {:.3g} of the gradients\' magnitude, '
                   'tolerance {:.3g})'.format(c, math.sqrt(res2) / scale,
                                              tol))
    if abs(loss_value - c * v_sum) > tol * (abs(loss_value)
                                            + abs(c) * v_abs):
        raise fail('the loss {:.6g} differs from c * (sum of the '
                   'per-example losses {:.6g}) with c = {:.6g} from the '
                   'gradients'.format(loss_value, v_sum, c))
    return c
