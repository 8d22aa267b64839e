/* FP8 E4M3 on the CUDA backend (docs/CUDA.md "FP8"): per-row quantization
 * (weights at load, a scale per output channel; activations per token), and
 * the e4m3 GEMM through cuBLASLt, its scales applied either by cuBLASLt's
 * outer-vector scale modes (one GEMM, bf16 out) or by a kernel after a GEMM
 * with unit scales and f32 out (kvs_cuda_options.fp8_gemm). */
#include <cuda_fp8.h>
#include <stdint.h>

#include "backend/cuda/cuda_internal.h"

enum { QUANT_THREADS = 256 };
/* AUTO's largest batch for the f32-out GEMM + scale kernel (above: outer-vector scales) */
enum { KVS_CUDA_FP8_EPILOGUE_MAX_N = 64 };

__device__ __forceinline__ uint8_t to_e4m3(float v) {
    return (uint8_t)__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}

/* One block per row: the row's amax, its scale, then the codes. VEC: 8
 * elements a step (16-byte loads, 8-byte stores; cols % 8 == 0). */
template <bool VEC>
__global__ void kvs_quantize_fp8_kernel(uint8_t *q, float *scale, const bf16 *x, int cols) {
    const bf16 *row = x + (size_t)blockIdx.x * cols;
    uint8_t *qrow = q + (size_t)blockIdx.x * cols;
    float m = 0.f;
    if (VEC) {
        for (int c = threadIdx.x * 8; c < cols; c += QUANT_THREADS * 8) {
            uint4 raw = *(const uint4 *)(row + c);
            const bf16 *v = (const bf16 *)&raw;
            for (int k = 0; k < 8; k++) m = fmaxf(m, fabsf(__bfloat162float(v[k])));
        }
    } else {
        for (int c = threadIdx.x; c < cols; c += QUANT_THREADS) m = fmaxf(m, fabsf(__bfloat162float(row[c])));
    }
    float s = kvs_block_max(m) / KVS_E4M3_MAX;
    if (!(s > 0.f)) s = 1.f;
    if (threadIdx.x == 0) scale[blockIdx.x] = s;
    if (VEC) {
        for (int c = threadIdx.x * 8; c < cols; c += QUANT_THREADS * 8) {
            uint4 raw = *(const uint4 *)(row + c);
            const bf16 *v = (const bf16 *)&raw;
            uint8_t out[8];
            for (int k = 0; k < 8; k++) out[k] = to_e4m3(__bfloat162float(v[k]) / s);
            *(uint2 *)(qrow + c) = *(const uint2 *)out;
        }
    } else {
        for (int c = threadIdx.x; c < cols; c += QUANT_THREADS) qrow[c] = to_e4m3(__bfloat162float(row[c]) / s);
    }
}

void kvs_cuda_quantize_fp8(kvs_backend *b, uint8_t *q, float *scale, const void *x, kvs_dtype x_dtype, int rows,
                           int cols) {
    if (rows <= 0 || cols <= 0) return;
    if (x_dtype != KVS_BF16) {
        kvs_cuda_report(b, "quantize_fp8", "the CUDA backend quantizes bf16 only", __FILE__, __LINE__);
        return;
    }
    cudaStream_t st = kvs_cuda_of(b)->stream;
    bool vec = cols % 8 == 0 && ((uintptr_t)x & 15) == 0 && ((uintptr_t)q & 7) == 0;
    if (vec)
        kvs_quantize_fp8_kernel<true><<<rows, QUANT_THREADS, 0, st>>>(q, scale, (const bf16 *)x, cols);
    else
        kvs_quantize_fp8_kernel<false><<<rows, QUANT_THREADS, 0, st>>>(q, scale, (const bf16 *)x, cols);
    KVS_CUDA_LAUNCHED(b, "quantize_fp8");
}

/* out[r][o] = bf16(acc[r][o] * xs[r] * ws[o] (+ bias[o])), two outputs a thread. */
__global__ void kvs_fp8_scale_kernel(bf16 *out, const float *acc, const float *xs, const float *ws, const bf16 *bias,
                                     int n, int out_dim) {
    size_t pairs = (size_t)n * out_dim / 2;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < pairs; i += (size_t)gridDim.x * blockDim.x) {
        size_t e = 2 * i;
        int r = (int)(e / out_dim), o = (int)(e % out_dim); /* out_dim even: both in row r */
        float2 a = *(const float2 *)(acc + e);
        float v0 = a.x * xs[r] * ws[o], v1 = a.y * xs[r] * ws[o + 1];
        if (bias) v0 += __bfloat162float(bias[o]), v1 += __bfloat162float(bias[o + 1]);
        *(__nv_bfloat162 *)(out + e) = __floats2bfloat162_rn(v0, v1);
    }
}

static bool fp8_gemm(kvs_backend *b, kvs_cuda_gemm_plan *p, void *d, const uint8_t *xq, const float *xs,
                     const uint8_t *wq, const float *ws, const void *bias) {
    kvs_cuda *c = kvs_cuda_of(b);
    float alpha = 1.0f, beta = 0.0f;
    int ok = 1;
    if (p->kind == KVS_GEMM_FP8_OUTER) {
        LT_CHECK(b, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ws, sizeof ws), ok);
        LT_CHECK(b, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &xs, sizeof xs), ok);
    }
    if (ok && p->bias)
        LT_CHECK(b, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias), ok);
    if (ok)
        LT_CHECK(b, cublasLtMatmul(c->lt, p->op, &alpha, wq, p->a, xq, p->b, &beta, d, p->c, d, p->c, &p->algo,
                                   c->lt_workspace, c->lt_workspace_bytes, c->stream),
                 ok);
    return ok;
}

void kvs_cuda_matmul_fp8(kvs_backend *b, void *out, const uint8_t *xq, const float *xs, const uint8_t *wq,
                         const float *ws, const void *bias, int n, int in_dim, int out_dim) {
    if (n <= 0 || out_dim <= 0) return;
    kvs_cuda *c = kvs_cuda_of(b);
    if (in_dim % 16 || out_dim % 16 || ((uintptr_t)xq & 15) || ((uintptr_t)wq & 15)) {
        kvs_cuda_report(b, "matmul_fp8", "in_dim and out_dim must be multiples of 16, the codes 16-byte aligned",
                        __FILE__, __LINE__);
        return;
    }
    int mode = c->fp8_gemm;
    bool automatic = mode == KVS_CUDA_FP8_AUTO;
    /* AUTO: decode-sized batches through the f32 GEMM + scale kernel (cuBLASLt's
       outer-vector kernels for few columns read the weights at ~2 TB/s, the
       unit-scale ones at ~3; docs/CUDA.md "FP8", run 5), larger ones outer-vector */
    if (automatic)
        mode = c->fp8_outer_missing || n <= KVS_CUDA_FP8_EPILOGUE_MAX_N ? KVS_CUDA_FP8_EPILOGUE_FAST
                                                                         : KVS_CUDA_FP8_OUTER_FAST;
    int fast = mode == KVS_CUDA_FP8_OUTER_FAST || mode == KVS_CUDA_FP8_EPILOGUE_FAST;
    if (mode == KVS_CUDA_FP8_OUTER_FAST || mode == KVS_CUDA_FP8_OUTER) {
        int epilogue = bias && ((uintptr_t)bias & 15) == 0;
        kvs_cuda_gemm_plan *p =
            kvs_cuda_gemm_plan_for(b, KVS_GEMM_FP8_OUTER, fast, n, in_dim, out_dim, epilogue, automatic);
        if (p) {
            if (fp8_gemm(b, p, out, xq, xs, wq, ws, bias) && bias && !epilogue)
                kvs_cuda_add_bias(b, out, bias, n, out_dim);
            return;
        }
        if (!automatic) return; /* reported */
        c->fp8_outer_missing = 1;
        kvs_log(KVS_LOG_WARN, "cuda: cuBLASLt has no outer-vector-scaled FP8 GEMM here; scaling in a kernel instead");
    }
    float *acc = (float *)kvs_cuda_scratch(b, sizeof(float) * (size_t)n * out_dim);
    if (!acc) return;
    kvs_cuda_gemm_plan *p = kvs_cuda_gemm_plan_for(b, KVS_GEMM_FP8_F32, fast, n, in_dim, out_dim, 0, 0);
    if (!p || !fp8_gemm(b, p, acc, xq, xs, wq, ws, NULL)) return;
    size_t pairs = (size_t)n * out_dim / 2;
    unsigned blocks = kvs_cuda_blocks(pairs, 256);
    if (blocks > 4 * 1024) blocks = 4 * 1024;
    kvs_fp8_scale_kernel<<<blocks, 256, 0, c->stream>>>((bf16 *)out, acc, xs, ws, (const bf16 *)bias, n, out_dim);
    KVS_CUDA_LAUNCHED(b, "fp8_scale");
}
