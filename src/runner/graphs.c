/* The decode-step CUDA graphs: mode, the capture/replay state machine of the
 * buckets, invalidation when the KV memory they baked in moves, statistics.
 * The step buffers never move (step_buffers.c: sized once). */
#include <stdlib.h>
#include <string.h>

#include "runner/runner_internal.h"

static void invalidate(kvs_executor *x);

void kvs_executor_set_graph_mode(kvs_executor *x, kvs_graph_mode mode) {
    if (x->graphs.mode == mode) return;
    invalidate(x);
    x->graphs.mode = mode;
}

kvs_graph_stats kvs_executor_graph_stats(const kvs_executor *x) { return x->graphs.stats; }

static void invalidate(kvs_executor *x) {
    kvs_graphs *g = &x->graphs;
    bool any = false;
    for (int i = 0; i < KVS_GRAPH_BATCHES; i++)
        for (int j = 0; j < KVS_GRAPH_VARIANTS; j++) {
            kvs_graph_slot *s = &g->slot[i][j];
            if (s->exec) {
                x->be->graph_destroy(x->be, s->exec);
                s->exec = NULL;
                any = true;
            }
            /* scratch never shrinks: a bucket seen before can capture at once */
            if (s->seen > 1) s->seen = 1;
        }
    if (any) g->stats.invalidations++;
}

/* Invalidates the graphs when the KV memory they baked in is not kv's (the table stride goes with the pointer). */
static kvs_status check_kv(kvs_executor *x, const kvs_kv_device *kv) {
    kvs_graphs *g = &x->graphs;
    size_t n = 2 + 2 * (size_t)x->cfg->n_layers;
    if (!g->baked && !(g->baked = calloc(2 * n, sizeof(void *))))
        return kvs_fail(KVS_ERR_NOMEM, "forward: out of host memory");
    const void **now = g->baked + n; /* kv's, after the baked ones */
    int stride;
    now[0] = kvs_kv_device_pool(kv)->data;
    now[1] = kvs_kv_device_layer_tables(kv, 0, &stride);
    for (int l = 0; l < x->cfg->n_layers; l++) {
        void *q;
        float *lse;
        kvs_kv_device_window_buffers(kv, l, &q, &lse);
        now[2 + 2 * l] = q;
        now[3 + 2 * l] = lse;
    }
    if (memcmp(g->baked, now, n * sizeof(void *)) == 0) return KVS_OK;
    invalidate(x);
    memcpy(g->baked, now, n * sizeof(void *));
    return KVS_OK;
}

/* The slot of the step's batch bucket made for its layer lengths (the step
 * buffers' layer_meta, just prepared), or else the unused or least recently
 * used one, emptied for them. NULL when out of host memory. */
static kvs_graph_slot *find_slot(kvs_executor *x, int bucket) {
    kvs_graphs *g = &x->graphs;
    const int L = x->cfg->n_layers;
    const kvs_layer_meta *lm = x->buf.layer_meta;
    kvs_graph_slot *row = g->slot[bucket], *pick = &row[0];
    g->clock++;
    for (int i = 0; i < KVS_GRAPH_VARIANTS; i++) {
        kvs_graph_slot *s = &row[i];
        int l = 0;
        while (s->kv_blocks && l < L && s->kv_blocks[l] == lm[l].kv_blocks) l++;
        if (s->kv_blocks && l == L) {
            s->used = g->clock;
            return s;
        }
        if (pick->kv_blocks && (!s->kv_blocks || s->used < pick->used)) pick = s;
    }
    if (pick->exec) x->be->graph_destroy(x->be, pick->exec);
    if (!pick->kv_blocks && !(pick->kv_blocks = malloc(sizeof(int32_t) * L))) return NULL;
    for (int l = 0; l < L; l++) pick->kv_blocks[l] = lm[l].kv_blocks;
    pick->exec = NULL, pick->seen = 0, pick->failed = false, pick->used = g->clock;
    return pick;
}

/* A padded step run eagerly. */
static kvs_status padded_eager(kvs_executor *x, const kvs_kv_device *kv) {
    x->graphs.stats.padded_eager_steps++;
    return kvs_forward_layers(x->m, &x->buf.fs, kv);
}

/* vLLM's protocol: a bucket's first step runs eagerly, its second is
 * captured, later ones replay. */
kvs_status kvs_graphs_run(kvs_executor *x, const kvs_kv_device *kv, const kvs_step_shape *sh) {
    kvs_backend *be = x->be;
    kvs_graphs *g = &x->graphs;
    if (!sh->padded) {
        g->stats.eager_steps++;
        return kvs_forward_layers(x->m, &x->buf.fs, kv);
    }
    if (g->mode != KVS_GRAPHS_ON || !be->graph_begin) return padded_eager(x, kv);
    KVS_TRY(check_kv(x, kv));
    kvs_graph_slot *slot = find_slot(x, sh->bucket);
    if (!slot) return kvs_fail(KVS_ERR_NOMEM, "forward: out of host memory");
    if (slot->exec) {
        if (be->graph_launch(be, slot->exec) == KVS_OK) {
            g->stats.replays++;
            return KVS_OK;
        }
        /* stale (the backend's scratch moved): eager now, capture next time */
        be->graph_destroy(be, slot->exec);
        slot->exec = NULL;
        slot->seen = 1;
        g->stats.invalidations++;
        return padded_eager(x, kv);
    }
    if (slot->failed || slot->seen++ == 0) return padded_eager(x, kv);
    kvs_status st = be->graph_begin(be);
    if (st == KVS_OK) {
        kvs_status body = kvs_forward_layers(x->m, &x->buf.fs, kv);
        void *exec = NULL;
        st = be->graph_end(be, &exec); /* always close the capture */
        if (body != KVS_OK) {
            if (exec) be->graph_destroy(be, exec);
            return body;
        }
        if (st == KVS_OK) {
            slot->exec = exec;
            g->stats.captures++;
            st = be->graph_launch(be, exec);
            if (st == KVS_OK) {
                g->stats.replays++;
                return KVS_OK;
            }
            be->graph_destroy(be, exec);
            slot->exec = NULL;
        }
    }
    slot->failed = true;
    g->stats.capture_failures++;
    kvs_log(KVS_LOG_WARN, "forward: no CUDA graph for %d sequences (layer 0's tables of %d blocks; %s); these "
            "lengths stay eager", sh->n_seqs, slot->kv_blocks[0], kvs_last_error());
    return padded_eager(x, kv); /* nothing of the failed capture ran */
}

void kvs_graphs_free(kvs_executor *x) {
    invalidate(x);
    for (int i = 0; i < KVS_GRAPH_BATCHES; i++)
        for (int j = 0; j < KVS_GRAPH_VARIANTS; j++) {
            free(x->graphs.slot[i][j].kv_blocks);
            x->graphs.slot[i][j].kv_blocks = NULL;
        }
    free(x->graphs.baked);
    x->graphs.baked = NULL;
}
