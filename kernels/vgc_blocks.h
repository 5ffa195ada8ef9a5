/*
 * chainer-vgc native CPU backend: the block machinery of the compress
 * passes.  A block is one cache line of the state (vgc_block); the new
 * state is stored non-temporally (vgc_store_block), the selected lanes of a
 * block are staged into the chunk (vgc_stage_signs, vgc_stage_selected,
 * AVX2 lane packing where built with it), and vgc_block_loop drives one
 * pass over a chunk.
 *
 * An internal header of the native CPU backend: included once, by
 * vgc_host.cpp (the one translation unit, so that the hot paths inline
 * across these files); not a public interface.
 */
#ifndef CHAINER_VGC_BLOCKS_H
#define CHAINER_VGC_BLOCKS_H

#include "vgc_host_common.h"

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

/* Stores a block of the new state: into a spare set (stream), where
 * nothing of this step reads it again, non-temporally where aligned (no
 * read-for-ownership of the destination); in place with ordinary stores,
 * since the block's line was just read and is in the cache (a
 * non-temporal store to a cached line evicts it: several times slower). */
template <typename S>
static inline void vgc_store_block(S *dst, const S *src, int n, bool stream) {
#if defined(__SSE2__)
    if (stream && n == vgc_block<S>::N && ((uintptr_t)dst & 15) == 0) {
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
 * rule keeps no v; in_place: r_out and v_out are the arrays the block was
 * read from). */
template <typename S, typename Arith, typename Stage>
static void vgc_block_loop(vgc_chunk &c, S *r_out, S *v_out, bool in_place,
                           Arith arith, Stage stage) {
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
        vgc_store_block(r_out + i0, rr, n, !in_place);
        if (v_out) vgc_store_block(v_out + i0, vv, n, !in_place);
    }
    if (!in_place) vgc_fence();
}

#endif /* CHAINER_VGC_BLOCKS_H */
