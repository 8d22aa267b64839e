/* server: Anthropic's Messages API and OpenAI's Responses API. Their bodies
 * mapped onto the chat request (and their 400s naming the client's fields),
 * Anthropic's error shape, and the answers' shapes whole and streamed on
 * forced outputs (the bundled model is not trained for tools). The real
 * server is driven by the official clients (test_server_anthropic.sh,
 * tests/openai/responses.mjs). */
#include <criterion/criterion.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "server/anthropic.h"
#include "server/responses.h"
#include "server/route.h"
#include "testutil.h"

static const kvs_api_limits LIM = {8192, 4096, 8};

#define TOOL "{\"name\": \"get_weather\", \"description\": \"The weather\", \"input_schema\": {\"type\": \"object\", " \
             "\"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}"
#define USER "{\"role\": \"user\", \"content\": \"Weather in Paris?\"}"

static bool anth(const char *extra, kvs_api_request *r, kvs_api_error *e) {
    char body[4096];
    snprintf(body, sizeof body, "{\"model\": \"m\", \"max_tokens\": 10, \"messages\": [" USER "]%s}", extra);
    return kvs_anth_parse_request(body, strlen(body), false, &LIM, r, e);
}

Test(server_apis, anthropic_fields_map_onto_chat) {
    kvs_api_request r;
    kvs_api_error e;
    cr_assert(anth(", \"system\": [{\"type\": \"text\", \"text\": \"Be brief.\", \"cache_control\": {\"type\": \"ephemeral\"}},"
                   " {\"type\": \"text\", \"text\": \"Be kind.\"}], \"stop_sequences\": [\"END\"], \"temperature\": 0.5,"
                   " \"top_k\": 5, \"metadata\": {\"user_id\": \"u\"}, \"thinking\": {\"type\": \"disabled\"}, \"tools\": ["
                   TOOL "], \"tool_choice\": {\"type\": \"any\", \"disable_parallel_tool_use\": true}, \"stream\": true",
                   &r, &e), "%s", e.message);
    cr_expect_eq(r.kind, KVS_API_CHAT);
    cr_expect_eq(r.dialect, KVS_DIALECT_ANTHROPIC);
    cr_expect_eq(r.max_tokens, 10);
    cr_expect(r.stream);
    cr_assert_eq(r.n_messages, 2);
    cr_expect_str_eq(r.messages[0].role, "system");
    cr_expect_str_eq(r.messages[0].content, "Be brief.\nBe kind.");
    cr_expect_str_eq(r.messages[1].content, "Weather in Paris?");
    cr_assert_eq(r.n_stop, 1);
    cr_expect_str_eq(r.stop[0], "END");
    cr_expect_float_eq(r.sampling.temperature, 0.5f, 1e-6);
    cr_expect_eq(r.sampling.top_k, 5);
    cr_expect_eq(r.tool_choice, KVS_TOOL_CHOICE_REQUIRED);
    cr_expect(!r.parallel_tool_calls);
    json_t *t = json_loads(r.tools, 0, NULL);
    json_t *fn = json_object_get(json_array_get(t, 0), "function");
    cr_expect_str_eq(json_string_value(json_object_get(fn, "name")), "get_weather");
    cr_expect_str_eq(json_string_value(json_object_get(json_object_get(fn, "parameters"), "type")), "object");
    json_decref(t);
    kvs_api_request_free(&r);
    /* tool_choice tool / none / auto */
    cr_assert(anth(", \"tools\": [" TOOL "], \"tool_choice\": {\"type\": \"tool\", \"name\": \"get_weather\"}", &r, &e), "%s",
              e.message);
    cr_expect_eq(r.tool_choice, KVS_TOOL_CHOICE_FUNCTION);
    cr_expect_str_eq(r.tool_choice_name, "get_weather");
    cr_expect(r.parallel_tool_calls);
    kvs_api_request_free(&r);
    cr_assert(anth(", \"tools\": [" TOOL "], \"tool_choice\": {\"type\": \"none\"}", &r, &e), "%s", e.message);
    cr_expect_eq(r.tool_choice, KVS_TOOL_CHOICE_NONE);
    kvs_api_request_free(&r);
    /* count_tokens needs no max_tokens; messages does */
    const char *count = "{\"model\": \"m\", \"messages\": [" USER "]}";
    cr_expect(kvs_anth_parse_request(count, strlen(count), true, &LIM, &r, &e), "%s", e.message);
    kvs_api_request_free(&r);
    cr_expect(!kvs_anth_parse_request(count, strlen(count), false, &LIM, &r, &e));
    cr_expect_str_eq(e.param, "max_tokens");
    const char *zero = "{\"max_tokens\": 0, \"messages\": [" USER "]}";
    cr_expect(!kvs_anth_parse_request(zero, strlen(zero), false, &LIM, &r, &e));
    cr_expect_str_eq(e.param, "max_tokens");
}

Test(server_apis, anthropic_tool_use_and_tool_result_turns) {
    const char *b =
        "{\"max_tokens\": 5, \"messages\": [" USER ", {\"role\": \"assistant\", \"content\": [{\"type\": \"thinking\", "
        "\"thinking\": \"hm\", \"signature\": \"s\"}, {\"type\": \"text\", \"text\": \"Looking.\"}, {\"type\": \"tool_use\", "
        "\"id\": \"toolu_1\", \"name\": \"get_weather\", \"input\": {\"city\": \"Paris\"}}]}, {\"role\": \"user\", \"content\": "
        "[{\"type\": \"tool_result\", \"tool_use_id\": \"toolu_1\", \"content\": [{\"type\": \"text\", \"text\": \"21 C\"}]}, "
        "{\"type\": \"tool_result\", \"tool_use_id\": \"toolu_2\", \"content\": \"rain\", \"is_error\": true}, "
        "{\"type\": \"text\", \"text\": \"And tomorrow?\"}]}]}";
    kvs_api_request r;
    kvs_api_error e;
    cr_assert(kvs_anth_parse_request(b, strlen(b), false, &LIM, &r, &e), "%s", e.message);
    cr_assert_eq(r.n_messages, 5);
    cr_expect_str_eq(r.messages[1].role, "assistant");
    cr_expect_str_eq(r.messages[1].content, "Looking.");
    cr_expect_str_eq(r.messages[1].tool_calls, "[{\"id\":\"toolu_1\",\"type\":\"function\",\"function\":{\"name\":"
                                               "\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}}]");
    cr_expect_str_eq(r.messages[2].role, "tool");
    cr_expect_str_eq(r.messages[2].tool_call_id, "toolu_1");
    cr_expect_str_eq(r.messages[2].content, "21 C");
    cr_expect_str_eq(r.messages[3].tool_call_id, "toolu_2");
    cr_expect_str_eq(r.messages[3].content, "rain");
    cr_expect_str_eq(r.messages[4].role, "user");
    cr_expect_str_eq(r.messages[4].content, "And tomorrow?");
    kvs_api_request_free(&r);
}

Test(server_apis, anthropic_bad_shapes_name_the_field) {
    static const struct { const char *extra, *param; } bad[] = {
        {", \"system\": 5", "system"},
        {", \"system\": [{\"type\": \"image\"}]", "system[0]"},
        {", \"stop_sequences\": \"x\"", "stop_sequences"},
        {", \"stop_sequences\": [\"\"]", "stop_sequences"},
        {", \"temperature\": 1.5", "temperature"},
        {", \"top_p\": 2", "top_p"},
        {", \"tools\": [{\"name\": \"f\"}]", "tools[0]"},
        {", \"tools\": [{\"type\": \"web_search_20250305\", \"name\": \"web_search\"}]", "tools[0]"},
        {", \"tools\": [{\"name\": \"a b\", \"input_schema\": {}}]", "tools"},
        {", \"tool_choice\": {\"type\": \"any\"}", "tool_choice"},
        {", \"tool_choice\": \"auto\"", "tool_choice"},
        {", \"tools\": [" TOOL "], \"tool_choice\": {\"type\": \"tool\", \"name\": \"other\"}", "tool_choice"},
        {", \"n\": 2", "n"},
        {", \"top_k\": \"x\"", "top_k"},
        {", \"container\": \"c\"", "container"},
        {", \"kv_policy\": {\"policy\": \"nope\"}", "kv_policy"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvs_api_request r;
        kvs_api_error e;
        cr_expect(!anth(bad[i].extra, &r, &e), "accepted: %s", bad[i].extra);
        cr_expect_eq(e.http_status, 400);
        cr_expect(!strncmp(e.param, bad[i].param, strlen(bad[i].param)), "%s: param %s (%s)", bad[i].extra, e.param,
                  e.message);
    }
    static const struct { const char *msgs, *param; } badm[] = {
        {"[]", "messages"},
        {"[{\"role\": \"system\", \"content\": \"x\"}]", "messages[0]"},
        {"[{\"role\": \"user\", \"content\": 5}]", "messages[0]"},
        {"[{\"role\": \"user\", \"content\": [{\"type\": \"image\", \"source\": {}}]}]", "messages[0].content[0]"},
        {"[{\"role\": \"user\", \"content\": [{\"type\": \"document\"}]}]", "messages[0].content[0]"},
        {"[{\"role\": \"user\", \"content\": [{\"type\": \"text\"}]}]", "messages[0].content[0]"},
        {"[{\"role\": \"user\", \"content\": [{\"type\": \"tool_use\", \"id\": \"a\", \"name\": \"f\", \"input\": {}}]}]",
         "messages[0].content[0]"},
        {"[" USER ", {\"role\": \"assistant\", \"content\": [{\"type\": \"tool_use\", \"id\": \"a\", \"name\": \"f\", "
         "\"input\": [1]}]}]", "messages[1].content[0]"},
        {"[{\"role\": \"user\", \"content\": [{\"type\": \"tool_result\", \"tool_use_id\": 3}]}]", "messages[0].content[0]"},
        {"[{\"role\": \"user\", \"content\": [{\"type\": \"tool_result\", \"tool_use_id\": \"a\", \"content\": "
         "[{\"type\": \"image\"}]}]}]", "messages[0].content[0].content[0]"},
        /* the chat validator's refusal names the client's message, not its mapping (after a system) */
        {"[" USER ", {\"role\": \"assistant\", \"content\": [{\"type\": \"tool_use\", \"id\": \"a\", \"name\": \"bad name\", "
         "\"input\": {}}]}]", "messages[1]"},
    };
    for (size_t i = 0; i < sizeof badm / sizeof badm[0]; i++) {
        char body[1024];
        snprintf(body, sizeof body, "{\"max_tokens\": 4, \"system\": \"s\", \"messages\": %s}", badm[i].msgs);
        kvs_api_request r;
        kvs_api_error e;
        cr_expect(!kvs_anth_parse_request(body, strlen(body), false, &LIM, &r, &e), "accepted: %s", badm[i].msgs);
        cr_expect(!strncmp(e.param, badm[i].param, strlen(badm[i].param)), "%s: param %s (%s)", badm[i].msgs, e.param,
                  e.message);
        cr_expect(strstr(e.message, badm[i].param), "%s: the message names %s: %s", badm[i].msgs, badm[i].param, e.message);
    }
}

Test(server_apis, anthropic_error_shape) {
    kvs_api_error e;
    static const struct { int status, wire; const char *type; } cases[] = {
        {400, 400, "invalid_request_error"}, {401, 401, "authentication_error"}, {404, 404, "not_found_error"},
        {413, 413, "request_too_large"},     {429, 429, "rate_limit_error"},     {500, 500, "api_error"},
        {503, 529, "overloaded_error"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kvs_api_fail(&e, cases[i].status, "x", "went wrong %d", cases[i].status);
        cr_expect_eq(kvs_api_error_status(&e, KVS_DIALECT_ANTHROPIC), cases[i].wire);
        cr_expect_eq(kvs_api_error_status(&e, KVS_DIALECT_OPENAI), cases[i].status);
        char *s = kvs_api_error_json_as(&e, KVS_DIALECT_ANTHROPIC);
        json_t *j = json_loads(s, 0, NULL);
        cr_assert(j, "%s", s);
        cr_expect_str_eq(json_string_value(json_object_get(j, "type")), "error");
        cr_expect_str_eq(json_string_value(json_object_get(json_object_get(j, "error"), "type")), cases[i].type);
        cr_expect(strstr(json_string_value(json_object_get(json_object_get(j, "error"), "message")), "went wrong"));
        json_decref(j);
        free(s);
        /* the responses API's errors are OpenAI's */
        s = kvs_api_error_json_as(&e, KVS_DIALECT_RESPONSES);
        cr_expect(strstr(s, "\"param\":\"x\""), "%s", s);
        free(s);
    }
}

/* ---- responses requests ----------------------------------------------------------- */
static bool rsp(const char *fields, kvs_api_request *r, kvs_api_error *e) {
    char body[4096];
    snprintf(body, sizeof body, "{\"model\": \"m\", %s}", fields);
    return kvs_rsp_parse_request(body, strlen(body), &LIM, r, e);
}

Test(server_apis, responses_fields_map_onto_chat) {
    kvs_api_request r;
    kvs_api_error e;
    cr_assert(rsp("\"input\": \"hi\", \"instructions\": \"Be brief.\", \"max_output_tokens\": 12, \"store\": false, "
                  "\"text\": {\"format\": {\"type\": \"json_schema\", \"name\": \"r\", \"strict\": true, \"schema\": "
                  "{\"type\": \"object\"}}}, \"metadata\": {\"k\": \"v\"}, \"user\": \"u\"", &r, &e), "%s", e.message);
    cr_expect_eq(r.dialect, KVS_DIALECT_RESPONSES);
    cr_expect_eq(r.max_tokens, 12);
    cr_expect_str_eq(r.max_tokens_param, "max_output_tokens");
    cr_assert_eq(r.n_messages, 2);
    cr_expect_str_eq(r.messages[0].role, "system");
    cr_expect_str_eq(r.messages[1].content, "hi");
    cr_expect_eq(r.format, KVS_FORMAT_JSON_SCHEMA);
    cr_expect_str_eq(json_string_value(json_object_get(r.format_schema, "type")), "object");
    cr_expect(json_is_false(json_object_get(r.echo, "store")));
    cr_expect_eq(json_integer_value(json_object_get(r.echo, "max_output_tokens")), 12);
    cr_expect_str_eq(json_string_value(json_object_get(json_object_get(r.echo, "metadata"), "k")), "v");
    kvs_api_request_free(&r);
    /* items: a message with parts, a call (joining the assistant's message), its output */
    cr_assert(rsp("\"input\": [{\"role\": \"user\", \"content\": [{\"type\": \"input_text\", \"text\": \"Weather \"}, "
                  "{\"type\": \"input_text\", \"text\": \"in Paris?\"}]}, {\"type\": \"message\", \"role\": \"assistant\", "
                  "\"content\": [{\"type\": \"output_text\", \"text\": \"Looking.\"}]}, {\"type\": \"function_call\", "
                  "\"call_id\": \"call_1\", \"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Paris\\\"}\"}, "
                  "{\"type\": \"reasoning\", \"summary\": []}, {\"type\": \"function_call_output\", \"call_id\": \"call_1\", "
                  "\"output\": \"21 C\"}], \"tools\": [{\"type\": \"function\", \"name\": \"get_weather\", \"parameters\": "
                  "{\"type\": \"object\"}, \"strict\": true}], \"tool_choice\": {\"type\": \"function\", \"name\": "
                  "\"get_weather\"}, \"parallel_tool_calls\": false", &r, &e), "%s", e.message);
    cr_assert_eq(r.n_messages, 3);
    cr_expect_str_eq(r.messages[0].content, "Weather in Paris?");
    cr_expect_str_eq(r.messages[1].content, "Looking.");
    cr_expect_str_eq(r.messages[1].tool_calls, "[{\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":"
                                               "\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}}]");
    cr_expect_str_eq(r.messages[2].role, "tool");
    cr_expect_str_eq(r.messages[2].tool_call_id, "call_1");
    cr_expect_eq(r.tool_choice, KVS_TOOL_CHOICE_FUNCTION);
    cr_expect(!r.parallel_tool_calls);
    kvs_api_request_free(&r);
}

Test(server_apis, responses_bad_shapes_name_the_field) {
    static const struct { const char *fields, *param; } bad[] = {
        {"\"max_output_tokens\": 3", "input"},
        {"\"input\": []", "input"},
        {"\"input\": 5", "input"},
        {"\"input\": [{\"role\": \"tool\", \"content\": \"x\"}]", "input[0]"},
        {"\"input\": [{\"role\": \"user\", \"content\": [{\"type\": \"input_image\", \"image_url\": \"u\"}]}]",
         "input[0].content"},
        {"\"input\": [{\"type\": \"function_call\", \"name\": \"f\"}]", "input[0]"},
        {"\"input\": [{\"type\": \"function_call_output\", \"output\": \"x\"}]", "input[0]"},
        {"\"input\": [{\"type\": \"item_reference\", \"id\": \"x\"}]", "input[0]"},
        {"\"input\": [{\"type\": \"web_search_call\"}]", "input[0]"},
        {"\"input\": \"x\", \"previous_response_id\": \"resp_1\"", "previous_response_id"},
        {"\"input\": \"x\", \"instructions\": 3", "instructions"},
        {"\"input\": \"x\", \"max_output_tokens\": 0", "max_output_tokens"},
        {"\"input\": \"x\", \"tools\": [{\"type\": \"file_search\"}]", "tools"},
        {"\"input\": \"x\", \"tools\": [{\"type\": \"function\", \"name\": \"a b\"}]", "tools"},
        {"\"input\": \"x\", \"tool_choice\": \"required\"", "tool_choice"},
        {"\"input\": \"x\", \"tool_choice\": {\"type\": \"function\"}", "tool_choice"},
        {"\"input\": \"x\", \"text\": {\"format\": {\"type\": \"json_schema\"}}", "text.format"},
        {"\"input\": \"x\", \"text\": {\"format\": {\"type\": \"yaml\"}}", "text.format"},
        {"\"input\": \"x\", \"background\": true", "background"},
        {"\"input\": \"x\", \"messages\": []", "messages"},
        {"\"input\": \"x\", \"temperature\": -1", "temperature"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvs_api_request r;
        kvs_api_error e;
        cr_expect(!rsp(bad[i].fields, &r, &e), "accepted: %s", bad[i].fields);
        cr_expect_eq(e.http_status, 400);
        cr_expect_str_eq(e.param, bad[i].param, "%s: %s", bad[i].fields, e.message);
    }
}

/* ---- answers ----------------------------------------------------------------------- */
static json_t *parsed(char *s) {
    json_t *j = json_loads(s, 0, NULL);
    cr_assert(j, "%s", s);
    free(s);
    return j;
}

#define CALL "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}"

Test(server_apis, anthropic_message_shapes) {
    kvs_resp_meta m = {KVS_API_CHAT, "msg_abc", "tiny"};
    m.dialect = KVS_DIALECT_ANTHROPIC;
    kvs_resp_end end = {KVS_FINISH_STOP, "END", false, 30, 8, 4, NULL};
    json_t *j = parsed(kvs_anth_full(&m, "Hi", 2, &end));
    cr_expect_str_eq(json_string_value(json_object_get(j, "type")), "message");
    cr_expect_str_eq(json_string_value(json_object_get(j, "role")), "assistant");
    cr_expect_str_eq(json_string_value(json_object_get(j, "stop_reason")), "stop_sequence");
    cr_expect_str_eq(json_string_value(json_object_get(j, "stop_sequence")), "END");
    json_t *u = json_object_get(j, "usage");
    cr_expect_eq(json_integer_value(json_object_get(u, "input_tokens")), 22, "the prompt less its cached tokens");
    cr_expect_eq(json_integer_value(json_object_get(u, "cache_read_input_tokens")), 8);
    cr_expect_eq(json_integer_value(json_object_get(u, "cache_creation_input_tokens")), 0);
    cr_expect_eq(json_integer_value(json_object_get(u, "output_tokens")), 4);
    cr_expect_str_eq(json_string_value(json_object_get(json_array_get(json_object_get(j, "content"), 0), "text")), "Hi");
    json_decref(j);
    end = (kvs_resp_end){KVS_FINISH_LENGTH, NULL, false, 3, 0, 4, NULL};
    j = parsed(kvs_anth_full(&m, "Hi", 2, &end));
    cr_expect_str_eq(json_string_value(json_object_get(j, "stop_reason")), "max_tokens");
    cr_expect(json_is_null(json_object_get(j, "stop_sequence")));
    json_decref(j);
    /* a call: a tool_use block whose input is the arguments' object, stop_reason tool_use */
    m.tools = KVS_TOOL_FORMAT_LLAMA3_JSON;
    end = (kvs_resp_end){KVS_FINISH_STOP, NULL, false, 3, 0, 4, NULL};
    j = parsed(kvs_anth_full(&m, CALL, strlen(CALL), &end));
    cr_expect_str_eq(json_string_value(json_object_get(j, "stop_reason")), "tool_use");
    json_t *content = json_object_get(j, "content");
    cr_assert_eq(json_array_size(content), 1, "no text block beside the call");
    json_t *b = json_array_get(content, 0);
    cr_expect_str_eq(json_string_value(json_object_get(b, "type")), "tool_use");
    cr_expect(!strncmp(json_string_value(json_object_get(b, "id")), "toolu_", 6));
    cr_expect_str_eq(json_string_value(json_object_get(b, "name")), "get_weather");
    cr_expect_str_eq(json_string_value(json_object_get(json_object_get(b, "input"), "city")), "Paris");
    json_decref(j);
}

Test(server_apis, responses_object_shapes) {
    kvs_resp_meta m = {KVS_API_CHAT, "resp_abc", "tiny"};
    m.dialect = KVS_DIALECT_RESPONSES;
    json_t *echo = json_pack("{s:s, s:b}", "instructions", "x", "store", 0);
    kvs_resp_end end = {KVS_FINISH_LENGTH, NULL, false, 30, 8, 4, NULL};
    json_t *j = parsed(kvs_rsp_full(&m, echo, 7, "Hi", 2, &end));
    cr_expect_str_eq(json_string_value(json_object_get(j, "object")), "response");
    cr_expect_eq(json_integer_value(json_object_get(j, "created_at")), 7);
    cr_expect_str_eq(json_string_value(json_object_get(j, "status")), "incomplete");
    cr_expect_str_eq(json_string_value(json_object_get(json_object_get(j, "incomplete_details"), "reason")),
                     "max_output_tokens");
    cr_expect_str_eq(json_string_value(json_object_get(j, "instructions")), "x");
    json_t *u = json_object_get(j, "usage");
    cr_expect_eq(json_integer_value(json_object_get(u, "input_tokens")), 30);
    cr_expect_eq(json_integer_value(json_object_get(json_object_get(u, "input_tokens_details"), "cached_tokens")), 8);
    cr_expect_eq(json_integer_value(json_object_get(u, "total_tokens")), 34);
    json_t *item = json_array_get(json_object_get(j, "output"), 0);
    cr_expect_str_eq(json_string_value(json_object_get(item, "type")), "message");
    cr_expect_str_eq(json_string_value(json_object_get(item, "id")), "msg_abc");
    json_t *part = json_array_get(json_object_get(item, "content"), 0);
    cr_expect_str_eq(json_string_value(json_object_get(part, "type")), "output_text");
    cr_expect_str_eq(json_string_value(json_object_get(part, "text")), "Hi");
    json_decref(j);
    m.tools = KVS_TOOL_FORMAT_LLAMA3_JSON;
    end.finish = KVS_FINISH_STOP;
    j = parsed(kvs_rsp_full(&m, echo, 7, CALL, strlen(CALL), &end));
    cr_expect_str_eq(json_string_value(json_object_get(j, "status")), "completed");
    cr_expect(json_is_null(json_object_get(j, "incomplete_details")));
    item = json_array_get(json_object_get(j, "output"), 0);
    cr_expect_str_eq(json_string_value(json_object_get(item, "type")), "function_call");
    cr_expect(!strncmp(json_string_value(json_object_get(item, "call_id")), "call_", 5));
    cr_expect(!strncmp(json_string_value(json_object_get(item, "id")), "fc_", 3));
    cr_expect_str_eq(json_string_value(json_object_get(item, "arguments")), "{\"city\": \"Paris\"}");
    json_decref(j);
    json_decref(echo);
}

/* ---- streams ------------------------------------------------------------------------ */
typedef struct {
    json_t *events; /* [[name, data], ...] */
} sink;

static void collect(void *ctx, const char *event, json_t *data) {
    sink *k = ctx;
    json_array_append_new(k->events, json_pack("[s, o]", event, data));
}

static const char *ev_name(sink *k, size_t i) { return json_string_value(json_array_get(json_array_get(k->events, i), 0)); }
static json_t *ev_data(sink *k, size_t i) { return json_array_get(json_array_get(k->events, i), 1); }

/* Feeds text through a tool parser in pieces cut at random (seeded) and the stream writer. */
static void stream_text(kvs_api_stream *w, const char *text, kvs_finish fin, uint64_t *rng) {
    kvs_tool_parser *p = w->meta.tools ? kvs_tool_parser_create(w->meta.tools, kvs_resp_tool_seed(&w->meta, 0)) : NULL;
    size_t n = strlen(text), at = 0;
    while (at < n || at == 0) {
        *rng = *rng * 6364136223846793005ull + 1442695040888963407ull;
        size_t k = 1 + (size_t)((*rng >> 33) % 6);
        if (k > n - at) k = n - at;
        bool last = at + k == n;
        kvs_tool_events ev = {0};
        if (p) {
            kvs_resp_slice s = {text + at, k};
            kvs_resp_tool_stream(p, &s, &ev, last);
        } else if (k) {
            kvs_tool_event e = {-1, NULL, NULL, (char *)text + at, k};
            kvs_tool_events one = {&e, 1, 1};
            w->dialect == KVS_DIALECT_ANTHROPIC ? kvs_anth_stream_events(w, &one) : kvs_rsp_stream_events(w, &one);
        }
        if (p) w->dialect == KVS_DIALECT_ANTHROPIC ? kvs_anth_stream_events(w, &ev) : kvs_rsp_stream_events(w, &ev);
        kvs_tool_events_free(&ev);
        at += k;
        if (last || n == 0) break;
    }
    kvs_resp_end end = {fin, NULL, p && kvs_tool_parser_n_calls(p) > 0, 10, 2, 5, fin == KVS_FINISH_ERROR ? "boom" : NULL};
    w->dialect == KVS_DIALECT_ANTHROPIC ? kvs_anth_stream_end(w, &end) : kvs_rsp_stream_end(w, &end);
    kvs_tool_parser_destroy(p);
}

static kvs_api_stream writer(kvs_api_dialect d, kvs_tool_format tools, sink *k) {
    kvs_api_stream w = {.dialect = d, .meta = {KVS_API_CHAT, d == KVS_DIALECT_ANTHROPIC ? "msg_s" : "resp_s", "tiny"},
                        .open = -1, .prompt_tokens = 10, .emit = collect, .ctx = k};
    w.meta.tools = tools;
    w.meta.dialect = d;
    k->events = json_array();
    return w;
}

static void writer_free(kvs_api_stream *w, sink *k) {
    free(w->acc), free(w->call_id), free(w->call_name);
    json_decref(w->items);
    json_decref(w->echo);
    json_decref(k->events);
}

Test(server_apis, anthropic_stream_events) {
    uint64_t seed = kvs_test_seed(), rng = seed;
    sink k;
    kvs_api_stream w = writer(KVS_DIALECT_ANTHROPIC, KVS_TOOL_FORMAT_NONE, &k);
    stream_text(&w, "Hello there", KVS_FINISH_STOP, &rng);
    const char *order[] = {"message_start", "content_block_start", "ping", "content_block_delta"};
    for (int i = 0; i < 4; i++) cr_expect_str_eq(ev_name(&k, i), order[i]);
    size_t n = json_array_size(k.events);
    cr_expect_str_eq(ev_name(&k, n - 3), "content_block_stop");
    cr_expect_str_eq(ev_name(&k, n - 2), "message_delta");
    cr_expect_str_eq(ev_name(&k, n - 1), "message_stop");
    char text[64] = "";
    for (size_t i = 0; i < n; i++)
        if (!strcmp(ev_name(&k, i), "content_block_delta"))
            strcat(text, json_string_value(json_object_get(json_object_get(ev_data(&k, i), "delta"), "text")));
    cr_expect_str_eq(text, "Hello there", "seed %llu", (unsigned long long)seed);
    json_t *md = ev_data(&k, n - 2);
    cr_expect_str_eq(json_string_value(json_object_get(json_object_get(md, "delta"), "stop_reason")), "end_turn");
    cr_expect_eq(json_integer_value(json_object_get(json_object_get(md, "usage"), "output_tokens")), 5);
    writer_free(&w, &k);
    /* a call in pieces: a tool_use block whose input_json_delta pieces are the arguments */
    w = writer(KVS_DIALECT_ANTHROPIC, KVS_TOOL_FORMAT_LLAMA3_JSON, &k);
    stream_text(&w, CALL, KVS_FINISH_STOP, &rng);
    n = json_array_size(k.events);
    char args[128] = "";
    int starts = 0;
    for (size_t i = 0; i < n; i++) {
        json_t *d = ev_data(&k, i);
        if (!strcmp(ev_name(&k, i), "content_block_start")) {
            json_t *b = json_object_get(d, "content_block");
            cr_expect_str_eq(json_string_value(json_object_get(b, "type")), "tool_use");
            cr_expect_str_eq(json_string_value(json_object_get(b, "name")), "get_weather");
            starts++;
        }
        if (!strcmp(ev_name(&k, i), "content_block_delta"))
            strcat(args, json_string_value(json_object_get(json_object_get(d, "delta"), "partial_json")));
    }
    cr_expect_eq(starts, 1);
    cr_expect_str_eq(args, "{\"city\": \"Paris\"}", "seed %llu", (unsigned long long)seed);
    cr_expect_str_eq(json_string_value(json_object_get(json_object_get(ev_data(&k, n - 2), "delta"), "stop_reason")),
                     "tool_use");
    writer_free(&w, &k);
    /* a failure: an error event ends it */
    w = writer(KVS_DIALECT_ANTHROPIC, KVS_TOOL_FORMAT_NONE, &k);
    stream_text(&w, "Hi", KVS_FINISH_ERROR, &rng);
    n = json_array_size(k.events);
    cr_expect_str_eq(ev_name(&k, n - 1), "error");
    cr_expect_str_eq(json_string_value(json_object_get(json_object_get(ev_data(&k, n - 1), "error"), "type")), "api_error");
    writer_free(&w, &k);
}

Test(server_apis, responses_stream_events) {
    uint64_t seed = kvs_test_seed(), rng = seed;
    sink k;
    kvs_api_stream w = writer(KVS_DIALECT_RESPONSES, KVS_TOOL_FORMAT_NONE, &k);
    stream_text(&w, "Hello there", KVS_FINISH_STOP, &rng);
    size_t n = json_array_size(k.events);
    const char *want[] = {"response.created", "response.in_progress", "response.output_item.added",
                          "response.content_part.added", "response.output_text.delta"};
    for (int i = 0; i < 5; i++) cr_expect_str_eq(ev_name(&k, i), want[i]);
    const char *tail[] = {"response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"};
    for (int i = 0; i < 4; i++) cr_expect_str_eq(ev_name(&k, n - 4 + i), tail[i]);
    for (size_t i = 0; i < n; i++) {
        cr_expect_eq(json_integer_value(json_object_get(ev_data(&k, i), "sequence_number")), (json_int_t)i);
        cr_expect_str_eq(json_string_value(json_object_get(ev_data(&k, i), "type")), ev_name(&k, i));
    }
    cr_expect_str_eq(json_string_value(json_object_get(ev_data(&k, n - 4), "text")), "Hello there", "seed %llu",
                     (unsigned long long)seed);
    json_t *resp = json_object_get(ev_data(&k, n - 1), "response");
    cr_expect_str_eq(json_string_value(json_object_get(resp, "status")), "completed");
    cr_expect_eq(json_array_size(json_object_get(resp, "output")), 1);
    writer_free(&w, &k);
    /* a call, cut by max_output_tokens: the arguments' events, then response.incomplete */
    w = writer(KVS_DIALECT_RESPONSES, KVS_TOOL_FORMAT_LLAMA3_JSON, &k);
    stream_text(&w, CALL, KVS_FINISH_LENGTH, &rng);
    n = json_array_size(k.events);
    char args[128] = "";
    for (size_t i = 0; i < n; i++)
        if (!strcmp(ev_name(&k, i), "response.function_call_arguments.delta"))
            strcat(args, json_string_value(json_object_get(ev_data(&k, i), "delta")));
    cr_expect_str_eq(args, "{\"city\": \"Paris\"}", "seed %llu", (unsigned long long)seed);
    cr_expect_str_eq(ev_name(&k, n - 3), "response.function_call_arguments.done");
    cr_expect_str_eq(json_string_value(json_object_get(ev_data(&k, n - 3), "arguments")), args);
    cr_expect_str_eq(ev_name(&k, n - 1), "response.incomplete");
    json_t *item = json_array_get(json_object_get(json_object_get(ev_data(&k, n - 1), "response"), "output"), 0);
    cr_expect_str_eq(json_string_value(json_object_get(item, "name")), "get_weather");
    writer_free(&w, &k);
    w = writer(KVS_DIALECT_RESPONSES, KVS_TOOL_FORMAT_NONE, &k);
    stream_text(&w, "Hi", KVS_FINISH_ERROR, &rng);
    n = json_array_size(k.events);
    cr_expect_str_eq(ev_name(&k, n - 1), "response.failed");
    writer_free(&w, &k);
}

/* ---- the request path in process: routes, x-api-key, Anthropic's errors, count_tokens --- */
typedef struct {
    int status;
    json_t *body;
    bool ready; /* ready for the engine */
} path_result;

static path_result path(kvs_server *s, const char *method, const char *url, const char *hname, const char *hvalue,
                        const char *body) {
    kvs_http_header h[2] = {{"Host", "localhost", 4, 9, false}};
    int n = 1;
    if (hname) h[n++] = (kvs_http_header){hname, hvalue, strlen(hname), strlen(hvalue), false};
    kvs_http_answer a;
    kvs_http_prepared p;
    path_result r = {0};
    r.ready = kvs_http_handle(s, method, url, "HTTP/1.1", h, n, body, body ? strlen(body) : 0, 0, &a, &p);
    if (r.ready) {
        cr_expect_eq(p.req.kind, KVS_API_CHAT);
        kvs_http_prepared_free(&p);
        return r;
    }
    r.status = a.status;
    r.body = a.body ? json_loads(a.body, 0, NULL) : NULL;
    cr_expect(r.body, "not JSON: %s", a.body ? a.body : "(none)");
    free(a.body);
    return r;
}

static const char *anth_error_type(const path_result *r) {
    cr_expect_str_eq(json_string_value(json_object_get(r->body, "type")), "error");
    return json_string_value(json_object_get(json_object_get(r->body, "error"), "type"));
}

Test(server_apis, routes_auth_and_error_shapes) {
    kvs_tokenizer *tok;
    cr_assert_eq(kvs_tokenizer_load(src_path("models/tiny-needle-llama"), &tok), KVS_OK, "%s", kvs_last_error());
    kvs_server_config cfg = {.api_key = "k", .served_model_name = "m", .max_model_len = 256, .n_layers = 8};
    kvs_server *s;
    cr_assert_eq(kvs_server_create(&cfg, NULL, tok, &s), KVS_OK, "%s", kvs_last_error());
    const char *msg = "{\"model\": \"m\", \"max_tokens\": 4, \"messages\": [" USER "]}";
    /* x-api-key or Bearer; a wrong or missing key is Anthropic's 401 under /v1/messages, OpenAI's elsewhere */
    path_result r = path(s, "POST", "/v1/messages", "x-api-key", "k", msg);
    cr_expect(r.ready, "status %d", r.status);
    r = path(s, "POST", "/v1/messages", "Authorization", "Bearer k", msg);
    cr_expect(r.ready);
    r = path(s, "POST", "/v1/messages", "x-api-key", "wrong", msg);
    cr_expect_eq(r.status, 401);
    cr_expect_str_eq(anth_error_type(&r), "authentication_error");
    json_decref(r.body);
    r = path(s, "POST", "/v1/responses", "x-api-key", "wrong", "{}");
    cr_expect_eq(r.status, 401);
    cr_expect(json_is_object(json_object_get(r.body, "error")));
    json_decref(r.body);
    /* Anthropic's 404 and 405 under /v1/messages; a bad model; a bad body */
    r = path(s, "POST", "/v1/messages/nope", "x-api-key", "k", "{}");
    cr_expect_eq(r.status, 404);
    cr_expect_str_eq(anth_error_type(&r), "not_found_error");
    json_decref(r.body);
    r = path(s, "GET", "/v1/messages", "x-api-key", "k", NULL);
    cr_expect_eq(r.status, 405);
    cr_expect_str_eq(anth_error_type(&r), "invalid_request_error");
    json_decref(r.body);
    r = path(s, "POST", "/v1/messages", "x-api-key", "k", "{\"model\": \"x\", \"max_tokens\": 4, \"messages\": [" USER "]}");
    cr_expect_eq(r.status, 404);
    cr_expect_str_eq(anth_error_type(&r), "not_found_error");
    json_decref(r.body);
    /* Anthropic's max_tokens is a ceiling, capped by the context (Claude Code asks for 32000) */
    r = path(s, "POST", "/v1/messages", "x-api-key", "k", "{\"max_tokens\": 32000, \"messages\": [" USER "]}");
    cr_expect(r.ready, "max_tokens past the context: %d", r.status);
    r = path(s, "POST", "/v1/responses", "x-api-key", "k", "{\"input\": \"hi\", \"max_output_tokens\": 300}");
    cr_expect_eq(r.status, 400);
    cr_expect_str_eq(json_string_value(json_object_get(json_object_get(r.body, "error"), "param")), "max_output_tokens");
    json_decref(r.body);
    r = path(s, "POST", "/v1/responses", "Authorization", "Bearer k", "{\"input\": \"hi\"}");
    cr_expect(r.ready);
    /* count_tokens: the chat template's prompt, as /tokenize of the same messages counts it */
    r = path(s, "POST", "/v1/messages/count_tokens", "x-api-key", "k", "{\"model\": \"m\", \"messages\": [" USER "]}");
    cr_expect_eq(r.status, 200);
    json_int_t n = json_integer_value(json_object_get(r.body, "input_tokens"));
    json_decref(r.body);
    r = path(s, "POST", "/tokenize", "x-api-key", "k", "{\"messages\": [" USER "]}");
    cr_expect_eq(r.status, 200);
    cr_expect_eq(json_integer_value(json_object_get(r.body, "count")), n);
    cr_expect_gt(n, 5);
    json_decref(r.body);
    r = path(s, "POST", "/v1/messages/count_tokens", "x-api-key", "k", "{\"messages\": 3}");
    cr_expect_eq(r.status, 400);
    cr_expect_str_eq(anth_error_type(&r), "invalid_request_error");
    json_decref(r.body);
    kvs_server_free(s);
    kvs_tokenizer_destroy(tok);
}
