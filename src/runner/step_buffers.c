/* The step buffers, sized once when the executor is created for its limits
 * (so the pointers a CUDA graph bakes in stay put): activations for the largest
 * step's rows, logits and sampling for max_seqs rows, the metadata of max_seqs
 * sequences in every layer. One walk over the buffers
 * counts them, allocates them and frees them. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "runner/runner_internal.h"

kvs_step_limits kvs_limits_resolve(const kvs_config *cfg, const kvs_step_limits *in) {
    kvs_step_limits l = in ? *in : (kvs_step_limits){0};
    if (l.max_tokens <= 0) l.max_tokens = 2048;
    if (l.max_seqs <= 0) l.max_seqs = 64;
    if (l.max_len <= 0) l.max_len = cfg->max_position_embeddings;
    if (l.block_size <= 0) l.block_size = KVS_KV_BLOCK_SIZE;
    return l;
}

int kvs_ceil_log2(int n) {
    int i = 0;
    while ((1 << i) < n) i++;
    return i;
}

int kvs_stride_bucket(int blocks) {
    int p = 1;
    while (p < blocks && p + p / 2 < blocks) p *= 2;
    return p >= blocks ? p : p + p / 2;
}

/* n, or the power of two a graph pads it to when there is a graph for it. */
static int padded(int n, int n_graph_sizes) {
    int p = kvs_ceil_log2(n);
    return p < n_graph_sizes ? 1 << p : n;
}

typedef enum { COUNT, ALLOC, FREE } walk_mode;
typedef struct {
    walk_mode mode;
    kvs_backend *be;
    size_t bytes; /* backend memory counted */
    bool failed;
} walk;

static void on_device(walk *w, void *ptr, size_t bytes) {
    void **p = ptr;
    w->bytes += bytes;
    if (w->mode == ALLOC && !(*p = w->be->alloc(w->be, bytes))) w->failed = true;
    if (w->mode == FREE && *p) w->be->free(w->be, *p);
}

static void on_host(walk *w, void *ptr, size_t bytes) {
    void **p = ptr;
    if (w->mode == ALLOC && !(*p = calloc(1, bytes ? bytes : 1))) w->failed = true;
    if (w->mode == FREE) free(*p);
}

/* Pinned on CUDA: to_device from it is truly asynchronous (backend.h). */
static void on_pinned(walk *w, void *ptr, size_t bytes) {
    void **p = ptr;
    if (w->mode == ALLOC && !(*p = w->be->host_alloc(w->be, bytes))) w->failed = true;
    if (w->mode == FREE && *p) w->be->host_free(w->be, *p);
}

/* Every step buffer of a rank model (shard) for limits l. */
static void walk_buffers(walk *w, kvs_step_buffers *b, kvs_sample_buffers *s, const kvs_config *c,
                         const kvs_shard *sh, const kvs_step_limits *l, kvs_dtype act_dtype) {
    kvs_forward_state *f = &b->fs;
    /* S sequences (max_seqs or the graph bucket it pads to), n rows (a padded
       decode step has one per sequence) */
    size_t a = kvs_dtype_size(act_dtype), S = padded(l->max_seqs, KVS_GRAPH_BATCHES), n = (size_t)l->max_tokens;
    if (n < S) n = S;
    size_t qd = (size_t)sh->n_heads * c->head_dim, kd = (size_t)sh->n_kv_heads * c->head_dim;
    size_t wide = (size_t)sh->intermediate > qd ? (size_t)sh->intermediate : qd;
    if (wide < (size_t)c->hidden_size) wide = c->hidden_size;
    on_device(w, &f->x, n * c->hidden_size * a);
    on_device(w, &f->xn, n * c->hidden_size * a);
    on_device(w, &f->qkv, n * (qd + 2 * kd) * a);
    on_device(w, &f->q, n * qd * a);
    on_device(w, &f->att, n * qd * a);
    on_device(w, &f->tmp, n * c->hidden_size * a);
    on_device(w, &f->gate_up, n * 2 * sh->intermediate * a);
    on_device(w, &f->act, n * wide * a);
    on_device(w, &f->lse, n * sh->n_heads * sizeof(float));
    if (c->quantization == KVS_QUANT_FP8) { /* the widest GEMM input: hidden, heads or the MLP columns */
        on_device(w, &f->xq, n * wide);
        on_device(w, &f->xs, n * sizeof(float));
    }
    /* the metadata (step_meta.c): ids, positions, q_start, table rows, then per
       layer slots, kv lengths and window-capture rows */
    size_t meta = 2 * n + 2 * S + 1 + (size_t)c->n_layers * (3 * n + S);
    b->meta_words = meta;
    on_device(w, &b->meta, meta * sizeof(int32_t));
    on_pinned(w, &b->h_meta, 2 * meta * sizeof(int32_t));
    on_host(w, &b->layer_meta, c->n_layers * sizeof(kvs_layer_meta));
    on_host(w, &b->layer_step, c->n_layers * sizeof(kvs_layer_step));
    /* the logits of the sequences that want them (at most one per sequence) */
    size_t L = (size_t)l->max_seqs, world = (size_t)sh->world, vp = (size_t)sh->vocab_pad;
    on_device(w, &f->last, L * c->hidden_size * a);
    on_device(w, &f->logits, L * vp * a);
    on_device(w, &b->last_rows, L * sizeof(int32_t));
    on_host(w, &b->h_last_rows, L * sizeof(int32_t));
    on_device(w, &s->params, L * sizeof(kvs_sample_row));
    on_device(w, &s->out, 2 * L * sizeof(int32_t));
    on_host(w, &s->h_out, 2 * L * sizeof(int32_t));
    on_device(w, (void **)&s->processed, L * c->vocab_size * a); /* logits processing, top logprobs */
    on_device(w, (void **)&s->process, L * sizeof(kvs_process_row));
    on_device(w, (void **)&s->masks, L * kvs_sample_mask_words(c->vocab_size) * sizeof(uint32_t));
    on_device(w, (void **)&s->top, 2 * L * KVS_MAX_TOP_LOGPROBS * sizeof(int32_t));
    on_host(w, (void **)&s->h_top, 2 * L * KVS_MAX_TOP_LOGPROBS * sizeof(int32_t));
    if (world == 1) return;
    on_device(w, &b->logits_all, world * L * vp * a); /* the logits gather */
    on_host(w, &b->h_logits, world * L * vp * sizeof(float));
    on_device(w, &s->rows, L * world * vp * a); /* sampling the gathered rows */
    on_device(w, &s->order, world * L * sizeof(int32_t));
    on_host(w, &s->h_order, world * L * sizeof(int32_t));
    on_device(w, &s->parts, L * sizeof(kvs_sample_part)); /* sampling without the gather */
    on_device(w, &s->parts_all, world * L * sizeof(kvs_sample_part));
    on_host(w, &s->h_parts, world * L * sizeof(kvs_sample_part));
}

size_t kvs_executor_bytes(const kvs_config *cfg, const kvs_shard *shard, const kvs_step_limits *limits,
                          kvs_dtype act_dtype) {
    kvs_step_limits l = kvs_limits_resolve(cfg, limits);
    kvs_step_buffers b;
    kvs_sample_buffers s;
    walk w = {COUNT, NULL, 0, false};
    walk_buffers(&w, &b, &s, cfg, shard, &l, act_dtype);
    return w.bytes;
}

kvs_status kvs_step_buffers_create(kvs_executor *x) {
    walk w = {ALLOC, x->be, 0, false};
    walk_buffers(&w, &x->buf, &x->sample, x->cfg, x->shard, &x->limits, x->be->act_dtype);
    x->buf.fs.layers = x->buf.layer_step;
    if (!w.failed) return KVS_OK;
    return kvs_fail(KVS_ERR_NOMEM, "model: out of memory for the step buffers (%.1f MiB of backend memory for %d "
                    "tokens and %d sequences per step)", w.bytes / 1048576.0, x->limits.max_tokens,
                    x->limits.max_seqs);
}

void kvs_step_buffers_free(kvs_executor *x) {
    walk w = {FREE, x->be, 0, false};
    walk_buffers(&w, &x->buf, &x->sample, x->cfg, x->shard, &x->limits, x->be->act_dtype);
    if (x->sample.adjust) x->be->free(x->be, x->sample.adjust);
    x->sample.adjust = NULL;
    x->sample.cap_adjust = 0;
}
