/* libFuzzer target: the HTTP request path as far as it goes without sockets
 * (src/server/route.c and framing.c, as http.c drives them): the header
 * fields' framing rules (repeated or conflicting Content-Length and
 * Transfer-Encoding, transfer codings, Host, an Authorization with a NUL),
 * routing (method + URL, the absolute form), the Authorization and x-api-key
 * check, the body limit (Content-Length and the bytes as they arrive, in
 * pieces), the OpenAI, Anthropic and Responses parsers and validation
 * (count_tokens and vLLM's render routes answered whole, render compiling the
 * request's grammar), the chat template and the tokenizer of
 * models/tiny-needle-llama. A request that would reach the engine stops there
 * (no engine: /metrics answers 503).
 *
 * Input: byte 0 picks the server (bit 0: an API key "k"; bit 1: the tokenizer;
 * bit 2: draining; bits 3-5: the body's piece size, 2^n bytes, 0 = whole;
 * bit 6: HTTP/1.0), then lines: method, URL, then header fields "Name: value"
 * (a value may hold any byte but a newline, NUL included) up to an empty
 * line, then the body.
 * Checked: every answer is a status in [200, 599] with a body, JSON where it
 * says so, an error object for errors; a request ready for the engine has a
 * prompt of ids inside the vocabulary that fits the context with its
 * max_tokens, came through POST on a generation route with a body within the
 * limit, and has well-framed fields (one Content-Length at most, no
 * Transfer-Encoding beside it). */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "server/route.h"

#ifndef KVS_SOURCE_DIR
#define KVS_SOURCE_DIR "."
#endif

enum { MAX_BODY = 16384, MAX_LEN = 128 }; /* text beyond 64 x 128 = 8192 bytes is refused before tokenizing */

static kvs_server *servers[4]; /* [key][tokenizer] */
static kvs_tokenizer *tok;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    kvs_log_set_level(KVS_LOG_ERROR);
    if (kvs_tokenizer_load(KVS_SOURCE_DIR "/models/tiny-needle-llama", &tok) != KVS_OK) {
        fprintf(stderr, "fuzz_http_request: no tokenizer (%s): text prompts stop at 'no tokenizer'\n", kvs_last_error());
        tok = NULL;
    }
    for (int i = 0; i < 4; i++) {
        kvs_server_config cfg = {.api_key = i & 1 ? "k" : NULL, .served_model_name = "tiny",
                                 .max_body_bytes = MAX_BODY, .max_model_len = MAX_LEN, .n_layers = 8};
        if (kvs_server_create(&cfg, NULL, i & 2 ? tok : NULL, &servers[i]) != KVS_OK) abort();
    }
    return 0;
}

/* The next line of [*p, end) as a NUL-terminated copy into buf; NULL when empty. */
static const char *next_line(const char **p, const char *end, char *buf, size_t cap) {
    const char *nl = memchr(*p, '\n', (size_t)(end - *p));
    const char *stop = nl ? nl : end;
    size_t n = (size_t)(stop - *p);
    if (n >= cap) n = cap - 1;
    memcpy(buf, *p, n);
    buf[n] = 0;
    *p = nl ? nl + 1 : end;
    return buf[0] ? buf : NULL;
}

enum { MAX_FIELDS = 16 };

/* "Name: value" lines up to an empty one, as slices of the input (values may hold NUL). */
static int next_fields(const char **p, const char *end, kvs_http_header *h) {
    int n = 0;
    while (*p < end && n < MAX_FIELDS) {
        const char *nl = memchr(*p, '\n', (size_t)(end - *p)), *stop = nl ? nl : end;
        const char *line = *p;
        *p = nl ? nl + 1 : end;
        if (stop == line) break;
        const char *colon = memchr(line, ':', (size_t)(stop - line));
        if (!colon) continue;
        const char *v = colon + 1;
        while (v < stop && *v == ' ') v++;
        h[n++] = (kvs_http_header){line, v, (size_t)(colon - line), (size_t)(stop - v), false};
    }
    return n;
}

static int count_fields(const kvs_http_header *h, int n, const char *name) {
    int k = 0;
    for (int i = 0; i < n; i++) k += h[i].name_len == strlen(name) && !strncasecmp(h[i].name, name, h[i].name_len);
    return k;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    kvs_server *s = servers[(data[0] & 1) | (data[0] & 2)];
    atomic_store(&s->draining, (data[0] & 4) != 0);
    int piece = (data[0] >> 3) & 7;
    size_t chunk = piece ? (size_t)1 << (piece - 1) * 2 : 0; /* 1, 4, 16, ... 4096 bytes, or whole */
    const char *version = data[0] & 64 ? "HTTP/1.0" : "HTTP/1.1";
    const char *p = (const char *)data + 1, *end = (const char *)data + size;
    char method[64], url[512];
    const char *m = next_line(&p, end, method, sizeof method);
    const char *u = next_line(&p, end, url, sizeof url);
    kvs_http_header h[MAX_FIELDS];
    int n = next_fields(&p, end, h);
    kvs_http_answer ans;
    kvs_http_prepared prep;
    bool ready = kvs_http_handle(s, m ? m : "", u ? u : "", version, h, n, p, (size_t)(end - p), chunk, &ans, &prep);
    atomic_store(&s->draining, false);
    if (ready) {
        const char *path = u ? kvs_http_origin_path(u) : "";
        /* Anthropic's messages and OpenAI's responses are chat requests in other shapes */
        bool chat = !strcmp(path, "/v1/chat/completions") || !strcmp(path, "/v1/messages") ||
                    !strcmp(path, "/v1/responses");
        if (!m || strcmp(m, "POST") || (!chat && strcmp(path, "/v1/completions"))) abort();
        if ((size_t)(end - p) > MAX_BODY || ans.status || ans.body) abort();
        if (count_fields(h, n, "Content-Length") > 1 ||
            (count_fields(h, n, "Content-Length") && count_fields(h, n, "Transfer-Encoding")))
            abort();
        if (prep.n_ids < 1 || prep.n_ids >= MAX_LEN || prep.max_tokens < 1 || prep.n_ids + prep.max_tokens > MAX_LEN)
            abort();
        int vocab = s->limits.vocab_size;
        for (int i = 0; i < prep.n_ids; i++)
            if (prep.ids[i] < 0 || prep.ids[i] >= vocab) abort();
        if (prep.req.kind != (chat ? KVS_API_CHAT : KVS_API_COMPLETIONS)) abort();
        kvs_http_prepared_free(&prep);
        return 0;
    }
    if (ans.status < 200 || ans.status > 599 || !ans.body || !ans.content_type) abort();
    if (strstr(ans.content_type, "json")) {
        json_t *j = json_loads(ans.body, 0, NULL);
        if (!j) abort();
        if (ans.status >= 400 && !(u && !strcmp(kvs_http_origin_path(u), "/health"))) {
            json_t *e = json_object_get(j, "error");
            if (!json_is_string(json_object_get(e, "message"))) abort();
        }
        json_decref(j);
    }
    free(ans.body);
    return 0;
}
