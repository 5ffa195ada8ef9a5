"""Kernel launches and host synchronisations of one GPU step, counted
through the fake CuPy (``tests/fake_cupy.py``: ``fake.launches``) with the
kernels compiled for the host, for models of 4, 40 and 400 tensors.

The budget of issue 25 is a fixed number of launches and one host
synchronisation per step, whatever the number of tensors: a compress step
one device-to-host copy and no scalar read; a decode step one upload, a
number of launches that grows with the ranks (one scatter a rank, issue
36) but not with the tensors, and nothing read back but the flags of the
FMT_GAP codes' checks.  The fake counts the launches
that CuPy really issues (issue 36): ``cupy.concatenate`` takes one copy per
input when they average over 2 MiB, so the gradients and the sums are
gathered by our own kernel through a table of addresses (uploaded only
when an address moves); ``cupy.cumsum`` takes about 2 log_512(N) + 1
launches for N elements, which grows with the model's size, not with its
number of tensors.  The whole-model compress step (chainer_vgc.engines.cuda.compress:
vgc, hybrid and Strom with every index coding, and 'none') runs at most
:data:`COMPRESS_KERNELS` kernels of its own besides CuPy's scans; the
whole-model decode (chainer_vgc.engines.cuda.decode) the sums zeroed, a scatter
launch per rank and a mean (the dense tree of 'none': one lookup launch),
and with FMT_GAP groups their flags zeroed and their blocks decoded and
checked from their restart points.  QSGD keeps its own counts, and
models of several dtypes are decoded tensor by tensor.

``python tests/test_launch_counts.py`` prints the counts.
"""

import types

import numpy
import pytest

from chainer_vgc import GradientCompressor
from chainer_vgc.exchange import mean as exchange_mean

TENSORS = (4, 40, 400)
METHODS = [('vgc', dict(alpha=1.0, index_coding='fixed')),
           ('vgc', dict(alpha=1.0, index_coding='gap')),
           ('vgc', dict(alpha=1.0)),
           ('hybrid', dict(alpha=1.0, tau=0.05, index_coding='fixed')),
           ('hybrid', dict(alpha=1.0, tau=0.05)),
           ('strom', dict(tau=0.05, index_coding='fixed')),
           ('strom', dict(tau=0.05)),
           ('none', {})]
IDS = ['{}:{}'.format(m, kw.get('index_coding', 'auto')) for m, kw in
       METHODS]
RANKS = 4
#: the budgets: a compress step's kernels besides CuPy's scans (cumsum),
#: and a decode step's launches besides one a rank
COMPRESS_KERNELS, DECODE_LAUNCHES = 10, 4
#: tensors of this many float32 elements (2.4 kB) with the fake's
#: concatenate threshold scaled from 2 MiB to 2 KiB: each tensor is over
#: the threshold, as 2.9 MB tensors are on a GPU (see test_real_sizes)
SCALED_SIZE, SCALED_THRESHOLD = 600, 2048


def _model(n_tensors, seed=0, size=None):
    rng = numpy.random.default_rng(seed)
    sizes = [int(s) for s in rng.integers(1, 300, n_tensors)] \
        if size is None else [size] * n_tensors
    steps = []
    for _ in range(3):
        gs = [rng.normal(0, 1, n).astype(numpy.float32) for n in sizes]
        ss = [g * g * rng.uniform(0.5, 2, g.size).astype(numpy.float32)
              for g in gs]
        steps.append((gs, ss))
    return sizes, steps


def step_counts(fake, method, kw, n_tensors, size=None):
    """{phase: {'launch', 'download', 'upload', 'scalar', 'scan': count}}
    of the third compress step of one rank and of the decode + mean of 4
    ranks' messages into device gradients ('scan': the launches of
    ``cupy.cumsum``, included in 'launch')."""
    sizes, steps = _model(n_tensors, size=size)
    comp = GradientCompressor(method, [str(i) for i in range(n_tensors)],
                              [(n,) for n in sizes],
                              [numpy.float32] * n_tensors, **kw)
    out = {}
    # the gradients and sums where they were last step, as CuPy's memory
    # pool usually puts them (else the gather's tables go up again)
    dgs, dss = ([fake.asarray(a) for a in arrays] for arrays in steps[0])
    for k, (gs, ss) in enumerate(steps):
        for dev, host in zip(dgs + dss, gs + ss):
            dev[...] = fake.asarray(host)
        gs, ss = dgs, dss
        fake.reset()
        message = comp.compress(gs, ss)
        if k == len(steps) - 1:
            out['compress'] = _counts(fake)
    grads = [fake.zeros(n, numpy.float32) for n in sizes]
    params = [types.SimpleNamespace(
        array=g, grad=g, dtype=g.dtype, shape=g.shape, size=g.size, xp=fake)
        for g in grads]
    fake.reset()
    exchange_mean.mean_gradients([message] * RANKS, comp, params, grads, RANKS,
                                 True, False)
    out['decode'] = _counts(fake)
    return out


def _counts(fake):
    out = {kind: fake.count(kind)
           for kind in ('launch', 'download', 'upload', 'scalar')}
    out['scan'] = sum(n.startswith(('cumsum', 'cub.'))
                      for n in fake.launches)
    return out


@pytest.mark.parametrize('method,kw', METHODS, ids=IDS)
def test_transfers_per_step_do_not_grow_with_the_model(device, method, kw):
    """One download per compress step and one upload per decode step,
    nothing read back by the decode but the flags of the FMT_GAP codes'
    checks, at 4, 40 and 400 tensors; the
    launches are counted (a step runs at least one kernel)."""
    for n in TENSORS:
        c = step_counts(device, method, kw, n)
        assert c['compress']['download'] == 1, (n, c)
        # (the gather's address tables go up only when the arrays move)
        assert c['compress']['upload'] == 0, (n, c)
        assert c['decode']['upload'] == 1, (n, c)
        # (the flags of the FMT_GAP codes' checks)
        assert c['decode']['download'] == (
            kw.get('index_coding') != 'fixed' and method != 'none'), (n, c)
        assert c['decode']['scalar'] == 0, (n, c)
        assert c['compress']['launch'] > 0 and c['decode']['launch'] > 0


@pytest.mark.parametrize('method,kw', METHODS, ids=IDS)
def test_compress_launches_are_fixed_whatever_the_model(device, method, kw):
    """4, 40 and 400 tensors, each over CuPy's concatenate threshold
    (scaled): the same launches, and at most COMPRESS_KERNELS besides the
    scans."""
    device.concat_threshold = SCALED_THRESHOLD
    counts = [step_counts(device, method, kw, n, SCALED_SIZE)['compress']
              for n in TENSORS]
    for c in counts:
        assert c['launch'] - c['scan'] <= COMPRESS_KERNELS, counts
        assert c['scalar'] == 0 and c['download'] == 1
    launches = [c['launch'] for c in counts]
    assert launches == [launches[0]] * len(TENSORS), counts


@pytest.mark.parametrize('method,kw', [METHODS[0], METHODS[2]],
                         ids=[IDS[0], IDS[2]])
def test_real_sizes_35_tensors_of_2_9_megabytes(device, method, kw):
    """The model of the GPU timings (25M float32 parameters in 35
    tensors of 2.9 MB) at CuPy's real thresholds: the gradients and the
    sums in separate arrays are gathered in one launch each (CuPy's
    concatenate took one copy per tensor, 70 launches a step); when they
    stay where they were, nothing is uploaded."""
    fake = device
    n, size = 35, 725000
    rng = numpy.random.default_rng(1)
    comp = GradientCompressor(method, [str(i) for i in range(n)],
                              [(size,)] * n, [numpy.float32] * n, **kw)
    gs = [fake.asarray(rng.normal(0, 1, size).astype(numpy.float32))
          for _ in range(n)]
    ss = [g * g for g in gs]
    for step in range(2):  # (the first also sets the arenas up)
        fake.reset()
        comp.compress(gs, ss)
        c = _counts(fake)
        tables = [k for k, b, _ in fake.log if k == 'upload' and b == 8 * n]
        assert 'concatenate.copy' not in fake.launches, fake.launches
        assert fake.launches.count('vgc_model_gather') == 2
        # (a second copy when the message outgrew the last one's by 25 %)
        assert c['download'] <= 2 and c['scalar'] == 0
        assert len(tables) == (2 if step == 0 else 0), fake.log
    assert c['launch'] - c['scan'] <= COMPRESS_KERNELS, fake.launches
    assert c['upload'] == 0, fake.log


@pytest.mark.parametrize('method,kw', METHODS, ids=IDS)
def test_decode_launches_are_fixed_whatever_the_model(device, method, kw):
    counts = [step_counts(device, method, kw, n)['decode'] for n in TENSORS]
    for c in counts:
        assert c['launch'] <= DECODE_LAUNCHES + RANKS and c['scalar'] == 0
    assert all(c == counts[0] for c in counts), counts


@pytest.mark.parametrize('method,kw', [METHODS[0], METHODS[1], METHODS[4]],
                         ids=[IDS[0], IDS[1], IDS[4]])
def test_sums_in_one_arena_are_read_in_place(device, method, kw):
    """Sums of squares that lie end to end in one array, as
    :class:`~chainer_vgc.statistics.PerSampleSquares` writes them, are read
    where they are: one launch fewer than sums in separate arrays, and the
    same messages and states bit for bit.  Views of one array in another
    order, or with a gap, are gathered as before."""
    fake = device
    sizes, steps = _model(40)
    forwards = list(range(len(sizes)))
    layouts = {'arena': (forwards, 0), 'backwards': (forwards[::-1], 0),
               'gapped': (forwards, 1)}

    def sums(ss, layout):
        """The sums on the device: each its own array, or views of one
        array in ``order``, ``gap`` elements apart."""
        if layout == 'separate':
            return [fake.asarray(s) for s in ss]
        order, gap = layouts[layout]
        flat = numpy.zeros(sum(sizes) + gap * len(sizes), numpy.float32)
        where, at = {}, 0
        for i in order:
            flat[at:at + sizes[i]] = ss[i]
            where[i], at = at, at + sizes[i] + gap
        flat = fake.asarray(flat)
        return [flat[where[i]:where[i] + sizes[i]] for i in forwards]
    runs = {}
    for layout in ['separate'] + sorted(layouts):
        comp = GradientCompressor(method, [str(i) for i in forwards],
                                  [(n,) for n in sizes],
                                  [numpy.float32] * len(sizes), **kw)
        for gs, ss in steps:
            gs, sq = [fake.asarray(g) for g in gs], sums(ss, layout)
            fake.reset()
            message = comp.compress(gs, sq)
        runs[layout] = (fake.count('launch'), message.copy(),
                        [fake.asnumpy(st[k]) for st in comp.states
                         for k in sorted(st)])
    launches, message, states = runs['separate']
    for layout, (n, m, st) in runs.items():
        assert numpy.array_equal(m, message), layout
        assert all(numpy.array_equal(a, b) for a, b in zip(st, states))
        assert n == launches - (layout == 'arena'), (layout, n, launches)


@pytest.mark.parametrize('method,kw', [METHODS[2], METHODS[4]],
                         ids=[IDS[2], IDS[4]])
def test_the_host_reads_the_summary_not_the_message(device, monkeypatch,
                                                    method, kw):
    """After the download the host reads the layout's summary (elements
    sent, groups that might merge), not the message: no walk of its
    groups at 4, 40 or 400 tensors of groups too large to merge (the
    count and the bytes as the message says); with small groups that
    merge_spans might join, it walks the message once to merge them."""
    from chainer_vgc import codec
    from chainer_vgc.codec import message as message_module
    walks = []
    real = message_module.walk

    def counted(*args, **kwargs):
        walks.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(message_module, 'walk', counted)
    seen = {}
    for n, size in [(4, 30000), (40, 30000), (400, 3000), (40, 50)]:
        sizes, steps = _model(n, size=size)
        comp = GradientCompressor(method, [str(i) for i in range(n)],
                                  [(k,) for k in sizes],
                                  [numpy.float32] * n, **kw)
        for gs, ss in steps:
            del walks[:]
            message = comp.compress([device.asarray(g) for g in gs],
                                    [device.asarray(q) for q in ss])
            monkeypatch.setattr(message_module, 'walk', real)
            # the oracle: two groups in a row of at most MERGE_MAX_COUNT
            # elements with one value table, in the message as sent
            heads = [(g.count, g.a, g.b) for g in real(message, None)]
            small = [c <= codec.MERGE_MAX_COUNT for c, _, _ in heads]
            pairs = any(small[j] and small[j + 1] and heads[j][1:] ==
                        heads[j + 1][1:] for j in range(len(heads) - 1))
            if not walks:  # (the message as downloaded)
                assert not pairs, (n, size)
            if size > codec.MERGE_MAX_COUNT * 8:  # large groups: no walk
                assert not walks, (n, size, heads)
            seen[bool(walks)] = True
            assert comp.last_sent == codec.message_count(message)
            assert comp.last_bytes == message.nbytes
            monkeypatch.setattr(message_module, 'walk', counted)
    assert seen == {False: True, True: True}  # both cases were met


@pytest.mark.parametrize('method,kw', METHODS, ids=IDS)
def test_the_decode_walks_no_group_in_python(device, monkeypatch, method,
                                             kw):
    """The decode + mean of 4 ranks' messages at 4, 40 and 400 tensors:
    the native validation's walk hands its group table over, and the
    descriptors and FMT_GAP block records are built from it with NumPy
    over the whole table, so no Python code runs per group (``walk``, the
    reference's group table, the gap expansion are never called) and the
    messages go up as received, a copy per message."""
    from chainer_vgc import codec
    from chainer_vgc.engines.cuda import decode as device_decode
    from chainer_vgc.codec import message as message_module
    calls = []

    def forbidden(name, real):
        def call(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return call
    for n in TENSORS:
        sizes, steps = _model(n)
        comp = GradientCompressor(method, [str(i) for i in range(n)],
                                  [(k,) for k in sizes],
                                  [numpy.float32] * n, **kw)
        for gs, ss in steps:
            message = comp.compress([device.asarray(g) for g in gs],
                                    [device.asarray(q) for q in ss]).copy()
        grads = [device.zeros(k, numpy.float32) for k in sizes]
        params = [types.SimpleNamespace(
            array=g, grad=g, dtype=g.dtype, shape=g.shape, size=g.size,
            xp=device) for g in grads]
        with monkeypatch.context() as m:
            for mod, name in [(message_module, 'walk'),
                              (device_decode, 'walk'),
                              (device_decode, 'group_rows'),
                              (codec, 'expand_gap'), (codec, 'unpack')]:
                m.setattr(mod, name, forbidden(name, getattr(mod, name)))
            exchange_mean.mean_gradients([message] * RANKS, comp, params, grads,
                                         RANKS, True, False)
        assert calls == [], (n, calls)
        # (the means: test_device_step's decode tests, bit for bit)


@pytest.mark.parametrize('method,kw', [METHODS[0], METHODS[2], METHODS[4]],
                         ids=[IDS[0], IDS[2], IDS[4]])
def test_the_scans_take_cub_or_fall_back_to_cumsum(device, method, kw):
    """The step's scans (which elements are sent, the code lengths) run
    in place: with CuPy's CUB two launches each and no cast pass; without
    it (``cupy.cuda.cub`` missing) ``cupy.cumsum`` into the same array.
    The messages and states are the same bit for bit."""
    from chainer_vgc.backends.cuda import kernels
    fake = device
    x = numpy.random.default_rng(2).integers(0, 3, 5000).astype(numpy.int64)
    for cub in (fake.cuda.cub, None):
        fake.cuda.cub = cub
        a = fake.asarray(x)
        fake.reset()
        assert kernels.scan(fake, a) is a
        assert numpy.array_equal(fake.asnumpy(a), numpy.cumsum(x))
        assert fake.launches == (['cub.init', 'cub.scan'] if cub else [
            'cumsum.copy', 'cumsum.block_sums', 'cumsum.scan',
            'cumsum.scan'])
    sizes, steps = _model(40, size=SCALED_SIZE)
    runs = []
    for cub in (fake.cuda.cub, None):
        fake.cuda.cub = cub
        comp = GradientCompressor(method, [str(i) for i in range(40)],
                                  [(k,) for k in sizes],
                                  [numpy.float32] * 40, **kw)
        for gs, ss in steps:
            fake.reset()
            message = comp.compress([fake.asarray(g) for g in gs],
                                    [fake.asarray(q) for q in ss]).copy()
        scans = [n for n in fake.launches
                 if n.startswith(('cub.', 'cumsum'))]
        assert all(n.startswith('cub.' if cub else 'cumsum')
                   for n in scans) and scans, fake.launches
        runs.append((message, [fake.asnumpy(st[k]) for st in comp.states
                               for k in sorted(st)]))
    assert numpy.array_equal(runs[0][0], runs[1][0])
    assert all(numpy.array_equal(a, b) for a, b in zip(runs[0][1],
                                                       runs[1][1]))


def test_the_fake_counts_launches_not_views(device):
    """The counter itself: kernels count, views and allocation do not."""
    fake = device
    x = fake.asarray(numpy.arange(12, dtype=numpy.float32))
    fake.reset()
    y = x.reshape(3, 4)[1:]          # views: no kernel
    fake.empty(5, numpy.float32)     # allocation: no kernel
    assert fake.count('launch') == 0
    z = y + 1                        # a ufunc
    z[z > 5] = 0                     # a comparison, then a scatter
    w = x[fake.asarray([0, 3])]      # a gather (and an upload)
    fake.zeros(3, numpy.float32)     # a fill
    assert fake.launches == ['add', 'greater', 'setitem', 'getitem',
                             'zeros']
    assert fake.count('upload') == 1 and w.size == 2
    fake.reset()
    assert fake.count('launch') == 0


def test_the_fake_counts_concatenate_and_cumsum_as_cupy_issues_them(
        device):
    """The counter's rules, read from CuPy's source
    (``_routines_manipulation.pyx``: ``_concatenate``; ``_routines_math.pyx``:
    ``scan``, ``scan_core``): one kernel and a pointer table for more than
    8 inputs of the output's dtype averaging under the threshold, else a
    copy per input; a scan of N elements takes a block-sum kernel and a
    scan kernel per level of 512, plus one."""
    fake = device
    small = [fake.zeros(10, numpy.float32) for _ in range(9)]
    cases = [
        (small, ['concatenate'], 1),                        # 9 small
        (small[:8], ['concatenate.copy'] * 8, 0),           # only 8
        (small[:8] + [fake.zeros(3, numpy.float32)],        # shapes differ:
         ['concatenate'], 3),                               # 3 tables
        (small[:8] + [fake.zeros(10, numpy.float64)],       # dtypes differ
         ['concatenate.copy'] * 9, 0)]
    for arrays, launches, uploads in cases:
        fake.reset()
        fake.concatenate(arrays)
        assert (fake.launches, fake.count('upload')) == (launches, uploads)
    fake.concat_threshold = 40  # 10 float32 = 40 bytes: not under it
    fake.reset()
    fake.concatenate(small)
    assert fake.launches == ['concatenate.copy'] * 9
    for n, levels in [(1, 0), (512, 0), (513, 1), (512 * 512 + 1, 2)]:
        x = fake.zeros(n, numpy.int32)
        fake.reset()
        fake.cumsum(x, dtype=numpy.int64)
        assert fake.launches == ['cumsum.block_sums', 'cumsum.scan'] * \
            levels + ['cumsum.scan'], n
    fake.accelerators = ('cub',)
    x = fake.zeros(600, numpy.int32)
    fake.reset()
    x.cumsum(dtype=numpy.int64)
    assert fake.launches == ['cumsum.astype', 'cumsum.cub_init',
                             'cumsum.cub_scan']


def main():
    """Print the counts (the ``device`` fixture's set-up, by hand): models
    of 4, 40 and 400 tensors of SCALED_SIZE elements, CuPy's concatenate
    threshold scaled as in the tests."""
    import _pytest.monkeypatch
    import conftest
    import kernel_harness
    mp = _pytest.monkeypatch.MonkeyPatch()
    fake = conftest.device.__wrapped__(kernel_harness.HostKernels(), mp)
    fake.concat_threshold = SCALED_THRESHOLD
    print('| method | tensors | compress launches (ours + CUB scans) | '
          'uploads | downloads | scalar reads | decode launches | uploads '
          '| downloads |')
    print('|---|---:|---:|---:|---:|---:|---:|---:|---:|')
    for (method, kw), name in zip(METHODS, IDS):
        for n in TENSORS:
            c = step_counts(fake, method, kw, n, SCALED_SIZE)
            comp, dec = c['compress'], c['decode']
            print('| {} | {} | {} + {} | {} | {} | {} | {} | {} | {} |'.format(
                name, n, comp['launch'] - comp['scan'], comp['scan'],
                comp['upload'], comp['download'], comp['scalar'],
                dec['launch'], dec['upload'], dec['download']))
    mp.undo()


if __name__ == '__main__':
    main()
