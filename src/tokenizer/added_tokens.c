/* tokenizer added tokens: parsing, and splitting text on them (leftmost-longest, with
 * the single_word / lstrip / rstrip rules of `tokenizers`). Special tokens are only
 * matched when parse_special is set; non-special added tokens always are. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tokenizer_internal.h"

void tk_added_free(tk_added_set *s) {
    for (int i = 0; i < s->n; i++) free(s->tokens[i].content);
    free(s->tokens);
    for (int k = 0; k < 2; k++)
        for (int b = 0; b < 256; b++) free(s->by_byte[k][b]);
    memset(s, 0, sizeof *s);
}

static int by_len_desc(const void *x, const void *y) {
    const tk_added *a = x, *b = y;
    if (a->len != b->len) return a->len < b->len ? 1 : -1;
    return a->id < b->id ? -1 : a->id > b->id;
}

kvs_status tk_added_parse(json_t *arr, tk_added_set *out) {
    memset(out, 0, sizeof *out);
    if (!arr || json_is_null(arr)) return KVS_OK;
    if (!json_is_array(arr)) return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: added_tokens must be an array");
    size_t n = json_array_size(arr);
    out->tokens = calloc(n + 1, sizeof *out->tokens);
    if (!out->tokens) return kvs_fail(KVS_ERR_NOMEM, "tokenizer.json: out of memory for added_tokens");
    char w[64];
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(arr, i);
        snprintf(w, sizeof w, "added_tokens[%zu]", i);
        if (!json_is_object(e)) return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s must be an object", w);
        json_t *id = json_object_get(e, "id");
        if (!json_is_integer(id) || json_integer_value(id) < 0 || json_integer_value(id) >= TK_MAX_ID)
            return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s.id must be an integer in [0, %d)", w, TK_MAX_ID);
        const char *content;
        size_t len;
        tk_added *t = &out->tokens[out->n];
        KVS_TRY(tk_json_string(e, "content", w, true, &content, &len));
        if (len == 0) return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s.content is empty", w);
        KVS_TRY(tk_json_bool(e, "special", w, false, &t->special));
        KVS_TRY(tk_json_bool(e, "lstrip", w, false, &t->lstrip));
        KVS_TRY(tk_json_bool(e, "rstrip", w, false, &t->rstrip));
        KVS_TRY(tk_json_bool(e, "single_word", w, false, &t->single_word));
        KVS_TRY(tk_json_bool(e, "normalized", w, !t->special, &t->normalized));
        t->id = (int32_t)json_integer_value(id);
        t->len = len;
        if (!(t->content = malloc(len + 1))) return kvs_fail(KVS_ERR_NOMEM, "tokenizer.json: out of memory");
        memcpy(t->content, content, len + 1);
        out->n++;
    }
    qsort(out->tokens, (size_t)out->n, sizeof *out->tokens, by_len_desc);
    for (int i = 0; i < out->n; i++) {
        const tk_added *t = &out->tokens[i];
        int k = t->normalized ? 1 : 0, b = (uint8_t)t->content[0];
        out->n_normalized += k;
        int *v = realloc(out->by_byte[k][b], (size_t)(out->n_by_byte[k][b] + 1) * sizeof *v);
        if (!v) return kvs_fail(KVS_ERR_NOMEM, "tokenizer.json: out of memory for added_tokens");
        v[out->n_by_byte[k][b]++] = i;
        out->by_byte[k][b] = v;
    }
    return KVS_OK;
}

const tk_added *tk_added_by_id(const tk_added_set *s, int32_t id) {
    for (int i = 0; i < s->n; i++)
        if (s->tokens[i].id == id) return &s->tokens[i];
    return NULL;
}

static bool is_word_char(uint32_t c) {
    return (c < 128 && ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_')) ||
           (c >= 128 && !tk_is_whitespace(c));
}

/* the code point ending at s[0..end) */
static uint32_t cp_before(const char *s, size_t end) {
    size_t p = end - 1;
    while (p > 0 && ((uint8_t)s[p] & 0xC0) == 0x80) p--;
    uint32_t cp;
    tk_utf8_decode(s + p, &cp);
    return cp;
}

kvs_status tk_added_split(const tk_added_set *set, bool normalized, bool parse_special,
                          const char *s, size_t len, bool first, tk_emit_fn emit, void *ctx) {
    int k = normalized ? 1 : 0;
    size_t start_offset = 0, pos = 0;
    while (pos < len) {
        int nb = set->n_by_byte[k][(uint8_t)s[pos]];
        const tk_added *hit = NULL;
        for (int c = 0; c < nb; c++) { /* longest first */
            const tk_added *t = &set->tokens[set->by_byte[k][(uint8_t)s[pos]][c]];
            if (t->len <= len - pos && !memcmp(s + pos, t->content, t->len)) {
                hit = t;
                break;
            }
        }
        if (!hit) {
            pos++;
            continue;
        }
        size_t start = pos, stop = pos + hit->len;
        if (hit->special && !parse_special) { /* ordinary text: skip past, as tokenizers does */
            pos = stop;
            continue;
        }
        if (hit->single_word) {
            bool ok_start = start == 0 || !is_word_char(cp_before(s, start));
            uint32_t cp = 0;
            if (stop < len) tk_utf8_decode(s + stop, &cp);
            bool ok_stop = stop == len || !is_word_char(cp);
            if (!ok_start || !ok_stop) { /* not a single word: the match is consumed as text */
                pos = stop;
                continue;
            }
        }
        if (hit->lstrip) {
            while (start > start_offset) {
                uint32_t cp = cp_before(s, start);
                if (!tk_is_whitespace(cp)) break;
                start -= (size_t)tk_utf8_encode(cp, (char[4]){0});
            }
        }
        if (hit->rstrip) {
            while (stop < len) {
                uint32_t cp;
                int cl = tk_utf8_decode(s + stop, &cp);
                if (!tk_is_whitespace(cp)) break;
                stop += (size_t)cl;
            }
        }
        if (start > start_offset)
            KVS_TRY(emit(ctx, s + start_offset, start - start_offset, -1, first && start_offset == 0));
        KVS_TRY(emit(ctx, s + start, stop - start, hit->id, first && start == 0));
        start_offset = pos = stop;
    }
    if (start_offset < len) KVS_TRY(emit(ctx, s + start_offset, len - start_offset, -1, first && start_offset == 0));
    return KVS_OK;
}
