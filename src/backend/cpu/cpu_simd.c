/* The generic kernel set (plain C, any CPU) and the pick of the best set. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include "backend/backend.h"
#include "backend/cpu/cpu_simd.h"

#define V float
#define VL 1
#define v_zero() 0.0f
#define v_set1(f) (f)
#define v_load(p) (*(p))
#define v_store(p, v) (*(p) = (v))
#define v_fma(a, b, c) ((a) * (b) + (c))
#define v_hsum(v) (v)
#define v_load_bf16(p) kvs_bf16_to_f32(*(p))
#define v_load_f16(p) kvs_f16_to_f32(*(p))
#define v_floor(t) floorf(t)
#define v_pow2(n) ldexpf(1.0f, (int)(n))
#define v_select_lt(x, c, a, b) ((x) < (c) ? (a) : (b))
#define KERNELS_NAME "generic"
#define KERNELS_VAR kvs_cpu_kernels_generic
#include "backend/cpu/cpu_simd_impl.h"

/* Scalar, so that every set sees the same blocks; round half away from zero
 * (llama.cpp's roundf), |q| <= 127 since |x| / d <= 127 up to rounding. The
 * rows are few (decode): its time is small against reading the weights. */
void kvs_cpu_quantize_q8(kvs_cpu_q8 *dst, const float *x, int n, int in_dim, int group) {
    for (size_t g = 0; g < (size_t)n * (in_dim / group); g++, x += group) {
        float amax = 0;
        for (int k = 0; k < group; k++) amax = fabsf(x[k]) > amax ? fabsf(x[k]) : amax; /* fmaxf: NaN ignored */
        float d = amax / 127.0f, inv = d != 0 ? 1.0f / d : 0.0f;
        for (int k0 = 0; k0 < group; k0 += 32, dst++) {
            int sum = 0;
            for (int k = 0; k < 32; k++) {
                /* roundf inline (|v| <= 127 up to rounding, or NaN; the libm call was 60% of the time):
                 * truncated, then the half away from zero */
                float v = x[k0 + k] * inv;
                v = v == v ? v : 0.0f; /* NaN (an inf or NaN input): 0, and d makes the sums NaN */
                int t = (int)v;
                float fr = v - (float)t;
                t += (fr >= 0.5f) - (fr <= -0.5f);
                int q = t >= 127 ? 127 : t <= -127 ? -127 : t;
                dst->q[k] = (int8_t)q;
                sum += q;
            }
            dst->d = d, dst->s = d * (float)sum, dst->isum = sum, dst->pad_ = 0;
        }
    }
}

/* The AVX-512 set's quantized gemv uses VNNI (vpdpbusd on 256 bits, so VL too):
 * a CPU with AVX-512 but not these (Skylake-SP) runs the AVX2 set. */
bool kvs_cpu_runs_avx512(void) {
#if defined(__x86_64__)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
    return false;
#endif
}

bool kvs_cpu_runs_avx2(void) {
#if defined(__x86_64__)
    /* F16C from CPUID leaf 1 (ECX bit 29): clang 14's __builtin_cpu_supports does not know "f16c" */
    unsigned a, b, c, d;
    bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
    return f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return false;
#endif
}

const kvs_cpu_kernels *kvs_cpu_kernels_pick(void) {
    const char *want = getenv("KVS_CPU_KERNELS");
    bool no512 = want && (!strcmp(want, "avx2") || !strcmp(want, "generic")), no2 = want && !strcmp(want, "generic");
    if (kvs_cpu_kernels_avx512 && kvs_cpu_runs_avx512() && !no512) return kvs_cpu_kernels_avx512;
    if (kvs_cpu_kernels_avx2 && kvs_cpu_runs_avx2() && !no2) return kvs_cpu_kernels_avx2;
    return &kvs_cpu_kernels_generic;
}

const char *kvs_cpu_kernels_name(void) { return kvs_cpu_kernels_pick()->name; }
