/*
 * chainer-vgc native CPU backend: what every part shares.  The wire-format
 * constants of chainer_vgc.codec (#define VGC_..., checked by
 * tests/test_wire_constants.py), the dtype / flag / coding codes shared
 * with chainer_vgc/native.py, the thread setting, element access (loads,
 * finiteness checks, non-temporal stores) and the per-chunk staging
 * (vgc_chunk, vgc_workspace, vgc_plan, vgc_for_chunks, the message header).
 *
 * An internal header of the native CPU backend: included once, by
 * vgc_host.cpp (the one translation unit, so that the hot paths inline
 * across these files); not a public interface.
 */
#ifndef CHAINER_VGC_HOST_COMMON_H
#define CHAINER_VGC_HOST_COMMON_H

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

/* Wire-format constants of chainer_vgc/codec/constants.py (checked by the
   tests; VGC_MAGIC, VGC_FMT_POW2, VGC_FMT_RAW, VGC_FMT_GAP,
   VGC_HEADER_WORDS, VGC_RAW_DENSE, VGC_RAW_FLOAT64, VGC_GAP_SIGN_ONLY and
   VGC_GAP_PARAM_WORDS come with vgc_numerics.cuh). */
#define VGC_FMT_QSGD 3u
#define VGC_QSGD_OFFSET_BITS 23
#define VGC_QSGD_RECORD_WORDS 4
/* FMT_GAP param word: bits 8..31 the span (the tensors after the group's
 * first that the group also covers; docs: addendum v2); bit 7,
 * VGC_GAP_RESTARTS, comes with vgc_numerics.cuh */
#define VGC_GAP_SPAN_SHIFT 8
/* FMT_SPARSE: FMT_GAP's indices, float16 or (flag b bit 0) float32 values
 * scaled by 2**a (chainer_vgc/codec/sparse.py) */
#define VGC_FMT_SPARSE 5u
#define VGC_SPARSE_FLOAT32 1u

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

/* vgc_finite(x): kernels/vgc_numerics.cuh */

/* FMT_SPARSE's float16 values (IEEE binary16 bits), as NumPy converts:
 * a double rounded to the nearest float16, ties to even, subnormals
 * included, overflow to infinity (a float's conversion is the same: the
 * double holds it exactly) */
static inline uint32_t vgc_half_bits(double x) {
    const uint32_t s = std::signbit(x) ? 0x8000u : 0u;
    const double a = std::fabs(x);
    if (std::isnan(a)) return s | 0x7E00u;
    if (a >= 65520.0) return s | 0x7C00u; /* rounds past 65504 */
    if (a < 6.103515625e-05) /* below 2**-14: units of 2**-24 (1024 is the
                                smallest normal's bits, also right) */
        return s | (uint32_t)std::nearbyint(a * 16777216.0);
    int e;
    double m = std::nearbyint(std::ldexp(std::frexp(a, &e), 11));
    if (m == 2048.0) {
        m = 1024.0;
        ++e;
    }
    return s | (uint32_t)(e + 14) << 10 | ((uint32_t)m - 1024u);
}

/* and back, exactly */
static inline double vgc_half_to_double(uint32_t h) {
    const uint32_t e = (h >> 10) & 31, f = h & 1023;
    double v = e == 0    ? std::ldexp((double)f, -24)
               : e == 31 ? (f ? NAN : INFINITY)
                         : std::ldexp((double)(f | 1024), (int)e - 25);
    return (h >> 15) ? -v : v;
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
     * bits, where its codes start in their section, and
     * the words of the two sections it shares with its neighbours */
    int64_t gap_prev;
    uint64_t gap_bits, gap_start;
    /* the bits of its codes before each restart point among them */
    std::vector<uint64_t> restart_bits;
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

#endif /* CHAINER_VGC_HOST_COMMON_H */
