"""Between a parameter and its use: the chain rule, per example (paper
Sec. 4.1's per-sample gradients, for parameters a model transforms before
using them).

A parameter often reaches the function that computes with it through
functions of itself and constants: a pruning mask (``W * mask``), a
constant factor, a cast, a reshape, an index (``scale[None, :, None,
None]``), a broadcast, or a user's elementwise ``FunctionNode`` (a
binarized weight).  If Q is what the parameter P became, example z's
contribution to P is the transpose of dQ/dP applied to its contribution
to Q.  A :class:`Pullback` is that path, one :class:`Step` per function
(``fn`` and the parameter's input index ``k``); :func:`step_of` says which
functions it follows:

* ``Reshape``, ``ExpandDims``, ``Squeeze``: reshape back;
* ``Transpose``: the inverse permutation;
* ``BroadcastTo``: the sum over the broadcast axes;
* ``GetItem`` (basic and advanced indices): scattered back into P's
  shape, repeated indices added;
* ``Cast``: nothing (the sums are in the state dtype);
* ``Stack`` and ``Concat`` of parameters: the parameter's slice;
* an elementwise function (Chainer's ``is_elementwise``: arithmetic with
  constants, ``MulConstant``, ``Neg``, ``PowVarConst``, ...; or a user's
  node that sets it) of the parameter, its output of P's shape, every
  other input a constant: times the derivative, which is the function's
  own backward of ones (one vector-Jacobian product a step: exact, since
  an elementwise function's Jacobian is diagonal).

Contributions go through the steps for a chunk of examples at a time,
``(n,) + shape``.  The factors a step needs (the mask, the derivative) are
read once, when the use is seen in the backward pass (:meth:`Pullback.
bind`), while the function still holds its inputs.
"""

import math

import chainer
from chainer.functions.array import broadcast as _broadcast
from chainer.functions.array import cast as _cast
from chainer.functions.array import concat as _concat
from chainer.functions.array import expand_dims as _expand_dims
from chainer.functions.array import get_item as _get_item
from chainer.functions.array import reshape as _reshape
from chainer.functions.array import squeeze as _squeeze
from chainer.functions.array import stack as _stack
from chainer.functions.array import transpose as _transpose
import numpy

from chainer_vgc.statistics.uses import _Use

_RESHAPING = (_reshape.Reshape, _expand_dims.ExpandDims, _squeeze.Squeeze)


def step_of(fn, k, constant):
    """The kind of :class:`Step` that follows input k of function node
    ``fn`` back to that input, or None (``fn`` is the parameter's use, or
    is not followed).  ``constant(node)``: whether a variable node is a
    constant (neither a parameter nor computed from the minibatch)."""
    out = fn.outputs[0]() if fn.outputs else None
    if out is None or len(fn.outputs) != 1:
        return None
    if isinstance(fn, _RESHAPING):
        return 'reshape'
    if isinstance(fn, _transpose.Transpose):
        return 'transpose'
    if isinstance(fn, _broadcast.BroadcastTo):
        return 'broadcast'
    if isinstance(fn, _get_item.GetItem):
        return 'index'
    if isinstance(fn, _cast.Cast):
        return 'cast'
    if isinstance(fn, (_stack.Stack, _concat.Concat)):
        return 'slice'
    if getattr(fn, 'is_elementwise', False) and \
            tuple(fn.inputs[k].shape) == tuple(out.shape) and all(
                constant(node) for j, node in enumerate(fn.inputs)
                if j != k):
        return 'elementwise'
    return None


class Step(object):
    """One function between the parameter and its use: ``fn``, the
    parameter's input ``k`` and the :func:`step_of` kind; ``in_shape``
    and ``out_shape`` of that input and of the output."""

    def __init__(self, fn, k, kind):
        self.fn, self.k, self.kind = fn, k, kind
        self.in_shape = tuple(fn.inputs[k].shape)
        self.out_shape = tuple(fn.outputs[0]().shape)

    def describe(self):
        return type(self.fn).__name__

    def bind(self, xp, dtype):
        """The step as a function of a chunk of contributions ``(n,) +
        out_shape`` to ``(n,) + in_shape``, its factors read now."""
        fn, k, ins, outs = self.fn, self.k, self.in_shape, self.out_shape
        if self.kind in ('reshape', 'cast'):
            return lambda c: c.reshape((c.shape[0],) + ins)
        if self.kind == 'transpose':
            axes = tuple(a % len(ins) for a in fn.axes) \
                if fn.axes is not None else tuple(reversed(range(len(ins))))
            back = numpy.argsort(axes)
            return lambda c: c.transpose((0,) + tuple(int(a) + 1
                                                      for a in back))
        if self.kind == 'broadcast':
            return lambda c: sum_to(xp, c, ins)
        if self.kind == 'index':
            slices = fn.slices if isinstance(fn.slices, tuple) else (
                fn.slices,)
            if all(_basic(s) for s in slices):
                def place(c):
                    # a view, each element once: written for all examples
                    out = xp.zeros((c.shape[0],) + ins, c.dtype)
                    out[(slice(None),) + slices] = c
                    return out
                return place

            def scatter(c):
                # one example at a time: its contribution has the shape
                # of the index's result, whatever numpy does with the
                # axes of advanced indices (split ones go first)
                out = xp.zeros((c.shape[0],) + ins, c.dtype)
                for z in range(c.shape[0]):
                    _add_at(xp, out[z], slices, c[z])
                return out
            return scatter
        if self.kind == 'slice':
            return self._slice()
        # elementwise: the derivative, the function's backward of ones
        ones = xp.ones(outs, dtype=fn.inputs[k].dtype)
        with chainer.no_backprop_mode():
            grads = fn.backward((k,), (chainer.Variable(ones),))
        if grads[0] is None:  # no gradient reaches the parameter here
            return lambda c: xp.zeros((c.shape[0],) + ins, c.dtype)
        d = grads[0].array.astype(dtype, copy=False)
        return lambda c: c * d

    def _slice(self):
        fn, k = self.fn, self.k
        axis = fn.axis % len(self.out_shape)
        if isinstance(fn, _stack.Stack):
            return lambda c: c.take(k, axis=axis + 1)
        sizes = [node.shape[axis] for node in fn.inputs]
        lo = sum(sizes[:k])
        index = (slice(None),) * (axis + 1) + (slice(lo, lo + sizes[k]),)
        return lambda c: c[index]


class Pullback(object):
    """The path from a parameter to its use (``steps``, the parameter's
    end first).  Like :class:`~chainer_vgc.statistics.graph.Selection`,
    what a use records about the way there; :meth:`wrap` makes the use's
    contributions the parameter's."""

    #: (a use through a pullback is covered when its own function is)
    covered = True

    def __init__(self, steps):
        self.steps = list(steps)

    @property
    def path(self):
        return [s.describe() for s in self.steps]

    def describe(self, fn):
        return ' -> '.join(self.path + [type(fn).__name__])

    def _kept(self, broadcasting):
        """The steps a use carries back: all of them, or for a use that
        reduces to the shape a broadcast started from (``broadcasting``),
        those before the path's last broadcasts."""
        steps = self.steps
        while broadcasting and steps and steps[-1].kind == 'broadcast':
            steps = steps[:-1]
        return steps

    def operand(self, broadcasting):
        """The shape of what the use reduces to: the input's own (None)
        or, for a broadcasting use, that of the broadcasts' start."""
        kept = self._kept(broadcasting)
        if len(kept) == len(self.steps):
            return None
        return kept[-1].out_shape if kept else self.steps[0].in_shape

    def wrap(self, use, xp, dtype, broadcasting=False):
        """``use`` (a :class:`~chainer_vgc.statistics.uses._Use` of what
        the parameter became; for a broadcasting use, of the
        :meth:`operand`) as a use of the parameter."""
        kept = self._kept(broadcasting)
        if not kept:
            return use
        return PulledBack(use, [s.bind(xp, dtype) for s in reversed(kept)],
                          kept[0].in_shape)


def sum_to(xp, c, shape):
    """``c``, a chunk ``(n,) + broadcast shape``, summed over the axes a
    broadcast from ``shape`` added or stretched (numpy's alignment: from
    the right), to ``(n,) + shape``."""
    lead = c.ndim - 1 - len(shape)
    axes = tuple(range(1, 1 + lead)) + tuple(
        1 + lead + i for i, s in enumerate(shape)
        if s == 1 and c.shape[1 + lead + i] != 1)
    if axes:
        c = c.sum(axis=axes, keepdims=True)
    return c.reshape((c.shape[0],) + tuple(shape))


def _basic(entry):
    """Whether an index entry is basic indexing (a view: an int, a slice,
    None or Ellipsis), not an advanced one (an array, a list, a bool)."""
    return (entry is None or entry is Ellipsis or isinstance(entry, slice)
            or (isinstance(entry, (int, numpy.integer))
                and not isinstance(entry, (bool, numpy.bool_))))


def _add_at(xp, out, index, values):
    """out[index] += values, repeated indices added (``numpy.add.at``;
    ``cupyx.scatter_add`` on the GPU)."""
    if xp is numpy:
        numpy.add.at(out, index, values)
    else:  # pragma: no cover - GPU only
        import cupyx
        cupyx.scatter_add(out, index, values)


class PulledBack(_Use):
    """A use's contributions carried back to the parameter: the use's
    own (``inner``), then each bound step, the use's end first.  Summed
    by the readable definition (:meth:`~chainer_vgc.statistics.uses._Use.
    reference_sqsum`): the steps change the shapes the products'
    shortcuts rely on."""

    def __init__(self, inner, steps, shape):
        super(PulledBack, self).__init__(inner.xp, inner.dtype)
        self.inner, self.steps, self.shape = inner, steps, shape
        self.rows = inner.rows
        self.row_bytes = inner.row_bytes + math.prod(
            shape) * self.dtype.itemsize

    def per_example(self, r0, r1):
        c = self.inner.per_example(r0, r1)
        for step in self.steps:
            c = step(c)
        return c
