/* A GGUF file's tokenizer (tokenizer.ggml.*) as the tokenizer.json and
 * tokenizer_config.json it stands for, built by the same code as theirs.
 *
 * Supported: tokenizer.ggml.model "gpt2" (byte-level BPE: tokens, merges,
 * token_type) with tokenizer.ggml.pre llama-bpe (Llama 3's split), qwen2 or
 * gpt2; and "llama" (SentencePiece pieces with scores: Llama 2, Mistral),
 * whose merges are derived from the scores as Hugging Face's converter
 * derives them (gguf_spm.c), with byte fallback and the "▁" space.
 * Control tokens (token type 3) become special added tokens and
 * user-defined ones (4) plain added tokens, as Hugging Face's files hold them;
 * BOS / EOS are added where add_bos_token / add_eos_token say (absent:
 * llama.cpp's defaults); tokenizer.chat_template is the chat template. */
#include "gguf/gguf.h"
#include "tokenizer/tokenizer_internal.h"

#include <stdlib.h>
#include <string.h>

enum { TOKEN_NORMAL = 1, TOKEN_UNKNOWN = 2, TOKEN_CONTROL = 3, TOKEN_USER_DEFINED = 4 };

/* The pre-tokenizer regexes of the tokenizer.json files these stand for. */
static const char llama3_split[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char qwen2_split[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

const char *kvs_gguf_pre_split(const char *pre) {
    return !strcmp(pre, "llama-bpe") ? llama3_split : !strcmp(pre, "qwen2") ? qwen2_split : NULL;
}

static bool str_is(kvs_gguf_str s, const char *lit) { return s.len == strlen(lit) && !memcmp(s.s, lit, s.len); }

static kvs_status nomem(void) { return kvs_fail(KVS_ERR_NOMEM, "tokenizer: out of memory building a GGUF vocabulary"); }

/* What tells the vocabularies' tokenizer.json files apart. */
typedef struct {
    bool spm;           /* "llama": SentencePiece pieces */
    const char *split;  /* gpt2: the pre-tokenizer's regex (NULL: GPT-2's own) */
    bool ignore_merges; /* gpt2: a word in the vocabulary is one token */
    bool nfc;           /* normalized to NFC first */
    bool space_prefix;  /* spm: a "▁" before the text (add_space_prefix) */
    bool add_bos;       /* llama.cpp's default, before add_bos_token */
} flavour;

/* tokenizer.ggml.model and .pre: llama.cpp's choices for each (BOS by default
 * for llama-bpe and SentencePiece), and the tokenizer.json's normalizer. */
static kvs_status read_flavour(const kvs_gguf *g, kvs_gguf_str model, flavour *f) {
    memset(f, 0, sizeof *f);
    if (str_is(model, "llama")) {
        f->spm = f->add_bos = f->space_prefix = true;
        return kvs_gguf_get_bool(g, "tokenizer.ggml.add_space_prefix", &f->space_prefix);
    }
    if (!str_is(model, "gpt2"))
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: tokenizer.ggml.model '%.*s' is unsupported (supported: gpt2, "
                        "byte-level BPE; llama, SentencePiece)", g->file_name, (int)(model.len > 64 ? 64 : model.len),
                        model.s);
    kvs_gguf_str pre = {"", 0};
    KVS_TRY(kvs_gguf_get_str(g, "tokenizer.ggml.pre", false, &pre));
    if (str_is(pre, "llama-bpe") || str_is(pre, "llama3") || str_is(pre, "llama-v3")) {
        f->split = llama3_split;
        f->ignore_merges = f->add_bos = true;
    } else if (str_is(pre, "qwen2")) {
        f->split = qwen2_split;
        f->nfc = true; /* Qwen's tokenizer.json normalizes to NFC (llama.cpp does not) */
    } else if (!str_is(pre, "gpt2")) {
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: tokenizer.ggml.pre '%.*s' is unsupported (supported: llama-bpe, "
                        "qwen2, gpt2)", g->file_name, (int)(pre.len > 64 ? 64 : pre.len), pre.s);
    }
    return KVS_OK;
}

/* gpt2: a Split on the regex (Isolated), then ByteLevel without its own
 * regex, or ByteLevel's GPT-2 regex alone; spm: none. */
static json_t *pre_tokenizer(const flavour *f) {
    if (f->spm) return json_null();
    if (!f->split) return json_pack("{s:s, s:b, s:b, s:b}", "type", "ByteLevel", "add_prefix_space", 0, "trim_offsets", 1,
                                    "use_regex", 1);
    return json_pack("{s:s, s:[{s:s, s:{s:s}, s:s, s:b}, {s:s, s:b, s:b, s:b}]}", "type", "Sequence", "pretokenizers",
                     "type", "Split", "pattern", "Regex", f->split, "behavior", "Isolated", "invert", 0, "type",
                     "ByteLevel", "add_prefix_space", 0, "trim_offsets", 1, "use_regex", 0);
}

#define SPM_SPACE "\xe2\x96\x81" /* "▁", SentencePiece's space */

static json_t *normalizer(const flavour *f) {
    if (f->nfc) return json_pack("{s:s}", "type", "NFC");
    if (!f->spm) return json_null();
    json_t *replace = json_pack("{s:s, s:{s:s}, s:s}", "type", "Replace", "pattern", "String", " ", "content", SPM_SPACE);
    if (!f->space_prefix) return replace;
    return json_pack("{s:s, s:[{s:s, s:s}, o]}", "type", "Sequence", "normalizers", "type", "Prepend", "prepend",
                     SPM_SPACE, replace);
}

static json_t *decoder(const flavour *f) {
    if (!f->spm)
        return json_pack("{s:s, s:b, s:b, s:b}", "type", "ByteLevel", "add_prefix_space", 1, "trim_offsets", 1,
                         "use_regex", 1);
    json_t *d = json_pack("[{s:s, s:{s:s}, s:s}, {s:s}, {s:s}]", "type", "Replace", "pattern", "String", SPM_SPACE,
                          "content", " ", "type", "ByteFallback", "type", "Fuse");
    if (d && f->space_prefix) /* the prefix's space comes off again */
        json_array_append_new(d, json_pack("{s:s, s:s, s:i, s:i}", "type", "Strip", "content", " ", "start", 1, "stop", 0));
    return json_pack("{s:s, s:o}", "type", "Sequence", "decoders", d);
}

static json_t *jstr(kvs_gguf_str s) { return json_stringn_nocheck(s.s, s.len); }

/* model.vocab (every token for SentencePiece, as its files hold them; the
 * added ones left out for gpt2; a string twice keeps its first id),
 * model.merges (the file's, or derived from the scores) and added_tokens. */
static kvs_status vocab(const kvs_gguf *g, const kvs_gguf_kv *tokens, const kvs_gguf_kv *types, const flavour *f,
                        json_t *model, json_t *added) {
    json_t *v = json_object(), *merges = json_array();
    if (json_object_set_new(model, "vocab", v) || json_object_set_new(model, "merges", merges)) return nomem();
    for (uint64_t i = 0; i < tokens->count; i++) {
        kvs_gguf_str s = tokens->strs[i];
        if (memchr(s.s, 0, s.len) || tk_utf8_validate(s.s, s.len) < s.len) /* JSON's strings cannot hold them */
            return kvs_fail(KVS_ERR_FORMAT, "%s: tokenizer.ggml.tokens[%llu] holds a NUL byte or is not UTF-8",
                            g->file_name, (unsigned long long)i);
        int64_t type = types ? kvs_gguf_array_int(types, i) : TOKEN_NORMAL;
        if (type == TOKEN_CONTROL || type == TOKEN_USER_DEFINED) {
            json_t *a = json_pack("{s:I, s:o, s:b, s:b, s:b, s:b, s:b}", "id", (json_int_t)i, "content", jstr(s),
                                  "special", type == TOKEN_CONTROL, "normalized", 0, "lstrip", 0, "rstrip", 0,
                                  "single_word", 0);
            if (!a || json_array_append_new(added, a)) return nomem();
            if (!f->spm) continue;
        }
        char *key = strndup(s.s, s.len);
        if (!key) return nomem();
        int fail = json_object_get(v, key) ? 0 : json_object_set_new(v, key, json_integer((json_int_t)i));
        free(key);
        if (fail) return nomem();
    }
    if (f->spm) return tk_gguf_spm_merges(g, tokens, v, merges);
    const kvs_gguf_kv *m;
    KVS_TRY(kvs_gguf_get_array(g, "tokenizer.ggml.merges", KVS_GGUF_STRING, true, &m));
    for (uint64_t i = 0; i < m->count; i++) {
        kvs_gguf_str s = m->strs[i];
        if (memchr(s.s, 0, s.len) || tk_utf8_validate(s.s, s.len) < s.len)
            return kvs_fail(KVS_ERR_FORMAT, "%s: tokenizer.ggml.merges[%llu] holds a NUL byte or is not UTF-8",
                            g->file_name, (unsigned long long)i);
        if (json_array_append_new(merges, jstr(s))) return nomem();
    }
    return KVS_OK;
}

/* A special token of the post-processor: its place in single, its ids in specials. */
static kvs_status add_special(const kvs_gguf_kv *tokens, int64_t id, json_t *single, json_t *specials) {
    char *name = strndup(tokens->strs[id].s, tokens->strs[id].len);
    int fail = !name ||
               json_array_append_new(single, json_pack("{s:{s:s, s:i}}", "SpecialToken", "id", name, "type_id", 0)) ||
               json_object_set_new(specials, name, json_pack("{s:s, s:[I]}", "id", name, "ids", (json_int_t)id));
    free(name);
    return fail ? nomem() : KVS_OK;
}

/* TemplateProcessing with BOS before and / or EOS after the text. */
static kvs_status post_processor(const kvs_gguf_kv *tokens, int64_t bos, int64_t eos, bool add_bos, bool add_eos,
                                 json_t *root) {
    add_bos = add_bos && bos >= 0;
    add_eos = add_eos && eos >= 0;
    if (!add_bos && !add_eos) return KVS_OK;
    json_t *single = json_array(), *specials = json_object();
    json_t *post = json_pack("{s:s, s:o, s:o}", "type", "TemplateProcessing", "single", single, "special_tokens", specials);
    if (!post || json_object_set_new(root, "post_processor", post)) return nomem();
    if (add_bos) KVS_TRY(add_special(tokens, bos, single, specials));
    if (json_array_append_new(single, json_pack("{s:{s:s, s:i}}", "Sequence", "id", "A", "type_id", 0))) return nomem();
    if (add_eos) KVS_TRY(add_special(tokens, eos, single, specials));
    return KVS_OK;
}

/* tokenizer_config.json: the chat template and the bos / eos strings. */
static kvs_status config(const kvs_gguf *g, const kvs_gguf_kv *tokens, int64_t bos, int64_t eos, json_t *cfg) {
    kvs_gguf_str tpl = {NULL, 0};
    KVS_TRY(kvs_gguf_get_str(g, "tokenizer.chat_template", false, &tpl));
    if (tpl.s && (memchr(tpl.s, 0, tpl.len) || tk_utf8_validate(tpl.s, tpl.len) < tpl.len))
        return kvs_fail(KVS_ERR_FORMAT, "%s: tokenizer.chat_template holds a NUL byte or is not UTF-8", g->file_name);
    if (tpl.s && json_object_set_new(cfg, "chat_template", jstr(tpl))) return nomem();
    if (bos >= 0 && json_object_set_new(cfg, "bos_token", jstr(tokens->strs[bos]))) return nomem();
    if (eos >= 0 && json_object_set_new(cfg, "eos_token", jstr(tokens->strs[eos]))) return nomem();
    return KVS_OK;
}

static kvs_status special_id(const kvs_gguf *g, const kvs_gguf_kv *tokens, const char *key, int64_t *id) {
    *id = -1;
    KVS_TRY(kvs_gguf_get_int(g, key, false, id));
    if (*id < -1 || *id >= (int64_t)tokens->count)
        return kvs_fail(KVS_ERR_FORMAT, "%s: %s %lld is outside the %llu tokens", g->file_name, key, (long long)*id,
                        (unsigned long long)tokens->count);
    return KVS_OK;
}

/* SentencePiece: the unknown piece (tokenizer.ggml.unknown_token_id, else
 * the first of token type 2), byte fallback, unknowns fused. */
static kvs_status spm_model(const kvs_gguf *g, const kvs_gguf_kv *tokens, const kvs_gguf_kv *types, json_t *m) {
    int64_t unk = -1;
    KVS_TRY(kvs_gguf_get_int(g, "tokenizer.ggml.unknown_token_id", false, &unk));
    for (uint64_t i = 0; unk < 0 && types && i < types->count; i++)
        if (kvs_gguf_array_int(types, i) == TOKEN_UNKNOWN) unk = (int64_t)i;
    if (unk >= (int64_t)tokens->count)
        return kvs_fail(KVS_ERR_FORMAT, "%s: tokenizer.ggml.unknown_token_id %lld is outside the %llu tokens",
                        g->file_name, (long long)unk, (unsigned long long)tokens->count);
    if (json_object_set_new(m, "byte_fallback", json_true()) || json_object_set_new(m, "fuse_unk", json_true()) ||
        (unk >= 0 && json_object_set_new(m, "unk_token", jstr(tokens->strs[unk]))))
        return nomem();
    return KVS_OK;
}

kvs_status tk_gguf_json(const kvs_gguf *g, json_t **tokenizer_json, json_t **config_json) {
    *tokenizer_json = *config_json = NULL;
    kvs_gguf_str model;
    flavour f;
    KVS_TRY(kvs_gguf_get_str(g, "tokenizer.ggml.model", true, &model));
    KVS_TRY(read_flavour(g, model, &f));
    const kvs_gguf_kv *tokens, *types;
    KVS_TRY(kvs_gguf_get_array(g, "tokenizer.ggml.tokens", KVS_GGUF_STRING, true, &tokens));
    KVS_TRY(kvs_gguf_get_array(g, "tokenizer.ggml.token_type", KVS_GGUF_I32, false, &types));
    if (types && types->count != tokens->count)
        return kvs_fail(KVS_ERR_FORMAT, "%s: tokenizer.ggml.token_type has %llu entries for %llu tokens", g->file_name,
                        (unsigned long long)types->count, (unsigned long long)tokens->count);
    bool add_bos = f.add_bos, add_eos = false;
    int64_t bos, eos;
    KVS_TRY(kvs_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &add_bos));
    KVS_TRY(kvs_gguf_get_bool(g, "tokenizer.ggml.add_eos_token", &add_eos));
    KVS_TRY(special_id(g, tokens, "tokenizer.ggml.bos_token_id", &bos));
    KVS_TRY(special_id(g, tokens, "tokenizer.ggml.eos_token_id", &eos));

    json_t *root = json_object(), *cfg = json_object(), *added = json_array();
    json_t *m = json_pack("{s:s, s:b}", "type", "BPE", "ignore_merges", f.ignore_merges);
    kvs_status s = KVS_OK;
    if (!root || !cfg || !added || !m || json_object_set_new(root, "model", m) ||
        json_object_set_new(root, "added_tokens", added) || json_object_set_new(root, "normalizer", normalizer(&f)) ||
        json_object_set_new(root, "pre_tokenizer", pre_tokenizer(&f)) ||
        json_object_set_new(root, "decoder", decoder(&f)))
        s = nomem();
    if (s == KVS_OK && f.spm) s = spm_model(g, tokens, types, m);
    if (s == KVS_OK) s = vocab(g, tokens, types, &f, m, added);
    if (s == KVS_OK) s = post_processor(tokens, bos, eos, add_bos, add_eos, root);
    if (s == KVS_OK) s = config(g, tokens, bos, eos, cfg);
    if (s != KVS_OK) {
        json_decref(root);
        json_decref(cfg);
        return s;
    }
    *tokenizer_json = root;
    *config_json = cfg;
    return KVS_OK;
}
