"""The GPU profile (benchmarks/gpu_profile.py, the runbook's first step)
without a GPU: ``--dry`` runs every section through the fake CuPy with the
kernels compiled for the host, and its table must have a row, with numbers,
for every kernel each compress step launches (the kernels are read from the
fake's launch record of the same step, run here through the ``device``
fixture), the decode rows for p = 4, 16 and 64, the VGG rows for none and
vgc, and the pinned line; and the log holds the same output."""

import os
import re
import subprocess
import sys

import numpy
import pytest

from chainer_vgc import GradientCompressor
from chainer_vgc.backends.cuda import kernels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILE = os.path.join(ROOT, 'benchmarks', 'gpu_profile.py')
sys.path.insert(0, os.path.join(ROOT, 'benchmarks'))
import gpu_profile  # NOQA: E402

#: a table row: the call (indented by ". " a level), kind, calls a step,
#: device ms, host ms, host self ms
ROW = re.compile(r'^\| ((?:\. )*)(\S.*?) \| (kernel|cupy|host) \| '
                 r'([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$', re.M)
#: kernels each compress case must show at least (all it launches are
#: checked against the fake's record of the same step)
EXPECTED = {
    'vgc:fixed': ('vgc_model_vgc_select', 'vgc_model_layout',
                  'vgc_model_vgc_write'),
    'vgc:auto': ('vgc_model_vgc_select',),
    'hybrid:fixed': ('vgc_model_hybrid_step',),
    'hybrid:auto': ('vgc_model_hybrid_step',)}


@pytest.fixture(scope='module')
def dry_run(tmp_path_factory):
    """(exit status, stdout, log text) of ``gpu_profile.py --dry``."""
    log = tmp_path_factory.mktemp('profile') / 'gpu_profile.log'
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONWARNINGS'}
    env.setdefault('OPENBLAS_NUM_THREADS', '1')
    proc = subprocess.run([sys.executable, PROFILE, '--dry', '--log',
                           str(log)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr, log.read_text()


def sections(text):
    """{title: body} of the ``## title`` (and ``### title``) sections."""
    parts = re.split(r'^###? (.*)$', text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def rows(body):
    """{call name: (kind, calls, device ms, host ms, host self ms)}."""
    return {m.group(2): (m.group(3),) + tuple(float(m.group(k))
                                              for k in range(4, 8))
            for m in ROW.finditer(body)}


def launched_kernels(fake, method, kw):
    """The ElementwiseKernels one compress step of the profile's
    conditions launches (sums of squares in one arena, copy=False)."""
    sizes = gpu_profile.model_sizes(6000, 9)
    inputs = gpu_profile.Inputs(fake, sizes)
    comp = GradientCompressor(method, [str(i) for i in range(len(sizes))],
                              [(s,) for s in sizes],
                              [numpy.float32] * len(sizes),
                              backend='native', **kw)
    names = set()
    for k in range(3):
        grads = inputs.grads(k)
        fake.reset()
        comp.compress(grads, inputs.sqsums, copy=False)
        names.update(n for n in fake.launches
                     if n in kernels.SPECS or n in kernels.REDUCTION_SPECS)
    return names


def test_dry_run_passes_and_logs_everything(dry_run):
    code, out, log = dry_run
    assert code == 0, out[-6000:]
    assert 'ERROR' not in log, log[-6000:]
    assert log.startswith('# chainer-vgc GPU profile (DRY')
    assert "conditions: GradientCompressor(backend='native'), compress(..., " \
        'copy=False), messages not kept' in log
    assert re.search(r'^RESULT \(DRY\) compress \(device\) vgc:fixed [\d.]+ '
                     r'ms', log, re.M), log[-2000:]
    for line in log.splitlines():  # stdout holds the log's lines
        assert line in out


@pytest.mark.parametrize('label,method,kw', gpu_profile.COMPRESS_CASES,
                         ids=[c[0] for c in gpu_profile.COMPRESS_CASES])
def test_every_kernel_of_a_compress_step_has_a_row(dry_run, device, label,
                                                   method, kw):
    body = sections(dry_run[2])['compress ' + label]
    assert re.search(r'whole step \(\d+ steps .*\): device [\d.]+ ms, wall '
                     r'[\d.]+ ms = [\d.]+x the copy', body), body
    got = rows(body)
    kernel_rows = {name for name, r in got.items() if r[0] == 'kernel'}
    assert set(EXPECTED[label]) <= kernel_rows, (label, sorted(got))
    assert launched_kernels(device, method, kw) <= kernel_rows
    for name in kernel_rows:
        kind, calls, dev, host, own = got[name]
        assert calls >= 1 and dev > 0 and host > 0, (name, got[name])
    # the host phases around them, the whole call first
    assert next(iter(got)) == 'GradientCompressor.compress'
    assert got['DeviceStep.compress'][0] == 'host'


def test_decode_rows_for_4_16_and_64_messages(dry_run):
    found = sections(dry_run[2])
    for coding in ('fixed', 'auto'):
        for ranks in (4, 16, 64):
            body = found['decode+mean vgc:{}, p = {}'.format(coding, ranks)]
            assert re.search(r'whole step .*: device [\d.]+ ms, wall [\d.]+ '
                             r'ms .*; (of which host validation [\d.]+ ms|'
                             r'host validation not timed)', body), body
            got = rows(body)
            # MPI's copy into the upload buffer (emulated), then the step
            assert list(got)[0] == \
                'MPI receive (emulated: the copy into the upload buffer)'
            assert 'exchange_mean.mean_gradients' in got, list(got)
            kernel_rows = [r for r in got.values() if r[0] == 'kernel']
            assert kernel_rows, (coding, ranks, sorted(got))
            assert all(r[1] >= 1 and r[2] > 0 for r in kernel_rows)
            # the draws' sizes change from step to step
            m = re.search(r'([\d,]+)-([\d,]+) words a step', body)
            assert m and m.group(1) != m.group(2), body


def test_vgg_rows_and_pinned_line(dry_run):
    log = dry_run[2]
    assert re.search(r'^\| vgg none \| [\d.]+ \| [\d.]+ \| no \|$', log, re.M)
    assert re.search(r'^\| vgg vgc \| [\d.]+ \| [\d.]+ \| yes \|$', log, re.M)
    assert re.search(r'^vgc / none = [\d.]+ \(device\)', log, re.M)
    vgc = rows(sections(log)['vgg vgc: one update, instrumented (2 updates)'])
    assert 'VGCCommunicator.exchange' in vgc
    assert 'PerSampleSquares.backward' in vgc
    assert re.search(r'^pinned after 200 decode steps \(vgc:auto, p = 4, .*'
                     r'pool n_free_blocks \d+ -> \d+.*; chainer_vgc took \d+ '
                     r'pinned buffers', log, re.M), log[-3000:]


def test_the_profiler_adds_up_by_call_path():
    """Two steps of nested wrapped calls: per-step sums by path, host self
    less the calls inside, medians over the steps, parents first."""
    clock = gpu_profile.Clock(None, dry=True)
    prof = gpu_profile.Profiler(clock)

    def inner():
        return 1

    def outer():
        return sum(prof.call('kernel', 'k', inner, (), {}) for _ in range(3))
    for _ in range(2):
        prof.begin()
        assert prof.call('host', 'outer', outer, (), {}) == 3
        prof.end()
    got = {path: row for path, *row in prof.rows()}
    assert list(got) == [('outer',), ('outer', 'k')]
    kind, calls, dev, host, own = got[('outer', 'k')]
    assert (kind, calls) == ('kernel', 3) and own == pytest.approx(host)
    kind, calls, dev, host, own = got[('outer',)]
    assert (kind, calls) == ('host', 1)
    assert own == pytest.approx(host - got[('outer', 'k')][3], abs=1e-6)
    assert not prof.active and prof.call('host', 'x', inner, (), {}) == 1


def test_a_name_it_cannot_wrap_fails_the_profile():
    """A chainer_vgc function the profile's tables name but that is gone
    (renamed, removed) stops the profile, which would otherwise time less
    than it says; CuPy's names are only listed (a real CuPy's ndarray
    cannot be patched, NumPy's has no ``get``); every table of today's
    code wraps."""
    import types
    from chainer_vgc.engines.cuda import decode

    class Calls(object):
        def call(self, kind, label, fn, args, kwargs):
            return fn(*args, **kwargs)

    original = decode._gap_groups
    with gpu_profile.Patches(Calls()) as patches:
        with pytest.raises(AttributeError, match='_no_such_step'):
            patches.wrap(decode, '_no_such_step', 'decode._no_such_step')
        patches.wrap(numpy.ndarray, 'get', 'ndarray.get', 'cupy')
        assert patches.missing == ['ndarray.get (not found)']
        gpu_profile.vgg_patches(types.SimpleNamespace(xp=numpy), patches)
        assert 'device_decode._gap_groups' in patches.wrapped
        assert decode._gap_groups is not original
    assert decode._gap_groups is original  # put back
