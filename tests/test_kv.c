/* The paged KV cache: block accounting under random operations, compaction
 * moving exactly the kept entries. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "kv/kv.h"
#include "testutil.h"

static kvs_backend *be;
static void setup(void) { cr_assert_eq(kvs_backend_cpu_create(1, &be), KVS_OK); }
static void teardown(void) { be->destroy(be); }

TestSuite(kv, .init = setup, .fini = teardown);

/* A copy of a layer table, kept as the model's device tables keep one
 * (src/model/tables.c): refreshed when the table's stamp moved, from the
 * first block when its base stamp moved too, else from the copy's end. */
typedef struct {
    int32_t blocks[400]; /* the pool's blocks */
} table_copy;

/* The tables' changes (kv.h kvs_kv_plan_tables) of a random part of the live
 * sequences, applied to copies kept per sequence id as a device keeps its
 * rows (never cleared: a new sequence of a freed id must be sent whole): the
 * copies of the planned sequences then hold their tables; the others catch
 * up whenever they are planned. */
static void check_table_copies(kvs_kv_cache *kv, const int *live, int n_live, int n_layers, table_copy (*copies)[4],
                               kvs_kv_table_deltas *d, kvs_rng *rng, uint64_t seed, int op) {
    int32_t planned[12];
    int n = 0;
    for (int i = 0; i < n_live; i++)
        if (kvs_rng_u64(rng) % 2) planned[n++] = live[i];
    cr_assert_eq(kvs_kv_plan_tables(kv, planned, n, d), KVS_OK, "%s", kvs_last_error());
    for (int k = 0; k < d->n_deltas; k++) {
        const kvs_kv_table_delta *x = &d->deltas[k];
        cr_assert(x->first >= 0 && x->n > 0 && x->first + x->n <= 400 && x->at + x->n <= d->n_blocks);
        memcpy(copies[x->seq][x->layer].blocks + x->first, d->blocks + x->at, sizeof(int32_t) * (size_t)x->n);
    }
    for (int i = 0; i < n; i++)
        for (int l = 0; l < n_layers; l++) {
            int nb;
            const int32_t *blocks = kvs_kv_blocks(kv, planned[i], l, &nb);
            for (int k = 0; k < nb; k++)
                cr_assert_eq(blocks[k], copies[planned[i]][l].blocks[k],
                             "seed %llu op %d: seq %d layer %d block %d is %d, its copy %d after the plan",
                             (unsigned long long)seed, op, planned[i], l, k, blocks[k],
                             copies[planned[i]][l].blocks[k]);
        }
}

/* 10,000 random allocate / append / compact / fork / free operations: no
 * block is leaked or owned twice, lengths add up, and copies of the tables
 * kept from their planned changes stay the tables. */
Test(kv, random_operations_keep_blocks_consistent) {
    kvs_kv_config kc = {.n_layers = 4, .n_kv_heads = 2, .head_dim = 8, .block_size = 16, .n_blocks = 400,
                        .max_seqs = 12};
    kvs_kv_cache *kv;
    cr_assert_eq(kvs_kv_create(&kc, be, &kv), KVS_OK);
    kvs_rng rng;
    uint64_t seed = kvs_test_seed();
    kvs_rng_seed(&rng, seed);
    int live[12], n_live = 0;
    int32_t keep[2 * 600];
    static table_copy copies[12][4];
    memset(copies, 0xff, sizeof copies); /* stale: -1 everywhere */
    kvs_kv_table_deltas deltas = {0};
    for (int op = 0; op < 10000; op++) {
        int what = (int)(kvs_rng_u64(&rng) % 5);
        if (what == 0 || n_live == 0) { /* allocate */
            int s = kvs_kv_seq_create(kv);
            if (s >= 0) live[n_live++] = s;
            else cr_assert_eq(n_live, 12, "seed %llu: create failed with %d live", (unsigned long long)seed, n_live);
        } else {
            int pick = (int)(kvs_rng_u64(&rng) % n_live), s = live[pick];
            if (what == 1) { /* append */
                kv_try_append(kv, s, 1 + (int)(kvs_rng_u64(&rng) % 40));
            } else if (what == 2) { /* compact a random layer to a random subset */
                int layer = (int)(kvs_rng_u64(&rng) % kc.n_layers), len = kvs_kv_len(kv, s, layer);
                if (len > 0) {
                    int n_keep = (int)(kvs_rng_u64(&rng) % (len + 1));
                    for (int h = 0; h < 2; h++) { /* sorted random subset of [0, len) */
                        int k = 0;
                        for (int e = 0; e < len && k < n_keep; e++)
                            if ((int)(kvs_rng_u64(&rng) % (len - e)) < n_keep - k) keep[h * n_keep + k++] = e;
                    }
                    cr_assert_eq(kvs_kv_compact(kv, s, layer, keep, n_keep), KVS_OK, "%s", kvs_last_error());
                    cr_assert_eq(kvs_kv_len(kv, s, layer), n_keep);
                }
            } else if (what == 3) { /* fork */
                int f;
                if (n_live < 12 && kvs_kv_fork(kv, s, &f) == KVS_OK) live[n_live++] = f;
            } else { /* free */
                kvs_kv_free(kv, s);
                live[pick] = live[--n_live];
            }
        }
        check_table_copies(kv, live, n_live, kc.n_layers, copies, &deltas, &rng, seed, op);
        if (op % 97 == 0) cr_assert_eq(kvs_kv_check(kv), KVS_OK, "seed %llu op %d: %s", (unsigned long long)seed, op, kvs_last_error());
    }
    cr_assert_eq(kvs_kv_check(kv), KVS_OK, "%s", kvs_last_error());
    kvs_kv_table_deltas_free(&deltas);
    for (int i = 0; i < n_live; i++) kvs_kv_free(kv, live[i]);
    cr_assert_eq(kvs_kv_used_blocks(kv), 0);
    cr_assert_eq(kvs_kv_check(kv), KVS_OK, "%s", kvs_last_error());
    kvs_kv_destroy(kv);
}

/* Compaction keeps exactly the chosen entries per head, in order, and frees the tail blocks. */
Test(kv, compact_keeps_exactly_the_chosen_entries) {
    kvs_kv_config kc = {.n_layers = 2, .n_kv_heads = 3, .head_dim = 4, .block_size = 16, .n_blocks = 64,
                        .max_seqs = 2};
    kvs_kv_cache *kv;
    cr_assert_eq(kvs_kv_create(&kc, be, &kv), KVS_OK);
    int s = kvs_kv_seq_create(kv), len = 100;
    cr_assert_eq(kvs_kv_reserve(kv, s, len), KVS_OK);
    const kvs_kv_pool *pool = kvs_kv_get_pool(kv);
    /* K value = 1000 * head + entry, V = -(that), for layer 1 */
    float *k = malloc(sizeof(float) * len * 3 * 4), *v = malloc(sizeof(float) * len * 3 * 4);
    int32_t *slots = malloc(sizeof(int32_t) * len);
    for (int e = 0; e < len; e++) {
        slots[e] = kvs_kv_slot(kv, s, 1, e);
        for (int h = 0; h < 3; h++)
            for (int j = 0; j < 4; j++) {
                k[(e * 3 + h) * 4 + j] = 1000.0f * h + e;
                v[(e * 3 + h) * 4 + j] = -(1000.0f * h + e);
            }
    }
    be->kv_write(be, pool, k, v, slots, len);
    kvs_kv_commit(kv, s, len);
    int64_t used = kvs_kv_used_blocks(kv);
    enum { N = 20 };
    int32_t keep[3 * N];
    for (int h = 0; h < 3; h++)
        for (int i = 0; i < N; i++) keep[h * N + i] = (i * (h + 2) * 7 + h) % 5 + i * 5; /* sorted, distinct */
    cr_assert_eq(kvs_kv_compact(kv, s, 1, keep, N), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(kvs_kv_len(kv, s, 1), N);
    cr_assert_eq(kvs_kv_len(kv, s, 0), len);
    cr_assert_eq(kvs_kv_used_blocks(kv), used - (7 - 2), "100 entries in 7 blocks -> 20 in 2");
    for (int h = 0; h < 3; h++)
        for (int i = 0; i < N; i++) {
            int32_t slot = kvs_kv_slot(kv, s, 1, i), blk = slot / 16, off = slot % 16;
            const float *base = (const float *)pool->data + (size_t)blk * 2 * 3 * 16 * 4;
            float kk = base[((0 * 3 + h) * 16 + off) * 4], vv = base[((1 * 3 + h) * 16 + off) * 4];
            cr_assert_eq(kk, 1000.0f * h + keep[h * N + i], "head %d entry %d", h, i);
            cr_assert_eq(vv, -(1000.0f * h + keep[h * N + i]));
        }
    /* bad keep lists are refused */
    int32_t bad[3] = {5, 3, 1};
    cr_assert_eq(kvs_kv_compact(kv, s, 0, bad, 1), KVS_OK);
    cr_assert_eq(kvs_kv_compact(kv, s, 0, (int32_t[]){2, 1, 0, 0, 0, 0}, 2), KVS_ERR_INVALID);
    cr_assert_eq(kvs_kv_check(kv), KVS_OK, "%s", kvs_last_error());
    free(k);
    free(v);
    free(slots);
    kvs_kv_destroy(kv);
}

Test(kv, admission_and_budget) {
    kvs_kv_config kc = {.n_layers = 4, .n_kv_heads = 2, .head_dim = 8, .block_size = 16, .n_blocks = 40,
                        .max_seqs = 4};
    cr_assert_eq(kvs_kv_block_bytes(&kc, KVS_F32), 2 * 2 * 16 * 8 * 4);
    cr_assert_eq(kvs_kv_blocks_for_budget(&kc, KVS_BF16, 1 << 20), (1 << 20) / (2 * 2 * 16 * 8 * 2));
    kvs_kv_cache *kv;
    cr_assert_eq(kvs_kv_create(&kc, be, &kv), KVS_OK);
    int s = kvs_kv_seq_create(kv);
    cr_assert_eq(kvs_kv_reserve(kv, s, 161), KVS_ERR_NOMEM);
    cr_assert_eq(kvs_kv_used_blocks(kv), 0);
    kvs_kv_destroy(kv);
    kc.n_blocks = 0;
    cr_assert_eq(kvs_kv_create(&kc, be, &kv), KVS_ERR_INVALID);
}

/* The backend's snapkv_select (CPU) against the kv module's reference helpers
 * (kvs_kv_pool_scores + kvs_kv_top_k_sorted, a heap): the same entries in the same
 * slots, then the window, on scores full of exact ties; k = 0, k >= n_keys (-1
 * padding), pools 1/3/7 and 1/2/8 KV heads. */
Test(kv, snapkv_select_matches_reference) {
    kvs_rng rng;
    uint64_t seed = kvs_test_seed();
    kvs_rng_seed(&rng, seed);
    const int heads[] = {1, 2, 8}, pools[] = {1, 3, 7};
    for (int trial = 0; trial < 300; trial++) {
        int H = heads[trial % 3], p = pools[(trial / 3) % 3], n = (int)(kvs_rng_u64(&rng) % 700);
        int k = trial % 7 == 0 ? 0 : trial % 7 == 1 ? n + (int)(kvs_rng_u64(&rng) % 4) : (int)(kvs_rng_u64(&rng) % (n + 1));
        int w = (int)(kvs_rng_u64(&rng) % 40), row = k + w, ties = trial % 2;
        float *s = malloc(sizeof(float) * (H * n + 1)), *pooled = malloc(sizeof(float) * (n + 1));
        for (int i = 0; i < H * n; i++)
            s[i] = ties ? (float)(kvs_rng_u64(&rng) % 9) * 0.25f : (float)kvs_rng_uniform(&rng);
        int32_t *got = malloc(sizeof(int32_t) * (H * row + 1)), *want = malloc(sizeof(int32_t) * (row + 1));
        be->snapkv_select(be, got, s, n, H, p, k, w);
        for (int h = 0; h < H; h++) {
            kvs_kv_pool_scores(s + (size_t)h * n, n, p, pooled);
            kvs_kv_top_k_sorted(pooled, n, k, want);
            int take = k < n ? k : n;
            for (int i = 0; i < w; i++) want[take + i] = n + i;
            for (int i = take + w; i < row; i++) want[i] = -1;
            for (int i = 0; i < row; i++)
                cr_assert_eq(got[(size_t)h * row + i], want[i],
                             "seed %llu trial %d: head %d of %d, n %d pool %d k %d window %d: slot %d is %d, want %d",
                             (unsigned long long)seed, trial, h, H, n, p, k, w, i, got[(size_t)h * row + i], want[i]);
        }
        free(s), free(pooled), free(got), free(want);
    }
}

Test(kv, snapkv_select_rejects_bad_arguments) {
    int32_t keep[4] = {7, 7, 7, 7};
    float s[2] = {1, 2};
    be->snapkv_select(be, keep, s, 2, 1, 0, 1, 1); /* pool 0 */
    cr_assert(strstr(kvs_last_error(), "snapkv_select"), "%s", kvs_last_error());
    be->snapkv_select(be, keep, s, 2, 1, 3, -1, 1); /* negative k */
    cr_assert_eq(keep[0], 7, "nothing is written on bad arguments");
}
