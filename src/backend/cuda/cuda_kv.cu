/* The paged KV pool on the GPU: the KV write (bf16, or FP8 codes with the
 * layer's scales) and compaction's per-head gather (codes copied as they are,
 * 16-byte pieces where a row allows; one job or a batch's list). */
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

#define KVS_GATHER_THREADS 256
#define KVS_GATHER_PIECES 8 /* pieces a thread holds per round */

/* Compaction's copies, a block per (job, KV head, kind): entry i of the
 * destination table gets entry src[i] of the job's table, src the head's keep
 * list (ascending, distinct, src[i] >= i), in pieces of type T (16 bytes when a
 * row's bytes allow; entries of esize bytes: codes are copied as they are, any
 * dtype). In place (dst NULL: the job's own table) the block walks the list in
 * rounds of THREADS x PIECES pieces, every read of a round before any of its
 * writes: a round writes only the entries it covers, and later rounds read
 * only sources above them (src[i] >= i, distinct; an entry that is its own
 * source does not move: a kept prefix stays put), so nothing is overwritten
 * before it is read, with no staging buffer. Into another table (a compacted
 * copy of a shared prompt) nothing overlaps. */
template <typename T>
__global__ void __launch_bounds__(KVS_GATHER_THREADS)
    kvs_kv_gather_kernel(unsigned char *pool, kvs_snapkv_job one, const kvs_snapkv_job *jobs, const int32_t *tables,
                         const int32_t *dst_table, const int32_t *keep, int n_kv_heads, int block_size, int head_dim,
                         int esize) {
    const kvs_snapkv_job job = kvs_job(jobs, one, blockIdx.y);
    const int h = blockIdx.x >> 1, kind = blockIdx.x & 1, n = job.k + job.n_win;
    const int pieces = head_dim * esize / (int)sizeof(T);
    const int32_t *blocks = tables + job.table, *src = keep + job.keep + (size_t)h * n;
    /* the destination: the job's copy table, else the call's, else its own (in place) */
    const int32_t *dst = job.dst_blocks > 0 ? tables + job.dst_table : dst_table ? dst_table : blocks;
    const bool in_place = dst == blocks;
    const size_t total = (size_t)n * pieces;
    for (size_t round = 0; round < total; round += KVS_GATHER_THREADS * KVS_GATHER_PIECES) {
        T piece[KVS_GATHER_PIECES];
#pragma unroll
        for (int r = 0; r < KVS_GATHER_PIECES; r++) {
            size_t t = round + (size_t)r * KVS_GATHER_THREADS + threadIdx.x;
            if (t >= total) continue;
            int i = (int)(t / pieces), c = (int)(t % pieces), e = src[i];
            if (e == i && in_place) continue;
            piece[r] = ((const T *)(pool + esize * kvs_kv_offset(blocks[e / block_size], kind, h, e % block_size,
                                                                 n_kv_heads, block_size, head_dim)))[c];
        }
        __syncthreads(); /* the round's reads before its writes */
#pragma unroll
        for (int r = 0; r < KVS_GATHER_PIECES; r++) {
            size_t t = round + (size_t)r * KVS_GATHER_THREADS + threadIdx.x;
            if (t >= total) continue;
            int i = (int)(t / pieces), c = (int)(t % pieces);
            if (src[i] == i && in_place) continue;
            ((T *)(pool + esize * kvs_kv_offset(dst[i / block_size], kind, h, i % block_size, n_kv_heads, block_size,
                                                head_dim)))[c] = piece[r];
        }
    }
}

template <typename T>
static void launch_kv_gather(kvs_backend *b, const kvs_kv_pool *pool, const kvs_snapkv_job &one,
                             const kvs_snapkv_job *jobs, int n_jobs, const int32_t *tables, const int32_t *dst,
                             const int32_t *keep, int esize) {
    for (int j0 = 0; j0 < n_jobs; j0 += KVS_CUDA_MAX_JOBS) {
        dim3 grid(2 * pool->n_kv_heads, n_jobs - j0 < KVS_CUDA_MAX_JOBS ? n_jobs - j0 : KVS_CUDA_MAX_JOBS);
        kvs_kv_gather_kernel<T><<<grid, KVS_GATHER_THREADS, 0, kvs_cuda_of(b)->stream>>>(
            (unsigned char *)pool->data, one, jobs ? jobs + j0 : NULL, tables, dst, keep, pool->n_kv_heads,
            pool->block_size, pool->head_dim, esize);
        KVS_CUDA_LAUNCHED(b, "kvs_kv_gather_kernel");
    }
}

void kvs_cuda_kv_gather_jobs(kvs_backend *b, const kvs_kv_pool *pool, const kvs_snapkv_job &one,
                             const kvs_snapkv_job *jobs, int n_jobs, const int32_t *tables, const int32_t *dst,
                             const int32_t *keep) {
    if (n_jobs <= 0 || pool->n_kv_heads <= 0 || pool->head_dim <= 0) return;
    int esize = (int)kvs_dtype_size(b->kv_dtype), row = pool->head_dim * esize;
    if (row % 16 == 0) launch_kv_gather<uint4>(b, pool, one, jobs, n_jobs, tables, dst, keep, esize);
    else if (row % 2 == 0) launch_kv_gather<uint16_t>(b, pool, one, jobs, n_jobs, tables, dst, keep, esize);
    else launch_kv_gather<uint8_t>(b, pool, one, jobs, n_jobs, tables, dst, keep, esize);
}

void kvs_cuda_kv_gather(kvs_backend *b, const kvs_kv_pool *pool, const int32_t *blocks, int n_blocks,
                        const int32_t *dst, const int32_t *src_entry, int n) {
    if (n <= 0) return;
    kvs_snapkv_job one = {};
    one.k = n; /* one job: its n entries as k, no window */
    kvs_cuda_kv_gather_jobs(b, pool, one, NULL, 1, blocks, dst == blocks ? NULL : dst, src_entry);
}
