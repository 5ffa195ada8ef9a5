"""Strom (2015) threshold quantization: a baseline of the paper's Table 1,
and the threshold that Fig. "Hybrid" (Sec. 4.5) combines with the variance
criterion.

Per element: ``r += g``; if ``|r| > tau``, send ``sign(r) * tau`` and
``r -= sign(r) * tau``.
The residual is kept; no variance is used.  Values on the wire as for the
hybrid rule: float32(tau) (:func:`chainer_vgc.codec.wire_scale`), in a
FMT_POW2 group (:func:`chainer_vgc.codec.pow2_sign_group`).
"""

import numpy

from chainer_vgc.backends import arrays
from chainer_vgc import codec
from chainer_vgc.backends import registry
from chainer_vgc.backends.cuda import kernels
from chainer_vgc.engines.native import bindings
from chainer_vgc.rules import base


class Strom(base.CompressionRule):
    """Strom's threshold (the paper's Table 1 baseline): tau > 0."""

    name = 'strom'
    hyperparameters = ('tau',)

    def __init__(self, tau=0.01, index_coding='auto'):
        self.tau = base.check_real('tau', tau, low=0)
        self.index_coding = base.check_coding(index_coding)

    def init_state(self, size, dtype, xp):
        return base.residual_state(size, dtype, xp, ('r',))

    def step(self, grad, state):
        """Accumulate and threshold; returns int8 signs (+1, -1, 0)."""
        r = state['r']
        tau = codec.wire_scale(self.tau, r.dtype)
        xp = arrays.get_array_module(r)
        if arrays.is_cupy(xp):
            sign = xp.empty(r.shape, dtype=numpy.int8)
            kernels.get_kernel('vgc_strom_step')(grad, tau, r, sign)
            return sign
        r += grad.astype(r.dtype, copy=False)
        index = numpy.nonzero(numpy.abs(r) > tau)[0]
        positive = r[index] > 0
        sign = numpy.zeros(r.shape, dtype=numpy.int8)
        sign[index] = numpy.where(positive, 1, -1)
        r[index] = numpy.where(positive, r[index] - tau, r[index] + tau)
        return sign

    def count(self, grad, sqsum, state):
        """Elements past tau now, the state unchanged."""
        r, _ = base.accumulated(grad, None, state)
        xp = arrays.get_array_module(r)
        return int((xp.abs(r) > codec.wire_scale(self.tau, r.dtype)).sum())

    def compress(self, tensor_id, grad, sqsum, state):
        sign = self.step(grad, state)
        return codec.pow2_sign_group(tensor_id, sign, self.tau,
                                     state['r'].dtype,
                                     coding=self.index_coding)


def _native_path(rule):
    """Strom's threshold on the native CPU backend: one fused pass;
    FMT_POW2 / FMT_GAP sign words."""
    coding = rule.index_coding

    def compress(ws, tensor_id, grad, sqsum, state, new_state, out):
        return bindings.compress_strom(ws, tensor_id, grad, state['r'],
                                       new_state['r'], rule.tau, out,
                                       coding=coding)
    return registry.FastPath(
        compress, lambda size, dtype: codec.pow2_max_words(size, coding),
        True)


def _device_select(rule, p):
    """Strom's threshold over the whole model on a GPU
    (``vgc_model_strom_step``): the next r, the signs."""
    kernels.get_kernel('vgc_model_strom_step')(
        p.g, p.old['r'], p.offsets, p.nt, p.active,
        codec.wire_scale(rule.tau, p.sdt), p.new['r'], p.sign, p.ok,
        p.flags)


registry.register('native', Strom, _native_path)
_DEVICE_RULE = registry.DeviceRule(('r',), _device_select, False,
                                   lambda rule: rule.tau, False)

registry.register('cuda', Strom, lambda rule: _DEVICE_RULE)
