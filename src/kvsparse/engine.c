/* kvsparse (the embedding API): options, errors, loading a model folder into
 * an engine that runs on its own thread, and tearing it down. */
#include <stdlib.h>
#include <string.h>

#include "kvsparse/kvsparse_internal.h"

/* the public enums are the engine's, value for value */
_Static_assert((int)KVSPARSE_ERR_BUSY == (int)KVS_ERR_BUSY && (int)KVSPARSE_ERR_IO == (int)KVS_ERR_IO,
               "kvsparse_status follows kvs_status");
_Static_assert((int)KVSPARSE_FINISH_ERROR == (int)KVS_FINISH_ERROR && (int)KVSPARSE_FINISH_STOP == (int)KVS_FINISH_STOP,
               "kvsparse_finish follows kvs_finish");

const char *kvsparse_version(void) { return "0.1.0"; }

const char *kvsparse_last_error(void) { return kvs_last_error(); }

const char *kvsparse_status_name(kvsparse_status s) {
    return s == KVSPARSE_ERR_CLOSED ? "closed" : kvs_status_name((kvs_status)s);
}

void kvsparse_options_init(kvsparse_options *o) {
    memset(o, 0, sizeof *o);
    o->device = "cpu";
    o->kv_policy = "full";
}

/* The engine's policy from the options' names. */
static kvs_status policy_from(const kvsparse_options *o, int n_layers, kvs_kv_policy *p) {
    kvs_policy_kind kind = KVS_POLICY_FULL;
    if (o->kv_policy && kvs_kv_policy_kind_parse(o->kv_policy, &kind) != KVS_OK)
        return kvs_fail(KVS_ERR_INVALID, "kv_policy '%s': not full, snapkv, pyramidkv or streamingllm", o->kv_policy);
    *p = kvs_kv_policy_default(kind);
    if (o->kv_budget && kvs_kv_budget_parse(o->kv_budget, p) != KVS_OK)
        return kvs_fail(KVS_ERR_INVALID, "kv_budget '%s': not a fraction (0.1), a percentage (10%%) or a token count",
                        o->kv_budget);
    if (o->kv_full_layers < 0) return kvs_fail(KVS_ERR_INVALID, "kv_full_layers %d: must be >= 0", o->kv_full_layers);
    p->full_layers = o->kv_full_layers;
    return kvs_kv_policy_validate(p, n_layers);
}

static kvs_status make_backend(const kvsparse_options *o, kvsparse_engine *e) {
    const char *dev = o->device ? o->device : "cpu";
    if (!strcmp(dev, "cpu")) return kvs_backend_cpu_create_typed(o->threads, e->cfg.dtype, e->cfg.dtype, &e->be);
    if (strcmp(dev, "cuda") && strncmp(dev, "cuda:", 5))
        return kvs_fail(KVS_ERR_INVALID, "device '%s': not cpu, cuda or cuda:N", dev);
    char *end = NULL;
    long n = dev[4] == ':' ? strtol(dev + 5, &end, 10) : 0;
    if (dev[4] == ':' && (end == dev + 5 || *end || n < 0 || n > 1023))
        return kvs_fail(KVS_ERR_INVALID, "device '%s': N in cuda:N must be a GPU's number", dev);
    kvs_cuda_options co = {.device = (int)n};
    return kvs_backend_cuda_create(&co, &e->be);
}

static kvs_status load(const char *model_dir, const kvsparse_options *o, kvsparse_engine *e) {
    if (!model_dir || !*model_dir) return kvs_fail(KVS_ERR_INVALID, "no model folder given");
    if (o->kv_memory_gib < 0 || o->max_num_seqs < 0 || o->max_model_len < 0 || o->threads < 0)
        return kvs_fail(KVS_ERR_INVALID, "options: kv_memory_gib, max_num_seqs, max_model_len and threads must be >= 0");
    KVS_TRY(kvs_config_load(model_dir, &e->cfg));
    kvs_generation_config g;
    KVS_TRY(kvs_generation_config_load(model_dir, &g));
    e->sampling = kvs_sampling_default();
    e->max_tokens = 64;
    kvs_sampling_apply(&g, &e->sampling, &e->max_tokens);
    kvs_engine_config c = kvs_engine_config_default();
    KVS_TRY(policy_from(o, e->cfg.n_layers, &c.default_policy));
    KVS_TRY(kvs_checkpoint_open(model_dir, &e->cfg, &e->ck));
    char path[4096];
    KVS_TRY(kvs_path_join(path, sizeof path, model_dir, "tokenizer.json"));
    if (!kvs_gguf_is_path(model_dir) && !kvs_file_exists(path)) /* a GGUF file's: tokenizer.ggml.* */
        return kvs_fail(KVS_ERR_NOT_FOUND, "%s: no tokenizer.json (the embedding API takes text prompts)", model_dir);
    KVS_TRY(kvs_tokenizer_load(model_dir, &e->tok));
    const char *src = kvs_tokenizer_chat_template(e->tok);
    if (!src) src = kvs_chat_template_default();
    if (kvs_chat_template_compile(src, strlen(src), &e->tpl) != KVS_OK)
        return kvs_fail(KVS_ERR_FORMAT, "%s: the chat template: %s", model_dir, kvs_last_error());
    KVS_TRY(make_backend(o, e));
    KVS_TRY(kvs_runner_create(&e->cfg, e->ck, 1, &e->be, NULL, -1, NULL, &e->runner));
    if (o->max_num_seqs) c.max_num_seqs = o->max_num_seqs;
    if (o->max_model_len) c.max_model_len = o->max_model_len;
    if (o->kv_memory_gib > 0) c.kv_memory_bytes = (size_t)(o->kv_memory_gib * (1u << 30));
    KVS_TRY(kvs_engine_create_runner(e->runner, e->tok, &c, &e->engine));
    return kvs_engine_start(e->engine);
}

kvsparse_status kvsparse_create(const char *model_dir, const kvsparse_options *o, kvsparse_engine **out) {
    kvsparse_options defaults;
    if (!o) kvsparse_options_init(&defaults), o = &defaults;
    if (!out) return kvsparse_from(kvs_fail(KVS_ERR_INVALID, "kvsparse_create: out is NULL"));
    *out = NULL;
    if (o->quiet) kvs_log_set_level(KVS_LOG_WARN);
    kvsparse_engine *e = calloc(1, sizeof *e);
    if (!e) return kvsparse_from(kvs_fail(KVS_ERR_NOMEM, "out of memory"));
    kvs_status st = load(model_dir, o, e);
    if (st != KVS_OK) {
        kvsparse_destroy(e);
        return kvsparse_from(st);
    }
    *out = e;
    return KVSPARSE_OK;
}

void kvsparse_destroy(kvsparse_engine *e) {
    if (!e) return;
    kvs_engine_destroy(e->engine); /* stops its thread: every request still running ends (ABORT) */
    kvs_runner_destroy(e->runner);
    kvs_checkpoint_destroy(e->ck);
    kvs_chat_template_destroy(e->tpl);
    if (e->tok) kvs_tokenizer_destroy(e->tok);
    if (e->be) e->be->destroy(e->be);
    free(e);
}
