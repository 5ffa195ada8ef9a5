"""p data-parallel workers in one process (for the paper harness on 2 cores).

In synchronous data parallelism every worker holds the same parameters, so
one model suffices: each step, every simulated worker runs forward/backward
on its own minibatch with its own compressor (its own residual state), and
the workers' messages are combined exactly as
:class:`~chainer_vgc.communicator.VGCCommunicator` combines the messages it
gathers (same functions, same rank order), then one optimizer update is
applied.  As with ChainerMN's multi-node optimizer, the first step only
"broadcasts" (no update).  ``tests/test_examples.py`` checks that this gives
the same parameters, bit for bit, as a real ``mpiexec`` run.
"""

from chainer_vgc import communicator as _comm
from chainer_vgc.compressor import GradientCompressor
from chainer_vgc.rules import create_rule
from chainer_vgc.statistics import PerSampleSquares
from chainer_vgc.statistics import model_params


class SimulatedWorkers(object):
    """``size`` workers sharing ``model`` and ``optimizer`` (a plain Chainer
    optimizer set up on ``model``)."""

    def __init__(self, model, optimizer, size, method='vgc',
                 zero_fill=True, **hyperparams):
        self.model, self.optimizer, self.size = model, optimizer, size
        self.method, self.zero_fill = method, zero_fill
        self.names, self.params = model_params(model)
        self.compressors = []
        for rank in range(size):
            args = dict(hyperparams)
            if args.get('seed') is not None:  # as VGCCommunicator
                args['seed'] = int(args['seed']) + rank
            comp = GradientCompressor(
                create_rule(method, **args), self.names,
                [p.shape for p in self.params],
                [p.dtype for p in self.params])
            for i, p in enumerate(self.params):
                comp.states[i] = comp.rule.init_state(p.size, p.dtype, p.xp)
            self.compressors.append(comp)
        self.stats = PerSampleSquares(model)
        self.steps = 0
        self.last = {}
        self.totals = _comm.new_totals()

    @property
    def compressor(self):
        return self.compressors[0]

    def update(self, lossfun, batches):
        """One synchronous step; ``batches[w]`` is worker w's tuple of
        arrays, ``lossfun(*batch)`` its mean loss."""
        if len(batches) != self.size:
            raise ValueError('expected {} batches, got {}'.format(
                self.size, len(batches)))
        self.steps += 1
        if self.steps == 1:
            return  # ChainerMN's first update broadcasts rank 0's params
        messages = []
        for comp, batch in zip(self.compressors, batches):
            self.model.cleargrads()
            loss = lossfun(*batch)
            sqsums = None
            if comp.rule.needs_sqsum:
                sqsums = self.stats.backward(loss, batch=batch)
            else:
                loss.backward()
            grads, sqsums = _comm.local_gradients(self.params, sqsums,
                                                  self.zero_fill)
            messages.append(comp.compress(grads, sqsums))
        elements = _comm.mean_gradients(messages, self.compressor,
                                        self.params, grads, self.size,
                                        self.zero_fill, self.method == 'none')
        self.optimizer.update()
        self.last = _comm.report_step(messages, self.compressor.n_params,
                                      self.totals, elements,
                                      self.compressor.n_bytes)
