/*
 * chainer-vgc numerics: the single source of every CuPy ElementwiseKernel.
 *
 * Compiled three ways from this one file:
 *   - by NVRTC, as the `preamble` of the CuPy ElementwiseKernels built in
 *     chainer_vgc/kernels.py (device code, `--fmad=false`);
 *   - by nvcc to PTX in the test suite (tests/test_kernels.py);
 *   - by the host C++ compiler in the test suite (`-ffp-contract=off`), which
 *     runs the same ElementwiseKernel operation strings element by element and
 *     compares them with the NumPy path of chainer_vgc.
 *
 * Paper: Tsuzuku, Imachi, Akiba, "Variance-based Gradient Compression for
 * Efficient Distributed Deep Learning", ICLR 2018 workshop.
 *
 * Only plain arithmetic and integer bit operations are used; no fused
 * multiply-add is allowed, so host and device round identically.
 */
#ifndef CHAINER_VGC_NUMERICS_CUH
#define CHAINER_VGC_NUMERICS_CUH

#if defined(__CUDACC__)
#define VGC_FN __device__ __forceinline__
VGC_FN unsigned int vgc_bits(float x) { return __float_as_uint(x); }
VGC_FN unsigned long long vgc_bits(double x) {
    return (unsigned long long)__double_as_longlong(x);
}
VGC_FN float vgc_from_bits(unsigned int u) { return __uint_as_float(u); }
VGC_FN double vgc_from_bits(unsigned long long u) {
    return __longlong_as_double((long long)u);
}
/* The subnormal rule: every backend keeps subnormals (IEEE-754 gradual
 * underflow) and rounds each operation once (no FMA).  CuPy appends
 * -ftz=true to every kernel it compiles, which would make NVVM emit
 * add.rn.ftz.f32, mul.rn.ftz.f32 and setp.*.ftz.f32 for plain C operators,
 * flushing subnormal operands and results to zero.  So on the device every
 * floating-point operation of these kernels is written in PTX: .rn without
 * .ftz (an explicit rounding mode also keeps ptxas from fusing a multiply
 * and an add into an FMA), comparisons by setp without .ftz, absolute value
 * and negation on the bits.  On the host they are the plain operators
 * (compiled with -ffp-contract=off), which is what NumPy does. */
/* name(a, b) = a OP b, rounded to nearest-even, for float and double */
#define VGC_PTX_BINARY(name, op)                                           \
    VGC_FN float name(float a, float b) {                                  \
        float c;                                                           \
        asm(op ".rn.f32 %0, %1, %2;" : "=f"(c) : "f"(a), "f"(b));          \
        return c;                                                          \
    }                                                                      \
    VGC_FN double name(double a, double b) {                               \
        double c;                                                          \
        asm(op ".rn.f64 %0, %1, %2;" : "=d"(c) : "d"(a), "d"(b));          \
        return c;                                                          \
    }
VGC_PTX_BINARY(vgc_add, "add")
VGC_PTX_BINARY(vgc_sub, "sub")
VGC_PTX_BINARY(vgc_mul, "mul")
VGC_PTX_BINARY(vgc_div, "div")
#undef VGC_PTX_BINARY
/* a > b (false when either is NaN) */
VGC_FN bool vgc_gt(float a, float b) {
    unsigned int p;
    asm("{\n\t.reg .pred q;\n\tsetp.gt.f32 q, %1, %2;\n\t"
        "selp.u32 %0, 1, 0, q;\n\t}" : "=r"(p) : "f"(a), "f"(b));
    return p != 0;
}
VGC_FN bool vgc_gt(double a, double b) {
    unsigned int p;
    asm("{\n\t.reg .pred q;\n\tsetp.gt.f64 q, %1, %2;\n\t"
        "selp.u32 %0, 1, 0, q;\n\t}" : "=r"(p) : "d"(a), "d"(b));
    return p != 0;
}
/* the state dtype from a gradient or sum of squares dtype: exact widening
 * (float16/float32 -> float32/float64), or float64 -> float32 rounded to
 * nearest without flushing */
template <typename S, typename T> struct vgc_convert {
    static VGC_FN S run(T x) { return (S)x; }
};
template <> struct vgc_convert<float, double> {
    static VGC_FN float run(double x) {
        float y;
        asm("cvt.rn.f32.f64 %0, %1;" : "=f"(y) : "d"(x));
        return y;
    }
};
template <> struct vgc_convert<double, float> {
    static VGC_FN double run(float x) {
        double y;
        asm("cvt.f64.f32 %0, %1;" : "=d"(y) : "f"(x));
        return y;
    }
};
/* float16 (CUDA's __half or CuPy's float16) -> float64 through float32,
 * exactly, without a flushing cvt */
template <typename T> struct vgc_convert<double, T> {
    static VGC_FN double run(T x) {
        return vgc_convert<double, float>::run((float)x);
    }
};
template <> struct vgc_convert<double, double> {
    static VGC_FN double run(double x) { return x; }
};
/* *p |= x for the FMT_GAP bit writes, where codes of different elements
 * share a word */
VGC_FN void vgc_atomic_or(unsigned int *p, unsigned int x) {
    atomicOr(p, x);
}
/* *p = max(*p, x): a tensor's largest selected |r| (as its bits) */
VGC_FN void vgc_atomic_max(unsigned long long *p, unsigned long long x) {
    atomicMax(p, x);
}
#else
#include <math.h>
#include <string.h>
#define VGC_FN static inline
VGC_FN unsigned int vgc_bits(float x) {
    unsigned int u;
    memcpy(&u, &x, sizeof u);
    return u;
}
VGC_FN unsigned long long vgc_bits(double x) {
    unsigned long long u;
    memcpy(&u, &x, sizeof u);
    return u;
}
VGC_FN float vgc_from_bits(unsigned int u) {
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}
VGC_FN double vgc_from_bits(unsigned long long u) {
    double x;
    memcpy(&x, &u, sizeof x);
    return x;
}
/* host: the plain operators (the build uses -ffp-contract=off) */
template <typename F> VGC_FN F vgc_add(F a, F b) { return a + b; }
template <typename F> VGC_FN F vgc_sub(F a, F b) { return a - b; }
template <typename F> VGC_FN F vgc_mul(F a, F b) { return a * b; }
template <typename F> VGC_FN F vgc_div(F a, F b) { return a / b; }
template <typename F> VGC_FN bool vgc_gt(F a, F b) { return a > b; }
template <typename S, typename T> struct vgc_convert {
    static S run(T x) { return (S)x; }
};
/* host: the kernels run element by element (tests/kernel_harness.py), so
 * CUDA's atomicOr is a plain OR */
VGC_FN void vgc_atomic_or(unsigned int *p, unsigned int x) { *p |= x; }
VGC_FN void vgc_atomic_max(unsigned long long *p, unsigned long long x) {
    if (x > *p) *p = x;
}
#endif

/* (S)x by the rule above; used by the kernels' operation strings */
template <typename S, typename T> VGC_FN S vgc_to(T x) {
    return vgc_convert<S, T>::run(x);
}

/* IEEE-754 layout of the state dtypes (float32 for float16/float32
 * parameters, float64 for float64 parameters). */
template <typename F> struct vgc_float_traits;
template <> struct vgc_float_traits<float> {
    typedef unsigned int U;
    static const int MANT = 23;
    static const int BIAS = 127;
    static const int SIGN_SHIFT = 31;
    static const unsigned int EXP_MASK = 0x7F800000u;
    static const unsigned int TOP_MANT_BIT = 0x00400000u;
    static const unsigned int ABS_MASK = 0x7FFFFFFFu;
};
template <> struct vgc_float_traits<double> {
    typedef unsigned long long U;
    static const int MANT = 52;
    static const int BIAS = 1023;
    static const int SIGN_SHIFT = 63;
    static const unsigned long long EXP_MASK = 0x7FF0000000000000ull;
    static const unsigned long long TOP_MANT_BIT = 0x0008000000000000ull;
    static const unsigned long long ABS_MASK = 0x7FFFFFFFFFFFFFFFull;
};

/* |x| and -x on the bits (exact, and never flushed) */
template <typename F> VGC_FN F vgc_abs(F x) {
    return vgc_from_bits(vgc_bits(x) & vgc_float_traits<F>::ABS_MASK);
}
template <typename F> VGC_FN F vgc_neg(F x) {
    return vgc_from_bits(vgc_bits(x) ^ ~vgc_float_traits<F>::ABS_MASK);
}

/* x * 2^n rounded once to nearest-even, built from the bits: normal and
 * subnormal results alike (ldexpf would be lowered to a flushing multiply
 * under -ftz=true).  Infinity past the largest finite value. */
template <typename F> VGC_FN F vgc_ldexp(F x, int n) {
    typedef vgc_float_traits<F> T;
    typedef typename T::U U;
    const U one = (U)1;
    const U implicit = one << T::MANT;
    U b = vgc_bits(x);
    U sign = b & ~T::ABS_MASK;
    U mag = b & T::ABS_MASK;
    int field = (int)(mag >> T::MANT);
    const int max_field = (int)(T::EXP_MASK >> T::MANT);
    if (mag == 0 || field == max_field) return x; /* zero, inf, NaN */
    U mant = field ? (mag & (implicit - one)) | implicit : mag;
    int e = field ? field : 1; /* biased exponent of mant's implicit bit */
    while (mant < implicit) { /* subnormal input: normalize */
        mant <<= 1;
        e -= 1;
    }
    long long target = (long long)e + n;
    if (target >= max_field) return vgc_from_bits(sign | T::EXP_MASK);
    if (target >= 1)
        return vgc_from_bits(sign | ((U)target << T::MANT) |
                             (mant & (implicit - one)));
    long long shift = 1 - target; /* subnormal result */
    if (shift > T::MANT + 1) return vgc_from_bits(sign);
    U kept = mant >> shift;
    U rem = mant & ((one << shift) - one);
    U half = one << (shift - 1);
    if (rem > half || (rem == half && (kept & one))) kept += one;
    return vgc_from_bits(sign | kept); /* a carry makes it normal: right */
}

/* log2 of a value the quantizer treats as zero (0 and subnormals). */
#define VGC_LOG2_ZERO (-(1 << 30))
/* Word layout (Sec. 4.2): sign bit | 3-bit d | 28-bit index. */
#define VGC_INDEX_BITS 28
#define VGC_INDEX_MASK 0x0FFFFFFFu
#define VGC_MAX_D 7

/* ---- Fig. "Basic": accumulate, criterion (eq. 4), decay ---------------- */

/* r += sum_z grad_z / B  and  v += sum_z (grad_z / B)^2 */
template <typename F> VGC_FN F vgc_accumulate(F acc, F x) {
    return vgc_add(acc, x);
}

/* eq. (4): (sum_z g_z/B)^2 > alpha * sum_z (g_z/B)^2 */
template <typename F> VGC_FN bool vgc_criterion(F r, F v, F alpha) {
    return vgc_gt(vgc_mul(r, r), vgc_mul(alpha, v));
}

/* v *= zeta for elements that were not sent (Sec. 4.1, 4.4). */
template <typename F> VGC_FN F vgc_decay(F v, F zeta) {
    return vgc_mul(v, zeta);
}

/* One step of Fig. "Basic" up to the criterion.  Returns whether the element
 * is selected.  v is decayed for every element: the caller resets r and v of
 * the selected elements after quantization (the set that is sent depends on
 * the tensor's maximum, Sec. 4.2), so only unselected elements keep the
 * decayed v, as in the figure; a selected element that cannot be represented
 * and is kept (keep_unrepresentable) keeps it too, like an unselected one. */
template <typename F>
VGC_FN bool vgc_basic_select(F g, F s, F alpha, F zeta, F &r, F &v) {
    r = vgc_accumulate(r, g);
    v = vgc_accumulate(v, s);
    bool sel = vgc_criterion(r, v, alpha);
    v = vgc_decay(v, zeta);
    return sel;
}

/* ---- Fig. "Hybrid" (Sec. 4.5) ------------------------------------------ */

/* Sends sign(r)*tau where |r| > tau and eq. (4) holds.  The variance is
 * corrected as the text of Sec. 4.5 derives it: with S = sign(r) tau the value
 * sent, sum (g)^2 becomes sum (g)^2 - 2 S sum g + S^2, i.e.
 * v - 2 |r_before| tau + tau^2 (the listing applies it to the already reduced
 * r), clipped at 0.  v decays every step.  Returns +1, -1 or 0. */
template <typename F>
VGC_FN int vgc_hybrid_step(F g, F s, F alpha, F zeta, F tau, F &r, F &v) {
    r = vgc_accumulate(r, g);
    v = vgc_accumulate(v, s);
    F mag = vgc_abs(r);
    /* written without branches (selects only), so that the host compiler
     * vectorizes it; the values are those of the if/else form */
    bool sel = vgc_gt(mag, tau) & vgc_criterion(r, v, alpha);
    bool positive = vgc_gt(r, (F)0);
    int sent = sel ? (positive ? 1 : -1) : 0;
    F reduced = positive ? vgc_sub(r, tau) : vgc_add(r, tau);
    /* v - 2 |r| tau + tau^2, evaluated left to right */
    F corrected = vgc_add(vgc_sub(v, vgc_mul(vgc_mul((F)2, mag), tau)),
                          vgc_mul(tau, tau));
    r = sel ? reduced : r;
    v = sel ? (vgc_gt(corrected, (F)0) ? corrected : (F)0) : v;
    v = vgc_decay(v, zeta);
    return sent;
}

/* ---- Strom (2015): threshold tau, send +-tau, keep the residual --------- */
template <typename F> VGC_FN int vgc_strom_step(F g, F tau, F &r) {
    r = vgc_accumulate(r, g);
    bool up = vgc_gt(r, tau), down = vgc_gt(vgc_neg(tau), r);
    r = up ? vgc_sub(r, tau) : (down ? vgc_add(r, tau) : r);
    return (int)up - (int)down;
}

/* ---- Quantization with the float bit trick (Sec. 4.2, 4.4, App. B) ------ */

/* floor(log2 |x|) by truncating the mantissa; VGC_LOG2_ZERO for 0 and
 * subnormals. */
template <typename F> VGC_FN int vgc_floor_log2(F x) {
    typedef vgc_float_traits<F> T;
    typename T::U b = vgc_bits(x) & T::ABS_MASK;
    int field = (int)(b >> T::MANT);
    return field == 0 ? VGC_LOG2_ZERO : field - T::BIAS;
}

/* log2 of the power of two nearest to |x|: add the mantissa's top bit as if
 * x were an unsigned integer, then mask the mantissa (ties 1.5*2^e go up).
 * 0 and subnormals give VGC_LOG2_ZERO (never sent). */
template <typename F> VGC_FN int vgc_round_log2(F x) {
    typedef vgc_float_traits<F> T;
    typename T::U b = vgc_bits(x) & T::ABS_MASK;
    if ((b & T::EXP_MASK) == 0) return VGC_LOG2_ZERO;
    typename T::U rounded = (b + T::TOP_MANT_BIT) & T::EXP_MASK;
    return (int)(rounded >> T::MANT) - T::BIAS;
}

/* d = e_k - log2 g' where g' is |x| truncated to 2^e_k when larger, else
 * rounded to the nearer power of two.  Large (> 7) for zeros/subnormals. */
template <typename F> VGC_FN int vgc_quantize_d(F x, int e_k) {
    int e = vgc_round_log2(x);
    if (e > e_k) e = e_k;
    return e == VGC_LOG2_ZERO ? VGC_MAX_D + 1 : e_k - e;
}

VGC_FN unsigned int vgc_pack_word(bool negative, int d, unsigned int index) {
    return ((negative ? 1u : 0u) << 31) | ((unsigned int)d << VGC_INDEX_BITS) |
           (index & VGC_INDEX_MASK);
}

/* Encodes x at `index` against the tensor exponent e_k.  Returns false (and
 * word 0) when d > 7: the element cannot be represented and is not sent. */
template <typename F>
VGC_FN bool vgc_pow2_encode(F x, int e_k, long long index, unsigned int &word) {
    typedef vgc_float_traits<F> T;
    int d = vgc_quantize_d(x, e_k);
    bool ok = d <= VGC_MAX_D;
    bool negative = ((vgc_bits(x) >> T::SIGN_SHIFT) & 1) != 0;
    word = ok ? vgc_pack_word(negative, d, (unsigned int)index) : 0u;
    return ok;
}

/* Exact inverse of vgc_pow2_encode: value = sign * scale * 2^(e_k - d). */
template <typename F>
VGC_FN F vgc_pow2_decode(unsigned int word, int e_k, F scale,
                         long long &index) {
    index = (long long)(word & VGC_INDEX_MASK);
    int d = (int)((word >> VGC_INDEX_BITS) & 7u);
    F mag = vgc_ldexp(scale, e_k - d);
    return (word >> 31) ? vgc_neg(mag) : mag;
}

/* ---- FMT_GAP: the gap-coded index stream (issue 14) -------------------- *
 * Integers only.  Element j of a group (sorted unique indices i_0 < i_1 <
 * ...) has gap_j = i_j - i_{j-1} - 1 (gap_0 = i_0), written as one code:
 * q = gap >> k; q < VGC_GAP_ESCAPE: q zero bits and a one bit (unary); else
 * VGC_GAP_ESCAPE zero bits and the Elias-gamma code of v = q - ESC + 1
 * (n = floor(log2 v) zero bits, a one bit, the low n bits of v); then the
 * low k bits of gap.  Fields are LSB-first: bit p of the stream is bit p & 31
 * of word p >> 5.  Codes are back to back from bit 0; the device writes
 * them with one thread per element at the exclusive prefix sum of the code
 * lengths, into a zeroed stream (zero bits are not written). */
#define VGC_GAP_ESCAPE 16

/* floor(log2 v) for v >= 1 */
VGC_FN int vgc_ilog2_u64(unsigned long long v) {
    int n = 0;
    if (v >> 32) { v >>= 32; n += 32; }
    if (v >> 16) { v >>= 16; n += 16; }
    if (v >> 8) { v >>= 8; n += 8; }
    if (v >> 4) { v >>= 4; n += 4; }
    if (v >> 2) { v >>= 2; n += 2; }
    if (v >> 1) { n += 1; }
    return n;
}

/* bits of the code of `gap` (>= 0) with Rice parameter k (0..63) */
VGC_FN long long vgc_gap_code_length(long long gap, int k) {
    unsigned long long q = (unsigned long long)gap >> k;
    long long len = q < VGC_GAP_ESCAPE
        ? (long long)q + 1
        : VGC_GAP_ESCAPE + 2LL * vgc_ilog2_u64(q - VGC_GAP_ESCAPE + 1) + 1;
    return len + k;
}

/* gap of element j of the sorted indices (a raw array: index[j - 1] is
 * read) and, the return value, the length of its code */
template <typename A>
VGC_FN long long vgc_gap_length(const A &index, long long j, int k,
                                long long &gap) {
    long long prev = j ? (long long)index[j - 1] : -1LL;
    gap = (long long)index[j] - prev - 1;
    return vgc_gap_code_length(gap, k);
}

/* ORs the n (0..64) low bits of x (the rest 0) at bit `pos` of `stream`,
 * a word at a time */
template <typename A>
VGC_FN void vgc_or_field(A stream, long long pos, unsigned long long x,
                         int n) {
    while (n > 0) {
        int off = (int)(pos & 31);
        int take = 32 - off < n ? 32 - off : n;
        unsigned int chunk =
            (unsigned int)(x & ((1ULL << take) - 1ULL)) << off;
        if (chunk) vgc_atomic_or(&stream[pos >> 5], chunk);
        x >>= take; /* take <= 32 */
        pos += take;
        n -= take;
    }
}

/* Writes the code of `gap`, which ends at bit `end` (the inclusive prefix
 * sum of the code lengths), into the zeroed `stream` (a raw uint32 array;
 * other threads write the neighbouring codes: atomic ORs). */
template <typename A>
VGC_FN void vgc_gap_write(A stream, long long gap, long long end, int k) {
    unsigned long long g = (unsigned long long)gap;
    unsigned long long q = g >> k;
    long long pos = end - vgc_gap_code_length(gap, k);
    if (q < VGC_GAP_ESCAPE) {
        pos += (long long)q; /* q zero bits */
        vgc_or_field(stream, pos, 1ULL, 1);
        pos += 1;
    } else {
        unsigned long long v = q - VGC_GAP_ESCAPE + 1;
        int n = vgc_ilog2_u64(v);
        pos += VGC_GAP_ESCAPE + n; /* ESC zero bits, n zero bits */
        vgc_or_field(stream, pos, 1ULL, 1);
        vgc_or_field(stream, pos + 1, v & ((1ULL << n) - 1ULL), n);
        pos += 1 + n;
    }
    if (k) vgc_or_field(stream, pos, g & ((1ULL << k) - 1ULL), k);
}

/* Value word w of the FMT_GAP body: the 4-bit fields nibble = sign << 3 | d
 * of elements 8w..8w+7, or (sign_only) the sign bits (nibble >> 3) of
 * elements 32w..32w+31, LSB-first; fields past `count` are 0. */
template <typename A>
VGC_FN unsigned int vgc_gap_value_word(const A &nibbles, long long count,
                                       bool sign_only, long long w) {
    int per = sign_only ? 32 : 8, bits = sign_only ? 1 : 4;
    long long first = w * per;
    unsigned int word = 0;
    for (int j = 0; j < per && first + j < count; ++j) {
        unsigned int x = (unsigned int)nibbles[first + j];
        unsigned int field = sign_only ? (x >> 3) & 1u : x & 15u;
        word |= field << (j * bits);
    }
    return word;
}


/* ---- The whole-model step (issue 25) ----------------------------------- *
 * One launch per kernel for every tensor of a dtype group: the tensors lie
 * end to end in one array (an arena); element i belongs to tensor t with
 * offsets[t] <= i < offsets[t + 1].  The kernels of chainer_vgc.device_step,
 * in launch order: a rule's select pass (state into a second arena, input
 * and overflow flags, a tensor's largest selected |r|), vgc's keep pass
 * (which selected elements the tensor's e_k can represent), a scan of the
 * elements sent (cupy.cumsum), the layout (one thread: the message's
 * headers and each group's place) and the write pass (the words, and the
 * reset of the elements selected).  The per-tensor results equal the
 * per-tensor kernels above, element for element. */

/* fault flags per tensor; the native backend's values (chainer_vgc.native) */
#define VGC_FLAG_BAD_GRAD 1u
#define VGC_FLAG_BAD_SQSUM 2u
#define VGC_FLAG_OVERFLOW_R 4u
#define VGC_FLAG_OVERFLOW_V 8u
/* the message's first word, formats and header (chainer_vgc.codec) */
#define VGC_MAGIC 0x31434756u
#define VGC_FMT_POW2 1u
#define VGC_FMT_RAW 2u
#define VGC_HEADER_WORDS 5
#define VGC_RAW_DENSE 1u
#define VGC_RAW_FLOAT64 2u
#define VGC_FMT_GAP 4u
#define VGC_GAP_SIGN_ONLY 64u
#define VGC_GAP_PARAM_WORDS 2
#define VGC_GAP_RESTART_CODES 1024
#define VGC_GAP_RESTART_WORDS 4
/* param bit 7: the body has a restart table (count > RESTART_CODES) */
#define VGC_GAP_RESTARTS 0x80u

/* restart points of a FMT_GAP group of count >= 1 codes: one every
 * VGC_GAP_RESTART_CODES codes after the first block */
VGC_FN long long vgc_gap_restarts(long long count) {
    return count > 0 ? (count - 1) / VGC_GAP_RESTART_CODES : 0;
}

/* the tensor of element i: the last t < n with offsets[t] <= i (an empty
 * tensor shares its offset with the next, which holds i) */
template <typename A>
VGC_FN int vgc_segment(const A &offsets, int n, long long i) {
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) >> 1;
        if ((long long)offsets[mid] <= i)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

template <typename F> VGC_FN bool vgc_finite(F x) {
    typedef vgc_float_traits<F> T;
    return (vgc_bits(x) & T::EXP_MASK) != T::EXP_MASK;
}

/* BAD_GRAD: g (in the state dtype, an exact conversion) is not finite;
 * BAD_SQSUM: s, in its own dtype, is not finite or is negative */
template <typename F, typename H>
VGC_FN unsigned int vgc_input_flags(F g, H s) {
    unsigned int f = vgc_finite(g) ? 0u : VGC_FLAG_BAD_GRAD;
    double sd = vgc_to<double>(s);
    if (!vgc_finite(sd) || vgc_gt(0.0, sd)) f |= VGC_FLAG_BAD_SQSUM;
    return f;
}

template <typename F> VGC_FN unsigned int vgc_state_flags(F r, F v) {
    return (vgc_finite(r) ? 0u : VGC_FLAG_OVERFLOW_R) |
           (vgc_finite(v) ? 0u : VGC_FLAG_OVERFLOW_V);
}

/* flags[t] |= f, only when there is something to OR */
template <typename A>
VGC_FN void vgc_flag(A &flags, int t, unsigned int f) {
    if (f) vgc_atomic_or(&flags[t], f);
}

/* Fig. "Basic" over the arena: r2, v2 = the step of r, v (unselected:
 * decayed; the write pass resets the selected); a tensor without gradient
 * this step (inactive) keeps its state. */
template <typename F, typename H, typename O, typename B, typename A,
          typename M>
VGC_FN void vgc_model_vgc_select(long long i, F g, H s, F r, F v,
                                 const O &offsets, int n, const B &active,
                                 F alpha, F zeta, F &r2, F &v2,
                                 signed char &sel, A &flags, M &maxbits) {
    const int t = vgc_segment(offsets, n, i);
    sel = 0;
    r2 = r;
    v2 = v;
    if (!active[t]) return;
    vgc_flag(flags, t, vgc_input_flags(g, s));
    bool b = vgc_basic_select<F>(g, vgc_to<F>(s), alpha, zeta, r2, v2);
    sel = b ? 1 : 0;
    if (b) {
        unsigned long long m =
            (unsigned long long)(vgc_bits(r2) & vgc_float_traits<F>::ABS_MASK);
        if (m > (unsigned long long)maxbits[t]) vgc_atomic_max(&maxbits[t], m);
    }
}

/* Step 1, the gather: element i of the arena from tensor t = its segment,
 * read through table[t], the device address of that tensor's array of G
 * (C-contiguous): 0, a tensor without an array this step, gives zero; 1
 * leaves out as it is (a tensor of another dtype, which its own launch
 * gathers).  One launch per input dtype, whatever the number of tensors. */
template <typename T, typename G, typename P, typename O>
VGC_FN void vgc_model_gather(long long i, const P &table, const O &offsets,
                             int n, T &out) {
    const int t = vgc_segment(offsets, n, i);
    const unsigned long long at = (unsigned long long)table[t];
    if (at == 1ULL) return;
    if (at == 0ULL) {
        out = (T)0;
        return;
    }
    out = vgc_to<T>(((const G *)at)[i - (long long)offsets[t]]);
}

/* The start of every step, one thread a tensor: its fault flags and its
 * largest selected |r| (e_k's input) cleared, so that a step that failed
 * after its select pass leaves nothing behind. */
template <typename M>
VGC_FN void vgc_model_clear(long long t, unsigned int &flag, M &maxbits) {
    flag = 0u;
    maxbits[t] = 0ULL;
}

/* e_k of tensor t: floor(log2) of its largest selected |r| (Sec. 4.2) */
template <typename F, typename M>
VGC_FN int vgc_model_e_k(const M &maxbits, int t) {
    typedef typename vgc_float_traits<F>::U U;
    return vgc_floor_log2(vgc_from_bits((U)maxbits[t]));
}

/* The layouts' e_k of tensor t (0 unless from_max: Strom and hybrid send
 * signs); vgc_model_clear clears the maxima at the next step's start */
template <typename M>
VGC_FN int vgc_model_take_e_k(const M &maxbits, int t, bool from_max,
                              bool is_f64) {
    int e_k = 0;
    if (from_max)
        e_k = is_f64 ? vgc_model_e_k<double>(maxbits, t)
                     : vgc_model_e_k<float>(maxbits, t);
    return e_k;
}

/* 1 where a selected element is sent: representable against e_k */
template <typename F, typename M, typename O>
VGC_FN int vgc_model_keep(long long i, F r2, signed char sel,
                          const M &maxbits, const O &offsets, int n) {
    if (!sel) return 0;
    const int e_k = vgc_model_e_k<F>(maxbits, vgc_segment(offsets, n, i));
    if (e_k == VGC_LOG2_ZERO) return 0; /* every selected value subnormal */
    unsigned int word;
    return vgc_pow2_encode<F>(r2, e_k, 0, word) ? 1 : 0;
}

/* Hybrid (Fig. "Hybrid") and Strom over the arena: the state's whole step;
 * sign +1/-1/0 and ok = sign != 0 (the scan's input, int64: scanned in
 * place, it becomes pos). */
template <typename F, typename H, typename O, typename B, typename A>
VGC_FN void vgc_model_hybrid_step(long long i, F g, H s, F r, F v,
                                  const O &offsets, int n, const B &active,
                                  F alpha, F zeta, F tau, F &r2, F &v2,
                                  signed char &sign, long long &ok,
                                  A &flags) {
    const int t = vgc_segment(offsets, n, i);
    sign = 0;
    r2 = r;
    v2 = v;
    if (active[t]) {
        vgc_flag(flags, t, vgc_input_flags(g, s));
        sign = (signed char)vgc_hybrid_step<F>(g, vgc_to<F>(s), alpha, zeta,
                                               tau, r2, v2);
        vgc_flag(flags, t, vgc_state_flags(r2, v2));
    }
    ok = sign != 0;
}

template <typename F, typename O, typename B, typename A>
VGC_FN void vgc_model_strom_step(long long i, F g, F r, const O &offsets,
                                 int n, const B &active, F tau, F &r2,
                                 signed char &sign, long long &ok,
                                  A &flags) {
    const int t = vgc_segment(offsets, n, i);
    sign = 0;
    r2 = r;
    if (active[t]) {
        vgc_flag(flags, t, vgc_input_flags(g, (F)0));
        sign = (signed char)vgc_strom_step<F>(g, tau, r2);
        vgc_flag(flags, t, vgc_state_flags(r2, (F)0));
    }
    ok = sign != 0;
}

/* The layouts' summary for the host, downloaded with the message:
 * info = {total words, groups, elements sent (low, high word), adjacent
 * groups that codec.merge_spans might merge (0: the host skips it)};
 * chainer_vgc.device_step.INFO_WORDS words */
#define VGC_MERGE_MAX_COUNT 1024
template <typename W>
VGC_FN void vgc_model_info(W &info, long long words, long long groups,
                           long long sent, long long mergeable) {
    info[0] = (unsigned int)words;
    info[1] = (unsigned int)groups;
    info[2] = (unsigned int)(sent & 0xFFFFFFFFLL);
    info[3] = (unsigned int)(sent >> 32);
    info[4] = (unsigned int)mergeable;
}

/* first rank of tensor t, and its count (pos: inclusive scan) */
template <typename P, typename O>
VGC_FN long long vgc_rank0(const P &pos, const O &offsets, int t) {
    const long long lo = (long long)offsets[t];
    return lo ? (long long)pos[lo - 1] : 0LL;
}
template <typename P, typename O>
VGC_FN long long vgc_sent(const P &pos, const O &offsets, int t) {
    const long long lo = (long long)offsets[t], hi = (long long)offsets[t + 1];
    return hi > lo ? (long long)pos[hi - 1] - vgc_rank0(pos, offsets, t) : 0;
}

/* The layout, one thread: tensor t sends pos[end_t - 1] - pos[start_t - 1]
 * elements (pos: inclusive scan of ok); its FMT_POW2 group (header: t,
 * FMT_POW2, count, e_k, scale) goes after the groups before it.  Writes
 * the message's first two words and the headers into msg, base[t] = the
 * word of its first body word (-1: no group), ek[t], and info = {total
 * words, groups}. */
template <typename P, typename O, typename M, typename E, typename W>
VGC_FN void vgc_model_layout(const P &pos, const O &offsets, int n,
                             M &maxbits, bool from_max, unsigned int scale,
                             E &base, E &ek, W &msg, W &info, bool is_f64) {
    long long w = 2, groups = 0, sent = 0;
    for (int t = 0; t < n; ++t) {
        const long long count = vgc_sent(pos, offsets, t);
        const int e_k = vgc_model_take_e_k(maxbits, t, from_max, is_f64);
        sent += count;
        ek[t] = e_k;
        if (!count) {
            base[t] = -1;
            continue;
        }
        msg[w] = (unsigned int)t;
        msg[w + 1] = VGC_FMT_POW2;
        msg[w + 2] = (unsigned int)count;
        msg[w + 3] = (unsigned int)e_k;
        msg[w + 4] = scale;
        base[t] = w + VGC_HEADER_WORDS;
        w += VGC_HEADER_WORDS + count;
        ++groups;
    }
    msg[0] = VGC_MAGIC;
    msg[1] = (unsigned int)groups;
    vgc_model_info(info, w, groups, sent, 0); /* (no merging: 'fixed') */
}

/* ok of element i, from pos (the inclusive scan of ok, done in place) */
template <typename P>
VGC_FN int vgc_model_ok(const P &pos, long long i) {
    return (int)((long long)pos[i] - (i ? (long long)pos[i - 1] : 0LL));
}

/* The slot of element i in its group's body (pos: inclusive scan of ok) */
template <typename P, typename O>
VGC_FN long long vgc_model_slot(const P &pos, const O &offsets, int t,
                                long long i) {
    return (long long)pos[i] - 1 - vgc_rank0(pos, offsets, t);
}

/* vgc: r and v of a selected element reset (with keep_unrepresentable, of
 * one sent only); the overflow flags of the state that stays */
template <typename F, typename B, typename A>
VGC_FN void vgc_model_vgc_reset(int t, int ok, signed char sel,
                                const B &active, bool keep, F &r2, F &v2,
                                A &flags) {
    if (sel && (ok || !keep)) {
        r2 = (F)0;
        v2 = (F)0;
    }
    if (active[t]) vgc_flag(flags, t, vgc_state_flags(r2, v2));
}

/* vgc's write pass: the word of each element sent; r and v of the
 * selected reset (with keep_unrepresentable, of those sent only); the
 * overflow flags of the state that stays. */
template <typename F, typename P, typename O, typename E, typename B,
          typename W, typename A>
VGC_FN void vgc_model_vgc_write(long long i, signed char sel,
                                const P &pos, const O &offsets, int n,
                                const E &base, const E &ek, const B &active,
                                bool keep, F &r2, F &v2, W &msg, A &flags) {
    const int t = vgc_segment(offsets, n, i);
    const int ok = vgc_model_ok(pos, i);
    if (sel && ok) {
        unsigned int word;
        vgc_pow2_encode<F>(r2, (int)ek[t], i - (long long)offsets[t], word);
        msg[(long long)base[t] + vgc_model_slot(pos, offsets, t, i)] = word;
    }
    vgc_model_vgc_reset(t, ok, sel, active, keep, r2, v2, flags);
}

/* Hybrid's and Strom's write pass: the sign word (e_k 0, d 0) of each
 * element sent */
template <typename P, typename O, typename E, typename W>
VGC_FN void vgc_model_sign_write(long long i, signed char sign, const P &pos,
                                 const O &offsets, int n, const E &base,
                                 W &msg) {
    if (!sign) return;
    const int t = vgc_segment(offsets, n, i);
    msg[(long long)base[t] + vgc_model_slot(pos, offsets, t, i)] =
        vgc_pack_word(sign < 0, 0,
                      (unsigned int)(i - (long long)offsets[t]));
}

/* 'none': each tensor with a gradient sends it whole, a dense FMT_RAW
 * group of state-dtype values (float64: two words, low first).  The
 * layout, one thread: headers and places; info = {total words, groups}. */
template <typename O, typename B, typename E, typename W>
VGC_FN void vgc_model_none_layout(const O &offsets, int n, const B &active,
                                  bool is_f64, E &base, W &msg, W &info) {
    long long w = 2, groups = 0, sent = 0;
    const int per = is_f64 ? 2 : 1;
    for (int t = 0; t < n; ++t) {
        const long long size = (long long)offsets[t + 1] - offsets[t];
        if (!active[t] || !size) {
            base[t] = -1;
            continue;
        }
        msg[w] = (unsigned int)t;
        msg[w + 1] = VGC_FMT_RAW;
        msg[w + 2] = (unsigned int)size;
        msg[w + 3] = VGC_RAW_DENSE | (is_f64 ? VGC_RAW_FLOAT64 : 0u);
        msg[w + 4] = 0u;
        base[t] = w + VGC_HEADER_WORDS;
        w += VGC_HEADER_WORDS + per * size;
        sent += size;
        ++groups;
    }
    msg[0] = VGC_MAGIC;
    msg[1] = (unsigned int)groups;
    vgc_model_info(info, w, groups, sent, 0);
}

/* the state dtype of a gradient dtype: float64 for float64, else float32
 * (float16 in any of its device spellings, float32) */
template <typename G> struct vgc_state { typedef float type; };
template <> struct vgc_state<double> { typedef double type; };

/* 'none': element i's value words, and BAD_GRAD where it is not finite */
template <typename F, typename O, typename E, typename W, typename A>
VGC_FN void vgc_model_none_write(long long i, F g, const O &offsets, int n,
                                 const E &base, W &msg, A &flags) {
    const int t = vgc_segment(offsets, n, i);
    if ((long long)base[t] < 0) return;
    vgc_flag(flags, t, vgc_finite(g) ? 0u : VGC_FLAG_BAD_GRAD);
    const long long j = i - (long long)offsets[t];
    const unsigned long long b = (unsigned long long)vgc_bits(g);
    if (sizeof(F) == 8) {
        msg[(long long)base[t] + 2 * j] = (unsigned int)b;
        msg[(long long)base[t] + 2 * j + 1] = (unsigned int)(b >> 32);
    } else {
        msg[(long long)base[t] + j] = (unsigned int)b;
    }
}

/* ---- The whole-model decode + mean (issue 25) -------------------------- *
 * One thread per element of the model: the sum, in rank order from +0.0
 * (dense: MPI's rank-order tree), of what each rank's message carries for
 * it, then the mean in the parameter dtype.  The uploaded buffer starts
 * with a descriptor of VGC_DESC_WORDS words per (rank, tensor): body
 * offset (low, high word), count, kind, e_k, scale bits, and for a
 * FMT_GAP group the tensor's first index in the group's index space (low,
 * high); the bodies follow.  FMT_GAP bodies arrive as sent: first
 * vgc_model_gap_expand decodes them, one thread per block of
 * VGC_GAP_RESTART_CODES codes from its restart point, into one uint64 a
 * element (index in the group's index space | nibble << 60). */
#define VGC_DESC_WORDS 8
#define VGC_BODY_POW2 1u
#define VGC_BODY_RAW32 2u
#define VGC_BODY_RAW64 3u
#define VGC_BODY_DENSE32 4u
#define VGC_BODY_DENSE64 5u
#define VGC_BODY_GAP 6u
#define VGC_TREE_MAX 64
#define VGC_EXPANDED_INDEX 0x0FFFFFFFFFFFFFFFull

/* the 64-bit field of words buf[at], buf[at + 1] (low word first) */
template <typename W>
VGC_FN unsigned long long vgc_u64_at(const W &buf, long long at) {
    return (unsigned long long)(unsigned int)buf[at] |
           ((unsigned long long)(unsigned int)buf[at + 1] << 32);
}

/* bits pos .. pos + 31 of the G-word stream at buf[s] (0 past its end) */
template <typename W>
VGC_FN unsigned int vgc_stream32(const W &buf, long long s, long long G,
                                 unsigned long long pos) {
    const unsigned long long w = pos >> 5;
    const unsigned long long lo =
        w < (unsigned long long)G ? (unsigned int)buf[s + (long long)w] : 0u;
    const unsigned long long hi =
        w + 1 < (unsigned long long)G ? (unsigned int)buf[s + (long long)w + 1]
                                      : 0u;
    return (unsigned int)((lo | (hi << 32)) >> (pos & 31));
}

/* the n (0..64) bits at pos, LSB first */
template <typename W>
VGC_FN unsigned long long vgc_stream_bits(const W &buf, long long s,
                                          long long G, unsigned long long pos,
                                          int n) {
    if (n == 0) return 0ull;
    if (n <= 32)
        return vgc_stream32(buf, s, G, pos) & (0xFFFFFFFFu >> (32 - n));
    return (unsigned long long)vgc_stream32(buf, s, G, pos) |
           ((unsigned long long)(vgc_stream32(buf, s, G, pos + 32) &
                                 (0xFFFFFFFFu >> (64 - n))) << 32);
}

/* Block b of the FMT_GAP groups: its group g is the last with
 * starts[g] <= b (starts: the groups' first blocks, cumulative, starts[0]
 * = 0), block k = b - starts[g] of it; the group's row of VGC_GAP_ROW
 * int64 in groups: its body's first word in buf, its codes, its first
 * element's place in out, its index space (span_size), its message.
 * From the body (docs/wire_format.md Sec. 4.5): the param word (k,
 * SIGN_ONLY), G, the restart table (entry m: the bit where code
 * (m + 1) N starts and the index before it, N = VGC_GAP_RESTART_CODES),
 * the stream, the value fields.  Block k decodes codes k N .. (k + 1) N
 * - 1 from entry k - 1 (block 0: bit 0, index -1), and writes each
 * element's index in the group's index space | its nibble (sign << 3 |
 * d) << 60.
 *
 * The host checked the message's structure only (headers, lengths,
 * value padding: native.decode_mean with gap_codes=False), so every
 * check of codec.gap_decode on the codes is made here (issue 36), each
 * code with the exact checks of vgc_gap_decode: a code never read past
 * the stream (32 G bits), a gap never past the group's index space; the
 * block must end where entry k says (bit and index), and the last block
 * at the canonical end (the last word, zero padding).  By induction from
 * block 0's exact start, every entry is then the sequential decoder's.
 * A failed check sets errs[message] and stops the block (its elements
 * are left unwritten: whoever reads them must stay in bounds whatever
 * they hold).  Reads buf only inside the group's body. */
#define VGC_GAP_ROW 5
template <typename W, typename I, typename X, typename E>
VGC_FN void vgc_model_gap_expand(long long b, const W &buf, const I &starts,
                                 const I &groups, int n_groups, X &out,
                                 E &errs) {
    const int g = vgc_segment(starts, n_groups, b);
    const long long k_block = b - (long long)starts[g];
    const long long nb = (long long)starts[g + 1] - (long long)starts[g];
    const long long at = (long long)VGC_GAP_ROW * g;
    const long long body = (long long)groups[at];
    const long long count = (long long)groups[at + 1];
    const long long first = (long long)groups[at + 2];
    const long long size = (long long)groups[at + 3];
    const unsigned int msg = (unsigned int)(long long)groups[at + 4];
    const unsigned int param = (unsigned int)buf[body];
    const long long G = (long long)(unsigned int)buf[body + 1];
    const long long table = body + VGC_GAP_PARAM_WORDS;
    const long long s = table + VGC_GAP_RESTART_WORDS * (nb - 1);
    unsigned long long pos = 0;
    long long prev = -1;
    if (k_block > 0) {
        const long long e = table + VGC_GAP_RESTART_WORDS * (k_block - 1);
        pos = vgc_u64_at(buf, e);
        prev = (long long)vgc_u64_at(buf, e + 2);
    }
    const long long j0 = k_block * VGC_GAP_RESTART_CODES;
    const long long left = count - j0;
    const long long codes = left < VGC_GAP_RESTART_CODES ? left
                                                         : VGC_GAP_RESTART_CODES;
    const int k = (int)(param & 63u);
    const bool sign_only = (param & VGC_GAP_SIGN_ONLY) != 0;
    const long long v = s + G;
    const long long o = first + j0;
    const bool last = k_block == nb - 1;
    const unsigned long long total = 32ull * (unsigned long long)G;
    const unsigned int esc_mask = (1u << VGC_GAP_ESCAPE) - 1u;
    bool ok = true;
    for (long long j = 0; j < codes && ok; ++j) {
        if (pos > total || prev < -1 || prev + 1 >= size) { ok = false; break; }
        const unsigned long long limit = (unsigned long long)(size - prev - 1);
        const unsigned long long qmax = (limit - 1) >> k;
        unsigned long long q;
        const unsigned int w = vgc_stream32(buf, s, G, pos);
        if (w & esc_mask) { /* unary: z zeros and a one */
            const int z = vgc_ilog2_u64((unsigned long long)(w & (0u - w)));
            if (pos + z + 1 > total) { ok = false; break; }
            q = (unsigned long long)z;
            pos += z + 1;
            if (q > qmax) { ok = false; break; }
        } else { /* escape, then Elias gamma: n zeros, a one, n bits */
            if (pos + VGC_GAP_ESCAPE > total) { ok = false; break; }
            pos += VGC_GAP_ESCAPE;
            int n = 0;
            for (;;) {
                if (pos + n >= total) { ok = false; break; }
                const unsigned int x = vgc_stream32(buf, s, G, pos + n);
                if (x) {
                    n += vgc_ilog2_u64((unsigned long long)(x & (0u - x)));
                    break;
                }
                n += 32;
                if (n >= 64) { ok = false; break; }
            }
            if (!ok || n >= 64 || pos + 2ull * n + 1 > total) {
                ok = false;
                break;
            }
            const unsigned long long val =
                (1ull << n) | vgc_stream_bits(buf, s, G, pos + n + 1, n);
            pos += 2ull * n + 1;
            if (qmax < VGC_GAP_ESCAPE || val > qmax - (VGC_GAP_ESCAPE - 1)) {
                ok = false;
                break;
            }
            q = val + (VGC_GAP_ESCAPE - 1);
        }
        if (pos + k > total) { ok = false; break; }
        const unsigned long long gap =
            (q << k) | vgc_stream_bits(buf, s, G, pos, k);
        pos += k;
        if (gap >= limit) { ok = false; break; }
        prev += 1 + (long long)gap;
        const long long e = j0 + j; /* its value field */
        const unsigned int field =
            sign_only ? (((unsigned int)buf[v + (e >> 5)] >> (e & 31)) & 1u) << 3
                      : ((unsigned int)buf[v + (e >> 3)] >> (4 * (e & 7))) & 15u;
        out[o + j] = (unsigned long long)prev | ((unsigned long long)field << 60);
    }
    if (ok && !last) { /* where the next block starts: entry k_block */
        const long long e = table + VGC_GAP_RESTART_WORDS * k_block;
        ok = pos == vgc_u64_at(buf, e) &&
             (unsigned long long)prev == vgc_u64_at(buf, e + 2);
    } else if (ok) { /* the canonical end */
        ok = pos <= total && prev < size && (pos + 31) / 32 == (unsigned long long)G &&
             (!(pos & 31) || !((unsigned int)buf[s + G - 1] >> (pos & 31)));
    }
    if (!ok) vgc_atomic_or(&errs[msg], 1u);
}

template <typename S, typename W>
VGC_FN S vgc_raw_value(const W &buf, long long at, bool f64) {
    if (!f64) return vgc_to<S>(vgc_from_bits((unsigned int)buf[at]));
    const unsigned long long lo = (unsigned int)buf[at],
                             hi = (unsigned int)buf[at + 1];
    return vgc_to<S>(vgc_from_bits(lo | (hi << 32)));
}

/* where key is among a[off .. off + count), their bits under mask sorted
 * increasing (a binary search); -1 if it is not */
template <typename A>
VGC_FN long long vgc_find(const A &a, long long off, long long count,
                          unsigned long long mask, unsigned long long key) {
    long long lo = 0, hi = count; /* the first >= key */
    while (lo < hi) {
        const long long mid = lo + (hi - lo) / 2;
        if (((unsigned long long)a[off + mid] & mask) < key)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < count && ((unsigned long long)a[off + lo] & mask) == key
               ? lo
               : -1;
}

/* the value the group described at buf[d] carries for index j, if any
 * (a FMT_GAP group's elements: in gaps, by vgc_model_gap_expand, j at
 * the tensor's place in the group) */
template <typename S, typename W, typename X>
VGC_FN bool vgc_lookup(const W &buf, const X &gaps, long long d, long long j,
                       S &value) {
    const long long count = (long long)(unsigned int)buf[d + 2];
    if (!count) return false;
    const long long off = (long long)(unsigned int)buf[d] |
                          ((long long)(unsigned int)buf[d + 1] << 32);
    const unsigned int kind = buf[d + 3];
    if (kind == VGC_BODY_DENSE32 || kind == VGC_BODY_DENSE64) {
        const bool f64 = kind == VGC_BODY_DENSE64;
        value = vgc_raw_value<S>(buf, off + (f64 ? 2 * j : j), f64);
        return true;
    }
    const bool gap = kind == VGC_BODY_GAP;
    const long long at =
        gap ? vgc_find(gaps, off, count, VGC_EXPANDED_INDEX,
                       vgc_u64_at(buf, d + 6) + (unsigned long long)j)
            : vgc_find(buf, off, count,
                       kind == VGC_BODY_POW2 ? VGC_INDEX_MASK : 0xFFFFFFFFu,
                       (unsigned long long)j);
    if (at < 0) return false;
    if (gap || kind == VGC_BODY_POW2) { /* (an expanded element's nibble
                                          * as the top of a FMT_POW2 word) */
        const unsigned int word =
            gap ? (unsigned int)(((unsigned long long)gaps[off + at] >> 60)
                                 << 28)
                : (unsigned int)buf[off + at];
        long long index;
        const S scale = vgc_to<S>(vgc_from_bits((unsigned int)buf[d + 5]));
        value = vgc_pow2_decode<S>(word, (int)buf[d + 4], scale, index);
        return true;
    }
    const bool f64 = kind == VGC_BODY_RAW64;
    value = vgc_raw_value<S>(buf, off + count + (f64 ? 2 * at : at), f64);
    return true;
}

/* the mean in the parameter dtype D of a sum acc in D's state dtype
 * (chainer_vgc.exchange's _finish_mean; see vgc_model_mean) */
template <typename D, typename S>
VGC_FN D vgc_mean_of(S acc, bool rescaled, double inv, double rescale,
                     float k16) {
    if (rescaled)
        return vgc_to<D>(vgc_mul(vgc_mul(acc, vgc_to<S>(inv)),
                                 vgc_to<S>(rescale)));
    if (sizeof(D) == 2)
        return vgc_to<D>(vgc_mul(vgc_to<float>(vgc_to<D>(acc)), k16));
    return vgc_mul(vgc_to<D>(acc), vgc_to<D>(inv));
}

/* the mean of element i in the parameter dtype D (chainer_vgc.exchange's
 * _finish_mean): sum * (1/p) in D (float16: the product in float32 by
 * k16 = float32(float16(1/p)), rounded once); with a loss scale, sum *
 * (1/p) * scale in the state dtype, then D */
template <typename D, typename W, typename X, typename O, typename T>
VGC_FN D vgc_model_mean(long long i, const W &buf, const X &gaps,
                        const O &offsets, const T &tids, int n_local, int n,
                        int p, bool dense, bool rescaled, double inv,
                        double rescale, float k16) {
    typedef typename vgc_state<D>::type S;
    /* i counts the elements of this launch's tensors (one dtype), end to
     * end: offsets[n_local + 1], their ids in the model tids[n_local] */
    const int u = vgc_segment(offsets, n_local, i);
    const int t = (int)tids[u];
    const long long j = i - (long long)offsets[u];
    S acc = (S)0, v;
    if (!dense) {
        for (int b = 0; b < p; ++b)
            if (vgc_lookup<S>(buf, gaps, (long long)VGC_DESC_WORDS * ((long long)b * n + t), j, v))
                acc = vgc_add(acc, v);
    } else {
        S vals[VGC_TREE_MAX];
        for (int b = 0; b < p; ++b)
            vals[b] = vgc_lookup<S>(buf, gaps, (long long)VGC_DESC_WORDS * ((long long)b * n + t), j, v)
                ? vgc_add((S)0, v) : (S)0;
        for (int w = p; w > 1; w = (w + 1) / 2) {
            for (int k = 0; k < w / 2; ++k)
                vals[k] = vgc_add(vals[2 * k], vals[2 * k + 1]);
            if (w & 1) vals[w / 2] = vals[w - 1];
        }
        acc = vals[0];
    }
    return vgc_mean_of<D>(acc, rescaled, inv, rescale, k16);
}

/* ---- The sparse mean by scatter (issue 36) ----------------------------- *
 * Without the dense tree, the sum of element j is the values the ranks
 * sent for it added in rank order from +0.0 (vgc_model_mean's order).
 * Here the sums live in acc, uint32 words from +0.0 (all bits zero):
 * tensor t's from acc_at[t] on, one word an element in float32 state,
 * two in float64 (acc_at[t + 1] - acc_at[t] is then twice its size).  Rank b's launch has one thread per element its
 * message carries: it finds its group among the rank's items (the group
 * table's rows of that message, in order: item_ends cumulative counts,
 * item_tids their first tensor), reads the element's index and value as
 * vgc_lookup would, and adds the value to the element's sum.  A message
 * carries an index at most once, so the threads of one launch touch
 * distinct sums, and the launches run in rank order on one stream: each
 * sum is built in rank order, as vgc_model_mean builds it, bit for bit.
 * Then vgc_model_finish writes the means.  An index outside the model
 * (a FMT_GAP element left unwritten by a block that failed its checks:
 * the step is refused then) adds nothing. */
template <typename S, typename A>
VGC_FN void vgc_acc_add(A &acc, long long w, S v) {
    if (sizeof(S) == 8) {
        const unsigned long long lo = (unsigned int)acc[w],
                                 hi = (unsigned int)acc[w + 1];
        const unsigned long long r = (unsigned long long)vgc_bits(
            vgc_add(vgc_to<S>(vgc_from_bits(lo | (hi << 32))), v));
        acc[w] = (unsigned int)r;
        acc[w + 1] = (unsigned int)(r >> 32);
    } else {
        acc[w] = (unsigned int)vgc_bits(
            vgc_add(vgc_to<S>(vgc_from_bits((unsigned int)acc[w])), v));
    }
}

/* element i of rank b's message: its descriptor's word index d in buf
 * (item r = the rank's group holding i, tensor item_tids[r]), its index
 * in the model's index space (bounds[n] if none), and for FMT_POW2 and
 * FMT_GAP its word (the nibble on top); the value is read by
 * vgc_scatter_value once the tensor, hence the state dtype, is known */
template <typename W, typename X, typename I>
VGC_FN long long vgc_scatter_index(long long i, const W &buf, const X &gaps,
                                   const I &item_ends, const I &item_tids,
                                   int n_items, int b, int n, const I &bounds,
                                   long long &d, long long &e,
                                   unsigned int &word) {
    const int r = vgc_segment(item_ends, n_items, i);
    const int t = (int)item_tids[r];
    e = i - (long long)item_ends[r];
    d = (long long)VGC_DESC_WORDS * ((long long)b * n + t);
    const long long off = (long long)(unsigned int)buf[d] |
                          ((long long)(unsigned int)buf[d + 1] << 32);
    const unsigned int kind = buf[d + 3];
    const long long end = (long long)bounds[n];
    word = 0u;
    if (kind == VGC_BODY_DENSE32 || kind == VGC_BODY_DENSE64)
        return (long long)bounds[t] + e;
    if (kind == VGC_BODY_RAW32 || kind == VGC_BODY_RAW64)
        return (long long)bounds[t] + (long long)(unsigned int)buf[off + e];
    if (kind == VGC_BODY_GAP) {
        const unsigned long long x = (unsigned long long)gaps[off + e];
        const unsigned long long gi = x & VGC_EXPANDED_INDEX;
        word = (unsigned int)((x >> 60) << 28);
        return gi < (unsigned long long)(end - (long long)bounds[t])
                   ? (long long)bounds[t] + (long long)gi
                   : end;
    }
    if (kind != VGC_BODY_POW2) return end;
    word = (unsigned int)buf[off + e];
    return (long long)bounds[t] + (long long)(word & VGC_INDEX_MASK);
}

template <typename S, typename W>
VGC_FN S vgc_scatter_value(const W &buf, long long d, long long e,
                           unsigned int word) {
    const long long count = (long long)(unsigned int)buf[d + 2];
    const long long off = (long long)(unsigned int)buf[d] |
                          ((long long)(unsigned int)buf[d + 1] << 32);
    const unsigned int kind = buf[d + 3];
    if (kind == VGC_BODY_DENSE32 || kind == VGC_BODY_DENSE64) {
        const bool f64 = kind == VGC_BODY_DENSE64;
        return vgc_raw_value<S>(buf, off + (f64 ? 2 * e : e), f64);
    }
    if (kind == VGC_BODY_RAW32 || kind == VGC_BODY_RAW64) {
        const bool f64 = kind == VGC_BODY_RAW64;
        return vgc_raw_value<S>(buf, off + count + (f64 ? 2 * e : e), f64);
    }
    long long index;
    const S scale = vgc_to<S>(vgc_from_bits((unsigned int)buf[d + 5]));
    return vgc_pow2_decode<S>(word, (int)buf[d + 4], scale, index);
}

template <typename W, typename X, typename I, typename A>
VGC_FN void vgc_model_scatter(long long i, const W &buf, const X &gaps,
                              const I &item_ends, const I &item_tids,
                              int n_items, int b, int n, const I &bounds,
                              const I &acc_at, A &acc) {
    long long d, e;
    unsigned int word;
    const long long j = vgc_scatter_index(i, buf, gaps, item_ends, item_tids,
                                          n_items, b, n, bounds, d, e, word);
    if (j < 0 || j >= (long long)bounds[n]) return;
    const int u = vgc_segment(bounds, n, j);
    const long long at = (long long)acc_at[u],
                    wide = (long long)acc_at[u + 1] - at >
                           (long long)bounds[u + 1] - (long long)bounds[u];
    const long long k = j - (long long)bounds[u];
    if (wide)
        vgc_acc_add<double>(acc, at + 2 * k,
                            vgc_scatter_value<double>(buf, d, e, word));
    else
        vgc_acc_add<float>(acc, at + k,
                           vgc_scatter_value<float>(buf, d, e, word));
}

/* the mean of element i of this launch's tensors (one parameter dtype D,
 * as vgc_model_mean's i) from its sum in acc */
template <typename D, typename A, typename I>
VGC_FN D vgc_model_finish(long long i, const A &acc, const I &acc_at,
                          const I &offsets, const I &tids, int n_local,
                          bool rescaled, double inv, double rescale,
                          float k16) {
    typedef typename vgc_state<D>::type S;
    const int u = vgc_segment(offsets, n_local, i);
    const int t = (int)tids[u];
    const long long w = (long long)acc_at[t] +
                        (sizeof(S) == 8 ? 2 : 1) * (i - (long long)offsets[u]);
    S sum;
    if (sizeof(S) == 8)
        sum = vgc_to<S>(vgc_from_bits(
            (unsigned long long)(unsigned int)acc[w] |
            ((unsigned long long)(unsigned int)acc[w + 1] << 32)));
    else
        sum = vgc_to<S>(vgc_from_bits((unsigned int)acc[w]));
    return vgc_mean_of<D>(sum, rescaled, inv, rescale, k16);
}

/* ---- FMT_GAP on the device, for the whole model (issue 25) ------------- *
 * After the scan of the elements sent (pos): the compact pass puts each
 * sent element's FMT_POW2 word at its rank (cw) with its tensor (ct); the
 * lengths pass gives each rank its code length with its tensor's Rice
 * parameter; a scan of those gives where each code ends (ends); the
 * layout (one thread) picks each group's format ('gap', or 'auto': FMT_GAP
 * where its body is shorter) and place; the assemble pass builds every
 * word of the message, one thread a word, from those arrays: headers, the
 * paper's words, or a FMT_GAP body (the codes and value fields overlapping
 * the word, no atomics). */

/* codec.rice_parameter for count <= size <= 2**28 */
VGC_FN int vgc_rice(long long count, long long size) {
    if (count <= 0 || size <= count) return 0;
    const long long t = (11 * (size - count)) / (16 * count);
    if (t < 1) return 0;
    const int k = vgc_ilog2_u64((unsigned long long)t);
    return k < 62 ? k : 62;
}

/* vgc: each sent element's word at its rank, with its tensor; then
 * vgc_model_vgc_reset, as in vgc_model_vgc_write */
template <typename F, typename P, typename O, typename M, typename B,
          typename W, typename T, typename A>
VGC_FN void vgc_model_vgc_compact(long long i, signed char sel,
                                  const P &pos, const O &offsets, int n,
                                  const M &maxbits, const B &active,
                                  bool keep, F &r2, F &v2, W &cw, T &ct,
                                  A &flags) {
    const int t = vgc_segment(offsets, n, i);
    const int ok = vgc_model_ok(pos, i);
    if (sel && ok) {
        unsigned int word;
        vgc_pow2_encode<F>(r2, vgc_model_e_k<F>(maxbits, t),
                           i - (long long)offsets[t], word);
        cw[(long long)pos[i] - 1] = word;
        ct[(long long)pos[i] - 1] = t;
    }
    vgc_model_vgc_reset(t, ok, sel, active, keep, r2, v2, flags);
}

/* hybrid, Strom: each sent element's sign word at its rank */
template <typename P, typename O, typename W, typename T>
VGC_FN void vgc_model_sign_compact(long long i, signed char sign,
                                   const P &pos, const O &offsets, int n,
                                   W &cw, T &ct) {
    if (!sign) return;
    const int t = vgc_segment(offsets, n, i);
    cw[(long long)pos[i] - 1] =
        vgc_pack_word(sign < 0, 0, (unsigned int)(i - (long long)offsets[t]));
    ct[(long long)pos[i] - 1] = t;
}

/* the code length of rank j (0 past the last rank sent) */
template <typename W, typename T, typename P, typename O>
VGC_FN long long vgc_model_gap_length(long long j, const W &cw, const T &ct,
                                      const P &pos, const O &offsets, int n) {
    const long long total = (long long)pos[(long long)offsets[n] - 1];
    if (j >= total) return 0;
    const int t = (int)ct[j];
    const long long r0 = vgc_rank0(pos, offsets, t);
    const int k = vgc_rice(vgc_sent(pos, offsets, t),
                           (long long)offsets[t + 1] - offsets[t]);
    const long long ix = (long long)(cw[j] & VGC_INDEX_MASK);
    const long long prev =
        j > r0 ? (long long)(cw[j - 1] & VGC_INDEX_MASK) : -1LL;
    return vgc_gap_code_length(ix - prev - 1, k);
}

/* The layout of the coded groups, one thread: per tensor, rec[6 t ..] =
 * {first word, format, k, stream words G, count, e_k}; rec[6 n], rec[6 n
 * + 1] = total words, groups; info = {total words, groups}; clears
 * maxbits. */
template <typename P, typename E, typename O, typename M, typename R,
          typename W>
VGC_FN void vgc_model_gap_layout(const P &pos, const E &ends,
                                 const O &offsets, int n, M &maxbits,
                                 bool from_max, bool is_f64, bool always_gap,
                                 bool sign_only, R &rec, W &info) {
    long long w = 2, groups = 0, sent = 0, mergeable = 0;
    long long last_count = 0; /* the previous group's count and e_k */
    int last_e_k = 0;
    const long long per = sign_only ? 1 : 4;
    for (int t = 0; t < n; ++t) {
        const long long count = vgc_sent(pos, offsets, t);
        const long long r0 = vgc_rank0(pos, offsets, t);
        const int e_k = vgc_model_take_e_k(maxbits, t, from_max, is_f64);
        rec[6 * t] = w;
        rec[6 * t + 1] = 0;
        if (!count) continue;
        const long long bits =
            (long long)ends[r0 + count - 1] - (r0 ? (long long)ends[r0 - 1] : 0);
        const long long G = (bits + 31) / 32;
        const long long body = VGC_GAP_PARAM_WORDS +
                               VGC_GAP_RESTART_WORDS * vgc_gap_restarts(count) +
                               G + (count * per + 31) / 32;
        const bool gap = always_gap || body < count;
        rec[6 * t + 1] = gap ? VGC_FMT_GAP : VGC_FMT_POW2;
        rec[6 * t + 2] = vgc_rice(count, (long long)offsets[t + 1] - offsets[t]);
        rec[6 * t + 3] = G;
        rec[6 * t + 4] = count;
        rec[6 * t + 5] = e_k;
        w += VGC_HEADER_WORDS + (gap ? body : count);
        /* two groups in a row of at most MERGE_MAX_COUNT elements with
         * one value table (e_k; the scale is the step's) */
        if (groups && count <= VGC_MERGE_MAX_COUNT &&
            last_count <= VGC_MERGE_MAX_COUNT && e_k == last_e_k)
            ++mergeable;
        last_count = count;
        last_e_k = e_k;
        sent += count;
        ++groups;
    }
    rec[6 * n] = w;
    rec[6 * n + 1] = groups;
    vgc_model_info(info, w, groups, sent, mergeable);
}

/* bit p (0 <= p < its length) of the code of `gap` with parameter k */
VGC_FN unsigned int vgc_code_bit(unsigned long long gap, int k, long long p) {
    const unsigned long long q = gap >> k;
    unsigned long long v = 0;
    long long z = (long long)q, nb = 0;
    if (q >= VGC_GAP_ESCAPE) {
        v = q - VGC_GAP_ESCAPE + 1;
        nb = vgc_ilog2_u64(v);
        z = VGC_GAP_ESCAPE + nb;
    }
    if (p < z) return 0u;
    if (p == z) return 1u;
    if (p <= z + nb) return (unsigned int)((v >> (p - z - 1)) & 1ULL);
    return (unsigned int)((gap >> (p - z - 1 - nb)) & 1ULL);
}

/* Message word w (< the total): a header word, a paper's word, or a word
 * of a FMT_GAP body */
template <typename R, typename W, typename P, typename O, typename E>
VGC_FN unsigned int vgc_model_gap_word(long long w, const R &rec, int n,
                                       const W &cw, const P &pos,
                                       const O &offsets, const E &ends,
                                       unsigned int scale, bool sign_only) {
    /* the group holding w: the last t with rec[6 t] <= w (an empty tensor
     * shares its first word with the next) */
    int lo = 0, hi = n - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if ((long long)rec[6 * mid] <= w)
            lo = mid;
        else
            hi = mid - 1;
    }
    const int t = lo;
    const long long off = w - (long long)rec[6 * t];
    const unsigned int fmt = (unsigned int)rec[6 * t + 1];
    const long long count = (long long)rec[6 * t + 4];
    if (off < VGC_HEADER_WORDS) {
        const unsigned int head[VGC_HEADER_WORDS] = {
            (unsigned int)t, fmt, (unsigned int)count,
            (unsigned int)(int)rec[6 * t + 5], scale};
        return head[off];
    }
    const long long b = off - VGC_HEADER_WORDS;
    const long long r0 = vgc_rank0(pos, offsets, t);
    if (fmt == VGC_FMT_POW2) return (unsigned int)cw[r0 + b];
    const int k = (int)rec[6 * t + 2];
    const long long G = (long long)rec[6 * t + 3];
    const long long T = VGC_GAP_RESTART_WORDS * vgc_gap_restarts(count);
    const long long s0 = r0 ? (long long)ends[r0 - 1] : 0LL;
    if (b == 0)
        return (unsigned int)k | (sign_only ? VGC_GAP_SIGN_ONLY : 0u) |
               (T ? VGC_GAP_RESTARTS : 0u);
    if (b == 1) return (unsigned int)G;
    if (b < VGC_GAP_PARAM_WORDS + T) { /* restart m: {bit, index} */
        const long long e = b - VGC_GAP_PARAM_WORDS;
        const long long last = /* rank of code m N - 1 */
            r0 + (e / VGC_GAP_RESTART_WORDS + 1) * VGC_GAP_RESTART_CODES - 1;
        const unsigned long long v =
            e % VGC_GAP_RESTART_WORDS < 2
                ? (unsigned long long)((long long)ends[last] - s0)
                : (unsigned long long)(cw[last] & VGC_INDEX_MASK);
        return (unsigned int)(e % 2 ? v >> 32 : v);
    }
    if (b < VGC_GAP_PARAM_WORDS + T + G) { /* codes over bits [a, a + 32) */
        const long long a = s0 + 32 * (b - VGC_GAP_PARAM_WORDS - T);
        long long j = r0, last = r0 + count; /* first code ending past a */
        while (j < last) {
            const long long mid = j + (last - j) / 2;
            if ((long long)ends[mid] > a)
                last = mid;
            else
                j = mid + 1;
        }
        unsigned int word = 0;
        for (; j < r0 + count; ++j) {
            const long long end = (long long)ends[j];
            const long long start = j ? (long long)ends[j - 1] : 0LL;
            if (start >= a + 32) break;
            const long long ix = (long long)(cw[j] & VGC_INDEX_MASK);
            const long long prev =
                j > r0 ? (long long)(cw[j - 1] & VGC_INDEX_MASK) : -1LL;
            const unsigned long long gap = (unsigned long long)(ix - prev - 1);
            const long long from = start > a ? start : a;
            const long long to = end < a + 32 ? end : a + 32;
            for (long long p = from; p < to; ++p)
                word |= vgc_code_bit(gap, k, p - start) << (p - a);
        }
        return word;
    }
    const long long vw = b - VGC_GAP_PARAM_WORDS - T - G;
    const int per = sign_only ? 32 : 8, bits = sign_only ? 1 : 4;
    unsigned int word = 0;
    for (int jj = 0; jj < per && vw * per + jj < count; ++jj) {
        const unsigned int nib = (unsigned int)cw[r0 + vw * per + jj] >> 28;
        const unsigned int field = sign_only ? (nib >> 3) & 1u : nib & 15u;
        word |= field << (jj * bits);
    }
    return word;
}

template <typename R, typename W, typename P, typename O, typename E>
VGC_FN void vgc_model_gap_assemble(long long w, const R &rec, int n,
                                   const W &cw, const P &pos,
                                   const O &offsets, const E &ends,
                                   unsigned int scale, bool sign_only,
                                   unsigned int &word) {
    if (w < 2) {
        word = w ? (unsigned int)rec[6 * n + 1] : VGC_MAGIC;
        return;
    }
    if (w >= (long long)rec[6 * n]) return;
    word = vgc_model_gap_word(w, rec, n, cw, pos, offsets, ends, scale,
                              sign_only);
}

#endif /* CHAINER_VGC_NUMERICS_CUH */
