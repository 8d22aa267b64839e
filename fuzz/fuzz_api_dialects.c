/* libFuzzer target: Anthropic's Messages and OpenAI's Responses request
 * parsers on arbitrary bytes (first byte: which, and count_tokens), then the
 * answers' writers, whole and streamed, on the rest as generated text (maybe
 * invalid UTF-8, maybe a tool call). No engine or model needed. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "server/anthropic.h"
#include "server/responses.h"

static void drop(void *ctx, const char *event, json_t *data) {
    (void)ctx, (void)event;
    json_decref(data);
}

static void answers(kvs_api_dialect d, kvs_tool_format f, const char *text, size_t len) {
    kvs_resp_meta m = {KVS_API_CHAT, d == KVS_DIALECT_ANTHROPIC ? "msg_x" : "resp_x", "m"};
    m.tools = f;
    m.dialect = d;
    kvs_resp_end end = {len % 3 ? KVS_FINISH_STOP : KVS_FINISH_LENGTH, len % 5 ? NULL : "S", false, 9, 2, 4, NULL};
    free(d == KVS_DIALECT_ANTHROPIC ? kvs_anth_full(&m, text, len, &end) : kvs_rsp_full(&m, NULL, 0, text, len, &end));
    kvs_api_stream w = {.dialect = d, .meta = m, .open = -1, .emit = drop};
    kvs_tool_parser *p = f ? kvs_tool_parser_create(f, 1) : NULL;
    for (size_t at = 0; at < len || at == 0; at += 7) { /* in pieces of 7 bytes */
        size_t k = len - at < 7 ? len - at : 7;
        kvs_tool_events ev = {0};
        kvs_tool_event plain = {-1, NULL, NULL, (char *)text + at, k};
        kvs_tool_events one = {&plain, 1, 1};
        if (p) {
            kvs_resp_slice s = {text + at, k};
            kvs_resp_tool_stream(p, &s, &ev, at + k >= len);
        }
        if (d == KVS_DIALECT_ANTHROPIC) kvs_anth_stream_events(&w, p ? &ev : &one);
        else kvs_rsp_stream_events(&w, p ? &ev : &one);
        kvs_tool_events_free(&ev);
        if (at + k >= len) break;
    }
    end.called = p && kvs_tool_parser_n_calls(p) > 0;
    if (len % 7 == 3) end.finish = KVS_FINISH_ERROR, end.error = "e";
    if (d == KVS_DIALECT_ANTHROPIC) kvs_anth_stream_end(&w, &end);
    else kvs_rsp_stream_end(&w, &end);
    kvs_tool_parser_destroy(p);
    free(w.acc), free(w.call_id), free(w.call_name);
    json_decref(w.items);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    int mode = data[0] % 4;
    const char *body = (const char *)data + 1;
    size_t len = size - 1;
    if (mode == 3) {
        answers(data[0] & 4 ? KVS_DIALECT_ANTHROPIC : KVS_DIALECT_RESPONSES,
                data[0] & 8 ? KVS_TOOL_FORMAT_HERMES : data[0] & 16 ? KVS_TOOL_FORMAT_LLAMA3_JSON : KVS_TOOL_FORMAT_NONE,
                body, len);
        return 0;
    }
    kvs_api_limits lim = {8192, 4096, 8};
    kvs_api_request r;
    kvs_api_error e;
    bool ok = mode == 2 ? kvs_rsp_parse_request(body, len, &lim, &r, &e)
                        : kvs_anth_parse_request(body, len, mode == 1, &lim, &r, &e);
    if (ok) {
        /* a valid request is a chat request the engine can take */
        if (r.kind != KVS_API_CHAT || r.n_messages < 1 || r.max_tokens < 0 || r.max_tokens > lim.max_model_len ||
            r.n_stop > KVS_MAX_STOP_STRINGS || r.sampling.temperature < 0 || (mode == 0 && r.max_tokens < 1) ||
            (mode == 2 && !r.echo))
            abort();
        for (int i = 0; i < r.n_messages; i++)
            if (!r.messages[i].role || !r.messages[i].content) abort();
        kvs_api_request_free(&r);
    } else {
        if (e.http_status < 400 || e.http_status > 599 || !e.message[0]) abort();
        free(kvs_api_error_json_as(&e, mode == 2 ? KVS_DIALECT_RESPONSES : KVS_DIALECT_ANTHROPIC));
    }
    return 0;
}
