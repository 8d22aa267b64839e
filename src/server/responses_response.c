/* server: the Responses API's response object, whole or as its stream of
 * events (see responses.h). */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/responses.h"

/* "PREFIX" + what follows the first '_' of id ("resp_X" -> "msg_X", "call_X" -> "fc_X"); k > 0 appended. */
static json_t *item_id(const char *prefix, const char *id, int k) {
    const char *u = id ? strchr(id, '_') : NULL;
    const char *hex = u ? u + 1 : id ? id : "";
    return k > 0 ? json_sprintf("%s_%s_%d", prefix, hex, k) : json_sprintf("%s_%s", prefix, hex);
}

static json_t *usage_json(const kvs_resp_end *e) {
    return json_pack("{s:i, s:{s:i}, s:i, s:{s:i}, s:i}", "input_tokens", e->prompt_tokens, "input_tokens_details",
                     "cached_tokens", e->cached_tokens, "output_tokens", e->completion_tokens, "output_tokens_details",
                     "reasoning_tokens", 0, "total_tokens", e->prompt_tokens + e->completion_tokens);
}

/* The response object without output and usage: status and the request's fields. */
static json_t *shell(const kvs_resp_meta *m, const json_t *echo, long long created, const char *status) {
    json_t *r = json_pack("{s:s, s:s, s:I, s:s, s:n, s:n, s:s}", "id", m->id, "object", "response", "created_at",
                          (json_int_t)created, "status", status, "error", "incomplete_details", "model", m->model);
    if (r && echo) json_object_update(r, (json_t *)echo);
    return r;
}

/* The end's status into r, with output and usage. */
static void finish(json_t *r, json_t *output, const kvs_resp_end *e) {
    bool cut = e->finish == KVS_FINISH_LENGTH;
    json_object_set_new(r, "status", json_string(cut ? "incomplete" : "completed"));
    if (cut) json_object_set_new(r, "incomplete_details", json_pack("{s:s}", "reason", "max_output_tokens"));
    json_object_set_new(r, "output", output);
    json_object_set_new(r, "usage", usage_json(e));
}

static json_t *text_part(json_t *text) {
    return json_pack("{s:s, s:o, s:[], s:[]}", "type", "output_text", "text", text, "annotations", "logprobs");
}

static json_t *message_item(json_t *id, const char *status, json_t *content) {
    return json_pack("{s:o, s:s, s:s, s:s, s:o}", "id", id, "type", "message", "status", status, "role", "assistant",
                     "content", content);
}

static json_t *call_item(const char *call_id, const char *name, json_t *args, const char *status) {
    return json_pack("{s:o, s:s, s:s, s:s, s:s, s:o}", "id", item_id("fc", call_id, 0), "type", "function_call",
                     "status", status, "call_id", call_id ? call_id : "", "name", name ? name : "", "arguments", args);
}

char *kvs_rsp_full(const kvs_resp_meta *m, const json_t *echo, long long created, const char *text, size_t n,
                   const kvs_resp_end *end) {
    json_t *output = json_array();
    kvs_resp_split sp;
    kvs_resp_split_calls(m, 0, text, n, &sp);
    const char *status = end->finish == KVS_FINISH_LENGTH ? "incomplete" : "completed";
    if (sp.text_len)
        json_array_append_new(output, message_item(item_id("msg", m->id, 0), status,
                                                   json_pack("[o]", text_part(kvs_resp_text_json(sp.text, sp.text_len)))));
    for (int i = 0; i < sp.n_calls; i++)
        json_array_append_new(output, call_item(sp.r.calls.v[i].id, sp.r.calls.v[i].name,
                                                kvs_resp_text_json(sp.r.calls.v[i].text, sp.r.calls.v[i].len), "completed"));
    kvs_resp_split_free(&sp);
    json_t *root = shell(m, echo, created, "completed");
    finish(root, output, end);
    char *s = root ? json_dumps(root, JSON_COMPACT) : NULL;
    json_decref(root);
    return s;
}

/* ---- the stream ------------------------------------------------------------------ */
/* An event: its type (also the SSE event's name) and sequence_number added. */
static void ev(kvs_api_stream *w, const char *type, json_t *data) {
    if (!data) return;
    json_object_set_new(data, "type", json_string(type));
    json_object_set_new(data, "sequence_number", json_integer(w->seq++));
    w->emit(w->ctx, type, data);
}

static bool acc_add(kvs_api_stream *w, const char *s, size_t n) {
    if (w->acc_len + n + 1 > w->acc_cap) {
        size_t cap = (w->acc_len + n + 1) * 2;
        char *p = realloc(w->acc, cap);
        if (!p) return false;
        w->acc = p, w->acc_cap = cap;
    }
    memcpy(w->acc + w->acc_len, s, n);
    w->acc_len += n;
    w->acc[w->acc_len] = 0;
    return true;
}

static void start(kvs_api_stream *w) {
    if (w->started) return;
    w->started = true;
    if (!w->items) w->items = json_array();
    const char *types[] = {"response.created", "response.in_progress"};
    for (int i = 0; i < 2; i++) {
        json_t *r = shell(&w->meta, w->echo, w->created, "in_progress");
        json_object_set_new(r, "output", json_array());
        json_object_set_new(r, "usage", json_null());
        ev(w, types[i], json_pack("{s:o}", "response", r));
    }
}

static json_t *open_id(kvs_api_stream *w) {
    return w->open_call ? item_id("fc", w->call_id, 0) : item_id("msg", w->meta.id, w->open);
}

/* status: a message's when the output was cut (incomplete) */
static void close_item(kvs_api_stream *w, const char *status) {
    if (w->open < 0) return;
    json_t *text = kvs_resp_text_json(w->acc, w->acc_len), *item;
    if (w->open_call) {
        ev(w, "response.function_call_arguments.done", json_pack("{s:o, s:i, s:O}", "item_id", open_id(w),
                                                                "output_index", w->open, "arguments", text));
        item = call_item(w->call_id, w->call_name, text, "completed");
    } else {
        ev(w, "response.output_text.done", json_pack("{s:o, s:i, s:i, s:O, s:[]}", "item_id", open_id(w), "output_index",
                                                     w->open, "content_index", 0, "text", text, "logprobs"));
        ev(w, "response.content_part.done", json_pack("{s:o, s:i, s:i, s:o}", "item_id", open_id(w), "output_index",
                                                      w->open, "content_index", 0, "part", text_part(json_incref(text))));
        item = message_item(open_id(w), status, json_pack("[o]", text_part(text)));
    }
    ev(w, "response.output_item.done", json_pack("{s:i, s:O}", "output_index", w->open, "item", item));
    json_array_append_new(w->items, item);
    w->open = -1;
    w->acc_len = 0;
    free(w->call_id), free(w->call_name);
    w->call_id = w->call_name = NULL;
}

static void open_item(kvs_api_stream *w, const kvs_tool_event *call) {
    close_item(w, "completed");
    w->open = w->n_opened++;
    w->open_call = call != NULL;
    if (call) {
        w->call_id = strdup(call->id ? call->id : "");
        w->call_name = strdup(call->name ? call->name : "");
        ev(w, "response.output_item.added", json_pack("{s:i, s:o}", "output_index", w->open, "item",
                                                      call_item(w->call_id, w->call_name, json_string(""), "in_progress")));
        return;
    }
    ev(w, "response.output_item.added", json_pack("{s:i, s:o}", "output_index", w->open, "item",
                                                  message_item(open_id(w), "in_progress", json_array())));
    ev(w, "response.content_part.added", json_pack("{s:o, s:i, s:i, s:o}", "item_id", open_id(w), "output_index", w->open,
                                                   "content_index", 0, "part", text_part(json_string(""))));
}

void kvs_rsp_stream_events(kvs_api_stream *w, const kvs_tool_events *evs) {
    start(w);
    for (int i = 0; evs && i < evs->n; i++) {
        const kvs_tool_event *e = &evs->v[i];
        if (e->call < 0) {
            if (!e->len) continue;
            if (w->open < 0 || w->open_call) open_item(w, NULL);
            acc_add(w, e->text, e->len);
            ev(w, "response.output_text.delta", json_pack("{s:o, s:i, s:i, s:o, s:[]}", "item_id", open_id(w),
                                                          "output_index", w->open, "content_index", 0, "delta",
                                                          kvs_resp_text_json(e->text, e->len), "logprobs"));
            continue;
        }
        if (w->meta.one_call && e->call > 0) continue; /* parallel_tool_calls false: the first call only */
        if (e->id) open_item(w, e);
        if (!e->len || w->open < 0 || !w->open_call) continue;
        acc_add(w, e->text, e->len);
        ev(w, "response.function_call_arguments.delta", json_pack("{s:o, s:i, s:o}", "item_id", open_id(w),
                                                                  "output_index", w->open, "delta",
                                                                  kvs_resp_text_json(e->text, e->len)));
    }
}

void kvs_rsp_stream_end(kvs_api_stream *w, const kvs_resp_end *end) {
    start(w);
    close_item(w, end->finish == KVS_FINISH_LENGTH ? "incomplete" : "completed");
    json_t *r = shell(&w->meta, w->echo, w->created, "failed");
    if (end->finish == KVS_FINISH_ERROR) {
        json_object_set_new(r, "output", json_incref(w->items));
        json_object_set_new(r, "error", json_pack("{s:s, s:s+}", "code", "server_error", "message", "generation failed: ",
                                                  end->error ? end->error : "unknown error"));
        ev(w, "response.failed", json_pack("{s:o}", "response", r));
        return;
    }
    finish(r, json_incref(w->items), end);
    ev(w, end->finish == KVS_FINISH_LENGTH ? "response.incomplete" : "response.completed", json_pack("{s:o}", "response", r));
}
