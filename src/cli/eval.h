/* Shared by the eval commands: the policies under test; for eval ppl, one prefill that they share. */
#ifndef KVS_CLI_EVAL_H
#define KVS_CLI_EVAL_H

#include "cli/cli_common.h"

#define KVS_EVAL_MAX_POLICIES 32

typedef struct {
    kvs_kv_policy list[KVS_EVAL_MAX_POLICIES];
    char names[KVS_EVAL_MAX_POLICIES][96];
    int n;
} kvs_eval_policies;

/* Parses the eval's policy options: --kv-policy and --kv-budget accept
 * comma-separated lists (their cross product is evaluated; "full" once);
 * the other --kv-* options apply to all. Returns 1 / 0 / -1 like kvs_cli_load_option. */
int kvs_eval_policy_option(kvs_kv_policy *base, char *kinds, char *budgets, size_t cap, int argc, char **argv, int *i);
kvs_status kvs_eval_policies_build(const kvs_kv_policy *base, const char *kinds, const char *budgets,
                                   int n_layers, kvs_eval_policies *out);

/* The loaded runner (N >= 1 ranks) with KV caches (each rank: its KV heads)
 * for two sequences of max_tokens: the shared prefill and one fork. The runner
 * is l's (kvs_cli_unload). */
kvs_status kvs_eval_group(kvs_loaded *l, int max_tokens, int window, kvs_runner **g);
/* Prefills ids into a new sequence whose windows are captured for every layer
 * but which is not compressed; logits of the last token into logits. */
kvs_status kvs_eval_prefill(kvs_runner *g, const int32_t *ids, int n, int window, int chunk, float *logits,
                            int *seq);
/* A fork of the prefilled seq under policy p, compacted (each rank its own
 * heads); *fork -1 and nothing left behind on failure. */
kvs_status kvs_eval_fork(kvs_runner *g, int seq, const kvs_kv_policy *p, int prompt_len, int *fork);
/* Runs one token of seq at pos; logits into logits. */
kvs_status kvs_eval_step(kvs_runner *g, int seq, int32_t id, int pos, float *logits);

#endif
