/* The eval commands' shared parts: the lists of policies under test, one
 * greedy answer through the engine. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/eval.h"

int kvs_eval_policy_option(kvs_kv_policy *base, const char **profile_path, char *kinds, char *budgets, size_t cap,
                           int argc, char **argv, int *i) {
    const char *a = argv[*i];
    if (!strcmp(a, "--kv-policy") || !strcmp(a, "--kv-budget")) {
        if (*i + 1 >= argc || strlen(argv[*i + 1]) >= cap) return -1;
        strcpy(!strcmp(a, "--kv-policy") ? kinds : budgets, argv[++*i]);
        return 1;
    }
    return kvs_cli_policy_option(base, profile_path, argc, argv, i);
}

kvs_eval_options kvs_eval_options_default(void) {
    kvs_eval_options o = {.load = {.allow_tp = true}, .base = kvs_kv_policy_default(KVS_POLICY_FULL)};
    return o;
}

int kvs_eval_option(kvs_eval_options *o, int argc, char **argv, int *i) {
    int r = kvs_cli_load_option(&o->load, argc, argv, i);
    if (r == 0) r = kvs_eval_policy_option(&o->base, &o->load.kv_profile, o->kinds, o->budgets, sizeof o->kinds, argc, argv, i);
    if (r != 0) return r;
    const char *a = argv[*i];
    bool v = *i + 1 < argc;
    if (!strcmp(a, "--data") && v) o->data = argv[++*i];
    else if (!strcmp(a, "--limit") && v) o->limit = atoi(argv[++*i]);
    else if (!strcmp(a, "--json")) o->json = true;
    else return 0;
    return o->limit < 0 ? -1 : 1;
}

/* " profile=NAME" after a sparse policy's description when it has a profile
 * (kvs_kv_policy_describe does not say) */
static void name_profile(const kvs_kv_policy *p, const char *profile_path, char *name, size_t cap) {
    if (!p->profile || p->kind == KVS_POLICY_FULL) return;
    char file[512];
    size_t n = strlen(name);
    snprintf(name + n, cap - n, " profile=%s", kvs_cli_last_name(profile_path, file, sizeof file));
}

kvs_status kvs_eval_policies_build(const kvs_kv_policy *base, const char *kinds, const char *budgets,
                                   const char *profile_path, int n_layers, kvs_eval_policies *out) {
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
            name_profile(&p, profile_path, out->names[out->n], sizeof out->names[0]);
            out->n++;
            if (p.kind == KVS_POLICY_FULL) break;
        }
    }
    return KVS_OK;
}

kvs_status kvs_eval_engine_create(kvs_loaded *l, const kvs_kv_policy *base, int max_seqs, int room, int context,
                                  bool prefix_caching, kvs_engine **e) {
    kvs_engine_config ec = kvs_engine_config_default();
    ec.enable_prefix_caching = prefix_caching;
    ec.max_num_seqs = max_seqs;
    ec.max_num_batched_tokens = 2048;
    ec.default_policy = *base; /* its window: the largest the policies use */
    ec.default_policy.kind = KVS_POLICY_FULL;
    ec.kv_memory_bytes = kvs_cli_kv_bytes_for(l, context, room);
    return kvs_cli_engine(l, &ec, e);
}

kvs_status kvs_eval_engine(kvs_loaded *l, const kvs_eval_options *o, int room, bool prefix_caching,
                           kvs_eval_policies *P, kvs_engine **e) {
    *e = NULL;
    kvs_kv_policy base = o->base;
    base.profile = l->kv_profile;
    KVS_TRY(kvs_eval_policies_build(&base, o->kinds, o->budgets, o->load.kv_profile, l->cfg.n_layers, P));
    if (!l->tok) return kvs_fail(KVS_ERR_UNSUPPORTED, "the model has no tokenizer.json");
    return kvs_eval_engine_create(l, &o->base, 1, room, l->cfg.max_position_embeddings, prefix_caching, e);
}

char *kvs_eval_trimmed(const char *s) {
    while (*s == ' ' || *s == '\n' || *s == '\t' || *s == '\r') s++;
    size_t n = strlen(s);
    while (n && (s[n - 1] == ' ' || s[n - 1] == '\n' || s[n - 1] == '\t' || s[n - 1] == '\r')) n--;
    char *out = malloc(n + 1);
    if (!out) return NULL;
    memcpy(out, s, n);
    out[n] = 0;
    return out;
}

static void on_answer(void *user, const kvs_request_output *out) {
    kvs_eval_answer *a = user;
    if (out->n_tokens && a->n_seen == 0) a->t_first = kvs_now(), a->compression = out->prompt_compression;
    for (int i = 0; i < out->n_tokens; i++, a->n_seen++)
        if (a->n_seen >= a->n_forced && a->n < KVS_EVAL_MAX_NEW) a->ids[a->n++] = out->token_ids[i];
    if (out->finish == KVS_FINISH_ERROR) snprintf(a->error, sizeof a->error, "%s", out->error ? out->error : "error");
}

kvs_status kvs_eval_answer_run(const kvs_tokenizer *tok, kvs_engine *e, const kvs_request_params *rp,
                               kvs_eval_answer *a, char **text) {
    memset(a, 0, sizeof *a);
    a->n_forced = rp->n_forced;
    *text = NULL;
    KVS_TRY(kvs_engine_submit(e, rp, on_answer, a, NULL));
    kvs_status st = KVS_OK;
    while (st == KVS_OK && !kvs_engine_idle(e)) st = kvs_engine_step(e);
    if (st == KVS_OK && a->error[0]) st = kvs_fail(KVS_ERR_INTERNAL, "%s", a->error);
    char *raw = NULL;
    if (st == KVS_OK) st = kvs_tokenizer_decode(tok, a->ids, a->n, true, &raw, NULL);
    if (st == KVS_OK && !(*text = kvs_eval_trimmed(raw))) st = kvs_fail(KVS_ERR_NOMEM, "out of memory");
    free(raw);
    return st;
}

int kvs_eval_count_lines(FILE *f, int limit) {
    int n = 0, c;
    while ((c = fgetc(f)) != EOF) n += c == '\n';
    rewind(f);
    return limit && limit < n ? limit : n;
}
