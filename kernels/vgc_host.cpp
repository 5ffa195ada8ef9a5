/*
 * chainer-vgc native CPU backend: the fused compress / decode passes, built
 * by the normal install (setup.py) into chainer_vgc/_vgc_native*.so and
 * driven from chainer_vgc/native.py through ctypes.
 *
 * Every per-element operation is a call into vgc_numerics.cuh, the source
 * the CuPy ElementwiseKernels are built from, so the GPU and the CPU run
 * the same arithmetic (compiled with -ffp-contract=off: no FMA, results
 * equal to the NumPy reference bit for bit; tests/test_native.py).
 *
 * Compress (one call per tensor, one rule):
 *   pass 1, parallel over contiguous chunks: accumulate r and v, criterion
 *     (eq. 4), decay, input checks (g finite, s finite and >= 0), overflow
 *     checks, max |r| of the selected elements (for e_k, Sec. 4.2); the
 *     selected elements are staged per chunk (index + value), nothing of the
 *     tensor's size is allocated.  The new r and v are written to *other*
 *     arrays (r_out, v_out) with non-temporal stores: one read of g, s, r, v
 *     and one write of r, v, and the caller keeps the old state untouched
 *     when any check fails (it swaps the arrays only on success).
 *   pass 2, parallel over chunks, over the selected elements only: quantize
 *     and encode (Sec. 4.2, App. B) into FMT_POW2 words, then either copy
 *     the words straight into the message buffer at prefix-summed offsets
 *     (FMT_POW2) or, by the index coding, write them gap-coded (FMT_GAP:
 *     serially, over the sent elements only; vgc_emit).  A chunk has at
 *     most 2**28 elements, so a staged word's low index bits and the
 *     chunk's start give the full index of any tensor size.
 * Decode: validate every message completely (the checks of codec.unpack,
 *   down to every value being finite in the state dtype it is written in;
 *   FMT_GAP bodies are decoded into per-call index / value-entry arrays
 *   then, a group spanning several tensors once over their concatenated
 *   index space, each tensor of the span getting its segment, local
 *   indices and a value table in its own state dtype), then per tensor
 *   zero the output and merge the p messages'
 *   sorted index lists, adding the contributions in rank order and
 *   applying the 1/p mean once; never a read or write out of bounds.
 */
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "vgc_numerics.cuh"

/* Wire-format constants of chainer_vgc/codec.py (checked by the tests). */
#define VGC_MAGIC 0x31434756u
#define VGC_FMT_POW2 1u
#define VGC_FMT_RAW 2u
#define VGC_FMT_QSGD 3u
#define VGC_HEADER_WORDS 5
#define VGC_RAW_DENSE 1u
#define VGC_RAW_FLOAT64 2u
#define VGC_QSGD_OFFSET_BITS 23
#define VGC_QSGD_RECORD_WORDS 4
#define VGC_FMT_GAP 4u
#define VGC_GAP_SIGN_ONLY 64u
#define VGC_GAP_PARAM_WORDS 2
/* FMT_GAP param word: bit 7 reserved, bits 8..31 the span (the tensors
 * after the group's first that the group also covers; docs: addendum v2) */
#define VGC_GAP_RESERVED 0x80u
#define VGC_GAP_SPAN_SHIFT 8

/* dtype codes shared with native.py */
enum { VGC_F16 = 0, VGC_F32 = 1, VGC_F64 = 2 };

/* flags reported by the compress functions */
enum {
    VGC_BAD_GRAD = 1,    /* NaN or Inf in g */
    VGC_BAD_SQSUM = 2,   /* NaN, Inf or negative in s */
    VGC_OVERFLOW_R = 4,  /* r not finite after the step */
    VGC_OVERFLOW_V = 8,  /* v not finite after the step */
    /* the group cannot be written: more than 2**32 - 1 elements, or a
     * tensor over 2**28 elements with coding 'fixed' (FMT_POW2) */
    VGC_UNENCODABLE = 16,
};

/* index codings of the compress functions (codec.CODINGS) */
enum { VGC_CODING_AUTO = 0, VGC_CODING_FIXED = 1, VGC_CODING_GAP = 2 };

/* elements below which a tensor is processed by one thread */
static const int64_t VGC_PARALLEL_MIN = 1 << 16;

static int vgc_threads = 0; /* 0: OpenMP's default (OMP_NUM_THREADS) */

/* ---- element access ---------------------------------------------------- */

typedef _Float16 vgc_half;

template <typename G, typename S> static inline S vgc_load(const G *p, int64_t i) {
    return (S)p[i];
}

template <typename S> static inline bool vgc_finite(S x) {
    typedef vgc_float_traits<S> T;
    return (vgc_bits(x) & T::EXP_MASK) != T::EXP_MASK;
}

template <typename S> static inline bool vgc_good_sqsum(S x) {
    return (x >= (S)0) & (x <= std::numeric_limits<S>::max());
}

/* Non-temporal store: the new state is not read again in this step, so it
 * bypasses the cache (no read-for-ownership of the destination). */
static inline void vgc_stream(float *p, float x) {
#if defined(__SSE2__)
    int i;
    memcpy(&i, &x, sizeof i);
    _mm_stream_si32((int *)p, i);
#else
    *p = x;
#endif
}

static inline void vgc_stream(double *p, double x) {
#if defined(__SSE2__) && defined(__x86_64__)
    long long i;
    memcpy(&i, &x, sizeof i);
    _mm_stream_si64((long long *)p, i);
#else
    *p = x;
#endif
}

static inline void vgc_fence() {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

static inline uint32_t vgc_f32_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static int vgc_nthreads() {
#ifdef _OPENMP
    return vgc_threads > 0 ? vgc_threads : omp_get_max_threads();
#else
    return 1;
#endif
}

/* ---- per-chunk staging (reused between calls) -------------------------- */

struct vgc_chunk {
    std::vector<uint32_t> words; /* index words (or final words) */
    std::vector<uint32_t> records; /* QSGD bucket records */
    /* staged r (and, keep_unrepresentable, v) of the selected elements,
     * in the state dtype */
    std::vector<float> fvalues, fvs;
    std::vector<double> dvalues, dvs;
    int64_t begin, end;
    int64_t count;    /* staged elements */
    int64_t out;      /* words this chunk contributes to the body */
    int64_t offset;   /* its position in the body */
    uint64_t maxbits; /* max |r| bits over selected elements */
    int flags;
    /* FMT_GAP emit (vgc_emit): the index before the chunk's first element
     * (the last of the non-empty chunks before it; -1 if none), its code
     * bits, where its codes and its values start in their sections, and
     * the words of the two sections it shares with its neighbours */
    int64_t gap_prev;
    uint64_t gap_bits, gap_start, value_start;
    uint64_t edge_word[4];
    int64_t tail_word[2];
    uint32_t edge_bits[4];
};

struct vgc_workspace {
    std::vector<vgc_chunk> chunks;
};

/* Elements per chunk at most: a staged word keeps the low 28 bits of an
 * index (FMT_POW2 words, sign words) or its low 32 bits, and the full
 * index is its chunk's start plus the offset they give (vgc_full_index). */
static const int64_t VGC_CHUNK_MAX = (int64_t)VGC_INDEX_MASK + 1;

static void vgc_plan(vgc_workspace *ws, int64_t n) {
    int t = n >= VGC_PARALLEL_MIN ? vgc_nthreads() : 1;
    if (t < 1) t = 1;
    if ((n + t - 1) / t > VGC_CHUNK_MAX)
        t = (int)((n + VGC_CHUNK_MAX - 1) / VGC_CHUNK_MAX);
    ws->chunks.resize(t);
    int64_t per = (n + t - 1) / t;
    per = (per + 15) & ~(int64_t)15; /* 64-byte aligned chunk starts */
    for (int k = 0; k < t; ++k) {
        vgc_chunk &c = ws->chunks[k];
        c.begin = std::min(n, k * per);
        c.end = std::min(n, c.begin + per);
        c.count = c.out = c.offset = 0;
        c.maxbits = 0;
        c.flags = 0;
    }
}

/* Runs body(chunk) for every chunk, in parallel when there are several. */
template <typename F> static void vgc_for_chunks(vgc_workspace *ws, F body) {
    int t = (int)ws->chunks.size();
#ifdef _OPENMP
    int nt = std::min(t, std::max(1, vgc_nthreads()));
#pragma omp parallel for num_threads(nt) schedule(static, 1) if (t > 1)
#endif
    for (int k = 0; k < t; ++k) body(ws->chunks[k]);
}

static int vgc_flags(vgc_workspace *ws) {
    int f = 0;
    for (size_t k = 0; k < ws->chunks.size(); ++k) f |= ws->chunks[k].flags;
    return f;
}

/* Body offsets from the chunks' word counts; returns the total. */
static int64_t vgc_offsets(vgc_workspace *ws) {
    int64_t total = 0;
    for (size_t k = 0; k < ws->chunks.size(); ++k) {
        ws->chunks[k].offset = total;
        total += ws->chunks[k].out;
    }
    return total;
}

static void vgc_header(uint32_t *out, int tid, uint32_t fmt, int64_t count,
                       uint32_t a, uint32_t b) {
    out[0] = (uint32_t)tid;
    out[1] = fmt;
    out[2] = (uint32_t)count;
    out[3] = a;
    out[4] = b;
}

/* ---- FMT_GAP: gap-coded indices (codec.gap_body, docs: issue 14) ------- */

/* The Rice parameter of codec.rice_parameter (integers only):
 * t = 11 (size - count) // (16 count), k = floor(log2 t) (0 if t < 1),
 * at most 62. */
static int vgc_rice_parameter(int64_t count, int64_t size) {
    if (count <= 0 || size <= count) return 0;
    unsigned __int128 num = (unsigned __int128)11 * (uint64_t)(size - count);
    unsigned __int128 den = (unsigned __int128)16 * (uint64_t)count;
    uint64_t t = (uint64_t)(num / den);
    if (t < 1) return 0;
    int k = 63 - __builtin_clzll(t);
    return k < 62 ? k : 62;
}

/* LSB-first bit writer: fields go to increasing bit positions, from bit
 * `start` of the section at base.  It may write one part of a section that
 * several writers (the chunks of vgc_emit, in parallel) share: it stores
 * every word it fills completely except its first (word start / 32),
 * which, like its last partial word, can hold bits of a neighbour: those
 * two are kept (head, tail) for the caller to OR in (edges()); alone in
 * its section, store_edges() writes them. */
struct vgc_bit_writer {
    uint32_t *base;
    uint64_t first, wi; /* first word, word being filled */
    uint64_t acc;       /* pending bits, below nb */
    int nb;             /* 0..31 */
    uint32_t head;      /* the first word, once filled */
    vgc_bit_writer(uint32_t *dst, uint64_t start = 0)
        : base(dst), first(start >> 5), wi(start >> 5), acc(0),
          nb((int)(start & 31)), head(0) {}
    inline void flush() {
        const uint32_t w = (uint32_t)acc;
        if (wi == first)
            head = w;
        else
            base[wi] = w;
        ++wi;
        acc >>= 32;
        nb -= 32;
    }
    /* a field of len <= 32 bits holding x < 2**len */
    inline void put(uint64_t x, int len) {
        acc |= x << nb;
        nb += len;
        if (nb >= 32) flush();
    }
    /* a field of len <= 64 bits holding x (len < 64: x < 2**len) */
    inline void put_long(uint64_t x, int len) {
        if (len > 32) {
            put(x & 0xFFFFFFFFu, 32);
            put(x >> 32, len - 32);
        } else {
            put(x, len);
        }
    }
    inline void zeros(int len) {
        nb += len;
        while (nb >= 32) flush();
    }
    /* the code of one gap (k <= 63) */
    inline void code(uint64_t gap, int k) {
        const uint64_t q = gap >> k;
        const uint64_t low = k ? gap & (~0ull >> (64 - k)) : 0;
        if (q < VGC_GAP_ESCAPE) {
            const int ul = (int)q + 1;
            if (ul + k <= 32) {
                put((1ull << q) | (low << ul), ul + k);
                return;
            }
            put(1ull << q, ul);
        } else {
            const uint64_t v = q - VGC_GAP_ESCAPE + 1;
            const int n = 63 - __builtin_clzll(v);
            zeros(VGC_GAP_ESCAPE + n);
            put(1, 1);
            if (n) put_long(v & (~0ull >> (64 - n)), n);
        }
        if (k) put_long(low, k);
    }
    /* After the last field (when any bit was written): the shared words,
     * the first (always; its bits below start are 0) and, when the bits
     * end past it, the last partial one (tail_word < 0: none). */
    inline void edges(uint64_t *head_word, uint32_t *head_bits,
                      int64_t *tail_word, uint32_t *tail_bits) const {
        *head_word = first;
        *head_bits = head;
        *tail_word = -1;
        *tail_bits = 0;
        if (nb) {
            if (wi == first)
                *head_bits = (uint32_t)acc;
            else {
                *tail_word = (int64_t)wi;
                *tail_bits = (uint32_t)acc;
            }
        }
    }
    /* the writer alone in its section, from bit 0, some bit written */
    inline void store_edges() {
        uint64_t hw;
        int64_t tw;
        uint32_t hb, tb;
        edges(&hw, &hb, &tw, &tb);
        base[hw] = hb;
        if (tw >= 0) base[tw] = tb;
    }
};

/* Bits of the gap stream of the elements each(f) visits in index order
 * (f(index, nibble)). */
template <typename Each>
static uint64_t vgc_gap_stream_bits(Each each, int k) {
    uint64_t bits = 0;
    int64_t prev = -1;
    each([&](int64_t ix, uint32_t) {
        bits += (uint64_t)vgc_gap_code_length(ix - prev - 1, k);
        prev = ix;
    });
    return bits;
}

static inline int64_t vgc_gap_value_words(int64_t count, bool sign_only) {
    return (count * (sign_only ? 1 : 4) + 31) / 32;
}

/* Writes the FMT_GAP body (param word, G, gap stream, values) of the
 * elements each(f) visits; G = ceil(bits / 32).  Returns its words. */
template <typename Each>
static int64_t vgc_gap_write_body(Each each, int64_t count, uint64_t bits,
                                  int k, bool sign_only, uint32_t *body) {
    const int64_t G = (int64_t)((bits + 31) / 32);
    body[0] = (uint32_t)k | (sign_only ? VGC_GAP_SIGN_ONLY : 0u);
    body[1] = (uint32_t)G;
    vgc_bit_writer gaps(body + VGC_GAP_PARAM_WORDS);
    vgc_bit_writer values(body + VGC_GAP_PARAM_WORDS + G);
    int64_t prev = -1;
    each([&](int64_t ix, uint32_t nib) {
        gaps.code((uint64_t)(ix - prev - 1), k);
        prev = ix;
        if (sign_only)
            values.put(nib >> 3, 1);
        else
            values.put(nib, 4);
    });
    if (count) {
        gaps.store_edges();
        values.store_edges();
    }
    return VGC_GAP_PARAM_WORDS + G + vgc_gap_value_words(count, sign_only);
}

/* Bits pos..pos+31 of the stream s of G words (0 past its end). */
static inline uint32_t vgc_peek32(const uint32_t *s, int64_t G, uint64_t pos) {
    const uint64_t i = pos >> 5;
    const uint64_t lo = i < (uint64_t)G ? s[i] : 0;
    const uint64_t hi = i + 1 < (uint64_t)G ? s[i + 1] : 0;
    return (uint32_t)((lo | hi << 32) >> (pos & 31));
}

/* The field of n <= 64 bits at pos. */
static inline uint64_t vgc_read_bits(const uint32_t *s, int64_t G,
                                     uint64_t pos, int n) {
    if (n == 0) return 0;
    if (n <= 32) return vgc_peek32(s, G, pos) & (~0u >> (32 - n));
    return (uint64_t)vgc_peek32(s, G, pos) |
           (uint64_t)(vgc_peek32(s, G, pos + 32) & (~0u >> (64 - n))) << 32;
}

/* Decodes and checks a FMT_GAP body of exactly len words (the decoder
 * checks of the spec) over one index space of size elements (a group's
 * span_size): index[count] (strictly increasing, < size) and nib[count]
 * (sign << 3 | d; d = 0 for SIGN_ONLY).  The span (param bits 8..31) is
 * the caller's; only bit 7 is reserved here.  false: invalid. */
static bool vgc_gap_decode(const uint32_t *body, int64_t len, int64_t count,
                           int64_t size, int64_t *index, uint8_t *nib) {
    if (len < VGC_GAP_PARAM_WORDS || count < 0) return false;
    const uint32_t param = body[0];
    if (param & VGC_GAP_RESERVED) return false; /* reserved bit */
    const int k = (int)(param & 63);
    const bool sign_only = (param & VGC_GAP_SIGN_ONLY) != 0;
    const int64_t G = body[1], V = vgc_gap_value_words(count, sign_only);
    if (len != VGC_GAP_PARAM_WORDS + G + V) return false;
    if (count > 32 * G && count) return false; /* a code has >= 1 bit */
    const uint32_t *s = body + VGC_GAP_PARAM_WORDS;
    const uint64_t total = 32 * (uint64_t)G;
    /* value padding (cheap, before any decoding) */
    const uint32_t *v = s + G;
    const uint64_t vbits = (uint64_t)count * (sign_only ? 1 : 4);
    if ((vbits & 31) && (v[V - 1] >> (vbits & 31))) return false;
    uint64_t pos = 0;
    int64_t prev = -1;
    /* The stream through a 64-bit window: buf holds the bits from pos on,
     * avail of them loaded (the bits above are 0, as the stream's past
     * its end: once every word is loaded, avail is left large).  Codes
     * with q < ESC and k <= 16 (at most 32 bits) are decoded from the
     * window with their checks deferred: pos only grows and the indices
     * only grow (by less than 2**21 a code), so "no code read past the
     * stream" is pos <= total at the end and "no gap overran" is the last
     * index < size (every other code is decoded by the exact checks
     * below, the window reloaded after it). */
    const uint64_t lowmask = k ? ~0ull >> (64 - k) : 0;
    const bool fast = k <= 16 && size <= (int64_t)1 << 62; /* no overflow */
    const int VGC_WINDOW_END = 1 << 28;
    uint64_t buf = 0, wi = 0;
    int avail = 0;
    for (int64_t j = 0; j < count; ++j) {
        if (avail <= 32) {
            if (wi < (uint64_t)G) {
                buf |= (uint64_t)s[wi++] << avail;
                avail += 32;
            } else {
                avail = VGC_WINDOW_END;
            }
        }
        if (fast && (buf & ((1u << VGC_GAP_ESCAPE) - 1))) {
            const int z = __builtin_ctzll(buf);
            const uint64_t gap = ((uint64_t)z << k) | ((buf >> (z + 1)) & lowmask);
            const int used = z + 1 + k;
            buf >>= used;
            avail -= used;
            pos += used;
            prev += 1 + (int64_t)gap;
            index[j] = prev;
            continue;
        }
        /* gap < limit keeps the index below size */
        if (pos > total || prev + 1 >= size) return false;
        const uint64_t limit = (uint64_t)(size - prev - 1);
        const uint64_t qmax = (limit - 1) >> k;
        uint64_t q;
        const uint32_t w = vgc_peek32(s, G, pos);
        if (w & ((1u << VGC_GAP_ESCAPE) - 1)) { /* unary */
            const int z = __builtin_ctz(w);
            if (pos + z + 1 > total) return false;
            q = (uint64_t)z;
            pos += z + 1;
            if (q > qmax) return false;
        } else { /* escape, then Elias gamma */
            if (pos + VGC_GAP_ESCAPE > total) return false;
            pos += VGC_GAP_ESCAPE;
            int n = 0;
            for (;;) {
                if (pos + n >= total) return false;
                const uint32_t x = vgc_peek32(s, G, pos + n);
                if (x) {
                    n += __builtin_ctz(x);
                    break;
                }
                n += 32;
                if (n >= 64) return false;
            }
            if (n >= 64) return false;
            if (pos + 2 * (uint64_t)n + 1 > total) return false;
            const uint64_t v =
                (1ull << n) | vgc_read_bits(s, G, pos + n + 1, n);
            pos += 2 * (uint64_t)n + 1;
            if (qmax < VGC_GAP_ESCAPE || v > qmax - (VGC_GAP_ESCAPE - 1))
                return false;
            q = v + (VGC_GAP_ESCAPE - 1);
        }
        if (pos + k > total) return false;
        const uint64_t gap = (q << k) | vgc_read_bits(s, G, pos, k);
        pos += k;
        if (gap >= limit) return false; /* overruns the tensor */
        prev += 1 + (int64_t)gap;
        index[j] = prev;
        /* reload the window at pos (<= total) */
        wi = pos >> 5;
        if (wi < (uint64_t)G) {
            buf = (uint64_t)(s[wi++] >> (pos & 31));
            avail = 32 - (int)(pos & 31);
        } else {
            buf = 0;
            avail = VGC_WINDOW_END;
        }
    }
    if (pos > total || (count && prev >= size)) return false;
    /* canonical end: the last code ends in the last word, zeros after */
    if ((pos + 31) / 32 != (uint64_t)G) return false;
    if ((pos & 31) && (s[G - 1] >> (pos & 31))) return false;
    if (sign_only)
        for (int64_t j = 0; j < count; ++j)
            nib[j] = (uint8_t)(((v[j >> 5] >> (j & 31)) & 1u) << 3);
    else
        for (int64_t j = 0; j < count; ++j)
            nib[j] = (uint8_t)((v[j >> 3] >> (4 * (j & 7))) & 15u);
    return true;
}

/* The full index of a word a chunk staged: FMT_POW2 and sign words keep
 * the low 28 bits of the index, the chunk (at most 2**28 elements) its
 * start. */
static inline int64_t vgc_full_index(const vgc_chunk &c, uint32_t word) {
    return c.begin + (int64_t)((word - (uint32_t)c.begin) & VGC_INDEX_MASK);
}

/* The FMT_POW2 words the chunks staged (c.words[0..c.out), in index
 * order) as one group: FMT_POW2 (the words as they are) or FMT_GAP by
 * `coding` (VGC_CODING_*); e_k and scale in the header fields a and b.
 * Sets info = {words, elements, flags}; returns the words. */
static int64_t vgc_emit(vgc_workspace *ws, int tid, int64_t n, int coding,
                        bool sign_only, uint32_t a, uint32_t b, uint32_t *out,
                        int64_t *info) {
    const int64_t count = vgc_offsets(ws);
    info[0] = info[1] = 0;
    info[2] = vgc_flags(ws);
    if (count == 0) return 0;
    const bool large = n > (int64_t)VGC_INDEX_MASK + 1;
    if (count > (int64_t)0xFFFFFFFFu ||
        (large && coding == VGC_CODING_FIXED)) {
        info[2] |= VGC_UNENCODABLE;
        return 0;
    }
    uint32_t *body = out + VGC_HEADER_WORDS;
    bool gap = coding == VGC_CODING_GAP || large;
    const int k = vgc_rice_parameter(count, n);
    /* pass 1, parallel: each chunk's code bits, its first gap taken from
     * the last index of the non-empty chunks before it */
    uint64_t bits = 0;
    const size_t nc = ws->chunks.size();
    if (coding != VGC_CODING_FIXED) {
        int64_t prev = -1;
        for (size_t t = 0; t < nc; ++t) {
            vgc_chunk &c = ws->chunks[t];
            c.gap_prev = prev;
            if (c.out) prev = vgc_full_index(c, c.words[c.out - 1]);
        }
        vgc_for_chunks(ws, [&](vgc_chunk &c) {
            const uint32_t *w = c.words.data();
            uint64_t cb = 0;
            int64_t p = c.gap_prev;
            for (int64_t j = 0; j < c.out; ++j) {
                const int64_t ix = vgc_full_index(c, w[j]);
                cb += (uint64_t)vgc_gap_code_length(ix - p - 1, k);
                p = ix;
            }
            c.gap_bits = cb;
        });
        for (size_t t = 0; t < nc; ++t) {
            vgc_chunk &c = ws->chunks[t];
            c.gap_start = bits;
            bits += c.gap_bits;
        }
        const int64_t words = VGC_GAP_PARAM_WORDS +
                              (int64_t)((bits + 31) / 32) +
                              vgc_gap_value_words(count, sign_only);
        gap |= words < count;
        if (gap && (bits + 31) / 32 > 0xFFFFFFFFu) {
            info[2] |= VGC_UNENCODABLE;
            return 0;
        }
    }
    int64_t words;
    if (gap) {
        /* pass 2, parallel: each chunk writes its codes and values at its
         * bit offsets in the two sections, every word it fills alone; the
         * words it shares with a neighbour (its first and last of each
         * section) are put together here afterwards */
        const int64_t G = (int64_t)((bits + 31) / 32);
        const int vbits = sign_only ? 1 : 4;
        body[0] = (uint32_t)k | (sign_only ? VGC_GAP_SIGN_ONLY : 0u);
        body[1] = (uint32_t)G;
        uint32_t *gs = body + VGC_GAP_PARAM_WORDS, *vs = gs + G;
        for (size_t t = 0; t < nc; ++t)
            ws->chunks[t].value_start = (uint64_t)ws->chunks[t].offset * vbits;
        vgc_for_chunks(ws, [&](vgc_chunk &c) {
            if (!c.out) return;
            const uint32_t *w = c.words.data();
            vgc_bit_writer gw(gs, c.gap_start), vw(vs, c.value_start);
            int64_t p = c.gap_prev;
            if (sign_only) {
                for (int64_t j = 0; j < c.out; ++j) {
                    const int64_t ix = vgc_full_index(c, w[j]);
                    gw.code((uint64_t)(ix - p - 1), k);
                    p = ix;
                    vw.put(w[j] >> 31, 1);
                }
            } else {
                for (int64_t j = 0; j < c.out; ++j) {
                    const int64_t ix = vgc_full_index(c, w[j]);
                    gw.code((uint64_t)(ix - p - 1), k);
                    p = ix;
                    vw.put(w[j] >> VGC_INDEX_BITS, 4);
                }
            }
            gw.edges(&c.edge_word[0], &c.edge_bits[0], &c.tail_word[0],
                     &c.edge_bits[1]);
            vw.edges(&c.edge_word[2], &c.edge_bits[2], &c.tail_word[1],
                     &c.edge_bits[3]);
        });
        for (int pass = 0; pass < 2; ++pass)
            for (size_t t = 0; t < nc; ++t) {
                const vgc_chunk &c = ws->chunks[t];
                if (!c.out) continue;
                uint32_t *at[4] = {
                    gs + c.edge_word[0],
                    c.tail_word[0] >= 0 ? gs + c.tail_word[0] : NULL,
                    vs + c.edge_word[2],
                    c.tail_word[1] >= 0 ? vs + c.tail_word[1] : NULL};
                for (int e = 0; e < 4; ++e)
                    if (at[e]) *at[e] = pass ? *at[e] | c.edge_bits[e] : 0u;
            }
        words = VGC_GAP_PARAM_WORDS + G + vgc_gap_value_words(count, sign_only);
    } else {
        vgc_for_chunks(ws, [&](vgc_chunk &c) {
            if (c.out) memcpy(body + c.offset, c.words.data(), 4 * c.out);
        });
        words = count;
    }
    vgc_header(out, tid, gap ? VGC_FMT_GAP : VGC_FMT_POW2, count, a, b);
    info[0] = VGC_HEADER_WORDS + words;
    info[1] = count;
    return info[0];
}

/* ---- blocks: one cache line of the state at a time ---------------------- */

/* Elements per block: 64 bytes of state.  The arithmetic of a block runs
 * in a loop without branches (vectorized by the compiler); the rare
 * selected elements are staged afterwards. */
template <typename S> struct vgc_block {
    static const int N = 64 / sizeof(S);
};

/* Integer lane type of the width of S (vectorizes with S). */
template <typename S> struct vgc_lane;
template <> struct vgc_lane<float> { typedef int32_t I; };
template <> struct vgc_lane<double> { typedef int64_t I; };

/* Stores a block of the new state, non-temporally where aligned. */
template <typename S>
static inline void vgc_store_block(S *dst, const S *src, int n) {
#if defined(__SSE2__)
    if (n == vgc_block<S>::N && ((uintptr_t)dst & 15) == 0) {
        const __m128i *from = (const __m128i *)src;
        __m128i *to = (__m128i *)dst;
        _mm_stream_si128(to, _mm_loadu_si128(from));
        _mm_stream_si128(to + 1, _mm_loadu_si128(from + 1));
        _mm_stream_si128(to + 2, _mm_loadu_si128(from + 2));
        _mm_stream_si128(to + 3, _mm_loadu_si128(from + 3));
        return;
    }
#endif
    memcpy(dst, src, sizeof(S) * n);
}

template <typename S> struct vgc_stage;
template <> struct vgc_stage<float> {
    static std::vector<float> &values(vgc_chunk &c) { return c.fvalues; }
    static std::vector<float> &vs(vgc_chunk &c) { return c.fvs; }
};
template <> struct vgc_stage<double> {
    static std::vector<double> &values(vgc_chunk &c) { return c.dvalues; }
    static std::vector<double> &vs(vgc_chunk &c) { return c.dvs; }
};

/* Room for `more` staged elements (the vectors only grow, so the memory
 * is reused from step to step). */
template <typename S>
static inline void vgc_reserve(vgc_chunk &c, int64_t more, bool values,
                               bool vs) {
    size_t need = (size_t)(c.count + more);
    if (need > c.words.size())
        c.words.resize(std::max<size_t>(2 * c.words.size(), need + 4096));
    if (values && need > vgc_stage<S>::values(c).size())
        vgc_stage<S>::values(c).resize(c.words.size());
    if (vs && need > vgc_stage<S>::vs(c).size())
        vgc_stage<S>::vs(c).resize(c.words.size());
}

/* Bit j set where a[j] != 0 (j < n <= 32). */
template <typename I> static inline uint32_t vgc_mask(const I *a, int n) {
    uint32_t m = 0;
    for (int j = 0; j < n; ++j) m |= (uint32_t)(a[j] != 0) << j;
    return m;
}

#if defined(__SSE2__)
template <> inline uint32_t vgc_mask<int32_t>(const int32_t *a, int n) {
    if (n != 16) {
        uint32_t m = 0;
        for (int j = 0; j < n; ++j) m |= (uint32_t)(a[j] != 0) << j;
        return m;
    }
    const __m128i zero = _mm_setzero_si128();
    uint32_t m = 0;
    for (int k = 0; k < 4; ++k) {
        __m128i x = _mm_loadu_si128((const __m128i *)(a + 4 * k));
        int eq = _mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(x, zero)));
        m |= (uint32_t)(~eq & 0xF) << (4 * k);
    }
    return m;
}
#endif

/* ---- staging the selected lanes of a block ------------------------------ */

#if defined(__AVX2__)
#include <immintrin.h>

/* For each 8-bit lane mask, the lanes to keep, packed to the front. */
struct vgc_pack_table {
    uint8_t lanes[256][8];
    vgc_pack_table() {
        for (int m = 0; m < 256; ++m) {
            int k = 0;
            for (int j = 0; j < 8; ++j)
                if (m >> j & 1) lanes[m][k++] = (uint8_t)j;
            for (; k < 8; ++k) lanes[m][k] = 0;
        }
    }
};

static const vgc_pack_table vgc_pack_lanes;

/* Writes the lanes of `x` selected by mask m (8 bits) to dst, packed, and
 * returns how many; dst must have room for 8. */
static inline int vgc_pack8(int m, __m256i x, uint32_t *dst) {
    __m256i perm = _mm256_cvtepu8_epi32(
        _mm_loadl_epi64((const __m128i *)vgc_pack_lanes.lanes[m]));
    _mm256_storeu_si256((__m256i *)dst, _mm256_permutevar8x32_epi32(x, perm));
    return __builtin_popcount(m);
}

static inline int vgc_nonzero8(const int32_t *a) {
    __m256i x = _mm256_loadu_si256((const __m256i *)a);
    __m256i eq = _mm256_cmpeq_epi32(x, _mm256_setzero_si256());
    return ~_mm256_movemask_ps(_mm256_castsi256_ps(eq)) & 0xFF;
}
#endif

/* Appends the sign words (sign | index) of the nonzero lanes of `sign`
 * (+1/-1/0) to the chunk's staging, in lane order. */
template <typename S, typename I>
static inline void vgc_stage_signs(vgc_chunk &c, const I *sign, int n,
                                   int64_t i0) {
#if defined(__AVX2__)
    if (sizeof(I) == 4 && n == 16) { /* no branch per element */
        vgc_reserve<S>(c, n + 8, false, false);
        const int32_t *sg = (const int32_t *)sign;
        for (int h = 0; h < 2; ++h) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(sg + 8 * h));
            __m256i index = _mm256_and_si256(
                _mm256_add_epi32(
                    _mm256_set1_epi32((int)(uint32_t)(i0 + 8 * h)),
                    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                _mm256_set1_epi32((int)VGC_INDEX_MASK));
            __m256i neg = _mm256_and_si256(
                _mm256_cmpgt_epi32(_mm256_setzero_si256(), x),
                _mm256_set1_epi32((int)0x80000000u));
            c.count += vgc_pack8(vgc_nonzero8(sg + 8 * h),
                                 _mm256_or_si256(index, neg),
                                 c.words.data() + c.count);
        }
        return;
    }
#endif
    uint32_t any = vgc_mask(sign, n);
    if (!any) return;
    vgc_reserve<S>(c, n, false, false);
    for (uint32_t m = any; m; m &= m - 1) {
        int j = __builtin_ctz(m);
        c.words[c.count++] = (sign[j] < 0 ? 0x80000000u : 0u) |
                             ((uint32_t)(i0 + j) & VGC_INDEX_MASK);
    }
}

/* Appends index and r (and v unless reset) of the selected lanes to the
 * chunk's staging; with reset, zeroes their r and v in the block. */
template <typename S, typename I>
static inline void vgc_stage_selected(vgc_chunk &c, const I *sel, int n,
                                      int64_t i0, S *rr, S *vv, bool reset) {
#if defined(__AVX2__)
    if (sizeof(S) == 4 && n == 16 && reset) {
        vgc_reserve<S>(c, n + 8, true, false);
        const int32_t *sl = (const int32_t *)sel;
        uint32_t *values = (uint32_t *)vgc_stage<S>::values(c).data();
        for (int h = 0; h < 2; ++h) {
            int m = vgc_nonzero8(sl + 8 * h);
            __m256i index = _mm256_add_epi32(
                _mm256_set1_epi32((int)(uint32_t)(i0 + 8 * h)),
                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            __m256i r = _mm256_loadu_si256((const __m256i *)(rr + 8 * h));
            vgc_pack8(m, r, values + c.count);
            c.count += vgc_pack8(m, index, c.words.data() + c.count);
            __m256i keep = _mm256_cmpeq_epi32(
                _mm256_loadu_si256((const __m256i *)(sl + 8 * h)),
                _mm256_setzero_si256());
            _mm256_storeu_si256((__m256i *)(rr + 8 * h),
                                _mm256_and_si256(r, keep));
            __m256i v = _mm256_loadu_si256((const __m256i *)(vv + 8 * h));
            _mm256_storeu_si256((__m256i *)(vv + 8 * h),
                                _mm256_and_si256(v, keep));
        }
        return;
    }
#endif
    uint32_t any = vgc_mask(sel, n);
    if (!any) return;
    vgc_reserve<S>(c, n, true, !reset);
    S *values = vgc_stage<S>::values(c).data();
    for (uint32_t m = any; m; m &= m - 1) {
        int j = __builtin_ctz(m);
        c.words[c.count] = (uint32_t)(i0 + j);
        values[c.count] = rr[j];
        if (reset) {
            rr[j] = (S)0;
            vv[j] = (S)0;
        } else {
            vgc_stage<S>::vs(c)[c.count] = vv[j];
        }
        ++c.count;
    }
}

/* Fault flags from per-lane accumulators (NULL: not checked). */
template <typename I>
static int vgc_lane_flags(const I *bad_g, const I *bad_s, const I *over_r,
                          const I *over_v, int n) {
    I g = 0, s = 0, r = 0, v = 0;
    for (int j = 0; j < n; ++j) {
        g |= bad_g ? bad_g[j] : 0;
        s |= bad_s ? bad_s[j] : 0;
        r |= over_r ? over_r[j] : 0;
        v |= over_v ? over_v[j] : 0;
    }
    return (g ? VGC_BAD_GRAD : 0) | (s ? VGC_BAD_SQSUM : 0) |
           (r ? VGC_OVERFLOW_R : 0) | (v ? VGC_OVERFLOW_V : 0);
}

template <typename I> static I vgc_lane_max(const I *a, int n) {
    I m = 0;
    for (int j = 0; j < n; ++j) m = a[j] > m ? a[j] : m;
    return m;
}

/* ---- the block loop shared by the passes ------------------------------ */

/* One pass over a chunk, one cache line of state at a time:
 * arith(nn, i0, n, rr, vv, lanes) computes a block of n elements into the
 * local rr, vv and per-lane results (nn: std::integral_constant, the block
 * size for full blocks, 0 for the tail, so full blocks have a constant trip
 * count the compiler unrolls and vectorizes); stage(i0, n, rr, vv, lanes)
 * stages the selected lanes; then the new state is stored (v_out NULL: the
 * rule keeps no v). */
template <typename S, typename Arith, typename Stage>
static void vgc_block_loop(vgc_chunk &c, S *r_out, S *v_out, Arith arith,
                           Stage stage) {
    typedef typename vgc_lane<S>::I I;
    const int B = vgc_block<S>::N;
    c.count = 0;
    for (int64_t i0 = c.begin; i0 < c.end; i0 += B) {
        const int n = (int)std::min<int64_t>(B, c.end - i0);
        S rr[B], vv[B];
        I lanes[B];
        if (n == B)
            arith(std::integral_constant<int, B>(), i0, n, rr, vv, lanes);
        else
            arith(std::integral_constant<int, 0>(), i0, n, rr, vv, lanes);
        stage(i0, n, rr, vv, lanes);
        vgc_store_block(r_out + i0, rr, n);
        if (v_out) vgc_store_block(v_out + i0, vv, n);
    }
    vgc_fence();
}

/* ---- Fig. "Basic" (vgc) ------------------------------------------------ */

/* The arithmetic of one block of n elements (NN > 0: n == NN, a constant
 * trip count the compiler unrolls and vectorizes). */
template <int NN, typename G, typename S, typename I>
static inline __attribute__((always_inline)) void
vgc_basic_block(int n, const G *__restrict g, const S *__restrict s,
                const S *__restrict r_in, const S *__restrict v_in, S alpha,
                S zeta, S *__restrict rr, S *__restrict vv, I *__restrict sel,
                I *__restrict bad_g, I *__restrict bad_s, I *__restrict over_r,
                I *__restrict over_v, I *__restrict maxbits) {
    typedef vgc_float_traits<S> T;
    const int m = NN > 0 ? NN : n;
    for (int j = 0; j < m; ++j) {
            S gi = vgc_load<G, S>(g, j), si = s[j], ri = r_in[j], vi = v_in[j];
            bad_g[j] |= (I)!vgc_finite(gi);
            bad_s[j] |= (I)!vgc_good_sqsum(si);
            I sl = (I)vgc_basic_select<S>(gi, si, alpha, zeta, ri, vi);
            I mag = (I)(vgc_bits(ri) & T::ABS_MASK);
            I cand = sl ? mag : (I)0;
            maxbits[j] = cand > maxbits[j] ? cand : maxbits[j];
            over_r[j] |= (I)(sl == 0) & (I)!vgc_finite(ri);
            over_v[j] |= (I)(sl == 0) & (I)!vgc_finite(vi);
            sel[j] = sl;
            rr[j] = ri;
            vv[j] = vi;
    }
}

template <typename G, typename S>
static void vgc_basic_pass(vgc_chunk &c, const G *g, const S *s, const S *r_in,
                           const S *v_in, S *r_out, S *v_out, S alpha, S zeta,
                           bool reset) {
    typedef typename vgc_lane<S>::I I;
    const int B = vgc_block<S>::N;
    I bad_g[B] = {0}, bad_s[B] = {0}, over_r[B] = {0}, over_v[B] = {0},
      maxbits[B] = {0};
    vgc_block_loop<S>(
        c, r_out, v_out,
        [&](auto nn, int64_t i0, int n, S *rr, S *vv, I *sel) {
            vgc_basic_block<decltype(nn)::value>(
                n, g + i0, s + i0, r_in + i0, v_in + i0, alpha, zeta, rr, vv,
                sel, bad_g, bad_s, over_r, over_v, maxbits);
        },
        [&](int64_t i0, int n, S *rr, S *vv, I *sel) {
            vgc_stage_selected<S>(c, sel, n, i0, rr, vv, reset);
        });
    c.maxbits = (uint64_t)vgc_lane_max(maxbits, B);
    c.flags = vgc_lane_flags(bad_g, bad_s, over_r, over_v, B);
}

/* Quantize the staged values of a chunk in place (Sec. 4.2): the words of
 * the representable ones, in index order.  keep: an unrepresentable element
 * stays in r (and v keeps its decayed value); otherwise it was reset in
 * pass 1 and is dropped, as the paper's Encode() does. */
template <typename S>
static void vgc_quantize_chunk(vgc_chunk &c, int e_k, bool keep, S *r_out,
                               S *v_out) {
    int64_t w = 0;
    const S *values = vgc_stage<S>::values(c).data();
    if (e_k == VGC_LOG2_ZERO) { /* every selected value is subnormal */
        if (keep)
            for (int64_t j = 0; j < c.count; ++j) {
                if (!vgc_finite(values[j])) c.flags |= VGC_OVERFLOW_R;
                if (!vgc_finite(vgc_stage<S>::vs(c)[j]))
                    c.flags |= VGC_OVERFLOW_V;
            }
        c.out = 0;
        return;
    }
    if (!keep) { /* compaction without branches: w <= j */
        for (int64_t j = 0; j < c.count; ++j) {
            uint32_t word;
            bool ok = vgc_pow2_encode<S>(values[j], e_k,
                                         (long long)c.words[j], word);
            c.words[w] = word;
            w += ok;
        }
        c.out = w;
        return;
    }
    for (int64_t j = 0; j < c.count; ++j) {
        /* staged: the index's low 32 bits (the chunk has <= 2**28) */
        const int64_t index =
            c.begin + (int64_t)(uint32_t)(c.words[j] - (uint32_t)c.begin);
        uint32_t word;
        S x = values[j];
        if (vgc_pow2_encode<S>(x, e_k, (long long)index, word)) {
            c.words[w++] = word;
            r_out[index] = (S)0;
            v_out[index] = (S)0;
        } else {
            if (!vgc_finite(x)) c.flags |= VGC_OVERFLOW_R;
            if (!vgc_finite(vgc_stage<S>::vs(c)[j])) c.flags |= VGC_OVERFLOW_V;
        }
    }
    c.out = w;
}

template <typename G, typename S>
static int64_t vgc_basic(vgc_workspace *ws, int tid, const G *g, const S *s,
                         const S *r_in, const S *v_in, S *r_out, S *v_out,
                         int64_t n, double alpha_d, double zeta_d,
                         int quantize, int keep_unrep, int coding,
                         uint32_t *out, int64_t *info) {
    typedef vgc_float_traits<S> T;
    const S alpha = (S)alpha_d, zeta = (S)zeta_d;
    const bool keep = quantize && keep_unrep;
    vgc_plan(ws, n);
    vgc_for_chunks(ws, [&](vgc_chunk &c) {
        vgc_basic_pass<G, S>(c, g, s, r_in, v_in, r_out, v_out, alpha, zeta,
                             !keep);
    });
    int64_t count = 0;
    uint64_t maxbits = 0;
    for (size_t k = 0; k < ws->chunks.size(); ++k) {
        count += ws->chunks[k].count;
        maxbits = std::max(maxbits, ws->chunks[k].maxbits);
    }
    info[0] = info[1] = 0;
    if (count == 0) {
        info[2] = vgc_flags(ws);
        return 0;
    }
    uint32_t *body = out + VGC_HEADER_WORDS;
    if (!quantize) {
        /* FMT_RAW: index words (unless all are sent), then the values */
        const bool dense = count == n;
        const int vw = sizeof(S) / 4;
        for (size_t k = 0; k < ws->chunks.size(); ++k)
            ws->chunks[k].out = ws->chunks[k].count;
        vgc_offsets(ws);
        uint32_t *values = body + (dense ? 0 : count);
        vgc_for_chunks(ws, [&](vgc_chunk &c) {
            if (!dense && c.count)
                memcpy(body + c.offset, c.words.data(), 4 * c.count);
            const S *staged = vgc_stage<S>::values(c).data();
            for (int64_t j = 0; j < c.count; ++j) {
                S x = staged[j];
                memcpy(values + (c.offset + j) * vw, &x, sizeof x);
            }
        });
        vgc_header(out, tid, VGC_FMT_RAW, count,
                   (dense ? VGC_RAW_DENSE : 0) |
                       (sizeof(S) == 8 ? VGC_RAW_FLOAT64 : 0),
                   0);
        info[0] = VGC_HEADER_WORDS + (dense ? 0 : count) + count * vw;
        info[1] = count;
        info[2] = vgc_flags(ws);
        return info[0];
    }
    /* e_k = floor(log2 max |r|) over the selected elements (Sec. 4.2) */
    typename T::U mb = (typename T::U)maxbits;
    S maxval;
    memcpy(&maxval, &mb, sizeof maxval);
    const int e_k = vgc_floor_log2<S>(maxval);
    vgc_for_chunks(ws, [&](vgc_chunk &c) {
        vgc_quantize_chunk<S>(c, e_k, keep, r_out, v_out);
    });
    return vgc_emit(ws, tid, n, coding, false, (uint32_t)e_k,
                    vgc_f32_bits(1.0f), out, info);
}

/* ---- Fig. "Hybrid" and Strom: +-tau, one pass -------------------------- */

template <int NN, typename G, typename S, typename I>
static inline __attribute__((always_inline)) void
vgc_hybrid_block(int n, const G *__restrict g, const S *__restrict s,
                 const S *__restrict r_in, const S *__restrict v_in, S alpha,
                 S zeta, S tau, S *__restrict rr, S *__restrict vv,
                 I *__restrict sign, I *__restrict bad_g, I *__restrict bad_s,
                 I *__restrict over_r, I *__restrict over_v) {
    const int m = NN > 0 ? NN : n;
    for (int j = 0; j < m; ++j) {
        S gi = vgc_load<G, S>(g, j), si = s[j], ri = r_in[j], vi = v_in[j];
        bad_g[j] |= (I)!vgc_finite(gi);
        bad_s[j] |= (I)!vgc_good_sqsum(si);
        I sg = (I)vgc_hybrid_step<S>(gi, si, alpha, zeta, tau, ri, vi);
        over_r[j] |= (I)!vgc_finite(ri);
        over_v[j] |= (I)!vgc_finite(vi);
        sign[j] = sg;
        rr[j] = ri;
        vv[j] = vi;
    }
}

template <typename G, typename S>
static void vgc_hybrid_pass(vgc_chunk &c, const G *g, const S *s,
                            const S *r_in, const S *v_in, S *r_out, S *v_out,
                            S alpha, S zeta, S tau) {
    typedef typename vgc_lane<S>::I I;
    const int B = vgc_block<S>::N;
    I bad_g[B] = {0}, bad_s[B] = {0}, over_r[B] = {0}, over_v[B] = {0};
    vgc_block_loop<S>(
        c, r_out, v_out,
        [&](auto nn, int64_t i0, int n, S *rr, S *vv, I *sign) {
            vgc_hybrid_block<decltype(nn)::value>(
                n, g + i0, s + i0, r_in + i0, v_in + i0, alpha, zeta, tau, rr,
                vv, sign, bad_g, bad_s, over_r, over_v);
        },
        [&](int64_t i0, int n, S *, S *, I *sign) {
            vgc_stage_signs<S>(c, sign, n, i0);
        });
    c.out = c.count;
    c.flags = vgc_lane_flags(bad_g, bad_s, over_r, over_v, B);
}

template <int NN, typename G, typename S, typename I>
static inline __attribute__((always_inline)) void
vgc_strom_block(int n, const G *__restrict g, const S *__restrict r_in,
                S tau, S *__restrict rr, I *__restrict sign,
                I *__restrict bad_g, I *__restrict over_r) {
    const int m = NN > 0 ? NN : n;
    for (int j = 0; j < m; ++j) {
        S gi = vgc_load<G, S>(g, j), ri = r_in[j];
        bad_g[j] |= (I)!vgc_finite(gi);
        I sg = (I)vgc_strom_step<S>(gi, tau, ri);
        over_r[j] |= (I)!vgc_finite(ri);
        sign[j] = sg;
        rr[j] = ri;
    }
}

template <typename G, typename S>
static void vgc_strom_pass(vgc_chunk &c, const G *g, const S *r_in, S *r_out,
                           S tau) {
    typedef typename vgc_lane<S>::I I;
    const int B = vgc_block<S>::N;
    I bad_g[B] = {0}, over_r[B] = {0};
    vgc_block_loop<S>(
        c, r_out, (S *)NULL,
        [&](auto nn, int64_t i0, int n, S *rr, S *, I *sign) {
            vgc_strom_block<decltype(nn)::value>(n, g + i0, r_in + i0, tau,
                                                 rr, sign, bad_g, over_r);
        },
        [&](int64_t i0, int n, S *, S *, I *sign) {
            vgc_stage_signs<S>(c, sign, n, i0);
        });
    c.out = c.count;
    c.flags = vgc_lane_flags(bad_g, (I *)NULL, over_r, (I *)NULL, B);
}

/* The staged sign words as a FMT_POW2 or FMT_GAP (SIGN_ONLY) group
 * (e_k 0, scale tau). */
static int64_t vgc_sign_group(vgc_workspace *ws, int tid, int64_t n,
                              float tau, int coding, uint32_t *out,
                              int64_t *info) {
    return vgc_emit(ws, tid, n, coding, true, 0u, vgc_f32_bits(tau), out,
                    info);
}

template <typename G, typename S>
static int64_t vgc_hybrid(vgc_workspace *ws, int tid, const G *g, const S *s,
                          const S *r_in, const S *v_in, S *r_out, S *v_out,
                          int64_t n, double alpha_d, double zeta_d,
                          double tau_d, int coding, uint32_t *out,
                          int64_t *info) {
    const float tau32 = (float)tau_d; /* the value on the wire */
    const S alpha = (S)alpha_d, zeta = (S)zeta_d, tau = (S)tau32;
    vgc_plan(ws, n);
    vgc_for_chunks(ws, [&](vgc_chunk &c) {
        vgc_hybrid_pass<G, S>(c, g, s, r_in, v_in, r_out, v_out, alpha, zeta,
                              tau);
    });
    return vgc_sign_group(ws, tid, n, tau32, coding, out, info);
}

template <typename G, typename S>
static int64_t vgc_strom(vgc_workspace *ws, int tid, const G *g,
                         const S *r_in, S *r_out, int64_t n, double tau_d,
                         int coding, uint32_t *out, int64_t *info) {
    const float tau32 = (float)tau_d;
    const S tau = (S)tau32;
    vgc_plan(ws, n);
    vgc_for_chunks(ws, [&](vgc_chunk &c) {
        vgc_strom_pass<G, S>(c, g, r_in, r_out, tau);
    });
    return vgc_sign_group(ws, tid, n, tau32, coding, out, info);
}

/* ---- none: the dense gradient in the state dtype (FMT_RAW, dense) ------ */

template <typename G, typename S>
static int64_t vgc_none(vgc_workspace *ws, int tid, const G *g, int64_t n,
                        uint32_t *out, int64_t *info) {
    info[0] = info[1] = info[2] = 0;
    if (n == 0) return 0;
    vgc_plan(ws, n);
    uint32_t *body = out + VGC_HEADER_WORDS;
    vgc_for_chunks(ws, [&](vgc_chunk &c) {
        bool bad = false;
        for (int64_t i = c.begin; i < c.end; ++i) {
            S x = vgc_load<G, S>(g, i);
            bad |= !vgc_finite(x);
            memcpy(body + i * (int64_t)(sizeof(S) / 4), &x, sizeof x);
        }
        c.flags = bad ? VGC_BAD_GRAD : 0;
    });
    vgc_header(out, tid, VGC_FMT_RAW, n,
               VGC_RAW_DENSE | (sizeof(S) == 8 ? VGC_RAW_FLOAT64 : 0), 0);
    info[0] = VGC_HEADER_WORDS + n * (int64_t)(sizeof(S) / 4);
    info[1] = n;
    info[2] = vgc_flags(ws);
    return info[0];
}

/* ---- QSGD (Alistarh et al. 2017), a baseline of Table 1 --------------- */

/* NumPy's pairwise summation (numpy/core/src/umath/loops_utils.h) of the
 * squares of x[0..n) in float64, x[k] read as 0 for k >= valid (the zero
 * padding of the last bucket): the reference computes the bucket norms with
 * ``(padded.reshape(nb, b) ** 2).sum(axis=1)``, and this reproduces its
 * rounding exactly. */
template <typename G>
static double vgc_pairwise_sq(const G *x, int64_t n, int64_t valid) {
    if (n < 8) {
        double res = 0.;
        for (int64_t i = 0; i < n; ++i) {
            double v = i < valid ? (double)x[i] : 0.0;
            res += v * v;
        }
        return res;
    }
    if (n <= 128) {
        double r[8];
        for (int j = 0; j < 8; ++j) {
            double v = j < valid ? (double)x[j] : 0.0;
            r[j] = v * v;
        }
        int64_t i;
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; ++j) {
                double v = i + j < valid ? (double)x[i + j] : 0.0;
                r[j] += v * v;
            }
        double res = ((r[0] + r[1]) + (r[2] + r[3])) +
                     ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; ++i) {
            double v = i < valid ? (double)x[i] : 0.0;
            res += v * v;
        }
        return res;
    }
    int64_t n2 = n / 2;
    n2 -= n2 % 8;
    return vgc_pairwise_sq(x, n2, valid) +
           vgc_pairwise_sq(x + n2, n - n2, valid - n2);
}

/* The bucket's sum of squares as the reference's reduction computes it:
 * NumPy's reduction loop sees a row in pieces of its buffer size (8192
 * elements) and adds each piece's pairwise sum to the running total. */
template <typename G>
static double vgc_bucket_sq(const G *x, int64_t bucket, int64_t valid) {
    const int64_t piece = 8192;
    double total = 0.0;
    for (int64_t off = 0; off < bucket; off += piece)
        total += vgc_pairwise_sq(x + off, std::min(piece, bucket - off),
                                 valid - off);
    return total;
}

/* One tensor, one pass: per bucket its norm, the stochastic levels
 * l = floor(|g| / n * levels + u) with the uniform draws u given, a record
 * (id, count, scale) for a bucket that sends something and one staged word
 * per sent element; then the FMT_QSGD group: the records, the words. */
template <typename G, typename S>
static int64_t vgc_qsgd(vgc_workspace *ws, int tid, const G *g, const S *u,
                        int64_t n, int64_t bucket, int levels, uint32_t *out,
                        int64_t *info) {
    info[0] = info[1] = info[2] = 0;
    vgc_plan(ws, 0); /* one chunk, serial */
    vgc_chunk &c = ws->chunks[0];
    c.words.clear();
    c.records.clear();
    const int64_t nb = (n + bucket - 1) / bucket;
    bool bad = false;
    for (int64_t k = 0; k < nb; ++k) {
        const int64_t lo = k * bucket, len = std::min(bucket, n - lo);
        for (int64_t i = lo; i < lo + len; ++i)
            bad |= !vgc_finite((double)g[i]);
        const double norm = sqrt(vgc_bucket_sq(g + lo, bucket, len));
        const double safe = norm > 0 ? norm : 1.0;
        const size_t first = c.words.size();
        for (int64_t i = lo; i < lo + len; ++i) {
            double x = (double)g[i];
            double scaled = (x < 0 ? -x : x) / safe * (double)levels;
            double lv = floor(scaled + (double)u[i]);
            int64_t level = norm > 0 ? (int64_t)lv : 0;
            level = level < 0 ? 0 : (level > levels ? levels : level);
            if (level)
                c.words.push_back((std::signbit(x) ? 0x80000000u : 0u) |
                                  ((uint32_t)level << VGC_QSGD_OFFSET_BITS) |
                                  (uint32_t)(i - lo));
        }
        const size_t sent = c.words.size() - first;
        if (!sent) continue;
        uint32_t rec[VGC_QSGD_RECORD_WORDS];
        double scale = norm / (double)levels;
        rec[0] = (uint32_t)k;
        rec[1] = (uint32_t)sent;
        memcpy(rec + 2, &scale, sizeof scale);
        c.records.insert(c.records.end(), rec, rec + VGC_QSGD_RECORD_WORDS);
    }
    info[2] = bad ? VGC_BAD_GRAD : 0;
    const int64_t count = (int64_t)c.words.size();
    if (count == 0) return 0;
    const int64_t n_rec = (int64_t)c.records.size() / VGC_QSGD_RECORD_WORDS;
    uint32_t *body = out + VGC_HEADER_WORDS;
    memcpy(body, c.records.data(), 4 * c.records.size());
    memcpy(body + c.records.size(), c.words.data(), 4 * count);
    vgc_header(out, tid, VGC_FMT_QSGD, count, (uint32_t)n_rec,
               ((uint32_t)levels << 24) | (uint32_t)bucket);
    info[0] = VGC_HEADER_WORDS + (int64_t)c.records.size() + count;
    info[1] = count;
    return info[0];
}

/* ---- decode ------------------------------------------------------------ */

/* One validated group of one message, and a cursor over its elements in
 * index order. */
struct vgc_group {
    const uint32_t *body;
    uint32_t fmt, count, a, b;
    /* cursor */
    int64_t pos;   /* element number */
    int64_t index; /* current index */
    int64_t rec, rec_left, word_at;
    double table[16]; /* FMT_POW2 and FMT_GAP values, in the state dtype */
    /* FMT_GAP: this tensor's elements of the group, decoded by vgc_walk:
     * indices (in this tensor) and table entries (sign << 3 | d), count of
     * each; a segment of the scratch arrays of the group's first tensor
     * (gap_index, gap_nib below) when the group spans several tensors */
    const int64_t *gap_index;
    const uint8_t *gap_nibble;
};

/* A FMT_GAP group found by vgc_walk, decoded afterwards (vgc_check_gap,
 * all groups of all messages in parallel). */
struct vgc_gap_job {
    const uint32_t *body;
    int64_t length, tid, span, span_size;
    uint32_t count, a, b;
    int msg;
};

static double vgc_word_double(const uint32_t *p) {
    double d;
    memcpy(&d, p, sizeof d);
    return d;
}

static float vgc_word_float(const uint32_t *p) {
    float f;
    memcpy(&f, p, sizeof f);
    return f;
}

/* The index of element pos (requires pos < count). */
static int64_t vgc_group_index(const vgc_group &g) {
    switch (g.fmt) {
    case VGC_FMT_POW2:
        return (int64_t)(g.body[g.pos] & VGC_INDEX_MASK);
    case VGC_FMT_GAP:
        return g.gap_index[g.pos];
    case VGC_FMT_RAW:
        return (g.a & VGC_RAW_DENSE) ? g.pos : (int64_t)g.body[g.pos];
    default: { /* QSGD: record rec, word at word_at */
        const uint32_t *r = g.body + VGC_QSGD_RECORD_WORDS * g.rec;
        int64_t bucket = g.b & 0xFFFFFF;
        return (int64_t)r[0] * bucket +
               (int64_t)(g.body[g.word_at] & ((1u << VGC_QSGD_OFFSET_BITS) - 1));
    }
    }
}

template <typename S> static S vgc_group_value(const vgc_group &g) {
    switch (g.fmt) {
    case VGC_FMT_POW2:
        return (S)g.table[g.body[g.pos] >> VGC_INDEX_BITS];
    case VGC_FMT_GAP:
        return (S)g.table[g.gap_nibble[g.pos]];
    case VGC_FMT_RAW: {
        const uint32_t *v = g.body + ((g.a & VGC_RAW_DENSE) ? 0 : g.count);
        if (g.a & VGC_RAW_FLOAT64) return (S)vgc_word_double(v + 2 * g.pos);
        return (S)vgc_word_float(v + g.pos);
    }
    default: {
        const uint32_t *r = g.body + VGC_QSGD_RECORD_WORDS * g.rec;
        uint32_t w = g.body[g.word_at];
        double mag = (double)((w >> VGC_QSGD_OFFSET_BITS) & 0xFFu) *
                     vgc_word_double(r + 2);
        return (S)((w >> 31) ? -mag : mag);
    }
    }
}

static void vgc_group_advance(vgc_group &g) {
    ++g.pos;
    if (g.fmt == VGC_FMT_QSGD) {
        ++g.word_at;
        if (--g.rec_left == 0 && g.pos < (int64_t)g.count) {
            ++g.rec;
            g.rec_left = g.body[VGC_QSGD_RECORD_WORDS * g.rec + 1];
        }
    }
}

static void vgc_group_start(vgc_group &g) {
    g.pos = 0;
    if (g.fmt == VGC_FMT_QSGD) {
        g.rec = 0;
        g.rec_left = g.body[1];
        g.word_at = VGC_QSGD_RECORD_WORDS * (int64_t)g.a;
    }
}

/* Error codes (the Python side re-runs codec.unpack to name the fault). */
enum { VGC_OK = 0, VGC_BAD_MESSAGE = 1 };

/* Every FMT_RAW value (wire type W), cast to the state dtype S as the
 * decoder casts it, is finite: a finite float64 may overflow float32. */
template <typename S, typename W>
static bool vgc_raw_finite(const uint32_t *v, int64_t count) {
    uint32_t bad = 0;
    for (int64_t j = 0; j < count; ++j) {
        W x;
        memcpy(&x, v + j * (int64_t)(sizeof(W) / 4), sizeof x);
        bad |= (uint32_t)!vgc_finite((S)x);
    }
    return !bad;
}

/* The value the decoder writes for the cursor's element, in the state
 * dtype (float64 if f64), is finite (QSGD: level * scale may overflow). */
static bool vgc_value_finite(const vgc_group &g, bool f64) {
    return f64 ? vgc_finite(vgc_group_value<double>(g))
               : vgc_finite(vgc_group_value<float>(g));
}

/* The 16-value table of FMT_POW2 / FMT_GAP (header a = e_k, b = scale
 * bits) in the state dtype (float64 if f64) into g.table, with the checks
 * of codec (e_k and scale in range, every value finite and nonzero). */
static bool vgc_pow2_table(vgc_group &g, bool f64) {
    int e_k = (int)(int32_t)g.a;
    float scale = vgc_word_float(&g.b);
    int minexp = f64 ? -1022 : -126, maxexp = f64 ? 1024 : 128;
    if (!(vgc_finite(scale) && scale > 0.0f && minexp <= e_k &&
          e_k <= maxexp - 1))
        return false;
    for (uint32_t k = 0; k < 16; ++k) {
        long long ix;
        double v = f64 ? vgc_pow2_decode<double>(k << VGC_INDEX_BITS, e_k,
                                                 (double)scale, ix)
                       : (double)vgc_pow2_decode<float>(k << VGC_INDEX_BITS,
                                                        e_k, scale, ix);
        if (!vgc_finite(v) || v == 0.0) return false;
        g.table[k] = v;
    }
    return true;
}

/* Validates one group's contents as codec.unpack does (FMT_GAP groups:
 * vgc_check_gap, which decodes them). */
static bool vgc_check_group(vgc_group &g, int64_t size, int scode) {
    const bool f64 = scode == VGC_F64;
    const int64_t count = g.count;
    if (g.fmt == VGC_FMT_POW2) {
        if (!vgc_pow2_table(g, f64)) return false;
    } else if (g.fmt == VGC_FMT_RAW) {
        const uint32_t *v = g.body + ((g.a & VGC_RAW_DENSE) ? 0 : count);
        const bool wire64 = g.a & VGC_RAW_FLOAT64;
        bool ok = wire64 ? (f64 ? vgc_raw_finite<double, double>(v, count)
                                : vgc_raw_finite<float, double>(v, count))
                         : (f64 ? vgc_raw_finite<double, float>(v, count)
                                : vgc_raw_finite<float, float>(v, count));
        if (!ok) return false;
        if (g.a & VGC_RAW_DENSE) return true;
    } else {
        const int64_t n_rec = g.a, bucket = g.b & 0xFFFFFF;
        const uint32_t levels = g.b >> 24;
        int64_t total = 0, last_id = -1;
        for (int64_t k = 0; k < n_rec; ++k) {
            const uint32_t *r = g.body + VGC_QSGD_RECORD_WORDS * k;
            double scale = vgc_word_double(r + 2);
            if ((int64_t)r[0] <= last_id || r[1] == 0 ||
                !(vgc_finite(scale) && scale > 0))
                return false;
            last_id = r[0];
            total += r[1];
        }
        if (total != count || last_id * bucket >= size) return false;
        const uint32_t *w = g.body + VGC_QSGD_RECORD_WORDS * n_rec;
        for (int64_t j = 0; j < count; ++j) {
            if ((int64_t)(w[j] & ((1u << VGC_QSGD_OFFSET_BITS) - 1)) >= bucket ||
                ((w[j] >> VGC_QSGD_OFFSET_BITS) & 0xFFu) > levels)
                return false;
        }
    }
    /* indices strictly increasing and in range */
    if (g.fmt == VGC_FMT_POW2 || g.fmt == VGC_FMT_RAW) {
        /* each index above the one before (a loop the compiler
         * vectorizes), so only the last needs the range check */
        const uint32_t mask =
            g.fmt == VGC_FMT_POW2 ? VGC_INDEX_MASK : 0xFFFFFFFFu;
        const uint32_t *w = g.body;
        uint32_t bad = 0;
        for (int64_t j = 1; j < count; ++j)
            bad |= (uint32_t)((w[j] & mask) <= (w[j - 1] & mask));
        return !bad && (int64_t)(w[count - 1] & mask) < size;
    }
    vgc_group_start(g);
    int64_t last = -1;
    for (int64_t j = 0; j < count; ++j) {
        int64_t ix = vgc_group_index(g);
        if (ix <= last || ix >= size || !vgc_value_finite(g, f64))
            return false;
        last = ix;
        vgc_group_advance(g);
    }
    return true;
}

/* Decodes and validates a FMT_GAP group (header fields count, a, b; body
 * of body_words words at body) that covers tensors t0..t0 + span
 * (checked to exist by the caller): its indices over their concatenated
 * index space (span_size elements, count <= span_size checked by the
 * caller) go to index[count], nib[count], then every tensor of the span that
 * receives elements gets groups[t] = its segment (indices minus the
 * tensor's offset in the span) with the value table in its own state
 * dtype (checked for each of them).  Tensors receiving nothing keep
 * body NULL. */
static bool vgc_check_gap(vgc_group *groups, int64_t t0, int64_t span,
                          const int64_t *sizes, const int *scodes,
                          const uint32_t *body, int64_t body_words,
                          int64_t span_size, uint32_t count, uint32_t a,
                          uint32_t b, int64_t *index, uint8_t *nib) {
    if (!vgc_gap_decode(body, body_words, count, span_size, index, nib))
        return false;
    int64_t j = 0, offset = 0;
    for (int64_t t = t0; t <= t0 + span && j < (int64_t)count; ++t) {
        const int64_t end = offset + sizes[t];
        int64_t e = j;
        while (e < (int64_t)count && index[e] < end) index[e++] -= offset;
        if (e > j) {
            vgc_group &g = groups[t];
            g.body = body;
            g.fmt = VGC_FMT_GAP;
            g.count = (uint32_t)(e - j);
            g.a = a;
            g.b = b;
            g.gap_index = index + j;
            g.gap_nibble = nib + j;
            /* the table in this tensor's state dtype; every entry finite
             * and nonzero, so every value of the segment is */
            if (!vgc_pow2_table(g, scodes[t] == VGC_F64)) return false;
        }
        j = e;
        offset = end;
    }
    return j == (int64_t)count; /* always: every index < span_size */
}

/* Walks and validates one message (as codec._walk + codec.unpack); fills
 * groups[tid] for the tensors it carries and adds its element count.
 * FMT_GAP groups are only queued in jobs (their header and the cheap
 * checks done): the message is valid iff this returns true and
 * vgc_check_gap accepts each of them. */
static bool vgc_walk(const uint32_t *m, int64_t len, int n_tensors,
                     const int64_t *sizes, const int *scodes,
                     vgc_group *groups, int64_t *elements,
                     std::vector<vgc_gap_job> *jobs) {
    if (len < 2 || m[0] != VGC_MAGIC) return false;
    int64_t n_groups = m[1], pos = 2, last = -1;
    *elements = 0;
    for (int64_t k = 0; k < n_groups; ++k) {
        if (pos + VGC_HEADER_WORDS > len) return false;
        const uint32_t *h = m + pos;
        int64_t tid = h[0];
        uint32_t fmt = h[1], count = h[2], a = h[3], b = h[4];
        pos += VGC_HEADER_WORDS;
        if (tid <= last || tid >= n_tensors) return false;
        last = tid;
        int64_t size = sizes[tid], length, span = 0;
        if (count == 0) return false;
        if (fmt != VGC_FMT_GAP && (int64_t)count > size) return false;
        if (fmt == VGC_FMT_POW2) {
            length = count;
        } else if (fmt == VGC_FMT_RAW) {
            if (a & ~(VGC_RAW_DENSE | VGC_RAW_FLOAT64)) return false;
            if ((a & VGC_RAW_DENSE) && (int64_t)count != size) return false;
            length = ((a & VGC_RAW_DENSE) ? 0 : (int64_t)count) +
                     (int64_t)count * ((a & VGC_RAW_FLOAT64) ? 2 : 1);
        } else if (fmt == VGC_FMT_QSGD) {
            if (a == 0 || a > count || (b & 0xFFFFFF) == 0 || (b >> 24) == 0)
                return false;
            length = VGC_QSGD_RECORD_WORDS * (int64_t)a + count;
        } else if (fmt == VGC_FMT_GAP) {
            /* the param word and G, before any other body word */
            if (pos + VGC_GAP_PARAM_WORDS > len) return false;
            const bool sign_only = (m[pos] & VGC_GAP_SIGN_ONLY) != 0;
            length = VGC_GAP_PARAM_WORDS + (int64_t)m[pos + 1] +
                     vgc_gap_value_words(count, sign_only);
            /* the span: tensors tid..tid + span, all in the model; the
             * next group's id must be above the last of them */
            span = m[pos] >> VGC_GAP_SPAN_SHIFT;
            if (span >= n_tensors - tid) return false;
            last = tid + span;
            size = 0; /* span_size (saturating: never past int64) */
            for (int64_t t = tid; t <= last; ++t)
                size = sizes[t] > INT64_MAX - size ? INT64_MAX
                                                   : size + sizes[t];
            if ((int64_t)count > size) return false;
        } else {
            return false;
        }
        if (pos + length > len) return false;
        if (fmt == VGC_FMT_GAP) {
            /* the cheap checks now (reserved bit, at least a bit per code,
             * value padding), the decoding later (vgc_check_gap) */
            const uint32_t *body = m + pos;
            const int64_t G = body[1];
            if ((body[0] & VGC_GAP_RESERVED) || (int64_t)count > 32 * G)
                return false;
            const uint64_t vbits =
                (uint64_t)count * ((body[0] & VGC_GAP_SIGN_ONLY) ? 1 : 4);
            if ((vbits & 31) && (body[length - 1] >> (vbits & 31)))
                return false;
            vgc_gap_job job = {body, length, tid, span, size,
                               count, a, b, 0};
            jobs->push_back(job);
        } else {
            vgc_group &g = groups[tid];
            g.body = m + pos;
            g.fmt = fmt;
            g.count = count;
            g.a = a;
            g.b = b;
            if (!vgc_check_group(g, size, scodes[tid])) return false;
        }
        *elements += count;
        pos += length;
    }
    return pos == len;
}

/* Position of the first element of group g (FMT_POW2, FMT_GAP or
 * FMT_RAW, sorted indices) whose index is >= lo. */
static int64_t vgc_lower_bound(const vgc_group &g, int64_t lo) {
    if (g.fmt == VGC_FMT_RAW && (g.a & VGC_RAW_DENSE)) return lo;
    if (g.fmt == VGC_FMT_GAP)
        return std::lower_bound(g.gap_index, g.gap_index + g.count, lo) -
               g.gap_index;
    int64_t a = 0, b = g.count;
    const uint32_t mask = g.fmt == VGC_FMT_POW2 ? VGC_INDEX_MASK : 0xFFFFFFFFu;
    while (a < b) {
        int64_t mid = a + (b - a) / 2;
        if ((int64_t)(g.body[mid] & mask) < lo)
            a = mid + 1;
        else
            b = mid;
    }
    return a;
}

/* out[index] += value for the elements of g from position *pos on whose
 * index is below hi; advances *pos. */
template <typename S>
static void vgc_add_until(const vgc_group &g, const S *table, int64_t *pos,
                          int64_t hi, S *out) {
    const int64_t count = g.count;
    int64_t j = *pos;
    if (g.fmt == VGC_FMT_POW2) {
        for (; j < count; ++j) {
            uint32_t w = g.body[j], ix = w & VGC_INDEX_MASK;
            if ((int64_t)ix >= hi) break;
            out[ix] += table[w >> VGC_INDEX_BITS];
        }
    } else if (g.fmt == VGC_FMT_GAP) {
        const int64_t *index = g.gap_index;
        const uint8_t *nib = g.gap_nibble;
        for (; j < count; ++j) {
            const int64_t ix = index[j];
            if (ix >= hi) break;
            out[ix] += table[nib[j]];
        }
    } else { /* FMT_RAW */
        const bool dense = g.a & VGC_RAW_DENSE, f64 = g.a & VGC_RAW_FLOAT64;
        const uint32_t *v = g.body + (dense ? 0 : count);
        for (; j < count; ++j) {
            int64_t ix = dense ? j : (int64_t)g.body[j];
            if (ix >= hi) break;
            out[ix] += f64 ? (S)vgc_word_double(v + 2 * j)
                           : (S)vgc_word_float(v + j);
        }
    }
    *pos = j;
}

/* Elements per cache block of the decode (256 KiB of float32). */
static const int64_t VGC_DECODE_BLOCK = 1 << 16;

/* out[lo..hi) = (sum over the p groups, in rank order, of their values at
 * each index, starting from 0: ((0 + v_0) + v_1) + ..., the reference's
 * order), times scale if apply_scale.  Works one cache block at a time:
 * zero it, add each group's elements that fall in it, scale it, so the
 * output is written to memory once.  Returns the elements added. */
template <typename S>
static int64_t vgc_sum_range(vgc_group **heads, int p, S *out, int64_t lo,
                             int64_t hi, int apply_scale, double scale_d) {
    const S scale = (S)scale_d;
    std::vector<int64_t> pos(p), start(p);
    std::vector<S> tables((size_t)16 * p);
    for (int b = 0; b < p; ++b) {
        if (!heads[b]) continue;
        pos[b] = start[b] = vgc_lower_bound(*heads[b], lo);
        for (int k = 0; k < 16; ++k) tables[16 * b + k] = (S)heads[b]->table[k];
    }
    for (int64_t b0 = lo; b0 < hi; b0 += VGC_DECODE_BLOCK) {
        const int64_t b1 = std::min(hi, b0 + VGC_DECODE_BLOCK);
        memset(out + b0, 0, sizeof(S) * (b1 - b0));
        for (int b = 0; b < p; ++b)
            if (heads[b])
                vgc_add_until<S>(*heads[b], &tables[16 * b], &pos[b], b1,
                                 out);
        if (apply_scale)
            for (int64_t i = b0; i < b1; ++i) out[i] *= scale;
    }
    int64_t added = 0;
    for (int b = 0; b < p; ++b) added += heads[b] ? pos[b] - start[b] : 0;
    return added;
}

/* The same for a whole tensor whose groups include QSGD (no random access
 * by index): all groups added in rank order, then one scaling pass. */
template <typename S>
static int64_t vgc_sum_sequential(vgc_group **heads, int p, S *out,
                                  int64_t size, int apply_scale,
                                  double scale_d) {
    const S scale = (S)scale_d;
    memset(out, 0, sizeof(S) * size);
    int64_t added = 0;
    for (int b = 0; b < p; ++b) {
        if (!heads[b]) continue;
        vgc_group &g = *heads[b];
        vgc_group_start(g);
        for (int64_t j = 0; j < (int64_t)g.count; ++j) {
            out[vgc_group_index(g)] += vgc_group_value<S>(g);
            vgc_group_advance(g);
        }
        added += g.count;
    }
    if (apply_scale)
        for (int64_t i = 0; i < size; ++i) out[i] *= scale;
    return added;
}

/* ---- exported API ------------------------------------------------------ */

template <typename T> struct vgc_tag { typedef T type; };

/* f(gradient type tag, state type tag) for a gradient dtype code: float16
 * and float32 gradients keep float32 state, float64 float64. */
template <typename F> static int64_t vgc_dispatch(int gcode, F f) {
    switch (gcode) {
    case VGC_F16: return f(vgc_tag<vgc_half>(), vgc_tag<float>());
    case VGC_F32: return f(vgc_tag<float>(), vgc_tag<float>());
    default: return f(vgc_tag<double>(), vgc_tag<double>());
    }
}

/* G and S from the tags of a vgc_dispatch lambda. */
#define VGC_TYPES(gt, st)                                                      \
    typedef typename decltype(gt)::type G;                                     \
    typedef typename decltype(st)::type S

extern "C" {

int vgc_native_abi(void) { return 1; }

/* Instruction set this build was compiled for, and whether this processor
 * runs the AVX2 build (asked of the baseline build before loading it). */
const char *vgc_native_isa(void) {
#if defined(__AVX2__)
    return "avx2";
#else
    return "baseline";
#endif
}

int vgc_native_cpu_has_avx2(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

const char *vgc_native_source_hash(void) {
#ifdef VGC_SOURCE_HASH
    return VGC_SOURCE_HASH;
#else
    return "";
#endif
}

void vgc_native_constants(int64_t *c) {
    c[0] = VGC_MAGIC;
    c[1] = VGC_FMT_POW2;
    c[2] = VGC_FMT_RAW;
    c[3] = VGC_FMT_QSGD;
    c[4] = VGC_HEADER_WORDS;
    c[5] = VGC_INDEX_BITS;
    c[6] = VGC_MAX_D;
    c[7] = VGC_LOG2_ZERO;
    c[8] = VGC_RAW_DENSE;
    c[9] = VGC_RAW_FLOAT64;
    c[10] = VGC_QSGD_OFFSET_BITS;
    c[11] = VGC_QSGD_RECORD_WORDS;
    c[12] = VGC_FMT_GAP;
    c[13] = VGC_GAP_ESCAPE;
    c[14] = VGC_GAP_SIGN_ONLY;
    c[15] = VGC_GAP_PARAM_WORDS;
}

void vgc_native_set_threads(int n) { vgc_threads = n > 0 ? n : 0; }

int vgc_native_threads(void) { return vgc_nthreads(); }

void *vgc_native_workspace_new(void) { return new vgc_workspace(); }

void vgc_native_workspace_free(void *ws) { delete (vgc_workspace *)ws; }

/* gcode: dtype of g (VGC_F16/F32/F64); s, r, v are in the state dtype
 * (float64 for F64, else float32).  info = {words, elements sent, flags}. */
int64_t vgc_native_vgc(void *ws, int tid, int gcode, const void *g,
                       const void *s, const void *r_in, const void *v_in,
                       void *r_out, void *v_out, int64_t n, double alpha,
                       double zeta, int quantize, int keep_unrep, int coding,
                       uint32_t *out, int64_t *info) {
    return vgc_dispatch(gcode, [&](auto gt, auto st) {
        VGC_TYPES(gt, st);
        return vgc_basic<G, S>((vgc_workspace *)ws, tid, (const G *)g,
                               (const S *)s, (const S *)r_in,
                               (const S *)v_in, (S *)r_out, (S *)v_out, n,
                               alpha, zeta, quantize, keep_unrep, coding, out,
                               info);
    });
}

int64_t vgc_native_hybrid(void *ws, int tid, int gcode, const void *g,
                          const void *s, const void *r_in, const void *v_in,
                          void *r_out, void *v_out, int64_t n, double alpha,
                          double zeta, double tau, int coding, uint32_t *out,
                          int64_t *info) {
    return vgc_dispatch(gcode, [&](auto gt, auto st) {
        VGC_TYPES(gt, st);
        return vgc_hybrid<G, S>((vgc_workspace *)ws, tid, (const G *)g,
                                (const S *)s, (const S *)r_in,
                                (const S *)v_in, (S *)r_out, (S *)v_out, n,
                                alpha, zeta, tau, coding, out, info);
    });
}

int64_t vgc_native_strom(void *ws, int tid, int gcode, const void *g,
                         const void *r_in, void *r_out, int64_t n, double tau,
                         int coding, uint32_t *out, int64_t *info) {
    return vgc_dispatch(gcode, [&](auto gt, auto st) {
        VGC_TYPES(gt, st);
        return vgc_strom<G, S>((vgc_workspace *)ws, tid, (const G *)g,
                               (const S *)r_in, (S *)r_out, n, tau, coding,
                               out, info);
    });
}

int64_t vgc_native_qsgd(void *ws, int tid, int gcode, const void *g,
                        const void *u, int64_t n, int64_t bucket, int levels,
                        uint32_t *out, int64_t *info) {
    return vgc_dispatch(gcode, [&](auto gt, auto st) {
        VGC_TYPES(gt, st);
        return vgc_qsgd<G, S>((vgc_workspace *)ws, tid, (const G *)g,
                              (const S *)u, n, bucket, levels, out, info);
    });
}

int64_t vgc_native_none(void *ws, int tid, int gcode, const void *g,
                        int64_t n, uint32_t *out, int64_t *info) {
    return vgc_dispatch(gcode, [&](auto gt, auto st) {
        VGC_TYPES(gt, st);
        return vgc_none<G, S>((vgc_workspace *)ws, tid, (const G *)g, n, out,
                              info);
    });
}

/* codec.rice_parameter(count, size). */
int vgc_native_rice_parameter(int64_t count, int64_t size) {
    return vgc_rice_parameter(count, size);
}

/* codec.gap_body: the FMT_GAP body of the elements index[count] (strictly
 * increasing, >= 0) with table entries nib[count] (sign << 3 | d; only
 * the sign, nib >> 3, is written with sign_only), Rice parameter k
 * (0..63).  out NULL: only returns the body's words.  Returns -1 for
 * invalid arguments. */
int64_t vgc_native_gap_encode(const int64_t *index, const uint8_t *nib,
                              int64_t count, int k, int sign_only,
                              uint32_t *out) {
    if (count < 0 || k < 0 || k > 63) return -1;
    for (int64_t j = 0; j < count; ++j)
        if (index[j] < 0 || (j && index[j] <= index[j - 1]) || nib[j] > 15)
            return -1;
    auto each = [&](auto f) {
        for (int64_t j = 0; j < count; ++j) f(index[j], (uint32_t)nib[j]);
    };
    const uint64_t bits = vgc_gap_stream_bits(each, k);
    if ((bits + 31) / 32 > 0xFFFFFFFFu) return -1;
    if (!out)
        return VGC_GAP_PARAM_WORDS + (int64_t)((bits + 31) / 32) +
               vgc_gap_value_words(count, sign_only != 0);
    return vgc_gap_write_body(each, count, bits, k, sign_only != 0, out);
}

/* codec.gap_decode_body: decodes and checks the FMT_GAP body of len words
 * (exactly the body) of a group of count elements over one index space of
 * size elements (the span bits 8..31 of the param word are ignored);
 * writes index[count], nib[count] (sign << 3 | d).  Returns VGC_OK or
 * VGC_BAD_MESSAGE. */
int vgc_native_gap_decode(const uint32_t *body, int64_t len, int64_t count,
                          int64_t size, int64_t *index, uint8_t *nib) {
    return vgc_gap_decode(body, len, count, size, index, nib)
               ? VGC_OK
               : VGC_BAD_MESSAGE;
}

/* Validates the p messages, then writes for every tensor t with outs[t]
 * (state dtype scodes[t]) the sum of the messages' elements in rank order,
 * times scale where apply_scale[t]; touched[t] = elements written,
 * elements[b] = elements message b carries.  Returns VGC_OK, or
 * VGC_BAD_MESSAGE with bad[0] = the first invalid message (nothing is
 * written then). */
int vgc_native_decode(int p, const uint32_t *const *blocks,
                      const int64_t *lens, int n_tensors,
                      const int64_t *sizes, const int *scodes,
                      void *const *outs, const int *apply_scale, double scale,
                      int64_t *touched, int64_t *elements, int64_t *bad) {
    /* the decoded FMT_GAP groups (the groups point into them) */
    std::vector<std::unique_ptr<int64_t[]> > gap_scratch;
    std::vector<vgc_group> groups((size_t)p * n_tensors);
    int threads = vgc_nthreads();
    std::vector<char> valid(p);
    std::vector<std::vector<vgc_gap_job> > msg_jobs(p);
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && p > 1)
#endif
    for (int b = 0; b < p; ++b) {
        vgc_group *row = groups.data() + (size_t)b * n_tensors;
        for (int t = 0; t < n_tensors; ++t) row[t].body = NULL;
        valid[b] = vgc_walk(blocks[b], lens[b], n_tensors, sizes, scodes, row,
                            elements + b, &msg_jobs[b]);
    }
    /* the FMT_GAP groups of the messages valid so far: decoded and checked
     * in parallel, largest first, each into its own scratch (indices, then
     * table entries; one block per group, malloc reuses those of earlier
     * calls) */
    std::vector<vgc_gap_job> jobs;
    for (int b = 0; b < p; ++b) {
        if (!valid[b]) continue;
        for (size_t j = 0; j < msg_jobs[b].size(); ++j) {
            vgc_gap_job job = msg_jobs[b][j];
            job.msg = b;
            jobs.push_back(job);
        }
    }
    if (!jobs.empty()) {
        std::sort(jobs.begin(), jobs.end(),
                  [](const vgc_gap_job &x, const vgc_gap_job &y) {
                      return x.count > y.count;
                  });
        gap_scratch.resize(jobs.size());
        std::vector<char> ok(jobs.size());
        const int n_jobs = (int)jobs.size();
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && n_jobs > 1)
#endif
        for (int j = 0; j < n_jobs; ++j) {
            const vgc_gap_job &job = jobs[j];
            gap_scratch[j].reset(new int64_t[job.count + (job.count + 7) / 8]);
            int64_t *index = gap_scratch[j].get();
            ok[j] = vgc_check_gap(groups.data() + (size_t)job.msg * n_tensors,
                                  job.tid, job.span, sizes, scodes, job.body,
                                  job.length, job.span_size, job.count, job.a,
                                  job.b, index,
                                  (uint8_t *)(index + job.count));
        }
        for (int j = 0; j < n_jobs; ++j)
            if (!ok[j]) valid[jobs[j].msg] = 0;
    }
    for (int b = 0; b < p; ++b)
        if (!valid[b]) {
            bad[0] = b;
            return VGC_BAD_MESSAGE;
        }
    /* work items: (tensor, range); large tensors are cut into one range
     * per thread where every group allows access by index */
    struct item { int t; int64_t lo, hi; int64_t added; };
    std::vector<item> items;
    for (int t = 0; t < n_tensors; ++t) {
        touched[t] = 0;
        if (!outs[t]) continue;
        bool by_index = true;
        for (int b = 0; b < p; ++b) {
            const vgc_group &g = groups[(size_t)b * n_tensors + t];
            by_index &= !g.body || g.fmt != VGC_FMT_QSGD;
        }
        int pieces = (by_index && sizes[t] >= VGC_PARALLEL_MIN) ? threads : 1;
        if (pieces < 1) pieces = 1;
        for (int k = 0; k < pieces; ++k) {
            item it = {t, sizes[t] * k / pieces, sizes[t] * (k + 1) / pieces,
                       0};
            if (!by_index) it.lo = -1; /* whole tensor, sequentially */
            items.push_back(it);
        }
    }
    const int n_items = (int)items.size();
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && n_items > 1)
#endif
    for (int k = 0; k < n_items; ++k) {
        item &it = items[k];
        const int t = it.t;
        std::vector<vgc_group *> heads(p);
        for (int b = 0; b < p; ++b) {
            vgc_group *g = &groups[(size_t)b * n_tensors + t];
            heads[b] = g->body ? g : NULL;
        }
        const bool f64 = scodes[t] == VGC_F64;
        if (it.lo < 0)
            it.added = f64 ? vgc_sum_sequential<double>(
                                 heads.data(), p, (double *)outs[t], sizes[t],
                                 apply_scale[t], scale)
                           : vgc_sum_sequential<float>(
                                 heads.data(), p, (float *)outs[t], sizes[t],
                                 apply_scale[t], scale);
        else
            it.added = f64 ? vgc_sum_range<double>(
                                 heads.data(), p, (double *)outs[t], it.lo,
                                 it.hi, apply_scale[t], scale)
                           : vgc_sum_range<float>(
                                 heads.data(), p, (float *)outs[t], it.lo,
                                 it.hi, apply_scale[t], scale);
    }
    for (int k = 0; k < n_items; ++k) touched[items[k].t] += items[k].added;
    return VGC_OK;
}

} /* extern "C" */
