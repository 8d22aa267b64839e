/* SnapKV selection on the CPU: max-pool each KV head's scores, sort the entries
 * by (pooled score descending, index ascending), keep the first k in index
 * order, append the window. The oracle of the CUDA radix select; written
 * independently of kv/select.c (the heap the kv module kept before this op),
 * and tests/test_kv.c checks the two against each other. */
#include <stdlib.h>

#include "backend/cpu/cpu_ops.h"

typedef struct {
    float score;
    int32_t idx;
} ranked;

static int by_rank(const void *pa, const void *pb) {
    const ranked *a = pa, *b = pb;
    if (a->score != b->score) return a->score > b->score ? -1 : 1;
    return a->idx < b->idx ? -1 : a->idx > b->idx;
}

static int by_index(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return x < y ? -1 : x > y;
}

void kvs_cpu_snapkv_select(kvs_backend *b, int32_t *keep, const float *scores, int n_keys, int n_kv_heads, int pool,
                           int k, int n_win) {
    if (n_keys < 0 || n_kv_heads < 0 || k < 0 || n_win < 0 || pool < 1) {
        kvs_cpu_fail(b, KVS_ERR_INVALID,
                     "snapkv_select: bad arguments (n_keys %d, kv heads %d, pool %d, k %d, window %d)", n_keys,
                     n_kv_heads, pool, k, n_win);
        return;
    }
    int r = pool / 2, take = k < n_keys ? k : n_keys, row = k + n_win;
    ranked *rk = malloc(sizeof(ranked) * (size_t)(n_keys ? n_keys : 1));
    if (!rk) {
        kvs_cpu_fail(b, KVS_ERR_NOMEM, "snapkv_select: out of memory for %d keys", n_keys);
        return;
    }
    for (int g = 0; g < n_kv_heads; g++) {
        const float *s = scores + (size_t)g * n_keys;
        int32_t *out = keep + (size_t)g * row;
        for (int j = 0; j < n_keys; j++) {
            int lo = j - r < 0 ? 0 : j - r, hi = j + r >= n_keys ? n_keys - 1 : j + r;
            float m = s[lo];
            for (int t = lo + 1; t <= hi; t++)
                if (s[t] > m) m = s[t];
            rk[j] = (ranked){m, j};
        }
        qsort(rk, (size_t)n_keys, sizeof(ranked), by_rank);
        for (int i = 0; i < take; i++) out[i] = rk[i].idx;
        qsort(out, (size_t)take, sizeof(int32_t), by_index);
        for (int i = 0; i < n_win; i++) out[take + i] = n_keys + i;
        for (int i = take + n_win; i < row; i++) out[i] = -1;
    }
    free(rk);
}
