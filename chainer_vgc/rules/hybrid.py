"""Hybrid of variance-based compression and Strom's method: Fig. "Hybrid",
Sec. 4.5 of the paper.

Per element, with tau the Strom threshold::

    r += g;  v += s
    if |r| > tau and r**2 > alpha * v:
        send S = sign(r) * tau;  r -= S
        v = max(v - 2 |r_before| tau + tau**2, 0)
    v *= zeta                              # every step

Variance correction: we follow the *text* of Sec. 4.5, which derives it by
replacing a**2 with (a - b)**2: sum g**2 becomes sum g**2 - 2 S sum g + S**2,
where sum g is the residual r *before* S is subtracted.  The listing of
Fig. "Hybrid" writes the same expression after ``r -= sign(r) tau``, i.e.
with the reduced r, which adds 2 tau**2 more than the derivation and is not
(a - b)**2 of anything; we take it for a transcription slip.

The value on the wire is float32(tau) (FMT_POW2 with e_k = 0, d = 0,
scale = tau: :func:`chainer_vgc.codec.pow2_sign_group`), and r is reduced by
exactly that value (:func:`chainer_vgc.codec.wire_scale`), so the residual
and what receivers add agree.
"""

import numpy

from chainer_vgc.backends import arrays
from chainer_vgc import codec
from chainer_vgc.backends import registry
from chainer_vgc.backends.cuda import kernels
from chainer_vgc.engines.native import bindings
from chainer_vgc.rules import base


class Hybrid(base.CompressionRule):
    """Fig. "Hybrid" (Sec. 4.5): alpha > 0, zeta in (0, 1], tau > 0."""

    name = 'hybrid'
    needs_sqsum = True
    hyperparameters = ('tau', 'alpha', 'zeta')

    def __init__(self, tau=0.01, alpha=2.0, zeta=0.999, index_coding='auto'):
        self.tau = base.check_real('tau', tau, low=0)
        self.alpha = base.check_real('alpha', alpha, low=0)
        self.zeta = base.check_real('zeta', zeta, low=0, high=1)
        self.index_coding = base.check_coding(index_coding)

    def init_state(self, size, dtype, xp):
        return base.residual_state(size, dtype, xp, ('r', 'v'))

    def step(self, grad, sqsum, state):
        """One step of Fig. "Hybrid"; returns int8 signs (+1, -1, 0)."""
        r, v = state['r'], state['v']
        dt = r.dtype
        alpha, zeta = dt.type(self.alpha), dt.type(self.zeta)
        tau = codec.wire_scale(self.tau, dt)
        xp = arrays.get_array_module(r)
        if arrays.is_cupy(xp):
            sign = xp.empty(r.shape, dtype=numpy.int8)
            kernels.get_kernel('vgc_hybrid_step')(
                grad, sqsum, alpha, zeta, tau, r, v, sign)
            return sign
        r += grad.astype(dt, copy=False)
        v += sqsum.astype(dt, copy=False)
        # candidates first (|r| > tau is rare), then the criterion on them
        index = numpy.nonzero(numpy.abs(r) > tau)[0]
        ri, vi = r[index], v[index]
        index, ri, vi = (a[ri * ri > alpha * vi] for a in (index, ri, vi))
        positive = ri > 0
        sign = numpy.zeros(r.shape, dtype=numpy.int8)
        sign[index] = numpy.where(positive, 1, -1)
        mag = numpy.abs(ri)
        r[index] = numpy.where(positive, ri - tau, ri + tau)
        corrected = vi - 2 * mag * tau + tau * tau
        v[index] = numpy.where(corrected > 0, corrected, 0)
        v *= zeta
        return sign

    def count(self, grad, sqsum, state):
        """Elements past both thresholds now, the state unchanged."""
        r, v = base.accumulated(grad, sqsum, state)
        tau = codec.wire_scale(self.tau, r.dtype)
        xp = arrays.get_array_module(r)
        return int(((xp.abs(r) > tau) &
                    (r * r > r.dtype.type(self.alpha) * v)).sum())

    def compress(self, tensor_id, grad, sqsum, state):
        sign = self.step(grad, sqsum, state)
        return codec.pow2_sign_group(tensor_id, sign, self.tau,
                                     state['r'].dtype,
                                     coding=self.index_coding)


def _native_path(rule):
    """Fig. "Hybrid" on the native CPU backend: one fused pass; FMT_POW2 /
    FMT_GAP sign words."""
    coding = rule.index_coding

    def compress(ws, tensor_id, grad, sqsum, state, new_state, out):
        return bindings.compress_hybrid(
            ws, tensor_id, grad, sqsum, state['r'], state['v'],
            new_state['r'], new_state['v'], rule.alpha, rule.zeta, rule.tau,
            out, coding=coding)
    return registry.FastPath(
        compress, lambda size, dtype: codec.pow2_max_words(size, coding),
        True)


def _device_select(rule, p):
    """Fig. "Hybrid"'s select pass over the whole model on a GPU
    (``vgc_model_hybrid_step``): both thresholds, the next r, v."""
    kernels.get_kernel('vgc_model_hybrid_step')(
        p.g, p.sqsums(), p.old['r'], p.old['v'], p.offsets, p.nt, p.active,
        p.sdt.type(rule.alpha), p.sdt.type(rule.zeta),
        codec.wire_scale(rule.tau, p.sdt), p.new['r'], p.new['v'], p.sign,
        p.ok, p.flags)


registry.register('native', Hybrid, _native_path)
_DEVICE_RULE = registry.DeviceRule(('r', 'v'), _device_select, False,
                                   lambda rule: rule.tau, False)

registry.register('cuda', Hybrid, lambda rule: _DEVICE_RULE)
