"""Strom (2015) threshold quantization, a baseline of the paper's tables.

Per element: r += g; if |r| > tau, send sign(r) * tau and r -= sign(r) * tau.
The residual is kept; no variance is used.  Values on the wire as in
:mod:`chainer_vgc.rules.hybrid` (float32(tau), FMT_POW2).
"""

import numpy

from chainer_vgc import backend
from chainer_vgc import codec
from chainer_vgc import kernels
from chainer_vgc import native
from chainer_vgc.rules import base
from chainer_vgc.rules.hybrid import encode_signs
from chainer_vgc.rules.hybrid import wire_tau


class Strom(base.CompressionRule):
    """Threshold tau > 0."""

    name = 'strom'

    def __init__(self, tau=0.01):
        self.tau = base.check_real('tau', tau, low=0)

    def init_state(self, size, dtype, xp):
        return base.residual_state(size, dtype, xp, ('r',))

    def max_words(self, size, dtype):
        return codec.HEADER_WORDS + size

    def compress_native(self, ws, tensor_id, grad, sqsum, state, new_state,
                        out):
        """:meth:`compress` as one fused pass (``kernels/vgc_host.cpp``)."""
        return native.compress_strom(ws, tensor_id, grad, state['r'],
                                     new_state['r'], self.tau, out)

    def step(self, grad, state):
        """Accumulate and threshold; returns int8 signs (+1, -1, 0)."""
        r = state['r']
        tau = wire_tau(self.tau, r.dtype)
        xp = backend.get_array_module(r)
        if backend.is_cupy(xp):
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

    def compress(self, tensor_id, grad, sqsum, state):
        sign = self.step(grad, state)
        return encode_signs(tensor_id, sign, self.tau, state['r'].dtype)
