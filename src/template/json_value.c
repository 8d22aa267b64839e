/* JSON text -> template values (the request's tools, a message's tool_calls),
 * as transformers receives them from json.loads: objects become dicts with
 * their keys in order, arrays lists, integers ints, other numbers floats. */
#include <jansson.h>
#include <string.h>

#include "template/template_internal.h"

static ct_value from_json(ct_ctx *c, json_t *j) {
    ct_step(c, CT_NOPOS);
    switch (json_typeof(j)) {
    case JSON_OBJECT: {
        ct_dict *d = ct_dict_new(c);
        const char *k;
        json_t *v;
        json_object_foreach(j, k, v) ct_dict_set(c, d, ct_strv(c, k, strlen(k)), from_json(c, v));
        return (ct_value){ .t = V_DICT, .d = d };
    }
    case JSON_ARRAY: {
        ct_list *l = ct_list_new(c, json_array_size(j));
        for (size_t i = 0; i < l->n; i++) l->v[i] = from_json(c, json_array_get(j, i));
        return ct_listv(l);
    }
    case JSON_STRING: return ct_strv(c, json_string_value(j), json_string_length(j));
    case JSON_INTEGER: return ct_int(json_integer_value(j));
    case JSON_REAL: return ct_float(json_real_value(j));
    case JSON_TRUE: return ct_bool(true);
    case JSON_FALSE: return ct_bool(false);
    default: return ct_none();
    }
}

ct_value ct_json_value(ct_ctx *c, const char *text, const char *what) {
    json_error_t jerr;
    json_t *j = json_loads(text, JSON_DECODE_ANY | JSON_ALLOW_NUL, &jerr);
    if (!j) ct_fail(c->e, CT_NOPOS, "%s is not valid JSON: %s", what, jerr.text);
    /* a failure below (memory, steps) longjmps past the decref: the tree is
       released first by converting into the arena in one piece */
    ct_value v;
    ct_err *saved = c->e, local = *saved;
    c->e = &local;
    if (setjmp(local.jb)) {
        json_decref(j);
        c->e = saved;
        memcpy(saved->msg, local.msg, sizeof saved->msg);
        saved->nomem = local.nomem;
        longjmp(saved->jb, 1);
    }
    v = from_json(c, j);
    c->e = saved;
    json_decref(j);
    return v;
}
