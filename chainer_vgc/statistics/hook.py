"""The hook: how are the per-sample sums of squares gathered during one
ordinary backward pass (paper Sec. 4.1, Fig. "Basic"; Sec. 5)?

:class:`PerSampleSquares` is a Chainer ``FunctionHook``.  Before the
backward pass it finds the function nodes that consume each parameter
(:mod:`~chainer_vgc.statistics.graph`) and which example owns each row of
their inputs (:mod:`~chainer_vgc.statistics.rows`; for a minibatch of
variable-length sequences, recorded during the forward pass run inside
:meth:`PerSampleSquares.forward`); during it, it
looks at each such node, with the node's input data x and output gradient
gy, and hands them to the node's handler
(:mod:`~chainer_vgc.statistics.handlers`).  The state of one backward pass
is one :class:`_Pass`.

A parameter used by several function nodes (shared weights, RNN-style
reuse) has its per-example contributions of all uses added *before*
squaring; those uses are kept until the last of them has been seen (or,
for uses no gradient reached, the backward pass ends) and then combined
chunk by chunk.  Each convolution's use keeps the columns
Chainer made for its weight gradient
(:class:`~chainer_vgc.statistics.im2col.ColumnCapture`); the uses waiting
for their partners keep at most ``max_memory`` of them.  On the CPU, a
convolution whose statistics form every example's weight gradient gives
Chainer its batch gradient from those same products, in place of Chainer's
own GEMM (:mod:`~chainer_vgc.statistics.weight_gradient`; its last bits
may then differ from a plain backward's).

A parameter consumed by any other function gets no silent wrong answer:
``uncovered='error'`` (default) raises :class:`UncoveredParameterError`
listing them before the backward pass; ``uncovered='dense'`` leaves their
sums None and lists them in ``uncovered_names`` (the communicator then sends
them uncompressed); ``uncovered='bruteforce'`` computes them exactly by one
backward pass per example (:mod:`~chainer_vgc.statistics.bruteforce`; slow;
needs ``loss_fn`` and ``batch``).

Memory: each per-example intermediate stays under ``max_memory`` bytes
(default :data:`DEFAULT_MAX_MEMORY`, 64 MiB; on the 2-core benchmark machine
64 MiB chunks were faster than 256 MiB ones and stayed under the training
step's own peak).

Results are in the residual state dtype (float32 for float16 parameters) on
the parameter's device; a parameter that gets no gradient gives None.
"""

import contextlib

import chainer
from chainer import backend as chainer_backend
from chainer.functions.pooling import average_pooling_nd as _pooling_nd
import numpy

from chainer_vgc.backends import arrays
from chainer_vgc.params import model_params
from chainer_vgc.params import some_of
from chainer_vgc.statistics.bruteforce import _uncovered_sqsums
from chainer_vgc.statistics.contraction import Workspace
from chainer_vgc.statistics import rows as _rows
from chainer_vgc.statistics import tracing as _tracing
from chainer_vgc.statistics.graph import _scan
from chainer_vgc.statistics.handlers import _broadcasting
from chainer_vgc.statistics.handlers import _row_input
from chainer_vgc.statistics.handlers import _supported
from chainer_vgc.statistics.handlers import _takes_columns
from chainer_vgc.statistics.handlers import _uses_of
from chainer_vgc.statistics.im2col import ColumnCapture
from chainer_vgc.statistics.pullback import Pullback
from chainer_vgc.statistics.uses import _combined_sqsum
from chainer_vgc.statistics import weight_gradient as _weight_gradient

#: default bound of each per-example intermediate (bytes)
DEFAULT_MAX_MEMORY = 64 * 2 ** 20
#: bound of the arrays held by the uses whose sums wait for the end of the
#: backward pass (:meth:`_Pass.defer`; at most ``max_memory``).  Squared
#: between Chainer's own backward steps, a Transformer's 80 small sums
#: slowed those too: its statistics step went from 1.32-1.36x a plain one
#: to 1.24-1.28x (one process, three runs); they hold 10 MiB
DEFER_BYTES = 16 * 2 ** 20


_NOTHING = contextlib.nullcontext()


def _covered(fn, k, selection):
    """Whether a use (input k of fn, through ``selection`` or directly) is
    covered by the handlers."""
    if isinstance(selection, Pullback):
        return _supported(fn, k, selection.operand(_broadcasting(fn)))
    return _supported(fn, k) and (selection is None or selection.covered)


class UncoveredParameterError(ValueError):
    """Parameters consumed by functions PerSampleSquares cannot handle;
    ``names``: all of them (the message lists a few)."""

    def __init__(self, message, names=()):
        super(UncoveredParameterError, self).__init__(message)
        self.names = list(names)


class _Pass(object):
    """The state of one :meth:`PerSampleSquares.backward`, read by the hook
    during ``loss.backward``.

    ``uses``: {parameter index: [(fn, k, selection)]} the hook handles
    (not brute force, not dense); ``b``: the number of examples;
    ``layouts``: {fn: (kind, k or idx)}, how the rows of fn's input
    become the b examples (:func:`~chainer_vgc.statistics.rows.layout`);
    ``single``: the indices with one use (squared as soon as it is seen,
    or, when what it holds is small and not a convolution's, once the
    pass is over, from its own copy of the output gradient:
    :meth:`defer`);
    ``by_fn``: {fn: [(index, k, selection)]}; ``pending``: {index:
    [(use, group)]} the uses of shared parameters, combined when the
    backward pass is over; ``results``: {index: sum of squares};
    ``views``: where the sums are written (see
    :meth:`PerSampleSquares._arena_views`), or None.
    """

    def __init__(self, uses, b, layouts, views=None, defer_bytes=0,
                 gy_written=False):
        self.uses = uses
        self.b = b
        self.layouts = layouts
        self.views = views
        self.single = {i for i, us in uses.items() if len(us) == 1}
        self.by_fn = {}
        for i, us in uses.items():
            for fn, k, sel in us:
                self.by_fn.setdefault(fn, []).append((i, k, sel))
        self.pending = {}
        #: bytes of Chainer's columns the pending uses keep
        self.held = 0
        self.results = {}
        #: [(index, use, group)] squared when the pass is over, and the
        #: bytes of the arrays they hold (at most ``defer_bytes``)
        self.deferred = []
        self.deferred_bytes = 0
        self.defer_bytes = defer_bytes
        #: a function writes into its output gradient: the uses kept past
        #: their node copy theirs (:func:`_writes_its_output_gradient`)
        self.gy_written = gy_written

    def room(self, nbytes):
        """Whether arrays of ``nbytes`` fit in what is left of
        ``defer_bytes``."""
        return self.deferred_bytes + nbytes <= self.defer_bytes

    def defer(self, i, use, group, nbytes):
        """Keep parameter i's single use, which holds arrays of ``nbytes``,
        to be squared when the backward pass is over, if they fit in what
        is left of ``defer_bytes`` (True); False: square it now."""
        if not self.room(nbytes):
            return False
        self.deferred.append((i, use, group))
        self.deferred_bytes += nbytes
        return True

    def out(self, i):
        """Where parameter i's sum is written (None: a new array)."""
        return None if self.views is None else self.views[i]


class PerSampleSquares(chainer.FunctionHook):
    """Per-sample sums of squared gradients of a link's parameters.

    Args:
        target: a :class:`chainer.Link` (all its parameters, in
            :func:`model_params` order) or a list of ``(name, param)``.
        max_memory: bound in bytes of each per-example intermediate.
        uncovered: ``'error'``, ``'dense'`` or ``'bruteforce'`` (see the
            module doc).
        batch_size: number of examples B; else read from the ``batch``
            given to :meth:`backward` (one of the two is needed).
        examples: None, or a function of the minibatch's arrays (as
            :meth:`backward` gets them) returning its examples, one array
            or tuple of arrays each (see
            :mod:`~chainer_vgc.statistics.rows`;
            :func:`~chainer_vgc.statistics.rows.sentence_pairs`).
        fused_weight_gradient: on the CPU, a convolution whose statistics
            form every example's weight gradient hands Chainer the batch
            gradient from those products instead of Chainer computing it
            again (:mod:`~chainer_vgc.statistics.weight_gradient`: about
            one GEMM less per such layer; the gradient's last bits may
            differ from a plain backward's).  False: Chainer's own
            gradient everywhere.

    Use :meth:`backward` instead of ``loss.backward()``; it returns the
    list of sums (aligned with :attr:`names`) and leaves the usual
    gradients in ``param.grad``.
    """

    name = 'PerSampleSquares'

    def __init__(self, target, max_memory=DEFAULT_MAX_MEMORY,
                 uncovered='error', batch_size=None, examples=None,
                 fused_weight_gradient=True):
        if isinstance(target, chainer.Link):
            self.names, self.params = model_params(target)
        else:
            pairs = list(target)
            self.names = [n for n, _ in pairs]
            self.params = [p for _, p in pairs]
        if uncovered not in ('error', 'bruteforce', 'dense'):
            raise ValueError("uncovered must be 'error', 'bruteforce' or "
                             "'dense', got {!r}".format(uncovered))
        if not max_memory > 0:
            raise ValueError('max_memory must be a positive number of bytes, '
                             'got {!r}'.format(max_memory))
        if batch_size is not None and int(batch_size) < 1:
            raise ValueError('batch_size must be >= 1, got {!r}'.format(
                batch_size))
        if examples is not None and not callable(examples):
            raise ValueError('examples must be a function of the '
                             "minibatch's arrays returning its examples, "
                             'got {!r}'.format(examples))
        self.max_memory = max_memory
        self.uncovered = uncovered
        self.batch_size = batch_size
        self.examples = examples
        self.sqsums = [None] * len(self.params)
        #: names of parameters to leave out (no sum is computed: None)
        self.skip = set()
        #: with uncovered='dense': the parameters the last backward could
        #: not cover (their sums are None)
        self.uncovered_names = []
        #: the parameters whose sums the last backward computed exactly in
        #: the pass (not by brute force; names only: the pass's function
        #: nodes hold the graph and are not kept)
        self.covered_names = []
        #: the current backward pass (a _Pass), None outside backward
        self._pass = None
        #: the products' buffers, kept from step to step
        self.work = Workspace()
        #: Chainer's own im2col of each convolution, taken over
        self._capture = ColumnCapture()
        self.fused_weight_gradient = bool(fused_weight_gradient)
        #: the convolutions' batch gradients from the statistics' products
        self._fused = _weight_gradient.FusedWeightGradient()

    def minibatch(self, batch=(), kwargs=None):
        """The :class:`~chainer_vgc.statistics.rows.Minibatch` of
        ``batch`` (positional arrays, lists of one array per example) and
        ``kwargs`` (keyword ones), read as :meth:`backward` reads it."""
        if isinstance(batch, _rows.Minibatch):
            return batch
        return _rows.minibatch(batch, self.examples, kwargs,
                               self.batch_size)

    @contextlib.contextmanager
    def forward(self, batch=(), kwargs=None):
        """Context of the forward pass whose loss a :meth:`backward` gets:
        records which function inputs are the minibatch's per-example
        arrays (needed for a minibatch of one array per example; the graph
        does not keep them).  Yields the minibatch (a
        :class:`~chainer_vgc.statistics.rows.Minibatch` holding the
        record), to be passed to :meth:`backward` as ``batch``."""
        mb = self.minibatch(batch, kwargs)
        if not mb.traced:
            yield mb
            return
        recorder = _rows.Recorder(mb)
        with recorder:
            yield mb
        mb.leaves = recorder.leaves
        mb.keep.extend(recorder.nodes)

    def backward(self, loss, loss_fn=None, batch=(), **backward_kwargs):
        """Run ``loss.backward(**backward_kwargs)`` and compute the sums.

        ``batch``: the minibatch: arrays with the examples on their first
        axis, and/or lists of one array per example (variable-length
        sequences; the rows each function sees are then traced through the
        graph, best with the forward pass run inside :meth:`forward`), or
        what :meth:`forward` yielded.  It gives B and lets the rows each
        function sees be traced to examples
        (:mod:`~chainer_vgc.statistics.rows`).
        ``loss_fn`` is needed only for ``uncovered='bruteforce'``:
        ``loss_fn(*batch)`` must compute ``loss``, and the uncovered
        parameters' sums are then formed from one pass of ``loss_fn`` per
        example (``loss_fn`` applied to that example alone, v_z), before
        ``loss.backward``.

        Brute force assumes the loss is linear in per-example terms:
        ``loss = c * sum_z v_z`` with one constant c (c = 1/B for a mean,
        1 for a sum, times any loss scale the loss was multiplied by; a
        ``loss_scale`` passed here multiplies it as it does the gradients).
        The contribution of example z is then ``c * grad v_z``.  c is
        inferred from the batch loss and the batch gradient of the
        uncovered parameters (one extra ``chainer.grad`` pass) and both are
        checked against the per-example sums up to rounding; a loss that
        is not of this form (per-example weights, a nonlinear function of a
        batch mean, a ``loss_fn`` that does not reproduce ``loss``) raises
        ValueError.  So do graphs the per-example passes cannot reproduce:
        batch normalization in training mode, and active dropout or other
        random noise (``chainer.functions.noise``).  Whatever ``loss_fn``
        reports during these passes is discarded: the current reporter
        keeps only what the real pass reported.
        """
        mb = self.minibatch(batch)
        functions, uses, consumers = _scan(loss, self.params,
                                           {id(a) for a in mb.arrays})
        uses = {i: us for i, us in uses.items()
                if self.names[i] not in self.skip}
        b = mb.b
        uncovered = sorted(i for i, us in uses.items()
                           if not all(_covered(fn, k, sel)
                                      for fn, k, sel in us))
        brute = {}
        self.uncovered_names = []
        if uncovered and self.uncovered == 'dense':
            # the caller sends them densely: no sums
            self.uncovered_names = [self.names[i] for i in uncovered]
            uses = {i: us for i, us in uses.items() if i not in uncovered}
        elif uncovered:
            if mb.traced and self.uncovered == 'bruteforce':
                raise ValueError(
                    "uncovered='bruteforce' slices the minibatch's arrays "
                    'by example; a minibatch of one array per example is '
                    "not supported there. Use uncovered='dense' for: "
                    + self._listing(uncovered, uses))
            brute = self._bruteforce(uncovered, uses, functions, loss_fn,
                                     mb.arrays, loss,
                                     backward_kwargs.get('loss_scale'))
        # (a local: its function nodes hold the graph, and with it the
        # activations they retain, which must not outlive this pass)
        uses = {i: us for i, us in uses.items() if i not in brute}
        layouts = self._layouts(uses, functions, consumers, mb)
        self.covered_names = [self.names[i] for i in sorted(uses)]
        current = _Pass(uses, b, layouts, self._arena_views(),
                        min(self.max_memory, DEFER_BYTES),
                        any(map(_writes_its_output_gradient, functions)))
        self.sqsums = [None] * len(self.params)
        self._fused.reset()
        try:
            self._pass = current
            convolutions = any(_takes_columns(fn) for us in uses.values()
                               for fn, _, _ in us)
            with self, (self._capture if convolutions else _NOTHING), (
                    self._fused if convolutions and
                    self.fused_weight_gradient else _NOTHING):
                loss.backward(**backward_kwargs)
            for i, use, group in current.deferred:
                current.results[i] = use.sqsum(group, self.max_memory,
                                               current.out(i), self.work)
            for i, use_list in current.pending.items():
                current.results[i] = _combined_sqsum(
                    use_list, b, self.max_memory, current.out(i), self.work)
        finally:
            self._pass = None
        for i, p in enumerate(self.params):
            if i in brute:
                self.sqsums[i] = brute[i]
            elif i in current.results:
                self.sqsums[i] = current.results[i]
            elif p.grad is not None and i in uses:
                # reached, but no gradient flowed through any use
                self.sqsums[i] = p.xp.zeros(p.shape, arrays.state_dtype(
                    p.dtype))
        return self.sqsums

    def _layouts(self, uses, functions, consumers, mb):
        """{fn: layout} of every use's function node: B contiguous
        groups of the first axis for a minibatch of arrays of examples,
        traced rows for one of one array per example
        (:mod:`~chainer_vgc.statistics.rows`)."""
        layouts = {}
        tracer = None
        for i, us in sorted(uses.items()):
            for fn, k, _ in us:
                if fn in layouts:
                    continue
                if not mb.traced:
                    layouts[fn] = ('groups', _rows.regular_layout(
                        fn, self.names[i], mb, consumers,
                        _row_input(fn, k)))
                    continue
                if tracer is None:
                    tracer = _tracing.Tracer(
                        functions, {id(p.node) for p in self.params}, mb,
                        mb.leaves)
                layouts[fn] = _rows.layout(
                    tracer.owners(fn, self.names[i], _row_input(fn, k)),
                    mb.b)
        return layouts

    def memory(self):
        """Bytes this hook holds after a backward, by role: ``sums`` (the
        per-sample sums of squares s of the parameters, one array end to
        end; a new one each backward, since an exchange may still read the
        last) and ``workspace`` (the buffers kept between passes, bounded
        by ``max_memory``: :class:`~chainer_vgc.statistics.contraction.
        Workspace`)."""
        seen, sums = set(), 0
        for a in self.sqsums or ():
            if a is None:
                continue
            base = a.base if a.base is not None else a
            if id(base) not in seen:
                seen.add(id(base))
                sums += int(base.nbytes)
        return {'sums': sums, 'workspace': int(self.work.nbytes)}

    def _arena_views(self):
        """Where this backward's sums go: views of one new array, the
        parameters' sums end to end in :attr:`names` order, when every
        parameter has data on one device and one state dtype (else
        None: each sum is its own array).  The reductions write into
        them, and a compressor on the GPU then reads the sums in place
        instead of gathering them (:mod:`chainer_vgc.engines.cuda.compress`)."""
        data = [p.array for p in self.params]
        if not data or any(a is None for a in data):
            return None
        dtypes = {arrays.state_dtype(a.dtype) for a in data}
        xp = arrays.get_array_module(data[0])
        if len(dtypes) != 1 or any(
                arrays.get_array_module(a) is not xp for a in data):
            return None
        if arrays.is_cupy(xp) and len({a.device.id for a in data}) != 1:
            return None
        with arrays.device_scope(data[0]):
            arena = xp.empty(sum(a.size for a in data), dtypes.pop())
        views, at = [], 0
        for a in data:
            views.append(arena[at:at + a.size].reshape(a.shape))
            at += a.size
        return views

    def __enter__(self):
        if getattr(self, '_pass', None) is None:
            raise TypeError('use PerSampleSquares.backward(loss, batch=...) '
                            'instead of registering the hook with "with"')
        return super(PerSampleSquares, self).__enter__()

    def _bruteforce(self, uncovered, uses, functions, loss_fn, batch, loss,
                    loss_scale):
        """{index: sum} of the uncovered parameters, or the error their
        ``uncovered`` mode asks for."""
        listing = self._listing(uncovered, uses)
        if self.uncovered == 'error':
            raise UncoveredParameterError(
                'per-sample statistics are not implemented for {} '
                'parameter(s): {}. Say what happens to them with the '
                "communicator's option: chainer_vgc.create_communicator(..., "
                "uncovered='dense') sends them uncompressed (a dense "
                "allreduce), uncovered='bruteforce' computes them exactly, "
                'one backward pass per example (not with dropout or batch '
                'normalization in training mode), or '
                'create_communicator(..., exclude=[...]) sends the names you '
                'give dense from the start (PerSampleSquares(model, '
                'uncovered=...) where you call the hook yourself; every '
                'name: the exception\'s .names)'.format(len(uncovered),
                                                        listing),
                names=[self.names[i] for i in uncovered])
        sums = _uncovered_sqsums([self.params[i] for i in uncovered],
                                 listing, functions, loss_fn, batch, loss,
                                 loss_scale)
        return dict(zip(uncovered, sums))

    def _listing(self, indices, uses):
        """A few of the parameters ``indices`` with the functions that use
        them, and a count."""
        return some_of(['{} (used by {})'.format(
            self.names[i], ', '.join(sorted({
                sel.describe(fn) if sel is not None else type(fn).__name__
                for fn, _, sel in uses[i]}))) for i in indices])

    # -- hook --
    def backward_preprocess(self, function, in_data, out_grad):
        """Chainer's function-hook callback, before ``function``'s
        backward: marks the weight-gradient call of a convolution whose
        statistics may give Chainer its batch gradient
        (:mod:`~chainer_vgc.statistics.weight_gradient`).  Does nothing
        outside :meth:`backward` or with ``fused_weight_gradient=False``."""
        current = self._pass
        if current is None or not self._fused.active:
            return
        entries = current.by_fn.get(function)
        if not entries or out_grad[0] is None:
            return
        kind, group = current.layouts[function]
        if kind != 'groups':
            return
        gy = out_grad[0]
        xp = chainer_backend.get_array_module(gy)
        for i, k, sel in entries:
            param = self.params[i]
            if (sel is not None or i not in current.single or gy.ndim != 4
                    or not _weight_gradient.eligible(
                        function, k, param, gy.shape[2] * gy.shape[3] *
                        group, in_data[0], gy)):
                continue
            use = _uses_of(function, k, in_data, gy,
                           arrays.state_dtype(param.dtype), xp)

            def run(use=use, i=i, shape=param.shape):
                grad = xp.empty(shape, use.dtype)
                current.results[i] = use.sqsum(group, self.max_memory,
                                               current.out(i), self.work,
                                               grad=grad)
                return grad
            self._fused.mark(in_data[0], gy, i, run)

    def backward_postprocess(self, function, in_data, out_grad):
        """Chainer's function-hook callback, after ``function``'s backward.

        For each parameter ``function`` consumes, adds the per-example
        contributions of ``out_grad[0]`` to that parameter's sum of squares
        (shared parameters: kept until their last use is seen).  Does
        nothing outside :meth:`backward`.
        """
        current = self._pass
        if current is None:
            return
        entries = current.by_fn.get(function)
        if not entries or out_grad[0] is None:
            return
        if self._fused.active:  # handled in the weight-gradient call
            self._fused.forget(in_data[0], out_grad[0])
            entries = [e for e in entries if e[0] not in self._fused.done]
            if not entries:
                return
        gy_all = out_grad[0]
        xp = chainer_backend.get_array_module(gy_all)
        kind, how = current.layouts[function]
        x_data = in_data
        # (a convolution's uses find Chainer's columns by their very gy
        # array, and are large: squared now, or kept as they are)
        columns = _takes_columns(function)
        if kind == 'index':  # rows regrouped by example, once per node
            r = _row_input(function, entries[0][1])
            x_data = tuple(_rows.gather_rows(xp, a, how) if j == r else a
                           for j, a in enumerate(in_data))
            gy_all = _rows.gather_rows(xp, gy_all, how)
        elif current.gy_written and not columns and (
                any(i not in current.single for i, _, _ in entries) or
                current.room(_nbytes(gy_all, *x_data))):
            # kept past this call: a later backward may write into this
            # very array (average pooling divides its own gy in place, and
            # Add hands one array to both its inputs)
            gy_all = gy_all.copy()
        for i, k, sel in entries:
            dtype = arrays.state_dtype(self.params[i].dtype)
            gy = gy_all
            if isinstance(sel, Pullback):  # through functions of itself
                wide = _broadcasting(function)
                use = sel.wrap(_uses_of(function, k, x_data, gy, dtype, xp,
                                        operand=sel.operand(wide)),
                               xp, dtype, wide)
            else:
                if sel is not None:  # the parameter's rows of a stack
                    gy = xp.take(gy, xp.asarray(sel.rows), axis=1)
                use = _uses_of(function, k, x_data, gy, dtype, xp)
            group = how if kind == 'groups' else how.shape[1]
            if kind == 'groups' and hasattr(use, 'adopt_columns'):
                # (Chainer's columns are in the rows' own order)
                use.adopt_columns(self._capture)
            if i in current.single:  # now, or with the small ones at the end
                if not columns and current.defer(
                        i, use, group, _nbytes(gy, *x_data, dtype=dtype)):
                    continue
                current.results[i] = use.sqsum(group, self.max_memory,
                                               current.out(i), self.work)
                continue
            # shared: combined per example once its last use is seen (or
            # when the backward pass is over); the Chainer columns a use
            # keeps meanwhile stay under max_memory in all
            held = getattr(use, 'columns', None)
            if held is not None:
                if current.held + held.nbytes > self.max_memory:
                    use.columns = None
                else:
                    current.held += held.nbytes
            pending = current.pending.setdefault(i, [])
            pending.append((use, group))
            if len(pending) == len(current.uses[i]):
                del current.pending[i]
                current.results[i] = _combined_sqsum(
                    pending, current.b, self.max_memory, current.out(i),
                    self.work)
                current.held -= sum(u.columns.nbytes for u, _ in pending
                                    if getattr(u, 'columns', None)
                                    is not None)


def _nbytes(*arrays, dtype=numpy.int8):
    """Bytes of the arrays (None: nothing), each element at least of
    ``dtype``'s size (a use holds float16 data as a float32 copy): a
    bound, not a measure."""
    size = numpy.dtype(dtype).itemsize
    return sum([a.size * max(a.itemsize, size) for a in arrays
                if a is not None])


def _writes_its_output_gradient(fn):
    """Whether function node fn's backward writes into the output gradient
    it is given, which other functions may hold too: Chainer's
    ``AveragePoolingND`` with ``pad_value=None`` divides it in place (its
    other functions return new arrays)."""
    return isinstance(fn, _pooling_nd.AveragePoolingND) and (
        fn.pad_value is None)
