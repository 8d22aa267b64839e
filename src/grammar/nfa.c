/* grammar rules: NFAs built by schema.c (byte ranges, epsilons, rule calls),
 * determinized rule by rule (subset construction) into the grammar's nodes. A
 * node has one successor per byte; the automaton stays nondeterministic only
 * through calls (a node may call several rules, and be final too), which the
 * matcher follows as a set of stacks. Every edge, node and set is counted
 * against the compile's budget (gr_budget), so a schema past a bound stops
 * the compile where it passes it. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar_internal.h"

/* room for need items of size bytes in *(void **)items, whose capacity is *cap */
static bool reserve(void *items, int *cap, int need, size_t size) {
    if (need <= *cap) return true;
    int c = need * 2 + 32;
    void *p = realloc(*(void **)items, (size_t)c * size);
    if (!p) return false;
    *(void **)items = p;
    *cap = c;
    return true;
}

/* ---- the budget ----------------------------------------------------------------------- */
void gr_budget_init(gr_budget *b, const kvs_grammar_limits *lim) {
    memset(b, 0, sizeof *b);
    if (lim) b->lim = *lim;
    b->t_end = b->lim.max_seconds > 0 ? kvs_now() + b->lim.max_seconds : 0;
}

/* records the first bound passed; false */
static bool budget_fail(gr_budget *b, kvs_status code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bool budget_fail(gr_budget *b, kvs_status code, const char *fmt, ...) {
    if (b->code != KVS_OK) return false;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b->why, sizeof b->why, fmt, ap);
    va_end(ap);
    b->code = code;
    return false;
}

kvs_status gr_budget_status(const gr_budget *b) { return kvs_fail(b->code, "%s", b->why); }

bool gr_budget_ok(gr_budget *b) {
    if (!b) return true;
    if (b->code != KVS_OK) return false;
    if (++b->checks % 512) return true;
    if (b->lim.cancel && atomic_load(b->lim.cancel)) return budget_fail(b, KVS_ERR_BUSY, "schema: compile cancelled");
    if (b->t_end > 0 && kvs_now() > b->t_end)
        return budget_fail(b, KVS_ERR_UNSUPPORTED, "schema: compiling it takes longer than the bound of %.0f ms",
                           b->lim.max_seconds * 1e3);
    return true;
}

bool gr_budget_bytes(gr_budget *b, ptrdiff_t n) {
    if (!b) return true;
    b->bytes += (size_t)n;
    if (n > 0 && b->lim.max_bytes && b->bytes > b->lim.max_bytes)
        return budget_fail(b, KVS_ERR_UNSUPPORTED, "schema: its automaton needs more than the bound of %zu MiB",
                           b->lim.max_bytes >> 20);
    return gr_budget_ok(b);
}

/* n transitions more: edges of the rules built, then the moves the determinization follows */
static bool budget_transitions(gr_budget *b, size_t n) {
    if (!b) return true;
    b->transitions += n;
    if (b->lim.max_transitions && b->transitions > (size_t)b->lim.max_transitions)
        return budget_fail(b, KVS_ERR_UNSUPPORTED, "schema: its automaton needs more than the bound of %d transitions",
                           b->lim.max_transitions);
    return gr_budget_ok(b);
}

static bool budget_edge(gr_budget *b) { return budget_transitions(b, 1) && gr_budget_bytes(b, sizeof(gr_edge)); }

static bool budget_node(gr_budget *b, int n_nodes) {
    if (!b) return true;
    if (b->lim.max_states && n_nodes > b->lim.max_states)
        return budget_fail(b, KVS_ERR_UNSUPPORTED, "schema: its automaton needs more than the bound of %d states",
                           b->lim.max_states);
    return gr_budget_bytes(b, sizeof(gr_node));
}

/* ---- rules under construction --------------------------------------------------------- */
static bool add_edge(gr_nfa *a, gr_edge e) {
    if (!budget_edge(a->budget) || !reserve(&a->edges, &a->cap_edges, a->n_edges + 1, sizeof e)) return false;
    a->edges[a->n_edges++] = e;
    return true;
}

int gr_nfa_state(gr_nfa *a) { return a->n_states < (1 << 24) && gr_budget_ok(a->budget) ? a->n_states++ : -1; }
bool gr_nfa_eps(gr_nfa *a, int from, int to) { return add_edge(a, (gr_edge){from, to, GR_EPS, 0, 0, -1}); }
bool gr_nfa_bytes(gr_nfa *a, int from, uint8_t lo, uint8_t hi, int to) {
    return add_edge(a, (gr_edge){from, to, GR_BYTES, lo, hi, -1});
}
bool gr_nfa_call(gr_nfa *a, int from, int rule, int to) { return add_edge(a, (gr_edge){from, to, GR_CALL, 0, 0, rule}); }
void gr_nfa_free(gr_nfa *a) {
    gr_budget_bytes(a->budget, -(ptrdiff_t)((size_t)a->n_edges * sizeof(gr_edge)));
    free(a->edges);
    memset(a, 0, sizeof *a);
}

/* ---- subset construction ------------------------------------------------------------ */
typedef struct {
    int32_t *v; /* the sets, flat: each sorted, unique */
    struct set_at { int off, len; } *at;
    int n, cap, vlen, vcap;
    int *table; /* hash -> set index + 1 */
    int table_cap;
} set_list;

typedef struct {
    const gr_nfa *a;
    int *first, *order; /* edges of state s: order[first[s] .. first[s + 1]) */
    uint8_t *mark;
    int32_t *stack;
    gr_budget *budget;
} det;

/* a successor of a node's members: a byte (0..255) or a rule called (256 + rule), and the target */
typedef struct {
    int32_t key, to;
} move;

static uint64_t hash_ints(const int32_t *v, int n) {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < n; i++) h = (h ^ (uint32_t)v[i]) * 1099511628211ull;
    return h;
}

static int cmp_int(const void *x, const void *y) {
    int32_t a = *(const int32_t *)x, b = *(const int32_t *)y;
    return (a > b) - (a < b);
}

static int cmp_move(const void *x, const void *y) {
    const move *a = x, *b = y;
    if (a->key != b->key) return a->key < b->key ? -1 : 1;
    return (a->to > b->to) - (a->to < b->to);
}

/* the epsilon closure of set[0..n) (duplicates allowed), sorted and unique: returns its size
   (set has room for every state), -1 past the budget */
static int eps_closure(det *d, int32_t *set, int n) {
    int sp = 0, m = 0;
    for (int i = 0; i < n; i++)
        if (!d->mark[set[i]]) d->mark[set[i]] = 1, set[m++] = set[i], d->stack[sp++] = set[i];
    while (sp) {
        int s = d->stack[--sp];
        for (int k = d->first[s]; k < d->first[s + 1]; k++) {
            const gr_edge *e = &d->a->edges[d->order[k]];
            if (e->kind == GR_EPS && !d->mark[e->to]) d->mark[e->to] = 1, set[m++] = e->to, d->stack[sp++] = e->to;
        }
    }
    for (int i = 0; i < m; i++) d->mark[set[i]] = 0;
    qsort(set, (size_t)m, sizeof *set, cmp_int);
    return budget_transitions(d->budget, (size_t)m) ? m : -1; /* the empty moves followed count as transitions */
}

static bool table_grow(set_list *l) {
    int cap = l->table_cap ? l->table_cap * 2 : 64;
    int *t = calloc((size_t)cap, sizeof *t);
    if (!t) return false;
    for (int i = 0; i < l->n; i++) {
        size_t h = hash_ints(l->v + l->at[i].off, l->at[i].len) & (size_t)(cap - 1);
        while (t[h]) h = (h + 1) & (size_t)(cap - 1);
        t[h] = i + 1;
    }
    free(l->table);
    l->table = t;
    l->table_cap = cap;
    return true;
}

/* the index of set[0..n) in l, added when new; -1 when out of memory or past the budget (n < 0: already past it) */
static int intern(set_list *l, const int32_t *set, int n, gr_budget *budget) {
    if (n < 0 || (2 * (l->n + 1) > l->table_cap && !table_grow(l))) return -1;
    size_t mask = (size_t)l->table_cap - 1, h = hash_ints(set, n) & mask;
    for (; l->table[h]; h = (h + 1) & mask) {
        int i = l->table[h] - 1;
        if (l->at[i].len == n && !memcmp(l->v + l->at[i].off, set, (size_t)n * sizeof *set)) return i;
    }
    if (!gr_budget_bytes(budget, (ptrdiff_t)((size_t)n * sizeof *set + sizeof *l->at)) ||
        !reserve(&l->at, &l->cap, l->n + 1, sizeof *l->at) || !reserve(&l->v, &l->vcap, l->vlen + n, sizeof *l->v))
        return -1;
    memcpy(l->v + l->vlen, set, (size_t)n * sizeof *set);
    l->at[l->n] = (struct set_at){l->vlen, n};
    l->vlen += n;
    l->table[h] = l->n + 1;
    return l->n++;
}

static void set_list_free(set_list *l, gr_budget *budget) {
    gr_budget_bytes(budget, -(ptrdiff_t)((size_t)l->vlen * sizeof *l->v + (size_t)l->n * sizeof *l->at));
    free(l->v);
    free(l->at);
    free(l->table);
}

typedef struct {
    gr_node *nodes;
    gr_call *calls;
    int n_nodes, cap_nodes, n_calls, cap_calls;
    gr_budget *budget;
} node_list;

static gr_node *new_node(node_list *o) {
    if (!budget_node(o->budget, o->n_nodes + 1) || !reserve(&o->nodes, &o->cap_nodes, o->n_nodes + 1, sizeof *o->nodes))
        return NULL;
    gr_node *n = &o->nodes[o->n_nodes++];
    memset(n->next, 0xff, sizeof n->next);
    n->first_call = o->n_calls;
    n->n_calls = 0;
    n->final = n->has_bytes = false;
    return n;
}

static bool new_call(node_list *o, int32_t rule, int32_t ret) {
    if (!gr_budget_bytes(o->budget, sizeof(gr_call)) || !reserve(&o->calls, &o->cap_calls, o->n_calls + 1, sizeof *o->calls))
        return false;
    o->calls[o->n_calls++] = (gr_call){rule, ret};
    return true;
}

/* whether the moves [a, a_end) and [b, b_end) have the same targets */
static bool same_targets(const move *mv, int a, int a_end, int b, int b_end) {
    if (a_end - a != b_end - b) return false;
    for (int i = 0; i < b_end - b; i++)
        if (mv[a + i].to != mv[b + i].to) return false;
    return true;
}

/* The moves out of a node's members, sorted by key then target, duplicates kept. */
static bool node_moves(const det *d, const int32_t *members, int n_members, move **mv, int *n, int *cap) {
    *n = 0;
    for (int m = 0; m < n_members; m++)
        for (int k = d->first[members[m]]; k < d->first[members[m] + 1]; k++) {
            const gr_edge *e = &d->a->edges[d->order[k]];
            if (e->kind == GR_EPS) continue;
            int lo = e->kind == GR_CALL ? 256 + e->rule : e->lo, hi = e->kind == GR_CALL ? lo : e->hi;
            if (!reserve(mv, cap, *n + hi - lo + 1, sizeof **mv)) return false;
            for (int b = lo; b <= hi; b++) (*mv)[(*n)++] = (move){b, e->to};
        }
    qsort(*mv, (size_t)*n, sizeof **mv, cmp_move);
    return budget_transitions(d->budget, (size_t)*n);
}

/* The DFA of one rule appended to o (calls hold rule ids, resolved later); *start its first node. */
static kvs_status determinize(const gr_nfa *a, node_list *o, int32_t *start) {
    int ns = a->n_states;
    det d = {a, calloc((size_t)ns + 2, sizeof(int)), malloc(((size_t)a->n_edges + 1) * sizeof(int)),
             calloc((size_t)ns + 1, 1), malloc(((size_t)ns + 1) * sizeof(int32_t)), o->budget};
    int32_t *set = malloc(((size_t)ns + 1) * sizeof *set), *members = NULL;
    int *fill = calloc((size_t)ns + 1, sizeof *fill);
    move *mv = NULL;
    int n_mv = 0, cap_mv = 0, cap_members = 0;
    set_list sets = {0};
    bool ok = d.first && d.order && d.mark && d.stack && set && fill;
    for (int k = 0; ok && k < a->n_edges; k++) d.first[a->edges[k].from + 1]++;
    for (int s = 0; ok && s < ns; s++) d.first[s + 1] += d.first[s];
    for (int k = 0; ok && k < a->n_edges; k++) d.order[d.first[a->edges[k].from] + fill[a->edges[k].from]++] = k;
    if (ok) {
        set[0] = a->start;
        ok = intern(&sets, set, eps_closure(&d, set, 1), o->budget) == 0;
    }
    int base = o->n_nodes;
    *start = base;
    for (int di = 0; ok && di < sets.n; di++) {
        ok = new_node(o) != NULL;
        int n_members = sets.at[di].len;
        ok = ok && reserve(&members, &cap_members, n_members, sizeof *members);
        if (!ok) break;
        memcpy(members, sets.v + sets.at[di].off, (size_t)n_members * sizeof *members);
        for (int m = 0; m < n_members; m++) o->nodes[base + di].final |= members[m] == a->final;
        ok = node_moves(&d, members, n_members, &mv, &n_mv, &cap_mv);
        /* one successor set per byte, one return set per rule called; consecutive bytes
           with the same targets share the set (and its interning) */
        int prev_from = -1, prev_to = -1, prev_id = -1;
        for (int i = 0; ok && i < n_mv;) {
            int j = i, nt = 0;
            for (; j < n_mv && mv[j].key == mv[i].key; j++)
                if (!nt || set[nt - 1] != mv[j].to) set[nt++] = mv[j].to; /* sorted: duplicates adjacent */
            int id;
            if (prev_from >= 0 && mv[i].key < 256 && same_targets(mv, prev_from, prev_to, i, j))
                id = prev_id;
            else
                id = intern(&sets, set, eps_closure(&d, set, nt), o->budget);
            if (id < 0) ok = false;
            else if (mv[i].key < 256) o->nodes[base + di].next[mv[i].key] = base + id;
            else if ((ok = new_call(o, mv[i].key - 256, base + id))) o->nodes[base + di].n_calls++;
            prev_from = i, prev_to = j, prev_id = id;
            i = j;
        }
    }
    kvs_status st = KVS_OK;
    if (!ok)
        st = o->budget && o->budget->code != KVS_OK ? gr_budget_status(o->budget)
                                                    : kvs_fail(KVS_ERR_NOMEM, "grammar: out of memory compiling a rule");
    free(d.first), free(d.order), free(d.mark), free(d.stack), free(set), free(fill), free(members), free(mv);
    set_list_free(&sets, o->budget);
    return st;
}

kvs_status gr_compile(gr_nfa *const *rules, int n_rules, int root, gr_budget *budget, kvs_grammar **out) {
    *out = NULL;
    node_list o = {.budget = budget};
    int32_t *starts = malloc(((size_t)n_rules + 1) * sizeof *starts);
    kvs_status st = starts ? KVS_OK : kvs_fail(KVS_ERR_NOMEM, "grammar: out of memory");
    for (int r = 0; r < n_rules && st == KVS_OK; r++) st = determinize(rules[r], &o, &starts[r]);
    kvs_grammar *g = st == KVS_OK ? calloc(1, sizeof *g) : NULL;
    if (st == KVS_OK && !g) st = kvs_fail(KVS_ERR_NOMEM, "grammar: out of memory");
    if (st != KVS_OK) {
        free(o.nodes), free(o.calls), free(starts);
        return st;
    }
    for (int c = 0; c < o.n_calls; c++) o.calls[c].callee = starts[o.calls[c].callee];
    for (int r = 0; r < n_rules; r++) { /* each rule's nodes: from its start to the next rule's */
        int end = r + 1 < n_rules ? starts[r + 1] : o.n_nodes;
        bool plain = true;
        for (int i = starts[r]; i < end; i++) plain &= o.nodes[i].n_calls == 0;
        for (int i = starts[r]; i < end; i++)
            o.nodes[i].plain = plain, o.nodes[i].rule_base = starts[r], o.nodes[i].rule_size = end - starts[r];
    }
    for (int i = 0; i < o.n_nodes; i++)
        for (int b = 0; b < 256 && !o.nodes[i].has_bytes; b++) o.nodes[i].has_bytes = o.nodes[i].next[b] >= 0;
    atomic_init(&g->refs, 1);
    g->nodes = o.nodes;
    g->calls = o.calls;
    g->n_nodes = o.n_nodes;
    g->n_calls = o.n_calls;
    g->root = starts[root];
    pthread_mutex_init(&g->cache_lock, NULL);
    free(starts);
    *out = g;
    return KVS_OK;
}

kvs_grammar *kvs_grammar_ref(kvs_grammar *g) {
    if (g) atomic_fetch_add(&g->refs, 1);
    return g;
}

size_t kvs_grammar_bytes(kvs_grammar *g) {
    if (!g) return 0;
    pthread_mutex_lock(&g->cache_lock);
    size_t n = sizeof *g + (size_t)g->n_nodes * sizeof *g->nodes + (size_t)g->n_calls * sizeof *g->calls +
               (size_t)g->min_bytes_levels * ((size_t)g->n_nodes + 1) * sizeof *g->min_bytes + gr_mask_cache_bytes(g->cache);
    pthread_mutex_unlock(&g->cache_lock);
    return n;
}

void kvs_grammar_unref(kvs_grammar *g) {
    if (!g || atomic_fetch_sub(&g->refs, 1) != 1) return;
    gr_mask_cache_free(g->cache);
    free(g->min_bytes);
    pthread_mutex_destroy(&g->cache_lock);
    free(g->nodes);
    free(g->calls);
    free(g);
}
