/* The streaming detokenizer and the engine's text path (stop strings, outputs):
 * cost per token flat however long the stream (skipped specials, unknown ids,
 * tokens that add no text, invalid bytes), NUL bytes carried with their length,
 * and the stream equal to a one-shot decode. The engine path is driven with
 * forced token sequences through kvs_request_append on a bare engine struct. */
#define _GNU_SOURCE /* memmem */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"
#include "testutil.h"
#include "tokenizer/tokenizer.h"

static kvs_tokenizer *tiny(void) {
    kvs_tokenizer *t = NULL;
    cr_assert_eq(kvs_tokenizer_load(src_path("models/tiny-needle-llama"), &t), KVS_OK, "%s", kvs_last_error());
    return t;
}

typedef struct {
    int32_t *v;
    int n, cap;
} idvec;

static void push_ids(idvec *a, const int32_t *ids, int n) {
    if (a->n + n > a->cap) {
        a->cap = (a->n + n) * 2;
        a->v = realloc(a->v, sizeof(int32_t) * a->cap);
        cr_assert(a->v);
    }
    memcpy(a->v + a->n, ids, sizeof(int32_t) * n);
    a->n += n;
}

static void push_text(idvec *a, const kvs_tokenizer *t, const char *text) {
    int32_t *ids;
    int n;
    cr_assert_eq(kvs_tokenizer_encode(t, text, strlen(text), (kvs_encode_options){false, false}, &ids, &n), KVS_OK);
    push_ids(a, ids, n);
    free(ids);
}

static void push_repeat(idvec *a, int32_t id, int count) {
    for (int i = 0; i < count; i++) push_ids(a, &id, 1);
}

typedef struct {
    char *s;
    size_t len, cap;
} text_buf;

static void text_add(text_buf *b, const char *s, size_t n) {
    if (b->len + n + 1 > b->cap) {
        b->cap = (b->len + n + 1) * 2;
        b->s = realloc(b->s, b->cap);
        cr_assert(b->s);
    }
    memcpy(b->s + b->len, s, n);
    b->len += n;
    b->s[b->len] = 0;
}

static bool valid_utf8(const char *s, size_t n) {
    const unsigned char *p = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        int k = p[i] < 0x80 ? 1 : (p[i] >> 5) == 6 ? 2 : (p[i] >> 4) == 14 ? 3 : (p[i] >> 3) == 30 ? 4 : 0;
        if (!k || i + k > n) return false;
        for (int j = 1; j < k; j++)
            if ((p[i + j] & 0xC0) != 0x80) return false;
        i += (size_t)k;
    }
    return true;
}

/* Streams ids through a fresh detokenizer into out (every piece valid UTF-8); returns seconds. */
static double stream(const kvs_tokenizer *t, bool skip, const int32_t *ids, int n, text_buf *out) {
    kvs_detokenizer *d = kvs_detokenizer_create(t, skip);
    cr_assert(d);
    out->len = 0;
    double t0 = kvs_now();
    for (int i = 0; i <= n; i++) {
        const char *piece;
        size_t len;
        kvs_status st = i < n ? kvs_detokenizer_push(d, ids[i], &piece, &len) : kvs_detokenizer_finish(d, &piece, &len);
        cr_assert_eq(st, KVS_OK, "%s", kvs_last_error());
        cr_assert(valid_utf8(piece, len), "piece %d is not valid UTF-8", i);
        text_add(out, piece, len);
    }
    double dt = kvs_now() - t0;
    kvs_detokenizer_destroy(d);
    return dt;
}

/* The stream equals the one-shot decode, byte for byte (NULs included). */
static void expect_stream_is_decode(const kvs_tokenizer *t, bool skip, const idvec *ids, const text_buf *got,
                                    const char *what) {
    char *want;
    size_t want_len;
    cr_assert_eq(kvs_tokenizer_decode(t, ids->v, ids->n, skip, &want, &want_len), KVS_OK);
    cr_expect(got->len == want_len && !memcmp(got->s, want, want_len),
              "%s: the stream (%zu bytes) differs from the one-shot decode (%zu bytes)", what, got->len, want_len);
    free(want);
}

/* Seconds per token of the best of 3 runs of build(count) (the least disturbed by other load). */
typedef void (*build_fn)(const kvs_tokenizer *t, int count, idvec *out);

static double per_token(const kvs_tokenizer *t, bool skip, build_fn build, int count, const char *what,
                        const char *want_text) {
    idvec ids = {0};
    build(t, count, &ids);
    text_buf got = {0};
    double best = 1e30;
    for (int rep = 0; rep < 3; rep++) {
        double dt = stream(t, skip, ids.v, ids.n, &got);
        if (dt < best) best = dt;
    }
    expect_stream_is_decode(t, skip, &ids, &got, what);
    if (want_text) cr_expect(got.len == strlen(want_text) && !memcmp(got.s, want_text, got.len), "%s: got '%.*s'", what,
                             (int)(got.len > 200 ? 200 : got.len), got.s);
    free(ids.v);
    free(got.s);
    return best / ids.n;
}

/* Per-token cost at 1k and 10k: printed, and bounded very generously (a quadratic
 * window costs ~10x more per token at 10k than at 1k; a flat one the same). */
static void expect_flat(const kvs_tokenizer *t, bool skip, build_fn build, const char *what, const char *want_text) {
    double c1 = per_token(t, skip, build, 1000, what, want_text);
    double c10 = per_token(t, skip, build, 10000, what, want_text);
    cr_log_info("%s: %.0f ns/token at 1k, %.0f ns/token at 10k", what, c1 * 1e9, c10 * 1e9);
    fprintf(stderr, "%s: %.0f ns/token at 1k, %.0f ns/token at 10k\n", what, c1 * 1e9, c10 * 1e9);
    cr_expect_lt(c10, 5 * c1 + 2e-6, "%s: %.0f ns/token at 10k vs %.0f at 1k: not linear", what, c10 * 1e9, c1 * 1e9);
}

static void build_specials(const kvs_tokenizer *t, int count, idvec *out) {
    push_text(out, t, "Hello");
    push_repeat(out, kvs_tokenizer_token_id(t, "<|eot_id|>"), count);
    push_text(out, t, " world");
}

static void build_unknown(const kvs_tokenizer *t, int count, idvec *out) {
    push_text(out, t, "Hello");
    for (int i = 0; i < count; i++) push_repeat(out, i % 2 ? -1 - i : kvs_tokenizer_vocab_size(t) + i, 1);
    push_text(out, t, " world");
}

/* the byte 0xFF (never valid UTF-8): every token's text ends in U+FFFD */
static void build_invalid_bytes(const kvs_tokenizer *t, int count, idvec *out) {
    push_text(out, t, "Hello");
    push_repeat(out, kvs_tokenizer_token_id(t, "\xC3\xBF"), count); /* byte-level 'ÿ' is the byte 0xFF */
    push_text(out, t, " world");
}

Test(detokenizer, skipped_specials_cost_flat) {
    kvs_tokenizer *t = tiny();
    expect_flat(t, true, build_specials, "skipped <|eot_id|>", "Hello world");
    expect_flat(t, true, build_unknown, "unknown ids", "Hello world");
    expect_flat(t, true, build_invalid_bytes, "invalid bytes (U+FFFD)", NULL);
    /* not skipped, the specials are text */
    idvec ids = {0};
    build_specials(t, 3, &ids);
    text_buf got = {0};
    stream(t, false, ids.v, ids.n, &got);
    cr_expect_str_eq(got.s, "Hello<|eot_id|><|eot_id|><|eot_id|> world");
    free(ids.v);
    free(got.s);
    kvs_tokenizer_destroy(t);
}

/* A tokenizer whose token "x" decodes to nothing (Replace "x" -> ""): tokens that
 * enter the window but add no text still advance it. */
static const char *EMPTY_TOKEN_JSON =
    "{\"model\":{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1,\"x\":2,\" \":3},\"merges\":[]},"
    "\"decoder\":{\"type\":\"Replace\",\"pattern\":{\"String\":\"x\"},\"content\":\"\"}}";

static void build_empty(const kvs_tokenizer *t, int count, idvec *out) {
    (void)t;
    int32_t head[] = {0, 3}, tail[] = {1, 0};
    push_ids(out, head, 2);
    push_repeat(out, 2, count);
    push_ids(out, tail, 2);
}

Test(detokenizer, tokens_without_text_cost_flat) {
    kvs_tokenizer *t;
    cr_assert_eq(kvs_tokenizer_parse(EMPTY_TOKEN_JSON, strlen(EMPTY_TOKEN_JSON), NULL, 0, &t), KVS_OK, "%s",
                 kvs_last_error());
    expect_flat(t, false, build_empty, "tokens that decode to nothing", "a ba");
    kvs_tokenizer_destroy(t);
}

/* Incomplete UTF-8 is held until complete; a NUL byte is text with a length. */
Test(detokenizer, utf8_held_and_nul_delivered) {
    kvs_tokenizer *t = tiny();
    int nul = kvs_tokenizer_token_id(t, "\xC4\x80"); /* byte-level 'Ā' is the byte 0x00 */
    cr_assert_geq(nul, 0);
    idvec ids = {0};
    push_text(&ids, t, "\xE4\xBD\xA0"); /* one character over several byte tokens */
    cr_assert_geq(ids.n, 2);
    kvs_detokenizer *d = kvs_detokenizer_create(t, true);
    const char *piece;
    size_t len;
    for (int i = 0; i + 1 < ids.n; i++) {
        cr_assert_eq(kvs_detokenizer_push(d, ids.v[i], &piece, &len), KVS_OK);
        cr_expect_eq(len, 0u, "an incomplete character was sent");
    }
    cr_assert_eq(kvs_detokenizer_push(d, ids.v[ids.n - 1], &piece, &len), KVS_OK);
    cr_expect(len == 3 && !memcmp(piece, "\xE4\xBD\xA0", 3));
    cr_assert_eq(kvs_detokenizer_push(d, nul, &piece, &len), KVS_OK);
    cr_expect(len == 1 && piece[0] == 0, "the NUL byte: got %zu bytes", len);
    int32_t a = kvs_tokenizer_token_id(t, "a");
    cr_assert_eq(kvs_detokenizer_push(d, a, &piece, &len), KVS_OK);
    cr_expect(len == 1 && piece[0] == 'a', "text after the NUL byte");
    /* an incomplete character at the end is flushed as U+FFFD */
    cr_assert_eq(kvs_detokenizer_push(d, ids.v[0], &piece, &len), KVS_OK);
    cr_expect_eq(len, 0u);
    cr_assert_eq(kvs_detokenizer_finish(d, &piece, &len), KVS_OK);
    cr_expect(len == 3 && !memcmp(piece, "\xEF\xBF\xBD", 3));
    kvs_detokenizer_destroy(d);
    free(ids.v);
    kvs_tokenizer_destroy(t);
}

/* Random id sequences (any id of the vocabulary, byte tokens, specials, unknown
 * ids): the stream equals the one-shot decode (byte-level decoding is exact). */
Test(detokenizer, random_ids_stream_is_decode) {
    uint64_t seed = getenv("KVS_TEST_SEED") ? strtoull(getenv("KVS_TEST_SEED"), NULL, 0) : 11;
    cr_log_info("seed %llu (KVS_TEST_SEED repeats it)", (unsigned long long)seed);
    fprintf(stderr, "detokenizer random_ids_stream_is_decode: seed %llu\n", (unsigned long long)seed);
    kvs_rng rng;
    kvs_rng_seed(&rng, seed);
    kvs_tokenizer *t = tiny();
    int vocab = kvs_tokenizer_vocab_size(t);
    /* multi-byte pieces: the box-drawing and quote tokens split inside characters */
    int32_t odd[] = {339, 349, 489, 702, 1726, 2286, 3718, 5254, 5255, 3158, 8187, 8191, -1, vocab};
    for (int c = 0; c < 300; c++) {
        idvec ids = {0};
        int n = 1 + (int)(kvs_rng_u64(&rng) % 200);
        for (int i = 0; i < n; i++) {
            uint64_t r = kvs_rng_u64(&rng);
            int32_t id = r % 3 == 0 ? odd[(r >> 8) % (sizeof odd / sizeof *odd)] : r % 3 == 1 ? (int32_t)((r >> 8) % 256) + 0
                                                                                             : (int32_t)((r >> 8) % vocab);
            push_ids(&ids, &id, 1);
        }
        for (int skip = 0; skip < 2; skip++) {
            text_buf got = {0};
            stream(t, skip, ids.v, ids.n, &got);
            char what[64];
            snprintf(what, sizeof what, "case %d (skip_special %d)", c, skip);
            expect_stream_is_decode(t, skip, &ids, &got, what);
            free(got.s);
        }
        free(ids.v);
    }
    kvs_tokenizer_destroy(t);
}

/* ---- the engine's text path: kvs_request_append with forced tokens --------- */
typedef struct {
    text_buf text;
    int tokens;
    kvs_finish finish;
} sink;

static void on_output(void *user, const kvs_request_output *o) {
    sink *s = user;
    cr_assert(valid_utf8(o->text, o->text_len));
    text_add(&s->text, o->text, o->text_len);
    s->tokens += o->n_tokens;
    if (o->finish != KVS_FINISH_NONE) s->finish = o->finish;
}

/* Appends ids to a request (max_tokens = n) until it finishes; returns seconds per token. */
static double engine_run(const kvs_tokenizer *t, const idvec *ids, const char *stop, sink *out) {
    kvs_engine *e = calloc(1, sizeof *e);
    cr_assert(e);
    pthread_mutex_init(&e->mu, NULL);
    e->tok = t;
    e->vocab = kvs_tokenizer_vocab_size(t);
    e->cfg.max_model_len = ids->n + 1;
    int32_t prompt = kvs_tokenizer_token_id(t, "a");
    const char *stops[1] = {stop};
    kvs_request_params p = {.prompt_ids = &prompt, .n_prompt = 1, .sampling = kvs_sampling_default(),
                            .max_tokens = ids->n, .stop_strings = stops, .n_stop_strings = stop ? 1 : 0};
    kvs_request *r;
    cr_assert_eq(kvs_request_create(e, &p, on_output, out, &r), KVS_OK, "%s", kvs_last_error());
    memset(out, 0, sizeof *out);
    double t0 = kvs_now();
    int i = 0;
    while (r->finish == KVS_FINISH_NONE && i < ids->n) kvs_request_append(e, r, ids->v[i++], 0.0f, NULL, NULL);
    double dt = kvs_now() - t0;
    cr_assert_neq(r->finish, KVS_FINISH_NONE);
    kvs_request_destroy(r);
    pthread_mutex_destroy(&e->mu);
    free(e);
    return dt / i;
}

/* count tokens of text with NUL bytes and skipped specials, then a stop string */
static void build_nul_then_stop(const kvs_tokenizer *t, int count, idvec *out) {
    int32_t nul = kvs_tokenizer_token_id(t, "\xC4\x80"), eot = kvs_tokenizer_token_id(t, "<|eot_id|>");
    push_text(out, t, "Hello");
    push_ids(out, &nul, 1);
    while (out->n < count) {
        push_repeat(out, eot, 7);
        push_ids(out, &nul, 1);
        push_text(out, t, " ab");
    }
    push_text(out, t, " STOP and more text");
}

Test(detokenizer, nul_byte_then_stop_string) {
    kvs_tokenizer *t = tiny();
    double cost[2];
    for (int k = 0; k < 2; k++) {
        int count = k ? 10000 : 1000;
        idvec ids = {0};
        build_nul_then_stop(t, count, &ids);
        char *all;
        size_t all_len;
        cr_assert_eq(kvs_tokenizer_decode(t, ids.v, ids.n, true, &all, &all_len), KVS_OK);
        const char *hit = memmem(all, all_len, "STOP", 4);
        cr_assert(hit);
        size_t want = (size_t)(hit - all);
        sink s = {0};
        cost[k] = 1e30;
        for (int rep = 0; rep < 3; rep++) {
            free(s.text.s);
            double c = engine_run(t, &ids, "STOP", &s);
            if (c < cost[k]) cost[k] = c;
        }
        cr_expect_eq(s.finish, KVS_FINISH_STOP);
        cr_expect_eq(s.text.len, want, "%d tokens: %zu bytes delivered, want %zu", count, s.text.len, want);
        cr_expect(s.text.len == want && !memcmp(s.text.s, all, want), "%d tokens: the text before the stop differs", count);
        size_t nuls = 0;
        for (size_t i = 0; i < s.text.len; i++) nuls += s.text.s[i] == 0;
        cr_expect_gt(nuls, (size_t)count / 12, "NUL bytes delivered: %zu", nuls);
        cr_expect_eq(s.text.s[s.text.len - 1], ' ', "the text up to the stop string");
        free(s.text.s);
        /* without a stop string it is all of it */
        engine_run(t, &ids, NULL, &s);
        cr_expect_eq(s.finish, KVS_FINISH_LENGTH);
        cr_expect(s.text.len == all_len && !memcmp(s.text.s, all, all_len), "%d tokens, no stop: text differs", count);
        free(s.text.s);
        free(all);
        free(ids.v);
    }
    cr_log_info("NUL + stop string through the engine: %.0f ns/token at 1k, %.0f ns/token at 10k", cost[0] * 1e9,
                cost[1] * 1e9);
    fprintf(stderr, "NUL + stop string through the engine: %.0f ns/token at 1k, %.0f ns/token at 10k\n", cost[0] * 1e9,
            cost[1] * 1e9);
    cr_expect_lt(cost[1], 5 * cost[0] + 2e-6, "not linear: %.0f ns/token at 10k vs %.0f at 1k", cost[1] * 1e9,
                 cost[0] * 1e9);
    kvs_tokenizer_destroy(t);
}

/* kvs_stop_sendable alone: lengths, NULs, held prefixes, the earliest stop. */
Test(detokenizer, stop_sendable) {
    const char *stops[] = {"END", "\nx"};
    bool stopped;
    cr_expect_eq(kvs_stop_sendable(stops, 2, "a\0bEN", 5, false, &stopped), 3u); /* "EN" may become "END" */
    cr_expect(!stopped);
    cr_expect_eq(kvs_stop_sendable(stops, 2, "a\0bEN", 5, true, &stopped), 5u);
    cr_expect_eq(kvs_stop_sendable(stops, 2, "a\0b\nxEND", 8, false, &stopped), 3u);
    cr_expect(stopped);
    cr_expect_eq(kvs_stop_sendable(stops, 2, "\0\0\0", 3, false, &stopped), 3u);
    const char *nested[] = {"s", "ters", "x"}; /* the earliest start wins, whatever the order */
    cr_expect_eq(kvs_stop_sendable(nested, 3, "afters", 6, false, &stopped), 2u);
    cr_expect(stopped);
    cr_expect_eq(kvs_stop_sendable(stops, 2, "", 0, false, &stopped), 0u);
    cr_expect(!stopped);
}
