/* The fault-injecting backend wrapper (backend/fault.h). */
#include "backend/fault.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/sample.h"

typedef struct {
    kvs_backend base; /* first: the model sees this; its ops are inner's but for those below */
    kvs_backend *inner;
    bool owns_inner;
    kvs_fault_spec spec;
    int steps; /* embedding calls so far */
    bool failed;
    char failure[160];
    kvs_sample_row *h_params; /* host copy of the sample op's params */
    int cap_params;
} fault_backend;

kvs_status kvs_fault_parse(const char *text, kvs_fault_spec *out) {
    memset(out, 0, sizeof *out);
    const char *p = text;
    while (*p) {
        char *end;
        if (!strncmp(p, "step=", 5)) {
            long v = strtol(p + 5, &end, 10);
            if (end == p + 5 || v < 1 || v > 1 << 30) goto bad;
            out->fail_step = (int)v;
        } else if (!strncmp(p, "nan-seed=", 9)) {
            out->nan_seed = strtoull(p + 9, &end, 10);
            if (end == p + 9) goto bad;
            out->nan = true;
        } else {
            goto bad;
        }
        if (*end && (*end != ',' || !end[1])) goto bad;
        p = *end ? end + 1 : end;
        continue;
    bad:
        return kvs_fail(KVS_ERR_INVALID, "fault spec '%s': bad part at '%s' (want step=N and/or nan-seed=S, comma-separated)",
                        text, p);
    }
    return KVS_OK;
}

static void fault_embedding(kvs_backend *b, void *out, const void *table, const int32_t *ids, int n, int dim) {
    fault_backend *f = (fault_backend *)b;
    f->inner->embedding(f->inner, out, table, ids, n, dim);
    if (++f->steps != f->spec.fail_step || f->failed) return;
    f->failed = true;
    snprintf(f->failure, sizeof f->failure, "injected fault: an op of forward step %d failed", f->steps);
    kvs_fail(KVS_ERR_INTERNAL, "%s", f->failure);
}

/* The inner backend's health, or the injected failure once it happened. */
static kvs_status with_injected(const fault_backend *f, kvs_status st) {
    return st == KVS_OK && f->failed ? kvs_fail(KVS_ERR_INTERNAL, "%s", f->failure) : st;
}

/* b, not inner: the inner op updates the wrapper's counters (impl shared) */
static kvs_status fault_check(kvs_backend *b) {
    const fault_backend *f = (const fault_backend *)b;
    return with_injected(f, f->inner->check(b));
}

static kvs_status fault_fence_wait(kvs_backend *b) {
    const fault_backend *f = (const fault_backend *)b;
    return with_injected(f, f->inner->fence_wait(b));
}

/* Writes a NaN at column col of the rows of logits [n_rows][ld] whose params
 * carry the chosen seed. */
static void poison(fault_backend *f, const void *logits, int n_rows, int ld, int col,
                   const struct kvs_sample_row *params) {
    if (!f->spec.nan || n_rows <= 0 || col < 0) return;
    kvs_backend *in = f->inner;
    if (n_rows > f->cap_params) {
        kvs_sample_row *p = realloc(f->h_params, sizeof *p * n_rows);
        if (!p) return;
        f->h_params = p;
        f->cap_params = n_rows;
    }
    in->to_host(in, f->h_params, params, sizeof(kvs_sample_row) * n_rows);
    const uint32_t nan32 = 0x7fc00000u;
    const uint16_t nan16 = in->act_dtype == KVS_F16 ? 0x7e00u : 0x7fc0u; /* f16, bf16 */
    size_t esz = kvs_dtype_size(in->act_dtype);
    for (int r = 0; r < n_rows; r++)
        if (f->h_params[r].seed == f->spec.nan_seed)
            in->to_device(in, (char *)logits + ((size_t)r * ld + col) * esz, esz == 4 ? (const void *)&nan32 : &nan16,
                          esz);
}

static void fault_sample(kvs_backend *b, int32_t *ids, float *logprobs, const void *logits, int n_rows, int ld,
                         int vocab, const struct kvs_sample_row *params) {
    fault_backend *f = (fault_backend *)b;
    poison(f, logits, n_rows, ld, vocab / 2, params);
    f->inner->sample(f->inner, ids, logprobs, logits, n_rows, ld, vocab, params);
}

static void fault_sample_shard(kvs_backend *b, struct kvs_sample_part *parts, const void *logits, int n_rows, int ld,
                               int count, int id0, const struct kvs_sample_row *params) {
    fault_backend *f = (fault_backend *)b;
    poison(f, logits, n_rows, ld, count > 0 ? count / 2 : -1, params);
    f->inner->sample_shard(f->inner, parts, logits, n_rows, ld, count, id0, params);
}

static void fault_destroy(kvs_backend *b) {
    fault_backend *f = (fault_backend *)b;
    if (f->owns_inner) f->inner->destroy(f->inner);
    free(f->h_params);
    free(f);
}

kvs_status kvs_backend_fault_wrap(kvs_backend *inner, const kvs_fault_spec *spec, bool owns_inner,
                                  kvs_backend **out) {
    *out = NULL;
    if (!inner || !spec) return kvs_fail(KVS_ERR_INVALID, "fault wrapper: no backend or no spec");
    fault_backend *f = calloc(1, sizeof *f);
    if (!f) return kvs_fail(KVS_ERR_NOMEM, "fault wrapper: out of memory");
    f->base = *inner; /* impl shared: the inner ops called with the wrapper find their state */
    f->inner = inner;
    f->owns_inner = owns_inner;
    f->spec = *spec;
    f->base.embedding = fault_embedding;
    f->base.check = fault_check;
    f->base.fence_wait = fault_fence_wait;
    f->base.sample = fault_sample;
    f->base.sample_shard = fault_sample_shard;
    f->base.graph_begin = NULL; /* eager: every step runs embedding */
    f->base.graph_end = NULL;
    f->base.graph_launch = NULL;
    f->base.graph_destroy = NULL;
    f->base.destroy = fault_destroy;
    *out = &f->base;
    return KVS_OK;
}
