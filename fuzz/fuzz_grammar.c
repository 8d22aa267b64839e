/* libFuzzer target: the grammar engine (src/grammar/) on the bundled model's
 * vocabulary (models/tiny-needle-llama).
 *
 * Input: a JSON schema text up to the first NUL byte (empty: json_object), then
 * a flags byte (bit 0: the tool-call prefix and suffix, for a schema), then bytes that drive
 * a walk: each pair picks a token, the low 15 bits its place among the tokens
 * the mask allows, the high bit a token the mask forbids instead.
 *
 * Checks: compiling never crashes (refusals are fine); every token the mask
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
static int n_tokens;
static int32_t end_id;
static char **bytes;
static size_t *lens;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    tok = fuzz_load_bundled_tokenizer("fuzz_grammar");
    end_id = kvs_tokenizer_eos_id(tok);
    n_tokens = kvs_tokenizer_vocab_size(tok);
    bytes = calloc((size_t)n_tokens, sizeof *bytes);
    lens = calloc((size_t)n_tokens, sizeof *lens);
    for (int id = 0; id < n_tokens; id++) {
        const char *text = kvs_tokenizer_token_text(tok, id);
        size_t cap = text ? strlen(text) : 0;
        bytes[id] = malloc(cap + 1);
        if (kvs_tokenizer_token_bytes(tok, id, bytes[id], cap, &lens[id]) != KVS_OK) abort();
    }
    if (end_id < 0 || kvs_grammar_vocab_create((const char *const *)bytes, lens, n_tokens, &end_id, 1, &vocab) != KVS_OK) {
        fprintf(stderr, "fuzz_grammar: no vocabulary: %s\n", kvs_last_error());
        abort();
    }
    return 0;
}

static void check(bool ok, const char *what) {
    if (ok) return;
    fprintf(stderr, "fuzz_grammar: %s\n", what);
    abort();
}

static bool allowed(const uint32_t *bits, int id) { return bits[id / 32] >> (id % 32) & 1; }

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
    bool tool = at < size && (data[at++] & 1) && schema_len; /* json_object has no prefix or suffix */
    kvs_grammar *g = NULL;
    kvs_status st = schema_len ? kvs_grammar_from_json_schema((const char *)data, schema_len, tool ? PREFIX : NULL,
                                                              tool ? SUFFIX : NULL, &g)
                               : kvs_grammar_json_object(&g);
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
        kvs_grammar_matcher_mask(m, bits);
        bool complete = kvs_grammar_matcher_complete(m);
        check(allowed(bits, end_id) == complete, "the end id is allowed other than when the output is complete");
        if (complete) check_parses(out, out_len, tool);
        int n_ok = 0;
        for (int id = 0; id < n_tokens; id++)
            if (allowed(bits, id)) ok_ids[n_ok++] = id;
        if (pick & 0x8000) { /* a forbidden token is refused and changes nothing */
            int id = (int)((pick & 0x7FFF) % (unsigned)n_tokens);
            if (allowed(bits, id)) continue;
            check(kvs_grammar_matcher_accept(m, id) != KVS_OK, "a token the mask forbids was accepted");
            kvs_grammar_matcher_mask(m, again);
            check(!memcmp(again, bits, (size_t)(n_tokens + 31) / 32 * sizeof *bits), "a refused token changed the mask");
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
