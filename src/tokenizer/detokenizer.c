/* tokenizer: the incremental (streaming) decoder.
 *
 * It keeps a window of ids: the ones already emitted whose text is the "prefix"
 * (window[0..read)), then the ones not yet emitted. On each push it decodes the
 * prefix and the whole window; when the whole window decodes to more text that
 * starts with the prefix's text and does not end in U+FFFD (an incomplete UTF-8
 * sequence, still waiting for bytes), the new suffix is emitted and the window
 * slides. Decoding the previous tokens with the new ones keeps the decoders'
 * context right (SentencePiece's leading-space strip only applies to the first
 * token of the whole stream, byte-level / byte-fallback sequences spanning tokens). */
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tokenizer_internal.h"

/* A tail of U+FFFD is held back at most this many tokens (a real U+FFFD in the text,
 * or invalid bytes that no later token can complete). */
#define TK_HOLD_MAX 8

struct kvs_detokenizer {
    const kvs_tokenizer *t;
    bool skip_special;
    int32_t *ids;
    int n, cap, read;
    char *prefix_text; /* decode(ids[0..read)) */
    size_t prefix_len;
    char *piece;
};

kvs_detokenizer *kvs_detokenizer_create(const kvs_tokenizer *t, bool skip_special) {
    if (!t) return NULL;
    kvs_detokenizer *d = calloc(1, sizeof *d);
    if (!d) return NULL;
    d->t = t;
    d->skip_special = skip_special;
    return d;
}

void kvs_detokenizer_destroy(kvs_detokenizer *d) {
    if (!d) return;
    free(d->ids);
    free(d->prefix_text);
    free(d->piece);
    free(d);
}

static bool ends_with_fffd(const char *s, size_t n) {
    return n >= 3 && !memcmp(s + n - 3, "\xEF\xBF\xBD", 3);
}

/* Emits new_text beyond the prefix; slides the window. Takes ownership of new_text. */
static void emit(kvs_detokenizer *d, char *new_text, size_t new_len, const char **piece, size_t *len) {
    size_t common = 0;
    if (new_len >= d->prefix_len && !memcmp(new_text, d->prefix_text ? d->prefix_text : "", d->prefix_len)) {
        common = d->prefix_len;
    } else { /* the decoders rewrote the prefix: emit from the longest common prefix on */
        while (common < d->prefix_len && common < new_len && new_text[common] == d->prefix_text[common]) common++;
        while (common > 0 && ((uint8_t)new_text[common] & 0xC0) == 0x80) common--;
    }
    free(d->piece);
    d->piece = malloc(new_len - common + 1);
    if (d->piece) {
        memcpy(d->piece, new_text + common, new_len - common);
        d->piece[new_len - common] = 0;
        *piece = d->piece;
        *len = new_len - common;
    }
    /* the window now starts at the tokens just emitted */
    memmove(d->ids, d->ids + d->read, (size_t)(d->n - d->read) * sizeof *d->ids);
    d->n -= d->read;
    d->read = d->n;
    free(d->prefix_text);
    d->prefix_text = NULL;
    d->prefix_len = 0;
    free(new_text);
}

static kvs_status refresh_prefix(kvs_detokenizer *d) {
    if (d->prefix_text) return KVS_OK;
    KVS_TRY(kvs_tokenizer_decode(d->t, d->ids, d->read, d->skip_special, &d->prefix_text));
    d->prefix_len = strlen(d->prefix_text);
    return KVS_OK;
}

kvs_status kvs_detokenizer_push(kvs_detokenizer *d, int32_t id, const char **piece, size_t *len) {
    *piece = "";
    *len = 0;
    if (!d) return kvs_fail(KVS_ERR_INVALID, "detokenizer: NULL");
    if (d->n == d->cap) {
        int cap = d->cap ? d->cap * 2 : 16;
        int32_t *v = realloc(d->ids, (size_t)cap * sizeof *v);
        if (!v) return kvs_fail(KVS_ERR_NOMEM, "detokenizer: out of memory");
        d->ids = v;
        d->cap = cap;
    }
    d->ids[d->n++] = id;
    KVS_TRY(refresh_prefix(d));
    char *text;
    KVS_TRY(kvs_tokenizer_decode(d->t, d->ids, d->n, d->skip_special, &text));
    size_t n = strlen(text);
    bool grows = n > d->prefix_len && !memcmp(text, d->prefix_text, d->prefix_len);
    bool held = ends_with_fffd(text, n) || !grows;
    if (held && d->n - d->read < TK_HOLD_MAX) {
        free(text);
        return KVS_OK;
    }
    if (!grows && n <= d->prefix_len) { /* nothing new at all (e.g. skipped specials) */
        free(text);
        return KVS_OK;
    }
    emit(d, text, n, piece, len);
    return KVS_OK;
}

kvs_status kvs_detokenizer_finish(kvs_detokenizer *d, const char **piece, size_t *len) {
    *piece = "";
    *len = 0;
    if (!d) return kvs_fail(KVS_ERR_INVALID, "detokenizer: NULL");
    if (d->n == d->read) return KVS_OK;
    KVS_TRY(refresh_prefix(d));
    char *text;
    KVS_TRY(kvs_tokenizer_decode(d->t, d->ids, d->n, d->skip_special, &text));
    emit(d, text, strlen(text), piece, len);
    return KVS_OK;
}
