"""Pinned (page-locked) host memory stays bounded (issue 36, item 5).

The whole-model decode (``chainer_vgc.engines.cuda.decode.mean``) stages every
rank's message in one host buffer and uploads it each step; the upload's
size changes from step to step.  CuPy's pinned pool reuses a freed block
only for the same size, so a new pinned buffer a step would pin more host
memory step after step.  The buffer is a
:class:`chainer_vgc.backends.arrays.HostStaging` kept on the compressor: it grows
geometrically, a bounded number of times, and is otherwise reused.

Here: the class itself (growth, bounds, views, the fallback without
CuPy, the wait for a queued copy), then 1,000 decode steps through the
fake CuPy (``tests/fake_cupy.py`` records each pinned allocation) with
message sizes that vary by about +-45 % from step to step.
"""

import gc
import math
import random
import types

import numpy
import pytest

from chainer_vgc import GradientCompressor
from chainer_vgc.backends import arrays
from chainer_vgc.exchange import mean as exchange_mean

from reference import assert_bitwise


# -- the class --------------------------------------------------------------
def _requests(seed, count=500, low=1000, high=3000):
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(count)]


@pytest.mark.parametrize('seed', range(5))
def test_growth_is_logarithmic_and_capacity_at_most_twice_the_largest(seed):
    """Sizes changing every request: a handful of allocations
    (<= ceil(log2(largest / first)) + 1), the capacity never above twice
    the largest request so far, every allocation together under four
    times it (what a pool that keeps freed blocks may hold)."""
    staging = arrays.HostStaging(pinned=False)
    requests = _requests(seed)
    allocated, largest = [], 0
    for n in requests:
        before = staging.capacity
        view = staging.view(n, numpy.uint32)
        largest = max(largest, 4 * n)
        if staging.capacity != before:
            allocated.append(staging.capacity)
        assert view.size == n and view.dtype == numpy.uint32
        assert 4 * n <= staging.capacity <= 2 * largest
    bound = math.ceil(math.log2(largest / (4 * requests[0]))) + 1
    assert staging.allocations == len(allocated) <= bound
    assert sum(allocated) < 4 * largest
    for a, b in zip(allocated, allocated[1:]):
        assert b >= 2 * a  # at least doubling


def test_a_request_that_fits_reuses_the_buffer():
    staging = arrays.HostStaging(pinned=False)
    big = staging.view(1000, numpy.float64)
    small = staging.view(10, numpy.float64)
    assert staging.allocations == 1 and staging.capacity == 8000
    assert numpy.shares_memory(big, small)
    staging.view(1001, numpy.float64)  # larger: twice the old capacity
    assert staging.allocations == 2 and staging.capacity == 16000
    staging.view(5000, numpy.float64)  # more than twice: exactly the need
    assert staging.allocations == 3 and staging.capacity == 40000


@pytest.mark.parametrize('dtype', [numpy.uint8, numpy.uint16, numpy.uint32,
                                   numpy.float16, numpy.float32,
                                   numpy.float64, numpy.int64])
def test_views_have_the_size_and_dtype_asked(dtype):
    staging = arrays.HostStaging(pinned=False)
    for n in (1, 7, 100, 3, 1000, 64):
        view = staging.view(n, dtype)
        assert view.shape == (n,) and view.dtype == dtype
        assert view.flags.c_contiguous and view.flags.writeable
        view[:] = numpy.arange(n).astype(dtype)  # the whole view is usable
    assert staging.view(0, dtype).shape == (0,)


def test_views_of_several_dtypes_share_one_buffer():
    staging = arrays.HostStaging(pinned=False)
    words = staging.view(100, numpy.uint32)
    halves = staging.view(200, numpy.float16)
    longs = staging.view(50, numpy.uint64)
    assert staging.allocations == 1
    assert numpy.shares_memory(words, halves)
    assert numpy.shares_memory(words, longs)


def test_ordinary_memory_without_cupy(monkeypatch):
    """No CuPy: ordinary host memory, with the same growth."""
    monkeypatch.setattr(arrays, 'cupy', None)
    monkeypatch.setattr(arrays, 'cupyx', None)
    staging = arrays.HostStaging()
    for n in _requests(0, 50):
        assert staging.view(n, numpy.uint32).size == n
    assert type(staging.view(1, numpy.uint32)) is numpy.ndarray
    assert staging.allocations <= 3


def test_ordinary_memory_where_cupy_cannot_pin(monkeypatch):
    """CuPy installed, but no driver: empty_pinned raises; the buffer is
    ordinary memory and the staging works as before."""
    def refuse(*args, **kwargs):
        raise RuntimeError('cudaErrorNoDevice')
    monkeypatch.setattr(arrays, 'cupyx',
                        types.SimpleNamespace(empty_pinned=refuse))
    staging = arrays.HostStaging()
    view = staging.view(100, numpy.uint32)
    view[:] = 7
    assert view.size == 100 and staging.allocations == 1


def test_pinned_through_the_fake(device):
    fake = device
    del fake.pinned_allocations[:]
    staging = arrays.HostStaging()
    view = staging.view(100, numpy.uint32)
    assert fake.is_pinned(view)
    staging.view(50, numpy.uint32)
    staging.view(300, numpy.uint32)
    assert fake.pinned_allocations == [400, 1200]
    unpinned = arrays.HostStaging(pinned=False)
    assert not fake.is_pinned(unpinned.view(100, numpy.uint32))


class _Event(object):
    """A CUDA event that writes what is done with it into ``trace``."""

    trace = None

    def __init__(self, disable_timing=False):
        pass

    def record(self, stream=None):
        self.trace.append(('record', self))

    def synchronize(self):
        self.trace.append(('synchronize', self))


def test_the_buffer_waits_for_the_copy_that_reads_it():
    trace = []
    event = type('Event', (_Event,), {'trace': trace})()
    staging = arrays.HostStaging(pinned=False)
    staging.view(10, numpy.uint32)
    staging.hold_until(event)
    assert trace == []
    staging.view(20, numpy.uint32)  # waits once, then forgets the event
    staging.view(5, numpy.uint32)
    assert trace == [('synchronize', event)]


# -- the decode, step after step ----------------------------------------------
RANKS = 4
STEPS = 1000
#: vgc's alpha for the messages: the uploads (messages, descriptors and
#: tables) of this model: the largest is over 1.5 times the smallest
ALPHAS = (0.25, 0.5, 1.0, 1.6, 3.0)


def _model():
    rng = numpy.random.default_rng(0)
    return [int(s) for s in rng.integers(1, 300, 40)]


def _compressor(sizes, alpha=1.0, **kw):
    return GradientCompressor('vgc', [str(i) for i in range(len(sizes))],
                              [(n,) for n in sizes],
                              [numpy.float32] * len(sizes), alpha=alpha,
                              **kw)


def _messages(sizes):
    """{alpha: [a message per rank]}, made once on the host."""
    out = {}
    for alpha in ALPHAS:
        out[alpha] = []
        for r in range(RANKS):
            rng = numpy.random.default_rng(100 + r)
            gs = [rng.normal(0, 1, n).astype(numpy.float32) for n in sizes]
            ss = [g * g * rng.uniform(0.5, 2, g.size).astype(numpy.float32)
                  for g in gs]
            out[alpha].append(_compressor(sizes, alpha).compress(gs, ss))
    return out


def _params(xp, sizes):
    grads = [xp.zeros(n, numpy.float32) for n in sizes]
    return [types.SimpleNamespace(array=g, grad=g, dtype=g.dtype,
                                  shape=g.shape, size=g.size, xp=xp)
            for g in grads]


def _decode(fake, blocks, comp, params):
    """The device decode of ``blocks``; returns the upload's bytes (the
    step's need of staging memory)."""
    fake.reset()
    exchange_mean.mean_gradients(blocks, comp, params, [p.grad for p in params],
                                 RANKS, True, False)
    (need,) = fake._of('upload')
    return need


def _reference(blocks, sizes, cpu='native'):
    """The CPU decode of ``blocks`` on host parameters (``cpu``: the
    backend; 'native' equals 'numpy' bit for bit and is quicker)."""
    params = _params(numpy, sizes)
    exchange_mean.mean_gradients(blocks, _compressor(sizes, backend=cpu),
                                 params, [p.grad for p in params], RANKS, True,
                                 False)
    return [p.grad for p in params]


def test_decode_pinned_memory_stays_bounded_over_1000_steps(device):
    """1,000 decode steps, each of 4 ranks' messages drawn at random
    (the upload's size changes from step to step): pinned memory is
    allocated O(log(largest / smallest)) times, not once a step; the live
    staging buffer holds at most twice the largest step's need, and every
    allocation together (what CuPy's pool may keep) under four times it.
    Every 50th step's means equal the CPU decode's bit for bit."""
    fake = device
    sizes = _model()
    messages = _messages(sizes)
    comp = _compressor(sizes)
    params = _params(fake, sizes)
    rng = random.Random(0)
    del fake.pinned_allocations[:]
    needs = []
    for step in range(STEPS):
        blocks = [messages[rng.choice(ALPHAS)][r] for r in range(RANKS)]
        needs.append(_decode(fake, blocks, comp, params))
        if step % 50 == 0:
            for got, want in zip(params, _reference(blocks, sizes)):
                assert_bitwise(fake.asnumpy(got.grad), want)
    largest, smallest = max(needs), min(needs)
    assert largest >= 1.5 * smallest  # the sizes did vary
    allocations = fake.pinned_allocations
    bound = math.ceil(math.log2(largest / smallest)) + 2
    assert len(allocations) <= bound, (len(allocations), bound)
    staging = comp.device_engine.staging('upload')
    assert staging.allocations == len(allocations)
    gc.collect()
    live = sum(a.nbytes for a in fake._pinned.values())
    assert live == staging.capacity <= 2 * largest
    assert sum(allocations) < 4 * largest


def test_a_small_step_after_a_large_one_reads_no_stale_data(device):
    """The buffer of a large step reused by a small one: the small one's
    means equal a fresh decode's (the NumPy backend's, and the device's
    with a new compressor) bit for bit."""
    fake = device
    sizes = _model()
    messages = _messages(sizes)
    large, small = messages[ALPHAS[0]], messages[ALPHAS[-1]]
    comp = _compressor(sizes)
    params = _params(fake, sizes)
    big_need = _decode(fake, large, comp, params)
    small_need = _decode(fake, small, comp, params)
    assert small_need < big_need
    assert comp.device_engine.staging('upload').allocations == 1
    fresh = _params(fake, sizes)
    _decode(fake, small, _compressor(sizes), fresh)
    want = _reference(small, sizes, 'numpy')
    for got, new, want in zip(params, fresh, want):
        assert_bitwise(fake.asnumpy(got.grad), want)
        assert_bitwise(fake.asnumpy(got.grad), fake.asnumpy(new.grad))


def test_the_next_step_waits_for_the_last_upload(device, monkeypatch):
    """Where CuPy records events: each step records one after its upload
    (CuPy copies from pinned memory asynchronously), and the next step
    waits for it before writing the buffer again."""
    fake = device
    trace = []

    class Event(_Event):
        def record(self, stream=None):
            trace.append(('record', self, fake.count('upload')))

        def synchronize(self):
            trace.append(('synchronize', self, fake.count('upload')))
    monkeypatch.setattr(fake.cuda, 'Event', Event, raising=False)
    sizes = _model()
    messages = _messages(sizes)
    comp = _compressor(sizes)
    params = _params(fake, sizes)
    _decode(fake, messages[ALPHAS[0]], comp, params)
    first = trace[-1][1]
    assert trace == [('record', first, 1)]  # after this step's upload
    _decode(fake, messages[ALPHAS[1]], comp, params)
    second = trace[-1][1]
    assert trace[1:] == [('synchronize', first, 0),  # before the write
                         ('record', second, 1)]
