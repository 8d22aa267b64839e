/* server: the compiled grammars of structured output (response_format, forced
 * tool calls), kept by their text so that requests with the same schema share
 * one grammar and its mask caches (grammar/grammar.h: a grammar's first masks
 * cost milliseconds, later ones microseconds). At most KVS_SERVER_GRAMMARS,
 * the least recently used dropped first. */
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

kvs_grammar *kvs_server_grammar(kvs_server *s, const char *schema, const char *prefix, const char *suffix,
                                const char *param, kvs_api_error *err) {
    size_t len;
    char *key = grammar_key(schema, prefix, suffix, &len);
    if (!key) {
        kvs_api_fail(err, 500, NULL, "out of memory");
        return NULL;
    }
    pthread_mutex_lock(&s->grammar_mu);
    kvs_grammar *g = NULL;
    for (int i = 0; i < s->n_grammars && !g; i++)
        if (s->grammars[i].len == len && !memcmp(s->grammars[i].key, key, len)) {
            g = kvs_grammar_ref(s->grammars[i].g);
            s->grammars[i].used = ++s->grammar_clock;
        }
    pthread_mutex_unlock(&s->grammar_mu);
    if (g) {
        free(key);
        return g;
    }
    kvs_status st = schema ? kvs_grammar_from_json_schema(schema, strlen(schema), prefix, suffix, &g)
                           : kvs_grammar_json_object(&g);
    if (st != KVS_OK) {
        free(key);
        kvs_api_fail(err, 400, param, "%s: %s", param, kvs_last_error());
        return NULL;
    }
    pthread_mutex_lock(&s->grammar_mu);
    int slot = s->n_grammars < KVS_SERVER_GRAMMARS ? s->n_grammars++ : 0;
    for (int i = 0; i < s->n_grammars; i++)
        if (s->grammars[i].used < s->grammars[slot].used) slot = i;
    if (s->grammars[slot].g) kvs_grammar_unref(s->grammars[slot].g);
    free(s->grammars[slot].key);
    s->grammars[slot] = (kvs_server_grammar_entry){key, len, kvs_grammar_ref(g), ++s->grammar_clock};
    pthread_mutex_unlock(&s->grammar_mu);
    return g;
}

void kvs_server_grammars_free(kvs_server *s) {
    for (int i = 0; i < s->n_grammars; i++) {
        kvs_grammar_unref(s->grammars[i].g);
        free(s->grammars[i].key);
    }
    s->n_grammars = 0;
}
