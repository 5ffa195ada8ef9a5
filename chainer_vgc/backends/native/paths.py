"""The native CPU backend's fast paths for the rules that ship.

The question this module answers: which fused C++ pass
(:mod:`chainer_vgc.backends.native.bindings`, ``kernels/``) runs each shipped rule on the
CPU, for the wire format its settings choose, and how large can its group
be?  Each factory returns a :data:`~chainer_vgc.backends.registry.FastPath`
bound to one rule object, registered with
:func:`chainer_vgc.backends.registry.register` on import.  The passes equal the
rules' NumPy steps bit for bit (``tests/test_native.py``).
"""

from chainer_vgc.backends import arrays as backend
from chainer_vgc import codec
from chainer_vgc.backends import registry as fast_paths
from chainer_vgc.backends.native import bindings as native
from chainer_vgc.rules import Hybrid
from chainer_vgc.rules import NoCompression
from chainer_vgc.rules import QSGD
from chainer_vgc.rules import Strom
from chainer_vgc.rules import VGC


def _raw_words(size, dtype, indexed):
    """A FMT_RAW group: header, index words (unless dense), values."""
    value_words = backend.state_dtype(dtype).itemsize // 4
    return codec.HEADER_WORDS + (size if indexed else 0) + size * value_words


def _vgc(rule):
    """Fig. "Basic": one fused pass; FMT_POW2 / FMT_GAP words, or FMT_RAW
    with quantization off."""
    def compress(ws, tensor_id, grad, sqsum, state, new_state, out):
        return native.compress_vgc(
            ws, tensor_id, grad, sqsum, state['r'], state['v'],
            new_state['r'], new_state['v'], rule.alpha, rule.zeta,
            rule.quantize, rule.keep_unrepresentable, out,
            coding=rule.coding)

    def max_words(size, dtype):
        if rule.quantize:
            return codec.pow2_max_words(size, rule.coding)
        return _raw_words(size, dtype, True)
    return fast_paths.FastPath(compress, max_words, True)


def _hybrid(rule):
    """Fig. "Hybrid": one fused pass; FMT_POW2 / FMT_GAP sign words."""
    coding = rule.index_coding

    def compress(ws, tensor_id, grad, sqsum, state, new_state, out):
        return native.compress_hybrid(
            ws, tensor_id, grad, sqsum, state['r'], state['v'],
            new_state['r'], new_state['v'], rule.alpha, rule.zeta, rule.tau,
            out, coding=coding)
    return fast_paths.FastPath(
        compress, lambda size, dtype: codec.pow2_max_words(size, coding),
        True)


def _strom(rule):
    """Strom's threshold: one fused pass; FMT_POW2 / FMT_GAP sign words."""
    coding = rule.index_coding

    def compress(ws, tensor_id, grad, sqsum, state, new_state, out):
        return native.compress_strom(ws, tensor_id, grad, state['r'],
                                     new_state['r'], rule.tau, out,
                                     coding=coding)
    return fast_paths.FastPath(
        compress, lambda size, dtype: codec.pow2_max_words(size, coding),
        True)


def _qsgd(rule):
    """QSGD: two passes (bucket norms, then levels); FMT_QSGD.  The uniform
    draws come from the rule's own generator, so the inputs are checked
    before any tensor (the generator must not draw on a fault)."""
    def compress(ws, tensor_id, grad, sqsum, state, new_state, out):
        u = rule.uniform_draws(grad.size, backend.state_dtype(grad.dtype))
        return native.compress_qsgd(ws, tensor_id, grad, u, rule.bucket,
                                    rule.levels, out)

    def max_words(size, dtype):
        buckets = -(-size // rule.bucket)
        return (codec.HEADER_WORDS + codec.QSGD_RECORD_WORDS * buckets
                + size)
    return fast_paths.FastPath(compress, max_words, False)


def _none(rule):
    """No compression: one copy into a dense FMT_RAW group."""
    def compress(ws, tensor_id, grad, sqsum, state, new_state, out):
        return native.compress_none(ws, tensor_id, grad, out)
    return fast_paths.FastPath(
        compress, lambda size, dtype: _raw_words(size, dtype, False), True)


for _cls, _factory in ((VGC, _vgc), (Hybrid, _hybrid), (Strom, _strom),
                       (QSGD, _qsgd), (NoCompression, _none)):
    fast_paths.register('native', _cls, _factory)
