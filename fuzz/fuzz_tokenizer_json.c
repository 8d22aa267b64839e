/* libFuzzer target: arbitrary bytes as tokenizer.json; when they load, encode and
 * decode (also streaming) a little text. Nothing may crash, leak or read out of bounds. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tokenizer.h"

static const char *const texts[] = {
    "Hello, world! It's 2024: caf\xC3\xA9 \xE4\xBD\xA0\xE5\xA5\xBD \xF0\x9F\x98\x80\n\n  tabs\tand  spaces ",
    "<s>[INST] hi [/INST]</s><|eot_id|><unk>ab a12zz",
    "",
};

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    kvs_tokenizer *t = NULL;
    if (kvs_tokenizer_parse((const char *)data, size, NULL, 0, &t) != KVS_OK) return 0;
    for (size_t k = 0; k < sizeof texts / sizeof *texts; k++) {
        int32_t *ids = NULL;
        int n = 0;
        kvs_encode_options opt = {.add_special_tokens = k == 0, .parse_special = k == 1};
        if (kvs_tokenizer_encode(t, texts[k], strlen(texts[k]), opt, &ids, &n) != KVS_OK) continue;
        char *text = NULL;
        if (kvs_tokenizer_decode(t, ids, n, k == 2, &text, NULL) == KVS_OK) free(text);
        kvs_detokenizer *d = kvs_detokenizer_create(t, false);
        for (int i = 0; d && i <= n; i++) {
            const char *piece;
            size_t len;
            if (i < n) kvs_detokenizer_push(d, ids[i], &piece, &len);
            else kvs_detokenizer_finish(d, &piece, &len);
        }
        kvs_detokenizer_destroy(d);
        free(ids);
    }
    /* out-of-range ids decode to nothing */
    int32_t odd[] = {-1, 0, 1, 2, 3, 1 << 30, kvs_tokenizer_vocab_size(t)};
    char *text = NULL;
    if (kvs_tokenizer_decode(t, odd, 7, false, &text, NULL) == KVS_OK) free(text);
    kvs_tokenizer_destroy(t);
    return 0;
}
