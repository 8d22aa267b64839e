/* server: generated text on its way to the client, without sockets: the response
 * builders (whole and streaming chunks, both APIs, logprobs) and the SSE stream
 * reader fed through the engine's output callback. A NUL byte in the text (the
 * byte-level token for 0x00) reaches the client as \u0000, text after it too. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "server/generate.h"
#include "testutil.h"

static kvs_tokenizer *tiny(void) {
    kvs_tokenizer *t = NULL;
    cr_assert_eq(kvs_tokenizer_load(src_path("models/tiny-needle-llama"), &t), KVS_OK, "%s", kvs_last_error());
    return t;
}

/* JSON text to an object; \u0000 accepted. */
static json_t *parse(const char *s) {
    json_error_t e;
    json_t *j = json_loads(s, JSON_ALLOW_NUL, &e);
    cr_assert(j, "not JSON (%s): %s", e.text, s);
    return j;
}

static json_t *choice0(json_t *j) { return json_array_get(json_object_get(j, "choices"), 0); }

static void expect_string(json_t *s, const char *want, size_t n, const char *what) {
    cr_assert(json_is_string(s), "%s: not a string", what);
    cr_expect(json_string_length(s) == n && !memcmp(json_string_value(s), want, n), "%s: got %zu bytes", what,
              json_string_length(s));
}

/* ids of "a", the NUL byte, "b": the text "a\0b" */
typedef struct {
    int32_t ids[3];
    float lps[3];
} nul_tokens;

static nul_tokens nul_ids(const kvs_tokenizer *t) {
    nul_tokens n = {{kvs_tokenizer_token_id(t, "a"), kvs_tokenizer_token_id(t, "\xC4\x80"), kvs_tokenizer_token_id(t, "b")},
                    {-0.5f, -1.5f, -2.5f}};
    for (int i = 0; i < 3; i++) cr_assert_geq(n.ids[i], 0);
    return n;
}

Test(server_text, nul_byte_in_whole_responses_and_chunks) {
    kvs_tokenizer *t = tiny();
    nul_tokens nt = nul_ids(t);
    kvs_resp_slice s = {"a\0b", 3, nt.ids, nt.lps, 3, 0, .finish = KVS_FINISH_STOP}, part = s;
    part.finish = KVS_FINISH_NONE;
    for (int chat = 0; chat < 2; chat++) {
        /* top_logprobs 1 for chat; completions' top_logprobs key the NUL token's text,
           which jansson does not parse back: checked as text below */
        kvs_resp_meta m = {chat ? KVS_API_CHAT : KVS_API_COMPLETIONS, "id-1", "tiny", 0, t, true, chat, false};
        char *full = kvs_resp_full(&m, &s, 1, 4, 3, NULL);
        char *chunk = kvs_resp_chunk(&m, &part, false, true);
        cr_assert(full && chunk);
        cr_expect(strstr(full, "a\\u0000b"), "whole (%s): %s", chat ? "chat" : "completions", full);
        cr_expect(strstr(chunk, "a\\u0000b"), "chunk (%s): %s", chat ? "chat" : "completions", chunk);
        json_t *jf = parse(full), *jc = parse(chunk);
        json_t *cf = choice0(jf), *cc = choice0(jc);
        if (chat) {
            expect_string(json_object_get(json_object_get(cf, "message"), "content"), "a\0b", 3, "message.content");
            expect_string(json_object_get(json_object_get(cc, "delta"), "content"), "a\0b", 3, "delta.content");
            json_t *tok1 = json_array_get(json_object_get(json_object_get(cf, "logprobs"), "content"), 1);
            expect_string(json_object_get(tok1, "token"), "\0", 1, "logprobs token");
            json_t *bytes = json_object_get(tok1, "bytes");
            cr_expect(json_array_size(bytes) == 1 && json_integer_value(json_array_get(bytes, 0)) == 0, "bytes [0]");
        } else {
            expect_string(json_object_get(cf, "text"), "a\0b", 3, "text");
            expect_string(json_object_get(cc, "text"), "a\0b", 3, "chunk text");
            json_t *lp = json_object_get(cf, "logprobs");
            expect_string(json_array_get(json_object_get(lp, "tokens"), 1), "\0", 1, "logprobs.tokens[1]");
            cr_expect_eq(json_integer_value(json_array_get(json_object_get(lp, "text_offset"), 2)), 2);
            m.top_logprobs = 1;
            char *with_top = kvs_resp_full(&m, &s, 1, 4, 3, NULL);
            cr_expect(strstr(with_top, "\"top_logprobs\":[{\"a\":-0.5},{\"\\u0000\":-1.5},{\"b\":-2.5}]"), "%s",
                      with_top);
            free(with_top);
        }
        json_decref(jf);
        json_decref(jc);
        free(full);
        free(chunk);
    }
    kvs_tokenizer_destroy(t);
}

/* ---- the SSE stream: outputs through kvs_gen_on_output, bytes from kvs_stream_read */
typedef struct {
    kvs_server srv;
    kvs_stream *st;
    char *out;
    size_t len, cap;
} sse_rig;

static void sse_open(sse_rig *r, kvs_api_kind kind, const kvs_tokenizer *t, bool include_usage) {
    memset(r, 0, sizeof *r);
    pthread_mutex_init(&r->srv.mu, NULL);
    pthread_cond_init(&r->srv.cv, NULL);
    r->srv.in_flight = 1;
    kvs_gen *g = kvs_gen_create(1, 0);
    cr_assert(g);
    g->refs = 2; /* the stream's and the engine's */
    r->st = calloc(1, sizeof *r->st);
    cr_assert(r->st);
    r->st->srv = &r->srv;
    r->st->gen = g;
    r->st->req_id = strdup("cmpl-test");
    r->st->meta = (kvs_resp_meta){kind, r->st->req_id, "tiny", 0, t, true, 0, false};
    r->st->include_usage = include_usage;
}

/* What the stream has ready (never blocks: call only when an output is pending). */
static bool sse_read(sse_rig *r) {
    char buf[256];
    ssize_t n = kvs_stream_read(r->st, r->len, buf, sizeof buf);
    if (n < 0) return false;
    if (r->len + (size_t)n + 1 > r->cap) {
        r->cap = (r->len + n + 1) * 2;
        r->out = realloc(r->out, r->cap);
    }
    memcpy(r->out + r->len, buf, (size_t)n);
    r->len += (size_t)n;
    r->out[r->len] = 0;
    return true;
}

static void sse_drain(sse_rig *r) {
    while (r->st->out_off < r->st->out_len || (!r->st->ended && r->st->gen->done)) sse_read(r);
}

static void sse_output(sse_rig *r, const char *text, size_t len, const int32_t *id, const float *lp, kvs_finish fin) {
    kvs_request_output o = {.request_id = 1, .token_ids = id, .logprobs = lp, .n_tokens = id ? 1 : 0, .text = text,
                            .text_len = len, .finish = fin, .error = fin == KVS_FINISH_ERROR ? "boom" : NULL,
                            .prompt_tokens = 2, .completion_tokens = 3};
    kvs_gen_on_output(r->st->gen, &o);
    sse_read(r); /* something is pending: the read takes it */
    sse_drain(r);
}

static void sse_close(sse_rig *r) {
    kvs_stream_free(r->st);
    pthread_mutex_destroy(&r->srv.mu);
    pthread_cond_destroy(&r->srv.cv);
    free(r->out);
}

/* Every event is one "data: <one line>\n\n"; the JSON ones parse. Returns the
 * concatenated text of the chunks (*len bytes) and counts events. */
static char *sse_text(const char *body, size_t body_len, bool chat, size_t *len, int *events, bool *done) {
    char *text = calloc(1, body_len + 1);
    *len = 0;
    *events = 0;
    *done = false;
    const char *p = body, *end = body + body_len;
    while (p < end) {
        cr_assert(end - p > 6 && !memcmp(p, "data: ", 6), "an event not starting with 'data: ': %s", p);
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        cr_assert(nl && nl + 1 < end && nl[1] == '\n', "an event that is not one line: %s", p);
        char *line = strndup(p + 6, (size_t)(nl - p - 6));
        (*events)++;
        if (!strcmp(line, "[DONE]")) {
            *done = true;
        } else {
            json_t *j = parse(line);
            json_t *c = choice0(j);
            json_t *s = chat ? json_object_get(json_object_get(c, "delta"), "content") : json_object_get(c, "text");
            if (json_is_string(s)) {
                memcpy(text + *len, json_string_value(s), json_string_length(s));
                *len += json_string_length(s);
            }
            json_decref(j);
        }
        free(line);
        p = nl + 2;
    }
    return text;
}

Test(server_text, sse_stream_carries_nul_bytes) {
    kvs_tokenizer *t = tiny();
    nul_tokens nt = nul_ids(t);
    for (int chat = 0; chat < 2; chat++)
        for (int usage = 0; usage < 2; usage++) {
            sse_rig r;
            sse_open(&r, chat ? KVS_API_CHAT : KVS_API_COMPLETIONS, t, usage);
            sse_output(&r, "a", 1, &nt.ids[0], &nt.lps[0], KVS_FINISH_NONE);
            sse_output(&r, "\0", 1, &nt.ids[1], &nt.lps[1], KVS_FINISH_NONE);
            sse_output(&r, "b\0\nc", 4, &nt.ids[2], &nt.lps[2], KVS_FINISH_STOP);
            cr_assert(r.st->ended, "no [DONE] after the last output");
            size_t len;
            int events;
            bool done;
            char *text = sse_text(r.out, r.len, chat, &len, &events, &done);
            cr_expect(len == 6 && !memcmp(text, "a\0b\0\nc", 6), "%s: the streamed text (%zu bytes) differs",
                      chat ? "chat" : "completions", len);
            cr_expect(strstr(r.out, "\\u0000"), "no \\u0000 in: %s", r.out);
            cr_expect(done);
            cr_expect_eq(events, 3 + chat + usage + 1, "events: %d in %s", events, r.out);
            free(text);
            sse_close(&r);
        }
    /* an error ends the stream with an error event and [DONE] */
    sse_rig r;
    sse_open(&r, KVS_API_CHAT, t, false);
    sse_output(&r, "x\0", 2, &nt.ids[0], NULL, KVS_FINISH_NONE);
    sse_output(&r, NULL, 0, NULL, NULL, KVS_FINISH_ERROR);
    size_t len;
    int events;
    bool done;
    free(sse_text(r.out, r.len, true, &len, &events, &done));
    cr_expect(done && strstr(r.out, "boom"), "%s", r.out);
    cr_expect_eq(len, 2u);
    sse_close(&r);
    kvs_tokenizer_destroy(t);
}

/* A chat stream with tools: the output, in pieces that split its tags and JSON,
 * arrives as delta.tool_calls (the name once, the arguments in fragments), the
 * text before the call as content, and finish_reason "tool_calls". */
Test(server_text, sse_stream_tool_calls) {
    sse_rig r;
    sse_open(&r, KVS_API_CHAT, NULL, false);
    r.st->meta.logprobs = false;
    r.st->meta.tools = KVS_TOOL_FORMAT_HERMES;
    r.st->tools = kvs_resp_tool_parsers(&r.st->meta, 1);
    /* each piece gives an event (a piece held back whole would leave the read waiting) */
    static const char *const pieces[] = {"Sure.\n<tool", "_call>\n{\"name\": \"get_weather\", \"arguments\": {\"ci",
                                         "ty\": \"Par", "is\"}}\n</tool_call>"};
    for (int i = 0; i < 4; i++) sse_output(&r, pieces[i], strlen(pieces[i]), NULL, NULL, KVS_FINISH_NONE);
    sse_output(&r, "", 0, NULL, NULL, KVS_FINISH_STOP);
    cr_assert(r.st->ended);
    char content[256] = "", name[64] = "", args[256] = "", finish[32] = "";
    int ids = 0, arg_events = 0;
    for (const char *p = r.out; (p = strstr(p, "data: ")); p += 6) {
        if (!strncmp(p + 6, "[DONE]", 6)) break;
        const char *end = strstr(p, "\n\n");
        json_t *j = json_loadb(p + 6, (size_t)(end - p - 6), 0, NULL);
        cr_assert(j, "%.*s", (int)(end - p), p);
        json_t *c = choice0(j), *delta = json_object_get(c, "delta");
        json_t *text = json_object_get(delta, "content"), *f = json_object_get(c, "finish_reason");
        if (json_is_string(text)) strcat(content, json_string_value(text));
        if (json_is_string(f)) snprintf(finish, sizeof finish, "%s", json_string_value(f));
        size_t k;
        json_t *d;
        json_array_foreach(json_object_get(delta, "tool_calls"), k, d) {
            cr_expect_eq(json_integer_value(json_object_get(d, "index")), 0);
            json_t *fn = json_object_get(d, "function");
            if (json_object_get(d, "id")) {
                ids++;
                strcat(name, json_string_value(json_object_get(fn, "name")));
            } else {
                cr_expect_null(json_object_get(fn, "name"), "the name is sent once");
            }
            strcat(args, json_string_value(json_object_get(fn, "arguments")));
            arg_events++;
        }
        json_decref(j);
    }
    cr_expect_str_eq(content, "Sure.\n");
    cr_expect_eq(ids, 1);
    cr_expect_str_eq(name, "get_weather");
    cr_expect_str_eq(args, "{\"city\": \"Paris\"}");
    cr_expect_geq(arg_events, 3, "the arguments come as they are generated");
    cr_expect_str_eq(finish, "tool_calls");
    sse_close(&r);
}
