/* Bookkeeping of the decode-step CUDA graphs (the buckets are run by
 * forward.c's run_step): mode, invalidation, the KV memory the graphs baked
 * in, statistics. */
#include <stdlib.h>
#include <string.h>

#include "model/model_internal.h"

void kvs_model_set_graph_mode(kvs_model *m, kvs_graph_mode mode) {
    if (m->graphs.mode == mode) return;
    kvs_graphs_invalidate(m);
    m->graphs.mode = mode;
}

kvs_graph_stats kvs_model_graph_stats(const kvs_model *m) { return m->graphs.stats; }

void kvs_graphs_invalidate(kvs_model *m) {
    kvs_graphs *g = &m->graphs;
    bool any = false;
    for (int i = 0; i < KVS_GRAPH_BATCHES; i++)
        for (int j = 0; j < KVS_GRAPH_STRIDES; j++) {
            kvs_graph_slot *s = &g->slot[i][j];
            if (s->exec) {
                m->be->graph_destroy(m->be, s->exec);
                s->exec = NULL;
                any = true;
            }
            /* scratch never shrinks: a bucket seen before can capture at once */
            if (s->seen > 1) s->seen = 1;
        }
    if (any) g->stats.invalidations++;
}

kvs_status kvs_graphs_check_kv(kvs_model *m, const kvs_kv_cache *kv) {
    kvs_graphs *g = &m->graphs;
    int L = m->cfg.n_layers, n = 1 + 2 * L;
    if (!g->baked) {
        g->baked = calloc((size_t)n, sizeof(void *));
        if (!g->baked) return kvs_fail(KVS_ERR_NOMEM, "forward: out of host memory");
        g->n_baked = n;
    }
    const void **now = g->baked;
    bool same = now[0] == kvs_kv_get_pool(kv)->data;
    const void *cur[2];
    for (int l = 0; l < L && same; l++) {
        void *q;
        float *lse;
        kvs_kv_window_buffers(kv, l, &q, &lse);
        cur[0] = q, cur[1] = lse;
        same = now[1 + 2 * l] == cur[0] && now[2 + 2 * l] == cur[1];
    }
    if (same) return KVS_OK;
    kvs_graphs_invalidate(m);
    now[0] = kvs_kv_get_pool(kv)->data;
    for (int l = 0; l < L; l++) {
        void *q;
        float *lse;
        kvs_kv_window_buffers(kv, l, &q, &lse);
        now[1 + 2 * l] = q;
        now[2 + 2 * l] = lse;
    }
    return KVS_OK;
}

void kvs_graphs_free(kvs_model *m) {
    kvs_backend *be = m->be;
    kvs_graphs_invalidate(m);
    free(m->graphs.baked);
    m->graphs.baked = NULL;
    kvs_step_buffers *b = &m->buf;
    if (b->meta) be->free(be, b->meta);
    if (b->h_meta) be->host_free ? be->host_free(be, b->h_meta) : free(b->h_meta);
    free(b->layer_meta);
    b->meta = b->h_meta = NULL;
    b->layer_meta = NULL;
    b->cap_meta = 0;
}
