"""Run under mpiexec: hybrid with float16 parameters and Chainer's dynamic
loss scaling trains like float32 hybrid (issue 24, finding 5).

Prints 'hybrid float16 OK at p=P'.

The hybrid rule (paper Fig. "Hybrid", Sec. 4.5) sends sign(r) * tau, so
every element of the mean it hands the optimizer is a multiple of tau / p,
however large the local gradients are.  Chainer keeps an optimizer's state
in the parameter's dtype unless ``use_fp32_update()`` is on: Adam's
v = (1 - beta2) g**2 = 1e-3 * (0.01 / 2)**2 = 2.5e-8 is 0 in float16, and
the step alpha_t m / (sqrt(v) + eps) is 3.2e-4 * 5e-4 / 1e-8 = 15.8
instead of about alpha (the issue's jump of max |param| from 0.47 to 16).
The multi-node optimizer therefore updates float16 parameters in float32
for the compressing methods.  The checks train float16 as the issue did
(no ``use_fp32_update()`` call) and as check_nonfinite.train_scaled does
(with it), and compare with float32.
"""

import os
import sys

import chainer
import chainer.functions as F
import numpy
from mpi4py import MPI

import chainer_vgc
from chainermn import global_except_hook

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import check_nonfinite  # NOQA: E402
import runner  # NOQA: E402

world = MPI.COMM_WORLD

#: the largest change of a parameter element in one step, in units of
#: Adam's alpha: Adam's step is at most about alpha (1 - beta1) /
#: sqrt(1 - beta2) = 3.2 alpha, and rounding to float16 adds at most an
#: ulp (2**-10 for the parameters here, all below 2)
MAX_STEP = 5.0


def mlp(seed=0, dtype=numpy.float32):
    """The issue's MLP, 64-128-10."""
    return check_nonfinite.make(seed, dtype, sizes=(64, 128, 10))


def mlp_data(step, n=32, dtype=numpy.float32, seed=0):
    """Ten classes: the largest of the first ten inputs (rank's own
    batches; step 10**6: held-out data, the same on every rank)."""
    rank = 0 if step == 10 ** 6 else world.rank
    rng = numpy.random.default_rng(100000 * seed + 1000 * step + rank)
    x = rng.normal(size=(n, 64))
    return x.astype(dtype), x[:, :10].argmax(axis=1).astype(numpy.int32)


def train(method, dtype, make, data, steps, alpha, loss_times=1,
          scale=None, interval=1000, overflow_step=None, batch=32, **kw):
    """Adam with Chainer's dynamic loss scaling (starting at ``scale``,
    Chainer's 1 by default); the loss times ``loss_times``; inputs times
    300 at ``overflow_step`` (float16 gradients overflow there).  Returns
    a dict: each step's training loss, the largest change of a parameter
    element in any step, then the largest |param|, held-out loss and
    accuracy at the end, and the skipped exchanges."""
    comm = chainer_vgc.create_communicator(method, world, **kw)
    model = make(0, dtype)
    inner = chainer.optimizers.Adam(alpha=alpha)
    opt = chainer_vgc.create_multi_node_optimizer(inner, comm).setup(model)
    inner.loss_scaling(interval=interval, scale=None)
    if scale is not None:
        inner._loss_scale = scale
    out = {'loss': [], 'step': 0.0,
           'test_loss0': held_out(model, data, dtype)[0]}

    def lossfun(x, t):
        loss = model(x, t)
        out['loss'].append(float(loss.array))
        return loss * dtype(loss_times)
    for step in range(steps):
        x, t = data(step, batch, dtype)
        if step == overflow_step:
            x = x * dtype(300)
        before = [p.array.astype(numpy.float64) for p in model.params()]
        with numpy.errstate(over='ignore', invalid='ignore'):
            opt.update(lossfun, x, t)
        out['step'] = max([out['step']] + [
            float(numpy.abs(p.array - b).max())
            for p, b in zip(model.params(), before)])
    out['test_loss'], out['accuracy'] = held_out(model, data, dtype)
    out['max_param'] = max(float(numpy.abs(p.array).max())
                           for p in model.params())
    out['skipped'] = int(comm.state(model).totals['skipped'])
    return out


def held_out(model, data, dtype):
    """Loss and accuracy on train_scaled's held-out data (2000 examples
    of step 10**6)."""
    x, t = data(10 ** 6, 2000, dtype)
    with chainer.using_config('train', False), \
            numpy.errstate(over='ignore', invalid='ignore'):
        y = F.cast(model.predictor(x), numpy.float32)
        return (float(F.softmax_cross_entropy(y, t).array),
                float(F.accuracy(y, t).array))


def expect_like_float32(half, ref, alpha, loss_tol, label, skip=()):
    """Finite training losses (but at the steps ``skip``), no step larger
    than Adam's, no parameter larger than float32's, final held-out loss
    and accuracy close to float32's."""
    losses = [x for i, x in enumerate(half['loss']) if i not in skip]
    assert numpy.isfinite(losses).all(), (label, half['loss'])
    assert half['step'] <= MAX_STEP * alpha, (label, half['step'])
    assert half['max_param'] <= ref['max_param'] + 0.1, (
        label, half['max_param'], ref['max_param'])
    assert abs(half['test_loss'] - ref['test_loss']) < loss_tol, (
        label, half['test_loss'], ref['test_loss'])
    assert abs(half['accuracy'] - ref['accuracy']) < 0.03, (
        label, half['accuracy'], ref['accuracy'])
    if world.rank == 0:
        print('{}: held-out loss {:.4f} (float32 {:.4f}), largest step '
              '{:.3g}, {} skipped'.format(label, half['test_loss'],
                                          ref['test_loss'], half['step'],
                                          half['skipped']))


def check_issue_setting():
    """The issue's setting: 64-128-10, Adam 1e-3, the loss times 512,
    dynamic loss scaling from Chainer's default scale; float16 as the
    issue ran it (no ``use_fp32_update()`` call)."""
    common = dict(make=mlp, data=mlp_data, steps=25, alpha=1e-3,
                  loss_times=512, tau=0.01)
    ref = train('hybrid', numpy.float32, **common)
    assert ref['test_loss'] < ref['test_loss0'] - 0.1, ref  # it trains
    half = train('hybrid', numpy.float16, **common)
    expect_like_float32(half, ref, 1e-3, 0.05, 'issue setting')


def check_existing_setting():
    """check_nonfinite.train_scaled's setting (6-32-3, Adam 0.01, the
    scale from 2**14 doubling every 2 steps, an overflow provoked at step
    5): as train_scaled runs it (it calls ``use_fp32_update()``), and
    without that call."""
    def data(step, n, dtype):
        return check_nonfinite.data(step, n, dtype)
    common = dict(make=check_nonfinite.make, data=data, steps=60,
                  alpha=0.01, tau=0.001)
    ref = train('hybrid', numpy.float32, **common)
    # the same held-out data as train() (seed 0, 2000 examples there)
    acc, skipped, _, _ = check_nonfinite.train_scaled(
        'hybrid', numpy.float16, True, tau=0.001)
    assert skipped >= 1 and abs(acc - ref['accuracy']) < 0.03, (
        acc, ref['accuracy'])
    half = train('hybrid', numpy.float16, scale=2.0 ** 14, interval=2,
                 overflow_step=5, **common)
    assert half['skipped'] >= 1, 'no overflow was provoked'
    expect_like_float32(half, ref, 0.01, 0.1, 'train_scaled setting',
                        skip=(5,))


CHECKS = [check_issue_setting, check_existing_setting]

if __name__ == '__main__':
    # a failed assertion on one rank aborts the job (no rank left waiting
    # in a collective)
    global_except_hook.add_hook()
    runner.run(CHECKS, 'hybrid float16')
