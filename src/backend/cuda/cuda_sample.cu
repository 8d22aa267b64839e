/* The sample op on the GPU: one block per row, the CPU op's passes
 * (cpu/cpu_sample.c) with block reductions; backend/sample.h states the
 * semantics. Thresholds use integer sums (order-free), so the kept set does
 * not depend on the reduction order and runs repeat exactly. No allocation,
 * no host round trip: ids (and logprobs) stay in device memory. */
#include "backend/cuda/cuda_internal.h"

extern "C" {
#include "backend/sample.h"
}

#define KVS_SAMPLE_THREADS 512

/* (v, i) beats (bv, bi): a larger value, ties to the lower id; i < 0 is nothing. */
__device__ __forceinline__ bool kvs_sample_better(float v, int i, float bv, int bi) {
    return i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi));
}

/* The block's best (v, i), returned to every thread. */
__device__ void kvs_sample_block_best(float &v, int &i, float *sv, int *si) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int k = 16; k > 0; k >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, k);
        int oi = __shfl_xor_sync(0xffffffffu, i, k);
        if (kvs_sample_better(ov, oi, v, i)) v = ov, i = oi;
    }
    if (lane == 0) sv[warp] = v, si[warp] = i;
    __syncthreads();
    if (warp == 0) {
        bool have = lane < (int)(blockDim.x >> 5);
        v = have ? sv[lane] : -INFINITY;
        i = have ? si[lane] : -1;
        for (int k = 16; k > 0; k >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, v, k);
            int oi = __shfl_xor_sync(0xffffffffu, i, k);
            if (kvs_sample_better(ov, oi, v, i)) v = ov, i = oi;
        }
        if (lane == 0) sv[0] = v, si[0] = i;
    }
    __syncthreads();
    v = sv[0];
    i = si[0];
    __syncthreads(); /* sv, si free for the next reduction */
}

__device__ float kvs_sample_block_sum(float v, float *sv) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int k = 16; k > 0; k >>= 1) v += __shfl_xor_sync(0xffffffffu, v, k);
    if (lane == 0) sv[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? sv[lane] : 0.f;
        for (int k = 16; k > 0; k >>= 1) v += __shfl_xor_sync(0xffffffffu, v, k);
        if (lane == 0) sv[0] = v;
    }
    __syncthreads();
    v = sv[0];
    __syncthreads();
    return v;
}

/* One row's filter state: z = x / t, m = max z, keep key(z) >= tau and z - m >= log_min_p. */
struct kvs_sample_view {
    const bf16 *x;
    int vocab;
    float t, m;
    uint32_t tau;
    double log_min_p;
    __device__ float z(int i) const { return __bfloat162float(x[i]) / t; }
    __device__ bool kept(float z) const {
        return kvs_sample_key(z) >= tau && kvs_sample_min_p_ok(z, m, log_min_p);
    }
};

/* Radix select over the keys, most significant byte first (cpu_sample.c's
 * threshold): the largest tau whose kept weight at or above reaches target
 * (frac * the kept total when frac > 0). */
__device__ uint32_t kvs_sample_threshold(const kvs_sample_view &r, bool by_mass, double target, double frac,
                                         unsigned long long *bins, uint32_t *s_prefix) {
    uint32_t prefix = 0;
    unsigned long long above = 0; /* thread 0's */
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int j = threadIdx.x; j < 256; j += blockDim.x) bins[j] = 0;
        __syncthreads();
        uint32_t hi_mask = shift == 24 ? 0u : ~0u << (shift + 8);
        for (int i = threadIdx.x; i < r.vocab; i += blockDim.x) {
            float z = r.z(i);
            uint32_t key = kvs_sample_key(z);
            if ((key & hi_mask) != prefix || !r.kept(z)) continue;
            atomicAdd(&bins[(key >> shift) & 255], by_mass ? (unsigned long long)kvs_sample_weight(z, r.m) : 1ull);
        }
        __syncthreads();
        if (threadIdx.x == 0)
            *s_prefix = prefix | kvs_sample_radix_digit(bins, shift == 24, frac, &target, &above) << shift;
        __syncthreads();
        prefix = *s_prefix;
    }
    return prefix;
}

__global__ void __launch_bounds__(KVS_SAMPLE_THREADS)
    kvs_sample_kernel(int32_t *ids, float *logprobs, const bf16 *logits, int ld, int vocab,
                      const kvs_sample_row *params) {
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ unsigned long long bins[256];
    __shared__ uint32_t s_prefix;
    const int row = blockIdx.x;
    const bf16 *x = logits + (size_t)row * ld;
    const kvs_sample_row p = params[row];

    float bx = -INFINITY; /* the argmax of the raw logits, first maximum */
    int best = -1, nonfinite = 0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float v = __bfloat162float(x[i]);
        nonfinite |= !isfinite(v);
        if (best < 0 || v > bx) bx = v, best = i;
    }
    if (__syncthreads_or(nonfinite)) { /* block-uniform: the row samples nothing */
        if (threadIdx.x == 0) {
            ids[row] = -1;
            if (logprobs) logprobs[row] = NAN;
        }
        return;
    }
    kvs_sample_block_best(bx, best, sv, si);
    int id = p.forced ? p.forced_id : best;

    if (!p.forced && p.temperature > 0) {
        kvs_sample_view r = {x, vocab, p.temperature, bx / p.temperature, 0u,
                             p.min_p > 0 ? log((double)p.min_p) : -INFINITY};
        if (p.top_k > 0 && p.top_k < vocab) r.tau = kvs_sample_threshold(r, false, (double)p.top_k, 0, bins, &s_prefix);
        if (p.top_p < 1) r.tau = kvs_sample_threshold(r, true, 0, p.top_p, bins, &s_prefix);
        uint64_t stream = kvs_sample_stream(p.seed, p.step);
        float bs = -INFINITY;
        int pick = -1;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            float z = r.z(i);
            if (!r.kept(z)) continue;
            float s = z + kvs_sample_gumbel(stream, i);
            if (pick < 0 || s > bs) bs = s, pick = i;
        }
        kvs_sample_block_best(bs, pick, sv, si);
        if (pick >= 0) id = pick;
    }
    if (logprobs) {
        float sum = 0.f;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x)
            sum += expf(__bfloat162float(x[i]) - bx);
        sum = kvs_sample_block_sum(sum, sv);
        if (threadIdx.x == 0) logprobs[row] = __bfloat162float(x[id]) - bx - logf(sum);
    }
    if (threadIdx.x == 0) ids[row] = id;
}

void kvs_cuda_sample(kvs_backend *b, int32_t *ids, float *logprobs, const void *logits, int n_rows, int ld, int vocab,
                     const struct kvs_sample_row *params) {
    if (n_rows <= 0 || vocab <= 0) return;
    kvs_sample_kernel<<<n_rows, KVS_SAMPLE_THREADS, 0, kvs_cuda_of(b)->stream>>>(ids, logprobs, (const bf16 *)logits,
                                                                                 ld, vocab, params);
    KVS_CUDA_LAUNCHED(b, "kvs_sample_kernel");
}

/* One vocabulary slice of each row (tensor parallelism): cpu_sample.c's
 * shard_row, one block per row. */
__global__ void __launch_bounds__(KVS_SAMPLE_THREADS)
    kvs_sample_shard_kernel(kvs_sample_part *parts, const bf16 *logits, int ld, int count, int id0,
                            const kvs_sample_row *params) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const int row = blockIdx.x;
    kvs_sample_part o = {-INFINITY, -1, -INFINITY, -1, -INFINITY, 0.f, 0};
    if (count <= 0) { /* block-uniform */
        if (threadIdx.x == 0) parts[row] = o;
        return;
    }
    const bf16 *x = logits + (size_t)row * ld;
    const kvs_sample_row p = params[row];
    float bx = -INFINITY;
    int best = -1, nonfinite = 0;
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
        float v = __bfloat162float(x[i]);
        nonfinite |= !isfinite(v);
        if (best < 0 || v > bx) bx = v, best = i;
    }
    if (__syncthreads_or(nonfinite)) { /* block-uniform: the row samples nothing */
        o.nonfinite = 1;
        if (threadIdx.x == 0) parts[row] = o;
        return;
    }
    kvs_sample_block_best(bx, best, sv, si);
    float sum = 0.f;
    for (int i = threadIdx.x; i < count; i += blockDim.x) sum += expf(__bfloat162float(x[i]) - bx);
    sum = kvs_sample_block_sum(sum, sv);
    o.x_max = bx, o.x_id = id0 + best, o.sum_exp = sum;
    if (p.forced) { /* block-uniform */
        if (p.forced_id >= id0 && p.forced_id < id0 + count)
            o.s_id = p.forced_id, o.x_at_s = __bfloat162float(x[p.forced_id - id0]);
    } else if (p.temperature > 0) {
        float t = p.temperature, m = bx / t;
        if (m == -INFINITY) { /* block-uniform: see shard_row */
            o.s_id = id0, o.x_at_s = __bfloat162float(x[0]);
        } else {
            uint64_t stream = kvs_sample_stream(p.seed, p.step);
            float bs = -INFINITY;
            int pick = -1;
            for (int i = threadIdx.x; i < count; i += blockDim.x) {
                float z = __bfloat162float(x[i]) / t;
                if (!kvs_sample_min_p_ok(z, m, -INFINITY)) continue; /* z = m = +inf */
                float s = z + kvs_sample_gumbel(stream, (int64_t)id0 + i);
                if (pick < 0 || s > bs) bs = s, pick = i;
            }
            kvs_sample_block_best(bs, pick, sv, si);
            if (pick >= 0) o.s_max = bs, o.s_id = id0 + pick, o.x_at_s = __bfloat162float(x[pick]);
        }
    }
    if (threadIdx.x == 0) parts[row] = o;
}

void kvs_cuda_sample_shard(kvs_backend *b, kvs_sample_part *parts, const void *logits, int n_rows, int ld, int count,
                           int id0, const struct kvs_sample_row *params) {
    if (n_rows <= 0) return;
    kvs_sample_shard_kernel<<<n_rows, KVS_SAMPLE_THREADS, 0, kvs_cuda_of(b)->stream>>>(
        parts, (const bf16 *)logits, ld, count, id0, params);
    KVS_CUDA_LAUNCHED(b, "kvs_sample_shard_kernel");
}

/* process_logits (cpu_logits.c's kvs_cpu_process_logits): the copy with the
 * grammar masks over a grid of (vocabulary chunk, row), then the rows' adjust
 * lists, one block per row (each entry's token read from the raw logits). */
#define KVS_PROCESS_CHUNK 4096

__global__ void kvs_process_copy_kernel(bf16 *out, int ld_out, const bf16 *logits, int ld, int vocab,
                                        const kvs_process_row *rows, const uint32_t *masks, int words) {
    const int row = blockIdx.y;
    const int mask_row = rows[row].mask_row;
    const uint32_t *mask = mask_row >= 0 ? masks + (size_t)mask_row * words : NULL;
    const bf16 *x = logits + (size_t)row * ld;
    bf16 *y = out + (size_t)row * ld_out;
    int end = min(vocab, (int)(blockIdx.x + 1) * KVS_PROCESS_CHUNK);
    for (int i = blockIdx.x * KVS_PROCESS_CHUNK + threadIdx.x; i < end; i += blockDim.x) {
        bf16 v = x[i];
        bool masked = mask && isfinite(__bfloat162float(v)) && !(mask[i >> 5] >> (i & 31) & 1);
        y[i] = masked ? __float2bfloat16(KVS_SAMPLE_MASKED) : v;
    }
}

__global__ void kvs_process_adjust_kernel(bf16 *out, int ld_out, const bf16 *logits, int ld, int vocab,
                                          const kvs_process_row *rows, const kvs_logit_adjust *adjust) {
    const int row = blockIdx.x;
    const kvs_process_row q = rows[row];
    const bf16 *x = logits + (size_t)row * ld;
    bf16 *y = out + (size_t)row * ld_out;
    for (int e = q.adjust_begin + threadIdx.x; e < q.adjust_begin + q.adjust_count; e += blockDim.x) {
        kvs_logit_adjust a = adjust[e];
        if (a.id < 0 || a.id >= vocab) continue;
        float v = __bfloat162float(x[a.id]);
        if (isfinite(v) && __bfloat162float(y[a.id]) != KVS_SAMPLE_MASKED)
            y[a.id] = __float2bfloat16(kvs_sample_adjusted(v, &a, &q));
    }
}

void kvs_cuda_process_logits(kvs_backend *b, void *out, int ld_out, const void *logits, int ld, int n_rows, int vocab,
                             const struct kvs_process_row *rows, const struct kvs_logit_adjust *adjust,
                             const uint32_t *masks) {
    if (n_rows <= 0 || vocab <= 0) return;
    cudaStream_t st = kvs_cuda_of(b)->stream;
    dim3 grid((vocab + KVS_PROCESS_CHUNK - 1) / KVS_PROCESS_CHUNK, n_rows);
    kvs_process_copy_kernel<<<grid, 256, 0, st>>>((bf16 *)out, ld_out, (const bf16 *)logits, ld, vocab, rows, masks,
                                                  kvs_sample_mask_words(vocab));
    KVS_CUDA_LAUNCHED(b, "kvs_process_copy_kernel");
    kvs_process_adjust_kernel<<<n_rows, 256, 0, st>>>((bf16 *)out, ld_out, (const bf16 *)logits, ld, vocab, rows,
                                                      adjust);
    KVS_CUDA_LAUNCHED(b, "kvs_process_adjust_kernel");
}

/* top_logprobs (cpu_logits.c's kvs_cpu_top_logprobs), one block per row: each
 * thread keeps its k best (sorted) over its strided share, then k rounds of a
 * block argmax over the threads' heads (the winner advances its head). */
#define KVS_TOPLP_THREADS 256

__global__ void __launch_bounds__(KVS_TOPLP_THREADS)
    kvs_top_logprobs_kernel(float *chosen_lp, int32_t *top_ids, float *top_lp, const bf16 *logits, int ld, int vocab,
                            const int32_t *chosen, int k) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const int row = blockIdx.x;
    const bf16 *x = logits + (size_t)row * ld;
    float bx = -INFINITY;
    int best = -1, nonfinite = 0;
    float lv[KVS_MAX_TOP_LOGPROBS];
    int li[KVS_MAX_TOP_LOGPROBS], n = 0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float v = __bfloat162float(x[i]);
        nonfinite |= !isfinite(v);
        if (best < 0 || v > bx) bx = v, best = i;
        if (k == 0 || (n == k && !kvs_sample_ranks_before(v, i, lv[k - 1], li[k - 1]))) continue;
        int j = n < k ? n++ : k - 1;
        while (j > 0 && kvs_sample_ranks_before(v, i, lv[j - 1], li[j - 1])) lv[j] = lv[j - 1], li[j] = li[j - 1], j--;
        lv[j] = v, li[j] = i;
    }
    int c = chosen[row];
    if (__syncthreads_or(nonfinite) || c < 0) { /* block-uniform */
        if (threadIdx.x == 0) chosen_lp[row] = NAN;
        for (int j = threadIdx.x; j < k; j += blockDim.x) top_ids[(size_t)row * k + j] = -1, top_lp[(size_t)row * k + j] = NAN;
        return;
    }
    kvs_sample_block_best(bx, best, sv, si);
    float sum = 0.f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) sum += expf(__bfloat162float(x[i]) - bx);
    sum = kvs_sample_block_sum(sum, sv);
    float lse = bx + logf(sum);
    if (threadIdx.x == 0) chosen_lp[row] = __bfloat162float(x[c]) - lse;
    int head = 0;
    for (int j = 0; j < k; j++) {
        float v = head < n ? lv[head] : -INFINITY;
        int i = head < n ? li[head] : -1;
        kvs_sample_block_best(v, i, sv, si);
        if (i >= 0 && head < n && li[head] == i) head++;
        if (threadIdx.x == 0) {
            top_ids[(size_t)row * k + j] = i;
            top_lp[(size_t)row * k + j] = i >= 0 ? v - lse : -INFINITY;
        }
    }
}

void kvs_cuda_top_logprobs(kvs_backend *b, float *chosen_lp, int32_t *top_ids, float *top_lp, const void *logits,
                           int n_rows, int ld, int vocab, const int32_t *chosen, int k) {
    if (n_rows <= 0 || vocab <= 0) return;
    kvs_top_logprobs_kernel<<<n_rows, KVS_TOPLP_THREADS, 0, kvs_cuda_of(b)->stream>>>(
        chosen_lp, top_ids, top_lp, (const bf16 *)logits, ld, vocab, chosen, k);
    KVS_CUDA_LAUNCHED(b, "kvs_top_logprobs_kernel");
}
