/* server: POST /tokenize and /detokenize (vLLM's shapes):
 *   /tokenize   {"prompt": "..."} or {"messages": [...]} (+ "add_special_tokens",
 *               "return_token_strs") -> {"count", "max_model_len", "tokens", "token_strs"}
 *   /detokenize {"tokens": [ids]} -> {"prompt": text}
 * and Anthropic's /v1/messages/count_tokens -> {"input_tokens": n}. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "server/route.h"

static bool bad(kvs_http_answer *a, const char *param, const char *msg) {
    kvs_api_error err;
    kvs_api_fail(&err, 400, param, "%s", msg);
    kvs_http_answer_error(a, &err);
    return false;
}

static void answer_json(kvs_http_answer *a, json_t *j) {
    a->status = 200;
    a->content_type = "application/json";
    a->body = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
}

/* The ids of {"prompt": ...} or {"messages": ...} (through the chat template). */
static bool tokens_of(kvs_server *s, json_t *root, int32_t **ids, int *n, kvs_http_answer *a) {
    json_t *prompt = json_object_get(root, "prompt"), *messages = json_object_get(root, "messages");
    json_t *special = json_object_get(root, "add_special_tokens");
    if (!!prompt == !!messages) return bad(a, "prompt", "send one of 'prompt' (a string) or 'messages'");
    if (special && !json_is_boolean(special)) return bad(a, "add_special_tokens", "'add_special_tokens' must be a boolean");
    if (prompt) {
        if (!json_is_string(prompt)) return bad(a, "prompt", "'prompt' must be a string");
        kvs_encode_options eo = {.add_special_tokens = !special || json_is_true(special), .parse_special = false};
        if (kvs_tokenizer_encode(s->tok, json_string_value(prompt), json_string_length(prompt), eo, ids, n) != KVS_OK)
            return bad(a, "prompt", kvs_last_error());
        return true;
    }
    /* the chat request's own parser and encoder, on the messages alone */
    json_t *chat = json_pack("{s:O}", "messages", messages);
    char *body = chat ? json_dumps(chat, JSON_COMPACT) : NULL;
    json_decref(chat);
    if (!body) return bad(a, NULL, "out of memory");
    kvs_http_prepared p;
    kvs_api_error err;
    bool ok = kvs_http_prepare(s, KVS_ROUTE_CHAT, body, strlen(body), NULL, &p, &err);
    free(body);
    if (!ok) {
        kvs_http_answer_error(a, &err);
        return false;
    }
    *ids = p.ids, *n = p.n_ids;
    p.ids = NULL;
    kvs_http_prepared_free(&p);
    return true;
}

void kvs_http_tokenize(kvs_server *s, bool detokenize, const char *body, size_t len, kvs_http_answer *a) {
    memset(a, 0, sizeof *a);
    json_error_t jerr;
    json_t *root = json_loadb(body ? body : "", len, JSON_REJECT_DUPLICATES, &jerr);
    if (!json_is_object(root)) {
        json_decref(root);
        bad(a, NULL, "the request body must be a JSON object");
        return;
    }
    json_t *model = json_object_get(root, "model");
    if (model && !(json_is_string(model) && !strcmp(json_string_value(model), s->model_name))) {
        kvs_api_error err;
        kvs_api_fail(&err, 404, "model", "The model '%.200s' does not exist", json_is_string(model) ? json_string_value(model) : "?");
        kvs_http_answer_error(a, &err);
    } else if (!s->tok) {
        bad(a, NULL, "this model has no tokenizer");
    } else if (detokenize) {
        json_t *toks = json_object_get(root, "tokens");
        size_t n = json_is_array(toks) ? json_array_size(toks) : 0;
        int32_t *ids = malloc(sizeof(int32_t) * (n ? n : 1));
        bool ok = json_is_array(toks) && ids;
        for (size_t i = 0; ok && i < n; i++) {
            json_t *t = json_array_get(toks, i);
            ok = json_is_integer(t) && json_integer_value(t) >= 0 && json_integer_value(t) < s->limits.vocab_size;
            if (ok) ids[i] = (int32_t)json_integer_value(t);
        }
        char *text = NULL;
        size_t tl = 0;
        if (!ok) bad(a, "tokens", "'tokens' must be an array of token ids in the vocabulary");
        else if (kvs_tokenizer_decode(s->tok, ids, (int)n, false, &text, &tl) != KVS_OK) bad(a, "tokens", kvs_last_error());
        else answer_json(a, json_pack("{s:s%}", "prompt", text, tl));
        free(text);
        free(ids);
    } else {
        int32_t *ids = NULL;
        int n = 0;
        json_t *strs = json_object_get(root, "return_token_strs");
        if (tokens_of(s, root, &ids, &n, a)) {
            json_t *arr = json_array(), *texts = json_is_true(strs) ? json_array() : json_null();
            for (int i = 0; i < n; i++) {
                json_array_append_new(arr, json_integer(ids[i]));
                const char *t = kvs_tokenizer_token_text(s->tok, ids[i]);
                if (json_is_array(texts)) json_array_append_new(texts, json_string(t ? t : ""));
            }
            answer_json(a, json_pack("{s:i, s:i, s:o, s:o}", "count", n, "max_model_len", s->limits.max_model_len,
                                     "tokens", arr, "token_strs", texts));
        }
        free(ids);
    }
    json_decref(root);
}

void kvs_http_count_tokens(kvs_server *s, const char *body, size_t len, kvs_http_answer *a) {
    memset(a, 0, sizeof *a);
    kvs_http_prepared p;
    kvs_api_error err;
    if (!kvs_http_prepare(s, KVS_ROUTE_COUNT_TOKENS, body, len, NULL, &p, &err)) {
        kvs_http_answer_error_as(a, &err, KVS_DIALECT_ANTHROPIC);
        return;
    }
    answer_json(a, json_pack("{s:i}", "input_tokens", p.n_ids));
    kvs_http_prepared_free(&p);
}
