/* Row-wise CUDA ops: embedding, RMSNorm, add, bias, RoPE, SwiGLU, row gathers,
 * the paged KV write, compaction's per-head gather and the window capture.
 * bf16 in and out, fp32 math. */
#include "backend/cuda/cuda_internal.h"

/* ---- row copies ------------------------------------------------------------ */

/* out[i] = in[idx[i]] for rows of `dim` bf16 (16-byte pieces when dim % 8 == 0). */
__global__ void kvs_copy_rows_kernel(bf16 *out, const bf16 *in, const int32_t *idx, int m, int dim) {
    int row = blockIdx.y;
    size_t src = (size_t)idx[row] * dim, dst = (size_t)row * dim;
    if ((dim & 7) == 0) {
        const uint4 *s = (const uint4 *)(in + src);
        uint4 *d = (uint4 *)(out + dst);
        for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < dim / 8; j += gridDim.x * blockDim.x) d[j] = s[j];
    } else {
        for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < dim; j += gridDim.x * blockDim.x)
            out[dst + j] = in[src + j];
    }
}

static void copy_rows(kvs_backend *b, void *out, const void *in, const int32_t *idx, int m, int dim) {
    if (m <= 0 || dim <= 0) return;
    int units = (dim & 7) == 0 ? dim / 8 : dim;
    unsigned gx = kvs_cuda_blocks(units, 256);
    if (gx > 8) gx = 8;
    kvs_copy_rows_kernel<<<dim3(gx, m), 256, 0, kvs_cuda_of(b)->stream>>>((bf16 *)out, (const bf16 *)in, idx, m,
                                                                           dim);
    KVS_CUDA_LAUNCHED(b, "kvs_copy_rows_kernel");
}

void kvs_cuda_embedding(kvs_backend *b, void *out, const void *table, const int32_t *ids, int n, int dim) {
    copy_rows(b, out, table, ids, n, dim);
}

void kvs_cuda_gather_rows(kvs_backend *b, void *out, const void *in, const int32_t *idx, int m, int dim) {
    copy_rows(b, out, in, idx, m, dim);
}

/* ---- RMSNorm: one block per row; in place is safe (each element is read by the thread that writes it) */

__global__ void kvs_rmsnorm_kernel(bf16 *out, const bf16 *in, const bf16 *w, int dim, float eps) {
    const bf16 *x = in + (size_t)blockIdx.x * dim;
    bf16 *o = out + (size_t)blockIdx.x * dim;
    float ss = 0.f;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) {
        float v = __bfloat162float(x[j]);
        ss += v * v;
    }
    float r = rsqrtf(kvs_block_sum(ss) / dim + eps);
    for (int j = threadIdx.x; j < dim; j += blockDim.x)
        o[j] = __float2bfloat16(__bfloat162float(x[j]) * r * __bfloat162float(w[j]));
}

void kvs_cuda_rmsnorm(kvs_backend *b, void *out, const void *in, const void *w, int n, int dim, float eps) {
    if (n <= 0) return;
    kvs_rmsnorm_kernel<<<n, 256, 0, kvs_cuda_of(b)->stream>>>((bf16 *)out, (const bf16 *)in, (const bf16 *)w, dim,
                                                               eps);
    KVS_CUDA_LAUNCHED(b, "kvs_rmsnorm_kernel");
}

/* ---- elementwise ----------------------------------------------------------- */

__global__ void kvs_add_kernel(bf16 *x, const bf16 *y, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] = __float2bfloat16(__bfloat162float(x[i]) + __bfloat162float(y[i]));
}

void kvs_cuda_add(kvs_backend *b, void *x, const void *y, size_t n) {
    if (!n) return;
    unsigned g = kvs_cuda_blocks(n, 256);
    if (g > 65535u) g = 65535u;
    kvs_add_kernel<<<g, 256, 0, kvs_cuda_of(b)->stream>>>((bf16 *)x, (const bf16 *)y, n);
    KVS_CUDA_LAUNCHED(b, "kvs_add_kernel");
}

/* out[i, j] += bias[j] */
__global__ void kvs_add_bias_kernel(bf16 *out, const bf16 *bias, size_t n, int dim) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16(__bfloat162float(out[i]) + __bfloat162float(bias[i % dim]));
}

void kvs_cuda_add_bias(kvs_backend *b, void *out, const void *bias, int n, int dim) {
    size_t total = (size_t)n * dim;
    if (!total) return;
    unsigned g = kvs_cuda_blocks(total, 256);
    if (g > 65535u) g = 65535u;
    kvs_add_bias_kernel<<<g, 256, 0, kvs_cuda_of(b)->stream>>>((bf16 *)out, (const bf16 *)bias, total, dim);
    KVS_CUDA_LAUNCHED(b, "kvs_add_bias_kernel");
}

__global__ void kvs_f32_to_bf16_kernel(bf16 *dst, const float *src, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        dst[i] = __float2bfloat16(src[i]);
}

void kvs_cuda_f32_to_bf16(kvs_backend *b, void *dst, const float *src, size_t n) {
    if (!n) return;
    unsigned g = kvs_cuda_blocks(n, 256);
    if (g > 65535u) g = 65535u;
    kvs_f32_to_bf16_kernel<<<g, 256, 0, kvs_cuda_of(b)->stream>>>((bf16 *)dst, src, n);
    KVS_CUDA_LAUNCHED(b, "kvs_f32_to_bf16_kernel");
}

/* out[i, j] = silu(g) * u with g = gate_up[i, j], u = gate_up[i, dim + j] */
__global__ void kvs_swiglu_kernel(bf16 *out, const bf16 *gate_up, int n, int dim) {
    size_t total = (size_t)n * dim;
    for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < total; t += (size_t)gridDim.x * blockDim.x) {
        size_t i = t / dim, j = t % dim;
        float g = __bfloat162float(gate_up[i * 2 * dim + j]), u = __bfloat162float(gate_up[i * 2 * dim + dim + j]);
        out[t] = __float2bfloat16(g / (1.0f + expf(-g)) * u);
    }
}

void kvs_cuda_swiglu(kvs_backend *b, void *out, const void *gate_up, int n, int dim) {
    size_t total = (size_t)n * dim;
    if (!total) return;
    unsigned g = kvs_cuda_blocks(total, 256);
    if (g > 65535u) g = 65535u;
    kvs_swiglu_kernel<<<g, 256, 0, kvs_cuda_of(b)->stream>>>((bf16 *)out, (const bf16 *)gate_up, n, dim);
    KVS_CUDA_LAUNCHED(b, "kvs_swiglu_kernel");
}

/* ---- RoPE: one thread per (token, frequency); the angle in double like the CPU reference */

__global__ void kvs_rope_kernel(bf16 *x, const int32_t *positions, const float *inv_freq, int n, int n_heads,
                                int head_dim) {
    int half = head_dim / 2;
    size_t total = (size_t)n * half;
    for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < total; t += (size_t)gridDim.x * blockDim.x) {
        int i = (int)(t / half), k = (int)(t % half);
        double s, c;
        sincos((double)positions[i] * inv_freq[k], &s, &c);
        float cf = (float)c, sf = (float)s;
        for (int h = 0; h < n_heads; h++) {
            bf16 *r = x + ((size_t)i * n_heads + h) * head_dim;
            float x1 = __bfloat162float(r[k]), x2 = __bfloat162float(r[k + half]);
            r[k] = __float2bfloat16(x1 * cf - x2 * sf);
            r[k + half] = __float2bfloat16(x2 * cf + x1 * sf);
        }
    }
}

void kvs_cuda_rope(kvs_backend *b, void *x, const int32_t *positions, const float *inv_freq, int n, int n_heads,
                   int head_dim) {
    size_t total = (size_t)n * (head_dim / 2);
    if (!total) return;
    unsigned g = kvs_cuda_blocks(total, 128);
    if (g > 65535u) g = 65535u;
    kvs_rope_kernel<<<g, 128, 0, kvs_cuda_of(b)->stream>>>((bf16 *)x, positions, inv_freq, n, n_heads, head_dim);
    KVS_CUDA_LAUNCHED(b, "kvs_rope_kernel");
}

/* ---- paged KV ---------------------------------------------------------------- */

/* One thread per (token, kind, head, element): pool slot <- k or v; negative slots skipped. */
__global__ void kvs_kv_write_kernel(bf16 *pool, const bf16 *k, const bf16 *v, const int32_t *slots, int n,
                                    int n_kv_heads, int block_size, int head_dim) {
    size_t row = (size_t)n_kv_heads * head_dim, total = (size_t)n * 2 * row;
    for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < total; t += (size_t)gridDim.x * blockDim.x) {
        int i = (int)(t / (2 * row));
        size_t r = t % (2 * row);
        int kind = (int)(r / row), h = (int)((r % row) / head_dim), e = (int)(r % head_dim);
        int slot = slots[i];
        if (slot < 0) continue; /* a padding row of a graph-bucketed batch: no KV */
        const bf16 *src = kind ? v : k;
        pool[kvs_kv_offset(slot / block_size, kind, h, slot % block_size, n_kv_heads, block_size, head_dim) + e] =
            src[(size_t)i * row + (size_t)h * head_dim + e];
    }
}

void kvs_cuda_kv_write(kvs_backend *b, const kvs_kv_pool *pool, const void *k, const void *v, const int32_t *slots,
                       int n) {
    size_t total = (size_t)n * 2 * pool->n_kv_heads * pool->head_dim;
    if (!total) return;
    unsigned g = kvs_cuda_blocks(total, 256);
    if (g > 65535u) g = 65535u;
    kvs_kv_write_kernel<<<g, 256, 0, kvs_cuda_of(b)->stream>>>((bf16 *)pool->data, (const bf16 *)k,
                                                                (const bf16 *)v, slots, n, pool->n_kv_heads,
                                                                pool->block_size, pool->head_dim);
    KVS_CUDA_LAUNCHED(b, "kvs_kv_write_kernel");
}

/* Compaction through a staging buffer, in pieces of type T (16 bytes when head_dim
 * % 8 == 0): phase 1 (SCATTER false) copies entry src[h * n + i] of head h into
 * staging[h][i][kind], phase 2 copies staging[h][i][kind] into entry i. Reading
 * everything before writing anything keeps it right when sources and
 * destinations overlap (compaction into the layer's leading blocks). Rows whose
 * source is their own entry (src == i: a kept prefix) move in neither phase. */
template <typename T, bool SCATTER>
__global__ void kvs_kv_gather_kernel(T *staging, bf16 *pool, const int32_t *blocks, const int32_t *src_entry, int n,
                                     int n_kv_heads, int block_size, int head_dim) {
    constexpr int PER = sizeof(T) / sizeof(bf16);
    const int pieces = head_dim / PER;
    size_t total = (size_t)n_kv_heads * n * 2 * pieces;
    for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < total; t += (size_t)gridDim.x * blockDim.x) {
        int c = (int)(t % pieces);
        size_t r = t / pieces;
        int kind = (int)(r & 1), i = (int)((r >> 1) % n), h = (int)((r >> 1) / n);
        int src = src_entry[(size_t)h * n + i];
        if (src == i) continue;
        if (SCATTER) {
            T *dst = (T *)(pool + kvs_kv_offset(blocks[i / block_size], kind, h, i % block_size, n_kv_heads,
                                                block_size, head_dim)) + c;
            *dst = staging[t];
        } else {
            staging[t] = ((const T *)(pool + kvs_kv_offset(blocks[src / block_size], kind, h, src % block_size,
                                                           n_kv_heads, block_size, head_dim)))[c];
        }
    }
}

template <typename T>
static void launch_kv_gather(kvs_backend *b, const kvs_kv_pool *pool, const int32_t *blocks,
                             const int32_t *src_entry, int n) {
    size_t total = (size_t)pool->n_kv_heads * n * 2 * (pool->head_dim / (sizeof(T) / sizeof(bf16)));
    T *staging = (T *)kvs_cuda_scratch(b, total * sizeof(T));
    if (!staging) return;
    unsigned g = kvs_cuda_blocks(total, 256);
    if (g > 65535u) g = 65535u;
    cudaStream_t s = kvs_cuda_of(b)->stream;
    bf16 *data = (bf16 *)pool->data;
    kvs_kv_gather_kernel<T, false><<<g, 256, 0, s>>>(staging, data, blocks, src_entry, n, pool->n_kv_heads,
                                                     pool->block_size, pool->head_dim);
    KVS_CUDA_LAUNCHED(b, "kvs_kv_gather_kernel (stage)");
    kvs_kv_gather_kernel<T, true><<<g, 256, 0, s>>>(staging, data, blocks, src_entry, n, pool->n_kv_heads,
                                                    pool->block_size, pool->head_dim);
    KVS_CUDA_LAUNCHED(b, "kvs_kv_gather_kernel (scatter)");
}

void kvs_cuda_kv_gather(kvs_backend *b, const kvs_kv_pool *pool, const int32_t *blocks, int n_blocks,
                        const int32_t *src_entry, int n) {
    if ((size_t)pool->n_kv_heads * n * pool->head_dim == 0) return;
    if (pool->head_dim % 8 == 0) launch_kv_gather<uint4>(b, pool, blocks, src_entry, n);
    else launch_kv_gather<bf16>(b, pool, blocks, src_entry, n);
}

/* ---- sparsity window capture: q rows (bf16) and lse rows (f32) ---------------- */

__global__ void kvs_window_capture_kernel(bf16 *win_q, float *win_lse, const bf16 *q, const float *lse,
                                          const int32_t *src_rows, const int32_t *dst_rows, int n_heads,
                                          int head_dim) {
    int i = blockIdx.x;
    size_t row = (size_t)n_heads * head_dim;
    if (dst_rows[i] < 0) return; /* not a window query (graph mode captures every row) */
    size_t s = (size_t)src_rows[i], d = (size_t)dst_rows[i];
    for (size_t j = threadIdx.x; j < row; j += blockDim.x) win_q[d * row + j] = q[s * row + j];
    for (int h = threadIdx.x; h < n_heads; h += blockDim.x) win_lse[d * n_heads + h] = lse[s * n_heads + h];
}

void kvs_cuda_window_capture(kvs_backend *b, void *win_q, float *win_lse, const void *q, const float *lse,
                             const int32_t *src_rows, const int32_t *dst_rows, int m, int n_heads, int head_dim) {
    if (m <= 0) return;
    kvs_window_capture_kernel<<<m, 256, 0, kvs_cuda_of(b)->stream>>>((bf16 *)win_q, win_lse, (const bf16 *)q, lse,
                                                                      src_rows, dst_rows, n_heads, head_dim);
    KVS_CUDA_LAUNCHED(b, "kvs_window_capture_kernel");
}
