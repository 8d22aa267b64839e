/* kvsparse info: what a model is, what its weights weigh, how much KV fits. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "cli/cli_common.h"
#include "model/model.h"

static void info_usage(FILE *f) {
    fprintf(f,
            "usage: kvsparse info (-m MODEL_DIR | --config CONFIG.json) [--memory GiB] [--load-format auto|dummy] [--json]\n"
            "  -m, --model DIR     model directory (config.json + safetensors)\n"
            "  --config FILE       a config.json alone (shapes only, no weights)\n"
            "  --memory GiB        memory budget for the KV cache (default 1: serve's KV pool on the CPU;\n"
            "                      on a GPU serve takes --gpu-memory-utilization of the card)\n"
            "  --load-format F     auto: open and check the safetensors; dummy: config only\n"
            "  --json              print one JSON object\n");
}

static const char *rope_name(kvs_rope_type t) {
    return t == KVS_ROPE_LINEAR   ? "linear"
           : t == KVS_ROPE_LLAMA3 ? "llama3"
           : t == KVS_ROPE_FACTORS ? "llama3 (per-frequency factors: GGUF rope_freqs)"
                                  : "none";
}

static void human_bytes(char *buf, size_t cap, double b) {
    const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    int u = 0;
    while (b >= 1024 && u < 4) b /= 1024, u++;
    snprintf(buf, cap, u ? "%.2f %s" : "%.0f %s", b, units[u]);
}

static void print_text(const char *source, const kvs_config *c, const char *weights_from, size_t weight_bytes,
                       double budget_gib) {
    int64_t params = kvs_config_param_count(c);
    size_t kv16 = kvs_config_kv_bytes_per_token(c, KVS_BF16), kv32 = kvs_config_kv_bytes_per_token(c, KVS_F32);
    double budget = budget_gib * 1073741824.0;
    char wb[32], k16[32], k32[32];
    human_bytes(wb, sizeof wb, (double)weight_bytes);
    human_bytes(k16, sizeof k16, (double)kv16);
    human_bytes(k32, sizeof k32, (double)kv32);
    printf("model            %s\n", source);
    printf("architecture     %s\n", c->architecture);
    printf("layers           %d\n", c->n_layers);
    printf("hidden size      %d (intermediate %d)\n", c->hidden_size, c->intermediate_size);
    printf("attention        %d heads, %d KV heads, head_dim %d (%d query heads per KV head)\n", c->n_heads,
           c->n_kv_heads, c->head_dim, c->n_heads / c->n_kv_heads);
    printf("vocab            %d\n", c->vocab_size);
    printf("max positions    %d\n", c->max_position_embeddings);
    printf("rope             theta %g, scaling %s", c->rope_theta, rope_name(c->rope_type));
    if (c->rope_type == KVS_ROPE_LINEAR) printf(" (factor %g)", c->rope_factor);
    if (c->rope_type == KVS_ROPE_LLAMA3)
        printf(" (factor %g, low_freq_factor %g, high_freq_factor %g, original_max_position_embeddings %d)",
               c->rope_factor, c->rope_low_freq_factor, c->rope_high_freq_factor, c->rope_original_max_position);
    printf("\n");
    printf("rms_norm_eps     %g\n", c->rms_norm_eps);
    printf("embeddings       %s; q/k/v biases %s\n", c->tie_word_embeddings ? "tied" : "untied",
           c->attention_bias ? "yes" : "no");
    if (c->ckpt_quant.fp8)
        printf("quantization     FP8 checkpoint (quant_method %s%s): linear weights as stored (F8_E4M3 + "
               "weight_scale), activations per token\n", c->ckpt_quant.method,
               c->ckpt_quant.static_input ? "; its static input_scale unused" : "");
    printf("bos / eos        %d /", c->bos_token_id);
    for (int i = 0; i < c->n_eos; i++) printf(" %d", c->eos_token_ids[i]);
    printf("\n");
    if (params >= 1000000000) printf("parameters       %.2f B (%lld)\n", (double)params / 1e9, (long long)params);
    else printf("parameters       %.2f M (%lld)\n", (double)params / 1e6, (long long)params);
    printf("weights          %s, %s (%zu bytes; %s)\n", kvs_dtype_name(c->dtype), wb, weight_bytes, weights_from);
    size_t kv8 = kvs_config_kv_bytes_per_token(c, KVS_F8_E4M3);
    char k8[32];
    human_bytes(k8, sizeof k8, (double)kv8);
    printf("KV per token     %s bf16 (%zu bytes; the CUDA backend, and the CPU's for bf16 weights), %s f32 (%zu "
           "bytes), %s fp8 (%zu bytes; --kv-cache-dtype fp8)\n", k16, kv16, k32, kv32, k8, kv8);
    printf("KV capacity      %.0f tokens bf16, %.0f tokens f32, %.0f tokens fp8 in a %g GiB budget "
           "(assumes the whole budget holds KV: weights and activations not subtracted)\n",
           budget / (double)kv16, budget / (double)kv32, budget / (double)kv8, budget_gib);
}

/* A float as the shortest decimal that reads back as it (1e-05, not 9.99999e-06). */
static double tidy(float x) {
    char buf[32];
    snprintf(buf, sizeof buf, "%.7g", (double)x);
    return strtod(buf, NULL);
}

static int print_json(const char *source, const kvs_config *c, const char *weights_from, size_t weight_bytes,
                      double budget_gib) {
    size_t kv16 = kvs_config_kv_bytes_per_token(c, KVS_BF16), kv32 = kvs_config_kv_bytes_per_token(c, KVS_F32);
    double budget = budget_gib * 1073741824.0;
    json_t *eos = json_array();
    for (int i = 0; i < c->n_eos; i++) json_array_append_new(eos, json_integer(c->eos_token_ids[i]));
    json_t *o = json_pack(
        "{s:s, s:s, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:i, s:f, s:{s:s, s:f, s:f, s:f, s:f, s:i}, s:f, s:b, s:b,"
        " s:i, s:o, s:I, s:s, s:I, s:s, s:I, s:I, s:f, s:I, s:I, s:s}",
        "model", source, "architecture", c->architecture, "layers", c->n_layers, "hidden_size", c->hidden_size,
        "intermediate_size", c->intermediate_size, "heads", c->n_heads, "kv_heads", c->n_kv_heads, "head_dim",
        c->head_dim, "vocab_size", c->vocab_size, "max_position_embeddings", c->max_position_embeddings,
        "rope_theta", tidy(c->rope_theta), "rope_scaling", "type", rope_name(c->rope_type), "factor",
        tidy(c->rope_factor), "low_freq_factor", tidy(c->rope_low_freq_factor), "high_freq_factor",
        tidy(c->rope_high_freq_factor), "theta", tidy(c->rope_theta), "original_max_position_embeddings",
        c->rope_original_max_position, "rms_norm_eps", tidy(c->rms_norm_eps), "tie_word_embeddings",
        c->tie_word_embeddings, "attention_bias", c->attention_bias, "bos_token_id", c->bos_token_id,
        "eos_token_ids", eos, "parameters", (json_int_t)kvs_config_param_count(c), "weight_dtype",
        kvs_dtype_name(c->dtype), "weight_bytes", (json_int_t)weight_bytes, "weights_from", weights_from,
        "kv_bytes_per_token_bf16", (json_int_t)kv16, "kv_bytes_per_token_f32", (json_int_t)kv32, "memory_gib",
        budget_gib, "kv_tokens_bf16", (json_int_t)(budget / (double)kv16), "kv_tokens_f32",
        (json_int_t)(budget / (double)kv32), "kv_budget_assumption",
        "the whole budget holds KV; weights and activations are not subtracted");
    size_t kv8 = kvs_config_kv_bytes_per_token(c, KVS_F8_E4M3);
    if (o && (json_object_set_new(o, "kv_bytes_per_token_fp8", json_integer((json_int_t)kv8)) ||
              json_object_set_new(o, "kv_tokens_fp8", json_integer((json_int_t)(budget / (double)kv8))))) {
        json_decref(o);
        o = NULL;
    }
    if (!o) {
        fprintf(stderr, "kvsparse: internal error building the JSON output\n");
        return 1;
    }
    char *s = json_dumps(o, JSON_INDENT(2));
    json_decref(o);
    if (!s) return 1;
    printf("%s\n", s);
    free(s);
    return 0;
}

/* A GGUF file's tensor types, "GGUF: Q4_K x48, Q6_K x9, F32 x17 (...)", into buf. */
static const char *gguf_types(const char *path, char *buf, size_t cap) {
    kvs_gguf *g;
    snprintf(buf, cap, "GGUF checked against its metadata");
    if (kvs_gguf_open(path, &g) != KVS_OK) return buf;
    int count[64] = {0};
    for (size_t i = 0; i < g->n_tensors; i++)
        if (g->tensors[i].type < 64) count[g->tensors[i].type]++;
    size_t n = (size_t)snprintf(buf, cap, "GGUF:");
    for (uint32_t t = 0; t < 64 && n < cap; t++) {
        kvs_ggml_layout lay;
        if (count[t] && kvs_ggml_type_layout(t, &lay))
            n += (size_t)snprintf(buf + n, cap - n, " %s x%d,", lay.name, count[t]);
    }
    if (n < cap) snprintf(buf + n - 1, cap - n + 1, "; checked against its metadata, quantized types kept in their blocks on the CPU, dequantized on CUDA");
    kvs_gguf_destroy(g);
    return buf;
}

int kvs_cmd_info(int argc, char **argv) {
    const char *model_dir = NULL, *config_file = NULL, *load_format = "auto";
    double budget_gib = KVS_CLI_HOST_KV_GIB;
    bool as_json = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool has_value = i + 1 < argc;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            info_usage(stdout);
            return 0;
        } else if ((!strcmp(a, "-m") || !strcmp(a, "--model")) && has_value) {
            model_dir = argv[++i];
        } else if (!strcmp(a, "--config") && has_value) {
            config_file = argv[++i];
        } else if (!strcmp(a, "--memory") && has_value) {
            char *end;
            budget_gib = strtod(argv[++i], &end);
            if (*end || !(budget_gib > 0) || budget_gib > 1e9) {
                fprintf(stderr, "kvsparse info: --memory must be a positive number of GiB, got '%s'\n", argv[i]);
                info_usage(stderr);
                return 2;
            }
        } else if (!strcmp(a, "--load-format") && has_value) {
            load_format = argv[++i];
            if (strcmp(load_format, "auto") && strcmp(load_format, "dummy")) {
                fprintf(stderr, "kvsparse info: --load-format must be auto or dummy, got '%s'\n", load_format);
                info_usage(stderr);
                return 2;
            }
        } else if (!strcmp(a, "--json")) {
            as_json = true;
        } else {
            bool takes_value = !strcmp(a, "-m") || !strcmp(a, "--model") || !strcmp(a, "--config") ||
                               !strcmp(a, "--memory") || !strcmp(a, "--load-format");
            fprintf(stderr, "kvsparse info: %s '%s'\n", takes_value ? "missing value for" : "unknown argument", a);
            info_usage(stderr);
            return 2;
        }
    }
    if (!model_dir == !config_file) {
        fprintf(stderr, "kvsparse info: give exactly one of -m MODEL_DIR or --config FILE\n");
        info_usage(stderr);
        return 2;
    }

    kvs_config cfg;
    kvs_status s;
    if (config_file) {
        char *text = NULL;
        size_t len = 0;
        const char *base = strrchr(config_file, '/');
        s = kvs_read_file(config_file, &text, &len);
        if (s == KVS_OK) s = kvs_config_parse(text, len, base ? base + 1 : config_file, &cfg);
        free(text);
    } else {
        s = kvs_config_load(model_dir, &cfg);
    }
    if (s != KVS_OK) {
        fprintf(stderr, "kvsparse: %s\n", kvs_last_error());
        return 1;
    }

    bool dummy = config_file || !strcmp(load_format, "dummy");
    kvs_checkpoint *ck = NULL;
    s = dummy ? kvs_checkpoint_dummy(&cfg, 0, &ck) : kvs_checkpoint_open(model_dir, &cfg, &ck);
    if (s != KVS_OK) {
        fprintf(stderr, "kvsparse: %s\n", kvs_last_error());
        return 1;
    }
    size_t weight_bytes = kvs_checkpoint_total_bytes(ck);
    kvs_host_tensor embed; /* the stored dtype wins over the config's torch_dtype */
    if (!dummy && kvs_checkpoint_read(ck, KVS_W_EMBED, -1, &embed) == KVS_OK) cfg.dtype = embed.dtype;
    kvs_checkpoint_destroy(ck);
    char gguf_from[256];
    const char *from = dummy                          ? "dummy weights, computed from the config"
                       : kvs_gguf_is_path(model_dir) ? gguf_types(model_dir, gguf_from, sizeof gguf_from)
                                                       : "safetensors checked against the config";
    const char *source = config_file ? config_file : model_dir;
    if (as_json) return print_json(source, &cfg, from, weight_bytes, budget_gib);
    print_text(source, &cfg, from, weight_bytes, budget_gib);
    return 0;
}
