/* The timing backend wrapper (backend/profile.h). Each timed op records a
 * mark before and after it; the marks are pooled (created once, reused every
 * step) and read after the step, when the work they mark is done. */
#include "backend/profile.h"

#include <stdlib.h>

#include "backend/sample.h"

struct kvs_profile {
    kvs_backend base; /* first: the model sees this; inner's ops but for the timed ones */
    kvs_backend *inner;
    bool owns_inner, on, out_of_marks;
    void **marks;      /* [cap_marks]: region r is marks 2r .. 2r + 1 */
    int n_marks, cap_marks;
    kvs_phase *phase;  /* [cap_marks / 2]: the step's regions */
    int n_regions;
    double last;       /* kvs_now() at the end of the previous step's reading */
    kvs_profile_totals t;
};

kvs_step_kind kvs_step_kind_of(int64_t tokens, int64_t decode_tokens) {
    if (tokens <= 0) return KVS_STEP_EMPTY;
    return decode_tokens == tokens ? KVS_STEP_DECODE : decode_tokens == 0 ? KVS_STEP_PREFILL : KVS_STEP_MIXED;
}

const char *kvs_step_kind_name(kvs_step_kind k) {
    static const char *const names[KVS_STEP_KINDS] = {"prefill", "decode", "mixed", "empty"};
    return k >= 0 && k < KVS_STEP_KINDS ? names[k] : "?";
}

/* Room for one more region's two marks (created on first use). */
static bool reserve(kvs_profile *p) {
    int need = 2 * p->n_regions + 2;
    if (need > p->cap_marks) {
        int cap = p->cap_marks ? 2 * p->cap_marks : 1024;
        void **m = realloc(p->marks, sizeof *m * cap);
        if (m) p->marks = m;
        kvs_phase *ph = m ? realloc(p->phase, sizeof *ph * (cap / 2)) : NULL;
        if (ph) p->phase = ph;
        if (!m || !ph) return false;
        p->cap_marks = cap;
    }
    while (p->n_marks < need) {
        void *mark = p->inner->mark_create(p->inner);
        if (!mark) return false;
        p->marks[p->n_marks++] = mark;
    }
    return true;
}

/* The region an op opens (-1: not timed). */
static int begin(kvs_profile *p, kvs_phase phase) {
    if (!p->on || p->out_of_marks) return -1;
    if (!reserve(p)) {
        p->out_of_marks = true;
        return -1;
    }
    int r = p->n_regions++;
    p->phase[r] = phase;
    p->inner->mark_record(p->inner, p->marks[2 * r]);
    return r;
}

static void end(kvs_profile *p, int r) {
    if (r >= 0) p->inner->mark_record(p->inner, p->marks[2 * r + 1]);
}

/* static void timed_OP(kvs_backend *b, PARAMS...): inner's op between two marks */
#define TIMED(op, phase, params, ...)                        \
    static void timed_##op params {                          \
        kvs_profile *p = (kvs_profile *)b;                   \
        int r = begin(p, phase);                             \
        p->inner->op(p->inner, __VA_ARGS__);                 \
        end(p, r);                                           \
    }

TIMED(matmul, KVS_PHASE_GEMM,
      (kvs_backend *b, void *out, const void *in, const void *w, const void *bias, int n, int in_dim, int out_dim),
      out, in, w, bias, n, in_dim, out_dim)
TIMED(matmul_fp8, KVS_PHASE_GEMM,
      (kvs_backend *b, void *out, const uint8_t *xq, const float *xs, const uint8_t *wq, const float *ws,
       const void *bias, int n, int in_dim, int out_dim),
      out, xq, xs, wq, ws, bias, n, in_dim, out_dim)
TIMED(quantize_fp8, KVS_PHASE_GEMM,
      (kvs_backend *b, uint8_t *q, float *scale, const void *x, kvs_dtype x_dtype, int rows, int cols), q, scale, x,
      x_dtype, rows, cols)
TIMED(attention, KVS_PHASE_ATTENTION,
      (kvs_backend *b, void *out, float *lse, const void *q, const kvs_kv_pool *pool, const kvs_attn_batch *ab,
       int n_heads, float scale),
      out, lse, q, pool, ab, n_heads, scale)
TIMED(embedding, KVS_PHASE_OTHER, (kvs_backend *b, void *out, const void *table, const int32_t *ids, int n, int dim),
      out, table, ids, n, dim)
TIMED(rmsnorm, KVS_PHASE_OTHER, (kvs_backend *b, void *out, const void *in, const void *w, int n, int dim, float eps),
      out, in, w, n, dim, eps)
TIMED(head_rmsnorm, KVS_PHASE_OTHER,
      (kvs_backend *b, void *x, const void *w, int n, int row_stride, int n_pieces, int head_dim, float eps), x, w, n,
      row_stride, n_pieces, head_dim, eps)
TIMED(add, KVS_PHASE_OTHER, (kvs_backend *b, void *x, const void *y, size_t n), x, y, n)
TIMED(rope, KVS_PHASE_OTHER,
      (kvs_backend *b, void *x, const int32_t *positions, const float *inv_freq, int n, int n_heads, int head_dim), x,
      positions, inv_freq, n, n_heads, head_dim)
TIMED(kv_write, KVS_PHASE_OTHER,
      (kvs_backend *b, const kvs_kv_pool *pool, const void *k, const void *v, const int32_t *slots, int n), pool, k, v,
      slots, n)
TIMED(swiglu, KVS_PHASE_OTHER, (kvs_backend *b, void *out, const void *gate_up, int n, int dim), out, gate_up, n, dim)
TIMED(gather_rows, KVS_PHASE_OTHER, (kvs_backend *b, void *out, const void *in, const int32_t *idx, int m, int dim),
      out, in, idx, m, dim)
TIMED(copy, KVS_PHASE_OTHER, (kvs_backend *b, void *dst, const void *src, size_t bytes), dst, src, bytes)
TIMED(scatter_i32, KVS_PHASE_OTHER, (kvs_backend *b, int32_t *dst, const int32_t *pairs, int n), dst, pairs, n)
TIMED(add_rmsnorm, KVS_PHASE_OTHER,
      (kvs_backend *b, void *x, void *xn, const void *y, const void *w, int n, int dim, float eps), x, xn, y, w, n, dim,
      eps)
TIMED(add_rmsnorm_fp8, KVS_PHASE_OTHER,
      (kvs_backend *b, void *x, uint8_t *q, float *scale, const void *y, const void *w, int n, int dim, float eps), x,
      q, scale, y, w, n, dim, eps)
TIMED(swiglu_fp8, KVS_PHASE_OTHER, (kvs_backend *b, uint8_t *q, float *scale, const void *gate_up, int n, int dim), q,
      scale, gate_up, n, dim)
TIMED(rope_kv_write, KVS_PHASE_OTHER,
      (kvs_backend *b, const kvs_kv_pool *pool, void *q, const void *qkv, const int32_t *positions,
       const float *inv_freq, const int32_t *slots, int n, int n_heads),
      pool, q, qkv, positions, inv_freq, slots, n, n_heads)
TIMED(window_capture, KVS_PHASE_SPARSIFY,
      (kvs_backend *b, void *win_q, float *win_lse, const void *q, const float *lse, const int32_t *src_rows,
       const int32_t *dst_rows, int m, int n_heads, int head_dim),
      win_q, win_lse, q, lse, src_rows, dst_rows, m, n_heads, head_dim)
TIMED(sparsity_scores, KVS_PHASE_SPARSIFY,
      (kvs_backend *b, float *scores, const void *win_q, const float *win_lse, int n_win, const kvs_kv_pool *pool,
       const int32_t *table, int n_keys, int n_heads, float scale),
      scores, win_q, win_lse, n_win, pool, table, n_keys, n_heads, scale)
TIMED(snapkv_select, KVS_PHASE_SPARSIFY,
      (kvs_backend *b, int32_t *keep, const float *scores, int n_keys, int n_kv_heads, int pool, int k, int n_win),
      keep, scores, n_keys, n_kv_heads, pool, k, n_win)
TIMED(kv_gather, KVS_PHASE_SPARSIFY,
      (kvs_backend *b, const kvs_kv_pool *pool, const int32_t *blocks, int n_blocks, const int32_t *dst,
       const int32_t *src_entry, int n),
      pool, blocks, n_blocks, dst, src_entry, n)
TIMED(snapkv_compact_batch, KVS_PHASE_SPARSIFY,
      (kvs_backend *b, const kvs_kv_pool *pool, const kvs_snapkv_batch *batch), pool, batch)
TIMED(sample, KVS_PHASE_SAMPLING,
      (kvs_backend *b, int32_t *ids, float *logprobs, const void *logits, int n_rows, int ld, int vocab,
       const struct kvs_sample_row *params),
      ids, logprobs, logits, n_rows, ld, vocab, params)
TIMED(sample_shard, KVS_PHASE_SAMPLING,
      (kvs_backend *b, struct kvs_sample_part *parts, const void *logits, int n_rows, int ld, int count, int id0,
       const struct kvs_sample_row *params),
      parts, logits, n_rows, ld, count, id0, params)
TIMED(process_logits, KVS_PHASE_SAMPLING,
      (kvs_backend *b, void *out, int ld_out, const void *logits, int ld, int n_rows, int vocab,
       const struct kvs_process_row *rows, const struct kvs_logit_adjust *adjust, const uint32_t *masks),
      out, ld_out, logits, ld, n_rows, vocab, rows, adjust, masks)
TIMED(top_logprobs, KVS_PHASE_SAMPLING,
      (kvs_backend *b, float *chosen_lp, int32_t *top_ids, float *top_lp, const void *logits, int n_rows, int ld,
       int vocab, const int32_t *chosen, int k),
      chosen_lp, top_ids, top_lp, logits, n_rows, ld, vocab, chosen, k)

void kvs_profile_start(kvs_profile *p) {
    p->t = (kvs_profile_totals){0};
    p->n_regions = 0;
    p->out_of_marks = false;
    p->on = true;
    kvs_host_clock_on(true);
    p->last = kvs_now();
}

kvs_status kvs_profile_step(kvs_profile *p, int64_t tokens, int64_t decode_tokens) {
    double t0 = kvs_now(), regions = 0;
    kvs_step_kind kind = kvs_step_kind_of(tokens, decode_tokens);
    kvs_backend *in = p->inner;
    in->synchronize(in); /* normally done already: the step's check waited for its work */
    for (int r = 0; r < p->n_regions; r++) {
        double ms = in->mark_elapsed_ms(in, p->marks[2 * r], p->marks[2 * r + 1]);
        p->t.op_ms[kind][p->phase[r]] += ms;
        regions += ms;
    }
    p->t.regions += p->n_regions;
    p->n_regions = 0;
    p->t.steps[kind]++;
    p->t.tokens[kind] += tokens;
    p->t.decode_tokens[kind] += decode_tokens;
    p->t.host_ms[kind] += 1e3 * (t0 - p->last) - regions;
    kvs_host_clock_totals(p->t.host_phase_ms);
    double t1 = kvs_now();
    p->t.read_ms += 1e3 * (t1 - t0);
    p->t.wall_ms += 1e3 * (t1 - p->last);
    p->last = t1;
    if (p->out_of_marks)
        return kvs_fail(KVS_ERR_NOMEM, "profile: out of memory for the %s backend's timing marks (%d)", in->name,
                        p->n_marks);
    return KVS_OK;
}

const kvs_profile_totals *kvs_profile_get(const kvs_profile *p) { return &p->t; }

static void profile_destroy(kvs_backend *b) {
    kvs_profile *p = (kvs_profile *)b;
    if (p->on) kvs_host_clock_on(false);
    for (int i = 0; i < p->n_marks; i++) p->inner->mark_destroy(p->inner, p->marks[i]);
    if (p->owns_inner) p->inner->destroy(p->inner);
    free(p->marks);
    free(p->phase);
    free(p);
}

kvs_status kvs_backend_profile_wrap(kvs_backend *inner, bool owns_inner, kvs_backend **out, kvs_profile **profile) {
    *out = NULL;
    *profile = NULL;
    if (!inner || !inner->mark_create)
        return kvs_fail(KVS_ERR_UNSUPPORTED, "profile: the %s backend has no timing marks", inner ? inner->name : "(no)");
    kvs_profile *p = calloc(1, sizeof *p);
    if (!p) return kvs_fail(KVS_ERR_NOMEM, "profile: out of memory");
    p->base = *inner; /* impl shared: inner's ops called with the wrapper find their state */
    p->inner = inner;
    p->owns_inner = owns_inner;
    kvs_backend *b = &p->base;
#define WRAP(op) b->op = inner->op ? timed_##op : NULL
    WRAP(matmul), WRAP(matmul_fp8), WRAP(quantize_fp8), WRAP(attention), WRAP(embedding), WRAP(rmsnorm), WRAP(add);
    WRAP(head_rmsnorm), WRAP(rope), WRAP(kv_write), WRAP(swiglu), WRAP(gather_rows), WRAP(copy), WRAP(add_rmsnorm);
    WRAP(scatter_i32);
    WRAP(rope_kv_write), WRAP(add_rmsnorm_fp8), WRAP(swiglu_fp8);
    WRAP(window_capture), WRAP(sparsity_scores), WRAP(snapkv_select), WRAP(kv_gather), WRAP(snapkv_compact_batch);
    WRAP(sample);
    WRAP(sample_shard), WRAP(process_logits), WRAP(top_logprobs);
#undef WRAP
    b->graph_begin = NULL; /* a captured op could not be timed: no graphs */
    b->graph_end = NULL;
    b->graph_launch = NULL;
    b->graph_destroy = NULL;
    b->destroy = profile_destroy;
    *out = b;
    *profile = p;
    return KVS_OK;
}
