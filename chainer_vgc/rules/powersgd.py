"""PowerSGD (Vogels, Karimireddy, Jaggi, NeurIPS 2019): each matrix-shaped
gradient is replaced by a rank-r approximation P Q^T that the workers sum
with two allreduces, so that the volume does not grow with their number.

Per compressed tensor, its gradient g seen as an n x m matrix (the first
axis against the others: a convolution's W is out x in*kh*kw), with the
error feedback E and the last step's Q (m x r) as its state, one step is
the paper's Algorithm 1 with error feedback (its Algorithm 2):

1. M = g + E;
2. P = M Q, then P = the mean of P over the workers (the first
   allreduce, every tensor's P in one buffer);
3. P^ = the Gram-Schmidt orthonormalization of P's columns
   (:func:`orthogonalize`);
4. Q = M^T P^, then Q = its mean over the workers (the second
   allreduce);
5. the update every worker applies is P^ Q^T; the next E is M - P^ Q^T,
   and the next step starts from this Q (warm start; with
   ``warm_start=False`` from a new random Q each step).

The first Q of a tensor is i.i.d. standard normal, the same on every
worker (drawn from ``seed`` and the tensor's position).  Vectors, and the
matrices whose rank-r factors would not be ``min_compression_rate``
times smaller than the matrix (n m / ((n + m) r)), go to the dense group
(:meth:`PowerSGD.keeps_dense`), as in PyTorch's DDP hook; so does every
parameter during the communicator's ``warmup`` steps (plain allreduce).

What this worker sends is (n + m) r numbers a tensor, whatever the
number of workers; the figures report them as the elements sent
(:mod:`chainer_vgc.reporting`).  The rounds run on the collectives'
allreduce (:meth:`chainer_vgc.chainermn.collectives.Collectives.
allreduce_sum`), in the state dtype, NumPy or CuPy alike; the
compressor's :meth:`~chainer_vgc.compressor.GradientCompressor.reduce`
checks the inputs, agrees on faults with the other workers and keeps
the state.
"""

import math

import numpy

from chainer_vgc.backends import arrays
from chainer_vgc.rules import base

#: added to a column's norm before it is divided by it (the paper's
#: implementation): a zero column stays zero instead of becoming NaN
ORTHOGONALIZATION_EPSILON = 1e-8


def matrix_shape(shape):
    """``(n, m)``: a tensor of ``shape`` as PowerSGD's matrix, its first
    axis against the others."""
    n = int(shape[0]) if len(shape) else 1
    return n, int(math.prod(shape[1:]))


def orthogonalize(p):
    """Gram-Schmidt over the columns of ``p`` (n x r), in place and in
    order: each column is divided by its norm (plus
    :data:`ORTHOGONALIZATION_EPSILON`), then its projection is taken off
    each column after it, one at a time (each product summed over one
    contiguous column, as the reference sums it)."""
    xp = arrays.get_array_module(p)
    eps = p.dtype.type(ORTHOGONALIZATION_EPSILON)
    r = p.shape[1]
    for i in range(r):
        col = p[:, i:i + 1]
        col /= xp.sqrt(xp.sum(col * col)) + eps
        for j in range(i + 1, r):
            other = p[:, j:j + 1]
            other -= xp.sum(col * other, axis=0) * col
    return p


class PowerSGD(base.CompressionRule):
    """PowerSGD: rank-``matrix_rank`` (r) factors of each matrix, summed by two
    allreduces a step (the module doc)."""

    name = 'powersgd'
    exchange = 'allreduce_factors'
    hyperparameters = ('matrix_rank', 'min_compression_rate',
                       'warm_start', 'seed')
    #: E is delayed gradient (merged as a residual at another world size);
    #: Q is the same on every worker (see :meth:`share_residuals`)
    residual_keys = ('r',)
    variance_keys = ()

    def __init__(self, matrix_rank=2, min_compression_rate=2.0,
                 warm_start=True, seed=0):
        self.matrix_rank = base.check_int('matrix_rank', matrix_rank, 1,
                                          2 ** 20)
        self.min_compression_rate = base.check_real(
            'min_compression_rate', min_compression_rate, low=0,
            low_open=False)
        if not isinstance(warm_start, (bool, numpy.bool_)):
            raise ValueError('warm_start must be True or False, got '
                             '{!r}'.format(warm_start))
        self.warm_start = bool(warm_start)
        self.seed = base.check_int('seed', seed, 0, 2 ** 32 - 1)
        #: steps begun (a fresh Q each step without warm start)
        self.steps = 0

    def keeps_dense(self, shape):
        """Vectors, and matrices whose factors would not be
        ``min_compression_rate`` times smaller (n m < rate (n + m) r)."""
        if len(shape) < 2:
            return True
        n, m = matrix_shape(shape)
        return (n * m < self.min_compression_rate * (n + m)
                * self.matrix_rank)

    def init_state(self, size, dtype, xp):
        """E (``'r'``, the size of the tensor) and an empty Q (``'q'``):
        a tensor's Q is made by :meth:`tensor_state`, which knows its
        shape."""
        state = base.residual_state(size, dtype, xp, ('r',))
        state['q'] = xp.zeros(0, dtype=state['r'].dtype)
        return state

    def tensor_state(self, tensor_id, shape, dtype, xp):
        n, m = matrix_shape(shape)
        state = base.residual_state(n * m, dtype, xp, ('r',))
        state['q'] = self._random_q(tensor_id, m, state['r'].dtype, xp, 0)
        return state

    def _random_q(self, tensor_id, m, dtype, xp, step):
        """An m x r standard normal Q (flat), the same on every worker:
        drawn on the host from (seed, tensor, step)."""
        draw = numpy.random.RandomState(
            [self.seed, int(tensor_id), int(step)]).standard_normal(
                m * self.matrix_rank)
        return xp.asarray(draw.astype(dtype))

    def get_extra_state(self):
        return {'steps': str(self.steps)}

    def set_extra_state(self, state):
        self.steps = int(state.get('steps', 0))

    def begin_step(self):
        self.steps += 1

    def share_residuals(self, saved):
        """E merged as a residual (the saved ranks' mean); Q, the same on
        every saved rank, is rank 0's."""
        out = super(PowerSGD, self).share_residuals(
            [{'r': st['r']} for st in saved])
        if saved:
            out['q'] = saved[0]['q'].copy()
        return out

    def reduce(self, tensors, mean):
        """Algorithm 1 over every tensor at once (the module doc): one
        allreduce of all the Ps, one of all the Qs."""
        r = self.matrix_rank
        ms, qs = [], []
        for tensor_id, shape, grad, state in tensors:
            n, m = matrix_shape(shape)
            ms.append((grad + state['r']).reshape(n, m))
            q = state['q']
            if not self.warm_start and self.steps > 1:
                q = self._random_q(tensor_id, m, q.dtype,
                                   arrays.get_array_module(q), self.steps)
            qs.append(q.reshape(m, r))
        ps = mean([(mat @ q).reshape(-1) for mat, q in zip(ms, qs)])
        p_hats = [orthogonalize(p.reshape(mat.shape[0], r))
                  for p, mat in zip(ps, ms)]
        qs = mean([(mat.T @ p_hat).reshape(-1)
                   for mat, p_hat in zip(ms, p_hats)])
        means, new_states, elements = [], [], []
        for mat, p_hat, q in zip(ms, p_hats, qs):
            n, m = mat.shape
            update = p_hat @ q.reshape(m, r).T
            means.append(update.reshape(-1))
            mat -= update  # E = M - P^ Q^T (M, this step's own, is done)
            new_states.append({'r': mat.reshape(-1), 'q': q})
            elements.append((n + m) * r)
        return means, new_states, elements
