"""The dense fallback's prediction and counts (chainer_vgc.exchange.fallback); the
multi-rank behaviour is tests/mpi/check_fallback.py."""

import numpy
import pytest

from chainer_vgc import codec
from chainer_vgc.exchange import fallback
from chainer_vgc.compressor import GradientCompressor
from chainer_vgc.exchange.state import MethodState


def test_choice_by_hand():
    # p = 4, N s = 32e6 bits, e = 32, B = 1e9, L = 1e-4; mean count 2e5:
    # T_v = 3 (1e-4 + 32 * 2e5 / 1e9) = 0.0195
    # T_r = 6 (1e-4 + 32e6 / 4e9) = 0.0486
    fb = fallback.DenseFallback(bandwidth='1Gbit', latency=1e-4)
    c = fb.choose([1e5, 3e5, 2e5, 2e5], 32e6, 32.0)
    assert not c.dense
    assert c.compressed_s == pytest.approx(3 * (1e-4 + 32 * 2e5 / 1e9))
    assert c.dense_s == pytest.approx(6 * (1e-4 + 32e6 / 4e9))
    # the bound of Sec. 5 without latency: dense once c < p e / (2 s)
    fb = fallback.DenseFallback(bandwidth=1e9, workers=64)
    n = 1e6
    assert fb.choose([n / 31], 32 * n, 32.0).dense      # c = 31 < 32
    assert not fb.choose([n / 33], 32 * n, 32.0).dense  # c = 33 > 32
    # one worker: never dense; e given wins over the measured one
    assert not fallback.DenseFallback(1e9).choose([n], 32 * n, 32).dense
    fb = fallback.DenseFallback(1e9, workers=64, bits_per_element=8)
    assert not fb.choose([n / 31], 32 * n, 32.0).dense


def test_settings_and_their_errors():
    assert fallback.make(None) is None and fallback.make(False) is None
    assert fallback.make(True).bandwidth is None  # measured
    assert fallback.make('10Gbit').bandwidth == 1e10
    assert fallback.make({'bandwidth': 1e9, 'workers': 8}).workers == 8
    for bad, words in ((dict(latency=-1), 'latency'),
                       (dict(workers=0), 'workers'),
                       (dict(bits_per_element=0), 'bits_per_element'),
                       (dict(bandwidth='fast'), 'bandwidth')):
        with pytest.raises(ValueError, match=words):
            fallback.DenseFallback(**bad)
    with pytest.raises(ValueError, match='dense_fallback'):
        fallback.make([1])
    with pytest.raises(ValueError, match='counts'):
        MethodState('qsgd', dense_fallback=True)


@pytest.mark.parametrize('backend', ['numpy', 'native'])
@pytest.mark.parametrize('method,kw', [
    ('vgc', dict(quantize=False, alpha=1.0)),
    ('hybrid', dict(tau=0.3, alpha=1.0)),
    ('strom', dict(tau=0.8))])
def test_count_is_what_the_next_compress_sends(method, kw, backend):
    """The count changes nothing and equals the elements the rule then
    sends, step after step (residuals carried over)."""
    rng = numpy.random.default_rng(3)
    shapes = [(30, 20), (50,)]
    comp = GradientCompressor(method, ['a', 'b'], shapes,
                              [numpy.float32] * 2, backend=backend, **kw)
    fb = fallback.DenseFallback(1e9)
    for step in range(6):
        g = [rng.normal(size=s).astype(numpy.float32) for s in shapes]
        s = [(x * x * rng.uniform(0.1, 4, size=x.shape)).astype(
            numpy.float32) for x in g]
        before = [None if st is None else
                  {k: v.copy() for k, v in st.items()}
                  for st in comp.states]
        n = fb.count(comp, g, s)
        for st, old in zip(comp.states, before):
            if old is not None:
                for k in old:
                    assert numpy.array_equal(st[k], old[k])
        message = comp.compress(g, s)
        assert n == codec.message_count(message), (step, n)
