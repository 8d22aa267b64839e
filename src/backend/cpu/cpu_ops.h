/* CPU implementations of the backend ops (fp32, OpenMP, OpenBLAS). Internal to backend/. */
#ifndef KVS_CPU_OPS_H
#define KVS_CPU_OPS_H

#include <omp.h>

#include "backend/backend.h"
#include "backend/cpu/cpu_pool.h"
#include "backend/cpu/cpu_simd.h"

/* Records the first failure of an op on b (its check reports it from then on)
 * and sets it as the calling thread's error too. Safe from OpenMP threads. */
void kvs_cpu_fail(kvs_backend *b, kvs_status code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* The backend's kernel set (cpu_simd.h). */
const kvs_cpu_kernels *kvs_cpu_kernels_of(kvs_backend *b);
/* The backend's thread pool (cpu_pool.h), as many threads as its OpenMP teams. */
kvs_cpu_pool *kvs_cpu_pool_of(kvs_backend *b);
/* The ops' grow-only scratch, at least bytes long (64-byte aligned), valid
 * until the next call; NULL (failure recorded) when out of memory. For one op
 * at a time, called outside parallel regions. */
void *kvs_cpu_scratch(kvs_backend *b, size_t bytes);
/* cos then sin of positions[i] * inv_freq[k] for k < half, [n][2][half] ((float) of
 * the double angle's cos and sin): made again only when the positions or the
 * frequencies differ from the last call's, so a step's layers (and q and k) share
 * one. Valid until the next call; NULL (failure recorded) when out of memory. */
const float *kvs_cpu_rope_table(kvs_backend *b, const int32_t *positions, const float *inv_freq, int n, int half);
/* Memory (cpu_memory.c) for the large buffers (weights, KV pool, step buffers,
 * scratch): 2 MiB aligned on transparent huge pages from 2 MiB up; free(). */
void *kvs_cpu_alloc_huge(size_t bytes);
/* The same, and from 2 MiB up faulted in at once (free()). */
void *kvs_cpu_alloc_resident(size_t bytes);
/* Output columns [c0, c1) of thread t of nt: multiples of 16 (whole cache lines). */
static inline void kvs_cpu_thread_cols(int out_dim, int nt, int t, int *c0, int *c1) {
    int per = (out_dim + nt - 1) / nt;
    per = (per + 15) / 16 * 16;
    *c0 = t * per < out_dim ? t * per : out_dim;
    *c1 = *c0 + per > out_dim ? out_dim : *c0 + per;
}
/* n weights of the backend's weight dtype as f32: w itself when weights are
 * f32, else converted into buf (n floats). */
const float *kvs_cpu_weights_f32(kvs_backend *b, const void *w, size_t n, float *buf);

/* Prefill's matmul (cpu_matmul.c): out[i * ld_out + c] = x_i . w_c (+ beta * out,
 * beta 0 or 1: 1 when out holds the bias) for i < n, c < out_dim, through
 * OpenBLAS sgemm; w's rows are f32 (widen NULL) or widened by widen(dst, w, row,
 * in_dim, ctx) a panel of kvs_cpu_panel_rows(in_dim) rows at a time into panel
 * (that many rows of in_dim floats). Call outside parallel regions. */
typedef void (*kvs_cpu_widen_fn)(float *dst, const void *w, int row, int in_dim, const void *ctx);
int kvs_cpu_panel_rows(int in_dim);
void kvs_cpu_sgemm_panels(float *out, int ld_out, const float *x, int n, int in_dim, int out_dim, float beta,
                          const void *w, kvs_cpu_widen_fn widen, const void *ctx, float *panel);

void kvs_cpu_embedding(kvs_backend *b, void *out, const void *table, const int32_t *ids, int n, int dim);
void kvs_cpu_rmsnorm(kvs_backend *b, void *out, const void *in, const void *w, int n, int dim, float eps);
void kvs_cpu_head_rmsnorm(kvs_backend *b, void *x, const void *w, int n, int row_stride, int n_pieces, int head_dim,
                          float eps);
void kvs_cpu_add(kvs_backend *b, void *x, const void *y, size_t n);
void kvs_cpu_add_rmsnorm(kvs_backend *b, void *x, void *xn, const void *y, const void *w, int n, int dim,
                         float eps);
void kvs_cpu_matmul(kvs_backend *b, void *out, const void *in, const void *w, const void *bias, int n,
                    int in_dim, int out_dim);
void kvs_cpu_matmul_q(kvs_backend *b, void *out, int ld_out, const void *in, const void *w, uint32_t type,
                      const void *bias, int n, int in_dim, int out_dim);
void kvs_cpu_embedding_q(kvs_backend *b, void *out, const void *table, uint32_t type, const int32_t *ids, int n,
                         int dim);
void kvs_cpu_rope(kvs_backend *b, void *x, const int32_t *positions, const float *inv_freq, int n,
                  int n_heads, int head_dim);
void kvs_cpu_swiglu(kvs_backend *b, void *out, const void *gate_up, int n, int dim);
void kvs_cpu_gather_rows(kvs_backend *b, void *out, const void *in, const int32_t *idx, int m, int dim);
void kvs_cpu_kv_write(kvs_backend *b, const kvs_kv_pool *pool, const void *k, const void *v,
                      const int32_t *slots, int n);
void kvs_cpu_rope_kv_write(kvs_backend *b, const kvs_kv_pool *pool, void *q, const void *qkv,
                           const int32_t *positions, const float *inv_freq, const int32_t *slots, int n,
                           int n_heads);
void kvs_cpu_attention(kvs_backend *b, void *out, float *lse, const void *q, const kvs_kv_pool *pool,
                       const kvs_attn_batch *ab, int n_heads, float scale);
void kvs_cpu_kv_gather(kvs_backend *b, const kvs_kv_pool *pool, const int32_t *blocks, int n_blocks, const int32_t *dst,
                       const int32_t *src_entry, int n);

void kvs_cpu_window_capture(kvs_backend *b, void *win_q, float *win_lse, const void *q, const float *lse,
                            const int32_t *src_rows, const int32_t *dst_rows, int m, int n_heads, int head_dim);
void kvs_cpu_sparsity_scores(kvs_backend *b, float *scores, const void *win_q, const float *win_lse, int n_win,
                             const kvs_kv_pool *pool, const int32_t *table, int n_keys, int n_heads, float scale);
void kvs_cpu_sample(kvs_backend *b, int32_t *ids, float *logprobs, const void *logits, int n_rows, int ld, int vocab,
                    const struct kvs_sample_row *params);
void kvs_cpu_process_logits(kvs_backend *b, void *out, int ld_out, const void *logits, int ld, int n_rows, int vocab,
                            const struct kvs_process_row *rows, const struct kvs_logit_adjust *adjust,
                            const uint32_t *masks);
void kvs_cpu_top_logprobs(kvs_backend *b, float *chosen_lp, int32_t *top_ids, float *top_lp, const void *logits,
                          int n_rows, int ld, int vocab, const int32_t *chosen, int k);
void kvs_cpu_sample_shard(kvs_backend *b, struct kvs_sample_part *parts, const void *logits, int n_rows, int ld,
                          int count, int id0, const struct kvs_sample_row *params);
void kvs_cpu_dummy_fill(kvs_backend *b, void *dst, uint64_t seed, float scale, kvs_dtype src_dtype, int64_t full_cols,
                        int64_t r0, int64_t nr, int64_t c0, int64_t nc);
void kvs_cpu_snapkv_select(kvs_backend *b, int32_t *keep, const float *scores, int n_keys, int n_kv_heads, int pool,
                           int k, int n_win);
void kvs_cpu_snapkv_compact_batch(kvs_backend *b, const kvs_kv_pool *pool, const kvs_snapkv_batch *batch);
void kvs_cpu_quantize_fp8(kvs_backend *b, uint8_t *q, float *scale, const void *x, kvs_dtype x_dtype, int rows,
                          int cols);
void kvs_cpu_add_rmsnorm_fp8(kvs_backend *b, void *x, uint8_t *q, float *scale, const void *y, const void *w, int n,
                             int dim, float eps);
void kvs_cpu_swiglu_fp8(kvs_backend *b, uint8_t *q, float *scale, const void *gate_up, int n, int dim);
void kvs_cpu_matmul_fp8(kvs_backend *b, void *out, const uint8_t *xq, const float *xs, const uint8_t *wq,
                        const float *ws, const void *bias, int n, int in_dim, int out_dim);
enum { KVS_CPU_MAX_HEAD_DIM = 1024 };

/* K (kind 0) or V (kind 1) vector of (block, head, offset) in a pool of
 * b->kv_dtype entries (F32, BF16, F16 or F8_E4M3). */
static inline void *kvs_cpu_kv_at(const kvs_backend *b, const kvs_kv_pool *p, int32_t block, int kind, int head,
                                  int offset) {
    size_t per_head = (size_t)p->block_size * p->head_dim;
    size_t per_block = 2 * (size_t)p->n_kv_heads * per_head;
    return (char *)p->data + ((size_t)block * per_block + ((size_t)kind * p->n_kv_heads + head) * per_head +
                              (size_t)offset * p->head_dim) *
                                 kvs_dtype_size(b->kv_dtype);
}

/* The scale of K (kind 0) or V (kind 1) of head in an FP8 pool view (backend.h
 * kvs_kv_pool); 1 for other dtypes and for a view without scales. */
static inline float kvs_cpu_kv_scale(const kvs_backend *b, const kvs_kv_pool *p, int kind, int head) {
    return b->kv_dtype == KVS_F8_E4M3 && p->scales ? p->scales[(size_t)kind * p->n_kv_heads + head] : 1.0f;
}
/* rows x head_dim entries of (block, kind, head) from offset on, as f32 into dst
 * (FP8: each code decoded exactly, then times its scale). */
void kvs_cpu_kv_rows_f32(const kvs_backend *b, const kvs_kv_pool *p, int32_t block, int kind, int head, int offset,
                         int rows, float *dst);

#endif
