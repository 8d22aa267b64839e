/* The values of dummy weights (--load-format dummy), element by element, for
 * host code and CUDA kernels alike. model/checkpoint.c generates whole
 * tensors on the host with these; the backends' dummy_fill op makes a slice
 * directly in backend memory, bit for bit the same elements.
 *
 * Element i of a weight with seed s: chunk c = i / KVS_DUMMY_CHUNK has its own
 * splitmix64 stream started at mix64(s ^ mix64(c)); the element is that
 * stream's (i % KVS_DUMMY_CHUNK + 1)-th output z, and its value is the
 * Irwin-Hall sum of z's four 16-bit parts minus 131070 (an integer in
 * [-131070, 131070]), times std / 37837.23 (65536 / sqrt(3)), plus the mean. */
#ifndef KVS_DUMMY_VALUES_H
#define KVS_DUMMY_VALUES_H

#include <stdint.h>

#ifdef __CUDACC__
#define KVS_DUMMY_FN static __host__ __device__ __forceinline__
#else
#define KVS_DUMMY_FN static inline
#endif

#define KVS_DUMMY_CHUNK 65536 /* elements per independently seeded chunk */
#define KVS_DUMMY_GOLDEN 0x9e3779b97f4a7c15ull

KVS_DUMMY_FN uint64_t kvs_dummy_mix64(uint64_t x) {
    x += KVS_DUMMY_GOLDEN;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* The per-weight seed of (kind, layer) (layer -1 for global weights). */
KVS_DUMMY_FN uint64_t kvs_dummy_seed(uint64_t checkpoint_seed, int kind, int layer) {
    return kvs_dummy_mix64(checkpoint_seed ^ kvs_dummy_mix64(((uint64_t)kind << 32) ^ (uint64_t)(uint32_t)(layer + 1)));
}

/* The chunk's splitmix64 state before its first element. */
KVS_DUMMY_FN uint64_t kvs_dummy_chunk_state(uint64_t seed, uint64_t chunk) {
    return kvs_dummy_mix64(seed ^ kvs_dummy_mix64(chunk));
}

/* The integer of the element after `state` (state already advanced to it). */
KVS_DUMMY_FN int32_t kvs_dummy_int_of_state(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    int64_t s = (int64_t)(z & 0xffff) + (int64_t)((z >> 16) & 0xffff) + (int64_t)((z >> 32) & 0xffff) +
                (int64_t)(z >> 48);
    return (int32_t)(s - 131070);
}

/* Element i's integer, computed on its own (no walk through the chunk). */
KVS_DUMMY_FN int32_t kvs_dummy_int(uint64_t seed, uint64_t i) {
    uint64_t state = kvs_dummy_chunk_state(seed, i / KVS_DUMMY_CHUNK);
    return kvs_dummy_int_of_state(state + (i % KVS_DUMMY_CHUNK + 1) * KVS_DUMMY_GOLDEN);
}

/* The scale of a weight with standard deviation std (computed once, in float). */
KVS_DUMMY_FN float kvs_dummy_scale(float std) { return std / 37837.23f; }

/* Rounding rules of core/dtype.c (kvs_f32_to_bf16, kvs_f32_to_f16,
 * kvs_f16_to_f32), repeated here so that kernels round the same way. */
KVS_DUMMY_FN uint32_t kvs_dummy_bits(float f) {
    union { float f; uint32_t u; } v;
    v.f = f;
    return v.u;
}
KVS_DUMMY_FN float kvs_dummy_float(uint32_t u) {
    union { float f; uint32_t u; } v;
    v.u = u;
    return v.f;
}
KVS_DUMMY_FN uint16_t kvs_dummy_to_bf16(float f) {
    uint32_t u = kvs_dummy_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
KVS_DUMMY_FN float kvs_dummy_bf16_to_f32(uint16_t h) { return kvs_dummy_float((uint32_t)h << 16); }
/* Finite values only (dummy weights are small). */
KVS_DUMMY_FN uint16_t kvs_dummy_to_f16(float f) {
    uint32_t u = kvs_dummy_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    float a = kvs_dummy_float(u & 0x7fffffffu);
    if (a >= 65520.0f) return sign | 0x7c00u;
    if (a < 6.103515625e-05f) { /* subnormal half: round to nearest even */
#ifdef __CUDA_ARCH__
        return sign | (uint16_t)__float2int_rn(a * 16777216.0f);
#else
        float r = a * 16777216.0f; /* exact; below 1024, so r + 2^23 - 2^23 rounds to an integer, ties to even */
        return sign | (uint16_t)(int32_t)((r + 8388608.0f) - 8388608.0f);
#endif
    }
    uint32_t exp = ((u >> 23) & 0xffu) - 127 + 15, man = u & 0x7fffffu;
    uint32_t h = (exp << 10) | (man >> 13), rest = man & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;
    return sign | (uint16_t)h;
}
KVS_DUMMY_FN float kvs_dummy_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else {
            int e = -1;
            do {
                man <<= 1;
                e++;
            } while (!(man & 0x400u));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        u = sign | 0x7f800000u | (man << 13);
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    return kvs_dummy_float(u);
}

/* A zero-mean weight's element i as float, after rounding to the checkpoint's
 * dtype (src: 0 F32, 1 F16, 2 BF16, core's kvs_dtype numbering). */
KVS_DUMMY_FN float kvs_dummy_value(uint64_t seed, uint64_t i, float scale, int src_dtype) {
    float x = (float)kvs_dummy_int(seed, i) * scale;
    if (src_dtype == 2) return kvs_dummy_bf16_to_f32(kvs_dummy_to_bf16(x));
    if (src_dtype == 1) return kvs_dummy_f16_to_f32(kvs_dummy_to_f16(x));
    return x;
}

#endif
