"""Codec: quantization (Sec. 4.2, 4.4), packing into 32-bit words, unpacking.

Wire message (a 1-D ``uint32`` array, little-endian words)::

    MAGIC, n_groups, group_0, group_1, ...

Only tensors that send something are in a group (one group per tensor,
except that a FMT_GAP group may span several consecutive tensors).  Each
group is a 5-word header ``tensor_id, format, count, a, b`` followed by a
body whose length follows from the header (FMT_GAP: and its first two body
words).  The formats are the entries of :data:`FORMATS` (one
:class:`WireFormat` each: code, meaning of ``a`` and ``b``, body length,
header checks, checked decoder, unchecked device decoder):

``FMT_POW2`` (VGC quantization, Strom, hybrid)
    ``a`` = e_k (int32), ``b`` = float32 bits of ``scale``; body: ``count``
    words ``sign(1) | d(3) | index(28)``.  Element value =
    ``sign * scale * 2**(e_k - d)`` (VGC: scale 1; Strom/hybrid: e_k 0,
    d 0, scale tau).  This is the paper's one word per element; the 28-bit
    index limits a tensor to 2**28 elements.
``FMT_RAW`` (quantization off, ``none``)
    ``a`` = flags (bit 0: dense, no index words; bit 1: float64 values);
    body: ``count`` index words (unless dense), then the values as float32
    (1 word) or float64 (2 words, copied out on decode for alignment).
``FMT_QSGD``
    ``a`` = number of bucket records, ``b`` = ``levels << 24 | bucket_size``;
    body: records ``bucket_id, count, float64 scale`` then ``count`` words
    ``sign(1) | level(8) | offset-in-bucket(23)``; value =
    ``sign * level * scale``.
``FMT_GAP`` (the elements of ``FMT_POW2``, indices gap-coded; beyond the
    paper)
    ``a``, ``b`` as ``FMT_POW2``; body: a param word (bits 0-5: the Rice
    parameter k; bit 6, :data:`GAP_SIGN_ONLY`: one value bit, the sign,
    and d = 0; bit 7, :data:`GAP_RESTARTS`: a restart table follows;
    bits 8-31: the span, the number of tensors after ``tensor_id`` the
    group also covers, in one index space, their concatenation, see
    :func:`merge_spans`), ``G``, the restart table (more than
    :data:`GAP_RESTART_CODES` elements: where a decoder can start), then
    ``G`` words of gap codes, then the values, ``ceil(count * vbits / 32)`` words of 4-bit fields
    ``sign << 3 | d`` (the top 4 bits of the ``FMT_POW2`` word) or 1-bit
    signs.  Bit strings are LSB-first: bit p is ``(w[p >> 5] >> (p & 31))
    & 1``.  Gap j is ``i_j - i_{j-1} - 1`` (``i_{-1} = -1``), coded with
    ``q = gap >> k``: q zeros and a one (q < :data:`GAP_ESCAPE`), or
    GAP_ESCAPE zeros then the Elias-gamma code of ``q - GAP_ESCAPE + 1``
    (n zeros, a one, the n bits below its top bit); then the k low bits of
    the gap.  ``G`` is exactly the words the codes fill, padding bits are
    0: for given k, value width and span, the elements have one encoding
    (:func:`gap_body`).  No limit on the tensor size; at most 2**32 - 1
    elements per group.
``FMT_SPARSE`` (unquantized values at gap-coded indices: ``dgc``)
    ``a`` = x (int32), ``b`` = flags (bit 0, :data:`SPARSE_FLOAT32`:
    float32 values, else float16); body: FMT_GAP's param word (no
    SIGN_ONLY, no span), ``G``, the restart table and the ``G`` words of
    gap codes, then the values, two float16 a word or one float32; value
    = the wire value times ``2**x`` in the state dtype.

:func:`unpack` checks every field against the receiving model (tensor ids,
counts, body lengths, exponents and scales, indices in range and strictly
increasing, levels, and every value it would write finite in the receiving
state dtype: a finite float64 raw value or QSGD ``level * scale`` may
overflow float32) and raises :class:`WireFormatError` instead of reading out
of bounds or decoding garbage.

The constants the C++/CUDA sources also define (``#define VGC_...``) are
listed once, in :data:`C_CONSTANTS`; :func:`check_kernel_constants` compares
a source text with them, and the native backend compares its compiled ones.

Modules: :mod:`.constants` (the numbers, defined once), :mod:`.c_defines`
(their C names and the check of a C/CUDA source), :mod:`.header` (group
header, :class:`WireFormat`, :class:`WireFormatError`, shared checks), one
module per format (:mod:`.pow2` with the quantization, :mod:`.raw`,
:mod:`.qsgd`, :mod:`.gap` with its restart table in :mod:`.restarts`,
:mod:`.sparse`),
:mod:`.index_coding` (FMT_POW2 or FMT_GAP),
:mod:`.formats` (the table) and :mod:`.message` (pack, walk, unpack,
decode, spans).  This package imports the device layer below it
(:mod:`chainer_vgc.backends`: the array module, the kernels), which
imports no part of it; the engines that write and read its messages
(:mod:`chainer_vgc.engines`) stand above it.  It imports neither Chainer
nor MPI.
The names below are the package's interface (``chainer_vgc.codec.NAME``);
the modules' other public names (``message.walk``, ``gap.span_parts``, ...)
are imported from their module.
"""

from chainer_vgc.codec.c_defines import (  # NOQA: F401
    C_CONSTANTS, KERNEL_CONSTANTS, check_kernel_constants)
from chainer_vgc.codec.constants import (  # NOQA: F401
    CODINGS, FMT_GAP, FMT_INDEXED, FMT_POW2, FMT_QSGD, FMT_RAW, FMT_SPARSE,
    GAP_ESCAPE, SPARSE_FLOAT32,
    GAP_K_MASK, GAP_MAX_K, GAP_PARAM_WORDS, GAP_RESTARTS, GAP_RESTART_CODES,
    GAP_RESTART_WORDS, GAP_SIGN_ONLY, GAP_SPAN_SHIFT, HEADER_WORDS, INDEX_BITS, LOG2_ZERO, MAGIC, MAX_COUNT,
    MAX_D, MAX_GAP_SPAN, MAX_INDEX, MAX_QSGD_BUCKET, MERGE_MAX_COUNT,
    QSGD_OFFSET_BITS, QSGD_RECORD_WORDS, RAW_DENSE, RAW_FLOAT64)
from chainer_vgc.codec.formats import (  # NOQA: F401
    FORMATS, INTERNAL_FORMATS)
from chainer_vgc.codec.gap import (  # NOQA: F401
    device_gap_body, gap_body, gap_code_lengths, gap_decode_body,
    rice_parameter)
from chainer_vgc.codec.header import (  # NOQA: F401
    Decoded, Group, WireFormat, WireFormatError)
from chainer_vgc.codec.restarts import gap_restarts  # NOQA: F401
from chainer_vgc.codec.index_coding import (  # NOQA: F401
    pow2_best_group, pow2_max_words, pow2_sign_group)
from chainer_vgc.codec.message import (  # NOQA: F401
    add_validated, decode_into, expand_gap, merge_spans, message_count,
    name_the_fault, pack, unpack)
from chainer_vgc.codec.pow2 import (  # NOQA: F401
    floor_log2, pow2_decode, pow2_encode, pow2_group, pow2_table,
    wire_scale)
from chainer_vgc.codec.qsgd import qsgd_group  # NOQA: F401
from chainer_vgc.codec.raw import raw_group  # NOQA: F401
from chainer_vgc.codec.sparse import (  # NOQA: F401
    sparse_group, sparse_max_words)
