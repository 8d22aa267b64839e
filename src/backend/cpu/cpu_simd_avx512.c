/* The AVX-512 (F + BW + VL + VNNI) kernel set (cpu_simd.h); this file alone is compiled
 * with those instructions, and runs only where the CPU has them. */
#include "backend/cpu/cpu_simd.h"

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#include <immintrin.h>

#define V __m512
#define VL 16
#define v_zero() _mm512_setzero_ps()
#define v_set1(f) _mm512_set1_ps(f)
#define v_load(p) _mm512_loadu_ps(p)
#define v_store(p, v) _mm512_storeu_ps(p, v)
#define v_fma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define v_load_bf16(p) \
    _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define v_load_f16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define v_hsum(v) _mm512_reduce_add_ps(v)
#define v_floor(t) _mm512_roundscale_ps((t), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
#define v_pow2(n) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23))
#define v_select_lt(x, c, a, b) _mm512_mask_blend_ps(_mm512_cmp_ps_mask((x), (c), _CMP_LT_OQ), (b), (a))
#define KERNELS_NAME "avx512"
#define KERNELS_VAR avx512_kernels
#define KERNELS_STATIC_STORAGE static
#include "backend/cpu/cpu_simd_impl.h"

const kvs_cpu_kernels *const kvs_cpu_kernels_avx512 = &avx512_kernels;
#else
const kvs_cpu_kernels *const kvs_cpu_kernels_avx512 = NULL;
#endif
