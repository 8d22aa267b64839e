#include "core/core.h"

#include <math.h>
#include <string.h>

size_t kvs_dtype_size(kvs_dtype t) {
    static const size_t sizes[KVS_DTYPE_COUNT] = {4, 2, 2, 4, 8, 1, 1};
    return (unsigned)t < KVS_DTYPE_COUNT ? sizes[t] : 0;
}

const char *kvs_dtype_name(kvs_dtype t) {
    static const char *names[KVS_DTYPE_COUNT] = {"F32", "F16", "BF16", "I32", "I64", "U8", "F8_E4M3"};
    return (unsigned)t < KVS_DTYPE_COUNT ? names[t] : "?";
}

uint16_t kvs_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float kvs_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else { /* subnormal: renormalise */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400u));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t kvs_f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    if (isnan(f)) return sign | 0x7e00u;
    float a = fabsf(f);
    if (a >= 65520.0f) return sign | 0x7c00u;
    if (a < 6.103515625e-05f) { /* subnormal half */
        return sign | (uint16_t)lrintf(a * 16777216.0f);
    }
    uint32_t exp = ((u >> 23) & 0xffu) - 127 + 15, man = u & 0x7fffffu;
    uint32_t h = (exp << 10) | (man >> 13), rest = man & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
    return sign | (uint16_t)h;
}

void kvs_to_f32(float *dst, const void *src, kvs_dtype t, size_t n) {
    const uint16_t *h = src;
    switch (t) {
    case KVS_F32: memcpy(dst, src, n * 4); break;
    case KVS_BF16: for (size_t i = 0; i < n; i++) dst[i] = kvs_bf16_to_f32(h[i]); break;
    case KVS_F16: for (size_t i = 0; i < n; i++) dst[i] = kvs_f16_to_f32(h[i]); break;
    default: memset(dst, 0, n * 4); break;
    }
}

uint8_t kvs_f32_to_e4m3(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    if (isnan(f)) return 0x7f; /* one NaN, as CUDA's conversion */
    float a = fabsf(f);
    if (a >= KVS_E4M3_MAX) return sign | 0x7e; /* saturate (inf too) */
    if (a < 0.015625f) /* below 2^-6: subnormal steps of 2^-9 (a * 512 is exact); 8 steps encode 2^-6 */
        return sign | (uint8_t)lrintf(a * 512.0f);
    uint32_t exp = ((u >> 23) & 0xffu) - 127 + 7, man = u & 0x7fffffu;
    uint32_t q = (exp << 3) | (man >> 20), rest = man & 0xfffffu;
    if (rest > 0x80000u || (rest == 0x80000u && (q & 1u))) q++; /* never past 0x7e: a < 448 */
    return sign | (uint8_t)q;
}

float kvs_e4m3_to_f32(uint8_t q) {
    uint32_t exp = (q >> 3) & 0xfu, man = q & 7u;
    float a;
    if (exp == 15 && man == 7) a = NAN;
    else if (exp == 0) a = (float)man / 512.0f;
    else a = ldexpf(1.0f + (float)man / 8.0f, (int)exp - 7);
    return q & 0x80u ? -a : a;
}
