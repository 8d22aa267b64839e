/* The JSON schemas that cost minutes and gigabytes without grammar bounds
 * (issue 47), built as text: for tests/test_grammar_bounds.c (the compiler)
 * and tests/test_server_schemas.c (the server). Each returns malloc'ed text. */
#ifndef KVS_TEST_SCHEMA_BOMBS_H
#define KVS_TEST_SCHEMA_BOMBS_H

#include <criterion/criterion.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

typedef struct {
    char *s;
    size_t n, cap;
} text_buf;

static inline void text_add(text_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static inline void text_add(text_buf *b, const char *fmt, ...) {
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int k = vsnprintf(b->s ? b->s + b->n : NULL, b->s ? b->cap - b->n : 0, fmt, ap);
        va_end(ap);
        if (b->s && b->n + (size_t)k < b->cap) {
            b->n += (size_t)k;
            return;
        }
        b->cap = (b->cap + (size_t)k + 1) * 2;
        b->s = realloc(b->s, b->cap);
        cr_assert(b->s);
    }
}

/* {"type":"object","properties":{"p00000":{"type":"string"}, ...}}: every one optional */
static inline char *bomb_optional_properties(int n) {
    text_buf b = {0};
    text_add(&b, "{\"type\":\"object\",\"properties\":{");
    for (int i = 0; i < n; i++) text_add(&b, "%s\"p%05d\":{\"type\":\"string\"}", i ? "," : "", i);
    text_add(&b, "}}");
    return b.s;
}

/* {"anyOf":[{"anyOf":[{"const":"v0_0"}, ...]}, ...]}: n x n constants */
static inline char *bomb_any_of_any_of(int n) {
    text_buf b = {0};
    text_add(&b, "{\"anyOf\":[");
    for (int i = 0; i < n; i++) {
        text_add(&b, "%s{\"anyOf\":[", i ? "," : "");
        for (int j = 0; j < n; j++) text_add(&b, "%s{\"const\":\"v%d_%d\"}", j ? "," : "", i, j);
        text_add(&b, "]}");
    }
    text_add(&b, "]}");
    return b.s;
}

/* {"enum":["s000000", ...]}: n short strings */
static inline char *bomb_enum(int n) {
    text_buf b = {0};
    text_add(&b, "{\"enum\":[");
    for (int i = 0; i < n; i++) text_add(&b, "%s\"s%06d\"", i ? "," : "", i);
    text_add(&b, "]}");
    return b.s;
}

#endif
