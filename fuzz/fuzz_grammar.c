/* libFuzzer target: the grammar engine (src/grammar/) on a slice of the bundled model's
 * vocabulary (models/tiny-needle-llama).
 *
 * Input: a JSON schema text up to the first NUL byte (empty: json_object), then
 * a flags byte (bit 0: the tool-call prefix and suffix, for a schema; bit 1:
 * compiled within small bounds, bits 2-4 picking them, so that every bound
 * stops compiles and masks somewhere), then bytes that drive a walk: each pair
 * picks a token, the low 15 bits its place among the tokens the mask allows,
 * the high bit a token the mask forbids instead.
 *
 * Checks: compiling never crashes (refusals are fine); a mask past its work
 * bound says so and the walk stops; every token the mask
 * allows is accepted, every one it forbids refused (the matcher unchanged);
 * an end id is allowed exactly when the output is complete, and a complete
 * output parses with jansson. The tokenizer: as fuzz_bundled_tokenizer.h says. */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_bundled_tokenizer.h"
#include "grammar/grammar.h"

#define MAX_STEPS 96
#define PREFIX "<tool_call>\n"
#define SUFFIX "\n</tool_call>"

static kvs_tokenizer *tok;
static kvs_grammar_vocab *vocab;
static kvs_grammar *object_grammar; /* compiled once and shared by every run, as the server shares it */
static int n_tokens;
static int32_t end_id;
static char **bytes;
static size_t *lens;

/* The vocabulary: the first VOCAB_TOKENS tokens of the bundled model (every
 * single byte, then the first merges) and its end token last. The mask costs a
 * walk over the vocabulary's trie each step; a slice of the 8,192 tokens takes
 * every code path (single and multi-byte tokens, the end id) at a rate that
 * makes a ten-million-execution run possible. */
#define VOCAB_TOKENS 1024

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    tok = fuzz_load_bundled_tokenizer("fuzz_grammar");
    int32_t eos = kvs_tokenizer_eos_id(tok), all = kvs_tokenizer_vocab_size(tok);
    if (eos < 0) {
        fprintf(stderr, "fuzz_grammar: the bundled tokenizer has no end token\n");
        abort();
    }
    n_tokens = (all < VOCAB_TOKENS ? all : VOCAB_TOKENS) + 1;
    end_id = n_tokens - 1;
    bytes = calloc((size_t)n_tokens, sizeof *bytes);
    lens = calloc((size_t)n_tokens, sizeof *lens);
    for (int id = 0; id < n_tokens; id++) {
        int32_t from = id == end_id ? eos : id;
        const char *text = kvs_tokenizer_token_text(tok, from);
        size_t cap = text ? strlen(text) : 0;
        bytes[id] = malloc(cap + 1);
        if (kvs_tokenizer_token_bytes(tok, from, bytes[id], cap, &lens[id]) != KVS_OK) abort();
    }
    if (kvs_grammar_vocab_create((const char *const *)bytes, lens, n_tokens, &end_id, 1, &vocab) != KVS_OK) {
        fprintf(stderr, "fuzz_grammar: no vocabulary: %s\n", kvs_last_error());
        abort();
    }
    if (kvs_grammar_json_object(&object_grammar) != KVS_OK) abort();
    return 0;
}

static void check(bool ok, const char *what) {
    if (ok) return;
    fprintf(stderr, "fuzz_grammar: %s\n", what);
    abort();
}

static bool allowed(const uint32_t *bits, int id) { return bits[id / 32] >> (id % 32) & 1; }

/* The harness's own loops over the vocabulary stay out of the coverage
 * instrumentation: its comparison hooks there cost more than the code under test. */
#define HARNESS_LOOP __attribute__((noinline, no_sanitize("coverage")))

/* the ids the mask allows, into ok_ids; their count */
HARNESS_LOOP static int allowed_ids(const uint32_t *bits, int32_t *ok_ids) {
    int n = 0;
    for (int id = 0; id < n_tokens; id++)
        if (allowed(bits, id)) ok_ids[n++] = id;
    return n;
}

HARNESS_LOOP static bool same_mask(const uint32_t *a, const uint32_t *b) {
    return !memcmp(a, b, (size_t)(n_tokens + 31) / 32 * sizeof *a);
}

/* the JSON value between prefix and suffix parses */
static void check_parses(const char *out, size_t n, bool tool) {
    size_t pre = tool ? strlen(PREFIX) : 0, suf = tool ? strlen(SUFFIX) : 0;
    check(n >= pre + suf && !memcmp(out, PREFIX, pre) && !memcmp(out + n - suf, SUFFIX, suf), "prefix or suffix missing");
    json_error_t err;
    json_t *v = json_loadb(out + pre, n - pre - suf, JSON_DECODE_ANY, &err);
    if (!v) fprintf(stderr, "fuzz_grammar: '%.*s': %s\n", (int)n, out, err.text);
    check(v != NULL, "a complete output does not parse");
    json_decref(v);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *nul = memchr(data, 0, size);
    size_t schema_len = nul ? (size_t)(nul - data) : size, at = nul ? schema_len + 1 : size;
    uint8_t flags = at < size ? data[at++] : 0;
    bool tool = (flags & 1) && schema_len; /* json_object has no prefix or suffix */
    unsigned k = (flags >> 2) & 7;
    kvs_grammar_limits lim = {.max_values = 4 + 16 * (int)k, .max_states = 8 + 64 * (int)k,
                              .max_transitions = 16 + 256 * (int)k, .max_bytes = (size_t)(k + 1) << 16,
                              .max_mask_work = 1000 + 20000 * k};
    kvs_grammar *g = NULL;
    kvs_status st = schema_len ? kvs_grammar_compile((const char *)data, schema_len, tool ? PREFIX : NULL,
                                                     tool ? SUFFIX : NULL, flags & 2 ? &lim : NULL, &g)
                               : (g = kvs_grammar_ref(object_grammar), KVS_OK);
    if (st != KVS_OK) {
        check(g == NULL && kvs_last_error()[0], "a refusal without a message, or with a grammar");
        return 0;
    }
    kvs_grammar_matcher *m;
    check(kvs_grammar_matcher_create(g, vocab, &m) == KVS_OK, "matcher_create failed");
    kvs_grammar_unref(g);
    uint32_t *bits = malloc((size_t)(n_tokens + 31) / 32 * sizeof *bits), *again = malloc((size_t)(n_tokens + 31) / 32 * sizeof *again);
    int32_t *ok_ids = malloc((size_t)n_tokens * sizeof *ok_ids);
    char *out = malloc(MAX_STEPS * 256 + 1);
    size_t out_len = 0;
    for (int step = 0; step < MAX_STEPS && at + 1 < size && !kvs_grammar_matcher_ended(m); step++, at += 2) {
        unsigned pick = data[at] | (unsigned)data[at + 1] << 8;
        if (kvs_grammar_matcher_mask(m, bits) != KVS_OK) { /* past the work bound: the request would end here */
            check((flags & 2) && strstr(kvs_last_error(), "bound of"), "a mask failed without its bound");
            break;
        }
        bool complete = kvs_grammar_matcher_complete(m);
        check(allowed(bits, end_id) == complete, "the end id is allowed other than when the output is complete");
        if (complete) check_parses(out, out_len, tool);
        int n_ok = allowed_ids(bits, ok_ids);
        if (pick & 0x8000) { /* a forbidden token is refused and changes nothing */
            int id = (int)((pick & 0x7FFF) % (unsigned)n_tokens);
            if (allowed(bits, id)) continue;
            check(kvs_grammar_matcher_accept(m, id) != KVS_OK, "a token the mask forbids was accepted");
            if (kvs_grammar_matcher_mask(m, again) == KVS_OK) check(same_mask(again, bits), "a refused token changed the mask");
            continue;
        }
        if (n_ok == 0) break; /* cut off (nesting deeper than the limit) */
        int id = ok_ids[pick % (unsigned)n_ok];
        check(kvs_grammar_matcher_accept(m, id) == KVS_OK, "a token the mask allows was refused");
        if (id != end_id && lens[id] <= 256) memcpy(out + out_len, bytes[id], lens[id]), out_len += lens[id];
        check(lens[id] <= 256 || id == end_id, "a token longer than 256 bytes");
    }
    if (kvs_grammar_matcher_ended(m)) check_parses(out, out_len, tool);
    kvs_grammar_matcher_destroy(m);
    free(bits);
    free(again);
    free(ok_ids);
    free(out);
    return 0;
}
