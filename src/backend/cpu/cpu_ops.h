/* CPU implementations of the backend ops (fp32, OpenMP, OpenBLAS). Internal to backend/. */
#ifndef KVS_CPU_OPS_H
#define KVS_CPU_OPS_H

#include <omp.h>

#include "backend/backend.h"

void kvs_cpu_embedding(kvs_backend *b, void *out, const void *table, const int32_t *ids, int n, int dim);
void kvs_cpu_rmsnorm(kvs_backend *b, void *out, const void *in, const void *w, int n, int dim, float eps);
void kvs_cpu_add(kvs_backend *b, void *x, const void *y, size_t n);
void kvs_cpu_matmul(kvs_backend *b, void *out, const void *in, const void *w, const void *bias, int n,
                    int in_dim, int out_dim);
void kvs_cpu_rope(kvs_backend *b, void *x, const int32_t *positions, const float *inv_freq, int n,
                  int n_heads, int head_dim);
void kvs_cpu_swiglu(kvs_backend *b, void *out, const void *gate_up, int n, int dim);
void kvs_cpu_gather_rows(kvs_backend *b, void *out, const void *in, const int32_t *idx, int m, int dim);
void kvs_cpu_kv_write(kvs_backend *b, const kvs_kv_pool *pool, const void *k, const void *v,
                      const int32_t *slots, int n);
void kvs_cpu_attention(kvs_backend *b, void *out, float *lse, const void *q, const kvs_kv_pool *pool,
                       const kvs_attn_batch *ab, int n_heads, float scale);
void kvs_cpu_kv_gather(kvs_backend *b, const kvs_kv_pool *pool, const int32_t *blocks, int n_blocks,
                       const int32_t *src_entry, int n);

#endif
