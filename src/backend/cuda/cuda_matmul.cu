/* matmul through cuBLASLt: bf16 x bf16 -> bf16, fp32 compute (the plan cache
 * also serves cuda_fp8.cu's e4m3 GEMMs). Row-major
 * out[n, o] = in[n, i] @ w[o, i]^T is, column-major, C(o x n) = W^T(o x i) B(i x n)
 * with W stored as (i x o, ld i) and transposed, B = in as (i x n, ld i).
 * One plan (descriptors + heuristic algorithm) is cached per shape. A bias is
 * added by cuBLASLt's bias epilogue (fp32, before the one rounding to bf16)
 * when its pointer is 16-byte aligned, else by a kernel after the GEMM. */
#include <stdint.h>
#include <string.h>

#include "backend/cuda/cuda_internal.h"

static void plan_release(kvs_cuda_gemm_plan *p) {
    if (p->op) cublasLtMatmulDescDestroy(p->op);
    if (p->a) cublasLtMatrixLayoutDestroy(p->a);
    if (p->b) cublasLtMatrixLayoutDestroy(p->b);
    if (p->c) cublasLtMatrixLayoutDestroy(p->c);
    memset(p, 0, sizeof *p);
}

void kvs_cuda_gemm_destroy(kvs_cuda *c) {
    for (int i = 0; i < KVS_CUDA_GEMM_PLANS; i++) plan_release(&c->plans[i]);
}

kvs_cuda_gemm_plan *kvs_cuda_gemm_plan_for(kvs_backend *b, kvs_gemm_kind kind, int fast_accum, int n, int in_dim,
                                           int out_dim, int bias, int quiet) {
    kvs_cuda *c = kvs_cuda_of(b);
    for (int i = 0; i < KVS_CUDA_GEMM_PLANS; i++) {
        kvs_cuda_gemm_plan *p = &c->plans[i];
        if (p->valid && p->kind == kind && p->fast_accum == fast_accum && p->n == n && p->in_dim == in_dim &&
            p->out_dim == out_dim && p->bias == bias)
            return p;
    }
    kvs_cuda_gemm_plan *p = &c->plans[c->next_plan];
    c->next_plan = (c->next_plan + 1) % KVS_CUDA_GEMM_PLANS;
    plan_release(p);
    int ok = 1;
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    /* FP8 on Hopper: e4m3 A and B, both K-major (this TN form), fp32 compute */
    cudaDataType_t in_t = kind == KVS_GEMM_BF16 ? CUDA_R_16BF : CUDA_R_8F_E4M3;
    cudaDataType_t out_t = kind == KVS_GEMM_FP8_F32 ? CUDA_R_32F : CUDA_R_16BF; /* FP8_BF16 too */
    LT_CHECK(b, cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F), ok);
    if (!ok) return NULL;
    LT_CHECK(b, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta), ok);
    LT_CHECK(b, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb), ok);
    if (kind != KVS_GEMM_BF16) {
        int8_t fast = (int8_t)(fast_accum != 0);
        LT_CHECK(b, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast), ok);
    }
    if (kind == KVS_GEMM_FP8_OUTER) { /* A's scales: one per row of op(A) (out_dim); B's: one per column (n) */
        int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
        LT_CHECK(b, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode, sizeof mode), ok);
        LT_CHECK(b, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode, sizeof mode), ok);
        /* the heuristic wants scale pointers (the real ones are set before each call): any device memory */
        const void *placeholder = c->lt_workspace;
        LT_CHECK(b, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &placeholder,
                                                   sizeof placeholder), ok);
        LT_CHECK(b, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &placeholder,
                                                   sizeof placeholder), ok);
    }
    if (bias) { /* bias[out_dim]: one value per row of C (o x n), broadcast over its n columns */
        cublasLtEpilogue_t ep = CUBLASLT_EPILOGUE_BIAS;
        cudaDataType_t bt = CUDA_R_16BF;
        LT_CHECK(b, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof ep), ok);
        LT_CHECK(b, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt), ok);
    }
    LT_CHECK(b, cublasLtMatrixLayoutCreate(&p->a, in_t, in_dim, out_dim, in_dim), ok);
    LT_CHECK(b, cublasLtMatrixLayoutCreate(&p->b, in_t, in_dim, n, in_dim), ok);
    LT_CHECK(b, cublasLtMatrixLayoutCreate(&p->c, out_t, out_dim, n, out_dim), ok);
    if (!ok) {
        plan_release(p);
        return NULL;
    }
    cublasLtMatmulPreference_t pref = NULL;
    LT_CHECK(b, cublasLtMatmulPreferenceCreate(&pref), ok);
    if (ok)
        LT_CHECK(b, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                         &c->lt_workspace_bytes, sizeof c->lt_workspace_bytes),
                 ok);
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    if (ok) {
        cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(c->lt, p->op, p->a, p->b, p->c, p->c, pref, 1, &res, &found);
        if (hs != CUBLAS_STATUS_SUCCESS && !quiet)
            kvs_cuda_report(b, "cublasLtMatmulAlgoGetHeuristic", cublasLtGetStatusString(hs), __FILE__, __LINE__);
        if (hs != CUBLAS_STATUS_SUCCESS) ok = 0;
    }
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (!ok || found == 0) {
        if (ok && !quiet)
            kvs_cuda_report(b, "cublasLtMatmulAlgoGetHeuristic", "no algorithm for this shape", __FILE__, __LINE__);
        plan_release(p);
        return NULL;
    }
    p->algo = res.algo;
    p->n = n;
    p->in_dim = in_dim;
    p->out_dim = out_dim;
    p->kind = kind;
    p->fast_accum = fast_accum;
    p->bias = bias;
    p->valid = 1;
    return p;
}

void kvs_cuda_matmul(kvs_backend *b, void *out, const void *in, const void *w, const void *bias, int n, int in_dim,
                     int out_dim) {
    if (n <= 0 || out_dim <= 0) return;
    kvs_cuda *c = kvs_cuda_of(b);
    int epilogue = bias && ((uintptr_t)bias & 15) == 0;
    kvs_cuda_gemm_plan *p = kvs_cuda_gemm_plan_for(b, KVS_GEMM_BF16, 0, n, in_dim, out_dim, epilogue, 0);
    if (!p) return;
    float alpha = 1.0f, beta = 0.0f;
    int ok = 1;
    if (epilogue)
        LT_CHECK(b, cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias), ok);
    if (ok)
        LT_CHECK(b, cublasLtMatmul(c->lt, p->op, &alpha, w, p->a, in, p->b, &beta, out, p->c, out, p->c, &p->algo,
                                   c->lt_workspace, c->lt_workspace_bytes, c->stream),
                 ok);
    if (ok && bias && !epilogue) kvs_cuda_add_bias(b, out, bias, n, out_dim);
}
