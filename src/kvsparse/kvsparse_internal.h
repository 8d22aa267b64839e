/* kvsparse (the embedding API): what engine.c and request.c share. */
#ifndef KVSPARSE_INTERNAL_H
#define KVSPARSE_INTERNAL_H

#include "backend/backend.h"
#include "engine/engine.h"
#include "kvsparse/kvsparse.h"
#include "model/model.h"
#include "runner/runner.h"
#include "template/template.h"
#include "tokenizer/tokenizer.h"

struct kvsparse_engine {
    kvs_config cfg;
    kvs_checkpoint *ck;
    kvs_backend *be;
    kvs_runner *runner;
    kvs_tokenizer *tok;
    kvs_chat_template *tpl; /* the model's chat template (or the default one) */
    kvs_engine *engine;
    /* a request's defaults: the built-in ones under the model's generation_config.json */
    kvs_sampling_params sampling;
    int max_tokens;
};

/* A kvs_status as the public enum (same values; OK stays 0). */
static inline kvsparse_status kvsparse_from(kvs_status s) { return (kvsparse_status)s; }

#endif
