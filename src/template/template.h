/* template: chat templates, the Jinja subset that tokenizer_config.json's
 * chat_template is written in (transformers' apply_chat_template semantics). */
#ifndef KVS_TEMPLATE_H
#define KVS_TEMPLATE_H

#include "core/core.h"

/* A message; the fields after content are optional (NULL: the message's dict
 * has no such key). */
typedef struct {
    const char *role;         /* "system", "user", "assistant", "tool", ... */
    const char *content;      /* NULL: None */
    const char *tool_calls;   /* an assistant's calls, JSON text: [{"id", "type", "function": {"name",
                                 "arguments": {...}}}] (arguments as an object, as vLLM gives templates) */
    const char *tool_call_id; /* a tool message's */
    const char *name;
} kvs_chat_message;

typedef struct kvs_chat_template kvs_chat_template;

/* Compiles a Jinja template; errors name the line and column. */
kvs_status kvs_chat_template_compile(const char *source, size_t len, kvs_chat_template **out);
/* Renders messages; *text is malloc'ed. raise_exception() in the template
 * becomes an error with its message. */
kvs_status kvs_chat_template_render(const kvs_chat_template *tpl, const kvs_chat_message *msgs,
                                    int n_msgs, bool add_generation_prompt,
                                    const char *bos_token, const char *eos_token, char **text);
/* The same with the request's tools: JSON text of an array of
 * {"type": "function", "function": {...}} (NULL: tools = None). Bad JSON in
 * tools or a message's tool_calls is an error naming it. */
kvs_status kvs_chat_template_render_tools(const kvs_chat_template *tpl, const kvs_chat_message *msgs, int n_msgs,
                                          const char *tools, bool add_generation_prompt, const char *bos_token,
                                          const char *eos_token, char **text);
void kvs_chat_template_destroy(kvs_chat_template *tpl);
/* What the templates' trim filter and strip()/lstrip()/rstrip() keep of s[0..n)
 * (Python's whitespace: Unicode spaces included): s[*start .. *start + *len). */
void kvs_chat_template_strip(const char *s, size_t n, bool left, bool right, size_t *start, size_t *len);
/* The documented fallback for models without a chat_template (ChatML-like). */
const char *kvs_chat_template_default(void);

#endif
