"""The wire format's numbers: magic word, format codes, field widths,
FMT_GAP parameters, limits.  Defined here once; :mod:`.c_defines` lists the
ones the C++/CUDA sources ``#define`` as well."""

MAGIC = 0x31434756  # b'VGC1' read as a little-endian uint32
FMT_POW2 = 1
FMT_RAW = 2
FMT_QSGD = 3
HEADER_WORDS = 5

INDEX_BITS = 28
MAX_INDEX = 1 << INDEX_BITS  # elements per tensor in FMT_POW2
MAX_D = 7
RAW_DENSE = 1
RAW_FLOAT64 = 2
QSGD_OFFSET_BITS = 23
MAX_QSGD_BUCKET = 1 << QSGD_OFFSET_BITS
QSGD_RECORD_WORDS = 4  # bucket id, count, float64 scale
FMT_GAP = 4
GAP_PARAM_WORDS = 2  # param word (k, flags), gap-stream length
GAP_K_MASK = 0x3F
GAP_SIGN_ONLY = 1 << 6  # param flag: one value bit (the sign), d = 0
#: param bit 7: the body has a restart table, set exactly when count >
#: GAP_RESTART_CODES (issue 25; reserved, so 0, before it)
GAP_RESTARTS = 1 << 7
GAP_SPAN_SHIFT = 8  # param bits 8-31: further tensors the group covers
MAX_GAP_SPAN = (1 << 24) - 1
#: groups of more elements are never merged into spans (their 7-word
#: overhead is under 0.25 bit an element; re-encoding them would cost more
#: time than it saves wire)
MERGE_MAX_COUNT = 1024
GAP_ESCAPE = 16  # unary zeros before the Elias-gamma escape
#: a FMT_GAP body has a restart point every GAP_RESTART_CODES codes (the
#: bit where code m * GAP_RESTART_CODES starts and the index before it,
#: two uint64 in GAP_RESTART_WORDS words), so that a decoder may start at
#: any of them: the device decodes the blocks in parallel (issue 25)
GAP_RESTART_CODES = 1024
GAP_RESTART_WORDS = 4
GAP_MAX_K = 62
MAX_COUNT = (1 << 32) - 1  # the header's count is one word
#: unquantized values at gap-coded indices (top-k methods: dgc); ``b``
#: flag SPARSE_FLOAT32: float32 values, else float16
FMT_SPARSE = 5
SPARSE_FLOAT32 = 1
#: index codings of the pow2 elements (``index_coding`` of vgc, hybrid,
#: strom); the native backend takes the position in this tuple
CODINGS = ('auto', 'fixed', 'gap')
LOG2_ZERO = -(1 << 30)  # same sentinel as VGC_LOG2_ZERO in the kernels

#: FMT_GAP groups as the GPU decoder receives them
#: (:func:`.expand_gap`): never sent, refused on
#: the wire
FMT_INDEXED = 0x100 | FMT_GAP
