/* kvsparse convert: any model kvsparse opens (safetensors, a .gguf, a config
 * with dummy weights) written as a GGUF v3 file that llama.cpp and kvsparse
 * read: llama.cpp's architecture names, hyper-parameter keys and tensor names,
 * the llama architecture's q / k rows interleaved as its converter does, and
 * the weights in f32 / bf16 / f16 or quantized as llama-quantize does (q8_0,
 * q4_k_m). The file is written beside the target and renamed into place, so a
 * failure leaves no half file. Same input, same bytes. */
#define _GNU_SOURCE /* asprintf */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "cli/cli_common.h"
#include "cli/convert.h"

typedef enum { OUT_F32, OUT_BF16, OUT_F16, OUT_Q8_0, OUT_Q4_K_M } out_type;
static const char *const out_names[] = {"f32", "bf16", "f16", "q8_0", "q4_k_m"};
/* llama.cpp's general.file_type (llama_ftype) of each */
static const uint32_t out_ftype[] = {0, 32, 1, 7, 15};

static void convert_usage(FILE *f) {
    fprintf(f,
            "usage: kvsparse convert (-m MODEL | --config CONFIG.json --load-format dummy) --out FILE.gguf\n"
            "                        [--type f32|bf16|f16|q8_0|q4_k_m] [--no-tokenizer]\n"
            "  -m, --model MODEL   a model folder (config.json, safetensors, tokenizer.json) or a .gguf file\n"
            "  --config FILE       a config.json alone, with --load-format dummy (seeded random weights)\n"
            "  --load-format F     auto (default) or dummy\n"
            "  --out FILE.gguf     the file to write (replaced when it exists)\n"
            "  --type T            the weights: f32, bf16 (default), f16; q8_0 (every matrix Q8_0, norms f32);\n"
            "                      q4_k_m (llama.cpp's Q4_K_M mix: Q4_K, Q6_K for the output / tied embedding\n"
            "                      and half the attn_v and ffn_down layers; norms f32)\n"
            "  --no-tokenizer      write no tokenizer.* metadata (a vocabulary convert cannot name)\n");
}

/* llama.cpp's use_more_bits (llama_tensor_get_type): the first and last
 * eighth of the layers and every third one between get more bits. */
static bool use_more_bits(int layer, int n_layers) {
    return layer < n_layers / 8 || layer >= 7 * n_layers / 8 || (layer - n_layers / 8) % 3 == 2;
}

/* The ggml type of a weight for the output type, as llama-quantize chooses it
 * (llama_tensor_get_type, no importance matrix): 1-D tensors (norms, biases)
 * F32; q8_0: every matrix Q8_0; q4_k_m: Q6_K for output.weight (or the token
 * embedding when tied: it is the output too), Q6_K for attn_v and ffn_down in
 * the layers use_more_bits picks, Q4_K for the rest. Not followed: its 70B
 * (80-layer) attn_v rule and its mixture-of-experts and Falcon rules (models
 * kvsparse does not run). A row that is not whole blocks falls back as
 * llama.cpp does: Q4_K to Q5_0, Q6_K to Q8_0, then F16 (rows not whole 32s). */
static uint32_t weight_type(out_type t, const kvs_config *cfg, kvs_weight_kind k, int layer, int ndim, int64_t cols) {
    if (ndim == 1) return KVS_GGML_F32;
    uint32_t type;
    switch (t) {
    case OUT_F32: return KVS_GGML_F32;
    case OUT_BF16: return KVS_GGML_BF16;
    case OUT_F16: return KVS_GGML_F16;
    case OUT_Q8_0: type = KVS_GGML_Q8_0; break;
    default:
        if (k == KVS_W_LM_HEAD || (k == KVS_W_EMBED && cfg->tie_word_embeddings)) type = KVS_GGML_Q6_K;
        else if ((k == KVS_W_V || k == KVS_W_DOWN) && use_more_bits(layer, cfg->n_layers)) type = KVS_GGML_Q6_K;
        else type = KVS_GGML_Q4_K;
    }
    if (cols % 256 && type == KVS_GGML_Q4_K) type = KVS_GGML_Q5_0;
    if (cols % 256 && type == KVS_GGML_Q6_K) type = KVS_GGML_Q8_0;
    if (cols % 32) type = KVS_GGML_F16;
    return type;
}

static const char *gguf_arch(const kvs_config *cfg) {
    if (!strcmp(cfg->architecture, "Qwen2ForCausalLM")) return "qwen2";
    if (!strcmp(cfg->architecture, "Qwen3ForCausalLM")) return "qwen3";
    return "llama"; /* Llama and Mistral: llama.cpp's llama */
}

/* The hyper-parameters under ARCH.*, as gguf_config.c reads them back. */
static kvs_status write_hparams(kvs_gguf_writer *w, const kvs_config *c, const char *name, out_type t) {
    const char *arch = gguf_arch(c);
    char key[128];
    kvs_status s = kvs_gguf_set_str(w, "general.architecture", arch, strlen(arch));
    if (s == KVS_OK) s = kvs_gguf_set_str(w, "general.name", name, strlen(name));
#define U32(suffix, v) \
    if (s == KVS_OK) snprintf(key, sizeof key, "%s.%s", arch, suffix), s = kvs_gguf_set_u32(w, key, (uint32_t)(v))
#define F32(suffix, v) \
    if (s == KVS_OK) snprintf(key, sizeof key, "%s.%s", arch, suffix), s = kvs_gguf_set_f32(w, key, (v))
    U32("context_length", c->max_position_embeddings);
    U32("embedding_length", c->hidden_size);
    U32("block_count", c->n_layers);
    U32("feed_forward_length", c->intermediate_size);
    U32("attention.head_count", c->n_heads);
    U32("attention.head_count_kv", c->n_kv_heads);
    U32("attention.key_length", c->head_dim);
    U32("attention.value_length", c->head_dim);
    U32("rope.dimension_count", c->head_dim);
    F32("rope.freq_base", c->rope_theta);
    F32("attention.layer_norm_rms_epsilon", c->rms_norm_eps);
    U32("vocab_size", c->vocab_size);
    if (c->rope_type == KVS_ROPE_LINEAR) {
        if (s == KVS_OK) snprintf(key, sizeof key, "%s.rope.scaling.type", arch), s = kvs_gguf_set_str(w, key, "linear", 6);
        F32("rope.scaling.factor", c->rope_factor);
    }
#undef U32
#undef F32
    if (s == KVS_OK) s = kvs_gguf_set_u32(w, "general.file_type", out_ftype[t]);
    if (s == KVS_OK && t >= OUT_Q8_0) s = kvs_gguf_set_u32(w, "general.quantization_version", 2);
    return s;
}

/* What the loader cannot read back, refused before anything is written. */
static kvs_status check_convertible(const kvs_config *c) {
    if (c->sliding_window)
        return kvs_fail(KVS_ERR_UNSUPPORTED, "sliding-window attention (sliding_window %d) is not converted: GGUF "
                        "metadata kvsparse reads has no key for it", c->sliding_window);
    if (c->ckpt_quant.fp8)
        return kvs_fail(KVS_ERR_UNSUPPORTED, "an FP8 checkpoint (quant_method %s) is not converted",
                        c->ckpt_quant.method);
    return KVS_OK;
}

typedef struct {
    kvs_checkpoint *ck;
    const kvs_config *cfg;
    out_type t;
    float *f32;       /* a weight as f32, in GGUF row order */
    uint8_t *out;     /* its bytes in the file's type */
} converter;

/* Weight (k, layer) as f32 in GGUF order: llama's q / k rows interleaved per
 * head (GGUF row h*hd + 2i + s is HF row h*hd + s*hd/2 + i: RoPE on adjacent
 * pairs, as convert_hf_to_gguf.py permutes them and gguf_weights.c undoes). */
static kvs_status read_f32(converter *c, kvs_weight_kind k, int layer, int64_t rows, int64_t cols) {
    kvs_host_tensor h;
    KVS_TRY(kvs_checkpoint_read(c->ck, k, layer, &h));
    if (h.dtype != KVS_F32 && h.dtype != KVS_F16 && h.dtype != KVS_BF16) {
        char name[160];
        kvs_weight_name(k, layer, name, sizeof name);
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: dtype %s is not converted", name, kvs_dtype_name(h.dtype));
    }
    bool permute = !strcmp(gguf_arch(c->cfg), "llama") && (k == KVS_W_Q || k == KVS_W_K);
    size_t esz = kvs_dtype_size(h.dtype);
    int64_t hd = c->cfg->head_dim;
    for (int64_t r = 0; r < rows; r++) {
        int64_t j = r % hd, from = permute ? r - j + (j % 2) * (hd / 2) + j / 2 : r;
        kvs_to_f32(c->f32 + r * cols, (const uint8_t *)h.data + (size_t)(from * cols) * esz, h.dtype, (size_t)cols);
    }
    return KVS_OK;
}

static kvs_status encode(converter *c, uint32_t type, int64_t n, size_t *bytes) {
    kvs_ggml_layout lay;
    kvs_ggml_type_layout(type, &lay);
    *bytes = (size_t)(n / lay.block) * (size_t)lay.block_bytes;
    if (type == KVS_GGML_F32) memcpy(c->out, c->f32, *bytes);
    else if (type == KVS_GGML_F16 || type == KVS_GGML_BF16) {
        uint16_t *o = (uint16_t *)c->out;
        for (int64_t i = 0; i < n; i++) o[i] = type == KVS_GGML_F16 ? kvs_f32_to_f16(c->f32[i]) : kvs_f32_to_bf16(c->f32[i]);
    } else KVS_TRY(kvs_ggml_quantize(type, c->f32, c->out, n));
    return KVS_OK;
}

static kvs_status convert(const kvs_config *cfg, kvs_checkpoint *ck, const char *model, const char *out_path,
                          out_type t, bool tokenizer) {
    KVS_TRY(check_convertible(cfg));
    kvs_gguf_writer *w;
    KVS_TRY(kvs_gguf_writer_create(&w));
    char name_buf[256];
    kvs_status s = write_hparams(w, cfg, kvs_cli_last_name(model, name_buf, sizeof name_buf), t);
    bool wrote = false;
    if (s == KVS_OK && tokenizer) s = kvs_convert_vocab(w, model, cfg, &wrote);
    int64_t shape[2], largest = 0;
    int ndim;
    for (int layer = -1, k = -1; s == KVS_OK && kvs_weight_next(cfg, &layer, &k, shape, &ndim);) {
        char name[96];
        kvs_gguf_weight_name((kvs_weight_kind)k, layer, name, sizeof name);
        int64_t cols = shape[ndim - 1], rows = ndim == 2 ? shape[0] : 1, ne[2] = {cols, rows};
        s = kvs_gguf_add_tensor(w, name, weight_type(t, cfg, (kvs_weight_kind)k, layer, ndim, cols), ndim, ne);
        if (rows * cols > largest) largest = rows * cols;
    }
    /* Llama 3's RoPE scaling as llama.cpp writes it: a divisor per frequency */
    bool rope_freqs = cfg->rope_type == KVS_ROPE_LLAMA3 || cfg->rope_type == KVS_ROPE_FACTORS;
    float factors[KVS_MAX_ROPE_FACTORS];
    if (cfg->rope_type == KVS_ROPE_LLAMA3) kvs_rope_llama3_factors(cfg, factors);
    if (cfg->rope_type == KVS_ROPE_FACTORS) memcpy(factors, cfg->rope_freq_factors, sizeof factors);
    int64_t half[1] = {cfg->head_dim / 2};
    if (s == KVS_OK && rope_freqs) s = kvs_gguf_add_tensor(w, "rope_freqs.weight", KVS_GGML_F32, 1, half);
    char *tmp = NULL;
    FILE *f = NULL;
    converter c = {ck, cfg, t, malloc((size_t)largest * 4 + 64), malloc((size_t)largest * 4 + 64)};
    if (s == KVS_OK && (!c.f32 || !c.out)) s = kvs_fail(KVS_ERR_NOMEM, "out of memory for a %lld-element weight", (long long)largest);
    if (s == KVS_OK && asprintf(&tmp, "%s.tmp%ld", out_path, (long)getpid()) < 0) s = kvs_fail(KVS_ERR_NOMEM, "out of memory");
    if (s == KVS_OK && !(f = fopen(tmp, "wb")))
        s = kvs_fail(KVS_ERR_IO, "cannot write %s: %s", out_path, strerror(errno));
    if (s == KVS_OK) s = kvs_gguf_writer_write_header(w, f, out_path);
    size_t i = 0;
    for (int layer = -1, k = -1; s == KVS_OK && kvs_weight_next(cfg, &layer, &k, shape, &ndim); i++) {
        int64_t cols = shape[ndim - 1], rows = ndim == 2 ? shape[0] : 1;
        size_t bytes;
        s = read_f32(&c, (kvs_weight_kind)k, layer, rows, cols);
        if (s == KVS_OK) s = encode(&c, weight_type(t, cfg, (kvs_weight_kind)k, layer, ndim, cols), rows * cols, &bytes);
        if (s == KVS_OK) s = kvs_gguf_writer_write_data(w, f, out_path, c.out, bytes);
    }
    if (s == KVS_OK && rope_freqs) s = kvs_gguf_writer_write_data(w, f, out_path, factors, sizeof(float) * half[0]), i++;
    if (f && fclose(f) && s == KVS_OK) s = kvs_fail(KVS_ERR_IO, "%s: write failed: %s", out_path, strerror(errno));
    if (s == KVS_OK && rename(tmp, out_path))
        s = kvs_fail(KVS_ERR_IO, "cannot write %s: %s", out_path, strerror(errno));
    if (s != KVS_OK && f) remove(tmp);
    if (s == KVS_OK)
        fprintf(stderr, "kvsparse convert: wrote %s (%s, %zu tensors%s)\n", out_path, out_names[t], i,
                wrote ? ", tokenizer" : ", no tokenizer");
    free(tmp), free(c.f32), free(c.out);
    kvs_gguf_writer_destroy(w);
    return s;
}

int kvs_cmd_convert(int argc, char **argv) {
    const char *model = NULL, *config = NULL, *out = NULL;
    bool dummy = false, tokenizer = true;
    out_type t = OUT_BF16;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool has_value = i + 1 < argc;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            convert_usage(stdout);
            return 0;
        } else if ((!strcmp(a, "-m") || !strcmp(a, "--model")) && has_value) {
            model = argv[++i];
        } else if (!strcmp(a, "--config") && has_value) {
            config = argv[++i];
        } else if (!strcmp(a, "--load-format") && has_value) {
            const char *v = argv[++i];
            if (strcmp(v, "auto") && strcmp(v, "dummy")) {
                fprintf(stderr, "kvsparse convert: --load-format must be auto or dummy, got '%s'\n", v);
                return 2;
            }
            dummy = !strcmp(v, "dummy");
        } else if (!strcmp(a, "--out") && has_value) {
            out = argv[++i];
        } else if (!strcmp(a, "--type") && has_value) {
            const char *v = argv[++i];
            int found = -1;
            for (int k = 0; k < (int)(sizeof out_names / sizeof out_names[0]); k++)
                if (!strcmp(v, out_names[k])) found = k;
            if (found < 0) {
                fprintf(stderr, "kvsparse convert: --type must be f32, bf16, f16, q8_0 or q4_k_m, got '%s'\n", v);
                return 2;
            }
            t = (out_type)found;
        } else if (!strcmp(a, "--no-tokenizer")) {
            tokenizer = false;
        } else {
            bool takes_value = !strcmp(a, "-m") || !strcmp(a, "--model") || !strcmp(a, "--config") ||
                               !strcmp(a, "--load-format") || !strcmp(a, "--out") || !strcmp(a, "--type");
            fprintf(stderr, "kvsparse convert: %s '%s'\n", takes_value ? "missing value for" : "unknown argument", a);
            convert_usage(stderr);
            return 2;
        }
    }
    if (!model == !config || !out || (config && !dummy)) {
        fprintf(stderr, "kvsparse convert: give -m MODEL (or --config FILE --load-format dummy) and --out FILE.gguf\n");
        convert_usage(stderr);
        return 2;
    }
    kvs_config cfg;
    kvs_status s;
    if (config) {
        char *text = NULL;
        size_t len = 0;
        s = kvs_read_file(config, &text, &len);
        if (s == KVS_OK) s = kvs_config_parse(text, len, config, &cfg);
        free(text);
    } else {
        s = kvs_config_load(model, &cfg);
    }
    kvs_checkpoint *ck = NULL;
    if (s == KVS_OK) s = dummy ? kvs_checkpoint_dummy(&cfg, 0, &ck) : kvs_checkpoint_open(model, &cfg, &ck);
    if (s == KVS_OK) s = convert(&cfg, ck, dummy ? NULL : model, out, t, tokenizer);
    kvs_checkpoint_destroy(ck);
    return s == KVS_OK ? 0 : kvs_cli_error();
}
