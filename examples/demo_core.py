#!/usr/bin/env python
"""Single-process demonstration of the compression core on a Chainer MLP.

One worker trains the same MLP once per method on generated data (10 classes
of Gaussian clusters).  Each step: forward/backward, per-sample sums of
squares (exact, chainer_vgc.statistics.PerSampleSquares), compress -> one uint32 message
-> decode -> Adam update with the decoded gradient.  Prints, per method, the
test accuracy, the compression ratio (parameters / average elements sent,
the paper's definition) and the bytes a step puts on the wire vs dense.
"""

import argparse
import time

import chainer
import chainer.functions as F
import chainer.links as L
import numpy

from chainer_vgc import GradientCompressor
from chainer_vgc import RULES
from chainer_vgc.statistics import PerSampleSquares
from chainer_vgc.statistics import model_params
from example_common import hyperparameter_text
from example_common import with_seed

# the settings shown; a rule of chainer_vgc.RULES not listed here runs too,
# with its defaults (a rule that takes a seed gets the run's)
SWEEP = [
    ('none', {}),
    ('vgc', dict(alpha=1.0)),
    ('vgc', dict(alpha=1.5)),
    ('vgc', dict(alpha=2.0)),
    ('hybrid', dict(alpha=2.0, tau=0.01)),
    ('strom', dict(tau=0.01)),
    ('qsgd', dict(bits=2, bucket=128)),
]
METHODS = SWEEP + [(m, {}) for m in sorted(RULES)
                   if m not in {method for method, _ in SWEEP}]


def make_data(rng, n_train, n_test, dim=64, classes=10):
    centers = rng.normal(0, 1, size=(classes, dim))

    def draw(n):
        t = rng.integers(0, classes, n).astype(numpy.int32)
        x = (centers[t] + rng.normal(0, 2.0, size=(n, dim))).astype(
            numpy.float32)
        return x, t
    return draw(n_train), draw(n_test)


def make_model(dim, seed):
    numpy.random.seed(seed)  # chainer's initializers draw from numpy.random
    return chainer.Sequential(L.Linear(dim, 128), F.relu, L.Linear(128, 10))


def train(method, kw, data, steps, batch, seed=0):
    (x, t), (xt, tt) = data
    model = make_model(x.shape[1], seed)
    opt = chainer.optimizers.Adam(alpha=1e-3)
    opt.setup(model)
    names, params = model_params(model)
    comp = GradientCompressor(method, names, [p.shape for p in params],
                              [p.dtype for p in params],
                              **with_seed(method, kw, seed))
    rng = numpy.random.default_rng(seed)
    stats = PerSampleSquares(model)

    def loss_fn(xb, tb):
        return F.softmax_cross_entropy(model(xb), tb)

    sent = wire = 0
    for _ in range(steps):
        idx = rng.integers(0, len(x), batch)
        xb, tb = x[idx], t[idx]
        model.cleargrads()
        if comp.rule.needs_sqsum:
            sq = stats.backward(loss_fn(xb, tb), batch=(xb,))
        else:
            sq = None
            loss_fn(xb, tb).backward()
        message = comp.compress([p.grad for p in params], sq)
        for p, update in zip(params, comp.decode(message)):
            p.grad[...] = update
        opt.update()
        sent += comp.last_sent
        wire += comp.last_bytes
    with chainer.using_config('train', False), chainer.no_backprop_mode():
        acc = float(F.accuracy(model(xt), tt).array)
    n = comp.n_params
    return dict(acc=acc, compression=n * steps / max(sent, 1),
                bytes=wire / steps, dense=4 * n, n=n)


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--steps', type=int, default=1500)
    p.add_argument('--batchsize', type=int, default=32)
    args = p.parse_args()
    data = make_data(numpy.random.default_rng(0), 20000, 2000)
    print('chainer-vgc core demo: 1 worker, MLP 64-128-10, Adam, {} steps '
          'of batch {}'.format(args.steps, args.batchsize))
    rows = []
    for method, kw in METHODS:
        t0 = time.time()
        res = train(method, kw, data, args.steps, args.batchsize)
        label = ' '.join([method, hyperparameter_text(kw)]).rstrip()
        rows.append((label, res))
        print('  {:<28} done in {:.1f}s'.format(label, time.time() - t0))
    n = rows[0][1]['n']
    print('\n{} parameters; dense gradient = {:,} bytes per step\n'.format(
        n, 4 * n))
    print('| method | test accuracy | compression | bytes/step | vs dense |')
    print('|---|---:|---:|---:|---:|')
    for label, r in rows:
        print('| {} | {:.3f} | {:,.1f} | {:,.0f} | {:.4f} |'.format(
            label, r['acc'], r['compression'], r['bytes'],
            r['bytes'] / r['dense']))


if __name__ == '__main__':
    main()
