"""The whole-model compress step on a GPU: a fixed number of kernel launches
and one device-to-host copy per step, whatever the number of tensors
(issue 25).

The question this module answers: how does one compress step of vgc
(Fig. "Basic", quantized, Sec. 4.1-4.4), hybrid (Fig. "Hybrid", Sec. 4.5)
or Strom run on CuPy arrays without a launch or a scalar read per tensor?
The residuals r and v of every tensor live in arenas (one array for the
whole model; each tensor's state is a view), and a step is:

1. the fault flags and each tensor's largest selected ``|r|`` cleared
   (``vgc_model_clear``, one launch: a step that failed half way leaves
   nothing for the next), and the gradients and the per-sample sums of
   squares gathered into arenas by ``vgc_model_gather``, one launch per
   input dtype through a table of their device addresses (uploaded only
   when an address moved); none for the sums of
   :class:`~chainer_vgc.statistics.PerSampleSquares`, which its
   reductions write into one arena already (``cupy.concatenate`` took
   one copy per tensor for tensors over 2 MiB: 70 launches a step for 35
   tensors of 2.9 MB);
2. the rule's select pass over the whole arena (``vgc_model_*`` in
   :data:`chainer_vgc.backends.cuda.kernels.SPECS`): the next state into the other pair
   of arenas, the input and overflow checks as per-tensor flags, and for
   vgc each tensor's largest selected ``|r|`` (for e_k, Sec. 4.2);
3. vgc only: which selected elements e_k can represent;
4. one scan of the elements sent, in place on the int64 ``ok``
   (:func:`chainer_vgc.backends.cuda.kernels.scan`: CUB's, two launches; without CUB
   ``cupy.cumsum``, whose launches grow with the model's size);
5. the layout, one thread: each tensor's FMT_POW2 group header and place;
6. the write pass: each element's word (Sec. 4.2) at its place, and the
   reset of the selected elements' r and v;
7. one download of the flags, the totals and the message together.

Nothing is read back before 7: 7 launches of our own for vgc, 6 for
hybrid, 5 for Strom (with the paper's words), besides the scan, whatever
the number of tensors (``tests/test_launch_counts.py`` counts them as
CuPy issues them).  'none' (no compression) is 4: the clear, the
gradients gathered, the layout and a pass writing them as
dense FMT_RAW groups.  When the flags report a fault (a gradient or sum
of squares that is not finite, a state that overflows), the arenas are
not swapped: every residual stays as it was, as on the CPU.  Messages
and states equal the per-tensor path and the CPU backends bit for bit
(``tests/test_device_step.py``); the kernels come from the same
``kernels/vgc_numerics.cuh``.

With ``index_coding`` 'gap' or 'auto', steps 6-7 become: each sent
element's word compacted at its rank, the gap code lengths, a scan of
them, the layout (FMT_GAP, or for 'auto' the paper's words where FMT_GAP
is not shorter) and one pass assembling every word of the message, a
thread a word (9 launches of our own for vgc, besides two scans).
Applies to tensors of at most 2**28 elements and models whose parameters
share one state dtype; QSGD and unquantized vgc take the rules'
per-tensor CuPy kernels.
"""

import collections

import numpy

from chainer_vgc.backends import arrays
from chainer_vgc import codec
from chainer_vgc.codec.header import f32_bits
from chainer_vgc.backends import registry
from chainer_vgc.backends.cuda import kernels

#: the download covers the last step's message times SLACK, and at least
#: MIN_SLACK words more (a longer message takes a second copy)
SLACK = 1.25
MIN_SLACK = 1 << 16
#: the layout's summary after the flags (``vgc_model_info`` in the .cuh)
INFO_WORDS = 5

#: What a rule's select pass (:data:`chainer_vgc.backends.registry.DeviceRule`)
#: is handed: the gradients end to end (``g``), ``sqsums()`` (their sums of
#: squares end to end, gathered on the first call), the current and next
#: state arenas by key (``old``, ``new``), the outputs ``sign``, ``ok``,
#: ``flags``, ``maxbits``, and the model's ``offsets`` (int64, tensor
#: bounds), ``nt`` (int32, the number of tensors), ``active`` (bool a
#: tensor: has a gradient this step) and ``sdt``, the state dtype.
SelectPass = collections.namedtuple(
    'SelectPass', 'g sqsums old new sign ok flags maxbits offsets nt active '
    'sdt')


def _span(arrays, size):
    """The 1-d array that ``arrays`` (C-contiguous, none missing) tile end
    to end, in order, from some element of one owner array, as a view of
    that owner; None when they do not.  (An empty array holds no memory:
    only its dtype is checked.)"""
    if not arrays or any(a is None for a in arrays):
        return None
    full = [a for a in arrays if a.size]
    if not full or any(a.dtype != full[0].dtype for a in arrays):
        return None
    base = full[0].base
    if base is None or base.ndim != 1 or not base.flags.c_contiguous \
            or base.dtype != full[0].dtype:
        return None
    at = full[0].data.ptr
    for a in full:
        if a.base is not base or not a.flags.c_contiguous or \
                a.data.ptr != at:
            return None
        at += a.nbytes
    start = (full[0].data.ptr - base.data.ptr) // base.itemsize
    if start + size > base.size:
        return None
    return base[start:start + size]


def device_rule(rule):
    """The rule's part of the whole-model step, as its module registered it
    (``registry.register('cuda', TheRule, factory)``, factory(rule) -> a
    :data:`~chainer_vgc.backends.registry.DeviceRule` or None; a subclass
    that overrides ``compress`` runs its own): None where the step does
    not run the rule."""
    return registry.find('cuda', rule)


def step_for(engine, grads):
    """The GPU engine's :class:`DeviceStep` (``engine.step``, made or
    replaced here) when it applies to ``grads`` (CuPy arrays, every one
    on one device), else None."""
    first = next((g for g in grads if g is not None), None)
    if first is None or not arrays.is_cupy(arrays.get_array_module(first)):
        return None  # (the CPU's steps pay for nothing more)
    compressor = engine.compressor
    part = device_rule(compressor.rule)
    if (part is None or any(n > codec.MAX_INDEX for n in compressor.sizes)
            or len({arrays.state_dtype(d) for d in compressor.dtypes}) != 1):
        return None
    present = [g for g in grads if g is not None]
    if not arrays.is_cupy(arrays.get_array_module(*present)):
        return None
    device = present[0].device
    if any(g.device != device for g in present):
        return None
    step = engine.step
    if step is None or step.part != part or step.device != device:
        with device:
            step = DeviceStep(compressor, part, device)
        engine.step = step
    return step


class DeviceStep(object):
    """One compressor's whole-model step on one device (see the module
    docstring)."""

    def __init__(self, compressor, part, device):
        xp = arrays.cupy
        #: ``part``: the rule's
        #: :data:`~chainer_vgc.backends.registry.DeviceRule`
        self.comp, self.part, self.device = compressor, part, device
        sizes = compressor.sizes
        self.n = len(sizes)
        self.sdt = arrays.state_dtype(compressor.dtypes[0])
        bounds = numpy.concatenate([[0], numpy.cumsum(sizes)]).astype(
            numpy.int64)
        self.size = int(bounds[-1])
        self.offsets = xp.asarray(bounds)
        self.keys = tuple(part.keys)
        #: two sets of state arenas; ``cur`` holds the state
        self.arenas = [{k: xp.zeros(self.size, self.sdt) for k in self.keys}
                       for _ in range(2)]
        self.views = [[{k: a[k][lo:hi] for k in self.keys}
                       for lo, hi in zip(bounds[:-1], bounds[1:])]
                      for a in self.arenas]
        self.cur = 0
        #: whether states[i] is this step's view (False: None, or zeros)
        self.installed = [False] * self.n
        self.maxbits = xp.zeros(max(self.n, 1), numpy.uint64)
        self.base = xp.empty(max(self.n, 1), numpy.int64)
        self.ek = xp.empty(max(self.n, 1), numpy.int64)
        self.active_key, self.active = None, None
        #: a one-element array of each input dtype (the gather's `like`)
        self.likes = {}
        #: the gather's address tables, host and device, per slot
        self.tables = {}
        #: [flags (a word a tensor), info (INFO_WORDS), message]
        self.head = self.n + INFO_WORDS
        #: whether the last message may hold groups that merge_spans joins
        self.mergeable = False
        # the longest message: dense FMT_RAW groups for 'none', else each
        # tensor's longest group in its coding ('gap': a FMT_GAP group of a
        # tiny tensor is longer than its elements)
        if part.dense:
            per = 2 if self.sdt == numpy.float64 else 1
            self.max_words = 2 + sum(codec.HEADER_WORDS + per * s
                                     for s in sizes)
        else:
            coding = compressor.rule.index_coding
            self.max_words = 2 + sum(codec.pow2_max_words(s, coding)
                                     for s in sizes)
        self.buffer = xp.empty(self.head + self.max_words, numpy.uint32)
        self.staged = arrays.host_buffer(self.buffer.size, numpy.uint32)
        self.cap = self.max_words

    # -- state -------------------------------------------------------------
    def _install(self):
        """Make the compressor's per-tensor states the views of the
        current arenas; a state set from outside (a snapshot loaded, a
        reset) is copied in first."""
        states = self.comp.states
        for i, view in enumerate(self.views[self.cur]):
            st = states[i]
            if st is view:
                continue
            if st is None:
                if self.installed[i]:  # reset from outside: start over
                    for key in self.keys:
                        view[key].fill(0)
                    self.installed[i] = False
                continue
            for key in self.keys:
                if st[key] is not view[key]:
                    view[key][...] = st[key]
            states[i] = view
            self.installed[i] = True

    def _commit(self, active):
        self.cur = 1 - self.cur
        states = self.comp.states
        for i, view in enumerate(self.views[self.cur]):
            if active[i] or self.installed[i]:
                states[i] = view
                self.installed[i] = True

    def _active(self, xp, grads):
        key = tuple(g is not None for g in grads)
        if key != self.active_key:
            self.active = xp.asarray(numpy.array(key or (False,), bool))
            self.active_key = key
        return self.active

    def _arena(self, xp, arrays, slot):
        """The arrays end to end (a missing one: zeros), in their dtype
        when they share it, else the state dtype.  Arrays that already lie
        end to end in one array (the sums of
        :class:`~chainer_vgc.statistics.PerSampleSquares`, written by its
        reductions into one arena) are read in place: no launch.  Else
        ``vgc_model_gather`` reads them through a table of their device
        addresses: one launch per input dtype, whatever the number of
        tensors (``cupy.concatenate`` takes one copy per input when they
        average over 2 MiB).  The table is uploaded only when an address
        changed since this ``slot``'s (gradients, sums) last step."""
        span = _span(arrays, self.size)
        if span is not None:
            return span
        dts = sorted({a.dtype for a in arrays if a is not None}, key=str)
        dtype = dts[0] if len(dts) == 1 else self.sdt
        out = xp.empty(self.size, dtype)
        if not self.size:
            return out
        arrays = [a if a is None or a.flags.c_contiguous
                  else xp.ascontiguousarray(a) for a in arrays]
        tables = self._tables(xp, arrays, dts, slot)
        nt = numpy.int32(self.n)
        for k, in_dtype in enumerate(dts or [dtype]):
            like = self.likes.get(in_dtype)
            if like is None:
                like = self.likes[in_dtype] = xp.zeros(1, in_dtype)
            kernels.get_kernel('vgc_model_gather')(
                tables[k], like, self.offsets, nt, out)
        return out

    def _tables(self, xp, arrays, dts, slot):
        """The gather's address tables (uint64 [input dtypes, tensors]) on
        the device: an array's address where it has the launch's dtype, 0
        for a missing array (first launch), 1 (left as it is) otherwise;
        uploaded when they differ from this slot's last ones."""
        table = numpy.ones((max(len(dts), 1), self.n), numpy.uint64)
        table[0] = 0
        for t, a in enumerate(arrays):
            if a is not None:
                table[dts.index(a.dtype), t] = a.data.ptr
        host, device = self.tables.get(slot, (None, None))
        if host is None or not numpy.array_equal(host, table):
            device = xp.asarray(table)
            self.tables[slot] = (table, device)
        return device

    # -- the step ------------------------------------------------------------
    def compress(self, grads, sqsums, agree):
        """One step (:meth:`GradientCompressor.compress
        <chainer_vgc.GradientCompressor.compress>`); returns the message, a
        view of a host buffer reused by the next call."""
        comp = self.comp
        sqsums = comp.validate(grads, sqsums, False, agree)
        before = comp.rule.get_extra_state()  # (given back on a fault)
        comp.rule.prepare(grads)
        comp.rule.begin_step()
        with self.device:
            self._install()
            self._passes(arrays.cupy, grads, sqsums)
            message, flags, info = self._download()
        flagged = [(int(i), int(flags[i])) for i in numpy.flatnonzero(flags)]
        try:
            comp.settle(comp.fault_of(flagged) if flagged else None, agree)
        except Exception:
            comp.rule.set_extra_state(before)
            raise
        self._commit(self.active_key)
        comp.last_sent = int(info[2]) | (int(info[3]) << 32)
        self.mergeable = bool(info[4])
        return message

    def _passes(self, xp, grads, sqsums):
        """Steps 1-6 (see the module docstring)."""
        rule, part, sdt = self.comp.rule, self.part, self.sdt
        old, new = self.arenas[self.cur], self.arenas[1 - self.cur]
        n = self.n
        flags = self.buffer[:max(n, 1)]
        msg = self.buffer[self.head:]
        offsets, nt = self.offsets, numpy.int32(n)
        active = self._active(xp, grads)
        kernels.get_kernel('vgc_model_clear')(nt, flags, self.maxbits)
        g = self._arena(xp, grads, 'g')
        if part.dense:
            kernels.get_kernel('vgc_model_none_layout')(
                offsets, nt, active, sdt == numpy.float64,
                xp.empty(1, numpy.int32), self.base, msg,
                self.buffer[n:n + INFO_WORDS])
            kernels.get_kernel('vgc_model_none_write')(
                g, offsets, nt, self.base, msg, flags)
            return
        sign = xp.empty(self.size, numpy.int8)
        ok = xp.empty(self.size, numpy.int64)  # scanned in place: pos
        part.select(rule, SelectPass(
            g, lambda: self._arena(xp, sqsums, 's'), old, new, sign, ok,
            flags, self.maxbits, offsets, nt, active, sdt))
        pos = kernels.scan(xp, ok)
        quantized = bool(part.quantized)
        scale = f32_bits(1.0 if quantized else part.scale(rule))
        if rule.index_coding != 'fixed':
            self._gap_passes(xp, sign, pos, active, old, new, scale)
            return
        kernels.get_kernel('vgc_model_layout')(
            pos, offsets, nt, quantized, numpy.uint32(scale),
            sdt == numpy.float64, xp.empty(1, numpy.int32), self.maxbits,
            self.base, self.ek, msg, self.buffer[n:n + INFO_WORDS])
        if quantized:
            kernels.get_kernel('vgc_model_vgc_write')(
                sign, pos, offsets, nt, self.base, self.ek, active,
                bool(rule.keep_unrepresentable), new['r'], new['v'], msg,
                flags)
        else:
            kernels.get_kernel('vgc_model_sign_write')(
                sign, pos, offsets, nt, self.base, msg)

    def _gap_passes(self, xp, sign, pos, active, old, new, scale):
        """Steps 6-7 with gap-coded indices: the words compacted by
        rank, the code lengths, one scan of them, the layout (FMT_GAP or
        the paper's words per tensor) and every message word assembled
        (see ``kernels/vgc_numerics.cuh``)."""
        rule, n = self.comp.rule, self.n
        quantized = bool(self.part.quantized)
        offsets, nt = self.offsets, numpy.int32(n)
        msg, flags = self.buffer[self.head:], self.buffer[:max(n, 1)]
        cw = xp.empty(self.size, numpy.uint32)
        ct = xp.empty(self.size, numpy.int32)
        if quantized:
            kernels.get_kernel('vgc_model_vgc_compact')(
                sign, pos, offsets, nt, self.maxbits, active,
                bool(rule.keep_unrepresentable), new['r'], new['v'], cw, ct,
                flags)
        else:
            kernels.get_kernel('vgc_model_sign_compact')(
                sign, pos, offsets, nt, cw, ct)
        length = xp.empty(self.size, numpy.int64)
        if self.size:
            kernels.get_kernel('vgc_model_gap_lengths')(
                cw, ct, pos, offsets, nt, length)
        ends = kernels.scan(xp, length)
        rec = xp.empty(6 * n + 2, numpy.int64)
        sign_only = not quantized
        kernels.get_kernel('vgc_model_gap_layout')(
            pos, ends, offsets, nt, quantized,
            self.sdt == numpy.float64, rule.index_coding == 'gap', sign_only,
            xp.empty(1, numpy.int32), self.maxbits, rec,
            self.buffer[n:n + INFO_WORDS])
        kernels.get_kernel('vgc_model_gap_assemble')(
            rec, nt, cw, pos, offsets, ends, numpy.uint32(scale),
            sign_only, msg)

    def _download(self):
        """Step 7: the flags, totals and message in one copy (a second
        one only when the message outgrew the last step's by more than
        :data:`SLACK` and :data:`MIN_SLACK`; the first step copies the
        longest message possible); returns (message, flags, info), host
        views."""
        n, head, host = self.n, self.head, self.staged
        first = head + self.cap
        self.buffer[:first].get(out=host[:first])
        total = int(host[n])
        if total > self.cap:
            self.buffer[first:head + total].get(out=host[first:head + total])
        self.cap = min(self.max_words, max(int(total * SLACK),
                                           total + MIN_SLACK)
                       + 2 + codec.HEADER_WORDS * n)
        return (host[head:head + total], host[:n],
                host[n:n + INFO_WORDS])
