/* kv policy: what a sequence's KV policy keeps (docs/SPARSITY.md): the
 * policies and their per-layer budgets, calibration profiles, and the blocks a
 * request costs under a policy (what the commands size a pool with). Pure
 * functions of lengths and parameters: no cache needed. */
#ifndef KVS_KV_POLICY_H
#define KVS_KV_POLICY_H

#include "core/core.h"

/* ---- sparsity policies ----------------------------------------------------
 * A sparse layer keeps B_l entries per KV head after prefill: the top
 * (B_l - window) earlier keys by SnapKV score (attention of the last `window`
 * prompt queries, from the prefill's log-sum-exp, summed over each KV group's
 * query heads, max-pooled with kernel `pool`) plus the window itself. During
 * decode a sparse layer that reaches B_l + window entries is re-compressed the
 * same way with its last `window` decode queries, so it never grows past that. */
typedef enum {
    KVS_POLICY_FULL,         /* no sparsity */
    KVS_POLICY_SNAPKV,       /* the same budget in every sparse layer */
    KVS_POLICY_PYRAMIDKV,    /* budgets falling linearly with depth, same total */
    KVS_POLICY_STREAMINGLLM, /* attention sinks + the most recent entries */
} kvs_policy_kind;

/* A per-layer budget profile (kvsparse calibrate writes it; kv/profile.c reads
 * it): for each of n_targets compression targets, the share of the prompt each
 * layer keeps at that target (share[t][l] in (0, 1], mean over layers 1 /
 * compression[t]). A policy with a profile splits its budget among its sparse
 * layers in proportion to the shares of the target nearest its compression. */
#define KVS_KV_PROFILE_MAX_TARGETS 16
typedef struct {
    int n_layers, n_targets;
    double compression[KVS_KV_PROFILE_MAX_TARGETS]; /* ascending, each > 1 */
    float *share[KVS_KV_PROFILE_MAX_TARGETS];       /* [n_layers] each */
} kvs_kv_profile;

/* Reads a profile file / text (the format: docs/SPARSITY.md, "Calibration
 * profiles"), checked against a model of n_layers layers (0: any, the file's);
 * a bad one is refused naming the field (KVS_ERR_FORMAT; a file that cannot be
 * read KVS_ERR_IO). Free with kvs_kv_profile_free. */
kvs_status kvs_kv_profile_load(const char *path, int n_layers, kvs_kv_profile **out);
kvs_status kvs_kv_profile_parse(const char *text, size_t len, int n_layers, kvs_kv_profile **out);
void kvs_kv_profile_free(kvs_kv_profile *p);
/* The target of p nearest (in log ratio) to `compression`. */
int kvs_kv_profile_target(const kvs_kv_profile *p, double compression);

typedef struct {
    kvs_policy_kind kind;
    int budget_tokens;     /* B: mean entries per KV head per sparse layer; 0: use budget_fraction */
    float budget_fraction; /* B = round(fraction x prompt length) when budget_tokens is 0 */
    int full_layers;       /* the first N layers stay full */
    int window;            /* observation window w (16) */
    int pool;              /* max-pool kernel p, odd (7) */
    int min_prompt;        /* prompts shorter than this are not compressed */
    int sinks;             /* streamingllm: first entries always kept (4) */
    float pyramid_beta;    /* pyramidkv: the top sparse layer keeps (B - w) / beta beyond the window (1.5) */
    const kvs_kv_profile *profile; /* per-layer shares of the budget (NULL: the kind's shape); the caller's, outlives the policy */
} kvs_kv_policy;

kvs_kv_policy kvs_kv_policy_default(kvs_policy_kind kind); /* 10% budget, w 32, p 7 */
const char *kvs_kv_policy_name(kvs_policy_kind kind);
/* "full", "snapkv", "pyramidkv", "streamingllm" */
kvs_status kvs_kv_policy_kind_parse(const char *name, kvs_policy_kind *kind);
/* "0.1" or "10%" (fraction of the prompt) or "256" (tokens) */
kvs_status kvs_kv_budget_parse(const char *text, kvs_kv_policy *p);
#define KVS_KV_MAX_WINDOW 512 /* a policy's observation window at most */
kvs_status kvs_kv_policy_validate(const kvs_kv_policy *p, int n_layers);
/* Per-layer budgets B_l for a prompt (-1: the layer stays full). */
void kvs_kv_policy_budgets(const kvs_kv_policy *p, int n_layers, int prompt_len, int *budgets);
/* Blocks (of block_size tokens) one sequence of a prompt_len-token prompt and
 * max_new generated tokens takes under p. peak: the most it holds at once,
 * what a pool must have for it alone: its prompt in every layer before the
 * compaction (plus, with prefix caching, the compaction's own copies of the
 * sparse layers, the prompt's blocks staying cached), or its last token.
 * held: after the compaction with every token generated (a sparse layer keeps
 * at most its budget and a window of decode entries before re-compressing), what
 * each running request keeps in the steady state. */
typedef struct {
    int64_t peak, held;
} kvs_kv_seq_blocks;
kvs_kv_seq_blocks kvs_kv_policy_seq_blocks(const kvs_kv_policy *p, int n_layers, int block_size, bool prefix_caching,
                                           int prompt_len, int max_new);
/* A one-line description, e.g. "pyramidkv budget=10% full_layers=2 window=16 pool=7". */
void kvs_kv_policy_describe(const kvs_kv_policy *p, char *buf, size_t cap);

#endif
