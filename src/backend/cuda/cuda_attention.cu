/* Causal GQA attention over the paged KV cache, with LSE.
 *
 * Three kernels behind one entry point:
 *  - kvs_attn_fa2mt_kernel (head_dim 32/64/128, batches with a chunk longer than
 *    one token): FlashAttention-2 structure on mma.sync m16n8k16 bf16. Each warp
 *    owns two 16-row m-tiles (each K/V fragment read from shared memory feeds two
 *    mma's; Q stays in shared memory); K/V tiles of 64 keys stream through shared
 *    memory with cp.async (double buffered, rows padded by 16 bytes so ldmatrix is
 *    conflict free); S stays in registers and becomes the bf16 A fragments of P.V
 *    directly; online softmax in the exp2 domain; causal masking only on the
 *    tiles that cross the diagonal; heaviest query tiles launch first. By default
 *    (KVS_CUDA_PREFILL_GQA) a block of 8 warps takes 4 query heads of a GQA group
 *    (HEAD: one head, for groups not a multiple of 4). Where its shared memory
 *    does not fit, kvs_attn_fa2_kernel (SMALL: one m-tile a warp, Q in
 *    registers). The other kernel versions measured live in bench/. On request
 *    (KVS_CUDA_PREFILL_WGMMA, compute capability 9.0) the Hopper kernel of
 *    cuda_attention_hopper.cu takes the bf16 prefill calls it supports.
 *  - kvs_attn_decode_warp_kernel (one-token batches, head_dim 32/64/128, GQA group
 *    <= 16, block_size a multiple of 16): per-warp cp.async rings, wave-aware
 *    splits, kvs_attn_combine_kernel merges the splits (none with one split);
 *    on FP8 pools kvs_attn_decode8_kernel, the same structure with the codes
 *    converted straight into the mma fragments.
 *  - kvs_attn_split_kernel: the scalar fallback for other head sizes (80, 96,
 *    256), larger groups and block sizes not a multiple of 16, also split + combine;
 *    and every batch of a sliding-window layer (kvs_attn_batch.window), prefill
 *    too: each token attends to its window alone (at most `window` keys).
 * LSE is the natural log of the softmax denominator of the scaled scores. */
#include <math.h>

#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/cuda_mma.cuh"

#define KVS_ATTN_TILE 64    /* keys per K/V tile; query rows per prefill block */
#define KVS_ATTN_THREADS 128

/* FP8 pools (the kernels' FP8 template argument): codes read from the paged
 * blocks are decoded into bf16 exactly (kvs_fp8x8_to_bf16x8) before the mma's;
 * the K scale of KV head g is folded into the softmax scale and the V scale
 * multiplies the output, so the math on the tensor cores is the bf16 kernels'.
 * The decode kernel (kvs_attn_decode8_kernel) converts codes to f16 instead. */

/* Loads keys [key0, key0 + 64) of (seq, kv head) into k_s and v_s (rows of D + 8;
 * rows at or past key_end are zero). 16-byte pieces of bf16 (FP8: 8-byte pieces
 * of codes, decoded). */
template <int D, bool FP8>
__device__ __forceinline__ void kvs_attn_load_kv_tile(const kvs_attn_args &a, const int32_t *table, int g, int key0,
                                                      int key_end, bf16 *k_s, bf16 *v_s) {
    constexpr int PIECES = D / 8, LD = D + 8;
    for (int idx = threadIdx.x; idx < KVS_ATTN_TILE * PIECES; idx += blockDim.x) {
        int r = idx / PIECES, c = idx % PIECES, e = key0 + r;
        uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
        if (e < key_end) {
            int blk = table[e / a.block_size], off = e % a.block_size;
            size_t ko = kvs_kv_offset(blk, 0, g, off, a.n_kv_heads, a.block_size, D) + c * 8;
            size_t vo = kvs_kv_offset(blk, 1, g, off, a.n_kv_heads, a.block_size, D) + c * 8;
            if (FP8) {
                kv = kvs_fp8x8_to_bf16x8(*(const uint2 *)(kvs_attn_pool8(a) + ko));
                vv = kvs_fp8x8_to_bf16x8(*(const uint2 *)(kvs_attn_pool8(a) + vo));
            } else {
                kv = *(const uint4 *)(a.pool + ko);
                vv = *(const uint4 *)(a.pool + vo);
            }
        }
        *(uint4 *)(k_s + r * LD + c * 8) = kv;
        *(uint4 *)(v_s + r * LD + c * 8) = vv;
    }
}

/* ---- decode (and fallback): one token x one KV group a block, split along keys */

/* Shared memory: K, V tiles, then f32 q[G][D], s[G][64], o[G][D], m, l, alpha[G]. */
template <int D>
static size_t kvs_split_smem_bytes(int group) {
    return (size_t)2 * KVS_ATTN_TILE * (D + 8) * 2 +
           sizeof(float) * ((size_t)group * D * 2 + (size_t)group * KVS_ATTN_TILE + 3 * (size_t)group);
}

/* Sequence of token t: the last s with q_start[s] <= t. */
__device__ __forceinline__ int kvs_attn_seq_of(const int32_t *q_start, int n_seqs, int t) {
    int lo = 0, hi = n_seqs - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (q_start[mid] <= t) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

template <int D, bool FP8>
__global__ void __launch_bounds__(KVS_ATTN_THREADS)
    kvs_attn_split_kernel(kvs_attn_args a, float *part_o, float *part_ml, int split_len) {
    constexpr int LD = D + 8;
    extern __shared__ __align__(128) unsigned char smem[];
    const int group = a.n_heads / a.n_kv_heads;
    bf16 *k_s = (bf16 *)smem, *v_s = k_s + KVS_ATTN_TILE * LD;
    float *q_s = (float *)(v_s + KVS_ATTN_TILE * LD), *s_s = q_s + group * D, *o_s = s_s + group * KVS_ATTN_TILE;
    float *m_s = o_s + group * D, *l_s = m_s + group, *alpha_s = l_s + group;

    const int t = blockIdx.x, g = blockIdx.y, split = blockIdx.z, h0 = g * group;
    const int seq = kvs_attn_seq_of(a.q_start, a.n_seqs, t);
    const int q_len = a.q_start[seq + 1] - a.q_start[seq];
    const int n_keys = a.kv_len[seq] - q_len + (t - a.q_start[seq]) + 1;
    const int first = a.window > 0 && n_keys > a.window ? n_keys - a.window : 0; /* the splits cover [first, n_keys) */
    const int k0 = first + split * split_len, k1 = min(n_keys, k0 + split_len);
    const int32_t *table = kvs_attn_table(a, seq);

    const float qk_scale = a.scale * (FP8 ? kvs_kv_scale(a.scales, 0, g, a.n_kv_heads) : 1.f);
    for (int i = threadIdx.x; i < group * D; i += blockDim.x) {
        q_s[i] = __bfloat162float(a.q[((size_t)t * a.n_heads + h0) * D + i]) * qk_scale;
        o_s[i] = 0.f;
    }
    for (int i = threadIdx.x; i < group; i += blockDim.x) {
        m_s[i] = -INFINITY;
        l_s[i] = 0.f;
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
    for (int key0 = k0; key0 < k1; key0 += KVS_ATTN_TILE) {
        __syncthreads();
        kvs_attn_load_kv_tile<D, FP8>(a, table, g, key0, k1, k_s, v_s);
        __syncthreads();
        /* scores: one (head, key) a thread; q pre-scaled */
        for (int idx = threadIdx.x; idx < group * KVS_ATTN_TILE; idx += blockDim.x) {
            int hh = idx / KVS_ATTN_TILE, r = idx % KVS_ATTN_TILE;
            float s = -INFINITY;
            if (key0 + r < k1) {
                const float *qv = q_s + hh * D;
                const bf16 *kv = k_s + r * LD;
                s = 0.f;
#pragma unroll
                for (int c = 0; c < D; c += 8) {
                    uint4 raw = *(const uint4 *)(kv + c);
                    const __nv_bfloat162 *k2 = (const __nv_bfloat162 *)&raw;
#pragma unroll
                    for (int u = 0; u < 4; u++) {
                        float2 kf = __bfloat1622float2(k2[u]);
                        s += qv[c + 2 * u] * kf.x + qv[c + 2 * u + 1] * kf.y;
                    }
                }
            }
            s_s[idx] = s;
        }
        __syncthreads();
        /* softmax update: one head a warp */
        for (int hh = warp; hh < group; hh += n_warps) {
            float *srow = s_s + hh * KVS_ATTN_TILE;
            float s0 = srow[lane], s1 = srow[lane + 32];
            float tmax = fmaxf(s0, s1);
            for (int k = 16; k > 0; k >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, k));
            float m_old = m_s[hh], m_new = fmaxf(m_old, tmax); /* finite: key0 < k1 */
            float p0 = __expf(s0 - m_new), p1 = __expf(s1 - m_new), sum = p0 + p1;
            for (int k = 16; k > 0; k >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, k);
            srow[lane] = p0;
            srow[lane + 32] = p1;
            __syncwarp();
            if (lane == 0) {
                float alpha = __expf(m_old - m_new);
                alpha_s[hh] = alpha;
                l_s[hh] = l_s[hh] * alpha + sum;
                m_s[hh] = m_new;
            }
        }
        __syncthreads();
        /* o = alpha o + p V: one (head, dim) a thread */
        int n_rows = min(KVS_ATTN_TILE, k1 - key0);
        for (int idx = threadIdx.x; idx < group * D; idx += blockDim.x) {
            int hh = idx / D, d = idx % D;
            const float *p = s_s + hh * KVS_ATTN_TILE;
            float acc = o_s[idx] * alpha_s[hh];
            for (int r = 0; r < n_rows; r++) acc += p[r] * __bfloat162float(v_s[r * LD + d]);
            o_s[idx] = acc;
        }
    }
    __syncthreads();
    size_t base = ((size_t)split * a.n_tokens + t) * a.n_heads + h0;
    const float vs = FP8 ? kvs_kv_scale(a.scales, 1, g, a.n_kv_heads) : 1.f;
    for (int i = threadIdx.x; i < group * D; i += blockDim.x) part_o[base * D + i] = o_s[i] * vs;
    for (int i = threadIdx.x; i < group; i += blockDim.x) {
        part_ml[(base + i) * 2] = m_s[i];
        part_ml[(base + i) * 2 + 1] = l_s[i];
    }
}

/* Merges the splits of one (token, head): out = sum_s e^(m_s - M) o_s / L. */
__global__ void kvs_attn_combine_kernel(bf16 *out, float *lse, const float *part_o, const float *part_ml,
                                        int n_splits, int n_rows, int head_dim) {
    int row = blockIdx.x; /* token * n_heads + head */
    float M = -INFINITY;
    for (int s = 0; s < n_splits; s++) M = fmaxf(M, part_ml[((size_t)s * n_rows + row) * 2]);
    float L = 0.f;
    for (int s = 0; s < n_splits; s++) {
        const float *ml = part_ml + ((size_t)s * n_rows + row) * 2;
        if (ml[0] != -INFINITY) L += ml[1] * __expf(ml[0] - M);
    }
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < n_splits; s++) {
            const float *ml = part_ml + ((size_t)s * n_rows + row) * 2;
            if (ml[0] != -INFINITY) acc += part_o[((size_t)s * n_rows + row) * head_dim + d] * __expf(ml[0] - M);
        }
        out[(size_t)row * head_dim + d] = __float2bfloat16(acc / L);
    }
    if (lse && threadIdx.x == 0) lse[row] = M + logf(L);
}

/* Shared-memory rows of K, V and Q: head_dim bf16 plus 16 bytes of padding, so the
 * eight 16-byte row pieces one ldmatrix phase reads fall in distinct banks. */
template <int D>
struct kvs_rows {
    static constexpr int BYTES = (D + 8) * 2;
    static constexpr int TILE_BYTES = KVS_ATTN_TILE * BYTES; /* one 64-key K (or V) tile */
};

/* Issues the async copies of keys [key0, key0 + 64) of (seq, kv head g) into the
 * K and V tiles at k_s, v_s (shared addresses); rows at or past key_end are zero. */
template <int D, int THREADS>
__device__ __forceinline__ void kvs_attn_issue_kv_tile(const kvs_attn_args &a, const int32_t *table, int g, int key0,
                                                       int key_end, uint32_t k_s, uint32_t v_s) {
    constexpr int CH = D / 8, PIECES = KVS_ATTN_TILE * CH;
    const size_t v_delta = (size_t)a.n_kv_heads * a.block_size * D;
#pragma unroll
    for (int p = threadIdx.x; p < PIECES; p += THREADS) {
        int r = p / CH, c = p % CH, e = key0 + r;
        bool ok = e < key_end;
        const bf16 *src = a.pool;
        if (ok)
            src = a.pool + kvs_kv_offset(table[e / a.block_size], 0, g, e % a.block_size, a.n_kv_heads,
                                         a.block_size, D) + c * 8;
        uint32_t off = r * kvs_rows<D>::BYTES + c * 16;
        kvs_cp_async16(k_s + off, src, ok);
        kvs_cp_async16(v_s + off, ok ? src + v_delta : a.pool, ok);
    }
}

/* FP8: issues the async copies of the codes of keys [key0, key0 + 64) of (seq,
 * kv head g) into raw K and V tiles at k_r, v_r (shared addresses, rows of D
 * bytes); rows at or past key_end are zero. */
template <int D, int THREADS>
__device__ __forceinline__ void kvs_attn_issue_kv_tile8(const kvs_attn_args &a, const int32_t *table, int g, int key0,
                                                        int key_end, uint32_t k_r, uint32_t v_r) {
    constexpr int CH = D / 16, PIECES = KVS_ATTN_TILE * CH;
    const size_t v_delta = (size_t)a.n_kv_heads * a.block_size * D;
    const uint8_t *pool = kvs_attn_pool8(a);
#pragma unroll
    for (int p = threadIdx.x; p < PIECES; p += THREADS) {
        int r = p / CH, c = p % CH, e = key0 + r;
        bool ok = e < key_end;
        const uint8_t *src = pool;
        if (ok)
            src = pool + kvs_kv_offset(table[e / a.block_size], 0, g, e % a.block_size, a.n_kv_heads, a.block_size, D) +
                  c * 16;
        uint32_t off = r * D + c * 16;
        kvs_cp_async16(k_r + off, src, ok);
        kvs_cp_async16(v_r + off, ok ? src + v_delta : pool, ok);
    }
}

/* FP8: `rows` rows of raw K codes at raw (then as many V rows after them, rows
 * of D bytes) decoded into bf16 K and V tiles at tile (rows of
 * kvs_rows<D>::BYTES, V at tile + v_off) by `threads` threads from `first`. */
template <int D>
__device__ __forceinline__ void kvs_attn_decode_rows8(const unsigned char *raw, unsigned char *tile, int rows,
                                                      int v_off, int first, int threads) {
    constexpr int CH = D / 8;
    const int per_kind = rows * CH;
    for (int p = first; p < 2 * per_kind; p += threads) {
        int kind = p / per_kind, q = p % per_kind, r = q / CH, c = q % CH;
        uint2 codes = *(const uint2 *)(raw + (size_t)kind * rows * D + r * D + c * 8);
        *(uint4 *)(tile + kind * v_off + r * kvs_rows<D>::BYTES + c * 16) = kvs_fp8x8_to_bf16x8(codes);
    }
}

/* Q A-fragments of a warp's 16 rows from shared memory (rows of kvs_rows<D>::BYTES). */
template <int D>
__device__ __forceinline__ void kvs_attn_load_q_frags(uint32_t (&qa)[D / 16][4], uint32_t q_w, int lane) {
    uint32_t base = q_w + ((lane & 7) + ((lane >> 3) & 1) * 8) * kvs_rows<D>::BYTES + (lane >> 4) * 16;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) kvs_ldmatrix_x4(qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], base + kk * 32);
}

/* One warp, one tile of NK keys (rows k_w, v_w of shared memory, key index key_base
 * for the first): S = Q K^T (16 x NK, registers), online softmax in the log2
 * domain (m: running max of scale*log2e*s; l: this thread's part of the running
 * sum, the quad adds them at the end), O = alpha O + P V with P converted from the
 * S accumulators straight into A fragments. Rows g and g + 8 of the warp (g = lane/4)
 * see keys e <= lim0 and e <= lim1 when MASK. */
template <int D, int NK, bool MASK>
__device__ __forceinline__ void kvs_attn_warp_tile(const uint32_t (&qa)[D / 16][4], uint32_t k_w, uint32_t v_w,
                                                   int key_base, int lim0, int lim1, float scale_log2,
                                                   float (&o)[D / 8][4], float &m0, float &m1, float &l0, float &l1,
                                                   int lane) {
    constexpr int RB = kvs_rows<D>::BYTES;
    float s[NK / 8][4];
#pragma unroll
    for (int j = 0; j < NK / 8; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;

    /* S = Q K^T: K rows are the B operand as stored (n = key, k = dim) */
    const uint32_t k_lane = k_w + (((lane >> 4) * 8) + (lane & 7)) * RB + ((lane >> 3) & 1) * 16;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
#pragma unroll
        for (int j = 0; j < NK / 8; j += 2) {
            uint32_t b0, b1, b2, b3;
            kvs_ldmatrix_x4(b0, b1, b2, b3, k_lane + j * 8 * RB + kk * 32);
            kvs_mma_bf16(s[j], qa[kk], b0, b1);
            kvs_mma_bf16(s[j + 1], qa[kk], b2, b3);
        }
    }

    /* online softmax */
    float mx0 = -INFINITY, mx1 = -INFINITY;
    const int col = key_base + 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < NK / 8; j++) {
#pragma unroll
        for (int c = 0; c < 4; c++) {
            float x = s[j][c] * scale_log2;
            if (MASK) {
                int e = col + 8 * j + (c & 1);
                if (e > (c < 2 ? lim0 : lim1)) x = -INFINITY;
            }
            s[j][c] = x;
        }
        mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
        mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float mu0 = mn0 == -INFINITY ? 0.f : mn0, mu1 = mn1 == -INFINITY ? 0.f : mn1;
    const float alpha0 = kvs_exp2(m0 - mu0), alpha1 = kvs_exp2(m1 - mu1);
    m0 = mn0, m1 = mn1;
    float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
    for (int j = 0; j < NK / 8; j++) {
        s[j][0] = kvs_exp2(s[j][0] - mu0);
        s[j][1] = kvs_exp2(s[j][1] - mu0);
        s[j][2] = kvs_exp2(s[j][2] - mu1);
        s[j][3] = kvs_exp2(s[j][3] - mu1);
        sum0 += s[j][0] + s[j][1];
        sum1 += s[j][2] + s[j][3];
    }
    l0 = l0 * alpha0 + sum0;
    l1 = l1 * alpha1 + sum1;
#pragma unroll
    for (int n = 0; n < D / 8; n++) {
        o[n][0] *= alpha0, o[n][1] *= alpha0;
        o[n][2] *= alpha1, o[n][3] *= alpha1;
    }

    /* O += P V: V rows (k = key, n = dim) through ldmatrix.trans */
    const uint32_t v_lane = v_w + (((lane >> 3) & 1) * 8 + (lane & 7)) * RB + (lane >> 4) * 16;
#pragma unroll
    for (int kk = 0; kk < NK / 16; kk++) {
        uint32_t pa[4];
        pa[0] = kvs_pack_bf16(s[2 * kk][0], s[2 * kk][1]);
        pa[1] = kvs_pack_bf16(s[2 * kk][2], s[2 * kk][3]);
        pa[2] = kvs_pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pa[3] = kvs_pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
        for (int n = 0; n < D / 8; n += 2) {
            uint32_t b0, b1, b2, b3;
            kvs_ldmatrix_x4_trans(b0, b1, b2, b3, v_lane + kk * 16 * RB + n * 16);
            kvs_mma_bf16(o[n], pa, b0, b1);
            kvs_mma_bf16(o[n + 1], pa, b2, b3);
        }
    }
}

/* The prefill variant of kvs_attn_warp_tile: the warp owns MT x 16 query rows
 * (m-tile mt: rows g and g + 8 of it see keys up to lim_base + 16 mt and + 8), so each K/V
 * fragment read from shared memory feeds MT mma's; its Q fragments are re-read
 * from shared memory (q_w: the warp's first row) at each tile, which costs less
 * shared-memory bandwidth than the K/V fragments it saves.
 * Needs scale > 0: the row max is taken over the raw scores and each
 * probability costs one FFMA + ex2 (exp2(s * scale_log2 - m)), and the O rescale
 * is skipped when no row max of the warp's m-tile changed (alpha == 1
 * everywhere; a warp vote, so a branch). */
template <int D, int NK, bool MASK, int MT>
__device__ __forceinline__ void kvs_attn_warp_tile_mt(uint32_t q_w, uint32_t k_w, uint32_t v_w, int key_base,
                                                      int lim_base, float scale_log2,
                                                      float (&o)[MT][D / 8][4], float (&m)[MT][2],
                                                      float (&l)[MT][2], int lane) {
    constexpr int RB = kvs_rows<D>::BYTES;
    float s[MT][NK / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int j = 0; j < NK / 8; j++) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;

    const uint32_t q_lane = q_w + ((lane & 7) + ((lane >> 3) & 1) * 8) * RB + (lane >> 4) * 16;
    const uint32_t k_lane = k_w + (((lane >> 4) * 8) + (lane & 7)) * RB + ((lane >> 3) & 1) * 16;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
        uint32_t qa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
            kvs_ldmatrix_x4(qa[mt][0], qa[mt][1], qa[mt][2], qa[mt][3], q_lane + mt * 16 * RB + kk * 32);
#pragma unroll
        for (int j = 0; j < NK / 8; j += 2) {
            uint32_t b0, b1, b2, b3;
            kvs_ldmatrix_x4(b0, b1, b2, b3, k_lane + j * 8 * RB + kk * 32);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                kvs_mma_bf16(s[mt][j], qa[mt], b0, b1);
                kvs_mma_bf16(s[mt][j + 1], qa[mt], b2, b3);
            }
        }
    }

    const int col = key_base + 2 * (lane & 3);
    uint32_t pa[MT][NK / 16][4];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int j = 0; j < NK / 8; j++) {
#pragma unroll
            for (int c = 0; c < 4; c++) {
                float x = s[mt][j][c];
                if (MASK) {
                    int e = col + 8 * j + (c & 1);
                    if (e > lim_base + 16 * mt + 8 * (c >> 1)) x = -INFINITY;
                }
                s[mt][j][c] = x;
            }
            mx0 = fmaxf(mx0, fmaxf(s[mt][j][0], s[mt][j][1]));
            mx1 = fmaxf(mx1, fmaxf(s[mt][j][2], s[mt][j][3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        mx0 *= scale_log2, mx1 *= scale_log2; /* -inf stays -inf (scale > 0) */
        const float mn0 = fmaxf(m[mt][0], mx0), mn1 = fmaxf(m[mt][1], mx1);
        const float mu0 = mn0 == -INFINITY ? 0.f : mn0, mu1 = mn1 == -INFINITY ? 0.f : mn1;
        const float alpha0 = kvs_exp2(m[mt][0] - mu0), alpha1 = kvs_exp2(m[mt][1] - mu1);
        const bool grew = mn0 != m[mt][0] || mn1 != m[mt][1];
        m[mt][0] = mn0, m[mt][1] = mn1;
        float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
        for (int j = 0; j < NK / 8; j++) {
            float p0 = kvs_exp2(fmaf(s[mt][j][0], scale_log2, -mu0)), p1 = kvs_exp2(fmaf(s[mt][j][1], scale_log2, -mu0));
            float p2 = kvs_exp2(fmaf(s[mt][j][2], scale_log2, -mu1)), p3 = kvs_exp2(fmaf(s[mt][j][3], scale_log2, -mu1));
            sum0 += p0 + p1;
            sum1 += p2 + p3;
            pa[mt][j / 2][(j & 1) * 2] = kvs_pack_bf16(p0, p1);
            pa[mt][j / 2][(j & 1) * 2 + 1] = kvs_pack_bf16(p2, p3);
        }
        l[mt][0] = l[mt][0] * alpha0 + sum0;
        l[mt][1] = l[mt][1] * alpha1 + sum1;
        if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
            for (int n = 0; n < D / 8; n++) {
                o[mt][n][0] *= alpha0, o[mt][n][1] *= alpha0;
                o[mt][n][2] *= alpha1, o[mt][n][3] *= alpha1;
            }
        }
    }

    const uint32_t v_lane = v_w + (((lane >> 3) & 1) * 8 + (lane & 7)) * RB + (lane >> 4) * 16;
#pragma unroll
    for (int kk = 0; kk < NK / 16; kk++) {
#pragma unroll
        for (int n = 0; n < D / 8; n += 2) {
            uint32_t b0, b1, b2, b3;
            kvs_ldmatrix_x4_trans(b0, b1, b2, b3, v_lane + kk * 16 * RB + n * 16);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                kvs_mma_bf16(o[mt][n], pa[mt][kk], b0, b1);
                kvs_mma_bf16(o[mt][n + 1], pa[mt][kk], b2, b3);
            }
        }
    }
}

/* ---- prefill: FlashAttention-2 on mma.sync ------------------------------------ */

/* Two K/V stages; the Q tile lands in the second stage (read into registers before
 * the first load into that stage is issued). */
template <int D, int WARPS>
struct kvs_fa2_smem {
    static constexpr int M = 16 * WARPS; /* query rows per block */
    static constexpr int STAGES = 2;
    static constexpr size_t kv = 0, q = 2 * (size_t)kvs_rows<D>::TILE_BYTES,
                            bytes = (size_t)STAGES * 2 * kvs_rows<D>::TILE_BYTES;
    static_assert((size_t)M * kvs_rows<D>::BYTES <= 2 * (size_t)kvs_rows<D>::TILE_BYTES, "Q fits a stage");
};

/* 4-warp blocks: at most 168 registers, so three blocks (12 warps) fit an SM */
#define KVS_FA2_MIN_BLOCKS(WARPS) ((WARPS) == 4 ? 3 : 1)

template <int D, int WARPS>
__global__ void __launch_bounds__(WARPS * 32, KVS_FA2_MIN_BLOCKS(WARPS))
    kvs_attn_fa2_kernel(kvs_attn_args a, bf16 *out, float *lse) {
    using L = kvs_fa2_smem<D, WARPS>;
    constexpr int THREADS = WARPS * 32, M = L::M, RB = kvs_rows<D>::BYTES, TB = kvs_rows<D>::TILE_BYTES;
    extern __shared__ __align__(128) unsigned char smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    /* heads fastest (the query heads of a KV group run together and share K/V in L2),
     * the query tiles with the most keys first */
    const int h = blockIdx.x, g = h / (a.n_heads / a.n_kv_heads), seq = blockIdx.z;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * M;
    const int t0 = a.q_start[seq], q_len = a.q_start[seq + 1] - t0, kv_len = a.kv_len[seq];
    if (q0 >= q_len) return;
    const int32_t *table = kvs_attn_table(a, seq);
    const int past = kv_len - q_len; /* query i sees keys 0 .. past + i */
    const int last_row = min(q0 + M, q_len) - 1;
    const int n_keys = past + last_row + 1, n_tiles = (n_keys + KVS_ATTN_TILE - 1) / KVS_ATTN_TILE;

    const uint32_t q_s = kvs_smem_u32(smem) + (uint32_t)L::q, kv_s = kvs_smem_u32(smem) + (uint32_t)L::kv;
    for (int p = threadIdx.x; p < M * (D / 8); p += THREADS) {
        int r = p / (D / 8), c = p % (D / 8);
        bool ok = q0 + r < q_len;
        const bf16 *src = ok ? a.q + ((size_t)(t0 + q0 + r) * a.n_heads + h) * D + c * 8 : a.q;
        kvs_cp_async16(q_s + r * RB + c * 16, src, ok);
    }
    kvs_attn_issue_kv_tile<D, THREADS>(a, table, g, 0, n_keys, kv_s, kv_s + TB);
    kvs_cp_async_commit();

    const int row0 = q0 + warp * 16 + lane / 4, row1 = row0 + 8;
    const int lim0 = past + row0, lim1 = past + row1;
    const int full_limit = past + q0; /* keys every row of the block sees */
    const float scale_log2 = a.scale * KVS_LOG2E;
    uint32_t qa[D / 16][4];
    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

    for (int i = 0; i < n_tiles; i++) {
        kvs_cp_async_wait<0>();
        __syncthreads(); /* tile i landed for every thread; tile i - 1 is no longer read */
        if (i == 0) {
            kvs_attn_load_q_frags<D>(qa, q_s + warp * 16 * RB, lane);
            __syncthreads(); /* Q is in stage 1, which the next load overwrites */
        }
        if (i + 1 < n_tiles) {
            uint32_t st = kv_s + ((i + 1) % L::STAGES) * 2 * TB;
            kvs_attn_issue_kv_tile<D, THREADS>(a, table, g, (i + 1) * KVS_ATTN_TILE, n_keys, st, st + TB);
        }
        kvs_cp_async_commit();
        const uint32_t k_w = kv_s + (i % L::STAGES) * 2 * TB, v_w = k_w + TB;
        const int key0 = i * KVS_ATTN_TILE;
        if (key0 + KVS_ATTN_TILE - 1 <= full_limit)
            kvs_attn_warp_tile<D, KVS_ATTN_TILE, false>(qa, k_w, v_w, key0, lim0, lim1, scale_log2, o, m0, m1, l0, l1,
                                                        lane);
        else
            kvs_attn_warp_tile<D, KVS_ATTN_TILE, true>(qa, k_w, v_w, key0, lim0, lim1, scale_log2, o, m0, m1, l0, l1,
                                                       lane);
    }

    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const int cq = 2 * (lane & 3);
    if (row0 < q_len) {
        size_t t = (size_t)t0 + row0;
        float inv = 1.f / l0;
        bf16 *orow = out + (t * a.n_heads + h) * D + cq;
#pragma unroll
        for (int n = 0; n < D / 8; n++) *(uint32_t *)(orow + 8 * n) = kvs_pack_bf16(o[n][0] * inv, o[n][1] * inv);
        if (lse && (lane & 3) == 0) lse[t * a.n_heads + h] = (m0 + __log2f(l0)) * KVS_LN2;
    }
    if (row1 < q_len) {
        size_t t = (size_t)t0 + row1;
        float inv = 1.f / l1;
        bf16 *orow = out + (t * a.n_heads + h) * D + cq;
#pragma unroll
        for (int n = 0; n < D / 8; n++) *(uint32_t *)(orow + 8 * n) = kvs_pack_bf16(o[n][2] * inv, o[n][3] * inv);
        if (lse && (lane & 3) == 0) lse[t * a.n_heads + h] = (m1 + __log2f(l1)) * KVS_LN2;
    }
}

/* Prefill with MT m-tiles a warp: WARPS x MT x 16 query rows a block, the Q tile
 * kept in shared memory beside two K/V stages (64-key tiles). */
template <int D, int WARPS, int MT, bool FP8 = false>
struct kvs_fa2mt_smem {
    static constexpr int M = 16 * MT * WARPS;
    static constexpr int STAGES = 2;
    /* FP8: one bf16 K/V tile (decoded from the raw stage in hand), then the
       codes' two stages (64 rows of D bytes each for K and for V) */
    static constexpr size_t RAW_STAGE = 2 * (size_t)KVS_ATTN_TILE * D;
    static constexpr size_t q = 0, kv = (size_t)M * kvs_rows<D>::BYTES,
                            raw = kv + (size_t)(FP8 ? 1 : STAGES) * 2 * kvs_rows<D>::TILE_BYTES,
                            bytes = raw + (FP8 ? STAGES * RAW_STAGE : 0);
};

/* Needs scale > 0 (kvs_attn_warp_tile_mt).
 * HEADS: query heads of one KV group a block (GQA pairing; the group size must be a
 * multiple): warps [k WARPS / HEADS, (k + 1) WARPS / HEADS) own the block's query
 * rows of head HEADS x blockIdx.x + k, so every K/V tile in shared memory feeds
 * HEADS heads while the block covers only M / HEADS query positions (the causal
 * diagonal's waste of M / HEADS-row tiles). WSKIP: a warp skips a tile whose keys
 * are all past its last row's causal limit (an exact no-op: p = 0, alpha = 1). */
template <int D, int WARPS, int MT, int HEADS = 1, bool WSKIP = false, bool FP8 = false>
__global__ void __launch_bounds__(WARPS * 32, WARPS == 4 ? 2 : 1)
    kvs_attn_fa2mt_kernel(kvs_attn_args a, bf16 *out, float *lse) {
    static_assert(HEADS >= 1 && WARPS % HEADS == 0, "whole warps per head");
    using L = kvs_fa2mt_smem<D, WARPS, MT, FP8>;
    constexpr int THREADS = WARPS * 32, M = L::M, RB = kvs_rows<D>::BYTES, TB = kvs_rows<D>::TILE_BYTES;
    constexpr int MH = M / HEADS, WPH = WARPS / HEADS; /* query rows and warps per head */
    extern __shared__ __align__(128) unsigned char smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int h0 = blockIdx.x * HEADS, g = h0 / (a.n_heads / a.n_kv_heads), seq = blockIdx.z;
    const int h = h0 + warp / WPH; /* this warp's head */
    const int q0 = (gridDim.y - 1 - blockIdx.y) * MH;
    const int t0 = a.q_start[seq], q_len = a.q_start[seq + 1] - t0, kv_len = a.kv_len[seq];
    if (q0 >= q_len) return;
    const int32_t *table = kvs_attn_table(a, seq);
    const int past = kv_len - q_len;
    const int last_row = min(q0 + MH, q_len) - 1;
    const int n_keys = past + last_row + 1, n_tiles = (n_keys + KVS_ATTN_TILE - 1) / KVS_ATTN_TILE;

    const uint32_t q_s = kvs_smem_u32(smem) + (uint32_t)L::q, kv_s = kvs_smem_u32(smem) + (uint32_t)L::kv;
    for (int p = threadIdx.x; p < M * (D / 8); p += THREADS) {
        int r = p / (D / 8), c = p % (D / 8), qr = q0 + r % MH; /* shared row r: head h0 + r / MH */
        bool ok = qr < q_len;
        const bf16 *src = ok ? a.q + ((size_t)(t0 + qr) * a.n_heads + h0 + r / MH) * D + c * 8 : a.q;
        kvs_cp_async16(q_s + r * RB + c * 16, src, ok);
    }
    /* tile 0 in flight, in one group with Q (n_tiles >= 1) */
    const uint32_t raw_s = kvs_smem_u32(smem) + (uint32_t)L::raw; /* FP8: the codes' stages */
    if (FP8) kvs_attn_issue_kv_tile8<D, THREADS>(a, table, g, 0, n_keys, raw_s, raw_s + KVS_ATTN_TILE * D);
    else kvs_attn_issue_kv_tile<D, THREADS>(a, table, g, 0, n_keys, kv_s, kv_s + TB);
    kvs_cp_async_commit();

    const int wrow = q0 + (warp % WPH) * 16 * MT + lane / 4; /* row g of the warp's first m-tile */
    const int lim_base = past + wrow;
    const int full_limit = past + q0;
    const int warp_limit = past + q0 + (warp % WPH + 1) * 16 * MT - 1; /* keys any row of the warp sees */
    const float scale_log2 = a.scale * KVS_LOG2E * (FP8 ? kvs_kv_scale(a.scales, 0, g, a.n_kv_heads) : 1.f);
    const uint32_t q_w = q_s + warp * 16 * MT * RB;
    float o[MT][D / 8][4], m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int n = 0; n < D / 8; n++) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
        m[mt][0] = m[mt][1] = -INFINITY;
        l[mt][0] = l[mt][1] = 0.f;
    }

    for (int i = 0; i < n_tiles; i++) {
        kvs_cp_async_wait<0>();
        __syncthreads(); /* tile i (and Q) landed; tile i - 1 is no longer read */
        if (i + 1 < n_tiles) { /* into the stage tile i - 1 used */
            if (FP8) {
                uint32_t st = raw_s + ((i + 1) % L::STAGES) * (uint32_t)L::RAW_STAGE;
                kvs_attn_issue_kv_tile8<D, THREADS>(a, table, g, (i + 1) * KVS_ATTN_TILE, n_keys, st,
                                                    st + KVS_ATTN_TILE * D);
            } else {
                uint32_t st = kv_s + ((i + 1) % L::STAGES) * 2 * TB;
                kvs_attn_issue_kv_tile<D, THREADS>(a, table, g, (i + 1) * KVS_ATTN_TILE, n_keys, st, st + TB);
            }
        }
        kvs_cp_async_commit();
        if (FP8) { /* tile i's codes -> the bf16 tile (tile i - 1's readers passed the barrier above) */
            kvs_attn_decode_rows8<D>(smem + L::raw + (i % L::STAGES) * L::RAW_STAGE, smem + L::kv, KVS_ATTN_TILE, TB,
                                     threadIdx.x, THREADS);
            __syncthreads();
        }
        const uint32_t k_w = FP8 ? kv_s : kv_s + (i % L::STAGES) * 2 * TB, v_w = k_w + TB;
        const int key0 = i * KVS_ATTN_TILE;
        if (WSKIP && key0 > warp_limit) continue; /* warp-uniform: every row masked */
        if (key0 + KVS_ATTN_TILE - 1 <= full_limit)
            kvs_attn_warp_tile_mt<D, KVS_ATTN_TILE, false, MT>(q_w, k_w, v_w, key0, lim_base, scale_log2, o, m, l,
                                                               lane);
        else
            kvs_attn_warp_tile_mt<D, KVS_ATTN_TILE, true, MT>(q_w, k_w, v_w, key0, lim_base, scale_log2, o, m, l,
                                                              lane);
    }

    const int cq = 2 * (lane & 3);
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            float lt = l[mt][hf];
            lt += __shfl_xor_sync(0xffffffffu, lt, 1);
            lt += __shfl_xor_sync(0xffffffffu, lt, 2);
            const int row = wrow + 16 * mt + 8 * hf;
            if (row < q_len) {
                size_t t = (size_t)t0 + row;
                float inv = (FP8 ? kvs_kv_scale(a.scales, 1, g, a.n_kv_heads) : 1.f) / lt;
                bf16 *orow = out + (t * a.n_heads + h) * D + cq;
#pragma unroll
                for (int n = 0; n < D / 8; n++)
                    *(uint32_t *)(orow + 8 * n) = kvs_pack_bf16(o[mt][n][2 * hf] * inv, o[mt][n][2 * hf + 1] * inv);
                if (lse && (lane & 3) == 0) lse[t * a.n_heads + h] = (m[mt][hf] + __log2f(lt)) * KVS_LN2;
            }
        }
    }
}

/* ---- decode on the tensor cores, per-warp pipelines (no block barrier in the key loop)
 * A block owns one token, one KV group and one split of its keys (the group's
 * query heads are the 16 rows of the mma A operand; rows past the group are
 * zero, so each K/V byte is read once for the whole group). Each of its 4 warps
 * streams its own 16-key sub-tiles (sub-tiles w, w + 4, w + 8, ... of the
 * split) through its own 3-stage cp.async ring, waiting only for its own
 * copies (wait_group + __syncwarp): a slow copy stalls one warp, not the block.
 * A sub-tile is 16 keys of one paged block (block_size % 16 == 0, split starts on
 * multiples of 64), so it costs one block-table entry; the entries of 32
 * sub-tiles at a time sit in the warp's lanes (one load, then __shfl_sync), off
 * the copy path. With one split (gridDim.z == 1) the block writes the final
 * output and LSE itself and no combine runs. FP8 pools: kvs_attn_decode8_kernel
 * below, the same structure on codes. */
#define KVS_DEC_WARPS 4
#define KVS_DEC_STAGES 3

template <int D>
struct kvs_decw_smem {
    static constexpr int STAGES = KVS_DEC_STAGES;
    static constexpr int SUB = 16 * kvs_rows<D>::BYTES; /* one 16-key K (or V) sub-tile */
    static constexpr size_t RING = (size_t)STAGES * 2 * SUB; /* a warp's ring of K + V sub-tiles */
    static constexpr size_t q = 0, kv = 16 * (size_t)kvs_rows<D>::BYTES, bytes = kv + (size_t)KVS_DEC_WARPS * RING;
    static_assert(KVS_DEC_WARPS * 16 * (D + 2) * 4 <= (size_t)KVS_DEC_WARPS * RING, "merge area");
};

/* A decode split that holds no keys (k0 >= k1: past its sequence's keys, a shorter
 * sequence or graph mode's capacity): with one split (kv_len 0, a padding slot)
 * zeros and lse -inf, else m = -inf for the combine to skip (part_o unread). */
__device__ __forceinline__ void kvs_attn_decode_empty(const kvs_attn_args &a, int group, int t, int h0, size_t base,
                                                      float *part_ml, bf16 *out, float *lse, int head_dim) {
    if (gridDim.z == 1) {
        for (int i = threadIdx.x; i < group * head_dim; i += blockDim.x)
            out[((size_t)t * a.n_heads + h0) * head_dim + i] = 0.f;
        for (int i = threadIdx.x; lse && i < group; i += blockDim.x) lse[(size_t)t * a.n_heads + h0 + i] = -INFINITY;
        return;
    }
    for (int i = threadIdx.x; i < group; i += blockDim.x) {
        part_ml[(base + i) * 2] = -INFINITY;
        part_ml[(base + i) * 2 + 1] = 0.f;
    }
}

/* What a block of both decode kernels works on (grid: tokens x KV groups x
 * splits): token t of sequence seq, the query heads h0 .. h0 + group - 1 of KV
 * group g, the keys [k0, k1) of split blockIdx.z that token sees; base: the
 * split's first partial row. empty(): no key (kvs_attn_decode_empty). Warp
 * `warp` takes the 16-key sub-tiles warp, warp + KVS_DEC_WARPS, ... of them,
 * n_mine(warp) in all. */
struct kvs_dec_block {
    int group, t, g, h0, seq, k0, k1;
    size_t base;
    __device__ __forceinline__ kvs_dec_block(const kvs_attn_args &a, int split_len) {
        group = a.n_heads / a.n_kv_heads;
        t = blockIdx.x, g = blockIdx.y, h0 = g * group;
        const int split = blockIdx.z;
        seq = kvs_attn_seq_of(a.q_start, a.n_seqs, t);
        const int q_len = a.q_start[seq + 1] - a.q_start[seq];
        const int n_keys = a.kv_len[seq] - q_len + (t - a.q_start[seq]) + 1;
        k0 = split * split_len, k1 = min(n_keys, k0 + split_len);
        base = ((size_t)split * a.n_tokens + t) * a.n_heads + h0;
    }
    __device__ __forceinline__ bool empty() const { return k0 >= k1; }
    __device__ __forceinline__ int n_mine(int warp) const {
        const int n_sub = (k1 - k0 + 15) / 16;
        return n_sub > warp ? (n_sub - warp + KVS_DEC_WARPS - 1) / KVS_DEC_WARPS : 0;
    }
    /* The first key of the warp's sub-tile i, and its paged block in table (the
       sequence's; warp-uniform i): lane j keeps the block of sub-tile 32 (i / 32) + j
       in lanes, read when i % 32 == 0. */
    __device__ __forceinline__ int key_of(int warp, int i) const { return k0 + (warp + KVS_DEC_WARPS * i) * 16; }
    __device__ __forceinline__ int block_of(const kvs_attn_args &a, const int32_t *table, int warp, int lane, int i,
                                            int &lanes) const {
        if ((i & 31) == 0) {
            const int key = key_of(warp, i + lane);
            lanes = key < k1 ? table[key / a.block_size] : 0;
        }
        return __shfl_sync(0xffffffffu, lanes, i & 31);
    }
};

/* The end of both decode kernels: the warps' rows in shared memory (warp w's query
 * row r at mw + (w ROWS + r)(D + 2): o[D], m in the log2 domain, l) merged into
 * the output and LSE (one split) or the split's partials (m in the natural-log
 * domain); o times v_scale. Call after a barrier that publishes mw. */
template <int D, int ROWS>
__device__ __forceinline__ void kvs_attn_decode_merge(const kvs_attn_args &a, const float *mw, int group, int t,
                                                      int h0, size_t base, float v_scale, float *part_o,
                                                      float *part_ml, bf16 *out, float *lse) {
    constexpr int OLD = D + 2;
    const bool direct = gridDim.z == 1; /* the only split: write the result itself */
    for (int idx = threadIdx.x; idx < group * D; idx += blockDim.x) {
        int r = idx / D, d = idx % D;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < KVS_DEC_WARPS; w++) M = fmaxf(M, mw[(w * ROWS + r) * OLD + D]);
        float acc = 0.f, Lsum = 0.f;
        if (M != -INFINITY) {
#pragma unroll
            for (int w = 0; w < KVS_DEC_WARPS; w++) {
                const float *row = mw + (w * ROWS + r) * OLD;
                float f = kvs_exp2(row[D] - M);
                acc += row[d] * f;
                Lsum += row[D + 1] * f;
            }
        }
        acc *= v_scale;
        if (direct) { /* M is finite: the split holds key k0 < k1 */
            size_t orow = (size_t)t * a.n_heads + h0 + r;
            out[orow * D + d] = __float2bfloat16(acc / Lsum);
            if (lse && d == 0) lse[orow] = (M + __log2f(Lsum)) * KVS_LN2;
        } else {
            part_o[(base + r) * D + d] = acc;
            if (d == 0) {
                part_ml[(base + r) * 2] = M == -INFINITY ? -INFINITY : M * KVS_LN2; /* natural-log domain */
                part_ml[(base + r) * 2 + 1] = Lsum;
            }
        }
    }
}

template <int D>
__global__ void __launch_bounds__(KVS_DEC_WARPS * 32)
    kvs_attn_decode_warp_kernel(kvs_attn_args a, float *part_o, float *part_ml, int split_len, bf16 *out, float *lse) {
    using L = kvs_decw_smem<D>;
    constexpr int STAGES = L::STAGES, THREADS = KVS_DEC_WARPS * 32, RB = kvs_rows<D>::BYTES, SUB = L::SUB, CH = D / 8;
    extern __shared__ __align__(128) unsigned char smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const kvs_dec_block db(a, split_len);
    if (db.empty()) {
        kvs_attn_decode_empty(a, db.group, db.t, db.h0, db.base, part_ml, out, lse, D);
        return;
    }
    const int group = db.group, t = db.t, g = db.g, h0 = db.h0, k1 = db.k1;
    const size_t base = db.base;
    const int32_t *table = kvs_attn_table(a, db.seq);
    const int n_mine = db.n_mine(warp);

    const uint32_t q_s = kvs_smem_u32(smem) + (uint32_t)L::q;
    const uint32_t ring = kvs_smem_u32(smem) + (uint32_t)L::kv + warp * (uint32_t)L::RING;
    for (int p = threadIdx.x; p < 16 * CH; p += THREADS) {
        int r = p / CH, c = p % CH;
        bool ok = r < group;
        const bf16 *src = ok ? a.q + ((size_t)t * a.n_heads + h0 + r) * D + c * 8 : a.q;
        kvs_cp_async16(q_s + r * RB + c * 16, src, ok);
    }
    kvs_cp_async_commit();

    const size_t v_delta = (size_t)a.n_kv_heads * a.block_size * D;
    int blk_lanes = 0; /* lane j: block of this warp's sub-tile 32 * chunk + j */
    /* issues this warp's sub-tile i into stage i % STAGES (warp-uniform i) */
    auto issue = [&](int i) {
        if (i >= n_mine) return;
        const int blk = db.block_of(a, table, warp, lane, i, blk_lanes), key0 = db.key_of(warp, i);
        const bf16 *kb = a.pool + kvs_kv_offset(blk, 0, g, key0 % a.block_size, a.n_kv_heads, a.block_size, D);
        const uint32_t st = ring + (i % STAGES) * 2 * SUB;
#pragma unroll
        for (int u = 0; u < CH / 2; u++) {
            int p = lane + 32 * u, r = p / CH, c = p % CH;
            bool ok = key0 + r < k1;
            const bf16 *src = ok ? kb + r * D + c * 8 : a.pool;
            uint32_t off = r * RB + c * 16;
            kvs_cp_async16(st + off, src, ok);
            kvs_cp_async16(st + SUB + off, ok ? src + v_delta : a.pool, ok);
        }
    };
#pragma unroll
    for (int i = 0; i < STAGES - 1; i++) {
        issue(i);
        kvs_cp_async_commit();
    }
    kvs_cp_async_wait<STAGES - 1>(); /* this thread's Q pieces */
    __syncthreads();                 /* everyone's */
    uint32_t qa[D / 16][4];
    kvs_attn_load_q_frags<D>(qa, q_s, lane);

    const float scale_log2 = a.scale * KVS_LOG2E;
    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
    const int lim = k1 - 1;
    for (int i = 0; i < n_mine; i++) {
        kvs_cp_async_wait<STAGES - 2>();
        __syncwarp(); /* sub-tile i landed for every lane; stage (i - 1) % STAGES is no longer read */
        issue(i + STAGES - 1);
        kvs_cp_async_commit();
        const uint32_t k_w = ring + (i % STAGES) * 2 * SUB, v_w = k_w + SUB;
        const int key_base = db.key_of(warp, i);
        if (key_base + 15 <= lim)
            kvs_attn_warp_tile<D, 16, false>(qa, k_w, v_w, key_base, lim, lim, scale_log2, o, m0, m1, l0, l1, lane);
        else
            kvs_attn_warp_tile<D, 16, true>(qa, k_w, v_w, key_base, lim, lim, scale_log2, o, m0, m1, l0, l1, lane);
    }
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);

    /* merge the warps through shared memory (reusing the rings) */
    kvs_cp_async_wait<0>();
    __syncthreads();
    constexpr int OLD = D + 2; /* floats per merge row: o[D], m, l */
    float *mw = (float *)(smem + L::kv);
    const int r0 = lane / 4, cq = 2 * (lane & 3);
    {
        float *w0 = mw + (warp * 16 + r0) * OLD, *w1 = w0 + 8 * OLD;
#pragma unroll
        for (int n = 0; n < D / 8; n++) {
            *(float2 *)(w0 + 8 * n + cq) = make_float2(o[n][0], o[n][1]);
            *(float2 *)(w1 + 8 * n + cq) = make_float2(o[n][2], o[n][3]);
        }
        if ((lane & 3) == 0) {
            w0[D] = m0, w0[D + 1] = l0;
            w1[D] = m1, w1[D + 1] = l1;
        }
    }
    __syncthreads();
    kvs_attn_decode_merge<D, 16>(a, mw, group, t, h0, base, 1.f, part_o, part_ml, out, lse);
}

/* ---- FP8 decode: the codes straight into the mma fragments
 * The structure of kvs_attn_decode_warp_kernel (a block a token x KV group x split,
 * 4 warps each streaming its 16-key sub-tiles through its own cp.async ring of
 * KVS_DEC8_STAGES), with the mma operands swapped: the sub-tile's 16 keys are the
 * rows of A and the group's query heads the 8 columns of B (NQ n-tiles of 8
 * heads: 2 for groups of 9-16), S^T = K Q^T then O^T += V^T P^T, 16 mma's a
 * sub-tile for groups up to 8 (32 with the heads as A rows). Lane (gq = lane / 4,
 * q4 = lane % 4) holds:
 *  - K: keys gq and gq + 8 (rows gq, gq + 8 of A), D / 4 codes of each; its word
 *    w (codes kvs_dec8_kdim(q4, w) .. + 3: D / 4 contiguous bytes in whole pieces
 *    of up to 16) is k-step w, the first pair its columns 2 q4, 2 q4 + 1, the second
 *    2 q4 + 8, + 9. Q's B fragments take their dims in the same order (a dot
 *    product does not see the order), so one cvt.rn.f16x2.e4m3x2 a pair makes A.
 *  - V: keys 2 q4, 2 q4 + 1, 2 q4 + 8, 2 q4 + 9 (the k rows of its A fragments)
 *    at dims gq D / 8 .. + D / 8 - 1: code 2 mt is row gq of m-tile mt, code 2 mt + 1
 *    row gq + 8, so the output's dims are permuted (undone when the warp writes its
 *    rows to shared memory); a prmt pairs two keys' codes, one cvt makes the pair.
 *  - P: S^T's accumulators (rows keys, columns queries) packed as f16 and moved
 *    to the B layout of V^T P^T by movmatrix.trans (two a sub-tile and n-tile).
 * Each lane copies exactly the bytes it reads back, so a stage is ready for a
 * lane after its own wait_group (no __syncwarp) and is laid out piece-major (the
 * 32 lanes' piece c side by side: copies and loads without bank conflicts); no
 * pass through shared memory converts anything: per 4 KB sub-tile (D = 128) the
 * shared memory moves 8 KB. Math as the f16 path it replaces: Q in f16 times
 * scale x log2 e (|q| up to ~5e5), K and V codes exact in f16, f32 accumulators,
 * the K scale on each score, P packed as f16, the V scale on the output. */
#define KVS_DEC8_STAGES 4

template <int D, int NQ>
struct kvs_dec8 {
    static constexpr int KB = D / 4 < 16 ? D / 4 : 16; /* bytes of a K piece (a lane's run of one key) */
    static constexpr int KP = D / 4 / KB;              /* K pieces a key a lane */
    static constexpr int VB = D / 8;                   /* bytes of a V piece (a lane's run of one key) */
    static constexpr int KW = D / 16, VW = VB / 4;     /* 4-code words of a key a lane, K and V */
    static constexpr int STAGE = 32 * D;               /* a sub-tile: 16 keys x D codes of K, then of V */
    static constexpr int K_PART = 2 * KP * 32 * KB;    /* its K pieces: [2 KP][32 lanes][KB]; V: [4][32][VB] */
    static constexpr size_t WARP = (size_t)KVS_DEC8_STAGES * STAGE, bytes = KVS_DEC_WARPS * WARP;
    static constexpr int ROWS = 8 * NQ; /* query rows a warp merges */
    static_assert(K_PART == 16 * D && VB <= 16, "K is half a stage; V pieces of at most 16 bytes");
    static_assert(KVS_DEC_WARPS * ROWS * (D + 2) * 4 <= bytes, "merge area");
};

/* First dim of K word w of lane q4 (Q's B fragments in the same order) */
template <int D>
__device__ __forceinline__ int kvs_dec8_kdim(int q4, int w) {
    constexpr int KB = kvs_dec8<D, 1>::KB, WP = KB / 4; /* words a piece */
    return (w / WP) * 4 * KB + q4 * KB + 4 * (w % WP);
}

/* N bytes (4, 8 or 16) of shared memory as N / 4 words */
template <int N>
__device__ __forceinline__ void kvs_lds_words(uint32_t *w, const unsigned char *p) {
    if (N == 16) {
        uint4 v = *(const uint4 *)p;
        w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else if (N == 8) {
        uint2 v = *(const uint2 *)p;
        w[0] = v.x, w[1] = v.y;
    } else {
        w[0] = *(const uint32_t *)p;
    }
}

template <int D, int NQ>
__global__ void __launch_bounds__(KVS_DEC_WARPS * 32)
    kvs_attn_decode8_kernel(kvs_attn_args a, float *part_o, float *part_ml, int split_len, bf16 *out, float *lse) {
    using L = kvs_dec8<D, NQ>;
    constexpr int STAGES = KVS_DEC8_STAGES, KB = L::KB, KP = L::KP, VB = L::VB, KW = L::KW, VW = L::VW, MT = D / 16;
    extern __shared__ __align__(128) unsigned char smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gq = lane / 4, q4 = lane % 4;
    const kvs_dec_block db(a, split_len);
    if (db.empty()) {
        kvs_attn_decode_empty(a, db.group, db.t, db.h0, db.base, part_ml, out, lse, D);
        return;
    }
    const int group = db.group, t = db.t, g = db.g, h0 = db.h0, k1 = db.k1;
    const size_t base = db.base;
    const int32_t *table = kvs_attn_table(a, db.seq);
    const int n_mine = db.n_mine(warp);

    const uint8_t *pool = kvs_attn_pool8(a);
    const size_t v_delta = (size_t)a.n_kv_heads * a.block_size * D;
    unsigned char *ring_p = smem + warp * L::WARP;
    const uint32_t ring = kvs_smem_u32(ring_p);
    int blk_lanes = 0; /* lane j: block of this warp's sub-tile 32 * chunk + j */
    /* issues this lane's pieces of the warp's sub-tile i into stage i % STAGES (warp-uniform i) */
    auto issue = [&](int i) {
        if (i >= n_mine) return;
        const int blk = db.block_of(a, table, warp, lane, i, blk_lanes), key0 = db.key_of(warp, i);
        const uint8_t *kb = pool + kvs_kv_offset(blk, 0, g, key0 % a.block_size, a.n_kv_heads, a.block_size, D);
        const uint32_t st = ring + (i % STAGES) * L::STAGE;
#pragma unroll
        for (int h = 0; h < 2; h++) { /* K: keys gq, gq + 8 */
            const int r = gq + 8 * h;
            const bool ok = key0 + r < k1;
#pragma unroll
            for (int p = 0; p < KP; p++)
                kvs_cp_async_n<KB>(st + ((h * KP + p) * 32 + lane) * KB,
                                   ok ? kb + r * D + kvs_dec8_kdim<D>(q4, p * (KB / 4)) : pool, ok);
        }
#pragma unroll
        for (int u = 0; u < 4; u++) { /* V: keys 2 q4 + {0, 1, 8, 9} */
            const int r = 2 * q4 + (u & 1) + 8 * (u >> 1);
            const bool ok = key0 + r < k1;
            kvs_cp_async_n<VB>(st + L::K_PART + (u * 32 + lane) * VB, ok ? kb + v_delta + r * D + gq * VB : pool, ok);
        }
    };
#pragma unroll
    for (int i = 0; i < STAGES - 1; i++) {
        issue(i);
        kvs_cp_async_commit();
    }

    /* Q's B fragments: head 8 nq + gq (zero past the group), f16 x scale log2 e */
    uint32_t qb[NQ][KW][2];
    const float qs = a.scale * KVS_LOG2E;
#pragma unroll
    for (int nq = 0; nq < NQ; nq++) {
        const int r = 8 * nq + gq;
        const bf16 *qrow = a.q + ((size_t)t * a.n_heads + h0 + min(r, group - 1)) * D;
#pragma unroll
        for (int w = 0; w < KW; w++) {
            uint2 raw = *(const uint2 *)(qrow + kvs_dec8_kdim<D>(q4, w));
            const __nv_bfloat162 *b2 = (const __nv_bfloat162 *)&raw;
#pragma unroll
            for (int j = 0; j < 2; j++) {
                float2 f = __bfloat1622float2(b2[j]);
                qb[nq][w][j] = r < group ? kvs_pack_f16(f.x * qs, f.y * qs) : 0u;
            }
        }
    }

    const float k_scale = kvs_kv_scale(a.scales, 0, g, a.n_kv_heads);
    float o[NQ][MT][4], m[NQ][2], l[NQ][2]; /* O^T; m, l of heads 8 nq + 2 q4 + {0, 1} */
#pragma unroll
    for (int nq = 0; nq < NQ; nq++) {
#pragma unroll
        for (int mt = 0; mt < MT; mt++) o[nq][mt][0] = o[nq][mt][1] = o[nq][mt][2] = o[nq][mt][3] = 0.f;
        m[nq][0] = m[nq][1] = -INFINITY;
        l[nq][0] = l[nq][1] = 0.f;
    }
    const int lim = k1 - 1;
    for (int i = 0; i < n_mine; i++) {
        kvs_cp_async_wait<STAGES - 2>(); /* this lane's pieces of sub-tile i landed */
        issue(i + STAGES - 1);           /* into the stage sub-tile i - 1 used (this lane read it) */
        kvs_cp_async_commit();
        const unsigned char *st = ring_p + (i % STAGES) * L::STAGE;
        const int key_base = db.key_of(warp, i);

        /* S^T = K Q^T */
        uint32_t kw[2][KW];
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int p = 0; p < KP; p++) kvs_lds_words<KB>(&kw[h][p * (KB / 4)], st + ((h * KP + p) * 32 + lane) * KB);
        float s[NQ][4];
#pragma unroll
        for (int nq = 0; nq < NQ; nq++) s[nq][0] = s[nq][1] = s[nq][2] = s[nq][3] = 0.f;
#pragma unroll
        for (int w = 0; w < KW; w++) {
            const uint32_t ka[4] = {kvs_e4m3x2_to_f16x2(kw[0][w], 0), kvs_e4m3x2_to_f16x2(kw[1][w], 0),
                                    kvs_e4m3x2_to_f16x2(kw[0][w], 1), kvs_e4m3x2_to_f16x2(kw[1][w], 1)};
#pragma unroll
            for (int nq = 0; nq < NQ; nq++) kvs_mma_f16(s[nq], ka, qb[nq][w][0], qb[nq][w][1]);
        }

        /* online softmax in the log2 domain: s[nq][c] is key key_base + gq + 8 (c / 2), head 8 nq + 2 q4 + c % 2 */
        const bool tail = key_base + 15 > lim;
        uint32_t pb[NQ][2];
        float alpha[NQ][2];
        bool grew = false;
#pragma unroll
        for (int nq = 0; nq < NQ; nq++) {
            float x[4];
#pragma unroll
            for (int c = 0; c < 4; c++) {
                x[c] = s[nq][c] * k_scale;
                if (tail && key_base + gq + 8 * (c >> 1) > lim) x[c] = -INFINITY;
            }
            float mx0 = fmaxf(x[0], x[2]), mx1 = fmaxf(x[1], x[3]);
#pragma unroll
            for (int k = 4; k < 32; k <<= 1) {
                mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, k));
                mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, k));
            }
            const float mn0 = fmaxf(m[nq][0], mx0), mn1 = fmaxf(m[nq][1], mx1);
            const float mu0 = mn0 == -INFINITY ? 0.f : mn0, mu1 = mn1 == -INFINITY ? 0.f : mn1;
            alpha[nq][0] = kvs_exp2(m[nq][0] - mu0), alpha[nq][1] = kvs_exp2(m[nq][1] - mu1);
            grew |= mn0 != m[nq][0] || mn1 != m[nq][1];
            m[nq][0] = mn0, m[nq][1] = mn1;
            const float p0 = kvs_exp2(x[0] - mu0), p1 = kvs_exp2(x[1] - mu1);
            const float p2 = kvs_exp2(x[2] - mu0), p3 = kvs_exp2(x[3] - mu1);
            l[nq][0] = l[nq][0] * alpha[nq][0] + (p0 + p2);
            l[nq][1] = l[nq][1] * alpha[nq][1] + (p1 + p3);
            pb[nq][0] = kvs_movmatrix_trans(kvs_pack_f16(p0, p1)); /* keys 2 q4, + 1 of head gq */
            pb[nq][1] = kvs_movmatrix_trans(kvs_pack_f16(p2, p3)); /* keys 2 q4 + 8, + 9 */
        }
        if (__any_sync(0xffffffffu, grew)) { /* else every alpha is 1 */
#pragma unroll
            for (int nq = 0; nq < NQ; nq++)
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    o[nq][mt][0] *= alpha[nq][0], o[nq][mt][1] *= alpha[nq][1];
                    o[nq][mt][2] *= alpha[nq][0], o[nq][mt][3] *= alpha[nq][1];
                }
        }

        /* O^T += V^T P^T: word w of each key holds codes 4w .. 4w + 3 of the lane's dims, m-tiles 2w and 2w + 1 */
        uint32_t vw[4][VW];
#pragma unroll
        for (int u = 0; u < 4; u++) kvs_lds_words<VB>(vw[u], st + L::K_PART + (u * 32 + lane) * VB);
#pragma unroll
        for (int w = 0; w < VW; w++) {
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                const uint32_t sel = hf ? 0x7362u : 0x5140u; /* codes 2 hf, 2 hf + 1 of two keys, interleaved */
                const uint32_t x01 = __byte_perm(vw[0][w], vw[1][w], sel), x89 = __byte_perm(vw[2][w], vw[3][w], sel);
                const uint32_t va[4] = {kvs_e4m3x2_to_f16x2(x01, 0), kvs_e4m3x2_to_f16x2(x01, 1),
                                        kvs_e4m3x2_to_f16x2(x89, 0), kvs_e4m3x2_to_f16x2(x89, 1)};
#pragma unroll
                for (int nq = 0; nq < NQ; nq++) kvs_mma_f16(o[nq][2 * w + hf], va, pb[nq][0], pb[nq][1]);
            }
        }
    }
#pragma unroll
    for (int nq = 0; nq < NQ; nq++)
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int k = 4; k < 32; k <<= 1) l[nq][j] += __shfl_xor_sync(0xffffffffu, l[nq][j], k);

    /* the warps' rows, dims in order, into shared memory (reusing the rings), then merged */
    kvs_cp_async_wait<0>();
    __syncthreads();
    constexpr int OLD = D + 2;
    float *mw = (float *)smem;
#pragma unroll
    for (int nq = 0; nq < NQ; nq++) {
#pragma unroll
        for (int j = 0; j < 2; j++) { /* head 8 nq + 2 q4 + j: dims gq D / 8 + 2 mt (c j) and + 1 (c j + 2) */
            float *row = mw + (warp * L::ROWS + 8 * nq + 2 * q4 + j) * OLD;
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
                *(float2 *)(row + gq * (D / 8) + 2 * mt) = make_float2(o[nq][mt][j], o[nq][mt][j + 2]);
            if (gq == 0) row[D] = m[nq][j], row[D + 1] = l[nq][j];
        }
    }
    __syncthreads();
    kvs_attn_decode_merge<D, L::ROWS>(a, mw, group, t, h0, base, kvs_kv_scale(a.scales, 1, g, a.n_kv_heads), part_o,
                                      part_ml, out, lse);
}

/* ---- dispatch ------------------------------------------------------------------ */

template <int D, int WARPS>
static void launch_fa2(kvs_backend *b, const kvs_attn_args &a, bf16 *out, float *lse, int max_q_len) {
    using L = kvs_fa2_smem<D, WARPS>;
    int tiles = (max_q_len + L::M - 1) / L::M;
    KVS_CUDA_CHECK(b, cudaFuncSetAttribute(kvs_attn_fa2_kernel<D, WARPS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)L::bytes));
    dim3 grid((unsigned)a.n_heads, (unsigned)tiles, (unsigned)a.n_seqs);
    kvs_attn_fa2_kernel<D, WARPS><<<grid, WARPS * 32, L::bytes, kvs_cuda_of(b)->stream>>>(a, out, lse);
    KVS_CUDA_LAUNCHED(b, "kvs_attn_fa2_kernel");
}

template <int D, int WARPS, int MT, int HEADS = 1, bool WSKIP = false, bool FP8 = false>
static void launch_fa2mt(kvs_backend *b, const kvs_attn_args &a, bf16 *out, float *lse, int max_q_len) {
    using L = kvs_fa2mt_smem<D, WARPS, MT, FP8>;
    auto kernel = kvs_attn_fa2mt_kernel<D, WARPS, MT, HEADS, WSKIP, FP8>;
    constexpr int MH = L::M / HEADS;
    int tiles = (max_q_len + MH - 1) / MH;
    KVS_CUDA_CHECK(b, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)L::bytes));
    dim3 grid((unsigned)(a.n_heads / HEADS), (unsigned)tiles, (unsigned)a.n_seqs);
    kernel<<<grid, WARPS * 32, L::bytes, kvs_cuda_of(b)->stream>>>(a, out, lse);
    KVS_CUDA_LAUNCHED(b, "kvs_attn_fa2mt_kernel");
}

/* Dynamic shared memory of prefill kernel k at head_dim D, in bytes (0: AUTO or
 * an unknown value). At D = 128 (rows of 272 bytes, 64-key K/V tiles of 17,408
 * bytes): GQA and HEAD 136 KiB (139,264: 256 Q rows + two K/V stages), SMALL
 * 68 KiB (69,632: two K/V stages, Q inside them). Opt-in limits per block:
 * sm_80 163 KiB, sm_86/sm_89 99 KiB, sm_90 227 KiB; so at D = 128 an RTX 4090
 * runs only SMALL, an A100 everything. At D = 64 (144-byte rows) GQA needs
 * 72 KiB: it fits sm_89. */
template <int D>
static size_t kvs_prefill_smem_bytes(int k, bool fp8) {
    switch (k) {
    case KVS_CUDA_PREFILL_GQA: case KVS_CUDA_PREFILL_HEAD: return kvs_fa2mt_smem<D, 8, 2>::bytes;
    case KVS_CUDA_PREFILL_SMALL: return kvs_fa2_smem<D, 4>::bytes;
    case KVS_CUDA_PREFILL_WGMMA: return kvs_cuda_wgmma_smem_bytes(D, fp8); /* cuda_attention_hopper.cu */
    default: return 0;
    }
}

/* cudaDevAttrMaxSharedMemoryPerBlockOptin of a device, queried once per device
 * (a benign race between threads: they store the same value). */
static int kvs_attn_smem_optin(kvs_cuda *c) {
    static int cache[64];
    int dev = c->device, v = dev >= 0 && dev < 64 ? cache[dev] : 0;
    if (v > 0) return v;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess || v <= 0) {
        cudaGetLastError();
        v = 48 * 1024; /* the limit without opt-in */
    }
    if (dev >= 0 && dev < 64) cache[dev] = v;
    return v;
}

/* The kernel to run: the backend's option (kvs_cuda_options.prefill) when it is
 * set, is known, takes this call (WGMMA: kvs_cuda_wgmma_fits) and fits this
 * device's shared memory; otherwise GQA (the fastest measured on the H200,
 * docs/CUDA.md) where it fits, else SMALL. GQA, HEAD and WGMMA take the row
 * max over unscaled scores, so they need scale > 0: SMALL otherwise. */
template <int D>
static int kvs_prefill_pick(kvs_cuda *c, const kvs_attn_args &a, bool fp8) {
    const float scale = a.scale;
    const size_t optin = (size_t)kvs_attn_smem_optin(c);
    int k = c->prefill;
    /* AUTO on Hopper: WGMMA, bf16 and FP8 pools (FP8: its producer converting the codes
       measured 1.7-1.8x the FA2-style FP8 kernel, docs/CUDA.md "FP8 pools", row 54) */
    if (k == KVS_CUDA_PREFILL_AUTO && c->wgmma_auto) k = KVS_CUDA_PREFILL_WGMMA;
    if (k == KVS_CUDA_PREFILL_WGMMA && !kvs_cuda_wgmma_fits(D, a.block_size, scale)) k = KVS_CUDA_PREFILL_AUTO;
    size_t need = kvs_prefill_smem_bytes<D>(k, fp8);
    if (need == 0 || need > optin)
        k = kvs_prefill_smem_bytes<D>(KVS_CUDA_PREFILL_GQA, fp8) <= optin ? KVS_CUDA_PREFILL_GQA
                                                                         : KVS_CUDA_PREFILL_SMALL;
    return scale > 0.f ? k : KVS_CUDA_PREFILL_SMALL;
}

template <int D>
static void launch_split(kvs_backend *b, const kvs_attn_args &a, bf16 *out, float *lse, int max_kv_len, bool fp8);

template <int D>
static void launch_prefill(kvs_backend *b, const kvs_attn_args &a, bf16 *out, float *lse, int max_q_len,
                           int max_kv_len, bool fp8) {
    const int k = kvs_prefill_pick<D>(kvs_cuda_of(b), a, fp8);
    const int group = a.n_heads / a.n_kv_heads;
    /* the kernel that runs (GQA takes groups of a multiple of 4 only) */
    kvs_cuda_of(b)->last_prefill = k == KVS_CUDA_PREFILL_GQA && group % 4 ? KVS_CUDA_PREFILL_HEAD : k;
    if (k == KVS_CUDA_PREFILL_WGMMA) { /* head_dim 64/128, bf16 or FP8 (kvs_prefill_pick) */
        kvs_cuda_prefill_wgmma(b, a, out, lse, D, max_q_len, fp8);
        return;
    }
    if (fp8) { /* GQA / HEAD decode FP8 tiles in shared memory; SMALL has no FP8 form: the decode kernels, a token a block */
        if (k == KVS_CUDA_PREFILL_SMALL) launch_split<D>(b, a, out, lse, max_kv_len, true);
        else if (k == KVS_CUDA_PREFILL_GQA && group % 4 == 0) launch_fa2mt<D, 8, 2, 4, true, true>(b, a, out, lse, max_q_len);
        else launch_fa2mt<D, 8, 2, 1, false, true>(b, a, out, lse, max_q_len);
        return;
    }
    if (k == KVS_CUDA_PREFILL_SMALL) launch_fa2<D, 4>(b, a, out, lse, max_q_len);
    else if (k == KVS_CUDA_PREFILL_GQA && group % 4 == 0) launch_fa2mt<D, 8, 2, 4, true>(b, a, out, lse, max_q_len);
    else launch_fa2mt<D, 8, 2>(b, a, out, lse, max_q_len); /* HEAD, and GQA for groups not a multiple of 4 */
}

/* Splits of whole 64-key tiles so that about 8 blocks per SM run in all (the
 * scalar fallback's split policy). */
#define KVS_ATTN_SPLIT_BLOCKS_PER_SM 8
static int kvs_attn_split_len(const kvs_cuda *c, const kvs_attn_args &a, int max_kv_len, int *n_splits_out) {
    long base_blocks = (long)a.n_tokens * a.n_kv_heads;
    int max_tiles = (max_kv_len + KVS_ATTN_TILE - 1) / KVS_ATTN_TILE;
    if (max_tiles < 1) max_tiles = 1;
    long target = (long)KVS_ATTN_SPLIT_BLOCKS_PER_SM * c->n_sms;
    int n_splits = (int)((target + base_blocks - 1) / base_blocks);
    if (n_splits > max_tiles) n_splits = max_tiles;
    if (n_splits < 1) n_splits = 1;
    int split_len = (max_tiles + n_splits - 1) / n_splits * KVS_ATTN_TILE;
    n_splits = (max_kv_len + split_len - 1) / split_len;
    *n_splits_out = n_splits < 1 ? 1 : n_splits;
    return split_len;
}

/* Wave-aware split count: resident blocks fill `slots` places, so a launch of B
 * blocks takes ceil(B / slots) waves, each as long as one split (its tiles plus
 * about two tiles of fill, drain and combine). Picks the count with the least
 * predicted time (the smallest on ties); splits are whole 64-key tiles. */
static int kvs_attn_split_waves(const kvs_attn_args &a, int max_kv_len, long slots, int *n_splits_out) {
    long base_blocks = (long)a.n_tokens * a.n_kv_heads;
    int max_tiles = (max_kv_len + KVS_ATTN_TILE - 1) / KVS_ATTN_TILE;
    if (max_tiles < 1) max_tiles = 1;
    if (slots < 1) slots = 1;
    int best = 1;
    double best_cost = 0;
    for (int s = 1; s <= max_tiles; s++) {
        int per = (max_tiles + s - 1) / s;
        if (s > 1 && (max_tiles + per - 1) / per < s) continue; /* same split length as a smaller s */
        double waves = (double)((base_blocks * s + slots - 1) / slots);
        double cost = waves * (per + 2.0);
        if (s == 1 || cost < best_cost) best = s, best_cost = cost;
    }
    int split_len = (max_tiles + best - 1) / best * KVS_ATTN_TILE;
    int n_splits = (max_kv_len + split_len - 1) / split_len;
    *n_splits_out = n_splits < 1 ? 1 : n_splits;
    return split_len;
}

/* Resident blocks per SM of a kernel (cached; a host query, no stream work). */
template <typename K>
static int kvs_attn_blocks_per_sm(K kernel, int threads, size_t smem, int *cache) {
    if (*cache <= 0) {
        int n = 0;
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess || n < 1) {
            cudaGetLastError();
            n = 1;
        }
        *cache = n;
    }
    return *cache;
}

/* The per-warp decode kernels (head_dim 32/64/128, group <= 16, block_size a
 * multiple of 16; FP8: kvs_attn_decode8_kernel with NQ 8-head n-tiles) with their
 * wave-aware split policy. */
template <int D, bool FP8, int NQ = 1>
static void launch_decode_warp(kvs_backend *b, const kvs_attn_args &a, bf16 *out, float *lse, int max_kv_len) {
    kvs_cuda *c = kvs_cuda_of(b);
    const size_t smem = FP8 ? kvs_dec8<D, NQ>::bytes : kvs_decw_smem<D>::bytes;
    auto kernel = FP8 ? kvs_attn_decode8_kernel<D, NQ> : kvs_attn_decode_warp_kernel<D>;
    KVS_CUDA_CHECK(b, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    static int per_sm = 0;
    int n_splits, split_len = kvs_attn_split_waves(
        a, max_kv_len, (long)kvs_attn_blocks_per_sm(kernel, KVS_DEC_WARPS * 32, smem, &per_sm) * c->n_sms, &n_splits);
    size_t rows = (size_t)a.n_tokens * a.n_heads;
    float *part_o = NULL, *part_ml = NULL;
    if (n_splits > 1) {
        size_t o_bytes = (size_t)n_splits * rows * D * sizeof(float), ml_bytes = (size_t)n_splits * rows * 2 * sizeof(float);
        char *scratch = (char *)kvs_cuda_scratch(b, o_bytes + ml_bytes);
        if (!scratch) return;
        part_o = (float *)scratch, part_ml = (float *)(scratch + o_bytes);
    }
    dim3 grid((unsigned)a.n_tokens, (unsigned)a.n_kv_heads, (unsigned)n_splits);
    kernel<<<grid, KVS_DEC_WARPS * 32, smem, c->stream>>>(a, part_o, part_ml, split_len, out, lse);
    KVS_CUDA_LAUNCHED(b, FP8 ? "kvs_attn_decode8_kernel" : "kvs_attn_decode_warp_kernel");
    if (n_splits > 1) {
        kvs_attn_combine_kernel<<<(unsigned)rows, D < 128 ? D : 128, 0, c->stream>>>(out, lse, part_o, part_ml,
                                                                                      n_splits, (int)rows, D);
        KVS_CUDA_LAUNCHED(b, "kvs_attn_combine_kernel");
    }
}

/* CUDA graphs (src/model/graphs.c, padded decode steps): the graph of a bucket
 * is captured once and replayed while its sequences grow and get compacted, so
 * max_kv_len here is the bucket's capacity (stride x block_size), not the
 * batch's longest sequence, and the split count below depends only on the
 * bucket. Requirements on the kernels (keep them in any rewrite):
 *  - a split whose first key is at or past its sequence's n_keys exits at once
 *    (writes m = -inf, l = 0, o = 0), so the cost of a short (sparse) layer
 *    does not grow with the bucket's capacity beyond one tiny block per split;
 *  - the combine ignores splits with m = -inf;
 *  - padding rows have kv_len 0 (n_keys 0: every split empty); their output is
 *    never read (today the combine writes 0/0 = NaN there and lse -inf; rows
 *    are independent, so that NaN stays in its row), but 0 would be cleaner;
 *  - the scratch below is only taken, never grown, inside a capture (a bucket
 *    runs eagerly once first; kvs_cuda_scratch fails the capture otherwise). */
/* The scalar split kernel; max_kv_len: the most keys a token attends to. */
template <int D>
static void launch_split_scalar(kvs_backend *b, const kvs_attn_args &a, bf16 *out, float *lse, int max_kv_len,
                                bool fp8) {
    kvs_cuda *c = kvs_cuda_of(b);
    int group = a.n_heads / a.n_kv_heads;
    int n_splits, split_len = kvs_attn_split_len(c, a, max_kv_len, &n_splits);
    size_t rows = (size_t)a.n_tokens * a.n_heads;
    size_t o_bytes = (size_t)n_splits * rows * D * sizeof(float), ml_bytes = (size_t)n_splits * rows * 2 * sizeof(float);
    char *scratch = (char *)kvs_cuda_scratch(b, o_bytes + ml_bytes);
    if (!scratch) return;
    float *part_o = (float *)scratch, *part_ml = (float *)(scratch + o_bytes);
    dim3 grid((unsigned)a.n_tokens, (unsigned)a.n_kv_heads, (unsigned)n_splits);
    size_t smem = kvs_split_smem_bytes<D>(group);
    auto kernel = fp8 ? kvs_attn_split_kernel<D, true> : kvs_attn_split_kernel<D, false>;
    if (smem > 48 * 1024)
        KVS_CUDA_CHECK(b, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    kernel<<<grid, KVS_ATTN_THREADS, smem, c->stream>>>(a, part_o, part_ml, split_len);
    KVS_CUDA_LAUNCHED(b, "kvs_attn_split_kernel");
    kvs_attn_combine_kernel<<<(unsigned)rows, D < 128 ? D : 128, 0, c->stream>>>(out, lse, part_o, part_ml, n_splits,
                                                                                  (int)rows, D);
    KVS_CUDA_LAUNCHED(b, "kvs_attn_combine_kernel");
}

template <int D>
static void launch_split(kvs_backend *b, const kvs_attn_args &a, bf16 *out, float *lse, int max_kv_len, bool fp8) {
    int group = a.n_heads / a.n_kv_heads;
    /* the per-warp kernels take 16-key sub-tiles of one paged block each */
    if ((D == 32 || D == 64 || D == 128) && group <= 16 && a.block_size % 16 == 0) {
        constexpr int DT = D == 32 || D == 64 ? D : 128; /* only instantiated for 32/64/128 */
        if (fp8 && group <= 8) launch_decode_warp<DT, true, 1>(b, a, out, lse, max_kv_len);
        else if (fp8) launch_decode_warp<DT, true, 2>(b, a, out, lse, max_kv_len);
        else launch_decode_warp<DT, false>(b, a, out, lse, max_kv_len);
        return;
    }
    launch_split_scalar<D>(b, a, out, lse, max_kv_len, fp8);
}

/* A sliding-window layer: every token (prefill or decode) through the split
 * kernel, its splits over the window's keys alone. */
template <int D>
static void launch_window(kvs_backend *b, const kvs_attn_args &a, bf16 *out, float *lse, int max_kv_len, bool fp8) {
    launch_split_scalar<D>(b, a, out, lse, max_kv_len < a.window ? max_kv_len : a.window, fp8);
}

/* A batch with prefill chunks: its leading decodes (ab->n_decode sequences of
 * one query) through the decode kernel, split over the keys, and the chunks
 * through the prefill kernel. In the prefill kernel a decode would be a tile of
 * one live row, a block per (sequence, head group) walking all its keys. The
 * two launches write disjoint rows of out and lse: the prefill kernels take
 * their rows from q_start (absolute), so the chunks' part starts at q_start + nd. */
template <int D>
static void launch_mixed(kvs_backend *b, const kvs_attn_args &a, bf16 *out, float *lse, const kvs_attn_batch *ab,
                         bool fp8) {
    int nd = ab->n_decode > 0 && ab->n_decode < a.n_seqs ? ab->n_decode : 0;
    if (fp8 && kvs_prefill_pick<D>(kvs_cuda_of(b), a, fp8) == KVS_CUDA_PREFILL_SMALL)
        nd = 0; /* that prefill is the decode kernel already, a token a block (its rows index from 0) */
    if (nd > 0) {
        kvs_attn_args dec = a;
        dec.n_seqs = nd, dec.n_tokens = nd;
        launch_split<D>(b, dec, out, lse, ab->max_kv_len, fp8);
    }
    kvs_attn_args pre = a;
    pre.q_start = a.q_start + nd, pre.kv_len = a.kv_len + nd;
    pre.table_rows = a.table_rows ? a.table_rows + nd : NULL;
    pre.block_tables = a.table_rows ? a.block_tables : a.block_tables + (size_t)nd * a.max_blocks;
    pre.n_seqs = a.n_seqs - nd, pre.n_tokens = a.n_tokens - nd;
    launch_prefill<D>(b, pre, out, lse, ab->max_q_len, ab->max_kv_len, fp8);
}

void kvs_cuda_attention(kvs_backend *b, void *out, float *lse, const void *q, const kvs_kv_pool *pool,
                        const kvs_attn_batch *ab, int n_heads, float scale) {
    if (ab->n_tokens <= 0 || ab->n_seqs <= 0) return;
    kvs_attn_args a;
    a.q = (const bf16 *)q;
    a.pool = (const bf16 *)pool->data;
    a.pool_blocks = pool->n_blocks;
    a.q_start = ab->q_start;
    a.kv_len = ab->kv_len;
    a.block_tables = ab->block_tables;
    a.table_rows = ab->table_rows;
    a.n_seqs = ab->n_seqs;
    a.n_tokens = ab->n_tokens;
    a.max_blocks = ab->max_blocks;
    a.n_heads = n_heads;
    a.n_kv_heads = pool->n_kv_heads;
    a.block_size = pool->block_size;
    a.window = ab->window;
    a.scale = scale;
    const bool fp8 = b->kv_dtype == KVS_F8_E4M3;
    a.scales = fp8 ? pool->scales : NULL;
    int D = pool->head_dim, mq = ab->max_q_len, mk = ab->max_kv_len;
    bf16 *o = (bf16 *)out;
    bool decode = mq <= 1;
    if (a.window > 0) {
        switch (D) {
        case 32: launch_window<32>(b, a, o, lse, mk, fp8); return;
        case 64: launch_window<64>(b, a, o, lse, mk, fp8); return;
        case 80: launch_window<80>(b, a, o, lse, mk, fp8); return;
        case 96: launch_window<96>(b, a, o, lse, mk, fp8); return;
        case 128: launch_window<128>(b, a, o, lse, mk, fp8); return;
        case 256: launch_window<256>(b, a, o, lse, mk, fp8); return;
        }
    }
    switch (D) {
    case 32: decode ? launch_split<32>(b, a, o, lse, mk, fp8) : launch_mixed<32>(b, a, o, lse, ab, fp8); return;
    case 64: decode ? launch_split<64>(b, a, o, lse, mk, fp8) : launch_mixed<64>(b, a, o, lse, ab, fp8); return;
    case 128: decode ? launch_split<128>(b, a, o, lse, mk, fp8) : launch_mixed<128>(b, a, o, lse, ab, fp8); return;
    case 80: launch_split<80>(b, a, o, lse, mk, fp8); return;
    case 96: launch_split<96>(b, a, o, lse, mk, fp8); return;
    case 256: launch_split<256>(b, a, o, lse, mk, fp8); return;
    default:
        kvs_cuda_report(b, "attention", "head_dim not supported (32, 64, 80, 96, 128, 256)", __FILE__, __LINE__);
    }
}
