/* gguf: llama.cpp's model file (GGUF v2/v3): the header, its metadata
 * (typed key/values, arrays included), the tensor infos over the mmap'd data,
 * ggml's weight formats (block layouts, a scalar dequantizer for each
 * supported one, llama.cpp's reference quantizers for Q8_0, Q4_K, Q5_K and
 * Q6_K) and a writer of GGUF v3 files (gguf_write.c). A module of its own
 * below model and tokenizer: the model reads the hyper-parameters and weights
 * of a .gguf, the tokenizer its vocabulary; kvsparse convert writes one.
 * Uses core only. */
#ifndef KVS_GGUF_H
#define KVS_GGUF_H

#include "core/core.h"

#include <stdio.h>

/* ---- metadata value types (the file's ids) ---------------------------------- */
typedef enum {
    KVS_GGUF_U8 = 0, KVS_GGUF_I8 = 1, KVS_GGUF_U16 = 2, KVS_GGUF_I16 = 3, KVS_GGUF_U32 = 4, KVS_GGUF_I32 = 5,
    KVS_GGUF_F32 = 6, KVS_GGUF_BOOL = 7, KVS_GGUF_STRING = 8, KVS_GGUF_ARRAY = 9, KVS_GGUF_U64 = 10,
    KVS_GGUF_I64 = 11, KVS_GGUF_F64 = 12, KVS_GGUF_TYPE_COUNT
} kvs_gguf_type;
const char *kvs_gguf_type_name(kvs_gguf_type t);

/* A string in the file: not NUL-terminated. */
typedef struct {
    const char *s;
    size_t len;
} kvs_gguf_str;

typedef struct kvs_gguf_kv {
    char *key;              /* NUL-terminated copy */
    kvs_gguf_type type;
    /* scalars: the value's bytes in the file (little-endian); strings: str */
    const uint8_t *data;
    kvs_gguf_str str;
    /* arrays: element type and count; elements at data (fixed-size types) or
       strs[count] (strings); an array of arrays is parsed and checked but its
       elements are not exposed */
    kvs_gguf_type elem_type;
    uint64_t count;
    kvs_gguf_str *strs;
} kvs_gguf_kv;

/* ---- ggml tensor types ------------------------------------------------------- */
typedef enum {
    KVS_GGML_F32 = 0, KVS_GGML_F16 = 1, KVS_GGML_Q4_0 = 2, KVS_GGML_Q4_1 = 3, KVS_GGML_Q5_0 = 6,
    KVS_GGML_Q5_1 = 7, KVS_GGML_Q8_0 = 8, KVS_GGML_Q8_1 = 9, KVS_GGML_Q2_K = 10, KVS_GGML_Q3_K = 11,
    KVS_GGML_Q4_K = 12, KVS_GGML_Q5_K = 13, KVS_GGML_Q6_K = 14, KVS_GGML_Q8_K = 15, KVS_GGML_BF16 = 30,
} kvs_ggml_type;

/* The layout of ggml type id: name, elements per block, bytes per block.
 * false for ids this table does not know (removed or newer than it). */
typedef struct {
    const char *name;
    int block;       /* elements per block */
    int block_bytes; /* bytes per block */
} kvs_ggml_layout;
bool kvs_ggml_type_layout(uint32_t id, kvs_ggml_layout *out);

typedef struct {
    char *name;            /* NUL-terminated copy */
    int n_dims;            /* 1..4 */
    int64_t ne[4];         /* ggml order: ne[0] is the row (fastest); unused dims 1 */
    uint32_t type;         /* a known ggml type id */
    uint64_t offset;       /* from the data section's start */
    const uint8_t *data;   /* in the file */
    size_t nbytes;
} kvs_gguf_tensor;

typedef struct kvs_gguf {
    char *file_name;       /* for messages (a copy) */
    uint32_t version;
    uint64_t alignment;
    kvs_gguf_kv *kvs;
    size_t n_kvs;
    kvs_gguf_tensor *tensors; /* in file order */
    size_t n_tensors;
    const uint8_t *base;      /* the whole file */
    size_t size;
    size_t data_start;        /* the data section's offset */
    kvs_mapped_file map;      /* kvs_gguf_open's mapping (none for kvs_gguf_parse) */
    kvs_gguf_kv **kvs_by_key;             /* sorted, for look-ups */
    kvs_gguf_tensor **tensors_by_name;
} kvs_gguf;

/* Whether path names a GGUF file (ends in ".gguf"). */
bool kvs_gguf_is_path(const char *path);
/* Parses buf (which must outlive the result). Checks every count against the
 * bytes left before allocating, every offset and size for overflow, general.
 * alignment (a power of two), each tensor's type, shape and data (aligned,
 * inside the file, no overlap); fails with KVS_ERR_FORMAT (KVS_ERR_UNSUPPORTED
 * for other versions and unknown ggml type ids) naming what is wrong. */
kvs_status kvs_gguf_parse(const uint8_t *buf, size_t len, const char *file_name, kvs_gguf **out);
/* Maps path and parses it. */
kvs_status kvs_gguf_open(const char *path, kvs_gguf **out);
void kvs_gguf_destroy(kvs_gguf *g);

const kvs_gguf_kv *kvs_gguf_find(const kvs_gguf *g, const char *key);
const kvs_gguf_tensor *kvs_gguf_find_tensor(const kvs_gguf *g, const char *name);

/* Typed reads of a key: absent leaves *out and returns KVS_OK (required:
 * fails naming the key); a value of another type fails naming the key and
 * both types. Integers of any integer type that fit; floats from F32/F64. */
kvs_status kvs_gguf_get_int(const kvs_gguf *g, const char *key, bool required, int64_t *out);
kvs_status kvs_gguf_get_float(const kvs_gguf *g, const char *key, bool required, double *out);
kvs_status kvs_gguf_get_bool(const kvs_gguf *g, const char *key, bool *out);
kvs_status kvs_gguf_get_str(const kvs_gguf *g, const char *key, bool required, kvs_gguf_str *out);
/* An array of elem_type (any integer type for KVS_GGUF_I32: read with
 * kvs_gguf_array_int); NULL *out when absent and not required. */
kvs_status kvs_gguf_get_array(const kvs_gguf *g, const char *key, kvs_gguf_type elem_type, bool required,
                              const kvs_gguf_kv **out);
/* Element i of an integer array (bounds are the caller's: i < count). */
int64_t kvs_gguf_array_int(const kvs_gguf_kv *kv, uint64_t i);

/* ---- weight formats (quant.c) -------------------------------------------------
 * Dequantizes n elements (a multiple of the type's block) of ggml type id from
 * src into dst. Supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
 * Q5_K, Q6_K; others fail naming the type. A block whose fp16 scale is inf or
 * NaN fails naming what (the caller's name for the data) and the block. */
kvs_status kvs_ggml_dequantize(uint32_t type, const void *src, float *dst, int64_t n, const char *what);
bool kvs_ggml_can_dequantize(uint32_t type);
/* Q8_0 as llama.cpp's reference quantizer writes it: per block of 32, d =
 * amax / 127 (stored as fp16), q = round(x / d) (halves away from zero), 0
 * where amax is 0. n a multiple of 32; dst holds n / 32 blocks of 34 bytes. */
void kvs_ggml_quantize_q8_0(const float *src, void *dst, int64_t n);
/* Quantizes n elements (a multiple of the type's block) of src into dst (n /
 * block blocks) as llama.cpp's reference quantizers do without an importance
 * matrix (quantize_row_*_ref: the same scale searches and roundings, so the
 * same bytes up to float ties; quant_k.c). Supported: Q8_0, Q5_0, Q4_K, Q5_K, Q6_K;
 * other types fail naming the type. Deterministic. */
kvs_status kvs_ggml_quantize(uint32_t type, const float *src, void *dst, int64_t n);
bool kvs_ggml_can_quantize(uint32_t type);

/* ---- writing a GGUF v3 file (gguf_write.c) ------------------------------------
 * Metadata and tensor infos are collected first (keys unique, in the order
 * set), then kvs_gguf_writer_write_header writes the header, key/values and
 * tensor infos with the data section aligned to KVS_GGUF_WRITE_ALIGNMENT
 * (written as general.alignment), then each tensor's data in the order added
 * (kvs_gguf_writer_write_data pads every one to the alignment). Errors name
 * the key, the tensor or the file. */
#define KVS_GGUF_WRITE_ALIGNMENT 32
typedef struct kvs_gguf_writer kvs_gguf_writer;
kvs_status kvs_gguf_writer_create(kvs_gguf_writer **out);
void kvs_gguf_writer_destroy(kvs_gguf_writer *w);
kvs_status kvs_gguf_set_u32(kvs_gguf_writer *w, const char *key, uint32_t v);
kvs_status kvs_gguf_set_i32(kvs_gguf_writer *w, const char *key, int32_t v);
kvs_status kvs_gguf_set_f32(kvs_gguf_writer *w, const char *key, float v);
kvs_status kvs_gguf_set_bool(kvs_gguf_writer *w, const char *key, bool v);
kvs_status kvs_gguf_set_str(kvs_gguf_writer *w, const char *key, const char *s, size_t len);
/* An array of n fixed-size elements of type elem (integers, floats, bool;
 * little-endian host layout) at data. */
kvs_status kvs_gguf_set_array(kvs_gguf_writer *w, const char *key, kvs_gguf_type elem, const void *data, size_t n);
/* An array of n strings (strs[i] of lens[i] bytes; lens NULL: NUL-terminated). */
kvs_status kvs_gguf_set_str_array(kvs_gguf_writer *w, const char *key, const char *const *strs, const size_t *lens,
                                  size_t n);
/* A key/value of a parsed file as it is (arrays of arrays refused, naming the key). */
kvs_status kvs_gguf_copy_kv(kvs_gguf_writer *w, const kvs_gguf_kv *kv);
/* Declares the next tensor: ggml type id, n_dims dims ne (fastest first);
 * the row (ne[0]) must be whole blocks of the type. */
kvs_status kvs_gguf_add_tensor(kvs_gguf_writer *w, const char *name, uint32_t type, int n_dims, const int64_t *ne);
/* Bytes of the declared tensor i's data. */
size_t kvs_gguf_writer_tensor_bytes(const kvs_gguf_writer *w, size_t i);
kvs_status kvs_gguf_writer_write_header(kvs_gguf_writer *w, FILE *f, const char *path);
/* The next tensor's data (exactly its bytes), then its padding. */
kvs_status kvs_gguf_writer_write_data(kvs_gguf_writer *w, FILE *f, const char *path, const void *data, size_t nbytes);

#endif
