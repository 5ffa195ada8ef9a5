"""What the benchmarks share (bench_compress.py, bench_statistics.py,
bench_allgatherv.py, bench_network.py, network_step.py): the timing, the
machine banner and the hyperparameters each method is measured with.

The benchmark scripts import it as a sibling module (``python
benchmarks/bench_compress.py`` puts ``benchmarks/`` on the path).
"""

import os
import platform
import time

import numpy

#: the hyperparameters each method is benchmarked with; a method not listed
#: runs with its rule's defaults (chainer_vgc.RULES)
HYPERPARAMETERS = {
    'vgc': dict(alpha=2.0),
    'hybrid': dict(alpha=2.0, tau=0.01),
    'strom': dict(tau=0.01),
    # the methods users pick instead (issue 51) at their papers' settings:
    # DGC's 0.1 % density, PowerSGD's rank 2
    'dgc': dict(density=0.001),
    'powersgd': dict(matrix_rank=2),
}


def hyperparameters(method, **overrides):
    """``method``'s entry of :data:`HYPERPARAMETERS` ({} if none), with the
    values of ``overrides`` for the hyperparameters it has (others are
    ignored: ``--alpha`` means nothing to strom)."""
    kw = dict(HYPERPARAMETERS.get(method, {}))
    kw.update((k, v) for k, v in overrides.items() if k in kw)
    return kw


def default(name):
    """The value of hyperparameter ``name`` in :data:`HYPERPARAMETERS` (the
    default of a flag that sets it for every method)."""
    values = {kw[name] for kw in HYPERPARAMETERS.values() if name in kw}
    if len(values) != 1:
        raise ValueError('the methods disagree on {}: {}'.format(
            name, sorted(values)))
    return values.pop()


def timed(fn, *args, **kwargs):
    """One call ``fn(*args, **kwargs)``: (its result, wall seconds, CPU
    seconds of this process)."""
    c0 = time.process_time()
    t0 = time.perf_counter()
    result = fn(*args, **kwargs)
    wall = time.perf_counter() - t0
    return result, wall, time.process_time() - c0


def median_time(fn, repeat, comm=None):
    """Median wall seconds of ``repeat`` calls of ``fn()``.  With an MPI
    communicator ``comm``, every call starts after a barrier and takes the
    time of its slowest rank."""
    times = []
    for _ in range(repeat):
        if comm is not None:
            comm.Barrier()
        times.append(timed(fn)[1])
    if comm is not None:
        times = numpy.max(comm.allgather(times), axis=0)
    return float(numpy.median(times))


def machine(processor=False, chainer=False, mpi=False, numpy_version=True):
    """``'N cores, ARCH, numpy X, python Y'``: this machine and its
    software, for a benchmark's first line.  ``processor``: ARCH is
    platform.processor() where it says something; ``chainer``, ``mpi``: add
    Chainer's version, the MPI library's name (after numpy's)."""
    parts = ['{} cores'.format(os.cpu_count()),
             (processor and platform.processor()) or platform.machine()]
    if numpy_version:
        parts.append('numpy ' + numpy.__version__)
    if chainer:
        import chainer as chainer_module
        parts.append('chainer ' + chainer_module.__version__)
    if mpi:
        from mpi4py import MPI
        parts.append('MPI: ' +
                     MPI.Get_library_version().splitlines()[0].strip())
    parts.append('python ' + platform.python_version())
    return ', '.join(parts)


def shapes_for(total):
    """VGG-like tensor sizes adding up to ``total`` elements (the stream of
    bench_compress.py and tests/gpu_check.py)."""
    sizes, left, k = [], total, 0
    pattern = [1728, 36864, 64, 73728, 147456, 128, 294912, 589824, 256,
               1179648, 2359296, 512]
    while left > 0:
        n = min(left, pattern[k % len(pattern)] * (1 + k // len(pattern)))
        sizes.append(n)
        left -= n
        k += 1
    return [(n,) for n in sizes]
