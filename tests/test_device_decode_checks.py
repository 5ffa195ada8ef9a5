"""The whole-model decode checks the FMT_GAP codes on the device (issue 36).

The host validates each received message's structure only (headers,
lengths, value padding, value tables: ``bindings.decode_mean(...,
gap_codes=False)``); ``vgc_model_gap_expand`` decodes every block of codes
from its restart point with the exact checks of the sequential decoder

# on both stacks (make test): its results depend on NumPy, the native
# build or the installed packages (docs/contributing.md)
pytestmark = pytest.mark.stack
(``vgc_gap_decode``) and the block's end against the next restart entry,
and flags the message otherwise.  The oracle is the reference decoder,
:func:`chainer_vgc.codec.unpack`: for messages with corrupted FMT_GAP
bodies (restart tables, code streams, value fields), the device path must
refuse exactly those the reference refuses, with the reference's error and
no gradient changed, and give the CPU path's means bit for bit for the
others.  Run through the kernels compiled for the host with every ``raw``
array bounds-checked (the ``checked_device`` fixture), a kernel that reads
or writes outside an array fails the test.
"""

import numpy
import pytest

from chainer_vgc import codec
from chainer_vgc.engines.cuda import decode as device_decode
from chainer_vgc.exchange import mean as exchange_mean
from chainer_vgc.engines.native import bindings
from chainer_vgc.codec.message import walk

from reference import assert_bitwise
from test_device_step import _pair
from test_device_step import _param
from test_device_step import _stream

F32, F64 = numpy.float32, numpy.float64
#: tensors of more than 1,024 elements sent: restart tables; a float64
#: tensor among float32 ones; 'strom' at a low density merges groups
#: into one FMT_GAP group spanning tensors
CASES = {
    'vgc-gap': ('vgc', dict(alpha=1.0, index_coding='gap'),
                [(12000,), (5,), (4100, 2)], [F32] * 3),
    'vgc-auto-f64': ('vgc', dict(alpha=1.0, index_coding='auto'),
                     [(3000,), (40,), (2500,)], [F32, F64, F32]),
    'strom-merged': ('strom', dict(tau=2.5, index_coding='auto'),
                     [(400,)] * 6 + [(5000,)], [F32] * 7),
}


def _messages(case, ranks=2):
    method, kw, shapes, dtypes = CASES[case]
    comps = [_pair(method, kw, shapes, dtypes)[1] for _ in range(ranks)]
    blocks = None
    for k in range(3):
        blocks = [c.compress(*_stream(shapes, dtypes, 3, 20 + r)[k]).copy()
                  for r, c in enumerate(comps)]
    return comps[0], blocks, shapes, dtypes


def _gap_bodies(message, sizes):
    """(first word, words) of each FMT_GAP group's body in ``message``,
    from its restart table on (the param word and G left alone: the host
    checks those)."""
    base = message.__array_interface__['data'][0]
    out = []
    for g in walk(message, sizes):
        if g.fmt == codec.FMT_GAP:
            at = (g.body.__array_interface__['data'][0] - base) // 4
            out.append((at + codec.GAP_PARAM_WORDS,
                        g.body.size - codec.GAP_PARAM_WORDS))
    return out


def _reference_verdict(message, comp):
    try:
        codec.unpack(message, comp.sizes, comp.dtypes)
    except codec.WireFormatError as e:
        return str(e)
    return None


def _host_means(blocks, comp, shapes, dtypes):
    host = [_param(numpy, s, d, numpy.ones(s, d))
            for s, d in zip(shapes, dtypes)]
    exchange_mean.mean_gradients(blocks, comp, host, [p.grad for p in host],
                                 len(blocks), True, False)
    return [p.grad for p in host]


def _fuzz(fake, case, trials, seed):
    comp, blocks, shapes, dtypes = _messages(case)
    good = blocks[1]
    bodies = _gap_bodies(good, comp.sizes)
    assert bodies, 'the case must carry FMT_GAP groups'
    assert any(g.fmt == codec.FMT_GAP and g.span for g in
               walk(good, comp.sizes)) or case != 'strom-merged'
    rng = numpy.random.default_rng(seed)
    refused = accepted = 0
    for _ in range(trials):
        bad = good.copy()
        at, n = bodies[rng.integers(len(bodies))]
        for _ in range(int(rng.integers(1, 4))):
            word = at + int(rng.integers(n))
            bad[word] ^= numpy.uint32(1 << int(rng.integers(32)))
        verdict = _reference_verdict(bad, comp)
        grads = [fake.asarray(numpy.ones(s, d))
                 for s, d in zip(shapes, dtypes)]
        dev = [_param(fake, s, d, g) for s, d, g in zip(shapes, dtypes,
                                                        grads)]
        if verdict is not None:
            with pytest.raises(codec.WireFormatError) as err:
                exchange_mean.mean_gradients([blocks[0], bad], comp, dev, grads,
                                             2, True, False)
            assert str(err.value) == verdict
            assert all(p.grad is g for p, g in zip(dev, grads))
            assert all((fake.asnumpy(g) == 1).all() for g in grads)
            refused += 1
        else:
            exchange_mean.mean_gradients([blocks[0], bad], comp, dev, grads, 2,
                                         True, False)
            for h, d in zip(_host_means([blocks[0], bad], comp, shapes,
                                        dtypes), dev):
                assert_bitwise(fake.asnumpy(d.grad), h)
            accepted += 1
    return refused, accepted


@pytest.mark.parametrize('case', sorted(CASES))
def test_corrupt_gap_codes_are_refused_as_the_reference_refuses_them(
        checked_device, case):
    refused, accepted = _fuzz(checked_device, case, 40, 7)
    assert refused >= 10, (refused, accepted)  # most flips break a code


def test_the_host_checks_the_structure_and_leaves_the_codes(device):
    """``gap_codes=False`` accepts a message whose codes are corrupt (the
    device refuses it) and refuses one whose header is, as the full
    validation does."""
    comp, blocks, shapes, dtypes = _messages('vgc-gap')
    sizes, sdts = comp.sizes, [numpy.dtype(d) for d in dtypes]
    at, _ = _gap_bodies(blocks[0], sizes)[0]
    g = next(g for g in walk(blocks[0], sizes) if g.fmt == codec.FMT_GAP)
    codes = blocks[0].copy()
    # the first word of the code stream, after the restart table
    codes[at + codec.GAP_RESTART_WORDS * codec.gap_restarts(g.count)] ^= \
        numpy.uint32(0xFFFFFFFF)
    assert _reference_verdict(codes, comp) is not None

    def check(msg, gap_codes):
        return bindings.decode_mean([msg], sizes, sdts, [None] * len(sizes),
                                    [0] * len(sizes), 1.0, table=True,
                                    gap_codes=gap_codes)
    assert check(codes, True) is None
    assert check(codes, False) is not None
    header = blocks[0].copy()
    header[4] = 0xFFFFFFF  # the first group's count: beyond the tensor
    assert check(header, False) is None and check(header, True) is None
    with pytest.raises(ValueError, match='none with gap_codes=False'):
        bindings.decode_mean([codes], sizes, sdts,
                             [numpy.zeros(s, F32) for s in sizes],
                             [0] * len(sizes), 1.0, gap_codes=False)


def test_a_device_refusal_the_host_does_not_share_is_reported(
        device, monkeypatch):
    """Should the device refuse a message that the full host validation
    accepts (a bug), the step stops with an error that says so and names
    the workaround, and no gradient changes."""
    fake = device
    comp, blocks, shapes, dtypes = _messages('vgc-gap')
    monkeypatch.setattr(device_decode, 'mean',
                        lambda *a, **k: device_decode.REFUSED)
    grads = [fake.asarray(numpy.ones(s, d)) for s, d in zip(shapes, dtypes)]
    dev = [_param(fake, s, d, g) for s, d, g in zip(shapes, dtypes, grads)]
    with pytest.raises(RuntimeError, match='CHAINER_VGC_BACKEND=numpy'):
        exchange_mean.mean_gradients(blocks, comp, dev, grads, 2, True, False)
    assert all(p.grad is g for p, g in zip(dev, grads))
