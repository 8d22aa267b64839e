/* kvsparse bench tokenizer: tokenizer.json load time and single-threaded encode speed. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "tokenizer/tokenizer.h"

static void bench_usage(FILE *f) {
    fprintf(f,
            "usage: kvsparse bench tokenizer -m DIR [--text FILE] [--mb N]\n"
            "  -m, --model DIR   folder with tokenizer.json\n"
            "  --text FILE       English text to encode (default: the project's README/docs\n"
            "                    markdown files and fixture texts, repeated to --mb)\n"
            "  --mb N            size of the default text in MB (default 8)\n");
}

static bool append(char **buf, size_t *len, size_t *cap, const char *s, size_t n) {
    if (*len + n + 1 > *cap) {
        size_t c = *cap ? *cap : 1 << 20;
        while (c < *len + n + 1) c *= 2;
        char *b = realloc(*buf, c);
        if (!b) return false;
        *buf = b;
        *cap = c;
    }
    memcpy(*buf + *len, s, n);
    *len += n;
    (*buf)[*len] = 0;
    return true;
}

/* Markdown under a folder (one level), appended to the buffer. */
static void add_markdown(const char *dir, char **buf, size_t *len, size_t *cap) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t n = strlen(e->d_name);
        if (n < 4 || strcmp(e->d_name + n - 3, ".md")) continue;
        char path[4096], *text;
        size_t tl;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (kvs_read_file(path, &text, &tl) == KVS_OK) {
            append(buf, len, cap, text, tl);
            append(buf, len, cap, "\n\n", 2);
            free(text);
        }
    }
    closedir(d);
}

static char *default_text(size_t target, size_t *out_len) {
    char *seed = NULL, *buf = NULL;
    size_t sl = 0, sc = 0, len = 0, cap = 0;
    const char *dirs[] = {".", "docs", "models/tiny-needle-llama", "../shared", "../shared/fixtures/tokenizers"};
    for (size_t i = 0; i < sizeof dirs / sizeof *dirs; i++) add_markdown(dirs[i], &seed, &sl, &sc);
    if (sl == 0) {
        const char *s = "The quick brown fox jumps over the lazy dog. It's 5 o'clock somewhere, isn't it?\n";
        append(&seed, &sl, &sc, s, strlen(s));
    }
    while (len < target && append(&buf, &len, &cap, seed, sl)) {}
    free(seed);
    *out_len = len;
    return buf;
}

int kvs_cmd_bench_tokenizer(int argc, char **argv) {
    const char *dir = NULL, *text_path = NULL;
    double mb = 8;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            bench_usage(stdout);
            return 0;
        } else if ((!strcmp(argv[i], "-m") || !strcmp(argv[i], "--model")) && i + 1 < argc) {
            dir = argv[++i];
        } else if (!strcmp(argv[i], "--text") && i + 1 < argc) {
            text_path = argv[++i];
        } else if (!strcmp(argv[i], "--mb") && i + 1 < argc) {
            mb = atof(argv[++i]);
        } else {
            fprintf(stderr, "kvsparse bench tokenizer: unknown or incomplete option '%s'\n", argv[i]);
            bench_usage(stderr);
            return 2;
        }
    }
    if (!dir || mb <= 0 || mb > 4096) {
        fprintf(stderr, "kvsparse bench tokenizer: need -m DIR (and --mb in (0, 4096])\n");
        bench_usage(stderr);
        return 2;
    }
    char *text;
    size_t len;
    if (text_path) {
        if (kvs_read_file(text_path, &text, &len) != KVS_OK) {
            fprintf(stderr, "kvsparse: %s\n", kvs_last_error());
            return 1;
        }
    } else {
        text = default_text((size_t)(mb * 1e6), &len);
        if (!text) {
            fprintf(stderr, "kvsparse bench tokenizer: out of memory\n");
            return 1;
        }
    }
    double t0 = kvs_now();
    kvs_tokenizer *t;
    if (kvs_tokenizer_load(dir, &t) != KVS_OK) {
        fprintf(stderr, "kvsparse: %s\n", kvs_last_error());
        free(text);
        return 1;
    }
    double load_s = kvs_now() - t0;
    int32_t *ids;
    int n;
    t0 = kvs_now();
    kvs_status st = kvs_tokenizer_encode(t, text, len, (kvs_encode_options){false, false}, &ids, &n);
    double enc_s = kvs_now() - t0;
    if (st != KVS_OK) {
        fprintf(stderr, "kvsparse: %s\n", kvs_last_error());
        free(text);
        kvs_tokenizer_destroy(t);
        return 1;
    }
    char *back = NULL;
    size_t back_len = 0;
    t0 = kvs_now();
    st = kvs_tokenizer_decode(t, ids, n, false, &back, &back_len);
    double dec_s = kvs_now() - t0;
    printf("tokenizer        %s (vocab %d)\n", dir, kvs_tokenizer_vocab_size(t));
    printf("load             %.1f ms\n", load_s * 1e3);
    printf("text             %.2f MB (%s)\n", len / 1e6, text_path ? text_path : "project markdown, repeated");
    printf("encode           %.2f MB/s single-threaded (%d tokens, %.2f bytes/token, %.0f ms)\n",
           len / 1e6 / enc_s, n, n ? (double)len / n : 0.0, enc_s * 1e3);
    if (st == KVS_OK)
        printf("decode           %.2f MB/s (round trip %s)\n", len / 1e6 / dec_s,
               back_len == len && !memcmp(back, text, len) ? "exact" : "differs");
    free(back);
    free(ids);
    free(text);
    kvs_tokenizer_destroy(t);
    return 0;
}
