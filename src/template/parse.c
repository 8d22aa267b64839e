/* Chat-template parser, expressions: tokens -> AST (recursive descent, jinja2's
 * grammar and operator precedence; filters bind tighter than binary operators),
 * plus the token helpers the statement parser (parse_stmt.c)
 * shares. Nesting is bounded by CT_MAX_DEPTH; unknown filters and tests are
 * compile errors. */
#include <stdio.h>
#include <string.h>

#include "template/template_internal.h"

const ct_token *ctp_cur(ct_parser *P) { return &P->t[P->i]; }
void ctp_adv(ct_parser *P) { if (P->t[P->i].type != T_EOF) P->i++; }
bool ctp_str_is(ct_str s, const char *lit) { return s.n == strlen(lit) && memcmp(s.p, lit, s.n) == 0; }
bool ctp_is_op(ct_parser *P, const char *op) { return ctp_cur(P)->type == T_OP && ctp_str_is(ctp_cur(P)->s, op); }
bool ctp_is_kw(ct_parser *P, const char *kw) { return ctp_cur(P)->type == T_NAME && ctp_str_is(ctp_cur(P)->s, kw); }

void ctp_enter(ct_parser *P) {
    if (++P->depth > CT_MAX_DEPTH) ct_fail(P->e, ctp_cur(P)->pos, "template nested too deeply");
}

_Noreturn void ctp_unexpected(ct_parser *P, const char *what) {
    const ct_token *t = ctp_cur(P);
    switch (t->type) {
    case T_EOF: ct_fail(P->e, t->pos, "unexpected end of template, expected %s", what);
    case T_VAR_END: case T_BLOCK_END: ct_fail(P->e, t->pos, "unexpected end of tag, expected %s", what);
    case T_NAME: case T_OP:
        ct_fail(P->e, t->pos, "unexpected '%.*s', expected %s", (int)(t->s.n > 40 ? 40 : t->s.n), t->s.p, what);
    case T_STRING: ct_fail(P->e, t->pos, "unexpected string, expected %s", what);
    case T_INT: case T_FLOAT: ct_fail(P->e, t->pos, "unexpected number, expected %s", what);
    default: ct_fail(P->e, t->pos, "unexpected text, expected %s", what);
    }
}

void ctp_expect_op(ct_parser *P, const char *op) {
    if (!ctp_is_op(P, op)) {
        char what[16];
        snprintf(what, sizeof what, "'%s'", op);
        ctp_unexpected(P, what);
    }
    ctp_adv(P);
}

ct_str ctp_expect_name(ct_parser *P) {
    if (ctp_cur(P)->type != T_NAME) ctp_unexpected(P, "a name");
    ct_str s = ctp_cur(P)->s;
    ctp_adv(P);
    return s;
}

void ctp_expect_end(ct_parser *P, ct_tok_type end) {
    if (ctp_cur(P)->type != end) ctp_unexpected(P, end == T_BLOCK_END ? "'%}'" : "'}}'");
    ctp_adv(P);
}

ct_node *ctp_mk(ct_parser *P, ct_kind k, size_t pos) {
    ct_node *n = ct_alloc(P->e, sizeof *n);
    memset(n, 0, sizeof *n);
    n->kind = k;
    n->pos = pos;
    return n;
}

void ctp_add(ct_parser *P, ct_nodes *l, ct_node *x) {
    if ((l->n & (l->n - 1)) == 0) { /* grow at powers of two */
        ct_node **v = ct_alloc(P->e, (size_t)(l->n ? l->n * 2 : 1) * sizeof *v);
        if (l->n) memcpy(v, l->v, (size_t)l->n * sizeof *v);
        l->v = v;
    }
    l->v[l->n++] = x;
}

void ctp_add_name(ct_parser *P, ct_node *n, ct_str s) {
    ct_str *v = ct_alloc(P->e, (size_t)(n->n_names + 1) * sizeof *v);
    if (n->n_names) memcpy(v, n->names, (size_t)n->n_names * sizeof *v);
    v[n->n_names++] = s;
    n->names = v;
}

static ct_node *parse_unary(ct_parser *P, bool with_filter);

/* (args, name=kwargs) after the '(' has been seen; fills body and names/alt. */
static void parse_call_args(ct_parser *P, ct_node *call) {
    ctp_expect_op(P, "(");
    while (!ctp_is_op(P, ")")) {
        if (call->body.n + call->alt.n > 0) ctp_expect_op(P, ",");
        if (ctp_is_op(P, ")")) break;
        if (ctp_cur(P)->type == T_NAME && P->t[P->i + 1].type == T_OP && ctp_str_is(P->t[P->i + 1].s, "=")) {
            ctp_add_name(P, call, ctp_cur(P)->s);
            P->i += 2;
            ctp_add(P, &call->alt, ctp_parse_expr(P));
        } else {
            if (call->alt.n) ct_fail(P->e, ctp_cur(P)->pos, "positional argument follows keyword argument");
            ctp_add(P, &call->body, ctp_parse_expr(P));
        }
    }
    ctp_adv(P);
}

static ct_node *parse_primary(ct_parser *P) {
    const ct_token *t = ctp_cur(P);
    ct_node *n;
    switch (t->type) {
    case T_NAME:
        ctp_adv(P);
        if (ctp_str_is(t->s, "true") || ctp_str_is(t->s, "True") || ctp_str_is(t->s, "false") || ctp_str_is(t->s, "False")) {
            n = ctp_mk(P, N_BOOL, t->pos);
            n->ival = t->s.p[0] == 't' || t->s.p[0] == 'T';
        } else if (ctp_str_is(t->s, "none") || ctp_str_is(t->s, "None")) {
            n = ctp_mk(P, N_NONE, t->pos);
        } else {
            n = ctp_mk(P, N_NAME, t->pos);
            n->name = t->s;
        }
        return n;
    case T_STRING: {
        n = ctp_mk(P, N_STR, t->pos);
        n->name = t->s;
        ctp_adv(P);
        if (ctp_cur(P)->type == T_STRING) { /* adjacent literals concatenate */
            size_t total = 0;
            for (size_t j = P->i - 1; P->t[j].type == T_STRING; j++) total += P->t[j].s.n;
            char *buf = ct_alloc(P->e, total + 1);
            size_t k = 0;
            for (P->i--; ctp_cur(P)->type == T_STRING; ctp_adv(P)) {
                memcpy(buf + k, ctp_cur(P)->s.p, ctp_cur(P)->s.n);
                k += ctp_cur(P)->s.n;
            }
            buf[k] = 0;
            n->name.p = buf;
            n->name.n = k;
        }
        return n;
    }
    case T_INT: n = ctp_mk(P, N_INT, t->pos); n->ival = t->ival; ctp_adv(P); return n;
    case T_FLOAT: n = ctp_mk(P, N_FLOAT, t->pos); n->fval = t->fval; ctp_adv(P); return n;
    case T_OP:
        if (ctp_is_op(P, "(")) {
            ctp_adv(P);
            if (ctp_is_op(P, ")")) { ctp_adv(P); return ctp_mk(P, N_TUPLE, t->pos); }
            ct_node *x = ctp_parse_expr(P);
            if (ctp_is_op(P, ",")) {
                n = ctp_mk(P, N_TUPLE, t->pos);
                ctp_add(P, &n->body, x);
                while (ctp_is_op(P, ",")) {
                    ctp_adv(P);
                    if (ctp_is_op(P, ")")) break;
                    ctp_add(P, &n->body, ctp_parse_expr(P));
                }
                x = n;
            }
            ctp_expect_op(P, ")");
            return x;
        }
        if (ctp_is_op(P, "[")) {
            ctp_adv(P);
            n = ctp_mk(P, N_LIST, t->pos);
            while (!ctp_is_op(P, "]")) {
                if (n->body.n) ctp_expect_op(P, ",");
                if (ctp_is_op(P, "]")) break;
                ctp_add(P, &n->body, ctp_parse_expr(P));
            }
            ctp_adv(P);
            return n;
        }
        if (ctp_is_op(P, "{")) {
            ctp_adv(P);
            n = ctp_mk(P, N_DICT, t->pos);
            while (!ctp_is_op(P, "}")) {
                if (n->body.n) ctp_expect_op(P, ",");
                if (ctp_is_op(P, "}")) break;
                ctp_add(P, &n->body, ctp_parse_expr(P));
                ctp_expect_op(P, ":");
                ctp_add(P, &n->alt, ctp_parse_expr(P));
            }
            ctp_adv(P);
            return n;
        }
        break;
    default: break;
    }
    ctp_unexpected(P, "an expression");
}

static ct_node *parse_subscript(ct_parser *P, ct_node *obj) {
    size_t pos = ctp_cur(P)->pos;
    ctp_expect_op(P, "[");
    ct_node *parts[3] = { 0 };
    int np = 0;
    bool slice = false;
    for (;;) {
        if (!ctp_is_op(P, ":") && !ctp_is_op(P, "]")) parts[np] = ctp_parse_expr(P);
        if (ctp_is_op(P, ":")) {
            slice = true;
            if (++np > 2) ctp_unexpected(P, "']'");
            ctp_adv(P);
            continue;
        }
        break;
    }
    ctp_expect_op(P, "]");
    ct_node *n = ctp_mk(P, slice ? N_SLICE : N_GETITEM, pos);
    n->a = obj;
    if (slice) {
        n->b = parts[0]; n->c = parts[1];
        if (parts[2]) ctp_add(P, &n->body, parts[2]);
    } else {
        if (!parts[0]) ct_fail(P->e, pos, "empty subscript");
        n->b = parts[0];
    }
    return n;
}

static ct_node *parse_postfix(ct_parser *P, ct_node *n) {
    for (;;) {
        if (ctp_is_op(P, ".")) {
            ctp_adv(P);
            ct_node *g;
            if (ctp_cur(P)->type == T_INT) {
                g = ctp_mk(P, N_GETITEM, ctp_cur(P)->pos);
                g->b = ctp_mk(P, N_INT, ctp_cur(P)->pos);
                g->b->ival = ctp_cur(P)->ival;
                ctp_adv(P);
            } else {
                g = ctp_mk(P, N_GETATTR, ctp_cur(P)->pos);
                g->name = ctp_expect_name(P);
            }
            g->a = n;
            n = g;
        } else if (ctp_is_op(P, "[")) {
            n = parse_subscript(P, n);
        } else if (ctp_is_op(P, "(")) {
            ct_node *c = ctp_mk(P, N_CALL, ctp_cur(P)->pos);
            c->a = n;
            parse_call_args(P, c);
            n = c;
        } else {
            return n;
        }
    }
}

/* "|name(args)" chain; input may be NULL (filter blocks). */
ct_node *ctp_parse_filter(ct_parser *P, ct_node *input) {
    size_t pos = ctp_cur(P)->pos;
    ct_node *f = ctp_mk(P, N_FILTER, pos);
    f->name = ctp_expect_name(P);
    if (!ct_filter_known(f->name.p, f->name.n))
        ct_fail(P->e, pos, "unknown filter '%.*s'", (int)(f->name.n > 40 ? 40 : f->name.n), f->name.p);
    f->a = input;
    if (ctp_is_op(P, "(")) parse_call_args(P, f);
    return f;
}

static ct_node *parse_filter_expr(ct_parser *P, ct_node *n) {
    for (;;) {
        if (ctp_is_op(P, "|")) {
            ctp_adv(P);
            n = ctp_parse_filter(P, n);
        } else if (ctp_is_kw(P, "is")) {
            ctp_adv(P);
            ct_node *t = ctp_mk(P, N_TEST, ctp_cur(P)->pos);
            if (ctp_is_kw(P, "not")) { t->op = 1; ctp_adv(P); }
            t->name = ctp_expect_name(P);
            if (!ct_test_known(t->name.p, t->name.n))
                ct_fail(P->e, t->pos, "unknown test '%.*s'", (int)(t->name.n > 40 ? 40 : t->name.n), t->name.p);
            t->a = n;
            const ct_token *c = ctp_cur(P);
            if (ctp_is_op(P, "(")) {
                parse_call_args(P, t);
            } else if ((c->type == T_NAME && !ctp_is_kw(P, "else") && !ctp_is_kw(P, "or") && !ctp_is_kw(P, "and") &&
                        !ctp_is_kw(P, "if") && !ctp_is_kw(P, "is")) ||
                       c->type == T_STRING || c->type == T_INT || c->type == T_FLOAT || ctp_is_op(P, "[") ||
                       ctp_is_op(P, "{")) {
                ctp_add(P, &t->body, parse_postfix(P, parse_primary(P)));
            }
            n = t;
        } else if (ctp_is_op(P, "(")) {
            ct_node *c = ctp_mk(P, N_CALL, ctp_cur(P)->pos);
            c->a = n;
            parse_call_args(P, c);
            n = c;
        } else {
            return n;
        }
    }
}

static ct_node *parse_unary(ct_parser *P, bool with_filter) {
    ctp_enter(P);
    ct_node *n;
    if (ctp_is_op(P, "-") || ctp_is_op(P, "+")) {
        n = ctp_mk(P, ctp_is_op(P, "-") ? N_NEG : N_POS, ctp_cur(P)->pos);
        ctp_adv(P);
        n->a = parse_unary(P, false);
    } else {
        n = parse_primary(P);
    }
    n = parse_postfix(P, n);
    if (with_filter) n = parse_filter_expr(P, n);
    P->depth--;
    return n;
}

static ct_node *binop(ct_parser *P, int op, size_t pos, ct_node *a, ct_node *b) {
    ct_node *n = ctp_mk(P, N_BINOP, pos);
    n->op = op; n->a = a; n->b = b;
    return n;
}

static ct_node *parse_pow(ct_parser *P) {
    ct_node *n = parse_unary(P, true);
    while (ctp_is_op(P, "**")) {
        size_t pos = ctp_cur(P)->pos;
        ctp_adv(P);
        n = binop(P, OP_POW, pos, n, parse_unary(P, true));
    }
    return n;
}

static ct_node *parse_math2(ct_parser *P) {
    ct_node *n = parse_pow(P);
    for (;;) {
        int op = ctp_is_op(P, "*") ? OP_MUL : ctp_is_op(P, "/") ? OP_DIV : ctp_is_op(P, "//") ? OP_FDIV : ctp_is_op(P, "%") ? OP_MOD : -1;
        if (op < 0) return n;
        size_t pos = ctp_cur(P)->pos;
        ctp_adv(P);
        n = binop(P, op, pos, n, parse_pow(P));
    }
}

static ct_node *parse_concat(ct_parser *P) {
    ct_node *n = parse_math2(P);
    while (ctp_is_op(P, "~")) {
        size_t pos = ctp_cur(P)->pos;
        ctp_adv(P);
        n = binop(P, OP_CAT, pos, n, parse_math2(P));
    }
    return n;
}

static ct_node *parse_math1(ct_parser *P) {
    ct_node *n = parse_concat(P);
    for (;;) {
        int op = ctp_is_op(P, "+") ? OP_ADD : ctp_is_op(P, "-") ? OP_SUB : -1;
        if (op < 0) return n;
        size_t pos = ctp_cur(P)->pos;
        ctp_adv(P);
        n = binop(P, op, pos, n, parse_concat(P));
    }
}

static ct_node *parse_compare(ct_parser *P) {
    ct_node *left = parse_math1(P), *result = NULL;
    for (;;) {
        size_t pos = ctp_cur(P)->pos;
        int op = ctp_is_op(P, "==") ? OP_EQ : ctp_is_op(P, "!=") ? OP_NE : ctp_is_op(P, "<") ? OP_LT
               : ctp_is_op(P, "<=") ? OP_LE : ctp_is_op(P, ">") ? OP_GT : ctp_is_op(P, ">=") ? OP_GE
               : ctp_is_kw(P, "in") ? OP_IN : -1;
        if (op < 0 && ctp_is_kw(P, "not") && P->t[P->i + 1].type == T_NAME && ctp_str_is(P->t[P->i + 1].s, "in")) {
            op = OP_NOTIN;
            ctp_adv(P);
        }
        if (op < 0) return result ? result : left;
        ctp_adv(P);
        ct_node *right = parse_math1(P);
        ct_node *c = ctp_mk(P, N_CMP, pos);
        c->op = op; c->a = left; c->b = right;
        if (result) { /* a < b < c  ==  (a < b) and (b < c) */
            ct_node *and = ctp_mk(P, N_AND, pos);
            and->a = result; and->b = c;
            result = and;
        } else {
            result = c;
        }
        left = right;
    }
}

static ct_node *parse_not(ct_parser *P) {
    if (ctp_is_kw(P, "not")) {
        ctp_enter(P);
        ct_node *n = ctp_mk(P, N_NOT, ctp_cur(P)->pos);
        ctp_adv(P);
        n->a = parse_not(P);
        P->depth--;
        return n;
    }
    return parse_compare(P);
}

static ct_node *parse_and(ct_parser *P) {
    ct_node *n = parse_not(P);
    while (ctp_is_kw(P, "and")) {
        ct_node *x = ctp_mk(P, N_AND, ctp_cur(P)->pos);
        ctp_adv(P);
        x->a = n; x->b = parse_not(P);
        n = x;
    }
    return n;
}

ct_node *ctp_parse_or(ct_parser *P) {
    ct_node *n = parse_and(P);
    while (ctp_is_kw(P, "or")) {
        ct_node *x = ctp_mk(P, N_OR, ctp_cur(P)->pos);
        ctp_adv(P);
        x->a = n; x->b = parse_and(P);
        n = x;
    }
    return n;
}

ct_node *ctp_parse_expr(ct_parser *P) {
    ctp_enter(P);
    ct_node *n = ctp_parse_or(P);
    while (ctp_is_kw(P, "if")) {
        ct_node *c = ctp_mk(P, N_COND, ctp_cur(P)->pos);
        ctp_adv(P);
        c->a = n;
        c->b = ctp_parse_or(P);
        if (ctp_is_kw(P, "else")) {
            ctp_adv(P);
            c->c = ctp_parse_expr(P);
        }
        n = c;
    }
    P->depth--;
    return n;
}

/* expr or "a, b, ..." (an implicit tuple) */
ct_node *ctp_parse_tuple_expr(ct_parser *P) {
    ct_node *n = ctp_parse_expr(P);
    if (!ctp_is_op(P, ",")) return n;
    ct_node *t = ctp_mk(P, N_TUPLE, n->pos);
    ctp_add(P, &t->body, n);
    while (ctp_is_op(P, ",")) {
        ctp_adv(P);
        if (ctp_cur(P)->type == T_VAR_END || ctp_cur(P)->type == T_BLOCK_END) break;
        ctp_add(P, &t->body, ctp_parse_expr(P));
    }
    return t;
}

