/* kvsparse eval multiturn: follow-up questions after a compressed first turn.
 * Each conversation's turn 1 is its prompt; turn 2 is prompt + followup_text
 * (the reference turn-1 answer and a question about another fact of the same
 * document). Turn 2 is answered three ways, through one engine with prefix
 * caching on, one request at a time:
 *   reprefill     turn 2 prefilled from scratch (a salt of its own: no reuse);
 *   reuse         turn 1's compressed cache kept, the follow-up appended and
 *                 decoded (turn 1's prompt, the follow-up as forced tokens):
 *                 what a naive sparse prefix cache does;
 *   prefix-cache  turn 2 as a new request sharing turn 1's cached prefix (the
 *                 engine as built: the full-resolution prefix reused, its own
 *                 observation window scored).
 * Reported per policy and strategy: both turns' accuracy and the prompt
 * tokens turn 2 prefilled. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "cli/eval.h"
#include "engine/engine.h"

enum { REPREFILL, REUSE, PREFIX_CACHE, N_STRATEGIES };
static const char *const strategy_names[N_STRATEGIES] = {"reprefill", "reuse", "prefix-cache"};

typedef struct {
    int samples, turn1_correct, turn2_correct[N_STRATEGIES];
    int64_t turn2_prompt_tokens, turn2_prefill[N_STRATEGIES];
} policy_score;

/* One conversation: turn 2's tokens, which start with turn 1's. */
typedef struct {
    int32_t *ids;
    int n1, n2;
    char *answer, *followup_answer; /* trimmed */
} conversation;

#define TABLE_LEGEND                                                                                       \
    "turn-1, turn-2: exact-match answers; prefilled: turn 2's prompt tokens prefilled (total, mean), what\n"  \
    "was not taken from a cache. reprefill: turn 2 prefilled from scratch; reuse: turn 1's compressed cache\n" \
    "kept, the follow-up appended and decoded; prefix-cache: turn 2 reusing turn 1's cached prefix.\n"

static void usage(FILE *f) {
    fprintf(f, "usage: kvsparse eval multiturn -m MODEL_DIR --data FILE.jsonl [options]\n"
               "Follow-up accuracy of KV policies: turn 1 (prompt), then turn 2 (prompt + followup_text) answered\n"
               "three ways (reprefill, reuse, prefix-cache); greedy answers, 16 tokens at most.\n"
               "  --data FILE.jsonl      the conversations: prompt, answer, followup_text, followup_answer\n"
               "  --limit N              N conversations, spread over the prompt lengths (the first of each in turn)\n"
               "  --json                 one JSON array: an object per policy and strategy\n"
               "  --answers FILE         write every conversation's answers per policy (JSON lines)\n"
               KVS_CLI_LOAD_HELP KVS_CLI_DEVICE_HELP KVS_CLI_TP_HELP KVS_CLI_POLICY_HELP
               "In eval, --kv-policy and --kv-budget take comma-separated lists: every combination is\n"
               "evaluated. The table's columns:\n" TABLE_LEGEND);
}

static void conversation_free(conversation *c) {
    free(c->ids);
    free(c->answer);
    free(c->followup_answer);
    memset(c, 0, sizeof *c);
}

/* A line of the data set -> *c; *skip for a blank line. */
static kvs_status read_conversation(const kvs_tokenizer *tok, const char *line, const char *where, conversation *c,
                                    bool *skip) {
    memset(c, 0, sizeof *c);
    *skip = line[0] == '\n';
    if (*skip) return KVS_OK;
    json_t *o = json_loads(line, 0, NULL);
    const char *prompt = json_string_value(json_object_get(o, "prompt"));
    const char *ans = json_string_value(json_object_get(o, "answer"));
    const char *followup = json_string_value(json_object_get(o, "followup_text"));
    const char *fans = json_string_value(json_object_get(o, "followup_answer"));
    kvs_status st = KVS_OK;
    if (!prompt || !ans || !followup || !fans)
        st = kvs_fail(KVS_ERR_FORMAT, "%s: expected an object with \"prompt\", \"answer\", \"followup_text\" and "
                      "\"followup_answer\" strings", where);
    kvs_encode_options eo = {.add_special_tokens = false, .parse_special = true};
    int32_t *turn1 = NULL;
    char *both = NULL;
    if (st == KVS_OK) st = kvs_tokenizer_encode(tok, prompt, strlen(prompt), eo, &turn1, &c->n1);
    if (st == KVS_OK && !(both = malloc(strlen(prompt) + strlen(followup) + 1))) st = kvs_fail(KVS_ERR_NOMEM, "out of memory");
    if (st == KVS_OK) {
        strcat(strcpy(both, prompt), followup);
        st = kvs_tokenizer_encode(tok, both, strlen(both), eo, &c->ids, &c->n2);
    }
    if (st == KVS_OK && (c->n2 <= c->n1 || memcmp(c->ids, turn1, sizeof(int32_t) * c->n1)))
        st = kvs_fail(KVS_ERR_FORMAT, "%s: the tokens of prompt + followup_text do not start with the %d tokens of "
                      "prompt (or add none): turn 2 cannot extend turn 1", where, c->n1);
    if (st == KVS_OK) {
        c->answer = kvs_eval_trimmed(ans);
        c->followup_answer = kvs_eval_trimmed(fans);
        if (!c->answer || !c->followup_answer) st = kvs_fail(KVS_ERR_NOMEM, "out of memory");
    }
    free(both);
    free(turn1);
    json_decref(o);
    if (st != KVS_OK) conversation_free(c);
    return st;
}

/* One request's answer (into answers[key] when answers is not NULL); whether
 * it is `want`; *hits: the prompt tokens it took from the prefix cache. */
static kvs_status ask(kvs_loaded *l, kvs_engine *e, const kvs_request_params *rp, const char *want, json_t *answers,
                      const char *key, bool *correct, int64_t *hits) {
    kvs_engine_stats before, after;
    kvs_engine_get_stats(e, &before);
    kvs_eval_answer a;
    char *text = NULL;
    KVS_TRY(kvs_eval_answer_run(l->tok, e, rp, &a, &text));
    kvs_engine_get_stats(e, &after);
    *correct = !strcmp(text, want);
    *hits = (int64_t)(after.prefix_cache_hits - before.prefix_cache_hits);
    if (answers) json_object_set_new(answers, key, json_string(text));
    free(text);
    return KVS_OK;
}

/* Turn 1 and the three turn 2s of one conversation under policy p. Turn 1,
 * prefix-cache's turn 2 and reuse share a salt of the policy's (policies
 * never share blocks: each one's figures stand alone); reprefill has a salt
 * of its own, so that nothing is reused. reuse is turn 1 again (its cached
 * blocks reused, its last tokens and window recomputed and compacted as the
 * first time: turn 1's compressed cache), the follow-up forced after it. */
static kvs_status run_conversation(kvs_loaded *l, kvs_engine *e, const conversation *c, int p,
                                   const kvs_kv_policy *policy, int *n_requests, policy_score *s, json_t *answers) {
    char shared[32], own[48];
    snprintf(shared, sizeof shared, "policy-%d", p);
    kvs_request_params rp = {.prompt_ids = c->ids, .n_prompt = c->n1, .sampling = kvs_sampling_default(),
                             .max_tokens = KVS_EVAL_MAX_NEW, .policy = policy, .cache_salt = shared};
    bool ok;
    int64_t hits;
    KVS_TRY(ask(l, e, &rp, c->answer, answers, "turn1", &ok, &hits));
    s->turn1_correct += ok;
    rp.n_prompt = c->n2; /* prefix-cache: turn 1's salt */
    KVS_TRY(ask(l, e, &rp, c->followup_answer, answers, strategy_names[PREFIX_CACHE], &ok, &hits));
    s->turn2_correct[PREFIX_CACHE] += ok;
    s->turn2_prefill[PREFIX_CACHE] += c->n2 - hits;
    snprintf(own, sizeof own, "reprefill-%d", (*n_requests)++);
    rp.cache_salt = own;
    KVS_TRY(ask(l, e, &rp, c->followup_answer, answers, strategy_names[REPREFILL], &ok, &hits));
    s->turn2_correct[REPREFILL] += ok;
    s->turn2_prefill[REPREFILL] += c->n2 - hits;
    rp.cache_salt = shared; /* turn 1 again, the follow-up forced */
    rp.n_prompt = c->n1;
    rp.forced_ids = c->ids + c->n1;
    rp.n_forced = c->n2 - c->n1;
    rp.max_tokens = rp.n_forced + KVS_EVAL_MAX_NEW;
    KVS_TRY(ask(l, e, &rp, c->followup_answer, answers, strategy_names[REUSE], &ok, &hits));
    s->turn2_correct[REUSE] += ok;
    s->turn2_prefill[REUSE] += rp.n_forced; /* turn 1's cache kept: only the follow-up is new */
    s->turn2_prompt_tokens += c->n2;
    s->samples++;
    return KVS_OK;
}

static double ratio(double a, double b) { return b > 0 ? a / b : 0; }

static void report(const kvs_eval_policies *P, const policy_score *S, bool as_json) {
    json_t *arr = json_array();
    int w = 24;
    for (int p = 0; p < P->n; p++) w = (int)strlen(P->names[p]) > w ? (int)strlen(P->names[p]) : w;
    if (!as_json) printf("%-*s %-13s %7s %7s %12s %9s\n", w, "policy", "strategy", "turn-1", "turn-2", "prefilled", "mean");
    for (int p = 0; p < P->n; p++)
        for (int k = 0; k < N_STRATEGIES; k++) {
            const policy_score *s = &S[p];
            double t1 = ratio(s->turn1_correct, s->samples), t2 = ratio(s->turn2_correct[k], s->samples);
            double mean = ratio((double)s->turn2_prefill[k], s->samples);
            if (as_json)
                json_array_append_new(arr, json_pack("{s:s, s:s, s:f, s:f, s:I, s:f, s:I, s:i}", "policy", P->names[p],
                                                     "strategy", strategy_names[k], "turn1_accuracy", t1, "turn2_accuracy",
                                                     t2, "turn2_prefill_tokens", (json_int_t)s->turn2_prefill[k],
                                                     "turn2_prefill_tokens_mean", mean, "turn2_prompt_tokens",
                                                     (json_int_t)s->turn2_prompt_tokens, "samples", s->samples));
            else
                printf("%-*s %-13s %6.1f%% %6.1f%% %12lld %9.1f\n", w, P->names[p], strategy_names[k], 100 * t1,
                       100 * t2, (long long)s->turn2_prefill[k], mean);
        }
    if (as_json) {
        char *text = json_dumps(arr, JSON_INDENT(1));
        printf("%s\n", text);
        free(text);
    } else {
        printf(TABLE_LEGEND);
    }
    json_decref(arr);
}

int kvs_cmd_eval_multiturn(int argc, char **argv) {
    kvs_eval_options o = kvs_eval_options_default();
    const char *answers_path = NULL;
    for (int i = 1; i < argc; i++) {
        int r = kvs_eval_option(&o, argc, argv, &i);
        if (r > 0) continue;
        if (r == 0 && !strcmp(argv[i], "--answers") && i + 1 < argc) {
            answers_path = argv[++i];
            continue;
        }
        if (r == 0 && (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h"))) { usage(stdout); return 0; }
        fprintf(stderr, "kvsparse eval multiturn: bad or incomplete option '%s'\n", argv[i]);
        usage(stderr);
        return 2;
    }
    const char *data = o.data;
    if (!data) { fprintf(stderr, "kvsparse eval multiturn: --data FILE.jsonl is required\n"); return 2; }
    kvs_eval_lines L;
    if (kvs_eval_lines_read(data, o.limit, &L) != KVS_OK) return kvs_cli_error();
    FILE *answers = answers_path ? fopen(answers_path, "w") : NULL;
    kvs_loaded l;
    if ((answers_path && !answers) || kvs_cli_load(&o.load, &l) != KVS_OK) {
        if (answers_path && !answers) fprintf(stderr, "kvsparse: %s: cannot write\n", answers_path);
        kvs_eval_lines_free(&L);
        if (answers) fclose(answers);
        return answers_path && !answers ? 1 : kvs_cli_error();
    }
    /* prefix caching on; room for a request of the longest context and the cached blocks of another */
    kvs_eval_policies P;
    kvs_engine *e;
    kvs_status st = kvs_eval_engine(&l, &o, 2, true, &P, &e);
    policy_score *S = calloc((size_t)P.n, sizeof *S);
    if (st == KVS_OK && !S) st = kvs_fail(KVS_ERR_NOMEM, "out of memory");
    kvs_progress bar;
    kvs_progress_start(&bar, "eval", L.n);
    char where[600];
    int n_samples = 0, n_requests = 0;
    for (int i = 0; st == KVS_OK && i < L.n; i++) {
        const char *line = L.text[i];
        snprintf(where, sizeof where, "%s:%d", data, L.line_no[i]);
        conversation c;
        bool skip;
        st = read_conversation(l.tok, line, where, &c, &skip);
        if (st != KVS_OK || skip) continue;
        json_t *row = answers ? json_object() : NULL;
        for (int p = 0; st == KVS_OK && p < P.n; p++) {
            json_t *mine = row ? json_object() : NULL;
            if (row) json_object_set_new(row, P.names[p], mine);
            st = run_conversation(&l, e, &c, p, &P.list[p], &n_requests, &S[p], mine);
            if (st != KVS_OK) {
                char why[512];
                snprintf(why, sizeof why, "%s", kvs_last_error());
                st = kvs_fail(st, "%s: %s", where, why);
            }
        }
        if (row && st == KVS_OK) {
            json_t *line_out = json_pack("{s:s, s:O}", "line", where, "answers", row);
            char *js = json_dumps(line_out, JSON_COMPACT);
            fprintf(answers, "%s\n", js);
            free(js);
            json_decref(line_out);
        }
        json_decref(row);
        conversation_free(&c);
        kvs_progress_update(&bar, ++n_samples);
    }
    kvs_progress_finish(&bar);
    kvs_eval_lines_free(&L);
    if (answers) fclose(answers);
    if (st == KVS_OK) report(&P, S, o.json);
    free(S);
    kvs_engine_destroy(e);
    kvs_cli_unload(&l);
    return st == KVS_OK ? 0 : kvs_cli_error();
}
