"""Running tests/mpi/ scripts under mpiexec from pytest, with a timeout so
that a hang fails instead of stalling."""

import os
import shutil
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, 'mpi')


def mpiexec():
    """$MPIEXEC, else the mpiexec beside this Python (the venv's MPICH),
    else the one on PATH."""
    exe = os.environ.get('MPIEXEC')
    if exe:
        return exe
    beside = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    if os.path.exists(beside):
        return beside
    found = shutil.which('mpiexec')
    if found is None:
        pytest.fail('mpiexec not found: install the pinned environment '
                    '(make test) or set MPIEXEC')
    return found


def run(n, script, *args, timeout=240):
    cmd = [mpiexec(), '-n', str(n), sys.executable,
           os.path.join(SCRIPTS, script)] + [str(a) for a in args]
    env = dict(os.environ, PYTHONUNBUFFERED='1')
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          timeout=timeout, env=env)
    return proc, time.time() - t0


def run_ok(n, script, *args, expect, timeout=240):
    proc, _ = run(n, script, *args, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert expect in proc.stdout, proc.stdout[-3000:]
    return proc
