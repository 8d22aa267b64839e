/* tokenizer decoders: ByteLevel, Metaspace, ByteFallback, Fuse, Strip, Replace,
 * Sequence. Each maps a list of token strings to a new list, as `tokenizers`'
 * decode_chain does; the caller concatenates the result. */
#define _GNU_SOURCE /* memmem */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tokenizer_internal.h"

bool tk_strs_push(tk_strs *l, const char *s, size_t len) {
    if (l->n == l->cap) {
        int cap = l->cap ? l->cap * 2 : 16;
        char **ns = realloc(l->s, (size_t)cap * sizeof *ns);
        if (!ns) return false;
        l->s = ns;
        size_t *nl = realloc(l->len, (size_t)cap * sizeof *nl);
        if (!nl) return false;
        l->len = nl;
        l->cap = cap;
    }
    char *d = malloc(len + 1);
    if (!d) return false;
    if (len) memcpy(d, s, len);
    d[len] = 0;
    l->s[l->n] = d;
    l->len[l->n++] = len;
    return true;
}

void tk_strs_free(tk_strs *l) {
    for (int i = 0; i < l->n; i++) free(l->s[i]);
    free(l->s);
    free(l->len);
    memset(l, 0, sizeof *l);
}

void tk_decoder_free(tk_decoder *d) {
    if (!d) return;
    for (int i = 0; i < d->n_children; i++) tk_decoder_free(d->children[i]);
    free(d->children);
    free(d->a);
    free(d->b);
    free(d);
}


static kvs_status parse_int(json_t *j, const char *key, const char *where, int *out) {
    json_t *v = json_object_get(j, key);
    *out = 0;
    if (!v) return KVS_OK;
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > 1000000)
        return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s.%s must be a small non-negative integer", where, key);
    *out = (int)json_integer_value(v);
    return KVS_OK;
}

static kvs_status parse_fields(json_t *j, const char *type, const char *where, tk_decoder *d) {
    char w[256];
    const char *s;
    size_t n;
    if (!strcmp(type, "Sequence")) {
        d->type = TK_DEC_SEQUENCE;
        json_t *arr = json_object_get(j, "decoders");
        if (!json_is_array(arr)) return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s.decoders must be an array", where);
        d->children = calloc(json_array_size(arr) + 1, sizeof *d->children);
        if (!d->children) return kvs_fail(KVS_ERR_NOMEM, "tokenizer.json: %s: out of memory", where);
        for (size_t i = 0; i < json_array_size(arr); i++) {
            snprintf(w, sizeof w, "%s.decoders[%zu]", where, i);
            KVS_TRY(tk_decoder_parse(json_array_get(arr, i), w, &d->children[i]));
            d->n_children++;
        }
    } else if (!strcmp(type, "ByteLevel")) {
        d->type = TK_DEC_BYTELEVEL;
    } else if (!strcmp(type, "ByteFallback")) {
        d->type = TK_DEC_BYTEFALLBACK;
    } else if (!strcmp(type, "Fuse")) {
        d->type = TK_DEC_FUSE;
    } else if (!strcmp(type, "Metaspace")) {
        d->type = TK_DEC_METASPACE;
        KVS_TRY(tk_json_string(j, "replacement", where, false, &s, &n));
        if (!s) s = "\xE2\x96\x81", n = 3;
        if (n == 0 || tk_utf8_seq_len((const uint8_t *)s, n) != (int)n)
            return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s.replacement must be one character", where);
        bool add_prefix;
        const char *scheme;
        KVS_TRY(tk_json_bool(j, "add_prefix_space", where, true, &add_prefix));
        KVS_TRY(tk_json_string(j, "prepend_scheme", where, false, &scheme, NULL));
        d->prepend = add_prefix ? TK_PREPEND_ALWAYS : TK_PREPEND_NEVER;
        if (scheme) {
            if (!strcmp(scheme, "always")) d->prepend = TK_PREPEND_ALWAYS;
            else if (!strcmp(scheme, "first")) d->prepend = TK_PREPEND_FIRST;
            else if (!strcmp(scheme, "never")) d->prepend = TK_PREPEND_NEVER;
            else return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s.prepend_scheme '%s' is unknown", where, scheme);
        }
        if (!(d->a = tk_strndup(s, n))) return kvs_fail(KVS_ERR_NOMEM, "tokenizer.json: %s: out of memory", where);
        d->a_len = n;
    } else if (!strcmp(type, "Strip")) {
        d->type = TK_DEC_STRIP;
        KVS_TRY(tk_json_string(j, "content", where, true, &s, &n));
        if (n == 0 || tk_utf8_seq_len((const uint8_t *)s, n) != (int)n)
            return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s.content must be one character", where);
        tk_utf8_decode(s, &d->content);
        KVS_TRY(parse_int(j, "start", where, &d->start));
        KVS_TRY(parse_int(j, "stop", where, &d->stop));
    } else if (!strcmp(type, "Replace")) {
        d->type = TK_DEC_REPLACE;
        json_t *p = json_object_get(j, "pattern");
        json_t *ps = json_is_object(p) ? json_object_get(p, "String") : NULL;
        if (!json_is_string(ps) || json_string_length(ps) == 0)
            return kvs_fail(KVS_ERR_UNSUPPORTED, "tokenizer.json: %s.pattern must be a non-empty String pattern", where);
        KVS_TRY(tk_json_string(j, "content", where, true, &s, &n));
        d->a_len = json_string_length(ps);
        d->a = tk_strndup(json_string_value(ps), d->a_len);
        d->b = tk_strndup(s, n);
        d->b_len = n;
        if (!d->a || !d->b) return kvs_fail(KVS_ERR_NOMEM, "tokenizer.json: %s: out of memory", where);
    } else {
        return kvs_fail(KVS_ERR_UNSUPPORTED, "tokenizer.json: %s.type '%s' is not a supported decoder", where, type);
    }
    return KVS_OK;
}

kvs_status tk_decoder_parse(json_t *j, const char *where, tk_decoder **out) {
    *out = NULL;
    if (!json_is_object(j)) return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s must be an object", where);
    const char *type;
    KVS_TRY(tk_json_string(j, "type", where, true, &type, NULL));
    tk_decoder *d = calloc(1, sizeof *d);
    if (!d) return kvs_fail(KVS_ERR_NOMEM, "tokenizer.json: %s: out of memory", where);
    kvs_status st = parse_fields(j, type, where, d);
    if (st != KVS_OK) {
        tk_decoder_free(d);
        return st;
    }
    *out = d;
    return KVS_OK;
}

/* ---- decoding ---------------------------------------------------------------------------- */
static kvs_status oom(void) { return kvs_fail(KVS_ERR_NOMEM, "tokenizer: out of memory decoding"); }

/* Replaces *l by one string per token produced by fn (or one fused string). */
static void swap_free(tk_strs *l, tk_strs *next) {
    tk_strs_free(l);
    *l = *next;
}

static kvs_status dec_bytelevel(tk_strs *l) {
    tk_buf bytes = {0}, out = {0};
    for (int i = 0; i < l->n; i++) {
        size_t start = bytes.len;
        const char *s = l->s[i];
        bool all = true;
        for (size_t k = 0; k < l->len[i];) {
            uint32_t cp;
            int cl = tk_utf8_seq_len((const uint8_t *)s + k, l->len[i] - k);
            if (cl == 0) { all = false; break; }
            tk_utf8_decode(s + k, &cp);
            int b = tk_byte_map_inverse(cp);
            if (b < 0) { all = false; break; }
            char c = (char)b;
            if (!tk_buf_append(&bytes, &c, 1)) goto nomem;
            k += (size_t)cl;
        }
        if (!all) {
            bytes.len = start;
            if (!tk_buf_append(&bytes, s, l->len[i])) goto nomem;
        }
    }
    if (!tk_buf_append_lossy(&out, bytes.data ? bytes.data : "", bytes.len)) goto nomem;
    tk_strs next = {0};
    if (!tk_strs_push(&next, out.data ? out.data : "", out.len)) {
        tk_strs_free(&next);
        goto nomem;
    }
    swap_free(l, &next);
    tk_buf_free(&bytes);
    tk_buf_free(&out);
    return KVS_OK;
nomem:
    tk_buf_free(&bytes);
    tk_buf_free(&out);
    return oom();
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

static bool flush_bytes(tk_strs *next, tk_buf *pending) {
    if (pending->len == 0) return true;
    bool ok = true;
    if (tk_utf8_validate(pending->data, pending->len) == pending->len) {
        ok = tk_strs_push(next, pending->data, pending->len);
    } else {
        for (size_t i = 0; ok && i < pending->len; i++) ok = tk_strs_push(next, "\xEF\xBF\xBD", 3);
    }
    pending->len = 0;
    return ok;
}

static kvs_status dec_bytefallback(tk_strs *l) {
    tk_strs next = {0};
    tk_buf pending = {0};
    bool ok = true;
    for (int i = 0; ok && i < l->n; i++) {
        const char *s = l->s[i];
        int hi, lo;
        if (l->len[i] == 6 && !memcmp(s, "<0x", 3) && s[5] == '>' && (hi = hexval(s[3])) >= 0 &&
            (lo = hexval(s[4])) >= 0) {
            char b = (char)(hi * 16 + lo);
            ok = tk_buf_append(&pending, &b, 1);
        } else {
            ok = flush_bytes(&next, &pending) && tk_strs_push(&next, s, l->len[i]);
        }
    }
    ok = ok && flush_bytes(&next, &pending);
    tk_buf_free(&pending);
    if (!ok) {
        tk_strs_free(&next);
        return oom();
    }
    swap_free(l, &next);
    return KVS_OK;
}

static kvs_status dec_fuse(tk_strs *l) {
    tk_buf all = {0};
    bool ok = tk_buf_append(&all, "", 0);
    for (int i = 0; ok && i < l->n; i++) ok = tk_buf_append(&all, l->s[i], l->len[i]);
    tk_strs next = {0};
    ok = ok && tk_strs_push(&next, all.data, all.len);
    tk_buf_free(&all);
    if (!ok) {
        tk_strs_free(&next);
        return oom();
    }
    swap_free(l, &next);
    return KVS_OK;
}

/* Per-token rewrite by a function of (token index, token) -> out. */
static kvs_status dec_map(const tk_decoder *d, tk_strs *l) {
    tk_buf out = {0};
    for (int i = 0; i < l->n; i++) {
        const char *s = l->s[i];
        size_t n = l->len[i];
        out.len = 0;
        if (!tk_buf_append(&out, "", 0)) goto nomem;
        if (d->type == TK_DEC_METASPACE) {
            for (size_t k = 0; k < n;) {
                if (n - k >= d->a_len && !memcmp(s + k, d->a, d->a_len)) {
                    if (!(i == 0 && d->prepend != TK_PREPEND_NEVER) && !tk_buf_append(&out, " ", 1)) goto nomem;
                    k += d->a_len;
                } else {
                    if (!tk_buf_append(&out, s + k, 1)) goto nomem;
                    k++;
                }
            }
        } else if (d->type == TK_DEC_REPLACE) {
            size_t k = 0;
            const char *hit;
            while (k < n && (hit = memmem(s + k, n - k, d->a, d->a_len))) {
                size_t at = (size_t)(hit - s);
                if (!tk_buf_append(&out, s + k, at - k) || !tk_buf_append(&out, d->b, d->b_len)) goto nomem;
                k = at + d->a_len;
            }
            if (!tk_buf_append(&out, s + k, n - k)) goto nomem;
        } else { /* Strip: up to start leading / stop trailing copies of content */
            size_t a = 0, b = n;
            for (int c = 0; c < d->start && a < b; c++) {
                uint32_t cp;
                int cl = tk_utf8_seq_len((const uint8_t *)s + a, b - a);
                if (cl == 0) break;
                tk_utf8_decode(s + a, &cp);
                if (cp != d->content) break;
                a += (size_t)cl;
            }
            for (int c = 0; c < d->stop && b > a; c++) {
                size_t p = b - 1;
                while (p > a && ((uint8_t)s[p] & 0xC0) == 0x80) p--;
                uint32_t cp;
                if (tk_utf8_seq_len((const uint8_t *)s + p, b - p) != (int)(b - p)) break;
                tk_utf8_decode(s + p, &cp);
                if (cp != d->content) break;
                b = p;
            }
            if (!tk_buf_append(&out, s + a, b - a)) goto nomem;
        }
        char *ns = realloc(l->s[i], out.len + 1);
        if (!ns) goto nomem;
        memcpy(ns, out.data, out.len + 1);
        l->s[i] = ns;
        l->len[i] = out.len;
    }
    tk_buf_free(&out);
    return KVS_OK;
nomem:
    tk_buf_free(&out);
    return oom();
}

kvs_status tk_decode_chain(const tk_decoder *d, tk_strs *tokens) {
    switch (d->type) {
    case TK_DEC_SEQUENCE:
        for (int i = 0; i < d->n_children; i++) KVS_TRY(tk_decode_chain(d->children[i], tokens));
        return KVS_OK;
    case TK_DEC_BYTELEVEL: return dec_bytelevel(tokens);
    case TK_DEC_BYTEFALLBACK: return dec_bytefallback(tokens);
    case TK_DEC_FUSE: return dec_fuse(tokens);
    default: return dec_map(d, tokens);
    }
}
