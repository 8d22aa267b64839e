/* server: OpenAI response shapes: completions / chat completions, whole or as
 * streaming chunks, with usage and logprobs. */
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "server/server_internal.h"

const char *kvs_resp_finish_reason(kvs_finish f) {
    switch (f) {
    case KVS_FINISH_STOP: return "stop";
    case KVS_FINISH_LENGTH: return "length";
    case KVS_FINISH_ABORT: return "abort";
    case KVS_FINISH_ERROR: return "error";
    default: return NULL;
    }
}

/* NUL bytes are kept ("\u0000" once dumped). */
json_t *kvs_resp_text_json(const char *s, size_t n) {
    json_t *j = json_stringn(s ? s : "", s ? n : 0);
    if (j) return j;
    char *fixed = malloc(n * 3 + 1);
    if (!fixed) return json_string("");
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        json_t *probe = len && i + len <= n ? json_stringn(s + i, len) : NULL;
        if (probe) {
            memcpy(fixed + o, s + i, len);
            o += len;
            i += len;
        } else {
            memcpy(fixed + o, "\xEF\xBF\xBD", 3);
            o += 3;
            i++;
        }
        json_decref(probe);
    }
    j = json_stringn(fixed, o);
    free(fixed);
    return j ? j : json_string("");
}

/* One token's text (malloc'ed, *len bytes: it may hold NUL bytes). */
static char *token_text(const kvs_tokenizer *tok, int32_t id, size_t *len) {
    char *s = NULL;
    if (!tok || kvs_tokenizer_decode(tok, &id, 1, false, &s, len) != KVS_OK) {
        *len = 0;
        return strdup("");
    }
    return s;
}

/* A logprob as JSON: -inf (and NaN, never expected) as OpenAI's -9999.0, since
 * JSON has no infinities (jansson refuses them: the entry would go missing). */
static json_t *lp_json(float v) { return json_real(isfinite(v) ? (double)v : -9999.0); }

static json_t *usage_json(int prompt_tokens, int completion_tokens, const kvs_resp_kv *kv) {
    json_t *u = json_pack("{s:i, s:i, s:i}", "prompt_tokens", prompt_tokens, "completion_tokens", completion_tokens,
                          "total_tokens", prompt_tokens + completion_tokens);
    if (kv) json_object_set_new(u, "prompt_tokens_details", json_pack("{s:i}", "cached_tokens", kv->cached_tokens));
    return u;
}

/* The "kv" extension beside usage: the policy, the prompt's compression and
 * whether sparsity applied (a prompt below min_prompt keeps its cache full),
 * the KV memory per layer after the prompt and its total. */
static void put_kv(json_t *root, const kvs_resp_kv *kv, int prompt_tokens) {
    if (!kv || !kv->policy) return;
    json_t *j = json_pack("{s:s, s:f, s:b}", "policy", kv->policy, "compression_ratio", kv->compression_ratio,
                          "sparsity_applied", kv->compression_ratio > 1.0);
    if (kv->n_layers > 0) {
        json_t *layers = json_array();
        int64_t held = 0;
        for (int l = 0; l < kv->n_layers; l++) {
            json_t *layer = json_pack("{s:i, s:b}", "entries", kv->layer_entries[l], "sparse", kv->layer_kind[l] == 1);
            if (kv->layer_kind[l] == 2) json_object_set_new(layer, "window", json_true()); /* a sliding-window layer */
            json_array_append_new(layers, layer);
            held += kv->layer_entries[l];
        }
        json_object_set_new(j, "layers", layers);
        json_object_set_new(j, "entry_bytes", json_integer((json_int_t)kv->entry_bytes));
        json_object_set_new(j, "bytes", json_integer((json_int_t)(held * (int64_t)kv->entry_bytes)));
        json_object_set_new(j, "bytes_full",
                            json_integer((json_int_t)prompt_tokens * kv->n_layers * (json_int_t)kv->entry_bytes));
    }
    if (kv->min_prompt > 0 && prompt_tokens < kv->min_prompt)
        json_object_set_new(j, "note", json_sprintf("the prompt (%d tokens) is below min_prompt %d: the cache stays full",
                                                    prompt_tokens, kv->min_prompt));
    json_object_set_new(root, "kv", j);
}

/* Chat's entry for one token: its text, logprob and UTF-8 bytes. */
static json_t *chat_token_json(const kvs_tokenizer *tok, int32_t id, float lp) {
    size_t tl;
    char *t = token_text(tok, id, &tl);
    json_t *bytes = json_array();
    for (size_t b = 0; b < tl; b++) json_array_append_new(bytes, json_integer((unsigned char)t[b]));
    json_t *j = json_pack("{s:o, s:o, s:o}", "token", kvs_resp_text_json(t, tl), "logprob", lp_json(lp), "bytes", bytes);
    free(t);
    return j;
}

/* Token i's alternatives, best first: m->top_logprobs of the n_top computed. */
static int alternatives(const kvs_resp_meta *m, const kvs_resp_slice *s) {
    return s->top_ids ? (m->top_logprobs < s->n_top ? m->top_logprobs : s->n_top) : 0;
}

static json_t *logprobs_json(const kvs_resp_meta *m, const kvs_resp_slice *s) {
    if (!m->logprobs || !s->lps) return json_null();
    int k = alternatives(m, s);
    if (m->kind == KVS_API_CHAT) {
        json_t *content = json_array();
        for (int i = 0; i < s->n; i++) {
            json_t *entry = chat_token_json(m->tok, s->ids[i], s->lps[i]);
            json_t *top = json_array();
            for (int j = 0; j < k; j++) {
                int32_t id = s->top_ids[(size_t)i * s->n_top + j];
                if (id >= 0) json_array_append_new(top, chat_token_json(m->tok, id, s->top_lps[(size_t)i * s->n_top + j]));
            }
            json_object_set_new(entry, "top_logprobs", top);
            json_array_append_new(content, entry);
        }
        return json_pack("{s:o, s:n}", "content", content, "refusal");
    }
    json_t *tokens = json_array(), *lps = json_array(), *offs = json_array();
    json_t *tops = m->top_logprobs > 0 ? json_array() : json_null();
    size_t off = s->text_offset;
    for (int i = 0; i < s->n; i++) {
        size_t tl;
        char *t = token_text(m->tok, s->ids[i], &tl);
        json_t *tj = kvs_resp_text_json(t, tl);
        json_array_append_new(tokens, tj);
        json_array_append_new(lps, lp_json(s->lps[i]));
        json_array_append_new(offs, json_integer((json_int_t)off));
        if (json_is_array(tops)) { /* keyed by each token's text as sent (valid UTF-8); tokens of one text share a key */
            json_t *one = json_object();
            for (int j = 0; j < k; j++) {
                int32_t id = s->top_ids[(size_t)i * s->n_top + j];
                if (id < 0) continue;
                size_t al;
                char *a = token_text(m->tok, id, &al);
                json_t *aj = kvs_resp_text_json(a, al);
                if (!json_object_getn(one, json_string_value(aj), json_string_length(aj)))
                    json_object_setn_new(one, json_string_value(aj), json_string_length(aj),
                                         lp_json(s->top_lps[(size_t)i * s->n_top + j]));
                json_decref(aj);
                free(a);
            }
            /* the chosen token is listed too (OpenAI's legacy completions) */
            if (!json_object_getn(one, json_string_value(tj), json_string_length(tj)))
                json_object_setn_new(one, json_string_value(tj), json_string_length(tj), lp_json(s->lps[i]));
            json_array_append_new(tops, one);
        }
        off += tl;
        free(t);
    }
    return json_pack("{s:o, s:o, s:o, s:o}", "tokens", tokens, "token_logprobs", lps, "top_logprobs", tops,
                     "text_offset", offs);
}

/* The choice's "token_ids" when asked (vLLM's return_token_ids). */
static void put_token_ids(json_t *choice, const kvs_resp_meta *m, const kvs_resp_slice *s) {
    if (!m->token_ids) return;
    json_t *ids = json_array();
    for (int i = 0; i < s->n; i++) json_array_append_new(ids, json_integer(s->ids[i]));
    json_object_set_new(choice, "token_ids", ids);
}

/* tools_called: calls were parsed from an output that stopped by itself */
static json_t *finish_json(kvs_finish f, bool tools_called) {
    const char *r = tools_called && f == KVS_FINISH_STOP ? "tool_calls" : kvs_resp_finish_reason(f);
    return r ? json_string(r) : json_null();
}

static json_t *envelope(const kvs_resp_meta *m, const char *object) {
    return json_pack("{s:s, s:s, s:I, s:s}", "id", m->id, "object", object, "created", (json_int_t)m->created,
                     "model", m->model);
}

static char *dump(json_t *root) {
    char *s = root ? json_dumps(root, JSON_COMPACT) : NULL;
    json_decref(root);
    return s;
}

static json_t *full_choice(const kvs_resp_meta *m, const kvs_resp_slice *s) {
    json_t *choice = json_pack("{s:i}", "index", s->index);
    bool called = false;
    if (m->kind == KVS_API_CHAT && m->tools != KVS_TOOL_FORMAT_NONE)
        json_object_set_new(choice, "message", kvs_resp_tool_message(m, s->index, s->text, s->text_len, &called));
    else if (m->kind == KVS_API_CHAT)
        json_object_set_new(choice, "message",
                            json_pack("{s:s, s:o}", "role", "assistant", "content", kvs_resp_text_json(s->text, s->text_len)));
    else
        json_object_set_new(choice, "text", kvs_resp_text_json(s->text, s->text_len));
    json_object_set_new(choice, "logprobs", logprobs_json(m, s));
    put_token_ids(choice, m, s);
    json_object_set_new(choice, "finish_reason", finish_json(s->finish, called));
    return choice;
}

char *kvs_resp_full(const kvs_resp_meta *m, const kvs_resp_slice *s, int n_choices, int prompt_tokens,
                    int completion_tokens, const kvs_resp_kv *kv) {
    json_t *root = envelope(m, m->kind == KVS_API_CHAT ? "chat.completion" : "text_completion");
    json_t *choices = json_array();
    for (int i = 0; i < n_choices; i++) json_array_append_new(choices, full_choice(m, &s[i]));
    json_object_set_new(root, "choices", choices);
    json_object_set_new(root, "usage", usage_json(prompt_tokens, completion_tokens, kv));
    put_kv(root, kv, prompt_tokens);
    return dump(root);
}

char *kvs_resp_chunk(const kvs_resp_meta *m, const kvs_resp_slice *s, bool first, bool usage_field) {
    bool chat = m->kind == KVS_API_CHAT;
    json_t *root = envelope(m, chat ? "chat.completion.chunk" : "text_completion");
    json_t *choice = json_pack("{s:i}", "index", s->index);
    if (chat) {
        json_t *delta = json_object();
        if (first) json_object_set_new(delta, "role", json_string("assistant"));
        if (s->tool_events) kvs_resp_tool_delta(m, delta, s->tool_events);
        else if (s->text_len || first) json_object_set_new(delta, "content", kvs_resp_text_json(s->text, s->text_len));
        json_object_set_new(choice, "delta", delta);
        if (!json_object_size(delta) && s->finish == KVS_FINISH_NONE) {
            /* no text before the last chunk: nothing goes out, but tokens whose
               logprobs or ids were asked for (as an empty content) outside a tool
               call's stream (there they are text a parser holds back) */
            if (s->tool_events || !(s->n && (m->logprobs || m->token_ids))) {
                json_decref(choice);
                json_decref(root);
                return NULL;
            }
            json_object_set_new(delta, "content", json_string(""));
        }
    } else {
        json_object_set_new(choice, "text", kvs_resp_text_json(s->text, s->text_len));
    }
    json_object_set_new(choice, "logprobs", s->n ? logprobs_json(m, s) : json_null());
    put_token_ids(choice, m, s);
    json_object_set_new(choice, "finish_reason", finish_json(s->finish, s->tools_called));
    json_object_set_new(root, "choices", json_pack("[o]", choice));
    if (usage_field) json_object_set_new(root, "usage", json_null());
    return dump(root);
}

char *kvs_resp_usage_chunk(const kvs_resp_meta *m, int prompt_tokens, int completion_tokens, const kvs_resp_kv *kv) {
    json_t *root = envelope(m, m->kind == KVS_API_CHAT ? "chat.completion.chunk" : "text_completion");
    json_object_set_new(root, "choices", json_array());
    json_object_set_new(root, "usage", usage_json(prompt_tokens, completion_tokens, kv));
    put_kv(root, kv, prompt_tokens);
    return dump(root);
}
