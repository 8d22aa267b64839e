/* cli: the kvsparse subcommands. Each returns the process exit status. */
#ifndef KVS_CLI_H
#define KVS_CLI_H

int kvs_cmd_generate(int argc, char **argv);       /* cmd_generate.c */
int kvs_cmd_info(int argc, char **argv);           /* cmd_info.c */
int kvs_cmd_tokenize(int argc, char **argv);       /* cmd_tokenize.c */
int kvs_cmd_bench(int argc, char **argv);          /* cmd_bench.c: bench model | tokenizer */
int kvs_cmd_bench_tokenizer(int argc, char **argv); /* cmd_bench_tokenizer.c */
int kvs_cmd_bench_throughput(int argc, char **argv); /* cmd_bench_throughput.c */
int kvs_cmd_bench_serve(int argc, char **argv);   /* cmd_bench_serve.c */
int kvs_cmd_serve(int argc, char **argv);         /* cmd_serve.c */
int kvs_cmd_eval(int argc, char **argv);          /* cmd_eval.c: eval retrieval | ppl */
int kvs_cmd_calibrate(int argc, char **argv);     /* cmd_calibrate.c */
int kvs_cmd_convert(int argc, char **argv);       /* cmd_convert.c: a model as a GGUF file */

#endif
