/* Chat templates: the public API (template.h) over the Jinja-subset engine
 * (lex.c, parse.c, parse_stmt.c, eval.c, value.c, builtins.c, filters.c).
 *
 * Rendering follows transformers' apply_chat_template: jinja2 with
 * trim_blocks=True and lstrip_blocks=True, loop controls, transformers' tojson
 * (json.dumps, ensure_ascii=False), raise_exception() and strftime_now(). The
 * context holds messages (a list of {role, content} dicts, with name,
 * tool_calls and tool_call_id where a message has them), add_generation_prompt,
 * bos_token / eos_token (undefined when NULL), tools (the request's, as
 * values, or None) and documents = None as transformers passes them; any other name is jinja2's default Undefined.
 * strftime_now() renders a fixed date (26 July 2024) so output is reproducible.
 *
 * Limits against hostile templates: source size, arena memory, output size
 * (16 MiB), nesting depth, macro recursion and total evaluation steps. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "template/template_internal.h"
#include "template/template.h"

struct kvs_chat_template {
    ct_arena arena; /* AST, tokens, normalized source */
    const ct_node *root;
    const char *src;
    size_t src_len;
};

/* ---- arena and errors -------------------------------------------------------- */
struct ct_chunk {
    ct_chunk *next;
    size_t used, cap;
    _Alignas(16) char data[];
};

void *ct_arena_alloc(ct_arena *a, size_t n) {
    n = (n + 15) & ~(size_t)15;
    if (n == 0) n = 16;
    if (n > a->limit || a->total > a->limit - n) return NULL;
    ct_chunk *h = a->head;
    if (!h || h->cap - h->used < n) {
        size_t cap = n > 60000 ? n : 64 * 1024 - sizeof(ct_chunk);
        h = malloc(sizeof(ct_chunk) + cap);
        if (!h) return NULL;
        h->cap = cap;
        h->used = 0;
        if (a->head && cap == n && a->head->cap - a->head->used > 1024) { /* keep the roomier chunk on top */
            h->next = a->head->next;
            a->head->next = h;
        } else {
            h->next = a->head;
            a->head = h;
        }
    }
    void *p = h->data + h->used;
    h->used += n;
    a->total += n;
    return p;
}

void ct_arena_free(ct_arena *a) {
    for (ct_chunk *h = a->head, *next; h; h = next) {
        next = h->next;
        free(h);
    }
    a->head = NULL;
    a->total = 0;
}

_Noreturn void ct_fail(ct_err *e, size_t pos, const char *fmt, ...) {
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (e->src && pos != CT_NOPOS) {
        int line = 1, col = 1;
        for (size_t i = 0; i < pos && i < e->src_len; i++) {
            if (e->src[i] == '\n') { line++; col = 1; }
            else if (((unsigned char)e->src[i] & 0xC0) != 0x80) col++;
        }
        snprintf(e->msg, sizeof e->msg, "chat template: line %d, column %d: %s", line, col, msg);
    } else {
        snprintf(e->msg, sizeof e->msg, "chat template: %s", msg);
    }
    longjmp(e->jb, 1);
}

void *ct_alloc(ct_err *e, size_t n) {
    void *p = ct_arena_alloc(e->arena, n);
    if (!p) {
        e->nomem = e->arena->total + n <= e->arena->limit;
        ct_fail(e, CT_NOPOS, e->nomem ? "out of memory" : "template exceeded its memory limit (%zu MiB)",
                e->arena->limit >> 20);
    }
    return p;
}

char *ct_strdup(ct_err *e, const char *s, size_t n) {
    char *p = ct_alloc(e, n + 1);
    if (n) memcpy(p, s, n);
    p[n] = 0;
    return p;
}

/* ---- API ---------------------------------------------------------------------- */
/* setjmp lives in these small functions; state that must survive a longjmp
 * belongs to the caller. */
static bool guarded_compile(ct_err *e, const char *source, size_t len, kvs_chat_template *t) {
    if (setjmp(e->jb)) return false;
    ct_token *toks;
    size_t n_toks;
    ct_lex(e, source, len, &toks, &n_toks);
    t->root = ct_parse(e, toks, n_toks);
    t->src = e->src;
    t->src_len = e->src_len;
    return true;
}

kvs_status kvs_chat_template_compile(const char *source, size_t len, kvs_chat_template **out) {
    if (!out) return kvs_fail(KVS_ERR_INVALID, "chat template: out is NULL");
    *out = NULL;
    if (!source && len) return kvs_fail(KVS_ERR_INVALID, "chat template: source is NULL");
    if (len > CT_MAX_SOURCE)
        return kvs_fail(KVS_ERR_FORMAT, "chat template: too large (%zu bytes, limit %u)", len, CT_MAX_SOURCE);
    kvs_chat_template *t = calloc(1, sizeof *t);
    if (!t) return kvs_fail(KVS_ERR_NOMEM, "chat template: out of memory");
    t->arena.limit = CT_COMPILE_MEM;
    ct_err e;
    memset(&e, 0, sizeof e);
    e.arena = &t->arena;
    if (!guarded_compile(&e, source ? source : "", len, t)) {
        ct_arena_free(&t->arena);
        free(t);
        return kvs_fail(e.nomem ? KVS_ERR_NOMEM : KVS_ERR_FORMAT, "%s", e.msg);
    }
    *out = t;
    return KVS_OK;
}

typedef struct {
    const kvs_chat_message *msgs;
    int n_msgs;
    const char *tools;
    bool add_generation_prompt;
    const char *bos, *eos;
    char *text;
    size_t len;
} render_job;

static bool guarded_render(ct_err *e, const kvs_chat_template *tpl, render_job *job) {
    if (setjmp(e->jb)) return false;
    ct_message *m = ct_alloc(e, (size_t)(job->n_msgs > 0 ? job->n_msgs : 1) * sizeof *m);
    for (int i = 0; i < job->n_msgs; i++) {
        m[i].role = job->msgs[i].role;
        m[i].content = job->msgs[i].content;
        m[i].tool_calls = job->msgs[i].tool_calls;
        m[i].tool_call_id = job->msgs[i].tool_call_id;
        m[i].name = job->msgs[i].name;
    }
    job->text = ct_render(e, tpl->root, m, job->n_msgs, job->tools, job->add_generation_prompt, job->bos, job->eos, &job->len);
    return true;
}

kvs_status kvs_chat_template_render(const kvs_chat_template *tpl, const kvs_chat_message *msgs, int n_msgs,
                                    bool add_generation_prompt, const char *bos_token, const char *eos_token,
                                    char **text) {
    return kvs_chat_template_render_tools(tpl, msgs, n_msgs, NULL, add_generation_prompt, bos_token, eos_token, text);
}

kvs_status kvs_chat_template_render_tools(const kvs_chat_template *tpl, const kvs_chat_message *msgs, int n_msgs,
                                          const char *tools, bool add_generation_prompt, const char *bos_token,
                                          const char *eos_token, char **text) {
    if (!text) return kvs_fail(KVS_ERR_INVALID, "chat template: text is NULL");
    *text = NULL;
    if (!tpl) return kvs_fail(KVS_ERR_INVALID, "chat template: template is NULL");
    if (n_msgs < 0 || (n_msgs > 0 && !msgs)) return kvs_fail(KVS_ERR_INVALID, "chat template: bad messages");
    ct_arena arena = { .limit = CT_RENDER_MEM };
    ct_err e;
    memset(&e, 0, sizeof e);
    e.arena = &arena;
    e.src = tpl->src;
    e.src_len = tpl->src_len;
    render_job job = { msgs, n_msgs, tools, add_generation_prompt, bos_token, eos_token, NULL, 0 };
    if (!guarded_render(&e, tpl, &job)) {
        ct_arena_free(&arena);
        return kvs_fail(e.nomem ? KVS_ERR_NOMEM : KVS_ERR_INVALID, "%s", e.msg);
    }
    char *res = malloc(job.len + 1);
    if (res) {
        memcpy(res, job.text, job.len);
        res[job.len] = 0;
    }
    ct_arena_free(&arena);
    if (!res) return kvs_fail(KVS_ERR_NOMEM, "chat template: out of memory");
    *text = res;
    return KVS_OK;
}

void kvs_chat_template_destroy(kvs_chat_template *tpl) {
    if (!tpl) return;
    ct_arena_free(&tpl->arena);
    free(tpl);
}

/* The fallback for models whose tokenizer_config.json has no chat_template:
 * ChatML, as transformers' former default template:
 *   <|im_start|>{role}\n{content}<|im_end|>\n  per message, then
 *   <|im_start|>assistant\n                    when add_generation_prompt. */
const char *kvs_chat_template_default(void) {
    return "{% for message in messages %}"
           "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
           "{% endfor %}"
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
}
