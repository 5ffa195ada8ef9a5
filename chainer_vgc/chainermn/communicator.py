"""The ChainerMN communicator: a drop-in that exchanges compressed gradients.

The question this module answers: what does a ChainerMN job hold to run
compressed data parallelism, and where does each part live?  A
:class:`VGCCommunicator` is ChainerMN's communicator interface over three
rooms:

- the bytes: it *is* a :class:`~chainer_vgc.chainermn.collectives.Collectives` (the
  allgatherv of the messages, the dense allreduce, ``bcast_data``);
- the method: one :class:`~chainer_vgc.exchange.state.MethodState` per model
  (rule, residuals, dense group, warm-up, ramp, totals), made from this
  communicator's settings the first time the model is exchanged, saved by
  :mod:`chainer_vgc.exchange.snapshot`;
- the step: :func:`chainer_vgc.exchange.run.exchange_async` (now, or on a
  background thread for double buffering) returns a handle whose
  ``wait()`` gives the result.

``multi_node_mean_grad`` (ChainerMN's entry point) and
:meth:`VGCCommunicator.exchange` run one step synchronously.  What a run
reads (``totals``, ``last``, ``skipped``, ``compressor``, ...) is a
model's state: ``comm.state(model)``, or ``comm.state()`` for that of the
model exchanged last.
"""

import gc
import weakref

from chainer_vgc.exchange import snapshot
from chainer_vgc.exchange import run as exchange_run
from chainer_vgc.chainermn import transport
from chainer_vgc.chainermn.collectives import Collectives
from chainer_vgc.exchange.state import MethodState
from chainer_vgc.statistics import DEFAULT_MAX_MEMORY


#: a model's state's attributes that the communicator itself once
#: forwarded (those of the model exchanged last): reading or setting one on
#: the communicator is an error that names ``comm.state()``
STATE_ATTRIBUTES = frozenset([
    'totals', 'last', 'skipped', 'last_timing', 'compressor', 'rule',
    'base_rule', 'method', 'hyperparams', 'exclude', 'min_size', 'warmup',
    'alpha_ramp', 'dense_dtype', 'uncovered', 'max_memory',
    'count_by_parameter', 'elements_by_parameter', 'parameter_sizes',
    'spare_residuals', 'examples', 'resume_other_method',
    'resume_residuals', 'needs_sqsum', 'warming_up', 'compressed_elements',
    'workers'])


def _in_the_state(name):
    return ('chainer_vgc: {0!r} is a model\'s exchange state, not the '
            "communicator's: use comm.state(model).{0} (comm.state().{0}: "
            'the model exchanged last)'.format(name))


class VGCCommunicator(Collectives):
    """ChainerMN communicator exchanging compressed gradients.

    Args:
        mpi_comm: an mpi4py communicator.
        method: a rule name (``'vgc'``, ``'hybrid'``, ``'strom'``,
            ``'qsgd'``, ``'none'``) or a
            :class:`~chainer_vgc.rules.CompressionRule` object (a rule of
            your own: see docs/methods.md).
        allgatherv: ``'ring'`` (pipelined ring on point-to-point calls) or
            ``'mpi'`` (``MPI_Allgatherv``).
        chunk_words: pipelining chunk of the ring, in 32-bit words.
        max_memory: passed to
            :class:`~chainer_vgc.statistics.PerSampleSquares`.
        spare_residuals: False (default): the native backend checks every
            input (and the ranks agree on it) before any state moves, then
            updates the residuals in place; an overflow found during the
            passes is raised on every rank and leaves the residuals
            part-updated (the communicator refuses further steps: resume
            a snapshot).  True: a second set of residuals takes each
            step's result and is swapped in only when no rank faulted
            (every state untouched by any fault), at 2 x 4 bytes more per
            float32 parameter (docs/benchmarks.md, "Memory").
        examples: None, or a function of ``update()``'s arguments
            returning the minibatch's examples, one array or tuple of
            arrays each, for a minibatch whose arrays are not all batches
            of examples on their first axis nor lists of one array per
            example (:func:`chainer_vgc.sentence_pairs` for ChainerMN's
            seq2seq converter; :mod:`~chainer_vgc.statistics.rows`).
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
        resume_residuals: a snapshot of another rank or world size:
            ``'own'`` (default) refuses it, naming the per-rank pattern
            (a snapshot saved on rank 0 only would give every rank rank
            0's residuals); ``'fresh'`` loads it with the residuals
            started empty (a warning);
            ``chainer_vgc.ElasticResume([every saved rank's file])``
            merges what the saved ranks held, for a resume at another
            world size (:mod:`chainer_vgc.exchange.elastic`).
        cuda_aware_mpi: declare that MPI accepts device pointers; by
            default (False) every collective on GPU arrays goes through
            host memory (the compressed exchange always does).
        dense_fallback: None (off), or a step predicted faster dense (Sec.
            5, from this step's counts) is sent dense, as a warm-up step:
            True (the link measured at the first exchange), a bandwidth
            (``'1Gbit'``), or :class:`~chainer_vgc.exchange.fallback.DenseFallback`
            arguments (a dict) or object; see :mod:`chainer_vgc.exchange.fallback`.
        **hyperparams: the rule's (``alpha``, ``zeta``, ``tau``, ``bits``,
            ``bucket``, ``seed``, ``quantize``, ...), with a method name.

    The compressed group goes through the allgatherv (ring by default); the
    dense group through MPI allreduce, after it.  Every argument is checked
    on every rank before any exchange.

    A model's state (its rule, residuals, dense group, totals, figures)
    is ``comm.state(model)``: one per model, so that two models (a GAN's
    generator and discriminator) share a communicator.
    ``comm.state()`` is that of the model exchanged last (before any, the
    one made on construction), for one-model scripts written as for
    ChainerMN: ``comm.state().totals``, ``comm.state().compressor``.
    """

    #: the method state's class, and the exchange's function (see
    #: :func:`chainer_vgc.exchange.run.exchange_async`'s ``run``): the
    #: hierarchical communicator has its own
    _State = MethodState
    _run = None

    def __getattr__(self, name):
        # (only for a name the class and the instance do not hold)
        if name in STATE_ATTRIBUTES:
            raise AttributeError(_in_the_state(name))
        raise AttributeError('{!r} object has no attribute {!r}'.format(
            type(self).__name__, name))

    def __setattr__(self, name, value):
        if name in STATE_ATTRIBUTES:  # it would be read by nothing
            raise AttributeError(_in_the_state(name))
        super(VGCCommunicator, self).__setattr__(name, value)

    def __init__(self, mpi_comm, method='vgc', allgatherv='ring',
                 chunk_words=transport.DEFAULT_CHUNK_WORDS,
                 max_memory=DEFAULT_MAX_MEMORY, uncovered='error',
                 examples=None, spare_residuals=False,
                 resume_other_method=False, cuda_aware_mpi=False,
                 exclude=None, min_size=0, warmup=0, alpha_ramp=None,
                 dense_dtype=None, dense_fallback=None,
                 resume_residuals='own', **hyperparams):
        super(VGCCommunicator, self).__init__(mpi_comm, allgatherv,
                                              chunk_words, cuda_aware_mpi)
        # checked here, on construction
        self._current = self._State(
            method, rank=self.rank, exclude=exclude, min_size=min_size,
            warmup=warmup, alpha_ramp=alpha_ramp, dense_dtype=dense_dtype,
            uncovered=uncovered, max_memory=max_memory, examples=examples,
            spare_residuals=spare_residuals,
            resume_other_method=resume_other_method,
            dense_fallback=dense_fallback,
            resume_residuals=resume_residuals, **hyperparams)
        self._unbound = self._current  # the first model's
        self._states = weakref.WeakKeyDictionary()
        self._met = 0  # models met so far (a state's index)
        self._hooks = weakref.WeakKeyDictionary()
        self._background = None
        self._in_flight = []  # background exchanges not known to be done
        self._sqsums = None
        self._loss_scale = None

    def split(self, color, key):
        return self.__class__(
            mpi_comm=self.mpi_comm.Split(color, key),
            allgatherv=self.allgatherv_method, chunk_words=self.chunk_words,
            cuda_aware_mpi=self.cuda_aware_mpi, **self._current.settings())

    # -- the method's state, one per model ------------------------------------
    def state(self, model=None):
        """The :class:`~chainer_vgc.exchange.state.MethodState` of ``model``
        (made from this communicator's settings at the first call; the
        first model gets the one made, and checked, on construction).
        While two or more models are alive on this communicator, each
        reports under its own name: the trainer's, else its
        :attr:`MethodState.label
        <chainer_vgc.exchange.state.MethodState.label>`; a model that comes
        after the last one was dropped (a sweep) reports ``vgc/...``.

        ``model`` None: the state of the model set up, exchanged (from
        the start of its exchange) or saved or loaded
        (:meth:`serialize_state`) last; before any, the one made on
        construction (the first model's)."""
        if model is None:
            return self._current
        st = self._states.get(model)
        if st is None:
            st, self._unbound = self._unbound, None
            if st is None:
                st = self._State(rank=self.rank,
                                 **self._current.settings())
            if len(self._states):
                # a model dropped but kept in a reference cycle (Chainer's
                # optimizers hold one) is not alive: a sweep of one model
                # at a time keeps reporting vgc/...
                gc.collect()
            st.index, self._met = self._met, self._met + 1
            self._states[model] = st
            if len(self._states) > 1:  # several models: each reports apart
                for each in self._states.values():
                    if each.label is None:
                        each.label = 'model{}'.format(each.index)
        return st

    def setup(self, model):
        """Build ``model``'s compressor and check that every rank has the
        same model and settings (see :meth:`MethodState.setup
        <chainer_vgc.exchange.state.MethodState.setup>`)."""
        self._current = self.state(model)
        self._current.setup(model, self)

    def dense_group(self, model):
        """Names of ``model``'s parameters exchanged densely."""
        return self.state(model).dense_group(model)

    def statistics(self, model):
        """The per-sample statistics hook for ``model`` (kept between steps;
        dense parameters skipped), for code that drives the backward pass
        itself: ``comm.statistics(model).backward(loss)`` then
        ``comm.set_sqsums(...)`` and ``multi_node_mean_grad``."""
        hook = self.state(model).statistics(model, self._hooks.get(model))
        self._hooks[model] = hook
        return hook

    def statistics_hook(self, model):
        """The hook :meth:`statistics` keeps for ``model`` (None before the
        first backward with statistics): the one place it is held, for
        this communicator's optimizers and exchanges alike."""
        return self._hooks.get(model)

    def uncovered_names(self, model):
        """Names of ``model``'s parameters that the statistics of its last
        backward could not cover (``()`` before any)."""
        return tuple(getattr(self._hooks.get(model), 'uncovered_names', ())
                     or ())

    def set_sqsums(self, sqsums):
        """Per-sample sums of squares for the next multi_node_mean_grad,
        aligned with ``model_params(model)``."""
        self._sqsums = sqsums

    def set_loss_scale(self, loss_scale):
        """The loss scale S of the coming multi_node_mean_grad (Chainer's
        ``optimizer.loss_scaling()``; None: none): see
        :func:`chainer_vgc.exchange.run.exchange_async`."""
        self._loss_scale = loss_scale

    # -- the step ------------------------------------------------------------
    def multi_node_mean_grad(self, model, zero_fill=False):
        """ChainerMN's entry point: :meth:`exchange` with what
        :meth:`set_sqsums` and :meth:`set_loss_scale` gave for this step."""
        sqsums, self._sqsums = self._sqsums, None
        loss_scale, self._loss_scale = self._loss_scale, None
        self.exchange(model, zero_fill, sqsums=sqsums, loss_scale=loss_scale)

    def exchange(self, model, zero_fill=False, sqsums=None, loss_scale=None,
                 uncovered=None, state=None):
        """One exchange, now: ``param.grad`` becomes the mean over the
        ranks; returns its :class:`~chainer_vgc.exchange.run.ExchangeResult`.  See
        :meth:`exchange_async`."""
        return self.exchange_async(model, zero_fill, sqsums, loss_scale,
                                   uncovered, state).wait()

    def exchange_async(self, model, zero_fill=False, sqsums=None,
                       loss_scale=None, uncovered=None, state=None,
                       background=False, collectives=None):
        """Start one exchange of ``model``'s gradients; returns an
        :class:`~chainer_vgc.exchange.run.ExchangeHandle` (``handle.wait()``: the
        mean is in ``param.grad``, the result is returned and its totals
        become the state's).

        ``state``: the :class:`~chainer_vgc.exchange.state.MethodState` to
        use (default: ``model``'s); ``uncovered``: the names this step's
        statistics did not cover (default: those of the last backward
        through :meth:`statistics`); ``background``: run on a thread, on
        ``collectives`` (a :meth:`duplicate`; default: this
        communicator's own, made at the first such call: collective).  A
        background exchange first waits for the one in flight on the same
        collectives or of the same state; see
        :func:`chainer_vgc.exchange.run.exchange_async` for the rest."""
        if state is None:
            state = self.state(model)
        if uncovered is None:
            uncovered = self.uncovered_names(model)
        self._current = state
        if background:
            if collectives is None:
                if self._background is None:
                    self._background = self.duplicate()
                collectives = self._background
            self._wait_before(collectives, state)
        else:
            collectives = self
        handle = exchange_run.exchange_async(
            collectives, state, model, zero_fill, sqsums, loss_scale,
            uncovered or (), background, self._run)
        if background:
            self._in_flight.append(handle)
        return handle

    def _wait_before(self, collectives, state):
        """Before a background exchange on ``collectives``: the one in
        flight there ends first (one thread per MPI communicator), and one
        of the same state is waited for (its totals committed)."""
        for before in self._in_flight:
            if before.collectives is collectives or before.state is state:
                before.join()  # its owner waits for it, and commits
                if before.state is state:
                    before.wait()
        self._in_flight = [h for h in self._in_flight if not h.done()]

    def sync_run(self, model):
        """Rank 0's run totals for ``model`` to every rank: when only some
        ranks resumed from a snapshot (the optimizer then broadcasts the
        parameters), the warm-up and alpha ramp must count the same steps
        everywhere."""
        st = self.state(model)
        st.totals = self.mpi_comm.bcast(st.totals, root=0)

    def serialize_state(self, model, serializer, state=None):
        """Save or load ``model``'s method state (residuals, totals, the
        rule's own state) with ``serializer``: see
        :func:`chainer_vgc.exchange.snapshot.serialize`."""
        if state is None:
            state = self.state(model)
        self._current = state
        snapshot.serialize(state, model, serializer, self.size,
                           rank=self.rank)

    def finalize(self):
        """Wait for the background exchanges in flight and free the
        duplicate MPI communicator of this communicator's own background
        exchanges (also freed when the communicator is garbage-collected;
        a double-buffered optimizer frees its own: ``close()``)."""
        for handle in self._in_flight:
            handle.join()
        self._in_flight = []
        if self._background is not None:
            self._background.free()
            self._background = None

