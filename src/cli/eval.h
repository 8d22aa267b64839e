/* Shared by the eval commands: the policies under test, and one greedy answer
 * through the engine. */
#ifndef KVS_CLI_EVAL_H
#define KVS_CLI_EVAL_H

#include <stdio.h>

#include "cli/cli_common.h"

#define KVS_EVAL_MAX_POLICIES 32

typedef struct {
    kvs_kv_policy list[KVS_EVAL_MAX_POLICIES];
    char names[KVS_EVAL_MAX_POLICIES][160];
    int n;
} kvs_eval_policies;

/* Parses the eval's policy options: --kv-policy and --kv-budget accept
 * comma-separated lists (their cross product is evaluated; "full" once);
 * the other --kv-* options apply to all. Returns 1 / 0 / -1 like kvs_cli_load_option. */
int kvs_eval_policy_option(kvs_kv_policy *base, const char **profile_path, char *kinds, char *budgets, size_t cap,
                           int argc, char **argv, int *i);
/* The options of the eval commands over a data set (retrieval, multiturn):
 * the model's, the policies' and --data FILE, --limit N, --json. The policies'
 * --kv-profile: load.kv_profile. */
typedef struct {
    kvs_load_options load;
    kvs_kv_policy base;
    char kinds[512], budgets[512]; /* --kv-policy, --kv-budget lists */
    const char *data;
    int limit;
    bool json;
} kvs_eval_options;
kvs_eval_options kvs_eval_options_default(void);
/* One of those at argv[*i]: 1 consumed, 0 not one of them, -1 a bad value. */
int kvs_eval_option(kvs_eval_options *o, int argc, char **argv, int *i);
/* The policies: base (its profile, when set, named profile_path in their
 * names) with each kind and budget of the lists. */
kvs_status kvs_eval_policies_build(const kvs_kv_policy *base, const char *kinds, const char *budgets,
                                   const char *profile_path, int n_layers, kvs_eval_policies *out);

/* An engine for the policies under test P (base: their largest window): at
 * most max_seqs requests at a time, prompts prefilled in chunks of 2048 tokens,
 * a pool for `room` sequences of `context` tokens at their peak under the most
 * demanding of P, prefix caching on or off. */
kvs_status kvs_eval_engine_create(kvs_loaded *l, const kvs_kv_policy *base, const kvs_eval_policies *P, int max_seqs,
                                  int room, int context, bool prefix_caching, kvs_engine **e);
/* The policies under test (in *P) and the engine that answers them: one
 * request at a time, a pool for `room` sequences of the model's longest
 * context (kvs_eval_engine_create). */
kvs_status kvs_eval_engine(kvs_loaded *l, const kvs_eval_options *o, int room, bool prefix_caching,
                           kvs_eval_policies *P, kvs_engine **e);

/* An answer of at most KVS_EVAL_MAX_NEW drawn tokens (greedy, to EOS). */
#define KVS_EVAL_MAX_NEW 16

typedef struct {
    int32_t ids[KVS_EVAL_MAX_NEW]; /* the drawn tokens, after the forced ones */
    int n, n_seen;                 /* drawn tokens kept; tokens delivered (forced ones too) */
    int n_forced;                  /* the request's forced tokens, not kept */
    double t_first, compression;   /* when the prefill's token came; the KV's compression after the prompt */
    char error[256];
} kvs_eval_answer;

/* Runs one request through the engine to its end (the only one: the engine is
 * stepped here) and keeps what it drew after its forced tokens in *a; their
 * text (special tokens skipped, surrounding whitespace trimmed) into *text
 * (malloc'ed). rp's max_tokens: its n_forced + KVS_EVAL_MAX_NEW at most. */
kvs_status kvs_eval_answer_run(const kvs_tokenizer *tok, kvs_engine *e, const kvs_request_params *rp,
                               kvs_eval_answer *a, char **text);
/* s without surrounding whitespace (malloc'ed). */
char *kvs_eval_trimmed(const char *s);
/* A data set's samples in the order they run: every non-blank line of a
 * JSON-lines file, or with limit > 0 that many spread over the prompt lengths
 * (a cheap slice that still has long prompts): the first of each length in
 * turn, in the file's order within a length (kvs_eval_bucket). Says on stderr
 * which lengths it took. */
typedef struct {
    char **text;  /* [n] each line, malloc'ed */
    int *line_no; /* [n] its line in the file, from 1 */
    int n;
} kvs_eval_lines;
kvs_status kvs_eval_lines_read(const char *path, int limit, kvs_eval_lines *out);
void kvs_eval_lines_free(kvs_eval_lines *l);
/* A sample's length class: its id's ("pub-4000-12" -> 4000), else its prompt
 * length (n_prompt tokens, else the line's n_prompt_tokens) to the nearest thousand. */
int kvs_eval_bucket(const char *id, int n_prompt);

#endif
