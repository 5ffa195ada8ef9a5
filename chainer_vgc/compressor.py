"""GradientCompressor: one rule over all parameters of a model.

Data flow (one step on one worker): gradients and per-sample sums of squares
-> rule (per-parameter state) -> codec groups -> one uint32 message.  The
receiving side decodes messages with :meth:`GradientCompressor.decode_into`.
All inputs are validated before any state changes, so a bad gradient (NaN,
Inf, wrong shape) raises an error naming the parameter and leaves every
residual as it was.

The steps themselves run in an engine, both directions, each holding its
own buffers (:mod:`chainer_vgc.engines`): for NumPy arrays the one the
``backend`` names, chosen when the compressor is made
(:func:`chainer_vgc.backends.arrays.cpu_backend`): ``'native'`` (default),
the fused C++ passes (:mod:`chainer_vgc.engines.native.engine`), or
``'numpy'``, the readable reference
(:mod:`chainer_vgc.engines.reference`), equal bit for bit; for CuPy
arrays the GPU engine (:mod:`chainer_vgc.engines.cuda.engine`, made on
first use), whose whole-model step runs where it applies and the
reference's CuPy code elsewhere.  The compressor owns what every engine
shares: the rule and its per-tensor state (:attr:`states`), the checks of
the inputs, the agreement with the other workers and the errors that name
a fault.
"""

import numpy

from chainer_vgc.backends import arrays
from chainer_vgc.backends.cuda import kernels
from chainer_vgc import codec
from chainer_vgc import faults
from chainer_vgc.engines import reference
from chainer_vgc.engines.cuda import engine as cuda_engine
from chainer_vgc.engines.native import bindings
from chainer_vgc.engines.native import engine as native_engine
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
            or arrays.get_array_module(g) is not numpy
            or arrays.get_array_module(s) is not numpy):
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
            raise ValueError(
                'hyperparameters {} given with a rule object; set them on '
                'the rule'.format(sorted(hyperparams)))
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
        self.backend = arrays.cpu_backend(backend)
        self.spare_residuals = bool(spare_residuals)
        #: whether the rule keeps per-parameter arrays (vgc's r and v;
        #: none keeps none, so its steps move nothing to protect)
        self.keeps_state = bool(rule.init_state(0, numpy.float32, numpy))
        #: the engine of NumPy arrays, chosen by ``backend`` (its buffers
        #: its own): :class:`~chainer_vgc.engines.native.engine.NativeEngine`
        #: or the reference,
        #: :class:`~chainer_vgc.engines.reference.ReferenceEngine`
        self.engine = (native_engine.NativeEngine(self)
                       if self.backend == 'native' else
                       reference.ReferenceEngine(self))
        self._device_engine = None
        #: statistics of the last :meth:`compress` or :meth:`reduce`: the
        #: elements and bytes this worker sent, and (:meth:`reduce`) the
        #: elements of each parameter ({index: elements})
        self.last_sent = 0
        self.last_bytes = 0
        self.last_sent_by_tensor = {}

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

    def new_state(self, i, xp):
        """A fresh state of parameter ``i`` on ``xp`` (the rule's
        :meth:`~chainer_vgc.rules.CompressionRule.tensor_state`)."""
        return self.rule.tensor_state(i, self.shapes[i], self.dtypes[i], xp)

    @property
    def device_engine(self):
        """The engine of CuPy arrays
        (:class:`~chainer_vgc.engines.cuda.engine.CudaEngine`, made on
        first use and kept with its buffers)."""
        if self._device_engine is None:
            self._device_engine = cuda_engine.CudaEngine(self, self.engine)
        return self._device_engine

    def engine_for(self, operands):
        """The engine that takes ``operands`` (gradients, messages,
        outputs; None ignored): :attr:`device_engine` when any is a CuPy
        array, else :attr:`engine`."""
        if any(a is not None and arrays.get_array_module(a) is not numpy
               for a in operands):
            return self.device_engine
        return self.engine

    def uses_native(self, grads):
        """Whether :meth:`compress` runs the native passes for ``grads``."""
        engine = self.engine_for(grads)
        return engine.name == 'native' and engine.fuses(grads)

    def check_inputs(self, grads, sqsums, values=True):
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
                with arrays.device_scope(g):  # reductions on g's device
                    self._check_one(name, shape, dtype, g, s, values)
        return sqsums

    def _check_one(self, name, shape, dtype, g, s, values):
        # the parameter's dtype, or its state dtype (a float16 gradient
        # unscaled in float32 by the communicator)
        if tuple(g.shape) != shape or g.dtype not in (
                dtype, arrays.state_dtype(dtype)):
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
        if self.rule.exchange == 'allreduce_factors':
            raise TypeError(
                'method {!r} exchanges dense factors by allreduce, not '
                'messages: use GradientCompressor.reduce (a communicator '
                'does)'.format(self.rule.name))
        engine = self.engine_for(grads)
        message, mergeable, reused = engine.compress(grads, sqsums, agree)
        message = self._merge_spans(message, mergeable)
        if copy and reused and message.base is not None:
            return message.copy()
        return message

    def reduce(self, grads, allreduce=None, size=1, agree=None,
               present=None):
        """One step of a rule that exchanges by allreduce of factors
        (:attr:`~chainer_vgc.rules.CompressionRule.exchange`
        ``'allreduce_factors'``: PowerSGD): returns each parameter's mean
        update over the ``size`` workers (an array of its shape in its
        state dtype, on its gradient's device; None for a parameter that
        takes no part) and sets :attr:`last_sent` (the elements this
        worker sent).

        ``allreduce(buffer)``: sums a flat array over the workers, in
        place, the same on every worker (the collectives'
        ``allreduce_sum``; None: one worker); the rule's rounds each make
        one call per state dtype.  ``agree``: as for :meth:`compress`,
        called twice: with this worker's input fault before anything is
        computed, then after the rounds with any overflow (a non-finite
        mean or next state); every state stays as it was unless every
        worker's step went well.  ``present`` (the list the first
        agreement fills, as the exchange's): which parameters some
        worker has a gradient for; those take part everywhere, zeros
        where this worker has none (without it: those with a gradient
        here).
        """
        rule = self.rule
        self.validate(grads, None, True, agree)
        # (a gradient missing here is zeros where the others are: on the
        # device of its state, or of this worker's gradients)
        like = next((g for g in grads if g is not None), None)
        tensors, where = [], []
        for i, g in enumerate(grads):
            if g is None and not (present and present[i]):
                continue
            sdt = arrays.state_dtype(self.dtypes[i])
            if g is None:
                on = like if self.states[i] is None else self.states[i]['r']
                xp = numpy if on is None else arrays.get_array_module(on)
                with arrays.device_scope(on):
                    flat = xp.zeros(self.sizes[i], dtype=sdt)
            else:
                xp = arrays.get_array_module(g)
                flat = kernels.cast(g.reshape(-1), sdt)
            if self.states[i] is None:
                with arrays.device_scope(flat):
                    self.states[i] = self.new_state(i, xp)
            tensors.append((i, self.shapes[i], flat, self.states[i]))
            where.append(i)
        before = rule.get_extra_state()  # (given back if the step fails)
        rule.prepare(grads)
        rule.begin_step()

        sent = [0]

        def mean(buffers):
            sent[0] += sum(int(b.nbytes) for b in buffers)
            return allreduce_mean(buffers, allreduce, size)
        with numpy.errstate(over='ignore', invalid='ignore'):
            means, new_states, elements = rule.reduce(tensors, mean)
        error = None
        for i, m, st in zip(where, means, new_states):
            bad = [k for k, a in sorted(st.items())
                   if not faults.all_finite(a)]
            if bad or not faults.all_finite(m):
                key = bad[0] if bad else 'r'
                error = faults.overflow(key, self.names[i],
                                        arrays.state_dtype(self.dtypes[i]),
                                        unchanged=True)
                break
        try:
            self.settle(error, agree)
        except Exception:
            rule.set_extra_state(before)
            raise
        out = [None] * len(grads)
        for i, m, st in zip(where, means, new_states):
            self.states[i] = st
            out[i] = m.reshape(self.shapes[i])
        self.last_sent_by_tensor = dict(zip(where, map(int, elements)))
        self.last_sent, self.last_bytes = sum(map(int, elements)), sent[0]
        return out

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
        return self.engine.gap_codec()

    def validate(self, grads, sqsums, values, agree):
        """:meth:`_check`, then the first of the two agreements of a step
        (before any state, or a rule's generator, moves; the second comes
        after the passes), so that both paths make the same collective
        calls.  Returns the sums of squares."""
        error = None
        try:
            sqsums = self.check_inputs(grads, sqsums, values=values)
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

    @staticmethod
    def settle(error, agree):
        """The second agreement of a fused step (native or
        :mod:`~chainer_vgc.engines.cuda.compress`): every worker's fault
        code, and ``error`` (or the others') raised on all of them when
        there is one; without ``agree``, ``error`` raised."""
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
            if flags & bindings.BAD_GRAD:
                return faults.bad_gradient(self.names[i])
            if flags & bindings.BAD_SQSUM:
                return faults.bad_sqsum(self.names[i])
        for i, flags in flagged:
            if flags & bindings.UNENCODABLE:
                return ValueError(
                    'parameter {!r}: {} elements selected in one step; a '
                    'group carries at most 2**32 - 1 (and '
                    "index_coding='fixed' at most 2**28 elements a tensor); "
                    'the residual state is unchanged'.format(
                        self.names[i], self.sizes[i]))
        i, flags = flagged[0]
        key = 'r' if flags & bindings.OVERFLOW_R else 'v'
        return faults.overflow(key, self.names[i], arrays.state_dtype(
            self.dtypes[i]), unchanged=True)

    def memory(self):
        """Bytes this compressor holds, by role: ``residuals`` (the rule's
        state, e.g. VGC's r and v), ``spare_residuals`` (the native
        backend's second set: each step writes the next state there and
        swaps it in only when no tensor faulted, so that a NaN gradient or
        an overflow leaves the state untouched) and ``message`` (the native
        backend's buffer, sized for the largest message the settings
        allow).  What ``benchmarks/bench_memory.py`` reports."""
        held = {'residuals': sum(int(a.nbytes) for st in self.states if st
                                 for a in st.values())}
        held.update(self.engine.memory())
        return held

    def decode_into(self, message, outs):
        """Add a message's elements into ``outs`` (arrays of each parameter's
        shape); returns the number of elements added.  The native engine
        (C-contiguous float32/float64 host outputs) validates and adds in
        one call, touching only the indices sent; else
        :func:`chainer_vgc.codec.decode_into`, equal bit for bit.  A
        rejected message raises ``WireFormatError``, ``outs`` unchanged."""
        if len(outs) != len(self.sizes):
            raise ValueError('expected {} output arrays, got {}'.format(
                len(self.sizes), len(outs)))
        return self.engine_for([message] + list(outs)).decode_into(message,
                                                                   outs)

    def decode(self, message):
        """The dense update a message carries: list of arrays in the state
        dtypes, on the message's device (a host message: NumPy), zero where
        nothing was sent.  The elements are added to +0.0 (the wire
        format's Sec. 5.2), so a sent -0.0 gives +0.0 here, where
        :func:`codec.unpack <chainer_vgc.codec.unpack>` lists it as
        sent."""
        xp = arrays.get_array_module(message)
        outs = [xp.zeros(shape, dtype=arrays.state_dtype(dt))
                for shape, dt in zip(self.shapes, self.dtypes)]
        self.decode_into(message, outs)
        return outs


def allreduce_mean(buffers, allreduce, size):
    """The mean over ``size`` workers of each of ``buffers`` (flat arrays):
    those of one dtype concatenated into one array, summed by one
    ``allreduce(array)`` (in place; None: one worker, nothing to add),
    divided by ``size`` in that dtype and cut apart again; new arrays, in
    the order given."""
    out = [None] * len(buffers)
    by_dtype = {}
    for j, b in enumerate(buffers):
        by_dtype.setdefault(numpy.dtype(b.dtype), []).append(j)
    for dtype in sorted(by_dtype, key=str):
        js = by_dtype[dtype]
        xp = arrays.get_array_module(buffers[js[0]])
        with arrays.device_scope(buffers[js[0]]):
            joined = xp.concatenate([buffers[j].reshape(-1) for j in js])
            if allreduce is not None:
                allreduce(joined)
            joined /= dtype.type(size)
        pos = 0
        for j in js:
            n = int(buffers[j].size)
            out[j] = joined[pos:pos + n]
            pos += n
    return out
