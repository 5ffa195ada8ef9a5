"""Run under mpiexec: trainer runs for the resume test.

    check_resume.py MODES N OUT METHODS

runs, one after the other in this process, every mode of the
comma-separated MODES for every method of the comma-separated METHODS
('vgc', 'qsgd', ..., 'vgc+db' with double buffering, 'hybrid+f16' a float16
model), each a fresh model, communicator and trainer:

    straight        # N iterations, save params
    half            # N/2 iterations, per-rank snapshot
    resume          # (a new process) load the snapshot, go to N
    resave          # load the snapshot, save it again at once (no update
                    # between)
    resume-resaved  # (a new process) load that one, go to N

Each rank writes OUT/METHOD/params_<mode>_rank<r>.npz; rank 0 prints
'resume runs OK: K' after the K runs.
"""

import os
import sys

import chainer
from chainer import training
from chainer.training import extensions
import chainer.links as L
from mpi4py import MPI
import numpy

import chainer_vgc
from chainer_vgc.harness.models import MLP

from topk_rule import TopK


def main():
    modes, n, out = sys.argv[1].split(','), int(sys.argv[2]), sys.argv[3]
    methods = sys.argv[4].split(',')
    for method in methods:
        os.makedirs(os.path.join(out, method), exist_ok=True)
        for mode in modes:
            run(mode, n, os.path.join(out, method), method)
    if MPI.COMM_WORLD.rank == 0:
        print('resume runs OK: {}'.format(len(methods) * len(modes)))


def run(mode, n, out, method):
    # 'METHOD+db': with double buffering (the snapshot holds the mean in
    # flight, which the resumed run applies first)
    # 'METHOD+f16': a float16 model (updated in float32: the snapshot holds
    # the float32 master weights)
    method, *flags = method.split('+')
    db = 'db' if 'db' in flags else ''
    dtype = numpy.float16 if 'f16' in flags else numpy.float32
    kw = {'vgc': dict(alpha=1.0), 'hybrid': dict(tau=0.001),
          'strom': dict(tau=0.001), 'qsgd': dict(seed=3),
          # (its density warm-up crosses the snapshot's step)
          'dgc': dict(density=0.05, density_warmup_steps=4),
          'powersgd': dict(matrix_rank=2, seed=4),
          'vgc-groups': dict(alpha=1.0, warmup=12, min_size=10,
                             exclude=['/predictor/layers/0/W'])}.get(method, {})
    if method == 'topk':
        method = TopK(0.2)  # a rule object from outside the package
    comm = chainer_vgc.create_communicator(
        'vgc' if method == 'vgc-groups' else method, **kw)
    numpy.random.seed(0)  # (the same initial model in every run)
    with chainer.using_config('dtype', dtype):
        model = L.Classifier(MLP((12,), 3))
    opt = chainer_vgc.create_multi_node_optimizer(
        chainer.optimizers.Adam(), comm,
        double_buffering=db == 'db').setup(model)
    rng = numpy.random.default_rng(comm.rank)
    x = rng.normal(size=(400, 6)).astype(dtype)
    t = ((x[:, 0] > 0).astype(numpy.int32) + (x[:, 1] > 0.5)).astype(
        numpy.int32)
    it = chainer.iterators.SerialIterator(
        chainer.datasets.TupleDataset(x, t), 16, shuffle=False)
    updater = training.StandardUpdater(it, opt)
    stop = n // 2 if mode == 'half' else n
    trainer = training.Trainer(updater, (stop, 'iteration'), out=out)
    snap = 'snapshot_rank{}'.format(comm.rank)
    if mode == 'half':
        trainer.extend(extensions.snapshot(filename=snap),
                       trigger=(stop, 'iteration'))
    if mode in ('resume', 'resave'):
        chainer.serializers.load_npz(os.path.join(out, snap), trainer)
    resaved = os.path.join(out, 'resaved_rank{}'.format(comm.rank))
    if mode == 'resave':  # (the updater: model, optimizer, iterator)
        chainer.serializers.save_npz(resaved, updater)
        opt.close()
        return
    if mode == 'resume-resaved':
        chainer.serializers.load_npz(resaved, updater)
    trainer.run()
    totals = comm.state(model).totals
    numpy.savez(os.path.join(out, 'params_{}_rank{}.npz'.format(
        mode, comm.rank)), totals=numpy.array([totals[k] for k in
                                               sorted(totals)]),
        **{name: p.array for name, p in model.namedparams()})
    opt.close()  # (the next run starts with no exchange in flight)


if __name__ == '__main__':
    main()
