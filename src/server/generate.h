/* server: the generation request's shared state and the SSE stream reader. */
#ifndef KVS_SERVER_GENERATE_H
#define KVS_SERVER_GENERATE_H

#include <sys/types.h>

#include "server/server_internal.h"

/* The state of one streamed response (MHD's content reader's cls). */
typedef struct {
    kvs_server *srv;
    kvs_gen *gen;        /* holds one reference */
    kvs_resp_meta meta;
    char *req_id;        /* meta.id's storage */
    int fd;              /* the client's socket, to notice a disconnect while waiting */
    bool include_usage, role_sent, ended;
    size_t text_offset;
    char *out;           /* formatted bytes not yet handed to MHD */
    size_t out_len, out_off, out_cap;
} kvs_stream;

ssize_t kvs_stream_read(void *cls, uint64_t pos, char *buf, size_t max);
void kvs_stream_free(void *cls);

bool kvs_peer_closed(int fd);
bool kvs_gen_wait(kvs_gen *g, int ms); /* with g->mu held; false on timeout */

/* http.c: a generation request has been answered (drain waits for none left). */
void kvs_server_request_done(kvs_server *s);

#endif
