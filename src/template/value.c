/* Chat-template values: constructors, lists and dicts, truthiness, equality and
 * ordering (Python semantics), str()/repr() and json.dumps()-compatible output,
 * UTF-8 helpers. All memory comes from the render arena. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "template/template_internal.h"

ct_value ct_none(void) { return (ct_value){ .t = V_NONE }; }
ct_value ct_undef(ct_str name) { return (ct_value){ .t = V_UNDEF, .s = name }; }
ct_value ct_bool(bool b) { return (ct_value){ .t = V_BOOL, .b = b }; }
ct_value ct_int(int64_t i) { return (ct_value){ .t = V_INT, .i = i }; }
ct_value ct_float(double f) { return (ct_value){ .t = V_FLOAT, .f = f }; }
ct_value ct_strref(ct_str s) { return (ct_value){ .t = V_STR, .s = s }; }
ct_value ct_listv(ct_list *l) { return (ct_value){ .t = V_LIST, .l = l }; }

ct_value ct_strv(ct_ctx *c, const char *p, size_t n) {
    if (n > CT_MAX_OUTPUT) ct_fail(c->e, CT_NOPOS, "string too long (limit %u bytes)", CT_MAX_OUTPUT);
    char *s = ct_alloc(c->e, n + 1);
    if (n) memcpy(s, p, n);
    s[n] = 0;
    return ct_strref((ct_str){ s, n });
}

ct_list *ct_list_new(ct_ctx *c, size_t n) {
    ct_list *l = ct_alloc(c->e, sizeof *l);
    if (n > CT_RENDER_MEM / sizeof(ct_value)) ct_fail(c->e, CT_NOPOS, "list too long");
    l->v = n ? ct_alloc(c->e, n * sizeof(ct_value)) : NULL;
    l->n = n;
    return l;
}

ct_dict *ct_dict_new(ct_ctx *c) {
    ct_dict *d = ct_alloc(c->e, sizeof *d);
    memset(d, 0, sizeof *d);
    return d;
}

ct_value *ct_dict_get(const ct_dict *d, ct_value k) {
    for (size_t i = 0; i < d->n; i++)
        if (ct_equal(d->k[i], k)) return &d->v[i];
    return NULL;
}

ct_value *ct_dict_gets(const ct_dict *d, const char *k, size_t n) {
    return ct_dict_get(d, ct_strref((ct_str){ k, n }));
}

void ct_dict_set(ct_ctx *c, ct_dict *d, ct_value k, ct_value v) {
    ct_value *old = ct_dict_get(d, k);
    if (old) { *old = v; return; }
    if (d->n == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 4;
        ct_value *nk = ct_alloc(c->e, cap * sizeof *nk), *nv = ct_alloc(c->e, cap * sizeof *nv);
        if (d->n) {
            memcpy(nk, d->k, d->n * sizeof *nk);
            memcpy(nv, d->v, d->n * sizeof *nv);
        }
        d->k = nk; d->v = nv; d->cap = cap;
    }
    d->k[d->n] = k;
    d->v[d->n++] = v;
}

void ct_buf_put(ct_ctx *c, ct_buf *b, const char *p, size_t n) {
    if (n == 0) return;
    if (n > CT_MAX_OUTPUT || b->n + n > CT_MAX_OUTPUT)
        ct_fail(c->e, CT_NOPOS, "output too long (limit %u bytes)", CT_MAX_OUTPUT);
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *np = ct_alloc(c->e, cap);
        if (b->n) memcpy(np, b->p, b->n);
        b->p = np;
        b->cap = cap;
    }
    memcpy(b->p + b->n, p, n);
    b->n += n;
    b->p[b->n] = 0;
}

ct_value ct_buf_value(ct_buf *b) { return ct_strref((ct_str){ b->p ? b->p : "", b->n }); }

bool ct_is_num(ct_value v) { return v.t == V_BOOL || v.t == V_INT || v.t == V_FLOAT; }
double ct_num(ct_value v) { return v.t == V_FLOAT ? v.f : v.t == V_INT ? (double)v.i : (double)v.b; }

bool ct_truthy(ct_value v) {
    switch (v.t) {
    case V_UNDEF: case V_NONE: return false;
    case V_BOOL: return v.b;
    case V_INT: return v.i != 0;
    case V_FLOAT: return v.f != 0;
    case V_STR: return v.s.n != 0;
    case V_LIST: return v.l->n != 0;
    case V_DICT: return v.d->ns || v.d->n != 0;
    default: return true;
    }
}

/* Values can nest arbitrarily deep (built in loops): recursion stops at a depth
 * limit, where deeper structures compare unequal / fail to order. */
#define VALUE_DEPTH 200

static bool equal_d(ct_value a, ct_value b, int depth) {
    if (depth > VALUE_DEPTH) return false;
    if (ct_is_num(a) && ct_is_num(b)) {
        if (a.t != V_FLOAT && b.t != V_FLOAT) {
            int64_t x = a.t == V_INT ? a.i : a.b, y = b.t == V_INT ? b.i : b.b;
            return x == y;
        }
        return ct_num(a) == ct_num(b);
    }
    if (a.t != b.t) return false;
    switch (a.t) {
    case V_UNDEF: case V_NONE: return true;
    case V_STR: return a.s.n == b.s.n && memcmp(a.s.p, b.s.p, a.s.n) == 0;
    case V_LIST:
        if (a.tuple != b.tuple || a.l->n != b.l->n) return false;
        for (size_t i = 0; i < a.l->n; i++)
            if (!equal_d(a.l->v[i], b.l->v[i], depth + 1)) return false;
        return true;
    case V_DICT:
        if (a.d->ns || b.d->ns) return a.d == b.d;
        if (a.d->n != b.d->n) return false;
        for (size_t i = 0; i < a.d->n; i++) {
            ct_value *o = NULL;
            for (size_t k = 0; k < b.d->n && !o; k++)
                if (equal_d(a.d->k[i], b.d->k[k], depth + 1)) o = &b.d->v[k];
            if (!o || !equal_d(a.d->v[i], *o, depth + 1)) return false;
        }
        return true;
    case V_MACRO: return a.macro == b.macro;
    case V_FUNC: return a.fn == b.fn;
    default: return false;
    }
}

bool ct_equal(ct_value a, ct_value b) { return equal_d(a, b, 0); }

const char *ct_type_name(ct_value v) {
    switch (v.t) {
    case V_UNDEF: return "undefined";
    case V_NONE: return "NoneType";
    case V_BOOL: return "bool";
    case V_INT: return "int";
    case V_FLOAT: return "float";
    case V_STR: return "str";
    case V_LIST: return v.tuple ? "tuple" : "list";
    case V_DICT: return v.d->ns ? "Namespace" : "dict";
    case V_MACRO: return "Macro";
    case V_FUNC: return "function";
    case V_METHOD: return "method";
    default: return "LoopContext";
    }
}

static int compare_d(ct_ctx *c, ct_value a, ct_value b, size_t pos, int depth) {
    if (depth > VALUE_DEPTH) ct_fail(c->e, pos, "values nested too deeply to compare");
    if (ct_is_num(a) && ct_is_num(b)) {
        double x = ct_num(a), y = ct_num(b);
        if (a.t != V_FLOAT && b.t != V_FLOAT) {
            int64_t p = a.t == V_INT ? a.i : a.b, q = b.t == V_INT ? b.i : b.b;
            return p < q ? -1 : p > q;
        }
        return x < y ? -1 : x > y;
    }
    if (a.t == V_STR && b.t == V_STR) {
        size_t n = a.s.n < b.s.n ? a.s.n : b.s.n;
        int r = n ? memcmp(a.s.p, b.s.p, n) : 0;
        if (r) return r < 0 ? -1 : 1;
        return a.s.n < b.s.n ? -1 : a.s.n > b.s.n;
    }
    if (a.t == V_LIST && b.t == V_LIST) {
        for (size_t i = 0; i < a.l->n && i < b.l->n; i++) {
            if (equal_d(a.l->v[i], b.l->v[i], depth + 1)) continue;
            return compare_d(c, a.l->v[i], b.l->v[i], pos, depth + 1);
        }
        return a.l->n < b.l->n ? -1 : a.l->n > b.l->n;
    }
    ct_fail(c->e, pos, "cannot compare '%s' with '%s'", ct_type_name(a), ct_type_name(b));
}

int ct_compare(ct_ctx *c, ct_value a, ct_value b, size_t pos) { return compare_d(c, a, b, pos, 0); }

void ct_fmt_float(double f, char out[40]) {
    if (isnan(f)) { strcpy(out, "nan"); return; }
    if (isinf(f)) { strcpy(out, f < 0 ? "-inf" : "inf"); return; }
    char tmp[40];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*e", prec - 1, f);
        if (strtod(tmp, NULL) == f) break;
    }
    /* tmp = [-]d[.ddd]e[+-]XX */
    char digits[24];
    int nd = 0, exp10;
    const char *p = tmp;
    bool neg = *p == '-';
    if (neg) p++;
    for (; *p && *p != 'e'; p++)
        if (*p != '.') digits[nd++] = *p;
    exp10 = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    char *o = out;
    if (neg) *o++ = '-';
    if (exp10 >= -4 && exp10 < 16) {
        if (exp10 < 0) {
            *o++ = '0'; *o++ = '.';
            for (int i = 0; i < -exp10 - 1; i++) *o++ = '0';
            for (int i = 0; i < nd; i++) *o++ = digits[i];
        } else {
            for (int i = 0; i <= exp10; i++) *o++ = i < nd ? digits[i] : '0';
            *o++ = '.';
            if (nd > exp10 + 1) for (int i = exp10 + 1; i < nd; i++) *o++ = digits[i];
            else *o++ = '0';
        }
        *o = 0;
    } else {
        *o++ = digits[0];
        if (nd > 1) {
            *o++ = '.';
            for (int i = 1; i < nd; i++) *o++ = digits[i];
        }
        snprintf(o, 16, "e%c%02d", exp10 < 0 ? '-' : '+', exp10 < 0 ? -exp10 : exp10);
    }
}

static void write_repr_str(ct_ctx *c, ct_buf *b, ct_str s) {
    bool has_sq = memchr(s.p, '\'', s.n) != NULL, has_dq = memchr(s.p, '"', s.n) != NULL;
    char q = has_sq && !has_dq ? '"' : '\'';
    ct_buf_put(c, b, &q, 1);
    for (size_t i = 0; i < s.n; i++) {
        unsigned char ch = (unsigned char)s.p[i];
        char esc[8];
        if (ch == '\\' || ch == (unsigned char)q) { esc[0] = '\\'; esc[1] = (char)ch; ct_buf_put(c, b, esc, 2); }
        else if (ch == '\n') ct_buf_puts(c, b, "\\n");
        else if (ch == '\r') ct_buf_puts(c, b, "\\r");
        else if (ch == '\t') ct_buf_puts(c, b, "\\t");
        else if (ch < 0x20 || ch == 0x7f) { snprintf(esc, sizeof esc, "\\x%02x", ch); ct_buf_puts(c, b, esc); }
        else ct_buf_put(c, b, (const char *)&ch, 1);
    }
    ct_buf_put(c, b, &q, 1);
}

static void write_scalar(ct_ctx *c, ct_buf *b, ct_value v) {
    char tmp[48];
    switch (v.t) {
    case V_NONE: ct_buf_puts(c, b, "None"); break;
    case V_BOOL: ct_buf_puts(c, b, v.b ? "True" : "False"); break;
    case V_INT: snprintf(tmp, sizeof tmp, "%lld", (long long)v.i); ct_buf_puts(c, b, tmp); break;
    case V_FLOAT: ct_fmt_float(v.f, tmp); ct_buf_puts(c, b, tmp); break;
    case V_MACRO: ct_buf_puts(c, b, "<Macro>"); break;
    case V_FUNC: ct_buf_puts(c, b, "<built-in function>"); break;
    case V_METHOD: ct_buf_puts(c, b, "<built-in method>"); break;
    case V_LOOP: ct_buf_puts(c, b, "<LoopContext>"); break;
    default: break;
    }
}

void ct_write_repr(ct_ctx *c, ct_buf *b, ct_value v) {
    ct_step(c, CT_NOPOS);
    if (++c->depth > 500) ct_fail(c->e, CT_NOPOS, "value nested too deeply");
    if (v.t == V_STR) {
        write_repr_str(c, b, v.s);
    } else if (v.t == V_UNDEF) {
        ct_buf_puts(c, b, "Undefined");
    } else if (v.t == V_LIST) {
        ct_buf_puts(c, b, v.tuple ? "(" : "[");
        for (size_t i = 0; i < v.l->n; i++) {
            if (i) ct_buf_puts(c, b, ", ");
            ct_write_repr(c, b, v.l->v[i]);
        }
        if (v.tuple && v.l->n == 1) ct_buf_puts(c, b, ",");
        ct_buf_puts(c, b, v.tuple ? ")" : "]");
    } else if (v.t == V_DICT) {
        ct_buf_puts(c, b, v.d->ns ? "<Namespace {" : "{");
        for (size_t i = 0; i < v.d->n; i++) {
            if (i) ct_buf_puts(c, b, ", ");
            ct_write_repr(c, b, v.d->k[i]);
            ct_buf_puts(c, b, ": ");
            ct_write_repr(c, b, v.d->v[i]);
        }
        ct_buf_puts(c, b, v.d->ns ? "}>" : "}");
    } else {
        write_scalar(c, b, v);
    }
    c->depth--;
}

void ct_write_str(ct_ctx *c, ct_buf *b, ct_value v) {
    if (v.t == V_STR) ct_buf_put(c, b, v.s.p, v.s.n);
    else if (v.t == V_UNDEF) return;
    else ct_write_repr(c, b, v);
}

ct_str ct_to_str(ct_ctx *c, ct_value v) {
    if (v.t == V_STR) return v.s;
    ct_buf b = { 0 };
    ct_write_str(c, &b, v);
    return ct_buf_value(&b).s;
}

static void json_str(ct_ctx *c, ct_buf *b, ct_str s, bool ascii) {
    ct_buf_puts(c, b, "\"");
    for (size_t i = 0; i < s.n;) {
        unsigned char ch = (unsigned char)s.p[i];
        char esc[16];
        if (ch == '"') ct_buf_puts(c, b, "\\\"");
        else if (ch == '\\') ct_buf_puts(c, b, "\\\\");
        else if (ch == '\n') ct_buf_puts(c, b, "\\n");
        else if (ch == '\r') ct_buf_puts(c, b, "\\r");
        else if (ch == '\t') ct_buf_puts(c, b, "\\t");
        else if (ch == '\b') ct_buf_puts(c, b, "\\b");
        else if (ch == '\f') ct_buf_puts(c, b, "\\f");
        else if (ch < 0x20) { snprintf(esc, sizeof esc, "\\u%04x", ch); ct_buf_puts(c, b, esc); }
        else if (ch >= 0x80 && ascii) {
            /* one character from its lead byte; a byte that starts none (invalid UTF-8) is U+FFFD */
            size_t len = (ch & 0xE0) == 0xC0 ? 2 : (ch & 0xF0) == 0xE0 ? 3 : (ch & 0xF8) == 0xF0 ? 4 : 1;
            for (size_t k = 1; k < len; k++)
                if (i + k >= s.n || ((unsigned char)s.p[i + k] & 0xC0) != 0x80) len = 1;
            uint32_t cp = len == 1 ? 0xFFFD : ch & (0xFF >> (len + 1));
            for (size_t k = 1; k < len; k++) cp = (cp << 6) | ((unsigned char)s.p[i + k] & 0x3F);
            if (cp >= 0x10000) {
                cp -= 0x10000;
                snprintf(esc, sizeof esc, "\\u%04x\\u%04x", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
            } else {
                snprintf(esc, sizeof esc, "\\u%04x", cp);
            }
            ct_buf_puts(c, b, esc);
            i += len;
            continue;
        } else ct_buf_put(c, b, (const char *)&ch, 1);
        i++;
    }
    ct_buf_puts(c, b, "\"");
}

static void json_newline(ct_ctx *c, ct_buf *b, const ct_json_opts *o, int level) {
    ct_buf_puts(c, b, "\n");
    for (int i = 0; i < level; i++) ct_buf_put(c, b, o->indent, o->indent_n);
}

static void json_key(ct_ctx *c, ct_buf *b, ct_value k, const ct_json_opts *o, size_t pos) {
    char tmp[48];
    switch (k.t) {
    case V_STR: json_str(c, b, k.s, o->ascii); return;
    case V_NONE: ct_buf_puts(c, b, "\"null\""); return;
    case V_BOOL: ct_buf_puts(c, b, k.b ? "\"true\"" : "\"false\""); return;
    case V_INT: snprintf(tmp, sizeof tmp, "\"%lld\"", (long long)k.i); ct_buf_puts(c, b, tmp); return;
    case V_FLOAT: ct_fmt_float(k.f, tmp); ct_buf_puts(c, b, "\""); ct_buf_puts(c, b, tmp); ct_buf_puts(c, b, "\""); return;
    default: ct_fail(c->e, pos, "tojson: keys must be str, int, float, bool or None, not %s", ct_type_name(k));
    }
}

void ct_write_json(ct_ctx *c, ct_buf *b, ct_value v, const ct_json_opts *o, int level, size_t pos) {
    char tmp[48];
    ct_step(c, pos);
    if (level > 500) ct_fail(c->e, pos, "tojson: value nested too deeply");
    switch (v.t) {
    case V_NONE: ct_buf_puts(c, b, "null"); return;
    case V_BOOL: ct_buf_puts(c, b, v.b ? "true" : "false"); return;
    case V_INT: snprintf(tmp, sizeof tmp, "%lld", (long long)v.i); ct_buf_puts(c, b, tmp); return;
    case V_FLOAT:
        if (isnan(v.f)) ct_buf_puts(c, b, "NaN");
        else if (isinf(v.f)) ct_buf_puts(c, b, v.f < 0 ? "-Infinity" : "Infinity");
        else { ct_fmt_float(v.f, tmp); ct_buf_puts(c, b, tmp); }
        return;
    case V_STR: json_str(c, b, v.s, o->ascii); return;
    case V_LIST:
        if (v.l->n == 0) { ct_buf_puts(c, b, "[]"); return; }
        ct_buf_puts(c, b, "[");
        for (size_t i = 0; i < v.l->n; i++) {
            if (i) ct_buf_put(c, b, o->item_sep.p, o->item_sep.n);
            if (o->indent) json_newline(c, b, o, level + 1);
            ct_write_json(c, b, v.l->v[i], o, level + 1, pos);
        }
        if (o->indent) json_newline(c, b, o, level);
        ct_buf_puts(c, b, "]");
        return;
    case V_DICT: {
        if (v.d->ns) break;
        if (v.d->n == 0) { ct_buf_puts(c, b, "{}"); return; }
        size_t n = v.d->n;
        size_t *order = ct_alloc(c->e, n * sizeof *order);
        for (size_t i = 0; i < n; i++) order[i] = i;
        if (o->sort) /* insertion sort: stable, keys compared like Python */
            for (size_t i = 1; i < n; i++)
                for (size_t j = i; j > 0 && ct_compare(c, v.d->k[order[j - 1]], v.d->k[order[j]], pos) > 0; j--) {
                    size_t t = order[j]; order[j] = order[j - 1]; order[j - 1] = t;
                }
        ct_buf_puts(c, b, "{");
        for (size_t i = 0; i < n; i++) {
            if (i) ct_buf_put(c, b, o->item_sep.p, o->item_sep.n);
            if (o->indent) json_newline(c, b, o, level + 1);
            json_key(c, b, v.d->k[order[i]], o, pos);
            ct_buf_put(c, b, o->key_sep.p, o->key_sep.n);
            ct_write_json(c, b, v.d->v[order[i]], o, level + 1, pos);
        }
        if (o->indent) json_newline(c, b, o, level);
        ct_buf_puts(c, b, "}");
        return;
    }
    default: break;
    }
    ct_fail(c->e, pos, "tojson: object of type '%s' is not JSON serializable", ct_type_name(v));
}

/* A character is a byte plus the continuation bytes after it (so invalid UTF-8
 * still splits into well-defined pieces). */
size_t ct_utf8_len(const char *p, size_t n) {
    size_t k = 0;
    for (size_t i = 0; i < n; k++) {
        i++;
        while (i < n && ((unsigned char)p[i] & 0xC0) == 0x80) i++;
    }
    return k;
}

size_t ct_utf8_offset(const char *p, size_t n, size_t idx) {
    size_t i = 0;
    for (size_t k = 0; k < idx && i < n; k++) {
        i++;
        while (i < n && ((unsigned char)p[i] & 0xC0) == 0x80) i++;
    }
    return i;
}

ct_list *ct_iterate(ct_ctx *c, ct_value v, size_t pos) {
    switch (v.t) {
    case V_UNDEF: return ct_list_new(c, 0);
    case V_LIST: return v.l;
    case V_DICT: {
        if (v.d->ns) break;
        ct_list *l = ct_list_new(c, v.d->n);
        for (size_t i = 0; i < v.d->n; i++) l->v[i] = v.d->k[i];
        return l;
    }
    case V_STR: {
        ct_list *l = ct_list_new(c, ct_utf8_len(v.s.p, v.s.n));
        size_t at = 0;
        for (size_t i = 0; i < l->n; i++) {
            size_t len = ct_utf8_offset(v.s.p + at, v.s.n - at, 1);
            l->v[i] = ct_strref((ct_str){ v.s.p + at, len });
            at += len;
        }
        return l;
    }
    default: break;
    }
    ct_fail(c->e, pos, "'%s' object is not iterable", ct_type_name(v));
}
