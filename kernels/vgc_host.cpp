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
 *     tensor's size is allocated: one read of g, s, r, v and one write of
 *     r, v.  In place (r_out == r_in, the default), with ordinary stores,
 *     after vgc_native_check_inputs checked every input of the step and
 *     the workers agreed on it; or into *other* arrays (r_out, v_out, the
 *     spare residuals) with non-temporal stores, the caller keeping the
 *     old state when any check fails (it swaps the arrays only on
 *     success).
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
 *
 * The source, one translation unit (this file) and its internal headers,
 * each included once here, so that every hot call inlines as before:
 *   vgc_host_common.h  wire-format constants (#define VGC_...), codes,
 *                      element access, per-chunk staging;
 *   vgc_gap_coder.h    FMT_GAP: the gap coder and vgc_emit;
 *   vgc_blocks.h       blocks, staging the selected lanes, the block loop;
 *   vgc_passes.h       the rules' compress passes (vgc, hybrid, strom,
 *                      none, qsgd);
 *   vgc_decode.h       decode;
 *   this file          the exported C ABI (extern "C" vgc_native_*).
 * All of them and vgc_numerics.cuh are hashed into VGC_SOURCE_HASH
 * (setup.py NATIVE_SOURCES, chainer_vgc/native.py SOURCES).
 */
#include "vgc_host_common.h"
#include "vgc_gap_coder.h"
#include "vgc_blocks.h"
#include "vgc_passes.h"
#include "vgc_decode.h"

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
    c[16] = VGC_GAP_RESTART_CODES;
    c[17] = VGC_GAP_RESTART_WORDS;
    c[18] = VGC_FMT_SPARSE;
    c[19] = VGC_SPARSE_FLOAT32;
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

/* DGC's step (vgc_passes.h: vgc_dgc); k the elements to select */
int64_t vgc_native_dgc(void *ws, int tid, int gcode, const void *g,
                       const void *r_in, const void *u_in, void *r_out,
                       void *u_out, int64_t n, double clip, double momentum,
                       int masking, int64_t k, int float32_values,
                       uint32_t *out, int64_t *info) {
    return vgc_dispatch(gcode, [&](auto gt, auto st) {
        VGC_TYPES(gt, st);
        return vgc_dgc<G, S>((vgc_workspace *)ws, tid, (const G *)g,
                             (const S *)r_in, (const S *)u_in, (S *)r_out,
                             (S *)u_out, n, clip, momentum, masking, k,
                             float32_values, out, info);
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

/* The inputs' checks of an in-place step, before any state moves: for
 * tensor k = n_tensors - 1 down to 0 (so that the first tensors, which the
 * passes compress first, are the ones left in the cache), flags[k] =
 * VGC_BAD_GRAD | VGC_BAD_SQSUM of g[k] (dtype code gcodes[k]) and s[k]
 * (state dtype; NULL: not checked); a NULL g[k] gives 0. */
void vgc_native_check_inputs(void *ws, int n_tensors, const int *gcodes,
                             const void *const *g, const void *const *s,
                             const int64_t *sizes, int32_t *flags) {
    for (int k = n_tensors - 1; k >= 0; --k) {
        flags[k] = 0;
        if (!g[k]) continue;
        flags[k] = (int32_t)vgc_dispatch(gcodes[k], [&](auto gt, auto st) {
            VGC_TYPES(gt, st);
            return (int64_t)vgc_check_inputs<G, S>(
                (vgc_workspace *)ws, (const G *)g[k], (const S *)s[k],
                sizes[k]);
        });
    }
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
        return VGC_GAP_PARAM_WORDS +
               VGC_GAP_RESTART_WORDS * vgc_gap_restarts(count) +
               (int64_t)((bits + 31) / 32) +
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
 * times scale where apply_scale[t] (with accumulate: outs[t] plus the
 * sum, every index not sent left as it was, no scaling); touched[t] =
 * elements written,
 * elements[b] = elements message b carries.  Returns VGC_OK, or
 * VGC_BAD_MESSAGE with bad[0] = the first invalid message (nothing is
 * written then).  With rows (room for p * n_tensors rows of
 * VGC_ROW_WORDS), each message's group table from row b * n_tensors on,
 * n_rows[b] rows (vgc_walk).  accumulate & VGC_DECODE_STRUCTURE (every
 * outs[t] NULL): the FMT_GAP groups' codes are not decoded (their
 * headers, lengths, value padding and value tables are checked, the
 * table in the state dtype of every tensor of the span): what is left
 * for the device decode to check (vgc_model_gap_expand, issue 36). */
#define VGC_DECODE_STRUCTURE 2
int vgc_native_decode(int p, const uint32_t *const *blocks,
                      const int64_t *lens, int n_tensors,
                      const int64_t *sizes, const int *scodes,
                      void *const *outs, const int *apply_scale, double scale,
                      int accumulate, int64_t *touched, int64_t *elements,
                      int64_t *bad, int64_t *rows, int64_t *n_rows) {
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
        valid[b] = vgc_walk(
            blocks[b], lens[b], n_tensors, sizes, scodes, row, elements + b,
            &msg_jobs[b],
            rows ? rows + (size_t)b * n_tensors * VGC_ROW_WORDS : NULL,
            rows ? n_rows + b : NULL);
    }
    const bool structure = (accumulate & VGC_DECODE_STRUCTURE) != 0;
    accumulate &= 1;
    if (structure) {
        for (int b = 0; b < p; ++b) {
            for (size_t j = 0; valid[b] && j < msg_jobs[b].size(); ++j) {
                const vgc_gap_job &job = msg_jobs[b][j];
                if (job.fmt == VGC_FMT_SPARSE) {
                    /* no device decode of its own: checked in full */
                    std::unique_ptr<int64_t[]> scratch(
                        new int64_t[2 * (size_t)job.count]);
                    vgc_group one;
                    if (!vgc_check_sparse(one, sizes[job.tid],
                                          scodes[job.tid], job.body,
                                          job.length, job.count, job.a,
                                          job.b, scratch.get(),
                                          (double *)(scratch.get() +
                                                     job.count)))
                        valid[b] = 0;
                    continue;
                }
                bool seen[2] = {false, false};
                for (int64_t t = job.tid; t <= job.tid + job.span; ++t) {
                    const int f64 = scodes[t] == VGC_F64;
                    if (seen[f64]) continue;
                    seen[f64] = true;
                    vgc_group g;
                    g.a = job.a;
                    g.b = job.b;
                    if (!vgc_pow2_table(g, f64)) valid[b] = 0;
                }
            }
            if (!valid[b]) {
                bad[0] = b;
                return VGC_BAD_MESSAGE;
            }
        }
        for (int t = 0; t < n_tensors; ++t) touched[t] = 0;
        return VGC_OK;
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
            vgc_group *row = groups.data() + (size_t)job.msg * n_tensors;
            if (job.fmt == VGC_FMT_SPARSE) { /* indices, float64 values */
                gap_scratch[j].reset(new int64_t[2 * (size_t)job.count]);
                int64_t *index = gap_scratch[j].get();
                ok[j] = vgc_check_sparse(row[job.tid], sizes[job.tid],
                                         scodes[job.tid], job.body,
                                         job.length, job.count, job.a,
                                         job.b, index,
                                         (double *)(index + job.count));
                continue;
            }
            gap_scratch[j].reset(new int64_t[job.count + (job.count + 7) / 8]);
            int64_t *index = gap_scratch[j].get();
            ok[j] = vgc_check_gap(row, job.tid, job.span, sizes, scodes,
                                  job.body, job.length, job.span_size,
                                  job.count, job.a, job.b, index,
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
                                 apply_scale[t], scale, accumulate != 0)
                           : vgc_sum_sequential<float>(
                                 heads.data(), p, (float *)outs[t], sizes[t],
                                 apply_scale[t], scale, accumulate != 0);
        else
            it.added = f64 ? vgc_sum_range<double>(
                                 heads.data(), p, (double *)outs[t], it.lo,
                                 it.hi, apply_scale[t], scale, accumulate != 0)
                           : vgc_sum_range<float>(
                                 heads.data(), p, (float *)outs[t], it.lo,
                                 it.hi, apply_scale[t], scale,
                                 accumulate != 0);
    }
    for (int k = 0; k < n_items; ++k) touched[items[k].t] += items[k].added;
    return VGC_OK;
}

} /* extern "C" */
