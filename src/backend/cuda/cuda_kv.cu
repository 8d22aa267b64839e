/* The paged KV pool on the GPU: the KV write and compaction's per-head gather
 * (bf16, 16-byte pieces where head_dim allows). */
#include "backend/cuda/cuda_internal.h"

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
 * % 8 == 0): phase 1 (SCATTER false) copies entry src[h * n + i] of head h of the
 * table blocks into staging[h][i][kind], phase 2 copies staging[h][i][kind] into
 * entry i of the table dst. Reading everything before writing anything keeps it
 * right when sources and destinations overlap (in place: dst == blocks, into the
 * layer's leading blocks). In place, rows whose source is their own entry
 * (src == i: a kept prefix) move in neither phase. */
template <typename T, bool SCATTER>
__global__ void kvs_kv_gather_kernel(T *staging, bf16 *pool, const int32_t *blocks, const int32_t *dst_blocks,
                                     const int32_t *src_entry, int n, int n_kv_heads, int block_size, int head_dim) {
    constexpr int PER = sizeof(T) / sizeof(bf16);
    const int pieces = head_dim / PER;
    size_t total = (size_t)n_kv_heads * n * 2 * pieces;
    for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < total; t += (size_t)gridDim.x * blockDim.x) {
        int c = (int)(t % pieces);
        size_t r = t / pieces;
        int kind = (int)(r & 1), i = (int)((r >> 1) % n), h = (int)((r >> 1) / n);
        int src = src_entry[(size_t)h * n + i];
        if (src == i && dst_blocks == blocks) continue;
        if (SCATTER) {
            T *dst = (T *)(pool + kvs_kv_offset(dst_blocks[i / block_size], kind, h, i % block_size, n_kv_heads,
                                                block_size, head_dim)) + c;
            *dst = staging[t];
        } else {
            staging[t] = ((const T *)(pool + kvs_kv_offset(blocks[src / block_size], kind, h, src % block_size,
                                                           n_kv_heads, block_size, head_dim)))[c];
        }
    }
}

template <typename T>
static void launch_kv_gather(kvs_backend *b, const kvs_kv_pool *pool, const int32_t *blocks, const int32_t *dst,
                             const int32_t *src_entry, int n) {
    size_t total = (size_t)pool->n_kv_heads * n * 2 * (pool->head_dim / (sizeof(T) / sizeof(bf16)));
    T *staging = (T *)kvs_cuda_scratch(b, total * sizeof(T));
    if (!staging) return;
    unsigned g = kvs_cuda_blocks(total, 256);
    if (g > 65535u) g = 65535u;
    cudaStream_t s = kvs_cuda_of(b)->stream;
    bf16 *data = (bf16 *)pool->data;
    kvs_kv_gather_kernel<T, false><<<g, 256, 0, s>>>(staging, data, blocks, dst, src_entry, n, pool->n_kv_heads,
                                                     pool->block_size, pool->head_dim);
    KVS_CUDA_LAUNCHED(b, "kvs_kv_gather_kernel (stage)");
    kvs_kv_gather_kernel<T, true><<<g, 256, 0, s>>>(staging, data, blocks, dst, src_entry, n, pool->n_kv_heads,
                                                    pool->block_size, pool->head_dim);
    KVS_CUDA_LAUNCHED(b, "kvs_kv_gather_kernel (scatter)");
}

void kvs_cuda_kv_gather(kvs_backend *b, const kvs_kv_pool *pool, const int32_t *blocks, int n_blocks,
                        const int32_t *dst, const int32_t *src_entry, int n) {
    if ((size_t)pool->n_kv_heads * n * pool->head_dim == 0) return;
    if (pool->head_dim % 8 == 0) launch_kv_gather<uint4>(b, pool, blocks, dst, src_entry, n);
    else launch_kv_gather<bf16>(b, pool, blocks, dst, src_entry, n);
}
