"""The dgc rule (Deep Gradient Compression, chainer_vgc/rules/dgc.py)
against a reference written element by element: momentum correction, the
exact top-k with its tie rule, masking, the warm-up's densities, on both
CPU backends; its step count resumed from the extra state; its
arguments checked."""

import math

import chainer
import numpy
import pytest

from chainer_vgc import GradientCompressor
from chainer_vgc import codec
from chainer_vgc.exchange import mean as exchange_mean
from chainer_vgc.rules import DGC

# on both stacks (make test): its results depend on NumPy
pytestmark = pytest.mark.stack


def _floor_log2(x):
    """floor(log2 x) of a positive float (frexp: x = f 2**e, f in [0.5,
    1))."""
    return math.frexp(x)[1] - 1


def _on_the_wire(values, dtype, float32):
    """What FMT_SPARSE delivers for ``values`` (state ``dtype``), worked
    out from the spec (docs/wire_format.md): float32 values as they are
    on a float32 model; else x = floor(log2 max |v|) - 14 and each value
    rounded to float16 after dividing by 2**x (exact), times 2**x; None
    when the largest is subnormal in ``dtype`` (nothing sent)."""
    if float32 and dtype == numpy.float32:
        return list(values)
    top = max(abs(float(v)) for v in values)
    if top < numpy.finfo(dtype).tiny:
        return None
    x = _floor_log2(top) - 14
    wire = numpy.float32 if float32 else numpy.float16
    return [dtype(float(wire(float(v) / 2.0 ** x)) * 2.0 ** x)
            for v in values]


def _clip_factor(grads, clip_norm, workers):
    """DGC's local clipping factor (as the paper's Sec. 3.2 and the rule's
    docstring): the norm summed tensor by tensor in float64."""
    if clip_norm is None:
        return 1.0
    total = 0.0
    for g in grads:
        g64 = numpy.asarray(g, numpy.float64).reshape(-1)
        total += float(g64.dot(g64))
    limit = clip_norm / math.sqrt(workers)
    norm = math.sqrt(total)
    return limit / (norm + 1e-6) if norm > limit else 1.0


def _reference(grads, density, m, masking, warmup, dtype, clip_norm=None,
               float32=False, workers=1, clip_factors=None):
    """Every step's (index, values) of one tensor and its final (r, u),
    element by element in ``dtype`` (the state dtype); ``clip_factors``:
    each step's clipping factor when the norm is over more tensors than
    this one (else from ``clip_norm`` and this tensor)."""
    n = len(grads[0])
    r = [dtype(0)] * n
    u = [dtype(0)] * n
    sent = []
    for step, g in enumerate(grads, 1):
        d = density
        if warmup:
            d = max(density, 0.25 / 4.0 ** ((step - 1) // warmup))
        c = (_clip_factor([g], clip_norm, workers) if clip_factors is None
             else clip_factors[step - 1])
        for i in range(n):
            gi = dtype(g[i])
            if c != 1.0:
                gi = dtype(gi * dtype(c))
            if m:
                u[i] = dtype(u[i] * dtype(m)) + gi
            else:
                u[i] = gi
            r[i] = dtype(r[i] + u[i])
        k = min(n, max(1, int(math.ceil(d * n))))
        order = sorted(range(n), key=lambda i: (-abs(float(r[i])), i))[:k]
        index = sorted(i for i in order if r[i] != 0)
        values = _on_the_wire([r[i] for i in index], dtype, float32) \
            if index else None
        if values is None:
            sent.append(([], []))
            continue
        kept = [(i, v) for i, v in zip(index, values) if v != 0]
        sent.append(([i for i, _ in kept], [v for _, v in kept]))
        for i, v in kept:
            r[i] = dtype(r[i] - v)
            if masking:
                u[i] = dtype(0)
    return sent, numpy.array(r, dtype), numpy.array(u, dtype)


def _stream(n, steps, seed, dtype):
    rng = numpy.random.default_rng(seed)
    out = []
    for _ in range(steps):
        g = rng.normal(0, 1, n).astype(dtype)
        g[rng.integers(0, n, 3)] = 0  # zeros,
        g[:2] = dtype(0.5)            # and ties
        out.append(g)
    return out


@pytest.mark.parametrize('backend', ['numpy', 'native'])
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
@pytest.mark.parametrize('m,masking,warmup,clip,values', [
    (0.9, True, 0, None, 'float16'), (0.9, False, 2, None, 'float32'),
    (0.0, True, 1, 2.0, 'float16'), (0.9, True, 0, 3.0, 'float32')])
def test_messages_and_state_equal_the_element_by_element_reference(
        backend, dtype, m, masking, warmup, clip, values):
    n, steps, density = 97, 6, 0.05
    grads = _stream(n, steps, 1, dtype)
    want, r, u = _reference(grads, density, m, masking, warmup, dtype,
                            clip, values == 'float32', workers=4)
    rule = DGC(density, m, masking, warmup, clip_norm=clip,
               value_dtype=values)
    rule.workers = 4  # (as the exchange sets it)
    comp = GradientCompressor(rule, ['w'], [(n,)], [dtype],
                              backend=backend)
    for g, (index, values) in zip(grads, want):
        msg = comp.compress([g])
        got = codec.unpack(msg, [n], [dtype])
        if not index:
            assert not got or got[0].index.size == 0
            continue
        assert got[0].index.tolist() == index
        assert got[0].value.dtype == dtype
        assert got[0].value.tobytes() == numpy.array(values, dtype).tobytes()
        assert comp.last_sent == len(index)
    assert comp.states[0]['r'].tobytes() == r.tobytes()
    assert comp.states[0]['u'].tobytes() == u.tobytes()


def test_the_warmup_densities_fall_by_four_to_the_density():
    rule = DGC(density=0.001, density_warmup_steps=3)
    got = [rule.current_density(step) for step in range(1, 17)]
    assert got[:3] == [0.25] * 3 and got[3:6] == [0.0625] * 3
    assert got[6] == 0.25 / 16 and got[9] == 0.25 / 64
    assert got[12:] == [0.001] * 4  # 0.25 / 256 < 0.001
    assert DGC(density=0.01).current_density(1) == 0.01


def test_a_resumed_rule_goes_on_bit_for_bit():
    n = 400
    grads = _stream(n, 8, 2, numpy.float32)

    def make():
        return GradientCompressor(DGC(0.01, density_warmup_steps=2), ['w'],
                                  [(n,)], [numpy.float32])
    whole, first = make(), make()
    for g in grads[:4]:
        whole.compress([g])
        first.compress([g])
    resumed = make()
    resumed.rule.set_extra_state(first.rule.get_extra_state())
    resumed.states[0] = {k: v.copy() for k, v in first.states[0].items()}
    assert resumed.rule.steps == 4
    for g in grads[4:]:
        assert whole.compress([g]).tobytes() == resumed.compress(
            [g]).tobytes()


def test_count_is_what_the_next_step_sends_and_moves_nothing():
    n = 300
    g = _stream(n, 1, 3, numpy.float32)[0]
    comp = GradientCompressor(DGC(0.02, density_warmup_steps=1), ['w'],
                              [(n,)], [numpy.float32])
    comp.compress([g])
    before = {k: v.copy() for k, v in comp.states[0].items()}
    counted = comp.rule.count(g, None, comp.states[0])
    for k in before:
        assert comp.states[0][k].tobytes() == before[k].tobytes()
    comp.compress([g])
    assert counted == comp.last_sent == math.ceil(0.0625 * n)


@pytest.mark.parametrize('kw,match', [
    (dict(density=0), 'density'), (dict(density=1.5), 'density'),
    (dict(momentum_factor=1.0), 'momentum_factor'),
    (dict(momentum_factor=-0.1), 'momentum_factor'),
    (dict(momentum_masking='yes'), 'momentum_masking'),
    (dict(density_warmup_steps=-1), 'density_warmup_steps')])
def test_bad_arguments_name_themselves(kw, match):
    with pytest.raises(ValueError, match=match):
        DGC(**kw)


def test_the_simulation_trains_with_it_at_its_density():
    """Two simulated workers (the exchange itself, in one process): the
    compressed group sends about density of its elements a step."""
    from chainer_vgc.harness.simulation import SimulatedWorkers
    model = chainer.links.Classifier(chainer.links.Linear(50, 10))
    opt = chainer.optimizers.SGD(0.1).setup(model)
    sim = SimulatedWorkers(model, opt, 2, 'dgc', density=0.01,
                           min_size=100)
    rng = numpy.random.default_rng(0)
    for _ in range(6):
        sim.update(model, [(rng.normal(size=(8, 50)).astype(numpy.float32),
                            rng.integers(0, 10, 8).astype(numpy.int32))
                           for _ in range(2)])
    assert sim.totals['steps'] == 5
    assert sim.last['vgc/compression_compressed'] == pytest.approx(100.0)


def _large(case, n, step, dtype):
    """Gradients of ``n`` elements that steer the native pass's sampled
    threshold: plain noise; a few levels (ties at the k-th); large values
    only at the sampled positions (the threshold lets fewer than k
    through: the pass's fallback); mostly zeros (fewer than k nonzero)."""
    rng = numpy.random.default_rng(1000 * step + n)
    g = rng.normal(0, 1, n)
    if case == 'ties':
        g = numpy.round(g * 2) / 2
    elif case == 'sampled-only':  # (kernels/vgc_passes.h's sample: runs
        # of 16 elements, 4096 or n / 1024 of them, spread over the tensor)
        runs = min(n // 16, max(4096, n // 1024) // 16)
        g = rng.normal(0, 0.01, n)
        g[(numpy.arange(runs)[:, None] * (n // runs)
           + numpy.arange(16)).ravel()] = 1000.0
    elif case == 'zeros':
        g[rng.random(n) > 0.0005] = 0
    return g.astype(dtype)


@pytest.mark.parametrize('case,n,density', [
    ('noise', 200003, 0.001), ('ties', 150000, 0.003),
    ('sampled-only', 200000, 0.03), ('zeros', 131072, 0.001),
    ('noise', 20000, 0.25)])
@pytest.mark.parametrize('dtype', [numpy.float16, numpy.float32,
                                   numpy.float64])
@pytest.mark.parametrize('clip,values,masking', [
    (None, 'float16', True), (5.0, 'float32', False)])
def test_native_equals_the_rule_on_large_tensors(case, n, density, dtype,
                                                 clip, values, masking):
    """The fused pass (its sampled threshold, its fallback, two threads)
    against the rule's own compress, the reference tested above: the
    messages and both states bit for bit, step after step."""
    def make(backend):
        rule = DGC(density, 0.9, masking, clip_norm=clip,
                   value_dtype=values)
        rule.workers = 2
        return GradientCompressor(rule, ['w'], [(n,)], [dtype],
                                  backend=backend)
    ref, fast = make('numpy'), make('native')
    assert fast.uses_native([numpy.zeros(n, dtype)])
    for step in range(3):
        g = _large(case, n, step, dtype)
        a, b = ref.compress([g]), fast.compress([g])
        assert a.tobytes() == b.tobytes(), step
        for key in ('r', 'u'):
            assert ref.states[0][key].tobytes() == \
                fast.states[0][key].tobytes(), (step, key)


def _device_param(xp, shape, dtype):
    """What mean_gradients reads of a chainer.Parameter, on ``xp``."""
    import types
    return types.SimpleNamespace(
        array=xp.zeros(shape, dtype), grad=xp.ones(shape, dtype), xp=xp,
        dtype=numpy.dtype(dtype), shape=shape, size=int(numpy.prod(shape)))


@pytest.mark.parametrize('values', ['float16', 'float32'])
def test_the_gpu_path_through_the_fake_equals_the_reference(device, values):
    """CuPy gradients (tests/fake_cupy.py): the rule's own compress runs on
    the device arrays (no whole-model GPU step for dgc yet) and gives the
    NumPy reference's messages and states bit for bit; its selected values
    and indices go through the host (two downloads a tensor, the sizes of
    a top-k), the message one more."""
    fake = device
    fake.ftz = True  # CuPy's own arithmetic flushes float32 subnormals
    shapes, dtypes = [(40, 30), (7, 5, 3), (300,)], [numpy.float32,
                                                    numpy.float64,
                                                    numpy.float16]

    def make():
        rule = DGC(0.02, 0.9, True, 2, clip_norm=30.0, value_dtype=values)
        rule.workers = 2
        return GradientCompressor(rule, list('abc'), shapes, dtypes,
                                  backend='numpy')
    host, dev = make(), make()
    rng = numpy.random.default_rng(4)
    for step in range(5):
        gs = [rng.normal(0, 1, s).astype(d) for s, d in zip(shapes, dtypes)]
        gs[0][:5, :5] = numpy.float32(3e-39)  # subnormal: kept, not flushed
        want = host.compress(gs)
        fake.reset()
        got = dev.compress([fake.asarray(g) for g in gs])
        assert isinstance(got, numpy.ndarray)
        assert got.tobytes() == want.tobytes(), step
        assert fake.count('download') <= 2 * len(shapes) + 1  # (+ pack)
        for a, b in zip(host.states, dev.states):
            for key in ('r', 'u'):
                assert isinstance(b[key], fake.ndarray)
                assert a[key].tobytes() == fake.asnumpy(b[key]).tobytes()
        # every parameter with a gradient: the GPU engine's decode, which
        # takes FMT_SPARSE tensor by tensor (its whole-model decode has no
        # descriptor for it), gives the CPU's means bit for bit
        blocks = [want, got]
        means = []
        for xp in (numpy, fake):
            params = [_device_param(xp, s, d) for s, d in zip(shapes, dtypes)]
            exchange_mean.mean_gradients(blocks, dev if xp is fake else host,
                                         params, [p.grad for p in params],
                                         2, True, False)
            means.append([xp.asnumpy(p.grad) if xp is fake else p.grad
                          for p in params])
        for a, b in zip(*means):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.parametrize('backend', ['numpy', 'native'])
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
def test_a_value_that_rounds_to_zero_is_not_sent_and_stays(backend, dtype):
    """Selected values 2**-40 times the largest round to a float16 zero:
    left out of the message, their r kept whole, their u not masked (as
    the element-by-element reference does it)."""
    g = numpy.zeros(10, dtype)
    g[2], g[5], g[7] = 1.0, 1e-13, -3e-13
    grads = [g, g * dtype(0.5)]
    want, r, u = _reference(grads, 0.3, 0.9, True, 0, dtype)
    comp = GradientCompressor(DGC(0.3, 0.9, True), ['w'], [(10,)], [dtype],
                              backend=backend)
    for step, (index, values) in enumerate(want):
        got = codec.unpack(comp.compress([g if step == 0 else grads[1]]),
                           [10], [dtype])
        assert got[0].index.tolist() == index == [2]
        assert got[0].value.tolist() == values
    assert r[5] != 0 and r[7] != 0 and u[5] != 0 and u[7] != 0
    assert comp.states[0]['r'].tobytes() == r.tobytes()
    assert comp.states[0]['u'].tobytes() == u.tobytes()
