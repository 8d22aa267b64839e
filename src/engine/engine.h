/* engine: sampling, and (later) requests, the scheduler and the step loop. */
#ifndef KVS_ENGINE_H
#define KVS_ENGINE_H

#include "core/core.h"

/* ---- sampling ------------------------------------------------------------- */
typedef struct {
    float temperature; /* 0 = greedy */
    int top_k;         /* 0 = off */
    float top_p;       /* 1 = off */
    float min_p;       /* 0 = off */
    uint64_t seed;
} kvs_sampling_params;

kvs_sampling_params kvs_sampling_default(void); /* greedy */
/* Checks ranges; errors name the parameter (e.g. "temperature must be >= 0"). */
kvs_status kvs_sampling_validate(const kvs_sampling_params *p);

typedef struct kvs_sampler kvs_sampler;
kvs_status kvs_sampler_create(const kvs_sampling_params *p, int vocab_size, kvs_sampler **out);
void kvs_sampler_destroy(kvs_sampler *s);
/* Picks a token from logits[vocab] (logits may be modified). Reproducible for a
 * given seed and sequence of calls. If logprob is not NULL it receives the
 * log-probability of the chosen token under the unmodified distribution. */
int32_t kvs_sampler_sample(kvs_sampler *s, float *logits, float *logprob);

/* Stop conditions for generation. */
typedef struct {
    int max_tokens;
    const int32_t *stop_ids;
    int n_stop_ids;
} kvs_stop_params;

bool kvs_is_stop_token(const kvs_stop_params *p, int32_t id);

#endif
