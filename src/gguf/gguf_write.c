/* Writing a GGUF v3 file: what kvs_gguf_parse reads, little-endian.
 *   "GGUF" u32 version=3 u64 n_tensors u64 n_kv
 *   n_kv x { string key; u32 type; value }          string = u64 len + bytes
 *   n_tensors x { string name; u32 n_dims; u64 ne[n_dims]; u32 type; u64 offset }
 *   padding to the alignment, then the data section: each tensor at its offset
 *   (a multiple of the alignment from the section's start).
 * The key/values are encoded as they are set into one growing buffer, the
 * tensor infos kept apart until the header is written; the data streams after. */
#include "gguf/gguf.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
    uint8_t *p;
    size_t len, cap;
} buf;

typedef struct {
    char *name;
    uint32_t type;
    int n_dims;
    int64_t ne[4];
    uint64_t offset, nbytes;
} tensor_info;

struct kvs_gguf_writer {
    buf kv;          /* the encoded key/values */
    char **keys;     /* for the duplicate check */
    size_t n_kv;
    tensor_info *tensors;
    size_t n_tensors, cap_tensors;
    uint64_t data_size; /* the data section so far, padded */
    size_t next;        /* the next tensor whose data is written */
    bool header_done;
};

static kvs_status put(buf *b, const void *p, size_t n) {
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + n) cap *= 2;
        uint8_t *q = realloc(b->p, cap);
        if (!q) return kvs_fail(KVS_ERR_NOMEM, "out of memory writing GGUF metadata");
        b->p = q;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->len, p, n);
    b->len += n;
    return KVS_OK;
}

static kvs_status put_u32(buf *b, uint32_t v) {
    uint8_t x[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    return put(b, x, 4);
}

static kvs_status put_u64(buf *b, uint64_t v) {
    uint8_t x[8];
    for (int i = 0; i < 8; i++) x[i] = (uint8_t)(v >> (8 * i));
    return put(b, x, 8);
}

static kvs_status put_str(buf *b, const char *s, size_t len) {
    KVS_TRY(put_u64(b, len));
    return put(b, s, len);
}

kvs_status kvs_gguf_writer_create(kvs_gguf_writer **out) {
    *out = calloc(1, sizeof **out);
    return *out ? KVS_OK : kvs_fail(KVS_ERR_NOMEM, "out of memory");
}

void kvs_gguf_writer_destroy(kvs_gguf_writer *w) {
    if (!w) return;
    free(w->kv.p);
    for (size_t i = 0; i < w->n_kv; i++) free(w->keys[i]);
    free(w->keys);
    for (size_t i = 0; i < w->n_tensors; i++) free(w->tensors[i].name);
    free(w->tensors);
    free(w);
}

/* The key's string and value type: unique, not empty, set before the header. */
static kvs_status begin_kv(kvs_gguf_writer *w, const char *key, kvs_gguf_type type) {
    if (w->header_done) return kvs_fail(KVS_ERR_INVALID, "GGUF key '%s' set after the header was written", key);
    if (!key || !*key) return kvs_fail(KVS_ERR_INVALID, "a GGUF key is empty");
    for (size_t i = 0; i < w->n_kv; i++)
        if (!strcmp(w->keys[i], key)) return kvs_fail(KVS_ERR_INVALID, "GGUF key '%s' set twice", key);
    char **keys = realloc(w->keys, (w->n_kv + 1) * sizeof *keys);
    if (!keys) return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    w->keys = keys;
    if (!(keys[w->n_kv] = strdup(key))) return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    w->n_kv++;
    KVS_TRY(put_str(&w->kv, key, strlen(key)));
    return put_u32(&w->kv, (uint32_t)type);
}

kvs_status kvs_gguf_set_u32(kvs_gguf_writer *w, const char *key, uint32_t v) {
    KVS_TRY(begin_kv(w, key, KVS_GGUF_U32));
    return put_u32(&w->kv, v);
}

kvs_status kvs_gguf_set_i32(kvs_gguf_writer *w, const char *key, int32_t v) {
    KVS_TRY(begin_kv(w, key, KVS_GGUF_I32));
    return put_u32(&w->kv, (uint32_t)v);
}

kvs_status kvs_gguf_set_f32(kvs_gguf_writer *w, const char *key, float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    KVS_TRY(begin_kv(w, key, KVS_GGUF_F32));
    return put_u32(&w->kv, u);
}

kvs_status kvs_gguf_set_bool(kvs_gguf_writer *w, const char *key, bool v) {
    uint8_t b = v;
    KVS_TRY(begin_kv(w, key, KVS_GGUF_BOOL));
    return put(&w->kv, &b, 1);
}

kvs_status kvs_gguf_set_str(kvs_gguf_writer *w, const char *key, const char *s, size_t len) {
    KVS_TRY(begin_kv(w, key, KVS_GGUF_STRING));
    return put_str(&w->kv, s, len);
}

static int elem_size(kvs_gguf_type t) {
    switch (t) {
    case KVS_GGUF_U8: case KVS_GGUF_I8: case KVS_GGUF_BOOL: return 1;
    case KVS_GGUF_U16: case KVS_GGUF_I16: return 2;
    case KVS_GGUF_U32: case KVS_GGUF_I32: case KVS_GGUF_F32: return 4;
    case KVS_GGUF_U64: case KVS_GGUF_I64: case KVS_GGUF_F64: return 8;
    default: return 0;
    }
}

kvs_status kvs_gguf_set_array(kvs_gguf_writer *w, const char *key, kvs_gguf_type elem, const void *data, size_t n) {
    int size = elem_size(elem);
    if (!size)
        return kvs_fail(KVS_ERR_INVALID, "GGUF key '%s': arrays of %s are written with kvs_gguf_set_str_array, or not "
                        "at all", key, kvs_gguf_type_name(elem));
    KVS_TRY(begin_kv(w, key, KVS_GGUF_ARRAY));
    KVS_TRY(put_u32(&w->kv, (uint32_t)elem));
    KVS_TRY(put_u64(&w->kv, n));
    return put(&w->kv, data, n * (size_t)size); /* GGUF is little-endian, as the hosts kvsparse runs on */
}

kvs_status kvs_gguf_set_str_array(kvs_gguf_writer *w, const char *key, const char *const *strs, const size_t *lens,
                                  size_t n) {
    KVS_TRY(begin_kv(w, key, KVS_GGUF_ARRAY));
    KVS_TRY(put_u32(&w->kv, KVS_GGUF_STRING));
    KVS_TRY(put_u64(&w->kv, n));
    for (size_t i = 0; i < n; i++) KVS_TRY(put_str(&w->kv, strs[i], lens ? lens[i] : strlen(strs[i])));
    return KVS_OK;
}

kvs_status kvs_gguf_copy_kv(kvs_gguf_writer *w, const kvs_gguf_kv *kv) {
    if (kv->type == KVS_GGUF_STRING) return kvs_gguf_set_str(w, kv->key, kv->str.s, kv->str.len);
    if (kv->type != KVS_GGUF_ARRAY) {
        int size = elem_size(kv->type);
        if (!size) return kvs_fail(KVS_ERR_INVALID, "GGUF key '%s': value type %d cannot be copied", kv->key, kv->type);
        KVS_TRY(begin_kv(w, kv->key, kv->type));
        return put(&w->kv, kv->data, (size_t)size);
    }
    if (kv->elem_type == KVS_GGUF_STRING) {
        KVS_TRY(begin_kv(w, kv->key, KVS_GGUF_ARRAY));
        KVS_TRY(put_u32(&w->kv, KVS_GGUF_STRING));
        KVS_TRY(put_u64(&w->kv, kv->count));
        for (uint64_t i = 0; i < kv->count; i++) KVS_TRY(put_str(&w->kv, kv->strs[i].s, kv->strs[i].len));
        return KVS_OK;
    }
    if (!elem_size(kv->elem_type))
        return kvs_fail(KVS_ERR_UNSUPPORTED, "GGUF key '%s': an array of %s cannot be copied", kv->key,
                        kvs_gguf_type_name(kv->elem_type));
    return kvs_gguf_set_array(w, kv->key, kv->elem_type, kv->data, (size_t)kv->count);
}

static bool has_key(const kvs_gguf_writer *w, const char *key) {
    for (size_t i = 0; i < w->n_kv; i++)
        if (!strcmp(w->keys[i], key)) return true;
    return false;
}

static uint64_t pad_to(uint64_t x) { return (x + KVS_GGUF_WRITE_ALIGNMENT - 1) / KVS_GGUF_WRITE_ALIGNMENT * KVS_GGUF_WRITE_ALIGNMENT; }

kvs_status kvs_gguf_add_tensor(kvs_gguf_writer *w, const char *name, uint32_t type, int n_dims, const int64_t *ne) {
    kvs_ggml_layout lay;
    if (w->header_done) return kvs_fail(KVS_ERR_INVALID, "GGUF tensor '%s' added after the header was written", name);
    if (!kvs_ggml_type_layout(type, &lay)) return kvs_fail(KVS_ERR_INVALID, "GGUF tensor '%s': ggml type id %u is unknown", name, type);
    if (n_dims < 1 || n_dims > 4) return kvs_fail(KVS_ERR_INVALID, "GGUF tensor '%s': %d dimensions (1 to 4)", name, n_dims);
    for (size_t i = 0; i < w->n_tensors; i++)
        if (!strcmp(w->tensors[i].name, name)) return kvs_fail(KVS_ERR_INVALID, "GGUF tensor '%s' added twice", name);
    uint64_t n = 1;
    for (int d = 0; d < n_dims; d++) {
        if (ne[d] <= 0 || n > UINT64_MAX / 2 / (uint64_t)ne[d])
            return kvs_fail(KVS_ERR_INVALID, "GGUF tensor '%s': dimension %d is %lld", name, d, (long long)ne[d]);
        n *= (uint64_t)ne[d];
    }
    if (ne[0] % lay.block)
        return kvs_fail(KVS_ERR_INVALID, "GGUF tensor '%s': its rows of %lld are not whole %s blocks of %d", name,
                        (long long)ne[0], lay.name, lay.block);
    if (w->n_tensors == w->cap_tensors) {
        size_t cap = w->cap_tensors ? 2 * w->cap_tensors : 64;
        tensor_info *t = realloc(w->tensors, cap * sizeof *t);
        if (!t) return kvs_fail(KVS_ERR_NOMEM, "out of memory");
        w->tensors = t;
        w->cap_tensors = cap;
    }
    tensor_info *t = &w->tensors[w->n_tensors];
    memset(t, 0, sizeof *t);
    if (!(t->name = strdup(name))) return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    t->type = type;
    t->n_dims = n_dims;
    for (int d = 0; d < 4; d++) t->ne[d] = d < n_dims ? ne[d] : 1;
    t->nbytes = n / (uint64_t)lay.block * (uint64_t)lay.block_bytes;
    t->offset = w->data_size;
    w->data_size = pad_to(w->data_size + t->nbytes);
    w->n_tensors++;
    return KVS_OK;
}

size_t kvs_gguf_writer_tensor_bytes(const kvs_gguf_writer *w, size_t i) {
    return i < w->n_tensors ? (size_t)w->tensors[i].nbytes : 0;
}

static kvs_status write_all(FILE *f, const char *path, const void *p, size_t n) {
    if (n && fwrite(p, 1, n, f) != n) return kvs_fail(KVS_ERR_IO, "%s: write failed (disk full?)", path);
    return KVS_OK;
}

kvs_status kvs_gguf_writer_write_header(kvs_gguf_writer *w, FILE *f, const char *path) {
    if (w->header_done) return kvs_fail(KVS_ERR_INVALID, "%s: GGUF header written twice", path);
    if (!has_key(w, "general.alignment")) KVS_TRY(kvs_gguf_set_u32(w, "general.alignment", KVS_GGUF_WRITE_ALIGNMENT));
    w->header_done = true;
    buf h = {0};
    kvs_status s = put(&h, "GGUF", 4);
    if (s == KVS_OK) s = put_u32(&h, 3);
    if (s == KVS_OK) s = put_u64(&h, w->n_tensors);
    if (s == KVS_OK) s = put_u64(&h, w->n_kv);
    if (s == KVS_OK) s = put(&h, w->kv.p, w->kv.len);
    for (size_t i = 0; s == KVS_OK && i < w->n_tensors; i++) {
        const tensor_info *t = &w->tensors[i];
        s = put_str(&h, t->name, strlen(t->name));
        if (s == KVS_OK) s = put_u32(&h, (uint32_t)t->n_dims);
        for (int d = 0; s == KVS_OK && d < t->n_dims; d++) s = put_u64(&h, (uint64_t)t->ne[d]);
        if (s == KVS_OK) s = put_u32(&h, t->type);
        if (s == KVS_OK) s = put_u64(&h, t->offset);
    }
    static const uint8_t zeros[KVS_GGUF_WRITE_ALIGNMENT];
    if (s == KVS_OK) s = put(&h, zeros, (size_t)(pad_to(h.len) - h.len));
    if (s == KVS_OK) s = write_all(f, path, h.p, h.len);
    free(h.p);
    return s;
}

kvs_status kvs_gguf_writer_write_data(kvs_gguf_writer *w, FILE *f, const char *path, const void *data, size_t nbytes) {
    if (!w->header_done) return kvs_fail(KVS_ERR_INVALID, "%s: tensor data before the GGUF header", path);
    if (w->next >= w->n_tensors) return kvs_fail(KVS_ERR_INVALID, "%s: more tensor data than tensors declared", path);
    const tensor_info *t = &w->tensors[w->next];
    if (nbytes != t->nbytes)
        return kvs_fail(KVS_ERR_INVALID, "%s: tensor '%s' has %zu bytes of data, its type and shape take %llu", path,
                        t->name, nbytes, (unsigned long long)t->nbytes);
    static const uint8_t zeros[KVS_GGUF_WRITE_ALIGNMENT];
    KVS_TRY(write_all(f, path, data, nbytes));
    KVS_TRY(write_all(f, path, zeros, (size_t)(pad_to(t->nbytes) - t->nbytes)));
    w->next++;
    return KVS_OK;
}
