/* server: Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens).
 *
 * No second implementation: a request is mapped onto the chat request
 * (kvs_api_request, KVS_API_CHAT) and goes through the chat validator, the
 * chat template, the grammar of a forced call, the tool-call parser and the
 * engine as chat completions do; only the shapes differ:
 *   system (string or text blocks)     -> a first system message
 *   content blocks text                -> the message's text (blocks joined by "\n")
 *   tool_use (assistant)               -> tool_calls, input as the arguments
 *   tool_result (user)                 -> a tool message (tool_call_id = tool_use_id)
 *   image, document, server tools      -> 400 naming them
 *   tools {name, description, input_schema} -> function tools
 *   tool_choice auto / any / tool / none    -> auto / required / the function / none
 *   stop_sequences                     -> stop
 * The answer (anthropic_response.c): a message with text and tool_use blocks,
 * stop_reason end_turn / max_tokens / stop_sequence / tool_use, usage with
 * cache_read_input_tokens from the prefix cache; streamed as Anthropic's
 * events. docs/SERVING.md lists what is taken and what is refused. */
#ifndef KVS_SERVER_ANTHROPIC_H
#define KVS_SERVER_ANTHROPIC_H

#include "server/server_internal.h"

/* A /v1/messages body (count: a count_tokens body, without max_tokens) into r;
 * false with a 400 naming the field. */
bool kvs_anth_parse_request(const char *body, size_t len, bool count, const kvs_api_limits *lim, kvs_api_request *r,
                            kvs_api_error *err);

/* The whole message for the output text (its calls parsed when m->tools). */
char *kvs_anth_full(const kvs_resp_meta *m, const char *text, size_t n, const kvs_resp_end *end);
/* The stream's events: message_start, content_block_start, ping (first call);
 * the events' deltas; at the end content_block_stop, message_delta,
 * message_stop (or an error event). */
void kvs_anth_stream_events(kvs_api_stream *w, const kvs_tool_events *ev);
void kvs_anth_stream_end(kvs_api_stream *w, const kvs_resp_end *end);
/* "toolu_" + the hex of a parser's "call_..." id (malloc'ed). */
char *kvs_anth_tool_id(const char *call_id);

#endif
