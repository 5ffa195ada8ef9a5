"""One use of a parameter by a function node: its per-example
contributions and the sum over the batch of their squares (paper Sec. 4.1,
Fig. "Basic").

:class:`_Use` is the base of :mod:`~chainer_vgc.statistics.handlers`'
classes (and :mod:`~chainer_vgc.statistics.normalizations`',
:mod:`~chainer_vgc.statistics.broadcasts`'); :class:`_SumOverPositions`
is the one of bias-like parameters (biases, betas), which both tables
use.  Its :meth:`_Use.reference_sqsum` and
:func:`_reference_combined_sqsum` are the readable definitions: each
example's contribution, formed for chunks of examples under
``max_memory``, squared and summed.  Weights whose contributions are
products (Linear, convolutions) take the faster exact formulations of
:mod:`~chainer_vgc.statistics.contraction` instead, tested against these.
"""

import numpy

from chainer_vgc.backends import arrays
from chainer_vgc.backends.cuda import kernels
from chainer_vgc.statistics import contraction


class _Use(object):
    """One use of a parameter by a function node, at backward time.

    ``rows``: leading size of the function's example axis.  Subclasses give
    ``per_example(r0, r1)`` (contributions of rows r0..r1-1, shape
    ``(r1 - r0,) + param.shape``) and ``row_bytes`` (bytes per row of that).
    :meth:`sqsum` takes the fast exact formulations of
    :mod:`~chainer_vgc.statistics.contraction` where the subclass gives
    ``operands`` (or a shortcut of its own); :meth:`reference_sqsum` is the
    definition they are tested against.
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

    #: for weights whose contributions are products (Linear, convolutions):
    #: ``operands()`` gives their :class:`~chainer_vgc.statistics.
    #: contraction.Operands`; None for the others
    operands = None
    #: True where :meth:`sqsum` is a sparse shortcut that the dense
    #: ``operands`` would lose (EmbedID's one-hot rows): such operands
    #: join only a product with another, dense use
    sparse = False

    def sqsum(self, group, max_memory, out=None, work=None, grad=None):
        """The sum over examples of the squared contributions; ``out``
        (an array of the parameter's shape and the state dtype, or None)
        receives it, written by the last reduction itself; ``work``: the
        :class:`~chainer_vgc.statistics.contraction.Workspace` of the
        products' buffers; ``grad`` (products only): receives the batch
        gradient from the same products (see
        :func:`~chainer_vgc.statistics.contraction.sum_squared_products`)."""
        if self.operands is not None:
            return contraction.sum_squared_products(
                self.operands(), self.rows // group, max_memory,
                work if work is not None else contraction.Workspace(), out,
                rows=group, grad=grad)
        if grad is not None:
            raise ValueError('the batch gradient comes with the products of '
                             'Linear and convolution weights only')
        return self.reference_sqsum(group, max_memory, out)

    def reference_sqsum(self, group, max_memory, out=None):
        """The readable definition :meth:`sqsum` is tested against: each
        example's contribution (:meth:`examples`, chunks of examples under
        ``max_memory``), squared and summed."""
        b = self.rows // group
        return _chunked_sqsum(
            lambda z0, z1: self.examples(z0, z1, group), b,
            _chunk(max_memory, self.row_bytes * group), out)


class _SumOverPositions(_Use):
    """Bias-like parameters (biases, BN's beta): per-example sum of gy
    over every axis but the example axis and the parameter axes."""

    def __init__(self, xp, dtype, gy, axes):
        super(_SumOverPositions, self).__init__(xp, dtype)
        self.gy = _as(gy, dtype)
        self.axes = tuple(a for a in axes if a != 0)
        self.rows = gy.shape[0]
        self.row_bytes = gy[0].size * dtype.itemsize

    def per_example(self, r0, r1):
        g = self.gy[r0:r1]
        return _sum_over(self.xp, g, self.axes) if self.axes else g


def _sum_over(xp, a, axes, b=None):
    """``a`` (times ``b``) summed over ``axes``: NumPy's einsum, which on
    the 2-core machine summed (n, C, h, w) over h, w 1.5-4x faster than
    ``sum`` and forms no product array; CuPy's ``sum`` on the GPU."""
    if xp is not numpy:
        return (a if b is None else a * b).sum(axis=axes)
    letters = 'abcdefghij'[:a.ndim]
    kept = ''.join(c for k, c in enumerate(letters) if k not in axes)
    if b is None:
        return numpy.einsum('{}->{}'.format(letters, kept), a)
    return numpy.einsum('{0},{0}->{1}'.format(letters, kept), a, b)


def _chunked_sqsum(examples, b, step, out):
    """sum_z g_z**2 over the examples 0..b-1, ``examples(z0, z1)`` giving
    the contributions of a chunk; the last chunk's reduction (or the
    add of the partial sums) writes into ``out`` when given."""
    acc = None
    for z0 in range(0, b, step):
        z1 = min(b, z0 + step)
        last = z1 == b
        g = examples(z0, z1)
        xp = arrays.get_array_module(g)
        if acc is None:
            acc = contraction.sum_squares(xp, g, out if last else None)
        else:
            acc = kernels.add(acc, contraction.sum_squares(xp, g),
                              out if last else None)
    return acc


def _combined_sqsum(use_list, b, max_memory, out=None, work=None):
    """Sum of squares of per-example contributions added over the uses
    ``[(use, group)]`` of one parameter (shared weights, RNN-style reuse),
    b examples, chunk by chunk (into ``out``, as :meth:`_Use.sqsum`).
    Uses that are products of one shape concatenate along their positions
    (:func:`~chainer_vgc.statistics.contraction.concatenate`): Linear's
    weight with itself, or an EmbedID's table with the output projection
    tied to it, but not sparse uses alone."""
    if all(u.operands is not None for u, _ in use_list) and not all(
            u.sparse for u, _ in use_list):
        parts = [(u.operands(), g) for u, g in use_list]
        if all(parts[0][0].same_product(op) for op, _ in parts):
            work = work if work is not None else contraction.Workspace()
            return contraction.sum_squared_products(
                contraction.concatenate(parts), b, max_memory, work,
                out)
    return _reference_combined_sqsum(use_list, b, max_memory, out)


def _reference_combined_sqsum(use_list, b, max_memory, out=None):
    """The readable definition of :func:`_combined_sqsum`: the uses'
    contributions of each example added, squared, summed."""
    def examples(z0, z1):
        total = None
        for use, g in use_list:
            part = use.examples(z0, z1, g)
            total = part if total is None else kernels.add(total, part)
        return total
    row_bytes = sum(u.row_bytes * g for u, g in use_list)
    return _chunked_sqsum(examples, b, _chunk(max_memory, row_bytes), out)


def _chunk(max_memory, bytes_per_item):
    return max(1, int(max_memory // max(1, bytes_per_item)))


def _as(a, dtype):
    return a.astype(dtype, copy=False)
