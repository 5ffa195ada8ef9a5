/*
 * chainer-vgc native CPU backend: decode.  Validates every message
 * completely (the checks of codec.unpack; FMT_GAP bodies decoded by
 * vgc_gap_decode), then per tensor merges the p messages' sorted index
 * lists into the zeroed output in rank order and applies the 1/p mean once.
 *
 * An internal header of the native CPU backend: included once, by
 * vgc_host.cpp (the one translation unit, so that the hot paths inline
 * across these files); not a public interface.
 */
#ifndef CHAINER_VGC_DECODE_H
#define CHAINER_VGC_DECODE_H

#include "vgc_host_common.h"
#include "vgc_gap_coder.h"

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
    /* FMT_GAP: this tensor's elements of the group, decoded by
     * vgc_check_gap: indices over the group's span and table entries
     * (sign << 3 | d), count of each; a segment of the group's scratch
     * arrays when the group spans several tensors.  An element's index in
     * this tensor is gap_index[j] - gap_base (the tensor's offset in the
     * span: the decoded indices are not rewritten) */
    const int64_t *gap_index;
    const uint8_t *gap_nibble;
    int64_t gap_base;
    /* FMT_SPARSE: its indices in gap_index (gap_base 0) and its values,
     * each wire value times 2**x in float64 (exact there; the one
     * rounding is the cast to the state dtype), decoded by
     * vgc_check_sparse */
    const double *sparse_value;
};

/* A FMT_GAP or FMT_SPARSE group found by vgc_walk, decoded afterwards
 * (vgc_check_gap, vgc_check_sparse: all groups of all messages in
 * parallel). */
struct vgc_gap_job {
    const uint32_t *body;
    int64_t length, tid, span, span_size;
    uint32_t count, a, b, fmt;
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
    case VGC_FMT_SPARSE:
        return g.gap_index[g.pos] - g.gap_base;
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
    case VGC_FMT_SPARSE:
        return (S)g.sparse_value[g.pos];
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
        /* the indices increase: this tensor's segment ends at the first
         * index >= end */
        const int64_t e =
            span ? std::lower_bound(index + j, index + count, end) - index
                 : (int64_t)count;
        if (e > j) {
            vgc_group &g = groups[t];
            g.body = body;
            g.fmt = VGC_FMT_GAP;
            g.count = (uint32_t)(e - j);
            g.a = a;
            g.b = b;
            g.gap_index = index + j;
            g.gap_nibble = nib + j;
            g.gap_base = offset;
            /* the table in this tensor's state dtype; every entry finite
             * and nonzero, so every value of the segment is */
            if (!vgc_pow2_table(g, scodes[t] == VGC_F64)) return false;
        }
        j = e;
        offset = end;
    }
    return j == (int64_t)count; /* always: every index < span_size */
}

/* Decodes and validates a FMT_SPARSE group of a tensor of size
 * elements in state dtype scode (header fields count, a = x, b = flags;
 * body of body_words words at body): its indices to index[count], its
 * values (wire value times 2**x, float64) to value[count], each finite
 * as sent and once cast to the state dtype; g then reads them. */
static bool vgc_check_sparse(vgc_group &g, int64_t size, int scode,
                             const uint32_t *body, int64_t body_words,
                             uint32_t count, uint32_t a, uint32_t b,
                             int64_t *index, double *value) {
    const int64_t V = vgc_sparse_value_words(count, b);
    if (body_words < V) return false;
    const uint32_t *v = body + body_words - V;
    const bool f32 = (b & VGC_SPARSE_FLOAT32) != 0;
    if (!f32 && (count & 1) && (v[V - 1] >> 16)) return false; /* padding */
    if (!vgc_gap_decode_indices(body, body_words, count, size, V, index))
        return false;
    const int x = (int)(int32_t)a;
    const bool f64 = scode == VGC_F64;
    uint32_t bad = 0;
    for (int64_t j = 0; j < (int64_t)count; ++j) {
        const double w = f32 ? (double)vgc_word_float(v + j)
                             : vgc_half_to_double((v[j >> 1] >> (16 * (j & 1)))
                                                  & 0xFFFFu);
        const double d = std::ldexp(w, x < -2200 ? -2200 : x > 2200 ? 2200 : x);
        value[j] = d;
        bad |= (uint32_t)!(vgc_finite(w) && (f64 ? vgc_finite(d)
                                                 : vgc_finite((float)d)));
    }
    if (bad) return false;
    g.body = body;
    g.fmt = VGC_FMT_SPARSE;
    g.count = count;
    g.a = a;
    g.b = b;
    g.gap_index = index;
    g.gap_base = 0;
    g.sparse_value = value;
    return true;
}

/* Words of a row of the group table that vgc_walk writes when asked:
 * tensor id, format, count, a, b, the body's first word in the message,
 * span (FMT_GAP: tensors after the first; else 0) */
#define VGC_ROW_WORDS 7

/* Walks and validates one message (as codec._walk + codec.unpack); fills
 * groups[tid] for the tensors it carries and adds its element count.
 * FMT_GAP groups are only queued in jobs (their header and the cheap
 * checks done): the message is valid iff this returns true and
 * vgc_check_gap accepts each of them.  With rows (room for n_tensors
 * rows), the group table too: VGC_ROW_WORDS words a group, *n_rows of
 * them. */
static bool vgc_walk(const uint32_t *m, int64_t len, int n_tensors,
                     const int64_t *sizes, const int *scodes,
                     vgc_group *groups, int64_t *elements,
                     std::vector<vgc_gap_job> *jobs, int64_t *rows,
                     int64_t *n_rows) {
    if (len < 2 || m[0] != VGC_MAGIC) return false;
    int64_t n_groups = m[1], pos = 2, last = -1;
    *elements = 0;
    if (n_rows) *n_rows = 0;
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
        const bool gap_coded = fmt == VGC_FMT_GAP || fmt == VGC_FMT_SPARSE;
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
            length = VGC_GAP_PARAM_WORDS +
                     VGC_GAP_RESTART_WORDS * vgc_gap_restarts(count) +
                     (int64_t)m[pos + 1] +
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
        } else if (fmt == VGC_FMT_SPARSE) {
            /* FMT_GAP's index part (no SIGN_ONLY, no span), then the
             * values */
            if (pos + VGC_GAP_PARAM_WORDS > len) return false;
            if ((m[pos] & VGC_GAP_SIGN_ONLY) || (m[pos] >> VGC_GAP_SPAN_SHIFT) ||
                (b & ~(uint32_t)VGC_SPARSE_FLOAT32))
                return false;
            length = VGC_GAP_PARAM_WORDS +
                     VGC_GAP_RESTART_WORDS * vgc_gap_restarts(count) +
                     (int64_t)m[pos + 1] + vgc_sparse_value_words(count, b);
        } else {
            return false;
        }
        if (pos + length > len) return false;
        if (fmt == VGC_FMT_SPARSE) {
            const uint32_t *body = m + pos;
            if (((body[0] & VGC_GAP_RESTARTS) != 0) !=
                    (vgc_gap_restarts(count) > 0) ||
                (int64_t)count > 32 * (int64_t)body[1])
                return false;
            vgc_gap_job job = {body, length, tid, 0, size,
                               count, a, b, fmt, 0};
            jobs->push_back(job);
        } else if (fmt == VGC_FMT_GAP) {
            /* the cheap checks now (reserved bit, at least a bit per code,
             * value padding), the decoding later (vgc_check_gap) */
            const uint32_t *body = m + pos;
            const int64_t G = body[1];
            if (((body[0] & VGC_GAP_RESTARTS) != 0) !=
                    (vgc_gap_restarts(count) > 0) ||
                (int64_t)count > 32 * G)
                return false;
            const uint64_t vbits =
                (uint64_t)count * ((body[0] & VGC_GAP_SIGN_ONLY) ? 1 : 4);
            if ((vbits & 31) && (body[length - 1] >> (vbits & 31)))
                return false;
            vgc_gap_job job = {body, length, tid, span, size,
                               count, a, b, fmt, 0};
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
        if (rows) {
            int64_t *row = rows + VGC_ROW_WORDS * (*n_rows)++;
            row[0] = tid;
            row[1] = fmt;
            row[2] = count;
            row[3] = a;
            row[4] = b;
            row[5] = pos;
            row[6] = span;
        }
        *elements += count;
        pos += length;
    }
    return pos == len;
}

/* Position of the first element of group g (FMT_POW2, FMT_GAP,
 * FMT_SPARSE or FMT_RAW, sorted indices) whose index is >= lo. */
static int64_t vgc_lower_bound(const vgc_group &g, int64_t lo) {
    if (g.fmt == VGC_FMT_RAW && (g.a & VGC_RAW_DENSE)) return lo;
    if (g.fmt == VGC_FMT_GAP || g.fmt == VGC_FMT_SPARSE)
        return std::lower_bound(g.gap_index, g.gap_index + g.count,
                                lo + g.gap_base) -
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
        /* the indices are the span's: the tensor's offset subtracted */
        const int64_t *index = g.gap_index;
        const uint8_t *nib = g.gap_nibble;
        const int64_t base = g.gap_base;
        for (; j < count; ++j) {
            const int64_t ix = index[j] - base;
            if (ix >= hi) break;
            out[ix] += table[nib[j]];
        }
    } else if (g.fmt == VGC_FMT_SPARSE) {
        const int64_t *index = g.gap_index;
        const double *value = g.sparse_value;
        for (; j < count; ++j) {
            if (index[j] >= hi) break;
            out[index[j]] += (S)value[j];
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
 * output is written to memory once.  With accumulate, the sum starts from
 * out's own values instead of 0 (((out + v_0) + v_1) + ..., as the
 * reference's decode_into adds) and only the indices sent are touched.
 * Returns the elements added. */
template <typename S>
static int64_t vgc_sum_range(vgc_group **heads, int p, S *out, int64_t lo,
                             int64_t hi, int apply_scale, double scale_d,
                             bool accumulate) {
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
        if (!accumulate) memset(out + b0, 0, sizeof(S) * (b1 - b0));
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
                                  double scale_d, bool accumulate) {
    const S scale = (S)scale_d;
    if (!accumulate) memset(out, 0, sizeof(S) * size);
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

#endif /* CHAINER_VGC_DECODE_H */
