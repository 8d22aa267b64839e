/* The KV pool's size: from --kv-memory or --gpu-memory (bench throughput, serve), or for a number of tokens. */
#include "cli/cli_common.h"

kvs_status kvs_cli_kv_bytes(kvs_loaded *l, double kv_gib, double gpu_gib, const kvs_kv_policy *policy, size_t *bytes) {
    if (gpu_gib <= 0) {
        *bytes = kv_gib > 0 ? (size_t)(kv_gib * (1 << 30)) : (size_t)1 << 30;
        return KVS_OK;
    }
    const kvs_config *c = &l->cfg;
    kvs_model_limits limits = kvs_runner_limits(l->runner);
    kvs_shard shard;
    KVS_TRY(kvs_shard_dims(c, 0, l->world > 0 ? l->world : 1, &shard));
    double cap = gpu_gib * (1 << 30);
    int w = l->world > 0 ? l->world : 1; /* a rank holds 1/w of the weights (embeddings aside) */
    double weights = kvs_config_weight_bytes(c, l->be->weight_dtype, true) / w;
    if (w > 1) weights += (double)c->vocab_size * c->hidden_size * kvs_dtype_size(l->be->weight_dtype);
    /* the model's step buffers and 64 MiB of backend scratch (attention partials, staging) */
    double act = (double)kvs_model_step_bytes(c, &shard, &limits, l->be->act_dtype) + 64.0 * (1 << 20);
    /* a sparse policy's window queries and LSE: [max_num_seqs * window] rows per layer */
    if (policy->kind != KVS_POLICY_FULL)
        act += (double)limits.max_seqs * policy->window * c->n_layers * c->n_heads / w *
               (c->head_dim * kvs_dtype_size(l->be->act_dtype) + sizeof(float));
    double left = cap - weights - act;
    if (left < 1 << 20)
        return kvs_fail(KVS_ERR_INVALID,
                        "--gpu-memory %.2f GiB leaves no room for the KV cache: weights take %.2f GiB and "
                        "activations %.2f GiB", gpu_gib, weights / (1 << 30), act / (1 << 30));
    *bytes = (size_t)left;
    return KVS_OK;
}

size_t kvs_cli_kv_bytes_for(const kvs_loaded *l, int max_tokens, int max_seqs) {
    const kvs_config *c = &l->cfg;
    int w = l->world > 0 ? l->world : 1;
    kvs_kv_config kc = {.n_layers = c->n_layers, .n_kv_heads = c->n_kv_heads / w, .head_dim = c->head_dim,
                        .block_size = KVS_KV_BLOCK_SIZE};
    int64_t blocks = (int64_t)((max_tokens + KVS_KV_BLOCK_SIZE - 1) / KVS_KV_BLOCK_SIZE + 1) * c->n_layers * max_seqs;
    return (size_t)blocks * kvs_kv_block_bytes(&kc, l->be->kv_dtype);
}
