/* fuzz: the bundled model's tokenizer for the fuzz targets that need one, found
 * at $KVS_TOKENIZER_DIR, $KVS_SOURCE_DIR/models/tiny-needle-llama, beside the
 * executable's folder (../models/tiny-needle-llama) or ./models/tiny-needle-llama. */
#ifndef KVS_FUZZ_BUNDLED_TOKENIZER_H
#define KVS_FUZZ_BUNDLED_TOKENIZER_H

#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "tokenizer/tokenizer.h"

static bool fuzz_try_load(const char *dir, kvs_tokenizer **tok) {
    if (!dir || access(dir, R_OK) != 0) return false;
    return kvs_tokenizer_load(dir, tok) == KVS_OK;
}

/* Aborts with a message naming `target` when no copy loads. */
static kvs_tokenizer *fuzz_load_bundled_tokenizer(const char *target) {
    kvs_tokenizer *tok = NULL;
    char path[PATH_MAX + 64];
    const char *src = getenv("KVS_SOURCE_DIR");
    if (src) snprintf(path, sizeof path, "%s/models/tiny-needle-llama", src);
    bool ok = fuzz_try_load(getenv("KVS_TOKENIZER_DIR"), &tok) || (src && fuzz_try_load(path, &tok));
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (!ok && n > 0) {
        exe[n] = 0;
        snprintf(path, sizeof path, "%s/../models/tiny-needle-llama", dirname(exe));
        ok = fuzz_try_load(path, &tok);
    }
    if (!ok) ok = fuzz_try_load("models/tiny-needle-llama", &tok);
    if (!ok) {
        fprintf(stderr, "%s: cannot load the tokenizer (set KVS_TOKENIZER_DIR): %s\n", target, kvs_last_error());
        abort();
    }
    return tok;
}

#endif
