/* kvsparse convert: the tokenizer as tokenizer.ggml.* metadata (convert.h). */
#define _GNU_SOURCE /* asprintf */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/convert.h"
#include "tokenizer/tokenizer.h"

enum { TOKEN_NORMAL = 1, TOKEN_CONTROL = 3, TOKEN_USER_DEFINED = 4, TOKEN_UNUSED = 5 };

/* A .gguf source: its tokenizer.* keys as they are. */
static kvs_status copy_gguf_vocab(kvs_gguf_writer *w, const char *path, bool *wrote) {
    kvs_gguf *g;
    KVS_TRY(kvs_gguf_open(path, &g));
    kvs_status s = KVS_OK;
    for (size_t i = 0; s == KVS_OK && i < g->n_kvs; i++)
        if (!strncmp(g->kvs[i].key, "tokenizer.", 10)) {
            s = kvs_gguf_copy_kv(w, &g->kvs[i]);
            *wrote = true;
        }
    kvs_gguf_destroy(g);
    return s;
}

/* The pre-tokenizer's name for llama.cpp: a Split regex it knows, or GPT-2's
 * own (a ByteLevel that splits). NULL: not a byte-level BPE it can name. */
static const char *pre_name(const json_t *pre, bool *byte_level) {
    const char *type = json_string_value(json_object_get(pre, "type"));
    if (!type) return NULL;
    if (!strcmp(type, "Sequence")) {
        const char *name = NULL, *n;
        size_t i;
        json_t *p;
        json_array_foreach(json_object_get(pre, "pretokenizers"), i, p) if ((n = pre_name(p, byte_level))) name = n;
        return name;
    }
    if (!strcmp(type, "ByteLevel")) {
        *byte_level = true;
        return json_is_false(json_object_get(pre, "use_regex")) ? NULL : "gpt2";
    }
    if (!strcmp(type, "Split")) {
        const char *re = json_string_value(json_object_get(json_object_get(pre, "pattern"), "Regex"));
        if (re && !strcmp(re, kvs_gguf_pre_split("llama-bpe"))) return "llama-bpe";
        if (re && !strcmp(re, kvs_gguf_pre_split("qwen2"))) return "qwen2";
    }
    return NULL;
}

/* tokenizer_config.json's bos_token / eos_token: a string or {"content": ...}. */
static const char *config_token(const json_t *tc, const char *field) {
    const json_t *v = json_object_get(tc, field);
    return json_is_object(v) ? json_string_value(json_object_get(v, "content")) : json_string_value(v);
}

static int64_t token_id(char **tokens, int64_t n, const char *text) {
    for (int64_t i = 0; text && i < n; i++)
        if (tokens[i] && !strcmp(tokens[i], text)) return i;
    return -1;
}

/* Whether the post-processor's single template starts with a special token (BOS added). */
static bool template_adds_bos(const json_t *pp) {
    const char *type = json_string_value(json_object_get(pp, "type"));
    if (!type) return false;
    if (!strcmp(type, "Sequence")) {
        size_t i;
        json_t *p;
        json_array_foreach(json_object_get(pp, "processors"), i, p) if (template_adds_bos(p)) return true;
        return false;
    }
    return !strcmp(type, "TemplateProcessing") &&
           json_object_get(json_array_get(json_object_get(pp, "single"), 0), "SpecialToken");
}

typedef struct {
    char **tokens;
    int32_t *types;
    int64_t n;
    char **merges;
    size_t n_merges;
} vocab;

static void vocab_free(vocab *v) {
    for (int64_t i = 0; v->tokens && i < v->n; i++) free(v->tokens[i]);
    for (size_t i = 0; v->merges && i < v->n_merges; i++) free(v->merges[i]);
    free(v->tokens), free(v->types), free(v->merges);
}

static kvs_status set_token(vocab *v, const char *file, const char *text, json_int_t id, int type) {
    if (!text || id < 0 || id >= v->n)
        return kvs_fail(KVS_ERR_FORMAT, "%s: token '%s' has id %lld, outside the vocabulary of %lld", file,
                        text ? text : "?", (long long)id, (long long)v->n);
    free(v->tokens[id]);
    if (!(v->tokens[id] = strdup(text))) return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    v->types[id] = type;
    return KVS_OK;
}

/* tokenizer.json's vocabulary, added tokens and merges, padded to cfg's vocab_size. */
static kvs_status read_vocab(const json_t *tj, const char *file, const kvs_config *cfg, vocab *v) {
    const json_t *model = json_object_get(tj, "model"), *tv = json_object_get(model, "vocab"), *added = json_object_get(tj, "added_tokens");
    const char *key;
    json_t *val;
    size_t i;
    v->n = cfg->vocab_size;
    json_object_foreach((json_t *)tv, key, val) if (json_integer_value(val) >= v->n) v->n = json_integer_value(val) + 1;
    json_array_foreach(added, i, val) if (json_integer_value(json_object_get(val, "id")) >= v->n) v->n =
        json_integer_value(json_object_get(val, "id")) + 1;
    v->tokens = calloc((size_t)v->n, sizeof *v->tokens);
    v->types = calloc((size_t)v->n, sizeof *v->types);
    if (!v->tokens || !v->types) return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    json_object_foreach((json_t *)tv, key, val) KVS_TRY(set_token(v, file, key, json_integer_value(val), TOKEN_NORMAL));
    json_array_foreach(added, i, val) {
        bool special = json_is_true(json_object_get(val, "special"));
        KVS_TRY(set_token(v, file, json_string_value(json_object_get(val, "content")),
                          json_integer_value(json_object_get(val, "id")), special ? TOKEN_CONTROL : TOKEN_USER_DEFINED));
    }
    for (int64_t id = 0; id < v->n; id++) /* ids nothing names: llama.cpp's padding tokens */
        if (!v->tokens[id]) {
            char pad[32];
            snprintf(pad, sizeof pad, "[PAD%lld]", (long long)id);
            KVS_TRY(set_token(v, file, pad, id, TOKEN_UNUSED));
        }
    const json_t *merges = json_object_get(model, "merges");
    v->merges = calloc(json_array_size(merges) + 1, sizeof *v->merges);
    if (!v->merges) return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    json_array_foreach(merges, i, val) { /* "a b", or ["a", "b"] in newer files */
        const char *a = json_string_value(val), *l = json_string_value(json_array_get(val, 0)),
                   *r = json_string_value(json_array_get(val, 1));
        if (!a && !(l && r)) return kvs_fail(KVS_ERR_FORMAT, "%s: merge %zu is neither \"a b\" nor [a, b]", file, i);
        char *m = NULL;
        if (a ? !(m = strdup(a)) : asprintf(&m, "%s %s", l, r) < 0) return kvs_fail(KVS_ERR_NOMEM, "out of memory");
        v->merges[v->n_merges++] = m;
    }
    return KVS_OK;
}

static kvs_status write_vocab(kvs_gguf_writer *w, const char *dir, const json_t *tj, const json_t *tc,
                              const kvs_config *cfg) {
    char file[4096];
    snprintf(file, sizeof file, "%s/tokenizer.json", dir);
    const json_t *model = json_object_get(tj, "model");
    const char *mtype = json_string_value(json_object_get(model, "type"));
    bool byte_level = false;
    const char *pre = pre_name(json_object_get(tj, "pre_tokenizer"), &byte_level);
    if (!mtype || strcmp(mtype, "BPE") || !byte_level || !pre)
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: only byte-level BPE vocabularies with the llama-bpe (Llama 3), "
                        "qwen2 or gpt2 pre-tokenizer are converted (this one: model %s%s); --no-tokenizer writes "
                        "the weights alone", file, mtype ? mtype : "?", byte_level ? ", another split" :
                        ", no ByteLevel pre-tokenizer");
    vocab v = {0};
    kvs_status s = read_vocab(tj, file, cfg, &v);
    int64_t bos = token_id(v.tokens, v.n, config_token(tc, "bos_token")),
            eos = token_id(v.tokens, v.n, config_token(tc, "eos_token")), eot = -1;
    if (bos < 0) bos = cfg->bos_token_id;
    if (eos < 0 && cfg->n_eos) eos = cfg->eos_token_ids[0];
    for (int i = 0; i < cfg->n_eos && eot < 0; i++) /* llama.cpp stops on eot too: the config's other stop id */
        if (cfg->eos_token_ids[i] != eos) eot = cfg->eos_token_ids[i];
    const json_t *add_bos_v = json_object_get(tc, "add_bos_token");
    bool add_bos = json_is_boolean(add_bos_v) ? json_is_true(add_bos_v)
                                               : template_adds_bos(json_object_get(tj, "post_processor"));
    if (s == KVS_OK) s = kvs_gguf_set_str(w, "tokenizer.ggml.model", "gpt2", 4);
    if (s == KVS_OK) s = kvs_gguf_set_str(w, "tokenizer.ggml.pre", pre, strlen(pre));
    if (s == KVS_OK) s = kvs_gguf_set_str_array(w, "tokenizer.ggml.tokens", (const char *const *)v.tokens, NULL, (size_t)v.n);
    if (s == KVS_OK) s = kvs_gguf_set_array(w, "tokenizer.ggml.token_type", KVS_GGUF_I32, v.types, (size_t)v.n);
    if (s == KVS_OK) s = kvs_gguf_set_str_array(w, "tokenizer.ggml.merges", (const char *const *)v.merges, NULL, v.n_merges);
    if (s == KVS_OK && bos >= 0) s = kvs_gguf_set_u32(w, "tokenizer.ggml.bos_token_id", (uint32_t)bos);
    if (s == KVS_OK && eos >= 0) s = kvs_gguf_set_u32(w, "tokenizer.ggml.eos_token_id", (uint32_t)eos);
    if (s == KVS_OK && eot >= 0) s = kvs_gguf_set_u32(w, "tokenizer.ggml.eot_token_id", (uint32_t)eot);
    if (s == KVS_OK) s = kvs_gguf_set_bool(w, "tokenizer.ggml.add_bos_token", add_bos);
    const char *tpl = json_string_value(json_object_get(tc, "chat_template"));
    if (s == KVS_OK && tpl) s = kvs_gguf_set_str(w, "tokenizer.chat_template", tpl, strlen(tpl));
    vocab_free(&v);
    return s;
}

kvs_status kvs_convert_vocab(kvs_gguf_writer *w, const char *model, const kvs_config *cfg, bool *wrote) {
    *wrote = false;
    if (!model) return KVS_OK;
    if (kvs_gguf_is_path(model)) return copy_gguf_vocab(w, model, wrote);
    char path[4096];
    snprintf(path, sizeof path, "%s/tokenizer.json", model);
    if (access(path, R_OK)) return KVS_OK;
    json_error_t err;
    json_t *tj = json_load_file(path, 0, &err), *tc = NULL;
    if (!tj) return kvs_fail(KVS_ERR_FORMAT, "%s: line %d: %s", path, err.line, err.text);
    snprintf(path, sizeof path, "%s/tokenizer_config.json", model);
    if (!access(path, R_OK) && !(tc = json_load_file(path, 0, &err))) {
        json_decref(tj);
        return kvs_fail(KVS_ERR_FORMAT, "%s: line %d: %s", path, err.line, err.text);
    }
    kvs_status s = write_vocab(w, model, tj, tc, cfg);
    json_decref(tj), json_decref(tc);
    *wrote = s == KVS_OK;
    return s;
}
