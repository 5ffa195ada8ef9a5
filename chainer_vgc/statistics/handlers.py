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
* ``BatchNormalization`` (training mode): BN couples the examples through
  the batch mean and variance, so "per-example gradient" is defined as the
  example's slice of the batch gradient: ``sum_{h,w} gy_z * x_hat_z`` for
  gamma and ``sum_{h,w} gy_z`` for beta, with x_hat normalized by the batch
  statistics.  The slices add up to the batch gradient;
* ``EmbedID`` (with ``ignore_label``): per example, the rows of the tokens
  it contains, combined by word id before squaring.

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

from chainer.functions.connection import convolution_2d as _conv
from chainer.functions.connection import deconvolution_2d as _deconv
from chainer.functions.connection import embed_id as _embed
from chainer.functions.connection import linear as _linear
from chainer.functions.normalization import batch_normalization as _bn
from chainer.utils import conv as conv_utils
import numpy

from chainer_vgc import backend
from chainer_vgc import kernels


class _Use(object):
    """One use of a parameter by a function node, at backward time.

    ``rows``: leading size of the function's example axis.  Subclasses give
    ``per_example(r0, r1)`` (contributions of rows r0..r1-1, shape
    ``(r1 - r0,) + param.shape``) and ``row_bytes`` (bytes per row of that);
    ``sqsum(group, max_memory)`` may be overridden by an exact shortcut.
    """

    rows = 0
    row_bytes = 1

    def __init__(self, xp, dtype):
        self.xp = xp
        self.dtype = dtype

    def per_example(self, r0, r1):
        raise NotImplementedError

    def examples(self, z0, z1, group):
        """Contributions of examples z0..z1-1 (groups of ``group`` rows)."""
        g = self.per_example(z0 * group, z1 * group)
        if group > 1:
            g = g.reshape((z1 - z0, group) + g.shape[1:]).sum(axis=1)
        return g

    def sqsum(self, group, max_memory, out=None):
        """The sum over examples of the squared contributions; ``out``
        (an array of the parameter's shape and the state dtype, or None)
        receives it, written by the last reduction itself."""
        b = self.rows // group
        return _chunked_sqsum(
            lambda z0, z1: self.examples(z0, z1, group), b,
            _chunk(max_memory, self.row_bytes * group), out)


def _chunked_sqsum(examples, b, step, out):
    """sum_z g_z**2 over the examples 0..b-1, ``examples(z0, z1)`` giving
    the contributions of a chunk; the last chunk's reduction (or the
    add of the partial sums) writes into ``out`` when given."""
    acc = None
    for z0 in range(0, b, step):
        z1 = min(b, z0 + step)
        last = z1 == b
        g = examples(z0, z1)
        xp = backend.get_array_module(g)
        if acc is None:
            acc = _sum_squares(xp, g, out if last else None)
        else:
            acc = kernels.add(acc, _sum_squares(xp, g),
                              out if last else None)
    return acc


def _combined_sqsum(use_list, b, max_memory, out=None):
    """Sum of squares of per-example contributions added over the uses
    ``[(use, group)]`` of one parameter (shared weights, RNN-style reuse),
    b examples, chunk by chunk (into ``out``, as :meth:`_Use.sqsum`)."""
    def examples(z0, z1):
        total = None
        for use, g in use_list:
            part = use.examples(z0, z1, g)
            total = part if total is None else kernels.add(total, part)
        return total
    row_bytes = sum(u.row_bytes * g for u, g in use_list)
    return _chunked_sqsum(examples, b, _chunk(max_memory, row_bytes), out)


def _sum_squares(xp, g, out=None):
    """sum over axis 0 of g**2 without a temporary of g's size: NumPy's
    einsum; on the GPU the ``vgc_sum_squares`` ReductionKernel
    (:mod:`chainer_vgc.kernels`; CuPy's einsum would make two transposed
    copies of g).  The GPU adds the examples in another order than NumPy,
    so the last bits of the statistics may differ between devices.
    ``out``: written in place (and returned)."""
    if xp is numpy:
        return xp.einsum('i...,i...->...', g, g, out=out)
    return kernels.get_kernel('vgc_sum_squares')(g, axis=0, out=out)


def _chunk(max_memory, bytes_per_item):
    return max(1, int(max_memory // max(1, bytes_per_item)))


def _as(a, dtype):
    return a.astype(dtype, copy=False)


class _LinearW(_Use):
    def __init__(self, xp, dtype, x, gy):
        super(_LinearW, self).__init__(xp, dtype)
        self.x, self.gy = _as(x, dtype), _as(gy, dtype)
        self.rows = x.shape[0]
        self.row_bytes = gy.shape[1] * x.shape[1] * dtype.itemsize

    def per_example(self, r0, r1):
        return self.gy[r0:r1, :, None] * self.x[r0:r1, None, :]

    def sqsum(self, group, max_memory, out=None):
        if group > 1:
            return super(_LinearW, self).sqsum(group, max_memory, out)
        # one row per example: (gy_z x_z^T)**2 = gy_z**2 (x_z**2)^T, exactly
        step = _chunk(max_memory, (self.x.shape[1] + self.gy.shape[1])
                      * self.dtype.itemsize)
        acc = None
        for r0 in range(0, self.rows, step):
            gy, x = self.gy[r0:r0 + step], self.x[r0:r0 + step]
            last = r0 + step >= self.rows
            if acc is None:
                acc = self.xp.dot((gy * gy).T, x * x,
                                  out=out if last else None)
            else:
                acc = kernels.add(acc, (gy * gy).T.dot(x * x),
                                  out if last else None)
        return acc


class _SumOverPositions(_Use):
    """Bias-like parameters: per-example sum of gy (times x_hat for BN
    gamma) over every axis but the example axis and the parameter axes."""

    def __init__(self, xp, dtype, gy, axes, factor=None):
        super(_SumOverPositions, self).__init__(xp, dtype)
        self.gy = _as(gy, dtype)
        self.factor = factor
        self.axes = tuple(a for a in axes if a != 0)
        self.rows = gy.shape[0]
        self.row_bytes = gy[0].size * dtype.itemsize

    def per_example(self, r0, r1):
        g = self.gy[r0:r1]
        if self.factor is not None:
            g = g * self.factor[r0:r1]
        return g.sum(axis=self.axes) if self.axes else g


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
        self.row_bytes = (col + int(numpy.prod(w_shape))
                          + other[0].size) * dtype.itemsize

    def per_example(self, r0, r1):
        fn, xp = self.fn, self.xp
        x, gy = self.x[r0:r1], self.gy[r0:r1]
        img, other = (gy, x) if self.transposed else (x, gy)
        kh, kw = self.w_shape[2:]
        kwargs = dict(cover_all=bool(fn.cover_all), dy=fn.dy, dx=fn.dx,
                      out_h=other.shape[2], out_w=other.shape[3])
        im2col = (conv_utils.im2col_cpu if xp is numpy
                  else conv_utils.im2col_gpu)
        col = im2col(img, kh, kw, fn.sy, fn.sx, fn.ph, fn.pw, **kwargs)
        n, groups = r1 - r0, fn.groups
        hw = other.shape[2] * other.shape[3]
        # (n, G, C_img/G * kh * kw, hw) and (n, G, C_other/G, hw)
        col = col.reshape(n, groups, -1, hw)
        oth = other.reshape(n, groups, -1, hw)
        g = xp.matmul(oth, col.transpose(0, 1, 3, 2))
        return g.reshape((n,) + tuple(self.w_shape))


class _EmbedW(_Use):
    def __init__(self, xp, dtype, ids, gy, w_shape, ignore_label):
        super(_EmbedW, self).__init__(xp, dtype)
        self.ids, self.gy = ids, _as(gy, dtype)
        self.w_shape, self.ignore = w_shape, ignore_label
        self.rows = ids.shape[0]
        self.row_bytes = int(numpy.prod(w_shape)) * dtype.itemsize

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

    def sqsum(self, group, max_memory, out=None):
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


def _bn_gamma(fn, in_data, gy, dtype, xp):
    x = _as(in_data[0], dtype)
    x_hat = (x - _as(fn.mean, dtype)[fn.expander]) * _as(
        fn.inv_std, dtype)[fn.expander]
    return _SumOverPositions(xp, dtype, gy, tuple(fn.axis), factor=x_hat)


def _bn_beta(fn, in_data, gy, dtype, xp):
    return _SumOverPositions(xp, dtype, gy, tuple(fn.axis))


def _bn_reduces_examples(fn):
    """BN statistics taken over the example axis (axis 0): otherwise an
    example's slice of the batch gradient is not defined here."""
    return 0 in tuple(fn.axis or (0,))


def _embed_weight(fn, in_data, gy, dtype, xp):
    return _EmbedW(xp, dtype, in_data[0], gy, fn._w_shape, fn.ignore_label)


def _always(fn):
    return True


class _Handler(object):
    """How one Chainer function class is covered: ``makers`` maps the
    index k of a parameter input (1: W or gamma, 2: b or beta) to its
    maker; ``accepts(fn)`` is False for nodes configured in a way the
    makers do not cover."""

    def __init__(self, makers, accepts=_always):
        self.makers = makers
        self.accepts = accepts


_CONV = _Handler({1: _conv_weight, 2: _conv_bias})

#: the covered function classes (subclasses are covered too)
_HANDLERS = {
    _linear.LinearFunction: _Handler({1: _linear_weight, 2: _linear_bias}),
    _conv.Convolution2DFunction: _CONV,
    _deconv.Deconvolution2DFunction: _CONV,
    _bn.BatchNormalization: _Handler({1: _bn_gamma, 2: _bn_beta},
                                     accepts=_bn_reduces_examples),
    _embed.EmbedIDFunction: _Handler({1: _embed_weight}),
}


def _handler(fn):
    """The table's entry for fn's class or its nearest base, or None."""
    for cls in type(fn).__mro__:
        handler = _HANDLERS.get(cls)
        if handler is not None:
            return handler
    return None


def _supported(fn, k):
    """Whether input k of function node fn is a parameter use covered
    here."""
    handler = _handler(fn)
    return (handler is not None and k in handler.makers
            and handler.accepts(fn))


def _uses_of(fn, k, in_data, gy, dtype, xp):
    """The _Use for input k of function node fn, or None if unsupported."""
    handler = _handler(fn)
    make = handler.makers.get(k) if handler is not None else None
    return None if make is None else make(fn, in_data, gy, dtype, xp)
