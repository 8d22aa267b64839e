/* libFuzzer target: the tool-call parsers (server/tool_calls.h).
 *
 * Input: a byte (bits 0-1: the format, 0 none, 1 llama3_json, 2-3 hermes; bits
 * 2-7: the size of the stream's pieces), then the model's text.
 *
 * Checks: the stream's events are well formed (a call's first event has an
 * id and a name, later ones neither; calls numbered 0, 1, ... in order); fed
 * in pieces it gives what it gives fed whole (content, ids, names,
 * arguments); with no calls, the content is the text, byte for byte (nothing
 * held back is lost), streamed and whole; a whole parse's calls have a name
 * and an id. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/tool_calls.h"

static void check(bool ok, const char *what) {
    if (ok) return;
    fprintf(stderr, "fuzz_tool_calls: %s\n", what);
    abort();
}

static void stream(kvs_tool_format f, const char *text, size_t n, size_t piece, kvs_tool_result *r) {
    memset(r, 0, sizeof *r);
    kvs_tool_parser *p = kvs_tool_parser_create(f, 99);
    check(p != NULL, "create");
    kvs_tool_events ev = {0};
    int next = 0;
    for (size_t at = 0; at <= n; at += piece) {
        size_t len = at + piece <= n ? piece : n - at;
        check(kvs_tool_parser_feed(p, text + at, len, &ev) == KVS_OK, "feed");
        if (at + piece > n) check(kvs_tool_parser_finish(p, &ev) == KVS_OK, "finish");
        for (int i = 0; i < ev.n; i++) {
            const kvs_tool_event *e = &ev.v[i];
            check(e->text != NULL, "an event without text");
            if (e->call < 0) {
                check(!e->id && !e->name, "content with an id");
                continue;
            }
            check(!e->id == !e->name, "an id without a name");
            check(e->id ? e->call == next++ : e->call == next - 1, "calls out of order");
        }
        check(kvs_tool_result_add(r, &ev) == KVS_OK, "add");
        kvs_tool_events_clear(&ev);
    }
    check(kvs_tool_parser_n_calls(p) == next, "n_calls");
    if (!r->content) r->content = strdup("");
    kvs_tool_events_free(&ev);
    kvs_tool_parser_destroy(p);
}

static void same(const kvs_tool_result *a, const kvs_tool_result *b) {
    check(a->content_len == b->content_len && !memcmp(a->content, b->content, a->content_len), "content differs by pieces");
    check(a->calls.n == b->calls.n, "calls differ by pieces");
    for (int i = 0; i < a->calls.n; i++) {
        const kvs_tool_event *x = &a->calls.v[i], *y = &b->calls.v[i];
        check(!strcmp(x->id, y->id) && !strcmp(x->name, y->name) && x->len == y->len &&
                  !memcmp(x->text, y->text, x->len),
              "a call differs by pieces");
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    static const kvs_tool_format formats[] = {KVS_TOOL_FORMAT_NONE, KVS_TOOL_FORMAT_LLAMA3_JSON, KVS_TOOL_FORMAT_HERMES,
                                              KVS_TOOL_FORMAT_HERMES};
    kvs_tool_format f = formats[data[0] & 3];
    size_t piece = 1 + (data[0] >> 2);
    const char *text = (const char *)data + 1;
    size_t n = size - 1;
    kvs_tool_result one, pieces, whole;
    stream(f, text, n, n + 1, &one);
    stream(f, text, n, piece, &pieces);
    same(&one, &pieces);
    check(kvs_tool_parse_text(f, 99, text, n, &whole) == KVS_OK, "parse_text");
    if (one.calls.n == 0) check(one.content_len == n && !memcmp(one.content, text, n), "streamed text lost");
    if (whole.calls.n == 0) check(whole.content_len == n && !memcmp(whole.content, text, n), "text lost");
    for (int i = 0; i < whole.calls.n; i++) check(whole.calls.v[i].name[0] && !strncmp(whole.calls.v[i].id, "call_", 5), "a call without a name");
    kvs_tool_result_free(&one);
    kvs_tool_result_free(&pieces);
    kvs_tool_result_free(&whole);
    return 0;
}
