/* kvsparse eval retrieval: long-context retrieval accuracy of KV policies
 * against the full cache: each policy's greedy answer to each prompt through
 * the engine. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "cli/eval.h"
#include "engine/engine.h"

int kvs_cmd_eval_ppl(int argc, char **argv);       /* cmd_eval_ppl.c */
int kvs_cmd_eval_multiturn(int argc, char **argv); /* cmd_eval_multiturn.c */

#define MAX_BUCKETS 16

typedef struct {
    int bucket[MAX_BUCKETS], correct[MAX_BUCKETS], count[MAX_BUCKETS];
    int n_buckets, total, n_correct, n_agree_hf;
    double ratio_sum; /* compression ratio after the prompt, summed */
} policy_score;

/* the table's columns, under the table and in --help */
#define TABLE_LEGEND                                                                                   \
    "accuracy: exact-match answers; ratio: compression (KV entries a full cache would hold / entries\n" \
    "kept, after the prompt); 1000, 2000, ...: accuracy on the prompts of about that many tokens;\n"    \
    "hf-agree: answers equal to Hugging Face transformers' full-cache answer (the samples' hf_full_answer).\n"

static void usage(FILE *f) {
    fprintf(f, "usage: kvsparse eval retrieval -m MODEL_DIR --data FILE.jsonl [options]\n"
               "Retrieval accuracy of KV policies: greedy answers (16 tokens at most) against each sample's answer.\n"
               "  --data FILE.jsonl      the samples: prompt, answer, hf_full_answer (../shared/eval/)\n"
               "  --limit N              N samples, spread over the prompt lengths (the first of each in turn)\n"
               "  --json                 one JSON object (an array when several policies)\n"
               "  --answers FILE         write every sample's answer per policy (JSON lines)\n"
               KVS_CLI_LOAD_HELP KVS_CLI_DEVICE_HELP KVS_CLI_TP_HELP KVS_CLI_POLICY_HELP
               "In eval, --kv-policy and --kv-budget take comma-separated lists: every combination is\n"
               "evaluated (one request per policy and prompt through the engine). The table's columns:\n" TABLE_LEGEND);
}

static void eval_usage(FILE *f) {
    fprintf(f, "usage: kvsparse eval (retrieval | multiturn | ppl) [options]\n"
               "  retrieval  long-context retrieval accuracy of KV policies (--data FILE.jsonl)\n"
               "  multiturn  follow-up accuracy after a compressed first turn: reprefill, reuse, prefix-cache\n"
               "  ppl        perplexity of a text's continuation after a long prefix (--text FILE)\n"
               "Run 'kvsparse eval COMMAND --help' for a command's options.\n");
}

static int bucket_index(policy_score *s, int bucket) {
    for (int i = 0; i < s->n_buckets; i++)
        if (s->bucket[i] == bucket) return i;
    if (s->n_buckets == MAX_BUCKETS) return MAX_BUCKETS - 1;
    s->bucket[s->n_buckets] = bucket;
    return s->n_buckets++;
}

/* The greedy answer (up to KVS_EVAL_MAX_NEW tokens, to EOS) under policy p, through the engine. */
static kvs_status answer(kvs_loaded *l, kvs_engine *e, const int32_t *ids, int n, const kvs_kv_policy *p,
                         kvs_eval_answer *a, char **text) {
    kvs_request_params rp = {.prompt_ids = ids, .n_prompt = n, .sampling = kvs_sampling_default(),
                             .max_tokens = KVS_EVAL_MAX_NEW, .policy = p};
    return kvs_eval_answer_run(l->tok, e, &rp, a, text);
}

static json_t *score_json(const char *name, const policy_score *s, int n_samples) {
    json_t *o = json_object(), *by = json_object();
    for (int i = 0; i < s->n_buckets; i++) {
        char key[32];
        snprintf(key, sizeof key, "%d", s->bucket[i]);
        json_object_set_new(by, key, json_pack("{s:f, s:i}", "accuracy", s->count[i] ? (double)s->correct[i] / s->count[i] : 0.0,
                                               "count", s->count[i]));
    }
    json_object_set_new(o, "policy", json_string(name));
    json_object_set_new(o, "accuracy", json_real(s->total ? (double)s->n_correct / s->total : 0));
    json_object_set_new(o, "agreement_with_hf_full", json_real(s->total ? (double)s->n_agree_hf / s->total : 0));
    json_object_set_new(o, "by_length", by);
    json_object_set_new(o, "compression_ratio", json_real(s->total ? s->ratio_sum / s->total : 1));
    json_object_set_new(o, "samples", json_integer(n_samples));
    return o;
}

static void print_table(const kvs_eval_policies *P, const policy_score *S, double tok_s) {
    int w = 52; /* or the longest policy name */
    for (int p = 0; p < P->n; p++) w = (int)strlen(P->names[p]) > w ? (int)strlen(P->names[p]) : w;
    printf("%-*s %8s %7s", w, "policy", "accuracy", "ratio");
    for (int i = 0; i < S[0].n_buckets; i++) printf(" %7d", S[0].bucket[i]);
    printf("  hf-agree\n");
    for (int p = 0; p < P->n; p++) {
        const policy_score *s = &S[p];
        printf("%-*s %7.1f%% %6.1fx", w, P->names[p], 100.0 * s->n_correct / (s->total ? s->total : 1),
               s->ratio_sum / (s->total ? s->total : 1));
        for (int i = 0; i < s->n_buckets; i++) printf(" %6.1f%%", 100.0 * s->correct[i] / (s->count[i] ? s->count[i] : 1));
        printf("  %6.1f%%\n", 100.0 * s->n_agree_hf / (s->total ? s->total : 1));
    }
    printf("prefill throughput: %.0f tokens/s\n" TABLE_LEGEND, tok_s);
}

static int eval_retrieval(int argc, char **argv) {
    kvs_eval_options o = kvs_eval_options_default();
    const char *answers_path = NULL;
    for (int i = 1; i < argc; i++) {
        int r = kvs_eval_option(&o, argc, argv, &i);
        if (r > 0) continue;
        if (r == 0 && !strcmp(argv[i], "--answers") && i + 1 < argc) answers_path = argv[++i];
        else if (r == 0 && (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h"))) { usage(stdout); return 0; }
        else { fprintf(stderr, "kvsparse eval retrieval: bad or incomplete option '%s'\n", argv[i]); usage(stderr); return 2; }
    }
    const char *data = o.data;
    int limit = o.limit;
    if (!data) { fprintf(stderr, "kvsparse eval retrieval: --data FILE.jsonl is required\n"); return 2; }
    kvs_eval_lines L;
    if (kvs_eval_lines_read(data, limit, &L) != KVS_OK) return kvs_cli_error();
    FILE *answers = answers_path ? fopen(answers_path, "w") : NULL;
    if (answers_path && !answers) {
        fprintf(stderr, "kvsparse: %s: cannot write\n", answers_path);
        kvs_eval_lines_free(&L);
        return 1;
    }
    kvs_loaded l;
    if (kvs_cli_load(&o.load, &l) != KVS_OK) {
        kvs_eval_lines_free(&L);
        if (answers) fclose(answers);
        return kvs_cli_error();
    }
    /* without prefix caching: every policy prefills each prompt itself (the throughput measured) */
    kvs_eval_policies P;
    kvs_engine *e;
    kvs_status st = kvs_eval_engine(&l, &o, 1, false, &P, &e);
    policy_score *S = calloc((size_t)P.n, sizeof *S);
    kvs_progress bar;
    kvs_progress_start(&bar, "eval", L.n);
    int n_samples = 0;
    double prefill_time = 0, prefill_tokens = 0;
    for (int i = 0; st == KVS_OK && i < L.n; i++) {
        const char *line = L.text[i];
        int line_no = L.line_no[i];
        json_error_t jerr;
        json_t *o = json_loads(line, 0, &jerr);
        const char *prompt = json_string_value(json_object_get(o, "prompt"));
        const char *ans = json_string_value(json_object_get(o, "answer"));
        const char *hf = json_string_value(json_object_get(json_object_get(o, "hf_full_answer"), "text"));
        if (!prompt || !ans) {
            json_decref(o);
            st = kvs_fail(KVS_ERR_FORMAT, "%s:%d: expected an object with \"prompt\" and \"answer\" strings", data, line_no);
            break;
        }
        int32_t *ids = NULL;
        int n = 0;
        kvs_encode_options eo = {.add_special_tokens = false, .parse_special = true};
        st = kvs_tokenizer_encode(l.tok, prompt, strlen(prompt), eo, &ids, &n);
        char *want = ans ? kvs_eval_trimmed(ans) : NULL, *hf_text = hf ? kvs_eval_trimmed(hf) : NULL;
        json_t *row = answers ? json_pack("{s:O?, s:i, s:o}", "id", json_object_get(o, "id"), "n_prompt_tokens", n,
                                          "answers", json_object())
                              : NULL;
        for (int p = 0; st == KVS_OK && p < P.n; p++) {
            char *text = NULL;
            kvs_eval_answer a;
            double t0 = kvs_now();
            st = answer(&l, e, ids, n, &P.list[p], &a, &text);
            if (st != KVS_OK) {
                char why[512];
                snprintf(why, sizeof why, "%s", kvs_last_error());
                st = kvs_fail(st, "%s:%d: %s", data, line_no, why);
                break;
            }
            prefill_time += a.t_first - t0;
            prefill_tokens += n;
            policy_score *s = &S[p];
            int b = bucket_index(s, kvs_eval_bucket(json_string_value(json_object_get(o, "id")), n));
            bool ok = !strcmp(text, want);
            s->count[b]++, s->correct[b] += ok, s->total++, s->n_correct += ok;
            s->n_agree_hf += hf_text && !strcmp(text, hf_text);
            s->ratio_sum += a.compression;
            if (row) json_object_set_new(json_object_get(row, "answers"), P.names[p], json_string(text));
            free(text);
        }
        if (row && st == KVS_OK) {
            char *js = json_dumps(row, JSON_COMPACT);
            fprintf(answers, "%s\n", js);
            free(js);
        }
        json_decref(row);
        free(want);
        free(hf_text);
        free(ids);
        json_decref(o);
        n_samples++;
        kvs_progress_update(&bar, n_samples);
    }
    kvs_progress_finish(&bar);
    kvs_eval_lines_free(&L);
    if (answers) fclose(answers);
    if (st == KVS_OK) {
        double tok_s = prefill_time > 0 ? prefill_tokens / prefill_time : 0;
        if (o.json) {
            json_t *arr = json_array();
            for (int p = 0; p < P.n; p++) {
                json_t *o = score_json(P.names[p], &S[p], n_samples);
                json_object_set_new(o, "prefill_tokens_per_s", json_real(tok_s));
                json_array_append_new(arr, o);
            }
            json_t *out = P.n == 1 ? json_incref(json_array_get(arr, 0)) : json_incref(arr);
            char *s = json_dumps(out, JSON_INDENT(1));
            printf("%s\n", s);
            free(s);
            json_decref(out);
            json_decref(arr);
        } else {
            print_table(&P, S, tok_s);
        }
    }
    free(S);
    kvs_engine_destroy(e);
    kvs_cli_unload(&l);
    return st == KVS_OK ? 0 : kvs_cli_error();
}

int kvs_cmd_eval(int argc, char **argv) {
    if (argc >= 2 && !strcmp(argv[1], "retrieval")) return eval_retrieval(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "ppl")) return kvs_cmd_eval_ppl(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "multiturn")) return kvs_cmd_eval_multiturn(argc - 1, argv + 1);
    bool help = argc >= 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"));
    eval_usage(help ? stdout : stderr);
    return help ? 0 : 2;
}
