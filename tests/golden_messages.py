"""Messages recorded before the issue-13 restructuring, to prove it changed
no byte on the wire: ``python tests/golden_messages.py`` rewrites
``tests/data/golden_messages.npz`` (only ever on purpose, with a wire
change); ``tests/test_golden.py`` compares every backend's messages with
it."""

import os

import numpy

from chainer_vgc import GradientCompressor

PATH = os.path.join(os.path.dirname(__file__), 'data', 'golden_messages.npz')
SHAPES = [(33, 7), (5,), (0,), (200,), (4, 4, 3)]
DTYPES = [numpy.float16, numpy.float32, numpy.float32, numpy.float64,
          numpy.float32]
CASES = [
    ('vgc', dict(alpha=1.0)),
    ('vgc', dict(alpha=1.5, zeta=0.99)),
    ('vgc', dict(alpha=1.0, keep_unrepresentable=True)),
    ('vgc', dict(alpha=2.0, quantize=False)),
    ('hybrid', dict(alpha=2.0, tau=0.05)),
    ('strom', dict(tau=0.05)),
    ('qsgd', dict(bits=3, bucket=16, seed=1)),
    ('none', {}),
]
STEPS = 6


def stream(seed=7):
    """Gradients with a wide dynamic range (some elements 2**-12 times the
    others, so that d > 7 occurs) and their per-sample squares."""
    rng = numpy.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        gs, ss = [], []
        for s, d in zip(SHAPES, DTYPES):
            g = rng.normal(0, 1, s) * numpy.where(rng.random(s) < 0.3,
                                                   2.0 ** -12, 1.0)
            gs.append(g.astype(d))
            ss.append((g ** 2 * (1 + rng.random(s))).astype(d))
        out.append((gs, ss))
    return out


def messages(method, kw, backend):
    comp = GradientCompressor(method, list('abcde'), SHAPES, DTYPES,
                              backend=backend, **kw)
    return [comp.compress(gs, ss).copy() for gs, ss in stream()]


def key(k, step):
    return 'case{}_step{}'.format(k, step)


def record():
    arrays = {}
    for k, (method, kw) in enumerate(CASES):
        for step, m in enumerate(messages(method, kw, 'numpy')):
            arrays[key(k, step)] = m
    numpy.savez_compressed(PATH, **arrays)


if __name__ == '__main__':
    record()
