/* Block ownership and the prefix cache: reference counts, the cached prompt
 * blocks by key, the evictable ones least recently used first, and a new
 * sequence's longest cached prefix (docs/SPARSITY.md, "Prefix caching"). */
#include <stdlib.h>
#include <string.h>

#include "backend/sample.h" /* kvs_sample_mix64 */
#include "kv/kv_internal.h"

static uint64_t hash_block(uint64_t parent_hash, const int32_t *tokens, int n) {
    uint64_t h = kvs_sample_mix64(parent_hash ^ 0x243f6a8885a308d3ull);
    for (int i = 0; i < n; i++) h = kvs_sample_mix64(h ^ ((uint64_t)(uint32_t)tokens[i] + 0x9e3779b97f4a7c15ull));
    return h;
}

static uint64_t hash_salt(const char *salt, uint64_t basis) { /* FNV-1a, then mixed */
    uint64_t h = basis;
    for (const unsigned char *c = (const unsigned char *)(salt ? salt : ""); *c; c++) h = (h ^ *c) * 0x100000001b3ull;
    return kvs_sample_mix64(h ^ (salt ? 1 : 0));
}

/* The key of prompt block hash h in a layer: never 0 (0 is "not cached"). */
static uint64_t layer_key(uint64_t h, int layer) {
    return kvs_sample_mix64(h ^ ((uint64_t)(layer + 1) * 0x9e3779b97f4a7c15ull)) | 1;
}

kvs_status kvs_kv_meta_create(kvs_kv_cache *kv) {
    int64_t n = kv->cfg.n_blocks;
    kv->meta = calloc((size_t)n, sizeof(block_meta));
    kv->cached_per_layer = calloc((size_t)kv->cfg.n_layers, sizeof(int64_t));
    if (!kv->meta || !kv->cached_per_layer) return kvs_fail(KVS_ERR_NOMEM, "kv cache: out of memory");
    kv->lru_head = kv->lru_tail = -1;
    kv->hash_block = hash_block;
    if (!kv->cfg.prefix_caching) return KVS_OK;
    kv->n_buckets = 1;
    while (kv->n_buckets < n) kv->n_buckets *= 2;
    kv->buckets = malloc(sizeof(int32_t) * (size_t)kv->n_buckets);
    kv->tokens = malloc(sizeof(int32_t) * (size_t)n * kv->cfg.block_size);
    if (!kv->buckets || !kv->tokens) return kvs_fail(KVS_ERR_NOMEM, "kv cache: out of memory for the prefix cache");
    memset(kv->buckets, 0xff, sizeof(int32_t) * (size_t)kv->n_buckets);
    return KVS_OK;
}

void kvs_kv_meta_destroy(kvs_kv_cache *kv) {
    free(kv->meta);
    free(kv->cached_per_layer);
    free(kv->buckets);
    free(kv->tokens);
}

/* ---- the evictable list ---------------------------------------------------------- */
static void lru_push_back(kvs_kv_cache *kv, int32_t b) {
    block_meta *m = &kv->meta[b];
    m->lru_prev = kv->lru_tail, m->lru_next = -1;
    if (kv->lru_tail >= 0) kv->meta[kv->lru_tail].lru_next = b;
    else kv->lru_head = b;
    kv->lru_tail = b;
    kv->n_evictable++;
}

static void lru_remove(kvs_kv_cache *kv, int32_t b) {
    block_meta *m = &kv->meta[b];
    if (m->lru_prev >= 0) kv->meta[m->lru_prev].lru_next = m->lru_next;
    else kv->lru_head = m->lru_next;
    if (m->lru_next >= 0) kv->meta[m->lru_next].lru_prev = m->lru_prev;
    else kv->lru_tail = m->lru_prev;
    kv->n_evictable--;
}

/* ---- the cached blocks by key ------------------------------------------------------ */
static int32_t *bucket_of(kvs_kv_cache *kv, uint64_t key) { return &kv->buckets[key & (uint64_t)(kv->n_buckets - 1)]; }

static void uncache(kvs_kv_cache *kv, int32_t b) {
    block_meta *m = &kv->meta[b];
    int32_t *p = bucket_of(kv, m->key);
    while (*p != b) p = &kv->meta[*p].hnext;
    *p = m->hnext;
    kv->cached_per_layer[m->layer]--;
    m->key = 0;
}

int32_t kvs_kv_take_block(kvs_kv_cache *kv) {
    int32_t b;
    if (kv->n_free > 0) {
        b = kv->free_blocks[--kv->n_free];
    } else if (kv->lru_head >= 0) { /* evict the least recently used cached block */
        b = kv->lru_head;
        lru_remove(kv, b);
        uncache(kv, b);
        kv->evictions++;
    } else {
        return -1;
    }
    kv->meta[b].ref = 1;
    return b;
}

void kvs_kv_drop_block(kvs_kv_cache *kv, int32_t b) {
    if (--kv->meta[b].ref > 0) return;
    if (kv->meta[b].key) lru_push_back(kv, b);
    else kv->free_blocks[kv->n_free++] = b;
}

bool kvs_kv_table_shared(const kvs_kv_cache *kv, const layer_table *t) {
    for (int i = 0; i < t->n_blocks; i++)
        if (kv->meta[t->blocks[i]].ref > 1 || kv->meta[t->blocks[i]].key) return true;
    return false;
}

void kvs_kv_free_prefix(kvs_kv_cache *kv, seq_state *s) {
    for (int i = s->n_spare - 1; i >= 0; i--) kvs_kv_drop_block(kv, s->spare[i]);
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
    uint64_t key = layer_key(h, l);
    size_t bytes = sizeof(int32_t) * kv->cfg.block_size;
    for (int32_t b = kv->buckets[key & (uint64_t)(kv->n_buckets - 1)]; b >= 0; b = kv->meta[b].hnext) {
        const block_meta *m = &kv->meta[b];
        if (m->key == key && m->salt_check == salt_check && m->parent == parent &&
            (parent < 0 || m->parent_gen == kv->meta[parent].gen) &&
            !memcmp(kv->tokens + (size_t)b * kv->cfg.block_size, tokens, bytes))
            return b;
    }
    return -1;
}

void kvs_kv_register_prompt(kvs_kv_cache *kv, seq_state *s) {
    int bs = kv->cfg.block_size, full = s->n_tokens / bs;
    if (full > s->n_prompt_blocks) full = s->n_prompt_blocks;
    for (; s->n_registered < full; s->n_registered++) {
        int i = s->n_registered;
        for (int l = 0; l < kv->cfg.n_layers; l++) {
            const layer_table *t = &s->layers[l];
            int32_t b = t->blocks[i], parent = i > 0 ? t->blocks[i - 1] : -1;
            uint64_t key = layer_key(s->prompt_hash[i], l);
            const int32_t *tokens = s->prompt_tokens + (size_t)i * bs;
            /* a reused block is cached already; the same block that another
               sequence cached first stays this sequence's own */
            if (kv->meta[b].key || lookup(kv, s->prompt_hash[i], l, tokens, s->salt_check, parent) >= 0) continue;
            block_meta *m = &kv->meta[b];
            *m = (block_meta){.ref = m->ref, .key = key, .salt_check = s->salt_check, .gen = m->gen + 1,
                              .parent = parent, .parent_gen = parent >= 0 ? kv->meta[parent].gen : 0, .layer = l,
                              .hnext = *bucket_of(kv, key), .lru_prev = -1, .lru_next = -1};
            *bucket_of(kv, key) = b;
            memcpy(kv->tokens + (size_t)b * bs, tokens, sizeof(int32_t) * bs);
            kv->cached_per_layer[l]++;
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
            if (kv->meta[b].ref++ == 0) lru_remove(kv, b);
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
        for (int i = 0; i < t->n_blocks; i++) blocks += 1.0 / kv->meta[t->blocks[i]].ref;
    }
    return blocks;
}

int64_t kvs_kv_cached_blocks(const kvs_kv_cache *kv, int layer) {
    return layer >= 0 && layer < kv->cfg.n_layers ? kv->cached_per_layer[layer] : 0;
}
int64_t kvs_kv_evictable_blocks(const kvs_kv_cache *kv) { return kv->n_evictable; }
uint64_t kvs_kv_evictions(const kvs_kv_cache *kv) { return kv->evictions; }

/* Every block in one state; a held block's ref counts its holders; every
 * cached block is found under its key, and only there. */
kvs_status kvs_kv_check(const kvs_kv_cache *kv) {
    int64_t n = kv->cfg.n_blocks;
    int32_t *holders = calloc((size_t)n, sizeof(int32_t));
    uint8_t *state = calloc((size_t)n, 1); /* 1 free, 2 evictable, 3 found under its key */
    if (!holders || !state) {
        free(holders), free(state);
        return kvs_fail(KVS_ERR_NOMEM, "kv check: out of memory");
    }
    kvs_status st = KVS_OK;
#define KV_BAD(...) (st = kvs_fail(KVS_ERR_INTERNAL, __VA_ARGS__))
    for (int64_t i = 0; i < kv->n_free && st == KVS_OK; i++) {
        int32_t b = kv->free_blocks[i];
        if (b < 0 || b >= n || state[b]) KV_BAD("kv check: free block %d twice", b);
        else if (kv->meta[b].ref || kv->meta[b].key) KV_BAD("kv check: free block %d is held or cached", b);
        else state[b] = 1;
    }
    int64_t on_list = 0;
    for (int32_t b = kv->lru_head, prev = -1; b >= 0 && st == KVS_OK; prev = b, b = kv->meta[b].lru_next, on_list++) {
        if (state[b] || kv->meta[b].lru_prev != prev) KV_BAD("kv check: evictable list broken at block %d", b);
        else if (kv->meta[b].ref || !kv->meta[b].key) KV_BAD("kv check: evictable block %d is held or not cached", b);
        else state[b] = 2;
    }
    if (st == KVS_OK && on_list != kv->n_evictable)
        KV_BAD("kv check: %lld evictable blocks listed, %lld counted", (long long)on_list, (long long)kv->n_evictable);
    for (int s = 0; s < kv->cfg.max_seqs && st == KVS_OK; s++) {
        const seq_state *q = &kv->seqs[s];
        if (!q->used) continue;
        for (int l = 0; l < kv->cfg.n_layers && st == KVS_OK; l++) {
            const layer_table *t = &q->layers[l];
            if (t->n_blocks < kvs_kv_blocks_for(kv, t->len))
                KV_BAD("kv check: seq %d layer %d holds %d entries in %d blocks", s, l, t->len, t->n_blocks);
            for (int i = 0; i < t->n_blocks && st == KVS_OK; i++) {
                int32_t b = t->blocks[i];
                if (b < 0 || b >= n || state[b] == 1 || state[b] == 2)
                    KV_BAD("kv check: block %d of seq %d layer %d is free or evictable", b, s, l);
                else holders[b]++;
            }
        }
        for (int i = 0; i < q->n_spare && st == KVS_OK; i++) holders[q->spare[i]]++;
    }
    int64_t cached = 0, per_layer = 0;
    for (int l = 0; l < kv->cfg.n_layers; l++) per_layer += kv->cached_per_layer[l];
    for (int64_t b = 0; b < n && st == KVS_OK; b++) {
        if (state[b] == 0 && holders[b] == 0) KV_BAD("kv check: block %lld leaked", (long long)b);
        else if (holders[b] != kv->meta[b].ref)
            KV_BAD("kv check: block %lld has %d holders, ref %d", (long long)b, holders[b], kv->meta[b].ref);
        cached += kv->meta[b].key != 0;
    }
    if (st == KVS_OK && cached != per_layer)
        KV_BAD("kv check: %lld cached blocks, %lld counted per layer", (long long)cached, (long long)per_layer);
    for (int64_t k = 0; k < kv->n_buckets && st == KVS_OK; k++)
        for (int32_t b = kv->buckets[k]; b >= 0 && st == KVS_OK; b = kv->meta[b].hnext) {
            if (!kv->meta[b].key || (kv->meta[b].key & (uint64_t)(kv->n_buckets - 1)) != (uint64_t)k)
                KV_BAD("kv check: block %d in the wrong bucket", b);
            cached--;
        }
    if (st == KVS_OK && cached != 0) KV_BAD("kv check: %lld cached blocks not under their key", (long long)cached);
#undef KV_BAD
    free(holders);
    free(state);
    return st;
}
