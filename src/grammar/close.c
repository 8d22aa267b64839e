/* grammar closing: how few bytes complete the output from a matcher's state,
 * and the tokens that lead there fastest, for the last tokens of a budget.
 * Per node, the fewest bytes to its rule's return: a byte edge costs 1 plus its
 * target's, a call the callee's start plus the return node's, a final node 0
 * (Bellman-Ford sweeps to the fixpoint, last node first: a rule's nodes are
 * numbered from its start, so most distances settle in one sweep); one table
 * per depth of calls allowed below the node, 0, 1, ... until a table equals the
 * one before (usually 2 or 3 tables), so the depth limit is counted. A stack
 * completes in the sum over its nodes (each rule returns in turn), a state in
 * its cheapest stack. One byte lowers that by at most 1, so the tokens on a
 * shortest completion are found walking the vocabulary's trie and pruning each
 * prefix that falls behind it. */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar_internal.h"

#define FAR INT32_MAX /* no completion */

static int32_t plus(int32_t a, int32_t b) {
    if (a == FAR || b == FAR) return FAR;
    int64_t s = (int64_t)a + b;
    return s < FAR ? (int32_t)s : FAR - 1;
}

/* d = the fewest bytes per node with calls nested at most k deep, from below = those for k - 1
   (NULL: k = 0, no calls), which d starts from (bounds: what k - 1 levels reach, k reach); true when
   some node got fewer */
static bool min_bytes_level(const kvs_grammar *g, const int32_t *below, int32_t *d) {
    if (below) memcpy(d, below, (size_t)g->n_nodes * sizeof *d);
    else
        for (int i = 0; i < g->n_nodes; i++) d[i] = g->nodes[i].final ? 0 : FAR;
    bool fewer = false;
    for (bool changed = true; changed;) {
        changed = false;
        for (int i = g->n_nodes - 1; i >= 0; i--) {
            const gr_node *n = &g->nodes[i];
            int32_t best = d[i];
            for (int b = 0; b < 256; b++) {
                if (n->next[b] < 0 || (b > 0 && n->next[b] == n->next[b - 1])) continue;
                int32_t via = plus(1, d[n->next[b]]);
                if (via < best) best = via;
            }
            for (int k = 0; below && k < n->n_calls; k++) {
                const gr_call *c = &g->calls[n->first_call + k];
                int32_t via = plus(below[c->callee], d[c->ret]);
                if (via < best) best = via;
            }
            if (best < d[i]) d[i] = best, changed = fewer = true;
        }
    }
    return fewer || !below;
}

/* the levels k = 0, 1, ... until one equals the one below (all deeper ones would too) or the depth limit */
static bool compute_min_bytes(kvs_grammar *g) {
    size_t n = (size_t)g->n_nodes + 1;
    int32_t *d = NULL;
    int k = 0;
    for (bool changed = true; changed && k < KVS_GRAMMAR_MAX_DEPTH; k++) {
        int32_t *nd = realloc(d, (size_t)(k + 1) * n * sizeof *d);
        if (!nd) {
            free(d);
            return false;
        }
        d = nd;
        changed = min_bytes_level(g, k ? d + (size_t)(k - 1) * n : NULL, d + (size_t)k * n);
    }
    g->min_bytes = d;
    g->min_bytes_levels = k;
    return true;
}

/* the grammar's table, built once (false: out of memory) */
static bool min_bytes(kvs_grammar *g) {
    pthread_mutex_lock(&g->cache_lock);
    bool ok = g->min_bytes || compute_min_bytes(g);
    pthread_mutex_unlock(&g->cache_lock);
    return ok;
}

/* the fewest bytes completing s, FAR when none: per stack, each node's rule returns in turn, a node at
   depth p nesting calls at most KVS_GRAMMAR_MAX_DEPTH - p deeper */
static int32_t state_bytes(const kvs_grammar *g, const gr_state *s) {
    int32_t best = FAR;
    size_t n = (size_t)g->n_nodes + 1;
    for (int i = 0; i < s->len; i += 1 + s->v[i]) {
        int32_t sum = 0;
        for (int p = 1; p <= s->v[i] && sum < best; p++) {
            int k = KVS_GRAMMAR_MAX_DEPTH - p < g->min_bytes_levels ? KVS_GRAMMAR_MAX_DEPTH - p : g->min_bytes_levels - 1;
            sum = plus(sum, g->min_bytes[(size_t)k * n + (size_t)s->v[i + p]]);
        }
        if (sum < best) best = sum;
    }
    return best;
}

int kvs_grammar_matcher_bytes_to_complete(const kvs_grammar_matcher *m) {
    if (m->ended) return 0;
    int32_t n = min_bytes(m->g) ? state_bytes(m->g, &m->state) : FAR;
    return n == FAR ? -1 : (int)n;
}

static bool has(const uint32_t *bits, int id) { return bits[id / 32] >> (id % 32) & 1; }

/* Into bits, of the tokens in allowed: on_path, those whose bytes keep to a
 * shortest completion of now bytes; else those leaving the fewest bytes. */
static bool closing_walk(kvs_grammar_matcher *m, const uint32_t *allowed, int32_t now, bool on_path,
                         uint32_t *bits) {
    const kvs_grammar_vocab *v = m->v;
    gr_state *levels = m->levels;
    int32_t fewest = FAR;
    for (int i = 0; i < v->n_nodes;) {
        int depth = v->depth[i];
        if (!gr_advance(m->g, depth == 1 ? &m->state : &levels[depth - 1], v->byte[i], &levels[depth], &m->walk)) return false;
        int32_t left = state_bytes(m->g, &levels[depth]);
        if (left == FAR || (on_path && plus(left, depth) > now)) {
            i = v->skip[i];
            continue;
        }
        for (int k = v->tok_first[i]; k < v->tok_first[i + 1]; k++) {
            int id = v->tok_ids[k];
            if (!has(allowed, id)) continue;
            if (!on_path && left < fewest) {
                memset(bits, 0, (size_t)(v->n_tokens + 31) / 32 * sizeof *bits);
                fewest = left;
            }
            if (on_path || left == fewest) bits[id / 32] |= 1u << (id % 32);
        }
        i++;
    }
    return true;
}

kvs_status kvs_grammar_matcher_closing_mask(kvs_grammar_matcher *m, uint32_t *bits) {
    KVS_TRY(kvs_grammar_matcher_mask(m, bits));
    if (m->ended) return KVS_OK;
    int32_t now = min_bytes(m->g) ? state_bytes(m->g, &m->state) : FAR;
    size_t n_words = (size_t)(m->v->n_tokens + 31) / 32;
    uint32_t *allowed = now != FAR ? malloc(n_words * sizeof *allowed) : NULL;
    if (!allowed) return KVS_OK; /* no completion (or no memory): the mask as it is */
    memcpy(allowed, bits, n_words * sizeof *bits);
    memset(bits, 0, n_words * sizeof *bits);
    bool ok = true, any = false;
    if (now == 0)
        for (int e = 0; e < m->v->n_end; e++)
            if (has(allowed, m->v->end_ids[e])) bits[m->v->end_ids[e] / 32] |= 1u << (m->v->end_ids[e] % 32);
    gr_walk_start(&m->walk, m->g);
    if (now > 0) ok = closing_walk(m, allowed, now, true, bits);
    for (size_t w = 0; ok && w < n_words; w++) any |= bits[w] != 0;
    if (ok && !any) ok = closing_walk(m, allowed, now, false, bits);
    kvs_status st = ok || !m->walk.over ? KVS_OK : gr_walk_failed(&m->walk);
    if (!ok) memcpy(bits, allowed, n_words * sizeof *bits); /* out of memory: the mask as it is */
    free(allowed);
    return st;
}
