"""FMT_GAP's restart table (issue 25; docs/wire_format.md Sec. 4.5): where
can a decoder start in a gap stream without reading the codes before it?

Every :data:`.GAP_RESTART_CODES` codes a FMT_GAP body records the bit
where the next code starts and the index of the element before it, so the
GPU decodes the blocks of a group in parallel, one thread each
(:mod:`chainer_vgc.engines.cuda.decode`).  The values are fixed by the codes:
the encoding stays canonical, and every decoder checks each point when it
reaches it (rule V26).
"""

import numpy

from chainer_vgc.codec.constants import GAP_RESTART_CODES


def gap_restarts(count):
    """Restart points of a FMT_GAP group of ``count`` elements: one every
    :data:`.GAP_RESTART_CODES` codes after the first block."""
    count = int(count)
    return (count - 1) // GAP_RESTART_CODES if count > 0 else 0


def restart_table(starts, index):
    """The restart table (uint32 words) of codes starting at bits
    ``starts`` for the sorted ``index``: restart m (1 ..
    :func:`gap_restarts`) is ``[bit, bit >> 32, i, i >> 32]``, ``bit`` where
    code ``m * GAP_RESTART_CODES`` starts, ``i`` the index before it."""
    at = numpy.arange(1, gap_restarts(len(index)) + 1) * GAP_RESTART_CODES
    bits = numpy.asarray(starts, dtype=numpy.int64)[at].astype(numpy.uint64)
    prev = numpy.asarray(index, dtype=numpy.int64)[at - 1].astype(
        numpy.uint64)
    table = numpy.stack([bits, prev], axis=1)  # uint64 pairs
    return table.astype('<u8').view('<u4').astype(numpy.uint32).reshape(-1)
