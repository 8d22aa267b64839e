/* kvsparse eval ppl: perplexity of a continuation after a long prefix, for
 * the full cache and each KV policy: one request per policy through the
 * engine, the prefix its prompt, the continuation its forced tokens. */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/eval.h"
#include "engine/engine.h"

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

/* One policy's continuation: the forced tokens' logprobs summed. */
typedef struct {
    double logprob_sum;
    int n;
    char error[256];
} ppl_score;

static void on_tokens(void *user, const kvs_request_output *out) {
    ppl_score *sc = user;
    for (int i = 0; i < out->n_tokens; i++) sc->logprob_sum += out->logprobs[i];
    sc->n += out->n_tokens;
    if (out->finish == KVS_FINISH_ERROR) snprintf(sc->error, sizeof sc->error, "%s", out->error ? out->error : "error");
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
               "scored (one request per policy through the engine).\n");
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
        if (r == 0) r = kvs_eval_policy_option(&base, &lo.kv_profile, kinds, budgets, sizeof kinds, argc, argv, &i);
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
    int n = 0;
    kvs_engine *e = NULL;
    ppl_score *S = NULL;
    base.profile = l.kv_profile;
    kvs_status st = kvs_eval_policies_build(&base, kinds, budgets, lo.kv_profile, l.cfg.n_layers, &P);
    if (st == KVS_OK && !l.tok) st = kvs_fail(KVS_ERR_UNSUPPORTED, "the model has no tokenizer.json");
    if (st == KVS_OK) st = read_text(path, &text);
    kvs_encode_options eo = {.add_special_tokens = false, .parse_special = false};
    if (st == KVS_OK) st = kvs_tokenizer_encode(l.tok, text, strlen(text), eo, &ids, &n);
    if (st == KVS_OK && n < prefix + cont)
        st = kvs_fail(KVS_ERR_INVALID, "%s has %d tokens; --prefix %d + --continuation %d needs more", path, n, prefix, cont);
    if (st == KVS_OK && prefix + cont > l.cfg.max_position_embeddings)
        st = kvs_fail(KVS_ERR_INVALID, "--prefix + --continuation exceeds the context %d", l.cfg.max_position_embeddings);
    /* every policy a request through the engine, all at once: the prefix its
       prompt (prefilled in chunks of 2048 tokens, then compressed), the
       continuation its forced tokens */
    if (st == KVS_OK) st = kvs_eval_engine_create(&l, &base, &P, P.n, P.n, prefix + cont, true, &e);
    if (st == KVS_OK && !(S = calloc((size_t)P.n, sizeof *S))) st = kvs_fail(KVS_ERR_NOMEM, "eval ppl: out of memory");
    for (int p = 0; st == KVS_OK && p < P.n; p++) {
        kvs_request_params rp = {.prompt_ids = ids, .n_prompt = prefix, .sampling = kvs_sampling_default(),
                                 .max_tokens = cont, .ignore_eos = true, .logprobs = 1, .policy = &P.list[p],
                                 .forced_ids = ids + prefix, .n_forced = cont};
        st = kvs_engine_submit(e, &rp, on_tokens, &S[p], NULL);
    }
    while (st == KVS_OK && !kvs_engine_idle(e)) st = kvs_engine_step(e);
    json_t *arr = json_array();
    for (int p = 0; st == KVS_OK && p < P.n; p++) {
        if (S[p].error[0] || S[p].n != cont) {
            st = kvs_fail(KVS_ERR_INTERNAL, "%s: %s", P.names[p], S[p].error[0] ? S[p].error : "continuation cut short");
            break;
        }
        double ppl = exp(-S[p].logprob_sum / cont);
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
    free(text), free(ids), free(S);
    kvs_engine_destroy(e);
    kvs_cli_unload(&l);
    return st == KVS_OK ? 0 : kvs_cli_error();
}
