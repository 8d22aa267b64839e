/* runner: the step plan, made once on the caller's thread from the batch and
 * the KV manager, and handed to every rank: what the forward reads (slots,
 * lengths, window rows, the layers' longest tables) and the cells of the
 * device tables that changed. The checks that need the manager run here, so
 * a bad batch fails before any rank runs. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "runner/runner.h"

/* *p holds at least n int32 (its contents dropped); false when out of memory. */
static bool room(int32_t **p, int *cap, size_t n) {
    if (n > INT32_MAX) return false;
    if ((int)n <= *cap) return true;
    int c = kvs_grown_capacity(*cap, (int)n, 256);
    free(*p);
    *p = malloc(sizeof(int32_t) * (size_t)c);
    *cap = *p ? c : 0;
    return *p != NULL;
}

/* What the manager must hold for the batch (well-formed: kvs_executor_check_batch):
 * live sequences, each with room reserved for its new tokens in every layer, no
 * table longer than the devices' rows. */
static kvs_status check(const kvs_kv_cache *kv, const kvs_batch *b) {
    const kvs_kv_config *kc = kvs_kv_get_config(kv);
    int max_blocks = kvs_kv_table_blocks(kc);
    for (int s = 0; s < b->n_seqs; s++) {
        int seq = b->seq_ids[s], q_len = b->query_start[s + 1] - b->query_start[s];
        for (int l = 0; l < kc->n_layers; l++) {
            int nb;
            kvs_kv_blocks(kv, seq, l, &nb);
            if ((int64_t)nb * kc->block_size < (int64_t)kvs_kv_len(kv, seq, l) + q_len)
                return kvs_fail(KVS_ERR_INVALID, "step: sequence %d has no KV room reserved", seq);
            if (nb > max_blocks)
                return kvs_fail(KVS_ERR_INVALID,
                                "step: sequence %d holds %d KV blocks in layer %d: more than the KV cache's limit of "
                                "%d (max_model_len %d / block size %d)", seq, nb, l, max_blocks, kc->max_len,
                                kc->block_size);
        }
    }
    return KVS_OK;
}

kvs_status kvs_step_plan_build(kvs_step_plan *p, kvs_kv_cache *kv, const kvs_batch *b, const kvs_executor *x,
                               const kvs_kv_device *dev) {
    KVS_TRY(kvs_executor_check_batch(x, b, dev));
    KVS_TRY(check(kv, b));
    const kvs_kv_config *kc = kvs_kv_get_config(kv);
    const int L = kc->n_layers, n = b->n_tokens, ns = b->n_seqs;
    if (!room(&p->slots, &p->cap_slots, (size_t)L * n) || !room(&p->window_rows, &p->cap_rows, (size_t)L * n) ||
        !room(&p->kv_len, &p->cap_len, (size_t)L * ns) || !room(&p->max_blocks, &p->cap_blocks, (size_t)L))
        return kvs_fail(KVS_ERR_NOMEM, "step: out of memory for the plan of %d tokens", n);
    for (int l = 0; l < L; l++) {
        int32_t *slots = p->slots + (size_t)l * n, *rows = p->window_rows + (size_t)l * n;
        int32_t *kv_len = p->kv_len + (size_t)l * ns;
        int most = 1;
        for (int s = 0; s < ns; s++) {
            int seq = b->seq_ids[s], q0 = b->query_start[s], q_len = b->query_start[s + 1] - q0, nb;
            int len = kvs_kv_len(kv, seq, l);
            kvs_kv_slots(kv, seq, l, len, q_len, slots + q0);
            kvs_kv_window_rows(kv, seq, l, b->positions + q0, q_len, rows + q0);
            kv_len[s] = len + q_len;
            kvs_kv_blocks(kv, seq, l, &nb);
            if (nb > most) most = nb;
        }
        p->max_blocks[l] = most;
    }
    p->in = (kvs_step_inputs){*b, p->slots, p->kv_len, p->window_rows, p->max_blocks,
                              kvs_kv_windows_wanted(kv) ? kvs_kv_window_rows_per_seq(kv) : 0};
    /* last: the changes it gives are forgotten, and the ranks must take them */
    return kvs_kv_plan_tables(kv, b->seq_ids, ns, &p->tables);
}

void kvs_step_plan_free(kvs_step_plan *p) {
    free(p->slots);
    free(p->window_rows);
    free(p->kv_len);
    free(p->max_blocks);
    kvs_kv_table_deltas_free(&p->tables);
    kvs_kv_compactions_free(&p->compactions);
    *p = (kvs_step_plan){0};
}
