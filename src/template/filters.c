/* Chat-template filters and tests (jinja2's builtins, plus transformers' tojson
 * that matches Python's json.dumps(ensure_ascii=False) with its separators). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "template/template_internal.h"

static bool str_eq(ct_str a, const char *b) { return a.n == strlen(b) && memcmp(a.p, b, a.n) == 0; }
static ct_value empty_str(void) { return ct_strref((ct_str){ "", 0 }); }

static const char *const FILTERS[] = { "abs", "capitalize", "count", "d", "default", "dictsort", "e", "escape",
    "first", "float", "forceescape", "format", "indent", "int", "items", "join", "last", "length", "list", "lower",
    "map", "max", "min", "reject", "rejectattr", "replace", "reverse", "round", "safe", "select", "selectattr",
    "sort", "string", "sum", "title", "tojson", "trim", "unique", "upper", "wordcount", NULL };
static const char *const TESTS[] = { "defined", "undefined", "none", "string", "mapping", "iterable", "sequence",
    "number", "integer", "float", "boolean", "true", "false", "callable", "odd", "even", "divisibleby", "eq",
    "equalto", "ne", "lt", "le", "gt", "ge", "lessthan", "greaterthan", "in", "lower", "upper", "sameas",
    "escaped", NULL };

static bool known(const char *const *names, const char *s, size_t n) {
    for (int i = 0; names[i]; i++)
        if (strlen(names[i]) == n && memcmp(names[i], s, n) == 0) return true;
    return false;
}
bool ct_filter_known(const char *name, size_t n) { return known(FILTERS, name, n); }
bool ct_test_known(const char *name, size_t n) { return known(TESTS, name, n); }

static ct_value lower_if_str(ct_ctx *c, ct_value v, bool case_sensitive) {
    return (!case_sensitive && v.t == V_STR) ? ct_str_case(c, v.s, CASE_LOWER) : v;
}

/* attribute path "a.b.0" as jinja's make_attrgetter */
static ct_value get_path(ct_ctx *c, ct_value v, ct_value attr, size_t pos) {
    if (attr.t == V_INT) return ct_getitem(c, v, attr, pos);
    if (attr.t != V_STR) ct_fail(c->e, pos, "attribute must be a string");
    ct_str s = attr.s;
    for (size_t i = 0; i <= s.n;) {
        size_t j = i;
        while (j < s.n && s.p[j] != '.') j++;
        ct_str part = { s.p + i, j - i };
        bool digits = part.n > 0 && part.n < 18;
        int64_t k = 0;
        for (size_t q = 0; q < part.n && digits; q++) {
            digits = part.p[q] >= '0' && part.p[q] <= '9';
            k = k * 10 + (part.p[q] - '0');
        }
        v = ct_getitem(c, v, digits ? ct_int(k) : ct_strref(part), pos);
        i = j + 1;
    }
    return v;
}

/* stable merge sort of items by key (attribute / case-insensitive) */
static void sort_values(ct_ctx *c, ct_value *v, ct_value *keys, size_t n, bool reverse, size_t pos) {
    if (n < 2) return;
    size_t h = n / 2;
    sort_values(c, v, keys, h, reverse, pos);
    sort_values(c, v + h, keys + h, n - h, reverse, pos);
    ct_value *tv = ct_alloc(c->e, n * sizeof *tv), *tk = ct_alloc(c->e, n * sizeof *tk);
    size_t i = 0, j = h, k = 0;
    while (i < h || j < n) {
        bool take_left = j >= n;
        if (i < h && j < n) {
            int r = ct_compare(c, keys[i], keys[j], pos);
            take_left = reverse ? r >= 0 : r <= 0;
        }
        ct_step(c, pos);
        if (take_left) { tv[k] = v[i]; tk[k++] = keys[i++]; }
        else { tv[k] = v[j]; tk[k++] = keys[j++]; }
    }
    memcpy(v, tv, n * sizeof *v);
    memcpy(keys, tk, n * sizeof *keys);
}

static ct_value escape_html(ct_ctx *c, ct_str s) {
    ct_buf b = { 0 };
    for (size_t i = 0; i < s.n; i++) {
        switch (s.p[i]) {
        case '&': ct_buf_puts(c, &b, "&amp;"); break;
        case '<': ct_buf_puts(c, &b, "&lt;"); break;
        case '>': ct_buf_puts(c, &b, "&gt;"); break;
        case '"': ct_buf_puts(c, &b, "&#34;"); break;
        case '\'': ct_buf_puts(c, &b, "&#39;"); break;
        default: ct_buf_put(c, &b, s.p + i, 1);
        }
    }
    return b.p ? ct_buf_value(&b) : empty_str();
}

static ct_value to_number(ct_ctx *c, ct_value v, bool want_int, ct_value dflt) {
    if (v.t == V_INT || v.t == V_BOOL) return want_int ? ct_int(v.t == V_INT ? v.i : v.b) : ct_float(ct_num(v));
    if (v.t == V_FLOAT) {
        if (!want_int) return v;
        if (!isfinite(v.f) || fabs(v.f) >= 9.2e18) return dflt;
        return ct_int((int64_t)v.f);
    }
    if (v.t != V_STR || v.s.n > 300) return dflt;
    char buf[320];
    size_t k = 0;
    for (size_t i = 0; i < v.s.n; i++)
        if (v.s.p[i] != '_') buf[k++] = v.s.p[i];
    buf[k] = 0;
    char *end;
    if (want_int) {
        long long x = strtoll(buf, &end, 10);
        while (*end == ' ' || *end == '\t' || *end == '\n') end++;
        if (end != buf && *end == 0) return ct_int(x);
    }
    double f = strtod(buf, &end);
    while (*end == ' ' || *end == '\t' || *end == '\n') end++;
    if (end == buf || *end != 0) return dflt;
    if (want_int) return (!isfinite(f) || fabs(f) >= 9.2e18) ? dflt : ct_int((int64_t)f);
    return ct_float(f);
}

static ct_value indent(ct_ctx *c, ct_str s, ct_value width, bool first, bool blank) {
    ct_buf ind = { 0 }, b = { 0 };
    if (width.t == V_STR) ct_buf_put(c, &ind, width.s.p, width.s.n);
    else for (int64_t i = 0, w = width.t == V_INT ? width.i : 4; i < w && i < 1000; i++) ct_buf_puts(c, &ind, " ");
    if (first) ct_buf_put(c, &b, ind.p, ind.n);
    size_t st = 0;
    bool first_line = true;
    for (size_t i = 0; i <= s.n; i++) {
        if (i < s.n && s.p[i] != '\n') continue;
        if (i == s.n && st == s.n) break;
        if (!first_line) {
            ct_buf_puts(c, &b, "\n");
            if (blank || i > st) ct_buf_put(c, &b, ind.p, ind.n);
        }
        ct_buf_put(c, &b, s.p + st, i - st);
        first_line = false;
        st = i + 1;
    }
    return b.p ? ct_buf_value(&b) : empty_str();
}

static ct_value printf_format(ct_ctx *c, ct_str f, ct_args *a) {
    ct_buf b = { 0 };
    int k = 0;
    for (size_t i = 0; i < f.n; i++) {
        if (f.p[i] != '%') { ct_buf_put(c, &b, f.p + i, 1); continue; }
        char conv = i + 1 < f.n ? f.p[++i] : 0;
        if (conv == '%') { ct_buf_puts(c, &b, "%"); continue; }
        if (k >= a->n) ct_fail(c->e, a->pos, "format: not enough arguments for format string");
        ct_value v = a->v[k++];
        if (conv == 's') ct_write_str(c, &b, v);
        else if (conv == 'r') ct_write_repr(c, &b, v);
        else if ((conv == 'd' || conv == 'i') && ct_is_num(v)) ct_write_str(c, &b, to_number(c, v, true, v));
        else ct_fail(c->e, a->pos, "format: unsupported conversion");
    }
    return b.p ? ct_buf_value(&b) : empty_str();
}

static ct_value tojson(ct_ctx *c, ct_value v, ct_args *a) {
    ct_json_opts o = { .item_sep = { ", ", 2 }, .key_sep = { ": ", 2 } };
    o.ascii = ct_truthy(ct_arg(a, 0, "ensure_ascii", ct_bool(false)));
    ct_value ind = ct_arg(a, 1, "indent", ct_none());
    ct_buf ib = { 0 };
    if (ind.t == V_INT || ind.t == V_BOOL) {
        for (int64_t i = 0; i < (ind.t == V_INT ? ind.i : ind.b) && i < 1000; i++) ct_buf_puts(c, &ib, " ");
        o.indent = ib.p ? ib.p : "";
        o.indent_n = ib.n;
    } else if (ind.t == V_STR) {
        o.indent = ind.s.p;
        o.indent_n = ind.s.n;
    } else if (ind.t != V_NONE) {
        ct_fail(c->e, a->pos, "tojson: indent must be an integer or a string");
    }
    if (o.indent) o.item_sep = (ct_str){ ",", 1 };
    ct_value sep = ct_arg(a, 2, "separators", ct_none());
    if (sep.t == V_LIST && sep.l->n == 2 && sep.l->v[0].t == V_STR && sep.l->v[1].t == V_STR) {
        o.item_sep = sep.l->v[0].s;
        o.key_sep = sep.l->v[1].s;
    } else if (sep.t != V_NONE) {
        ct_fail(c->e, a->pos, "tojson: separators must be a pair of strings");
    }
    o.sort = ct_truthy(ct_arg(a, 3, "sort_keys", ct_bool(false)));
    ct_buf b = { 0 };
    ct_write_json(c, &b, v, &o, 0, a->pos);
    return ct_buf_value(&b);
}

/* select / reject / selectattr / rejectattr */
static ct_value select_items(ct_ctx *c, ct_value in, ct_args *a, bool attr, bool keep) {
    ct_list *items = ct_iterate(c, in, a->pos);
    ct_list *out = ct_list_new(c, items->n);
    out->n = 0;
    int first_test = attr ? 1 : 0;
    if (attr && a->n < 1) ct_fail(c->e, a->pos, "selectattr/rejectattr need an attribute");
    ct_str test = { 0 };
    if (a->n > first_test) {
        if (a->v[first_test].t != V_STR || !ct_test_known(a->v[first_test].s.p, a->v[first_test].s.n))
            ct_fail(c->e, a->pos, "unknown test in select filter");
        test = a->v[first_test].s;
    }
    /* the test's own arguments, after the attribute and the test name (a->v is NULL without any) */
    int n_ta = a->n > first_test + 1 ? a->n - first_test - 1 : 0;
    ct_args ta = { .v = n_ta ? a->v + first_test + 1 : NULL, .n = n_ta, .pos = a->pos };
    for (size_t i = 0; i < items->n; i++) {
        ct_step(c, a->pos);
        ct_value v = attr ? get_path(c, items->v[i], a->v[0], a->pos) : items->v[i];
        bool ok = test.n ? ct_test(c, test, v, &ta) : ct_truthy(v);
        if (ok == keep) out->v[out->n++] = items->v[i];
    }
    return ct_listv(out);
}

static ct_value map_items(ct_ctx *c, ct_value in, ct_args *a) {
    ct_list *items = ct_iterate(c, in, a->pos);
    ct_list *out = ct_list_new(c, items->n);
    ct_value attr = ct_arg(a, -1, "attribute", ct_undef((ct_str){ 0 }));
    ct_value dflt = ct_arg(a, -1, "default", ct_undef((ct_str){ 0 }));
    if (attr.t == V_UNDEF && (a->n < 1 || a->v[0].t != V_STR || !ct_filter_known(a->v[0].s.p, a->v[0].s.n)))
        ct_fail(c->e, a->pos, "map: expected attribute= or a filter name");
    ct_args fa = { .v = a->n > 1 ? a->v + 1 : NULL, .n = a->n > 1 ? a->n - 1 : 0, .pos = a->pos };
    for (size_t i = 0; i < items->n; i++) {
        ct_step(c, a->pos);
        if (attr.t != V_UNDEF) {
            ct_value v = get_path(c, items->v[i], attr, a->pos);
            out->v[i] = v.t == V_UNDEF && dflt.t != V_UNDEF ? dflt : v;
        } else {
            out->v[i] = ct_filter(c, a->v[0].s, items->v[i], &fa);
        }
    }
    return ct_listv(out);
}

static ct_value sorted(ct_ctx *c, ct_value in, ct_args *a, int which) { /* 0 sort, 1 dictsort */
    bool cs = ct_truthy(ct_arg(a, which ? 0 : 1, "case_sensitive", ct_bool(false)));
    bool rev = ct_truthy(ct_arg(a, which ? 2 : 0, "reverse", ct_bool(false)));
    ct_list *items;
    ct_value attr = ct_arg(a, which ? -1 : 2, "attribute", ct_none());
    bool by_value = false;
    if (which) {
        if (in.t != V_DICT || in.d->ns) ct_fail(c->e, a->pos, "dictsort: expected a dict");
        ct_value by = ct_arg(a, 1, "by", ct_strref((ct_str){ "key", 3 }));
        by_value = by.t == V_STR && str_eq(by.s, "value");
        ct_args none = { .pos = a->pos };
        ct_method m = { .self = in, .name = { "items", 5 } };
        items = ct_call_method(c, &m, &none).l;
    } else {
        items = ct_iterate(c, in, a->pos);
    }
    ct_list *out = ct_list_new(c, items->n);
    ct_value *keys = ct_alloc(c->e, (items->n + 1) * sizeof *keys);
    for (size_t i = 0; i < items->n; i++) {
        out->v[i] = items->v[i];
        ct_value k = which ? items->v[i].l->v[by_value] : attr.t != V_NONE ? get_path(c, items->v[i], attr, a->pos) : items->v[i];
        keys[i] = lower_if_str(c, k, cs);
    }
    sort_values(c, out->v, keys, out->n, rev, a->pos);
    return ct_listv(out);
}

static ct_value extreme(ct_ctx *c, ct_value in, ct_args *a, bool want_max) {
    ct_list *items = ct_iterate(c, in, a->pos);
    bool cs = ct_truthy(ct_arg(a, 0, "case_sensitive", ct_bool(false)));
    ct_value attr = ct_arg(a, 1, "attribute", ct_none());
    if (items->n == 0) return ct_undef((ct_str){ 0 });
    size_t best = 0;
    ct_value bk = ct_none();
    for (size_t i = 0; i < items->n; i++) {
        ct_value k = lower_if_str(c, attr.t != V_NONE ? get_path(c, items->v[i], attr, a->pos) : items->v[i], cs);
        if (i == 0 || (want_max ? ct_compare(c, k, bk, a->pos) > 0 : ct_compare(c, k, bk, a->pos) < 0)) { best = i; bk = k; }
    }
    return items->v[best];
}

ct_value ct_filter(ct_ctx *c, ct_str name, ct_value in, ct_args *a) {
    size_t pos = a->pos;
    ct_value none = ct_none();
    ct_step(c, pos);
    if (str_eq(name, "default") || str_eq(name, "d")) {
        bool boolean = ct_truthy(ct_arg(a, 1, "boolean", ct_bool(false)));
        bool use = in.t == V_UNDEF || (boolean && !ct_truthy(in));
        return use ? ct_arg(a, 0, "default_value", empty_str()) : in;
    }
    if (str_eq(name, "safe")) return in;
    if (str_eq(name, "string")) return ct_strref(ct_to_str(c, in));
    if (str_eq(name, "tojson")) return tojson(c, in, a);
    if (str_eq(name, "length") || str_eq(name, "count")) {
        switch (in.t) {
        case V_UNDEF: return ct_int(0);
        case V_STR: return ct_int((int64_t)ct_utf8_len(in.s.p, in.s.n));
        case V_LIST: return ct_int((int64_t)in.l->n);
        case V_DICT: if (!in.d->ns) return ct_int((int64_t)in.d->n); break;
        default: break;
        }
        ct_fail(c->e, pos, "object of type '%s' has no len()", ct_type_name(in));
    }
    if (str_eq(name, "items")) {
        if (in.t == V_UNDEF) return ct_listv(ct_list_new(c, 0));
        if (in.t != V_DICT || in.d->ns) ct_fail(c->e, pos, "can only get item pairs from a mapping");
        ct_args none_args = { .pos = pos };
        ct_method m = { .self = in, .name = { "items", 5 } };
        return ct_call_method(c, &m, &none_args);
    }
    if (str_eq(name, "list")) {
        ct_list *src = ct_iterate(c, in, pos), *l = ct_list_new(c, src->n);
        if (src->n) memcpy(l->v, src->v, src->n * sizeof(ct_value));
        return ct_listv(l);
    }
    if (str_eq(name, "first") || str_eq(name, "last")) {
        ct_list *l = ct_iterate(c, in, pos);
        if (l->n == 0) return ct_undef((ct_str){ 0 });
        return name.p[0] == 'f' ? l->v[0] : l->v[l->n - 1];
    }
    if (str_eq(name, "reverse")) {
        ct_list *src = ct_iterate(c, in, pos), *l = ct_list_new(c, src->n);
        for (size_t i = 0; i < src->n; i++) l->v[i] = src->v[src->n - 1 - i];
        if (in.t != V_STR) return ct_listv(l);
        ct_buf b = { 0 };
        for (size_t i = 0; i < l->n; i++) ct_buf_put(c, &b, l->v[i].s.p, l->v[i].s.n);
        return b.p ? ct_buf_value(&b) : empty_str();
    }
    if (str_eq(name, "join")) {
        ct_list *l = ct_iterate(c, in, pos);
        ct_str sep = ct_to_str(c, ct_arg(a, 0, "d", empty_str()));
        ct_value attr = ct_arg(a, 1, "attribute", none);
        ct_buf b = { 0 };
        for (size_t i = 0; i < l->n; i++) {
            if (i) ct_buf_put(c, &b, sep.p, sep.n);
            ct_write_str(c, &b, attr.t != V_NONE ? get_path(c, l->v[i], attr, pos) : l->v[i]);
        }
        return b.p ? ct_buf_value(&b) : empty_str();
    }
    if (str_eq(name, "int")) return to_number(c, in, true, ct_arg(a, 0, "default", ct_int(0)));
    if (str_eq(name, "float")) return to_number(c, in, false, ct_arg(a, 0, "default", ct_float(0)));
    if (str_eq(name, "abs")) {
        if (in.t == V_FLOAT) return ct_float(fabs(in.f));
        if (in.t == V_INT || in.t == V_BOOL) {
            int64_t v = in.t == V_INT ? in.i : in.b;
            if (v == INT64_MIN) ct_fail(c->e, pos, "integer overflow");
            return ct_int(v < 0 ? -v : v);
        }
        ct_fail(c->e, pos, "bad operand type for abs(): '%s'", ct_type_name(in));
    }
    if (str_eq(name, "round")) {
        if (!ct_is_num(in)) ct_fail(c->e, pos, "round: expected a number, not '%s'", ct_type_name(in));
        ct_value pv = ct_arg(a, 0, "precision", ct_int(0)), mv = ct_arg(a, 1, "method", ct_strref((ct_str){ "common", 6 }));
        int64_t prec = pv.t == V_INT ? pv.i : 0;
        if (prec < -300 || prec > 300) prec = prec < 0 ? -300 : 300;
        double x = ct_num(in), s = pow(10.0, (double)prec);
        if (mv.t == V_STR && str_eq(mv.s, "floor")) return ct_float(floor(x * s) / s);
        if (mv.t == V_STR && str_eq(mv.s, "ceil")) return ct_float(ceil(x * s) / s);
        if (in.t != V_FLOAT) return ct_int(in.t == V_INT ? in.i : in.b);
        if (!isfinite(x)) return in;
        if (prec <= 0 || prec > 40) return ct_float(prec == 0 ? nearbyint(x) : nearbyint(x * s) / s);
        char tmp[400];
        snprintf(tmp, sizeof tmp, "%.*f", (int)prec, x);
        return ct_float(strtod(tmp, NULL));
    }
    if (str_eq(name, "selectattr") || str_eq(name, "rejectattr"))
        return select_items(c, in, a, true, name.p[0] == 's');
    if (str_eq(name, "select") || str_eq(name, "reject")) return select_items(c, in, a, false, name.p[0] == 's');
    if (str_eq(name, "map")) return map_items(c, in, a);
    if (str_eq(name, "sort")) return sorted(c, in, a, 0);
    if (str_eq(name, "dictsort")) return sorted(c, in, a, 1);
    if (str_eq(name, "max") || str_eq(name, "min")) return extreme(c, in, a, name.p[1] == 'a');
    if (str_eq(name, "unique")) {
        ct_list *l = ct_iterate(c, in, pos), *out = ct_list_new(c, l->n);
        bool cs = ct_truthy(ct_arg(a, 0, "case_sensitive", ct_bool(false)));
        ct_value attr = ct_arg(a, 1, "attribute", none);
        ct_value *seen = ct_alloc(c->e, (l->n + 1) * sizeof *seen);
        out->n = 0;
        for (size_t i = 0; i < l->n; i++) {
            ct_value k = lower_if_str(c, attr.t != V_NONE ? get_path(c, l->v[i], attr, pos) : l->v[i], cs);
            bool dup = false;
            for (size_t j = 0; j < out->n && !dup; j++) { ct_step(c, pos); dup = ct_equal(seen[j], k); }
            if (!dup) { seen[out->n] = k; out->v[out->n++] = l->v[i]; }
        }
        return ct_listv(out);
    }
    if (str_eq(name, "sum")) {
        ct_list *l = ct_iterate(c, in, pos);
        ct_value attr = ct_arg(a, 0, "attribute", none), acc = ct_arg(a, 1, "start", ct_int(0));
        for (size_t i = 0; i < l->n; i++) {
            ct_value v = attr.t != V_NONE ? get_path(c, l->v[i], attr, pos) : l->v[i];
            if (!ct_is_num(v) || !ct_is_num(acc)) ct_fail(c->e, pos, "sum: items must be numbers");
            if (v.t == V_FLOAT || acc.t == V_FLOAT) acc = ct_float(ct_num(acc) + ct_num(v));
            else if (__builtin_add_overflow((int64_t)ct_num(acc), (int64_t)(v.t == V_INT ? v.i : v.b), &acc.i)) ct_fail(c->e, pos, "integer overflow");
            else acc.t = V_INT;
        }
        return acc;
    }
    if (str_eq(name, "wordcount")) {
        ct_list *w = ct_iterate(c, ct_call_method(c, &(ct_method){ .self = ct_strref(ct_to_str(c, in)), .name = { "split", 5 } },
                                                  &(ct_args){ .pos = pos }), pos);
        return ct_int((int64_t)w->n);
    }
    /* the remaining filters work on str(value) */
    ct_str s = ct_to_str(c, in);
    if (str_eq(name, "trim")) return ct_str_strip(c, s, ct_arg(a, 0, "chars", none), true, true, pos);
    if (str_eq(name, "lower")) return ct_str_case(c, s, CASE_LOWER);
    if (str_eq(name, "upper")) return ct_str_case(c, s, CASE_UPPER);
    if (str_eq(name, "capitalize")) return ct_str_case(c, s, CASE_CAPITALIZE);
    if (str_eq(name, "title")) return ct_str_case(c, s, CASE_JINJA_TITLE);
    if (str_eq(name, "e") || str_eq(name, "escape") || str_eq(name, "forceescape")) return escape_html(c, s);
    if (str_eq(name, "format")) return printf_format(c, s, a);
    if (str_eq(name, "indent"))
        return indent(c, s, ct_arg(a, 0, "width", ct_int(4)), ct_truthy(ct_arg(a, 1, "first", ct_bool(false))),
                      ct_truthy(ct_arg(a, 2, "blank", ct_bool(false))));
    if (str_eq(name, "replace")) {
        ct_str old = ct_to_str(c, ct_arg(a, 0, "old", empty_str())), rep = ct_to_str(c, ct_arg(a, 1, "new", empty_str()));
        ct_value cnt = ct_arg(a, 2, "count", none);
        return ct_str_replace(c, s, old, rep, cnt.t == V_INT ? cnt.i : -1);
    }
    ct_fail(c->e, pos, "unknown filter '%.*s'", (int)name.n, name.p);
}

bool ct_test(ct_ctx *c, ct_str name, ct_value v, ct_args *a) {
    size_t pos = a->pos;
    ct_value arg = ct_arg(a, 0, NULL, ct_undef((ct_str){ 0 }));
    if (str_eq(name, "defined")) return v.t != V_UNDEF;
    if (str_eq(name, "undefined")) return v.t == V_UNDEF;
    if (str_eq(name, "none")) return v.t == V_NONE;
    if (str_eq(name, "string")) return v.t == V_STR;
    if (str_eq(name, "mapping")) return v.t == V_DICT && !v.d->ns;
    if (str_eq(name, "iterable") || str_eq(name, "sequence"))
        return v.t == V_STR || v.t == V_LIST || v.t == V_UNDEF || (v.t == V_DICT && !v.d->ns);
    if (str_eq(name, "number")) return ct_is_num(v);
    if (str_eq(name, "integer")) return v.t == V_INT;
    if (str_eq(name, "float")) return v.t == V_FLOAT;
    if (str_eq(name, "boolean")) return v.t == V_BOOL;
    if (str_eq(name, "true")) return v.t == V_BOOL && v.b;
    if (str_eq(name, "false")) return v.t == V_BOOL && !v.b;
    if (str_eq(name, "callable")) return v.t == V_MACRO || v.t == V_FUNC || v.t == V_METHOD;
    if (str_eq(name, "escaped")) return false;
    if (str_eq(name, "lower") || str_eq(name, "upper")) {
        if (v.t != V_STR) return false;
        ct_value conv = ct_str_case(c, v.s, name.p[0] == 'l' ? CASE_LOWER : CASE_UPPER);
        return ct_equal(conv, v);
    }
    if (str_eq(name, "odd") || str_eq(name, "even") || str_eq(name, "divisibleby")) {
        if (v.t != V_INT && v.t != V_BOOL) ct_fail(c->e, pos, "test '%.*s' needs an integer", (int)name.n, name.p);
        int64_t x = v.t == V_INT ? v.i : v.b, d = 2;
        if (name.p[0] == 'd') {
            if (arg.t != V_INT || arg.i == 0) ct_fail(c->e, pos, "divisibleby needs a non-zero integer");
            d = arg.i;
            return d == -1 || x % d == 0;
        }
        return (x % 2 != 0) == (name.p[0] == 'o');
    }
    if (str_eq(name, "eq") || str_eq(name, "equalto")) return ct_equal(v, arg);
    if (str_eq(name, "ne")) return !ct_equal(v, arg);
    if (str_eq(name, "sameas"))
        return v.t == arg.t && (v.t == V_NONE || v.t == V_UNDEF || ct_equal(v, arg)) &&
               (v.t != V_LIST || v.l == arg.l) && (v.t != V_DICT || v.d == arg.d);
    if (str_eq(name, "in")) {
        if (arg.t == V_STR && v.t == V_STR) {
            for (size_t i = 0; i + v.s.n <= arg.s.n; i++)
                if (memcmp(arg.s.p + i, v.s.p, v.s.n) == 0) return true;
            return false;
        }
        ct_list *l = ct_iterate(c, arg, pos);
        for (size_t i = 0; i < l->n; i++)
            if (ct_equal(l->v[i], v)) return true;
        return false;
    }
    if (v.t == V_UNDEF || arg.t == V_UNDEF) ct_fail(c->e, pos, "comparison with an undefined value");
    int r = ct_compare(c, v, arg, pos);
    if (str_eq(name, "lt") || str_eq(name, "lessthan")) return r < 0;
    if (str_eq(name, "le")) return r <= 0;
    if (str_eq(name, "gt") || str_eq(name, "greaterthan")) return r > 0;
    if (str_eq(name, "ge")) return r >= 0;
    ct_fail(c->e, pos, "unknown test '%.*s'", (int)name.n, name.p);
}
