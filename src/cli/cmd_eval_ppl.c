/* kvsparse eval ppl: perplexity of a continuation after a long prefix, for
 * the full cache and each KV policy (the prefix is prefilled once). */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/eval.h"

int kvs_cmd_eval_ppl(int argc, char **argv);

/* The text: a plain file, or for a .jsonl file the "prompt" field of its first line. */
static kvs_status read_text(const char *path, char **text) {
    size_t len;
    KVS_TRY(kvs_read_file(path, text, &len));
    size_t pl = strlen(path);
    if (pl > 6 && !strcmp(path + pl - 6, ".jsonl")) {
        char *nl = strchr(*text, '\n');
        if (nl) *nl = 0;
        json_error_t err;
        json_t *o = json_loads(*text, 0, &err);
        const char *p = json_string_value(json_object_get(o, "prompt"));
        free(*text);
        *text = p ? strdup(p) : NULL;
        json_decref(o);
        if (!*text) return kvs_fail(KVS_ERR_FORMAT, "%s: first line has no \"prompt\" string", path);
    }
    return KVS_OK;
}

static double log_softmax(const float *x, int n, int i) {
    float m = x[0];
    for (int j = 1; j < n; j++) m = x[j] > m ? x[j] : m;
    double s = 0;
    for (int j = 0; j < n; j++) s += exp((double)x[j] - m);
    return (double)x[i] - m - log(s);
}

static void usage(FILE *f) {
    fprintf(f, "usage: kvsparse eval ppl -m MODEL_DIR --text FILE [options]\n"
               "Perplexity of --continuation tokens after a --prefix, for the full cache and each KV policy.\n"
               "  --text FILE            the text: a plain file, or the \"prompt\" of a .jsonl file's first line\n"
               "  --prefix N             tokens prefilled (and compressed) before the continuation (default 2048)\n"
               "  --continuation N       tokens scored after the prefix, teacher-forced (default 256)\n"
               "  --json                 print one JSON array\n"
               KVS_CLI_LOAD_HELP KVS_CLI_DEVICE_HELP KVS_CLI_TP_HELP KVS_CLI_POLICY_HELP
               "In eval, --kv-policy and --kv-budget take comma-separated lists: every combination is\n"
               "scored over one shared prefill.\n");
}

int kvs_cmd_eval_ppl(int argc, char **argv) {
    kvs_load_options lo = {.allow_tp = true};
    kvs_kv_policy base = kvs_kv_policy_default(KVS_POLICY_FULL);
    char kinds[512] = "", budgets[512] = "";
    const char *path = NULL;
    int prefix = 2048, cont = 256;
    bool as_json = false;
    for (int i = 1; i < argc; i++) {
        int r = kvs_cli_load_option(&lo, argc, argv, &i);
        if (r == 0) r = kvs_eval_policy_option(&base, kinds, budgets, sizeof kinds, argc, argv, &i);
        if (r > 0) continue;
        if (r == 0 && !strcmp(argv[i], "--text") && i + 1 < argc) path = argv[++i];
        else if (r == 0 && !strcmp(argv[i], "--prefix") && i + 1 < argc) prefix = atoi(argv[++i]);
        else if (r == 0 && !strcmp(argv[i], "--continuation") && i + 1 < argc) cont = atoi(argv[++i]);
        else if (r == 0 && !strcmp(argv[i], "--json")) as_json = true;
        else if (r == 0 && (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h"))) { usage(stdout); return 0; }
        else { fprintf(stderr, "kvsparse eval ppl: bad or incomplete option '%s'\n", argv[i]); usage(stderr); return 2; }
    }
    if (!path || prefix < 1 || cont < 1) {
        usage(stderr);
        return 2;
    }
    kvs_loaded l;
    if (kvs_cli_load(&lo, &l) != KVS_OK) return kvs_cli_error();
    kvs_eval_policies P;
    char *text = NULL;
    int32_t *ids = NULL;
    int n = 0, seq = -1;
    kvs_runner *g = NULL; /* N >= 1 ranks */
    float *logits = malloc(sizeof(float) * l.cfg.vocab_size), *first = malloc(sizeof(float) * l.cfg.vocab_size);
    kvs_status st = kvs_eval_policies_build(&base, kinds, budgets, l.cfg.n_layers, &P);
    if (st == KVS_OK && !l.tok) st = kvs_fail(KVS_ERR_UNSUPPORTED, "the model has no tokenizer.json");
    if (st == KVS_OK) st = read_text(path, &text);
    kvs_encode_options eo = {.add_special_tokens = false, .parse_special = false};
    if (st == KVS_OK) st = kvs_tokenizer_encode(l.tok, text, strlen(text), eo, &ids, &n);
    if (st == KVS_OK && n < prefix + cont)
        st = kvs_fail(KVS_ERR_INVALID, "%s has %d tokens; --prefix %d + --continuation %d needs more", path, n, prefix, cont);
    if (st == KVS_OK && prefix + cont > l.cfg.max_position_embeddings)
        st = kvs_fail(KVS_ERR_INVALID, "--prefix + --continuation exceeds the context %d", l.cfg.max_position_embeddings);
    if (st == KVS_OK) st = kvs_eval_group(&l, prefix + cont, base.window, &g);
    if (st == KVS_OK) st = kvs_eval_prefill(g, ids, prefix, base.window, 2048, first, &seq);
    json_t *arr = json_array();
    for (int p = 0; st == KVS_OK && p < P.n; p++) {
        int fork;
        st = kvs_eval_fork(g, seq, &P.list[p], prefix, &fork);
        if (st != KVS_OK) break;
        double nll = 0;
        memcpy(logits, first, sizeof(float) * l.cfg.vocab_size);
        for (int t = 0; st == KVS_OK && t < cont; t++) { /* teacher forcing */
            nll -= log_softmax(logits, l.cfg.vocab_size, ids[prefix + t]);
            if (t + 1 < cont) st = kvs_eval_step(g, fork, ids[prefix + t], prefix + t, logits);
        }
        kvs_runner_seq_free(g, fork);
        if (st != KVS_OK) break;
        double ppl = exp(nll / cont);
        json_array_append_new(arr, json_pack("{s:s, s:f, s:i, s:i}", "policy", P.names[p], "ppl", ppl, "prefix", prefix,
                                             "continuation", cont));
        if (!as_json) printf("%-52s ppl %.3f (prefix %d, continuation %d)\n", P.names[p], ppl, prefix, cont);
    }
    if (st == KVS_OK && as_json) {
        char *s = json_dumps(arr, JSON_INDENT(1));
        printf("%s\n", s);
        free(s);
    }
    json_decref(arr);
    free(text), free(ids), free(logits), free(first);
    kvs_cli_unload(&l); /* the runner and its KV caches too */
    return st == KVS_OK ? 0 : kvs_cli_error();
}
