/* libFuzzer target: chat messages -> prompt ids (kvs_tokenizer_encode_chat) with the
 * real tokenizer of models/tiny-needle-llama and several real chat templates.
 *
 * Input: byte 0 picks the template (low 3 bits) and the mode (bit 3):
 *   JSON mode: the rest is a /v1/chat/completions body, parsed by the API
 *              parser; its messages are encoded.
 *   raw mode:  the rest is messages separated by NUL: one byte picking the
 *              role, then the content bytes as they are (invalid UTF-8, marker
 *              bytes, control-token text); a content "\x01" R X is X repeated
 *              R+1 times (up to 64 KiB: huge contents).
 * Checked on every encoding that succeeds:
 *   - every id is inside the vocabulary;
 *   - user text never becomes a control token: the special ids are exactly
 *     those of the same conversation with every content "x" (whitespace kept);
 *   - for templates that only join, trim, strip or tojson contents, the ids decode to the
 *     text the template renders with the real contents (what transformers'
 *     apply_chat_template would give).
 * Setup (tokenizer, templates) is done once, in LLVMFuzzerInitialize. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/server.h"

#ifndef KVS_SOURCE_DIR
#define KVS_SOURCE_DIR "."
#endif

typedef struct {
    const char *file; /* under fuzz/corpus/chat_template/, NULL: the tokenizer's own */
    bool transparent; /* uses contents only by joining, trim, strip and tojson */
    kvs_chat_template *tpl;
} fuzz_template;

static fuzz_template templates[] = {
    {NULL, true, NULL},
    {"llama3.jinja", true, NULL},
    {"llama2.jinja", true, NULL},
    {"chatml.jinja", true, NULL},
    {"gemma_sysfold.jinja", true, NULL},
    {"mistral.jinja", true, NULL},
    {"qwen3.jinja", false, NULL},         /* splits contents at </think> */
    {"llama31_tools.jinja", true, NULL},  /* tojson of tool contents */
};
#define N_TEMPLATES (int)(sizeof templates / sizeof *templates)
static kvs_tokenizer *tok;

static const char *const roles[] = {"user", "assistant", "system", "tool", "user", "assistant", "ipython", ""};

static void die(const char *what) {
    fprintf(stderr, "fuzz_chat_encode: %s: %s\n", what, kvs_last_error());
    abort();
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    const char *root = getenv("KVS_SOURCE_DIR") ? getenv("KVS_SOURCE_DIR") : KVS_SOURCE_DIR;
    char path[4096];
    snprintf(path, sizeof path, "%s/models/tiny-needle-llama", root);
    if (kvs_tokenizer_load(path, &tok) != KVS_OK) die(path);
    for (int i = 0; i < N_TEMPLATES; i++) {
        char *src = NULL;
        size_t len = 0;
        if (templates[i].file) {
            snprintf(path, sizeof path, "%s/fuzz/corpus/chat_template/%s", root, templates[i].file);
            if (kvs_read_file(path, &src, &len) != KVS_OK) die(path);
        } else {
            src = strdup(kvs_tokenizer_chat_template(tok));
            len = strlen(src);
        }
        if (kvs_chat_template_compile(src, len, &templates[i].tpl) != KVS_OK) die("compile");
        free(src);
    }
    return 0;
}

/* The special ids of ids[0..n), in order, into out (n entries at most); returns how many. */
static int special_ids(const int32_t *ids, int n, int32_t *out) {
    int k = 0;
    for (int i = 0; i < n; i++)
        if (kvs_tokenizer_is_special(tok, ids[i])) out[k++] = ids[i];
    return k;
}

static void check(const fuzz_template *ft, const kvs_chat_message *msgs, int n) {
    int32_t *ids = NULL;
    int n_ids = 0;
    if (kvs_tokenizer_encode_chat(tok, ft->tpl, msgs, n, &ids, &n_ids) != KVS_OK) {
        if (!kvs_last_error()[0]) die("an error without a message");
        return;
    }
    int vocab = kvs_tokenizer_vocab_size(tok);
    for (int i = 0; i < n_ids; i++)
        if (ids[i] < 0 || ids[i] >= vocab) die("an id outside the vocabulary");

    /* the same conversation with each content that is not whitespace replaced by
       "x": the template's own control tokens */
    kvs_chat_message *empty = malloc(sizeof *empty * (size_t)(n > 0 ? n : 1));
    for (int i = 0; i < n; i++) {
        size_t start, len;
        kvs_chat_template_strip(msgs[i].content, strlen(msgs[i].content), true, true, &start, &len);
        empty[i] = (kvs_chat_message){msgs[i].role, len ? "x" : msgs[i].content};
    }
    int32_t *base = NULL;
    int n_base = 0;
    if (kvs_tokenizer_encode_chat(tok, ft->tpl, empty, n, &base, &n_base) != KVS_OK)
        die("\"x\" contents fail where the real ones encode");
    free(empty);
    int32_t *sa = malloc(sizeof *sa * (size_t)(n_ids + 1)), *sb = malloc(sizeof *sb * (size_t)(n_base + 1));
    int ka = special_ids(ids, n_ids, sa), kb = special_ids(base, n_base, sb);
    if (ka != kb || memcmp(sa, sb, sizeof *sa * (size_t)ka)) die("user content became a control token");
    free(sa), free(sb), free(base);

    if (ft->transparent) {
        char *want = NULL, *got = NULL;
        if (kvs_chat_template_render(ft->tpl, msgs, n, true, kvs_tokenizer_bos_token(tok),
                                     kvs_tokenizer_eos_token(tok), &want) != KVS_OK)
            die("the real contents fail to render");
        if (kvs_tokenizer_decode(tok, ids, n_ids, false, &got, NULL) != KVS_OK) die("decode");
        if (strcmp(want, got)) {
            fprintf(stderr, "rendered: [%s]\nencoded:  [%s]\n", want, got);
            abort();
        }
        free(want), free(got);
    }
    free(ids);
}

static void fuzz_json(const fuzz_template *ft, const char *body, size_t len) {
    kvs_api_limits lim = {kvs_tokenizer_vocab_size(tok), 8192, 8};
    kvs_api_request r;
    kvs_api_error e;
    if (!kvs_api_parse_request(body, len, KVS_API_CHAT, &lim, &r, &e)) return;
    check(ft, r.messages, r.n_messages);
    kvs_api_request_free(&r);
}

#define MAX_RAW_MESSAGES 64
#define MAX_CONTENT (64 * 1024)

static void fuzz_raw(const fuzz_template *ft, const uint8_t *p, size_t len) {
    kvs_chat_message msgs[MAX_RAW_MESSAGES] = {0}; /* the tool fields stay NULL */
    char *owned[MAX_RAW_MESSAGES];
    int n = 0;
    size_t at = 0;
    while (at < len && n < MAX_RAW_MESSAGES) {
        const uint8_t *end = memchr(p + at, 0, len - at);
        size_t flen = end ? (size_t)(end - (p + at)) : len - at;
        const uint8_t *f = p + at;
        at += flen + 1;
        if (flen == 0) continue;
        msgs[n].role = roles[f[0] % (sizeof roles / sizeof *roles)];
        f++, flen--;
        size_t reps = 1;
        if (flen >= 2 && f[0] == 1) {
            reps = (size_t)f[1] + 1;
            f += 2, flen -= 2;
            while (reps > 1 && flen * reps > MAX_CONTENT) reps--;
        }
        char *c = malloc(flen * reps + 1);
        for (size_t r = 0; r < reps; r++) memcpy(c + r * flen, f, flen);
        c[flen * reps] = 0;
        owned[n] = c;
        msgs[n].content = c;
        n++;
    }
    if (n > 0) check(ft, msgs, n);
    for (int i = 0; i < n; i++) free(owned[i]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const fuzz_template *ft = &templates[(data[0] & 7) % N_TEMPLATES];
    if (data[0] & 8) fuzz_raw(ft, data + 1, size - 1);
    else fuzz_json(ft, (const char *)data + 1, size - 1);
    return 0;
}
