"""The whole-model decode + mean on a GPU: one upload and one kernel launch
per step, whatever the number of tensors and ranks (issue 25).

The question this module answers: how do every rank's messages become
the parameters' gradients on the device without a launch per tensor?
The messages are validated on the host, where MPI left them (a bad one is
refused before anything moves).  A descriptor per (rank, tensor) (body
offset, count, kind, e_k, scale) and the bodies go up in one copy; gap-coded
groups (FMT_GAP) arrive as FMT_POW2 words, expanded on the host, until the
format has a layout the device can decode in parallel.  Then one
``vgc_model_decode_mean`` thread per element of the model finds what each
rank sent for it (binary search in each rank's group), adds the values in
rank order from +0.0 (``dense``: MPI's rank-order tree), and writes the
mean in the parameter dtype into one new array; each ``param.grad``
becomes a view of it.  The sums and means equal
:func:`chainer_vgc.exchange.sum_messages` + ``write_mean`` bit for bit
(``tests/test_device_step.py``).

Applies when every parameter has a gradient and shares one dtype, the
tensors have at most 2**28 elements and no message carries FMT_QSGD;
otherwise :mod:`chainer_vgc.exchange` decodes tensor by tensor.
"""

import numpy

from chainer_vgc import backend
from chainer_vgc import codec
from chainer_vgc import kernels
from chainer_vgc import native_gap
from chainer_vgc.codec.gap import span_parts
from chainer_vgc.codec.message import walk

#: words of a (rank, tensor) descriptor, and the body kinds
#: (kernels/vgc_numerics.cuh)
DESC_WORDS = 6
POW2, RAW32, RAW64, DENSE32, DENSE64 = 1, 2, 3, 4, 5
#: ranks the dense tree adds in registers (more: tensor by tensor)
TREE_MAX = 64


def applies(blocks, compressor, params, grads, dense):
    """Whether :func:`mean` can decode this step (before reading any
    message: the formats are checked by :func:`mean` itself)."""
    if any(g is None for g in grads) or not params:
        return False
    if len({numpy.dtype(p.dtype) for p in params}) != 1:
        return False
    if any(n > codec.MAX_INDEX for n in compressor.sizes):
        return False
    return not (dense and len(blocks) > TREE_MAX)


def _bodies(blocks, sizes, decoder):
    """(descriptors uint32 [ranks, tensors, DESC_WORDS], bodies) of the
    validated messages, or None when one carries FMT_QSGD."""
    n = len(sizes)
    desc = numpy.zeros((len(blocks), n, DESC_WORDS), numpy.uint32)
    parts, pos = [], desc.size
    for b, block in enumerate(blocks):
        for g in walk(block, sizes):
            if g.fmt == codec.FMT_QSGD:
                return None
            if g.fmt == codec.FMT_RAW:
                dense = bool(g.a & codec.RAW_DENSE)
                f64 = bool(g.a & codec.RAW_FLOAT64)
                kind = (DENSE64 if f64 else DENSE32) if dense else (
                    RAW64 if f64 else RAW32)
                pieces = [(g.tensor_id, g.body, kind)]
            elif g.fmt == codec.FMT_POW2:
                pieces = [(g.tensor_id, g.body, POW2)]
            else:  # FMT_GAP, as FMT_POW2 words
                pieces = [(t, (nib.astype(numpy.uint32)
                               << numpy.uint32(codec.INDEX_BITS))
                           | index.astype(numpy.uint32), POW2)
                          for t, index, nib in span_parts(g, sizes, decoder)]
            for t, body, kind in pieces:
                desc[b, t] = (pos & 0xFFFFFFFF, pos >> 32, g.count
                              if kind != POW2 else body.size, kind,
                              g.a if kind == POW2 else 0,
                              g.b if kind == POW2 else 0)
                parts.append(body)
                pos += body.size
    return desc, parts


def mean(blocks, compressor, params, size, dense, rescale):
    """``param.grad`` = the mean of the (validated) ``blocks`` for every
    parameter; False (nothing done) when a message carries FMT_QSGD."""
    got = _bodies(blocks, compressor.sizes,
                  native_gap.codec_or_reference()[0])
    if got is None:
        return False
    desc, parts = got
    xp = backend.get_array_module(params[0].array)
    bounds = numpy.concatenate([[0], numpy.cumsum(compressor.sizes)]).astype(
        numpy.int64)
    # [the tensors' offsets (int64)][descriptors][bodies]: one upload
    head = 2 * bounds.size
    staged = backend.host_buffer(
        head + desc.size + sum(b.size for b in parts), numpy.uint32)
    staged[:head] = bounds.view(numpy.uint32)
    staged[head:head + desc.size] = desc.reshape(-1)
    pos = head + desc.size
    for body in parts:
        staged[pos:pos + body.size] = body
        pos += body.size
    dtype = numpy.dtype(params[0].dtype)
    with backend.device_scope(params[0].array):
        uploaded = xp.asarray(staged)
        offsets = uploaded[:head].view(numpy.int64)
        buf = uploaded[head:]  # body offsets count from here
        out = xp.empty(int(bounds[-1]), dtype)
        rescaled = rescale not in (None, 1)
        kernels.get_kernel('vgc_model_decode_mean')(
            buf, offsets, numpy.int32(len(compressor.sizes)),
            numpy.int32(len(blocks)), bool(dense), rescaled,
            numpy.float64(1.0 / size),
            numpy.float64(rescale if rescaled else 1.0),
            numpy.float32(numpy.float16(1.0 / size)), out)
    for p, lo, hi in zip(params, bounds[:-1], bounds[1:]):
        p.grad = out[lo:hi].reshape(p.shape)
    return True

