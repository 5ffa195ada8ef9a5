"""Run under mpiexec: the communicator against the independent oracles of
tests/reference.py.  Prints 'strength OK at p=N'.

- traffic: what each rank really sends (its MPI calls, seen through a
  counting wrapper of the mpi4py communicator) against ``vgc/bytes``, the
  run totals and the ring algorithm; the elements of the messages against
  ``vgc/compression``; the mean gradient against the decoded messages / p;
  ``allgatherv='mpi'`` and ``chunk_words=7`` give the default ring's
  results;
- hyperparameters: ranks built with different alpha / zeta / tau / bits /
  ... fail at the first step with a ValueError naming them, on every rank;
- zero_fill=False with a parameter only some ranks have a gradient for:
  the same mean on every rank, equal to the oracle's (sum of the
  compressed contributions) / p.
"""

import os
import sys

import chainer
import chainer.functions as F
import chainer.links as L
import numpy
from mpi4py import MPI

import chainer_vgc
from chainer_vgc.statistics import model_params

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
import reference  # NOQA: E402  (tests/reference.py)
import runner  # NOQA: E402  (tests/mpi/runner.py)

comm_world = MPI.COMM_WORLD
RANK, SIZE = comm_world.rank, comm_world.size


class Net(chainer.Chain):
    """An MLP; ``branch`` is used on the even ranks only (when
    ``partial``)."""

    def __init__(self, partial=False):
        super(Net, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(6, 12)
            self.l2 = L.Linear(12, 3)
            self.branch = L.Linear(3, 3)
        self.partial = partial

    def forward(self, x):
        y = self.l2(F.relu(self.l1(x)))
        if not self.partial or RANK % 2 == 0:
            y = y + self.branch(y)
        return y


def make(partial=False):
    numpy.random.seed(0)
    return L.Classifier(Net(partial))


def data(step, n=16):
    rng = numpy.random.default_rng(1000 * step + RANK)
    x = rng.normal(size=(n, 6)).astype(numpy.float32)
    t = ((x[:, 0] + x[:, 1] > 0).astype(numpy.int32) + (x[:, 2] > 1))
    return x, t.astype(numpy.int32)


def backward(comm, model, step):
    """This step's gradients (and the statistics when the method needs
    them); returns the sums of squares given to the communicator."""
    x, t = data(step)
    model.cleargrads()
    loss = model(x, t)
    if comm.state(model).needs_sqsum:
        sq = comm.statistics(model).backward(loss, batch=(x,))
        comm.set_sqsums(sq)
        return sq
    loss.backward()
    return None


def _copy(a):
    return None if a is None else numpy.array(a, copy=True)


class CountingComm(object):
    """An mpi4py communicator that records the words this rank sends with
    point-to-point calls (the ring) and gives to ``Allgatherv``; everything
    else is passed through."""

    def __init__(self, comm):
        self._comm = comm
        self.reset()

    def reset(self):
        self.sends = []  # uint32 arrays, in call order
        self.gathered = []

    def __getattr__(self, name):
        return getattr(self._comm, name)

    @staticmethod
    def _words(buf):
        arr = buf[0] if isinstance(buf, (list, tuple)) else buf
        arr = numpy.array(arr, copy=True)
        assert arr.dtype == numpy.uint32, arr.dtype
        return arr.reshape(-1)

    def Send(self, buf, *args, **kwargs):
        self.sends.append(self._words(buf))
        return self._comm.Send(buf, *args, **kwargs)

    def Isend(self, buf, *args, **kwargs):
        self.sends.append(self._words(buf))
        return self._comm.Isend(buf, *args, **kwargs)

    def Sendrecv(self, sendbuf, *args, **kwargs):
        self.sends.append(self._words(sendbuf))
        return self._comm.Sendrecv(sendbuf, *args, **kwargs)

    def Allgatherv(self, sendbuf, recvbuf):
        self.gathered.append(self._words(sendbuf))
        return self._comm.Allgatherv(sendbuf, recvbuf)


def split_messages(words):
    """Consecutive messages of a stream of words (they delimit
    themselves: magic, group count, headers, bodies)."""
    words = [int(w) for w in words]
    out, pos = [], 0
    while pos < len(words):
        start = pos
        n_groups = words[pos + 1]
        pos += 2
        for _ in range(n_groups):
            fmt, count, a = words[pos + 1:pos + 4]
            pos += 5
            pos += reference.body_length(fmt, count, a, words[pos:pos + 2],
                                         words[pos - 1])
        out.append(words[start:pos])
    assert pos == len(words)
    return out


# ---- traffic figures, ring vs mpi vs small chunks ---------------------------

def run_traffic(allgatherv, chunk_words=None, steps=6):
    kw = {} if chunk_words is None else dict(chunk_words=chunk_words)
    comm = chainer_vgc.create_communicator('vgc', comm_world, alpha=1.0,
                                           allgatherv=allgatherv, **kw)
    counting = CountingComm(comm.mpi_comm)
    comm.mpi_comm = counting
    model = make()
    names, params = model_params(model)
    sizes = [p.size for p in params]
    n_params = sum(sizes)
    p = SIZE
    results, wire_total, elements_total = [], 0.0, 0
    for step in range(steps):
        backward(comm, model, step)
        counting.reset()
        comm.multi_node_mean_grad(model)
        # this rank's message: the head of the ring stream it sent, or what
        # it gave to Allgatherv
        if allgatherv == 'ring':
            stream = (numpy.concatenate(counting.sends) if counting.sends
                      else numpy.zeros(0, numpy.uint32))
            assert not counting.gathered
            if p == 1:
                assert stream.size == 0
                own = None
            else:
                own = split_messages(stream)[0]
        else:
            assert not counting.sends, 'mpi allgatherv sent point to point'
            own = [int(w) for w in counting.gathered[0]]
        if own is None:  # one rank: nothing on the wire
            everyone = [None]
            total_words = 0
        else:
            everyone = comm_world.allgather(own)
            total_words = sum(len(m) for m in everyone)
        if allgatherv == 'ring' and p > 1:
            # the ring: rank r sends its own block, then the blocks of
            # r - 1, r - 2, ..., r + 2 (all but that of r + 1)
            want = []
            for k in range(p - 1):
                want += everyone[(RANK - k) % p]
            assert [int(w) for w in stream] == want
            sent_bytes = 4 * len(want)
            assert sent_bytes == 4 * (total_words -
                                      len(everyone[(RANK + 1) % p]))
            if chunk_words is not None:
                assert max(s.size for s in counting.sends) <= chunk_words
                # every word of the stream went in chunks of at most that
                assert len(counting.sends) >= -(-len(want) // chunk_words)
            mean_sent = sum(comm_world.allgather(sent_bytes)) / p
        else:
            mean_sent = 4 * (p - 1) * total_words / p
        fig = comm.state(model).last
        # vgc/bytes: what a rank sends on average, (p - 1) / p of all
        # messages in the ring
        assert abs(fig['vgc/bytes'] - mean_sent) <= 1e-9 * mean_sent, (
            fig['vgc/bytes'], mean_sent)
        assert abs(fig['vgc/bytes'] -
                   4 * (p - 1) * total_words / p) <= 1e-9 * total_words
        wire_total += mean_sent
        if everyone[0] is None:  # p == 1: the message never left
            elements = None
        else:
            elements = sum(reference.message_elements(m) for m in everyone)
            elements_total += elements
            want_c = (n_params * p / elements if elements
                      else float('inf'))
            assert abs(fig['vgc/compression'] - want_c) <= 1e-9 * want_c
            # the mean: every rank's decoded message, summed, over p
            mean = [numpy.zeros(n) for n in sizes]
            for m in everyone:
                for acc, dec in zip(mean, reference.decode_message(m,
                                                                   sizes)):
                    acc += dec
            for name, prm, acc in zip(names, params, mean):
                numpy.testing.assert_allclose(
                    prm.grad.reshape(-1), acc / p, rtol=1e-6, atol=0,
                    err_msg=name)
        results.append(([_copy(prm.grad) for prm in params],
                        fig['vgc/bytes'], fig['vgc/compression']))
    tot = comm.state(model).totals
    assert tot['steps'] == steps
    assert abs(tot['bytes'] - wire_total) <= 1e-9 * max(wire_total, 1)
    if p > 1:
        assert tot['elements'] == elements_total
        assert elements_total > 0
    assert tot['param_elements'] == steps * n_params
    return results


def check_traffic_and_allgatherv_variants():
    ring = run_traffic('ring')
    for variant in (run_traffic('ring', chunk_words=7),
                    run_traffic('mpi'), run_traffic('mpi', chunk_words=7)):
        for (ga, ba, ca), (gb, bb, cb) in zip(ring, variant):
            assert ba == bb and ca == cb
            for a, b in zip(ga, gb):
                assert (a is None) == (b is None)
                if a is not None:
                    assert a.dtype == b.dtype and (a == b).all()


# ---- hyperparameters in the cross-rank check --------------------------------

MISMATCHES = [
    ('vgc', dict(alpha=1.5), dict(alpha=2.0), 'alpha', '1.5', '2.0'),
    ('vgc', dict(zeta=0.999), dict(zeta=0.99), 'zeta', '0.999', '0.99'),
    ('vgc', {}, dict(keep_unrepresentable=True), 'keep_unrepresentable',
     'False', 'True'),
    ('vgc', {}, dict(quantize=False), 'quantize', 'True', 'False'),
    ('hybrid', dict(tau=0.01), dict(tau=0.02), 'tau', '0.01', '0.02'),
    ('strom', dict(tau=0.01), dict(tau=0.03), 'tau', '0.01', '0.03'),
    ('qsgd', dict(bits=2), dict(bits=3), 'bits', '2', '3'),
    ('qsgd', dict(bucket=64), dict(bucket=32), 'bucket', '64', '32'),
]


def check_hyperparameters_must_agree():
    odd = SIZE - 1  # the last rank is built differently
    for method, mine, theirs, name, a, b in MISMATCHES:
        kw = theirs if RANK == odd else mine
        comm = chainer_vgc.create_communicator(method, comm_world, **kw)
        model = make()
        backward(comm, model, 0)
        try:
            comm.multi_node_mean_grad(model)
        except ValueError as e:
            msg = str(e)
            ok = ('differ from rank 0' in msg and repr(method) in msg
                  and repr(name) in msg and a in msg and b in msg
                  and 'rank {}'.format(odd) in msg)
            if not ok:
                print('rank {}: unexpected message: {}'.format(RANK, msg))
        else:
            ok = SIZE == 1
            if not ok:
                print('rank {}: no error for {} {} vs {}'.format(
                    RANK, method, mine, theirs))
        everyone = comm_world.allgather(ok)
        assert all(everyone), (method, name, everyone)


# ---- zero_fill=False, a branch on some ranks only ---------------------------

def check_zero_fill_false_partial_gradients(steps=6):
    """``branch`` has a gradient on the even ranks only."""
    comm = chainer_vgc.create_communicator('vgc', comm_world, alpha=1.0)
    model = make(partial=True)
    names, params = model_params(model)
    sizes = [p.size for p in params]
    oracles = [reference.VGCOracle(sizes, numpy.float32, alpha=1.0)
               for _ in range(SIZE)]
    checked = 0
    for step in range(steps):
        sq = backward(comm, model, step)
        mine = ([_copy(p.grad) for p in params], [_copy(s) for s in sq])
        everyone = comm_world.allgather(mine)
        assert [g is None for g in mine[0]] == [
            RANK % 2 and n.startswith('/predictor/branch') for n in names]
        comm.multi_node_mean_grad(model, zero_fill=False)
        got = [_copy(p.grad) for p in params]
        all_got = comm_world.allgather(got)
        want = [None] * len(params)
        present = [False] * len(params)
        for rank, (grads, sqs) in enumerate(everyone):
            for k, sent in enumerate(oracles[rank].step(grads, sqs)):
                if sent is None:
                    continue
                present[k] = True
                want[k] = sent if want[k] is None else want[k] + sent
        for k, name in enumerate(names):
            for rank in range(SIZE):  # the same on every rank
                a = all_got[rank][k]
                assert a is not None, (rank, name, step)
                assert a.tolist() == all_got[0][k].tolist(), (rank, name,
                                                              step)
            numpy.testing.assert_allclose(
                got[k].reshape(-1), want[k] / SIZE, rtol=1e-6, atol=0,
                err_msg='{} step {}'.format(name, step))
            if name.startswith('/predictor/branch') and SIZE > 1:
                checked += 1
    assert SIZE == 1 or checked >= steps, checked


CHECKS = [check_traffic_and_allgatherv_variants,
          check_hyperparameters_must_agree,
          check_zero_fill_false_partial_gradients]


def main():
    runner.run(CHECKS, 'strength')


if __name__ == '__main__':
    main()
