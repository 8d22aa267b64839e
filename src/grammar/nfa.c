/* grammar rules: NFAs built by schema.c (byte ranges, epsilons, rule calls),
 * determinized rule by rule (subset construction) into the grammar's nodes. A
 * node has one successor per byte; the automaton stays nondeterministic only
 * through calls (a node may call several rules, and be final too), which the
 * matcher follows as a set of stacks. */
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

static bool add_edge(gr_nfa *a, gr_edge e) {
    if (!reserve(&a->edges, &a->cap_edges, a->n_edges + 1, sizeof e)) return false;
    a->edges[a->n_edges++] = e;
    return true;
}

int gr_nfa_state(gr_nfa *a) { return a->n_states < (1 << 24) ? a->n_states++ : -1; }
bool gr_nfa_eps(gr_nfa *a, int from, int to) { return add_edge(a, (gr_edge){from, to, GR_EPS, 0, 0, -1}); }
bool gr_nfa_bytes(gr_nfa *a, int from, uint8_t lo, uint8_t hi, int to) {
    return add_edge(a, (gr_edge){from, to, GR_BYTES, lo, hi, -1});
}
bool gr_nfa_call(gr_nfa *a, int from, int rule, int to) { return add_edge(a, (gr_edge){from, to, GR_CALL, 0, 0, rule}); }
void gr_nfa_free(gr_nfa *a) {
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
} det;

static uint64_t hash_ints(const int32_t *v, int n) {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < n; i++) h = (h ^ (uint32_t)v[i]) * 1099511628211ull;
    return h;
}

static void push_unique(int32_t *v, int *n, int32_t x) {
    for (int i = 0; i < *n; i++)
        if (v[i] == x) return;
    v[(*n)++] = x;
}

static int cmp_int(const void *x, const void *y) {
    int32_t a = *(const int32_t *)x, b = *(const int32_t *)y;
    return (a > b) - (a < b);
}

/* the epsilon closure of set[0..n), sorted: returns its size (set has room for every state) */
static int eps_closure(det *d, int32_t *set, int n) {
    int sp = 0;
    for (int i = 0; i < n; i++) d->mark[set[i]] = 1, d->stack[sp++] = set[i];
    while (sp) {
        int s = d->stack[--sp];
        for (int k = d->first[s]; k < d->first[s + 1]; k++) {
            const gr_edge *e = &d->a->edges[d->order[k]];
            if (e->kind == GR_EPS && !d->mark[e->to]) d->mark[e->to] = 1, set[n++] = e->to, d->stack[sp++] = e->to;
        }
    }
    for (int i = 0; i < n; i++) d->mark[set[i]] = 0;
    qsort(set, (size_t)n, sizeof *set, cmp_int);
    return n;
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

/* the index of set[0..n) in l, added when new; -1 when out of memory */
static int intern(set_list *l, const int32_t *set, int n) {
    if (2 * (l->n + 1) > l->table_cap && !table_grow(l)) return -1;
    size_t mask = (size_t)l->table_cap - 1, h = hash_ints(set, n) & mask;
    for (; l->table[h]; h = (h + 1) & mask) {
        int i = l->table[h] - 1;
        if (l->at[i].len == n && !memcmp(l->v + l->at[i].off, set, (size_t)n * sizeof *set)) return i;
    }
    if (!reserve(&l->at, &l->cap, l->n + 1, sizeof *l->at) || !reserve(&l->v, &l->vcap, l->vlen + n, sizeof *l->v))
        return -1;
    memcpy(l->v + l->vlen, set, (size_t)n * sizeof *set);
    l->at[l->n] = (struct set_at){l->vlen, n};
    l->vlen += n;
    l->table[h] = l->n + 1;
    return l->n++;
}

static void set_list_free(set_list *l) {
    free(l->v);
    free(l->at);
    free(l->table);
}

typedef struct {
    gr_node *nodes;
    gr_call *calls;
    int n_nodes, cap_nodes, n_calls, cap_calls;
} node_list;

static gr_node *new_node(node_list *o) {
    if (!reserve(&o->nodes, &o->cap_nodes, o->n_nodes + 1, sizeof *o->nodes)) return NULL;
    gr_node *n = &o->nodes[o->n_nodes++];
    memset(n->next, 0xff, sizeof n->next);
    n->first_call = o->n_calls;
    n->n_calls = 0;
    n->final = n->has_bytes = false;
    return n;
}

static bool new_call(node_list *o, int32_t rule, int32_t ret) {
    if (!reserve(&o->calls, &o->cap_calls, o->n_calls + 1, sizeof *o->calls)) return false;
    o->calls[o->n_calls++] = (gr_call){rule, ret};
    return true;
}

/* The DFA of one rule appended to o (calls hold rule ids, resolved later); *start its first node. */
static kvs_status determinize(const gr_nfa *a, node_list *o, int32_t *start) {
    kvs_status st = kvs_fail(KVS_ERR_NOMEM, "grammar: out of memory compiling a rule");
    int ns = a->n_states;
    det d = {a, calloc((size_t)ns + 2, sizeof(int)), malloc(((size_t)a->n_edges + 1) * sizeof(int)),
             calloc((size_t)ns + 1, 1), malloc(((size_t)ns + 1) * sizeof(int32_t))};
    int32_t *set = malloc(((size_t)ns + 1) * sizeof *set);
    int32_t *by_byte = malloc((size_t)ns * 256 * sizeof *by_byte);
    int *n_by_byte = calloc(256, sizeof *n_by_byte);
    set_list sets = {0};
    if (!d.first || !d.order || !d.mark || !d.stack || !set || !by_byte || !n_by_byte) goto done;
    for (int k = 0; k < a->n_edges; k++) d.first[a->edges[k].from + 1]++;
    for (int s = 0; s < ns; s++) d.first[s + 1] += d.first[s];
    int *fill = calloc((size_t)ns + 1, sizeof *fill);
    if (!fill) goto done;
    for (int k = 0; k < a->n_edges; k++) d.order[d.first[a->edges[k].from] + fill[a->edges[k].from]++] = k;
    free(fill);
    set[0] = a->start;
    int n = eps_closure(&d, set, 1);
    if (intern(&sets, set, n) != 0) goto done;
    int base = o->n_nodes;
    *start = base;
    for (int di = 0; di < sets.n; di++) {
        gr_node *node = new_node(o);
        if (!node) goto done;
        int n_members = sets.at[di].len;
        int32_t *members = malloc((size_t)n_members * sizeof *members);
        if (!members) goto done;
        memcpy(members, sets.v + sets.at[di].off, (size_t)n_members * sizeof *members);
        memset(n_by_byte, 0, 256 * sizeof *n_by_byte);
        bool ok = true;
        for (int m = 0; m < n_members; m++) {
            int s = members[m];
            if (s == a->final) node->final = true;
            for (int k = d.first[s]; k < d.first[s + 1]; k++) {
                const gr_edge *e = &a->edges[d.order[k]];
                if (e->kind == GR_BYTES)
                    for (int b = e->lo; b <= e->hi; b++) push_unique(by_byte + b * ns, &n_by_byte[b], e->to);
            }
        }
        int prev_b = -1, prev_id = -1;
        for (int b = 0; b < 256 && ok; b++) {
            if (!n_by_byte[b]) continue;
            int32_t *t = by_byte + b * ns;
            int id;
            if (prev_b >= 0 && n_by_byte[b] == n_by_byte[prev_b] && !memcmp(t, by_byte + prev_b * ns, (size_t)n_by_byte[b] * sizeof *t)) {
                id = prev_id;
            } else {
                memcpy(set, t, (size_t)n_by_byte[b] * sizeof *set);
                id = intern(&sets, set, eps_closure(&d, set, n_by_byte[b]));
            }
            if (id < 0) ok = false;
            o->nodes[base + di].next[b] = base + id;
            prev_b = b, prev_id = id;
        }
        /* calls: one per rule called by a member, returning to the set of their targets */
        for (int m = 0; m < n_members && ok; m++) {
            for (int k = d.first[members[m]]; k < d.first[members[m] + 1] && ok; k++) {
                const gr_edge *e = &a->edges[d.order[k]];
                if (e->kind != GR_CALL) continue;
                bool seen = false;
                for (int c = o->nodes[base + di].first_call; c < o->n_calls; c++) seen |= o->calls[c].callee == e->rule;
                if (seen) continue;
                int nt = 0;
                for (int m2 = 0; m2 < n_members; m2++)
                    for (int k2 = d.first[members[m2]]; k2 < d.first[members[m2] + 1]; k2++) {
                        const gr_edge *e2 = &a->edges[d.order[k2]];
                        if (e2->kind == GR_CALL && e2->rule == e->rule) push_unique(set, &nt, e2->to);
                    }
                int id = intern(&sets, set, eps_closure(&d, set, nt));
                ok = id >= 0 && new_call(o, e->rule, base + id);
                if (ok) o->nodes[base + di].n_calls++;
            }
        }
        free(members);
        if (!ok) goto done;
    }
    st = KVS_OK;
done:
    free(d.first), free(d.order), free(d.mark), free(d.stack), free(set), free(by_byte), free(n_by_byte);
    set_list_free(&sets);
    return st;
}

kvs_status gr_compile(gr_nfa *const *rules, int n_rules, int root, kvs_grammar **out) {
    *out = NULL;
    node_list o = {0};
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

void kvs_grammar_unref(kvs_grammar *g) {
    if (!g || atomic_fetch_sub(&g->refs, 1) != 1) return;
    gr_mask_cache_free(g->cache);
    free(g->min_bytes);
    pthread_mutex_destroy(&g->cache_lock);
    free(g->nodes);
    free(g->calls);
    free(g);
}
