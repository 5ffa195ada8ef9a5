"""Compression rules against element-by-element references of the paper."""

import math

import numpy
import pytest
from hypothesis import given
from hypothesis import strategies as st

import chainer_vgc
from chainer_vgc import GradientCompressor
from chainer_vgc import create_rule
from chainer_vgc.backends.arrays import state_dtype

from reference import ref_floor_log2
from reference import ref_quantize

# on both stacks (make test): its results depend on NumPy, the native
# build or the installed packages (docs/contributing.md)
pytestmark = pytest.mark.stack

DTYPES = [numpy.float16, numpy.float32, numpy.float64]


# ---- references: plain loops over elements, in the state dtype -------------

def ref_basic(g, s, r, v, alpha, zeta, quantize=True, keep=False):
    """Fig. "Basic".  Updates r, v (lists of numpy scalars); returns the
    dense update sent."""
    T = type(r[0])
    alpha, zeta = T(alpha), T(zeta)
    selected = []
    for i in range(len(r)):
        r[i] = r[i] + T(g[i])
        v[i] = v[i] + T(s[i])
        if r[i] * r[i] > alpha * v[i]:
            selected.append(i)
        else:
            v[i] = v[i] * zeta
    sent = [0.0] * len(r)
    if not selected:
        return sent
    if not quantize:
        for i in selected:
            sent[i] = float(r[i])
            r[i] = v[i] = T(0)
        return sent
    m = max(abs(float(r[i])) for i in selected)
    tiny = numpy.finfo(T).tiny
    e_k = ref_floor_log2(m) if m >= tiny else None
    for i in selected:
        q = ref_quantize(r[i], e_k, T) if e_k is not None else None
        if q is not None:
            neg, d = q
            sent[i] = (-1.0 if neg else 1.0) * 2.0 ** (e_k - d)
        if q is None and keep:
            v[i] = v[i] * zeta
        else:
            r[i] = v[i] = T(0)
    return sent


def ref_hybrid(g, s, r, v, alpha, zeta, tau):
    """Fig. "Hybrid" with the variance correction of the Sec. 4.5 text."""
    T = type(r[0])
    alpha, zeta, tau = T(alpha), T(zeta), T(numpy.float32(tau))
    sent = [0.0] * len(r)
    for i in range(len(r)):
        r[i] = r[i] + T(g[i])
        v[i] = v[i] + T(s[i])
        a = abs(r[i])
        if a > tau and r[i] * r[i] > alpha * v[i]:
            sign = 1 if r[i] > 0 else -1
            sent[i] = sign * float(tau)
            r[i] = r[i] - tau if sign > 0 else r[i] + tau
            c = v[i] - T(2) * a * tau + tau * tau
            v[i] = c if c > 0 else T(0)
        v[i] = v[i] * zeta
    return sent


def ref_strom(g, r, tau):
    T = type(r[0])
    tau = T(numpy.float32(tau))
    sent = [0.0] * len(r)
    for i in range(len(r)):
        r[i] = r[i] + T(g[i])
        if r[i] > tau:
            sent[i], r[i] = float(tau), r[i] - tau
        elif r[i] < -tau:
            sent[i], r[i] = -float(tau), r[i] + tau
    return sent


# ---- data -------------------------------------------------------------------

def make_stream(rng, steps, n, dtype, batch=8, signal=0.3):
    """Minibatch gradients and per-sample sums of squares from simulated
    per-example gradients (mean per element + noise)."""
    mu = rng.normal(0, signal, size=n)
    out = []
    for _ in range(steps):
        per_example = mu + rng.normal(0, 1, size=(batch, n))
        g = (per_example / batch).sum(axis=0)
        s = ((per_example / batch) ** 2).sum(axis=0)
        out.append((g.astype(dtype), s.astype(dtype)))
    return out


def run_rule(method, stream, dtype, **kw):
    n = stream[0][0].size
    comp = GradientCompressor(method, ['p'], [(n,)], [dtype], **kw)
    sent = []
    for g, s in stream:
        msg = comp.compress([g], [s])
        sent.append(comp.decode(msg)[0])
    return comp, sent


def _state_lists(n, dtype):
    T = state_dtype(dtype).type
    return [T(0)] * n, [T(0)] * n


def _assert_state_equal(comp, r, v=None):
    st = comp.state(0)
    assert st['r'].tolist() == [float(x) for x in r]
    if v is not None:
        assert st['v'].tolist() == [float(x) for x in v]


# ---- rule vs reference, many steps -------------------------------------------

@given(seed=st.integers(0, 2 ** 31), n=st.integers(1, 40),
       steps=st.integers(1, 25), dtype=st.sampled_from(DTYPES),
       alpha=st.sampled_from([0.5, 1.0, 1.5, 2.0, 4.0]),
       zeta=st.sampled_from([0.5, 0.999, 1.0]),
       quantize=st.booleans(), keep=st.booleans(),
       signal=st.sampled_from([0.01, 0.3, 3.0]))
def test_vgc_matches_reference(seed, n, steps, dtype, alpha, zeta, quantize,
                               keep, signal):
    stream = make_stream(numpy.random.default_rng(seed), steps, n, dtype,
                         signal=signal)
    comp, sent = run_rule('vgc', stream, dtype, alpha=alpha, zeta=zeta,
                          quantize=quantize, keep_unrepresentable=keep)
    r, v = _state_lists(n, dtype)
    for (g, s), got in zip(stream, sent):
        want = ref_basic(g, s, r, v, alpha, zeta, quantize, keep)
        assert got.tolist() == want
    _assert_state_equal(comp, r, v)


@given(seed=st.integers(0, 2 ** 31), n=st.integers(1, 40),
       steps=st.integers(1, 25), dtype=st.sampled_from(DTYPES),
       alpha=st.sampled_from([1.0, 2.0]), zeta=st.sampled_from([0.9, 0.999]),
       tau=st.sampled_from([0.01, 0.1, 0.3]))
def test_hybrid_matches_reference(seed, n, steps, dtype, alpha, zeta, tau):
    stream = make_stream(numpy.random.default_rng(seed), steps, n, dtype)
    comp, sent = run_rule('hybrid', stream, dtype, alpha=alpha, zeta=zeta,
                          tau=tau)
    r, v = _state_lists(n, dtype)
    for (g, s), got in zip(stream, sent):
        assert got.tolist() == ref_hybrid(g, s, r, v, alpha, zeta, tau)
    _assert_state_equal(comp, r, v)


@given(seed=st.integers(0, 2 ** 31), n=st.integers(1, 40),
       steps=st.integers(1, 25), dtype=st.sampled_from(DTYPES),
       tau=st.sampled_from([0.001, 0.01, 0.1]))
def test_strom_matches_reference(seed, n, steps, dtype, tau):
    stream = make_stream(numpy.random.default_rng(seed), steps, n, dtype)
    comp, sent = run_rule('strom', stream, dtype, tau=tau)
    r, _ = _state_lists(n, dtype)
    for (g, _s), got in zip(stream, sent):
        assert got.tolist() == ref_strom(g, r, tau)
    _assert_state_equal(comp, r)


@given(seed=st.integers(0, 2 ** 31), n=st.integers(1, 70),
       bits=st.integers(1, 8), bucket=st.sampled_from([1, 3, 16, 128]),
       dtype=st.sampled_from(DTYPES))
def test_qsgd_matches_reference(seed, n, bits, bucket, dtype):
    rng = numpy.random.default_rng(seed)
    g = rng.normal(size=n).astype(dtype)
    comp = GradientCompressor('qsgd', ['p'], [(n,)], [dtype], bits=bits,
                              bucket=bucket, seed=seed)
    got = comp.decode(comp.compress([g]))[0]
    sdt = state_dtype(dtype)
    u = numpy.random.default_rng(seed).random(n, dtype=sdt)  # same draws
    levels = 2 ** bits - 1
    gs = g.astype(numpy.float64)
    for start in range(0, n, bucket):
        block = range(start, min(n, start + bucket))
        norm = math.sqrt(math.fsum(gs[i] ** 2 for i in block))
        scale = norm / levels
        for i in block:
            x = abs(gs[i]) / norm * levels if norm else 0.0
            lo = math.floor(x)
            want_level = lo + (1 if x - lo + float(u[i]) >= 1 else 0)
            if abs(x - lo + float(u[i]) - 1) < 1e-4:  # at a rounding edge
                assert min(abs(abs(got[i]) - lo * scale),
                           abs(abs(got[i]) - (lo + 1) * scale)) <= (
                               1e-6 * (lo + 1) * scale)
            else:
                want = math.copysign(min(want_level, levels) * scale, gs[i])
                assert got[i] == pytest.approx(want, rel=1e-6, abs=0)


def test_qsgd_is_unbiased_and_seeded():
    g = numpy.random.default_rng(0).normal(size=64).astype(numpy.float32)
    comp = GradientCompressor('qsgd', ['p'], [(64,)], [numpy.float32],
                              bits=2, bucket=16, seed=7)
    mean = numpy.mean([comp.decode(comp.compress([g]))[0]
                       for _ in range(4000)], axis=0)
    assert numpy.abs(mean - g).max() < 0.1 * numpy.abs(g).max()
    again = GradientCompressor('qsgd', ['p'], [(64,)], [numpy.float32],
                               bits=2, bucket=16, seed=7)
    first = GradientCompressor('qsgd', ['p'], [(64,)], [numpy.float32],
                               bits=2, bucket=16, seed=7)
    assert (first.compress([g]) == again.compress([g])).all()


@pytest.mark.parametrize('dtype', DTYPES)
def test_none_sends_every_element_exactly(dtype):
    g = numpy.random.default_rng(0).normal(size=(3, 5)).astype(dtype)
    comp = GradientCompressor('none', ['w'], [(3, 5)], [dtype])
    out = comp.decode(comp.compress([g]))[0]
    assert comp.last_sent == 15
    assert (out == g.astype(out.dtype)).all()


# ---- properties of the paper ------------------------------------------------

@pytest.mark.parametrize('method,kw', [
    ('vgc', dict(alpha=1.5, quantize=False)),
    ('hybrid', dict(alpha=2.0, tau=0.05)),
    ('strom', dict(tau=0.05)),
])
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
def test_conservation_over_1000_steps(method, kw, dtype):
    """sum of gradients = sum sent + residual r (Sec. 4.1: r is a delayed
    update, nothing is lost)."""
    rng = numpy.random.default_rng(3)
    n = 50
    comp = GradientCompressor(method, ['p'], [(n,)], [dtype], **kw)
    total_g = numpy.zeros(n)
    total_sent = numpy.zeros(n)
    # The bound that rounding justifies, element by element.  In exact
    # arithmetic r_t = r_(t-1) + g_t - sent_t, so sum g = sum sent + r.
    # The rule computes x = fl(r + g) in the state dtype (here ``dtype``),
    # then sends x and sets r = 0 (vgc, quantize=False: no further
    # rounding) or sends float32(tau) exactly and sets r = fl(x -+ tau)
    # (strom, hybrid).  Each fl() errs by at most half a unit in the last
    # place of its result, 0.5 * spacing(|result|), so the identity is off
    # by at most the sum of those over the steps.  The test's float64
    # sums (total_g, total_sent, and total_sent + r at the end) add half
    # a float64 spacing of each result.  (Here, float32: below 0.04 < tau
    # = 0.05 even where strom's |r| grows to ~950, about 0.005 typically,
    # 7e-5 for vgc; the tolerance below, 1000 * eps * (max|sum g| + 1) =
    # 0.119 for float32, exceeds 2 tau and would not notice a lost
    # element.)
    bound = numpy.zeros(n)
    for g, s in make_stream(rng, 1000, n, dtype):
        state = comp.state(0)
        r_prev = (numpy.zeros(n, dtype) if state is None
                  else state['r'].copy())
        total_g += g
        sent = comp.decode(comp.compress([g], [s]))[0]
        total_sent += sent
        x = r_prev + g  # fl(r + g), as the rule computes it
        r_now = comp.state(0)['r']
        bound += 0.5 * numpy.spacing(numpy.abs(x)).astype(numpy.float64)
        bound += numpy.where(sent != 0, 0.5 * numpy.spacing(
            numpy.abs(r_now)).astype(numpy.float64), 0.0)
        bound += 0.5 * (numpy.spacing(numpy.abs(total_g)) +
                        numpy.spacing(numpy.abs(total_sent)))
    residual = comp.state(0)['r'].astype(numpy.float64)
    eps = numpy.finfo(dtype).eps
    scale = numpy.abs(total_g).max() + 1
    assert total_sent.any()
    numpy.testing.assert_allclose(total_sent + residual, total_g, rtol=0,
                                  atol=1000 * eps * scale)
    got = total_sent + residual
    bound += 0.5 * numpy.spacing(numpy.abs(got))
    err = numpy.abs(got - total_g)
    assert (err <= bound * (1 + 1e-9)).all(), (err / bound).max()


def test_compression_increases_with_alpha():
    """Table 1 trend: larger alpha, fewer elements sent."""
    stream = make_stream(numpy.random.default_rng(4), 200, 2000,
                         numpy.float32, batch=16, signal=0.2)
    ratios = []
    for alpha in (1.0, 1.5, 2.0, 3.0):
        comp = GradientCompressor('vgc', ['p'], [(2000,)], [numpy.float32],
                                  alpha=alpha)
        sent = 0
        for g, s in stream:
            comp.compress([g], [s])
            sent += comp.last_sent
        ratios.append(2000 * 200 / sent)
    assert ratios == sorted(ratios) and len(set(ratios)) == 4, ratios
    assert ratios[0] > 2


def test_keep_unrepresentable_keeps_dropped_value_in_residual():
    # one large and one tiny (d > 7) element, both with no variance
    g = numpy.array([100.0, 0.1], dtype=numpy.float32)
    s = numpy.zeros(2, dtype=numpy.float32)
    for keep, want_r1 in ((False, 0.0), (True, numpy.float32(0.1))):
        comp = GradientCompressor('vgc', ['p'], [(2,)], [numpy.float32],
                                  keep_unrepresentable=keep)
        out = comp.decode(comp.compress([g], [s]))[0]
        assert out.tolist() == [64.0, 0.0]  # 100 -> 2**6, 0.1 not sent
        assert comp.state(0)['r'][1] == want_r1


# ---- many tensors, dtypes, parameters without gradients ---------------------

def test_mixed_dtypes_missing_grads_and_empty_tensors():
    shapes = [(4, 3), (0,), (5,), (2, 2, 2)]
    dtypes = [numpy.float16, numpy.float32, numpy.float64, numpy.float32]
    comp = GradientCompressor('vgc', ['a', 'b', 'c', 'd'], shapes, dtypes,
                              alpha=1.0, quantize=False)
    rng = numpy.random.default_rng(5)
    grads = [rng.normal(size=s).astype(d) for s, d in zip(shapes, dtypes)]
    sqs = [numpy.zeros(s, d) for s, d in zip(shapes, dtypes)]
    grads[3] = sqs[3] = None  # 'd' has no gradient this step
    outs = comp.decode(comp.compress(grads, sqs))
    assert comp.state(3) is None
    assert (outs[3] == 0).all()
    assert outs[0].dtype == numpy.float32 and outs[2].dtype == numpy.float64
    assert (outs[0] == grads[0].astype(numpy.float32)).all()
    assert (outs[2] == grads[2]).all()
    assert comp.last_sent == 12 + 5


# ---- bad input ---------------------------------------------------------------

@pytest.mark.parametrize('method,kw,match', [
    ('vgc', dict(alpha=0), r'alpha must be in \(0, inf\)'),
    ('vgc', dict(alpha=-1), 'alpha'),
    ('vgc', dict(alpha=float('nan')), 'alpha'),
    ('vgc', dict(zeta=0), r'zeta must be in \(0, 1\]'),
    ('vgc', dict(zeta=1.5), 'zeta'),
    ('hybrid', dict(tau=0), r'tau must be in \(0, inf\)'),
    ('hybrid', dict(alpha=0), 'alpha'),
    ('strom', dict(tau=-0.1), 'tau'),
    ('qsgd', dict(bits=0), r'bits must be an integer in 1\.\.8'),
    ('qsgd', dict(bits=9), 'bits'),
    ('qsgd', dict(bucket=0), 'bucket must be an integer in 1'),
    ('qsgd', dict(bucket=2.5), 'bucket'),
    ('vgc', dict(tau=0.1), "method 'vgc'.*tau"),
    ('nope', {}, 'unknown compression method'),
])
def test_bad_hyperparameters(method, kw, match):
    with pytest.raises(ValueError, match=match):
        create_rule(method, **kw)


@pytest.mark.parametrize('method', ['vgc', 'hybrid', 'strom', 'qsgd', 'none'])
@pytest.mark.parametrize('bad', [numpy.nan, numpy.inf, -numpy.inf])
def test_nonfinite_gradient_names_parameter_and_keeps_state(method, bad):
    shapes = [(6,), (3, 2)]
    comp = GradientCompressor(method, ['fc/W', 'fc/b'], shapes,
                              [numpy.float32] * 2)
    rng = numpy.random.default_rng(6)
    for _ in range(3):
        comp.compress([rng.normal(size=s).astype(numpy.float32)
                       for s in shapes],
                      [numpy.ones(s, numpy.float32) for s in shapes])
    before = [None if state is None else {k: a.copy()
                                          for k, a in state.items()}
              for state in comp.states]
    grads = [rng.normal(size=s).astype(numpy.float32) for s in shapes]
    grads[1][1, 0] = bad
    with pytest.raises(FloatingPointError, match="'fc/b'"):
        comp.compress(grads, [numpy.ones(s, numpy.float32) for s in shapes])
    for b, state in zip(before, comp.states):
        for k in (b or {}):
            assert (state[k] == b[k]).all()


def test_bad_sqsum_and_shapes():
    comp = GradientCompressor('vgc', ['w'], [(3,)], [numpy.float32])
    g = numpy.ones(3, numpy.float32)
    with pytest.raises(ValueError, match="needs the per-sample.*'w'"):
        comp.compress([g])
    with pytest.raises(FloatingPointError, match="'w'"):
        comp.compress([g], [-numpy.ones(3, numpy.float32)])
    with pytest.raises(ValueError, match="'w' has shape"):
        comp.compress([numpy.ones(4, numpy.float32)], [g])
    with pytest.raises(ValueError, match='expected 1 gradients'):
        comp.compress([g, g], [g, g])
    with pytest.raises(TypeError, match='not floating'):
        GradientCompressor('vgc', ['i'], [(3,)], [numpy.int32])


@pytest.mark.parametrize('method', ['vgc', 'hybrid', 'strom'])
def test_tensor_over_2_28_elements_is_refused_only_with_fixed_words(method):
    """The paper's word addresses 2**28 elements: forced, it refuses a
    larger tensor by name; gap-coded indices (the default 'auto') and
    formats with full index words accept it (nothing is allocated here)."""
    huge = [(2 ** 14, 2 ** 14 + 1)]
    with pytest.raises(ValueError, match="'huge'.*2\\*\\*28.*index_coding"):
        GradientCompressor(method, ['huge'], huge, [numpy.float32],
                           index_coding='fixed')
    for coding in ('auto', 'gap'):
        GradientCompressor(method, ['huge'], huge, [numpy.float32],
                           index_coding=coding)
    GradientCompressor('vgc', ['huge'], huge, [numpy.float32],
                       quantize=False, index_coding='fixed')
    with pytest.raises(ValueError, match="index_coding must be one of"):
        GradientCompressor(method, ['w'], [(3,)], [numpy.float32],
                           index_coding='rice')


def test_public_names():
    assert set(chainer_vgc.RULES) == {'vgc', 'hybrid', 'strom', 'qsgd',
                                      'dgc', 'powersgd', 'none'}


def test_criterion_and_threshold_are_strict():
    """r**2 == alpha * v is not sent (eq. 4 is strict); nor is |r| == tau."""
    one = numpy.ones(1, numpy.float32)
    comp = GradientCompressor('vgc', ['p'], [(1,)], [numpy.float32],
                              alpha=1.0, zeta=0.5)
    assert comp.decode(comp.compress([one], [one]))[0][0] == 0
    assert comp.state(0)['v'][0] == 0.5  # decayed, not reset
    assert comp.decode(comp.compress([one], [one]))[0][0] == 2.0  # 4 > 1.5
    assert comp.state(0)['v'][0] == 0 and comp.state(0)['r'][0] == 0
    tau = numpy.float32(0.25)
    for method in ('strom', 'hybrid'):
        comp = GradientCompressor(method, ['p'], [(1,)], [numpy.float32],
                                  tau=0.25)
        zero = numpy.zeros(1, numpy.float32)
        assert comp.decode(comp.compress([tau * one], [zero]))[0][0] == 0
        assert comp.decode(comp.compress([tau * one], [zero]))[0][0] == tau


def test_state_overflow_is_an_error_naming_the_parameter():
    big = numpy.full(3, 3e38, numpy.float32)
    for method in ('vgc', 'hybrid', 'strom'):
        comp = GradientCompressor(method, ['fc/W'], [(3,)], [numpy.float32])
        with numpy.errstate(over='raise'):  # our arithmetic must not trip
            with pytest.raises(FloatingPointError,
                               match="'fc/W' overflowed float32"):
                for _ in range(5):
                    comp.compress([big], [big])


def test_qsgd_keeps_extreme_magnitudes():
    """Norms and scales in float64: huge float32 and huge/tiny float64
    gradients survive (bucket [v, -v]: level 10 or 11 of 15, times
    norm / 15 with norm = v * sqrt(2))."""
    for dtype, value in ((numpy.float32, 1e30), (numpy.float64, 1e100),
                         (numpy.float64, 1e-50)):
        g = numpy.array([value, -value, 0.0], dtype)
        comp = GradientCompressor('qsgd', ['p'], [(3,)], [dtype], bits=4,
                                  bucket=2, seed=0)
        out = comp.decode(comp.compress([g]))[0]
        assert comp.last_sent == 2 and out[2] == 0
        assert out[0] > 0 > out[1]
        for got in numpy.abs(out[:2]):
            level = got / (float(value) * 2 ** 0.5 / 15)
            assert min(abs(level - 10), abs(level - 11)) < 1e-5, level
