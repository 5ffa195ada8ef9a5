"""Per-example contributions: for one function node that consumes a
parameter, what is each example's contribution to the parameter's
minibatch gradient, and the sum over the batch of its squares (paper
Sec. 4.1, Fig. "Basic")?

Each handler starts from the node's input data x and its output gradient
gy (which already carries the 1/B of a mean loss) and uses Chainer's own
primitives:

* ``Linear`` (``F.linear``, any ``n_batch_axes``): weight
  ``gy_z^T x_z``, bias ``sum gy_z``.  With one row per example the exact
  shortcut ``(gy**2)^T (x**2)`` is used;
* ``Convolution2D`` (stride, pad, dilate, groups, with/without bias): the
  per-example weight gradient contracts only the spatial axes of
  ``im2col(x_z)`` with ``gy_z`` (a batched matmul), then squares and sums
  over the batch.  ``(gy**2)^T (x**2)`` would be wrong here;
* ``Deconvolution2D``: the same with ``im2col(gy_z)`` and ``x_z``;
* normalization layers' gamma and beta (``BatchNormalization``,
  ``BatchRenormalization``, ``LayerNormalization``,
  ``GroupNormalization``, ``FixedBatchNormalization``):
  :mod:`~chainer_vgc.statistics.normalizations`;
* ``EmbedID`` (with ``ignore_label``): per example, the rows of the tokens
  it contains, combined by word id before squaring;
* a parameter combined with minibatch data element by element (with
  broadcasting: a per-channel scale ``x * s[None, :, None, None]``,
  ``L.Scale``, ``L.Bias``, a positional embedding ``x + pos[None]``,
  ``PReLU``): the output gradient times the derivative with respect to the
  parameter's operand (the other operand, for a product), summed over the
  axes the operand was broadcast along, per row; the rows are the data
  operand's (:func:`_row_input`): :mod:`~chainer_vgc.statistics.
  broadcasts`.

:data:`_HANDLERS` is the one table of what is covered, keyed by Chainer
function class: :func:`_supported` (is this use covered?) and
:func:`_uses_of` (its :class:`_Use` at backward time) both read it.  A
function whose input has ``k * B`` rows is read as B contiguous groups of
k rows (see :mod:`chainer_vgc.statistics.graph`); the contributions of
several uses of one parameter are added before squaring
(:func:`_combined_sqsum`).

Memory: per-example intermediates are formed for chunks of examples so that
each stays under ``max_memory`` bytes (at least one example per chunk).
Results do not depend on the chunk size beyond floating-point summation
order.  Everything is written with ``xp`` array calls, so the same code
runs on NumPy and CuPy arrays.
"""

import math

from chainer.functions.connection import convolution_2d as _conv
from chainer.functions.connection import deconvolution_2d as _deconv
from chainer.functions.connection import embed_id as _embed
from chainer.functions.connection import linear as _linear
from chainer import function as _function
from chainer.functions.activation import prelu as _prelu
from chainer.functions.math import basic_math as _math
from chainer.functions.normalization import batch_normalization as _bn
from chainer.functions.normalization import batch_renormalization as _brn
from chainer.functions.normalization import group_normalization as _gn
from chainer.functions.normalization import layer_normalization as _ln
from chainer.utils import conv as conv_utils
import numpy

from chainer_vgc.backends import arrays
from chainer_vgc.statistics import broadcasts
from chainer_vgc.statistics import contraction
from chainer_vgc.statistics import normalizations
from chainer_vgc.statistics.im2col import im2col
from chainer_vgc.statistics.uses import _as
from chainer_vgc.statistics.uses import _chunk
from chainer_vgc.statistics.uses import _SumOverPositions
from chainer_vgc.statistics.uses import _Use


class _LinearW(_Use):
    def __init__(self, xp, dtype, x, gy):
        super(_LinearW, self).__init__(xp, dtype)
        self.x, self.gy = _as(x, dtype), _as(gy, dtype)
        self.rows = x.shape[0]
        self.row_bytes = gy.shape[1] * x.shape[1] * dtype.itemsize

    def per_example(self, r0, r1):
        return self.gy[r0:r1, :, None] * self.x[r0:r1, None, :]

    def sqsum(self, group, max_memory, out=None, work=None):
        if group > 1:
            fast = self._one_block(group, max_memory, out, work)
            if fast is not None:
                return fast
            return super(_LinearW, self).sqsum(group, max_memory, out, work)
        # one row per example: (gy_z x_z^T)**2 = gy_z**2 (x_z**2)^T exactly
        # (the Gram formulation of one position, without its generality)
        xp, work = self.xp, work or contraction.Workspace()
        step = _chunk(max_memory, (self.x.shape[1] + self.gy.shape[1])
                      * self.dtype.itemsize)
        if out is None:
            out = xp.empty((self.gy.shape[1], self.x.shape[1]), self.dtype)
        for r0 in range(0, self.rows, step):
            gy, x = self.gy[r0:r0 + step], self.x[r0:r0 + step]
            gy2 = work.get(xp, 'gy2', gy.shape, self.dtype)
            x2 = work.get(xp, 'x2', x.shape, self.dtype)
            xp.multiply(gy, gy, out=gy2)
            xp.multiply(x, x, out=x2)
            contraction.accumulate(xp, out, r0 == 0, work,
                                   lambda dst: xp.dot(gy2.T, x2, out=dst))
        return out

    def _one_block(self, group, max_memory, out, work):
        """The blocked formulation of :func:`~chainer_vgc.statistics.
        contraction.sum_squared_products` where it is one batched matmul
        and one square-sum (CPU; every example's product fits one block
        and the operands one chunk), without its general loops: the same
        calls on the same views, so the same bits (tested).  Rows of
        examples of many tokens and small weights (a Transformer's
        projections: 64 x 64, 10 tokens, 16 examples) spend more time in
        those loops than in the products.  None where it does not apply."""
        xp, dtype = self.xp, self.dtype
        b, (m, n) = self.rows // group, (self.gy.shape[1], self.x.shape[1])
        if (xp is not numpy or contraction.uses_gram(xp, group) or
                b * m * n * dtype.itemsize > min(contraction.BLOCK_BYTES,
                                                 max_memory) or
                b * group * (m + n) * dtype.itemsize > max_memory):
            return None
        work = work if work is not None else contraction.Workspace()
        prod = work.get(xp, 'block', (b, m, n), dtype)
        xp.matmul(self.gy.reshape(b, group, m).transpose(0, 2, 1),
                  self.x.reshape(b, group, n), out=prod)
        if out is None:
            out = xp.empty((m, n), dtype)
        return contraction.sum_squares(xp, prod, out)

    def operands(self):
        """A_z = gy_z (one column per row), B_z = x_z: with one row per
        example the Gram formulation is ``(gy**2)^T (x**2)``."""
        gy, x = self.gy, self.x

        def make(r0, r1, work):
            return gy[r0:r1, None, :, None], x[r0:r1, None, None, :]

        return contraction.Operands(self.xp, self.dtype, 1, gy.shape[1],
                                    x.shape[1], 1, make,
                                    (gy.shape[1], x.shape[1]))


class _ConvW(_Use):
    """Convolution2D (``transposed=False``: im2col of x, contracted with gy)
    and Deconvolution2D (``transposed=True``: im2col of gy, contracted with
    x).  Only the spatial axes are contracted, per example."""

    def __init__(self, xp, dtype, fn, x, gy, w_shape, transposed):
        super(_ConvW, self).__init__(xp, dtype)
        self.fn, self.w_shape, self.transposed = fn, w_shape, transposed
        self.x, self.gy = _as(x, dtype), _as(gy, dtype)
        self.rows = x.shape[0]
        img, other = (gy, x) if transposed else (x, gy)
        kh, kw = w_shape[2:]
        col = img.shape[1] * kh * kw * other.shape[2] * other.shape[3]
        self.row_bytes = (col + math.prod(w_shape)
                          + other[0].size) * dtype.itemsize

    def per_example(self, r0, r1):
        fn, xp = self.fn, self.xp
        x, gy = self.x[r0:r1], self.gy[r0:r1]
        img, other = (gy, x) if self.transposed else (x, gy)
        kh, kw = self.w_shape[2:]
        kwargs = dict(cover_all=bool(fn.cover_all), dy=fn.dy, dx=fn.dx,
                      out_h=other.shape[2], out_w=other.shape[3])
        columns = (conv_utils.im2col_cpu if xp is numpy
                   else conv_utils.im2col_gpu)
        col = columns(img, kh, kw, fn.sy, fn.sx, fn.ph, fn.pw, **kwargs)
        n, groups = r1 - r0, fn.groups
        hw = other.shape[2] * other.shape[3]
        # (n, G, C_img/G * kh * kw, hw) and (n, G, C_other/G, hw)
        col = col.reshape(n, groups, -1, hw)
        oth = other.reshape(n, groups, -1, hw)
        g = xp.matmul(oth, col.transpose(0, 1, 3, 2))
        return g.reshape((n,) + tuple(self.w_shape))

    #: the columns Chainer made for this node's weight gradient, when
    #: :meth:`adopt_columns` could take them
    columns = None

    def adopt_columns(self, capture):
        """Take the im2col Chainer computed for this node from ``capture``
        (an active :class:`~chainer_vgc.statistics.im2col.ColumnCapture`)
        when it is of this image, geometry and the state dtype."""
        img, other = (self.gy, self.x) if self.transposed else (self.x,
                                                                self.gy)
        kh, kw = self.w_shape[2:]
        col = capture.take(img, self.fn, kh, kw)
        if (col is not None and col.dtype == self.dtype and col.shape ==
                img.shape[:2] + (kh, kw) + other.shape[2:]):
            self.columns = col

    def operands(self):
        """A_z = the other side's maps (G, C_other/G, h*w), B_z = the
        im2col of the image side (G, h*w, C_img/G*kh*kw), per example."""
        fn, xp = self.fn, self.xp
        img_all, other_all = ((self.gy, self.x) if self.transposed
                              else (self.x, self.gy))
        kh, kw = self.w_shape[2:]
        groups = fn.groups
        oh, ow = other_all.shape[2:]
        m_rows = other_all.shape[1] // groups
        n_cols = img_all.shape[1] // groups * kh * kw

        columns = self.columns

        def make(r0, r1, work):
            n = r1 - r0
            a = other_all[r0:r1].reshape(n, groups, m_rows, oh * ow)
            if columns is not None:
                col = columns[r0:r1]
            else:
                col = im2col(xp, img_all[r0:r1], fn, kh, kw, oh, ow, work)
            b = col.reshape(n, groups, n_cols, oh * ow).transpose(0, 1, 3, 2)
            return a, b

        return contraction.Operands(xp, self.dtype, groups, m_rows, n_cols,
                                    oh * ow, make, self.w_shape)


class _EmbedW(_Use):
    def __init__(self, xp, dtype, ids, gy, w_shape, ignore_label):
        super(_EmbedW, self).__init__(xp, dtype)
        self.ids, self.gy = ids, _as(gy, dtype)
        self.w_shape, self.ignore = w_shape, ignore_label
        self.rows = ids.shape[0]
        self.row_bytes = math.prod(w_shape) * dtype.itemsize

    def _tokens(self, r0, r1, group):
        ids = self.ids[r0:r1].reshape(r1 - r0, -1)
        gy = self.gy[r0:r1].reshape(ids.shape + (self.w_shape[1],))
        example = self.xp.repeat(self.xp.arange(r1 - r0) // group,
                                 ids.shape[1]).reshape(ids.shape)
        keep = (ids != self.ignore) if self.ignore is not None else None
        if keep is not None:
            ids, gy, example = ids[keep], gy[keep], example[keep]
        return ids.reshape(-1), gy.reshape(-1, self.w_shape[1]), \
            example.reshape(-1)

    def per_example(self, r0, r1):
        ids, gy, example = self._tokens(r0, r1, 1)
        out = self.xp.zeros((r1 - r0,) + tuple(self.w_shape), self.dtype)
        _scatter_add(self.xp, out, (example, ids), gy)
        return out

    #: its own :meth:`sqsum` is sparse; the one-hot :meth:`operands` are
    #: for a product it is combined with (a tied output projection)
    sparse = True

    def operands(self):
        """A_z = the one-hot matrix of the row's tokens (vocabulary x
        tokens; ignored tokens have no 1), B_z = their output gradients:
        the product a tied output projection ``F.linear(h, embed.W)`` has
        too, so that the two concatenate (:func:`~chainer_vgc.statistics.
        uses._combined_sqsum`)."""
        xp, (vocab, d) = self.xp, self.w_shape
        per_row = max(1, self.ids[0].size)

        def make(r0, r1, work):
            n = r1 - r0
            ids = self.ids[r0:r1].reshape(n, per_row)
            gy = self.gy[r0:r1].reshape(n, 1, per_row, d)
            a = work.get(xp, 'onehot', (n, 1, vocab, per_row), self.dtype)
            a.fill(0)
            keep = (ids != self.ignore if self.ignore is not None
                    else xp.ones(ids.shape, bool))
            row, pos = xp.nonzero(keep)
            a[row, 0, ids[row, pos], pos] = 1
            return a, gy

        return contraction.Operands(xp, self.dtype, 1, vocab, d, per_row,
                                    make, self.w_shape)

    def sqsum(self, group, max_memory, out=None, work=None):
        # sparse: combine each example's tokens by word id, square, scatter
        xp = self.xp
        per_token = (self.gy[0].size // max(1, self.ids[0].size) + 2) * 8
        tokens_per_row = max(1, self.ids[0].size)
        step = _chunk(max_memory, per_token * tokens_per_row * group) * group
        if out is None:
            acc = xp.zeros(self.w_shape, self.dtype)
        else:
            acc = out
            acc.fill(0)
        for r0 in range(0, self.rows, step):
            r1 = min(self.rows, r0 + step)
            ids, gy, example = self._tokens(r0, r1, group)
            if ids.size == 0:
                continue
            key = example.astype(numpy.int64) * self.w_shape[0] + ids
            uniq, inverse = xp.unique(key, return_inverse=True)
            summed = xp.zeros((uniq.size, self.w_shape[1]), self.dtype)
            _scatter_add(xp, summed, inverse.reshape(-1), gy)
            _scatter_add(xp, acc, uniq % self.w_shape[0], summed * summed)
        return acc


def _scatter_add(xp, out, index, values):
    """out[index] += values, repeated indices summed.  On the GPU
    ``cupyx.scatter_add`` adds with atomics in no fixed order, so EmbedID
    statistics may differ in their last bits from run to run there (they
    are deterministic on the CPU)."""
    if xp is numpy:
        numpy.add.at(out, index, values)
    else:  # pragma: no cover - GPU only
        import cupyx
        cupyx.scatter_add(out, index, values)


# ---- the table --------------------------------------------------------------
# Each maker builds the _Use of one input of a function node from the node,
# its input data, its output gradient gy, the state dtype and xp.

def _linear_weight(fn, in_data, gy, dtype, xp):
    return _LinearW(xp, dtype, in_data[0], gy)


def _linear_bias(fn, in_data, gy, dtype, xp):
    return _SumOverPositions(xp, dtype, gy, ())


def _conv_weight(fn, in_data, gy, dtype, xp):
    return _ConvW(xp, dtype, fn, in_data[0], gy, in_data[1].shape,
                  transposed=isinstance(fn, _deconv.Deconvolution2DFunction))


def _conv_bias(fn, in_data, gy, dtype, xp):
    return _SumOverPositions(xp, dtype, gy, (2, 3))


def _embed_weight(fn, in_data, gy, dtype, xp):
    return _EmbedW(xp, dtype, in_data[0], gy, fn._w_shape, fn.ignore_label)


def _always(fn):
    return True


def _other_operand(fn, k):
    return 1 - k


def _first_input(fn, k):
    return 0


class _Handler(object):
    """How one Chainer function class is covered: ``makers`` maps the
    index k of a parameter input (1: W or gamma, 2: b or beta) to its
    maker; ``accepts(fn)`` is False for nodes configured in a way the
    makers do not cover; ``row_input(fn, k)``: the input whose rows are
    the examples' (input 0, or the data operand of an elementwise
    function); ``broadcasting``: its makers take the shape a broadcast
    on the parameter's path started from (``operand=``)."""

    def __init__(self, makers, accepts=_always, row_input=_first_input,
                 broadcasting=False):
        self.makers = makers
        self.accepts = accepts
        self.row_input = row_input
        self.broadcasting = broadcasting


def _elementwise(makers):
    return _Handler(makers, row_input=_other_operand, broadcasting=True)


_CONV = _Handler({1: _conv_weight, 2: _conv_bias})

#: the covered function classes (subclasses are covered too)
_HANDLERS = {
    _linear.LinearFunction: _Handler({1: _linear_weight, 2: _linear_bias}),
    _conv.Convolution2DFunction: _CONV,
    _deconv.Deconvolution2DFunction: _CONV,
    _bn.BatchNormalization: _Handler(
        {1: normalizations.bn_gamma, 2: normalizations.bn_beta},
        accepts=normalizations.reduces_examples),
    _embed.EmbedIDFunction: _Handler({1: _embed_weight}),
    _ln.LayerNormalization: _Handler({1: normalizations.ln_gamma,
                                      2: normalizations.ln_beta}),
    _gn.GroupNormalization: _Handler({1: normalizations.gn_gamma,
                                      2: normalizations.gn_beta}),
    _bn.FixedBatchNormalization: _Handler(
        {1: normalizations.fixed_bn_gamma, 2: normalizations.fixed_bn_beta},
        accepts=normalizations.reduces_examples),
    _math.Add: _elementwise(broadcasts.ADD),
    _math.Sub: _elementwise(broadcasts.SUB),
    _math.Mul: _elementwise(broadcasts.MUL),
    _math.Div: _elementwise(broadcasts.DIV),
    _prelu.PReLUFunction: _Handler({1: broadcasts.prelu_weight}),
}


def _handler(fn):
    """The table's entry for fn's class or its nearest base (for an
    old-style Function, its adapter's function's), or None."""
    if isinstance(fn, _function.FunctionAdapter):
        return _ADAPTED.get(type(fn._function))
    cls = type(fn)
    if cls not in _BY_CLASS:  # (the backward asks for every node)
        _BY_CLASS[cls] = next((_HANDLERS[c] for c in cls.__mro__
                               if c in _HANDLERS), None)
    return _BY_CLASS[cls]


#: {function class: its _HANDLERS entry or None}, as _handler found it
_BY_CLASS = {}


def _takes_columns(fn):
    """Whether node fn is a convolution whose weight's statistics can take
    the im2col Chainer makes for its weight gradient."""
    return _handler(fn) is _CONV


def _supported(fn, k, operand=None):
    """Whether input k of function node fn is a parameter use covered
    here; ``operand``: for a broadcasting use, the shape the broadcast on
    the parameter's path started from (None: the input's)."""
    handler = _handler(fn)
    if not (handler is not None and k in handler.makers
            and handler.accepts(fn)):
        return False
    return not handler.broadcasting or broadcasts.operand_has_no_rows(
        fn, k, operand)


#: old-style Functions covered, reached through their FunctionAdapter
_ADAPTED = {
    _brn.BatchRenormalizationFunction: _Handler(
        {1: normalizations.brn_gamma, 2: normalizations.brn_beta}),
}


def _row_input(fn, k):
    """The input of fn whose rows are the examples' for its input k."""
    handler = _handler(fn)
    return 0 if handler is None else handler.row_input(fn, k)


def _broadcasting(fn):
    """Whether fn's uses take the shape a broadcast started from."""
    handler = _handler(fn)
    return handler is not None and handler.broadcasting


def _uses_of(fn, k, in_data, gy, dtype, xp, operand=None):
    """The _Use for input k of function node fn, or None if unsupported;
    ``operand``: for a broadcasting use, the shape the broadcast on the
    parameter's path started from (None: the input's)."""
    handler = _handler(fn)
    make = handler.makers.get(k) if handler is not None else None
    if make is None:
        return None
    if handler.broadcasting:
        return make(fn, in_data, gy, dtype, xp, operand=operand)
    return make(fn, in_data, gy, dtype, xp)
