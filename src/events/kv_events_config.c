/* --kv-events-config: vLLM's KVEventsConfig JSON (kv_events.h). */
#include <jansson.h>
#include <string.h>

#include "events/kv_events.h"

kvs_kv_events_config kvs_kv_events_config_default(void) {
    kvs_kv_events_config c = {.enable = false, .buffer_steps = 10000, .hwm = 100000};
    strcpy(c.endpoint, "tcp://*:5557");
    return c;
}

static kvs_status copy_str(json_t *v, const char *key, char *dst, size_t cap) {
    if (json_is_null(v) && !strcmp(key, "replay_endpoint")) return (void)(dst[0] = 0), KVS_OK;
    if (!json_is_string(v)) return kvs_fail(KVS_ERR_INVALID, "--kv-events-config: \"%s\" must be a string", key);
    if (json_string_length(v) >= cap || strlen(json_string_value(v)) != json_string_length(v))
        return kvs_fail(KVS_ERR_INVALID, "--kv-events-config: \"%s\" is too long or holds a NUL", key);
    memcpy(dst, json_string_value(v), json_string_length(v) + 1);
    return KVS_OK;
}

static kvs_status copy_int(json_t *v, const char *key, int min, int *dst) {
    if (!json_is_integer(v) || json_integer_value(v) < min || json_integer_value(v) > 1000000000)
        return kvs_fail(KVS_ERR_INVALID, "--kv-events-config: \"%s\" must be an integer from %d to 1000000000", key, min);
    *dst = (int)json_integer_value(v);
    return KVS_OK;
}

static kvs_status parse_key(const char *key, json_t *v, kvs_kv_events_config *c) {
    if (!strcmp(key, "enable_kv_cache_events")) {
        if (!json_is_boolean(v)) return kvs_fail(KVS_ERR_INVALID, "--kv-events-config: \"%s\" must be true or false", key);
        c->enable = json_is_true(v);
        return KVS_OK;
    }
    if (!strcmp(key, "publisher")) {
        char pub[16];
        KVS_TRY(copy_str(v, key, pub, sizeof pub));
        if (!strcmp(pub, "null")) c->enable = false; /* vLLM's publisher that drops everything */
        else if (strcmp(pub, "zmq"))
            return kvs_fail(KVS_ERR_UNSUPPORTED, "--kv-events-config: publisher \"%s\": only \"zmq\" (or \"null\")", pub);
        return KVS_OK;
    }
    if (!strcmp(key, "endpoint")) return copy_str(v, key, c->endpoint, sizeof c->endpoint);
    if (!strcmp(key, "replay_endpoint")) return copy_str(v, key, c->replay_endpoint, sizeof c->replay_endpoint);
    if (!strcmp(key, "topic")) return copy_str(v, key, c->topic, sizeof c->topic);
    if (!strcmp(key, "buffer_steps")) return copy_int(v, key, 1, &c->buffer_steps);
    if (!strcmp(key, "hwm")) return copy_int(v, key, 0, &c->hwm);
    if (!strcmp(key, "max_queue_size")) { /* vLLM's queue to its publisher thread: batches go out as they come here */
        int ignored;
        return copy_int(v, key, 1, &ignored);
    }
    return kvs_fail(KVS_ERR_INVALID,
                    "--kv-events-config: unknown key \"%s\" (known: enable_kv_cache_events, publisher, endpoint, "
                    "replay_endpoint, buffer_steps, hwm, max_queue_size, topic)", key);
}

kvs_status kvs_kv_events_config_parse(const char *json, kvs_kv_events_config *out) {
    *out = kvs_kv_events_config_default();
    json_error_t err;
    json_t *root = json_loads(json, JSON_REJECT_DUPLICATES, &err);
    if (!root) return kvs_fail(KVS_ERR_INVALID, "--kv-events-config: not JSON: %s (column %d)", err.text, err.column);
    kvs_status st = KVS_OK;
    if (!json_is_object(root)) st = kvs_fail(KVS_ERR_INVALID, "--kv-events-config: must be a JSON object");
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        if (st != KVS_OK) break;
        st = parse_key(key, v, out);
    }
    if (st == KVS_OK && out->enable && !out->endpoint[0])
        st = kvs_fail(KVS_ERR_INVALID, "--kv-events-config: \"endpoint\" is empty");
    json_decref(root);
    return st;
}
