"""Sums of squared per-example products: for the weights of Linear,
Convolution2D and Deconvolution2D, sum_z (A_z B_z)**2 computed without
keeping a per-example gradient of every example (paper Sec. 4.1, Fig.
"Basic"; Sec. 5 on the cost of per-sample gradients).

Each example's contribution to such a weight's gradient is a product
``A_z B_z`` summed over P positions: ``A_z`` (M x P) is the output
gradient (Convolution2D, Linear) or the input (Deconvolution2D) of example
z, ``B_z`` (P x N) the im2col of the other side, or its rows (Linear), per
group of channels.  :class:`Operands` describes one such product;
:func:`sum_squared_products` computes ``sum_z (A_z B_z)**2`` by one of two
exact formulations, whichever costs less for the shape:

* **Gram** (P <= :data:`GRAM_MAX_POSITIONS`, on the GPU
  :data:`GRAM_MAX_POSITIONS_GPU`): (A_z B_z)**2 summed over z
  equals ``sum_{z, p <= q} c_pq (a_zp a_zq) (b_zp b_zq)`` (c = 1 on the
  diagonal, 2 off it): one GEMM with inner size B * P(P+1)/2 and no
  per-example gradient at all.  For P = 1 (Linear, one row per example) it
  is ``(gy**2)^T (x**2)``.  Rounding may leave a tiny negative where the
  true value is 0; results are clamped at 0.
* **per-example, blocked**: batched matmuls of a few examples and a block
  of M rows at a time into a reused buffer (16 MiB, so that it is still
  in cache when it is squared and summed into the result).  This is the
  one extra weight gradient the issue's bound speaks of, without writing
  B copies of the weight to memory.

Several uses of one parameter (shared weights; a discriminator applied to
real and to generated images) add their contributions before squaring:
their products concatenate along P (:func:`concatenate`), so they cost one
product of P1 + P2 positions instead of two and an add.

Memory: operands are formed for chunks of examples whose bytes stay under
``max_memory``; buffers come from a :class:`Workspace` that keeps them
from step to step (no large allocation per step).  Everything is
written with ``xp`` array calls, for NumPy and CuPy alike; on the GPU the
per-example product is one cuBLAS batched GEMM per chunk and the square-sum
the ``vgc_sum_squares`` ReductionKernel.
"""

import math

import numpy

from chainer_vgc.backends.cuda import kernels

#: the Gram formulation is used up to this many positions per example
#: (measured on the 2-core machine, one thread: at P = 4 it took 0.04 s
#: where the blocked per-example product took 0.12 s, at P = 9 0.38 s
#: against 0.13 s; 64 examples, M = 512, N = 4608)
GRAM_MAX_POSITIONS = 4
#: on the GPU, where a launch costs more than the memory traffic the Gram
#: formulation saves (its pairs are a launch or two each), only up to this
GRAM_MAX_POSITIONS_GPU = 1
#: bytes of the per-example block buffer on the CPU (at most
#: ``max_memory``).  On the 2-core machine, one thread, 16 MiB blocks were
#: the fastest of 1 to 64 MiB for the VGG's and the DCGAN's shapes (e.g. 16
#: examples x 512 x 4608 x 32 positions: 86 ms with 1 MiB, 55 ms with 4 MiB,
#: 48 ms with 16 MiB, 62 ms with 64 MiB).  On the GPU the block is bounded
#: by ``max_memory`` alone: fewer, larger batched GEMMs
BLOCK_BYTES = 16 * 2 ** 20


class Workspace(object):
    """Buffers kept from one backward pass to the next: :meth:`get` returns
    a view of a flat buffer per ``(role, dtype, device)``, grown when a
    larger one is asked for and otherwise reused, so that a training loop
    of fixed shapes allocates nothing large after its first step.
    :attr:`nbytes` is what it holds."""

    def __init__(self):
        self._buffers = {}

    def get(self, xp, role, shape, dtype):
        shape = tuple(int(s) for s in shape)
        size = math.prod(shape)
        dtype = numpy.dtype(dtype)
        key = (role, dtype.str, xp.__name__, _device_id(xp))
        buf = self._buffers.get(key)
        if buf is None or buf.size < size:
            buf = xp.empty(max(size, 1), dtype)
            self._buffers[key] = buf
        return buf[:size].reshape(shape)

    @property
    def nbytes(self):
        return sum(b.nbytes for b in self._buffers.values())


def _device_id(xp):
    if xp is numpy:
        return -1
    return xp.cuda.Device().id


class Operands(object):
    """One product ``A_z B_z`` per example z, for examples z0..z1-1 at a
    time: ``make(z0, z1, work)`` returns (A, B), A of shape (m, G, M, P)
    and B of shape (m, G, P, N) (m = z1 - z0; views are fine).  ``shape``
    is the weight's shape, (G * M, N...) in C order; ``bytes_per_example``
    what one example's A and B take."""

    def __init__(self, xp, dtype, groups, m, n, positions, make, shape):
        self.xp, self.dtype = xp, numpy.dtype(dtype)
        self.groups, self.m, self.n, self.positions = groups, m, n, positions
        self.make, self.shape = make, tuple(shape)
        self.bytes_per_example = (groups * positions * (m + n)
                                  * self.dtype.itemsize)

    def same_product(self, other):
        return (self.xp is other.xp and self.dtype == other.dtype and
                (self.groups, self.m, self.n) ==
                (other.groups, other.m, other.n))


def concatenate(parts):
    """The :class:`Operands` whose product for example z is the sum of the
    ``parts``' products (each a list of (operands, rows per example)):
    their A and B side by side along P."""
    first = parts[0][0]
    positions = sum(op.positions * g for op, g in parts)

    def make(z0, z1, work):
        m = z1 - z0
        a = work.get(first.xp, 'cat_a', (m, first.groups, first.m,
                                         positions), first.dtype)
        # B with the positions last, as im2col lays them out: the copies
        # are runs of P elements, and the matmul reads it transposed
        bt = work.get(first.xp, 'cat_b', (m, first.groups, first.n,
                                          positions), first.dtype)
        at = 0
        for op, g in parts:
            pa, pb = _grouped(op, z0, z1, g, work)
            p = pa.shape[-1]
            a[..., at:at + p] = pa
            bt[..., at:at + p] = pb.transpose(0, 1, 3, 2)
            at += p
        return a, bt.transpose(0, 1, 3, 2)

    return Operands(first.xp, first.dtype, first.groups, first.m, first.n,
                    positions, make, first.shape)


def _grouped(op, z0, z1, rows, work):
    """A and B of examples z0..z1-1 when each example is ``rows`` rows of
    the operands' own example axis: the rows join the positions."""
    a, b = op.make(z0 * rows, z1 * rows, work)
    if rows == 1:
        return a, b
    m, g, mm, p = a.shape
    a = a.reshape(z1 - z0, rows, g, mm, p).transpose(0, 2, 3, 1, 4)
    b = b.reshape(z1 - z0, rows, g, p, b.shape[-1]).transpose(0, 2, 1, 3, 4)
    return (a.reshape(z1 - z0, g, mm, rows * p),
            b.reshape(z1 - z0, g, rows * p, b.shape[-1]))


def uses_gram(xp, positions):
    """Whether :func:`sum_squared_products` takes the Gram formulation for
    products of ``positions`` positions per example (else the blocked
    per-example one)."""
    return positions <= (GRAM_MAX_POSITIONS if xp is numpy
                         else GRAM_MAX_POSITIONS_GPU)


def sum_squared_products(op, b, max_memory, work, out=None, rows=1,
                         grad=None):
    """``sum_z (A_z B_z)**2`` over the b examples of ``op`` (each ``rows``
    rows of op's example axis), in op's weight shape; written into ``out``
    when given.  Gram or blocked per-example (module doc).

    ``grad``: an array of op's weight shape and dtype, or None; when given
    (blocked formulation only), it receives ``sum_z A_z B_z``, the batch
    gradient, summed from the same per-example products in the same pass
    (:mod:`~chainer_vgc.statistics.weight_gradient`)."""
    xp = op.xp
    positions = op.positions * rows
    gram = uses_gram(xp, positions)
    if gram and grad is not None:
        raise ValueError('the batch gradient comes with the blocked '
                         'formulation only ({} positions take the Gram '
                         'one)'.format(positions))
    pairs = positions * (positions + 1) // 2
    per_example = op.bytes_per_example * rows  # the operands
    if gram:  # and their pair products
        per_example += op.groups * pairs * (op.m + op.n) * op.dtype.itemsize
    step = max(1, int(max_memory // max(1, per_example)))
    if out is None:
        out = xp.empty(op.shape, op.dtype)
    acc = out.reshape(op.groups, op.m, op.n)
    total = None if grad is None else grad.reshape(op.groups, op.m, op.n)
    first = True
    for z0 in range(0, b, step):
        z1 = min(b, z0 + step)
        a, bb = _grouped(op, z0, z1, rows, work)
        if gram:
            _gram_into(xp, a, bb, acc, first, work)
        else:
            _blocked_into(xp, a, bb, acc, first, work,
                          min(BLOCK_BYTES, max_memory) if xp is numpy
                          else max_memory, total)
        first = False
    if gram:  # rounding can leave -0.0 or a tiny negative where 0 is exact
        xp.maximum(acc, 0, out=acc)
    return out


def _gram_into(xp, a, b, acc, first, work):
    """acc (+)= sum_z (a_z b_z)**2 by one GEMM per group over the position
    pairs p <= q (module doc)."""
    m, groups, mm, p = a.shape
    n = b.shape[-1]
    pairs = [(i, j) for i in range(p) for j in range(i, p)]
    q = len(pairs)
    left = work.get(xp, 'gram_a', (groups, mm, m, q), a.dtype)
    right = work.get(xp, 'gram_b', (groups, m, q, n), a.dtype)
    for k, (i, j) in enumerate(pairs):
        dst = left[..., k]
        xp.multiply(a[..., i].transpose(1, 2, 0), a[..., j].transpose(1, 2, 0),
                    out=dst)
        if i != j:
            xp.multiply(dst, 2, out=dst)
        xp.multiply(b[:, :, i].transpose(1, 0, 2),
                    b[:, :, j].transpose(1, 0, 2), out=right[:, :, k])
    lhs = left.reshape(groups, mm, m * q)
    rhs = right.reshape(groups, m * q, n)
    accumulate(xp, acc, first, work, lambda dst: xp.matmul(lhs, rhs, out=dst))


def _blocked_into(xp, a, b, acc, first, work, budget, total=None):
    """acc (+)= sum_z (a_z b_z)**2, the products of a few examples and a
    block of rows at a time into a reused buffer of at most ``budget``
    bytes (but one row of one example; module doc); and total (+)=
    sum_z a_z b_z from the same products when ``total`` is given."""
    m, groups, mm, p = a.shape
    n = b.shape[-1]
    itemsize = a.dtype.itemsize
    if mm * n * itemsize * min(m, 4) <= budget:
        rows_block = mm
        z_block = max(1, min(m, budget // (mm * n * itemsize)))
    else:
        z_block = min(m, 4)
        rows_block = max(1, budget // (z_block * n * itemsize))
    for g in range(groups):
        for r0 in range(0, mm, rows_block):
            r1 = min(mm, r0 + rows_block)
            target = acc[g, r0:r1]
            for z0 in range(0, m, z_block):
                z1 = min(m, z0 + z_block)
                # contiguous views of the same two buffers every time
                prod = work.get(xp, 'block', (z1 - z0, r1 - r0, n), a.dtype)
                xp.matmul(a[z0:z1, g, r0:r1], b[z0:z1, g], out=prod)
                accumulate(xp, target, first and z0 == 0, work,
                           lambda dst: sum_squares(xp, prod, dst))
                if total is not None:
                    accumulate(xp, total[g, r0:r1], first and z0 == 0, work,
                               lambda dst: xp.sum(prod, axis=0, out=dst))


def accumulate(xp, acc, first, work, write):
    """``write(dst)`` straight into ``acc`` the first time, else into the
    workspace's partial-sum buffer, added to ``acc`` (a contiguous
    array)."""
    if first:
        write(acc)
        return
    part = work.get(xp, 'part', acc.shape, acc.dtype)
    write(part)
    xp.add(acc, part, out=acc)


def sum_squares(xp, g, out=None):
    """sum over axis 0 of g**2 without a temporary of g's size: NumPy's
    einsum; on the GPU the ``vgc_sum_squares`` ReductionKernel
    (:mod:`chainer_vgc.backends.cuda.kernels`; CuPy's einsum would make two transposed
    copies of g).  The GPU adds the examples in another order than NumPy,
    so the last bits of the statistics may differ between devices.
    ``out``: written in place (and returned)."""
    if xp is numpy:
        return numpy.einsum('i...,i...->...', g, g, out=out)
    kernel = kernels.get_kernel('vgc_sum_squares')
    if out is not None and not out.flags.c_contiguous:
        out[...] = kernel(g, axis=0)
        return out
    return kernel(g, axis=0, out=out)
