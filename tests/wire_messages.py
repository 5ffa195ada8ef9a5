"""Random valid wire messages of every format, for the codec and native
decoder tests (built with the codec's group builders, not the compressor)."""

import numpy

from chainer_vgc import codec


def random_message(rng, sizes, pow2_scale=1.0):
    """(message, groups): for each tensor, at random, no group or a group of
    FMT_POW2, sparse FMT_RAW (float64), dense FMT_RAW (float32) or
    FMT_QSGD (bucket 3, 3 levels)."""
    groups = []
    for tid, size in enumerate(sizes):
        kind = rng.integers(0, 5)
        if kind == 0 or size == 0:
            continue
        n = int(rng.integers(1, size + 1))
        index = numpy.sort(rng.choice(size, n, replace=False))
        if kind == 1:
            vals = rng.normal(size=n).astype(numpy.float32)
            e_k = codec.floor_log2(numpy.abs(vals).max())
            words, ok = codec.pow2_encode(vals, index, e_k)
            if ok.any():
                groups.append(codec.pow2_group(tid, words[ok], e_k,
                                               pow2_scale))
        elif kind == 2:
            groups.append(codec.raw_group(tid, index, rng.normal(size=n),
                                          size))
        elif kind == 3:
            groups.append(codec.raw_group(
                tid, None, rng.normal(size=size).astype(numpy.float32), size))
        else:
            level = rng.integers(0, 4, size=size)
            if level.any():
                groups.append(codec.qsgd_group(
                    tid, level, rng.random(size) < 0.5,
                    rng.random(-(-size // 3)).astype(numpy.float32), 3, 3))
    return codec.pack(groups), groups
