/* server: GET /metrics, the engine's stats in Prometheus' text format (0.0.4). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/route.h"
#include "server/server.h"

typedef struct {
    char *s;
    size_t len, cap;
    const char *labels; /* model="..." */
} text_buf;

static void put(text_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(text_buf *b, const char *fmt, ...) {
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->s ? b->s + b->len : NULL, b->s ? b->cap - b->len : 0, fmt, ap);
        va_end(ap);
        if (n < 0) return;
        if (b->s && b->len + (size_t)n < b->cap) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = (b->cap + (size_t)n + 1) * 2;
        char *p = realloc(b->s, cap);
        if (!p) return;
        b->s = p;
        b->cap = cap;
    }
}

static void metric(text_buf *b, const char *name, const char *type, const char *help, double v) {
    put(b, "# HELP %s %s\n# TYPE %s %s\n%s{%s} %.17g\n", name, help, name, type, name, b->labels, v);
}

static void histogram(text_buf *b, const char *name, const char *help, const kvs_histogram *h) {
    put(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    uint64_t cum = 0;
    for (int i = 0; i < KVS_HIST_BUCKETS; i++) {
        cum += h->counts[i];
        put(b, "%s_bucket{%s,le=\"%g\"} %llu\n", name, b->labels, kvs_hist_bounds[i], (unsigned long long)cum);
    }
    cum += h->counts[KVS_HIST_BUCKETS];
    put(b, "%s_bucket{%s,le=\"+Inf\"} %llu\n", name, b->labels, (unsigned long long)cum);
    put(b, "%s_sum{%s} %.17g\n%s_count{%s} %llu\n", name, b->labels, h->sum, name, b->labels,
        (unsigned long long)h->n);
}

/* vLLM's names of the values routers read (the Gateway API Inference
 * Extension's endpoint picker, which llm-d builds on, defaults to them), each
 * equal to kvsparse's own name in the same scrape: a router set up for vLLM
 * routes to kvsparse unchanged. A vLLM block is block_size tokens of every
 * layer, a kvsparse block those of one: num_gpu_blocks is the pool in vLLM's
 * blocks, so that block_size x num_gpu_blocks = kvsparse_kv_tokens_capacity.
 * prometheus_client writes a counter's samples and HELP/TYPE with _total. */
static void vllm_names(text_buf *b, const kvs_engine_stats *st, double usage) {
    metric(b, "vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", st->running);
    metric(b, "vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", st->waiting);
    metric(b, "vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", usage);
    put(b, "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig.\n"
           "# TYPE vllm:cache_config_info gauge\n"
           "vllm:cache_config_info{%s,block_size=\"%d\",num_gpu_blocks=\"%lld\"} 1\n",
        b->labels, KVS_KV_BLOCK_SIZE, (long long)(st->kv_tokens_capacity / KVS_KV_BLOCK_SIZE));
    metric(b, "vllm:prefix_cache_queries_total", "counter",
           "Prefix cache queries, in terms of number of queried tokens.", (double)st->prefix_cache_queries);
    metric(b, "vllm:prefix_cache_hits_total", "counter", "Prefix cache hits, in terms of number of cached tokens.",
           (double)st->prefix_cache_hits);
    metric(b, "vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
           (double)st->prompt_tokens_total);
    metric(b, "vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
           (double)st->generation_tokens_total);
    metric(b, "vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.",
           (double)st->preemptions);
}

char *kvs_server_metrics_text(kvs_engine *engine, const kvs_server_config *cfg, const char *model_name,
                              const kvs_server_http_stats *http) {
    kvs_engine_stats st;
    memset(&st, 0, sizeof st);
    if (engine) kvs_engine_get_stats(engine, &st);
    /* a label value escapes backslash, quote and newline */
    char labels[512], *o = labels;
    o += snprintf(o, 32, "model_name=\"");
    for (const char *p = model_name; *p && o < labels + sizeof labels - 8; p++) {
        if (*p == '\\' || *p == '"') *o++ = '\\', *o++ = *p;
        else if (*p == '\n') *o++ = '\\', *o++ = 'n';
        else *o++ = *p;
    }
    *o++ = '"';
    *o = 0;
    text_buf b = {NULL, 0, 0, labels};
    metric(&b, "kvsparse_num_requests_running", "gauge", "Requests in the running batch.", st.running);
    metric(&b, "kvsparse_num_requests_waiting", "gauge", "Requests waiting to be scheduled.", st.waiting);
    metric(&b, "kvsparse_kv_blocks_total", "gauge", "KV blocks in the pool (one block: 16 tokens of one layer).",
           (double)st.kv_blocks_total);
    metric(&b, "kvsparse_kv_blocks_used", "gauge", "KV blocks in use.", (double)st.kv_blocks_used);
    put(&b, "# HELP kvsparse_kv_blocks_in_use KV blocks in use by running requests, per layer kind.\n"
            "# TYPE kvsparse_kv_blocks_in_use gauge\n"
            "kvsparse_kv_blocks_in_use{%s,layer_kind=\"full\"} %lld\n"
            "kvsparse_kv_blocks_in_use{%s,layer_kind=\"sparse\"} %lld\n",
        labels, (long long)st.kv_blocks_full_layers, labels, (long long)st.kv_blocks_sparse_layers);
    double usage = st.kv_blocks_total > 0 ? (double)st.kv_blocks_used / (double)st.kv_blocks_total : 0.0;
    metric(&b, "kvsparse_kv_usage_ratio", "gauge", "Fraction of the KV pool in use.", usage);
    metric(&b, "kvsparse_kv_compression_ratio", "gauge",
           "KV entries a full cache would hold / entries held, over running requests.", st.compression_ratio);
    metric(&b, "kvsparse_kv_tokens_capacity", "gauge", "Tokens the KV pool holds with every layer full.",
           (double)st.kv_tokens_capacity);
    kvs_kv_policy policy = engine ? kvs_engine_default_policy(engine) : kvs_kv_policy_default(KVS_POLICY_FULL);
    metric(&b, "kvsparse_kv_admit_tokens", "gauge",
           "The longest prompt a new request of the default KV policy is admitted with now: its peak (the prompt in "
           "every layer before the compaction) fits in the free blocks.",
           (double)kvs_server_kv_admit_tokens(&policy, engine ? kvs_engine_get_limits(engine).n_layers : 0,
                                              !cfg->no_prefix_caching, st.kv_blocks_total - st.kv_blocks_used));
    metric(&b, "kvsparse_prompt_tokens_total", "counter", "Prompt tokens processed.", (double)st.prompt_tokens_total);
    metric(&b, "kvsparse_generation_tokens_total", "counter", "Tokens generated.", (double)st.generation_tokens_total);
    metric(&b, "kvsparse_requests_finished_total", "counter", "Requests finished.", (double)st.requests_finished);
    metric(&b, "kvsparse_preemptions_total", "counter", "Requests preempted (KV blocks freed, recomputed later).",
           (double)st.preemptions);
    metric(&b, "kvsparse_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
           (double)st.prefix_cache_queries);
    metric(&b, "kvsparse_prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
           (double)st.prefix_cache_hits);
    metric(&b, "kvsparse_prefix_cache_evictions_total", "counter", "Cached KV blocks evicted to make room.",
           (double)st.prefix_cache_evictions);
    metric(&b, "kvsparse_prefix_cache_reusable_blocks", "gauge",
           "Prompt blocks cached in every layer: what the KV events announced and did not remove (0 without them).",
           (double)st.prefix_cache_reusable_blocks);
    put(&b, "# HELP kvsparse_kv_cache_blocks_cached KV blocks in the prefix cache (in use or evictable), per layer kind.\n"
            "# TYPE kvsparse_kv_cache_blocks_cached gauge\n"
            "kvsparse_kv_cache_blocks_cached{%s,layer_kind=\"full\"} %lld\n"
            "kvsparse_kv_cache_blocks_cached{%s,layer_kind=\"sparse\"} %lld\n",
        labels, (long long)st.kv_blocks_cached_full_layers, labels, (long long)st.kv_blocks_cached_sparse_layers);
    metric(&b, "kvsparse_kv_cache_blocks_evictable", "gauge",
           "Cached KV blocks no request holds (counted as free; evicted least recently used).",
           (double)st.kv_blocks_evictable);
    metric(&b, "kvsparse_http_requests_total", "counter", "HTTP requests answered.", (double)http->http_requests);
    metric(&b, "kvsparse_http_errors_total", "counter", "HTTP requests answered with a 4xx or 5xx status.",
           (double)http->http_errors);
    put(&b, "# HELP kvsparse_http_connections Open connections: pending (not a request in flight: sending one, or "
            "idle) or in flight.\n# TYPE kvsparse_http_connections gauge\n"
            "kvsparse_http_connections{%s,state=\"pending\"} %u\nkvsparse_http_connections{%s,state=\"in_flight\"} %u\n",
        labels, http->connections_pending, labels, http->connections_in_flight);
    put(&b, "# HELP kvsparse_http_connections_closed_total Connections shut by the server before their request "
            "was in: past the header deadline, below the body's minimum rate, displaced by another address's "
            "fair share of pending connections; or refused at accept.\n"
            "# TYPE kvsparse_http_connections_closed_total counter\n"
            "kvsparse_http_connections_closed_total{%s,reason=\"header_timeout\"} %llu\n"
            "kvsparse_http_connections_closed_total{%s,reason=\"body_timeout\"} %llu\n"
            "kvsparse_http_connections_closed_total{%s,reason=\"displaced\"} %llu\n"
            "kvsparse_http_connections_closed_total{%s,reason=\"refused\"} %llu\n",
        labels, (unsigned long long)http->header_timeouts, labels, (unsigned long long)http->body_timeouts, labels,
        (unsigned long long)http->displaced, labels, (unsigned long long)http->refused);
    metric(&b, "kvsparse_grammar_cache_bytes", "gauge",
           "Memory of the compiled grammars kept (automata, their mask caches, keys; --grammar-cache-bytes).",
           (double)http->grammar_cache_bytes);
    metric(&b, "kvsparse_grammar_cache_entries", "gauge", "Compiled grammars (and refused schemas) kept.",
           (double)http->grammar_cache_entries);
    histogram(&b, "kvsparse_time_to_first_token_seconds", "Time to first token.", &st.ttft);
    histogram(&b, "kvsparse_inter_token_latency_seconds", "Time between consecutive tokens of a request.", &st.itl);
    if (!cfg->no_vllm_metrics) vllm_names(&b, &st, usage);
    return b.s ? b.s : strdup("");
}

void kvs_http_reset_prefix_cache(kvs_server *s, kvs_http_answer *a) {
    if (!s->engine) kvs_http_answer_errorf(a, 503, NULL, "%s", "no engine");
    else if (kvs_engine_reset_prefix_cache(s->engine) != KVS_OK)
        kvs_http_answer_errorf(a, 503, NULL, "the prefix cache was not reset: %s", kvs_last_error());
    else *a = (kvs_http_answer){.status = 200, .content_type = "application/json", .body = strdup("{\"status\":\"ok\"}")};
}
