"""Fashion-MNIST's idx files, small, written by the tests themselves (the
format: big-endian magic 0x800 + ndim, the dimensions, the bytes)."""

import gzip
import os
import struct

import numpy

from chainer_vgc.harness import datasets


def write_idx(path, array, magic=None, extra=b''):
    """An idx file as the format defines it: big-endian magic 0x800 + ndim
    and dimensions, then the bytes (gzip when the name ends in .gz)."""
    array = numpy.asarray(array, dtype=numpy.uint8)
    head = struct.pack('>{}I'.format(1 + array.ndim),
                       magic if magic is not None else 0x800 + array.ndim,
                       *array.shape)
    data = head + array.tobytes() + extra
    opener = gzip.open if path.endswith('.gz') else open
    with opener(path, 'wb') as f:
        f.write(data)


def fake_package(root, n_train=5, n_test=3, seed=0):
    """The four files of the package, small, in ``root``; returns the
    arrays written."""
    rng = numpy.random.default_rng(seed)
    os.makedirs(root, exist_ok=True)
    arrays = {}
    for split, n in (('train', n_train), ('test', n_test)):
        x = rng.integers(0, 256, size=(n, 28, 28), dtype=numpy.uint8)
        t = rng.integers(0, 10, size=n, dtype=numpy.uint8)
        images, labels = datasets.FASHION_FILES[split]
        write_idx(os.path.join(root, images), x)
        write_idx(os.path.join(root, labels), t)
        arrays[split] = (x, t)
    return arrays
