#include "cli/cli_common.h"

#include "backend/comm.h"
#include "backend/fault.h"
#include "backend/profile.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* --dtype's names (vLLM's): false for "auto" and unknown names. */
static bool parse_dtype(const char *v, kvs_dtype *t) {
    if (!strcmp(v, "float32") || !strcmp(v, "float")) *t = KVS_F32;
    else if (!strcmp(v, "bfloat16")) *t = KVS_BF16;
    else if (!strcmp(v, "float16") || !strcmp(v, "half")) *t = KVS_F16;
    else return false;
    return true;
}

/* --kv-cache-dtype's FP8 names (vLLM's: fp8 is E4M3). */
static bool is_fp8_name(const char *v) { return v && (!strcmp(v, "fp8") || !strcmp(v, "fp8_e4m3")); }

/* The dtype an option asks for (auto: fallback); the CUDA backend keeps bf16,
 * and an FP8 KV cache (--kv-cache-dtype fp8). */
static kvs_status option_dtype(const char *option, const char *v, kvs_dtype fallback, bool cuda, kvs_dtype *t) {
    *t = fallback;
    bool kv = !strcmp(option, "--kv-cache-dtype");
    if (kv && is_fp8_name(v)) {
        *t = KVS_F8_E4M3;
        return KVS_OK;
    }
    if (v && strcmp(v, "auto") && !parse_dtype(v, t))
        return kvs_fail(KVS_ERR_INVALID, "%s %s: not auto, float32, bfloat16 or float16%s", option, v,
                        kv ? " or fp8" : "");
    if (cuda && v && strcmp(v, "auto") && *t != KVS_BF16)
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s %s: the CUDA backend keeps bfloat16%s", option, v,
                        kv ? " or fp8" : " only");
    return KVS_OK;
}

int kvs_cli_load_option(kvs_load_options *o, int argc, char **argv, int *i) {
    const char *a = argv[*i];
    bool has_value = *i + 1 < argc;
    if (!strcmp(a, "-m") || !strcmp(a, "--model")) {
        if (!has_value) return -1;
        o->model_dir = argv[++*i];
    } else if (!strcmp(a, "--config")) {
        if (!has_value) return -1;
        o->config_path = argv[++*i];
    } else if (!strcmp(a, "--load-format")) {
        if (!has_value) return -1;
        const char *v = argv[++*i];
        if (!strcmp(v, "dummy")) o->dummy = true;
        else if (!strcmp(v, "auto") || !strcmp(v, "safetensors")) o->dummy = false;
        else return -1;
    } else if (!strcmp(a, "--threads")) {
        if (!has_value) return -1;
        o->threads = atoi(argv[++*i]);
        if (o->threads <= 0) return -1;
    } else if (!strcmp(a, "--dtype")) {
        if (!has_value) return -1;
        o->dtype = argv[++*i];
        kvs_dtype t;
        if (!parse_dtype(o->dtype, &t) && strcmp(o->dtype, "auto")) return -1;
    } else if (!strcmp(a, "--kv-cache-dtype")) {
        if (!has_value) return -1;
        o->kv_dtype = argv[++*i];
        kvs_dtype t;
        if (!parse_dtype(o->kv_dtype, &t) && strcmp(o->kv_dtype, "auto") && !is_fp8_name(o->kv_dtype)) return -1;
    } else if (!strcmp(a, "--device")) {
        if (!has_value) return -1;
        o->device = argv[++*i];
        if (strcmp(o->device, "cpu") && strcmp(o->device, "cuda") && strncmp(o->device, "cuda:", 5)) return -1;
    } else if (!strcmp(a, "--quantization")) {
        if (!has_value) return -1;
        if (kvs_quantization_parse(argv[++*i], &o->quantization) != KVS_OK) {
            fprintf(stderr, "kvsparse: %s\n", kvs_last_error());
            return -1;
        }
    } else if (!strcmp(a, "--enforce-eager")) {
        o->enforce_eager = true;
    } else if (!strcmp(a, "--tensor-parallel-size") || !strcmp(a, "-tp")) {
        if (!has_value) return -1;
        char *end;
        long v = strtol(argv[++*i], &end, 10);
        if (end == argv[*i] || *end || v < 1 || v > 1024) return -1;
        o->tensor_parallel = (int)v;
    } else {
        return 0;
    }
    return 1;
}

static bool parse_int(const char *s, int lo, int hi, int *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (end == s || *end || errno || v < lo || v > hi) return false;
    *out = (int)v;
    return true;
}

int kvs_cli_policy_option(kvs_kv_policy *p, const char **profile_path, int argc, char **argv, int *i) {
    const char *a = argv[*i];
    if (strncmp(a, "--kv-", 5) != 0) return 0;
    if (*i + 1 >= argc) return -1;
    const char *v = argv[*i + 1];
    bool ok;
    const char *want = NULL; /* what a bad value should have been */
    if (!strcmp(a, "--kv-profile")) {
        *profile_path = v;
        ok = *v != 0;
        want = "a profile file (kvsparse calibrate --out)";
    } else if (!strcmp(a, "--kv-policy")) {
        kvs_policy_kind kind;
        ok = kvs_kv_policy_kind_parse(v, &kind) == KVS_OK;
        if (ok) p->kind = kind;
        want = "full, snapkv, pyramidkv or streamingllm";
    } else if (!strcmp(a, "--kv-budget")) {
        ok = kvs_kv_budget_parse(v, p) == KVS_OK;
        want = "a fraction of the prompt (0.1 or 10%) or a number of tokens (256)";
    } else if (!strcmp(a, "--kv-full-layers")) {
        ok = parse_int(v, 0, 100000, &p->full_layers);
        want = "a number of layers, 0 or more";
    } else if (!strcmp(a, "--kv-window")) {
        ok = parse_int(v, 1, 512, &p->window);
        want = "a number of tokens from 1 to 512";
    } else if (!strcmp(a, "--kv-pool")) {
        ok = parse_int(v, 1, 255, &p->pool) && p->pool % 2 == 1;
        want = "an odd number from 1 to 255";
    } else if (!strcmp(a, "--kv-pyramid-beta")) {
        char *end;
        p->pyramid_beta = strtof(v, &end);
        ok = end != v && !*end && p->pyramid_beta >= 1 && p->pyramid_beta <= 1000;
        want = "a number from 1 to 1000";
    } else if (!strcmp(a, "--kv-min-prompt")) {
        ok = parse_int(v, 0, 1 << 30, &p->min_prompt);
        want = "a number of tokens, 0 or more";
    } else {
        return 0;
    }
    ++*i;
    if (!ok) fprintf(stderr, "kvsparse: bad value '%s' for %s: expected %s\n", v, a, want);
    return ok ? 1 : -1;
}

int kvs_cli_prefix_caching_option(bool *enable, const char *arg) {
    if (strcmp(arg, "--enable-prefix-caching") && strcmp(arg, "--no-enable-prefix-caching")) return 0;
    *enable = !strcmp(arg, "--enable-prefix-caching");
    return 1;
}

int kvs_cli_generation_option(bool *none, int argc, char **argv, int *i) {
    if (strcmp(argv[*i], "--generation-config")) return 0;
    if (*i + 1 >= argc) return -1;
    const char *v = argv[++*i];
    if (strcmp(v, "auto") && strcmp(v, "none")) {
        fprintf(stderr, "kvsparse: --generation-config %s: not auto or none\n", v);
        return -1;
    }
    *none = !strcmp(v, "none");
    return 1;
}

kvs_status kvs_cli_generation_config(const kvs_load_options *o, bool none, kvs_generation_config *g) {
    memset(g, 0, sizeof *g);
    if (none || !o->model_dir) return KVS_OK;
    kvs_status st = kvs_generation_config_load(o->model_dir, g);
    if (st == KVS_OK) return KVS_OK;
    char why[600];
    snprintf(why, sizeof why, "%s", kvs_last_error());
    return kvs_fail(st, "%s (--generation-config none leaves the file's sampling fields out)", why);
}

/* The CUDA backend's options for GPU device: KVSPARSE_FP8_GEMM (a benchmarking
 * knob, docs/CUDA.md "FP8") picks matmul_fp8's scaling mode: outer_fast, outer,
 * epilogue_fast or epilogue (unset: auto). */
static kvs_status cuda_options(int device, kvs_dtype kv_dtype, kvs_cuda_options *o) {
    *o = (kvs_cuda_options){.device = device, .kv_fp8 = kv_dtype == KVS_F8_E4M3};
    const char *v = getenv("KVSPARSE_FP8_GEMM");
    if (!v || !*v || !strcmp(v, "auto")) return KVS_OK;
    const char *names[] = {"outer_fast", "outer", "epilogue_fast", "epilogue"};
    const kvs_cuda_fp8_gemm modes[] = {KVS_CUDA_FP8_OUTER_FAST, KVS_CUDA_FP8_OUTER, KVS_CUDA_FP8_EPILOGUE_FAST,
                                       KVS_CUDA_FP8_EPILOGUE};
    for (int i = 0; i < 4; i++)
        if (!strcmp(v, names[i])) {
            o->fp8_gemm = modes[i];
            return KVS_OK;
        }
    return kvs_fail(KVS_ERR_INVALID, "KVSPARSE_FP8_GEMM=%s: not auto, outer_fast, outer, epilogue_fast or epilogue", v);
}

/* --device cuda[:K] --tensor-parallel-size N: CUDA backends on GPUs K .. K+N-1,
 * their NCCL communicators and the group (one thread per GPU). */
static kvs_status load_cuda_ranks(const kvs_load_options *o, kvs_loaded *out, int tp, int device0) {
    int gpus = kvs_comm_gpu_count();
    if (device0 < 0 || device0 + tp > gpus)
        return kvs_fail(KVS_ERR_INVALID,
                        "--tensor-parallel-size %d on %s needs GPUs %d .. %d, but %d GPU%s present%s", tp, o->device,
                        device0, device0 + tp - 1, gpus, gpus == 1 ? " is" : "s are",
                        gpus == 0 ? " (or this kvsparse was built without CUDA and NCCL)" : "");
    out->rank_be = calloc((size_t)tp, sizeof *out->rank_be);
    out->rank_comm = calloc((size_t)tp, sizeof *out->rank_comm);
    if (!out->rank_be || !out->rank_comm) return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    for (int r = 0; r < tp; r++) {
        kvs_cuda_options co;
        KVS_TRY(cuda_options(device0 + r, out->kv_dtype, &co));
        KVS_TRY(kvs_backend_cuda_create(&co, &out->rank_be[r]));
    }
    out->be = out->rank_be[0];
    KVS_TRY(kvs_comm_nccl_create(out->rank_be, tp, out->rank_comm));
    if (o->skip_model) return KVS_OK;
    /* the runner's device check counts from device0: the range was checked above */
    return kvs_runner_create(&out->cfg, out->ck, tp, out->rank_be, out->rank_comm, gpus - device0, &o->limits,
                             &out->runner);
}

/* KVSPARSE_FAULT=step=N,nan-seed=S (tests only, backend/fault.h): the backend
 * wrapped so that forward step N fails and rows of seed S get NaN logits. */
static kvs_status inject_faults(kvs_loaded *out, int tp) {
    const char *text = getenv("KVSPARSE_FAULT");
    if (!text || !*text) return KVS_OK;
    if (tp > 1) return kvs_fail(KVS_ERR_UNSUPPORTED, "KVSPARSE_FAULT: not with --tensor-parallel-size");
    kvs_fault_spec spec;
    KVS_TRY(kvs_fault_parse(text, &spec));
    kvs_backend *wrapped;
    KVS_TRY(kvs_backend_fault_wrap(out->be, &spec, true, &wrapped));
    out->be = wrapped;
    kvs_log(KVS_LOG_WARN, "KVSPARSE_FAULT=%s: injecting faults into the backend (for tests only)", text);
    return KVS_OK;
}

/* bench throughput --profile: the backend wrapped so that its ops are timed
 * (backend/profile.h); one rank only. */
static kvs_status wrap_profile(kvs_loaded *out, bool *graphs) {
    *graphs = out->be->graph_begin != NULL; /* the wrapper has none */
    kvs_backend *wrapped;
    KVS_TRY(kvs_backend_profile_wrap(out->be, true, &wrapped, &out->profile));
    out->be = wrapped;
    return KVS_OK;
}

/* Whether the model has a tokenizer: tokenizer.json in its folder, or a GGUF
 * file's tokenizer.ggml.model (without one it runs with --prompt-ids). */
static bool has_tokenizer(const char *model_dir) {
    if (kvs_gguf_is_path(model_dir)) {
        kvs_gguf *g;
        if (kvs_gguf_open(model_dir, &g) != KVS_OK) return false;
        bool has = kvs_gguf_find(g, "tokenizer.ggml.model") != NULL;
        kvs_gguf_destroy(g);
        return has;
    }
    char path[4096];
    return kvs_path_join(path, sizeof path, model_dir, "tokenizer.json") == KVS_OK && kvs_file_exists(path);
}

kvs_status kvs_cli_load(const kvs_load_options *o, kvs_loaded *out) {
    memset(out, 0, sizeof *out);
    kvs_status st;
    if (o->config_path) {
        char *text = NULL;
        size_t len = 0;
        st = kvs_read_file(o->config_path, &text, &len);
        if (st == KVS_OK) st = kvs_config_parse(text, len, o->config_path, &out->cfg);
        free(text);
        if (st == KVS_OK && !o->dummy)
            st = kvs_fail(KVS_ERR_INVALID, "--config needs --load-format dummy (or use -m MODEL_DIR)");
    } else if (o->model_dir) {
        st = kvs_config_load(o->model_dir, &out->cfg);
    } else {
        st = kvs_fail(KVS_ERR_INVALID, "no model given: use -m MODEL_DIR (or --config FILE --load-format dummy)");
    }
    /* an FP8 checkpoint (quantization_config) is fp8 already; --quantization fp8 on it changes nothing */
    if (st == KVS_OK && o->quantization != KVS_QUANT_NONE) out->cfg.quantization = o->quantization;
    if (st == KVS_OK && o->kv_profile) /* before the weights: a bad profile fails at once */
        st = kvs_kv_profile_load(o->kv_profile, out->cfg.n_layers, &out->kv_profile);
    if (st == KVS_OK)
        st = o->dummy ? kvs_checkpoint_dummy(&out->cfg, o->dummy_seed, &out->ck)
                      : kvs_checkpoint_open(o->model_dir, &out->cfg, &out->ck);
    int tp = o->tensor_parallel > 1 ? o->tensor_parallel : 1;
    out->world = tp;
    if (st == KVS_OK && tp > 1 && !o->allow_tp)
        st = kvs_fail(KVS_ERR_UNSUPPORTED,
                      "--tensor-parallel-size %d: not available in this command yet (serve, generate, eval, "
                      "bench throughput and bench model have it)",
                      tp);
    if (st == KVS_OK && tp > 1) st = kvs_tp_validate(&out->cfg, tp, -1);
    bool cuda = o->device && !strncmp(o->device, "cuda", 4);
    int device0 = cuda && o->device[4] == ':' ? atoi(o->device + 5) : 0;
    /* auto: weights as the checkpoint (config.json's torch_dtype) stores them, and the KV cache in the
       weights' dtype, as vLLM does (on the CPU a bf16 cache halves the bytes decode reads: docs/CPU.md) */
    if (st == KVS_OK) st = option_dtype("--dtype", o->dtype, out->cfg.dtype, cuda, &out->weight_dtype);
    if (st == KVS_OK) st = option_dtype("--kv-cache-dtype", o->kv_dtype, out->weight_dtype, cuda, &out->kv_dtype);
    bool graphs = false; /* --profile: the wrapped backend has graphs */
    if (st == KVS_OK && o->profile && tp > 1)
        st = kvs_fail(KVS_ERR_UNSUPPORTED, "--profile: not with --tensor-parallel-size (one rank only)");
    if (st == KVS_OK && cuda && tp > 1) {
        st = load_cuda_ranks(o, out, tp, device0);
    } else if (st == KVS_OK) {
        kvs_cuda_options co;
        st = cuda ? cuda_options(device0, out->kv_dtype, &co) : KVS_OK;
        if (st == KVS_OK)
            st = cuda ? kvs_backend_cuda_create(&co, &out->be)
                      : kvs_backend_cpu_create_typed(o->threads, out->weight_dtype, out->kv_dtype, &out->be);
        if (st == KVS_OK) st = inject_faults(out, tp);
        if (st == KVS_OK && o->profile) st = wrap_profile(out, &graphs);
        if (st == KVS_OK && !o->skip_model) {
            if (tp > 1) { /* the CPU simulation: --threads split over the ranks */
                int per_rank = o->threads > 0 ? (o->threads + tp - 1) / tp : 0;
                st = kvs_runner_create_cpu(&out->cfg, out->ck, tp, per_rank, out->weight_dtype, out->kv_dtype, &o->limits,
                                           &out->runner);
            } else {
                st = kvs_runner_create(&out->cfg, out->ck, 1, &out->be, NULL, -1, &o->limits, &out->runner);
            }
        }
    }
    if (st == KVS_OK && out->runner) /* --enforce-eager on every rank, CUDA ranks too; --profile: the graphs'
                                        layout run eagerly (a captured op cannot be timed) */
        kvs_runner_set_graph_mode(out->runner, o->enforce_eager ? KVS_GRAPHS_OFF
                                               : graphs         ? KVS_GRAPHS_PADDED
                                                                : KVS_GRAPHS_ON);
    if (st == KVS_OK && o->model_dir && has_tokenizer(o->model_dir)) st = kvs_tokenizer_load(o->model_dir, &out->tok);
    if (st != KVS_OK) kvs_cli_unload(out);
    return st;
}

void kvs_cli_unload(kvs_loaded *l) {
    kvs_runner_destroy(l->runner);
    kvs_checkpoint_destroy(l->ck);
    if (l->tok) kvs_tokenizer_destroy(l->tok);
    if (l->rank_be) { /* CUDA ranks: communicators before their backends */
        for (int r = 0; r < l->world; r++)
            if (l->rank_comm && l->rank_comm[r]) l->rank_comm[r]->destroy(l->rank_comm[r]);
        for (int r = 0; r < l->world; r++)
            if (l->rank_be[r]) l->rank_be[r]->destroy(l->rank_be[r]);
        l->be = NULL;
    }
    free(l->rank_be);
    free(l->rank_comm);
    if (l->be) l->be->destroy(l->be);
    kvs_kv_profile_free(l->kv_profile);
    memset(l, 0, sizeof *l);
}

kvs_status kvs_cli_engine(kvs_loaded *l, const kvs_engine_config *c, kvs_engine **out) {
    return kvs_engine_create_runner(l->runner, l->tok, c, out);
}

bool kvs_cli_parse_ids(const char *s, int32_t **ids, int *n) {
    int cap = 16, count = 0;
    int32_t *v = malloc(sizeof(int32_t) * cap);
    const char *p = s;
    while (v && *p) {
        char *end;
        errno = 0;
        long x = strtol(p, &end, 10);
        if (end == p || errno || x < 0 || x > INT32_MAX) break;
        if (count == cap) {
            int32_t *bigger = realloc(v, sizeof(int32_t) * (cap *= 2));
            if (!bigger) break;
            v = bigger;
        }
        v[count++] = (int32_t)x;
        p = end;
        while (*p == ' ') p++;
        if (*p == ',') {
            p++;
            if (!*p) break;
        } else if (*p) {
            break;
        }
    }
    if (!v || *p || count == 0) {
        free(v);
        return false;
    }
    *ids = v;
    *n = count;
    return true;
}

const char *kvs_cli_last_name(const char *path, char *buf, size_t cap) {
    snprintf(buf, cap, "%s", path ? path : "model");
    size_t n = strlen(buf);
    while (n > 1 && buf[n - 1] == '/') buf[--n] = 0;
    const char *slash = strrchr(buf, '/');
    return slash && slash[1] ? slash + 1 : buf;
}

int kvs_cli_error(void) {
    fprintf(stderr, "kvsparse: %s\n", kvs_last_error());
    return 1;
}
