/* kvsparse convert: a model as a GGUF file (cmd_convert.c; the tokenizer's
 * metadata in convert_vocab.c). */
#ifndef KVS_CLI_CONVERT_H
#define KVS_CLI_CONVERT_H

#include "gguf/gguf.h"
#include "model/model.h"

/* The tokenizer of model (a folder's tokenizer.json and tokenizer_config.json,
 * or a .gguf's tokenizer.* keys) as tokenizer.ggml.* metadata, as llama.cpp's
 * convert_hf_to_gguf.py writes a byte-level BPE vocabulary: model gpt2, pre
 * (llama-bpe or qwen2 from the pre-tokenizer's regex), tokens padded to the
 * config's vocab_size, token_type, merges, bos / eos (and the config's other
 * end-of-generation id as eot), add_bos_token, and tokenizer.chat_template.
 * *wrote false when model has no tokenizer (a config alone, dummy weights). */
kvs_status kvs_convert_vocab(kvs_gguf_writer *w, const char *model, const kvs_config *cfg, bool *wrote);

#endif
