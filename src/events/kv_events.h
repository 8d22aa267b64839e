/* events: the KV manager's prefix-cache events (kv.h, "KV events") published
 * the way vLLM's --kv-events-config does, for the routers that read them
 * (llm-d's precise prefix-cache scorer, NVIDIA Dynamo's KV router):
 *   - a ZeroMQ PUB socket; each message is [topic, seq as 8 bytes big-endian,
 *     payload], seq counting the batches from 0 without gaps;
 *   - the payload MessagePack in vLLM's array layout: [ts, [events...], dp_rank]
 *     with ["BlockStored", hashes, parent hash or nil, token_ids, block_size,
 *     lora_id (nil), medium], ["BlockRemoved", hashes, medium], ["AllBlocksCleared"];
 *   - an optional ROUTER replay socket: a client sends [empty, first seq it
 *     missed (8 bytes)] and gets [empty, seq, payload] for every buffered
 *     batch from there, then [empty, -1 as 8 bytes, empty].
 * docs/SERVING.md says what the events mean under sparsity. */
#ifndef KVS_KV_EVENTS_H
#define KVS_KV_EVENTS_H

#include <stddef.h>

#include "core/core.h"
#include "kv/kv.h"

/* vLLM's KVEventsConfig, as its JSON names it. */
typedef struct {
    bool enable;             /* enable_kv_cache_events */
    char endpoint[256];      /* the PUB socket (bound; default vLLM's: port 5557 on every interface) */
    char replay_endpoint[256]; /* the ROUTER replay socket; "" for none */
    int buffer_steps;        /* batches kept for replay (default 10,000) */
    int hwm;                 /* the PUB socket's send high-water mark (default 100,000) */
    char topic[256];         /* the first frame of every message (default "") */
} kvs_kv_events_config;

kvs_kv_events_config kvs_kv_events_config_default(void);
/* Parses --kv-events-config's JSON over the defaults; an unknown key, a wrong
 * type or an unsupported publisher is an error that names it. */
kvs_status kvs_kv_events_config_parse(const char *json, kvs_kv_events_config *out);

/* One batch's payload: the events in order, consecutive stored blocks of one
 * chain in one BlockStored and consecutive removals in one BlockRemoved;
 * clear_first puts AllBlocksCleared before them and log->lost one after.
 * medium: "GPU" or "CPU". Into a malloc'd *out of *len bytes. */
kvs_status kvs_kv_events_encode(const kvs_kv_event_log *log, bool clear_first, const char *medium, double ts,
                                int dp_rank, unsigned char **out, size_t *len);

typedef struct kvs_kv_event_publisher kvs_kv_event_publisher;
/* Binds the sockets (an endpoint in use is an error naming it). */
kvs_status kvs_kv_event_publisher_create(const kvs_kv_events_config *cfg, const char *medium,
                                         kvs_kv_event_publisher **out);
/* Publishes one batch (the engine's on_kv_events: user is the publisher).
 * Never blocks: a slow subscriber loses messages (it sees the gap in seq and
 * replays them); a batch that cannot be encoded makes the next start with
 * AllBlocksCleared. */
void kvs_kv_event_publisher_publish(void *user, const kvs_kv_event_log *log);
/* The batches published so far (the next seq). */
uint64_t kvs_kv_event_publisher_batches(kvs_kv_event_publisher *p);
void kvs_kv_event_publisher_destroy(kvs_kv_event_publisher *p);

#endif
