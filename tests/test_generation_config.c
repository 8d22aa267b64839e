/* A request's defaults from the checkpoint's generation_config.json
 * (--generation-config auto|none): the file's fields and their errors, and
 * serve, generate and the embedding library agreeing on the bundled model
 * (do_sample false: greedy, max_new_tokens 32) and on a copy of it whose file
 * says do_sample true, temperature 0.6. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/engine.h"
#include "kvsparse/kvsparse.h"
#include "model/model.h"
#include "server_client.h"
#include "testutil.h"

TestSuite(generation_config, .timeout = 300);

#define STORY "Once upon a time"

/* ---- the file's fields -------------------------------------------------------- */

static kvs_generation_config parse_ok(const char *text) {
    kvs_generation_config g;
    cr_assert_eq(kvs_generation_config_parse(text, strlen(text), "generation_config.json", &g), KVS_OK, "%s: %s", text,
                 kvs_last_error());
    return g;
}

Test(generation_config, fields_and_do_sample) {
    kvs_generation_config g;
    cr_assert_eq(kvs_generation_config_load(src_path("models/tiny-needle-llama"), &g), KVS_OK, "%s", kvs_last_error());
    cr_expect(g.has_temperature && g.temperature == 0, "do_sample false: greedy");
    cr_expect(g.has_max_new_tokens && g.max_new_tokens == 32);
    cr_expect(!g.has_top_p && !g.has_top_k && !g.has_min_p && !g.has_repetition_penalty);

    g = parse_ok("{\"do_sample\": true, \"temperature\": 0.7, \"top_p\": 0.8, \"top_k\": 20, \"min_p\": 0.05, "
                 "\"repetition_penalty\": 1.05, \"max_new_tokens\": 100, \"eos_token_id\": 2}");
    cr_expect(g.temperature == 0.7f && g.top_p == 0.8f && g.top_k == 20 && g.min_p == 0.05f &&
              g.repetition_penalty == 1.05f && g.max_new_tokens == 100);
    kvs_sampling_params sp = kvs_sampling_default();
    int max_tokens = 64;
    kvs_sampling_apply(&g, &sp, &max_tokens);
    cr_expect(sp.temperature == 0.7f && sp.top_p == 0.8f && sp.top_k == 20 && max_tokens == 100);
    char line[160];
    kvs_sampling_describe(&sp, line, sizeof line);
    cr_expect_str_eq(line, "temperature 0.7, top_p 0.8, top_k 20, min_p 0.05, repetition_penalty 1.05");

    g = parse_ok("{\"do_sample\": true}"); /* transformers' temperature */
    cr_expect(g.has_temperature && g.temperature == 1);
    g = parse_ok("{\"do_sample\": false, \"temperature\": 0.6, \"top_p\": 0.9}"); /* greedy wins, top_p kept */
    cr_expect(g.temperature == 0 && g.has_top_p);
    g = parse_ok("{\"temperature\": 0.6}"); /* no do_sample: the file's temperature, as vLLM */
    cr_expect(g.has_temperature && g.temperature == 0.6f);
    g = parse_ok("{\"temperature\": null, \"top_k\": null, \"bos_token_id\": 1}");
    cr_expect(!kvs_generation_config_any(&g), "null and other fields set nothing");
    cr_expect_eq(kvs_generation_config_load("/nonexistent/model", &g), KVS_OK, "no file: nothing set");
    cr_expect(!kvs_generation_config_any(&g));
}

Test(generation_config, bad_fields_are_refused_naming_them) {
    static const struct {
        const char *text, *field;
    } cases[] = {
        {"{\"temperature\": -0.5}", "'temperature'"},
        {"{\"temperature\": \"0.7\"}", "'temperature'"},
        {"{\"temperature\": 1e40}", "'temperature'"},
        {"{\"top_p\": 0}", "'top_p'"},
        {"{\"top_p\": 1.5}", "'top_p'"},
        {"{\"top_k\": -1}", "'top_k'"},
        {"{\"top_k\": 2.5}", "'top_k'"},
        {"{\"min_p\": 2}", "'min_p'"},
        {"{\"repetition_penalty\": 0}", "'repetition_penalty'"},
        {"{\"max_new_tokens\": 0}", "'max_new_tokens'"},
        {"{\"do_sample\": \"yes\"}", "'do_sample'"},
        {"[1, 2]", "JSON object"},
        {"{\"temperature\": 0.7,}", "not valid JSON"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kvs_generation_config g;
        cr_expect_neq(kvs_generation_config_parse(cases[i].text, strlen(cases[i].text), "generation_config.json", &g),
                      KVS_OK, "%s was accepted", cases[i].text);
        const char *msg = kvs_last_error();
        cr_expect(strstr(msg, "generation_config.json") && strstr(msg, cases[i].field), "%s: '%s'", cases[i].text, msg);
        cr_expect(!kvs_generation_config_any(&g), "a refused file sets nothing");
    }
}

/* ---- model folders ---------------------------------------------------------------- */

/* A temporary copy of the bundled model (its files symlinked) whose
 * generation_config.json is text; the folder's path (static buffer). */
static const char *model_copy(const char *text) {
    const char *dir = make_temp_dir();
    cr_assert(dir);
    const char *src = src_path("models/tiny-needle-llama");
    DIR *d = opendir(src);
    cr_assert(d, "%s", src);
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] == '.' || !strcmp(e->d_name, "generation_config.json")) continue;
        char from[4096], to[4096];
        snprintf(from, sizeof from, "%s/%s", src, e->d_name);
        snprintf(to, sizeof to, "%s/%s", dir, e->d_name);
        cr_assert_eq(symlink(from, to), 0, "symlink %s", to);
    }
    closedir(d);
    write_file(dir, "generation_config.json", text, strlen(text));
    return dir;
}

static void remove_copy(const char *dir) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    cr_expect_eq(system(cmd), 0);
}

/* A completion's token ids (return_token_ids) into ids; how many. */
static int completion_ids(int port, const char *fields, int32_t *ids, int cap) {
    char body[1024];
    snprintf(body, sizeof body, "{\"prompt\": \"" STORY "\", \"ignore_eos\": true, \"return_token_ids\": true%s}",
             fields);
    json_t *j = post_json(port, "/v1/completions", body, 200);
    json_t *arr = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "token_ids");
    int n = (int)json_array_size(arr);
    cr_assert(n > 0 && n <= cap, "%s: %d token_ids", body, n);
    for (int i = 0; i < n; i++) ids[i] = (int32_t)json_integer_value(json_array_get(arr, i));
    json_decref(j);
    return n;
}

static bool same_ids(const int32_t *a, int na, const int32_t *b, int nb) {
    return na == nb && !memcmp(a, b, sizeof(int32_t) * (size_t)na);
}

/* `kvsparse generate --json` on STORY with extra options: the generated ids. */
static int generate_ids(const char *model_dir, const char *extra, int32_t *ids, int cap) {
    char cmd[2048], *out = NULL;
    snprintf(cmd, sizeof cmd, "OMP_WAIT_POLICY=passive '%s' generate -m '%s' --threads 2 -p '" STORY
             "' --ignore-eos --json %s 2>/dev/null", kvsparse_binary(), model_dir, extra);
    cr_assert_eq(run_capture(cmd, &out), 0, "%s: %s", cmd, out);
    json_t *j = json_loads(out, 0, NULL);
    cr_assert(j, "%s: %s", cmd, out);
    json_t *arr = json_object_get(j, "generated_ids");
    int n = (int)json_array_size(arr);
    cr_assert(n > 0 && n <= cap);
    for (int i = 0; i < n; i++) ids[i] = (int32_t)json_integer_value(json_array_get(arr, i));
    json_decref(j);
    free(out);
    return n;
}

static kvsparse_engine *library_open(const char *model_dir) {
    kvsparse_options o;
    kvsparse_options_init(&o);
    o.threads = 2, o.quiet = 1, o.kv_memory_gib = 0.05;
    kvsparse_engine *e = NULL;
    cr_assert_eq(kvsparse_create(model_dir, &o, &e), KVSPARSE_OK, "%s", kvsparse_last_error());
    return e;
}

/* A library request's generated ids. */
static int library_ids(kvsparse_engine *e, const kvsparse_request *r, int32_t *ids, int cap) {
    kvsparse_stream *st;
    cr_assert_eq(kvsparse_submit_stream(e, r, &st), KVSPARSE_OK, "%s", kvsparse_last_error());
    int n = 0;
    kvsparse_output out;
    while (kvsparse_stream_next(st, &out) == KVSPARSE_OK) {
        for (int i = 0; i < out.n_tokens && n < cap; i++) ids[n++] = out.token_ids[i];
        if (out.finish != KVSPARSE_FINISH_NONE) break;
    }
    kvsparse_stream_close(st);
    return n;
}

/* ---- serve -------------------------------------------------------------------- */

/* The user message of a public retrieval prompt (its text between the chat
 * template's user header and end of turn). */
static char *needle_message(const json_t *row) {
    const char *p = json_string_value(json_object_get(row, "prompt"));
    const char *head = "<|end_header_id|>\n\n", *b = strstr(p, head), *e = b ? strstr(b, "<|eot_id|>") : NULL;
    cr_assert(b && e, "unexpected prompt layout");
    b += strlen(head);
    return strndup(b, (size_t)(e - b));
}

/* The failure: chat requests without temperature sampled at 1.0. The
 * bundled model's file is greedy: 5 identical requests, identical answers,
 * those of temperature 0, and max_new_tokens caps them. */
Test(generation_config, serve_is_greedy_for_a_greedy_checkpoint) {
    json_t *rows = load_jsonl(shared_input("eval/retrieval_public.jsonl"));
    server_proc s = start_server(NULL);
    const char *ids[] = {"pub-1000-000", "pub-2000-000"};
    for (int k = 0; k < 2; k++) {
        json_t *row = NULL;
        for (size_t i = 0; i < json_array_size(rows) && !row; i++)
            if (!strcmp(json_string_value(json_object_get(json_array_get(rows, i), "id")), ids[k]))
                row = json_array_get(rows, i);
        cr_assert(row, "%s missing", ids[k]);
        char *msg = needle_message(row);
        json_t *req = json_pack("{s:[{s:s, s:s}]}", "messages", "role", "user", "content", msg);
        char *body = json_dumps(req, JSON_COMPACT), first[512] = "";
        for (int r = 0; r < 5; r++) {
            json_t *j = post_json(s.port, "/v1/chat/completions", body, 200);
            const char *ans = choice_text(j, true);
            cr_expect_leq(usage_of(j, "completion_tokens"), 32, "max_new_tokens is the default max_tokens");
            if (!r) snprintf(first, sizeof first, "%s", ans);
            cr_expect_str_eq(ans, first, "%s: request %d answered '%s', the first '%s'", ids[k], r, ans, first);
            json_decref(j);
        }
        json_object_set_new(req, "temperature", json_real(0));
        free(body);
        body = json_dumps(req, JSON_COMPACT);
        json_t *j = post_json(s.port, "/v1/chat/completions", body, 200);
        cr_expect_str_eq(choice_text(j, true), first, "the default is temperature 0");
        fprintf(stderr, "%s (%d prompt tokens, answer '%s'): '%s' 5 times\n", ids[k], usage_of(j, "prompt_tokens"),
                json_string_value(json_object_get(row, "answer")), first);
        json_decref(j);
        json_decref(req);
        free(body);
        free(msg);
    }
    json_decref(rows);
    cr_expect_eq(stop_server(&s), 0);
}

/* --generation-config none: OpenAI's defaults again (temperature 1, 16 tokens
 * for a completion); auto (the default): the file's 32 tokens. */
Test(generation_config, none_restores_the_builtin_defaults) {
    uint64_t seed = kvs_test_seed() % 2147483647u;
    int32_t a[64], b[64], c[64];
    char fields[160];
    server_proc s = start_server("--generation-config none");
    snprintf(fields, sizeof fields, ", \"seed\": %llu", (unsigned long long)seed);
    int na = completion_ids(s.port, fields, a, 64);
    cr_expect_eq(na, 16, "completions' built-in max_tokens");
    snprintf(fields, sizeof fields, ", \"seed\": %llu, \"temperature\": 1", (unsigned long long)seed);
    int nb = completion_ids(s.port, fields, b, 64);
    cr_expect(same_ids(a, na, b, nb), "without temperature: the draws of temperature 1");
    int nc = completion_ids(s.port, ", \"temperature\": 0, \"max_tokens\": 16", c, 64);
    cr_expect(!same_ids(a, na, c, nc), "not greedy");
    cr_expect_eq(stop_server(&s), 0);

    s = start_server(NULL);
    nb = completion_ids(s.port, "", b, 64);
    cr_expect_eq(nb, 32, "the file's max_new_tokens");
    cr_expect(same_ids(b, 16, c, 16), "greedy");
    cr_expect_eq(stop_server(&s), 0);
}

/* A checkpoint whose file says temperature 0.6 samples at 0.6: serve without
 * temperature draws what temperature 0.6 draws with the same seed (not what
 * 1.0 or greedy do), and generate and the library draw the same. */
Test(generation_config, serve_generate_and_library_sample_at_the_files_temperature) {
    uint64_t seed = kvs_test_seed() % 2147483647u;
    const char *dir = model_copy("{\"do_sample\": true, \"temperature\": 0.6, \"eos_token_id\": [8191, 8188]}");
    char dir_copy[256], fields[160], extra[160];
    snprintf(dir_copy, sizeof dir_copy, "%s", dir);
    server_proc s = start_server_on(dir_copy, NULL, NULL);
    int32_t d[64], t06[64], t1[64], g[64], cli[64];
    snprintf(fields, sizeof fields, ", \"seed\": %llu, \"max_tokens\": 32", (unsigned long long)seed);
    int nd = completion_ids(s.port, fields, d, 64);
    snprintf(fields, sizeof fields, ", \"seed\": %llu, \"max_tokens\": 32, \"temperature\": 0.6", (unsigned long long)seed);
    int n06 = completion_ids(s.port, fields, t06, 64);
    snprintf(fields, sizeof fields, ", \"seed\": %llu, \"max_tokens\": 32, \"temperature\": 1.0", (unsigned long long)seed);
    int n1 = completion_ids(s.port, fields, t1, 64);
    int ng = completion_ids(s.port, ", \"max_tokens\": 32, \"temperature\": 0", g, 64);
    cr_expect(same_ids(d, nd, t06, n06), "without temperature: the draws of temperature 0.6");
    cr_expect(!same_ids(d, nd, t1, n1), "not those of temperature 1.0");
    cr_expect(!same_ids(d, nd, g, ng), "not greedy");
    cr_expect_eq(completion_ids(s.port, "", cli, 64), 16, "no max_new_tokens in the file: completions' 16");
    cr_expect_eq(stop_server(&s), 0);

    snprintf(extra, sizeof extra, "-n 32 --seed %llu", (unsigned long long)seed);
    int nc = generate_ids(dir_copy, extra, cli, 64);
    cr_expect(same_ids(d, nd, cli, nc), "generate draws what serve draws");
    snprintf(extra, sizeof extra, "-n 32 --seed %llu --generation-config none", (unsigned long long)seed);
    nc = generate_ids(dir_copy, extra, cli, 64);
    cr_expect(same_ids(g, ng, cli, nc), "generate --generation-config none: greedy");

    kvsparse_engine *e = library_open(dir_copy);
    kvsparse_request r;
    kvsparse_request_init(&r);
    r.prompt = STORY, r.seed = seed, r.max_tokens = 32, r.ignore_eos = 1;
    int nl = library_ids(e, &r, cli, 64);
    kvsparse_destroy(e);
    cr_expect(same_ids(d, nd, cli, nl), "the library draws what serve draws");
    remove_copy(dir_copy);
}

/* A bad field stops serve, generate and the library at start, naming the
 * file and the field; --generation-config none does not read it. */
Test(generation_config, a_bad_file_is_refused_at_start) {
    const char *dir = model_copy("{\"do_sample\": true, \"top_p\": 1.5}");
    char dir_copy[256], cmd[2048], *out = NULL;
    snprintf(dir_copy, sizeof dir_copy, "%s", dir);
    const char *runs[] = {"timeout 60 '%s' serve -m '%s' --port 0 --threads 2", "'%s' generate -m '%s' -p hi -n 2"};
    for (int k = 0; k < 2; k++) {
        snprintf(cmd, sizeof cmd, runs[k], kvsparse_binary(), dir_copy);
        cr_expect_eq(run_capture(cmd, &out), 1, "%s: %s", cmd, out);
        cr_expect(strstr(out, "generation_config.json") && strstr(out, "'top_p'") && strstr(out, "(0, 1]"), "%s", out);
        free(out);
    }
    snprintf(cmd, sizeof cmd, "OMP_WAIT_POLICY=passive '%s' generate -m '%s' -p hi -n 2 --threads 2 --generation-config none",
             kvsparse_binary(), dir_copy);
    cr_expect_eq(run_capture(cmd, &out), 0, "%s: %s", cmd, out);
    free(out);
    kvsparse_options o;
    kvsparse_options_init(&o);
    o.quiet = 1;
    kvsparse_engine *e = NULL;
    cr_expect_eq(kvsparse_create(dir_copy, &o, &e), KVSPARSE_ERR_FORMAT);
    cr_expect(strstr(kvsparse_last_error(), "'top_p'"), "%s", kvsparse_last_error());
    cr_expect_null(e);
    remove_copy(dir_copy);
}

/* ---- the library ------------------------------------------------------------------ */

/* kvsparse_request_init's fields take the model's defaults: the bundled
 * model's greedy draws and its 32 tokens; set fields win. */
Test(generation_config, library_follows_the_model_defaults) {
    kvsparse_engine *e = library_open(src_path("models/tiny-needle-llama"));
    kvsparse_request r;
    kvsparse_request_init(&r);
    cr_expect(r.max_tokens == KVSPARSE_MODEL_DEFAULT && r.temperature == KVSPARSE_MODEL_DEFAULT &&
              r.top_p == KVSPARSE_MODEL_DEFAULT && r.top_k == KVSPARSE_MODEL_DEFAULT);
    r.prompt = STORY, r.ignore_eos = 1, r.seed = kvs_test_seed();
    int32_t ids[3][64];
    int n[3];
    for (int k = 0; k < 3; k++) {
        if (k == 1) r.temperature = 0, r.max_tokens = 32; /* what the defaults should be */
        if (k == 2) r.temperature = 1;
        n[k] = library_ids(e, &r, ids[k], 64);
    }
    kvsparse_destroy(e);
    cr_expect_eq(n[0], 32, "the file's max_new_tokens");
    cr_expect(same_ids(ids[0], n[0], ids[1], n[1]), "greedy by default");
    cr_expect(!same_ids(ids[0], n[0], ids[2], n[2]), "a request's temperature wins");
}
