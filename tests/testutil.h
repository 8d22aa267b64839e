/* Helpers shared by the tests: where things are, fixtures, comparisons. */
#ifndef KVS_TESTUTIL_H
#define KVS_TESTUTIL_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

/* $KVS_SOURCE_DIR/rel and $KVS_SHARED_DIR/rel (static buffers, 4 of each, rotating) */
const char *src_path(const char *rel);
const char *shared_path(const char *rel);
/* The path of the built kvsparse binary ($KVS_BINARY). */
const char *kvsparse_binary(void);

/* Reads a JSONL file: returns a JSON array of the lines' objects. */
json_t *load_jsonl(const char *path);
json_t *load_json(const char *path);

/* Decodes base64 of little-endian float32; returns malloc'ed array, *n floats. */
float *b64_floats(const char *b64, size_t *n);
/* ids from a JSON array of integers; malloc'ed. */
int32_t *json_ids(const json_t *arr, int *n);

/* max|a-b| / max|b| */
double rel_max_diff(const float *a, const float *b, size_t n);
int argmax_f(const float *x, int n);

/* Writes text into a fresh temporary directory's file; returns the dir path (static buffer). */
const char *make_temp_dir(void);
void write_file(const char *dir, const char *name, const void *data, size_t len);
/* Runs a shell command; captures combined output into *out (malloc'ed); returns exit status. */
int run_capture(const char *cmd, char **out);

#endif
