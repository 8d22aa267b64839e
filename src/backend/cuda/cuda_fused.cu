/* Fused forward-pass kernels: residual add + RMSNorm, RoPE + paged KV write, and
 * for fp8 activations add + RMSNorm or SwiGLU with the per-row quantize of their
 * output. Each one equals the unfused sequence of cuda_ops.cu, cuda_kv.cu and
 * cuda_fp8.cu (add then rmsnorm; rope on q and k then kv_write; add_rmsnorm or
 * swiglu, then quantize_fp8) up to the order of the fp32 sum of squares; the
 * CPU references are in cpu/cpu_fused.c. */
#include <stdint.h>

#include "backend/cuda/cuda_internal.h"

/* ---- residual add + RMSNorm: one block per row ---------------------------------
 * Pass 1 reads x and y once, stores x + y rounded to bf16 (as kvs_add_kernel
 * does) into x and into a shared-memory copy of the row, and sums the squares
 * of the rounded values in fp32 (so the norm sees the x that add + rmsnorm
 * would read); pass 2 writes xn from the shared copy. VEC: 16-byte pieces.
 * QUANT (add_rmsnorm_fp8): pass 2 writes xn over the shared copy instead and
 * takes its amax; pass 3 writes the codes of xn / scale as quantize_fp8 does
 * (the same xn bits as add_rmsnorm's with the same VEC: the same threads sum
 * the squares in the same order). */

union kvs_bf16x8 {
    uint4 u;
    __nv_bfloat162 h[4];
};

/* The row's scale (amax / 448, 1 for a row of zeros), as quantize_fp8's. */
__device__ __forceinline__ float kvs_fp8_row_scale(float amax) {
    float s = kvs_block_max(amax) / KVS_E4M3_MAX;
    return s > 0.f ? s : 1.f;
}

/* The codes of the bf16 row in shared memory (dim of them) over s, as quantize_fp8 writes them. */
template <bool VEC>
__device__ __forceinline__ void kvs_fp8_row_codes(uint8_t *q, const bf16 *row, int dim, float s) {
    if (VEC) {
        for (int j = threadIdx.x; j < dim / 8; j += blockDim.x) {
            kvs_bf16x8 a;
            a.u = ((const uint4 *)row)[j];
            uint8_t c[8];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float2 f = __bfloat1622float2(a.h[e]);
                c[2 * e] = kvs_kv_fp8_code(f.x, s), c[2 * e + 1] = kvs_kv_fp8_code(f.y, s);
            }
            ((uint2 *)q)[j] = *(const uint2 *)c;
        }
    } else {
        for (int j = threadIdx.x; j < dim; j += blockDim.x) q[j] = kvs_kv_fp8_code(__bfloat162float(row[j]), s);
    }
}

template <bool VEC, bool QUANT>
__global__ void kvs_add_rmsnorm_kernel(bf16 *x, bf16 *xn, uint8_t *q, float *qscale, const bf16 *y, const bf16 *w,
                                       int dim, float eps) {
    extern __shared__ uint4 kvs_add_rmsnorm_row[]; /* dim bf16 */
    bf16 *row = (bf16 *)kvs_add_rmsnorm_row;
    size_t base = (size_t)blockIdx.x * dim;
    float ss = 0.f, amax = 0.f;
    if (VEC) {
        uint4 *xv = (uint4 *)(x + base), *rv = (uint4 *)row;
        const uint4 *yv = (const uint4 *)(y + base);
        for (int j = threadIdx.x; j < dim / 8; j += blockDim.x) {
            kvs_bf16x8 a, c;
            a.u = xv[j], c.u = yv[j];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float2 fa = __bfloat1622float2(a.h[e]), fc = __bfloat1622float2(c.h[e]);
                a.h[e] = __floats2bfloat162_rn(fa.x + fc.x, fa.y + fc.y);
                float2 s = __bfloat1622float2(a.h[e]);
                ss += s.x * s.x;
                ss += s.y * s.y;
            }
            xv[j] = a.u;
            rv[j] = a.u;
        }
    } else {
        for (int j = threadIdx.x; j < dim; j += blockDim.x) {
            bf16 s = __float2bfloat16(__bfloat162float(x[base + j]) + __bfloat162float(y[base + j]));
            float f = __bfloat162float(s);
            ss += f * f;
            x[base + j] = s;
            row[j] = s;
        }
    }
    float r = rsqrtf(kvs_block_sum(ss) / dim + eps); /* its barrier also publishes the shared row */
    if (VEC) {
        uint4 *rv = (uint4 *)row;
        const uint4 *wv = (const uint4 *)w;
        uint4 *ov = QUANT ? rv : (uint4 *)(xn + base); /* QUANT: each thread over its own pieces */
        for (int j = threadIdx.x; j < dim / 8; j += blockDim.x) {
            kvs_bf16x8 a, g;
            a.u = rv[j], g.u = wv[j];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float2 fa = __bfloat1622float2(a.h[e]), fg = __bfloat1622float2(g.h[e]);
                a.h[e] = __floats2bfloat162_rn(fa.x * r * fg.x, fa.y * r * fg.y);
                float2 o = __bfloat1622float2(a.h[e]);
                amax = fmaxf(amax, fmaxf(fabsf(o.x), fabsf(o.y)));
            }
            ov[j] = a.u;
        }
    } else {
        bf16 *out = QUANT ? row : xn + base;
        for (int j = threadIdx.x; j < dim; j += blockDim.x) {
            bf16 o = __float2bfloat16(__bfloat162float(row[j]) * r * __bfloat162float(w[j]));
            amax = fmaxf(amax, fabsf(__bfloat162float(o)));
            out[j] = o;
        }
    }
    if (QUANT) {
        float s = kvs_fp8_row_scale(amax); /* its barriers publish xn in the shared row */
        if (threadIdx.x == 0) qscale[blockIdx.x] = s;
        kvs_fp8_row_codes<VEC>(q + base, row, dim, s);
    }
}

static bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

/* add_rmsnorm (q NULL) or add_rmsnorm_fp8 (xn NULL). The path (and the block
 * shape, so the order of the sum of squares) depends on dim and the alignment
 * of the pointers: with xn 16-byte and q 8-byte aligned both ops take the same
 * one, so the codes are quantize_fp8's of add_rmsnorm's xn, bit for bit. */
static void add_rmsnorm(kvs_backend *b, void *x, void *xn, uint8_t *q, float *qscale, const void *y, const void *w,
                        int n, int dim, float eps) {
    if (n <= 0 || dim <= 0) return;
    bool out_ok = q ? ((uintptr_t)q & 7) == 0 : aligned16(xn);
    bool vec = dim % 8 == 0 && aligned16(x) && aligned16(y) && aligned16(w) && out_ok;
    size_t smem = (size_t)dim * sizeof(bf16);
    /* a thread per 16-byte piece up to 1024 threads (whole warps); 256 for the scalar path */
    int units = vec ? dim / 8 : 256;
    int threads = units >= 1024 ? 1024 : (units + 31) / 32 * 32;
    if (threads < 64) threads = 64;
    void (*kernel)(bf16 *, bf16 *, uint8_t *, float *, const bf16 *, const bf16 *, int, float) =
        q ? (vec ? kvs_add_rmsnorm_kernel<true, true> : kvs_add_rmsnorm_kernel<false, true>)
          : (vec ? kvs_add_rmsnorm_kernel<true, false> : kvs_add_rmsnorm_kernel<false, false>);
    if (smem > 48 * 1024) /* rows over 24576 elements: opt in to more shared memory */
        KVS_CUDA_CHECK(b, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    kernel<<<n, threads, smem, kvs_cuda_of(b)->stream>>>((bf16 *)x, (bf16 *)xn, q, qscale, (const bf16 *)y,
                                                          (const bf16 *)w, dim, eps);
    KVS_CUDA_LAUNCHED(b, "kvs_add_rmsnorm_kernel");
}

void kvs_cuda_add_rmsnorm(kvs_backend *b, void *x, void *xn, const void *y, const void *w, int n, int dim,
                          float eps) {
    add_rmsnorm(b, x, xn, NULL, NULL, y, w, n, dim, eps);
}

void kvs_cuda_add_rmsnorm_fp8(kvs_backend *b, void *x, uint8_t *q, float *scale, const void *y, const void *w, int n,
                              int dim, float eps) {
    add_rmsnorm(b, x, NULL, q, scale, y, w, n, dim, eps);
}

/* ---- SwiGLU + the fp8 quantize of its output: one block per row ---------------
 * Pass 1 stores silu(g) * u rounded to bf16 (as the swiglu kernels do) into a
 * shared-memory row and takes its amax; pass 2 writes the codes as
 * quantize_fp8 does. VEC: 16-byte loads (the values do not depend on it). */
template <bool VEC>
__global__ void kvs_swiglu_fp8_kernel(uint8_t *q, float *qscale, const bf16 *gate_up, int dim) {
    extern __shared__ uint4 kvs_swiglu_row[]; /* dim bf16 */
    bf16 *row = (bf16 *)kvs_swiglu_row;
    const bf16 *g = gate_up + (size_t)blockIdx.x * 2 * dim, *u = g + dim;
    float amax = 0.f;
    if (VEC) {
        for (int j = threadIdx.x; j < dim / 8; j += blockDim.x) {
            kvs_bf16x8 a, c, o;
            a.u = ((const uint4 *)g)[j], c.u = ((const uint4 *)u)[j];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float2 fa = __bfloat1622float2(a.h[e]), fc = __bfloat1622float2(c.h[e]);
                o.h[e] = __halves2bfloat162(__float2bfloat16(kvs_silu_mul(fa.x, fc.x)),
                                            __float2bfloat16(kvs_silu_mul(fa.y, fc.y)));
                float2 f = __bfloat1622float2(o.h[e]);
                amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
            }
            ((uint4 *)row)[j] = o.u;
        }
    } else {
        for (int j = threadIdx.x; j < dim; j += blockDim.x) {
            bf16 o = __float2bfloat16(kvs_silu_mul(__bfloat162float(g[j]), __bfloat162float(u[j])));
            amax = fmaxf(amax, fabsf(__bfloat162float(o)));
            row[j] = o;
        }
    }
    float s = kvs_fp8_row_scale(amax); /* its barriers publish the row */
    if (threadIdx.x == 0) qscale[blockIdx.x] = s;
    kvs_fp8_row_codes<VEC>(q + (size_t)blockIdx.x * dim, row, dim, s);
}

void kvs_cuda_swiglu_fp8(kvs_backend *b, uint8_t *q, float *scale, const void *gate_up, int n, int dim) {
    if (n <= 0 || dim <= 0) return;
    bool vec = dim % 8 == 0 && aligned16(gate_up) && ((uintptr_t)q & 7) == 0;
    size_t smem = (size_t)dim * sizeof(bf16);
    int units = vec ? dim / 8 : 256;
    int threads = units >= 1024 ? 1024 : (units + 31) / 32 * 32;
    if (threads < 64) threads = 64;
    void (*kernel)(uint8_t *, float *, const bf16 *, int) =
        vec ? kvs_swiglu_fp8_kernel<true> : kvs_swiglu_fp8_kernel<false>;
    if (smem > 48 * 1024)
        KVS_CUDA_CHECK(b, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    kernel<<<n, threads, smem, kvs_cuda_of(b)->stream>>>(q, scale, (const bf16 *)gate_up, dim);
    KVS_CUDA_LAUNCHED(b, "kvs_swiglu_fp8_kernel");
}

/* ---- RoPE + paged KV write: one block per token --------------------------------
 * The token's cos/sin table (angle and sincos in double, like kvs_rope_kernel)
 * goes to shared memory once; then the block rotates the q heads of its qkv
 * row into q and its k heads straight into the pool slot, and copies v into
 * the slot. A negative slot (a padding row) rotates q only. VEC (head_dim % 8 == 0): pairs
 * (j, j + 1) rotated as bf16x2, v copied in 16-byte pieces. T: the pool's
 * entries, bf16 or FP8 codes (uint8_t: K's rotated f32 value and V's value
 * each divided by its (kind, head) scale and rounded once, kvs_kv_fp8_code). */

/* Stores two rotated values at dst[0], dst[1] of a bf16 or FP8 row. */
__device__ __forceinline__ void kvs_store2(bf16 *dst, float a, float b, float) {
    *(__nv_bfloat162 *)dst = __floats2bfloat162_rn(a, b);
}
__device__ __forceinline__ void kvs_store2(uint8_t *dst, float a, float b, float s) {
    dst[0] = kvs_kv_fp8_code(a, s), dst[1] = kvs_kv_fp8_code(b, s);
}
__device__ __forceinline__ void kvs_store1(bf16 *dst, float a, float) { *dst = __float2bfloat16(a); }
__device__ __forceinline__ void kvs_store1(uint8_t *dst, float a, float s) { *dst = kvs_kv_fp8_code(a, s); }

template <bool VEC, typename T>
__global__ void kvs_rope_kv_write_kernel(T *pool, bf16 *q, const bf16 *qkv, const int32_t *positions,
                                         const float *inv_freq, const int32_t *slots, int n_heads, int n_kv_heads,
                                         int block_size, int head_dim, const float *scales) {
    extern __shared__ float2 kvs_rope_cs[]; /* [head_dim / 2] (cos, sin) */
    int i = blockIdx.x, half = head_dim / 2;
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
        double s, c;
        sincos((double)positions[i] * inv_freq[j], &s, &c);
        kvs_rope_cs[j] = make_float2((float)c, (float)s);
    }
    __syncthreads();
    size_t ld = (size_t)(n_heads + 2 * n_kv_heads) * head_dim;
    const bf16 *k = qkv + i * ld + (size_t)n_heads * head_dim, *vrow = k + (size_t)n_kv_heads * head_dim;
    int slot = slots[i];
    int blk = slot >= 0 ? slot / block_size : 0, off = slot >= 0 ? slot % block_size : 0;
    int rows = n_heads + (slot >= 0 ? n_kv_heads : 0); /* q heads, then k heads */
    int step = VEC ? 2 : 1, per_row = half / step;
    for (int t = threadIdx.x; t < rows * per_row; t += blockDim.x) {
        int h = t / per_row, j = (t % per_row) * step;
        const bf16 *src;
        if (h < n_heads) { /* q, bf16 */
            bf16 *dst = q + ((size_t)i * n_heads + h) * head_dim;
            src = qkv + i * ld + (size_t)h * head_dim;
            if (VEC) {
                float2 c0 = kvs_rope_cs[j], c1 = kvs_rope_cs[j + 1];
                float2 x1 = __bfloat1622float2(*(const __nv_bfloat162 *)(src + j));
                float2 x2 = __bfloat1622float2(*(const __nv_bfloat162 *)(src + j + half));
                kvs_store2(dst + j, x1.x * c0.x - x2.x * c0.y, x1.y * c1.x - x2.y * c1.y, 1.f);
                kvs_store2(dst + j + half, x2.x * c0.x + x1.x * c0.y, x2.y * c1.x + x1.y * c1.y, 1.f);
            } else {
                float2 cs = kvs_rope_cs[j];
                float x1 = __bfloat162float(src[j]), x2 = __bfloat162float(src[j + half]);
                kvs_store1(dst + j, x1 * cs.x - x2 * cs.y, 1.f);
                kvs_store1(dst + j + half, x2 * cs.x + x1 * cs.y, 1.f);
            }
            continue;
        }
        h -= n_heads;
        src = k + (size_t)h * head_dim;
        T *dst = pool + kvs_kv_offset(blk, 0, h, off, n_kv_heads, block_size, head_dim);
        float ks = kvs_kv_scale(scales, 0, h, n_kv_heads);
        if (VEC) {
            float2 c0 = kvs_rope_cs[j], c1 = kvs_rope_cs[j + 1];
            float2 x1 = __bfloat1622float2(*(const __nv_bfloat162 *)(src + j));
            float2 x2 = __bfloat1622float2(*(const __nv_bfloat162 *)(src + j + half));
            kvs_store2(dst + j, x1.x * c0.x - x2.x * c0.y, x1.y * c1.x - x2.y * c1.y, ks);
            kvs_store2(dst + j + half, x2.x * c0.x + x1.x * c0.y, x2.y * c1.x + x1.y * c1.y, ks);
        } else {
            float2 cs = kvs_rope_cs[j];
            float x1 = __bfloat162float(src[j]), x2 = __bfloat162float(src[j + half]);
            kvs_store1(dst + j, x1 * cs.x - x2 * cs.y, ks);
            kvs_store1(dst + j + half, x2 * cs.x + x1 * cs.y, ks);
        }
    }
    if (slot < 0) return;
    if (!VEC && (head_dim & 1)) /* an odd head_dim's last element is not rotated (as kvs_rope_kernel) */
        for (int h = threadIdx.x; h < n_kv_heads; h += blockDim.x)
            kvs_store1(pool + kvs_kv_offset(blk, 0, h, off, n_kv_heads, block_size, head_dim) + head_dim - 1,
                       __bfloat162float(k[(size_t)h * head_dim + head_dim - 1]),
                       kvs_kv_scale(scales, 0, h, n_kv_heads));
    int piece = VEC ? 8 : 1, per_head = head_dim / piece;
    for (int t = threadIdx.x; t < n_kv_heads * per_head; t += blockDim.x) {
        int h = t / per_head, e = (t % per_head) * piece;
        T *dst = pool + kvs_kv_offset(blk, 1, h, off, n_kv_heads, block_size, head_dim) + e;
        const bf16 *src = vrow + (size_t)h * head_dim + e;
        if constexpr (sizeof(T) == 1) {
            float vs = kvs_kv_scale(scales, 1, h, n_kv_heads);
            if (VEC) { /* 8 values -> 8 codes, one 8-byte store */
                uint4 raw = *(const uint4 *)src;
                const __nv_bfloat162 *x2 = (const __nv_bfloat162 *)&raw;
                uint8_t c[8];
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    float2 f = __bfloat1622float2(x2[u]);
                    c[2 * u] = kvs_kv_fp8_code(f.x, vs), c[2 * u + 1] = kvs_kv_fp8_code(f.y, vs);
                }
                *(uint2 *)dst = *(const uint2 *)c;
            } else {
                *dst = kvs_kv_fp8_code(__bfloat162float(*src), vs);
            }
        } else if (VEC) {
            *(uint4 *)dst = *(const uint4 *)src;
        } else {
            *dst = *src;
        }
    }
}

template <typename T>
static void launch_rope_kv_write(kvs_backend *b, const kvs_kv_pool *pool, void *q, const void *qkv,
                                 const int32_t *positions, const float *inv_freq, const int32_t *slots, int n,
                                 int n_heads, bool vec) {
    int D = pool->head_dim;
    size_t smem = sizeof(float2) * (size_t)(D / 2);
    void (*kernel)(T *, bf16 *, const bf16 *, const int32_t *, const float *, const int32_t *, int, int, int, int,
                   const float *) = vec ? kvs_rope_kv_write_kernel<true, T> : kvs_rope_kv_write_kernel<false, T>;
    kernel<<<n, 256, smem, kvs_cuda_of(b)->stream>>>((T *)pool->data, (bf16 *)q, (const bf16 *)qkv, positions,
                                                     inv_freq, slots, n_heads, pool->n_kv_heads, pool->block_size, D,
                                                     pool->scales);
    KVS_CUDA_LAUNCHED(b, "kvs_rope_kv_write_kernel");
}

void kvs_cuda_rope_kv_write(kvs_backend *b, const kvs_kv_pool *pool, void *q, const void *qkv,
                            const int32_t *positions, const float *inv_freq, const int32_t *slots, int n,
                            int n_heads) {
    int D = pool->head_dim;
    if (n <= 0 || D < 2) return;
    bool vec = D % 8 == 0 && aligned16(pool->data) && aligned16(q) && aligned16(qkv);
    if (b->kv_dtype == KVS_F8_E4M3)
        launch_rope_kv_write<uint8_t>(b, pool, q, qkv, positions, inv_freq, slots, n, n_heads, vec);
    else
        launch_rope_kv_write<bf16>(b, pool, q, qkv, positions, inv_freq, slots, n, n_heads, vec);
}
