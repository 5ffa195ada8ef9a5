"""Messages recorded before the issue-13 restructuring, to prove it changed
no byte on the wire, FMT_GAP messages recorded when issue 14 added it, and
FMT_GAP groups with restart tables recorded when issue 25 added them:
``python tests/golden_messages.py`` rewrites
``tests/data/golden_messages.npz`` (only ever on purpose, with a wire
change; it refuses to change a recorded message unless ``--force``);
``tests/test_golden.py`` compares every backend's messages with it."""

import os

import numpy

from chainer_vgc import GradientCompressor

PATH = os.path.join(os.path.dirname(__file__), 'data', 'golden_messages.npz')
SHAPES = [(33, 7), (5,), (0,), (200,), (4, 4, 3)]
DTYPES = [numpy.float16, numpy.float32, numpy.float32, numpy.float64,
          numpy.float32]
CASES = [
    # the paper's 32-bit words (index_coding='fixed'), unchanged since
    # before issue 13
    ('vgc', dict(alpha=1.0, index_coding='fixed')),
    ('vgc', dict(alpha=1.5, zeta=0.99, index_coding='fixed')),
    ('vgc', dict(alpha=1.0, keep_unrepresentable=True,
                 index_coding='fixed')),
    ('vgc', dict(alpha=2.0, quantize=False)),
    ('hybrid', dict(alpha=2.0, tau=0.05, index_coding='fixed')),
    ('strom', dict(tau=0.05, index_coding='fixed')),
    ('qsgd', dict(bits=3, bucket=16, seed=1)),
    ('none', {}),
    # FMT_GAP (issue 14), recorded when it was introduced (and again when
    # groups spanning tensors were added, codec.merge_spans); its
    # correctness is checked against an independent decoder in
    # tests/test_gap_format.py
    ('vgc', dict(alpha=1.0, index_coding='gap')),
    ('vgc', dict(alpha=1.5, zeta=0.99)),  # 'auto': per tensor and step
    ('hybrid', dict(alpha=2.0, tau=0.05, index_coding='gap')),
    ('strom', dict(tau=0.05)),
    # FMT_SPARSE (issue 51), recorded when it was introduced: dgc's top-k,
    # float16 values (clipped, warm-up) and float32 ones
    ('dgc', dict(density=0.2, clip_norm=5.0, density_warmup_steps=2)),
    ('dgc', dict(density=0.1, momentum_factor=0.0, value_dtype='float32')),
]
STEPS = 6
#: FMT_GAP groups of more than 1,024 elements, with the restart table of
#: issue 25, recorded when it was introduced (their own model: the cases
#: above keep their words)
RESTART_SHAPES = [(12000,), (3, 4000), (7,)]
RESTART_DTYPES = [numpy.float32, numpy.float16, numpy.float64]
RESTART_CASES = [
    ('vgc', dict(alpha=1.0, index_coding='gap')),
    ('vgc', dict(alpha=1.5, zeta=0.99)),
    ('hybrid', dict(alpha=2.0, tau=0.05, index_coding='gap')),
    ('strom', dict(tau=0.05)),
    ('dgc', dict(density=0.2)),
]


def stream(seed=7, shapes=SHAPES, dtypes=DTYPES):
    """Gradients with a wide dynamic range (some elements 2**-12 times the
    others, so that d > 7 occurs) and their per-sample squares."""
    rng = numpy.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        gs, ss = [], []
        for s, d in zip(shapes, dtypes):
            g = rng.normal(0, 1, s) * numpy.where(rng.random(s) < 0.3,
                                                  2.0 ** -12, 1.0)
            gs.append(g.astype(d))
            ss.append((g ** 2 * (1 + rng.random(s))).astype(d))
        out.append((gs, ss))
    return out


def messages(method, kw, backend, restarts=False):
    shapes, dtypes = ((RESTART_SHAPES, RESTART_DTYPES) if restarts
                      else (SHAPES, DTYPES))
    comp = GradientCompressor(method, list('abcde')[:len(shapes)], shapes,
                              dtypes, backend=backend, **kw)
    return [comp.compress(gs, ss).copy()
            for gs, ss in stream(shapes=shapes, dtypes=dtypes)]


def key(k, step, restarts=False):
    return '{}{}_step{}'.format('restart' if restarts else 'case', k, step)


def record(force=False):
    """Record the cases not yet in the file; a recorded message that would
    change is an error unless ``force``."""
    old = dict(numpy.load(PATH)) if os.path.exists(PATH) else {}
    arrays = {}
    runs = [(k, method, kw, False) for k, (method, kw) in enumerate(CASES)]
    runs += [(k, method, kw, True)
             for k, (method, kw) in enumerate(RESTART_CASES)]
    for k, method, kw, restarts in runs:
        for step, m in enumerate(messages(method, kw, 'numpy', restarts)):
            name = key(k, step, restarts)
            if (name in old and not numpy.array_equal(old[name], m)
                    and not force):
                raise SystemExit('{} ({} {}) would change; pass --force to '
                                 'rewrite it'.format(name, method, kw))
            arrays[name] = m
    numpy.savez_compressed(PATH, **arrays)


if __name__ == '__main__':
    import sys
    record(force='--force' in sys.argv[1:])
