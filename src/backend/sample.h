/* backend: sampling rows of logits in backend memory (the `sample` op), the
 * per-row parameters, and the math the CPU and CUDA ops share so that both
 * pick the same token: a counter-based RNG (no state: the draw depends only on
 * (seed, step, token id)), Gumbel noise, order-preserving float keys and
 * fixed-point softmax weights (integer sums: exact in any order).
 *
 * The op, for row r with p = params[r] and logits x[0 .. vocab) (NaN read as -inf):
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
 *   filters) at the chosen id, as the host sampler (engine.h) reports it.
 * Greedy is shardable (max of (x, id) pairs), and so is pure temperature
 * sampling: the hash takes the global token id, so a vocabulary slice can take
 * its local max of z_i + g_i. */
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

/* One row's parameters (32 bytes; an array of them lives in backend memory). */
typedef struct kvs_sample_row {
    float temperature; /* 0: greedy */
    int32_t top_k;     /* 0 (or >= vocab): off */
    float top_p;       /* in (0, 1]; 1: off */
    float min_p;       /* in [0, 1]; 0: off */
    uint64_t seed;     /* the request's stream */
    uint64_t step;     /* the draw in that stream (the engine: tokens generated so far) */
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

/* NaN logits read as -inf. */
KVS_HD float kvs_sample_clean(float x) { return x != x ? -INFINITY : x; }

#undef KVS_HD
#endif
