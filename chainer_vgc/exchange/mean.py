"""The exchange arithmetic of one step: from every rank's message to the mean.

The question this module answers: once every rank holds every rank's
message, what does ``param.grad`` become?  The data flow of one step runs
one way (paper Sec. 4.3):

1. this worker's gradients (:func:`local_gradients`; missing ones as zeros
   with ``zero_fill``), divided by the loss scale (:func:`unscaled`), go to
   the compressor, which makes one uint32 message;
2. the transport (an allgatherv, :mod:`chainer_vgc.chainermn.transport`)
   gives every rank every rank's message (where the GPU engine takes them,
   straight into its upload buffer: :func:`receive_into`); nothing is
   re-compressed;
3. every message is decoded and the messages are summed in rank order
   (indices may overlap), then multiplied by 1/p as ChainerMN's naive
   communicator does, into ``param.grad`` (:func:`mean_gradients`).

Step 3 runs in the compressor's engine for the parameters' arrays, which
owns the decode (:mod:`chainer_vgc.engines`): the reference's arithmetic
(:func:`chainer_vgc.engines.reference.sum_messages` +
:func:`~chainer_vgc.engines.reference.write_mean`), the native engine's one
fused call or the GPU engine's whole-model decode, equal bit for bit.

No MPI here: :class:`~chainer_vgc.chainermn.communicator.VGCCommunicator`
and the one-process :class:`~chainer_vgc.harness.simulation.SimulatedWorkers`
call the same functions in the same rank order, which is why the
simulation matches an ``mpiexec`` run bit for bit.
"""


from chainer_vgc.backends import arrays
from chainer_vgc.backends.cuda import kernels


# -- this worker: what goes into the compressor ----------------------------
def local_gradients(params, sqsums, zero_fill):
    """This worker's gradients and sums of squares for the compressor.

    With ``zero_fill`` (ChainerMN's default) a missing gradient counts as
    zeros, as in ChainerMN's communicators.
    """
    grads = [p.grad for p in params]
    if sqsums is not None:
        sqsums = [None if g is None else s for g, s in zip(grads, sqsums)]
    if zero_fill:
        def zeros(p):
            with arrays.device_scope(p.array):
                return p.xp.zeros_like(p.array)
        if sqsums is not None:
            sqsums = [zeros(p) if g is None else s
                      for p, g, s in zip(params, grads, sqsums)]
        grads = [zeros(p) if g is None else g
                 for p, g in zip(params, grads)]
    return grads, sqsums


def unscaled(grads, sqsums, loss_scale):
    """g / S and s / S**2 in the state dtypes (unchanged without S)."""
    if loss_scale in (None, 1):
        return grads, sqsums
    scale = float(loss_scale)

    def div(a, by):
        if a is None:
            return None
        sdt = arrays.state_dtype(a.dtype)
        with arrays.device_scope(a):  # (the subnormal rule on a GPU)
            return kernels.divide(kernels.cast(a, sdt), by)
    grads = [div(g, scale) for g in grads]
    if sqsums is not None:
        sqsums = [div(s, scale * scale) for s in sqsums]
    return grads, sqsums


# -- every rank: the gathered messages to param.grad -----------------------
def mean_gradients(blocks, compressor, params, grads, size, zero_fill,
                   dense, rescale=None, present=None):
    """``param.grad`` = (sum of every worker's elements) * (1 / size), in
    the compressor's engine for the parameters' arrays
    (:meth:`~chainer_vgc.compressor.GradientCompressor.engine_for`).

    ``grads``: this worker's gradients as compressed (None where it had
    none); ``dense``: the rank-order tree of method 'none'
    (:func:`chainer_vgc.engines.reference.sum_messages`); ``rescale``: the
    loss scale to multiply back
    (:func:`chainer_vgc.engines.reference.finish_mean`).  ``present[i]``:
    whether any worker had a gradient for parameter i (with
    ``zero_fill=False`` such a parameter gets the mean, zeros included, on
    every worker; without ``present``, a gradient-less parameter gets it
    only where something was sent).  Returns the number of elements each
    message carries.
    """
    engine = compressor.engine_for([p.array for p in params])
    return engine.mean(blocks, params, grads, size, zero_fill, dense,
                       rescale, present)


def receive_into(compressor, params, grads, size):
    """Where MPI should receive this step's ``size`` messages
    (:func:`chainer_vgc.chainermn.transport.allgatherv`'s ``into``): for
    parameters on a GPU, the GPU engine's upload buffer where its
    whole-model decode takes them
    (:meth:`chainer_vgc.engines.cuda.engine.CudaEngine.receive_into`);
    else None, a new host array."""
    engine = compressor.engine_for([p.array for p in params])
    if engine.name != 'cuda':
        return None
    return engine.receive_into(params, grads, size)
