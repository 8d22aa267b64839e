/* Prefill attention on Hopper's warpgroup MMA (KVS_CUDA_PREFILL_WGMMA; sm_90a,
 * head_dim 64 and 128, bf16 pools). The semantics are cuda_attention.cu's
 * prefill kernels' (backend.h kvs_attn_batch: varlen, chunks after cached
 * entries, causal within the chunk, GQA, LSE as the natural log of the softmax
 * denominator of the scaled scores). docs/CUDA.md "Hopper prefill kernel (wgmma)"
 * has the design and the measurements.
 *
 * A block owns 128 query rows of one KV group: HEADS query heads of the group (4
 * when the group is a multiple of 4, else 2, else 1) x 128 / HEADS positions, so
 * each K/V tile in shared memory feeds 128 rows; two consumer warpgroups of 64 rows
 * (warps 0-3, 4-7). Per K/V tile (176 keys at bf16 head_dim 128, else 128: kvs_wg_cfg)
 * each consumer warpgroup computes S = Q K^T with wgmma m64n176k16 / m64n128k16 (Q and
 * K from shared memory, K-major, 128-byte swizzle),
 * the online softmax in registers (row max over raw scores, moved only by more
 * than 8 in log2, one FFMA + ex2 a probability, O rescale skipped by warp vote when
 * no row max moved), and
 * O += P V with wgmma m64nDk16, P straight from the S accumulators packed to bf16
 * (the f32 accumulator layout of a 16-column slice is the A-fragment layout), V
 * from shared memory as the N-major (transposed) B operand.
 *
 * FlashAttention-3's structure (kvs_attn_wgmma_kernel). 12 warps: a producer
 * warpgroup (warps 8-11, setmaxnreg down to 56 registers) and the two consumer
 * warpgroups (setmaxnreg up to 224). The producer fills a K ring and a V ring (STAGES
 * tiles each): bf16 at head_dim 128 by TMA, one box a 16-key unit of a paged block
 * from each of its four warps (kvs_wg_produce_tma), else its 128 threads by 16-byte
 * cp.async, two half-tiles (a tile's K or V) in flight (kvs_wg_produce), FP8 pools
 * with the same threads converting the codes (kvs_wg_produce8); rows at or past the
 * block's last key are zero-filled, so that stale or NaN pool rows never reach the
 * tensor cores. Consumers: S of tile i and P V of tile i - 1 are issued together (O
 * rescaled between them, FlashAttention-3's order), K_i released once S_i is done,
 * P V of i - 1 waited for and V_{i-1} released before the softmax of i in the SASS
 * (see the tile loop); with 2 or 4 heads a block the two warpgroups issue their GEMMs in
 * turn (named barriers 3 and 4, FlashAttention-3's warp-scheduler barriers), so one's
 * softmax runs under the other's GEMMs.
 *
 * Shared memory (every tile 1024-byte aligned; a "column block" is 64 bf16 = 128
 * bytes of each row): Q [D/64 column blocks][128 rows][128 B], then the K/V tiles
 * [D/64][BN keys][128 B] (bf16 d128: [8-row group][2 column blocks][8 rows][128 B],
 * what the TMA boxes write: kvs_wg_swz_units, its descriptors there), then the
 * mbarriers; layout and descriptors in cuda_wgmma.cuh (kvs_wg_swz, kvs_wg_desc).
 * Descriptors: K-major (Q, K) start + 32
 * bytes per k16 step inside a column block, LBO 16 (unused), SBO 1024 (8-row
 * groups); N-major (V) start + 2048 bytes per 16 keys, LBO = BN keys x 128 B (the
 * next 64 head_dim columns), SBO 1024 (the next 8 keys). */
#include <cudaTypedefs.h> /* PFN_cuTensorMapEncodeTiled (kvs_wg_unit_map) */
#include <math.h>
#include <string.h>

#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/cuda_mma.cuh"
#include "backend/cuda/cuda_wgmma.cuh"

/* 1 in the sm_90a code of this file, 0 in any other: read by the host to tell
 * whether the device runs the wgmma kernel (a build for other architectures
 * compiles it empty). */
__device__ int kvs_wgmma_built =
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    1;
#else
    0;
#endif

/* bench-only: the DIAG variant's counters (KVS_WG_DIAG_*; kvs_cuda_wgmma_diag_read) */
__device__ unsigned long long kvs_wg_diag[KVS_WG_DIAG_N];

#define KVS_WG_BM 128      /* query rows a block (two consumer warpgroups of 64) */
#define KVS_WG_BN 128      /* keys a K/V tile (the cp.async producers'; TMA's: kvs_wg_cfg) */
#define KVS_WG_THREADS 384 /* 2 consumer warpgroups + the producer warpgroup */
/* registers a thread after setmaxnreg: producer + 2 consumers = 3 x 168, the
   count ptxas compiles 384 threads at (the consumers need 192 at head_dim 128; the
   producer's copies, and FP8's conversion, fit 56) */
#define KVS_WG_PRODUCER_REGS 56
#define KVS_WG_CONSUMER_REGS 224
static_assert(KVS_WG_PRODUCER_REGS + 2 * KVS_WG_CONSUMER_REGS == 3 * 168, "register split");

/* Shared memory: Q, the K ring, the V ring (bf16 tiles), FP8 pools: two raw tiles of
   codes (a tile's K or V, 128 keys x D bytes, the producer's staging), then the
   mbarriers; + 1024 for aligning the base. */
template <int D, int STAGES, bool FP8, int BN = KVS_WG_BN>
struct kvs_wg_smem {
    static constexpr size_t TILE = (size_t)BN * D * 2, RAW = (size_t)BN * D;
    static constexpr size_t q = 0, k = (size_t)KVS_WG_BM * D * 2, v = k + STAGES * TILE, raw = v + STAGES * TILE;
    static constexpr size_t bar = raw + (FP8 ? 2 * RAW : 0);
    static constexpr size_t bytes = bar + 4 * STAGES * 8 + 1024;
};

/* A kernel's tiles and rings. bf16 at head_dim 128 by TMA (the default): 176-key tiles
 * (FlashAttention-3's non-causal shape; 0.96 / 0.95x the time of 128-key tiles at 16k /
 * 32k, docs/CUDA.md "Session 18"), two stages (32 KiB of Q + 2 x 2 x 44 KiB: 209 KiB);
 * the cp.async producers (head_dim 64, FP8 pools, bf16 without a tensor map: bench
 * CP_ASYNC) 128-key tiles: bf16 3 stages at 128 (225 KiB under sm_90's 227 KiB), 4 at
 * 64 (145 KiB); FP8 (two raw tiles of codes besides: 32 KiB at 128, 16 at 64) 2 at 128
 * (193 KiB), 6 at 64 (225 KiB). */
template <int D, bool FP8, int AB>
struct kvs_wg_cfg {
    static constexpr bool tma = D == 128 && !FP8 && (AB & KVS_WG_AB_CP_ASYNC) == 0;
    static constexpr int BN = tma ? 176 : KVS_WG_BN;
    static constexpr int STAGES = D == 128 ? (FP8 || tma ? 2 : 3) : (FP8 ? 6 : 4);
    using L = kvs_wg_smem<D, STAGES, FP8, BN>;
    static_assert(L::bytes <= 227 * 1024, "the shared memory of an sm_90 block");
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* ---- the kernel's pieces ------------------------------------------------------------
 * Block row R: head h0 + R / MH, position q0 + R % MH; warpgroup wg owns rows
 * 64 wg .. 64 wg + 63; a thread holds rows R0 = 64 wg + 16 (warp % 4) + lane / 4
 * and R0 + 8 (one head). */

/* Work item w of the kernel (ny q-blocks a sequence): query heads h0 .. h0 + HEADS - 1
   of KV group g, positions q0 .. q0 + 128 / HEADS - 1 of sequence seq (position tiles
   from the last down: the heaviest first), whose chunk starts at token t0 and sees
   `past` cached entries; the item's rows see keys 0 .. n_keys - 1 (n_tiles tiles of
   BN). q0 >= q_len: the item has no row. */
template <int HEADS, int BN = KVS_WG_BN>
struct kvs_wg_block {
    int h0, g, seq, q0, t0, q_len, past, n_keys, n_tiles;
    __device__ __forceinline__ kvs_wg_block(const kvs_attn_args &a, int w, int ny) {
        constexpr int MH = KVS_WG_BM / HEADS;
        const int nx = a.n_heads / HEADS;
        h0 = w % nx * HEADS, g = h0 / (a.n_heads / a.n_kv_heads), seq = w / nx / ny;
        q0 = (ny - 1 - w / nx % ny) * MH;
        t0 = a.q_start[seq], q_len = a.q_start[seq + 1] - t0, past = a.kv_len[seq] - q_len;
        n_keys = past + min(q0 + MH, q_len);
        n_tiles = (n_keys + BN - 1) / BN;
    }
};

/* Warpgroup wg's Q rows (zero past q_len) into q_s by cp.async; waits, publishes
   them to the async proxy and syncs the warpgroup (named barrier 1 + wg). */
template <int D, int HEADS>
__device__ __forceinline__ void kvs_wg_load_q(const kvs_attn_args &a, uint32_t q_s, int wg, int h0, int q0, int t0,
                                              int q_len) {
    constexpr int MH = KVS_WG_BM / HEADS, CH = D / 8;
    for (int p = threadIdx.x % 128; p < 64 * CH; p += 128) {
        const int R = 64 * wg + p / CH, c = p % CH, pos = q0 + R % MH;
        const bool ok = pos < q_len;
        const bf16 *src = ok ? a.q + ((size_t)(t0 + pos) * a.n_heads + h0 + R / MH) * D + c * 8 : a.q;
        kvs_cp_async16(q_s + kvs_wg_swz(KVS_WG_BM, R, c), src, ok);
    }
    kvs_cp_async_commit();
    kvs_cp_async_wait<0>();
    kvs_fence_proxy_async();
    kvs_named_sync(1 + wg, 128);
}

/* The scaled row maxima (log2 domain) of the thread's rows over S of the tile at
   key k0 (-inf where a row sees none of it); with `mask`, first sets the scores of
   keys past each row's last (lim0 for row R0, lim0 + 8 for R0 + 8) to -inf. */
template <int BN>
__device__ __forceinline__ void kvs_wg_row_max(float (&s)[BN / 2], int k0, bool mask, int lim0, float scale_log2,
                                               float &mx0, float &mx1) {
    const int lane = threadIdx.x % 32;
    if (mask) {
        const int col = k0 + 2 * (lane & 3);
#pragma unroll
        for (int j = 0; j < BN / 8; j++) {
#pragma unroll
            for (int c = 0; c < 4; c++) {
                if (col + 8 * j + (c & 1) > lim0 + 8 * (c >> 1)) s[4 * j + c] = -INFINITY;
            }
        }
    }
    mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int j = 0; j < BN / 8; j++) {
        mx0 = fmaxf(mx0, fmaxf(s[4 * j], s[4 * j + 1]));
        mx1 = fmaxf(mx1, fmaxf(s[4 * j + 2], s[4 * j + 3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    mx0 *= scale_log2, mx1 *= scale_log2; /* -inf stays -inf (scale > 0) */
}

/* O x v_scale / l and the LSE of the thread's rows (positions past q_len skipped);
   l0, l1: the thread's parts of the row sums, m0, m1: the rows' scaled maxima;
   v_scale: an FP8 pool's V scale (1 for bf16). */
template <int D, int HEADS>
__device__ __forceinline__ void kvs_wg_store(const kvs_attn_args &a, bf16 *out, float *lse, const float (&o)[D / 2],
                                             float l0, float l1, float m0, float m1, float v_scale, int R0, int h0,
                                             int q0, int t0, int q_len) {
    constexpr int MH = KVS_WG_BM / HEADS;
    const int lane = threadIdx.x % 32, head = h0 + R0 / MH, pos0 = q0 + R0 % MH;
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const int cq = 2 * (lane & 3);
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        const int pos = pos0 + 8 * hf;
        if (pos < q_len) {
            const size_t t = (size_t)t0 + pos;
            const float lt = hf ? l1 : l0, inv = v_scale / lt;
            bf16 *orow = out + (t * a.n_heads + head) * D + cq;
#pragma unroll
            for (int j = 0; j < D / 8; j++)
                *(uint32_t *)(orow + 8 * j) = kvs_pack_bf16(o[4 * j + 2 * hf] * inv, o[4 * j + 2 * hf + 1] * inv);
            if (lse && (lane & 3) == 0) lse[t * a.n_heads + head] = ((hf ? m1 : m0) + __log2f(lt)) * KVS_LN2;
        }
    }
}

/* The DIAG variant's clock (0 in the others: the timing folds away) */
template <int AB>
__device__ __forceinline__ long long kvs_wg_tick() {
    if constexpr ((AB & KVS_WG_AB_DIAG) != 0) return clock64();
    else return 0;
}
/* A bf16 producer's DIAG counters (thread 0 of the producer warpgroup): its loop's cycles
   from t_loop, those of its empty waits, its tiles */
template <int AB>
__device__ __forceinline__ void kvs_wg_diag_producer(int pt, long long t_loop, long long d_empty, int n_tiles) {
    if constexpr ((AB & KVS_WG_AB_DIAG) != 0) {
        if (pt == 0) {
            atomicAdd(&kvs_wg_diag[KVS_WG_DIAG_PROD_LOOP], (unsigned long long)(clock64() - t_loop));
            atomicAdd(&kvs_wg_diag[KVS_WG_DIAG_PROD_EMPTY], (unsigned long long)d_empty);
            atomicAdd(&kvs_wg_diag[KVS_WG_DIAG_PROD_TILES], (unsigned long long)n_tiles);
        }
    }
}

/* The bf16 producer at head_dim 64 (and at 128 without a tensor map of the pool, or as
 * the bench's CP_ASYNC; kvs_wg_produce_tma below is the d128 default), thread pt of the
 * producer warpgroup, one work item: K and V of every tile into the rings by 16-byte
 * cp.async (FlashAttention-3's way for pages of fewer than 128 keys). Half-tile j: tile j / 2's K (j even) or V, 128 keys x D:
 * thread pt copies the chunk c = pt % CH (CH = D / 8) of rows kt + KPR v (kt = pt /
 * CH, KPR = 128 / CH) straight into the ring stage's swizzled place, rows at or past
 * n_keys zero-filled. Lanes 0..7 of each warp hold the 16-key units (paged block x
 * 16-row group, as kvs_wg_produce8's) of the tile being copied, and the next tile's,
 * loaded a tile ahead. Half-tiles j + 1 and j + 2 are issued (each after its stage's
 * empty wait) before j is waited for, fenced to the async proxy and arrived on (128
 * arrivals). AB: the bench's NO_V (no V copies), NO_LOAD (none after the first STAGES
 * tiles), DIAG (the empty waits' clock). */
template <int D, int STAGES, int AB>
__device__ __forceinline__ void kvs_wg_produce(const kvs_attn_args &a, int g, int seq, int n_keys, int n_tiles,
                                               uint32_t k_s, uint32_t v_s, uint32_t bars, int pt) {
    constexpr int BN = KVS_WG_BN, CH = D / 8, KPR = 128 / CH;
    constexpr uint32_t TILE = (uint32_t)BN * D * 2;
    static_assert(KPR % 8 == 0 && KPR <= 16, "a thread's rows kt + KPR v: 16 / KPR of each 16-row group");
    const int32_t *table = kvs_attn_table(a, seq);
    const int bs = a.block_size, lane = pt % 32, kt = pt / CH, c = pt % CH;
    const bf16 *src_k = a.pool + kvs_kv_offset(0, 0, g, kt, a.n_kv_heads, bs, D) + 8 * c;
    const size_t v_off = (size_t)a.n_kv_heads * bs * D; /* a block's K rows of a head -> its V rows */
    const uint32_t bunits = 2u * a.n_kv_heads * (bs / 16);
    auto unit_of = [&](int i) -> uint32_t { /* lane < 8: the unit of group lane of tile i (0 past the keys) */
        const int e = i * BN + 16 * lane;
        return lane < 8 && e < n_keys ? (uint32_t)table[e / bs] * bunits + (uint32_t)(e % bs) / 16 : 0u;
    };
    auto tick = kvs_wg_tick<AB>;
    long long d_empty = 0;
    const long long t_loop = tick();
    uint32_t unit_t = unit_of(0), unit_n = unit_of(1);
    auto issue = [&](int j) {
        const int i = j >> 1, kind = j & 1, k0 = i * BN;
        if (((AB & KVS_WG_AB_NO_V) != 0 && kind) || ((AB & KVS_WG_AB_NO_LOAD) != 0 && i >= STAGES)) {
            kvs_cp_async_commit(); /* bench: no copy (an empty group keeps the count) */
            return;
        }
        const uint32_t dst = (kind ? v_s : k_s) + (uint32_t)(i % STAGES) * TILE;
        const bf16 *src = kind ? src_k + v_off : src_k;
        const uint32_t dst_t = dst + kvs_wg_swz(BN, kt, c); /* row kt + KPR v: + KPR v x 128 bytes (same swizzle) */
#pragma unroll
        for (int gq = 0; gq < BN / 16; gq++) { /* the thread's rows of 16-key group gq */
            const uint32_t u = __shfl_sync(0xffffffffu, unit_t, gq);
            const bf16 *src_g = src + (size_t)u * 16 * D;
#pragma unroll
            for (int w = 0; w < 16 / KPR; w++) {
                const int rr = KPR * w, r = 16 * gq + rr + kt; /* row rr + kt of the group */
                const bool ok = k0 + r < n_keys;
                kvs_cp_async16(dst_t + (uint32_t)(16 * gq + rr) * 128, ok ? src_g + (size_t)rr * D : a.pool, ok);
            }
        }
        kvs_cp_async_commit();
    };
    /* Two half-tiles in flight while the producer waits for the oldest (half-tile j + 2
     * issued before j is waited for: K_{i+1} before K_i is published, V_{i+1} before
     * V_i; one in flight measured 0.98-1.0x of this with the consumers' order below,
     * docs/CUDA.md "Where a tile's time goes").
     * Deadlock-free for STAGES >= 2. The producer arrives on full(j) only after the
     * empty waits of every half-tile up to j + 2 (j + 2's the latest: the one that
     * binds), which need releases by both consumer warpgroups; a consumer releases K_t
     * once S of tile t is done (its iteration t needs full K_t and V_{t-1}) and V_t
     * after P V of tile t (its iteration t + 1 needs full K_{t+1} and V_t; the last
     * tile's after the loop needs V_t alone; tiles past a warpgroup's keys need their
     * own stage alone). Full(K_i) waits on empty K_{i+1}: the release of K_{i+1-STAGES},
     * which needs full K_{i+1-STAGES} and V_{i-STAGES}, both before K_i in the
     * producer's order (K_0 V_0 K_1 ...) when STAGES >= 2. Full(V_i) waits on empty
     * V_{i+1}: the release of V_{i+1-STAGES}, which needs full K_{i+2-STAGES} and
     * V_{i+1-STAGES}, before V_i when STAGES >= 2 (at 2: K_i, published one step
     * earlier). Every arrival thus needs only earlier arrivals (and consumer progress
     * that needs only those; the consumers' turns, kvs_attn_wgmma_kernel, keep the two
     * warpgroups within a round of each other, both past the releases named here): no
     * cycle. At STAGES = 3 (bf16 d128) the slack is a tile more than at 2.
     * j = -1 issues half-tile 1 and publishes nothing (one inlined issue in the loop: a
     * second copy of its 16 addresses spills at 56 registers). */
    issue(0);
#pragma unroll 1
    for (int j = -1; j < 2 * n_tiles; j++) {
        if (j + 2 < 2 * n_tiles) {
            const int i1 = (j + 2) >> 1, kind1 = (j + 2) & 1;
            if (!kind1) unit_t = unit_n, unit_n = unit_of(i1 + 1); /* tile i1's units; i1 + 1's on the way */
            const long long t_empty = tick();
            if (i1 >= STAGES) /* tile i1 - STAGES of this kind read */
                kvs_mbar_wait(bars + 8 * (kind1 * STAGES + i1 % STAGES) + 16 * STAGES, ((i1 / STAGES) & 1) ^ 1);
            d_empty += tick() - t_empty;
            issue(j + 2);
        } else kvs_cp_async_commit(); /* an empty group: the wait below leaves two in flight */
        if (j >= 0) {
            kvs_cp_async_wait<2>(); /* half-tile j's copies landed */
            kvs_fence_proxy_async();
            kvs_mbar_arrive(bars + 8 * ((j & 1) * STAGES + (j >> 1) % STAGES));
        }
    }
    kvs_wg_diag_producer<AB>(pt, t_loop, d_empty, n_tiles);
}

/* The bf16 producer at head_dim 128 (the default since 2026-12-04; bench CP_ASYNC and
 * a pool without a tensor map take kvs_wg_produce): K and V by TMA, one box a 16-key
 * unit of a paged block (16 rows x 256 bytes: both column blocks), through a 4D view
 * of the pool (kvs_wg_unit_map: {64 columns, 8 rows, 2 column blocks, 8-row groups}),
 * which writes the tile as [unit][row group][column block][8 rows][128 B]
 * (kvs_wg_swz_units; the consumers' descriptors follow): BN / 16 boxes a tile (11 at
 * the default's 176 keys) from four warps, where session 16's one warp issuing 32 boxes
 * of 16 rows x 128 bytes a 128-key tile could not keep up; 0.93x the time of the 128
 * threads' cp.async at 128-key tiles (docs/CUDA.md "Where a tile's time goes"). Warp w
 * of the producer loads units w, w + 4, w + 8 (those < BN / 16) of every half-tile: it
 * waits for the stage's empty barrier, copies the units holding keys at or past n_keys
 * (the last tile's: stale or NaN pool rows must not reach the tensor cores) by 16-byte
 * cp.async with those rows zero-filled, waits for them and fences them to the async
 * proxy, then lane 0 arrives on the full barrier (4 arrivals, one a warp) announcing
 * its TMA bytes and issues its boxes. The paged blocks of a tile's units: lanes 0 .. 2
 * load them a tile ahead. */
template <int D, int STAGES, int AB, int BN>
__device__ __forceinline__ void kvs_wg_produce_tma(const void *map, const kvs_attn_args &a, int g, int seq,
                                                   int n_keys, int n_tiles, uint32_t k_s, uint32_t v_s,
                                                   uint32_t bars, int pt) {
    static_assert(D == 128, "the unit box is 16 rows x 2 column blocks");
    static_assert(BN % 16 == 0 && BN <= 256, "whole units, 4 a warp at most");
    constexpr uint32_t TILE = (uint32_t)BN * D * 2, UNIT = 16u * D * 2;
    /* the tile's NU units over the four warps: warp w's m-th is unit w + 4 m (at 176
       keys: 3, 3, 3 and 2 units) */
    constexpr int NU = BN / 16, MU = (NU + 3) / 4;
    auto unit = [](int w, int m) { return w + 4 * m; };
    auto owned = [](int u) { return u < NU; };
    const int32_t *table = kvs_attn_table(a, seq);
    const int bs = a.block_size, w = pt / 32, lane = pt % 32;
    const int rg_k = (int)(kvs_kv_offset(0, 0, g, 0, a.n_kv_heads, bs, D) / (8 * D)); /* head g's K, 8-row groups */
    const int rg_v = a.n_kv_heads * bs / 8;                                             /* K -> V rows of a block */
    const int bunits = 2 * a.n_kv_heads * (bs / 16);
    auto block_of = [&](int i) -> int { /* lane < MU: the paged block of the warp's unit `lane` of tile i (0 past the keys) */
        const int u = unit(w, lane), e = i * BN + 16 * u;
        return lane < MU && owned(u) && e < n_keys ? table[e / bs] : 0;
    };
    auto tick = kvs_wg_tick<AB>;
    long long d_empty = 0;
    const long long t_loop = tick();
    int blk_cur = 0, blk_next = block_of(0);
    for (int j = 0; j < 2 * n_tiles; j++) {
        const int i = j >> 1, kind = j & 1, st = i % STAGES, k0 = i * BN;
        if (!kind) blk_cur = blk_next, blk_next = i + 1 < n_tiles ? block_of(i + 1) : 0;
        const uint32_t full = bars + 8 * (kind * STAGES + st), empty = full + 16 * STAGES;
        const long long t_empty = tick();
        if (i >= STAGES) kvs_mbar_wait(empty, ((i / STAGES) & 1) ^ 1); /* tile i - STAGES read */
        d_empty += tick() - t_empty;
        const uint32_t dst = (kind ? v_s : k_s) + st * TILE;
        /* bench: no V copies (NO_V), none after the first STAGES tiles (NO_LOAD) */
        if (((AB & KVS_WG_AB_NO_V) != 0 && kind) || ((AB & KVS_WG_AB_NO_LOAD) != 0 && i >= STAGES)) {
            if (lane == 0) kvs_mbar_arrive(full);
            continue;
        }
        int n_box = 0, n_units = 0;
#pragma unroll
        for (int m = 0; m < MU; m++) {
            const int u = unit(w, m), e = k0 + 16 * u, blk = __shfl_sync(0xffffffffu, blk_cur, m);
            if (!owned(u)) continue;
            n_units++;
            if (e + 16 <= n_keys) {
                n_box++;
                continue;
            }
            /* keys at or past n_keys in it: 16 rows x 16 chunks by the warp, 8 a lane */
            const bf16 *unit_src = a.pool + (e < n_keys ? kvs_kv_offset(blk, kind, g, e % bs, a.n_kv_heads, bs, D) : 0);
#pragma unroll 1
            for (int v = 0; v < 8; v++) {
                const int q = lane + 32 * v, r = q / 16, c = q % 16;
                const bool ok = e + r < n_keys;
                kvs_cp_async16(dst + kvs_wg_swz_units(16 * u + r, c), ok ? unit_src + r * D + 8 * c : a.pool, ok);
            }
        }
        if (n_box < n_units) {
            kvs_cp_async_commit();
            kvs_cp_async_wait<0>();
            kvs_fence_proxy_async();
            __syncwarp();
        }
        if (lane == 0) kvs_mbar_arrive_tx(full, (uint32_t)n_box * UNIT); /* tx may complete first: no order needed */
        { /* the boxes: lane m < MU holds the paged block of the warp's unit m */
            const int u = unit(w, lane % MU), e = k0 + 16 * u;
            const int rg = rg_k + 2 * (blk_cur * bunits + (e % bs) / 16) + (kind ? rg_v : 0);
            if (lane < MU && owned(u) && e + 16 <= n_keys) kvs_tma_load_4d(dst + u * UNIT, map, rg, full);
        }
    }
    kvs_wg_diag_producer<AB>(pt, t_loop, d_empty, n_tiles);
}

/* ---- FP8 pools: the producer warpgroup's 128 threads convert codes -----------------
 * Half-tile j: tile j / 2's K (j even) or V codes, 128 keys x D bytes, 16-byte chunks
 * p = pt + 128 v (v < D / 16) for thread pt (0 .. 127): chunk p % (D / 16) of key
 * p / (D / 16), so the thread's key in round v is kt + KPV v (kt = pt / (D / 16), KPV
 * = 2048 / D keys a round) and its chunk c = pt % (D / 16) the same in every round. A
 * thread converts exactly the chunks it copied, so the raw tiles need no barrier
 * between the producer's threads. block_size is a multiple of 16
 * (kvs_cuda_wgmma_fits), so each 16-key group of a tile lies in one paged block, the
 * same for all 128 threads and for K and V: lane l < 8 of every producer warp looks up
 * group l's block one tile ahead and the copies take it by shuffle. */

/* Thread pt's chunks of a half-tile into raw tile `raw` (+ 16 pt) by cp.async, keys at
   or past n_keys (v with KPV v >= lim = n_keys - k0 - kt) zero-filled; src: the
   thread's byte in paged block 0 (K or V), unit: lane l's 16-key unit of group l (the
   block's 16-key units x block id + the group's unit in it; 0 past the keys), gl0:
   the lane of the thread's group in round 0. One commit group. */
template <int D>
__device__ __forceinline__ void kvs_wg_issue_codes8(const uint8_t *src, uint32_t unit, int gl0, int lim,
                                                    uint32_t raw) {
    constexpr int CH = D / 16, KPV = KVS_WG_BN / CH;
    asm("" : "+l"(src)); /* opaque: one IMAD.WIDE a chunk on it, not the pool base added after */
#pragma unroll
    for (int v = 0; v < CH; v++) {
        const uint32_t u = __shfl_sync(0xffffffffu, unit, gl0 + KPV / 16 * v);
        kvs_cp_async16(raw + 2048 * v, src + (size_t)u * (16 * D), KPV * v < lim);
    }
    kvs_cp_async_commit();
}

/* Two E4M3 codes as a bf16 pair, exactly for non-NaN codes (kvs_fp8x8_to_bf16x8 bit
   for bit): the prmt (selector s over the bytes of a, b) puts the low code at byte 1,
   its sign replicated into byte 2 and the high code at byte 3; shifted right by 4
   (arithmetic) each half holds its code's sign at bit 15 and the code's 7 other bits
   at bits 4-10 (the mask drops the rest: the 4 exponent bits at the bottom of bf16's
   8, the 3 mantissa bits at its top), which is the code's value x 2^-120 as a bf16
   (normal or subnormal: bf16's bias 127 = E4M3's 7 + 120), then one exact multiply
   by 2^120 a pair. A NaN code (0x7f, 0xff) comes out as +-480. 4 instructions a pair
   (PRMT, SHF, LOP3, HMUL2 with 2^120 as an immediate). */
__device__ __forceinline__ uint32_t kvs_wg_e4m3x2_to_bf16x2(uint32_t a, uint32_t b, uint32_t s) {
    uint32_t x;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(x) : "r"(a), "r"(b), "r"(s));
    const uint32_t bits = (uint32_t)((int32_t)x >> 4) & 0x87f087f0u, k = 0x7b807b80u; /* k: 2^120 twice */
    const __nv_bfloat162 r = __hmul2(*(const __nv_bfloat162 *)&bits, *(const __nv_bfloat162 *)&k);
    return *(const uint32_t *)&r;
}
/* The prmt selector of codes 0-1 (hi 0) or 2-3 (hi 1) of a word of a (b: 0) or of b
   (b: 1): byte 1 = the low code, byte 2 = its sign replicated, byte 3 = the high code. */
__device__ __forceinline__ uint32_t kvs_wg_sel8(int hi, int b) {
    const uint32_t i = 2 * hi + 4 * b;
    return i | i << 4 | (8 | i) << 8 | (i + 1) << 12;
}

/* Thread pt's chunks of raw tile `raw` (+ 16 pt; its copies, waited for) as bf16 into
   the stage tile, swizzled (kvs_wg_swz): 16 codes -> 2 bf16 chunks.
   The thread of chunk c writes the chunk at `first` (+ 128 KPV v: row kt + KPV v keeps
   its swizzle, kt % 8) before the one at `second`: chunk 2c, then 2c + 1, or for c >= 4
   (the second column block) 2c + 1 first, so the 8 threads of a row hit 8 different
   bank groups; sel: the prmt selectors of the first chunk (codes 0-1, 2-3 of words
   x, y, or z, w: kvs_wg_sel8), the second's are ^ 0x4444. Loads 4 chunks, then
   converts and stores them; one NaN test for all: a thread that met a NaN code does
   its chunks again the exact way (kvs_fp8x8_to_bf16x8), so NaN stays NaN. */
template <int D>
__device__ __forceinline__ void kvs_wg_convert8(uint32_t raw, uint32_t first, uint32_t second, uint32_t sel0,
                                                uint32_t sel1, bool odd_first) {
    constexpr int CH = D / 16, KPV = KVS_WG_BN / CH, B = CH < 4 ? CH : 4;
    uint32_t nan = 0; /* bit 7 of a byte: a NaN code (low 7 bits all ones: + 1 carries into bit 7 alone) */
#pragma unroll
    for (int v0 = 0; v0 < CH; v0 += B) {
        uint4 c[B];
#pragma unroll
        for (int u = 0; u < B; u++) c[u] = kvs_lds128(raw + 2048 * (v0 + u));
#pragma unroll
        for (int u = 0; u < B; u++) {
            const uint32_t m = 0x7f7f7f7fu, one = 0x01010101u;
            nan |= ((c[u].x & m) + one) | ((c[u].y & m) + one) | ((c[u].z & m) + one) | ((c[u].w & m) + one);
            const uint32_t s0 = sel0 ^ 0x4444u, s1 = sel1 ^ 0x4444u;
            const uint4 f = make_uint4(kvs_wg_e4m3x2_to_bf16x2(c[u].x, c[u].z, sel0),
                                       kvs_wg_e4m3x2_to_bf16x2(c[u].x, c[u].z, sel1),
                                       kvs_wg_e4m3x2_to_bf16x2(c[u].y, c[u].w, sel0),
                                       kvs_wg_e4m3x2_to_bf16x2(c[u].y, c[u].w, sel1));
            const uint4 s = make_uint4(kvs_wg_e4m3x2_to_bf16x2(c[u].x, c[u].z, s0),
                                       kvs_wg_e4m3x2_to_bf16x2(c[u].x, c[u].z, s1),
                                       kvs_wg_e4m3x2_to_bf16x2(c[u].y, c[u].w, s0),
                                       kvs_wg_e4m3x2_to_bf16x2(c[u].y, c[u].w, s1));
            kvs_sts128(first + 128 * KPV * (v0 + u), f);
            kvs_sts128(second + 128 * KPV * (v0 + u), s);
        }
    }
    if (nan & 0x80808080u) {
        const uint32_t lo = odd_first ? second : first, hi = odd_first ? first : second;
#pragma unroll 1
        for (int v = 0; v < CH; v++) {
            const uint4 c = kvs_lds128(raw + 2048 * v);
            kvs_sts128(lo + 128 * KPV * v, kvs_fp8x8_to_bf16x8(make_uint2(c.x, c.y)));
            kvs_sts128(hi + 128 * KPV * v, kvs_fp8x8_to_bf16x8(make_uint2(c.z, c.w)));
        }
    }
}

/* The FP8 producer, thread pt of the producer warpgroup, one work item: half-tiles
 * j = 0 .. 2 n_tiles - 1 in order, j's codes copied while j - 1's convert (raw tiles
 * j % 2 at raw, raw + RAW). For each: wait for its own copies, for the ring stage's
 * empty barrier (tile j / 2 - STAGES read), convert into stage (j / 2) % STAGES of
 * the K or V ring, fence to the async proxy and arrive on the stage's full barrier
 * (128 arrivals, no transaction bytes). Lane l < 8 holds group l's 16-key unit of the
 * tile being copied (unit) and the table entry of the next tile's (nb; -1 past the
 * keys), loaded one tile ahead; key 128 t + 16 l = bq block_size + br, advanced a
 * tile at a time without a division. */
template <int D, int STAGES>
__device__ __forceinline__ void kvs_wg_produce8(const kvs_attn_args &a, int g, int seq, int n_keys, int n_tiles,
                                                uint32_t k_s, uint32_t v_s, uint32_t raw, uint32_t bars, int pt) {
    constexpr int CH = D / 16;
    constexpr uint32_t TILE = (uint32_t)KVS_WG_BN * D * 2, RAW = (uint32_t)KVS_WG_BN * D;
    const int32_t *table = kvs_attn_table(a, seq);
    const int bs = a.block_size, lane = pt % 32, kt = pt / CH, c = pt % CH, gl0 = kt / 16;
    const uint8_t *src_k = kvs_attn_pool8(a) + kvs_kv_offset(0, 0, g, kt % 16, a.n_kv_heads, bs, D) + 16 * c;
    const uint8_t *src_v = src_k + (size_t)a.n_kv_heads * bs * D;
    const uint32_t bunits = 2u * a.n_kv_heads * (bs / 16); /* 16-key units a paged block */
    const int tq = KVS_WG_BN / bs, tr = KVS_WG_BN % bs;
    int bq = 16 * lane / bs, br = 16 * lane % bs, nb, nr, t_next = 0;
    auto fetch = [&]() { /* lane's group of tile t_next, then the tile after it */
        nb = lane < 8 && KVS_WG_BN * t_next + 16 * lane < n_keys ? table[bq] : -1, nr = br / 16;
        bq += tq, br += tr, t_next++;
        if (br >= bs) br -= bs, bq++;
    };
    auto unit_of = [&]() -> uint32_t { return nb < 0 ? 0u : (uint32_t)nb * bunits + (uint32_t)nr; };
    fetch();
    uint32_t unit = unit_of();
    fetch();
    /* the stage tile's chunks of row kt (its swizzle holds for kt + KPV v) */
    const int odd_first = (c >> 2) & 1;
    const uint32_t first = kvs_wg_swz(KVS_WG_BN, kt, 2 * c + odd_first);
    const uint32_t second = kvs_wg_swz(KVS_WG_BN, kt, 2 * c + 1 - odd_first);
    const uint32_t sel0 = kvs_wg_sel8(0, odd_first), sel1 = kvs_wg_sel8(1, odd_first);
    const uint32_t raw_t = raw + 16 * pt;
    kvs_wg_issue_codes8<D>(src_k, unit, gl0, n_keys - kt, raw_t);
    for (int j = 0; j < 2 * n_tiles; j++) {
        if (j + 1 < 2 * n_tiles) {
            const int kind = (j + 1) & 1, t = (j + 1) >> 1;
            if (!kind) unit = unit_of(), fetch(); /* tile t's groups; tile t + 1's entries on the way */
            kvs_wg_issue_codes8<D>(kind ? src_v : src_k, unit, gl0, n_keys - KVS_WG_BN * t - kt,
                                   raw_t + ((j + 1) & 1) * RAW);
        } else kvs_cp_async_commit(); /* an empty group: the wait below leaves one in flight */
        kvs_cp_async_wait<1>();        /* half-tile j's copies landed */
        const int i = j >> 1, kind = j & 1, st = i % STAGES;
        const uint32_t full = bars + 8 * (kind * STAGES + st), empty = full + 16 * STAGES;
        if (i >= STAGES) kvs_mbar_wait(empty, ((i / STAGES) & 1) ^ 1); /* tile i - STAGES read */
        const uint32_t dst = (kind ? v_s : k_s) + st * TILE;
        kvs_wg_convert8<D>(raw_t + (j & 1) * RAW, dst + first, dst + second, sel0, sel1, odd_first);
        kvs_fence_proxy_async();
        kvs_mbar_arrive(full);
    }
}
#endif

/* The kernel (docs/CUDA.md "Hopper prefill kernel (wgmma)"). CTA w runs work item w
 * (n_heads / HEADS x ny x n_seqs of them): HEADS query heads (head group
 * w % (n_heads / HEADS)) x 128 / HEADS positions (q-block ny - 1 - the next index: the
 * heaviest first) of sequence w / (n_heads / HEADS x ny), the order the hardware
 * launches a grid of that shape in. 12 warps. Needs scale > 0 (the row max is taken
 * over raw scores). FP8: the pool holds E4M3 codes, which the producer warpgroup's
 * four warps copy and convert (kvs_wg_produce8); the K scale is folded into the
 * softmax scale, the V scale into 1 / l. AB:
 * a bench variant (KVS_WG_AB_*, cuda_internal.h; 0 everywhere but kvs_bench_kernels
 * ablate). */
template <int D, int HEADS, bool FP8, int AB = 0>
__global__ void __launch_bounds__(KVS_WG_THREADS, 1)
    kvs_attn_wgmma_kernel(const __grid_constant__ CUtensorMap kv_map, kvs_attn_args a, bf16 *out, float *lse, int ny) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using C = kvs_wg_cfg<D, FP8, AB>;
    using L = typename C::L;
    /* bf16 d128: K/V by TMA boxes of 16-key units (kvs_wg_produce_tma) into 176-key
       tiles laid out by units (kvs_wg_swz_units); else (and bench CP_ASYNC) by cp.async */
    constexpr bool tma = C::tma;
    constexpr int BM = KVS_WG_BM, BN = C::BN, STAGES = C::STAGES, MH = BM / HEADS;
    static_assert(D == 64 || D == 128, "head_dim 64 or 128");
    static_assert(BN == KVS_WG_BN || tma, "other tile widths by TMA only");
    static_assert(STAGES >= 2, "two stages at least");
    extern __shared__ unsigned char kvs_wg_smem_raw[];
    const uint32_t base = (kvs_smem_u32(kvs_wg_smem_raw) + 1023u) & ~1023u;
    const uint32_t q_s = base + (uint32_t)L::q, k_s = base + (uint32_t)L::k, v_s = base + (uint32_t)L::v;
    /* mbarriers at bars + 8 x: [0, STAGES) K full, [STAGES, 2 STAGES) V full (the
       producer warpgroup's 128 threads), then K empty, V empty (the 8 consumer warps) */
    const uint32_t bars = base + (uint32_t)L::bar, full_k = bars, full_v = bars + 8 * STAGES;
    const uint32_t empty_k = bars + 16 * STAGES, empty_v = bars + 24 * STAGES;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x == 0) {
        for (int st = 0; st < 2 * STAGES; st++) kvs_mbar_init(bars + 8 * st, tma ? 4 : 128);
        for (int st = 2 * STAGES; st < 4 * STAGES; st++) kvs_mbar_init(bars + 8 * st, 8);
        kvs_mbar_init_fence();
    }
    __syncthreads();
    auto tick = kvs_wg_tick<AB>;
    [[maybe_unused]] long long t_cta = tick(), ns_cta = 0;
    if constexpr ((AB & KVS_WG_AB_DIAG) != 0) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns_cta));
    const kvs_wg_block<HEADS, BN> blk(a, blockIdx.x, ny);
    if (blk.q0 >= blk.q_len) return; /* no row (a q-block past a short sequence's q_len) */

    if (warp >= 8) { /* the producer warpgroup */
        kvs_setmaxnreg_dec<KVS_WG_PRODUCER_REGS>();
        if (FP8)
            kvs_wg_produce8<D, STAGES>(a, blk.g, blk.seq, blk.n_keys, blk.n_tiles, k_s, v_s, base + (uint32_t)L::raw,
                                       bars, threadIdx.x - 256);
        else if constexpr (tma)
            kvs_wg_produce_tma<D, STAGES, AB, BN>(&kv_map, a, blk.g, blk.seq, blk.n_keys, blk.n_tiles, k_s, v_s, bars,
                                          threadIdx.x - 256);
        else
            kvs_wg_produce<D, STAGES, AB>(a, blk.g, blk.seq, blk.n_keys, blk.n_tiles, k_s, v_s, bars, threadIdx.x - 256);
        return;
    }
    kvs_setmaxnreg_inc<KVS_WG_CONSUMER_REGS>();

    /* ---- consumers: warpgroup wg owns block rows 64 wg .. 64 wg + 63 ---- */
    const int wg = warp / 4;
    const int R0 = 64 * wg + 16 * (warp % 4) + lane / 4; /* this thread's rows R0 and R0 + 8 (one head) */
    const float scale_log2 = a.scale * KVS_LOG2E * (FP8 ? kvs_kv_scale(a.scales, 0, blk.g, a.n_kv_heads) : 1.f);
    const uint32_t q_wg = q_s + (uint32_t)wg * 64 * 128;
    const int h0 = blk.h0, q0 = blk.q0, t0 = blk.t0, q_len = blk.q_len;
    const int past = blk.past, n_tiles = blk.n_tiles; /* query i sees keys 0 .. past + i */
    kvs_wg_load_q<D, HEADS>(a, q_s, wg, h0, q0, t0, q_len);

    const int lim0 = past + q0 + R0 % MH;                /* the last key row R0 sees (R0 + 8: lim0 + 8) */
    /* the warpgroup's positions: [wg_first, wg_first + min(MH, 64)) */
    const int wg_first = q0 + (HEADS == 1 ? 64 * wg : 0);
    /* keys past it: no live row of the warpgroup sees them (-1: no live row) */
    const int wg_last_key = wg_first < q_len ? past + min(wg_first + (MH < 64 ? MH : 64), q_len) - 1 : -1;
    const int wg_full_key = past + wg_first; /* every row sees keys up to it */
    const int n_live = wg_last_key < 0 ? 0 : wg_last_key / BN + 1; /* tiles 0 .. n_live - 1 hold keys of its rows */

    float o[D / 2], s[BN / 2];
#pragma unroll
    for (int i = 0; i < D / 2; i++) o[i] = 0.f;
#pragma unroll
    for (int i = 0; i < BN / 2; i++) s[i] = 0.f;
    uint32_t pa[BN / 16][4]; /* P as the A fragments of k16 step kk: keys 16 kk .. 16 kk + 15 */
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

    long long d_full = 0, d_ws = 0, d_sm = 0, d_wpv = 0, d_tail = 0; /* DIAG */
    auto wait_full = [&](uint32_t full, int i) {
        const long long t0 = tick();
        kvs_mbar_wait(full + 8 * (i % STAGES), (i / STAGES) & 1);
        d_full += tick() - t0;
    };
    /* this warp's wgmma's reading tile i's stage completed: hand it back, fenced (the
       producer writes the stage next through the generic proxy: cp.async, FP8's stores) */
    auto release = [&](uint32_t empty, int i) {
        kvs_fence_proxy_async();
        __syncwarp();
        if (lane == 0) kvs_mbar_arrive(empty + 8 * (i % STAGES));
    };
    auto gemm_s = [&](int i) { /* S = Q K_i^T: one commit group */
        const uint32_t k_st = k_s + (uint32_t)((i % STAGES) * L::TILE);
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) { /* K's column block kk / 4: tiles by units (TMA) or [column block][rows] */
            const uint64_t k_desc = tma ? kvs_wg_desc(k_st + (kk / 4) * 1024 + (kk % 4) * 32, 16, 2048)
                                        : kvs_wg_desc(k_st + (kk / 4) * (BN * 128) + (kk % 4) * 32, 16);
            kvs_wgmma_ss<BN>(s, kvs_wg_desc(q_wg + (kk / 4) * (BM * 128) + (kk % 4) * 32, 16), k_desc, kk > 0);
        }
        kvs_wgmma_commit();
    };
    auto gemm_pv = [&](int i) { /* O += P V_i: one commit group */
        const uint32_t v_st = v_s + (uint32_t)((i % STAGES) * L::TILE);
#pragma unroll
        for (int kk = 0; kk < BN / 16; kk++) {
            if constexpr (tma) kvs_wgmma_rs<D>(o, pa[kk], kvs_wg_desc(v_st + kk * 4096, 1024, 2048), 1);
            else kvs_wgmma_rs<D>(o, pa[kk], kvs_wg_desc(v_st + kk * 16 * 128, BN * 128), 1);
        }
        kvs_wgmma_commit();
    };

    /* online softmax of S = tile i's scores, in place (log2 domain, m over scaled
       scores): s becomes the probabilities; alpha: O's factors; returns whether a
       row max changed */
    auto softmax = [&](int i, float &alpha0, float &alpha1) -> bool {
        if constexpr ((AB & KVS_WG_AB_NO_SOFTMAX) != 0) { /* bench: P = S */
            alpha0 = alpha1 = 1.f;
            return false;
        }
        /* bench NO_EXP: the probabilities without their ex2 */
        auto ex = [](float x) { return (AB & KVS_WG_AB_NO_EXP) != 0 ? x : kvs_exp2(x); };
        float mx0, mx1; /* mask where the tile crosses some row's diagonal */
        kvs_wg_row_max<BN>(s, i * BN, i * BN + BN - 1 > wg_full_key, lim0, scale_log2, mx0, mx1);
        /* a row's max moves only where the tile's exceeds it by more than 8 (log2):
           probabilities up to 2^8, and O's rescale all but gone after the first tiles
           (FlashAttention-4's threshold; -inf: the first tile a row sees sets it) */
        const float mn0 = mx0 > m0 + 8.f ? mx0 : m0, mn1 = mx1 > m1 + 8.f ? mx1 : m1;
        const float mu0 = mn0 == -INFINITY ? 0.f : mn0, mu1 = mn1 == -INFINITY ? 0.f : mn1;
        alpha0 = kvs_exp2(m0 - mu0), alpha1 = kvs_exp2(m1 - mu1);
        const bool grew = mn0 != m0 || mn1 != m1;
        m0 = mn0, m1 = mn1;
        float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
        for (int j = 0; j < BN / 8; j++) {
            s[4 * j] = ex(fmaf(s[4 * j], scale_log2, -mu0));
            s[4 * j + 1] = ex(fmaf(s[4 * j + 1], scale_log2, -mu0));
            s[4 * j + 2] = ex(fmaf(s[4 * j + 2], scale_log2, -mu1));
            s[4 * j + 3] = ex(fmaf(s[4 * j + 3], scale_log2, -mu1));
            sum0 += s[4 * j] + s[4 * j + 1];
            sum1 += s[4 * j + 2] + s[4 * j + 3];
        }
        l0 = l0 * alpha0 + sum0;
        l1 = l1 * alpha1 + sum1;
        return grew;
    };
    auto pack_p = [&]() { /* the probabilities as P's A fragments (once P V of the last tile is done) */
#pragma unroll
        for (int j = 0; j < BN / 8; j++) {
            pa[j / 2][(j & 1) * 2] = kvs_pack_bf16(s[4 * j], s[4 * j + 1]);         /* row lane/4, keys 8 j + 2 (lane % 4) */
            pa[j / 2][(j & 1) * 2 + 1] = kvs_pack_bf16(s[4 * j + 2], s[4 * j + 3]); /* row lane/4 + 8 */
        }
    };
    /* O x the factors of a tile's softmax, skipped when no row max of the warp grew */
    auto rescale_o = [&](bool grew, float alpha0, float alpha1) {
        if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
            for (int j = 0; j < D / 8; j++) {
                o[4 * j] *= alpha0, o[4 * j + 1] *= alpha0;
                o[4 * j + 2] *= alpha1, o[4 * j + 3] *= alpha1;
            }
        }
    };
    /* FlashAttention-3's order: O (tiles up to i - 2) is rescaled by tile i - 1's
       factors after the S_i issue and before the P_{i-1} V_{i-1} issue (a second
       wgmma.fence: the P V wgmma reads O), the last tile's before its P V after the
       loop; after the S wait: the K release, (in the SASS) the P V wait and the V
       release, the softmax, the P pack. (Rescaling after the P V wait instead: the
       same arithmetic, 1.0-1.02x the time, session 16.)
       With 2 or 4 heads a block, FlashAttention-3's warp-scheduler barriers too: the
       warpgroups issue their GEMMs in turn (a round: tile 0's S; tile i's S with tile
       i - 1's P V; the last tile's P V): warpgroup wg waits on named barrier 3 + wg
       before its round's issue and arrives on the other's after it, so one's softmax
       runs while the other's GEMMs hold the tensor cores. Both warpgroups run the same
       rounds (n_live + 1: they hold the same positions); warpgroup 1 lets 0 go first
       and skips its last arrival (nobody waits for it), so every barrier ends
       balanced. 1 head a block (the warpgroups' positions and rounds differ): no turns.
       Measured together with the producer's two half-tiles in flight: 0.97-0.99x the
       time of neither (docs/CUDA.md "Where a tile's time goes"). */
    constexpr bool pp = HEADS >= 2;
    auto turn_begin = [&]() {
        if constexpr (pp) kvs_named_sync(3 + wg, 256);
    };
    auto turn_end = [&](bool last) {
        if constexpr (pp) {
            if (!last || wg == 0) kvs_named_arrive(4 - wg, 256);
        }
    };
    const long long t_loop = tick();
    long long n_iter = 0;
    if (n_live > 0) {
        float alpha0, alpha1;
        bool grew_prev = false; /* tile i - 1's softmax grew a max (tile 0: O is 0) */
        if (pp && wg == 1) kvs_named_arrive(3, 256); /* warpgroup 0's first turn */
        wait_full(full_k, 0);
        turn_begin();
        kvs_wgmma_fence();
        gemm_s(0);
        turn_end(false);
        kvs_wgmma_wait<0>();
        kvs_wg_fence_regs(s);
        release(empty_k, 0);
        softmax(0, alpha0, alpha1); /* O is 0: nothing to rescale */
        pack_p();
        for (int i = 1; i < n_live; i++) {
            wait_full(full_k, i);
            wait_full(full_v, i - 1);
            turn_begin();
            kvs_wgmma_fence();
            gemm_s(i);
            rescale_o(grew_prev, alpha0, alpha1); /* tile i - 1's factors */
            kvs_wgmma_fence();
            gemm_pv(i - 1);
            turn_end(false);
            const long long t0 = tick();
            kvs_wgmma_wait<1>(); /* S done; P V of i - 1 still running */
            kvs_wg_fence_regs(s);
            d_ws += tick() - t0;
            /* K_i released as soon as S_i is done. ptxas hoists the P V wait and the
               V_{i-1} release above the softmax (up to the K release's memory
               operations; the SASS: wait_group 0 and its fence right after the K
               release's), so the softmax of tile i runs after P V of i - 1, while the
               other warpgroup's GEMMs hold the tensor cores. The softmax under this
               warpgroup's own P V (K_i released after it, its arrival made
               data-dependent on the row sums to pin the wait below all 64 ex2: the
               order before 2026-12-04) measured 1.015-1.05x this order's time in
               three calls; the wait written before the softmax schedules the softmax
               differently (not measured better): docs/CUDA.md "Session 18" */
            release(empty_k, i);
            const long long t1 = tick();
            const bool grew = softmax(i, alpha0, alpha1);
            d_sm += tick() - t1;
            const long long t = tick();
            kvs_wgmma_wait<0>();
            kvs_wg_fence_regs(o);
            d_wpv += tick() - t;
            d_tail -= tick();
            release(empty_v, i - 1);
            grew_prev = grew;
            pack_p();
            d_tail += tick(), n_iter++;
        }
        wait_full(full_v, n_live - 1);
        rescale_o(grew_prev, alpha0, alpha1); /* the last tile's factors */
        turn_begin();
        kvs_wgmma_fence();
        gemm_pv(n_live - 1);
        turn_end(true);
        kvs_wgmma_wait<0>();
        kvs_wg_fence_regs(o);
        release(empty_v, n_live - 1);
    }
    for (int i = n_live; i < n_tiles; i++) { /* tiles past the warpgroup's keys (1 head a block): releases */
        wait_full(full_k, i);
        release(empty_k, i);
        wait_full(full_v, i);
        release(empty_v, i);
    }

    [[maybe_unused]] const long long d_loop = tick() - t_loop;

    if (wg_last_key >= 0) {
        const float v_scale = FP8 ? kvs_kv_scale(a.scales, 1, blk.g, a.n_kv_heads) : 1.f;
        kvs_wg_store<D, HEADS>(a, out, lse, o, l0, l1, m0, m1, v_scale, R0, h0, q0, t0, q_len);
    }
    if constexpr ((AB & KVS_WG_AB_DIAG) != 0) {
        if (warp % 4 == 0 && lane == 0) { /* one thread a consumer warpgroup */
            const long long d[] = {d_loop, d_full, d_ws, d_sm, d_wpv, d_tail, n_iter, 1};
            for (int k = 0; k <= KVS_WG_DIAG_WGS; k++) atomicAdd(&kvs_wg_diag[k], (unsigned long long)d[k]);
        }
        if (threadIdx.x == 0) {
            long long ns;
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
            atomicAdd(&kvs_wg_diag[KVS_WG_DIAG_CTA_CYCLES], (unsigned long long)(tick() - t_cta));
            atomicAdd(&kvs_wg_diag[KVS_WG_DIAG_CTA_NS], (unsigned long long)(ns - ns_cta));
            atomicAdd(&kvs_wg_diag[KVS_WG_DIAG_CTAS], 1ull);
        }
    }
#else
    __trap(); /* not built for sm_90a: kvs_cuda_wgmma_supported refuses such devices */
#endif
}

/* ---- host ------------------------------------------------------------------------ */

const char *kvs_cuda_wgmma_supported(int device) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
        cudaGetLastError();
        return "cannot query the compute capability";
    }
    if (major != 9 || minor != 0) return "needs compute capability 9.0 (Hopper wgmma)";
    int built = 0;
    if (cudaMemcpyFromSymbol(&built, kvs_wgmma_built, sizeof built) != cudaSuccess) {
        cudaGetLastError();
        return "cannot read the kernel's build flag";
    }
    if (!built) return "this build has no sm_90a code (CMAKE_CUDA_ARCHITECTURES must include 90a)";
    return NULL;
}

bool kvs_cuda_wgmma_fits(int head_dim, int block_size, float scale) {
    return (head_dim == 64 || head_dim == 128) && block_size % 16 == 0 && scale > 0.f;
}

/* ---- bench-only variants (kvs_cuda.wgmma_variant: KVS_WG_AB_* masks; docs/CUDA.md
 * "Where a tile's time goes"): instantiated for bf16 d128 with 4 heads a block only */
void kvs_cuda_wgmma_diag_reset(void) {
    static const unsigned long long zero[KVS_WG_DIAG_N] = {0};
    cudaMemcpyToSymbol(kvs_wg_diag, zero, sizeof zero);
}
void kvs_cuda_wgmma_diag_read(unsigned long long out[KVS_WG_DIAG_N]) {
    cudaMemcpyFromSymbol(out, kvs_wg_diag, sizeof(unsigned long long) * KVS_WG_DIAG_N);
}
typedef void (*kvs_wg_kernel_fn)(const CUtensorMap, kvs_attn_args, bf16 *, float *, int);

/* cuTensorMapEncodeTiled through the runtime's driver entry point (no link dependency
 * on libcuda); NULL where the driver has none. */
static PFN_cuTensorMapEncodeTiled_v12000 kvs_encode_tiled(void) {
    static PFN_cuTensorMapEncodeTiled_v12000 fn;
    static bool tried;
    if (!tried) {
        void *p = NULL;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q) ==
                cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            fn = (PFN_cuTensorMapEncodeTiled_v12000)p;
        else
            cudaGetLastError();
        tried = true;
    }
    return fn;
}

/* The bf16 d128 kernel's TMA view of the pool: 4D {64 columns, 8 rows, 2 column
 * blocks, 8-row groups} (groups = the pool's rows / 8: n_blocks x 2 x n_kv_heads x
 * block_size / 8), strides 256 B (a row), 128 B (a column block), 2 KiB (a row group),
 * boxes {64, 8, 2, 2} (a 16-key unit) with the 128-byte swizzle. Encoded once a pool and
 * cached in the backend; false (warned once) where it cannot be made: the kernel then
 * copies by cp.async (KVS_WG_AB_CP_ASYNC). */
static bool kvs_wg_unit_map(kvs_backend *b, const kvs_attn_args &a, CUtensorMap *map) {
    static_assert(sizeof(CUtensorMap) == sizeof(((kvs_cuda *)0)->wgmma_map), "the cached map's size");
    kvs_cuda *c = kvs_cuda_of(b);
    const int64_t groups = a.pool_blocks * 2 * a.n_kv_heads * a.block_size / 8;
    if (c->wgmma_map_ok && c->wgmma_map_pool == a.pool && c->wgmma_map_groups == groups) {
        memcpy(map, c->wgmma_map, sizeof *map);
        return true;
    }
    PFN_cuTensorMapEncodeTiled_v12000 encode = kvs_encode_tiled();
    const char *why = NULL;
    if (!encode) why = "the driver has no cuTensorMapEncodeTiled";
    else if (groups <= 0 || groups > INT32_MAX) why = "the pool has more 8-row groups than TMA's int32 coordinates reach";
    if (!why) {
        const cuuint64_t dims[4] = {64, 8, 2, (cuuint64_t)groups}, strides[3] = {256, 128, 2048};
        const cuuint32_t box[4] = {64, 8, 2, 2}, unit[4] = {1, 1, 1, 1};
        if (encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, (void *)a.pool, dims, strides, box, unit,
                   CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                   CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
            why = "cuTensorMapEncodeTiled failed";
    }
    if (why) {
        if (!c->wgmma_map_warned) kvs_log(KVS_LOG_WARN, "cuda: the WGMMA prefill copies K/V by cp.async, not TMA: %s", why);
        c->wgmma_map_warned = 1;
        return false;
    }
    memcpy(c->wgmma_map, map, sizeof *map);
    c->wgmma_map_pool = a.pool, c->wgmma_map_groups = groups, c->wgmma_map_ok = 1;
    return true;
}
/* a compiled kernel and its dynamic shared memory */
struct kvs_wg_kernel {
    kvs_wg_kernel_fn fn;
    size_t smem;
};
template <int D, int HEADS, bool FP8, int AB>
static kvs_wg_kernel kvs_wg_pick() {
    return {kvs_attn_wgmma_kernel<D, HEADS, FP8, AB>, kvs_wg_cfg<D, FP8, AB>::L::bytes};
}
/* the variant's kernel ({NULL, 0} for a mask not compiled) */
template <int D, int HEADS, bool FP8>
static kvs_wg_kernel kvs_wg_variant(int ab) {
    if constexpr (D == 128 && !FP8) { /* every head count: the fallback without a tensor map */
        if (ab == KVS_WG_AB_CP_ASYNC) return kvs_wg_pick<D, HEADS, FP8, KVS_WG_AB_CP_ASYNC>();
    }
    if constexpr (D == 128 && HEADS == 4 && !FP8) {
        enum { V = KVS_WG_AB_NO_V, NL = KVS_WG_AB_NO_LOAD, NE = KVS_WG_AB_NO_EXP, NS = KVS_WG_AB_NO_SOFTMAX,
               DG = KVS_WG_AB_DIAG, CP = KVS_WG_AB_CP_ASYNC };
        switch (ab) {
        case V: return kvs_wg_pick<D, HEADS, FP8, V>();
        case NL: return kvs_wg_pick<D, HEADS, FP8, NL>();
        case NE: return kvs_wg_pick<D, HEADS, FP8, NE>();
        case NS: return kvs_wg_pick<D, HEADS, FP8, NS>();
        case NL | NS: return kvs_wg_pick<D, HEADS, FP8, NL | NS>();
        case DG: return kvs_wg_pick<D, HEADS, FP8, DG>();
        case CP | DG: return kvs_wg_pick<D, HEADS, FP8, CP | DG>();
        case CP | NL: return kvs_wg_pick<D, HEADS, FP8, CP | NL>();
        default: return {NULL, 0};
        }
    }
    (void)ab;
    return {NULL, 0};
}

template <int D, int HEADS, bool FP8>
static void launch_wgmma(kvs_backend *b, const kvs_attn_args &a, bf16 *out, float *lse, int max_q_len) {
    kvs_cuda *c = kvs_cuda_of(b);
    kvs_wg_kernel k = kvs_wg_pick<D, HEADS, FP8, 0>();
    const kvs_wg_kernel variant = c->wgmma_variant ? kvs_wg_variant<D, HEADS, FP8>(c->wgmma_variant) : kvs_wg_kernel{};
    const int ab = variant.fn ? c->wgmma_variant : 0; /* the mask that runs (0: the default) */
    if (variant.fn) k = variant;
    CUtensorMap map;
    memset(&map, 0, sizeof map);
    if (D == 128 && !FP8 && !(ab & KVS_WG_AB_CP_ASYNC) && !kvs_wg_unit_map(b, a, &map)) /* TMA without a map: */
        k = kvs_wg_variant<D, HEADS, FP8>(KVS_WG_AB_CP_ASYNC);                               /* cp.async */
    constexpr int MH = KVS_WG_BM / HEADS;
    KVS_CUDA_CHECK(b, cudaFuncSetAttribute(k.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)k.smem));
    /* work items (head groups x q-blocks x sequences): a CTA each */
    const int ny = (max_q_len + MH - 1) / MH;
    const int64_t grid = (int64_t)(a.n_heads / HEADS) * ny * a.n_seqs;
    if (grid <= 0) return;
    k.fn<<<(unsigned)grid, KVS_WG_THREADS, k.smem, c->stream>>>(map, a, out, lse, ny);
    KVS_CUDA_LAUNCHED(b, "kvs_attn_wgmma_kernel");
}

template <int D, bool FP8>
static void launch_wgmma_group(kvs_backend *b, const kvs_attn_args &a, bf16 *out, float *lse, int max_q_len) {
    const int group = a.n_heads / a.n_kv_heads;
    if (group % 4 == 0) launch_wgmma<D, 4, FP8>(b, a, out, lse, max_q_len);
    else if (group % 2 == 0) launch_wgmma<D, 2, FP8>(b, a, out, lse, max_q_len);
    else launch_wgmma<D, 1, FP8>(b, a, out, lse, max_q_len);
}

/* the most a block of the kernel takes (bf16 d128: the cp.async fallback's 225 KiB, over
   the default's 209) */
size_t kvs_cuda_wgmma_smem_bytes(int head_dim, bool fp8) {
    constexpr size_t bf16_128 = kvs_wg_cfg<128, false, 0>::L::bytes,
                     bf16_128_cp = kvs_wg_cfg<128, false, KVS_WG_AB_CP_ASYNC>::L::bytes;
    if (head_dim == 128) return fp8 ? kvs_wg_cfg<128, true, 0>::L::bytes : (bf16_128 > bf16_128_cp ? bf16_128 : bf16_128_cp);
    if (head_dim == 64) return fp8 ? kvs_wg_cfg<64, true, 0>::L::bytes : kvs_wg_cfg<64, false, 0>::L::bytes;
    return 0;
}

void kvs_cuda_prefill_wgmma(kvs_backend *b, const kvs_attn_args &a, bf16 *out, float *lse, int head_dim,
                            int max_q_len, bool fp8) {
    if (head_dim == 128 && fp8) launch_wgmma_group<128, true>(b, a, out, lse, max_q_len);
    else if (head_dim == 128) launch_wgmma_group<128, false>(b, a, out, lse, max_q_len);
    else if (head_dim == 64 && fp8) launch_wgmma_group<64, true>(b, a, out, lse, max_q_len);
    else if (head_dim == 64) launch_wgmma_group<64, false>(b, a, out, lse, max_q_len);
    else kvs_cuda_report(b, "attention", "the wgmma prefill kernel takes head_dim 64 or 128", __FILE__, __LINE__);
}
