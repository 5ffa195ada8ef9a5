"""Fashion-MNIST from Debian's package: the idx reader on files the test
writes itself, the search order, and the errors that name the fix."""

import gzip
import os
import struct

import chainer
import numpy
import pytest

from chainer_vgc.harness import datasets
from fashion_files import fake_package
from fashion_files import write_idx

# on both stacks (make test): its results depend on NumPy, the native
# build or the installed packages (docs/contributing.md)
pytestmark = pytest.mark.stack


@pytest.mark.parametrize('ndim', [1, 3])
def test_loads_what_was_written(tmp_path, ndim):
    arrays = fake_package(str(tmp_path))
    train, test = datasets.get_fashion_mnist(ndim=ndim, path=str(tmp_path))
    for ds, (x, t) in zip((train, test), (arrays['train'], arrays['test'])):
        assert len(ds) == len(t)
        got_x, got_t = chainer.dataset.concat_examples(ds[:])
        assert got_x.dtype == numpy.float32 and got_t.dtype == numpy.int32
        shape = (784,) if ndim == 1 else (1, 28, 28)
        assert got_x.shape == (len(t),) + shape
        # pixel / 255, in the file's row-major order
        assert numpy.array_equal(got_x.reshape(len(t), 28, 28) * 255,
                                 x.astype(numpy.float32))
        assert got_t.tolist() == t.tolist()
    assert train[0][0].max() <= 1.0


def test_search_order_env_then_system_then_cache(tmp_path, monkeypatch):
    """$CHAINER_VGC_FASHION_MNIST first; the cache root below
    $XDG_CACHE_HOME holds a `dpkg-deb -x` of the package."""
    monkeypatch.delenv(datasets.FASHION_ENV, raising=False)
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'cache'))
    root = datasets.fashion_cache_root()
    assert root == str(tmp_path / 'cache' / 'chainer_vgc' / 'fashion-mnist')
    dirs = datasets.fashion_mnist_dirs()
    assert dirs[0] == datasets.FASHION_SYSTEM_DIR
    if datasets.fashion_mnist_path() == datasets.FASHION_SYSTEM_DIR:
        pytest.skip('the package is installed system-wide here')
    assert datasets.fashion_mnist_path() is None
    extracted = root + datasets.FASHION_SYSTEM_DIR
    fake_package(extracted, seed=1)
    assert datasets.fashion_mnist_path() == extracted
    own = str(tmp_path / 'own')
    fake_package(own, n_train=2, n_test=1, seed=2)
    monkeypatch.setenv(datasets.FASHION_ENV, own)
    assert datasets.fashion_mnist_path() == own
    train, test = datasets.get_fashion_mnist()
    assert (len(train), len(test)) == (2, 1)


def test_missing_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.delenv(datasets.FASHION_ENV, raising=False)
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path))
    monkeypatch.setattr(datasets, 'FASHION_SYSTEM_DIR',
                        str(tmp_path / 'nowhere'))
    with pytest.raises(RuntimeError) as e:
        datasets.get_fashion_mnist()
    text = str(e.value)
    assert 'apt-get install dataset-fashion-mnist' in text
    assert 'dpkg-deb -x' in text and datasets.fashion_cache_root() in text
    assert datasets.FASHION_ENV in text


@pytest.mark.parametrize('fault', ['magic', 'truncated', 'extra', 'header',
                                   'count', 'label'])
def test_corrupt_files_are_refused_by_name(tmp_path, fault):
    root = str(tmp_path)
    fake_package(root)
    images, labels = datasets.FASHION_FILES['test']
    x = numpy.zeros((3, 28, 28), numpy.uint8)
    if fault == 'magic':
        write_idx(os.path.join(root, images), x, magic=0x801)
        match = 'magic 0x801, expected 0x803'
    elif fault == 'truncated':
        with gzip.open(os.path.join(root, images), 'wb') as f:
            f.write(struct.pack('>4I', 0x803, 3, 28, 28) + b'\0' * 100)
        match = 'truncated or corrupt'
    elif fault == 'extra':
        write_idx(os.path.join(root, images), x, extra=b'\0')
        match = 'truncated or corrupt'
    elif fault == 'header':
        with gzip.open(os.path.join(root, labels), 'wb') as f:
            f.write(b'\0\0\x08')
        match = 'shorter than the idx header'
    elif fault == 'count':
        write_idx(os.path.join(root, labels), numpy.zeros(2, numpy.uint8))
        match = '3 images .* 2 labels'
    else:
        write_idx(os.path.join(root, labels), [1, 10, 2])
        match = 'label 10 outside 0..9'
    with pytest.raises(ValueError, match=match) as e:
        datasets.get_fashion_mnist(path=root)
    assert root in str(e.value)
