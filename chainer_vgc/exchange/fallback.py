"""The dense fallback: a step sent dense when Sec. 5 predicts it faster.

The question this module answers: when should a step not be compressed?
An allgatherv's cost grows with the ranks, a ring allreduce's does not
(paper Sec. 5): with p workers, compression c = N / elements sent, e bits
per sent element and s bits per parameter, the compressed exchange is the
slower one once c < p e / (2 s).  So with many ranks, or in a step where
much of the model passes the criterion, a dense allreduce is faster.

:class:`DenseFallback` predicts both from this step's counts: each rank
counts the elements its rule would send (:meth:`CompressionRule.count
<chainer_vgc.rules.CompressionRule.count>`, nothing changed), the counts
travel in the fault agreement the exchange makes anyway (one small
allgather, before any residual moves), and every rank computes the same
decision from the same numbers:

    T_v = (p - 1) (L + e * mean(count) / B)         pipelined ring allgatherv
    T_r = 2 (p - 1) (L + s * N / (p B))             ring allreduce

(L: latency per message, B: bandwidth;
:func:`chainer_vgc.costmodel.ring_step_times`).  When T_v > T_r the step
is sent as a warm-up step is: every parameter's gradient by allreduce, every
residual as it was (neither accumulated nor decayed), reported as
``vgc/dense_steps``.  The link (B, L) is the user's, or measured once
with two allreduces at the first exchange (rank 0's figures, broadcast).
"""

import collections
import time

import numpy

from chainer_vgc.backends import arrays
from chainer_vgc import costmodel

Choice = collections.namedtuple('Choice', ['dense', 'compressed_s',
                                           'dense_s'])


class DenseFallback(object):
    """Chooses, every step, between the compressed exchange and allreduce.

    Args:
        bandwidth: bits per second (``1e9``, ``'1Gbit'``) or None: measured
            once, at the first exchange.
        latency: seconds per message (with ``bandwidth``; default 0, the
            paper's model).
        workers: the p of the prediction (default: the ranks exchanging);
            to predict a larger job from a small one.
        bits_per_element: e (default: the run's measured bits per element
            so far, 32 before any).
    """

    def __init__(self, bandwidth=None, latency=0.0, workers=None,
                 bits_per_element=None):
        self.bandwidth = None if bandwidth is None else \
            costmodel.parse_bandwidth(bandwidth)
        if not (latency >= 0 and numpy.isfinite(latency)):
            raise ValueError('dense_fallback: latency must be >= 0 seconds, '
                             'got {!r}'.format(latency))
        self.latency = float(latency)
        if workers is not None and (isinstance(workers, bool) or
                                    int(workers) != workers or workers < 1):
            raise ValueError('dense_fallback: workers must be a positive '
                             'int or None, got {!r}'.format(workers))
        self.workers = workers
        if bits_per_element is not None and not bits_per_element > 0:
            raise ValueError('dense_fallback: bits_per_element must be > 0, '
                             'got {!r}'.format(bits_per_element))
        self.bits_per_element = bits_per_element

    def describe(self):
        """The settings every rank must share, as a record."""
        return ('dense_fallback', self.bandwidth, self.latency,
                self.workers, self.bits_per_element)

    def ensure_link(self, mpi_comm):
        """Measure the link at the first exchange (collective) unless the
        user gave it."""
        if self.bandwidth is None:
            self.latency, self.bandwidth = measure_link(mpi_comm)

    def count(self, compressor, grads, sqsums):
        """Elements this rank's rule would send now (state unchanged)."""
        rule, total = compressor.rule, 0
        for i, g in enumerate(grads):
            if g is None:
                continue
            state = compressor.states[i]
            if state is None:  # (the first step: empty residuals)
                state = compressor.new_state(
                    i, arrays.get_array_module(g))
            n = rule.count(g, None if sqsums is None else sqsums[i], state)
            if n is None:
                raise ValueError(
                    'dense_fallback needs a rule that counts what it would '
                    'send (CompressionRule.count); {!r} does not'.format(
                        rule.name))
            total += n
        return total

    def choose(self, counts, dense_bits, bits_per_element):
        """The same :class:`Choice` on every rank, from every rank's count
        and the compressed group's dense size in bits."""
        p = self.workers or len(counts)
        if p < 2:
            return Choice(False, 0.0, 0.0)
        e = self.bits_per_element or bits_per_element or 32.0
        mean = float(sum(counts)) / len(counts)
        t_v, t_r = costmodel.ring_step_times(p, e * mean, dense_bits,
                                             self.bandwidth, self.latency)
        return Choice(t_v > t_r, t_v, t_r)


def measure_link(mpi_comm, small=2, large=1 << 18, repeats=5):
    """(latency s, bandwidth bit/s) from the best of ``repeats`` ring
    allreduces of ``small`` and ``large`` float32 elements on ``mpi_comm``,
    solved with the model above; rank 0's, on every rank."""
    p = mpi_comm.size
    if p < 2:
        return 0.0, 1e12

    def best(n):
        a = numpy.ones(n, dtype=numpy.float32)
        out = numpy.empty_like(a)
        times = []
        for _ in range(repeats):
            mpi_comm.Barrier()
            t = time.perf_counter()
            mpi_comm.Allreduce(a, out)
            times.append(time.perf_counter() - t)
        return min(times)
    t_small, t_large = best(small), best(large)
    latency = t_small / (2 * (p - 1))
    spent = max(t_large - t_small, 1e-9)
    bandwidth = 2.0 * (p - 1) / p * 32 * (large - small) / spent
    return mpi_comm.bcast((latency, bandwidth), root=0)


def figures(choice):
    """The dense fallback's figures of a step (none without one):
    ``vgc/dense_steps`` (1: sent dense) and the two predicted times."""
    if choice is None:
        return {}
    return {'vgc/dense_steps': float(choice.dense),
            '_dense_steps': float(choice.dense),
            'vgc/predicted_compressed_s': choice.compressed_s,
            'vgc/predicted_dense_s': choice.dense_s}


def bits_per_element(totals):
    """The run's measured bits per sent element so far (None before any
    message)."""
    n = totals.get('message_elements', 0.0)
    return totals.get('message_bits', 0.0) / n if n else None


def make(setting):
    """``dense_fallback`` as given to the communicator: None (off), True
    (on, link measured), a bandwidth (``'1Gbit'``), a dict of
    :class:`DenseFallback`'s arguments, or one."""
    if setting is None or setting is False:
        return None
    if setting is True:
        return DenseFallback()
    if isinstance(setting, DenseFallback):
        return setting
    if isinstance(setting, dict):
        return DenseFallback(**setting)
    if isinstance(setting, (str, int, float)):
        return DenseFallback(bandwidth=setting)
    raise ValueError('dense_fallback: None, True, a bandwidth, a dict of '
                     'DenseFallback arguments or a DenseFallback, got '
                     '{!r}'.format(setting))
