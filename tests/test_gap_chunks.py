"""The native FMT_GAP encoder split over chunks (``vgc_emit`` in
``kernels/vgc_gap_coder.h``): each chunk counts its code bits in 32-bit
lanes (escapes corrected block by block), writes its codes with the
branch-free writer and packs its value fields a word at a time; the words
it shares with its neighbours are joined afterwards.  These tests place
the elements where those paths meet (escapes, chunk edges, value words
split between chunks, Rice parameters on both sides of 16) and compare
every message with the NumPy reference, bit for bit, at 1 to 5 chunks.
"""

import numpy
import pytest

from chainer_vgc import GradientCompressor
from chainer_vgc import codec
from chainer_vgc.engines.native import bindings

# on both stacks (make test): its results depend on NumPy, the native
# build or the installed packages (docs/contributing.md)
pytestmark = pytest.mark.stack

@pytest.fixture(params=[1, 3, 5])
def chunks(request):
    before = bindings.num_threads()
    bindings.set_num_threads(request.param)
    yield request.param
    bindings.set_num_threads(before)


def chunk_starts(n, t):
    """Where vgc_plan starts the chunks of a tensor of n elements split
    over t threads (64-byte aligned)."""
    per = -(-n // t)
    per = (per + 15) & ~15
    return [min(n, k * per) for k in range(t)]


def selection(pattern, n, t, rng):
    """Boolean mask of the elements to send."""
    pick = numpy.zeros(n, bool)
    if pattern == 'dense':  # k = 2, a few escapes
        pick = rng.random(n) < 0.12
    elif pattern == 'medium':  # k = 4: codes put two or four at a time
        pick = rng.random(n) < 0.03
    elif pattern == 'clustered':  # runs, then gaps that escape
        for start in range(7, n, 5003):
            pick[start:start + 50] = True
    elif pattern == 'edges':  # every chunk edge, each side, at 30 %
        pick = rng.random(n) < 0.3
        for s in chunk_starts(n, t):
            pick[max(s - 2, 0):s + 2] = True
        pick[-1] = True
    elif pattern == 'sparse':  # k = 18: inner codes of 19 + q bits
        per = chunk_starts(n, t)[1] if t > 1 else n
        pick[[3, 4, 1000, 2 ** 19 + 1, per - 1, min(per + 1, n - 1)]] = True
    elif pattern == 'wide-k':  # k = 17, a unary code of 33 bits
        pick[[5, 6, 7, 2000008, 2000009, 2000010, 3000000, 3000001, 3500000,
              3900000, 3999000, n - 1]] = True
    return pick


SIZES = {'dense': 300007, 'medium': 300007, 'clustered': 300007,
         'edges': 300007,
         'sparse': 4000037, 'wide-k': 4000037}


@pytest.mark.parametrize('pattern', sorted(SIZES))
@pytest.mark.parametrize('method', ['vgc', 'strom'])
def test_chunked_gap_encoding_matches_numpy(pattern, method, chunks):
    n = SIZES[pattern]
    rng = numpy.random.default_rng(len(pattern) * 7 + chunks)
    pick = selection(pattern, n, chunks, rng)
    g = numpy.zeros(n, numpy.float32)
    # magnitudes 2**-4 .. 2**3 (every d of the value table), both signs
    g[pick] = (rng.choice([-1.0, 1.0], int(pick.sum()))
               * 2.0 ** rng.integers(-4, 4, int(pick.sum())))
    kw = dict(alpha=1.0) if method == 'vgc' else dict(tau=1e-3)
    comps = [GradientCompressor(method, ['w'], [(n,)], [numpy.float32],
                                backend=b, index_coding='gap', **kw)
             for b in ('numpy', 'native')]
    sq = [numpy.zeros(n, numpy.float32)] if method == 'vgc' else None
    ref, got = (c.compress([g], sq) for c in comps)
    assert comps[1].uses_native([None])
    assert comps[0].last_sent == comps[1].last_sent == int(pick.sum())
    assert int(ref[2 + 1]) == codec.FMT_GAP  # the group's format word
    assert ref.dtype == got.dtype and numpy.array_equal(ref, got), (
        pattern, method, chunks)
    # and the body decodes back to the selection
    (part,) = [d for d in codec.unpack(got, [n], [numpy.float32])]
    assert numpy.array_equal(part.index, numpy.flatnonzero(pick))


def test_patterns_reach_the_paths_they_name():
    """The Rice parameters and escapes the patterns above are for."""
    rng = numpy.random.default_rng(0)
    for pattern, want_k in (('dense', 2), ('medium', 4), ('sparse', 18),
                            ('wide-k', 17)):
        pick = selection(pattern, SIZES[pattern], 3, rng)
        assert codec.rice_parameter(pick.sum(), pick.size) == want_k, pattern
    q = (numpy.diff(numpy.flatnonzero(pick)) - 1) >> 17
    assert ((q < codec.GAP_ESCAPE) & (q + 1 + 17 > 32)).any()  # wide-k
    pick = selection('clustered', SIZES['clustered'], 3, rng)
    k = codec.rice_parameter(pick.sum(), pick.size)
    gaps = numpy.diff(numpy.flatnonzero(pick)) - 1
    assert (gaps >> k).max() >= codec.GAP_ESCAPE
