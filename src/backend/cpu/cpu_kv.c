/* The paged KV pool on the CPU: the KV write, reading entries as f32, and
 * compaction's per-head gather (codes copied as they are, any dtype). */
#include <string.h>

#include "backend/cpu/cpu_ops.h"

#define kv_at(...) kvs_cpu_kv_at(b, __VA_ARGS__)

/* d f32 values into an entry of the pool's dtype (bf16 / f16: round to nearest
 * even; FP8: the code of x / scale, rounded to nearest even, saturating) */
static void store_entry(kvs_dtype t, void *dst, const float *src, int d, float scale) {
    if (t == KVS_F32) {
        memcpy(dst, src, sizeof(float) * d);
        return;
    }
    if (t == KVS_F8_E4M3) {
        uint8_t *c = dst;
        for (int j = 0; j < d; j++) c[j] = kvs_f32_to_e4m3(src[j] / scale);
        return;
    }
    uint16_t *o = dst;
    for (int j = 0; j < d; j++) o[j] = t == KVS_BF16 ? kvs_f32_to_bf16(src[j]) : kvs_f32_to_f16(src[j]);
}

void kvs_cpu_kv_write(kvs_backend *b, const kvs_kv_pool *pool, const void *k, const void *v,
                      const int32_t *slots, int n) {
    const float *kk = k, *vv = v;
    size_t row = (size_t)pool->n_kv_heads * pool->head_dim;
    for (int i = 0; i < n; i++) {
        if (slots[i] < 0) continue; /* a padding row: no KV */
        int32_t block = slots[i] / pool->block_size, off = slots[i] % pool->block_size;
        for (int h = 0; h < pool->n_kv_heads; h++) {
            store_entry(b->kv_dtype, kv_at(pool, block, 0, h, off), kk + i * row + (size_t)h * pool->head_dim,
                        pool->head_dim, kvs_cpu_kv_scale(b, pool, 0, h));
            store_entry(b->kv_dtype, kv_at(pool, block, 1, h, off), vv + i * row + (size_t)h * pool->head_dim,
                        pool->head_dim, kvs_cpu_kv_scale(b, pool, 1, h));
        }
    }
}

void kvs_cpu_kv_rows_f32(const kvs_backend *b, const kvs_kv_pool *p, int32_t block, int kind, int head, int offset,
                         int rows, float *dst) {
    size_t n = (size_t)rows * p->head_dim;
    const void *src = kv_at(p, block, kind, head, offset);
    if (b->kv_dtype != KVS_F8_E4M3) {
        kvs_to_f32(dst, src, b->kv_dtype, n);
        return;
    }
    const uint8_t *c = src;
    float s = kvs_cpu_kv_scale(b, p, kind, head);
    for (size_t i = 0; i < n; i++) dst[i] = kvs_e4m3_values[c[i]] * s;
}

void kvs_cpu_kv_gather(kvs_backend *b, const kvs_kv_pool *pool, const int32_t *blocks, int n_blocks, const int32_t *dst,
                       const int32_t *src_entry, int n) {
    int bs = pool->block_size;
    size_t bytes = kvs_dtype_size(b->kv_dtype) * pool->head_dim;
    for (int h = 0; h < pool->n_kv_heads; h++) {
        const int32_t *src = src_entry + (size_t)h * n;
        for (int i = 0; i < n; i++) { /* src[i] >= i (sorted, distinct): in-place safe */
            if (src[i] == i && dst == blocks) continue;
            for (int kind = 0; kind < 2; kind++)
                memcpy(kv_at(pool, dst[i / bs], kind, h, i % bs),
                       kv_at(pool, blocks[src[i] / bs], kind, h, src[i] % bs), bytes);
        }
    }
}
