"""The native CPU engine (``backend='native'``, the default): a step of
every tensor in the fused C++ passes, both directions.

The question this module answers: how does a compressor's step run on
NumPy arrays without a Python loop over elements, and what does it keep?

* compress: the rule's registered fast path
  (:func:`chainer_vgc.backends.registry.find`, a
  :data:`~chainer_vgc.backends.registry.FastPath` over
  :mod:`.bindings`) tensor by tensor into one message buffer, reused from
  step to step.  By default one read-only pass
  (:func:`~.bindings.check_inputs`) checks every input and the workers
  agree on it before the passes update each tensor's state in place; with
  ``spare_residuals=True`` the passes write the next state into a second
  set of arrays, swapped in only when every tensor passed its checks, so
  that an overflow too leaves the state as it was.  A rule without a fast
  path, or a dtype the library does not take, runs the reference's
  :meth:`~chainer_vgc.engines.reference.ReferenceEngine.compress`;
* mean: one call validates every rank's message and writes the sums, in
  rank order, straight into the gradient arrays with the mean applied
  (float16 parameters through a float32 buffer kept here), equal to the
  reference's :func:`~chainer_vgc.engines.reference.sum_messages` +
  :func:`~chainer_vgc.engines.reference.write_mean` bit for bit; the
  dense rank-order tree ('none') is the reference's.

What it holds: the passes' workspace, the message buffer, the spare
residuals and the decode buffers (:meth:`NativeEngine.memory`).
"""

import numpy

from chainer_vgc.backends import arrays
from chainer_vgc.backends import registry
from chainer_vgc import codec
from chainer_vgc.engines import reference
from chainer_vgc.engines.native import bindings
from chainer_vgc.engines.native import gap


class NativeEngine(reference.ReferenceEngine):
    """A compressor's steps on the native CPU backend (the module doc)."""

    name = 'native'

    def __init__(self, compressor):
        super(NativeEngine, self).__init__(compressor)
        #: the rule's fused step here (None: the rule's compress)
        self.fast_path = registry.find('native', compressor.rule)
        if self.fast_path is not None:
            bindings.load()  # a missing or stale build is reported now
        self._workspace = None
        self._buffer = None
        self._spares = [None] * len(compressor.sizes)
        self._decode_buffers = [None] * len(compressor.sizes)
        #: why the residuals can no longer be trusted (in-place steps only:
        #: a fault after the passes began), or None
        self._lost = None

    def _takes(self, dtypes):
        return all(d in bindings.DTYPE_CODES for d in dtypes)

    def fuses(self, grads):
        """Whether :meth:`compress` runs the native passes for ``grads``
        (NumPy arrays, None for a missing gradient)."""
        return (self.fast_path is not None
                and self._takes(self.compressor.dtypes)
                and all(g is None or arrays.get_array_module(g) is numpy
                        for g in grads))

    def gap_codec(self):
        """The native FMT_GAP coder's ``(decoder, encoder)``."""
        return gap.gap_decode, gap.gap_encode

    def memory(self):
        def held(states):
            return sum(int(a.nbytes) for st in states if st
                       for a in st.values())
        return {'spare_residuals': held(self._spares),
                'message': (0 if self._buffer is None else
                            int(self._buffer.nbytes))}

    # -- compress ----------------------------------------------------------
    def compress(self, grads, sqsums, agree):
        """One step in the fused passes (the module doc), or the
        reference's where they do not apply; ``(message, mergeable,
        reused)``, the message a view of the buffer the next step
        reuses."""
        if not self.fuses(grads):
            return super(NativeEngine, self).compress(grads, sqsums, agree)
        comp, path = self.compressor, self.fast_path
        rule = comp.rule
        if self._lost is not None:
            raise RuntimeError(self._lost)
        if not path.checks_inputs:  # (state outside the arrays: checked
            # and agreed by the reference's checks before anything moves)
            sqsums = comp.validate(grads, sqsums, True, agree)
        else:
            sqsums = comp.check_inputs(grads, sqsums, values=False)
        flat_g, flat_s = self._flat_inputs(grads, sqsums)
        if self._workspace is None:
            self._workspace = bindings.Workspace()
            self._buffer = numpy.empty(2 + sum(
                path.max_words(n, dt) for n, dt in zip(comp.sizes,
                                                       comp.dtypes)),
                dtype=numpy.uint32)
        in_place = not comp.spare_residuals and comp.keeps_state
        if path.checks_inputs:
            # in place, every input is checked (and agreed) before any
            # state moves; with spares (or no state), the passes check them
            bad = [] if not in_place else [
                (i, f) for i, f in enumerate(bindings.check_inputs(
                    self._workspace, flat_g, flat_s)) if f]
            comp.agree_inputs(comp.fault_of(bad) if bad else None, agree)
        # the rule's step begins once the inputs are agreed on (a step
        # skipped or sent dense before this moves nothing of the rule's;
        # one the passes refuse below gets its own state back)
        before = rule.get_extra_state()
        rule.prepare(grads)
        rule.begin_step()
        buf, pos, n_groups, sent = self._buffer, 2, 0, 0
        flagged, done = [], []
        for i, (g, s) in enumerate(zip(flat_g, flat_s)):
            if g is None:
                continue
            if comp.states[i] is None:
                comp.states[i] = comp.new_state(i, numpy)
            if in_place:
                out_state = comp.states[i]
            else:
                if self._spares[i] is None:
                    self._spares[i] = comp.new_state(i, numpy)
                out_state = self._spares[i]
            words, count, flags = path.compress(
                self._workspace, i, g, s, comp.states[i], out_state,
                buf[pos:])
            if flags:
                flagged.append((i, flags))
            if words:
                pos += words
                n_groups += 1
                sent += count
            done.append(i)
        try:
            comp.settle(comp.fault_of(flagged) if flagged else None, agree)
        except Exception as e:
            rule.set_extra_state(before)
            if in_place:
                self._lost = (
                    'chainer_vgc: this compressor\'s residuals were updated '
                    'in place by a step that then failed ({}: {}); they are '
                    'part-updated and no further step is taken. Resume '
                    'from a snapshot, or use create_communicator(..., '
                    'spare_residuals=True) to keep every state untouched '
                    'by any fault (twice the residuals\' memory)'.format(
                        type(e).__name__, e))
            raise
        if not in_place:
            for i in done:
                comp.states[i], self._spares[i] = (self._spares[i],
                                                   comp.states[i])
        buf[0], buf[1] = codec.MAGIC, n_groups
        comp.last_sent = sent
        return buf[:pos], True, True

    def _flat_inputs(self, grads, sqsums):
        """Each gradient flat and C-contiguous (None stays None), and its
        sum of squares in the state dtype (None where the rule reads
        none), as the native passes take them."""
        comp = self.compressor
        flat_g, flat_s = [], []
        for i, (g, s) in enumerate(zip(grads, sqsums)):
            if g is None:
                flat_g.append(None)
                flat_s.append(None)
                continue
            flat_g.append(numpy.ascontiguousarray(g).reshape(-1))
            flat_s.append(
                None if s is None or not comp.rule.needs_sqsum else
                numpy.ascontiguousarray(s, dtype=arrays.state_dtype(
                    comp.dtypes[i])).reshape(-1))
        return flat_g, flat_s

    # -- decode --------------------------------------------------------------
    def _decodes(self, blocks):
        return (all(isinstance(b, numpy.ndarray) for b in blocks)
                and self._takes(self.compressor.dtypes))

    def decode_into(self, message, outs):
        """One call validates and adds the message into C-contiguous
        float32/float64 host outputs, touching only the indices sent; else
        the reference's, equal bit for bit.  A rejected message raises
        ``WireFormatError``, ``outs`` unchanged."""
        sizes = self.compressor.sizes
        if not (isinstance(message, numpy.ndarray)
                and message.dtype == numpy.uint32 and message.ndim == 1
                and all(isinstance(o, numpy.ndarray)
                        and o.dtype in (numpy.float32, numpy.float64)
                        and o.flags.c_contiguous and o.flags.writeable
                        and o.size == n for o, n in zip(outs, sizes))):
            return super(NativeEngine, self).decode_into(message, outs)
        flat = [o.reshape(-1) for o in outs]
        result = bindings.decode_mean(
            [message], sizes, [o.dtype for o in outs], flat,
            [False] * len(outs), 1.0, accumulate=True)
        if result is not None:
            return int(result[1][0])
        # rejected (nothing written): the reference names the fault
        codec.name_the_fault([message], sizes, [o.dtype for o in outs],
                             workaround="backend='numpy'")

    def validate(self, blocks, dtypes, table=False, codes=True):
        """The native decoder's walk (same checks as the reference, no
        output); with ``table`` also the group table it read (see
        :func:`chainer_vgc.engines.cuda.decode.group_rows`).
        ``codes=False``: the FMT_GAP groups' codes are left unchecked, for
        the device decode, which checks them
        (:func:`chainer_vgc.engines.cuda.decode.mean`); a message refused
        even so is checked in full, which names the fault."""
        if not self._decodes(blocks):
            return super(NativeEngine, self).validate(blocks, dtypes, table,
                                                      codes)
        sizes = self.compressor.sizes
        sdts = [arrays.state_dtype(d) for d in dtypes]
        result = bindings.decode_mean(blocks, sizes, sdts, [None] * len(sizes),
                                      [0] * len(sizes), 1.0, table=table,
                                      gap_codes=codes)
        if result is None and not codes:
            result = bindings.decode_mean(blocks, sizes, sdts,
                                          [None] * len(sizes),
                                          [0] * len(sizes), 1.0, table=table)
        if result is None:
            codec.name_the_fault(blocks, sizes, dtypes)
        elements = [int(e) for e in result[1]]
        return (elements, result[2]) if table else elements

    def _decode_buffer(self, i):
        """A flat array of parameter i's size in its state dtype, allocated
        on first use and reused: where the native decoder writes the sum it
        cannot write into ``param.grad`` directly (float16 parameters,
        missing gradients)."""
        if self._decode_buffers[i] is None:
            comp = self.compressor
            self._decode_buffers[i] = numpy.empty(
                comp.sizes[i], arrays.state_dtype(comp.dtypes[i]))
        return self._decode_buffers[i]

    def mean(self, blocks, params, grads, size, zero_fill, dense,
             rescale=None, present=None):
        """One native call (the module doc); the reference's for the dense
        tree and for messages it does not take."""
        if dense or not self._decodes(blocks):
            return super(NativeEngine, self).mean(
                blocks, params, grads, size, zero_fill, dense, rescale,
                present)
        sizes = self.compressor.sizes
        sdts = [arrays.state_dtype(p.dtype) for p in params]
        outs, direct = [], []
        for i, (p, g, sdt) in enumerate(zip(params, grads, sdts)):
            grad = p.grad
            ok = (grad is not None and g is not None and grad.dtype == sdt
                  and grad.dtype == p.dtype and grad.flags.c_contiguous
                  and grad.size == sizes[i])
            outs.append(grad.reshape(-1) if ok else self._decode_buffer(i))
            direct.append(ok)
        result = bindings.decode_mean(blocks, sizes, sdts, outs, direct,
                                      1.0 / size)
        if result is None:  # name the fault as the reference decoder does
            codec.name_the_fault(blocks, sizes, [p.dtype for p in params])
        touched, elements = result
        for i, (p, g, out, ok, n) in enumerate(zip(params, grads, outs,
                                                   direct, touched)):
            if ok:
                if rescale not in (None, 1):
                    p.grad *= p.grad.dtype.type(rescale)
                continue
            if reference.stays_none(g, zero_fill, present, i,
                                    lambda: bool(n and out.any())):
                continue  # nothing (or a zero sum) for a gradient-less param
            p.grad = reference.finish_mean(out.reshape(p.shape).copy(),
                                           p.dtype, size, rescale)
        return [int(e) for e in elements]
