/* A batch of KV events as vLLM's KVEventBatch in MessagePack (kv_events.h),
 * written with msgpack-c. */
#include <msgpack.h>
#include <stdlib.h>
#include <string.h>

#include "events/kv_events.h"

static void pack_str(msgpack_packer *pk, const char *s) {
    size_t n = strlen(s);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

/* Events [i, j) that go into one vLLM event from i: a stored block's chain
 * (each the next one's parent), or a run of removals; a clear alone. */
static int run_end(const kvs_kv_event_log *log, int i) {
    const kvs_kv_event *e = log->events;
    int j = i + 1;
    if (e[i].kind == KVS_KV_EVENT_STORED)
        while (j < log->n && e[j].kind == KVS_KV_EVENT_STORED && e[j].has_parent && e[j].parent_hash == e[j - 1].hash) j++;
    else if (e[i].kind == KVS_KV_EVENT_REMOVED)
        while (j < log->n && e[j].kind == KVS_KV_EVENT_REMOVED) j++;
    return j;
}

static void pack_event(msgpack_packer *pk, const kvs_kv_event_log *log, int i, int j, const char *medium) {
    const kvs_kv_event *e = log->events;
    if (e[i].kind == KVS_KV_EVENT_CLEARED) {
        msgpack_pack_array(pk, 1);
        pack_str(pk, "AllBlocksCleared");
        return;
    }
    bool stored = e[i].kind == KVS_KV_EVENT_STORED;
    msgpack_pack_array(pk, stored ? 7 : 3);
    pack_str(pk, stored ? "BlockStored" : "BlockRemoved");
    msgpack_pack_array(pk, (size_t)(j - i));
    for (int k = i; k < j; k++) msgpack_pack_uint64(pk, e[k].hash);
    if (stored) {
        if (e[i].has_parent) msgpack_pack_uint64(pk, e[i].parent_hash);
        else msgpack_pack_nil(pk);
        int bs = log->block_size;
        msgpack_pack_array(pk, (size_t)(j - i) * (size_t)bs);
        for (int k = i; k < j; k++)
            for (int t = 0; t < bs; t++) msgpack_pack_int32(pk, log->tokens[e[k].token0 + t]);
        msgpack_pack_int32(pk, bs);
        msgpack_pack_nil(pk); /* lora_id: no adapters */
    }
    pack_str(pk, medium);
}

/* msgpack-c's buffer writer, remembering a failed write (out of memory): the
 * packer's calls would otherwise each need checking */
typedef struct {
    msgpack_sbuffer sb;
    bool failed;
} sink;

static int sink_write(void *data, const char *buf, size_t len) {
    sink *s = data;
    if (!s->failed && msgpack_sbuffer_write(&s->sb, buf, len) != 0) s->failed = true;
    return 0;
}

kvs_status kvs_kv_events_encode(const kvs_kv_event_log *log, bool clear_first, const char *medium, double ts,
                                int dp_rank, unsigned char **out, size_t *len) {
    *out = NULL, *len = 0;
    int n_out = clear_first + log->lost;
    for (int i = 0; i < log->n; i = run_end(log, i)) n_out++;
    sink sb = {0};
    msgpack_sbuffer_init(&sb.sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, sink_write);
    msgpack_pack_array(&pk, 3);
    msgpack_pack_double(&pk, ts);
    msgpack_pack_array(&pk, (size_t)n_out);
    if (clear_first) msgpack_pack_array(&pk, 1), pack_str(&pk, "AllBlocksCleared");
    for (int i = 0, j; i < log->n; i = j) {
        j = run_end(log, i);
        pack_event(&pk, log, i, j, medium);
    }
    if (log->lost) msgpack_pack_array(&pk, 1), pack_str(&pk, "AllBlocksCleared");
    msgpack_pack_int32(&pk, dp_rank);
    if (sb.failed) {
        msgpack_sbuffer_destroy(&sb.sb);
        return kvs_fail(KVS_ERR_NOMEM, "kv events: out of memory");
    }
    *len = sb.sb.size;
    *out = (unsigned char *)msgpack_sbuffer_release(&sb.sb);
    return KVS_OK;
}
