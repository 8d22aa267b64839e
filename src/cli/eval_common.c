/* The eval commands' shared parts: the lists of policies under test, one
 * greedy answer through the engine. */
#include <errno.h>
#include <jansson.h>
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

kvs_status kvs_eval_engine_create(kvs_loaded *l, const kvs_kv_policy *base, const kvs_eval_policies *P, int max_seqs,
                                  int room, int context, bool prefix_caching, kvs_engine **e) {
    kvs_engine_config ec = kvs_engine_config_default();
    ec.enable_prefix_caching = prefix_caching;
    ec.max_num_seqs = max_seqs;
    ec.max_num_batched_tokens = 2048;
    ec.default_policy = *base; /* its window: the largest the policies use */
    ec.default_policy.kind = KVS_POLICY_FULL;
    ec.kv_memory_bytes = kvs_cli_kv_bytes_for(l, &ec.default_policy, prefix_caching, context, 0, room);
    for (int i = 0; i < P->n; i++) {
        size_t bytes = kvs_cli_kv_bytes_for(l, &P->list[i], prefix_caching, context, 0, room);
        if (bytes > ec.kv_memory_bytes) ec.kv_memory_bytes = bytes;
    }
    return kvs_cli_engine(l, &ec, e);
}

kvs_status kvs_eval_engine(kvs_loaded *l, const kvs_eval_options *o, int room, bool prefix_caching,
                           kvs_eval_policies *P, kvs_engine **e) {
    *e = NULL;
    kvs_kv_policy base = o->base;
    base.profile = l->kv_profile;
    KVS_TRY(kvs_eval_policies_build(&base, o->kinds, o->budgets, o->load.kv_profile, l->cfg.n_layers, P));
    if (!l->tok) return kvs_fail(KVS_ERR_UNSUPPORTED, "the model has no tokenizer.json");
    return kvs_eval_engine_create(l, &o->base, P, 1, room, l->cfg.max_position_embeddings, prefix_caching, e);
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

int kvs_eval_bucket(const char *id, int n_prompt) {
    const char *dash = id ? strchr(id, '-') : NULL;
    int b = dash ? atoi(dash + 1) : 0;
    return b > 0 ? b : (n_prompt + 500) / 1000 * 1000;
}

void kvs_eval_lines_free(kvs_eval_lines *l) {
    for (int i = 0; l->text && i < l->n; i++) free(l->text[i]);
    free(l->text);
    free(l->line_no);
    memset(l, 0, sizeof *l);
}

#define MAX_LENGTHS 64

/* limit lines of all[n] taken the first of each length in turn, into order[]; says which on stderr. */
static int spread(char **all, int n, int limit, int *order) {
    int bucket[MAX_LENGTHS], count[MAX_LENGTHS] = {0}, taken[MAX_LENGTHS] = {0}, n_buckets = 0;
    int *of = malloc(sizeof(int) * (size_t)n);
    if (!of) return -1;
    for (int i = 0; i < n; i++) {
        json_t *o = json_loads(all[i], 0, NULL);
        json_int_t tokens = json_integer_value(json_object_get(o, "n_prompt_tokens"));
        int b = kvs_eval_bucket(json_string_value(json_object_get(o, "id")), (int)tokens), k = 0;
        json_decref(o);
        while (k < n_buckets && bucket[k] != b) k++;
        if (k == n_buckets && n_buckets < MAX_LENGTHS) bucket[n_buckets++] = b;
        if (k == MAX_LENGTHS) k = MAX_LENGTHS - 1; /* more lengths than that: the last class takes the rest */
        of[i] = k;
        count[k]++;
    }
    int got = 0;
    while (got < limit) { /* a round takes the next unused line of each length */
        int before = got;
        for (int k = 0; k < n_buckets && got < limit; k++) {
            if (taken[k] == count[k]) continue;
            int seen = 0;
            for (int i = 0; i < n; i++)
                if (of[i] == k && seen++ == taken[k]) {
                    order[got++] = i;
                    break;
                }
            taken[k]++;
        }
        if (got == before) break;
    }
    char msg[1024];
    int len = snprintf(msg, sizeof msg, "eval: --limit %d of %d samples, spread over the prompt lengths:", limit, n);
    for (int k = 0; k < n_buckets && len < (int)sizeof msg; k++)
        len += snprintf(msg + len, sizeof msg - len, "%s %d of %d tokens", k ? "," : "", taken[k], bucket[k]);
    kvs_log(KVS_LOG_INFO, "%s", msg);
    free(of);
    return got;
}

kvs_status kvs_eval_lines_read(const char *path, int limit, kvs_eval_lines *out) {
    memset(out, 0, sizeof *out);
    FILE *f = fopen(path, "rb");
    if (!f) return kvs_fail(KVS_ERR_IO, "%s: cannot open", path);
    char **all = NULL, *line = NULL;
    int *no = NULL, n = 0, cap_all = 0, line_no = 0;
    size_t cap = 0;
    ssize_t len;
    kvs_status st = KVS_OK;
    while (st == KVS_OK && (len = getline(&line, &cap, f)) > 0) {
        line_no++;
        if (strspn(line, " \t\r\n") == (size_t)len) continue;
        if (n == cap_all) {
            cap_all = cap_all ? 2 * cap_all : 256;
            char **a = realloc(all, sizeof(char *) * cap_all);
            int *b = a ? realloc(no, sizeof(int) * cap_all) : NULL;
            if (a) all = a;
            if (b) no = b;
            if (!a || !b) st = kvs_fail(KVS_ERR_NOMEM, "out of memory");
        }
        if (st == KVS_OK && !(all[n] = strdup(line))) st = kvs_fail(KVS_ERR_NOMEM, "out of memory");
        if (st == KVS_OK) no[n++] = line_no;
    }
    free(line);
    if (st == KVS_OK && ferror(f)) st = kvs_fail(KVS_ERR_IO, "%s: cannot be read (%s)", path, strerror(errno));
    else if (st == KVS_OK && n == 0) st = kvs_fail(KVS_ERR_FORMAT, "%s: no samples (an empty file)", path);
    fclose(f);
    out->text = all, out->line_no = no, out->n = n;
    if (st != KVS_OK || limit <= 0 || limit >= n) {
        if (st != KVS_OK) kvs_eval_lines_free(out);
        return st;
    }
    int *order = malloc(sizeof(int) * (size_t)limit);
    char **text = malloc(sizeof(char *) * (size_t)limit);
    int *line_nos = malloc(sizeof(int) * (size_t)limit);
    int got = order && text && line_nos ? spread(all, n, limit, order) : -1;
    if (got < 0) {
        free(order), free(text), free(line_nos);
        kvs_eval_lines_free(out);
        return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    }
    for (int i = 0; i < got; i++) {
        text[i] = all[order[i]], line_nos[i] = no[order[i]];
        all[order[i]] = NULL;
    }
    for (int i = 0; i < n; i++) free(all[i]);
    free(all), free(no), free(order);
    out->text = text, out->line_no = line_nos, out->n = got;
    return KVS_OK;
}
