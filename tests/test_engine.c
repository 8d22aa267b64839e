/* The continuous-batching engine: batched outputs equal single-sequence runs,
 * chunked prefill, preemption, aborts, stop conditions, validation, stats and
 * the engine thread. Uses the bundled tiny model on the CPU backend. */
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/engine.h"
#include "runner/runner_internal.h" /* a rank's cache */
#include "testutil.h"

typedef struct {
    kvs_config cfg;
    kvs_checkpoint *ck;
    kvs_backend *be;
    kvs_model *m;
    kvs_executor *x; /* m's, for the tests that run steps by hand */
    kvs_tokenizer *tok;
} fixture;

static void fx_open(fixture *f) {
    memset(f, 0, sizeof *f);
    const char *dir = src_path("models/tiny-needle-llama");
    cr_assert_eq(kvs_config_load(dir, &f->cfg), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(kvs_checkpoint_open(dir, &f->cfg, &f->ck), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(kvs_backend_cpu_create(0, &f->be), KVS_OK);
    cr_assert_eq(kvs_model_create(&f->cfg, f->ck, f->be, &f->m), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(kvs_executor_create(f->m, NULL, &f->x), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(kvs_tokenizer_load(dir, &f->tok), KVS_OK, "%s", kvs_last_error());
}

static void fx_close(fixture *f) {
    kvs_tokenizer_destroy(f->tok);
    kvs_executor_destroy(f->x);
    kvs_model_destroy(f->m);
    kvs_checkpoint_destroy(f->ck);
    f->be->destroy(f->be);
}

/* What one request received through the callback. */
typedef struct {
    int32_t ids[512];
    float lp[512];
    int n, deliveries, n_lp;
    char text[8192];
    size_t text_len;
    kvs_finish finish;
    char error[256];
    int finals;
    pthread_mutex_t *mu; /* thread mode */
    int32_t top_ids[64 * KVS_MAX_TOP_LOGPROBS]; /* the first 64 tokens' alternatives */
    float top_lp[64 * KVS_MAX_TOP_LOGPROBS];
    int n_top, index, prompt_tokens;
} sink;

static void on_output(void *user, const kvs_request_output *o) {
    sink *s = user;
    if (s->mu) pthread_mutex_lock(s->mu);
    cr_assert_eq(s->finish, KVS_FINISH_NONE, "delivery after the final one");
    s->index = o->index;
    s->prompt_tokens = o->prompt_tokens;
    for (int i = 0; i < o->n_tokens && s->n < 512; i++) {
        if (o->logprobs) s->lp[s->n_lp++] = o->logprobs[i];
        s->n_top = o->n_top;
        for (int j = 0; j < o->n_top && s->n < 64; j++) {
            s->top_ids[s->n * KVS_MAX_TOP_LOGPROBS + j] = o->top_ids[i * o->n_top + j];
            s->top_lp[s->n * KVS_MAX_TOP_LOGPROBS + j] = o->top_logprobs[i * o->n_top + j];
        }
        s->ids[s->n++] = o->token_ids[i];
    }
    if (o->text_len && s->text_len + o->text_len < sizeof s->text) {
        memcpy(s->text + s->text_len, o->text, o->text_len);
        s->text_len += o->text_len;
    }
    s->deliveries++;
    if (o->finish != KVS_FINISH_NONE) {
        s->finals++;
        if (o->error) snprintf(s->error, sizeof s->error, "%s", o->error);
        cr_assert_eq(o->completion_tokens, s->n);
        s->finish = o->finish;
    }
    if (s->mu) pthread_mutex_unlock(s->mu);
}

static int32_t *random_prompt(uint64_t seed, int n) {
    kvs_rng rng;
    kvs_rng_seed(&rng, seed);
    int32_t *p = malloc(sizeof(int32_t) * n);
    for (int i = 0; i < n; i++) p[i] = (int32_t)(kvs_rng_u64(&rng) % 8000);
    return p;
}

/* Greedy decoding of one sequence straight through the model (the reference). */
static void reference(fixture *f, const int32_t *prompt, int n, int n_new, int32_t *out) {
    kvs_kv_config kc = {.n_layers = f->cfg.n_layers, .n_kv_heads = f->cfg.n_kv_heads, .head_dim = f->cfg.head_dim,
                        .n_heads = f->cfg.n_heads, .block_size = 16, .max_seqs = 1};
    kc.n_blocks = (int64_t)((n + n_new + 15) / 16 + 1) * kc.n_layers;
    kvs_kv_cache *kv;
    cr_assert_eq(kvs_kv_create(&kc, f->be, &kv), KVS_OK);
    int seq = kvs_kv_seq_create(kv);
    float *logits = malloc(sizeof(float) * f->cfg.vocab_size);
    int32_t *pos = malloc(sizeof(int32_t) * n), qs[2] = {0, n};
    for (int i = 0; i < n; i++) pos[i] = i;
    uint8_t want = 1;
    cr_assert_eq(kvs_kv_reserve(kv, seq, n), KVS_OK);
    kvs_batch b = {n, 1, prompt, pos, qs, &seq, &want};
    cr_assert_eq(rig_forward(f->x, &b, kv, logits), KVS_OK, "%s", kvs_last_error());
    kv_keep(kv, &b);
    for (int i = 0; i < n_new; i++) {
        out[i] = argmax_f(logits, f->cfg.vocab_size);
        if (i + 1 == n_new) break;
        int32_t p = n + i, q1[2] = {0, 1};
        cr_assert_eq(kvs_kv_reserve(kv, seq, 1), KVS_OK);
        kvs_batch d = {1, 1, &out[i], &p, q1, &seq, &want};
        cr_assert_eq(rig_forward(f->x, &d, kv, logits), KVS_OK, "%s", kvs_last_error());
        kv_keep(kv, &d);
    }
    free(pos);
    free(logits);
    kvs_kv_destroy(kv);
}

static kvs_request_params greedy_params(const int32_t *prompt, int n, int max_tokens) {
    return (kvs_request_params){.prompt_ids = prompt, .n_prompt = n, .sampling = kvs_sampling_default(),
                                .max_tokens = max_tokens, .ignore_eos = true};
}

static void run_until_idle(kvs_engine *e, int max_steps) {
    for (int i = 0; i < max_steps && !kvs_engine_idle(e); i++) cr_assert_eq(kvs_engine_step(e), KVS_OK, "%s", kvs_last_error());
    cr_assert(kvs_engine_idle(e), "the engine did not finish in %d steps", max_steps);
}

/* Streams ids through a detokenizer: the text of each token and the whole text. */
static char *stream_text(const kvs_tokenizer *tok, const int32_t *ids, int n, size_t *ends) {
    kvs_detokenizer *d = kvs_detokenizer_create(tok, true);
    size_t cap = 1 << 14, len = 0;
    char *text = calloc(cap, 1);
    for (int i = 0; i < n; i++) {
        const char *piece;
        size_t pl;
        cr_assert_eq(kvs_detokenizer_push(d, ids[i], &piece, &pl), KVS_OK);
        cr_assert_lt(len + pl, cap);
        memcpy(text + len, piece, pl);
        len += pl;
        ends[i] = len;
    }
    kvs_detokenizer_destroy(d);
    return text;
}

/* Submits n requests (prompt lengths from lens, seeds from seed0), runs them and checks
 * each against the single-sequence reference. */
static void batch_vs_reference(fixture *f, kvs_engine *e, int n, const int *lens, int n_new, uint64_t seed0,
                               const kvs_kv_policy *policy) {
    sink *sinks = calloc(n, sizeof(sink));
    int32_t **prompts = malloc(sizeof(int32_t *) * n);
    for (int i = 0; i < n; i++) {
        prompts[i] = random_prompt(seed0 + i, lens[i]);
        kvs_request_params p = greedy_params(prompts[i], lens[i], n_new + i % 5);
        p.policy = policy;
        cr_assert_eq(kvs_engine_submit(e, &p, on_output, &sinks[i], NULL), KVS_OK, "%s", kvs_last_error());
    }
    run_until_idle(e, 100000);
    for (int i = 0; i < n; i++) {
        cr_assert_eq(sinks[i].finish, KVS_FINISH_LENGTH, "request %d: %s", i, kvs_finish_name(sinks[i].finish));
        cr_assert_eq(sinks[i].finals, 1);
        cr_assert_eq(sinks[i].n, n_new + i % 5);
        size_t ends[512];
        char *text = stream_text(f->tok, sinks[i].ids, sinks[i].n, ends);
        cr_assert_eq(sinks[i].text_len, strlen(text), "request %d: streamed text", i);
        cr_assert(!memcmp(sinks[i].text, text, sinks[i].text_len), "request %d: streamed text", i);
        free(text);
        if (policy) continue;
        int32_t want[64];
        reference(f, prompts[i], lens[i], sinks[i].n, want);
        for (int k = 0; k < sinks[i].n; k++)
            cr_assert_eq(sinks[i].ids[k], want[k], "request %d (prompt %d) token %d: %d != %d", i, lens[i], k,
                         sinks[i].ids[k], want[k]);
    }
    for (int i = 0; i < n; i++) free(prompts[i]);
    free(prompts);
    free(sinks);
}

Test(engine, batch_of_32_matches_single_runs) {
    fixture f;
    fx_open(&f);
    kvs_engine_config c = kvs_engine_config_default();
    c.max_num_seqs = 16;
    c.max_num_batched_tokens = 96; /* prompts over 96 tokens take several chunks */
    c.kv_memory_bytes = 64 << 20;
    kvs_engine *e;
    cr_assert_eq(kvs_engine_create(f.m, f.tok, &c, &e), KVS_OK, "%s", kvs_last_error());
    int lens[32];
    uint64_t prompt_total = 0, gen_total = 0;
    for (int i = 0; i < 32; i++) {
        lens[i] = 5 + (i * 37) % 260;
        prompt_total += lens[i];
        gen_total += 12 + i % 5;
    }
    batch_vs_reference(&f, e, 32, lens, 12, 1000, NULL);
    kvs_engine_stats s;
    kvs_engine_get_stats(e, &s);
    cr_expect_eq(s.running, 0);
    cr_expect_eq(s.waiting, 0);
    cr_expect_eq(s.kv_blocks_used, 0);
    cr_expect_eq(s.requests_finished, 32);
    cr_expect_eq(s.prompt_tokens_total, prompt_total);
    cr_expect_eq(s.generation_tokens_total, gen_total);
    cr_expect_eq(s.ttft.n, 32);
    cr_expect_eq(s.itl.n, gen_total - 32);
    uint64_t in_buckets = 0;
    for (int b = 0; b <= KVS_HIST_BUCKETS; b++) in_buckets += s.itl.counts[b];
    cr_expect_eq(in_buckets, s.itl.n);
    cr_expect_eq(s.preemptions, 0);
    cr_expect_gt(s.kv_tokens_capacity, 0);
    cr_expect_eq(s.kv_blocks_total * 16 / f.cfg.n_layers, s.kv_tokens_capacity);
    kvs_engine_destroy(e);
    fx_close(&f);
}

Test(engine, preemption_keeps_outputs_and_frees_blocks) {
    fixture f;
    fx_open(&f);
    kvs_engine_config c = kvs_engine_config_default();
    c.max_num_seqs = 8;
    c.max_num_batched_tokens = 256;
    kvs_kv_config kc = {.n_layers = f.cfg.n_layers, .n_kv_heads = f.cfg.n_kv_heads, .head_dim = f.cfg.head_dim,
                        .block_size = 16};
    c.kv_memory_bytes = kvs_kv_block_bytes(&kc, f.be->kv_dtype) * 24 * f.cfg.n_layers; /* 384 tokens a layer */
    kvs_engine *e;
    cr_assert_eq(kvs_engine_create(f.m, f.tok, &c, &e), KVS_OK, "%s", kvs_last_error());
    int lens[8];
    for (int i = 0; i < 8; i++) lens[i] = 30 + 9 * i; /* peaks of 60 .. 130 tokens: 8 don't fit at once */
    batch_vs_reference(&f, e, 8, lens, 30, 2000, NULL);
    kvs_engine_stats s;
    kvs_engine_get_stats(e, &s);
    cr_expect_gt(s.preemptions, 0, "the pool was meant to run dry");
    cr_log_info("preemptions: %llu", (unsigned long long)s.preemptions);
    cr_expect_eq(s.requests_finished, 8);
    cr_expect_eq(s.kv_blocks_used, 0);
    kvs_engine_destroy(e);
    fx_close(&f);
}

static kvs_engine *small_engine(fixture *f, int max_batched) {
    kvs_engine_config c = kvs_engine_config_default();
    c.max_num_seqs = 4;
    c.max_num_batched_tokens = max_batched;
    c.kv_memory_bytes = 16 << 20;
    kvs_engine *e;
    cr_assert_eq(kvs_engine_create(f->m, f->tok, &c, &e), KVS_OK, "%s", kvs_last_error());
    return e;
}

Test(engine, abort_frees_blocks) {
    fixture f;
    fx_open(&f);
    kvs_engine *e = small_engine(&f, 32);
    int32_t *prompt = random_prompt(7, 200);
    sink a = {0}, b = {0}, w = {0};
    uint64_t ida, idb, idw;
    kvs_request_params p = greedy_params(prompt, 200, 20);
    cr_assert_eq(kvs_engine_submit(e, &p, on_output, &a, &ida), KVS_OK);
    p.n_prompt = 20;
    cr_assert_eq(kvs_engine_submit(e, &p, on_output, &b, &idb), KVS_OK);
    cr_assert_eq(kvs_engine_step(e), KVS_OK); /* a: first 32 prompt tokens */
    kvs_engine_stats s;
    kvs_engine_get_stats(e, &s);
    cr_assert_gt(s.kv_blocks_used, 0);
    kvs_engine_abort(e, ida); /* mid-prefill */
    cr_assert_eq(kvs_engine_step(e), KVS_OK);
    cr_assert_eq(a.finish, KVS_FINISH_ABORT);
    cr_assert_eq(a.n, 0);
    while (b.n < 3) cr_assert_eq(kvs_engine_step(e), KVS_OK);
    kvs_engine_abort(e, idb); /* mid-decode */
    cr_assert_eq(kvs_engine_submit(e, &p, on_output, &w, &idw), KVS_OK);
    kvs_engine_abort(e, idw); /* still queued */
    kvs_engine_abort(e, 999999); /* unknown: ignored */
    cr_assert_eq(kvs_engine_step(e), KVS_OK);
    cr_assert_eq(b.finish, KVS_FINISH_ABORT);
    cr_assert_eq(w.finish, KVS_FINISH_ABORT);
    cr_assert(kvs_engine_idle(e));
    kvs_engine_get_stats(e, &s);
    cr_assert_eq(s.kv_blocks_used, 0);
    cr_assert_eq(s.running + s.waiting, 0);
    kvs_engine_abort(e, idb); /* finished: ignored */
    cr_assert_eq(kvs_engine_step(e), KVS_OK);
    cr_assert_eq(b.finals, 1);
    free(prompt);
    kvs_engine_destroy(e);
    fx_close(&f);
}

Test(engine, stop_string_across_tokens) {
    fixture f;
    fx_open(&f);
    kvs_engine *e = small_engine(&f, 512);
    int32_t *ids;
    int n;
    const char *text = "The secret code is 4471. Remember the secret code, then tell a story about it.";
    kvs_encode_options eo = {.add_special_tokens = true};
    cr_assert_eq(kvs_tokenizer_encode(f.tok, text, strlen(text), eo, &ids, &n), KVS_OK);
    sink full = {0};
    kvs_request_params p = greedy_params(ids, n, 40);
    cr_assert_eq(kvs_engine_submit(e, &p, on_output, &full, NULL), KVS_OK);
    run_until_idle(e, 1000);
    size_t ends[512];
    char *all = stream_text(f.tok, full.ids, full.n, ends);
    cr_assert_eq(full.text_len, strlen(all));
    cr_assert(!memcmp(full.text, all, full.text_len), "streamed text differs from the detokenizer's");
    /* a stop string made of the end of one token's text and the start of the next's */
    int k = -1;
    for (int i = 2; i + 1 < full.n && k < 0; i++)
        if (ends[i] - ends[i - 1] >= 2 && ends[i + 1] - ends[i] >= 2) k = i;
    cr_assert(k >= 0, "no two adjacent tokens with text in: %s", all);
    char stop[8] = {0};
    memcpy(stop, all + ends[k] - 2, 4);
    char *hit = strstr(all, stop);
    size_t want_len = hit - all;
    sink s = {0};
    const char *stops[2] = {"no such stop string", stop};
    p.stop_strings = stops;
    p.n_stop_strings = 2;
    cr_assert_eq(kvs_engine_submit(e, &p, on_output, &s, NULL), KVS_OK);
    run_until_idle(e, 1000);
    cr_log_info("stop '%s' in '%s'", stop, all);
    cr_assert_eq(s.finish, KVS_FINISH_STOP);
    cr_assert_eq(s.text_len, want_len, "got '%.*s'", (int)s.text_len, s.text);
    cr_assert(!memcmp(s.text, all, want_len));
    cr_assert_leq(s.n, k + 2);
    free(all);
    free(ids);
    kvs_engine_destroy(e);
    fx_close(&f);
}

/* An engine of 4 sequences in a 64-token context (8 MiB of KV) on f's model. */
static kvs_engine *small_context_engine(fixture *f) {
    kvs_engine_config c = kvs_engine_config_default();
    c.max_num_seqs = 4;
    c.max_model_len = 64;
    c.kv_memory_bytes = 8 << 20;
    kvs_engine *e;
    cr_assert_eq(kvs_engine_create(f->m, f->tok, &c, &e), KVS_OK, "%s", kvs_last_error());
    return e;
}

Test(engine, max_tokens_and_context_limit) {
    fixture f;
    fx_open(&f);
    kvs_engine *e = small_context_engine(&f);
    int32_t *prompt = random_prompt(3, 50);
    sink a = {0}, b = {0};
    kvs_request_params p = greedy_params(prompt, 50, 5);
    p.logprobs = 1;
    cr_assert_eq(kvs_engine_submit(e, &p, on_output, &a, NULL), KVS_OK);
    p.max_tokens = 14; /* exactly up to the context */
    p.logprobs = 0;
    cr_assert_eq(kvs_engine_submit(e, &p, on_output, &b, NULL), KVS_OK);
    p.max_tokens = 15;
    cr_assert_eq(kvs_engine_submit(e, &p, on_output, &b, NULL), KVS_ERR_INVALID);
    cr_assert_str_eq(kvs_last_error(),
                     "this model's maximum context length is 64 tokens; the prompt has 50 and 15 were asked for");
    run_until_idle(e, 1000);
    cr_assert_eq(a.finish, KVS_FINISH_LENGTH);
    cr_assert_eq(a.n, 5);
    cr_assert_eq(a.n_lp, 5);
    for (int i = 0; i < 5; i++) cr_assert(a.lp[i] <= 0 && a.lp[i] > -100, "logprob %g", a.lp[i]);
    cr_assert_eq(b.finish, KVS_FINISH_LENGTH);
    cr_assert_eq(b.n, 14);
    cr_assert_eq(b.n_lp, 0);
    cr_assert_str_eq(kvs_finish_name(b.finish), "length");
    free(prompt);
    kvs_engine_destroy(e);
    fx_close(&f);
}

/* The context's limits are checked at the engine's door, in OpenAI's words,
 * naming the limit broken (the server maps it to the field of its 400). */
Test(engine, door_refuses_prompts_and_max_tokens_beyond_the_context) {
    cr_expect_eq(kvs_length_check(64, 63, 1), KVS_LENGTH_OK);
    cr_expect_eq(kvs_length_check(64, 1, 63), KVS_LENGTH_OK);
    cr_expect_eq(kvs_length_check(64, 64, 1), KVS_LENGTH_PROMPT);
    cr_expect_str_eq(kvs_last_error(), "this model's maximum context length is 64 tokens; the prompt has 64");
    cr_expect_eq(kvs_length_check(64, 100, 0), KVS_LENGTH_PROMPT); /* the prompt first, whatever max_tokens */
    cr_expect_eq(kvs_length_check(64, 60, 5), KVS_LENGTH_MAX_TOKENS);
    cr_expect_str_eq(kvs_last_error(), "this model's maximum context length is 64 tokens; the prompt has 60 and 5 were "
                                       "asked for");
    cr_expect_eq(kvs_length_check(64, 60, 2147483647), KVS_LENGTH_MAX_TOKENS); /* no overflow */

    fixture f;
    fx_open(&f);
    kvs_engine *e = small_context_engine(&f);
    int32_t *prompt = random_prompt(5, 80);
    sink a = {0};
    kvs_request_params p = greedy_params(prompt, 64, 1); /* no room left for a token */
    cr_expect_eq(kvs_engine_submit(e, &p, on_output, &a, NULL), KVS_ERR_INVALID);
    cr_expect_str_eq(kvs_last_error(), "this model's maximum context length is 64 tokens; the prompt has 64");
    p.n_prompt = 80;
    p.max_tokens = 16;
    cr_expect_eq(kvs_engine_submit(e, &p, on_output, &a, NULL), KVS_ERR_INVALID);
    cr_expect_str_eq(kvs_last_error(), "this model's maximum context length is 64 tokens; the prompt has 80");
    p.n_prompt = 60;
    p.max_tokens = 5;
    cr_expect_eq(kvs_engine_submit(e, &p, on_output, &a, NULL), KVS_ERR_INVALID);
    cr_expect_str_eq(kvs_last_error(), "this model's maximum context length is 64 tokens; the prompt has 60 and 5 were "
                                       "asked for");
    cr_expect(kvs_engine_idle(e), "nothing refused was queued");
    p.max_tokens = 4; /* exactly up to the context */
    cr_assert_eq(kvs_engine_submit(e, &p, on_output, &a, NULL), KVS_OK, "%s", kvs_last_error());
    run_until_idle(e, 1000);
    cr_expect_eq(a.finish, KVS_FINISH_LENGTH);
    cr_expect_eq(a.n, 4);
    free(prompt);
    kvs_engine_destroy(e);
    fx_close(&f);
}

static void expect_invalid(kvs_engine *e, const kvs_request_params *p, kvs_status want, const char *field) {
    cr_assert_eq(kvs_engine_submit(e, p, on_output, NULL, NULL), want, "%s", field);
    cr_assert(strstr(kvs_last_error(), field), "'%s' does not name %s", kvs_last_error(), field);
}

Test(engine, submit_validation_and_busy) {
    fixture f;
    fx_open(&f);
    kvs_engine_config c = kvs_engine_config_default();
    c.max_waiting = 2;
    c.kv_memory_bytes = 8 << 20;
    kvs_engine *e;
    cr_assert_eq(kvs_engine_create(f.m, f.tok, &c, &e), KVS_OK, "%s", kvs_last_error());
    int32_t prompt[4] = {1, 2, 3, 4};
    kvs_request_params p = greedy_params(prompt, 0, 4);
    expect_invalid(e, &p, KVS_ERR_INVALID, "prompt");
    p.n_prompt = 4;
    p.max_tokens = 0;
    expect_invalid(e, &p, KVS_ERR_INVALID, "max_tokens");
    p.max_tokens = 8192;
    expect_invalid(e, &p, KVS_ERR_INVALID, "maximum context length");
    p.max_tokens = 4;
    prompt[2] = 8192;
    expect_invalid(e, &p, KVS_ERR_INVALID, "vocabulary");
    prompt[2] = -1;
    expect_invalid(e, &p, KVS_ERR_INVALID, "vocabulary");
    prompt[2] = 3;
    p.sampling.temperature = -1;
    expect_invalid(e, &p, KVS_ERR_INVALID, "temperature");
    p.sampling = kvs_sampling_default();
    p.sampling.top_p = 0;
    expect_invalid(e, &p, KVS_ERR_INVALID, "top_p");
    p.sampling = kvs_sampling_default();
    kvs_kv_policy pol = kvs_kv_policy_default(KVS_POLICY_SNAPKV);
    pol.pool = 4;
    p.policy = &pol;
    expect_invalid(e, &p, KVS_ERR_INVALID, "kv_pool");
    pol = kvs_kv_policy_default(KVS_POLICY_SNAPKV);
    pol.window = 500;
    expect_invalid(e, &p, KVS_ERR_INVALID, "kv_window");
    p.policy = NULL;
    const char *stops[9] = {"a", "b", "c", "d", "e", "f", "g", "h", "i"};
    p.stop_strings = stops;
    p.n_stop_strings = 9;
    expect_invalid(e, &p, KVS_ERR_INVALID, "stop");
    stops[0] = "";
    p.n_stop_strings = 1;
    expect_invalid(e, &p, KVS_ERR_INVALID, "stop");
    p.n_stop_strings = 0;
    expect_invalid(e, &(kvs_request_params){.prompt_ids = prompt, .n_prompt = 4, .max_tokens = 1, .logprobs = -1,
                                            .sampling = kvs_sampling_default()},
                   KVS_ERR_INVALID, "logprobs");
    int32_t forced[5] = {7, 8, 9, 10, 11};
    p.forced_ids = forced;
    p.n_forced = 5; /* > max_tokens */
    expect_invalid(e, &p, KVS_ERR_INVALID, "forced");
    p.n_forced = 4;
    forced[3] = 8192;
    expect_invalid(e, &p, KVS_ERR_INVALID, "forced");
    p.n_forced = 0;
    cr_assert_eq(kvs_engine_submit(e, &p, NULL, NULL, NULL), KVS_OK);
    cr_assert_eq(kvs_engine_submit(e, &p, NULL, NULL, NULL), KVS_OK);
    expect_invalid(e, &p, KVS_ERR_BUSY, "max_waiting");
    run_until_idle(e, 100);
    cr_assert_eq(kvs_engine_submit(e, &p, NULL, NULL, NULL), KVS_OK);
    kvs_engine_destroy(e); /* with a request still queued */
    /* stop strings need a tokenizer; bad engine configurations name the field */
    cr_assert_eq(kvs_engine_create(f.m, NULL, &c, &e), KVS_OK);
    p.stop_strings = stops + 1;
    p.n_stop_strings = 1;
    expect_invalid(e, &p, KVS_ERR_UNSUPPORTED, "stop");
    kvs_engine_destroy(e);
    c.max_num_seqs = 100;
    c.max_num_batched_tokens = 50;
    cr_assert_eq(kvs_engine_create(f.m, NULL, &c, &e), KVS_ERR_INVALID);
    cr_assert(strstr(kvs_last_error(), "max_num_batched_tokens"));
    c = kvs_engine_config_default();
    c.kv_memory_bytes = 1000;
    cr_assert_eq(kvs_engine_create(f.m, NULL, &c, &e), KVS_ERR_INVALID);
    cr_assert(strstr(kvs_last_error(), "kv_memory"));
    fx_close(&f);
}

/* Teacher forcing: a request's forced tokens come back as its tokens, each
 * with the model's logprob (log softmax of the logits after the prompt and the
 * forced tokens before it, straight through the model: within 1e-4); a
 * greedy request in the same batches is unchanged; under a sparse policy the
 * forced tokens come back too. */
Test(engine, forced_tokens_score_a_continuation) {
    fixture f;
    fx_open(&f);
    uint64_t seed = kvs_test_seed();
    enum { N = 300, K = 12 };
    int32_t *prompt = random_prompt(seed, N), *forced = random_prompt(seed + 1, K);
    /* the reference: the prompt, then the forced tokens one at a time */
    int V = f.cfg.vocab_size;
    kvs_kv_config kc = {.n_layers = f.cfg.n_layers, .n_kv_heads = f.cfg.n_kv_heads, .head_dim = f.cfg.head_dim,
                        .n_heads = f.cfg.n_heads, .block_size = 16, .max_seqs = 1};
    kc.n_blocks = (int64_t)((N + K + 15) / 16 + 1) * kc.n_layers;
    kvs_kv_cache *kv;
    cr_assert_eq(kvs_kv_create(&kc, f.be, &kv), KVS_OK);
    int seq = kvs_kv_seq_create(kv);
    float *logits = malloc(sizeof(float) * V);
    double want_lp[K];
    for (int i = 0; i < K; i++) {
        int len = i == 0 ? N : 1;
        int32_t *pos = malloc(sizeof(int32_t) * len), qs[2] = {0, len};
        for (int j = 0; j < len; j++) pos[j] = i == 0 ? j : N + i - 1;
        uint8_t want = 1;
        cr_assert_eq(kvs_kv_reserve(kv, seq, len), KVS_OK);
        kvs_batch b = {len, 1, i == 0 ? prompt : &forced[i - 1], pos, qs, &seq, &want};
        cr_assert_eq(rig_forward(f.x, &b, kv, logits), KVS_OK, "%s", kvs_last_error());
        kv_keep(kv, &b);
        free(pos);
        double m = logits[0], sum = 0;
        for (int v = 1; v < V; v++) m = logits[v] > m ? logits[v] : m;
        for (int v = 0; v < V; v++) sum += exp((double)logits[v] - m);
        want_lp[i] = (double)logits[forced[i]] - m - log(sum);
    }
    kvs_kv_destroy(kv);
    free(logits);
    int32_t greedy_ref[K];
    reference(&f, prompt, N, K, greedy_ref);

    kvs_engine_config c = kvs_engine_config_default();
    c.kv_memory_bytes = 32 << 20;
    c.max_num_batched_tokens = 128; /* chunked prefill beside the other requests' decodes */
    kvs_engine *e;
    cr_assert_eq(kvs_engine_create(f.m, f.tok, &c, &e), KVS_OK, "%s", kvs_last_error());
    kvs_kv_policy snap = kvs_kv_policy_default(KVS_POLICY_SNAPKV);
    snap.budget_fraction = 0.2f;
    snap.min_prompt = 0;
    kvs_request_params full = greedy_params(prompt, N, K), sparse, plain = greedy_params(prompt, N, K);
    full.forced_ids = forced, full.n_forced = K, full.logprobs = 1;
    sparse = full;
    sparse.policy = &snap;
    sink out[3] = {0};
    cr_assert_eq(kvs_engine_submit(e, &full, on_output, &out[0], NULL), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(kvs_engine_submit(e, &plain, on_output, &out[1], NULL), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(kvs_engine_submit(e, &sparse, on_output, &out[2], NULL), KVS_OK, "%s", kvs_last_error());
    run_until_idle(e, 1000);
    for (int r = 0; r < 3; r++) cr_assert_eq(out[r].n, K, "request %d: %d tokens (%s)", r, out[r].n, out[r].error);
    cr_assert_eq(out[0].n_lp, K);
    for (int i = 0; i < K; i++) {
        cr_expect_eq(out[0].ids[i], forced[i], "token %d: %d, forced %d", i, out[0].ids[i], forced[i]);
        cr_expect_eq(out[2].ids[i], forced[i], "sparse token %d: %d, forced %d", i, out[2].ids[i], forced[i]);
        cr_expect(fabs(out[0].lp[i] - want_lp[i]) <= 1e-4 * fmax(1, fabs(want_lp[i])), "token %d: logprob %g, want %g",
                  i, out[0].lp[i], want_lp[i]);
        cr_expect_eq(out[1].ids[i], greedy_ref[i], "greedy token %d: %d, reference %d", i, out[1].ids[i], greedy_ref[i]);
    }
    kvs_engine_destroy(e);
    free(prompt);
    free(forced);
    fx_close(&f);
}

/* Runs P1 then P2 (one after the other) on e; P2's tokens into out, the
 * prompt tokens P2 found cached into *hits. */
static void two_turns(kvs_engine *e, const int32_t *p1, int n1, const int32_t *p2, int n2, const kvs_kv_policy *pol,
                      sink *out, uint64_t *hits) {
    sink first = {0};
    kvs_request_params a = greedy_params(p1, n1, 12), b = greedy_params(p2, n2, 12);
    a.policy = b.policy = pol;
    cr_assert_eq(kvs_engine_submit(e, &a, on_output, &first, NULL), KVS_OK, "%s", kvs_last_error());
    run_until_idle(e, 1000);
    kvs_engine_stats s0, s1;
    kvs_engine_get_stats(e, &s0);
    memset(out, 0, sizeof *out);
    cr_assert_eq(kvs_engine_submit(e, &b, on_output, out, NULL), KVS_OK, "%s", kvs_last_error());
    run_until_idle(e, 1000);
    kvs_engine_get_stats(e, &s1);
    *hits = s1.prefix_cache_hits - s0.prefix_cache_hits;
    cr_assert_eq(s1.prefix_cache_queries - s0.prefix_cache_queries, (uint64_t)n2);
    cr_assert_eq(out->n, 12, "%s", out->error);
}

/* A follow-up sharing a 600-token document: with the cache it reuses the
 * document's whole blocks (592 tokens) and answers exactly as without the
 * cache, for the full cache, snapkv and pyramidkv (compacted for itself), and
 * over two tensor-parallel ranks (the ranks' caches decide alike). */
Test(engine, prefix_cache_reuses_a_shared_document_and_answers_alike, .timeout = 600) {
    fixture f;
    fx_open(&f);
    uint64_t seed = kvs_test_seed();
    enum { DOC = 600, Q = 40 };
    int32_t *p1 = random_prompt(seed, DOC + Q), *p2 = random_prompt(seed + 1, DOC + Q);
    memcpy(p2, p1, sizeof(int32_t) * DOC);
    kvs_kv_policy pols[3] = {kvs_kv_policy_default(KVS_POLICY_FULL), kvs_kv_policy_default(KVS_POLICY_SNAPKV),
                             kvs_kv_policy_default(KVS_POLICY_PYRAMIDKV)};
    for (int i = 1; i < 3; i++) kvs_kv_budget_parse("20%", &pols[i]);
    kvs_engine_config c = kvs_engine_config_default();
    c.kv_memory_bytes = 32 << 20;
    c.max_num_batched_tokens = 256;
    for (int pi = 0; pi < 3; pi++) {
        sink cached, plain, tp;
        uint64_t hits, plain_hits, tp_hits;
        kvs_engine *e;
        c.enable_prefix_caching = true;
        cr_assert_eq(kvs_engine_create(f.m, f.tok, &c, &e), KVS_OK, "%s", kvs_last_error());
        two_turns(e, p1, DOC + Q, p2, DOC + Q, &pols[pi], &cached, &hits);
        kvs_engine_stats s;
        kvs_engine_get_stats(e, &s);
        cr_expect_eq(s.kv_blocks_used, 0, "the finished requests hold nothing");
        cr_expect(s.kv_blocks_evictable > 0 && s.kv_blocks_cached_full_layers > 0);
        kvs_engine_destroy(e);
        c.enable_prefix_caching = false;
        cr_assert_eq(kvs_engine_create(f.m, f.tok, &c, &e), KVS_OK, "%s", kvs_last_error());
        two_turns(e, p1, DOC + Q, p2, DOC + Q, &pols[pi], &plain, &plain_hits);
        kvs_engine_destroy(e);
        c.enable_prefix_caching = true;
        kvs_runner *g2;
        cr_assert_eq(kvs_runner_create_cpu(&f.cfg, f.ck, 2, 1, KVS_F32, KVS_F32, NULL, &g2), KVS_OK, "%s", kvs_last_error());
        kvs_engine_config c2 = c;
        c2.kv_memory_bytes /= 2;
        cr_assert_eq(kvs_engine_create_runner(g2, f.tok, &c2, &e), KVS_OK, "%s", kvs_last_error());
        two_turns(e, p1, DOC + Q, p2, DOC + Q, &pols[pi], &tp, &tp_hits);
        kvs_engine_destroy(e);
        kvs_runner_destroy(g2);
        cr_log_info("policy %d: %llu tokens reused (TP=2: %llu)", pi, (unsigned long long)hits,
                    (unsigned long long)tp_hits);
        cr_expect_eq(hits, 592, "policy %d: %llu tokens reused", pi, (unsigned long long)hits);
        cr_expect_eq(tp_hits, 592);
        cr_expect_eq(plain_hits, 0);
        for (int k = 0; k < 12; k++) {
            cr_expect_eq(cached.ids[k], plain.ids[k], "policy %d token %d: %d with the cache, %d without", pi, k,
                         cached.ids[k], plain.ids[k]);
            cr_expect_eq(tp.ids[k], plain.ids[k], "policy %d token %d: %d at TP=2, %d", pi, k, tp.ids[k], plain.ids[k]);
        }
    }
    free(p1), free(p2);
    fx_close(&f);
}

Test(engine, sparse_policy_compresses) {
    fixture f;
    fx_open(&f);
    kvs_engine_config c = kvs_engine_config_default();
    c.max_num_seqs = 4;
    c.max_num_batched_tokens = 256;
    c.kv_memory_bytes = 32 << 20;
    c.default_policy = kvs_kv_policy_default(KVS_POLICY_SNAPKV); /* 10% */
    kvs_engine *e;
    cr_assert_eq(kvs_engine_create(f.m, f.tok, &c, &e), KVS_OK, "%s", kvs_last_error());
    int32_t *prompt = random_prompt(11, 600);
    sink s[3] = {0};
    kvs_request_params p = greedy_params(prompt, 600, 24);
    cr_assert_eq(kvs_engine_submit(e, &p, on_output, &s[0], NULL), KVS_OK);
    kvs_kv_policy pyr = kvs_kv_policy_default(KVS_POLICY_PYRAMIDKV);
    pyr.full_layers = 2;
    p.policy = &pyr;
    p.n_prompt = 550;
    cr_assert_eq(kvs_engine_submit(e, &p, on_output, &s[1], NULL), KVS_OK);
    kvs_kv_policy full = kvs_kv_policy_default(KVS_POLICY_FULL);
    p.policy = &full;
    p.n_prompt = 300;
    cr_assert_eq(kvs_engine_submit(e, &p, on_output, &s[2], NULL), KVS_OK);
    double best_ratio = 0;
    int64_t sparse_blocks = 0, full_blocks = 0;
    while (!kvs_engine_idle(e)) {
        cr_assert_eq(kvs_engine_step(e), KVS_OK, "%s", kvs_last_error());
        kvs_engine_stats st;
        kvs_engine_get_stats(e, &st);
        cr_assert_eq(st.kv_blocks_full_layers + st.kv_blocks_sparse_layers, st.kv_blocks_used);
        if (st.running == 3 && s[0].n > 0 && s[1].n > 0 && s[2].n > 0 && st.compression_ratio > best_ratio) {
            best_ratio = st.compression_ratio;
            sparse_blocks = st.kv_blocks_sparse_layers;
            full_blocks = st.kv_blocks_full_layers;
        }
    }
    cr_log_info("compression %.2fx, blocks: %lld in full layers, %lld in sparse layers", best_ratio,
                (long long)full_blocks, (long long)sparse_blocks);
    /* 1450 tokens x 8 layers held as: 600 x 10% + 550 x ~10% in 6 layers + full rest */
    cr_assert_gt(best_ratio, 1.8);
    cr_assert_gt(sparse_blocks, 0);
    for (int i = 0; i < 3; i++) {
        cr_assert_eq(s[i].finish, KVS_FINISH_LENGTH);
        cr_assert_eq(s[i].n, 24);
    }
    /* the full-policy request is unaffected by its sparse neighbours */
    int32_t want[24];
    reference(&f, prompt, 300, 24, want);
    for (int k = 0; k < 24; k++) cr_assert_eq(s[2].ids[k], want[k], "token %d", k);
    kvs_engine_stats st;
    kvs_engine_get_stats(e, &st);
    cr_assert_eq(st.kv_blocks_used, 0);
    free(prompt);
    kvs_engine_destroy(e);
    fx_close(&f);
}

typedef struct {
    kvs_engine *e;
    int32_t *prompt;
    sink *sinks; /* 4 */
    int base_len;
} submitter;

static void *submit_four(void *arg) {
    submitter *t = arg;
    for (int i = 0; i < 4; i++) {
        kvs_request_params p = greedy_params(t->prompt, t->base_len + 7 * i, 8 + i);
        cr_assert_eq(kvs_engine_submit(t->e, &p, on_output, &t->sinks[i], NULL), KVS_OK, "%s", kvs_last_error());
        kvs_engine_stats s;
        kvs_engine_get_stats(t->e, &s);
    }
    return NULL;
}

Test(engine, thread_mode) {
    fixture f;
    fx_open(&f);
    kvs_engine *e = small_engine(&f, 128);
    cr_assert_eq(kvs_engine_start(e), KVS_OK);
    cr_assert_eq(kvs_engine_step(e), KVS_ERR_INVALID);
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    sink sinks[16] = {0};
    for (int i = 0; i < 16; i++) sinks[i].mu = &mu;
    int32_t *prompt = random_prompt(5, 100);
    submitter subs[4];
    pthread_t th[4];
    for (int t = 0; t < 4; t++) {
        subs[t] = (submitter){e, prompt, sinks + 4 * t, 20 + 10 * t};
        pthread_create(&th[t], NULL, submit_four, &subs[t]);
    }
    for (int t = 0; t < 4; t++) pthread_join(th[t], NULL);
    for (int tries = 0;; tries++) {
        int done = 0;
        pthread_mutex_lock(&mu);
        for (int i = 0; i < 16; i++) done += sinks[i].finish != KVS_FINISH_NONE;
        pthread_mutex_unlock(&mu);
        if (done == 16) break;
        cr_assert_lt(tries, 6000, "requests did not finish");
        usleep(20000);
    }
    for (int t = 0; t < 4; t++)
        for (int i = 0; i < 4; i++) {
            sink *s = &sinks[4 * t + i];
            cr_assert_eq(s->finish, KVS_FINISH_LENGTH);
            cr_assert_eq(s->n, 8 + i);
            int32_t want[16];
            reference(&f, prompt, 20 + 10 * t + 7 * i, s->n, want);
            for (int k = 0; k < s->n; k++) cr_assert_eq(s->ids[k], want[k]);
        }
    /* more work, then stop with draining; then a second engine stopped without */
    sink late = {.mu = &mu};
    kvs_request_params p = greedy_params(prompt, 60, 10);
    cr_assert_eq(kvs_engine_submit(e, &p, on_output, &late, NULL), KVS_OK);
    kvs_engine_stop(e, true);
    cr_assert_eq(late.finish, KVS_FINISH_LENGTH);
    cr_assert_eq(late.n, 10);
    cr_assert_eq(kvs_engine_submit(e, &p, on_output, &late, NULL), KVS_ERR_BUSY);
    kvs_engine_destroy(e);

    e = small_engine(&f, 128);
    cr_assert_eq(kvs_engine_start(e), KVS_OK);
    sink ab[6] = {0};
    p.max_tokens = 200;
    for (int i = 0; i < 6; i++) {
        ab[i].mu = &mu;
        cr_assert_eq(kvs_engine_submit(e, &p, on_output, &ab[i], NULL), KVS_OK);
    }
    usleep(100000);
    kvs_engine_stop(e, false);
    for (int i = 0; i < 6; i++) {
        cr_assert_eq(ab[i].finish, KVS_FINISH_ABORT);
        cr_assert_eq(ab[i].finals, 1);
    }
    kvs_engine_stats s;
    kvs_engine_get_stats(e, &s);
    cr_assert_eq(s.kv_blocks_used, 0);
    kvs_engine_destroy(e);
    free(prompt);
    fx_close(&f);
}

/* The engine over tensor-parallel groups: a 2-rank CPU group (host
 * communicator, each rank its half of the heads and its own KV pool) gives the
 * same greedy outputs as a world-1 group and as the plain model, with full and
 * snapkv policies, chunked prefill and preemption included. */
static void engine_run_all(kvs_engine *e, int n, int32_t **prompts, const int *lens, int max_tokens, sink *sinks,
                           const kvs_kv_policy *policy) {
    for (int i = 0; i < n; i++) {
        kvs_request_params p = greedy_params(prompts[i], lens[i], max_tokens);
        p.policy = policy;
        cr_assert_eq(kvs_engine_submit(e, &p, on_output, &sinks[i], NULL), KVS_OK, "%s", kvs_last_error());
    }
    run_until_idle(e, 4000);
    for (int i = 0; i < n; i++) cr_assert_eq(sinks[i].finish, KVS_FINISH_LENGTH, "request %d: %s", i, sinks[i].error);
}

Test(engine, tensor_parallel_group_matches_one_rank) {
    fixture f;
    fx_open(&f);
    enum { N = 10, MAX_TOKENS = 24 };
    int32_t *prompts[N];
    int lens[N];
    for (int i = 0; i < N; i++) {
        lens[i] = 20 + (i * 53) % 200;
        prompts[i] = random_prompt(900 + i, lens[i]);
    }
    kvs_kv_policy policies[2] = {kvs_kv_policy_default(KVS_POLICY_FULL), kvs_kv_policy_default(KVS_POLICY_SNAPKV)};
    kvs_kv_budget_parse("25%", &policies[1]);
    for (int pi = 0; pi < 2; pi++) {
        sink *want = calloc(N, sizeof(sink)), *got1 = calloc(N, sizeof(sink)), *got2 = calloc(N, sizeof(sink));
        kvs_engine_config c = kvs_engine_config_default();
        c.max_num_seqs = 4;
        c.max_num_batched_tokens = 64; /* chunked prefill */
        kvs_kv_config kc = {.n_layers = f.cfg.n_layers, .n_kv_heads = f.cfg.n_kv_heads, .head_dim = f.cfg.head_dim,
                            .block_size = 16};
        c.kv_memory_bytes = kvs_kv_block_bytes(&kc, f.be->kv_dtype) * 40 * f.cfg.n_layers; /* tight: preemption */
        kvs_engine *e;
        cr_assert_eq(kvs_engine_create(f.m, f.tok, &c, &e), KVS_OK, "%s", kvs_last_error());
        engine_run_all(e, N, prompts, lens, MAX_TOKENS, want, &policies[pi]);
        kvs_engine_destroy(e);

        kvs_runner *g1, *g2;
        cr_assert_eq(kvs_runner_create_cpu(&f.cfg, f.ck, 1, 0, KVS_F32, KVS_F32, NULL, &g1), KVS_OK, "%s", kvs_last_error());
        cr_assert_eq(kvs_engine_create_runner(g1, f.tok, &c, &e), KVS_OK, "%s", kvs_last_error());
        engine_run_all(e, N, prompts, lens, MAX_TOKENS, got1, &policies[pi]);
        kvs_engine_destroy(e);
        kvs_runner_destroy(g1);

        cr_assert_eq(kvs_runner_create_cpu(&f.cfg, f.ck, 2, 1, KVS_F32, KVS_F32, NULL, &g2), KVS_OK, "%s", kvs_last_error());
        /* per-rank budget: each rank holds half the heads, so half the bytes give the same blocks */
        c.kv_memory_bytes /= 2;
        cr_assert_eq(kvs_engine_create_runner(g2, f.tok, &c, &e), KVS_OK, "%s", kvs_last_error());
        cr_assert_eq(kvs_kv_device_config(kvs_runner_kv_device(g2, 1))->n_kv_heads, f.cfg.n_kv_heads / 2);
        engine_run_all(e, N, prompts, lens, MAX_TOKENS, got2, &policies[pi]);
        kvs_engine_stats s;
        kvs_engine_get_stats(e, &s);
        cr_expect_eq(s.kv_blocks_used, 0);
        cr_expect_eq(kvs_kv_used_blocks(kvs_runner_kv(g2)), 0, "blocks kept");
        cr_log_info("policy %d: TP=2 preemptions %llu", pi, (unsigned long long)s.preemptions);
        kvs_engine_destroy(e);
        kvs_runner_destroy(g2);

        for (int i = 0; i < N; i++) {
            cr_assert_eq(got1[i].n, want[i].n);
            cr_assert_eq(got2[i].n, want[i].n);
            for (int k = 0; k < want[i].n; k++) {
                cr_assert_eq(got1[i].ids[k], want[i].ids[k], "policy %d request %d token %d (world 1)", pi, i, k);
                cr_assert_eq(got2[i].ids[k], want[i].ids[k], "policy %d request %d token %d (world 2)", pi, i, k);
            }
        }
        free(want);
        free(got1);
        free(got2);
    }
    for (int i = 0; i < N; i++) free(prompts[i]);
    fx_close(&f);
}

/* ---- preemption of sparse requests ------------------------------------------------
 * A preempted request gives the tokens it would have given unpreempted. Two
 * full-policy neighbours (40-token prompts, 200 tokens each) are admitted
 * first; the request under test (200-token prompt, 150 tokens, budget 25%,
 * window 32: decode re-compressions every 32 tokens) comes last, so it is the
 * newest and the victim when the neighbours' growth dries a 200-block pool
 * (after ~90 of its tokens); it is re-admitted and recomputed. Its tokens must
 * equal those of the request alone in a pool that never runs dry, and so must
 * the logprobs of the tokens after the preemption (the same compaction: a
 * recompute with another budget or observation window moves them by ~0.1 and,
 * for this prompt, changes tokens 95 (pyramidkv) and 118 (snapkv)). */
enum { PRE_NEIGHBOURS = 2, PRE_PROMPT = 200, PRE_TOKENS = 150 };

typedef struct {
    sink target;
    unsigned long long preemptions;
    int tokens_at_preemption; /* the target's tokens when first seen waiting again; -1: never */
} preempt_run;

static void run_with_neighbours(fixture *f, const kvs_kv_policy *policy, int64_t pool_blocks, bool neighbours,
                                preempt_run *out) {
    memset(out, 0, sizeof *out);
    out->tokens_at_preemption = -1;
    kvs_engine_config c = kvs_engine_config_default();
    c.max_num_seqs = 4;
    c.max_num_batched_tokens = 256;
    kvs_kv_config kc = {.n_layers = f->cfg.n_layers, .n_kv_heads = f->cfg.n_kv_heads, .head_dim = f->cfg.head_dim,
                        .block_size = 16};
    c.kv_memory_bytes = kvs_kv_block_bytes(&kc, f->be->kv_dtype) * (size_t)pool_blocks;
    kvs_engine *e;
    cr_assert_eq(kvs_engine_create(f->m, f->tok, &c, &e), KVS_OK, "%s", kvs_last_error());
    sink others[PRE_NEIGHBOURS] = {0};
    int32_t *prompts[PRE_NEIGHBOURS];
    kvs_kv_policy full = kvs_kv_policy_default(KVS_POLICY_FULL);
    for (int i = 0; neighbours && i < PRE_NEIGHBOURS; i++) {
        prompts[i] = random_prompt(3100 + i, 40);
        kvs_request_params p = greedy_params(prompts[i], 40, 200);
        p.policy = &full;
        cr_assert_eq(kvs_engine_submit(e, &p, on_output, &others[i], NULL), KVS_OK, "%s", kvs_last_error());
    }
    int32_t *prompt = random_prompt(5, PRE_PROMPT);
    kvs_request_params p = greedy_params(prompt, PRE_PROMPT, PRE_TOKENS);
    p.policy = policy;
    p.logprobs = 1;
    cr_assert_eq(kvs_engine_submit(e, &p, on_output, &out->target, NULL), KVS_OK, "%s", kvs_last_error());
    for (int i = 0; i < 5000 && !kvs_engine_idle(e); i++) {
        cr_assert_eq(kvs_engine_step(e), KVS_OK, "%s", kvs_last_error());
        kvs_engine_stats s;
        kvs_engine_get_stats(e, &s);
        /* the neighbours never wait once admitted (they are older): a waiting request is the target */
        if (s.waiting > 0 && out->target.n > 0 && out->target.finish == KVS_FINISH_NONE &&
            out->tokens_at_preemption < 0)
            out->tokens_at_preemption = out->target.n;
    }
    cr_assert(kvs_engine_idle(e), "the engine did not finish");
    kvs_engine_stats s;
    kvs_engine_get_stats(e, &s);
    out->preemptions = s.preemptions;
    cr_assert_eq(s.kv_blocks_used, 0);
    cr_assert_eq(out->target.finish, KVS_FINISH_LENGTH, "%s", out->target.error);
    cr_assert_eq(out->target.n, PRE_TOKENS);
    for (int i = 0; neighbours && i < PRE_NEIGHBOURS; i++) {
        cr_assert_eq(others[i].finish, KVS_FINISH_LENGTH, "neighbour %d: %s", i, others[i].error);
        free(prompts[i]);
    }
    free(prompt);
    kvs_engine_destroy(e);
}

static void preempted_equals_unpreempted(kvs_policy_kind kind) {
    fixture f;
    fx_open(&f);
    kvs_kv_policy pol = kvs_kv_policy_default(kind);
    kvs_kv_budget_parse("25%", &pol);
    pol.full_layers = kind == KVS_POLICY_FULL ? 0 : 1;
    const char *name = kvs_kv_policy_name(kind);
    preempt_run alone, tight;
    run_with_neighbours(&f, &pol, 4000, false, &alone);
    run_with_neighbours(&f, &pol, 200, true, &tight);
    cr_assert_eq(alone.preemptions, 0);
    cr_assert_gt(tight.preemptions, 0, "%s: the 200-block pool was meant to run dry", name);
    int k0 = tight.tokens_at_preemption;
    /* sparse: preempted after decode re-compressions (every window = 32 tokens past the budget) */
    cr_assert_geq(k0, kind == KVS_POLICY_FULL ? 1 : 2 * pol.window, "%s: preempted after %d tokens", name, k0);
    for (int k = 0; k < PRE_TOKENS; k++)
        cr_assert_eq(tight.target.ids[k], alone.target.ids[k], "%s token %d: preempted %d, not preempted %d", name,
                     k, tight.target.ids[k], alone.target.ids[k]);
    /* the tokens after the preemption come from the recomputed KV: the same
       compaction gives the same logprobs, up to the rounding of other batches
       (another observation window or budget moves them by ~1e-1) */
    double before = 0, after = 0;
    for (int k = 0; k < PRE_TOKENS; k++) {
        double d = fabs((double)tight.target.lp[k] - alone.target.lp[k]);
        if (k < k0) before = d > before ? d : before;
        else after = d > after ? d : after;
    }
    fprintf(stderr, "%s: %llu preemptions, the first after %d of %d tokens; max |logprob diff| vs not preempted: "
            "%.2e before it, %.2e after\n", name, tight.preemptions, k0, PRE_TOKENS, before, after);
    cr_assert_eq(tight.target.n_lp, PRE_TOKENS);
    cr_assert_leq(after, 1e-3, "%s: logprobs after the preemption differ by %g", name, after);
    cr_assert_eq(tight.target.text_len, alone.target.text_len);
    cr_assert(!memcmp(tight.target.text, alone.target.text, alone.target.text_len), "%s: streamed text", name);
    fx_close(&f);
}

Test(engine, preempted_snapkv_request_gives_the_same_tokens, .timeout = 600) {
    preempted_equals_unpreempted(KVS_POLICY_SNAPKV);
}
Test(engine, preempted_pyramidkv_request_gives_the_same_tokens, .timeout = 600) {
    preempted_equals_unpreempted(KVS_POLICY_PYRAMIDKV);
}
Test(engine, preempted_full_request_gives_the_same_tokens, .timeout = 600) {
    preempted_equals_unpreempted(KVS_POLICY_FULL);
}

/* The sampling parameters' ranges (the engine refuses a request outside them). */
Test(engine, sampling_validation_names_the_parameter) {
    kvs_sampling_params p = kvs_sampling_default();
    p.temperature = -1;
    cr_assert_eq(kvs_sampling_validate(&p), KVS_ERR_INVALID);
    cr_assert(strstr(kvs_last_error(), "temperature"));
    p = kvs_sampling_default();
    p.top_p = 0;
    cr_assert_eq(kvs_sampling_validate(&p), KVS_ERR_INVALID);
    cr_assert(strstr(kvs_last_error(), "top_p"));
    p = kvs_sampling_default();
    p.min_p = 2;
    cr_assert(strstr((kvs_sampling_validate(&p), kvs_last_error()), "min_p"));
    p = kvs_sampling_default();
    p.top_k = -3;
    cr_assert_eq(kvs_sampling_validate(&p), KVS_ERR_INVALID);
    p = kvs_sampling_default();
    p.temperature = NAN;
    cr_assert_eq(kvs_sampling_validate(&p), KVS_ERR_INVALID);
}

/* ---- sampling controls and n > 1 -------------------------------------------- */
/* The logits after the prompt and tokens (a fresh forward over them all). */
static void logits_after(fixture *f, const int32_t *toks, int n, float *logits) {
    kvs_kv_config kc = {.n_layers = f->cfg.n_layers, .n_kv_heads = f->cfg.n_kv_heads, .head_dim = f->cfg.head_dim,
                        .n_heads = f->cfg.n_heads, .block_size = 16, .max_seqs = 1};
    kc.n_blocks = (int64_t)((n + 15) / 16 + 1) * kc.n_layers;
    kvs_kv_cache *kv;
    cr_assert_eq(kvs_kv_create(&kc, f->be, &kv), KVS_OK);
    int seq = kvs_kv_seq_create(kv);
    int32_t *pos = malloc(sizeof(int32_t) * n), qs[2] = {0, n};
    for (int i = 0; i < n; i++) pos[i] = i;
    uint8_t want = 1;
    cr_assert_eq(kvs_kv_reserve(kv, seq, n), KVS_OK);
    kvs_batch b = {n, 1, toks, pos, qs, &seq, &want};
    cr_assert_eq(rig_forward(f->x, &b, kv, logits), KVS_OK, "%s", kvs_last_error());
    free(pos);
    kvs_kv_destroy(kv);
}

/* Greedy with presence, frequency and repetition penalties and logit_bias,
 * each step against the penalties applied by hand (double) to the logits of
 * a fresh forward over prompt + the tokens so far; the top logprobs against
 * the full log softmax of those raw logits. */
Test(engine, penalties_and_logit_bias_follow_the_reference, .timeout = 600) {
    fixture f;
    fx_open(&f);
    uint64_t seed = kvs_test_seed();
    enum { N = 40, K = 12, TOP = 5 };
    int V = f.cfg.vocab_size;
    int32_t *prompt = random_prompt(seed, N), plain[K];
    reference(&f, prompt, N, K, plain);
    kvs_engine *e = small_engine(&f, 256);
    kvs_logit_bias bias[2] = {{.id = plain[0], .bias = -100}, {.id = prompt[3], .bias = 2.5f}};
    kvs_request_params p = greedy_params(prompt, N, K);
    p.sampling.presence_penalty = 0.8f, p.sampling.frequency_penalty = 0.6f, p.sampling.repetition_penalty = 1.4f;
    p.logit_bias = bias, p.n_logit_bias = 2, p.logprobs = 1, p.top_logprobs = TOP;
    sink out = {0};
    cr_assert_eq(kvs_engine_submit(e, &p, on_output, &out, NULL), KVS_OK, "%s", kvs_last_error());
    run_until_idle(e, 1000);
    cr_assert_eq(out.n, K, "%d tokens (%s)", out.n, out.error);
    cr_assert_eq(out.n_top, TOP);
    cr_expect_neq(out.ids[0], plain[0], "a bias of -100 bans the unbiased first token");
    int32_t *toks = malloc(sizeof(int32_t) * (N + K));
    memcpy(toks, prompt, sizeof(int32_t) * N);
    float *x = malloc(sizeof(float) * V);
    double *v = malloc(sizeof(double) * V);
    int compared = 0;
    for (int k = 0; k < K; k++) {
        logits_after(&f, toks, N + k, x);
        double m = -INFINITY, sum = 0;
        for (int i = 0; i < V; i++) m = fmax(m, x[i]);
        for (int i = 0; i < V; i++) sum += exp((double)x[i] - m);
        double lse = m + log(sum);
        int best = 0, second = -1;
        for (int i = 0; i < V; i++) {
            int count = 0;
            bool in_prompt = false;
            for (int j = 0; j < N; j++) in_prompt |= prompt[j] == i;
            for (int j = 0; j < k; j++) count += out.ids[j] == i;
            double y = x[i];
            for (int j = 0; j < 2; j++) y += bias[j].id == i ? bias[j].bias : 0;
            if (count > 0 || in_prompt) y = y > 0 ? y / 1.4 : y * 1.4;
            y -= 0.6 * count + (count > 0 ? 0.8 : 0);
            v[i] = y;
            if (y > v[best]) second = best, best = i;
            else if (i != best && (second < 0 || y > v[second])) second = i;
        }
        if (v[best] - v[second] > 1e-4) { /* no near-tie: the engine draws exactly this one */
            cr_expect_eq(out.ids[k], best, "token %d: %d, the reference %d", k, out.ids[k], best);
            compared++;
        }
        cr_expect(fabs(out.lp[k] - (x[out.ids[k]] - lse)) <= 1e-4, "token %d: logprob %g, want %g (raw logits)", k,
                  out.lp[k], x[out.ids[k]] - lse);
        for (int j = 0; j < TOP; j++) { /* the raw logits' best, in order */
            int id = out.top_ids[k * KVS_MAX_TOP_LOGPROBS + j];
            cr_assert(id >= 0 && id < V);
            cr_expect(fabs(out.top_lp[k * KVS_MAX_TOP_LOGPROBS + j] - (x[id] - lse)) <= 1e-4, "token %d alt %d", k, j);
            int above = 0;
            for (int i = 0; i < V; i++) above += x[i] > x[id];
            cr_expect(above <= j, "token %d alternative %d (id %d) has %d better tokens", k, j, id, above);
        }
        toks[N + k] = out.ids[k];
    }
    cr_expect_geq(compared, K - 2, "only %d of %d steps without a near-tie", compared, K);
    free(v), free(x), free(toks), free(prompt);
    kvs_engine_destroy(e);
    fx_close(&f);
}

/* min_tokens bans the stop ids (and keeps stop strings quiet) before it:
 * a stop id that would end the request at once is never drawn first. */
Test(engine, min_tokens_bans_the_stop_ids_before_it) {
    fixture f;
    fx_open(&f);
    uint64_t seed = kvs_test_seed();
    enum { N = 30, K = 8 };
    int32_t *prompt = random_prompt(seed, N), plain[K];
    reference(&f, prompt, N, K, plain);
    kvs_engine *e = small_engine(&f, 256);
    kvs_request_params p = greedy_params(prompt, N, K);
    p.stop_ids = &plain[0], p.n_stop_ids = 1;
    sink now = {0}, later = {0};
    cr_assert_eq(kvs_engine_submit(e, &p, on_output, &now, NULL), KVS_OK, "%s", kvs_last_error());
    p.min_tokens = 3;
    cr_assert_eq(kvs_engine_submit(e, &p, on_output, &later, NULL), KVS_OK, "%s", kvs_last_error());
    run_until_idle(e, 1000);
    cr_expect(now.n == 1 && now.finish == KVS_FINISH_STOP, "without min_tokens the stop id ends it at once");
    cr_assert_geq(later.n, 3, "min_tokens 3: %d tokens", later.n);
    for (int i = 0; i < 3; i++) cr_expect_neq(later.ids[i], plain[0], "token %d is the banned stop id", i);
    p.min_tokens = K + 1;
    cr_expect_eq(kvs_engine_submit(e, &p, on_output, &later, NULL), KVS_ERR_INVALID);
    cr_expect(strstr(kvs_last_error(), "min_tokens"), "%s", kvs_last_error());
    free(prompt);
    kvs_engine_destroy(e);
    fx_close(&f);
}

typedef struct {
    sink s[KVS_MAX_N];
} choices;

static void on_choice(void *user, const kvs_request_output *o) {
    choices *c = user;
    cr_assert(o->index >= 0 && o->index < KVS_MAX_N);
    on_output(&c->s[o->index], o);
}

/* n = 3: greedy choices equal the reference and the prompt is prefilled once
 * (the other two start from its cached blocks); seeded draws repeat, choice 0
 * is the n = 1 request with the same seed; an abort ends every choice. */
Test(engine, n_choices_share_one_prefill, .timeout = 600) {
    fixture f;
    fx_open(&f);
    uint64_t seed = kvs_test_seed();
    enum { N = 100, K = 8 };
    int32_t *prompt = random_prompt(seed, N), want[K];
    reference(&f, prompt, N, K, want);
    kvs_engine *e = small_engine(&f, 512);
    kvs_request_params p = greedy_params(prompt, N, K);
    p.n = 3;
    choices g = {0};
    cr_assert_eq(kvs_engine_submit(e, &p, on_choice, &g, NULL), KVS_OK, "%s", kvs_last_error());
    run_until_idle(e, 1000);
    for (int c = 0; c < 3; c++) {
        cr_assert_eq(g.s[c].n, K, "choice %d: %d tokens (%s)", c, g.s[c].n, g.s[c].error);
        cr_expect_eq(g.s[c].finals, 1);
        for (int i = 0; i < K; i++) cr_expect_eq(g.s[c].ids[i], want[i], "choice %d token %d", c, i);
    }
    kvs_engine_stats st;
    kvs_engine_get_stats(e, &st);
    cr_expect_geq(st.prefix_cache_hits, 2 * 96, "the other choices reuse the prompt: %llu tokens found",
                  (unsigned long long)st.prefix_cache_hits);
    /* seeded temperature: the same choices twice; choice 0 is the n = 1 draw */
    kvs_request_params t = p;
    t.sampling.temperature = 1, t.sampling.seed = seed, t.sampling.has_seed = true;
    choices a = {0}, b = {0}, one = {0};
    cr_assert_eq(kvs_engine_submit(e, &t, on_choice, &a, NULL), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(kvs_engine_submit(e, &t, on_choice, &b, NULL), KVS_OK, "%s", kvs_last_error());
    t.n = 1;
    cr_assert_eq(kvs_engine_submit(e, &t, on_choice, &one, NULL), KVS_OK, "%s", kvs_last_error());
    run_until_idle(e, 1000);
    for (int c = 0; c < 3; c++)
        for (int i = 0; i < K; i++) cr_expect_eq(a.s[c].ids[i], b.s[c].ids[i], "choice %d token %d repeats", c, i);
    for (int i = 0; i < K; i++) cr_expect_eq(a.s[0].ids[i], one.s[0].ids[i], "choice 0 token %d", i);
    /* an abort ends all of them */
    choices ab = {0};
    uint64_t id;
    p.max_tokens = 50;
    cr_assert_eq(kvs_engine_submit(e, &p, on_choice, &ab, &id), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(kvs_engine_step(e), KVS_OK);
    kvs_engine_abort(e, id);
    run_until_idle(e, 1000);
    for (int c = 0; c < 3; c++) cr_expect(ab.s[c].finish == KVS_FINISH_ABORT && ab.s[c].finals == 1, "choice %d", c);
    free(prompt);
    kvs_engine_destroy(e);
    fx_close(&f);
}

/* a grammar request whose max_tokens runs out closes its JSON in time: the last tokens take the shortest
   way to a complete value, so the output parses whatever the budget (from the shortest output's length on) */
Test(engine, grammar_output_closes_before_max_tokens, .timeout = 600) {
    fixture f;
    fx_open(&f);
    kvs_engine *e = small_engine(&f, 256);
    static const char *const schemas[] = {
        "{\"type\":\"object\",\"properties\":{\"text\":{\"type\":\"string\"}},\"required\":[\"text\"]}",
        "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"tags\":{\"type\":\"array\","
        "\"items\":{\"type\":\"string\"},\"minItems\":2},\"code\":{\"type\":\"integer\"}},\"required\":[\"name\",\"tags\",\"code\"]}",
    };
    uint64_t seed = kvs_test_seed();
    for (int k = 0; k < 2; k++) {
        kvs_grammar *g;
        cr_assert_eq(kvs_grammar_from_json_schema(schemas[k], strlen(schemas[k]), NULL, NULL, &g), KVS_OK, "%s", kvs_last_error());
        sink out[8] = {0};
        int32_t *prompts[8];
        for (int i = 0; i < 8; i++) {
            prompts[i] = random_prompt(seed + (uint64_t)(k * 8 + i), 12);
            kvs_request_params p = greedy_params(prompts[i], 12, 36 + 4 * i); /* the shortest: 11 and 33 bytes */
            p.sampling.temperature = 1.0f;
            p.sampling.seed = seed + (uint64_t)i;
            p.grammar = g;
            cr_assert_eq(kvs_engine_submit(e, &p, on_output, &out[i], NULL), KVS_OK, "%s", kvs_last_error());
        }
        kvs_grammar_unref(g); /* the requests hold theirs */
        run_until_idle(e, 2000);
        for (int i = 0; i < 8; i++) {
            cr_assert(out[i].finish == KVS_FINISH_STOP || out[i].finish == KVS_FINISH_LENGTH, "%s", out[i].error);
            json_t *v = json_loadb(out[i].text, out[i].text_len, 0, NULL);
            cr_expect(v && json_is_object(v), "schema %d, max_tokens %d: not complete JSON after %d tokens: %.*s", k, 36 + 4 * i,
                      out[i].n, (int)out[i].text_len, out[i].text);
            json_decref(v);
            free(prompts[i]);
        }
    }
    kvs_engine_destroy(e);
    fx_close(&f);
}

/* kvsparse_requests_finished_total counts a request once, whichever way it
 * ends: length, a stop id, aborted queued or running (an abort repeated or of
 * an unknown id changes nothing), a prompt the pool can never hold, a request
 * that outgrows the pool alone, and n = 2 choices (one request). */
Test(engine, requests_finished_counts_every_end) {
    fixture f;
    fx_open(&f);
    kvs_kv_config kc = {.n_layers = f.cfg.n_layers, .n_kv_heads = f.cfg.n_kv_heads, .head_dim = f.cfg.head_dim,
                        .block_size = 16};
    kvs_engine_config c = kvs_engine_config_default();
    c.max_num_seqs = 4;
    c.max_num_batched_tokens = 64;
    c.kv_memory_bytes = kvs_kv_block_bytes(&kc, f.be->kv_dtype) * 8 * f.cfg.n_layers; /* 128 tokens a layer */
    kvs_engine *e;
    cr_assert_eq(kvs_engine_create(f.m, f.tok, &c, &e), KVS_OK, "%s", kvs_last_error());
    int32_t *prompt = random_prompt(11, 300);
    enum { N = 7 };
    sink s[N];
    memset(s, 0, sizeof s);
    uint64_t id[N];
    kvs_request_params p = greedy_params(prompt, 20, 3);
    cr_assert_eq(kvs_engine_submit(e, &p, on_output, &s[0], &id[0]), KVS_OK); /* length */
    run_until_idle(e, 100);
    cr_assert_eq(s[0].finish, KVS_FINISH_LENGTH);
    p.stop_ids = &s[0].ids[1], p.n_stop_ids = 1; /* its second token again: a stop */
    cr_assert_eq(kvs_engine_submit(e, &p, on_output, &s[1], &id[1]), KVS_OK);
    p.stop_ids = NULL, p.n_stop_ids = 0;
    p.max_tokens = 50;
    cr_assert_eq(kvs_engine_submit(e, &p, on_output, &s[2], &id[2]), KVS_OK); /* aborted running */
    cr_assert_eq(kvs_engine_step(e), KVS_OK);
    cr_assert_eq(kvs_engine_submit(e, &p, on_output, &s[3], &id[3]), KVS_OK); /* aborted queued */
    kvs_engine_abort(e, id[2]);
    kvs_engine_abort(e, id[3]);
    kvs_engine_abort(e, id[3]);
    kvs_engine_abort(e, 999999);
    p.n_prompt = 300; /* never fits: 19 blocks a layer */
    cr_assert_eq(kvs_engine_submit(e, &p, on_output, &s[4], &id[4]), KVS_OK);
    run_until_idle(e, 1000);
    p.n_prompt = 100, p.max_tokens = 100; /* fits, then outgrows the pool alone */
    cr_assert_eq(kvs_engine_submit(e, &p, on_output, &s[5], &id[5]), KVS_OK);
    run_until_idle(e, 1000);
    p.n_prompt = 20, p.max_tokens = 4, p.n = 2; /* two choices, one request */
    choices two = {0};
    p.sampling.temperature = 0;
    cr_assert_eq(kvs_engine_submit(e, &p, on_choice, &two, &id[6]), KVS_OK);
    run_until_idle(e, 1000);
    kvs_finish want[N - 1] = {KVS_FINISH_LENGTH, KVS_FINISH_STOP, KVS_FINISH_ABORT, KVS_FINISH_ABORT,
                              KVS_FINISH_ERROR, KVS_FINISH_ERROR};
    for (int i = 0; i < N - 1; i++) {
        cr_expect_eq(s[i].finish, want[i], "request %d ended %s, want %s (%s)", i, kvs_finish_name(s[i].finish),
                     kvs_finish_name(want[i]), s[i].error);
        cr_expect_eq(s[i].finals, 1, "request %d: %d final outputs", i, s[i].finals);
    }
    cr_expect(strstr(s[4].error, "does not fit"), "%s", s[4].error);
    cr_expect(strstr(s[5].error, "too small"), "%s", s[5].error);
    cr_expect(two.s[0].finals == 1 && two.s[1].finals == 1, "the choices' final outputs: %d, %d", two.s[0].finals,
              two.s[1].finals);
    kvs_engine_stats st;
    kvs_engine_get_stats(e, &st);
    cr_expect_eq(st.requests_finished, N, "requests_finished %llu, want %d",
                 (unsigned long long)st.requests_finished, N);
    cr_expect_eq(st.kv_blocks_used, 0);
    kvs_engine_abort(e, id[2]); /* ended: ignored */
    cr_assert(kvs_engine_idle(e));
    free(prompt);
    kvs_engine_destroy(e);
    fx_close(&f);
}
