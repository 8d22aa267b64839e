/* server: an OpenAI Responses body -> the chat request (see responses.h).
 * Responses' own shapes are checked here, naming its fields; then written as
 * chat's and parsed by the chat validator. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/responses.h"

static const char *type_of(json_t *j) { return json_string_value(json_object_get(j, "type")); }

/* A message's content: a string, or input_text / output_text parts -> chat's text parts. */
static json_t *map_content(json_t *c, const char *param, kvs_api_error *err) {
    if (json_is_string(c)) return json_incref(c);
    if (!json_is_array(c)) {
        kvs_api_fail(err, 400, param, "'%s' must be a string or an array of input_text parts", param);
        return NULL;
    }
    json_t *parts = json_array();
    size_t k;
    json_t *p;
    json_array_foreach(c, k, p) {
        const char *t = type_of(p);
        json_t *text = json_object_get(p, "text");
        if (!t || (strcmp(t, "input_text") && strcmp(t, "output_text") && strcmp(t, "text")) || !json_is_string(text)) {
            json_decref(parts);
            kvs_api_fail(err, 400, param, "'%s[%d]': only input_text and output_text parts are supported%s", param,
                         (int)k, t && !strncmp(t, "input_", 6) ? " (this model reads text only)" : "");
            return NULL;
        }
        json_array_append_new(parts, json_pack("{s:s, s:O}", "type", "text", "text", text));
    }
    return parts;
}

/* The last chat message when it is an assistant's (function calls join it). */
static json_t *last_assistant(json_t *out) {
    json_t *m = json_array_get(out, json_array_size(out) - 1);
    const char *role = json_string_value(json_object_get(m, "role"));
    return role && !strcmp(role, "assistant") ? m : NULL;
}

/* One input item -> chat messages appended to out. */
static bool map_item(json_t *it, int i, json_t *out, kvs_api_error *err) {
    char param[48];
    snprintf(param, sizeof param, "input[%d]", i);
    if (!json_is_object(it)) return kvs_api_fail(err, 400, param, "'%s' must be an object", param);
    const char *type = type_of(it);
    if (!type || !strcmp(type, "message")) {
        const char *role = json_string_value(json_object_get(it, "role"));
        if (!role || (strcmp(role, "user") && strcmp(role, "assistant") && strcmp(role, "system") &&
                      strcmp(role, "developer")))
            return kvs_api_fail(err, 400, param, "'%s.role' must be user, assistant, system or developer", param);
        char cp[64];
        snprintf(cp, sizeof cp, "%s.content", param);
        json_t *content = map_content(json_object_get(it, "content"), cp, err);
        if (!content) return false;
        json_array_append_new(out, json_pack("{s:s, s:o}", "role", role, "content", content));
        return true;
    }
    if (!strcmp(type, "function_call")) {
        json_t *id = json_object_get(it, "call_id"), *name = json_object_get(it, "name"),
               *args = json_object_get(it, "arguments");
        if (!json_is_string(id) || !json_is_string(name) || !json_is_string(args))
            return kvs_api_fail(err, 400, param, "'%s' must be {\"type\": \"function_call\", \"call_id\", \"name\", "
                                "\"arguments\": a string of JSON}", param);
        json_t *call = json_pack("{s:O, s:s, s:{s:O, s:O}}", "id", id, "type", "function", "function", "name", name,
                                 "arguments", args);
        json_t *m = last_assistant(out), *calls = json_object_get(m, "tool_calls");
        if (!m) json_array_append_new(out, m = json_pack("{s:s, s:s}", "role", "assistant", "content", ""));
        if (!calls) json_object_set_new(m, "tool_calls", calls = json_array());
        json_array_append_new(calls, call);
        return true;
    }
    if (!strcmp(type, "function_call_output")) {
        json_t *id = json_object_get(it, "call_id"), *output = json_object_get(it, "output");
        if (!json_is_string(id)) return kvs_api_fail(err, 400, param, "'%s.call_id' must be a string", param);
        char op[64];
        snprintf(op, sizeof op, "%s.output", param);
        json_t *content = map_content(output, op, err);
        if (!content) return false;
        json_array_append_new(out, json_pack("{s:s, s:O, s:o}", "role", "tool", "tool_call_id", id, "content", content));
        return true;
    }
    if (!strcmp(type, "reasoning")) return true; /* a client may send back reasoning items; this server writes none */
    if (!strcmp(type, "item_reference"))
        return kvs_api_fail(err, 400, param, "'%s': item references need stored responses, which this server keeps none "
                            "of: send the items themselves", param);
    return kvs_api_fail(err, 400, param, "'%s': input items of type '%.40s' are not supported", param, type);
}

static bool parse_input(json_t *input, json_t *instructions, const kvs_api_limits *lim, kvs_api_request *r,
                        kvs_api_error *err) {
    json_t *out = json_array();
    bool ok = true;
    if (instructions) json_array_append_new(out, json_pack("{s:s, s:O}", "role", "system", "content", instructions));
    if (json_is_string(input)) {
        json_array_append_new(out, json_pack("{s:s, s:O}", "role", "user", "content", input));
    } else if (!json_is_array(input) || json_array_size(input) == 0) {
        ok = kvs_api_fail(err, 400, "input", "'input' must be a string or a non-empty array of input items");
    } else if (json_array_size(input) > 4096) {
        ok = kvs_api_fail(err, 400, "input", "'input' holds at most 4096 items");
    } else {
        size_t i;
        json_t *it;
        json_array_foreach(input, i, it) if (ok) ok = map_item(it, (int)i, out, err);
    }
    /* the validator's messages[k] are not the client's input[k]: name the field */
    if (ok && !kvs_api_parse_messages(out, lim, r, err)) {
        ok = false;
        snprintf(err->param, sizeof err->param, "input");
    }
    json_decref(out);
    return ok;
}

/* tools: [{type: function, name, description, parameters, strict}] -> chat's. */
static bool parse_tools(json_t *v, kvs_api_request *r, kvs_api_error *err) {
    if (json_is_null(v)) return true;
    if (!json_is_array(v)) return kvs_api_fail(err, 400, "tools", "'tools' must be an array");
    json_t *tools = json_array();
    size_t i;
    json_t *t;
    json_array_foreach(v, i, t) {
        const char *type = type_of(t);
        if (!json_is_object(t) || !type || strcmp(type, "function")) {
            json_decref(tools);
            return kvs_api_fail(err, 400, "tools", "'tools[%d]': only function tools ({\"type\": \"function\", \"name\", "
                                "\"parameters\"}) are supported%s%.40s", (int)i, type ? ", not " : "", type ? type : "");
        }
        json_t *fn = json_deep_copy(t);
        json_object_del(fn, "type");
        json_array_append_new(tools, json_pack("{s:s, s:o}", "type", "function", "function", fn));
    }
    bool ok = kvs_api_parse_tools_field("tools", tools, r, err);
    json_decref(tools);
    if (!ok) kvs_api_error_rename(err, ".function", "");
    return ok;
}

/* tool_choice: "auto" | "none" | "required" | {"type": "function", "name"}. */
static bool parse_tool_choice(json_t *v, kvs_api_request *r, kvs_api_error *err) {
    if (json_is_string(v) || json_is_null(v)) return kvs_api_parse_tools_field("tool_choice", v, r, err);
    json_t *name = json_object_get(v, "name");
    if (!type_of(v) || strcmp(type_of(v), "function") || !json_is_string(name))
        return kvs_api_fail(err, 400, "tool_choice", "'tool_choice' must be \"auto\", \"none\", \"required\" or "
                            "{\"type\": \"function\", \"name\": ...}");
    json_t *chat = json_pack("{s:s, s:{s:O}}", "type", "function", "function", "name", name);
    bool ok = kvs_api_parse_tools_field("tool_choice", chat, r, err);
    json_decref(chat);
    return ok;
}

/* text: {"format": {...}, "verbosity"}. */
static bool parse_text(json_t *v, kvs_api_request *r, kvs_api_error *err) {
    if (json_is_null(v)) return true;
    if (!json_is_object(v)) return kvs_api_fail(err, 400, "text", "'text' must be an object");
    json_t *format = json_object_get(v, "format");
    return !format || kvs_api_parse_format(format, "text.format", r, err);
}

/* Fields taken that change nothing here, at the values that mean nothing. */
static bool ignored(const char *key, json_t *v, kvs_api_error *err) {
    if (json_is_null(v)) return true;
    if (!strcmp(key, "previous_response_id"))
        return kvs_api_fail(err, 400, key, "'previous_response_id' is not supported: this server stores no responses; "
                            "send the conversation in 'input'");
    if (!strcmp(key, "store")) return json_is_boolean(v) || kvs_api_fail(err, 400, key, "'store' must be a boolean");
    if (!strcmp(key, "background") && !json_is_false(v))
        return kvs_api_fail(err, 400, key, "'background' is not supported");
    if (!strcmp(key, "metadata") || !strcmp(key, "reasoning"))
        return json_is_object(v) || kvs_api_fail(err, 400, key, "'%s' must be an object", key);
    if (!strcmp(key, "user") || !strcmp(key, "safety_identifier") || !strcmp(key, "prompt_cache_key") ||
        !strcmp(key, "service_tier") || !strcmp(key, "truncation"))
        return json_is_string(v) || kvs_api_fail(err, 400, key, "'%s' must be a string", key);
    if (!strcmp(key, "include")) return json_is_array(v) || kvs_api_fail(err, 400, key, "'include' must be an array");
    if (!strcmp(key, "background")) return true;
    return kvs_api_fail(err, 400, key, "'%.40s': the field is not supported", key);
}

static bool parse_fields(json_t *root, const kvs_api_limits *lim, kvs_api_request *r, kvs_api_error *err) {
    const char *key;
    json_t *v, *input = NULL, *instructions = NULL;
    bool ok = true;
    json_object_foreach(root, key, v) {
        json_int_t x;
        if (!strcmp(key, "input")) {
            input = v;
        } else if (!strcmp(key, "instructions")) {
            ok = json_is_null(v) || json_is_string(v) ||
                 kvs_api_fail(err, 400, key, "'instructions' must be a string");
            instructions = json_is_string(v) ? v : NULL;
        } else if (!strcmp(key, "max_output_tokens")) {
            ok = json_is_null(v) || kvs_api_get_int(v, key, 1, lim->max_model_len, &x, err);
            r->max_tokens = ok && !json_is_null(v) ? (int)x : 0;
        } else if (!strcmp(key, "tools")) {
            ok = parse_tools(v, r, err);
        } else if (!strcmp(key, "tool_choice")) {
            ok = parse_tool_choice(v, r, err);
        } else if (!strcmp(key, "parallel_tool_calls")) {
            ok = kvs_api_parse_tools_field(key, v, r, err);
        } else if (!strcmp(key, "text")) {
            ok = parse_text(v, r, err);
        } else {
            int common = kvs_api_parse_common_field(key, v, lim, r, err); /* model, stream, temperature, top_p, ... */
            ok = common > 0 || (common < 0 && ignored(key, v, err));
        }
        if (!ok) return false;
    }
    if (!input) return kvs_api_fail(err, 400, "input", "'input' is required");
    return parse_input(input, instructions, lim, r, err) && kvs_api_tools_check(r, err) &&
           kvs_api_check_sampling(&r->sampling, err);
}

/* root[key] into e (fallback, a new value, when absent or null). */
static void repeat(json_t *e, json_t *root, const char *key, json_t *fallback) {
    json_t *v = json_object_get(root, key);
    if (v && !json_is_null(v)) {
        json_decref(fallback);
        fallback = json_incref(v);
    }
    json_object_set_new(e, key, fallback);
}

/* What the response object repeats of the request. */
static json_t *echo_of(json_t *root, const kvs_api_request *r) {
    json_t *e = json_object(), *format = json_object_get(json_object_get(root, "text"), "format");
    if (!e) return NULL;
    repeat(e, root, "instructions", json_null());
    repeat(e, root, "max_output_tokens", json_null());
    json_object_set_new(e, "temperature", json_real(r->sampling.temperature));
    json_object_set_new(e, "top_p", json_real(r->sampling.top_p));
    repeat(e, root, "tools", json_array());
    repeat(e, root, "tool_choice", json_string("auto"));
    json_object_set_new(e, "parallel_tool_calls", json_boolean(r->parallel_tool_calls));
    json_object_set_new(e, "store", json_boolean(!json_is_false(json_object_get(root, "store"))));
    repeat(e, root, "metadata", json_object());
    json_object_set_new(e, "text", json_pack("{s:o}", "format", format && !json_is_null(format) ? json_incref(format)
                                                                                          : json_pack("{s:s}", "type", "text")));
    json_object_set_new(e, "truncation", json_string("disabled"));
    json_object_set_new(e, "previous_response_id", json_null());
    json_object_set_new(e, "reasoning", json_pack("{s:n, s:n}", "effort", "summary"));
    json_object_set_new(e, "user", json_null());
    return e;
}

bool kvs_rsp_parse_request(const char *body, size_t len, const kvs_api_limits *lim, kvs_api_request *r,
                           kvs_api_error *err) {
    kvs_api_request_init(r, KVS_API_CHAT, lim);
    memset(err, 0, sizeof *err);
    r->dialect = KVS_DIALECT_RESPONSES;
    r->max_tokens_param = "max_output_tokens";
    json_t *root = kvs_api_load_object(body, len, err);
    bool ok = root && parse_fields(root, lim, r, err);
    if (ok && !(r->echo = echo_of(root, r))) ok = kvs_api_fail(err, 500, NULL, "out of memory");
    json_decref(root);
    if (!ok) kvs_api_request_free(r);
    return ok;
}
