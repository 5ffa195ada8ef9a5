"""One exchange of one model, now or in the background.

The question this module answers: in what order does one exchange run,
from this rank's gradients to ``param.grad`` = the mean over the ranks?
(paper Sec. 4.3, Alg. 1):

1. the parameters the statistics left uncovered join the dense group
   (``uncovered='dense'``), and every rank checks that it has the same
   model and settings (:meth:`MethodState.setup
   <chainer_vgc.exchange.state.MethodState.setup>`);
2. the compressed group: this worker's gradients, unscaled, to the rule
   and one uint32 message (:class:`~chainer_vgc.compressor.
   GradientCompressor`; a rank whose gradients are not finite makes every
   rank skip the step), the allgatherv, every message decoded and summed
   in rank order times 1/p into ``param.grad``
   (:func:`chainer_vgc.exchange.mean.mean_gradients`);
3. the dense group (and, during the warm-up, every parameter): allreduce;
4. the figures (:mod:`chainer_vgc.reporting`).

:func:`exchange_async` returns an :class:`ExchangeHandle`; ``wait()``
gives the :class:`ExchangeResult` and makes its totals and figures the
state's.  With ``background=True`` the exchange runs on a thread, on
collectives over a duplicate MPI communicator (double buffering); the
state's totals are then those of the last exchange waited for.
"""

import atexit
import threading
import time

import chainer
import numpy

from chainer_vgc.backends import arrays
from chainer_vgc.engines import reference
from chainer_vgc.exchange import mean as exchange_mean
from chainer_vgc import reporting
from chainer_vgc.exchange import fallback
from chainer_vgc import faults
from chainer_vgc.faults import SkippedStep
from chainer_vgc.params import model_params


class ExchangeResult(object):
    """What one exchange did: ``figures`` (the reported figures, and the
    totals' increments under '_' keys), ``skipped`` (a rank's gradients
    were not finite: nothing was exchanged, the gradients are NaN),
    ``timing`` (seconds of this rank's phases) and ``totals`` (the run
    totals after it)."""

    def __init__(self, totals):
        self.totals = totals
        self.figures = {}
        self.skipped = False
        self.timing = {}
        #: the dense fallback's :class:`~chainer_vgc.exchange.fallback.Choice`
        #: (None without one)
        self.choice = None


class ExchangeHandle(object):
    """An exchange started by :func:`exchange_async`.

    :meth:`wait` completes it (joins its thread), raises its error if it
    failed, makes its totals and figures the state's (once) and returns the
    :class:`ExchangeResult`; :meth:`done` says whether waiting would block.
    """

    def __init__(self, state, run, background, collectives=None):
        self.state = state
        #: the collectives it runs on (None once done: not kept alive)
        self.collectives = collectives
        self._result = None
        self._error = None
        self._committed = False
        self._thread = None
        if background:
            _UNWAITED.add(self)
            _register_exit()
            self._thread = threading.Thread(
                target=self._run, args=(run,), daemon=True,
                name='chainer_vgc exchange')
            self._thread.start()
        else:
            self._run(run)

    def _run(self, run):
        try:
            self._result = run()
        except BaseException as e:  # raised by wait(), on the caller's thread
            self._error = e
        finally:
            self.collectives = None

    def done(self):
        return self._thread is None or not self._thread.is_alive()

    def join(self):
        """Wait for the exchange to end, without raising its error or
        committing anything; returns the error (None if none)."""
        if self._thread is not None:
            self._thread.join()
        return self._error

    def discard(self):
        """Wait for the exchange to end and forget it: no error is raised
        and nothing is committed (a snapshot is loaded over the run)."""
        self.join()
        self._error, self._committed = None, True
        _UNWAITED.discard(self)

    def wait(self):
        error = self.join()
        _UNWAITED.discard(self)
        if error is not None:
            raise error
        if not self._committed:
            self._committed = True
            r = self._result
            self.state.commit(r.totals, r.figures, r.skipped, r.timing)
        return self._result


#: background exchanges not waited for yet: kept alive, so that at exit each
#: completes before MPI is finalized
_UNWAITED = set()
_EXIT_HOOK = []


def _register_exit():
    """Registers :func:`_complete_at_exit` once, at the first background
    exchange, on every way MPI can be finalized:

    - ``atexit`` (MPI is loaded by then, so it runs before mpi4py's own
      finalization at exit);
    - mpi4py's ``MPI.Finalize``, wrapped: a user's own ``MPI.Finalize()``
      with an exchange in flight first lets it end.  This must happen
      before ``MPI_Finalize`` starts: MPICH 5 turns its locks off
      ("single threaded from here") before it runs any callback, so a
      thread then still inside a collective may leave a lock held, and
      ``MPI_Finalize`` aborts on the busy mutex (MPI-3.1 Sec. 8.7: a
      process completes its MPI calls before it finalizes);
    - the delete callback of an ``MPI_COMM_SELF`` attribute, which
      ``MPI_Finalize`` runs before anything is freed (MPI-3.1 Sec.
      8.7.1): a last resort for a finalization that bypasses the wrapper
      (a name bound before the first exchange, or C code)."""
    if not _EXIT_HOOK:
        from mpi4py import MPI
        atexit.register(_complete_at_exit)
        finalize = MPI.Finalize

        def finalize_after_exchanges():
            _complete_at_exit()
            finalize()
        finalize_after_exchanges.__wrapped__ = finalize
        finalize_after_exchanges.__doc__ = (
            'MPI.Finalize, after every chainer_vgc exchange in flight '
            'ends. ' + (finalize.__doc__ or ''))
        MPI.Finalize = finalize_after_exchanges

        def at_finalize(comm, keyval, value):
            _complete_at_exit()
            return MPI.SUCCESS
        keyval = MPI.Comm.Create_keyval(delete_fn=at_finalize)
        MPI.COMM_SELF.Set_attr(keyval, True)
        _EXIT_HOOK.append(keyval)


def _complete_at_exit():
    """Let every background exchange not waited for finish before MPI is
    finalized (its mean is not applied: call ``optimizer.wait()`` or
    ``handle.wait()`` before finalizing to keep it); one that failed
    aborts the job, as it would have at the next update (the other ranks
    may be waiting in its collectives)."""
    for handle in list(_UNWAITED):
        error = handle.join()
        _UNWAITED.discard(handle)
        if error is not None:
            import sys
            import traceback
            traceback.print_exception(type(error), error,
                                      error.__traceback__)
            print('chainer_vgc: the last exchange failed on this rank; '
                  'aborting the job', file=sys.stderr, flush=True)
            from mpi4py import MPI
            MPI.COMM_WORLD.Abort(1)


def exchange_async(collectives, state, model, zero_fill=False, sqsums=None,
                   loss_scale=None, uncovered=(), background=False,
                   run=None):
    """Start one exchange of ``model``'s gradients for ``state`` on
    ``collectives``; returns its :class:`ExchangeHandle`.

    ``sqsums``: this step's per-sample sums of squares, aligned with
    ``model_params(model)`` (needed when ``state.needs_sqsum``);
    ``loss_scale``: the loss scale S of this step's gradients (None: none):
    gradients and sums of squares are unscaled (g / S, s / S**2) before
    the rule sees them and the mean is scaled back (x S) for Chainer to
    unscale; ``uncovered``: the names this step's statistics did not
    cover.  With ``background``, the exchange runs on a thread (its
    collectives must then be the background ones, and its device work is
    ordered after the work queued so far on the current stream).
    ``run``: the exchange itself (default :func:`run_exchange`; the
    hierarchical one is :func:`chainer_vgc.nodes.run.run_node_exchange`),
    called with this function's arguments and a copy of the totals."""
    if run is None:
        run = run_exchange
    totals = dict(state.totals)
    if not background:
        return ExchangeHandle(state, lambda: run(
            collectives, state, model, zero_fill, sqsums, loss_scale,
            uncovered, totals), False)
    first = next((p.array for p in model_params(model)[1]
                  if p.array is not None), None)
    debug = chainer.is_debug()  # (Chainer's config is per thread)
    ready = arrays.stream_marker(first)  # the backward's work, queued

    def in_background():
        with arrays.device_scope(first), \
                chainer.using_config('debug', debug):
            arrays.wait_marker(ready)
            result = run(collectives, state, model, zero_fill, sqsums,
                         loss_scale, uncovered, totals)
            arrays.finish_stream(first)
            return result
    return ExchangeHandle(state, in_background, True, collectives)


def run_exchange(collectives, state, model, zero_fill, sqsums, loss_scale,
                 uncovered, totals):
    """The exchange itself (see the module's steps); ``totals`` (a copy of
    the state's) is updated and returned in the result."""
    state.note_uncovered(uncovered, collectives)
    state.setup(model, collectives)
    result = ExchangeResult(totals)
    done = exchange_parameters(collectives, state, model, zero_fill,
                               sqsums, loss_scale, result)
    if done is not None and state.count_by_parameter:
        reporting.count_sent(state.elements_by_parameter,
                             state.parameter_sizes, done,
                             state.compressor, model, collectives.size)
    if done is not None:
        result.figures = reporting.report_step(
            done.blocks, done.n_params, totals, done.elements,
            done.param_bytes, size=collectives.size,
            allreduced_bytes=done.allreduced_bytes,
            dense_elements=done.n_dense * collectives.size,
            dense_wire=done.dense_wire, n_compressed=done.n_compressed,
            observer=model, label=state.label,
            extra=fallback.figures(result.choice))
    return result



class Sent(object):
    """What :func:`exchange_parameters` sent: the compressed group's
    ``blocks`` (every rank's message) and ``elements`` (per message), the
    dense group's ``n_dense`` elements per rank and ``dense_wire`` bytes
    per rank, and the sizes ``n_params``, ``n_compressed`` (elements)
    and ``param_bytes``.  A rule that exchanges by allreduce of factors
    sends no messages: ``blocks`` is empty, ``elements`` what each rank
    sent, and ``allreduced_bytes`` the bytes each rank put into the
    allreduces (None otherwise)."""

    def __init__(self, compressed, dense, blocks, elements, n_dense,
                 dense_wire, allreduced_bytes=None):
        self.allreduced_bytes = allreduced_bytes
        self.blocks, self.elements = blocks, elements
        self.n_dense, self.dense_wire = n_dense, dense_wire
        #: the dense group's indices in model_params order
        self.dense_indices = [i for i, _ in dense]
        self.n_compressed = sum(p.size for _, p in compressed)
        self.n_params = self.n_compressed + sum(p.size for _, p in dense)
        self.param_bytes = sum(p.size * p.dtype.itemsize
                               for _, p in compressed + dense)


def exchange_parameters(collectives, state, model, zero_fill, sqsums,
                        loss_scale, result, agree_on=None):
    """Both groups of one set-up exchange: the compressed group's
    allgatherv, then the dense group's allreduce (every parameter's during
    the warm-up).  Returns :class:`Sent`, or None when a rank's
    gradients were not finite (the step is skipped, reported, and
    ``param.grad`` is NaN).  ``agree_on``: see :func:`_compressed_mean`."""
    compressed, dense = state.split(model, result.totals['steps'])
    blocks, elements, allreduced = [], None, None
    if compressed:
        state.ramp_alpha(result.totals['steps'])
        params = [p for _, p in compressed]
        if sqsums is not None:  # aligned with all parameters
            sqsums = [sqsums[i] for i, _ in compressed]
        out = _compressed_mean(collectives, state, params, sqsums,
                               zero_fill, loss_scale, result, model,
                               agree_on)
        if out is None:  # skipped on every rank (reported)
            nan_grads([p for _, p in dense])
            return None
        if isinstance(out, faults.DenseStep):  # as a warm-up step
            dense, compressed = sorted(compressed + dense,
                                       key=lambda ip: ip[0]), []
        else:
            blocks, elements = out
            if blocks is None:  # allreduced factors, no messages
                blocks, allreduced = [], state.compressor.last_bytes
    n_dense, dense_wire = collectives.dense_mean(
        [p for _, p in dense], zero_fill, state.dense_dtype)
    return Sent(compressed, dense, blocks, elements, n_dense, dense_wire,
                allreduced)


def nan_grads(params):
    """A skipped step's gradients: NaN, so that Chainer's dynamic loss
    scaling skips the update."""
    for p in params:
        p.grad = p.xp.full(p.shape, numpy.nan, dtype=p.dtype)


def _compressed_mean(collectives, state, params, sqsums, zero_fill,
                     loss_scale, result, model, agree_on=None):
    """The compressed group's exchange; (blocks, elements per block), or
    None when a rank's gradients were not finite (skipped).  The ranks
    agree on faults with ``agree_on(obj)`` (default: the collectives'
    ``allgather_obj``), which returns the objects of this group's ranks
    in rank order."""
    if agree_on is None:
        agree_on = collectives.allgather_obj
    comp = state.compressor
    if comp.rule.needs_sqsum and sqsums is None:
        raise RuntimeError(
            "method {!r} needs per-sample statistics of this step's "
            'backward pass: make the optimizer with '
            'chainer_vgc.create_multi_node_optimizer and pass the loss '
            'function to optimizer.update (StandardUpdater does), or run '
            'comm.statistics(model).backward(loss) and '
            'comm.set_sqsums(...) instead of loss.backward()'.format(
                state.method))
    grads, sqsums = exchange_mean.local_gradients(params, sqsums, zero_fill)
    has_grad = tuple(g is not None for g in grads)
    present = []
    spans = []  # (arrived, left) of each agreement, perf_counter seconds
    rule_grads, rule_sqsums = exchange_mean.unscaled(grads, sqsums,
                                                     loss_scale)
    chooser, count, calls = state.fallback, None, []
    if chooser is not None:
        chooser.ensure_link(collectives.mpi_comm)
        count = chooser.count(comp, rule_grads, rule_sqsums)

    def agree(code):
        """Every rank's fault code (one small allgather), with which
        compressed parameters have a gradient on that rank: with
        ``zero_fill=False`` a parameter some rank has a gradient for gets
        the mean on every rank, even when nobody sent anything for it.
        Its seconds (mostly waiting for the slowest rank to arrive) are
        the ``agree`` phase, not ``compress``; ``agree_spans`` holds each
        call's (arrival, departure) on this process's ``perf_counter``
        clock, from which a benchmark whose ranks share one clock splits
        it into the wait for the slowest rank and the agreement itself."""
        t = time.perf_counter()
        both = agree_on((int(code), has_grad, count))
        present[:] = [any(bits) for bits in zip(*(b for _, b, _ in both))]
        spans.append((t, time.perf_counter()))
        codes = [c for c, _, _ in both]
        calls.append(code)
        if chooser is not None and len(calls) == 1 and not any(codes):
            choice = chooser.choose(
                [n for _, _, n in both],
                8.0 * sum(p.size * p.dtype.itemsize for p in params),
                fallback.bits_per_element(result.totals))
            if choice.dense:  # (before any state moves)
                raise faults.DenseStep(choice)
            result.choice = choice
        return codes

    if comp.rule.exchange == 'allreduce_factors':
        return _factor_mean(collectives, comp, params, rule_grads,
                            loss_scale, result, state, model, agree,
                            present, spans)
    t0 = time.perf_counter()
    try:
        message = comp.compress(rule_grads, rule_sqsums, copy=False,
                                agree=agree)
    except SkippedStep as e:
        skip_step(params, e, result, state, model)
        return None
    except faults.DenseStep as e:
        result.choice = e.choice
        comp.rule.dense_step()
        return e
    t1 = time.perf_counter()
    # the message is in host memory on every path (codec.pack): MPI never
    # sees a device pointer; the blocks stay on the host, where the
    # headers, checks and reports read them (on a GPU, in the buffer the
    # decode uploads from, until the next step)
    blocks, _ = collectives.allgatherv_words(
        message, exchange_mean.receive_into(comp, params, grads,
                                            collectives.size))
    t2 = time.perf_counter()
    # the mean, times the loss scale for Chainer to divide again
    elements = exchange_mean.mean_gradients(blocks, comp, params, grads,
                                            collectives.size, zero_fill,
                                            False, rescale=loss_scale,
                                            present=present)
    waited = sum(left - arrived for arrived, left in spans)
    result.timing = {'compress': t1 - t0 - waited, 'agree': waited,
                     'transport': t2 - t1, 'decode': time.perf_counter() - t2,
                     'agree_spans': spans}
    return blocks, elements


def _factor_mean(collectives, comp, params, rule_grads, loss_scale, result,
                 state, model, agree, present, spans):
    """The compressed group's exchange for a rule whose exchange is
    ``'allreduce_factors'`` (PowerSGD): the compressor's rounds, each an
    allreduce of ``collectives`` (:meth:`~chainer_vgc.compressor.
    GradientCompressor.reduce`), their mean into ``param.grad`` (times
    the loss scale for Chainer to divide again; ``None`` stays where no
    worker had a gradient and ``zero_fill`` is off).  Returns
    ``(None, elements)``: no messages, and the elements each rank sent
    (every rank the same), or None when a rank's gradients were not
    finite."""
    reduced = []  # (start, end) of each allreduce, perf_counter seconds

    def allreduce(buffer):
        t = time.perf_counter()
        collectives.allreduce_sum(buffer)
        reduced.append((t, time.perf_counter()))
    t0 = time.perf_counter()
    try:
        means = comp.reduce(rule_grads, allreduce, collectives.size,
                            agree=agree, present=present)
    except SkippedStep as e:
        skip_step(params, e, result, state, model)
        return None
    t1 = time.perf_counter()
    for p, m in zip(params, means):
        if m is None:  # no worker had a gradient (zero_fill off)
            continue
        with arrays.device_scope(p.array):  # (the mean is already one)
            p.grad = reference.finish_mean(m, p.dtype, 1, loss_scale)
    waited = sum(left - arrived for arrived, left in spans)
    moved = sum(end - start for start, end in reduced)
    result.timing = {'compress': t1 - t0 - waited - moved, 'agree': waited,
                     'transport': moved, 'decode': time.perf_counter() - t1,
                     'agree_spans': spans}
    return None, [comp.last_sent] * collectives.size


def skip_step(params, error, result, state, model):
    """A rank's gradients were not finite: nothing was exchanged and no
    residual changed.  The gradients become NaN, so that Chainer's dynamic
    loss scaling skips the update and lowers the scale (the optimizer
    wrapper skips it without); ``vgc/skipped`` is reported.  In debug mode
    (``chainer.set_debug(True)``) a ValueError instead, as ChainerMN's
    communicators raise."""
    if chainer.is_debug():
        raise ValueError('Parameters diverged: {}'.format(error))
    nan_grads(params)
    result.skipped = True
    result.totals['skipped'] += 1
    result.figures = {'vgc/skipped': 1.0}
    reporting.report(result.figures, model, state.label)
