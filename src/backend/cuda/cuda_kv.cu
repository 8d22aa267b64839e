/* The paged KV pool on the GPU: the KV write (bf16, or FP8 codes with the
 * layer's scales) and compaction's per-head gather (codes copied as they are,
 * 16-byte pieces where a row allows). */
#include "backend/cuda/cuda_internal.h"

/* One thread per (token, kind, head, element): pool slot <- k or v (bf16 as
 * is; FP8: the code of x / scale of its (kind, head)); negative slots skipped. */
template <typename T>
__global__ void kvs_kv_write_kernel(T *pool, const bf16 *k, const bf16 *v, const int32_t *slots, int n,
                                    int n_kv_heads, int block_size, int head_dim, const float *scales) {
    size_t row = (size_t)n_kv_heads * head_dim, total = (size_t)n * 2 * row;
    for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < total; t += (size_t)gridDim.x * blockDim.x) {
        int i = (int)(t / (2 * row));
        size_t r = t % (2 * row);
        int kind = (int)(r / row), h = (int)((r % row) / head_dim), e = (int)(r % head_dim);
        int slot = slots[i];
        if (slot < 0) continue; /* a padding row of a graph-bucketed batch: no KV */
        bf16 x = (kind ? v : k)[(size_t)i * row + (size_t)h * head_dim + e];
        T *dst = pool + kvs_kv_offset(slot / block_size, kind, h, slot % block_size, n_kv_heads, block_size, head_dim) + e;
        if constexpr (sizeof(T) == 1)
            *dst = kvs_kv_fp8_code(__bfloat162float(x), kvs_kv_scale(scales, kind, h, n_kv_heads));
        else
            *dst = x;
    }
}

void kvs_cuda_kv_write(kvs_backend *b, const kvs_kv_pool *pool, const void *k, const void *v, const int32_t *slots,
                       int n) {
    size_t total = (size_t)n * 2 * pool->n_kv_heads * pool->head_dim;
    if (!total) return;
    unsigned g = kvs_cuda_blocks(total, 256);
    if (g > 65535u) g = 65535u;
    cudaStream_t st = kvs_cuda_of(b)->stream;
    if (b->kv_dtype == KVS_F8_E4M3)
        kvs_kv_write_kernel<uint8_t><<<g, 256, 0, st>>>((uint8_t *)pool->data, (const bf16 *)k, (const bf16 *)v, slots, n,
                                                        pool->n_kv_heads, pool->block_size, pool->head_dim,
                                                        pool->scales);
    else
        kvs_kv_write_kernel<bf16><<<g, 256, 0, st>>>((bf16 *)pool->data, (const bf16 *)k, (const bf16 *)v, slots, n,
                                                     pool->n_kv_heads, pool->block_size, pool->head_dim, NULL);
    KVS_CUDA_LAUNCHED(b, "kvs_kv_write_kernel");
}

/* Compaction through a staging buffer, in pieces of type T (16 bytes when a
 * row's bytes allow; the pool's entries are esize bytes: codes are copied as
 * they are, any dtype): phase 1 (SCATTER false) copies entry src[h * n + i] of
 * head h of the table blocks into staging[h][i][kind], phase 2 copies
 * staging[h][i][kind] into entry i of the table dst. Reading everything before
 * writing anything keeps it right when sources and destinations overlap (in
 * place: dst == blocks, into the layer's leading blocks). In place, rows whose
 * source is their own entry (src == i: a kept prefix) move in neither phase. */
template <typename T, bool SCATTER>
__global__ void kvs_kv_gather_kernel(T *staging, unsigned char *pool, const int32_t *blocks, const int32_t *dst_blocks,
                                     const int32_t *src_entry, int n, int n_kv_heads, int block_size, int head_dim,
                                     int esize) {
    const int pieces = head_dim * esize / (int)sizeof(T);
    size_t total = (size_t)n_kv_heads * n * 2 * pieces;
    for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < total; t += (size_t)gridDim.x * blockDim.x) {
        int c = (int)(t % pieces);
        size_t r = t / pieces;
        int kind = (int)(r & 1), i = (int)((r >> 1) % n), h = (int)((r >> 1) / n);
        int src = src_entry[(size_t)h * n + i];
        if (src == i && dst_blocks == blocks) continue;
        if (SCATTER) {
            T *dst = (T *)(pool + esize * kvs_kv_offset(dst_blocks[i / block_size], kind, h, i % block_size, n_kv_heads,
                                                        block_size, head_dim)) + c;
            *dst = staging[t];
        } else {
            staging[t] = ((const T *)(pool + esize * kvs_kv_offset(blocks[src / block_size], kind, h,
                                                                   src % block_size, n_kv_heads, block_size,
                                                                   head_dim)))[c];
        }
    }
}

template <typename T>
static void launch_kv_gather(kvs_backend *b, const kvs_kv_pool *pool, const int32_t *blocks, const int32_t *dst,
                             const int32_t *src_entry, int n, int esize) {
    size_t total = (size_t)pool->n_kv_heads * n * 2 * (pool->head_dim * esize / sizeof(T));
    T *staging = (T *)kvs_cuda_scratch(b, total * sizeof(T));
    if (!staging) return;
    unsigned g = kvs_cuda_blocks(total, 256);
    if (g > 65535u) g = 65535u;
    cudaStream_t s = kvs_cuda_of(b)->stream;
    unsigned char *data = (unsigned char *)pool->data;
    kvs_kv_gather_kernel<T, false><<<g, 256, 0, s>>>(staging, data, blocks, dst, src_entry, n, pool->n_kv_heads,
                                                     pool->block_size, pool->head_dim, esize);
    KVS_CUDA_LAUNCHED(b, "kvs_kv_gather_kernel (stage)");
    kvs_kv_gather_kernel<T, true><<<g, 256, 0, s>>>(staging, data, blocks, dst, src_entry, n, pool->n_kv_heads,
                                                    pool->block_size, pool->head_dim, esize);
    KVS_CUDA_LAUNCHED(b, "kvs_kv_gather_kernel (scatter)");
}

void kvs_cuda_kv_gather(kvs_backend *b, const kvs_kv_pool *pool, const int32_t *blocks, int n_blocks,
                        const int32_t *dst, const int32_t *src_entry, int n) {
    if ((size_t)pool->n_kv_heads * n * pool->head_dim == 0) return;
    int esize = (int)kvs_dtype_size(b->kv_dtype), row = pool->head_dim * esize;
    if (row % 16 == 0) launch_kv_gather<uint4>(b, pool, blocks, dst, src_entry, n, esize);
    else if (row % 2 == 0) launch_kv_gather<uint16_t>(b, pool, blocks, dst, src_entry, n, esize);
    else launch_kv_gather<uint8_t>(b, pool, blocks, dst, src_entry, n, esize);
}
