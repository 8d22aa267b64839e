/* server: kvsparse_kv_admit_tokens, the KV capacity a router can route on.
 * The scheduler admits a waiting request when the free blocks (evictable
 * cached ones included) hold its peak: its prompt in every layer, reserved
 * whole at admission, plus, with prefix caching, the blocks its sparse layers
 * are compacted into (the prompt's own stay cached). A sparse policy does not
 * lower that peak (it raises it by the copies); what it frees comes after the
 * prefill, when the request keeps its budgets: free blocks, and so this
 * gauge, grow back while compressed requests run. */
#include "server/server.h"

int64_t kvs_server_kv_admit_tokens(const kvs_kv_policy *p, int n_layers, bool prefix_caching, int64_t free_blocks) {
    if (n_layers <= 0 || free_blocks < n_layers) return 0;
    /* the peak grows with the prompt (but for a block or two of the rounding of
       pyramid budgets) and holds the prompt in every layer, so one past the
       prompt the free blocks hold with every layer full is too long */
    int64_t lo = 0, hi = free_blocks / n_layers * KVS_KV_BLOCK_SIZE + 1;
    if (hi > INT32_MAX) hi = INT32_MAX; /* a prompt's length is an int */
    while (hi - lo > 1) {
        int64_t mid = lo + (hi - lo) / 2;
        kvs_kv_seq_blocks need = kvs_kv_policy_seq_blocks(p, n_layers, KVS_KV_BLOCK_SIZE, prefix_caching, (int)mid, 0);
        if (need.peak <= free_blocks) lo = mid;
        else hi = mid;
    }
    return lo;
}
