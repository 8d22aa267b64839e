/* Causal GQA attention over the paged KV cache (with LSE). */
#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu_ops.h"

#define kv_at kvs_cpu_kv_at

/* A dot product the compiler can vectorise (independent partial sums). */
static inline float dot(const float *a, const float *b, int n) {
    float acc[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0;
    for (; i < n; i++) s += a[i] * b[i];
    for (int j = 0; j < 16; j++) s += acc[j];
    return s;
}

/* One (query token, head): scores over entries 0..n_keys-1 of the sequence's table. */
static void attend_one(const kvs_kv_pool *pool, const int32_t *table, int n_keys, int kv_head,
                       const float *q, float scale, float *scores, float *out, float *lse) {
    int d = pool->head_dim, bs = pool->block_size;
    if (n_keys <= 0) { /* a padding row (kv_len 0): no keys, output 0 */
        memset(out, 0, sizeof(float) * d);
        if (lse) *lse = -INFINITY;
        return;
    }
    float mx = -INFINITY;
    for (int e = 0; e < n_keys; e++) {
        const float *kv = kv_at(pool, table[e / bs], 0, kv_head, e % bs);
        float s = dot(q, kv, d) * scale;
        scores[e] = s;
        if (s > mx) mx = s;
    }
    double sum = 0;
    for (int e = 0; e < n_keys; e++) {
        scores[e] = expf(scores[e] - mx);
        sum += scores[e];
    }
    memset(out, 0, sizeof(float) * d);
    for (int e = 0; e < n_keys; e++) {
        const float *vv = kv_at(pool, table[e / bs], 1, kv_head, e % bs);
        float p = scores[e];
        for (int j = 0; j < d; j++) out[j] += p * vv[j];
    }
    float inv = (float)(1.0 / sum);
    for (int j = 0; j < d; j++) out[j] *= inv;
    if (lse) *lse = mx + (float)log(sum);
}

/* Prefill chunks of at least this many queries go through sgemm on the
 * sequence's keys gathered into contiguous buffers; shorter ones (decode) are
 * attended one query at a time straight from the paged pool. */
enum { BLOCKED_MIN_Q = 16, Q_BLOCK = 64 };

typedef struct {
    int s, h, i0, i1; /* sequence, query head, query rows [i0, i1) of the sequence's chunk */
    bool blocked;
} work_item;

/* Rows [i0, i1) of sequence s, head h, against the gathered keys k/v [n_kv][d]. */
static void attend_rows(const kvs_attn_batch *ab, int s, int h, int i0, int i1, const float *k, const float *v,
                        const float *q, float *out, float *lse, int n_heads, int d, float scale, float *S) {
    int q_len = ab->q_start[s + 1] - ab->q_start[s], past = ab->kv_len[s] - q_len;
    int nb = i1 - i0, nk = past + i1, ld = n_heads * d;
    size_t row0 = ((size_t)(ab->q_start[s] + i0) * n_heads + h);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nb, nk, d, scale, q + row0 * d, ld, k, d, 0.0f, S, nk);
    float *inv = S + (size_t)nb * nk; /* nb floats after the scores */
    for (int r = 0; r < nb; r++) {
        float *sr = S + (size_t)r * nk, mx = -INFINITY;
        int limit = past + i0 + r + 1; /* causal */
        for (int e = 0; e < limit; e++) mx = sr[e] > mx ? sr[e] : mx;
        double sum = 0;
        for (int e = 0; e < limit; e++) sum += sr[e] = expf(sr[e] - mx);
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
static void gather_head(const kvs_kv_pool *pool, const kvs_attn_batch *ab, int s, int g, float *k, float *v) {
    int d = pool->head_dim, bs = pool->block_size, n = ab->kv_len[s];
    const int32_t *table = ab->block_tables + (size_t)s * ab->max_blocks;
    for (int e0 = 0; e0 < n; e0 += bs) {
        int cnt = n - e0 < bs ? n - e0 : bs;
        memcpy(k + (size_t)e0 * d, kv_at(pool, table[e0 / bs], 0, g, 0), sizeof(float) * d * cnt);
        memcpy(v + (size_t)e0 * d, kv_at(pool, table[e0 / bs], 1, g, 0), sizeof(float) * d * cnt);
    }
}

void kvs_cpu_attention(kvs_backend *b, void *out, float *lse, const void *q, const kvs_kv_pool *pool,
                       const kvs_attn_batch *ab, int n_heads, float scale) {
    int d = pool->head_dim, KVH = pool->n_kv_heads, group = n_heads / KVH;
    const float *qq = q;
    float *o = out;
    /* the work list and, for blocked sequences, their gathered keys */
    size_t n_items = 0, cap = (size_t)ab->n_tokens * n_heads + 1;
    work_item *items = malloc(sizeof(work_item) * cap);
    size_t n_bufs = (size_t)ab->n_seqs * KVH;
    float **kbuf = calloc(n_bufs ? n_bufs : 1, sizeof(float *)), **vbuf = calloc(n_bufs ? n_bufs : 1, sizeof(float *));
    bool ok = items && kbuf && vbuf;
    for (int s = 0; ok && s < ab->n_seqs; s++) {
        int q_len = ab->q_start[s + 1] - ab->q_start[s];
        bool blocked = q_len >= BLOCKED_MIN_Q;
        for (int h = 0; h < n_heads; h++)
            for (int i0 = 0; i0 < q_len; i0 += blocked ? Q_BLOCK : 1)
                items[n_items++] = (work_item){s, h, i0, blocked ? (i0 + Q_BLOCK < q_len ? i0 + Q_BLOCK : q_len) : i0 + 1,
                                               blocked};
        for (int g = 0; blocked && g < KVH; g++) {
            kbuf[s * KVH + g] = malloc(sizeof(float) * (size_t)ab->kv_len[s] * d);
            vbuf[s * KVH + g] = malloc(sizeof(float) * (size_t)ab->kv_len[s] * d);
            ok = ok && kbuf[s * KVH + g] && vbuf[s * KVH + g];
        }
    }
    if (!ok) {
        kvs_cpu_fail(b, KVS_ERR_NOMEM, "attention: out of memory (%d sequences, %d tokens)", ab->n_seqs, ab->n_tokens);
        n_items = 0;
    }
#pragma omp parallel if (ok)
    {
#pragma omp for schedule(dynamic, 1)
        for (int sg = 0; sg < (ok ? ab->n_seqs * KVH : 0); sg++)
            if (kbuf[sg]) gather_head(pool, ab, sg / KVH, sg % KVH, kbuf[sg], vbuf[sg]);
        size_t s_cap = (size_t)(Q_BLOCK + 1) * (ab->max_kv_len > 0 ? ab->max_kv_len : 1) + Q_BLOCK;
        float *S = malloc(sizeof(float) * s_cap);
        if (!S) kvs_cpu_fail(b, KVS_ERR_NOMEM, "attention: out of memory (%zu scores)", s_cap);
#pragma omp for schedule(dynamic, 2)
        for (size_t it = 0; it < n_items; it++) {
            if (!S) continue;
            work_item w = items[it];
            if (w.blocked) {
                int g = w.h / group;
                attend_rows(ab, w.s, w.h, w.i0, w.i1, kbuf[w.s * KVH + g], vbuf[w.s * KVH + g], qq, o, lse, n_heads,
                            d, scale, S);
            } else {
                int t = ab->q_start[w.s] + w.i0, q_len = ab->q_start[w.s + 1] - ab->q_start[w.s];
                int n_keys = ab->kv_len[w.s] - q_len + w.i0 + 1;
                attend_one(pool, ab->block_tables + (size_t)w.s * ab->max_blocks, n_keys, w.h / group,
                           qq + ((size_t)t * n_heads + w.h) * d, scale, S, o + ((size_t)t * n_heads + w.h) * d,
                           lse ? lse + (size_t)t * n_heads + w.h : NULL);
            }
        }
        free(S);
    }
    for (size_t i = 0; kbuf && vbuf && i < n_bufs; i++) {
        free(kbuf[i]);
        free(vbuf[i]);
    }
    free(kbuf);
    free(vbuf);
    free(items);
}
