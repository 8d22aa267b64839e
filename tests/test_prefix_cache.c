/* The KV module's prefix cache: hits, exact verification (forced hash
 * collisions), salts, eviction order, compaction of shared layers, forks, and
 * the ownership invariant under 10,000 random operations. CPU backend. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "kv/kv.h"
#include "kv/kv_internal.h" /* forcing hash collisions, reading reference counts */
#include "testutil.h"

static kvs_backend *be;
static void setup(void) { cr_assert_eq(kvs_backend_cpu_create(1, &be), KVS_OK); }
static void teardown(void) { be->destroy(be); }
TestSuite(prefix_cache, .init = setup, .fini = teardown);

enum { L = 3, BS = 16 };

static kvs_kv_cache *cache(int64_t n_blocks, int max_seqs) {
    kvs_kv_config kc = {.n_layers = L, .n_kv_heads = 2, .head_dim = 8, .n_heads = 4, .block_size = BS,
                        .n_blocks = n_blocks, .max_seqs = max_seqs, .max_window = 8, .prefix_caching = true};
    kvs_kv_cache *kv;
    cr_assert_eq(kvs_kv_create(&kc, be, &kv), KVS_OK, "%s", kvs_last_error());
    return kv;
}

static void check(const kvs_kv_cache *kv) { cr_assert_eq(kvs_kv_check(kv), KVS_OK, "%s", kvs_last_error()); }

/* A new sequence for prompt (its cached prefix attached), then the rest of
 * the prompt "prefilled" (reserved and committed). Returns the hit tokens. */
static int start(kvs_kv_cache *kv, int *seq, const int32_t *prompt, int n, const char *salt) {
    *seq = kvs_kv_seq_create(kv);
    cr_assert(*seq >= 0);
    int hit = kvs_kv_prefix_attach(kv, *seq, prompt, n, salt, n - 1);
    cr_assert_eq(kvs_kv_len(kv, *seq, 0), hit);
    cr_assert_eq(kvs_kv_reserve(kv, *seq, n - hit), KVS_OK, "%s", kvs_last_error());
    kvs_kv_commit(kv, *seq, n - hit);
    check(kv);
    return hit;
}

static int32_t *tokens(int n, int32_t base) {
    int32_t *t = malloc(sizeof(int32_t) * n);
    for (int i = 0; i < n; i++) t[i] = base + i;
    return t;
}

Test(prefix_cache, a_shared_prefix_reuses_whole_blocks_in_every_layer) {
    kvs_kv_cache *kv = cache(200, 4);
    int32_t *a = tokens(100, 1000), *b = tokens(120, 1000);
    for (int i = 85; i < 120; i++) b[i] = 7; /* 85 tokens in common: 5 whole blocks */
    int sa, sb;
    cr_expect_eq(start(kv, &sa, a, 100, NULL), 0, "nothing cached yet");
    cr_expect_eq(kvs_kv_cached_blocks(kv, 0), 6, "6 full prompt blocks of 100 tokens cached");
    cr_expect_eq(start(kv, &sb, b, 120, NULL), 80);
    for (int l = 0; l < L; l++) {
        int na, nb;
        const int32_t *ta = kvs_kv_blocks(kv, sa, l, &na), *tb = kvs_kv_blocks(kv, sb, l, &nb);
        for (int i = 0; i < 5; i++) {
            cr_expect_eq(tb[i], ta[i], "layer %d block %d: the same physical block", l, i);
            cr_expect_eq(kvs_block_refs(&kv->blocks, ta[i]), 2);
        }
        cr_expect_neq(tb[5], ta[5], "layer %d: the sixth block differs", l);
    }
    /* a request may not take the whole prompt: at most max_tokens, whole blocks */
    int sc = kvs_kv_seq_create(kv);
    cr_expect_eq(kvs_kv_prefix_attach(kv, sc, a, 100, NULL, 40), 32);
    kvs_kv_free(kv, sc);
    kvs_kv_free(kv, sb); /* finished, aborted or preempted alike: its references go */
    for (int l = 0; l < L; l++) {
        int na;
        const int32_t *ta = kvs_kv_blocks(kv, sa, l, &na);
        for (int i = 0; i < 5; i++) cr_expect_eq(kvs_block_refs(&kv->blocks, ta[i]), 1, "layer %d block %d: a's alone again", l, i);
    }
    kvs_kv_free(kv, sa);
    check(kv);
    cr_expect_eq(kvs_kv_free_blocks(kv), 200, "cached blocks count as free");
    cr_expect(kvs_kv_evictable_blocks(kv) > 0);
    /* without the cache nothing is reused */
    kvs_kv_config kc = *kvs_kv_get_config(kv);
    kc.prefix_caching = false;
    kvs_kv_cache *plain;
    cr_assert_eq(kvs_kv_create(&kc, be, &plain), KVS_OK);
    cr_expect_eq(start(plain, &sa, a, 100, NULL), 0);
    kvs_kv_free(plain, sa);
    cr_expect_eq(start(plain, &sa, a, 100, NULL), 0);
    kvs_kv_destroy(plain);
    kvs_kv_destroy(kv);
    free(a), free(b);
}

/* Two requests that prefill the same prefix at once (neither found it cached
 * when admitted): the one that commits second takes the first one's cached
 * blocks and frees its own copies, so its own blocks beyond the prefix are
 * cached under a parent it holds, reachable however the first one ends. */
Test(prefix_cache, a_prefix_prefilled_twice_at_once_is_cached_once_and_stays_reachable) {
    kvs_kv_cache *kv = cache(3 * 20, 4); /* 20 blocks a layer */
    int32_t *a = tokens(64, 1000), *b = tokens(100, 1000); /* a: b's first 4 blocks */
    int sa = kvs_kv_seq_create(kv), sb = kvs_kv_seq_create(kv);
    cr_assert_eq(kvs_kv_prefix_attach(kv, sa, a, 64, NULL, 63), 0);
    cr_assert_eq(kvs_kv_prefix_attach(kv, sb, b, 100, NULL, 99), 0);
    cr_assert_eq(kvs_kv_reserve(kv, sa, 64), KVS_OK);
    cr_assert_eq(kvs_kv_reserve(kv, sb, 100), KVS_OK);
    kvs_kv_commit(kv, sa, 64);
    kvs_kv_commit(kv, sb, 100);
    check(kv);
    for (int l = 0; l < L; l++) {
        int na, nb;
        const int32_t *ta = kvs_kv_blocks(kv, sa, l, &na), *tb = kvs_kv_blocks(kv, sb, l, &nb);
        for (int i = 0; i < 4; i++) cr_expect_eq(tb[i], ta[i], "layer %d block %d: b holds a's cached copy", l, i);
    }
    cr_expect_eq(kvs_kv_free_blocks(kv), 3 * (20 - 7), "b's copies of the 4 shared blocks went back: 7 blocks a layer held");
    kvs_kv_free(kv, sa); /* a ends first; pressure then evicts what nobody holds */
    int32_t *c = tokens(13 * 16, 90000);
    int sc;
    start(kv, &sc, c, 13 * 16, NULL);
    check(kv);
    kvs_kv_free(kv, sc);
    int32_t *probe = tokens(101, 1000);
    int sp = kvs_kv_seq_create(kv);
    cr_expect_eq(kvs_kv_prefix_attach(kv, sp, probe, 101, NULL, 100), 96, "b's 6 full blocks are a hit");
    kvs_kv_free(kv, sp);
    kvs_kv_free(kv, sb);
    check(kv);
    kvs_kv_destroy(kv);
    free(a), free(b), free(c), free(probe);
}

/* A reset while a prompt is half prefilled: the blocks it commits afterwards
 * follow blocks no longer cached, so no lookup could reach them: they are
 * not cached (nor announced). */
Test(prefix_cache, blocks_committed_after_a_reset_are_not_cached_under_uncached_parents) {
    kvs_kv_cache *kv = cache(3 * 20, 4);
    cr_assert_eq(kvs_kv_enable_events(kv), KVS_OK);
    kvs_kv_event_log log = {0};
    int32_t *a = tokens(100, 1000);
    int sa = kvs_kv_seq_create(kv);
    cr_assert_eq(kvs_kv_prefix_attach(kv, sa, a, 100, NULL, 99), 0);
    cr_assert_eq(kvs_kv_reserve(kv, sa, 100), KVS_OK);
    kvs_kv_commit(kv, sa, 40); /* blocks 0 and 1 cached */
    kvs_kv_take_events(kv, &log);
    cr_expect_eq(log.n, 2);
    kvs_kv_reset_prefix_cache(kv);
    kvs_kv_commit(kv, sa, 60);
    check(kv);
    kvs_kv_take_events(kv, &log);
    cr_expect(log.n == 1 && log.events[0].kind == KVS_KV_EVENT_CLEARED, "the reset alone: %d events", log.n);
    cr_expect_eq(kvs_kv_cached_blocks(kv, 0), 0);
    kvs_kv_free(kv, sa);
    cr_expect_eq(kvs_kv_free_blocks(kv), 60);
    kvs_kv_event_log_free(&log);
    kvs_kv_destroy(kv);
    free(a);
}

static uint64_t constant_hash(uint64_t parent, const int32_t *t, int n) {
    (void)parent, (void)t, (void)n;
    return 42;
}

/* Every block hashes alike: a hit still needs the same tokens, the same
 * parent chain and the same salt. */
Test(prefix_cache, a_forced_hash_collision_never_reuses_another_prompts_kv) {
    kvs_kv_cache *kv = cache(300, 6);
    kv->hash_block = constant_hash;
    int32_t *a = tokens(64, 1), *b = tokens(64, 5000), *c = tokens(64, 1), *d = tokens(64, 1);
    for (int i = 0; i < 16; i++) c[i] = 9000 + i; /* another first block, then a's blocks 2-4 */
    for (int i = 40; i < 64; i++) d[i] = 77;      /* a's first 2 blocks, then others */
    int sa, sb, sc, sd, se;
    cr_expect_eq(start(kv, &sa, a, 64, NULL), 0);
    cr_expect_eq(start(kv, &sb, b, 64, NULL), 0, "other tokens, same hash: no hit");
    cr_expect_eq(start(kv, &sc, c, 64, NULL), 0, "a's later blocks after another first block: no hit");
    cr_expect_eq(start(kv, &sd, d, 64, NULL), 32, "the blocks that really match");
    cr_expect_eq(start(kv, &se, a, 64, "tenant"), 0, "another salt");
    int sf;
    cr_expect_eq(start(kv, &sf, a, 64, NULL), 48, "a itself (all but its last token: 3 blocks)");
    kvs_kv_destroy(kv);
    free(a), free(b), free(c), free(d);
}

Test(prefix_cache, cache_salt_isolates) {
    kvs_kv_cache *kv = cache(300, 8);
    int32_t *a = tokens(64, 1);
    int s[6];
    cr_expect_eq(start(kv, &s[0], a, 64, "alice"), 0);
    cr_expect_eq(start(kv, &s[1], a, 64, "bob"), 0);
    cr_expect_eq(start(kv, &s[2], a, 64, NULL), 0);
    cr_expect_eq(start(kv, &s[3], a, 64, ""), 0, "an empty salt is not no salt");
    cr_expect_eq(start(kv, &s[4], a, 64, "alice"), 48);
    cr_expect_eq(start(kv, &s[5], a, 64, NULL), 48);
    kvs_kv_destroy(kv);
    free(a);
}

/* Freed prompts become evictable; the least recently used goes first; a
 * block in use is never taken. */
Test(prefix_cache, eviction_is_least_recently_used_and_spares_blocks_in_use) {
    kvs_kv_cache *kv = cache(4 * L, 4); /* four blocks a layer */
    int32_t *a = tokens(32, 1), *b = tokens(32, 100), *c = tokens(32, 200);
    int sa, sb, sc;
    start(kv, &sa, a, 32, NULL);
    start(kv, &sb, b, 32, NULL);
    kvs_kv_free(kv, sa); /* a: evictable, older */
    kvs_kv_free(kv, sb);
    cr_expect_eq(kvs_kv_free_blocks(kv), 4 * L, "evictable blocks count as free");
    int sx = kvs_kv_seq_create(kv);
    cr_expect_eq(kvs_kv_prefix_attach(kv, sx, a, 32, NULL, 32), 32, "a used again: b is now the least recent");
    kvs_kv_free(kv, sx);
    cr_expect_eq(kvs_kv_evictions(kv), 0);
    start(kv, &sc, c, 32, NULL); /* 2 blocks a layer: b's */
    cr_expect_eq(kvs_kv_evictions(kv), 2 * L);
    cr_expect_eq(start(kv, &sx, a, 32, NULL), 16, "a survived");
    kvs_kv_free(kv, sx);
    int sy = kvs_kv_seq_create(kv);
    cr_expect_eq(kvs_kv_prefix_attach(kv, sy, b, 32, NULL, 31), 0, "b was evicted");
    /* c is held: a new sequence may take a's 2 blocks a layer, never c's */
    cr_expect_eq(kvs_kv_reserve(kv, sy, 33), KVS_ERR_NOMEM, "c holds 2 of 4 blocks a layer");
    uint64_t evicted = kvs_kv_evictions(kv);
    cr_expect_eq(kvs_kv_reserve(kv, sy, 32), KVS_OK, "%s", kvs_last_error());
    cr_expect_eq(kvs_kv_evictions(kv) - evicted, 2 * L);
    check(kv);
    kvs_kv_free(kv, sy);
    kvs_kv_free(kv, sc);
    check(kv);
    kvs_kv_destroy(kv);
    free(a), free(b), free(c);
}

/* A layer holding cached blocks compacts into blocks of its own: the cached
 * blocks' bytes are unchanged and stay cached; the kept entries are the ones
 * asked for. A fork shares the cached blocks and copies the rest. */
Test(prefix_cache, compaction_and_forks_leave_cached_blocks_alone) {
    kvs_kv_cache *kv = cache(120, 4);
    const kvs_kv_pool *pool = kvs_kv_get_pool(kv);
    size_t block_bytes = kvs_kv_block_bytes(kvs_kv_get_config(kv), be->kv_dtype);
    float *data = pool->data;
    for (size_t i = 0; i < (size_t)pool->n_blocks * block_bytes / sizeof(float); i++) data[i] = (float)i;
    int32_t *a = tokens(40, 1);
    int sa, sb;
    start(kv, &sa, a, 40, NULL);
    cr_assert_eq(start(kv, &sb, a, 40, NULL), 32);
    int nb;
    const int32_t *tb = kvs_kv_blocks(kv, sb, 1, &nb);
    int32_t cached0 = tb[0], cached1 = tb[1];
    char *before = malloc(2 * block_bytes);
    memcpy(before, (char *)pool->data + cached0 * block_bytes, block_bytes);
    memcpy(before + block_bytes, (char *)pool->data + cached1 * block_bytes, block_bytes);
    int32_t keep[2 * 5] = {0, 3, 17, 30, 39, 1, 2, 20, 33, 38};
    /* the entry's K, per head, before: entry e of head h is at block t[e / 16], offset e % 16 */
    float want[2][5];
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 5; i++) {
            int e = keep[h * 5 + i];
            want[h][i] = *((float *)((char *)pool->data + (size_t)tb[e / BS] * block_bytes) + ((size_t)h * BS + e % BS) * 8);
        }
    cr_assert_eq(kvs_kv_compact(kv, sb, 1, keep, 5), KVS_OK, "%s", kvs_last_error());
    check(kv);
    tb = kvs_kv_blocks(kv, sb, 1, &nb);
    cr_expect_eq(nb, 1);
    cr_expect(tb[0] != cached0 && tb[0] != cached1, "compacted into a block of its own");
    cr_expect(!memcmp(before, (char *)pool->data + cached0 * block_bytes, block_bytes) &&
                  !memcmp(before + block_bytes, (char *)pool->data + cached1 * block_bytes, block_bytes),
              "the cached blocks' bytes are unchanged");
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 5; i++) {
            float got = *((float *)((char *)pool->data + (size_t)tb[0] * block_bytes) + ((size_t)h * BS + i) * 8);
            cr_expect_eq(got, want[h][i], "head %d kept entry %d", h, i);
        }
    int fork;
    int64_t free_before = kvs_kv_free_blocks(kv);
    cr_assert_eq(kvs_kv_fork(kv, sa, &fork), KVS_OK, "%s", kvs_last_error());
    cr_expect_eq(free_before - kvs_kv_free_blocks(kv), L, "the fork copies only the partial block of each layer");
    const int32_t *ta = kvs_kv_blocks(kv, sa, 0, &nb), *tf = kvs_kv_blocks(kv, fork, 0, &nb);
    cr_expect(ta[0] == tf[0] && ta[1] == tf[1] && ta[2] != tf[2]);
    check(kv);
    kvs_kv_free(kv, sa), kvs_kv_free(kv, sb), kvs_kv_free(kv, fork);
    check(kv);
    cr_expect_eq(kvs_kv_free_blocks(kv), 120);
    kvs_kv_destroy(kv);
    free(a), free(before);
}

/* 10,000 random operations: admit (a prompt from a few shared documents and
 * two salts, its cached prefix attached; half of them under a sparse policy
 * (StreamingLLM or SnapKV),
 * compacted when their prompt completes and in decode), append, compact, fork, free, preempt
 * (free mid-prompt), with eviction under pressure: the invariant holds after
 * each, every hit's blocks hold that prompt's tokens, and all comes back. */

/* ---- KV events: a subscriber's view of what is reusable ---------------------- */
/* As a router keeps it: each announced block's hash, its parent's and its tokens. */
enum { VIEW_MAX = 4096 };
typedef struct {
    uint64_t h, parent;
    bool has_parent;
    int32_t tokens[BS];
} view_block;
typedef struct {
    view_block b[VIEW_MAX];
    int n;
    int stored, removed, cleared;
} event_view;

static int view_find(const event_view *v, uint64_t h) {
    for (int i = 0; i < v->n; i++)
        if (v->b[i].h == h) return i;
    return -1;
}

/* Applies the events logged since the last call, checking each makes sense
 * to a subscriber: a block is stored while not known, removed while known. */
static void view_apply(kvs_kv_cache *kv, event_view *v, kvs_kv_event_log *log) {
    kvs_kv_take_events(kv, log);
    cr_assert(!log->lost);
    for (int i = 0; i < log->n; i++) {
        const kvs_kv_event *e = &log->events[i];
        int at = view_find(v, e->hash);
        if (e->kind == KVS_KV_EVENT_STORED) {
            cr_assert_eq(at, -1, "block %llx stored twice", (unsigned long long)e->hash);
            cr_assert(v->n < VIEW_MAX);
            view_block *nb = &v->b[v->n++];
            *nb = (view_block){.h = e->hash, .parent = e->parent_hash, .has_parent = e->has_parent};
            memcpy(nb->tokens, log->tokens + e->token0, sizeof nb->tokens);
            v->stored++;
        } else if (e->kind == KVS_KV_EVENT_REMOVED) {
            cr_assert_neq(at, -1, "block %llx removed but never stored", (unsigned long long)e->hash);
            v->b[at] = v->b[--v->n];
            v->removed++;
        } else {
            v->n = 0, v->cleared++;
        }
    }
}

/* The tokens of the announced chain ending at block `at` (parents first) in
 * out; its length, or 0 when a parent is no longer announced. */
static int view_chain(const event_view *v, int at, int32_t *out, int cap) {
    int n = 0;
    for (int b = at;; n += BS) {
        if (n + BS > cap) return 0;
        memmove(out + BS, out, sizeof(int32_t) * n);
        memcpy(out, v->b[b].tokens, sizeof v->b[b].tokens);
        if (!v->b[b].has_parent) return n + BS;
        if ((b = view_find(v, v->b[b].parent)) < 0) return 0;
    }
}

/* A router's promise: a prompt of an announced chain's tokens (and one more)
 * is a hit for the whole chain, under one of the salts the run uses. */
static void view_chain_hits(kvs_kv_cache *kv, const event_view *v, int at, int op) {
    static int32_t chain[4096 + 1];
    int n = view_chain(v, at, chain, 4096);
    if (n == 0) return;
    chain[n] = 1;
    int best = 0;
    for (int k = 0; k < 2; k++) {
        int s = kvs_kv_seq_create(kv);
        if (s < 0) return; /* no sequence free: the next op tries again */
        int hit = kvs_kv_prefix_attach(kv, s, chain, n + 1, k ? "other" : NULL, n);
        if (hit > best) best = hit;
        kvs_kv_free(kv, s);
    }
    cr_assert_eq(best, n, "op %d: an announced chain of %d tokens hits %d", op, n, best);
}

static int cmp_hash(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* The subscriber's set equals the manager's reusable blocks. */
static void view_check(const kvs_kv_cache *kv, const event_view *v, int op) {
    uint64_t *own;
    int64_t n;
    cr_assert_eq(kvs_kv_reusable_blocks(kv, &own, &n), KVS_OK);
    cr_assert_eq(n, v->n, "op %d: %lld blocks reusable, %d announced and not removed", op, (long long)n, v->n);
    cr_assert_eq(kvs_kv_reusable_count(kv), n, "op %d: the count kept", op);
    static uint64_t sorted[VIEW_MAX];
    for (int i = 0; i < v->n; i++) sorted[i] = v->b[i].h;
    qsort(sorted, (size_t)v->n, sizeof(uint64_t), cmp_hash);
    for (int64_t i = 0; i < n; i++) cr_assert_eq(own[i], sorted[i], "op %d: the sets differ", op);
    free(own);
}

Test(prefix_cache, kv_events_announce_reusable_blocks_chained_once_and_their_removal) {
    kvs_kv_cache *kv = cache(3 * 12, 4); /* 12 blocks a layer */
    cr_assert_eq(kvs_kv_enable_events(kv), KVS_OK);
    kvs_kv_event_log log = {0};
    event_view v = {0};
    int32_t *a = tokens(100, 1000), *b = tokens(120, 1000);
    for (int i = 85; i < 120; i++) b[i] = 7; /* 5 whole blocks in common */
    int sa, sb;
    start(kv, &sa, a, 100, NULL);
    kvs_kv_take_events(kv, &log);
    cr_assert_eq(log.n, 6, "a's 6 full prompt blocks stored, once each (3 layers)");
    for (int i = 0; i < 6; i++) {
        const kvs_kv_event *e = &log.events[i];
        cr_assert_eq(e->kind, KVS_KV_EVENT_STORED);
        cr_assert_eq(e->has_parent, i > 0, "only the first block has no parent");
        if (i) cr_assert_eq(e->parent_hash, log.events[i - 1].hash, "block %d's parent is the block before", i);
        cr_assert(!memcmp(log.tokens + e->token0, a + i * BS, sizeof(int32_t) * BS), "block %d's tokens", i);
        v.b[v.n++].h = e->hash;
    }
    uint64_t a5 = log.events[4].hash;
    start(kv, &sb, b, 120, NULL); /* 80 tokens hit: only b's 6th and 7th blocks are new */
    kvs_kv_take_events(kv, &log);
    cr_assert_eq(log.n, 2, "the reused blocks are not announced again");
    cr_assert(log.events[0].has_parent && log.events[0].parent_hash == a5, "b's 6th block follows the shared 5th");
    cr_assert(!memcmp(log.tokens + log.events[0].token0, b + 80, sizeof(int32_t) * BS));
    for (int i = 0; i < 2; i++) v.b[v.n++].h = log.events[i].hash;
    view_check(kv, &v, 0);
    /* under pressure: a third prompt takes evictable blocks once a and b end */
    kvs_kv_free(kv, sa);
    kvs_kv_free(kv, sb);
    int32_t *c = tokens(150, 50000);
    int sc;
    start(kv, &sc, c, 150, NULL);
    view_apply(kv, &v, &log);
    cr_assert(v.removed > 0, "evicted blocks are removed");
    view_check(kv, &v, 1);
    kvs_kv_reset_prefix_cache(kv);
    view_apply(kv, &v, &log);
    cr_assert_eq(v.cleared, 1);
    cr_assert_eq(log.events[log.n - 1].kind, KVS_KV_EVENT_CLEARED);
    view_check(kv, &v, 2);
    kvs_kv_free(kv, sc);
    check(kv);
    cr_expect_eq(kvs_kv_free_blocks(kv), 36);
    cr_expect_eq(kvs_kv_evictable_blocks(kv), 0, "a reset cache holds nothing");
    kvs_kv_event_log_free(&log);
    free(a), free(b), free(c);
    kvs_kv_destroy(kv);
}

Test(prefix_cache, random_operations_keep_ownership_and_reference_counts, .timeout = 300) {
    enum { SEQS = 10, BLOCKS = 40 * L };
    kvs_kv_cache *kv = cache(BLOCKS, SEQS);
    cr_assert_eq(kvs_kv_enable_events(kv), KVS_OK);
    kvs_kv_event_log log = {0};
    static event_view v;
    kvs_rng rng;
    kvs_rng_seed(&rng, kvs_test_seed());
    int live[SEQS], n_live = 0, prompt_left[SEQS] = {0};
    int32_t prompt[200], keep[2 * 600];
    uint64_t hits = 0;
    for (int op = 0; op < 10000; op++) {
        int what = (int)(kvs_rng_u64(&rng) % 6);
        if (what == 0 || n_live == 0) { /* admit */
            int doc = (int)(kvs_rng_u64(&rng) % 3), n = 20 + (int)(kvs_rng_u64(&rng) % 150);
            int shared = (int)(kvs_rng_u64(&rng) % (n + 1));
            for (int i = 0; i < n; i++) prompt[i] = i < shared ? doc * 1000 + i : (int32_t)(kvs_rng_u64(&rng) % 5000);
            int s = kvs_kv_seq_create(kv);
            if (s < 0) continue;
            if (kvs_rng_u64(&rng) % 2) { /* compacted at the prompt's end (into its own blocks), then in decode:
                                             StreamingLLM pair by pair, SnapKV in the step's batch */
                kvs_kv_policy p = kvs_kv_policy_default(kvs_rng_u64(&rng) % 2 ? KVS_POLICY_STREAMINGLLM : KVS_POLICY_SNAPKV);
                p.budget_fraction = 0.3f, p.window = 8, p.min_prompt = 0;
                cr_assert_eq(kvs_kv_set_policy(kv, s, &p, n), KVS_OK, "%s", kvs_last_error());
            }
            int hit = kvs_kv_prefix_attach(kv, s, prompt, n, kvs_rng_u64(&rng) % 4 ? NULL : "other", n - 1);
            hits += hit;
            cr_assert(hit % BS == 0 && hit < n);
            for (int l = 0; l < L && hit; l++) { /* the hit blocks' cached tokens are the prompt's */
                int nb;
                const int32_t *t = kvs_kv_blocks(kv, s, l, &nb);
                for (int i = 0; i < hit / BS; i++)
                    cr_assert(!memcmp(kv->blocks.tokens + (size_t)t[i] * BS, prompt + i * BS, sizeof(int32_t) * BS),
                              "a hit on other tokens");
            }
            live[n_live] = s, prompt_left[n_live++] = n - hit;
        } else {
            int pick = (int)(kvs_rng_u64(&rng) % n_live), s = live[pick];
            if (what <= 2) { /* append: the rest of the prompt in a chunk, then decode tokens */
                int n = prompt_left[pick] ? 1 + (int)(kvs_rng_u64(&rng) % prompt_left[pick]) : 1;
                if (kv_try_append(kv, s, n)) {
                    prompt_left[pick] -= prompt_left[pick] ? n : 0;
                    cr_assert_eq(kvs_kv_sparsify(kv, s), KVS_OK, "%s", kvs_last_error());
                }
            } else if (what == 3) { /* compact a random layer */
                int layer = (int)(kvs_rng_u64(&rng) % L), len = kvs_kv_len(kv, s, layer);
                if (len > 0) {
                    int n_keep = (int)(kvs_rng_u64(&rng) % (len + 1));
                    for (int h = 0; h < 2; h++) {
                        int k = 0;
                        for (int e = 0; e < len && k < n_keep; e++)
                            if ((int)(kvs_rng_u64(&rng) % (len - e)) < n_keep - k) keep[h * n_keep + k++] = e;
                    }
                    kvs_status st = kvs_kv_compact(kv, s, layer, keep, n_keep);
                    cr_assert(st == KVS_OK || st == KVS_ERR_NOMEM, "%s", kvs_last_error());
                    if (st == KVS_OK) cr_assert_eq(kvs_kv_len(kv, s, layer), n_keep);
                }
            } else if (what == 4 && n_live < SEQS) { /* fork */
                int f;
                kvs_status st = kvs_kv_fork(kv, s, &f);
                cr_assert(st == KVS_OK || st == KVS_ERR_NOMEM, "%s", kvs_last_error());
                if (st == KVS_OK) live[n_live] = f, prompt_left[n_live++] = 0;
            } else { /* free: finished, aborted or preempted */
                kvs_kv_free(kv, s);
                live[pick] = live[--n_live];
                prompt_left[pick] = prompt_left[n_live];
            }
        }
        if (kvs_rng_u64(&rng) % 500 == 0) kvs_kv_reset_prefix_cache(kv);
        cr_assert_eq(kvs_kv_check(kv), KVS_OK, "op %d: %s", op, kvs_last_error());
        view_apply(kv, &v, &log);
        view_check(kv, &v, op);
        if (v.n > 0) {
            view_chain_hits(kv, &v, (int)(kvs_rng_u64(&rng) % (uint64_t)v.n), op);
            view_apply(kv, &v, &log); /* a probe evicts nothing: it only holds cached blocks */
            view_check(kv, &v, op);
        }
    }
    cr_log_info("%llu tokens reused, %llu evictions; events: %d stored, %d removed, %d cleared", (unsigned long long)hits,
                (unsigned long long)kvs_kv_evictions(kv), v.stored, v.removed, v.cleared);
    cr_expect(v.stored > 0 && v.removed > 0, "the run announced and removed blocks");
    kvs_kv_event_log_free(&log);
    cr_expect(hits > 0 && kvs_kv_evictions(kv) > 0, "the run reused and evicted (hits %llu)", (unsigned long long)hits);
    while (n_live) kvs_kv_free(kv, live[--n_live]);
    check(kv);
    cr_expect_eq(kvs_kv_free_blocks(kv), BLOCKS);
    kvs_kv_destroy(kv);
}
