"""Moving bytes between the ranks: the collectives one exchange runs.

The question this module answers: how do the bytes of one exchange travel,
and nothing else?  :class:`Collectives` is a ChainerMN communicator (on
ChainerMN's ``MpiCommunicatorBase``) that knows no method and no model
state: the allgatherv of the compressed messages (paper Sec. 4.3: every
worker sends its elements to every other worker;
:mod:`chainer_vgc.chainermn.transport`), small object allgathers for the checks
every rank must agree on, the dense group's allreduce (ChainerMN's naive
mean, or one float16 allreduce as ChainerMN's ``allreduce_grad_dtype``),
and rank 0's parameters to every rank.  Device arrays travel through host
memory unless ``cuda_aware_mpi``.

:class:`~chainer_vgc.chainermn.communicator.VGCCommunicator` is one; a background
exchange (double buffering) runs on a second one over a duplicate of the
MPI communicator, so that its collectives never mix with the main thread's.
"""

import weakref

from chainer_vgc.chainermn import mpi_support

# ChainerMN loads mpi4py.MPI, which needs an MPI library: without one, fail
# here with an error that says how to get it
mpi_support.import_mpi()

import chainer  # NOQA: E402
from chainermn.communicators import mpi_communicator_base  # NOQA: E402
import numpy  # NOQA: E402

from chainer_vgc.backends import arrays  # NOQA: E402
from chainer_vgc import reporting  # NOQA: E402
from chainer_vgc.chainermn import transport  # NOQA: E402
from chainer_vgc.params import model_params  # NOQA: E402
from chainer_vgc.params import with_gradients  # NOQA: E402


class Collectives(mpi_communicator_base.MpiCommunicatorBase):
    """The collectives of one exchange over ``mpi_comm``.

    Args:
        mpi_comm: an mpi4py communicator.
        allgatherv: ``'ring'`` (pipelined ring on point-to-point calls) or
            ``'mpi'`` (``MPI_Allgatherv``).
        chunk_words: pipelining chunk of the ring, in 32-bit words.
        cuda_aware_mpi: declare that MPI accepts device pointers; by
            default (False) every collective on GPU arrays goes through
            host memory (the compressed exchange always does).
    """

    def __init__(self, mpi_comm, allgatherv='ring',
                 chunk_words=transport.DEFAULT_CHUNK_WORDS,
                 cuda_aware_mpi=False):
        allgatherv, chunk_words = transport.check_arguments(allgatherv,
                                                            chunk_words)
        super(Collectives, self).__init__(mpi_comm)
        self.allgatherv_method = allgatherv
        self.chunk_words = chunk_words
        self.cuda_aware_mpi = bool(cuda_aware_mpi)

    def transport_settings(self):
        """What every rank must agree on about the transport."""
        return (self.allgatherv_method, self.chunk_words,
                arrays.cpu_backend())

    def duplicate(self):
        """The same collectives on a duplicate of the MPI communicator
        (collective: every rank calls it).  The duplicate is freed by
        :meth:`free`, or when the returned object is garbage-collected:
        a run that makes and drops many (double-buffered optimizers in a
        sweep) does not exhaust MPI's communicators."""
        dup = Collectives(self.mpi_comm.Dup(), self.allgatherv_method,
                          self.chunk_words, self.cuda_aware_mpi)
        dup.free_when_collected(free_mpi_comm, dup.mpi_comm)
        return dup

    def free_when_collected(self, release, *args):
        """``release(*args)`` (what frees this duplicate's MPI
        communicators) runs at :meth:`free`, or when this object is
        garbage-collected, whichever comes first, once; not at exit
        (``MPI_Finalize`` frees what is left).  For :meth:`duplicate` and
        its overrides (``args`` must not refer to this object)."""
        self._free = weakref.finalize(self, release, *args)
        self._free.atexit = False

    def free(self):
        """Free the MPI communicator of one made by :meth:`duplicate` (at
        most once; no-op after ``MPI.Finalize``)."""
        release = getattr(self, '_free', None)
        if release is not None:
            release()

    def multi_node_mean_grad(self, model, zero_fill=False):
        """ChainerMN's naive exchange: every gradient's mean, uncompressed."""
        self.dense_mean(model_params(model)[1], zero_fill)

    # -- the exchange's collectives ------------------------------------------
    def allgather_obj(self, obj):
        """Every rank's ``obj``, in rank order (one small allgather)."""
        return self.mpi_comm.allgather(obj)

    def allgatherv_words(self, message, into=None):
        """Every rank's uint32 message, in rank order: (blocks, counts);
        received into ``into(words)``'s buffer where given
        (:mod:`chainer_vgc.chainermn.transport`)."""
        return transport.allgatherv(self.mpi_comm, message,
                                    method=self.allgatherv_method,
                                    chunk_words=self.chunk_words, into=into)

    def allreduce_sum(self, buffer):
        """Sum ``buffer`` (a flat float32/float64 array, the same size on
        every rank) over the ranks, in place: one ``MPI_Allreduce``
        (a factor round of PowerSGD, :meth:`chainer_vgc.compressor.
        GradientCompressor.reduce`); a device array goes through host
        memory unless ``cuda_aware_mpi``."""
        from mpi4py import MPI
        if self.cuda_aware_mpi or isinstance(buffer, numpy.ndarray):
            arrays.finish_stream(buffer)  # (MPI reads the device memory)
            self.mpi_comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
            return buffer
        host = arrays.to_numpy(buffer)
        self.mpi_comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)
        with arrays.device_scope(buffer):
            buffer[...] = arrays.get_array_module(buffer).asarray(host)
        return buffer

    def dense_mean(self, params, zero_fill, dense_dtype=None):
        """The dense group's gradients become their mean over the ranks:
        ChainerMN's naive exchange (one allreduce per parameter, float16
        summed in float32, non-finite values passed through, ValueError in
        debug mode), or with ``dense_dtype`` float16 one allreduce of the
        whole group in float16.  Returns (elements per rank, bytes each
        rank sends with a ring allreduce)."""
        grads = with_gradients(params, zero_fill)
        if not grads:
            return 0, 0.0
        p = self.size
        if dense_dtype is None:
            for q in grads:
                self._multi_node_mean(None, q.grad)
        else:
            allreduce_mean_float16(self.mpi_comm, grads)
        wire = reporting.allreduce_wire(grads, p,
                                        float16=dense_dtype is not None)
        return sum(q.size for q in grads), (wire if p > 1 else 0.0)

    def bcast_data(self, model):
        """Rank 0's parameters to every rank (ChainerMN's first update).

        Unless ``cuda_aware_mpi``, the parameters travel through one host
        buffer (their bytes, float16 included), so MPI never sees a device
        pointer; the result equals ChainerMN's ``bcast_data`` bit for bit.
        """
        if self.cuda_aware_mpi:
            return super(Collectives, self).bcast_data(model)
        params = [p for p in model_params(model)[1] if p.array is not None]
        hosts = [numpy.ascontiguousarray(arrays.to_numpy(p.array))
                 for p in params]
        buf = numpy.empty(sum(h.nbytes for h in hosts), dtype=numpy.uint8)
        pos = 0
        for h in hosts:
            buf[pos:pos + h.nbytes] = h.reshape(-1).view(numpy.uint8)
            pos += h.nbytes
        self.mpi_comm.Bcast(buf, root=0)
        pos = 0
        for p, h in zip(params, hosts):
            got = buf[pos:pos + h.nbytes].view(h.dtype).reshape(h.shape)
            pos += h.nbytes
            p.array[...] = p.xp.asarray(got)

    def _multi_node_mean(self, sendbuf, recvbuf):
        """ChainerMN's mean of one array over the ranks; a device array is
        staged through host memory unless ``cuda_aware_mpi`` (same
        per-array Allreduce, so the same sums)."""
        if self.cuda_aware_mpi or isinstance(recvbuf, numpy.ndarray):
            return super(Collectives, self)._multi_node_mean(sendbuf,
                                                             recvbuf)
        if sendbuf is None and self.size == 1 and not chainer.is_debug():
            # one rank: the mean is the array itself (ChainerMN's sum of
            # one, times 1.0, is exact); no round trip through the host,
            # which cost a one-rank 'none' step 29 ms of the App. D VGG's
            # 66 ms on an H200 (issue 36)
            return
        host = arrays.to_numpy(recvbuf)
        src = None if sendbuf is None else arrays.to_numpy(sendbuf)
        super(Collectives, self)._multi_node_mean(src, host)
        with recvbuf.device:  # a CuPy array: back onto its device
            recvbuf[...] = arrays.get_array_module(recvbuf).asarray(host)


def free_mpi_comm(mpi_comm):
    """``MPI_Comm_free`` of a duplicate, unless MPI is finalized (local in
    MPICH and Open MPI: a rank frees its handle whenever its copy is
    dropped; the context id returns when every rank has freed it)."""
    from mpi4py import MPI
    if not MPI.Is_finalized() and mpi_comm != MPI.COMM_NULL:
        mpi_comm.Free()


def allreduce_mean_float16(mpi_comm, params):
    """The mean of the ``params``' gradients over the ranks, through one
    allreduce of all of them cast to float16 (summed in float16, pairwise
    in whatever order MPI chooses, each sum rounded once), then times 1/p
    in float32 and cast back: ChainerMN's ``allreduce_grad_dtype`` float16.
    Device gradients are staged through one host buffer."""
    from mpi4py import MPI
    sizes = [q.size for q in params]
    on_device = any(arrays.get_array_module(q.grad) is not numpy
                    for q in params)
    buf = arrays.host_buffer(sum(sizes), numpy.float16, pinned=on_device)
    pos = 0
    for q, n in zip(params, sizes):
        buf[pos:pos + n] = arrays.to_numpy(q.grad).reshape(-1)
        pos += n
    mpi_comm.Allreduce(MPI.IN_PLACE, [buf.view(numpy.uint16),
                                      MPI.UINT16_T], op=_float16_sum())
    mean = buf.astype(numpy.float32) * numpy.float32(1.0 / mpi_comm.size)
    pos = 0
    for q, n in zip(params, sizes):
        part = mean[pos:pos + n].reshape(q.shape).astype(q.dtype)
        pos += n
        with arrays.device_scope(q.grad):
            q.grad[...] = q.xp.asarray(part)


_FLOAT16_SUM = []


def _float16_sum():
    """MPI reduction op: elementwise float16 sum of 16-bit words."""
    if not _FLOAT16_SUM:
        from mpi4py import MPI

        def add(inbuf, outbuf, datatype):
            a = numpy.frombuffer(inbuf, dtype=numpy.float16)
            b = numpy.frombuffer(outbuf, dtype=numpy.float16)
            with numpy.errstate(over='ignore', invalid='ignore'):
                b[...] = (a.astype(numpy.float32) + b).astype(numpy.float16)
        _FLOAT16_SUM.append(MPI.Op.Create(add, commute=True))
    return _FLOAT16_SUM[0]
