/* model loading: config.json, safetensors, checkpoints (single, sharded, dummy),
 * and the errors a broken model directory gives, through the library and `kvsparse info`. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "model/model.h"
#include "testutil.h"

/* ---- helpers ------------------------------------------------------------------ */
static const char *arch_dir(const char *name) {
    static char buf[4][1024];
    static int next;
    char *b = buf[next++ & 3];
    snprintf(b, 1024, "%s", shared_input("fixtures/arch"));
    snprintf(b + strlen(b), 1024 - strlen(b), "/%s", name);
    return b;
}

static const char *tiny_dir(void) {
    const char *p = shared_path("models/tiny-needle-llama");
    char probe[4096];
    snprintf(probe, sizeof probe, "%s/config.json", p);
    if (access(probe, R_OK) == 0) return p;
    return src_path("models/tiny-needle-llama");
}

static void load_cfg(const char *dir, kvs_config *cfg) {
    cr_assert_eq(kvs_config_load(dir, cfg), KVS_OK, "%s: %s", dir, kvs_last_error());
}

static kvs_status parse_str(const char *json, kvs_config *cfg) {
    return kvs_config_parse(json, strlen(json), "config.json", cfg);
}

static void expect_contains(const char *msg, const char *needle) {
    cr_assert(strstr(msg, needle) != NULL, "expected '%s' in the message: %s", needle, msg);
}

/* A copy of a model directory in a fresh temp dir (writable). */
static const char *copy_model(const char *src) {
    const char *dst = make_temp_dir();
    cr_assert(dst != NULL);
    static char out[256];
    snprintf(out, sizeof out, "%s", dst);
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "cp '%s'/config.json '%s'/*.safetensors '%s'/ && chmod -R u+w '%s' && "
             "(cp '%s'/model.safetensors.index.json '%s'/generation_config.json '%s'/ 2>/dev/null; chmod -R u+w '%s')",
             src, src, out, out, src, src, out, out);
    cr_assert_eq(run_capture(cmd, NULL), 0, "copy failed: %s", cmd);
    return out;
}

static void remove_dir(const char *dir) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    run_capture(cmd, NULL);
}

/* A safetensors file split into its header (JSON) and data section. */
typedef struct {
    json_t *header;
    uint8_t *data;
    size_t data_len;
} st_parts;

static char *read_all(const char *path, size_t *len) {
    char *text = NULL;
    cr_assert_eq(kvs_read_file(path, &text, len), KVS_OK, "%s", kvs_last_error());
    return text;
}

static st_parts st_load(const char *dir, const char *name) {
    char path[2048];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    size_t len;
    char *bytes = read_all(path, &len);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | (uint8_t)bytes[i];
    st_parts p;
    json_error_t err;
    p.header = json_loadb(bytes + 8, hlen, 0, &err);
    cr_assert(p.header != NULL, "fixture header: %s", err.text);
    p.data_len = len - 8 - hlen;
    p.data = malloc(p.data_len + 1);
    memcpy(p.data, bytes + 8 + hlen, p.data_len);
    free(bytes);
    return p;
}

/* Writes header (compact JSON) + data; hlen_override != 0 writes that length instead. */
static void st_save(const char *dir, const char *name, st_parts *p, uint64_t hlen_override) {
    char *h = json_dumps(p->header, JSON_COMPACT);
    size_t hlen = strlen(h);
    uint64_t stored = hlen_override ? hlen_override : hlen;
    size_t total = 8 + hlen + p->data_len;
    uint8_t *buf = malloc(total);
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)(stored >> (8 * i));
    memcpy(buf + 8, h, hlen);
    memcpy(buf + 8 + hlen, p->data, p->data_len);
    write_file(dir, name, buf, total);
    free(buf);
    free(h);
    json_decref(p->header);
    free(p->data);
}

static json_t *st_tensor(st_parts *p, const char *name) {
    json_t *t = json_object_get(p->header, name);
    cr_assert(t != NULL, "fixture has no tensor %s", name);
    return t;
}

/* Loading the directory fails through the library (with every needle in the
 * message) and through `kvsparse info -m DIR` (exit 1, one line on stderr). */
static void expect_load_error(const char *dir, const char *const *needles) {
    kvs_config cfg;
    kvs_checkpoint *ck = NULL;
    kvs_status s = kvs_config_load(dir, &cfg);
    if (s == KVS_OK) s = kvs_checkpoint_open(dir, &cfg, &ck);
    cr_assert_neq(s, KVS_OK, "loading %s should fail", dir);
    cr_assert_null(ck);
    const char *msg = kvs_last_error();
    for (int i = 0; needles[i]; i++) expect_contains(msg, needles[i]);
    cr_assert_null(strchr(msg, '\n'), "message must be one line: %s", msg);

    const char *bin = kvsparse_binary();
    cr_assert(access(bin, X_OK) == 0, "kvsparse binary not found at %s (build the kvsparse target)", bin);
    char cmd[4096], *out = NULL;
    snprintf(cmd, sizeof cmd, "( '%s' info -m '%s' 2>&1 >/dev/null )", bin, dir);
    int rc = run_capture(cmd, &out);
    cr_assert_eq(rc, 1, "kvsparse info exit status %d, stderr: %s", rc, out);
    size_t n = strlen(out);
    cr_assert(n > 0 && out[n - 1] == '\n' && strchr(out, '\n') == out + n - 1,
              "stderr must be exactly one line: [%s]", out);
    cr_assert(strncmp(out, "kvsparse: ", 10) == 0, "stderr: %s", out);
    for (int i = 0; needles[i]; i++) expect_contains(out, needles[i]);
    free(out);
}

#define NEEDLES(...) ((const char *const[]){__VA_ARGS__, NULL})

/* ---- config.json ------------------------------------------------------------------ */
Test(config, llama3_rope_scaling) {
    kvs_config c;
    load_cfg(arch_dir("llama3-rope-scaling"), &c);
    cr_assert_str_eq(c.architecture, "LlamaForCausalLM");
    cr_assert_eq(c.hidden_size, 128);
    cr_assert_eq(c.n_layers, 2);
    cr_assert_eq(c.n_heads, 4);
    cr_assert_eq(c.n_kv_heads, 2);
    cr_assert_eq(c.head_dim, 32);
    cr_assert_eq(c.intermediate_size, 256);
    cr_assert_eq(c.vocab_size, 512);
    cr_assert_eq(c.max_position_embeddings, 131072);
    cr_assert_eq(c.rope_type, KVS_ROPE_LLAMA3);
    cr_assert_float_eq(c.rope_factor, 8.0f, 1e-6);
    cr_assert_float_eq(c.rope_low_freq_factor, 1.0f, 1e-6);
    cr_assert_float_eq(c.rope_high_freq_factor, 4.0f, 1e-6);
    cr_assert_eq(c.rope_original_max_position, 8192);
    cr_assert_float_eq(c.rope_theta, 500000.0f, 1e-1);
    cr_assert_float_eq(c.rms_norm_eps, 1e-5f, 1e-12);
    cr_assert_not(c.tie_word_embeddings);
    cr_assert_not(c.attention_bias);
    cr_assert_eq(c.dtype, KVS_BF16);
    cr_assert_eq(c.bos_token_id, 1);
    cr_assert_eq(c.n_eos, 1);
    cr_assert_eq(c.eos_token_ids[0], 2);
}

Test(config, qwen2_bias_tied) {
    kvs_config c;
    load_cfg(arch_dir("qwen2-bias-tied"), &c);
    cr_assert_str_eq(c.architecture, "Qwen2ForCausalLM");
    cr_assert(c.attention_bias);
    cr_assert(c.tie_word_embeddings);
    cr_assert_eq(c.head_dim, 32); /* hidden / heads: no head_dim in this config */
    cr_assert_eq(c.dtype, KVS_F16);
    cr_assert_eq(c.rope_type, KVS_ROPE_NONE);
    cr_assert_float_eq(c.rope_theta, 1e6f, 1.0);
    cr_assert_float_eq(c.rms_norm_eps, 1e-6f, 1e-12);
}

Test(config, mistral_fp32) {
    kvs_config c;
    load_cfg(arch_dir("mistral"), &c);
    cr_assert_str_eq(c.architecture, "MistralForCausalLM");
    cr_assert_eq(c.dtype, KVS_F32);
    cr_assert_not(c.tie_word_embeddings);
    cr_assert_not(c.attention_bias);
    cr_assert_float_eq(c.rope_theta, 1e6f, 1.0);
    cr_assert_eq(c.max_position_embeddings, 32768);
}

Test(config, tiny_needle_llama) {
    kvs_config c;
    load_cfg(tiny_dir(), &c);
    cr_assert_eq(c.n_layers, 8);
    cr_assert_eq(c.hidden_size, 512);
    cr_assert_eq(c.head_dim, 128);
    cr_assert_eq(c.vocab_size, 8192);
    cr_assert(c.tie_word_embeddings);
    cr_assert_eq(c.bos_token_id, 8187);
    cr_assert_eq(c.n_eos, 2);
    cr_assert_eq(c.eos_token_ids[0], 8191);
    cr_assert_eq(c.eos_token_ids[1], 8188);
    cr_assert_eq(kvs_config_kv_bytes_per_token(&c, KVS_BF16), (size_t)2 * 8 * 2 * 128 * 2);
}

Test(config, generation_config_extends_eos) {
    const char *dir = make_temp_dir();
    char dirc[256];
    snprintf(dirc, sizeof dirc, "%s", dir);
    const char *cfg_json = "{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":64,\"num_hidden_layers\":1,"
                           "\"num_attention_heads\":2,\"intermediate_size\":128,\"vocab_size\":100,"
                           "\"bos_token_id\":1,\"eos_token_id\":2}";
    const char *gen = "{\"bos_token_id\":3,\"eos_token_id\":[2,7,9,7]}";
    write_file(dirc, "config.json", cfg_json, strlen(cfg_json));
    write_file(dirc, "generation_config.json", gen, strlen(gen));
    kvs_config c;
    load_cfg(dirc, &c);
    cr_assert_eq(c.bos_token_id, 3);
    cr_assert_eq(c.n_eos, 3);
    cr_assert_eq(c.eos_token_ids[0], 2);
    cr_assert_eq(c.eos_token_ids[1], 7);
    cr_assert_eq(c.eos_token_ids[2], 9);
    cr_assert_eq(c.n_kv_heads, 2);
    cr_assert_eq(c.head_dim, 32);
    cr_assert_float_eq(c.rope_theta, 10000.0f, 1e-3);
    cr_assert_eq(c.dtype, KVS_BF16);

    const char *bad_gen = "{\"eos_token_id\":\"x\"}";
    write_file(dirc, "generation_config.json", bad_gen, strlen(bad_gen));
    cr_assert_neq(kvs_config_load(dirc, &c), KVS_OK);
    expect_contains(kvs_last_error(), "generation_config.json: field 'eos_token_id'");
    remove_dir(dirc);
}

#define BASE "\"hidden_size\":64,\"num_hidden_layers\":2,\"num_attention_heads\":4,\"num_key_value_heads\":2," \
             "\"intermediate_size\":128,\"vocab_size\":100"

Test(config, layouts_and_fallbacks) {
    kvs_config c;
    /* model_type without architectures */
    cr_assert_eq(parse_str("{\"model_type\":\"qwen2\"," BASE "}", &c), KVS_OK, "%s", kvs_last_error());
    cr_assert_str_eq(c.architecture, "Qwen2ForCausalLM");
    cr_assert(c.attention_bias);
    /* newer transformers: rope_parameters */
    cr_assert_eq(parse_str("{\"model_type\":\"llama\"," BASE ",\"rope_parameters\":{\"rope_type\":\"llama3\","
                           "\"rope_theta\":500000.0,\"factor\":32,\"low_freq_factor\":1,\"high_freq_factor\":4,"
                           "\"original_max_position_embeddings\":8192}}", &c), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(c.rope_type, KVS_ROPE_LLAMA3);
    cr_assert_float_eq(c.rope_factor, 32.0f, 1e-6);
    cr_assert_float_eq(c.rope_theta, 500000.0f, 0.1);
    cr_assert_eq(parse_str("{\"model_type\":\"llama\"," BASE ",\"rope_parameters\":{\"rope_type\":\"default\","
                           "\"rope_theta\":1000.0}}", &c), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(c.rope_type, KVS_ROPE_NONE);
    cr_assert_float_eq(c.rope_theta, 1000.0f, 1e-3);
    /* linear scaling with the old "type" key; eos list; dtype key */
    cr_assert_eq(parse_str("{\"model_type\":\"mistral\"," BASE ",\"rope_scaling\":{\"type\":\"linear\",\"factor\":2.0},"
                           "\"eos_token_id\":[5,6],\"dtype\":\"float32\",\"head_dim\":16}", &c), KVS_OK, "%s",
                 kvs_last_error());
    cr_assert_eq(c.rope_type, KVS_ROPE_LINEAR);
    cr_assert_float_eq(c.rope_factor, 2.0f, 1e-6);
    cr_assert_eq(c.n_eos, 2);
    cr_assert_eq(c.bos_token_id, -1);
    cr_assert_eq(c.dtype, KVS_F32);
    cr_assert_eq(c.head_dim, 16);
    /* Mistral's sliding window as long as the context: harmless */
    cr_assert_eq(parse_str("{\"model_type\":\"mistral\"," BASE ",\"max_position_embeddings\":4096,"
                           "\"sliding_window\":4096}", &c), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(c.sliding_window, 0);
}

/* Sliding windows as transformers reads them: Mistral's in every layer;
 * Qwen's with use_sliding_window from max_window_layers on (else none);
 * layer_types when given. Qwen3 has q_norm / k_norm. */
Test(config, sliding_windows_and_qwen3) {
    kvs_config c;
    cr_assert_eq(parse_str("{\"model_type\":\"mistral\"," BASE ",\"max_position_embeddings\":32768,"
                           "\"sliding_window\":4096}", &c), KVS_OK, "%s", kvs_last_error());
    cr_expect(kvs_config_layer_sliding_window(&c, 0) == 4096 && kvs_config_layer_sliding_window(&c, 1) == 4096);
    cr_expect_eq(kvs_config_layer_sliding_window(&c, 2), 0, "no layer 2");
    cr_assert_eq(parse_str("{\"model_type\":\"qwen2\"," BASE ",\"sliding_window\":4096}", &c), KVS_OK);
    cr_expect_eq(c.sliding_window, 0, "Qwen2 without use_sliding_window: none");
    cr_assert_eq(parse_str("{\"model_type\":\"qwen2\"," BASE ",\"sliding_window\":64,\"use_sliding_window\":true}",
                           &c), KVS_OK);
    cr_expect_eq(c.sliding_window, 0, "max_window_layers 28 by default: no layer of 2");
    cr_assert_eq(parse_str("{\"model_type\":\"qwen2\"," BASE ",\"sliding_window\":64,\"use_sliding_window\":true,"
                           "\"max_window_layers\":1}", &c), KVS_OK);
    cr_expect(kvs_config_layer_sliding_window(&c, 0) == 0 && kvs_config_layer_sliding_window(&c, 1) == 64);
    cr_assert_eq(parse_str("{\"model_type\":\"qwen3\"," BASE ",\"sliding_window\":32,\"use_sliding_window\":false,"
                           "\"layer_types\":[\"sliding_attention\",\"full_attention\"]}", &c), KVS_OK);
    cr_expect(kvs_config_layer_sliding_window(&c, 0) == 32 && kvs_config_layer_sliding_window(&c, 1) == 0, "layer_types decide");
    cr_expect(c.qk_norm && !c.attention_bias);
    cr_expect_str_eq(c.architecture, "Qwen3ForCausalLM");
    cr_assert_eq(parse_str("{\"model_type\":\"llama\"," BASE ",\"sliding_window\":64,\"use_sliding_window\":true}",
                           &c), KVS_OK);
    cr_expect(c.sliding_window == 0 && !c.qk_norm, "Llama has no sliding window");
    int64_t shape[2];
    int nd;
    cr_assert_eq(parse_str("{\"architectures\":[\"Qwen3ForCausalLM\"]," BASE ",\"head_dim\":32}", &c), KVS_OK);
    cr_expect(kvs_weight_expected(&c, KVS_W_Q_NORM, shape, &nd) && nd == 1 && shape[0] == 32);
    char name[96];
    kvs_weight_name(KVS_W_K_NORM, 3, name, sizeof name);
    cr_expect_str_eq(name, "model.layers.3.self_attn.k_norm.weight");
}

typedef struct {
    const char *json;
    kvs_status code;
    const char *needle;
} config_case;

Test(config, errors) {
    static const config_case cases[] = {
        {"{\"architectures\":[\"LlamaForCausalLM\"]," BASE, KVS_ERR_FORMAT, "config.json: not valid JSON"},
        {"[1,2]", KVS_ERR_FORMAT, "config.json: expected a JSON object"},
        {"{\"architectures\":[\"GPT2LMHeadModel\"]," BASE "}", KVS_ERR_UNSUPPORTED, "architecture 'GPT2LMHeadModel' is unsupported"},
        {"{\"model_type\":\"gemma\"," BASE "}", KVS_ERR_UNSUPPORTED, "model_type 'gemma' is unsupported"},
        {"{" BASE "}", KVS_ERR_FORMAT, "field 'architectures' is missing"},
        {"{\"architectures\":\"LlamaForCausalLM\"," BASE "}", KVS_ERR_FORMAT, "field 'architectures'"},
        {"{\"model_type\":\"llama\",\"num_hidden_layers\":2,\"num_attention_heads\":4,\"intermediate_size\":128,"
         "\"vocab_size\":100}", KVS_ERR_FORMAT, "config.json: field 'hidden_size' is missing"},
        {"{\"model_type\":\"llama\",\"hidden_size\":64,\"num_hidden_layers\":2,\"num_attention_heads\":4,"
         "\"num_key_value_heads\":\"2\",\"intermediate_size\":128,\"vocab_size\":100}", KVS_ERR_FORMAT,
         "config.json: field 'num_key_value_heads' must be a positive integer"},
        {"{\"model_type\":\"llama\",\"hidden_size\":-64,\"num_hidden_layers\":2,\"num_attention_heads\":4,"
         "\"intermediate_size\":128,\"vocab_size\":100}", KVS_ERR_FORMAT, "field 'hidden_size' must be a positive integer"},
        {"{\"model_type\":\"llama\",\"hidden_size\":64.5,\"num_hidden_layers\":2,\"num_attention_heads\":4,"
         "\"intermediate_size\":128,\"vocab_size\":100}", KVS_ERR_FORMAT, "field 'hidden_size' must be a positive integer"},
        {"{\"model_type\":\"llama\",\"hidden_size\":1099511627776,\"num_hidden_layers\":2,\"num_attention_heads\":4,"
         "\"intermediate_size\":128,\"vocab_size\":100}", KVS_ERR_UNSUPPORTED, "field 'hidden_size' is 1099511627776"},
        {"{\"model_type\":\"llama\",\"hidden_size\":64,\"num_hidden_layers\":2,\"num_attention_heads\":4,"
         "\"intermediate_size\":128,\"vocab_size\":1099511627776}", KVS_ERR_UNSUPPORTED, "field 'vocab_size'"},
        {"{\"model_type\":\"llama\",\"hidden_size\":64,\"num_hidden_layers\":2,\"num_attention_heads\":4,"
         "\"num_key_value_heads\":3,\"intermediate_size\":128,\"vocab_size\":100}", KVS_ERR_FORMAT,
         "field 'num_attention_heads' (4) must be a multiple of num_key_value_heads (3)"},
        {"{\"model_type\":\"llama\"," BASE ",\"head_dim\":15}", KVS_ERR_FORMAT, "field 'head_dim' must be even"},
        {"{\"model_type\":\"llama\",\"hidden_size\":66,\"num_hidden_layers\":2,\"num_attention_heads\":4,"
         "\"intermediate_size\":128,\"vocab_size\":100}", KVS_ERR_FORMAT, "field 'hidden_size' (66) is not divisible"},
        {"{\"model_type\":\"llama\"," BASE ",\"rope_scaling\":{\"rope_type\":\"yarn\",\"factor\":4}}", KVS_ERR_UNSUPPORTED,
         "config.json: rope_scaling type 'yarn' is unsupported (supported: linear, llama3)"},
        {"{\"model_type\":\"llama\"," BASE ",\"rope_scaling\":{\"type\":\"dynamic\",\"factor\":4}}", KVS_ERR_UNSUPPORTED,
         "rope_scaling type 'dynamic' is unsupported"},
        {"{\"model_type\":\"llama\"," BASE ",\"rope_scaling\":{\"rope_type\":\"linear\"}}", KVS_ERR_FORMAT,
         "field 'rope_scaling.factor' is missing"},
        {"{\"model_type\":\"llama\"," BASE ",\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8,\"low_freq_factor\":1,"
         "\"high_freq_factor\":4}}", KVS_ERR_FORMAT, "field 'rope_scaling.original_max_position_embeddings' is missing"},
        {"{\"model_type\":\"llama\"," BASE ",\"rope_scaling\":{\"factor\":8}}", KVS_ERR_FORMAT, "rope_scaling.rope_type"},
        {"{\"model_type\":\"llama\"," BASE ",\"rope_scaling\":\"linear\"}", KVS_ERR_FORMAT, "field 'rope_scaling' must be"},
        {"{\"model_type\":\"llama\"," BASE ",\"rope_theta\":-1}", KVS_ERR_FORMAT, "field 'rope_theta' must be a positive number"},
        {"{\"model_type\":\"llama\"," BASE ",\"rms_norm_eps\":\"1e-5\"}", KVS_ERR_FORMAT, "field 'rms_norm_eps'"},
        {"{\"model_type\":\"llama\"," BASE ",\"tie_word_embeddings\":1}", KVS_ERR_FORMAT, "field 'tie_word_embeddings' must be true or false"},
        {"{\"model_type\":\"llama\"," BASE ",\"attention_bias\":true}", KVS_ERR_UNSUPPORTED, "field 'attention_bias'"},
        {"{\"model_type\":\"qwen2\"," BASE ",\"sliding_window\":\"4096\",\"use_sliding_window\":true}", KVS_ERR_FORMAT,
         "field 'sliding_window' must be a positive integer"},
        {"{\"model_type\":\"mistral\"," BASE ",\"sliding_window\":0}", KVS_ERR_FORMAT,
         "field 'sliding_window' must be a positive integer"},
        {"{\"model_type\":\"qwen3\"," BASE ",\"sliding_window\":64,\"use_sliding_window\":1}", KVS_ERR_FORMAT,
         "field 'use_sliding_window' must be true or false"},
        {"{\"model_type\":\"qwen2\"," BASE ",\"sliding_window\":64,\"max_window_layers\":-1}", KVS_ERR_FORMAT,
         "field 'max_window_layers'"},
        {"{\"model_type\":\"qwen2\"," BASE ",\"sliding_window\":64,\"layer_types\":[\"full_attention\"]}", KVS_ERR_FORMAT,
         "field 'layer_types' must be a list of num_hidden_layers (2) strings"},
        {"{\"model_type\":\"qwen2\"," BASE ",\"sliding_window\":64,\"layer_types\":[\"full_attention\",\"chunked_attention\"]}",
         KVS_ERR_UNSUPPORTED, "field 'layer_types[1]' must be"},
        {"{\"model_type\":\"qwen3\"," BASE ",\"layer_types\":[\"sliding_attention\",\"full_attention\"]}", KVS_ERR_FORMAT,
         "'sliding_window' is missing"},
        {"{\"model_type\":\"qwen3\"," BASE ",\"attention_bias\":true}", KVS_ERR_UNSUPPORTED, "field 'attention_bias'"},
        {"{\"model_type\":\"llama\"," BASE ",\"torch_dtype\":\"int8\"}", KVS_ERR_UNSUPPORTED, "field 'torch_dtype' value 'int8'"},
        {"{\"model_type\":\"llama\"," BASE ",\"eos_token_id\":[1,\"2\"]}", KVS_ERR_FORMAT, "field 'eos_token_id' must be"},
        {"{\"model_type\":\"llama\"," BASE ",\"eos_token_id\":100}", KVS_ERR_FORMAT, "outside the vocabulary"},
        {"{\"model_type\":\"llama\"," BASE ",\"bos_token_id\":-1}", KVS_ERR_FORMAT, "field 'bos_token_id'"},
        {"{\"model_type\":\"llama\"," BASE ",\"quantization_config\":{\"bits\":4}}", KVS_ERR_UNSUPPORTED, "quantization_config"},
        {"{\"model_type\":\"llama\"," BASE ",\"hidden_size\":128}", KVS_ERR_FORMAT, "not valid JSON"}, /* duplicate key */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kvs_config c;
        kvs_status s = parse_str(cases[i].json, &c);
        cr_assert_eq(s, cases[i].code, "case %zu: status %d (%s), expected %d", i, s, kvs_last_error(), cases[i].code);
        expect_contains(kvs_last_error(), cases[i].needle);
        expect_contains(kvs_last_error(), "config.json: ");
        cr_assert_null(strchr(kvs_last_error(), '\n'));
    }
}

Test(config, param_counts_and_kv_bytes) {
    kvs_config c8, c70;
    size_t len;
    char *t = read_all(src_path("bench/llama-3-8b.json"), &len);
    cr_assert_eq(kvs_config_parse(t, len, "llama-3-8b.json", &c8), KVS_OK, "%s", kvs_last_error());
    free(t);
    t = read_all(src_path("bench/llama-3-70b.json"), &len);
    cr_assert_eq(kvs_config_parse(t, len, "llama-3-70b.json", &c70), KVS_OK, "%s", kvs_last_error());
    free(t);
    cr_assert_eq(kvs_config_param_count(&c8), 8030261248LL);
    cr_assert_eq(kvs_config_param_count(&c70), 70553706496LL);
    cr_assert_eq(kvs_config_kv_bytes_per_token(&c8, KVS_BF16), 131072u); /* 128 KiB, as DESIGN.md says */
    cr_assert_eq(kvs_config_kv_bytes_per_token(&c8, KVS_F32), 262144u);
    cr_assert_eq(kvs_config_kv_bytes_per_token(&c70, KVS_BF16), (size_t)2 * 80 * 8 * 128 * 2);
    cr_assert_eq(c8.n_eos, 2);
    cr_assert_eq(c8.bos_token_id, 128000);

    kvs_config q; /* qwen2: tied, with biases */
    load_cfg(arch_dir("qwen2-bias-tied"), &q);
    int64_t per_layer = 128 * 128 * 2 + 64 * 128 * 2 + 128 + 64 * 2 + 3 * 256 * 128 + 2 * 128;
    cr_assert_eq(kvs_config_param_count(&q), 512 * 128 + 128 + 2 * per_layer);
}

/* ---- weights ------------------------------------------------------------------------ */
Test(weights, names_and_shapes) {
    char buf[128];
    kvs_weight_name(KVS_W_Q, 3, buf, sizeof buf);
    cr_assert_str_eq(buf, "model.layers.3.self_attn.q_proj.weight");
    kvs_weight_name(KVS_W_K_BIAS, 0, buf, sizeof buf);
    cr_assert_str_eq(buf, "model.layers.0.self_attn.k_proj.bias");
    kvs_weight_name(KVS_W_MLP_NORM, 11, buf, sizeof buf);
    cr_assert_str_eq(buf, "model.layers.11.post_attention_layernorm.weight");
    kvs_weight_name(KVS_W_DOWN, 1, buf, sizeof buf);
    cr_assert_str_eq(buf, "model.layers.1.mlp.down_proj.weight");
    kvs_weight_name(KVS_W_EMBED, -1, buf, sizeof buf);
    cr_assert_str_eq(buf, "model.embed_tokens.weight");
    kvs_weight_name(KVS_W_FINAL_NORM, -1, buf, sizeof buf);
    cr_assert_str_eq(buf, "model.norm.weight");
    kvs_weight_name(KVS_W_LM_HEAD, -1, buf, sizeof buf);
    cr_assert_str_eq(buf, "lm_head.weight");

    kvs_config c;
    load_cfg(arch_dir("llama3-rope-scaling"), &c);
    int64_t s[2];
    int nd;
    cr_assert(kvs_weight_expected(&c, KVS_W_Q, s, &nd));
    cr_assert(nd == 2 && s[0] == 128 && s[1] == 128);
    cr_assert(kvs_weight_expected(&c, KVS_W_K, s, &nd));
    cr_assert(nd == 2 && s[0] == 64 && s[1] == 128);
    cr_assert(kvs_weight_expected(&c, KVS_W_O, s, &nd));
    cr_assert(nd == 2 && s[0] == 128 && s[1] == 128);
    cr_assert(kvs_weight_expected(&c, KVS_W_DOWN, s, &nd));
    cr_assert(nd == 2 && s[0] == 128 && s[1] == 256);
    cr_assert(kvs_weight_expected(&c, KVS_W_ATTN_NORM, s, &nd));
    cr_assert(nd == 1 && s[0] == 128);
    cr_assert(kvs_weight_expected(&c, KVS_W_LM_HEAD, s, &nd));
    cr_assert_not(kvs_weight_expected(&c, KVS_W_Q_BIAS, s, &nd));
    load_cfg(arch_dir("qwen2-bias-tied"), &c);
    cr_assert_not(kvs_weight_expected(&c, KVS_W_LM_HEAD, s, &nd));
    cr_assert(kvs_weight_expected(&c, KVS_W_V_BIAS, s, &nd));
    cr_assert(nd == 1 && s[0] == 64);
}

/* ---- checkpoints ------------------------------------------------------------------ */
static float first_f32(kvs_checkpoint *ck, kvs_weight_kind k, int layer, kvs_host_tensor *t) {
    cr_assert_eq(kvs_checkpoint_read(ck, k, layer, t), KVS_OK, "%s", kvs_last_error());
    float x;
    kvs_to_f32(&x, t->data, t->dtype, 1);
    return x;
}

static void check_all_finite(const kvs_config *c, kvs_checkpoint *ck) {
    size_t total = 0;
    for (int layer = -1; layer < c->n_layers; layer++)
        for (int k = 0; k < KVS_W_KIND_COUNT; k++) {
            if ((k < KVS_W_ATTN_NORM) != (layer < 0)) continue;
            int64_t s[2];
            int nd;
            if (!kvs_weight_expected(c, (kvs_weight_kind)k, s, &nd)) {
                kvs_host_tensor t;
                cr_assert_eq(kvs_checkpoint_read(ck, (kvs_weight_kind)k, layer, &t), KVS_ERR_NOT_FOUND);
                continue;
            }
            kvs_host_tensor t;
            cr_assert_eq(kvs_checkpoint_read(ck, (kvs_weight_kind)k, layer, &t), KVS_OK, "%s", kvs_last_error());
            size_t n = (size_t)(nd == 2 ? s[0] * s[1] : s[0]);
            cr_assert_eq(t.nbytes, n * kvs_dtype_size(t.dtype));
            cr_assert_eq(t.ndim, nd);
            float *f = malloc(n * sizeof *f);
            kvs_to_f32(f, t.data, t.dtype, n);
            double sum = 0;
            for (size_t i = 0; i < n; i++) {
                cr_assert(isfinite(f[i]), "weight kind %d layer %d element %zu not finite", k, layer, i);
                sum += fabs(f[i]);
            }
            cr_assert(sum > 0, "weight kind %d layer %d is all zeros", k, layer);
            free(f);
            total += t.nbytes;
        }
    cr_assert_eq(total, kvs_checkpoint_total_bytes(ck));
}

Test(checkpoint, arch_fixtures) {
    /* reference values read from the files with python3 (struct + json) */
    kvs_config c;
    kvs_checkpoint *ck;
    kvs_host_tensor t;

    load_cfg(arch_dir("llama3-rope-scaling"), &c);
    cr_assert_eq(kvs_checkpoint_open(arch_dir("llama3-rope-scaling"), &c, &ck), KVS_OK, "%s", kvs_last_error());
    cr_assert_float_eq(first_f32(ck, KVS_W_K, 1, &t), -0.0086669921875f, 0);
    cr_assert_eq(t.dtype, KVS_BF16);
    cr_assert(t.shape[0] == 64 && t.shape[1] == 128);
    check_all_finite(&c, ck);
    kvs_checkpoint_destroy(ck);

    load_cfg(arch_dir("qwen2-bias-tied"), &c);
    cr_assert_eq(kvs_checkpoint_open(arch_dir("qwen2-bias-tied"), &c, &ck), KVS_OK, "%s", kvs_last_error());
    cr_assert_float_eq(first_f32(ck, KVS_W_Q_BIAS, 0, &t), -0.09295654296875f, 0);
    cr_assert_eq(t.dtype, KVS_F16);
    cr_assert(t.ndim == 1 && t.shape[0] == 128);
    cr_assert_eq(kvs_checkpoint_read(ck, KVS_W_LM_HEAD, -1, &t), KVS_ERR_NOT_FOUND);
    cr_assert_eq(kvs_checkpoint_read(ck, KVS_W_Q, 2, &t), KVS_ERR_INVALID);
    cr_assert_eq(kvs_checkpoint_read(ck, KVS_W_Q, -1, &t), KVS_ERR_INVALID);
    check_all_finite(&c, ck);
    kvs_checkpoint_destroy(ck);

    load_cfg(arch_dir("mistral"), &c);
    cr_assert_eq(kvs_checkpoint_open(arch_dir("mistral"), &c, &ck), KVS_OK, "%s", kvs_last_error());
    cr_assert_float_eq(first_f32(ck, KVS_W_FINAL_NORM, -1, &t), 0.9739627838134766f, 0);
    cr_assert_eq(t.dtype, KVS_F32);
    check_all_finite(&c, ck);
    cr_assert_eq(kvs_checkpoint_total_bytes(ck), (size_t)kvs_config_param_count(&c) * 4);
    kvs_checkpoint_destroy(ck);
}

Test(checkpoint, sharded_tiny_needle) {
    kvs_config c;
    kvs_checkpoint *ck;
    kvs_host_tensor t;
    load_cfg(tiny_dir(), &c);
    cr_assert_eq(kvs_checkpoint_open(tiny_dir(), &c, &ck), KVS_OK, "%s", kvs_last_error());
    cr_assert_float_eq(first_f32(ck, KVS_W_UP, 3, &t), 0.25390625f, 0);
    cr_assert(t.shape[0] == 768 && t.shape[1] == 512);
    cr_assert_eq(kvs_checkpoint_total_bytes(ck), 39863296u); /* the index's metadata.total_size */
    check_all_finite(&c, ck);
    kvs_checkpoint_destroy(ck);
}

/* ---- broken model directories: library and CLI ------------------------------------- */
#define LLAMA3 "llama3-rope-scaling"
#define KPROJ1 "model.layers.1.self_attn.k_proj.weight"

Test(broken, truncated_safetensors) {
    const char *dir = copy_model(arch_dir(LLAMA3));
    char path[1024];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    cr_assert_eq(truncate(path, 855440 / 2), 0);
    expect_load_error(dir, NEEDLES("model.safetensors: tensor '", "exceed the file"));
    remove_dir(dir);
}

Test(broken, header_length_beyond_file) {
    const char *dir = copy_model(arch_dir(LLAMA3));
    st_parts p = st_load(dir, "model.safetensors");
    st_save(dir, "model.safetensors", &p, 1u << 30);
    expect_load_error(dir, NEEDLES("model.safetensors: header length 1073741824 exceeds the file"));
    remove_dir(dir);
}

Test(broken, header_not_json) {
    const char *dir = copy_model(arch_dir(LLAMA3));
    char path[1024];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    FILE *f = fopen(path, "r+b");
    cr_assert(f);
    fseek(f, 8, SEEK_SET);
    fputs("{not json", f);
    fclose(f);
    expect_load_error(dir, NEEDLES("model.safetensors: header is not valid JSON"));
    remove_dir(dir);
}

Test(broken, dtype_f64) {
    const char *dir = copy_model(arch_dir(LLAMA3));
    st_parts p = st_load(dir, "model.safetensors");
    json_t *t = st_tensor(&p, KPROJ1);
    json_object_set_new(t, "dtype", json_string("F64"));
    json_array_set_new(json_object_get(t, "shape"), 0, json_integer(16)); /* same byte count */
    st_save(dir, "model.safetensors", &p, 0);
    expect_load_error(dir, NEEDLES("model.safetensors: tensor '" KPROJ1 "' has unsupported dtype 'F64'"));
    remove_dir(dir);
}

Test(broken, dtype_i32) {
    const char *dir = copy_model(arch_dir(LLAMA3));
    st_parts p = st_load(dir, "model.safetensors");
    json_t *t = st_tensor(&p, KPROJ1);
    json_object_set_new(t, "dtype", json_string("I32"));
    json_array_set_new(json_object_get(t, "shape"), 0, json_integer(32));
    st_save(dir, "model.safetensors", &p, 0);
    expect_load_error(dir, NEEDLES("model.safetensors: tensor '" KPROJ1 "' has unsupported dtype 'I32'"));
    remove_dir(dir);
}

Test(broken, wrong_shape) {
    const char *dir = copy_model(arch_dir(LLAMA3));
    st_parts p = st_load(dir, "model.safetensors");
    json_t *shape = json_object_get(st_tensor(&p, KPROJ1), "shape");
    json_array_set_new(shape, 0, json_integer(128));
    json_array_set_new(shape, 1, json_integer(64));
    st_save(dir, "model.safetensors", &p, 0);
    expect_load_error(dir, NEEDLES("model.safetensors: tensor '" KPROJ1 "' has shape [128, 64], expected [64, 128] from config.json"));
    remove_dir(dir);
}

Test(broken, missing_tensor) {
    const char *dir = copy_model(arch_dir(LLAMA3));
    st_parts p = st_load(dir, "model.safetensors");
    json_object_del(p.header, KPROJ1);
    st_save(dir, "model.safetensors", &p, 0);
    expect_load_error(dir, NEEDLES("model.safetensors: missing tensor '" KPROJ1 "'"));
    remove_dir(dir);
}

Test(broken, missing_tensor_in_shard) {
    const char *dir = copy_model(tiny_dir());
    const char *shard = "model-00002-of-00003.safetensors", *name = "model.layers.3.mlp.up_proj.weight";
    st_parts p = st_load(dir, shard);
    json_object_del(p.header, name);
    st_save(dir, shard, &p, 0);
    expect_load_error(dir, NEEDLES("model-00002-of-00003.safetensors: missing tensor 'model.layers.3.mlp.up_proj.weight'"));
    remove_dir(dir);
}

Test(broken, missing_shard) {
    const char *dir = copy_model(tiny_dir());
    char path[1024];
    snprintf(path, sizeof path, "%s/model-00003-of-00003.safetensors", dir);
    cr_assert_eq(unlink(path), 0);
    expect_load_error(dir, NEEDLES("model-00003-of-00003.safetensors: shard named in model.safetensors.index.json is missing"));
    remove_dir(dir);
}

Test(broken, index_not_json) {
    const char *dir = copy_model(tiny_dir());
    write_file(dir, "model.safetensors.index.json", "{\"weight_map\": ", 15);
    expect_load_error(dir, NEEDLES("model.safetensors.index.json: not valid JSON"));
    remove_dir(dir);
}

Test(broken, shard_offsets_out_of_range) {
    const char *dir = copy_model(tiny_dir());
    const char *shard = "model-00002-of-00003.safetensors", *name = "model.layers.3.mlp.up_proj.weight";
    st_parts p = st_load(dir, shard);
    json_t *off = json_object_get(st_tensor(&p, name), "data_offsets");
    json_int_t size = json_integer_value(json_array_get(off, 1)) - json_integer_value(json_array_get(off, 0));
    json_array_set_new(off, 0, json_integer((json_int_t)p.data_len));
    json_array_set_new(off, 1, json_integer((json_int_t)p.data_len + size));
    st_save(dir, shard, &p, 0);
    expect_load_error(dir, NEEDLES("model-00002-of-00003.safetensors: tensor 'model.layers.3.mlp.up_proj.weight': data_offsets [",
                                   "exceed the file"));
    remove_dir(dir);
}

Test(broken, offsets_overlap) {
    const char *dir = copy_model(arch_dir(LLAMA3));
    st_parts p = st_load(dir, "model.safetensors");
    json_t *k = json_object_get(st_tensor(&p, KPROJ1), "data_offsets");
    json_object_set_new(st_tensor(&p, "model.layers.1.self_attn.v_proj.weight"), "data_offsets", json_deep_copy(k));
    st_save(dir, "model.safetensors", &p, 0);
    expect_load_error(dir, NEEDLES("model.safetensors: tensors '", "overlap", "model.layers.1.self_attn.v_proj.weight"));
    remove_dir(dir);
}

Test(broken, offsets_size_mismatch) {
    const char *dir = copy_model(arch_dir(LLAMA3));
    st_parts p = st_load(dir, "model.safetensors");
    json_t *off = json_object_get(st_tensor(&p, KPROJ1), "data_offsets");
    json_array_set_new(off, 1, json_integer(json_integer_value(json_array_get(off, 1)) - 2));
    st_save(dir, "model.safetensors", &p, 0);
    expect_load_error(dir, NEEDLES("model.safetensors: tensor '" KPROJ1 "': data_offsets", "need 16384"));
    remove_dir(dir);
}

static void write_config_variant(const char *dir, const char *key, json_t *value /* stolen; NULL deletes */) {
    char path[1024];
    snprintf(path, sizeof path, "%s/config.json", dir);
    json_t *root = load_json(path);
    cr_assert(root);
    if (value) json_object_set_new(root, key, value);
    else json_object_del(root, key);
    char *s = json_dumps(root, JSON_INDENT(2));
    write_file(dir, "config.json", s, strlen(s));
    free(s);
    json_decref(root);
}

Test(broken, config_not_json) {
    const char *dir = copy_model(arch_dir("mistral"));
    write_file(dir, "config.json", "{\"hidden_size\": 128,", 20);
    expect_load_error(dir, NEEDLES("config.json: not valid JSON"));
    remove_dir(dir);
}

Test(broken, config_wrong_type) {
    const char *dir = copy_model(arch_dir("mistral"));
    write_config_variant(dir, "num_key_value_heads", json_string("2"));
    expect_load_error(dir, NEEDLES("config.json: field 'num_key_value_heads' must be a positive integer"));
    remove_dir(dir);
}

Test(broken, config_missing_field) {
    const char *dir = copy_model(arch_dir("qwen2-bias-tied"));
    write_config_variant(dir, "intermediate_size", NULL);
    expect_load_error(dir, NEEDLES("config.json: field 'intermediate_size' is missing"));
    remove_dir(dir);
}

Test(broken, config_rope_yarn) {
    const char *dir = copy_model(arch_dir(LLAMA3));
    write_config_variant(dir, "rope_scaling", json_pack("{s:s, s:f, s:i}", "rope_type", "yarn", "factor", 4.0,
                                                       "original_max_position_embeddings", 32768));
    expect_load_error(dir, NEEDLES("config.json: rope_scaling type 'yarn' is unsupported (supported: linear, llama3)"));
    remove_dir(dir);
}

Test(broken, config_shapes_disagree_with_weights) {
    const char *dir = copy_model(arch_dir("mistral"));
    write_config_variant(dir, "intermediate_size", json_integer(512));
    expect_load_error(dir, NEEDLES("model.safetensors: tensor 'model.layers.0.mlp.", "expected [", "from config.json"));
    remove_dir(dir);
}

Test(broken, no_safetensors) {
    const char *dir = make_temp_dir();
    char d[256];
    snprintf(d, sizeof d, "%s", dir);
    size_t len;
    char path[1024];
    snprintf(path, sizeof path, "%s/config.json", arch_dir("mistral"));
    char *text = read_all(path, &len);
    write_file(d, "config.json", text, len);
    free(text);
    expect_load_error(d, NEEDLES(d, "no model.safetensors or model.safetensors.index.json"));
    remove_dir(d);
}

Test(broken, no_config) {
    const char *dir = make_temp_dir();
    char d[256];
    snprintf(d, sizeof d, "%s", dir);
    expect_load_error(d, NEEDLES(d, "no config.json"));
    remove_dir(d);
}

/* ---- safetensors_parse on hand-made buffers ------------------------------------------ */
static kvs_status count_visit(void *ctx, const char *name, kvs_dtype dtype, int ndim, const int64_t *shape,
                              const void *data, size_t nbytes) {
    (*(int *)ctx)++;
    return KVS_OK;
}

static kvs_status parse_header(const char *header, size_t data_len, int *count) {
    size_t hlen = strlen(header), len = 8 + hlen + data_len;
    uint8_t *buf = calloc(1, len);
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
    memcpy(buf + 8, header, hlen);
    *count = 0;
    kvs_status s = kvs_safetensors_parse(buf, len, "t.safetensors", count_visit, count);
    free(buf);
    return s;
}

Test(safetensors, hand_made) {
    int n;
    cr_assert_eq(parse_header("{\"__metadata__\":{\"format\":\"pt\"},\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],"
                              "\"data_offsets\":[0,16]},\"b\":{\"dtype\":\"BF16\",\"shape\":[],\"data_offsets\":[16,18]},"
                              "\"e\":{\"dtype\":\"F16\",\"shape\":[0,4],\"data_offsets\":[18,18]}}", 18, &n),
                 KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(n, 3);
    cr_assert_eq(parse_header("{}", 0, &n), KVS_OK);
    cr_assert_eq(n, 0);

    static const struct { const char *h; size_t data; const char *needle; } bad[] = {
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4611686018427387904,4],\"data_offsets\":[0,16]}}", 16, "shape is too large"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1],\"data_offsets\":[0,4]}}", 4, "5 dimensions"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4, "non-negative"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,0]}}", 4, "begin after"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 4, "'data_offsets' must be"},
        /* F8_E4M3 is read (FP8 checkpoints; test_fp8_checkpoint), E5M2 is not */
        {"{\"a\":{\"dtype\":\"F8_E5M2\",\"shape\":[1],\"data_offsets\":[0,1]}}", 4, "unsupported dtype 'F8_E5M2'"},
        {"{\"a\":{\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "'dtype' must be a string"},
        {"{\"a\":[1,2]}", 4, "tensor 'a': entry must be an object"},
        {"[1]", 4, "header must be a JSON object"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},\"a\":{}}", 4, "not valid JSON"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"b\":{\"dtype\":\"F32\",\"shape\":[1],"
         "\"data_offsets\":[4,8]}}", 8, "overlap"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cr_assert_neq(parse_header(bad[i].h, bad[i].data, &n), KVS_OK, "case %zu", i);
        expect_contains(kvs_last_error(), "t.safetensors: ");
        expect_contains(kvs_last_error(), bad[i].needle);
        cr_assert_eq(n, 0, "nothing is visited when the header is bad");
    }
    uint8_t tiny[5] = {1, 0, 0, 0, 0};
    cr_assert_eq(kvs_safetensors_parse(tiny, sizeof tiny, "t.safetensors", count_visit, &n), KVS_ERR_FORMAT);
    expect_contains(kvs_last_error(), "too short");
    uint8_t huge[16] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
    cr_assert_eq(kvs_safetensors_parse(huge, sizeof huge, "t.safetensors", count_visit, &n), KVS_ERR_FORMAT);
    expect_contains(kvs_last_error(), "header length 18446744073709551615 exceeds the file (16 bytes)");
}

/* ---- dummy weights ----------------------------------------------------------------------- */
static kvs_config load_bench_config(const char *rel) {
    kvs_config c;
    size_t len;
    char *t = read_all(src_path(rel), &len);
    cr_assert_eq(kvs_config_parse(t, len, rel, &c), KVS_OK, "%s", kvs_last_error());
    free(t);
    return c;
}

Test(dummy, llama3_70b_deterministic_without_the_whole_model) {
    kvs_config c = load_bench_config("bench/llama-3-70b.json");
    kvs_checkpoint *a, *b, *other;
    cr_assert_eq(kvs_checkpoint_dummy(&c, 42, &a), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(kvs_checkpoint_dummy(&c, 42, &b), KVS_OK);
    cr_assert_eq(kvs_checkpoint_dummy(&c, 43, &other), KVS_OK);
    cr_assert_eq(kvs_checkpoint_total_bytes(a), (size_t)70553706496ULL * 2);

    kvs_host_tensor ta, tb, to;
    cr_assert_eq(kvs_checkpoint_read(a, KVS_W_K, 79, &ta), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(ta.dtype, KVS_BF16);
    cr_assert(ta.ndim == 2 && ta.shape[0] == 1024 && ta.shape[1] == 8192);
    cr_assert_eq(ta.nbytes, (size_t)1024 * 8192 * 2);
    cr_assert_eq(kvs_checkpoint_read(b, KVS_W_K, 79, &tb), KVS_OK);
    cr_assert_eq(memcmp(ta.data, tb.data, ta.nbytes), 0, "same seed, same weights");
    cr_assert_eq(kvs_checkpoint_read(other, KVS_W_K, 79, &to), KVS_OK);
    cr_assert_neq(memcmp(ta.data, to.data, 4096), 0, "another seed, other weights");

    size_t n = ta.nbytes / 2;
    float *f = malloc(n * sizeof *f);
    kvs_to_f32(f, ta.data, ta.dtype, n);
    double sum = 0, sq = 0;
    for (size_t i = 0; i < n; i++) sum += f[i], sq += (double)f[i] * f[i];
    double mean = sum / n, sd = sqrt(sq / n - mean * mean);
    cr_assert(fabs(mean) < 1e-3 && fabs(sd - 0.02) < 1e-3, "mean %g sd %g", mean, sd);

    /* another layer or kind differs; reading back the first gives the same bytes */
    uint16_t head[64];
    memcpy(head, ta.data, sizeof head);
    cr_assert_eq(kvs_checkpoint_read(a, KVS_W_K, 78, &ta), KVS_OK);
    cr_assert_neq(memcmp(head, ta.data, sizeof head), 0);
    cr_assert_eq(kvs_checkpoint_read(a, KVS_W_V, 79, &ta), KVS_OK);
    cr_assert_neq(memcmp(head, ta.data, sizeof head), 0);
    cr_assert_eq(kvs_checkpoint_read(a, KVS_W_K, 79, &ta), KVS_OK);
    cr_assert_eq(memcmp(head, ta.data, sizeof head), 0);

    cr_assert_eq(kvs_checkpoint_read(a, KVS_W_ATTN_NORM, 0, &ta), KVS_OK);
    cr_assert(ta.ndim == 1 && ta.shape[0] == 8192);
    kvs_to_f32(f, ta.data, ta.dtype, 8192);
    for (int i = 0; i < 8192; i++) cr_assert(fabsf(f[i] - 1.0f) < 0.1f, "norm weight %d = %g", i, f[i]);
    cr_assert_eq(kvs_checkpoint_read(a, KVS_W_O, 40, &ta), KVS_OK);
    cr_assert(ta.shape[0] == 8192 && ta.shape[1] == 8192);
    cr_assert_eq(kvs_checkpoint_read(a, KVS_W_Q_BIAS, 0, &ta), KVS_ERR_NOT_FOUND);
    cr_assert_eq(kvs_checkpoint_read(a, KVS_W_K, 80, &ta), KVS_ERR_INVALID);
    free(f);

    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    cr_assert_lt(ru.ru_maxrss, 4L << 20, "peak RSS %ld KiB: the dummy checkpoint must not hold the model", ru.ru_maxrss);
    kvs_checkpoint_destroy(a);
    kvs_checkpoint_destroy(b);
    kvs_checkpoint_destroy(other);
}

Test(dummy, other_dtypes) {
    kvs_config c;
    load_cfg(arch_dir("mistral"), &c); /* float32 */
    kvs_checkpoint *ck;
    cr_assert_eq(kvs_checkpoint_dummy(&c, 1, &ck), KVS_OK);
    kvs_host_tensor t;
    cr_assert_eq(kvs_checkpoint_read(ck, KVS_W_EMBED, -1, &t), KVS_OK);
    cr_assert_eq(t.dtype, KVS_F32);
    cr_assert_eq(t.nbytes, (size_t)512 * 128 * 4);
    check_all_finite(&c, ck);
    kvs_checkpoint_destroy(ck);
    load_cfg(arch_dir("qwen2-bias-tied"), &c); /* float16, biases */
    cr_assert_eq(kvs_checkpoint_dummy(&c, 1, &ck), KVS_OK);
    cr_assert_eq(kvs_checkpoint_read(ck, KVS_W_V_BIAS, 1, &t), KVS_OK);
    cr_assert_eq(t.dtype, KVS_F16);
    check_all_finite(&c, ck);
    kvs_checkpoint_destroy(ck);
}

/* The backends' dummy_fill op makes a slice of a dummy weight in place: the
 * CPU op gives bit for bit what the host tensor holds at those elements
 * (after upload_weight's conversion to f32), for every dtype, 1-D and 2-D
 * weights, slices with odd offsets and slices crossing the generator's chunks. */
static void check_fill_slice(kvs_backend *be, kvs_checkpoint *ck, kvs_weight_kind kind, int layer, int64_t r0,
                             int64_t nr, int64_t c0, int64_t nc) {
    kvs_dummy_weight dw;
    cr_assert(kvs_checkpoint_dummy_weight(ck, kind, layer, &dw), "weight %d layer %d", (int)kind, layer);
    kvs_host_tensor t;
    cr_assert_eq(kvs_checkpoint_read(ck, kind, layer, &t), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(t.dtype, dw.dtype);
    cr_assert_eq(t.shape[0], dw.rows);
    cr_assert_eq(t.ndim == 2 ? t.shape[1] : 1, dw.cols);
    if (nr < 0) r0 = 0, nr = dw.rows;
    if (nc < 0) c0 = 0, nc = dw.cols;
    size_t n = (size_t)nr * nc, es = kvs_dtype_size(t.dtype);
    float *want = malloc(n * sizeof(float)), *got = malloc(n * sizeof(float));
    for (int64_t r = 0; r < nr; r++)
        kvs_to_f32(want + r * nc, (const char *)t.data + ((size_t)(r0 + r) * dw.cols + c0) * es, t.dtype, nc);
    be->dummy_fill(be, got, dw.seed, dw.scale, dw.dtype, dw.cols, r0, nr, c0, nc);
    for (size_t i = 0; i < n; i++)
        cr_assert_eq(memcmp(&got[i], &want[i], 4), 0,
                     "weight %d layer %d %s slice rows %lld+%lld cols %lld+%lld, element %zu: %a != %a", (int)kind,
                     layer, kvs_dtype_name(t.dtype), (long long)r0, (long long)nr, (long long)c0, (long long)nc, i,
                     got[i], want[i]);
    free(want);
    free(got);
}

Test(dummy, backend_fill_equals_host_slices) {
    kvs_backend *be;
    cr_assert_eq(kvs_backend_cpu_create(0, &be), KVS_OK);
    const char *dtypes[3] = {"float32", "float16", "bfloat16"};
    for (int d = 0; d < 3; d++) {
        char json[1024];
        /* embed 1500 x 96 = 144,000 elements: three generator chunks */
        snprintf(json, sizeof json,
                 "{\"architectures\": [\"Qwen2ForCausalLM\"], \"hidden_size\": 96, \"num_hidden_layers\": 2,"
                 " \"num_attention_heads\": 6, \"num_key_value_heads\": 2, \"head_dim\": 16,"
                 " \"intermediate_size\": 160, \"vocab_size\": 1500, \"max_position_embeddings\": 256,"
                 " \"rms_norm_eps\": 1e-5, \"rope_theta\": 10000.0, \"tie_word_embeddings\": false,"
                 " \"torch_dtype\": \"%s\"}",
                 dtypes[d]);
        kvs_config c;
        cr_assert_eq(kvs_config_parse(json, strlen(json), "test", &c), KVS_OK, "%s", kvs_last_error());
        kvs_checkpoint *ck;
        cr_assert_eq(kvs_checkpoint_dummy(&c, 7 + d, &ck), KVS_OK);
        check_fill_slice(be, ck, KVS_W_EMBED, -1, 0, -1, 0, -1);
        check_fill_slice(be, ck, KVS_W_EMBED, -1, 681, 7, 0, -1); /* rows across the first chunk's end */
        check_fill_slice(be, ck, KVS_W_LM_HEAD, -1, 750, 750, 0, -1);
        check_fill_slice(be, ck, KVS_W_Q, 1, 32, 48, 0, -1);
        check_fill_slice(be, ck, KVS_W_O, 0, 0, -1, 48, 48); /* a column slice */
        check_fill_slice(be, ck, KVS_W_DOWN, 1, 3, 90, 77, 3);
        check_fill_slice(be, ck, KVS_W_K_BIAS, 1, 16, 16, 0, -1); /* 1-D */
        check_fill_slice(be, ck, KVS_W_GATE, 0, 0, -1, 0, -1);
        kvs_dummy_weight dw;
        cr_assert_not(kvs_checkpoint_dummy_weight(ck, KVS_W_ATTN_NORM, 0, &dw), "norms stay on the host path");
        kvs_checkpoint_destroy(ck);
    }
    /* a slice of a 70B weight deep in the tensor (no whole-tensor work on the op's side) */
    kvs_config c = load_bench_config("bench/llama-3-70b.json");
    kvs_checkpoint *ck, *real;
    cr_assert_eq(kvs_checkpoint_dummy(&c, 42, &ck), KVS_OK);
    check_fill_slice(be, ck, KVS_W_DOWN, 79, 8100, 92, 14336 + 5, 333);
    kvs_dummy_weight dw;
    kvs_config tc;
    load_cfg(tiny_dir(), &tc);
    cr_assert_eq(kvs_checkpoint_open(tiny_dir(), &tc, &real), KVS_OK, "%s", kvs_last_error());
    cr_assert_not(kvs_checkpoint_dummy_weight(real, KVS_W_Q, 0, &dw), "a real checkpoint has no dummy weights");
    kvs_checkpoint_destroy(real);
    kvs_checkpoint_destroy(ck);
    be->destroy(be);
}

/* A model uploaded through dummy_fill equals one uploaded from the host tensors. */
Test(dummy, model_through_fill_equals_host_upload) {
    kvs_config c;
    load_cfg(arch_dir("qwen2-bias-tied"), &c);
    kvs_checkpoint *ck;
    cr_assert_eq(kvs_checkpoint_dummy(&c, 5, &ck), KVS_OK);
    float *logits[2];
    for (int k = 0; k < 2; k++) {
        kvs_backend *be;
        cr_assert_eq(kvs_backend_cpu_create(0, &be), KVS_OK);
        if (k == 1) be->dummy_fill = NULL; /* the host path */
        kvs_model *m;
        cr_assert_eq(kvs_model_create(&c, ck, be, &m), KVS_OK, "%s", kvs_last_error());
        kvs_executor *x;
        cr_assert_eq(kvs_executor_create(m, NULL, &x), KVS_OK, "%s", kvs_last_error());
        kvs_kv_config kc = {.n_layers = c.n_layers, .n_kv_heads = c.n_kv_heads, .head_dim = c.head_dim,
                            .n_heads = c.n_heads, .block_size = 16, .max_seqs = 1, .n_blocks = 4 * c.n_layers};
        kvs_kv_cache *kv;
        cr_assert_eq(kvs_kv_create(&kc, be, &kv), KVS_OK, "%s", kvs_last_error());
        int seq = kvs_kv_seq_create(kv);
        int32_t ids[20], pos[20], qs[2] = {0, 20};
        for (int i = 0; i < 20; i++) ids[i] = (i * 31 + 3) % c.vocab_size, pos[i] = i;
        uint8_t want = 1;
        cr_assert_eq(kvs_kv_reserve(kv, seq, 20), KVS_OK);
        kvs_batch b = {20, 1, ids, pos, qs, &seq, &want};
        logits[k] = malloc(sizeof(float) * c.vocab_size);
        cr_assert_eq(rig_forward(x, &b, kv, logits[k]), KVS_OK, "%s", kvs_last_error());
        kv_keep(kv, &b);
        kvs_kv_destroy(kv);
        kvs_executor_destroy(x);
        kvs_model_destroy(m);
        be->destroy(be);
    }
    cr_assert_eq(memcmp(logits[0], logits[1], sizeof(float) * c.vocab_size), 0, "logits differ");
    free(logits[0]);
    free(logits[1]);
    kvs_checkpoint_destroy(ck);
}

/* ---- kvsparse info ------------------------------------------------------------------------- */
static int run_info(const char *args, char **out) {
    const char *bin = kvsparse_binary();
    cr_assert(access(bin, X_OK) == 0, "kvsparse binary not found at %s", bin);
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "'%s' info %s", bin, args);
    return run_capture(cmd, out);
}

Test(cli_info, tiny_needle_text_and_json) {
    char args[2048], *out;
    snprintf(args, sizeof args, "-m '%s'", tiny_dir());
    cr_assert_eq(run_info(args, &out), 0, "%s", out);
    expect_contains(out, "LlamaForCausalLM");
    expect_contains(out, "4 heads, 2 KV heads, head_dim 128");
    expect_contains(out, "39863296 bytes");
    expect_contains(out, "whole budget holds KV");
    free(out);

    snprintf(args, sizeof args, "-m '%s' --json --memory 1 2>/dev/null", tiny_dir());
    cr_assert_eq(run_info(args, &out), 0, "%s", out);
    json_error_t err;
    json_t *j = json_loads(out, 0, &err);
    cr_assert(j, "not JSON: %s\n%s", err.text, out);
    cr_assert_eq(json_integer_value(json_object_get(j, "layers")), 8);
    cr_assert_eq(json_integer_value(json_object_get(j, "weight_bytes")), 39863296);
    cr_assert_eq(json_integer_value(json_object_get(j, "kv_bytes_per_token_bf16")), 8192);
    cr_assert_eq(json_integer_value(json_object_get(j, "kv_tokens_bf16")), (1 << 30) / 8192);
    cr_assert_eq(json_integer_value(json_object_get(j, "kv_tokens_f32")), (1 << 30) / 16384);
    json_decref(j);
    free(out);
}

Test(cli_info, config_only_and_arguments) {
    char args[2048], *out;
    snprintf(args, sizeof args, "--config '%s' --json 2>/dev/null", src_path("bench/llama-3-70b.json"));
    cr_assert_eq(run_info(args, &out), 0, "%s", out);
    json_error_t err;
    json_t *j = json_loads(out, 0, &err);
    cr_assert(j, "not JSON: %s\n%s", err.text, out);
    cr_assert_eq(json_integer_value(json_object_get(j, "parameters")), 70553706496LL);
    cr_assert_eq(json_integer_value(json_object_get(j, "kv_bytes_per_token_bf16")), 327680);
    /* the default budget: serve's KV pool on the CPU, 1 GiB */
    cr_assert_eq(json_integer_value(json_object_get(j, "kv_tokens_bf16")), (1LL << 30) / 327680);
    json_decref(j);
    free(out);

    snprintf(args, sizeof args, "-m '%s' --load-format dummy", arch_dir(LLAMA3));
    cr_assert_eq(run_info(args, &out), 0, "%s", out);
    expect_contains(out, "llama3 (factor 8");
    free(out);

    cr_assert_eq(run_info("", &out), 2);
    free(out);
    cr_assert_eq(run_info("-m", &out), 2);
    expect_contains(out, "missing value for '-m'");
    free(out);
    cr_assert_eq(run_info("-m x --config y", &out), 2);
    free(out);
    cr_assert_eq(run_info("-m x --memory -3", &out), 2);
    free(out);
    cr_assert_eq(run_info("-m x --load-format pt", &out), 2);
    free(out);
    cr_assert_eq(run_info("--bogus", &out), 2);
    free(out);
    cr_assert_eq(run_info("--config /nonexistent/config.json", &out), 1);
    expect_contains(out, "kvsparse: /nonexistent/config.json: cannot open");
    free(out);
}
