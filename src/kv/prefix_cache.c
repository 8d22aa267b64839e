/* The prefix cache: a sequence's full prompt blocks cached as every layer
 * commits them (keyed by a chain hash of the salt and the prompt, per layer),
 * and a new sequence's longest cached prefix attached to its tables
 * (docs/SPARSITY.md, "Prefix caching"); the blocks' states are block_pool.c's. */
#include <stdlib.h>
#include <string.h>

#include "backend/sample.h" /* kvs_sample_mix64 */
#include "kv/kv_internal.h"

uint64_t kvs_kv_hash_block(uint64_t parent_hash, const int32_t *tokens, int n) {
    uint64_t h = kvs_sample_mix64(parent_hash ^ 0x243f6a8885a308d3ull);
    for (int i = 0; i < n; i++) h = kvs_sample_mix64(h ^ ((uint64_t)(uint32_t)tokens[i] + 0x9e3779b97f4a7c15ull));
    return h;
}

static uint64_t hash_salt(const char *salt, uint64_t basis) { /* FNV-1a, then mixed */
    uint64_t h = basis;
    for (const unsigned char *c = (const unsigned char *)(salt ? salt : ""); *c; c++) h = (h ^ *c) * 0x100000001b3ull;
    return kvs_sample_mix64(h ^ (salt ? 1 : 0));
}

bool kvs_kv_table_shared(const kvs_kv_cache *kv, const layer_table *t) {
    for (int i = 0; i < t->n_blocks; i++)
        if (kvs_block_refs(&kv->blocks, t->blocks[i]) > 1 || kvs_block_cached(&kv->blocks, t->blocks[i])) return true;
    return false;
}

void kvs_kv_free_prefix(kvs_kv_cache *kv, seq_state *s) {
    for (int i = s->n_spare - 1; i >= 0; i--) kvs_block_drop(&kv->blocks, s->spare[i]);
    free(s->spare);
    free(s->prompt_hash);
    free(s->prompt_tokens);
    s->spare = NULL, s->prompt_hash = NULL, s->prompt_tokens = NULL;
    s->n_spare = s->n_prompt_blocks = s->n_registered = 0;
}

/* ---- caching a sequence's prompt, finding a cached prefix ------------------------- */
/* The cached block of prompt block i (tokens, hash h) in layer l whose parent
 * is the given block: -1 when none verifies. */
static int32_t lookup(const kvs_kv_cache *kv, uint64_t h, int l, const int32_t *tokens, uint64_t salt_check,
                      int32_t parent) {
    return kvs_block_lookup(&kv->blocks, h, l, salt_check, parent, tokens);
}

void kvs_kv_register_prompt(kvs_kv_cache *kv, seq_state *s) {
    int bs = kv->cfg.block_size, full = s->n_tokens / bs;
    if (full > s->n_prompt_blocks) full = s->n_prompt_blocks;
    for (; s->n_registered < full; s->n_registered++) {
        int i = s->n_registered;
        for (int l = 0; l < kv->cfg.n_layers; l++) {
            layer_table *t = &s->layers[l];
            int32_t b = t->blocks[i], parent = i > 0 ? t->blocks[i - 1] : -1, found;
            const int32_t *tokens = s->prompt_tokens + (size_t)i * bs;
            if (kvs_block_cached(&kv->blocks, b)) continue; /* reused: cached already */
            if (parent >= 0 && !kvs_block_cached(&kv->blocks, parent)) continue; /* a reset: no lookup reaches it */
            if ((found = lookup(kv, s->prompt_hash[i], l, tokens, s->salt_check, parent)) < 0) {
                kvs_block_cache(&kv->blocks, b, s->prompt_hash[i], s->salt_check, parent, l, tokens);
                continue;
            }
            /* another sequence computed and cached the same block first: the
               table takes its copy (the same KV) and frees its own, so that
               whoever holds a cached block holds its parent too. A parent
               then outlives its children in the LRU order, and a block
               announced reusable is reachable by a lookup. */
            kvs_block_hold(&kv->blocks, found);
            kvs_block_drop(&kv->blocks, b);
            t->blocks[i] = found;
            kvs_kv_touch_from(t, i);
        }
    }
}

int kvs_kv_prefix_attach(kvs_kv_cache *kv, int seq_id, const int32_t *prompt, int n_prompt, const char *salt,
                         int max_tokens) {
    seq_state *s = kvs_kv_get_seq(kv, seq_id);
    int bs = kv->cfg.block_size, L = kv->cfg.n_layers, nb = n_prompt / bs;
    if (!kv->cfg.prefix_caching || !s || s->n_tokens > 0 || s->prompt_hash || nb == 0) return 0;
    s->prompt_hash = malloc(sizeof(uint64_t) * nb);
    s->prompt_tokens = malloc(sizeof(int32_t) * (size_t)nb * bs);
    int32_t *found = malloc(sizeof(int32_t) * (size_t)nb * L);
    bool ok = s->prompt_hash && s->prompt_tokens && found;
    for (int l = 0; ok && l < L; l++) { /* room in the tables for the whole prompt */
        layer_table *t = &s->layers[l];
        if (t->cap >= nb) continue;
        int32_t *grown = realloc(t->blocks, sizeof(int32_t) * nb);
        if (grown) t->blocks = grown, t->cap = nb;
        ok = grown != NULL;
    }
    if (!ok) { /* no caching for this prompt; nothing changed */
        free(found);
        kvs_kv_free_prefix(kv, s);
        return 0;
    }
    memcpy(s->prompt_tokens, prompt, sizeof(int32_t) * (size_t)nb * bs);
    s->n_prompt_blocks = nb;
    s->salt_check = hash_salt(salt, 0x6a09e667f3bcc909ull);
    uint64_t h = hash_salt(salt, 0xcbf29ce484222325ull);
    int hit = 0, max_blocks = max_tokens > 0 ? max_tokens / bs : 0;
    for (int i = 0; i < nb; i++) {
        h = s->prompt_hash[i] = kv->hash_block(h, prompt + (size_t)i * bs, bs);
        if (hit < i || i >= max_blocks) continue; /* the hashes of the rest, for caching them later */
        bool all = true;
        for (int l = 0; all && l < L; l++)
            all = (found[(size_t)i * L + l] = lookup(kv, h, l, prompt + (size_t)i * bs, s->salt_check,
                                                     i ? found[(size_t)(i - 1) * L + l] : -1)) >= 0;
        if (all) hit = i + 1;
    }
    for (int l = 0; l < L; l++) { /* the hit blocks join the tables as committed tokens */
        layer_table *t = &s->layers[l];
        for (int i = 0; i < hit; i++) {
            int32_t b = found[(size_t)i * L + l];
            kvs_block_hold(&kv->blocks, b);
            t->blocks[t->n_blocks++] = b;
        }
        if (hit) kvs_kv_touch(t);
        t->len = hit * bs;
    }
    free(found);
    s->n_tokens = hit * bs;
    s->n_registered = hit;
    return hit * bs;
}

double kvs_kv_seq_sparse_blocks(const kvs_kv_cache *kv, int seq_id) {
    const seq_state *s = kvs_kv_get_seq(kv, seq_id);
    if (!s || !s->budgets) return 0;
    double blocks = s->n_spare;
    for (int l = 0; l < kv->cfg.n_layers; l++) {
        const layer_table *t = &s->layers[l];
        if (s->budgets[l] < 0) continue;
        if (s->prefill_done && s->budgets[l] < s->prompt_len) { /* compacted: its own blocks */
            blocks += t->n_blocks;
            continue;
        }
        for (int i = 0; i < t->n_blocks; i++) blocks += 1.0 / kvs_block_refs(&kv->blocks, t->blocks[i]);
    }
    return blocks;
}

int64_t kvs_kv_cached_blocks(const kvs_kv_cache *kv, int layer) {
    return layer >= 0 && layer < kv->cfg.n_layers ? kv->blocks.cached_per_layer[layer] : 0;
}
int64_t kvs_kv_evictable_blocks(const kvs_kv_cache *kv) { return kv->blocks.n_evictable; }
uint64_t kvs_kv_evictions(const kvs_kv_cache *kv) { return kv->blocks.evictions; }

/* The tables' holders of each block (every table's blocks in range, its
 * entries within them), then the pool's invariants with those holders. */
kvs_status kvs_kv_check(const kvs_kv_cache *kv) {
    int64_t n = kv->cfg.n_blocks;
    int32_t *holders = calloc((size_t)n, sizeof(int32_t));
    if (!holders) return kvs_fail(KVS_ERR_NOMEM, "kv check: out of memory");
    kvs_status st = KVS_OK;
    for (int s = 0; s < kv->cfg.max_seqs && st == KVS_OK; s++) {
        const seq_state *q = &kv->seqs[s];
        if (!q->used) continue;
        for (int l = 0; l < kv->cfg.n_layers && st == KVS_OK; l++) {
            const layer_table *t = &q->layers[l];
            if (t->n_blocks < kvs_kv_blocks_for(kv, t->len))
                st = kvs_fail(KVS_ERR_INTERNAL, "kv check: seq %d layer %d holds %d entries in %d blocks", s, l,
                              t->len, t->n_blocks);
            for (int i = 0; i < t->n_blocks && st == KVS_OK; i++) {
                int32_t b = t->blocks[i];
                if (b < 0 || b >= n) st = kvs_fail(KVS_ERR_INTERNAL, "kv check: seq %d layer %d holds block %d", s, l, b);
                else holders[b]++;
            }
        }
        for (int i = 0; i < q->n_spare && st == KVS_OK; i++) holders[q->spare[i]]++;
    }
    if (st == KVS_OK) st = kvs_block_pool_check(&kv->blocks, holders);
    free(holders);
    return st;
}

/* ---- KV events (kv.h) ----------------------------------------------------------- */
kvs_status kvs_kv_enable_events(kvs_kv_cache *kv) {
    if (kv->blocks.events) return KVS_OK;
    kv->blocks.events = calloc(1, sizeof *kv->blocks.events);
    if (!kv->blocks.events) return kvs_fail(KVS_ERR_NOMEM, "kv events: out of memory");
    kv->blocks.events->block_size = kv->cfg.block_size;
    return KVS_OK;
}

void kvs_kv_take_events(kvs_kv_cache *kv, kvs_kv_event_log *out) {
    kvs_kv_event_log *g = kv->blocks.events, t;
    out->n = 0, out->n_tokens = 0, out->lost = false;
    if (!g) return;
    t = *g, *g = *out, *out = t;
    out->block_size = g->block_size = kv->cfg.block_size;
}

void kvs_kv_event_log_free(kvs_kv_event_log *log) {
    if (!log) return;
    free(log->events);
    free(log->tokens);
    *log = (kvs_kv_event_log){0};
}

void kvs_kv_reset_prefix_cache(kvs_kv_cache *kv) {
    if (kv->blocks.buckets) kvs_block_uncache_all(&kv->blocks);
}

int64_t kvs_kv_reusable_count(const kvs_kv_cache *kv) { return kv->blocks.n_reusable; }

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

kvs_status kvs_kv_reusable_blocks(const kvs_kv_cache *kv, uint64_t **hashes, int64_t *n) {
    const kvs_block_pool *p = &kv->blocks;
    *hashes = NULL, *n = 0;
    int64_t cap = p->n_layers > 0 ? p->cached_per_layer[0] : 0;
    if (!p->buckets || cap == 0) return KVS_OK;
    uint64_t *h = malloc(sizeof *h * (size_t)cap);
    if (!h) return kvs_fail(KVS_ERR_NOMEM, "kv: out of memory");
    int64_t k = 0;
    for (int64_t b = 0; b < p->n_blocks; b++) /* layer 0's copies, each hash once */
        if (p->meta[b].key && p->meta[b].layer == 0 && kvs_block_reusable(p, p->meta[b].hash)) h[k++] = p->meta[b].hash;
    qsort(h, (size_t)k, sizeof *h, cmp_u64);
    int64_t u = 0;
    for (int64_t i = 0; i < k; i++)
        if (u == 0 || h[u - 1] != h[i]) h[u++] = h[i];
    if (u == 0) free(h), h = NULL;
    *hashes = h, *n = u;
    return KVS_OK;
}
