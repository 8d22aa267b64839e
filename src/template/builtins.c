/* Chat-template builtins: attribute and item access, str/dict methods, loop
 * attributes, global functions (range, namespace, dict, raise_exception,
 * strftime_now) and the string helpers filters share. Python semantics; case
 * mapping through utf8proc (simple, one-to-one mappings). */
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <utf8proc.h>

#include "template/template_internal.h"
#include "template/template.h"

static bool str_eq(ct_str a, const char *b) { return a.n == strlen(b) && memcmp(a.p, b, a.n) == 0; }

ct_value ct_arg(ct_args *a, int i, const char *name, ct_value dflt) {
    if (i >= 0 && i < a->n) return a->v[i];
    for (int k = 0; name && k < a->nkw; k++)
        if (str_eq(a->kwn[k], name)) return a->kwv[k];
    return dflt;
}

static ct_str need_str(ct_ctx *c, ct_value v, const char *what, size_t pos) {
    if (v.t != V_STR) ct_fail(c->e, pos, "%s must be a string, not '%s'", what, ct_type_name(v));
    return v.s;
}

static int64_t need_int(ct_ctx *c, ct_value v, const char *what, size_t pos) {
    if (v.t == V_INT) return v.i;
    if (v.t == V_BOOL) return v.b;
    ct_fail(c->e, pos, "%s must be an integer, not '%s'", what, ct_type_name(v));
}

/* ---- string helpers ------------------------------------------------------------ */
static int32_t next_cp(const char *p, size_t n, size_t *len) {
    utf8proc_int32_t cp;
    utf8proc_ssize_t k = utf8proc_iterate((const utf8proc_uint8_t *)p, (utf8proc_ssize_t)n, &cp);
    if (k <= 0) { *len = 1; return -1; } /* invalid byte: kept as is */
    *len = (size_t)k;
    return cp;
}

static bool is_space_cp(int32_t cp) {
    return cp == ' ' || (cp >= 0x09 && cp <= 0x0d) || (cp >= 0x1c && cp <= 0x1f) || cp == 0x85 || cp == 0xa0 ||
           cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 || cp == 0x2029 || cp == 0x202f ||
           cp == 0x205f || cp == 0x3000;
}

static void put_cp(ct_ctx *c, ct_buf *b, int32_t cp) {
    utf8proc_uint8_t tmp[4];
    utf8proc_ssize_t k = utf8proc_encode_char(cp, tmp);
    ct_buf_put(c, b, (const char *)tmp, (size_t)k);
}

ct_value ct_str_case(ct_ctx *c, ct_str s, int mode) {
    ct_buf b = { 0 };
    bool prev_cased = false, first = true;
    for (size_t i = 0; i < s.n;) {
        size_t len;
        int32_t cp = next_cp(s.p + i, s.n - i, &len);
        if (cp < 0) { ct_buf_put(c, &b, s.p + i, 1); i++; prev_cased = false; continue; }
        int32_t out = cp;
        switch (mode) {
        case CASE_LOWER: out = utf8proc_tolower(cp); break;
        case CASE_UPPER: out = utf8proc_toupper(cp); break;
        case CASE_CAPITALIZE: out = first ? utf8proc_totitle(cp) : utf8proc_tolower(cp); break;
        case CASE_TITLE: { /* str.title(): upper after an uncased char */
            bool cased = utf8proc_tolower(cp) != cp || utf8proc_toupper(cp) != cp;
            out = cased ? (prev_cased ? utf8proc_tolower(cp) : utf8proc_totitle(cp)) : cp;
            prev_cased = cased;
            break;
        }
        default: { /* jinja's title filter: words start after whitespace or -({[< */
            out = prev_cased ? utf8proc_tolower(cp) : utf8proc_toupper(cp);
            prev_cased = !(is_space_cp(cp) || cp == '-' || cp == '(' || cp == '{' || cp == '[' || cp == '<');
            break;
        }
        }
        first = false;
        if (cp == 0xDF && out != 0xDF) { /* Python: 'ß'.upper() == 'SS', title 'Ss' */
            ct_buf_puts(c, &b, mode == CASE_UPPER ? "SS" : "Ss");
            i += len;
            continue;
        }
        put_cp(c, &b, out);
        i += len;
    }
    return ct_buf_value(&b);
}

static bool in_chars(ct_str chars, const char *p, size_t len) {
    for (size_t i = 0; i < chars.n;) {
        size_t l = ct_utf8_offset(chars.p + i, chars.n - i, 1);
        if (l == len && memcmp(chars.p + i, p, len) == 0) return true;
        i += l;
    }
    return false;
}

/* The range of s kept by Python's strip/lstrip/rstrip: whitespace when set is NULL, else set's characters. */
static void strip_range(ct_str s, const ct_str *set, bool left, bool right, size_t *lo_out, size_t *hi_out) {
    size_t lo = 0, hi = s.n;
    if (left)
        while (lo < hi) {
            size_t len;
            int32_t cp = next_cp(s.p + lo, hi - lo, &len);
            if (!set ? !is_space_cp(cp) : !in_chars(*set, s.p + lo, len)) break;
            lo += len;
        }
    if (right)
        while (hi > lo) {
            size_t st = hi - 1;
            while (st > lo && ((unsigned char)s.p[st] & 0xC0) == 0x80) st--;
            size_t len;
            int32_t cp = next_cp(s.p + st, hi - st, &len);
            if (len != hi - st) cp = -1, len = hi - st;
            if (!set ? !is_space_cp(cp) : !in_chars(*set, s.p + st, len)) break;
            hi = st;
        }
    *lo_out = lo;
    *hi_out = hi;
}

ct_value ct_str_strip(ct_ctx *c, ct_str s, ct_value chars, bool left, bool right, size_t pos) {
    bool ws = chars.t == V_NONE || chars.t == V_UNDEF;
    ct_str set = ws ? (ct_str){ 0 } : need_str(c, chars, "strip characters", pos);
    size_t lo, hi;
    strip_range(s, ws ? NULL : &set, left, right, &lo, &hi);
    return ct_strref((ct_str){ s.p + lo, hi - lo });
}

void kvs_chat_template_strip(const char *s, size_t n, bool left, bool right, size_t *start, size_t *len) {
    size_t lo, hi;
    strip_range((ct_str){ s, n }, NULL, left, right, &lo, &hi);
    *start = lo;
    *len = hi - lo;
}

static const char *find(ct_str hay, size_t from, ct_str needle) {
    for (size_t i = from; i + needle.n <= hay.n; i++)
        if (memcmp(hay.p + i, needle.p, needle.n) == 0) return hay.p + i;
    return NULL;
}

ct_value ct_str_replace(ct_ctx *c, ct_str s, ct_str old, ct_str rep, int64_t count) {
    ct_buf b = { 0 };
    size_t i = 0;
    int64_t done = 0;
    if (old.n == 0) { /* Python inserts rep between characters */
        for (size_t k = 0; k <= s.n;) {
            if (count < 0 || done < count) { ct_buf_put(c, &b, rep.p, rep.n); done++; }
            if (k == s.n) break;
            size_t len = ct_utf8_offset(s.p + k, s.n - k, 1);
            ct_buf_put(c, &b, s.p + k, len);
            k += len;
        }
        return ct_buf_value(&b);
    }
    for (const char *hit; (count < 0 || done < count) && (hit = find(s, i, old)); done++) {
        ct_buf_put(c, &b, s.p + i, (size_t)(hit - s.p) - i);
        ct_buf_put(c, &b, rep.p, rep.n);
        i = (size_t)(hit - s.p) + old.n;
    }
    ct_buf_put(c, &b, s.p + i, s.n - i);
    if (!b.p) return ct_strref((ct_str){ "", 0 });
    return ct_buf_value(&b);
}

static ct_value split(ct_ctx *c, ct_str s, ct_value sepv, int64_t maxsplit, size_t pos) {
    ct_list *l = ct_list_new(c, s.n + 1);
    l->n = 0;
    if (sepv.t == V_NONE || sepv.t == V_UNDEF) { /* runs of whitespace, no empty items */
        size_t i = 0;
        for (;;) {
            size_t len;
            while (i < s.n && is_space_cp(next_cp(s.p + i, s.n - i, &len))) i += len;
            if (i >= s.n) break;
            size_t st = i;
            if (maxsplit >= 0 && (int64_t)l->n >= maxsplit) {
                ct_value rest = ct_str_strip(c, (ct_str){ s.p + st, s.n - st }, ct_none(), false, true, pos);
                l->v[l->n++] = rest;
                break;
            }
            while (i < s.n && !is_space_cp(next_cp(s.p + i, s.n - i, &len))) i += len;
            l->v[l->n++] = ct_strref((ct_str){ s.p + st, i - st });
        }
        return ct_listv(l);
    }
    ct_str sep = need_str(c, sepv, "separator", pos);
    if (sep.n == 0) ct_fail(c->e, pos, "empty separator");
    size_t i = 0;
    const char *hit;
    while ((maxsplit < 0 || (int64_t)l->n < maxsplit) && (hit = find(s, i, sep))) {
        l->v[l->n++] = ct_strref((ct_str){ s.p + i, (size_t)(hit - s.p) - i });
        i = (size_t)(hit - s.p) + sep.n;
    }
    l->v[l->n++] = ct_strref((ct_str){ s.p + i, s.n - i });
    return ct_listv(l);
}

/* str.format: {} {0} {name}; conversions and format specs are ignored. */
static ct_value format(ct_ctx *c, ct_str f, ct_args *a) {
    ct_buf b = { 0 };
    int auto_idx = 0;
    for (size_t i = 0; i < f.n; i++) {
        char ch = f.p[i];
        if ((ch == '{' || ch == '}') && i + 1 < f.n && f.p[i + 1] == ch) { ct_buf_put(c, &b, &ch, 1); i++; continue; }
        if (ch == '}') ct_fail(c->e, a->pos, "format: single '}' encountered");
        if (ch != '{') { ct_buf_put(c, &b, &ch, 1); continue; }
        size_t j = i + 1;
        while (j < f.n && f.p[j] != '}') j++;
        if (j >= f.n) ct_fail(c->e, a->pos, "format: single '{' encountered");
        size_t fe = i + 1;
        while (fe < j && f.p[fe] != ':' && f.p[fe] != '!') fe++;
        ct_str field = { f.p + i + 1, fe - i - 1 };
        ct_value v;
        if (field.n == 0) {
            if (auto_idx >= a->n) ct_fail(c->e, a->pos, "format: not enough arguments");
            v = a->v[auto_idx++];
        } else if (field.p[0] >= '0' && field.p[0] <= '9') {
            int k = 0;
            for (size_t q = 0; q < field.n && k < 1000000; q++) {
                if (field.p[q] < '0' || field.p[q] > '9') ct_fail(c->e, a->pos, "format: bad argument index");
                k = k * 10 + (field.p[q] - '0');
            }
            if (k >= a->n) ct_fail(c->e, a->pos, "format: argument index out of range");
            v = a->v[k];
        } else {
            bool found = false;
            for (int k = 0; k < a->nkw; k++)
                if (a->kwn[k].n == field.n && memcmp(a->kwn[k].p, field.p, field.n) == 0) { v = a->kwv[k]; found = true; }
            if (!found) ct_fail(c->e, a->pos, "format: missing argument '%.*s'", (int)(field.n > 40 ? 40 : field.n), field.p);
        }
        ct_write_str(c, &b, v);
        i = j;
    }
    return ct_buf_value(&b);
}

static bool str_pred(ct_str s, int kind) {
    if (s.n == 0) return false;
    bool any_cased = false;
    for (size_t i = 0; i < s.n;) {
        size_t len;
        int32_t cp = next_cp(s.p + i, s.n - i, &len);
        i += len;
        if (cp < 0) return false;
        utf8proc_category_t cat = utf8proc_category(cp);
        bool alpha = cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO;
        bool digit = cat == UTF8PROC_CATEGORY_ND;
        switch (kind) {
        case 0: if (!digit) return false; break;
        case 1: if (!alpha) return false; break;
        case 2: if (!alpha && !digit && cat != UTF8PROC_CATEGORY_NL && cat != UTF8PROC_CATEGORY_NO) return false; break;
        case 3: if (!is_space_cp(cp)) return false; break;
        case 4: if (utf8proc_toupper(cp) != cp && utf8proc_tolower(cp) == cp) any_cased = true;
                else if (utf8proc_tolower(cp) != cp) return false;
                break;
        default: if (utf8proc_tolower(cp) != cp && utf8proc_toupper(cp) == cp) any_cased = true;
                 else if (utf8proc_toupper(cp) != cp) return false;
                 break;
        }
    }
    return kind < 4 || any_cased;
}

static const char *const STR_METHODS[] = { "startswith", "endswith", "split", "rsplit", "replace", "strip",
    "lstrip", "rstrip", "lower", "upper", "title", "capitalize", "format", "find", "count", "join",
    "isdigit", "isalpha", "isalnum", "isspace", "islower", "isupper", "splitlines", NULL };
static const char *const DICT_METHODS[] = { "get", "items", "keys", "values", NULL };

static bool in_list(const char *const *names, ct_str s) {
    for (int i = 0; names[i]; i++)
        if (str_eq(s, names[i])) return true;
    return false;
}

static bool affix(ct_ctx *c, ct_str s, ct_value arg, bool start, size_t pos) {
    if (arg.t == V_LIST && arg.tuple) {
        for (size_t i = 0; i < arg.l->n; i++)
            if (affix(c, s, arg.l->v[i], start, pos)) return true;
        return false;
    }
    ct_str x = need_str(c, arg, start ? "startswith argument" : "endswith argument", pos);
    if (x.n > s.n) return false;
    return memcmp(start ? s.p : s.p + s.n - x.n, x.p, x.n) == 0;
}

static ct_value str_method(ct_ctx *c, ct_str s, ct_str name, ct_args *a) {
    ct_value none = ct_none();
    size_t pos = a->pos;
    if (str_eq(name, "startswith") || str_eq(name, "endswith"))
        return ct_bool(affix(c, s, ct_arg(a, 0, NULL, ct_strref((ct_str){ "", 0 })), name.p[0] == 's', pos));
    if (str_eq(name, "split") || str_eq(name, "rsplit")) {
        int64_t maxsplit = need_int(c, ct_arg(a, 1, "maxsplit", ct_int(-1)), "maxsplit", pos);
        if (name.p[0] == 'r' && maxsplit >= 0) ct_fail(c->e, pos, "rsplit with maxsplit is not supported");
        return split(c, s, ct_arg(a, 0, "sep", none), maxsplit, pos);
    }
    if (str_eq(name, "replace")) {
        ct_str old = need_str(c, ct_arg(a, 0, NULL, none), "replace argument", pos);
        ct_str rep = need_str(c, ct_arg(a, 1, NULL, none), "replace argument", pos);
        return ct_str_replace(c, s, old, rep, need_int(c, ct_arg(a, 2, "count", ct_int(-1)), "count", pos));
    }
    if (str_eq(name, "strip")) return ct_str_strip(c, s, ct_arg(a, 0, NULL, none), true, true, pos);
    if (str_eq(name, "lstrip")) return ct_str_strip(c, s, ct_arg(a, 0, NULL, none), true, false, pos);
    if (str_eq(name, "rstrip")) return ct_str_strip(c, s, ct_arg(a, 0, NULL, none), false, true, pos);
    if (str_eq(name, "lower")) return ct_str_case(c, s, CASE_LOWER);
    if (str_eq(name, "upper")) return ct_str_case(c, s, CASE_UPPER);
    if (str_eq(name, "title")) return ct_str_case(c, s, CASE_TITLE);
    if (str_eq(name, "capitalize")) return ct_str_case(c, s, CASE_CAPITALIZE);
    if (str_eq(name, "format")) return format(c, s, a);
    if (str_eq(name, "find") || str_eq(name, "count")) {
        ct_str sub = need_str(c, ct_arg(a, 0, NULL, none), "substring", pos);
        if (name.p[0] == 'f') {
            const char *hit = find(s, 0, sub);
            return ct_int(hit ? (int64_t)ct_utf8_len(s.p, (size_t)(hit - s.p)) : -1);
        }
        if (sub.n == 0) return ct_int((int64_t)ct_utf8_len(s.p, s.n) + 1);
        int64_t k = 0;
        for (const char *hit = find(s, 0, sub); hit; hit = find(s, (size_t)(hit - s.p) + sub.n, sub)) k++;
        return ct_int(k);
    }
    if (str_eq(name, "join")) {
        ct_list *items = ct_iterate(c, ct_arg(a, 0, NULL, none), pos);
        ct_buf b = { 0 };
        for (size_t i = 0; i < items->n; i++) {
            if (i) ct_buf_put(c, &b, s.p, s.n);
            ct_buf_put(c, &b, need_str(c, items->v[i], "join item", pos).p, items->v[i].s.n);
        }
        return b.p ? ct_buf_value(&b) : ct_strref((ct_str){ "", 0 });
    }
    if (str_eq(name, "splitlines")) {
        ct_list *l = ct_list_new(c, s.n + 1);
        l->n = 0;
        size_t st = 0;
        for (size_t i = 0; i < s.n; i++) {
            if (s.p[i] != '\n' && s.p[i] != '\r') continue;
            l->v[l->n++] = ct_strref((ct_str){ s.p + st, i - st });
            if (s.p[i] == '\r' && i + 1 < s.n && s.p[i + 1] == '\n') i++;
            st = i + 1;
        }
        if (st < s.n) l->v[l->n++] = ct_strref((ct_str){ s.p + st, s.n - st });
        return ct_listv(l);
    }
    static const char *const preds[] = { "isdigit", "isalpha", "isalnum", "isspace", "islower", "isupper" };
    for (int k = 0; k < 6; k++)
        if (str_eq(name, preds[k])) return ct_bool(str_pred(s, k));
    ct_fail(c->e, pos, "unknown string method");
}

static ct_value dict_items(ct_ctx *c, ct_dict *d, int which) { /* 0 items, 1 keys, 2 values */
    ct_list *l = ct_list_new(c, d->n);
    for (size_t i = 0; i < d->n; i++) {
        if (which == 1) { l->v[i] = d->k[i]; continue; }
        if (which == 2) { l->v[i] = d->v[i]; continue; }
        ct_list *pair = ct_list_new(c, 2);
        pair->v[0] = d->k[i];
        pair->v[1] = d->v[i];
        l->v[i] = ct_listv(pair);
        l->v[i].tuple = true;
    }
    return ct_listv(l);
}

ct_value ct_call_method(ct_ctx *c, ct_method *m, ct_args *a) {
    if (m->self.t == V_STR) return str_method(c, m->self.s, m->name, a);
    if (m->self.t == V_LOOP) return ct_call_func(c, FN_LOOP_CYCLE, m->self, a);
    ct_dict *d = m->self.d;
    if (str_eq(m->name, "get")) {
        ct_value *v = ct_dict_get(d, ct_arg(a, 0, NULL, ct_none()));
        return v ? *v : ct_arg(a, 1, NULL, ct_none());
    }
    return dict_items(c, d, str_eq(m->name, "items") ? 0 : str_eq(m->name, "keys") ? 1 : 2);
}

/* Undefined for a missing attribute: its message says so when it is used. */
static ct_value no_attr(ct_ctx *c, ct_value obj, ct_str name) {
    char msg[160];
    int n = snprintf(msg, sizeof msg, "'%s object' has no attribute '%.*s'", ct_type_name(obj),
                     (int)(name.n > 60 ? 60 : name.n), name.p);
    ct_value u = ct_strv(c, msg, (size_t)n < sizeof msg ? (size_t)n : sizeof msg - 1);
    u.t = V_UNDEF;
    u.tuple = true; /* s is a whole message */
    return u;
}

static ct_value method(ct_ctx *c, ct_value self, ct_str name) {
    ct_method *m = ct_alloc(c->e, sizeof *m);
    m->self = self;
    m->name = name;
    return (ct_value){ .t = V_METHOD, .m = m };
}

static ct_value loop_attr(ct_ctx *c, ct_loop *l, ct_str name, ct_value self) {
    int64_t i = (int64_t)l->idx, n = (int64_t)l->items->n;
    if (str_eq(name, "index")) return ct_int(i + 1);
    if (str_eq(name, "index0")) return ct_int(i);
    if (str_eq(name, "revindex")) return ct_int(n - i);
    if (str_eq(name, "revindex0")) return ct_int(n - i - 1);
    if (str_eq(name, "first")) return ct_bool(i == 0);
    if (str_eq(name, "last")) return ct_bool(i == n - 1);
    if (str_eq(name, "length")) return ct_int(n);
    if (str_eq(name, "depth")) return ct_int(1);
    if (str_eq(name, "depth0")) return ct_int(0);
    if (str_eq(name, "previtem")) return i > 0 ? l->items->v[i - 1] : ct_undef(name);
    if (str_eq(name, "nextitem")) return i + 1 < n ? l->items->v[i + 1] : ct_undef(name);
    if (str_eq(name, "cycle")) return method(c, self, name);
    return ct_undef(name);
}

ct_value ct_getattr(ct_ctx *c, ct_value obj, ct_str name, size_t pos) {
    switch (obj.t) {
    case V_UNDEF:
        if (obj.tuple) ct_fail(c->e, pos, "%.*s", (int)obj.s.n, obj.s.p);
        if (obj.s.n) ct_fail(c->e, pos, "'%.*s' is undefined", (int)(obj.s.n > 60 ? 60 : obj.s.n), obj.s.p);
        ct_fail(c->e, pos, "undefined value has no attribute '%.*s'", (int)(name.n > 60 ? 60 : name.n), name.p);
    case V_STR: return in_list(STR_METHODS, name) ? method(c, obj, name) : no_attr(c, obj, name);
    case V_DICT: {
        if (!obj.d->ns && in_list(DICT_METHODS, name)) return method(c, obj, name);
        ct_value *v = ct_dict_gets(obj.d, name.p, name.n);
        return v ? *v : no_attr(c, obj, name);
    }
    case V_LOOP: return loop_attr(c, obj.loop, name, obj);
    default: return no_attr(c, obj, name);
    }
}

ct_value ct_getitem(ct_ctx *c, ct_value obj, ct_value key, size_t pos) {
    if (obj.t == V_UNDEF) return ct_getattr(c, obj, (ct_str){ "[]", 2 }, pos);
    if (obj.t == V_DICT && !obj.d->ns) {
        ct_value *v = ct_dict_get(obj.d, key);
        if (v) return *v;
    } else if ((obj.t == V_LIST || obj.t == V_STR) && (key.t == V_INT || key.t == V_BOOL)) {
        int64_t i = key.t == V_INT ? key.i : key.b;
        int64_t n = obj.t == V_LIST ? (int64_t)obj.l->n : (int64_t)ct_utf8_len(obj.s.p, obj.s.n);
        if (i < 0) i += n;
        if (i < 0 || i >= n) return ct_undef((ct_str){ 0 });
        if (obj.t == V_LIST) return obj.l->v[i];
        size_t at = ct_utf8_offset(obj.s.p, obj.s.n, (size_t)i);
        return ct_strref((ct_str){ obj.s.p + at, ct_utf8_offset(obj.s.p + at, obj.s.n - at, 1) });
    }
    if (key.t == V_STR) return ct_getattr(c, obj, key.s, pos);
    return ct_undef((ct_str){ 0 });
}

ct_value ct_call_func(ct_ctx *c, int fn, ct_value self, ct_args *a) {
    size_t pos = a->pos;
    switch (fn) {
    case FN_RANGE: {
        if (a->n < 1 || a->n > 3) ct_fail(c->e, pos, "range expected 1 to 3 arguments, got %d", a->n);
        int64_t start = 0, stop, step = 1;
        if (a->n == 1) stop = need_int(c, a->v[0], "range argument", pos);
        else {
            start = need_int(c, a->v[0], "range argument", pos);
            stop = need_int(c, a->v[1], "range argument", pos);
            if (a->n == 3) step = need_int(c, a->v[2], "range argument", pos);
        }
        if (step == 0) ct_fail(c->e, pos, "range() arg 3 must not be zero");
        double count = step > 0 ? ((double)stop - (double)start) / (double)step : ((double)start - (double)stop) / -(double)step;
        if (count > CT_MAX_RANGE) ct_fail(c->e, pos, "range too large (limit %d items)", CT_MAX_RANGE);
        size_t n = count > 0 ? (size_t)(count + 0.999999999) : 0;
        ct_list *l = ct_list_new(c, n);
        size_t k = 0;
        for (int64_t v = start; k < n && (step > 0 ? v < stop : v > stop); v += step) l->v[k++] = ct_int(v);
        l->n = k;
        return ct_listv(l);
    }
    case FN_NAMESPACE: case FN_DICT: {
        ct_dict *d = ct_dict_new(c);
        d->ns = fn == FN_NAMESPACE;
        for (int i = 0; i < a->n; i++) {
            if (a->v[i].t != V_DICT) ct_fail(c->e, pos, "%s() positional argument must be a mapping", d->ns ? "namespace" : "dict");
            for (size_t k = 0; k < a->v[i].d->n; k++) ct_dict_set(c, d, a->v[i].d->k[k], a->v[i].d->v[k]);
        }
        for (int i = 0; i < a->nkw; i++) ct_dict_set(c, d, ct_strref(a->kwn[i]), a->kwv[i]);
        return (ct_value){ .t = V_DICT, .d = d };
    }
    case FN_RAISE: {
        ct_str msg = ct_to_str(c, ct_arg(a, 0, "message", ct_strref((ct_str){ "raise_exception called", 22 })));
        ct_fail(c->e, pos, "%.*s", (int)(msg.n > 400 ? 400 : msg.n), msg.p);
    }
    case FN_STRFTIME: {
        /* Rendering must be reproducible, so "now" is a fixed date: Friday 26 July
         * 2024, 00:00:00 (Llama 3.1's default date_string is "26 Jul 2024"). */
        ct_str f = need_str(c, ct_arg(a, 0, "format", ct_none()), "strftime_now format", pos);
        if (f.n > 256) ct_fail(c->e, pos, "strftime_now format too long");
        char fmt[260], out[1024];
        memcpy(fmt, f.p, f.n);
        fmt[f.n] = 0;
        struct tm tm = { .tm_year = 124, .tm_mon = 6, .tm_mday = 26, .tm_wday = 5, .tm_yday = 207 };
        size_t n = strftime(out, sizeof out, fmt, &tm);
        return ct_strv(c, out, n);
    }
    case FN_LOOP_CYCLE: {
        if (a->n == 0) ct_fail(c->e, pos, "no items for cycling given");
        return a->v[self.loop->idx % (size_t)a->n];
    }
    default: ct_fail(c->e, pos, "internal error: bad function");
    }
}
