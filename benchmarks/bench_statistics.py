#!/usr/bin/env python
"""Training-step time and peak memory with per-sample statistics vs without.

One step = forward, backward, update; the statistics step uses
``PerSampleSquares.backward`` in place of ``loss.backward``; a third kind
is the statistics step with Chainer's own weight gradients
(``fused_weight_gradient=False``: on the CPU the default takes a
convolution's gradient from the statistics' products).  The kinds of step
alternate, so all see the same machine state; the medians, the ratios and
the extra peak memory of the statistics step are printed, one row per
model:

* ``mlp``: the demo's MLP (784-200-200-10, batch 32, ``make demo``);
* ``vgg``: the App. D VGG at the Fashion-MNIST grid's setting (width 1/8,
  28x28x1 input, no dropout, batch 32);
* ``vgg-full``: the App. D VGG at full width, batch 64, 28x28x1 (the GPU
  runbook's setting);
* ``vgg-cifar``: the App. D VGG at full width with its dropout, batch 16
  of 32x32x3 (the shape of ChainerMN's CIFAR example's VGG);
* ``resnet50``: ``BottleneckResNet``, ResNet-50's shape (bottleneck
  blocks, batch normalization everywhere, stride-2 1x1 projections),
  batch 4 of 224x224x3, 1000 classes (ChainerMN's ImageNet example);
* ``seq2seq``: ``Seq2seq``, ChainerMN's seq2seq example's shape (EmbedID
  over concatenated sentences, 3-layer NStepLSTM encoder and decoder with
  dropout, the projection over every token) at 256 units, batch 64 of
  sentence pairs of 2..30 words from 1,000 (its minibatch: the flat tuple
  of that example's converter, ``examples=sentence_pairs``);
* ``transformer``: ``Transformer``, ``examples/train_transformer.py``'s
  encoder-decoder (LayerNorm, a tied embedding, a positional embedding
  added by broadcast), batch 16 of padded sentence pairs;
* ``dcgan``: a DCGAN-shaped generator (Linear, three stride-2
  Deconvolution2D with BatchNormalization) and discriminator (seven
  Convolution2D with BatchNormalization), updated in turn as in ChainerMN's
  DCGAN example, batch 16 of 32x32x3; the statistics step computes both
  models' statistics.

Under ``mpiexec -n P`` every rank runs the same steps on its own data with
a barrier before each, and the slowest rank's time counts (``make bench``
runs it at P = 2, one BLAS thread each: a rank of a 2-rank job on the
2-core machine).  ``--device @cupy:0`` runs on a GPU: steps are timed
to the device's synchronisation, and memory is what CuPy's pool hands out.

Peak memory, measured in steps of their own after the timed ones (a
tracer slows the step it watches): on the CPU tracemalloc's peak (it
sees NumPy's buffers) over the step, less the memory held before it; the
statistics' workspace (buffers kept from step to step,
``PerSampleSquares.work``) is printed beside it and counted in the extra
memory.
"""

import argparse
import os
import time
import tracemalloc

import chainer
import chainer.functions as F
import numpy

from chainer_vgc.harness.models import BottleneckResNet
from chainer_vgc.harness.models import DCGANDiscriminator
from chainer_vgc.harness.models import DCGANGenerator
from chainer_vgc.harness.models import MLP
from chainer_vgc.harness.models import Seq2seq
from chainer_vgc.harness.models import Transformer
from chainer_vgc.harness.models import padded_pairs_task
from chainer_vgc.harness.models import sentence_pairs_task
from chainer_vgc.harness.models import VGG
from chainer_vgc.statistics import DEFAULT_MAX_MEMORY
from chainer_vgc.statistics import PerSampleSquares
from chainer_vgc.statistics.rows import sentence_pairs

from bench_common import machine

MODELS = ('mlp', 'vgg', 'vgg-full', 'vgg-cifar', 'resnet50', 'seq2seq',
          'dcgan', 'transformer')


class _Classifier(object):
    """One network trained on labelled generated data."""

    def __init__(self, net, x, t, device, max_memory):
        self.net = net
        net.to_device(device)
        self.x, self.t = device.send(x), device.send(t)
        self.opt = chainer.optimizers.MomentumSGD(lr=0.01)
        self.opt.setup(net)
        net(self.x)  # shapes of lazily built links
        self.stats = PerSampleSquares(net, max_memory=max_memory)
        self.nets = [net]

    def step(self, with_stats):
        self.net.cleargrads()
        loss = F.softmax_cross_entropy(self.net(self.x), self.t)
        if with_stats:
            self.stats.backward(loss, batch=(self.x, self.t))
        else:
            loss.backward()
        self.opt.update()


class _Sentences(object):
    """The seq2seq model on the flat tuple of ChainerMN's converter."""

    def __init__(self, batch, device, max_memory, rng):
        self.net = Seq2seq(3, 1000, 1000, 256)
        self.net.to_device(device)
        self.nets = [self.net]
        pairs = sentence_pairs_task(batch, 1000, 30,
                                    int(rng.integers(1 << 30)))
        self.sentences = tuple(device.send(x) for x, _ in pairs) + tuple(
            device.send(y) for _, y in pairs)
        self.opt = chainer.optimizers.Adam()
        self.opt.setup(self.net)
        self.stats = PerSampleSquares(self.net, max_memory=max_memory,
                                      examples=sentence_pairs)

    def step(self, with_stats):
        self.net.cleargrads()
        if with_stats:
            with self.stats.forward(self.sentences) as batch:
                loss = self.net(*self.sentences)
            self.stats.backward(loss, batch=batch)
        else:
            self.net(*self.sentences).backward()
        self.opt.update()


class _Tokens(object):
    """``examples/train_transformer.py``'s Transformer on padded blocks of
    sentence pairs (its default shape: 2 layers each side, d = 64, 4
    heads, batch 16 of up to 10 tokens, dropout 0.1)."""

    def __init__(self, batch, device, max_memory, rng):
        self.net = Transformer(40, d=64, heads=4, layers=2, max_length=10)
        self.net.to_device(device)
        self.nets = [self.net]
        source, target = padded_pairs_task(batch, 40, 10,
                                           int(rng.integers(1 << 30)))
        self.batch = (device.send(source), device.send(target))
        self.opt = chainer.optimizers.Adam()
        self.opt.setup(self.net)
        self.stats = PerSampleSquares(self.net, max_memory=max_memory)

    def step(self, with_stats):
        self.net.cleargrads()
        loss = self.net(*self.batch)
        if with_stats:
            self.stats.backward(loss, batch=self.batch)
        else:
            loss.backward()
        self.opt.update()


class _GAN(object):
    """The DCGAN updater's step: the discriminator on real and generated
    images, then the generator through the discriminator."""

    def __init__(self, batch, device, max_memory, rng):
        self.gen, self.dis = DCGANGenerator(), DCGANDiscriminator()
        self.nets = [self.dis, self.gen]  # in the order they are updated
        self.opts = []
        for net in self.nets:
            net.to_device(device)
            opt = chainer.optimizers.Adam(alpha=0.0002, beta1=0.5)
            opt.setup(net)
            self.opts.append(opt)
        self.stats = [PerSampleSquares(n, max_memory=max_memory)
                      for n in self.nets]
        self.real = device.send(rng.uniform(-1, 1, (batch, 3, 32, 32))
                                .astype(numpy.float32))
        self.z = device.send(self.gen.make_hidden(batch, rng))

    def step(self, with_stats):
        fake = self.gen(self.z)
        y_fake, y_real = self.dis(fake), self.dis(self.real)
        b = len(self.z)
        loss_dis = (F.sum(F.softplus(-y_real)) + F.sum(F.softplus(y_fake))) / b
        loss_gen = F.sum(F.softplus(-y_fake)) / b
        for k, (net, loss, batch) in enumerate((
                (self.dis, loss_dis, (self.real,)),
                (self.gen, loss_gen, (self.z,)))):
            net.cleargrads()
            if with_stats:
                self.stats[k].backward(loss, batch=batch)
            else:
                loss.backward()
            self.opts[k].update()
        fake.unchain_backward()


def build(name, device, max_memory, rng):
    if name == 'dcgan':
        return _GAN(16, device, max_memory, rng)
    if name == 'seq2seq':
        return _Sentences(64, device, max_memory, rng)
    if name == 'transformer':
        return _Tokens(16, device, max_memory, rng)
    n_class = 10
    if name == 'mlp':
        net, shape, b = MLP((200, 200), 10), (784,), 32
    elif name == 'vgg-cifar':
        net, shape, b = VGG(10, width=1.0, dropout=True), (3, 32, 32), 16
    elif name == 'resnet50':
        n_class = 1000
        net, shape, b = BottleneckResNet(n_class), (3, 224, 224), 4
    else:
        full = name == 'vgg-full'
        net = VGG(10, width=1.0 if full else 0.125, dropout=False)
        shape, b = (1, 28, 28), 64 if full else 32
    x = rng.normal(size=(b,) + shape).astype(numpy.float32)
    t = rng.integers(0, n_class, b).astype(numpy.int32)
    return _Classifier(net, x, t, device, max_memory)


class _HostMemory(object):
    """Peak bytes allocated over a call, beyond what was held before it."""

    def __enter__(self):
        tracemalloc.start()
        return self

    def measure(self, fn):
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base

    def __exit__(self, *exc):
        tracemalloc.stop()


class _DeviceMemory(object):
    """The same for CuPy's pool: bytes handed out, counted by a hook."""

    def __enter__(self):
        import cupy
        tracker = self

        class Hook(cupy.cuda.MemoryHook):
            name = 'bench_statistics_peak'

            def malloc_postprocess(self, device_id, size, mem_size,
                                   mem_ptr=0, pmem_id=0):
                tracker.used += mem_size
                tracker.peak = max(tracker.peak, tracker.used)

            def free_postprocess(self, device_id, mem_size, mem_ptr=0,
                                 pmem_id=0):
                tracker.used -= mem_size

        self.used = self.peak = 0
        self.hook = Hook()
        self.hook.__enter__()
        return self

    def measure(self, fn):
        self.peak = self.used
        base = self.used
        fn()
        return self.peak - base

    def __exit__(self, *exc):
        self.hook.__exit__(*exc)


#: steps of each kind whose peak memory is measured (after the timed ones)
PEAK_STEPS = 2


def run_model(name, args, device, comm):
    rng = numpy.random.default_rng(1 + (comm.rank if comm else 0))
    numpy.random.seed(0)
    model = build(name, device, args.max_memory, rng)
    on_gpu = device.xp is not numpy

    def sync():
        if on_gpu:
            device.device.synchronize()
        if comm is not None:
            comm.Barrier()

    hooks = model.stats if isinstance(model.stats, list) else [model.stats]
    modes = (False, True, 'chainer')

    def step(mode):
        for h in hooks:  # 'chainer': Chainer's own weight gradients
            if hasattr(h, 'fused_weight_gradient'):
                h.fused_weight_gradient = mode is True
        model.step(bool(mode))

    for mode in modes + modes:  # warm up every kind (and the pool)
        step(mode)
    sync()
    times = {m: [] for m in modes}
    for _ in range(args.steps):  # timed without the memory tracker
        for mode in modes:
            sync()
            t0 = time.perf_counter()
            step(mode)
            sync()
            spent = time.perf_counter() - t0
            if comm is not None:  # the slowest rank
                spent = max(comm.allgather(spent))
            times[mode].append(spent)
    # the peaks from steps of their own: tracemalloc slows every Python
    # allocation, and Chainer's graph is made of them (the Transformer's
    # steps took 7x as long under it, and the ratios were not the ones of
    # an untraced run)
    peaks = {m: 0 for m in modes}
    with (_DeviceMemory() if on_gpu else _HostMemory()) as memory:
        for _ in range(PEAK_STEPS):
            for mode in modes:
                sync()
                peak = memory.measure(lambda: step(mode) or sync())
                if comm is not None:  # the largest peak
                    peak = max(comm.allgather(peak))
                peaks[mode] = max(peaks[mode], peak)
    plain, stats, unfused = (float(numpy.median(times[m])) for m in modes)
    n_params = sum(p.size for net in model.nets for p in net.params())
    # (a package from before issue 26, timed for comparison, has none)
    work = sum(h.work.nbytes for h in hooks if hasattr(h, 'work'))
    if comm is not None:
        work = max(comm.allgather(work))
    return dict(model=name, params=n_params, plain=plain, stats=stats,
                ratio=stats / plain, unfused=unfused / plain,
                peak_plain=peaks[False],
                peak_stats=peaks[True], work=work,
                extra=max(0, peaks[True] - peaks[False]) + work)


def main():
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--model', choices=MODELS + ('all',), default='all')
    p.add_argument('--steps', type=int, default=5,
                   help='timed steps of each kind (median)')
    p.add_argument('--device', default='@numpy',
                   help="Chainer device specifier ('@cupy:0': GPU 0)")
    p.add_argument('--max-memory', type=int, default=DEFAULT_MAX_MEMORY)
    args = p.parse_args()
    comm = None
    if any(v in os.environ for v in ('PMI_RANK', 'OMPI_COMM_WORLD_RANK')):
        from mpi4py import MPI
        comm = MPI.COMM_WORLD if MPI.COMM_WORLD.size > 1 else None
    device = chainer.get_device(args.device)
    device.use()
    names = MODELS if args.model == 'all' else (args.model,)
    rows = [run_model(n, args, device, comm) for n in names]
    if comm is not None and comm.rank:
        return
    print('machine: {}, device {}, {} rank(s)'.format(
        machine(chainer=True), args.device, comm.size if comm else 1))
    print('median of {} steps of each kind, alternating; max_memory {} MiB'
          .format(args.steps, args.max_memory >> 20))
    print('| model | parameters | plain s | with statistics s | ratio | '
          "ratio with Chainer's weight gradients | "
          'step peak MiB plain | step peak MiB statistics | workspace MiB | '
          'extra MiB |')
    print('|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|')
    for r in rows:
        print('| {model} | {params:,} | {plain:.4f} | {stats:.4f} | '
              '{ratio:.2f} | {unfused:.2f} | {pp:.1f} | {ps:.1f} | '
              '{w:.1f} | {ex:.1f} |'
              .format(pp=r['peak_plain'] / 2 ** 20,
                      ps=r['peak_stats'] / 2 ** 20, w=r['work'] / 2 ** 20,
                      ex=r['extra'] / 2 ** 20, **r))
    print("ratio with Chainer's weight gradients: the statistics step "
          'with PerSampleSquares(fused_weight_gradient=False), timed in '
          'turn with the other two')
    print('extra = the workspace the statistics keep from step to step + '
          'how much higher the statistics step\'s peak is than the plain '
          "step's")


if __name__ == '__main__':
    main()
