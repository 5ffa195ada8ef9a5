"""The CPU CuPy stand-in of fake_cupy.py: it must keep host and device apart
as CuPy does and count every transfer, or transfer-budget tests built on it
would pass for the wrong reason."""

import numpy
import pytest

import fake_cupy
from fake_cupy import DeviceArray, FakeCupy

# on both stacks (make test): its results depend on NumPy, the native
# build or the installed packages (docs/contributing.md)
pytestmark = pytest.mark.stack


@pytest.fixture
def xp():
    return FakeCupy()


def test_module_identity(xp):
    assert xp.__name__ == 'cupy'
    assert xp.ndarray is DeviceArray
    assert xp.float32 is numpy.float32 and xp.bool_ is numpy.bool_
    a = xp.zeros(3)
    assert isinstance(a, xp.ndarray)
    assert not isinstance(a, numpy.ndarray)
    with pytest.raises(AttributeError):
        xp.not_a_cupy_function  # noqa: B018 - coverage gaps must show


def test_upload_recorded_with_bytes(xp):
    a = xp.asarray(numpy.arange(10, dtype=numpy.float32))
    assert isinstance(a, DeviceArray) and a.dtype == numpy.float32
    assert xp.log == [('upload', 40, 'asarray')]
    xp.asarray([1, 2, 3], dtype=numpy.int64)
    xp.array(numpy.zeros((2, 2)))
    assert xp.count('upload') == 3
    assert xp.bytes('upload') == 40 + 24 + 32
    # device data: no transfer, same object unless converted
    assert xp.asarray(a) is a
    assert xp.asarray(a, dtype=numpy.float32) is a
    assert xp.asarray(a, dtype=numpy.float64).dtype == numpy.float64
    assert xp.array(a) is not a
    assert xp.count('upload') == 3


def test_creation_and_compute_are_free(xp):
    a = xp.zeros(5, dtype=numpy.float32) + xp.arange(5)
    b = xp.where(a > 2, a, 0) * xp.ones_like(a)
    c = xp.concatenate([a, b, xp.full(2, 7.0)])
    assert isinstance(c, DeviceArray) and c.shape == (12,)
    assert xp.log == []


def test_download_recorded(xp):
    a = xp.arange(6, dtype=numpy.int32)
    host = xp.asnumpy(a)
    assert isinstance(host, numpy.ndarray)
    numpy.testing.assert_array_equal(host, numpy.arange(6))
    assert xp.log == [('download', 24, 'get')]
    h = a.get()
    assert isinstance(h, numpy.ndarray) and xp.bytes('download') == 48
    h[0] = 99  # a host copy, not a view of the device data
    assert int(a[0]) == 0
    # host input passes through asnumpy with no record
    xp.reset()
    plain = numpy.ones(3)
    assert xp.asnumpy(plain) is plain
    assert xp.log == []


def test_get_out_fills_host_array(xp):
    a = xp.arange(4, dtype=numpy.float64)
    out = numpy.zeros(4)
    assert a.get(out=out) is out
    numpy.testing.assert_array_equal(out, [0, 1, 2, 3])
    assert xp.count('download') == 1 and xp.bytes('download') == 32
    out2 = numpy.zeros(4)
    assert xp.asnumpy(a, out=out2) is out2
    numpy.testing.assert_array_equal(out2, [0, 1, 2, 3])
    assert xp.count('download') == 2
    with pytest.raises(ValueError):
        a.get(out=numpy.zeros(5))


def test_scalar_reads_recorded(xp):
    a = xp.arange(4, dtype=numpy.int64)
    assert int(a[1]) == 1
    assert float(a.sum()) == 6.0
    assert bool(a.any()) is True
    assert a[3].item() == 3
    assert a.tolist() == [0, 1, 2, 3]
    assert list(range(5))[a[2]] == 2  # __index__
    if a.all():  # truth value
        raise AssertionError('a[0] is 0')
    assert [k for k, _, _ in xp.log] == ['scalar'] * 7
    # 8-byte int64 values, two 1-byte bools, and tolist reads all 4 values
    assert xp.bytes('scalar') == 8 * 4 + 1 + 1 + 32
    with pytest.raises(ValueError):  # ambiguous truth: no read recorded
        bool(a)
    assert xp.count('scalar') == 7
    assert xp.count('upload') == xp.count('download') == 0


def test_reductions_stay_on_device(xp):
    a = xp.arange(6, dtype=numpy.float32).reshape(2, 3)
    for r in (a.sum(), a.max(), a.min(), a.mean(), a.any(), a.all(),
              a.argmax(), xp.sum(a), xp.count_nonzero(a),
              a.ravel().dot(a.ravel())):
        assert isinstance(r, DeviceArray) and r.ndim == 0
    assert isinstance(a.sum(axis=0), DeviceArray)
    assert xp.log == []


def test_implicit_host_conversion_raises(xp):
    a = xp.arange(3)
    with pytest.raises(TypeError, match='Implicit conversion'):
        numpy.asarray(a)
    with pytest.raises(TypeError):
        numpy.array([a, a])
    with pytest.raises(TypeError):
        numpy.concatenate([a, a])
    with pytest.raises(TypeError):
        numpy.where(a)
    assert xp.log == []


def test_host_device_mixing_raises(xp):
    a = xp.arange(3, dtype=numpy.float64)
    host = numpy.ones(3)
    for op in (lambda: a + host, lambda: host + a, lambda: a * host,
               lambda: a == host, lambda: xp.maximum(a, host),
               lambda: xp.concatenate([a, host]), lambda: xp.where(a > 0, a,
                                                                   host),
               lambda: a + [1, 2, 3]):
        with pytest.raises(TypeError):
            op()
    # scalars (Python, NumPy, 0-d) are fine and stay on the device
    for s in (2, 2.0, numpy.float32(2), numpy.uint32(2), numpy.array(2.0)):
        assert isinstance(a * s, DeviceArray)
    assert isinstance(numpy.float64(2) * a, DeviceArray)
    assert xp.log == []


def test_nonzero_returns_device_tuple(xp):
    a = xp.asarray(numpy.array([[0, 1], [2, 0]]))
    xp.reset()
    idx = xp.nonzero(a)
    assert isinstance(idx, tuple) and len(idx) == 2
    assert all(isinstance(i, DeviceArray) for i in idx)
    assert isinstance(a.nonzero()[0], DeviceArray)
    assert isinstance(xp.flatnonzero(a), DeviceArray)
    numpy.testing.assert_array_equal(xp.asnumpy(a[idx]), [1, 2])
    u, inv = xp.unique(xp.concatenate([a.ravel(), a.ravel()]),
                       return_inverse=True)
    assert isinstance(u, DeviceArray) and isinstance(inv, DeviceArray)


def test_in_place_ops_stay_on_device(xp):
    a = xp.zeros(4, dtype=numpy.float32)
    b = xp.ones(4, dtype=numpy.float32)
    a_id = id(a)
    a += b
    a *= 3
    a -= numpy.float32(1)
    a[1:3] = b[1:3]
    a[0] = 5
    a[a > 4] = 0
    xp.maximum(a, b, out=a)
    numpy.add.at(a, xp.asarray(numpy.array([0, 0])), 1)
    assert id(a) == a_id and isinstance(a, DeviceArray)
    assert xp.count('download') == 0 and xp.count('scalar') == 0
    assert xp.count('upload') == 1  # only the explicit index upload
    numpy.testing.assert_array_equal(a.get(), [3, 1, 1, 2])


def test_setitem_host_value_is_an_upload(xp):
    a = xp.zeros((2, 3), dtype=numpy.float32)
    a[0] = numpy.array([1, 2, 3], dtype=numpy.float32)
    assert xp.log == [('upload', 12, 'asarray')]
    a[1] = numpy.float32(4)  # a scalar is a kernel argument, no transfer
    a[...] = a * 2
    assert xp.count('upload') == 1
    numpy.testing.assert_array_equal(a.get(), [[2, 4, 6], [8, 8, 8]])


def test_host_index_raises(xp):
    a = xp.arange(5)
    with pytest.raises(TypeError):
        a[numpy.array([0, 1])]
    with pytest.raises(TypeError):
        a[numpy.array([True] * 5)] = 0
    assert isinstance(a[xp.asarray(numpy.array([0, 1]))], DeviceArray)
    assert isinstance(a[numpy.int64(2)], DeviceArray)  # numpy scalar: fine


def test_device_placement(xp):
    assert xp.cuda.Device().id == 0
    a = xp.zeros(3)
    with xp.cuda.Device(1) as dev:
        assert dev.id == 1 and xp.cuda.Device().id == 1
        b = xp.zeros(3)
        c = xp.asarray(numpy.ones(2))
        view = a[1:]  # a view stays where its data is
        with xp.cuda.Device(2):
            assert xp.empty(1)._dev == 2
        assert xp.cuda.Device().id == 1
    assert xp.cuda.Device().id == 0
    assert (a._dev, b._dev, c._dev, view._dev) == (0, 1, 1, 0)
    assert b.device == xp.cuda.Device(1) and b.device.id == 1
    with b.device:  # back onto an array's device
        d = xp.asarray(numpy.zeros(1))
    assert d._dev == 1
    with pytest.raises(RuntimeError):
        with xp.cuda.Device(99):
            pass


def test_strict_devices():
    xp = FakeCupy(strict_devices=True)
    with xp.cuda.Device(1):
        b = xp.ones(2)
    with pytest.raises(ValueError):
        b + 1
    with b.device:
        assert isinstance(b + 1, DeviceArray)


def test_pinned_memory(xp):
    h = xp.x.empty_pinned((4, 2), dtype=numpy.float32)
    z = xp.x.zeros_pinned(3)
    assert type(h) is numpy.ndarray and h.dtype == numpy.float32
    numpy.testing.assert_array_equal(z, 0)
    assert xp.is_pinned(h) and xp.is_pinned(h[1:].reshape(-1))
    assert xp.is_pinned(z) and not xp.is_pinned(numpy.zeros(3))
    assert xp.log == []


def test_random_generator(xp):
    u = xp.random.default_rng(5).random(4, dtype=numpy.float32)
    assert isinstance(u, DeviceArray) and u.dtype == numpy.float32
    expect = numpy.random.default_rng(5).random(4, dtype=numpy.float32)
    numpy.testing.assert_array_equal(u.get(), expect)
    out = xp.empty(3)
    rng = xp.random.default_rng(numpy.random.SeedSequence(1))
    assert rng.random(dtype=numpy.float64, out=out) is out
    assert isinstance(xp.random.default_rng(None).random(), DeviceArray)


def test_transfer_record_helpers(xp):
    xp.asarray(numpy.zeros(2))
    assert xp.count('upload') == 1 and xp.bytes('download') == 0
    with pytest.raises(ValueError):
        xp.count('uploads')
    xp.reset()
    assert xp.log == [] and xp.count('upload') == 0


def test_install_routes_backend(monkeypatch):
    from chainer_vgc.backends import arrays
    xp = fake_cupy.install(monkeypatch)
    a = xp.arange(3, dtype=numpy.float32)
    assert arrays.get_array_module(numpy.ones(1), a) is xp
    assert arrays.get_array_module(numpy.ones(1)) is numpy
    assert arrays.is_cupy(xp)
    host = arrays.to_numpy(a)
    assert isinstance(host, numpy.ndarray)
    assert xp.log == [('download', 12, 'get')]


def test_views_copies_and_ufunc_methods(xp):
    import copy
    a = xp.arange(6, dtype=numpy.float32)
    v = a.reshape(2, 3)[1]
    v[...] = 0  # a view writes through, like a CuPy view
    assert a.astype(numpy.float32, copy=False) is a
    assert xp.ascontiguousarray(a) is a
    for c in (copy.copy(a), copy.deepcopy(a), a.copy()):
        assert isinstance(c, DeviceArray) and c._fake is xp
        c[0] = 42
    xp.add.at(a, xp.asarray(numpy.array([0, 0, 1])), 1)
    xp.x.scatter_add(a, xp.asarray(numpy.array([2])), 1)
    assert isinstance(xp.add.reduce(a), DeviceArray)
    z = xp.zeros_like(numpy.ones((2, 2), dtype=numpy.int32))  # shape only
    assert isinstance(z, DeviceArray) and z.dtype == numpy.int32
    assert xp.count('upload') == 2 and xp.count('download') == 0
    numpy.testing.assert_array_equal(a.get(), [2, 2, 3, 0, 0, 0])


def test_int64_cumsum_stays_on_device(xp):
    """The FMT_GAP encoder's scan (codec.gap.device_gap_body): cumsum of
    int64 code lengths on the device is free and exact; reading its last
    element is the one scalar read."""
    lengths = xp.asarray(numpy.array([5, 2 ** 40, 7, 141], numpy.int64))
    xp.reset()
    end = xp.cumsum(lengths)
    assert isinstance(end, DeviceArray) and end.dtype == numpy.int64
    assert xp.log == []
    assert int(end[-1]) == 2 ** 40 + 153
    assert xp.log == [('scalar', 8, 'int')]
