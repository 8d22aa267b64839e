/* libFuzzer target: the KV events' two parsers and writer (events/kv_events.h).
 * Input starting with '{': --kv-events-config's JSON (a config that parses
 * holds what the publisher relies on). Otherwise: an event log made from the
 * bytes is encoded, and the MessagePack read back with msgpack-c must give
 * vLLM's layout with every hash, parent and token of the log, in order. */
#include <assert.h>
#include <msgpack.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "events/kv_events.h"

static uint64_t take_u64(const uint8_t **p, const uint8_t *end) {
    uint64_t v = 0;
    for (int i = 0; i < 8 && *p < end; i++) v = v << 8 | *(*p)++;
    return v;
}

static void check_config(const uint8_t *data, size_t size) {
    char *s = malloc(size + 1);
    if (!s) return;
    memcpy(s, data, size);
    s[size] = 0;
    kvs_kv_events_config c;
    if (kvs_kv_events_config_parse(s, &c) == KVS_OK) {
        assert(c.buffer_steps >= 1 && c.hwm >= 0);
        assert(strlen(c.endpoint) < sizeof c.endpoint && strlen(c.topic) < sizeof c.topic);
        assert(!c.enable || c.endpoint[0]);
    }
    free(s);
}

static bool str_is(const msgpack_object *o, const char *s) {
    return o->type == MSGPACK_OBJECT_STR && o->via.str.size == strlen(s) && !memcmp(o->via.str.ptr, s, o->via.str.size);
}

/* The decoded batch against the log: each vLLM event, its hashes the log's next ones. */
static void check_batch(const msgpack_object *root, const kvs_kv_event_log *log, bool clear_first) {
    assert(root->type == MSGPACK_OBJECT_ARRAY && root->via.array.size == 3);
    const msgpack_object *f = root->via.array.ptr;
    assert(f[0].type == MSGPACK_OBJECT_FLOAT64 && f[1].type == MSGPACK_OBJECT_ARRAY);
    assert(f[2].type == MSGPACK_OBJECT_POSITIVE_INTEGER && f[2].via.u64 == 0);
    int at = 0; /* the log's next event */
    const msgpack_object_array *evs = &f[1].via.array;
    for (uint32_t k = 0; k < evs->size; k++) {
        const msgpack_object *e = &evs->ptr[k];
        assert(e->type == MSGPACK_OBJECT_ARRAY && e->via.array.size >= 1);
        const msgpack_object *x = e->via.array.ptr;
        if (str_is(&x[0], "AllBlocksCleared")) {
            assert(e->via.array.size == 1);
            if (clear_first && k == 0) continue;
            if (at < log->n) assert(log->events[at++].kind == KVS_KV_EVENT_CLEARED);
            else assert(log->lost && k + 1 == evs->size);
            continue;
        }
        bool stored = str_is(&x[0], "BlockStored");
        assert(stored || str_is(&x[0], "BlockRemoved"));
        assert(e->via.array.size == (stored ? 7u : 3u) && x[1].type == MSGPACK_OBJECT_ARRAY && x[1].via.array.size >= 1);
        assert(str_is(&x[e->via.array.size - 1], "CPU"));
        const msgpack_object_array *h = &x[1].via.array;
        for (uint32_t i = 0; i < h->size; i++, at++) {
            assert(at < log->n);
            const kvs_kv_event *le = &log->events[at];
            assert(le->kind == (stored ? KVS_KV_EVENT_STORED : KVS_KV_EVENT_REMOVED));
            assert(h->ptr[i].type == MSGPACK_OBJECT_POSITIVE_INTEGER && h->ptr[i].via.u64 == le->hash);
            if (!stored) continue;
            if (i == 0 && le->has_parent) assert(x[2].type == MSGPACK_OBJECT_POSITIVE_INTEGER && x[2].via.u64 == le->parent_hash);
            else if (i == 0) assert(x[2].type == MSGPACK_OBJECT_NIL);
            else assert(le->has_parent && le->parent_hash == log->events[at - 1].hash);
            const msgpack_object_array *t = &x[3].via.array;
            assert(x[3].type == MSGPACK_OBJECT_ARRAY && t->size == h->size * (uint32_t)log->block_size);
            for (int j = 0; j < log->block_size; j++) {
                const msgpack_object *v = &t->ptr[i * log->block_size + j];
                int64_t tok = v->type == MSGPACK_OBJECT_POSITIVE_INTEGER ? (int64_t)v->via.u64 : v->via.i64;
                assert(tok == log->tokens[le->token0 + j]);
            }
        }
        if (stored) assert(x[4].via.u64 == (uint64_t)log->block_size && x[5].type == MSGPACK_OBJECT_NIL);
    }
    assert(at == log->n);
}

static void check_encoder(const uint8_t *data, size_t size) {
    const uint8_t *p = data, *end = data + size;
    kvs_kv_event_log log = {.block_size = 1 + (p < end ? *p++ % 32 : 0)};
    bool clear_first = p < end && (*p++ & 1);
    log.lost = p < end && (*p++ & 1);
    kvs_kv_event ev[64];
    int32_t tokens[64 * 32];
    log.events = ev, log.tokens = tokens;
    while (p < end && log.n < 64) {
        uint8_t kind = *p++ % 3;
        kvs_kv_event e = {.kind = kind == 0 ? KVS_KV_EVENT_STORED : kind == 1 ? KVS_KV_EVENT_REMOVED : KVS_KV_EVENT_CLEARED};
        e.hash = take_u64(&p, end);
        if (e.kind == KVS_KV_EVENT_STORED) {
            /* a chain most of the time (the parent the hash before), as the manager logs them */
            uint8_t how = p < end ? *p++ : 0;
            e.has_parent = how % 4 != 0;
            e.parent_hash = how % 4 == 1 || log.n == 0 ? take_u64(&p, end) : log.events[log.n - 1].hash;
            e.token0 = log.n_tokens;
            for (int j = 0; j < log.block_size; j++) {
                uint64_t t = take_u64(&p, end);
                tokens[log.n_tokens++] = (int32_t)(uint32_t)t;
            }
        }
        ev[log.n++] = e;
    }
    unsigned char *out;
    size_t len;
    if (kvs_kv_events_encode(&log, clear_first, "CPU", 1.7e9, 0, &out, &len) != KVS_OK) return;
    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    size_t off = 0;
    assert(msgpack_unpack_next(&u, (const char *)out, len, &off) == MSGPACK_UNPACK_SUCCESS && off == len);
    check_batch(&u.data, &log, clear_first);
    msgpack_unpacked_destroy(&u);
    free(out);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size > 0 && data[0] == '{') check_config(data, size);
    else check_encoder(data, size);
    return 0;
}
