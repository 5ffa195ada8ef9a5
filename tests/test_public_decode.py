"""``GradientCompressor.decode_into`` and ``decode`` on the native backend
(issue 25): one call of the native decoder, in place, touching only the
indices sent, equal bit for bit to the NumPy reference
(``backend='numpy'``, :func:`chainer_vgc.codec.decode_into`), and rejecting
what the reference rejects with the outputs unchanged."""

import numpy
import pytest

from chainer_vgc import GradientCompressor
from chainer_vgc import WireFormatError
from chainer_vgc import codec
from chainer_vgc.engines.native import bindings

import golden_messages as golden
from test_native import _corrupt
from wire_messages import random_message

# on both stacks (make test): its results depend on NumPy, the native
# build or the installed packages (docs/contributing.md)
pytestmark = pytest.mark.stack


def _pair(method='vgc', **kw):
    return [GradientCompressor(method, list('abcde'), golden.SHAPES,
                               golden.DTYPES, backend=b, **kw)
            for b in ('native', 'numpy')]


def _outs(rng, dtypes):
    """Non-zero starting values, with +0.0 and -0.0 among them (a sent
    -0.0 added to +0.0 gives +0.0; to -0.0, -0.0)."""
    outs = []
    for shape, dt in zip(golden.SHAPES, dtypes):
        o = rng.normal(0, 1, shape).astype(dt)
        flat = o.reshape(-1)
        flat[::5] = 0
        flat[1::7] = -0.0
        outs.append(o)
    return outs


def _bits(arrays):
    return [a.tobytes() for a in arrays]


def _state_dtypes():
    return [numpy.float32 if d == numpy.float16 else d
            for d in golden.DTYPES]


@pytest.mark.parametrize('case', range(len(golden.CASES)))
def test_decode_into_equals_the_reference_bit_for_bit(case, monkeypatch):
    method, kw = golden.CASES[case]
    nat, ref = _pair(method, **kw)
    rng = numpy.random.default_rng(case)
    # the reference decoder must not be what the native side runs
    calls = []
    reference = codec.decode_into
    monkeypatch.setattr(codec, 'decode_into',
                        lambda *a, **k: calls.append(1) or reference(*a, **k))
    for step, msg in enumerate(golden.messages(method, kw, 'native')):
        for dtypes in (_state_dtypes(), [numpy.float64] * 5):
            a = _outs(rng, dtypes)
            b = [x.copy() for x in a]
            del calls[:]
            n_nat = nat.decode_into(msg, a)
            assert not calls, 'the native backend ran the reference decoder'
            n_ref = ref.decode_into(msg, b)
            assert calls
            assert n_nat == n_ref == codec.message_count(msg)
            assert _bits(a) == _bits(b), (case, step)
        assert _bits(nat.decode(msg)) == _bits(ref.decode(msg))


def test_random_messages_of_every_format_decode_as_the_reference():
    rng = numpy.random.default_rng(5)
    sizes = [int(numpy.prod(s)) for s in golden.SHAPES]
    nat, ref = _pair()
    for _ in range(200):
        msg, _ = random_message(rng, sizes)
        a = _outs(rng, [numpy.float32] * 5)
        b = [x.copy() for x in a]
        assert nat.decode_into(msg, a) == ref.decode_into(msg, b)
        assert _bits(a) == _bits(b)


def test_corrupt_messages_are_rejected_as_the_reference_rejects():
    rng = numpy.random.default_rng(11)
    nat, ref = _pair()
    msgs = golden.messages('vgc', dict(alpha=1.5, zeta=0.99), 'native') + \
        golden.messages('strom', dict(tau=0.05), 'native')
    rejected = 0
    for k in range(400):
        bad = _corrupt(rng, msgs[k % len(msgs)])
        a = _outs(rng, _state_dtypes())
        before = _bits(a)
        b = [x.copy() for x in a]
        try:
            n_ref = ref.decode_into(bad, b)
        except WireFormatError as e:
            rejected += 1
            with pytest.raises(WireFormatError) as info:
                nat.decode_into(bad, a)
            assert str(info.value) == str(e)
            assert _bits(a) == before, 'a rejected message wrote outputs'
            continue
        assert nat.decode_into(bad, a) == n_ref
        assert _bits(a) == _bits(b)
    assert rejected > 100


def test_outputs_the_native_decoder_cannot_write_take_the_reference(
        monkeypatch):
    """float16 outputs, non-contiguous ones, read-only ones, and
    ``backend='numpy'`` run :func:`codec.decode_into`; the native decoder
    is not called."""
    nat, ref = _pair()
    msg = golden.messages('vgc', dict(alpha=1.0), 'native')[2]
    monkeypatch.setattr(bindings, 'decode_mean', lambda *a, **k: 1 / 0)
    rng = numpy.random.default_rng(0)
    half = _outs(rng, golden.DTYPES)
    expected = [x.copy() for x in half]
    ref.decode_into(msg, expected)
    nat.decode_into(msg, half)  # a float16 output among them
    assert _bits(half) == _bits(expected)
    strided = [numpy.zeros((2,) + s, numpy.float32)[0] for s in
               golden.SHAPES]
    strided[0] = numpy.zeros((33, 14), numpy.float32)[:, ::2]
    with pytest.raises(ValueError, match='not C-contiguous'):
        nat.decode_into(msg, strided)
    frozen = [numpy.zeros(s, numpy.float32) for s in golden.SHAPES]
    frozen[3].flags.writeable = False
    with pytest.raises(ValueError, match='read-only'):
        nat.decode_into(msg, frozen)


def test_decode_into_touches_only_the_indices_sent():
    """The accumulate mode adds in place: an element not sent keeps its
    bits (NaN included), so the cost is the elements', not the tensors'."""
    nat, _ = _pair(index_coding='fixed')
    msg = golden.messages('vgc', dict(alpha=1.0, index_coding='fixed'),
                          'native')[3]
    outs = [numpy.full(s, numpy.nan, numpy.float32) for s in golden.SHAPES]
    sent = [numpy.zeros(s, bool) for s in golden.SHAPES]
    for dec in codec.unpack(msg, nat.sizes, [numpy.float32] * 5):
        sent[dec.tensor_id].reshape(-1)[dec.index] = True
    nat.decode_into(msg, outs)
    for o, s in zip(outs, sent):
        assert numpy.isnan(o[~s]).all() and numpy.isnan(o[s]).all()
    assert any(s.any() for s in sent)
