"""No compression: every element is sent exactly (dense FMT_RAW group)."""

from chainer_vgc import backend
from chainer_vgc import codec
from chainer_vgc.rules import base


class NoCompression(base.CompressionRule):
    name = 'none'
    uses_index_words = False

    def compress(self, tensor_id, grad, sqsum, state):
        if grad.size == 0:
            return None
        values = grad.astype(backend.state_dtype(grad.dtype), copy=False)
        return codec.raw_group(tensor_id, None, values, grad.size)
