/* Layer policies: presets, parsing and per-layer budgets (SnapKV uniform,
 * PyramidKV linear, StreamingLLM). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv/kv_internal.h"

static const char *kind_names[] = {"full", "snapkv", "pyramidkv", "streamingllm"};

kvs_kv_policy kvs_kv_policy_default(kvs_policy_kind kind) {
    return (kvs_kv_policy){.kind = kind, .budget_tokens = 0, .budget_fraction = 0.10f, .full_layers = 0,
                           .window = 16, .pool = 7, .min_prompt = 64, .sinks = 4,
                           .pyramid_beta = 1.5f};
}

const char *kvs_kv_policy_name(kvs_policy_kind kind) {
    return (unsigned)kind < sizeof kind_names / sizeof kind_names[0] ? kind_names[kind] : "?";
}

kvs_status kvs_kv_policy_kind_parse(const char *name, kvs_policy_kind *kind) {
    for (int i = 0; i < (int)(sizeof kind_names / sizeof kind_names[0]); i++)
        if (!strcmp(name, kind_names[i])) {
            *kind = (kvs_policy_kind)i;
            return KVS_OK;
        }
    return kvs_fail(KVS_ERR_INVALID, "unknown KV policy '%s' (expected full, snapkv, pyramidkv or streamingllm)",
                    name);
}

/* Digits, at most one '.', then an optional '%': nothing strtod would also
 * take (signs, spaces, hex, exponents, inf, nan). */
static bool plain_decimal(const char *t) {
    int digits = 0, dots = 0;
    for (; *t && *t != '%'; t++) {
        if (*t == '.') dots++;
        else if (*t >= '0' && *t <= '9') digits++;
        else return false;
    }
    return digits > 0 && dots <= 1 && (!*t || !t[1]);
}

kvs_status kvs_kv_budget_parse(const char *text, kvs_kv_policy *p) {
    char *end;
    double v = plain_decimal(text) ? strtod(text, &end) : 0;
    bool percent = v > 0 && *end == '%';
    if (!plain_decimal(text) || (*end && !(percent && !end[1])) || !isfinite(v) || v <= 0)
        return kvs_fail(KVS_ERR_INVALID, "KV budget '%s': expected a fraction (0.1), a percentage (10%%) or tokens (256)",
                        text);
    if (percent) v /= 100;
    if (percent || v < 1) {
        if (v > 1) return kvs_fail(KVS_ERR_INVALID, "KV budget '%s' is over 100%%", text);
        p->budget_fraction = (float)v;
        p->budget_tokens = 0;
    } else {
        if (v != floor(v) || v > 1e9) return kvs_fail(KVS_ERR_INVALID, "KV budget '%s': tokens must be a whole number", text);
        p->budget_tokens = (int)v;
    }
    return KVS_OK;
}

kvs_status kvs_kv_policy_validate(const kvs_kv_policy *p, int n_layers) {
    if ((unsigned)p->kind > KVS_POLICY_STREAMINGLLM) return kvs_fail(KVS_ERR_INVALID, "unknown KV policy kind");
    if (p->kind == KVS_POLICY_FULL) return KVS_OK;
    if (p->budget_tokens < 0 || (p->budget_tokens == 0 && !(p->budget_fraction > 0 && p->budget_fraction <= 1)))
        return kvs_fail(KVS_ERR_INVALID, "kv_budget must be a fraction in (0, 1] or a positive number of tokens");
    if (p->window < 1 || p->window > KVS_KV_MAX_WINDOW)
        return kvs_fail(KVS_ERR_INVALID, "kv_window must be in [1, %d]", KVS_KV_MAX_WINDOW);
    if (p->pool < 1 || p->pool % 2 == 0 || p->pool > 255)
        return kvs_fail(KVS_ERR_INVALID, "kv_pool must be an odd number in [1, 255]");
    if (p->full_layers < 0 || p->full_layers > n_layers)
        return kvs_fail(KVS_ERR_INVALID, "kv_full_layers must be in [0, %d]", n_layers);
    if (p->min_prompt < 0) return kvs_fail(KVS_ERR_INVALID, "kv_min_prompt must be >= 0");
    if (p->sinks < 0 || p->sinks > 1024) return kvs_fail(KVS_ERR_INVALID, "kv_sinks must be in [0, 1024]");
    if (!(p->pyramid_beta >= 1 && p->pyramid_beta <= 1000))
        return kvs_fail(KVS_ERR_INVALID, "kv_pyramid_beta must be in [1, 1000]");
    if (p->profile && p->profile->n_layers != n_layers)
        return kvs_fail(KVS_ERR_INVALID, "kv profile: %d layers, the model has %d", p->profile->n_layers, n_layers);
    return KVS_OK;
}

/* Splits `total` whole entries among n layers in proportion to weight[] (> 0),
 * each within [lo, hi[l]] (lo <= hi): water-filling (a layer that a clamp holds
 * gives its share to the others), then the largest remainders take the last
 * units, so the sum is exactly `total` whenever n * lo <= total <= sum of hi. */
static void apportion(long total, const double *weight, int lo, const int *hi, int n, int *out) {
    bool *fixed = calloc((size_t)n, sizeof(bool));
    double *want = malloc(sizeof(double) * (size_t)n);
    if (!fixed || !want) { /* out of memory: the even split, clamped */
        for (int l = 0; l < n; l++) out[l] = (int)(total / n) < lo ? lo : (int)(total / n) > hi[l] ? hi[l] : (int)(total / n);
        free(fixed), free(want);
        return;
    }
    for (bool again = true; again;) { /* at most n rounds: each fixes a layer or ends */
        again = false;
        long left = total;
        double w_free = 0;
        for (int l = 0; l < n; l++)
            if (fixed[l]) left -= out[l];
            else w_free += weight[l];
        for (int l = 0; l < n && !again; l++) {
            if (fixed[l]) continue;
            want[l] = w_free > 0 ? (double)left * weight[l] / w_free : 0;
            if (want[l] < lo || want[l] > hi[l]) {
                out[l] = want[l] < lo ? lo : hi[l];
                fixed[l] = again = true;
            }
        }
    }
    long sum = 0;
    for (int l = 0; l < n; l++) {
        if (!fixed[l]) out[l] = (int)floor(want[l]);
        sum += out[l];
    }
    while (sum < total) { /* the largest remainder first (the lower layer on a tie) */
        int best = -1;
        double rem = -1;
        for (int l = 0; l < n; l++)
            if (!fixed[l] && out[l] < hi[l] && want[l] - out[l] > rem) rem = want[l] - out[l], best = l;
        if (best < 0) break;
        out[best]++, want[best] = out[best], sum++;
    }
    free(fixed), free(want);
}

int kvs_kv_profile_target(const kvs_kv_profile *p, double compression) {
    int best = 0;
    for (int t = 1; t < p->n_targets; t++)
        if (fabs(log(p->compression[t] / compression)) < fabs(log(p->compression[best] / compression))) best = t;
    return best;
}

void kvs_kv_policy_budgets(const kvs_kv_policy *p, int n_layers, int prompt_len, int *budgets) {
    int floor_budget = p->kind == KVS_POLICY_STREAMINGLLM ? p->sinks + 1 : p->window;
    int threshold = p->min_prompt > 2 * p->window ? p->min_prompt : 2 * p->window;
    bool off = p->kind == KVS_POLICY_FULL || prompt_len < threshold;
    int B = p->budget_tokens > 0 ? p->budget_tokens : (int)lround(p->budget_fraction * prompt_len);
    int first = p->full_layers < n_layers ? p->full_layers : n_layers, m = n_layers - first;
    for (int l = 0; l < n_layers; l++) budgets[l] = -1;
    if (off || m == 0) return;
    double *weight = malloc(sizeof(double) * m);
    int *hi = malloc(sizeof(int) * m);
    if (!weight || !hi) {
        for (int l = first; l < n_layers; l++) budgets[l] = B < floor_budget ? floor_budget : B;
        free(weight), free(hi);
        return;
    }
    int t = p->profile ? kvs_kv_profile_target(p->profile, (double)prompt_len / (B > 0 ? B : 1)) : 0;
    for (int i = 0; i < m; i++) {
        int l = first + i;
        weight[i] = 1;
        if (p->profile && p->profile->n_layers == n_layers) {
            weight[i] = p->profile->share[t][l];
        } else if (p->kind == KVS_POLICY_PYRAMIDKV && m > 1) {
            /* PyramidKV: beyond the window, budgets fall linearly from 2(B-w) - min at the
               lowest sparse layer to min = (B-w)/beta at the highest; the mean stays B.
               The paper's beta (20, for 32 layers) starves the top layers of shallow
               models; the default is milder (docs/SPARSITY.md has the measurements). */
            double extra = B - p->window > 0 ? B - p->window : 0, beta = p->pyramid_beta;
            double lo = extra / beta, top = 2 * extra - lo;
            weight[i] = p->window + top - (top - lo) * i / (m - 1);
        }
        hi[i] = prompt_len > floor_budget ? prompt_len : floor_budget; /* a whole layer at most */
    }
    /* the sparse layers together keep m x B entries per KV head, exactly */
    apportion((long)m * B, weight, floor_budget, hi, m, budgets + first);
    free(weight), free(hi);
}

int kvs_kv_compaction_spare(const int *budgets, int n_layers, int block_size, int prompt_len) {
    int spare = 0;
    for (int l = 0; l < n_layers; l++)
        if (budgets[l] >= 0 && budgets[l] < prompt_len) spare += (budgets[l] + block_size - 1) / block_size;
    return spare;
}

kvs_kv_seq_blocks kvs_kv_policy_seq_blocks(const kvs_kv_policy *p, int n_layers, int block_size, bool prefix_caching,
                                           int prompt_len, int max_new) {
    int *budgets = malloc(sizeof(int) * (size_t)(n_layers > 0 ? n_layers : 1));
    for (int l = 0; budgets && l < n_layers; l++) budgets[l] = -1;
    if (budgets) kvs_kv_policy_budgets(p, n_layers, prompt_len, budgets); /* out of memory: all full, an upper bound */
    int len = prompt_len + max_new;
    int64_t prompt_blocks = 0, held = 0;
    for (int l = 0; l < n_layers; l++) {
        int b = budgets ? budgets[l] : -1;
        bool sparse = b >= 0 && b < prompt_len;
        int kept = !sparse ? len : b + p->window < len ? b + p->window : len;
        prompt_blocks += (prompt_len + block_size - 1) / block_size;
        held += (kept + block_size - 1) / block_size;
    }
    int64_t spare = prefix_caching && budgets ? kvs_kv_compaction_spare(budgets, n_layers, block_size, prompt_len) : 0;
    free(budgets);
    kvs_kv_seq_blocks r = {.peak = prompt_blocks + spare > held ? prompt_blocks + spare : held, .held = held};
    return r;
}

void kvs_kv_policy_describe(const kvs_kv_policy *p, char *buf, size_t cap) {
    if (p->kind == KVS_POLICY_FULL) {
        snprintf(buf, cap, "full");
        return;
    }
    char budget[32];
    if (p->budget_tokens > 0) snprintf(budget, sizeof budget, "%d", p->budget_tokens);
    else snprintf(budget, sizeof budget, "%g%%", 100.0 * p->budget_fraction);
    snprintf(buf, cap, "%s budget=%s full_layers=%d window=%d pool=%d", kvs_kv_policy_name(p->kind), budget,
             p->full_layers, p->window, p->pool);
}
