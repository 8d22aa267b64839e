/* server: the compiled grammars of structured output (response_format, forced
 * tool calls), kept by their text so that requests with the same schema share
 * one grammar and its mask caches (grammar/grammar.h: a grammar's first masks
 * cost milliseconds, later ones microseconds). A schema is compiled within
 * the server's bounds (--grammar-max-*), on the worker that prepares its
 * request, and its first masks are computed there too (kvs_grammar_warm), so
 * the engine's thread meets neither cost. The cache holds at most
 * --grammar-cache-bytes (automata, their mask caches, the keys), the least
 * recently used dropped first; refusals are kept too, so a schema past a
 * bound sent again is refused at once. */
#include <stdlib.h>
#include <string.h>

#include "server/server_internal.h"

/* The cache key: kind, prefix, suffix and schema, NUL-separated. */
static char *grammar_key(const char *schema, const char *prefix, const char *suffix, size_t *len) {
    size_t a = schema ? strlen(schema) : 0, b = prefix ? strlen(prefix) : 0, c = suffix ? strlen(suffix) : 0;
    char *k = malloc(a + b + c + 4);
    if (!k) return NULL;
    k[0] = schema ? 's' : 'o';
    memcpy(k + 1, prefix ? prefix : "", b);
    k[1 + b] = 0;
    memcpy(k + 2 + b, suffix ? suffix : "", c);
    k[2 + b + c] = 0;
    memcpy(k + 3 + b + c, schema ? schema : "", a);
    *len = a + b + c + 3;
    return k;
}

static size_t entry_bytes(const kvs_server_grammar_entry *e) {
    return sizeof *e + e->len + (e->error ? strlen(e->error) : 0) + kvs_grammar_bytes(e->g);
}

static void entry_free(kvs_server_grammar_entry *e) {
    kvs_grammar_unref(e->g);
    free(e->key);
    free(e->error);
    memset(e, 0, sizeof *e);
}

size_t kvs_server_grammar_bytes(kvs_server *s, int *n) {
    pthread_mutex_lock(&s->grammar_mu);
    size_t bytes = 0;
    for (int i = 0; i < s->n_grammars; i++) bytes += entry_bytes(&s->grammars[i]);
    if (n) *n = s->n_grammars;
    pthread_mutex_unlock(&s->grammar_mu);
    return bytes;
}

/* Keeps e (taken) unless it alone passes the budget; drops the least recently
 * used entries until the rest fits. Under grammar_mu. */
static void keep(kvs_server *s, kvs_server_grammar_entry *e) {
    size_t budget = s->cfg.grammar_cache_bytes, bytes = entry_bytes(e), total = bytes;
    if (bytes > budget) {
        entry_free(e);
        return;
    }
    for (int i = 0; i < s->n_grammars; i++) total += entry_bytes(&s->grammars[i]);
    while (s->n_grammars && (total > budget || s->n_grammars == KVS_SERVER_GRAMMARS)) {
        int lru = 0;
        for (int i = 1; i < s->n_grammars; i++)
            if (s->grammars[i].used < s->grammars[lru].used) lru = i;
        total -= entry_bytes(&s->grammars[lru]);
        entry_free(&s->grammars[lru]);
        s->grammars[lru] = s->grammars[--s->n_grammars];
    }
    e->used = ++s->grammar_clock;
    s->grammars[s->n_grammars++] = *e;
}

/* Compiles within the server's bounds and warms the first masks; NULL with the refusal's status. */
static kvs_grammar *compile(kvs_server *s, const char *schema, json_t *value, const char *prefix, const char *suffix,
                            const atomic_bool *cancel, kvs_status *st) {
    kvs_grammar_limits lim = s->cfg.grammar_limits;
    lim.cancel = cancel;
    kvs_grammar *g = NULL;
    if (value) *st = kvs_grammar_compile_value(value, prefix, suffix, &lim, &g);
    else if (schema) *st = kvs_grammar_compile(schema, strlen(schema), prefix, suffix, &lim, &g);
    else *st = kvs_grammar_json_object(&g);
    const kvs_grammar_vocab *v;
    if (*st == KVS_OK && s->engine && kvs_engine_grammar_vocab(s->engine, &v) == KVS_OK) *st = kvs_grammar_warm(g, v);
    if (*st != KVS_OK) {
        kvs_grammar_unref(g);
        return NULL;
    }
    return g;
}

kvs_grammar *kvs_server_grammar(kvs_server *s, const char *schema, json_t *value, const char *prefix,
                                const char *suffix, const char *param, const atomic_bool *cancel, kvs_api_error *err) {
    /* a parsed schema: its size checked before it is written out as its key */
    if (value && kvs_grammar_check_values(value, &s->cfg.grammar_limits) != KVS_OK) {
        kvs_api_fail(err, 400, param, "%s: %s", param, kvs_last_error());
        return NULL;
    }
    char *text = value ? json_dumps(value, JSON_COMPACT) : NULL;
    size_t len;
    char *key = value && !text ? NULL : grammar_key(value ? text : schema, prefix, suffix, &len);
    free(text);
    if (!key) {
        kvs_api_fail(err, 500, NULL, "out of memory");
        return NULL;
    }
    pthread_mutex_lock(&s->grammar_mu);
    kvs_grammar *g = NULL;
    bool hit = false;
    for (int i = 0; i < s->n_grammars && !hit; i++) {
        kvs_server_grammar_entry *e = &s->grammars[i];
        if (e->len != len || memcmp(e->key, key, len)) continue;
        hit = true;
        e->used = ++s->grammar_clock;
        if (e->g) g = kvs_grammar_ref(e->g);
        else kvs_api_fail(err, 400, param, "%s: %s", param, e->error);
    }
    pthread_mutex_unlock(&s->grammar_mu);
    if (hit) {
        free(key);
        return g;
    }
    kvs_status st;
    g = compile(s, schema, value, prefix, suffix, cancel, &st);
    kvs_server_grammar_entry e = {key, len, g ? kvs_grammar_ref(g) : NULL, 0, NULL};
    if (!g) {
        /* a schema refused (not one whose client left, nor out of memory) is remembered as refused */
        bool remember = st == KVS_ERR_UNSUPPORTED || st == KVS_ERR_INVALID;
        e.error = remember ? strdup(kvs_last_error()) : NULL;
        kvs_api_fail(err, st == KVS_ERR_NOMEM ? 500 : st == KVS_ERR_BUSY ? 503 : 400, param, "%s: %s", param,
                     kvs_last_error());
        if (!e.error) {
            free(key);
            return NULL;
        }
    }
    pthread_mutex_lock(&s->grammar_mu);
    keep(s, &e);
    pthread_mutex_unlock(&s->grammar_mu);
    return g;
}

void kvs_server_grammars_free(kvs_server *s) {
    for (int i = 0; i < s->n_grammars; i++) entry_free(&s->grammars[i]);
    s->n_grammars = 0;
}
