/* Chat-template lexer: Jinja source -> tokens.
 * Matches jinja2's lexer under transformers' settings: trim_blocks=True (the
 * first newline after a block or comment tag is dropped), lstrip_blocks=True
 * (spaces/tabs before a block or comment tag at the start of a line are
 * dropped), '-' strips all whitespace on that side of a tag, '+' disables
 * lstrip/trim, newlines are normalized to \n and one trailing newline of the
 * template is dropped. {% raw %}...{% endraw %} is handled here. */
#include <stdlib.h>
#include <string.h>

#include "template/template_internal.h"

typedef struct {
    ct_err *e;
    const char *s;
    size_t n, pos;
    ct_token *v;
    size_t nv, cap;
} lexer;

static bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }
static bool is_digit(char c) { return c >= '0' && c <= '9'; }
static bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
static bool is_name_char(char c) { return is_name_start(c) || is_digit(c); }

static ct_token *push(lexer *L, ct_tok_type t, const char *p, size_t n, size_t pos) {
    if (L->nv == L->cap) {
        size_t cap = L->cap ? L->cap * 2 : 64;
        ct_token *v = ct_alloc(L->e, cap * sizeof *v);
        if (L->nv) memcpy(v, L->v, L->nv * sizeof *v);
        L->v = v;
        L->cap = cap;
    }
    ct_token *t0 = &L->v[L->nv++];
    memset(t0, 0, sizeof *t0);
    t0->type = t;
    t0->s.p = p;
    t0->s.n = n;
    t0->pos = pos;
    return t0;
}

static void push_text(lexer *L, size_t from, size_t to) {
    if (to > from) push(L, T_TEXT, L->s + from, to - from, from);
}

/* Appends one code point as UTF-8; returns bytes written. */
static size_t put_utf8(char *o, uint32_t cp) {
    if (cp < 0x80) { o[0] = (char)cp; return 1; }
    if (cp < 0x800) { o[0] = (char)(0xC0 | (cp >> 6)); o[1] = (char)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | (cp >> 12)); o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (char)(0x80 | (cp & 0x3F)); return 3;
    }
    o[0] = (char)(0xF0 | (cp >> 18)); o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); o[3] = (char)(0x80 | (cp & 0x3F)); return 4;
}

static int hexval(char c) {
    if (is_digit(c)) return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* A quoted string with Python escapes (unicode-escape semantics; unknown escapes kept). */
static void lex_string(lexer *L) {
    size_t start = L->pos;
    char q = L->s[L->pos++];
    size_t end = L->pos;
    while (end < L->n && L->s[end] != q) end += (L->s[end] == '\\' && end + 1 < L->n) ? 2 : 1;
    if (end >= L->n) ct_fail(L->e, start, "unterminated string literal");
    char *o = ct_alloc(L->e, (end - L->pos) * 2 + 1);
    size_t k = 0;
    for (size_t i = L->pos; i < end;) {
        char c = L->s[i];
        if (c != '\\') { o[k++] = c; i++; continue; }
        char d = L->s[i + 1];
        i += 2;
        switch (d) {
        case 'n': o[k++] = '\n'; break;
        case 't': o[k++] = '\t'; break;
        case 'r': o[k++] = '\r'; break;
        case 'a': o[k++] = '\a'; break;
        case 'b': o[k++] = '\b'; break;
        case 'f': o[k++] = '\f'; break;
        case 'v': o[k++] = '\v'; break;
        case '\\': o[k++] = '\\'; break;
        case '\'': o[k++] = '\''; break;
        case '"': o[k++] = '"'; break;
        case '\n': break; /* line continuation */
        case 'x': case 'u': case 'U': {
            int nd = d == 'x' ? 2 : d == 'u' ? 4 : 8;
            uint32_t cp = 0;
            for (int j = 0; j < nd; j++) {
                int h = i + j < end ? hexval(L->s[i + j]) : -1;
                if (h < 0) ct_fail(L->e, i - 2, "invalid \\%c escape in string literal", d);
                cp = cp * 16 + (uint32_t)h;
            }
            if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
                ct_fail(L->e, i - 2, "invalid code point in string literal escape");
            i += (size_t)nd;
            k += put_utf8(o + k, cp);
            break;
        }
        default:
            if (d >= '0' && d <= '7') {
                uint32_t cp = (uint32_t)(d - '0');
                for (int j = 0; j < 2 && i < end && L->s[i] >= '0' && L->s[i] <= '7'; j++, i++)
                    cp = cp * 8 + (uint32_t)(L->s[i] - '0');
                k += put_utf8(o + k, cp);
            } else {
                o[k++] = '\\';
                o[k++] = d;
            }
        }
    }
    o[k] = 0;
    push(L, T_STRING, o, k, start);
    L->pos = end + 1;
}

static void lex_number(lexer *L) {
    size_t start = L->pos, i = L->pos;
    bool is_float = false;
    while (i < L->n && (is_digit(L->s[i]) || (L->s[i] == '_' && i + 1 < L->n && is_digit(L->s[i + 1])))) i++;
    if (i + 1 < L->n && L->s[i] == '.' && is_digit(L->s[i + 1])) {
        is_float = true;
        i++;
        while (i < L->n && (is_digit(L->s[i]) || (L->s[i] == '_' && i + 1 < L->n && is_digit(L->s[i + 1])))) i++;
    }
    if (i < L->n && (L->s[i] == 'e' || L->s[i] == 'E')) {
        size_t j = i + 1;
        if (j < L->n && (L->s[j] == '+' || L->s[j] == '-')) j++;
        if (j < L->n && is_digit(L->s[j])) {
            is_float = true;
            i = j;
            while (i < L->n && is_digit(L->s[i])) i++;
        }
    }
    char buf[128];
    size_t k = 0;
    for (size_t j = start; j < i && k < sizeof buf - 1; j++)
        if (L->s[j] != '_') buf[k++] = L->s[j];
    buf[k] = 0;
    if (i - start >= sizeof buf - 1) ct_fail(L->e, start, "number literal too long");
    ct_token *t = push(L, is_float ? T_FLOAT : T_INT, L->s + start, i - start, start);
    if (is_float) {
        t->fval = strtod(buf, NULL);
    } else {
        int64_t v = 0;
        for (size_t j = 0; j < k; j++) {
            if (v > (INT64_MAX - 9) / 10) ct_fail(L->e, start, "integer literal too large");
            v = v * 10 + (buf[j] - '0');
        }
        t->ival = v;
    }
    L->pos = i;
}

static const char *const OPS[] = { "**", "//", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~",
                                   "<", ">", "=", ".", ",", ":", "|", "(", ")", "[", "]", "{", "}" };

/* Tokens inside {{ }} or {% %}, up to and including the end marker. */
static void lex_tag(lexer *L, bool block, size_t tag_pos) {
    int depth = 0;
    for (;;) {
        while (L->pos < L->n && is_ws(L->s[L->pos])) L->pos++;
        if (L->pos >= L->n)
            ct_fail(L->e, tag_pos, "unclosed tag: expected '%s'", block ? "%}" : "}}");
        const char *p = L->s + L->pos;
        size_t left = L->n - L->pos;
        char endc = block ? '%' : '}';
        if (depth == 0) {
            bool minus = left >= 3 && p[0] == '-' && p[1] == endc && p[2] == '}';
            bool plus = block && left >= 3 && p[0] == '+' && p[1] == endc && p[2] == '}';
            bool plain = left >= 2 && p[0] == endc && p[1] == '}';
            if (minus || plus || plain) {
                push(L, block ? T_BLOCK_END : T_VAR_END, p, 2, L->pos);
                L->pos += (minus || plus) ? 3 : 2;
                if (minus) {
                    while (L->pos < L->n && is_ws(L->s[L->pos])) L->pos++;
                } else if (block && !plus && L->pos < L->n && L->s[L->pos] == '\n') {
                    L->pos++;
                }
                return;
            }
        }
        char c = p[0];
        if (c == '\'' || c == '"') { lex_string(L); continue; }
        if (is_digit(c)) { lex_number(L); continue; }
        if (is_name_start(c)) {
            size_t i = L->pos;
            while (i < L->n && is_name_char(L->s[i])) i++;
            push(L, T_NAME, p, i - L->pos, L->pos);
            L->pos = i;
            continue;
        }
        bool found = false;
        for (size_t k = 0; k < sizeof OPS / sizeof OPS[0]; k++) {
            size_t ol = strlen(OPS[k]);
            if (left >= ol && memcmp(p, OPS[k], ol) == 0) {
                push(L, T_OP, OPS[k], ol, L->pos);
                if (ol == 1 && (c == '(' || c == '[' || c == '{')) depth++;
                if (ol == 1 && (c == ')' || c == ']' || c == '}')) {
                    if (depth == 0) ct_fail(L->e, L->pos, "unexpected '%c'", c);
                    depth--;
                }
                L->pos += ol;
                found = true;
                break;
            }
        }
        if (!found) {
            if ((unsigned char)c >= 0x20 && (unsigned char)c < 0x7f)
                ct_fail(L->e, L->pos, "unexpected character '%c'", c);
            ct_fail(L->e, L->pos, "unexpected character (byte 0x%02x)", (unsigned char)c);
        }
    }
}

/* At L->pos just after "{%[-+]?": if the tag is "raw", consumes through endraw. */
static bool lex_raw(lexer *L) {
    size_t i = L->pos;
    while (i < L->n && is_ws(L->s[i])) i++;
    if (L->n - i < 3 || memcmp(L->s + i, "raw", 3) != 0) return false;
    i += 3;
    while (i < L->n && is_ws(L->s[i])) i++;
    bool minus = i < L->n && L->s[i] == '-';
    if (i < L->n && (L->s[i] == '-' || L->s[i] == '+')) i++;
    if (L->n - i < 2 || L->s[i] != '%' || L->s[i + 1] != '}') return false;
    i += 2;
    if (minus) while (i < L->n && is_ws(L->s[i])) i++;
    else if (i < L->n && L->s[i] == '\n') i++;
    size_t body = i;
    for (size_t j = body; j + 1 < L->n; j++) {
        if (L->s[j] != '{' || L->s[j + 1] != '%') continue;
        size_t k = j + 2;
        bool strip = k < L->n && L->s[k] == '-';
        if (k < L->n && (L->s[k] == '-' || L->s[k] == '+')) k++;
        while (k < L->n && is_ws(L->s[k])) k++;
        if (L->n - k < 6 || memcmp(L->s + k, "endraw", 6) != 0) continue;
        k += 6;
        while (k < L->n && is_ws(L->s[k])) k++;
        bool strip_after = k < L->n && L->s[k] == '-';
        bool keep = k < L->n && L->s[k] == '+';
        if (strip_after || keep) k++;
        if (L->n - k < 2 || L->s[k] != '%' || L->s[k + 1] != '}') continue;
        size_t text_end = j;
        if (strip) while (text_end > body && is_ws(L->s[text_end - 1])) text_end--;
        push_text(L, body, text_end);
        k += 2;
        if (strip_after) while (k < L->n && is_ws(L->s[k])) k++;
        else if (!keep && k < L->n && L->s[k] == '\n') k++;
        L->pos = k;
        return true;
    }
    ct_fail(L->e, L->pos - 2, "unclosed 'raw' block");
}

void ct_lex(ct_err *e, const char *src, size_t len, ct_token **toks, size_t *n_toks) {
    char *s = ct_alloc(e, len + 1);
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            s[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n') i++;
        } else {
            s[n++] = src[i];
        }
    }
    if (n > 0 && s[n - 1] == '\n') n--;
    s[n] = 0;
    e->src = s;
    e->src_len = n;
    lexer L = { .e = e, .s = s, .n = n };
    while (L.pos < n) {
        size_t tag = L.pos;
        int kind = 0; /* 1 var, 2 block, 3 comment */
        for (; tag + 1 < n; tag++) {
            if (s[tag] != '{') continue;
            char c = s[tag + 1];
            if (c == '{') { kind = 1; break; }
            if (c == '%') { kind = 2; break; }
            if (c == '#') { kind = 3; break; }
        }
        if (!kind) { push_text(&L, L.pos, n); break; }
        char sign = tag + 2 < n ? s[tag + 2] : 0;
        size_t text_end = tag;
        if (sign == '-') {
            while (text_end > L.pos && is_ws(s[text_end - 1])) text_end--;
        } else if (sign != '+' && kind != 1) {
            size_t l = text_end;
            while (l > L.pos && (s[l - 1] == ' ' || s[l - 1] == '\t' || s[l - 1] == '\f' || s[l - 1] == '\v')) l--;
            bool at_line_start = l > L.pos ? s[l - 1] == '\n' : (l == 0 || s[l - 1] == '\n');
            if (at_line_start) text_end = l;
        }
        push_text(&L, L.pos, text_end);
        L.pos = tag + 2 + (sign == '-' || sign == '+');
        if (kind == 3) {
            size_t j = L.pos;
            while (j + 1 < n && !(s[j] == '#' && s[j + 1] == '}')) j++;
            if (j + 1 >= n) ct_fail(e, tag, "unclosed comment: expected '#}'");
            bool minus = j > L.pos && s[j - 1] == '-';
            bool plus = j > L.pos && s[j - 1] == '+';
            L.pos = j + 2;
            if (minus) while (L.pos < n && is_ws(s[L.pos])) L.pos++;
            else if (!plus && L.pos < n && s[L.pos] == '\n') L.pos++;
        } else if (kind == 2 && lex_raw(&L)) {
            continue;
        } else {
            push(&L, kind == 1 ? T_VAR_BEGIN : T_BLOCK_BEGIN, s + tag, 2, tag);
            lex_tag(&L, kind == 2, tag);
        }
    }
    push(&L, T_EOF, s + n, 0, n);
    *toks = L.v;
    *n_toks = L.nv;
}
