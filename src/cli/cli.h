/* cli: the kvsparse subcommands. Each returns the process exit status. */
#ifndef KVS_CLI_H
#define KVS_CLI_H

int kvs_cmd_generate(int argc, char **argv);       /* cmd_generate.c */
int kvs_cmd_info(int argc, char **argv);           /* cmd_info.c */
int kvs_cmd_tokenize(int argc, char **argv);       /* cmd_tokenize.c */
int kvs_cmd_bench(int argc, char **argv);          /* cmd_bench.c: bench model | tokenizer */
int kvs_cmd_bench_tokenizer(int argc, char **argv); /* cmd_bench_tokenizer.c */

#endif
