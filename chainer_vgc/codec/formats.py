"""The table of wire formats: code -> :class:`~.header.WireFormat`, one
entry per format module (:mod:`chainer_vgc.codec.pow2`,
:mod:`chainer_vgc.codec.raw`, :mod:`chainer_vgc.codec.qsgd`,
:mod:`chainer_vgc.codec.gap`, :mod:`chainer_vgc.codec.sparse`)."""

import collections

from chainer_vgc.codec import gap
from chainer_vgc.codec import pow2
from chainer_vgc.codec import qsgd
from chainer_vgc.codec import raw
from chainer_vgc.codec import sparse

#: code -> :class:`~.header.WireFormat`
FORMATS = collections.OrderedDict(
    (f.code, f) for f in [pow2.FORMAT, raw.FORMAT, qsgd.FORMAT, gap.FORMAT,
                          sparse.FORMAT])

#: FMT_GAP groups as the GPU decoder receives them
#: (:func:`~.message.expand_gap`): never sent, refused on the wire
INTERNAL_FORMATS = {pow2.INDEXED_FORMAT.code: pow2.INDEXED_FORMAT}
