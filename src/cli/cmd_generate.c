/* kvsparse generate: one prompt, streamed tokens or one JSON object. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "cli/cli_common.h"
#include "engine/engine.h"

typedef struct {
    kvs_load_options load;
    const char *prompt, *prompt_file, *prompt_ids;
    bool chat, json;
    kvs_generation_config set; /* the sampling options given: over the model's defaults */
    bool generation_none;      /* --generation-config none */
    uint64_t seed;
    int max_new;               /* resolved: what -n says, else the model's default, else 64 */
    kvs_sampling_params sp;    /* resolved (resolve_sampling) */
    int32_t stop_ids[16];
    int n_stop_ids;
    bool ignore_eos;
    kvs_kv_policy policy;
} gen_options;

static void usage(FILE *f) {
    fprintf(f, "usage: kvsparse generate -m MODEL_DIR (-p TEXT | -f FILE | --prompt-ids 1,2,3) [options]\n"
               "  -p, --prompt TEXT      the prompt\n"
               "  -f, --prompt-file FILE  the prompt is FILE's text as it is (a long one, or one ending in a newline)\n"
               "  --prompt-ids 1,2,3     the prompt as token ids (a model without tokenizer.json)\n"
               "  -n, --max-tokens N     tokens to generate (default: the model's max_new_tokens, else 64)\n"
               "  --chat                 wrap the prompt as a user message with the chat template\n"
               "  --temperature T        0 = greedy (default: the model's, else 0)\n"
               "  --top-k K              sample among the K most likely tokens (default: the model's, else 0 = all)\n"
               "  --top-p P              among the most likely tokens of total probability P (default: the\n"
               "                         model's, else 1 = all)\n"
               "  --min-p P              drop tokens less likely than P x the most likely (default: the model's,\n"
               "                         else 0 = none)\n"
               "  --seed S               the sampling seed (default 0)\n"
               "  --stop-ids 1,2         extra stop token ids\n"
               "  --ignore-eos           do not stop at the model's end-of-sequence tokens\n"
               "  --json                 print one JSON object instead of streaming text\n"
               KVS_CLI_GENERATION_HELP KVS_CLI_LOAD_HELP KVS_CLI_DEVICE_HELP KVS_CLI_TP_HELP KVS_CLI_POLICY_HELP
               "Text prompts are the operator's: special-token text in them becomes control tokens.\n");
}

static bool parse_float(const char *s, float *out) {
    char *end;
    *out = strtof(s, &end);
    return end != s && !*end;
}

static int parse_args(int argc, char **argv, gen_options *o) {
    memset(o, 0, sizeof *o);
    o->policy = kvs_kv_policy_default(KVS_POLICY_FULL);
    o->load.allow_tp = true;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int r = kvs_cli_load_option(&o->load, argc, argv, &i);
        if (r == 0) r = kvs_cli_policy_option(&o->policy, &o->load.kv_profile, argc, argv, &i);
        if (r == 0) r = kvs_cli_generation_option(&o->generation_none, argc, argv, &i);
        if (r < 0) goto bad;
        if (r > 0) continue;
        bool v = i + 1 < argc;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { usage(stdout); return 0; }
        else if (!strcmp(a, "--chat")) o->chat = true;
        else if (!strcmp(a, "--json")) o->json = true;
        else if (!strcmp(a, "--ignore-eos")) o->ignore_eos = true;
        else if ((!strcmp(a, "-p") || !strcmp(a, "--prompt")) && v) o->prompt = argv[++i];
        else if ((!strcmp(a, "-f") || !strcmp(a, "--prompt-file")) && v) o->prompt_file = argv[++i];
        else if (!strcmp(a, "--prompt-ids") && v) o->prompt_ids = argv[++i];
        else if ((!strcmp(a, "-n") || !strcmp(a, "--max-tokens")) && v) {
            o->set.max_new_tokens = atoi(argv[++i]);
            if (o->set.max_new_tokens <= 0) goto bad;
            o->set.has_max_new_tokens = true;
        } else if (!strcmp(a, "--temperature") && v) {
            if (!parse_float(argv[++i], &o->set.temperature)) goto bad;
            o->set.has_temperature = true;
        } else if (!strcmp(a, "--top-p") && v) {
            if (!parse_float(argv[++i], &o->set.top_p)) goto bad;
            o->set.has_top_p = true;
        } else if (!strcmp(a, "--min-p") && v) {
            if (!parse_float(argv[++i], &o->set.min_p)) goto bad;
            o->set.has_min_p = true;
        } else if (!strcmp(a, "--top-k") && v) {
            o->set.top_k = atoi(argv[++i]);
            o->set.has_top_k = true;
        } else if (!strcmp(a, "--seed") && v) o->seed = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(a, "--stop-ids") && v) {
            int32_t *ids;
            int n;
            if (!kvs_cli_parse_ids(argv[++i], &ids, &n) || n > 16) goto bad;
            memcpy(o->stop_ids, ids, sizeof(int32_t) * n);
            o->n_stop_ids = n;
            free(ids);
        } else goto bad;
        continue;
    bad:
        fprintf(stderr, "kvsparse generate: bad or incomplete option '%s'\n", a);
        usage(stderr);
        return 2;
    }
    if (!!o->prompt + !!o->prompt_file + !!o->prompt_ids != 1) {
        fprintf(stderr, "kvsparse generate: give exactly one of -p TEXT, -f FILE or --prompt-ids IDS\n");
        return 2;
    }
    return -1; /* go on */
}

/* The sampling and max tokens: the built-in ones (greedy, 64), the model's
 * generation_config.json over them (--generation-config auto), the options
 * given over both. */
static kvs_status resolve_sampling(gen_options *o) {
    kvs_generation_config file;
    KVS_TRY(kvs_cli_generation_config(&o->load, o->generation_none, &file));
    o->sp = kvs_sampling_default();
    o->max_new = 64;
    kvs_sampling_apply(&file, &o->sp, &o->max_new);
    kvs_sampling_apply(&o->set, &o->sp, &o->max_new);
    o->sp.seed = o->seed;
    o->sp.has_seed = true; /* --seed S, else 0: generate repeats itself */
    return KVS_OK;
}

/* Turns the options' prompt into ids. */
static kvs_status prompt_to_ids(const gen_options *o, const kvs_loaded *l, int32_t **ids, int *n) {
    if (o->prompt_ids) {
        if (!kvs_cli_parse_ids(o->prompt_ids, ids, n))
            return kvs_fail(KVS_ERR_INVALID, "--prompt-ids: expected comma-separated token ids");
        return KVS_OK;
    }
    if (!l->tok)
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s has no tokenizer.json: use --prompt-ids",
                        o->load.model_dir ? o->load.model_dir : "the model");
    char *text = NULL, *file = NULL;
    size_t file_len = 0;
    const char *prompt = o->prompt;
    if (o->prompt_file) {
        KVS_TRY(kvs_read_file(o->prompt_file, &file, &file_len));
        if (memchr(file, 0, file_len)) {
            free(file);
            return kvs_fail(KVS_ERR_INVALID, "--prompt-file %s: holds a NUL byte, not text", o->prompt_file);
        }
        prompt = file;
    }
    kvs_encode_options eo = {.add_special_tokens = true, .parse_special = true};
    if (o->chat) {
        const char *src = kvs_tokenizer_chat_template(l->tok);
        if (!src) src = kvs_chat_template_default();
        kvs_chat_template *tpl;
        kvs_status st = kvs_chat_template_compile(src, strlen(src), &tpl);
        kvs_chat_message msg = {"user", prompt};
        if (st == KVS_OK) {
            st = kvs_chat_template_render(tpl, &msg, 1, true, kvs_tokenizer_bos_token(l->tok),
                                          kvs_tokenizer_eos_token(l->tok), &text);
            kvs_chat_template_destroy(tpl);
        }
        if (st != KVS_OK) {
            free(file);
            return st;
        }
        eo.add_special_tokens = false; /* the template wrote BOS */
    }
    const char *p = text ? text : prompt;
    kvs_status st = kvs_tokenizer_encode(l->tok, p, strlen(p), eo, ids, n);
    free(text);
    free(file);
    /* a prompt that starts with its own BOS (one formatted for chat already, as the eval
       sets' are) keeps that one: a second would be a context the model never saw */
    int bos = l->cfg.bos_token_id;
    if (st == KVS_OK && eo.add_special_tokens && *n >= 2 && (*ids)[0] == bos && (*ids)[1] == bos)
        memmove(*ids, *ids + 1, sizeof(int32_t) * (size_t)--*n);
    return st;
}

typedef struct {
    int32_t *ids;
    int n;
    const char *finish;
    char error[256];
    double t_start, t_first, t_end;
    double compression; /* KV entries a full cache would hold / entries held, after the prompt */
    bool stream;        /* print the text (or ids without a tokenizer) as it comes */
} gen_result;

static void on_output(void *user, const kvs_request_output *out) {
    gen_result *r = user;
    if (out->n_tokens && r->n == 0) r->t_first = kvs_now(), r->compression = out->prompt_compression;
    for (int i = 0; i < out->n_tokens; i++) r->ids[r->n++] = out->token_ids[i];
    if (r->stream) {
        if (out->text_len) fwrite(out->text, 1, out->text_len, stdout);
        fflush(stdout);
    }
    if (out->finish == KVS_FINISH_NONE) return;
    r->t_end = kvs_now();
    r->finish = kvs_finish_name(out->finish);
    if (out->finish == KVS_FINISH_ERROR) snprintf(r->error, sizeof r->error, "%s", out->error ? out->error : "error");
}

/* Without a tokenizer the stream is the ids, comma-separated. */
static void on_output_ids(void *user, const kvs_request_output *out) {
    gen_result *r = user;
    for (int i = 0; i < out->n_tokens; i++) printf("%s%d", r->n + i > 0 ? "," : "", out->token_ids[i]);
    fflush(stdout);
    r->stream = false;
    on_output(user, out);
    r->stream = true;
}

/* One request through the engine, the server's path: the same sampler, the
 * same stop rules. The whole prompt is one prefill step. */
static kvs_status run(const gen_options *o, kvs_loaded *l, const int32_t *prompt, int n_prompt, gen_result *r) {
    int max_new = o->max_new, room = kvs_runner_limits(l->runner).max_len - n_prompt;
    if (!o->set.has_max_new_tokens && max_new > room && room > 0) max_new = room; /* a default: capped by the context */
    kvs_engine_config c = kvs_engine_config_default();
    c.max_num_seqs = 1;
    /* the whole prompt one prefill step, within the step buffers the model was made for */
    int step_cap = kvs_runner_limits(l->runner).max_tokens;
    c.max_num_batched_tokens = n_prompt < step_cap ? n_prompt : step_cap;
    c.max_waiting = 1;
    c.default_policy = o->policy;
    c.kv_memory_bytes = kvs_cli_kv_bytes_for(l, &o->policy, c.enable_prefix_caching, n_prompt, max_new, 1);
    kvs_request_params p = {.prompt_ids = prompt, .n_prompt = n_prompt, .sampling = o->sp, .max_tokens = max_new,
                            .stop_ids = o->stop_ids, .n_stop_ids = o->n_stop_ids, .ignore_eos = o->ignore_eos};
    r->ids = malloc(sizeof(int32_t) * max_new);
    r->stream = !o->json;
    if (!r->ids) return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    kvs_engine *e;
    KVS_TRY(kvs_cli_engine(l, &c, &e));
    r->t_start = kvs_now();
    kvs_status st = kvs_engine_submit(e, &p, l->tok || o->json ? on_output : on_output_ids, r, NULL);
    bool submitted = st == KVS_OK;
    while (st == KVS_OK && !kvs_engine_idle(e)) st = kvs_engine_step(e);
    kvs_engine_destroy(e);
    if (submitted && !o->json) printf("\n");
    if (st == KVS_OK && r->error[0]) st = kvs_fail(KVS_ERR_INTERNAL, "%s", r->error);
    return st;
}

static void print_json(const gen_options *o, const kvs_loaded *l, const int32_t *prompt, int n_prompt,
                       const gen_result *r) {
    json_t *root = json_object(), *pids = json_array(), *gids = json_array();
    for (int i = 0; i < n_prompt; i++) json_array_append_new(pids, json_integer(prompt[i]));
    for (int i = 0; i < r->n; i++) json_array_append_new(gids, json_integer(r->ids[i]));
    json_object_set_new(root, "prompt_ids", pids);
    json_object_set_new(root, "generated_ids", gids);
    char *text = NULL;
    size_t text_len;
    if (l->tok && kvs_tokenizer_decode(l->tok, r->ids, r->n, true, &text, &text_len) == KVS_OK)
        json_object_set_new(root, "text", json_stringn(text, text_len));
    else
        json_object_set_new(root, "text", json_null());
    free(text);
    json_object_set_new(root, "finish_reason", json_string(r->finish));
    char policy[96];
    kvs_kv_policy_describe(&o->policy, policy, sizeof policy);
    json_object_set_new(root, "kv_policy", json_string(policy));
    json_object_set_new(root, "kv_compression_ratio", json_real(r->compression));
    int n_decoded = r->n > 0 ? r->n - 1 : 0; /* the first token comes from the prefill */
    double t_prefill = r->t_first - r->t_start, t_decode = r->t_end - r->t_first;
    json_object_set_new(root, "timings",
                        json_pack("{s:f, s:f, s:f, s:f}", "prefill_s", t_prefill, "decode_s", t_decode,
                                  "prefill_tokens_per_s", t_prefill > 0 ? n_prompt / t_prefill : 0.0,
                                  "decode_tokens_per_s", t_decode > 0 ? n_decoded / t_decode : 0.0));
    char *s = json_dumps(root, JSON_COMPACT);
    printf("%s\n", s);
    free(s);
    json_decref(root);
}

int kvs_cmd_generate(int argc, char **argv) {
    gen_options o;
    int rc = parse_args(argc, argv, &o);
    if (rc >= 0) return rc;
    if (resolve_sampling(&o) != KVS_OK) return kvs_cli_error();
    if (kvs_sampling_validate(&o.sp) != KVS_OK) { /* before the model loads: a usage error */
        fprintf(stderr, "kvsparse generate: %s\n", kvs_last_error());
        return 2;
    }
    kvs_loaded l;
    if (kvs_cli_load(&o.load, &l) != KVS_OK) return kvs_cli_error();
    o.policy.profile = l.kv_profile;
    int32_t *prompt = NULL;
    int n_prompt = 0;
    gen_result r = {0};
    kvs_status st = prompt_to_ids(&o, &l, &prompt, &n_prompt);
    if (st == KVS_OK) st = run(&o, &l, prompt, n_prompt, &r);
    if (st == KVS_OK && o.json) print_json(&o, &l, prompt, n_prompt, &r);
    free(prompt);
    free(r.ids);
    kvs_cli_unload(&l);
    return st == KVS_OK ? 0 : kvs_cli_error();
}
