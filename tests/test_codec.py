"""Codec: quantization, word packing and message validation (Sec. 4.2, App. B)."""

import numpy
import pytest
from hypothesis import given
from hypothesis import strategies as st

from chainer_vgc import codec
from chainer_vgc.codec import WireFormatError
from wire_messages import random_message
import reference
from reference import edge_values
from reference import ref_floor_log2
from reference import ref_quantize

# on both stacks (make test): its results depend on NumPy, the native
# build or the installed packages (docs/contributing.md)
pytestmark = pytest.mark.stack


def test_appendix_b_example():
    """Paper App. B: (0.04, 0.31, -6.25, 22.25, -35.75) -> e = 5; 0.04 is not
    sent; d = 7, 2, 1, 0 with signs +, -, +, - at indices 1, 2, 3, 4."""
    x = numpy.array([0.04, 0.31, -6.25, 22.25, -35.75], dtype=numpy.float32)
    e_k = codec.floor_log2(numpy.abs(x).max())
    assert e_k == 5
    words, ok = codec.pow2_encode(x, numpy.arange(5), e_k)
    assert ok.tolist() == [False, True, True, True, True]
    fields = [(int(w) >> 31, (int(w) >> 28) & 7, int(w) & (2 ** 28 - 1))
              for w in words[ok]]
    assert fields == [(0, 7, 1), (1, 2, 2), (0, 1, 3), (1, 0, 4)]
    msg = codec.pack([codec.pow2_group(0, words[ok], e_k)])
    (dec,) = codec.unpack(msg, [5], [numpy.float32])
    assert dec.index.tolist() == [1, 2, 3, 4]
    assert dec.value.tolist() == [0.25, -8.0, 16.0, -32.0]
    # one 5-word header + one word per element + 2 message words
    assert msg.size == 2 + 5 + 4


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
def test_quantizer_edge_values_match_reference(dtype):
    x = edge_values(dtype)
    for e_k in (-3, 0, 1, 2, 5, 10, 11):
        words, ok = codec.pow2_encode(x, numpy.arange(x.size), e_k)
        for i, xi in enumerate(x):
            ref = ref_quantize(xi, e_k, dtype)
            assert bool(ok[i]) == (ref is not None), (xi, e_k)
            if ref is not None:
                w = int(words[i])
                assert (bool(w >> 31), (w >> 28) & 7) == ref, (xi, e_k)
                assert w & (2 ** 28 - 1) == i
            else:
                assert words[i] == 0


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32),
                min_size=1, max_size=60))
def test_quantizer_matches_reference_float32(vals):
    _check_against_reference(numpy.array(vals, dtype=numpy.float32))


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False),
                min_size=1, max_size=60))
def test_quantizer_matches_reference_float64(vals):
    _check_against_reference(numpy.array(vals, dtype=numpy.float64))


def _check_against_reference(x):
    m = numpy.abs(x).max()
    if m < numpy.finfo(x.dtype).tiny:
        assert codec.floor_log2(m) == codec.LOG2_ZERO
        return
    e_k = codec.floor_log2(m)
    assert e_k == ref_floor_log2(m)
    words, ok = codec.pow2_encode(x, numpy.arange(x.size), e_k)
    for i, xi in enumerate(x):
        ref = ref_quantize(xi, e_k, x.dtype)
        assert bool(ok[i]) == (ref is not None)
        if ref is not None:
            w = int(words[i])
            assert (bool(w >> 31), (w >> 28) & 7) == ref
    # decode is the exact inverse: sign * 2**(e_k - d)
    index, value = codec.pow2_decode(words[ok], e_k, 1.0, x.dtype)
    assert index.tolist() == numpy.nonzero(ok)[0].tolist()
    for i, val in zip(index, value):
        neg, d = ref_quantize(x[i], e_k, x.dtype)
        assert val == (-1 if neg else 1) * 2.0 ** (e_k - d)


def test_floor_log2_edges():
    assert codec.floor_log2(numpy.float32(1.0)) == 0
    assert codec.floor_log2(numpy.float32(0.999)) == -1
    assert codec.floor_log2(numpy.float32(-2.0)) == 1
    assert codec.floor_log2(numpy.float64(2.0 ** 700)) == 700
    assert codec.floor_log2(numpy.float32(0)) == codec.LOG2_ZERO
    assert codec.floor_log2(numpy.float32(1e-40)) == codec.LOG2_ZERO


def test_pack_unpack_roundtrip_all_formats():
    rng = numpy.random.default_rng(0)
    sizes = [7, 1, 0, 33, 100, 5]
    dtypes = [numpy.float32] * len(sizes)
    for _ in range(30):
        msg, groups = random_message(rng, sizes)
        decoded = codec.unpack(msg, sizes, dtypes)
        assert [d.tensor_id for d in decoded] == [g.tensor_id for g in groups]
        for d, g in zip(decoded, groups):
            assert d.index.size == g.count
            assert (numpy.diff(d.index) > 0).all()
            assert d.index.max() < sizes[d.tensor_id]
            # the values packed, read back from the group word by word
            index, value = reference.decode_group(
                g.tensor_id, g.fmt, g.count, g.a, g.b, g.body,
                sizes[g.tensor_id])
            assert d.index.tolist() == index
            assert d.value.dtype == numpy.float32
            assert d.value.tolist() == [float(numpy.float32(x))
                                        for x in value]


def test_raw_float64_values_are_exact():
    vals = numpy.array([numpy.pi, -1e-300, 1e300])
    msg = codec.pack([codec.raw_group(0, numpy.array([0, 3, 4]), vals, 9)])
    out = [numpy.zeros(9)]
    assert codec.decode_into(msg, out) == 3
    assert out[0][[0, 3, 4]].tolist() == vals.tolist()


def test_qsgd_group_decodes_levels_times_scale():
    level = numpy.array([0, 3, 1, 0, 0, 2, 1])
    neg = numpy.array([0, 1, 0, 0, 1, 0, 1], dtype=bool)
    scales = numpy.array([0.5, 0.25, 2.0], dtype=numpy.float32)  # bucket 3
    msg = codec.pack([codec.qsgd_group(4, level, neg, scales, 3, 3)])
    (dec,) = codec.unpack(msg, [1, 1, 1, 1, 7], [numpy.float32] * 5)
    assert dec.tensor_id == 4
    assert dec.index.tolist() == [1, 2, 5, 6]
    assert dec.value.tolist() == [-1.5, 0.5, 0.5, -2.0]


def test_empty_message():
    msg = codec.pack([])
    assert msg.tolist() == [codec.MAGIC, 0]
    assert codec.unpack(msg, [3], [numpy.float32]) == []


def test_corrupt_messages_raise_clear_errors():
    rng = numpy.random.default_rng(1)
    sizes = [7, 1, 33, 100, 5]
    dtypes = [numpy.float32] * len(sizes)
    msg, _ = random_message(rng, sizes)
    while msg.size < 12:
        msg, _ = random_message(rng, sizes)
    with pytest.raises(WireFormatError, match='truncated|trailing'):
        codec.unpack(msg[:-1], sizes, dtypes)
    with pytest.raises(WireFormatError, match='magic'):
        codec.unpack(msg[1:], sizes, dtypes)
    with pytest.raises(WireFormatError, match='uint32'):
        codec.unpack(msg.astype(numpy.int64), sizes, dtypes)
    with pytest.raises(WireFormatError, match='trailing'):
        codec.unpack(numpy.append(msg, numpy.uint32(0)), sizes, dtypes)
    with pytest.raises(WireFormatError, match='same model'):
        codec.unpack(msg, sizes[:1], dtypes[:1])


def test_fuzzed_messages_never_read_out_of_bounds():
    """Every prefix and many random corruptions either decode to indices
    inside the model or raise WireFormatError; nothing else escapes."""
    rng = numpy.random.default_rng(2)
    sizes = [7, 1, 33, 100, 5]
    dtypes = [numpy.float32] * len(sizes)
    truncated = detected = 0
    for trial in range(200):
        msg, _ = random_message(rng, sizes)
        bad = msg.copy()
        if trial % 2:
            bad = bad[:rng.integers(0, bad.size)]
            truncated += 1
        else:
            pos = rng.integers(0, bad.size)
            bad[pos] ^= numpy.uint32(1 << int(rng.integers(0, 32)))
        try:
            decoded = codec.unpack(bad, sizes, dtypes)
        except WireFormatError:
            detected += trial % 2
            continue
        for d in decoded:
            assert d.index.size == 0 or (0 <= d.index.min()
                                         and d.index.max() <
                                         sizes[d.tensor_id])
            assert d.index.size == d.value.size
            assert (numpy.diff(d.index) > 0).all()
            assert numpy.isfinite(d.value).all()
    assert detected == truncated == 100  # every truncation is detected


def test_decode_into_requires_contiguous_outputs():
    msg = codec.pack([codec.raw_group(0, None, numpy.ones(4,
                                                          numpy.float32), 4)])
    out = numpy.zeros((4, 2), numpy.float32)[:, 0]
    with pytest.raises(ValueError, match='contiguous'):
        codec.decode_into(msg, [out])


def test_corrupt_fields_that_would_decode_silently_are_rejected():
    x = numpy.array([0.5, -3.0, 7.0, 0.25], numpy.float32)
    words, ok = codec.pow2_encode(x, numpy.array([1, 4, 6, 9]), 2)
    good = codec.pack([codec.pow2_group(0, words[ok], 2)])
    sizes, dtypes = [10], [numpy.float32]
    assert codec.unpack(good, sizes, dtypes)[0].index.tolist() == [1, 4, 6, 9]
    for e_k in (200, -200, 0x80000000):
        bad = good.copy()
        bad[2 + 3] = numpy.uint32(e_k & 0xFFFFFFFF)  # header word a = e_k
        with pytest.raises(WireFormatError, match='exponent'):
            codec.unpack(bad, sizes, dtypes)
    bad = good.copy()
    bad[-1] = (bad[-1] & numpy.uint32(0xF0000000)) | numpy.uint32(6)
    with pytest.raises(WireFormatError, match='strictly increasing'):
        codec.unpack(bad, sizes, dtypes)
    bad = good.copy()
    bad[2 + 4] = numpy.float32(numpy.nan).view(numpy.uint32)  # scale
    with pytest.raises(WireFormatError, match='scale'):
        codec.unpack(bad, sizes, dtypes)
    raw = codec.pack([codec.raw_group(0, numpy.array([2, 3]),
                                      numpy.array([1.0, numpy.inf]), 10)])
    with pytest.raises(WireFormatError, match='non-finite'):
        codec.unpack(raw, sizes, [numpy.float64])


def _qsgd_message(scale, level):
    """One FMT_QSGD group: tensor of 3 elements, one bucket, element 1 at
    ``level`` (levels 3) times the float64 ``scale``."""
    return codec.pack([codec.qsgd_group(
        0, numpy.array([0, level, 0]), numpy.array([False, True, False]),
        numpy.array([scale], numpy.float64), 3, 3)])


def test_values_that_overflow_the_state_dtype_are_rejected():
    """A scale or raw value finite on the wire whose decoded value
    (level * scale, or the value, cast to the state dtype) is not finite
    there is rejected; where it is finite it decodes."""
    cases = [  # (message, state dtypes rejecting it, accepting it)
        (_qsgd_message(2e38, 3), [numpy.float32], [numpy.float64]),
        (_qsgd_message(1e308, 1), [numpy.float32], [numpy.float64]),
        (_qsgd_message(1e308, 2), [numpy.float32, numpy.float64], []),
        (codec.pack([codec.raw_group(0, numpy.array([2]),
                                     numpy.array([-1e300]), 3)]),
         [numpy.float32], [numpy.float64]),
        (codec.pack([codec.raw_group(0, None, numpy.array([1.0, 3.5e38,
                                                          2.0]), 3)]),
         [numpy.float32], [numpy.float64]),
    ]
    for msg, rejecting, accepting in cases:
        for dtype in rejecting:
            with pytest.raises(WireFormatError,
                               match='value out of range for {}'.format(
                                   numpy.dtype(dtype))):
                codec.unpack(msg, [3], [dtype])
        for dtype in accepting:
            dec, = codec.unpack(msg, [3], [dtype])
            assert dec.value.dtype == dtype
            assert numpy.isfinite(dec.value).all()
    # float16 parameters receive float32 state: the same limit
    with pytest.raises(WireFormatError, match='out of range for float32'):
        codec.unpack(_qsgd_message(2e38, 3), [3], [numpy.float16])
    # the largest finite products still decode
    dec, = codec.unpack(_qsgd_message(numpy.finfo(numpy.float32).max / 3, 3),
                        [3], [numpy.float32])
    assert numpy.isfinite(dec.value).all() and dec.value[0] < -3e38


# ---- -0.0: one rule for every decoder (wire format Sec. 5.2) ----------------

def negative_zero_message():
    """``(message, sizes, dtypes, where)``: one message with every way a
    -0.0 element reaches a decoder, ``where`` its (tensor, index) pairs:
    a sparse float32 FMT_RAW element, a dense float64 one (the example of
    Sec. 4.6), a float64 value that rounds to -0.0 in a float32 state, a
    QSGD word with s = 1 and level 0 (accepted, never sent) and a dense
    float32 element of a float16 tensor."""
    F16, F32, F64 = numpy.float16, numpy.float32, numpy.float64
    sizes, dtypes = [4, 3, 4, 4, 2], [F32, F64, F32, F32, F16]
    qsgd = codec.qsgd_group(3, numpy.array([0, 1, 0, 2]),
                            numpy.array([0, 1, 0, 0], dtype=bool),
                            numpy.array([0.5]), 4, 3)
    body = qsgd.body.copy()
    body[4] &= numpy.uint32(~(0xFF << 23) & 0xFFFFFFFF)  # index 1: level 0
    message = codec.pack([
        codec.raw_group(0, numpy.array([1, 3]),
                        numpy.array([-0.0, 0.5], F32), 4),
        codec.raw_group(1, numpy.arange(3), numpy.array([1.0, -0.0, -2.5]),
                        3),
        codec.raw_group(2, numpy.array([0, 2]), numpy.array([1e-300,
                                                             -1e-300]), 4),
        qsgd._replace(body=body),
        codec.raw_group(4, numpy.arange(2), numpy.array([-0.0, 3.0], F32),
                        2)])
    return message, sizes, dtypes, [(0, 1), (1, 1), (2, 2), (3, 1), (4, 0)]


def _listed(message, sizes, dtypes):
    """{(tensor, index): value} of codec.unpack, and the same of the
    specification's own decoder, which must agree bit for bit."""
    import spec_decoder
    got = {(d.tensor_id, int(i)): v for d in codec.unpack(
        message, sizes, dtypes) for i, v in zip(d.index.tolist(), d.value)}
    spec = {(t, i): v for t, index, values in spec_decoder.decode(
        message, sizes, dtypes) for i, v in zip(index, values)}
    assert sorted(got) == sorted(spec)
    for key, v in got.items():
        assert reference.bits(v) == reference.bits(spec[key]), key
    return got


def _assert_sums(outs, listed, start, scale=1):
    """Every listed element landed in ``outs`` as ``start + value`` (times
    ``scale``), bit for bit."""
    for (t, i), v in listed.items():
        got = outs[t].reshape(-1)[i]
        T = got.dtype.type
        want = T(T(start) + T(v)) * T(scale)
        assert reference.bits(got) == reference.bits(want), (t, i, got)


def test_negative_zero_one_rule_for_every_decoder():
    """Sec. 5.2: an element's value is what was sent, -0.0 included;
    codec.unpack and the specification's decoder list it bit for bit.
    Every decoder that makes tensors adds the values into them: those
    that start from +0.0 (GradientCompressor.decode, the exchange, the
    native decoder) give +0.0 for a -0.0 element, and decode_into keeps
    what its output holds (-0.0 + -0.0 = -0.0).  Each decoder's tensors
    are +0.0 + what unpack lists, bit for bit."""
    from chainer_vgc import GradientCompressor
    from chainer_vgc.backends import arrays
    from chainer_vgc.engines import reference as reference_engine
    from chainer_vgc.engines.native import bindings
    import types
    message, sizes, dtypes, where = negative_zero_message()
    sdts = [arrays.state_dtype(d) for d in dtypes]
    listed = _listed(message, sizes, dtypes)
    for key in where:
        assert listed[key] == 0 and numpy.signbit(listed[key]), key
    assert sum(numpy.signbit(v) for v in listed.values() if v == 0) == 5
    comp = GradientCompressor('none', list('abcde'), [(n,) for n in sizes],
                              dtypes)
    outs = comp.decode(message)
    assert [o.dtype for o in outs] == sdts
    for t, i in where:
        assert outs[t][i] == 0 and not numpy.signbit(outs[t][i]), (t, i)
    _assert_sums(outs, listed, 0.0)
    for start in (0.0, -0.0):  # decode_into adds to what is there
        outs = [numpy.full(n, start, dt) for n, dt in zip(sizes, sdts)]
        comp.decode_into(message, outs)
        _assert_sums(outs, listed, start)
        for t, i in where:  # -0.0 only where the output held -0.0
            assert numpy.signbit(outs[t][i]) == numpy.signbit(start)
    params = [types.SimpleNamespace(array=numpy.zeros(n, dt), shape=(n,),
                                    dtype=numpy.dtype(dt), size=n)
              for n, dt in zip(sizes, dtypes)]
    for ranks in (1, 2):
        blocks = [message] * ranks
        for dense in (False, True):  # rank order, or the pairwise tree
            sums = reference_engine.sum_messages(blocks, comp.sizes, params,
                                                 dense)
            _assert_sums(sums, listed, 0.0, scale=ranks)
        outs = [numpy.full(n, 7, dt) for n, dt in zip(sizes, sdts)]
        assert bindings.decode_mean(blocks, sizes, sdts, outs,
                                    [False] * len(sizes), 1.0) is not None
        _assert_sums(outs, listed, 0.0, scale=ranks)


def test_negative_zero_on_the_device_path(device):
    """The GPU path (CuPy arrays, here the fake) follows the same rule:
    a device message decoded by GradientCompressor.decode, and the
    exchange's validate, expand, upload and add, give +0.0."""
    from chainer_vgc import GradientCompressor
    from chainer_vgc.backends import arrays
    message, sizes, dtypes, where = negative_zero_message()
    sdts = [arrays.state_dtype(d) for d in dtypes]
    listed = _listed(message, sizes, dtypes)
    comp = GradientCompressor('none', list('abcde'), [(n,) for n in sizes],
                              dtypes)
    _assert_sums([device.asnumpy(o) for o in comp.decode(
        device.asarray(message))], listed, 0.0)
    for start in (0.0, -0.0):
        outs = [device.asarray(numpy.full(n, start, dt))
                for n, dt in zip(sizes, sdts)]
        codec.decode_into(device.asarray(message), outs, sizes)
        _assert_sums([device.asnumpy(o) for o in outs], listed, start)
        outs = [device.asarray(numpy.full(n, start, dt))
                for n, dt in zip(sizes, sdts)]
        codec.add_validated(message, device.asarray(message), outs, sizes)
        _assert_sums([device.asnumpy(o) for o in outs], listed, start)
