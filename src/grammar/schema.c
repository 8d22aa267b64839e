/* grammar from a JSON schema: each schema a rule (an NFA of bytes, epsilons and
 * calls of the rules of its parts), the strings, numbers and "any value" rules
 * shared; a $ref's rule by its target (any JSON pointer), so recursion is a
 * call like any other; a pattern's (or a format's) string a rule of its own
 * (regex.c). The subset and the one way values are written: grammar.h. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar_internal.h"

#define MAX_COUNT 256     /* minItems, maxItems, minLength, maxLength */
#define MAX_NESTING 64    /* schemas inside schemas (not counting $ref) */

typedef struct {
    gr_nfa **rules;
    int n_rules, cap_rules;
    json_t *root;
    json_t *refs;     /* a $ref's target (its address, as text) -> rule id */
    json_t *patterns; /* "lo:hi:" + a pattern -> the rule of its string */
    int r_string, r_integer, r_number, r_any;
    int nesting;
    bool oom;          /* out of memory, or past the budget (then budget.code says which bound) */
    gr_budget *budget; /* NULL: no bounds */
} builder;

/* ---- NFA helpers: out of memory is remembered and reported once ---------------------- */
static gr_nfa *nfa(builder *b, int r) { return b->rules[r]; }
static int state(builder *b, int r) {
    int s = gr_nfa_state(nfa(b, r));
    if (s < 0) b->oom = true;
    return s < 0 ? 0 : s;
}
static void eps(builder *b, int r, int x, int y) { b->oom |= !gr_nfa_eps(nfa(b, r), x, y); }
static void range(builder *b, int r, int x, int lo, int hi, int y) { b->oom |= !gr_nfa_bytes(nfa(b, r), x, (uint8_t)lo, (uint8_t)hi, y); }
static void call(builder *b, int r, int x, int rule, int y) { b->oom |= !gr_nfa_call(nfa(b, r), x, rule, y); }
static int call_new(builder *b, int r, int x, int rule) {
    int y = state(b, r);
    call(b, r, x, rule, y);
    return y;
}
static int lit(builder *b, int r, int x, const char *s, size_t n) {
    for (size_t i = 0; i < n; i++) {
        int y = state(b, r);
        range(b, r, x, (uint8_t)s[i], (uint8_t)s[i], y);
        x = y;
    }
    return x;
}
static int lit_str(builder *b, int r, int x, const char *s) { return lit(b, r, x, s, strlen(s)); }
/* at most one space */
static int ws(builder *b, int r, int x) {
    int y = state(b, r);
    eps(b, r, x, y);
    range(b, r, x, ' ', ' ', y);
    return y;
}
static void chars(builder *b, int r, int x, const char *set, int y) {
    for (; *set; set++) range(b, r, x, (uint8_t)*set, (uint8_t)*set, y);
}

static kvs_status new_rule(builder *b, int *r) {
    if (b->n_rules == b->cap_rules) {
        int cap = b->cap_rules ? b->cap_rules * 2 : 16;
        gr_nfa **nr = realloc(b->rules, (size_t)cap * sizeof *nr);
        if (!nr) return kvs_fail(KVS_ERR_NOMEM, "grammar: out of memory");
        b->rules = nr;
        b->cap_rules = cap;
    }
    gr_nfa *a = calloc(1, sizeof *a);
    if (!a) return kvs_fail(KVS_ERR_NOMEM, "grammar: out of memory");
    a->budget = b->budget;
    if (!gr_budget_bytes(b->budget, sizeof *a)) b->oom = true;
    b->rules[*r = b->n_rules++] = a;
    a->start = gr_nfa_state(a);
    a->final = gr_nfa_state(a);
    if (a->start < 0 || a->final < 0) b->oom = true, a->start = a->final = 0;
    return KVS_OK;
}

/* ---- strings: one code point (raw UTF-8 or an escape jansson accepts) ------------------ */
static void utf8_char(builder *b, int r, int x, int y) {
    int c1 = state(b, r), c2 = state(b, r), c3 = state(b, r), e0 = state(b, r), ed = state(b, r), f0 = state(b, r),
        f4 = state(b, r);
    range(b, r, x, 0x20, 0x21, y);
    range(b, r, x, 0x23, 0x5B, y);
    range(b, r, x, 0x5D, 0x7F, y);
    range(b, r, x, 0xC2, 0xDF, c1);
    range(b, r, x, 0xE0, 0xE0, e0);
    range(b, r, x, 0xE1, 0xEC, c2);
    range(b, r, x, 0xED, 0xED, ed);
    range(b, r, x, 0xEE, 0xEF, c2);
    range(b, r, x, 0xF0, 0xF0, f0);
    range(b, r, x, 0xF1, 0xF3, c3);
    range(b, r, x, 0xF4, 0xF4, f4);
    range(b, r, c3, 0x80, 0xBF, c2);
    range(b, r, c2, 0x80, 0xBF, c1);
    range(b, r, c1, 0x80, 0xBF, y);
    range(b, r, e0, 0xA0, 0xBF, c1);
    range(b, r, ed, 0x80, 0x9F, c1);
    range(b, r, f0, 0x90, 0xBF, c2);
    range(b, r, f4, 0x80, 0x8F, c2);
}

/* \X or \uXXXX: not \u0000, a high surrogate only with its low one */
#define HEX "0123456789ABCDEFabcdef"
#define HEX_NONZERO "123456789ABCDEFabcdef"
static void escape_char(builder *b, int r, int x, int y) {
    int e = state(b, r), u = state(b, r), h1 = state(b, r), h2 = state(b, r), h3 = state(b, r), z1 = state(b, r),
        z2 = state(b, r), z3 = state(b, r), d1 = state(b, r), p2 = state(b, r), p3 = state(b, r), p4 = state(b, r),
        p5 = state(b, r), p6 = state(b, r), l1 = state(b, r);
    chars(b, r, x, "\\", e);
    chars(b, r, e, "\"\\/bfnrt", y);
    chars(b, r, e, "u", u);
    chars(b, r, h1, HEX, y); /* h1..h3: that many hex digits left */
    chars(b, r, h2, HEX, h1);
    chars(b, r, h3, HEX, h2);
    chars(b, r, u, "0", z1); /* z1..z3: zeros so far, a non-zero digit still due */
    chars(b, r, u, "123456789ABCEFabcef", h3);
    chars(b, r, u, "Dd", d1);
    chars(b, r, z1, "0", z2);
    chars(b, r, z1, HEX_NONZERO, h2);
    chars(b, r, z2, "0", z3);
    chars(b, r, z2, HEX_NONZERO, h1);
    chars(b, r, z3, HEX_NONZERO, y);
    chars(b, r, d1, "01234567", h2); /* D800..DBFF: a high surrogate, then \uDC00..\uDFFF */
    chars(b, r, d1, "89ABab", p2);
    chars(b, r, p2, HEX, p3);
    chars(b, r, p3, HEX, p4);
    chars(b, r, p4, "\\", p5);
    chars(b, r, p5, "u", p6);
    chars(b, r, p6, "Dd", l1);
    chars(b, r, l1, "CDEFcdef", h2);
}

static void one_char(builder *b, int r, int x, int y) {
    utf8_char(b, r, x, y);
    escape_char(b, r, x, y);
}

/* ---- the shared rules -------------------------------------------------------------------- */
static kvs_status string_rule(builder *b, int *out) {
    if (b->r_string < 0) {
        int r;
        KVS_TRY(new_rule(b, &r));
        int loop = lit_str(b, r, nfa(b, r)->start, "\"");
        one_char(b, r, loop, loop);
        range(b, r, loop, '"', '"', nfa(b, r)->final);
        b->r_string = r;
    }
    *out = b->r_string;
    return KVS_OK;
}

static int char_new(builder *b, int r, int x) {
    int y = state(b, r);
    one_char(b, r, x, y);
    return y;
}

/* up to n digits after x (at least one); returns the state after them */
static int digits(builder *b, int r, int x, int lo, int n) {
    int end = state(b, r);
    for (int i = 0; i < n; i++) {
        int y = state(b, r);
        range(b, r, x, i ? '0' : lo, '9', y);
        eps(b, r, y, end);
        x = y;
    }
    return end;
}

/* -?(0|[1-9][0-9]{0,17}) then, for a number, (.[0-9]{1,15})?([eE][+-]?[0-9]{1,2})? */
static kvs_status number_rule(builder *b, bool real, int *out) {
    int *have = real ? &b->r_number : &b->r_integer;
    if (*have < 0) {
        int r;
        KVS_TRY(new_rule(b, &r));
        int x = nfa(b, r)->start, sign = state(b, r), in = state(b, r);
        eps(b, r, x, sign);
        range(b, r, x, '-', '-', sign);
        range(b, r, sign, '0', '0', in);
        eps(b, r, digits(b, r, sign, '1', 18), in);
        int end = nfa(b, r)->final;
        eps(b, r, in, end);
        if (real) {
            int frac = digits(b, r, lit_str(b, r, in, "."), '0', 15), e = state(b, r), es = state(b, r);
            eps(b, r, frac, end);
            range(b, r, in, 'e', 'e', e);
            range(b, r, in, 'E', 'E', e);
            range(b, r, frac, 'e', 'e', e);
            range(b, r, frac, 'E', 'E', e);
            eps(b, r, e, es);
            range(b, r, e, '+', '+', es);
            range(b, r, e, '-', '-', es);
            eps(b, r, digits(b, r, es, '0', 2), end);
        }
        *have = r;
    }
    *out = *have;
    return KVS_OK;
}

/* '{' (key ':' ws value (',' ws key ':' ws value)*)? '}' with keys any string */
static int map_of(builder *b, int r, int x, int key_rule, int value_rule) {
    int open = lit_str(b, r, x, "{"), end = state(b, r), item = state(b, r);
    range(b, r, open, '}', '}', end);
    eps(b, r, open, item);
    int after = call_new(b, r, ws(b, r, lit_str(b, r, call_new(b, r, item, key_rule), ":")), value_rule);
    range(b, r, after, '}', '}', end);
    eps(b, r, ws(b, r, lit_str(b, r, after, ",")), item);
    return end;
}

/* '[' (value (',' ws value)*)? ']' */
static int list_of(builder *b, int r, int x, int value_rule) {
    int open = lit_str(b, r, x, "["), end = state(b, r);
    range(b, r, open, ']', ']', end);
    int after = call_new(b, r, open, value_rule);
    range(b, r, after, ']', ']', end);
    call(b, r, ws(b, r, lit_str(b, r, after, ",")), value_rule, after);
    return end;
}

/* any JSON value; object_only: any JSON object */
static kvs_status any_rule(builder *b, int *out) {
    if (b->r_any < 0) {
        int r, s, n;
        KVS_TRY(new_rule(b, &r));
        b->r_any = r;
        KVS_TRY(string_rule(b, &s));
        KVS_TRY(number_rule(b, true, &n));
        int x = nfa(b, r)->start, end = nfa(b, r)->final;
        eps(b, r, map_of(b, r, x, s, r), end);
        eps(b, r, list_of(b, r, x, r), end);
        call(b, r, x, s, end);
        call(b, r, x, n, end);
        for (const char *const *w = (const char *const[]){"true", "false", "null", NULL}; *w; w++)
            eps(b, r, lit_str(b, r, x, *w), end);
    }
    *out = b->r_any;
    return KVS_OK;
}

/* ---- schemas ----------------------------------------------------------------------------- */
static const char *const supported[] = {
    "type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems", "enum", "const",
    "minLength", "maxLength", "pattern", "format", "anyOf", "oneOf", "$ref", "$defs", "definitions",
    /* accepted, not enforced */
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    /* ignored */
    "description", "title", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
    "writeOnly", "strict", NULL};

static kvs_status rule_of(builder *b, json_t *s, const char *path, int *rule);
static kvs_status value(builder *b, int r, int x, json_t *s, const char *path, int *to);

static kvs_status check_keywords(json_t *s, const char *path) {
    const char *k;
    json_t *v;
    json_object_foreach(s, k, v) {
        const char *const *w = supported;
        while (*w && strcmp(*w, k)) w++;
        if (!*w) return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: '%.64s' is not supported", path, k);
    }
    return KVS_OK;
}

/* an integer keyword in [0, MAX_COUNT], dflt when absent */
static kvs_status count(json_t *s, const char *key, const char *path, int dflt, int *out) {
    json_t *v = json_object_get(s, key);
    *out = dflt;
    if (!v) return KVS_OK;
    if (!json_is_integer(v) || json_integer_value(v) < 0)
        return kvs_fail(KVS_ERR_INVALID, "%s.%s must be a non-negative integer", path, key);
    if (json_integer_value(v) > MAX_COUNT)
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s.%s above %d is not supported", path, key, MAX_COUNT);
    *out = (int)json_integer_value(v);
    return KVS_OK;
}

static kvs_status bounds(json_t *s, const char *lo_key, const char *hi_key, const char *path, int *lo, int *hi) {
    KVS_TRY(count(s, lo_key, path, 0, lo));
    KVS_TRY(count(s, hi_key, path, -1, hi));
    if (*hi >= 0 && *hi < *lo) return kvs_fail(KVS_ERR_INVALID, "%s: %s is below %s", path, hi_key, lo_key);
    return KVS_OK;
}

/* the literal JSON text of v (compact, as jansson writes it) */
static int literal(builder *b, int r, int x, json_t *v, const char *path, kvs_status *st) {
    char *text = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!text) {
        *st = kvs_fail(KVS_ERR_INVALID, "%s: a value that cannot be written as JSON", path);
        return x;
    }
    int y = lit_str(b, r, x, text);
    free(text);
    return y;
}

/* "<name>": the property name as jansson writes it */
static int key_literal(builder *b, int r, int x, const char *name, kvs_status *st) {
    json_t *k = json_string(name);
    int y = k ? literal(b, r, x, k, "key", st) : x;
    if (!k) *st = kvs_fail(KVS_ERR_NOMEM, "grammar: out of memory");
    json_decref(k);
    return y;
}

/* The formats enforced, as patterns (regex.c); any other format is an annotation. */
static const struct {
    const char *name, *pattern;
} formats[] = {
#define DATE "\\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\\d|3[01])"
#define TIME "([01]\\d|2[0-3]):[0-5]\\d:([0-5]\\d|60)(\\.\\d+)?([Zz]|[+-]([01]\\d|2[0-3]):[0-5]\\d)"
#define LABEL "[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
#define OCTET "(25[0-5]|2[0-4]\\d|1\\d\\d|[1-9]?\\d)"
#define ATEXT "[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]"
    {"date", "^" DATE "$"},
    {"time", "^" TIME "$"},
    {"date-time", "^" DATE "[Tt]" TIME "$"},
    {"uuid", "^[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}$"},
    {"email", "^" ATEXT "+(\\." ATEXT "+)*@[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)+$"},
    {"ipv4", "^" OCTET "(\\." OCTET "){3}$"},
    {"hostname", "^" LABEL "(\\." LABEL ")*$"},
#undef DATE
#undef TIME
#undef LABEL
#undef OCTET
#undef ATEXT
};

/* a string whose content matches the pattern re[0..n), lo..hi code points long: a rule
   of its own (the quotes and the pattern), shared by the strings of the same pattern and bounds */
static kvs_status pattern_value(builder *b, int r, int x, const char *re, size_t n, int lo, int hi, const char *where, int *to) {
    char head[32];
    int hl = snprintf(head, sizeof head, "%d:%d:", lo, hi);
    char *key = malloc((size_t)hl + n + 1);
    if (!key) return kvs_fail(KVS_ERR_NOMEM, "grammar: out of memory");
    memcpy(key, head, (size_t)hl);
    memcpy(key + hl, re, n);
    json_t *have = json_object_getn(b->patterns, key, (size_t)hl + n);
    int rule = have ? (int)json_integer_value(have) : -1;
    kvs_status st = KVS_OK;
    if (rule < 0 && (st = new_rule(b, &rule)) == KVS_OK) {
        int q = lit_str(b, rule, nfa(b, rule)->start, "\""), e = state(b, rule);
        st = gr_regex(nfa(b, rule), q, e, re, n, lo, hi, where);
        if (st == KVS_OK) eps(b, rule, lit_str(b, rule, e, "\""), nfa(b, rule)->final);
        if (st == KVS_OK && json_object_setn_new(b->patterns, key, (size_t)hl + n, json_integer(rule)))
            st = kvs_fail(KVS_ERR_NOMEM, "grammar: out of memory");
    }
    free(key);
    if (st == KVS_OK) *to = call_new(b, r, x, rule);
    return st;
}

static kvs_status string_value(builder *b, int r, int x, json_t *s, const char *path, int *to) {
    int lo, hi, c;
    KVS_TRY(bounds(s, "minLength", "maxLength", path, &lo, &hi));
    json_t *pattern = json_object_get(s, "pattern"), *format = json_object_get(s, "format");
    char where[600];
    if (pattern && !json_is_string(pattern)) return kvs_fail(KVS_ERR_INVALID, "%s.pattern must be a string", path);
    if (format && !json_is_string(format)) return kvs_fail(KVS_ERR_INVALID, "%s.format must be a string", path);
    if (pattern) {
        snprintf(where, sizeof where, "%s.pattern", path);
        return pattern_value(b, r, x, json_string_value(pattern), json_string_length(pattern), lo, hi, where, to);
    }
    for (size_t i = 0; format && i < sizeof formats / sizeof *formats; i++)
        if (!strcmp(json_string_value(format), formats[i].name)) {
            snprintf(where, sizeof where, "%s.format '%s'", path, formats[i].name);
            return pattern_value(b, r, x, formats[i].pattern, strlen(formats[i].pattern), lo, hi, where, to);
        }
    if (lo == 0 && hi < 0) {
        KVS_TRY(string_rule(b, &c));
        *to = call_new(b, r, x, c);
        return KVS_OK;
    }
    /* the characters inline (not calls of a rule of one character), so that each
       position's node decides most tokens without the stack (vocab.c's tables) */
    x = lit_str(b, r, x, "\"");
    for (int i = 0; i < lo; i++) x = char_new(b, r, x);
    int end = state(b, r);
    eps(b, r, x, end);
    if (hi < 0) one_char(b, r, x, x);
    for (int i = lo; i < hi; i++) {
        x = char_new(b, r, x);
        eps(b, r, x, end);
    }
    *to = lit_str(b, r, end, "\"");
    return KVS_OK;
}

static kvs_status array_value(builder *b, int r, int x, json_t *s, const char *path, int *to) {
    int lo, hi, item;
    char sub[512];
    KVS_TRY(bounds(s, "minItems", "maxItems", path, &lo, &hi));
    json_t *items = json_object_get(s, "items");
    snprintf(sub, sizeof sub, "%s.items", path);
    if (items) KVS_TRY(rule_of(b, items, sub, &item));
    else KVS_TRY(any_rule(b, &item));
    int open = lit_str(b, r, x, "["), end = state(b, r);
    *to = lit_str(b, r, end, "]");
    if (lo == 0) eps(b, r, open, end);
    if (hi == 0) return KVS_OK;
    x = call_new(b, r, open, item);
    for (int n = 1;; n++) {
        if (n >= lo) eps(b, r, x, end);
        if (hi >= 0 && n == hi) break;
        int sep = ws(b, r, lit_str(b, r, x, ","));
        if (hi < 0 && n >= lo) {
            call(b, r, sep, item, x);
            break;
        }
        x = call_new(b, r, sep, item);
    }
    return KVS_OK;
}

/* exactly the listed properties in order: the required ones, any of the optional ones */
static kvs_status object_value(builder *b, int r, int x, json_t *s, const char *path, int *to) {
    json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required");
    json_t *extra = json_object_get(s, "additionalProperties");
    char sub[512];
    if (props && !json_is_object(props)) return kvs_fail(KVS_ERR_INVALID, "%s.properties must be an object", path);
    if (req && !json_is_array(req)) return kvs_fail(KVS_ERR_INVALID, "%s.required must be an array", path);
    if (extra && !json_is_boolean(extra) && !json_is_object(extra))
        return kvs_fail(KVS_ERR_INVALID, "%s.additionalProperties must be a boolean or a schema", path);
    size_t n = props ? json_object_size(props) : 0;
    json_t *req_names = json_object(); /* the required names, looked up once per property */
    if (!req_names) return kvs_fail(KVS_ERR_NOMEM, "grammar: out of memory");
    for (size_t i = 0; req && i < json_array_size(req); i++) {
        json_t *name = json_array_get(req, i);
        kvs_status bad = KVS_OK;
        if (!json_is_string(name)) bad = kvs_fail(KVS_ERR_INVALID, "%s.required[%zu] must be a string", path, i);
        else if (!json_object_get(props, json_string_value(name)))
            bad = kvs_fail(KVS_ERR_INVALID, "%s.required[%zu]: '%.64s' is not in properties", path, i, json_string_value(name));
        else if (json_object_set(req_names, json_string_value(name), json_true()))
            bad = kvs_fail(KVS_ERR_NOMEM, "grammar: out of memory");
        if (bad != KVS_OK) {
            json_decref(req_names);
            return bad;
        }
    }
    if (n == 0 && !json_is_false(extra)) { /* a map: any keys, values of additionalProperties (or any) */
        int key, value;
        json_decref(req_names);
        KVS_TRY(string_rule(b, &key));
        snprintf(sub, sizeof sub, "%s.additionalProperties", path);
        if (json_is_object(extra)) KVS_TRY(rule_of(b, extra, sub, &value));
        else KVS_TRY(any_rule(b, &value));
        *to = map_of(b, r, x, key, value);
        return KVS_OK;
    }
    bool *required = calloc(n + 1, sizeof *required);
    int *key_start = malloc((n + 1) * sizeof *key_start), *after = malloc((n + 1) * sizeof *after);
    kvs_status st = required && key_start && after ? KVS_OK : kvs_fail(KVS_ERR_NOMEM, "grammar: out of memory");
    int open = lit_str(b, r, x, "{"), end = state(b, r);
    const char *name;
    json_t *ps;
    size_t i = 0;
    json_object_foreach(props, name, ps) {
        if (st != KVS_OK || b->oom) break;
        required[i] = json_object_get(req_names, name) != NULL;
        int value;
        snprintf(sub, sizeof sub, "%s.properties.%s", path, name);
        st = rule_of(b, ps, sub, &value);
        if (st != KVS_OK) break;
        key_start[i] = state(b, r);
        int colon = lit_str(b, r, key_literal(b, r, key_start[i], name, &st), ":");
        after[i] = call_new(b, r, ws(b, r, colon), value);
        i++;
    }
    /* a chain deciding each property in turn: "first" while none has been written
       (no comma before the next), "more" after one; an optional one may be
       skipped, so each step costs a few states and edges whatever follows */
    int first = open, more = -1;
    for (size_t q = 0; st == KVS_OK && q < n; q++) {
        int first_next = state(b, r), more_next = state(b, r);
        eps(b, r, first, key_start[q]);
        if (more >= 0) eps(b, r, ws(b, r, lit_str(b, r, more, ",")), key_start[q]);
        eps(b, r, after[q], more_next);
        if (!required[q]) {
            eps(b, r, first, first_next);
            if (more >= 0) eps(b, r, more, more_next);
        }
        first = first_next, more = more_next;
    }
    eps(b, r, first, end); /* reachable only when no property is required */
    if (more >= 0) eps(b, r, more, end);
    *to = lit_str(b, r, end, "}");
    free(required), free(key_start), free(after);
    json_decref(req_names);
    return st;
}

/* The value a reference inside the schema points at: '#' then a JSON pointer
 * (RFC 6901: '/'-separated names, ~1 for '/', ~0 for '~', array indexes in
 * decimal), percent-encoded as a URI fragment (RFC 3986). NULL in *target
 * when nothing is there; its path ("schema.$defs.node") into where. */
static kvs_status resolve_ref(builder *b, const char *text, const char *path, json_t **target, char *where, size_t cap) {
    *target = NULL;
    if (text[0] != '#')
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s.$ref: '%.64s' is not supported (only references inside the schema: '#' or '#/a/json/pointer')",
                        path, text);
    size_t n = strlen(text + 1), len = 0;
    char *ptr = malloc(n + 1);
    if (!ptr) return kvs_fail(KVS_ERR_NOMEM, "grammar: out of memory");
    for (const char *c = text + 1; *c; c++) { /* percent-decoding */
        int h1, h2;
        if (*c != '%') {
            ptr[len++] = *c;
            continue;
        }
        h1 = c[1] >= '0' && c[1] <= '9' ? c[1] - '0' : (c[1] | 32) >= 'a' && (c[1] | 32) <= 'f' ? (c[1] | 32) - 'a' + 10 : -1;
        h2 = h1 < 0 ? -1 : c[2] >= '0' && c[2] <= '9' ? c[2] - '0' : (c[2] | 32) >= 'a' && (c[2] | 32) <= 'f' ? (c[2] | 32) - 'a' + 10 : -1;
        if (h2 < 0) {
            free(ptr);
            return kvs_fail(KVS_ERR_INVALID, "%s.$ref: '%.64s' has a bad percent-encoding", path, text);
        }
        ptr[len++] = (char)(h1 * 16 + h2);
        c += 2;
    }
    if (len && ptr[0] != '/') {
        free(ptr);
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s.$ref: '%.64s' is not supported (a plain-name fragment; only '#' or '#/a/json/pointer')",
                        path, text);
    }
    json_t *v = b->root;
    int w = snprintf(where, cap, "schema");
    for (size_t at = 0; v && at < len;) { /* one reference token: ptr[at + 1 ..) up to the next '/' */
        size_t end = at + 1, k = 0;
        while (end < len && ptr[end] != '/') end++;
        char *tok = ptr + at + 1; /* unescaped in place */
        for (size_t i = at + 1; i < end; i++) {
            if (ptr[i] == '~' && i + 1 < end && (ptr[i + 1] == '0' || ptr[i + 1] == '1')) tok[k++] = ptr[++i] == '0' ? '~' : '/';
            else if (ptr[i] == '~') {
                free(ptr);
                return kvs_fail(KVS_ERR_INVALID, "%s.$ref: '%.64s' has a '~' that is not ~0 or ~1", path, text);
            } else tok[k++] = ptr[i];
        }
        if (json_is_object(v)) {
            v = json_object_getn(v, tok, k);
        } else if (json_is_array(v)) {
            size_t i = 0, d = 0;
            for (; d < k && tok[d] >= '0' && tok[d] <= '9' && i < ((size_t)1 << 40); d++) i = i * 10 + (size_t)(tok[d] - '0');
            v = d == k && k && (k == 1 || tok[0] != '0') ? json_array_get(v, i) : NULL;
        } else {
            v = NULL;
        }
        if (w >= 0 && (size_t)w < cap) w += snprintf(where + w, cap - (size_t)w, ".%.*s", (int)k, tok);
        at = end;
    }
    free(ptr);
    *target = v;
    return KVS_OK;
}

static kvs_status ref_rule(builder *b, json_t *ref, const char *path, int *rule) {
    if (!json_is_string(ref)) return kvs_fail(KVS_ERR_INVALID, "%s.$ref must be a string", path);
    const char *text = json_string_value(ref);
    json_t *target;
    char sub[512], key[32];
    KVS_TRY(resolve_ref(b, text, path, &target, sub, sizeof sub));
    if (!target) return kvs_fail(KVS_ERR_INVALID, "%s.$ref: '%.64s' is not defined", path, text);
    snprintf(key, sizeof key, "%p", (void *)target); /* the same target however it is spelled */
    json_t *have = json_object_get(b->refs, key);
    if (have) {
        *rule = (int)json_integer_value(have);
        return KVS_OK;
    }
    KVS_TRY(new_rule(b, rule));
    if (json_object_set_new(b->refs, key, json_integer(*rule))) return kvs_fail(KVS_ERR_NOMEM, "grammar: out of memory");
    int r = *rule, to;
    kvs_status st = value(b, r, nfa(b, r)->start, target, sub, &to);
    if (st == KVS_OK) eps(b, r, to, nfa(b, r)->final);
    return st;
}

/* alternatives: one call each from x to a common end */
static kvs_status alternatives(builder *b, int r, int x, json_t *s, json_t *alts, const char *key, const char *path, int *to) {
    char sub[512];
    if (!json_is_array(alts) || json_array_size(alts) == 0)
        return kvs_fail(KVS_ERR_INVALID, "%s.%s must be a non-empty array", path, key);
    *to = state(b, r);
    for (size_t i = 0; i < json_array_size(alts) && !b->oom; i++) {
        json_t *alt = json_array_get(alts, i);
        int rule;
        snprintf(sub, sizeof sub, "%s.%s[%zu]", path, key, i);
        if (json_is_string(alt)) { /* a type array: the schema with that one type */
            json_t *one = json_copy(s);
            if (!one || json_object_set(one, "type", alt)) {
                json_decref(one);
                return kvs_fail(KVS_ERR_NOMEM, "grammar: out of memory");
            }
            kvs_status st = rule_of(b, one, sub, &rule);
            json_decref(one);
            KVS_TRY(st);
        } else {
            KVS_TRY(rule_of(b, alt, sub, &rule));
        }
        call(b, r, x, rule, *to);
    }
    return KVS_OK;
}

static kvs_status typed_value(builder *b, int r, int x, json_t *s, const char *type, const char *path, int *to) {
    int rule;
    if (!strcmp(type, "object")) return object_value(b, r, x, s, path, to);
    if (!strcmp(type, "array")) return array_value(b, r, x, s, path, to);
    if (!strcmp(type, "string")) return string_value(b, r, x, s, path, to);
    if (!strcmp(type, "integer") || !strcmp(type, "number")) {
        KVS_TRY(number_rule(b, type[0] == 'n', &rule));
        *to = call_new(b, r, x, rule);
        return KVS_OK;
    }
    if (!strcmp(type, "boolean")) {
        *to = state(b, r);
        eps(b, r, lit_str(b, r, x, "true"), *to);
        eps(b, r, lit_str(b, r, x, "false"), *to);
        return KVS_OK;
    }
    if (!strcmp(type, "null")) {
        *to = lit_str(b, r, x, "null");
        return KVS_OK;
    }
    return kvs_fail(KVS_ERR_UNSUPPORTED, "%s.type: '%.32s' is not a JSON schema type", path, type);
}

/* a value of schema s from state x of rule r, ending at *to */
static kvs_status value(builder *b, int r, int x, json_t *s, const char *path, int *to) {
    int rule;
    kvs_status st = KVS_OK;
    if (json_is_true(s)) {
        KVS_TRY(any_rule(b, &rule));
        *to = call_new(b, r, x, rule);
        return KVS_OK;
    }
    if (b->oom) return kvs_fail(KVS_ERR_NOMEM, "grammar: out of memory"); /* or past a bound: build() says which */
    if (!json_is_object(s)) return kvs_fail(KVS_ERR_INVALID, "%s must be a schema (an object)", path);
    if (++b->nesting > MAX_NESTING) return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: schemas nested deeper than %d", path, MAX_NESTING);
    KVS_TRY(check_keywords(s, path));
    json_t *v, *type = json_object_get(s, "type");
    if ((v = json_object_get(s, "$ref"))) {
        KVS_TRY(ref_rule(b, v, path, &rule));
        *to = call_new(b, r, x, rule);
    } else if ((v = json_object_get(s, "const"))) {
        *to = literal(b, r, x, v, path, &st);
    } else if ((v = json_object_get(s, "enum"))) {
        if (!json_is_array(v) || json_array_size(v) == 0)
            return kvs_fail(KVS_ERR_INVALID, "%s.enum must be a non-empty array", path);
        *to = state(b, r);
        for (size_t i = 0; i < json_array_size(v) && st == KVS_OK && !b->oom; i++)
            eps(b, r, literal(b, r, x, json_array_get(v, i), path, &st), *to);
    } else if ((v = json_object_get(s, "anyOf")) || (v = json_object_get(s, "oneOf"))) {
        st = alternatives(b, r, x, s, v, json_object_get(s, "anyOf") ? "anyOf" : "oneOf", path, to);
    } else if (json_is_array(type)) {
        st = alternatives(b, r, x, s, type, "type", path, to);
    } else if (json_is_string(type)) {
        st = typed_value(b, r, x, s, json_string_value(type), path, to);
    } else if (type) {
        st = kvs_fail(KVS_ERR_INVALID, "%s.type must be a string or an array of strings", path);
    } else if (json_object_get(s, "properties") || json_object_get(s, "additionalProperties")) {
        st = object_value(b, r, x, s, path, to);
    } else if (json_object_get(s, "items")) {
        st = array_value(b, r, x, s, path, to);
    } else {
        KVS_TRY(any_rule(b, &rule));
        *to = call_new(b, r, x, rule);
    }
    b->nesting--;
    return st;
}

/* a schema's own rule (the shared one for a plain string, integer or number) */
static kvs_status rule_of(builder *b, json_t *s, const char *path, int *rule) {
    json_t *type = json_object_get(s, "type");
    if (json_is_object(s) && json_is_string(type) && json_object_size(s) == 1) {
        const char *t = json_string_value(type);
        if (!strcmp(t, "string")) return string_rule(b, rule);
        if (!strcmp(t, "integer") || !strcmp(t, "number")) return number_rule(b, t[0] == 'n', rule);
    }
    int to;
    KVS_TRY(new_rule(b, rule));
    int r = *rule;
    KVS_TRY(value(b, r, nfa(b, r)->start, s, path, &to));
    eps(b, r, to, nfa(b, r)->final);
    return KVS_OK;
}

static void builder_free(builder *b) {
    for (int i = 0; i < b->n_rules; i++) {
        gr_budget_bytes(b->budget, -(ptrdiff_t)sizeof *b->rules[i]);
        gr_nfa_free(b->rules[i]);
        free(b->rules[i]);
    }
    free(b->rules);
    json_decref(b->refs);
    json_decref(b->patterns);
}

/* the JSON values in v, counted up to past limit */
static int count_values(json_t *v, int limit) {
    int n = 1;
    size_t i;
    const char *k;
    json_t *x;
    if (json_is_array(v))
        json_array_foreach(v, i, x) if ((n += count_values(x, limit - n)) > limit) return n;
    if (json_is_object(v))
        json_object_foreach(v, k, x) if ((n += count_values(x, limit - n)) > limit) return n;
    return n;
}

kvs_status kvs_grammar_check_values(json_t *schema, const kvs_grammar_limits *lim) {
    if (schema && lim && lim->max_values > 0 && count_values(schema, lim->max_values) > lim->max_values)
        return kvs_fail(KVS_ERR_UNSUPPORTED, "schema: it holds more than the bound of %d JSON values", lim->max_values);
    return KVS_OK;
}

/* the root rule: prefix, the value, suffix */
static kvs_status build(json_t *schema, bool object_only, const char *prefix, const char *suffix,
                        const kvs_grammar_limits *lim, kvs_grammar **out) {
    KVS_TRY(kvs_grammar_check_values(schema, lim));
    gr_budget budget;
    gr_budget_init(&budget, lim);
    builder b = {.root = schema, .refs = json_object(), .patterns = json_object(), .r_string = -1, .r_integer = -1,
                 .r_number = -1, .r_any = -1, .budget = lim ? &budget : NULL};
    int root, to, key, any;
    kvs_status st = b.refs && b.patterns ? new_rule(&b, &root) : kvs_fail(KVS_ERR_NOMEM, "grammar: out of memory");
    if (st == KVS_OK) {
        int x = lit_str(&b, root, nfa(&b, root)->start, prefix ? prefix : "");
        if (object_only) {
            st = string_rule(&b, &key);
            if (st == KVS_OK) st = any_rule(&b, &any);
            if (st == KVS_OK) to = map_of(&b, root, x, key, any);
        } else {
            st = value(&b, root, x, schema, "schema", &to);
        }
        if (st == KVS_OK) eps(&b, root, lit_str(&b, root, to, suffix ? suffix : ""), nfa(&b, root)->final);
    }
    if (st != KVS_OK && b.budget && budget.code != KVS_OK) st = gr_budget_status(&budget); /* the bound, not its echo */
    if (st == KVS_OK && b.oom)
        st = b.budget && budget.code != KVS_OK ? gr_budget_status(&budget)
                                               : kvs_fail(KVS_ERR_NOMEM, "grammar: out of memory building the schema's rules");
    if (st == KVS_OK) st = gr_compile(b.rules, b.n_rules, root, b.budget, out);
    builder_free(&b);
    if (st == KVS_OK && lim) (*out)->mask_work = lim->max_mask_work;
    return st;
}

kvs_grammar_limits kvs_grammar_limits_default(void) {
    return (kvs_grammar_limits){KVS_GRAMMAR_MAX_VALUES,  KVS_GRAMMAR_MAX_STATES,   KVS_GRAMMAR_MAX_TRANSITIONS,
                                KVS_GRAMMAR_MAX_BYTES,   KVS_GRAMMAR_MAX_SECONDS, KVS_GRAMMAR_MAX_MASK_WORK, NULL};
}

kvs_status kvs_grammar_compile(const char *schema, size_t len, const char *prefix, const char *suffix,
                               const kvs_grammar_limits *lim, kvs_grammar **out) {
    *out = NULL;
    json_error_t err;
    json_t *s = json_loadb(schema, len, JSON_DECODE_ANY, &err);
    if (!s) return kvs_fail(KVS_ERR_INVALID, "schema: not JSON (%s at line %d)", err.text, err.line);
    kvs_status st = build(s, false, prefix, suffix, lim, out);
    json_decref(s);
    return st;
}

kvs_status kvs_grammar_compile_value(json_t *schema, const char *prefix, const char *suffix,
                                     const kvs_grammar_limits *lim, kvs_grammar **out) {
    *out = NULL;
    return build(schema, false, prefix, suffix, lim, out);
}

kvs_status kvs_grammar_from_json_schema(const char *schema, size_t len, const char *prefix, const char *suffix,
                                        kvs_grammar **out) {
    return kvs_grammar_compile(schema, len, prefix, suffix, NULL, out);
}

kvs_status kvs_grammar_json_object(kvs_grammar **out) {
    *out = NULL;
    return build(NULL, true, NULL, NULL, NULL, out);
}
