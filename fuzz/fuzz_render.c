/* libFuzzer target: vLLM's render endpoints (src/server/render.c) against the
 * generating routes they stand for, on arbitrary bodies: the generating
 * route's preparation as a request worker runs it (route.c's kvs_http_prepare,
 * the grammar compiled), then the render route's answer through the request
 * path's dispatch (kvs_http_answer_whole). Checked: render answers 200 exactly
 * when the generating route takes the body, and then with vLLM's
 * GenerateRequest (completions: an array of one) whose token_ids are the
 * prepared prompt, id for id, whose sampling_params.max_tokens is the
 * validated one, and whose other fields have their types; else the very same
 * error (status and JSON bytes). The chat template and the tokenizer of
 * models/tiny-needle-llama; no engine.
 *
 * Input: byte 0 picks the route (bit 0: chat, else completions) and the
 * context (bit 1: 128 tokens, else 8192); the rest is the body. */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/route.h"

#ifndef KVS_SOURCE_DIR
#define KVS_SOURCE_DIR "."
#endif

static kvs_server *servers[2]; /* [short context] */
static kvs_tokenizer *tok;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    kvs_log_set_level(KVS_LOG_ERROR);
    if (kvs_tokenizer_load(KVS_SOURCE_DIR "/models/tiny-needle-llama", &tok) != KVS_OK) {
        fprintf(stderr, "fuzz_render: no tokenizer (%s)\n", kvs_last_error());
        abort(); /* without it every text prompt stops at 'no tokenizer': nothing to compare */
    }
    for (int i = 0; i < 2; i++) {
        /* bounds without a deadline: both routes compile a schema to the same verdict */
        kvs_server_config cfg = {.served_model_name = "tiny", .max_model_len = i ? 128 : 8192, .n_layers = 8,
                                 .grammar_limits = {.max_values = 2000, .max_states = 4096, .max_transitions = 100000,
                                                    .max_bytes = (size_t)16 << 20, .max_seconds = 1e6}};
        if (kvs_server_create(&cfg, NULL, tok, &servers[i]) != KVS_OK) abort();
    }
    return 0;
}

static bool is_int(json_t *j) { return json_is_integer(j); }

/* The GenerateRequest g of a body the generating route prepared as p. */
static void check_generate_request(json_t *g, const kvs_http_prepared *p, bool chat, const kvs_server *s) {
    const char *id = json_string_value(json_object_get(g, "request_id"));
    if (!id || strncmp(id, chat ? "chatcmpl-" : "cmpl-", chat ? 9 : 5)) abort();
    json_t *ids = json_object_get(g, "token_ids");
    if (!json_is_array(ids) || json_array_size(ids) != (size_t)p->n_ids || p->n_ids < 1) abort();
    for (int i = 0; i < p->n_ids; i++) {
        json_t *t = json_array_get(ids, (size_t)i);
        if (!is_int(t) || json_integer_value(t) != p->ids[i] || p->ids[i] < 0 || p->ids[i] >= s->limits.vocab_size)
            abort();
    }
    json_t *sp = json_object_get(g, "sampling_params");
    json_t *max = json_object_get(sp, "max_tokens");
    if (!json_is_object(sp) || !is_int(max) || json_integer_value(max) != p->max_tokens) abort();
    if (p->n_ids + p->max_tokens > s->limits.max_model_len) abort();
    if (!json_is_array(json_object_get(sp, "stop")) || !is_int(json_object_get(sp, "n")) ||
        !json_is_number(json_object_get(sp, "temperature")))
        abort();
    if (!json_is_null(json_object_get(g, "features")) || !json_is_string(json_object_get(g, "model")) ||
        !json_is_boolean(json_object_get(g, "stream")))
        abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    bool chat = data[0] & 1;
    kvs_server *s = servers[(data[0] >> 1) & 1];
    const char *body = (const char *)data + 1;
    size_t len = size - 1;
    atomic_bool cancel = false;
    kvs_http_prepared p;
    kvs_api_error err;
    bool takes = kvs_http_prepare(s, chat ? KVS_ROUTE_CHAT : KVS_ROUTE_COMPLETIONS, body, len, &cancel, &p, &err);
    kvs_http_answer a;
    if (!kvs_http_answer_whole(s, chat ? KVS_ROUTE_CHAT_RENDER : KVS_ROUTE_COMPLETIONS_RENDER, body, len, &cancel, &a))
        abort();
    if (!a.body || !a.content_type || strcmp(a.content_type, "application/json")) abort();
    json_t *j = json_loads(a.body, 0, NULL);
    if (!j) abort();
    if (takes) {
        if (a.status != 200) abort();
        if (!chat && (!json_is_array(j) || json_array_size(j) != 1)) abort();
        check_generate_request(chat ? j : json_array_get(j, 0), &p, chat, s);
        kvs_http_prepared_free(&p);
    } else {
        char *want = kvs_api_error_json(&err);
        if (a.status != err.http_status || strcmp(a.body, want)) abort();
        free(want);
    }
    json_decref(j);
    free(a.body);
    return 0;
}
