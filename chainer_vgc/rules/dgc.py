"""Deep Gradient Compression (Lin, Han, Mao, Wang, Dally, ICLR 2018): each
step, every worker sends the largest ``density`` fraction of its
accumulated velocity, exactly those elements, and keeps the rest.

Per parameter, with momentum factor m (``momentum_factor``; 0: plain top-k
with error feedback), minibatch gradient g and state u (the local
velocity) and r (the accumulated velocity, the delayed update):

0. local gradient clipping (``clip_norm`` c, None: off): when the norm of
   this worker's gradient over every tensor it compresses (the dense
   group's vectors are neither counted nor clipped) exceeds c / sqrt(p),
   p the workers, every such g is multiplied by (c / sqrt(p)) /
   (norm + 1e-6) (the paper's Sec. 3.2: each worker clips its own
   gradient before accumulating it, the threshold scaled by p**-1/2 so
   that the sum of p independent such gradients has a norm of about c);
1. momentum correction: u <- m u + g, then r <- r + u (the residual
   accumulates the velocity, not the raw gradient, so that the delayed
   update carries the momentum it would have had);
2. the k = ceil(density n) elements of largest ``|r|`` are selected (ties
   at the k-th largest ``|r|`` broken by the lower index; zeros never
   sent);
3. they are sent as FMT_SPARSE (:mod:`chainer_vgc.codec.sparse`):
   gap-coded indices and, by default (``value_dtype='float16'``), float16
   values scaled by a power of two per tensor, as DGC's implementation
   sends float16; an element's r becomes what rounding left of it (0
   with ``value_dtype='float32'`` on a float32 model), so nothing is lost:
   the rounding is fed back like everything not sent.  At 0.1 % density a
   gap code takes about 12 bits, so a float16 element costs about 29 bits
   on the wire against 45 with float32 values.  Momentum factor masking
   (``momentum_masking``) sets the sent elements' u to 0, so that a sent
   element's stale momentum does not push it again.

The optimizer then applies the mean of what the workers sent as a plain
gradient: with momentum correction on, make it momentum-free
(``chainer.optimizers.SGD``), the momentum being applied here.

Warm-up (``density_warmup_steps`` > 0): the density starts at 25 % and
falls by 4x after every ``density_warmup_steps`` steps (25 %, 6.25 %,
1.5625 %, 0.39 %, ...) until it reaches ``density``, the paper's
exponential schedule over its first epochs (give it the steps of an
epoch).  The step count is the rule's extra state, saved with snapshots.

DGC compresses only tensors of more than one dimension: vectors (biases,
normalization layers' parameters) go to the dense group
(:meth:`DGC.keeps_dense`).  The selection is the exact top-k: the native
backend's fused pass finds it from a threshold estimated on a sample, the
count fixed up, the same elements bit for bit.
"""

import ctypes
import math

import numpy

from chainer_vgc.backends import arrays
from chainer_vgc.backends import registry
from chainer_vgc.backends.cuda import kernels
from chainer_vgc import codec
from chainer_vgc.engines.native import bindings
from chainer_vgc.rules import base

#: the first warm-up density and the factor it falls by at each stage
WARMUP_START = 0.25
WARMUP_FACTOR = 4.0
#: added to the gradient's norm before the clipping threshold is divided
#: by it (as ``torch.nn.utils.clip_grad_norm_``)
CLIP_EPSILON = 1e-6
VALUE_DTYPES = ('float16', 'float32')


class DGC(base.CompressionRule):
    """Deep Gradient Compression: top-k of the accumulated velocity (the
    module doc); ``density`` in (0, 1]."""

    name = 'dgc'
    hyperparameters = ('density', 'momentum_factor', 'momentum_masking',
                       'density_warmup_steps', 'clip_norm', 'value_dtype')
    #: the velocity u and the accumulated r are both averaged over the
    #: saved ranks when a run resumes at another world size
    residual_keys = ('r', 'u')
    variance_keys = ()

    def __init__(self, density=0.001, momentum_factor=0.9,
                 momentum_masking=True, density_warmup_steps=0,
                 clip_norm=None, value_dtype='float16'):
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
        self.clip_norm = None if clip_norm is None else base.check_real(
            'clip_norm', clip_norm, low=0,
            hint=' (None: no local clipping)')
        if value_dtype not in VALUE_DTYPES:
            raise ValueError('value_dtype must be one of {}, got {!r}'.format(
                ', '.join(repr(v) for v in VALUE_DTYPES), value_dtype))
        self.value_dtype = value_dtype
        #: steps begun (for the warm-up's density)
        self.steps = 0
        #: this step's clipping factor (1.0: none), set by :meth:`prepare`
        self.clip_factor = 1.0

    @property
    def reads_every_gradient(self):
        """The clipping needs the norm of the whole gradient."""
        return self.clip_norm is not None

    def check_optimizer(self, optimizer):
        """Momentum correction is the optimizer's momentum moved into the
        rule: an optimizer with momentum of its own would apply it twice."""
        momentum = getattr(getattr(optimizer, 'hyperparam', None),
                           'momentum', 0) or 0
        if self.momentum_factor and momentum:
            raise ValueError(
                'dgc with momentum_factor={} applies the momentum itself '
                "(momentum correction, Lin et al. 2018); the optimizer's "
                'own momentum ({} {}) would apply it twice: use '
                'chainer.optimizers.SGD(lr=...) with dgc, or '
                'momentum_factor=0 (top-k with error feedback) with this '
                'optimizer'.format(self.momentum_factor,
                                   type(optimizer).__name__, momentum))

    def keeps_dense(self, shape):
        """Tensors of one dimension or none go to the dense group."""
        return len(shape) < 2

    def init_state(self, size, dtype, xp):
        return base.residual_state(size, dtype, xp, ('r', 'u'))

    def get_extra_state(self):
        return {'steps': str(self.steps)}

    def set_extra_state(self, state):
        self.steps = int(state.get('steps', 0))

    def prepare(self, grads):
        """This step's clipping factor from every gradient (None: none):
        the norm summed tensor by tensor in float64, in order."""
        self.clip_factor = 1.0
        if self.clip_norm is None:
            return
        total = 0.0
        for g in grads:
            if g is not None:
                flat = g.reshape(-1).astype(numpy.float64)
                total += float(flat.dot(flat))
        limit = self.clip_norm / math.sqrt(self.workers)
        norm = math.sqrt(total)
        if norm > limit:
            self.clip_factor = limit / (norm + CLIP_EPSILON)

    def begin_step(self):
        self.steps += 1

    def dense_step(self):
        """A step sent dense by the fallback still moves the warm-up."""
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
        """Clipping and momentum correction, in place: u <- m u + c g,
        r <- r + u (c the clipping factor, its multiply skipped at 1), by
        the kernels' arithmetic on a GPU (the subnormal rule:
        :mod:`chainer_vgc.backends.cuda.kernels`; NumPy's own here)."""
        u, r = state['u'], state['r']
        dt = r.dtype
        g = kernels.cast(grad.reshape(-1), dt)
        if self.clip_factor != 1.0:
            g = kernels.scale(g, dt.type(self.clip_factor))
        if self.momentum_factor:
            u[...] = kernels.scale(u, dt.type(self.momentum_factor))
            kernels.add_into(u, g)
        else:
            u[...] = g
        kernels.add_into(r, u)
        return r, u

    def select(self, r, density):
        """The indices (sorted) of the k = ceil(density n) largest
        ``|r|``, ties broken by the lower index, zeros left out."""
        xp = arrays.get_array_module(r)
        n = int(r.size)
        if n == 0:
            return xp.zeros(0, numpy.int64)
        k = top_k(n, density)
        mag = xp.abs(r)
        kth = xp.partition(mag, n - k)[n - k]  # the k-th largest
        above = xp.nonzero(mag > kth)[0]
        at = xp.nonzero(mag == kth)[0][:k - int(above.size)]
        index = xp.sort(xp.concatenate([above, at]))
        return index[mag[index] > 0]

    def count(self, grad, sqsum, state):
        """The elements the next step selects (the dense fallback's
        estimate: the last step's clipping factor, and elements whose
        value would round to zero on the wire counted), the state
        unchanged."""
        st = {key: a.copy() for key, a in state.items()}
        r, _ = self._accumulate(grad, st)  # (the next step's density)
        return int(self.select(r, self.current_density(self.steps + 1))
                   .size)

    def compress(self, tensor_id, grad, sqsum, state):
        r, u = self._accumulate(grad, state)
        index = self.select(r, self.current_density())
        if index.size == 0:
            return None
        group, sent = codec.sparse_group(
            tensor_id, index, r[index], r.size,
            float32=self.value_dtype == 'float32')
        left = r[index]  # what rounding left (0 where sent exactly)
        kernels.add_into(left, kernels.scale(sent, -1))
        r[index] = left
        if self.momentum_masking:
            u[index[sent != 0]] = 0
        return group


def top_k(n, density):
    """k = ceil(density n), at least 1 and at most n."""
    return min(n, max(1, int(math.ceil(density * n))))


#: the native pass (kernels/vgc_passes.h: vgc_dgc): r, u in, r, u out, n,
#: the clipping factor, the momentum factor, masking, k, float32 values,
#: the group's words
_native_dgc = bindings.fused_pass('dgc', [
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
    ctypes.c_int64, ctypes.c_double, ctypes.c_double, ctypes.c_int,
    ctypes.c_int64, ctypes.c_int, ctypes.c_void_p])


def _native_path(rule):
    """DGC on the native CPU backend: the accumulation and the candidates
    above a sampled threshold in one fused pass, the exact top-k among
    them, FMT_SPARSE (the rule's compress, bit for bit)."""
    float32 = rule.value_dtype == 'float32'

    def compress(ws, tensor_id, grad, sqsum, state, new_state, out):
        n = int(grad.size)
        return _native_dgc(
            ws, tensor_id, grad, state['r'], state['u'], new_state['r'],
            new_state['u'], n, rule.clip_factor, rule.momentum_factor,
            int(rule.momentum_masking), top_k(n, rule.current_density()),
            int(float32), out)
    return registry.FastPath(
        compress, lambda size, dtype: codec.sparse_max_words(size, float32),
        True)


registry.register('native', DGC, _native_path)
