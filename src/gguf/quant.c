/* ggml's weight formats, written from their block layouts: plain scalar
 * reference code (one block at a time, in the order the format defines its
 * values), the oracle later kernels are checked against.
 *
 * A row of n elements is n / block blocks. The 32-element formats:
 *   Q4_0 {f16 d; u8 qs[16]}          x = d * (nibble - 8)
 *   Q4_1 {f16 d, m; u8 qs[16]}       x = d * nibble + m
 *   Q5_0 {f16 d; u8 qh[4]; qs[16]}   x = d * (nibble | high bit << 4) - 16 * d
 *   Q5_1 {f16 d, m; u8 qh[4]; qs[16]} x = d * (nibble | high bit << 4) + m
 *   Q8_0 {f16 d; i8 qs[32]}          x = d * q
 * (element j < 16 is the low nibble of qs[j], element j + 16 its high nibble;
 * Q5's fifth bit of element j is bit j of qh, read as a little-endian u32).
 * The 256-element "K" formats hold 8 or 16 sub-blocks with their own scales:
 *   Q4_K {f16 d, dmin; u8 scales[12]; u8 qs[128]}          x = d*sc*nibble - dmin*m
 *   Q5_K {f16 d, dmin; u8 scales[12]; u8 qh[32]; qs[128]}  the same with a fifth bit
 *   Q6_K {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}      x = d * sc * (6-bit q - 32)
 * Q4_K / Q5_K pack 8 six-bit scales and 8 six-bit mins into 12 bytes
 * (scale_min_k4); their 64-element chunks take the low nibbles for the first
 * 32 elements and the high nibbles for the next 32. */
#include "gguf/gguf.h"

#include <math.h>
#include <string.h>

static const kvs_ggml_layout layouts[] = {
    [0] = {"F32", 1, 4},       [1] = {"F16", 1, 2},       [2] = {"Q4_0", 32, 18},     [3] = {"Q4_1", 32, 20},
    [6] = {"Q5_0", 32, 22},    [7] = {"Q5_1", 32, 24},    [8] = {"Q8_0", 32, 34},     [9] = {"Q8_1", 32, 36},
    [10] = {"Q2_K", 256, 84},  [11] = {"Q3_K", 256, 110}, [12] = {"Q4_K", 256, 144},  [13] = {"Q5_K", 256, 176},
    [14] = {"Q6_K", 256, 210}, [15] = {"Q8_K", 256, 292}, [16] = {"IQ2_XXS", 256, 66}, [17] = {"IQ2_XS", 256, 74},
    [18] = {"IQ3_XXS", 256, 98}, [19] = {"IQ1_S", 256, 50}, [20] = {"IQ4_NL", 32, 18}, [21] = {"IQ3_S", 256, 110},
    [22] = {"IQ2_S", 256, 82}, [23] = {"IQ4_XS", 256, 136}, [24] = {"I8", 1, 1},       [25] = {"I16", 1, 2},
    [26] = {"I32", 1, 4},      [27] = {"I64", 1, 8},      [28] = {"F64", 1, 8},       [29] = {"IQ1_M", 256, 56},
    [30] = {"BF16", 1, 2},     [34] = {"TQ1_0", 256, 54}, [35] = {"TQ2_0", 256, 66},  [39] = {"MXFP4", 32, 17},
};

bool kvs_ggml_type_layout(uint32_t id, kvs_ggml_layout *out) {
    if (id >= sizeof layouts / sizeof layouts[0] || !layouts[id].name) return false;
    *out = layouts[id];
    return true;
}

static uint16_t u16_at(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

/* A block's fp16 field at p as f32; false when it is inf or NaN. */
static bool f16_at(const uint8_t *p, float *out) {
    *out = kvs_f16_to_f32(u16_at(p));
    return isfinite(*out);
}

static kvs_status bad_scale(const char *what, const char *type, int64_t block, const char *field) {
    return kvs_fail(KVS_ERR_FORMAT, "%s: %s block %lld has a non-finite fp16 %s", what ? what : "tensor", type,
                    (long long)block, field);
}

/* ---- 32-element blocks --------------------------------------------------------- */
static bool q4_0(const uint8_t *b, float *y) {
    float d;
    if (!f16_at(b, &d)) return false;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((b[2 + j] & 0xF) - 8);
        y[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
    }
    return true;
}

static bool q4_1(const uint8_t *b, float *y) {
    float d, m;
    if (!f16_at(b, &d) || !f16_at(b + 2, &m)) return false;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)(b[4 + j] & 0xF) + m;
        y[j + 16] = d * (float)(b[4 + j] >> 4) + m;
    }
    return true;
}

/* Q5_0 (has_min false: values centred by -16) and Q5_1 (a min m). */
static bool q5(const uint8_t *b, float *y, bool has_min) {
    float d, m = 0;
    if (!f16_at(b, &d) || (has_min && !f16_at(b + 2, &m))) return false;
    const uint8_t *qh_p = b + (has_min ? 4 : 2), *qs = qh_p + 4;
    uint32_t qh = (uint32_t)qh_p[0] | (uint32_t)qh_p[1] << 8 | (uint32_t)qh_p[2] << 16 | (uint32_t)qh_p[3] << 24;
    int centre = has_min ? 0 : 16;
    for (int j = 0; j < 16; j++) {
        int lo = (qs[j] & 0xF) | (int)((qh >> j) & 1) << 4;
        int hi = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
        y[j] = d * (float)(lo - centre) + m;
        y[j + 16] = d * (float)(hi - centre) + m;
    }
    return true;
}

static bool q8_0(const uint8_t *b, float *y) {
    float d;
    if (!f16_at(b, &d)) return false;
    for (int j = 0; j < 32; j++) y[j] = d * (float)(int8_t)b[2 + j];
    return true;
}

/* ---- 256-element K blocks ------------------------------------------------------- */
/* Sub-block j's 6-bit scale and min from the 12 packed bytes: j < 4 in the
 * low 6 bits of bytes j and j + 4; j >= 4 in byte j + 4's nibbles, with the
 * top 2 bits from the high bits of bytes j - 4 and j. */
static void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Q4_K (qh NULL) and Q5_K: four chunks of 64, each two sub-blocks of 32. */
static bool q45_k(const uint8_t *b, float *y, bool five) {
    float d, dmin;
    if (!f16_at(b, &d) || !f16_at(b + 2, &dmin)) return false;
    const uint8_t *scales = b + 4, *qh = five ? b + 16 : NULL, *qs = b + (five ? 48 : 16);
    for (int chunk = 0; chunk < 4; chunk++) {
        int sc1, m1, sc2, m2;
        scale_min_k4(2 * chunk, scales, &sc1, &m1);
        scale_min_k4(2 * chunk + 1, scales, &sc2, &m2);
        float d1 = d * (float)sc1, min1 = dmin * (float)m1, d2 = d * (float)sc2, min2 = dmin * (float)m2;
        int bit_lo = 2 * chunk, bit_hi = 2 * chunk + 1; /* Q5_K: the fifth bits of this chunk in qh */
        for (int l = 0; l < 32; l++) {
            int lo = qs[l] & 0xF, hi = qs[l] >> 4;
            if (five) {
                lo |= ((qh[l] >> bit_lo) & 1) << 4;
                hi |= ((qh[l] >> bit_hi) & 1) << 4;
            }
            y[l] = d1 * (float)lo - min1;
            y[l + 32] = d2 * (float)hi - min2;
        }
        y += 64;
        qs += 32;
    }
    return true;
}

/* Q6_K: two halves of 128; in a half, element l + 32k (l < 32, k < 4) takes
 * the low (k < 2) or high (k >= 2) nibble of ql[l + 32 (k % 2)], bits 2k and
 * 2k + 1 of qh[l] above it, and the scale sc[l / 16 + 2k]. */
static bool q6_k(const uint8_t *b, float *y) {
    float d;
    if (!f16_at(b + 208, &d)) return false;
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    for (int half = 0; half < 2; half++) {
        for (int l = 0; l < 32; l++) {
            int is = l / 16;
            int q1 = ((ql[l] & 0xF) | ((qh[l] >> 0) & 3) << 4) - 32;
            int q2 = ((ql[l + 32] & 0xF) | ((qh[l] >> 2) & 3) << 4) - 32;
            int q3 = ((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32;
            int q4 = ((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32;
            y[l] = d * (float)sc[is] * (float)q1;
            y[l + 32] = d * (float)sc[is + 2] * (float)q2;
            y[l + 64] = d * (float)sc[is + 4] * (float)q3;
            y[l + 96] = d * (float)sc[is + 6] * (float)q4;
        }
        y += 128;
        ql += 64;
        qh += 32;
        sc += 8;
    }
    return true;
}

bool kvs_ggml_can_dequantize(uint32_t type) {
    switch (type) {
    case KVS_GGML_F32: case KVS_GGML_F16: case KVS_GGML_BF16: case KVS_GGML_Q4_0: case KVS_GGML_Q4_1:
    case KVS_GGML_Q5_0: case KVS_GGML_Q5_1: case KVS_GGML_Q8_0: case KVS_GGML_Q4_K: case KVS_GGML_Q5_K:
    case KVS_GGML_Q6_K: return true;
    default: return false;
    }
}

kvs_status kvs_ggml_dequantize(uint32_t type, const void *src, float *dst, int64_t n, const char *what) {
    kvs_ggml_layout lay;
    if (!kvs_ggml_type_layout(type, &lay))
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: ggml type id %u is unknown", what ? what : "tensor", type);
    if (!kvs_ggml_can_dequantize(type))
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: ggml type %s is unsupported (supported: F32, F16, BF16, Q4_0, Q4_1, "
                        "Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)", what ? what : "tensor", lay.name);
    if (n < 0 || n % lay.block)
        return kvs_fail(KVS_ERR_INVALID, "%s: %lld elements are not whole %s blocks of %d", what ? what : "tensor",
                        (long long)n, lay.name, lay.block);
    if (type == KVS_GGML_F32 || type == KVS_GGML_F16 || type == KVS_GGML_BF16) {
        kvs_to_f32(dst, src, type == KVS_GGML_F32 ? KVS_F32 : type == KVS_GGML_F16 ? KVS_F16 : KVS_BF16, (size_t)n);
        return KVS_OK;
    }
    const uint8_t *b = src;
    for (int64_t i = 0; i < n / lay.block; i++, b += lay.block_bytes, dst += lay.block) {
        bool ok;
        switch (type) {
        case KVS_GGML_Q4_0: ok = q4_0(b, dst); break;
        case KVS_GGML_Q4_1: ok = q4_1(b, dst); break;
        case KVS_GGML_Q5_0: ok = q5(b, dst, false); break;
        case KVS_GGML_Q5_1: ok = q5(b, dst, true); break;
        case KVS_GGML_Q8_0: ok = q8_0(b, dst); break;
        case KVS_GGML_Q4_K: ok = q45_k(b, dst, false); break;
        case KVS_GGML_Q5_K: ok = q45_k(b, dst, true); break;
        default: ok = q6_k(b, dst); break;
        }
        if (!ok) return bad_scale(what, lay.name, i, "scale");
    }
    return KVS_OK;
}

/* ---- the Q8_0 quantizer ---------------------------------------------------------- */
void kvs_ggml_quantize_q8_0(const float *x, void *dst, int64_t n) {
    uint8_t *b = dst;
    for (int64_t i = 0; i < n / 32; i++, x += 32, b += 34) {
        float amax = 0;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
        float d = amax / 127.0f, inv = d != 0 ? 1.0f / d : 0.0f; /* x * (1/d), as the reference rounds */
        uint16_t h = kvs_f32_to_f16(d);
        b[0] = (uint8_t)h;
        b[1] = (uint8_t)(h >> 8);
        for (int j = 0; j < 32; j++) b[2 + j] = (uint8_t)(int8_t)roundf(x[j] * inv);
    }
}
