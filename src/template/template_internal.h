/* Internal interfaces of the chat-template engine (a Jinja subset):
 *   lex.c                  source -> tokens (whitespace control, trim/lstrip_blocks)
 *   parse.c, parse_stmt.c  tokens -> AST
 *   eval.c, value.c, builtins.c, filters.c
 *                          values, filters, tests, methods, rendering
 *   template.c             public API (template.h) and the default template
 * Memory: every allocation goes to an arena (one per compiled template, one per
 * render), bounded by a byte limit; errors longjmp back to the API entry point,
 * so nothing leaks and nothing on the error path needs cleanup. */
#ifndef KVS_TEMPLATE_INTERNAL_H
#define KVS_TEMPLATE_INTERNAL_H

#include <setjmp.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/core.h"

/* ---- limits (a hostile template must not exhaust the process) -------------- */
#define CT_MAX_SOURCE (4u << 20)          /* template source bytes */
#define CT_COMPILE_MEM (64u << 20)        /* compile arena bytes */
#define CT_RENDER_MEM (128u << 20)        /* render arena bytes */
#define CT_MAX_OUTPUT (16u << 20)         /* rendered text bytes */
#define CT_MAX_DEPTH 96                   /* parser nesting (expressions + blocks) */
#define CT_MAX_CALL_DEPTH 40              /* macro recursion */
#define CT_MAX_STEPS 20000000ull          /* evaluation steps per render */
#define CT_MAX_RANGE 1000000              /* items in one range() */

#define CT_NOPOS ((size_t)-1)             /* an error without a source position */

/* ---- arena ------------------------------------------------------------------ */
typedef struct ct_chunk ct_chunk;
typedef struct {
    ct_chunk *head;
    size_t total, limit;
} ct_arena;
void *ct_arena_alloc(ct_arena *a, size_t n); /* NULL when over the limit / no memory */
void ct_arena_free(ct_arena *a);

/* ---- errors: a message with line and column, then longjmp ------------------- */
typedef struct {
    jmp_buf jb;
    char msg[512];
    const char *src; /* normalized source, for line/column */
    size_t src_len;
    ct_arena *arena;
    bool nomem; /* malloc itself failed */
} ct_err;
_Noreturn void ct_fail(ct_err *e, size_t pos, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void *ct_alloc(ct_err *e, size_t n); /* arena alloc; fails with a message at the limit */
char *ct_strdup(ct_err *e, const char *s, size_t n); /* NUL-terminated copy */

typedef struct {
    const char *p;
    size_t n;
} ct_str;

/* ---- lexer -------------------------------------------------------------------- */
typedef enum {
    T_TEXT, T_VAR_BEGIN, T_VAR_END, T_BLOCK_BEGIN, T_BLOCK_END,
    T_NAME, T_STRING, T_INT, T_FLOAT, T_OP, T_EOF
} ct_tok_type;

typedef struct {
    ct_tok_type type;
    ct_str s;     /* text, name, decoded string, operator */
    int64_t ival;
    double fval;
    size_t pos;   /* byte offset in the normalized source */
} ct_token;

/* Normalizes newlines (\r\n, \r -> \n), drops one trailing newline (jinja2's
 * keep_trailing_newline=False) and tokenizes with trim_blocks and lstrip_blocks. */
void ct_lex(ct_err *e, const char *src, size_t len, ct_token **toks, size_t *n_toks);
/* The normalized source (ct_lex stores it in e->src). */

/* ---- AST ---------------------------------------------------------------------- */
typedef enum {
    /* expressions */
    N_STR, N_INT, N_FLOAT, N_BOOL, N_NONE, N_LIST, N_TUPLE, N_DICT, N_NAME,
    N_GETATTR, N_GETITEM, N_SLICE, N_CALL, N_FILTER, N_TEST, N_BINOP, N_NEG, N_POS,
    N_AND, N_OR, N_NOT, N_CMP, N_COND,
    /* statements */
    S_TEXT, S_OUTPUT, S_IF, S_FOR, S_SET, S_SETBLOCK, S_MACRO, S_BREAK, S_CONTINUE,
    S_FILTERBLOCK, S_BODY
} ct_kind;

/* operators (N_BINOP, N_CMP) */
enum { OP_ADD, OP_SUB, OP_MUL, OP_DIV, OP_FDIV, OP_MOD, OP_POW, OP_CAT,
       OP_EQ, OP_NE, OP_LT, OP_LE, OP_GT, OP_GE, OP_IN, OP_NOTIN };

typedef struct ct_node ct_node;
typedef struct {
    ct_node **v;
    int n;
} ct_nodes;

struct ct_node {
    ct_kind kind;
    int op;       /* operator; for N_TEST: negated; for S_FOR: recursive */
    size_t pos;
    ct_node *a, *b, *c;
    ct_nodes body; /* items / positional args / statement body / dict keys */
    ct_nodes alt;  /* kwarg values / else body / dict values / macro defaults */
    ct_str name;   /* identifier, attribute, filter/test name, string literal, text */
    ct_str *names; /* kwarg names / macro params / for or set targets */
    int n_names;
    int64_t ival;
    double fval;
};

ct_node *ct_parse(ct_err *e, const ct_token *toks, size_t n_toks);

/* parser internals shared by parse.c (expressions) and
 * parse_stmt.c (statements) */
typedef struct {
    ct_err *e;
    const ct_token *t;
    size_t n, i;
    int depth, loops; /* nesting; enclosing for loops (for break/continue) */
} ct_parser;
const ct_token *ctp_cur(ct_parser *P);
void ctp_adv(ct_parser *P);
bool ctp_str_is(ct_str s, const char *lit);
bool ctp_is_op(ct_parser *P, const char *op);
bool ctp_is_kw(ct_parser *P, const char *kw);
void ctp_enter(ct_parser *P); /* depth++, fails past CT_MAX_DEPTH */
_Noreturn void ctp_unexpected(ct_parser *P, const char *what);
void ctp_expect_op(ct_parser *P, const char *op);
ct_str ctp_expect_name(ct_parser *P);
void ctp_expect_end(ct_parser *P, ct_tok_type end);
ct_node *ctp_mk(ct_parser *P, ct_kind k, size_t pos);
void ctp_add(ct_parser *P, ct_nodes *l, ct_node *x);
void ctp_add_name(ct_parser *P, ct_node *n, ct_str s);
ct_node *ctp_parse_expr(ct_parser *P);       /* with ternary */
ct_node *ctp_parse_or(ct_parser *P);         /* without ternary */
ct_node *ctp_parse_tuple_expr(ct_parser *P); /* a, b -> tuple */
ct_node *ctp_parse_filter(ct_parser *P, ct_node *input); /* after '|' */

/* ---- values (value.c) ----------------------------------------- */
typedef enum { V_UNDEF, V_NONE, V_BOOL, V_INT, V_FLOAT, V_STR, V_LIST, V_DICT, V_MACRO, V_FUNC,
               V_METHOD, V_LOOP } ct_vtype;
typedef struct ct_value ct_value;
typedef struct { ct_value *v; size_t n; } ct_list;
typedef struct { ct_value *k, *v; size_t n, cap; bool ns; } ct_dict; /* ns: namespace() */
typedef struct ct_method ct_method;
typedef struct ct_loop ct_loop;
enum { FN_RANGE, FN_NAMESPACE, FN_RAISE, FN_STRFTIME, FN_DICT, FN_LOOP_CYCLE };
struct ct_value {
    uint8_t t;
    bool tuple; /* V_LIST shown as (a, b) */
    union {
        bool b;
        int64_t i;
        double f;
        ct_str s;        /* V_STR; V_UNDEF: the name, for messages */
        ct_list *l;
        ct_dict *d;
        const ct_node *macro;
        int fn;          /* V_FUNC */
        ct_method *m;
        ct_loop *loop;
    };
};
struct ct_method { ct_value self; ct_str name; };
struct ct_loop { ct_list *items; size_t idx; };

typedef struct { char *p; size_t n, cap; } ct_buf;
typedef struct ct_frame ct_frame;
typedef struct {
    ct_err *e;
    ct_frame *globals;
    ct_buf *out;
    uint64_t steps;
    int depth, calls;
} ct_ctx;

/* call arguments: positional then keyword */
typedef struct {
    ct_value *v; int n;
    ct_str *kwn; ct_value *kwv; int nkw;
    size_t pos;
} ct_args;

ct_value ct_none(void);
ct_value ct_undef(ct_str name);
ct_value ct_bool(bool b);
ct_value ct_int(int64_t i);
ct_value ct_float(double f);
ct_value ct_strv(ct_ctx *c, const char *p, size_t n); /* copies */
ct_value ct_strref(ct_str s);                         /* no copy */
ct_value ct_listv(ct_list *l);
ct_list *ct_list_new(ct_ctx *c, size_t n);
ct_dict *ct_dict_new(ct_ctx *c);
void ct_dict_set(ct_ctx *c, ct_dict *d, ct_value k, ct_value v);
ct_value *ct_dict_get(const ct_dict *d, ct_value k);
ct_value *ct_dict_gets(const ct_dict *d, const char *k, size_t n);
void ct_buf_put(ct_ctx *c, ct_buf *b, const char *p, size_t n);
static inline void ct_buf_puts(ct_ctx *c, ct_buf *b, const char *s) { ct_buf_put(c, b, s, __builtin_strlen(s)); }
ct_value ct_buf_value(ct_buf *b);
bool ct_truthy(ct_value v);
bool ct_equal(ct_value a, ct_value b);
int ct_compare(ct_ctx *c, ct_value a, ct_value b, size_t pos); /* fails when not orderable */
const char *ct_type_name(ct_value v);
bool ct_is_num(ct_value v); /* bool, int, float */
double ct_num(ct_value v);
void ct_write_str(ct_ctx *c, ct_buf *b, ct_value v);  /* Python str() */
void ct_write_repr(ct_ctx *c, ct_buf *b, ct_value v); /* Python repr() */
ct_str ct_to_str(ct_ctx *c, ct_value v);
void ct_fmt_float(double f, char out[40]);            /* Python repr(float) */
typedef struct { const char *indent; size_t indent_n; bool ascii, sort; ct_str item_sep, key_sep; } ct_json_opts;
void ct_write_json(ct_ctx *c, ct_buf *b, ct_value v, const ct_json_opts *o, int level, size_t pos);
size_t ct_utf8_len(const char *p, size_t n);          /* code points */
size_t ct_utf8_offset(const char *p, size_t n, size_t idx); /* byte offset of code point idx */
ct_list *ct_iterate(ct_ctx *c, ct_value v, size_t pos); /* list items, dict keys, str chars */
void ct_step(ct_ctx *c, size_t pos);                  /* counts work; fails past the limit */

/* ---- builtins (builtins.c) -------------------------------------- */
bool ct_filter_known(const char *name, size_t n);
bool ct_test_known(const char *name, size_t n);
ct_value ct_filter(ct_ctx *c, ct_str name, ct_value in, ct_args *a);
bool ct_test(ct_ctx *c, ct_str name, ct_value in, ct_args *a);
ct_value ct_getattr(ct_ctx *c, ct_value obj, ct_str name, size_t pos);
ct_value ct_getitem(ct_ctx *c, ct_value obj, ct_value key, size_t pos);
ct_value ct_call_method(ct_ctx *c, ct_method *m, ct_args *a);
ct_value ct_call_func(ct_ctx *c, int fn, ct_value self, ct_args *a);
/* string helpers shared by methods and filters */
enum { CASE_LOWER, CASE_UPPER, CASE_TITLE, CASE_CAPITALIZE, CASE_JINJA_TITLE };
ct_value ct_str_case(ct_ctx *c, ct_str s, int mode);
ct_value ct_str_strip(ct_ctx *c, ct_str s, ct_value chars, bool left, bool right, size_t pos);
ct_value ct_str_replace(ct_ctx *c, ct_str s, ct_str old, ct_str rep, int64_t count);
/* positional i, else keyword name, else dflt */
ct_value ct_arg(ct_args *a, int i, const char *name, ct_value dflt);

/* ---- evaluation (eval.c) ---------------------------------------- */
typedef struct {
    const char *role, *content;
    const char *tool_calls;              /* JSON text, or NULL */
    const char *tool_call_id, *name;     /* NULL: no such key */
} ct_message;

/* Renders root into a NUL-terminated string allocated in e->arena; tools:
 * JSON text (NULL: tools = None). */
char *ct_render(ct_err *e, const ct_node *root, const ct_message *msgs, int n_msgs, const char *tools,
                bool add_generation_prompt, const char *bos, const char *eos, size_t *out_len);

/* ---- JSON text -> values (json_value.c); what: the name its error gives --- */
ct_value ct_json_value(ct_ctx *c, const char *text, const char *what);

#endif
