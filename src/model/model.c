/* Creating a model: weights from a checkpoint uploaded into the backend. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model_internal.h"

void kvs_rope_inv_freq(const kvs_config *cfg, float *inv_freq) {
    int half = cfg->head_dim / 2;
    for (int i = 0; i < half; i++) {
        float f = (float)(1.0 / pow((double)cfg->rope_theta, (double)(2 * i) / cfg->head_dim));
        if (cfg->rope_type == KVS_ROPE_LINEAR) {
            f /= cfg->rope_factor;
        } else if (cfg->rope_type == KVS_ROPE_FACTORS) {
            f /= cfg->rope_freq_factors[i];
        } else if (cfg->rope_type == KVS_ROPE_LLAMA3) {
            /* Llama 3.1: scale low frequencies by 1/factor, keep high ones, blend between */
            double old_ctx = cfg->rope_original_max_position;
            double low_wavelen = old_ctx / cfg->rope_low_freq_factor;
            double high_wavelen = old_ctx / cfg->rope_high_freq_factor;
            double wavelen = 2 * M_PI / f;
            if (wavelen > low_wavelen) {
                f = f / cfg->rope_factor;
            } else if (wavelen >= high_wavelen) {
                double smooth = (old_ctx / wavelen - cfg->rope_low_freq_factor) /
                                (cfg->rope_high_freq_factor - cfg->rope_low_freq_factor);
                f = (float)((1 - smooth) * f / cfg->rope_factor + smooth * f);
            }
        }
        inv_freq[i] = f;
    }
}

void kvs_rope_llama3_factors(const kvs_config *cfg, float *out) {
    double old_ctx = cfg->rope_original_max_position, lo = cfg->rope_low_freq_factor, hi = cfg->rope_high_freq_factor;
    for (int i = 0; i < cfg->head_dim / 2; i++) {
        double f = 1.0 / pow((double)cfg->rope_theta, (double)(2 * i) / cfg->head_dim), wavelen = 2 * M_PI / f;
        double smooth = (old_ctx / wavelen - lo) / (hi - lo);
        out[i] = wavelen < old_ctx / hi   ? 1.0f
                 : wavelen > old_ctx / lo ? cfg->rope_factor
                                          : (float)(1.0 / ((1 - smooth) / cfg->rope_factor + smooth));
    }
}

kvs_status kvs_tp_validate(const kvs_config *cfg, int world, int n_devices) {
    if (world < 1)
        return kvs_fail(KVS_ERR_INVALID, "--tensor-parallel-size %d: must be at least 1", world);
    if (cfg->n_kv_heads % world)
        return kvs_fail(KVS_ERR_INVALID,
                        "--tensor-parallel-size %d does not divide the model's %d KV heads (num_key_value_heads)",
                        world, cfg->n_kv_heads);
    if (cfg->n_heads % world)
        return kvs_fail(KVS_ERR_INVALID,
                        "--tensor-parallel-size %d does not divide the model's %d attention heads "
                        "(num_attention_heads)",
                        world, cfg->n_heads);
    if (cfg->intermediate_size % world)
        return kvs_fail(KVS_ERR_INVALID,
                        "--tensor-parallel-size %d does not divide the model's MLP size %d (intermediate_size)",
                        world, cfg->intermediate_size);
    if (n_devices >= 0 && world > n_devices)
        return kvs_fail(KVS_ERR_INVALID, "--tensor-parallel-size %d exceeds the %d GPU%s present", world, n_devices,
                        n_devices == 1 ? "" : "s");
    return KVS_OK;
}

kvs_status kvs_shard_dims(const kvs_config *cfg, int rank, int world, kvs_shard *out) {
    KVS_TRY(kvs_tp_validate(cfg, world, -1));
    if (rank < 0 || rank >= world)
        return kvs_fail(KVS_ERR_INVALID, "tensor parallel: rank %d out of range for %d ranks", rank, world);
    int pad = (cfg->vocab_size + world - 1) / world, begin = rank * pad;
    int count = cfg->vocab_size - begin;
    if (count > pad) count = pad;
    if (count < 0) count = 0;
    *out = (kvs_shard){rank, world, cfg->n_heads / world, cfg->n_kv_heads / world, cfg->intermediate_size / world,
                       begin, count, pad};
    return KVS_OK;
}

static void *weights_alloc(kvs_model *m, size_t bytes) {
    return m->be->alloc_weights ? m->be->alloc_weights(m->be, bytes) : m->be->alloc(m->be, bytes);
}

/* Uploads rows [r0, r0 + nr) x columns [c0, c0 + nc) of a weight (nr or nc < 0:
 * all of them; 1-D tensors are one column) to *dst + offset_elems, allocating
 * *dst with alloc_elems elements (0: the slice's) when it is NULL. A column
 * slice (row-parallel weights) is gathered on the host first, so every
 * backend gets one upload per weight. */
static kvs_status upload_slice(kvs_model *m, kvs_checkpoint *ck, kvs_weight_kind kind, int layer, int64_t r0,
                               int64_t nr, int64_t c0, int64_t nc, void **dst, size_t offset_elems,
                               size_t alloc_elems) {
    kvs_dummy_weight dw;
    if (m->be->dummy_fill && kvs_checkpoint_dummy_weight(ck, kind, layer, &dw)) {
        /* dummy weights: the backend makes the slice itself (no host tensor, no copy) */
        if (nr < 0) r0 = 0, nr = dw.rows;
        if (nc < 0) c0 = 0, nc = dw.cols;
        if (r0 < 0 || c0 < 0 || r0 + nr > dw.rows || c0 + nc > dw.cols)
            return kvs_fail(KVS_ERR_INVALID, "model: dummy weight %d of layer %d has no slice rows %lld+%lld", (int)kind,
                            layer, (long long)r0, (long long)nr);
        size_t n = (size_t)nr * (size_t)nc, ws = kvs_dtype_size(m->be->weight_dtype);
        if (!*dst) *dst = weights_alloc(m, (alloc_elems ? alloc_elems : n) * ws);
        if (!*dst) return kvs_fail(KVS_ERR_NOMEM, "model: out of backend memory for weights");
        m->be->dummy_fill(m->be, (char *)*dst + offset_elems * ws, dw.seed, dw.scale, dw.dtype, dw.cols, r0, nr, c0,
                          nc);
        return KVS_OK;
    }
    kvs_host_tensor t;
    KVS_TRY(kvs_checkpoint_read(ck, kind, layer, &t));
    if (t.dtype == KVS_F8_E4M3) /* FP8 codes go through copy_fp8, never a conversion */
        return kvs_fail(KVS_ERR_INTERNAL, "model: FP8 weight %d of layer %d reached a conversion", (int)kind, layer);
    int64_t rows = t.shape[0], cols = t.ndim == 2 ? t.shape[1] : 1;
    if (nr < 0) r0 = 0, nr = rows;
    if (nc < 0) c0 = 0, nc = cols;
    if (r0 < 0 || c0 < 0 || r0 + nr > rows || c0 + nc > cols) {
        char name[160];
        kvs_weight_name(kind, layer, name, sizeof name);
        return kvs_fail(KVS_ERR_INVALID, "model: %s [%lld, %lld] has no slice rows %lld+%lld, columns %lld+%lld",
                        name, (long long)rows, (long long)cols, (long long)r0, (long long)nr, (long long)c0,
                        (long long)nc);
    }
    size_t n = (size_t)nr * (size_t)nc, es = kvs_dtype_size(t.dtype);
    if (!*dst) {
        *dst = weights_alloc(m, (alloc_elems ? alloc_elems : n) * kvs_dtype_size(m->be->weight_dtype));
        if (!*dst) return kvs_fail(KVS_ERR_NOMEM, "model: out of backend memory for weights");
    }
    void *to = (char *)*dst + offset_elems * kvs_dtype_size(m->be->weight_dtype);
    const char *from = (const char *)t.data + ((size_t)r0 * (size_t)cols + (size_t)c0) * es;
    if (nc == cols || nr <= 1) { /* contiguous */
        m->be->upload_weight(m->be, to, from, t.dtype, n);
        return KVS_OK;
    }
    char *staging = malloc(n * es);
    if (!staging) return kvs_fail(KVS_ERR_NOMEM, "model: out of host memory slicing weights");
    for (int64_t r = 0; r < nr; r++) memcpy(staging + (size_t)r * nc * es, from + (size_t)r * cols * es, nc * es);
    m->be->upload_weight(m->be, to, staging, t.dtype, n);
    free(staging);
    return KVS_OK;
}

static kvs_status upload(kvs_model *m, kvs_checkpoint *ck, kvs_weight_kind kind, int layer, void **dst) {
    return upload_slice(m, ck, kind, layer, 0, -1, 0, -1, dst, 0, 0);
}

static kvs_status upload_rows(kvs_model *m, kvs_checkpoint *ck, kvs_weight_kind kind, int layer, int64_t r0,
                              int64_t nr, void **dst, size_t offset_elems, size_t alloc_elems) {
    return upload_slice(m, ck, kind, layer, r0, nr, 0, -1, dst, offset_elems, alloc_elems);
}

/* One backend allocation for all of a layer's weights, each part 256-byte
 * aligned: a few large allocations instead of many (the CPU backend backs
 * large ones with huge pages, which stream faster). With fp8 the four linear
 * weights are E4M3 codes (a byte each), followed by their f32 scales. */
static kvs_status alloc_layer(kvs_model *m, kvs_checkpoint *ck, int l, int64_t qn, int64_t kn, int64_t in) {
    const kvs_config *c = &m->cfg;
    kvs_layer_weights *w = &m->layers[l];
    int64_t h = c->hidden_size, bias = c->attention_bias ? 1 : 0, fp8 = c->quantization == KVS_QUANT_FP8;
    int64_t qk_norm = c->qk_norm ? c->head_dim : 0;
    size_t ws = kvs_dtype_size(m->be->weight_dtype), ls = fp8 ? 1 : ws; /* linear weights: codes or weight_dtype */
    int64_t qkv = qn + 2 * kn;
    void **part[] = {&w->attn_norm, &w->w_qkv, &w->b_qkv, &w->wo, &w->mlp_norm, &w->w_gate_up, &w->w_down,
                     (void **)&w->s_qkv, (void **)&w->so, (void **)&w->s_gate_up, (void **)&w->s_down,
                     &w->q_norm, &w->k_norm};
    int64_t elems[] = {h, qkv * h, bias * qkv, h * qn, h, 2 * in * h, h * in, fp8 * qkv, fp8 * h, fp8 * 2 * in, fp8 * h,
                       qk_norm, qk_norm};
    size_t size[] = {ws, ls, ws, ls, ws, ls, ls, 4, 4, 4, 4, ws, ws};
    if (kvs_quantization_is_ggml(c->quantization)) { /* the linear weights in ggml blocks: bytes, not elements */
        const kvs_weight_kind qkv_k[] = {KVS_W_Q, KVS_W_K, KVS_W_V}, o_k[] = {KVS_W_O},
                              gu_k[] = {KVS_W_GATE, KVS_W_UP}, down_k[] = {KVS_W_DOWN};
        const int64_t qkv_r[] = {qn, kn, kn}, o_r[] = {h}, gu_r[] = {in, in}, down_r[] = {h};
        KVS_TRY(kvs_ggml_weight_plan(m, ck, qkv_k, 3, l, qkv_r, h, &w->g_qkv));
        KVS_TRY(kvs_ggml_weight_plan(m, ck, o_k, 1, l, o_r, qn, &w->g_o));
        KVS_TRY(kvs_ggml_weight_plan(m, ck, gu_k, 2, l, gu_r, h, &w->g_gate_up));
        KVS_TRY(kvs_ggml_weight_plan(m, ck, down_k, 1, l, down_r, in, &w->g_down));
        const kvs_ggml_weight *g[] = {NULL, &w->g_qkv, NULL, &w->g_o, NULL, &w->g_gate_up, &w->g_down};
        for (int i = 0; i < 7; i++)
            if (g[i] && g[i]->n_parts) elems[i] = (int64_t)kvs_ggml_weight_bytes(g[i]), size[i] = 1;
    }
    enum { N_PARTS = sizeof elems / sizeof elems[0] };
    size_t total = 0;
    for (int i = 0; i < N_PARTS; i++) total += ((size_t)elems[i] * size[i] + 255) / 256 * 256;
    w->arena = weights_alloc(m, total);
    w->arena_bytes = total;
    if (!w->arena) return kvs_fail(KVS_ERR_NOMEM, "model: out of backend memory for weights");
    size_t at = 0;
    for (int i = 0; i < N_PARTS; i++) {
        *part[i] = elems[i] ? (char *)w->arena + at : NULL;
        at += ((size_t)elems[i] * size[i] + 255) / 256 * 256;
    }
    return KVS_OK;
}

/* An FP8 checkpoint's weight: rows [r0, r0 + nr) x columns [c0, c0 + nc) of
 * its codes copied to codes, their rows' scales (the checkpoint's, a
 * per-tensor one repeated) to scale: exactly as stored, no requantization. */
static kvs_status copy_fp8(kvs_model *m, kvs_checkpoint *ck, kvs_weight_kind kind, int layer, int64_t r0, int64_t nr,
                           int64_t c0, int64_t nc, uint8_t *codes, float *scale) {
    kvs_host_tensor t;
    KVS_TRY(kvs_checkpoint_read(ck, kind, layer, &t));
    int64_t cols = t.shape[1];
    if (t.ndim != 2 || r0 < 0 || c0 < 0 || r0 + nr > t.shape[0] || c0 + nc > cols)
        return kvs_fail(KVS_ERR_INVALID, "model: FP8 weight %d of layer %d has no slice rows %lld+%lld, columns "
                        "%lld+%lld", (int)kind, layer, (long long)r0, (long long)nr, (long long)c0, (long long)nc);
    const uint8_t *from = (const uint8_t *)t.data + (size_t)r0 * (size_t)cols + (size_t)c0;
    size_t n = (size_t)nr * (size_t)nc;
    uint8_t *gathered = nc == cols ? NULL : malloc(n ? n : 1);
    float *s = malloc(sizeof(float) * (size_t)(nr ? nr : 1));
    kvs_status st = s && (nc == cols || gathered) ? KVS_OK : kvs_fail(KVS_ERR_NOMEM, "model: out of host memory");
    if (st == KVS_OK) st = kvs_checkpoint_read_scales(ck, kind, layer, r0, nr, s);
    if (st == KVS_OK) {
        for (int64_t r = 0; gathered && r < nr; r++) memcpy(gathered + (size_t)r * nc, from + (size_t)r * cols, nc);
        m->be->to_device(m->be, codes, gathered ? gathered : from, n); /* pageable sources: staged on return */
        m->be->to_device(m->be, scale, s, sizeof(float) * (size_t)nr);
    }
    free(gathered);
    free(s);
    return st;
}

/* A linear weight's rows [r0, r0 + nr) x columns [c0, c0 + nc) into w from its
 * row `at` on (w's rows are nc wide). With fp8, w holds E4M3 codes and scale
 * their rows' scales: the checkpoint's own when it stores FP8, else the
 * weight staged in the backend's dtype and quantized (quantize_fp8, one scale
 * per row: quantizing gate and up apart gives what quantizing them together
 * would). */
static kvs_status upload_linear(kvs_model *m, kvs_checkpoint *ck, kvs_weight_kind kind, int layer, int64_t r0,
                                int64_t nr, int64_t c0, int64_t nc, void *w, float *scale, int64_t at,
                                const kvs_ggml_weight *g) {
    size_t offset = (size_t)at * (size_t)nc;
    if (g && g->n_parts) { /* ggml blocks: the part that starts at row `at` (one rank: whole rows) */
        int part = 0;
        for (int64_t r = 0; part < g->n_parts && r < at; part++) r += g->rows[part];
        return kvs_ggml_weight_upload(m, ck, kind, layer, r0, nr, nc, g, part, w);
    }
    if (m->cfg.quantization != KVS_QUANT_FP8) return upload_slice(m, ck, kind, layer, r0, nr, c0, nc, &w, offset, 0);
    if (kvs_checkpoint_dtype(ck, kind, layer) == KVS_F8_E4M3)
        return copy_fp8(m, ck, kind, layer, r0, nr, c0, nc, (uint8_t *)w + offset, scale + at);
    void *staging = m->staging;
    KVS_TRY(upload_slice(m, ck, kind, layer, r0, nr, c0, nc, &staging, 0, 0));
    m->be->quantize_fp8(m->be, (uint8_t *)w + offset, scale + at, m->staging, m->be->weight_dtype, (int)nr, (int)nc);
    return KVS_OK;
}

static kvs_status upload_layer(kvs_model *m, kvs_checkpoint *ck, int l) {
    const kvs_config *c = &m->cfg;
    const kvs_shard *sh = &m->shard;
    kvs_layer_weights *w = &m->layers[l];
    int64_t hd = c->head_dim, q0 = (int64_t)sh->rank * sh->n_heads * hd, qn = (int64_t)sh->n_heads * hd;
    int64_t k0 = (int64_t)sh->rank * sh->n_kv_heads * hd, kn = (int64_t)sh->n_kv_heads * hd;
    int64_t i0 = (int64_t)sh->rank * sh->intermediate, in = sh->intermediate, h = c->hidden_size;
    KVS_TRY(alloc_layer(m, ck, l, qn, kn, in));
    KVS_TRY(upload(m, ck, KVS_W_ATTN_NORM, l, &w->attn_norm));
    /* column-parallel: this rank's heads are rows of Q, K, V, one above the other (one GEMM) */
    KVS_TRY(upload_linear(m, ck, KVS_W_Q, l, q0, qn, 0, h, w->w_qkv, w->s_qkv, 0, &w->g_qkv));
    KVS_TRY(upload_linear(m, ck, KVS_W_K, l, k0, kn, 0, h, w->w_qkv, w->s_qkv, qn, &w->g_qkv));
    KVS_TRY(upload_linear(m, ck, KVS_W_V, l, k0, kn, 0, h, w->w_qkv, w->s_qkv, qn + kn, &w->g_qkv));
    if (c->attention_bias) {
        KVS_TRY(upload_rows(m, ck, KVS_W_Q_BIAS, l, q0, qn, &w->b_qkv, 0, 0));
        KVS_TRY(upload_rows(m, ck, KVS_W_K_BIAS, l, k0, kn, &w->b_qkv, (size_t)qn, 0));
        KVS_TRY(upload_rows(m, ck, KVS_W_V_BIAS, l, k0, kn, &w->b_qkv, (size_t)(qn + kn), 0));
    }
    if (c->qk_norm) { /* one weight for every head: the same on every rank */
        KVS_TRY(upload(m, ck, KVS_W_Q_NORM, l, &w->q_norm));
        KVS_TRY(upload(m, ck, KVS_W_K_NORM, l, &w->k_norm));
    }
    /* row-parallel: O [hidden, heads * head_dim] keeps the columns of this rank's heads */
    KVS_TRY(upload_linear(m, ck, KVS_W_O, l, 0, h, q0, qn, w->wo, w->so, 0, &w->g_o));
    KVS_TRY(upload(m, ck, KVS_W_MLP_NORM, l, &w->mlp_norm));
    /* gate rows, then up rows */
    KVS_TRY(upload_linear(m, ck, KVS_W_GATE, l, i0, in, 0, h, w->w_gate_up, w->s_gate_up, 0, &w->g_gate_up));
    KVS_TRY(upload_linear(m, ck, KVS_W_UP, l, i0, in, 0, h, w->w_gate_up, w->s_gate_up, in, &w->g_gate_up));
    /* row-parallel: down [hidden, intermediate] keeps this rank's intermediate columns */
    KVS_TRY(upload_linear(m, ck, KVS_W_DOWN, l, 0, h, i0, in, w->w_down, w->s_down, 0, &w->g_down));
    return KVS_OK;
}

/* --quantization fp8: the backend's FP8 ops and GEMM sizes cuBLASLt takes
 * (multiples of 16); the staging buffer for the largest linear weight. */
static kvs_status fp8_prepare(kvs_model *m) {
    const kvs_config *c = &m->cfg;
    const kvs_shard *sh = &m->shard;
    char who[64] = "--quantization fp8"; /* what asks for fp8, in messages */
    if (c->ckpt_quant.fp8) snprintf(who, sizeof who, "FP8 checkpoint (quant_method %s)", c->ckpt_quant.method);
    if (!m->be->quantize_fp8 || !m->be->matmul_fp8 || !m->be->add_rmsnorm_fp8 || !m->be->swiglu_fp8)
        return kvs_fail(KVS_ERR_UNSUPPORTED,
                        "%s: the %s backend has no FP8 here (CUDA needs a GPU of compute capability "
                        "8.9 or later: Ada, Hopper, Blackwell)",
                        who, m->be->name);
    int64_t h = c->hidden_size, qn = (int64_t)sh->n_heads * c->head_dim, kn = (int64_t)sh->n_kv_heads * c->head_dim;
    int64_t in = sh->intermediate;
    const char *names[] = {"hidden_size", "the attention heads x head_dim", "the KV heads x head_dim",
                           "intermediate_size"};
    int64_t dims[] = {h, qn, kn, in};
    for (int i = 0; i < 4; i++)
        if (dims[i] % 16)
            return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: %s (%lld on this rank) is not a multiple of 16", who,
                            names[i], (long long)dims[i]);
    int64_t most = in * h; /* gate, up and down one at a time */
    if (qn * h > most) most = qn * h;
    m->staging = m->be->alloc(m->be, (size_t)most * kvs_dtype_size(m->be->weight_dtype));
    if (!m->staging) return kvs_fail(KVS_ERR_NOMEM, "model: out of backend memory staging weights for fp8");
    return KVS_OK;
}


/* This rank's LM-head rows, zero-padded to vocab_pad rows. When the head is
 * tied and the slice needs no padding it is a view into the embedding. */
static kvs_status upload_lm_head(kvs_model *m, kvs_checkpoint *ck) {
    const kvs_config *c = &m->cfg;
    const kvs_shard *sh = &m->shard;
    kvs_weight_kind kind = c->tie_word_embeddings ? KVS_W_EMBED : KVS_W_LM_HEAD;
    if (c->quantization == KVS_QUANT_GGUF) { /* one rank: no vocabulary slice, no padding */
        if (c->tie_word_embeddings && m->g_embed.n_parts) {
            m->lm_head = m->embed, m->g_lm_head = m->g_embed, m->lm_head_owned = false;
            return KVS_OK;
        }
        const kvs_weight_kind k[] = {KVS_W_LM_HEAD};
        const int64_t rows[] = {c->vocab_size};
        if (!c->tie_word_embeddings) KVS_TRY(kvs_ggml_weight_plan(m, ck, k, 1, -1, rows, c->hidden_size, &m->g_lm_head));
        if (m->g_lm_head.n_parts) {
            m->lm_head_owned = true;
            m->lm_head = weights_alloc(m, kvs_ggml_weight_bytes(&m->g_lm_head));
            if (!m->lm_head) return kvs_fail(KVS_ERR_NOMEM, "model: out of backend memory for weights");
            return kvs_ggml_weight_upload(m, ck, KVS_W_LM_HEAD, -1, 0, c->vocab_size, c->hidden_size, &m->g_lm_head,
                                          0, m->lm_head);
        }
    }
    size_t ws = kvs_dtype_size(m->be->weight_dtype), row = (size_t)c->hidden_size;
    if (c->tie_word_embeddings && sh->vocab_count == sh->vocab_pad) {
        m->lm_head = (char *)m->embed + (size_t)sh->vocab_begin * row * ws;
        m->lm_head_owned = false;
        return KVS_OK;
    }
    m->lm_head_owned = true;
    size_t pad_rows = (size_t)(sh->vocab_pad - sh->vocab_count);
    if (sh->vocab_count > 0) {
        KVS_TRY(upload_rows(m, ck, kind, -1, sh->vocab_begin, sh->vocab_count, &m->lm_head, 0,
                            (size_t)sh->vocab_pad * row));
    } else {
        m->lm_head = weights_alloc(m, (size_t)sh->vocab_pad * row * ws);
        if (!m->lm_head) return kvs_fail(KVS_ERR_NOMEM, "model: out of backend memory for weights");
    }
    if (pad_rows) { /* padding rows give logits the gather and the argmax skip */
        float *zeros = calloc(pad_rows * row, sizeof(float));
        if (!zeros) return kvs_fail(KVS_ERR_NOMEM, "model: out of host memory");
        m->be->upload_weight(m->be, (char *)m->lm_head + (size_t)sh->vocab_count * row * ws, zeros, KVS_F32,
                             pad_rows * row);
        free(zeros);
    }
    return KVS_OK;
}

/* The embedding: in the file's blocks (GGUF), else in weight_dtype. */
static kvs_status upload_embed(kvs_model *m, kvs_checkpoint *ck) {
    const kvs_config *c = &m->cfg;
    const kvs_weight_kind k[] = {KVS_W_EMBED};
    const int64_t rows[] = {c->vocab_size};
    if (c->quantization == KVS_QUANT_GGUF)
        KVS_TRY(kvs_ggml_weight_plan(m, ck, k, 1, -1, rows, c->hidden_size, &m->g_embed));
    if (!m->g_embed.n_parts) return upload(m, ck, KVS_W_EMBED, -1, &m->embed);
    m->embed = weights_alloc(m, kvs_ggml_weight_bytes(&m->g_embed));
    if (!m->embed) return kvs_fail(KVS_ERR_NOMEM, "model: out of backend memory for weights");
    return kvs_ggml_weight_upload(m, ck, KVS_W_EMBED, -1, 0, c->vocab_size, c->hidden_size, &m->g_embed, 0, m->embed);
}

/* Weights in ggml blocks need the backend's matmul_q and one rank; a GGUF
 * file's quantized weights are kept as blocks where they can be, else
 * dequantized at load (said once). */
static kvs_status ggml_prepare(kvs_model *m, kvs_checkpoint *ck) {
    kvs_config *c = &m->cfg;
    bool can = m->be->matmul_q && m->be->embedding_q && m->shard.world == 1;
    if (c->quantization == KVS_QUANT_NONE && kvs_checkpoint_has_quantized(ck)) {
        if (can) c->quantization = KVS_QUANT_GGUF;
        else if (m->shard.rank == 0)
            kvs_log(KVS_LOG_INFO, "GGUF: the quantized weights are dequantized to %s at load (%s%s: no ggml block "
                    "kernels)", kvs_dtype_name(m->be->weight_dtype), m->shard.world > 1 ? "tensor parallelism on " : "",
                    m->be->name);
        return KVS_OK;
    }
    if (!kvs_quantization_is_ggml(c->quantization) || can) return KVS_OK;
    if (m->shard.world > 1)
        return kvs_fail(KVS_ERR_UNSUPPORTED, "--quantization %s: not with --tensor-parallel-size %d (llama.cpp's "
                        "block formats run on one rank)", kvs_quantization_name(c->quantization), m->shard.world);
    return kvs_fail(KVS_ERR_UNSUPPORTED, "--quantization %s: the %s backend has no kernels for llama.cpp's block "
                    "formats (the CPU's); on a GPU use --quantization fp8", kvs_quantization_name(c->quantization),
                    m->be->name);
}

kvs_status kvs_model_create(const kvs_config *cfg, kvs_checkpoint *ck, kvs_backend *be, kvs_model **out) {
    return kvs_model_create_shard(cfg, ck, be, 0, 1, NULL, out);
}

/* The checkpoint's KV-cache scales of this rank's KV heads, every layer. */
static kvs_status load_kv_scales(kvs_model *m, kvs_checkpoint *ck) {
    int kvh = m->shard.n_kv_heads, head0 = m->shard.rank * kvh;
    m->kv_scales = malloc(sizeof(float) * 2 * (size_t)kvh * m->cfg.n_layers);
    if (!m->kv_scales) return kvs_fail(KVS_ERR_NOMEM, "model: out of memory");
    for (int l = 0; l < m->cfg.n_layers; l++) {
        float *k = m->kv_scales + (size_t)l * 2 * kvh;
        KVS_TRY(kvs_checkpoint_kv_scales(ck, l, head0, kvh, k, k + kvh));
    }
    return KVS_OK;
}

kvs_status kvs_model_create_shard(const kvs_config *cfg, kvs_checkpoint *ck, kvs_backend *be, int rank, int world,
                                  kvs_comm *comm, kvs_model **out) {
    *out = NULL;
    kvs_shard shard;
    KVS_TRY(kvs_shard_dims(cfg, rank, world, &shard));
    if (world > 1 && (!comm || comm->rank != rank || comm->world != world))
        return kvs_fail(KVS_ERR_INVALID, "model: rank %d of %d needs a communicator of that rank and world (got %s)",
                        rank, world, comm ? "another" : "none");
    kvs_model *m = calloc(1, sizeof *m);
    if (!m) return kvs_fail(KVS_ERR_NOMEM, "model: out of memory");
    m->cfg = *cfg;
    if (cfg->ckpt_quant.fp8) m->cfg.quantization = KVS_QUANT_FP8; /* its codes are the weights */
    m->be = be;
    m->shard = shard;
    m->comm = world > 1 ? comm : NULL;
    m->layers = calloc((size_t)cfg->n_layers, sizeof(kvs_layer_weights));
    kvs_status st = m->layers ? KVS_OK : kvs_fail(KVS_ERR_NOMEM, "model: out of memory");
    kvs_progress bar;
    bool show = rank == 0; /* one bar for the group */
    if (st == KVS_OK) st = ggml_prepare(m, ck);
    if (st == KVS_OK && m->cfg.quantization == KVS_QUANT_FP8) st = fp8_prepare(m);
    if (show) kvs_progress_start(&bar, "loading weights", cfg->n_layers + 2);
    if (st == KVS_OK) st = upload_embed(m, ck);
    if (st == KVS_OK) st = upload(m, ck, KVS_W_FINAL_NORM, -1, &m->final_norm);
    if (st == KVS_OK) st = upload_lm_head(m, ck);
    if (show) kvs_progress_update(&bar, 2);
    for (int l = 0; l < cfg->n_layers && st == KVS_OK; l++) {
        st = upload_layer(m, ck, l);
        if (show) kvs_progress_update(&bar, 3 + l);
    }
    if (show) kvs_progress_finish(&bar);
    if (m->staging) be->free(be, m->staging); /* waits for the last quantize */
    m->staging = NULL;
    if (st == KVS_OK) {
        float host[1024];
        size_t bytes = sizeof(float) * (size_t)(cfg->head_dim / 2);
        m->inv_freq = be->alloc(be, bytes);
        if (!m->inv_freq || cfg->head_dim / 2 > 1024) {
            st = kvs_fail(KVS_ERR_NOMEM, "model: cannot allocate RoPE tables");
        } else {
            kvs_rope_inv_freq(cfg, host);
            be->to_device(be, m->inv_freq, host, bytes);
        }
    }
    if (st == KVS_OK) st = load_kv_scales(m, ck);
    if (st != KVS_OK) {
        kvs_model_destroy(m);
        return st;
    }
    *out = m;
    return KVS_OK;
}

void kvs_model_destroy(kvs_model *m) {
    if (!m) return;
    kvs_backend *be = m->be;
    if (m->layers) {
        for (int l = 0; l < m->cfg.n_layers; l++) {
            if (m->layers[l].arena) be->free(be, m->layers[l].arena);
        }
        free(m->layers);
    }
    if (m->lm_head && m->lm_head_owned) be->free(be, m->lm_head);
    if (m->embed) be->free(be, m->embed); /* a tied ggml LM head is this memory too (not owned) */
    if (m->final_norm) be->free(be, m->final_norm);
    if (m->inv_freq) be->free(be, m->inv_freq);
    free(m->kv_scales);
    if (m->staging) be->free(be, m->staging);
    free(m);
}

const kvs_config *kvs_model_config(const kvs_model *m) { return &m->cfg; }

size_t kvs_model_weight_bytes_read(const kvs_model *m) {
    size_t ws = kvs_dtype_size(m->be->weight_dtype), h = (size_t)m->cfg.hidden_size, total = h * ws; /* final norm */
    for (int l = 0; l < m->cfg.n_layers; l++) total += m->layers[l].arena_bytes;
    if (m->g_lm_head.n_parts) return total + kvs_ggml_weight_bytes(&m->g_lm_head);
    return total + (size_t)m->shard.vocab_pad * h * ws;
}
const kvs_shard *kvs_model_shard(const kvs_model *m) { return &m->shard; }
const float *kvs_model_kv_scales(const kvs_model *m) { return m->kv_scales; }
kvs_backend *kvs_model_backend(const kvs_model *m) { return m->be; }
kvs_comm *kvs_model_comm(const kvs_model *m) { return m->comm; }

