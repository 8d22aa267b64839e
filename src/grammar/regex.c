/* grammar: a JSON string whose content matches a regular expression (JSON
 * Schema's "pattern": ECMA-262 syntax and semantics, on code points as with
 * the u flag), and through it the string formats (schema.c). Three steps:
 *  1. parse: the pattern's text -> a syntax tree; a construct that is not
 *     supported is refused naming it and its offset (in bytes);
 *  2. a code-point NFA: the tree by Thompson's construction (classes of code
 *     points on the edges, ^ and $ as assertion edges), then the search made
 *     explicit as a product with the input's phase (nothing read yet, something
 *     read, past a $) between an implicit [any]* before and after the match
 *     (a pattern is unanchored unless its ^ and $ say otherwise); with
 *     minLength / maxLength, a product with the count of code points; trimmed
 *     to the states on some path from start to final, so that the rule has no
 *     dead end (every prefix the mask allows can be completed);
 *  3. bytes: each class edge written as the JSON text of its code points into
 *     the rule's NFA (nfa.c), which gr_compile determinizes with the rest.
 * The JSON text of a code point: raw UTF-8, except '"' and '\' (\" and \\)
 * and the control characters (\b \f \n \r \t, or \u00XX with hex digits in
 * either case); '/' raw or as \/. U+0000 (jansson refuses \u0000) and lone
 * surrogates cannot be written: no class holds them.
 * Bounds, besides the compile's own (gr_budget): repetition counts up to
 * RX_MAX_REPEAT, the pattern multiplied out (each counted repetition copied)
 * up to RX_MAX_POSITIONS positions, the product with a length up to
 * RX_MAX_STATES states; past one the pattern is refused naming it. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar_internal.h"

#define RX_MAX_CP 0x10FFFFu
#define RX_MAX_REPEAT 1000     /* {n,m} counts */
#define RX_MAX_POSITIONS 4096  /* classes and anchors of the pattern multiplied out */
#define RX_MAX_STATES 32768    /* code-point states of the product with minLength / maxLength */
#define RX_MAX_NESTING 64 /* groups inside groups */

typedef struct {
    uint32_t lo, hi;
} rx_range;

typedef struct {
    rx_range *v;
    int n, cap;
} rx_set;

enum { RX_EMPTY, RX_CLASS, RX_CAT, RX_ALT, RX_REPEAT, RX_BOL, RX_EOL };
typedef struct {
    uint8_t kind;
    int32_t first, last, next; /* children (CAT, ALT; REPEAT: one), the next sibling; -1: none */
    int32_t min, max;          /* REPEAT: max -1 = unbounded */
    int32_t cls, n_cls;        /* CLASS: ranges [cls, cls + n_cls) of the pool */
} rx_node;

typedef struct {
    const unsigned char *s;
    size_t len, pos;
    int depth;
    const char *where;
    kvs_status st;
    rx_node *nodes;
    int n_nodes, cap_nodes;
    rx_set pool; /* every class's ranges */
} rx;

/* ---- errors and memory ----------------------------------------------------------------- */
static bool grow(void *items, int *cap, int need, size_t size) {
    if (need <= *cap) return true;
    int c = need * 2 + 16;
    void *q = realloc(*(void **)items, (size_t)c * size);
    if (!q) return false;
    *(void **)items = q;
    *cap = c;
    return true;
}

static bool fail(rx *p, kvs_status code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bool fail(rx *p, kvs_status code, const char *fmt, ...) {
    if (p->st != KVS_OK) return false;
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    p->st = kvs_fail(code, "%s: %s", p->where, msg);
    return false;
}
static bool oom(rx *p) { return fail(p, KVS_ERR_NOMEM, "out of memory"); }
#define UNSUPPORTED(p, at, what) fail(p, KVS_ERR_UNSUPPORTED, "%s at offset %zu is not supported", what, (size_t)(at))

/* ---- sets of code points --------------------------------------------------------------- */
static bool set_add(rx *p, rx_set *s, uint32_t lo, uint32_t hi) {
    if (!grow(&s->v, &s->cap, s->n + 1, sizeof *s->v)) return oom(p);
    s->v[s->n++] = (rx_range){lo, hi};
    return true;
}
static bool set_add_all(rx *p, rx_set *s, const rx_range *r, int n) {
    for (int i = 0; i < n; i++)
        if (!set_add(p, s, r[i].lo, r[i].hi)) return false;
    return true;
}
static int cmp_range(const void *x, const void *y) {
    const rx_range *a = x, *b = y;
    return (a->lo > b->lo) - (a->lo < b->lo);
}
/* sorted, overlapping and adjacent ranges merged */
static void set_norm(rx_set *s) {
    if (s->n < 2) return;
    qsort(s->v, (size_t)s->n, sizeof *s->v, cmp_range);
    int m = 0;
    for (int i = 1; i < s->n; i++)
        if (s->v[i].lo <= s->v[m].hi + 1) s->v[m].hi = s->v[i].hi > s->v[m].hi ? s->v[i].hi : s->v[m].hi;
        else s->v[++m] = s->v[i];
    s->n = m + 1;
}
/* s (normalized) := its complement in [lo, hi] of every normalized range of keep */
static bool set_within(rx *p, rx_set *s, bool negate, const rx_range *keep, int n_keep) {
    rx_set in = *s, out = {0};
    rx_set neg = {0};
    if (negate) {
        uint32_t next = 0;
        for (int i = 0; i < in.n; i++) {
            if (in.v[i].lo > next && !set_add(p, &neg, next, in.v[i].lo - 1)) goto bad;
            next = in.v[i].hi + 1;
        }
        if ((in.n == 0 || in.v[in.n - 1].hi < RX_MAX_CP) && !set_add(p, &neg, next, RX_MAX_CP)) goto bad;
        in = neg;
    }
    for (int i = 0; i < in.n; i++)
        for (int k = 0; k < n_keep; k++) {
            uint32_t lo = in.v[i].lo > keep[k].lo ? in.v[i].lo : keep[k].lo;
            uint32_t hi = in.v[i].hi < keep[k].hi ? in.v[i].hi : keep[k].hi;
            if (lo <= hi && !set_add(p, &out, lo, hi)) goto bad;
        }
    free(neg.v);
    free(s->v);
    *s = out;
    return true;
bad:
    free(neg.v);
    free(out.v);
    return false;
}

/* what a JSON string can hold: not U+0000, not a lone surrogate */
static const rx_range WRITABLE[] = {{1, 0xD7FF}, {0xE000, RX_MAX_CP}};
static const rx_range DIGIT[] = {{'0', '9'}};
static const rx_range WORD[] = {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};
static const rx_range SPACE[] = {{9, 13},          {0x20, 0x20},     {0xA0, 0xA0},     {0x1680, 0x1680},
                                 {0x2000, 0x200A}, {0x2028, 0x2029}, {0x202F, 0x202F}, {0x205F, 0x205F},
                                 {0x3000, 0x3000}, {0xFEFF, 0xFEFF}};
static const rx_range LINE_END[] = {{10, 10}, {13, 13}, {0x2028, 0x2029}}; /* what '.' does not match */
#define N_OF(a) (int)(sizeof a / sizeof a[0])

/* ---- the syntax tree ---------------------------------------------------------------------- */
static int32_t node(rx *p, int kind) {
    if (!grow(&p->nodes, &p->cap_nodes, p->n_nodes + 1, sizeof *p->nodes)) return oom(p), -1;
    p->nodes[p->n_nodes] = (rx_node){(uint8_t)kind, -1, -1, -1, 0, 0, 0, 0};
    return p->n_nodes++;
}
static void adopt(rx *p, int32_t parent, int32_t child) {
    rx_node *x = &p->nodes[parent];
    if (x->last >= 0) p->nodes[x->last].next = child;
    else x->first = child;
    x->last = child;
}
/* a CLASS node of s (normalized, negated when asked, cut to what JSON can hold); s is freed */
static int32_t class_node(rx *p, rx_set *s, bool negate) {
    set_norm(s);
    int32_t n = -1;
    if (set_within(p, s, negate, WRITABLE, N_OF(WRITABLE)) && (n = node(p, RX_CLASS)) >= 0) {
        p->nodes[n].cls = p->pool.n;
        p->nodes[n].n_cls = s->n;
        if (!set_add_all(p, &p->pool, s->v, s->n)) n = -1;
    }
    free(s->v);
    memset(s, 0, sizeof *s);
    return n;
}

/* ---- parsing ------------------------------------------------------------------------------- */
/* the code point at p->pos and its length in *n; -1 at the end, -2 for a byte that is not UTF-8 */
static int32_t peek(const rx *p, size_t *n) {
    *n = 0;
    if (p->pos >= p->len) return -1;
    const unsigned char *s = p->s + p->pos;
    size_t left = p->len - p->pos;
    uint32_t c = s[0];
    int k = c < 0x80 ? 0 : c >= 0xC2 && c <= 0xDF ? 1 : c >= 0xE0 && c <= 0xEF ? 2 : c >= 0xF0 && c <= 0xF4 ? 3 : -1;
    if (k < 0 || (size_t)k >= left) return -2;
    c = k == 0 ? c : c & (0x3F >> k);
    for (int i = 1; i <= k; i++) {
        if ((s[i] & 0xC0) != 0x80) return -2;
        c = c << 6 | (s[i] & 0x3F);
    }
    if ((k == 2 && (c < 0x800 || (c >= 0xD800 && c <= 0xDFFF))) || (k == 3 && (c < 0x10000 || c > RX_MAX_CP))) return -2;
    *n = (size_t)k + 1;
    return (int32_t)c;
}
static int32_t look(const rx *p) {
    size_t n;
    return peek(p, &n);
}
static int32_t take(rx *p) {
    size_t n;
    int32_t c = peek(p, &n);
    p->pos += n;
    return c;
}
static int32_t look_at(const rx *p, size_t ahead) { return p->pos + ahead < p->len ? p->s[p->pos + ahead] : -1; }

static int hex(int32_t c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}
/* n hex digits at p->pos (consumed), -1 when they are not there */
static int32_t hex_digits(rx *p, int n) {
    int32_t v = 0;
    for (int i = 0; i < n; i++) {
        int h = hex(look_at(p, (size_t)i));
        if (h < 0) return -1;
        v = v * 16 + h;
    }
    p->pos += (size_t)n;
    return v;
}

/* An escape after its '\' (at offset at): a class into s (returns 0) or one code point into *cp (returns 1); -1: refused */
static int escape(rx *p, size_t at, bool in_class, rx_set *s, uint32_t *cp) {
    int32_t c = take(p);
    bool neg = c == 'D' || c == 'W' || c == 'S';
    switch (c) {
    case -1: return fail(p, KVS_ERR_INVALID, "'\\' at the end of the pattern"), -1;
    case -2: return fail(p, KVS_ERR_INVALID, "not UTF-8 at offset %zu", p->pos), -1;
    case 'd': case 'D': case 'w': case 'W': case 's': case 'S': {
        rx_set t = {0};
        bool ok = c == 'd' || c == 'D'   ? set_add_all(p, &t, DIGIT, N_OF(DIGIT))
                  : c == 'w' || c == 'W' ? set_add_all(p, &t, WORD, N_OF(WORD))
                                         : set_add_all(p, &t, SPACE, N_OF(SPACE));
        if (ok && neg) ok = set_within(p, &t, true, (const rx_range[]){{0, RX_MAX_CP}}, 1);
        ok = ok && set_add_all(p, s, t.v, t.n);
        free(t.v);
        return ok ? 0 : -1;
    }
    case 'b':
        if (in_class) return *cp = 8, 1;
        return UNSUPPORTED(p, at, "a word boundary '\\b'"), -1;
    case 'B': return UNSUPPORTED(p, at, "a non-word-boundary '\\B'"), -1;
    case 't': return *cp = 9, 1;
    case 'n': return *cp = 10, 1;
    case 'v': return *cp = 11, 1;
    case 'f': return *cp = 12, 1;
    case 'r': return *cp = 13, 1;
    case '0':
        if (look(p) >= '0' && look(p) <= '9') return UNSUPPORTED(p, at, "an octal escape"), -1;
        return *cp = 0, 1;
    case 'k': return UNSUPPORTED(p, at, "a named backreference '\\k'"), -1;
    case 'p': case 'P': return UNSUPPORTED(p, at, "a Unicode property class '\\p{...}'"), -1;
    case 'c': {
        int32_t l = look(p);
        if (!((l >= 'a' && l <= 'z') || (l >= 'A' && l <= 'Z')))
            return fail(p, KVS_ERR_INVALID, "'\\c' without a control letter at offset %zu", at), -1;
        p->pos++;
        return *cp = (uint32_t)(l % 32), 1;
    }
    case 'x': {
        int32_t v = hex_digits(p, 2);
        if (v < 0) return fail(p, KVS_ERR_INVALID, "'\\x' without two hex digits at offset %zu", at), -1;
        return *cp = (uint32_t)v, 1;
    }
    case 'u': {
        int32_t v;
        if (look(p) == '{') {
            p->pos++;
            v = 0;
            int n = 0;
            for (; hex(look(p)) >= 0 && v <= (int32_t)RX_MAX_CP; n++) v = v * 16 + hex(take(p));
            if (!n || look(p) != '}' || v > (int32_t)RX_MAX_CP)
                return fail(p, KVS_ERR_INVALID, "a bad '\\u{...}' at offset %zu", at), -1;
            p->pos++;
        } else if ((v = hex_digits(p, 4)) < 0) {
            return fail(p, KVS_ERR_INVALID, "'\\u' without four hex digits at offset %zu", at), -1;
        } else if (v >= 0xD800 && v <= 0xDBFF && look_at(p, 0) == '\\' && look_at(p, 1) == 'u') { /* a pair */
            size_t back = p->pos;
            p->pos += 2;
            int32_t low = hex_digits(p, 4);
            if (low >= 0xDC00 && low <= 0xDFFF) v = 0x10000 + ((v - 0xD800) << 10) + (low - 0xDC00);
            else p->pos = back;
        }
        return *cp = (uint32_t)v, 1;
    }
    default:
        if (c >= '1' && c <= '9') return UNSUPPORTED(p, at, in_class ? "an octal escape" : "a backreference"), -1;
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
            char what[32];
            snprintf(what, sizeof what, "the escape '\\%c'", (char)c);
            return UNSUPPORTED(p, at, what), -1;
        }
        return *cp = (uint32_t)c, 1; /* an identity escape: \. \* \\ \/ \- ... */
    }
}

/* '[' ... ']' after its '[' (at offset at) */
static int32_t char_class(rx *p, size_t at) {
    rx_set s = {0};
    bool negate = look(p) == '^';
    if (negate) p->pos++;
    for (;;) {
        size_t item = p->pos;
        int32_t c = take(p);
        if (c == -1) return fail(p, KVS_ERR_INVALID, "'[' at offset %zu is not closed", at), free(s.v), -1;
        if (c == -2) return fail(p, KVS_ERR_INVALID, "not UTF-8 at offset %zu", item), free(s.v), -1;
        if (c == ']') break;
        uint32_t lo = (uint32_t)c, hi;
        int single = 1;
        if (c == '\\' && (single = escape(p, item, true, &s, &lo)) < 0) return free(s.v), -1;
        if (look(p) != '-' || look_at(p, 1) == ']' || look_at(p, 1) == -1) {
            if (single && !set_add(p, &s, lo, lo)) return free(s.v), -1;
            continue;
        }
        size_t dash = p->pos++, second = p->pos;
        int32_t d = take(p);
        int single2 = 1;
        hi = (uint32_t)d;
        if (d == -2) return fail(p, KVS_ERR_INVALID, "not UTF-8 at offset %zu", second), free(s.v), -1;
        if (d == '\\' && (single2 = escape(p, second, true, &s, &hi)) < 0) return free(s.v), -1;
        if (!single || !single2)
            return fail(p, KVS_ERR_INVALID, "a range with a class escape at offset %zu", dash), free(s.v), -1;
        if (hi < lo) return fail(p, KVS_ERR_INVALID, "a range out of order at offset %zu", item), free(s.v), -1;
        if (!set_add(p, &s, lo, hi)) return free(s.v), -1;
    }
    return class_node(p, &s, negate);
}

static int32_t alternation(rx *p);

/* {n}, {n,}, {n,m} at p->pos: true with the counts (consumed), false when the text is not one */
static bool braces(rx *p, int32_t *min, int32_t *max) {
    size_t i = 1;
    int64_t v[2] = {0, -1};
    int k = 0;
    if (look_at(p, 0) != '{') return false;
    for (;; i++) {
        int32_t c = look_at(p, i);
        if (c >= '0' && c <= '9') {
            if (v[k] < 0) v[k] = 0;
            if (v[k] < 100000000) v[k] = v[k] * 10 + (c - '0');
        } else if (c == ',' && k == 0 && i > 1) {
            k = 1;
        } else if (c == '}' && i > 1) {
            break;
        } else {
            return false;
        }
    }
    *min = v[0] > INT32_MAX ? INT32_MAX : (int32_t)v[0];
    *max = k == 0 ? *min : v[1] > INT32_MAX ? INT32_MAX : (int32_t)v[1];
    p->pos += i + 1;
    return true;
}

/* a quantifier at p->pos: true with its counts (consumed), false when there is none */
static bool quantifier(rx *p, int32_t *min, int32_t *max) {
    int32_t c = look(p);
    if (c == '*' || c == '+' || c == '?') {
        p->pos++;
        *min = c == '+', *max = c == '?' ? 1 : -1;
        return true;
    }
    return braces(p, min, max);
}

/* an atom and its quantifier; -1: refused */
static int32_t quantified(rx *p) {
    size_t at = p->pos;
    int32_t min, max, c = take(p), a;
    switch (c) {
    case -2: return fail(p, KVS_ERR_INVALID, "not UTF-8 at offset %zu", at), -1;
    case '*': case '+': case '?':
        return fail(p, KVS_ERR_INVALID, "a quantifier with nothing to repeat at offset %zu", at), -1;
    case '{':
        p->pos = at;
        if (braces(p, &min, &max)) return fail(p, KVS_ERR_INVALID, "a quantifier with nothing to repeat at offset %zu", at), -1;
        return fail(p, KVS_ERR_INVALID, "'{' at offset %zu is not a quantifier ('\\{' is the character)", at), -1;
    case '^': case '$':
        a = node(p, c == '^' ? RX_BOL : RX_EOL);
        if (a >= 0 && quantifier(p, &min, &max))
            return fail(p, KVS_ERR_INVALID, "a quantifier after an anchor at offset %zu", at), -1;
        return a;
    case '(':
        if (look(p) == '?') {
            int32_t d = look_at(p, 1), e = look_at(p, 2);
            if (d == '=') return UNSUPPORTED(p, at, "a lookahead '(?='"), -1;
            if (d == '!') return UNSUPPORTED(p, at, "a negative lookahead '(?!'"), -1;
            if (d == '<' && e == '=') return UNSUPPORTED(p, at, "a lookbehind '(?<='"), -1;
            if (d == '<' && e == '!') return UNSUPPORTED(p, at, "a negative lookbehind '(?<!'"), -1;
            if (d == '<') return UNSUPPORTED(p, at, "a named group '(?<name>'"), -1;
            if (d != ':') return UNSUPPORTED(p, at, "a '(?' group other than '(?:'"), -1;
            p->pos += 2;
        }
        if (++p->depth > RX_MAX_NESTING)
            return fail(p, KVS_ERR_UNSUPPORTED, "groups nested deeper than the bound of %d at offset %zu", RX_MAX_NESTING, at), -1;
        a = alternation(p);
        if (a < 0) return -1;
        if (look(p) != ')') return fail(p, KVS_ERR_INVALID, "'(' at offset %zu is not closed", at), -1;
        p->pos++;
        p->depth--;
        break;
    case '[': a = char_class(p, at); break;
    case '.': {
        rx_set s = {0};
        a = set_add_all(p, &s, LINE_END, N_OF(LINE_END)) ? class_node(p, &s, true) : (free(s.v), -1);
        break;
    }
    default: {
        uint32_t cp = (uint32_t)c;
        rx_set s = {0};
        int one = c == '\\' ? escape(p, at, false, &s, &cp) : 1;
        if (one < 0) return free(s.v), -1;
        a = one && !set_add(p, &s, cp, cp) ? (free(s.v), -1) : class_node(p, &s, false);
    }
    }
    if (a < 0) return -1;
    size_t q = p->pos;
    if (!quantifier(p, &min, &max)) {
        if (look(p) == '{') return fail(p, KVS_ERR_INVALID, "'{' at offset %zu is not a quantifier ('\\{' is the character)", q), -1;
        return a;
    }
    if (min > RX_MAX_REPEAT || max > RX_MAX_REPEAT)
        return fail(p, KVS_ERR_UNSUPPORTED, "a repetition count above the bound of %d at offset %zu", RX_MAX_REPEAT, q), -1;
    if (max >= 0 && max < min) return fail(p, KVS_ERR_INVALID, "a quantifier {n,m} with m < n at offset %zu", q), -1;
    if (look(p) == '?') p->pos++; /* lazy: the same strings match */
    else if (look(p) == '+') return UNSUPPORTED(p, p->pos, "a possessive quantifier"), -1;
    int32_t dummy_min, dummy_max;
    size_t again = p->pos;
    if (quantifier(p, &dummy_min, &dummy_max))
        return fail(p, KVS_ERR_INVALID, "a quantifier with nothing to repeat at offset %zu", again), -1;
    int32_t r = node(p, RX_REPEAT);
    if (r < 0) return -1;
    p->nodes[r].min = min, p->nodes[r].max = max;
    adopt(p, r, a);
    return r;
}

static int32_t concatenation(rx *p) {
    int32_t cat = node(p, RX_CAT);
    for (int32_t c = look(p); cat >= 0 && c != -1 && c != '|' && c != ')'; c = look(p)) {
        int32_t a = quantified(p);
        if (a < 0) return -1;
        adopt(p, cat, a);
    }
    return cat;
}

static int32_t alternation(rx *p) {
    int32_t first = concatenation(p);
    if (first < 0 || look(p) != '|') return first;
    int32_t alt = node(p, RX_ALT);
    if (alt < 0) return -1;
    adopt(p, alt, first);
    while (look(p) == '|') {
        p->pos++;
        int32_t c = concatenation(p);
        if (c < 0) return -1;
        adopt(p, alt, c);
    }
    return alt;
}

/* positions of n multiplied out (each counted repetition copied), up to past RX_MAX_POSITIONS */
static int64_t positions(const rx *p, int32_t n) {
    const rx_node *x = &p->nodes[n];
    int64_t sum = 1;
    if (x->kind == RX_CAT || x->kind == RX_ALT)
        for (int32_t c = x->first; c >= 0 && sum <= RX_MAX_POSITIONS; c = p->nodes[c].next) sum += positions(p, c);
    if (x->kind == RX_REPEAT) {
        int64_t copies = x->max < 0 ? x->min + 1 : x->max;
        sum += copies * positions(p, x->first);
    }
    return sum > RX_MAX_POSITIONS ? RX_MAX_POSITIONS + 1 : sum;
}

/* ---- code-point NFAs ------------------------------------------------------------------------ */
enum { E_EPS, E_CLASS, E_BOL, E_EOL };
typedef struct {
    int32_t from, to;
    int32_t kind, cls, n_cls;
} rx_edge;
typedef struct {
    rx_edge *e;
    int n, cap;
    int32_t n_states, start, final;
} rx_nfa;

static int32_t new_state(rx_nfa *a) { return a->n_states++; }
static bool edge(rx *p, rx_nfa *a, int32_t from, int32_t to, int kind, int32_t cls, int32_t n_cls) {
    if (!grow(&a->e, &a->cap, a->n + 1, sizeof *a->e)) return oom(p);
    a->e[a->n++] = (rx_edge){from, to, kind, cls, n_cls};
    return true;
}
#define EPS(p, a, x, y) edge(p, a, x, y, E_EPS, 0, 0)

/* Thompson's construction of node n from state from; the state after it, -1 when out of memory */
static int32_t build(rx *p, rx_nfa *a, int32_t n, int32_t from) {
    const rx_node x = p->nodes[n];
    int32_t to, s;
    switch (x.kind) {
    case RX_CLASS: case RX_BOL: case RX_EOL:
        to = new_state(a);
        return edge(p, a, from, to, x.kind == RX_CLASS ? E_CLASS : x.kind == RX_BOL ? E_BOL : E_EOL, x.cls, x.n_cls) ? to : -1;
    case RX_CAT:
        for (int32_t c = x.first; c >= 0 && from >= 0; c = p->nodes[c].next) from = build(p, a, c, from);
        return from;
    case RX_ALT:
        to = new_state(a);
        for (int32_t c = x.first; c >= 0; c = p->nodes[c].next) {
            s = new_state(a);
            int32_t t = EPS(p, a, from, s) ? build(p, a, c, s) : -1;
            if (t < 0 || !EPS(p, a, t, to)) return -1;
        }
        return to;
    case RX_REPEAT:
        for (int i = 0; i < x.min && from >= 0; i++) from = build(p, a, x.first, from);
        if (from < 0) return -1;
        if (x.max < 0) { /* a loop through s */
            s = new_state(a);
            int32_t t = EPS(p, a, from, s) ? build(p, a, x.first, s) : -1;
            return t >= 0 && EPS(p, a, t, s) ? s : -1;
        }
        to = new_state(a);
        if (!EPS(p, a, from, to)) return -1;
        for (int i = x.min; i < x.max; i++)
            if ((from = build(p, a, x.first, from)) < 0 || !EPS(p, a, from, to)) return -1;
        return to;
    default: return from;
    }
}

/* Keeps the states on a path from start to final (renumbered), the edges between them;
 * class edges without code points dropped. False when out of memory. */
static bool trim(rx *p, rx_nfa *a) {
    int32_t ns = a->n_states;
    int *first = calloc((size_t)ns + 1, sizeof *first), *adj = malloc(((size_t)a->n + 1) * sizeof *adj);
    int *fill = calloc((size_t)ns + 1, sizeof *fill);
    int32_t *stack = malloc(((size_t)ns + 1) * sizeof *stack), *map = malloc(((size_t)ns + 1) * sizeof *map);
    uint8_t *mark = calloc((size_t)ns + 1, 1);
    bool ok = first && adj && fill && stack && map && mark;
    int m = 0;
    for (int i = 0; ok && i < a->n; i++)
        if (a->e[i].kind != E_CLASS || a->e[i].n_cls > 0) a->e[m++] = a->e[i];
    a->n = ok ? m : a->n;
    for (int dir = 0; ok && dir < 2; dir++) { /* 0: forward from start (mark 1), 1: backward from final (mark 2) */
        memset(first, 0, ((size_t)ns + 1) * sizeof *first);
        memset(fill, 0, ((size_t)ns + 1) * sizeof *fill);
        for (int i = 0; i < a->n; i++) first[(dir ? a->e[i].to : a->e[i].from) + 1]++;
        for (int s = 0; s < ns; s++) first[s + 1] += first[s];
        for (int i = 0; i < a->n; i++) {
            int s = dir ? a->e[i].to : a->e[i].from;
            adj[first[s] + fill[s]++] = i;
        }
        int sp = 0, bit = 1 << dir, root = dir ? a->final : a->start;
        if (dir == 0 || (mark[root] & 1)) mark[root] |= (uint8_t)bit, stack[sp++] = root;
        while (sp) {
            int s = stack[--sp];
            for (int k = first[s]; k < first[s + 1]; k++) {
                int t = dir ? a->e[adj[k]].from : a->e[adj[k]].to;
                if ((mark[t] & bit) || (dir && !(mark[t] & 1))) continue;
                mark[t] |= (uint8_t)bit;
                stack[sp++] = t;
            }
        }
    }
    if (ok) {
        int32_t n = 0;
        for (int s = 0; s < ns; s++) map[s] = mark[s] == 3 ? n++ : -1;
        m = 0;
        for (int i = 0; i < a->n; i++)
            if (map[a->e[i].from] >= 0 && map[a->e[i].to] >= 0)
                a->e[m] = a->e[i], a->e[m].from = map[a->e[i].from], a->e[m].to = map[a->e[i].to], m++;
        a->n = m;
        a->n_states = n;
        a->start = map[a->start];
        a->final = map[a->final];
    }
    free(first), free(adj), free(fill), free(stack), free(map), free(mark);
    return ok || oom(p);
}

/* The search made explicit: [any]* before the match unless a ^ holds it at the
 * start, [any]* after it unless a $ holds it at the end. A state (q, phase):
 * phase 0: nothing read yet (a ^ passes), 1: something read, 2 and 3: the same
 * past a $ (nothing more may be read). Without a ^ in the pattern, phases 0
 * and 1 are one (and 2 and 3). */
static bool search(rx *p, const rx_nfa *a, bool has_bol, rx_nfa *out, int32_t any, int32_t n_any) {
    int32_t n = a->n_states, pre0 = 4 * n, pre1 = has_bol ? pre0 + 1 : pre0, post = pre0 + 2, fin = pre0 + 3;
#define AT(ph, q) ((has_bol ? (ph) : (ph) & 2) * n + (q))
    *out = (rx_nfa){.n_states = 4 * n + 4, .start = pre0, .final = fin};
    bool ok = EPS(p, out, pre0, a->start) && (!has_bol || edge(p, out, pre0, pre1, E_CLASS, any, n_any)) &&
              edge(p, out, pre1, pre1, E_CLASS, any, n_any) && EPS(p, out, pre1, AT(1, a->start));
    for (int i = 0; ok && i < a->n; i++) {
        rx_edge e = a->e[i];
        switch (e.kind) {
        case E_EPS:
            for (int ph = 0; ph < 4 && ok; ph++)
                if (has_bol || !(ph & 1)) ok = EPS(p, out, AT(ph, e.from), AT(ph, e.to));
            break;
        case E_CLASS:
            ok = edge(p, out, AT(0, e.from), AT(1, e.to), E_CLASS, e.cls, e.n_cls) &&
                 (!has_bol || edge(p, out, AT(1, e.from), AT(1, e.to), E_CLASS, e.cls, e.n_cls));
            break;
        case E_BOL: ok = EPS(p, out, AT(0, e.from), AT(0, e.to)) && EPS(p, out, AT(2, e.from), AT(2, e.to)); break;
        case E_EOL:
            for (int ph = 0; ph < 4 && ok; ph++)
                if (has_bol || !(ph & 1)) ok = EPS(p, out, AT(ph, e.from), AT(ph | 2, e.to));
            break;
        }
    }
    ok = ok && EPS(p, out, AT(0, a->final), post) && (!has_bol || EPS(p, out, AT(1, a->final), post)) &&
         edge(p, out, post, post, E_CLASS, any, n_any) && EPS(p, out, post, fin) && EPS(p, out, AT(2, a->final), fin) &&
         (!has_bol || EPS(p, out, AT(3, a->final), fin));
#undef AT
    return ok;
}

/* The product with a count of code points read: between lo and hi (hi < 0: lo or more) */
static bool counted(rx *p, const rx_nfa *a, int lo, int hi, rx_nfa *out) {
    int32_t n = a->n_states, top = hi >= 0 ? hi : lo;
    if ((int64_t)n * (top + 1) + 1 > RX_MAX_STATES)
        return fail(p, KVS_ERR_UNSUPPORTED, "the pattern with minLength/maxLength needs more than the bound of %d states",
                    RX_MAX_STATES);
    *out = (rx_nfa){.n_states = n * (top + 1) + 1, .start = a->start, .final = n * (top + 1)};
    bool ok = true;
    for (int i = 0; ok && i < a->n; i++) {
        rx_edge e = a->e[i];
        for (int k = 0; ok && k <= top; k++) {
            if (e.kind == E_EPS) ok = EPS(p, out, k * n + e.from, k * n + e.to);
            else if (k < top || hi < 0) ok = edge(p, out, k * n + e.from, (k < top ? k + 1 : k) * n + e.to, E_CLASS, e.cls, e.n_cls);
        }
    }
    for (int k = lo; ok && k <= top; k++) ok = EPS(p, out, k * n + a->final, out->final);
    return ok;
}

/* ---- bytes ----------------------------------------------------------------------------------- */
typedef struct {
    rx *p;
    gr_nfa *g;
    bool ok;
} emitter;

static int32_t g_state(emitter *m) {
    int32_t s = m->ok ? gr_nfa_state(m->g) : -1;
    m->ok &= s >= 0;
    return s < 0 ? 0 : s;
}
static void g_bytes(emitter *m, int32_t x, int lo, int hi, int32_t y) {
    m->ok = m->ok && gr_nfa_bytes(m->g, x, (uint8_t)lo, (uint8_t)hi, y);
}

static int utf8_encode(uint32_t c, uint8_t *b) {
    if (c < 0x80) return b[0] = (uint8_t)c, 1;
    if (c < 0x800) return b[0] = (uint8_t)(0xC0 | c >> 6), b[1] = (uint8_t)(0x80 | (c & 0x3F)), 2;
    if (c < 0x10000)
        return b[0] = (uint8_t)(0xE0 | c >> 12), b[1] = (uint8_t)(0x80 | (c >> 6 & 0x3F)), b[2] = (uint8_t)(0x80 | (c & 0x3F)), 3;
    b[0] = (uint8_t)(0xF0 | c >> 18), b[1] = (uint8_t)(0x80 | (c >> 12 & 0x3F));
    b[2] = (uint8_t)(0x80 | (c >> 6 & 0x3F)), b[3] = (uint8_t)(0x80 | (c & 0x3F));
    return 4;
}

/* code points lo..hi (>= 0x80, one side of the surrogates) as UTF-8: split until each
 * piece is a sequence of byte ranges */
static void utf8_range(emitter *m, int32_t from, int32_t to, uint32_t lo, uint32_t hi) {
    static const uint32_t last_of_len[] = {0x7FF, 0xFFFF};
    for (int i = 0; i < 2; i++)
        if (lo <= last_of_len[i] && hi > last_of_len[i]) {
            utf8_range(m, from, to, lo, last_of_len[i]);
            utf8_range(m, from, to, last_of_len[i] + 1, hi);
            return;
        }
    for (int i = 1; i < 4; i++) {
        uint32_t k = (1u << (6 * i)) - 1;
        if ((lo & ~k) == (hi & ~k)) continue;
        if (lo & k) {
            utf8_range(m, from, to, lo, lo | k);
            utf8_range(m, from, to, (lo | k) + 1, hi);
            return;
        }
        if ((hi & k) != k) {
            utf8_range(m, from, to, lo, (hi & ~k) - 1);
            utf8_range(m, from, to, hi & ~k, hi);
            return;
        }
    }
    uint8_t a[4], b[4];
    int n = utf8_encode(lo, a);
    utf8_encode(hi, b);
    int32_t x = from;
    for (int i = 0; i < n; i++) {
        int32_t y = i + 1 < n ? g_state(m) : to;
        g_bytes(m, x, a[i], b[i], y);
        x = y;
    }
}

/* the JSON text of the code points of r[0..n) from state from to state to */
static void class_bytes(emitter *m, int32_t from, int32_t to, const rx_range *r, int n) {
    int32_t bs = -1, u00 = -1, nibble[2] = {-1, -1}; /* after '\', after "\u00", after "\u000" / "\u001" */
    static const char short_escape[32] = {[8] = 'b', [9] = 't', [10] = 'n', [12] = 'f', [13] = 'r'};
    for (int i = 0; i < n; i++) {
        uint32_t lo = r[i].lo, hi = r[i].hi, top = hi < 0x7F ? hi : 0x7F;
        for (uint32_t c = lo; c <= top; c++) {
            bool raw = c >= 0x20 && c != '"' && c != '\\';
            if (raw) { /* a run of raw bytes, and \/ where it holds '/' */
                uint32_t end = c;
                while (end < top && end + 1 != '"' && end + 1 != '\\') end++;
                g_bytes(m, from, (int)c, (int)end, to);
                bool slash = c <= '/' && '/' <= end;
                c = end;
                if (!slash) continue;
            }
            uint32_t e = raw ? '/' : c; /* the code point escaped */
            if (bs < 0) bs = g_state(m), g_bytes(m, from, '\\', '\\', bs);
            if (e >= 0x20) { /* \" \\ \/ */
                g_bytes(m, bs, (int)e, (int)e, to);
                continue;
            }
            if (short_escape[e]) g_bytes(m, bs, short_escape[e], short_escape[e], to);
            if (u00 < 0) {
                int32_t u = g_state(m), z = g_state(m);
                u00 = g_state(m);
                g_bytes(m, bs, 'u', 'u', u);
                g_bytes(m, u, '0', '0', z);
                g_bytes(m, z, '0', '0', u00);
            }
            int h = (int)(e >> 4), l = (int)(e & 15);
            if (nibble[h] < 0) nibble[h] = g_state(m), g_bytes(m, u00, '0' + h, '0' + h, nibble[h]);
            if (l < 10) g_bytes(m, nibble[h], '0' + l, '0' + l, to);
            else g_bytes(m, nibble[h], 'a' + l - 10, 'a' + l - 10, to), g_bytes(m, nibble[h], 'A' + l - 10, 'A' + l - 10, to);
        }
        if (hi >= 0x80) utf8_range(m, from, to, lo > 0x80 ? lo : 0x80, hi);
    }
}

static bool emit(rx *p, const rx_nfa *a, gr_nfa *g, int x, int y) {
    emitter m = {p, g, true};
    int32_t *map = malloc(((size_t)a->n_states + 1) * sizeof *map);
    if (!map) return oom(p);
    for (int32_t s = 0; s < a->n_states; s++) map[s] = g_state(&m);
    m.ok = m.ok && gr_nfa_eps(g, x, map[a->start]) && gr_nfa_eps(g, map[a->final], y);
    for (int i = 0; m.ok && i < a->n; i++) {
        const rx_edge *e = &a->e[i];
        if (e->kind == E_EPS) m.ok = gr_nfa_eps(g, map[e->from], map[e->to]);
        else class_bytes(&m, map[e->from], map[e->to], p->pool.v + e->cls, e->n_cls);
    }
    free(map);
    if (m.ok) return true;
    if (g->budget && g->budget->code != KVS_OK) {
        if (p->st == KVS_OK) p->st = gr_budget_status(g->budget);
        return false;
    }
    return oom(p);
}

kvs_status gr_regex(gr_nfa *g, int x, int y, const char *pattern, size_t len, int lo, int hi, const char *where) {
    rx p = {.s = (const unsigned char *)pattern, .len = len, .where = where, .st = KVS_OK};
    rx_nfa a = {0}, b = {0}, c = {0};
    int32_t root = alternation(&p);
    if (root >= 0 && p.pos < p.len) /* alternation stops only at the end or a ')' */
        fail(&p, KVS_ERR_INVALID, "')' at offset %zu closes no group", p.pos);
    if (p.st == KVS_OK && positions(&p, root) > RX_MAX_POSITIONS)
        fail(&p, KVS_ERR_UNSUPPORTED, "the pattern multiplied out (each counted repetition copied) has more than the bound of %d positions",
             RX_MAX_POSITIONS);
    int32_t any = p.pool.n;
    rx_set all = {0};
    if (p.st == KVS_OK && set_add(&p, &all, 0, RX_MAX_CP) && set_within(&p, &all, false, WRITABLE, N_OF(WRITABLE)))
        set_add_all(&p, &p.pool, all.v, all.n);
    free(all.v);
    if (p.st == KVS_OK) {
        a.start = new_state(&a);
        a.final = build(&p, &a, root, a.start);
    }
    bool has_bol = false;
    for (int i = 0; i < p.n_nodes; i++) has_bol |= p.nodes[i].kind == RX_BOL;
    if (p.st == KVS_OK && search(&p, &a, has_bol, &b, any, N_OF(WRITABLE)) && trim(&p, &b) && b.n_states &&
        (lo > 0 || hi >= 0)) {
        if (counted(&p, &b, lo, hi, &c) && trim(&p, &c)) {
            free(b.e);
            b = c;
            c = (rx_nfa){0};
        }
    }
    if (p.st == KVS_OK && b.n_states == 0)
        fail(&p, KVS_ERR_INVALID, lo > 0 || hi >= 0 ? "no string of the length allowed (minLength, maxLength) matches the pattern"
                                                    : "no string matches the pattern");
    if (p.st == KVS_OK) emit(&p, &b, g, x, y);
    free(a.e), free(b.e), free(c.e), free(p.nodes), free(p.pool.v);
    return p.st;
}
