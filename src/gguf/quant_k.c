/* ggml's quantizers: Q8_0 (quant.c) and the 256-element "K" formats Q4_K,
 * Q5_K and Q6_K, written from llama.cpp's reference quantizers (the
 * quantize_row_*_ref of ggml-quants.c, the ones llama-quantize runs without an
 * importance matrix), step for step and in the same float operations, so that
 * the blocks come out as llama-quantize writes them: the same scale search,
 * the same round-half-to-even (nearest_int), the same order of sums. A
 * reordered sum or a fused multiply-add would flip the odd tie; the block
 * layouts are those quant.c reads (see its header comment).
 *
 * Q4_K / Q5_K: per sub-block of 32 a scale and a min fitted by a weighted
 * least-squares search over candidate scales (make_qkx2), then the 8 scales
 * and 8 mins quantized to 6 bits against the block's largest (d, dmin in
 * fp16), then every value re-rounded against its quantized scale and min.
 * Q6_K: per sub-block of 16 a signed scale from a search around amax / 32
 * weighted by x^2 (make_qx), the 16 scales to int8 against the largest, the
 * values re-rounded. */
#include "gguf/gguf.h"

#include <math.h>
#include <string.h>

#define QK 256
#define MAX_EPS 1e-15f /* llama.cpp's GROUP_MAX_EPS: below it a group is all zero */

/* Round to nearest, halves to even, by the float trick llama.cpp uses (valid
 * for |x| < 2^22; the callers' values are bounded by the scale search). */
static inline int nearest_int(float x) {
    float v = x + 12582912.f; /* 1.5 * 2^23: the integer lands in the mantissa */
    int32_t i;
    memcpy(&i, &v, sizeof i);
    return (i & 0x007fffff) - 0x00400000;
}

static inline int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

static void put_f16(uint8_t *p, float x) {
    uint16_t h = kvs_f32_to_f16(x);
    p[0] = (uint8_t)h;
    p[1] = (uint8_t)(h >> 8);
}

static float get_f16(const uint8_t *p) { return kvs_f16_to_f32((uint16_t)(p[0] | p[1] << 8)); }

/* A sub-block's levels L[i] in [0, nmax] and scale s, min m (x ~ s * L - m,
 * m >= 0 returned in *neg_min): start from the range's own scale, then try
 * nstep + 1 candidate scales (nmax + rmin + rdelta * k) / range, for each fit
 * scale and min by weighted least squares to the rounded levels, keep the one
 * with the least weighted squared error (ties keep the earlier). */
static float fit_scale_min(int n, int nmax, const float *x, const float *w, uint8_t *L, float *neg_min, float rmin,
                           float rdelta, int nstep) {
    uint8_t aux[32];
    float lo = x[0], hi = x[0], sum_w = w[0], sum_x = sum_w * x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < lo) lo = x[i];
        if (x[i] > hi) hi = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (lo > 0) lo = 0; /* the min is never positive: zero stays representable */
    if (hi == lo) {
        memset(L, 0, (size_t)n);
        *neg_min = -lo;
        return 0.f;
    }
    float iscale = (float)nmax / (hi - lo), scale = 1 / iscale, best = 0;
    for (int i = 0; i < n; i++) {
        L[i] = (uint8_t)clampi(nearest_int(iscale * (x[i] - lo)), 0, nmax);
        float diff = scale * L[i] + lo - x[i];
        best += w[i] * (diff * diff);
    }
    for (int k = 0; k <= nstep; k++) {
        iscale = (rmin + rdelta * (float)k + (float)nmax) / (hi - lo);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; i++) {
            int l = clampi(nearest_int(iscale * (x[i] - lo)), 0, nmax);
            aux[i] = (uint8_t)l;
            sum_l += w[i] * (float)l;
            sum_l2 += w[i] * (float)l * (float)l;
            sum_xl += w[i] * (float)l * x[i];
        }
        float det = sum_w * sum_l2 - sum_l * sum_l;
        if (!(det > 0)) continue;
        float s = (sum_w * sum_xl - sum_x * sum_l) / det, m = (sum_l2 * sum_x - sum_l * sum_xl) / det;
        if (m > 0) {
            m = 0;
            s = sum_xl / sum_l2;
        }
        float err = 0;
        for (int i = 0; i < n; i++) {
            float diff = s * aux[i] + m - x[i];
            err += w[i] * (diff * diff);
        }
        if (err < best) {
            memcpy(L, aux, (size_t)n);
            best = err;
            scale = s;
            lo = m;
        }
    }
    *neg_min = -lo;
    return scale;
}

/* The 8 six-bit scales and mins of Q4_K / Q5_K into their 12 bytes (the
 * inverse of quant.c's scale_min_k4). */
static void pack_scale_min_k4(const int *ls, const int *lm, uint8_t *q) {
    memset(q, 0, 12);
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            q[j] = (uint8_t)ls[j];
            q[j + 4] = (uint8_t)lm[j];
        } else {
            q[j + 4] = (uint8_t)((ls[j] & 0xF) | (lm[j] & 0xF) << 4);
            q[j - 4] |= (uint8_t)((ls[j] >> 4) << 6);
            q[j] |= (uint8_t)((lm[j] >> 4) << 6);
        }
    }
}

static void unpack_scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | (q[j - 4] >> 6) << 4;
        *m = (q[j + 4] >> 4) | (q[j] >> 6) << 4;
    }
}

/* One Q4_K (nmax 15) or Q5_K (nmax 31) block of 256 values at x into b. */
static void quantize_q45_k_block(const float *x, uint8_t *b, bool five) {
    const int nmax = five ? 31 : 15;
    uint8_t L[QK];
    float scales[8], mins[8], w[32], max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; j++) {
        const float *xs = x + 32 * j;
        float sum_x2 = 0;
        for (int l = 0; l < 32; l++) sum_x2 += xs[l] * xs[l];
        float av_x = sqrtf(sum_x2 / 32); /* weights: the values' rms plus each one's size */
        for (int l = 0; l < 32; l++) w[l] = av_x + fabsf(xs[l]);
        scales[j] = five ? fit_scale_min(32, nmax, xs, w, L + 32 * j, &mins[j], -0.5f, 0.1f, 15)
                         : fit_scale_min(32, nmax, xs, w, L + 32 * j, &mins[j], -1.f, 0.1f, 20);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f, inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    int ls[8], lm[8];
    for (int j = 0; j < 8; j++) {
        /* llama.cpp stores nearest_int in a uint8_t before the MIN */
        ls[j] = (uint8_t)nearest_int(inv_scale * scales[j]);
        lm[j] = (uint8_t)nearest_int(inv_min * mins[j]);
        if (ls[j] > 63) ls[j] = 63;
        if (lm[j] > 63) lm[j] = 63;
    }
    uint8_t *scales_q = b + 4;
    pack_scale_min_k4(ls, lm, scales_q);
    put_f16(b, max_scale / 63.f);
    put_f16(b + 2, max_min / 63.f);
    float d_all = get_f16(b), dmin_all = get_f16(b + 2);
    for (int j = 0; j < 8; j++) {
        int sc, m;
        unpack_scale_min_k4(j, scales_q, &sc, &m);
        float d = d_all * (float)sc;
        if (d == 0) continue; /* keeps the fit's levels, as the reference does */
        float dm = dmin_all * (float)m;
        for (int i = 0; i < 32; i++) L[32 * j + i] = (uint8_t)clampi(nearest_int((x[32 * j + i] + dm) / d), 0, nmax);
    }
    uint8_t *qh = five ? b + 16 : NULL, *qs = b + (five ? 48 : 16);
    if (five) memset(qh, 0, 32);
    for (int c = 0; c < 4; c++, qs += 32) { /* chunk c of 64: low nibbles, then high */
        for (int l = 0; l < 32; l++) {
            int lo = L[64 * c + l], hi = L[64 * c + 32 + l];
            if (five) {
                qh[l] |= (uint8_t)((lo >> 4) << (2 * c) | (hi >> 4) << (2 * c + 1));
                lo &= 0xF;
                hi &= 0xF;
            }
            qs[l] = (uint8_t)(lo | hi << 4);
        }
    }
}

/* A group's signed levels L[i] + nmax in [0, 2 nmax) and its scale (x ~ s *
 * (L - nmax)): from -nmax / (the value of largest magnitude), then 18 nearby
 * candidates (nmax + 0.1 k, k = -9..9), keeping the best by x^2-weighted
 * least squares. */
static float fit_signed_scale(int n, int nmax, const float *x, int8_t *L) {
    float max = 0, amax = 0;
    for (int i = 0; i < n; i++) {
        float ax = fabsf(x[i]);
        if (ax > amax) {
            amax = ax;
            max = x[i];
        }
    }
    if (amax < MAX_EPS) {
        memset(L, 0, (size_t)n);
        return 0.f;
    }
    float iscale = -(float)nmax / max, sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        int l = clampi(nearest_int(iscale * x[i]), -nmax, nmax - 1);
        L[i] = (int8_t)(l + nmax);
        float w = x[i] * x[i];
        sumlx += w * x[i] * (float)l;
        suml2 += w * (float)l * (float)l;
    }
    float scale = suml2 != 0 ? sumlx / suml2 : 0.0f, best = scale * sumlx;
    for (int k = -9; k <= 9; k++) {
        if (k == 0) continue;
        iscale = -((float)nmax + 0.1f * (float)k) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; i++) {
            int l = clampi(nearest_int(iscale * x[i]), -nmax, nmax - 1);
            float w = x[i] * x[i];
            sumlx += w * x[i] * (float)l;
            suml2 += w * (float)l * (float)l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; i++) L[i] = (int8_t)(nmax + clampi(nearest_int(iscale * x[i]), -nmax, nmax - 1));
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

/* One Q6_K block {ql[128], qh[64], int8 scales[16], f16 d}. */
static void quantize_q6_k_block(const float *x, uint8_t *b) {
    int8_t L[QK];
    float scales[16], max_scale = 0, max_abs = 0;
    for (int g = 0; g < 16; g++) {
        scales[g] = fit_signed_scale(16, 32, x + 16 * g, L + 16 * g);
        if (fabsf(scales[g]) > max_abs) {
            max_abs = fabsf(scales[g]);
            max_scale = scales[g];
        }
    }
    memset(b, 0, 210);
    if (max_abs < MAX_EPS) return; /* all zero, d = 0 */
    int8_t *sc = (int8_t *)(b + 192);
    float iscale = -128.f / max_scale;
    put_f16(b + 208, 1 / iscale);
    for (int g = 0; g < 16; g++) {
        int s = nearest_int(iscale * scales[g]);
        sc[g] = (int8_t)(s < 127 ? s : 127);
    }
    float d_all = get_f16(b + 208);
    for (int g = 0; g < 16; g++) {
        float d = d_all * (float)sc[g];
        if (d == 0) continue;
        for (int i = 0; i < 16; i++) L[16 * g + i] = (int8_t)(clampi(nearest_int(x[16 * g + i] / d), -32, 31) + 32);
    }
    uint8_t *ql = b, *qh = b + 128;
    for (int h = 0; h < 2; h++, ql += 64, qh += 32) { /* two halves of 128 */
        const int8_t *Lh = L + 128 * h;
        for (int l = 0; l < 32; l++) {
            int q1 = Lh[l], q2 = Lh[l + 32], q3 = Lh[l + 64], q4 = Lh[l + 96];
            ql[l] = (uint8_t)((q1 & 0xF) | (q3 & 0xF) << 4);
            ql[l + 32] = (uint8_t)((q2 & 0xF) | (q4 & 0xF) << 4);
            qh[l] = (uint8_t)((q1 >> 4) | (q2 >> 4) << 2 | (q3 >> 4) << 4 | (q4 >> 4) << 6);
        }
    }
}

/* Q5_0 {f16 d; u8 qh[4]; qs[16]}, what llama.cpp's Q4_K falls back to for
 * rows that are not whole blocks of 256: d = (the value of largest
 * magnitude) / -16, q = trunc(x / d + 16.5) capped at 31 (llama.cpp's
 * quantize_row_q5_0_ref, its rounding kept). */
static void quantize_q5_0_block(const float *x, uint8_t *b) {
    float amax = 0, max = 0;
    for (int j = 0; j < 32; j++)
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    float d = max / -16, id = d != 0 ? 1.0f / d : 0.0f;
    put_f16(b, d);
    uint32_t qh = 0;
    for (int j = 0; j < 16; j++) {
        int8_t t0 = (int8_t)(x[j] * id + 16.5f), t1 = (int8_t)(x[j + 16] * id + 16.5f);
        uint8_t q0 = (uint8_t)(t0 < 31 ? t0 : 31), q1 = (uint8_t)(t1 < 31 ? t1 : 31);
        b[6 + j] = (uint8_t)((q0 & 0xF) | (q1 & 0xF) << 4);
        qh |= (uint32_t)(q0 >> 4) << j | (uint32_t)(q1 >> 4) << (j + 16);
    }
    for (int k = 0; k < 4; k++) b[2 + k] = (uint8_t)(qh >> (8 * k));
}

bool kvs_ggml_can_quantize(uint32_t type) {
    return type == KVS_GGML_Q8_0 || type == KVS_GGML_Q5_0 || type == KVS_GGML_Q4_K || type == KVS_GGML_Q5_K || type == KVS_GGML_Q6_K;
}

kvs_status kvs_ggml_quantize(uint32_t type, const float *src, void *dst, int64_t n) {
    kvs_ggml_layout lay;
    if (!kvs_ggml_type_layout(type, &lay)) return kvs_fail(KVS_ERR_UNSUPPORTED, "ggml type id %u is unknown", type);
    if (!kvs_ggml_can_quantize(type))
        return kvs_fail(KVS_ERR_UNSUPPORTED, "quantizing to ggml type %s is unsupported (supported: Q8_0, Q5_0, "
                        "Q4_K, Q5_K, Q6_K)", lay.name);
    if (n < 0 || n % lay.block)
        return kvs_fail(KVS_ERR_INVALID, "%lld elements are not whole %s blocks of %d", (long long)n, lay.name,
                        lay.block);
    if (type == KVS_GGML_Q8_0) {
        kvs_ggml_quantize_q8_0(src, dst, n);
        return KVS_OK;
    }
    uint8_t *b = dst;
    if (type == KVS_GGML_Q5_0) {
        for (int64_t i = 0; i < n / 32; i++, src += 32, b += lay.block_bytes) quantize_q5_0_block(src, b);
        return KVS_OK;
    }
    for (int64_t i = 0; i < n / QK; i++, src += QK, b += lay.block_bytes) {
        if (type == KVS_GGML_Q6_K) quantize_q6_k_block(src, b);
        else quantize_q45_k_block(src, b, type == KVS_GGML_Q5_K);
    }
    return KVS_OK;
}
