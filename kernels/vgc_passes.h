/*
 * chainer-vgc native CPU backend: the fused compress pass of each rule.
 * Fig. "Basic" (vgc: accumulate, criterion eq. 4, decay, quantize and
 * encode, Sec. 4.2), Fig. "Hybrid" and Strom's threshold method (+-tau, one
 * pass, sign words), none (the dense gradient, FMT_RAW) and QSGD
 * (Alistarh et al. 2017, a baseline of Table 1).
 *
 * An internal header of the native CPU backend: included once, by
 * vgc_host.cpp (the one translation unit, so that the hot paths inline
 * across these files); not a public interface.
 */
#ifndef CHAINER_VGC_PASSES_H
#define CHAINER_VGC_PASSES_H

#include "vgc_host_common.h"
#include "vgc_gap_coder.h"
#include "vgc_blocks.h"

/* ---- the inputs' checks before an in-place step ------------------------ */

/* The checks of vgc_check_range over whole blocks, lo to hi (hi - lo a
 * multiple of the block).  Not inlined: inlined into the chunk's lambda
 * beside the tail's loop, it read at about half the memory's speed
 * (measured in one binary: 22 ms against 11 ms for 25M float32 g and s,
 * two threads). */
template <bool SQSUM, typename G, typename S>
__attribute__((noinline)) static int
vgc_check_blocks(const G *__restrict g, const S *__restrict s, int64_t lo,
                 int64_t hi) {
    typedef typename vgc_lane<S>::I I;
    const int B = vgc_block<S>::N;
    I bad_g[B] = {0}, bad_s[B] = {0};
    for (int64_t i0 = hi - B; i0 >= lo; i0 -= B)
        for (int j = 0; j < B; ++j) {
            bad_g[j] |= (I)!vgc_finite(vgc_load<G, S>(g, i0 + j));
            if (SQSUM) bad_s[j] |= (I)!vgc_good_sqsum(s[i0 + j]);
        }
    return vgc_lane_flags(bad_g, SQSUM ? bad_s : (I *)NULL, (I *)NULL,
                          (I *)NULL, B);
}

/* Fault flags (VGC_BAD_GRAD, VGC_BAD_SQSUM) of g[lo, hi) and, with
 * SQSUM, s[lo, hi): the checks the fused passes make, read-only.  The
 * range is read from its end down to its start, so that the start, where
 * the pass that follows begins, is the part still in the cache. */
template <bool SQSUM, typename G, typename S>
static int vgc_check_range(const G *g, const S *s, int64_t lo, int64_t hi) {
    const int64_t full = hi - (hi - lo) % vgc_block<S>::N;
    int flags = 0;
    for (int64_t i = full; i < hi; ++i) {
        if (!vgc_finite(vgc_load<G, S>(g, i))) flags |= VGC_BAD_GRAD;
        if (SQSUM && !vgc_good_sqsum(s[i])) flags |= VGC_BAD_SQSUM;
    }
    return flags | vgc_check_blocks<SQSUM, G, S>(g, s, lo, full);
}

/* The flags of one tensor of n elements, over the chunks vgc_plan gives
 * the pass (each thread checks the chunk it then compresses). */
template <typename G, typename S>
static int vgc_check_inputs(vgc_workspace *ws, const G *g, const S *s,
                            int64_t n) {
    vgc_plan(ws, n);
    vgc_for_chunks(ws, [&](vgc_chunk &c) {
        c.flags = s ? vgc_check_range<true, G, S>(g, s, c.begin, c.end)
                    : vgc_check_range<false, G, S>(g, s, c.begin, c.end);
    });
    return vgc_flags(ws);
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
        c, r_out, v_out, r_out == r_in,
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
        c, r_out, v_out, r_out == r_in,
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
        c, r_out, (S *)NULL, r_out == r_in,
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

/* ---- DGC (Lin et al. 2018): top-k of the accumulated velocity -------- */

/* The accumulation of one chunk (clipping factor c applied where CLIP,
 * momentum m where MOM), u and r written to the *_out arrays, and the
 * candidates: the offsets in the chunk (c.words) and |r| (the staged
 * values) of the elements with |r| >= t and r != 0, in index order. */
template <bool CLIP, bool MOM, typename G, typename S>
static void vgc_dgc_pass(vgc_chunk &c, const G *g, const S *r_in,
                         const S *u_in, S *r_out, S *u_out, S clip, S m,
                         S t) {
    typedef typename vgc_lane<S>::I I;
    const int B = vgc_block<S>::N;
    const int64_t SCAN = 1024; /* the candidates' scan follows this many */
    I bad_g[B] = {0}, over[B] = {0};
    std::vector<S> &mags = vgc_stage<S>::values(c);
    for (int64_t s0 = c.begin; s0 < c.end; s0 += SCAN) {
        const int64_t s1 = std::min(c.end, s0 + SCAN);
        int64_t i = s0;
        for (; i + B <= s1; i += B)
            for (int j = 0; j < B; ++j) {
                S gi = vgc_load<G, S>(g, i + j);
                bad_g[j] |= (I)!vgc_finite(gi);
                if (CLIP) gi = gi * clip;
                const S ui = MOM ? u_in[i + j] * m + gi : gi;
                const S ri = r_in[i + j] + ui;
                over[j] |= (I)!vgc_finite(ri) | (I)!vgc_finite(ui);
                u_out[i + j] = ui;
                r_out[i + j] = ri;
            }
        for (; i < s1; ++i) {
            S gi = vgc_load<G, S>(g, i);
            bad_g[0] |= (I)!vgc_finite(gi);
            if (CLIP) gi = gi * clip;
            const S ui = MOM ? u_in[i] * m + gi : gi;
            const S ri = r_in[i] + ui;
            over[0] |= (I)!vgc_finite(ri) | (I)!vgc_finite(ui);
            u_out[i] = ui;
            r_out[i] = ri;
        }
        for (i = s0; i < s1; ++i) {
            const S a = std::fabs(r_out[i]);
            if (a >= t && a != (S)0) {
                vgc_reserve<S>(c, 1, true, false);
                c.words[c.count] = (uint32_t)(i - c.begin);
                mags[c.count++] = a;
            }
        }
    }
    c.flags = vgc_lane_flags(bad_g, (I *)NULL, over, (I *)NULL, B);
}

/* The FMT_SPARSE body of the sorted index[count] (param, G, restart
 * table, gap codes) of a tensor of n elements; the values' words follow
 * at the returned offset. */
static int64_t vgc_sparse_index_words(const int64_t *index, int64_t count,
                                      int64_t n, uint32_t *body) {
    const int k = vgc_rice_parameter(count, n);
    uint64_t bits = 0;
    for (int64_t j = 0, prev = -1; j < count; prev = index[j++])
        bits += (uint64_t)vgc_gap_code_length(index[j] - prev - 1, k);
    const int64_t G = (int64_t)((bits + 31) / 32);
    const int64_t T = VGC_GAP_RESTART_WORDS * vgc_gap_restarts(count);
    body[0] = (uint32_t)k | (T ? VGC_GAP_RESTARTS : 0u);
    body[1] = (uint32_t)G;
    uint32_t *table = body + VGC_GAP_PARAM_WORDS;
    vgc_bit_writer gaps(table + T);
    for (int64_t j = 0, prev = -1; j < count; prev = index[j++]) {
        if (j && j % VGC_GAP_RESTART_CODES == 0)
            vgc_put_restart(table, j / VGC_GAP_RESTART_CODES,
                            32 * (gaps.wi - gaps.first) + gaps.nb, prev);
        gaps.code((uint64_t)(index[j] - prev - 1), k);
    }
    if (count) gaps.store_edges();
    return VGC_GAP_PARAM_WORDS + T + G;
}

/* DGC's step on one tensor of n elements (chainer_vgc/rules/dgc.py, bit
 * for bit): clipping and momentum correction in one pass over the
 * chunks, the k elements of largest |r| (ties by the lower index, zeros
 * never) found among the candidates above a threshold estimated from a
 * sample (every element when the sample's threshold lets fewer than k
 * through), then their values as FMT_SPARSE's float16 (or float32) and
 * r reduced by what the receivers decode, u zeroed where sent
 * (masking).  info: words, elements, flags. */
template <typename G, typename S>
static int64_t vgc_dgc(vgc_workspace *ws, int tid, const G *g,
                       const S *r_in, const S *u_in, S *r_out, S *u_out,
                       int64_t n, double clip_d, double m_d, int masking,
                       int64_t k, int float32_values, uint32_t *out,
                       int64_t *info) {
    info[0] = info[1] = info[2] = 0;
    if (n == 0) return 0;
    const S clip = (S)clip_d, m = (S)m_d;
    const bool use_clip = clip_d != 1.0, mom = m_d != 0.0;
    /* the threshold: the (1.5 k s / n + 8)-th largest |r| of s sampled
     * elements, computed as the pass will (only a guess: the selection
     * is exact whatever it is); the sample is s / 16 runs of 16
     * consecutive elements spread over the tensor, a cache line of each
     * array a run, so that it costs a few thousand lines, not one a
     * sampled element */
    S t = 0;
    const int64_t RUN = 16;
    const int64_t s = RUN * std::min<int64_t>(
        n / RUN, std::max<int64_t>(4096, n / 1024) / RUN);
    const int64_t want = s ? (int64_t)std::ceil(1.5 * (double)k * s / n) + 8
                           : 0;
    if (n > 16384 && want < s) {
        std::vector<S> sample((size_t)s);
        const int64_t runs = s / RUN;
        for (int64_t q = 0; q < runs; ++q) {
            const int64_t i0 = q * (n / runs);
            for (int64_t j = 0; j < RUN; ++j) {
                const int64_t i = i0 + j;
                S gi = vgc_load<G, S>(g, i);
                if (use_clip) gi = gi * clip;
                const S ui = mom ? u_in[i] * m + gi : gi;
                sample[q * RUN + j] = std::fabs(r_in[i] + ui);
            }
        }
        std::nth_element(sample.begin(), sample.begin() + (s - want),
                         sample.end());
        t = sample[s - want];
        if (!(t >= (S)0)) t = 0; /* (a NaN: flagged by the pass) */
    }
    vgc_plan(ws, n);
    vgc_for_chunks(ws, [&](vgc_chunk &c) {
        if (use_clip)
            mom ? vgc_dgc_pass<true, true, G, S>(c, g, r_in, u_in, r_out,
                                                 u_out, clip, m, t)
                : vgc_dgc_pass<true, false, G, S>(c, g, r_in, u_in, r_out,
                                                  u_out, clip, m, t);
        else
            mom ? vgc_dgc_pass<false, true, G, S>(c, g, r_in, u_in, r_out,
                                                  u_out, clip, m, t)
                : vgc_dgc_pass<false, false, G, S>(c, g, r_in, u_in, r_out,
                                                   u_out, clip, m, t);
    });
    info[2] = vgc_flags(ws);
    if (info[2]) return 0; /* the compressor raises; nothing is sent */
    /* the candidates, chunk by chunk in index order; when t let fewer
     * than k through, every nonzero element instead (a second look at the
     * tensor, into the first chunk's staging) */
    int64_t total = 0;
    for (size_t q = 0; q < ws->chunks.size(); ++q)
        total += ws->chunks[q].count;
    if (total < k && t > (S)0) {
        for (size_t q = 1; q < ws->chunks.size(); ++q)
            ws->chunks[q].count = 0;
        vgc_chunk &c0 = ws->chunks[0];
        c0.count = 0;
        for (int64_t i = 0; i < n; ++i) {
            const S a = std::fabs(r_out[i]);
            if (a != (S)0) {
                vgc_reserve<S>(c0, 1, true, false);
                c0.words[c0.count] = (uint32_t)(i - c0.begin);
                vgc_stage<S>::values(c0)[c0.count++] = a;
            }
        }
        total = c0.count;
    }
    /* the k largest, ties at the k-th by the lower index (kth: the k-th
     * largest |r|, found in a copy of the candidates' magnitudes) */
    S kth = 0;
    int64_t ties = 0;
    if (total > k) {
        std::vector<S> tmp;
        tmp.reserve((size_t)total);
        for (size_t q = 0; q < ws->chunks.size(); ++q) {
            const std::vector<S> &mags = vgc_stage<S>::values(ws->chunks[q]);
            tmp.insert(tmp.end(), mags.begin(),
                       mags.begin() + ws->chunks[q].count);
        }
        std::nth_element(tmp.begin(), tmp.begin() + (total - k), tmp.end());
        kth = tmp[total - k];
        int64_t above = 0;
        for (int64_t j = 0; j < total; ++j) above += tmp[j] > kth;
        ties = k - above;
    }
    std::vector<int64_t> sel;
    sel.reserve((size_t)std::min(total, k));
    for (size_t q = 0; q < ws->chunks.size(); ++q) {
        vgc_chunk &c = ws->chunks[q];
        const std::vector<S> &mags = vgc_stage<S>::values(c);
        for (int64_t j = 0; j < c.count; ++j)
            if (total <= k || mags[j] > kth ||
                (mags[j] == kth && ties-- > 0))
                sel.push_back(c.begin + (int64_t)c.words[j]);
    }
    if (sel.empty()) return 0;
    /* the values: float32 as they are (float32 values, float32 state), or
     * divided by 2**x (x = floor(log2 max |v|) - 14) and rounded */
    S top = 0;
    for (size_t j = 0; j < sel.size(); ++j)
        top = std::max(top, std::fabs(r_out[sel[j]]));
    const bool exact = float32_values && sizeof(S) == 4;
    const int e = vgc_floor_log2(top);
    if (!exact && e == VGC_LOG2_ZERO) return 0; /* all subnormal */
    const int x = exact ? 0 : e - 14;
    std::vector<int64_t> keep;
    std::vector<uint32_t> wire;
    keep.reserve(sel.size());
    wire.reserve(sel.size());
    for (size_t j = 0; j < sel.size(); ++j) {
        const int64_t i = sel[j];
        const S v = r_out[i];
        uint32_t w;
        double back;
        if (exact) {
            memcpy(&w, &v, 4);
            back = (double)v;
        } else if (float32_values) {
            const float f = (float)std::ldexp((double)v, -x);
            memcpy(&w, &f, 4);
            back = (double)f;
        } else {
            w = vgc_half_bits(std::ldexp((double)v, -x));
            back = vgc_half_to_double(w);
        }
        if (back == 0.0) continue; /* rounds to zero: not sent */
        const S sent = (S)std::ldexp(back, x);
        r_out[i] = v - sent;
        if (masking && sent != (S)0) u_out[i] = 0;
        keep.push_back(i);
        wire.push_back(w);
    }
    const int64_t count = (int64_t)keep.size();
    if (count == 0) return 0;
    uint32_t *body = out + VGC_HEADER_WORDS;
    int64_t words = vgc_sparse_index_words(keep.data(), count, n, body);
    uint32_t *v = body + words;
    if (float32_values) {
        memcpy(v, wire.data(), 4 * (size_t)count);
        words += count;
    } else {
        for (int64_t j = 0; j < count; j += 2)
            v[j / 2] = wire[j] | (j + 1 < count ? wire[j + 1] << 16 : 0u);
        words += (count + 1) / 2;
    }
    vgc_header(out, tid, VGC_FMT_SPARSE, count, (uint32_t)x,
               float32_values ? VGC_SPARSE_FLOAT32 : 0u);
    info[0] = VGC_HEADER_WORDS + words;
    info[1] = count;
    return info[0];
}

#endif /* CHAINER_VGC_PASSES_H */
