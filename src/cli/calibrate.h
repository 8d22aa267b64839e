/* kvsparse calibrate's parts (docs/SPARSITY.md, "Calibration profiles"):
 * per-layer statistics of the SnapKV window's attention over prompts
 * (calib_stats.c), the recommended per-layer budget shares (calib_stats.c),
 * and the report: table, profile JSON and plots (calib_report.c). */
#ifndef KVS_CLI_CALIBRATE_H
#define KVS_CLI_CALIBRATE_H

#include <jansson.h>
#include <stdio.h>

#include "core/core.h"

/* the top 1, 5, 10 and 20% of the keys */
#define KVS_CALIB_TOPS 4
extern const double kvs_calib_top_fraction[KVS_CALIB_TOPS];
/* the concentration curve's grid of kept fractions, 0.5% .. 100% */
#define KVS_CALIB_GRID 30
extern const double kvs_calib_kept[KVS_CALIB_GRID];

/* Sums over the prompts of each (layer, KV head)'s measures; the means are
 * the sums / n_prompts. A head's measures of a prompt come from its scores of
 * the m = n - w keys before the window (what selection chooses among; the
 * window is always kept), normalised to sum 1: the mass of its top ceil(x * m)
 * keys, and its entropy / ln m; and the mass SnapKV keeps at a budget of B =
 * round(x * n) entries (never below the window w): the top B - w earlier keys
 * by max-pooled score (kernel `pool`), as kvs_kv_sparsify selects them. */
typedef struct {
    int n_layers, n_kv_heads, n_prompts, window, pool;
    double *top;         /* [layer][head][KVS_CALIB_TOPS] */
    double *entropy;     /* [layer][head] */
    double *curve;       /* [layer][KVS_CALIB_GRID]: the mass of the top kept[k] keys, mean over the heads */
    double *snapkv;      /* [layer][KVS_CALIB_GRID]: the mass SnapKV keeps at a budget of kept[k], mean over the heads */
    double *mass, *cum;  /* scratch [n]: one head's normalised scores; prefix sums in some order */
    struct kvs_calib_ranked *ranked; /* scratch [n]: earlier keys by pooled score */
    int scratch_n;
} kvs_calib_stats;

kvs_status kvs_calib_stats_init(kvs_calib_stats *s, int n_layers, int n_kv_heads, int window, int pool);
void kvs_calib_stats_free(kvs_calib_stats *s);
/* One prompt's scores of a layer: scores[g * (n - window) + j], KV head g, key j
 * before the window of the n-token prompt (kvs_runner_window_scores). */
kvs_status kvs_calib_add_layer(kvs_calib_stats *s, int layer, const float *scores, int n);
void kvs_calib_prompt_done(kvs_calib_stats *s); /* after every layer of a prompt */

/* Means over the prompts; head -1: the mean over the heads. */
double kvs_calib_top(const kvs_calib_stats *s, int layer, int head, int k);
double kvs_calib_entropy(const kvs_calib_stats *s, int layer, int head);
double kvs_calib_curve(const kvs_calib_stats *s, int layer, int k);
double kvs_calib_snapkv_curve(const kvs_calib_stats *s, int layer, int k);

/* The recommended shares at compression c > 1: mean 1/c, each in
 * [0.5/c, min(2/c, 1)], maximising the mass the layers keep together (the sum of their
 * mean top-keys curves, read between grid points linearly): water-filling,
 * every next slice of the budget to the layer whose curve gains most from it.
 * (The snapkv curves are for people: docs/SPARSITY.md says why they do not
 * set the shares either.) */
void kvs_calib_shares(const kvs_calib_stats *s, double compression, double *share);

/* ---- the report (calib_report.c) ------------------------------------------ */
typedef struct {
    const char *model, *data; /* names for the profile */
    int stride;
    long long tokens;          /* prompt tokens calibrated */
    double seconds;
    int n_targets;
    const double *targets;     /* ascending compressions */
    double *const *shares;     /* [n_targets][n_layers] */
} kvs_calib_result;

/* The table on f: per layer top 1/5/10/20%, entropy, the share per target. */
void kvs_calib_print_table(FILE *f, const kvs_calib_stats *s, const kvs_calib_result *r);
/* The profile (the format kvs_kv_profile_load reads, with the statistics). */
json_t *kvs_calib_profile_json(const kvs_calib_stats *s, const kvs_calib_result *r);
kvs_status kvs_calib_write_profile(const char *path, const kvs_calib_stats *s, const kvs_calib_result *r);

/* The first prompt's attention mass by layer and position, for the heatmap:
 * mass[l * n + j], layer l's scores of key j summed over its KV heads, over their
 * total (0 in the window, whose own mass is not measured). */
typedef struct {
    int n, window;
    double *mass; /* [n_layers][n] */
} kvs_calib_first;
/* DIR made if missing (before the run: a folder that cannot be made fails at once). */
kvs_status kvs_calib_plot_dir(const char *dir);
/* DIR/attention_heatmap.png and DIR/concentration.png (DIR made if missing). */
kvs_status kvs_calib_plots(const char *dir, const kvs_calib_stats *s, const kvs_calib_first *first,
                           const kvs_calib_result *r);

#endif
