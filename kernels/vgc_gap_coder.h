/*
 * chainer-vgc native CPU backend: FMT_GAP, the gap-coded indices
 * (codec.gap_body; docs: issue 14).  The Rice parameter, the LSB-first bit
 * writer, the gap stream's encoder and its checking decoder
 * (vgc_gap_decode), and vgc_emit, which writes the words the chunks staged
 * as one FMT_POW2 or FMT_GAP group.
 *
 * An internal header of the native CPU backend: included once, by
 * vgc_host.cpp (the one translation unit, so that the hot paths inline
 * across these files); not a public interface.
 */
#ifndef CHAINER_VGC_GAP_CODER_H
#define CHAINER_VGC_GAP_CODER_H

#include "vgc_host_common.h"

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

/* Restart m of a FMT_GAP body's table: code m N starts at bit `bit` of
 * the stream, after the element of index `prev`. */
static inline void vgc_put_restart(uint32_t *table, int64_t m, uint64_t bit,
                                   int64_t prev) {
    uint32_t *e = table + VGC_GAP_RESTART_WORDS * (m - 1);
    e[0] = (uint32_t)bit;
    e[1] = (uint32_t)(bit >> 32);
    e[2] = (uint32_t)(uint64_t)prev;
    e[3] = (uint32_t)((uint64_t)prev >> 32);
}

/* Writes the FMT_GAP body (param word, G, restart table, gap stream,
 * values) of the elements each(f) visits; G = ceil(bits / 32).  Returns
 * its words. */
template <typename Each>
static int64_t vgc_gap_write_body(Each each, int64_t count, uint64_t bits,
                                  int k, bool sign_only, uint32_t *body) {
    const int64_t G = (int64_t)((bits + 31) / 32);
    const int64_t T = VGC_GAP_RESTART_WORDS * vgc_gap_restarts(count);
    body[0] = (uint32_t)k | (sign_only ? VGC_GAP_SIGN_ONLY : 0u) |
              (T ? VGC_GAP_RESTARTS : 0u);
    body[1] = (uint32_t)G;
    uint32_t *table = body + VGC_GAP_PARAM_WORDS;
    vgc_bit_writer gaps(table + T);
    vgc_bit_writer values(table + T + G);
    int64_t prev = -1, j = 0;
    each([&](int64_t ix, uint32_t nib) {
        if (j && j % VGC_GAP_RESTART_CODES == 0)
            vgc_put_restart(table, j / VGC_GAP_RESTART_CODES,
                            32 * (gaps.wi - gaps.first) + gaps.nb, prev);
        ++j;
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
    return VGC_GAP_PARAM_WORDS + T + G + vgc_gap_value_words(count, sign_only);
}

/* The stream is read through vgc_stream32 and vgc_stream_bits of
 * vgc_numerics.cuh (the device's decoder reads it with them too). */

/* Words of the values of a FMT_SPARSE group of count elements (header
 * flags b): float32 one a word, float16 two. */
static inline int64_t vgc_sparse_value_words(int64_t count, uint32_t b) {
    return (b & VGC_SPARSE_FLOAT32) ? count : (count + 1) / 2;
}

/* Decodes and checks the gap-coded indices of a body of exactly len words
 * (FMT_GAP's or FMT_SPARSE's: param word, G, restart table, G words of
 * codes, then V value words, which are the caller's) over one index space
 * of size elements (a group's span_size): index[count] (strictly
 * increasing, < size), the decoder checks of the spec.  The span (param
 * bits 8..31) is the caller's; bit 7 must say whether a restart table
 * follows.  false: invalid. */
static bool vgc_gap_decode_indices(const uint32_t *body, int64_t len,
                                   int64_t count, int64_t size, int64_t V,
                                   int64_t *index) {
    if (len < VGC_GAP_PARAM_WORDS || count < 0) return false;
    const uint32_t param = body[0];
    if (((param & VGC_GAP_RESTARTS) != 0) != (vgc_gap_restarts(count) > 0))
        return false; /* the restart flag disagrees with count */
    const int k = (int)(param & 63);
    const int64_t G = body[1];
    const int64_t R = vgc_gap_restarts(count);
    if (len != VGC_GAP_PARAM_WORDS + VGC_GAP_RESTART_WORDS * R + G + V)
        return false;
    if (count > 32 * G && count) return false; /* a code has >= 1 bit */
    /* restart m (1..R): {bit, index} where code m N starts, checked when
     * the decoder gets there */
    const uint32_t *table = body + VGC_GAP_PARAM_WORDS;
    int64_t next_restart = R ? VGC_GAP_RESTART_CODES : count;
    const uint32_t *s = table + VGC_GAP_RESTART_WORDS * R;
    const uint64_t total = 32 * (uint64_t)G;
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
    const uint64_t esc_mask = (1u << VGC_GAP_ESCAPE) - 1;
    uint64_t buf = 0, wi = 0;
    int avail = 0;
    int64_t j = 0;
    while (j < count) {
        if (j == next_restart) {
            const uint32_t *e =
                table + VGC_GAP_RESTART_WORDS *
                            (j / VGC_GAP_RESTART_CODES - 1);
            if (pos != ((uint64_t)e[0] | (uint64_t)e[1] << 32) ||
                (uint64_t)prev != ((uint64_t)e[2] | (uint64_t)e[3] << 32))
                return false;
            next_restart = j / VGC_GAP_RESTART_CODES < R
                               ? j + VGC_GAP_RESTART_CODES
                               : count;
        }
        if (fast && wi < (uint64_t)G) {
            /* The fast path's own loop, up to the next restart point
             * while words are left to load: the window refilled without
             * a branch (a word whenever 32 bits or fewer are left, so a
             * code of <= 32 bits is always whole in it) and pos derived
             * once at the end (32 wi - avail: every loaded bit not yet
             * used).  It stops before a code it cannot take (an escape)
             * and before the stream's last word, which the code below
             * decodes one code at a time. */
            const int64_t stop = next_restart < count ? next_restart : count;
            uint64_t b = buf, w = wi;
            int64_t av = avail, pv = prev, jj = j;
            while (jj < stop && w < (uint64_t)G) {
                const uint64_t need = 0 - (uint64_t)(av <= 32);
                b |= ((uint64_t)s[w] << (av & 63)) & need;
                w -= need; /* + 1 where a word was loaded */
                av += (int64_t)(need & 32);
                if (!(b & esc_mask)) break;
                const int z = __builtin_ctzll(b);
                const uint64_t gap = ((uint64_t)z << k) | ((b >> (z + 1)) & lowmask);
                const int used = z + 1 + k;
                b >>= used;
                av -= used;
                pv += 1 + (int64_t)gap;
                index[jj++] = pv;
            }
            buf = b;
            wi = w;
            avail = (int)av;
            prev = pv;
            j = jj;
            pos = 32 * wi - (uint64_t)avail;
            if (j == stop) continue; /* a restart point, or the end */
        }
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
            index[j++] = prev;
            continue;
        }
        /* gap < limit keeps the index below size */
        if (pos > total || prev + 1 >= size) return false;
        const uint64_t limit = (uint64_t)(size - prev - 1);
        const uint64_t qmax = (limit - 1) >> k;
        uint64_t q;
        const uint32_t w = vgc_stream32(s, 0, G, pos);
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
                const uint32_t x = vgc_stream32(s, 0, G, pos + n);
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
                (1ull << n) | vgc_stream_bits(s, 0, G, pos + n + 1, n);
            pos += 2 * (uint64_t)n + 1;
            if (qmax < VGC_GAP_ESCAPE || v > qmax - (VGC_GAP_ESCAPE - 1))
                return false;
            q = v + (VGC_GAP_ESCAPE - 1);
        }
        if (pos + k > total) return false;
        const uint64_t gap = (q << k) | vgc_stream_bits(s, 0, G, pos, k);
        pos += k;
        if (gap >= limit) return false; /* overruns the tensor */
        prev += 1 + (int64_t)gap;
        index[j++] = prev;
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
    return true;
}

/* Decodes and checks a FMT_GAP body of exactly len words (the decoder
 * checks of the spec) over one index space of size elements (a group's
 * span_size): index[count] (strictly increasing, < size) and nib[count]
 * (sign << 3 | d; d = 0 for SIGN_ONLY).  The span (param bits 8..31) is
 * the caller's.  false: invalid. */
static bool vgc_gap_decode(const uint32_t *body, int64_t len, int64_t count,
                           int64_t size, int64_t *index, uint8_t *nib) {
    if (len < VGC_GAP_PARAM_WORDS || count < 0) return false;
    const bool sign_only = (body[0] & VGC_GAP_SIGN_ONLY) != 0;
    const int64_t V = vgc_gap_value_words(count, sign_only);
    if (len < V) return false;
    /* value padding (cheap, before any decoding) */
    const uint32_t *v = body + len - V;
    const uint64_t vbits = (uint64_t)count * (sign_only ? 1 : 4);
    if ((vbits & 31) && (v[V - 1] >> (vbits & 31))) return false;
    if (!vgc_gap_decode_indices(body, len, count, size, V, index))
        return false;
    if (sign_only)
        for (int64_t j = 0; j < count; ++j)
            nib[j] = (uint8_t)(((v[j >> 5] >> (j & 31)) & 1u) << 3);
    else { /* eight values a word, then the last word's */
        int64_t j = 0;
        for (; j + 8 <= count; j += 8) {
            const uint32_t x = v[j >> 3];
            for (int i = 0; i < 8; ++i)
                nib[j + i] = (uint8_t)((x >> (4 * i)) & 15u);
        }
        for (; j < count; ++j)
            nib[j] = (uint8_t)((v[j >> 3] >> (4 * (j & 7))) & 15u);
    }
    return true;
}

/* The full index of a word a chunk staged: FMT_POW2 and sign words keep
 * the low 28 bits of the index, the chunk (at most 2**28 elements) its
 * start. */
static inline int64_t vgc_full_index(const vgc_chunk &c, uint32_t word) {
    return c.begin + (int64_t)((word - (uint32_t)c.begin) & VGC_INDEX_MASK);
}

/* The code bits of a chunk's inner codes j0 <= j < j1 (j0 >= 1: gaps
 * between its own staged words).  Inside a chunk (at most 2**28
 * elements) a gap is the difference of two 28-bit index fields, so the
 * loop runs on 32-bit lanes without a carried dependency (the compiler
 * vectorizes it): a unary code adds q + 1 + k bits; an escape (rare) is
 * counted, and a block of 256 gaps holding one is read again, one gap at
 * a time, to add the escapes' lengths. */
static uint64_t vgc_code_bits_range(const vgc_chunk &c, int k, int64_t j0,
                                    int64_t j1) {
    const uint32_t *w = c.words.data();
    uint64_t bits = (uint64_t)(j1 - j0) * (uint64_t)(1 + k);
    if (k >= VGC_INDEX_BITS || j1 <= j0) return bits; /* inner q is 0 */
    const uint32_t base = (uint32_t)c.begin;
    for (int64_t b = j0; b < j1; b += 256) {
        const int64_t e = b + 256 < j1 ? b + 256 : j1;
        uint32_t unary = 0, escapes = 0; /* < 256 * 16 */
        for (int64_t j = b; j < e; ++j) {
            const uint32_t q =
                ((((w[j] - base) & VGC_INDEX_MASK) -
                  ((w[j - 1] - base) & VGC_INDEX_MASK)) - 1u) >> k;
            const bool esc = q >= (uint32_t)VGC_GAP_ESCAPE;
            unary += esc ? 0u : q;
            escapes += esc;
        }
        bits += unary;
        for (int64_t j = b; escapes && j < e; ++j) { /* rare: rescan */
            const int64_t gap = vgc_full_index(c, w[j]) -
                                vgc_full_index(c, w[j - 1]) - 1;
            if ((gap >> k) >= VGC_GAP_ESCAPE) {
                bits += (uint64_t)(vgc_gap_code_length(gap, k) - 1 - k);
                --escapes;
            }
        }
    }
    return bits;
}

/* The code bits of a chunk's staged words (its first gap from
 * c.gap_prev); c.restart_bits gets, for each restart point among its
 * codes (element c.offset + j a multiple of VGC_GAP_RESTART_CODES, not
 * the first of the group), the bits of its codes before it. */
static uint64_t vgc_chunk_code_bits(vgc_chunk &c, int k) {
    c.restart_bits.clear();
    if (!c.out) return 0;
    const int64_t N = VGC_GAP_RESTART_CODES;
    if (c.offset && c.offset % N == 0) c.restart_bits.push_back(0);
    uint64_t bits = (uint64_t)vgc_gap_code_length(
        vgc_full_index(c, c.words[0]) - c.gap_prev - 1, k);
    int64_t j = 1, next = N - c.offset % N; /* >= 1 */
    for (; next < c.out; next += N) {
        bits += vgc_code_bits_range(c, k, j, next);
        c.restart_bits.push_back(bits);
        j = next;
    }
    return bits + vgc_code_bits_range(c, k, j, c.out);
}

/* The chunk's entries of the restart table (after vgc_chunk_code_bits and
 * the chunks' c.gap_start). */
static void vgc_chunk_restarts(const vgc_chunk &c, uint32_t *table) {
    const int64_t N = VGC_GAP_RESTART_CODES;
    int64_t j = (N - c.offset % N) % N; /* local code of the first */
    if (c.offset + j == 0) j += N;       /* (none before the first code) */
    for (size_t r = 0; r < c.restart_bits.size(); ++r, j += N)
        vgc_put_restart(table, (c.offset + j) / N,
                        c.gap_start + c.restart_bits[r],
                        j ? vgc_full_index(c, c.words[j - 1]) : c.gap_prev);
}

/* Writes the codes of a chunk's staged words at bit c.gap_start of the
 * gap stream gs (its first gap from c.gap_prev), every word it fills
 * alone, and sets its shared words (c.edge_word, c.edge_bits,
 * c.tail_word) as vgc_bit_writer::edges() gives them.  The same bits as
 * vgc_bit_writer::code() a gap at a time: the inner gaps (k < 28) are
 * 28-bit index differences, a code that fits one 32-bit field (q < 16,
 * q + 1 + k <= 32) is ORed in with no branch on the word's end (the word
 * being filled is stored on every code, and the position advances by the
 * words completed), and any other code goes through code(). */
static void vgc_chunk_write_codes(vgc_chunk &c, const int k, uint32_t *gs) {
    const uint32_t *w = c.words.data();
    const int64_t n = c.out;
    vgc_bit_writer gw(gs, c.gap_start);
    gw.code((uint64_t)(vgc_full_index(c, w[0]) - c.gap_prev - 1), k);
    int64_t j = 1;
    if (k < VGC_INDEX_BITS) {
        const uint32_t base = (uint32_t)c.begin;
        const uint32_t low_mask = (1u << k) - 1u;
        /* codes up to the end of the first word (shared: kept in head) */
        for (; j < n && gw.wi == gw.first; ++j) {
            const uint32_t gap = ((w[j] - base) & VGC_INDEX_MASK) -
                                 ((w[j - 1] - base) & VGC_INDEX_MASK) - 1u;
            gw.code(gap, k);
        }
        uint32_t *dst = gw.base;
        uint64_t acc = gw.acc, wi = gw.wi;
        int nb = gw.nb;
        /* with k <= 16, q < 16 makes len <= 32 */
        const uint32_t fits = k <= 16 ? (uint32_t)VGC_GAP_ESCAPE
                                      : (uint32_t)(32 - k);
        /* blocks of 256: their codes in lanes (x and its length; 64 for
         * one that does not fit a field), then put in the stream four or
         * two at a time where they fit one 32-bit field together */
        uint32_t xs[256], lens[256];
        for (; j < n; j += 256) {
            const int64_t m = n - j < 256 ? n - j : 256;
            for (int64_t i = 0; i < m; ++i) {
                const uint32_t gap =
                    ((w[j + i] - base) & VGC_INDEX_MASK) -
                    ((w[j + i - 1] - base) & VGC_INDEX_MASK) - 1u;
                const uint32_t q = gap >> k;
                const bool ok = q < fits;
                /* q zeros, a one, the k low bits */
                xs[i] = ok ? ((gap & low_mask) << 1 | 1u) << q : 0u;
                lens[i] = ok ? q + 1u + (uint32_t)k : 64u;
            }
            auto put = [&](uint64_t x, int len) {
                acc |= x << nb;
                nb += len;
                dst[wi] = (uint32_t)acc;
                const int full = nb >> 5;
                wi += (uint64_t)full;
                acc >>= 32 * full;
                nb &= 31;
            };
            auto one = [&](int64_t i) {
                if (lens[i] != 64u) {
                    put(xs[i], (int)lens[i]);
                    return;
                }
                gw.acc = acc;
                gw.nb = nb;
                gw.wi = wi;
                gw.code(((w[j + i] - base) & VGC_INDEX_MASK) -
                            ((w[j + i - 1] - base) & VGC_INDEX_MASK) - 1u,
                        k);
                acc = gw.acc;
                nb = gw.nb;
                wi = gw.wi;
            };
            int64_t i = 0;
            for (; i + 3 < m; i += 4) {
                const uint32_t l0 = lens[i], l1 = lens[i + 1];
                const uint32_t l2 = lens[i + 2], l3 = lens[i + 3];
                const uint32_t l01 = l0 + l1, l23 = l2 + l3;
                if (l01 + l23 <= 32u) {
                    put((uint64_t)xs[i] | (uint64_t)xs[i + 1] << l0 |
                            (uint64_t)xs[i + 2] << l01 |
                            (uint64_t)xs[i + 3] << (l01 + l2),
                        (int)(l01 + l23));
                } else {
                    for (int e = 0; e < 4; e += 2) {
                        const uint32_t la = lens[i + e], lb = lens[i + e + 1];
                        if (la + lb <= 32u) {
                            put((uint64_t)xs[i + e] |
                                    (uint64_t)xs[i + e + 1] << la,
                                (int)(la + lb));
                        } else {
                            one(i + e);
                            one(i + e + 1);
                        }
                    }
                }
            }
            for (; i < m; ++i) one(i);
        }
        gw.acc = acc;
        gw.nb = nb;
        gw.wi = wi;
    } else {
        for (; j < n; ++j)
            gw.code((uint64_t)(vgc_full_index(c, w[j]) -
                               vgc_full_index(c, w[j - 1]) - 1), k);
    }
    gw.edges(&c.edge_word[0], &c.edge_bits[0], &c.tail_word[0],
             &c.edge_bits[1]);
}

/* The value fields of n staged words (the top 4 bits of each, or with
 * sign_only the sign bit) as elements offset.. of the value section vs:
 * the words this chunk fills alone are stored whole (8 or 32 fields at a
 * time); its first word and its last partial one, which it may share
 * with a neighbour, are returned as vgc_bit_writer::edges() returns them.
 * The same bits as a bit writer putting each field in turn. */
static void vgc_pack_values(const uint32_t *w, int64_t n, int64_t offset,
                            bool sign_only, uint32_t *vs, uint64_t *head_word,
                            uint32_t *head_bits, int64_t *tail_word,
                            uint32_t *tail_bits) {
    const int vb = sign_only ? 1 : 4, per = 32 / vb;
    const int src = sign_only ? 31 : VGC_INDEX_BITS;
    const uint64_t first = (uint64_t)offset / per;
    int64_t j = 0;
    uint32_t head = 0;
    const int64_t in_first = (int64_t)(first + 1) * per - offset;
    for (; j < n && j < in_first; ++j)
        head |= (w[j] >> src) << (((offset + j) % per) * vb);
    *head_word = first;
    *head_bits = head;
    *tail_word = -1;
    *tail_bits = 0;
    uint64_t wi = first + 1;
    if (sign_only) {
        for (; j + 32 <= n; j += 32, ++wi) {
            uint32_t x = 0;
            for (int m = 0; m < 32; ++m) x |= (w[j + m] >> 31) << m;
            vs[wi] = x;
        }
    } else {
        for (; j + 8 <= n; j += 8, ++wi) {
            uint32_t x = 0;
            for (int m = 0; m < 8; ++m)
                x |= (w[j + m] >> VGC_INDEX_BITS) << (4 * m);
            vs[wi] = x;
        }
    }
    if (j < n) {
        uint32_t t = 0;
        for (int m = 0; j < n; ++j, ++m) t |= (w[j] >> src) << (m * vb);
        *tail_word = (int64_t)wi;
        *tail_bits = t;
    }
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
    /* the first gap of each chunk is taken from the last index of the
     * non-empty chunks before it */
    uint64_t bits = 0;
    const size_t nc = ws->chunks.size();
    const int64_t T = VGC_GAP_RESTART_WORDS * vgc_gap_restarts(count);
    uint32_t *table = body + VGC_GAP_PARAM_WORDS, *gs = table + T, *vs = gs;
    int64_t G = 0, gap_words = 0; /* (FMT_GAP's body) */
    bool too_long = false;
    if (coding != VGC_CODING_FIXED) {
        int64_t prev = -1;
        for (size_t t = 0; t < nc; ++t) {
            vgc_chunk &c = ws->chunks[t];
            c.gap_prev = prev;
            if (c.out) prev = vgc_full_index(c, c.words[c.out - 1]);
        }
        const int nt_all = (int)nc;
#ifdef _OPENMP
        const int nt = std::min(nt_all, std::max(1, vgc_nthreads()));
#pragma omp parallel num_threads(nt) if (nt_all > 1)
#endif
        {
            /* pass 1, parallel: each chunk's code bits */
#ifdef _OPENMP
#pragma omp for schedule(static, 1)
#endif
            for (int t = 0; t < nt_all; ++t)
                ws->chunks[t].gap_bits =
                    vgc_chunk_code_bits(ws->chunks[t], k);
            /* one thread: the offsets, and FMT_GAP or not ('auto': when
             * shorter) */
#ifdef _OPENMP
#pragma omp single
#endif
            {
                for (size_t t = 0; t < nc; ++t) {
                    ws->chunks[t].gap_start = bits;
                    bits += ws->chunks[t].gap_bits;
                }
                G = (int64_t)((bits + 31) / 32);
                gap_words = VGC_GAP_PARAM_WORDS + T + G +
                            vgc_gap_value_words(count, sign_only);
                gap |= gap_words < count;
                too_long = gap && (bits + 31) / 32 > 0xFFFFFFFFu;
                vs = gs + G;
            } /* (every thread waits here) */
            /* pass 2, parallel: each chunk writes its codes and values
             * at its bit offsets in the two sections, every word it fills
             * alone; the words it shares with a neighbour (its first and
             * last of each section) are put together afterwards */
            if (gap && !too_long) {
#ifdef _OPENMP
#pragma omp for schedule(static, 1)
#endif
                for (int t = 0; t < nt_all; ++t) {
                    vgc_chunk &c = ws->chunks[t];
                    if (!c.out) continue;
                    vgc_chunk_write_codes(c, k, gs);
                    vgc_chunk_restarts(c, table);
                    vgc_pack_values(c.words.data(), c.out, c.offset,
                                    sign_only, vs, &c.edge_word[2],
                                    &c.edge_bits[2], &c.tail_word[1],
                                    &c.edge_bits[3]);
                }
            }
        }
        if (too_long) {
            info[2] |= VGC_UNENCODABLE;
            return 0;
        }
    }
    int64_t words;
    if (gap) {
        body[0] = (uint32_t)k | (sign_only ? VGC_GAP_SIGN_ONLY : 0u) |
                  (T ? VGC_GAP_RESTARTS : 0u);
        body[1] = (uint32_t)G;
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
        words = gap_words;
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

#endif /* CHAINER_VGC_GAP_CODER_H */
