"""Per-sample statistics: s = sum_z (grad_z / B)**2 (paper Sec. 4.1, Fig.
"Basic"; Sec. 5: "common deep learning libraries do not support access to
gradients of each sample").

:class:`PerSampleSquares` computes, during an ordinary backward pass, for
every parameter the sum over the minibatch of the squared per-example
contributions to the minibatch gradient.  It is a Chainer ``FunctionHook``
that looks at each function node that consumes a parameter, with the node's
input data x and output gradient gy (which already carries the 1/B of a mean
loss), and forms the per-example contributions from Chainer's own primitives:

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

A parameter used by several function nodes (shared weights, RNN-style
reuse) has its per-example contributions of all uses added *before*
squaring; those uses are kept until the backward pass ends and then
combined chunk by chunk.

Examples: the first axis of the functions' inputs.  A function whose input
has ``k * B`` rows (``n_batch_axes > 1``, or ``x.reshape(B * T, -1)`` of an
example-major ``(B, T, ...)`` array) is read as B contiguous groups of k rows;
time-major layouts would mix examples, so pass ``batch_size`` and keep the
batch axis first.

Memory: per-example intermediates are formed for chunks of examples so that
each stays under ``max_memory`` bytes (default 64 MiB, at least one example
per chunk; on the 2-core benchmark machine 64 MiB chunks were faster than
256 MiB ones and stayed under the training step's own peak).  Results do not depend on the chunk size beyond floating-point
summation order.

A parameter consumed by any other function gets no silent wrong answer:
``uncovered='error'`` (default) raises :class:`UncoveredParameterError`
listing them before the backward pass; ``uncovered='dense'`` leaves their
sums None and lists them in ``uncovered_names`` (the communicator then sends
them uncompressed); ``uncovered='bruteforce'`` computes
them exactly by one backward pass per example (slow; needs ``loss_fn`` and
``batch``).  The loss may have any scaling (mean, sum, times a loss scale,
``backward(loss_scale=...)``): it must be ``c * sum_z loss_fn(example z)``
for one unknown constant c, which is inferred and checked (see
:meth:`PerSampleSquares.backward`).  Models whose per-example passes
cannot reproduce the batch pass are refused: batch normalization in
training mode, active dropout and other random-noise functions.  The
per-example passes report nothing to the current reporter.

Results are in the residual state dtype (float32 for float16 parameters) on
the parameter's device; a parameter that gets no gradient gives None.
Everything is written with ``xp`` array calls, so the same code runs on
NumPy and CuPy arrays.
"""

import contextlib
import math

import chainer
from chainer import backend as chainer_backend
from chainer.functions.connection import convolution_2d as _conv
from chainer.functions.connection import deconvolution_2d as _deconv
from chainer.functions.connection import embed_id as _embed
from chainer.functions.connection import linear as _linear
from chainer.functions.noise import dropout as _dropout
from chainer.functions.noise import gaussian as _gaussian
from chainer.functions.noise import simplified_dropconnect as _dropconnect
from chainer.functions.noise import zoneout as _zoneout
from chainer.functions.normalization import batch_normalization as _bn
from chainer.utils import conv as conv_utils
import numpy

from chainer_vgc import backend
from chainer_vgc import kernels

#: default bound of each per-example intermediate (bytes)
DEFAULT_MAX_MEMORY = 64 * 2 ** 20


class UncoveredParameterError(ValueError):
    """Parameters consumed by functions PerSampleSquares cannot handle."""


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
                g = g.array.astype(backend.state_dtype(p.dtype))
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


def _functions_of(var):
    """Every function node in the graph of ``var``."""
    seen, out = set(), []
    stack = [var.creator_node] if var.creator_node is not None else []
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        out.append(fn)
        stack.extend(node.creator_node for node in fn.inputs
                     if node.creator_node is not None)
    return out


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


def model_params(link):
    """(names, params) of a link, sorted by name: the order used everywhere
    (the same on every worker)."""
    pairs = sorted(link.namedparams(), key=lambda kv: kv[0])
    return [k for k, _ in pairs], [v for _, v in pairs]


# ---- per-function handlers ---------------------------------------------------

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

    def sqsum(self, group, max_memory):
        b = self.rows // group
        step = _chunk(max_memory, self.row_bytes * group)
        acc = None
        for z0 in range(0, b, step):
            g = self.examples(z0, min(b, z0 + step), group)
            part = _sum_squares(self.xp, g)
            acc = part if acc is None else kernels.add(acc, part)
        return acc


def _sum_squares(xp, g):
    """sum over axis 0 of g**2 without a temporary of g's size: NumPy's
    einsum; on the GPU the ``vgc_sum_squares`` ReductionKernel
    (:mod:`chainer_vgc.kernels`; CuPy's einsum would make two transposed
    copies of g).  The GPU adds the examples in another order than NumPy,
    so the last bits of the statistics may differ between devices."""
    if xp is numpy:
        return xp.einsum('i...,i...->...', g, g)
    return kernels.get_kernel('vgc_sum_squares')(g, axis=0)


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

    def sqsum(self, group, max_memory):
        if group > 1:
            return super(_LinearW, self).sqsum(group, max_memory)
        # one row per example: (gy_z x_z^T)**2 = gy_z**2 (x_z**2)^T, exactly
        step = _chunk(max_memory, (self.x.shape[1] + self.gy.shape[1])
                      * self.dtype.itemsize)
        acc = None
        for r0 in range(0, self.rows, step):
            gy, x = self.gy[r0:r0 + step], self.x[r0:r0 + step]
            part = (gy * gy).T.dot(x * x)
            acc = part if acc is None else kernels.add(acc, part)
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

    def sqsum(self, group, max_memory):
        # sparse: combine each example's tokens by word id, square, scatter
        xp = self.xp
        per_token = (self.gy[0].size // max(1, self.ids[0].size) + 2) * 8
        tokens_per_row = max(1, self.ids[0].size)
        step = _chunk(max_memory, per_token * tokens_per_row * group) * group
        acc = xp.zeros(self.w_shape, self.dtype)
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


def _array_ids(arrays):
    return {id(a) for a in arrays}


def _derived_from(array, ids):
    """Whether ``array`` is one of the arrays ``ids`` or a view of one."""
    while array is not None:
        if id(array) in ids:
            return True
        array = getattr(array, 'base', None)
    return False


def _example_major(node, b):
    """Whether a node's k*b rows are b contiguous groups, one per example:
    a chain of reshapes (F.reshape, F.linear's n_batch_axes) of something
    whose first axis is the batch, or a C-order view of such an array."""
    while node.creator_node is not None:
        creator = node.creator_node
        if type(creator).__name__ != 'Reshape':
            return False
        node = creator.inputs[0]
        if len(node.shape) and node.shape[0] == b:
            return True
    data = node.data
    while data is not None:
        base = getattr(data, 'base', None)
        if base is None:
            return False
        if (getattr(base, 'ndim', 0) and base.shape[0] == b
                and getattr(data.flags, 'c_contiguous', False)
                and base.flags.c_contiguous):
            return True
        data = base
    return False


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


def _uses_of(fn, k, in_data, gy, dtype, xp):
    """The _Use for input k of function node fn, or None if unsupported."""
    if isinstance(fn, _linear.LinearFunction):
        x = in_data[0]
        if k == 1:
            return _LinearW(xp, dtype, x, gy)
        if k == 2:
            return _SumOverPositions(xp, dtype, gy, ())
    elif isinstance(fn, (_conv.Convolution2DFunction,
                         _deconv.Deconvolution2DFunction)):
        if k == 1:
            return _ConvW(xp, dtype, fn, in_data[0], gy, in_data[1].shape,
                          transposed=isinstance(
                              fn, _deconv.Deconvolution2DFunction))
        if k == 2:
            return _SumOverPositions(xp, dtype, gy, (2, 3))
    elif isinstance(fn, _bn.BatchNormalization):
        axes = tuple(fn.axis)
        if k == 1:
            x = _as(in_data[0], dtype)
            x_hat = (x - _as(fn.mean, dtype)[fn.expander]) * _as(
                fn.inv_std, dtype)[fn.expander]
            return _SumOverPositions(xp, dtype, gy, axes, factor=x_hat)
        if k == 2:
            return _SumOverPositions(xp, dtype, gy, axes)
    elif isinstance(fn, _embed.EmbedIDFunction):
        if k == 1:
            return _EmbedW(xp, dtype, in_data[0], gy, fn._w_shape,
                           fn.ignore_label)
    return None


def _supported(fn, k):
    if isinstance(fn, (_linear.LinearFunction, _conv.Convolution2DFunction,
                       _deconv.Deconvolution2DFunction)):
        return k in (1, 2)
    if isinstance(fn, _bn.BatchNormalization):
        return k in (1, 2) and 0 in tuple(fn.axis or (0,))
    if isinstance(fn, _embed.EmbedIDFunction):
        return k == 1
    return False


# ---- the hook ----------------------------------------------------------------

class PerSampleSquares(chainer.FunctionHook):
    """Per-sample sums of squared gradients of a link's parameters.

    Args:
        target: a :class:`chainer.Link` (all its parameters, in
            :func:`model_params` order) or a list of ``(name, param)``.
        max_memory: bound in bytes of each per-example intermediate.
        uncovered: ``'error'`` or ``'bruteforce'`` (see the module doc).
        batch_size: number of examples B; else ``len(batch[0])`` of the
            ``batch`` given to :meth:`backward` (one of the two is needed).

    Use :meth:`backward` instead of ``loss.backward()``; it returns the
    list of sums (aligned with :attr:`names`) and leaves the usual
    gradients in ``param.grad``.
    """

    name = 'PerSampleSquares'

    def __init__(self, target, max_memory=DEFAULT_MAX_MEMORY,
                 uncovered='error', batch_size=None):
        if isinstance(target, chainer.Link):
            self.names, self.params = model_params(target)
        else:
            pairs = list(target)
            self.names = [n for n, _ in pairs]
            self.params = [p for _, p in pairs]
        if uncovered not in ('error', 'bruteforce', 'dense'):
            raise ValueError("uncovered must be 'error', 'bruteforce' or "
                             "'dense', got {!r}".format(uncovered))
        if not max_memory > 0:
            raise ValueError('max_memory must be a positive number of bytes, '
                             'got {!r}'.format(max_memory))
        if batch_size is not None and int(batch_size) < 1:
            raise ValueError('batch_size must be >= 1, got {!r}'.format(
                batch_size))
        self.max_memory = max_memory
        self.uncovered = uncovered
        self.batch_size = batch_size
        self.sqsums = [None] * len(self.params)
        #: names of parameters to leave out (no sum is computed: None)
        self.skip = set()
        #: with uncovered='dense': the parameters the last backward could
        #: not cover (their sums are None)
        self.uncovered_names = []
        self._in_backward = False
        self._by_fn = {}

    # -- graph inspection --
    def _scan(self, loss):
        """Function nodes that consume each parameter: {index: [(fn, k)]}."""
        index = {id(p.node): i for i, p in enumerate(self.params)}
        uses = {}
        self._graph_functions = _functions_of(loss)
        for fn in self._graph_functions:
            for k, node in enumerate(fn.inputs):
                i = index.get(id(node))
                if i is not None:
                    uses.setdefault(i, []).append((fn, k))
        return uses

    def backward(self, loss, loss_fn=None, batch=(), **backward_kwargs):
        """Run ``loss.backward(**backward_kwargs)`` and compute the sums.

        ``batch``: the minibatch arrays (first axis = examples); gives B and
        lets the rows each function sees be traced to examples.
        ``loss_fn`` is needed only for ``uncovered='bruteforce'``:
        ``loss_fn(*batch)`` must compute ``loss``, and the uncovered
        parameters' sums are then formed from one pass of ``loss_fn`` per
        example (``loss_fn`` applied to that example alone, v_z), before
        ``loss.backward``.

        Brute force assumes the loss is linear in per-example terms:
        ``loss = c * sum_z v_z`` with one constant c (c = 1/B for a mean,
        1 for a sum, times any loss scale the loss was multiplied by; a
        ``loss_scale`` passed here multiplies it as it does the gradients).
        The contribution of example z is then ``c * grad v_z``.  c is
        inferred from the batch loss and the batch gradient of the
        uncovered parameters (one extra ``chainer.grad`` pass) and both are
        checked against the per-example sums up to rounding; a loss that
        is not of this form (per-example weights, a nonlinear function of a
        batch mean, a ``loss_fn`` that does not reproduce ``loss``) raises
        ValueError.  So do graphs the per-example passes cannot reproduce:
        batch normalization in training mode, and active dropout or other
        random noise (``chainer.functions.noise``).  Whatever ``loss_fn``
        reports during these passes is discarded: the current reporter
        keeps only what the real pass reported.
        """
        uses = {i: us for i, us in self._scan(loss).items()
                if self.names[i] not in self.skip}
        b = self._batch_size(batch)
        batch_ids = _array_ids(batch)
        uncovered = sorted(i for i, us in uses.items()
                           if not all(_supported(fn, k) for fn, k in us))
        brute = {}
        self.uncovered_names = []
        if uncovered and self.uncovered == 'dense':
            # the caller sends them densely: no sums
            self.uncovered_names = [self.names[i] for i in uncovered]
            uses = {i: us for i, us in uses.items() if i not in uncovered}
        elif uncovered:
            brute = self._bruteforce(uncovered, uses, loss_fn, batch, loss,
                                     backward_kwargs.get('loss_scale'))
        self._uses = {i: us for i, us in uses.items() if i not in brute}
        for i, us in self._uses.items():
            for fn, _ in us:
                self._check_rows(fn, i, b, batch_ids)
        self._single = {i for i, us in self._uses.items() if len(us) == 1}
        self._pending = {}
        self._by_fn = {}
        for i, us in self._uses.items():
            for fn, k in us:
                self._by_fn.setdefault(id(fn), []).append((i, k))
        self._b = b
        self.sqsums = [None] * len(self.params)
        self._results = {}
        try:
            self._in_backward = True
            with self:
                loss.backward(**backward_kwargs)
            for i, use_list in self._pending.items():
                self._results[i] = self._combine(use_list, self._b)
        finally:
            self._in_backward = False
            self._by_fn = {}
            self._pending = {}
        for i, p in enumerate(self.params):
            if i in brute:
                self.sqsums[i] = brute[i]
            elif i in self._results:
                self.sqsums[i] = self._results[i]
            elif p.grad is not None and i in uses:
                # reached, but no gradient flowed through any use
                self.sqsums[i] = p.xp.zeros(p.shape, backend.state_dtype(
                    p.dtype))
        return self.sqsums

    def __enter__(self):
        if not getattr(self, '_in_backward', False):
            raise TypeError('use PerSampleSquares.backward(loss, batch=...) '
                            'instead of registering the hook with "with"')
        return super(PerSampleSquares, self).__enter__()

    def _bruteforce(self, uncovered, uses, loss_fn, batch, loss,
                    loss_scale):
        listing = ', '.join('{} (used by {})'.format(
            self.names[i], ', '.join(sorted({type(fn).__name__
                                             for fn, _ in uses[i]})))
            for i in uncovered)
        if self.uncovered == 'error':
            raise UncoveredParameterError(
                'per-sample statistics are not implemented for: {}. Use '
                "uncovered='dense' (send them uncompressed, with a dense "
                "allreduce), uncovered='bruteforce' (exact, one backward "
                'pass per example) or exclude these parameters'.format(
                    listing))
        if loss_fn is None or not len(batch):
            raise ValueError(
                "uncovered='bruteforce' needs loss_fn and batch to recompute "
                'per-example losses for: ' + listing)
        coupled = sorted({type(fn).__name__ for fn in self._graph_functions
                          if isinstance(fn, _bn.BatchNormalization)})
        if coupled:
            raise ValueError(
                "uncovered='bruteforce' recomputes each example alone, which "
                'is not exact with {} in training mode (it couples the '
                'examples); uncovered parameters: {}'.format(
                    ', '.join(coupled), listing))
        noise = _random_functions(self._graph_functions)
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
        params = [self.params[i] for i in uncovered]
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
        c = _loss_scaling(loss_value, batch_grads, passes, float(eps),
                          listing)
        return {i: None if a is None else a * a.dtype.type(c * c)
                for i, a in zip(uncovered, passes.sqsum)}

    def _check_rows(self, fn, i, b, batch_ids):
        """Refuse inputs whose rows cannot be attributed to examples."""
        node = fn.inputs[0]
        rows = node.shape[0] if len(node.shape) else 0
        where = '{} (input of {} for parameter {})'.format(
            tuple(node.shape), type(fn).__name__, self.names[i])
        if rows == 0 or rows % b:
            raise ValueError(
                '{}: {} rows on the example axis, not a multiple of the '
                'batch size {}; pass batch=/batch_size= and keep the batch '
                'axis first'.format(where, rows, b))
        if rows != b and not _example_major(node, b):
            raise ValueError(
                '{}: {} rows for {} examples, and they do not come from an '
                'example-major reshape of the batch (e.g. a concatenation or '
                'a time-major layout); per-example contributions are '
                'undefined'.format(where, rows, b))
        if (batch_ids and node.creator_node is None and node.data is not None
                and not _derived_from(node.data, batch_ids)):
            raise ValueError(
                '{}: the input is a constant array, not minibatch data; '
                'per-example contributions are undefined'.format(where))

    def _batch_size(self, batch):
        if self.batch_size is not None:
            return int(self.batch_size)
        if len(batch):
            return len(batch[0])
        raise ValueError(
            'PerSampleSquares needs the number of examples: pass batch=(x, '
            '...) to backward() or batch_size= to the constructor (guessing '
            'it from the graph can merge examples silently)')

    # -- hook --
    def backward_postprocess(self, function, in_data, out_grad):
        entries = self._by_fn.get(id(function))
        if not entries or out_grad[0] is None:
            return
        gy = out_grad[0]
        xp = chainer_backend.get_array_module(gy)
        for i, k in entries:
            dtype = backend.state_dtype(self.params[i].dtype)
            use = _uses_of(function, k, in_data, gy, dtype, xp)
            group = use.rows // self._b  # a multiple: see _check_rows
            if i in self._single:  # done now: nothing is kept
                self._results[i] = use.sqsum(group, self.max_memory)
            else:  # shared: combined per example when backward is over
                self._pending.setdefault(i, []).append((use, group))

    def _combine(self, use_list, b):
        """Sum of squares of per-example contributions added over uses."""
        row_bytes = sum(u.row_bytes * g for u, g in use_list)
        step = _chunk(self.max_memory, row_bytes)
        acc = None
        for z0 in range(0, b, step):
            z1 = min(b, z0 + step)
            total = None
            for use, g in use_list:
                part = use.examples(z0, z1, g)
                total = part if total is None else kernels.add(total, part)
            part = _sum_squares(backend.get_array_module(total), total)
            acc = part if acc is None else kernels.add(acc, part)
        return acc
