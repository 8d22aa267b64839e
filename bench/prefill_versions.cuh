/* Prefill attention kernel versions measured but not shipped (as llm.c keeps
 * kernel versions in dev/): kvs_bench_kernels times them beside the shipped
 * kernels of src/backend/cuda/cuda_attention.cu and checks their output
 * against the default's. Self-contained copies: a change to the shipped
 * kernels does not reach these.
 *
 * v0 (docs/CUDA.md's performance log): 4 warps x 2 m-tiles (128 query rows a
 * block) of one head, the exact softmax (scores scaled before the row max, the
 * O rescale every tile), so it also takes scale <= 0; ~102 KiB of shared memory
 * at head_dim 128. Include after cuda_internal.h and cuda_mma.cuh. */
namespace prefill_v0 {

constexpr int TILE = 64; /* keys per K/V tile */

struct args {
    const bf16 *q, *pool;
    const int32_t *q_start, *kv_len, *block_tables;
    int n_seqs, n_tokens, max_blocks, n_heads, n_kv_heads, block_size;
    float scale;
};

template <int D>
struct rows {
    static constexpr int BYTES = (D + 8) * 2, TILE_BYTES = TILE * BYTES;
};

template <int D, int THREADS>
__device__ __forceinline__ void issue_kv_tile(const args &a, const int32_t *table, int g, int key0, int key_end,
                                              uint32_t k_s, uint32_t v_s) {
    constexpr int CH = D / 8, PIECES = TILE * CH;
    const size_t v_delta = (size_t)a.n_kv_heads * a.block_size * D;
#pragma unroll
    for (int p = threadIdx.x; p < PIECES; p += THREADS) {
        int r = p / CH, c = p % CH, e = key0 + r;
        bool ok = e < key_end;
        const bf16 *src = a.pool;
        if (ok)
            src = a.pool + kvs_kv_offset(table[e / a.block_size], 0, g, e % a.block_size, a.n_kv_heads,
                                         a.block_size, D) + c * 8;
        uint32_t off = r * rows<D>::BYTES + c * 16;
        kvs_cp_async16(k_s + off, src, ok);
        kvs_cp_async16(v_s + off, ok ? src + v_delta : a.pool, ok);
    }
}

/* One warp, MT m-tiles of 16 rows, one tile of NK keys: S = Q K^T, the online
 * softmax in the log2 domain, O = alpha O + P V. */
template <int D, int NK, bool MASK, int MT>
__device__ __forceinline__ void warp_tile(uint32_t q_w, uint32_t k_w, uint32_t v_w, int key_base, int lim_base,
                                          float scale_log2, float (&o)[MT][D / 8][4], float (&m)[MT][2],
                                          float (&l)[MT][2], int lane) {
    constexpr int RB = rows<D>::BYTES;
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
                float x = s[mt][j][c] * scale_log2;
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
        const float mn0 = fmaxf(m[mt][0], mx0), mn1 = fmaxf(m[mt][1], mx1);
        const float mu0 = mn0 == -INFINITY ? 0.f : mn0, mu1 = mn1 == -INFINITY ? 0.f : mn1;
        const float alpha0 = kvs_exp2(m[mt][0] - mu0), alpha1 = kvs_exp2(m[mt][1] - mu1);
        m[mt][0] = mn0, m[mt][1] = mn1;
        float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
        for (int j = 0; j < NK / 8; j++) {
            float p0 = kvs_exp2(s[mt][j][0] - mu0), p1 = kvs_exp2(s[mt][j][1] - mu0);
            float p2 = kvs_exp2(s[mt][j][2] - mu1), p3 = kvs_exp2(s[mt][j][3] - mu1);
            sum0 += p0 + p1;
            sum1 += p2 + p3;
            pa[mt][j / 2][(j & 1) * 2] = kvs_pack_bf16(p0, p1);
            pa[mt][j / 2][(j & 1) * 2 + 1] = kvs_pack_bf16(p2, p3);
        }
        l[mt][0] = l[mt][0] * alpha0 + sum0;
        l[mt][1] = l[mt][1] * alpha1 + sum1;
#pragma unroll
        for (int n = 0; n < D / 8; n++) {
            o[mt][n][0] *= alpha0, o[mt][n][1] *= alpha0;
            o[mt][n][2] *= alpha1, o[mt][n][3] *= alpha1;
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

constexpr int WARPS = 4, MT = 2, M = 16 * MT * WARPS; /* query rows a block */

template <int D>
struct smem {
    static constexpr size_t q = 0, kv = (size_t)M * rows<D>::BYTES, bytes = kv + (size_t)2 * 2 * rows<D>::TILE_BYTES;
};

template <int D>
__global__ void __launch_bounds__(WARPS * 32, 2) kernel(args a, bf16 *out, float *lse) {
    using L = smem<D>;
    constexpr int THREADS = WARPS * 32, RB = rows<D>::BYTES, TB = rows<D>::TILE_BYTES;
    extern __shared__ __align__(128) unsigned char sm[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int h = blockIdx.x, g = h / (a.n_heads / a.n_kv_heads), seq = blockIdx.z;
    const int q0 = (gridDim.y - 1 - blockIdx.y) * M;
    const int t0 = a.q_start[seq], q_len = a.q_start[seq + 1] - t0, kv_len = a.kv_len[seq];
    if (q0 >= q_len) return;
    const int32_t *table = a.block_tables + (size_t)seq * a.max_blocks;
    const int past = kv_len - q_len;
    const int last_row = min(q0 + M, q_len) - 1;
    const int n_keys = past + last_row + 1, n_tiles = (n_keys + TILE - 1) / TILE;

    const uint32_t q_s = kvs_smem_u32(sm) + (uint32_t)L::q, kv_s = kvs_smem_u32(sm) + (uint32_t)L::kv;
    for (int p = threadIdx.x; p < M * (D / 8); p += THREADS) {
        int r = p / (D / 8), c = p % (D / 8), qr = q0 + r;
        bool ok = qr < q_len;
        const bf16 *src = ok ? a.q + ((size_t)(t0 + qr) * a.n_heads + h) * D + c * 8 : a.q;
        kvs_cp_async16(q_s + r * RB + c * 16, src, ok);
    }
    issue_kv_tile<D, THREADS>(a, table, g, 0, n_keys, kv_s, kv_s + TB);
    kvs_cp_async_commit();

    const int wrow = q0 + warp * 16 * MT + lane / 4;
    const int lim_base = past + wrow, full_limit = past + q0;
    const float scale_log2 = a.scale * KVS_LOG2E;
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
        __syncthreads();
        if (i + 1 < n_tiles) {
            uint32_t st = kv_s + ((i + 1) % 2) * 2 * TB;
            issue_kv_tile<D, THREADS>(a, table, g, (i + 1) * TILE, n_keys, st, st + TB);
        }
        kvs_cp_async_commit();
        const uint32_t k_w = kv_s + (i % 2) * 2 * TB, v_w = k_w + TB;
        const int key0 = i * TILE;
        if (key0 + TILE - 1 <= full_limit)
            warp_tile<D, TILE, false, MT>(q_w, k_w, v_w, key0, lim_base, scale_log2, o, m, l, lane);
        else
            warp_tile<D, TILE, true, MT>(q_w, k_w, v_w, key0, lim_base, scale_log2, o, m, l, lane);
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
                float inv = 1.f / lt;
                bf16 *orow = out + (t * a.n_heads + h) * D + cq;
#pragma unroll
                for (int n = 0; n < D / 8; n++)
                    *(uint32_t *)(orow + 8 * n) = kvs_pack_bf16(o[mt][n][2 * hf] * inv, o[mt][n][2 * hf + 1] * inv);
                if (lse && (lane & 3) == 0) lse[t * a.n_heads + h] = (m[mt][hf] + __log2f(lt)) * KVS_LN2;
            }
        }
    }
}

/* The attention op's prefill at head_dim 128, as b->attention would run it with v0. */
static void attention(kvs_backend *b, void *out, float *lse, const void *q, const kvs_kv_pool *pool,
                      const kvs_attn_batch *ab, int n_heads, float scale) {
    constexpr int D = 128;
    args a = {(const bf16 *)q, (const bf16 *)pool->data, ab->q_start, ab->kv_len, ab->block_tables, ab->n_seqs,
              ab->n_tokens, ab->max_blocks, n_heads, pool->n_kv_heads, pool->block_size, scale};
    KVS_CUDA_CHECK(b, cudaFuncSetAttribute(kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           (int)smem<D>::bytes));
    dim3 grid((unsigned)n_heads, (unsigned)((ab->max_q_len + M - 1) / M), (unsigned)ab->n_seqs);
    kernel<D><<<grid, WARPS * 32, smem<D>::bytes, kvs_cuda_of(b)->stream>>>(a, (bf16 *)out, lse);
    KVS_CUDA_LAUNCHED(b, "prefill_v0::kernel");
}

} // namespace prefill_v0
