"""A parameter combined with minibatch data element by element: its
per-example contributions (paper Sec. 4.1, Fig. "Basic").

For ``y = f(x, s)``, an elementwise function (Chainer's ``Add``, ``Sub``,
``Mul``, ``Div``, broadcasting included; ``PReLU``'s weight) of the data x
and the parameter's operand s, each row's contribution to s is ``gy *
dy/ds`` (the other operand for a product, 1 for a sum), summed over the
axes s was broadcast along: ``L.Scale``, ``L.Bias``, a learned positional
embedding added to tokens, a per-channel scale ``x * s[None, :, None,
None]``.  The rows are the data operand's
(:func:`chainer_vgc.statistics.handlers._row_input`), and an operand
with a value for every row is no parameter's use by every example
(:func:`operand_has_no_rows`).  Where the parameter's path ended in a
broadcast, the use takes the shape the broadcast started from
(:meth:`chainer_vgc.statistics.pullback.Pullback.operand`) instead of
forming the broadcast per example.  The makers are the table's, in
:mod:`chainer_vgc.statistics.handlers`.
"""

import math

import numpy

from chainer_vgc.statistics.pullback import sum_to
from chainer_vgc.statistics.uses import _as
from chainer_vgc.statistics.uses import _Use


class BroadcastOperand(_Use):
    """A parameter's operand of an elementwise function of minibatch data
    (``y = f(x, s)``): per row, ``gy * dy/ds`` (``factor``: an array that
    broadcasts against gy, with rows or without, or None for 1) summed
    over the axes the operand was broadcast along
    (:func:`~chainer_vgc.statistics.pullback.sum_to`) to its shape
    ``shape``.  ``aligned``: the operand's axes against gy's after the
    row axis, when they are not numpy's alignment from the right (PReLU's
    weight runs from axis 1).  An operand with a value for every row is
    refused before the backward pass (:func:`operand_has_no_rows`)."""

    def __init__(self, xp, dtype, gy, factor, shape, aligned=None):
        super(BroadcastOperand, self).__init__(xp, dtype)
        self.gy = _as(gy, dtype)
        self.factor = None if factor is None else _as(factor, dtype)
        self.shape = tuple(shape)
        if aligned is None:  # numpy's: from the right, rows first
            aligned = ((1,) * (gy.ndim - len(self.shape)) + self.shape)[1:]
        self.aligned = tuple(aligned)
        self.rows = gy.shape[0]
        self.row_bytes = (2 * gy[0].size + math.prod(self.shape)) * \
            dtype.itemsize

    def per_example(self, r0, r1):
        g = self.gy[r0:r1]
        f = self.factor
        if f is not None:
            g = g * (f[r0:r1] if f.ndim == g.ndim and f.shape[0] ==
                     self.rows else f)
        return sum_to(self.xp, g, self.aligned).reshape((r1 - r0,) +
                                                        self.shape)


def _operand_shape(fn, k, operand):
    """The shape a broadcasting use reduces to: ``operand`` where the
    parameter's path ended in a broadcast (folded into the use: see
    :meth:`~chainer_vgc.statistics.pullback.Pullback.wrap`), else the
    input's own."""
    return tuple(operand) if operand is not None else tuple(
        fn.inputs[k].shape)


def _binary(derivative):
    """The makers of inputs 0 and 1 of an elementwise binary function
    ``y = f(x0, x1)``: ``derivative(k, x0, x1)`` is dy/dx_k (None: 1)."""
    def maker(k):
        def make(fn, in_data, gy, dtype, xp, operand=None):
            # (the inputs a derivative reads are those the function
            # retains; Add and Sub retain none)
            x0, x1 = (None if a is None else _as(a, dtype)
                      for a in in_data[:2])
            return BroadcastOperand(xp, dtype, gy, derivative(k, x0, x1),
                                    _operand_shape(fn, k, operand))
        return make
    return {0: maker(0), 1: maker(1)}


ADD = _binary(lambda k, x0, x1: None)
SUB = _binary(lambda k, x0, x1: None if k == 0 else -1.0)
MUL = _binary(lambda k, x0, x1: x1 if k == 0 else x0)
DIV = _binary(lambda k, x0, x1: 1 / x1 if k == 0 else -x0 / (x1 * x1))


def prelu_weight(fn, in_data, gy, dtype, xp):
    """``F.prelu(x, W)``: y = x where x >= 0, W x elsewhere (W along the
    axes after the first); dy/dW = x where x < 0."""
    x, w = in_data[0], in_data[1]
    x = _as(x, dtype)
    factor = xp.where(x < 0, x, x.dtype.type(0))
    aligned = tuple(w.shape) + (1,) * (x.ndim - w.ndim - 1)
    return BroadcastOperand(xp, dtype, gy, factor, w.shape, aligned)


def operand_has_no_rows(fn, k, operand=None):
    """Whether the parameter's operand, input k of fn (of the shape
    :func:`_operand_shape` gives; numpy's alignment from the right against
    fn's output), is broadcast along the rows: otherwise it has a value
    of its own for every row, which no example shares."""
    shape = _operand_shape(fn, k, operand)
    out = fn.outputs[0]()
    if out is None or len(shape) > len(out.shape):
        return False
    aligned = (1,) * (len(out.shape) - len(shape)) + tuple(shape)
    return len(aligned) == 0 or aligned[0] == 1 or out.shape[0] == 1
