#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: kvsparse COMMAND [options]\n"
            "  generate -m MODEL_DIR (-p TEXT | -f FILE | --prompt-ids 1,2,3) [-n N] [sampling options] [--json]\n"
            "  info     -m MODEL_DIR [--memory GiB]\n"
            "  tokenize -m MODEL_DIR [--special] (TEXT | --decode 1,2,3)\n"
            "  serve    -m MODEL_DIR [--host H] [--port P] [engine and KV policy options]\n"
            "  eval     retrieval | multiturn -m MODEL_DIR --data FILE.jsonl [KV policy options] | ppl -m MODEL_DIR --text FILE\n"
            "  bench    model | tokenizer | throughput | serve  (see --help of each)\n"
            "  convert  -m MODEL --out FILE.gguf [--type f32|bf16|f16|q8_0|q4_k_m]\n"
            "  calibrate -m MODEL_DIR --data FILE.jsonl [--out PROFILE.json] [--plot DIR]\n"
            "  -h, --help     this help\n"
            "  -V, --version  print the version and exit\n"
            "Run 'kvsparse COMMAND --help' for a command's options.\n");
}

/* OpenMP threads that spin between parallel regions starve the other threads
 * (and every other process) on a busy machine: decode ran 10-20x slower with
 * the default policy on 2 shared cores. libgomp reads OMP_WAIT_POLICY when it
 * loads, so set it and re-execute once unless the user chose a policy. */
static void prefer_passive_openmp(char **argv) {
    if (getenv("OMP_WAIT_POLICY")) return;
    setenv("OMP_WAIT_POLICY", "passive", 1);
    execv("/proc/self/exe", argv); /* returns only on failure: carry on */
}

int main(int argc, char **argv) {
    prefer_passive_openmp(argv);
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "--version") || !strcmp(argv[1], "-V")) {
        printf("kvsparse %s (git %s)\n", KVS_VERSION, KVS_GIT_HASH);
        return 0;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "generate")) return kvs_cmd_generate(argc - 1, argv + 1);
    if (!strcmp(cmd, "info")) return kvs_cmd_info(argc - 1, argv + 1);
    if (!strcmp(cmd, "tokenize")) return kvs_cmd_tokenize(argc - 1, argv + 1);
    if (!strcmp(cmd, "bench")) return kvs_cmd_bench(argc - 1, argv + 1);
    if (!strcmp(cmd, "serve")) return kvs_cmd_serve(argc - 1, argv + 1);
    if (!strcmp(cmd, "eval")) return kvs_cmd_eval(argc - 1, argv + 1);
    if (!strcmp(cmd, "convert")) return kvs_cmd_convert(argc - 1, argv + 1);
    if (!strcmp(cmd, "calibrate")) return kvs_cmd_calibrate(argc - 1, argv + 1);
    fprintf(stderr, "kvsparse: unknown command '%s'\n", cmd);
    usage(stderr);
    return 2;
}
