/* The eval commands' shared parts: the lists of policies under test. */
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
