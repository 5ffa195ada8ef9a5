"""Transport: allgatherv of the ranks' uint32 messages (paper Sec. 4.3, 5).

The question this module answers: how do the ranks' compressed messages
reach every rank?  (What is done with them there is
:mod:`chainer_vgc.exchange.mean`'s question.)

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
by the caller.  ``into(words)``, where given, returns the host array (1-D
uint32, C-contiguous, of that many words) the blocks are received into:
for a model on a GPU, the pinned buffer its decode uploads from, so that
nothing is copied between MPI and the upload.
"""

import numpy

#: default pipelining chunk (words): 256 KiB
DEFAULT_CHUNK_WORDS = 65536
_TAG = 0x5647


def exchange_counts(comm, count):
    """Block sizes of every rank (one small Allgather)."""
    counts = numpy.zeros(comm.size, dtype=numpy.int64)
    comm.Allgather(numpy.array([count], dtype=numpy.int64), counts)
    return counts


def ring_schedule(counts, chunk_words):
    """Words each rank sends in each round of the pipelined ring.

    Returns a list of per-round tuples ``s`` where rank r sends ``s[r]``
    words to rank r+1 (and so receives ``s[r-1]`` from rank r-1).  A rank
    forwards only words it already holds, at most ``chunk_words`` a round.
    If no rank can send, every block is empty (the words held sum to the
    words sent), so the loop ends: no round is ever empty for all ranks.
    """
    counts = [int(c) for c in counts]
    p = len(counts)
    if p < 2:
        return []
    total = sum(counts)
    length = [total - counts[(r + 1) % p] for r in range(p)]
    sent = [0] * p
    held = list(counts)  # own block + received so far
    rounds = []
    while True:
        s = tuple(min(chunk_words, min(held[r], length[r]) - sent[r])
                  for r in range(p))
        if not any(s):
            break
        for r in range(p):
            sent[r] += s[r]
            held[r] += s[r - 1]
        rounds.append(s)
    assert sent == length, 'ring schedule stalled'
    return rounds


def check_arguments(method='ring', chunk_words=DEFAULT_CHUNK_WORDS):
    """The allgatherv's settings checked: ``method`` ``'ring'`` or
    ``'mpi'``, ``chunk_words`` >= 1 (checked for both methods, although
    ``'mpi'`` does not use it).  Returns ``(method, chunk_words)`` as
    :func:`allgatherv` takes them; raises ValueError naming the bad one."""
    if method not in ALLGATHERV:
        raise ValueError("allgatherv must be 'ring' or 'mpi', got {!r}"
                         .format(method))
    return method, _check_chunk_words(chunk_words)


def _check_chunk_words(chunk_words):
    if int(chunk_words) < 1:
        raise ValueError('chunk_words must be >= 1, got {!r}'.format(
            chunk_words))
    return int(chunk_words)


def ring_allgatherv(comm, sendbuf, chunk_words=DEFAULT_CHUNK_WORDS,
                    counts=None, into=None):
    """Pipelined ring allgatherv of uint32 blocks.

    Returns ``(blocks, counts)``: ``blocks[i]`` is rank i's block.  The
    blocks are views into one buffer (``into``'s, see the module docstring)
    laid out in ring order (own block, then r-1, r-2, ...), which is exactly
    the stream this rank sends on, so nothing is copied after the exchange.
    """
    return _ring_allgatherv(comm, sendbuf, _check_chunk_words(chunk_words),
                            counts, into)


def _receive_buffer(into, words):
    """The receive buffer: ``into(words)`` checked, or a new array."""
    if into is None:
        return numpy.empty(words, dtype=numpy.uint32)
    buf = into(words)
    if not (isinstance(buf, numpy.ndarray) and buf.dtype == numpy.uint32
            and buf.shape == (words,) and buf.flags.c_contiguous):
        raise ValueError('allgatherv: into({}) must return a C-contiguous '
                         '1-D uint32 host array of {} words'.format(
                             words, words))
    return buf


def _ring_allgatherv(comm, sendbuf, chunk_words, counts, into=None):
    """:func:`ring_allgatherv` with ``chunk_words`` already checked."""
    from mpi4py import MPI  # here: importing this module loads no MPI
    sendbuf = _as_words(sendbuf)
    if counts is None:
        counts = exchange_counts(comm, sendbuf.size)
    p, r = comm.size, comm.rank
    own = int(counts[r])
    if sendbuf.size != own:
        raise ValueError('sendbuf has {} words but counts[{}] = {}'.format(
            sendbuf.size, r, own))
    stream = _receive_buffer(into, int(counts.sum()))
    stream[:own] = sendbuf
    left, right = (r - 1) % p, (r + 1) % p
    sent = received = 0
    for s in ring_schedule(counts, chunk_words):
        n_send, n_recv = s[r], s[left]
        # both sides follow the same schedule, so every send has its
        # receive; a rank that only sends or only receives cannot close a
        # cycle of blocking sends (its neighbour receives from it)
        out = [stream[sent:sent + n_send], MPI.UINT32_T]
        into = [stream[own + received:own + received + n_recv],
                MPI.UINT32_T]
        if n_send and n_recv:
            comm.Sendrecv(out, dest=right, sendtag=_TAG, recvbuf=into,
                          source=left, recvtag=_TAG)
        elif n_send:
            comm.Send(out, dest=right, tag=_TAG)
        elif n_recv:
            comm.Recv(into, source=left, tag=_TAG)
        sent += n_send
        received += n_recv
    blocks = [None] * p
    pos = 0
    for k in range(p):
        src = (r - k) % p
        n = int(counts[src])
        blocks[src] = stream[pos:pos + n]
        pos += n
    return blocks, counts


def mpi_allgatherv(comm, sendbuf, counts=None, into=None):
    """MPI's own Allgatherv; same ``(blocks, counts)`` as
    :func:`ring_allgatherv` (the blocks in rank order)."""
    from mpi4py import MPI  # here: importing this module loads no MPI
    sendbuf = _as_words(sendbuf)
    if counts is None:
        counts = exchange_counts(comm, sendbuf.size)
    displs = numpy.concatenate([[0], numpy.cumsum(counts)[:-1]])
    recvbuf = _receive_buffer(into, int(counts.sum()))
    comm.Allgatherv([sendbuf, MPI.UINT32_T],
                    [recvbuf, counts.tolist(), displs.tolist(),
                     MPI.UINT32_T])
    return split_blocks(recvbuf, counts), counts


ALLGATHERV = {'ring': ring_allgatherv, 'mpi': mpi_allgatherv}


def allgatherv(comm, sendbuf, method='ring',
               chunk_words=DEFAULT_CHUNK_WORDS, counts=None, into=None):
    """Dispatch to ``'ring'`` or ``'mpi'`` (which ignores ``chunk_words``);
    the arguments are checked by :func:`check_arguments`.  Returns
    ``(blocks, counts)``."""
    method, chunk_words = check_arguments(method, chunk_words)
    if method == 'ring':
        return _ring_allgatherv(comm, sendbuf, chunk_words, counts, into)
    return mpi_allgatherv(comm, sendbuf, counts=counts, into=into)


def split_blocks(recvbuf, counts):
    """The per-rank blocks of a buffer gathered in rank order."""
    bounds = numpy.concatenate([[0], numpy.cumsum(counts)])
    return [recvbuf[bounds[i]:bounds[i + 1]] for i in range(len(counts))]


def _as_words(buf):
    buf = numpy.ascontiguousarray(buf)
    if buf.dtype != numpy.uint32 or buf.ndim != 1:
        raise TypeError('allgatherv sends 1-D uint32 arrays, got {} {}'
                        .format(buf.dtype, buf.shape))
    return buf
