/* libFuzzer target: arbitrary bytes as a GGUF file. When it parses: every
 * tensor's first and last byte touched (its data must lie inside the buffer),
 * every key read as each type, each small tensor dequantized, and the file's
 * config (llama.* metadata through kvs_config_parse) and tokenizer
 * (tokenizer.ggml.* as a tokenizer.json) built, the tokenizer then encoding
 * and decoding a short text. Checked: a parsed tensor lies inside the buffer;
 * the tokenizer's ids are inside its vocabulary. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf/gguf.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"

#define MAX_DEQUANT (1 << 16) /* elements: larger tensors are touched, not dequantized */

static void read_keys(const kvs_gguf *g) {
    for (size_t i = 0; i < g->n_kvs; i++) {
        const char *k = g->kvs[i].key;
        int64_t v;
        double d;
        bool b;
        kvs_gguf_str s;
        const kvs_gguf_kv *a;
        kvs_gguf_get_int(g, k, true, &v);
        kvs_gguf_get_float(g, k, true, &d);
        kvs_gguf_get_bool(g, k, &b);
        kvs_gguf_get_str(g, k, true, &s);
        if (kvs_gguf_get_array(g, k, KVS_GGUF_I32, true, &a) == KVS_OK)
            for (uint64_t j = 0; j < a->count; j++) v ^= kvs_gguf_array_int(a, j);
        if (kvs_gguf_get_array(g, k, KVS_GGUF_STRING, true, &a) == KVS_OK)
            for (uint64_t j = 0; j < a->count; j++) v ^= a->strs[j].len ? (uint8_t)a->strs[j].s[a->strs[j].len - 1] : 0;
        (void)v;
    }
}

static void tensors(const kvs_gguf *g, const uint8_t *buf, size_t len) {
    float *out = malloc(MAX_DEQUANT * sizeof *out);
    for (size_t i = 0; i < g->n_tensors && out; i++) {
        const kvs_gguf_tensor *t = &g->tensors[i];
        if (t->nbytes && (t->data < buf || t->data + t->nbytes > buf + len)) abort();
        volatile uint8_t sink = t->nbytes ? t->data[0] ^ t->data[t->nbytes - 1] : 0;
        (void)sink;
        int64_t n = t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
        if (n <= MAX_DEQUANT) kvs_ggml_dequantize(t->type, t->data, out, n, t->name);
    }
    free(out);
}

static void tokenizer(const kvs_gguf *g) {
    kvs_tokenizer *tok;
    if (kvs_tokenizer_from_gguf(g, &tok) != KVS_OK) return;
    static const char text[] = "Hello <|eot_id|> world 123 \xc3\xa9t\xc3\xa9";
    int32_t *ids;
    int n;
    kvs_encode_options o = {.add_special_tokens = true, .parse_special = true};
    if (kvs_tokenizer_encode(tok, text, sizeof text - 1, o, &ids, &n) == KVS_OK) {
        for (int i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= kvs_tokenizer_vocab_size(tok)) abort();
        char *dec;
        size_t len;
        if (kvs_tokenizer_decode(tok, ids, n, false, &dec, &len) == KVS_OK) free(dec);
        free(ids);
    }
    kvs_tokenizer_destroy(tok);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    kvs_gguf *g;
    if (kvs_gguf_parse(data, size, "fuzz.gguf", &g) != KVS_OK) return 0;
    read_keys(g);
    tensors(g, data, size);
    kvs_config cfg;
    kvs_gguf_config(g, &cfg);
    tokenizer(g);
    kvs_gguf_destroy(g);
    return 0;
}
