/* Failures: a backend op that fails, a forward step that fails (the fault
 * wrapper of backend/fault.h), a tensor-parallel rank that fails, NaN logits
 * for one request; through the backend, the model, the engine, the HTTP
 * server in-process (the engine stepped by the test: every request is in the
 * batch that fails) and the real `kvsparse serve` (KVSPARSE_FAULT). On the CPU
 * backend with the bundled tiny model. */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "backend/fault.h"
#include "engine/engine.h"
#include "server/server.h"
#include "testutil.h"

#define MODEL "models/tiny-needle-llama"

static kvs_backend *faulty_cpu(const char *spec) {
    kvs_backend *cpu, *b;
    kvs_fault_spec f;
    cr_assert_eq(kvs_fault_parse(spec, &f), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(kvs_backend_cpu_create(2, &cpu), KVS_OK);
    cr_assert_eq(kvs_backend_fault_wrap(cpu, &f, true, &b), KVS_OK, "%s", kvs_last_error());
    return b;
}

/* ---- the backend and the model ---------------------------------------------- */
Test(faults, an_op_failure_is_sticky_in_check) {
    kvs_backend *b;
    cr_assert_eq(kvs_backend_cpu_create(1, &b), KVS_OK);
    cr_expect_eq(b->check(b), KVS_OK);
    int32_t keep[4];
    float s[2] = {1, 2};
    b->snapkv_select(b, keep, s, 2, 1, 0, 1, 1); /* pool 0: a bad argument */
    b->snapkv_select(b, keep, s, 2, 1, 3, 1, 1); /* a good call does not clear it */
    cr_expect_eq(b->check(b), KVS_ERR_INVALID);
    cr_expect(strstr(kvs_last_error(), "snapkv_select: bad arguments"), "%s", kvs_last_error());
    cr_expect_eq(b->check(b), KVS_ERR_INVALID, "the backend stays failed");
    b->destroy(b);
}

Test(faults, spec_parsing) {
    kvs_fault_spec f;
    cr_expect_eq(kvs_fault_parse("step=7,nan-seed=99", &f), KVS_OK);
    cr_expect(f.fail_step == 7 && f.nan && f.nan_seed == 99);
    cr_expect_eq(kvs_fault_parse("", &f), KVS_OK);
    cr_expect(f.fail_step == 0 && !f.nan);
    const char *bad[] = {"step=0", "step=x", "nan-seed=", "steps=3", "step=3;nan-seed=1", "step=3,"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cr_expect_eq(kvs_fault_parse(bad[i], &f), KVS_ERR_INVALID, "'%s' accepted", bad[i]);
        cr_expect(strstr(kvs_last_error(), "fault spec"), "%s", kvs_last_error());
    }
}

/* The step whose op failed reports it (not a later one), and every step after. */
Test(faults, the_failing_step_returns_the_error) {
    kvs_backend *b = faulty_cpu("step=3");
    rig r;
    rig_open(&r, src_path(MODEL), b, RIG_BLOCKS(64, 1), 1);
    int seq = kvs_kv_seq_create(r.kv);
    int32_t tok = 100, id = -1, qs[2] = {0, 1};
    uint8_t want = 1;
    kvs_sample_row greedy = {.temperature = 0, .top_p = 1};
    for (int step = 1; step <= 4; step++) {
        int32_t pos = step - 1;
        cr_assert_eq(kvs_kv_reserve(r.kv, seq, 1), KVS_OK);
        kvs_batch bt = {1, 1, &tok, &pos, qs, &seq, &want};
        kvs_status st = rig_forward_sample(r.x, &bt, r.kv, &greedy, NULL, &id, NULL);
        if (st == KVS_OK) kv_keep(r.kv, &bt);
        if (step < 3) {
            cr_expect_eq(st, KVS_OK, "step %d: %s", step, kvs_last_error());
        } else {
            cr_expect_eq(st, KVS_ERR_INTERNAL, "step %d", step);
            cr_expect(strstr(kvs_last_error(), "injected fault: an op of forward step 3 failed"), "step %d: %s", step,
                      kvs_last_error());
        }
    }
    rig_close(&r);
    b->destroy(b);
}

/* ---- the engine ------------------------------------------------------------- */
typedef struct {
    int32_t ids[256];
    int n;
    kvs_finish finish;
    char error[512];
    int finals;
} sink;

static void on_output(void *user, const kvs_request_output *o) {
    sink *s = user;
    for (int i = 0; i < o->n_tokens && s->n < 256; i++) s->ids[s->n++] = o->token_ids[i];
    if (o->finish != KVS_FINISH_NONE) {
        s->finals++;
        s->finish = o->finish;
        snprintf(s->error, sizeof s->error, "%s", o->error ? o->error : "");
    }
}

typedef struct {
    kvs_config cfg;
    kvs_checkpoint *ck;
    kvs_backend *be;
    kvs_model *m;
    kvs_tokenizer *tok;
    kvs_engine *e;
} fixture;

/* The tiny model on a CPU backend (wrapped with spec unless NULL) and an engine. */
static void fx_open(fixture *f, const char *spec, int max_num_seqs) {
    memset(f, 0, sizeof *f);
    const char *dir = src_path(MODEL);
    cr_assert_eq(kvs_config_load(dir, &f->cfg), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(kvs_checkpoint_open(dir, &f->cfg, &f->ck), KVS_OK, "%s", kvs_last_error());
    if (spec) f->be = faulty_cpu(spec);
    else cr_assert_eq(kvs_backend_cpu_create(2, &f->be), KVS_OK);
    cr_assert_eq(kvs_model_create(&f->cfg, f->ck, f->be, &f->m), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(kvs_tokenizer_load(dir, &f->tok), KVS_OK, "%s", kvs_last_error());
    kvs_engine_config ec = kvs_engine_config_default();
    ec.max_num_seqs = max_num_seqs;
    ec.kv_memory_bytes = 64u << 20;
    cr_assert_eq(kvs_engine_create(f->m, f->tok, &ec, &f->e), KVS_OK, "%s", kvs_last_error());
}

static void fx_close(fixture *f) {
    kvs_engine_destroy(f->e);
    kvs_tokenizer_destroy(f->tok);
    kvs_model_destroy(f->m);
    kvs_checkpoint_destroy(f->ck);
    f->be->destroy(f->be);
}

static const int32_t PROMPTS[3][6] = {{1, 450, 2130, 310, 278, 2787}, {1, 903, 2501, 263, 931}, {1, 1504, 2989}};
static const int PROMPT_LEN[3] = {6, 5, 3};

static kvs_request_params params(int i, int max_tokens) {
    return (kvs_request_params){.prompt_ids = PROMPTS[i], .n_prompt = PROMPT_LEN[i],
                                .sampling = kvs_sampling_default(), .max_tokens = max_tokens, .ignore_eos = true};
}

/* Step 4 fails: the two running requests and the one still waiting end with
 * the error; the engine is failed for good and refuses new requests. */
Test(faults, a_failed_step_fails_the_engine_and_every_request) {
    fixture f;
    fx_open(&f, "step=4", 2);
    sink s[3] = {0};
    for (int i = 0; i < 3; i++) {
        kvs_request_params p = params(i, 50);
        cr_assert_eq(kvs_engine_submit(f.e, &p, on_output, &s[i], NULL), KVS_OK, "%s", kvs_last_error());
    }
    for (int step = 1; step <= 3; step++) cr_assert_eq(kvs_engine_step(f.e), KVS_OK, "step %d: %s", step, kvs_last_error());
    cr_expect(!kvs_engine_failed(f.e, NULL));
    cr_expect_eq(kvs_engine_step(f.e), KVS_ERR_INTERNAL);
    cr_expect(strstr(kvs_last_error(), "injected fault"), "%s", kvs_last_error());
    const char *why = NULL;
    cr_assert(kvs_engine_failed(f.e, &why));
    cr_expect(strstr(why, "model forward failed") && strstr(why, "injected fault: an op of forward step 4 failed"), "%s",
              why);
    for (int i = 0; i < 3; i++) {
        cr_expect_eq(s[i].finals, 1, "request %d: %d final outputs", i, s[i].finals);
        cr_expect_eq(s[i].finish, KVS_FINISH_ERROR, "request %d", i);
        cr_expect(strstr(s[i].error, "the engine failed: model forward failed"), "request %d: %s", i, s[i].error);
    }
    cr_expect(s[0].n == 3 && s[1].n == 3 && s[2].n == 0, "tokens before the failure: %d %d %d (request 2 waited)",
              s[0].n, s[1].n, s[2].n);
    kvs_request_params p = params(0, 4);
    cr_expect_eq(kvs_engine_submit(f.e, &p, on_output, &s[0], NULL), KVS_ERR_INTERNAL);
    cr_expect(strstr(kvs_last_error(), "the engine failed: model forward failed"), "%s", kvs_last_error());
    cr_expect(kvs_engine_idle(f.e));
    cr_expect_eq(kvs_engine_step(f.e), KVS_ERR_INTERNAL, "a failed engine stays failed");
    kvs_engine_stats st;
    kvs_engine_get_stats(f.e, &st);
    cr_expect_eq(st.running + st.waiting, 0);
    cr_expect_eq(st.kv_blocks_used, 0, "blocks still held after the failure");
    kvs_engine_stop(f.e, true); /* returns: nothing left to drain */
    fx_close(&f);
}

/* With the engine thread: the failure ends the requests without the caller stepping. */
Test(faults, the_engine_thread_fails_the_same_way) {
    fixture f;
    fx_open(&f, "step=2", 4);
    sink s = {0};
    cr_assert_eq(kvs_engine_start(f.e), KVS_OK);
    kvs_request_params p = params(0, 50);
    cr_assert_eq(kvs_engine_submit(f.e, &p, on_output, &s, NULL), KVS_OK);
    for (int i = 0; i < 3000 && !kvs_engine_failed(f.e, NULL); i++) usleep(10000);
    cr_assert(kvs_engine_failed(f.e, NULL), "not failed after 30 s");
    kvs_engine_stop(f.e, true);
    cr_expect_eq(s.finish, KVS_FINISH_ERROR);
    cr_expect_eq(s.n, 1);
    fx_close(&f);
}

/* Tensor parallelism: rank 1's op fails; the step fails on the engine, whose
 * reason names the rank. */
static kvs_backend *wrap_rank1(void *user, int rank, kvs_backend *be) {
    kvs_backend **w = user;
    if (rank != 1) return be;
    kvs_fault_spec f = {.fail_step = 2};
    return kvs_backend_fault_wrap(be, &f, false, w) == KVS_OK ? *w : NULL;
}

Test(faults, a_failed_rank_fails_the_engine) {
    kvs_config cfg;
    kvs_checkpoint *ck;
    const char *dir = src_path(MODEL);
    cr_assert_eq(kvs_config_load(dir, &cfg), KVS_OK);
    cr_assert_eq(kvs_checkpoint_open(dir, &cfg, &ck), KVS_OK);
    kvs_backend *wrapper = NULL;
    kvs_runner *g;
    cr_assert_eq(kvs_runner_create_cpu_wrapped(&cfg, ck, 2, 1, KVS_F32, KVS_F32, wrap_rank1, &wrapper, NULL, &g), KVS_OK, "%s",
                 kvs_last_error());
    kvs_engine_config ec = kvs_engine_config_default();
    ec.kv_memory_bytes = 32u << 20;
    kvs_engine *e;
    cr_assert_eq(kvs_engine_create_runner(g, NULL, &ec, &e), KVS_OK, "%s", kvs_last_error());
    sink s[2] = {0};
    for (int i = 0; i < 2; i++) {
        kvs_request_params p = params(i, 20);
        cr_assert_eq(kvs_engine_submit(e, &p, on_output, &s[i], NULL), KVS_OK);
    }
    cr_expect_eq(kvs_engine_step(e), KVS_OK, "%s", kvs_last_error());
    cr_expect_eq(kvs_engine_step(e), KVS_ERR_INTERNAL);
    const char *why = "";
    cr_assert(kvs_engine_failed(e, &why));
    cr_expect(strstr(why, "tensor parallel rank 1 of 2") && strstr(why, "injected fault"), "%s", why);
    for (int i = 0; i < 2; i++) {
        cr_expect_eq(s[i].finish, KVS_FINISH_ERROR);
        cr_expect_eq(s[i].n, 1);
    }
    kvs_engine_destroy(e);
    kvs_runner_destroy(g);
    wrapper->destroy(wrapper); /* the group destroyed rank 1's backend under it */
    kvs_checkpoint_destroy(ck);
}

/* NaN logits for one request (seed 4242): it alone fails, at its first token;
 * the others in the same batches give the tokens they give without the fault. */
Test(faults, nan_logits_fail_that_request_alone) {
    sink want[2] = {0};
    fixture f;
    fx_open(&f, NULL, 8);
    for (int i = 0; i < 2; i++) {
        kvs_request_params p = params(i, 12);
        cr_assert_eq(kvs_engine_submit(f.e, &p, on_output, &want[i], NULL), KVS_OK);
    }
    for (int i = 0; i < 100 && !kvs_engine_idle(f.e); i++) cr_assert_eq(kvs_engine_step(f.e), KVS_OK);
    fx_close(&f);

    fx_open(&f, "nan-seed=4242", 8);
    sink s[3] = {0};
    for (int i = 0; i < 3; i++) {
        kvs_request_params p = params(i == 2 ? 0 : i, 12);
        if (i == 2) p.sampling.seed = 4242, p.sampling.has_seed = true;
        cr_assert_eq(kvs_engine_submit(f.e, &p, on_output, &s[i], NULL), KVS_OK);
    }
    for (int i = 0; i < 100 && !kvs_engine_idle(f.e); i++) cr_assert_eq(kvs_engine_step(f.e), KVS_OK, "%s", kvs_last_error());
    cr_assert(kvs_engine_idle(f.e));
    cr_expect_eq(s[2].finish, KVS_FINISH_ERROR);
    cr_expect_str_eq(s[2].error, "non-finite logits (NaN or infinity) at generated token 1");
    cr_expect_eq(s[2].n, 0);
    for (int i = 0; i < 2; i++) {
        cr_expect_eq(s[i].finish, KVS_FINISH_LENGTH, "request %d: %s", i, s[i].error);
        cr_expect_eq(s[i].n, 12);
        cr_expect_arr_eq(s[i].ids, want[i].ids, sizeof(int32_t) * 12, "request %d: other tokens than without the fault", i);
    }
    cr_expect(!kvs_engine_failed(f.e, NULL));
    fx_close(&f);
}

/* ---- HTTP: a tiny HTTP/1.0 client (the server closes after each response) --- */
typedef struct {
    int status;
    char *body;
} http_resp;

static http_resp http(int port, const char *method, const char *path, const char *body) {
    http_resp r = {0, NULL};
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct timeval tv = {.tv_sec = 120}; /* bounded: a hang fails the test instead of stalling it */
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        r.body = strdup("");
        return r;
    }
    char head[512];
    size_t len = body ? strlen(body) : 0;
    int n = snprintf(head, sizeof head, "%s %s HTTP/1.0\r\nHost: localhost\r\nContent-Length: %zu\r\n\r\n", method, path,
                     len);
    send(fd, head, (size_t)n, MSG_NOSIGNAL);
    if (len) send(fd, body, len, MSG_NOSIGNAL);
    size_t cap = 1 << 16, got = 0;
    char *buf = malloc(cap);
    ssize_t k;
    while ((k = recv(fd, buf + got, cap - got - 1, 0)) > 0) {
        got += (size_t)k;
        if (cap - got < 4096) buf = realloc(buf, cap *= 2);
    }
    buf[got] = 0;
    close(fd);
    sscanf(buf, "HTTP/%*s %d", &r.status);
    char *b = strstr(buf, "\r\n\r\n");
    r.body = strdup(b ? b + 4 : "");
    free(buf);
    return r;
}

/* A stream's text, its error message (an {"error": ...} event) and whether [DONE] ended it. */
typedef struct {
    char text[4096], error[512];
    int chunks;
    bool done, done_last;
} stream_result;

static void parse_stream(const char *body, stream_result *out) {
    memset(out, 0, sizeof *out);
    for (const char *p = body; (p = strstr(p, "data: "));) {
        p += 6;
        const char *end = strstr(p, "\n\n");
        if (!end) break;
        if (!strncmp(p, "[DONE]", 6)) {
            out->done = true;
            out->done_last = end[2] == 0;
            break;
        }
        json_t *j = json_loadb(p, (size_t)(end - p), 0, NULL);
        cr_assert(j, "bad event: %.*s", (int)(end - p), p);
        json_t *err = json_object_get(j, "error"), *ch = json_array_get(json_object_get(j, "choices"), 0);
        if (err) snprintf(out->error, sizeof out->error, "%s", json_string_value(json_object_get(err, "message")));
        if (ch) {
            json_t *t = json_object_get(ch, "text");
            if (!t) t = json_object_get(json_object_get(ch, "delta"), "content");
            if (json_is_string(t)) strncat(out->text, json_string_value(t), sizeof out->text - strlen(out->text) - 1);
            out->chunks++;
        }
        json_decref(j);
        p = end;
    }
}

/* The whole answer's text (completions or chat), or its error message. */
static const char *answer_text(json_t *j) {
    json_t *ch = json_array_get(json_object_get(j, "choices"), 0);
    json_t *t = json_object_get(ch, "text");
    if (!t) t = json_object_get(json_object_get(ch, "message"), "content");
    if (!t) t = json_object_get(json_object_get(j, "error"), "message");
    return json_is_string(t) ? json_string_value(t) : "";
}

typedef struct {
    int port;
    const char *path;
    char body[512];
    http_resp r;
} client_job;

static void *client_thread(void *arg) {
    client_job *c = arg;
    c->r = http(c->port, "POST", c->path, c->body);
    return NULL;
}

static void job(client_job *c, bool chat, bool stream, int max_tokens, const char *extra) {
    c->path = chat ? "/v1/chat/completions" : "/v1/completions";
    snprintf(c->body, sizeof c->body,
             chat ? "{\"messages\": [{\"role\": \"user\", \"content\": \"What is the access code?\"}], "
                    "\"max_tokens\": %d, \"temperature\": 0, \"ignore_eos\": true, \"stream\": %s%s}"
                  : "{\"prompt\": \"Once upon a time\", \"max_tokens\": %d, \"temperature\": 0, \"ignore_eos\": true, "
                    "\"stream\": %s%s}",
             max_tokens, stream ? "true" : "false", extra ? extra : "");
}

/* The server in-process over the fixture's engine, which the test steps itself:
 * all the clients' requests are in the engine before the first step. */
typedef struct {
    fixture f;
    kvs_server *srv;
    int port;
} served;

static void serve_open(served *s, const char *spec, int max_num_seqs) {
    fx_open(&s->f, spec, max_num_seqs);
    kvs_server_config sc = {.host = "127.0.0.1", .port = 0, .served_model_name = "tiny",
                            .max_model_len = s->f.cfg.max_position_embeddings, .n_layers = s->f.cfg.n_layers};
    cr_assert_eq(kvs_server_start(&sc, s->f.e, s->f.tok, &s->srv), KVS_OK, "%s", kvs_last_error());
    s->port = kvs_server_port(s->srv);
}

static void serve_close(served *s) {
    kvs_server_drain(s->srv, 30); /* returns at once: every request was answered */
    kvs_server_stop(s->srv);
    fx_close(&s->f);
}

/* Runs the clients: starts them one by one, each once the engine holds the
 * previous one's request (bounded waits; so the queue order is the jobs'
 * order), steps the engine until idle, joins the clients. Returns the steps
 * that failed. */
static int run_clients(served *s, client_job *jobs, int n) {
    pthread_t th[8];
    for (int k = 0; k < n; k++) {
        jobs[k].port = s->port;
        pthread_create(&th[k], NULL, client_thread, &jobs[k]);
        kvs_engine_stats st = {0};
        for (int i = 0; i < 3000 && st.running + st.waiting <= k; i++) {
            usleep(10000);
            kvs_engine_get_stats(s->f.e, &st);
        }
        cr_assert_eq(st.running + st.waiting, k + 1, "request %d did not reach the engine in 30 s", k);
    }
    int failed = 0;
    for (int i = 0; i < 5000 && !kvs_engine_idle(s->f.e); i++) failed += kvs_engine_step(s->f.e) != KVS_OK;
    cr_assert(kvs_engine_idle(s->f.e));
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
    return failed;
}

TestSuite(faults_server, .timeout = 300);

/* Step 3 fails with two streams running and a whole answer waiting (at most 2
 * running): the streams get an error event and [DONE], the whole answer a 500,
 * all naming the failure; then /health is 503 with the reason and new requests
 * get 503 naming it. */
Test(faults_server, a_failed_step_ends_every_request_then_503) {
    served s;
    serve_open(&s, "step=3", 2);
    client_job jobs[3];
    job(&jobs[0], false, true, 40, NULL);
    job(&jobs[1], true, true, 40, NULL);
    job(&jobs[2], false, false, 40, NULL);
    cr_expect_eq(run_clients(&s, jobs, 3), 1, "the failing step, and no other step ran");
    for (int i = 0; i < 2; i++) {
        stream_result sr;
        cr_expect_eq(jobs[i].r.status, 200);
        parse_stream(jobs[i].r.body, &sr);
        cr_expect(sr.done && sr.done_last, "stream %d: no [DONE] at the end: %s", i, jobs[i].r.body);
        cr_expect(strstr(sr.error, "generation failed: the engine failed: model forward failed") &&
                      strstr(sr.error, "injected fault: an op of forward step 3 failed"),
                  "stream %d: error '%s'", i, sr.error);
        cr_expect_geq(sr.chunks, 2, "stream %d: the tokens of steps 1 and 2 came first (%d chunks)", i, sr.chunks);
    }
    cr_expect_eq(jobs[2].r.status, 500, "%s", jobs[2].r.body);
    cr_expect(strstr(jobs[2].r.body, "the engine failed: model forward failed") &&
                  strstr(jobs[2].r.body, "injected fault"),
              "%s", jobs[2].r.body);
    for (int i = 0; i < 3; i++) free(jobs[i].r.body);

    http_resp r = http(s.port, "GET", "/health", NULL);
    cr_expect_eq(r.status, 503);
    json_t *j = json_loads(r.body, 0, NULL);
    cr_assert(j, "/health: %s", r.body);
    cr_expect_str_eq(json_string_value(json_object_get(j, "status")), "failed");
    cr_expect(strstr(json_string_value(json_object_get(j, "reason")), "injected fault"), "%s", r.body);
    json_decref(j);
    free(r.body);
    for (int chat = 0; chat < 2; chat++) {
        client_job c;
        job(&c, chat, chat, 4, NULL);
        r = http(s.port, "POST", c.path, c.body);
        cr_expect_eq(r.status, 503, "%s", r.body);
        cr_expect(strstr(r.body, "the engine failed: model forward failed"), "%s", r.body);
        free(r.body);
    }
    serve_close(&s);
}

/* NaN logits for the requests of seed 4242 (one streamed, one not): they fail
 * alone with the message; the others, in the same batches, answer what they
 * answer alone; /health stays ok. */
Test(faults_server, nan_logits_fail_those_requests_alone) {
    served s;
    serve_open(&s, "nan-seed=4242", 8);
    client_job ref[2], jobs[4];
    job(&ref[0], false, true, 16, NULL);
    job(&ref[1], true, false, 16, NULL);
    cr_expect_eq(run_clients(&s, ref, 2), 0);
    job(&jobs[0], false, true, 16, ", \"seed\": 4242");
    job(&jobs[1], false, true, 16, NULL);
    job(&jobs[2], true, false, 16, ", \"seed\": 4242");
    job(&jobs[3], true, false, 16, NULL);
    cr_expect_eq(run_clients(&s, jobs, 4), 0);

    stream_result want, got;
    parse_stream(ref[0].r.body, &want);
    cr_expect(want.done && !want.error[0] && want.chunks >= 16);
    parse_stream(jobs[1].r.body, &got);
    cr_expect(got.done && !got.error[0], "%s", got.error);
    cr_expect_str_eq(got.text, want.text, "the stream beside the NaN requests changed");
    parse_stream(jobs[0].r.body, &got);
    cr_expect(got.done && got.done_last);
    cr_expect_str_eq(got.error, "generation failed: non-finite logits (NaN or infinity) at generated token 1");
    cr_expect_str_eq(got.text, "");

    cr_expect_eq(ref[1].r.status, 200);
    cr_expect_eq(jobs[3].r.status, 200);
    json_t *a = json_loads(ref[1].r.body, 0, NULL), *b = json_loads(jobs[3].r.body, 0, NULL),
           *c = json_loads(jobs[2].r.body, 0, NULL);
    cr_assert(a && b && c);
    cr_expect_str_eq(answer_text(b), answer_text(a), "the answer beside the NaN requests changed");
    cr_expect_eq(jobs[2].r.status, 500);
    cr_expect_str_eq(answer_text(c), "generation failed: non-finite logits (NaN or infinity) at generated token 1");
    json_decref(a), json_decref(b), json_decref(c);
    for (int i = 0; i < 2; i++) free(ref[i].r.body);
    for (int i = 0; i < 4; i++) free(jobs[i].r.body);

    http_resp r = http(s.port, "GET", "/health", NULL);
    cr_expect_eq(r.status, 200);
    cr_expect_str_eq(r.body, "{\"status\":\"ok\"}");
    free(r.body);
    cr_expect(!kvs_engine_failed(s.f.e, NULL));
    serve_close(&s);
}

/* ---- the real binary: `kvsparse serve` under KVSPARSE_FAULT ----------------- */
typedef struct {
    pid_t pid;
    int port;
    char log[4096];
} server_proc;

static server_proc start_server(const char *fault) {
    server_proc s = {0};
    snprintf(s.log, sizeof s.log, "%s/serve.log", make_temp_dir());
    int fds[2];
    cr_assert_eq(pipe(fds), 0);
    s.pid = fork();
    cr_assert_geq(s.pid, 0);
    if (s.pid == 0) {
        dup2(fds[1], 1);
        close(fds[0]);
        close(fds[1]);
        char cmd[8192];
        snprintf(cmd, sizeof cmd, "exec '%s' serve -m '%s' --port 0 --threads 2 --kv-memory 0.05 2>'%s'",
                 kvsparse_binary(), src_path(MODEL), s.log);
        setenv("KVSPARSE_FAULT", fault, 1);
        setenv("OMP_WAIT_POLICY", "passive", 1);
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    close(fds[1]);
    FILE *f = fdopen(fds[0], "r");
    char line[512];
    while (fgets(line, sizeof line, f)) {
        const char *p = strstr(line, "(port ");
        if (p) {
            s.port = atoi(p + 6);
            break;
        }
    }
    fclose(f);
    cr_assert_gt(s.port, 0, "the server did not print its port");
    return s;
}

/* The exit status within limit_s seconds (-1: killed by a signal; -2: still running, then killed). */
static int wait_exit(server_proc *s, int limit_s) {
    int status = 0;
    for (int i = 0; i < limit_s * 10; i++) {
        if (waitpid(s->pid, &status, WNOHANG) == s->pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        usleep(100000);
    }
    kill(s->pid, SIGKILL);
    waitpid(s->pid, &status, 0);
    return -2;
}

static char *read_log(const server_proc *s) {
    char *text = NULL;
    size_t len = 0;
    return kvs_read_file(s->log, &text, &len) == KVS_OK ? text : strdup("");
}

TestSuite(faults_binary, .timeout = 300);

/* The engine fails at step 3: the stream ends with the error and [DONE], and
 * the server drains and exits 1 by itself, its log naming the failure. */
Test(faults_binary, serve_exits_1_after_an_engine_failure) {
    server_proc s = start_server("step=3");
    client_job c;
    job(&c, false, true, 64, NULL);
    http_resp r = http(s.port, "POST", c.path, c.body);
    cr_expect_eq(r.status, 200);
    stream_result sr;
    parse_stream(r.body, &sr);
    cr_expect(sr.done && sr.done_last, "%s", r.body);
    cr_expect(strstr(sr.error, "injected fault: an op of forward step 3 failed"), "%s", r.body);
    free(r.body);
    double t0 = kvs_now();
    int rc = wait_exit(&s, 60);
    fprintf(stderr, "serve exited %d, %.2f s after the failed stream ended\n", rc, kvs_now() - t0);
    cr_expect_eq(rc, 1, "serve's exit status after an engine failure");
    char *log = read_log(&s);
    cr_expect(strstr(log, "stopped after an engine failure: model forward failed") && strstr(log, "injected fault"),
              "log:\n%s", log);
    free(log);
}

/* NaN logits for seed 777: that request gets 500 naming them, another 200, the
 * server stays healthy and SIGTERM still exits 0. */
Test(faults_binary, serve_survives_nan_logits) {
    server_proc s = start_server("nan-seed=777");
    client_job c;
    job(&c, true, false, 8, ", \"seed\": 777");
    http_resp r = http(s.port, "POST", c.path, c.body);
    cr_expect_eq(r.status, 500);
    cr_expect(strstr(r.body, "non-finite logits (NaN or infinity) at generated token 1"), "%s", r.body);
    free(r.body);
    job(&c, true, false, 8, NULL);
    r = http(s.port, "POST", c.path, c.body);
    cr_expect_eq(r.status, 200, "%s", r.body);
    free(r.body);
    r = http(s.port, "GET", "/health", NULL);
    cr_expect_eq(r.status, 200, "%s", r.body);
    free(r.body);
    kill(s.pid, SIGTERM);
    cr_expect_eq(wait_exit(&s, 60), 0);
}
