/* kvsparse tokenize: text -> ids (a JSON array), or --decode ids -> text. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "cli/cli_common.h"
#include "tokenizer/tokenizer.h"

static void tokenize_usage(FILE *f) {
    fprintf(f,
            "usage: kvsparse tokenize -m MODEL_DIR [--special] [--bos] TEXT\n"
            "       kvsparse tokenize -m MODEL_DIR --decode 1,2,3 [--skip-special]\n"
            "  -m, --model DIR   folder with tokenizer.json (+ tokenizer_config.json)\n"
            "  --special         special-token text (e.g. <|eot_id|>) becomes control tokens\n"
            "  --bos             add the post-processor's tokens (BOS/EOS)\n"
            "  --decode IDS      decode comma-separated ids instead of encoding\n"
            "  --skip-special    with --decode: leave special tokens out\n"
            "Prints the ids as a JSON array, or the decoded text.\n");
}

int kvs_cmd_tokenize(int argc, char **argv) {
    const char *dir = NULL, *text = NULL, *decode = NULL;
    bool special = false, bos = false, skip_special = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            tokenize_usage(stdout);
            return 0;
        } else if ((!strcmp(a, "-m") || !strcmp(a, "--model")) && i + 1 < argc) {
            dir = argv[++i];
        } else if (!strcmp(a, "--decode") && i + 1 < argc) {
            decode = argv[++i];
        } else if (!strcmp(a, "--special")) {
            special = true;
        } else if (!strcmp(a, "--bos")) {
            bos = true;
        } else if (!strcmp(a, "--skip-special")) {
            skip_special = true;
        } else if (a[0] == '-' && a[1] != 0) {
            fprintf(stderr, "kvsparse tokenize: unknown or incomplete option '%s'\n", a);
            tokenize_usage(stderr);
            return 2;
        } else if (!text) {
            text = a;
        } else {
            fprintf(stderr, "kvsparse tokenize: give the text as one argument (quote it)\n");
            return 2;
        }
    }
    if (!dir || (!text && !decode) || (text && decode)) {
        fprintf(stderr, "kvsparse tokenize: need -m MODEL_DIR and either TEXT or --decode IDS\n");
        tokenize_usage(stderr);
        return 2;
    }
    int32_t *ids = NULL;
    int n = 0;
    if (decode && !kvs_cli_parse_ids(decode, &ids, &n)) {
        fprintf(stderr, "kvsparse tokenize: --decode needs comma-separated ids, got '%s'\n", decode);
        return 2;
    }
    kvs_tokenizer *t;
    if (kvs_tokenizer_load(dir, &t) != KVS_OK) {
        free(ids);
        return kvs_cli_error();
    }
    kvs_status st;
    if (decode) {
        char *s = NULL;
        size_t len;
        st = kvs_tokenizer_decode(t, ids, n, skip_special, &s, &len);
        if (st == KVS_OK) fwrite(s, 1, len, stdout), putchar('\n');
        free(s);
    } else {
        st = kvs_tokenizer_encode(t, text, strlen(text), (kvs_encode_options){bos, special}, &ids, &n);
        if (st == KVS_OK) {
            printf("[");
            for (int i = 0; i < n; i++) printf("%s%d", i ? ", " : "", ids[i]);
            printf("]\n");
        }
    }
    free(ids);
    kvs_tokenizer_destroy(t);
    return st == KVS_OK ? 0 : kvs_cli_error();
}
