/* backend: one ops interface over memory the backend owns (host memory for
 * cpu/, device memory for cuda/). The model and the kv module call only these
 * ops, so the forward pass is the same code for every backend.
 *
 * Conventions: matrices are row-major. Activations and weights use the
 * backend's dtypes (act_dtype, weight_dtype); the KV pool uses kv_dtype.
 * Index arrays (ids, positions, slots, block tables, lengths) live in backend
 * memory too: upload them with to_device. A negative slot in kv_write and a
 * negative dst row in window_capture mean "skip this row" (the padding rows of
 * a graph-bucketed batch). */
#ifndef KVS_BACKEND_H
#define KVS_BACKEND_H

#include "core/core.h"

/* The paged KV pool: n_blocks blocks; a block holds block_size tokens of one
 * layer, laid out [2 (K, V)][n_kv_heads][block_size][head_dim], entries of the
 * backend's kv_dtype.
 *
 * FP8 pools (kv_dtype KVS_F8_E4M3, --kv-cache-dtype fp8): an entry x of K or V
 * head g is stored as the code e4m3(x / s) (kvs_f32_to_e4m3 of the IEEE f32
 * quotient) and read as kvs_e4m3_to_f32(code) * s, with s = scales[g] for K and
 * scales[n_kv_heads + g] for V: a scale per (layer, KV head), so the pool the
 * model passes to an op is one layer's view (kvs_kv_layer_pool: the same data,
 * that layer's scales). scales: f32 in backend memory, NULL = every scale 1.
 * kv_write, rope_kv_write, attention and sparsity_scores apply them; kv_gather
 * copies codes. Pools of other dtypes ignore scales. */
typedef struct {
    void *data;
    int64_t n_blocks;
    int block_size, n_kv_heads, head_dim;
    const float *scales; /* FP8 pools: [2][n_kv_heads] (K's, then V's) of one layer; NULL: 1 */
} kvs_kv_pool;

/* One layer's view of a batch for attention, all arrays in backend memory.
 * Sequence s has q_len[s] = q_start[s+1] - q_start[s] new query tokens, whose
 * K/V were already written at entries kv_len[s] - q_len[s] .. kv_len[s] - 1 of
 * its table; query i of s attends to entries 0 .. kv_len[s] - q_len[s] + i
 * (causal within the chunk). Entry e of s is in block
 * block_tables[r * max_blocks + e / block_size] at offset e % block_size, where
 * r = table_rows[s] (r = s when table_rows is NULL). max_kv_len bounds kv_len
 * (it sizes the kernels' grids); a table is read only below
 * ceil(kv_len[s] / block_size). */
typedef struct {
    int n_seqs, n_tokens, max_blocks, max_q_len, max_kv_len;
    const int32_t *q_start;      /* [n_seqs + 1] */
    const int32_t *kv_len;       /* [n_seqs] */
    const int32_t *block_tables; /* [rows * max_blocks] */
    const int32_t *table_rows;   /* [n_seqs]: each sequence's row of block_tables; NULL: row s */
    /* sliding window (0: none): a query sees its own entry and the window - 1
       entries before it, not those further back (the layer's entries are then
       consecutive positions: kv/kv.h's window layers) */
    int window;
    /* the first n_decode sequences have one query each (q_start[s] = s for
       s <= n_decode): a mixed step's decodes, which a backend may run apart
       from the prefill chunks (the CUDA decode kernel); 0: none said */
    int n_decode;
} kvs_attn_batch;

/* Sequence s's block table (for backends whose memory the host reads). */
static inline const int32_t *kvs_attn_table(const kvs_attn_batch *ab, int s) {
    return ab->block_tables + (size_t)(ab->table_rows ? ab->table_rows[s] : s) * ab->max_blocks;
}

/* One (sequence, layer) pair of snapkv_compact_batch: its SnapKV scores,
 * selection and compaction, exactly as sparsity_scores, snapkv_select and
 * kv_gather would do them for that pair alone: in place (dst == blocks), or,
 * with dst_blocks > 0, into the table at dst_table (a compacted copy of a
 * table it does not own alone, e.g. a prompt the prefix cache holds). Offsets
 * index the batch's arrays (kvs_snapkv_batch); pointers are backend memory. */
typedef struct {
    const void *win_q;    /* its window queries [n_win][n_heads][head_dim] (act_dtype) */
    const float *win_lse; /* [n_win][n_heads] */
    const float *scales;  /* its layer's FP8 scales (kvs_kv_pool.scales); NULL: 1 */
    int64_t scores;       /* its scores [n_kv_heads][n_keys] at batch.scores + scores */
    int64_t keep;         /* its keep lists [n_kv_heads][k + n_win] at batch.keep + keep */
    int32_t table;        /* its block table: batch.tables[table .. table + n_blocks) */
    int32_t n_blocks;
    int32_t n_keys;       /* entries scored and selected from: [0, n_keys); the window follows */
    int32_t n_win, k;     /* window queries (= window entries kept), entries kept before it (k <= n_keys) */
    int32_t pool;         /* max-pool kernel of its selection */
    int32_t dst_table, dst_blocks; /* its copy's table: batch.tables[dst_table .. + dst_blocks); 0 blocks: in place */
} kvs_snapkv_job;

/* A list of pairs for one snapkv_compact_batch call. The pairs' tables hold
 * blocks of no other pair (compaction writes them). jobs, tables, scores and
 * keep are backend memory; the bounds are host values (the CUDA launch is
 * sized by them). */
typedef struct {
    int n_jobs;
    int n_heads;  /* query heads (a multiple of the pool's n_kv_heads) */
    float scale;  /* the attention scale, 1 / sqrt(head_dim) */
    const kvs_snapkv_job *jobs; /* [n_jobs] */
    const int32_t *tables;
    float *scores;              /* [scores_len] */
    int32_t *keep;
    int max_keys;       /* the largest n_keys of the jobs */
    int64_t scores_len; /* the scores' extent: at least every job's scores + n_kv_heads * n_keys */
} kvs_snapkv_batch;

typedef struct kvs_backend kvs_backend;
struct kvs_sample_row; /* backend/sample.h */
struct kvs_sample_part; /* backend/sample.h */
struct kvs_process_row;  /* backend/sample.h */
struct kvs_logit_adjust; /* backend/sample.h */
struct kvs_backend {
    const char *name;
    kvs_dtype weight_dtype, act_dtype, kv_dtype;
    void *impl;
    /* Uploads from host_alloc buffers are numbered as they are enqueued
     * (kvs_turn_sent: n_sent); n_done is the highest number the host knows the
     * device has run, raised by every wait (synchronize, to_host, check: all of
     * them; fence_wait: those enqueued before the fence). kvs_upload_turns. */
    uint64_t n_sent, n_done;

    /* memory */
    void *(*alloc)(kvs_backend *b, size_t bytes); /* NULL when out of memory */
    /* Memory for weights, written once and then read whole every step (NULL:
     * alloc). The CPU backend puts it on huge pages. */
    void *(*alloc_weights)(kvs_backend *b, size_t bytes);
    void (*free)(kvs_backend *b, void *p);
    void (*to_device)(kvs_backend *b, void *dst, const void *src, size_t bytes);
    void (*to_host)(kvs_backend *b, void *dst, const void *src, size_t bytes);
    /* dst (weight_dtype, n elements) = convert(src of src_dtype) */
    void (*upload_weight)(kvs_backend *b, void *dst, const void *src, kvs_dtype src_dtype, size_t n);
    void (*synchronize)(kvs_backend *b);
    /* The device memory's free and total bytes now (cudaMemGetInfo): what a
     * KV pool sized as a share of the card may take. NULL: host memory, which
     * the backend does not size. */
    kvs_status (*memory_info)(kvs_backend *b, size_t *free_bytes, size_t *total_bytes);
    /* The backend's health. Ops return nothing, so an op that fails (a CUDA
     * error, a kernel fault, out of memory inside an op, a bad argument)
     * records it and the backend stays failed: check returns KVS_OK while no
     * op has failed, else the first failure's status with its message (set
     * again with kvs_fail on the calling thread). Waits for the work already
     * enqueued (CUDA: a fault in flight shows here, not a step later). The
     * forward calls it at the end of every step. */
    kvs_status (*check)(kvs_backend *b);
    /* A step's end without waiting for the work enqueued after it: fence marks
     * the point in the enqueued work (the backend holds one fence: a later
     * fence moves it); to_host_async enqueues a copy into host_alloc memory
     * whose bytes are there once a wait for a point after it returns;
     * fence_wait waits for the fence (not for what was enqueued since) and
     * returns what check would, but for faults of the work after the fence,
     * which a later wait reports. The runner fences a step, enqueues the KV
     * policy's compactions, then waits: the host plans them while the device
     * runs the step. */
    void (*fence)(kvs_backend *b);
    kvs_status (*fence_wait)(kvs_backend *b);
    void (*to_host_async)(kvs_backend *b, void *dst, const void *src, size_t bytes);

    /* ops; n = rows (tokens) */
    void (*embedding)(kvs_backend *b, void *out, const void *table, const int32_t *ids, int n, int dim);
    void (*rmsnorm)(kvs_backend *b, void *out, const void *in, const void *w, int n, int dim, float eps);
    /* In place, the rmsnorm of each head_dim-wide piece: the first n_pieces
     * pieces of each of the n rows of x (rows row_stride elements apart), each
     * scaled by w[head_dim]. Qwen3's per-head q_norm and k_norm on the QKV rows. */
    void (*head_rmsnorm)(kvs_backend *b, void *x, const void *w, int n, int row_stride, int n_pieces, int head_dim,
                         float eps);
    void (*add)(kvs_backend *b, void *x, const void *y, size_t n); /* x += y */
    /* out[n, out_dim] = in[n, in_dim] @ w[out_dim, in_dim]^T (+ bias[out_dim] if not NULL) */
    void (*matmul)(kvs_backend *b, void *out, const void *in, const void *w, const void *bias, int n,
                   int in_dim, int out_dim);
    /* Weights kept in a ggml block format (gguf.h: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
     * Q4_K, Q5_K, Q6_K; also the F16 / BF16 / F32 ggml ids for completeness):
     * out[i * ld_out + j] (f32) = sum_k in[i * in_dim + k] (act_dtype, f32 on the
     * CPU) * w_j[k] (+ bias[j], bias in weight_dtype, may be NULL) for i < n,
     * j < out_dim, where row j of w is in_dim / block blocks at w + j * row_bytes
     * (row_bytes = in_dim / block * block_bytes). in_dim a multiple of the type's
     * block. The CPU's decode (n <= 8) quantizes the inputs to int8 blocks of 32
     * first (llama.cpp's way: relative error ~1/254 of sum |x w| at worst),
     * prefill multiplies by the dequantized weights in f32. NULL on backends
     * without it (CUDA). */
    void (*matmul_q)(kvs_backend *b, void *out, int ld_out, const void *in, const void *w, uint32_t type,
                     const void *bias, int n, int in_dim, int out_dim);
    /* out [n][dim] (act_dtype) = rows ids[r] of a table in a ggml block format
     * (dim a multiple of the block). NULL where matmul_q is. */
    void (*embedding_q)(kvs_backend *b, void *out, const void *table, uint32_t type, const int32_t *ids, int n,
                        int dim);
    /* In-place rotate-half RoPE on x[n, n_heads, head_dim]; inv_freq[head_dim/2] (f32). */
    void (*rope)(kvs_backend *b, void *x, const int32_t *positions, const float *inv_freq, int n,
                 int n_heads, int head_dim);
    /* Writes k, v [n, n_kv_heads, head_dim] into pool slots (slot = block * block_size + offset);
     * rows whose slot is negative (padding) are skipped. */
    void (*kv_write)(kvs_backend *b, const kvs_kv_pool *pool, const void *k, const void *v,
                     const int32_t *slots, int n);
    /* Causal GQA attention over the paged cache (within ab->window when it is set): out[n_tokens, n_heads, head_dim];
     * lse[n_tokens, n_heads] (f32, natural log of the softmax denominator of the
     * scaled scores) when lse is not NULL. */
    void (*attention)(kvs_backend *b, void *out, float *lse, const void *q, const kvs_kv_pool *pool,
                      const kvs_attn_batch *ab, int n_heads, float scale);
    /* out[n, dim] = silu(gate_up[n, 0:dim]) * gate_up[n, dim:2dim] */
    void (*swiglu)(kvs_backend *b, void *out, const void *gate_up, int n, int dim);
    /* Gathers rows idx[m] of in[*, dim] into out[m, dim]. */
    void (*gather_rows)(kvs_backend *b, void *out, const void *in, const int32_t *idx, int m, int dim);
    /* Copies act_dtype x[n] to f32 host memory. */
    void (*to_host_f32)(kvs_backend *b, float *dst, const void *src, size_t n);
    /* KV copies for compaction: for each (head h, i < n), entry i of head h in
     * the table dst gets entry src_entry[h * n + i] of the table blocks
     * (ascending per head, src_entry[h * n + i] >= i). Entry e of a table t lives
     * in block t[e / block_size] at offset e % block_size; blocks has n_blocks.
     * dst == blocks: in place (one sequence's layer); otherwise dst's blocks
     * (at least ceil(n / block_size)) are none of blocks' (a compacted copy, the
     * source kept: a shared or cached prompt). Arrays in backend memory. */
    void (*kv_gather)(kvs_backend *b, const kvs_kv_pool *pool, const int32_t *blocks, int n_blocks,
                      const int32_t *dst, const int32_t *src_entry, int n);
    /* dst <- src, both backend memory */
    void (*copy)(kvs_backend *b, void *dst, const void *src, size_t bytes);
    /* dst[pairs[2 i]] = pairs[2 i + 1] for i < n (distinct indices), backend memory */
    void (*scatter_i32)(kvs_backend *b, int32_t *dst, const int32_t *pairs, int n);

    /* sparsity */
    /* Copies rows src_rows[i] of q [*, n_heads * head_dim] and lse [*, n_heads]
     * into rows dst_rows[i] of win_q and win_lse, for i < m. */
    void (*window_capture)(kvs_backend *b, void *win_q, float *win_lse, const void *q, const float *lse,
                           const int32_t *src_rows, const int32_t *dst_rows, int m, int n_heads, int head_dim);
    /* SnapKV scores from the window's log-sum-exp: for KV head g and entry j < n_keys
     * of the table, scores[g * n_keys + j] = sum over the group's query heads h and
     * the n_win window queries i of exp(scale * q[i,h] . k[g,j] - lse[i,h]). */
    void (*sparsity_scores)(kvs_backend *b, float *scores, const void *win_q, const float *win_lse, int n_win,
                            const kvs_kv_pool *pool, const int32_t *table, int n_keys, int n_heads, float scale);

    /* sampling (backend/sample.h: the parameters and the exact semantics):
     * ids[r] (int32) for each row r < n_rows of logits [n_rows][ld] (act_dtype,
     * columns 0 .. vocab - 1 used) with params[r]; logprobs[r] (f32) too when
     * not NULL. All arrays in backend memory; no host round trip. */
    void (*sample)(kvs_backend *b, int32_t *ids, float *logprobs, const void *logits, int n_rows, int ld, int vocab,
                   const struct kvs_sample_row *params);
    /* Logits processing before the draw (backend/sample.h): out [n_rows][ld_out]
     * (act_dtype) from logits [n_rows][ld] with rows[r], the step's adjust list
     * and mask rows [*][kvs_sample_mask_words(vocab)] (NULL when no row has one).
     * All arrays in backend memory. */
    void (*process_logits)(kvs_backend *b, void *out, int ld_out, const void *logits, int ld, int n_rows, int vocab,
                           const struct kvs_process_row *rows, const struct kvs_logit_adjust *adjust,
                           const uint32_t *masks);
    /* Top logprobs of the raw logits (backend/sample.h): chosen_lp [n_rows],
     * top_ids / top_lp [n_rows][k] (k in [0, 20]; NULL when k is 0). All arrays
     * in backend memory. */
    void (*top_logprobs)(kvs_backend *b, float *chosen_lp, int32_t *top_ids, float *top_lp, const void *logits,
                         int n_rows, int ld, int vocab, const int32_t *chosen, int k);
    /* Dummy weights (--load-format dummy) made in place, without the host:
     * dst (weight_dtype, nr x nc, row-major) gets the zero-mean dummy elements
     * (r0 + r) * full_cols + c0 + c of the weight with per-weight seed `seed`
     * (backend/dummy_values.h: kvs_dummy_value(seed, i, scale, src_dtype)), i.e.
     * exactly what the checkpoint's host tensor of dtype src_dtype would hold
     * there, converted as upload_weight converts it. */
    void (*dummy_fill)(kvs_backend *b, void *dst, uint64_t seed, float scale, kvs_dtype src_dtype, int64_t full_cols,
                       int64_t r0, int64_t nr, int64_t c0, int64_t nc);
    /* SnapKV selection from scores already in backend memory (scores[g * n_keys + j],
     * as sparsity_scores writes them). For each KV head g: max-pool its n_keys scores
     * (kernel `pool`, stride 1, same size, borders use the part inside), take the
     * min(k, n_keys) entries of highest pooled score (ties to the lower index) and
     * write them ascending to keep[g * (k + n_win) + 0 ..], followed by the window
     * entries n_keys .. n_keys + n_win - 1; slots left over when k > n_keys get -1.
     * keep [n_kv_heads * (k + n_win)] is what kv_gather takes as src_entry.
     * Scores must not be NaN. Bad arguments (negative sizes, pool < 1) are reported
     * and nothing is written. */
    void (*snapkv_select)(kvs_backend *b, int32_t *keep, const float *scores, int n_keys, int n_kv_heads, int pool,
                          int k, int n_win);
    /* For each job of batch (kvs_snapkv_batch): sparsity_scores of its window
     * over entries [0, n_keys) of its table (pool with the job's scales) into
     * its scores, snapkv_select of those (its pool kernel, k, n_win) into its
     * keep lists, then kv_gather of its k + n_win kept entries in place
     * (dst == blocks) or, with dst_blocks > 0, into its copy's table:
     * afterwards entries 0 .. k + n_win - 1 of that table hold the kept ones.
     * pool gives the blocks and the geometry (its scales are not used). Stage
     * by stage (every job's scores, then every selection, then every gather:
     * one launch each on CUDA), so no two jobs may share scores or keep lists,
     * and no job may write a block another job reads or writes (jobs may read
     * the same source blocks when both compact into copies). The CPU checks the jobs (k <= n_keys, sizes, the
     * bounds) and reports a bad one, writing nothing; CUDA trusts them. Bad
     * batch arguments (sizes, heads, head_dim) are reported and nothing is
     * written. */
    void (*snapkv_compact_batch)(kvs_backend *b, const kvs_kv_pool *pool, const kvs_snapkv_batch *batch);
    /* ---- an executor's step buffers and decode-step graphs ---- */
    /* Host memory for uploads: pinned on CUDA (to_device from it is a truly
     * asynchronous copy, so the source must stay unchanged until the stream has
     * run the copy: the next synchronize or to_host), malloc on the CPU. NULL
     * when out of memory. */
    void *(*host_alloc)(kvs_backend *b, size_t bytes);
    void (*host_free)(kvs_backend *b, void *p);
    /* Graphs (NULL where the backend has none, e.g. the CPU): graph_begin starts
     * capturing what this thread enqueues on the backend's stream (collectives a
     * communicator puts on that stream included); nothing runs until graph_end,
     * which returns the replayable graph in *graph, or fails with *graph NULL when
     * the capture broke (then none of the captured ops ran: run them again). */
    kvs_status (*graph_begin)(kvs_backend *b);
    kvs_status (*graph_end)(kvs_backend *b, void **graph);
    /* Replays graph on the stream. Fails without running anything when memory
     * the graph baked in moved since the capture (the backend's grow-only scratch
     * grew): destroy it, run eagerly, capture again. */
    kvs_status (*graph_launch)(kvs_backend *b, void *graph);
    void (*graph_destroy)(kvs_backend *b, void *graph);
    /* fused ops (each equals the unfused sequence named in its comment) */
    /* x += y, then xn = rmsnorm(x) * w over rows of dim: add then rmsnorm in one
     * pass (one read of x and y, one write of x and xn). The norm reads x as
     * stored (bf16 on CUDA: rounded after the add, like add + rmsnorm). */
    void (*add_rmsnorm)(kvs_backend *b, void *x, void *xn, const void *y, const void *w, int n, int dim,
                        float eps);
    /* qkv [n][(n_heads + 2 * n_kv_heads) * head_dim] is one GEMM's output: each
     * row's q heads, then its k heads, then its v heads. q [n, n_heads, head_dim]
     * gets rope(q); rope(k) and v are written into pool slots like kv_write (qkv
     * is left as it is). Rows whose slot is negative (padding) write nothing to
     * the pool. */
    void (*rope_kv_write)(kvs_backend *b, const kvs_kv_pool *pool, void *q, const void *qkv,
                          const int32_t *positions, const float *inv_freq, const int32_t *slots, int n,
                          int n_heads);

    /* Tensor-parallel sampling (backend/sample.h, kvs_sample_part): for each row
     * r < n_rows of logits [n_rows][ld] (act_dtype), a vocabulary slice whose
     * columns 0 .. count - 1 are the global token ids id0 .. id0 + count - 1,
     * parts[r] = the slice's share of the sample op's pick with params[r]
     * (greedy or temperature; top-k, top-p and min-p are ignored: callers use
     * it only for rows kvs_sample_shardable accepts). count 0: an empty part.
     * All arrays in backend memory. */
    void (*sample_shard)(kvs_backend *b, struct kvs_sample_part *parts, const void *logits, int n_rows, int ld,
                         int count, int id0, const struct kvs_sample_row *params);

    /* FP8 E4M3 weights (--quantization fp8; docs/CUDA.md "FP8"). NULL where the
     * backend has no FP8 (CUDA below compute capability 8.9). Codes are E4M3
     * bytes (core.h kvs_f32_to_e4m3), one f32 scale per row. */
    /* Per-row quantization: scale[r] = max_c |x[r][c]| / 448 (1 when that is not
     * > 0: a row of zeros), q[r][c] = e4m3(x[r][c] / scale[r]) (IEEE f32 division),
     * for x [rows][cols] of x_dtype (the backend's weight_dtype or act_dtype).
     * Weights at load (a scale per output channel), activations per token. */
    void (*quantize_fp8)(kvs_backend *b, uint8_t *q, float *scale, const void *x, kvs_dtype x_dtype, int rows,
                         int cols);
    /* out[n, out_dim] (act_dtype) = (sum_k e4m3(xq[n][k]) * e4m3(wq[o][k])) * xs[n] * ws[o]
     * (+ bias[o] of weight_dtype when not NULL): the matmul on quantize_fp8's
     * codes and scales, accumulated in f32. in_dim and out_dim multiples of 16
     * (cuBLASLt's FP8 alignment); the codes 16-byte aligned. */
    void (*matmul_fp8)(kvs_backend *b, void *out, const uint8_t *xq, const float *xs, const uint8_t *wq,
                       const float *ws, const void *bias, int n, int in_dim, int out_dim);
    /* A GEMM input quantized by the op that makes it (fp8 activations): q, scale
     * are what quantize_fp8 (x_dtype act_dtype) makes of the output the unfused
     * op would have stored, and that output is not stored. add_rmsnorm_fp8: x as
     * add_rmsnorm leaves it, q, scale of rmsnorm(x) * w; swiglu_fp8: q, scale of
     * swiglu(gate_up) [n, dim]. NULL where quantize_fp8 is. */
    void (*add_rmsnorm_fp8)(kvs_backend *b, void *x, uint8_t *q, float *scale, const void *y, const void *w, int n,
                            int dim, float eps);
    void (*swiglu_fp8)(kvs_backend *b, uint8_t *q, float *scale, const void *gate_up, int n, int dim);

    /* Timing marks (backend/profile.h times the ops with them): a mark is a
     * point in the enqueued work. CUDA records an event on the stream; the CPU,
     * whose ops run before they return, reads the monotonic clock.
     * mark_create: NULL when out of memory. mark_elapsed_ms: milliseconds from
     * mark `from` to mark `to`, both recorded and reached (after a synchronize). */
    void *(*mark_create)(kvs_backend *b);
    void (*mark_record)(kvs_backend *b, void *mark);
    double (*mark_elapsed_ms)(kvs_backend *b, void *from, void *to);
    void (*mark_destroy)(kvs_backend *b, void *mark);

    void (*destroy)(kvs_backend *b);
};

/* The CPU backend with f32 weights (the oracle); n_threads 0: OpenMP's default. */
kvs_status kvs_backend_cpu_create(int n_threads, kvs_backend **out);
/* ... with weights kept in weight_dtype (F32, BF16 or F16: a bf16 or f16
 * checkpoint's bytes as they are) and a KV cache of kv_dtype (F32, BF16 or
 * F16: rounded to nearest even when written), both widened in registers;
 * activations stay f32. */
kvs_status kvs_backend_cpu_create_typed(int n_threads, kvs_dtype weight_dtype, kvs_dtype kv_dtype, kvs_backend **out);
/* kv_dtype may also be F8_E4M3 (an FP8 pool with scales, kvs_kv_pool); its
 * entries are decoded and scaled in registers. */
/* The CPU kernel set this machine runs ("avx512", "avx2" or "generic"). */
const char *kvs_cpu_kernels_name(void);
/* The memory's read rate in GB/s as the CPU backend b reads (its threads and
 * kernels, each thread one contiguous part): the best of reps passes over
 * `bytes` (make it well above the last-level cache). 0 when b is no CPU backend. */
double kvs_cpu_read_bandwidth(kvs_backend *b, size_t bytes, int reps);

/* The CUDA backend's prefill attention kernel (docs/CUDA.md). A kernel whose
 * shared memory does not fit the device, or an unknown value, acts as AUTO. */
typedef enum {
    KVS_CUDA_PREFILL_AUTO,  /* GQA where it fits the device's shared memory, else SMALL */
    KVS_CUDA_PREFILL_GQA,   /* 8 warps, 4 query heads of a KV group a block (HEAD for other groups) */
    KVS_CUDA_PREFILL_HEAD,  /* 8 warps, 256 query rows of one head a block */
    KVS_CUDA_PREFILL_SMALL, /* 4 warps, 64 rows, Q in registers: the least shared memory */
    /* Hopper (compute capability 9.0 only; kvs_backend_cuda_create refuses it
       elsewhere): wgmma fed by a TMA producer warpgroup, two consumer
       warpgroups, 128 rows of one KV group a block; head_dim 64/128 with bf16
       or FP8 pools and block sizes a multiple of 16, other calls as AUTO. AUTO's
       choice on Hopper for bf16 pools (FP8 pools: GQA, measured faster). */
    KVS_CUDA_PREFILL_WGMMA,
} kvs_cuda_prefill;
/* How the CUDA backend's matmul_fp8 applies the per-token and per-channel
 * scales (docs/CUDA.md "FP8"), and whether cuBLASLt's FP8 fast accumulation is
 * on (FAST: the tensor cores' own accumulator; otherwise partial sums are
 * promoted to f32 periodically). */
typedef enum {
    KVS_CUDA_FP8_AUTO,          /* EPILOGUE_FAST up to 64 rows (decode), OUTER_FAST above where cuBLASLt has it */
    KVS_CUDA_FP8_OUTER_FAST,    /* cuBLASLt outer-vector scales (A per row, B per column), bf16 out */
    KVS_CUDA_FP8_OUTER,         /* the same without fast accumulation */
    KVS_CUDA_FP8_EPILOGUE_FAST, /* cuBLASLt with unit scales, f32 out, then a kernel scales (+ bias) to bf16 */
    KVS_CUDA_FP8_EPILOGUE,      /* the same without fast accumulation */
} kvs_cuda_fp8_gemm;
typedef struct {
    int device;               /* CUDA device index */
    kvs_cuda_prefill prefill; /* 0: AUTO */
    kvs_cuda_fp8_gemm fp8_gemm; /* 0: AUTO */
    bool kv_fp8; /* kv_dtype F8_E4M3 (--kv-cache-dtype fp8) instead of BF16; compute capability 8.9+ */
} kvs_cuda_options;
/* CUDA backend; KVS_ERR_UNSUPPORTED when built without CUDA, no GPU present, or
 * kv_fp8 on a GPU below compute capability 8.9 (the message says so). */
kvs_status kvs_backend_cuda_create(const kvs_cuda_options *opt, kvs_backend **out);
/* For tests: the kvs_cuda_prefill kernel that the CUDA backend b's last prefill
 * attention launch ran (HEAD where GQA took a group not a multiple of 4); -1 before
 * the first, for a backend that is not CUDA's, or in a build without CUDA. */
int kvs_backend_cuda_last_prefill(kvs_backend *b);

/* Two host_alloc buffers (or halves of one) taking turns as the source of
 * uploads, so that building the next upload need not wait for the last one:
 * kvs_turn_take gives the half to write, waiting for its previous upload only
 * when no wait since covered it (normally a step's fence_wait came in
 * between); kvs_turn_sent after its to_device numbers the upload and hands
 * over to the other half. */
typedef struct {
    uint64_t mark[2]; /* each half's last upload's number (b->n_sent) */
    int half;         /* the half to write next */
} kvs_upload_turns;

static inline int kvs_turn_take(kvs_backend *b, const kvs_upload_turns *t) {
    if (b->n_done < t->mark[t->half]) b->synchronize(b);
    return t->half;
}
static inline void kvs_turn_sent(kvs_backend *b, kvs_upload_turns *t) {
    t->mark[t->half] = ++b->n_sent;
    t->half ^= 1;
}

#endif
