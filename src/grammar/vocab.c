/* grammar vocabulary: the tokens' bytes as a trie in preorder (a node's
 * subtree is the nodes up to skip[i]), the mask walk over it from a state, and
 * the grammar's cache of masks by state. */
#define _GNU_SOURCE /* qsort_r */
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar_internal.h"

#define CACHE_BYTES ((size_t)64 << 20) /* masks kept per grammar; the cache starts again past this */

/* What a node decides on its own, for states whose stacks have it on top (xgrammar's
 * context-independent tokens): walked from the stack [node] alone, a token is
 * accepted when a stack of its rule (or deeper) is left after it, uncertain when
 * the rule returns inside it (what follows depends on the stacks below), else
 * rejected. Uncertain tokens are kept as positions in tok_ids (trie order). */
typedef struct {
    bool usable; /* false: the walk dropped stacks (too deep, too many): no table for this node */
    uint32_t *accepted;
    int32_t *uncertain;
    int n_uncertain;
} node_table;

/* node tables shared by every grammar of a vocabulary (below) */
typedef struct {
    uint64_t hash;
    int32_t offset, size; /* the node within its rule, the rule's nodes */
    int32_t *shape;       /* per node of the rule: next[256] relative to the rule, then final */
    node_table *t;
} shared_table;

struct gr_shared_tables {
    pthread_mutex_t lock;
    shared_table *e;
    int n, cap;
    size_t bytes;
};

static void shared_tables_free(struct gr_shared_tables *s);

void kvs_grammar_vocab_destroy(kvs_grammar_vocab *v) {
    if (!v) return;
    shared_tables_free(v->shared);
    for (int i = 0; i < v->n_tokens; i++) free(v->bytes[i]);
    free(v->bytes), free(v->lens), free(v->is_end), free(v->end_ids);
    free(v->byte), free(v->depth), free(v->skip), free(v->tok_first), free(v->tok_ids);
    free(v);
}

int kvs_grammar_vocab_size(const kvs_grammar_vocab *v) { return v->n_tokens; }

static int cmp_token(const void *x, const void *y, void *vocab) {
    const kvs_grammar_vocab *v = vocab;
    int a = *(const int32_t *)x, b = *(const int32_t *)y;
    size_t la = v->lens[a], lb = v->lens[b];
    int c = memcmp(v->bytes[a], v->bytes[b], la < lb ? la : lb);
    return c ? c : (la > lb) - (la < lb);
}

/* the preorder trie of the tokens sorted by their bytes */
static bool build_trie(kvs_grammar_vocab *v, int32_t *sorted, int n_sorted, size_t total) {
    v->byte = malloc(total + 1);
    v->depth = malloc((total + 1) * sizeof *v->depth);
    v->skip = malloc((total + 1) * sizeof *v->skip);
    v->tok_first = calloc(total + 2, sizeof *v->tok_first);
    int32_t *path = malloc(((size_t)v->max_depth + 1) * sizeof *path);
    if (!v->byte || !v->depth || !v->skip || !v->tok_first || !path) {
        free(path);
        return false;
    }
    int depth = 0, n = 0;
    const char *prev = NULL;
    size_t prev_len = 0;
    for (int t = 0; t < n_sorted; t++) {
        int id = sorted[t];
        const char *s = v->bytes[id];
        size_t len = v->lens[id], lcp = 0;
        while (prev && lcp < len && lcp < prev_len && s[lcp] == prev[lcp]) lcp++;
        while (depth > (int)lcp) v->skip[path[--depth]] = n; /* leaving a subtree */
        for (; depth < (int)len; depth++) {
            v->byte[n] = (uint8_t)s[depth];
            v->depth[n] = depth + 1;
            path[depth] = n++;
        }
        v->tok_first[path[len - 1] + 1]++;
        prev = s, prev_len = len;
    }
    while (depth > 0) v->skip[path[--depth]] = n;
    free(path);
    v->n_nodes = n;
    for (int i = 0; i < n; i++) v->tok_first[i + 1] += v->tok_first[i];
    v->tok_ids = sorted; /* sorted by bytes = grouped by end node in preorder */
    return true;
}

kvs_status kvs_grammar_vocab_create(const char *const *tokens, const size_t *lens, int n_tokens,
                                    const int32_t *end_ids, int n_end, kvs_grammar_vocab **out) {
    *out = NULL;
    if (n_tokens <= 0 || (!tokens && n_tokens) || !lens || (n_end > 0 && !end_ids) || n_end < 0)
        return kvs_fail(KVS_ERR_INVALID, "grammar vocabulary: no tokens, or NULL arrays");
    for (int i = 0; i < n_end; i++)
        if (end_ids[i] < 0 || end_ids[i] >= n_tokens)
            return kvs_fail(KVS_ERR_INVALID, "grammar vocabulary: end id %d is not below the vocabulary size %d", end_ids[i], n_tokens);
    kvs_grammar_vocab *v = calloc(1, sizeof *v);
    int32_t *sorted = NULL;
    if (!v) return kvs_fail(KVS_ERR_NOMEM, "grammar vocabulary: out of memory");
    v->n_tokens = n_tokens;
    v->bytes = calloc((size_t)n_tokens, sizeof *v->bytes);
    v->lens = calloc((size_t)n_tokens, sizeof *v->lens);
    v->is_end = calloc((size_t)n_tokens, 1);
    v->end_ids = malloc(((size_t)n_end + 1) * sizeof *v->end_ids);
    sorted = malloc((size_t)n_tokens * sizeof *sorted);
    if ((v->shared = calloc(1, sizeof *v->shared))) pthread_mutex_init(&v->shared->lock, NULL);
    bool ok = v->bytes && v->lens && v->is_end && v->end_ids && sorted && v->shared;
    int n_sorted = 0;
    size_t total = 0;
    for (int i = 0; ok && i < n_end; i++) v->is_end[v->end_ids[v->n_end++] = end_ids[i]] = 1;
    for (int i = 0; ok && i < n_tokens; i++) {
        if (!lens[i] || v->is_end[i]) continue;
        ok = (v->bytes[i] = malloc(lens[i])) != NULL;
        if (!ok) break;
        memcpy(v->bytes[i], tokens[i], lens[i]);
        v->lens[i] = lens[i];
        if ((int)lens[i] > v->max_depth) v->max_depth = (int)lens[i];
        total += lens[i];
        sorted[n_sorted++] = i;
    }
    if (ok) {
        qsort_r(sorted, (size_t)n_sorted, sizeof *sorted, cmp_token, v);
        ok = build_trie(v, sorted, n_sorted, total);
        if (ok) sorted = NULL; /* kept as v->tok_ids */
    }
    free(sorted);
    if (!ok) {
        kvs_grammar_vocab_destroy(v);
        return kvs_fail(KVS_ERR_NOMEM, "grammar vocabulary: out of memory for %d tokens", n_tokens);
    }
    *out = v;
    return KVS_OK;
}

kvs_status kvs_grammar_vocab_from_tokenizer(const kvs_tokenizer *t, const int32_t *end_ids, int n_end,
                                            kvs_grammar_vocab **out) {
    *out = NULL;
    int n = kvs_tokenizer_vocab_size(t);
    char **bytes = calloc((size_t)n + 1, sizeof *bytes);
    size_t *lens = calloc((size_t)n + 1, sizeof *lens);
    kvs_status st = bytes && lens ? KVS_OK : kvs_fail(KVS_ERR_NOMEM, "grammar vocabulary: out of memory");
    for (int id = 0; id < n && st == KVS_OK; id++) {
        const char *text = kvs_tokenizer_token_text(t, id);
        size_t cap = text ? strlen(text) : 0;
        if (!cap || !(bytes[id] = malloc(cap))) continue;
        st = kvs_tokenizer_token_bytes(t, id, bytes[id], cap, &lens[id]);
    }
    if (st == KVS_OK) st = kvs_grammar_vocab_create((const char *const *)bytes, lens, n, end_ids, n_end, out);
    for (int id = 0; bytes && id < n; id++) free(bytes[id]);
    free(bytes);
    free(lens);
    return st;
}

/* ---- the mask walk -------------------------------------------------------------------------- */
static void set_bit(uint32_t *bits, int id) { bits[id / 32] |= 1u << (id % 32); }

static void end_bits(const kvs_grammar_vocab *v, const gr_state *s, uint32_t *bits) {
    if (gr_state_accepted(s))
        for (int i = 0; i < v->n_end; i++) set_bit(bits, v->end_ids[i]);
}

/* the whole trie from s */
static bool full_walk(const kvs_grammar *g, const kvs_grammar_vocab *v, const gr_state *s, gr_state *levels,
                      gr_walk *w, uint32_t *bits) {
    for (int i = 0; i < v->n_nodes;) {
        int d = v->depth[i];
        if (!gr_advance(g, d == 1 ? s : &levels[d - 1], v->byte[i], &levels[d], w)) return false;
        if (!levels[d].n_stacks) {
            i = v->skip[i];
            continue;
        }
        for (int k = v->tok_first[i]; k < v->tok_first[i + 1]; k++) set_bit(bits, v->tok_ids[k]);
        i++;
    }
    return true;
}


#define LOCAL_DEPTH (KVS_GRAMMAR_MAX_DEPTH / 2) /* states deeper than this take the full walk */
#define LOCAL_STACKS 64                          /* a table's walk that needs more stacks is not kept */
#define TABLE_STACKS 8                           /* states of more stacks take the full walk */

static void node_table_free(node_table *t) {
    if (!t) return;
    free(t->accepted);
    free(t->uncertain);
    free(t);
}

static bool push_pos(node_table *t, int *cap, int32_t pos) {
    if (t->n_uncertain == *cap) {
        *cap = *cap ? *cap * 2 : 256;
        int32_t *nu = realloc(t->uncertain, (size_t)*cap * sizeof *nu);
        if (!nu) return false;
        t->uncertain = nu;
    }
    t->uncertain[t->n_uncertain++] = pos;
    return true;
}

static node_table *node_table_build(const kvs_grammar *g, const kvs_grammar_vocab *v, int32_t node, gr_state *levels,
                                    gr_walk *w) {
    node_table *t = calloc(1, sizeof *t);
    uint8_t *popped = malloc((size_t)v->max_depth + 2);
    gr_state start = {0};
    int cap = 0;
    bool ok = t && popped && (t->accepted = calloc((size_t)(v->n_tokens + 31) / 32, sizeof *t->accepted)) &&
              gr_state_single(&start, node);
    if (ok) t->usable = true, popped[0] = 0;
    for (int i = 0; ok && t->usable && i < v->n_nodes;) {
        int d = v->depth[i];
        gr_state *l = &levels[d];
        ok = gr_advance_limited(g, d == 1 ? &start : &levels[d - 1], v->byte[i], l, w, LOCAL_DEPTH + 1);
        if (l->cut || l->n_stacks > LOCAL_STACKS) t->usable = false;
        bool returned = gr_state_accepted(l); /* the empty stack: node's rule returned */
        popped[d] = popped[d - 1] | returned;
        if (l->n_stacks > (int)returned) {
            for (int k = v->tok_first[i]; k < v->tok_first[i + 1]; k++) set_bit(t->accepted, v->tok_ids[k]);
            i++;
            continue;
        }
        if (popped[d])
            for (int k = v->tok_first[i]; ok && k < v->tok_first[v->skip[i]]; k++) ok = push_pos(t, &cap, k);
        i = v->skip[i];
    }
    free(popped);
    gr_state_free(&start);
    if (!ok) {
        node_table_free(t);
        return NULL;
    }
    return t;
}

static int cmp_pos(const void *x, const void *y) {
    int32_t a = *(const int32_t *)x, b = *(const int32_t *)y;
    return (a > b) - (a < b);
}

/* the tokens at positions pos[0..n) (trie order) from s, sharing the states of common prefixes */
static bool list_walk(const kvs_grammar *g, const kvs_grammar_vocab *v, const gr_state *s, const int32_t *pos, int n,
                      gr_state *levels, gr_walk *w, uint32_t *bits) {
    const char *prev = NULL;
    size_t prev_len = 0, have = 0, dead = SIZE_MAX; /* levels[1..have] hold prev's prefixes; prefix of length dead is rejected */
    for (int k = 0; k < n; k++) {
        int id = v->tok_ids[pos[k]];
        if (bits[id / 32] >> (id % 32) & 1) continue;
        const char *b = v->bytes[id];
        size_t len = v->lens[id], lcp = 0;
        while (prev && lcp < len && lcp < prev_len && b[lcp] == prev[lcp]) lcp++;
        if (prev && lcp >= dead) continue;
        if (have > lcp) have = lcp;
        dead = SIZE_MAX;
        for (size_t d = have + 1; d <= len; d++) {
            if (!gr_advance(g, d == 1 ? s : &levels[d - 1], (uint8_t)b[d - 1], &levels[d], w)) return false;
            have = d;
            if (!levels[d].n_stacks) {
                dead = d;
                have = d - 1;
                break;
            }
        }
        if (dead == SIZE_MAX) set_bit(bits, id);
        prev = b, prev_len = len;
    }
    return true;
}

static node_table *table_for(kvs_grammar *g, const kvs_grammar_vocab *v, int32_t node, gr_state *levels, gr_walk *w);

bool gr_mask_compute(kvs_grammar *g, const kvs_grammar_vocab *v, const gr_state *s, gr_state *levels,
                     gr_walk *w, uint32_t *bits) {
    size_t n_words = (size_t)(v->n_tokens + 31) / 32;
    memset(bits, 0, n_words * sizeof *bits);
    end_bits(v, s, bits);
    bool tables = s->n_stacks <= TABLE_STACKS;
    for (int i = 0; tables && i < s->len; i += 1 + s->v[i]) tables = s->v[i] <= LOCAL_DEPTH;
    node_table *t[TABLE_STACKS];
    int n_t = 0, n_pos = 0;
    for (int i = 0; tables && i < s->len; i += 1 + s->v[i]) {
        if (s->v[i] == 0) continue;
        t[n_t] = table_for(g, v, s->v[i + s->v[i]], levels, w);
        tables = t[n_t] && t[n_t]->usable;
        if (tables) n_pos += t[n_t++]->n_uncertain;
    }
    if (!tables) return full_walk(g, v, s, levels, w, bits);
    int32_t *pos = malloc(((size_t)n_pos + 1) * sizeof *pos);
    if (!pos) return false;
    n_pos = 0;
    for (int k = 0; k < n_t; k++) {
        for (size_t i = 0; i < n_words; i++) bits[i] |= t[k]->accepted[i];
        if (t[k]->n_uncertain) memcpy(pos + n_pos, t[k]->uncertain, (size_t)t[k]->n_uncertain * sizeof *pos);
        n_pos += t[k]->n_uncertain;
    }
    if (n_t > 1) qsort(pos, (size_t)n_pos, sizeof *pos, cmp_pos);
    bool ok = list_walk(g, v, s, pos, n_pos, levels, w, bits);
    free(pos);
    return ok;
}

/* ---- the mask cache: open addressing by the state's hash ------------------------------------ */
typedef struct {
    uint64_t hash;
    int32_t *key; /* the state's stacks (NULL: empty slot) */
    int key_len;
    uint32_t *bits;
} cache_slot;

struct gr_mask_cache {
    const kvs_grammar_vocab *v; /* the vocabulary the masks are for */
    cache_slot *slots;
    size_t cap, n, bytes, n_words;
    node_table **tables; /* [n_tables = grammar nodes], built on first use */
    int n_tables;
    size_t table_bytes;  /* the tables' memory */
};

size_t gr_mask_cache_bytes(const gr_mask_cache *c) {
    return c ? sizeof *c + c->cap * sizeof *c->slots + (size_t)c->n_tables * sizeof *c->tables + c->bytes + c->table_bytes
             : 0;
}

static void cache_clear(gr_mask_cache *c) {
    for (size_t i = 0; i < c->cap; i++) free(c->slots[i].key), free(c->slots[i].bits);
    memset(c->slots, 0, c->cap * sizeof *c->slots);
    c->n = c->bytes = 0;
}

void gr_mask_cache_free(gr_mask_cache *c) {
    if (!c) return;
    cache_clear(c);
    for (int i = 0; c->tables && i < c->n_tables; i++) node_table_free(c->tables[i]);
    free(c->tables);
    free(c->slots);
    free(c);
}

static cache_slot *cache_find(const gr_mask_cache *c, const gr_state *s, uint64_t h) {
    for (size_t i = h & (c->cap - 1);; i = (i + 1) & (c->cap - 1)) {
        cache_slot *e = &c->slots[i];
        if (!e->key || (e->hash == h && e->key_len == s->len &&
                        (s->len == 0 || !memcmp(e->key, s->v, (size_t)s->len * sizeof *s->v))))
            return e;
    }
}

void kvs_grammar_forget_masks(kvs_grammar *g) {
    pthread_mutex_lock(&g->cache_lock);
    if (g->cache) cache_clear(g->cache);
    pthread_mutex_unlock(&g->cache_lock);
}

bool gr_cache_get(kvs_grammar *g, const kvs_grammar_vocab *v, const gr_state *s, uint32_t *bits) {
    bool hit = false;
    uint64_t h = gr_state_hash(s);
    pthread_mutex_lock(&g->cache_lock);
    gr_mask_cache *c = g->cache;
    if (c && c->v == v && c->cap) { /* made (for its node tables) by another thread, no mask put yet: cap 0 */
        cache_slot *e = cache_find(c, s, h);
        if ((hit = e->key != NULL)) memcpy(bits, e->bits, c->n_words * sizeof *bits);
    }
    pthread_mutex_unlock(&g->cache_lock);
    return hit;
}

static bool cache_grow(gr_mask_cache *c) {
    size_t cap = c->cap ? c->cap * 2 : 256;
    cache_slot *ns = calloc(cap, sizeof *ns);
    if (!ns) return false;
    cache_slot *old = c->slots;
    size_t old_cap = c->cap;
    c->slots = ns;
    c->cap = cap;
    for (size_t i = 0; i < old_cap; i++) {
        if (!old[i].key) continue;
        size_t k = old[i].hash & (cap - 1);
        while (ns[k].key) k = (k + 1) & (cap - 1);
        ns[k] = old[i];
    }
    free(old);
    return true;
}

/* g's cache when it is for v (made for the first vocabulary asked); call under the lock */
static gr_mask_cache *cache_for(kvs_grammar *g, const kvs_grammar_vocab *v) {
    if (!g->cache && (g->cache = calloc(1, sizeof *g->cache))) {
        g->cache->v = v;
        g->cache->n_words = (size_t)(v->n_tokens + 31) / 32;
        if (!(g->cache->tables = calloc((size_t)g->n_nodes, sizeof *g->cache->tables))) {
            free(g->cache);
            g->cache = NULL;
        } else {
            g->cache->n_tables = g->n_nodes;
        }
    }
    return g->cache && g->cache->v == v ? g->cache : NULL;
}

/* ---- node tables shared by every grammar of a vocabulary ------------------------------------
 * A node of a rule that calls nothing decides its tokens from that rule alone, so
 * the same rule (a string, a number, a bounded string, an enum) compiled in
 * another grammar gets the same table: kept by the rule's shape. */
#define SHARED_RULE_NODES 256
#define SHARED_BYTES ((size_t)64 << 20)


static bool reserve_entries(struct gr_shared_tables *s) {
    int cap = s->cap ? s->cap * 2 : 64;
    shared_table *ne = realloc(s->e, (size_t)cap * sizeof *ne);
    if (!ne) return false;
    s->e = ne;
    s->cap = cap;
    return true;
}

static void shared_tables_free(struct gr_shared_tables *s) {
    if (!s) return;
    for (int i = 0; i < s->n; i++) free(s->e[i].shape), node_table_free(s->e[i].t);
    free(s->e);
    pthread_mutex_destroy(&s->lock);
    free(s);
}

static int32_t *rule_shape(const kvs_grammar *g, int32_t node, uint64_t *hash) {
    const gr_node *n = &g->nodes[node];
    int32_t *shape = malloc((size_t)n->rule_size * 257 * sizeof *shape);
    if (!shape) return NULL;
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < n->rule_size; i++) {
        const gr_node *r = &g->nodes[n->rule_base + i];
        int32_t *out = shape + (size_t)i * 257;
        for (int b = 0; b < 256; b++) out[b] = r->next[b] < 0 ? -1 : r->next[b] - n->rule_base;
        out[256] = r->final;
        for (int k = 0; k < 257; k++) h = (h ^ (uint32_t)out[k]) * 1099511628211ull;
    }
    *hash = h;
    return shape;
}

static node_table *table_copy(const node_table *t, size_t n_words) {
    node_table *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    *c = *t;
    c->accepted = malloc(n_words * sizeof *c->accepted);
    c->uncertain = malloc(((size_t)t->n_uncertain + 1) * sizeof *c->uncertain);
    if (!c->accepted || !c->uncertain) {
        node_table_free(c);
        return NULL;
    }
    memcpy(c->accepted, t->accepted, n_words * sizeof *c->accepted);
    if (t->n_uncertain) memcpy(c->uncertain, t->uncertain, (size_t)t->n_uncertain * sizeof *c->uncertain);
    return c;
}

/* a copy of the shared table of node's rule shape, or NULL */
static node_table *shared_get(const kvs_grammar_vocab *v, int32_t offset, const int32_t *shape, int32_t size, uint64_t h) {
    struct gr_shared_tables *s = v->shared;
    node_table *t = NULL;
    pthread_mutex_lock(&s->lock);
    for (int i = 0; i < s->n && !t; i++) {
        shared_table *e = &s->e[i];
        if (e->hash == h && e->offset == offset && e->size == size && !memcmp(e->shape, shape, (size_t)size * 257 * sizeof *shape))
            t = table_copy(e->t, (size_t)(v->n_tokens + 31) / 32);
    }
    pthread_mutex_unlock(&s->lock);
    return t;
}

/* keeps a copy of t for the rule shape (which it then owns); frees shape otherwise */
static void shared_put(const kvs_grammar_vocab *v, int32_t offset, int32_t *shape, int32_t size, uint64_t h, const node_table *t) {
    struct gr_shared_tables *s = v->shared;
    size_t n_words = (size_t)(v->n_tokens + 31) / 32;
    size_t bytes = n_words * 4 + (size_t)t->n_uncertain * 4 + (size_t)size * 257 * 4;
    node_table *c = NULL;
    pthread_mutex_lock(&s->lock);
    if (s->bytes + bytes <= SHARED_BYTES && (s->n < s->cap || reserve_entries(s)) && (c = table_copy(t, n_words))) {
        s->e[s->n++] = (shared_table){h, offset, size, shape, c};
        s->bytes += bytes;
        shape = NULL;
    }
    pthread_mutex_unlock(&s->lock);
    free(shape);
}

/* a node's table: a copy of the shared one when its rule calls nothing, else built */
static node_table *table_make(const kvs_grammar *g, const kvs_grammar_vocab *v, int32_t node, gr_state *levels, gr_walk *w) {
    const gr_node *n = &g->nodes[node];
    if (!n->plain || n->rule_size > SHARED_RULE_NODES) return node_table_build(g, v, node, levels, w);
    uint64_t h;
    int32_t *shape = rule_shape(g, node, &h), offset = node - n->rule_base;
    node_table *t = shape ? shared_get(v, offset, shape, n->rule_size, h) : NULL;
    if (t || !shape) {
        free(shape);
        return t ? t : node_table_build(g, v, node, levels, w);
    }
    t = node_table_build(g, v, node, levels, w);
    if (t) shared_put(v, offset, shape, n->rule_size, h, t);
    else free(shape);
    return t;
}

/* node's table: kept in the cache, built (outside the lock) on first use; NULL when out of memory */
static node_table *table_for(kvs_grammar *g, const kvs_grammar_vocab *v, int32_t node, gr_state *levels, gr_walk *w) {
    pthread_mutex_lock(&g->cache_lock);
    gr_mask_cache *c = cache_for(g, v);
    node_table *t = c ? c->tables[node] : NULL;
    pthread_mutex_unlock(&g->cache_lock);
    if (t || !c) return t;
    if (!(t = table_make(g, v, node, levels, w))) return NULL;
    pthread_mutex_lock(&g->cache_lock);
    c = cache_for(g, v);
    node_table *keep = !c ? NULL : c->tables[node] ? c->tables[node] : (c->tables[node] = t);
    if (keep == t) c->table_bytes += sizeof *t + c->n_words * sizeof *t->accepted + (size_t)t->n_uncertain * sizeof *t->uncertain;
    pthread_mutex_unlock(&g->cache_lock);
    if (keep != t) node_table_free(t);
    return keep;
}

void gr_cache_put(kvs_grammar *g, const kvs_grammar_vocab *v, const gr_state *s, const uint32_t *bits) {
    uint64_t h = gr_state_hash(s);
    pthread_mutex_lock(&g->cache_lock);
    gr_mask_cache *c = cache_for(g, v);
    if (!c) goto done; /* the cache serves the first vocabulary only */
    size_t entry = c->n_words * sizeof *bits + (size_t)s->len * sizeof *s->v;
    if (c->bytes + entry > CACHE_BYTES) cache_clear(c);
    if (2 * (c->n + 1) > c->cap && !cache_grow(c)) goto done;
    cache_slot *e = cache_find(c, s, h);
    if (e->key) goto done;
    int32_t *key = malloc((size_t)s->len * sizeof *key + 1);
    uint32_t *copy = malloc(c->n_words * sizeof *copy);
    if (!key || !copy) {
        free(key), free(copy);
        goto done;
    }
    if (s->len) memcpy(key, s->v, (size_t)s->len * sizeof *key); /* an empty state (every stack cut) has no v */
    memcpy(copy, bits, c->n_words * sizeof *copy);
    *e = (cache_slot){h, key, s->len, copy};
    c->n++;
    c->bytes += entry;
done:
    pthread_mutex_unlock(&g->cache_lock);
}
