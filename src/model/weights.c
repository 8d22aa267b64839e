/* Weight names (Hugging Face layout) and their shapes from the config. */
#include "model/model.h"

#include <stdio.h>

static const char *const weight_suffix[KVS_W_KIND_COUNT] = {
    [KVS_W_EMBED] = "model.embed_tokens.weight",
    [KVS_W_FINAL_NORM] = "model.norm.weight",
    [KVS_W_LM_HEAD] = "lm_head.weight",
    [KVS_W_ATTN_NORM] = "input_layernorm.weight",
    [KVS_W_Q] = "self_attn.q_proj.weight",
    [KVS_W_K] = "self_attn.k_proj.weight",
    [KVS_W_V] = "self_attn.v_proj.weight",
    [KVS_W_Q_BIAS] = "self_attn.q_proj.bias",
    [KVS_W_K_BIAS] = "self_attn.k_proj.bias",
    [KVS_W_V_BIAS] = "self_attn.v_proj.bias",
    [KVS_W_O] = "self_attn.o_proj.weight",
    [KVS_W_MLP_NORM] = "post_attention_layernorm.weight",
    [KVS_W_GATE] = "mlp.gate_proj.weight",
    [KVS_W_UP] = "mlp.up_proj.weight",
    [KVS_W_DOWN] = "mlp.down_proj.weight",
    [KVS_W_Q_NORM] = "self_attn.q_norm.weight",
    [KVS_W_K_NORM] = "self_attn.k_norm.weight",
};

void kvs_weight_name(kvs_weight_kind kind, int layer, char *buf, size_t cap) {
    if (!buf || cap == 0) return;
    if ((unsigned)kind >= KVS_W_KIND_COUNT) {
        snprintf(buf, cap, "<weight kind %d>", (int)kind);
    } else if (kind <= KVS_W_LM_HEAD) {
        snprintf(buf, cap, "%s", weight_suffix[kind]);
    } else {
        snprintf(buf, cap, "model.layers.%d.%s", layer, weight_suffix[kind]);
    }
}

bool kvs_weight_is_linear(kvs_weight_kind kind) {
    return kind == KVS_W_Q || kind == KVS_W_K || kind == KVS_W_V || kind == KVS_W_O || kind == KVS_W_GATE ||
           kind == KVS_W_UP || kind == KVS_W_DOWN;
}

static bool set_shape(int64_t shape[2], int *ndim, int64_t rows, int64_t cols) {
    shape[0] = rows;
    shape[1] = cols;
    *ndim = cols > 0 ? 2 : 1;
    if (cols <= 0) shape[1] = 0;
    return true;
}

bool kvs_weight_expected(const kvs_config *cfg, kvs_weight_kind kind, int64_t shape[2], int *ndim) {
    int64_t hidden = cfg->hidden_size, inter = cfg->intermediate_size, vocab = cfg->vocab_size;
    int64_t q_out = (int64_t)cfg->n_heads * cfg->head_dim, kv_out = (int64_t)cfg->n_kv_heads * cfg->head_dim;
    switch (kind) {
    case KVS_W_EMBED: return set_shape(shape, ndim, vocab, hidden);
    case KVS_W_FINAL_NORM: return set_shape(shape, ndim, hidden, 0);
    case KVS_W_LM_HEAD:
        if (cfg->tie_word_embeddings) return false;
        return set_shape(shape, ndim, vocab, hidden);
    case KVS_W_ATTN_NORM: return set_shape(shape, ndim, hidden, 0);
    case KVS_W_Q: return set_shape(shape, ndim, q_out, hidden);
    case KVS_W_K: return set_shape(shape, ndim, kv_out, hidden);
    case KVS_W_V: return set_shape(shape, ndim, kv_out, hidden);
    case KVS_W_Q_BIAS:
        if (!cfg->attention_bias) return false;
        return set_shape(shape, ndim, q_out, 0);
    case KVS_W_K_BIAS:
    case KVS_W_V_BIAS:
        if (!cfg->attention_bias) return false;
        return set_shape(shape, ndim, kv_out, 0);
    case KVS_W_O: return set_shape(shape, ndim, hidden, q_out);
    case KVS_W_MLP_NORM: return set_shape(shape, ndim, hidden, 0);
    case KVS_W_GATE: return set_shape(shape, ndim, inter, hidden);
    case KVS_W_UP: return set_shape(shape, ndim, inter, hidden);
    case KVS_W_DOWN: return set_shape(shape, ndim, hidden, inter);
    case KVS_W_Q_NORM:
    case KVS_W_K_NORM:
        if (!cfg->qk_norm) return false;
        return set_shape(shape, ndim, cfg->head_dim, 0);
    default: return false;
    }
}

bool kvs_weight_next(const kvs_config *cfg, int *layer, int *kind, int64_t shape[2], int *ndim) {
    for (;;) {
        if (++*kind == KVS_W_KIND_COUNT) {
            *kind = 0;
            if (++*layer == cfg->n_layers) return false;
        }
        bool global = *kind < KVS_W_ATTN_NORM;
        if (global == (*layer < 0) && kvs_weight_expected(cfg, (kvs_weight_kind)*kind, shape, ndim)) return true;
    }
}
