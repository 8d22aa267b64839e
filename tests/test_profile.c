/* The timing wrapper (backend/profile.h) and `bench throughput --profile` on
 * the CPU backend with the bundled tiny model: the phases add up to the wall
 * time, each is >= 0, and the ones the run must exercise are not zero. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/profile.h"
#include "testutil.h"

static int run_cli(const char *args, char **out) {
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "'%s' %s", kvsparse_binary(), args);
    return run_capture(cmd, out);
}

/* The last line of out that is a JSON object. */
static json_t *last_json_line(const char *out) {
    const char *line = out[0] == '{' ? out : NULL;
    for (const char *q = out; *q; q++)
        if (*q == '\n' && q[1] == '{') line = q + 1;
    cr_assert(line, "no JSON in: %s", out);
    json_error_t err;
    json_t *j = json_loads(line, JSON_DISABLE_EOF_CHECK, &err);
    cr_assert(j, "bad JSON (%s) in: %s", err.text, out);
    return j;
}

/* The profile row named name (its ms and share), asserted present. */
static const json_t *row(const json_t *profile, const char *name) {
    const json_t *rows = json_object_get(profile, "rows"), *r;
    size_t i;
    json_array_foreach(rows, i, r) if (!strcmp(json_string_value(json_object_get(r, "phase")), name)) return r;
    cr_assert_fail("no row '%s'", name);
    return NULL;
}

static double ms_of(const json_t *profile, const char *name) {
    return json_real_value(json_object_get(row(profile, name), "ms"));
}

/* bench throughput --profile --json with extra options; the "profile" object
 * checked to add up (every row >= 0, shares summing to 1 within 3%). */
static json_t *profiled_run(const char *extra, char **out) {
    char args[4096];
    snprintf(args, sizeof args,
             "bench throughput -m '%s' --num-prompts 6 --input-len 200 --output-len 12 --ignore-eos --kv-memory 0.05 "
             "--max-num-seqs 4 --max-num-batched-tokens 512 --profile --json %s",
             src_path("models/tiny-needle-llama"), extra);
    cr_assert_eq(run_cli(args, out), 0, "%s", *out);
    json_t *j = last_json_line(*out);
    cr_assert_eq(json_integer_value(json_object_get(j, "output_tokens")), 6 * 12, "%s", *out);
    const json_t *p = json_object_get(j, "profile");
    cr_assert(p, "no profile in %s", *out);
    double sum = 0, wall = json_real_value(json_object_get(p, "wall_ms"));
    const json_t *r;
    size_t i;
    json_array_foreach(json_object_get(p, "rows"), i, r) {
        double ms = json_real_value(json_object_get(r, "ms")), share = json_real_value(json_object_get(r, "share"));
        cr_expect(ms >= 0 && share >= 0, "%s: %g ms, share %g", json_string_value(json_object_get(r, "phase")), ms,
                  share);
        sum += share;
    }
    cr_expect(wall > 0, "wall %g ms", wall);
    cr_expect(sum > 0.97 && sum < 1.03, "shares sum to %g:\n%s", sum, *out);
    double elapsed_ms = 1e3 * json_real_value(json_object_get(j, "elapsed_s"));
    cr_expect(wall <= elapsed_ms * 1.03 + 1 && wall >= elapsed_ms * 0.97 - 1, "profile wall %g ms, elapsed %g ms", wall,
              elapsed_ms);
    return j;
}

Test(profile, bench_throughput_adds_up_by_phase, .timeout = 300) {
    char *out;
    json_t *j = profiled_run("", &out);
    const json_t *p = json_object_get(j, "profile");
    /* 6 prompts, 4 at a time and 512 tokens a step: prefill alone, decodes beside prefill chunks, decode alone */
    const json_t *steps = json_object_get(p, "steps");
    json_int_t tokens = 0, decodes = 0;
    const char *kinds[3] = {"prefill", "decode", "mixed"};
    for (int k = 0; k < 3; k++) {
        const json_t *o = json_object_get(steps, kinds[k]);
        cr_expect(json_integer_value(json_object_get(o, "steps")) > 0, "no %s step: %s", kinds[k], out);
        tokens += json_integer_value(json_object_get(o, "tokens"));
        decodes += json_integer_value(json_object_get(o, "decode_tokens"));
    }
    /* every prompt token and every decode (a request's first token comes with its prefill); more if preempted */
    cr_expect(tokens >= 6 * (200 + 11) && decodes > 0 && decodes < tokens, "%lld tokens, %lld decodes: %s",
              (long long)tokens, (long long)decodes, out);
    const json_t *dec = json_object_get(steps, "decode"), *mix = json_object_get(steps, "mixed");
    cr_expect_eq(json_integer_value(json_object_get(dec, "decode_tokens")), json_integer_value(json_object_get(dec, "tokens")));
    cr_expect(json_integer_value(json_object_get(mix, "decode_tokens")) > 0 &&
                  json_integer_value(json_object_get(mix, "decode_tokens")) < json_integer_value(json_object_get(mix, "tokens")),
              "%s", out);
    cr_expect(ms_of(p, "prefill GEMM") > 0, "%s", out);
    cr_expect(ms_of(p, "decode GEMM") > 0, "%s", out);
    cr_expect(ms_of(p, "prefill attention") > 0 && ms_of(p, "decode attention") > 0, "%s", out);
    cr_expect(ms_of(p, "sampling") > 0, "%s", out);
    cr_expect_eq(ms_of(p, "sparsify (window capture, score, select, compact)"), 0, "full cache: nothing to sparsify");
    /* the host's work by phase: none longer than the run, some time in all */
    const json_t *host = json_object_get(p, "host_work"), *h;
    size_t i;
    double host_sum = 0;
    cr_expect_eq(json_array_size(host), KVS_HOST_PHASES, "%s", out);
    json_array_foreach(host, i, h) {
        double ms = json_real_value(json_object_get(h, "ms"));
        cr_expect(ms >= 0 && ms < json_real_value(json_object_get(p, "wall_ms")), "%s: %g ms",
                  json_string_value(json_object_get(h, "phase")), ms);
        host_sum += ms;
    }
    cr_expect(host_sum > 0, "%s", out);
    json_decref(j);
    free(out);
}

Test(profile, sparse_policy_times_the_sparsify, .timeout = 300) {
    char *out;
    json_t *j = profiled_run("--kv-policy snapkv --kv-budget 25%", &out);
    cr_expect(ms_of(json_object_get(j, "profile"), "sparsify (window capture, score, select, compact)") > 0, "%s", out);
    json_decref(j);
    free(out);
}

Test(profile, table_and_refusals) {
    char args[4096], *out;
    const char *tiny = src_path("models/tiny-needle-llama");
    snprintf(args, sizeof args, "bench throughput -m '%s' --num-prompts 2 --input-len 64 --output-len 4 --ignore-eos "
             "--kv-memory 0.02 --profile", tiny);
    cr_assert_eq(run_cli(args, &out), 0, "%s", out);
    cr_expect(strstr(out, "prefill GEMM") && strstr(out, "decode attention") && strstr(out, "total (wall)") &&
                  strstr(out, "100.0%"), "%s", out);
    free(out);
    snprintf(args, sizeof args, "bench throughput -m '%s' --num-prompts 2 --profile --tensor-parallel-size 2", tiny);
    cr_assert_eq(run_cli(args, &out), 1, "%s", out);
    cr_expect(strstr(out, "--profile: not with --tensor-parallel-size"), "%s", out);
    free(out);
}

/* The wrapper alone: ops before the start are not timed; after it each op is
 * a region of its phase, and the step's wall is its regions plus host time. */
Test(profile, wrapper_counts_regions_by_phase) {
    kvs_backend *cpu, *b;
    kvs_profile *p;
    cr_assert_eq(kvs_backend_cpu_create(1, &cpu), KVS_OK);
    cr_assert_eq(kvs_backend_profile_wrap(cpu, true, &b, &p), KVS_OK);
    cr_expect_null(b->graph_begin);
    enum { N = 256 };
    float *x = b->alloc(b, sizeof(float) * N * N), *y = b->alloc(b, sizeof(float) * N * N);
    cr_assert(x && y);
    memset(x, 0, sizeof(float) * N * N);
    b->matmul(b, y, x, x, NULL, N, N, N); /* before the start */
    kvs_profile_start(p);
    for (int i = 0; i < 3; i++) b->matmul(b, y, x, x, NULL, N, N, N);
    b->add(b, x, y, (size_t)N * N);
    cr_assert_eq(kvs_profile_step(p, 512, 0), KVS_OK); /* a prefill step */
    b->rmsnorm(b, y, x, x, N, N, 1e-5f);
    cr_assert_eq(kvs_profile_step(p, 8, 8), KVS_OK); /* a decode step */
    const kvs_profile_totals *t = kvs_profile_get(p);
    cr_expect_eq(t->regions, 5);
    cr_expect_eq(t->steps[KVS_STEP_PREFILL], 1);
    cr_expect_eq(t->steps[KVS_STEP_DECODE], 1);
    cr_expect(t->op_ms[KVS_STEP_PREFILL][KVS_PHASE_GEMM] > 0);
    cr_expect(t->op_ms[KVS_STEP_PREFILL][KVS_PHASE_OTHER] > 0);
    cr_expect(t->op_ms[KVS_STEP_DECODE][KVS_PHASE_OTHER] > 0);
    cr_expect_eq(t->op_ms[KVS_STEP_DECODE][KVS_PHASE_GEMM], 0);
    double sum = t->read_ms;
    for (int k = 0; k < KVS_STEP_KINDS; k++) {
        sum += t->host_ms[k];
        cr_expect(t->host_ms[k] >= 0, "host %g ms in %s steps", t->host_ms[k], kvs_step_kind_name(k));
        for (int ph = 0; ph < KVS_PHASES; ph++) sum += t->op_ms[k][ph];
    }
    cr_expect(sum > 0.999 * t->wall_ms && sum < 1.001 * t->wall_ms, "parts %g ms, wall %g ms", sum, t->wall_ms);
    b->free(b, x);
    b->free(b, y);
    b->destroy(b); /* and cpu with it */
}

Test(profile, step_kinds_and_a_backend_without_marks) {
    cr_expect_eq(kvs_step_kind_of(0, 0), KVS_STEP_EMPTY);
    cr_expect_eq(kvs_step_kind_of(512, 0), KVS_STEP_PREFILL);
    cr_expect_eq(kvs_step_kind_of(64, 64), KVS_STEP_DECODE);
    cr_expect_eq(kvs_step_kind_of(512, 3), KVS_STEP_MIXED);
    kvs_backend *cpu, *b;
    kvs_profile *p;
    cr_assert_eq(kvs_backend_cpu_create(1, &cpu), KVS_OK);
    kvs_backend no_marks = *cpu;
    no_marks.mark_create = NULL;
    cr_expect_eq(kvs_backend_profile_wrap(&no_marks, false, &b, &p), KVS_ERR_UNSUPPORTED);
    cr_expect_null(b);
    cr_expect(strstr(kvs_last_error(), "no timing marks"), "%s", kvs_last_error());
    cpu->destroy(cpu);
}
