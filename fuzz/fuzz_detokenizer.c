/* libFuzzer target: the streaming detokenizer and the engine's text path (stop
 * strings, outputs) over arbitrary id sequences on the bundled tokenizer
 * (models/tiny-needle-llama: byte-level, so the stream is exact).
 *
 * Input: a flags byte (bit 0 skip_special, bits 1-2 the number of stop strings,
 * bit 3 an EOS id, bits 4-7 max_tokens / 16, 0: every id), then each stop string as a length
 * byte (high bit: a slice of the decoded text at the offset of the next byte,
 * else the bytes that follow), then ids, two bytes each (little-endian: below
 * 0xF000 taken mod the vocabulary, above it out-of-range ids either side).
 *
 * Checks: every piece is valid UTF-8; pieces + the final flush equal a one-shot
 * decode; through kvs_request_append, the delivered text never holds a stop
 * string, every delivery is valid UTF-8, and the request ends where a simple
 * reference says (the first stop string, the EOS id, or max_tokens) with the
 * text up to there. The tokenizer: $KVS_TOKENIZER_DIR, else
 * $KVS_SOURCE_DIR/models/tiny-needle-llama, else ../models/tiny-needle-llama
 * next to this executable, else models/tiny-needle-llama. */
#define _GNU_SOURCE /* memmem */
#include <libgen.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/engine_internal.h"
#include "fuzz_bundled_tokenizer.h"
#include "fuzz_utf8.h"
#include "tokenizer/tokenizer.h"

#define MAX_IDS 512
#define MAX_STOP 24

static kvs_tokenizer *tok;
static int vocab;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    tok = fuzz_load_bundled_tokenizer("fuzz_detokenizer");
    vocab = kvs_tokenizer_vocab_size(tok);
    return 0;
}


static void check(bool ok, const char *what) {
    if (ok) return;
    fprintf(stderr, "fuzz_detokenizer: %s\n", what);
    abort();
}

typedef struct {
    char *s;
    size_t len, cap;
} buf;

static void add(buf *b, const char *s, size_t n) {
    if (b->len + n + 1 > b->cap) {
        b->cap = (b->len + n + 1) * 2;
        char *p = realloc(b->s, b->cap);
        check(p != NULL, "out of memory");
        b->s = p;
    }
    if (n) memcpy(b->s + b->len, s, n);
    b->len += n;
    b->s[b->len] = 0;
}

typedef struct {
    buf text;
    int tokens, finals;
    kvs_finish finish;
    char *const *stops;
    int n_stops;
} sink;

static void on_output(void *user, const kvs_request_output *o) {
    sink *s = user;
    check(s->finals == 0, "a delivery after the final one");
    check(fuzz_valid_utf8(o->text, o->text_len), "a delivery is not valid UTF-8");
    add(&s->text, o->text, o->text_len);
    s->tokens += o->n_tokens;
    if (o->finish != KVS_FINISH_NONE) s->finals++, s->finish = o->finish;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    uint8_t flags = data[0];
    bool skip = flags & 1;
    int n_stops = (flags >> 1) & 3;
    bool use_eos = flags & 8;
    size_t at = 1;
    /* stop strings: their specs now, their bytes once the text is known */
    struct {
        bool slice;
        size_t len, off;
        const uint8_t *bytes;
    } spec[3];
    int n_spec = 0;
    for (int i = 0; i < n_stops && at < size; i++) {
        uint8_t l = data[at++];
        spec[n_spec].slice = l & 0x80;
        spec[n_spec].len = 1 + (l & 0x7F) % MAX_STOP;
        if (spec[n_spec].slice) {
            spec[n_spec].off = at < size ? data[at++] : 0;
        } else {
            if (spec[n_spec].len > size - at) spec[n_spec].len = size - at;
            spec[n_spec].bytes = data + at;
            at += spec[n_spec].len;
        }
        n_spec++;
    }
    int32_t ids[MAX_IDS];
    int n = 0;
    for (; at + 1 < size && n < MAX_IDS; at += 2) {
        unsigned v = data[at] | (unsigned)data[at + 1] << 8;
        ids[n++] = v < 0xF000 ? (int32_t)(v % (unsigned)vocab) : (v & 1) ? vocab + (int32_t)(v - 0xF000) : -1 - (int32_t)(v - 0xF000);
    }
    if (n == 0) return 0;

    /* 1. the detokenizer alone: pieces + flush == one-shot decode */
    char *whole;
    size_t whole_len;
    check(kvs_tokenizer_decode(tok, ids, n, skip, &whole, &whole_len) == KVS_OK, "decode failed");
    kvs_detokenizer *d = kvs_detokenizer_create(tok, skip);
    check(d != NULL, "create failed");
    buf streamed = {0};
    add(&streamed, "", 0);
    size_t ends[MAX_IDS]; /* streamed.len after each push */
    for (int i = 0; i <= n; i++) {
        const char *piece;
        size_t len;
        kvs_status st = i < n ? kvs_detokenizer_push(d, ids[i], &piece, &len) : kvs_detokenizer_finish(d, &piece, &len);
        check(st == KVS_OK, "push failed");
        check(fuzz_valid_utf8(piece, len), "a piece is not valid UTF-8");
        add(&streamed, piece, len);
        if (i < n) ends[i] = streamed.len;
        check(streamed.len <= whole_len || i == n, "the stream ran ahead of the whole text");
    }
    kvs_detokenizer_destroy(d);
    check(streamed.len == whole_len && !memcmp(streamed.s, whole, whole_len), "stream != one-shot decode");

    /* stop strings: non-empty, no NUL, valid UTF-8 (what the API lets through) */
    char stop_buf[3][MAX_STOP + 1];
    char *stops[3];
    int n_valid = 0;
    for (int i = 0; i < n_spec; i++) {
        const char *src = spec[i].slice ? whole + (whole_len ? spec[i].off % whole_len : 0) : (const char *)spec[i].bytes;
        size_t len = spec[i].len;
        if (spec[i].slice && len > whole_len - (size_t)(src - whole)) len = whole_len - (size_t)(src - whole);
        const char *nul = memchr(src, 0, len);
        if (nul) len = (size_t)(nul - src);
        while (len > 0 && !fuzz_valid_utf8(src, len)) len--;
        if (len == 0) continue;
        memcpy(stop_buf[n_valid], src, len);
        stop_buf[n_valid][len] = 0;
        stops[n_valid] = stop_buf[n_valid];
        n_valid++;
    }

    /* 2. the engine's text path, and a reference for where it ends */
    int max_tokens = (flags >> 4) && (flags >> 4) * 16 < n ? (flags >> 4) * 16 : n;
    int32_t eos = kvs_tokenizer_eos_id(tok) >= 0 ? kvs_tokenizer_eos_id(tok) : 0;
    static kvs_engine e; /* a bare engine: what kvs_request_create and _append read */
    static bool e_init;
    if (!e_init) pthread_mutex_init(&e.mu, NULL), e_init = true;
    e.tok = tok;
    e.vocab = vocab;
    e.cfg.max_model_len = MAX_IDS + 2;
    e.mcfg.n_eos = use_eos;
    e.mcfg.eos_token_ids[0] = eos;
    int32_t prompt = 0;
    kvs_request_params p = {.prompt_ids = &prompt, .n_prompt = 1, .sampling = kvs_sampling_default(),
                            .max_tokens = max_tokens, .stop_strings = (const char *const *)stops,
                            .n_stop_strings = n_valid};
    sink out = {0};
    add(&out.text, "", 0);
    kvs_request *r;
    check(kvs_request_create(&e, &p, on_output, &out, &r) == KVS_OK, "request rejected");
    int consumed = 0;
    while (r->finish == KVS_FINISH_NONE && consumed < n) kvs_request_append(&e, r, ids[consumed++], -1.0f, NULL, NULL);
    kvs_finish engine_finish = r->finish;
    kvs_request_destroy(r);

    /* the reference: the stream token by token (pass 1's pieces when it skipped
       specials as the engine does, else a stream of its own), the first stop string
       in it; at the EOS id or max_tokens the text is the decode of the ids so far */
    d = skip ? NULL : kvs_detokenizer_create(tok, true);
    buf s = {0};
    add(&s, "", 0);
    size_t max_stop = 0;
    for (int i = 0; i < n_valid; i++) max_stop = strlen(stops[i]) > max_stop ? strlen(stops[i]) : max_stop;
    kvs_finish want = KVS_FINISH_NONE;
    size_t want_len = 0, searched = 0;
    int want_tokens = 0;
    for (int i = 0; i < n && want == KVS_FINISH_NONE; i++) {
        const char *piece;
        size_t len;
        bool is_eos = use_eos && ids[i] == eos, final = is_eos || i + 1 == max_tokens;
        if (!is_eos && d) {
            kvs_detokenizer_push(d, ids[i], &piece, &len);
            add(&s, piece, len);
        } else if (!is_eos) {
            size_t from = i ? ends[i - 1] : 0;
            add(&s, streamed.s + from, ends[i] - from);
        }
        if (final && d) {
            kvs_detokenizer_finish(d, &piece, &len);
            add(&s, piece, len);
        } else if (final) {
            char *all;
            check(kvs_tokenizer_decode(tok, ids, is_eos ? i : i + 1, true, &all, &len) == KVS_OK, "decode failed");
            check(len >= s.len && !memcmp(all, s.s, s.len), "a decode does not extend the stream before it");
            s.len = 0;
            add(&s, all, len);
            free(all);
        }
        size_t from = searched > max_stop ? searched - max_stop : 0, best = SIZE_MAX;
        for (int k = 0; k < n_valid; k++) {
            const char *hit = memmem(s.s + from, s.len - from, stops[k], strlen(stops[k]));
            if (hit && (size_t)(hit - s.s) < best) best = (size_t)(hit - s.s);
        }
        searched = s.len;
        want_tokens = i + 1;
        if (best != SIZE_MAX) want = KVS_FINISH_STOP, want_len = best;
        else if (final) want = is_eos ? KVS_FINISH_STOP : KVS_FINISH_LENGTH, want_len = s.len;
    }
    kvs_detokenizer_destroy(d);
    if (want != KVS_FINISH_NONE) {
        check(engine_finish == want && out.finals == 1, "the request ended otherwise than the reference");
        check(out.tokens == want_tokens && consumed == want_tokens, "the request ended at another token");
        check(out.text.len == want_len && !memcmp(out.text.s, s.s, want_len), "the delivered text differs");
    } else {
        check(engine_finish == KVS_FINISH_NONE && out.finals == 0 && consumed == n, "the request ended early");
        check(out.text.len <= s.len && !memcmp(out.text.s, s.s, out.text.len), "the delivered text differs");
    }
    for (int k = 0; k < n_valid; k++) check(!memmem(out.text.s, out.text.len, stops[k], strlen(stops[k])), "a stop string was delivered");
    free(s.s);
    free(out.text.s);
    free(streamed.s);
    free(whole);
    return 0;
}
