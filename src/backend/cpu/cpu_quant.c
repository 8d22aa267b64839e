/* matmul_q and embedding_q: weights kept in llama.cpp's ggml block formats
 * (gguf/gguf.h), never widened whole. Decode (n <= KVS_CPU_GEMV_MAX_N) quantizes
 * the inputs once to int8 blocks of 32 (scaled per 32, or per 256 for the K
 * formats, as llama.cpp's Q8_0 / Q8_K) and runs the kernel set's integer gemv_q
 * (cpu_quant_impl.h) over the pool's threads, each reading its rows of w once,
 * as llama.cpp does; prefill widens panels of w to f32 for sgemm, like the
 * bf16 matmul (cpu_matmul.c). */
#include <string.h>

#include "backend/cpu/cpu_ops.h"
#include "gguf/gguf.h"

typedef struct {
    const kvs_cpu_kernels *k;
    float *out;
    int ld_out;
    const float *x, *bias;
    const kvs_cpu_q8 *xq; /* NULL: plain weights of dtype wt through gemv */
    const void *w;
    uint32_t type;
    kvs_dtype wt;
    size_t row_bytes;
    int n, in_dim, out_dim;
} gemv_q_job;

static void run_gemv_q(void *arg, int t, int nt) {
    const gemv_q_job *g = arg;
    int c0, c1;
    kvs_cpu_thread_cols(g->out_dim, nt, t, &c0, &c1);
    if (c0 >= c1) return;
    if (g->xq)
        g->k->gemv_q(g->out, g->ld_out, g->xq, g->w, g->type, g->row_bytes, g->bias, g->n, g->in_dim, c0, c1);
    else
        g->k->gemv(g->out, g->ld_out, g->x, g->w, g->wt, g->bias, g->n, g->in_dim, c0, c1);
}

typedef struct {
    kvs_backend *b;
    uint32_t type;
    size_t row_bytes;
} widen_ctx;

/* a row of w through the reference dequantizer: prefill's sgemm does ~2n flops
 * a weight, so the widening is a small part of its time */
static void widen_q(float *dst, const void *w, int row, int in_dim, const void *ctx) {
    const widen_ctx *c = ctx;
    if (kvs_ggml_dequantize(c->type, (const char *)w + (size_t)row * c->row_bytes, dst, in_dim, "matmul_q weights") !=
        KVS_OK) {
        kvs_cpu_fail(c->b, KVS_ERR_FORMAT, "%s", kvs_last_error());
        memset(dst, 0, sizeof(float) * in_dim);
    }
}

/* the dtype of the plain ggml types (F32 for the quantized ones) */
static kvs_dtype plain_dtype(uint32_t type) {
    return type == KVS_GGML_F16 ? KVS_F16 : type == KVS_GGML_BF16 ? KVS_BF16 : KVS_F32;
}

/* type's row size for dim elements; false (failure recorded) when unsupported or dim is not whole blocks */
static bool row_bytes_of(kvs_backend *b, const char *op, uint32_t type, int dim, size_t *row_bytes) {
    kvs_ggml_layout lay;
    if (!kvs_ggml_type_layout(type, &lay) || !kvs_ggml_can_dequantize(type)) {
        kvs_cpu_fail(b, KVS_ERR_UNSUPPORTED, "%s: ggml type %s is unsupported", op,
                     kvs_ggml_type_layout(type, &lay) ? lay.name : "(unknown)");
        return false;
    }
    if (dim <= 0 || dim % lay.block) {
        kvs_cpu_fail(b, KVS_ERR_INVALID, "%s: %d elements are not whole %s blocks of %d", op, dim, lay.name, lay.block);
        return false;
    }
    *row_bytes = (size_t)(dim / lay.block) * lay.block_bytes;
    return true;
}

void kvs_cpu_matmul_q(kvs_backend *b, void *out, int ld_out, const void *in, const void *w, uint32_t type,
                      const void *bias, int n, int in_dim, int out_dim) {
    size_t row_bytes;
    if (n <= 0 || out_dim <= 0 || !row_bytes_of(b, "matmul_q", type, in_dim, &row_bytes)) return;
    float *o = out;
    const float *x = in;
    bool plain = type == KVS_GGML_F32 || type == KVS_GGML_F16 || type == KVS_GGML_BF16;
    bool gemv = n <= KVS_CPU_GEMV_MAX_N, widen = !gemv && type != KVS_GGML_F32;
    /* scratch: the bias as f32, then the quantized inputs (decode) or the widened panel (prefill) */
    size_t bias_bytes = bias && b->weight_dtype != KVS_F32 ? sizeof(float) * (size_t)(out_dim + 15) / 16 * 16 : 0;
    size_t rest = gemv && !plain ? sizeof(kvs_cpu_q8) * (size_t)n * (in_dim / 32)
                  : widen       ? sizeof(float) * (size_t)kvs_cpu_panel_rows(in_dim) * in_dim
                                : 0;
    char *scratch = NULL;
    if (bias_bytes + rest) {
        scratch = kvs_cpu_scratch(b, bias_bytes + rest);
        if (!scratch) return;
    }
    const float *bias32 = bias ? kvs_cpu_weights_f32(b, bias, out_dim, (float *)scratch) : NULL;
    if (gemv) { /* decode: the inputs quantized once, then the pool's threads split the rows of w */
        kvs_cpu_q8 *xq = plain ? NULL : (kvs_cpu_q8 *)(scratch + bias_bytes);
        bool k256 = type == KVS_GGML_Q4_K || type == KVS_GGML_Q5_K || type == KVS_GGML_Q6_K;
        if (xq) kvs_cpu_quantize_q8(xq, x, n, in_dim, k256 ? 256 : 32);
        gemv_q_job job = {kvs_cpu_kernels_of(b), o, ld_out, x, bias32, xq, w, type, plain_dtype(type), row_bytes,
                          n, in_dim, out_dim};
        kvs_cpu_pool_run(kvs_cpu_pool_of(b), run_gemv_q, &job);
        return;
    }
    if (bias32)
        for (int i = 0; i < n; i++) memcpy(o + (size_t)i * ld_out, bias32, sizeof(float) * out_dim);
    widen_ctx ctx = {b, type, row_bytes};
    kvs_cpu_sgemm_panels(o, ld_out, x, n, in_dim, out_dim, bias32 ? 1.0f : 0.0f, w, widen ? widen_q : NULL, &ctx,
                         widen ? (float *)(scratch + bias_bytes) : NULL);
}

void kvs_cpu_embedding_q(kvs_backend *b, void *out, const void *table, uint32_t type, const int32_t *ids, int n,
                         int dim) {
    size_t row_bytes;
    if (n <= 0 || !row_bytes_of(b, "embedding_q", type, dim, &row_bytes)) return;
    widen_ctx ctx = {b, type, row_bytes};
    for (int i = 0; i < n; i++) widen_q((float *)out + (size_t)i * dim, table, ids[i], dim, &ctx);
}
