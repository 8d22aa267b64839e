/* Selection helpers: max-pooling of scores and the top-k entries, sorted by index. */
#include <stdlib.h>

#include "kv/kv.h"

void kvs_kv_pool_scores(const float *s, int n, int p, float *out) {
    int r = p / 2;
    for (int j = 0; j < n; j++) {
        int lo = j - r < 0 ? 0 : j - r, hi = j + r >= n ? n - 1 : j + r;
        float m = s[lo];
        for (int t = lo + 1; t <= hi; t++)
            if (s[t] > m) m = s[t];
        out[j] = m;
    }
}

typedef struct {
    float score;
    int32_t idx;
} scored;

/* Higher score first; ties go to the earlier entry. */
static int better(scored a, scored b) { return a.score > b.score || (a.score == b.score && a.idx < b.idx); }

static int by_index(const void *a, const void *b) { return *(const int32_t *)a - *(const int32_t *)b; }

void kvs_kv_top_k_sorted(const float *s, int n, int k, int32_t *out) {
    if (k <= 0) return;
    if (k >= n) {
        for (int j = 0; j < n; j++) out[j] = j;
        return;
    }
    /* a min-heap of the k best seen so far */
    scored *heap = malloc(sizeof(scored) * (size_t)k);
    int size = 0;
    for (int j = 0; j < n; j++) {
        scored c = {s[j], j};
        if (size < k) {
            int i = size++;
            while (i > 0 && better(heap[(i - 1) / 2], c)) {
                heap[i] = heap[(i - 1) / 2];
                i = (i - 1) / 2;
            }
            heap[i] = c;
        } else if (better(c, heap[0])) {
            int i = 0;
            for (;;) {
                int l = 2 * i + 1, r = l + 1, w = i;
                scored cw = c;
                if (l < k && better(cw, heap[l])) { w = l; cw = heap[l]; }
                if (r < k && better(cw, heap[r])) w = r;
                if (w == i) break;
                heap[i] = heap[w];
                i = w;
            }
            heap[i] = c;
        }
    }
    for (int i = 0; i < k; i++) out[i] = heap[i].idx;
    free(heap);
    qsort(out, (size_t)k, sizeof(int32_t), by_index);
}
