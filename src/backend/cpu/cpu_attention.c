/* Causal GQA attention over the paged KV cache (with LSE). */
#include <cblas.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu_ops.h"

#define kv_at(...) kvs_cpu_kv_at(b, __VA_ARGS__)

/* Entries of a table's block that starts at entry e0 (of n). */
static inline int block_rows(int n, int e0, int bs) { return n - e0 < bs ? n - e0 : bs; }

/* Asks for the K (kind 0) or V (kind 1) rows of head g in the block after the one
 * at entry e0, while that one is computed: the blocks of a table are scattered,
 * so the hardware prefetcher, which follows a stream within a page, starts cold
 * at each one. */
static inline void prefetch_next_block(const kvs_backend *b, const kvs_kv_pool *pool, const int32_t *table, int n_keys,
                                       int e0, int kind, int g) {
    int bs = pool->block_size;
    if (e0 + bs >= n_keys) return;
    const char *p = kv_at(pool, table[e0 / bs + 1], kind, g, 0);
    size_t bytes = (size_t)block_rows(n_keys, e0 + bs, bs) * pool->head_dim * kvs_dtype_size(b->kv_dtype);
    for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
}

/* The first cnt K (kind 0) or V rows of head g in block: the pool's own rows,
 * or for an FP8 pool their values (decoded, times the scale) in buf (f32). */
static inline const void *block_kv(const kvs_backend *b, const kvs_kv_pool *pool, int32_t block, int kind, int g,
                                   int cnt, float *buf) {
    if (b->kv_dtype != KVS_F8_E4M3) return kv_at(pool, block, kind, g, 0);
    kvs_cpu_kv_rows_f32(b, pool, block, kind, g, 0, cnt, buf);
    return buf;
}

/* The first entry a query sees that sees n_keys entries: all of them, or the
 * last `window` (a sliding window, kvs_attn_batch.window). */
static inline int first_key(int n_keys, int window) { return window > 0 && n_keys > window ? n_keys - window : 0; }

/* Decode: one query row i of sequence s against its paged keys [first, n_keys),
 * for all the query heads of KV head g at once (each key and value row read
 * once), the scores in S [group][n_keys]. */
static void attend_group(const kvs_backend *b, const kvs_cpu_kernels *k, const kvs_kv_pool *pool, const int32_t *table, int n_keys,
                         int first, int g, int group, const float *q, float scale, float *S, float *out, float *lse) {
    int d = pool->head_dim, bs = pool->block_size, begin = first / bs * bs; /* the block that holds first */
    if (n_keys <= 0) { /* a padding row (kv_len 0): no keys, output 0 */
        memset(out, 0, sizeof(float) * d * group);
        for (int h = 0; lse && h < group; h++) lse[h] = -INFINITY;
        return;
    }
    bool fp8 = b->kv_dtype == KVS_F8_E4M3; /* blocks decoded (and scaled) into f32 first */
    float blk[fp8 ? (size_t)bs * d : 1];
    kvs_dtype kt = fp8 ? KVS_F32 : b->kv_dtype;
    for (int e0 = begin; e0 < n_keys; e0 += bs) {
        prefetch_next_block(b, pool, table, n_keys, e0, 0, g);
        const void *rows = block_kv(b, pool, table[e0 / bs], 0, g, block_rows(n_keys, e0, bs), blk);
        k->qk(S + e0, n_keys, q, d, group, rows, kt, block_rows(n_keys, e0, bs), d, scale);
    }
    double sum[group];
    float mx[group];
    for (int h = 0; h < group; h++) {
        float *sh = S + (size_t)h * n_keys, m = -INFINITY;
        for (int e = first; e < n_keys; e++) m = sh[e] > m ? sh[e] : m;
        sum[h] = k->exp_sum(sh + first, n_keys - first, m), mx[h] = m;
        for (int e = begin; e < first; e++) sh[e] = 0; /* before the window */
    }
    memset(out, 0, sizeof(float) * d * group);
    for (int e0 = begin; e0 < n_keys; e0 += bs) {
        prefetch_next_block(b, pool, table, n_keys, e0, 1, g);
        const void *rows = block_kv(b, pool, table[e0 / bs], 1, g, block_rows(n_keys, e0, bs), blk);
        k->pv(out, d, S + e0, n_keys, group, rows, kt, block_rows(n_keys, e0, bs), d);
    }
    for (int h = 0; h < group; h++) {
        float inv = (float)(1.0 / sum[h]);
        for (int j = 0; j < d; j++) out[(size_t)h * d + j] *= inv;
        if (lse) lse[h] = mx[h] + (float)log(sum[h]);
    }
}

/* Prefill chunks of at least this many queries go through sgemm on the
 * sequence's keys gathered into contiguous buffers; shorter ones (decode) are
 * attended one query at a time straight from the paged pool. */
enum { BLOCKED_MIN_Q = 16, Q_BLOCK = 64 };

typedef struct {
    int s, h, i0, i1; /* sequence, query head (decode: KV head), query rows [i0, i1) of the sequence's chunk */
    bool blocked;
} work_item;

/* Rows [i0, i1) of sequence s, head h, against the gathered keys k/v [n_kv][d]. */
static void attend_rows(const kvs_cpu_kernels *kern, const kvs_attn_batch *ab, int s, int h, int i0, int i1,
                        const float *k, const float *v, const float *q, float *out, float *lse, int n_heads, int d,
                        float scale, float *S) {
    int q_len = ab->q_start[s + 1] - ab->q_start[s], past = ab->kv_len[s] - q_len;
    int nb = i1 - i0, nk = past + i1, ld = n_heads * d;
    size_t row0 = ((size_t)(ab->q_start[s] + i0) * n_heads + h);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nb, nk, d, scale, q + row0 * d, ld, k, d, 0.0f, S, nk);
    float *inv = S + (size_t)nb * nk; /* nb floats after the scores */
    for (int r = 0; r < nb; r++) {
        float *sr = S + (size_t)r * nk, mx = -INFINITY;
        int limit = past + i0 + r + 1, first = first_key(limit, ab->window); /* causal, within the window */
        for (int e = first; e < limit; e++) mx = sr[e] > mx ? sr[e] : mx;
        double sum = kern->exp_sum(sr + first, limit - first, mx);
        for (int e = 0; e < first; e++) sr[e] = 0;
        for (int e = limit; e < nk; e++) sr[e] = 0;
        inv[r] = (float)(1.0 / sum);
        if (lse) lse[(row0 + (size_t)r * n_heads)] = mx + (float)log(sum);
    }
    float *o = out + row0 * d;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nb, d, nk, 1.0f, S, nk, v, d, 0.0f, o, ld);
    for (int r = 0; r < nb; r++)
        for (int j = 0; j < d; j++) o[(size_t)r * ld + j] *= inv[r];
}

/* Copies the K and V of (sequence s, KV head g) into contiguous [kv_len][d] buffers. */
static void gather_head(const kvs_backend *b, const kvs_kv_pool *pool, const kvs_attn_batch *ab, int s, int g, float *k, float *v) {
    int d = pool->head_dim, bs = pool->block_size, n = ab->kv_len[s];
    const int32_t *table = kvs_attn_table(ab, s);
    for (int e0 = 0; e0 < n; e0 += bs) {
        int cnt = block_rows(n, e0, bs);
        kvs_cpu_kv_rows_f32(b, pool, table[e0 / bs], 0, g, 0, cnt, k + (size_t)e0 * d);
        kvs_cpu_kv_rows_f32(b, pool, table[e0 / bs], 1, g, 0, cnt, v + (size_t)e0 * d);
    }
}

/* One attention call's work, shared by the pool's threads: items taken in
 * order from next (dynamic scheduling). */
typedef struct {
    const kvs_backend *b;
    const kvs_cpu_kernels *k;
    const kvs_kv_pool *pool;
    const kvs_attn_batch *ab;
    const work_item *items;
    size_t n_items;
    float **kbuf, **vbuf;
    const float *q;
    float *out, *lse;
    int n_heads, KVH, group, d;
    float scale;
    float *S0;
    size_t s_stride; /* floats of scores per thread */
    atomic_size_t next;
} attn_job;

static void run_gathers(void *arg, int t, int nt) {
    attn_job *j = arg;
    for (size_t sg; (sg = atomic_fetch_add(&j->next, 1)) < (size_t)j->ab->n_seqs * j->KVH;)
        if (j->kbuf[sg]) gather_head(j->b, j->pool, j->ab, (int)sg / j->KVH, (int)sg % j->KVH, j->kbuf[sg], j->vbuf[sg]);
}

static void run_items(void *arg, int t, int nt) {
    attn_job *j = arg;
    const kvs_attn_batch *ab = j->ab;
    float *S = j->S0 + j->s_stride * t;
    for (size_t it; (it = atomic_fetch_add(&j->next, 1)) < j->n_items;) {
        work_item w = j->items[it];
        if (w.blocked) {
            int g = w.h / j->group;
            attend_rows(j->k, ab, w.s, w.h, w.i0, w.i1, j->kbuf[w.s * j->KVH + g], j->vbuf[w.s * j->KVH + g], j->q, j->out,
                        j->lse, j->n_heads, j->d, j->scale, S);
        } else {
            int tok = ab->q_start[w.s] + w.i0, q_len = ab->q_start[w.s + 1] - ab->q_start[w.s];
            int n_keys = ab->kv_len[w.s] - q_len + w.i0 + 1;
            size_t row = (size_t)tok * j->n_heads + (size_t)w.h * j->group;
            attend_group(j->b, j->k, j->pool, kvs_attn_table(ab, w.s), n_keys,
                         first_key(n_keys, ab->window), w.h, j->group, j->q + row * j->d, j->scale, S,
                         j->out + row * j->d, j->lse ? j->lse + row : NULL);
        }
    }
}

/* Carves n bytes (64-byte aligned) off *at. */
static void *carve(char **at, size_t n) {
    void *p = *at;
    *at += (n + 63) / 64 * 64;
    return p;
}

void kvs_cpu_attention(kvs_backend *b, void *out, float *lse, const void *q, const kvs_kv_pool *pool,
                       const kvs_attn_batch *ab, int n_heads, float scale) {
    int d = pool->head_dim, KVH = pool->n_kv_heads, group = n_heads / KVH, nt = kvs_cpu_pool_size(kvs_cpu_pool_of(b));
    const float *qq = q;
    float *o = out;
    /* scratch: the work list, the gathered keys of blocked (prefill) sequences, each thread's scores */
    size_t n_items = 0, cap = (size_t)ab->n_tokens * n_heads + 1, n_bufs = (size_t)ab->n_seqs * KVH, kv_floats = 0;
    for (int s = 0; s < ab->n_seqs; s++)
        if (ab->q_start[s + 1] - ab->q_start[s] >= BLOCKED_MIN_Q) kv_floats += 2 * (size_t)ab->kv_len[s] * d * KVH;
    size_t max_kv = ab->max_kv_len > 0 ? ab->max_kv_len : 1;
    size_t blocked_s = (size_t)(Q_BLOCK + 1) * max_kv + Q_BLOCK, group_s = (size_t)group * max_kv;
    size_t s_cap = blocked_s > group_s ? blocked_s : group_s;
    size_t bytes = (sizeof(work_item) * cap + 64) + 2 * (sizeof(float *) * n_bufs + 64) + sizeof(float) * kv_floats +
                   64 * KVH * ab->n_seqs * 2 + nt * (sizeof(float) * s_cap + 64);
    char *at = kvs_cpu_scratch(b, bytes);
    if (!at) return;
    work_item *items = carve(&at, sizeof(work_item) * cap);
    float **kbuf = carve(&at, sizeof(float *) * n_bufs), **vbuf = carve(&at, sizeof(float *) * n_bufs);
    for (int s = 0; s < ab->n_seqs; s++) {
        int q_len = ab->q_start[s + 1] - ab->q_start[s];
        bool blocked = q_len >= BLOCKED_MIN_Q;
        if (blocked)
            for (int h = 0; h < n_heads; h++)
                for (int i0 = 0; i0 < q_len; i0 += Q_BLOCK)
                    items[n_items++] = (work_item){s, h, i0, i0 + Q_BLOCK < q_len ? i0 + Q_BLOCK : q_len, true};
        else
            for (int g = 0; g < KVH; g++)
                for (int i = 0; i < q_len; i++) items[n_items++] = (work_item){s, g, i, i + 1, false};
        for (int g = 0; g < KVH; g++) {
            kbuf[s * KVH + g] = blocked ? carve(&at, sizeof(float) * ab->kv_len[s] * d) : NULL;
            vbuf[s * KVH + g] = blocked ? carve(&at, sizeof(float) * ab->kv_len[s] * d) : NULL;
        }
    }
    float *S0 = carve(&at, 0);
    attn_job job = {b, kvs_cpu_kernels_of(b), pool, ab, items, n_items, kbuf, vbuf, qq, o, lse, n_heads, KVH, group, d, scale, S0,
                    (sizeof(float) * s_cap + 64) / 64 * 64 / sizeof(float)};
    atomic_init(&job.next, 0);
    if (kv_floats) kvs_cpu_pool_run(kvs_cpu_pool_of(b), run_gathers, &job); /* prefill: keys gathered first */
    atomic_store(&job.next, 0);
    kvs_cpu_pool_run(kvs_cpu_pool_of(b), run_items, &job);
}
