/* server: HTTP helpers shared by http.c and completions.c (libmicrohttpd). */
#ifndef KVS_SERVER_HTTP_H
#define KVS_SERVER_HTTP_H

#include <microhttpd.h>

#include "server/server_internal.h"

/* Queues body (malloc'ed, taken) with status; counts the request. */
enum MHD_Result kvs_http_respond(kvs_server *s, struct MHD_Connection *c, unsigned status, const char *content_type,
                                 char *body);
enum MHD_Result kvs_http_error(kvs_server *s, struct MHD_Connection *c, const kvs_api_error *err);
int kvs_http_conn_fd(struct MHD_Connection *c);
/* Restarts the connection's --http-timeout clock (after the server, not the
 * client, took a while: waiting for tokens). */
void kvs_http_touch(struct MHD_Connection *c, unsigned timeout_s);
/* completions.c: a POST /v1/completions or /v1/chat/completions with its
 * whole body; http11: the client speaks HTTP/1.1 (it may be sent a 1xx). */
enum MHD_Result kvs_http_generate(kvs_server *s, struct MHD_Connection *c, kvs_api_kind kind, const char *body,
                                  size_t len, bool http11);

#endif
