"""QSGD (Alistarh et al. 2017), a baseline of the paper's Table 1.

Each tensor is cut into buckets of ``bucket`` elements.  With
``levels = 2**bits - 1`` (``bits`` excludes the sign bit, as in the paper's
table) and n the bucket's L2 norm, element g is sent as
``sign(g) * n * l / levels`` where ``l = floor(|g| / n * levels + u)``,
``u ~ U[0, 1)``: stochastic rounding, unbiased.  Elements with l = 0 are
not sent.  No residual is kept.  The uniform draws come from a seedable
generator: ``numpy.random.default_rng(seed)`` on the CPU; on the GPU, a fresh
Philox4x32-10 generator from ``SeedSequence(entropy, spawn_key=(step,))``
each step, so that its whole state is ``(entropy, step)``.  The two streams
differ.  Both states are saved with snapshots (:meth:`get_extra_state`).
"""

import json

import numpy

from chainer_vgc.backends import arrays
from chainer_vgc import codec
from chainer_vgc.backends import registry
from chainer_vgc.engines.native import bindings
from chainer_vgc.rules import base


class QSGD(base.CompressionRule):
    """QSGD, the paper's Table 1 baseline: bits in 1..8, bucket in
    1..2**23, seed: int or None."""

    name = 'qsgd'
    hyperparameters = ('bits', 'bucket', 'seed')

    def __init__(self, bits=2, bucket=128, seed=None):
        self.bits = base.check_int('bits', bits, 1, 8)
        self.bucket = base.check_int('bucket', bucket, 1,
                                     codec.MAX_QSGD_BUCKET)
        self.levels = (1 << self.bits) - 1
        self.seed = seed
        self._rngs = {}
        #: the GPU stream: entropy of the seed, and the step it is at
        self._entropy = numpy.random.SeedSequence(seed).entropy
        self._step = 0
        #: dtype -> buffer of :meth:`uniform_draws`, grown to the largest
        #: parameter
        self._draws = {}

    def _rng(self, xp):
        key = xp.__name__
        if key not in self._rngs:
            if arrays.is_cupy(xp):
                # Philox: counter-based, so a new generator each step is
                # cheap (XORWOW would initialize ~10^5 states every step)
                self._rngs[key] = xp.random.default_rng(
                    xp.random.Philox4x3210(numpy.random.SeedSequence(
                        self._entropy, spawn_key=(self._step,))))
            else:
                self._rngs[key] = numpy.random.default_rng(self.seed)
        return self._rngs[key]

    def for_rank(self, rank):
        """Independent rounding on every rank: the seed plus the rank (no
        seed: fresh entropy per rank)."""
        seed = None if self.seed is None else int(self.seed) + int(rank)
        return type(self)(bits=self.bits, bucket=self.bucket, seed=seed)

    def begin_step(self):
        """A new step: the GPU generator is re-seeded from (entropy, step)
        at its first draw."""
        self._step += 1
        self._rngs.pop('cupy', None)

    def uniform_draws(self, n, dtype):
        """The next ``n`` uniform draws of the CPU generator, in ``dtype``
        (a buffer kept between steps, grown to the largest parameter): what
        :meth:`quantize` draws for a NumPy tensor of ``n`` elements, for a
        fast path that quantizes itself."""
        buf = self._draws.get(dtype)
        if buf is None or buf.size < n:
            buf = self._draws[dtype] = numpy.empty(n, dtype)
        u = buf[:n]
        self._rng(numpy).random(dtype=dtype, out=u)
        return u

    def get_extra_state(self):
        """Both generators' states (JSON), so a resumed run draws the same
        numbers: the CPU generator's, and the GPU stream's (entropy, step)."""
        return {'numpy_rng': json.dumps(self._rng(numpy).bit_generator.state),
                'cupy_stream': json.dumps({'entropy': str(self._entropy),
                                           'step': self._step})}

    def set_extra_state(self, state):
        if 'numpy_rng' in state:
            self._rng(numpy).bit_generator.state = json.loads(
                state['numpy_rng'])
        if 'cupy_stream' in state:
            gpu = json.loads(state['cupy_stream'])
            self._entropy, self._step = int(gpu['entropy']), int(gpu['step'])
            self._rngs.pop('cupy', None)

    def quantize(self, grad, dtype):
        """Returns (level int64, negative bool, per-bucket float64 scale).

        Norms and scales are computed in float64, so neither large float32
        gradients (squares overflow) nor float64 ones lose their bucket.
        """
        xp = arrays.get_array_module(grad)
        g = grad.astype(numpy.float64)
        n, b = g.size, self.bucket
        nb = -(-n // b)
        padded = xp.zeros(nb * b, dtype=numpy.float64)
        padded[:n] = g
        norms = xp.sqrt(bucket_sq(padded.reshape(nb, b) ** 2))
        norm = xp.repeat(norms, b)[:n]
        u = self._rng(xp).random(n, dtype=dtype)
        safe = xp.where(norm > 0, norm, 1)
        scaled = xp.abs(g) / safe * self.levels
        level = xp.floor(scaled + u).astype(numpy.int64)
        level = xp.clip(xp.where(norm > 0, level, 0), 0, self.levels)
        return level, xp.signbit(g), norms / self.levels

    def compress(self, tensor_id, grad, sqsum, state):
        dtype = arrays.state_dtype(grad.dtype)
        level, negative, scales = self.quantize(grad, dtype)
        if not level.any():
            return None
        return codec.qsgd_group(tensor_id, level, negative, scales,
                                self.bucket, self.levels)


#: the length of the pieces a bucket's sum of squares is added in
SUM_PIECE = 8192


def bucket_sq(sq):
    """Row sums of the (buckets, bucket) float64 squares ``sq``, in one
    order on every NumPy: the pairwise sum of each piece of
    :data:`SUM_PIECE` elements, added to the running total piece after
    piece.  This is how numpy 1.x's ``sq.sum(axis=1)`` rounds (its reduction
    loop sees a long row in pieces of its 8192-element buffer); NumPy 2.3
    changed that buffering, so a plain ``sum`` rounds rows longer than 8192
    differently there.  The native backend (``vgc_bucket_sq`` in
    ``kernels/vgc_host.cpp``) computes the same order."""
    if sq.shape[1] <= SUM_PIECE:
        return sq.sum(axis=1)
    total = sq[:, :SUM_PIECE].sum(axis=1)
    for off in range(SUM_PIECE, sq.shape[1], SUM_PIECE):
        total = total + sq[:, off:off + SUM_PIECE].sum(axis=1)
    return total


def _native_path(rule):
    """QSGD on the native CPU backend: two passes (bucket norms, then
    levels); FMT_QSGD.  The uniform draws come from the rule's own
    generator, so the inputs are checked before any tensor (the generator
    must not draw on a fault).  No whole-model GPU step."""
    def compress(ws, tensor_id, grad, sqsum, state, new_state, out):
        u = rule.uniform_draws(grad.size, arrays.state_dtype(grad.dtype))
        return bindings.compress_qsgd(ws, tensor_id, grad, u, rule.bucket,
                                      rule.levels, out)

    def max_words(size, dtype):
        buckets = -(-size // rule.bucket)
        return (codec.HEADER_WORDS + codec.QSGD_RECORD_WORDS * buckets
                + size)
    return registry.FastPath(compress, max_words, False)


registry.register('native', QSGD, _native_path)
