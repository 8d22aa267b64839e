/* Tool-call parsers (server/tool_calls.h) on outputs as the models write them
 * (Qwen 2.5 / Hermes <tool_call> blocks, Llama 3.x JSON and <|python_tag|>
 * calls; several from vLLM's parser tests), parsed whole and streamed: split
 * at every point, byte by byte and in random pieces, the same content and
 * calls. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"
#include "server/tool_calls.h"

typedef struct {
    const char *name, *args;
} want_call;

typedef struct {
    kvs_tool_format format;
    const char *output;  /* the model's text */
    const char *content; /* what the response's content is */
    int n_calls;
    want_call calls[3];
} tool_case;

#define H KVS_TOOL_FORMAT_HERMES
#define L KVS_TOOL_FORMAT_LLAMA3_JSON

static const tool_case CASES[] = {
    /* Hermes / Qwen */
    {H, "<tool_call>\n{\"name\": \"get_current_temperature\", \"arguments\": {\"location\": \"San Francisco, CA, USA\"}}\n</tool_call>",
     "", 1, {{"get_current_temperature", "{\"location\": \"San Francisco, CA, USA\"}"}}},
    {H, "<tool_call>\n{\"name\": \"get_current_temperature\", \"arguments\": {\"location\": \"San Francisco, CA, USA\"}}\n</tool_call>\n"
        "<tool_call>\n{\"name\": \"get_temperature_date\", \"arguments\": {\"location\": \"San Francisco, CA, USA\", \"date\": \"2024-10-01\"}}\n</tool_call>",
     "", 2, {{"get_current_temperature", "{\"location\": \"San Francisco, CA, USA\"}"},
             {"get_temperature_date", "{\"location\": \"San Francisco, CA, USA\", \"date\": \"2024-10-01\"}"}}},
    {H, "Let me check the weather for you.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": [1, 2]}}\n</tool_call>",
     "Let me check the weather for you.\n", 1, {{"get_weather", "{\"city\": \"Paris\", \"days\": [1, 2]}"}}},
    {H, "The answer is 4 < 5, and <b>bold</b> <tool_cal", "The answer is 4 < 5, and <b>bold</b> <tool_cal", 0, {{0}}},
    {H, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"s\": \"a \\\"}\\\" b\", \"n\": {\"m\": [{}]}}}", /* cut short: no closing tag */
     "", 1, {{"f", "{\"s\": \"a \\\"}\\\" b\", \"n\": {\"m\": [{}]}}"}}},
    {H, "<tool_call>\nnot json\n</tool_call> after", "<tool_call>\nnot json\n</tool_call> after", 0, {{0}}},
    {H, "<tool_call>{\"arguments\":\"{\\\"a\\\": 1}\",\"name\":\"g\"}</tool_call><tool_call>{\"name\":\"now\"}</tool_call>",
     "", 2, {{"g", "{\"a\": 1}"}, {"now", "{}"}}},
    {H, "<tool_call>\n{\"name\": \"f\", \"argu", "<tool_call>\n{\"name\": \"f\", \"argu", 0, {{0}}},
    {H, "  \n", "  \n", 0, {{0}}},
    {H, "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\nDone.", "\nDone.", 1, {{"f", "{}"}}},
    /* Llama 3.x */
    {L, "{\"name\": \"searchTool\", \"parameters\": {\"query\": \"test query\", \"limit\": 10}}", "", 1,
     {{"searchTool", "{\"query\": \"test query\", \"limit\": 10}"}}},
    {L, "{\"name\": \"searchTool\", \"parameters\": {\"query\": \"test1\"}}; {\"name\": \"getOpenIncidentsTool\", \"parameters\": {}}; "
        "{\"name\": \"searchTool\", \"parameters\": {\"query\": \"test2\"}}",
     "", 3, {{"searchTool", "{\"query\": \"test1\"}"}, {"getOpenIncidentsTool", "{}"}, {"searchTool", "{\"query\": \"test2\"}"}}},
    {L, "{\"name\": \"searchTool\", \"arguments\": {\"query\": \"test\"}}\n{\"name\": \"t\", \"parameters\": {\"x\": true}}", "", 2,
     {{"searchTool", "{\"query\": \"test\"}"}, {"t", "{\"x\": true}"}}},
    {L, "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}", "", 1,
     {{"get_weather", "{\"city\": \"Paris\"}"}}},
    {L, "<|python_tag|>brave_search.call(query=\"weather in Paris, \\\"today\\\"\", n=3, safe=True)", "", 1,
     {{"brave_search", "{\"query\":\"weather in Paris, \\\"today\\\"\",\"n\":3,\"safe\":true}"}}},
    {L, "<|python_tag|>import math\nprint(math.pi)", "<|python_tag|>import math\nprint(math.pi)", 0, {{0}}},
    {L, "This is just some text without any tool calls", "This is just some text without any tool calls", 0, {{0}}},
    {L, "Here is the result: {\"name\": \"getOpenIncidentsTool\", \"parameters\": {}} Would you like to know more?",
     "Here is the result:  Would you like to know more?", 1, {{"getOpenIncidentsTool", "{}"}}},
    {L, "{\"answer\": 42} and {\"name\": \"Bob\"", "{\"answer\": 42} and {\"name\": \"Bob\"", 0, {{0}}},
    {L, "{\"name\": \"parserTool\", \"parameters\": {\"text\": \"He said \\\"Hello {world}\\\"\"}}", "", 1,
     {{"parserTool", "{\"text\": \"He said \\\"Hello {world}\\\"\"}"}}},
};
#define N_CASES (sizeof CASES / sizeof CASES[0])

static void expect_result(const tool_case *c, const kvs_tool_result *r, const char *how) {
    cr_expect_str_eq(r->content, c->content, "%s content of %s", how, c->output);
    cr_expect_eq(r->calls.n, c->n_calls, "%s: %d calls in %s", how, r->calls.n, c->output);
    for (int i = 0; i < r->calls.n && i < c->n_calls; i++) {
        cr_expect_str_eq(r->calls.v[i].name, c->calls[i].name, "%s: call %d of %s", how, i, c->output);
        cr_expect_str_eq(r->calls.v[i].text, c->calls[i].args, "%s: call %d of %s", how, i, c->output);
        cr_expect(!strncmp(r->calls.v[i].id, "call_", 5) && strlen(r->calls.v[i].id) == 29, "id %s", r->calls.v[i].id);
    }
}

/* Feeds the output in pieces ending at cuts[0..n_cuts) (then the rest); checks
 * the events' shape: a call's first event has its id and name, the next ones
 * neither, calls numbered 0, 1, ... in order. */
static void parse_stream(const tool_case *c, const size_t *cuts, int n_cuts, kvs_tool_result *r) {
    memset(r, 0, sizeof *r);
    kvs_tool_parser *p = kvs_tool_parser_create(c->format, 7);
    cr_assert(p);
    kvs_tool_events ev = {0};
    size_t len = strlen(c->output), at = 0;
    int next_call = 0;
    for (int k = 0; k <= n_cuts; k++) {
        size_t end = k < n_cuts ? cuts[k] : len;
        cr_assert_eq(kvs_tool_parser_feed(p, c->output + at, end - at, &ev), KVS_OK);
        at = end;
        if (k == n_cuts) cr_assert_eq(kvs_tool_parser_finish(p, &ev), KVS_OK);
        for (int i = 0; i < ev.n; i++) {
            const kvs_tool_event *e = &ev.v[i];
            if (e->call < 0) continue;
            if (e->id) cr_assert_eq(e->call, next_call++, "calls in order");
            else cr_assert_eq(e->call, next_call - 1, "a fragment of the call begun last");
            cr_assert_eq(!e->id, !e->name);
        }
        cr_assert_eq(kvs_tool_result_add(r, &ev), KVS_OK);
        kvs_tool_events_clear(&ev);
    }
    cr_expect_eq(kvs_tool_parser_n_calls(p), next_call);
    if (!r->content) r->content = strdup("");
    kvs_tool_events_free(&ev);
    kvs_tool_parser_destroy(p);
}

static void expect_same(const kvs_tool_result *a, const kvs_tool_result *b, const char *how) {
    cr_expect_str_eq(a->content, b->content, "%s", how);
    cr_assert_eq(a->calls.n, b->calls.n, "%s", how);
    for (int i = 0; i < a->calls.n; i++) {
        cr_expect_str_eq(a->calls.v[i].id, b->calls.v[i].id, "%s", how);
        cr_expect_str_eq(a->calls.v[i].name, b->calls.v[i].name, "%s", how);
        cr_expect_str_eq(a->calls.v[i].text, b->calls.v[i].text, "%s", how);
    }
}

Test(tool_calls, recorded_outputs_whole) {
    for (size_t i = 0; i < N_CASES; i++) {
        kvs_tool_result r;
        cr_assert_eq(kvs_tool_parse_text(CASES[i].format, 7, CASES[i].output, strlen(CASES[i].output), &r), KVS_OK);
        expect_result(&CASES[i], &r, "whole");
        kvs_tool_result_free(&r);
    }
}

Test(tool_calls, streamed_at_every_split_point_gives_the_same) {
    for (size_t i = 0; i < N_CASES; i++) {
        const tool_case *c = &CASES[i];
        size_t len = strlen(c->output);
        kvs_tool_result whole, r;
        cr_assert_eq(kvs_tool_parse_text(c->format, 7, c->output, len, &whole), KVS_OK);
        for (size_t cut = 0; cut <= len; cut++) {
            parse_stream(c, &cut, 1, &r);
            char how[64];
            snprintf(how, sizeof how, "case %zu split at %zu", i, cut);
            expect_same(&r, &whole, how);
            kvs_tool_result_free(&r);
        }
        size_t *bytes = malloc(sizeof *bytes * (len + 1));
        for (size_t k = 0; k < len; k++) bytes[k] = k + 1;
        parse_stream(c, bytes, (int)len, &r);
        expect_same(&r, &whole, "byte by byte");
        kvs_tool_result_free(&r);
        free(bytes);
        kvs_tool_result_free(&whole);
    }
}

Test(tool_calls, streamed_in_random_pieces) {
    uint64_t s = kvs_test_seed();
    for (int round = 0; round < 200; round++) {
        const tool_case *c = &CASES[round % N_CASES];
        size_t len = strlen(c->output), cuts[16];
        int n = 0;
        for (size_t at = 0; n < 16;) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            at += 1 + (s >> 33) % 12;
            if (at >= len) break;
            cuts[n++] = at;
        }
        kvs_tool_result r;
        parse_stream(c, cuts, n, &r);
        expect_result(c, &r, "random pieces");
        kvs_tool_result_free(&r);
    }
}

/* The stream sends a call once its name and arguments begin: JSON that goes
 * bad later stays a call there; a whole output takes only valid calls. */
Test(tool_calls, invalid_json_whole_is_content) {
    const char *out = "{\"name\": \"invalidTool\", \"parameters\": {invalid json}";
    kvs_tool_result r;
    cr_assert_eq(kvs_tool_parse_text(L, 1, out, strlen(out), &r), KVS_OK);
    cr_expect_str_eq(r.content, out);
    cr_expect_eq(r.calls.n, 0);
    kvs_tool_result_free(&r);
    tool_case c = {L, out, "", 1, {{"invalidTool", "{invalid json}"}}};
    parse_stream(&c, NULL, 0, &r);
    expect_result(&c, &r, "streamed");
    kvs_tool_result_free(&r);
}

Test(tool_calls, stream_sends_arguments_as_they_come) {
    kvs_tool_parser *p = kvs_tool_parser_create(H, 3);
    kvs_tool_events ev = {0};
    const char *a = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"ci";
    cr_assert_eq(kvs_tool_parser_feed(p, a, strlen(a), &ev), KVS_OK);
    cr_assert_eq(ev.n, 1);
    cr_expect_eq(ev.v[0].call, 0);
    cr_expect_str_eq(ev.v[0].name, "get_weather");
    cr_expect_str_eq(ev.v[0].text, "{\"ci");
    kvs_tool_events_clear(&ev);
    const char *b = "ty\": \"Paris\"}}\n</tool_call>";
    cr_assert_eq(kvs_tool_parser_feed(p, b, strlen(b), &ev), KVS_OK);
    cr_assert_eq(ev.n, 1);
    cr_expect_null(ev.v[0].id);
    cr_expect_str_eq(ev.v[0].text, "ty\": \"Paris\"}");
    kvs_tool_events_clear(&ev);
    /* content waits only while it may be a tag */
    cr_assert_eq(kvs_tool_parser_feed(p, "ok <tool", 8, &ev), KVS_OK);
    cr_assert_eq(ev.n, 1);
    cr_expect_str_eq(ev.v[0].text, "ok ");
    kvs_tool_events_clear(&ev);
    cr_assert_eq(kvs_tool_parser_finish(p, &ev), KVS_OK);
    cr_assert_eq(ev.n, 1);
    cr_expect_str_eq(ev.v[0].text, "<tool");
    kvs_tool_events_free(&ev);
    kvs_tool_parser_destroy(p);
}

Test(tool_calls, formats_and_names) {
    kvs_tool_format f;
    cr_expect(kvs_tool_format_parse("hermes", &f) && f == H);
    cr_expect(kvs_tool_format_parse("llama3_json", &f) && f == L);
    cr_expect(kvs_tool_format_parse("auto", &f) && f == KVS_TOOL_FORMAT_NONE);
    cr_expect(!kvs_tool_format_parse("mistral", &f));
    cr_expect_eq(kvs_tool_format_for_template("{{ '<tool_call>' }}"), H);
    cr_expect_eq(kvs_tool_format_for_template("<|start_header_id|>"), L);
    cr_expect_eq(kvs_tool_format_for_template("<|im_start|>"), H);
    /* format none: everything is content */
    kvs_tool_result r;
    const char *out = "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>";
    cr_assert_eq(kvs_tool_parse_text(KVS_TOOL_FORMAT_NONE, 1, out, strlen(out), &r), KVS_OK);
    cr_expect_str_eq(r.content, out);
    cr_expect_eq(r.calls.n, 0);
    kvs_tool_result_free(&r);
    /* ids differ per call and per seed */
    const char *two = "<tool_call>{\"name\": \"f\"}</tool_call><tool_call>{\"name\": \"f\"}</tool_call>";
    kvs_tool_result x, y;
    cr_assert_eq(kvs_tool_parse_text(H, 1, two, strlen(two), &x), KVS_OK);
    cr_assert_eq(kvs_tool_parse_text(H, 2, two, strlen(two), &y), KVS_OK);
    cr_assert(x.calls.n == 2 && y.calls.n == 2);
    cr_expect_str_neq(x.calls.v[0].id, x.calls.v[1].id);
    cr_expect_str_neq(x.calls.v[0].id, y.calls.v[0].id);
    kvs_tool_result_free(&x);
    kvs_tool_result_free(&y);
}
