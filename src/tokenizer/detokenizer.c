/* tokenizer: the incremental (streaming) decoder.
 *
 * It keeps a short window of ids: the context ids[0..read), whose text
 * ("prefix") was delivered except its last `unsent` bytes, then the ids not yet
 * settled. A push decodes the window; the text beyond the delivered part of the
 * prefix is new. Decoding the context with the new ids keeps the decoders'
 * context right (SentencePiece's leading-space strip only applies to the first
 * token, byte-level / byte-fallback sequences span tokens).
 *
 * Text ending in U+FFFD (an incomplete UTF-8 sequence, still waiting for bytes)
 * or no longer starting with what was delivered (the decoders rewrote it) is
 * held back for up to TK_HOLD_MAX ids; then all but a trailing U+FFFD is sent
 * (invalid bytes become U+FFFD; the trailing one goes out with the next text,
 * or as the character it completes). After every delivery the window slides:
 * the new context starts at the latest token boundary where the text did not
 * end in U+FFFD (a cut no later byte can change), at most TK_WINDOW_MAX ids
 * back. Ids that add nothing to a decode (unknown ids, skipped specials) never
 * enter the window. So a push costs a bounded decode, however long the stream:
 * O(1) per token. Lengths throughout: the text may hold NUL bytes. */
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tokenizer_internal.h"

#define TK_HOLD_MAX 8    /* ids a held tail waits at most */
#define TK_WINDOW_MAX 16 /* context ids at most, when no clean cut is nearer */

struct kvs_detokenizer {
    const kvs_tokenizer *t;
    bool skip_special;
    int32_t *ids;
    bool *clean; /* clean[i]: the text up to and including ids[i] did not end in U+FFFD */
    int n, cap, read;
    char *prefix; /* decode(ids[0..read)), NULL until needed */
    size_t prefix_len, unsent;
    char *text;   /* the last decode; pieces point into it */
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
    free(d->clean);
    free(d->prefix);
    free(d->text);
    free(d);
}

static bool ends_with_fffd(const char *s, size_t n) { return n >= 3 && !memcmp(s + n - 3, "\xEF\xBF\xBD", 3); }

static kvs_status refresh_prefix(kvs_detokenizer *d) {
    if (d->prefix) return KVS_OK;
    KVS_TRY(kvs_tokenizer_decode(d->t, d->ids, d->read, d->skip_special, &d->prefix, &d->prefix_len));
    if (d->unsent > d->prefix_len) d->unsent = d->prefix_len;
    return KVS_OK;
}

/* Where the new text starts: after the delivered part of the prefix, or, when the
 * decoders rewrote it, after the longest common start (on a character boundary). */
static size_t new_text_start(const kvs_detokenizer *d, const char *text, size_t len, bool *settled) {
    size_t sent = d->prefix_len - d->unsent;
    *settled = len >= sent && !memcmp(text, d->prefix, sent);
    if (*settled) return sent;
    size_t common = 0;
    while (common < sent && common < len && text[common] == d->prefix[common]) common++;
    while (common > 0 && common < len && ((uint8_t)text[common] & 0xC0) == 0x80) common--;
    return common;
}

/* Everything up to ids[n) is settled but the last `unsent` bytes of its text:
 * the window restarts at the latest clean cut before the last id. */
static void slide(kvs_detokenizer *d, size_t unsent) {
    int start = d->n - 1;
    while (start > 0 && !d->clean[start - 1] && d->n - start < TK_WINDOW_MAX) start--;
    memmove(d->ids, d->ids + start, (size_t)(d->n - start) * sizeof *d->ids);
    memmove(d->clean, d->clean + start, (size_t)(d->n - start) * sizeof *d->clean);
    d->n -= start;
    d->read = d->n;
    free(d->prefix);
    d->prefix = NULL;
    d->prefix_len = 0;
    d->unsent = unsent;
}

static kvs_status decode_window(kvs_detokenizer *d, size_t *len) {
    free(d->text);
    d->text = NULL;
    KVS_TRY(refresh_prefix(d));
    return kvs_tokenizer_decode(d->t, d->ids, d->n, d->skip_special, &d->text, len);
}

kvs_status kvs_detokenizer_push(kvs_detokenizer *d, int32_t id, const char **piece, size_t *len) {
    *piece = "";
    *len = 0;
    if (!d) return kvs_fail(KVS_ERR_INVALID, "detokenizer: NULL");
    if (!tk_token_visible(d->t, id, d->skip_special)) return KVS_OK; /* adds nothing to any decode */
    if (d->n == d->cap) {
        int cap = d->cap ? d->cap * 2 : 16;
        int32_t *v = realloc(d->ids, (size_t)cap * sizeof *v);
        if (!v) return kvs_fail(KVS_ERR_NOMEM, "detokenizer: out of memory");
        d->ids = v;
        bool *c = realloc(d->clean, (size_t)cap * sizeof *c);
        if (!c) return kvs_fail(KVS_ERR_NOMEM, "detokenizer: out of memory");
        d->clean = c;
        d->cap = cap;
    }
    d->ids[d->n++] = id;
    size_t n;
    KVS_TRY(decode_window(d, &n));
    bool tail = ends_with_fffd(d->text, n), settled;
    d->clean[d->n - 1] = !tail;
    size_t from = new_text_start(d, d->text, n, &settled);
    if ((tail || !settled) && d->n - d->read < TK_HOLD_MAX) return KVS_OK;
    size_t to = tail && n - 3 >= from ? n - 3 : n; /* a trailing U+FFFD may still become a character */
    *piece = d->text + from;
    *len = to - from;
    slide(d, n - to);
    return KVS_OK;
}

kvs_status kvs_detokenizer_finish(kvs_detokenizer *d, const char **piece, size_t *len) {
    *piece = "";
    *len = 0;
    if (!d) return kvs_fail(KVS_ERR_INVALID, "detokenizer: NULL");
    if (d->n == d->read && d->unsent == 0) return KVS_OK;
    size_t n;
    KVS_TRY(decode_window(d, &n));
    bool settled;
    size_t from = new_text_start(d, d->text, n, &settled);
    *piece = d->text + from;
    *len = n - from;
    if (d->n > 0) slide(d, 0);
    return KVS_OK;
}
