/* server: the request's tool fields: tools, tool_choice, parallel_tool_calls;
 * messages' tool_calls, tool_call_id and name; and the constraint a forced
 * call puts on the output (kvs_tool_constraint). Every refusal names its field. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/server_internal.h"

#define MAX_TOOLS 128
#define MAX_NAME 64

static char *dump_compact(json_t *j) { return json_dumps(j, JSON_COMPACT | JSON_ENCODE_ANY); }

/* OpenAI's function names: 1 to 64 of a-z, A-Z, 0-9, '_', '-', '.'. */
static bool good_name(json_t *v) {
    if (!json_is_string(v)) return false;
    size_t n = json_string_length(v);
    const char *s = json_string_value(v);
    if (n == 0 || n > MAX_NAME) return false;
    for (size_t i = 0; i < n; i++)
        if (!strchr("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.", s[i]) || !s[i]) return false;
    return true;
}

static bool parse_tools(json_t *v, kvs_api_request *r, kvs_api_error *err) {
    if (json_is_null(v)) return true;
    if (!json_is_array(v)) return kvs_api_fail(err, 400, "tools", "'tools' must be an array");
    if (json_array_size(v) > MAX_TOOLS) return kvs_api_fail(err, 400, "tools", "'tools' holds at most %d tools", MAX_TOOLS);
    if (json_array_size(v) == 0) return true;
    size_t i;
    json_t *t;
    json_array_foreach(v, i, t) {
        char param[48];
        snprintf(param, sizeof param, "tools[%d]", (int)i);
        json_t *type = json_object_get(t, "type"), *f = json_object_get(t, "function");
        if (!json_is_object(t) || !json_is_string(type) || strcmp(json_string_value(type), "function"))
            return kvs_api_fail(err, 400, param, "'%s' must be {\"type\": \"function\", \"function\": {...}}", param);
        snprintf(param, sizeof param, "tools[%d].function", (int)i);
        if (!json_is_object(f)) return kvs_api_fail(err, 400, param, "'%s' must be an object", param);
        json_t *desc = json_object_get(f, "description"), *params = json_object_get(f, "parameters"),
               *strict = json_object_get(f, "strict");
        if (!good_name(json_object_get(f, "name")))
            return kvs_api_fail(err, 400, "tools", "'%s.name' must be 1 to %d letters, digits, '_', '-' or '.'", param,
                                MAX_NAME);
        if (desc && !json_is_string(desc) && !json_is_null(desc))
            return kvs_api_fail(err, 400, "tools", "'%s.description' must be a string", param);
        if (params && !json_is_object(params) && !json_is_null(params))
            return kvs_api_fail(err, 400, "tools", "'%s.parameters' must be a JSON schema object", param);
        if (strict && !json_is_boolean(strict) && !json_is_null(strict))
            return kvs_api_fail(err, 400, "tools", "'%s.strict' must be a boolean", param);
        for (size_t k = 0; k < i; k++)
            if (json_equal(json_object_get(json_object_get(json_array_get(v, k), "function"), "name"),
                           json_object_get(f, "name")))
                return kvs_api_fail(err, 400, "tools", "'%s.name' repeats the name of tools[%d]", param, (int)k);
    }
    if (!(r->tools = dump_compact(v))) return kvs_api_fail(err, 500, NULL, "out of memory");
    return true;
}

static bool parse_tool_choice(json_t *v, kvs_api_request *r, kvs_api_error *err) {
    if (json_is_null(v)) return true;
    static const char *const names[] = {"auto", "none", "required"};
    if (json_is_string(v)) {
        for (int k = 0; k < 3; k++)
            if (!strcmp(json_string_value(v), names[k])) {
                r->tool_choice = (kvs_tool_choice)k;
                return true;
            }
        return kvs_api_fail(err, 400, "tool_choice", "'tool_choice' must be \"auto\", \"none\", \"required\" or "
                            "{\"type\": \"function\", \"function\": {\"name\": ...}}");
    }
    json_t *type = json_object_get(v, "type"), *name = json_object_get(json_object_get(v, "function"), "name");
    if (!json_is_string(type) || strcmp(json_string_value(type), "function") || !good_name(name))
        return kvs_api_fail(err, 400, "tool_choice", "'tool_choice' as an object must be {\"type\": \"function\", "
                            "\"function\": {\"name\": ...}}");
    r->tool_choice = KVS_TOOL_CHOICE_FUNCTION;
    if (!(r->tool_choice_name = strdup(json_string_value(name)))) return kvs_api_fail(err, 500, NULL, "out of memory");
    return true;
}

bool kvs_api_is_tools_field(const char *key) {
    return !strcmp(key, "tools") || !strcmp(key, "tool_choice") || !strcmp(key, "parallel_tool_calls");
}

bool kvs_api_parse_tools_field(const char *key, json_t *v, kvs_api_request *r, kvs_api_error *err) {
    if (!strcmp(key, "tools")) return parse_tools(v, r, err);
    if (!strcmp(key, "tool_choice")) return parse_tool_choice(v, r, err);
    if (json_is_null(v)) return true;
    if (!json_is_boolean(v)) return kvs_api_fail(err, 400, key, "'parallel_tool_calls' must be a boolean");
    r->parallel_tool_calls = json_is_true(v);
    return true;
}

void kvs_api_tools_defaults(kvs_api_request *r) { r->parallel_tool_calls = true; }

bool kvs_api_tools_check(kvs_api_request *r, kvs_api_error *err) {
    if ((r->tool_choice == KVS_TOOL_CHOICE_REQUIRED || r->tool_choice == KVS_TOOL_CHOICE_FUNCTION) && !r->tools)
        return kvs_api_fail(err, 400, "tool_choice", "'tool_choice' %s needs 'tools'",
                            r->tool_choice == KVS_TOOL_CHOICE_REQUIRED ? "\"required\"" : "naming a function");
    if (r->tool_choice != KVS_TOOL_CHOICE_FUNCTION) return true;
    json_t *tools = json_loads(r->tools, 0, NULL);
    bool found = false;
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t) {
        const char *name = json_string_value(json_object_get(json_object_get(t, "function"), "name"));
        found |= name && !strcmp(name, r->tool_choice_name);
    }
    json_decref(tools);
    if (!found)
        return kvs_api_fail(err, 400, "tool_choice", "'tool_choice' names the function '%s', which is not in 'tools'",
                            r->tool_choice_name);
    return true;
}

/* ---- messages ------------------------------------------------------------------ */
/* An assistant's tool_calls, as the template gets them: the arguments (a
 * string of JSON, as OpenAI sends them) parsed into an object, as vLLM does. */
static bool parse_tool_calls(json_t *v, const char *param, char **out, kvs_api_error *err) {
    if (!json_is_array(v)) return kvs_api_fail(err, 400, param, "'%s' must be an array", param);
    json_t *calls = json_array();
    size_t i;
    json_t *c;
    json_array_foreach(v, i, c) {
        json_t *f = json_object_get(c, "function"), *id = json_object_get(c, "id"), *type = json_object_get(c, "type");
        json_t *args = json_object_get(f, "arguments");
        json_t *parsed = json_is_string(args) ? json_loads(json_string_value(args), 0, NULL) : json_incref(args);
        const char *bad = !json_is_object(c) || !json_is_object(f) ? "must be {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}}"
                          : !good_name(json_object_get(f, "name")) ? "has a bad function.name"
                          : id && !json_is_string(id) ? "has an id that is not a string"
                          : type && !(json_is_string(type) && !strcmp(json_string_value(type), "function")) ? "has a type other than \"function\""
                          : !json_is_object(parsed) ? "has function.arguments that are not a JSON object (as a string)"
                          : NULL;
        if (bad) {
            json_decref(parsed);
            json_decref(calls);
            return kvs_api_fail(err, 400, param, "'%s[%d]' %s", param, (int)i, bad);
        }
        json_t *call = json_object();
        if (id) json_object_set(call, "id", id);
        json_object_set_new(call, "type", json_string("function"));
        json_object_set_new(call, "function", json_pack("{s:O, s:o}", "name", json_object_get(f, "name"), "arguments", parsed));
        json_array_append_new(calls, call);
    }
    *out = dump_compact(calls);
    json_decref(calls);
    return *out ? true : kvs_api_fail(err, 500, NULL, "out of memory");
}

static bool parse_text_field(json_t *m, const char *key, int i, char **out, kvs_api_error *err) {
    json_t *v = json_object_get(m, key);
    if (!v || json_is_null(v)) return true;
    char param[48];
    snprintf(param, sizeof param, "messages[%d].%s", i, key);
    if (!json_is_string(v) || memchr(json_string_value(v), 0, json_string_length(v)) || json_string_length(v) > 256)
        return kvs_api_fail(err, 400, param, "'%s' must be a string of at most 256 bytes without NUL", param);
    *out = strdup(json_string_value(v));
    return *out ? true : kvs_api_fail(err, 500, NULL, "out of memory");
}

bool kvs_api_parse_message_tools(json_t *m, int i, kvs_chat_message *out, kvs_api_error *err) {
    char *name = NULL, *id = NULL, *calls = NULL;
    json_t *tc = json_object_get(m, "tool_calls");
    char param[48];
    snprintf(param, sizeof param, "messages[%d].tool_calls", i);
    bool ok = parse_text_field(m, "name", i, &name, err) && parse_text_field(m, "tool_call_id", i, &id, err);
    if (ok && tc && !json_is_null(tc)) {
        if (strcmp(out->role, "assistant")) ok = kvs_api_fail(err, 400, param, "only assistant messages have '%s'", param);
        else ok = parse_tool_calls(tc, param, &calls, err);
    }
    out->name = name;
    out->tool_call_id = id;
    out->tool_calls = calls;
    return ok;
}

void kvs_api_tools_free(kvs_api_request *r) {
    for (int i = 0; i < r->n_messages; i++) {
        free((char *)r->messages[i].name);
        free((char *)r->messages[i].tool_call_id);
        free((char *)r->messages[i].tool_calls);
    }
    free(r->tools);
    free(r->tool_choice_name);
    free(r->constraint_schema);
    free(r->constraint_prefix);
    free(r->constraint_suffix);
}

/* ---- the constraint of a forced call ---------------------------------------------- */
/* {"type": "object", "properties": {"name": {"const": N}, KEY: PARAMS}, "required": ["name", KEY]} */
static json_t *call_schema(json_t *function, const char *args_key) {
    json_t *params = json_object_get(function, "parameters");
    json_t *props = json_pack("{s:{s:O}}", "name", "const", json_object_get(function, "name"));
    json_object_set_new(props, args_key, json_is_object(params) ? json_incref(params) : json_pack("{s:s}", "type", "object"));
    return json_pack("{s:s, s:o, s:[s,s]}", "type", "object", "properties", props, "required", "name", args_key);
}

kvs_status kvs_tool_constraint(const char *tools, kvs_tool_choice choice, const char *function, kvs_tool_format f,
                               char **schema, char **prefix, char **suffix) {
    *schema = *prefix = *suffix = NULL;
    if (choice != KVS_TOOL_CHOICE_REQUIRED && choice != KVS_TOOL_CHOICE_FUNCTION) return KVS_OK;
    if (f == KVS_TOOL_FORMAT_NONE) return kvs_fail(KVS_ERR_UNSUPPORTED, "a forced tool call needs a tool-call parser");
    json_t *arr = json_loads(tools ? tools : "", 0, NULL), *options = json_array();
    const char *key = f == KVS_TOOL_FORMAT_HERMES ? "arguments" : "parameters";
    size_t i;
    json_t *t;
    json_array_foreach(arr, i, t) {
        json_t *fn = json_object_get(t, "function");
        const char *name = json_string_value(json_object_get(fn, "name"));
        if (name && (choice == KVS_TOOL_CHOICE_REQUIRED || !strcmp(name, function)))
            json_array_append_new(options, call_schema(fn, key));
    }
    json_decref(arr);
    if (json_array_size(options) == 0) {
        json_decref(options);
        return kvs_fail(KVS_ERR_INVALID, "tool_choice: no such function in tools");
    }
    json_t *root = json_array_size(options) == 1 ? json_incref(json_array_get(options, 0)) : json_pack("{s:O}", "anyOf", options);
    json_decref(options);
    *schema = dump_compact(root);
    json_decref(root);
    *prefix = strdup(f == KVS_TOOL_FORMAT_HERMES ? "<tool_call>\n" : "");
    *suffix = strdup(f == KVS_TOOL_FORMAT_HERMES ? "\n</tool_call>" : "");
    if (*schema && *prefix && *suffix) return KVS_OK;
    free(*schema), free(*prefix), free(*suffix);
    *schema = *prefix = *suffix = NULL;
    return kvs_fail(KVS_ERR_NOMEM, "out of memory");
}

bool kvs_api_tool_constrain(kvs_api_request *r, kvs_tool_format f, kvs_api_error *err) {
    if (!r->tools || (r->tool_choice != KVS_TOOL_CHOICE_REQUIRED && r->tool_choice != KVS_TOOL_CHOICE_FUNCTION))
        return true;
    if (kvs_tool_constraint(r->tools, r->tool_choice, r->tool_choice_name, f, &r->constraint_schema,
                            &r->constraint_prefix, &r->constraint_suffix) == KVS_OK)
        return true;
    return kvs_api_fail(err, 400, "tool_choice", "'tool_choice': %s (serve --tool-call-parser)", kvs_last_error());
}
