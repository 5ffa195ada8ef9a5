"""Fault handling of the compressor and the mean, without MPI: the
agreement between ranks is a stand-in returning the other ranks' codes."""

import chainer
import numpy
import pytest

from chainer_vgc import codec
from chainer_vgc.exchange import mean as exchange_mean
from chainer_vgc import GradientCompressor
from chainer_vgc.faults import NONFINITE, OK, OVERFLOW, SkippedStep

# on both stacks (make test): its results depend on NumPy, the native
# build or the installed packages (docs/contributing.md)
pytestmark = pytest.mark.stack

BACKENDS = ['numpy', 'native']


def others(*codes):
    """agree() of a 2-rank run whose other rank reports ``codes`` in turn;
    records how many times it was called."""
    seq = iter(codes)
    calls = []

    def agree(mine):
        calls.append(mine)
        return [mine, next(seq)]
    agree.calls = calls
    return agree


@pytest.mark.parametrize('backend', BACKENDS)
def test_both_paths_agree_twice_a_step(backend):
    comp = GradientCompressor('vgc', ['w'], [(4,)], [numpy.float32],
                              backend=backend, alpha=1.0)
    agree = others(OK, OK)
    comp.compress([numpy.ones(4, numpy.float32)],
                  [numpy.ones(4, numpy.float32)], agree=agree)
    assert agree.calls == [OK, OK]


@pytest.mark.parametrize('backend', BACKENDS)
def test_nonfinite_anywhere_skips_even_with_an_overflow_elsewhere(backend):
    """This rank has a NaN gradient, the other rank's residual overflows:
    every rank skips (no state was committed), on both paths."""
    comp = GradientCompressor('vgc', ['w'], [(4,)], [numpy.float32],
                              backend=backend, alpha=1.0)
    g = numpy.array([1, numpy.nan, 1, 1], numpy.float32)
    with pytest.raises(SkippedStep) as info:
        comp.compress([g], [numpy.ones(4, numpy.float32)],
                      agree=others(OK, OVERFLOW))
    assert info.value.ranks == [0]
    assert comp.states[0] is None or not comp.states[0]['r'].any()


@pytest.mark.parametrize('backend', BACKENDS)
def test_overflow_elsewhere_fails_here_too(backend):
    comp = GradientCompressor('vgc', ['w'], [(4,)], [numpy.float32],
                              backend=backend, alpha=1.0)
    with pytest.raises(FloatingPointError, match=r'rank\(s\) \[1\]'):
        comp.compress([numpy.ones(4, numpy.float32)],
                      [numpy.ones(4, numpy.float32)],
                      agree=others(OK, OVERFLOW))


def test_qsgd_generator_does_not_move_on_a_skipped_step():
    """A step skipped because of another rank leaves the generator where it
    was: the next message equals that of a run without the skipped step,
    on both backends."""
    g = [numpy.linspace(-1, 1, 50).astype(numpy.float32)]
    runs = []
    for backend, skip in [('numpy', True), ('native', True),
                          ('native', False)]:
        comp = GradientCompressor('qsgd', ['w'], [(50,)], [numpy.float32],
                                  backend=backend, seed=4)
        comp.compress(g)
        if skip:
            with pytest.raises(SkippedStep):
                comp.compress(g, agree=others(NONFINITE))
        runs.append(comp.compress(g))
    assert numpy.array_equal(runs[0], runs[1])
    assert numpy.array_equal(runs[1], runs[2])


def _mean(backend, sums, dtype, rescale):
    """mean_gradients of one rank's raw message of ``sums``."""
    n = sums.size
    comp = GradientCompressor('vgc', ['w'], [(n,)], [dtype], backend=backend,
                              alpha=1.0, quantize=False)
    msg = codec.pack([codec.raw_group(0, None, sums, n)])
    p = chainer.Parameter(numpy.zeros(n, dtype))
    p.grad = numpy.zeros(n, dtype)
    exchange_mean.mean_gradients([msg, msg], comp, [p], [p.grad], 2, True,
                                 False, rescale=rescale)
    return p.grad


@pytest.mark.parametrize('backend', BACKENDS)
def test_loss_scale_is_applied_before_the_float16_cast(backend):
    """An unscaled float16 mean of 1e-8 (below float16's range) times
    S = 2**16 (above it) is 6.55e-4, not 0 or inf."""
    sums = numpy.array([1e-8, 3e-7, 1e-6, 1e-4], numpy.float32)
    got = _mean(backend, sums, numpy.float16, 2.0 ** 16)
    want = (sums * numpy.float32(2 ** 16)).astype(numpy.float16)
    assert numpy.isfinite(got).all()
    assert numpy.array_equal(got, want)


@pytest.mark.parametrize('dtype', [numpy.float16, numpy.float32,
                                   numpy.float64])
def test_rescaled_mean_is_identical_on_both_backends(dtype):
    rng = numpy.random.default_rng(0)
    sdt = numpy.float64 if dtype == numpy.float64 else numpy.float32
    sums = rng.normal(size=70001).astype(sdt) * 1e-3
    for rescale in (None, 128.0, 2.0 ** 16, 3.0):
        a = _mean('numpy', sums, dtype, rescale)
        b = _mean('native', sums, dtype, rescale)
        assert a.dtype == b.dtype and numpy.array_equal(a, b), rescale


def test_snapshot_record_takes_numpy_scalar_hyperparameters():
    import json
    from chainer_vgc.exchange.state import plain_json as _plain
    text = json.dumps({'alpha': numpy.float32(2.0), 'bits': numpy.int64(3)},
                      default=_plain)
    assert json.loads(text) == {'alpha': 2.0, 'bits': 3}


# ---- in-place residuals (spare_residuals=False, the communicator's default) --

@pytest.mark.parametrize('method,kw', [('vgc', dict(alpha=1.0)),
                                       ('hybrid', dict(alpha=1.0, tau=0.05)),
                                       ('strom', dict(tau=0.05))])
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float16,
                                   numpy.float64])
def test_in_place_steps_equal_the_spare_path_bit_for_bit(method, kw, dtype):
    """The same messages and states, step after step, whether the native
    passes write the next state in place (ordinary stores) or into spares
    swapped in (non-temporal stores); the last tensor is split into
    parallel chunks and ends in a partial block."""
    rng = numpy.random.default_rng(3)
    shapes = [(300,), (17, 5), (4096,), (70001,)]
    comps = [GradientCompressor(method, ['a', 'b', 'c', 'd'], shapes,
                                [dtype] * 4, backend='native',
                                spare_residuals=spare, **kw)
             for spare in (True, False)]
    for step in range(6):
        gs = [(rng.normal(size=s) * 0.1).astype(dtype) for s in shapes]
        ss = [rng.random(s).astype(numpy.float32) * 0.01 for s in shapes]
        msgs = [c.compress(gs, ss if c.rule.needs_sqsum else None)
                for c in comps]
        numpy.testing.assert_array_equal(msgs[0], msgs[1], err_msg=step)
        for a, b in zip(comps[0].states, comps[1].states):
            for key in a:
                numpy.testing.assert_array_equal(a[key], b[key])
    spare, in_place = (c.memory()['spare_residuals'] for c in comps)
    assert spare > 0 and in_place == 0


def test_in_place_nonfinite_input_is_agreed_before_any_state_moves():
    """A NaN in the last tensor: every state untouched (the inputs are
    checked before the passes), the step skipped on every rank."""
    comp = GradientCompressor('vgc', ['a', 'b'], [(8,), (8,)],
                              [numpy.float32] * 2, backend='native',
                              spare_residuals=False, alpha=1.0)
    ones = numpy.ones(8, numpy.float32)
    comp.compress([ones, ones], [ones, ones])
    before = [{k: v.copy() for k, v in st.items()} for st in comp.states]
    bad = ones.copy()
    bad[3] = numpy.nan
    agree = others(OK, OK)
    with pytest.raises(SkippedStep):
        comp.compress([ones, bad], [ones, ones], agree=agree)
    assert agree.calls == [NONFINITE]  # (every rank skips at the first)
    for st, old in zip(comp.states, before):
        for key in st:
            numpy.testing.assert_array_equal(st[key], old[key])
    comp.compress([ones, ones], [ones, ones])  # and it goes on


def agree_checking_states(comp, before, codes):
    """agree() of a 2-rank run (the other rank reports ``codes`` in turn)
    that, at its first call, records whether any state of ``comp``
    already differs from ``before``."""
    agree = others(*codes)
    moved = []

    def check(mine):
        if not agree.calls:
            moved.append(any(
                not numpy.array_equal(st[key], old[key], equal_nan=True)
                for st, old in zip(comp.states, before) for key in st))
        return agree(mine)
    check.calls, check.moved = agree.calls, moved
    return check


@pytest.mark.parametrize('method,kw,bad', [
    (method, kw, bad)
    for method, kw in [('vgc', dict(alpha=1.0)),
                       ('hybrid', dict(alpha=1.0, tau=0.05)),
                       ('strom', dict(tau=0.05))]
    for bad in ['nan-grad', 'inf-grad', 'negative-sqsum']
    if (method, bad) != ('strom', 'negative-sqsum')])  # (strom reads no s)
def test_in_place_nothing_moves_before_the_first_agreement(method, kw, bad):
    """Tensors large enough for parallel chunks, a bad input near the end
    of the last one: when the ranks first agree, no state has moved, and
    the step is skipped with every state untouched.  (A planted bug that
    lets the passes commit before the agreement fails this test:
    tests/planted_bugs.py, 'commit-before-agreement'.)"""
    rng = numpy.random.default_rng(5)
    shapes = [(70001,), (131072,)]
    comp = GradientCompressor(method, ['a', 'b'], shapes,
                              [numpy.float32] * 2, backend='native', **kw)
    assert not comp.spare_residuals  # the default
    gs = [(rng.normal(size=s) * 0.1).astype(numpy.float32) for s in shapes]
    ss = [rng.random(s).astype(numpy.float32) * 0.01 for s in shapes]
    comp.compress(gs, ss if comp.rule.needs_sqsum else None)
    before = [{k: v.copy() for k, v in st.items()} for st in comp.states]
    gs, ss = [g.copy() for g in gs], [s.copy() for s in ss]
    if bad == 'negative-sqsum':
        ss[1][-5] = -1e-3
    else:
        gs[1][-5] = numpy.nan if bad == 'nan-grad' else numpy.inf
    agree = agree_checking_states(comp, before, (OK, OK))
    with pytest.raises(SkippedStep):
        comp.compress(gs, ss if comp.rule.needs_sqsum else None,
                      agree=agree)
    assert agree.moved == [False]
    assert agree.calls == [NONFINITE]
    for st, old in zip(comp.states, before):
        for key in st:
            numpy.testing.assert_array_equal(st[key], old[key])


@pytest.mark.parametrize('gdtype', [numpy.float16, numpy.float32,
                                    numpy.float64])
def test_native_input_checks_equal_the_reference(gdtype):
    """bindings.check_inputs against a NumPy oracle: NaN, +-Inf in g;
    NaN, Inf, a negative value (but not -0.0) in s; at the first element,
    inside a block, in a partial last block and at a chunk boundary, in
    tensors of several sizes; None gradients and None sums."""
    from chainer_vgc.engines.native import bindings
    from chainer_vgc.backends.arrays import state_dtype
    ws = bindings.Workspace()
    rng = numpy.random.default_rng(11)
    sdt = state_dtype(numpy.dtype(gdtype))
    sizes = [1, 15, 16, 17, 1000, 65536, 70001]
    bad_g = [numpy.nan, numpy.inf, -numpy.inf]
    bad_s = [numpy.nan, numpy.inf, -1.0, -1e-30]
    seen = set()
    for n in sizes:
        spots = sorted({0, n - 1, n // 2, min(n - 1, 35008), n // 3})
        for at in spots:
            for kind in range(len(bad_g) + len(bad_s) + 1):
                g = (rng.normal(size=n) * 0.1).astype(gdtype)
                s = rng.random(n).astype(sdt)
                s[rng.integers(n)] = -0.0  # a good sum of squares
                if kind < len(bad_g):
                    g[at] = bad_g[kind]
                elif kind < len(bad_g) + len(bad_s):
                    s[at] = bad_s[kind - len(bad_g)]
                want = ((0 if numpy.isfinite(g.astype(sdt)).all()
                         else bindings.BAD_GRAD) |
                        (0 if (numpy.isfinite(s) & (s >= 0)).all()
                         else bindings.BAD_SQSUM))
                got = bindings.check_inputs(ws, [None, g, g], [None, s, None])
                assert got == [0, want, want & bindings.BAD_GRAD], (n, at,
                                                                    kind)
                seen.add(want)
    assert seen == {0, bindings.BAD_GRAD, bindings.BAD_SQSUM}


def test_in_place_overflow_is_raised_and_then_every_step_refused():
    """An overflow found by the passes (v, the sum of the sums of squares,
    overflows float32)
    after the state moved: the error is raised, and the compressor then
    refuses steps, naming the snapshot and spare_residuals=True."""
    comp = GradientCompressor('vgc', ['a'], [(8,)], [numpy.float32],
                              backend='native', spare_residuals=False,
                              alpha=1.0)
    ones = numpy.ones(8, numpy.float32)
    huge = numpy.full(8, 3e38, numpy.float32)
    comp.compress([ones], [huge])  # kept (ambiguous): v = 3e38
    with pytest.raises(Exception) as first:
        comp.compress([ones], [huge])  # v + 3e38 overflows
    assert not isinstance(first.value, SkippedStep)
    assert 'overflow' in str(first.value).lower()
    with pytest.raises(RuntimeError) as info:
        comp.compress([ones], [ones])
    assert 'spare_residuals=True' in str(info.value)
    assert 'snapshot' in str(info.value)
