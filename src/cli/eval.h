/* Shared by the eval commands: the policies under test. */
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

#endif
