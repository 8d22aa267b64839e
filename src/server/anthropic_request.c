/* server: an Anthropic Messages body -> the chat request (see anthropic.h).
 * The shapes Anthropic has and chat has not are checked here, naming
 * Anthropic's fields; then they are written as chat's and parsed by the chat
 * validator (kvs_api_parse_messages, the tools fields, the common fields). */
#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/anthropic.h"

static bool is_type(json_t *block, const char *type) {
    json_t *t = json_object_get(block, "type");
    return json_is_string(t) && !strcmp(json_string_value(t), type);
}

/* Appends text to *acc (joined by "\n"). */
static bool join(json_t **acc, json_t *text) {
    if (!*acc) {
        *acc = json_copy(text);
        return *acc != NULL;
    }
    json_t *both = json_sprintf("%s\n%s", json_string_value(*acc), json_string_value(text));
    if (!both) return false;
    json_decref(*acc);
    *acc = both;
    return true;
}

/* A text block's text: {"type": "text", "text": "..."} (cache_control, citations ignored). */
static bool block_text(json_t *b, const char *param, json_t **acc, kvs_api_error *err) {
    json_t *text = json_object_get(b, "text");
    if (!json_is_string(text)) return kvs_api_fail(err, 400, param, "'%s.text' must be a string", param);
    if (memchr(json_string_value(text), 0, json_string_length(text)))
        return kvs_api_fail(err, 400, param, "'%s.text' must not hold NUL", param);
    return join(acc, text) || kvs_api_fail(err, 500, NULL, "out of memory");
}

/* system: a string or text blocks -> one string. */
static bool parse_system(json_t *v, json_t **out, kvs_api_error *err) {
    if (json_is_null(v)) return true;
    if (json_is_string(v)) return join(out, v) || kvs_api_fail(err, 500, NULL, "out of memory");
    if (!json_is_array(v)) return kvs_api_fail(err, 400, "system", "'system' must be a string or an array of text blocks");
    size_t i;
    json_t *b;
    json_array_foreach(v, i, b) {
        char param[48];
        snprintf(param, sizeof param, "system[%d]", (int)i);
        if (!is_type(b, "text")) return kvs_api_fail(err, 400, param, "'%s' must be a text block", param);
        if (!block_text(b, param, out, err)) return false;
    }
    return true;
}

/* A tool_result's content: a string or text blocks. */
static bool result_text(json_t *c, const char *param, json_t **acc, kvs_api_error *err) {
    if (!c || json_is_null(c)) return true;
    if (json_is_string(c)) return join(acc, c) || kvs_api_fail(err, 500, NULL, "out of memory");
    if (!json_is_array(c)) return kvs_api_fail(err, 400, param, "'%s.content' must be a string or text blocks", param);
    size_t k;
    json_t *b;
    json_array_foreach(c, k, b) {
        char sub[128];
        snprintf(sub, sizeof sub, "%s.content[%d]", param, (int)k);
        if (!is_type(b, "text"))
            return kvs_api_fail(err, 400, sub, "'%s': only text blocks are supported in a tool_result (this model "
                                "reads text only)", sub);
        if (!block_text(b, sub, acc, err)) return false;
    }
    return true;
}

/* One Anthropic message -> chat messages appended to out (a user turn's
 * tool results first, as tool messages, then its text). map[k]: the
 * Anthropic index of chat message k. */
static bool map_message(json_t *m, int i, json_t *out, int *map, kvs_api_error *err) {
    char param[64];
    snprintf(param, sizeof param, "messages[%d]", i);
    json_t *role = json_object_get(m, "role"), *content = json_object_get(m, "content");
    if (!json_is_object(m)) return kvs_api_fail(err, 400, param, "'%s' must be an object", param);
    const char *rs = json_string_value(role);
    if (!rs || (strcmp(rs, "user") && strcmp(rs, "assistant")))
        return kvs_api_fail(err, 400, param, "'%s.role' must be \"user\" or \"assistant\"", param);
    bool user = !strcmp(rs, "user");
    json_t *text = NULL, *calls = json_array();
    bool ok = true, results = false;
    if (json_is_string(content)) {
        ok = join(&text, content) || kvs_api_fail(err, 500, NULL, "out of memory");
    } else if (!json_is_array(content)) {
        ok = kvs_api_fail(err, 400, param, "'%s.content' must be a string or an array of content blocks", param);
    }
    size_t j;
    json_t *b;
    json_array_foreach(json_is_array(content) ? content : NULL, j, b) {
        if (!ok) break;
        char bp[80];
        snprintf(bp, sizeof bp, "%s.content[%d]", param, (int)j);
        const char *type = json_string_value(json_object_get(b, "type"));
        if (!json_is_object(b) || !type) {
            ok = kvs_api_fail(err, 400, bp, "'%s' must be a content block with a 'type'", bp);
        } else if (!strcmp(type, "text")) {
            ok = block_text(b, bp, &text, err);
        } else if (!user && (!strcmp(type, "thinking") || !strcmp(type, "redacted_thinking"))) {
            /* a client may send back thinking blocks; this server writes none, and they are not prompt text */
        } else if (!user && !strcmp(type, "tool_use")) {
            json_t *id = json_object_get(b, "id"), *name = json_object_get(b, "name"), *input = json_object_get(b, "input");
            if (!json_is_string(id) || !json_is_string(name) || (input && !json_is_object(input)))
                ok = kvs_api_fail(err, 400, bp, "'%s' must be {\"type\": \"tool_use\", \"id\", \"name\", \"input\": {...}}", bp);
            else
                json_array_append_new(calls, json_pack("{s:O, s:s, s:{s:O, s:o}}", "id", id, "type", "function",
                                                       "function", "name", name, "arguments",
                                                       input ? json_incref(input) : json_object()));
        } else if (user && !strcmp(type, "tool_result")) {
            json_t *id = json_object_get(b, "tool_use_id"), *is_error = json_object_get(b, "is_error");
            json_t *result = NULL;
            if (!json_is_string(id))
                ok = kvs_api_fail(err, 400, bp, "'%s.tool_use_id' must be a string", bp);
            else if (is_error && !json_is_boolean(is_error))
                ok = kvs_api_fail(err, 400, bp, "'%s.is_error' must be a boolean", bp);
            else
                ok = result_text(json_object_get(b, "content"), bp, &result, err);
            if (ok) {
                results = true;
                json_array_append_new(out, json_pack("{s:s, s:O, s:o}", "role", "tool", "tool_call_id", id, "content",
                                                     result ? result : json_string("")));
                map[json_array_size(out) - 1] = i;
            } else {
                json_decref(result);
            }
        } else if (!strcmp(type, "image") || !strcmp(type, "document")) {
            ok = kvs_api_fail(err, 400, bp, "'%s': %s blocks are not supported (this model reads text only)", bp, type);
        } else {
            ok = kvs_api_fail(err, 400, bp, "'%s': content blocks of type '%.40s' are not supported in %s messages", bp,
                              type, rs);
        }
    }
    if (ok && !(results && !text)) { /* a turn of tool results alone adds no empty user message */
        json_t *msg = json_pack("{s:s, s:o}", "role", rs, "content", text ? text : json_string(""));
        text = NULL;
        if (json_array_size(calls)) json_object_set(msg, "tool_calls", calls);
        json_array_append_new(out, msg);
        map[json_array_size(out) - 1] = i;
    }
    json_decref(text);
    json_decref(calls);
    return ok;
}

static bool parse_messages(json_t *v, json_t *system, const kvs_api_limits *lim, kvs_api_request *r,
                           kvs_api_error *err) {
    if (!json_is_array(v) || json_array_size(v) == 0)
        return kvs_api_fail(err, 400, "messages", "'messages' must be a non-empty array");
    if (json_array_size(v) > 4096) return kvs_api_fail(err, 400, "messages", "'messages' holds at most 4096 messages");
    /* a message maps to at most its blocks + 1 chat messages */
    size_t cap = 2, i;
    json_t *m;
    json_array_foreach(v, i, m) cap += 1 + json_array_size(json_object_get(m, "content"));
    int *map = malloc(sizeof(int) * cap);
    json_t *out = json_array();
    bool ok = map && out;
    if (!ok) kvs_api_fail(err, 500, NULL, "out of memory");
    if (ok && system) {
        json_array_append_new(out, json_pack("{s:s, s:O}", "role", "system", "content", system));
        map[0] = -1;
    }
    json_array_foreach(v, i, m) if (ok) ok = map_message(m, (int)i, out, map, err);
    if (ok && !kvs_api_parse_messages(out, lim, r, err)) { /* name the client's message, not its chat mapping */
        ok = false;
        int k = -1;
        if (sscanf(err->param, "messages[%d]", &k) == 1 && k >= 0 && (size_t)k < json_array_size(out)) {
            char from[32], to[32];
            snprintf(from, sizeof from, "messages[%d]", k);
            if (map[k] < 0) snprintf(to, sizeof to, "system");
            else snprintf(to, sizeof to, "messages[%d]", map[k]);
            kvs_api_error_rename(err, from, to);
        }
    }
    free(map);
    json_decref(out);
    return ok;
}

/* tools: [{name, description, input_schema}] -> chat's function tools. */
static bool parse_tools(json_t *v, kvs_api_request *r, kvs_api_error *err) {
    if (json_is_null(v)) return true;
    if (!json_is_array(v)) return kvs_api_fail(err, 400, "tools", "'tools' must be an array");
    json_t *tools = json_array();
    size_t i;
    json_t *t;
    json_array_foreach(v, i, t) {
        char param[32];
        snprintf(param, sizeof param, "tools[%d]", (int)i);
        json_t *type = json_object_get(t, "type"), *schema = json_object_get(t, "input_schema");
        json_t *desc = json_object_get(t, "description");
        const char *bad = !json_is_object(t) ? "must be {\"name\", \"description\", \"input_schema\"}"
                          : type && !json_is_null(type) && !is_type(t, "custom") ? "is a server tool: only client tools ({\"name\", \"input_schema\"}) are supported"
                          : !json_is_object(schema) ? "needs 'input_schema', a JSON schema object"
                          : NULL;
        if (bad) {
            json_decref(tools);
            return kvs_api_fail(err, 400, param, "'%s' %s", param, bad);
        }
        json_t *fn = json_pack("{s:O, s:O}", "name", json_object_get(t, "name") ? json_object_get(t, "name") : json_null(),
                               "parameters", schema);
        if (desc) json_object_set(fn, "description", desc);
        json_array_append_new(tools, json_pack("{s:s, s:o}", "type", "function", "function", fn));
    }
    bool ok = kvs_api_parse_tools_field("tools", tools, r, err);
    json_decref(tools);
    if (!ok) kvs_api_error_rename(err, ".function", "");
    return ok;
}

/* tool_choice: {"type": auto | any | tool (+ name) | none, "disable_parallel_tool_use"}. */
static bool parse_tool_choice(json_t *v, kvs_api_request *r, kvs_api_error *err) {
    if (json_is_null(v)) return true;
    const char *type = json_string_value(json_object_get(v, "type"));
    json_t *name = json_object_get(v, "name"), *one = json_object_get(v, "disable_parallel_tool_use");
    json_t *chat = !type                ? NULL
                   : !strcmp(type, "auto") ? json_string("auto")
                   : !strcmp(type, "any")  ? json_string("required")
                   : !strcmp(type, "none") ? json_string("none")
                   : !strcmp(type, "tool") && json_is_string(name)
                       ? json_pack("{s:s, s:{s:O}}", "type", "function", "function", "name", name)
                       : NULL;
    if (!json_is_object(v) || !chat || (one && !json_is_boolean(one))) {
        json_decref(chat);
        return kvs_api_fail(err, 400, "tool_choice", "'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"none\"} or "
                            "{\"type\": \"tool\", \"name\": ...}, with an optional boolean 'disable_parallel_tool_use'");
    }
    bool ok = kvs_api_parse_tools_field("tool_choice", chat, r, err);
    json_decref(chat);
    if (json_is_true(one)) r->parallel_tool_calls = false;
    return ok;
}

/* Fields taken and ignored: what Anthropic's clients send that changes nothing here. */
static bool ignored(const char *key, json_t *v, kvs_api_error *err) {
    if (!strcmp(key, "metadata")) return json_is_object(v) || json_is_null(v) ||
                                         kvs_api_fail(err, 400, key, "'metadata' must be an object");
    if (!strcmp(key, "service_tier")) return json_is_string(v) || kvs_api_fail(err, 400, key, "'service_tier' must be a string");
    /* extended thinking: this server writes no thinking blocks, so enabling it changes nothing */
    if (!strcmp(key, "thinking")) return json_is_object(v) || json_is_null(v) ||
                                         kvs_api_fail(err, 400, key, "'thinking' must be an object");
    return kvs_api_fail(err, 400, key, "'%.40s': the field is not supported", key);
}

static bool parse_fields(json_t *root, bool count, const kvs_api_limits *lim, kvs_api_request *r, kvs_api_error *err) {
    const char *key;
    json_t *v, *system = NULL, *messages = NULL;
    bool ok = true;
    json_object_foreach(root, key, v) {
        json_int_t x;
        if (!strcmp(key, "system")) {
            ok = parse_system(v, &system, err);
        } else if (!strcmp(key, "messages")) {
            messages = v; /* after system, whatever their order */
        } else if (!strcmp(key, "max_tokens")) {
            ok = kvs_api_get_int(v, "max_tokens", 1, INT32_MAX, &x, err); /* capped by the context (route.c) */
            r->max_tokens = ok ? (int)(x < lim->max_model_len ? x : lim->max_model_len) : 0;
        } else if (!strcmp(key, "stop_sequences")) {
            ok = json_is_array(v) || json_is_null(v) ||
                 kvs_api_fail(err, 400, key, "'stop_sequences' must be an array of strings");
            ok = ok && kvs_api_parse_stop(v, "stop_sequences", r, err);
        } else if (!strcmp(key, "tools")) {
            ok = parse_tools(v, r, err);
        } else if (!strcmp(key, "tool_choice")) {
            ok = parse_tool_choice(v, r, err);
        } else if (!strcmp(key, "temperature") && json_is_number(v) && json_number_value(v) > 1) {
            ok = kvs_api_fail(err, 400, key, "'temperature' must be in [0, 1], got %g", json_number_value(v));
        } else {
            int common = kvs_api_parse_common_field(key, v, lim, r, err); /* model, stream, top_p, top_k, kv_policy, ... */
            ok = common > 0 || (common < 0 && ignored(key, v, err));
        }
        if (!ok) break;
    }
    if (ok && !messages) ok = kvs_api_fail(err, 400, "messages", "'messages' is required");
    if (ok && !count && !r->max_tokens) ok = kvs_api_fail(err, 400, "max_tokens", "'max_tokens' is required");
    ok = ok && parse_messages(messages, system, lim, r, err) && kvs_api_tools_check(r, err) &&
         kvs_api_check_sampling(&r->sampling, err);
    json_decref(system);
    return ok;
}

bool kvs_anth_parse_request(const char *body, size_t len, bool count, const kvs_api_limits *lim, kvs_api_request *r,
                            kvs_api_error *err) {
    kvs_api_request_init(r, KVS_API_CHAT, lim);
    memset(err, 0, sizeof *err);
    r->dialect = KVS_DIALECT_ANTHROPIC;
    r->max_tokens_param = "max_tokens";
    json_t *root = kvs_api_load_object(body, len, err);
    bool ok = root && parse_fields(root, count, lim, r, err);
    json_decref(root);
    if (!ok) kvs_api_request_free(r);
    return ok;
}
