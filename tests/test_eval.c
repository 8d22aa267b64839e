/* The eval commands end to end on a short slice of the retrieval set (the
 * full table is `make eval`), and the CLI's KV-policy options. */
#include <criterion/criterion.h>
#include <math.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "tokenizer/tokenizer.h"

static json_t *run_json(const char *args) {
    char cmd[4096], *out = NULL;
    snprintf(cmd, sizeof cmd, "{ %s %s 2>/dev/null; }", kvsparse_binary(), args); /* run_capture adds 2>&1 */
    int rc = run_capture(cmd, &out);
    cr_assert_eq(rc, 0, "%s\n%s", cmd, out);
    json_error_t err;
    json_t *j = json_loads(out, 0, &err);
    cr_assert(j, "not JSON: %s", out);
    free(out);
    return j;
}

/* The first n samples of a data set in a file of their own (the short
 * prompts lead each public set): --limit would spread over the lengths. */
static const char *first_samples(const char *rel, int n) {
    static char paths[4][600];
    static int next;
    char *path = paths[next++ % 4];
    /* not make_temp_dir(): its buffer is the caller's too */
    snprintf(path, sizeof paths[0], "/tmp/kvs-test-%d-first%d-%s", (int)getpid(), n, strrchr(rel, '/') + 1);
    FILE *in = fopen(shared_input(rel), "rb"), *out = fopen(path, "wb");
    cr_assert(in && out, "%s", path);
    char *line = NULL;
    size_t cap = 0;
    for (int i = 0; i < n && getline(&line, &cap, in) > 0; i++) fputs(line, out);
    free(line);
    fclose(in);
    fclose(out);
    return path;
}

Test(eval, retrieval_slice_reports_each_policy, .timeout = 900) {
    char args[2048];
    snprintf(args, sizeof args,
             "eval retrieval -m %s --data %s --kv-policy full,snapkv,pyramidkv,streamingllm --kv-budget 10%% --json",
             src_path("models/tiny-needle-llama"), first_samples("eval/retrieval_public.jsonl", 4));
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
             src_path("models/tiny-needle-llama"), shared_input("eval/retrieval_public.jsonl"));
    json_t *arr = run_json(args);
    cr_assert_eq(json_array_size(arr), 2);
    double full = json_real_value(json_object_get(json_array_get(arr, 0), "ppl"));
    double sparse = json_real_value(json_object_get(json_array_get(arr, 1), "ppl"));
    cr_assert(full > 1 && full < 1000 && sparse > 1 && sparse < 1000, "ppl %g / %g", full, sparse);
    json_decref(arr);
}

/* --quantization fp8, --kv-cache-dtype fp8 and both on the CPU (issue 14): on
 * a 20-prompt slice the same retrieval accuracy as bf16 (weights and KV) for
 * full and pyramidkv 10% (within a point: on 20 prompts, equal), and the
 * perplexity of 256 tokens after a 4,000-token prefix within 2% of bf16's
 * (fp8 KV: no accuracy lost; it answers one prompt more under pyramidkv),
 * over the first five samples of more than 4,400 tokens (1,280 tokens scored:
 * one 256-token window moved by 2.07% under pyramidkv, as fp8's rounding flips
 * near-ties of the selection). */
static double policy_value(json_t *arr, size_t i, const char *key) { return json_real_value(json_object_get(json_array_get(arr, i), key)); }

enum { PPL_TEXTS = 5, N_QUANT = 4 };
static const char *const quant_opts[N_QUANT] = {"", "--quantization fp8", "--kv-cache-dtype fp8",
                                                "--quantization fp8 --kv-cache-dtype fp8"};
static const char *const quant_names[N_QUANT] = {"bf16", "fp8 weights", "fp8 KV", "fp8 weights + fp8 KV"};

Test(eval, fp8_weights_and_kv_keep_retrieval_and_perplexity, .timeout = 1100) {
#if defined(__SANITIZE_ADDRESS__)
    /* about 2 minutes of model runs in the release build, many times that here; test_fp8 runs the fp8 ops under
       the sanitizers */
    cr_skip_test("accuracy and perplexity, not memory: run in the release build");
#endif
    char args[2048], name[32];
    json_t *acc[N_QUANT];
    double log_ppl[N_QUANT][2] = {{0}}; /* [configuration][policy]: the mean log perplexity over the texts */
    const char *dir = make_temp_dir();
    json_t *rows = load_jsonl(shared_input("eval/retrieval_public.jsonl")), *row;
    size_t i;
    int n_texts = 0;
    json_array_foreach(rows, i, row) if (n_texts < PPL_TEXTS && json_integer_value(json_object_get(row, "n_prompt_tokens")) > 4400) {
        const char *text = json_string_value(json_object_get(row, "prompt"));
        snprintf(name, sizeof name, "long%d.txt", n_texts++);
        write_file(dir, name, text, strlen(text));
    }
    cr_assert_eq(n_texts, PPL_TEXTS, "%d samples of more than 4,400 tokens", n_texts);
    json_decref(rows);
    for (int q = 0; q < N_QUANT; q++) {
        const char *quant = quant_opts[q];
        snprintf(args, sizeof args, "eval retrieval -m %s --data %s --kv-policy full,pyramidkv --kv-budget 10%% %s --json",
                 src_path("models/tiny-needle-llama"), first_samples("eval/retrieval_public.jsonl", 20), quant);
        acc[q] = run_json(args);
        for (int t = 0; t < PPL_TEXTS; t++) {
            snprintf(args, sizeof args, "eval ppl -m %s --text %s/long%d.txt --prefix 4000 --continuation 256 --kv-policy "
                     "full,pyramidkv --kv-budget 10%% %s --json", src_path("models/tiny-needle-llama"), dir, t, quant);
            json_t *ppl = run_json(args);
            for (size_t p = 0; p < 2; p++) {
                double v = policy_value(ppl, p, "ppl");
                cr_assert(v > 1 && v < 1000, "text %d policy %zu: ppl %g", t, p, v);
                log_ppl[q][p] += log(v) / PPL_TEXTS;
            }
            json_decref(ppl);
        }
    }
    for (int q = 1; q < N_QUANT; q++)
        for (size_t p = 0; p < 2; p++) {
            double a0 = policy_value(acc[0], p, "accuracy"), a1 = policy_value(acc[q], p, "accuracy");
            double p0 = exp(log_ppl[0][p]), p1 = exp(log_ppl[q][p]);
            cr_log_info("%s, %s: accuracy bf16 %.3f, %.3f; ppl bf16 %.4f, %.4f (%+.2f%%)", quant_names[q],
                        p ? "pyramidkv 10%" : "full", a0, a1, p0, p1, 100 * (p1 / p0 - 1));
            if (q == 1) /* fp8 weights: the same answers' accuracy */
                cr_expect(fabs(a1 - a0) <= 0.01 + 1e-9, "%s, policy %zu: accuracy %.3f, bf16 %.3f", quant_names[q], p, a1,
                          a0);
            else /* fp8 KV: no loss (on 20 prompts one answer is 5 points; pyramidkv answers one more, 2026-12-03) */
                cr_expect(a1 >= a0 - 0.01 - 1e-9, "%s, policy %zu: accuracy %.3f, bf16 %.3f", quant_names[q], p, a1, a0);
            cr_expect(fabs(p1 / p0 - 1) <= 0.02, "%s, policy %zu: perplexity %g, bf16 %g", quant_names[q], p, p1, p0);
        }
    for (int q = 0; q < N_QUANT; q++) json_decref(acc[q]);
}

/* eval multiturn: per policy, the three strategies' accuracies and turn 2's
 * prefilled tokens: reprefill prefills all of turn 2, reuse the follow-up. */
Test(eval, multiturn_slice_reports_each_strategy, .timeout = 900) {
    const char *data = first_samples("eval/retrieval_multiturn_public.jsonl", 3);
    char args[2048];
    snprintf(args, sizeof args, "eval multiturn -m %s --data %s --kv-policy full,snapkv --kv-budget 10%% --json",
             src_path("models/tiny-needle-llama"), data);
    json_t *arr = run_json(args);
    cr_assert(json_is_array(arr));
    cr_assert_eq(json_array_size(arr), 6, "2 policies x 3 strategies");
    /* the slice's turn-2 and follow-up token counts, from the tokenizer */
    kvs_tokenizer *tok;
    cr_assert_eq(kvs_tokenizer_load(src_path("models/tiny-needle-llama"), &tok), KVS_OK);
    json_t *rows = load_jsonl(data);
    long turn2 = 0, followup = 0;
    for (size_t i = 0; i < 3; i++) {
        json_t *r = json_array_get(rows, i);
        const char *p = json_string_value(json_object_get(r, "prompt")), *f = json_string_value(json_object_get(r, "followup_text"));
        char *both = malloc(strlen(p) + strlen(f) + 1);
        strcat(strcpy(both, p), f);
        kvs_encode_options eo = {.add_special_tokens = false, .parse_special = true};
        int32_t *ids;
        int n1, n2;
        cr_assert_eq(kvs_tokenizer_encode(tok, p, strlen(p), eo, &ids, &n1), KVS_OK);
        free(ids);
        cr_assert_eq(kvs_tokenizer_encode(tok, both, strlen(both), eo, &ids, &n2), KVS_OK);
        free(ids);
        free(both);
        turn2 += n2, followup += n2 - n1;
    }
    json_decref(rows);
    kvs_tokenizer_destroy(tok);
    static const char *const strategies[3] = {"reprefill", "reuse", "prefix-cache"};
    for (size_t i = 0; i < 6; i++) {
        json_t *o = json_array_get(arr, i);
        if (i < 3) cr_assert_str_eq(json_string_value(json_object_get(o, "policy")), "full");
        cr_assert_str_eq(json_string_value(json_object_get(o, "strategy")), strategies[i % 3]);
        cr_expect(json_is_number(json_object_get(o, "turn1_accuracy")) && json_is_number(json_object_get(o, "turn2_accuracy")));
        cr_expect_eq(json_integer_value(json_object_get(o, "samples")), 3);
        cr_expect_eq(json_integer_value(json_object_get(o, "turn2_prompt_tokens")), turn2);
        /* turn 1 is answered once per policy: its accuracy is the same under every strategy */
        cr_expect_float_eq(json_real_value(json_object_get(o, "turn1_accuracy")),
                           json_real_value(json_object_get(json_array_get(arr, i / 3 * 3), "turn1_accuracy")), 1e-9);
    }
    cr_expect(strncmp(json_string_value(json_object_get(json_array_get(arr, 3), "policy")), "snapkv", 6) == 0);
    for (size_t p = 0; p < 2; p++) {
        json_t *reprefill = json_array_get(arr, 3 * p), *reuse = json_array_get(arr, 3 * p + 1),
               *prefix = json_array_get(arr, 3 * p + 2);
        cr_expect_eq(json_integer_value(json_object_get(reprefill, "turn2_prefill_tokens")), turn2,
                     "reprefill prefills all of turn 2 (its salt shares nothing)");
        cr_expect_eq(json_integer_value(json_object_get(reuse, "turn2_prefill_tokens")), followup,
                     "reuse prefills the follow-up only");
        cr_expect_leq(json_integer_value(json_object_get(prefix, "turn2_prefill_tokens")), turn2);
        /* prefix caching: turn 2 reuses turn 1's cached blocks */
        cr_expect_lt(json_integer_value(json_object_get(prefix, "turn2_prefill_tokens")),
                     json_integer_value(json_object_get(reprefill, "turn2_prefill_tokens")) / 10,
                     "prefix-cache prefills at most a tenth of reprefill's tokens");
    }
    /* the full cache: prefix-cache answers as reprefill does */
    cr_expect_float_eq(json_real_value(json_object_get(json_array_get(arr, 2), "turn2_accuracy")),
                       json_real_value(json_object_get(json_array_get(arr, 0), "turn2_accuracy")), 1e-9);
    json_decref(arr);
}

Test(eval, bad_policy_options_are_named) {
    char cmd[2048], *out = NULL;
    snprintf(cmd, sizeof cmd, "%s generate -m %s -p hi --kv-policy h2o", kvsparse_binary(),
             src_path("models/tiny-needle-llama"));
    cr_assert_eq(run_capture(cmd, &out), 2);
    cr_assert(strstr(out, "h2o") && strstr(out, "expected full, snapkv, pyramidkv or streamingllm"), "%s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "%s generate -m %s -p hi --kv-pool 4", kvsparse_binary(),
             src_path("models/tiny-needle-llama"));
    cr_assert_eq(run_capture(cmd, &out), 2);
    cr_assert(strstr(out, "--kv-pool") && strstr(out, "an odd number"), "%s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "%s eval retrieval -m %s --data /nonexistent.jsonl", kvsparse_binary(),
             src_path("models/tiny-needle-llama"));
    cr_assert_eq(run_capture(cmd, &out), 1);
    cr_assert(strstr(out, "/nonexistent.jsonl"), "%s", out);
    free(out);
}

/* --tensor-parallel-size 2 on the CPU simulation: every rank forks and
 * compacts its own KV heads. Retrieval: the same answers (every sample, every
 * policy) and hence the same accuracies and compression ratios as TP = 1; only
 * the prefill throughput may differ. Logits are not bitwise equal (the O and
 * down projections are summed over two partial matmuls), but the greedy
 * answers are, on this slice. ppl: within 1e-3 relative (observed ~1e-7). */
static json_t *without_throughput(json_t *arr) {
    for (size_t i = 0; i < json_array_size(arr); i++) json_object_del(json_array_get(arr, i), "prefill_tokens_per_s");
    return arr;
}

static char *read_all(const char *path) {
    FILE *f = fopen(path, "rb");
    cr_assert(f, "%s", path);
    char *buf = calloc(1, 1 << 20);
    fread(buf, 1, (1 << 20) - 1, f);
    fclose(f);
    return buf;
}

Test(eval, tensor_parallel_2_matches_one_rank, .timeout = 900) {
    char args[4096], answers[2][256];
    json_t *r[2];
    for (int k = 0; k < 2; k++) {
        snprintf(answers[k], sizeof answers[k], "/tmp/kvs_test_eval_tp%d_%d.jsonl", k + 1, (int)getpid());
        snprintf(args, sizeof args,
                 "eval retrieval -m %s --data %s --kv-policy full,snapkv,pyramidkv --kv-budget 10%% "
                 "--answers %s --json --tensor-parallel-size %d",
                 src_path("models/tiny-needle-llama"), first_samples("eval/retrieval_public.jsonl", 4), answers[k], k + 1);
        r[k] = without_throughput(run_json(args));
        cr_assert_eq(json_array_size(r[k]), 3);
    }
    char *a0 = json_dumps(r[0], JSON_COMPACT | JSON_SORT_KEYS), *a1 = json_dumps(r[1], JSON_COMPACT | JSON_SORT_KEYS);
    cr_expect_str_eq(a0, a1, "TP=2 scores differ from TP=1");
    free(a0), free(a1);
    char *t0 = read_all(answers[0]), *t1 = read_all(answers[1]);
    cr_assert(strlen(t0) > 0);
    cr_expect_str_eq(t0, t1, "TP=2 answers differ from TP=1");
    free(t0), free(t1);
    for (int k = 0; k < 2; k++) json_decref(r[k]), remove(answers[k]);

    double ppl[2][2];
    for (int k = 0; k < 2; k++) {
        snprintf(args, sizeof args,
                 "eval ppl -m %s --text %s --prefix 600 --continuation 24 --kv-policy full,pyramidkv --kv-budget 20%% "
                 "--json --tensor-parallel-size %d",
                 src_path("models/tiny-needle-llama"), shared_input("eval/retrieval_public.jsonl"), k + 1);
        json_t *arr = run_json(args);
        cr_assert_eq(json_array_size(arr), 2);
        for (int p = 0; p < 2; p++) ppl[k][p] = json_real_value(json_object_get(json_array_get(arr, p), "ppl"));
        json_decref(arr);
    }
    for (int p = 0; p < 2; p++) {
        cr_assert(ppl[0][p] > 1 && ppl[0][p] < 1000, "ppl %g", ppl[0][p]);
        cr_expect(fabs(ppl[1][p] - ppl[0][p]) <= 1e-3 * ppl[0][p], "policy %d: TP=2 ppl %.9g, TP=1 %.9g", p, ppl[1][p],
                  ppl[0][p]);
    }
}

Test(eval, bench_model_tensor_parallel_2_runs, .timeout = 600) {
    char cmd[4096], *out = NULL;
    snprintf(cmd, sizeof cmd,
             "%s bench model -m %s --prompt-len 100 --decode-len 8 --decode-batches 1,3 --tensor-parallel-size 2 2>&1",
             kvsparse_binary(), src_path("models/tiny-needle-llama"));
    cr_assert_eq(run_capture(cmd, &out), 0, "%s", out);
    cr_assert(strstr(out, "tensor parallel 2"), "%s", out);
    cr_assert(strstr(out, "prefill: 100 tokens"), "%s", out);
    cr_assert(strstr(out, "rank 0's slice of 2"), "%s", out);
    cr_assert(strstr(out, "batch   3: eager"), "%s", out);
    free(out);
    /* N must divide the KV heads: the error names the numbers (eval and bench model alike) */
    snprintf(cmd, sizeof cmd, "%s bench model -m %s --tensor-parallel-size 3 2>&1", kvsparse_binary(),
             src_path("models/tiny-needle-llama"));
    cr_assert_eq(run_capture(cmd, &out), 1, "%s", out);
    cr_assert(strstr(out, "--tensor-parallel-size 3 does not divide the model's 2 KV heads"), "%s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "%s eval retrieval -m %s --data %s --limit 1 --tensor-parallel-size 3 2>&1",
             kvsparse_binary(), src_path("models/tiny-needle-llama"), shared_input("eval/retrieval_public.jsonl"));
    cr_assert_eq(run_capture(cmd, &out), 1, "%s", out);
    cr_assert(strstr(out, "--tensor-parallel-size 3 does not divide the model's 2 KV heads"), "%s", out);
    free(out);
}

/* Weights in llama.cpp's blocks through the commands: bench model counts the
 * bytes the formats read (a GGUF file's blocks; --quantization q8_0), and
 * eval runs a GGUF file under a sparse KV policy. */
Test(eval, bench_model_and_eval_on_quantized_weights, .timeout = 600) {
    char cmd[4096], *out = NULL;
    snprintf(cmd, sizeof cmd, "%s bench model -m %s --prompt-len 100 --decode-len 8 2>&1", kvsparse_binary(),
             shared_input("fixtures/gguf/tiny-q4_k_m.gguf"));
    cr_assert_eq(run_capture(cmd, &out), 0, "%s", out);
    cr_expect(strstr(out, "decode reads") && strstr(out, "the GGUF file's blocks weights"), "%s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "%s bench model -m %s --quantization q8_0 --prompt-len 100 --decode-len 8 2>&1",
             kvsparse_binary(), src_path("models/tiny-needle-llama"));
    cr_assert_eq(run_capture(cmd, &out), 0, "%s", out);
    cr_expect(strstr(out, "q8_0 weights"), "%s", out);
    free(out);
    snprintf(cmd, sizeof cmd, "%s eval retrieval -m %s --data %s --limit 2 --kv-policy full,snapkv --kv-budget 10%% 2>&1",
             kvsparse_binary(), shared_input("fixtures/gguf/tiny-q8_0.gguf"), shared_input("eval/retrieval_public.jsonl"));
    cr_assert_eq(run_capture(cmd, &out), 0, "%s", out);
    cr_expect(strstr(out, "snapkv budget=10%"), "%s", out);
    free(out);
}

/* ---- calibrate and --kv-profile ------------------------------------------------- */
static bool png_size(const char *path, unsigned *w, unsigned *h, long *bytes) {
    FILE *f = fopen(path, "rb");
    if (!f) return false;
    unsigned char head[24];
    bool ok = fread(head, 1, sizeof head, f) == sizeof head && !memcmp(head, "\x89PNG\r\n\x1a\n", 8) &&
              !memcmp(head + 12, "IHDR", 4);
    fseek(f, 0, SEEK_END);
    *bytes = ftell(f);
    fclose(f);
    *w = (unsigned)head[16] << 24 | head[17] << 16 | head[18] << 8 | head[19];
    *h = (unsigned)head[20] << 24 | head[21] << 16 | head[22] << 8 | head[23];
    return ok;
}

/* calibrate on the first 2 public prompts: a profile the loader accepts, its
 * statistics shaped as docs/SPARSITY.md says, and the two plots. */
Test(eval, calibrate_writes_a_profile_and_plots, .timeout = 300) {
    const char *dir = make_temp_dir();
    char cmd[4096], *out = NULL, profile[1024], plots[1024];
    snprintf(profile, sizeof profile, "%s/profile.json", dir);
    snprintf(plots, sizeof plots, "%s/plots", dir);
    snprintf(cmd, sizeof cmd, "%s calibrate -m %s --data %s --limit 2 --out %s --plot %s 2>&1", kvsparse_binary(),
             src_path("models/tiny-needle-llama"), shared_input("eval/retrieval_public.jsonl"), profile, plots);
    cr_assert_eq(run_capture(cmd, &out), 0, "%s\n%s", cmd, out);
    cr_expect(strstr(out, "calibrate [##############################] 2/2 prompts"), "the progress line: %s", out);
    cr_expect(strstr(out, "layer  top1%  top5% top10% top20% entropy  share@10x  share@20x"), "the table: %s", out);
    free(out);
    kvs_kv_profile *p;
    cr_assert_eq(kvs_kv_profile_load(profile, 8, &p), KVS_OK, "%s", kvs_last_error());
    cr_expect_eq(p->n_targets, 2);
    for (int t = 0; t < p->n_targets; t++) {
        double c = t ? 20 : 10, sum = 0;
        cr_expect_float_eq(p->compression[t], c, 0);
        for (int l = 0; l < 8; l++) {
            sum += p->share[t][l];
            cr_expect(p->share[t][l] >= 0.5 / c * (1 - 1e-5) && p->share[t][l] <= fmin(2 / c, 1) * (1 + 1e-5), "%gx, layer %d: share %g", c, l,
                      p->share[t][l]);
        }
        cr_expect_float_eq(sum / 8, 1 / c, 1e-5, "%gx: mean share %g", c, sum / 8);
    }
    kvs_kv_profile_free(p);
    json_t *j = load_json(profile);
    cr_expect_eq(json_integer_value(json_object_get(j, "prompts")), 2);
    cr_expect_eq(json_integer_value(json_object_get(j, "n_kv_heads")), 2);
    json_t *layers = json_object_get(j, "layers"), *curve = json_object_get(j, "curve");
    cr_assert_eq(json_array_size(layers), 8);
    for (size_t l = 0; l < 8; l++) {
        json_t *o = json_array_get(layers, l);
        cr_expect_eq(json_array_size(json_object_get(o, "heads")), 2);
        double top1 = json_number_value(json_object_get(o, "top1")), top20 = json_number_value(json_object_get(o, "top20"));
        double h = json_number_value(json_object_get(o, "entropy"));
        cr_expect(top1 > 0 && top1 <= top20 && top20 <= 1 + 1e-9 && h > 0 && h <= 1, "layer %zu: %g %g %g", l, top1, top20, h);
        json_t *mass = json_array_get(json_object_get(curve, "mass"), l);
        cr_expect_eq(json_array_size(mass), json_array_size(json_object_get(curve, "kept")));
        cr_expect_float_eq(json_number_value(json_array_get(mass, json_array_size(mass) - 1)), 1, 1e-5, "all keys: all the mass");
        json_t *snap = json_array_get(json_object_get(curve, "snapkv_mass"), l);
        cr_expect_eq(json_array_size(snap), json_array_size(mass));
        for (size_t k = 1; k < json_array_size(snap); k++) /* more budget, more mass kept; all of it at 100% */
            cr_expect_geq(json_number_value(json_array_get(snap, k)), json_number_value(json_array_get(snap, k - 1)) - 1e-6,
                          "layer %zu, kept[%zu]", l, k);
        cr_expect_float_eq(json_number_value(json_array_get(snap, json_array_size(snap) - 1)), 1, 1e-5);
    }
    json_decref(j);
    static const char *const pngs[] = {"attention_heatmap.png", "concentration.png"};
    for (int i = 0; i < 2; i++) {
        char path[1200];
        unsigned w, h;
        long bytes;
        snprintf(path, sizeof path, "%s/%s", plots, pngs[i]);
        cr_assert(png_size(path, &w, &h, &bytes), "%s: not a PNG", path);
        cr_expect(w >= 600 && w <= 3000 && h >= 300 && h <= 2000 && bytes > 4000, "%s: %ux%u, %ld bytes", path, w, h, bytes);
    }
}

Test(eval, calibrate_refuses_bad_options) {
    static const struct {
        const char *args, *says;
        int rc;
    } cases[] = {
        {"--targets 1", "'--targets' 1", 2},
        {"--targets 20,10", "'--targets' 20,10", 2},
        {"--stride 0", "'--stride' 0", 2},
        {"--limit 2 --tensor-parallel-size 2", "--tensor-parallel-size 2: not available in this command", 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char cmd[4096], *out = NULL;
        snprintf(cmd, sizeof cmd, "%s calibrate -m %s --data %s %s 2>&1", kvsparse_binary(),
                 src_path("models/tiny-needle-llama"), shared_input("eval/retrieval_public.jsonl"), cases[i].args);
        cr_expect_eq(run_capture(cmd, &out), cases[i].rc, "%s\n%s", cmd, out);
        cr_expect(strstr(out, cases[i].says), "%s: '%s' not in\n%s", cases[i].args, cases[i].says, out);
        free(out);
    }
}

/* --kv-profile: eval names the policy with its profile and keeps the
 * compression (the sparse layers' total is m x B); a profile of another
 * layer count, or a broken one, is refused before the weights load. */
Test(eval, kv_profile_option, .timeout = 300) {
    const char *dir = make_temp_dir();
    const char *good = "{\"format\": \"kvsparse-kv-profile\", \"version\": 1, \"n_layers\": 8, \"budgets\": ["
                       "{\"compression\": 10, \"layer_share\": [0.3, 0.05, 0.05, 0.05, 0.05, 0.1, 0.1, 0.1]}]}";
    write_file(dir, "good.json", good, strlen(good));
    char args[4096];
    snprintf(args, sizeof args, "eval retrieval -m %s --data %s --limit 1 --kv-policy snapkv --kv-budget 10%% --kv-profile %s/good.json --json",
             src_path("models/tiny-needle-llama"), shared_input("eval/retrieval_public.jsonl"), dir);
    json_t *o = run_json(args);
    cr_expect_str_eq(json_string_value(json_object_get(o, "policy")),
                     "snapkv budget=10% full_layers=0 window=16 pool=7 profile=good.json");
    double r = json_real_value(json_object_get(o, "compression_ratio"));
    cr_expect(r > 9.5 && r < 10.5, "10%% budget with a profile: ratio %g", r);
    json_decref(o);
    const char *bad = "{\"format\": \"kvsparse-kv-profile\", \"version\": 1, \"n_layers\": 16, \"budgets\": []}";
    write_file(dir, "bad.json", bad, strlen(bad));
    static const char *const commands[] = {"generate -p hi", "bench throughput --num-prompts 1", "eval ppl --text /dev/null",
                                           "serve --port 0"};
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) {
        char cmd[4096], *out = NULL;
        snprintf(cmd, sizeof cmd, "%s %s -m %s --kv-policy snapkv --kv-profile %s/bad.json 2>&1", kvsparse_binary(),
                 commands[i], src_path("models/tiny-needle-llama"), dir);
        cr_expect_eq(run_capture(cmd, &out), 1, "%s\n%s", cmd, out);
        cr_expect(strstr(out, "bad.json: n_layers is 16, the model has 8"), "%s:\n%s", commands[i], out);
        free(out);
    }
}

static char *trimmed(const char *s) {
    while (*s && strchr(" \t\r\n", *s)) s++;
    size_t n = strlen(s);
    while (n && strchr(" \t\r\n", s[n - 1])) n--;
    return strndup(s, n);
}

/* generate answers as eval retrieval does: the same prompt ids, the same
 * greedy answer under each sparse policy, on prompts of 1,000 and 2,000
 * tokens (--limit 2 takes one of each). generate sized its pool for a full
 * cache once and refused sparse policies' longer prompts: the pool is sized
 * for the policy now (the compaction's own blocks included). */
Test(eval, generate_answers_as_eval_does, .timeout = 900) {
    static const char *sets[][2] = {{"snapkv,streamingllm", "10% --kv-full-layers 0"},
                                    {"pyramidkv", "5% --kv-full-layers 2"}};
    const char *dir = make_temp_dir();
    char cmd[4096], args[2048], path[600], data[600];
    snprintf(data, sizeof data, "%s", shared_input("eval/retrieval_public.jsonl")); /* a static buffer of testutil's */
    int checked = 0;
    for (size_t s = 0; s < sizeof sets / sizeof sets[0]; s++) {
        snprintf(path, sizeof path, "%s/answers%zu.jsonl", dir, s);
        snprintf(args, sizeof args, "eval retrieval -m %s --data %s --limit 2 --kv-policy %s --kv-budget %s --answers %s --json",
                 src_path("models/tiny-needle-llama"), data, sets[s][0], sets[s][1], path);
        json_decref(run_json(args));
        json_t *rows = load_jsonl(path), *prompts = load_jsonl(data), *row;
        size_t i;
        json_array_foreach(rows, i, row) {
            const char *id = json_string_value(json_object_get(row, "id")), *prompt = NULL;
            json_t *sample;
            size_t j;
            json_array_foreach(prompts, j, sample) if (!strcmp(json_string_value(json_object_get(sample, "id")), id))
                prompt = json_string_value(json_object_get(sample, "prompt"));
            cr_assert(prompt, "%s", id);
            write_file(dir, "prompt.txt", prompt, strlen(prompt));
            const char *name;
            json_t *want;
            json_object_foreach(json_object_get(row, "answers"), name, want) {
                char kind[32], pct[16];
                int full_layers;
                cr_assert_eq(sscanf(name, "%31s budget=%15s full_layers=%d", kind, pct, &full_layers), 3, "%s", name);
                snprintf(cmd, sizeof cmd, "generate -m %s -f %s/prompt.txt -n 16 --json --kv-policy %s --kv-budget %s "
                         "--kv-full-layers %d", src_path("models/tiny-needle-llama"), dir, kind, pct, full_layers);
                json_t *got = run_json(cmd);
                char *text = trimmed(json_string_value(json_object_get(got, "text")));
                cr_assert_eq(json_array_size(json_object_get(got, "prompt_ids")),
                             (size_t)json_integer_value(json_object_get(row, "n_prompt_tokens")), "%s: prompt ids", id);
                cr_assert_str_eq(text, json_string_value(want), "%s, %s: generate answered '%s', eval '%s'", id, name,
                                 text, json_string_value(want));
                free(text);
                json_decref(got);
                checked++;
            }
        }
        json_decref(rows);
        json_decref(prompts);
    }
    cr_assert_eq(checked, 6, "2 prompts x 3 policies: %d checked", checked);
}
