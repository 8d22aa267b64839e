/* server: vLLM's render endpoints (render.c) and the names routers scrape in
 * /metrics. In process (suite render_path): the ids are the chat template's
 * and the tokenizer's through the library, the sampling parameters those the
 * engine would take, and every body gets the generating route's answer, the
 * same 400 or the same ids (a table, then random bodies). Against the real
 * binary (suite server): the ids are the ones generation prefills (the prefix
 * cache finds the chat request's blocks for a completions request of the
 * rendered ids), rendering leaves the engine alone, and /metrics' vllm: names
 * equal kvsparse's own in the same scrape. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/route.h"
#include "server_client.h"
#include "testutil.h"

/* ---- in process ------------------------------------------------------------ */
static kvs_tokenizer *tiny_tokenizer(void) {
    kvs_tokenizer *tok;
    cr_assert_eq(kvs_tokenizer_load(src_path("models/tiny-needle-llama"), &tok), KVS_OK, "%s", kvs_last_error());
    return tok;
}

static kvs_server *render_server(const char *key, int max_len, const kvs_tokenizer *tok) {
    kvs_server_config cfg = {.api_key = key, .served_model_name = "m", .max_model_len = max_len, .n_layers = 8};
    cfg.grammar_limits.max_values = 40; /* a schema past it is refused: the same 400 on both routes */
    kvs_server *s;
    cr_assert_eq(kvs_server_create(&cfg, NULL, tok, &s), KVS_OK, "%s", kvs_last_error());
    return s;
}

/* POST body to url through the request path (the workers' and kvs_http_handle's
 * kvs_http_answer_whole); the answer's body is the caller's. */
static kvs_http_answer post_path(kvs_server *s, const char *method, const char *url, const char *auth, const char *body) {
    kvs_http_header h[2] = {{"Host", "localhost", 4, 9, false}};
    int n = 1;
    if (auth) h[n++] = (kvs_http_header){"Authorization", auth, 13, strlen(auth), false};
    kvs_http_answer a;
    kvs_http_prepared p;
    cr_assert_not(kvs_http_handle(s, method, url, "HTTP/1.1", h, n, body, body ? strlen(body) : 0, 0, &a, &p),
                  "%s %s went to the engine", method, url);
    cr_assert(a.body, "%s %s: an answer without a body", method, url);
    return a;
}

/* The render route's answer to body: its GenerateRequest (completions: the one of the array), or NULL (*status, *body). */
static json_t *render(kvs_server *s, bool chat, const char *body, int *status, char **text) {
    kvs_http_answer a = post_path(s, "POST", chat ? "/v1/chat/completions/render" : "/v1/completions/render", NULL, body);
    *status = a.status;
    json_t *j = json_loads(a.body, 0, NULL);
    cr_assert(j, "not JSON: %s", a.body);
    if (text) *text = a.body;
    else free(a.body);
    if (a.status != 200) {
        json_decref(j);
        return NULL;
    }
    if (chat) return j;
    cr_assert(json_is_array(j) && json_array_size(j) == 1, "completions render: not an array of one: %s", a.body);
    json_t *one = json_incref(json_array_get(j, 0));
    json_decref(j);
    return one;
}

/* The generating route as its worker runs it (kvs_http_prepare with a cancel
 * flag: grammars compiled): true with *p; false with its error's status and JSON. */
static bool generate_prepare(kvs_server *s, bool chat, const char *body, kvs_http_prepared *p, int *status, char **error) {
    atomic_bool cancel = false;
    kvs_api_error err;
    if (kvs_http_prepare(s, chat ? KVS_ROUTE_CHAT : KVS_ROUTE_COMPLETIONS, body, strlen(body), &cancel, p, &err)) return true;
    *status = err.http_status;
    *error = kvs_api_error_json(&err);
    return false;
}

static void expect_ids(json_t *got, const int32_t *want, int n, const char *what) {
    cr_assert(json_is_array(got), "%s: token_ids not an array", what);
    cr_expect_eq((int)json_array_size(got), n, "%s: %zu ids, want %d", what, json_array_size(got), n);
    for (int i = 0; i < n && i < (int)json_array_size(got); i++)
        cr_expect_eq(json_integer_value(json_array_get(got, i)), want[i], "%s: id %d", what, i);
}

/* Render and the generating route agree on body: the same error (status and
 * JSON), or ids and max_tokens equal. Returns whether it rendered. */
static bool agree(kvs_server *s, bool chat, const char *body) {
    int rs = 0, gs = 0;
    char *rtext = NULL, *gerr = NULL;
    json_t *r = render(s, chat, body, &rs, &rtext);
    kvs_http_prepared p;
    bool ok = generate_prepare(s, chat, body, &p, &gs, &gerr);
    cr_expect_eq(!!r, ok, "%s: render %d, generating route %s: %s", body, rs, ok ? "ok" : gerr, rtext);
    if (r && ok) {
        expect_ids(json_object_get(r, "token_ids"), p.ids, p.n_ids, body);
        cr_expect_eq(json_integer_value(json_object_get(json_object_get(r, "sampling_params"), "max_tokens")), p.max_tokens);
    } else if (!r && !ok) {
        cr_expect_eq(rs, gs, "%s: status %d, the generating route's %d", body, rs, gs);
        cr_expect_str_eq(rtext, gerr, "%s: not the generating route's error", body);
    }
    if (ok) kvs_http_prepared_free(&p);
    json_decref(r);
    free(rtext), free(gerr);
    return r != NULL;
}

Test(render_path, chat_ids_are_the_templates_encoding) {
    kvs_tokenizer *tok = tiny_tokenizer();
    kvs_server *s = render_server(NULL, 256, tok);
    const char *body = "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", \"content\": "
                       "\"The access code for Marigold is 48213. What is it?\"}], \"temperature\": 0}";
    int status;
    json_t *r = render(s, true, body, &status, NULL);
    cr_assert(r, "status %d", status);
    /* the library's own: the template rendered to text, encoded with its control tokens */
    kvs_chat_message msgs[2] = {{"system", "Be brief."}, {"user", "The access code for Marigold is 48213. What is it?"}};
    char *text = NULL;
    cr_assert_eq(kvs_chat_template_render(s->tpl, msgs, 2, true, kvs_tokenizer_bos_token(tok), kvs_tokenizer_eos_token(tok),
                                          &text), KVS_OK);
    int32_t *ids = NULL;
    int n = 0;
    kvs_encode_options eo = {.add_special_tokens = false, .parse_special = true};
    cr_assert_eq(kvs_tokenizer_encode(tok, text, strlen(text), eo, &ids, &n), KVS_OK);
    cr_expect_eq(ids[0], kvs_tokenizer_token_id(tok, kvs_tokenizer_bos_token(tok)), "one BOS, the template's");
    expect_ids(json_object_get(r, "token_ids"), ids, n, "render vs the template's text encoded");
    /* /tokenize of the same messages */
    kvs_http_answer t = post_path(s, "POST", "/tokenize", NULL, "{\"messages\": [{\"role\": \"system\", \"content\": \"Be "
                                  "brief.\"}, {\"role\": \"user\", \"content\": \"The access code for Marigold is 48213. What is it?\"}]}");
    json_t *tj = json_loads(t.body, 0, NULL);
    expect_ids(json_object_get(tj, "tokens"), ids, n, "/tokenize");
    /* the GenerateRequest's shape */
    cr_expect_eq(strncmp(json_string_value(json_object_get(r, "request_id")), "chatcmpl-", 9), 0);
    cr_expect(json_is_null(json_object_get(r, "features")));
    cr_expect_str_eq(json_string_value(json_object_get(r, "model")), "m");
    cr_expect(json_is_false(json_object_get(r, "stream")));
    cr_expect(json_is_null(json_object_get(r, "cache_salt")));
    /* tools: the ids the library encodes with them */
    cr_assert(agree(s, true, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"tools\": [{\"type\": "
                             "\"function\", \"function\": {\"name\": \"f\", \"parameters\": {\"type\": \"object\"}}}]}"));
    free(t.body), free(text), free(ids);
    json_decref(tj), json_decref(r);
    kvs_server_free(s);
    kvs_tokenizer_destroy(tok);
}

Test(render_path, completions_prompts) {
    kvs_tokenizer *tok = tiny_tokenizer();
    kvs_server *s = render_server(NULL, 256, tok);
    int32_t *ids = NULL;
    int n = 0, status;
    kvs_encode_options eo = {.add_special_tokens = true, .parse_special = false};
    cr_assert_eq(kvs_tokenizer_encode(tok, "Hello world", 11, eo, &ids, &n), KVS_OK);
    const char *texts[] = {"{\"prompt\": \"Hello world\"}", "{\"prompt\": [\"Hello world\"]}"};
    for (int i = 0; i < 2; i++) {
        json_t *r = render(s, false, texts[i], &status, NULL);
        cr_assert(r, "%s: status %d", texts[i], status);
        expect_ids(json_object_get(r, "token_ids"), ids, n, texts[i]);
        cr_expect_eq(strncmp(json_string_value(json_object_get(r, "request_id")), "cmpl-", 5), 0);
        json_decref(r);
    }
    const int32_t verbatim[] = {5, 6, 7, 1, 1};
    const char *id_prompts[] = {"{\"prompt\": [5, 6, 7, 1, 1]}", "{\"prompt\": [[5, 6, 7, 1, 1]]}"};
    for (int i = 0; i < 2; i++) {
        json_t *r = render(s, false, id_prompts[i], &status, NULL);
        cr_assert(r, "%s: status %d", id_prompts[i], status);
        expect_ids(json_object_get(r, "token_ids"), verbatim, 5, "ids are returned verbatim");
        json_decref(r);
    }
    /* a batch: the generating route takes one prompt a request, so does render */
    cr_expect_not(agree(s, false, "{\"prompt\": [\"a\", \"b\"]}"));
    cr_expect_not(agree(s, false, "{\"prompt\": [[1, 2], [3]]}"));
    free(ids);
    kvs_server_free(s);
    kvs_tokenizer_destroy(tok);
}

static double param(json_t *r, const char *k) { return json_number_value(json_object_get(json_object_get(r, "sampling_params"), k)); }

Test(render_path, sampling_params_are_the_engines) {
    kvs_tokenizer *tok = tiny_tokenizer();
    kvs_sampling_params defaults = kvs_api_sampling_default();
    defaults.temperature = 0.6f, defaults.top_p = 0.9f; /* as a generation_config.json sets them */
    kvs_server_config cfg = {.served_model_name = "m", .max_model_len = 256, .n_layers = 8, .sampling_defaults = &defaults};
    kvs_server *s;
    cr_assert_eq(kvs_server_create(&cfg, NULL, tok, &s), KVS_OK);
    int status;
    json_t *r = render(s, true, "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"top_k\": 5, \"seed\": 42, "
                                "\"stop\": [\"x\", \"yz\"], \"n\": 2, \"logprobs\": true, \"top_logprobs\": 3, "
                                "\"min_tokens\": 2, \"stop_token_ids\": [9], \"logit_bias\": {\"7\": -1.5}, \"stream\": true, "
                                "\"stream_options\": {\"include_usage\": true}, \"cache_salt\": \"tenant\", "
                                "\"response_format\": {\"type\": \"json_object\"}}", &status, NULL);
    cr_assert(r, "status %d", status);
    cr_expect_float_eq(param(r, "temperature"), 0.6, 1e-9, "the server's default, written as sent");
    cr_expect_float_eq(param(r, "top_p"), 0.9, 1e-9);
    cr_expect_eq(param(r, "top_k"), 5);
    cr_expect_eq(param(r, "seed"), 42);
    cr_expect_eq(param(r, "n"), 2);
    cr_expect_eq(param(r, "logprobs"), 3);
    cr_expect_eq(param(r, "min_tokens"), 2);
    int n_ids = (int)json_array_size(json_object_get(r, "token_ids"));
    cr_expect_eq(param(r, "max_tokens"), 256 - n_ids, "chat without max_tokens: the rest of the context");
    json_t *sp = json_object_get(r, "sampling_params");
    cr_expect_str_eq(json_string_value(json_array_get(json_object_get(sp, "stop"), 1)), "yz");
    cr_expect_eq(json_integer_value(json_array_get(json_object_get(sp, "stop_token_ids"), 0)), 9);
    cr_expect_float_eq(json_number_value(json_object_get(json_object_get(sp, "logit_bias"), "7")), -1.5, 1e-9);
    cr_expect(json_is_true(json_object_get(json_object_get(sp, "structured_outputs"), "json_object")));
    cr_expect(json_is_true(json_object_get(r, "stream")));
    cr_expect(json_is_true(json_object_get(json_object_get(r, "stream_options"), "include_usage")));
    cr_expect_str_eq(json_string_value(json_object_get(r, "cache_salt")), "tenant");
    json_decref(r);
    r = render(s, false, "{\"prompt\": \"hi\", \"temperature\": 0.25}", &status, NULL);
    cr_assert(r);
    cr_expect_eq(param(r, "max_tokens"), 16, "completions without max_tokens: 16");
    cr_expect_float_eq(param(r, "temperature"), 0.25, 1e-9);
    cr_expect(json_is_null(json_object_get(json_object_get(r, "sampling_params"), "seed")), "no seed: the engine draws one");
    json_decref(r);
    kvs_server_free(s);
    kvs_tokenizer_destroy(tok);
}

#define MSG "\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]"
#define TEN "one two three four five six seven eight nine ten "
Test(render_path, bad_bodies_get_the_generating_routes_errors) {
    kvs_tokenizer *tok = tiny_tokenizer();
    kvs_server *s = render_server(NULL, 64, tok);
    const char *chat[] = {
        "", "not json", "[]", "{}", "{\"messages\": 1}", "{\"messages\": []}", "{\"messages\": [{\"role\": \"king\"}]}",
        "{\"messages\": [{\"role\": \"user\", \"content\": 5}]}", "{" MSG ", \"model\": \"other\"}",
        "{" MSG ", \"temperature\": -1}", "{" MSG ", \"max_tokens\": 0}", "{" MSG ", \"max_tokens\": 1000}",
        "{" MSG ", \"max_tokens\": 60}", "{" MSG ", \"bogus\": 1}", "{" MSG ", \"n\": 99}", "{" MSG ", \"top_logprobs\": 2}",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"" TEN TEN TEN TEN TEN TEN TEN TEN "\"}]}", /* past 64 tokens */
        "{" MSG ", \"tools\": [{\"type\": \"function\", \"function\": {\"name\": 5}}]}",
        "{" MSG ", \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\"}}], \"tool_choice\": {\"type\": "
        "\"function\", \"function\": {\"name\": \"g\"}}}",
        "{" MSG ", \"response_format\": {\"type\": \"json_schema\", \"json_schema\": {\"name\": \"x\", \"schema\": "
        "{\"type\": \"object\", \"properties\": {\"a\": {\"enum\": [1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,"
        "22,23,24,25,26,27,28,29,30,31,32,33,34,35,36,37,38,39,40,41,42]}}}}}}", /* past --grammar-max-values */
        "{" MSG ", \"kv_policy\": {\"policy\": \"nope\"}}", "{" MSG ", \"stream_options\": {\"include_usage\": true}}",
        "{" MSG ", \"cache_salt\": 3}", "{" MSG ", \"logit_bias\": {\"x\": 1}}",
    };
    for (size_t i = 0; i < sizeof chat / sizeof *chat; i++) cr_expect_not(agree(s, true, chat[i]), "%s rendered", chat[i]);
    const char *completions[] = {
        "{}", "{\"prompt\": \"\"}", "{\"prompt\": 5}", "{\"prompt\": [99999999]}", "{\"prompt\": []}",
        "{\"prompt\": \"a\", \"echo\": true}", "{\"prompt\": \"a\", \"suffix\": \"b\"}", "{\"prompt\": \"a\\u0000b\"}",
        "{\"prompt\": [1, 2, 3], \"max_tokens\": 62}", "{" MSG "}",
    };
    for (size_t i = 0; i < sizeof completions / sizeof *completions; i++)
        cr_expect_not(agree(s, false, completions[i]), "%s rendered", completions[i]);
    kvs_server_free(s);
    kvs_tokenizer_destroy(tok);
}

/* A body of fields drawn from good and bad values: the render route and the
 * generating route must give the same answer to every one. */
static void random_body(kvs_rng *g, bool chat, char *out, size_t cap) {
    static const char *fields[] = {
        "\"temperature\": 0.5", "\"temperature\": 7", "\"top_p\": 0", "\"top_p\": 0.5", "\"top_k\": -2", "\"top_k\": 3",
        "\"max_tokens\": 4", "\"max_tokens\": 63", "\"max_tokens\": null", "\"seed\": 7", "\"seed\": \"7\"",
        "\"stop\": \"x\"", "\"stop\": [1]", "\"n\": 2", "\"n\": 0", "\"stream\": true", "\"stream\": 1",
        "\"cache_salt\": \"s\"", "\"kv_policy\": {\"policy\": \"snapkv\"}", "\"kv_policy\": 3", "\"min_tokens\": 2",
        "\"min_tokens\": 80", "\"logit_bias\": {\"3\": 2}", "\"ignore_eos\": true", "\"model\": \"m\"",
        "\"model\": \"x\"", "\"response_format\": {\"type\": \"json_object\"}", "\"response_format\": {\"type\": \"xml\"}",
        "\"stop_token_ids\": [2]", "\"presence_penalty\": 3", "\"repetition_penalty\": 1.1", "\"user\": \"u\"",
    };
    static const char *chat_prompts[] = {MSG, "\"messages\": [{\"role\": \"assistant\", \"content\": [{\"type\": \"text\", "
                                              "\"text\": \"a\"}, {\"type\": \"text\", \"text\": \"b\"}]}]",
                                         "\"messages\": [{\"role\": \"tool\"}]", "\"messages\": {}", "\"prompt\": \"x\""};
    static const char *prompts[] = {"\"prompt\": \"Hello\"", "\"prompt\": [1, 2]", "\"prompt\": [[3]]", "\"prompt\": [-1]",
                                    "\"prompt\": [\"a\", [1]]", MSG};
    const char **ps = chat ? chat_prompts : prompts;
    size_t np = chat ? sizeof chat_prompts / sizeof *chat_prompts : sizeof prompts / sizeof *prompts;
    size_t at = (size_t)snprintf(out, cap, "{");
    if (kvs_rng_u64(g) % 8) at += (size_t)snprintf(out + at, cap - at, "%s", ps[kvs_rng_u64(g) % np]);
    for (int k = (int)(kvs_rng_u64(g) % 4); k > 0; k--)
        at += (size_t)snprintf(out + at, cap - at, "%s%s", at > 1 ? ", " : "",
                               fields[kvs_rng_u64(g) % (sizeof fields / sizeof *fields)]);
    snprintf(out + at, cap - at, "}");
}

Test(render_path, random_bodies_get_the_generating_routes_answer) {
    kvs_tokenizer *tok = tiny_tokenizer();
    kvs_server *s = render_server(NULL, 64, tok);
    kvs_rng g;
    kvs_rng_seed(&g, kvs_test_seed());
    int rendered = 0;
    for (int i = 0; i < 400; i++) {
        char body[1024];
        bool chat = i % 2;
        random_body(&g, chat, body, sizeof body);
        rendered += agree(s, chat, body);
    }
    cr_expect_gt(rendered, 20, "too few bodies rendered (%d of 400) to compare the ids", rendered);
    cr_expect_lt(rendered, 380, "too few bodies refused (%d of 400 rendered) to compare the errors", rendered);
    kvs_server_free(s);
    kvs_tokenizer_destroy(tok);
}

Test(render_path, auth_methods_and_paths) {
    kvs_tokenizer *tok = tiny_tokenizer();
    kvs_server *s = render_server("k", 64, tok);
    const char *body = "{" MSG "}";
    kvs_http_answer gen = post_path(s, "POST", "/v1/chat/completions", NULL, body);
    kvs_http_answer a = post_path(s, "POST", "/v1/chat/completions/render", NULL, body);
    cr_expect_eq(a.status, 401);
    cr_expect_str_eq(a.body, gen.body, "the generating route's 401");
    free(a.body), free(gen.body);
    a = post_path(s, "POST", "/v1/completions/render", "Bearer x", "{\"prompt\": \"a\"}");
    cr_expect_eq(a.status, 401);
    free(a.body);
    a = post_path(s, "POST", "/v1/chat/completions/render", "Bearer k", body);
    cr_expect_eq(a.status, 200, "%s", a.body);
    free(a.body);
    a = post_path(s, "GET", "/v1/completions/render", "Bearer k", NULL);
    cr_expect_eq(a.status, 405);
    cr_expect_str_eq(a.allow, "POST");
    free(a.body);
    const char *unknown[] = {"/v1/chat/completions/render/", "/v1/completions/renderx", "/v1/render", "/render"};
    for (int i = 0; i < 4; i++) {
        a = post_path(s, "POST", unknown[i], "Bearer k", body);
        cr_expect_eq(a.status, 404, "%s", unknown[i]);
        free(a.body);
    }
    atomic_store(&s->draining, true); /* as every POST while the server drains */
    a = post_path(s, "POST", "/v1/chat/completions/render", "Bearer k", body);
    cr_expect_eq(a.status, 503);
    free(a.body);
    kvs_server_free(s);
    kvs_tokenizer_destroy(tok);
}

Test(render_path, admit_tokens_follow_the_schedulers_peak) {
    kvs_kv_policy full = kvs_kv_policy_default(KVS_POLICY_FULL);
    const int64_t frees[] = {0, 7, 8, 9, 100, 4096, 65535};
    for (int i = 0; i < 7; i++) /* a full request's peak: its prompt's blocks in each of the 8 layers */
        cr_expect_eq(kvs_server_kv_admit_tokens(&full, 8, true, frees[i]), frees[i] / 8 * 16, "free %lld",
                     (long long)frees[i]);
    cr_expect_eq(kvs_server_kv_admit_tokens(&full, 0, true, 100), 0);
    kvs_kv_policy sparse = kvs_kv_policy_default(KVS_POLICY_PYRAMIDKV);
    sparse.full_layers = 2;
    for (int64_t free_blocks = 8; free_blocks < 20000; free_blocks = free_blocks * 3 + 5) {
        for (int pc = 0; pc < 2; pc++) {
            int64_t p = kvs_server_kv_admit_tokens(&sparse, 8, pc, free_blocks);
            cr_expect_leq(kvs_kv_policy_seq_blocks(&sparse, 8, 16, pc, (int)p, 0).peak, free_blocks);
            cr_expect_gt(kvs_kv_policy_seq_blocks(&sparse, 8, 16, pc, (int)p + 1, 0).peak, free_blocks);
            /* the prompt is reserved in every layer before the compaction: never more than a full request */
            cr_expect_leq(p, kvs_server_kv_admit_tokens(&full, 8, pc, free_blocks));
        }
        cr_expect_eq(kvs_server_kv_admit_tokens(&sparse, 8, false, free_blocks), free_blocks / 8 * 16,
                     "without prefix caching the compaction needs no copies");
    }
}

/* ---- the real server --------------------------------------------------------- */
TestSuite(server, .timeout = 400);

static json_t *post_auth(int port, const char *path, const char *body) {
    http_resp r = http(port, "POST", path, "Authorization: Bearer k\r\n", body);
    cr_assert_eq(r.status, 200, "POST %s %s -> %d %s", path, body, r.status, r.body);
    json_t *j = json_loads(r.body, 0, NULL);
    cr_assert(j, "not JSON: %s", r.body);
    free(r.body);
    return j;
}

/* "{\"prompt\": [ids], ...}" of a render's token_ids */
static char *ids_prompt(json_t *ids, const char *rest) {
    char *list = json_dumps(ids, JSON_COMPACT), *out = malloc(strlen(list) + strlen(rest) + 32);
    sprintf(out, "{\"prompt\": %s, %s}", list, rest);
    free(list);
    return out;
}

static int cached_tokens(json_t *j) {
    return (int)json_integer_value(json_object_get(json_object_get(json_object_get(j, "usage"), "prompt_tokens_details"),
                                                   "cached_tokens"));
}

/* A scrape's sample of name (its first line, labels or none); -1 when absent. */
static double sample(const char *text, const char *name) {
    size_t n = strlen(name);
    for (const char *p = text; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL)
        if (!strncmp(p, name, n) && (p[n] == '{' || p[n] == ' ')) return atof(strchr(p + n, ' ') + 1);
    return -1;
}

Test(server, render_ids_are_what_generation_prefills) {
    server_proc s = start_server("--api-key k");
    const char *rest = "\"max_tokens\": 6, \"temperature\": 0";
    char chat[1024];
    snprintf(chat, sizeof chat, "{\"messages\": [{\"role\": \"user\", \"content\": \"The access code for Marigold is "
             "48213. The sky was grey over the harbour. What is the access code for Marigold?\"}], %s}", rest);
    http_resp m0 = http(s.port, "GET", "/metrics", NULL, NULL);
    json_t *r = post_auth(s.port, "/v1/chat/completions/render", chat);
    http_resp m1 = http(s.port, "GET", "/metrics", NULL, NULL);
    const char *untouched[] = {"kvsparse_prompt_tokens_total", "kvsparse_prefix_cache_queries_total",
                               "kvsparse_requests_finished_total", "kvsparse_kv_blocks_used"};
    for (int i = 0; i < 4; i++)
        cr_expect_eq(sample(m0.body, untouched[i]), sample(m1.body, untouched[i]), "render moved %s", untouched[i]);
    json_t *ids = json_object_get(r, "token_ids");
    int n = (int)json_array_size(ids);
    cr_assert_gt(n, 16, "a prompt of whole blocks to find in the prefix cache");
    json_t *tk = post_auth(s.port, "/tokenize", "{\"messages\": [{\"role\": \"user\", \"content\": \"The access code for "
                           "Marigold is 48213. The sky was grey over the harbour. What is the access code for Marigold?\"}]}");
    cr_expect(json_equal(json_object_get(tk, "tokens"), ids), "/tokenize's ids differ from render's");
    json_t *g = post_auth(s.port, "/v1/chat/completions", chat);
    cr_expect_eq(usage_of(g, "prompt_tokens"), n);
    /* the rendered ids as a prompt: the prefix cache finds every whole block of
       the chat request's prompt (blocks are verified token by token) */
    char *by_ids = ids_prompt(ids, rest);
    json_t *c = post_auth(s.port, "/v1/completions", by_ids);
    cr_expect_eq(usage_of(c, "prompt_tokens"), n);
    cr_expect_eq(cached_tokens(c), (n - 1) / 16 * 16, "the chat request's prefill was not these ids");
    cr_expect_str_eq(choice_text(c, false), choice_text(g, true), "greedy answers differ");
    /* a text prompt: render's ids, then the text's own request, then the ids' */
    json_t *cr = post_auth(s.port, "/v1/completions/render", "{\"prompt\": \"Zora's locker number is 4410. The rain "
                           "had stopped over the quiet town all afternoon. What is Zora's locker number?\", \"max_tokens\": 4}");
    json_t *cids = json_object_get(json_array_get(cr, 0), "token_ids");
    int cn = (int)json_array_size(cids);
    json_t *ct = post_auth(s.port, "/v1/completions", "{\"prompt\": \"Zora's locker number is 4410. The rain had stopped "
                           "over the quiet town all afternoon. What is Zora's locker number?\", \"max_tokens\": 4}");
    cr_expect_eq(usage_of(ct, "prompt_tokens"), cn);
    char *cby_ids = ids_prompt(cids, "\"max_tokens\": 4");
    json_t *cc = post_auth(s.port, "/v1/completions", cby_ids);
    cr_expect_eq(cached_tokens(cc), (cn - 1) / 16 * 16, "the text prompt's prefill was not these ids");
    http_resp no_key = http(s.port, "POST", "/v1/chat/completions/render", NULL, chat);
    cr_expect_eq(no_key.status, 401);
    free(by_ids), free(cby_ids), free(m0.body), free(m1.body), free(no_key.body);
    json_decref(r), json_decref(tk), json_decref(g), json_decref(c), json_decref(cr), json_decref(ct), json_decref(cc);
    cr_expect_eq(stop_server(&s), 0);
}

static void *long_request(void *arg) {
    int port = *(int *)arg;
    http_resp r = http(port, "POST", "/v1/completions", NULL,
                       "{\"prompt\": \"The access code for Marigold is 48213.\", \"max_tokens\": 600, \"ignore_eos\": true}");
    free(r.body);
    return NULL;
}

/* Every vllm: name equals kvsparse's own in one scrape, with its HELP and TYPE. */
static void expect_vllm_names(const char *m) {
    const char *pairs[][2] = {
        {"vllm:num_requests_running", "kvsparse_num_requests_running"},
        {"vllm:num_requests_waiting", "kvsparse_num_requests_waiting"},
        {"vllm:kv_cache_usage_perc", "kvsparse_kv_usage_ratio"},
        {"vllm:prefix_cache_queries_total", "kvsparse_prefix_cache_queries_total"},
        {"vllm:prefix_cache_hits_total", "kvsparse_prefix_cache_hits_total"},
        {"vllm:prompt_tokens_total", "kvsparse_prompt_tokens_total"},
        {"vllm:generation_tokens_total", "kvsparse_generation_tokens_total"},
        {"vllm:num_preemptions_total", "kvsparse_preemptions_total"},
    };
    for (size_t i = 0; i < sizeof pairs / sizeof *pairs; i++) {
        cr_expect_geq(sample(m, pairs[i][0]), 0, "%s missing", pairs[i][0]);
        cr_expect_eq(sample(m, pairs[i][0]), sample(m, pairs[i][1]), "%s != %s", pairs[i][0], pairs[i][1]);
        char help[96], type[96];
        snprintf(help, sizeof help, "# HELP %s ", pairs[i][0]);
        snprintf(type, sizeof type, "# TYPE %s %s\n", pairs[i][0], strstr(pairs[i][0], "_total") ? "counter" : "gauge");
        cr_expect(strstr(m, help) && strstr(m, type), "%s: no HELP or TYPE line", pairs[i][0]);
    }
    const char *info = strstr(m, "\nvllm:cache_config_info{");
    cr_assert(info && strstr(m, "# TYPE vllm:cache_config_info gauge\n"), "no vllm:cache_config_info");
    long long blocks = 0;
    cr_assert(strstr(info, "block_size=\"16\""));
    cr_assert_eq(sscanf(strstr(info, "num_gpu_blocks=\""), "num_gpu_blocks=\"%lld\"", &blocks), 1);
    cr_expect_eq(blocks * 16, (long long)sample(m, "kvsparse_kv_tokens_capacity"), "vLLM's blocks hold every layer");
    cr_expect_eq(strtod(strchr(strchr(info, '}'), ' '), NULL), 1);
}

/* kvsparse_kv_admit_tokens of a full policy: the free blocks' tokens with every layer full */
static double free_tokens(const char *m) {
    double total = sample(m, "kvsparse_kv_blocks_total"), used = sample(m, "kvsparse_kv_blocks_used");
    double layers = total / (sample(m, "kvsparse_kv_tokens_capacity") / 16);
    return (double)((long long)((total - used) / layers) * 16);
}

Test(server, metrics_carry_vllm_names_equal_to_kvsparse_names) {
    server_proc s = start_server(NULL);
    pthread_t t;
    pthread_create(&t, NULL, long_request, &s.port);
    cr_assert(wait_running(s.port, 1), "the request never ran");
    http_resp m = http(s.port, "GET", "/metrics", NULL, NULL);
    cr_assert_eq(m.status, 200);
    expect_vllm_names(m.body);
    cr_expect_eq(sample(m.body, "vllm:num_requests_running"), 1);
    cr_expect_gt(sample(m.body, "vllm:kv_cache_usage_perc"), 0);
    cr_expect_eq(sample(m.body, "kvsparse_kv_admit_tokens"), free_tokens(m.body), "full policy: the free tokens");
    cr_expect_lt(sample(m.body, "kvsparse_kv_admit_tokens"), sample(m.body, "kvsparse_kv_tokens_capacity"));
    free(m.body);
    pthread_join(t, NULL);
    cr_expect_eq(stop_server(&s), 0);

    s = start_server("--no-vllm-metrics");
    m = http(s.port, "GET", "/metrics", NULL, NULL);
    cr_expect_null(strstr(m.body, "vllm:"), "--no-vllm-metrics still writes vLLM's names");
    cr_expect_gt(sample(m.body, "kvsparse_num_requests_waiting"), -1);
    free(m.body);
    cr_expect_eq(stop_server(&s), 0);

    /* a sparse default policy: admission reserves the prompt in every layer,
       and with prefix caching the compaction's copies too */
    const char *sparse[] = {"--kv-policy snapkv --kv-budget 10%", "--kv-policy snapkv --kv-budget 10% --no-enable-prefix-caching"};
    for (int i = 0; i < 2; i++) {
        s = start_server(sparse[i]);
        m = http(s.port, "GET", "/metrics", NULL, NULL);
        double admit = sample(m.body, "kvsparse_kv_admit_tokens"), free_tok = free_tokens(m.body);
        if (i == 0) cr_expect(admit > 0 && admit < free_tok, "%s: admits %g of %g free tokens", sparse[i], admit, free_tok);
        else cr_expect_eq(admit, free_tok, "%s", sparse[i]);
        free(m.body);
        cr_expect_eq(stop_server(&s), 0);
    }
}
