/* server: tool calls in chat responses: message.tool_calls of a whole output,
 * delta.tool_calls of a stream's chunks (as OpenAI and vLLM send them). */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "server/server_internal.h"

uint64_t kvs_resp_tool_seed(const kvs_resp_meta *m, int index) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a of the response id, then the choice */
    for (const char *p = m->id ? m->id : ""; *p; p++) h = (h ^ (unsigned char)*p) * 1099511628211ull;
    return (h ^ (uint64_t)index) * 1099511628211ull;
}

kvs_tool_parser **kvs_resp_tool_parsers(const kvs_resp_meta *m, int n_choices) {
    kvs_tool_parser **p = calloc(n_choices > 0 ? n_choices : 1, sizeof *p);
    for (int i = 0; p && i < n_choices; i++)
        if (!(p[i] = kvs_tool_parser_create(m->tools, kvs_resp_tool_seed(m, i)))) {
            kvs_resp_tool_parsers_free(p, i);
            return NULL;
        }
    return p;
}

void kvs_resp_tool_parsers_free(kvs_tool_parser **p, int n_choices) {
    if (!p) return;
    for (int i = 0; i < n_choices; i++) kvs_tool_parser_destroy(p[i]);
    free(p);
}

static bool only_space(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!strchr(" \t\r\n", s[i])) return false;
    return true;
}

static json_t *text_or_null(const char *s, size_t n) {
    json_t *j = json_stringn(s, n);
    return j ? j : json_string("\xEF\xBF\xBD"); /* never expected: the text is valid UTF-8 */
}

void kvs_resp_split_calls(const kvs_resp_meta *m, int index, const char *text, size_t n, kvs_resp_split *out) {
    *out = (kvs_resp_split){.text = text ? text : "", .text_len = text ? n : 0};
    out->parsed = m->tools != KVS_TOOL_FORMAT_NONE &&
                  kvs_tool_parse_text(m->tools, kvs_resp_tool_seed(m, index), out->text, out->text_len, &out->r) == KVS_OK;
    if (!out->parsed) return;
    out->n_calls = m->one_call && out->r.calls.n > 1 ? 1 : out->r.calls.n;
    out->text = out->r.content;
    out->text_len = out->n_calls > 0 && only_space(out->r.content, out->r.content_len) ? 0 : out->r.content_len;
}

void kvs_resp_split_free(kvs_resp_split *s) {
    if (s->parsed) kvs_tool_result_free(&s->r);
    s->parsed = false;
}

json_t *kvs_resp_tool_message(const kvs_resp_meta *m, int index, const char *text, size_t n, bool *called) {
    kvs_resp_split sp;
    kvs_resp_split_calls(m, index, text, n, &sp);
    json_t *msg = json_pack("{s:s}", "role", "assistant");
    /* beside calls, a content of only whitespace is null, as OpenAI sends it */
    json_object_set_new(msg, "content", sp.n_calls > 0 && !sp.text_len ? json_null() : text_or_null(sp.text, sp.text_len));
    if (sp.n_calls > 0) {
        json_t *calls = json_array();
        for (int i = 0; i < sp.n_calls; i++) {
            const kvs_tool_event *c = &sp.r.calls.v[i];
            json_array_append_new(calls, json_pack("{s:s, s:s, s:{s:s, s:o}}", "id", c->id, "type", "function", "function",
                                                   "name", c->name, "arguments", text_or_null(c->text, c->len)));
        }
        json_object_set_new(msg, "tool_calls", calls);
    }
    *called = sp.n_calls > 0;
    kvs_resp_split_free(&sp);
    return msg;
}

void kvs_resp_tool_delta(const kvs_resp_meta *m, json_t *delta, const kvs_tool_events *ev) {
    json_t *content = NULL, *calls = NULL;
    for (int i = 0; i < ev->n; i++) {
        const kvs_tool_event *e = &ev->v[i];
        if (e->call < 0) {
            json_t *more = text_or_null(e->text, e->len);
            if (content) { /* content after a call in the same delta: one string */
                size_t a = json_string_length(content), b = json_string_length(more);
                char *both = malloc(a + b + 1);
                if (both) {
                    memcpy(both, json_string_value(content), a);
                    memcpy(both + a, json_string_value(more), b);
                    json_string_setn(content, both, a + b);
                    free(both);
                }
                json_decref(more);
            } else {
                content = more;
            }
            continue;
        }
        if (m->one_call && e->call > 0) continue;
        json_t *fn = json_object(), *d = json_pack("{s:i}", "index", e->call);
        if (e->id) {
            json_object_set_new(d, "id", json_string(e->id));
            json_object_set_new(d, "type", json_string("function"));
            json_object_set_new(fn, "name", json_string(e->name));
        }
        json_object_set_new(fn, "arguments", text_or_null(e->text, e->len));
        json_object_set_new(d, "function", fn);
        if (!calls) calls = json_array();
        json_array_append_new(calls, d);
    }
    if (content) json_object_set_new(delta, "content", content);
    if (calls) json_object_set_new(delta, "tool_calls", calls);
}

void kvs_resp_tool_stream(kvs_tool_parser *p, kvs_resp_slice *s, kvs_tool_events *ev, bool last) {
    kvs_status st = kvs_tool_parser_feed(p, s->text ? s->text : "", s->text ? s->text_len : 0, ev);
    if (st == KVS_OK && last) st = kvs_tool_parser_finish(p, ev);
    if (st != KVS_OK) kvs_log(KVS_LOG_WARN, "%s", kvs_last_error());
    s->tool_events = ev;
    s->tools_called = kvs_tool_parser_n_calls(p) > 0;
}
