"""A GAN on MNIST, data parallel with compressed gradients: the generator's
and the discriminator's optimizers share one communicator, as in
ChainerMN's DCGAN example.

    mpiexec -n 2 python examples/train_gan.py --iterations 200
    mpiexec -n 2 python examples/train_gan.py --double-buffering
    mpiexec -n 2 python examples/train_gan.py --communicator-per-model

Each model keeps its own compression state on the shared communicator
(residuals, statistics, warm-up, totals) and reports under its optimizer's
name: ``gen/vgc/compression``, ``dis/vgc/compression``.  With
``--communicator-per-model`` each optimizer gets a communicator of its own
instead; the two runs end with the same parameters, bit for bit
(``tests/test_examples.py`` checks it).  Small MLPs, so that a CPU run
takes a minute.

Measured (2 ranks, 100 iterations, ``--alpha 2``): vgc sends most of these
gradients: compression 1.1x for the generator and 1.5x for the
discriminator over the run (``--alpha 8``: 1.4x and 2.2x).  Their elements
are consistent across the batch, so the variance criterion finds few of
them ambiguous; this example shows the shared communicator, not a saving.
"""

import argparse
import os

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import training
from chainer.training import extensions
import numpy

import chainer_vgc
from chainer_vgc.harness import datasets


class Generator(chainer.Chain):
    def __init__(self, n_hidden=16, units=128):
        super(Generator, self).__init__()
        self.n_hidden = n_hidden
        with self.init_scope():
            self.l1 = L.Linear(n_hidden, units)
            self.l2 = L.Linear(units, 784)

    def make_hidden(self, n, rng):
        return rng.uniform(-1, 1, (n, self.n_hidden)).astype(numpy.float32)

    def forward(self, z):
        return F.sigmoid(self.l2(F.relu(self.l1(z))))


class Discriminator(chainer.Chain):
    def __init__(self, units=128):
        super(Discriminator, self).__init__()
        with self.init_scope():
            self.l1 = L.Linear(784, units)
            self.l2 = L.Linear(units, 1)

    def forward(self, x):
        return self.l2(F.leaky_relu(self.l1(x)))


class GANUpdater(training.updaters.StandardUpdater):
    """The discriminator on real and generated images, then the generator
    through the discriminator (the non-saturating GAN loss).  The loss
    functions take the minibatch arrays, so that the per-sample statistics
    of vgc see where each example's contribution comes from."""

    def __init__(self, iterator, gen, dis, opt_gen, opt_dis, seed):
        super(GANUpdater, self).__init__(
            iterator, {'gen': opt_gen, 'dis': opt_dis})
        self.gen, self.dis = gen, dis
        self.rng = numpy.random.RandomState(seed)

    def loss_dis(self, x_real, z):
        n = len(x_real)
        loss = (F.sum(F.softplus(-self.dis(x_real))) +
                F.sum(F.softplus(self.dis(self.gen(z))))) / n
        chainer.report({'loss': loss}, self.dis)
        return loss

    def loss_gen(self, z):
        loss = F.sum(F.softplus(-self.dis(self.gen(z)))) / len(z)
        chainer.report({'loss': loss}, self.gen)
        return loss

    def update_core(self):
        batch = self.get_iterator('main').next()
        x_real, _ = self.converter(batch)
        z = self.gen.make_hidden(len(x_real), self.rng)
        self.get_optimizer('dis').update(self.loss_dis, x_real, z)
        self.get_optimizer('gen').update(self.loss_gen, z)


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--method', default='vgc')
    p.add_argument('--alpha', type=float, default=2.0)
    p.add_argument('--iterations', type=int, default=300)
    p.add_argument('--batchsize', type=int, default=32)
    p.add_argument('--units', type=int, default=128)
    p.add_argument('--double-buffering', action='store_true')
    p.add_argument('--communicator-per-model', action='store_true')
    p.add_argument('--out', default='result_gan')
    args = p.parse_args()

    kw = {'alpha': args.alpha} if args.method in ('vgc', 'hybrid') else {}
    comm = chainer_vgc.create_communicator(args.method, **kw)
    comms = {'gen': comm, 'dis': comm}
    if args.communicator_per_model:
        comms['dis'] = chainer_vgc.create_communicator(args.method, **kw)
    numpy.random.seed(0)  # the same initial models on every rank
    gen, dis = Generator(units=args.units), Discriminator(args.units)
    opts = {name: chainer_vgc.create_multi_node_optimizer(
        chainer.optimizers.Adam(2e-4, beta1=0.5), comms[name],
        double_buffering=args.double_buffering).setup(model)
        for name, model in (('gen', gen), ('dis', dis))}

    train, _ = datasets.get_mnist()
    train = datasets.shard(train, comm.rank, comm.size)
    it = datasets.iterator(train, args.batchsize, comm.rank)
    updater = GANUpdater(it, gen, dis, opts['gen'], opts['dis'],
                         seed=comm.rank)
    trainer = training.Trainer(updater, (args.iterations, 'iteration'),
                               out=args.out)
    every = (max(1, args.iterations // 5), 'iteration')
    keys = ['iteration', 'gen/loss', 'dis/loss']
    for name in ('gen', 'dis'):
        if not args.communicator_per_model:
            keys.append(name + '/vgc/compression')
    if args.communicator_per_model:
        keys.append('vgc/compression')  # (one model per communicator)
    if comm.rank == 0:
        trainer.extend(extensions.LogReport(trigger=every))
        trainer.extend(extensions.PrintReport(keys), trigger=every)
    trainer.run()
    for opt in opts.values():
        opt.close()  # (double buffering: the last exchange completes)
    if comm.rank == 0:
        print('| model | exchanges | compression over the run |')
        print('|---|---:|---:|')
    for name, model in (('gen', gen), ('dis', dis)):
        totals = comms[name].state(model).totals
        per_rank = totals['elements'] / comm.size
        ratio = totals['param_elements'] / per_rank if per_rank else 0.0
        if comm.rank == 0:
            print('| {} | {:.0f} | {:.1f} |'.format(name, totals['steps'],
                                                    ratio))
    numpy.savez(os.path.join(args.out, 'params_rank{}.npz'.format(
        comm.rank)), **{'gen' + n: p.array for n, p in gen.namedparams()},
        **{'dis' + n: p.array for n, p in dis.namedparams()})


if __name__ == '__main__':
    main()
