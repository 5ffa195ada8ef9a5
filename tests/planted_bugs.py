"""Plant single-line bugs and show that the suite still catches each one.

    python tests/planted_bugs.py [--tree DIR] [--only NAME ...]

For every bug of :data:`BUGS`: copies the checkout ``DIR`` (default: this
one; its tracked files and the native libraries built in place) to a
temporary folder, changes exactly one line of the package there, runs the
tests named for that bug from the copy (``PYTHONPATH`` puts the copy's
package first, for the ``mpiexec`` ranks too) and prints whether they
failed, as they must.  Run it with ``--tree`` on a checkout of an older
commit to compare the suite before and after a change (the bugs are
planted in the package of that checkout).  Exits non-zero when a bug goes
uncaught or its line is not found.
"""

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: name -> (file, the line as it is, the line planted, the tests to run)
BUGS = {
    'agreement': (
        'chainer_vgc/exchange/run.py',
        'present[:] = [any(bits) for bits in zip(*(b for _, b, _ in both))]',
        'present[:] = list(has_grad)  # (only this rank\'s)',
        ['tests/test_mpi.py', '-k', 'strength']),
    'node-s-over-k': (
        'chainer_vgc/nodes/transfer.py',
        "work.get((i, 's', me), p), k, k * k)",
        "work.get((i, 's', me), p), k, k)",
        ['tests/test_mpi.py', '-k', 'hierarchical']),
    'restart-off-by-one': (
        'chainer_vgc/codec/restarts.py',
        'prev = numpy.asarray(index, dtype=numpy.int64)[at - 1].astype(',
        'prev = numpy.asarray(index, dtype=numpy.int64)[at].astype(',
        ['tests/test_gap_format.py', '-k', 'restart']),
    'gram-weight': (
        'chainer_vgc/statistics/contraction.py',
        'xp.multiply(dst, 2, out=dst)',
        'xp.multiply(dst, 1, out=dst)',
        ['tests/test_statistics.py', 'tests/test_contraction.py']),
    'duplicates-never-freed': (
        'chainer_vgc/chainermn/collectives.py',
        '        mpi_comm.Free()',
        '        pass  # (the duplicate is never freed)',
        ['tests/test_mpi.py', '-k',
         'live_communicators or thousands_of_double_buffered']),
    'commit-before-agreement': (
        'chainer_vgc/engines/native/engine.py',
        'bad = [] if not in_place else [',
        'bad = [] if True else [  # (in place, unchecked)',
        ['tests/test_faults.py', '-k', 'in_place']),
    'double-buffering-without-delay': (
        'chainer_vgc/optimizer.py',
        'if double_buffering:',
        'if False:  # (double_buffering ignored)',
        ['tests/test_mpi.py', '-k', 'one_step_delayed']),
    'dgc-residual-without-momentum': (
        'chainer_vgc/rules/dgc.py',
        '        kernels.add_into(r, u)',
        '        kernels.add_into(r, g)  # (the raw gradient: no momentum '
        'correction)',
        ['tests/test_dgc.py']),
    'powersgd-without-error-feedback': (
        'chainer_vgc/rules/powersgd.py',
        'mat -= update  # E = M - P^ Q^T',
        'mat *= 0  # (no error feedback)',
        ['tests/test_powersgd.py']),
    'device-decode-ignores-its-checks': (
        'chainer_vgc/engines/cuda/decode.py',
        'if errs is not None and errs.get().any():  # (waits for the device)',
        'if False:  # (the device\'s FMT_GAP code checks ignored)',
        ['tests/test_device_decode_checks.py']),
}


def copy_tree(tree, dst):
    """The tracked files of ``tree`` and its native builds, into ``dst``."""
    files = subprocess.run(['git', '-C', tree, 'ls-files', '-z'],
                           check=True, capture_output=True,
                           text=True).stdout.split('\0')
    built = glob.glob(os.path.join(tree, 'chainer_vgc', '**', '*.so'),
                      recursive=True)
    for rel in [f for f in files if f] + [os.path.relpath(b, tree)
                                          for b in built]:
        src = os.path.join(tree, rel)
        if not os.path.isfile(src):
            continue
        os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
        shutil.copy2(src, os.path.join(dst, rel))


def plant(copy, path, old, new):
    """Replaces the one line of ``path`` that contains ``old``."""
    full = os.path.join(copy, path)
    with open(full) as f:
        lines = f.read().split('\n')
    hits = [i for i, ln in enumerate(lines) if old in ln]
    if len(hits) != 1:
        raise SystemExit('{}: {} lines hold {!r} (want 1): update BUGS'
                         .format(path, len(hits), old))
    lines[hits[0]] = lines[hits[0]].replace(old, new)
    with open(full, 'w') as f:
        f.write('\n'.join(lines))
    return hits[0] + 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--tree', default=ROOT)
    ap.add_argument('--only', nargs='*', default=None)
    args = ap.parse_args()
    missed = []
    for name, (path, old, new, tests) in BUGS.items():
        if args.only and name not in args.only:
            continue
        with tempfile.TemporaryDirectory(prefix='vgc_bug_') as copy:
            copy_tree(os.path.abspath(args.tree), copy)
            line = plant(copy, path, old, new)
            env = dict(os.environ, PYTHONPATH=copy, OPENBLAS_NUM_THREADS='1')
            t0 = time.time()
            proc = subprocess.run(
                [sys.executable, '-m', 'pytest', '-q', '-x', '-p',
                 'no:cacheprovider', '-n', '2', '--dist', 'loadgroup']
                + tests, cwd=copy, env=env, capture_output=True, text=True)
            tail = (proc.stdout.strip().split('\n') or [''])[-1]
            caught = proc.returncode in (1, 2) and ' failed' in ' ' + tail
            failed = [ln.split()[1] for ln in proc.stdout.split('\n')
                      if ln.startswith('FAILED ')]
            print('{:32s} {}:{:<4d} {} in {:.0f} s ({}; {})'.format(
                name, path, line, 'CAUGHT' if caught else 'MISSED',
                time.time() - t0, tail, ', '.join(failed) or '-'),
                flush=True)
            if not caught:
                missed.append(name)
                print(proc.stdout[-3000:], proc.stderr[-2000:])
    sys.exit(1 if missed else 0)


if __name__ == '__main__':
    main()
