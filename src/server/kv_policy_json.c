/* server: the request field kv_policy (kvsparse's extension) -> kvs_kv_policy. */
#include <jansson.h>
#include <string.h>

#include "server/server_internal.h"

bool kvs_api_parse_policy(json_t *v, const kvs_api_limits *lim, kvs_kv_policy *out, kvs_api_error *err) {
    if (json_is_null(v)) return true;
    if (!json_is_object(v)) return kvs_api_fail(err, 400, "kv_policy", "'kv_policy' must be an object");
    kvs_policy_kind kind = KVS_POLICY_SNAPKV;
    json_t *name = json_object_get(v, "policy");
    if (name) {
        if (!json_is_string(name) || kvs_kv_policy_kind_parse(json_string_value(name), &kind) != KVS_OK)
            return kvs_api_fail(err, 400, "kv_policy.policy",
                                "'kv_policy.policy' must be one of \"full\", \"snapkv\", \"pyramidkv\", \"streamingllm\"");
    }
    kvs_kv_policy p = kvs_kv_policy_default(kind);
    p.profile = lim->kv_profile;
    const char *key;
    json_t *f;
    json_object_foreach(v, key, f) {
        json_int_t x;
        if (!strcmp(key, "policy")) continue;
        if (!strcmp(key, "budget")) {
            if (json_is_integer(f) && json_integer_value(f) >= 1) {
                if (!kvs_api_get_int(f, "kv_policy.budget", 1, 1 << 24, &x, err)) return false;
                p.budget_tokens = (int)x;
                p.budget_fraction = 0;
            } else if (json_is_number(f)) {
                double d = json_number_value(f);
                if (!(d > 0 && d <= 1))
                    return kvs_api_fail(err, 400, "kv_policy.budget",
                                        "'kv_policy.budget' must be a fraction in (0, 1] or a token count >= 1");
                p.budget_tokens = 0;
                p.budget_fraction = (float)d;
            } else if (json_is_string(f)) {
                if (kvs_kv_budget_parse(json_string_value(f), &p) != KVS_OK)
                    return kvs_api_fail(err, 400, "kv_policy.budget", "'kv_policy.budget': %s", kvs_last_error());
            } else {
                return kvs_api_fail(err, 400, "kv_policy.budget", "'kv_policy.budget' must be a number or a string");
            }
        } else if (!strcmp(key, "full_layers")) {
            if (!kvs_api_get_int(f, "kv_policy.full_layers", 0, lim->n_layers, &x, err)) return false;
            p.full_layers = (int)x;
        } else if (!strcmp(key, "window")) { /* one bound: the engine's (it sizes the window buffers) */
            int hi = lim->max_window > 0 && lim->max_window < KVS_KV_MAX_WINDOW ? lim->max_window : KVS_KV_MAX_WINDOW;
            if (!kvs_api_get_int(f, "kv_policy.window", 1, hi, &x, err)) return false;
            p.window = (int)x;
        } else if (!strcmp(key, "pool")) {
            if (!kvs_api_get_int(f, "kv_policy.pool", 1, 1 << 10, &x, err)) return false;
            p.pool = (int)x;
        } else if (!strcmp(key, "sinks")) {
            if (!kvs_api_get_int(f, "kv_policy.sinks", 0, 1 << 16, &x, err)) return false;
            p.sinks = (int)x;
        } else if (!strcmp(key, "min_prompt")) {
            if (!kvs_api_get_int(f, "kv_policy.min_prompt", 0, 1 << 24, &x, err)) return false;
            p.min_prompt = (int)x;
        } else {
            return kvs_api_fail(err, 400, "kv_policy", "unknown field 'kv_policy.%.40s'", key);
        }
    }
    if (kvs_kv_policy_validate(&p, lim->n_layers) != KVS_OK)
        return kvs_api_fail(err, 400, "kv_policy", "'kv_policy': %s", kvs_last_error());
    *out = p;
    return true;
}
