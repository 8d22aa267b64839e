/* safetensors: 8-byte little-endian header length, a JSON header mapping tensor
 * names to {dtype, shape, data_offsets}, then the data section. */
#include "model/model.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#define ST_MAX_HEADER (100u << 20) /* the format's own limit: 100 MB */
#define ST_MAX_DIMS 4

typedef struct {
    const char *name;
    kvs_dtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    uint64_t begin, end;
} st_entry;

/* Maps a safetensors dtype string; returns false for dtypes kvs_dtype lacks. */
static bool st_dtype(const char *s, kvs_dtype *out) {
    static const struct { const char *name; kvs_dtype t; } map[] = {
        {"F32", KVS_F32}, {"F16", KVS_F16}, {"BF16", KVS_BF16},
        {"I32", KVS_I32}, {"I64", KVS_I64}, {"U8", KVS_U8}, {"F8_E4M3", KVS_F8_E4M3},
    };
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (!strcmp(s, map[i].name)) {
            *out = map[i].t;
            return true;
        }
    return false;
}

static bool json_u64(const json_t *v, uint64_t *out) {
    if (!json_is_integer(v) || json_integer_value(v) < 0) return false;
    *out = (uint64_t)json_integer_value(v);
    return true;
}

static kvs_status parse_entry(const char *fname, const char *name, const json_t *v, uint64_t data_size,
                              st_entry *e) {
    if (!json_is_object(v)) return kvs_fail(KVS_ERR_FORMAT, "%s: tensor '%s': entry must be an object", fname, name);
    e->name = name;
    const json_t *dt = json_object_get(v, "dtype");
    if (!json_is_string(dt)) return kvs_fail(KVS_ERR_FORMAT, "%s: tensor '%s': 'dtype' must be a string", fname, name);
    if (!st_dtype(json_string_value(dt), &e->dtype))
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: tensor '%s' has unsupported dtype '%.32s' (supported: F32, F16, BF16, "
                        "F8_E4M3, I32, I64, U8)",
                        fname, name, json_string_value(dt));

    const json_t *shape = json_object_get(v, "shape");
    if (!json_is_array(shape)) return kvs_fail(KVS_ERR_FORMAT, "%s: tensor '%s': 'shape' must be a list", fname, name);
    if (json_array_size(shape) > ST_MAX_DIMS)
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: tensor '%s' has %zu dimensions (at most %d supported)", fname, name,
                        json_array_size(shape), ST_MAX_DIMS);
    e->ndim = (int)json_array_size(shape);
    uint64_t nbytes = kvs_dtype_size(e->dtype);
    for (int d = 0; d < e->ndim; d++) {
        uint64_t dim;
        if (!json_u64(json_array_get(shape, (size_t)d), &dim))
            return kvs_fail(KVS_ERR_FORMAT, "%s: tensor '%s': shape entries must be non-negative integers", fname, name);
        e->shape[d] = (int64_t)dim;
        if (__builtin_mul_overflow(nbytes, dim, &nbytes))
            return kvs_fail(KVS_ERR_FORMAT, "%s: tensor '%s': shape is too large", fname, name);
    }

    const json_t *off = json_object_get(v, "data_offsets");
    if (!json_is_array(off) || json_array_size(off) != 2 || !json_u64(json_array_get(off, 0), &e->begin) ||
        !json_u64(json_array_get(off, 1), &e->end))
        return kvs_fail(KVS_ERR_FORMAT, "%s: tensor '%s': 'data_offsets' must be [begin, end] with non-negative integers",
                        fname, name);
    if (e->begin > e->end)
        return kvs_fail(KVS_ERR_FORMAT, "%s: tensor '%s': data_offsets [%llu, %llu] begin after they end", fname, name,
                        (unsigned long long)e->begin, (unsigned long long)e->end);
    if (e->end > data_size)
        return kvs_fail(KVS_ERR_FORMAT, "%s: tensor '%s': data_offsets [%llu, %llu] exceed the file (data section is %llu bytes)",
                        fname, name, (unsigned long long)e->begin, (unsigned long long)e->end,
                        (unsigned long long)data_size);
    if (e->end - e->begin != nbytes)
        return kvs_fail(KVS_ERR_FORMAT, "%s: tensor '%s': data_offsets [%llu, %llu] hold %llu bytes, but its dtype and shape need %llu",
                        fname, name, (unsigned long long)e->begin, (unsigned long long)e->end,
                        (unsigned long long)(e->end - e->begin), (unsigned long long)nbytes);
    return KVS_OK;
}

static int by_begin(const void *a, const void *b) {
    const st_entry *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

/* All entries parsed, sorted by offset; checks that no two tensors share bytes. */
static kvs_status check_overlaps(const char *fname, st_entry *e, size_t n) {
    if (n > 1) qsort(e, n, sizeof *e, by_begin);
    size_t last = SIZE_MAX; /* the entry reaching furthest so far */
    for (size_t i = 0; i < n; i++) {
        if (e[i].begin == e[i].end) continue; /* empty tensors take no bytes */
        if (last != SIZE_MAX && e[i].begin < e[last].end)
            return kvs_fail(KVS_ERR_FORMAT, "%s: tensors '%s' [%llu, %llu] and '%s' [%llu, %llu] overlap", fname,
                            e[last].name, (unsigned long long)e[last].begin, (unsigned long long)e[last].end,
                            e[i].name, (unsigned long long)e[i].begin, (unsigned long long)e[i].end);
        if (last == SIZE_MAX || e[i].end > e[last].end) last = i;
    }
    return KVS_OK;
}

kvs_status kvs_safetensors_parse(const uint8_t *buf, size_t len, const char *file_name, kvs_st_visit visit,
                                 void *ctx) {
    const char *fname = file_name ? file_name : "safetensors";
    if (!buf || len < 8)
        return kvs_fail(KVS_ERR_FORMAT, "%s: file is too short for a safetensors header (%zu bytes)", fname, len);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | buf[i];
    if (hlen > len - 8)
        return kvs_fail(KVS_ERR_FORMAT, "%s: header length %llu exceeds the file (%zu bytes): truncated or not a safetensors file",
                        fname, (unsigned long long)hlen, len);
    if (hlen > ST_MAX_HEADER)
        return kvs_fail(KVS_ERR_FORMAT, "%s: header length %llu is larger than the 100 MB limit", fname,
                        (unsigned long long)hlen);
    uint64_t data_size = len - 8 - hlen;
    const uint8_t *data = buf + 8 + hlen;

    json_error_t err;
    json_t *root = json_loadb((const char *)buf + 8, (size_t)hlen, JSON_REJECT_DUPLICATES, &err);
    if (!root)
        return kvs_fail(KVS_ERR_FORMAT, "%s: header is not valid JSON: %s (column %d)", fname, err.text, err.column);
    if (!json_is_object(root)) {
        json_decref(root);
        return kvs_fail(KVS_ERR_FORMAT, "%s: header must be a JSON object", fname);
    }

    size_t cap = json_object_size(root), n = 0;
    st_entry *entries = cap ? calloc(cap, sizeof *entries) : NULL;
    if (cap && !entries) {
        json_decref(root);
        return kvs_fail(KVS_ERR_NOMEM, "%s: out of memory for %zu tensor entries", fname, cap);
    }
    kvs_status s = KVS_OK;
    const char *key;
    json_t *v;
    json_object_foreach(root, key, v) {
        if (!strcmp(key, "__metadata__")) continue;
        s = parse_entry(fname, key, v, data_size, &entries[n]);
        if (s != KVS_OK) break;
        n++;
    }
    if (s == KVS_OK) s = check_overlaps(fname, entries, n);
    for (size_t i = 0; s == KVS_OK && visit && i < n; i++)
        s = visit(ctx, entries[i].name, entries[i].dtype, entries[i].ndim, entries[i].shape, data + entries[i].begin,
                  (size_t)(entries[i].end - entries[i].begin));
    free(entries);
    json_decref(root);
    return s;
}
