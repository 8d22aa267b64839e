/* grammar matcher: a sequence's state is a set of stacks of nodes (gr_state);
 * a byte moves every stack's top node, then the closure follows calls (push the
 * callee's start, the top becoming the return node) and final nodes (pop), so
 * every stack of a state ends on a node that reads a byte, or is the empty,
 * accepted stack. */
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar_internal.h"

#define CLOSURE_BUDGET 4096 /* stacks one byte may visit (left recursion is cut off there) */
#define MAX_STACKS 512      /* stacks in one state */

static bool reserve(gr_state *s, int n) {
    if (s->len + n <= s->cap) return true;
    int cap = (s->len + n) * 2 + 16;
    int32_t *nv = realloc(s->v, (size_t)cap * sizeof *nv);
    if (!nv) return false;
    s->v = nv;
    s->cap = cap;
    return true;
}

static void clear(gr_state *s) {
    s->len = s->n_stacks = 0;
    s->cut = false;
}
void gr_state_free(gr_state *s) {
    free(s->v);
    memset(s, 0, sizeof *s);
}

static bool contains(const gr_state *s, const int32_t *stack, int depth) {
    for (int i = 0; i < s->len; i += 1 + s->v[i])
        if (s->v[i] == depth && !memcmp(s->v + i + 1, stack, (size_t)depth * sizeof *stack)) return true;
    return false;
}

/* adds the stack unless present; false when out of memory */
static bool add(gr_state *s, const int32_t *stack, int depth) {
    if (contains(s, stack, depth)) return true;
    if (s->n_stacks >= MAX_STACKS) {
        s->cut = true;
        return true;
    }
    if (!reserve(s, depth + 1)) return false;
    s->v[s->len] = depth;
    memcpy(s->v + s->len + 1, stack, (size_t)depth * sizeof *stack);
    s->len += depth + 1;
    s->n_stacks++;
    return true;
}

bool gr_state_accepted(const gr_state *s) {
    for (int i = 0; i < s->len; i += 1 + s->v[i])
        if (s->v[i] == 0) return true;
    return false;
}

uint64_t gr_state_hash(const gr_state *s) {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < s->len; i++) h = (h ^ (uint32_t)s->v[i]) * 1099511628211ull;
    return h;
}

typedef struct {
    const kvs_grammar *g;
    gr_state *out;
    gr_walk *w;
    int budget, limit; /* expansions left for this input stack; the deepest stack kept */
    bool ok;
} closure_run;

/* cost more units of w's work; false once past its bound */
static bool step(gr_walk *w, uint64_t cost) {
    w->work += cost;
    if (w->work <= w->max_work || !w->max_work) return true;
    w->over = true;
    return false;
}

/* stack[0..depth) with stack[depth - 1] just reached; stack has room for MAX_DEPTH + 1 */
static void closure(closure_run *c, int32_t *stack, int depth) {
    if (!c->ok) return;
    /* a visit scans the stacks kept and seen so far (contains): count those */
    if (!step(c->w, 1 + (uint64_t)c->out->n_stacks + (uint64_t)c->w->seen.n_stacks)) {
        c->ok = false;
        return;
    }
    if (--c->budget < 0) {
        c->out->cut = true;
        return;
    }
    if (depth == 0) {
        c->ok = add(c->out, stack, 0);
        return;
    }
    const gr_node *n = &c->g->nodes[stack[depth - 1]];
    if (n->n_calls || n->final) { /* branches: visit each stack once */
        if (contains(&c->w->seen, stack, depth)) return;
        if (!(c->ok = add(&c->w->seen, stack, depth))) return;
    }
    if (n->has_bytes && !(c->ok = add(c->out, stack, depth))) return;
    int32_t top = stack[depth - 1];
    if (n->n_calls && depth >= c->limit) c->out->cut = true;
    for (int k = 0; k < n->n_calls && depth < c->limit; k++) {
        const gr_call *call = &c->g->calls[n->first_call + k];
        stack[depth - 1] = call->ret;
        stack[depth] = call->callee;
        closure(c, stack, depth + 1);
        stack[depth - 1] = top;
    }
    if (n->final) closure(c, stack, depth - 1);
}

/* one stack whose top moves to a node that neither calls nor returns (inside a
   string, a number, a literal): what the closure would give, without it */
static bool advance_plain(const kvs_grammar *g, const gr_state *in, uint8_t b, gr_state *out) {
    int depth = in->v[0];
    int32_t next = g->nodes[in->v[depth]].next[b];
    const gr_node *n = next >= 0 ? &g->nodes[next] : NULL;
    if (n && (n->n_calls || n->final)) return false;
    clear(out);
    if (!n || !n->has_bytes) return true;
    if (!reserve(out, depth + 1)) return false;
    memcpy(out->v, in->v, (size_t)depth * sizeof *out->v);
    out->v[depth] = next;
    out->len = depth + 1;
    out->n_stacks = 1;
    return true;
}

bool gr_advance_limited(const kvs_grammar *g, const gr_state *in, uint8_t b, gr_state *out, gr_walk *w, int limit) {
    if (!step(w, 1)) return false;
    if (in->n_stacks == 1 && in->v[0] > 0 && advance_plain(g, in, b, out)) return true;
    int32_t stack[KVS_GRAMMAR_MAX_DEPTH + 1];
    closure_run c = {g, out, w, CLOSURE_BUDGET, limit, true};
    clear(out);
    clear(&w->seen);
    for (int i = 0; i < in->len && c.ok; i += 1 + in->v[i]) {
        int depth = in->v[i];
        if (depth == 0) continue;
        int32_t next = g->nodes[in->v[i + depth]].next[b];
        if (next < 0) continue;
        memcpy(stack, in->v + i + 1, (size_t)(depth - 1) * sizeof *stack);
        stack[depth - 1] = next;
        c.budget = CLOSURE_BUDGET; /* per input stack: its closure is the same whatever lies below it */
        closure(&c, stack, depth);
    }
    return c.ok;
}

bool gr_advance(const kvs_grammar *g, const gr_state *in, uint8_t b, gr_state *out, gr_walk *w) {
    return gr_advance_limited(g, in, b, out, w, KVS_GRAMMAR_MAX_DEPTH);
}

bool gr_state_single(gr_state *out, int32_t node) {
    clear(out);
    return add(out, &node, 1);
}

bool gr_initial(const kvs_grammar *g, gr_state *out, gr_walk *w) {
    int32_t stack[KVS_GRAMMAR_MAX_DEPTH + 1] = {g->root};
    closure_run c = {g, out, w, CLOSURE_BUDGET, KVS_GRAMMAR_MAX_DEPTH, true};
    clear(out);
    clear(&w->seen);
    closure(&c, stack, 1);
    return c.ok;
}

/* the stacks sorted, so that equal states are equal arrays (the mask cache's key) */
static int cmp_stack(const void *x, const void *y) {
    const int32_t *a = *(const int32_t *const *)x, *b = *(const int32_t *const *)y;
    if (a[0] != b[0]) return a[0] < b[0] ? -1 : 1;
    for (int i = 1; i <= a[0]; i++)
        if (a[i] != b[i]) return a[i] < b[i] ? -1 : 1;
    return 0;
}

static void swap(gr_state *a, gr_state *b) {
    gr_state t = *a;
    *a = *b;
    *b = t;
}

static bool canonical(gr_state *s, gr_state *tmp) {
    if (s->n_stacks < 2) return true;
    const int32_t **at = malloc((size_t)s->n_stacks * sizeof *at);
    if (!at) return false;
    int k = 0;
    for (int i = 0; i < s->len; i += 1 + s->v[i]) at[k++] = s->v + i;
    qsort(at, (size_t)k, sizeof *at, cmp_stack);
    clear(tmp);
    bool ok = reserve(tmp, s->len);
    for (int i = 0; ok && i < k; i++) {
        memcpy(tmp->v + tmp->len, at[i], (size_t)(at[i][0] + 1) * sizeof *tmp->v);
        tmp->len += at[i][0] + 1;
    }
    free(at);
    if (!ok) return false;
    tmp->n_stacks = s->n_stacks;
    swap(s, tmp);
    return true;
}

bool kvs_grammar_accepts_prefix(const kvs_grammar *g, const char *bytes, size_t n, bool *complete) {
    gr_state a = {0}, b = {0};
    gr_walk w = {0};
    bool ok = gr_initial(g, &a, &w);
    for (size_t i = 0; ok && i < n && a.n_stacks; i++) {
        ok = gr_advance(g, &a, (uint8_t)bytes[i], &b, &w);
        swap(&a, &b);
    }
    ok = ok && a.n_stacks > 0;
    if (complete) *complete = ok && gr_state_accepted(&a);
    gr_state_free(&a), gr_state_free(&b), gr_state_free(&w.seen);
    return ok;
}

/* ---- the matcher -------------------------------------------------------------------------- */
kvs_status kvs_grammar_matcher_create(kvs_grammar *g, const kvs_grammar_vocab *v, kvs_grammar_matcher **out) {
    *out = NULL;
    if (!g || !v) return kvs_fail(KVS_ERR_INVALID, "grammar matcher: NULL grammar or vocabulary");
    kvs_grammar_matcher *m = calloc(1, sizeof *m);
    if (m) m->levels = calloc((size_t)v->max_depth + 1, sizeof *m->levels);
    if (!m || !m->levels || !gr_initial(g, &m->state, &m->walk)) {
        if (m) free(m->levels), gr_state_free(&m->state), gr_state_free(&m->walk.seen);
        free(m);
        return kvs_fail(KVS_ERR_NOMEM, "grammar matcher: out of memory");
    }
    m->g = kvs_grammar_ref(g);
    m->v = v;
    *out = m;
    return KVS_OK;
}

void kvs_grammar_matcher_destroy(kvs_grammar_matcher *m) {
    if (!m) return;
    for (int i = 0; i <= m->v->max_depth; i++) gr_state_free(&m->levels[i]);
    free(m->levels);
    gr_state_free(&m->state), gr_state_free(&m->next), gr_state_free(&m->tmp), gr_state_free(&m->walk.seen);
    kvs_grammar_unref(m->g);
    free(m);
}

bool kvs_grammar_matcher_complete(const kvs_grammar_matcher *m) { return m->ended || gr_state_accepted(&m->state); }
bool kvs_grammar_matcher_ended(const kvs_grammar_matcher *m) { return m->ended; }

static void end_ids_only(const kvs_grammar_vocab *v, uint32_t *bits) {
    memset(bits, 0, (size_t)(v->n_tokens + 31) / 32 * sizeof *bits);
    for (int i = 0; i < v->n_end; i++) bits[v->end_ids[i] / 32] |= 1u << (v->end_ids[i] % 32);
}

/* the walk's bound restarted for one mask */
void gr_walk_start(gr_walk *w, const kvs_grammar *g) {
    w->work = 0;
    w->max_work = g->mask_work;
    w->over = false;
}

kvs_status gr_walk_failed(const gr_walk *w) {
    if (!w->over) return kvs_fail(KVS_ERR_NOMEM, "structured output: out of memory computing a token mask");
    return kvs_fail(KVS_ERR_UNSUPPORTED,
                    "structured output: a token mask of this schema takes more than the bound of %llu matcher steps",
                    (unsigned long long)w->max_work);
}

kvs_status kvs_grammar_matcher_mask(kvs_grammar_matcher *m, uint32_t *bits) {
    if (m->ended) {
        end_ids_only(m->v, bits);
        return KVS_OK;
    }
    if (gr_cache_get(m->g, m->v, &m->state, bits)) return KVS_OK;
    gr_walk_start(&m->walk, m->g);
    if (!gr_mask_compute(m->g, m->v, &m->state, m->levels, &m->walk, bits)) return gr_walk_failed(&m->walk);
    gr_cache_put(m->g, m->v, &m->state, bits);
    return KVS_OK;
}

#define WARM_TOKENS 8 /* masks kvs_grammar_warm computes along a walk from the start */

kvs_status kvs_grammar_warm(kvs_grammar *g, const kvs_grammar_vocab *v) {
    kvs_grammar_matcher *m;
    KVS_TRY(kvs_grammar_matcher_create(g, v, &m));
    kvs_status st = KVS_OK;
    if (m->state.cut)
        st = kvs_fail(KVS_ERR_UNSUPPORTED, "schema: more than %d alternatives (anyOf, oneOf, type lists) are open at "
                      "its start, past the bound of a matcher's state", MAX_STACKS);
    uint32_t *bits = st == KVS_OK ? malloc((size_t)(v->n_tokens + 31) / 32 * sizeof *bits) : NULL;
    if (st == KVS_OK && !bits) st = kvs_fail(KVS_ERR_NOMEM, "grammar: out of memory");
    /* the first masks along one output (each step its first token that is not an end id):
       where a schema's masks cost most, their first states, before the engine meets them */
    for (int k = 0; st == KVS_OK && k < WARM_TOKENS && !m->ended; k++) {
        st = kvs_grammar_matcher_mask(m, bits);
        int pick = -1;
        for (int id = 0; st == KVS_OK && pick < 0 && id < v->n_tokens; id++)
            if ((bits[id / 32] >> (id % 32) & 1) && !v->is_end[id]) pick = id;
        if (pick < 0 || kvs_grammar_matcher_accept(m, pick) != KVS_OK) break;
    }
    free(bits);
    kvs_grammar_matcher_destroy(m);
    return st;
}

kvs_status kvs_grammar_matcher_accept(kvs_grammar_matcher *m, int32_t id) {
    const kvs_grammar_vocab *v = m->v;
    if (id < 0 || id >= v->n_tokens) return kvs_fail(KVS_ERR_INVALID, "grammar: token %d is not in the vocabulary", id);
    if (v->is_end[id]) {
        if (!m->ended && !gr_state_accepted(&m->state))
            return kvs_fail(KVS_ERR_INVALID, "grammar: end token %d before the output is complete", id);
        m->ended = true;
        return KVS_OK;
    }
    if (m->ended) return kvs_fail(KVS_ERR_INVALID, "grammar: token %d after the end of the output", id);
    if (!v->lens[id]) return kvs_fail(KVS_ERR_INVALID, "grammar: token %d has no text the grammar can take", id);
    /* into m->next (and m->tmp), so that a rejected token leaves m->state as it was */
    m->walk.max_work = 0; /* a token's bytes: bounded by the mask that allowed it */
    bool ok = gr_advance(m->g, &m->state, (uint8_t)v->bytes[id][0], &m->next, &m->walk);
    for (size_t i = 1; ok && i < v->lens[id] && m->next.n_stacks; i++) {
        ok = gr_advance(m->g, &m->next, (uint8_t)v->bytes[id][i], &m->tmp, &m->walk);
        swap(&m->next, &m->tmp);
    }
    if (ok && m->next.n_stacks) ok = canonical(&m->next, &m->tmp);
    if (!ok) return kvs_fail(KVS_ERR_NOMEM, "grammar: out of memory advancing by token %d", id);
    if (!m->next.n_stacks)
        return kvs_fail(KVS_ERR_INVALID, "grammar: token %d ('%.*s') is not allowed here", id,
                        (int)(v->lens[id] < 32 ? v->lens[id] : 32), v->bytes[id]);
    swap(&m->state, &m->next);
    return KVS_OK;
}
