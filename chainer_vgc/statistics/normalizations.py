"""Normalization layers' gamma and beta: their per-example contributions
(paper Sec. 4.1, Fig. "Basic").

* ``BatchNormalization`` (training mode) couples the examples through the
  batch mean and variance, so "per-example gradient" is defined as the
  example's slice of the batch gradient: ``sum_{h,w} gy_z * x_hat_z`` for
  gamma and ``sum_{h,w} gy_z`` for beta, with x_hat normalized by the
  batch statistics (:class:`_BNGamma`).  The slices add up to the batch
  gradient.  ``BatchRenormalization`` in training is read the same way,
  from the renormalized x it kept.
* ``LayerNormalization``, ``GroupNormalization`` and batch normalization
  with fixed statistics (``FixedBatchNormalization``: test mode,
  fine-tuning with frozen statistics) normalize each row (a token, an
  example) by statistics of its own or by constants, so the rows'
  contributions are exact per-example ones: ``gy * x_hat`` for gamma
  (:class:`_NormalizedGamma`, x_hat by each function's own definition),
  ``gy`` for beta, summed over the positions and over an example's rows.

The makers are the table's, in :mod:`chainer_vgc.statistics.handlers`.
"""

from chainer_vgc.statistics.uses import _as
from chainer_vgc.statistics.uses import _sum_over
from chainer_vgc.statistics.uses import _SumOverPositions
from chainer_vgc.statistics.uses import _Use


class _BNGamma(_Use):
    """BatchNormalization's gamma: the example's slice of the batch
    gradient, ``sum gy_z * x_hat_z`` over the positions, computed as
    ``inv_std * (sum gy_z * x_z - mean * sum gy_z)`` so that neither x_hat
    nor the product is formed as an array of x's size (NumPy's einsum; on
    the GPU one product per chunk)."""

    def __init__(self, xp, dtype, fn, x, gy):
        super(_BNGamma, self).__init__(xp, dtype)
        self.x, self.gy = _as(x, dtype), _as(gy, dtype)
        self.mean, self.inv_std = _as(fn.mean, dtype), _as(fn.inv_std, dtype)
        self.axes = tuple(a for a in fn.axis if a != 0)
        self.rows = x.shape[0]
        self.row_bytes = 3 * self.mean.size * dtype.itemsize

    def per_example(self, r0, r1):
        x, gy = self.x[r0:r1], self.gy[r0:r1]
        if not self.axes:
            s_gx, s_g = gy * x, gy
        else:
            s_gx = _sum_over(self.xp, gy, self.axes, x)
            s_g = _sum_over(self.xp, gy, self.axes)
        return self.inv_std * (s_gx - self.mean * s_g)


class _NormalizedGamma(_Use):
    """gamma of a normalization that couples no examples: per row,
    ``sum gy * x_hat`` over the positions, ``x_hat`` formed for the rows
    of a chunk only.  ``normalize(x)``: the rows' x_hat (the function's
    own definition of it); ``axes``: the axes summed (not 0, not the
    parameter's)."""

    def __init__(self, xp, dtype, x, gy, normalize, axes, param_size):
        super(_NormalizedGamma, self).__init__(xp, dtype)
        self.x, self.gy = _as(x, dtype), _as(gy, dtype)
        self.normalize, self.axes = normalize, tuple(axes)
        self.rows = x.shape[0]
        self.row_bytes = (2 * x[0].size + param_size) * dtype.itemsize

    def per_example(self, r0, r1):
        x_hat = self.normalize(self.x[r0:r1])
        return _sum_over(self.xp, self.gy[r0:r1], self.axes, x_hat)


def _layer_norm_hat(xp, eps):
    """x_hat of ``F.layer_normalization`` (Chainer's definition: each
    row's mean and biased variance over its features, ``+ eps``)."""
    def normalize(x):
        mu = x.mean(axis=1, keepdims=True)
        xm = x - mu
        var = (xm * xm).mean(axis=1, keepdims=True)
        return xm / xp.sqrt(var + x.dtype.type(eps))
    return normalize


def _group_norm_hat(xp, groups, eps):
    """x_hat of ``F.group_normalization``: each example's channels in
    ``groups`` groups, each group normalized over its channels and
    positions."""
    rows = _layer_norm_hat(xp, eps)  # each group a row

    def normalize(x):
        return rows(x.reshape(x.shape[0] * groups, -1)).reshape(x.shape)
    return normalize


def _fixed_norm_hat(xp, mean, var, eps, shape):
    """x_hat of ``F.fixed_batch_normalization``: the given statistics,
    broadcast to x along its key axes (``shape``)."""
    def normalize(x):
        m = mean.reshape(shape).astype(x.dtype, copy=False)
        v = var.reshape(shape).astype(x.dtype, copy=False)
        return (x - m) / xp.sqrt(v + x.dtype.type(eps))
    return normalize


# ---- the makers (input 1: gamma, input 2: beta) -----------------------------

def bn_gamma(fn, in_data, gy, dtype, xp):
    return _BNGamma(xp, dtype, fn, in_data[0], gy)


def bn_beta(fn, in_data, gy, dtype, xp):
    return _SumOverPositions(xp, dtype, gy, tuple(fn.axis))


def reduces_examples(fn):
    """BN statistics taken over the example axis (axis 0): otherwise an
    example's slice of the batch gradient is not defined here."""
    return 0 in tuple(fn.axis or (0,))


def ln_gamma(fn, in_data, gy, dtype, xp):
    return _NormalizedGamma(xp, dtype, in_data[0], gy,
                            _layer_norm_hat(xp, fn.eps), (), in_data[1].size)


def gn_gamma(fn, in_data, gy, dtype, xp):
    return _NormalizedGamma(xp, dtype, in_data[0], gy,
                            _group_norm_hat(xp, fn.groups, fn.eps),
                            tuple(range(2, in_data[0].ndim)),
                            in_data[1].size)


def gn_beta(fn, in_data, gy, dtype, xp):
    return _SumOverPositions(xp, dtype, gy, tuple(range(2, gy.ndim)))


def _fixed_key_shape(fn, x, gamma):
    """gamma's shape broadcast to x along the function's key axes."""
    shape = [1] * x.ndim
    for i, a in enumerate(fn.key_axis):
        shape[a] = gamma.shape[i]
    return tuple(shape)


def fixed_bn_gamma(fn, in_data, gy, dtype, xp):
    x, gamma, _, mean, var = in_data
    return _NormalizedGamma(
        xp, dtype, x, gy, _fixed_norm_hat(xp, _as(mean, dtype),
                                          _as(var, dtype), fn.eps,
                                          _fixed_key_shape(fn, x, gamma)),
        tuple(a for a in fn.axis if a != 0), gamma.size)


def brn_gamma(fn, in_data, gy, dtype, xp):
    """``BatchRenormalization`` in training (Chainer's old-style Function,
    through its adapter): as batch normalization, the example's slice of
    the batch gradient, ``sum gy_z * x_hat_renorm_z`` over the positions,
    from the renormalized x the function kept."""
    f = fn._function
    hat = f.x_hat_renorm
    return _NormalizedGamma(xp, dtype, hat, gy, lambda rows: rows,
                            tuple(range(1 + in_data[1].ndim, hat.ndim)),
                            in_data[1].size)


def brn_beta(fn, in_data, gy, dtype, xp):
    return _SumOverPositions(xp, dtype, gy,
                             tuple(range(1 + in_data[1].ndim, gy.ndim)))


def fixed_bn_beta(fn, in_data, gy, dtype, xp):
    return _SumOverPositions(xp, dtype, gy, tuple(fn.axis))


def ln_beta(fn, in_data, gy, dtype, xp):
    return _SumOverPositions(xp, dtype, gy, ())
