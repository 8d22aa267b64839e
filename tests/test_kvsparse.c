/* The embedding API (src/kvsparse/kvsparse.h) on the bundled model: create,
 * the push and pull APIs, abort, errors as status + message, destroy with a
 * request still running. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvsparse/kvsparse.h"
#include "testutil.h"

static const char *NEEDLE = "The access code for Marigold is 48213. The sky was grey over the harbour. "
                            "What is the access code for Marigold?";

/* The bundled model's engine, its context max_model_len tokens (0: the model's). */
static kvsparse_engine *open_engine_of(int max_model_len) {
    kvsparse_options o;
    kvsparse_options_init(&o);
    o.threads = 2;
    o.quiet = 1;
    o.kv_memory_gib = 0.05;
    o.max_model_len = max_model_len;
    kvsparse_engine *e = NULL;
    kvsparse_status st = kvsparse_create(src_path("models/tiny-needle-llama"), &o, &e);
    cr_assert_eq(st, KVSPARSE_OK, "kvsparse_create: %s", kvsparse_last_error());
    return e;
}

static kvsparse_engine *open_engine(void) { return open_engine_of(0); }

static kvsparse_request needle_request(void) {
    kvsparse_request r;
    kvsparse_request_init(&r);
    r.prompt = NEEDLE;
    r.chat = 1;
    r.max_tokens = 16;
    return r;
}

/* Reads a stream to its end: the text (malloc'ed) and the last delivery. */
static char *read_all(kvsparse_stream *s, kvsparse_output *last) {
    size_t len = 0;
    char *text = calloc(1, 1);
    kvsparse_output out;
    kvsparse_status st;
    while ((st = kvsparse_stream_next(s, &out)) == KVSPARSE_OK) {
        text = realloc(text, len + out.text_len + 1);
        memcpy(text + len, out.text, out.text_len);
        text[len += out.text_len] = 0;
        *last = out;
        if (out.finish != KVSPARSE_FINISH_NONE) break;
    }
    cr_assert_eq(st, KVSPARSE_OK, "kvsparse_stream_next: %s", kvsparse_last_error());
    cr_assert_eq(kvsparse_stream_next(s, &out), KVSPARSE_ERR_CLOSED, "a stream read to its end is closed");
    return text;
}

Test(kvsparse, stream_answers_the_needle) {
    kvsparse_engine *e = open_engine();
    kvsparse_request r = needle_request();
    kvsparse_stream *s;
    cr_assert_eq(kvsparse_submit_stream(e, &r, &s), KVSPARSE_OK, "%s", kvsparse_last_error());
    cr_assert_gt(kvsparse_stream_id(s), 0);
    kvsparse_output last;
    char *text = read_all(s, &last);
    cr_expect(strstr(text, "48213"), "the answer: '%s'", text);
    cr_expect_eq(last.finish, KVSPARSE_FINISH_STOP);
    cr_expect_gt(last.prompt_tokens, 20);
    cr_expect_gt(last.completion_tokens, 0);
    cr_expect_float_eq(last.compression_ratio, 1.0, 1e-9, "the full policy keeps every entry");
    free(text);
    kvsparse_stream_close(s);
    kvsparse_destroy(e);
}

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    char text[4096];
    size_t len;
    int deliveries;
    kvsparse_finish finish;
    double ratio;
    kvsparse_engine *abort_after_first; /* abort the request at its first delivery */
} pushed;

static void on_output(void *user, const kvsparse_output *o) {
    pushed *p = user;
    pthread_mutex_lock(&p->mu);
    if (p->len + o->text_len < sizeof p->text) memcpy(p->text + p->len, o->text, o->text_len), p->len += o->text_len;
    if (p->deliveries++ == 0 && p->abort_after_first) kvsparse_abort(p->abort_after_first, o->request_id);
    p->ratio = o->compression_ratio;
    p->finish = o->finish;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

static void wait_finish(pushed *p) {
    pthread_mutex_lock(&p->mu);
    while (p->finish == KVSPARSE_FINISH_NONE) pthread_cond_wait(&p->cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

Test(kvsparse, callback_and_stream_agree) {
    kvsparse_engine *e = open_engine();
    kvsparse_request r = needle_request();
    pushed p = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};
    uint64_t id = 0;
    cr_assert_eq(kvsparse_submit(e, &r, on_output, &p, &id), KVSPARSE_OK, "%s", kvsparse_last_error());
    kvsparse_stream *s;
    cr_assert_eq(kvsparse_submit_stream(e, &r, &s), KVSPARSE_OK); /* both run together */
    cr_assert_neq(kvsparse_stream_id(s), id);
    kvsparse_output last;
    char *text = read_all(s, &last);
    wait_finish(&p);
    cr_expect_str_eq(p.text, text, "greedy: the same answer through both APIs");
    cr_expect_eq(p.finish, KVSPARSE_FINISH_STOP);
    free(text);
    kvsparse_stream_close(s);
    kvsparse_destroy(e);
}

Test(kvsparse, abort_ends_a_request) {
    kvsparse_engine *e = open_engine();
    kvsparse_request r = needle_request();
    r.ignore_eos = 1;
    r.max_tokens = 400;
    pushed p = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};
    p.abort_after_first = e;
    cr_assert_eq(kvsparse_submit(e, &r, on_output, &p, NULL), KVSPARSE_OK);
    wait_finish(&p);
    cr_expect_eq(p.finish, KVSPARSE_FINISH_ABORT);
    cr_expect_lt(p.deliveries, 400);
    kvsparse_abort(e, 12345); /* unknown: ignored */
    kvsparse_destroy(e);
}

Test(kvsparse, sparse_policy_compresses_a_long_prompt) {
    kvsparse_options o;
    kvsparse_options_init(&o);
    o.threads = 2, o.quiet = 1, o.kv_memory_gib = 0.05;
    o.kv_policy = "snapkv";
    o.kv_budget = "64";
    kvsparse_engine *e;
    cr_assert_eq(kvsparse_create(src_path("models/tiny-needle-llama"), &o, &e), KVSPARSE_OK, "%s", kvsparse_last_error());
    char prompt[8192] = "";
    for (int i = 0; i < 40; i++) strcat(prompt, "The sky was grey over the harbour and the boats rocked. ");
    strcat(prompt, NEEDLE);
    kvsparse_request r = needle_request();
    r.prompt = prompt;
    r.max_tokens = 4;
    kvsparse_stream *s;
    cr_assert_eq(kvsparse_submit_stream(e, &r, &s), KVSPARSE_OK);
    kvsparse_output last;
    free(read_all(s, &last));
    cr_expect_gt(last.compression_ratio, 2.0, "a prompt of %d tokens at a budget of 64: ratio %g", last.prompt_tokens,
                 last.compression_ratio);
    kvsparse_stream_close(s);
    kvsparse_destroy(e);
}

Test(kvsparse, destroy_with_a_request_running) {
    kvsparse_engine *e = open_engine();
    kvsparse_request r = needle_request();
    r.ignore_eos = 1;
    r.max_tokens = 2000;
    kvsparse_stream *s;
    cr_assert_eq(kvsparse_submit_stream(e, &r, &s), KVSPARSE_OK);
    kvsparse_output out;
    cr_assert_eq(kvsparse_stream_next(s, &out), KVSPARSE_OK);
    kvsparse_destroy(e); /* ends the request */
    kvsparse_output last = out;
    while (last.finish == KVSPARSE_FINISH_NONE) cr_assert_eq(kvsparse_stream_next(s, &last), KVSPARSE_OK);
    cr_expect_eq(last.finish, KVSPARSE_FINISH_ABORT);
    kvsparse_stream_close(s);
}

Test(kvsparse, errors_name_what_is_wrong) {
    kvsparse_engine *e = NULL;
    cr_expect_neq(kvsparse_create("/nonexistent/model", NULL, &e), KVSPARSE_OK);
    cr_expect(strstr(kvsparse_last_error(), "/nonexistent/model"), "%s", kvsparse_last_error());
    cr_expect_null(e);

    kvsparse_options o;
    kvsparse_options_init(&o);
    o.quiet = 1;
    o.kv_policy = "sparsest";
    cr_expect_eq(kvsparse_create(src_path("models/tiny-needle-llama"), &o, &e), KVSPARSE_ERR_INVALID);
    cr_expect(strstr(kvsparse_last_error(), "sparsest"), "%s", kvsparse_last_error());
    o.kv_policy = "snapkv";
    o.kv_budget = "ten";
    cr_expect_eq(kvsparse_create(src_path("models/tiny-needle-llama"), &o, &e), KVSPARSE_ERR_INVALID);
    cr_expect(strstr(kvsparse_last_error(), "kv_budget"), "%s", kvsparse_last_error());
    o.kv_budget = NULL;
    o.device = "tpu";
    cr_expect_eq(kvsparse_create(src_path("models/tiny-needle-llama"), &o, &e), KVSPARSE_ERR_INVALID);
    cr_expect(strstr(kvsparse_last_error(), "tpu"), "%s", kvsparse_last_error());

    e = open_engine();
    kvsparse_request r = needle_request();
    kvsparse_stream *s = NULL;
    r.max_tokens = 0;
    cr_expect_eq(kvsparse_submit_stream(e, &r, &s), KVSPARSE_ERR_INVALID);
    cr_expect(strstr(kvsparse_last_error(), "max_tokens"), "%s", kvsparse_last_error());
    cr_expect_null(s);
    r.max_tokens = 1 << 30;
    cr_expect_eq(kvsparse_submit_stream(e, &r, &s), KVSPARSE_ERR_INVALID);
    cr_expect(strstr(kvsparse_last_error(), "context"), "%s", kvsparse_last_error());
    r.max_tokens = 4;
    r.prompt = NULL;
    cr_expect_eq(kvsparse_submit(e, &r, on_output, NULL, NULL), KVSPARSE_ERR_INVALID);
    cr_expect(strstr(kvsparse_last_error(), "prompt"), "%s", kvsparse_last_error());
    r.prompt = "\xff\xfe not UTF-8";
    r.chat = 0;
    cr_expect_neq(kvsparse_submit_stream(e, &r, &s), KVSPARSE_OK);
    cr_expect_str_eq(kvsparse_status_name(KVSPARSE_ERR_CLOSED), "closed");
    cr_expect_str_eq(kvsparse_version(), "0.1.0");
    kvsparse_destroy(e);
    kvsparse_destroy(NULL);
}

/* The context's limits: the engine's door refuses, in OpenAI's words, a prompt
 * that leaves no room for a token and prompt + max_tokens beyond the context;
 * a default max_tokens is capped by the context instead. */
Test(kvsparse, context_limits_are_clear) {
    kvsparse_engine *e = open_engine_of(32);
    kvsparse_request r;
    kvsparse_request_init(&r);
    char long_prompt[400] = "";
    for (int i = 0; i < 40; i++) strcat(long_prompt, "harbour ");
    r.prompt = long_prompt;
    kvsparse_stream *s = NULL;
    int max_len = 0, n = 0, k = 0, end = 0;
    cr_expect_eq(kvsparse_submit_stream(e, &r, &s), KVSPARSE_ERR_INVALID);
    const char *msg = kvsparse_last_error();
    int got = sscanf(msg, "this model's maximum context length is %d tokens; the prompt has %d%n", &max_len, &n, &end);
    cr_expect(got == 2 && !msg[end], "%s", msg);
    cr_expect(max_len == 32 && n >= 40, "%s", msg);
    cr_expect_null(s);
    r.prompt = "The sky was grey over the harbour.";
    r.max_tokens = 40;
    cr_expect_eq(kvsparse_submit(e, &r, on_output, NULL, NULL), KVSPARSE_ERR_INVALID);
    msg = kvsparse_last_error();
    end = 0;
    got = sscanf(msg, "this model's maximum context length is %d tokens; the prompt has %d and %d were asked for%n",
                 &max_len, &n, &k, &end);
    cr_expect(got == 3 && !msg[end], "%s", msg);
    cr_expect(max_len == 32 && n > 0 && n < 32 && k == 40, "%s", msg);
    r.max_tokens = KVSPARSE_MODEL_DEFAULT; /* the default: capped by the context */
    cr_assert_eq(kvsparse_submit_stream(e, &r, &s), KVSPARSE_OK, "%s", kvsparse_last_error());
    kvsparse_output last;
    free(read_all(s, &last));
    cr_expect_neq(last.finish, KVSPARSE_FINISH_ERROR, "%s", last.error ? last.error : "");
    cr_expect_leq(last.prompt_tokens + last.completion_tokens, 32);
    kvsparse_stream_close(s);
    kvsparse_destroy(e);
}
