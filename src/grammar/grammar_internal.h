/* grammar internals shared by nfa.c, schema.c, matcher.c and vocab.c. Not a public header. */
#ifndef KVS_GRAMMAR_INTERNAL_H
#define KVS_GRAMMAR_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include "grammar/grammar.h"

/* ---- a rule under construction: an NFA over bytes, epsilons and rule calls (nfa.c) ---- */
enum { GR_EPS, GR_BYTES, GR_CALL };
typedef struct {
    int32_t from, to;
    uint8_t kind, lo, hi; /* GR_BYTES: the range lo..hi */
    int32_t rule;         /* GR_CALL: the rule called; to is where it returns */
} gr_edge;
/* What one compile has spent against its bounds (kvs_grammar_limits); shared by
 * every rule's NFA and the determinization. NULL: no bounds. */
typedef struct {
    kvs_grammar_limits lim;
    double t_end;       /* kvs_now() past which the compile stops (0: none) */
    size_t transitions; /* NFA edges built */
    size_t bytes;       /* memory held now: NFA edges, subset sets, DFA nodes and calls */
    unsigned checks;
    kvs_status code;    /* the first bound passed (KVS_OK: none) and why */
    char why[200];
} gr_budget;
void gr_budget_init(gr_budget *b, const kvs_grammar_limits *lim);
/* false once a bound is passed (the clock and the cancel flag are read every few hundred calls) */
bool gr_budget_ok(gr_budget *b);
bool gr_budget_bytes(gr_budget *b, ptrdiff_t n); /* n bytes more (negative: freed) */
kvs_status gr_budget_status(const gr_budget *b); /* the failure, as kvs_fail */

typedef struct {
    gr_edge *edges;
    int n_edges, cap_edges;
    int n_states, start, final;
    gr_budget *budget;
} gr_nfa;

int gr_nfa_state(gr_nfa *a); /* -1 when out of memory */
bool gr_nfa_eps(gr_nfa *a, int from, int to);
bool gr_nfa_bytes(gr_nfa *a, int from, uint8_t lo, uint8_t hi, int to);
bool gr_nfa_call(gr_nfa *a, int from, int rule, int to);
void gr_nfa_free(gr_nfa *a);

/* ---- regular expressions (regex.c) ---------------------------------------------------------
 * Edges of a from x to y: the content of a JSON string (the quotes are the
 * caller's) whose code points match pattern (ECMA-262, UTF-8 text of len
 * bytes; unanchored unless ^ / $ say otherwise), between lo and hi code points
 * long (lo 0, hi -1: any length). where names the pattern in messages
 * ("schema.properties.code.pattern"). */
kvs_status gr_regex(gr_nfa *a, int x, int y, const char *pattern, size_t len, int lo, int hi, const char *where);

/* ---- the compiled grammar: every rule's DFA, one array of nodes ---------------------- */
typedef struct {
    int32_t callee, ret; /* the callee's start node; the node of the caller to return to */
} gr_call;
typedef struct {
    int32_t next[256]; /* node after each byte, -1: rejected */
    int32_t first_call, n_calls;
    bool final;     /* the rule may return here */
    bool has_bytes; /* some next[] >= 0 */
    bool plain;     /* its rule calls no rule */
    int32_t rule_base, rule_size; /* its rule's nodes */
} gr_node;

typedef struct gr_mask_cache gr_mask_cache;
struct kvs_grammar {
    atomic_int refs;
    gr_node *nodes;
    gr_call *calls;
    int n_nodes, n_calls;
    int32_t root; /* the start node of the root rule */
    pthread_mutex_t cache_lock;
    gr_mask_cache *cache; /* masks by state, for one vocabulary (vocab.c) */
    int32_t *min_bytes;   /* [min_bytes_levels][n_nodes + 1] the fewest bytes from each node to its rule's */
    int min_bytes_levels; /* return, calls nested at most k deep (close.c), built on first use */
    uint64_t mask_work;   /* matcher steps a mask may take (0: no bound) */
};

/* Determinizes rules[0..n_rules) into a grammar whose root is rules[root]. */
kvs_status gr_compile(gr_nfa *const *rules, int n_rules, int root, gr_budget *budget, kvs_grammar **out);
size_t gr_mask_cache_bytes(const gr_mask_cache *c); /* under the grammar's cache_lock */
void gr_mask_cache_free(gr_mask_cache *c);

/* ---- states: a set of stacks of nodes (matcher.c) --------------------------------------
 * Stored flat: for each stack its depth, then its nodes bottom to top; a stack of
 * depth 0 is the accepted output. Every top node has byte edges. */
typedef struct {
    int32_t *v;
    int len, cap, n_stacks;
    bool cut; /* stacks were dropped making it (depth limit, closure budget, too many stacks) */
} gr_state;
/* A walk's scratch and its work: the stacks a byte's closure visited, the
 * steps taken (stacks moved or expanded) and the most it may take (0: any). */
typedef struct {
    gr_state seen;
    uint64_t work, max_work;
    bool over; /* max_work was passed: the walk stopped */
} gr_walk;
bool gr_state_accepted(const gr_state *s);
/* out = the state after byte b; false when out of memory or past w's max_work */
bool gr_advance(const kvs_grammar *g, const gr_state *in, uint8_t b, gr_state *out, gr_walk *w);
/* the same, keeping stacks up to limit deep */
bool gr_advance_limited(const kvs_grammar *g, const gr_state *in, uint8_t b, gr_state *out, gr_walk *w, int limit);
bool gr_state_single(gr_state *out, int32_t node); /* out = the one stack [node] */
bool gr_initial(const kvs_grammar *g, gr_state *out, gr_walk *w);
void gr_walk_start(gr_walk *w, const kvs_grammar *g); /* work 0, the grammar's mask bound */
kvs_status gr_walk_failed(const gr_walk *w);          /* why a walk returned false, as kvs_fail */
void gr_state_free(gr_state *s);
uint64_t gr_state_hash(const gr_state *s);

/* ---- the matcher (matcher.c; close.c reads it) ------------------------------------------- */
struct kvs_grammar_matcher {
    kvs_grammar *g;
    const kvs_grammar_vocab *v;
    gr_state state, next, tmp;
    gr_walk walk;
    gr_state *levels; /* [v->max_depth + 1]: the mask walk's state at each trie depth */
    bool ended;
};

/* ---- the vocabulary trie (vocab.c) ------------------------------------------------------- */
struct kvs_grammar_vocab {
    int n_tokens, n_nodes, max_depth;
    uint8_t *byte;       /* [n_nodes] preorder: the byte of the edge into node i */
    int32_t *depth;      /* [n_nodes] 1 = a child of the root */
    int32_t *skip;       /* [n_nodes] the node after i's subtree */
    int32_t *tok_first;  /* [n_nodes + 1] tokens ending at node i: tok_ids[tok_first[i] .. tok_first[i + 1]) */
    int32_t *tok_ids;
    char **bytes;        /* [n_tokens] each token's bytes (NULL: none) */
    size_t *lens;
    uint8_t *is_end;     /* [n_tokens] */
    int32_t *end_ids;
    int n_end;
    struct gr_shared_tables *shared; /* node tables of rules that call nothing, for every grammar (vocab.c) */
};
/* bits[] for state s: every token whose bytes keep s alive, the end ids when s is accepted.
 * levels: [v->max_depth + 1] scratch states. */
bool gr_mask_compute(kvs_grammar *g, const kvs_grammar_vocab *v, const gr_state *s, gr_state *levels,
                     gr_walk *w, uint32_t *bits);
/* The cached mask of s for v into bits (true), or false if none. */
bool gr_cache_get(kvs_grammar *g, const kvs_grammar_vocab *v, const gr_state *s, uint32_t *bits);
void gr_cache_put(kvs_grammar *g, const kvs_grammar_vocab *v, const gr_state *s, const uint32_t *bits);

#endif
