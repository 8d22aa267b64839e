/* Calibration profiles (src/kv/profile.c): the loader accepts what calibrate
 * writes and refuses, naming the field, what is wrong; a policy with a
 * profile splits its budget as the profile's shares say. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv/kv.h"
#include "testutil.h"

/* 8 layers; mean shares 1/10 and 1/20 */
#define SHARES_10 "[0.3, 0.05, 0.05, 0.05, 0.05, 0.1, 0.1, 0.1]"
#define SHARES_20 "[0.15, 0.025, 0.025, 0.025, 0.025, 0.05, 0.05, 0.05]"
#define VALID                                                                                                     \
    "{\"format\": \"kvsparse-kv-profile\", \"version\": 1, \"model\": \"m\", \"n_layers\": 8, \"layers\": [],\n" \
    " \"budgets\": [{\"compression\": 10, \"layer_share\": " SHARES_10 "},\n"                                     \
    "             {\"compression\": 20, \"layer_share\": " SHARES_20 "}]}"

static kvs_status parse(const char *text, int n_layers, kvs_kv_profile **p) {
    return kvs_kv_profile_parse(text, strlen(text), n_layers, p);
}

Test(kv_profile, a_valid_profile_loads) {
    kvs_kv_profile *p;
    cr_assert_eq(parse(VALID, 8, &p), KVS_OK, "%s", kvs_last_error());
    cr_expect_eq(p->n_layers, 8);
    cr_expect_eq(p->n_targets, 2);
    cr_expect_float_eq(p->compression[0], 10, 0);
    cr_expect_float_eq(p->compression[1], 20, 0);
    cr_expect_float_eq(p->share[0][0], 0.3f, 1e-7);
    cr_expect_float_eq(p->share[1][7], 0.05f, 1e-7);
    cr_expect_eq(kvs_kv_profile_target(p, 9), 0);
    cr_expect_eq(kvs_kv_profile_target(p, 16), 1, "16 is nearer 20 than 10 in log ratio");
    cr_expect_eq(kvs_kv_profile_target(p, 100), 1);
    kvs_kv_profile_free(p);
    cr_assert_eq(parse(VALID, 0, &p), KVS_OK, "n_layers 0: the file's");
    kvs_kv_profile_free(p);
    kvs_kv_profile_free(NULL);
}

/* VALID with `from` replaced by `to` must be refused with `why` in the message. */
typedef struct {
    const char *from, *to, *why;
} refusal;

static const refusal refusals[] = {
    {"\"n_layers\": 8,", "\"n_layers\": 8,,", "kv profile: not JSON (line 1: "},
    {"\"version\": 1,", "\"version\": 1,\n\"version\": 1,", "not JSON (line 2: "},
    {"\"format\": \"kvsparse-kv-profile\",", "", "format is missing"},
    {"\"kvsparse-kv-profile\"", "\"other\"", "format is \"other\", must be \"kvsparse-kv-profile\""},
    {"\"kvsparse-kv-profile\"", "7", "format is 7, must be a string"},
    {"\"version\": 1,", "", "version is missing"},
    {"\"version\": 1,", "\"version\": 2,", "version is 2, this kvsparse reads version 1"},
    {"\"version\": 1,", "\"version\": \"1\",", "version is a string, must be an integer"},
    {"\"version\": 1,", "\"version\": 1.5,", "version is 1.5, must be an integer"},
    {"\"n_layers\": 8,", "", "n_layers is missing"},
    {"\"n_layers\": 8,", "\"n_layers\": 16,", "n_layers is 16, the model has 8"},
    {"\"n_layers\": 8,", "\"n_layers\": [8],", "n_layers is an array, must be an integer"},
    {"\"budgets\"", "\"targets\"", "budgets is missing"},
    {"{\"compression\": 10", "{\"ratio\": 10", "budgets[0].compression is missing"},
    {"{\"compression\": 10", "{\"compression\": \"10\"", "budgets[0].compression is a string, must be a number"},
    {"{\"compression\": 10", "{\"compression\": 1", "budgets[0].compression is 1, must be a finite number > 1"},
    {"{\"compression\": 10", "{\"compression\": 0.5", "budgets[0].compression is 0.5, must be a finite number > 1"},
    {"{\"compression\": 20", "{\"compression\": 10", "budgets[1].compression is 10, must be above budgets[0].compression (10)"},
    {"{\"compression\": 10", "{\"compression\": 1e999", "not JSON"},
    {"{\"compression\": 20, \"layer_share\"", "{\"compression\": 20, \"shares\"", "budgets[1].layer_share is missing"},
    {"\"layer_share\": " SHARES_10, "\"layer_share\": 0.1", "budgets[0].layer_share is 0.1, must be an array"},
    {"\"layer_share\": " SHARES_10, "\"layer_share\": [0.3, 0.05, 0.05, 0.05, 0.05, 0.1, 0.1]",
     "budgets[0].layer_share has 7 numbers, must have n_layers = 8"},
    {"[0.15, 0.025, 0.025, 0.025", "[0.15, 0.025, 0.025, 1.5", "budgets[1].layer_share[3] is 1.5, must be in (0, 1]"},
    {"[0.3, 0.05, 0.05", "[0.3, 0.05, 0", "budgets[0].layer_share[2] is 0, must be in (0, 1]"},
    {"[0.3, 0.05, 0.05", "[0.3, 0.05, -0.05", "budgets[0].layer_share[2] is -0.05, must be in (0, 1]"},
    {"[0.3, 0.05, 0.05", "[0.3, 0.05, \"0.05\"", "budgets[0].layer_share[2] is a string, must be a number"},
    {"[0.3, 0.05, 0.05", "[0.3, 0.05, 1e-12", "budgets[0].layer_share[2] is 1e-12, too small"},
    {"[0.3, 0.05, 0.05", "[0.4, 0.05, 0.05", "budgets[0].layer_share has mean 0.1125, must be within 2% of 1 / compression = 0.1"},
    {"{\"compression\": 10, \"layer_share\": " SHARES_10 "},", "7,", "budgets[0] is 7, must be an object"},
};

static char *replaced(const char *from, const char *to) {
    const char *at = strstr(VALID, from);
    cr_assert(at, "'%s' is not in the valid profile", from);
    size_t a = (size_t)(at - VALID), nf = strlen(from), nt = strlen(to);
    char *s = malloc(strlen(VALID) - nf + nt + 1);
    memcpy(s, VALID, a);
    memcpy(s + a, to, nt);
    strcpy(s + a + nt, at + nf);
    return s;
}

Test(kv_profile, every_refusal_names_the_field) {
    for (size_t i = 0; i < sizeof refusals / sizeof refusals[0]; i++) {
        char *text = replaced(refusals[i].from, refusals[i].to);
        kvs_kv_profile *p = (kvs_kv_profile *)1;
        kvs_status st = parse(text, 8, &p);
        cr_expect_eq(st, KVS_ERR_FORMAT, "case %zu accepted:\n%s", i, text);
        cr_expect_null(p, "case %zu: no profile on failure", i);
        cr_expect(strstr(kvs_last_error(), refusals[i].why), "case %zu: '%s' does not say '%s'", i, kvs_last_error(),
                  refusals[i].why);
        cr_expect(!strncmp(kvs_last_error(), "kv profile: ", 12), "case %zu: '%s'", i, kvs_last_error());
        free(text);
    }
}

Test(kv_profile, target_counts_are_bounded) {
    const char *empty = "{\"format\": \"kvsparse-kv-profile\", \"version\": 1, \"n_layers\": 2, \"budgets\": []}";
    kvs_kv_profile *p;
    cr_expect_eq(parse(empty, 2, &p), KVS_ERR_FORMAT);
    cr_expect(strstr(kvs_last_error(), "budgets has 0 targets, must have 1 to 16"), "%s", kvs_last_error());
    char text[8192];
    int n = snprintf(text, sizeof text, "{\"format\": \"kvsparse-kv-profile\", \"version\": 1, \"n_layers\": 2, \"budgets\": [");
    for (int t = 0; t < 17; t++) /* compressions 2, 3, ..., 18: shares 1/c each */
        n += snprintf(text + n, sizeof text - n, "%s{\"compression\": %d, \"layer_share\": [%.9f, %.9f]}", t ? ", " : "",
                      t + 2, 1.0 / (t + 2), 1.0 / (t + 2));
    snprintf(text + n, sizeof text - n, "]}");
    cr_expect_eq(parse(text, 2, &p), KVS_ERR_FORMAT);
    cr_expect(strstr(kvs_last_error(), "budgets has 17 targets, must have 1 to 16"), "%s", kvs_last_error());
    const char *object = "{\"format\": \"kvsparse-kv-profile\", \"version\": 1, \"n_layers\": 2, \"budgets\": {}}";
    cr_expect_eq(parse(object, 2, &p), KVS_ERR_FORMAT);
    cr_expect(strstr(kvs_last_error(), "budgets is an object, must be an array"), "%s", kvs_last_error());
    const char *top = "[1, 2]";
    cr_expect_eq(parse(top, 2, &p), KVS_ERR_FORMAT);
    cr_expect(strstr(kvs_last_error(), "the top level is an array, must be an object"), "%s", kvs_last_error());
}

Test(kv_profile, load_names_the_file) {
    const char *dir = make_temp_dir();
    char *text = replaced("\"n_layers\": 8,", "\"n_layers\": 16,");
    write_file(dir, "p.json", text, strlen(text));
    free(text);
    char path[1024];
    snprintf(path, sizeof path, "%s/p.json", dir);
    kvs_kv_profile *p;
    cr_expect_eq(kvs_kv_profile_load(path, 8, &p), KVS_ERR_FORMAT);
    char want[1200];
    snprintf(want, sizeof want, "kv profile %s: n_layers is 16, the model has 8", path);
    cr_expect_str_eq(kvs_last_error(), want);
    cr_expect_eq(kvs_kv_profile_load(path, 16, &p), KVS_ERR_FORMAT, "16 layers, but the shares list 8");
    cr_expect(strstr(kvs_last_error(), "budgets[0].layer_share has 8 numbers, must have n_layers = 16"), "%s",
              kvs_last_error());
    write_file(dir, "ok.json", VALID, strlen(VALID));
    snprintf(path, sizeof path, "%s/ok.json", dir);
    cr_assert_eq(kvs_kv_profile_load(path, 8, &p), KVS_OK, "%s", kvs_last_error());
    kvs_kv_profile_free(p);
    cr_expect_eq(kvs_kv_profile_load("/nonexistent/p.json", 8, &p), KVS_ERR_IO);
    cr_expect(strstr(kvs_last_error(), "kv profile /nonexistent/p.json: cannot open"), "%s", kvs_last_error());
}

/* want[first .. L): total entries in proportion to share[], each at least lo
 * (a layer the floor holds keeps lo, the others split the rest). */
static void shares_to_entries(const float *share, int first, int L, long total, int lo, double *want) {
    bool fixed[32] = {0};
    for (bool again = true; again;) {
        again = false;
        double left = (double)total, w_sum = 0;
        for (int l = first; l < L; l++)
            if (fixed[l]) left -= lo;
            else w_sum += share[l];
        for (int l = first; l < L; l++) {
            if (fixed[l]) continue;
            want[l] = left * share[l] / w_sum;
            if (want[l] < lo) want[l] = lo, fixed[l] = again = true;
        }
    }
}

/* With a profile the sparse layers keep m x B entries together, exactly,
 * each layer its share of them (within a token: the apportionment's
 * rounding; never below the window), from the target nearest the policy's
 * compression. */
Test(kv_profile, budgets_follow_the_shares) {
    kvs_rng rng;
    kvs_rng_seed(&rng, kvs_test_seed());
    for (int trial = 0; trial < 200; trial++) {
        int L = 2 + (int)(kvs_rng_u64(&rng) % 31), prompt = 1000 + (int)(kvs_rng_u64(&rng) % 7000);
        kvs_kv_profile prof = {.n_layers = L, .n_targets = 2, .compression = {10, 20}};
        float shares[2][32];
        for (int t = 0; t < 2; t++) {
            double sum = 0;
            for (int l = 0; l < L; l++) sum += shares[t][l] = (float)(0.5 + kvs_rng_uniform(&rng));
            for (int l = 0; l < L; l++) shares[t][l] = (float)(shares[t][l] / sum * L / prof.compression[t]);
            prof.share[t] = shares[t];
        }
        kvs_kv_policy p = kvs_kv_policy_default(trial % 2 ? KVS_POLICY_PYRAMIDKV : KVS_POLICY_SNAPKV);
        p.budget_fraction = trial % 3 ? 0.1f : 0.05f;
        p.full_layers = (int)(kvs_rng_u64(&rng) % 2);
        p.profile = &prof;
        cr_assert_eq(kvs_kv_policy_validate(&p, L), KVS_OK, "%s", kvs_last_error());
        int budgets[32], t = p.budget_fraction < 0.07f ? 1 : 0, m = L - p.full_layers;
        kvs_kv_policy_budgets(&p, L, prompt, budgets);
        long B = lroundf(p.budget_fraction * prompt), total = 0;
        double want[32];
        shares_to_entries(shares[t], p.full_layers, L, m * B, p.window, want);
        for (int l = 0; l < L; l++) {
            if (l < p.full_layers) {
                cr_expect_eq(budgets[l], -1, "layer %d stays full", l);
                continue;
            }
            cr_expect(fabs(budgets[l] - want[l]) < 1 + 1e-9, "trial %d, layer %d of %d: budget %d, shares say %.2f", trial,
                      l, L, budgets[l], want[l]);
            total += budgets[l];
        }
        cr_expect_eq(total, m * B, "trial %d: the sparse layers keep %ld, not m x B = %ld", trial, total, m * B);
    }
}

Test(kv_profile, a_profile_for_other_layers_is_refused_by_the_policy) {
    kvs_kv_profile *p;
    cr_assert_eq(parse(VALID, 8, &p), KVS_OK);
    kvs_kv_policy pol = kvs_kv_policy_default(KVS_POLICY_SNAPKV);
    pol.profile = p;
    cr_expect_eq(kvs_kv_policy_validate(&pol, 8), KVS_OK);
    cr_expect_eq(kvs_kv_policy_validate(&pol, 16), KVS_ERR_INVALID);
    cr_expect(strstr(kvs_last_error(), "kv profile: 8 layers, the model has 16"), "%s", kvs_last_error());
    kvs_kv_profile_free(p);
}
