/* Greedy, temperature, top-k, top-p and min-p sampling with a seeded RNG. */
#include <math.h>
#include <stdlib.h>

#include "engine/engine.h"

typedef struct {
    float logit;
    int32_t id;
} kvs_candidate;

struct kvs_sampler {
    kvs_sampling_params p;
    int vocab;
    kvs_rng rng;
    kvs_candidate *cand; /* sorted by logit, descending */
    float *prob;
};

kvs_sampling_params kvs_sampling_default(void) {
    return (kvs_sampling_params){.temperature = 0, .top_k = 0, .top_p = 1, .min_p = 0, .seed = 0, .has_seed = false};
}

kvs_status kvs_sampling_validate(const kvs_sampling_params *p) {
    if (!(p->temperature >= 0) || !isfinite(p->temperature))
        return kvs_fail(KVS_ERR_INVALID, "temperature must be a finite number >= 0");
    if (p->top_k < 0) return kvs_fail(KVS_ERR_INVALID, "top_k must be >= 0 (0 disables it)");
    if (!(p->top_p > 0 && p->top_p <= 1)) return kvs_fail(KVS_ERR_INVALID, "top_p must be in (0, 1]");
    if (!(p->min_p >= 0 && p->min_p <= 1)) return kvs_fail(KVS_ERR_INVALID, "min_p must be in [0, 1]");
    return KVS_OK;
}

kvs_status kvs_sampler_create(const kvs_sampling_params *p, int vocab_size, kvs_sampler **out) {
    *out = NULL;
    KVS_TRY(kvs_sampling_validate(p));
    kvs_sampler *s = calloc(1, sizeof *s);
    if (!s) return kvs_fail(KVS_ERR_NOMEM, "sampler: out of memory");
    s->p = *p;
    s->vocab = vocab_size;
    s->cand = malloc(sizeof(kvs_candidate) * vocab_size);
    s->prob = malloc(sizeof(float) * vocab_size);
    if (!s->cand || !s->prob) {
        kvs_sampler_destroy(s);
        return kvs_fail(KVS_ERR_NOMEM, "sampler: out of memory");
    }
    kvs_rng_seed(&s->rng, p->seed);
    *out = s;
    return KVS_OK;
}

void kvs_sampler_destroy(kvs_sampler *s) {
    if (!s) return;
    free(s->cand);
    free(s->prob);
    free(s);
}

static int argmax(const float *x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

static float log_softmax_at(const float *x, int n, int i) {
    float mx = x[argmax(x, n)];
    double sum = 0;
    for (int j = 0; j < n; j++) sum += exp((double)x[j] - mx);
    return (float)((double)x[i] - mx - log(sum));
}

static int by_logit_desc(const void *a, const void *b) {
    float x = ((const kvs_candidate *)a)->logit, y = ((const kvs_candidate *)b)->logit;
    return (x < y) - (x > y);
}

/* Moves the k largest logits to c[0..k), sorted descending (quickselect, then sort). */
static void top_candidates(const float *logits, kvs_candidate *c, int n, int k) {
    for (int i = 0; i < n; i++) c[i] = (kvs_candidate){logits[i], i};
    int lo = 0, hi = n - 1;
    while (k < n && lo < hi) {
        float pivot = c[(lo + hi) / 2].logit;
        int i = lo, j = hi;
        while (i <= j) {
            while (c[i].logit > pivot) i++;
            while (c[j].logit < pivot) j--;
            if (i <= j) {
                kvs_candidate t = c[i];
                c[i++] = c[j];
                c[j--] = t;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else break;
    }
    qsort(c, (size_t)k, sizeof *c, by_logit_desc);
}

int32_t kvs_sampler_sample(kvs_sampler *s, float *logits, float *logprob) {
    int n = s->vocab;
    for (int i = 0; i < n; i++)
        if (!isfinite(logits[i])) { /* a numerical failure, not a distribution (as the sample op) */
            if (logprob) *logprob = NAN;
            return -1;
        }
    if (s->p.temperature == 0) {
        int best = argmax(logits, n);
        if (logprob) *logprob = log_softmax_at(logits, n, best);
        return best;
    }
    int k = s->p.top_k > 0 && s->p.top_k < n ? s->p.top_k : n;
    top_candidates(logits, s->cand, n, k);
    float inv_t = 1.0f / s->p.temperature, mx = s->cand[0].logit;
    double sum = 0;
    for (int i = 0; i < k; i++) sum += s->prob[i] = expf((s->cand[i].logit - mx) * inv_t);
    int keep = k;
    if (s->p.min_p > 0) { /* drop tokens below min_p x the top probability */
        float floor_p = s->p.min_p * s->prob[0];
        while (keep > 1 && s->prob[keep - 1] < floor_p) sum -= s->prob[--keep];
    }
    if (s->p.top_p < 1) { /* smallest prefix whose mass reaches top_p */
        double acc = 0;
        for (int i = 0; i < keep; i++) {
            acc += s->prob[i];
            if (acc >= s->p.top_p * sum) {
                keep = i + 1;
                sum = acc;
                break;
            }
        }
    }
    double r = kvs_rng_uniform(&s->rng) * sum, acc = 0;
    int pick = keep - 1;
    for (int i = 0; i < keep; i++) {
        acc += s->prob[i];
        if (r < acc) {
            pick = i;
            break;
        }
    }
    int32_t id = s->cand[pick].id;
    if (logprob) *logprob = log_softmax_at(logits, n, id);
    return id;
}

bool kvs_is_stop_token(const kvs_stop_params *p, int32_t id) {
    for (int i = 0; i < p->n_stop_ids; i++)
        if (p->stop_ids[i] == id) return true;
    return false;
}
