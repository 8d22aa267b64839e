/* The KV pool's size: from --kv-memory, --gpu-memory or --gpu-memory-utilization
 * (serve, bench throughput), or for a workload under its policy; and the
 * start-up line that says what it holds. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli_common.h"

#define GIB (1024.0 * 1024.0 * 1024.0)

kvs_cli_memory kvs_cli_memory_default(void) {
    return (kvs_cli_memory){.gpu_util = 0.9};
}

static bool parse_real(const char *s, double lo_excl, double hi, double *out) {
    char *end;
    double v = strtod(s, &end);
    if (end == s || *end || !(v > lo_excl && v <= hi)) return false;
    *out = v;
    return true;
}

int kvs_cli_memory_option(kvs_cli_memory *m, int argc, char **argv, int *i) {
    const char *a = argv[*i];
    bool v = *i + 1 < argc;
    if (!strcmp(a, "--kv-memory") && v) return parse_real(argv[++*i], 0, 1e5, &m->kv_gib) ? 1 : -1;
    if (!strcmp(a, "--gpu-memory") && v) return parse_real(argv[++*i], 0, 1e5, &m->gpu_gib) ? 1 : -1;
    if (!strcmp(a, "--gpu-memory-utilization") && v) {
        if (parse_real(argv[++*i], 0, 1, &m->gpu_util)) return 1;
        fprintf(stderr, "kvsparse: --gpu-memory-utilization takes a share of the card in (0, 1], got '%s'\n", argv[*i]);
        return -1;
    }
    return 0;
}

kvs_status kvs_cli_memory_check(const kvs_cli_memory *m) {
    if (m->kv_gib > 0 && m->gpu_gib > 0) return kvs_fail(KVS_ERR_INVALID, "give --kv-memory or --gpu-memory, not both");
    return KVS_OK;
}

/* What the model takes beyond its weights and step buffers on one rank: the
 * backend's scratch (attention partials, staging: grown on first use), the KV
 * device's copies of the block tables and a sparse policy's window queries and
 * LSE ([max_num_seqs * window] rows per layer). */
static double lazy_bytes(const kvs_loaded *l, const kvs_kv_policy *policy) {
    const kvs_config *c = &l->cfg;
    int w = l->world > 0 ? l->world : 1;
    kvs_step_limits limits = kvs_runner_limits(l->runner);
    double bytes = 64.0 * (1 << 20);
    kvs_kv_config tables = {.n_layers = c->n_layers, .block_size = KVS_KV_BLOCK_SIZE, .n_blocks = 1,
                            .max_seqs = limits.max_seqs, .max_len = limits.max_len};
    bytes += (double)kvs_kv_device_table_bytes(&tables);
    if (policy->kind != KVS_POLICY_FULL)
        bytes += (double)limits.max_seqs * policy->window * c->n_layers * c->n_heads / w *
                 (c->head_dim * kvs_dtype_size(l->be->act_dtype) + sizeof(float));
    return bytes;
}

/* --gpu-memory GiB: the cap less this rank's weights, step buffers and lazy allocations. */
static kvs_status bytes_under_cap(kvs_loaded *l, double gpu_gib, const kvs_kv_policy *policy, double *left) {
    const kvs_config *c = &l->cfg;
    kvs_step_limits limits = kvs_runner_limits(l->runner);
    kvs_shard shard;
    KVS_TRY(kvs_shard_dims(c, 0, l->world > 0 ? l->world : 1, &shard));
    int w = l->world > 0 ? l->world : 1; /* a rank holds 1/w of the weights (embeddings aside) */
    double weights = kvs_config_weight_bytes(c, l->be->weight_dtype, true) / w;
    if (w > 1) weights += (double)c->vocab_size * c->hidden_size * kvs_dtype_size(l->be->weight_dtype);
    double act = (double)kvs_executor_bytes(c, &shard, &limits, l->be->act_dtype) + lazy_bytes(l, policy);
    *left = gpu_gib * GIB - weights - act;
    if (*left < 1 << 20)
        return kvs_fail(KVS_ERR_INVALID,
                        "--gpu-memory %.2f GiB leaves no room for the KV cache: weights take %.2f GiB and "
                        "activations %.2f GiB", gpu_gib, weights / GIB, act / GIB);
    return KVS_OK;
}

/* The share of the card: util x total less what is in use now (the weights,
 * the step buffers, the CUDA context, other processes) and the lazy allocations
 * still to come. With several ranks, the fullest card decides. */
static kvs_status bytes_of_card(kvs_loaded *l, double util, const kvs_kv_policy *policy, double *left) {
    int w = l->world > 0 ? l->world : 1;
    double worst = -1, total_min = 0, used_max = 0;
    for (int r = 0; r < w; r++) {
        kvs_backend *be = l->rank_be ? l->rank_be[r] : l->be;
        size_t free_b = 0, total_b = 0;
        KVS_TRY(be->memory_info(be, &free_b, &total_b));
        double room = util * (double)total_b - (double)(total_b - free_b) - lazy_bytes(l, policy);
        if (worst < 0 || room < worst) worst = room, total_min = (double)total_b, used_max = (double)(total_b - free_b);
    }
    *left = worst;
    if (worst < 1 << 20)
        return kvs_fail(KVS_ERR_NOMEM,
                        "--gpu-memory-utilization %.2f leaves no room for the KV cache: %.2f of the card's %.2f GiB "
                        "are in use after loading the model: raise it, or set --gpu-memory or --kv-memory",
                        util, used_max / GIB, total_min / GIB);
    return KVS_OK;
}

kvs_status kvs_cli_kv_bytes(kvs_loaded *l, const kvs_cli_memory *m, const kvs_kv_policy *policy, size_t *bytes) {
    double left;
    KVS_TRY(kvs_cli_memory_check(m));
    if (m->kv_gib > 0) left = m->kv_gib * GIB;
    else if (m->gpu_gib > 0) KVS_TRY(bytes_under_cap(l, m->gpu_gib, policy, &left));
    else if (l->be->memory_info) KVS_TRY(bytes_of_card(l, m->gpu_util, policy, &left));
    else left = KVS_CLI_HOST_KV_GIB * GIB;
    *bytes = (size_t)left;
    return KVS_OK;
}

size_t kvs_cli_kv_bytes_for(const kvs_loaded *l, const kvs_kv_policy *policy, bool prefix_caching, int prompt_len,
                            int max_new, int max_seqs) {
    const kvs_config *c = &l->cfg;
    int w = l->world > 0 ? l->world : 1;
    kvs_kv_config kc = {.n_layers = c->n_layers, .n_kv_heads = c->n_kv_heads / w, .head_dim = c->head_dim,
                        .block_size = KVS_KV_BLOCK_SIZE};
    kvs_kv_seq_blocks need = kvs_kv_policy_seq_blocks(policy, c->n_layers, KVS_KV_BLOCK_SIZE, prefix_caching,
                                                      prompt_len, max_new);
    /* a block a layer to spare: a decode reserves its next token's block ahead */
    int64_t blocks = (need.peak + c->n_layers) * max_seqs;
    return (size_t)blocks * kvs_kv_block_bytes(&kc, l->be->kv_dtype);
}

/* "1,234,567" */
static const char *grouped(long long v, char *buf, size_t cap) {
    char digits[32];
    int n = snprintf(digits, sizeof digits, "%lld", v < 0 ? -v : v), j = 0;
    if (v < 0 && cap > 1) buf[j++] = '-';
    for (int i = 0; i < n && j + 2 < (int)cap; i++) {
        if (i > 0 && (n - i) % 3 == 0) buf[j++] = ',';
        buf[j++] = digits[i];
    }
    buf[j] = 0;
    return buf;
}

/* Requests of len prompt tokens that run at once under p: each holds its
 * steady-state blocks, and the pool keeps room for one more at its peak
 * (admission needs the whole prompt in every layer before the compaction). */
static long long fit(const kvs_kv_policy *p, int n_layers, bool prefix_caching, int64_t blocks, int len) {
    kvs_kv_seq_blocks s = kvs_kv_policy_seq_blocks(p, n_layers, KVS_KV_BLOCK_SIZE, prefix_caching, len, 0);
    if (s.peak > blocks) return 0;
    return 1 + (blocks - s.peak) / s.held;
}

void kvs_cli_log_capacity(const kvs_loaded *l, const kvs_engine_config *ec, int max_len) {
    const kvs_config *c = &l->cfg;
    int w = l->world > 0 ? l->world : 1, L = c->n_layers;
    kvs_kv_config kc = {.n_layers = L, .n_kv_heads = c->n_kv_heads / w, .head_dim = c->head_dim,
                        .n_heads = c->n_heads / w, .block_size = KVS_KV_BLOCK_SIZE, .max_seqs = ec->max_num_seqs};
    int64_t blocks = kvs_kv_blocks_for_budget(&kc, l->be->kv_dtype, ec->kv_memory_bytes);
    const kvs_kv_policy *p = &ec->default_policy;
    kvs_kv_policy full = *p;
    full.kind = KVS_POLICY_FULL;
    bool pc = ec->enable_prefix_caching;
    int lens[2] = {max_len, max_len < 4000 ? max_len : 4000};
    long long n_full[2], n_pol[2], most = 0;
    for (int i = 0; i < 2; i++) {
        n_full[i] = fit(&full, L, pc, blocks, lens[i]);
        n_pol[i] = fit(p, L, pc, blocks, lens[i]);
        most = n_pol[i] > most ? n_pol[i] : most;
    }
    char tokens[32], len0[32], len1[32], f0[32], f1[32], p0[32], p1[32], kept[32], desc[160], cap[96] = "";
    grouped(blocks / L * KVS_KV_BLOCK_SIZE, tokens, sizeof tokens);
    grouped(lens[0], len0, sizeof len0), grouped(lens[1], len1, sizeof len1);
    grouped(n_full[0], f0, sizeof f0), grouped(n_full[1], f1, sizeof f1);
    grouped(n_pol[0], p0, sizeof p0), grouped(n_pol[1], p1, sizeof p1);
    grouped(n_pol[1] * lens[1], kept, sizeof kept);
    kvs_kv_policy_describe(p, desc, sizeof desc);
    if (most > ec->max_num_seqs) snprintf(cap, sizeof cap, " (--max-num-seqs runs %d at most)", ec->max_num_seqs);
    if (!strcmp(l->be->name, "cpu"))
        kvs_log(KVS_LOG_INFO, "cpu backend: %s weights, %s KV cache, %s kernels", kvs_dtype_name(l->be->weight_dtype),
                kvs_dtype_name(l->be->kv_dtype), kvs_cpu_kernels_name());
    if (p->kind == KVS_POLICY_FULL)
        kvs_log(KVS_LOG_INFO, "KV cache%s: %.2f GiB = %s tokens; requests that fit at once: %s of %s tokens (the "
                "model's maximum), %s of %s tokens%s", w > 1 ? " per GPU" : "", ec->kv_memory_bytes / GIB, tokens, f0,
                len0, f1, len1, cap);
    else
        kvs_log(KVS_LOG_INFO, "KV cache%s: %.2f GiB = %s tokens with a full cache, %s tokens of %s-token prompts "
                "compressed by %s; requests that fit at once, full / compressed: %s / %s of %s tokens (the model's "
                "maximum), %s / %s of %s tokens%s", w > 1 ? " per GPU" : "", ec->kv_memory_bytes / GIB, tokens, kept,
                len1, desc, f0, p0, len0, f1, p1, len1, cap);
}
