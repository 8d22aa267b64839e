/* The CPU backend's vector kernels: one set per instruction set (generic C,
 * AVX2 + FMA + F16C, AVX-512), all from one source (cpu_simd_impl.h) compiled
 * once per set; the best set the CPU runs is picked at backend creation.
 * Internal to backend/cpu/. */
#ifndef KVS_CPU_SIMD_H
#define KVS_CPU_SIMD_H

#include "core/core.h"

/* The most input rows the gemv kernel takes: above it the matmul goes to sgemm. */
enum { KVS_CPU_GEMV_MAX_N = 8 };

/* 32 activations quantized for the integer dot products of the quantized
 * gemv (cpu_quant.c): x[k] ~ d * q[k], q = round(x / d) in [-127, 127], d =
 * max |x| / 127 over the block's group (32, or 256 for the K formats, as
 * llama.cpp's Q8_0 and Q8_K); isum = the sum of the q, s = d * isum, which the
 * formats' mins multiply. */
typedef struct {
    int8_t q[32];
    float d, s;
    int32_t isum, pad_;
} kvs_cpu_q8;

typedef struct {
    const char *name; /* "avx512", "avx2", "generic" */
    /* Weights read once, for decode: out[i * ld_out + j] = sum_k x[i * in_dim + k] *
     * w[j * in_dim + k] (+ bias[j]) for i < n (at most KVS_CPU_GEMV_MAX_N) and rows
     * j in [j0, j1) of w, whose dtype is wt (F32, BF16 or F16). A row's result
     * does not depend on n, j0 or j1. */
    void (*gemv)(float *out, int ld_out, const float *x, const void *w, kvs_dtype wt, const float *bias, int n,
                 int in_dim, int j0, int j1);
    /* Weights in a ggml block format (gguf.h ids: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
     * Q4_K, Q5_K, Q6_K), for decode: out[i * ld_out + j] = sum_k xq_i[k] * w_j[k]
     * (+ bias[j]) for i < n (at most KVS_CPU_GEMV_MAX_N) and rows j in [j0, j1)
     * of w (row_bytes apart), over inputs quantized by kvs_cpu_quantize_q8
     * (input i's in_dim / 32 blocks at xq + i * in_dim / 32). The generic set's
     * is the reference (exact integer dots per 16, then f32); the others sum
     * the same terms in another order. A row's result does not depend on n, j0
     * or j1. */
    void (*gemv_q)(float *out, int ld_out, const kvs_cpu_q8 *xq, const void *w, uint32_t type, size_t row_bytes,
                   const float *bias, int n, int in_dim, int j0, int j1);
    /* Attention scores of g query vectors (q + h * ld_q, h < g) against cnt
     * contiguous key rows k [cnt][d] of dtype kt (F32, BF16, F16):
     * s[h * ld_s + e] = scale * q_h . k_e. */
    void (*qk)(float *s, int ld_s, const float *q, int ld_q, int g, const void *k, kvs_dtype kt, int cnt, int d,
               float scale);
    /* out[h * ld_out + :d] += sum_e p[h * ld_p + e] * v[e][:d] for h < g, e < cnt (v of dtype vt). */
    void (*pv)(float *out, int ld_out, const float *p, int ld_p, int g, const void *v, kvs_dtype vt, int cnt, int d);
    /* The sum of x[0 .. n) (n a multiple of 64): the memory read benchmark's loop. */
    float (*sum)(const float *x, size_t n);
    /* Softmax numerators in place: s[e] = exp(s[e] - m) for e < n, 0 where s[e] - m is
     * below float's normal range (-87.33), and their sum. exp is a polynomial within 2
     * ulp of expf; an element's value does not depend on where it sits. */
    float (*exp_sum)(float *s, int n, float m);
    /* SwiGLU of one row: out[j] = g[j] / (1 + exp(-g[j])) * u[j] for j < n (exp as above:
     * +inf past 88.72). */
    void (*silu_mul)(float *out, const float *g, const float *u, int n);
} kvs_cpu_kernels;

extern const kvs_cpu_kernels kvs_cpu_kernels_generic;
/* NULL where the build has no such set (not x86-64). */
extern const kvs_cpu_kernels *const kvs_cpu_kernels_avx2, *const kvs_cpu_kernels_avx512;

/* Whether this CPU runs a set (its instructions, not whether the build has it). */
bool kvs_cpu_runs_avx2(void);
bool kvs_cpu_runs_avx512(void);

/* Quantizes n rows of in_dim floats (a multiple of group: 32 or 256) into
 * n * in_dim / 32 blocks (kvs_cpu_q8), one scale per group: the same bits for
 * every set. gemv_q takes group 256 for the K formats, 32 for the others. */
void kvs_cpu_quantize_q8(kvs_cpu_q8 *dst, const float *x, int n, int in_dim, int group);

/* The best set this CPU runs; $KVS_CPU_KERNELS (generic, avx2, avx512) picks a
 * lesser one (a set the CPU lacks falls back to the best it has). */
const kvs_cpu_kernels *kvs_cpu_kernels_pick(void);

#endif
