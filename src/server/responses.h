/* server: OpenAI's Responses API (POST /v1/responses).
 *
 * As with Anthropic's (anthropic.h), a request is mapped onto the chat
 * request and goes through chat's validator, template, grammar, tool-call
 * parser and engine:
 *   instructions                         -> a first system message
 *   input: a string                      -> one user message
 *   input items: messages (input_text / output_text parts), function_call
 *   (an assistant's tool call), function_call_output (a tool message)
 *   tools [{type: function, name, description, parameters, strict}] -> function tools
 *   tool_choice auto / none / required / {type: function, name}
 *   text.format text / json_object / json_schema -> response_format
 *   max_output_tokens                    -> max_tokens
 * Nothing is stored: previous_response_id is refused (400), store is taken
 * and changes nothing. The answer (responses_response.c): a response object
 * with message and function_call output items, status completed or
 * incomplete (max_output_tokens); streamed as the Responses events, each with
 * its sequence_number. docs/SERVING.md lists what is taken and refused. */
#ifndef KVS_SERVER_RESPONSES_H
#define KVS_SERVER_RESPONSES_H

#include "server/server_internal.h"

/* A /v1/responses body into r (r->echo: the fields the response repeats);
 * false with a 400 naming the field. */
bool kvs_rsp_parse_request(const char *body, size_t len, const kvs_api_limits *lim, kvs_api_request *r,
                           kvs_api_error *err);

/* The whole response object; echo: the request's (r->echo). */
char *kvs_rsp_full(const kvs_resp_meta *m, const json_t *echo, long long created, const char *text, size_t n,
                   const kvs_resp_end *end);
/* The stream's events (w->echo set): response.created and .in_progress first,
 * then the output items' events; at the end response.completed (or
 * .incomplete, or .failed). */
void kvs_rsp_stream_events(kvs_api_stream *w, const kvs_tool_events *ev);
void kvs_rsp_stream_end(kvs_api_stream *w, const kvs_resp_end *end);

#endif
