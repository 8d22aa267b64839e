/* libFuzzer target: the SSE writer. Arbitrary outputs (text with NULs, invalid
 * UTF-8 and newlines, ids in and out of the vocabulary, any float as logprob,
 * every finish reason, error messages) go through the engine's output callback
 * (kvs_gen_on_output) into the stream reader (kvs_stream_read), for both APIs,
 * with and without usage and logprobs.
 *
 * Input: a flags byte (bit 0 chat, bit 1 include_usage, bit 2 logprobs, bits 3-4
 * top_logprobs, bit 5 a tokenizer for logprobs' token text), then outputs, each:
 * a byte (bits 0-2 finish: 0-3 none, 4 stop, 5 length, 6 abort, 7 error; bits
 * 3-5 tokens), a text length byte and the text, 2 bytes per id, 4 per logprob;
 * an error output takes its message from the bytes that follow. A final output
 * ends the input.
 *
 * Checks: the bytes are events "data: <one line>\n\n"; each line is JSON (or
 * [DONE], last, once, after a final output); the chunks' text is the outputs'
 * text when that is valid UTF-8; every output with text or tokens has its chunk.
 * The tokenizer for logprobs is the bundled one, found as fuzz_detokenizer does. */
#include <jansson.h>
#include <libgen.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fuzz_bundled_tokenizer.h"
#include "fuzz_utf8.h"
#include "server/generate.h"

static kvs_tokenizer *tok;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    tok = fuzz_load_bundled_tokenizer("fuzz_sse");
    return 0;
}

static void check(bool ok, const char *what, const char *data, size_t len) {
    if (ok) return;
    fprintf(stderr, "fuzz_sse: %s: %.*s\n", what, (int)(len > 4000 ? 4000 : len), data ? data : "");
    abort();
}


typedef struct {
    char *s;
    size_t len, cap;
} buf;

static void add(buf *b, const void *s, size_t n) {
    if (b->len + n + 1 > b->cap) {
        b->cap = (b->len + n + 1) * 2;
        b->s = realloc(b->s, b->cap);
        check(b->s != NULL, "out of memory", NULL, 0);
    }
    if (n) memcpy(b->s + b->len, s, n);
    b->len += n;
    b->s[b->len] = 0;
}

/* Whatever the stream has ready; call only when something is pending (else it waits). */
static void read_ready(kvs_stream *st, buf *out) {
    char chunk[512];
    do {
        ssize_t n = kvs_stream_read(st, out->len, chunk, sizeof chunk);
        if (n < 0) break;
        add(out, chunk, (size_t)n);
    } while (st->out_off < st->out_len || (!st->ended && st->gen->done));
}

/* Parses one event's JSON, NUL bytes in strings kept. jansson refuses a NUL in an
 * object key, which JSON allows (completions' top_logprobs keyed by a NUL token's
 * text): then "\u0000" becomes "\u0001" and *nul_as_1 is set. */
static json_t *parse_event(const char *line, size_t len, bool *nul_as_1) {
    json_t *j = json_loadb(line, len, JSON_ALLOW_NUL, NULL);
    if (j) return j;
    *nul_as_1 = true;
    char *copy = malloc(len + 1);
    check(copy != NULL, "out of memory", NULL, 0);
    memcpy(copy, line, len);
    copy[len] = 0;
    for (size_t i = 0; i + 1 < len; i++) /* escape by escape: a "\\\\" then "u0000" is no NUL */
        if (copy[i] == '\\') {
            if (copy[i + 1] == 'u' && i + 5 < len && !memcmp(copy + i + 2, "0000", 4)) copy[i + 5] = '1';
            i++;
        }
    json_error_t e;
    j = json_loadb(copy, len, JSON_ALLOW_NUL, &e);
    if (!j) fprintf(stderr, "fuzz_sse: %s at %d\n", e.text, e.position);
    check(j != NULL, "an event is not JSON", line, len);
    free(copy);
    return j;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    uint8_t flags = data[0];
    bool chat = flags & 1, usage = flags & 2, logprobs = flags & 4;
    int top = (flags >> 3) & 3;
    kvs_server srv;
    memset(&srv, 0, sizeof srv);
    pthread_mutex_init(&srv.mu, NULL);
    pthread_cond_init(&srv.cv, NULL);
    srv.in_flight = 1;
    kvs_gen *g = kvs_gen_create(1, 0);
    check(g != NULL, "out of memory", NULL, 0);
    g->refs = 2; /* the stream's and the engine's */
    kvs_stream *st = calloc(1, sizeof *st);
    check(st != NULL, "out of memory", NULL, 0);
    st->srv = &srv;
    st->gen = g;
    st->req_id = strdup("chatcmpl-fuzz");
    st->meta = (kvs_resp_meta){chat ? KVS_API_CHAT : KVS_API_COMPLETIONS, st->req_id, "tiny", 1, (flags & 32) ? tok : NULL,
                               logprobs, top, false};
    st->include_usage = usage;

    buf out = {0}, want = {0};
    add(&out, "", 0);
    add(&want, "", 0);
    bool want_exact = true, final = false;
    int chunks_wanted = 0, chunk_tokens[256];
    size_t at = 1;
    while (at < size && !final) {
        uint8_t h = data[at++];
        int fin_code = h & 7;
        kvs_finish fin = fin_code < 4 ? KVS_FINISH_NONE : (kvs_finish)(KVS_FINISH_STOP + (fin_code - 4));
        int n_tok = (h >> 3) & 7;
        size_t tl = at < size ? data[at++] : 0;
        if (tl > size - at) tl = size - at;
        const char *text = (const char *)data + at;
        at += tl;
        int32_t ids[8];
        float lps[8];
        int k = 0;
        for (; k < n_tok && at + 1 < size; k++, at += 2) {
            int v = data[at] | data[at + 1] << 8;
            ids[k] = v < 0xF000 ? v % 8300 : -(v - 0xF000); /* some beyond the vocabulary, some negative */
        }
        for (int i = 0; i < k; i++, at += 4) {
            uint32_t bits = 0;
            if (at + 4 <= size) memcpy(&bits, data + at, 4);
            memcpy(&lps[i], &bits, 4); /* any float: NaN and infinities too */
        }
        if (at > size) at = size;
        char err[200] = "";
        if (fin == KVS_FINISH_ERROR) {
            size_t el = size - at < sizeof err - 1 ? size - at : sizeof err - 1;
            memcpy(err, data + at, el);
            err[el] = 0;
            at += el;
        }
        kvs_request_output o = {.request_id = 1, .token_ids = ids, .logprobs = logprobs ? lps : NULL, .n_tokens = k,
                                .text = text, .text_len = tl, .finish = fin, .error = fin == KVS_FINISH_ERROR ? err : NULL,
                                .prompt_tokens = 3, .completion_tokens = k};
        bool pending = tl || k || fin != KVS_FINISH_NONE || (chat && !g->choices[0].role_sent);
        kvs_gen_on_output(g, &o);
        final = fin != KVS_FINISH_NONE;
        want_exact = want_exact && fuzz_valid_utf8((const uint8_t *)text, tl);
        add(&want, text, tl);
        /* a chat chunk with no text goes out only as the last, or with tokens
           whose logprobs were asked for (the role goes in a chunk of its own,
           not counted) */
        bool sent = tl || (k && (!chat || logprobs)) || (final && fin != KVS_FINISH_ERROR);
        if (sent) { /* the tokens of the first 256 chunks */
            if (chunks_wanted < 256) chunk_tokens[chunks_wanted] = k;
            chunks_wanted++;
        }
        if (pending) read_ready(st, &out);
    }
    if (!final) { /* end the stream so it can be freed */
        kvs_request_output o = {.request_id = 1, .finish = KVS_FINISH_ABORT};
        kvs_gen_on_output(g, &o);
        if (chunks_wanted < 256) chunk_tokens[chunks_wanted] = 0;
        chunks_wanted++;
        read_ready(st, &out);
    }
    check(st->ended, "no end of stream after a final output", out.s, out.len);

    /* the events */
    buf text = {0};
    add(&text, "", 0);
    int events = 0, chunks = 0;
    bool done = false, nul_as_1 = false;
    const char *p = out.s, *end = out.s + out.len;
    while (p < end) {
        check(!done, "an event after [DONE]", out.s, out.len);
        check(end - p > 6 && !memcmp(p, "data: ", 6), "an event not starting with 'data: '", p, (size_t)(end - p));
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        check(nl && nl + 1 < end && nl[1] == '\n', "an event not one line then a blank line", p, (size_t)(end - p));
        const char *line = p + 6;
        size_t len = (size_t)(nl - line);
        check(!memchr(line, '\r', len) && !memchr(line, 0, len), "a raw CR or NUL in an event", line, len);
        events++;
        if (len == 6 && !memcmp(line, "[DONE]", 6)) {
            done = true;
        } else {
            json_t *j = parse_event(line, len, &nul_as_1);
            json_t *c = json_array_get(json_object_get(j, "choices"), 0);
            json_t *s = chat ? json_object_get(json_object_get(c, "delta"), "content") : json_object_get(c, "text");
            bool role_only = chat && json_object_get(json_object_get(c, "delta"), "role");
            if (c && !role_only) {
                /* logprobs: one entry per token of the chunk, in every array */
                json_t *lp = json_object_get(c, "logprobs");
                int k = chunks < chunks_wanted && chunks < 256 ? chunk_tokens[chunks] : -1;
                if (k < 0) {
                    /* past the chunks whose tokens were recorded */
                } else if (logprobs && k > 0) {
                    check(json_is_object(lp), "no logprobs", line, len);
                    if (chat) {
                        check((int)json_array_size(json_object_get(lp, "content")) == k, "logprobs.content entries", line, len);
                    } else {
                        const char *keys[] = {"tokens", "token_logprobs", "text_offset"};
                        for (int i = 0; i < 3; i++)
                            check((int)json_array_size(json_object_get(lp, keys[i])) == k, "logprobs entries", line, len);
                        if (top)
                            check((int)json_array_size(json_object_get(lp, "top_logprobs")) == k, "top_logprobs entries", line, len);
                    }
                } else {
                    check(json_is_null(lp), "logprobs not asked for or no tokens, yet not null", line, len);
                }
                chunks++;
            }
            if (json_is_string(s)) add(&text, json_string_value(s), json_string_length(s));
            json_decref(j);
        }
        p = nl + 2;
    }
    check(done, "no [DONE]", out.s, out.len);
    check(chunks == chunks_wanted, "a chunk is missing or extra", out.s, out.len);
    check(fuzz_valid_utf8((const uint8_t *)text.s, text.len), "the streamed text is not valid UTF-8", text.s, text.len);
    if (nul_as_1)
        for (size_t i = 0; i < text.len; i++) text.s[i] = text.s[i] == 1 ? 0 : text.s[i];
    for (size_t i = 0; nul_as_1 && i < want.len; i++) want.s[i] = want.s[i] == 1 ? 0 : want.s[i];
    if (want_exact)
        check(text.len == want.len && !memcmp(text.s, want.s, want.len), "the streamed text differs", out.s, out.len);
    (void)events;
    kvs_stream_free(st);
    pthread_mutex_destroy(&srv.mu);
    pthread_cond_destroy(&srv.cv);
    free(out.s);
    free(want.s);
    free(text.s);
    return 0;
}
