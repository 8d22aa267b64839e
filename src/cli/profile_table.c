/* bench throughput --profile: the totals of backend/profile.h as a table of
 * phases (ms, share of the wall time) and as JSON. The rows add up to the
 * wall time: host time is what no op's region covers. */
#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "cli/cli_common.h"

#define MAX_ROWS 16

typedef struct {
    const char *name;
    double ms;
} row;

static int rows_of(const kvs_profile_totals *t, row *r) {
    static const char *const names[3][3] = {{"prefill GEMM", "prefill attention", "prefill other kernels"},
                                            {"decode GEMM", "decode attention", "decode other kernels"},
                                            {"mixed GEMM", "mixed attention", "mixed other kernels"}};
    static const kvs_phase per_kind[3] = {KVS_PHASE_GEMM, KVS_PHASE_ATTENTION, KVS_PHASE_OTHER};
    static const kvs_step_kind kinds[3] = {KVS_STEP_PREFILL, KVS_STEP_DECODE, KVS_STEP_MIXED};
    int n = 0;
    for (int k = 0; k < 3; k++)
        for (int p = 0; p < 3; p++) r[n++] = (row){names[k][p], t->op_ms[kinds[k]][per_kind[p]]};
    row sparsify = {"sparsify (window capture, score, select, compact)", 0}, sampling = {"sampling", 0};
    row host = {"host (scheduling, metadata, launches, syncs, copies)", 0}, empty = {"empty steps' kernels", 0};
    for (int k = 0; k < KVS_STEP_KINDS; k++) {
        sparsify.ms += t->op_ms[k][KVS_PHASE_SPARSIFY];
        sampling.ms += t->op_ms[k][KVS_PHASE_SAMPLING];
        host.ms += t->host_ms[k];
    }
    for (int p = 0; p < 3; p++) empty.ms += t->op_ms[KVS_STEP_EMPTY][per_kind[p]]; /* none: no batch, no ops */
    r[n++] = sparsify;
    r[n++] = sampling;
    if (empty.ms > 0) r[n++] = empty;
    r[n++] = host;
    r[n++] = (row){"profiler (reading the marks)", t->read_ms};
    return n;
}

static const char *timing_of(const char *backend) {
    return strcmp(backend, "cuda") == 0 ? "CUDA events on the stream" : "the monotonic clock around each op";
}

/* How decode steps ran: kvs_cli_load's graph mode with --profile. */
static const char *decode_of(const char *backend) {
    return strcmp(backend, "cuda") == 0 ? "eager, in the graphs' padded layout (with --enforce-eager: unpadded)"
                                        : "eager (no graphs on this backend)";
}

void kvs_cli_profile_print(const kvs_profile_totals *t, const char *backend) {
    row r[MAX_ROWS];
    int n = rows_of(t, r);
    double wall = t->wall_ms > 0 ? t->wall_ms : 1e-9;
    printf("profile (%s; decode steps %s):\n", timing_of(backend), decode_of(backend));
    printf("  %-54s %12s %7s\n", "phase", "ms", "share");
    for (int i = 0; i < n; i++) printf("  %-54s %12.1f %6.1f%%\n", r[i].name, r[i].ms, 100 * r[i].ms / wall);
    printf("  %-54s %12.1f %6.1f%%\n", "total (wall)", t->wall_ms, 100.0);
    printf("  host work by phase (wall clock on the host, the device busy or not):\n");
    for (int h = 0; h < KVS_HOST_PHASES; h++)
        printf("    %-52s %12.1f %6.1f%%\n", kvs_host_phase_name(h), t->host_phase_ms[h], 100 * t->host_phase_ms[h] / wall);
    printf("  steps: %lld prefill (%lld tokens), %lld decode (%lld tokens), %lld mixed (%lld tokens, %lld of them "
           "decodes), %lld empty; %lld ops timed\n",
           (long long)t->steps[KVS_STEP_PREFILL], (long long)t->tokens[KVS_STEP_PREFILL],
           (long long)t->steps[KVS_STEP_DECODE], (long long)t->tokens[KVS_STEP_DECODE],
           (long long)t->steps[KVS_STEP_MIXED], (long long)t->tokens[KVS_STEP_MIXED],
           (long long)t->decode_tokens[KVS_STEP_MIXED], (long long)t->steps[KVS_STEP_EMPTY], (long long)t->regions);
}

json_t *kvs_cli_profile_json(const kvs_profile_totals *t, const char *backend) {
    row r[MAX_ROWS];
    int n = rows_of(t, r);
    double wall = t->wall_ms > 0 ? t->wall_ms : 1e-9;
    json_t *rows = json_array(), *steps = json_object(), *host = json_array();
    for (int i = 0; i < n; i++)
        json_array_append_new(rows, json_pack("{s:s, s:f, s:f}", "phase", r[i].name, "ms", r[i].ms, "share",
                                              r[i].ms / wall));
    for (int h = 0; h < KVS_HOST_PHASES; h++)
        json_array_append_new(host, json_pack("{s:s, s:f}", "phase", kvs_host_phase_name(h), "ms", t->host_phase_ms[h]));
    for (int k = 0; k < KVS_STEP_KINDS; k++) /* per kind: steps, their tokens and the decodes among them */
        json_object_set_new(steps, kvs_step_kind_name(k),
                            json_pack("{s:I, s:I, s:I}", "steps", (json_int_t)t->steps[k], "tokens",
                                      (json_int_t)t->tokens[k], "decode_tokens", (json_int_t)t->decode_tokens[k]));
    return json_pack("{s:s, s:s, s:f, s:o, s:o, s:o, s:I}", "timing", timing_of(backend), "decode",
                     decode_of(backend), "wall_ms", t->wall_ms, "rows", rows, "host_work", host, "steps", steps,
                     "ops_timed", (json_int_t)t->regions);
}
