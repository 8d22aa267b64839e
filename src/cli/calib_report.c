/* kvsparse calibrate's report: the per-layer table, the profile JSON
 * (docs/SPARSITY.md, "Calibration profiles") and the two plots. */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli/calibrate.h"
#include "cli/plot_png.h"
#include "kv/kv.h"

void kvs_calib_print_table(FILE *f, const kvs_calib_stats *s, const kvs_calib_result *r) {
    fprintf(f, "calibrated %d prompt%s (%lld tokens) of %s in %.1f s; window %d\n", s->n_prompts,
            s->n_prompts == 1 ? "" : "s", r->tokens, r->data, r->seconds, s->window);
    fprintf(f, "layer  top1%%  top5%% top10%% top20%% entropy");
    for (int t = 0; t < r->n_targets; t++) fprintf(f, "  share@%gx", r->targets[t]);
    fprintf(f, "\n");
    for (int l = 0; l < s->n_layers; l++) {
        fprintf(f, "%5d", l);
        for (int k = 0; k < KVS_CALIB_TOPS; k++) fprintf(f, " %6.1f", 100 * kvs_calib_top(s, l, -1, k));
        fprintf(f, " %7.3f", kvs_calib_entropy(s, l, -1));
        for (int t = 0; t < r->n_targets; t++) {
            char head[32];
            int w = snprintf(head, sizeof head, "  share@%gx", r->targets[t]) - 1;
            fprintf(f, " %*.2f%%", w - 1, 100 * r->shares[t][l]);
        }
        fprintf(f, "\n");
    }
    fprintf(f, "top N%%: the attention mass of a KV head's top N%% of keys (the last %d prompt queries' attention,\n"
               "mean over heads and prompts); entropy: of that attention / ln(keys), 1 = uniform; share@Cx: the\n"
               "recommended budget of the layer as a fraction of the prompt at compression C (mean 1/C).\n",
            s->window);
}

static json_t *measures(const kvs_calib_stats *s, int layer, int head) {
    static const char *const names[KVS_CALIB_TOPS] = {"top1", "top5", "top10", "top20"};
    json_t *o = json_object();
    for (int k = 0; k < KVS_CALIB_TOPS; k++) json_object_set_new(o, names[k], json_real(kvs_calib_top(s, layer, head, k)));
    json_object_set_new(o, "entropy", json_real(kvs_calib_entropy(s, layer, head)));
    return o;
}

static json_t *number(double v) { return v == floor(v) && fabs(v) < 1e15 ? json_integer((json_int_t)v) : json_real(v); }

json_t *kvs_calib_profile_json(const kvs_calib_stats *s, const kvs_calib_result *r) {
    json_t *layers = json_array(), *kept = json_array(), *mass = json_array(), *snapkv = json_array(),
           *budgets = json_array();
    for (int l = 0; l < s->n_layers; l++) {
        json_t *o = measures(s, l, -1), *heads = json_array(), *row = json_array(), *snap_row = json_array();
        for (int g = 0; g < s->n_kv_heads; g++) json_array_append_new(heads, measures(s, l, g));
        json_object_set_new(o, "heads", heads);
        json_array_append_new(layers, o);
        for (int k = 0; k < KVS_CALIB_GRID; k++) {
            json_array_append_new(row, json_real(kvs_calib_curve(s, l, k)));
            json_array_append_new(snap_row, json_real(kvs_calib_snapkv_curve(s, l, k)));
        }
        json_array_append_new(mass, row);
        json_array_append_new(snapkv, snap_row);
    }
    for (int k = 0; k < KVS_CALIB_GRID; k++) json_array_append_new(kept, json_real(kvs_calib_kept[k]));
    for (int t = 0; t < r->n_targets; t++) {
        json_t *shares = json_array();
        for (int l = 0; l < s->n_layers; l++) json_array_append_new(shares, json_real(r->shares[t][l]));
        json_array_append_new(budgets, json_pack("{s:o, s:o}", "compression", number(r->targets[t]), "layer_share", shares));
    }
    return json_pack("{s:s, s:i, s:s, s:i, s:i, s:i, s:i, s:i, s:s, s:i, s:I, s:o, s:{s:o, s:o, s:o}, s:o}", "format",
                     "kvsparse-kv-profile", "version", 1, "model", r->model, "n_layers", s->n_layers, "n_kv_heads",
                     s->n_kv_heads, "window", s->window, "pool", s->pool, "prompts", s->n_prompts, "data", r->data,
                     "stride", r->stride, "tokens", (json_int_t)r->tokens, "layers", layers, "curve", "kept", kept,
                     "mass", mass, "snapkv_mass", snapkv, "budgets", budgets);
}

kvs_status kvs_calib_write_profile(const char *path, const kvs_calib_stats *s, const kvs_calib_result *r) {
    json_t *j = kvs_calib_profile_json(s, r);
    if (!j) return kvs_fail(KVS_ERR_NOMEM, "calibrate: out of memory building the profile");
    int rc = json_dump_file(j, path, JSON_INDENT(1) | JSON_REAL_PRECISION(6) | JSON_PRESERVE_ORDER);
    json_decref(j);
    return rc == 0 ? KVS_OK : kvs_fail(KVS_ERR_IO, "calibrate: cannot write the profile %s: %s", path, strerror(errno));
}

/* The heatmap's columns: bins of ceil(n / 600) positions, each the mean mass of its positions. */
static kvs_status heatmap(const char *path, const kvs_calib_first *first, int n_layers) {
    int n = first->n, per = (n + 599) / 600, cols = (n + per - 1) / per;
    double *v = calloc((size_t)n_layers * cols, sizeof(double));
    if (!v) return kvs_fail(KVS_ERR_NOMEM, "calibrate: out of memory");
    for (int l = 0; l < n_layers; l++)
        for (int c = 0; c < cols; c++) {
            int j0 = c * per, j1 = j0 + per < n ? j0 + per : n;
            for (int j = j0; j < j1; j++) v[(size_t)l * cols + c] += first->mass[(size_t)l * n + j] / (j1 - j0);
        }
    char title[160], sub[160];
    snprintf(title, sizeof title, "Attention of the last %d queries by key position (first prompt, %d tokens)",
             first->window, n);
    snprintf(sub, sizeof sub, "each layer's row scaled to its maximum, log colour; %d positions a column", per);
    kvs_plot_heatmap h = {title, sub, "key position (tokens)", "layer", v, n_layers, cols, (double)n, 4,
                          (double)(n - first->window), "window"};
    kvs_status st = kvs_plot_heatmap_png(path, &h);
    free(v);
    return st;
}

static kvs_status concentration(const char *path, const kvs_calib_stats *s, const kvs_calib_result *r) {
    int L = s->n_layers;
    double *y = malloc(sizeof(double) * L * KVS_CALIB_GRID), marks[KVS_KV_PROFILE_MAX_TARGETS];
    kvs_plot_series *series = calloc((size_t)L, sizeof *series);
    char (*names)[32] = calloc((size_t)L + KVS_KV_PROFILE_MAX_TARGETS, 32);
    if (!y || !series || !names) {
        free(y), free(series), free(names);
        return kvs_fail(KVS_ERR_NOMEM, "calibrate: out of memory");
    }
    for (int l = 0; l < L; l++) {
        for (int k = 0; k < KVS_CALIB_GRID; k++) y[l * KVS_CALIB_GRID + k] = kvs_calib_curve(s, l, k);
        snprintf(names[l], 32, "layer %d", l);
        series[l] = (kvs_plot_series){names[l], y + l * KVS_CALIB_GRID};
    }
    const char *mark_names[KVS_KV_PROFILE_MAX_TARGETS];
    int n_marks = r->n_targets < KVS_KV_PROFILE_MAX_TARGETS ? r->n_targets : KVS_KV_PROFILE_MAX_TARGETS;
    for (int t = 0; t < n_marks; t++) {
        marks[t] = 1 / r->targets[t];
        snprintf(names[L + t], 32, "%gx", r->targets[t]);
        mark_names[t] = names[L + t];
    }
    char title[160];
    snprintf(title, sizeof title, "Attention mass kept vs keys kept (mean over %d prompts and the KV heads)", s->n_prompts);
    kvs_plot_curves c = {title, "keys kept (top by score, % of the prompt)", "mass kept", kvs_calib_kept, KVS_CALIB_GRID,
                         series, L, marks, mark_names, n_marks};
    kvs_status st = kvs_plot_fraction_curves_png(path, &c);
    free(y), free(series), free(names);
    return st;
}

kvs_status kvs_calib_plot_dir(const char *dir) {
    if (mkdir(dir, 0777) != 0 && errno != EEXIST)
        return kvs_fail(KVS_ERR_IO, "calibrate --plot %s: cannot make the folder: %s", dir, strerror(errno));
    return KVS_OK;
}

kvs_status kvs_calib_plots(const char *dir, const kvs_calib_stats *s, const kvs_calib_first *first,
                           const kvs_calib_result *r) {
    KVS_TRY(kvs_calib_plot_dir(dir));
    char path[4096];
    KVS_TRY(kvs_path_join(path, sizeof path, dir, "attention_heatmap.png"));
    KVS_TRY(heatmap(path, first, s->n_layers));
    KVS_TRY(kvs_path_join(path, sizeof path, dir, "concentration.png"));
    return concentration(path, s, r);
}
