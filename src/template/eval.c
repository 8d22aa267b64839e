/* Chat-template evaluation: scopes, expressions, operators, statements, macros.
 * Scoping follows jinja2: a for loop opens a scope (its sets do not leak out,
 * hence namespace()), if blocks do not; macros see the template's top-level
 * scope. Work, recursion and output are bounded (see the CT_ limits). */
#include <math.h>
#include <string.h>

#include "template/template_internal.h"

struct ct_frame {
    ct_frame *parent;
    ct_str *names;
    ct_value *vals;
    size_t n, cap;
};

enum { R_OK, R_BREAK, R_CONTINUE };

static bool str_eq(ct_str a, const char *b) { return a.n == strlen(b) && memcmp(a.p, b, a.n) == 0; }

static ct_frame *frame_new(ct_ctx *c, ct_frame *parent) {
    ct_frame *f = ct_alloc(c->e, sizeof *f);
    memset(f, 0, sizeof *f);
    f->parent = parent;
    return f;
}

static void frame_set(ct_ctx *c, ct_frame *f, ct_str name, ct_value v) {
    for (size_t i = 0; i < f->n; i++)
        if (f->names[i].n == name.n && memcmp(f->names[i].p, name.p, name.n) == 0) {
            f->vals[i] = v;
            return;
        }
    if (f->n == f->cap) {
        size_t cap = f->cap ? f->cap * 2 : 8;
        ct_str *nn = ct_alloc(c->e, cap * sizeof *nn);
        ct_value *nv = ct_alloc(c->e, cap * sizeof *nv);
        if (f->n) {
            memcpy(nn, f->names, f->n * sizeof *nn);
            memcpy(nv, f->vals, f->n * sizeof *nv);
        }
        f->names = nn; f->vals = nv; f->cap = cap;
    }
    f->names[f->n] = name;
    f->vals[f->n++] = v;
}

static ct_value *lookup(ct_frame *f, ct_str name) {
    for (; f; f = f->parent)
        for (size_t i = 0; i < f->n; i++)
            if (f->names[i].n == name.n && memcmp(f->names[i].p, name.p, name.n) == 0) return &f->vals[i];
    return NULL;
}

void ct_step(ct_ctx *c, size_t pos) {
    if (++c->steps > CT_MAX_STEPS) ct_fail(c->e, pos, "template exceeded the evaluation step limit");
}

static ct_value eval(ct_ctx *c, ct_frame *f, const ct_node *n);
static int exec_body(ct_ctx *c, ct_frame *f, const ct_nodes *body);

static _Noreturn void fail_undef(ct_ctx *c, ct_value v, size_t pos) {
    if (v.tuple) ct_fail(c->e, pos, "%.*s", (int)v.s.n, v.s.p);
    if (v.s.n) ct_fail(c->e, pos, "'%.*s' is undefined", (int)(v.s.n > 60 ? 60 : v.s.n), v.s.p);
    ct_fail(c->e, pos, "undefined value used");
}

static void eval_args(ct_ctx *c, ct_frame *f, const ct_node *n, ct_args *a) {
    a->n = n->body.n;
    a->nkw = n->alt.n;
    a->v = a->n ? ct_alloc(c->e, (size_t)a->n * sizeof(ct_value)) : NULL;
    a->kwv = a->nkw ? ct_alloc(c->e, (size_t)a->nkw * sizeof(ct_value)) : NULL;
    a->kwn = n->names;
    a->pos = n->pos;
    for (int i = 0; i < a->n; i++) a->v[i] = eval(c, f, n->body.v[i]);
    for (int i = 0; i < a->nkw; i++) a->kwv[i] = eval(c, f, n->alt.v[i]);
}

static ct_value apply_filter_node(ct_ctx *c, ct_frame *f, const ct_node *n, ct_value in) {
    ct_args a;
    eval_args(c, f, n, &a);
    return ct_filter(c, n->name, in, &a);
}

static ct_value filter_chain(ct_ctx *c, ct_frame *f, const ct_node *n, ct_value in) {
    if (++c->depth > 600) ct_fail(c->e, n->pos, "template recursion too deep");
    if (n->a) in = filter_chain(c, f, n->a, in);
    ct_value r = apply_filter_node(c, f, n, in);
    c->depth--;
    return r;
}

static ct_value call_macro(ct_ctx *c, const ct_node *m, ct_args *a) {
    if (a->n > m->n_names)
        ct_fail(c->e, a->pos, "macro '%.*s' takes not more than %d argument(s)", (int)m->name.n, m->name.p, m->n_names);
    if (++c->calls > CT_MAX_CALL_DEPTH) ct_fail(c->e, a->pos, "macro recursion too deep");
    ct_frame *mf = frame_new(c, c->globals);
    for (int i = 0; i < m->n_names; i++) {
        ct_value v = ct_undef(m->names[i]);
        bool set = false;
        if (i < a->n) { v = a->v[i]; set = true; }
        for (int k = 0; k < a->nkw; k++)
            if (a->kwn[k].n == m->names[i].n && memcmp(a->kwn[k].p, m->names[i].p, a->kwn[k].n) == 0) {
                v = a->kwv[k];
                set = true;
            }
        if (!set && m->alt.v[i]) v = eval(c, mf, m->alt.v[i]);
        frame_set(c, mf, m->names[i], v);
    }
    for (int k = 0; k < a->nkw; k++) {
        bool known = false;
        for (int i = 0; i < m->n_names; i++)
            known |= a->kwn[k].n == m->names[i].n && memcmp(a->kwn[k].p, m->names[i].p, a->kwn[k].n) == 0;
        if (!known)
            ct_fail(c->e, a->pos, "macro '%.*s' has no argument '%.*s'", (int)m->name.n, m->name.p,
                    (int)a->kwn[k].n, a->kwn[k].p);
    }
    ct_buf out = { 0 }, *saved = c->out;
    c->out = &out;
    exec_body(c, mf, &m->body);
    c->out = saved;
    c->calls--;
    return ct_buf_value(&out);
}

static ct_value call(ct_ctx *c, ct_value callee, ct_args *a) {
    switch (callee.t) {
    case V_MACRO: return call_macro(c, callee.macro, a);
    case V_FUNC: return ct_call_func(c, callee.fn, ct_none(), a);
    case V_METHOD: return ct_call_method(c, callee.m, a);
    case V_UNDEF: fail_undef(c, callee, a->pos);
    default: ct_fail(c->e, a->pos, "'%s' object is not callable", ct_type_name(callee));
    }
}

static int64_t as_int(ct_value v) { return v.t == V_INT ? v.i : v.t == V_BOOL ? (int64_t)v.b : 0; }

static ct_value arith(ct_ctx *c, int op, ct_value a, ct_value b, size_t pos) {
    bool both_int = a.t != V_FLOAT && b.t != V_FLOAT;
    int64_t x = as_int(a), y = as_int(b), r;
    double p = ct_num(a), q = ct_num(b);
    switch (op) {
    case OP_ADD:
        if (!both_int) return ct_float(p + q);
        if (__builtin_add_overflow(x, y, &r)) break;
        return ct_int(r);
    case OP_SUB:
        if (!both_int) return ct_float(p - q);
        if (__builtin_sub_overflow(x, y, &r)) break;
        return ct_int(r);
    case OP_MUL:
        if (!both_int) return ct_float(p * q);
        if (__builtin_mul_overflow(x, y, &r)) break;
        return ct_int(r);
    case OP_DIV:
        if (q == 0) ct_fail(c->e, pos, "division by zero");
        return ct_float(p / q);
    case OP_FDIV: case OP_MOD:
        if (q == 0) ct_fail(c->e, pos, "%s by zero", op == OP_MOD ? "modulo" : "integer division");
        if (both_int) {
            if (x == INT64_MIN && y == -1) break;
            int64_t d = x / y, m = x % y;
            if (m != 0 && ((m < 0) != (y < 0))) { d--; m += y; }
            return ct_int(op == OP_FDIV ? d : m);
        } else {
            double m = fmod(p, q);
            if (m != 0 && ((m < 0) != (q < 0))) m += q;
            return ct_float(op == OP_FDIV ? floor(p / q) : m);
        }
    case OP_POW:
        if (both_int && y >= 0) {
            if (x == 0 || x == 1) return ct_int(y == 0 ? 1 : x);
            if (x == -1) return ct_int(y % 2 ? -1 : 1);
            int64_t acc = 1; /* |x| >= 2: overflows within 63 steps */
            for (int64_t i = 0; i < y; i++)
                if (__builtin_mul_overflow(acc, x, &acc)) goto overflow;
            return ct_int(acc);
        }
        if (p == 0 && q < 0) ct_fail(c->e, pos, "0 cannot be raised to a negative power");
        return ct_float(pow(p, q));
    }
overflow:
    ct_fail(c->e, pos, "integer overflow");
}

static ct_value repeat(ct_ctx *c, ct_value seq, int64_t times, size_t pos) {
    if (times < 0) times = 0;
    if (seq.t == V_STR && seq.s.n == 0) times = 0; /* '' * 10**11 is '' at once, not after 10**11 steps */
    if (seq.t == V_STR) {
        if (seq.s.n && (uint64_t)times > CT_MAX_OUTPUT / seq.s.n) ct_fail(c->e, pos, "string too long");
        ct_buf b = { 0 };
        for (int64_t i = 0; i < times; i++) ct_buf_put(c, &b, seq.s.p, seq.s.n);
        return ct_buf_value(&b);
    }
    if (seq.l->n && (uint64_t)times > (CT_RENDER_MEM / sizeof(ct_value)) / seq.l->n) ct_fail(c->e, pos, "list too long");
    ct_list *l = ct_list_new(c, seq.l->n * (size_t)times);
    for (size_t i = 0; i < l->n; i++) l->v[i] = seq.l->v[i % seq.l->n];
    return ct_listv(l);
}

static ct_value binop(ct_ctx *c, int op, ct_value a, ct_value b, size_t pos) {
    static const char *const names[] = { "+", "-", "*", "/", "//", "%", "**", "~" };
    if (op == OP_CAT) {
        ct_buf buf = { 0 };
        ct_write_str(c, &buf, a);
        ct_write_str(c, &buf, b);
        return ct_buf_value(&buf);
    }
    if (a.t == V_UNDEF) fail_undef(c, a, pos);
    if (b.t == V_UNDEF) fail_undef(c, b, pos);
    if (ct_is_num(a) && ct_is_num(b)) return arith(c, op, a, b, pos);
    if (op == OP_ADD && a.t == V_STR && b.t == V_STR) {
        ct_buf buf = { 0 };
        ct_buf_put(c, &buf, a.s.p, a.s.n);
        ct_buf_put(c, &buf, b.s.p, b.s.n);
        return ct_buf_value(&buf);
    }
    if (op == OP_ADD && a.t == V_LIST && b.t == V_LIST) {
        ct_list *l = ct_list_new(c, a.l->n + b.l->n);
        if (a.l->n) memcpy(l->v, a.l->v, a.l->n * sizeof(ct_value));
        if (b.l->n) memcpy(l->v + a.l->n, b.l->v, b.l->n * sizeof(ct_value));
        ct_value r = ct_listv(l);
        r.tuple = a.tuple;
        return r;
    }
    if (op == OP_MUL && (a.t == V_STR || a.t == V_LIST) && (b.t == V_INT || b.t == V_BOOL))
        return repeat(c, a, as_int(b), pos);
    if (op == OP_MUL && (b.t == V_STR || b.t == V_LIST) && (a.t == V_INT || a.t == V_BOOL))
        return repeat(c, b, as_int(a), pos);
    ct_fail(c->e, pos, "unsupported operand type(s) for %s: '%s' and '%s'", names[op], ct_type_name(a),
            ct_type_name(b));
}

static bool contains(ct_ctx *c, ct_value hay, ct_value needle, size_t pos) {
    switch (hay.t) {
    case V_UNDEF: return false;
    case V_STR:
        if (needle.t != V_STR) ct_fail(c->e, pos, "'in <string>' requires string as left operand, not %s", ct_type_name(needle));
        if (needle.s.n == 0) return true;
        for (size_t i = 0; i + needle.s.n <= hay.s.n; i++)
            if (memcmp(hay.s.p + i, needle.s.p, needle.s.n) == 0) return true;
        return false;
    case V_LIST:
        for (size_t i = 0; i < hay.l->n; i++)
            if (ct_equal(hay.l->v[i], needle)) return true;
        return false;
    case V_DICT:
        if (hay.d->ns) break;
        return ct_dict_get(hay.d, needle) != NULL;
    default: break;
    }
    ct_fail(c->e, pos, "argument of type '%s' is not iterable", ct_type_name(hay));
}

static ct_value compare(ct_ctx *c, int op, ct_value a, ct_value b, size_t pos) {
    switch (op) {
    case OP_EQ: return ct_bool(ct_equal(a, b));
    case OP_NE: return ct_bool(!ct_equal(a, b));
    case OP_IN: return ct_bool(contains(c, b, a, pos));
    case OP_NOTIN: return ct_bool(!contains(c, b, a, pos));
    default: break;
    }
    if (a.t == V_UNDEF) fail_undef(c, a, pos);
    if (b.t == V_UNDEF) fail_undef(c, b, pos);
    int r = ct_compare(c, a, b, pos);
    return ct_bool(op == OP_LT ? r < 0 : op == OP_LE ? r <= 0 : op == OP_GT ? r > 0 : r >= 0);
}

/* Python slice semantics over list items or string characters. */
static ct_value slice(ct_ctx *c, ct_value obj, ct_value lo, ct_value hi, ct_value st, size_t pos) {
    if (obj.t == V_UNDEF) fail_undef(c, obj, pos);
    if (obj.t != V_LIST && obj.t != V_STR) ct_fail(c->e, pos, "'%s' object is not subscriptable", ct_type_name(obj));
    ct_list *items = obj.t == V_STR ? ct_iterate(c, obj, pos) : obj.l;
    int64_t n = (int64_t)items->n, step = 1, start, stop;
    for (int k = 0; k < 3; k++) {
        ct_value v = k == 0 ? lo : k == 1 ? hi : st;
        if (v.t != V_NONE && v.t != V_INT && v.t != V_BOOL)
            ct_fail(c->e, pos, "slice indices must be integers or None");
    }
    if (st.t != V_NONE) step = as_int(st);
    if (step == 0) ct_fail(c->e, pos, "slice step cannot be zero");
    if (step < -INT64_MAX) step = -INT64_MAX;
    int64_t dflt_lo = step > 0 ? 0 : n - 1, dflt_hi = step > 0 ? n : -1;
    start = lo.t == V_NONE ? dflt_lo : as_int(lo);
    stop = hi.t == V_NONE ? dflt_hi : as_int(hi);
    if (lo.t != V_NONE) {
        if (start < 0) start = start < -n ? (step > 0 ? 0 : -1) : start + n;
        else if (start >= n) start = step > 0 ? n : n - 1;
    }
    if (hi.t != V_NONE) {
        if (stop < 0) stop = stop < -n ? (step > 0 ? 0 : -1) : stop + n;
        else if (stop >= n) stop = step > 0 ? n : n - 1;
    }
    size_t count = 0;
    if (step > 0 && stop > start) count = (size_t)((stop - start - 1) / step + 1);
    if (step < 0 && stop < start) count = (size_t)((start - stop - 1) / -step + 1);
    ct_list *l = ct_list_new(c, count);
    for (size_t i = 0; i < count; i++) l->v[i] = items->v[start + (int64_t)i * step];
    if (obj.t == V_LIST) {
        ct_value r = ct_listv(l);
        r.tuple = obj.tuple;
        return r;
    }
    ct_buf b = { 0 };
    for (size_t i = 0; i < count; i++) ct_buf_put(c, &b, l->v[i].s.p, l->v[i].s.n);
    return ct_buf_value(&b);
}

static ct_value eval_name(ct_ctx *c, ct_frame *f, const ct_node *n) {
    ct_value *v = lookup(f, n->name);
    if (v) return *v;
    static const char *const fns[] = { "range", "namespace", "raise_exception", "strftime_now", "dict" };
    static const int ids[] = { FN_RANGE, FN_NAMESPACE, FN_RAISE, FN_STRFTIME, FN_DICT };
    for (int i = 0; i < 5; i++)
        if (str_eq(n->name, fns[i])) return (ct_value){ .t = V_FUNC, .fn = ids[i] };
    return ct_undef(n->name);
}

static ct_value eval(ct_ctx *c, ct_frame *f, const ct_node *n) {
    ct_step(c, n->pos);
    if (++c->depth > 600) ct_fail(c->e, n->pos, "template recursion too deep");
    ct_value r;
    switch (n->kind) {
    case N_STR: r = ct_strref(n->name); break;
    case N_INT: r = ct_int(n->ival); break;
    case N_FLOAT: r = ct_float(n->fval); break;
    case N_BOOL: r = ct_bool(n->ival != 0); break;
    case N_NONE: r = ct_none(); break;
    case N_LIST: case N_TUPLE: {
        ct_list *l = ct_list_new(c, (size_t)n->body.n);
        for (int i = 0; i < n->body.n; i++) l->v[i] = eval(c, f, n->body.v[i]);
        r = ct_listv(l);
        r.tuple = n->kind == N_TUPLE;
        break;
    }
    case N_DICT: {
        ct_dict *d = ct_dict_new(c);
        for (int i = 0; i < n->body.n; i++) {
            ct_value k = eval(c, f, n->body.v[i]);
            ct_dict_set(c, d, k, eval(c, f, n->alt.v[i]));
        }
        r = (ct_value){ .t = V_DICT, .d = d };
        break;
    }
    case N_NAME: r = eval_name(c, f, n); break;
    case N_GETATTR: r = ct_getattr(c, eval(c, f, n->a), n->name, n->pos); break;
    case N_GETITEM: {
        ct_value obj = eval(c, f, n->a);
        r = ct_getitem(c, obj, eval(c, f, n->b), n->pos);
        break;
    }
    case N_SLICE: {
        ct_value obj = eval(c, f, n->a);
        ct_value lo = n->b ? eval(c, f, n->b) : ct_none();
        ct_value hi = n->c ? eval(c, f, n->c) : ct_none();
        ct_value st = n->body.n ? eval(c, f, n->body.v[0]) : ct_none();
        r = slice(c, obj, lo, hi, st, n->pos);
        break;
    }
    case N_CALL: {
        ct_value callee = eval(c, f, n->a);
        ct_args a;
        eval_args(c, f, n, &a);
        r = call(c, callee, &a);
        break;
    }
    case N_FILTER: r = apply_filter_node(c, f, n, eval(c, f, n->a)); break;
    case N_TEST: {
        ct_value in = eval(c, f, n->a);
        ct_args a;
        eval_args(c, f, n, &a);
        r = ct_bool(ct_test(c, n->name, in, &a) != (n->op != 0));
        break;
    }
    case N_BINOP: {
        ct_value a = eval(c, f, n->a);
        r = binop(c, n->op, a, eval(c, f, n->b), n->pos);
        break;
    }
    case N_NEG: case N_POS: {
        ct_value a = eval(c, f, n->a);
        if (a.t == V_UNDEF) fail_undef(c, a, n->pos);
        if (!ct_is_num(a)) ct_fail(c->e, n->pos, "bad operand type for unary %c: '%s'", n->kind == N_NEG ? '-' : '+', ct_type_name(a));
        if (n->kind == N_POS) r = a.t == V_BOOL ? ct_int(a.b) : a;
        else if (a.t == V_FLOAT) r = ct_float(-a.f);
        else if (as_int(a) == INT64_MIN) ct_fail(c->e, n->pos, "integer overflow");
        else r = ct_int(-as_int(a));
        break;
    }
    case N_AND: r = eval(c, f, n->a); if (ct_truthy(r)) r = eval(c, f, n->b); break;
    case N_OR: r = eval(c, f, n->a); if (!ct_truthy(r)) r = eval(c, f, n->b); break;
    case N_NOT: r = ct_bool(!ct_truthy(eval(c, f, n->a))); break;
    case N_CMP: {
        ct_value a = eval(c, f, n->a);
        r = compare(c, n->op, a, eval(c, f, n->b), n->pos);
        break;
    }
    case N_COND:
        if (ct_truthy(eval(c, f, n->b))) r = eval(c, f, n->a);
        else r = n->c ? eval(c, f, n->c) : ct_undef((ct_str){ 0 });
        break;
    default: ct_fail(c->e, n->pos, "internal error: bad expression node");
    }
    c->depth--;
    return r;
}

static void assign_targets(ct_ctx *c, ct_frame *f, const ct_node *n, ct_value v) {
    if (n->n_names == 1) {
        frame_set(c, f, n->names[0], v);
        return;
    }
    ct_list *items = (v.t == V_LIST || v.t == V_STR) ? ct_iterate(c, v, n->pos) : NULL;
    if (!items) ct_fail(c->e, n->pos, "cannot unpack non-iterable %s object", ct_type_name(v));
    if (items->n != (size_t)n->n_names)
        ct_fail(c->e, n->pos, "cannot unpack %zu values into %d names", items->n, n->n_names);
    for (int i = 0; i < n->n_names; i++) frame_set(c, f, n->names[i], items->v[i]);
}

static int exec_for(ct_ctx *c, ct_frame *f, const ct_node *n) {
    ct_list *items = ct_iterate(c, eval(c, f, n->a), n->pos);
    if (n->b) { /* for x in xs if cond: filter first, loop.* counts kept items */
        ct_list *kept = ct_list_new(c, items->n);
        kept->n = 0;
        ct_frame *tf = frame_new(c, f);
        for (size_t i = 0; i < items->n; i++) {
            assign_targets(c, tf, n, items->v[i]);
            if (ct_truthy(eval(c, tf, n->b))) kept->v[kept->n++] = items->v[i];
        }
        items = kept;
    }
    if (items->n == 0) return exec_body(c, f, &n->alt);
    ct_frame *lf = frame_new(c, f);
    ct_loop *loop = ct_alloc(c->e, sizeof *loop);
    loop->items = items;
    frame_set(c, lf, (ct_str){ "loop", 4 }, (ct_value){ .t = V_LOOP, .loop = loop });
    for (size_t i = 0; i < items->n; i++) {
        ct_step(c, n->pos);
        loop->idx = i;
        assign_targets(c, lf, n, items->v[i]);
        if (exec_body(c, lf, &n->body) == R_BREAK) break;
    }
    return R_OK;
}

static int exec(ct_ctx *c, ct_frame *f, const ct_node *n) {
    ct_step(c, n->pos);
    int r = R_OK;
    switch (n->kind) {
    case S_TEXT: ct_buf_put(c, c->out, n->name.p, n->name.n); break;
    case S_OUTPUT: ct_write_str(c, c->out, eval(c, f, n->a)); break;
    case S_IF: r = exec_body(c, f, ct_truthy(eval(c, f, n->a)) ? &n->body : &n->alt); break;
    case S_FOR: r = exec_for(c, f, n); break;
    case S_SET:
        if (n->a) { /* ns.attr = value */
            ct_value ns = eval(c, f, n->a->a);
            if (ns.t != V_DICT || !ns.d->ns)
                ct_fail(c->e, n->pos, "cannot assign attribute on non-namespace object");
            ct_dict_set(c, ns.d, ct_strref(n->a->name), eval(c, f, n->b));
        } else {
            assign_targets(c, f, n, eval(c, f, n->b));
        }
        break;
    case S_SETBLOCK: case S_FILTERBLOCK: {
        ct_buf out = { 0 }, *saved = c->out;
        c->out = &out;
        exec_body(c, f, &n->body);
        c->out = saved;
        ct_value v = ct_buf_value(&out);
        if (n->a) v = filter_chain(c, f, n->a, v);
        if (n->kind == S_SETBLOCK) frame_set(c, f, n->names[0], v);
        else ct_write_str(c, c->out, v);
        break;
    }
    case S_MACRO: frame_set(c, f, n->name, (ct_value){ .t = V_MACRO, .macro = n }); break;
    case S_BREAK: r = R_BREAK; break;
    case S_CONTINUE: r = R_CONTINUE; break;
    case S_BODY: r = exec_body(c, f, &n->body); break;
    default: ct_fail(c->e, n->pos, "internal error: bad statement node");
    }
    return r;
}

static int exec_body(ct_ctx *c, ct_frame *f, const ct_nodes *body) {
    if (++c->depth > 600) ct_fail(c->e, body->n ? body->v[0]->pos : 0, "template recursion too deep");
    for (int i = 0; i < body->n; i++) {
        int r = exec(c, f, body->v[i]);
        if (r != R_OK) { c->depth--; return r; }
    }
    c->depth--;
    return R_OK;
}

static void set_key(ct_ctx *c, ct_dict *d, const char *key, ct_value v) {
    ct_dict_set(c, d, ct_strv(c, key, strlen(key)), v);
}

static ct_value str_or_none(ct_ctx *c, const char *s) { return s ? ct_strv(c, s, strlen(s)) : ct_none(); }

/* A message as the dict transformers is given: role and content, then the
 * keys the message has (name, tool_calls, tool_call_id) and no others, since
 * templates test `'tool_calls' in message`. */
static ct_value message_value(ct_ctx *c, const ct_message *m) {
    ct_dict *d = ct_dict_new(c);
    set_key(c, d, "role", str_or_none(c, m->role));
    set_key(c, d, "content", str_or_none(c, m->content));
    if (m->name) set_key(c, d, "name", str_or_none(c, m->name));
    if (m->tool_calls) set_key(c, d, "tool_calls", ct_json_value(c, m->tool_calls, "a message's tool_calls"));
    if (m->tool_call_id) set_key(c, d, "tool_call_id", str_or_none(c, m->tool_call_id));
    return (ct_value){ .t = V_DICT, .d = d };
}

char *ct_render(ct_err *e, const ct_node *root, const ct_message *msgs, int n_msgs, const char *tools,
                bool add_generation_prompt, const char *bos, const char *eos, size_t *out_len) {
    ct_ctx c = { .e = e };
    ct_frame *g = frame_new(&c, NULL);
    c.globals = g;
    ct_list *ml = ct_list_new(&c, n_msgs > 0 ? (size_t)n_msgs : 0);
    for (int i = 0; i < n_msgs; i++) ml->v[i] = message_value(&c, &msgs[i]);
    frame_set(&c, g, (ct_str){ "messages", 8 }, ct_listv(ml));
    frame_set(&c, g, (ct_str){ "add_generation_prompt", 21 }, ct_bool(add_generation_prompt));
    /* transformers passes tools=None and documents=None when none are given */
    frame_set(&c, g, (ct_str){ "tools", 5 }, tools ? ct_json_value(&c, tools, "tools") : ct_none());
    frame_set(&c, g, (ct_str){ "documents", 9 }, ct_none());
    if (bos) frame_set(&c, g, (ct_str){ "bos_token", 9 }, ct_strv(&c, bos, strlen(bos)));
    if (eos) frame_set(&c, g, (ct_str){ "eos_token", 9 }, ct_strv(&c, eos, strlen(eos)));
    ct_buf out = { 0 };
    c.out = &out;
    exec_body(&c, g, &root->body);
    *out_len = out.n;
    return out.p ? out.p : ct_strdup(e, "", 0);
}
