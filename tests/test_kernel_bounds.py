"""The harness's bounds-checked mode (``kernel_harness.HostKernels(
checked=True)``, the ``host_kernels_checked`` and ``checked_device``
fixtures): every ``raw`` array of a kernel is passed with its size, an
index outside it is counted (the run goes on with a dummy element, touching
no memory outside the array) and the call raises ``AssertionError``.

Honest runs give the unchecked mode's outputs bit for bit; a test-only
kernel that reads or writes its raw array at ``i + shift`` is caught at an
overrun of one element either way, and runs clean in bounds.
"""

import numpy
import pytest

import kernel_harness
from chainer_vgc.backends.cuda import kernels
from chainer_vgc.codec.gap import device_gap_body

# on both stacks (make test): its results depend on NumPy, the native
# build or the installed packages (docs/contributing.md)
pytestmark = pytest.mark.stack

#: test-only kernels: element i copied from / to raw element i + shift
SHIFTED_READ = kernels.KernelSpec(
    'raw T src, int64 shift', 'T dst', 'dst = src[i + shift]')
SHIFTED_WRITE = kernels.KernelSpec(
    'T x, int64 shift', 'raw T dst', 'dst[i + shift] = x')


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and \
        a.tobytes() == b.tobytes()


def _gap_chain(run, index, nibbles, k, sign_only):
    """The FMT_GAP kernels one after the other through ``run`` (a
    HostKernels): gaps and code lengths from the raw index, the codes ORed
    into a raw stream of exactly the words they need, the value words
    gathered from the raw nibbles.  Returns every output."""
    gap = numpy.empty(index.size, numpy.int64)
    length = numpy.empty(index.size, numpy.int64)
    run('vgc_gap_lengths', index, numpy.int32(k), gap, length)
    end = numpy.cumsum(length)
    stream = numpy.zeros(-(-int(end[-1]) // 32), numpy.uint32)
    run('vgc_gap_write', gap, end, numpy.int32(k), stream)
    per = 32 if sign_only else 8
    words = numpy.full(-(-index.size // per), 0xFFFFFFFF, numpy.uint32)
    run('vgc_gap_values', nibbles, numpy.int64(index.size), sign_only,
        words)
    return [gap, length, stream, words]


def _strom_chain(run, g, r, offsets, active, tau):
    """Strom's whole-model step through ``run``: the select pass (raw
    offsets, active, flags), the scan of ok, the one-thread layout into a
    message of exactly the words it writes (2 + a header and the elements
    of each tensor that sends), then the sign words.  Returns every
    output."""
    n = numpy.int32(offsets.size - 1)
    flags = numpy.zeros(n, numpy.uint32)
    r2, sign, ok, _ = run('vgc_model_strom_step', g, r, offsets, n,
                          active, tau, numpy.empty_like(r),
                          numpy.empty(g.size, numpy.int8),
                          numpy.empty(g.size, numpy.int64), flags)
    pos = numpy.cumsum(ok)
    counts = [int(ok[offsets[t]:offsets[t + 1]].sum()) for t in range(n)]
    msg = numpy.zeros(2 + sum(5 + c for c in counts if c), numpy.uint32)
    maxbits = numpy.zeros(n, numpy.uint64)
    base, ek = numpy.zeros(n, numpy.int64), numpy.zeros(n, numpy.int64)
    info = numpy.zeros(5, numpy.uint32)  # engines.cuda.compress.INFO_WORDS
    done = run('vgc_model_layout', pos, offsets, n, False,
               numpy.uint32(7), False, numpy.zeros(1, numpy.int32),
               maxbits, base, ek, msg, info)[0]
    run('vgc_model_sign_write', sign, pos, offsets, n, base, msg)
    return [r2, sign, ok, flags, done, base, ek, msg, info]


def test_honest_kernels_run_clean_and_equal_the_unchecked_mode(
        host_kernels, host_kernels_checked):
    """The FMT_GAP kernels and Strom's whole-model step, with every raw
    array of exactly the size the kernels need: no out-of-bounds access,
    and every output the unchecked build's bit for bit."""
    assert host_kernels_checked.checked and not host_kernels.checked
    rng = numpy.random.default_rng(5)
    index = numpy.sort(rng.choice(2 ** 40, 300, replace=False))
    nibbles = rng.integers(0, 16, index.size).astype(numpy.uint8)
    for k, sign_only in ((0, False), (7, True), (33, False)):
        want = _gap_chain(host_kernels, index, nibbles, k, sign_only)
        got = _gap_chain(host_kernels_checked, index, nibbles, k, sign_only)
        assert host_kernels_checked.oob() == 0
        assert all(_same_bits(a, b) for a, b in zip(got, want)), k
    # three tensors (the middle one empty, the last inactive)
    offsets = numpy.array([0, 17, 17, 40], numpy.int64)
    active = numpy.array([True, True, False])
    g = rng.standard_normal(40).astype(numpy.float32)
    r = rng.standard_normal(40).astype(numpy.float32)
    g[3] = numpy.inf  # an input flag for tensor 0
    tau = numpy.float32(0.8)
    want = _strom_chain(host_kernels, g, r, offsets, active, tau)
    got = _strom_chain(host_kernels_checked, g, r, offsets, active, tau)
    assert host_kernels_checked.oob() == 0
    assert all(_same_bits(a, b) for a, b in zip(got, want))
    assert want[3][0] and want[7][0] != 0  # flagged; a message was laid out


def test_an_overrun_of_one_element_is_caught(host_kernels_checked,
                                             monkeypatch):
    """A raw read or write at i + shift: clean for shift 0, caught for one
    element past either end (AssertionError naming the kernel, the count
    and the raw arrays), the run finished with a zero read in place of the
    missing element and no write outside the array."""
    monkeypatch.setitem(kernels.SPECS, 'vgc_test_shifted_read',
                        SHIFTED_READ)
    monkeypatch.setitem(kernels.SPECS, 'vgc_test_shifted_write',
                        SHIFTED_WRITE)
    run = host_kernels_checked
    src = numpy.arange(1, 5, dtype=numpy.float32)
    dst = numpy.full(4, -1, numpy.float32)
    run('vgc_test_shifted_read', src, numpy.int64(0), dst)
    assert run.oob() == 0 and dst.tolist() == [1, 2, 3, 4]
    with pytest.raises(AssertionError, match=(
            r'kernel vgc_test_shifted_read read or wrote out of bounds 1 '
            r'times \(raw arrays: src\[4\]\)')):
        run('vgc_test_shifted_read', src, numpy.int64(1), dst)
    assert run.oob() == 1 and dst.tolist() == [2, 3, 4, 0]
    with pytest.raises(AssertionError, match='out of bounds 1 times'):
        run('vgc_test_shifted_read', src, numpy.int64(-1), dst)
    assert dst.tolist() == [0, 1, 2, 3]
    run.reset_oob()
    assert run.oob() == 0

    # the written array is a view inside a larger one: its neighbours stay
    backing = numpy.full(6, 9, numpy.int64)
    x = numpy.arange(1, 5, dtype=numpy.int64)
    run('vgc_test_shifted_write', x, numpy.int64(0), backing[1:5])
    assert run.oob() == 0 and backing.tolist() == [9, 1, 2, 3, 4, 9]
    with pytest.raises(AssertionError, match=(
            r'kernel vgc_test_shifted_write read or wrote out of bounds 1 '
            r'times \(raw arrays: dst\[4\]\)')):
        run('vgc_test_shifted_write', x, numpy.int64(1), backing[1:5])
    assert backing.tolist() == [9, 1, 1, 2, 3, 9]
    with pytest.raises(AssertionError, match='out of bounds 4 times'):
        run('vgc_test_shifted_write', x, numpy.int64(-5), backing[1:5])
    assert backing.tolist() == [9, 1, 1, 2, 3, 9]


def test_the_unchecked_mode_does_not_see_the_overrun(host_kernels,
                                                     monkeypatch):
    """Why the checked mode exists: the same overrun unchecked writes the
    neighbour silently (here a cell of the larger array, so harmless)."""
    monkeypatch.setitem(kernels.SPECS, 'vgc_test_shifted_write',
                        SHIFTED_WRITE)
    backing = numpy.full(6, 9, numpy.int64)
    host_kernels('vgc_test_shifted_write', numpy.arange(1, 5),
                 numpy.int64(1), backing[1:5])
    assert backing.tolist() == [9, 9, 1, 2, 3, 4]
    assert host_kernels.oob() == 0


def test_checked_source_differs_only_for_raw_arrays():
    """The checked mode's translation unit: the prelude, and each raw array
    as pointer and count bound to vgc_bounded; a kernel without raw arrays
    keeps its unchecked body.  The cache keys of the two modes differ."""
    args = (numpy.zeros(3, numpy.int64), numpy.int32(0),
            numpy.zeros(3, numpy.int64), numpy.zeros(3, numpy.int64))
    plain = kernel_harness.generated_source([('vgc_gap_lengths', args)],
                                            device=False)
    checked = kernel_harness.generated_source([('vgc_gap_lengths', args)],
                                              device=False, checked=True)
    assert 'vgc_bounded' not in plain and 'const long long *index,' in plain
    assert kernel_harness.CHECKED_PRELUDE in checked
    assert 'const long long *index_p, long long index_n,' in checked
    assert 'vgc_bounded<const long long> index = {index_p, index_n};' in \
        checked
    cast = [('vgc_cast', (numpy.zeros(2, numpy.float32),
                          numpy.zeros(2, numpy.float64)))]
    assert kernel_harness.generated_source(cast, False, checked=True) == \
        kernel_harness.generated_source(cast, False).replace(
            '.cuh"\n', '.cuh"\n\n' + kernel_harness.CHECKED_PRELUDE + '\n', 1)
    with pytest.raises(ValueError):
        kernel_harness.generated_source(cast, device=True, checked=True)
    a = kernel_harness.HostKernels(workdir='.')
    b = kernel_harness.HostKernels(workdir='.', checked=True)
    assert a._key(plain) != b._key(plain)


def test_checked_device_runs_the_gap_body_in_bounds(checked_device):
    """The ``checked_device`` fixture: device_gap_body on the fake device
    with every kernel bounds-checked, equal to the host body."""
    rng = numpy.random.default_rng(11)
    for count, k, sign_only in ((1, 0, False), (97, 5, True),
                                (300, 20, False)):
        index = numpy.sort(rng.choice(2 ** 33, count, replace=False))
        nibbles = rng.integers(0, 16, count).astype(numpy.uint8)
        body = device_gap_body(checked_device.asarray(index),
                               checked_device.asarray(nibbles), k, sign_only)
        want = device_gap_body(index, nibbles, k, sign_only)
        assert checked_device.asnumpy(body).tolist() == want.tolist()
