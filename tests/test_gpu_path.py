"""The GPU code path, run on the CPU through tests/fake_cupy.py (arrays that
are not NumPy arrays, every host<->device copy recorded) with the CuPy
kernels compiled for the host (the ``device`` fixture in conftest.py).

The transfer budget of one step on one rank (issue 11): the message is
assembled in host memory with one download; every rank's message is
uploaded once; headers, checks and reports read the host copies, so the
decode reads no device value back.  Sums equal the CPU path bit for bit.
"""

import types

import numpy
import pytest

from chainer_vgc import GradientCompressor
from chainer_vgc.backends import arrays
from chainer_vgc import codec
from chainer_vgc.codec.message import walk
from chainer_vgc.chainermn import communicator
from chainer_vgc.exchange import mean as exchange_mean

from reference import assert_bitwise

F16, F32, F64 = numpy.float16, numpy.float32, numpy.float64
SHAPES = [(17, 3), (5,), (0,), (64,), (9, 2)]
DTYPES = [F16, F32, F32, F64, F32]
RANKS = 4
METHODS = [('vgc', dict(alpha=1.0)), ('vgc', dict(alpha=1.5, quantize=False)),
           ('hybrid', dict(alpha=1.0, tau=0.05)), ('strom', dict(tau=0.05)),
           ('qsgd', dict(bits=2, bucket=8, seed=3)), ('none', {})]


def param(xp, array, grad):
    """What mean_gradients reads of a chainer.Parameter."""
    return types.SimpleNamespace(array=array, grad=grad, dtype=array.dtype,
                                 shape=array.shape, size=array.size, xp=xp)


def stream(seed, steps):
    rng = numpy.random.default_rng(seed)
    out = []
    for _ in range(steps):
        gs = [rng.normal(0, 1, s).astype(d) for s, d in zip(SHAPES, DTYPES)]
        ss = [(g.astype(F64) ** 2 * rng.random(g.shape) * 2).astype(g.dtype)
              for g in gs]
        out.append((gs, ss))
    return out


def compressors(method, kw):
    return [GradientCompressor(method, list('abcde'), SHAPES, DTYPES,
                               **dict(kw, **({'seed': kw['seed'] + r}
                                             if 'seed' in kw else {})))
            for r in range(RANKS)]


#: scalar reads a compress step may make per tensor (input and overflow
#: checks, e_k, sizes of the selections): bounded by the model, never by
#: the number of ranks or of elements
SCALAR_READS_PER_TENSOR = 6


def upload_words(blocks, comp):
    """The words the decode uploads.  The whole-model decode
    (chainer_vgc.engines.cuda.decode, every method but QSGD): each dtype's tensor
    offsets and ids, the model's offsets and the sums' (a float64 tensor
    takes two words an element), room for each rank's items (at most a
    group a tensor: 2 n + 1), all int64; a descriptor of 8 words per
    (rank, tensor), the messages as received, and with FMT_GAP groups
    (after a word of padding to 8 bytes where needed) their first blocks
    (cumulative) and a row of 5 int64 each.  QSGD, tensor by tensor: the
    messages, their gap-coded groups expanded on the host
    (codec.expand_gap)."""
    groups = [g for b in blocks for g in walk(b, comp.sizes)]
    if any(g.fmt == codec.FMT_QSGD for g in groups):
        return sum(codec.expand_gap(b, comp.sizes).size for b in blocks)
    n, per_dtype = len(comp.sizes), {}
    for d in DTYPES:
        per_dtype[numpy.dtype(d)] = per_dtype.get(numpy.dtype(d), 0) + 1
    tables = sum(2 * (2 * m + 1) for m in per_dtype.values()) + 2 * (
        2 * (n + 1) + len(blocks) * (2 * n + 1))
    words = tables + 8 * len(blocks) * n + sum(b.size for b in blocks)
    gap = sum(g.fmt == codec.FMT_GAP for g in groups)
    return words + (words % 2 + 2 * (gap + 1 + 5 * gap) if gap else 0)


@pytest.mark.parametrize('method,kw', METHODS)
def test_one_step_costs_one_download_and_one_upload(device, method, kw,
                                                    monkeypatch):
    fake = device
    # the message as assembled from the device, before groups are merged
    # into spans on the host (codec.merge_spans)
    assembled = []
    merge = codec.merge_spans

    def recording(message, *args, **kwargs):
        assembled.append(message)
        return merge(message, *args, **kwargs)
    monkeypatch.setattr(codec, 'merge_spans', recording)
    streams = [stream(10 + r, 3) for r in range(RANKS)]
    comps = compressors(method, kw)
    formats = set()
    for step in range(3):
        blocks = []
        for r, comp in enumerate(comps):
            gs = [fake.asarray(g) for g in streams[r][step][0]]
            ss = [fake.asarray(s) for s in streams[r][step][1]]
            fake.reset()
            blocks.append(comp.compress(gs, ss))
            # compress: the message leaves the device once, as a whole
            assert isinstance(blocks[-1], numpy.ndarray)
            whole = assembled.pop() if assembled else blocks[-1]
            assert not assembled
            assert fake.count('download') == 1
            assert fake.bytes('download') == 4 * whole.size - 4 * (
                2 + codec.HEADER_WORDS * int(whole[1]))
            assert blocks[-1].size <= whole.size
            assert fake.count('upload') == 0
            assert fake.count('scalar') <= SCALAR_READS_PER_TENSOR * len(
                SHAPES)
            formats.update(g.fmt for g in walk(blocks[-1], None))
        # rank 0 decodes every rank's message into its device gradients
        grads = [fake.asarray(numpy.ones(s, d)) for s, d in zip(SHAPES,
                                                                DTYPES)]
        params = [param(fake, fake.zeros(s, d), g)
                  for s, d, g in zip(SHAPES, DTYPES, grads)]
        fake.reset()
        elements = exchange_mean.mean_gradients(
            blocks, comps[0], params, grads, RANKS, True, False)
        assert fake.count('upload') == 1
        assert fake.bytes('upload') == 4 * upload_words(blocks, comps[0])
        # (the flags of the device's checks of FMT_GAP codes)
        gap = any(g.fmt == codec.FMT_GAP for b in blocks
                  for g in walk(b, comps[0].sizes))
        assert fake.count('download') == (gap and method != 'qsgd')
        assert fake.count('scalar') == 0
        assert elements == [codec.message_count(b) for b in blocks]
        # the CPU decoder's means of the same messages, bit for bit
        host = [param(numpy, numpy.zeros(s, d), numpy.ones(s, d))
                for s, d in zip(SHAPES, DTYPES)]
        exchange_mean.mean_gradients(blocks, comps[0], host,
                                     [h.grad for h in host], RANKS, True,
                                     False)
        for h, p in zip(host, params):
            assert isinstance(p.grad, fake.ndarray)
            assert_bitwise(h.grad.ravel(), fake.asnumpy(p.grad).ravel())
        # and in the rank-order tree ('dense', the simulation's 'none')
        for ps in (host, params):
            exchange_mean.mean_gradients(blocks, comps[0], ps,
                                         [p.grad for p in ps], RANKS, True,
                                         True)
        for h, p in zip(host, params):
            assert_bitwise(h.grad.ravel(), fake.asnumpy(p.grad).ravel())
    if comps[0].rule.index_coding:  # gap-coded groups went through
        assert codec.FMT_GAP in formats, formats


def test_a_bad_message_is_refused_on_the_host_before_any_transfer(device):
    """The GPU decoder validates on the host copy first: a corrupt message
    raises the reference's WireFormatError, nothing is uploaded and no
    gradient changes."""
    fake = device
    comp = compressors('vgc', dict(alpha=1.0))[0]
    gs = [fake.asarray(g) for g in stream(1, 1)[0][0]]
    ss = [fake.asarray(s) for s in stream(1, 1)[0][1]]
    good = comp.compress(gs, ss)
    bad = good.copy()
    bad[4] = 0xFFFFFFF  # the first group's count: beyond the tensor
    params = [param(fake, fake.zeros(s, d), fake.ones(s, d))
              for s, d in zip(SHAPES, DTYPES)]
    with pytest.raises(codec.WireFormatError) as err:
        codec.unpack(bad, comp.sizes, comp.dtypes)
    fake.reset()
    with pytest.raises(codec.WireFormatError, match=str(err.value)[:40]):
        exchange_mean.mean_gradients([good, bad], comp, params,
                                     [p.grad for p in params], 2, True,
                                     False)
    assert fake.count('upload') == 0
    assert all((fake.asnumpy(p.grad) == 1).all() for p in params)


@pytest.mark.parametrize('method,kw', METHODS)
def test_state_and_sums_live_on_the_parameters_device(device, method, kw):
    """A model on device 1 while device 0 is current: residuals, work arrays
    and decoded gradients stay on device 1 (the fake is strict: an operand
    on another device than the current one is an error, as in CuPy without
    peer access)."""
    fake = device
    fake.strict_devices = True
    with fake.cuda.Device(1):
        gs = [fake.asarray(g) for g in stream(0, 1)[0][0]]
        ss = [fake.asarray(s) for s in stream(0, 1)[0][1]]
        params = [param(fake, fake.zeros(s, d), fake.zeros(s, d))
                  for s, d in zip(SHAPES, DTYPES)]
    assert fake.cuda.Device().id == 0
    comp = compressors(method, kw)[0]
    message = comp.compress(gs, ss)
    for st in comp.states:
        assert all(a.device.id == 1 for a in (st or {}).values())
    for dense in (False, True):
        exchange_mean.mean_gradients([message, message], comp, params,
                                     [p.grad for p in params], 2, True, dense)
        assert all(p.grad.device.id == 1 for p in params)
    assert fake.cuda.Device().id == 0


def test_qsgd_gpu_stream_resumes_from_saved_state(device):
    """The GPU generator's state, (entropy, step), is saved with the rule's
    extra state: a restored rule draws what the original drew next."""
    fake = device
    steps = [([fake.asarray(g) for g in gs], None) for gs, _ in
             stream(5, 5)]

    def fresh():
        return GradientCompressor('qsgd', list('abcde'), SHAPES, DTYPES,
                                  bits=2, bucket=8, seed=None)
    first = fresh()
    for gs, _ in steps[:2]:
        first.compress(gs)
    saved = first.rule.get_extra_state()
    assert set(saved) == {'numpy_rng', 'cupy_stream'}
    want = [first.compress(gs) for gs, _ in steps[2:]]
    again = fresh()  # another seed (None: fresh entropy)
    assert not all(numpy.array_equal(a, b) for a, b in zip(
        want, [again.compress(gs) for gs, _ in steps[2:]]))
    resumed = fresh()
    resumed.rule.set_extra_state(saved)
    got = [resumed.compress(gs) for gs, _ in steps[2:]]
    for a, b in zip(want, got):
        assert_bitwise(a, b)


class _FakeModel(object):
    def __init__(self, params):
        self._params = params

    def namedparams(self):
        return list(self._params.items())


def _named_params(xp, seed):
    """{name: parameter} of SHAPES and DTYPES on ``xp`` (numpy or the
    fake), zero arrays and normal gradients."""
    rng = numpy.random.default_rng(seed)
    out = {}
    for name, s, d in zip('abcde', SHAPES, DTYPES):
        g = rng.normal(0, 1, s).astype(d)
        out['/' + name] = types.SimpleNamespace(
            array=xp.zeros(s, d), grad=g if xp is numpy else xp.asarray(g),
            data=None, dtype=numpy.dtype(d), shape=s,
            size=int(numpy.prod(s)), xp=xp)
    return out


def test_communicator_step_on_device_arrays(device):
    """VGCCommunicator.multi_node_mean_grad on a one-rank world with device
    gradients: one download, one upload, no value read back by the decode
    (only the flag of its checks of FMT_GAP codes), and the mean equals the
    CPU path's."""
    from mpi4py import MPI
    fake = device
    host = _named_params(numpy, 7)
    dev = {k: types.SimpleNamespace(
        array=fake.asarray(p.array), grad=fake.asarray(p.grad), data=None,
        dtype=p.dtype, shape=p.shape, size=p.size, xp=fake)
        for k, p in host.items()}
    sq = [(p.grad.astype(F64) ** 2).astype(p.dtype)
          for _, p in sorted(host.items())]
    results = []
    for params, xp in ((host, numpy), (dev, fake)):
        comm = communicator.VGCCommunicator(MPI.COMM_SELF, method='vgc',
                                            alpha=1.0)
        comm.set_sqsums([xp.asarray(s) if xp is fake else s for s in sq])
        fake.reset()
        model = _FakeModel(params)
        comm.multi_node_mean_grad(model)
        if xp is fake:
            # the message, then (FMT_GAP codes checked on the device) the
            # checks' flag of the one rank
            downs = [n for kind, n, _ in fake.log if kind == 'download']
            assert len(downs) in (1, 2) and downs[1:] in ([], [4]), downs
            assert fake.count('upload') == 1
            assert fake.count('scalar') <= SCALAR_READS_PER_TENSOR * len(
                SHAPES)
        results.append([arrays.to_numpy(p.grad) for _, p in
                        sorted(params.items())])
        assert comm.state(model).last['vgc/compression'] > 1
    for a, b in zip(*results):
        assert_bitwise(a.ravel(), b.ravel())


def test_one_rank_dense_mean_keeps_device_gradients_in_place(device,
                                                             monkeypatch):
    """'none' on one rank (the runbook's vgg_step baseline): the mean of
    one rank is the gradient itself, so nothing crosses to the host and
    back (that round trip cost 29 ms of a 66 ms App. D VGG step on an
    H200, issue 36); in Chainer's debug mode the staged path still runs
    and checks the values."""
    import chainer
    from mpi4py import MPI
    fake = device
    params = _named_params(fake, 3)
    before = {k: fake.asnumpy(p.grad) for k, p in params.items()}
    comm = communicator.VGCCommunicator(MPI.COMM_SELF, method='none')
    for debug in (False, True):
        monkeypatch.setattr(chainer, 'is_debug', lambda: debug)
        fake.reset()
        model = _FakeModel(params)
        comm.multi_node_mean_grad(model)
        moved = fake.count('download') + fake.count('upload')
        assert moved == (2 * len(SHAPES) if debug else 0), fake.log
        for k, p in params.items():
            assert_bitwise(fake.asnumpy(p.grad), before[k])


def test_statistics_square_sum_on_device_is_the_reduction_kernel(device):
    """The statistics' per-sample square sum on device arrays runs the
    vgc_sum_squares ReductionKernel: no transfer, NumPy's einsum values."""
    from chainer_vgc.statistics import contraction
    fake = device
    g = numpy.random.default_rng(2).normal(0, 1, (16, 4, 3)).astype(F32)
    dg = fake.asarray(g)
    fake.reset()
    got = contraction.sum_squares(fake, dg)
    assert isinstance(got, fake.ndarray) and fake.log == []
    assert_bitwise(fake.asnumpy(got).ravel(),
                   numpy.einsum('i...,i...->...', g, g).ravel())


def test_device_decoders_keep_subnormals_where_cupy_flushes(device):
    """CuPy's own arithmetic flushes float32 subnormals (its kernels are
    compiled with -ftz=true; the fake does the same with ``ftz``): the
    production decoder (mean_gradients) and the public codec.decode_into
    on a device message must still give the CPU's sums bit for bit.  On an
    H100, decode_into's former ``flat[index] += value`` lost them."""
    fake = device
    fake.ftz = True
    tiny = numpy.finfo(F32).tiny
    sub = numpy.array([tiny / 2, -tiny / 8, tiny * 0.75, 3 * tiny],
                      dtype=F32)
    sizes, dtypes = [8, 6], [F32, F32]
    blocks = [codec.pack([
        codec.raw_group(0, numpy.array([0, 2, 5, 7]), sub * (r + 1), 8),
        # e_k = -126, d = 1: values 2**-127, subnormal in float32
        codec.pow2_best_group(1, numpy.array([1 << 28 | 1, 9 << 28 | 3],
                                             numpy.uint32) + r,
                              numpy.array([1, 3]) + r, -126, 1.0, 6,
                              coding='gap' if r else 'fixed')])
              for r in range(2)]
    comp = GradientCompressor('vgc', ['a', 'b'], [(8,), (6,)], dtypes)
    host = [numpy.zeros(n, dt) for n, dt in zip(sizes, dtypes)]
    codec.decode_into(blocks[0], host)
    codec.decode_into(blocks[1], host)
    assert all(((h != 0) & (numpy.abs(h) < tiny)).any() for h in host)
    outs = [fake.zeros(n, dt) for n, dt in zip(sizes, dtypes)]
    for b in blocks:
        codec.decode_into(fake.asarray(b), outs)
    for h, o in zip(host, outs):
        assert_bitwise(h, fake.asnumpy(o))
    # the production path: validate, expand, one upload, add, mean
    want = [param(numpy, numpy.zeros(n, dt), numpy.zeros(n, dt))
            for n, dt in zip(sizes, dtypes)]
    got = [param(fake, fake.zeros(n, dt), fake.zeros(n, dt))
           for n, dt in zip(sizes, dtypes)]
    for ps in (want, got):
        exchange_mean.mean_gradients(blocks, comp, ps, [p.grad for p in ps],
                                     2, True, False)
    for w, g in zip(want, got):
        assert_bitwise(w.grad, fake.asnumpy(g.grad))
    # the fake does flush CuPy's own arithmetic: this test can fail
    x = fake.asarray(sub)
    x += fake.asarray(numpy.zeros(4, F32))
    assert fake.asnumpy(x).tolist() == [0, 0, 0, 3 * tiny]
