/* config.json (+ generation_config.json) for Llama, Mistral, Qwen2 and Qwen3 models. */
#include "model/model_internal.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Sane upper limits: large enough for any released Llama-family model, small
 * enough that every shape product below fits comfortably in int64. */
#define KVS_MAX_HIDDEN (1 << 17)
#define KVS_MAX_HEADS 1024
#define KVS_MAX_HEAD_DIM 1024
#define KVS_MAX_INTERMEDIATE (1 << 20)
#define KVS_MAX_VOCAB (1 << 24)
#define KVS_MAX_POSITIONS (1 << 30)

static const char *const supported_archs[][2] = {
    {"LlamaForCausalLM", "llama"},
    {"MistralForCausalLM", "mistral"},
    {"Qwen2ForCausalLM", "qwen2"},
    {"Qwen3ForCausalLM", "qwen3"},
};
#define N_ARCHS (sizeof supported_archs / sizeof supported_archs[0])

/* An integer field in [lo, hi]; *present tells whether it was there (and not null). */
static kvs_status get_int(const json_t *obj, const char *key, const char *field, const char *name,
                          bool required, long long lo, long long hi, int *out, bool *present) {
    const json_t *v = json_object_get(obj, key);
    if (present) *present = false;
    if (!v || json_is_null(v)) {
        if (required) return kvs_fail(KVS_ERR_FORMAT, "%s: field '%s' is missing", name, field);
        return KVS_OK;
    }
    if (!json_is_integer(v)) {
        if (lo >= 1) return kvs_fail(KVS_ERR_FORMAT, "%s: field '%s' must be a positive integer", name, field);
        return kvs_fail(KVS_ERR_FORMAT, "%s: field '%s' must be an integer", name, field);
    }
    long long x = json_integer_value(v);
    if (x < lo) {
        if (lo == 1) return kvs_fail(KVS_ERR_FORMAT, "%s: field '%s' must be a positive integer", name, field);
        return kvs_fail(KVS_ERR_FORMAT, "%s: field '%s' must be at least %lld (got %lld)", name, field, lo, x);
    }
    if (x > hi)
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: field '%s' is %lld, larger than the supported maximum %lld",
                        name, field, x, hi);
    *out = (int)x;
    if (present) *present = true;
    return KVS_OK;
}

/* A positive finite number field. */
static kvs_status get_positive(const json_t *obj, const char *key, const char *field, const char *name,
                               bool required, float *out) {
    const json_t *v = json_object_get(obj, key);
    if (!v || json_is_null(v)) {
        if (required) return kvs_fail(KVS_ERR_FORMAT, "%s: field '%s' is missing", name, field);
        return KVS_OK;
    }
    if (!json_is_number(v)) return kvs_fail(KVS_ERR_FORMAT, "%s: field '%s' must be a positive number", name, field);
    double x = json_number_value(v);
    if (!(x > 0) || !isfinite((float)x) || (float)x <= 0)
        return kvs_fail(KVS_ERR_FORMAT, "%s: field '%s' must be a positive number", name, field);
    *out = (float)x;
    return KVS_OK;
}

static kvs_status get_bool(const json_t *obj, const char *key, const char *name, bool *out) {
    const json_t *v = json_object_get(obj, key);
    if (!v || json_is_null(v)) return KVS_OK;
    if (!json_is_boolean(v)) return kvs_fail(KVS_ERR_FORMAT, "%s: field '%s' must be true or false", name, key);
    *out = json_is_true(v);
    return KVS_OK;
}

static kvs_status parse_architecture(const json_t *root, const char *name, kvs_config *cfg) {
    const json_t *archs = json_object_get(root, "architectures");
    const char *arch = NULL;
    if (archs && !json_is_null(archs)) {
        if (!json_is_array(archs) || json_array_size(archs) == 0 || !json_is_string(json_array_get(archs, 0)))
            return kvs_fail(KVS_ERR_FORMAT, "%s: field 'architectures' must be a non-empty list of strings", name);
        arch = json_string_value(json_array_get(archs, 0));
        for (size_t i = 0; i < N_ARCHS; i++)
            if (!strcmp(arch, supported_archs[i][0])) {
                snprintf(cfg->architecture, sizeof cfg->architecture, "%s", arch);
                return KVS_OK;
            }
        return kvs_fail(KVS_ERR_UNSUPPORTED,
                        "%s: architecture '%.100s' is unsupported (supported: LlamaForCausalLM, "
                        "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)", name, arch);
    }
    const json_t *mt = json_object_get(root, "model_type");
    if (!mt || json_is_null(mt))
        return kvs_fail(KVS_ERR_FORMAT, "%s: field 'architectures' is missing (and no 'model_type')", name);
    if (!json_is_string(mt)) return kvs_fail(KVS_ERR_FORMAT, "%s: field 'model_type' must be a string", name);
    for (size_t i = 0; i < N_ARCHS; i++)
        if (!strcmp(json_string_value(mt), supported_archs[i][1])) {
            snprintf(cfg->architecture, sizeof cfg->architecture, "%s", supported_archs[i][0]);
            return KVS_OK;
        }
    return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: model_type '%.100s' is unsupported (supported: llama, mistral, qwen2, qwen3)",
                    name, json_string_value(mt));
}

/* rope_theta and rope_scaling, in the classic layout (top level) or inside
 * "rope_parameters" (newer transformers). */
static kvs_status parse_rope(const json_t *root, const char *name, kvs_config *cfg) {
    const json_t *params = json_object_get(root, "rope_parameters");
    if (params && !json_is_null(params) && !json_is_object(params))
        return kvs_fail(KVS_ERR_FORMAT, "%s: field 'rope_parameters' must be an object", name);
    if (params && json_is_null(params)) params = NULL;

    cfg->rope_theta = 10000.0f;
    if (json_object_get(root, "rope_theta"))
        KVS_TRY(get_positive(root, "rope_theta", "rope_theta", name, false, &cfg->rope_theta));
    else if (params)
        KVS_TRY(get_positive(params, "rope_theta", "rope_parameters.rope_theta", name, false, &cfg->rope_theta));

    const json_t *sc = json_object_get(root, "rope_scaling");
    const char *prefix = "rope_scaling";
    if (sc && !json_is_null(sc) && !json_is_object(sc))
        return kvs_fail(KVS_ERR_FORMAT, "%s: field 'rope_scaling' must be an object or null", name);
    if (!sc || json_is_null(sc)) {
        sc = params;
        prefix = "rope_parameters";
    }
    cfg->rope_type = KVS_ROPE_NONE;
    cfg->rope_factor = 1.0f;
    if (!sc) return KVS_OK;

    const json_t *t = json_object_get(sc, "rope_type");
    if (!t || json_is_null(t)) t = json_object_get(sc, "type");
    char field[96];
    if (!t || json_is_null(t)) {
        if (sc == params) return KVS_OK; /* rope_parameters with only rope_theta */
        return kvs_fail(KVS_ERR_FORMAT, "%s: field 'rope_scaling.rope_type' is missing", name);
    }
    if (!json_is_string(t))
        return kvs_fail(KVS_ERR_FORMAT, "%s: field '%s.rope_type' must be a string", name, prefix);
    const char *type = json_string_value(t);
    if (!strcmp(type, "default")) return KVS_OK;
    if (!strcmp(type, "linear")) {
        cfg->rope_type = KVS_ROPE_LINEAR;
        snprintf(field, sizeof field, "%s.factor", prefix);
        return get_positive(sc, "factor", field, name, true, &cfg->rope_factor);
    }
    if (!strcmp(type, "llama3")) {
        cfg->rope_type = KVS_ROPE_LLAMA3;
        snprintf(field, sizeof field, "%s.factor", prefix);
        KVS_TRY(get_positive(sc, "factor", field, name, true, &cfg->rope_factor));
        snprintf(field, sizeof field, "%s.low_freq_factor", prefix);
        KVS_TRY(get_positive(sc, "low_freq_factor", field, name, true, &cfg->rope_low_freq_factor));
        snprintf(field, sizeof field, "%s.high_freq_factor", prefix);
        KVS_TRY(get_positive(sc, "high_freq_factor", field, name, true, &cfg->rope_high_freq_factor));
        snprintf(field, sizeof field, "%s.original_max_position_embeddings", prefix);
        KVS_TRY(get_int(sc, "original_max_position_embeddings", field, name, true, 1, KVS_MAX_POSITIONS,
                        &cfg->rope_original_max_position, NULL));
        if (!(cfg->rope_high_freq_factor > cfg->rope_low_freq_factor))
            return kvs_fail(KVS_ERR_FORMAT, "%s: field '%s.high_freq_factor' must be larger than low_freq_factor",
                            name, prefix);
        return KVS_OK;
    }
    return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: %s type '%.64s' is unsupported (supported: linear, llama3)", name,
                    prefix, type);
}

/* Appends a token id (int) or ids (list) to the eos set, unique, at most KVS_MAX_EOS. */
static kvs_status add_eos(kvs_config *cfg, const json_t *v, const char *name) {
    if (!v || json_is_null(v)) return KVS_OK;
    size_t n = json_is_array(v) ? json_array_size(v) : 1;
    for (size_t i = 0; i < n; i++) {
        const json_t *e = json_is_array(v) ? json_array_get(v, i) : v;
        if (!json_is_integer(e))
            return kvs_fail(KVS_ERR_FORMAT, "%s: field 'eos_token_id' must be an integer or a list of integers", name);
        long long id = json_integer_value(e);
        if (id < 0 || id >= cfg->vocab_size)
            return kvs_fail(KVS_ERR_FORMAT, "%s: field 'eos_token_id' value %lld is outside the vocabulary (vocab_size %d)",
                            name, id, cfg->vocab_size);
        bool seen = false;
        for (int k = 0; k < cfg->n_eos; k++) seen |= cfg->eos_token_ids[k] == (int)id;
        if (seen) continue;
        if (cfg->n_eos == KVS_MAX_EOS) {
            kvs_log(KVS_LOG_WARN, "%s: more than %d eos_token_id values; ignoring %lld", name, KVS_MAX_EOS, id);
            continue;
        }
        cfg->eos_token_ids[cfg->n_eos++] = (int)id;
    }
    return KVS_OK;
}

static kvs_status get_bos(const json_t *root, const char *name, kvs_config *cfg) {
    const json_t *v = json_object_get(root, "bos_token_id");
    if (!v || json_is_null(v)) return KVS_OK;
    if (!json_is_integer(v)) return kvs_fail(KVS_ERR_FORMAT, "%s: field 'bos_token_id' must be an integer", name);
    long long id = json_integer_value(v);
    if (id < 0 || id >= cfg->vocab_size)
        return kvs_fail(KVS_ERR_FORMAT, "%s: field 'bos_token_id' value %lld is outside the vocabulary (vocab_size %d)",
                        name, id, cfg->vocab_size);
    cfg->bos_token_id = (int)id;
    return KVS_OK;
}

static kvs_status parse_dtype(const json_t *root, const char *name, kvs_config *cfg) {
    const char *key = "torch_dtype";
    const json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) v = json_object_get(root, key = "dtype");
    cfg->dtype = KVS_BF16;
    if (!v || json_is_null(v)) return KVS_OK;
    if (!json_is_string(v)) return kvs_fail(KVS_ERR_FORMAT, "%s: field '%s' must be a string", name, key);
    const char *s = json_string_value(v);
    if (!strcmp(s, "bfloat16")) cfg->dtype = KVS_BF16;
    else if (!strcmp(s, "float16")) cfg->dtype = KVS_F16;
    else if (!strcmp(s, "float32")) cfg->dtype = KVS_F32;
    else
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: field '%s' value '%.64s' is unsupported (supported: bfloat16, float16, float32)",
                        name, key, s);
    return KVS_OK;
}

/* Sliding-window attention, as transformers reads it: layer_types when given
 * ("sliding_attention" / "full_attention" per layer); else Mistral's
 * sliding_window (every layer); else Qwen2/Qwen3's use_sliding_window with
 * sliding_window, for the layers from max_window_layers (default 28) on. A
 * window as long as the context changes nothing (none). Llama has no such field. */
static kvs_status parse_sliding_window(const json_t *root, const char *name, bool mistral, kvs_config *cfg) {
    bool qwen = !strncmp(cfg->architecture, "Qwen", 4), has_window;
    int window = 0, max_window_layers = 28;
    memset(cfg->sliding_layers, 0, sizeof cfg->sliding_layers);
    cfg->sliding_window = 0;
    if (!mistral && !qwen) return KVS_OK;
    KVS_TRY(get_int(root, "sliding_window", "sliding_window", name, false, 1, KVS_MAX_POSITIONS, &window, &has_window));
    bool use = mistral;
    KVS_TRY(get_bool(root, "use_sliding_window", name, &use));
    if (qwen) KVS_TRY(get_int(root, "max_window_layers", "max_window_layers", name, false, 0, KVS_MAX_LAYERS,
                              &max_window_layers, NULL));
    const json_t *types = json_object_get(root, "layer_types");
    bool any = false;
    if (types && !json_is_null(types)) {
        if (!json_is_array(types) || (int)json_array_size(types) != cfg->n_layers)
            return kvs_fail(KVS_ERR_FORMAT, "%s: field 'layer_types' must be a list of num_hidden_layers (%d) strings",
                            name, cfg->n_layers);
        for (int l = 0; l < cfg->n_layers; l++) {
            const char *t = json_string_value(json_array_get(types, l));
            if (t && !strcmp(t, "sliding_attention")) cfg->sliding_layers[l] = 1, any = true;
            else if (!t || strcmp(t, "full_attention"))
                return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: field 'layer_types[%d]' must be \"full_attention\" or "
                                "\"sliding_attention\"", name, l);
        }
        if (any && !has_window)
            return kvs_fail(KVS_ERR_FORMAT, "%s: field 'layer_types' has sliding_attention layers but "
                            "'sliding_window' is missing", name);
    } else if (use && has_window) {
        for (int l = mistral ? 0 : max_window_layers; l < cfg->n_layers; l++) cfg->sliding_layers[l] = 1, any = true;
    }
    if (!any || window >= cfg->max_position_embeddings) {
        memset(cfg->sliding_layers, 0, sizeof cfg->sliding_layers);
        return KVS_OK;
    }
    cfg->sliding_window = window;
    return KVS_OK;
}

int kvs_config_layer_sliding_window(const kvs_config *cfg, int layer) {
    return layer >= 0 && layer < cfg->n_layers && cfg->sliding_layers[layer] ? cfg->sliding_window : 0;
}

static kvs_status parse_root(const json_t *root, const char *name, kvs_config *cfg) {
    if (!json_is_object(root)) return kvs_fail(KVS_ERR_FORMAT, "%s: expected a JSON object", name);
    KVS_TRY(parse_architecture(root, name, cfg));
    bool qwen2 = !strcmp(cfg->architecture, "Qwen2ForCausalLM");
    bool mistral = !strcmp(cfg->architecture, "MistralForCausalLM");
    cfg->qk_norm = !strcmp(cfg->architecture, "Qwen3ForCausalLM"); /* q_norm and k_norm in every layer */

    KVS_TRY(kvs_quant_config_parse(root, name, &cfg->ckpt_quant));
    if (cfg->ckpt_quant.fp8) cfg->quantization = KVS_QUANT_FP8; /* an FP8 checkpoint runs as --quantization fp8 */

    bool has;
    KVS_TRY(get_int(root, "hidden_size", "hidden_size", name, true, 1, KVS_MAX_HIDDEN, &cfg->hidden_size, NULL));
    KVS_TRY(get_int(root, "num_hidden_layers", "num_hidden_layers", name, true, 1, KVS_MAX_LAYERS, &cfg->n_layers, NULL));
    KVS_TRY(get_int(root, "num_attention_heads", "num_attention_heads", name, true, 1, KVS_MAX_HEADS, &cfg->n_heads, NULL));
    cfg->n_kv_heads = cfg->n_heads;
    KVS_TRY(get_int(root, "num_key_value_heads", "num_key_value_heads", name, false, 1, KVS_MAX_HEADS, &cfg->n_kv_heads, NULL));
    KVS_TRY(get_int(root, "head_dim", "head_dim", name, false, 1, KVS_MAX_HEAD_DIM, &cfg->head_dim, &has));
    if (!has) {
        if (cfg->hidden_size % cfg->n_heads != 0)
            return kvs_fail(KVS_ERR_FORMAT, "%s: field 'hidden_size' (%d) is not divisible by num_attention_heads (%d) and no 'head_dim' is given",
                            name, cfg->hidden_size, cfg->n_heads);
        cfg->head_dim = cfg->hidden_size / cfg->n_heads;
    }
    KVS_TRY(get_int(root, "intermediate_size", "intermediate_size", name, true, 1, KVS_MAX_INTERMEDIATE, &cfg->intermediate_size, NULL));
    KVS_TRY(get_int(root, "vocab_size", "vocab_size", name, true, 1, KVS_MAX_VOCAB, &cfg->vocab_size, NULL));
    cfg->max_position_embeddings = 2048;
    KVS_TRY(get_int(root, "max_position_embeddings", "max_position_embeddings", name, false, 1, KVS_MAX_POSITIONS,
                    &cfg->max_position_embeddings, NULL));
    cfg->rms_norm_eps = 1e-6f;
    KVS_TRY(get_positive(root, "rms_norm_eps", "rms_norm_eps", name, false, &cfg->rms_norm_eps));
    if (cfg->rms_norm_eps >= 1.0f)
        return kvs_fail(KVS_ERR_FORMAT, "%s: field 'rms_norm_eps' must be below 1 (got %g)", name, cfg->rms_norm_eps);

    if (cfg->n_heads % cfg->n_kv_heads != 0)
        return kvs_fail(KVS_ERR_FORMAT, "%s: field 'num_attention_heads' (%d) must be a multiple of num_key_value_heads (%d)",
                        name, cfg->n_heads, cfg->n_kv_heads);
    if (cfg->head_dim % 2 != 0)
        return kvs_fail(KVS_ERR_FORMAT, "%s: field 'head_dim' must be even for rotary embeddings (got %d)", name, cfg->head_dim);
    if ((long long)cfg->n_heads * cfg->head_dim > KVS_MAX_HIDDEN)
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: field 'num_attention_heads' * head_dim (%lld) exceeds %d", name,
                        (long long)cfg->n_heads * cfg->head_dim, KVS_MAX_HIDDEN);

    KVS_TRY(parse_rope(root, name, cfg));

    cfg->tie_word_embeddings = false;
    KVS_TRY(get_bool(root, "tie_word_embeddings", name, &cfg->tie_word_embeddings));
    cfg->attention_bias = false;
    if (qwen2) {
        cfg->attention_bias = true; /* Qwen2 always has q/k/v biases */
    } else {
        KVS_TRY(get_bool(root, "attention_bias", name, &cfg->attention_bias));
        if (cfg->attention_bias) /* Llama's attention_bias also adds an o_proj bias */
            return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: field 'attention_bias' true is unsupported for %s (o_proj bias)",
                            name, cfg->architecture);
    }
    bool mlp_bias = false;
    KVS_TRY(get_bool(root, "mlp_bias", name, &mlp_bias));
    if (mlp_bias) return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: field 'mlp_bias' true is unsupported", name);

    KVS_TRY(parse_sliding_window(root, name, mistral, cfg));

    cfg->bos_token_id = -1;
    cfg->n_eos = 0;
    KVS_TRY(get_bos(root, name, cfg));
    KVS_TRY(add_eos(cfg, json_object_get(root, "eos_token_id"), name));
    return parse_dtype(root, name, cfg);
}

kvs_status kvs_config_json_load(const char *text, size_t len, const char *name, json_t **out) {
    json_error_t err;
    *out = json_loadb(text, len, JSON_REJECT_DUPLICATES, &err);
    if (!*out)
        return kvs_fail(KVS_ERR_FORMAT, "%s: not valid JSON: %s (line %d, column %d)", name, err.text, err.line, err.column);
    return KVS_OK;
}

kvs_status kvs_config_parse(const char *json_text, size_t len, const char *name, kvs_config *cfg) {
    if (!name) name = "config.json";
    if (!json_text || !cfg) return kvs_fail(KVS_ERR_INVALID, "%s: no config text", name);
    memset(cfg, 0, sizeof *cfg);
    json_t *root;
    KVS_TRY(kvs_config_json_load(json_text, len, name, &root));
    kvs_status s = parse_root(root, name, cfg);
    json_decref(root);
    return s;
}

/* generation_config.json: its bos replaces, its eos extend config.json's. */
static kvs_status merge_generation_config(const char *text, size_t len, kvs_config *cfg) {
    const char *name = "generation_config.json";
    json_t *root;
    KVS_TRY(kvs_config_json_load(text, len, name, &root));
    kvs_status s = KVS_OK;
    if (!json_is_object(root)) s = kvs_fail(KVS_ERR_FORMAT, "%s: expected a JSON object", name);
    if (s == KVS_OK) s = get_bos(root, name, cfg);
    if (s == KVS_OK) s = add_eos(cfg, json_object_get(root, "eos_token_id"), name);
    json_decref(root);
    return s;
}

kvs_status kvs_config_load(const char *model_dir, kvs_config *cfg) {
    if (kvs_gguf_is_path(model_dir)) return kvs_gguf_config_load(model_dir, cfg);
    char path[4096];
    char *text = NULL;
    size_t len = 0;
    KVS_TRY(kvs_path_join(path, sizeof path, model_dir, "config.json"));
    if (!kvs_file_exists(path))
        return kvs_fail(KVS_ERR_NOT_FOUND, "%s: no config.json in the model directory", model_dir);
    KVS_TRY(kvs_read_file(path, &text, &len));
    kvs_status s = kvs_config_parse(text, len, "config.json", cfg);
    free(text);
    if (s != KVS_OK) return s;

    KVS_TRY(kvs_path_join(path, sizeof path, model_dir, "generation_config.json"));
    if (!kvs_file_exists(path)) return KVS_OK;
    KVS_TRY(kvs_read_file(path, &text, &len));
    s = merge_generation_config(text, len, cfg);
    free(text);
    return s;
}

size_t kvs_config_kv_bytes_per_token(const kvs_config *cfg, kvs_dtype kv_dtype) {
    return 2 * (size_t)cfg->n_layers * (size_t)cfg->n_kv_heads * (size_t)cfg->head_dim * kvs_dtype_size(kv_dtype);
}

/* Elements of one copy of weight kind k (0 when the model has none) and its rows;
 * how many copies: one per layer from the attention norm on, else one. */
static int64_t kind_elems(const kvs_config *cfg, int k, int64_t *rows) {
    int64_t shape[2];
    int ndim;
    if (!kvs_weight_expected(cfg, (kvs_weight_kind)k, shape, &ndim)) return 0;
    *rows = shape[0];
    return ndim == 2 ? shape[0] * shape[1] : shape[0];
}
static int kind_copies(const kvs_config *cfg, int k) { return k >= KVS_W_ATTN_NORM ? cfg->n_layers : 1; }

double kvs_config_weight_bytes(const kvs_config *cfg, kvs_dtype weight_dtype, bool include_embed) {
    double total = 0;
    for (int k = 0; k < KVS_W_KIND_COUNT; k++) {
        int64_t rows, n = kind_elems(cfg, k, &rows);
        if (!n || (k == KVS_W_EMBED && !include_embed && !cfg->tie_word_embeddings)) continue;
        bool linear = kvs_weight_is_linear((kvs_weight_kind)k);
        bool fp8 = cfg->quantization == KVS_QUANT_FP8 && linear;
        double bytes = fp8 ? (double)n + (double)rows * sizeof(float) : (double)n * kvs_dtype_size(weight_dtype);
        if (linear && (cfg->quantization == KVS_QUANT_Q8_0 || cfg->quantization == KVS_QUANT_Q4_K)) {
            int64_t cols = n / rows; /* Q4_K where the row is whole super-blocks (ggml_weights.c) */
            bool k4 = cfg->quantization == KVS_QUANT_Q4_K && cols % 256 == 0;
            bytes = (double)n * (k4 ? 144.0 / 256 : 34.0 / 32);
        }
        total += bytes * kind_copies(cfg, k);
    }
    return total;
}

int64_t kvs_config_param_count(const kvs_config *cfg) {
    int64_t total = 0, rows;
    for (int k = 0; k < KVS_W_KIND_COUNT; k++) total += kind_elems(cfg, k, &rows) * kind_copies(cfg, k);
    return total;
}
