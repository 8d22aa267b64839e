/* backend: sampling rows of logits in backend memory (the `sample` op), the
 * per-row parameters, and the math the CPU and CUDA ops share so that both
 * pick the same token: a counter-based RNG (no state: the draw depends only on
 * (seed, step, token id)), Gumbel noise, order-preserving float keys and
 * fixed-point softmax weights (integer sums: exact in any order).
 *
 * The op, for row r with p = params[r] and logits x[0 .. vocab):
 * - a row holding a non-finite logit (NaN, +inf or -inf: a numerical failure
 *   upstream, never a distribution) samples nothing: id -1, logprob NaN. The
 *   engine fails that request alone.
 * - p.forced (teacher forcing: scoring given tokens): the id is p.forced_id
 *   (in [0, vocab)), whatever the other parameters say.
 * - p.temperature == 0: greedy, the argmax of x, ties to the lowest id; the
 *   filters are ignored.
 * - otherwise z_i = x_i / T (f32) and m = max z; token i is kept when
 *     top-k   (0 < k < vocab): key(z_i) >= key of the k-th largest z (ties kept);
 *     min-p   (> 0):           (double)z_i - m >= log(min_p);
 *     top-p   (< 1):           among the tokens kept by top-k and min-p, with
 *                              w_i = floor(exp(z_i - m) * 2^40) (double exp),
 *                              key(z_i) >= tau, tau the largest key for which the
 *                              sum of w over kept tokens with key >= tau reaches
 *                              top_p * (sum of all their w) (double compare): the
 *                              smallest set of highest-z tokens with that mass,
 *                              ties with its last member kept;
 *   and the op picks the argmax over the kept tokens of z_i + g_i (f32; ties to
 *   the lowest id) with g_i = kvs_sample_gumbel(kvs_sample_stream(seed, step), i):
 *   an exact draw from softmax(z) restricted to the kept set (Gumbel-max).
 *   Every filter is a threshold on z, so top-k, min-p and top-p commute.
 * - logprobs (optional): log softmax of the raw logits x (T not applied, no
 *   filters) at the chosen id.
 * Greedy is shardable (max of (x, id) pairs), and so is pure temperature
 * sampling: the hash takes the global token id, so a vocabulary slice can take
 * its local max of z_i + g_i; a forced row needs only the slice that holds its id. */
#ifndef KVS_BACKEND_SAMPLE_H
#define KVS_BACKEND_SAMPLE_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>

#ifdef __CUDACC__
#define KVS_HD __host__ __device__ __forceinline__
#else
#define KVS_HD static inline
#endif

/* One row's parameters (40 bytes; an array of them lives in backend memory).
 * All zero but top_p 1 is greedy. */
typedef struct kvs_sample_row {
    float temperature; /* 0: greedy */
    int32_t top_k;     /* 0 (or >= vocab): off */
    float top_p;       /* in (0, 1]; 1: off */
    float min_p;       /* in [0, 1]; 0: off */
    uint64_t seed;     /* the request's stream */
    uint64_t step;     /* the draw in that stream (the engine: tokens generated so far) */
    int32_t forced;    /* 1: teacher forcing: the row's id is forced_id (its logprob the model's); 0: a draw */
    int32_t forced_id;
} kvs_sample_row;

/* splitmix64's finalizer. */
KVS_HD uint64_t kvs_sample_mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

/* The key of one (seed, step) draw. */
KVS_HD uint64_t kvs_sample_stream(uint64_t seed, uint64_t step) {
    return kvs_sample_mix64(seed ^ kvs_sample_mix64(step + 0x9e3779b97f4a7c15ull));
}

/* Gumbel(0, 1) noise for token id of a draw: -log(-log(u)), u in (0, 1) from a
 * hash of (stream, id), computed in double and rounded once to f32. */
KVS_HD float kvs_sample_gumbel(uint64_t stream, int64_t id) {
    uint64_t h = kvs_sample_mix64(stream + ((uint64_t)id + 1) * 0x9e3779b97f4a7c15ull);
    double u = ((double)(h >> 11) + 0.5) * (1.0 / 9007199254740992.0); /* 2^-53 */
    return (float)-log(-log(u));
}

/* Order-preserving unsigned key of a float (larger float, larger key). */
KVS_HD uint32_t kvs_sample_key(float z) {
    union {
        float f;
        uint32_t u;
    } c;
    c.f = z;
    return (c.u & 0x80000000u) ? ~c.u : c.u | 0x80000000u;
}

/* Fixed-point softmax weight of z against the max m (z <= m): in [0, 2^40]. */
KVS_HD uint64_t kvs_sample_weight(float z, float m) {
    return (uint64_t)(exp((double)z - (double)m) * 1099511627776.0); /* 2^40 */
}

KVS_HD bool kvs_sample_min_p_ok(float z, float m, double log_min_p) { return (double)z - (double)m >= log_min_p; }

/* One byte of the radix select over the keys (cpu_sample.c's threshold,
 * cuda_sample.cu's kvs_sample_threshold), from the 256 bins of the kept weight
 * under the prefix: on the first byte (first) with frac > 0 the target becomes
 * frac x the bins' total; the byte is the highest d whose bins from 255 down to
 * d reach the target (0 when none), and above gains the bins past d. */
KVS_HD uint32_t kvs_sample_radix_digit(const unsigned long long *bins, bool first, double frac, double *target,
                                       unsigned long long *above) {
    if (first && frac > 0) {
        unsigned long long total = 0;
        for (int d = 0; d < 256; d++) total += bins[d];
        *target = frac * (double)total;
    }
    int d = 255;
    for (; d > 0; d--) {
        if ((double)(*above + bins[d]) >= *target) break;
        *above += bins[d];
    }
    return (uint32_t)d;
}

/* ---- logits processing before the draw (the process_logits op) ----------
 * Penalties, logit_bias, banned tokens and grammar masks, on the device. For
 * row r with q = rows[r] and its raw logits x (act_dtype), out[r][i] is
 *  - x_i when x_i is not finite (the sample op then fails the row, as before);
 *  - KVS_SAMPLE_MASKED when q.mask_row >= 0 and bit i % 32 of word i / 32 of
 *    mask row q.mask_row is clear (a grammar forbids token i);
 *  - kvs_sample_adjusted(x_i, adjust[e], &q) when token i is adjust[e].id for
 *    an e in [q.adjust_begin, q.adjust_begin + q.adjust_count) (ids distinct
 *    within a row);
 *  - x_i otherwise;
 * rounded to act_dtype. KVS_SAMPLE_MASKED is the lowest finite bf16 (and a
 * float): the sample op never picks a masked token while the row keeps one
 * finite, unmasked logit (greedy, every filter and the Gumbel draw order it
 * last; its weight is 0), and the row does not count as non-finite. */
#define KVS_SAMPLE_MASKED (-3.38953139e38f)
#define KVS_MAX_TOP_LOGPROBS 20

typedef struct kvs_logit_adjust {
    int32_t id;
    int32_t count;     /* times the request generated it (frequency and presence penalties) */
    float bias;        /* added first (logit_bias); -INFINITY: banned (min_tokens' stop ids) */
    int32_t in_prompt; /* 1: the prompt holds it (the repetition penalty applies to prompt and output) */
} kvs_logit_adjust;

typedef struct kvs_process_row {
    float presence, frequency, repetition; /* off: 0, 0, 1 */
    int32_t adjust_begin, adjust_count;    /* the row's entries in the step's adjust list */
    int32_t mask_row;                      /* -1: no grammar mask */
} kvs_process_row;

/* 32-bit words of one mask row. */
KVS_HD int kvs_sample_mask_words(int vocab) { return (vocab + 31) / 32; }

/* One adjusted logit, vLLM's order: logit_bias, then the repetition penalty
 * (divides a positive logit, multiplies a negative one), then frequency and
 * presence (subtracted). Kept within +-1e38 so that it never reaches the mask. */
KVS_HD float kvs_sample_adjusted(float x, const kvs_logit_adjust *a, const kvs_process_row *q) {
    if (a->bias == -INFINITY) return KVS_SAMPLE_MASKED;
    float v = x + a->bias;
    if (q->repetition != 1.0f && (a->count > 0 || a->in_prompt)) v = v > 0 ? v / q->repetition : v * q->repetition;
    float pen = q->frequency * (float)a->count;
    if (a->count > 0) pen += q->presence;
    v -= pen;
    return v > 1e38f ? 1e38f : v < -1e38f ? -1e38f : v;
}

/* ---- top logprobs (the top_logprobs op, on the raw logits after the draw) --
 * For row r: lp = the log softmax of its raw logits x; chosen_lp[r] =
 * lp[chosen[r]] (NaN when chosen[r] < 0: a failed row); for j < k (k in
 * [0, KVS_MAX_TOP_LOGPROBS]) top_ids[r * k + j] / top_lp[r * k + j]: the
 * j-th largest x (ties to the lower id) and its lp; id -1 and lp -inf past
 * the vocabulary, -1 and NaN in a failed row. */
KVS_HD bool kvs_sample_ranks_before(float v, int i, float bv, int bi) { /* (v, i) before (bv, bi) */
    return bi < 0 || v > bv || (v == bv && i < bi);
}

/* ---- tensor parallelism: sampling a row whose logits are split by vocabulary
 * A rank holding the slice of global ids id0 .. id0 + count - 1 reduces it to
 * one kvs_sample_part (the sample_shard op); the ranks all-gather the parts
 * (28 bytes per row and rank instead of the slice) and kvs_sample_pick
 * combines them, in rank (= vocabulary) order, into exactly the id the sample
 * op picks over the whole row: for greedy rows and for pure temperature rows
 * (top-k, top-p and min-p off; the filters need the whole row). logprob: as
 * the sample op's, from per-slice sums (equal up to the order of the sum). */
typedef struct kvs_sample_part {
    float x_max;       /* the slice's first maximum of the logits */
    int32_t x_id;      /* its global id; -1: an empty slice (count 0) or a non-finite one */
    float s_max;       /* temperature rows: the slice's best kept z + g */
    int32_t s_id;      /* its global id (forced rows: the forced id when the slice holds it); -1: a greedy
                          row or nothing kept */
    float x_at_s;      /* the logit at s_id */
    float sum_exp;     /* sum over the slice of exp(x - x_max) */
    int32_t nonfinite; /* 1: the slice holds a NaN or infinite logit (the row samples nothing) */
} kvs_sample_part;

/* Whether a row can be sampled from parts: greedy, or temperature alone
 * (top_k 0 or >= vocab, top_p 1, min_p 0). */
KVS_HD bool kvs_sample_shardable(const kvs_sample_row *p, int vocab) {
    return p->forced || p->temperature == 0 || ((p->top_k <= 0 || p->top_k >= vocab) && p->top_p >= 1 && p->min_p <= 0);
}

/* The id of a row from world parts (parts[r * stride] is rank r's), and its
 * logprob when logprob is not NULL; -1 (logprob NaN) when a slice held a
 * non-finite logit, as the sample op.
 * Why it is exact: greedy is the first maximum over the slices' first maxima.
 * With temperature, M = (global max x) / T; when M > -inf every token except
 * +inf ones (M = +inf) is kept, so each slice's kept set is the global one
 * restricted to it, except a slice whose own max is -inf (it reports its
 * first token with s = -inf, which is what the whole row's scan would keep);
 * the scan's "first kept token, then a strictly larger z + g" is the same
 * over slices taken in order. M = -inf or nothing kept: the argmax. */
KVS_HD int32_t kvs_sample_pick(const kvs_sample_part *parts, int world, size_t stride, const kvs_sample_row *p,
                               float *logprob) {
    float m = -INFINITY, x_at = -INFINITY;
    int32_t id = -1;
    for (int r = 0; r < world; r++)
        if (parts[(size_t)r * stride].nonfinite) {
            if (logprob) *logprob = NAN;
            return -1;
        }
    for (int r = 0; r < world; r++) {
        const kvs_sample_part *q = parts + (size_t)r * stride;
        if (q->x_id >= 0 && (id < 0 || q->x_max > m)) m = q->x_max, id = q->x_id;
    }
    x_at = m;
    if (p->forced) { /* the slice holding the id reported it as its pick */
        id = p->forced_id;
        for (int r = 0; r < world; r++)
            if (parts[(size_t)r * stride].s_id == id) x_at = parts[(size_t)r * stride].x_at_s;
    } else if (p->temperature > 0 && m / p->temperature > -INFINITY) {
        float best = -INFINITY;
        int32_t pick = -1;
        for (int r = 0; r < world; r++) {
            const kvs_sample_part *q = parts + (size_t)r * stride;
            if (q->s_id >= 0 && (pick < 0 || q->s_max > best)) best = q->s_max, pick = q->s_id, x_at = q->x_at_s;
        }
        if (pick >= 0) id = pick;
    }
    if (logprob) {
        double sum = 0;
        for (int r = 0; r < world; r++) {
            const kvs_sample_part *q = parts + (size_t)r * stride;
            if (q->x_id >= 0 && !(q->x_max == -INFINITY && m > -INFINITY)) /* all--inf slices add 0 */
                sum += (double)q->sum_exp * exp((double)q->x_max - (double)m);
        }
        *logprob = (float)((double)x_at - (double)m - log(sum));
    }
    return id < 0 ? 0 : id;
}

#undef KVS_HD
#endif
