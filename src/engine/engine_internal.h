/* engine: the internal state shared by engine.c, scheduler.c, request.c and stats.c. */
#ifndef KVS_ENGINE_INTERNAL_H
#define KVS_ENGINE_INTERNAL_H

#include <pthread.h>

#include "engine/engine.h"

/* The choices of one request with n > 1: the first prefills the prompt, the
 * others wait until it is cached (prompt_ready). */
typedef struct {
    int refs;
    bool prompt_ready;
} kvs_req_group;

/* A token whose logit the request adjusts (backend/sample.h), sorted by id;
 * stop: an EOS or stop id, banned before min_tokens. */
typedef struct {
    kvs_logit_adjust a;
    bool stop;
} kvs_req_adjust;

/* One request: its parameters, its tokens, its place in the scheduler. */
typedef struct kvs_request {
    uint64_t id;
    int index;            /* the choice */
    kvs_req_group *group; /* n > 1 with prefix caching: NULL otherwise */
    kvs_output_fn fn;
    void *user;
    int32_t *prompt;
    int n_prompt;
    int32_t *gen; /* [max_tokens] generated ids */
    int n_gen, max_tokens;
    int32_t *forced; /* [n_forced]: generated ids n_gen < n_forced are these (teacher forcing) */
    int n_forced;
    char *cache_salt; /* NULL: none */
    kvs_sampling_params sampling; /* has_seed always true here: the engine drew one when the request had none */
    int32_t *stop_ids;
    int n_stop_ids;
    char *stop_strings[KVS_MAX_STOP_STRINGS];
    int n_stop_strings;
    int stop_string;   /* 1 + the index of the stop string that ended it (0: none) */
    bool ignore_eos;
    int logprobs, top_logprobs, min_tokens;
    /* logits processing: penalties, logit_bias, bans (process), generated
       tokens counted into adj (counts) */
    kvs_req_adjust *adj;
    int n_adj, cap_adj;
    bool process, counts;
    kvs_grammar *grammar;         /* structured output (a reference), NULL: none */
    kvs_grammar_matcher *matcher; /* made on the engine thread at its first draw */
    bool grammar_failed;          /* no matcher or no mask for it (error holds why): fails after the step */
    kvs_kv_policy policy;
    /* text */
    kvs_detokenizer *detok;
    char *pending; /* decoded text not yet sent (could start a stop string) */
    size_t pending_len, pending_cap;
    /* scheduling: the KV holds tokens [0, n_computed) of prompt ++ gen */
    int seq;          /* kv sequence id, -1 when not running */
    int n_computed;
    int n_cached;     /* prompt tokens the prefix cache gave at admission */
    int32_t *layer_entries; /* [n_layers] at the first token: each layer's KV entries (kvs_kv_len) */
    uint8_t *layer_kind;
    int n_layers;           /* 0 until then */
    int n_sched;      /* tokens scheduled in the current step */
    bool recompute;   /* was preempted after generating: it recomputes its KV (scheduler.c) */
    bool aborted;     /* kvs_engine_abort named its id: take_inputs retires it */
    double t_arrival, t_last_token;
    kvs_finish finish;
    char error[200];
    struct kvs_request *prev, *next;
} kvs_request;

typedef struct {
    kvs_request *head, *tail;
    int n;
} kvs_req_list;

void kvs_list_push_back(kvs_req_list *l, kvs_request *r);
void kvs_list_push_front(kvs_req_list *l, kvs_request *r);
void kvs_list_remove(kvs_req_list *l, kvs_request *r);

struct kvs_engine {
    /* The model and its KV caches, for every tensor-parallel size (a single
       model is wrapped: owns_runner). */
    kvs_runner *runner;
    bool owns_runner;
    const kvs_tokenizer *tok;
    kvs_engine_config cfg;
    kvs_config mcfg;
    int vocab;
    /* run_batch's sampling rows, ids and logprobs [max_num_seqs] */
    kvs_sample_row *sample_rows;
    int32_t *sample_ids;
    float *sample_lp;
    /* the extras (kvs_sample_extras): process rows, adjust entries (grown),
       top logprobs [max_num_seqs][KVS_MAX_TOP_LOGPROBS] */
    kvs_process_row *process_rows;
    kvs_logit_adjust *adjust;
    int cap_adjust;
    int32_t *top_ids;
    float *top_lp;
    /* structured output: the model's vocabulary as bytes (made once, at the
       first grammar request or kvs_engine_grammar_vocab, under gvocab_mu) and
       the step's mask rows [max_num_seqs][mask words] */
    pthread_mutex_t gvocab_mu;
    kvs_grammar_vocab *gvocab;
    uint32_t *masks;
    struct kvs_request **mask_reqs; /* the requests of those rows */
    /* The step (model.h's batch), built by the scheduler: its pointers point at
       the arrays of rows, set once at creation (max_num_batched_tokens tokens,
       max_num_seqs sequences); rows.reqs [n_seqs] are the rows' requests. */
    kvs_batch batch;
    struct {
        int32_t *token_ids, *positions, *query_start, *seq_ids;
        uint8_t *wants_logits;
        struct kvs_request **reqs;
    } rows;
    /* owned by the stepping thread */
    kvs_req_list waiting, running;
    /* guarded by mu */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    kvs_req_list incoming;
    /* every request submitted and not yet ended, by id (ascending: ids only
       grow), with its choices still going and whether an abort named it; grown
       at submit, so an abort needs no memory and is never lost */
    struct kvs_live_request {
        uint64_t id;
        int choices;
        bool aborted;
    } *live;
    int n_live, cap_live;
    int n_abort_pending; /* live entries aborted since the last take_inputs */
    uint64_t next_id;
    int n_queued, n_running; /* mirrors of waiting.n / running.n for submit, idle and stats */
    bool abort_all, stop_requested, thread_started;
    /* kvs_engine_reset_prefix_cache: asked, and how many were done (reset_cv) */
    bool reset_pending;
    uint64_t resets_done;
    pthread_cond_t reset_cv;
    kvs_kv_event_log kv_events; /* the stepping thread's: a step's events on their way to on_kv_events */
    bool failed;        /* a step failed: every request ended, submit refuses (set once, never cleared) */
    char failure[512];  /* why; written before failed is set, constant after */
    pthread_t thread;
    kvs_engine_stats stats;
};

/* request.c */
kvs_status kvs_request_create(const kvs_engine *e, const kvs_request_params *p, kvs_output_fn fn, void *user,
                              kvs_request **out);
void kvs_request_destroy(kvs_request *r);
/* The token at position i of prompt ++ gen. */
static inline int32_t kvs_request_token(const kvs_request *r, int i) {
    return i < r->n_prompt ? r->prompt[i] : r->gen[i - r->n_prompt];
}
static inline int kvs_request_len(const kvs_request *r) { return r->n_prompt + r->n_gen; }
/* Appends a sampled token, applies the stop conditions and delivers the output
 * (finish set when the request ends). */
void kvs_request_append(kvs_engine *e, kvs_request *r, int32_t id, float logprob, const int32_t *top_ids,
                        const float *top_logprobs);
/* Its process row and adjust entries (at adjust[*n_adjust ..], *n_adjust
 * advanced) for the next draw; a neutral row when it needs no processing. */
void kvs_request_process_row(const kvs_request *r, kvs_process_row *row, kvs_logit_adjust *adjust, int *n_adjust);
/* Delivers a final output with no new tokens (abort, error). */
void kvs_request_finish(kvs_engine *e, kvs_request *r, kvs_finish f, const char *error);
/* engine.c: the one place a request ends: r (a choice, in list l) leaves it,
 * its KV sequence freed, its final output delivered with f and msg (f NONE: it
 * was delivered already, with the token that ended it), and freed; the
 * request counts as finished when its last choice ends. */
void kvs_request_retire(kvs_engine *e, kvs_req_list *l, kvs_request *r, kvs_finish f, const char *msg);

/* stop_text.c: how many bytes of the pending text[0..len) may be delivered now:
 * up to the first stop string (then *stopped), else all but a tail that could
 * still grow into one (all of it when final). stops are non-empty C strings;
 * text may hold NUL bytes. Costs O(len + total stop length squared), however
 * long the stream before. */
size_t kvs_stop_sendable(const char *const *stops, int n_stops, const char *text, size_t len, bool final,
                         bool *stopped);

/* scheduler.c: picks this step's batch into e->batch; preempts when the pool runs dry. */
kvs_status kvs_schedule(kvs_engine *e);
void kvs_preempt(kvs_engine *e, kvs_request *r);
/* Frees r's KV sequence (if any). */
void kvs_release_seq(kvs_engine *e, kvs_request *r);

/* stats.c */
void kvs_hist_add(kvs_histogram *h, double v);
/* Recomputes the KV and queue parts of e->stats (call with mu held). */
void kvs_stats_refresh(kvs_engine *e);

#endif
