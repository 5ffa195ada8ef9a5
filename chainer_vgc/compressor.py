"""GradientCompressor: one rule over all parameters of a model.

Data flow (one step on one worker): gradients and per-sample sums of squares
-> rule (per-parameter state) -> codec groups -> one uint32 message.  The
receiving side decodes messages with :meth:`GradientCompressor.decode_into`.
All inputs are validated before any state changes, so a bad gradient (NaN,
Inf, wrong shape) raises an error naming the parameter and leaves every
residual as it was.

Two CPU backends (:func:`chainer_vgc.backends.arrays.cpu_backend`): ``'native'``
(default), the fused C++ passes of :mod:`chainer_vgc.engines.native.bindings`,
which by default check every input in one read-only pass, agree on it
with the other workers and then update each tensor's state in place (with
``spare_residuals=True`` they write it into a second set of arrays, swapped
in only when every tensor passed its checks, so an overflow too leaves the
state as it was), and ``'numpy'``, the readable reference, equal bit for
bit.  CuPy arrays take the whole-model GPU step
(:mod:`chainer_vgc.engines.cuda.compress`, the kernels of the rule's
registered kind, its buffers in :attr:`GradientCompressor.device_buffers`)
where it applies (every gradient on one device, one state dtype, no tensor
over the 28-bit index), else the rule's own ``compress`` with CuPy's
arrays and the rules' CuPy kernels.
"""

import numpy

from chainer_vgc.backends import arrays as _backend
from chainer_vgc import codec
from chainer_vgc.engines.cuda import compress as device_step
from chainer_vgc.backends import registry as fast_paths
from chainer_vgc import faults
from chainer_vgc.engines.native import bindings as native
from chainer_vgc.engines.native import gap as native_gap
from chainer_vgc.rules import CompressionRule
from chainer_vgc.rules import create_rule

# (raised by compress: importable from here too)
SkippedStep = faults.SkippedStep


def _finite_together(g, s):
    """A quick proof that g and s are both finite: one BLAS dot of the two
    (a NaN or an infinity in either makes it non-finite: 0 * inf is NaN).
    False proves nothing (finite products may overflow): the caller then
    checks each one (:func:`chainer_vgc.faults.all_finite`)."""
    if (g.dtype != s.dtype or g.dtype not in (numpy.float32, numpy.float64)
            or _backend.get_array_module(g) is not numpy
            or _backend.get_array_module(s) is not numpy):
        return False
    with numpy.errstate(over='ignore', invalid='ignore'):
        return bool(numpy.isfinite(g.reshape(-1).dot(s.reshape(-1))))


class GradientCompressor(object):
    """Compresses the gradients of a fixed list of parameters.

    Args:
        rule: a :class:`~chainer_vgc.rules.CompressionRule` or a method name
            (``'vgc'``, ``'hybrid'``, ``'strom'``, ``'qsgd'``, ``'none'``);
            with a name, ``**hyperparams`` go to the rule.
        names, shapes, dtypes: one entry per parameter (same order on every
            worker).
        backend: ``'native'`` or ``'numpy'`` for NumPy arrays (default:
            ``CHAINER_VGC_BACKEND``, else ``'native'``); ``'native'`` with a
            rule that has no native step runs the rule's NumPy code.
        spare_residuals: the native backend's commit of a step, as in
            :func:`~chainer_vgc.create_communicator` (the same default).
            False (default): one read-only native pass checks every input
            (finite gradient, finite non-negative sum of squares) and the
            workers agree on it (``agree``) before any state moves; then
            the passes update the state in place.  A fault the passes find
            afterwards (an overflow of r or v, a group that cannot be
            encoded) is raised, and the compressor then refuses further
            steps (its residuals are part-updated: restore a snapshot).
            True: each step writes the next state into a second set of
            arrays and swaps them in only when no tensor faulted, so any
            fault leaves every state untouched, at twice the state's
            memory.  ``benchmarks/bench_residual_commit.py`` times both.
    """

    def __init__(self, rule, names, shapes, dtypes, backend=None,
                 spare_residuals=False, **hyperparams):
        if not isinstance(rule, CompressionRule):
            rule = create_rule(rule, **hyperparams)
        elif hyperparams:
            raise ValueError('hyperparameters {} given with a rule object; '
                             'set them on the rule'.format(sorted(hyperparams)))
        self.rule = rule
        self.names = list(names)
        self.shapes = [tuple(int(n) for n in s) for s in shapes]
        self.dtypes = [numpy.dtype(d) for d in dtypes]
        if not len(self.names) == len(self.shapes) == len(self.dtypes):
            raise ValueError('names, shapes and dtypes must have one entry '
                             'per parameter ({}, {}, {} given)'.format(
                                 len(self.names), len(self.shapes),
                                 len(self.dtypes)))
        self.sizes = [int(numpy.prod(s, dtype=numpy.int64))
                      for s in self.shapes]
        for name, size, dtype in zip(self.names, self.sizes, self.dtypes):
            if dtype.kind != 'f':
                raise TypeError('parameter {!r}: dtype {} is not floating '
                                'point'.format(name, dtype))
            if rule.index_coding == 'fixed' and size > codec.MAX_INDEX:
                raise ValueError(
                    'parameter {!r} has {} elements; the 32-bit word format '
                    '(sign | 3-bit d | 28-bit index, paper Sec. 4.2) '
                    'addresses at most 2**28 = {} elements per tensor. Use '
                    "index_coding='auto' or 'gap' (gap-coded indices, any "
                    'size), or split the parameter'
                    .format(name, size, codec.MAX_INDEX))
        self.states = [None] * len(self.names)
        self.backend = _backend.cpu_backend(backend)
        #: the backend's fast path for the rule (None: the rule's compress)
        self.fast_path = fast_paths.find(self.backend, rule)
        if self.fast_path is not None and self.backend == 'native':
            native.load()  # a missing or stale build is reported now
        self._workspace = None
        self.spare_residuals = bool(spare_residuals)
        #: whether the rule keeps per-parameter arrays (vgc's r and v;
        #: none keeps none, so its steps move nothing to protect)
        self._keeps_state = bool(rule.init_state(0, numpy.float32, numpy))
        self._spares = [None] * len(self.names)
        #: why the residuals can no longer be trusted (in-place steps only:
        #: a fault after the passes began), or None
        self._lost = None
        self._buffer = None
        self._decode_buffers = [None] * len(self.names)
        #: the GPU path's step and staging buffers (its own, reached only
        #: through :class:`~chainer_vgc.backends.arrays.DeviceBuffers`)
        self.device_buffers = _backend.DeviceBuffers()
        #: statistics of the last :meth:`compress`
        self.last_sent = 0
        self.last_bytes = 0

    @property
    def n_params(self):
        """Total number of parameter elements."""
        return sum(self.sizes)

    @property
    def n_bytes(self):
        """Bytes of all gradients in their own dtypes."""
        return sum(n * dt.itemsize for n, dt in zip(self.sizes, self.dtypes))

    def state(self, i):
        """Per-parameter state dict of parameter ``i`` (None before its
        first gradient)."""
        return self.states[i]

    def uses_native(self, grads):
        """Whether :meth:`compress` runs the native passes for ``grads``."""
        if (self.backend != 'native' or self.fast_path is None
                or any(dt not in native.DTYPE_CODES for dt in self.dtypes)):
            return False
        return all(g is None or _backend.get_array_module(g) is numpy
                   for g in grads)

    def _check(self, grads, sqsums, values=True):
        n = len(self.names)
        if len(grads) != n:
            raise ValueError('expected {} gradients (one per parameter, None '
                             'for a parameter without gradient), got {}'
                             .format(n, len(grads)))
        if sqsums is None:
            sqsums = [None] * n
        if len(sqsums) != n:
            raise ValueError('expected {} per-sample sums of squares, got {}'
                             .format(n, len(sqsums)))
        for name, shape, dtype, g, s in zip(self.names, self.shapes,
                                            self.dtypes, grads, sqsums):
            if g is not None:
                with _backend.device_scope(g):  # reductions on g's device
                    self._check_one(name, shape, dtype, g, s, values)
        return sqsums

    def _check_one(self, name, shape, dtype, g, s, values):
        # the parameter's dtype, or its state dtype (a float16 gradient
        # unscaled in float32 by the communicator)
        if tuple(g.shape) != shape or g.dtype not in (
                dtype, _backend.state_dtype(dtype)):
            raise ValueError(
                'gradient of parameter {!r} has shape {} dtype {}; '
                'expected shape {} dtype {} (the model must match the one '
                'the compressor was built for)'.format(
                    name, tuple(g.shape), g.dtype, shape, dtype))
        if not self.rule.needs_sqsum:
            if values and not faults.all_finite(g):
                raise faults.bad_gradient(name)
            return
        if s is None:
            raise ValueError(
                'method {!r} needs the per-sample sum of squared '
                'gradients of parameter {!r}, got None'.format(
                    self.rule.name, name))
        if tuple(s.shape) != shape or s.dtype.kind != 'f':
            raise ValueError(
                'per-sample sum of squares of parameter {!r} has shape {} '
                'dtype {}; expected shape {} floating point'.format(
                    name, tuple(s.shape), s.dtype, shape))
        if not values:
            return
        if _finite_together(g, s) and (not s.size or float(s.min()) >= 0):
            return
        if not faults.all_finite(g):
            raise faults.bad_gradient(name)
        if s.size and not (faults.all_finite(s) and float(s.min()) >= 0):
            raise faults.bad_sqsum(name)

    def compress(self, grads, sqsums=None, copy=True, agree=None):
        """One step: returns the message, a uint32 NumPy array (host memory
        on every path: MPI sends it; CuPy gradients are compressed on their
        device and the message assembled with one download, see
        :func:`chainer_vgc.codec.pack`).

        ``grads[i]`` is the minibatch gradient of parameter i (None: the
        parameter has no gradient this step and its state is untouched);
        ``sqsums[i]`` the per-sample sum of squares (variance-based rules).
        ``copy=False`` (native backend): the message is a view of a buffer
        reused by the next call, valid until then.

        ``agree`` (the communicator's): called with this worker's fault code
        (:data:`OK`, :data:`NONFINITE`, :data:`OVERFLOW`) before any state
        is committed, it returns every worker's codes; if any worker's
        gradients were not finite, :class:`SkippedStep` is raised on all of
        them with every state untouched.
        """
        device = device_step.step_for(self, grads)
        if device is not None or self.uses_native(grads):
            message = self._merge_spans(
                device.compress(grads, sqsums, agree) if device else
                self._compress_native(grads, sqsums, agree),
                device is None or device.mergeable)
            return message.copy() if copy and message.base is not None \
                else message
        sqsums = self.validate(grads, sqsums, True, agree)
        self.rule.begin_step()
        groups = []
        xp = numpy
        for i, (g, s) in enumerate(zip(grads, sqsums)):
            if g is None:
                continue
            xp = _backend.get_array_module(g)
            flat_s = None if s is None else s.reshape(-1)
            # state and work arrays on the gradient's device
            with _backend.device_scope(g), numpy.errstate(over='ignore',
                                                           invalid='ignore'):
                if self.states[i] is None:
                    self.states[i] = self.rule.init_state(
                        self.sizes[i], self.dtypes[i], xp)
                group = self.rule.compress(i, g.reshape(-1), flat_s,
                                           self.states[i])
                overflowed = [(key, arr) for key, arr in
                              self.states[i].items()
                              if not faults.all_finite(arr)]
            for key, arr in overflowed[:1]:
                if agree is not None:  # the others must not wait
                    faults.settle(agree(faults.OVERFLOW), faults.overflow(
                        key, self.names[i], arr.dtype))
                raise faults.overflow(key, self.names[i], arr.dtype)
            if group is not None:
                groups.append(group)
        if agree is not None:
            faults.settle(agree(faults.OK), None)
        message = self._merge_spans(codec.pack(groups, xp))
        self.last_sent = sum(grp.count for grp in groups)
        return message

    def _merge_spans(self, message, mergeable=True):
        """:func:`chainer_vgc.codec.merge_spans` where the rule gap-codes
        and groups might merge (``mergeable``: the GPU layout counts them),
        with the CPU backend's gap codec; sets :attr:`last_bytes`."""
        rule = self.rule
        if mergeable and rule.index_coding not in (None, 'fixed'):
            message = codec.merge_spans(message, self.sizes,
                                        *self.gap_codec())
        self.last_bytes = int(message.nbytes)
        return message

    def gap_codec(self):
        """``(decoder, encoder)`` of FMT_GAP bodies for the CPU backend:
        the native ones, or ``(None, None)`` for the NumPy reference
        (:func:`chainer_vgc.codec.gap_decode_body`, ``gap_body``)."""
        if self.backend == 'native':
            return native_gap.gap_decode, native_gap.gap_encode
        return None, None

    def validate(self, grads, sqsums, values, agree):
        """:meth:`_check`, then the first of the two agreements of a step
        (before any state, or a rule's generator, moves; the second comes
        after the passes), so that both paths make the same collective
        calls.  Returns the sums of squares."""
        error = None
        try:
            sqsums = self._check(grads, sqsums, values=values)
        except faults.InputFault as e:
            error = e
        self.agree_inputs(error, agree)
        return sqsums

    @staticmethod
    def agree_inputs(error, agree):
        """The first agreement of a step: this worker's input fault
        (``error``, an :class:`~chainer_vgc.faults.InputFault`, or None)
        against every worker's; :class:`SkippedStep` on all of them if any
        gradient was not finite (without ``agree``, ``error`` raised)."""
        if agree is None:
            if error is not None:
                raise error
            return
        faults.settle(agree(faults.OK if error is None
                            else faults.NONFINITE), error)

    def _flat_inputs(self, grads, sqsums):
        """Each gradient flat and C-contiguous (None stays None), and its
        sum of squares in the state dtype (None where the rule reads
        none), as the native passes take them."""
        flat_g, flat_s = [], []
        for i, (g, s) in enumerate(zip(grads, sqsums)):
            if g is None:
                flat_g.append(None)
                flat_s.append(None)
                continue
            flat_g.append(numpy.ascontiguousarray(g).reshape(-1))
            flat_s.append(
                None if s is None or not self.rule.needs_sqsum else
                numpy.ascontiguousarray(s, dtype=_backend.state_dtype(
                    self.dtypes[i])).reshape(-1))
        return flat_g, flat_s

    def _compress_native(self, grads, sqsums, agree=None):
        """:meth:`compress` on the native backend.

        With ``spare_residuals``, each tensor's step reads ``states[i]``
        and writes the next state into a spare set of arrays; the message is
        written in place into one buffer.  Only when no tensor reported a
        fault are the spares swapped in, so a NaN gradient or an overflow
        leaves every state untouched.  Without, one read-only native pass
        (:func:`~chainer_vgc.engines.native.bindings.check_inputs`) checks
        every input and the workers agree on it before the passes write
        the state in place (the class doc); a rule without state (none)
        skips that pass, since its passes move nothing.
        """
        rule, path = self.rule, self.fast_path
        if self._lost is not None:
            raise RuntimeError(self._lost)
        if not path.checks_inputs:  # (state outside the arrays: checked
            # and agreed by the reference's checks before anything moves)
            sqsums = self.validate(grads, sqsums, True, agree)
        else:
            sqsums = self._check(grads, sqsums, values=False)
        flat_g, flat_s = self._flat_inputs(grads, sqsums)
        rule.begin_step()
        if self._workspace is None:
            self._workspace = native.Workspace()
            self._buffer = numpy.empty(2 + sum(
                path.max_words(n, dt) for n, dt in zip(self.sizes,
                                                       self.dtypes)),
                dtype=numpy.uint32)
        in_place = not self.spare_residuals and self._keeps_state
        if path.checks_inputs:
            # in place, every input is checked (and agreed) before any
            # state moves; with spares (or no state), the passes check them
            bad = [] if not in_place else [
                (i, f) for i, f in enumerate(native.check_inputs(
                    self._workspace, flat_g, flat_s)) if f]
            self.agree_inputs(self.fault_of(bad) if bad else None, agree)
        buf, pos, n_groups, sent = self._buffer, 2, 0, 0
        flagged, done = [], []
        for i, (g, s) in enumerate(zip(flat_g, flat_s)):
            if g is None:
                continue
            if self.states[i] is None:
                self.states[i] = rule.init_state(self.sizes[i],
                                                 self.dtypes[i], numpy)
            if in_place:
                out_state = self.states[i]
            else:
                if self._spares[i] is None:
                    self._spares[i] = rule.init_state(
                        self.sizes[i], self.dtypes[i], numpy)
                out_state = self._spares[i]
            words, count, flags = path.compress(
                self._workspace, i, g, s, self.states[i], out_state,
                buf[pos:])
            if flags:
                flagged.append((i, flags))
            if words:
                pos += words
                n_groups += 1
                sent += count
            done.append(i)
        try:
            self.settle(self.fault_of(flagged) if flagged else None, agree)
        except Exception as e:
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
                self.states[i], self._spares[i] = (self._spares[i],
                                                   self.states[i])
        buf[0], buf[1] = codec.MAGIC, n_groups
        self.last_sent = sent
        self.last_bytes = 4 * pos
        return buf[:pos]

    @staticmethod
    def settle(error, agree):
        """The second agreement of a fused step (native or
        :mod:`~chainer_vgc.engines.cuda.compress`): every worker's fault code, and
        ``error`` (or the others') raised on all of them when there is
        one; without ``agree``, ``error`` raised."""
        if agree is not None:
            code = faults.OK if error is None else (
                faults.NONFINITE if isinstance(error, faults.InputFault)
                else faults.OVERFLOW)
            faults.settle(agree(code), error)
        elif error is not None:
            raise error

    def fault_of(self, flagged):
        """The error the reference would raise first for the flags of
        the fused passes (or of the check before them), ``flagged``
        ``[(tensor, flags)]``: bad inputs (gradient before sum of squares)
        in parameter order, then a tensor whose group cannot be encoded,
        then overflows."""
        for i, flags in flagged:
            if flags & native.BAD_GRAD:
                return faults.bad_gradient(self.names[i])
            if flags & native.BAD_SQSUM:
                return faults.bad_sqsum(self.names[i])
        for i, flags in flagged:
            if flags & native.UNENCODABLE:
                return ValueError(
                    'parameter {!r}: {} elements selected in one step; a '
                    'group carries at most 2**32 - 1 (and '
                    "index_coding='fixed' at most 2**28 elements a tensor); "
                    'the residual state is unchanged'.format(
                        self.names[i], self.sizes[i]))
        i, flags = flagged[0]
        key = 'r' if flags & native.OVERFLOW_R else 'v'
        return faults.overflow(key, self.names[i], _backend.state_dtype(
            self.dtypes[i]), unchanged=True)

    def memory(self):
        """Bytes this compressor holds, by role: ``residuals`` (the rule's
        state, e.g. VGC's r and v), ``spare_residuals`` (the native
        backend's second set: each step writes the next state there and
        swaps it in only when no tensor faulted, so that a NaN gradient or
        an overflow leaves the state untouched) and ``message`` (the native
        backend's buffer, sized for the largest message the settings
        allow).  What ``benchmarks/bench_memory.py`` reports."""
        def held(states):
            return sum(int(a.nbytes) for st in states if st
                       for a in st.values())
        return {'residuals': held(self.states),
                'spare_residuals': held(self._spares),
                'message': (0 if self._buffer is None else
                            int(self._buffer.nbytes))}

    def decode_buffer(self, i):
        """A flat array of parameter i's size in its state dtype, allocated
        on first use and reused: where the native decoder writes the sum it
        cannot write into ``param.grad`` directly (float16 parameters,
        missing gradients)."""
        if self._decode_buffers[i] is None:
            self._decode_buffers[i] = numpy.empty(
                self.sizes[i], _backend.state_dtype(self.dtypes[i]))
        return self._decode_buffers[i]

    def decode_into(self, message, outs):
        """Add a message's elements into ``outs`` (arrays of each parameter's
        shape); returns the number of elements added.  The native backend
        (C-contiguous float32/float64 host outputs) validates and adds in
        one call, touching only the indices sent; else
        :func:`chainer_vgc.codec.decode_into`, equal bit for bit.  A
        rejected message raises ``WireFormatError``, ``outs`` unchanged."""
        if len(outs) != len(self.sizes):
            raise ValueError('expected {} output arrays, got {}'.format(
                len(self.sizes), len(outs)))
        if self._native_decodes(message, outs):
            flat = [o.reshape(-1) for o in outs]
            result = native.decode_mean(
                [message], self.sizes, [o.dtype for o in outs], flat,
                [False] * len(outs), 1.0, accumulate=True)
            if result is not None:
                return int(result[1][0])
            # rejected (nothing written): the reference names the fault
            codec.name_the_fault([message], self.sizes,
                                 [o.dtype for o in outs],
                                 workaround="backend='numpy'")
        return codec.decode_into(message, outs, self.sizes)

    def _native_decodes(self, message, outs):
        """Whether :meth:`decode_into` takes the native decoder."""
        return (self.backend == 'native'
                and isinstance(message, numpy.ndarray)
                and message.dtype == numpy.uint32 and message.ndim == 1
                and all(isinstance(o, numpy.ndarray)
                        and o.dtype in (numpy.float32, numpy.float64)
                        and o.flags.c_contiguous and o.flags.writeable
                        and o.size == n for o, n in zip(outs, self.sizes)))

    def decode(self, message):
        """The dense update a message carries: list of arrays in the state
        dtypes, on the message's device (a host message: NumPy), zero where
        nothing was sent.  The elements are added to +0.0 (the wire
        format's Sec. 5.2), so a sent -0.0 gives +0.0 here, where
        :func:`codec.unpack <chainer_vgc.codec.unpack>` lists it as
        sent."""
        xp = _backend.get_array_module(message)
        outs = [xp.zeros(shape, dtype=_backend.state_dtype(dt))
                for shape, dt in zip(self.shapes, self.dtypes)]
        self.decode_into(message, outs)
        return outs
