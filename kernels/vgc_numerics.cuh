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
VGC_FN float vgc_ldexp(float x, int e) { return ldexpf(x, e); }
VGC_FN double vgc_ldexp(double x, int e) { return ldexp(x, e); }
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
VGC_FN float vgc_ldexp(float x, int e) { return ldexpf(x, e); }
VGC_FN double vgc_ldexp(double x, int e) { return ldexp(x, e); }
#endif

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

/* log2 of a value the quantizer treats as zero (0 and subnormals). */
#define VGC_LOG2_ZERO (-(1 << 30))
/* Word layout (Sec. 4.2): sign bit | 3-bit d | 28-bit index. */
#define VGC_INDEX_BITS 28
#define VGC_INDEX_MASK 0x0FFFFFFFu
#define VGC_MAX_D 7

/* ---- Fig. "Basic": accumulate, criterion (eq. 4), decay ---------------- */

/* r += sum_z grad_z / B  and  v += sum_z (grad_z / B)^2 */
template <typename F> VGC_FN F vgc_accumulate(F acc, F x) { return acc + x; }

/* eq. (4): (sum_z g_z/B)^2 > alpha * sum_z (g_z/B)^2 */
template <typename F> VGC_FN bool vgc_criterion(F r, F v, F alpha) {
    return r * r > alpha * v;
}

/* v *= zeta for elements that were not sent (Sec. 4.1, 4.4). */
template <typename F> VGC_FN F vgc_decay(F v, F zeta) { return v * zeta; }

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
    F mag = r < (F)0 ? -r : r;
    /* written without branches (selects only), so that the host compiler
     * vectorizes it; the values are those of the if/else form */
    bool sel = (mag > tau) & vgc_criterion(r, v, alpha);
    int sent = sel ? (r > (F)0 ? 1 : -1) : 0;
    F reduced = r > (F)0 ? r - tau : r + tau;
    F corrected = v - (F)2 * mag * tau + tau * tau;
    r = sel ? reduced : r;
    v = sel ? (corrected > (F)0 ? corrected : (F)0) : v;
    v = vgc_decay(v, zeta);
    return sent;
}

/* ---- Strom (2015): threshold tau, send +-tau, keep the residual --------- */
template <typename F> VGC_FN int vgc_strom_step(F g, F tau, F &r) {
    r = vgc_accumulate(r, g);
    bool up = r > tau, down = r < -tau;
    r = up ? r - tau : (down ? r + tau : r);
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
    return (word >> 31) ? -mag : mag;
}

#endif /* CHAINER_VGC_NUMERICS_CUH */
