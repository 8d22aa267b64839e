/* libFuzzer target: kvs_kv_profile_parse on arbitrary bytes (any layer count,
 * then the bundled model's 8); a profile that parses must hold what the
 * loader promises, and split budgets with it (UBSan watches the arithmetic). */
#include <assert.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "kv/kv.h"

static void use(const kvs_kv_profile *p) {
    assert(p->n_layers >= 1 && p->n_targets >= 1 && p->n_targets <= KVS_KV_PROFILE_MAX_TARGETS);
    for (int t = 0; t < p->n_targets; t++) {
        assert(p->compression[t] > 1 && (t == 0 || p->compression[t] > p->compression[t - 1]));
        for (int l = 0; l < p->n_layers; l++) assert(p->share[t][l] > 0 && p->share[t][l] <= 1);
    }
    static const float fractions[] = {0.5f, 0.1f, 0.05f, 0.01f};
    int *budgets = malloc(sizeof(int) * p->n_layers);
    if (!budgets) return;
    for (size_t f = 0; f < sizeof fractions / sizeof fractions[0]; f++) {
        kvs_kv_policy pol = kvs_kv_policy_default(f % 2 ? KVS_POLICY_PYRAMIDKV : KVS_POLICY_SNAPKV);
        pol.budget_fraction = fractions[f];
        pol.full_layers = (int)f < p->n_layers ? (int)f : 0;
        pol.profile = p;
        assert(kvs_kv_profile_target(p, 1 / fractions[f]) < p->n_targets);
        if (kvs_kv_policy_validate(&pol, p->n_layers) != KVS_OK) continue;
        kvs_kv_policy_budgets(&pol, p->n_layers, 4000, budgets);
        long total = 0, m = p->n_layers - pol.full_layers, B = lroundf(fractions[f] * 4000);
        for (int l = pol.full_layers; l < p->n_layers; l++) total += budgets[l];
        assert(m == 0 || B < pol.window || total == m * B); /* the sparse layers keep m x B together */
    }
    free(budgets);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    kvs_kv_profile *p;
    if (kvs_kv_profile_parse((const char *)data, size, 0, &p) == KVS_OK) {
        use(p);
        kvs_kv_profile_free(p);
    }
    if (kvs_kv_profile_parse((const char *)data, size, 8, &p) == KVS_OK) {
        assert(p->n_layers == 8);
        kvs_kv_profile_free(p);
    }
    return 0;
}
