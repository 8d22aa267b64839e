/* kvsparse calibrate: the window's attention, measured per layer and KV head
 * and averaged over prompts, and the budget shares it recommends. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cli/calibrate.h"
#include "kv/kv.h"

const double kvs_calib_top_fraction[KVS_CALIB_TOPS] = {0.01, 0.05, 0.10, 0.20};
const double kvs_calib_kept[KVS_CALIB_GRID] = {0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.07,
                                               0.08,  0.09, 0.10,  0.12, 0.14,  0.16, 0.18, 0.20, 0.25, 0.30,
                                               0.35,  0.40, 0.45,  0.50, 0.60,  0.70, 0.80, 0.90, 0.95, 1.00};

kvs_status kvs_calib_stats_init(kvs_calib_stats *s, int n_layers, int n_kv_heads, int window, int pool) {
    memset(s, 0, sizeof *s);
    s->n_layers = n_layers, s->n_kv_heads = n_kv_heads, s->window = window, s->pool = pool;
    size_t heads = (size_t)n_layers * n_kv_heads, grid = (size_t)n_layers * KVS_CALIB_GRID;
    s->top = calloc(heads * KVS_CALIB_TOPS, sizeof(double));
    s->entropy = calloc(heads, sizeof(double));
    s->curve = calloc(grid, sizeof(double));
    s->snapkv = calloc(grid, sizeof(double));
    if (!s->top || !s->entropy || !s->curve || !s->snapkv) {
        kvs_calib_stats_free(s);
        return kvs_fail(KVS_ERR_NOMEM, "calibrate: out of memory");
    }
    return KVS_OK;
}

void kvs_calib_stats_free(kvs_calib_stats *s) {
    free(s->top), free(s->entropy), free(s->curve), free(s->snapkv);
    free(s->mass), free(s->cum), free(s->ranked);
    memset(s, 0, sizeof *s);
}

struct kvs_calib_ranked {
    float pooled;
    int32_t key;
};

static kvs_status grow_scratch(kvs_calib_stats *s, int n) {
    if (n <= s->scratch_n) return KVS_OK;
    free(s->mass), free(s->cum), free(s->ranked);
    s->mass = malloc(sizeof(double) * n), s->cum = malloc(sizeof(double) * n);
    s->ranked = malloc(sizeof(struct kvs_calib_ranked) * n);
    s->scratch_n = s->mass && s->cum && s->ranked ? n : 0;
    return s->scratch_n ? KVS_OK : kvs_fail(KVS_ERR_NOMEM, "calibrate: out of memory");
}

static int descending(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* The mass of the top ceil(fraction * n) keys, from the prefix sums cum[0..n) of the sorted masses. */
static double top_mass(const double *cum, int n, double fraction) {
    int k = (int)ceil(fraction * n - 1e-9);
    k = k < 1 ? 1 : k > n ? n : k;
    return cum[k - 1];
}

/* SnapKV's order of the earlier keys: by max-pooled score, higher first, ties
 * to the earlier key (kvs_kv_top_k_sorted's order). */
static int by_pooled(const void *a, const void *b) {
    const struct kvs_calib_ranked *x = a, *y = b;
    return x->pooled > y->pooled ? -1 : x->pooled < y->pooled ? 1 : x->key - y->key;
}

/* One head: s->snapkv[layer][k] += the mass SnapKV keeps at budget kept[k] of the
 * n-token prompt / heads: the top B - w of the m earlier keys by pooled score (the
 * window is kept whole; its own mass is not measured). */
static void add_snapkv(kvs_calib_stats *s, int layer, const float *row, int m, int n) {
    int w = n - m;
    float *pooled = (float *)s->cum; /* the prefix sums' room, before they are written */
    kvs_kv_pool_scores(row, m, s->pool, pooled);
    for (int j = 0; j < m; j++) s->ranked[j] = (struct kvs_calib_ranked){pooled[j], j};
    qsort(s->ranked, (size_t)m, sizeof *s->ranked, by_pooled);
    for (int j = 0; j < m; j++) s->cum[j] = s->mass[s->ranked[j].key] + (j ? s->cum[j - 1] : 0);
    for (int k = 0; k < KVS_CALIB_GRID; k++) {
        long budget = lround(kvs_calib_kept[k] * n), extra = budget > w ? budget - w : 0;
        extra = extra < m ? extra : m;
        s->snapkv[(size_t)layer * KVS_CALIB_GRID + k] += (extra ? s->cum[extra - 1] : 0) / s->n_kv_heads;
    }
}

kvs_status kvs_calib_add_layer(kvs_calib_stats *s, int layer, const float *scores, int n) {
    int m = n - s->window; /* the keys before the window */
    if (m < 1) return kvs_fail(KVS_ERR_INVALID, "calibrate: layer %d has no keys before its window", layer);
    KVS_TRY(grow_scratch(s, m));
    double *a = s->mass;
    for (int g = 0; g < s->n_kv_heads; g++) {
        const float *row = scores + (size_t)g * m;
        double total = 0;
        for (int j = 0; j < m; j++) total += row[j];
        if (!isfinite(total) || total < 0)
            return kvs_fail(KVS_ERR_INTERNAL, "calibrate: layer %d, KV head %d: the scores sum to %g", layer, g, total);
        size_t head = (size_t)layer * s->n_kv_heads + g;
        if (total == 0) { /* the window's attention stays in the window (bf16 exp underflows): nothing to keep */
            for (int t = 0; t < KVS_CALIB_TOPS; t++) s->top[head * KVS_CALIB_TOPS + t] += 1;
            for (int k = 0; k < KVS_CALIB_GRID; k++) {
                s->curve[(size_t)layer * KVS_CALIB_GRID + k] += 1.0 / s->n_kv_heads;
                s->snapkv[(size_t)layer * KVS_CALIB_GRID + k] += 1.0 / s->n_kv_heads;
            }
            continue;
        }
        double h = 0;
        for (int j = 0; j < m; j++) {
            a[j] = row[j] > 0 ? row[j] / total : 0;
            if (a[j] > 0) h -= a[j] * log(a[j]);
        }
        s->entropy[head] += m > 1 ? h / log(m) : 0;
        add_snapkv(s, layer, row, m, n);
        memcpy(s->cum, a, sizeof(double) * m);
        qsort(s->cum, (size_t)m, sizeof(double), descending);
        for (int j = 1; j < m; j++) s->cum[j] += s->cum[j - 1]; /* the top j + 1 keys' mass */
        for (int t = 0; t < KVS_CALIB_TOPS; t++)
            s->top[head * KVS_CALIB_TOPS + t] += top_mass(s->cum, m, kvs_calib_top_fraction[t]);
        for (int k = 0; k < KVS_CALIB_GRID; k++)
            s->curve[(size_t)layer * KVS_CALIB_GRID + k] += top_mass(s->cum, m, kvs_calib_kept[k]) / s->n_kv_heads;
    }
    return KVS_OK;
}

void kvs_calib_prompt_done(kvs_calib_stats *s) { s->n_prompts++; }

static double per_prompt(const kvs_calib_stats *s, double sum) { return s->n_prompts ? sum / s->n_prompts : 0; }

double kvs_calib_top(const kvs_calib_stats *s, int layer, int head, int k) {
    if (head >= 0) return per_prompt(s, s->top[((size_t)layer * s->n_kv_heads + head) * KVS_CALIB_TOPS + k]);
    double sum = 0;
    for (int g = 0; g < s->n_kv_heads; g++) sum += kvs_calib_top(s, layer, g, k);
    return sum / s->n_kv_heads;
}

double kvs_calib_entropy(const kvs_calib_stats *s, int layer, int head) {
    if (head >= 0) return per_prompt(s, s->entropy[(size_t)layer * s->n_kv_heads + head]);
    double sum = 0;
    for (int g = 0; g < s->n_kv_heads; g++) sum += kvs_calib_entropy(s, layer, g);
    return sum / s->n_kv_heads;
}

double kvs_calib_curve(const kvs_calib_stats *s, int layer, int k) {
    return per_prompt(s, s->curve[(size_t)layer * KVS_CALIB_GRID + k]);
}

double kvs_calib_snapkv_curve(const kvs_calib_stats *s, int layer, int k) {
    return per_prompt(s, s->snapkv[(size_t)layer * KVS_CALIB_GRID + k]);
}

/* Layer l's mean curve at kept fraction x in [0, 1]: linear between (0, 0) and the grid's points. */
static double curve_at(const kvs_calib_stats *s, int l, double x) {
    double x0 = 0, y0 = 0;
    for (int k = 0; k < KVS_CALIB_GRID; k++) {
        double x1 = kvs_calib_kept[k], y1 = kvs_calib_curve(s, l, k);
        if (x <= x1) return y0 + (y1 - y0) * (x - x0) / (x1 - x0);
        x0 = x1, y0 = y1;
    }
    return y0;
}

void kvs_calib_shares(const kvs_calib_stats *s, double compression, double *share) {
    int L = s->n_layers;
    /* at most 2x either way from the uniform split: kept mass is a proxy (an unbounded
       split starves the sharp layers of the few tokens retrieval needs: docs/SPARSITY.md) */
    double lo = 0.5 / compression, hi = 2 / compression < 1 ? 2 / compression : 1, left = L / compression - L * lo;
    enum { SLICES = 4000 };
    double slice = left / SLICES;
    for (int l = 0; l < L; l++) share[l] = lo;
    for (int i = 0; i < SLICES; i++) {
        int best = -1;
        double gain = -1;
        for (int l = 0; l < L; l++) {
            if (share[l] + slice > hi + 1e-12) continue;
            double g = curve_at(s, l, share[l] + slice) - curve_at(s, l, share[l]);
            if (g > gain + 1e-15) gain = g, best = l; /* a tie: the lower layer */
        }
        if (best < 0) break; /* every layer whole (cannot happen for compression > 1) */
        share[best] += slice;
    }
}
