/* server: Anthropic's message, whole or as its stream of events (see anthropic.h). */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/anthropic.h"

char *kvs_anth_tool_id(const char *call_id) {
    const char *hex = call_id && !strncmp(call_id, "call_", 5) ? call_id + 5 : call_id ? call_id : "";
    size_t n = strlen(hex) + 7;
    char *s = malloc(n);
    if (s) snprintf(s, n, "toolu_%s", hex);
    return s;
}

static const char *stop_reason(const kvs_resp_end *e) {
    if (e->finish == KVS_FINISH_LENGTH) return "max_tokens";
    if (e->finish == KVS_FINISH_STOP && e->called) return "tool_use";
    if (e->finish == KVS_FINISH_STOP && e->stop_sequence) return "stop_sequence";
    return "end_turn";
}

/* Anthropic counts input_tokens apart from the tokens read from the cache: their sum is the prompt. */
static json_t *usage_json(const kvs_resp_end *e, bool with_input) {
    json_t *u = json_pack("{s:i}", "output_tokens", e->completion_tokens);
    if (with_input) {
        json_object_set_new(u, "input_tokens", json_integer(e->prompt_tokens - e->cached_tokens));
        json_object_set_new(u, "cache_creation_input_tokens", json_integer(0));
        json_object_set_new(u, "cache_read_input_tokens", json_integer(e->cached_tokens));
    }
    return u;
}

/* A call's arguments as the tool_use's input object ({} when they are not one). */
static json_t *input_json(const char *args, size_t n) {
    json_t *j = json_loadb(args ? args : "", n, JSON_DECODE_ANY, NULL);
    if (json_is_object(j)) return j;
    json_decref(j);
    return json_object();
}

static json_t *tool_use(const char *call_id, const char *name, json_t *input) {
    char *id = kvs_anth_tool_id(call_id);
    json_t *b = json_pack("{s:s, s:s?, s:s, s:o}", "type", "tool_use", "id", id, "name", name ? name : "", "input", input);
    free(id);
    return b;
}

char *kvs_anth_full(const kvs_resp_meta *m, const char *text, size_t n, const kvs_resp_end *end) {
    json_t *content = json_array();
    kvs_resp_end e = *end;
    kvs_resp_split sp;
    kvs_resp_split_calls(m, 0, text, n, &sp);
    if (sp.text_len)
        json_array_append_new(content, json_pack("{s:s, s:o}", "type", "text", "text", kvs_resp_text_json(sp.text, sp.text_len)));
    for (int i = 0; i < sp.n_calls; i++)
        json_array_append_new(content, tool_use(sp.r.calls.v[i].id, sp.r.calls.v[i].name,
                                                input_json(sp.r.calls.v[i].text, sp.r.calls.v[i].len)));
    e.called = sp.n_calls > 0;
    kvs_resp_split_free(&sp);
    json_t *root = json_pack("{s:s, s:s, s:s, s:s, s:o, s:s, s:o, s:o}", "id", m->id, "type", "message", "role",
                             "assistant", "model", m->model, "content", content, "stop_reason", stop_reason(&e),
                             "stop_sequence", e.stop_sequence && !e.called ? json_string(e.stop_sequence) : json_null(),
                             "usage", usage_json(&e, true));
    char *s = root ? json_dumps(root, JSON_COMPACT) : NULL;
    json_decref(root);
    return s;
}

/* ---- the stream ------------------------------------------------------------------ */
static void emit(kvs_api_stream *w, const char *event, json_t *data) {
    if (data) w->emit(w->ctx, event, data);
}

static void start(kvs_api_stream *w) {
    if (w->started) return;
    w->started = true;
    kvs_resp_end e = {.prompt_tokens = w->prompt_tokens};
    json_t *msg = json_pack("{s:s, s:s, s:s, s:s, s:[], s:n, s:n, s:o}", "id", w->meta.id, "type", "message", "role",
                            "assistant", "model", w->meta.model, "content", "stop_reason", "stop_sequence", "usage",
                            usage_json(&e, true));
    emit(w, "message_start", json_pack("{s:s, s:o}", "type", "message_start", "message", msg));
}

static void close_block(kvs_api_stream *w) {
    if (w->open < 0) return;
    emit(w, "content_block_stop", json_pack("{s:s, s:i}", "type", "content_block_stop", "index", w->open));
    w->open = -1;
}

static void open_block(kvs_api_stream *w, bool call, json_t *block) {
    close_block(w);
    w->open = w->n_opened++;
    w->open_call = call;
    emit(w, "content_block_start", json_pack("{s:s, s:i, s:o}", "type", "content_block_start", "index", w->open,
                                             "content_block", block));
    if (!w->seq) emit(w, "ping", json_pack("{s:s}", "type", "ping")); /* seq: ping sent */
    w->seq = 1;
}

static void delta(kvs_api_stream *w, const char *type, const char *key, const char *s, size_t n) {
    emit(w, "content_block_delta", json_pack("{s:s, s:i, s:{s:s, s:o}}", "type", "content_block_delta", "index",
                                             w->open, "delta", "type", type, key, kvs_resp_text_json(s, n)));
}

void kvs_anth_stream_events(kvs_api_stream *w, const kvs_tool_events *ev) {
    start(w);
    for (int i = 0; ev && i < ev->n; i++) {
        const kvs_tool_event *e = &ev->v[i];
        if (e->call < 0) { /* text */
            if (!e->len) continue;
            if (w->open < 0 || w->open_call) open_block(w, false, json_pack("{s:s, s:s}", "type", "text", "text", ""));
            delta(w, "text_delta", "text", e->text, e->len);
            continue;
        }
        if (w->meta.one_call && e->call > 0) continue; /* disable_parallel_tool_use: the first call only */
        if (e->id) open_block(w, true, tool_use(e->id, e->name, json_object()));
        if (e->len && w->open >= 0 && w->open_call) delta(w, "input_json_delta", "partial_json", e->text, e->len);
    }
}

void kvs_anth_stream_end(kvs_api_stream *w, const kvs_resp_end *end) {
    start(w);
    close_block(w);
    if (end->finish == KVS_FINISH_ERROR) {
        char msg[600];
        snprintf(msg, sizeof msg, "generation failed: %s", end->error ? end->error : "unknown error");
        emit(w, "error", json_pack("{s:s, s:{s:s, s:s}}", "type", "error", "error", "type", "api_error", "message", msg));
        return;
    }
    if (!w->seq) emit(w, "ping", json_pack("{s:s}", "type", "ping"));
    json_t *d = json_pack("{s:s, s:o}", "stop_reason", stop_reason(end), "stop_sequence",
                          end->stop_sequence && !end->called ? json_string(end->stop_sequence) : json_null());
    emit(w, "message_delta", json_pack("{s:s, s:o, s:o}", "type", "message_delta", "delta", d, "usage",
                                       usage_json(end, true)));
    emit(w, "message_stop", json_pack("{s:s}", "type", "message_stop"));
}
