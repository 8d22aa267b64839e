/* The block pool: which blocks are free, held or cached, and nothing else.
 * A block is in exactly one state: free (on the stack), held (ref >= 1: the
 * tables and spare lists holding it) or evictable (cached, no holder, on the
 * LRU list, least recently dropped first). A cached block is also in the
 * hash index under its key, with what verifies a hit exactly (its tokens, its
 * parent block and that block's generation, the salt's second hash): a key
 * collision never gives another prompt's KV. Host memory only; the pool's
 * bytes are the backend's (kv_cache.c). */
#include <stdlib.h>
#include <string.h>

#include "backend/sample.h" /* kvs_sample_mix64 */
#include "kv/kv_internal.h"

kvs_status kvs_block_pool_init(kvs_block_pool *p, int64_t n_blocks, int block_size, int n_layers, bool caching) {
    memset(p, 0, sizeof *p);
    p->n_blocks = n_blocks, p->block_size = block_size, p->n_layers = n_layers;
    p->lru_head = p->lru_tail = -1;
    p->free_blocks = malloc(sizeof(int32_t) * (size_t)n_blocks);
    p->meta = calloc((size_t)n_blocks, sizeof(block_meta));
    p->cached_per_layer = calloc((size_t)n_layers, sizeof(int64_t));
    if (!p->free_blocks || !p->meta || !p->cached_per_layer) return kvs_fail(KVS_ERR_NOMEM, "kv cache: out of memory");
    for (int64_t i = 0; i < n_blocks; i++) p->free_blocks[i] = (int32_t)(n_blocks - 1 - i); /* block 0 first */
    p->n_free = n_blocks;
    if (!caching) return KVS_OK;
    p->n_buckets = 1;
    while (p->n_buckets < n_blocks) p->n_buckets *= 2;
    p->buckets = malloc(sizeof(int32_t) * (size_t)p->n_buckets);
    p->tokens = malloc(sizeof(int32_t) * (size_t)n_blocks * block_size);
    if (!p->buckets || !p->tokens) return kvs_fail(KVS_ERR_NOMEM, "kv cache: out of memory for the prefix cache");
    memset(p->buckets, 0xff, sizeof(int32_t) * (size_t)p->n_buckets);
    return KVS_OK;
}

void kvs_block_pool_release(kvs_block_pool *p) {
    free(p->free_blocks);
    free(p->meta);
    free(p->cached_per_layer);
    free(p->buckets);
    free(p->tokens);
    if (p->events) free(p->events->events), free(p->events->tokens), free(p->events);
    memset(p, 0, sizeof *p);
}

/* ---- the evictable list ---------------------------------------------------------- */
static void lru_push_back(kvs_block_pool *p, int32_t b) {
    block_meta *m = &p->meta[b];
    m->lru_prev = p->lru_tail, m->lru_next = -1;
    if (p->lru_tail >= 0) p->meta[p->lru_tail].lru_next = b;
    else p->lru_head = b;
    p->lru_tail = b;
    p->n_evictable++;
}

static void lru_remove(kvs_block_pool *p, int32_t b) {
    block_meta *m = &p->meta[b];
    if (m->lru_prev >= 0) p->meta[m->lru_prev].lru_next = m->lru_next;
    else p->lru_head = m->lru_next;
    if (m->lru_next >= 0) p->meta[m->lru_next].lru_prev = m->lru_prev;
    else p->lru_tail = m->lru_prev;
    p->n_evictable--;
}

/* ---- the cached blocks by key ------------------------------------------------------ */
/* The key of prompt block hash in a layer: never 0 (0 is "not cached"). */
static uint64_t layer_key(uint64_t hash, int layer) {
    return kvs_sample_mix64(hash ^ ((uint64_t)(layer + 1) * 0x9e3779b97f4a7c15ull)) | 1;
}

static int32_t *bucket_of(const kvs_block_pool *p, uint64_t key) {
    return &p->buckets[key & (uint64_t)(p->n_buckets - 1)];
}

/* Whether some block is cached as prompt block hash of layer (whatever its parent). */
static bool layer_has(const kvs_block_pool *p, uint64_t hash, int layer) {
    uint64_t key = layer_key(hash, layer);
    for (int32_t b = *bucket_of(p, key); b >= 0; b = p->meta[b].hnext)
        if (p->meta[b].key == key) return true;
    return false;
}

/* Whether every layer but `except` has prompt block hash cached; the layers
 * after `except` first: while a prompt is cached layer by layer they are the
 * ones missing, so the common answer costs one look. */
static bool others_have(const kvs_block_pool *p, uint64_t hash, int except) {
    for (int i = 1; i < p->n_layers; i++)
        if (!layer_has(p, hash, (except + i) % p->n_layers)) return false;
    return true;
}

bool kvs_block_reusable(const kvs_block_pool *p, uint64_t hash) {
    return p->buckets && layer_has(p, hash, 0) && others_have(p, hash, 0);
}

/* ---- KV events --------------------------------------------------------------------- */
static void log_event(kvs_block_pool *p, kvs_kv_event e, const int32_t *tokens) {
    kvs_kv_event_log *g = p->events;
    if (g->lost) return; /* the subscribers are told to forget everything anyway */
    int bs = p->block_size;
    int cap = kvs_grown_capacity(g->cap, g->n + 1, 64);
    if (cap != g->cap) {
        kvs_kv_event *grown = realloc(g->events, sizeof *grown * (size_t)cap);
        if (!grown) return (void)(g->lost = true);
        g->events = grown, g->cap = cap;
    }
    cap = tokens ? kvs_grown_capacity(g->cap_tokens, g->n_tokens + bs, 64 * bs) : g->cap_tokens;
    if (cap != g->cap_tokens) {
        int32_t *grown = realloc(g->tokens, sizeof *grown * (size_t)cap);
        if (!grown) return (void)(g->lost = true);
        g->tokens = grown, g->cap_tokens = cap;
    }
    if (tokens) {
        e.token0 = g->n_tokens;
        memcpy(g->tokens + g->n_tokens, tokens, sizeof(int32_t) * (size_t)bs);
        g->n_tokens += bs;
    }
    g->events[g->n++] = e;
}

static void uncache(kvs_block_pool *p, int32_t b) {
    block_meta *m = &p->meta[b];
    int32_t *at = bucket_of(p, m->key);
    while (*at != b) at = &p->meta[*at].hnext;
    *at = m->hnext;
    p->cached_per_layer[m->layer]--;
    m->key = 0;
    /* the last copy of a reusable block's layer: it is reusable no more */
    if (p->events && !layer_has(p, m->hash, m->layer) && others_have(p, m->hash, m->layer)) {
        p->n_reusable--;
        log_event(p, (kvs_kv_event){.kind = KVS_KV_EVENT_REMOVED, .hash = m->hash}, NULL);
    }
}

/* ---- holders ----------------------------------------------------------------------- */
int32_t kvs_block_take(kvs_block_pool *p) {
    int32_t b;
    if (p->n_free > 0) {
        b = p->free_blocks[--p->n_free];
    } else if (p->lru_head >= 0) { /* evict the least recently used cached block */
        b = p->lru_head;
        lru_remove(p, b);
        uncache(p, b);
        p->evictions++;
    } else {
        return -1;
    }
    p->meta[b].ref = 1;
    return b;
}

void kvs_block_hold(kvs_block_pool *p, int32_t b) {
    if (p->meta[b].ref++ == 0) lru_remove(p, b); /* a block with no holder is evictable (cached) */
}

void kvs_block_drop(kvs_block_pool *p, int32_t b) {
    if (--p->meta[b].ref > 0) return;
    if (p->meta[b].key) lru_push_back(p, b);
    else p->free_blocks[p->n_free++] = b;
}

int32_t kvs_block_lookup(const kvs_block_pool *p, uint64_t hash, int layer, uint64_t salt_check, int32_t parent,
                         const int32_t *tokens) {
    size_t bytes = sizeof(int32_t) * p->block_size;
    uint64_t key = layer_key(hash, layer);
    for (int32_t b = *bucket_of(p, key); b >= 0; b = p->meta[b].hnext) {
        const block_meta *m = &p->meta[b];
        if (m->key == key && m->salt_check == salt_check && m->parent == parent &&
            (parent < 0 || m->parent_gen == p->meta[parent].gen) &&
            !memcmp(p->tokens + (size_t)b * p->block_size, tokens, bytes))
            return b;
    }
    return -1;
}

void kvs_block_cache(kvs_block_pool *p, int32_t b, uint64_t hash, uint64_t salt_check, int32_t parent, int layer,
                     const int32_t *tokens) {
    block_meta *m = &p->meta[b];
    uint64_t key = layer_key(hash, layer);
    /* the layer's first copy of a block the others have: it becomes reusable */
    if (p->events && !layer_has(p, hash, layer) && others_have(p, hash, layer)) {
        p->n_reusable++;
        log_event(p, (kvs_kv_event){.kind = KVS_KV_EVENT_STORED, .hash = hash, .has_parent = parent >= 0,
                                    .parent_hash = parent >= 0 ? p->meta[parent].hash : 0}, tokens);
    }
    *m = (block_meta){.ref = m->ref, .key = key, .hash = hash, .salt_check = salt_check, .gen = m->gen + 1, .parent = parent,
                      .parent_gen = parent >= 0 ? p->meta[parent].gen : 0, .layer = layer,
                      .hnext = *bucket_of(p, key), .lru_prev = -1, .lru_next = -1};
    *bucket_of(p, key) = b;
    memcpy(p->tokens + (size_t)b * p->block_size, tokens, sizeof(int32_t) * p->block_size);
    p->cached_per_layer[layer]++;
}

void kvs_block_uncache_all(kvs_block_pool *p) {
    kvs_kv_event_log *events = p->events;
    p->events = NULL; /* one event says it all */
    for (int64_t b = 0; b < p->n_blocks; b++) {
        if (!p->meta[b].key) continue;
        if (!p->meta[b].ref) { /* evictable: free now */
            lru_remove(p, (int32_t)b);
            p->free_blocks[p->n_free++] = (int32_t)b;
        }
        uncache(p, (int32_t)b);
    }
    p->events = events;
    p->n_reusable = 0;
    if (events) log_event(p, (kvs_kv_event){.kind = KVS_KV_EVENT_CLEARED}, NULL);
}

/* Every block in one state; a held block's ref its holders; every cached
 * block found under its key, and only there. */
kvs_status kvs_block_pool_check(const kvs_block_pool *p, const int32_t *holders) {
    int64_t n = p->n_blocks;
    uint8_t *state = calloc((size_t)n, 1); /* 1 free, 2 evictable */
    if (!state) return kvs_fail(KVS_ERR_NOMEM, "kv check: out of memory");
    kvs_status st = KVS_OK;
#define KV_BAD(...) (st = kvs_fail(KVS_ERR_INTERNAL, __VA_ARGS__))
    for (int64_t i = 0; i < p->n_free && st == KVS_OK; i++) {
        int32_t b = p->free_blocks[i];
        if (b < 0 || b >= n || state[b]) KV_BAD("kv check: free block %d twice", b);
        else if (p->meta[b].ref || p->meta[b].key) KV_BAD("kv check: free block %d is held or cached", b);
        else state[b] = 1;
    }
    int64_t on_list = 0;
    for (int32_t b = p->lru_head, prev = -1; b >= 0 && st == KVS_OK; prev = b, b = p->meta[b].lru_next, on_list++) {
        if (state[b] || p->meta[b].lru_prev != prev) KV_BAD("kv check: evictable list broken at block %d", b);
        else if (p->meta[b].ref || !p->meta[b].key) KV_BAD("kv check: evictable block %d is held or not cached", b);
        else state[b] = 2;
    }
    if (st == KVS_OK && on_list != p->n_evictable)
        KV_BAD("kv check: %lld evictable blocks listed, %lld counted", (long long)on_list, (long long)p->n_evictable);
    int64_t cached = 0, per_layer = 0;
    for (int l = 0; l < p->n_layers; l++) per_layer += p->cached_per_layer[l];
    for (int64_t b = 0; b < n && st == KVS_OK; b++) {
        if (holders[b] && state[b]) KV_BAD("kv check: block %lld is held and %s", (long long)b, state[b] == 1 ? "free" : "evictable");
        else if (state[b] == 0 && holders[b] == 0) KV_BAD("kv check: block %lld leaked", (long long)b);
        else if (holders[b] != p->meta[b].ref)
            KV_BAD("kv check: block %lld has %d holders, ref %d", (long long)b, holders[b], p->meta[b].ref);
        cached += p->meta[b].key != 0;
        /* a cached block's parent is cached (the one it was cached under): a lookup can reach it */
        int32_t parent = p->meta[b].parent;
        if (p->meta[b].key && parent >= 0 && (!p->meta[parent].key || p->meta[parent].gen != p->meta[b].parent_gen))
            KV_BAD("kv check: cached block %lld outlived its parent %d", (long long)b, parent);
    }
    if (st == KVS_OK && cached != per_layer)
        KV_BAD("kv check: %lld cached blocks, %lld counted per layer", (long long)cached, (long long)per_layer);
    for (int64_t k = 0; k < p->n_buckets && st == KVS_OK; k++)
        for (int32_t b = p->buckets[k]; b >= 0 && st == KVS_OK; b = p->meta[b].hnext) {
            if (!p->meta[b].key || (p->meta[b].key & (uint64_t)(p->n_buckets - 1)) != (uint64_t)k)
                KV_BAD("kv check: block %d in the wrong bucket", b);
            cached--;
        }
    if (st == KVS_OK && cached != 0) KV_BAD("kv check: %lld cached blocks not under their key", (long long)cached);
#undef KV_BAD
    free(state);
    return st;
}
