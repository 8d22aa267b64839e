/* Shared by the subcommands: loading a model from command-line options. */
#ifndef KVS_CLI_COMMON_H
#define KVS_CLI_COMMON_H

#include "backend/backend.h"
#include "kv/kv.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"

typedef struct {
    const char *model_dir;   /* -m */
    const char *config_path; /* --config (with --load-format dummy) */
    bool dummy;              /* --load-format dummy */
    uint64_t dummy_seed;
    int threads;             /* --threads */
    bool skip_model;         /* load config, checkpoint and backend only */
} kvs_load_options;

typedef struct {
    kvs_config cfg;
    kvs_checkpoint *ck;
    kvs_backend *be;
    kvs_model *model;
    kvs_tokenizer *tok; /* NULL when the folder has no tokenizer.json */
} kvs_loaded;

/* Handles -m, --config, --load-format, --threads at argv[*i]; advances *i.
 * Returns 1 if consumed, 0 if not one of these, -1 on a bad value. */
int kvs_cli_load_option(kvs_load_options *o, int argc, char **argv, int *i);
kvs_status kvs_cli_load(const kvs_load_options *o, kvs_loaded *out);
void kvs_cli_unload(kvs_loaded *l);

/* A KV cache for the model holding max_tokens tokens per sequence for max_seqs sequences. */
kvs_status kvs_cli_kv_cache(const kvs_loaded *l, int max_tokens, int max_seqs, kvs_kv_cache **out);

/* "1,2,3" -> ids (malloc'ed); false on a malformed list. */
bool kvs_cli_parse_ids(const char *s, int32_t **ids, int *n);
/* Prints "kvsparse: <last error>" on stderr; returns 1. */
int kvs_cli_error(void);

#endif
