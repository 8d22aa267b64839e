/* libFuzzer target: the pattern compiler (src/grammar/regex.c) through a schema
 * {"type":"string","pattern":P}, differentially against PCRE2.
 *
 * Input: the pattern up to the first NUL byte, then a flags byte (bit 0:
 * minLength and maxLength from the next byte, each 0..15), then the subject.
 *
 * Checks: compiling never crashes and stays within its bounds (a refusal says
 * why and gives no grammar); when the pattern compiles and the subject is
 * UTF-8 without NUL, its JSON text (written by jansson) is accepted iff PCRE2
 * finds a match in the subject (and its code points are within the lengths),
 * where PCRE2 reads the pattern as ECMA-262 does (the oracle is skipped for the
 * few places they differ: POSIX classes, empty classes, a subject with line
 * terminators or non-ASCII white space, a pattern PCRE2 refuses); every prefix of an accepted
 * text is a valid prefix; a pattern refused as matching nothing matches nothing. */
#define _GNU_SOURCE /* memmem */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <jansson.h>
#include <pcre2.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar.h"

static void check(bool ok, const char *what, const char *pattern) {
    if (ok) return;
    fprintf(stderr, "fuzz_regex: %s (pattern '%s')\n", what, pattern);
    abort();
}

/* the code points of UTF-8 s[0..n) (valid: jansson checked it) */
static size_t code_points(const char *s, size_t n) {
    size_t k = 0;
    for (size_t i = 0; i < n; i++) k += ((unsigned char)s[i] & 0xC0) != 0x80;
    return k;
}

/* whether ECMA-262 and PCRE2 (as compiled below) may disagree on this subject: line
 * terminators ('.', $), white space beyond ASCII (\s) */
static bool subject_differs(const char *s, size_t n) {
    static const char *const odd[] = {"\n", "\r", "\xe2\x80\xa8", "\xe2\x80\xa9", "\xc2\xa0", "\xe1\x9a\x80", "\xe2\x80",
                                      "\xe2\x81\x9f", "\xe3\x80\x80", "\xef\xbb\xbf", "\xc2\x85"};
    for (size_t i = 0; i < sizeof odd / sizeof *odd; i++)
        if (memmem(s, n, odd[i], strlen(odd[i]))) return true; /* "\xe2\x80": U+2000..U+203F, broadly */
    return false;
}

/* PCRE2 reading the pattern as ECMA-262 does; NULL where they differ: POSIX classes
 * ([:alpha:] is a set of characters in ECMA-262), an empty class (PCRE2 compiles
 * [] to a failure its quantifier cannot skip: /[]*\/ matches "" in ECMA-262, not in PCRE2) */
static pcre2_code *oracle(const char *pattern, size_t n) {
    if (memmem(pattern, n, "[:", 2) || memmem(pattern, n, "[.", 2) || memmem(pattern, n, "[=", 2) ||
        memmem(pattern, n, "[]", 2))
        return NULL;
    pcre2_compile_context *cc = pcre2_compile_context_create(NULL);
    pcre2_set_newline(cc, PCRE2_NEWLINE_LF);
    pcre2_set_compile_extra_options(cc, PCRE2_EXTRA_ALT_BSUX);
    int err;
    PCRE2_SIZE off;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, n,
                                   PCRE2_UTF | PCRE2_DOLLAR_ENDONLY | PCRE2_ALLOW_EMPTY_CLASS | PCRE2_ALT_BSUX | PCRE2_NEVER_UCP,
                                   &err, &off, cc);
    pcre2_compile_context_free(cc);
    return re;
}

/* 1: a match, 0: none, -1: PCRE2 gave up (its match limit) */
static int search(pcre2_code *re, const char *s, size_t n) {
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
    pcre2_match_context *mc = pcre2_match_context_create(NULL);
    pcre2_set_match_limit(mc, 1000000);
    int rc = pcre2_match(re, (PCRE2_SPTR)s, n, 0, 0, md, mc);
    pcre2_match_context_free(mc);
    pcre2_match_data_free(md);
    return rc >= 0 ? 1 : rc == PCRE2_ERROR_NOMATCH ? 0 : -1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *nul = memchr(data, 0, size);
    size_t plen = nul ? (size_t)(nul - data) : size, at = nul ? plen + 1 : size;
    uint8_t flags = at < size ? data[at++] : 0;
    int lo = 0, hi = -1;
    if ((flags & 1) && at < size) {
        lo = data[at] & 15, hi = data[at] >> 4, at++;
        if (hi < lo) hi = -1;
    }
    json_t *pattern = json_stringn((const char *)data, plen);
    if (!pattern) return 0; /* not UTF-8: no JSON schema can hold it */
    json_t *schema = json_pack("{s:s, s:o}", "type", "string", "pattern", pattern);
    if (flags & 1) {
        json_object_set_new(schema, "minLength", json_integer(lo));
        if (hi >= 0) json_object_set_new(schema, "maxLength", json_integer(hi));
    }
    char *text = json_dumps(schema, JSON_COMPACT);
    json_decref(schema);
    const char *p = (const char *)data; /* for messages: up to its NUL or the input's end */
    char shown[256];
    snprintf(shown, sizeof shown, "%.*s", (int)(plen < 200 ? plen : 200), p);
    /* small bounds: a compile costs at most a few ms, so that the run reaches millions of inputs */
    kvs_grammar_limits lim = {.max_values = 1000, .max_states = 512, .max_transitions = 40000,
                              .max_bytes = (size_t)4 << 20};
    kvs_grammar *g = NULL;
    kvs_status st = kvs_grammar_compile(text, strlen(text), NULL, NULL, &lim, &g);
    free(text);
    bool nothing = false;
    if (st != KVS_OK) {
        check(g == NULL && kvs_last_error()[0], "a refusal without a message, or with a grammar", shown);
        nothing = strstr(kvs_last_error(), "matches the pattern") != NULL;
        if (!nothing) return 0;
    }
    json_t *subject = json_stringn((const char *)data + at, size - at);
    if (!subject || memchr(data + at, 0, size - at)) {
        json_decref(subject);
        kvs_grammar_unref(g);
        return 0;
    }
    const char *s = (const char *)data + at;
    size_t n = size - at, cps = code_points(s, n);
    bool in_length = (int)cps >= lo && (hi < 0 || (int)cps <= hi);
    pcre2_code *re = subject_differs(s, n) ? NULL : oracle(p, plen);
    int want = re ? search(re, s, n) : -1;
    pcre2_code_free(re);
    if (nothing) {
        check(want != 1 || !in_length, "a pattern refused as matching nothing matches (PCRE2)", shown);
        json_decref(subject);
        return 0;
    }
    for (int slash = 0; slash < 2; slash++) {
        char *json = json_dumps(subject, JSON_ENCODE_ANY | (slash ? JSON_ESCAPE_SLASH : 0));
        size_t jn = strlen(json);
        bool complete = false, ok = kvs_grammar_accepts_prefix(g, json, jn, &complete);
        bool got = ok && complete;
        if (want >= 0 && got != (want && in_length)) {
            fprintf(stderr, "fuzz_regex: /%s/ (lengths %d..%d) on %s: the grammar says %d, PCRE2 %d\n", shown, lo, hi, json,
                    got, want && in_length);
            abort();
        }
        if (got) /* about 64 prefixes, so that a long subject costs no more than a short one's square */
            for (size_t k = 0; k < jn; k += jn / 64 + 1) {
                bool c2;
                check(kvs_grammar_accepts_prefix(g, json, k, &c2) && !c2, "a prefix of an accepted text is refused or complete",
                      shown);
            }
        free(json);
    }
    json_decref(subject);
    kvs_grammar_unref(g);
    return 0;
}
