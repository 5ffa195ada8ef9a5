#!/usr/bin/env python3
"""chainer-vgc on a real GPU: bit-for-bit checks against recorded NumPy
references, then timings.

Two modes:

``python tests/gpu_check.py record DIR``
    On a machine with the project's environment (either stack, the native
    backend built; Chainer is not needed; ``make gpu-bundle`` records on
    the np2 stack, as the GPU runbook carries it).  Generates deterministic inputs,
    computes the NumPy reference path's outputs (and checks that the native
    backend gives the same), and writes ``DIR/reference.npz`` (inputs, the
    wire messages, the kernels' expected outputs) and ``DIR/cases.json``
    (the cases, the SHA-256 digests of every message, state, decoded sum
    and mean): about 16 MB, 10 s.  Record from the same working tree that
    the GPU machine will run (the reference is this tree's NumPy path).

``python3 tests/gpu_check.py check DIR``
    On the GPU machine (CuPy, no Chainer, no native backend: only the
    chainer-free core is imported; the package ``__init__`` imports neither
    Chainer nor MPI).
    Runs the same cases with CuPy arrays, compares every message, residual
    state, decoded sum and mean and every kernel output bit for bit with
    the reference (NaN-safe bit patterns), prints one PASS/FAIL line per
    check with the first mismatch, then times compress+encode and
    decode+mean of 25M float32 parameters against a device-to-device copy
    (with ``backend='numpy'``, ``copy=True`` and every message kept: not
    training's conditions, which ``benchmarks/gpu_profile.py`` measures).
    Writes ``gpu_check.json`` to ``$OUT`` (else DIR).  Exit status 1 if any
    check failed.

    Where the reference is a digest (sums, means, states: they would not
    fit in the file), the same quantity is also computed on the host with
    the NumPy backend from the same inputs; the device result must have the
    recorded digest, and a mismatch is located against the host result
    (which itself is checked against the digest: the ``host/`` lines, i.e.
    the NumPy reference path under the GPU machine's NumPy).

    Lines: ``kernel/*`` (each kernel and codec entry point on edge values:
    casts, add/scale/divide, pow2 encode/decode, the rules' steps, the
    statistics' square-sum reduction, FMT_GAP bodies), ``host/<case>``,
    ``compress/<case>`` (4 workers x 4 steps of GradientCompressor on
    device gradients, then the states), ``sums/<case>`` (the device
    decoder: validate, expand FMT_GAP, one upload, codec.add_validated),
    ``mean*/<case>`` (exchange.mean_gradients on device parameters: plain,
    dense tree, loss-scale), ``decode_into/<case>`` (the public checked
    decoder with a device message).

Hidden options of ``check``: ``--fake-cupy`` runs the GPU code path on the
CPU (``tests/fake_cupy.py`` arrays, the kernels compiled for the host by
``tests/kernel_harness.py``, as the test suite's ``device`` fixture does):
the plumbing and comparisons without a GPU; ``--small`` times 1M instead of
25M parameters; ``--corrupt`` flips one bit of the expected value of every
comparison: every check must then FAIL (a check that still passes cannot
fail); ``--fake-ftz`` (with ``--fake-cupy``) flushes the kernels' float32
subnormal results to zero, as ``-ftz=true`` would: the subnormal cases must
then FAIL; ``--only REGEX`` runs the matching checks; ``--no-timing``;
``--params N``, ``--repeat N``, ``--warmup N`` (timings);
``--no-nvrtc-preload`` (cuda_support.preload_nvrtc loads nothing, should a
CUDA 12 NVRTC wheel clash with a CUDA 13 CuPy).
"""

import argparse
import hashlib
import importlib
import json
import os
import platform
import re
import sys
import time
import traceback
import types
import warnings

import numpy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(REPO, 'benchmarks'))
from bench_common import shapes_for  # NOQA: E402 (chainer-free)
F16, F32, F64 = 'float16', 'float32', 'float64'
STEPS = 4
WORKERS = 4
FORMAT_VERSION = 1

# ---- the cases --------------------------------------------------------------

#: the compression model: name, shape, dtype, dtype of the per-sample sum
#: of squares, kind of values (see :func:`gen_grad`)
MODEL = [
    ('a', (1,), F32, F64, 'wide'),
    ('b', (7,), F16, F16, 'wide'),
    ('c', (33, 3), F64, F32, 'wide'),
    ('d', (100000,), F32, F32, 'wide'),
    ('e', (257,), F16, F16, 'wide'),
    ('f', (1001,), F64, F16, 'wide'),
    ('g', (0,), F32, F32, 'wide'),
    ('h', (4099,), F32, F32, 'tiny'),
    ('i', (513,), F16, F16, 'tiny'),
    ('j', (65,), F64, F64, 'tiny'),
    ('k', (17, 3), F16, F32, 'edges'),
    ('l', (301,), F32, F32, 'edges'),
]

#: name, method, hyperparameters, extra decode variants.  QSGD: decode only
#: (its GPU random stream differs from the CPU's by design).
CASES = [
    ('vgc_a1_fixed', 'vgc', dict(alpha=1.0, index_coding='fixed'),
     ['rescale']),
    ('vgc_a1_gap', 'vgc', dict(alpha=1.0, index_coding='gap'), []),
    ('vgc_a1_auto', 'vgc', dict(alpha=1.0, index_coding='auto'), []),
    ('vgc_a2_fixed', 'vgc', dict(alpha=2.0, index_coding='fixed'), []),
    ('vgc_a2_gap', 'vgc', dict(alpha=2.0, index_coding='gap'), []),
    ('vgc_a2_auto', 'vgc', dict(alpha=2.0, index_coding='auto'), []),
    ('vgc_a1_keep', 'vgc', dict(alpha=1.0, keep_unrepresentable=True,
                                index_coding='fixed'), []),
    ('vgc_raw', 'vgc', dict(alpha=1.5, quantize=False), ['dense']),
    ('hybrid_auto', 'hybrid', dict(tau=0.05, index_coding='auto'), []),
    ('hybrid_fixed', 'hybrid', dict(tau=0.05, index_coding='fixed'), []),
    ('strom_auto', 'strom', dict(tau=0.05, index_coding='auto'), []),
    ('none', 'none', {}, ['dense', 'rescale']),
    ('qsgd', 'qsgd', dict(bits=2, bucket=64), []),
]
RESCALE = 1024.0
#: the whole-model GPU paths (issue 25: chainer_vgc.engines.cuda.compress and
#: device_decode) run on a model of one dtype: MODEL's tensors and inputs
#: in float32 (cast on the host), these cases
WHOLE_CASES = [
    ('whole_vgc_fixed', 'vgc', dict(alpha=1.0, index_coding='fixed')),
    ('whole_vgc_auto', 'vgc', dict(alpha=1.0, index_coding='auto')),
    ('whole_vgc_keep', 'vgc', dict(alpha=2.0, keep_unrepresentable=True,
                                   index_coding='fixed')),
    ('whole_hybrid_auto', 'hybrid', dict(tau=0.05, index_coding='auto')),
    ('whole_strom_fixed', 'strom', dict(tau=0.05, index_coding='fixed')),
    ('whole_none', 'none', {}),
    # the sums as views of one array (as PerSampleSquares writes them):
    # read in place by the device step
    ('whole_vgc_arena', 'vgc', dict(alpha=1.0, index_coding='auto')),
]


def qsgd_seed(worker):
    return 11 + worker


def for_worker(a, w, sign=True):
    """Worker w's copy of the step's data: rolled (and negated for odd w,
    ``sign``), exact operations done the same way in both modes."""
    flat = numpy.ascontiguousarray(a).reshape(-1)
    if flat.size:
        flat = numpy.roll(flat, w * (flat.size // 4 + 1))
    if sign and w % 2:
        flat = -flat
    return numpy.ascontiguousarray(flat).reshape(a.shape)


def edge_values(dtype, huge=True):
    """Zeros, subnormals, powers of two, mid-points 1.5*2**e and their
    neighbours (as tests/reference.py), both signs."""
    dtype = numpy.dtype(dtype)
    fi = numpy.finfo(dtype)
    vals = [0.0, -0.0, fi.tiny, fi.tiny / 2, fi.tiny / 4, fi.tiny * 0.75]
    if huge:
        vals += [fi.max, fi.max / 2]
    for e in (-20, -3, -1, 0, 1, 2, 5, 10):
        for base in (2.0 ** e, 1.5 * 2.0 ** e):
            b = dtype.type(base)
            vals += [b, numpy.nextafter(b, dtype.type(numpy.inf)),
                     numpy.nextafter(b, dtype.type(0))]
    with numpy.errstate(under='ignore'):
        arr = numpy.array(vals, dtype=dtype)
    return numpy.concatenate([arr, -arr])


def gen_grad(rng, kind, n, dtype):
    """Gradients of one tensor.  'wide': normal values times 2**-k for k in
    {0, 1, 3, 12, 13, 24}, a few subnormal-ish values of the dtype, zeros
    of both signs, ties 1.5*2**e and their neighbours; 'tiny': a whole
    tensor whose squares (float32, float64) or values (float16) are
    subnormal; 'edges': the codec's edge values."""
    dt = numpy.dtype(dtype)
    with numpy.errstate(under='ignore', over='ignore'):
        if kind == 'tiny':
            if dt == numpy.float16:
                x = rng.integers(-1023, 1024, n) * 2.0 ** -24
            elif dt == numpy.float32:
                x = rng.normal(0, 1, n) * 2.0 ** -70
            else:
                x = rng.normal(0, 1, n) * 2.0 ** -530
            return x.astype(dt)
        if kind == 'edges':
            return rng.choice(edge_values(dt, huge=False), n).astype(dt)
        x = rng.normal(0, 1, n) * 2.0 ** -rng.choice(
            [0, 0, 0, 1, 3, 12, 13, 24], n)
        small = {numpy.dtype(numpy.float16): (-15, -20),
                 numpy.dtype(numpy.float32): (-63, -130),
                 numpy.dtype(numpy.float64): (-520, -1030)}[dt]
        for e in small:
            m = rng.random(n) < 0.02
            x[m] = rng.normal(0, 1, int(m.sum())) * 2.0 ** e
        g = x.astype(dt)
        m = rng.random(n) < 0.03
        ties = dt.type(1.5) * (2.0 ** rng.integers(-5, 4, int(m.sum()))
                               ).astype(dt)
        move = rng.integers(0, 3, ties.size)
        ties = numpy.where(move == 1, numpy.nextafter(ties, dt.type(0)),
                           numpy.where(move == 2, numpy.nextafter(
                               ties, dt.type(numpy.inf)), ties))
        g[m] = ties * numpy.where(rng.random(ties.size) < 0.5, -1, 1
                                  ).astype(dt)
        g[rng.random(n) < 0.02] = 0
        g[rng.random(n) < 0.02] = -0.0
        return g


def gen_sqsum(rng, g, sqdt):
    """Per-sample sums of squares >= 0: g**2 times U(0, 5) (a selection
    density of about 1 / (5 alpha) at the first step), zeros, and exact
    ties r**2 == alpha * v of the first step for alpha 1 and 2."""
    sqdt = numpy.dtype(sqdt)
    sdt = numpy.float64 if g.dtype == numpy.float64 else numpy.float32
    n = g.size
    with numpy.errstate(under='ignore', over='ignore'):
        s = (g.astype(numpy.float64) ** 2 * rng.uniform(0, 5, n))
        gs = g.astype(sdt)
        tie = gs * gs
        m1 = rng.random(n) < 0.03
        m2 = rng.random(n) < 0.03
        s[m1] = tie[m1]
        s[m2] = tie[m2] / sdt(2)
        s[rng.random(n) < 0.05] = 0
        s = s.astype(sqdt)
    assert numpy.isfinite(s).all() and (s >= 0).all()
    return s


# ---- importing the chainer-free core ----------------------------------------

#: the chainer-free core: {the name gpu_check uses: module under chainer_vgc}
CORE = {'cuda_support': 'backends.cuda.support', 'arrays': 'backends.arrays',
        'kernels': 'backends.cuda.kernels', 'codec': 'codec',
        'native': 'engines.native.bindings', 'rules': 'rules',
        'compressor': 'compressor', 'exchange': 'exchange.mean',
        'reference': 'engines.reference',
        'cuda_engine': 'engines.cuda.engine',
        'device_compress': 'engines.cuda.compress'}


def import_core(no_nvrtc_preload=False):
    """chainer_vgc's chainer-free modules (the package ``__init__`` imports
    neither Chainer nor MPI), from this tree unless chainer_vgc is already
    imported.  ``no_nvrtc_preload``: cuda_support.preload_nvrtc (which the
    backend calls at import) loads nothing."""
    warnings.filterwarnings('ignore', category=UserWarning,
                            module=r'cupy\._environment')
    if 'chainer_vgc' not in sys.modules:
        sys.path.insert(0, REPO)
    mods = {}
    for name, module in CORE.items():
        mods[name] = importlib.import_module('chainer_vgc.' + module)
        if name == 'cuda_support' and no_nvrtc_preload:
            mods[name].preload_nvrtc = lambda: None
    return types.SimpleNamespace(**mods)


def sdtype(dtype):
    return numpy.dtype(numpy.float64 if numpy.dtype(dtype) == numpy.float64
                       else numpy.float32)


def digest(a):
    a = numpy.ascontiguousarray(a)
    h = hashlib.sha256()
    h.update('{}|{}|'.format(a.dtype.str, a.shape).encode())
    h.update(a.tobytes())
    return h.hexdigest()[:32]


def param(xp, shape, dtype):
    """What exchange.mean_gradients reads of a chainer.Parameter."""
    dtype = numpy.dtype(dtype)
    shape = tuple(int(n) for n in shape)
    array = xp.zeros(shape, dtype=dtype)
    return types.SimpleNamespace(
        array=array, grad=xp.zeros(shape, dtype=dtype), dtype=dtype,
        shape=shape, size=int(numpy.prod(shape, dtype=numpy.int64)), xp=xp)


def model_lists(model):
    names = [m[0] for m in model]
    shapes = [tuple(m[1]) for m in model]
    dtypes = [numpy.dtype(m[2]) for m in model]
    return names, shapes, dtypes


def make_compressor(core, case, model, worker, backend):
    method, kw = case['method'], dict(case['kwargs'])
    if method == 'qsgd':
        kw['seed'] = qsgd_seed(worker)
    names, shapes, dtypes = model_lists(model)
    return core.compressor.GradientCompressor(method, names, shapes, dtypes,
                                              backend=backend, **kw)


def decode_variants(case):
    out = [('mean', dict(dense=False, rescale=None))]
    if 'dense' in case['variants']:
        out.append(('mean_dense', dict(dense=True, rescale=None)))
    if 'rescale' in case['variants']:
        out.append(('mean_rescale', dict(dense=False, rescale=RESCALE)))
    return out


def host_means(core, blocks, comp, model, dense, rescale):
    """exchange.mean_gradients on host parameters (the reference path)."""
    params = [param(numpy, m[1], m[2]) for m in model]
    grads = [p.grad for p in params]
    core.exchange.mean_gradients(blocks, comp, params, grads, len(blocks),
                                 True, dense, rescale=rescale)
    return [numpy.asarray(p.grad) for p in params]


def host_sums(core, blocks, comp, model):
    params = [param(numpy, m[1], m[2]) for m in model]
    return [numpy.asarray(s) for s in core.reference.sum_messages(
        blocks, comp.sizes, params, False)]


# ---- record -----------------------------------------------------------------

def record(args):
    core = import_core()
    os.makedirs(args.dir, exist_ok=True)
    arrays, meta = {}, {'format': FORMAT_VERSION}
    meta['recorded_with'] = {'numpy': numpy.__version__,
                             'python': platform.python_version(),
                             'machine': platform.machine()}
    try:
        import subprocess
        meta['recorded_with']['git_head'] = subprocess.run(
            ['git', 'rev-parse', 'HEAD'], cwd=REPO, capture_output=True,
            text=True).stdout.strip()
        meta['recorded_with']['git_dirty'] = bool(subprocess.run(
            ['git', 'status', '--porcelain', '--untracked-files=no'],
            cwd=REPO, capture_output=True, text=True).stdout.strip())
    except Exception:
        pass
    native_ok = True
    try:
        core.native.load()
    except Exception as e:
        native_ok = False
        print('WARNING: native backend unavailable ({}: {}); the native == '
              'numpy cross-check is skipped'.format(type(e).__name__, e))
    problems = []
    t0 = time.perf_counter()
    record_compression(core, arrays, meta, native_ok, problems)
    record_whole(core, arrays, meta)
    print('compression cases recorded ({:.1f} s)'.format(
        time.perf_counter() - t0))
    t0 = time.perf_counter()
    record_kernels(core, arrays, meta)
    print('kernel cases recorded ({:.1f} s)'.format(time.perf_counter() - t0))
    path = os.path.join(args.dir, 'reference.npz')
    numpy.savez_compressed(path, **arrays)
    with open(path, 'rb') as f:
        meta['reference_sha256'] = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(args.dir, 'cases.json'), 'w') as f:
        json.dump(meta, f, indent=1, sort_keys=True)
    size = os.path.getsize(path)
    print('wrote {} ({:.1f} MB, {} arrays) and cases.json'.format(
        path, size / 1e6, len(arrays)))
    for p in problems:
        print('PROBLEM: ' + p)
    return 1 if problems else 0


def record_compression(core, arrays, meta, native_ok, problems):
    rng = numpy.random.default_rng(20240611)
    model = [[n, list(s), d, sq, kind] for n, s, d, sq, kind in MODEL]
    meta['model'] = model
    meta['steps'], meta['workers'] = STEPS, WORKERS
    meta['rescale'] = RESCALE
    for step in range(STEPS):
        for t, (name, shape, dt, sqdt, kind) in enumerate(MODEL):
            n = int(numpy.prod(shape, dtype=numpy.int64))
            g = gen_grad(rng, kind, n, dt).reshape(shape)
            s = gen_sqsum(rng, g.reshape(-1), sqdt).reshape(shape)
            arrays['in/g/{}/{}'.format(step, t)] = g
            arrays['in/s/{}/{}'.format(step, t)] = s
    inputs = load_inputs(arrays, model)
    cases = []
    for name, method, kw, variants in CASES:
        case = {'name': name, 'method': method, 'kwargs': kw,
                'variants': variants, 'compress': method != 'qsgd'}
        cases.append(case)
        digests = case['digests'] = {}
        comps = [make_compressor(core, case, model, w, 'numpy')
                 for w in range(WORKERS)]
        natives = ([make_compressor(core, case, model, w, 'native')
                    for w in range(WORKERS)] if native_ok else None)
        sent = 0
        for step in range(STEPS):
            blocks = []
            for w in range(WORKERS):
                gs, ss = worker_inputs(inputs, step, w)
                msg = comps[w].compress(gs, ss)
                blocks.append(msg)
                arrays['msg/{}/{}/{}'.format(name, step, w)] = msg
                digests['msg/{}/{}'.format(step, w)] = digest(msg)
                sent += core.codec.message_count(msg)
                if natives is not None:
                    other = natives[w].compress(gs, ss)
                    if not numpy.array_equal(other, msg):
                        problems.append('native != numpy: message of {} '
                                        'step {} worker {}'.format(
                                            name, step, w))
            sums = host_sums(core, blocks, comps[0], model)
            for t, a in enumerate(sums):
                digests['sum/{}/{}'.format(step, t)] = digest(a)
            for vname, kw2 in decode_variants(case):
                means = host_means(core, blocks, comps[0], model, **kw2)
                for t, a in enumerate(means):
                    digests['{}/{}/{}'.format(vname, step, t)] = digest(a)
                if natives is not None:
                    other = host_means(core, blocks, natives[0], model, **kw2)
                    for t, (a, b) in enumerate(zip(means, other)):
                        if digest(a) != digest(b):
                            problems.append('native != numpy: {} of {} step '
                                            '{} tensor {}'.format(
                                                vname, name, step, t))
        for w in range(WORKERS):
            for t, st in enumerate(comps[w].states):
                for key, a in sorted((st or {}).items()):
                    digests['state/{}/{}/{}'.format(w, t, key)] = digest(a)
                    if natives is not None:
                        b = natives[w].states[t][key]
                        if digest(a) != digest(b):
                            problems.append('native != numpy: state {} of '
                                            '{} worker {} tensor {}'.format(
                                                key, name, w, t))
        kinds = sorted({core.codec.FORMATS[g.fmt].name
                        for w in range(WORKERS)
                        for g in core.codec.message.walk(
                            arrays['msg/{}/{}/{}'.format(name, STEPS - 1, w)],
                            None)})
        print('  {:14s} {:9,d} elements sent over {} messages; formats of '
              'the last step: {}'.format(name, sent, STEPS * WORKERS,
                                         ', '.join(kinds)))
    meta['cases'] = cases


def whole_model(model):
    """The float32 model of the whole-model cases."""
    return [[m[0], list(m[1]), F32, F32, m[4]] for m in model]


def whole_inputs(inputs):
    with numpy.errstate(under='ignore', over='ignore'):
        return [([g.astype(F32) for g in gs], [s.astype(F32) for s in ss])
                for gs, ss in inputs]


def whole_results(core, case, xp, meta, arrays):
    """One whole-model case on ``xp`` (numpy: the NumPy path; the device's
    array module: the GPU path): ``(key, label, host array)`` of every
    message, then the means of each step, then the states, in order; on
    the device, Mismatch when the whole-model compress step did not
    run."""
    model = whole_model(meta['model'])
    inputs = whole_inputs(load_inputs(arrays, meta['model']))
    comps = [make_compressor(core, case, model, w, 'numpy')
             for w in range(WORKERS)]
    for step in range(STEPS):
        blocks = []
        for w in range(WORKERS):
            gs, ss = worker_inputs(inputs, step, w)
            sq = [xp.asarray(s) for s in ss]
            if case['name'].endswith('_arena'):
                flat = xp.asarray(numpy.concatenate([s.ravel() for s in ss]))
                ends = numpy.cumsum([0] + [s.size for s in ss])
                sq = [flat[a:b].reshape(s.shape)
                      for a, b, s in zip(ends[:-1], ends[1:], ss)]
                if xp is not numpy and core.device_compress._span(
                        sq, int(ends[-1])) is None:
                    raise Mismatch('the sums in one array were not read '
                                   'in place')
            blocks.append(comps[w].compress([xp.asarray(g) for g in gs],
                                            sq))
            yield ('msg/{}/{}'.format(step, w),
                   'step {} worker {} message'.format(step, w), blocks[-1])
        if xp is not numpy and comps[0].device_engine.step is None:
            raise Mismatch('the whole-model compress step did not run')
        params = [param(xp, m[1], m[2]) for m in model]
        core.exchange.mean_gradients(blocks, comps[0], params,
                                     [p.grad for p in params], len(blocks),
                                     True, case['method'] == 'none')
        for t, p in enumerate(params):
            yield ('mean/{}/{}'.format(step, t),
                   'step {} tensor {} mean'.format(step, t),
                   core.arrays.to_numpy(p.grad))
    for w in range(WORKERS):
        for t, st in enumerate(comps[w].states):
            for key, a in sorted((st or {}).items()):
                yield ('state/{}/{}/{}'.format(w, t, key),
                       'worker {} tensor {} state {}'.format(w, t, key),
                       core.arrays.to_numpy(a))


def record_whole(core, arrays, meta):
    """The whole-model cases on the NumPy path: the digests of the
    messages, the means and the states."""
    meta['whole'] = []
    for name, method, kw in WHOLE_CASES:
        case = {'name': name, 'method': method, 'kwargs': kw}
        case['digests'] = {key: digest(a) for key, _, a in whole_results(
            core, case, numpy, meta, arrays)}
        meta['whole'].append(case)


def check_whole(ctx, ck):
    """The whole-model cases on the device: every message, the states and
    the means, bit for bit the NumPy path's, and the whole-model paths
    taken (not the per-tensor ones)."""
    if 'whole' not in ctx.meta:
        ck.run('whole/', lambda: (_ for _ in ()).throw(Skip(
            'a reference recorded before issue 25 has no whole-model '
            'cases')))
        return
    for case in ctx.meta['whole']:
        ck.run('whole/' + case['name'],
               lambda case=case: check_whole_case(ctx, ck, case))


def check_whole_case(ctx, ck, case):
    for key, label, a in whole_results(ctx.core, case, ctx.xp, ctx.meta,
                                       ctx.ref):
        ck.same_digest(label, a, case['digests'][key])
    return '{} messages, means and the states'.format(STEPS * WORKERS)


def load_inputs(arrays, model):
    """inputs[step] = (grads, sqsums) of worker 0 (host arrays)."""
    out = []
    for step in range(STEPS):
        out.append(([arrays['in/g/{}/{}'.format(step, t)]
                     for t in range(len(model))],
                    [arrays['in/s/{}/{}'.format(step, t)]
                     for t in range(len(model))]))
    return out


def worker_inputs(inputs, step, w):
    gs, ss = inputs[step]
    return ([for_worker(g, w) for g in gs],
            [for_worker(s, w, sign=False) for s in ss])


def record_kernels(core, arrays, meta):
    """Edge-value inputs of every kernel and the NumPy results."""
    rng = numpy.random.default_rng(77)
    codec = core.codec
    checks = []

    def add(kind, name, params, **arrs):
        key = 'k/{}/'.format(name)
        for k, a in arrs.items():
            arrays[key + k] = a
        checks.append({'kind': kind, 'name': name, 'params': params,
                       'arrays': sorted(arrs)})

    specials = {'inf': numpy.inf, 'ninf': -numpy.inf, 'nan': numpy.nan}
    with numpy.errstate(all='ignore'):
        # casts: the device decoder's and the mean's (vgc_cast)
        for src, dst in ((F64, F32), (F32, F64), (F32, F16), (F16, F32),
                         (F64, F16), (F16, F64)):
            sd = numpy.dtype(src)
            x = numpy.concatenate([
                edge_values(sd), numpy.array(list(specials.values()), sd),
                rng.normal(0, 1e-3, 500).astype(sd),
                (rng.normal(0, 1, 200) * 2.0 ** -130).astype(sd),
                (rng.normal(0, 1, 200) * 2.0 ** -20).astype(sd),
                (rng.normal(0, 1, 100) * 6e4).astype(sd)])
            add('cast', 'cast_{}_{}'.format(src, dst), {'dst': dst}, x=x,
                want=x.astype(dst))
        for sdt in (F32, F64):
            dt = numpy.dtype(sdt)
            tiny = numpy.finfo(dt).tiny
            a = numpy.concatenate([edge_values(dt),
                                   rng.normal(0, 1, 300).astype(dt),
                                   (rng.normal(0, 1, 200) * tiny).astype(dt),
                                   numpy.array([numpy.inf, -numpy.inf], dt)])
            b = numpy.roll(a, 7)
            add('add_into', 'add_into_' + sdt, {}, a=a, b=b, want=a + b)
            ks = [0.25, 1 / 3, 1024.0, 3e-39, 0.1, 1 / 4096]
            if dt == numpy.float64:
                ks.append(2.0 ** -1060)
            for j, k in enumerate(ks):
                kk = dt.type(k)
                add('scale', 'scale_{}_{}'.format(sdt, j), {'k': float(k)},
                    x=a, want=a * kk)
                add('divide', 'divide_{}_{}'.format(sdt, j), {'k': float(k)},
                    x=a, want=a / kk)
        # the codec's word encoding and decoding
        for sdt in (F32, F64):
            dt = numpy.dtype(sdt)
            x = numpy.concatenate([
                edge_values(dt), rng.normal(0, 10, 1000).astype(dt),
                (rng.normal(0, 1, 100) * 2.0 ** -120).astype(dt)])
            index = (numpy.arange(x.size, dtype=numpy.int64) * 7919
                     % (2 ** 28))
            index[-50:] += numpy.int64(2 ** 28) * numpy.arange(
                1, 51, dtype=numpy.int64) ** 3  # beyond 28 bits: masked
            for e_k in (-20, -1, 0, 1, 5, 10, 127, 200, -126, -140):
                words, ok = codec.pow2_encode(x, index, e_k)
                add('pow2_encode', 'pow2_encode_{}_ek{}'.format(sdt, e_k),
                    {'e_k': e_k}, x=x, index=index, words=words, ok=ok)
            words = rng.integers(0, 2 ** 32, 4096, dtype=numpy.uint64
                                 ).astype(numpy.uint32)
            words[:16] = (numpy.arange(16, dtype=numpy.uint32)
                          << numpy.uint32(28)) | numpy.uint32(12345)
            pairs = [(0, 1.0), (5, 1.0), (-130, 1.0), (0, 0.1), (3, 0.37),
                     (-145, 1.0), (120, 1.0)]
            if dt == numpy.float64:
                pairs += [(-1070, 1.0), (-1000, 0.05), (1000, 1.0)]
            for j, (e_k, scale) in enumerate(pairs):
                index_out, value = codec.pow2_decode(words, e_k, scale, dt)
                add('pow2_decode', 'pow2_decode_{}_{}'.format(sdt, j),
                    {'e_k': e_k, 'scale': scale, 'dtype': sdt}, words=words,
                    index=index_out, value=value)
    # the rules' step kernels on edge inputs (several steps)
    for gdt, hdt in ((F16, F16), (F32, F32), (F64, F64), (F32, F64),
                     (F64, F32), (F64, F16)):
        record_rule_steps(core, add, rng, gdt, hdt)
    record_subnormal_steps(core, add)
    record_sum_squares(add, rng)
    record_gap_bodies(codec, add, rng)
    meta['kernel_checks'] = checks


def edge_stream(rng, gdt, hdt, n, steps):
    """Gradients mixing random values with edge values (as
    tests/test_kernels.py), sums of squares with zeros."""
    edges = edge_values(gdt)
    out = []
    with numpy.errstate(over='ignore'):
        for _ in range(steps):
            g = rng.normal(0, 1, n).astype(gdt)
            g[rng.integers(0, n, n // 4)] = rng.choice(edges, n // 4)
            g[:3] = 0
            s = (numpy.abs(rng.normal(0, 1, n)) ** 2).astype(hdt)
            s[rng.integers(0, n, n // 8)] = 0
            out.append((g, s))
    return out


def record_rule_steps(core, add, rng, gdt, hdt, n=501, steps=8):
    rules = core.rules
    stream = edge_stream(rng, gdt, hdt, n, steps)
    gs = numpy.stack([g for g, _ in stream])
    ss = numpy.stack([s for _, s in stream])
    tag = '{}_{}'.format(gdt, hdt)
    with numpy.errstate(all='ignore'):
        sel, rs, vs = _vgc_select_steps(rules.VGC(alpha=1.5, zeta=0.999),
                                        stream, n, gdt)
        add('vgc_select', 'vgc_select_' + tag,
            {'alpha': 1.5, 'zeta': 0.999, 'gdt': gdt}, g=gs, s=ss,
            sel=numpy.stack(sel), r=numpy.stack(rs), v=numpy.stack(vs))
        hyb = rules.Hybrid(tau=0.1, alpha=2.0, zeta=0.99)
        st = hyb.init_state(n, gdt, numpy)
        sign, rs, vs = [], [], []
        for g, s in stream:
            sign.append(hyb.step(g, s, st))
            rs.append(st['r'].copy())
            vs.append(st['v'].copy())
        add('hybrid_step', 'hybrid_step_' + tag,
            {'tau': 0.1, 'alpha': 2.0, 'zeta': 0.99, 'gdt': gdt}, g=gs,
            s=ss, sign=numpy.stack(sign), r=numpy.stack(rs),
            v=numpy.stack(vs))
        if gdt == hdt:
            strom = rules.Strom(tau=0.1)
            st = strom.init_state(n, gdt, numpy)
            sign, rs = [], []
            for g, _ in stream:
                sign.append(strom.step(g, st))
                rs.append(st['r'].copy())
            add('strom_step', 'strom_step_' + gdt, {'tau': 0.1, 'gdt': gdt},
                g=gs, sign=numpy.stack(sign), r=numpy.stack(rs))


def _vgc_select_steps(rule, stream, n, dtype):
    """The selection masks and the r and v after each step of ``rule``'s
    criterion pass over ``stream`` ((g, s) pairs), selected elements reset
    as compress resets them."""
    st = rule.init_state(n, dtype, numpy)
    sel, rs, vs = [], [], []
    for g, s in stream:
        m = rule.select(g, s, st)
        sel.append(m)
        rs.append(st['r'].copy())
        vs.append(st['v'].copy())
        st['r'][m] = 0
        st['v'][m] = 0
    return sel, rs, vs


def record_subnormal_steps(core, add):
    """Subnormal gradients and sums of squares, float32 and float64 state
    (tests/test_kernels.py::test_subnormal_state_...): nothing may flush."""
    rules = core.rules
    for sdt in (F32, F64):
        dt = numpy.dtype(sdt)
        tiny = numpy.finfo(dt).tiny
        with numpy.errstate(under='ignore'):
            g = numpy.array([tiny / 4, -tiny / 2, tiny * 0.75, tiny / 1024,
                             -tiny / 3, tiny * 3], dt)
        s = numpy.abs(g[::-1]).copy()
        gs, ss = numpy.stack([g, g, -g]), numpy.stack([s, s, s])
        with numpy.errstate(all='ignore'):
            sel, rs, vs = _vgc_select_steps(rules.VGC(alpha=1.0, zeta=0.5),
                                            zip(gs, ss), g.size, dt)
            assert (rs[0] != 0).all() and (vs[0] != 0).all()
            add('vgc_select', 'vgc_select_subnormal_' + sdt,
                {'alpha': 1.0, 'zeta': 0.5, 'gdt': sdt}, g=gs, s=ss,
                sel=numpy.stack(sel), r=numpy.stack(rs), v=numpy.stack(vs))
            tau = float(tiny / 8)
            hyb = rules.Hybrid(tau=tau, alpha=1.0, zeta=0.5)
            st = hyb.init_state(g.size, dt, numpy)
            sign, rs, vs = [], [], []
            for gg, s2 in zip(gs, ss):
                sign.append(hyb.step(gg, s2, st))
                rs.append(st['r'].copy())
                vs.append(st['v'].copy())
            add('hybrid_step', 'hybrid_step_subnormal_' + sdt,
                {'tau': tau, 'alpha': 1.0, 'zeta': 0.5, 'gdt': sdt}, g=gs,
                s=ss, sign=numpy.stack(sign), r=numpy.stack(rs),
                v=numpy.stack(vs))
            if sdt == F64:  # float32(tau) is 0 for a float32 tiny / 8
                strom = rules.Strom(tau=tau)
                st = strom.init_state(g.size, dt, numpy)
                sign, rs = [], []
                for gg in gs:
                    sign.append(strom.step(gg, st))
                    rs.append(st['r'].copy())
                add('strom_step', 'strom_step_subnormal_' + sdt,
                    {'tau': tau, 'gdt': sdt}, g=gs, sign=numpy.stack(sign),
                    r=numpy.stack(rs))


def sum_squares_host(g):
    """The statistics' per-sample square sum on the CPU
    (chainer_vgc/statistics/contraction.py, sum_squares)."""
    return numpy.einsum('i...,i...->...', g, g)


def record_sum_squares(add, rng):
    """Exact cases: every partial sum is exact (small integers times powers
    of two), so any order of the additions gives the same bits; the
    squares and sums are subnormal in some.  Random cases: the GPU's
    order differs from NumPy's (docs/gpu.md), checked against an error
    bound."""
    for sdt in (F32, F64):
        dt = numpy.dtype(sdt)
        low = -74 if dt == numpy.float32 else -535  # squares subnormal
        cases = {
            'exact_64rows': ((64, 5, 3), 0),
            'exact_subnormal_64rows': ((64, 5, 3), low),
            'exact_2rows_subnormal': ((2, 7), low),
            'exact_1row': ((1, 4), low),
            'exact_mixed_3rows': ((3, 1000), None),
        }
        for name, (shape, e0) in cases.items():
            k = rng.integers(-15, 16, shape)
            if e0 is None:  # per row a different power of two, normal
                e = rng.integers(-8, 1, (shape[0],) + (1,) * (len(shape) - 1))
            else:
                e = numpy.full((shape[0],) + (1,) * (len(shape) - 1), e0) + \
                    rng.integers(0, 3, (shape[0],) + (1,) *
                                 (len(shape) - 1))
            with numpy.errstate(under='ignore'):
                g = (k * 2.0 ** e).astype(dt)
                want = sum_squares_host(g)
                exact = (g.astype(numpy.float64) ** 2).sum(axis=0)
            if e0 is None or dt == numpy.float32:
                assert (want.astype(numpy.float64) == exact).all(), name
            add('sum_squares', 'sum_squares_{}_{}'.format(sdt, name),
                {'exact': True}, g=g, want=want)
        g = rng.normal(0, 1, (37, 5, 3)).astype(dt)
        g[3] = numpy.finfo(dt).tiny * 2 ** 10
        g[7, 0] = numpy.sqrt(numpy.finfo(dt).tiny) / 4
        with numpy.errstate(under='ignore'):
            add('sum_squares', 'sum_squares_{}_random'.format(sdt),
                {'exact': False}, g=g, want=sum_squares_host(g))


def record_gap_bodies(codec, add, rng):
    """FMT_GAP bodies of a few index sets, huge gaps and escapes included
    (codec.gap_body; on the device it runs codec.gap.device_gap_body)."""
    sets = []
    idx = numpy.sort(rng.choice(10 ** 6, 5000, replace=False))
    sets.append(('sparse', idx, 10 ** 6))
    sets.append(('dense', numpy.arange(1000), 1000))
    sets.append(('one_first', numpy.array([0]), 10))
    sets.append(('one_late', numpy.array([12345]), 20000))
    sets.append(('huge_gaps', numpy.array(
        [0, 1, 2 ** 20, 2 ** 28 + 5, 2 ** 33, 2 ** 33 + 1, 2 ** 40]),
        2 ** 41))
    gaps = numpy.array([0, 15, 16, 17, 31, 32, 1000, 65535, 2 ** 31, 3, 0,
                        2 ** 16 * 17, 5])
    sets.append(('escapes', numpy.cumsum(gaps + 1) - 1, 2 ** 33))
    clustered = numpy.concatenate([numpy.arange(100, 400),
                                   numpy.arange(10 ** 7, 10 ** 7 + 50),
                                   numpy.arange(2 ** 29, 2 ** 29 + 3)])
    sets.append(('clustered', clustered, 2 ** 30))
    for name, index, size in sets:
        index = numpy.asarray(index, dtype=numpy.int64)
        count = int(index.size)
        ks = sorted({codec.rice_parameter(count, size), 0, 3})
        if name in ('huge_gaps', 'escapes'):
            ks += [20, 40, codec.GAP_MAX_K]
        for sign_only in (False, True):
            if sign_only:
                nib = (rng.integers(0, 2, count) * 8).astype(numpy.uint32)
            else:
                nib = rng.integers(0, 16, count).astype(numpy.uint32)
            for k in ks:
                body = codec.gap_body(index, nib, k, sign_only)
                back, nib2 = codec.gap_decode_body(body, count, size)
                assert (back == index).all()
                add('gap_body', 'gap_body_{}_k{}{}'.format(
                    name, k, '_sign' if sign_only else ''),
                    {'k': int(k), 'sign_only': sign_only}, index=index,
                    nibbles=nib, body=body)


# ---- check ------------------------------------------------------------------

class Mismatch(Exception):
    pass


class Skip(Exception):
    pass


_UINT = {1: numpy.uint8, 2: numpy.uint16, 4: numpy.uint32, 8: numpy.uint64}


def _bits(a):
    a = numpy.ascontiguousarray(a)
    if a.dtype == numpy.bool_:
        return a.view(numpy.uint8)
    return a.view(_UINT[a.dtype.itemsize])


def _fmt(a, i):
    v = a.reshape(-1)[i]
    if a.dtype.kind == 'f':
        return '{!r} (0x{:0{}x})'.format(float(v), int(_bits(a).reshape(
            -1)[i]), 2 * a.dtype.itemsize)
    return repr(v.item() if hasattr(v, 'item') else v)


def mismatch_detail(got, want):
    """None if ``got`` and ``want`` have the same dtype, shape and bits
    (NaN == NaN whatever its payload), else what differs first."""
    got, want = numpy.asarray(got), numpy.asarray(want)
    if got.dtype != want.dtype:
        return 'dtype {} != expected {}'.format(got.dtype, want.dtype)
    if got.shape != want.shape:
        return 'shape {} != expected {}'.format(got.shape, want.shape)
    diff = _bits(got).reshape(-1) != _bits(want).reshape(-1)
    if got.dtype.kind == 'f':
        diff &= ~(numpy.isnan(got.reshape(-1)) & numpy.isnan(
            want.reshape(-1)))
    bad = numpy.flatnonzero(diff)
    if bad.size == 0:
        return None
    i = int(bad[0])
    where = (tuple(int(j) for j in numpy.unravel_index(i, got.shape))
             if got.ndim > 1 else i)
    return '{} of {} elements differ; first at {}: got {}, expected {}'.format(
        bad.size, got.size, where, _fmt(got, i), _fmt(want, i))


class Checker(object):
    """Runs checks, prints one line each, keeps the results."""

    def __init__(self, only=None, corrupt=False):
        self.only = re.compile(only) if only else None
        self.corrupt = corrupt
        self.results = []
        self.errors_shown = 0

    def wanted(self, name):
        return self.only is None or bool(self.only.search(name))

    def run(self, name, fn, category='device'):
        if not self.wanted(name):
            return
        t0 = time.perf_counter()
        try:
            note = fn()
        except Mismatch as e:
            status, detail = 'FAIL', str(e)
        except Skip as e:
            status, detail = 'SKIP', str(e)
        except Exception as e:
            if self.errors_shown < 3:  # the whole story of the first few
                self.errors_shown += 1
                traceback.print_exc(file=sys.stdout)
            tb = traceback.extract_tb(e.__traceback__)[-3:]
            where = '; '.join('{}:{} {}'.format(os.path.basename(f.filename),
                                                f.lineno, f.name) for f in tb)
            status, detail = 'FAIL', 'error {}: {} [{}]'.format(
                type(e).__name__, str(e)[:400], where)
        else:
            status, detail = 'PASS', note or ''
        dt = time.perf_counter() - t0
        self.results.append({'name': name, 'category': category,
                             'status': status, 'detail': detail,
                             'seconds': round(dt, 3)})
        print('{} {}{}  ({:.1f} s)'.format(status, name,
                                           ': ' + detail if detail else '',
                                           dt), flush=True)

    def _spoil(self, want):
        """--corrupt: ``want`` with one bit of its first element flipped."""
        want = numpy.array(want, copy=True)
        if want.size == 0:
            return want
        flat = want.reshape(-1)
        if want.dtype == numpy.bool_:
            flat[0] = not flat[0]
        else:
            b = _bits(flat)
            b[0] ^= b.dtype.type(1) << b.dtype.type(8 * b.itemsize - 2)
        return want

    def equal(self, label, got, want):
        if self.corrupt:
            want = self._spoil(want)
        detail = mismatch_detail(got, want)
        if detail is not None:
            raise Mismatch('{}: {}'.format(label, detail))

    def same_digest(self, label, got, want_digest, host=None):
        """``got`` must have the recorded digest; a mismatch is located
        against ``host`` (the host reference computed here) when given."""
        if self.corrupt:
            want_digest = ('0' if want_digest[0] != '0' else '1') + \
                want_digest[1:]
        d = digest(got)
        if d == want_digest:
            return
        msg = '{}: digest {} != recorded {}'.format(label, d, want_digest)
        if host is not None:
            where = mismatch_detail(got, host)
            host_ok = digest(host) == want_digest
            msg += '; against the host result ({} the recorded digest): {}'\
                .format('which has' if host_ok else 'which does NOT have',
                        where or 'equal')
        raise Mismatch(msg)

    def message(self, label, got, want, codec):
        if not isinstance(got, numpy.ndarray):
            raise Mismatch('{}: the message is a {}, not a host NumPy '
                           'array'.format(label, type(got).__name__))
        if self.corrupt:
            want = self._spoil(want)
        if got.dtype == want.dtype and got.shape == want.shape and \
                numpy.array_equal(got, want):
            return
        n = min(got.size, want.size)
        diff = numpy.flatnonzero(got[:n] != want[:n])
        pos = int(diff[0]) if diff.size else n
        raise Mismatch('{}: {} words, expected {}; first difference at word '
                       '{} ({}): got {}, expected {}'.format(
                           label, got.size, want.size, pos,
                           locate_word(codec, want, pos),
                           hex(int(got[pos])) if pos < got.size else '-',
                           hex(int(want[pos])) if pos < want.size else '-'))

    def failed(self):
        return [r for r in self.results if r['status'] == 'FAIL']


def locate_word(codec, msg, pos):
    """Which part of message ``msg`` word ``pos`` belongs to."""
    if pos < 2:
        return 'message header'
    try:
        p = 2
        for g in codec.message.walk(msg, None):
            if pos < p + codec.HEADER_WORDS:
                return 'header of the group of tensor {}'.format(g.tensor_id)
            p += codec.HEADER_WORDS
            if pos < p + g.body.size:
                return 'body word {} of the group of tensor {} (format {}, ' \
                       '{} elements)'.format(pos - p, g.tensor_id,
                                             codec.FORMATS[g.fmt].name,
                                             g.count)
            p += g.body.size
    except Exception as e:
        return 'unparsable reference ({})'.format(e)
    return 'past the end'


class Context(object):
    pass


def setup_device(args, core):
    """The array module of the device path: real CuPy (with the version
    check replaced by a recorder when CuPy is outside the pinned major), or
    the fake CuPy over host-compiled kernels (--fake-cupy)."""
    env = {}
    if args.fake_cupy:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import fake_cupy
        import kernel_harness
        fake = fake_cupy.FakeCupy()
        core.arrays.cupy = fake
        core.arrays.cupyx = fake.x
        host = kernel_harness.HostKernels()
        kernels = core.kernels

        def get_kernel(name):  # as tests/conftest.py's device fixture
            if name in kernels.REDUCTION_SPECS:
                def reduce(x, axis=None):
                    assert axis == 0, 'the harness reduces axis 0 only'
                    out = host.reduce_axis0(name, x._a)
                    if args.fake_ftz:
                        flush_f32(out)
                    return fake_cupy.DeviceArray(fake, out)
                return reduce

            def launch(*a):
                hosts, shape = [], ()
                for x in a:
                    if isinstance(x, fake_cupy.DeviceArray):
                        fake._check_device(x)
                        assert x._a.flags.c_contiguous
                        hosts.append(x._a.reshape(-1))
                        shape = x.shape
                    else:
                        fake_cupy._reject_host(x)
                        hosts.append(x)
                outs = host(name, *hosts)
                if args.fake_ftz:
                    for o in outs:
                        flush_f32(o)
                n_in = len(kernel_harness.parse_params(
                    kernels.SPECS[name].in_params))
                given = a[n_in:]
                return tuple(given[k] if k < len(given) else
                             fake_cupy.DeviceArray(fake, o.reshape(shape))
                             for k, o in enumerate(outs))
            return launch
        kernels.get_kernel = get_kernel
        env['device'] = 'fake CuPy (tests/fake_cupy.py) with host-compiled ' \
                        'kernels{}: NOT a GPU'.format(
                            ', float32 subnormal results FLUSHED (--fake-ftz)'
                            if args.fake_ftz else '')
        return fake, env
    import cupy
    if core.arrays.cupy is not cupy:
        raise SystemExit('chainer_vgc.backends.arrays did not import CuPy (its '
                         'import failed there); cannot run the GPU path')
    env['cupy'] = cupy.__version__
    try:  # a device, memory and copies at all (no kernel compiled yet)
        probe = numpy.arange(8, dtype=numpy.float32)
        if not numpy.array_equal(cupy.asarray(probe).get(), probe):
            raise RuntimeError('a host-device round trip changed the data')
    except Exception as e:
        raise SystemExit('no usable GPU through CuPy {}: {}: {}'.format(
            cupy.__version__, type(e).__name__, e))
    try:
        core.cuda_support.check_cupy(cupy)
        env['cupy_pinned_pairing'] = True
    except RuntimeError as e:
        seen = []

        def check_cupy(module):
            version = core.cuda_support.parse_version(module.__version__)
            seen.append(version)
            return version
        core.cuda_support.check_cupy = check_cupy
        env['cupy_pinned_pairing'] = False
        env['check_cupy_refused'] = str(e)
        print('NOTE: running under CuPy {}, OUTSIDE the pinned pairing (CuPy '
              '{}); chainer_vgc.backends.cuda.support.check_cupy replaced by a '
              'recorder for this run'.format(
                  cupy.__version__, core.cuda_support.supported_range()))
    try:
        props = cupy.cuda.runtime.getDeviceProperties(
            cupy.cuda.Device().id)
        name = props['name']
        env['device'] = name.decode() if isinstance(name, bytes) else name
        env['compute_capability'] = '{}.{}'.format(props['major'],
                                                   props['minor'])
        env['cuda_runtime'] = cupy.cuda.runtime.runtimeGetVersion()
        env['cuda_driver'] = cupy.cuda.runtime.driverGetVersion()
    except Exception as e:
        env['device'] = 'unknown ({})'.format(e)
    env['nvrtc_preloaded'] = core.cuda_support.preload_nvrtc()
    print('cuda_support.preload_nvrtc() loaded: {}{}'.format(
        env['nvrtc_preloaded'], ' (--no-nvrtc-preload)'
        if args.no_nvrtc_preload else ''))
    if (env['nvrtc_preloaded'] and '.so.12' in env['nvrtc_preloaded']
            and int(env.get('cuda_runtime') or 0) >= 13000):
        print('NOTE: a CUDA 12 NVRTC was preloaded (RTLD_GLOBAL) into a '
              'CUDA {} CuPy; if kernel compilation fails, run again with '
              '--no-nvrtc-preload'.format(env['cuda_runtime']))
    return cupy, env


def nvrtc_report(env):
    """Which NVRTC libraries the process has loaded, and the version CuPy's
    NVRTC binding reports (after the kernels were compiled)."""
    try:
        with open('/proc/self/maps') as f:
            env['nvrtc_loaded'] = sorted({line.split()[-1] for line in f
                                          if 'nvrtc' in line.split()[-1]})
    except Exception as e:
        env['nvrtc_loaded'] = 'unknown ({})'.format(e)
    try:
        from cupy_backends.cuda.libs import nvrtc
        env['nvrtc_version'] = nvrtc.getVersion()
    except Exception as e:
        env['nvrtc_version'] = 'unknown ({}: {})'.format(type(e).__name__, e)
    print('NVRTC libraries loaded: {}; CuPy NVRTC version {}'.format(
        env['nvrtc_loaded'], env['nvrtc_version']))


def flush_f32(a):
    """--fake-ftz: float32 subnormal results flushed to (signed) zero in
    place, as a kernel compiled with -ftz=true would leave them."""
    if isinstance(a, numpy.ndarray) and a.dtype == numpy.float32:
        tiny = numpy.finfo(numpy.float32).tiny
        m = (a != 0) & (numpy.abs(a) < tiny)
        a[m] = numpy.copysign(numpy.float32(0), a[m])


def sync(ctx):
    if not ctx.fake:
        ctx.xp.cuda.runtime.deviceSynchronize()


def check(args):
    core = import_core(args.no_nvrtc_preload)
    ctx = Context()
    ctx.core, ctx.args, ctx.fake = core, args, args.fake_cupy
    with open(os.path.join(args.dir, 'cases.json')) as f:
        ctx.meta = json.load(f)
    if ctx.meta.get('format') != FORMAT_VERSION:
        raise SystemExit('cases.json is of format {}, this script reads {}: '
                         'record again'.format(ctx.meta.get('format'),
                                               FORMAT_VERSION))
    path = os.path.join(args.dir, 'reference.npz')
    with open(path, 'rb') as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    if sha != ctx.meta.get('reference_sha256'):
        print('WARNING: reference.npz does not have the SHA-256 recorded in '
              'cases.json (modified after recording?)')
    with numpy.load(path, allow_pickle=False) as z:
        ctx.ref = {k: z[k] for k in z.files}
    ctx.xp, env = setup_device(args, core)
    env.update(numpy=numpy.__version__, python=platform.python_version(),
               recorded_with=ctx.meta.get('recorded_with'))
    launched = set()
    inner = core.kernels.get_kernel

    def get_kernel(name):
        launched.add(name)
        return inner(name)
    core.kernels.get_kernel = get_kernel
    print('device: {}'.format(env.get('device')))
    print('numpy {}, python {}; reference recorded with {}'.format(
        numpy.__version__, platform.python_version(),
        ctx.meta.get('recorded_with')))
    if 'chainer' in sys.modules:
        print('NOTE: chainer is imported in this process')
    ck = Checker(args.only, args.corrupt)
    t_start = time.perf_counter()
    check_kernels(ctx, ck)
    t_kern = time.perf_counter()
    check_compression(ctx, ck)
    check_whole(ctx, ck)
    t_comp = time.perf_counter()
    if not ctx.fake:
        nvrtc_report(env)
    all_kernels = (set(core.kernels.SPECS) |
                   set(core.kernels.REDUCTION_SPECS))
    never = sorted(all_kernels - launched)
    if never:
        print('NOTE: kernels of kernels.SPECS/REDUCTION_SPECS never launched '
              'by these checks: {}'.format(', '.join(never)))
    timings = {}
    if not args.no_timing and not args.corrupt:
        try:
            timings = run_timings(ctx)
        except Exception as e:
            traceback.print_exc()
            timings = {'error': '{}: {}'.format(type(e).__name__, e)}
    t_end = time.perf_counter()
    failed = ck.failed()
    counts = {s: sum(r['status'] == s for r in ck.results)
              for s in ('PASS', 'FAIL', 'SKIP')}
    print()
    print('summary: {PASS} passed, {FAIL} failed, {SKIP} skipped; kernel '
          'checks {0:.0f} s, compression checks {1:.0f} s, timings {2:.0f} '
          's'.format(t_kern - t_start, t_comp - t_kern, t_end - t_comp,
                     **counts))
    for r in failed:
        print('  FAILED: {} [{}]'.format(r['name'], r['category']))
    result = {'environment': env, 'checks': ck.results, 'counts': counts,
              'kernels_launched': sorted(launched),
              'kernels_never_launched': never, 'timings': timings,
              'corrupt': args.corrupt,
              'seconds': {'kernels': t_kern - t_start,
                          'compression': t_comp - t_kern,
                          'timings': t_end - t_comp}}
    out_dir = os.environ.get('OUT') or args.dir
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, 'gpu_check.json')
    with open(out, 'w') as f:
        json.dump(result, f, indent=1, default=str)
    print('wrote ' + out)
    if args.corrupt:
        passed = [r['name'] for r in ck.results if r['status'] == 'PASS']
        print('--corrupt: {} checks still PASS with a corrupted reference{}'
              .format(len(passed), ': ' + ', '.join(passed) if passed else
                      ' (good: every check can fail)'))
        return 1 if passed else 0
    return 1 if failed else 0


# ---- check: kernels ---------------------------------------------------------

def check_kernels(ctx, ck):
    core, xp, ref = ctx.core, ctx.xp, ctx.ref
    codec, kernels, to_numpy = core.codec, core.kernels, core.arrays.to_numpy
    has_gap = hasattr(codec, 'device_gap_body')
    for spec in ctx.meta['kernel_checks']:
        name, kind, p = spec['name'], spec['kind'], spec['params']
        arr = {k: ref['k/{}/{}'.format(name, k)] for k in spec['arrays']}

        def run(name=name, kind=kind, p=p, arr=arr):
            if kind == 'cast':
                got = kernels.cast(xp.asarray(arr['x']), p['dst'])
                ck.equal('cast', to_numpy(got), arr['want'])
            elif kind == 'add_into':
                acc = xp.asarray(arr['a'])
                kernels.add_into(acc, xp.asarray(arr['b']))
                ck.equal('acc', to_numpy(acc), arr['want'])
            elif kind in ('scale', 'divide'):
                fn = kernels.scale if kind == 'scale' else kernels.divide
                got = fn(xp.asarray(arr['x']), p['k'])
                ck.equal(kind, to_numpy(got), arr['want'])
            elif kind == 'pow2_encode':
                words, ok = codec.pow2_encode(xp.asarray(arr['x']),
                                              xp.asarray(arr['index']),
                                              p['e_k'])
                ck.equal('ok', to_numpy(ok), arr['ok'])
                ck.equal('words', to_numpy(words), arr['words'])
            elif kind == 'pow2_decode':
                index, value = codec.pow2_decode(xp.asarray(arr['words']),
                                                 p['e_k'], p['scale'],
                                                 p['dtype'])
                ck.equal('index', to_numpy(index), arr['index'])
                ck.equal('value', to_numpy(value), arr['value'])
            elif kind in ('vgc_select', 'hybrid_step', 'strom_step'):
                check_rule_steps(ctx, ck, kind, p, arr)
            elif kind == 'sum_squares':
                return check_sum_squares(ctx, ck, p, arr)
            elif kind == 'gap_body':
                if not has_gap:
                    raise Skip('chainer_vgc.codec has no device_gap_body: '
                               'no device FMT_GAP encoder to check')
                body = codec.gap_body(xp.asarray(arr['index']),
                                      xp.asarray(arr['nibbles']), p['k'],
                                      p['sign_only'])
                ck.equal('body', numpy.asarray(to_numpy(body)), arr['body'])
            else:
                raise Skip('unknown kind ' + kind)
        ck.run('kernel/' + name, run, category='kernel')


def check_rule_steps(ctx, ck, kind, p, arr):
    core, xp = ctx.core, ctx.xp
    to_numpy = core.arrays.to_numpy
    gdt = numpy.dtype(p['gdt'])
    n = arr['g'].shape[1]
    if kind == 'vgc_select':
        rule = core.rules.VGC(alpha=p['alpha'], zeta=p['zeta'])
    elif kind == 'hybrid_step':
        rule = core.rules.Hybrid(tau=p['tau'], alpha=p['alpha'],
                                 zeta=p['zeta'])
    else:
        rule = core.rules.Strom(tau=p['tau'])
    st = rule.init_state(n, gdt, xp)
    for step in range(arr['g'].shape[0]):
        g = xp.asarray(arr['g'][step])
        label = 'step {} '.format(step)
        if kind == 'vgc_select':
            sel = rule.select(g, xp.asarray(arr['s'][step]), st)
            ck.equal(label + 'sel', to_numpy(sel), arr['sel'][step])
        elif kind == 'hybrid_step':
            sign = rule.step(g, xp.asarray(arr['s'][step]), st)
            ck.equal(label + 'sign', to_numpy(sign), arr['sign'][step])
        else:
            sign = rule.step(g, st)
            ck.equal(label + 'sign', to_numpy(sign), arr['sign'][step])
        ck.equal(label + 'r', to_numpy(st['r']), arr['r'][step])
        if 'v' in arr:
            ck.equal(label + 'v', to_numpy(st['v']), arr['v'][step])
        if kind == 'vgc_select':
            st['r'][sel] = 0
            st['v'][sel] = 0


def check_sum_squares(ctx, ck, p, arr):
    """As chainer_vgc/statistics/contraction.py sum_squares calls it."""
    core, xp = ctx.core, ctx.xp
    g = arr['g']
    got = core.arrays.to_numpy(core.kernels.get_kernel('vgc_sum_squares')(
        xp.asarray(g), axis=0))
    if p['exact']:
        ck.equal('sum', got, arr['want'])
        return 'order-independent exact sums'
    want = arr['want']
    if ck.corrupt:
        want = ck._spoil(want)
    if got.dtype != want.dtype or got.shape != want.shape:
        raise Mismatch('dtype/shape {} {} != {} {}'.format(
            got.dtype, got.shape, want.dtype, want.shape))
    # |got - want| <= 2 * rows * eps * sum(g**2) (any summation order)
    eps = float(numpy.finfo(g.dtype).eps)
    bound = 2 * g.shape[0] * eps * (g.astype(numpy.float64) ** 2).sum(
        axis=0) + float(numpy.finfo(g.dtype).smallest_subnormal)
    err = numpy.abs(got.astype(numpy.float64) - want.astype(numpy.float64))
    if not (err <= bound).all():
        i = int(numpy.argmax(err / bound))
        raise Mismatch('error {} > bound {} at {}'.format(
            err.reshape(-1)[i], bound.reshape(-1)[i], i))
    same = int((_bits(got) == _bits(want)).sum())
    return '{} of {} bit-identical to NumPy; max error/bound {:.3g}'.format(
        same, got.size, float((err / bound).max()))


# ---- check: compression and decoding ----------------------------------------

def check_compression(ctx, ck):
    ref, meta = ctx.ref, ctx.meta
    model = meta['model']
    assert meta['steps'] == STEPS and meta['workers'] == WORKERS
    inputs = load_inputs(ref, model)
    for case in meta['cases']:
        name = case['name']
        msgs = [[ref['msg/{}/{}/{}'.format(name, s, w)]
                 for w in range(WORKERS)] for s in range(STEPS)]
        host = {}

        def host_path(case=case, msgs=msgs, host=host):
            return check_host(ctx, ck, case, inputs, msgs, host)
        ck.run('host/' + name, host_path, category='host')
        if case['compress']:
            ck.run('compress/' + name,
                   lambda case=case, msgs=msgs, host=host: check_compress(
                       ctx, ck, case, inputs, msgs, host))
        else:
            def skip():
                raise Skip('the GPU random stream differs from the CPU one '
                           'by design; decode checked only')
            ck.run('compress/' + name, skip)
        ck.run('sums/' + name, lambda case=case, msgs=msgs, host=host:
               check_device_sums(ctx, ck, case, msgs, host))
        for vname, kw in decode_variants(case):
            ck.run('{}/{}'.format(vname, name),
                   lambda case=case, msgs=msgs, host=host, vname=vname,
                   kw=kw: check_device_means(ctx, ck, case, msgs, host,
                                             vname, **kw))
        ck.run('decode_into/' + name, lambda case=case, msgs=msgs,
               host=host: check_decode_into(ctx, ck, case, msgs, host),
               category='device-api')


def check_host(ctx, ck, case, inputs, msgs, host):
    """The NumPy reference path on this machine's NumPy (the host side of
    the GPU path runs it too): messages, states, sums and means must have
    the recorded bits.  Everything is computed first and kept in ``host``,
    to locate device mismatches, then compared."""
    core, model = ctx.core, ctx.meta['model']
    digests = case['digests']
    comps = [make_compressor(core, case, model, w, 'numpy')
             for w in range(WORKERS)]
    # from the recorded messages: the decode references
    for step in range(STEPS):
        sums = host_sums(core, msgs[step], comps[0], model)
        for t, a in enumerate(sums):
            host['sum/{}/{}'.format(step, t)] = a
        for vname, kw in decode_variants(case):
            means = host_means(core, msgs[step], comps[0], model, **kw)
            for t, a in enumerate(means):
                host['{}/{}/{}'.format(vname, step, t)] = a
    # the compressor on host arrays
    got = []
    for step in range(STEPS):
        for w in range(WORKERS):
            gs, ss = worker_inputs(inputs, step, w)
            got.append((step, w, comps[w].compress(gs, ss)))
    for w in range(WORKERS):
        for t, st in enumerate(comps[w].states):
            for key, a in sorted((st or {}).items()):
                host['state/{}/{}/{}'.format(w, t, key)] = a
    for step, w, m in got:
        ck.message('step {} worker {} message'.format(step, w), m,
                   msgs[step][w], core.codec)
    for key in sorted(host, key=lambda k: (k.split('/')[0] != 'state', k)):
        ck.same_digest(key, host[key], digests[key])
    return 'messages, states, sums, means of {} steps x {} workers'.format(
        STEPS, WORKERS)


def check_compress(ctx, ck, case, inputs, msgs, host):
    """GradientCompressor on device gradients: every worker's message of
    every step, then the residual states."""
    core, xp, model = ctx.core, ctx.xp, ctx.meta['model']
    to_numpy = core.arrays.to_numpy
    comps = [make_compressor(core, case, model, w, 'numpy')
             for w in range(WORKERS)]
    for step in range(STEPS):
        for w in range(WORKERS):
            gs, ss = worker_inputs(inputs, step, w)
            m = comps[w].compress([xp.asarray(g) for g in gs],
                                  [xp.asarray(s) for s in ss])
            ck.message('step {} worker {} message'.format(step, w), m,
                       msgs[step][w], core.codec)
    digests = case['digests']
    for w in range(WORKERS):
        for t, st in enumerate(comps[w].states):
            for key, a in sorted((st or {}).items()):
                if not isinstance(a, xp.ndarray):
                    raise Mismatch('state {} of tensor {} is not on the '
                                   'device'.format(key, t))
                k = 'state/{}/{}/{}'.format(w, t, key)
                ck.same_digest('worker {} tensor {} state {}'.format(
                    w, t, key), to_numpy(a), digests[k], host.get(k))
    return '{} messages and the states'.format(STEPS * WORKERS)


def device_params(ctx):
    return [param(ctx.xp, m[1], m[2]) for m in ctx.meta['model']]


def check_device_sums(ctx, ck, case, msgs, host):
    """The device decoder's sums in rank order (the GPU engine's
    tensor-by-tensor mean up to write_mean: host validation, FMT_GAP
    expansion, one upload, codec.add_validated into zeros)."""
    core, xp, model = ctx.core, ctx.xp, ctx.meta['model']
    ref, codec, to_numpy = core.reference, core.codec, core.arrays.to_numpy
    comp = make_compressor(core, case, model, 0, 'numpy')
    for step in range(STEPS):
        params = device_params(ctx)
        blocks = msgs[step]
        comp.engine.validate(blocks, [p.dtype for p in params])
        blocks = [codec.expand_gap(b, comp.sizes, comp.gap_codec()[0])
                  for b in blocks]
        first = params[0].array
        dev = core.cuda_engine.upload_blocks(blocks, xp, first)

        def adder(h, d):
            return lambda outs: codec.add_validated(
                h, d, [o.reshape(-1) for o in outs], comp.sizes)
        with core.arrays.device_scope(first):
            sums = ref.rank_order_sum(
                [adder(h, d) for h, d in zip(blocks, dev)],
                lambda: ref.zero_sums(params, xp), False)
        for t, a in enumerate(sums):
            k = 'sum/{}/{}'.format(step, t)
            ck.same_digest('step {} tensor {} ({}) sum'.format(
                step, t, model[t][0]), to_numpy(a), case['digests'][k],
                host.get(k))
    return '{} steps of {} messages'.format(STEPS, WORKERS)


def check_device_means(ctx, ck, case, msgs, host, vname, dense, rescale):
    """exchange.mean_gradients with parameters on the device (the
    production decode: the GPU engine's mean)."""
    core, xp, model = ctx.core, ctx.xp, ctx.meta['model']
    to_numpy = core.arrays.to_numpy
    comp = make_compressor(core, case, model, 0, 'numpy')
    for step in range(STEPS):
        params = device_params(ctx)
        grads = [p.grad for p in params]
        elements = core.exchange.mean_gradients(
            msgs[step], comp, params, grads, WORKERS, True, dense,
            rescale=rescale)
        want = [core.codec.message_count(b) for b in msgs[step]]
        if list(elements) != want:
            raise Mismatch('step {}: element counts {} != {}'.format(
                step, elements, want))
        for t, p in enumerate(params):
            if not isinstance(p.grad, xp.ndarray):
                raise Mismatch('step {} tensor {}: grad is a {}, not a '
                               'device array'.format(step, t,
                                                     type(p.grad).__name__))
            k = '{}/{}/{}'.format(vname, step, t)
            ck.same_digest('step {} tensor {} ({}) {}'.format(
                step, t, model[t][0], vname), to_numpy(p.grad),
                case['digests'][k], host.get(k))
    return '{} steps'.format(STEPS)


def check_decode_into(ctx, ck, case, msgs, host):
    """The public GradientCompressor.decode_into with a device message and
    device outputs (codec.unpack's checked decoder, on the device)."""
    core, xp, model = ctx.core, ctx.xp, ctx.meta['model']
    to_numpy = core.arrays.to_numpy
    comp = make_compressor(core, case, model, 0, 'numpy')
    for step in range(STEPS):
        outs = [xp.zeros(tuple(m[1]), dtype=sdtype(m[2])) for m in model]
        for b in msgs[step]:
            comp.decode_into(xp.asarray(b), outs)
        for t, a in enumerate(outs):
            k = 'sum/{}/{}'.format(step, t)
            ck.same_digest('step {} tensor {} ({}) sum'.format(
                step, t, model[t][0]), to_numpy(a), case['digests'][k],
                host.get(k))
    return '{} steps'.format(STEPS)


# ---- timings ----------------------------------------------------------------

TIMED = [('vgc:fixed', 'vgc', dict(alpha=2.0, index_coding='fixed')),
         ('vgc:auto', 'vgc', dict(alpha=2.0, index_coding='auto')),
         ('hybrid:fixed', 'hybrid', dict(alpha=2.0, tau=0.01,
                                         index_coding='fixed')),
         ('hybrid:auto', 'hybrid', dict(alpha=2.0, tau=0.01,
                                        index_coding='auto'))]


def run_timings(ctx):
    """compress+encode and decode+mean vs a device-to-device copy, the
    stream of benchmarks/bench_compress.py (medians).

    Conditions: the compressor's CPU backend is ``'numpy'`` (host
    validation and the FMT_GAP codec on the host in NumPy), ``compress``
    with ``copy=True`` (each message copied into a new host array) and
    every timed message kept, the sums of squares separate device arrays.
    That is not what training runs (native backend, ``copy=False``, sums
    in one arena, messages dropped): ``benchmarks/gpu_profile.py`` (the
    runbook's ``profile`` step) measures those conditions, kernel by
    kernel."""
    core, xp, args = ctx.core, ctx.xp, ctx.args
    n = args.params or (1_000_000 if args.small else 25_000_000)
    repeat, warmup = args.repeat, args.warmup
    shapes = shapes_for(n)
    t0 = time.perf_counter()
    rng = numpy.random.default_rng(0)
    batch, sigma = 64, 1e-2
    mus = [rng.normal(0, 2e-4, s).astype(numpy.float32) for s in shapes]
    sqs = [(mu * mu + numpy.float32(sigma ** 2)) / numpy.float32(batch)
           for mu in mus]
    draws = [[mu + rng.normal(0, sigma / batch ** 0.5, mu.shape).astype(
        numpy.float32) for mu in mus] for _ in range(4)]
    d_draws = [[xp.asarray(g) for g in d] for d in draws]
    d_sqs = [xp.asarray(s) for s in sqs]
    del draws
    print()
    print('timings: {:,} float32 parameters in {} tensors ({:.0f} MB); '
          'inputs made in {:.1f} s; warm-up {}, median of {}{}'.format(
              n, len(shapes), 4 * n / 1e6, time.perf_counter() - t0,
              warmup, repeat, ' (fake CuPy: meaningless)' if ctx.fake
              else ''))
    print("conditions: backend='numpy' (host validation and gap codec in "
          'NumPy), compress(copy=True), every message kept, sums of squares '
          'in separate arrays: NOT training\'s conditions (native backend, '
          'copy=False, sums in one arena, messages dropped), for which see '
          'benchmarks/gpu_profile.py (the runbook\'s profile step)')
    src = xp.concatenate([g.reshape(-1) for g in d_draws[0]])
    dst = xp.empty_like(src)

    def copy():
        if ctx.fake:
            dst[...] = src
        else:
            xp.copyto(dst, src)

    def median(fn, reps):
        times = []
        for _ in range(reps):
            sync(ctx)
            t = time.perf_counter()
            fn()
            sync(ctx)
            times.append(time.perf_counter() - t)
        return float(numpy.median(times))
    for _ in range(3):
        copy()
    copy_t = median(copy, repeat)
    res = {'params': n, 'tensors': len(shapes), 'repeat': repeat,
           'warmup': warmup, 'copy_ms': copy_t * 1e3, 'methods': {}}
    events = ''
    if not ctx.fake:
        try:
            ev = []
            for _ in range(repeat):
                a, b = xp.cuda.Event(), xp.cuda.Event()
                a.record()
                copy()
                b.record()
                b.synchronize()
                ev.append(xp.cuda.get_elapsed_time(a, b))
            res['copy_event_ms'] = float(numpy.median(ev))
            events = ' (CUDA events: {:.3f} ms, {:.0f} GB/s read+write)'\
                .format(res['copy_event_ms'],
                        2 * src.nbytes / res['copy_event_ms'] / 1e6)
        except Exception as e:
            events = ' (CUDA events failed: {})'.format(e)
    print('device-to-device copy of the gradient bytes: {:.3f} ms{}'.format(
        copy_t * 1e3, events))
    names = [str(i) for i in range(len(shapes))]
    for label, method, kw in TIMED:
        r = res['methods'][label] = {}
        try:
            comp = core.compressor.GradientCompressor(
                method, names, shapes, [numpy.float32] * len(shapes),
                backend='numpy', **kw)
            t = time.perf_counter()
            comp.compress(d_draws[0], d_sqs)
            r['first_step_s'] = time.perf_counter() - t
            for k in range(warmup):
                comp.compress(d_draws[(k + 1) % 4], d_sqs)
            times, sent, nbytes, msgs = [], [], [], []
            for k in range(repeat):
                sync(ctx)
                t = time.perf_counter()
                m = comp.compress(d_draws[k % 4], d_sqs)
                sync(ctx)
                times.append(time.perf_counter() - t)
                sent.append(comp.last_sent)
                nbytes.append(comp.last_bytes)
                msgs.append(m)
            r['compress_ms'] = float(numpy.median(times)) * 1e3
            r['compress_x_copy'] = r['compress_ms'] / res['copy_ms']
            if args.profile:  # where a step's time goes, Python side
                import cProfile
                import pstats
                prof = cProfile.Profile()
                prof.enable()
                for k in range(3):
                    comp.compress(d_draws[k % 4], d_sqs)
                sync(ctx)
                prof.disable()
                print('profile of 3 compress steps, {}:'.format(label))
                pstats.Stats(prof).sort_stats('tottime').print_stats(18)
            r['density'] = float(numpy.mean(sent)) / n
            r['message_bytes'] = float(numpy.mean(nbytes))
            r['bits_per_sent_element'] = 8 * r['message_bytes'] / max(
                1.0, float(numpy.mean(sent)))
            fmts = sorted({core.codec.FORMATS[g.fmt].name
                           for g in core.codec.message.walk(msgs[-1], None)})
            r['formats'] = fmts
            print('| {} | compress+encode | {:.2f} ms | {:.1f} x copy | '
                  'density {:.2%} | {:,.0f} bytes | {:.1f} bits/element | '
                  '{} | first step {:.1f} s'.format(
                      label, r['compress_ms'], r['compress_x_copy'],
                      r['density'], r['message_bytes'],
                      r['bits_per_sent_element'], '+'.join(fmts),
                      r['first_step_s']), flush=True)
        except Exception as e:
            r['error'] = '{}: {}'.format(type(e).__name__, str(e)[:300])
            print('| {} | compress+encode | error: {}'.format(label,
                                                              r['error']))
            continue
        blocks = (msgs * 4)[:4]
        if 'gap' in fmts:
            r['decode'] = ('not timed: the host validation of FMT_GAP groups '
                           'on the NumPy backend (the native walk is not '
                           'available here) is a Python loop per element')
            print('| {} | decode+mean of 4 | {}'.format(label, r['decode']))
            continue
        try:
            params = [param(xp, s, numpy.float32) for s in shapes]
            local = [xp.ones(s, dtype=numpy.float32) for s in shapes]

            def decode():
                for p, g in zip(params, local):
                    p.grad = g
                core.exchange.mean_gradients(blocks, comp, params, local, 4,
                                             True, False)
            decode()
            dec = median(decode, repeat)
            val = median(lambda: comp.engine.validate(
                blocks, [p.dtype for p in params]), repeat)
            r['decode_mean_ms'] = dec * 1e3
            r['decode_x_copy'] = dec / copy_t
            r['host_validation_ms'] = val * 1e3
            print('| {} | decode+mean of 4 | {:.2f} ms | {:.1f} x copy | of '
                  'which host validation (NumPy backend) {:.2f} ms'.format(
                      label, dec * 1e3, dec / copy_t, val * 1e3), flush=True)
        except Exception as e:
            r['decode_error'] = '{}: {}'.format(type(e).__name__,
                                                str(e)[:300])
            print('| {} | decode+mean of 4 | error: {}'.format(
                label, r['decode_error']))
    return res


# ---- main -------------------------------------------------------------------

def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split('\n')[0],
        epilog='record DIR here, copy DIR to the GPU machine, check DIR '
               'there')
    p.add_argument('mode', choices=('record', 'check'))
    p.add_argument('dir')
    p.add_argument('--fake-cupy', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--small', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--corrupt', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--fake-ftz', action='store_true', help=argparse.SUPPRESS)
    p.add_argument('--no-nvrtc-preload', action='store_true',
                   help=argparse.SUPPRESS)
    p.add_argument('--only', default=None, help=argparse.SUPPRESS)
    p.add_argument('--no-timing', action='store_true',
                   help=argparse.SUPPRESS)
    p.add_argument('--repeat', type=int, default=10, help=argparse.SUPPRESS)
    p.add_argument('--params', type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument('--warmup', type=int, default=5, help=argparse.SUPPRESS)
    p.add_argument('--profile', action='store_true',
                   help='cProfile 3 compress steps of each timed method')
    args = p.parse_args(argv)
    if args.mode == 'record':
        return record(args)
    return check(args)


if __name__ == '__main__':
    sys.exit(main())
