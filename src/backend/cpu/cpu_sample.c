/* The sample op on the CPU: the reference for the CUDA kernel (same passes,
 * same thresholds; backend/sample.h states the semantics). */
#include <math.h>

#include "backend/cpu/cpu_ops.h"
#include "backend/sample.h"

/* What one row's filters see: z = x / t, m = max z. */
typedef struct {
    const float *x;
    int vocab;
    float t, m;
    uint32_t tau;     /* keep key(z) >= tau */
    double log_min_p; /* keep z - m >= log_min_p */
} row_view;

static float z_at(const row_view *r, int i) { return r->x[i] / r->t; }

static bool kept(const row_view *r, float z) {
    return kvs_sample_key(z) >= r->tau && kvs_sample_min_p_ok(z, r->m, r->log_min_p);
}

/* Radix select, most significant byte first: the largest key tau such that the
 * weight (1 per token for top-k, the fixed-point softmax weight for top-p) of
 * the kept tokens with key >= tau reaches target (frac * their total weight
 * when frac > 0). */
static uint32_t threshold(const row_view *r, bool by_mass, double target, double frac) {
    uint32_t prefix = 0;
    unsigned long long above = 0; /* weight of the tokens above the prefix's range */
    for (int shift = 24; shift >= 0; shift -= 8) {
        unsigned long long bins[256] = {0};
        uint32_t hi_mask = shift == 24 ? 0 : ~0u << (shift + 8);
        for (int i = 0; i < r->vocab; i++) {
            float z = z_at(r, i);
            uint32_t key = kvs_sample_key(z);
            if ((key & hi_mask) != prefix || !kept(r, z)) continue;
            bins[(key >> shift) & 255] += by_mass ? kvs_sample_weight(z, r->m) : 1;
        }
        prefix |= kvs_sample_radix_digit(bins, shift == 24, frac, &target, &above) << shift;
    }
    return prefix;
}

static int32_t sample_row(const float *x, int vocab, const kvs_sample_row *p, float *logprob) {
    int best = 0;
    float bx = x[0];
    bool finite = true;
    for (int i = 0; i < vocab; i++) {
        finite &= isfinite(x[i]) != 0;
        if (x[i] > bx) bx = x[i], best = i;
    }
    if (!finite) { /* a numerical failure upstream: no token */
        if (logprob) *logprob = NAN;
        return -1;
    }
    int32_t id = p->forced ? p->forced_id : best;
    if (!p->forced && p->temperature > 0) {
        row_view r = {x, vocab, p->temperature, bx / p->temperature, 0,
                      p->min_p > 0 ? log((double)p->min_p) : -INFINITY};
        if (p->top_k > 0 && p->top_k < vocab) r.tau = threshold(&r, false, p->top_k, 0);
        if (p->top_p < 1) r.tau = threshold(&r, true, 0, p->top_p);
        uint64_t stream = kvs_sample_stream(p->seed, p->step);
        float best_s = -INFINITY;
        int pick = -1;
        for (int i = 0; i < vocab; i++) {
            float z = z_at(&r, i);
            if (!kept(&r, z)) continue;
            float s = z + kvs_sample_gumbel(stream, i);
            if (pick < 0 || s > best_s) best_s = s, pick = i;
        }
        if (pick >= 0) id = pick; /* else z overflowed (a tiny T): the argmax */
    }
    if (logprob) {
        double sum = 0;
        for (int i = 0; i < vocab; i++) sum += exp((double)x[i] - bx);
        *logprob = (float)((double)x[id] - bx - log(sum));
    }
    return id;
}

void kvs_cpu_sample(kvs_backend *b, int32_t *ids, float *logprobs, const void *logits, int n_rows, int ld, int vocab,
                    const struct kvs_sample_row *params) {
    const float *x = logits;
#pragma omp parallel for schedule(dynamic, 1) if (n_rows > 1)
    for (int r = 0; r < n_rows; r++)
        ids[r] = sample_row(x + (size_t)r * ld, vocab, &params[r], logprobs ? &logprobs[r] : NULL);
}

/* One slice of a row (tensor parallelism): kvs_sample_pick's part. */
static kvs_sample_part shard_row(const float *x, int count, int id0, const kvs_sample_row *p) {
    kvs_sample_part o = {-INFINITY, -1, -INFINITY, -1, -INFINITY, 0, 0};
    if (count <= 0) return o;
    int best = 0;
    float bx = x[0];
    for (int i = 0; i < count; i++) {
        if (!isfinite(x[i])) o.nonfinite = 1;
        if (x[i] > bx) bx = x[i], best = i;
    }
    if (o.nonfinite) return o;
    double sum = 0;
    for (int i = 0; i < count; i++) sum += exp((double)x[i] - bx);
    o.x_max = bx, o.x_id = id0 + best, o.sum_exp = (float)sum;
    if (p->forced) {
        if (p->forced_id >= id0 && p->forced_id < id0 + count) o.s_id = p->forced_id, o.x_at_s = x[p->forced_id - id0];
    } else if (p->temperature > 0) {
        float t = p->temperature, m = bx / t;
        if (m == -INFINITY) { /* z underflowed (a tiny T): the whole row's scan keeps these unless its max is -inf too */
            o.s_id = id0, o.x_at_s = x[0];
            return o;
        }
        uint64_t stream = kvs_sample_stream(p->seed, p->step);
        for (int i = 0; i < count; i++) {
            float z = x[i] / t;
            if (!kvs_sample_min_p_ok(z, m, -INFINITY)) continue; /* z = m = +inf */
            float s = z + kvs_sample_gumbel(stream, (int64_t)id0 + i);
            if (o.s_id < 0 || s > o.s_max) o.s_max = s, o.s_id = id0 + i, o.x_at_s = x[i];
        }
    }
    return o;
}

void kvs_cpu_sample_shard(kvs_backend *b, kvs_sample_part *parts, const void *logits, int n_rows, int ld, int count,
                          int id0, const struct kvs_sample_row *params) {
    const float *x = logits;
#pragma omp parallel for schedule(dynamic, 1) if (n_rows > 1)
    for (int r = 0; r < n_rows; r++) parts[r] = shard_row(x + (size_t)r * ld, count, id0, &params[r]);
}
