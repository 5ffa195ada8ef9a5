#!/usr/bin/env python3
"""The GPU exchange under training conditions, kernel by kernel (issue 36,
item 1): where the time of a compress step, of a decode+mean step and of a
whole App. D VGG step goes, and whether pinned host memory stays bounded.

``python3 benchmarks/gpu_profile.py [--log FILE]`` (on a GPU; the runbook's
first step, ``benchmarks/gpu_runbook.py``, runs it so)
``python3 benchmarks/gpu_profile.py --dry`` (no GPU: the same code through
the fake CuPy of ``tests/fake_cupy.py`` with the kernels compiled for the
host, tiny sizes, a few steps; ``tests/test_gpu_profile.py`` runs it)

Conditions (what training runs, unlike ``tests/gpu_check.py``'s timing
table, which builds its compressor with ``backend='numpy'`` and
``copy=True`` and keeps every message):

- ``GradientCompressor(..., backend='native')``: the host work of the
  step (validation, the walk of the message) on the native CPU backend;
- ``compress(grads, sqsums, copy=False)``: the message is a view of the
  step's reused host buffer, and it is not kept;
- the gradients one device array per tensor (as Chainer's parameters hold
  them); the sums of squares views of one device array laid end to end,
  as :class:`chainer_vgc.statistics.PerSampleSquares` writes them (read in
  place by the device step: no gather);
- float32, ``--params`` (25M) parameters in ``--tensors`` (35) tensors of
  the VGG-like sizes of ``benchmarks/bench_common.shapes_for``, the
  gradient stream of ``tests/gpu_check.py``'s timings (batch 64, sigma
  1e-2), vgc with alpha 2 and hybrid with alpha 2, tau 0.01
  (``bench_common.HYPERPARAMETERS``), index coding 'fixed' and 'auto'.

Data flow of a measurement:

1. **whole steps**, nothing wrapped: the device synchronized, an event
   recorded, the step called, an event recorded, the device synchronized;
   the events' elapsed time ("device ms") and the wall time between the
   two synchronizations ("wall ms"), medians over the timed steps after
   the warm-up.  Next to them, the same for a device-to-device copy of the
   model's gradient bytes (``dst[...] = src``), and their ratio.
2. **instrumented steps**: :class:`Patches` replaces, for these steps only,
   ``chainer_vgc.backends.cuda.kernels.get_kernel`` (every kernel it returns is wrapped),
   the CuPy calls the steps make (``concatenate``, ``cumsum``,
   ``asarray``, ``ndarray.get``, ``ndarray.fill``, where CuPy lets them be
   replaced) and the host phases (methods of ``GradientCompressor``,
   ``device_compress.DeviceStep``, functions of ``exchange``,
   ``device_decode``, ``codec``, ``backend``), each by a wrapper that asks
   :class:`Profiler` to record an event before and after the call and the
   host's ``time.perf_counter`` around it.  After each step the device is
   synchronized and every call's times are added up by its call path
   (the wrapped calls it is nested in, then its name); a row of the table
   is one path: calls per step, device ms (events), host ms (the call on
   the host: a kernel's launch, a phase's whole host time) and host self
   ms (less the wrapped calls inside it, e.g. a copy loop written inline),
   medians over the steps.  A name that is not there (the code moved on)
   is listed, not an error.
3. **decode+mean**: p = 4, 16, 64 received messages through
   ``exchange_mean.mean_gradients`` (as ``tests/test_launch_counts.py``'s
   ``step_counts`` calls it), the messages drawn each step from a pool of
   messages of different sizes (compress steps of gradients with
   different noise), so that the sizes change from step to step; the host
   validation (the host engine's ``validate``, the step's first part) is
   also timed alone on the same draws, and the rest of the step is the
   whole step less it.
4. **VGG**: the runbook's App. D VGG step (``gpu_runbook.vgg_update``:
   forward, backward with the statistics where the method needs them,
   exchange, update) at one rank, none and vgc, timed as in 1, then one
   instrumented pass each.
5. **pinned**: 200 decode steps with changing sizes; CuPy's pinned pool
   (``cupy.get_default_pinned_memory_pool().n_free_blocks()``), the pinned
   blocks chainer_vgc took (:class:`PinnedTracker`) and the process's
   locked/pinned/resident memory (``/proc/self/status``) at steps 0, 50,
   ..., 200.

``--dry`` stands in for what the fake CuPy has not: CUDA events (host
clock readings), the device synchronization and the pinned pool (none:
counted as 0).  Its times are the CPU's, meaningless as GPU times.
``--budget S`` bounds the measurements (default 150 s on a GPU): a timed
loop stops after the step that passes it (one step at least), a section
that starts past it is skipped and says so.  The sections run in the
order copy, compress (4 cases), VGG, pinned, decode+mean ('auto', then
'fixed'; p = 4, 16, 64): what a short budget cuts is the last.  The
last line is ``RESULT ...`` (the runbook prints it); the exit status is 1
if a section raised.
"""

import argparse
import functools
import os
import sys
import time
import traceback
import types
import weakref

import numpy

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from bench_common import HYPERPARAMETERS  # NOQA: E402 (chainer-free)
from bench_common import shapes_for  # NOQA: E402

#: compress cases: label, method, hyperparameters
COMPRESS_CASES = [
    ('vgc:fixed', 'vgc', dict(HYPERPARAMETERS['vgc'], index_coding='fixed')),
    ('vgc:auto', 'vgc', dict(HYPERPARAMETERS['vgc'], index_coding='auto')),
    ('hybrid:fixed', 'hybrid', dict(HYPERPARAMETERS['hybrid'],
                                    index_coding='fixed')),
    ('hybrid:auto', 'hybrid', dict(HYPERPARAMETERS['hybrid'],
                                   index_coding='auto'))]
#: received messages per decode step
RANKS = (4, 16, 64)
#: the index codings of the decoded (vgc) messages
DECODE_CODINGS = ('fixed', 'auto')
#: noise of the pool's gradients, relative to the stream's: message sizes
#: from about half to about twice the middle one
SPREADS = (0.6, 1.0, 1.5, 0.8, 1.2, 2.0, 0.7, 1.1)
#: decode steps of the pinned-memory section, and where it is read
PINNED_STEPS = 200
PINNED_EVERY = 50
#: on a GPU, and --dry
SETTINGS = {
    'gpu': dict(params=25_000_000, tensors=35, warmup=3, repeat=10,
                decode_repeat=5, pool=6, budget=150.0),
    'dry': dict(params=6000, tensors=9, warmup=1, repeat=3,
                decode_repeat=2, pool=4, budget=120.0)}
#: CuPy's pinned pool rounds a request up to this many bytes
#: (``cupy/cuda/pinned_memory.pyx``: ``_allocation_unit_size``)
PINNED_UNIT = 512


# -- the device's clock -------------------------------------------------------

class _HostEvent(object):
    """--dry's stand-in for ``cupy.cuda.Event``: the host clock when
    recorded (the fake CuPy's work is done when its call returns)."""

    def __init__(self):
        self.at = None

    def record(self, stream=None):
        self.at = time.perf_counter()

    def synchronize(self):
        pass


class Clock(object):
    """Events, their elapsed time and the device's synchronization: CuPy's
    (``cupy.cuda.Event``, ``cupy.cuda.get_elapsed_time``,
    ``cupy.cuda.runtime.deviceSynchronize``), or host stand-ins (dry)."""

    def __init__(self, xp, dry):
        self.xp, self.dry = xp, dry

    def event(self):
        return _HostEvent() if self.dry else self.xp.cuda.Event()

    def elapsed_ms(self, start, end):
        if self.dry:
            return 1e3 * (end.at - start.at)
        return float(self.xp.cuda.get_elapsed_time(start, end))

    def sync(self):
        if not self.dry:
            self.xp.cuda.runtime.deviceSynchronize()

    def pinned_pool(self):
        """CuPy's default pinned memory pool (None: the fake has none)."""
        if self.dry:
            return None
        return self.xp.get_default_pinned_memory_pool()


# -- recording wrapped calls --------------------------------------------------

class Profiler(object):
    """The calls of the instrumented steps.  While a step runs
    (:meth:`begin` .. :meth:`end`), :meth:`call` runs each wrapped call
    between two events and two host clock readings, under its call path
    (the labels of the wrapped calls it runs in, then its own); :meth:`end`
    synchronizes, reads the events and adds the step's calls up by path;
    :meth:`rows` gives the medians over the steps."""

    def __init__(self, clock):
        self.clock = clock
        self.active = False
        self._stack = []
        self._calls = []
        self._events = []
        self._next = 0
        #: per step: {path: [kind, calls, host s, device ms, host self s]}
        self.steps = []
        #: path -> (kind, order of first appearance)
        self._paths = {}

    def _event(self):
        if self._next == len(self._events):
            self._events.append(self.clock.event())
        ev = self._events[self._next]
        self._next += 1
        return ev

    def call(self, kind, label, fn, args, kwargs):
        """``fn(*args, **kwargs)``, recorded when a step is running."""
        if not self.active:
            return fn(*args, **kwargs)
        path = tuple(self._stack) + (label,)
        if path not in self._paths:  # rows in the order calls start
            self._paths[path] = (kind, len(self._paths))
        self._stack.append(label)
        start = self._event()
        start.record()
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            host = time.perf_counter() - t
            end = self._event()
            end.record()
            self._stack.pop()
            self._calls.append((path, kind, host, start, end))

    def begin(self):
        self.clock.sync()
        self._calls, self._stack, self._next = [], [], 0
        self.active = True

    def end(self):
        self.active = False
        self.clock.sync()
        step = {}
        for path, kind, host, start, end in self._calls:
            row = step.setdefault(path, [kind, 0, 0.0, 0.0, 0.0])
            row[1] += 1
            row[2] += host
            row[3] += self.clock.elapsed_ms(start, end)
            row[4] += host
        for path, row in step.items():  # host self: less the calls inside
            if len(path) > 1 and path[:-1] in step:
                step[path[:-1]][4] -= row[2]
        self.steps.append(step)

    def rows(self):
        """``[(path, kind, calls, device ms, host ms, host self ms)]``,
        medians over the steps (a path missing from a step counts 0), in
        the order their calls first started (a call before the calls it
        makes)."""
        out = []
        for path, (kind, _) in sorted(self._paths.items(),
                                      key=lambda kv: kv[1][1]):
            per = [s.get(path, [kind, 0, 0.0, 0.0, 0.0]) for s in self.steps]
            out.append((path, kind, float(numpy.median([r[1] for r in per])),
                        float(numpy.median([r[3] for r in per])),
                        1e3 * float(numpy.median([r[2] for r in per])),
                        1e3 * float(numpy.median([r[4] for r in per]))))
        return out


class Patches(object):
    """Attributes replaced for the instrumented steps, and put back.

    :meth:`wrap` replaces ``owner.name`` (a module's function, a class's
    method, static method or a method it inherits, an object's attribute)
    by a wrapper that runs it through :meth:`Profiler.call`;
    :meth:`kernels` wraps every kernel ``chainer_vgc.backends.cuda.kernels.get_kernel``
    returns.  A name that does not exist or cannot be replaced is an
    error for chainer_vgc's and listed in :attr:`missing` for CuPy's (a
    CuPy extension type; :meth:`_cannot`).  Used as a context
    manager."""

    def __init__(self, prof):
        self.prof = prof
        self.saved = []
        self.wrapped = []
        self.missing = []

    def _set(self, owner, name, value):
        own = name in vars(owner)
        old = vars(owner)[name] if own else None
        setattr(owner, name, value)
        self.saved.append((owner, name, own, old))

    def wrap(self, owner, name, label, kind='host'):
        if owner is None:
            raw = None
        elif isinstance(owner, type):
            raw = next((vars(k)[name] for k in owner.__mro__
                        if name in vars(k)), None)
        else:
            raw = vars(owner).get(name, getattr(owner, name, None))
        if raw is None:
            self._cannot(label, kind, 'not found')
            return
        prof = self.prof

        def wrapper_of(fn):
            def wrapper(*args, **kwargs):
                return prof.call(kind, label, fn, args, kwargs)
            try:
                return functools.wraps(fn)(wrapper)
            except (AttributeError, TypeError):
                return wrapper
        if isinstance(raw, staticmethod):
            new = staticmethod(wrapper_of(raw.__func__))
        elif isinstance(raw, classmethod):
            new = classmethod(wrapper_of(raw.__func__))
        else:
            new = wrapper_of(raw)
        try:
            self._set(owner, name, new)
        except (AttributeError, TypeError) as e:  # an extension type
            self._cannot(label, kind, type(e).__name__)
            return
        self.wrapped.append(label)

    def _cannot(self, label, kind, why):
        """A name that cannot be wrapped: CuPy's (``kind='cupy'``: NumPy
        in a dry run has no ``ndarray.get``, a real CuPy's ndarray is an
        extension type) is listed in :attr:`missing`; one of chainer_vgc's
        is an error, since the profile would then time less than it says
        (a function renamed or removed: mend the tables here)."""
        if kind == 'cupy':
            self.missing.append('{} ({})'.format(label, why))
            return
        raise AttributeError(
            'gpu_profile: cannot wrap {} ({}): the profile names a '
            'function of chainer_vgc that is not there or not replaceable; '
            'mend its table in benchmarks/gpu_profile.py'.format(label, why))

    def kernels(self, kernels_module):
        """Every kernel that ``get_kernel`` returns, wrapped (kind
        'kernel', labelled by its name)."""
        get_kernel, prof, cache = kernels_module.get_kernel, self.prof, {}

        def timed_get_kernel(name):
            timed = cache.get(name)
            if timed is None:
                kernel = get_kernel(name)

                def timed(*args, **kwargs):
                    return prof.call('kernel', name, kernel, args, kwargs)
                cache[name] = timed
            return timed
        self._set(kernels_module, 'get_kernel', timed_get_kernel)
        self.wrapped.append('kernels.get_kernel')

    def restore(self):
        for owner, name, own, old in reversed(self.saved):
            if own:
                setattr(owner, name, old)
            else:
                delattr(owner, name)
        self.saved = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.restore()


def exchange_patches(ctx, patches):
    """What a compress or a decode step calls: the kernels, CuPy's
    functions, the host phases."""
    from chainer_vgc import codec
    from chainer_vgc.backends import arrays
    from chainer_vgc.engines.cuda import decode as device_decode
    from chainer_vgc.engines.cuda import compress as device_compress
    from chainer_vgc.engines.cuda import engine as cuda_engine
    from chainer_vgc.engines.native import engine as native_engine
    from chainer_vgc.exchange import mean as exchange_mean
    from chainer_vgc.backends.cuda import kernels
    from chainer_vgc.compressor import GradientCompressor
    xp = ctx.xp
    patches.kernels(kernels)
    patches.wrap(sys.modules[__name__], 'mpi_receive',
                 'MPI receive (emulated: the copy into the upload buffer)')
    for name in ('concatenate', 'cumsum', 'asarray'):
        patches.wrap(xp, name, 'cupy.' + name, 'cupy')
    for name in ('get', 'fill'):
        patches.wrap(xp.ndarray, name, 'ndarray.' + name, 'cupy')
    step = getattr(device_compress, 'DeviceStep', None)
    for owner, name, label in [
            (GradientCompressor, 'compress', 'GradientCompressor.compress'),
            (cuda_engine.CudaEngine, 'compress', 'CudaEngine.compress'),
            (device_compress, 'step_for', 'device_compress.step_for'),
            (step, 'compress', 'DeviceStep.compress'),
            (GradientCompressor, 'validate', 'GradientCompressor.validate'),
            (step, '_install', 'DeviceStep._install'),
            (step, '_passes', 'DeviceStep._passes'),
            (step, '_arena', 'DeviceStep._arena'),
            (step, '_gap_passes', 'DeviceStep._gap_passes'),
            (step, '_download', 'DeviceStep._download'),
            (GradientCompressor, 'settle', 'GradientCompressor.settle'),
            (step, '_commit', 'DeviceStep._commit'),
            (codec, 'message_count', 'codec.message_count'),
            (GradientCompressor, '_merge_spans',
             'GradientCompressor._merge_spans'),
            (codec, 'merge_spans', 'codec.merge_spans'),
            (exchange_mean, 'mean_gradients', 'exchange_mean.mean_gradients'),
            (cuda_engine.CudaEngine, 'mean', 'CudaEngine.mean'),
            (native_engine.NativeEngine, 'validate',
             'NativeEngine.validate (host validation)'),
            (device_decode, 'applies', 'device_decode.applies'),
            (device_decode, 'mean', 'device_decode.mean'),
            (device_decode, 'group_rows', 'device_decode.group_rows'),
            (device_decode, '_descriptors', 'device_decode._descriptors'),
            (device_decode, '_gap_groups', 'device_decode._gap_groups'),
            (device_decode, '_mean_by_lookup',
             'device_decode._mean_by_lookup'),
            (device_decode, '_mean_by_scatter',
             'device_decode._mean_by_scatter'),
            (device_decode, '_items', 'device_decode._items'),
            (device_decode, '_dtype_groups', 'device_decode._dtype_groups'),
            (arrays.HostStaging, 'view', 'HostStaging.view'),
            (arrays, 'host_buffer', 'arrays.host_buffer'),
            (cuda_engine, 'upload_blocks', 'cuda_engine.upload_blocks'),
            (codec, 'expand_gap', 'codec.expand_gap')]:
        patches.wrap(owner, name, label)


def vgg_patches(ctx, patches):
    """The exchange's, and the parts of a training step around it."""
    import chainer
    from chainer_vgc.chainermn.communicator import VGCCommunicator
    from chainer_vgc.chainermn.multi_node_optimizer import \
        VGCMultiNodeOptimizer
    from chainer_vgc.statistics import PerSampleSquares
    for owner, name, label in [
            (VGCMultiNodeOptimizer, 'update', 'VGCMultiNodeOptimizer.update'),
            (VGCMultiNodeOptimizer, '_loss_backward',
             'VGCMultiNodeOptimizer._loss_backward (forward + backward)'),
            (PerSampleSquares, 'backward', 'PerSampleSquares.backward'),
            (VGCCommunicator, 'exchange', 'VGCCommunicator.exchange'),
            (chainer.optimizer.GradientMethod, 'update',
             'GradientMethod.update')]:
        patches.wrap(owner, name, label)
    statistics_patches(patches)
    exchange_patches(ctx, patches)


def statistics_patches(patches):
    """The statistics' phases inside ``PerSampleSquares.backward``: the
    hook's per-function work, the uses it builds, the contraction (Gram or
    blocked), im2col and the square sums, each where the caller looks it
    up (a name imported into ``hook``, ``handlers`` or ``normalizations``
    is wrapped there)."""
    from chainer_vgc.statistics import contraction
    from chainer_vgc.statistics import handlers
    from chainer_vgc.statistics import hook
    from chainer_vgc.statistics import im2col
    from chainer_vgc.statistics import normalizations
    from chainer_vgc.statistics import uses
    for owner, name, label in [
            (hook.PerSampleSquares, 'backward_postprocess',
             'PerSampleSquares.backward_postprocess'),
            (hook, '_uses_of', 'statistics._uses_of'),
            (hook, '_combined_sqsum', 'statistics._combined_sqsum'),
            (contraction, 'sum_squared_products',
             'contraction.sum_squared_products'),
            (contraction, '_gram_into', 'contraction._gram_into'),
            (contraction, '_blocked_into', 'contraction._blocked_into'),
            (contraction, 'sum_squares', 'contraction.sum_squares'),
            (handlers, 'im2col', 'handlers.im2col'),
            (uses, '_sum_over', 'uses._sum_over'),
            (normalizations, '_sum_over', 'normalizations._sum_over'),
            (im2col.ColumnCapture, 'take', 'ColumnCapture.take')]:
        patches.wrap(owner, name, label)


# -- pinned memory ------------------------------------------------------------

class PinnedTracker(object):
    """The pinned buffers chainer_vgc takes (``backend.cupyx.empty_pinned``,
    which ``backend.host_buffer`` calls), seen as blocks of CuPy's pinned
    pool: a block is (address, size rounded up to :data:`PINNED_UNIT`).
    CuPy's pool keeps every block it made and hands a freed one out again
    only for the same rounded size, so on a GPU the distinct blocks seen
    are what the pool holds for chainer_vgc (on the fake, freed memory's
    addresses come back: meaningless)."""

    def __init__(self, backend_module):
        self.calls = 0
        self.requested = 0
        self.blocks = set()
        self.live = 0
        self._saved = None
        cupyx = getattr(backend_module, 'cupyx', None)
        if cupyx is None or getattr(cupyx, 'empty_pinned', None) is None:
            return
        self._owner = cupyx
        own = 'empty_pinned' in vars(cupyx)
        self._saved = (own, vars(cupyx).get('empty_pinned'))
        take = cupyx.empty_pinned

        def empty_pinned(*args, **kwargs):
            a = take(*args, **kwargs)
            self._seen(a)
            return a
        cupyx.empty_pinned = empty_pinned

    def _seen(self, a):
        size = -(-a.nbytes // PINNED_UNIT) * PINNED_UNIT
        self.calls += 1
        self.requested += a.nbytes
        self.blocks.add((a.__array_interface__['data'][0], size))
        self.live += 1
        weakref.finalize(a, self._freed)

    def _freed(self):
        self.live -= 1

    def held_bytes(self):
        return sum(size for _, size in self.blocks)

    def restore(self):
        if self._saved is not None:
            own, old = self._saved
            if own:
                self._owner.empty_pinned = old
            else:
                del self._owner.empty_pinned
            self._saved = None


def proc_memory():
    """{'VmRSS', 'VmLck', 'VmPin': kB} of this process (what Linux
    reports: memory CUDA pins through its driver need not count as locked
    or pinned there); {} where there is no /proc."""
    out = {}
    try:
        with open('/proc/self/status') as f:
            for line in f:
                key = line.split(':')[0]
                if key in ('VmRSS', 'VmLck', 'VmPin'):
                    out[key] = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return out


# -- inputs -------------------------------------------------------------------

def model_sizes(params, tensors):
    """``tensors`` element counts adding up to ``params``: the VGG-like
    sizes of ``bench_common.shapes_for`` (35 tensors at 25M), scaled when
    another number of tensors is asked for."""
    base = [s for (s,) in shapes_for(25_000_000)]
    sizes = [s for (s,) in shapes_for(params)]
    if not tensors or len(sizes) == tensors:
        return sizes
    weights = [base[k % len(base)] * (1 + k // len(base))
               for k in range(tensors)]
    total = float(sum(weights))
    sizes = [max(1, int(w * params / total)) for w in weights]
    sizes[sizes.index(max(sizes))] += params - sum(sizes)
    return sizes


class Inputs(object):
    """The device inputs of a compress step: gradients drawn as
    ``tests/gpu_check.py``'s timing stream (mean mu ~ N(0, 2e-4), batch 64,
    sigma 1e-2), a new device array per tensor each draw (as Chainer's
    parameters hold them), and the sums of squares ``(mu**2 + sigma**2) /
    batch`` as views of one device array, end to end (as
    :class:`~chainer_vgc.statistics.PerSampleSquares` writes them).  Draw
    ``k`` takes the noise from offset ``k * SHIFT`` of one noise array,
    scaled by ``spread``: only two arrays of normal draws are made on the
    host."""

    SHIFT = 997
    DRAWS = 64

    def __init__(self, xp, sizes, seed=0):
        rng = numpy.random.default_rng(seed)
        self.xp, self.sizes = xp, sizes
        self.n = n = int(sum(sizes))
        self.bounds = numpy.concatenate([[0], numpy.cumsum(sizes)])
        batch, sigma = 64, 1e-2
        mu = rng.normal(0, 2e-4, n).astype(numpy.float32)
        noise = (rng.standard_normal(n + self.SHIFT * self.DRAWS)
                 * (sigma / batch ** 0.5)).astype(numpy.float32)
        sq = (mu * mu + numpy.float32(sigma ** 2)) / numpy.float32(batch)
        self.mu, self.noise = xp.asarray(mu), xp.asarray(noise)
        self.arena = xp.asarray(sq.astype(numpy.float32))
        #: the sums of squares: views of one device array
        self.sqsums = [self.arena[lo:hi] for lo, hi in
                       zip(self.bounds[:-1], self.bounds[1:])]

    def grads(self, k, spread=1.0):
        """Draw ``k``: one new device array per tensor."""
        at = self.SHIFT * (k % self.DRAWS)
        flat = self.mu + self.noise[at:at + self.n] * numpy.float32(spread)
        return [flat[lo:hi].copy() for lo, hi in
                zip(self.bounds[:-1], self.bounds[1:])]


# -- the report ---------------------------------------------------------------

class Report(object):
    """Lines to stdout and to ``--log``."""

    def __init__(self, path):
        self.log = open(path, 'w') if path else None

    def say(self, text=''):
        print(text, flush=True)
        if self.log:
            self.log.write(text + '\n')
            self.log.flush()

    def table(self, prof):
        """The rows of ``prof`` (see :meth:`Profiler.rows`)."""
        self.say('| call | kind | calls/step | device ms | host ms | '
                 'host self ms |')
        self.say('|---|---|---:|---:|---:|---:|')
        kernels = [0.0, 0.0]
        cupy_calls = [0.0, 0.0]
        for path, kind, calls, dev, host, own in prof.rows():
            self.say('| {}{} | {} | {:g} | {:.4f} | {:.4f} | {:.4f} |'.format(
                '. ' * (len(path) - 1), path[-1], kind, calls, dev, host,
                own))
            for total, k in ((kernels, 'kernel'), (cupy_calls, 'cupy')):
                if kind == k:
                    total[0] += calls
                    total[1] += dev
        self.say('kernels: {:g} launches a step, {:.4f} ms on the device; '
                 'CuPy calls: {:g}, {:.4f} ms'.format(
                     kernels[0], kernels[1], cupy_calls[0], cupy_calls[1]))
        return kernels


# -- the measurements ---------------------------------------------------------

class Context(object):
    """What the sections share: the array module, the clock, the settings,
    the budget's deadline, the report and the results for the RESULT
    line."""

    def __init__(self, args, xp, device_text):
        self.args, self.xp, self.dry = args, xp, args.dry
        self.clock = Clock(xp, args.dry)
        self.device_text = device_text
        self.report = Report(args.log)
        self.deadline = time.monotonic() + args.budget
        self.results = {}
        self.errors = []
        self.missing = set()
        self.inputs = None
        self.copy_ms = None

    def late(self):
        return time.monotonic() > self.deadline

    def timed_steps(self, fn, reps, start=0):
        """``fn(start + k)`` for k < ``reps`` (fewer past the deadline, one
        at least), each between a device synchronization and an event
        recorded before and after it; (device ms, wall ms, steps),
        medians."""
        dev, wall = [], []
        for k in range(reps):
            if k and self.late():
                break
            self.clock.sync()
            a, b = self.clock.event(), self.clock.event()
            a.record()
            t = time.perf_counter()
            fn(start + k)
            b.record()
            self.clock.sync()
            wall.append(1e3 * (time.perf_counter() - t))
            dev.append(self.clock.elapsed_ms(a, b))
        return float(numpy.median(dev)), float(numpy.median(wall)), len(dev)

    def instrumented(self, fn, reps, start, install):
        """``fn(start + k)`` for k < ``reps`` (fewer past the deadline, one
        at least) with the patches ``install(ctx, patches)`` makes; the
        :class:`Profiler` of these steps."""
        prof = Profiler(self.clock)
        with Patches(prof) as patches:
            install(self, patches)
            self.missing.update(patches.missing)
            for k in range(reps):
                if k and self.late():
                    break
                prof.begin()
                try:
                    fn(start + k)
                finally:
                    prof.end()
        return prof

    def section(self, title, fn, *args):
        """Run one section; an exception is reported and counted, and the
        others still run.  Past the deadline, the section is skipped."""
        say = self.report.say
        say()
        say('## ' + title)
        if self.late():
            say('(skipped: the --budget of {:.0f} s is spent)'.format(
                self.args.budget))
            self.errors.append(title + ': skipped')
            return
        try:
            fn(*args)
        except Exception as e:  # reported; the other sections still run
            say('ERROR {}: {}: {}'.format(title, type(e).__name__, e))
            for line in traceback.format_exc().rstrip().splitlines()[-12:]:
                say('    ' + line)
            self.errors.append(title)


def compressor(ctx, method, kw):
    from chainer_vgc import GradientCompressor
    sizes = ctx.inputs.sizes
    return GradientCompressor(method, [str(i) for i in range(len(sizes))],
                              [(s,) for s in sizes],
                              [numpy.float32] * len(sizes),
                              backend='native', **kw)


def measure_copy(ctx):
    """The baseline: a device-to-device copy of the model's gradient
    bytes."""
    xp, a = ctx.xp, ctx.args
    src = ctx.inputs.mu
    dst = xp.empty_like(src)

    def copy(k):
        dst[...] = src
    for _ in range(a.warmup):
        copy(0)
    dev, wall, steps = ctx.timed_steps(copy, a.repeat)
    ctx.copy_ms = dev
    ctx.report.say('device-to-device copy of {:,} bytes (dst[...] = src): '
                   'device {:.4f} ms, wall {:.4f} ms ({:.0f} GB/s read + '
                   'write by the events), median of {}'.format(
                       src.nbytes, dev, wall,
                       2 * src.nbytes / max(dev, 1e-9) / 1e6, steps))


def profile_compress(ctx, label, method, kw):
    a, say, inputs = ctx.args, ctx.report.say, ctx.inputs
    comp = compressor(ctx, method, kw)
    draws = [inputs.grads(k) for k in range(4)]
    sq = inputs.sqsums

    def step(k):
        comp.compress(draws[k % 4], sq, copy=False)
    t = time.perf_counter()
    step(0)
    ctx.clock.sync()
    first = time.perf_counter() - t
    on_device = comp.device_engine.step is not None
    for k in range(a.warmup):
        step(k + 1)
    dev, wall, steps = ctx.timed_steps(step, a.repeat)
    density = comp.last_sent / float(inputs.n)
    say('whole step ({} steps after {} of warm-up, nothing wrapped): device '
        '{:.4f} ms, wall {:.4f} ms = {:.1f}x the copy (device); first step '
        '{:.2f} s; density {:.2%}, {:,} message bytes{}'.format(
            steps, a.warmup, dev, wall, dev / max(ctx.copy_ms, 1e-9), first,
            density, comp.last_bytes, '' if on_device else
            '; NOTE: not the whole-model device step '
            '(device_compress.step_for returned None)'))
    prof = ctx.instrumented(step, a.repeat, 0, exchange_patches)
    ctx.report.table(prof)
    ctx.results['compress ' + label] = dev


def message_pool(ctx, coding, count):
    """``count`` host copies of vgc messages (index coding ``coding``) of
    one compressor's steps on draws of different noise (:data:`SPREADS`),
    so of different sizes."""
    comp = compressor(ctx, 'vgc', dict(HYPERPARAMETERS['vgc'],
                                       index_coding=coding))
    messages = []
    for k in range(count):
        grads = ctx.inputs.grads(16 + k, SPREADS[k % len(SPREADS)])
        messages.append(comp.compress(grads, ctx.inputs.sqsums,
                                      copy=False).copy())
    return messages


def mpi_receive(receiver, params, grads, blocks):
    """What MPI does in training before the decode: the messages copied
    into the buffer the decode uploads from (``transport.allgatherv``'s
    ``into``, from ``exchange_mean.receive_into``); the blocks there (or the
    blocks themselves where the decode takes no such buffer).  Its own row
    in the tables: a copy that the allgatherv makes in training."""
    from chainer_vgc.exchange import mean as exchange_mean
    into = exchange_mean.receive_into(receiver, params, grads, len(blocks))
    if into is None:
        return blocks
    buf = into(sum(int(b.size) for b in blocks))
    out, at = [], 0
    for b in blocks:
        buf[at:at + b.size] = b
        out.append(buf[at:at + b.size])
        at += b.size
    return out


def decode_step(ctx, coding, messages, ranks, seed):
    """``(step, validate, receiver, words)``: ``step(k)`` is the
    decode+mean of ``ranks`` messages drawn from ``messages`` (the draw of
    step k: sizes change from step to step) into device parameters by
    ``receiver``, a new compressor of the same settings (what it keeps
    from step to step starts afresh), as ``tests/test_launch_counts.py``'s
    ``step_counts`` calls ``exchange_mean.mean_gradients``; ``validate(k)`` is
    the host validation of the same draw alone (the host engine's
    ``validate``, which the step runs first);
    ``words[k]``, the draw's words."""
    from chainer_vgc.exchange import mean as exchange_mean
    xp = ctx.xp
    receiver = compressor(ctx, 'vgc', dict(HYPERPARAMETERS['vgc'],
                                           index_coding=coding))
    zeros = [xp.zeros(s, numpy.float32) for s in ctx.inputs.sizes]
    params = [types.SimpleNamespace(array=z, grad=z, dtype=z.dtype,
                                    shape=z.shape, size=z.size, xp=xp)
              for z in zeros]
    rng = numpy.random.default_rng(seed)
    draws = [rng.integers(0, len(messages), ranks) for _ in range(64)]

    def step(k):
        blocks = mpi_receive(receiver, params, zeros,
                             [messages[i] for i in draws[k % len(draws)]])
        exchange_mean.mean_gradients(blocks, receiver, params, zeros, ranks,
                                     True, False)

    def validate(k):  # as the step validates (the device checks codes)
        blocks = [messages[i] for i in draws[k % len(draws)]]
        receiver.engine.validate(blocks, [p.dtype for p in params], True,
                                 codes=False)
    words = [sum(int(messages[i].size) for i in d) for d in draws]
    return step, validate, receiver, words


def profile_decode(ctx, coding, ranks, messages):
    a, say = ctx.args, ctx.report.say
    step, validate, _, words = decode_step(ctx, coding, messages, ranks,
                                           ranks)
    warmup = min(a.warmup, 2)  # (the pinned section compiled the kernels)
    for k in range(warmup):
        step(k)
    dev, wall, steps = ctx.timed_steps(step, a.decode_repeat, warmup)
    _, check, _ = ctx.timed_steps(validate, steps, warmup)
    split = ('of which host validation {:.4f} ms (the host engine\'s '
             'validate alone, the same draws), the rest {:.4f} ms'.format(
                 check, wall - check))
    sizes = [int(m.size) for m in messages]
    say('whole step ({} steps, nothing wrapped): device {:.4f} ms, wall '
        '{:.4f} ms = {:.1f}x the copy (wall / copy device); {}; messages of '
        '{:,}-{:,} words (pool of {}), {:,}-{:,} words a step'.format(
            steps, dev, wall, wall / max(ctx.copy_ms, 1e-9), split,
            min(sizes), max(sizes), len(messages), min(words), max(words)))
    start = warmup + steps
    prof = ctx.instrumented(step, a.decode_repeat, start, exchange_patches)
    ctx.report.table(prof)
    ctx.results['decode {} p={}'.format(coding, ranks)] = wall


def profile_vgg(ctx):
    import gpu_runbook
    say = ctx.report.say
    width, batch, steps = gpu_runbook.VGG_SETTINGS['dry' if ctx.dry
                                                   else 'gpu']
    device = gpu_runbook._device(ctx.dry)
    say('gpu_runbook.vgg_update: App. D VGG, width {}, batch {}, one rank, '
        '{} updates after 2 (the first broadcasts), the device synchronized '
        'before and after each'.format(width, batch, steps))
    say('| method | device ms | wall ms | statistics hook ran |')
    say('|---|---:|---:|---|')
    times, profs = {}, {}
    for method in ('none', 'vgc'):
        update, opt = gpu_runbook.vgg_update(method, device, width, batch)
        update()
        update()
        dev, wall, n = ctx.timed_steps(lambda k: update(), steps)
        times[method] = (dev, wall)
        hooked = opt.communicator.statistics_hook(opt.target) is not None
        say('| vgg {} | {:.4f} | {:.4f} | {} |'.format(
            method, dev, wall, 'yes' if hooked else 'no'))
        profs[method] = ctx.instrumented(lambda k: update(), 2, 0,
                                         vgg_patches)
    ratio = times['vgc'][0] / max(times['none'][0], 1e-9)
    say('vgc / none = {:.2f} (device), {:.2f} (wall)'.format(
        ratio, times['vgc'][1] / max(times['none'][1], 1e-9)))
    for method in ('none', 'vgc'):
        say()
        say('### vgg {}: one update, instrumented (2 updates)'.format(method))
        ctx.report.table(profs[method])
    ctx.results['vgg vgc/none'] = ratio


def profile_pinned(ctx, messages, ranks=4):
    from chainer_vgc.backends import arrays
    say = ctx.report.say
    step, _, receiver, words = decode_step(ctx, 'auto', messages, ranks,
                                           7)
    cupy_pool = ctx.clock.pinned_pool()
    tracker = PinnedTracker(arrays)
    marks = []

    def mark(k):
        mem = proc_memory()
        marks.append((k, cupy_pool.n_free_blocks() if cupy_pool else 0,
                      len(tracker.blocks), tracker.held_bytes(), mem))
    try:
        mark(0)
        for k in range(PINNED_STEPS):
            step(k)
            if (k + 1) % PINNED_EVERY == 0:
                mark(k + 1)
    finally:
        tracker.restore()
    say('| after step | pool n_free_blocks | blocks seen | bytes held '
        '(blocks seen) | VmRSS MiB | VmLck kB | VmPin kB |')
    say('|---:|---:|---:|---:|---:|---:|---:|')
    for k, free, blocks, held, mem in marks:
        say('| {} | {} | {} | {:,} | {} | {} | {} |'.format(
            k, free, blocks, held,
            '{:.1f}'.format(mem['VmRSS'] / 1024.0) if 'VmRSS' in mem else '-',
            mem.get('VmLck', '-'), mem.get('VmPin', '-')))
    first, last = marks[0], marks[-1]
    extra = [getattr(cupy_pool, name)() for name in ('total_bytes',)
             if cupy_pool is not None and hasattr(cupy_pool, name)]
    staging = receiver.device_engine.held('upload')
    if staging is not None:  # chainer_vgc.backends.arrays.HostStaging, if used
        say('the receiver\'s upload staging: {} allocations, {:,} bytes '
            'held'.format(getattr(staging, 'allocations', '?'),
                          getattr(staging, 'capacity', 0)))
    say('pinned after {} decode steps (vgc:auto, p = {}, {:,}-{:,} words a '
        'step): pool n_free_blocks {} -> {}{}{}; chainer_vgc took {} pinned '
        'buffers ({:.1f} MiB requested), {} distinct blocks, {:.1f} MiB '
        'held; VmRSS {}'.format(
            PINNED_STEPS, ranks, min(words), max(words), first[1], last[1],
            ' (pool total_bytes {:,})'.format(extra[0]) if extra else '',
            ' (fake CuPy: no pinned pool, counted 0)' if cupy_pool is None
            else '', tracker.calls, tracker.requested / 2.0 ** 20,
            len(tracker.blocks), tracker.held_bytes() / 2.0 ** 20,
            '{:+.1f} MiB'.format((last[4].get('VmRSS', 0) -
                                  first[4].get('VmRSS', 0)) / 1024.0)
            if 'VmRSS' in last[4] else 'not available'))
    ctx.results['pinned'] = (first[1], last[1], len(tracker.blocks),
                             tracker.held_bytes())


# -- main ---------------------------------------------------------------------

def setup(args):
    """The array module of the device path and a line on the device:
    CuPy, or (dry) the fake CuPy over host-compiled kernels, as
    ``tests/gpu_check.py`` sets them up (chainer_vgc imported first, so
    that it comes from where the interpreter finds it: the runbook's
    venv)."""
    import chainer_vgc  # NOQA: F401 (before gpu_check's import_core)
    sys.path.append(os.path.join(REPO, 'tests'))
    import gpu_check
    core = gpu_check.import_core()
    xp, env = gpu_check.setup_device(argparse.Namespace(
        fake_cupy=args.dry, fake_ftz=False, no_nvrtc_preload=False), core)
    if args.dry:
        return xp, env['device']
    return xp, '{} (compute capability {}), CuPy {}, CUDA runtime {}'.format(
        env.get('device'), env.get('compute_capability'), env.get('cupy'),
        env.get('cuda_runtime'))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--dry', action='store_true',
                   help='no GPU: the fake CuPy, tiny sizes, few steps')
    p.add_argument('--log', default=None, help='a copy of the output')
    p.add_argument('--params', type=int, default=None)
    p.add_argument('--tensors', type=int, default=None)
    p.add_argument('--repeat', type=int, default=None,
                   help='timed compress steps (and of the copy)')
    p.add_argument('--decode-repeat', type=int, default=None)
    p.add_argument('--warmup', type=int, default=None)
    p.add_argument('--pool', type=int, default=None,
                   help='messages of different sizes the decode draws from')
    p.add_argument('--budget', type=float, default=None,
                   help='seconds for the measurements (150 on a GPU)')
    args = p.parse_args(argv)
    for key, value in SETTINGS['dry' if args.dry else 'gpu'].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    started = time.monotonic()
    xp, device_text = setup(args)
    ctx = Context(args, xp, device_text)
    say = ctx.report.say
    sizes = model_sizes(args.params, args.tensors)
    say('# chainer-vgc GPU profile{}'.format(
        ' (DRY: the fake CuPy, times are the CPU\'s, NOT a GPU\'s)'
        if args.dry else ''))
    say('device: ' + device_text)
    say('conditions: GradientCompressor(backend=\'native\'), compress(..., '
        'copy=False), messages not kept; gradients one device array per '
        'tensor, sums of squares views of one device array end to end (as '
        'PerSampleSquares writes them); float32, {:,} parameters in {} '
        'tensors; vgc {}, hybrid {}; warm-up {}, then median of {} steps '
        '(decode: {}); budget {:.0f} s'.format(
            sum(sizes), len(sizes), HYPERPARAMETERS['vgc'],
            HYPERPARAMETERS['hybrid'], args.warmup, args.repeat,
            args.decode_repeat, args.budget))
    say('columns: "whole step": nothing wrapped, device = CUDA events '
        'around the call, wall = host clock between two device '
        'synchronizations; tables: instrumented steps, by call path '
        '(". " = inside the call above), device ms = events before and '
        'after the call (the GPU timeline, idle gaps included), host ms = '
        'the call on the host (a kernel: its launch), host self = less the '
        'wrapped calls inside; medians of per-step sums')
    t = time.perf_counter()
    ctx.inputs = Inputs(xp, sizes)
    say('inputs made in {:.1f} s'.format(time.perf_counter() - t))
    ctx.section('copy baseline', measure_copy, ctx)
    for label, method, kw in COMPRESS_CASES:
        ctx.section('compress {}'.format(label), profile_compress, ctx,
                    label, method, kw)
    ctx.section('App. D VGG step, none against vgc', profile_vgg, ctx)
    pools = {}
    for coding in DECODE_CODINGS:
        try:
            pools[coding] = message_pool(ctx, coding, args.pool)
        except Exception as e:  # reported with the sections it spoils
            say('ERROR message pool {}: {}: {}'.format(coding,
                                                       type(e).__name__, e))
            ctx.errors.append('message pool ' + coding)
    if 'auto' in pools:  # first: the receivers start empty
        ctx.section('pinned memory over {} decode steps'.format(
            PINNED_STEPS), profile_pinned, ctx, pools['auto'])
    for coding in sorted(pools):
        for ranks in RANKS:
            ctx.section('decode+mean vgc:{}, p = {}'.format(coding, ranks),
                        profile_decode, ctx, coding, ranks, pools[coding])
    say()
    if ctx.missing:
        say('not wrapped (CuPy names not found, or not replaceable): ' +
            ', '.join(sorted(ctx.missing)))
    r = ctx.results
    parts = ['compress (device) ' + ', '.join(
        '{} {:.3f} ms'.format(label, r['compress ' + label])
        for label, _, _ in COMPRESS_CASES if 'compress ' + label in r)]
    decodes = ['p={} {:.3f} ms'.format(ranks, r['decode auto p={}'.format(
        ranks)]) for ranks in RANKS if 'decode auto p={}'.format(ranks) in r]
    if decodes:
        parts.append('decode+mean auto (wall) ' + ', '.join(decodes))
    if 'vgg vgc/none' in r:
        parts.append('VGG vgc/none {:.2f}'.format(r['vgg vgc/none']))
    if 'pinned' in r:
        parts.append('pinned: pool free blocks {} -> {}, {} blocks {:.1f} '
                     'MiB held'.format(r['pinned'][0], r['pinned'][1],
                                       r['pinned'][2],
                                       r['pinned'][3] / 2.0 ** 20))
    if ctx.errors:
        parts.append('{} sections failed: {}'.format(
            len(ctx.errors), ', '.join(ctx.errors)))
    say('RESULT {}{} ({:.0f} s)'.format(
        '(DRY) ' if args.dry else '', '; '.join(parts),
        time.monotonic() - started))
    return 1 if ctx.errors else 0


if __name__ == '__main__':
    sys.exit(main())
