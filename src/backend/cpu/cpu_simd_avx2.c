/* The AVX2 + FMA + F16C kernel set (cpu_simd.h); this file alone is compiled
 * with those instructions, and runs only where the CPU has them. */
#include "backend/cpu/cpu_simd.h"

#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#define V __m256
#define VL 8
#define v_zero() _mm256_setzero_ps()
#define v_set1(f) _mm256_set1_ps(f)
#define v_load(p) _mm256_loadu_ps(p)
#define v_store(p, v) _mm256_storeu_ps(p, v)
#define v_fma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define v_load_bf16(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define v_load_f16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
static inline float v_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define v_floor(t) _mm256_floor_ps(t)
#define v_pow2(n) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23))
#define v_select_lt(x, c, a, b) _mm256_blendv_ps((b), (a), _mm256_cmp_ps((x), (c), _CMP_LT_OQ))
#define KERNELS_NAME "avx2"
#define KERNELS_VAR avx2_kernels
#define KERNELS_STATIC_STORAGE static
#include "backend/cpu/cpu_simd_impl.h"

const kvs_cpu_kernels *const kvs_cpu_kernels_avx2 = &avx2_kernels;
#else
const kvs_cpu_kernels *const kvs_cpu_kernels_avx2 = NULL;
#endif
