"""ChainerMN glue: a communicator that averages compressed gradients.

``multi_node_mean_grad`` runs the data flow of one step on every rank:
gradients (+ per-sample statistics) -> rule -> codec -> one uint32 message
-> allgatherv (paper Sec. 4.3: each worker sends its elements to every other
worker, nothing is re-compressed) -> decode every rank's message -> sum
(indices may overlap) -> multiply by 1/size (as ChainerMN's naive
communicator does) -> ``param.grad``.

The per-sample statistics come from the user's ordinary backward pass when
the optimizer is wrapped by :func:`create_multi_node_optimizer`.
"""

import json
import numbers
import time
import warnings

import chainer
from chainermn.communicators import mpi_communicator_base
import numpy

from chainer_vgc import backend
from chainer_vgc import codec
from chainer_vgc import kernels
from chainer_vgc import native
from chainer_vgc import transport
from chainer_vgc.compressor import GradientCompressor
from chainer_vgc.compressor import SkippedStep
from chainer_vgc.rules import CompressionRule
from chainer_vgc.rules import RULES
from chainer_vgc.rules import create_rule
from chainer_vgc.statistics import DEFAULT_MAX_MEMORY
from chainer_vgc.statistics import PerSampleSquares
from chainer_vgc.statistics import model_params


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

    def __init__(self, mpi_comm, method='vgc', allgatherv='ring',
                 chunk_words=transport.DEFAULT_CHUNK_WORDS,
                 max_memory=DEFAULT_MAX_MEMORY, uncovered='error',
                 resume_other_method=False, cuda_aware_mpi=False,
                 exclude=None, min_size=0, warmup=0, alpha_ramp=None,
                 dense_dtype=None, **hyperparams):
        super(VGCCommunicator, self).__init__(mpi_comm)
        self.resume_other_method = bool(resume_other_method)
        self.cuda_aware_mpi = bool(cuda_aware_mpi)
        if allgatherv not in transport.ALLGATHERV:
            raise ValueError("allgatherv must be 'ring' or 'mpi', got {!r}"
                             .format(allgatherv))
        if int(chunk_words) < 1:
            raise ValueError('chunk_words must be >= 1, got {!r}'.format(
                chunk_words))
        if uncovered not in ('error', 'bruteforce', 'dense'):
            raise ValueError("uncovered must be 'error', 'bruteforce' or "
                             "'dense', got {!r}".format(uncovered))
        self.base_rule = _make_rule(method, hyperparams)
        self.method = self.base_rule.name
        self.hyperparams = dict(hyperparams)
        self._method_arg = method
        #: this rank's rule (QSGD: its own random stream)
        self.rule = self.base_rule.for_rank(self.rank)
        self.exclude = _check_exclude(exclude)
        self.min_size = _check_count('min_size', min_size)
        self.warmup = _check_count('warmup', warmup)
        self.alpha_ramp = _check_ramp(alpha_ramp, self.base_rule)
        self.dense_dtype = _check_dense_dtype(dense_dtype)
        self.allgatherv_method = allgatherv
        self.chunk_words = int(chunk_words)
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
        self.totals = new_totals()
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
        everything_dense = (self._names is not None
                            and len(self._dense) == len(self._names))
        return (self.rule.needs_sqsum and self.rule.exchange != 'allreduce'
                and not self.warming_up and not everything_dense)

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
        see :func:`dense_group`."""
        return dense_group(model, self.rule, self.exclude, self.min_size,
                           self._uncovered_dense)

    # -- the step -----------------------------------------------------------
    def set_loss_scale(self, loss_scale):
        """The loss scale S of the coming exchange (Chainer's
        ``optimizer.loss_scaling()``; None: none).  The gradients and sums
        of squares are unscaled (g / S, s / S**2) before the rule sees them,
        so residuals and thresholds are in gradient units whatever S does,
        and the mean is scaled back (x S) for Chainer to unscale."""
        self._loss_scale = loss_scale

    def multi_node_mean_grad(self, model, zero_fill=False):
        """One exchange: the compressed group through the allgatherv, then
        the dense group (and, during the warm-up, every parameter) through
        allreduce; ``param.grad`` becomes the mean over the ranks."""
        self._note_uncovered()
        self.setup(model)
        loss_scale, self._loss_scale = self._loss_scale, None
        sqsums, self._sqsums = self._sqsums, None
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
        self.last = report_step(
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
        grads, sqsums = local_gradients(params, sqsums, zero_fill)
        rule_grads, rule_sqsums = _unscaled(grads, sqsums, loss_scale)
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
            **({'chunk_words': self.chunk_words}
               if self.allgatherv_method == 'ring' else {}))
        t2 = time.perf_counter()
        # the mean, times the loss scale for Chainer to divide again
        elements = mean_gradients(blocks, comp, params, grads, self.size,
                                  zero_fill, False, rescale=loss_scale)
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

    def _note_uncovered(self):
        """With ``uncovered='dense'``: parameters the last backward could
        not cover join the dense group (one warning listing them)."""
        if self.uncovered != 'dense':
            return
        stats = self._stats
        mine = sorted(set(getattr(stats, 'uncovered_names', ()) or ()) -
                      self._uncovered_dense)
        # every rank's (a branch may run on some ranks only): the dense
        # group must be the same everywhere before any exchange
        new = set().union(*self.mpi_comm.allgather(mine))
        if not new:
            return
        self._uncovered_dense |= new
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
            wire = sum(2 * (p - 1) * max(4, q.dtype.itemsize) * q.size / p
                       for q in grads)
        else:
            allreduce_mean_float16(self.mpi_comm, grads)
            wire = 2 * (p - 1) * 2 * n / p
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
        """Every rank's fault code (one small allgather)."""
        return self.mpi_comm.allgather(int(code))

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


def dense_group(model, rule, exclude=(), min_size=0, also=()):
    """Names of ``model``'s initialized parameters exchanged densely: all
    of them for a rule whose ``exchange`` is ``'allreduce'`` (``none``),
    else those named in ``exclude`` or selected by its predicates
    ``f(name, param)``, those of fewer than ``min_size`` elements, and the
    names in ``also``.  An unknown name in ``exclude`` raises ValueError."""
    all_names, all_params = model_params(model)
    if rule.exchange == 'allreduce':
        return {n for n, p in zip(all_names, all_params)
                if p.array is not None}
    known = set(all_names)
    unknown = sorted(n for n in exclude if isinstance(n, str)
                     and n not in known)
    if unknown:
        raise ValueError(
            'exclude: the model has no parameter named {}; its parameters '
            'are {}'.format(unknown, sorted(known)))
    tests = [f for f in exclude if callable(f)]
    names = {n for n in exclude if isinstance(n, str)} | set(also)
    return {n for n, p in zip(all_names, all_params)
            if p.array is not None and (
                n in names or p.size < min_size or
                any(f(n, p) for f in tests))}


def _make_rule(method, hyperparams):
    """The rule a communicator runs: made from a name, or a rule object
    checked for what the communicator calls."""
    if isinstance(method, str):
        return create_rule(method, **hyperparams)
    if hyperparams:
        raise ValueError('method: hyperparameters {} given with a rule '
                         'object; set them on the rule'.format(
                             sorted(hyperparams)))
    if not isinstance(method, CompressionRule):
        raise TypeError(
            'method must be a rule name ({}) or a '
            'chainer_vgc.rules.CompressionRule object, got {!r}'.format(
                ', '.join(sorted(RULES)), method))
    missing = [m for m in ('compress', 'max_words')
               if getattr(type(method), m) is getattr(CompressionRule, m)
               and not (m == 'max_words' and
                        method.compress_native is None)]
    if not isinstance(method.name, str) or not method.name:
        missing.insert(0, 'name (a string)')
    if method.exchange not in ('allgatherv', 'allreduce'):
        missing.append("exchange ('allgatherv' or 'allreduce')")
    if missing:
        raise TypeError('method: the rule object {!r} does not define {}; '
                        'see chainer_vgc.rules.CompressionRule'.format(
                            method, ', '.join(missing)))
    return method


def _check_exclude(exclude):
    """``exclude`` as a tuple of names and predicates."""
    if exclude is None:
        return ()
    if isinstance(exclude, str) or callable(exclude):
        exclude = [exclude]
    try:
        items = tuple(exclude)
    except TypeError:
        raise TypeError('exclude must be parameter names and/or predicates '
                        'f(name, param) -> bool, got {!r}'.format(exclude))
    for item in items:
        if not (isinstance(item, str) or callable(item)):
            raise TypeError('exclude: {!r} is neither a parameter name nor a '
                            'predicate f(name, param) -> bool'.format(item))
    return items


def _check_count(name, value):
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
            or value < 0):
        raise ValueError('{} must be an integer >= 0, got {!r}'.format(
            name, value))
    return int(value)


def _check_ramp(ramp, rule):
    if ramp is None:
        return None
    try:
        alpha0, steps = ramp
        alpha0 = float(alpha0)
    except (TypeError, ValueError):
        raise ValueError('alpha_ramp must be (alpha0, steps), got {!r}'
                         .format(ramp))
    if not hasattr(rule, 'alpha'):
        raise ValueError('alpha_ramp: method {!r} has no alpha'.format(
            rule.name))
    if not alpha0 > 0:
        raise ValueError('alpha_ramp: alpha0 must be > 0, got {!r}'.format(
            alpha0))
    return (alpha0, _check_count('alpha_ramp steps', steps))


def _check_dense_dtype(dtype):
    if dtype is None:
        return None
    try:
        dt = numpy.dtype(dtype)
    except TypeError:
        dt = None
    if dt != numpy.float16:
        raise ValueError("dense_dtype must be None (the parameters' own "
                         "dtypes) or 'float16', got {!r}".format(dtype))
    return dt


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


def _unscaled(grads, sqsums, loss_scale):
    """g / S and s / S**2 in the state dtypes (unchanged without S)."""
    if loss_scale in (None, 1):
        return grads, sqsums
    scale = float(loss_scale)

    def div(a, by):
        if a is None:
            return None
        sdt = backend.state_dtype(a.dtype)
        with backend.device_scope(a):  # (the subnormal rule on a GPU)
            return kernels.divide(kernels.cast(a, sdt), by)
    grads = [div(g, scale) for g in grads]
    if sqsums is not None:
        sqsums = [div(s, scale * scale) for s in sqsums]
    return grads, sqsums


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
            with backend.device_scope(p.array):
                return p.xp.zeros_like(p.array)
        if sqsums is not None:
            sqsums = [zeros(p) if g is None else s
                      for p, g, s in zip(params, grads, sqsums)]
        grads = [zeros(p) if g is None else g
                 for p, g in zip(params, grads)]
    return grads, sqsums


def sum_messages(blocks, compressor, params, dense):
    """Decode every worker's message and add them up, in rank order.

    ``dense`` (method 'none'): a rank-order pairwise tree, the order of
    MPI's recursive doubling, so that 2^k ranks reproduce a dense allreduce
    bit for bit (two ranks: any order does).
    """
    xp = backend.get_array_module(blocks[0]) if blocks else numpy
    dtypes = [backend.state_dtype(p.dtype) for p in params]

    def zeros():
        return [xp.zeros(p.shape, dtype=d) for p, d in zip(params, dtypes)]
    if dense:
        per_rank = []
        for block in blocks:
            outs = zeros()
            codec.decode_into(block, outs, compressor.sizes)
            per_rank.append(outs)
        return _tree_sum(per_rank)
    outs = zeros()
    for block in blocks:
        codec.decode_into(block, outs, compressor.sizes)
    return outs


def mean_gradients(blocks, compressor, params, grads, size, zero_fill,
                   dense, rescale=None):
    """``param.grad`` = (sum of every worker's elements) * (1 / size).

    On the native backend one call validates the messages and writes the
    sums, in rank order, straight into the gradient arrays with the mean
    applied (float16 parameters through a float32 buffer); elsewhere, and
    for the rank-order tree of ``dense`` ('none'), the reference
    :func:`sum_messages` + :func:`write_mean`, which it equals bit for bit.
    ``rescale``: the loss scale to multiply back (:func:`_finish_mean`).
    Returns the number of elements each message carries.
    """
    if _on_device(params):
        return _device_mean(blocks, compressor, params, grads, size,
                            zero_fill, dense, rescale)
    if dense or not _native_decode_applies(blocks, compressor):
        write_mean(params, grads,
                   sum_messages(blocks, compressor, params, dense), size,
                   zero_fill, rescale)
        return [codec.message_count(b) for b in blocks]
    scale = 1.0 / size
    sdts = [backend.state_dtype(p.dtype) for p in params]
    outs, direct = [], []
    for i, (p, g, sdt) in enumerate(zip(params, grads, sdts)):
        grad = p.grad
        ok = (grad is not None and g is not None and grad.dtype == sdt
              and grad.dtype == p.dtype and grad.flags.c_contiguous
              and grad.size == compressor.sizes[i])
        outs.append(grad.reshape(-1) if ok else compressor.decode_buffer(i))
        direct.append(ok)
    result = native.decode_mean(blocks, compressor.sizes, sdts, outs, direct,
                                scale)
    if result is None:  # name the fault as the reference decoder does
        dtypes = [p.dtype for p in params]
        for block in blocks:
            codec.unpack(block, compressor.sizes, dtypes)
        raise RuntimeError('chainer_vgc: the native decoder rejected a '
                           'message the reference decoder accepts; please '
                           'report this with CHAINER_VGC_BACKEND=numpy as '
                           'the workaround')
    touched, elements = result
    for p, g, out, ok, n in zip(params, grads, outs, direct, touched):
        if ok:
            if rescale not in (None, 1):
                p.grad *= p.grad.dtype.type(rescale)
            continue
        if g is None and not zero_fill and not (n and out.any()):
            continue  # nothing (or a zero sum) for a gradient-less param
        p.grad = _finish_mean(out.reshape(p.shape).copy(), p.dtype, size,
                              rescale)
    return [int(e) for e in elements]


def _on_device(params):
    return any(backend.get_array_module(p.array) is not numpy
               for p in params if p.array is not None)


def validate_messages(blocks, compressor, dtypes):
    """Check every host message against the model, as :func:`codec.unpack`
    does (the native decoder's walk where it applies: same checks, no
    output); returns the elements each carries.  A fault raises
    :class:`~chainer_vgc.codec.WireFormatError` as the reference names
    it."""
    sizes = compressor.sizes
    sdts = [backend.state_dtype(d) for d in dtypes]
    if _native_decode_applies(blocks, compressor):
        result = native.decode_mean(blocks, sizes, sdts, [None] * len(sizes),
                                    [0] * len(sizes), 1.0)
        if result is not None:
            return [int(e) for e in result[1]]
    counts = []
    for block in blocks:
        counts.append(sum(int(d.index.size)
                          for d in codec.unpack(block, sizes, dtypes)))
    if _native_decode_applies(blocks, compressor):
        raise RuntimeError('chainer_vgc: the native decoder rejected a '
                           'message the reference decoder accepts; please '
                           'report this with CHAINER_VGC_BACKEND=numpy as '
                           'the workaround')
    return counts


def upload_blocks(blocks, xp, like):
    """Every rank's message on ``like``'s device with one host-to-device
    copy (through one pinned buffer); returns a device view per block."""
    sizes = [int(b.size) for b in blocks]
    staged = backend.host_buffer(sum(sizes), numpy.uint32)
    pos = 0
    for b, n in zip(blocks, sizes):
        staged[pos:pos + n] = b
        pos += n
    with backend.device_scope(like):
        device = xp.asarray(staged)
    views, pos = [], 0
    for n in sizes:
        views.append(device[pos:pos + n])
        pos += n
    return views


def _device_mean(blocks, compressor, params, grads, size, zero_fill, dense,
                 rescale):
    """:func:`mean_gradients` for parameters on a GPU.  The messages are
    validated on the host (where MPI left them), uploaded once, decoded and
    summed on the device (in rank order; ``dense``: in the rank-order tree
    of :func:`sum_messages`) without reading a value back, then
    :func:`write_mean`: the reference's sums bit for bit.  (Parameters on
    several devices: the blocks are uploaded to the first one's device and
    read from there.)"""
    dtypes = [p.dtype for p in params]
    elements = validate_messages(blocks, compressor, dtypes)
    arrays = [p.array for p in params if p.array is not None]
    xp = backend.get_array_module(*arrays)
    first = next(a for a in arrays if backend.get_array_module(a) is xp)

    def zeros():
        out = []
        for p, n in zip(params, compressor.sizes):
            with backend.device_scope(p.array):
                out.append(xp.zeros(n, dtype=backend.state_dtype(p.dtype)))
        return out
    device = upload_blocks(blocks, xp, first)
    with backend.device_scope(first):
        if dense:
            per_rank = []
            for host, dev in zip(blocks, device):
                per_rank.append(zeros())
                codec.add_validated(host, dev, per_rank[-1],
                                    compressor.sizes)
            sums = _tree_sum(per_rank)
        else:
            sums = zeros()
            for host, dev in zip(blocks, device):
                codec.add_validated(host, dev, sums, compressor.sizes)
    write_mean(params, grads, [s.reshape(p.shape) for s, p in
                               zip(sums, params)], size, zero_fill, rescale)
    return elements


def _tree_sum(per_rank):
    """Pairwise sums of per-rank lists of arrays in rank order (MPI's
    recursive doubling), added with :func:`chainer_vgc.kernels.add_into`."""
    while len(per_rank) > 1:
        nxt = [[kernels.add_into(a.copy(), b)
                for a, b in zip(per_rank[k], per_rank[k + 1])]
               for k in range(0, len(per_rank) - 1, 2)]
        if len(per_rank) % 2:
            nxt.append(per_rank[-1])
        per_rank = nxt
    return per_rank[0]


def _native_decode_applies(blocks, compressor):
    return (compressor.backend == 'native'
            and all(isinstance(b, numpy.ndarray) for b in blocks)
            and all(d in native.DTYPE_CODES for d in compressor.dtypes))


def write_mean(params, grads, sums, size, zero_fill, rescale=None):
    """param.grad = sum * (1 / size) in the parameter dtype (as ChainerMN);
    ``rescale`` (the loss scale): times it, in the sum's dtype before the
    cast to a float16 parameter's dtype (see :func:`_finish_mean`)."""
    for p, g, total in zip(params, grads, sums):
        if g is None and not zero_fill and not bool((total != 0).any()):
            continue  # nobody sent anything for a gradient-less param
        with backend.device_scope(p.array):
            p.grad = _finish_mean(total, p.dtype, size, rescale)


def _finish_mean(total, dtype, size, rescale):
    """The mean in ``dtype`` of a sum (ours to reuse): the sum cast to
    ``dtype`` times 1/size (as ChainerMN); with a loss scale S, the sum
    times 1/size times S in its own (state) dtype, then the cast, so that a
    float16 gradient is neither rounded unscaled nor multiplied by an S
    that float16 cannot hold."""
    dtype = numpy.dtype(dtype)
    if backend.get_array_module(total) is not numpy:
        return _device_finish_mean(total, dtype, size, rescale)
    if rescale in (None, 1):
        mean = total.astype(dtype, copy=False)
        mean *= 1.0 / size
        return mean
    total *= total.dtype.type(1.0 / size)
    total *= total.dtype.type(rescale)
    return total.astype(dtype, copy=False)


def _device_finish_mean(total, dtype, size, rescale):
    """:func:`_finish_mean` with the subnormal rule's kernels, the same
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


def step_figures(blocks, n_params, elements=None, param_bytes=None,
                 size=None, dense_elements=0, dense_wire=0.0,
                 n_compressed=None):
    """Figures of one exchange, the same on every rank.

    ``vgc/compression``: parameters / average elements sent per rank (the
    paper's definition), over all parameters (a dense group's elements
    count as sent); ``vgc/density``: its inverse; ``vgc/bytes``: bytes each
    rank sends on the wire, on average: (p - 1) / p of all messages with the
    ring, plus ``dense_wire`` for the dense group's allreduce;
    ``vgc/skipped``: 0 (an exchange took place; a skipped step reports 1).
    With a dense group (``n_compressed`` < ``n_params``), also
    ``vgc/dense_fraction`` (of the parameters) and, when some parameters
    are compressed, ``vgc/compression_compressed`` (that group alone).  Keys with '_' feed the run
    totals, with ``dense_bytes`` what a dense ring allreduce of the
    gradients in their own dtypes would send per rank, 2 (p - 1) / p *
    ``param_bytes`` (Sec. 5; ``param_bytes`` = sum of size * itemsize,
    default 4 N).  ``dense_elements``: elements of the dense group over
    all ranks; ``size``: the number of ranks (default: len(blocks)).
    """
    if param_bytes is None:
        param_bytes = 4 * n_params
    p = size or len(blocks)
    if elements is None:
        elements = [codec.message_count(b) for b in blocks]
    sent = sum(elements)
    total_bytes = 4 * sum(int(b.size) for b in blocks)
    per_rank = (sent + dense_elements) / p
    wire = (p - 1) * total_bytes / p + dense_wire
    figures = {
        'vgc/compression': n_params / per_rank if per_rank else float('inf'),
        'vgc/density': per_rank / n_params if n_params else 0.0,
        'vgc/bytes': wire,
        'vgc/skipped': 0.0,  # an exchange took place
        '_elements': sent + dense_elements,
        '_bytes': wire,
        '_dense_bytes': 2 * (p - 1) * param_bytes / p,
    }
    if n_compressed is not None and n_compressed < n_params:
        figures['vgc/dense_fraction'] = (n_params - n_compressed) / n_params
        if n_compressed:  # (none during a warm-up)
            figures['vgc/compression_compressed'] = (
                n_compressed * p / sent if sent else float('inf'))
    return figures


def new_totals():
    """Run totals: steps, elements (all ranks), bytes and dense_bytes (per
    rank), skipped exchanges, param_elements (parameters x steps)."""
    return {'steps': 0.0, 'elements': 0.0, 'bytes': 0.0, 'dense_bytes': 0.0,
            'skipped': 0.0, 'param_elements': 0.0}


def report_step(blocks, n_params, totals, elements=None, param_bytes=None,
                **dense):
    """Add one exchange to ``totals``, report its figures with
    ``chainer.reporter`` and return them (``elements``: per message, when
    already counted; ``param_bytes`` and ``dense``: see
    :func:`step_figures`)."""
    figures = step_figures(blocks, n_params, elements, param_bytes, **dense)
    for key, value in figures.items():
        if key.startswith('_'):
            totals[key[1:]] += value
    totals['steps'] += 1
    totals['param_elements'] += n_params
    chainer.reporter.report({k: v for k, v in figures.items()
                             if not k.startswith('_')})
    return figures


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
