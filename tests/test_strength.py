"""Pure functions and the rule against the independent oracles of
``tests/reference.py`` (no MPI): the ring schedule, the traffic figures,
the batch of an update call, CompressionReport, the VGC exponent e_k, and
the mean of partially present gradients (zero_fill=False)."""

import chainer
import numpy
import pytest
from hypothesis import given
from hypothesis import strategies as st

from chainer_vgc import GradientCompressor
from chainer_vgc import codec
from chainer_vgc.exchange import mean as exchange_mean
from chainer_vgc import extensions
from chainer_vgc import reporting
from chainer_vgc.chainermn import multi_node_optimizer
from chainer_vgc.chainermn import transport
from chainer_vgc.params import model_params

import reference

BACKENDS = ['numpy', 'native']


# ---- transport.ring_schedule ------------------------------------------------

@given(counts=st.lists(st.integers(0, 25), min_size=1, max_size=7),
       chunk=st.integers(1, 9))
def test_ring_schedule_matches_a_simulation_of_the_ring(counts, chunk):
    rounds, received = reference.ring_simulation(counts, chunk)
    got = transport.ring_schedule(counts, chunk)
    assert [tuple(s) for s in got] == rounds
    p, total = len(counts), sum(counts)
    for r in range(p):
        # every other block arrives whole, in the ring order r-1, r-2, ...
        want = [((r - k) % p, j) for k in range(1, p)
                for j in range(counts[(r - k) % p])]
        assert received[r] == want
        # rank r forwards everything but the block of r + 1
        if p > 1:
            assert sum(s[r] for s in got) == total - counts[(r + 1) % p]
        assert all(0 <= s[r] <= chunk for s in got)


def test_ring_schedule_fixed_cases():
    assert transport.ring_schedule([5], 2) == []
    assert transport.ring_schedule([0, 0, 0], 4) == []
    # two ranks: each sends its own block, 2 words a round
    assert [tuple(s) for s in transport.ring_schedule([3, 1], 2)] == [
        (2, 1), (1, 0)]
    # three ranks, chunk 1: rank 0 forwards rank 2's word once it has it
    assert [tuple(s) for s in transport.ring_schedule([1, 0, 1], 1)] == [
        (1, 0, 1), (1, 1, 0)]


# ---- step_figures / report_step ---------------------------------------------

def _message(rng, size, n_tensors=3):
    """A VGC-style message of random FMT_POW2 groups (some tensors send
    nothing)."""
    groups = []
    for tid in range(n_tensors):
        if rng.random() < 0.3:
            continue
        n = int(rng.integers(1, size + 1))
        index = numpy.sort(rng.choice(size, n, replace=False))
        vals = rng.normal(size=n).astype(numpy.float32)
        words, ok = codec.pow2_encode(vals, index,
                                      codec.floor_log2(abs(vals).max()))
        if ok.any():
            groups.append(codec.pow2_group(tid, words[ok],
                                           codec.floor_log2(
                                               abs(vals).max())))
    return codec.pack(groups)


@pytest.mark.parametrize('p', [1, 2, 3, 4])
def test_step_figures_against_the_ring_and_the_messages(p):
    rng = numpy.random.default_rng(p)
    for trial in range(20):
        blocks = [_message(rng, 40) for _ in range(p)]
        counts = [int(b.size) for b in blocks]
        n_params = 3 * 40 + 17
        dense_elements = 17 * p if trial % 2 else 0
        dense_wire = 2 * (p - 1) * 4 * 17 / p if trial % 2 else 0.0
        n_compressed = n_params - 17 if trial % 2 else None
        fig = reporting.step_figures(
            blocks, n_params, None, 4 * n_params, size=p,
            dense_elements=dense_elements, dense_wire=dense_wire,
            n_compressed=n_compressed)
        # bytes each rank sends, on average over the ranks, in the ring
        per_rank = reference.ring_bytes_sent(counts, chunk_words=7)
        wire = sum(per_rank) / p + dense_wire
        assert fig['vgc/bytes'] == pytest.approx(wire, rel=1e-12, abs=0)
        assert fig['_bytes'] == pytest.approx(wire, rel=1e-12, abs=0)
        if p == 1:
            assert fig['vgc/bytes'] == 0
        sent = sum(reference.message_elements(b) for b in blocks)
        elements = sent + dense_elements
        assert fig['_elements'] == elements
        if elements:
            assert fig['vgc/compression'] == pytest.approx(
                n_params * p / elements, rel=1e-12)
        else:
            assert fig['vgc/compression'] == float('inf')
        assert fig['vgc/density'] == pytest.approx(
            elements / p / n_params, rel=1e-12, abs=0)
        assert fig['_dense_bytes'] == pytest.approx(
            2 * (p - 1) * 4 * n_params / p, rel=1e-12, abs=0)
        assert fig['vgc/skipped'] == 0
        if n_compressed is None:
            assert 'vgc/dense_fraction' not in fig
        else:
            assert fig['vgc/dense_fraction'] == pytest.approx(
                17 / n_params)
            assert fig['vgc/compression_compressed'] == (
                pytest.approx(n_compressed * p / sent) if sent
                else float('inf'))
        # elements given by the caller win over counting
        given_elements = [7] * p
        fig2 = reporting.step_figures(blocks, n_params, given_elements,
                                      size=p)
        assert fig2['_elements'] == 7 * p
        assert fig2['vgc/bytes'] == pytest.approx(sum(per_rank) / p)
        assert fig2['_dense_bytes'] == pytest.approx(
            2 * (p - 1) * 4 * n_params / p)


def test_report_step_adds_to_the_totals_and_reports():
    rng = numpy.random.default_rng(9)
    totals = reporting.new_totals()
    reporter = chainer.Reporter()
    seen = []
    want = dict(steps=0, elements=0, bytes=0.0, dense_bytes=0.0,
                param_elements=0)
    for step in range(3):
        blocks = [_message(rng, 30) for _ in range(4)]
        obs = {}
        with reporter.scope(obs):
            fig = reporting.report_step(blocks, 90, totals,
                                        param_bytes=2 * 90)
        seen.append(obs)
        counts = [int(b.size) for b in blocks]
        elements = sum(reference.message_elements(b) for b in blocks)
        want['steps'] += 1
        want['elements'] += elements
        want['bytes'] += sum(reference.ring_bytes_sent(counts, 64)) / 4
        want['dense_bytes'] += 2 * 3 * 2 * 90 / 4
        want['param_elements'] += 90
        for key, value in want.items():
            assert totals[key] == pytest.approx(value, rel=1e-12), key
        assert totals['skipped'] == 0
        assert sorted(obs) == sorted(k for k in fig if not k.startswith('_'))
        for key in obs:
            assert obs[key] == fig[key]
        assert obs['vgc/compression'] == (
            pytest.approx(90 * 4 / elements) if elements else float('inf'))


# ---- multi_node_optimizer._batch_of ----------------------------------------

def test_batch_of_positional_arrays():
    calls = []

    def lossfun(*args, **kw):
        calls.append((args, kw))
        return 'loss'
    x, t = numpy.zeros((4, 2)), numpy.arange(4)
    batch, loss_fn = multi_node_optimizer._batch_of(lossfun, (x, t), {})
    assert len(batch) == 2 and batch[0] is x and batch[1] is t
    assert loss_fn(x[:1], t[:1]) == 'loss'
    (args, kw), = calls
    assert args[0].shape == (1, 2) and args[1].tolist() == [0] and kw == {}
    # keywords that are not arrays are passed along
    calls.clear()
    batch, loss_fn = multi_node_optimizer._batch_of(lossfun, (x, t), {'scale': 2})
    assert batch[0] is x and batch[1] is t
    loss_fn(x[1:2], t[1:2])
    (args, kw), = calls
    assert args[1].tolist() == [1] and kw == {'scale': 2}


def test_batch_of_dict_batches():
    calls = []

    def lossfun(*args, **kw):
        calls.append((args, kw))
        return 'loss'
    x, t = numpy.ones((3, 5)), numpy.arange(3)
    batch, loss_fn = multi_node_optimizer._batch_of(
        lossfun, (), {'x': x, 'flag': 'on', 't': t})
    assert len(batch) == 2 and batch[0] is x and batch[1] is t
    assert loss_fn(x[2:3], t[2:3]) == 'loss'
    (args, kw), = calls
    assert args == ()
    assert sorted(kw) == ['flag', 't', 'x'] and kw['flag'] == 'on'
    assert kw['x'].shape == (1, 5) and kw['t'].tolist() == [2]


# ---- CompressionReport ------------------------------------------------------

class _FakeCompressor(object):
    n_params = 1000


class _FakeState(object):
    def __init__(self):
        self.compressor = _FakeCompressor()
        self.totals = reporting.new_totals()


class _FakeCommunicator(object):
    """One model's state, ``state()`` (CompressionReport without a model
    reads the state of the model exchanged last)."""

    def __init__(self, size):
        self.size = size
        self._state = _FakeState()

    def state(self, model=None):
        assert model is None
        return self._state


def _report(ext):
    obs = {}
    with chainer.Reporter().scope(obs):
        ext(None)
    return obs


def test_compression_report_totals_and_intervals():
    comm = _FakeCommunicator(4)
    ext = extensions.CompressionReport(comm, trigger=(1, 'iteration'))
    tot = comm.state().totals
    # 3 steps of 1000 parameters, 40 + 80 + 120 elements over 4 ranks
    tot.update(steps=3, elements=240, param_elements=3000, bytes=123.0,
               dense_bytes=4.5e3)
    out = _report(ext)
    assert out['vgc/total_compression'] == pytest.approx(3000 / (240 / 4))
    assert out['vgc/interval_compression'] == pytest.approx(3000 / 60)
    assert out['vgc/total_bytes'] == 123.0
    assert out['vgc/dense_bytes'] == 4.5e3
    # 2 more steps with 400 elements: the interval sees only them
    tot.update(steps=5, elements=640, param_elements=5000)
    out = _report(ext)
    assert out['vgc/interval_compression'] == pytest.approx(2000 / 100)
    assert out['vgc/total_compression'] == pytest.approx(5000 / 160)
    # no step since the last report: no interval figure
    out = _report(ext)
    assert 'vgc/interval_compression' not in out
    # steps that sent nothing
    tot.update(steps=6, param_elements=6000)
    out = _report(ext)
    assert out['vgc/interval_compression'] == float('inf')
    # an old run without param_elements: the compressor's size x steps
    old = _FakeCommunicator(2)
    old.state().totals = dict(steps=4, elements=100, bytes=0.0,
                              dense_bytes=0.0, skipped=0)
    out = _report(extensions.CompressionReport(old))
    assert out['vgc/total_compression'] == pytest.approx(4000 / 50)


# ---- VGCCommunicator.state(): the model exchanged last ---------------------

#: what the communicator once forwarded to the state of the model exchanged
#: last (``comm.totals``, ...): now only the state's, ``comm.state().totals``
OLD_PROXIES = (
    'totals', 'last', 'skipped', 'last_timing', 'compressor', 'rule',
    'base_rule', 'method', 'hyperparams', 'exclude', 'min_size', 'warmup',
    'alpha_ramp', 'dense_dtype', 'uncovered', 'max_memory',
    'count_by_parameter', 'elements_by_parameter', 'parameter_sizes',
    'spare_residuals', 'examples', 'resume_other_method',
    'resume_residuals', 'needs_sqsum', 'warming_up', 'compressed_elements',
    'workers')


def _exchange(comm, model, rng):
    """One exchange of ``model`` with normal gradients (and their squares
    as the sums of squares)."""
    _, params = model_params(model)
    for p in params:
        p.grad = rng.normal(size=p.shape).astype(p.dtype)
    comm.exchange(model, sqsums=[p.grad ** 2 for p in params])


def test_state_without_a_model_is_that_of_the_model_exchanged_last():
    """Two models on one communicator (one rank, MPI_COMM_SELF):
    ``comm.state()`` is the state made on construction before any model
    (the first model's), then that of the model set up or exchanged last;
    the communicator has none of the state's attributes of its own."""
    from mpi4py import MPI
    from chainer_vgc.chainermn import communicator
    comm = communicator.VGCCommunicator(MPI.COMM_SELF, method='vgc',
                                        alpha=1.0)
    made = comm.state()
    gen = chainer.links.Linear(5, 4)
    dis = chainer.links.Linear(3, 2)
    assert comm.state(gen) is made and comm.state() is made
    assert comm.state(dis) is not made and comm.state() is made  # (met)
    comm.setup(dis)
    assert comm.state() is comm.state(dis)
    rng = numpy.random.default_rng(0)
    steps = {gen: 0, dis: 0}
    for model in (gen, dis, dis, gen, dis):
        _exchange(comm, model, rng)
        steps[model] += 1
        assert comm.state() is comm.state(model)
        assert comm.state().totals['steps'] == steps[model]
        other = dis if model is gen else gen
        assert comm.state(other).totals['steps'] == steps[other]
    # what a script sets goes to the state of the model exchanged last
    comm.state().count_by_parameter = True
    assert comm.state(dis).count_by_parameter
    assert not comm.state(gen).count_by_parameter
    for name in OLD_PROXIES:
        assert hasattr(made, name), name  # (the state's attributes)
        fix = r'comm\.state\(model\)\.' + name
        with pytest.raises(AttributeError, match=fix):
            getattr(comm, name)
        with pytest.raises(AttributeError, match=fix):  # not ignored
            setattr(comm, name, True)
    assert set(OLD_PROXIES) == communicator.STATE_ATTRIBUTES


# ---- VGC: e_k over the selected elements ------------------------------------

def _compress(backend, dtype, steps, **kw):
    """The rule's messages and sent values for ``steps`` of (g, s)."""
    n = steps[0][0].size
    comp = GradientCompressor('vgc', ['p'], [(n,)], [dtype],
                              backend=backend, **kw)
    out = []
    for g, s in steps:
        msg = comp.compress([g], [s])
        out.append((msg, reference.decode_message(msg, [n])[0]))
    return comp, out


@pytest.mark.parametrize('backend', BACKENDS)
@pytest.mark.parametrize('dtype', [numpy.float16, numpy.float32,
                                   numpy.float64])
def test_e_k_is_taken_over_the_selected_elements(backend, dtype):
    """Element 0 (|r| = 1000) is not selected (large variance), element 1
    (|r| = 1) and element 2 (-0.75, a tie: -1) are: e_k = 0, and 1.0 and
    -1.0 are sent.  Over all elements e_k would be 9 and d = 9 > 7: nothing
    sent.  (1000**2 <= 20 * 6e4: not selected; float16 holds 6e4.)"""
    g = numpy.array([1000.0, 1.0, -0.75], dtype)
    s = numpy.array([6e4, 0.0, 0.0], dtype)
    for keep in (False, True):
        comp, [(msg, sent)] = _compress(backend, dtype, [(g, s)],
                                        alpha=20.0, keep_unrepresentable=keep)
        groups = reference.parse_message(msg)
        assert len(groups) == 1, 'nothing sent: e_k over unselected |r|?'
        (tid, fmt, count, a, b, body), = groups
        assert (fmt, count, a) == (reference.FMT_POW2, 2, 0)  # e_k = 0
        assert sent.tolist() == [0.0, 1.0, -1.0]
        r = comp.state(0)['r']
        assert r.tolist() == [1000.0, 0.0, 0.0]


def _wide_stream(rng, n, steps, dtype):
    """Gradients spread over 2**-14 .. 2**5, so d > 7 is common: about
    half the elements "noisy" (large, with sums of squares that keep them
    unselected for a while), the others "quiet" (small, selected)."""
    noisy = rng.random(n) < 0.5
    out = []
    for _ in range(steps):
        mag = numpy.where(noisy, 2.0 ** rng.uniform(-2, 5, size=n),
                          2.0 ** rng.uniform(-14, 3, size=n))
        g = (mag * rng.choice([-1.0, 1.0], size=n)).astype(dtype)
        s = numpy.where(noisy, (mag * rng.uniform(1.5, 2.5, size=n)) ** 2,
                        (mag * rng.uniform(0, 0.5, size=n)) ** 2)
        s[rng.random(n) < 0.1] = 0
        out.append((g, s.astype(dtype)))
    return out


@pytest.mark.parametrize('backend', BACKENDS)
@pytest.mark.parametrize('dtype', [numpy.float16, numpy.float32,
                                   numpy.float64])
@pytest.mark.parametrize('keep', [False, True])
def test_vgc_with_unrepresentable_elements_matches_the_oracle(backend, dtype,
                                                              keep):
    """Generated streams where d > 7 is common and unselected residuals
    dwarf the selected ones: values sent, group exponent and state (r, v)
    equal the brute-force Fig. "Basic" of tests/reference.py, with either
    keep_unrepresentable."""
    rng = numpy.random.default_rng(11)
    covered = dict(unrepresentable=0, larger_unselected=0)
    sdt = numpy.float64 if dtype == numpy.float64 else numpy.float32
    for case in range(60):
        n = int(rng.integers(1, 40))
        alpha = float(rng.choice([0.5, 1.0, 2.0]))
        zeta = float(rng.choice([0.5, 0.999]))
        stream = _wide_stream(rng, n, 6, dtype)
        comp, got = _compress(backend, dtype, stream, alpha=alpha,
                              zeta=zeta, keep_unrepresentable=keep)
        oracle = reference.VGCOracle([n], sdt, alpha=alpha, zeta=zeta,
                                     keep_unrepresentable=keep)
        for (g, s), (msg, sent) in zip(stream, got):
            want, = oracle.step([g], [s])
            assert sent.tolist() == want.tolist(), case
            groups = reference.parse_message(msg)
            e_k, = oracle.last_e_k
            assert bool(groups) == (e_k is not None)
            if groups:  # the header's exponent is the oracle's e_k
                (_, fmt, _, a, _, _), = groups
                # the paper's word, or gap-coded indices (index_coding
                # 'auto'): the same header fields
                assert fmt in (reference.FMT_POW2, codec.FMT_GAP)
                assert int(numpy.uint32(a).view(numpy.int32)) == e_k
            # coverage: a selected element not sent (d > 7), and an
            # unselected |r| above 2**8 times every selected one (where e_k
            # over all elements would drop every selected element)
            info = oracle.last_info[0]
            chosen = [abs(info['r'][i]) for i in info['selected']]
            others = [abs(x) for i, x in enumerate(info['r'])
                      if i not in info['selected']]
            if any(want[i] == 0 for i in info['selected']):
                covered['unrepresentable'] += 1
            if chosen and others and max(others) >= 256 * max(chosen):
                covered['larger_unselected'] += 1
        r = comp.state(0)['r'].tolist()
        assert r == [float(x) for x in oracle.r[0]]
        assert comp.state(0)['v'].tolist() == [float(x)
                                               for x in oracle.v[0]]
    assert covered['unrepresentable'] >= 100
    assert covered['larger_unselected'] >= 10


# ---- zero_fill=False: a parameter some ranks have no gradient for -----------

def _partial_exchange(backend, alpha, grads_of, p=2, steps=4, seed=0):
    """``p`` simulated ranks exchange messages with
    :func:`exchange_mean.mean_gradients` (zero_fill=False); ``grads_of(rank,
    step)`` says which of the 2 tensors have a gradient.  Returns, per step,
    every rank's resulting grads and the oracle's mean."""
    rng = numpy.random.default_rng(seed)
    shapes = [(5,), (7,)]
    comps = [GradientCompressor('vgc', ['a', 'b'], shapes,
                                [numpy.float32] * 2, backend=backend,
                                alpha=alpha) for _ in range(p)]
    oracles = [reference.VGCOracle([5, 7], numpy.float32, alpha=alpha)
               for _ in range(p)]
    params = [[chainer.Parameter(numpy.zeros(s, numpy.float32))
               for s in shapes] for _ in range(p)]
    out = []
    for step in range(steps):
        grads, sqsums, msgs = [], [], []
        want = [None, None]
        for rank in range(p):
            have = grads_of(rank, step)
            g = [rng.normal(size=s).astype(numpy.float32) if h else None
                 for s, h in zip(shapes, have)]
            s = [None if x is None else
                 (x * x * rng.uniform(0, 0.6)).astype(numpy.float32)
                 for x in g]
            sent = oracles[rank].step(g, s)
            for k, x in enumerate(sent):
                if x is not None:
                    want[k] = x if want[k] is None else want[k] + x
            msgs.append(comps[rank].compress(
                [None if x is None else x.copy() for x in g], s))
            grads.append(g)
            sqsums.append(s)
        for rank in range(p):
            for prm, g in zip(params[rank], grads[rank]):
                prm.grad = None if g is None else g.copy()
            # which tensors have a gradient on some rank: what the
            # communicator's agreement tells every rank
            present = [any(grads_of(r, step)[k] for r in range(p))
                       for k in range(len(shapes))]
            exchange_mean.mean_gradients(
                msgs, comps[rank], params[rank],
                [prm.grad for prm in params[rank]], p, False, False,
                present=present)
        got = [[None if prm.grad is None else prm.grad.copy()
                for prm in params[rank]] for rank in range(p)]
        out.append((got, [None if w is None else w / p for w in want]))
    return out


@pytest.mark.parametrize('backend', BACKENDS)
@pytest.mark.parametrize('p', [2, 3])
def test_zero_fill_false_partial_gradients_same_mean_everywhere(backend, p):
    """Tensor 'b' has a gradient on rank 0 only: every rank gets the same
    mean, (sum of the compressed contributions) / p, for both tensors."""
    def grads_of(rank, step):
        return (True, rank == 0)
    for got, want in _partial_exchange(backend, 0.5, grads_of, p=p):
        assert want[1] is not None and want[1].any()  # rank 0 sent some
        for rank in range(p):
            for k in range(2):
                assert got[rank][k] is not None, (rank, k)
                assert got[rank][k].tolist() == got[0][k].tolist()
                numpy.testing.assert_allclose(got[rank][k], want[k],
                                              rtol=1e-6, atol=0)


@pytest.mark.parametrize('backend', BACKENDS)
def test_zero_fill_false_nothing_sent_is_the_same_everywhere(backend):
    """Tensor 'b' has a gradient on rank 0 only and nobody sends anything:
    every rank still gets the same (zero) mean, not zeros on rank 0 and
    None elsewhere (an optimizer with momentum would then move it on some
    ranks only)."""
    def grads_of(rank, step):
        return (True, rank == 0)
    got, want = _partial_exchange(backend, 1e12, grads_of, steps=1)[0]
    assert not any(w.any() for w in want)  # nothing sent (alpha 1e12)
    for rank in range(2):
        for k in range(2):
            a, b = got[rank][k], got[0][k]
            assert (a is None) == (b is None), (rank, k)


# ---- multi_node_optimizer.serialize_fp32_masters ----------------------------
def _half_model_and_adam(fp32):
    import chainer.links as L
    numpy.random.seed(0)
    with chainer.using_config('dtype', numpy.float16):
        model = L.Linear(3, 2)
    opt = chainer.optimizers.Adam()
    if fp32:
        opt.use_fp32_update()
    opt.setup(model)
    model.W.grad = numpy.full((2, 3), 0.25, numpy.float16)
    model.b.grad = numpy.full(2, -0.5, numpy.float16)
    opt.update()
    return model, opt


def _save(model, opt):
    saved = {}
    ser = chainer.serializers.DictionarySerializer(saved)
    opt.serialize(ser)
    multi_node_optimizer.serialize_fp32_masters(model, ser['vgc_fp32'])
    return saved


def _load(model, opt, saved):
    de = chainer.serializers.NpzDeserializer(saved)
    opt.serialize(de)
    multi_node_optimizer.serialize_fp32_masters(model, de['vgc_fp32'])


def test_fp32_masters_are_saved_and_restored():
    """The float32 master weights of float16 parameters updated in float32
    travel with the snapshot (Chainer's serialization leaves them out):
    after loading, the masters are the saved ones, not the float16
    parameters' rounding."""
    model, opt = _half_model_and_adam(fp32=True)
    masters = {n: p.update_rule._fp32_param.array.copy()
               for n, p in model.namedparams()}
    assert any((m != m.astype(numpy.float16)).any() for m in masters.values())
    saved = _save(model, opt)
    fresh, fresh_opt = _half_model_and_adam(fp32=True)
    for p in fresh.params():
        p.update_rule._fp32_param = None  # (as a new process has)
    _load(fresh, fresh_opt, saved)
    for n, p in fresh.namedparams():
        got = p.update_rule._fp32_param.array
        assert got.dtype == numpy.float32
        assert (got == masters[n]).all(), n


def test_a_float16_state_loads_as_float32_for_float32_updates():
    """A snapshot saved before float32 updates were on holds Adam's m and v
    in float16: loading them for float32 updates casts them to float32
    (a float16 v would underflow again, issue 24)."""
    model, opt = _half_model_and_adam(fp32=False)
    assert model.W.update_rule.state['v'].dtype == numpy.float16
    saved = _save(model, opt)
    assert not any(k.startswith('vgc_fp32') for k in saved)
    fresh, fresh_opt = _half_model_and_adam(fp32=True)
    _load(fresh, fresh_opt, saved)
    for n, p in fresh.namedparams():
        for k in ('m', 'v'):
            got = p.update_rule.state[k]
            assert got.dtype == numpy.float32, (n, k)
            want = getattr(model, n.strip('/')).update_rule.state[k]
            assert (got == want.astype(numpy.float32)).all(), (n, k)
