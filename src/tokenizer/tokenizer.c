/* tokenizer: loading tokenizer.json (+ tokenizer_config.json), the encode pipeline
 * (added tokens -> normalizer -> normalized added tokens -> pre-tokenizer -> BPE ->
 * post-processor), decoding, and the vocabulary accessors. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf/gguf.h"
#include "tokenizer/tokenizer_internal.h"

static char *dup_str(const char *s) {
    if (!s) return NULL;
    size_t n = strlen(s);
    char *d = malloc(n + 1);
    if (d) memcpy(d, s, n + 1);
    return d;
}

void kvs_tokenizer_destroy(kvs_tokenizer *t) {
    if (!t) return;
    tk_bpe_free(&t->bpe);
    tk_added_free(&t->added);
    tk_normalizer_free(t->normalizer);
    tk_pretok_free(t->pretok);
    tk_decoder_free(t->decoder);
    free(t->post.prefix);
    free(t->post.suffix);
    free(t->text);
    free(t->text_len);
    free(t->special);
    free(t->chat_template);
    free(t->bos_token);
    free(t->eos_token);
    free(t);
}

/* ---- post-processor ----------------------------------------------------------------------- */
static kvs_status post_add(tk_post *p, bool suffix, int32_t id) {
    int32_t **v = suffix ? &p->suffix : &p->prefix;
    int *n = suffix ? &p->n_suffix : &p->n_prefix;
    int32_t *nv = realloc(*v, (size_t)(*n + 1) * sizeof *nv);
    if (!nv) return kvs_fail(KVS_ERR_NOMEM, "tokenizer.json: out of memory for post_processor");
    nv[(*n)++] = id;
    *v = nv;
    return KVS_OK;
}

static kvs_status parse_template(json_t *j, const char *where, tk_post *p) {
    json_t *single = json_object_get(j, "single"), *specials = json_object_get(j, "special_tokens");
    if (!json_is_array(single)) return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s.single must be an array", where);
    bool after = false;
    for (size_t i = 0; i < json_array_size(single); i++) {
        json_t *it = json_array_get(single, i), *sp = json_object_get(it, "SpecialToken");
        if (json_is_object(json_object_get(it, "Sequence"))) {
            after = true;
            continue;
        }
        json_t *name = json_object_get(sp, "id");
        if (!json_is_string(name))
            return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s.single[%zu] must be a Sequence or SpecialToken with an id", where, i);
        json_t *ids = json_object_get(json_object_get(specials, json_string_value(name)), "ids");
        if (!json_is_array(ids))
            return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s.special_tokens[\"%.64s\"].ids is missing", where,
                            json_string_value(name));
        for (size_t k = 0; k < json_array_size(ids); k++) {
            json_t *id = json_array_get(ids, k);
            if (!json_is_integer(id) || json_integer_value(id) < 0 || json_integer_value(id) >= TK_MAX_ID)
                return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s.special_tokens[\"%.64s\"].ids[%zu] must be an id",
                                where, json_string_value(name), k);
            KVS_TRY(post_add(p, after, (int32_t)json_integer_value(id)));
        }
    }
    return KVS_OK;
}

static kvs_status parse_post(json_t *j, const char *where, tk_post *p) {
    if (!j || json_is_null(j)) return KVS_OK;
    if (!json_is_object(j)) return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s must be an object", where);
    const char *type;
    KVS_TRY(tk_json_string(j, "type", where, true, &type, NULL));
    char w[256];
    if (!strcmp(type, "TemplateProcessing")) return parse_template(j, where, p);
    if (!strcmp(type, "ByteLevel")) return KVS_OK; /* offsets only */
    if (!strcmp(type, "Sequence")) {
        json_t *arr = json_object_get(j, "processors");
        if (!json_is_array(arr)) return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s.processors must be an array", where);
        for (size_t i = 0; i < json_array_size(arr); i++) {
            snprintf(w, sizeof w, "%s.processors[%zu]", where, i);
            KVS_TRY(parse_post(json_array_get(arr, i), w, p));
        }
        return KVS_OK;
    }
    if (!strcmp(type, "BertProcessing") || !strcmp(type, "RobertaProcessing")) {
        json_t *cls = json_object_get(j, "cls"), *sep = json_object_get(j, "sep");
        if (!json_is_integer(json_array_get(cls, 1)) || !json_is_integer(json_array_get(sep, 1)))
            return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s.cls and .sep must be [token, id]", where);
        KVS_TRY(post_add(p, false, (int32_t)json_integer_value(json_array_get(cls, 1))));
        return post_add(p, true, (int32_t)json_integer_value(json_array_get(sep, 1)));
    }
    return kvs_fail(KVS_ERR_UNSUPPORTED, "tokenizer.json: %s.type '%s' is not a supported post-processor", where, type);
}

/* ---- tokenizer_config.json ------------------------------------------------------------------ */
static const char *token_string(json_t *v) {
    if (json_is_string(v)) return json_string_value(v);
    if (json_is_object(v) && json_is_string(json_object_get(v, "content")))
        return json_string_value(json_object_get(v, "content"));
    return NULL;
}

static kvs_status parse_config(kvs_tokenizer *t, const char *cfg, size_t len) {
    json_error_t err;
    json_t *j = json_loadb(cfg, len, JSON_DECODE_INT_AS_REAL, &err); /* model_max_length can be 1e30 */
    if (!j) return kvs_fail(KVS_ERR_FORMAT, "tokenizer_config.json: line %d: %s", err.line, err.text);
    kvs_status st = KVS_OK;
    if (!json_is_object(j)) {
        st = kvs_fail(KVS_ERR_FORMAT, "tokenizer_config.json: must be an object");
        goto out;
    }
    json_t *ct = json_object_get(j, "chat_template");
    const char *tpl = NULL;
    if (json_is_string(ct)) {
        tpl = json_string_value(ct);
    } else if (json_is_array(ct)) { /* [{name, template}]: "default", else the first */
        for (size_t i = 0; i < json_array_size(ct); i++) {
            json_t *e = json_array_get(ct, i);
            const char *name = json_string_value(json_object_get(e, "name"));
            const char *body = json_string_value(json_object_get(e, "template"));
            if (body && (!tpl || (name && !strcmp(name, "default")))) tpl = body;
        }
    } else if (ct && !json_is_null(ct)) {
        st = kvs_fail(KVS_ERR_FORMAT, "tokenizer_config.json: chat_template must be a string or a list");
        goto out;
    }
    const char *bos = token_string(json_object_get(j, "bos_token"));
    const char *eos = token_string(json_object_get(j, "eos_token"));
    if ((tpl && !(t->chat_template = dup_str(tpl))) || (bos && !(t->bos_token = dup_str(bos))) ||
        (eos && !(t->eos_token = dup_str(eos))))
        st = kvs_fail(KVS_ERR_NOMEM, "tokenizer_config.json: out of memory");
out:
    json_decref(j);
    return st;
}

static void resolve_bos_eos(kvs_tokenizer *t) {
    t->bos_id = t->bos_token ? kvs_tokenizer_token_id(t, t->bos_token) : -1;
    if (t->bos_id < 0 && !t->bos_token && t->post.n_prefix > 0) t->bos_id = t->post.prefix[0];
    t->eos_id = t->eos_token ? kvs_tokenizer_token_id(t, t->eos_token) : -1;
}

/* ---- building ----------------------------------------------------------------------------- */
static kvs_status build_tables(kvs_tokenizer *t) {
    int n = t->bpe.n_tokens;
    for (int i = 0; i < t->added.n; i++)
        if (t->added.tokens[i].id >= n) n = t->added.tokens[i].id + 1;
    t->vocab_size = n;
    t->text = calloc((size_t)n + 1, sizeof *t->text);
    t->text_len = calloc((size_t)n + 1, sizeof *t->text_len);
    t->special = calloc((size_t)n + 1, 1);
    if (!t->text || !t->text_len || !t->special) return kvs_fail(KVS_ERR_NOMEM, "tokenizer.json: out of memory");
    for (int i = 0; i < t->bpe.n_tokens; i++) {
        t->text[i] = t->bpe.tokens[i];
        t->text_len[i] = t->bpe.token_len[i];
    }
    for (int i = 0; i < t->added.n; i++) {
        const tk_added *a = &t->added.tokens[i];
        t->text[a->id] = a->content;
        t->text_len[a->id] = (uint32_t)a->len;
        t->special[a->id] = a->special;
    }
    return KVS_OK;
}

static kvs_status parse_json(kvs_tokenizer *t, json_t *root) {
    if (!json_is_object(root)) return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: the top level must be an object");
    json_t *model = json_object_get(root, "model");
    if (!model) return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: model is missing");
    KVS_TRY(tk_bpe_parse(model, &t->bpe));
    KVS_TRY(tk_added_parse(json_object_get(root, "added_tokens"), &t->added));
    json_t *j = json_object_get(root, "normalizer");
    if (j && !json_is_null(j)) KVS_TRY(tk_normalizer_parse(j, "normalizer", &t->normalizer));
    j = json_object_get(root, "pre_tokenizer");
    if (j && !json_is_null(j)) KVS_TRY(tk_pretok_parse(j, "pre_tokenizer", &t->pretok));
    KVS_TRY(tk_pre_chain_build(t->pretok, &t->pre_chain));
    j = json_object_get(root, "decoder");
    if (j && !json_is_null(j)) KVS_TRY(tk_decoder_parse(j, "decoder", &t->decoder));
    KVS_TRY(parse_post(json_object_get(root, "post_processor"), "post_processor", &t->post));
    return build_tables(t);
}

/* The tokenizer of a tokenizer.json root (its reference kept by the caller)
 * and tokenizer_config.json's text (may be NULL). */
static kvs_status build(json_t *root, const char *config_json, size_t config_len, kvs_tokenizer **out) {
    kvs_tokenizer *t = calloc(1, sizeof *t);
    kvs_status st = t ? parse_json(t, root) : kvs_fail(KVS_ERR_NOMEM, "tokenizer.json: out of memory");
    if (st == KVS_OK && config_json) st = parse_config(t, config_json, config_len);
    if (st != KVS_OK) {
        kvs_tokenizer_destroy(t);
        return st;
    }
    resolve_bos_eos(t);
    *out = t;
    return KVS_OK;
}

kvs_status kvs_tokenizer_parse(const char *tokenizer_json, size_t len, const char *config_json,
                               size_t config_len, kvs_tokenizer **out) {
    *out = NULL;
    if (!tokenizer_json) return kvs_fail(KVS_ERR_INVALID, "tokenizer.json: no text given");
    json_error_t err;
    json_t *root = json_loadb(tokenizer_json, len, JSON_ALLOW_NUL, &err);
    if (!root) return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: line %d column %d: %s", err.line, err.column, err.text);
    kvs_status st = build(root, config_json, config_len, out);
    json_decref(root);
    return st;
}

kvs_status kvs_tokenizer_from_gguf(const kvs_gguf *g, kvs_tokenizer **out) {
    *out = NULL;
    json_t *root, *cfg;
    KVS_TRY(tk_gguf_json(g, &root, &cfg));
    char *cfg_text = json_dumps(cfg, JSON_COMPACT);
    kvs_status st = cfg_text ? build(root, cfg_text, strlen(cfg_text), out)
                             : kvs_fail(KVS_ERR_NOMEM, "tokenizer: out of memory");
    free(cfg_text);
    json_decref(root);
    json_decref(cfg);
    if (st != KVS_OK) { /* the messages name tokenizer.json: say which file it stands for */
        char why[512];
        snprintf(why, sizeof why, "%s", kvs_last_error());
        return kvs_fail(st, "%s (tokenizer.ggml.* as a tokenizer.json): %s", g->file_name, why);
    }
    return KVS_OK;
}

static kvs_status load_gguf(const char *path, kvs_tokenizer **out) {
    kvs_gguf *g;
    KVS_TRY(kvs_gguf_open(path, &g));
    kvs_status st = kvs_tokenizer_from_gguf(g, out);
    kvs_gguf_destroy(g);
    return st;
}

kvs_status kvs_tokenizer_load(const char *model_dir, kvs_tokenizer **out) {
    char path[4096];
    char *json = NULL, *cfg = NULL;
    size_t len = 0, cfg_len = 0;
    *out = NULL;
    if (kvs_gguf_is_path(model_dir)) return load_gguf(model_dir, out);
    KVS_TRY(kvs_path_join(path, sizeof path, model_dir, "tokenizer.json"));
    KVS_TRY(kvs_read_file(path, &json, &len));
    kvs_status st = kvs_path_join(path, sizeof path, model_dir, "tokenizer_config.json");
    if (st == KVS_OK && kvs_file_exists(path)) st = kvs_read_file(path, &cfg, &cfg_len);
    if (st == KVS_OK) st = kvs_tokenizer_parse(json, len, cfg, cfg_len, out);
    free(json);
    free(cfg);
    if (st != KVS_OK) return st;
    /* special_tokens_map.json fills in bos/eos when tokenizer_config.json lacks them */
    kvs_tokenizer *t = *out;
    if ((!t->bos_token || !t->eos_token) &&
        kvs_path_join(path, sizeof path, model_dir, "special_tokens_map.json") == KVS_OK && kvs_file_exists(path)) {
        json_error_t err;
        json_t *m = json_load_file(path, JSON_DECODE_INT_AS_REAL, &err);
        const char *bos = token_string(json_object_get(m, "bos_token"));
        const char *eos = token_string(json_object_get(m, "eos_token"));
        if (!t->bos_token && bos) t->bos_token = dup_str(bos);
        if (!t->eos_token && eos) t->eos_token = dup_str(eos);
        json_decref(m);
        resolve_bos_eos(t);
    }
    return KVS_OK;
}

/* ---- encoding ------------------------------------------------------------------------------ */
typedef struct {
    const kvs_tokenizer *t;
    kvs_encode_options opt;
    pcre2_match_data *md;
    int32_t *ids;
    int n, cap;
    tk_buf norm;
    tk_pre_run run;
} enc_ctx;

static kvs_status push_ids(enc_ctx *c, const int32_t *ids, int n) {
    for (int i = 0; i < n; i++) {
        if (c->n == c->cap) {
            int cap = c->cap ? c->cap * 2 : 64;
            int32_t *v = realloc(c->ids, (size_t)cap * sizeof *v);
            if (!v) return kvs_fail(KVS_ERR_NOMEM, "tokenizer: out of memory encoding");
            c->ids = v;
            c->cap = cap;
        }
        c->ids[c->n++] = ids[i];
    }
    return KVS_OK;
}

static kvs_status bpe_sink(void *ctx, const char *s, size_t n) {
    enc_ctx *c = ctx;
    return tk_bpe_encode_word(&c->t->bpe, s, n, &c->ids, &c->n, &c->cap);
}

/* text after normalization and added-token splitting: pre-tokenize, then BPE */
static kvs_status emit_normalized(void *ctx, const char *s, size_t len, int32_t id, bool first) {
    enc_ctx *c = ctx;
    if (id >= 0) return push_ids(c, &id, 1);
    if (len == 0) return KVS_OK;
    if (c->t->pre_chain.n_stages > 0) return tk_pretokenize(&c->t->pre_chain, &c->run, s, len, first);
    return bpe_sink(c, s, len);
}

/* raw text between (unnormalized) added tokens: normalize, then split on normalized ones */
static kvs_status emit_raw(void *ctx, const char *s, size_t len, int32_t id, bool first) {
    enc_ctx *c = ctx;
    if (id >= 0) return push_ids(c, &id, 1);
    if (len == 0) return KVS_OK;
    if (c->t->normalizer) {
        KVS_TRY(tk_normalize(c->t->normalizer, c->md, s, len, &c->norm));
        s = c->norm.data;
        len = c->norm.len;
    }
    if (c->t->added.n_normalized > 0)
        return tk_added_split(&c->t->added, true, c->opt.parse_special, s, len, first, emit_normalized, c);
    return emit_normalized(c, s, len, -1, first);
}

kvs_status kvs_tokenizer_encode(const kvs_tokenizer *t, const char *text, size_t len,
                                kvs_encode_options opt, int32_t **ids, int *n_ids) {
    *ids = NULL;
    *n_ids = 0;
    if (!t || (!text && len)) return kvs_fail(KVS_ERR_INVALID, "tokenizer encode: NULL argument");
    if (!text) text = "";
    size_t bad = tk_utf8_validate(text, len);
    if (bad < len)
        return kvs_fail(KVS_ERR_INVALID, "tokenizer encode: text is not valid UTF-8 (byte 0x%02X at offset %zu)",
                        (uint8_t)text[bad], bad);
    enc_ctx c = {.t = t, .opt = opt};
    c.md = c.run.md = pcre2_match_data_create(8, NULL);
    c.run.sink = bpe_sink;
    c.run.sink_ctx = &c;
    if (!c.md) return kvs_fail(KVS_ERR_NOMEM, "tokenizer: out of memory encoding");
    kvs_status st = KVS_OK;
    if (opt.add_special_tokens) st = push_ids(&c, t->post.prefix, t->post.n_prefix);
    if (st == KVS_OK) st = tk_added_split(&t->added, false, opt.parse_special, text, len, true, emit_raw, &c);
    if (st == KVS_OK && opt.add_special_tokens) st = push_ids(&c, t->post.suffix, t->post.n_suffix);
    if (st == KVS_OK && !c.ids) c.ids = malloc(sizeof *c.ids); /* empty result: still a valid pointer */
    if (st == KVS_OK && !c.ids) st = kvs_fail(KVS_ERR_NOMEM, "tokenizer: out of memory encoding");
    pcre2_match_data_free(c.md);
    tk_buf_free(&c.norm);
    for (int i = 0; i < TK_MAX_STAGES; i++) tk_buf_free(&c.run.scratch[i][0]), tk_buf_free(&c.run.scratch[i][1]);
    if (st != KVS_OK) {
        free(c.ids);
        return st;
    }
    *ids = c.ids;
    *n_ids = c.n;
    return KVS_OK;
}

/* ---- decoding ------------------------------------------------------------------------------ */
const char *tk_token_text(const kvs_tokenizer *t, int id, size_t *len) {
    if (id < 0 || id >= t->vocab_size || !t->text[id]) return NULL;
    if (len) *len = t->text_len[id];
    return t->text[id];
}

bool tk_token_visible(const kvs_tokenizer *t, int id, bool skip_special) {
    return tk_token_text(t, id, NULL) && !(skip_special && t->special[id]);
}

kvs_status kvs_tokenizer_decode(const kvs_tokenizer *t, const int32_t *ids, int n_ids,
                                bool skip_special, char **text, size_t *len) {
    *text = NULL;
    if (len) *len = 0;
    if (!t || (!ids && n_ids > 0)) return kvs_fail(KVS_ERR_INVALID, "tokenizer decode: NULL argument");
    tk_strs toks = {0};
    kvs_status st = KVS_OK;
    for (int i = 0; i < n_ids && st == KVS_OK; i++) {
        size_t n;
        const char *s = tk_token_text(t, ids[i], &n);
        if (!tk_token_visible(t, ids[i], skip_special)) continue; /* unknown ids, skipped specials */
        if (!tk_strs_push(&toks, s, n)) st = kvs_fail(KVS_ERR_NOMEM, "tokenizer: out of memory decoding");
    }
    if (st == KVS_OK && t->decoder) st = tk_decode_chain(t->decoder, &toks);
    tk_buf out = {0};
    if (st == KVS_OK && !tk_buf_append(&out, "", 0)) st = kvs_fail(KVS_ERR_NOMEM, "tokenizer: out of memory decoding");
    for (int i = 0; i < toks.n && st == KVS_OK; i++) {
        bool ok = (t->decoder || i == 0 || tk_buf_append(&out, " ", 1)) && tk_buf_append(&out, toks.s[i], toks.len[i]);
        if (!ok) st = kvs_fail(KVS_ERR_NOMEM, "tokenizer: out of memory decoding");
    }
    tk_strs_free(&toks);
    if (st != KVS_OK) {
        tk_buf_free(&out);
        return st;
    }
    *text = out.data;
    if (len) *len = out.len;
    return KVS_OK;
}

/* ---- accessors ------------------------------------------------------------------------------ */
int kvs_tokenizer_vocab_size(const kvs_tokenizer *t) { return t ? t->vocab_size : 0; }

int kvs_tokenizer_token_id(const kvs_tokenizer *t, const char *token) {
    if (!t || !token) return -1;
    size_t n = strlen(token);
    for (int i = 0; i < t->added.n; i++)
        if (t->added.tokens[i].len == n && !memcmp(t->added.tokens[i].content, token, n)) return t->added.tokens[i].id;
    return tk_strmap_get(&t->bpe.vocab, token, n);
}

const char *kvs_tokenizer_token_text(const kvs_tokenizer *t, int id) { return t ? tk_token_text(t, id, NULL) : NULL; }
bool kvs_tokenizer_is_special(const kvs_tokenizer *t, int id) {
    return t && id >= 0 && id < t->vocab_size && t->special[id];
}
int kvs_tokenizer_bos_id(const kvs_tokenizer *t) { return t ? t->bos_id : -1; }
int kvs_tokenizer_eos_id(const kvs_tokenizer *t) { return t ? t->eos_id : -1; }
const char *kvs_tokenizer_chat_template(const kvs_tokenizer *t) { return t ? t->chat_template : NULL; }
const char *kvs_tokenizer_bos_token(const kvs_tokenizer *t) { return t ? t->bos_token : NULL; }
const char *kvs_tokenizer_eos_token(const kvs_tokenizer *t) { return t ? t->eos_token : NULL; }
