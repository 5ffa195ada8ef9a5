"""The reference engine: the readable step, both directions, that every
fast engine equals bit for bit.

The question this module answers: what are a compress step's message and
state, and what does ``param.grad`` become from every rank's message, in
plain NumPy (or CuPy, tensor by tensor)?

* compress (paper Alg. 1 and its variants, Sec. 4): the inputs checked
  and agreed on before any state moves
  (:meth:`~chainer_vgc.compressor.GradientCompressor.validate`), then the
  rule's own ``compress`` tensor by tensor, and the groups packed into one
  uint32 message (:func:`chainer_vgc.codec.pack`);
* mean (Sec. 4.3): every message decoded
  (:func:`chainer_vgc.codec.decode_into`) and the messages summed in rank
  order (indices may overlap, :func:`sum_messages`), then multiplied by
  1/p as ChainerMN's naive communicator does (:func:`write_mean`).  A dense group (method
  ``'none'``) is summed in a rank-order pairwise tree, MPI's
  recursive-doubling order, so that 2^k ranks reproduce a dense allreduce
  bit for bit.

The native engine (:mod:`chainer_vgc.engines.native.engine`) and the GPU
engine (:mod:`chainer_vgc.engines.cuda.engine`) take the same calls and
fall back to these where their fused paths do not apply; the functions
below are the arithmetic they share (the mean in a parameter's dtype, a
gradient-less parameter's ``None``).
"""

import functools

import numpy

from chainer_vgc.backends import arrays
from chainer_vgc.backends.cuda import kernels
from chainer_vgc import codec
from chainer_vgc import faults


class ReferenceEngine(object):
    """The NumPy reference (``backend='numpy'``), and every engine's
    fallback: a compressor's step in the rule's own code."""

    name = 'numpy'

    def __init__(self, compressor):
        self.compressor = compressor

    def fuses(self, grads):
        """Whether :meth:`compress` runs a fused pass for ``grads`` (never,
        here)."""
        return False

    def compress(self, grads, sqsums, agree):
        """One step (:meth:`GradientCompressor.compress
        <chainer_vgc.compressor.GradientCompressor.compress>`): ``(message,
        mergeable, reused)``, the groups packed, whether
        :func:`chainer_vgc.codec.merge_spans` may join two of them, and
        whether the message is a view of a buffer the next step reuses
        (not here)."""
        comp = self.compressor
        sqsums = comp.validate(grads, sqsums, True, agree)
        comp.rule.prepare(grads)
        comp.rule.begin_step()
        groups = []
        xp = numpy
        for i, (g, s) in enumerate(zip(grads, sqsums)):
            if g is None:
                continue
            xp = arrays.get_array_module(g)
            flat_s = None if s is None else s.reshape(-1)
            # state and work arrays on the gradient's device
            with arrays.device_scope(g), numpy.errstate(over='ignore',
                                                        invalid='ignore'):
                if comp.states[i] is None:
                    comp.states[i] = comp.new_state(i, xp)
                group = comp.rule.compress(i, g.reshape(-1), flat_s,
                                           comp.states[i])
                overflowed = [(key, arr) for key, arr in
                              comp.states[i].items()
                              if not faults.all_finite(arr)]
            for key, arr in overflowed[:1]:
                if agree is not None:  # the others must not wait
                    faults.settle(agree(faults.OVERFLOW), faults.overflow(
                        key, comp.names[i], arr.dtype))
                raise faults.overflow(key, comp.names[i], arr.dtype)
            if group is not None:
                groups.append(group)
        if agree is not None:
            faults.settle(agree(faults.OK), None)
        comp.last_sent = sum(grp.count for grp in groups)
        return codec.pack(groups, xp), True, False

    def gap_codec(self):
        """``(decoder, encoder)`` of FMT_GAP bodies: ``(None, None)``, the
        codec's own (:func:`chainer_vgc.codec.gap_decode_body`,
        ``gap_body``)."""
        return None, None

    def decode_into(self, message, outs):
        """Add one message's elements into ``outs``; the number added."""
        return codec.decode_into(message, outs, self.compressor.sizes)

    def validate(self, blocks, dtypes, table=False, codes=True):
        """Check every host message against the model as
        :func:`chainer_vgc.codec.unpack` does; the elements each carries
        (with ``table``: and None, the group table only the native walk
        returns).  A fault raises
        :class:`~chainer_vgc.codec.WireFormatError`.  ``codes``: see the
        native engine's."""
        sizes = self.compressor.sizes
        counts = [sum(int(d.index.size)
                      for d in codec.unpack(block, sizes, dtypes))
                  for block in blocks]
        return (counts, None) if table else counts

    def mean(self, blocks, params, grads, size, zero_fill, dense,
             rescale=None, present=None):
        """``param.grad`` = (sum of every worker's elements) * (1 / size)
        (see :func:`chainer_vgc.exchange.mean.mean_gradients`); the number
        of elements each message carries."""
        write_mean(params, grads,
                   sum_messages(blocks, self.compressor.sizes, params, dense),
                   size, zero_fill, rescale, present)
        return [codec.message_count(b) for b in blocks]

    def memory(self):
        """Bytes this engine holds beyond the rule's state, by role."""
        return {'spare_residuals': 0, 'message': 0}


# -- the arithmetic every engine shares -------------------------------------
def sum_messages(blocks, sizes, params, dense):
    """Decode every worker's message and add them up, in rank order.

    ``dense`` (method 'none'): a rank-order pairwise tree, the order of
    MPI's recursive doubling, so that 2^k ranks reproduce a dense allreduce
    bit for bit (two ranks: any order does).
    """
    xp = arrays.get_array_module(blocks[0]) if blocks else numpy
    adders = [functools.partial(codec.decode_into, block, sizes=sizes)
              for block in blocks]
    return rank_order_sum(adders, lambda: zero_sums(params, xp), dense)


def zero_sums(params, xp):
    """Zeros of each parameter's shape in its state dtype, on its device."""
    out = []
    for p in params:
        with arrays.device_scope(p.array):
            out.append(xp.zeros(p.shape, dtype=arrays.state_dtype(p.dtype)))
    return out


def rank_order_sum(adders, zeros, dense):
    """Every worker's elements added up in rank order: ``adders[r](outs)``
    adds worker r's message into ``outs``, fresh ``zeros()``; ``dense``:
    each worker into its own zeros, then the pairwise tree
    (:func:`tree_sum`)."""
    if dense:
        per_rank = []
        for add in adders:
            per_rank.append(zeros())
            add(per_rank[-1])
        return tree_sum(per_rank)
    outs = zeros()
    for add in adders:
        add(outs)
    return outs


def tree_sum(per_rank):
    """Pairwise sums of per-rank lists of arrays in rank order (MPI's
    recursive doubling), added with
    :func:`chainer_vgc.backends.cuda.kernels.add_into`."""
    while len(per_rank) > 1:
        nxt = [[kernels.add_into(a.copy(), b)
                for a, b in zip(per_rank[k], per_rank[k + 1])]
               for k in range(0, len(per_rank) - 1, 2)]
        if len(per_rank) % 2:
            nxt.append(per_rank[-1])
        per_rank = nxt
    return per_rank[0]


def stays_none(g, zero_fill, present, i, received):
    """Whether parameter i, without a gradient here, keeps ``grad = None``:
    only with ``zero_fill`` off, and when no worker had a gradient for it
    (``present``, the workers' agreement) or, without that, when nothing
    nonzero was received (``received()``)."""
    if g is not None or zero_fill:
        return False
    return not (present[i] if present is not None else received())


def write_mean(params, grads, sums, size, zero_fill, rescale=None,
               present=None):
    """param.grad = sum * (1 / size) in the parameter dtype (as ChainerMN);
    ``rescale`` (the loss scale): times it, in the sum's dtype before the
    cast to a float16 parameter's dtype (see :func:`finish_mean`);
    ``present``: see :func:`chainer_vgc.exchange.mean.mean_gradients`."""
    for i, (p, g, total) in enumerate(zip(params, grads, sums)):
        if stays_none(g, zero_fill, present, i,
                      lambda: bool((total != 0).any())):
            continue  # nobody sent anything for a gradient-less param
        with arrays.device_scope(p.array):
            p.grad = finish_mean(total, p.dtype, size, rescale)


def finish_mean(total, dtype, size, rescale):
    """The mean in ``dtype`` of a sum (ours to reuse): the sum cast to
    ``dtype`` times 1/size (as ChainerMN); with a loss scale S, the sum
    times 1/size times S in its own (state) dtype, then the cast, so that a
    float16 gradient is neither rounded unscaled nor multiplied by an S
    that float16 cannot hold."""
    dtype = numpy.dtype(dtype)
    if not isinstance(total, numpy.ndarray):  # (a CuPy array)
        return _device_finish_mean(total, dtype, size, rescale)
    if rescale in (None, 1):
        mean = total.astype(dtype, copy=False)
        mean *= 1.0 / size
        return mean
    total *= total.dtype.type(1.0 / size)
    total *= total.dtype.type(rescale)
    return total.astype(dtype, copy=False)


def _device_finish_mean(total, dtype, size, rescale):
    """:func:`finish_mean` with the subnormal rule's kernels, the same
    values: float16 products are taken in float32 (exact for two float16
    numbers) and rounded once to float16, as NumPy's float16 multiply
    does."""
    if rescale not in (None, 1):
        total = kernels.scale(kernels.scale(total, 1.0 / size), rescale)
        return kernels.cast(total, dtype)
    mean = kernels.cast(total, dtype)
    if dtype == numpy.float16:
        k = numpy.float32(numpy.float16(1.0 / size))
        return kernels.cast(kernels.scale(kernels.cast(mean, numpy.float32),
                                          k), dtype)
    return kernels.scale(mean, 1.0 / size)
