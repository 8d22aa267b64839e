/* GGUF parsing: "GGUF", version, tensor count, key/value count, the key/values,
 * the tensor infos, then (at general.alignment) the data section. Everything
 * is read through a cursor that knows the bytes left, so a count is checked
 * against what the rest of the file could hold before anything is allocated. */
#include "gguf/gguf.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_DIMS 4
#define GGUF_MAX_NESTING 8 /* arrays of arrays, deeper is refused */

typedef struct {
    const uint8_t *p;
    size_t left;
    const char *file;
    const uint8_t *base;
} cursor;

static size_t at(const cursor *c) { return (size_t)(c->p - c->base); }

static kvs_status truncated(const cursor *c, const char *what, size_t need) {
    return kvs_fail(KVS_ERR_FORMAT, "%s: truncated at byte %zu: %s needs %zu bytes, %zu left", c->file, at(c), what,
                    need, c->left);
}

static kvs_status take(cursor *c, size_t n, const char *what, const uint8_t **out) {
    if (n > c->left) return truncated(c, what, n);
    *out = c->p;
    c->p += n;
    c->left -= n;
    return KVS_OK;
}

static uint64_t le(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static kvs_status read_u32(cursor *c, const char *what, uint32_t *out) {
    const uint8_t *p = NULL;
    KVS_TRY(take(c, 4, what, &p));
    *out = (uint32_t)le(p, 4);
    return KVS_OK;
}

static kvs_status read_u64(cursor *c, const char *what, uint64_t *out) {
    const uint8_t *p = NULL;
    KVS_TRY(take(c, 8, what, &p));
    *out = le(p, 8);
    return KVS_OK;
}

static kvs_status read_str(cursor *c, const char *what, kvs_gguf_str *out) {
    uint64_t n;
    KVS_TRY(read_u64(c, what, &n));
    if (n > c->left) return truncated(c, what, n > SIZE_MAX ? SIZE_MAX : (size_t)n);
    const uint8_t *p = NULL;
    KVS_TRY(take(c, (size_t)n, what, &p));
    out->s = (const char *)p;
    out->len = (size_t)n;
    return KVS_OK;
}

/* A key or tensor name as a C string: no NUL byte inside. */
static kvs_status dup_name(const cursor *c, kvs_gguf_str s, const char *what, char **out) {
    if (memchr(s.s, 0, s.len))
        return kvs_fail(KVS_ERR_FORMAT, "%s: %s '%.*s' holds a NUL byte", c->file, what, (int)(s.len > 64 ? 64 : s.len),
                        s.s);
    *out = malloc(s.len + 1);
    if (!*out) return kvs_fail(KVS_ERR_NOMEM, "%s: out of memory for a %zu-byte %s", c->file, s.len, what);
    memcpy(*out, s.s, s.len);
    (*out)[s.len] = 0;
    return KVS_OK;
}

static const struct {
    const char *name;
    int size; /* bytes of a scalar; 0: string / array */
} value_types[KVS_GGUF_TYPE_COUNT] = {
    [KVS_GGUF_U8] = {"u8", 1},   [KVS_GGUF_I8] = {"i8", 1},    [KVS_GGUF_U16] = {"u16", 2},
    [KVS_GGUF_I16] = {"i16", 2}, [KVS_GGUF_U32] = {"u32", 4},  [KVS_GGUF_I32] = {"i32", 4},
    [KVS_GGUF_F32] = {"f32", 4}, [KVS_GGUF_BOOL] = {"bool", 1}, [KVS_GGUF_STRING] = {"string", 0},
    [KVS_GGUF_ARRAY] = {"array", 0}, [KVS_GGUF_U64] = {"u64", 8}, [KVS_GGUF_I64] = {"i64", 8},
    [KVS_GGUF_F64] = {"f64", 8},
};

const char *kvs_gguf_type_name(kvs_gguf_type t) {
    return (unsigned)t < KVS_GGUF_TYPE_COUNT ? value_types[t].name : "unknown";
}

static kvs_status value(cursor *c, kvs_gguf_kv *kv, uint32_t type, int depth);

/* An array: element type, count, elements. The count is checked against the
 * bytes left at the smallest size an element can take before strs is allocated. */
static kvs_status array(cursor *c, kvs_gguf_kv *kv, int depth) {
    uint32_t et;
    uint64_t n;
    KVS_TRY(read_u32(c, "an array's element type", &et));
    KVS_TRY(read_u64(c, "an array's length", &n));
    if (et >= KVS_GGUF_TYPE_COUNT)
        return kvs_fail(KVS_ERR_FORMAT, "%s: key '%s': array element type %u is unknown", c->file, kv->key, et);
    if (depth >= GGUF_MAX_NESTING)
        return kvs_fail(KVS_ERR_FORMAT, "%s: key '%s': arrays nested deeper than %d", c->file, kv->key,
                        GGUF_MAX_NESTING);
    size_t min_size = et == KVS_GGUF_STRING ? 8 : et == KVS_GGUF_ARRAY ? 12 : (size_t)value_types[et].size;
    if (n > c->left / min_size)
        return kvs_fail(KVS_ERR_FORMAT, "%s: key '%s': array of %llu %s elements cannot fit in the %zu bytes left",
                        c->file, kv->key, (unsigned long long)n, value_types[et].name, c->left);
    if (depth == 0) {
        kv->elem_type = (kvs_gguf_type)et;
        kv->count = n;
        kv->data = c->p;
    }
    if (value_types[et].size) {
        const uint8_t *p = NULL;
        return take(c, (size_t)n * min_size, "an array's elements", &p);
    }
    if (et == KVS_GGUF_STRING && depth == 0) {
        kv->strs = n ? malloc((size_t)n * sizeof *kv->strs) : NULL;
        if (n && !kv->strs)
            return kvs_fail(KVS_ERR_NOMEM, "%s: key '%s': out of memory for %llu strings", c->file, kv->key,
                            (unsigned long long)n);
    }
    for (uint64_t i = 0; i < n; i++) {
        if (et == KVS_GGUF_STRING) {
            kvs_gguf_str s;
            KVS_TRY(read_str(c, "an array's string", &s));
            if (depth == 0) kv->strs[i] = s;
        } else {
            KVS_TRY(value(c, kv, et, depth + 1));
        }
    }
    return KVS_OK;
}

static kvs_status value(cursor *c, kvs_gguf_kv *kv, uint32_t type, int depth) {
    if (type >= KVS_GGUF_TYPE_COUNT)
        return kvs_fail(KVS_ERR_FORMAT, "%s: key '%s': value type %u is unknown", c->file, kv->key, type);
    if (type == KVS_GGUF_ARRAY) return array(c, kv, depth);
    if (type == KVS_GGUF_STRING) {
        kvs_gguf_str s;
        KVS_TRY(read_str(c, "a string value", &s));
        if (depth == 0) kv->str = s;
        return KVS_OK;
    }
    const uint8_t *p = NULL;
    KVS_TRY(take(c, (size_t)value_types[type].size, "a value", &p));
    if (type == KVS_GGUF_BOOL && *p > 1)
        return kvs_fail(KVS_ERR_FORMAT, "%s: key '%s': bool value %u is neither 0 nor 1", c->file, kv->key, *p);
    if (depth == 0) kv->data = p;
    return KVS_OK;
}

/* Look-ups by name: pointers to the n entries (each size bytes, its name the
 * char * that starts it: kvs_gguf_kv's key, kvs_gguf_tensor's name) sorted by
 * name; a name twice fails. */
_Static_assert(offsetof(kvs_gguf_kv, key) == 0 && offsetof(kvs_gguf_tensor, name) == 0, "names first");
static const char *entry_name(const void *e) { return *(char *const *)e; }
static int by_name(const void *a, const void *b) {
    return strcmp(entry_name(*(const void *const *)a), entry_name(*(const void *const *)b));
}

static kvs_status index_names(kvs_gguf *g, void *entries, size_t size, size_t n, const char *what, void ***out) {
    if (!n) return KVS_OK;
    void **idx = malloc(n * sizeof *idx);
    if (!idx) return kvs_fail(KVS_ERR_NOMEM, "%s: out of memory", g->file_name);
    for (size_t i = 0; i < n; i++) idx[i] = (char *)entries + i * size;
    qsort(idx, n, sizeof *idx, by_name);
    *out = idx;
    for (size_t i = 1; i < n; i++)
        if (!strcmp(entry_name(idx[i - 1]), entry_name(idx[i])))
            return kvs_fail(KVS_ERR_FORMAT, "%s: %s '%s' appears twice", g->file_name, what, entry_name(idx[i]));
    return KVS_OK;
}

static kvs_status read_kvs(cursor *c, kvs_gguf *g, uint64_t n) {
    if (n > c->left / 13) /* a key/value takes at least 8 (key length) + 4 (type) + 1 bytes */
        return kvs_fail(KVS_ERR_FORMAT, "%s: %llu key/values cannot fit in the %zu bytes left", c->file,
                        (unsigned long long)n, c->left);
    g->kvs = n ? calloc((size_t)n, sizeof *g->kvs) : NULL;
    if (n && !g->kvs) return kvs_fail(KVS_ERR_NOMEM, "%s: out of memory for %llu key/values", c->file, (unsigned long long)n);
    for (uint64_t i = 0; i < n; i++) {
        kvs_gguf_kv *kv = &g->kvs[i];
        kvs_gguf_str key;
        uint32_t type;
        KVS_TRY(read_str(c, "a key", &key));
        KVS_TRY(dup_name(c, key, "key", &kv->key));
        g->n_kvs = (size_t)i + 1; /* so destroy frees what was allocated */
        KVS_TRY(read_u32(c, "a value type", &type));
        kv->type = (kvs_gguf_type)(type < KVS_GGUF_TYPE_COUNT ? type : 0);
        KVS_TRY(value(c, kv, type, 0));
    }
    return index_names(g, g->kvs, sizeof *g->kvs, g->n_kvs, "key", (void ***)&g->kvs_by_key);
}

static kvs_status read_alignment(kvs_gguf *g) {
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    int64_t a;
    const kvs_gguf_kv *kv = kvs_gguf_find(g, "general.alignment");
    if (!kv) return KVS_OK;
    if (kv->type != KVS_GGUF_U32)
        return kvs_fail(KVS_ERR_FORMAT, "%s: key 'general.alignment' is %s, must be u32", g->file_name,
                        kvs_gguf_type_name(kv->type));
    KVS_TRY(kvs_gguf_get_int(g, "general.alignment", true, &a));
    if (a == 0 || (a & (a - 1)))
        return kvs_fail(KVS_ERR_FORMAT, "%s: general.alignment %lld is not a power of two", g->file_name, (long long)a);
    g->alignment = (uint64_t)a;
    return KVS_OK;
}

/* One tensor info: name, dims, type, offset; its byte size from the type's layout. */
static kvs_status read_tensor(cursor *c, kvs_gguf *g, kvs_gguf_tensor *t) {
    kvs_gguf_str name;
    uint32_t n_dims;
    KVS_TRY(read_str(c, "a tensor name", &name));
    KVS_TRY(dup_name(c, name, "tensor name", &t->name));
    KVS_TRY(read_u32(c, "a tensor's dimension count", &n_dims));
    if (n_dims < 1 || n_dims > GGUF_MAX_DIMS)
        return kvs_fail(KVS_ERR_FORMAT, "%s: tensor '%s' has %u dimensions (1 to %d)", c->file, t->name, n_dims,
                        GGUF_MAX_DIMS);
    t->n_dims = (int)n_dims;
    for (int d = 0; d < GGUF_MAX_DIMS; d++) t->ne[d] = 1;
    uint64_t elems = 1;
    for (int d = 0; d < t->n_dims; d++) {
        uint64_t ne;
        KVS_TRY(read_u64(c, "a tensor dimension", &ne));
        if (ne > INT64_MAX || __builtin_mul_overflow(elems, ne, &elems) || elems > INT64_MAX)
            return kvs_fail(KVS_ERR_FORMAT, "%s: tensor '%s': shape is too large", c->file, t->name);
        t->ne[d] = (int64_t)ne;
    }
    KVS_TRY(read_u32(c, "a tensor's type", &t->type));
    KVS_TRY(read_u64(c, "a tensor's offset", &t->offset));
    kvs_ggml_layout lay;
    if (!kvs_ggml_type_layout(t->type, &lay))
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: tensor '%s' has ggml type id %u, which is unknown", c->file, t->name,
                        t->type);
    if (t->ne[0] % lay.block)
        return kvs_fail(KVS_ERR_FORMAT, "%s: tensor '%s' (%s) has rows of %lld elements, not a multiple of its block "
                        "of %d", c->file, t->name, lay.name, (long long)t->ne[0], lay.block);
    uint64_t bytes;
    if (__builtin_mul_overflow(elems / (uint64_t)lay.block, (uint64_t)lay.block_bytes, &bytes) || bytes > SIZE_MAX)
        return kvs_fail(KVS_ERR_FORMAT, "%s: tensor '%s': size is too large", c->file, t->name);
    t->nbytes = (size_t)bytes;
    if (t->offset % g->alignment)
        return kvs_fail(KVS_ERR_FORMAT, "%s: tensor '%s': offset %llu is not a multiple of the alignment %llu",
                        c->file, t->name, (unsigned long long)t->offset, (unsigned long long)g->alignment);
    return KVS_OK;
}

static int by_offset(const void *a, const void *b) {
    const kvs_gguf_tensor *x = *(const kvs_gguf_tensor *const *)a, *y = *(const kvs_gguf_tensor *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

/* The data section: each tensor inside the file, no two sharing bytes. */
static kvs_status place_tensors(kvs_gguf *g) {
    size_t data_size = g->size - g->data_start;
    for (size_t i = 0; i < g->n_tensors; i++) {
        kvs_gguf_tensor *t = &g->tensors[i];
        if (t->offset > data_size || t->nbytes > data_size - t->offset)
            return kvs_fail(KVS_ERR_FORMAT, "%s: tensor '%s': %zu bytes at offset %llu exceed the data section (%zu bytes)",
                            g->file_name, t->name, t->nbytes, (unsigned long long)t->offset, data_size);
        t->data = g->base + g->data_start + t->offset;
    }
    if (g->n_tensors < 2) return KVS_OK;
    const kvs_gguf_tensor **order = malloc(g->n_tensors * sizeof *order);
    if (!order) return kvs_fail(KVS_ERR_NOMEM, "%s: out of memory", g->file_name);
    for (size_t i = 0; i < g->n_tensors; i++) order[i] = &g->tensors[i];
    qsort(order, g->n_tensors, sizeof *order, by_offset);
    kvs_status s = KVS_OK;
    for (size_t i = 1; i < g->n_tensors && s == KVS_OK; i++)
        if (order[i - 1]->offset + order[i - 1]->nbytes > order[i]->offset && order[i]->nbytes)
            s = kvs_fail(KVS_ERR_FORMAT, "%s: tensors '%s' and '%s' overlap", g->file_name, order[i - 1]->name,
                         order[i]->name);
    free(order);
    return s;
}

static kvs_status read_tensors(cursor *c, kvs_gguf *g, uint64_t n) {
    if (n > c->left / 32) /* name length 8, one dim 8, dim count 4, type 4, offset 8 */
        return kvs_fail(KVS_ERR_FORMAT, "%s: %llu tensor infos cannot fit in the %zu bytes left", c->file,
                        (unsigned long long)n, c->left);
    g->tensors = n ? calloc((size_t)n, sizeof *g->tensors) : NULL;
    if (n && !g->tensors) return kvs_fail(KVS_ERR_NOMEM, "%s: out of memory for %llu tensors", c->file, (unsigned long long)n);
    for (uint64_t i = 0; i < n; i++) {
        g->n_tensors = (size_t)i + 1;
        KVS_TRY(read_tensor(c, g, &g->tensors[i]));
    }
    KVS_TRY(index_names(g, g->tensors, sizeof *g->tensors, g->n_tensors, "tensor", (void ***)&g->tensors_by_name));
    /* the data section starts at the next multiple of the alignment (even
       with no tensors, where it may be the file's end) */
    size_t pos = at(c), pad = (size_t)((g->alignment - pos % g->alignment) % g->alignment);
    if (pad > c->left && n) return truncated(c, "the padding before the data section", pad);
    g->data_start = pad > c->left ? g->size : pos + pad;
    return place_tensors(g);
}

kvs_status kvs_gguf_parse(const uint8_t *buf, size_t len, const char *file_name, kvs_gguf **out) {
    *out = NULL;
    const char *file = file_name ? file_name : "gguf";
    if (!buf || len < 4 || memcmp(buf, "GGUF", 4))
        return kvs_fail(KVS_ERR_FORMAT, "%s: not a GGUF file (no \"GGUF\" magic)", file);
    kvs_gguf *g = calloc(1, sizeof *g);
    if (g) g->file_name = strdup(file); /* the caller's string may not outlive the file */
    if (!g || !g->file_name) {
        free(g);
        return kvs_fail(KVS_ERR_NOMEM, "%s: out of memory", file);
    }
    file = g->file_name;
    g->base = buf;
    g->size = len;
    cursor c = {buf + 4, len - 4, file, buf};
    uint64_t n_tensors = 0, n_kvs = 0;
    kvs_status s = read_u32(&c, "the version", &g->version);
    if (s == KVS_OK && (g->version == 0x02000000u || g->version == 0x03000000u))
        s = kvs_fail(KVS_ERR_UNSUPPORTED, "%s: a big-endian GGUF file (only little-endian is supported)", file);
    else if (s == KVS_OK && g->version != 2 && g->version != 3)
        s = kvs_fail(KVS_ERR_UNSUPPORTED, "%s: GGUF version %u is unsupported (2 and 3 are)", file, g->version);
    if (s == KVS_OK) s = read_u64(&c, "the tensor count", &n_tensors);
    if (s == KVS_OK) s = read_u64(&c, "the key/value count", &n_kvs);
    if (s == KVS_OK) s = read_kvs(&c, g, n_kvs);
    if (s == KVS_OK) s = read_alignment(g);
    if (s == KVS_OK) s = read_tensors(&c, g, n_tensors);
    if (s != KVS_OK) {
        kvs_gguf_destroy(g);
        return s;
    }
    *out = g;
    return KVS_OK;
}

bool kvs_gguf_is_path(const char *path) {
    size_t n = path ? strlen(path) : 0;
    return n > 5 && !strcmp(path + n - 5, ".gguf");
}

kvs_status kvs_gguf_open(const char *path, kvs_gguf **out) {
    *out = NULL;
    kvs_mapped_file map;
    KVS_TRY(kvs_map_file(path, &map));
    const char *base = strrchr(path, '/');
    kvs_status s = kvs_gguf_parse(map.data, map.size, base ? base + 1 : path, out);
    if (s != KVS_OK) {
        kvs_unmap_file(&map);
        return s;
    }
    (*out)->map = map;
    return KVS_OK;
}

void kvs_gguf_destroy(kvs_gguf *g) {
    if (!g) return;
    for (size_t i = 0; i < g->n_kvs; i++) {
        free(g->kvs[i].key);
        free(g->kvs[i].strs);
    }
    free(g->kvs);
    for (size_t i = 0; i < g->n_tensors; i++) free(g->tensors[i].name);
    free(g->tensors);
    free(g->kvs_by_key);
    free(g->tensors_by_name);
    kvs_unmap_file(&g->map);
    free(g->file_name);
    free(g);
}

/* ---- look-ups ------------------------------------------------------------------ */
static void *lookup(void **sorted, size_t n, const char *name) {
    if (!sorted || !name) return NULL;
    const char *key = name;
    const void *k = &key;
    void **hit = bsearch(&k, sorted, n, sizeof *sorted, by_name);
    return hit ? *hit : NULL;
}

const kvs_gguf_kv *kvs_gguf_find(const kvs_gguf *g, const char *key) {
    return g ? lookup((void **)g->kvs_by_key, g->n_kvs, key) : NULL;
}

const kvs_gguf_tensor *kvs_gguf_find_tensor(const kvs_gguf *g, const char *name) {
    return g ? lookup((void **)g->tensors_by_name, g->n_tensors, name) : NULL;
}

static bool is_int_type(kvs_gguf_type t) {
    return t == KVS_GGUF_U8 || t == KVS_GGUF_I8 || t == KVS_GGUF_U16 || t == KVS_GGUF_I16 || t == KVS_GGUF_U32 ||
           t == KVS_GGUF_I32 || t == KVS_GGUF_U64 || t == KVS_GGUF_I64;
}

/* An integer of type t at p; false when a u64 does not fit in int64. */
static bool int_at(kvs_gguf_type t, const uint8_t *p, int64_t *out) {
    int size = value_types[t].size;
    uint64_t u = le(p, size);
    bool sign = t == KVS_GGUF_I8 || t == KVS_GGUF_I16 || t == KVS_GGUF_I32 || t == KVS_GGUF_I64;
    if (sign && size < 8 && (u >> (size * 8 - 1)) & 1) u |= ~0ull << (size * 8); /* sign-extend */
    if (!sign && u > INT64_MAX) return false;
    *out = (int64_t)u;
    return true;
}

static kvs_status wrong_type(const kvs_gguf *g, const kvs_gguf_kv *kv, const char *want) {
    return kvs_fail(KVS_ERR_FORMAT, "%s: key '%s' is %s, must be %s", g->file_name, kv->key,
                    kvs_gguf_type_name(kv->type), want);
}

static kvs_status missing(const kvs_gguf *g, const char *key) {
    return kvs_fail(KVS_ERR_FORMAT, "%s: key '%s' is missing", g->file_name, key);
}

kvs_status kvs_gguf_get_int(const kvs_gguf *g, const char *key, bool required, int64_t *out) {
    const kvs_gguf_kv *kv = kvs_gguf_find(g, key);
    if (!kv) return required ? missing(g, key) : KVS_OK;
    if (!is_int_type(kv->type)) return wrong_type(g, kv, "an integer");
    if (!int_at(kv->type, kv->data, out))
        return kvs_fail(KVS_ERR_FORMAT, "%s: key '%s' is too large", g->file_name, key);
    return KVS_OK;
}

kvs_status kvs_gguf_get_float(const kvs_gguf *g, const char *key, bool required, double *out) {
    const kvs_gguf_kv *kv = kvs_gguf_find(g, key);
    if (!kv) return required ? missing(g, key) : KVS_OK;
    if (kv->type == KVS_GGUF_F32) {
        uint32_t u = (uint32_t)le(kv->data, 4);
        float f;
        memcpy(&f, &u, 4);
        *out = f;
    } else if (kv->type == KVS_GGUF_F64) {
        uint64_t u = le(kv->data, 8);
        memcpy(out, &u, 8);
    } else {
        return wrong_type(g, kv, "f32 or f64");
    }
    return KVS_OK;
}

kvs_status kvs_gguf_get_bool(const kvs_gguf *g, const char *key, bool *out) {
    const kvs_gguf_kv *kv = kvs_gguf_find(g, key);
    if (!kv) return KVS_OK;
    if (kv->type != KVS_GGUF_BOOL) return wrong_type(g, kv, "bool");
    *out = kv->data[0] != 0;
    return KVS_OK;
}

kvs_status kvs_gguf_get_str(const kvs_gguf *g, const char *key, bool required, kvs_gguf_str *out) {
    const kvs_gguf_kv *kv = kvs_gguf_find(g, key);
    if (!kv) return required ? missing(g, key) : KVS_OK;
    if (kv->type != KVS_GGUF_STRING) return wrong_type(g, kv, "string");
    *out = kv->str;
    return KVS_OK;
}

kvs_status kvs_gguf_get_array(const kvs_gguf *g, const char *key, kvs_gguf_type elem_type, bool required,
                              const kvs_gguf_kv **out) {
    *out = NULL;
    const kvs_gguf_kv *kv = kvs_gguf_find(g, key);
    if (!kv) return required ? missing(g, key) : KVS_OK;
    bool ok = kv->type == KVS_GGUF_ARRAY &&
              (elem_type == KVS_GGUF_I32 ? is_int_type(kv->elem_type) : kv->elem_type == elem_type);
    if (!ok) {
        char want[48];
        snprintf(want, sizeof want, "an array of %s", elem_type == KVS_GGUF_I32 ? "integers" : kvs_gguf_type_name(elem_type));
        if (kv->type != KVS_GGUF_ARRAY) return wrong_type(g, kv, want);
        return kvs_fail(KVS_ERR_FORMAT, "%s: key '%s' is an array of %s, must be %s", g->file_name, key,
                        kvs_gguf_type_name(kv->elem_type), want);
    }
    *out = kv;
    return KVS_OK;
}

int64_t kvs_gguf_array_int(const kvs_gguf_kv *kv, uint64_t i) {
    int64_t v = 0;
    if (!int_at(kv->elem_type, kv->data + i * (uint64_t)value_types[kv->elem_type].size, &v)) v = INT64_MAX;
    return v;
}
