/* grammar bounds (kvs_grammar_limits): the schemas that cost minutes and
 * gigabytes without them (8,000 optional properties, anyOf 300 x 300, an enum
 * of 180,000 strings) are refused naming the bound they pass, well within a
 * second; schemas agents send compile within the default bounds, their first
 * masks too; a mask past its work bound fails naming it; a compile whose
 * cancel flag is set stops; the grammar's bytes are counted. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar.h"
#include "schema_bombs.h"
#include "testutil.h"

/* anyOf of n strings, each of its own length bound: n open alternatives inside a string */
static char *strings_of_lengths(int n) {
    text_buf b = {0};
    text_add(&b, "{\"anyOf\":[");
    for (int i = 0; i < n; i++) text_add(&b, "%s{\"type\":\"string\",\"maxLength\":%d}", i ? "," : "", 20 + i);
    text_add(&b, "]}");
    return b.s;
}

/* compiles with lim; the status, the message into msg, the seconds into *secs */
static kvs_status compile_timed(const char *schema, const kvs_grammar_limits *lim, char *msg, size_t cap,
                                double *secs, kvs_grammar **out) {
    kvs_grammar *g = NULL;
    double t0 = kvs_now();
    kvs_status st = kvs_grammar_compile(schema, strlen(schema), NULL, NULL, lim, &g);
    *secs = kvs_now() - t0;
    snprintf(msg, cap, "%s", st == KVS_OK ? "" : kvs_last_error());
    if (out) *out = g;
    else kvs_grammar_unref(g);
    return st;
}

TestSuite(grammar_bounds, .timeout = 300);

/* The default compile-time bound (0.5 s) stops any compile; a second leaves
 * room for the clock's check interval and a loaded 2-core machine (the issue's
 * figures without bounds: 169 s, 31 s, minutes). */
Test(grammar_bounds, schema_bombs_are_refused_naming_the_bound) {
    struct {
        const char *name;
        char *schema;
    } bombs[] = {
        {"8,000 optional properties", bomb_optional_properties(8000)},
        {"anyOf 300 x 300", bomb_any_of_any_of(300)},
        {"enum of 180,000 strings", bomb_enum(180000)},
    };
    kvs_grammar_limits lim = kvs_grammar_limits_default();
    for (size_t i = 0; i < sizeof bombs / sizeof *bombs; i++) {
        char msg[512];
        double secs;
        kvs_status st = compile_timed(bombs[i].schema, &lim, msg, sizeof msg, &secs, NULL);
        fprintf(stderr, "%s (%zu bytes): refused in %.1f ms: %s\n", bombs[i].name, strlen(bombs[i].schema), secs * 1e3,
                msg);
        cr_expect_eq(st, KVS_ERR_UNSUPPORTED, "%s: %s", bombs[i].name, msg);
        cr_expect(strstr(msg, "bound of"), "%s: the message names no bound: %s", bombs[i].name, msg);
        cr_expect_lt(secs, 1.0 * SLOWDOWN, "%s took %.2f s", bombs[i].name, secs);
        free(bombs[i].schema);
    }
}

/* Patterns that would cost memory or time without bounds (repetitions multiplied
 * out, nested quantifiers, a DFA exponential in a count, a length bound times a
 * long pattern): refused naming the bound, or compiled within the default
 * bounds, each well within a second. */
Test(grammar_bounds, pathological_patterns_are_bounded) {
    static const struct {
        const char *pattern, *extra, *says; /* says NULL: compiles */
    } cases[] = {
        {"(a{1,100}){1,100}", "", "bound of 4096 positions"},
        {"((a{0,20}){0,20}){0,20}", "", "bound of 4096 positions"},
        {"a{0,100000}", "", "bound of 1000"},
        {"x{99999999999}", "", "bound of 1000"},
        {"((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((a))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))", "", "deeper than the bound of 64"},
        {"^[a-z]{1,200}$", ",\"maxLength\":256", "bound of 32768 states"},
        {"[ab]*a[ab]{24}", "", "bound of"}, /* a DFA of 2^24 states */
        {".*a.{30}$", "", "bound of"},
        {"^.{1000}$", "", "bound of"},
        {"(.*){1000}", "", "bound of"},
        {"abc", ",\"maxLength\":256", "bound of"},
        {"[^x]{8}y", ",\"minLength\":2,\"maxLength\":32", "bound of"},
        {"(a*)*b", "", NULL},
        {"((a+)+)+$", "", NULL},
        {"(a|a)*(a|aa)*c", "", NULL},
        {"(a|b|c)*d(a|b|c){10}", "", NULL},
        {"(.*){300}", "", NULL},
        {"^.{200}$", "", NULL},
        {"abc", ",\"maxLength\":64", NULL},
        {"^(\\\\d{1,3}\\\\.){3}\\\\d{1,3}$", ",\"maxLength\":15", NULL},
        {"^[a-zA-Z0-9_-]{3,32}$", ",\"maxLength\":32", NULL},
    };
    kvs_grammar_limits lim = kvs_grammar_limits_default();
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char schema[1024], msg[512];
        double secs;
        snprintf(schema, sizeof schema, "{\"type\":\"string\",\"pattern\":\"%s\"%s}", cases[i].pattern, cases[i].extra);
        kvs_status st = compile_timed(schema, &lim, msg, sizeof msg, &secs, NULL);
        fprintf(stderr, "pattern %s%s: %s in %.1f ms%s%s\n", cases[i].pattern, cases[i].extra, st == KVS_OK ? "compiled" : "refused",
                secs * 1e3, st == KVS_OK ? "" : ": ", msg);
        if (cases[i].says) {
            cr_expect_eq(st, KVS_ERR_UNSUPPORTED, "%s: %s", schema, msg);
            cr_expect(strstr(msg, cases[i].says), "%s: '%s' does not say '%s'", schema, msg, cases[i].says);
        } else {
            cr_expect_eq(st, KVS_OK, "%s: %s", schema, msg);
        }
        cr_expect_lt(secs, 1.0 * SLOWDOWN, "%s took %.2f s", schema, secs);
    }
    /* an email as agents bound it (RFC 5321's 254) */
    char msg[512];
    double secs;
    const char *email = "{\"type\":\"string\",\"format\":\"email\",\"maxLength\":254}";
    cr_expect_eq(compile_timed(email, &lim, msg, sizeof msg, &secs, NULL), KVS_OK, "%s", msg);
    fprintf(stderr, "%s: compiled in %.1f ms\n", email, secs * 1e3);
    cr_expect_lt(secs, 1.0 * SLOWDOWN);
}

/* Each bound on its own, on a schema that passes only it: the message names it. */
Test(grammar_bounds, each_bound_named) {
    char *props = bomb_optional_properties(200), msg[512];
    double secs;
    struct {
        kvs_grammar_limits lim;
        const char *says;
    } cases[] = {
        {{.max_values = 100}, "bound of 100 JSON values"},
        {{.max_states = 100}, "bound of 100 states"},
        {{.max_transitions = 1000}, "bound of 1000 transitions"},
        {{.max_bytes = 1 << 20}, "bound of 1 MiB"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        cr_expect_eq(compile_timed(props, &cases[i].lim, msg, sizeof msg, &secs, NULL), KVS_ERR_UNSUPPORTED);
        cr_expect(strstr(msg, cases[i].says), "'%s' does not say '%s'", msg, cases[i].says);
    }
    free(props);
    char *big = bomb_optional_properties(4000); /* seconds without bounds */
    kvs_grammar_limits slow = {.max_seconds = 0.05};
    cr_expect_eq(compile_timed(big, &slow, msg, sizeof msg, &secs, NULL), KVS_ERR_UNSUPPORTED);
    cr_expect(strstr(msg, "longer than the bound of 50 ms"), "%s", msg);
    cr_expect_lt(secs, 1.0 * SLOWDOWN, "a 50 ms bound stopped the compile after %.2f s", secs);
    atomic_bool cancel;
    atomic_init(&cancel, true);
    kvs_grammar_limits cancelled = {.cancel = &cancel};
    cr_expect_eq(compile_timed(big, &cancelled, msg, sizeof msg, &secs, NULL), KVS_ERR_BUSY);
    cr_expect(strstr(msg, "cancelled"), "%s", msg);
    cr_expect_lt(secs, 1.0 * SLOWDOWN);
    free(big);
}

static kvs_grammar_vocab *bundled_vocab(kvs_tokenizer **tok) {
    cr_assert_eq(kvs_tokenizer_load(src_path("models/tiny-needle-llama"), tok), KVS_OK, "%s", kvs_last_error());
    int32_t eos = kvs_tokenizer_eos_id(*tok);
    kvs_grammar_vocab *v;
    cr_assert_eq(kvs_grammar_vocab_from_tokenizer(*tok, &eos, 1, &v), KVS_OK, "%s", kvs_last_error());
    return v;
}

/* What agents send (the shapes of tests/test_grammar.c, tests/test_server_tools.c and
 * tests/openai/basic.mjs): compiled within the default bounds, first masks too. */
Test(grammar_bounds, agent_schemas_fit_the_default_bounds) {
    static const char *const schemas[] = {
        "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\"}},"
        "\"required\":[\"name\",\"age\"],\"additionalProperties\":false}",
        "{\"type\":\"object\",\"properties\":{\"location\":{\"type\":\"string\",\"description\":\"City and country\"},"
        "\"unit\":{\"type\":\"string\",\"enum\":[\"celsius\",\"fahrenheit\"]}},\"required\":[\"location\"]}",
        "{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"value\":{\"type\":\"integer\"},"
        "\"children\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/node\"},\"maxItems\":3}},"
        "\"required\":[\"value\"]}},\"$ref\":\"#/$defs/node\"}",
        "{\"type\":\"object\",\"properties\":{\"query\":{\"type\":\"string\",\"maxLength\":256},"
        "\"filters\":{\"type\":\"array\",\"items\":{\"type\":\"object\",\"properties\":{\"field\":{\"type\":\"string\"},"
        "\"op\":{\"enum\":[\"eq\",\"ne\",\"lt\",\"gt\",\"in\"]},\"value\":{\"type\":[\"string\",\"number\",\"boolean\",\"null\"]}},"
        "\"required\":[\"field\",\"op\",\"value\"]},\"maxItems\":16},\"limit\":{\"type\":\"integer\",\"minimum\":1},"
        "\"sort\":{\"anyOf\":[{\"const\":\"asc\"},{\"const\":\"desc\"}]}},\"required\":[\"query\"]}",
    };
    kvs_tokenizer *tok;
    kvs_grammar_vocab *v = bundled_vocab(&tok);
    kvs_grammar_limits lim = kvs_grammar_limits_default();
    for (size_t i = 0; i < sizeof schemas / sizeof *schemas; i++) {
        char msg[512];
        double secs;
        kvs_grammar *g;
        cr_assert_eq(compile_timed(schemas[i], &lim, msg, sizeof msg, &secs, &g), KVS_OK, "schema %zu: %s", i, msg);
        double t0 = kvs_now();
        cr_expect_eq(kvs_grammar_warm(g, v), KVS_OK, "schema %zu: %s", i, kvs_last_error());
        fprintf(stderr, "agent schema %zu: compiled in %.2f ms, first masks in %.2f ms, %zu bytes\n", i, secs * 1e3,
                (kvs_now() - t0) * 1e3, kvs_grammar_bytes(g));
        kvs_grammar_unref(g);
    }
    kvs_grammar_vocab_destroy(v);
    kvs_tokenizer_destroy(tok);
}

/* 10 strings of different length bounds: inside the string every mask walks
 * the vocabulary with 10 stacks (about 800,000 steps); a bound of 100,000 steps
 * refuses the schema at its warm-up, and a matcher's mask past it fails. */
Test(grammar_bounds, mask_work_is_bounded) {
    kvs_tokenizer *tok;
    kvs_grammar_vocab *v = bundled_vocab(&tok);
    char *schema = strings_of_lengths(10), msg[512];
    double secs;
    kvs_grammar_limits lim = kvs_grammar_limits_default();
    lim.max_mask_work = 100000;
    kvs_grammar *g;
    cr_assert_eq(compile_timed(schema, &lim, msg, sizeof msg, &secs, &g), KVS_OK, "%s", msg);
    cr_expect_eq(kvs_grammar_warm(g, v), KVS_ERR_UNSUPPORTED);
    cr_expect(strstr(kvs_last_error(), "bound of 100000 matcher steps"), "%s", kvs_last_error());
    kvs_grammar_matcher *m;
    cr_assert_eq(kvs_grammar_matcher_create(g, v, &m), KVS_OK);
    uint32_t *bits = calloc((size_t)(kvs_grammar_vocab_size(v) + 31) / 32, sizeof *bits);
    kvs_status st = KVS_OK;
    for (int k = 0; k < 4 && st == KVS_OK; k++) { /* the opening quote, then inside the string */
        st = kvs_grammar_matcher_mask(m, bits);
        int pick = -1;
        for (int id = 0; st == KVS_OK && pick < 0 && id < kvs_grammar_vocab_size(v); id++)
            if (bits[id / 32] >> (id % 32) & 1) pick = id;
        if (st == KVS_OK) cr_assert_eq(kvs_grammar_matcher_accept(m, pick), KVS_OK);
    }
    cr_expect_eq(st, KVS_ERR_UNSUPPORTED, "no mask passed the bound");
    kvs_grammar_matcher_destroy(m);
    size_t before = kvs_grammar_bytes(g);
    kvs_grammar_unref(g);
    /* without the mask bound the same grammar serves its masks, which its bytes then count */
    lim.max_mask_work = 0;
    cr_assert_eq(compile_timed(schema, &lim, msg, sizeof msg, &secs, &g), KVS_OK, "%s", msg);
    size_t compiled = kvs_grammar_bytes(g);
    cr_expect_eq(kvs_grammar_warm(g, v), KVS_OK, "%s", kvs_last_error());
    cr_expect_gt(kvs_grammar_bytes(g), compiled, "the masks cached by the warm-up are not counted");
    cr_expect_gt(before, 0);
    kvs_grammar_unref(g);
    free(bits);
    free(schema);
    kvs_grammar_vocab_destroy(v);
    kvs_tokenizer_destroy(tok);
}

/* anyOf 600 constants: the first state holds more alternatives than a state
 * keeps (512); the warm-up refuses instead of cutting some silently. */
Test(grammar_bounds, too_many_open_alternatives_refused) {
    text_buf b = {0};
    text_add(&b, "{\"anyOf\":[");
    for (int i = 0; i < 600; i++)
        text_add(&b, "%s{\"type\":\"object\",\"properties\":{\"k%d\":{\"const\":%d}}}", i ? "," : "", i, i);
    text_add(&b, "]}");
    kvs_tokenizer *tok;
    kvs_grammar_vocab *v = bundled_vocab(&tok);
    kvs_grammar_limits lim = kvs_grammar_limits_default();
    kvs_grammar *g;
    char msg[512];
    double secs;
    cr_assert_eq(compile_timed(b.s, &lim, msg, sizeof msg, &secs, &g), KVS_OK, "%s", msg);
    cr_expect_eq(kvs_grammar_warm(g, v), KVS_ERR_UNSUPPORTED);
    cr_expect(strstr(kvs_last_error(), "alternatives"), "%s", kvs_last_error());
    kvs_grammar_unref(g);
    free(b.s);
    kvs_grammar_vocab_destroy(v);
    kvs_tokenizer_destroy(tok);
}
