#include <stdio.h>
#include <string.h>

#include "cli/cli.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: kvsparse COMMAND [options]\n"
            "  generate -m MODEL_DIR (-p TEXT | --prompt-ids 1,2,3) [-n N] [sampling options] [--json]\n"
            "  info     -m MODEL_DIR [--memory GiB]\n"
            "  tokenize -m MODEL_DIR [--special] (TEXT | --decode 1,2,3)\n"
            "  serve    -m MODEL_DIR [--host H] [--port P] [engine and KV policy options]\n"
            "  eval     retrieval -m MODEL_DIR --data FILE.jsonl [KV policy options] | ppl -m MODEL_DIR --text FILE\n"
            "  bench    model | tokenizer | throughput | serve  (see --help of each)\n"
            "Run 'kvsparse COMMAND --help' for a command's options.\n");
}

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "generate")) return kvs_cmd_generate(argc - 1, argv + 1);
    if (!strcmp(cmd, "info")) return kvs_cmd_info(argc - 1, argv + 1);
    if (!strcmp(cmd, "tokenize")) return kvs_cmd_tokenize(argc - 1, argv + 1);
    if (!strcmp(cmd, "bench")) return kvs_cmd_bench(argc - 1, argv + 1);
    if (!strcmp(cmd, "serve")) return kvs_cmd_serve(argc - 1, argv + 1);
    if (!strcmp(cmd, "eval")) return kvs_cmd_eval(argc - 1, argv + 1);
    fprintf(stderr, "kvsparse: unknown command '%s'\n", cmd);
    usage(stderr);
    return 2;
}
