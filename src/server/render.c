/* server: vLLM's render endpoints, POST /v1/chat/completions/render and
 * /v1/completions/render. A router that routes on token ids (llm-d's token
 * producer, a KV-cache-aware scorer) sends the body it would send to the
 * generating route and gets back vLLM's GenerateRequest:
 *   {"request_id", "token_ids", "features": null, "sampling_params",
 *    "model", "stream", "stream_options", "cache_salt"}
 * (completions: an array of one, /v1/completions taking one prompt a request).
 * The body goes through kvs_http_prepare, the generating routes' own parser,
 * validator, chat template and tokenizer, so token_ids are the ids the engine
 * would prefill and a bad body gets the generating route's 400; nothing
 * reaches the engine (no generation, no KV). */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/route.h"

/* A float parameter as the short decimal the client sent: its float's 7
 * significant digits (written with 15, 0.7 rather than 0.699999988079071). */
static json_t *float_json(float v) {
    char buf[32];
    snprintf(buf, sizeof buf, "%.7g", (double)v);
    return json_real(strtod(buf, NULL));
}

static json_t *ids_json(const int32_t *ids, int n) {
    json_t *a = json_array();
    for (int i = 0; i < n; i++) json_array_append_new(a, json_integer(ids[i]));
    return a;
}

/* vLLM's structured_outputs of a response_format (null: none). The grammar of
 * a forced tool call is kvsparse's own (prefix, schema, suffix) and not told. */
static json_t *structured_outputs_json(const kvs_api_request *r) {
    if (r->format == KVS_FORMAT_JSON_OBJECT) return json_pack("{s:b}", "json_object", 1);
    if (r->format == KVS_FORMAT_JSON_SCHEMA && r->format_schema) return json_pack("{s:O}", "json", r->format_schema);
    return json_null();
}

/* The sampling parameters as the engine would take them (completions.c's
 * kvs_http_submit), in vLLM's SamplingParams names: the request's fields over
 * the server's defaults (generation_config.json), max_tokens as validated. */
static json_t *sampling_json(const kvs_http_prepared *p) {
    const kvs_api_request *r = &p->req;
    const kvs_sampling_params *sp = &r->sampling;
    json_t *stop = json_array(), *bias = r->n_logit_bias ? json_object() : json_null();
    for (int i = 0; i < r->n_stop; i++) json_array_append_new(stop, json_string(r->stop[i]));
    for (int i = 0; i < r->n_logit_bias; i++) {
        char key[16];
        snprintf(key, sizeof key, "%d", r->logit_bias[i].id);
        json_object_set_new(bias, key, float_json(r->logit_bias[i].bias));
    }
    json_t *j = json_object();
    json_object_set_new(j, "n", json_integer(r->n > 1 ? r->n : 1));
    json_object_set_new(j, "temperature", float_json(sp->temperature));
    json_object_set_new(j, "top_p", float_json(sp->top_p));
    json_object_set_new(j, "top_k", json_integer(sp->top_k));
    json_object_set_new(j, "min_p", float_json(sp->min_p));
    json_object_set_new(j, "presence_penalty", float_json(sp->presence_penalty));
    json_object_set_new(j, "frequency_penalty", float_json(sp->frequency_penalty));
    json_object_set_new(j, "repetition_penalty", float_json(sp->repetition_penalty));
    /* no seed: the engine draws one for the request */
    json_object_set_new(j, "seed", sp->has_seed ? json_integer((json_int_t)sp->seed) : json_null());
    json_object_set_new(j, "max_tokens", json_integer(p->max_tokens));
    json_object_set_new(j, "min_tokens", json_integer(r->min_tokens));
    json_object_set_new(j, "stop", stop);
    json_object_set_new(j, "stop_token_ids", ids_json(r->stop_token_ids, r->n_stop_token_ids));
    json_object_set_new(j, "ignore_eos", json_boolean(r->ignore_eos));
    json_object_set_new(j, "logprobs", r->logprobs ? json_integer(r->top_logprobs) : json_null());
    json_object_set_new(j, "logit_bias", bias);
    json_object_set_new(j, "structured_outputs", structured_outputs_json(r));
    return j;
}

static json_t *generate_request_json(kvs_server *s, const kvs_http_prepared *p) {
    const kvs_api_request *r = &p->req;
    char id[64];
    kvs_api_response_id(s, r, id, sizeof id);
    json_t *j = json_object();
    json_object_set_new(j, "request_id", json_string(id));
    json_object_set_new(j, "token_ids", ids_json(p->ids, p->n_ids));
    json_object_set_new(j, "features", json_null()); /* no multimodal inputs */
    json_object_set_new(j, "sampling_params", sampling_json(p));
    json_object_set_new(j, "model", json_string(s->model_name));
    json_object_set_new(j, "stream", json_boolean(r->stream)); /* kept, as vLLM keeps it */
    json_object_set_new(j, "stream_options",
                        r->stream ? json_pack("{s:b}", "include_usage", r->include_usage) : json_null());
    json_object_set_new(j, "cache_salt", r->cache_salt ? json_string(r->cache_salt) : json_null());
    return j;
}

void kvs_http_render(kvs_server *s, kvs_route route, const char *body, size_t len, const atomic_bool *cancel,
                     kvs_http_answer *a) {
    memset(a, 0, sizeof *a);
    kvs_http_prepared p;
    kvs_api_error err;
    kvs_route generating = route == KVS_ROUTE_CHAT_RENDER ? KVS_ROUTE_CHAT : KVS_ROUTE_COMPLETIONS;
    if (!kvs_http_prepare(s, generating, body, len, cancel, &p, &err)) {
        kvs_http_answer_error_as(a, &err, kvs_route_dialect(generating));
        return;
    }
    json_t *one = generate_request_json(s, &p);
    json_t *root = route == KVS_ROUTE_COMPLETIONS_RENDER ? json_pack("[o]", one) : one;
    kvs_http_prepared_free(&p);
    a->status = 200;
    a->content_type = "application/json";
    /* 15 digits: jansson's 17 write 0.7 as 0.69999999999999996 */
    a->body = root ? json_dumps(root, JSON_COMPACT | JSON_REAL_PRECISION(15)) : NULL;
    json_decref(root);
    if (!a->body) kvs_http_answer_errorf(a, 500, NULL, "out of memory");
}
