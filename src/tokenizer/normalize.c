#define _GNU_SOURCE /* memmem */
/* tokenizer normalizers: Sequence, Prepend, Replace, NFC/NFD/NFKC/NFKD (utf8proc),
 * Lowercase, Strip. Each maps a whole string to a new string. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "tokenizer/tokenizer_internal.h"

void tk_normalizer_free(tk_normalizer *n) {
    if (!n) return;
    for (int i = 0; i < n->n_children; i++) tk_normalizer_free(n->children[i]);
    free(n->children);
    free(n->a);
    free(n->b);
    if (n->re) pcre2_code_free(n->re);
    free(n);
}


/* Replace patterns: {"String": "..."} or {"Regex": "..."}. Shared with pretokenize.c
 * through the same shape, so kept here as a small local helper. */
static kvs_status parse_pattern(json_t *j, const char *where, char **lit, size_t *lit_len,
                                pcre2_code **re) {
    json_t *p = json_object_get(j, "pattern");
    if (!json_is_object(p))
        return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s.pattern must be an object", where);
    json_t *s = json_object_get(p, "String"), *r = json_object_get(p, "Regex");
    if (json_is_string(s)) {
        *lit_len = json_string_length(s);
        *lit = tk_strndup(json_string_value(s), *lit_len);
        if (!*lit) return kvs_fail(KVS_ERR_NOMEM, "tokenizer.json: %s: out of memory", where);
        return KVS_OK;
    }
    if (json_is_string(r)) {
        char w[256];
        snprintf(w, sizeof w, "%s.pattern.Regex", where);
        return tk_regex_compile(json_string_value(r), json_string_length(r), false, w, re);
    }
    return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s.pattern needs a String or Regex string", where);
}

kvs_status tk_normalizer_parse(json_t *j, const char *where, tk_normalizer **out) {
    *out = NULL;
    if (!json_is_object(j)) return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s must be an object", where);
    const char *type;
    KVS_TRY(tk_json_string(j, "type", where, true, &type, NULL));
    tk_normalizer *n = calloc(1, sizeof *n);
    if (!n) return kvs_fail(KVS_ERR_NOMEM, "tokenizer.json: %s: out of memory", where);
    kvs_status st = KVS_OK;
    char w[256];
    if (!strcmp(type, "Sequence")) {
        n->type = TK_NORM_SEQUENCE;
        json_t *arr = json_object_get(j, "normalizers");
        if (!json_is_array(arr)) {
            st = kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s.normalizers must be an array", where);
        } else if (!(n->children = calloc(json_array_size(arr) + 1, sizeof *n->children))) {
            st = kvs_fail(KVS_ERR_NOMEM, "tokenizer.json: %s: out of memory", where);
        } else {
            for (size_t i = 0; st == KVS_OK && i < json_array_size(arr); i++) {
                snprintf(w, sizeof w, "%s.normalizers[%zu]", where, i);
                st = tk_normalizer_parse(json_array_get(arr, i), w, &n->children[i]);
                if (st == KVS_OK) n->n_children++;
            }
        }
    } else if (!strcmp(type, "Prepend")) {
        n->type = TK_NORM_PREPEND;
        const char *s;
        st = tk_json_string(j, "prepend", where, true, &s, &n->a_len);
        if (st == KVS_OK) n->a = tk_strndup(s, n->a_len);
    } else if (!strcmp(type, "Replace")) {
        n->type = TK_NORM_REPLACE;
        const char *s;
        st = parse_pattern(j, where, &n->a, &n->a_len, &n->re);
        if (st == KVS_OK) st = tk_json_string(j, "content", where, true, &s, &n->b_len);
        if (st == KVS_OK) n->b = tk_strndup(s, n->b_len);
        if (st == KVS_OK && !n->re && n->a_len == 0)
            st = kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s.pattern.String is empty", where);
    } else if (!strcmp(type, "NFC")) {
        n->type = TK_NORM_NFC;
    } else if (!strcmp(type, "NFD")) {
        n->type = TK_NORM_NFD;
    } else if (!strcmp(type, "NFKC")) {
        n->type = TK_NORM_NFKC;
    } else if (!strcmp(type, "NFKD")) {
        n->type = TK_NORM_NFKD;
    } else if (!strcmp(type, "Lowercase")) {
        n->type = TK_NORM_LOWERCASE;
    } else if (!strcmp(type, "Strip")) {
        n->type = TK_NORM_STRIP;
        bool has_new = json_object_get(j, "strip_left") || json_object_get(j, "strip_right");
        st = tk_json_bool(j, has_new ? "strip_left" : "left", where, true, &n->left);
        if (st == KVS_OK) st = tk_json_bool(j, has_new ? "strip_right" : "right", where, true, &n->right);
    } else {
        st = kvs_fail(KVS_ERR_UNSUPPORTED, "tokenizer.json: %s.type '%s' is not a supported normalizer",
                      where, type);
    }
    if (st == KVS_OK && (n->type == TK_NORM_PREPEND || n->type == TK_NORM_REPLACE) &&
        (!n->a && !n->re))
        st = kvs_fail(KVS_ERR_NOMEM, "tokenizer.json: %s: out of memory", where);
    if (st != KVS_OK) {
        tk_normalizer_free(n);
        return st;
    }
    *out = n;
    return KVS_OK;
}

static kvs_status oom(void) { return kvs_fail(KVS_ERR_NOMEM, "tokenizer: out of memory normalizing"); }

static kvs_status map_run(int opt, const char *s, size_t len, tk_buf *out) {
    utf8proc_uint8_t *dst = NULL;
    utf8proc_ssize_t n = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)len, &dst,
                                      (utf8proc_option_t)opt);
    if (n < 0) {
        free(dst);
        return kvs_fail(KVS_ERR_INVALID, "tokenizer: normalization failed: %s", utf8proc_errmsg(n));
    }
    bool ok = tk_buf_append(out, dst, (size_t)n);
    free(dst);
    return ok ? KVS_OK : oom();
}

/* ASCII is left alone by every normalization form and never composes with what comes
 * before it, so only the non-ASCII runs (with the ASCII starter just before each, which
 * a combining mark may compose with) go through utf8proc. */
static kvs_status unicode_form(tk_norm_type type, const char *s, size_t len, tk_buf *out) {
    int opt = UTF8PROC_STABLE;
    switch (type) {
    case TK_NORM_NFC: opt |= UTF8PROC_COMPOSE; break;
    case TK_NORM_NFD: opt |= UTF8PROC_DECOMPOSE; break;
    case TK_NORM_NFKC: opt |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT; break;
    case TK_NORM_NFKD: opt |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT; break;
    default: break;
    }
    out->len = 0;
    if (!tk_buf_reserve(out, len)) return oom();
    size_t i = 0;
    while (i < len) {
        size_t a = i;
        while (i < len && (uint8_t)s[i] < 0x80) i++;
        if (i == len) return tk_buf_append(out, s + a, i - a) ? KVS_OK : oom();
        size_t start = i > a ? i - 1 : i; /* the ASCII starter before the run */
        while (i < len && (uint8_t)s[i] >= 0x80) i++;
        if (!tk_buf_append(out, s + a, start - a)) return oom();
        KVS_TRY(map_run(opt, s + start, i - start, out));
    }
    return tk_buf_append(out, "", 0) ? KVS_OK : oom();
}

static kvs_status lowercase(const char *s, size_t len, tk_buf *out) {
    out->len = 0;
    if (!tk_buf_reserve(out, len)) return oom();
    for (size_t i = 0; i < len;) {
        uint32_t cp;
        i += (size_t)tk_utf8_decode(s + i, &cp);
        char enc[4];
        int k = tk_utf8_encode((uint32_t)utf8proc_tolower((utf8proc_int32_t)cp), enc);
        if (!tk_buf_append(out, enc, (size_t)k)) return oom();
    }
    return tk_buf_append(out, "", 0) ? KVS_OK : oom();
}

static kvs_status strip(const tk_normalizer *n, const char *s, size_t len, tk_buf *out) {
    size_t a = 0, b = len;
    while (n->left && a < b) {
        uint32_t cp;
        int k = tk_utf8_decode(s + a, &cp);
        if (!tk_is_whitespace(cp)) break;
        a += (size_t)k;
    }
    while (n->right && b > a) {
        size_t c = b - 1;
        while (c > a && ((uint8_t)s[c] & 0xC0) == 0x80) c--;
        uint32_t cp;
        tk_utf8_decode(s + c, &cp);
        if (!tk_is_whitespace(cp)) break;
        b = c;
    }
    out->len = 0;
    return tk_buf_append(out, s + a, b - a) ? KVS_OK : oom();
}

/* Normalizers may grow the text (Replace " " -> "\u2581" triples it, NFKC makes
 * 18 characters of U+FDFA), but a chain
 * of Replaces that match everywhere would multiply it without end: past this, an error. */
static bool too_long(size_t out_len, size_t in_len) { return out_len > in_len * 64 + 4096; }

static kvs_status too_long_error(void) {
    return kvs_fail(KVS_ERR_INVALID, "tokenizer: the normalizer makes the text more than 64 times longer "
                                     "(a Replace pattern that matches everywhere?)");
}

static kvs_status replace(const tk_normalizer *n, pcre2_match_data *md, const char *s, size_t len,
                          tk_buf *out) {
    out->len = 0;
    size_t pos = 0;
    while (pos <= len) {
        size_t ms, me;
        bool found;
        if (n->re) {
            int rc = tk_regex_next(n->re, md, s, len, pos, &ms, &me);
            if (rc < 0) return KVS_ERR_UNSUPPORTED; /* message already set */
            found = rc > 0;
            if (found && me == ms) { /* empty match: insert the content, step one character */
                if (!tk_buf_append(out, s + pos, ms - pos) || !tk_buf_append(out, n->b, n->b_len)) return oom();
                pos = ms;
                if (ms >= len) break;
                uint32_t cp;
                me = ms + (size_t)tk_utf8_decode(s + ms, &cp);
                if (!tk_buf_append(out, s + pos, me - pos)) return oom();
                pos = me;
                if (too_long(out->len, len)) return too_long_error();
                continue;
            }
        } else {
            const char *hit = pos < len ? memmem(s + pos, len - pos, n->a, n->a_len) : NULL;
            found = hit != NULL;
            if (found) ms = (size_t)(hit - s), me = ms + n->a_len;
        }
        if (!found) break;
        if (!tk_buf_append(out, s + pos, ms - pos) || !tk_buf_append(out, n->b, n->b_len)) return oom();
        pos = me;
        if (too_long(out->len, len)) return too_long_error();
    }
    if (pos < len && !tk_buf_append(out, s + pos, len - pos)) return oom();
    return tk_buf_append(out, "", 0) ? KVS_OK : oom();
}

kvs_status tk_normalize(const tk_normalizer *n, pcre2_match_data *md, const char *s, size_t len,
                        tk_buf *out) {
    switch (n->type) {
    case TK_NORM_SEQUENCE: {
        tk_buf cur = {0}, next = {0};
        if (!tk_buf_append(&cur, s, len)) return oom();
        for (int i = 0; i < n->n_children; i++) {
            kvs_status st = tk_normalize(n->children[i], md, cur.data, cur.len, &next);
            if (st == KVS_OK && too_long(next.len, len)) st = too_long_error();
            if (st != KVS_OK) {
                tk_buf_free(&cur);
                tk_buf_free(&next);
                return st;
            }
            tk_buf t = cur;
            cur = next;
            next = t;
        }
        out->len = 0;
        bool ok = tk_buf_append(out, cur.data, cur.len);
        tk_buf_free(&cur);
        tk_buf_free(&next);
        return ok ? KVS_OK : oom();
    }
    case TK_NORM_PREPEND:
        out->len = 0;
        if (len > 0 && !tk_buf_append(out, n->a, n->a_len)) return oom();
        return tk_buf_append(out, s, len) ? KVS_OK : oom();
    case TK_NORM_REPLACE: return replace(n, md, s, len, out);
    case TK_NORM_LOWERCASE: return lowercase(s, len, out);
    case TK_NORM_STRIP: return strip(n, s, len, out);
    default: return unicode_form(n->type, s, len, out);
    }
}
