/* The eval commands' shared parts: policy lists and one prefill shared by all policies. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/eval.h"

int kvs_eval_policy_option(kvs_kv_policy *base, char *kinds, char *budgets, size_t cap, int argc, char **argv, int *i) {
    const char *a = argv[*i];
    if (!strcmp(a, "--kv-policy") || !strcmp(a, "--kv-budget")) {
        if (*i + 1 >= argc || strlen(argv[*i + 1]) >= cap) return -1;
        strcpy(!strcmp(a, "--kv-policy") ? kinds : budgets, argv[++*i]);
        return 1;
    }
    return kvs_cli_policy_option(base, argc, argv, i);
}

kvs_status kvs_eval_policies_build(const kvs_kv_policy *base, const char *kinds, const char *budgets,
                                   int n_layers, kvs_eval_policies *out) {
    out->n = 0;
    char kbuf[512], bbuf[512], *ks, *bs;
    snprintf(kbuf, sizeof kbuf, "%s", kinds[0] ? kinds : "full");
    bool have_full = false;
    for (char *k = strtok_r(kbuf, ",", &ks); k; k = strtok_r(NULL, ",", &ks)) {
        kvs_kv_policy p = *base;
        KVS_TRY(kvs_kv_policy_kind_parse(k, &p.kind));
        snprintf(bbuf, sizeof bbuf, "%s", budgets[0] ? budgets : "10%");
        for (char *b = strtok_r(bbuf, ",", &bs); b; b = strtok_r(NULL, ",", &bs)) {
            if (p.kind == KVS_POLICY_FULL && have_full) break;
            have_full |= p.kind == KVS_POLICY_FULL;
            KVS_TRY(kvs_kv_budget_parse(b, &p));
            KVS_TRY(kvs_kv_policy_validate(&p, n_layers));
            if (out->n == KVS_EVAL_MAX_POLICIES) return kvs_fail(KVS_ERR_INVALID, "too many policies (max %d)", KVS_EVAL_MAX_POLICIES);
            out->list[out->n] = p;
            kvs_kv_policy_describe(&p, out->names[out->n], sizeof out->names[0]);
            out->n++;
            if (p.kind == KVS_POLICY_FULL) break;
        }
    }
    return KVS_OK;
}

kvs_status kvs_eval_group(kvs_loaded *l, int max_tokens, int window, kvs_runner **g) {
    *g = l->runner;
    kvs_kv_config kc = {.n_layers = l->cfg.n_layers, .n_kv_heads = l->cfg.n_kv_heads, .head_dim = l->cfg.head_dim,
                        .n_heads = l->cfg.n_heads, .block_size = 16, .max_seqs = 2, .max_window = window};
    kc.n_blocks = (int64_t)((max_tokens + 15) / 16 + 1) * l->cfg.n_layers * 2;
    return kvs_runner_kv_create(*g, &kc); /* each rank: its KV heads, the same blocks */
}

kvs_status kvs_eval_prefill(kvs_runner *g, const int32_t *ids, int n, int window, int chunk, float *logits,
                            int *seq) {
    *seq = kvs_runner_seq_create(g);
    if (*seq < 0) return KVS_ERR_NOMEM;
    /* capture the window in every layer, compress nothing (a budget of the whole prompt) */
    kvs_kv_policy capture = kvs_kv_policy_default(KVS_POLICY_SNAPKV);
    capture.budget_fraction = 1.0f;
    capture.window = window;
    capture.min_prompt = 0;
    kvs_status st = kvs_runner_set_policy(g, *seq, &capture, n);
    int32_t *pos = malloc(sizeof(int32_t) * (chunk < n ? chunk : n));
    if (!pos && st == KVS_OK) st = kvs_fail(KVS_ERR_NOMEM, "eval: out of memory");
    for (int s = 0; st == KVS_OK && s < n; s += chunk) {
        int len = n - s < chunk ? n - s : chunk;
        int32_t qs[2] = {0, len};
        uint8_t want = s + len == n;
        for (int i = 0; i < len; i++) pos[i] = s + i;
        st = kvs_runner_reserve(g, *seq, len);
        kvs_batch b = {len, 1, ids + s, pos, qs, seq, &want};
        if (st == KVS_OK) st = kvs_runner_step(g, &b, logits);
    }
    free(pos);
    return st;
}

kvs_status kvs_eval_fork(kvs_runner *g, int seq, const kvs_kv_policy *p, int prompt_len, int *fork) {
    KVS_TRY(kvs_runner_fork(g, seq, fork));
    kvs_status st = kvs_runner_set_policy(g, *fork, p, prompt_len);
    if (st == KVS_OK) st = kvs_runner_sparsify(g, *fork);
    if (st != KVS_OK) {
        kvs_runner_seq_free(g, *fork);
        *fork = -1;
    }
    return st;
}

kvs_status kvs_eval_step(kvs_runner *g, int seq, int32_t id, int pos, float *logits) {
    KVS_TRY(kvs_runner_reserve(g, seq, 1));
    int32_t qs[2] = {0, 1};
    uint8_t want = 1;
    kvs_batch b = {1, 1, &id, &pos, qs, &seq, &want};
    return kvs_runner_step(g, &b, logits);
}
