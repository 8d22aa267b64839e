/* Row-wise CUDA ops: embedding, RMSNorm, add, bias, RoPE, SwiGLU, row gathers.
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

__global__ void kvs_scatter_i32_kernel(int32_t *dst, const int32_t *pairs, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        dst[pairs[2 * i]] = pairs[2 * i + 1];
}

void kvs_cuda_scatter_i32(kvs_backend *b, int32_t *dst, const int32_t *pairs, int n) {
    if (n <= 0) return;
    int grid = (n + 255) / 256;
    kvs_scatter_i32_kernel<<<grid < 1024 ? grid : 1024, 256, 0, kvs_cuda_of(b)->stream>>>(dst, pairs, n);
    KVS_CUDA_LAUNCHED(b, "kvs_scatter_i32_kernel");
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

/* Per-head RMSNorm in place: one warp per (row, piece) */
__global__ void kvs_head_rmsnorm_kernel(bf16 *x, const bf16 *w, int row_stride, int head_dim, float eps) {
    bf16 *p = x + (size_t)blockIdx.x * row_stride + (size_t)blockIdx.y * head_dim;
    float ss = 0.f;
    for (int j = threadIdx.x; j < head_dim; j += 32) {
        float v = __bfloat162float(p[j]);
        ss += v * v;
    }
    for (int k = 16; k > 0; k >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, k);
    float r = rsqrtf(ss / head_dim + eps);
    for (int j = threadIdx.x; j < head_dim; j += 32)
        p[j] = __float2bfloat16(__bfloat162float(p[j]) * r * __bfloat162float(w[j]));
}

void kvs_cuda_head_rmsnorm(kvs_backend *b, void *x, const void *w, int n, int row_stride, int n_pieces, int head_dim,
                           float eps) {
    if (n <= 0 || n_pieces <= 0) return;
    kvs_head_rmsnorm_kernel<<<dim3(n, n_pieces), 32, 0, kvs_cuda_of(b)->stream>>>((bf16 *)x, (const bf16 *)w,
                                                                                  row_stride, head_dim, eps);
    KVS_CUDA_LAUNCHED(b, "kvs_head_rmsnorm_kernel");
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

/* out[i, j] = silu(g) * u with g = gate_up[i, j], u = gate_up[i, dim + j] (kvs_silu_mul) */
__global__ void kvs_swiglu_kernel(bf16 *out, const bf16 *gate_up, int n, int dim) {
    size_t total = (size_t)n * dim;
    for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < total; t += (size_t)gridDim.x * blockDim.x) {
        size_t i = t / dim, j = t % dim;
        float g = __bfloat162float(gate_up[i * 2 * dim + j]), u = __bfloat162float(gate_up[i * 2 * dim + dim + j]);
        out[t] = __float2bfloat16(kvs_silu_mul(g, u));
    }
}

/* dim a multiple of 8: a thread takes 8 columns of a row, 16-byte loads and
 * stores (the scalar kernel's 2-byte accesses and 64-bit divisions reached
 * about half the copy rate at prefill sizes); the same math, the same bits. */
__global__ void kvs_swiglu8_kernel(bf16 *out, const bf16 *gate_up, int n, int dim) {
    const int per_row = dim / 8;
    const size_t total = (size_t)n * per_row;
    for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < total; t += (size_t)gridDim.x * blockDim.x) {
        size_t i = t / per_row, j = (t % per_row) * 8;
        uint4 gv = *(const uint4 *)(gate_up + i * 2 * dim + j), uv = *(const uint4 *)(gate_up + i * 2 * dim + dim + j);
        const bf16 *g = (const bf16 *)&gv, *u = (const bf16 *)&uv;
        uint4 ov;
        bf16 *o = (bf16 *)&ov;
#pragma unroll
        for (int k = 0; k < 8; k++) o[k] = __float2bfloat16(kvs_silu_mul(__bfloat162float(g[k]), __bfloat162float(u[k])));
        *(uint4 *)(out + i * dim + j) = ov;
    }
}

void kvs_cuda_swiglu(kvs_backend *b, void *out, const void *gate_up, int n, int dim) {
    size_t total = (size_t)n * dim;
    if (!total) return;
    cudaStream_t s = kvs_cuda_of(b)->stream;
    bool wide = dim % 8 == 0 && (uintptr_t)out % 16 == 0 && (uintptr_t)gate_up % 16 == 0;
    unsigned g = kvs_cuda_blocks(wide ? total / 8 : total, 256);
    if (g > 65535u) g = 65535u;
    if (wide) kvs_swiglu8_kernel<<<g, 256, 0, s>>>((bf16 *)out, (const bf16 *)gate_up, n, dim);
    else kvs_swiglu_kernel<<<g, 256, 0, s>>>((bf16 *)out, (const bf16 *)gate_up, n, dim);
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
