"""ChainerMN glue: a communicator that averages compressed gradients.

The question this module answers: how does a ChainerMN job run one step of
compressed data parallelism over MPI, and how is that run saved and
resumed?  ``multi_node_mean_grad`` runs the data flow of one step on every
rank: gradients (+ per-sample statistics) -> rule -> codec -> one uint32
message -> allgatherv (:mod:`chainer_vgc.transport`; paper Sec. 4.3: each
worker sends its elements to every other worker, nothing is re-compressed)
-> decode every rank's message, sum in rank order, multiply by 1/size (as
ChainerMN's naive communicator does) -> ``param.grad``
(:mod:`chainer_vgc.exchange`).  The dense group goes through MPI allreduce
(here); the settings and the groups are :mod:`chainer_vgc.groups`', the
figures reported :mod:`chainer_vgc.extensions`'.  Here: the MPI
collectives, the checks that every rank agrees, and the snapshots.

The per-sample statistics come from the user's ordinary backward pass when
the optimizer is wrapped by :func:`create_multi_node_optimizer`.
"""

import json
import threading
import time
import warnings

import chainer
from chainermn.communicators import mpi_communicator_base
import numpy

from chainer_vgc import backend
from chainer_vgc import exchange
from chainer_vgc import extensions
from chainer_vgc import groups
from chainer_vgc import native
from chainer_vgc import transport
from chainer_vgc.compressor import GradientCompressor
from chainer_vgc.compressor import SkippedStep
from chainer_vgc.rules import RULES
from chainer_vgc.rules import create_rule
from chainer_vgc.statistics import DEFAULT_MAX_MEMORY
from chainer_vgc.statistics import PerSampleSquares
from chainer_vgc.statistics import model_params

# Moved to the modules named above; still importable from here (tests,
# examples and user code reach them as chainer_vgc.communicator.NAME).
from chainer_vgc.exchange import _device_finish_mean  # NOQA
from chainer_vgc.exchange import _device_mean  # NOQA
from chainer_vgc.exchange import _finish_mean  # NOQA
from chainer_vgc.exchange import _native_decode_applies  # NOQA
from chainer_vgc.exchange import _on_device  # NOQA
from chainer_vgc.exchange import _tree_sum  # NOQA
from chainer_vgc.exchange import local_gradients  # NOQA
from chainer_vgc.exchange import mean_gradients  # NOQA
from chainer_vgc.exchange import sum_messages  # NOQA
from chainer_vgc.exchange import unscaled as _unscaled  # NOQA
from chainer_vgc.exchange import upload_blocks  # NOQA
from chainer_vgc.exchange import validate_messages  # NOQA
from chainer_vgc.exchange import write_mean  # NOQA
from chainer_vgc.extensions import new_totals  # NOQA
from chainer_vgc.extensions import report_step  # NOQA
from chainer_vgc.extensions import step_figures  # NOQA
from chainer_vgc.groups import check_count as _check_count  # NOQA
from chainer_vgc.groups import check_dense_dtype as _check_dense_dtype  # NOQA
from chainer_vgc.groups import check_exclude as _check_exclude  # NOQA
from chainer_vgc.groups import check_ramp as _check_ramp  # NOQA
from chainer_vgc.groups import dense_group  # NOQA
from chainer_vgc.groups import make_rule as _make_rule  # NOQA


def _per_thread(name, doc):
    """An attribute that a thread running :meth:`VGCCommunicator.background`
    sees in its own view (double buffering), every other thread in the
    communicator."""
    private = '_' + name

    def get(self):
        view = getattr(getattr(self, '_views', None), 'view', None)
        if view is not None and name in view:
            return view[name]
        return getattr(self, private)

    def set(self, value):
        view = getattr(getattr(self, '_views', None), 'view', None)
        if view is not None and name in view:
            view[name] = value
        else:
            setattr(self, private, value)
    return property(get, set, doc=doc)


class VGCCommunicator(mpi_communicator_base.MpiCommunicatorBase):
    """ChainerMN communicator exchanging compressed gradients.

    Args:
        mpi_comm: an mpi4py communicator.
        method: a rule name (``'vgc'``, ``'hybrid'``, ``'strom'``,
            ``'qsgd'``, ``'none'``) or a
            :class:`~chainer_vgc.rules.CompressionRule` object (a rule of
            your own: see the README).
        allgatherv: ``'ring'`` (pipelined ring on point-to-point calls) or
            ``'mpi'`` (``MPI_Allgatherv``).
        chunk_words: pipelining chunk of the ring, in 32-bit words.
        max_memory: passed to
            :class:`~chainer_vgc.statistics.PerSampleSquares`.
        uncovered: parameters the per-sample statistics do not cover (LSTM,
            attention, ...): ``'error'`` (default), ``'bruteforce'`` (exact,
            one backward pass per example) or ``'dense'`` (sent in the dense
            group, with one warning listing them).
        exclude: parameters sent uncompressed, in the dense group: names
            (as in ``model.namedparams()``) and/or predicates
            ``f(name, param) -> bool`` (of the name, shape and dtype only:
            the group must be the same on every rank).
        min_size: parameters of fewer elements go to the dense group too
            (biases, batch normalization); 0: none.
        warmup: exchanges (steps) with every parameter dense before
            compression starts; the residuals start empty after it.
        alpha_ramp: ``(alpha0, steps)``: after the warm-up, the rule's
            ``alpha`` goes linearly from alpha0 to its own value over that
            many steps (DGC-style); None: constant.
        dense_dtype: None (the parameters' dtypes, exactly ChainerMN's naive
            allreduce) or ``'float16'``: the dense group is cast to float16
            and summed in float16 in one allreduce, as ChainerMN's
            ``allreduce_grad_dtype``.
        resume_other_method: allow loading a snapshot saved with another
            method (its residuals are then dropped, with a warning); by
            default a snapshot of other settings is an error.
        cuda_aware_mpi: declare that MPI accepts device pointers; by
            default (False) every collective on GPU arrays goes through
            host memory (the compressed exchange always does).
        **hyperparams: the rule's (``alpha``, ``zeta``, ``tau``, ``bits``,
            ``bucket``, ``seed``, ``quantize``, ...), with a method name.

    The compressed group goes through the allgatherv (ring by default); the
    dense group through MPI allreduce, after it.  Every argument is checked
    on every rank before any exchange.
    """

    mpi_comm = _per_thread('mpi_comm', 'the mpi4py communicator (in a '
                           'background exchange: its duplicate)')
    totals = _per_thread('totals', 'running totals since construction')
    last = _per_thread('last', 'figures of the last step (aggregated over '
                       'ranks)')
    skipped = _per_thread('skipped', 'whether the last exchange was skipped '
                          '(a rank\'s gradients were not finite)')
    last_timing = _per_thread('last_timing', "seconds of the last "
                              "exchange's phases on this rank")

    def __init__(self, mpi_comm, method='vgc', allgatherv='ring',
                 chunk_words=transport.DEFAULT_CHUNK_WORDS,
                 max_memory=DEFAULT_MAX_MEMORY, uncovered='error',
                 resume_other_method=False, cuda_aware_mpi=False,
                 exclude=None, min_size=0, warmup=0, alpha_ramp=None,
                 dense_dtype=None, **hyperparams):
        self._views = threading.local()
        super(VGCCommunicator, self).__init__(mpi_comm)
        self.resume_other_method = bool(resume_other_method)
        self.cuda_aware_mpi = bool(cuda_aware_mpi)
        allgatherv, chunk_words = transport.check_arguments(allgatherv,
                                                            chunk_words)
        if uncovered not in ('error', 'bruteforce', 'dense'):
            raise ValueError("uncovered must be 'error', 'bruteforce' or "
                             "'dense', got {!r}".format(uncovered))
        self.base_rule = groups.make_rule(method, hyperparams)
        self.method = self.base_rule.name
        self.hyperparams = dict(hyperparams)
        self._method_arg = method
        #: this rank's rule (QSGD: its own random stream)
        self.rule = self.base_rule.for_rank(self.rank)
        self.exclude = groups.check_exclude(exclude)
        self.min_size = groups.check_count('min_size', min_size)
        self.warmup = groups.check_count('warmup', warmup)
        self.alpha_ramp = groups.check_ramp(alpha_ramp, self.base_rule)
        self.dense_dtype = groups.check_dense_dtype(dense_dtype)
        self.allgatherv_method = allgatherv
        self.chunk_words = chunk_words
        self.max_memory = max_memory
        self.uncovered = uncovered
        self.compressor = None
        self._names = None
        self._dense = set()
        self._uncovered_dense = set()
        self._stats = None
        self._sqsums = None
        self._loaded_state = None
        #: figures of the last step (aggregated over ranks)
        self.last = {}
        #: running totals since construction
        self.totals = extensions.new_totals()
        self.last_timing = {}
        self._loss_scale = None
        #: whether the last exchange was skipped (a rank's gradients were
        #: not finite)
        self.skipped = False

    def split(self, color, key):
        return self.__class__(
            mpi_comm=self.mpi_comm.Split(color, key),
            method=self._method_arg, allgatherv=self.allgatherv_method,
            chunk_words=self.chunk_words, max_memory=self.max_memory,
            uncovered=self.uncovered,
            resume_other_method=self.resume_other_method,
            cuda_aware_mpi=self.cuda_aware_mpi, exclude=self.exclude,
            min_size=self.min_size, warmup=self.warmup,
            alpha_ramp=self.alpha_ramp, dense_dtype=self.dense_dtype,
            **self.hyperparams)

    @property
    def needs_sqsum(self):
        """Whether this step needs the per-sample statistics (not during
        the warm-up, nor for a rule that does not use them)."""
        return self.needs_sqsum_after(self.totals['steps'])

    def needs_sqsum_after(self, steps):
        """Whether an exchange that starts when at most ``steps`` exchanges
        have completed may need the per-sample statistics (double
        buffering decides before the exchange in flight completes: it
        computes them unless the coming exchange is surely a warm-up)."""
        names, dense = self._names, self._dense
        everything_dense = names is not None and len(dense) == len(names)
        return (self.rule.needs_sqsum and self.rule.exchange != 'allreduce'
                and steps >= self.warmup and not everything_dense)

    # -- double buffering ---------------------------------------------------
    def background_view(self, mpi_comm):
        """The state a background exchange works on (double buffering):
        ``mpi_comm`` (a duplicate, so that its collectives never mix with
        the main thread's), a copy of the run totals, and its own ``last``,
        ``skipped`` and ``last_timing``; :meth:`commit` makes them the
        communicator's once the exchange has completed."""
        return {'mpi_comm': mpi_comm, 'totals': dict(self.totals),
                'last': {}, 'skipped': False, 'last_timing': {}}

    def run_in_view(self, view, fn, *args, **kwds):
        """``fn(*args, **kwds)`` in this thread, with the communicator's
        per-thread attributes read from and written to ``view``."""
        self._views.view = view
        try:
            return fn(*args, **kwds)
        finally:
            self._views.view = None

    def commit(self, view):
        """A completed background exchange's totals and figures become
        the communicator's (main thread)."""
        for key in ('totals', 'last', 'skipped', 'last_timing'):
            setattr(self, key, view[key])

    @property
    def warming_up(self):
        """Whether the next exchange is a warm-up (dense) one."""
        return self.totals['steps'] < self.warmup

    # -- statistics ---------------------------------------------------------
    def statistics(self, model):
        """The PerSampleSquares hook for ``model`` (kept between steps);
        parameters of the dense group are skipped."""
        names, _ = model_params(model)
        if self._stats is None or self._stats.names != names:
            self._stats = PerSampleSquares(
                model, max_memory=self.max_memory, uncovered=self.uncovered)
        self._stats.skip = self.dense_group(model)
        return self._stats

    def set_sqsums(self, sqsums):
        """Per-sample sums of squares for the next multi_node_mean_grad,
        aligned with ``model_params(model)``."""
        self._sqsums = sqsums

    # -- set-up and consistency ---------------------------------------------
    def setup(self, model):
        """Build the compressor for ``model`` and check that every rank has
        the same model (names, shapes, dtypes), method, dense group and
        warm-up.

        Raises ValueError on every rank otherwise.  Called by the first
        :meth:`multi_node_mean_grad` and before loading state.
        """
        names, params = _initialized(model)
        dense = self.dense_group(model)
        if (self._names == names and self._dense == dense
                and self.compressor is not None):
            return
        signature = ((self.method, _record(self.base_rule.hyperparams())),
                     (self.allgatherv_method, self.chunk_words,
                      backend.cpu_backend()),
                     [(n, tuple(p.shape), str(p.dtype))
                      for n, p in zip(names, params)],
                     (sorted(dense), self.warmup, self.alpha_ramp,
                      str(self.dense_dtype), self.uncovered))
        everyone = self.mpi_comm.allgather(signature)
        diffs = [r for r, sig in enumerate(everyone) if sig != everyone[0]]
        if diffs:
            label, mine, theirs = _first_difference(everyone[0],
                                                    everyone[diffs[0]])
            raise ValueError(
                'chainer_vgc: ranks {} differ from rank 0 in {}: rank 0 has '
                '{} but rank {} has {}. Every rank must build the same model '
                'and communicator'.format(diffs, label, mine, diffs[0],
                                          theirs))
        if self.dense_dtype == numpy.float16:
            # (during a warm-up every parameter is in the dense group)
            wide = [n for n, p in zip(names, params)
                    if (n in dense or self.warmup)
                    and p.dtype == numpy.float64]
            if wide:
                raise ValueError(
                    "dense_dtype='float16' would round the float64 "
                    'parameters {} of the dense group to float16; use '
                    'dense_dtype=None for this model'.format(wide))
        # residuals are kept per parameter name: a parameter initialized
        # later (a branch reached mid-run) starts fresh, the others go on
        kept = {}
        if self.compressor is not None:
            kept = {n: st for n, st in zip(self.compressor.names,
                                           self.compressor.states)
                    if st is not None}
        pairs = [(n, p) for n, p in zip(names, params) if n not in dense]
        self.compressor = GradientCompressor(
            self.rule, [n for n, _ in pairs], [p.shape for _, p in pairs],
            [p.dtype for _, p in pairs])
        if self.compressor.backend == 'native':
            # the cores of this node, shared by its ranks (OMP_NUM_THREADS
            # wins where set)
            threads = native.default_threads(self.intra_size)
            if threads:
                native.set_num_threads(threads)
        for i, (name, p) in enumerate(pairs):
            old = kept.get(name)
            if old is not None and all(
                    a.size == p.size and
                    a.dtype == backend.state_dtype(p.dtype)
                    for a in old.values()):
                self.compressor.states[i] = old
            else:
                with backend.device_scope(p.array):
                    self.compressor.states[i] = self.rule.init_state(
                        p.size, p.dtype, p.xp)
        self._names, self._dense = names, dense
        if self._loaded_state is not None:
            self._install_loaded_state([p for _, p in pairs])

    def dense_group(self, model):
        """Names of the initialized parameters exchanged densely (allreduce):
        see :func:`chainer_vgc.groups.dense_group`."""
        return groups.dense_group(model, self.rule, self.exclude,
                                  self.min_size, self._uncovered_dense)

    # -- the step -----------------------------------------------------------
    def set_loss_scale(self, loss_scale):
        """The loss scale S of the coming exchange (Chainer's
        ``optimizer.loss_scaling()``; None: none).  The gradients and sums
        of squares are unscaled (g / S, s / S**2) before the rule sees them,
        so residuals and thresholds are in gradient units whatever S does,
        and the mean is scaled back (x S) for Chainer to unscale."""
        self._loss_scale = loss_scale

    def multi_node_mean_grad(self, model, zero_fill=False):
        """ChainerMN's entry point: :meth:`exchange` with what
        :meth:`set_sqsums` and :meth:`set_loss_scale` gave for this step
        (for code that drives the backward pass itself; the optimizer
        wrapper calls :meth:`exchange` directly)."""
        sqsums, self._sqsums = self._sqsums, None
        loss_scale, self._loss_scale = self._loss_scale, None
        self.exchange(model, zero_fill, sqsums=sqsums, loss_scale=loss_scale)

    def exchange(self, model, zero_fill=False, sqsums=None,
                 loss_scale=None, uncovered=None):
        """One exchange: the compressed group through the allgatherv, then
        the dense group (and, during the warm-up, every parameter) through
        allreduce; ``param.grad`` becomes the mean over the ranks.

        ``sqsums``: this step's per-sample sums of squares, aligned with
        ``model_params(model)`` (needed when :attr:`needs_sqsum`);
        ``loss_scale``: the loss scale S of this step's gradients (None:
        none), see :meth:`set_loss_scale`; ``uncovered``: the names the
        statistics of this step did not cover (None: those of the last
        backward through :meth:`statistics`)."""
        self._note_uncovered(uncovered)
        self.setup(model)
        all_names, all_params = model_params(model)
        warm = self.warming_up
        compressed, dense = [], []
        for i, (n, p) in enumerate(zip(all_names, all_params)):
            if p.array is None:
                continue
            (dense if warm or n in self._dense else compressed).append(
                (i, p))
        self.skipped = False
        blocks, elements = [], None
        if compressed:
            self._ramp_alpha()
            params = [p for _, p in compressed]
            if sqsums is not None:  # aligned with all parameters
                sqsums = [sqsums[i] for i, _ in compressed]
            result = self._compressed_mean(params, sqsums, zero_fill,
                                           loss_scale)
            if result is None:  # skipped on every rank
                for _, p in dense:
                    p.grad = p.xp.full(p.shape, numpy.nan, dtype=p.dtype)
                return
            blocks, elements = result
        n_dense, dense_wire = self._dense_mean([p for _, p in dense],
                                               zero_fill)
        self.last = extensions.report_step(
            blocks, sum(p.size for _, p in compressed) +
            sum(p.size for _, p in dense), self.totals, elements,
            sum(p.size * p.dtype.itemsize for _, p in compressed + dense),
            size=self.size, dense_elements=n_dense * self.size,
            dense_wire=dense_wire,
            n_compressed=sum(p.size for _, p in compressed))

    def _compressed_mean(self, params, sqsums, zero_fill, loss_scale):
        """The compressed group's exchange; (blocks, elements per block), or
        None when a rank's gradients were not finite (skipped)."""
        comp = self.compressor
        if comp.rule.needs_sqsum and sqsums is None:
            raise RuntimeError(
                "method {!r} needs per-sample statistics of this step's "
                'backward pass: make the optimizer with '
                'chainer_vgc.create_multi_node_optimizer and pass the loss '
                'function to optimizer.update (StandardUpdater does), or run '
                'comm.statistics(model).backward(loss) and '
                'comm.set_sqsums(...) instead of loss.backward()'.format(
                    self.method))
        grads, sqsums = exchange.local_gradients(params, sqsums, zero_fill)
        self._has_grad = tuple(g is not None for g in grads)
        rule_grads, rule_sqsums = exchange.unscaled(grads, sqsums,
                                                    loss_scale)
        t0 = time.perf_counter()
        try:
            message = comp.compress(rule_grads, rule_sqsums, copy=False,
                                    agree=self._agree)
        except SkippedStep as e:
            self._skip(params, e)
            return None
        t1 = time.perf_counter()
        # the message is in host memory on every path (codec.pack): MPI
        # never sees a device pointer; the blocks stay on the host, where
        # the headers, checks and reports read them
        blocks, counts = transport.allgatherv(
            self.mpi_comm, message, method=self.allgatherv_method,
            chunk_words=self.chunk_words)
        t2 = time.perf_counter()
        # the mean, times the loss scale for Chainer to divide again
        elements = exchange.mean_gradients(blocks, comp, params, grads,
                                           self.size, zero_fill, False,
                                           rescale=loss_scale,
                                           present=self._present)
        t3 = time.perf_counter()
        #: seconds of the last exchange's phases on this rank
        self.last_timing = {'compress': t1 - t0, 'transport': t2 - t1,
                            'decode': t3 - t2}
        return blocks, elements

    def _ramp_alpha(self):
        """The rule's alpha on the ``alpha_ramp`` schedule."""
        if self.alpha_ramp is None:
            return
        alpha0, steps = self.alpha_ramp
        done = max(0.0, self.totals['steps'] - self.warmup)
        frac = min(1.0, done / steps) if steps else 1.0
        self.rule.alpha = alpha0 + (self.base_rule.alpha - alpha0) * frac

    def sync_run(self):
        """Rank 0's run totals to every rank: when only some ranks resumed
        from a snapshot (the optimizer then broadcasts the parameters), the
        warm-up and alpha ramp must count the same steps everywhere."""
        self.totals = self.mpi_comm.bcast(self.totals, root=0)

    def _note_uncovered(self, names=None):
        """With ``uncovered='dense'``: parameters the last backward could
        not cover (or ``names``) join the dense group (one warning listing
        them)."""
        if self.uncovered != 'dense':
            return
        if names is None:
            names = getattr(self._stats, 'uncovered_names', ())
        mine = sorted(set(names or ()) - self._uncovered_dense)
        # every rank's (a branch may run on some ranks only): the dense
        # group must be the same everywhere before any exchange
        new = set().union(*self.mpi_comm.allgather(mine))
        if not new:
            return
        # a new set: the main thread may be reading the old one
        self._uncovered_dense = self._uncovered_dense | new
        warnings.warn(
            "chainer_vgc: per-sample statistics do not cover {}; with "
            "uncovered='dense' they are sent uncompressed (dense "
            'allreduce)'.format(sorted(new)))

    def _dense_mean(self, params, zero_fill):
        """The dense group: ChainerMN's naive exchange (one allreduce per
        parameter, float16 summed in float32, non-finite values passed
        through, ValueError in debug mode), or with ``dense_dtype`` float16
        one allreduce of the whole group in float16.  Returns (elements per
        rank, bytes each rank sends with a ring allreduce)."""
        grads = []
        for param in params:  # model_params order: the same on every rank
            if zero_fill and param.grad is None:
                if param.data is None:
                    continue
                param.grad = param.xp.zeros_like(param.data)
            if param.grad is not None:
                grads.append(param)
        if not grads:
            return 0, 0.0
        p = self.size
        n = sum(q.size for q in grads)
        if self.dense_dtype is None:
            for q in grads:
                self._multi_node_mean(None, q.grad)
        else:
            allreduce_mean_float16(self.mpi_comm, grads)
        wire = extensions.allreduce_wire(
            grads, p, float16=self.dense_dtype is not None)
        return n, (wire if p > 1 else 0.0)

    def bcast_data(self, model):
        """Rank 0's parameters to every rank (ChainerMN's first update).

        Unless ``cuda_aware_mpi``, the parameters travel through one host
        buffer (their bytes, float16 included), so MPI never sees a device
        pointer; the result equals ChainerMN's ``bcast_data`` bit for bit.
        """
        if self.cuda_aware_mpi:
            return super(VGCCommunicator, self).bcast_data(model)
        params = [p for _, p in sorted(model.namedparams())
                  if p.array is not None]
        hosts = [numpy.ascontiguousarray(backend.to_numpy(p.array))
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
            return super(VGCCommunicator, self)._multi_node_mean(sendbuf,
                                                                 recvbuf)
        host = backend.to_numpy(recvbuf)
        src = None if sendbuf is None else backend.to_numpy(sendbuf)
        super(VGCCommunicator, self)._multi_node_mean(src, host)
        with recvbuf.device:  # a CuPy array: back onto its device
            recvbuf[...] = backend.get_array_module(recvbuf).asarray(host)

    def _agree(self, code):
        """Every rank's fault code (one small allgather), with which
        compressed parameters have a gradient on that rank: with
        ``zero_fill=False`` a parameter some rank has a gradient for gets
        the mean on every rank, even when nobody sent anything for it."""
        both = self.mpi_comm.allgather((int(code), self._has_grad))
        self._present = [any(bits) for bits in zip(*(b for _, b in both))]
        return [c for c, _ in both]

    def _skip(self, params, error):
        """A rank's gradients were not finite: nothing was exchanged and no
        residual changed.  The gradients become NaN, so that Chainer's
        dynamic loss scaling skips the update and lowers the scale (the
        optimizer wrapper skips it without); ``vgc/skipped`` is reported.
        In debug mode (``chainer.set_debug(True)``) a ValueError instead,
        as ChainerMN's communicators raise."""
        if chainer.is_debug():
            raise ValueError('Parameters diverged: {}'.format(error))
        for p in params:
            p.grad = p.xp.full(p.shape, numpy.nan, dtype=p.dtype)
        self.skipped = True
        self.totals['skipped'] += 1
        self.last = {'vgc/skipped': 1.0}
        chainer.reporter.report(self.last)

    # -- residual state: part of the run ------------------------------------
    def serialize_state(self, model, serializer):
        """Save or load this rank's residual state (r, v) for ``model``.

        Saving runs no collective (a snapshot taken on one rank only cannot
        hang): it writes what this rank holds, with a record of the method,
        hyperparameters, rank count and model.  Loading checks that record
        against this communicator and the model (a mismatch raises
        ValueError naming both, unless ``resume_other_method`` allows a
        different method: its residuals then start fresh) and may happen
        before the model's parameters are initialized (trainer snapshots
        load the optimizer before the model), so loaded arrays are kept and
        installed by :meth:`setup`.
        """
        if isinstance(serializer, chainer.serializer.Deserializer):
            return self._load_state(model, serializer)
        states = {}
        if self.compressor is not None:
            states = {n: st for n, st in zip(self.compressor.names,
                                             self.compressor.states) if st}
        elif self._loaded_state:  # loaded, not installed yet
            states = self._loaded_state
        serializer('meta', json.dumps(self._meta(model, sorted(states)),
                                      default=_plain))
        self._serialize_run(serializer)
        for name in sorted(states):
            for key in sorted(states[name]):
                serializer(_state_key(name, key), states[name][key])

    def _meta(self, model, state_names):
        return {'format': 2, 'method': self.method,
                'hyperparams': _record(self.base_rule.hyperparams()),
                'ranks': self.size, 'model': _model_record(model),
                'states': state_names}

    def _load_state(self, model, serializer):
        keys = sorted(self.rule.init_state(0, numpy.float32, numpy))
        try:
            text = str(serializer('meta', ''))
        except KeyError:  # a snapshot from before the record existed
            text = ''
        meta = json.loads(text) if text else None
        fresh = False
        if meta is not None:
            fresh = self._check_meta(meta, model)
        if not fresh:
            self._serialize_run(serializer, meta)
        loaded = {}
        if meta is None:
            names, _ = model_params(model)
        else:
            names = [] if fresh else meta['states']
        for name in names:
            for key in keys:
                try:  # absent: the parameter was not initialized then
                    arr = serializer(_state_key(name, key), None)
                except KeyError:
                    arr = None
                if arr is not None:
                    loaded.setdefault(name, {})[key] = arr
        if meta is None and keys and names and not loaded:
            raise ValueError(
                'the snapshot has no residual state for method {!r} '
                '(was it saved with another method?)'.format(self.method))
        self._loaded_state = loaded
        self.compressor = None  # installed by the next setup()

    def _check_meta(self, meta, model):
        """Compare a snapshot's record with this run; returns True when the
        method differs and ``resume_other_method`` allows it."""
        saved_params = meta['hyperparams']
        if meta.get('format', 1) == 1 and meta['method'] in RULES:
            # format 1 recorded the arguments given: the rule they make
            try:
                saved_params = _record(create_rule(
                    meta['method'], **dict(saved_params)).hyperparams())
            except ValueError:
                pass
        saved = (meta['method'], [tuple(kv) for kv in saved_params])
        here = (self.method, [tuple(kv) for kv in
                              _record(self.base_rule.hyperparams())])
        if meta['ranks'] != self.size:
            raise ValueError(
                'chainer_vgc: the snapshot was saved by a run of {} ranks; '
                'this run has {}. Resume with the same number of ranks'
                .format(meta['ranks'], self.size))
        ours = {n: (s, d) for n, s, d in _model_record(model)}
        if ours:  # loaded before the model's lazy params: setup() checks
            for n, s, d in meta['model']:
                if n in ours and ours[n] != (s, d):
                    raise ValueError(
                        'chainer_vgc: the snapshot was saved for a model whose '
                        'parameter {} has shape {} dtype {}; this model has '
                        'shape {} dtype {}'.format(n, s, d, *ours[n]))
        if saved != here:
            if saved[0] != here[0] and self.resume_other_method:
                warnings.warn(
                    'chainer_vgc: resuming a {!r} snapshot with method {!r}: '
                    'its residuals start fresh (resume_other_method=True)'
                    .format(saved[0], here[0]))
                return True
            raise ValueError(
                'chainer_vgc: the snapshot was saved with method {!r} {} but '
                'this run uses {!r} {}; resume with the same settings{}'
                .format(saved[0], dict(saved[1]), here[0], dict(here[1]),
                        '' if saved[0] == here[0] else
                        ' (or, to switch method and start the residuals '
                        'fresh, create_communicator(..., '
                        'resume_other_method=True))'))
        return False

    def _serialize_run(self, serializer, meta=None):
        """Run totals and the rule's own state (QSGD's generator).
        ``meta``: the record of a snapshot being loaded."""
        for key in sorted(self.totals):
            try:
                self.totals[key] = float(serializer('totals/' + key,
                                                    float(self.totals[key])))
            except KeyError:  # a snapshot from before this total existed
                if key == 'param_elements' and meta is not None:
                    # every step exchanged the recorded model
                    self.totals[key] = self.totals['steps'] * sum(
                        int(numpy.prod(shape)) for _, shape, _ in
                        meta['model'])
        extra = self.rule.get_extra_state()
        for key in sorted(extra):
            try:
                extra[key] = str(serializer('rule/' + key, extra[key]))
            except KeyError:  # a snapshot from before this state existed
                pass
        self.rule.set_extra_state(extra)

    def _install_loaded_state(self, params):
        loaded, self._loaded_state = self._loaded_state, None
        for i, (name, p) in enumerate(zip(self.compressor.names, params)):
            for key, arr in loaded.get(name, {}).items():
                state = self.compressor.states[i][key]
                if arr.size != state.size:
                    raise ValueError(
                        'residual state {!r} of parameter {!r} has {} '
                        'elements in the snapshot, the model has {}'.format(
                            key, name, arr.size, state.size))
                with backend.device_scope(state):
                    state[...] = p.xp.asarray(arr).reshape(
                        state.shape).astype(state.dtype)


def _record(params):
    """Hyperparameters as a sorted list of [name, value] pairs, as JSON
    gives them back (tuples become lists, NumPy values plain), so that a
    record compares equal to itself after a snapshot."""
    return json.loads(json.dumps(sorted([k, v] for k, v in params.items()),
                                 default=_plain))


def allreduce_mean_float16(mpi_comm, params):
    """The mean of the ``params``' gradients over the ranks, through one
    allreduce of all of them cast to float16 (summed in float16, pairwise
    in whatever order MPI chooses, each sum rounded once), then times 1/p
    in float32 and cast back: ChainerMN's ``allreduce_grad_dtype`` float16.
    Device gradients are staged through one host buffer."""
    from mpi4py import MPI
    sizes = [q.size for q in params]
    on_device = any(backend.get_array_module(q.grad) is not numpy
                    for q in params)
    buf = backend.host_buffer(sum(sizes), numpy.float16, pinned=on_device)
    pos = 0
    for q, n in zip(params, sizes):
        buf[pos:pos + n] = backend.to_numpy(q.grad).reshape(-1)
        pos += n
    mpi_comm.Allreduce(MPI.IN_PLACE, [buf.view(numpy.uint16),
                                      MPI.UINT16_T], op=_float16_sum())
    mean = buf.astype(numpy.float32) * numpy.float32(1.0 / mpi_comm.size)
    pos = 0
    for q, n in zip(params, sizes):
        part = mean[pos:pos + n].reshape(q.shape).astype(q.dtype)
        pos += n
        with backend.device_scope(q.grad):
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


def _model_record(model):
    """[name, shape, dtype] of each initialized parameter (JSON-ready)."""
    names, params = _initialized(model)
    return [[n, list(p.shape), str(p.dtype)] for n, p in zip(names, params)]


def _plain(value):
    """JSON for NumPy values among the hyperparameters (anything else that
    JSON cannot hold: its repr)."""
    if isinstance(value, (numpy.generic, numpy.ndarray)):
        return value.tolist()
    return repr(value)


def _state_key(name, key):
    return name.lstrip('/') + '/' + key


def _initialized(model):
    """(names, params) of the initialized parameters, sorted by name.

    As ChainerMN's communicators do, a lazily initialized parameter that has
    not been initialized yet (no forward pass reached it) is left out."""
    names, params = model_params(model)
    pairs = [(n, p) for n, p in zip(names, params) if p.array is not None]
    return [n for n, _ in pairs], [p for _, p in pairs]


def _first_difference(a, b):
    labels = ('method', 'allgatherv, chunk_words and CPU backend')
    for label, x, y in zip(labels, a[:2], b[:2]):
        if x != y:
            return label, x, y
    pa, pb = a[2], b[2]
    for x, y in zip(pa, pb):
        if x != y:
            return 'a parameter', x, y
    if len(pa) != len(pb):
        return 'the number of parameters', len(pa), len(pb)
    return ('the dense group, warmup, alpha_ramp, dense_dtype and '
            'uncovered', a[3], b[3])


def create_communicator(method='vgc', mpi_comm=None, allgatherv='ring',
                        abort_on_exception=True, exclude=None, min_size=0,
                        uncovered='error', warmup=0, alpha_ramp=None,
                        dense_dtype=None, **kwargs):
    """A :class:`VGCCommunicator` on ``mpi_comm`` (default COMM_WORLD).

    ``method``: a rule name or a
    :class:`~chainer_vgc.rules.CompressionRule` object.  The controls (see
    :class:`VGCCommunicator` for the details):

    - ``exclude``: parameter names and/or predicates ``f(name, param)``
      sent uncompressed (dense allreduce); ``min_size``: parameters of
      fewer elements too;
    - ``uncovered``: ``'error'``, ``'bruteforce'`` or ``'dense'`` for the
      parameters the per-sample statistics cannot cover;
    - ``warmup``: dense exchanges before compression starts;
      ``alpha_ramp=(alpha0, steps)``: alpha from alpha0 to its value;
    - ``dense_dtype``: None or ``'float16'`` for the dense group.

    The rule's hyperparameters (``alpha``, ``tau``, ...) are further keyword
    arguments.  ``abort_on_exception`` installs ChainerMN's global except
    hook, so an uncaught exception on one rank aborts the whole job instead
    of leaving the others waiting in a collective.
    """
    if mpi_comm is None:
        from mpi4py import MPI
        mpi_comm = MPI.COMM_WORLD
    if abort_on_exception:
        import sys
        from chainermn import global_except_hook
        if sys.excepthook is not global_except_hook._global_except_hook:
            global_except_hook.add_hook()
    return VGCCommunicator(mpi_comm, method=method, allgatherv=allgatherv,
                           exclude=exclude, min_size=min_size,
                           uncovered=uncovered, warmup=warmup,
                           alpha_ramp=alpha_ramp, dense_dtype=dense_dtype,
                           **kwargs)
