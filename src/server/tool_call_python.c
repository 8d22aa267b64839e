/* server: Llama 3.1's built-in tool calls, <|python_tag|>name.call(k=v, ...)
 * (tool_calls.h): Python keyword arguments whose values are string, number,
 * True, False or None literals, as a JSON object. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "server/tool_calls.h"

static const char *skip_ws(const char *s, const char *e) {
    while (s < e && (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r')) s++;
    return s;
}

static const char *ident(const char *s, const char *e) {
    const char *q = s;
    while (q < e && (*q == '_' || (*q >= 'a' && *q <= 'z') || (*q >= 'A' && *q <= 'Z') || (q > s && *q >= '0' && *q <= '9')))
        q++;
    return q;
}

/* A Python literal: a quoted string, a number, True, False or None. */
static json_t *py_literal(const char **sp, const char *e) {
    const char *s = *sp;
    if (s < e && (*s == '"' || *s == '\'')) {
        char q = *s++, *b = malloc((size_t)(e - s) + 1);
        size_t n = 0;
        for (; b && s < e && *s != q; s++) {
            char c = *s;
            if (c == '\\' && s + 1 < e) {
                c = *++s;
                c = c == 'n' ? '\n' : c == 't' ? '\t' : c;
            }
            b[n++] = c;
        }
        json_t *j = b && s < e ? json_stringn(b, n) : NULL;
        free(b);
        *sp = s + 1;
        return j;
    }
    static const struct { const char *lit; json_t *(*make)(void); } words[] = {
        {"True", json_true}, {"False", json_false}, {"None", json_null}};
    for (size_t k = 0; k < 3; k++) {
        size_t n = strlen(words[k].lit);
        if ((size_t)(e - s) >= n && !memcmp(s, words[k].lit, n)) {
            *sp = s + n;
            return words[k].make();
        }
    }
    char num[64];
    size_t n = 0;
    while (s + n < e && n < sizeof num - 1 && strchr("+-0123456789.eE", s[n])) n++;
    if (!n) return NULL;
    memcpy(num, s, n);
    num[n] = 0;
    *sp = s + n;
    return json_loads(num, JSON_DECODE_ANY, NULL);
}

bool kvs_tool_python_call(const char *s, size_t len, char **name, char **args) {
    const char *e = s + len, *q;
    s = skip_ws(s, e);
    *name = *args = NULL;
    if ((q = ident(s, e)) == s) return false;
    *name = strndup(s, (size_t)(q - s));
    s = q;
    if ((size_t)(e - s) >= 5 && !memcmp(s, ".call", 5)) s += 5;
    json_t *obj = json_object();
    bool ok = s < e && *s++ == '(';
    for (s = skip_ws(s, e); ok && s < e && *s != ')';) {
        if ((q = ident(s, e)) == s) break;
        char *key = strndup(s, (size_t)(q - s));
        s = skip_ws(q, e);
        json_t *v = s < e && *s == '=' ? (s = skip_ws(s + 1, e), py_literal(&s, e)) : NULL;
        ok = v && key && json_object_set_new(obj, key, v) == 0;
        free(key);
        s = skip_ws(s, e);
        if (s < e && *s == ',') s = skip_ws(s + 1, e);
    }
    ok = ok && s < e && *s == ')' && skip_ws(s + 1, e) == e;
    *args = ok ? json_dumps(obj, JSON_COMPACT) : NULL;
    json_decref(obj);
    if (!*args || !*name) {
        free(*name), free(*args);
        *name = *args = NULL;
        return false;
    }
    return true;
}
