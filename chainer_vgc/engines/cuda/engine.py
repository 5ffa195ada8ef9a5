"""The GPU engine: a compressor's steps on CuPy arrays, both directions,
with the buffers they keep from step to step.

The question this module answers: which GPU path runs a step, and what
does it fall back to?

* compress: the whole-model step (:mod:`.compress`, a fixed number of
  launches and one download) where it applies (every gradient on one
  device, one state dtype, no tensor over the 28-bit index, a rule with a
  registered GPU step), else the reference's
  :meth:`~chainer_vgc.engines.reference.ReferenceEngine.compress` with
  CuPy's arrays and the rules' CuPy kernels;
* mean: the messages are checked on the host where MPI left them, by the
  host engine (the native walk, or the reference's), for the whole-model
  decode (:mod:`.decode`) all but the FMT_GAP codes, which it checks on
  the device; they go up in one copy and are decoded and summed there.
  Otherwise (FMT_QSGD or FMT_SPARSE, a missing gradient) their FMT_GAP
  and FMT_SPARSE groups are
  expanded to indices on the host (:func:`chainer_vgc.codec.expand_gap`),
  uploaded in one copy (:func:`upload_blocks`) and decoded tensor by
  tensor on the device, in the reference's rank order
  (:func:`chainer_vgc.engines.reference.rank_order_sum`): its sums bit
  for bit.

What it holds (:class:`CudaEngine`): the whole-model step of the last
device it ran on (``step``) and a pinned host buffer per role
(:meth:`CudaEngine.staging`): ``'upload'``, the decode's one upload, which
MPI may receive into, and ``'fallback'``, the tensor-by-tensor decode's.
"""

import numpy

from chainer_vgc.backends import arrays
from chainer_vgc import codec
from chainer_vgc.engines import reference
from chainer_vgc.engines.cuda import compress as device_compress
from chainer_vgc.engines.cuda import decode as device_decode


class CudaEngine(reference.ReferenceEngine):
    """A compressor's steps on a GPU (the module doc); ``host``: the
    compressor's CPU engine, which checks the messages MPI received."""

    name = 'cuda'
    ROLES = ('upload', 'fallback')

    def __init__(self, compressor, host):
        super(CudaEngine, self).__init__(compressor)
        self.host = host
        #: the whole-model compress step of the last device it ran on
        #: (:class:`.compress.DeviceStep`), None until one runs
        self.step = None
        self._staging = {}

    def staging(self, role):
        """The :class:`~chainer_vgc.backends.arrays.HostStaging` of
        ``role``, made on first use and kept (the upload's size changes
        every step, and a new pinned buffer a step would pin more memory
        each step)."""
        if role not in self.ROLES:
            raise ValueError('chainer_vgc: no staging buffer {!r}; the '
                             'roles are {}'.format(role, self.ROLES))
        held = self._staging.get(role)
        if held is None:
            held = self._staging[role] = arrays.HostStaging()
        return held

    def held(self, role):
        """The staging buffer of ``role`` if one was made, else None."""
        return self._staging.get(role)

    def fuses(self, grads):
        return device_compress.step_for(self, grads) is not None

    def gap_codec(self):
        return self.host.gap_codec()

    def validate(self, blocks, dtypes, table=False, codes=True):
        return self.host.validate(blocks, dtypes, table, codes)

    # -- compress ----------------------------------------------------------
    def compress(self, grads, sqsums, agree):
        """The whole-model step where it applies, else the reference's;
        ``(message, mergeable, reused)``."""
        step = device_compress.step_for(self, grads)
        if step is None:
            return super(CudaEngine, self).compress(grads, sqsums, agree)
        message = step.compress(grads, sqsums, agree)
        return message, step.mergeable, True

    # -- mean --------------------------------------------------------------
    def receive_into(self, params, grads, size):
        """Where MPI should receive this step's ``size`` messages
        (:func:`chainer_vgc.chainermn.transport.allgatherv`'s ``into``):
        when the whole-model decode takes them, the buffer it uploads from
        (:func:`.decode.receive_into`); else None, a new host array."""
        if not device_decode.applies([None] * size, self.compressor.sizes,
                                     params, grads, False):
            return None
        return device_decode.receive_into(self.compressor.sizes,
                                          self.staging('upload'), params,
                                          size)

    def mean(self, blocks, params, grads, size, zero_fill, dense,
             rescale=None, present=None):
        """``param.grad`` = the mean of the ``blocks`` on the device (the
        module doc); the elements each message carries.  (Parameters on
        several devices: the blocks are uploaded to the first one's device
        and read from there.)"""
        comp = self.compressor
        dtypes = [p.dtype for p in params]
        whole = device_decode.applies(blocks, comp.sizes, params, grads,
                                      dense)
        # the whole-model decode checks the FMT_GAP codes itself
        elements, rows = self.validate(blocks, dtypes, True,
                                       codes=not whole)
        if whole:
            done = device_decode.mean(blocks, comp.sizes,
                                      self.staging('upload'), params, size,
                                      dense, rescale, rows)
            if done is device_decode.REFUSED:
                # a message's codes failed the device's checks (nothing was
                # written): the reference names the fault
                codec.name_the_fault(blocks, comp.sizes, dtypes,
                                     'the device decode')
            if done:
                return elements
            self.validate(blocks, dtypes)  # (codes too, now)
        # gap-coded indices are sequential codes: decoded here, on the host
        decoder, _ = self.gap_codec()
        blocks = [codec.expand_gap(b, comp.sizes, decoder) for b in blocks]
        on = [p.array for p in params if p.array is not None]
        xp = arrays.get_array_module(*on)
        first = next(a for a in on if arrays.get_array_module(a) is xp)
        device = upload_blocks(blocks, xp, first, self.staging('fallback'))

        def adder(host, dev):
            def add(outs):
                codec.add_validated(host, dev, [o.reshape(-1) for o in outs],
                                    comp.sizes)
            return add
        with arrays.device_scope(first):
            sums = reference.rank_order_sum(
                [adder(h, d) for h, d in zip(blocks, device)],
                lambda: reference.zero_sums(params, xp), dense)
        reference.write_mean(params, grads, sums, size, zero_fill, rescale,
                             present)
        return elements


def upload_blocks(blocks, xp, like, staging=None):
    """Every rank's message on ``like``'s device with one host-to-device
    copy (through one pinned buffer: ``staging``'s, a
    :class:`~chainer_vgc.backends.arrays.HostStaging` kept from step to
    step, or a new one); returns a device view per block."""
    sizes = [int(b.size) for b in blocks]
    staging = staging or arrays.HostStaging()
    staged = staging.view(sum(sizes), numpy.uint32)
    pos = 0
    for b, n in zip(blocks, sizes):
        staged[pos:pos + n] = b
        pos += n
    with arrays.device_scope(like):
        device = xp.asarray(staged)
        staging.hold_until(arrays.upload_fence(device))
    views, pos = [], 0
    for n in sizes:
        views.append(device[pos:pos + n])
        pos += n
    return views
