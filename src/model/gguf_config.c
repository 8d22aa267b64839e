/* A GGUF file's hyper-parameters as a config: its `llama.*` metadata written
 * as the config.json it stands for, then parsed by kvs_config_parse, so a
 * GGUF model passes the same checks as a Hugging Face one. */
#include "gguf/gguf.h"
#include "model/model_internal.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

/* GGUF architectures and the config.json architecture each stands for. Mistral's
 * GGUF files are "llama" too. */
static const char *const archs[][2] = {
    {"llama", "LlamaForCausalLM"}, {"qwen2", "Qwen2ForCausalLM"}, {"qwen3", "Qwen3ForCausalLM"}};

typedef struct {
    const kvs_gguf *g;
    const char *arch;
    json_t *cfg;
} builder;

/* Sets field to the integer at arch.suffix (absent: nothing unless required). */
static kvs_status put_int(builder *b, const char *suffix, const char *field, bool required) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", b->arch, suffix);
    int64_t v = INT64_MIN;
    KVS_TRY(kvs_gguf_get_int(b->g, key, required, &v));
    if (v != INT64_MIN && json_object_set_new(b->cfg, field, json_integer(v)))
        return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    return KVS_OK;
}

static kvs_status put_float(builder *b, const char *suffix, const char *field) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", b->arch, suffix);
    double v = 0;
    if (!kvs_gguf_find(b->g, key)) return KVS_OK;
    KVS_TRY(kvs_gguf_get_float(b->g, key, true, &v));
    if (json_object_set_new(b->cfg, field, json_real(v))) return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    return KVS_OK;
}

/* head_dim: key_length, which value_length and rope.dimension_count must
 * equal (the model has one head size and rotates all of it). */
static kvs_status put_head_dim(builder *b) {
    static const char *const keys[] = {"attention.key_length", "attention.value_length", "rope.dimension_count"};
    int64_t dims[3] = {-1, -1, -1};
    for (int i = 0; i < 3; i++) {
        char key[128];
        snprintf(key, sizeof key, "%s.%s", b->arch, keys[i]);
        KVS_TRY(kvs_gguf_get_int(b->g, key, false, &dims[i]));
    }
    for (int i = 1; i < 3; i++)
        if (dims[i] >= 0 && dims[0] >= 0 && dims[i] != dims[0])
            return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: %s.%s (%lld) differs from %s.%s (%lld): unsupported",
                            b->g->file_name, b->arch, keys[i], (long long)dims[i], b->arch, keys[0], (long long)dims[0]);
    if (dims[0] >= 0) return put_int(b, "attention.key_length", "head_dim", true);
    return KVS_OK;
}

/* rope.scaling.type: none, or linear with rope.scaling.factor; others refused. */
static kvs_status put_rope_scaling(builder *b) {
    char key[128];
    snprintf(key, sizeof key, "%s.rope.scaling.type", b->arch);
    kvs_gguf_str type = {"none", 4};
    KVS_TRY(kvs_gguf_get_str(b->g, key, false, &type));
    if (type.len == 4 && !memcmp(type.s, "none", 4)) return KVS_OK;
    if (!(type.len == 6 && !memcmp(type.s, "linear", 6)))
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: %s '%.*s' is unsupported (supported: none, linear)", b->g->file_name,
                        key, (int)(type.len > 32 ? 32 : type.len), type.s);
    snprintf(key, sizeof key, "%s.rope.scaling.factor", b->arch);
    double factor;
    KVS_TRY(kvs_gguf_get_float(b->g, key, true, &factor));
    json_t *sc = json_pack("{s:s, s:f}", "rope_type", "linear", "factor", factor);
    if (!sc || json_object_set_new(b->cfg, "rope_scaling", sc)) return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    return KVS_OK;
}

/* The vocabulary's size: the token list's length (else arch.vocab_size, else
 * the embedding's rows). */
static kvs_status put_vocab(builder *b) {
    const kvs_gguf_kv *tokens;
    KVS_TRY(kvs_gguf_get_array(b->g, "tokenizer.ggml.tokens", KVS_GGUF_STRING, false, &tokens));
    if (tokens) return json_object_set_new(b->cfg, "vocab_size", json_integer((json_int_t)tokens->count))
                           ? kvs_fail(KVS_ERR_NOMEM, "out of memory") : KVS_OK;
    char key[128];
    snprintf(key, sizeof key, "%s.vocab_size", b->arch);
    if (kvs_gguf_find(b->g, key)) return put_int(b, "vocab_size", "vocab_size", true);
    const kvs_gguf_tensor *e = kvs_gguf_find_tensor(b->g, "token_embd.weight");
    if (!e) return kvs_fail(KVS_ERR_FORMAT, "%s: no tokenizer.ggml.tokens, %s or token_embd.weight to size the vocabulary",
                            b->g->file_name, key);
    return json_object_set_new(b->cfg, "vocab_size", json_integer(e->ne[1])) ? kvs_fail(KVS_ERR_NOMEM, "out of memory")
                                                                             : KVS_OK;
}

/* bos, and as eos every end-of-generation id the file names (eos, eot, eom), as llama.cpp stops on each. */
static kvs_status put_special_ids(builder *b) {
    int64_t bos = -1;
    KVS_TRY(kvs_gguf_get_int(b->g, "tokenizer.ggml.bos_token_id", false, &bos));
    if (bos >= 0 && json_object_set_new(b->cfg, "bos_token_id", json_integer(bos)))
        return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    static const char *const eos_keys[] = {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                           "tokenizer.ggml.eom_token_id"};
    json_t *eos = json_array();
    if (!eos || json_object_set_new(b->cfg, "eos_token_id", eos)) return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    for (int i = 0; i < 3; i++) {
        int64_t id = -1;
        KVS_TRY(kvs_gguf_get_int(b->g, eos_keys[i], false, &id));
        if (id >= 0 && json_array_append_new(eos, json_integer(id))) return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    }
    return KVS_OK;
}

/* The dtype the model runs in: the embedding's if it is F32/F16/BF16; float32
 * for quantized files (their weights are dequantized to f32 at load, exactly). */
static const char *torch_dtype(const kvs_gguf *g) {
    const kvs_gguf_tensor *e = kvs_gguf_find_tensor(g, "token_embd.weight");
    if (e && e->type == KVS_GGML_BF16) return "bfloat16";
    if (e && e->type == KVS_GGML_F16) return "float16";
    return "float32";
}

static kvs_status build(builder *b) {
    char key[128];
    snprintf(key, sizeof key, "%s.expert_count", b->arch);
    int64_t experts = 0;
    KVS_TRY(kvs_gguf_get_int(b->g, key, false, &experts));
    if (experts > 0)
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: %s is %lld: mixture-of-experts models are unsupported",
                        b->g->file_name, key, (long long)experts);
    KVS_TRY(put_int(b, "block_count", "num_hidden_layers", true));
    KVS_TRY(put_int(b, "embedding_length", "hidden_size", true));
    KVS_TRY(put_int(b, "feed_forward_length", "intermediate_size", true));
    KVS_TRY(put_int(b, "attention.head_count", "num_attention_heads", true));
    KVS_TRY(put_int(b, "attention.head_count_kv", "num_key_value_heads", false));
    KVS_TRY(put_int(b, "context_length", "max_position_embeddings", false));
    KVS_TRY(put_head_dim(b));
    KVS_TRY(put_float(b, "rope.freq_base", "rope_theta"));
    KVS_TRY(put_float(b, "attention.layer_norm_rms_epsilon", "rms_norm_eps"));
    KVS_TRY(put_rope_scaling(b));
    KVS_TRY(put_vocab(b));
    KVS_TRY(put_special_ids(b));
    bool tied = !kvs_gguf_find_tensor(b->g, "output.weight");
    if (json_object_set_new(b->cfg, "tie_word_embeddings", json_boolean(tied)) ||
        json_object_set_new(b->cfg, "torch_dtype", json_string(torch_dtype(b->g))))
        return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    return KVS_OK;
}

/* rope_freqs.weight (Llama 3.1 / 3.2 as llama.cpp converts them): F32
 * [head_dim / 2], finite and positive, and no rope.scaling beside it. */
static kvs_status read_rope_factors(const kvs_gguf *g, kvs_config *cfg) {
    const kvs_gguf_tensor *t = kvs_gguf_find_tensor(g, "rope_freqs.weight");
    if (!t) return KVS_OK;
    int half = cfg->head_dim / 2;
    if (t->type != KVS_GGML_F32 || t->n_dims != 1 || t->ne[0] != half || half > KVS_MAX_ROPE_FACTORS)
        return kvs_fail(KVS_ERR_FORMAT, "%s: rope_freqs.weight must be F32 [%d] (head_dim / 2)", g->file_name, half);
    if (cfg->rope_type != KVS_ROPE_NONE)
        return kvs_fail(KVS_ERR_FORMAT, "%s: rope_freqs.weight beside rope.scaling: two RoPE scalings",
                        g->file_name);
    for (int i = 0; i < half; i++) {
        float f;
        memcpy(&f, t->data + 4 * (size_t)i, 4);
        if (!(f > 0) || !isfinite(f))
            return kvs_fail(KVS_ERR_FORMAT, "%s: rope_freqs.weight[%d] is %g (must be finite and positive)",
                            g->file_name, i, (double)f);
        cfg->rope_freq_factors[i] = f;
    }
    cfg->rope_type = KVS_ROPE_FACTORS;
    return KVS_OK;
}

kvs_status kvs_gguf_config(const kvs_gguf *g, kvs_config *cfg) {
    kvs_gguf_str arch;
    KVS_TRY(kvs_gguf_get_str(g, "general.architecture", true, &arch));
    const char *hf = NULL, *name = NULL;
    for (size_t i = 0; i < sizeof archs / sizeof archs[0]; i++)
        if (arch.len == strlen(archs[i][0]) && !memcmp(arch.s, archs[i][0], arch.len)) name = archs[i][0], hf = archs[i][1];
    if (!hf)
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: general.architecture '%.*s' is unsupported (supported: llama, "
                        "qwen2, qwen3)",
                        g->file_name, (int)(arch.len > 64 ? 64 : arch.len), arch.s);
    builder b = {g, name, json_pack("{s:[s]}", "architectures", hf)};
    if (!b.cfg) return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    kvs_status s = build(&b);
    char *text = s == KVS_OK ? json_dumps(b.cfg, JSON_COMPACT) : NULL;
    json_decref(b.cfg);
    if (s == KVS_OK && !text) s = kvs_fail(KVS_ERR_NOMEM, "out of memory");
    if (s != KVS_OK) return s;
    char what[300];
    snprintf(what, sizeof what, "%s (its %s.* metadata)", g->file_name, name);
    s = kvs_config_parse(text, strlen(text), what, cfg);
    free(text);
    if (s == KVS_OK) s = read_rope_factors(g, cfg);
    return s;
}

kvs_status kvs_gguf_config_load(const char *path, kvs_config *cfg) {
    kvs_gguf *g;
    KVS_TRY(kvs_gguf_open(path, &g));
    kvs_status s = kvs_gguf_config(g, cfg);
    kvs_gguf_destroy(g);
    return s;
}
