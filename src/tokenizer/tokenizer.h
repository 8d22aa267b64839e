/* tokenizer: Hugging Face tokenizer.json (byte-level BPE and SentencePiece-style
 * BPE), normalizers, pre-tokenizers, added/special tokens, decoders, an
 * incremental (streaming) decoder, and chat messages encoded through a chat
 * template (template/template.h renders them). */
#ifndef KVS_TOKENIZER_H
#define KVS_TOKENIZER_H

#include "core/core.h"
#include "gguf/gguf.h"
#include "template/template.h"

/* ======================= tokenizer.json ===================================== */
typedef struct kvs_tokenizer kvs_tokenizer;

/* Loads model_dir/tokenizer.json (+ tokenizer_config.json and
 * special_tokens_map.json when present); model_dir may be a .gguf file instead. */
kvs_status kvs_tokenizer_load(const char *model_dir, kvs_tokenizer **out);
/* A GGUF file's tokenizer.ggml.* (byte-level BPE or SentencePiece: gguf_vocab.c
 * says what is supported) and tokenizer.chat_template, built as the
 * tokenizer.json they stand for. */
kvs_status kvs_tokenizer_from_gguf(const kvs_gguf *g, kvs_tokenizer **out);
/* The pre-tokenizer split regex (tokenizer.json's Split pattern) that a GGUF
 * tokenizer.ggml.pre name stands for: "llama-bpe", "qwen2"; NULL for others. */
const char *kvs_gguf_pre_split(const char *pre);
/* Parses tokenizer.json text directly (config_json may be NULL): for tests and fuzzing. */
kvs_status kvs_tokenizer_parse(const char *tokenizer_json, size_t len, const char *config_json,
                               size_t config_len, kvs_tokenizer **out);
void kvs_tokenizer_destroy(kvs_tokenizer *t);

typedef struct {
    bool add_special_tokens; /* post-processor (BOS/EOS) */
    bool parse_special;      /* text such as "<|eot_id|>" may become control tokens;
                                must be false for user text from the API */
} kvs_encode_options;

/* Encodes UTF-8 text; *ids is malloc'ed. Invalid UTF-8 is an error. */
kvs_status kvs_tokenizer_encode(const kvs_tokenizer *t, const char *text, size_t len,
                                kvs_encode_options opt, int32_t **ids, int *n_ids);
/* Decodes ids to text: *text is malloc'ed, *len bytes long (it may hold NUL bytes,
 * e.g. a byte-level token for 0x00; a NUL follows the last byte). len may be NULL
 * only where a NUL byte may end the text. Unknown ids add no text. */
kvs_status kvs_tokenizer_decode(const kvs_tokenizer *t, const int32_t *ids, int n_ids,
                                bool skip_special, char **text, size_t *len);

int kvs_tokenizer_vocab_size(const kvs_tokenizer *t);
int kvs_tokenizer_token_id(const kvs_tokenizer *t, const char *token); /* -1 if none */
const char *kvs_tokenizer_token_text(const kvs_tokenizer *t, int id);  /* NULL if none */
bool kvs_tokenizer_is_special(const kvs_tokenizer *t, int id);
/* The raw bytes id decodes to on its own (for constrained decoding): byte-level
 * BPE with the byte-to-unicode map undone, SentencePiece with U+2581 as a space
 * and <0xNN> as its byte; special tokens and unknown ids: none (*len 0). Never
 * longer than kvs_tokenizer_token_text(t, id); a smaller cap fails, with the
 * length needed in *len. */
kvs_status kvs_tokenizer_token_bytes(const kvs_tokenizer *t, int id, char *buf, size_t cap, size_t *len);
int kvs_tokenizer_bos_id(const kvs_tokenizer *t); /* -1 if none */
int kvs_tokenizer_eos_id(const kvs_tokenizer *t); /* -1 if none */
/* tokenizer_config.json's chat_template, bos_token and eos_token strings (NULL if absent). */
const char *kvs_tokenizer_chat_template(const kvs_tokenizer *t);
const char *kvs_tokenizer_bos_token(const kvs_tokenizer *t);
const char *kvs_tokenizer_eos_token(const kvs_tokenizer *t);

/* Streaming decoder: feed one id at a time; each call returns the new text that
 * is complete (never a broken UTF-8 sequence), possibly empty: *len bytes at
 * *piece, NUL bytes included. O(1) per id however long the stream. The pieces
 * and the final flush add up to kvs_tokenizer_decode of the same ids, except
 * where a decoder rewrites text already sent (ByteFallback turning a valid byte
 * run into U+FFFDs when an invalid byte joins it). */
typedef struct kvs_detokenizer kvs_detokenizer;
kvs_detokenizer *kvs_detokenizer_create(const kvs_tokenizer *t, bool skip_special);
/* *piece is owned by the detokenizer, valid until the next call. */
kvs_status kvs_detokenizer_push(kvs_detokenizer *d, int32_t id, const char **piece, size_t *len);
/* Flushes whatever is held back at the end of the stream. */
kvs_status kvs_detokenizer_finish(kvs_detokenizer *d, const char **piece, size_t *len);
void kvs_detokenizer_destroy(kvs_detokenizer *d);

/* ======================= chat messages -> prompt ids ======================= */
/* Renders chat messages with the template and encodes the result: template
 * text may hold control tokens, message contents never do (parse_special is
 * false for them). *ids is malloc'ed. */
kvs_status kvs_tokenizer_encode_chat(const kvs_tokenizer *t, const kvs_chat_template *tpl,
                                     const kvs_chat_message *msgs, int n_msgs, int32_t **ids, int *n_ids);
/* The same with the request's tools (JSON text, template.h; NULL: none). The
 * tools and the messages' tool_calls, tool_call_id and name are refused
 * (KVS_ERR_INVALID) when a string in them holds a special token's text. */
kvs_status kvs_tokenizer_encode_chat_tools(const kvs_tokenizer *t, const kvs_chat_template *tpl,
                                           const kvs_chat_message *msgs, int n_msgs, const char *tools,
                                           int32_t **ids, int *n_ids);

#endif
