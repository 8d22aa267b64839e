/* Chat-template parser, statements: {% if %}, {% for %}, {% set %}, {% macro %},
 * {% filter %}, {% generation %}, break/continue, and the template body.
 * Expressions and the shared helpers are in parse.c. */
#include <stdio.h>
#include <string.h>

#include "template/template_internal.h"

/* ---- statements ---------------------------------------------------------------- */
static int parse_body(ct_parser *P, const char *const *ends, ct_nodes *out);

static void parse_block_until(ct_parser *P, const char *const *ends, ct_nodes *out, const char *tag, size_t tag_pos,
                              int *which) {
    int w = parse_body(P, ends, out);
    if (w < 0)
        ct_fail(P->e, tag_pos, "'%s' block is never closed (expected '{%% %s %%}')", tag, ends[0]);
    ctp_adv(P); /* the end tag's name */
    if (which) *which = w;
}

static ct_node *parse_if(ct_parser *P, size_t pos, const char *tag) {
    static const char *const ends[] = { "endif", "elif", "else", NULL };
    ctp_enter(P); /* elif chains nest */
    ct_node *n = ctp_mk(P, S_IF, pos);
    n->a = ctp_parse_expr(P);
    ctp_expect_end(P, T_BLOCK_END);
    int w;
    parse_block_until(P, ends, &n->body, tag, pos, &w);
    if (w == 1) { /* elif */
        size_t epos = P->t[P->i - 1].pos;
        ctp_add(P, &n->alt, parse_if(P, epos, "elif"));
        P->depth--;
        return n;
    }
    ctp_expect_end(P, T_BLOCK_END);
    if (w == 2) {
        static const char *const ends2[] = { "endif", NULL };
        parse_block_until(P, ends2, &n->alt, "else", pos, NULL);
        ctp_expect_end(P, T_BLOCK_END);
    }
    P->depth--;
    return n;
}

static ct_node *parse_for(ct_parser *P, size_t pos) {
    static const char *const ends[] = { "endfor", "else", NULL };
    static const char *const ends2[] = { "endfor", NULL };
    ct_node *n = ctp_mk(P, S_FOR, pos);
    bool paren = ctp_is_op(P, "(");
    if (paren) ctp_adv(P);
    ctp_add_name(P, n, ctp_expect_name(P));
    while (ctp_is_op(P, ",")) {
        ctp_adv(P);
        if (ctp_is_kw(P, "in") || ctp_is_op(P, ")")) break;
        ctp_add_name(P, n, ctp_expect_name(P));
    }
    if (paren) ctp_expect_op(P, ")");
    if (!ctp_is_kw(P, "in")) ctp_unexpected(P, "'in'");
    ctp_adv(P);
    n->a = ctp_parse_or(P);
    if (ctp_is_op(P, ",")) { /* for x in a, b */
        ct_node *t = ctp_mk(P, N_TUPLE, n->a->pos);
        ctp_add(P, &t->body, n->a);
        while (ctp_is_op(P, ",")) {
            ctp_adv(P);
            ctp_add(P, &t->body, ctp_parse_or(P));
        }
        n->a = t;
    }
    if (ctp_is_kw(P, "if")) {
        ctp_adv(P);
        n->b = ctp_parse_expr(P);
    }
    if (ctp_is_kw(P, "recursive")) ct_fail(P->e, ctp_cur(P)->pos, "recursive loops are not supported");
    ctp_expect_end(P, T_BLOCK_END);
    int w;
    P->loops++;
    parse_block_until(P, ends, &n->body, "for", pos, &w);
    P->loops--;
    ctp_expect_end(P, T_BLOCK_END);
    if (w == 1) {
        parse_block_until(P, ends2, &n->alt, "for", pos, NULL);
        ctp_expect_end(P, T_BLOCK_END);
    }
    return n;
}

static ct_node *parse_set(ct_parser *P, size_t pos) {
    static const char *const ends[] = { "endset", NULL };
    ct_node *n = ctp_mk(P, S_SET, pos);
    ct_str first = ctp_expect_name(P);
    if (ctp_is_op(P, ".")) { /* ns.attr = ... */
        ctp_adv(P);
        ct_node *g = ctp_mk(P, N_GETATTR, pos);
        g->a = ctp_mk(P, N_NAME, pos);
        g->a->name = first;
        g->name = ctp_expect_name(P);
        n->a = g;
    } else {
        ctp_add_name(P, n, first);
        while (ctp_is_op(P, ",")) {
            ctp_adv(P);
            ctp_add_name(P, n, ctp_expect_name(P));
        }
    }
    if (ctp_is_op(P, "=")) {
        ctp_adv(P);
        n->b = ctp_parse_tuple_expr(P);
        ctp_expect_end(P, T_BLOCK_END);
        return n;
    }
    if (n->a || n->n_names != 1) ctp_unexpected(P, "'='");
    n->kind = S_SETBLOCK;
    ct_node *filter = NULL;
    while (ctp_is_op(P, "|")) {
        ctp_adv(P);
        filter = ctp_parse_filter(P, filter);
    }
    n->a = filter;
    ctp_expect_end(P, T_BLOCK_END);
    parse_block_until(P, ends, &n->body, "set", pos, NULL);
    ctp_expect_end(P, T_BLOCK_END);
    return n;
}

static ct_node *parse_macro(ct_parser *P, size_t pos) {
    static const char *const ends[] = { "endmacro", NULL };
    ct_node *n = ctp_mk(P, S_MACRO, pos);
    n->name = ctp_expect_name(P);
    ctp_expect_op(P, "(");
    while (!ctp_is_op(P, ")")) {
        if (n->n_names) ctp_expect_op(P, ",");
        if (ctp_is_op(P, ")")) break;
        ctp_add_name(P, n, ctp_expect_name(P));
        ct_node *dflt = NULL;
        if (ctp_is_op(P, "=")) {
            ctp_adv(P);
            dflt = ctp_parse_expr(P);
        }
        ctp_add(P, &n->alt, dflt);
    }
    ctp_adv(P);
    ctp_expect_end(P, T_BLOCK_END);
    int saved = P->loops;
    P->loops = 0;
    parse_block_until(P, ends, &n->body, "macro", pos, NULL);
    P->loops = saved;
    if (ctp_cur(P)->type == T_NAME) ctp_adv(P); /* {% endmacro name %} */
    ctp_expect_end(P, T_BLOCK_END);
    return n;
}

static ct_node *parse_statement(ct_parser *P) {
    const ct_token *t = ctp_cur(P);
    size_t pos = P->t[P->i - 1].pos; /* the '{%' */
    ct_str tag = t->s;
    ctp_adv(P);
    ctp_enter(P);
    ct_node *n = NULL;
    if (ctp_str_is(tag, "if")) {
        n = parse_if(P, pos, "if");
    } else if (ctp_str_is(tag, "for")) {
        n = parse_for(P, pos);
    } else if (ctp_str_is(tag, "set")) {
        n = parse_set(P, pos);
    } else if (ctp_str_is(tag, "macro")) {
        n = parse_macro(P, pos);
    } else if (ctp_str_is(tag, "break") || ctp_str_is(tag, "continue")) {
        if (!P->loops) ct_fail(P->e, t->pos, "'%.*s' outside of a loop", (int)tag.n, tag.p);
        n = ctp_mk(P, tag.p[0] == 'b' ? S_BREAK : S_CONTINUE, pos);
        ctp_expect_end(P, T_BLOCK_END);
    } else if (ctp_str_is(tag, "filter")) {
        static const char *const ends[] = { "endfilter", NULL };
        n = ctp_mk(P, S_FILTERBLOCK, pos);
        n->a = ctp_parse_filter(P, NULL);
        while (ctp_is_op(P, "|")) {
            ctp_adv(P);
            n->a = ctp_parse_filter(P, n->a);
        }
        ctp_expect_end(P, T_BLOCK_END);
        parse_block_until(P, ends, &n->body, "filter", pos, NULL);
        ctp_expect_end(P, T_BLOCK_END);
    } else if (ctp_str_is(tag, "generation")) { /* transformers' AssistantTracker: renders its body */
        static const char *const ends[] = { "endgeneration", NULL };
        n = ctp_mk(P, S_BODY, pos);
        ctp_expect_end(P, T_BLOCK_END);
        parse_block_until(P, ends, &n->body, "generation", pos, NULL);
        ctp_expect_end(P, T_BLOCK_END);
    } else {
        ct_fail(P->e, t->pos, "unknown tag '%.*s'", (int)(tag.n > 40 ? 40 : tag.n), tag.p);
    }
    P->depth--;
    return n;
}

/* Parses statements until a {% <one of ends> %} (returns its index, the current
 * token being its name) or the end of the template (-1). */
static int parse_body(ct_parser *P, const char *const *ends, ct_nodes *out) {
    for (;;) {
        const ct_token *t = ctp_cur(P);
        switch (t->type) {
        case T_EOF: return -1;
        case T_TEXT: {
            ct_node *n = ctp_mk(P, S_TEXT, t->pos);
            n->name = t->s;
            ctp_add(P, out, n);
            ctp_adv(P);
            break;
        }
        case T_VAR_BEGIN: {
            ct_node *n = ctp_mk(P, S_OUTPUT, t->pos);
            ctp_adv(P);
            n->a = ctp_parse_tuple_expr(P);
            ctp_expect_end(P, T_VAR_END);
            ctp_add(P, out, n);
            break;
        }
        case T_BLOCK_BEGIN: {
            ctp_adv(P);
            if (ctp_cur(P)->type != T_NAME) ctp_unexpected(P, "a tag name");
            for (int k = 0; ends && ends[k]; k++)
                if (ctp_str_is(ctp_cur(P)->s, ends[k])) return k;
            ctp_add(P, out, parse_statement(P));
            break;
        }
        default: ctp_unexpected(P, "text or a tag");
        }
    }
}

ct_node *ct_parse(ct_err *e, const ct_token *toks, size_t n_toks) {
    ct_parser P = { .e = e, .t = toks, .n = n_toks };
    ct_node *root = ctp_mk(&P, S_BODY, 0);
    if (parse_body(&P, NULL, &root->body) >= 0) ctp_unexpected(&P, "end of template");
    return root;
}
