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

#endif /* CHAINER_VGC_NUMERICS_CUH */
