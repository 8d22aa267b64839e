/* Causal GQA attention over the paged KV cache, with LSE.
 *
 * Two kernels behind one entry point:
 *  - kvs_attn_prefill_kernel (head_dim 32/64/128, any batch with a chunk longer
 *    than one token): FlashAttention-2 style. A block of 4 warps owns 64 query
 *    rows of one head; it walks the sequence's K/V in tiles of 64 keys through
 *    shared memory, S = QK^T and O += PV on the tensor cores (WMMA bf16, fp32
 *    accumulation), online softmax in fp32 registers (two lanes per row).
 *  - kvs_attn_split_kernel (decode batches, and the fallback for other head
 *    sizes): a block owns one token and one KV head, so each K/V tile is read
 *    once for the whole GQA group; long sequences are split across blocks
 *    (flash-decoding) and kvs_attn_combine_kernel merges the partial softmaxes.
 * LSE is the natural log of the softmax denominator of the scaled scores. */
#include <math.h>
#include <mma.h>

#include "backend/cuda/cuda_internal.h"

using namespace nvcuda;

#define KVS_ATTN_TILE 64    /* keys per K/V tile; query rows per prefill block */
#define KVS_ATTN_THREADS 128

struct kvs_attn_args {
    const bf16 *q;
    const bf16 *pool;
    const int32_t *q_start, *kv_len, *block_tables;
    int n_seqs, n_tokens, max_blocks, n_heads, n_kv_heads, block_size;
    float scale;
};

/* Element offset of (block, kind, head, offset) in a bf16 pool. */
__device__ __forceinline__ size_t kvs_attn_kv_offset(const kvs_attn_args &a, int block, int kind, int head,
                                                     int offset, int head_dim) {
    return ((((size_t)block * 2 + kind) * a.n_kv_heads + head) * a.block_size + offset) * (size_t)head_dim;
}

/* Loads keys [key0, key0 + 64) of (seq, kv head) into k_s and v_s (rows of D + 8;
 * rows at or past key_end are zero). 16-byte pieces. */
template <int D>
__device__ __forceinline__ void kvs_attn_load_kv_tile(const kvs_attn_args &a, const int32_t *table, int g, int key0,
                                                      int key_end, bf16 *k_s, bf16 *v_s) {
    constexpr int PIECES = D / 8, LD = D + 8;
    for (int idx = threadIdx.x; idx < KVS_ATTN_TILE * PIECES; idx += blockDim.x) {
        int r = idx / PIECES, c = idx % PIECES, e = key0 + r;
        uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
        if (e < key_end) {
            int blk = table[e / a.block_size], off = e % a.block_size;
            kv = *(const uint4 *)(a.pool + kvs_attn_kv_offset(a, blk, 0, g, off, D) + c * 8);
            vv = *(const uint4 *)(a.pool + kvs_attn_kv_offset(a, blk, 1, g, off, D) + c * 8);
        }
        *(uint4 *)(k_s + r * LD + c * 8) = kv;
        *(uint4 *)(v_s + r * LD + c * 8) = vv;
    }
}

/* ---- prefill: tensor-core tiles --------------------------------------------- */

template <int D>
struct kvs_prefill_smem {
    static constexpr int LD = D + 8;      /* bf16 rows of Q, K, V */
    static constexpr int S_LD = KVS_ATTN_TILE + 4;  /* f32 rows of S */
    static constexpr int P_LD = KVS_ATTN_TILE + 8;  /* bf16 rows of P */
    static constexpr size_t q = 0, k = q + KVS_ATTN_TILE * LD * 2, v = k + KVS_ATTN_TILE * LD * 2,
                            s = v + KVS_ATTN_TILE * LD * 2, p = s + 4 * 16 * S_LD * 4,
                            bytes = p + 4 * 16 * P_LD * 2;
};

template <int D>
__global__ void __launch_bounds__(KVS_ATTN_THREADS)
    kvs_attn_prefill_kernel(kvs_attn_args a, bf16 *out, float *lse, int tiles_per_seq) {
    using L = kvs_prefill_smem<D>;
    extern __shared__ __align__(128) unsigned char smem[];
    bf16 *q_s = (bf16 *)(smem + L::q), *k_s = (bf16 *)(smem + L::k), *v_s = (bf16 *)(smem + L::v);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float *s_w = (float *)(smem + L::s) + warp * 16 * L::S_LD;
    bf16 *p_w = (bf16 *)(smem + L::p) + warp * 16 * L::P_LD;

    const int seq = blockIdx.x / tiles_per_seq, q0 = (blockIdx.x % tiles_per_seq) * KVS_ATTN_TILE;
    const int h = blockIdx.y, g = h / (a.n_heads / a.n_kv_heads);
    const int t0 = a.q_start[seq], q_len = a.q_start[seq + 1] - t0, kv_len = a.kv_len[seq];
    if (q0 >= q_len) return;
    const int32_t *table = a.block_tables + (size_t)seq * a.max_blocks;

    /* Q tile: rows q0 .. q0 + 63 of the chunk (zero past its end) */
    for (int idx = threadIdx.x; idx < KVS_ATTN_TILE * (D / 8); idx += blockDim.x) {
        int r = idx / (D / 8), c = idx % (D / 8);
        uint4 v = make_uint4(0, 0, 0, 0);
        if (q0 + r < q_len) v = *(const uint4 *)(a.q + ((size_t)(t0 + q0 + r) * a.n_heads + h) * D + c * 8);
        *(uint4 *)(q_s + r * L::LD + c * 8) = v;
    }

    /* this lane's row (two lanes a row, each half of the columns) */
    const int row = lane / 2, half = lane % 2, qi = q0 + warp * 16 + row;
    const int limit = qi < q_len ? kv_len - q_len + qi : -1; /* last key this row sees */
    const int last_row = min(q0 + KVS_ATTN_TILE, q_len) - 1;
    const int n_keys = kv_len - q_len + last_row + 1;
    float m = -INFINITY, l = 0.f, o[D / 16][8];
#pragma unroll
    for (int j = 0; j < D / 16; j++)
#pragma unroll
        for (int c = 0; c < 8; c++) o[j][c] = 0.f;

    for (int key0 = 0; key0 < n_keys; key0 += KVS_ATTN_TILE) {
        __syncthreads(); /* the previous tile is no longer read */
        kvs_attn_load_kv_tile<D>(a, table, g, key0, n_keys, k_s, v_s);
        __syncthreads();

        /* S (16 x 64 per warp) = Q_w K^T */
#pragma unroll
        for (int j = 0; j < KVS_ATTN_TILE / 16; j++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::fill_fragment(acc, 0.f);
#pragma unroll
            for (int kk = 0; kk < D / 16; kk++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> fb;
                wmma::load_matrix_sync(fa, q_s + (warp * 16) * L::LD + kk * 16, L::LD);
                wmma::load_matrix_sync(fb, k_s + (j * 16) * L::LD + kk * 16, L::LD);
                wmma::mma_sync(acc, fa, fb, acc);
            }
            wmma::store_matrix_sync(s_w + j * 16, acc, L::S_LD, wmma::mem_row_major);
        }
        __syncwarp();

        /* online softmax over this lane's 32 columns; the pair shares max and sum */
        const float *srow = s_w + row * L::S_LD + half * 32;
        float sv[32], tmax = -INFINITY;
#pragma unroll
        for (int c = 0; c < 32; c++) {
            int e = key0 + half * 32 + c;
            sv[c] = e <= limit ? srow[c] * a.scale : -INFINITY;
            tmax = fmaxf(tmax, sv[c]);
        }
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
        float m_new = fmaxf(m, tmax), alpha = 1.f, sum = 0.f;
        bf16 *prow = p_w + row * L::P_LD + half * 32;
        if (m_new == -INFINITY) {
#pragma unroll
            for (int c = 0; c < 32; c++) prow[c] = __float2bfloat16(0.f);
        } else {
            alpha = __expf(m - m_new);
#pragma unroll
            for (int c = 0; c < 32; c++) {
                float p = __expf(sv[c] - m_new);
                sum += p;
                prow[c] = __float2bfloat16(p);
            }
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        l = l * alpha + sum;
        m = m_new;
        __syncwarp();

        /* O_w (16 x D) = alpha O_w + P_w V, one 16-column chunk at a time through s_w */
#pragma unroll
        for (int j = 0; j < D / 16; j++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
            wmma::fill_fragment(acc, 0.f);
#pragma unroll
            for (int kk = 0; kk < KVS_ATTN_TILE / 16; kk++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> fa;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> fb;
                wmma::load_matrix_sync(fa, p_w + kk * 16, L::P_LD);
                wmma::load_matrix_sync(fb, v_s + (kk * 16) * L::LD + j * 16, L::LD);
                wmma::mma_sync(acc, fa, fb, acc);
            }
            wmma::store_matrix_sync(s_w, acc, L::S_LD, wmma::mem_row_major);
            __syncwarp();
#pragma unroll
            for (int c = 0; c < 8; c++) o[j][c] = o[j][c] * alpha + s_w[row * L::S_LD + half * 8 + c];
            __syncwarp();
        }
    }

    if (qi < q_len) {
        size_t t = (size_t)t0 + qi;
        float inv = 1.f / l;
        bf16 *orow = out + (t * a.n_heads + h) * D;
#pragma unroll
        for (int j = 0; j < D / 16; j++)
#pragma unroll
            for (int c = 0; c < 8; c++) orow[j * 16 + half * 8 + c] = __float2bfloat16(o[j][c] * inv);
        if (lse && half == 0) lse[t * a.n_heads + h] = m + logf(l);
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

template <int D>
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
    const int k0 = split * split_len, k1 = min(n_keys, k0 + split_len);
    const int32_t *table = a.block_tables + (size_t)seq * a.max_blocks;

    for (int i = threadIdx.x; i < group * D; i += blockDim.x) {
        q_s[i] = __bfloat162float(a.q[((size_t)t * a.n_heads + h0) * D + i]) * a.scale;
        o_s[i] = 0.f;
    }
    for (int i = threadIdx.x; i < group; i += blockDim.x) {
        m_s[i] = -INFINITY;
        l_s[i] = 0.f;
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, n_warps = blockDim.x / 32;
    for (int key0 = k0; key0 < k1; key0 += KVS_ATTN_TILE) {
        __syncthreads();
        kvs_attn_load_kv_tile<D>(a, table, g, key0, k1, k_s, v_s);
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
    for (int i = threadIdx.x; i < group * D; i += blockDim.x) part_o[base * D + i] = o_s[i];
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

/* ---- dispatch ------------------------------------------------------------------ */

template <int D>
static void launch_prefill(kvs_backend *b, const kvs_attn_args &a, bf16 *out, float *lse, int max_q_len) {
    using L = kvs_prefill_smem<D>;
    int tiles = (max_q_len + KVS_ATTN_TILE - 1) / KVS_ATTN_TILE;
    KVS_CUDA_CHECK(b, cudaFuncSetAttribute(kvs_attn_prefill_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)L::bytes));
    dim3 grid((unsigned)(a.n_seqs * tiles), (unsigned)a.n_heads);
    kvs_attn_prefill_kernel<D><<<grid, KVS_ATTN_THREADS, L::bytes, kvs_cuda_of(b)->stream>>>(a, out, lse, tiles);
    KVS_CUDA_LAUNCHED(b, "kvs_attn_prefill_kernel");
}

template <int D>
static void launch_split(kvs_backend *b, const kvs_attn_args &a, bf16 *out, float *lse, int max_kv_len) {
    kvs_cuda *c = kvs_cuda_of(b);
    int group = a.n_heads / a.n_kv_heads;
    /* enough blocks for several waves over the GPU, in splits of whole tiles */
    long base_blocks = (long)a.n_tokens * a.n_kv_heads;
    int max_tiles = (max_kv_len + KVS_ATTN_TILE - 1) / KVS_ATTN_TILE;
    int n_splits = (int)((8L * c->n_sms + base_blocks - 1) / base_blocks);
    if (n_splits > max_tiles) n_splits = max_tiles;
    if (n_splits < 1) n_splits = 1;
    int split_len = (max_tiles + n_splits - 1) / n_splits * KVS_ATTN_TILE;
    n_splits = (max_kv_len + split_len - 1) / split_len;
    if (n_splits < 1) n_splits = 1;
    size_t rows = (size_t)a.n_tokens * a.n_heads;
    size_t o_bytes = (size_t)n_splits * rows * D * sizeof(float), ml_bytes = (size_t)n_splits * rows * 2 * sizeof(float);
    char *scratch = (char *)kvs_cuda_scratch(b, o_bytes + ml_bytes);
    if (!scratch) return;
    float *part_o = (float *)scratch, *part_ml = (float *)(scratch + o_bytes);
    size_t smem = kvs_split_smem_bytes<D>(group);
    if (smem > 48 * 1024)
        KVS_CUDA_CHECK(b, cudaFuncSetAttribute(kvs_attn_split_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               (int)smem));
    dim3 grid((unsigned)a.n_tokens, (unsigned)a.n_kv_heads, (unsigned)n_splits);
    kvs_attn_split_kernel<D><<<grid, KVS_ATTN_THREADS, smem, c->stream>>>(a, part_o, part_ml, split_len);
    KVS_CUDA_LAUNCHED(b, "kvs_attn_split_kernel");
    kvs_attn_combine_kernel<<<(unsigned)rows, D < 128 ? D : 128, 0, c->stream>>>(out, lse, part_o, part_ml, n_splits,
                                                                                  (int)rows, D);
    KVS_CUDA_LAUNCHED(b, "kvs_attn_combine_kernel");
}

void kvs_cuda_attention(kvs_backend *b, void *out, float *lse, const void *q, const kvs_kv_pool *pool,
                        const kvs_attn_batch *ab, int n_heads, float scale) {
    if (ab->n_tokens <= 0 || ab->n_seqs <= 0) return;
    kvs_attn_args a;
    a.q = (const bf16 *)q;
    a.pool = (const bf16 *)pool->data;
    a.q_start = ab->q_start;
    a.kv_len = ab->kv_len;
    a.block_tables = ab->block_tables;
    a.n_seqs = ab->n_seqs;
    a.n_tokens = ab->n_tokens;
    a.max_blocks = ab->max_blocks;
    a.n_heads = n_heads;
    a.n_kv_heads = pool->n_kv_heads;
    a.block_size = pool->block_size;
    a.scale = scale;
    int D = pool->head_dim;
    bf16 *o = (bf16 *)out;
    bool decode = ab->max_q_len <= 1;
    switch (D) {
    case 32: decode ? launch_split<32>(b, a, o, lse, ab->max_kv_len) : launch_prefill<32>(b, a, o, lse, ab->max_q_len); return;
    case 64: decode ? launch_split<64>(b, a, o, lse, ab->max_kv_len) : launch_prefill<64>(b, a, o, lse, ab->max_q_len); return;
    case 128: decode ? launch_split<128>(b, a, o, lse, ab->max_kv_len) : launch_prefill<128>(b, a, o, lse, ab->max_q_len); return;
    case 80: launch_split<80>(b, a, o, lse, ab->max_kv_len); return;
    case 96: launch_split<96>(b, a, o, lse, ab->max_kv_len); return;
    case 256: launch_split<256>(b, a, o, lse, ab->max_kv_len); return;
    default:
        kvs_cuda_report(b, "attention", "head_dim not supported (32, 64, 80, 96, 128, 256)", __FILE__, __LINE__);
    }
}
