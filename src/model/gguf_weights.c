/* A GGUF file's tensors as the checkpoint's weights: names mapped both ways
 * (token_embd.weight <-> model.embed_tokens.weight, blk.N.attn_q.weight <->
 * model.layers.N.self_attn.q_proj.weight, ...), every tensor of the file
 * checked at open (a tensor the model would not use is refused by name, not
 * dropped), F32 / F16 / BF16 read in place, quantized types dequantized to
 * f32 at read, and the q / k rows of the llama architecture put back in the
 * Hugging Face order. */
#include "gguf/gguf.h"
#include "model/model_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const gguf_suffix[KVS_W_KIND_COUNT] = {
    [KVS_W_EMBED] = "token_embd.weight",      [KVS_W_FINAL_NORM] = "output_norm.weight",
    [KVS_W_LM_HEAD] = "output.weight",        [KVS_W_ATTN_NORM] = "attn_norm.weight",
    [KVS_W_Q] = "attn_q.weight",              [KVS_W_K] = "attn_k.weight",
    [KVS_W_V] = "attn_v.weight",              [KVS_W_Q_BIAS] = "attn_q.bias",
    [KVS_W_K_BIAS] = "attn_k.bias",           [KVS_W_V_BIAS] = "attn_v.bias",
    [KVS_W_O] = "attn_output.weight",         [KVS_W_MLP_NORM] = "ffn_norm.weight",
    [KVS_W_GATE] = "ffn_gate.weight",         [KVS_W_UP] = "ffn_up.weight",
    [KVS_W_DOWN] = "ffn_down.weight",         [KVS_W_Q_NORM] = "attn_q_norm.weight",
    [KVS_W_K_NORM] = "attn_k_norm.weight",
};

void kvs_gguf_weight_name(kvs_weight_kind kind, int layer, char *buf, size_t cap) {
    if (!buf || !cap) return;
    if ((unsigned)kind >= KVS_W_KIND_COUNT) snprintf(buf, cap, "<weight kind %d>", (int)kind);
    else if (kind <= KVS_W_LM_HEAD) snprintf(buf, cap, "%s", gguf_suffix[kind]);
    else snprintf(buf, cap, "blk.%d.%s", layer, gguf_suffix[kind]);
}

bool kvs_gguf_weight_kind(const char *name, kvs_weight_kind *kind, int *layer) {
    for (int k = 0; k <= KVS_W_LM_HEAD; k++)
        if (!strcmp(name, gguf_suffix[k])) return *kind = (kvs_weight_kind)k, *layer = -1, true;
    if (strncmp(name, "blk.", 4) || name[4] < '0' || name[4] > '9') return false;
    char *end;
    long l = strtol(name + 4, &end, 10);
    if (*end != '.' || l > KVS_MAX_LAYERS || (name[4] == '0' && end != name + 5)) return false;
    for (int k = KVS_W_ATTN_NORM; k < KVS_W_KIND_COUNT; k++)
        if (!strcmp(end + 1, gguf_suffix[k])) return *kind = (kvs_weight_kind)k, *layer = (int)l, true;
    return false;
}

struct kvs_gguf_weights {
    kvs_gguf *g;
    kvs_config cfg;
    bool permuted_qk; /* llama: q / k rows interleaved by llama.cpp's converter */
    void *scratch;    /* dequantized or un-permuted weights, the last read's */
    size_t scratch_size;
    size_t total_bytes;
};

void kvs_gguf_weights_destroy(kvs_gguf_weights *w) {
    if (!w) return;
    kvs_gguf_destroy(w->g);
    free(w->scratch);
    free(w);
}

static bool dtype_of(uint32_t type, kvs_dtype *out) {
    if (type == KVS_GGML_F32) *out = KVS_F32;
    else if (type == KVS_GGML_F16) *out = KVS_F16;
    else if (type == KVS_GGML_BF16) *out = KVS_BF16;
    else return false;
    return true;
}

/* The file's tensor for a weight the model uses: present, its shape the
 * config's (GGUF lists dimensions fastest first: ne = [cols, rows]), its type
 * one that can be read. */
static kvs_status check_weight(const kvs_gguf_weights *w, kvs_weight_kind kind, int layer) {
    char name[96], hf[160];
    kvs_gguf_weight_name(kind, layer, name, sizeof name);
    kvs_weight_name(kind, layer, hf, sizeof hf);
    int64_t shape[2];
    int ndim;
    kvs_weight_expected(&w->cfg, kind, shape, &ndim);
    const kvs_gguf_tensor *t = kvs_gguf_find_tensor(w->g, name);
    if (!t) return kvs_fail(KVS_ERR_FORMAT, "%s: missing tensor '%s' (%s)", w->g->file_name, name, hf);
    bool same = t->n_dims == ndim && t->ne[0] == shape[ndim - 1] && (ndim == 1 || t->ne[1] == shape[0]);
    if (!same) {
        char want[64];
        if (ndim == 2) snprintf(want, sizeof want, "[%lld, %lld]", (long long)shape[1], (long long)shape[0]);
        else snprintf(want, sizeof want, "[%lld]", (long long)shape[0]);
        return kvs_fail(KVS_ERR_FORMAT, "%s: tensor '%s' has %d dimensions [%lld, %lld, ...], expected %s (fastest "
                        "first) from its metadata", w->g->file_name, name, t->n_dims, (long long)t->ne[0],
                        (long long)t->ne[1], want);
    }
    if (!kvs_ggml_can_dequantize(t->type)) {
        kvs_ggml_layout lay;
        kvs_ggml_type_layout(t->type, &lay);
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: tensor '%s' has ggml type %s, unsupported (supported: F32, F16, "
                        "BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)", w->g->file_name, name, lay.name);
    }
    return KVS_OK;
}

/* Every tensor of the file is a weight the model uses. */
static kvs_status check_all_used(const kvs_gguf_weights *w) {
    for (size_t i = 0; i < w->g->n_tensors; i++) {
        const kvs_gguf_tensor *t = &w->g->tensors[i];
        if (!strcmp(t->name, "rope_freqs.weight")) continue; /* the config's (gguf_config.c) */
        kvs_weight_kind kind;
        int layer, ndim;
        int64_t shape[2];
        bool known = kvs_gguf_weight_kind(t->name, &kind, &layer);
        if (known && layer >= w->cfg.n_layers)
            return kvs_fail(KVS_ERR_FORMAT, "%s: tensor '%s' is beyond the model's %d layers", w->g->file_name,
                            t->name, w->cfg.n_layers);
        if (!known || !kvs_weight_expected(&w->cfg, kind, shape, &ndim))
            return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: tensor '%s' is not a weight kvsparse's %s model uses (refused "
                            "rather than left out)", w->g->file_name, t->name, w->cfg.architecture);
    }
    return KVS_OK;
}

kvs_status kvs_gguf_weights_open(const char *path, const kvs_config *cfg, kvs_gguf_weights **out) {
    *out = NULL;
    kvs_gguf_weights *w = calloc(1, sizeof *w);
    if (!w) return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    w->cfg = *cfg;
    w->permuted_qk = !strcmp(cfg->architecture, "LlamaForCausalLM");
    kvs_status s = kvs_gguf_open(path, &w->g);
    if (s == KVS_OK) s = check_all_used(w);
    int64_t shape[2];
    int ndim;
    for (int layer = -1, k = -1; s == KVS_OK && kvs_weight_next(cfg, &layer, &k, shape, &ndim);)
        s = check_weight(w, (kvs_weight_kind)k, layer);
    for (size_t i = 0; s == KVS_OK && i < w->g->n_tensors; i++) w->total_bytes += w->g->tensors[i].nbytes;
    if (s != KVS_OK) {
        kvs_gguf_weights_destroy(w);
        return s;
    }
    *out = w;
    return KVS_OK;
}

size_t kvs_gguf_weights_bytes(const kvs_gguf_weights *w) { return w ? w->total_bytes : 0; }

static const kvs_gguf_tensor *tensor_of(const kvs_gguf_weights *w, kvs_weight_kind kind, int layer) {
    char name[96];
    kvs_gguf_weight_name(kind, layer, name, sizeof name);
    return kvs_gguf_find_tensor(w->g, name);
}

kvs_dtype kvs_gguf_weights_dtype(const kvs_gguf_weights *w, kvs_weight_kind kind, int layer) {
    const kvs_gguf_tensor *t = tensor_of(w, kind, layer);
    kvs_dtype d = KVS_F32;
    if (t) dtype_of(t->type, &d);
    return d; /* quantized types are read as f32 */
}

static kvs_status grow_scratch(kvs_gguf_weights *w, size_t bytes) {
    if (bytes <= w->scratch_size) return KVS_OK;
    free(w->scratch);
    w->scratch_size = 0;
    w->scratch = kvs_aligned_alloc(bytes);
    if (!w->scratch) return kvs_fail(KVS_ERR_NOMEM, "%s: out of memory for a %zu-byte buffer", w->g->file_name, bytes);
    w->scratch_size = bytes;
    return KVS_OK;
}

/* llama.cpp's converter stores the rows of each head of q / k (head_dim rows:
 * two halves of head_dim / 2, Hugging Face's rotate-half layout) interleaved,
 * for RoPE on adjacent pairs: GGUF row 2i + s of a head is HF row s * head_dim / 2 + i.
 * Puts src's rows back into dst in HF order. */
static void unpermute_rows(const uint8_t *src, uint8_t *dst, int64_t rows, size_t row_bytes, int head_dim) {
    int half = head_dim / 2;
    for (int64_t r = 0; r < rows; r++) {
        int64_t head = r / head_dim, j = r % head_dim, s = j / half, i = j % half;
        memcpy(dst + (size_t)r * row_bytes, src + (size_t)(head * head_dim + 2 * i + s) * row_bytes, row_bytes);
    }
}

kvs_status kvs_gguf_weights_read(kvs_gguf_weights *w, kvs_weight_kind kind, int layer, kvs_host_tensor *out) {
    const kvs_gguf_tensor *t = tensor_of(w, kind, layer);
    if (!t) return kvs_fail(KVS_ERR_INTERNAL, "%s: a weight vanished after the check", w->g->file_name);
    int64_t cols = t->ne[0], rows = t->n_dims == 2 ? t->ne[1] : 1, n = rows * cols;
    bool permute = w->permuted_qk && (kind == KVS_W_Q || kind == KVS_W_K);
    kvs_dtype d;
    bool plain = dtype_of(t->type, &d);
    if (plain && !permute) {
        out->dtype = d;
        out->data = t->data;
        out->nbytes = t->nbytes;
        return KVS_OK;
    }
    if (!plain) d = KVS_F32;
    size_t bytes = (size_t)n * kvs_dtype_size(d);
    KVS_TRY(grow_scratch(w, permute && !plain ? 2 * bytes : bytes)); /* dequantized, then un-permuted */
    uint8_t *dst = w->scratch;
    const uint8_t *src = t->data;
    if (!plain) {
        char what[160];
        snprintf(what, sizeof what, "%s: tensor '%s'", w->g->file_name, t->name);
        float *deq = (float *)(permute ? dst + bytes : dst);
        KVS_TRY(kvs_ggml_dequantize(t->type, t->data, deq, n, what));
        src = (const uint8_t *)deq;
    }
    if (permute) unpermute_rows(src, dst, rows, (size_t)cols * kvs_dtype_size(d), w->cfg.head_dim);
    out->dtype = d;
    out->data = dst;
    out->nbytes = bytes;
    return KVS_OK;
}

uint32_t kvs_gguf_weights_type(const kvs_gguf_weights *w, kvs_weight_kind kind, int layer) {
    const kvs_gguf_tensor *t = tensor_of(w, kind, layer);
    return t ? t->type : KVS_GGML_F32;
}

kvs_status kvs_gguf_weights_read_blocks(kvs_gguf_weights *w, kvs_weight_kind kind, int layer, kvs_ggml_rows *out) {
    const kvs_gguf_tensor *t = tensor_of(w, kind, layer);
    if (!t) return kvs_fail(KVS_ERR_INTERNAL, "%s: a weight vanished after the check", w->g->file_name);
    int64_t rows = t->n_dims == 2 ? t->ne[1] : 1;
    out->type = t->type;
    out->rows = rows;
    out->row_bytes = t->nbytes / (size_t)rows;
    out->data = t->data;
    if (!(w->permuted_qk && (kind == KVS_W_Q || kind == KVS_W_K))) return KVS_OK;
    /* a row's blocks move with it: the permutation is of whole rows */
    KVS_TRY(grow_scratch(w, t->nbytes));
    unpermute_rows(t->data, w->scratch, rows, out->row_bytes, w->cfg.head_dim);
    out->data = w->scratch;
    return KVS_OK;
}
