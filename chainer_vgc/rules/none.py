"""No compression, the paper's Table 1 baseline: every element is sent
exactly (dense FMT_RAW group)."""

from chainer_vgc.backends import arrays
from chainer_vgc import codec
from chainer_vgc.backends import registry
from chainer_vgc.engines.native import bindings
from chainer_vgc.rules import base


class NoCompression(base.CompressionRule):
    """Dense exchange.  In a communicator it is ChainerMN's naive allreduce
    (:attr:`exchange`); :meth:`compress` is the one-process path (the
    simulation, a compressor used alone)."""

    name = 'none'
    exchange = 'allreduce'

    def compress(self, tensor_id, grad, sqsum, state):
        if grad.size == 0:
            return None
        values = grad.astype(arrays.state_dtype(grad.dtype), copy=False)
        return codec.raw_group(tensor_id, None, values, grad.size)


def _native_path(rule):
    """No compression on the native CPU backend: one copy into a dense
    FMT_RAW group."""
    def compress(ws, tensor_id, grad, sqsum, state, new_state, out):
        return bindings.compress_none(ws, tensor_id, grad, out)
    return registry.FastPath(
        compress, lambda size, dtype: base.raw_max_words(size, dtype, False),
        True)


registry.register('native', NoCompression, _native_path)
# the GPU engine's dense step: every element, no select pass
_DEVICE_RULE = registry.DeviceRule((), None, False, None, True)

registry.register('cuda', NoCompression, lambda rule: _DEVICE_RULE)
