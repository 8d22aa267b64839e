/* The kernels of backend/cpu/cpu_simd.h, written once over a vector type.
 * The includer defines:
 *   V, VL              the vector type and its width in floats
 *   v_zero(), v_set1(f), v_load(p), v_store(p, v), v_fma(a, b, c) (a * b + c),
 *   v_hsum(v)          the sum of the lanes
 *   v_load_bf16(p), v_load_f16(p)   VL weights of those dtypes, widened to f32
 *   v_floor(t), v_pow2(n), v_select_lt(x, c, a, b)   for v_exp (below)
 *   KERNELS_NAME, KERNELS_VAR       the set's name and the variable to define
 * Every row is computed by the same sequence of operations wherever it falls
 * (block position, thread, batch size), so results do not depend on the split. */
#include <string.h>

#include "backend/cpu/cpu_simd.h"

#define ALWAYS_INLINE static inline __attribute__((always_inline))
/* Loops over a compile-time head count, unrolled whole so that their arrays of
 * accumulators stay in registers (-O2 alone leaves them on the stack). */
#define UNROLL _Pragma("GCC unroll 8")

enum { KTILE = 1024 }; /* a multiple of 4 * VL for every VL */

ALWAYS_INLINE V load_w(const void *w, size_t i, kvs_dtype wt) {
    if (wt == KVS_BF16) return v_load_bf16((const uint16_t *)w + i);
    if (wt == KVS_F16) return v_load_f16((const uint16_t *)w + i);
    return v_load((const float *)w + i);
}

ALWAYS_INLINE float w_at(const void *w, size_t i, kvs_dtype wt) {
    if (wt == KVS_BF16) return kvs_bf16_to_f32(((const uint16_t *)w)[i]);
    if (wt == KVS_F16) return kvs_f16_to_f32(((const uint16_t *)w)[i]);
    return ((const float *)w)[i];
}

/* One input's share of a weight row's tile [t0, t1): four accumulators over
 * 4 * VL, then VL at a time, then scalars. The paired form below does the same
 * operations in the same order for each of its inputs, so a row's result does
 * not depend on how the inputs were grouped. */
ALWAYS_INLINE float tile_1(const float *xi, const void *w, size_t row, int t0, int e4, int e1, int t1, kvs_dtype wt) {
    V a0 = v_zero(), a1 = v_zero(), a2 = v_zero(), a3 = v_zero();
    int k = t0;
    for (; k < e4; k += 4 * VL) {
        a0 = v_fma(load_w(w, row + k, wt), v_load(xi + k), a0);
        a1 = v_fma(load_w(w, row + k + VL, wt), v_load(xi + k + VL), a1);
        a2 = v_fma(load_w(w, row + k + 2 * VL, wt), v_load(xi + k + 2 * VL), a2);
        a3 = v_fma(load_w(w, row + k + 3 * VL, wt), v_load(xi + k + 3 * VL), a3);
    }
    for (; k < e1; k += VL) a0 = v_fma(load_w(w, row + k, wt), v_load(xi + k), a0);
    float t = v_hsum(a0 + a1 + (a2 + a3));
    for (; k < t1; k++) t += w_at(w, row + k, wt) * xi[k];
    return t;
}

/* Two inputs over one load (and widening) of the weights. */
ALWAYS_INLINE void tile_2(float *t, const float *xa, const float *xb, const void *w, size_t row, int t0, int e4, int e1,
                          int t1, kvs_dtype wt) {
    V a0 = v_zero(), a1 = v_zero(), a2 = v_zero(), a3 = v_zero();
    V b0 = v_zero(), b1 = v_zero(), b2 = v_zero(), b3 = v_zero();
    int k = t0;
    for (; k < e4; k += 4 * VL) {
        V w0 = load_w(w, row + k, wt), w1 = load_w(w, row + k + VL, wt);
        V w2 = load_w(w, row + k + 2 * VL, wt), w3 = load_w(w, row + k + 3 * VL, wt);
        a0 = v_fma(w0, v_load(xa + k), a0), b0 = v_fma(w0, v_load(xb + k), b0);
        a1 = v_fma(w1, v_load(xa + k + VL), a1), b1 = v_fma(w1, v_load(xb + k + VL), b1);
        a2 = v_fma(w2, v_load(xa + k + 2 * VL), a2), b2 = v_fma(w2, v_load(xb + k + 2 * VL), b2);
        a3 = v_fma(w3, v_load(xa + k + 3 * VL), a3), b3 = v_fma(w3, v_load(xb + k + 3 * VL), b3);
    }
    for (; k < e1; k += VL) {
        V w0 = load_w(w, row + k, wt);
        a0 = v_fma(w0, v_load(xa + k), a0), b0 = v_fma(w0, v_load(xb + k), b0);
    }
    float ta = v_hsum(a0 + a1 + (a2 + a3)), tb = v_hsum(b0 + b1 + (b2 + b3));
    for (; k < t1; k++) {
        float wk = w_at(w, row + k, wt);
        ta += wk * xa[k], tb += wk * xb[k];
    }
    t[0] = ta, t[1] = tb;
}

/* One weight row at a time, one stream the prefetcher follows (measured
 * faster here than four interleaved rows); the k range in tiles of KTILE so
 * that the row's tile stays in L1 while the n inputs go over it, two at a time. */
ALWAYS_INLINE void gemv_t(float *out, int ld_out, const float *x, const void *w, const float *bias, int n, int in_dim,
                          int j0, int j1, kvs_dtype wt) {
    int k4 = in_dim / (4 * VL) * (4 * VL), k1 = in_dim / VL * VL;
    for (int j = j0; j < j1; j++) {
        size_t row = (size_t)j * in_dim;
        float sum[KVS_CPU_GEMV_MAX_N] = {0};
        for (int t0 = 0; t0 < in_dim; t0 += KTILE) {
            int t1 = t0 + KTILE < in_dim ? t0 + KTILE : in_dim, e4 = t1 < k4 ? t1 : k4, e1 = t1 < k1 ? t1 : k1;
            int i = 0;
            for (; i + 2 <= n; i += 2) {
                float t[2];
                tile_2(t, x + (size_t)i * in_dim, x + (size_t)(i + 1) * in_dim, w, row, t0, e4, e1, t1, wt);
                sum[i] += t[0], sum[i + 1] += t[1];
            }
            if (i < n) sum[i] += tile_1(x + (size_t)i * in_dim, w, row, t0, e4, e1, t1, wt);
        }
        for (int i = 0; i < n; i++) out[(size_t)i * ld_out + j] = sum[i] + (bias ? bias[j] : 0.0f);
    }
}

static void gemv(float *out, int ld_out, const float *x, const void *w, kvs_dtype wt, const float *bias, int n,
                 int in_dim, int j0, int j1) {
    if (n > KVS_CPU_GEMV_MAX_N) n = KVS_CPU_GEMV_MAX_N; /* the caller's contract */
    if (wt == KVS_BF16) gemv_t(out, ld_out, x, w, bias, n, in_dim, j0, j1, KVS_BF16);
    else if (wt == KVS_F16) gemv_t(out, ld_out, x, w, bias, n, in_dim, j0, j1, KVS_F16);
    else gemv_t(out, ld_out, x, w, bias, n, in_dim, j0, j1, KVS_F32);
}

/* Up to QK_HEADS query heads a pass: one read of each key row serves them all. */
enum { QK_HEADS = 8 };

/* Rows e .. e + R - 1 of the keys against nh query heads: R * nh accumulators
 * (at most 8), so that the FMAs of different rows overlap instead of waiting on
 * one row's chain. Each (row, head) is the same sequence as with R = 1. */
ALWAYS_INLINE void qk_rows(float *s, int ld_s, const float *q, int ld_q, const void *k, int e, int d, int dv,
                           float scale, const int nh, const int R, const kvs_dtype kt) {
    V acc[8];
    UNROLL for (int i = 0; i < R * nh; i++) acc[i] = v_zero();
    for (int c = 0; c < dv; c += VL) {
        UNROLL for (int r = 0; r < R; r++) {
            V kv = load_w(k, (size_t)(e + r) * d + c, kt);
            UNROLL for (int h = 0; h < nh; h++) acc[r * nh + h] = v_fma(v_load(q + (size_t)h * ld_q + c), kv, acc[r * nh + h]);
        }
    }
    UNROLL for (int r = 0; r < R; r++)
        UNROLL for (int h = 0; h < nh; h++) {
            size_t ke = (size_t)(e + r) * d;
            float t = v_hsum(acc[r * nh + h]);
            for (int c = dv; c < d; c++) t += q[(size_t)h * ld_q + c] * w_at(k, ke + c, kt);
            s[(size_t)h * ld_s + e + r] = scale * t;
        }
}

ALWAYS_INLINE void qk_t(float *s, int ld_s, const float *q, int ld_q, const void *k, int cnt, int d, float scale,
                        const int nh, const kvs_dtype kt) {
    const int R = nh >= 8 ? 1 : 8 / nh;
    int dv = d / VL * VL, e = 0;
    for (; e + R <= cnt; e += R) qk_rows(s, ld_s, q, ld_q, k, e, d, dv, scale, nh, R, kt);
    for (; e < cnt; e++) qk_rows(s, ld_s, q, ld_q, k, e, d, dv, scale, nh, 1, kt);
}

/* Columns c0 .. c0 + C * VL - 1 of the nh output rows, kept in registers
 * (nh * C accumulators, at most 8) over the block's values key by key: each
 * output element gets the same FMAs in the same key order as with a load and
 * store of the output around each, without them. */
ALWAYS_INLINE void pv_cols(float *out, int ld_out, const float *p, int ld_p, const void *v, int cnt, int d, int c0,
                           const int nh, const int C, const kvs_dtype vt) {
    V acc[8];
    UNROLL for (int h = 0; h < nh; h++)
        UNROLL for (int j = 0; j < C; j++) acc[h * C + j] = v_load(out + (size_t)h * ld_out + c0 + j * VL);
    for (int e = 0; e < cnt; e++) {
        size_t ve = (size_t)e * d + c0;
        V pe[QK_HEADS];
        UNROLL for (int h = 0; h < nh; h++) pe[h] = v_set1(p[(size_t)h * ld_p + e]);
        UNROLL for (int j = 0; j < C; j++) {
            V vv = load_w(v, ve + j * VL, vt);
            UNROLL for (int h = 0; h < nh; h++) acc[h * C + j] = v_fma(pe[h], vv, acc[h * C + j]);
        }
    }
    UNROLL for (int h = 0; h < nh; h++)
        UNROLL for (int j = 0; j < C; j++) v_store(out + (size_t)h * ld_out + c0 + j * VL, acc[h * C + j]);
}

/* The block's values into the output rows, a register tile of columns at a
 * time; the columns past the last full vector in scalars. */
ALWAYS_INLINE void pv_t(float *out, int ld_out, const float *p, int ld_p, const void *v, int cnt, int d,
                        const int nh, const kvs_dtype vt) {
    const int C = nh >= 8 ? 1 : 8 / nh;
    int dv = d / VL * VL, c0 = 0;
    for (; c0 + C * VL <= dv; c0 += C * VL) pv_cols(out, ld_out, p, ld_p, v, cnt, d, c0, nh, C, vt);
    for (; c0 < dv; c0 += VL) pv_cols(out, ld_out, p, ld_p, v, cnt, d, c0, nh, 1, vt);
    for (int e = 0; e < cnt; e++)
        for (int c = dv; c < d; c++)
            for (int h = 0; h < nh; h++)
                out[(size_t)h * ld_out + c] += p[(size_t)h * ld_p + e] * w_at(v, (size_t)e * d + c, vt);
}

/* the head count as a constant, so that the accumulators stay in registers */
#define BY_HEADS(call)                                                                                             \
    switch (nh) {                                                                                                  \
    case 1: call(1); break;                                                                                        \
    case 2: call(2); break;                                                                                        \
    case 3: call(3); break;                                                                                        \
    case 4: call(4); break;                                                                                        \
    case 5: call(5); break;                                                                                        \
    case 6: call(6); break;                                                                                        \
    case 7: call(7); break;                                                                                        \
    default: call(8); break;                                                                                       \
    }

/* the heads as a constant, then the K/V dtype as one */
#define BY_DTYPE(call, N, t)                                                                                     \
    do {                                                                                                         \
        if (t == KVS_BF16) call(N, KVS_BF16);                                                                    \
        else if (t == KVS_F16) call(N, KVS_F16);                                                                 \
        else call(N, KVS_F32);                                                                                   \
    } while (0)

static void qk(float *s, int ld_s, const float *q, int ld_q, int g, const void *k, kvs_dtype kt, int cnt, int d,
               float scale) {
    for (int h0 = 0; h0 < g; h0 += QK_HEADS) {
        int nh = g - h0 < QK_HEADS ? g - h0 : QK_HEADS;
#define QK_T(N, T) qk_t(s + (size_t)h0 * ld_s, ld_s, q + (size_t)h0 * ld_q, ld_q, k, cnt, d, scale, N, T)
#define QK(N) BY_DTYPE(QK_T, N, kt)
        BY_HEADS(QK)
#undef QK
#undef QK_T
    }
}

static void pv(float *out, int ld_out, const float *p, int ld_p, int g, const void *v, kvs_dtype vt, int cnt, int d) {
    for (int h0 = 0; h0 < g; h0 += QK_HEADS) {
        int nh = g - h0 < QK_HEADS ? g - h0 : QK_HEADS;
#define PV_T(N, T) pv_t(out + (size_t)h0 * ld_out, ld_out, p + (size_t)h0 * ld_p, ld_p, v, cnt, d, N, T)
#define PV(N) BY_DTYPE(PV_T, N, vt)
        BY_HEADS(PV)
#undef PV
#undef PV_T
    }
}

static float sum(const float *x, size_t n) {
    V a0 = v_zero(), a1 = v_zero(), a2 = v_zero(), a3 = v_zero();
    for (size_t i = 0; i + 4 * VL <= n; i += 4 * VL) {
        a0 = a0 + v_load(x + i);
        a1 = a1 + v_load(x + i + VL);
        a2 = a2 + v_load(x + i + 2 * VL);
        a3 = a3 + v_load(x + i + 3 * VL);
    }
    return v_hsum(a0 + a1 + (a2 + a3));
}

/* exp over a vector (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6
 * polynomial for e^r, 2^n put into the exponent in two halves): within 2 ulp of
 * the exact value for x in [-87.33, 88.72]; 0 below (no subnormals: callers add
 * these to sums of at least 1, or divide by 1 + them), +inf above, NaN for NaN.
 * The includer supplies v_floor(t) (as floats), v_pow2(n) (2^n for integral n in
 * [-126, 127]) and v_select_lt(x, c, a, b) (x < c ? a : b per lane). */
ALWAYS_INLINE V v_exp(V x) {
    const float lo = -87.3365447504f, hi = 88.7228391117f;
    V xc = v_select_lt(x, v_set1(lo), v_set1(lo), v_select_lt(v_set1(hi), x, v_set1(hi), x));
    V n = v_floor(v_fma(xc, v_set1(1.44269504088896341f), v_set1(0.5f)));
    V r = v_fma(n, v_set1(-0.693359375f), xc);
    r = v_fma(n, v_set1(2.12194440e-4f), r);
    V y = v_set1(1.9875691500e-4f);
    y = v_fma(y, r, v_set1(1.3981999507e-3f));
    y = v_fma(y, r, v_set1(8.3334519073e-3f));
    y = v_fma(y, r, v_set1(4.1665795894e-2f));
    y = v_fma(y, r, v_set1(1.6666665459e-1f));
    y = v_fma(y, r, v_set1(5.0000001201e-1f));
    y = v_fma(y, r * r, r + v_set1(1.0f));
    V n1 = v_floor(n * v_set1(0.5f)); /* n in [-126, 128]: 2^n1 * 2^(n - n1), both normal */
    y = y * v_pow2(n1) * v_pow2(n - n1);
    y = v_select_lt(x, v_set1(lo), v_zero(), y);
    return v_select_lt(v_set1(hi), x, v_set1(__builtin_inff()), y);
}

/* n < VL elements of p through f as one vector padded with `pad`: the tail gets
 * exactly the vector code's arithmetic. */
#define TAIL_LOAD(buf, p, n, pad)                                                                                  \
    do {                                                                                                           \
        for (int i_ = 0; i_ < VL; i_++) (buf)[i_] = i_ < (n) ? (p)[i_] : (pad);                                     \
    } while (0)

static float exp_sum(float *s, int n, float m) {
    V vm = v_set1(m), a0 = v_zero(), a1 = v_zero();
    int e = 0;
    for (; e + 2 * VL <= n; e += 2 * VL) {
        V y0 = v_exp(v_load(s + e) - vm), y1 = v_exp(v_load(s + e + VL) - vm);
        v_store(s + e, y0), v_store(s + e + VL, y1);
        a0 = a0 + y0, a1 = a1 + y1;
    }
    for (; e + VL <= n; e += VL) {
        V y = v_exp(v_load(s + e) - vm);
        v_store(s + e, y);
        a0 = a0 + y;
    }
    if (e < n) {
        float buf[VL];
        TAIL_LOAD(buf, s + e, n - e, -__builtin_inff());
        V y = v_exp(v_load(buf) - vm);
        v_store(buf, y);
        memcpy(s + e, buf, sizeof(float) * (size_t)(n - e));
        a1 = a1 + y; /* the padding lanes are exp(-inf) = 0 */
    }
    return v_hsum(a0 + a1);
}

ALWAYS_INLINE V silu_mul_v(V g, V u) { return g / (v_set1(1.0f) + v_exp(v_zero() - g)) * u; }

static void silu_mul(float *out, const float *g, const float *u, int n) {
    int j = 0;
    for (; j + VL <= n; j += VL) v_store(out + j, silu_mul_v(v_load(g + j), v_load(u + j)));
    if (j < n) {
        float bg[VL], bu[VL];
        TAIL_LOAD(bg, g + j, n - j, 0.0f);
        TAIL_LOAD(bu, u + j, n - j, 0.0f);
        v_store(bg, silu_mul_v(v_load(bg), v_load(bu)));
        memcpy(out + j, bg, sizeof(float) * (size_t)(n - j));
    }
}

#include "backend/cpu/cpu_quant_impl.h"

#ifndef KERNELS_STATIC_STORAGE
#define KERNELS_STATIC_STORAGE
#endif
KERNELS_STATIC_STORAGE const kvs_cpu_kernels KERNELS_VAR = {KERNELS_NAME, gemv, gemv_q, qk, pv, sum, exp_sum, silu_mul};
