/* The eval commands end to end on a short slice of the retrieval set (the
 * full table is `make eval`), and the CLI's KV-policy options. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

static json_t *run_json(const char *args) {
    char cmd[4096], *out = NULL;
    snprintf(cmd, sizeof cmd, "%s %s 2>/dev/null", kvsparse_binary(), args);
    int rc = run_capture(cmd, &out);
    cr_assert_eq(rc, 0, "%s\n%s", cmd, out);
    json_error_t err;
    json_t *j = json_loads(out, 0, &err);
    cr_assert(j, "not JSON: %s", out);
    free(out);
    return j;
}

Test(eval, retrieval_slice_reports_each_policy, .timeout = 900) {
    char args[2048];
    snprintf(args, sizeof args,
             "eval retrieval -m %s --data %s --limit 4 --kv-policy full,snapkv,pyramidkv,streamingllm --kv-budget 10%% --json",
             src_path("models/tiny-needle-llama"), shared_path("eval/retrieval_public.jsonl"));
    json_t *arr = run_json(args);
    cr_assert(json_is_array(arr));
    cr_assert_eq(json_array_size(arr), 4);
    json_t *full = json_array_get(arr, 0);
    cr_assert_str_eq(json_string_value(json_object_get(full, "policy")), "full");
    cr_assert_float_eq(json_real_value(json_object_get(full, "compression_ratio")), 1.0, 1e-9);
    cr_assert_geq(json_real_value(json_object_get(full, "agreement_with_hf_full")), 0.75,
                  "the full cache answers as transformers does");
    for (size_t i = 0; i < 4; i++) {
        json_t *o = json_array_get(arr, i);
        cr_assert(json_is_number(json_object_get(o, "accuracy")));
        cr_assert_eq(json_integer_value(json_object_get(o, "samples")), 4);
        json_t *b = json_object_get(json_object_get(o, "by_length"), "1000");
        cr_assert_eq(json_integer_value(json_object_get(b, "count")), 4);
        if (i > 0) {
            double r = json_real_value(json_object_get(o, "compression_ratio"));
            cr_assert(r > 8 && r < 12, "10%% budget: ratio %g", r);
        }
    }
    json_decref(arr);
}

Test(eval, ppl_full_and_sparse, .timeout = 900) {
    char args[2048];
    snprintf(args, sizeof args,
             "eval ppl -m %s --text %s --prefix 600 --continuation 24 --kv-policy full,snapkv --kv-budget 20%% --json",
             src_path("models/tiny-needle-llama"), shared_path("eval/retrieval_public.jsonl"));
    json_t *arr = run_json(args);
    cr_assert_eq(json_array_size(arr), 2);
    double full = json_real_value(json_object_get(json_array_get(arr, 0), "ppl"));
    double sparse = json_real_value(json_object_get(json_array_get(arr, 1), "ppl"));
    cr_assert(full > 1 && full < 1000 && sparse > 1 && sparse < 1000, "ppl %g / %g", full, sparse);
    json_decref(arr);
}

Test(eval, bad_policy_options_are_named) {
    char cmd[2048], *out = NULL;
    snprintf(cmd, sizeof cmd, "%s generate -m %s -p hi --kv-policy h2o", kvsparse_binary(),
             src_path("models/tiny-needle-llama"));
    cr_assert_eq(run_capture(cmd, &out), 2);
    cr_assert(strstr(out, "h2o"), "%s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "%s generate -m %s -p hi --kv-pool 4", kvsparse_binary(),
             src_path("models/tiny-needle-llama"));
    cr_assert_eq(run_capture(cmd, &out), 2);
    cr_assert(strstr(out, "--kv-pool"), "%s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "%s eval retrieval -m %s --data /nonexistent.jsonl", kvsparse_binary(),
             src_path("models/tiny-needle-llama"));
    cr_assert_eq(run_capture(cmd, &out), 1);
    cr_assert(strstr(out, "/nonexistent.jsonl"), "%s", out);
    free(out);
}
