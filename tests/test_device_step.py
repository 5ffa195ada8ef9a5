"""The whole-model GPU compress step (chainer_vgc.engines.cuda.compress), run on the
CPU through the fake CuPy with its kernels compiled for the host (the
``device`` fixture): messages and states bit for bit those of the native
CPU backend, step after step, faults leaving every state untouched, and a
fixed number of launches with one download and no scalar read."""

import numpy
import pytest

from chainer_vgc import GradientCompressor
from chainer_vgc.backends import arrays
from chainer_vgc.backends import registry
from chainer_vgc.backends.cuda import kernels
from chainer_vgc import codec
from chainer_vgc.codec.message import walk
from chainer_vgc.faults import SkippedStep
from chainer_vgc.engines.cuda import compress as device_compress
from chainer_vgc.exchange import mean as exchange_mean
from chainer_vgc import faults
from chainer_vgc.rules import CompressionRule

from reference import assert_bitwise
from test_gpu_path import _FakeModel
from test_gpu_path import param

# on both stacks (make test): its results depend on NumPy, the native
# build or the installed packages (docs/contributing.md)
pytestmark = pytest.mark.stack

F16, F32, F64 = numpy.float16, numpy.float32, numpy.float64
METHODS = [
    ('vgc', dict(alpha=1.0)),
    ('vgc', dict(alpha=1.5, zeta=0.9)),
    ('vgc', dict(alpha=1.0, keep_unrepresentable=True)),
    ('hybrid', dict(alpha=1.0, tau=0.05)),
    ('strom', dict(tau=0.05)),
    ('none', {}),
]
IDS = ['vgc', 'vgc-zeta', 'vgc-keep', 'hybrid', 'strom', 'none']
CODED = [
    ('vgc', dict(alpha=1.0, index_coding='gap')),
    ('vgc', dict(alpha=1.5, zeta=0.9, index_coding='auto')),
    ('hybrid', dict(alpha=1.0, tau=0.05, index_coding='auto')),
    ('hybrid', dict(alpha=1.0, tau=0.05, index_coding='gap')),
    ('strom', dict(tau=0.05, index_coding='auto')),
]
CODED_IDS = ['vgc-gap', 'vgc-auto', 'hybrid-auto', 'hybrid-gap',
             'strom-auto']
MODELS = {
    'f32': ([(17, 3), (5,), (0,), (64,), (9, 2), (1,)], [F32] * 6),
    'f16': ([(40,), (3, 3), (0,), (7,)], [F16] * 4),
    'f64': ([(33,), (8,), (2, 2)], [F64] * 3),
    'f16+f32': ([(12,), (30,), (5,)], [F16, F32, F16]),
    # groups of more than 1,024 elements: FMT_GAP restart tables (issue 25)
    'big': ([(12000,), (5,), (4100, 2)], [F32] * 3),
}


def _stream(shapes, dtypes, steps, seed, missing=()):
    """Gradients with a wide dynamic range (d > 7 and subnormal values
    occur) and their per-sample squares; ``missing``: (step, tensor)
    pairs without a gradient."""
    rng = numpy.random.default_rng(seed)
    out = []
    for k in range(steps):
        gs, ss = [], []
        for t, (shape, dt) in enumerate(zip(shapes, dtypes)):
            g = rng.normal(0, 1, shape) * numpy.where(
                rng.random(shape) < 0.3, 2.0 ** -14, 1.0)
            if dt == F32 and g.size:
                g.reshape(-1)[0] = 1e-40  # a float32 subnormal
            s = (g ** 2 * rng.uniform(0.5, 3, shape))
            gs.append(None if (k, t) in missing else g.astype(dt))
            ss.append(None if (k, t) in missing else s.astype(dt))
        out.append((gs, ss))
    return out


def _pair(method, kw, shapes, dtypes):
    names = [str(i) for i in range(len(shapes))]
    if method != 'none':
        kw = dict(dict(index_coding='fixed'), **kw)
    # the device step commits as the native spare path does (it keeps two
    # device arenas and swaps them in when no tensor faulted), whatever
    # spare_residuals says: that path is its CPU counterpart
    return (GradientCompressor(method, names, shapes, dtypes, **kw),
            GradientCompressor(method, names, shapes, dtypes,
                               backend='native', spare_residuals=True,
                               **kw))


def _on(fake, arrays):
    return [None if a is None else fake.asarray(a) for a in arrays]


def _assert_states(dev, cpu, fake):
    for a, b in zip(dev.states, cpu.states):
        assert (a is None) == (b is None)
        if a is None:
            continue
        assert sorted(a) == sorted(b)
        for key in a:
            assert_bitwise(fake.asnumpy(a[key]), b[key])


@pytest.mark.parametrize('model', sorted(MODELS))
@pytest.mark.parametrize('method,kw', METHODS + CODED, ids=IDS + CODED_IDS)
def test_messages_and_states_equal_the_cpu_backend(device, method, kw,
                                                   model):
    fake = device
    shapes, dtypes = MODELS[model]
    dev, cpu = _pair(method, kw, shapes, dtypes)
    missing = {(1, 0), (2, len(shapes) - 1), (3, 1)}
    formats, restarts = set(), {0}
    for k, (gs, ss) in enumerate(_stream(shapes, dtypes, 5, 3, missing)):
        fake.reset()
        got = dev.compress(_on(fake, gs), _on(fake, ss))
        assert isinstance(dev.device_engine.step, device_compress.DeviceStep)
        assert fake.count('download') == 1 and fake.count('scalar') == 0
        want = cpu.compress(gs, ss)
        assert_bitwise(got, want)
        assert dev.last_sent == cpu.last_sent
        assert dev.last_bytes == cpu.last_bytes
        _assert_states(dev, cpu, fake)
        formats.update(g.fmt for g in walk(got, dev.sizes))
        restarts.update(codec.gap_restarts(g.count)
                        for g in walk(got, dev.sizes)
                        if g.fmt == codec.FMT_GAP)
    if kw.get('index_coding') == 'gap':  # re-coded on the host
        assert codec.FMT_GAP in formats, formats
        if model == 'big':  # the device wrote restart tables
            assert max(restarts) >= 1, restarts
    if (kw.get('index_coding') == 'auto'
            and (method, model) == ('vgc', 'f32')):
        assert {codec.FMT_GAP, codec.FMT_POW2} <= formats, formats


@pytest.mark.parametrize('method,kw', METHODS, ids=IDS)
@pytest.mark.parametrize('where', ['grad', 'sqsum', 'overflow'])
def test_a_fault_leaves_every_state_as_it_was(device, method, kw, where):
    fake = device
    shapes, dtypes = MODELS['f32']
    dev, cpu = _pair(method, kw, shapes, dtypes)
    steps = _stream(shapes, dtypes, 3, 5)
    for gs, ss in steps[:2]:
        dev.compress(_on(fake, gs), _on(fake, ss))
        cpu.compress(gs, ss)
    gs, ss = [None if a is None else a.copy() for a in steps[2][0]], \
        [a.copy() for a in steps[2][1]]
    if where == 'grad':
        gs[3][5] = numpy.nan
    elif method == 'none' or (where, method) == ('sqsum', 'strom'):
        pytest.skip('{} reads no sum of squares and has no state'.format(
            method))
    elif where == 'sqsum':
        ss[4][1, 1] = -1.0
    else:  # r (and v) overflow float32, the element not selected
        big = numpy.finfo(F32).max
        gs[3][7] = ss[3][7] = big
        for st in (dev.states[3], cpu.states[3]):
            for key in st:
                st[key][7] = big
    before = [{k: fake.asnumpy(v).copy() for k, v in st.items()}
              for st in dev.states if st is not None]
    with pytest.raises(Exception) as cpu_error:
        cpu.compress(gs, ss)
    with pytest.raises(type(cpu_error.value)) as dev_error:
        dev.compress(_on(fake, gs), _on(fake, ss))
    assert str(dev_error.value) == str(cpu_error.value)
    after = [{k: fake.asnumpy(v) for k, v in st.items()}
             for st in dev.states if st is not None]
    for b, a in zip(before, after):
        for key in b:
            assert_bitwise(a[key], b[key])
    _assert_states(dev, cpu, fake)
    # and the next good step goes on as on the CPU
    gs, ss = _stream(shapes, dtypes, 1, 9)[0]
    assert_bitwise(dev.compress(_on(fake, gs), _on(fake, ss)),
                   cpu.compress(gs, ss))
    _assert_states(dev, cpu, fake)


@pytest.mark.parametrize('coding', ['fixed', 'auto'])
def test_a_step_failing_after_the_select_pass_leaves_nothing_behind(
        device, monkeypatch, coding):
    """An error between the select pass and the layout (an out-of-memory
    error on an intermediate array) leaves the state as it was, and the
    per-tensor maxima of that step (e_k's input) are cleared with the
    flags at the next step's start: its message and states equal the CPU
    path that never saw the failed step (issue 36)."""
    from chainer_vgc.backends.cuda import kernels
    fake = device
    shapes, dtypes = MODELS['f32']
    dev, cpu = _pair('vgc', dict(alpha=1.0, index_coding=coding), shapes,
                     dtypes)
    steps = _stream(shapes, dtypes, 3, 11)
    # the failed step's gradients are 2**10 larger: its maxima, if left,
    # raise the next step's e_k
    big = ([None if g is None else g * 1024 for g in steps[1][0]],
           [None if q is None else q * 2 ** 20 for q in steps[1][1]])
    launch = kernels.get_kernel

    def failing(name):
        if name == 'vgc_model_keep':
            def oom(*args):
                raise MemoryError('out of memory (planted)')
            return oom
        return launch(name)
    for k, (gs, ss) in enumerate([steps[0], big, steps[2]]):
        if k == 1:
            monkeypatch.setattr(kernels, 'get_kernel', failing)
            with pytest.raises(MemoryError):
                dev.compress(_on(fake, gs), _on(fake, ss))
            monkeypatch.setattr(kernels, 'get_kernel', launch)
            continue
        got = dev.compress(_on(fake, gs), _on(fake, ss))
        assert_bitwise(got, cpu.compress(gs, ss))
        _assert_states(dev, cpu, fake)


def test_agreement_skips_the_step_on_every_worker(device):
    """With ``agree`` (the communicator's), a fault raises SkippedStep and
    the codes go through it as on the CPU."""
    fake = device
    shapes, dtypes = MODELS['f32']
    dev, cpu = _pair('vgc', dict(alpha=1.0), shapes, dtypes)
    gs, ss = _stream(shapes, dtypes, 1, 2)[0]
    gs[0][0, 0] = numpy.inf
    for comp, on in ((cpu, lambda a: a), (dev, lambda a: _on(fake, a))):
        codes = []
        with pytest.raises(SkippedStep):
            comp.compress(on(gs), on(ss),
                          agree=lambda c: codes.append(c) or [c])
        assert codes == [faults.OK, faults.NONFINITE]


def test_a_state_set_from_outside_is_taken_in(device):
    """A snapshot loaded or a state reset between steps (the compressor's
    ``states`` replaced) is what the next step starts from."""
    fake = device
    shapes, dtypes = MODELS['f32']
    dev, cpu = _pair('vgc', dict(alpha=1.0), shapes, dtypes)
    steps = _stream(shapes, dtypes, 4, 8)
    for gs, ss in steps[:2]:
        dev.compress(_on(fake, gs), _on(fake, ss))
        cpu.compress(gs, ss)
    rng = numpy.random.default_rng(0)
    for i in (0, 3):
        new = {k: rng.normal(0, 1, v.shape).astype(v.dtype) ** 2
               for k, v in cpu.states[i].items()}
        cpu.states[i] = new
        dev.states[i] = {k: fake.asarray(v) for k, v in new.items()}
    cpu.states[4] = None
    dev.states[4] = None
    for gs, ss in steps[2:]:
        assert_bitwise(dev.compress(_on(fake, gs), _on(fake, ss)),
                       cpu.compress(gs, ss))
        _assert_states(dev, cpu, fake)


def test_settings_it_does_not_cover_take_the_per_tensor_kernels(device):
    fake = device
    shapes, dtypes = MODELS['f32']
    for method, kw in (('vgc', dict(quantize=False)),
                       ('qsgd', dict(bits=2, bucket=8, seed=1))):
        comp = GradientCompressor(method, list('abcdef'), shapes, dtypes,
                                  **kw)
        gs, ss = _stream(shapes, dtypes, 1, 1)[0]
        comp.compress(_on(fake, gs), _on(fake, ss))
        assert comp.device_engine.step is None
    mixed = GradientCompressor('vgc', list('ab'), [(3,), (4,)], [F32, F64],
                               index_coding='fixed')
    mixed.compress([fake.asarray(numpy.ones(3, F32)),
                    fake.asarray(numpy.ones(4, F64))],
                   [fake.asarray(numpy.ones(3, F32)),
                    fake.asarray(numpy.ones(4, F64))])
    assert mixed.device_engine.step is None


def test_a_message_longer_than_the_last_one_takes_a_second_copy(
        device, monkeypatch):
    """The download covers the last message plus slack; beyond it, the
    rest comes in a second copy and the message is whole."""
    fake = device
    monkeypatch.setattr(device_compress, 'MIN_SLACK', 0)
    monkeypatch.setattr(device_compress, 'SLACK', 1.0)
    shapes, dtypes = [(500,)], [F32]
    dev, cpu = _pair('strom', dict(tau=0.5), shapes, dtypes)
    rng = numpy.random.default_rng(1)
    counts = []
    for scale in (1e-3, 1.0, 1.0, 4.0):  # ever more elements cross tau
        g = (rng.normal(0, 1, 500) * scale).astype(F32)
        fake.reset()
        assert_bitwise(dev.compress([fake.asarray(g)]), cpu.compress([g]))
        counts.append((fake.count('download'), dev.last_sent))
    assert counts[0][0] == 1  # the first step copies the longest possible
    assert any(d == 2 for d, _ in counts[1:]), counts
    assert counts[-1][1] > counts[1][1]


def _param(xp, shape, dtype, grad):
    return param(xp, xp.zeros(shape, dtype), grad)


@pytest.mark.parametrize('model', sorted(MODELS))
@pytest.mark.parametrize('method,kw', METHODS + CODED, ids=IDS + CODED_IDS)
@pytest.mark.parametrize('ranks,rescale', [(1, None), (3, None), (4, None),
                                           (4, 1024.0)])
def test_decode_and_mean_equal_the_cpu_backend(device, method, kw, model,
                                               ranks, rescale):
    """Every rank's messages (CPU-made) decoded on the device: with the
    dense tree ('none') one lookup launch a parameter dtype (float16 +
    float32: two); otherwise the sums zeroed, one scatter launch a rank
    that sent something, in rank order, and one finish a dtype; with
    FMT_GAP groups their blocks decoded and checked from the restart
    points first, and one flag read back.  The means equal the CPU
    decoder's bit for bit, and each grad is a view of one new array a
    dtype."""
    fake = device
    shapes, dtypes = MODELS[model]
    comps = [_pair(method, kw, shapes, dtypes)[1] for _ in range(ranks)]
    blocks = None
    for k in range(3):  # the residuals' third step: a realistic density
        blocks = [c.compress(*_stream(shapes, dtypes, 3, 10 + r)[k])
                  for r, c in enumerate(comps)]
    dense = method == 'none'
    host = [_param(numpy, s, d, numpy.ones(s, d))
            for s, d in zip(shapes, dtypes)]
    exchange_mean.mean_gradients(blocks, comps[0], host, [p.grad for p in host],
                                 ranks, True, dense, rescale=rescale)
    grads = [fake.asarray(numpy.ones(s, d)) for s, d in zip(shapes, dtypes)]
    dev = [_param(fake, s, d, g) for s, d, g in zip(shapes, dtypes, grads)]
    fake.reset()
    elements = exchange_mean.mean_gradients(blocks, comps[0], dev, grads, ranks,
                                            True, dense, rescale=rescale)
    groups = [g for b in blocks for g in walk(b, comps[0].sizes)]
    gap = any(g.fmt == codec.FMT_GAP for g in groups)
    sending = sum(codec.message_count(b) > 0 for b in blocks)
    assert fake.launches == (
        ['zeros', 'vgc_model_gap_expand'] if gap else []) + (
        ['vgc_model_decode_mean'] * len(set(dtypes)) if dense else
        ['zeros'] + ['vgc_model_scatter'] * sending +
        ['vgc_model_finish'] * len(set(dtypes)))  # one a dtype
    assert fake.count('upload') == 1
    assert fake.count('download') == (1 if gap else 0)  # the flags
    assert fake.count('scalar') == 0
    assert elements == [codec.message_count(b) for b in blocks]
    if model == 'big' and kw.get('index_coding') == 'gap':
        # blocks decoded from their restart points
        assert max(codec.gap_restarts(g.count) for g in groups
                   if g.fmt == codec.FMT_GAP) >= 1
    for h, d in zip(host, dev):
        assert d.grad.shape == h.grad.shape and d.grad.dtype == h.grad.dtype
        assert_bitwise(fake.asnumpy(d.grad), h.grad)
    owners = {}
    for d in dev:
        assert d.grad.base is not None
        owners.setdefault(d.grad.dtype, set()).add(id(d.grad.base))
    assert all(len(o) == 1 for o in owners.values()), owners


@pytest.mark.parametrize('model', ['f32', 'f16+f32', 'big'])
@pytest.mark.parametrize('method,kw', [METHODS[0]] + CODED,
                         ids=[IDS[0]] + CODED_IDS)
def test_messages_received_into_the_upload_buffer_stay_where_they_are(
        device, monkeypatch, method, kw, model):
    """4 ranks' messages as the ring leaves them on rank 1 (its own first,
    then ranks 0, 3, 2) in the buffer :func:`exchange_mean.receive_into` hands
    MPI: the decode reads each where it lies (the descriptors point there,
    nothing is copied) and the means equal the CPU decoder's bit for
    bit."""
    from chainer_vgc.engines.cuda import decode as device_decode
    fake = device
    shapes, dtypes = MODELS[model]
    ranks = 4
    comps = [_pair(method, kw, shapes, dtypes)[1] for _ in range(ranks)]
    for k in range(3):
        blocks = [c.compress(*_stream(shapes, dtypes, 3, 20 + r)[k])
                  for r, c in enumerate(comps)]
    host = [_param(numpy, s, d, numpy.ones(s, d))
            for s, d in zip(shapes, dtypes)]
    exchange_mean.mean_gradients(blocks, comps[0], host, [p.grad for p in host],
                                 ranks, True, False)
    grads = [fake.asarray(numpy.ones(s, d)) for s, d in zip(shapes, dtypes)]
    dev = [_param(fake, s, d, g) for s, d, g in zip(shapes, dtypes, grads)]
    into = exchange_mean.receive_into(comps[0], dev, grads, ranks)
    stream = into(sum(b.size for b in blocks))
    views, at = [None] * ranks, 0
    for src in (1, 0, 3, 2):  # ring order on rank 1
        views[src] = stream[at:at + blocks[src].size]
        views[src][...] = blocks[src]
        at += blocks[src].size
    seen = []
    describe = device_decode._descriptors

    def recording(rows, sizes, p, starts):
        seen.append(starts.copy())
        return describe(rows, sizes, p, starts)
    monkeypatch.setattr(device_decode, '_descriptors', recording)
    exchange_mean.mean_gradients(views, comps[0], dev, grads, ranks, True, False)
    base = stream.__array_interface__['data'][0]
    where = [(v.__array_interface__['data'][0] - base) // 4 for v in views]
    assert (seen[-1] - seen[-1][1]).tolist() == where, (seen, where)
    assert numpy.shares_memory(views[0], comps[0].device_engine.staging('upload')._raw)
    for h, d in zip(host, dev):
        assert_bitwise(fake.asnumpy(d.grad), h.grad)


def test_communicator_step_takes_the_whole_model_paths(device, monkeypatch):
    """VGCCommunicator.multi_node_mean_grad on a one-rank world, a float32
    model on the device, three steps: the whole-model compress and decode
    (vgc's default 'auto': 13 launches and one download, then FMT_GAP's
    blocks decoded and checked, the rank's scatter and the mean, one
    upload, from the buffer MPI received the messages into, and the
    checks' flags read back; no scalar read), the means and the residuals
    of the CPU path bit for bit."""
    from mpi4py import MPI
    from chainer_vgc.chainermn import communicator
    from chainer_vgc.chainermn import transport
    fake = device
    shapes, dtypes = MODELS['f32']
    steps = _stream(shapes, dtypes, 3, 4)
    comms = {xp: communicator.VGCCommunicator(MPI.COMM_SELF, method='vgc',
                                              alpha=1.0)
             for xp in (numpy, fake)}
    received = []
    allgatherv = transport.allgatherv

    def recording(*args, **kwargs):
        blocks, counts = allgatherv(*args, **kwargs)
        received.append(blocks)
        return blocks, counts
    monkeypatch.setattr(transport, 'allgatherv', recording)
    models = {}
    for xp in (numpy, fake):
        models[xp] = _FakeModel({'/{}'.format(t): _param(
            xp, s, d, None) for t, (s, d) in enumerate(zip(shapes, dtypes))})
    for k, (gs, ss) in enumerate(steps):
        means = {}
        for xp in (numpy, fake):
            params = [p for _, p in sorted(models[xp].namedparams())]
            for p, g in zip(params, gs):
                p.grad = g.copy() if xp is numpy else fake.asarray(g)
            comms[xp].set_sqsums([s if xp is numpy else fake.asarray(s)
                                  for s in ss])
            fake.reset()
            comms[xp].multi_node_mean_grad(models[xp])
            if xp is fake:
                # the message; and the device decode's flags when it
                # checked FMT_GAP codes
                sizes = comms[xp].state(models[xp]).compressor.sizes
                gap = any(g.fmt == codec.FMT_GAP for b in received[-1]
                          for g in walk(b, sizes))
                assert fake.count('download') == 1 + gap
                # the first step uploads the offsets and which tensors have
                # a gradient; every step its messages, and the gather's
                # tables of addresses (gradients, sums) where they moved
                tables = [n for kind, n, _ in fake.log if kind == 'upload'
                          and n == 8 * len(shapes)]
                assert fake.count('upload') == (3 if k == 0 else 1) + len(
                    tables) and len(tables) <= 2
                assert fake.count('scalar') == 0
                if k:  # (the first step also sets the arenas up)
                    # 9 kernels of ours and two CUB scans of 2 launches;
                    # decode: 2 zeroed arrays, FMT_GAP's blocks, the
                    # scatter of the one rank, the mean
                    assert fake.count('launch') <= 9 + 4 + 5, ' '.join(
                        fake.launches)
            means[xp] = [arrays.to_numpy(p.grad) for p in params]
            # on the device, MPI received into the buffer the decode
            # uploads from (no copy between them); on the host, anywhere
            staging = comms[xp].state(
                models[xp]).compressor.device_engine.held('upload')
            assert (staging is not None and numpy.shares_memory(
                received[-1][0], staging._raw)) == (xp is fake)
        for a, b in zip(means[numpy], means[fake]):
            assert_bitwise(a, b)
    comp = {xp: comms[xp].state(models[xp]).compressor
            for xp in (numpy, fake)}
    assert isinstance(comp[fake].device_engine.step, device_compress.DeviceStep)
    _assert_states(comp[fake], comp[numpy], fake)


def test_a_bad_message_never_reaches_the_decode_kernel(device):
    """The whole-model decode validates every message's structure on the
    host first: a corrupt header raises the reference's WireFormatError,
    nothing is uploaded or launched and no gradient changes."""
    fake = device
    shapes, dtypes = MODELS['f32']
    comp = _pair('vgc', dict(alpha=1.0), shapes, dtypes)[1]
    good = comp.compress(*_stream(shapes, dtypes, 1, 6)[0]).copy()
    bad = good.copy()
    bad[4] = 0xFFFFFFF  # the first group's count: beyond the tensor
    with pytest.raises(codec.WireFormatError) as err:
        codec.unpack(bad, comp.sizes, comp.dtypes)
    grads = [fake.asarray(numpy.ones(s, d)) for s, d in zip(shapes, dtypes)]
    dev = [_param(fake, s, d, g) for s, d, g in zip(shapes, dtypes, grads)]
    fake.reset()
    with pytest.raises(codec.WireFormatError, match=str(err.value)[:40]):
        exchange_mean.mean_gradients([good, bad], comp, dev, grads, 2, True,
                                     False)
    assert fake.count('upload') == 0 and fake.launches == []
    assert all(p.grad is g for p, g in zip(dev, grads))
    assert all((fake.asnumpy(g) == 1).all() for g in grads)
    # and the good messages alone do take the whole-model decode
    exchange_mean.mean_gradients([good, good], comp, dev, grads, 2, True, False)
    assert fake.launches == ['zeros'] + ['vgc_model_scatter'] * 2 + [
        'vgc_model_finish']


@pytest.mark.parametrize('method,kw', [
    ('vgc', dict(alpha=1.0, index_coding='gap')),
    ('vgc', dict(alpha=1.0, index_coding='auto')),
    ('hybrid', dict(alpha=1.0, tau=0.5, index_coding='gap')),
    ('strom', dict(tau=0.5, index_coding='auto'))])
def test_device_gap_codes_with_escapes_and_word_edges(device, method, kw):
    """FMT_GAP bodies built on the device, one thread a word: clusters and
    gaps long enough for the escape code (Elias gamma), codes across word
    boundaries, a tensor sending one element and one sending all; the
    CPU's bits."""
    fake = device
    shapes, dtypes = [(20000,), (1,), (300,), (4097,)], [F32] * 4
    dev, cpu = _pair(method, kw, shapes, dtypes)
    rng = numpy.random.default_rng(3)
    for step in range(3):
        gs = []
        for t, (n,) in enumerate(shapes):
            g = rng.normal(0, 1e-6, n).astype(F32)
            if t == 0:  # a cluster, then far apart: escapes
                g[:700] = rng.normal(0, 1, 700)
                g[[9000, 19999]] = [3.0, -5.0]
            elif t == 2:
                g[:] = rng.normal(0, 1, n)  # everything sent
            elif t == 3:
                g[rng.choice(n, 37, replace=False)] = 2.0 ** -step
            gs.append(g)
        ss = [g * g * F32(0.25) for g in gs]
        got = dev.compress(_on(fake, gs), _on(fake, ss))
        assert_bitwise(got, cpu.compress(gs, ss))
        assert codec.FMT_GAP in {g.fmt for g in walk(got, dev.sizes)}
    _assert_states(dev, cpu, fake)


@pytest.mark.parametrize('method', ['vgc', 'strom'])
def test_gap_groups_of_tiny_tensors_fit_the_buffer(device, method):
    """With index_coding='gap', a tensor of one or two elements gets a
    FMT_GAP group longer than its elements (param word, G, a code word, a
    value word): the device buffer holds the longest message of the
    coding, so a model of tiny tensors is not cut short (it was: the
    buffer held a header and one word an element)."""
    fake = device
    shapes = [(1,), (1,), (2,), (1,)]
    kw = dict(alpha=1.0) if method == 'vgc' else dict(tau=0.01)
    dev, cpu = _pair(method, dict(kw, index_coding='gap'), shapes,
                     [F32] * len(shapes))
    gs = [numpy.full(s, 0.5, F32) for s in shapes]
    ss = [g * g * F32(0.25) for g in gs]
    got = dev.compress(_on(fake, gs), _on(fake, ss))
    assert isinstance(dev.device_engine.step, device_compress.DeviceStep)
    want = cpu.compress(gs, ss)
    assert_bitwise(got, want)
    assert {g.fmt for g in walk(got, dev.sizes)} == {codec.FMT_GAP}


class _OutsideThreshold(CompressionRule):
    """A rule defined outside the package, as a user writes one: a
    threshold with error feedback in plain NumPy (Strom's arithmetic,
    written here), whose GPU step is registered below."""

    name = 'outside-threshold'

    def __init__(self, tau):
        self.tau = tau
        self.index_coding = 'fixed'

    def init_state(self, size, dtype, xp):
        return {'r': xp.zeros(size, dtype=dtype)}

    def compress(self, tensor_id, grad, sqsum, state):
        r = state['r']
        tau = codec.wire_scale(self.tau, r.dtype)
        r += grad.astype(r.dtype, copy=False)
        sent = numpy.abs(r) > tau
        sign = numpy.where(sent, numpy.where(r > 0, 1, -1), 0).astype(
            numpy.int8)
        r -= sign * tau
        return codec.pow2_sign_group(tensor_id, sign, self.tau, r.dtype,
                                     coding='fixed')


def _outside_select(rule, p):
    kernels.get_kernel('vgc_model_strom_step')(
        p.g, p.old['r'], p.offsets, p.nt, p.active,
        codec.wire_scale(rule.tau, p.sdt), p.new['r'], p.sign, p.ok,
        p.flags)


_OUTSIDE = registry.DeviceRule(('r',), _outside_select, False,
                               lambda rule: rule.tau, False)


def test_a_rule_of_ones_own_registers_its_gpu_step(device):
    """docs/contributing.md's GPU fast path: a rule that is none of the
    shipped ones runs the whole-model step from its registration alone
    (one download, no scalar read), its messages and states those of its
    own NumPy compress bit for bit, its scale read every step."""
    fake = device
    registry.register('cuda', _OutsideThreshold, lambda rule: _OUTSIDE)
    shapes, dtypes = MODELS['f32']
    names = [str(i) for i in range(len(shapes))]
    dev, cpu = (GradientCompressor(_OutsideThreshold(0.05), names, shapes,
                                   dtypes, backend='numpy')
                for _ in range(2))
    for k, (gs, ss) in enumerate(_stream(shapes, dtypes, 4, 5, {(1, 0)})):
        if k == 2:
            dev.rule.tau = cpu.rule.tau = 0.2
        fake.reset()
        got = dev.compress(_on(fake, gs))
        assert isinstance(dev.device_engine.step, device_compress.DeviceStep)
        assert dev.device_engine.step.part is _OUTSIDE
        assert fake.count('download') == 1 and fake.count('scalar') == 0
        want = cpu.compress(gs)
        assert dev.last_sent == cpu.last_sent > 0
        assert_bitwise(got, want)
        _assert_states(dev, cpu, fake)
