/* server: tool calling. The request's tools fields and their 400s, the
 * messages' tool_calls, the response builders on forced outputs (the bundled
 * model is not trained for tools), the constraint for forced calls, and the
 * real server's answers to tools requests. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "server/server_internal.h"
#include "server_client.h"
#include "testutil.h"

static const kvs_api_limits LIM = {8192, 4096, 8};

#define TOOL_WEATHER                                                                                                   \
    "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"The weather\", "          \
    "\"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}"
#define TOOL_TIME "{\"type\": \"function\", \"function\": {\"name\": \"now\"}}"
#define USER "{\"role\": \"user\", \"content\": \"Weather in Paris?\"}"

static bool parse_chat(const char *extra, kvs_api_request *r, kvs_api_error *e) {
    char body[4096];
    snprintf(body, sizeof body, "{\"messages\": [" USER "]%s}", extra);
    return kvs_api_parse_request(body, strlen(body), KVS_API_CHAT, &LIM, r, e);
}

Test(server_tools, fields) {
    kvs_api_request r;
    kvs_api_error e;
    cr_assert(parse_chat(", \"tools\": [" TOOL_WEATHER ", " TOOL_TIME "]", &r, &e), "%s", e.message);
    cr_expect_eq(r.tool_choice, KVS_TOOL_CHOICE_AUTO);
    cr_expect(r.parallel_tool_calls);
    json_t *t = json_loads(r.tools, 0, NULL);
    cr_expect_eq(json_array_size(t), 2);
    cr_expect_str_eq(json_string_value(json_object_get(json_object_get(json_array_get(t, 0), "function"), "name")),
                     "get_weather");
    json_decref(t);
    kvs_api_request_free(&r);
    cr_assert(parse_chat(", \"tools\": [" TOOL_WEATHER "], \"tool_choice\": {\"type\": \"function\", \"function\": "
                         "{\"name\": \"get_weather\"}}, \"parallel_tool_calls\": false", &r, &e), "%s", e.message);
    cr_expect_eq(r.tool_choice, KVS_TOOL_CHOICE_FUNCTION);
    cr_expect_str_eq(r.tool_choice_name, "get_weather");
    cr_expect(!r.parallel_tool_calls);
    kvs_api_request_free(&r);
    /* harmless values: none, auto without tools, an empty tools list, nulls */
    const char *fine[] = {", \"tool_choice\": \"none\"", ", \"tool_choice\": \"auto\"", ", \"tools\": []",
                          ", \"tools\": null, \"tool_choice\": null, \"parallel_tool_calls\": null",
                          ", \"parallel_tool_calls\": true"};
    for (size_t i = 0; i < sizeof fine / sizeof fine[0]; i++) {
        cr_expect(parse_chat(fine[i], &r, &e), "%s: %s", fine[i], e.message);
        cr_expect_null(r.tools);
        kvs_api_request_free(&r);
    }
}

Test(server_tools, bad_shapes_name_the_field) {
    static const struct { const char *extra, *param; } bad[] = {
        {", \"tools\": {}", "tools"},
        {", \"tools\": [1]", "tools[0]"},
        {", \"tools\": [{\"type\": \"code\", \"function\": {\"name\": \"f\"}}]", "tools[0]"},
        {", \"tools\": [{\"type\": \"function\"}]", "tools[0].function"},
        {", \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"a b\"}}]", "tools"},
        {", \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"\"}}]", "tools"},
        {", \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": []}}]", "tools"},
        {", \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"description\": 3}}]", "tools"},
        {", \"tools\": [" TOOL_TIME ", " TOOL_TIME "]", "tools"},
        {", \"tool_choice\": \"sometimes\"", "tool_choice"},
        {", \"tool_choice\": {\"type\": \"function\"}", "tool_choice"},
        {", \"tool_choice\": \"required\"", "tool_choice"},
        {", \"tools\": [" TOOL_TIME "], \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"other\"}}",
         "tool_choice"},
        {", \"parallel_tool_calls\": 1", "parallel_tool_calls"},
        {", \"functions\": [{\"name\": \"f\"}]", "functions"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvs_api_request r;
        kvs_api_error e;
        cr_expect(!parse_chat(bad[i].extra, &r, &e), "accepted: %s", bad[i].extra);
        cr_expect_eq(e.http_status, 400);
        cr_expect_str_eq(e.param, bad[i].param, "%s: %s", bad[i].extra, e.message);
    }
    /* completions have no tools */
    kvs_api_request r;
    kvs_api_error e;
    const char *b = "{\"prompt\": \"hi\", \"tools\": [" TOOL_TIME "]}";
    cr_expect(!kvs_api_parse_request(b, strlen(b), KVS_API_COMPLETIONS, &LIM, &r, &e));
    cr_expect_str_eq(e.param, "tools");
}

Test(server_tools, messages_with_calls_and_results) {
    const char *b =
        "{\"messages\": [" USER ", {\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"id\": \"call_1\", "
        "\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Paris\\\"}\"}}]},"
        " {\"role\": \"tool\", \"tool_call_id\": \"call_1\", \"name\": \"get_weather\", \"content\": \"21 C\"}]}";
    kvs_api_request r;
    kvs_api_error e;
    cr_assert(kvs_api_parse_request(b, strlen(b), KVS_API_CHAT, &LIM, &r, &e), "%s", e.message);
    cr_assert_eq(r.n_messages, 3);
    cr_expect_str_eq(r.messages[1].content, "");
    /* the arguments as an object, as vLLM gives the template */
    cr_expect_str_eq(r.messages[1].tool_calls, "[{\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":"
                                               "\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}}]");
    cr_expect_str_eq(r.messages[2].tool_call_id, "call_1");
    cr_expect_str_eq(r.messages[2].name, "get_weather");
    cr_expect_null(r.messages[0].tool_calls);
    kvs_api_request_free(&r);
    static const struct { const char *msg, *param; } bad[] = {
        {"{\"role\": \"assistant\", \"tool_calls\": {}}", "messages[0].tool_calls"},
        {"{\"role\": \"assistant\", \"tool_calls\": [{\"function\": {\"name\": \"f\", \"arguments\": \"{bad\"}}]}",
         "messages[0].tool_calls"},
        {"{\"role\": \"assistant\", \"tool_calls\": [{\"function\": {\"name\": \"f\", \"arguments\": \"[1]\"}}]}",
         "messages[0].tool_calls"},
        {"{\"role\": \"assistant\", \"tool_calls\": [{\"type\": \"x\", \"function\": {\"name\": \"f\", \"arguments\": {}}}]}",
         "messages[0].tool_calls"},
        {"{\"role\": \"user\", \"content\": \"x\", \"tool_calls\": []}", "messages[0].tool_calls"},
        {"{\"role\": \"tool\", \"content\": \"x\", \"tool_call_id\": 5}", "messages[0].tool_call_id"},
        {"{\"role\": \"user\", \"content\": \"x\", \"name\": [\"n\"]}", "messages[0].name"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char body[1024];
        snprintf(body, sizeof body, "{\"messages\": [%s]}", bad[i].msg);
        cr_expect(!kvs_api_parse_request(body, strlen(body), KVS_API_CHAT, &LIM, &r, &e), "accepted: %s", bad[i].msg);
        cr_expect_str_eq(e.param, bad[i].param, "%s: %s", bad[i].msg, e.message);
    }
}

/* ---- responses from forced outputs ------------------------------------------------ */
static json_t *full_response(kvs_tool_format f, bool one_call, const char *text, kvs_finish fin) {
    kvs_resp_meta m = {KVS_API_CHAT, "chatcmpl-t", "tiny", 0, NULL, false, 0, false, f, one_call};
    kvs_resp_slice s = {text, strlen(text), NULL, NULL, 0, 0, .finish = fin};
    char *body = kvs_resp_full(&m, &s, 1, 5, 7, NULL);
    json_t *j = json_loads(body, 0, NULL);
    cr_assert(j, "%s", body);
    free(body);
    return j;
}

static json_t *choice(json_t *j) { return json_array_get(json_object_get(j, "choices"), 0); }

Test(server_tools, whole_response_has_tool_calls) {
    const char *out = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n"
                      "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>";
    json_t *j = full_response(KVS_TOOL_FORMAT_HERMES, false, out, KVS_FINISH_STOP);
    json_t *msg = json_object_get(choice(j), "message");
    cr_expect(json_is_null(json_object_get(msg, "content")), "content null when only calls");
    cr_expect_str_eq(json_string_value(json_object_get(choice(j), "finish_reason")), "tool_calls");
    json_t *calls = json_object_get(msg, "tool_calls");
    cr_assert_eq(json_array_size(calls), 2);
    json_t *c0 = json_array_get(calls, 0);
    cr_expect(!strncmp(json_string_value(json_object_get(c0, "id")), "call_", 5));
    cr_expect_str_eq(json_string_value(json_object_get(c0, "type")), "function");
    cr_expect_str_eq(json_string_value(json_object_get(json_object_get(c0, "function"), "name")), "get_weather");
    json_t *args = json_loads(json_string_value(json_object_get(json_object_get(c0, "function"), "arguments")), 0, NULL);
    cr_expect_str_eq(json_string_value(json_object_get(args, "city")), "Paris");
    json_decref(args);
    json_decref(j);
    /* parallel_tool_calls false: the first call only; cut by max_tokens: "length" stays */
    j = full_response(KVS_TOOL_FORMAT_HERMES, true, out, KVS_FINISH_LENGTH);
    cr_expect_eq(json_array_size(json_object_get(json_object_get(choice(j), "message"), "tool_calls")), 1);
    cr_expect_str_eq(json_string_value(json_object_get(choice(j), "finish_reason")), "length");
    json_decref(j);
    /* no calls: the text as content, no tool_calls, finish stop */
    j = full_response(KVS_TOOL_FORMAT_LLAMA3_JSON, false, "It is sunny.", KVS_FINISH_STOP);
    json_t *m2 = json_object_get(choice(j), "message");
    cr_expect_str_eq(json_string_value(json_object_get(m2, "content")), "It is sunny.");
    cr_expect_null(json_object_get(m2, "tool_calls"));
    cr_expect_str_eq(json_string_value(json_object_get(choice(j), "finish_reason")), "stop");
    json_decref(j);
    /* tools not parsed (tool_choice none): the text as it is */
    j = full_response(KVS_TOOL_FORMAT_NONE, false, out, KVS_FINISH_STOP);
    cr_expect_str_eq(json_string_value(json_object_get(json_object_get(choice(j), "message"), "content")), out);
    json_decref(j);
}

Test(server_tools, stream_chunk_delta) {
    kvs_resp_meta m = {KVS_API_CHAT, "chatcmpl-t", "tiny", 0, NULL, false, 0, false, KVS_TOOL_FORMAT_LLAMA3_JSON, false};
    kvs_tool_parser *p = kvs_tool_parser_create(m.tools, kvs_resp_tool_seed(&m, 0));
    kvs_tool_events ev = {0};
    const char *text = "{\"name\": \"now\", \"parameters\": {\"tz\": \"UTC\"}}";
    kvs_resp_slice s = {text, strlen(text), NULL, NULL, 0, 0, .finish = KVS_FINISH_STOP};
    kvs_resp_tool_stream(p, &s, &ev, true);
    char *chunk = kvs_resp_chunk(&m, &s, false, false);
    json_t *j = json_loads(chunk, 0, NULL);
    cr_assert(j, "%s", chunk);
    json_t *delta = json_object_get(choice(j), "delta");
    cr_expect_null(json_object_get(delta, "content"));
    json_t *d0 = json_array_get(json_object_get(delta, "tool_calls"), 0);
    cr_expect_eq(json_integer_value(json_object_get(d0, "index")), 0);
    cr_expect_str_eq(json_string_value(json_object_get(json_object_get(d0, "function"), "name")), "now");
    cr_expect_str_eq(json_string_value(json_object_get(json_object_get(d0, "function"), "arguments")), "{\"tz\": \"UTC\"}");
    cr_expect_str_eq(json_string_value(json_object_get(choice(j), "finish_reason")), "tool_calls");
    json_decref(j);
    free(chunk);
    kvs_tool_events_free(&ev);
    kvs_tool_parser_destroy(p);
}

/* A chunk whose delta would be empty (no role, content or tool_calls) before the
 * last is not made: text the parser holds back (with logprobs or token ids
 * asked too), a second call when only the first is wanted; the last chunk
 * carries its finish_reason with an empty delta, as OpenAI's. */
Test(server_tools, no_chunk_with_an_empty_delta) {
    kvs_resp_meta m = {KVS_API_CHAT, "chatcmpl-t", "tiny", 0, NULL, false, 0, true, KVS_TOOL_FORMAT_HERMES, true};
    kvs_tool_parser *p = kvs_tool_parser_create(m.tools, kvs_resp_tool_seed(&m, 0));
    int32_t ids[2] = {5, 6};
    /* held back: the start of a call */
    kvs_tool_events ev = {0};
    const char *held = "<tool_call>\n{\"na";
    kvs_resp_slice s = {held, strlen(held), ids, NULL, 2, 0};
    kvs_resp_tool_stream(p, &s, &ev, false);
    cr_expect_null(kvs_resp_chunk(&m, &s, false, false), "a chunk for text held back");
    kvs_tool_events_free(&ev);
    /* the first call, then a second one that is not wanted */
    const char *first = "me\": \"now\", \"arguments\": {}}\n</tool_call>\n";
    s = (kvs_resp_slice){first, strlen(first), ids, NULL, 1, 0};
    kvs_resp_tool_stream(p, &s, &ev, false);
    char *chunk = kvs_resp_chunk(&m, &s, false, false);
    cr_assert(chunk && strstr(chunk, "\"tool_calls\""), "%s", chunk ? chunk : "no chunk");
    free(chunk);
    kvs_tool_events_free(&ev);
    const char *second = "<tool_call>\n{\"name\": \"now\", \"arguments\": {\"x\": 1}}\n</tool_call>";
    s = (kvs_resp_slice){second, strlen(second), ids, NULL, 2, 0};
    kvs_resp_tool_stream(p, &s, &ev, false);
    chunk = kvs_resp_chunk(&m, &s, false, false);
    cr_expect_null(chunk, "a chunk for a call not wanted: %s", chunk);
    free(chunk);
    kvs_tool_events_free(&ev);
    /* the last: an empty delta with its finish_reason */
    s = (kvs_resp_slice){"", 0, ids, NULL, 0, 0, .finish = KVS_FINISH_STOP};
    kvs_resp_tool_stream(p, &s, &ev, true);
    chunk = kvs_resp_chunk(&m, &s, false, false);
    json_t *j = chunk ? json_loads(chunk, 0, NULL) : NULL;
    cr_assert(j, "no last chunk");
    cr_expect_eq(json_object_size(json_object_get(choice(j), "delta")), 0);
    cr_expect_str_eq(json_string_value(json_object_get(choice(j), "finish_reason")), "tool_calls");
    json_decref(j);
    free(chunk);
    kvs_tool_events_free(&ev);
    kvs_tool_parser_destroy(p);
}

/* every chunk of a chat stream has something in its delta, or its finish_reason */
static void expect_no_empty_delta(const char *body) {
    int chunks = 0;
    for (const char *p = body; (p = strstr(p, "data: ")); ) {
        p += 6;
        const char *end = strstr(p, "\n\n");
        if (!end || !strncmp(p, "[DONE]", 6)) break;
        json_t *j = json_loadb(p, (size_t)(end - p), 0, NULL);
        cr_assert(j, "bad chunk: %.*s", (int)(end - p), p);
        json_t *ch = json_array_get(json_object_get(j, "choices"), 0);
        if (ch) {
            chunks++;
            cr_expect(json_object_size(json_object_get(ch, "delta")) > 0 || !json_is_null(json_object_get(ch, "finish_reason")),
                      "a chunk with an empty delta: %.*s", (int)(end - p), p);
        }
        json_decref(j);
    }
    cr_expect_gt(chunks, 1);
}

/* ---- the constraint of a forced call ------------------------------------------------ */
Test(server_tools, constraint_schema) {
    const char *tools = "[" TOOL_WEATHER "," TOOL_TIME "]";
    char *schema, *prefix, *suffix;
    cr_assert_eq(kvs_tool_constraint(tools, KVS_TOOL_CHOICE_FUNCTION, "get_weather", KVS_TOOL_FORMAT_HERMES, &schema,
                                     &prefix, &suffix), KVS_OK, "%s", kvs_last_error());
    cr_expect_str_eq(prefix, "<tool_call>\n");
    cr_expect_str_eq(suffix, "\n</tool_call>");
    cr_expect_str_eq(schema, "{\"type\":\"object\",\"properties\":{\"name\":{\"const\":\"get_weather\"},\"arguments\":"
                             "{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}},\"required\":[\"city\"]}},"
                             "\"required\":[\"name\",\"arguments\"]}");
    free(schema), free(prefix), free(suffix);
    cr_assert_eq(kvs_tool_constraint(tools, KVS_TOOL_CHOICE_REQUIRED, NULL, KVS_TOOL_FORMAT_LLAMA3_JSON, &schema,
                                     &prefix, &suffix), KVS_OK);
    cr_expect_str_eq(prefix, "");
    cr_expect_str_eq(suffix, "");
    json_t *j = json_loads(schema, 0, NULL);
    json_t *any = json_object_get(j, "anyOf");
    cr_assert_eq(json_array_size(any), 2);
    json_t *second = json_object_get(json_array_get(any, 1), "properties");
    cr_expect_str_eq(json_string_value(json_object_get(json_object_get(second, "name"), "const")), "now");
    cr_expect_str_eq(json_string_value(json_object_get(json_object_get(second, "parameters"), "type")), "object");
    json_decref(j);
    free(schema), free(prefix), free(suffix);
    cr_assert_eq(kvs_tool_constraint(tools, KVS_TOOL_CHOICE_AUTO, NULL, KVS_TOOL_FORMAT_HERMES, &schema, &prefix, &suffix),
                 KVS_OK);
    cr_expect(!schema && !prefix && !suffix);
    cr_expect_neq(kvs_tool_constraint(tools, KVS_TOOL_CHOICE_REQUIRED, NULL, KVS_TOOL_FORMAT_NONE, &schema, &prefix,
                                      &suffix), KVS_OK);
}

/* ---- the real server ---------------------------------------------------------------- */
#define CHAT_TOOLS(extra) "{\"max_tokens\": 4, \"temperature\": 0, \"messages\": [" USER "], \"tools\": [" TOOL_WEATHER "]" extra "}"

Test(server_tools, serve_accepts_tools_requests, .timeout = 300) {
    server_proc s = start_server("--max-model-len 512");
    const char *ok[] = {
        CHAT_TOOLS(""), CHAT_TOOLS(", \"tool_choice\": \"none\""), CHAT_TOOLS(", \"tool_choice\": \"required\""),
        CHAT_TOOLS(", \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"get_weather\"}}, "
                   "\"parallel_tool_calls\": false"),
        "{\"max_tokens\": 2, \"messages\": [" USER ", {\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"id\": "
        "\"c1\", \"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Paris\\\"}\"}}]},"
        " {\"role\": \"tool\", \"tool_call_id\": \"c1\", \"content\": \"21 C\"}], \"tools\": [" TOOL_WEATHER "]}",
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        json_t *j = post_json(s.port, "/v1/chat/completions", ok[i], 200);
        json_t *msg = json_object_get(choice(j), "message");
        cr_expect_str_eq(json_string_value(json_object_get(msg, "role")), "assistant");
        cr_expect(json_is_string(json_object_get(msg, "content")) || json_is_array(json_object_get(msg, "tool_calls")));
        json_decref(j);
    }
    /* n choices, each parsed on its own */
    json_t *nj = post_json(s.port, "/v1/chat/completions", CHAT_TOOLS(", \"n\": 2"), 200);
    cr_expect_eq(json_array_size(json_object_get(nj, "choices")), 2);
    json_decref(nj);
    http_resp rn = http(s.port, "POST", "/v1/chat/completions", NULL, CHAT_TOOLS(", \"n\": 2, \"stream\": true"));
    cr_expect_eq(rn.status, 200);
    cr_expect(strstr(rn.body, "\"index\":1") && strstr(rn.body, "[DONE]"), "%s", rn.body);
    free(rn.body);
    /* streaming with tools: chunks, then [DONE] */
    http_resp r = http(s.port, "POST", "/v1/chat/completions", NULL, CHAT_TOOLS(", \"stream\": true"));
    cr_expect_eq(r.status, 200);
    stream_result sr;
    parse_stream(r.body, true, &sr);
    cr_expect(sr.done && sr.n_chunks >= 2);
    free(r.body);
    /* a forced call streamed: its text is held back by the parser, and no chunk goes out with an empty delta
       before the last one (which carries only the finish_reason, as OpenAI's) */
    r = http(s.port, "POST", "/v1/chat/completions", NULL,
             "{\"max_tokens\": 64, \"temperature\": 0, \"messages\": [" USER "], \"tools\": [" TOOL_WEATHER "], "
             "\"tool_choice\": \"required\", \"stream\": true}");
    cr_expect_eq(r.status, 200);
    cr_expect(strstr(r.body, "\"tool_calls\"") && strstr(r.body, "[DONE]"), "%s", r.body);
    cr_expect(!strstr(r.body, "\"delta\":{},\"logprobs\":null,\"finish_reason\":null"), "an empty delta: %s", r.body);
    expect_no_empty_delta(r.body);
    free(r.body);
    /* the same with logprobs and token ids asked: the tokens held back make no chunk either */
    r = http(s.port, "POST", "/v1/chat/completions", NULL,
             "{\"max_tokens\": 64, \"temperature\": 0, \"messages\": [" USER "], \"tools\": [" TOOL_WEATHER "], "
             "\"tool_choice\": \"required\", \"stream\": true, \"logprobs\": true, \"return_token_ids\": true}");
    cr_expect_eq(r.status, 200, "%s", r.body);
    cr_expect(strstr(r.body, "\"tool_calls\"") && strstr(r.body, "[DONE]"), "%s", r.body);
    expect_no_empty_delta(r.body);
    free(r.body);
    /* control-token text in the tools: 400 naming tools */
    json_t *j = post_json(s.port, "/v1/chat/completions",
                          "{\"messages\": [" USER "], \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", "
                          "\"description\": \"x<|eot_id|>y\"}}]}", 400);
    cr_expect_str_eq(json_string_value(json_object_get(json_object_get(j, "error"), "param")), "tools");
    json_decref(j);
    j = post_json(s.port, "/v1/chat/completions", CHAT_TOOLS(", \"tool_choice\": \"maybe\""), 400);
    cr_expect_str_eq(json_string_value(json_object_get(json_object_get(j, "error"), "param")), "tool_choice");
    json_decref(j);
    cr_expect_eq(stop_server(&s), 0);
    /* without a parser, a forced call cannot be had */
    s = start_server("--max-model-len 512 --tool-call-parser none");
    j = post_json(s.port, "/v1/chat/completions", CHAT_TOOLS(", \"tool_choice\": \"required\""), 400);
    cr_expect_str_eq(json_string_value(json_object_get(json_object_get(j, "error"), "param")), "tool_choice");
    json_decref(j);
    j = post_json(s.port, "/v1/chat/completions", CHAT_TOOLS(""), 200);
    json_decref(j);
    cr_expect_eq(stop_server(&s), 0);
}
