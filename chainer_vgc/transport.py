"""Transport: allgatherv of the ranks' uint32 messages (paper Sec. 4.3, 5).

Each rank contributes one block of 32-bit words (its compressed message);
every rank receives all blocks in rank order.  Two implementations with the
same result:

``'ring'`` -- a pipelined ring on point-to-point calls (Traeff et al.'s
    pipelined ring allgatherv, as in MPICH/MVAPICH for large inputs).  Rank r
    sends a stream to rank r+1: its own block, then the blocks it receives
    from rank r-1 (except the one that originated at r+1).  Streams are cut
    into chunks of ``chunk_words`` words, and a chunk is forwarded as soon as
    it has arrived, so every link is busy at once: time about
    (sum_i n_i + (p - 1) m) beta (Sec. 5).  Every rank computes the same
    chunk schedule from the block sizes (exchanged first with a small
    ``Allgather``), so each send has a matching receive; zero-length blocks,
    even all of them, need no special case and cannot hang.
``'mpi'`` -- MPI's own ``Allgatherv``.

Buffers are host (NumPy) arrays; a GPU message is copied to the host first
by the caller.
"""

import numpy

try:
    from mpi4py import MPI
except ImportError:  # pragma: no cover - mpi4py is a dependency
    MPI = None

#: default pipelining chunk (words): 64 KiB
DEFAULT_CHUNK_WORDS = 16384
_TAG = 0x5647


def exchange_counts(comm, count):
    """Block sizes of every rank (one small Allgather)."""
    counts = numpy.zeros(comm.size, dtype=numpy.int64)
    comm.Allgather(numpy.array([count], dtype=numpy.int64), counts)
    return counts


def ring_schedule(counts, chunk_words):
    """Words each rank sends in each round of the pipelined ring.

    Returns a list of per-round arrays ``s`` where rank r sends ``s[r]``
    words to rank r+1 (and so receives ``s[r-1]`` from rank r-1).  A rank
    forwards only words it already holds, at most ``chunk_words`` a round.
    """
    counts = numpy.asarray(counts, dtype=numpy.int64)
    p = counts.size
    total = int(counts.sum())
    length = total - numpy.roll(counts, -1)  # stream length: all but r+1's
    sent = numpy.zeros(p, dtype=numpy.int64)
    received = numpy.zeros(p, dtype=numpy.int64)
    rounds = []
    if p < 2:
        return rounds
    while (sent < length).any():
        avail = numpy.minimum(counts + received, length)
        s = numpy.minimum(chunk_words, avail - sent)
        # progress: if no rank can send, sum(counts) == 0 (see module doc)
        assert s.any(), 'ring schedule stalled'
        sent += s
        received += numpy.roll(s, 1)
        rounds.append(s)
    return rounds


def ring_allgatherv(comm, sendbuf, chunk_words=DEFAULT_CHUNK_WORDS,
                    counts=None):
    """Pipelined ring allgatherv of uint32 blocks.

    Returns ``(recvbuf, counts)``: all blocks concatenated in rank order.
    """
    if int(chunk_words) < 1:
        raise ValueError('chunk_words must be >= 1, got {!r}'.format(
            chunk_words))
    sendbuf = _as_words(sendbuf)
    if counts is None:
        counts = exchange_counts(comm, sendbuf.size)
    p, r = comm.size, comm.rank
    displs = numpy.concatenate([[0], numpy.cumsum(counts)[:-1]])
    total = int(counts.sum())
    recvbuf = numpy.empty(total, dtype=numpy.uint32)
    recvbuf[displs[r]:displs[r] + counts[r]] = sendbuf
    if p == 1:
        return recvbuf, counts
    # stream = own block, then the blocks of r-1, r-2, ..., r+1 as received
    stream = numpy.empty(total, dtype=numpy.uint32)
    own = int(counts[r])
    stream[:own] = sendbuf
    left, right = (r - 1) % p, (r + 1) % p
    sent = received = 0
    for s in ring_schedule(counts, int(chunk_words)):
        n_send, n_recv = int(s[r]), int(s[left])
        reqs = []
        if n_recv:
            reqs.append(comm.Irecv(
                [stream[own + received:own + received + n_recv],
                 MPI.UINT32_T], source=left, tag=_TAG))
        if n_send:
            reqs.append(comm.Isend([stream[sent:sent + n_send],
                                    MPI.UINT32_T], dest=right, tag=_TAG))
        MPI.Request.Waitall(reqs)
        sent += n_send
        received += n_recv
    pos = own
    for k in range(1, p):
        src = (r - k) % p
        n = int(counts[src])
        recvbuf[displs[src]:displs[src] + n] = stream[pos:pos + n]
        pos += n
    return recvbuf, counts


def mpi_allgatherv(comm, sendbuf, counts=None):
    """MPI's own Allgatherv; same result as :func:`ring_allgatherv`."""
    sendbuf = _as_words(sendbuf)
    if counts is None:
        counts = exchange_counts(comm, sendbuf.size)
    displs = numpy.concatenate([[0], numpy.cumsum(counts)[:-1]])
    recvbuf = numpy.empty(int(counts.sum()), dtype=numpy.uint32)
    comm.Allgatherv([sendbuf, MPI.UINT32_T],
                    [recvbuf, counts.tolist(), displs.tolist(),
                     MPI.UINT32_T])
    return recvbuf, counts


ALLGATHERV = {'ring': ring_allgatherv, 'mpi': mpi_allgatherv}


def allgatherv(comm, sendbuf, method='ring', **kwargs):
    """Dispatch to ``'ring'`` or ``'mpi'``."""
    try:
        fn = ALLGATHERV[method]
    except KeyError:
        raise ValueError("allgatherv must be 'ring' or 'mpi', got {!r}"
                         .format(method))
    return fn(comm, sendbuf, **kwargs)


def split_blocks(recvbuf, counts):
    """The per-rank blocks of a gathered buffer."""
    bounds = numpy.concatenate([[0], numpy.cumsum(counts)])
    return [recvbuf[bounds[i]:bounds[i + 1]] for i in range(len(counts))]


def _as_words(buf):
    buf = numpy.ascontiguousarray(buf)
    if buf.dtype != numpy.uint32 or buf.ndim != 1:
        raise TypeError('allgatherv sends 1-D uint32 arrays, got {} {}'
                        .format(buf.dtype, buf.shape))
    return buf
