"""Variance-based compression, Fig. "Basic" of the paper (Sec. 4.1-4.4).

Per element i, with g = sum_z grad_z / B and s = sum_z (grad_z / B)**2::

    r += g;  v += s
    if r**2 > alpha * v:   send r (quantized, Sec. 4.2);  r = v = 0
    else:                  v *= zeta

The criterion is eq. (4), the efficient form of eq. (1) (App. A).

Quantization (``quantize=True``, the paper's setting): the selected values of
one tensor are quantized against e_k = floor(log2 max|r|) over the selected
elements (:func:`chainer_vgc.codec.pow2_encode`).  A selected element with
d > 7 (or a subnormal value) cannot be represented.  The paper's Encode()
then sets r = v = 0 anyway, so that element's update is *dropped*; this is
the default.  With ``keep_unrepresentable=True`` it stays in r instead (v
decays as for an unselected element) and is sent once it is representable.
As in the paper, the rounding error of sent elements is not carried over.

``quantize=False`` sends the exact residual (FMT_RAW, index + value words);
then sum of gradients = sum sent + r exactly up to float rounding.
"""

import numpy

from chainer_vgc.backends import arrays
from chainer_vgc import codec
from chainer_vgc.backends import registry
from chainer_vgc.backends.cuda import kernels
from chainer_vgc.engines.native import bindings
from chainer_vgc.rules import base


class VGC(base.CompressionRule):
    """Fig. "Basic" (Sec. 4.1-4.4).  alpha > 0 (1-2 recommended, Sec. 4.4),
    zeta in (0, 1] (0.999 in the paper's experiments)."""

    name = 'vgc'
    needs_sqsum = True
    hyperparameters = ('alpha', 'zeta', 'quantize', 'keep_unrepresentable')

    def __init__(self, alpha=1.5, zeta=0.999, quantize=True,
                 keep_unrepresentable=False, index_coding='auto'):
        self.alpha = base.check_real('alpha', alpha, low=0)
        self.zeta = base.check_real('zeta', zeta, low=0, high=1)
        self.quantize = bool(quantize)
        self.keep_unrepresentable = bool(keep_unrepresentable)
        #: the ``index_coding`` argument (used when quantizing)
        self.coding = base.check_coding(index_coding)
        #: dtype -> the two work arrays of :meth:`select` (NumPy path),
        #: grown to the largest parameter (private: not a hyperparameter)
        self._buffers = {}

    def init_state(self, size, dtype, xp):
        return base.residual_state(size, dtype, xp, ('r', 'v'))

    @property
    def index_coding(self):
        """FMT_POW2 words' index coding; None without quantization (the
        exact residuals go in FMT_RAW groups)."""
        return self.coding if self.quantize else None

    def _scratch(self, like):
        """Two work arrays shaped like ``like``: views of buffers kept for
        the largest parameter, so the hot path allocates nothing."""
        pair = self._buffers.get(like.dtype)
        if pair is None or pair[0].size < like.size:
            pair = self._buffers[like.dtype] = (
                numpy.empty(like.size, like.dtype),
                numpy.empty(like.size, like.dtype))
        return pair[0][:like.size], pair[1][:like.size]

    def select(self, grad, sqsum, state):
        """Accumulate, apply the criterion (eq. 4), decay v.

        Returns the boolean mask of selected elements; :meth:`compress`
        resets their r and v.
        """
        r, v = state['r'], state['v']
        alpha, zeta = r.dtype.type(self.alpha), r.dtype.type(self.zeta)
        xp = arrays.get_array_module(r)
        if arrays.is_cupy(xp):
            sel = xp.empty(r.shape, dtype=bool)
            kernels.get_kernel('vgc_basic_select')(
                grad, sqsum, alpha, zeta, r, v, sel)
            return sel
        r += grad.astype(r.dtype, copy=False)
        v += sqsum.astype(v.dtype, copy=False)
        lhs, rhs = self._scratch(r)
        numpy.multiply(r, r, out=lhs)
        sel = numpy.greater(lhs, numpy.multiply(v, alpha, out=rhs))
        v *= zeta  # selected elements are reset (or kept) by compress()
        return sel

    def count(self, grad, sqsum, state):
        """Elements that pass eq. (4) now (those quantization drops
        included), the state unchanged."""
        r, v = base.accumulated(grad, sqsum, state)
        return int((r * r > r.dtype.type(self.alpha) * v).sum())

    def compress(self, tensor_id, grad, sqsum, state):
        r, v = state['r'], state['v']
        xp = arrays.get_array_module(r)
        index = xp.nonzero(self.select(grad, sqsum, state))[0]
        if index.size == 0:
            return None
        values = r[index]
        if not self.quantize:
            r[index] = 0
            v[index] = 0
            return codec.raw_group(tensor_id, index, values, r.size)
        e_k = codec.floor_log2(xp.abs(values).max())
        if e_k == codec.LOG2_ZERO:  # every selected value is subnormal
            ok = xp.zeros(index.shape, dtype=bool)
            words = xp.zeros(index.shape, dtype=numpy.uint32)
        else:
            words, ok = codec.pow2_encode(values, index, e_k)
        sent = index[ok]
        # v is already decayed: a kept element continues like an unselected
        reset = sent if self.keep_unrepresentable else index
        r[reset] = 0
        v[reset] = 0
        if sent.size == 0:
            return None
        return codec.pow2_best_group(tensor_id, words[ok], sent, e_k, 1.0,
                                     r.size, coding=self.coding)


def _native_path(rule):
    """Fig. "Basic" on the native CPU backend: one fused pass; FMT_POW2 /
    FMT_GAP words, or FMT_RAW with quantization off."""
    def compress(ws, tensor_id, grad, sqsum, state, new_state, out):
        return bindings.compress_vgc(
            ws, tensor_id, grad, sqsum, state['r'], state['v'],
            new_state['r'], new_state['v'], rule.alpha, rule.zeta,
            rule.quantize, rule.keep_unrepresentable, out,
            coding=rule.coding)

    def max_words(size, dtype):
        if rule.quantize:
            return codec.pow2_max_words(size, rule.coding)
        return base.raw_max_words(size, dtype, True)
    return registry.FastPath(compress, max_words, True)


def _device_select(rule, p):
    """Fig. "Basic"'s select pass over the whole model on a GPU: the
    criterion and the next r, v (``vgc_model_vgc_select``), then which
    selected elements e_k can represent (``vgc_model_keep``)."""
    kernels.get_kernel('vgc_model_vgc_select')(
        p.g, p.sqsums(), p.old['r'], p.old['v'], p.offsets, p.nt, p.active,
        p.sdt.type(rule.alpha), p.sdt.type(rule.zeta), p.new['r'],
        p.new['v'], p.sign, p.flags, p.maxbits)
    kernels.get_kernel('vgc_model_keep')(
        p.new['r'], p.sign, p.maxbits, p.offsets, p.nt, p.ok)


#: the whole-model GPU step's part (quantized only: unquantized vgc runs
#: the rule's own compress)
_DEVICE_RULE = registry.DeviceRule(('r', 'v'), _device_select, True, None,
                                   False)

registry.register('native', VGC, _native_path)
registry.register('cuda', VGC,
                  lambda rule: _DEVICE_RULE if rule.quantize else None)
