"""The batch gradient of a convolution's weight, taken from the statistics'
own per-example products (paper Sec. 4.1; Sec. 5 on the cost of
per-sample gradients).

The blocked formulation of :mod:`~chainer_vgc.statistics.contraction`
forms every example's weight gradient ``A_z B_z`` to square it: one more
weight-gradient GEMM per convolution, which made the statistics cost about
1.3x a plain step on the CIFAR-shaped VGG and ResNet-50 (issue 38).  Those
products also hold the batch gradient, their sum over the examples.  While
a :class:`~chainer_vgc.statistics.PerSampleSquares` backward runs on the
CPU, :class:`FusedWeightGradient` replaces Chainer's
``Convolution2DGradW.forward_cpu`` (im2col, then one GEMM over the batch)
for the convolutions whose statistics take the blocked formulation: the
hook's ``backward_preprocess`` marks such a node's ``(x, gy)``; the
replacement, called by the node's backward with those very arrays,
computes the sum of squares (written where the hook writes it) and returns
the batch gradient from the same pass; ``backward_postprocess`` then
leaves that parameter alone.  Every other call goes to Chainer's.

What changes: the weight's gradient is summed example by example (in
blocks of rows) instead of in one GEMM over the batch, so its last bits
may differ from a plain ``loss.backward()``'s; the sums of squares are
bit for bit the ones the hook computes otherwise.  Only where it is exact
for the method's definition: a Convolution2D weight with one use in the
graph, rows grouped by example (the minibatch's first axis), a weight
dtype that is the statistics' dtype (float32, float64) and the dtype of
the layer's input and output gradient, NumPy arrays.
``PerSampleSquares(fused_weight_gradient=False)`` keeps Chainer's
gradient everywhere.
"""

from chainer.functions.connection import convolution_2d as _conv
import numpy

from chainer_vgc.backends import arrays
from chainer_vgc.statistics import contraction


def eligible(fn, k, param, positions, x, gy):
    """Whether the use of ``param`` (input ``k`` of node ``fn``, whose
    products have ``positions`` positions per example, on input ``x`` and
    output gradient ``gy``) may take its batch gradient from the
    statistics' products: Chainer's would be computed in x's dtype, the
    products are in the weight's, so all three must agree."""
    dtype = param.dtype
    return (type(fn) is _conv.Convolution2DFunction and k == 1 and
            isinstance(x, numpy.ndarray) and isinstance(gy, numpy.ndarray)
            and not getattr(fn, '_use_ideep', False)
            and dtype == arrays.state_dtype(dtype) and x.dtype == dtype
            and gy.dtype == dtype
            and not contraction.uses_gram(numpy, positions))


class FusedWeightGradient(object):
    """While active (``with``, one backward pass), Chainer's
    ``Convolution2DGradW.forward_cpu`` is replaced: a call whose inputs
    are a pair marked by :meth:`mark` computes that parameter's sum of
    squares and returns the batch gradient from the same products (module
    doc); other calls run Chainer's.  :attr:`done` holds the indices of
    the parameters handled so."""

    def __init__(self):
        self._marked = {}
        self._original = None
        self.done = set()

    @property
    def active(self):
        """Whether Chainer's weight gradient is replaced now."""
        return self._original is not None

    def forget(self, x, gy):
        """Drop the mark of ``(x, gy)`` (a node whose weight needed no
        gradient never made the call)."""
        self._marked.pop((id(x), id(gy)), None)

    def mark(self, x, gy, index, run):
        """The weight-gradient call on exactly the arrays ``x`` and ``gy``
        is to be handled: ``run()`` computes parameter ``index``'s sum of
        squares and returns its batch gradient (the weight's shape)."""
        self._marked[(id(x), id(gy))] = (x, gy, index, run)

    def reset(self):
        """Forget the last pass's marks and :attr:`done`."""
        self._marked, self.done = {}, set()

    def __enter__(self):
        self.reset()
        self._original = _conv.Convolution2DGradW.forward_cpu
        original, fused = self._original, self

        def forward_cpu(node, inputs):
            x, gy = inputs
            entry = fused._marked.pop((id(x), id(gy)), None)
            if entry is None or entry[0] is not x or entry[1] is not gy:
                return original(node, inputs)
            node.retain_inputs((0, 1))  # as Chainer's, for its backward
            grad = entry[3]()
            fused.done.add(entry[2])
            return grad.astype(node.W_dtype, copy=False),

        _conv.Convolution2DGradW.forward_cpu = forward_cpu
        return self

    def __exit__(self, *exc):
        _conv.Convolution2DGradW.forward_cpu = self._original
        self._original, self._marked = None, {}
