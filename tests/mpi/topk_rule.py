"""A compression rule written outside the package, as a user would: the k
largest |r| of each tensor, sent exactly (raw groups), the rest kept in r.
Used by check_groups.py and check_resume.py through create_communicator."""

import numpy

from chainer_vgc import codec
from chainer_vgc.rules import CompressionRule
from chainer_vgc.rules import base


class TopK(CompressionRule):

    name = 'topk_test'
    hyperparameters = ('ratio', 'kinds')

    def __init__(self, ratio=0.1, kinds=('W', 'b')):
        self.ratio = ratio
        self.kinds = kinds  # a tuple: recorded in snapshots as a list

    def init_state(self, size, dtype, xp):
        return base.residual_state(size, dtype, xp, ('r',))

    def compress(self, tensor_id, grad, sqsum, state):
        r = state['r']
        r += grad.astype(r.dtype)
        k = int(r.size * self.ratio)
        if k == 0:
            return None
        index = numpy.sort(numpy.argsort(-numpy.abs(r), kind='stable')[:k])
        values = r[index].copy()
        r[index] = 0
        return codec.raw_group(tensor_id, index, values, r.size)
