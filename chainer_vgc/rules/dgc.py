"""Deep Gradient Compression (Lin, Han, Mao, Wang, Dally, ICLR 2018): each
step, every worker sends the largest ``density`` fraction of its
accumulated velocity, exactly those elements, and keeps the rest.

Per parameter, with momentum factor m (``momentum_factor``; 0: plain top-k
with error feedback), minibatch gradient g and state u (the local
velocity) and r (the accumulated velocity, the delayed update):

1. momentum correction: u <- m u + g, then r <- r + u (the residual
   accumulates the velocity, not the raw gradient, so that the delayed
   update carries the momentum it would have had);
2. the k = ceil(density n) elements of largest ``|r|`` are selected (ties at
   the k-th largest ``|r|`` broken by the lower index; zeros never sent);
3. they are sent with their values (FMT_RAW: a 32-bit index and the state
   dtype's value each, so the residual reset loses nothing) and their r
   is set to 0; momentum factor masking (``momentum_masking``) sets their
   u to 0 too, so that a sent element's stale momentum does not push it
   again.

The optimizer then applies the mean of what the workers sent as a plain
gradient: with momentum correction on, make it momentum-free
(``chainer.optimizers.SGD``), the momentum being applied here.

Warm-up (``density_warmup_steps`` > 0): the density starts at 25 % and
falls by 4x after every ``density_warmup_steps`` steps (25 %, 6.25 %,
1.5625 %, 0.39 %, ...) until it reaches ``density``, the paper's
exponential schedule over its first epochs (give it the steps of an
epoch).  The step count is the rule's extra state, saved with snapshots.

Not here yet (issue 51): DGC's local gradient clipping, its threshold
estimated from a sample (the selection here is the exact top-k that the
sample's fix-up arrives at), gap-coded indices, fp16 values and the
native and GPU fast paths: this rule runs its NumPy code on every
backend.  DGC compresses only tensors of more than one dimension: give
the others to the dense group (``min_size`` or ``exclude``).
"""

import math

import numpy

from chainer_vgc.backends import arrays
from chainer_vgc import codec
from chainer_vgc.rules import base

#: the first warm-up density and the factor it falls by at each stage
WARMUP_START = 0.25
WARMUP_FACTOR = 4.0


class DGC(base.CompressionRule):
    """Deep Gradient Compression: top-k of the accumulated velocity (the
    module doc); ``density`` in (0, 1]."""

    name = 'dgc'
    hyperparameters = ('density', 'momentum_factor', 'momentum_masking',
                       'density_warmup_steps')
    #: the velocity u and the accumulated r are both averaged over the
    #: saved ranks when a run resumes at another world size
    residual_keys = ('r', 'u')
    variance_keys = ()

    def __init__(self, density=0.001, momentum_factor=0.9,
                 momentum_masking=True, density_warmup_steps=0):
        self.density = base.check_real('density', density, low=0, high=1)
        self.momentum_factor = base.check_real(
            'momentum_factor', momentum_factor, low=0, high=1,
            low_open=False, high_open=True)
        if not isinstance(momentum_masking, (bool, numpy.bool_)):
            raise ValueError('momentum_masking must be True or False, got '
                             '{!r}'.format(momentum_masking))
        self.momentum_masking = bool(momentum_masking)
        self.density_warmup_steps = base.check_int(
            'density_warmup_steps', density_warmup_steps, 0, 2 ** 62)
        #: steps begun (for the warm-up's density)
        self.steps = 0

    def init_state(self, size, dtype, xp):
        return base.residual_state(size, dtype, xp, ('r', 'u'))

    def get_extra_state(self):
        return {'steps': str(self.steps)}

    def set_extra_state(self, state):
        self.steps = int(state.get('steps', 0))

    def begin_step(self):
        self.steps += 1

    def current_density(self, step=None):
        """The density of step ``step`` (1, 2, ...; default: the step
        begun last): the warm-up's stage, not below ``density``."""
        if not self.density_warmup_steps:
            return self.density
        step = self.steps if step is None else step
        stage = (max(step, 1) - 1) // self.density_warmup_steps
        return max(self.density,
                   WARMUP_START / WARMUP_FACTOR ** min(stage, 64))

    def _accumulate(self, grad, state):
        """Momentum correction, in place: u <- m u + g, r <- r + u."""
        u, r = state['u'], state['r']
        dt = r.dtype
        g = grad.astype(dt, copy=False)
        if self.momentum_factor:
            u *= dt.type(self.momentum_factor)
            u += g
        else:
            u[...] = g
        r += u
        return r, u

    def select(self, r, density):
        """The indices (sorted) of the k = ceil(density n) largest ``|r|``,
        ties broken by the lower index, zeros left out."""
        xp = arrays.get_array_module(r)
        n = int(r.size)
        if n == 0:
            return xp.zeros(0, numpy.int64)
        k = min(n, max(1, int(math.ceil(density * n))))
        mag = xp.abs(r)
        kth = xp.partition(mag, n - k)[n - k]  # the k-th largest
        above = xp.nonzero(mag > kth)[0]
        at = xp.nonzero(mag == kth)[0][:k - int(above.size)]
        index = xp.sort(xp.concatenate([above, at]))
        return index[mag[index] > 0]

    def count(self, grad, sqsum, state):
        st = {key: a.copy() for key, a in state.items()}
        r, _ = self._accumulate(grad, st)  # (the next step's density)
        return int(self.select(r, self.current_density(self.steps + 1))
                   .size)

    def compress(self, tensor_id, grad, sqsum, state):
        r, u = self._accumulate(grad, state)
        index = self.select(r, self.current_density())
        if index.size == 0:
            return None
        values = r[index].copy()
        r[index] = 0
        if self.momentum_masking:
            u[index] = 0
        return codec.raw_group(tensor_id, index, values, r.size)
