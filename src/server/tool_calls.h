/* server: tool calls in the model's output text (tool_calls.c), the request's
 * tools fields (tools_json.c) and the constraint for forced calls.
 *
 * Formats (vLLM's parser names):
 *   llama3_json  Llama 3.x: {"name": ..., "parameters" | "arguments": {...}}
 *                (after an optional <|python_tag|>), several separated by ';'
 *                or white space; or <|python_tag|>name.call(k="v", ...) (a
 *                built-in tool, to the end of the output). Other text, and
 *                JSON objects that are not calls, are content.
 *   hermes       Hermes / Qwen: <tool_call>{"name": ..., "arguments": {...}}</tool_call>,
 *                several in a row, text around them kept as content.
 * The parser is streaming: fed text deltas, it gives content and call events
 * at once where the text decides them and holds back only what is still
 * undecided (a partial tag, a call's object before its name and arguments
 * begin); finish gives back whatever is held. A call's first event carries
 * its id ("call_...") and function name; its arguments then come in fragments
 * (the model's own JSON text of the value, as written). The same text fed in
 * any pieces gives the same content and calls. */
#ifndef KVS_SERVER_TOOL_CALLS_H
#define KVS_SERVER_TOOL_CALLS_H

#include <stddef.h>
#include <stdint.h>

#include "core/core.h"

typedef enum { KVS_TOOL_FORMAT_NONE, KVS_TOOL_FORMAT_LLAMA3_JSON, KVS_TOOL_FORMAT_HERMES } kvs_tool_format;

/* "llama3_json", "hermes", "none" (NULL for others). */
const char *kvs_tool_format_name(kvs_tool_format f);
/* Those names, and "auto" (*out = NONE, the caller then asks the template); false for others. */
bool kvs_tool_format_parse(const char *name, kvs_tool_format *out);
/* The format a chat template's model writes: <tool_call> or ChatML -> hermes,
 * <|python_tag|>, ipython or Llama 3's headers -> llama3_json, else hermes. */
kvs_tool_format kvs_tool_format_for_template(const char *template_source);

/* One piece of output: content text, or a part of call `call`. */
typedef struct {
    int call;    /* -1: content; else the call's index (0, 1, ... in the response) */
    char *id;    /* a call's first event: "call_..." and the function's name; else NULL */
    char *name;
    char *text;  /* content, or a fragment of the call's arguments (possibly empty) */
    size_t len;
} kvs_tool_event;

typedef struct {
    kvs_tool_event *v;
    int n, cap;
} kvs_tool_events;

void kvs_tool_events_clear(kvs_tool_events *e); /* frees the events' strings; n = 0 */
void kvs_tool_events_free(kvs_tool_events *e);

typedef struct kvs_tool_parser kvs_tool_parser;

/* ids are "call_" + 24 hex digits from id_seed and the call's index. */
kvs_tool_parser *kvs_tool_parser_create(kvs_tool_format f, uint64_t id_seed);
/* Appends the events that text decides to out (merging with its last event). */
kvs_status kvs_tool_parser_feed(kvs_tool_parser *p, const char *text, size_t n, kvs_tool_events *out);
/* The end of the output: what is held back becomes content or a call. */
kvs_status kvs_tool_parser_finish(kvs_tool_parser *p, kvs_tool_events *out);
int kvs_tool_parser_n_calls(const kvs_tool_parser *p);
void kvs_tool_parser_destroy(kvs_tool_parser *p);

/* A whole output: content and complete calls (calls.v[i]: call i, its id, name
 * and all of its arguments as text, len bytes, NUL bytes included). */
typedef struct {
    char *content; /* NUL-terminated, content_len bytes */
    size_t content_len;
    kvs_tool_events calls;
} kvs_tool_result;

/* Adds events to r (content appended, fragments to their calls). */
kvs_status kvs_tool_result_add(kvs_tool_result *r, const kvs_tool_events *e);
/* Parses a whole output. Unlike the stream, which sends a call once its name
 * and arguments begin, it takes only calls whose JSON is complete and valid:
 * the others are content. On valid outputs both give the same. */
kvs_status kvs_tool_parse_text(kvs_tool_format f, uint64_t id_seed, const char *text, size_t n, kvs_tool_result *r);
void kvs_tool_result_free(kvs_tool_result *r);

/* The parser's part for <|python_tag|> text (tool_call_python.c): name.call(k=v, ...)
 * or name(k=v, ...) as the name and the arguments as compact JSON (malloc'ed);
 * false when the text is not such a call. */
bool kvs_tool_python_call(const char *text, size_t len, char **name, char **args);

#endif
