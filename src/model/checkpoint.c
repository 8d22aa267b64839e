/* Checkpoints: safetensors files (single or sharded via the index) mapped into
 * memory, or seeded dummy weights generated on demand into a scratch buffer. */
#include "model/model_internal.h"
#include "backend/dummy_values.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    char *name;
    int file; /* index into ck->files */
    kvs_dtype dtype;
    int ndim;
    int64_t shape[4];
    const void *data;
    size_t nbytes;
} ck_tensor;

struct kvs_checkpoint {
    kvs_config cfg;
    /* safetensors */
    int n_files;
    char **file_names; /* relative to the model directory */
    kvs_mapped_file *files;
    ck_tensor *tensors; /* sorted by name */
    size_t n_tensors, cap_tensors;
    /* a GGUF file */
    kvs_gguf_weights *gguf;
    /* dummy */
    bool dummy;
    uint64_t seed;
    void *scratch;
    size_t scratch_size;
    size_t total_bytes;
};

static int tensor_cmp(const void *a, const void *b) {
    return strcmp(((const ck_tensor *)a)->name, ((const ck_tensor *)b)->name);
}

static const ck_tensor *find_tensor(const kvs_checkpoint *ck, const char *name) {
    ck_tensor key = {.name = (char *)name};
    return ck->n_tensors ? bsearch(&key, ck->tensors, ck->n_tensors, sizeof key, tensor_cmp) : NULL;
}

void kvs_checkpoint_destroy(kvs_checkpoint *ck) {
    if (!ck) return;
    for (size_t i = 0; i < ck->n_tensors; i++) free(ck->tensors[i].name);
    free(ck->tensors);
    for (int i = 0; i < ck->n_files; i++) {
        kvs_unmap_file(&ck->files[i]);
        free(ck->file_names[i]);
    }
    free(ck->files);
    free(ck->file_names);
    free(ck->scratch);
    kvs_gguf_weights_destroy(ck->gguf);
    free(ck);
}

/* ---- safetensors files -------------------------------------------------------- */
typedef struct {
    kvs_checkpoint *ck;
    int file;
} visit_ctx;

static kvs_status add_tensor(void *p, const char *name, kvs_dtype dtype, int ndim, const int64_t *shape,
                             const void *data, size_t nbytes) {
    visit_ctx *vc = p;
    kvs_checkpoint *ck = vc->ck;
    if (ck->n_tensors == ck->cap_tensors) {
        size_t cap = ck->cap_tensors ? ck->cap_tensors * 2 : 256;
        ck_tensor *t = realloc(ck->tensors, cap * sizeof *t);
        if (!t) return kvs_fail(KVS_ERR_NOMEM, "out of memory for the tensor table");
        ck->tensors = t;
        ck->cap_tensors = cap;
    }
    ck_tensor *t = &ck->tensors[ck->n_tensors];
    memset(t, 0, sizeof *t);
    t->name = strdup(name);
    if (!t->name) return kvs_fail(KVS_ERR_NOMEM, "out of memory for the tensor table");
    t->file = vc->file;
    t->dtype = dtype;
    t->ndim = ndim;
    for (int d = 0; d < ndim && d < 4; d++) t->shape[d] = shape[d];
    t->data = data;
    t->nbytes = nbytes;
    ck->n_tensors++;
    return KVS_OK;
}

/* Maps model_dir/file_name once and adds its tensors to the table. */
static kvs_status add_file(kvs_checkpoint *ck, const char *model_dir, const char *file_name) {
    for (int i = 0; i < ck->n_files; i++)
        if (!strcmp(ck->file_names[i], file_name)) return KVS_OK;
    if (strchr(file_name, '/') || !strcmp(file_name, "..") || !*file_name)
        return kvs_fail(KVS_ERR_FORMAT, "model.safetensors.index.json: shard name '%.200s' must be a plain file name "
                        "inside the model directory", file_name);
    char path[4096];
    KVS_TRY(kvs_path_join(path, sizeof path, model_dir, file_name));
    if (!kvs_file_exists(path))
        return kvs_fail(KVS_ERR_NOT_FOUND, "%s: shard named in model.safetensors.index.json is missing from %s",
                        file_name, model_dir);
    char **names = realloc(ck->file_names, (size_t)(ck->n_files + 1) * sizeof *names);
    if (!names) return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    ck->file_names = names;
    kvs_mapped_file *files = realloc(ck->files, (size_t)(ck->n_files + 1) * sizeof *files);
    if (!files) return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    ck->files = files;
    int idx = ck->n_files;
    ck->file_names[idx] = strdup(file_name);
    if (!ck->file_names[idx]) return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    kvs_status s = kvs_map_file(path, &ck->files[idx]);
    if (s != KVS_OK) {
        free(ck->file_names[idx]);
        return s;
    }
    ck->n_files++;
    visit_ctx vc = {ck, idx};
    return kvs_safetensors_parse(ck->files[idx].data, ck->files[idx].size, file_name, add_tensor, &vc);
}

/* model.safetensors.index.json: maps every shard of the weight_map, then checks
 * that each tensor the index names is in the shard it names. */
static kvs_status open_index(kvs_checkpoint *ck, const char *model_dir, const char *index_path) {
    const char *iname = "model.safetensors.index.json";
    char *text;
    size_t len;
    KVS_TRY(kvs_read_file(index_path, &text, &len));
    json_error_t err;
    json_t *root = json_loadb(text, len, 0, &err);
    free(text);
    if (!root) return kvs_fail(KVS_ERR_FORMAT, "%s: not valid JSON: %s (line %d)", iname, err.text, err.line);
    kvs_status s = KVS_OK;
    json_t *map = json_is_object(root) ? json_object_get(root, "weight_map") : NULL;
    if (!json_is_object(map) || json_object_size(map) == 0)
        s = kvs_fail(KVS_ERR_FORMAT, "%s: field 'weight_map' must be a non-empty object", iname);
    const char *key;
    json_t *v;
    if (s == KVS_OK) json_object_foreach(map, key, v) {
        if (!json_is_string(v)) {
            s = kvs_fail(KVS_ERR_FORMAT, "%s: weight_map entry '%s' must be a file name", iname, key);
            break;
        }
        if ((s = add_file(ck, model_dir, json_string_value(v))) != KVS_OK) break;
    }
    if (s == KVS_OK) {
        if (ck->n_tensors > 1) qsort(ck->tensors, ck->n_tensors, sizeof *ck->tensors, tensor_cmp);
        json_object_foreach(map, key, v) {
            const ck_tensor *t = find_tensor(ck, key);
            if (!t || strcmp(ck->file_names[t->file], json_string_value(v)) != 0) {
                s = kvs_fail(KVS_ERR_FORMAT, "%s: missing tensor '%s' (listed in %s)", json_string_value(v), key, iname);
                break;
            }
        }
    }
    json_decref(root);
    return s;
}

static void shape_str(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (int d = 0; d < ndim && n < cap; d++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", d ? ", " : "", (long long)shape[d]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
}

/* "...q_proj.weight" -> "...q_proj.<suffix>" (weight_scale, input_scale). */
static void sibling_name(const char *weight, const char *suffix, char *buf, size_t cap) {
    size_t n = strlen(weight), w = strlen("weight");
    size_t keep = n >= w && !strcmp(weight + n - w, "weight") ? n - w : n;
    snprintf(buf, cap, "%.*s%s", (int)keep, weight, suffix);
}

static int64_t elem_count(const ck_tensor *t) {
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
    return n;
}

static float scale_at(const ck_tensor *t, int64_t i) {
    float v;
    kvs_to_f32(&v, (const char *)t->data + (size_t)i * kvs_dtype_size(t->dtype), t->dtype, 1);
    return v;
}

/* An FP8 weight's weight_scale: F32/BF16/F16, one element ([] or [1]: per
 * tensor) or one per row ([rows] or [rows, 1]: per channel), every value
 * finite and not negative; its input_scale, when present: one finite positive
 * element (checked, not used: activations are quantized per token). */
static kvs_status check_fp8_scales(kvs_checkpoint *ck, const char *weight, const char *file, int64_t rows) {
    char name[192];
    sibling_name(weight, "weight_scale", name, sizeof name);
    const ck_tensor *t = find_tensor(ck, name);
    if (!t)
        return kvs_fail(KVS_ERR_FORMAT, "%s: tensor '%s' is F8_E4M3 but its scale '%s' is missing (%s checkpoint)", file,
                        weight, name, ck->cfg.ckpt_quant.method);
    char got[96];
    shape_str(got, sizeof got, t->ndim, t->shape);
    if (t->dtype != KVS_F32 && t->dtype != KVS_BF16 && t->dtype != KVS_F16)
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: tensor '%s' has dtype '%s' (supported: F32, BF16, F16)",
                        ck->file_names[t->file], name, kvs_dtype_name(t->dtype));
    int64_t n = elem_count(t);
    bool per_tensor = n == 1 && t->ndim <= 2;
    bool per_row = t->ndim >= 1 && t->ndim <= 2 && t->shape[0] == rows && (t->ndim == 1 || t->shape[1] == 1);
    if (!per_tensor && !per_row)
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: tensor '%s' has shape %s: supported are one scale per tensor ([] or "
                        "[1]) or per output channel ([%lld] or [%lld, 1]); block-wise scales are not",
                        ck->file_names[t->file], name, got, (long long)rows, (long long)rows);
    for (int64_t i = 0; i < n; i++) {
        float v = scale_at(t, i);
        if (!(v >= 0) || !isfinite(v))
            return kvs_fail(KVS_ERR_FORMAT, "%s: tensor '%s' element %lld is %g (scales must be finite and not negative)",
                            ck->file_names[t->file], name, (long long)i, v);
    }
    sibling_name(weight, "input_scale", name, sizeof name);
    const ck_tensor *in = find_tensor(ck, name);
    if (!in) return KVS_OK;
    float v = in->dtype == KVS_F32 || in->dtype == KVS_BF16 || in->dtype == KVS_F16 ? scale_at(in, 0) : NAN;
    if (elem_count(in) != 1 || in->ndim > 2 || !(v > 0) || !isfinite(v)) {
        shape_str(got, sizeof got, in->ndim, in->shape);
        return kvs_fail(KVS_ERR_FORMAT, "%s: tensor '%s' (%s %s) must be one finite positive F32/BF16/F16 value "
                        "(a per-tensor static activation scale)", ck->file_names[in->file], name,
                        kvs_dtype_name(in->dtype), got);
    }
    return KVS_OK;
}

/* vLLM's name of a layer's KV-cache scale: which is "k_scale" or "v_scale". */
static void kv_scale_name(int layer, const char *which, char *buf, size_t cap) {
    snprintf(buf, cap, "model.layers.%d.self_attn.%s", layer, which);
}

/* A layer's k_scale / v_scale, when present: F32/BF16/F16, one value ([] or
 * [1]: every KV head) or one per KV head ([n_kv_heads]), each finite and
 * positive (the FP8 KV cache divides by it). */
static kvs_status check_kv_scale(kvs_checkpoint *ck, int layer, const char *which) {
    char name[128], got[96];
    kv_scale_name(layer, which, name, sizeof name);
    const ck_tensor *t = find_tensor(ck, name);
    if (!t) return KVS_OK;
    const char *file = ck->file_names[t->file];
    shape_str(got, sizeof got, t->ndim, t->shape);
    if (t->dtype != KVS_F32 && t->dtype != KVS_BF16 && t->dtype != KVS_F16)
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: tensor '%s' has dtype '%s' (a KV-cache scale: F32, BF16 or F16)", file,
                        name, kvs_dtype_name(t->dtype));
    int64_t n = elem_count(t), heads = ck->cfg.n_kv_heads;
    if (!((n == 1 && t->ndim <= 1) || (t->ndim == 1 && n == heads)))
        return kvs_fail(KVS_ERR_FORMAT, "%s: tensor '%s' has shape %s: a KV-cache scale is one value ([] or [1]) or "
                        "one per KV head ([%lld])", file, name, got, (long long)heads);
    for (int64_t i = 0; i < n; i++) {
        float v = scale_at(t, i);
        if (!(v > 0) || !isfinite(v))
            return kvs_fail(KVS_ERR_FORMAT, "%s: tensor '%s' element %lld is %g (a KV-cache scale must be finite and "
                            "positive)", file, name, (long long)i, v);
    }
    return KVS_OK;
}

kvs_status kvs_checkpoint_kv_scales(const kvs_checkpoint *ck, int layer, int head0, int n_heads, float *k, float *v) {
    for (int w = 0; w < 2; w++) {
        float *out = w ? v : k;
        char name[128];
        kv_scale_name(layer, w ? "v_scale" : "k_scale", name, sizeof name);
        const ck_tensor *t = ck && !ck->dummy ? find_tensor(ck, name) : NULL;
        if (t && elem_count(t) != 1 && head0 + n_heads > elem_count(t))
            return kvs_fail(KVS_ERR_INVALID, "checkpoint: '%s' has no scales for KV heads %d+%d", name, head0, n_heads);
        for (int h = 0; h < n_heads; h++) out[h] = !t ? 1.0f : scale_at(t, elem_count(t) == 1 ? 0 : head0 + h);
    }
    return KVS_OK;
}

/* A weight's stored dtype: F32/F16/BF16, or F8_E4M3 for a linear weight of an
 * FP8 checkpoint (its scales are checked after its shape). */
static kvs_status check_dtype(const kvs_checkpoint *ck, kvs_weight_kind k, const ck_tensor *t, const char *name) {
    const char *file = ck->file_names[t->file];
    if (t->dtype == KVS_F32 || t->dtype == KVS_F16 || t->dtype == KVS_BF16) return KVS_OK;
    if (t->dtype == KVS_F8_E4M3 && kvs_weight_is_linear(k) && ck->cfg.ckpt_quant.fp8) return KVS_OK;
    if (t->dtype == KVS_F8_E4M3 && kvs_weight_is_linear(k))
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: tensor '%s' is F8_E4M3, but config.json has no FP8 "
                        "quantization_config (quant_method fp8 or compressed-tensors)", file, name);
    return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: tensor '%s' has unsupported dtype '%s' (supported: F32, F16, BF16%s)",
                    file, name, kvs_dtype_name(t->dtype),
                    kvs_weight_is_linear(k) ? "; F8_E4M3 in an FP8 checkpoint" : "");
}

/* Checks every weight the config calls for: present, dtype, shape. */
static kvs_status check_weights(kvs_checkpoint *ck, const char *default_file) {
    const kvs_config *cfg = &ck->cfg;
    ck->total_bytes = 0;
    for (int layer = -1; layer < cfg->n_layers; layer++) {
        for (int k = 0; k < KVS_W_KIND_COUNT; k++) {
            bool global = k < KVS_W_ATTN_NORM;
            if (global != (layer < 0)) continue;
            int64_t shape[2];
            int ndim;
            if (!kvs_weight_expected(cfg, (kvs_weight_kind)k, shape, &ndim)) continue;
            char name[160];
            kvs_weight_name((kvs_weight_kind)k, layer, name, sizeof name);
            const ck_tensor *t = find_tensor(ck, name);
            if (!t) return kvs_fail(KVS_ERR_FORMAT, "%s: missing tensor '%s'", default_file, name);
            const char *file = ck->file_names[t->file];
            KVS_TRY(check_dtype(ck, (kvs_weight_kind)k, t, name));
            bool same = t->ndim == ndim;
            for (int d = 0; same && d < ndim; d++) same = t->shape[d] == shape[d];
            if (!same) {
                char got[96], want[96];
                shape_str(got, sizeof got, t->ndim, t->shape);
                shape_str(want, sizeof want, ndim, shape);
                return kvs_fail(KVS_ERR_FORMAT, "%s: tensor '%s' has shape %s, expected %s from config.json", file,
                                name, got, want);
            }
            if (t->dtype == KVS_F8_E4M3) KVS_TRY(check_fp8_scales(ck, name, file, shape[0]));
            ck->total_bytes += t->nbytes;
        }
        if (layer >= 0) {
            KVS_TRY(check_kv_scale(ck, layer, "k_scale"));
            KVS_TRY(check_kv_scale(ck, layer, "v_scale"));
        }
    }
    return KVS_OK;
}

static kvs_status open_gguf(const char *path, const kvs_config *cfg, kvs_checkpoint **out) {
    kvs_checkpoint *ck = calloc(1, sizeof *ck);
    if (!ck) return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    ck->cfg = *cfg;
    kvs_status s = kvs_gguf_weights_open(path, cfg, &ck->gguf);
    if (s != KVS_OK) {
        kvs_checkpoint_destroy(ck);
        return s;
    }
    ck->total_bytes = kvs_gguf_weights_bytes(ck->gguf);
    *out = ck;
    return KVS_OK;
}

kvs_status kvs_checkpoint_open(const char *model_dir, const kvs_config *cfg, kvs_checkpoint **out) {
    *out = NULL;
    if (kvs_gguf_is_path(model_dir)) return open_gguf(model_dir, cfg, out);
    char index_path[4096], single_path[4096];
    KVS_TRY(kvs_path_join(index_path, sizeof index_path, model_dir, "model.safetensors.index.json"));
    KVS_TRY(kvs_path_join(single_path, sizeof single_path, model_dir, "model.safetensors"));
    bool sharded = kvs_file_exists(index_path);
    if (!sharded && !kvs_file_exists(single_path))
        return kvs_fail(KVS_ERR_NOT_FOUND, "%s: no model.safetensors or model.safetensors.index.json in the model directory",
                        model_dir);
    kvs_checkpoint *ck = calloc(1, sizeof *ck);
    if (!ck) return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    ck->cfg = *cfg;
    kvs_status s = sharded ? open_index(ck, model_dir, index_path) : add_file(ck, model_dir, "model.safetensors");
    if (s == KVS_OK) {
        if (ck->n_tensors > 1) qsort(ck->tensors, ck->n_tensors, sizeof *ck->tensors, tensor_cmp);
        for (size_t i = 1; i < ck->n_tensors && s == KVS_OK; i++)
            if (!strcmp(ck->tensors[i - 1].name, ck->tensors[i].name))
                s = kvs_fail(KVS_ERR_FORMAT, "%s: tensor '%s' is also in %s", ck->file_names[ck->tensors[i].file],
                             ck->tensors[i].name, ck->file_names[ck->tensors[i - 1].file]);
    }
    if (s == KVS_OK) s = check_weights(ck, sharded ? "model.safetensors.index.json" : "model.safetensors");
    if (s != KVS_OK) {
        kvs_checkpoint_destroy(ck);
        return s;
    }
    *out = ck;
    return KVS_OK;
}

/* ---- dummy weights ------------------------------------------------------------- */
static size_t weight_elems(const kvs_config *cfg, kvs_weight_kind k, int64_t shape[2], int *ndim) {
    if (!kvs_weight_expected(cfg, k, shape, ndim)) return 0;
    return (size_t)(*ndim == 2 ? shape[0] * shape[1] : shape[0]);
}

kvs_status kvs_checkpoint_dummy(const kvs_config *cfg, uint64_t seed, kvs_checkpoint **out) {
    *out = NULL;
    if (cfg->dtype != KVS_F32 && cfg->dtype != KVS_F16 && cfg->dtype != KVS_BF16)
        return kvs_fail(KVS_ERR_UNSUPPORTED, "dummy weights: dtype %s is unsupported", kvs_dtype_name(cfg->dtype));
    kvs_checkpoint *ck = calloc(1, sizeof *ck);
    if (!ck) return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    ck->cfg = *cfg;
    ck->dummy = true;
    ck->seed = seed;
    size_t esize = kvs_dtype_size(cfg->dtype);
    for (int k = 0; k < KVS_W_KIND_COUNT; k++) {
        int64_t shape[2];
        int ndim;
        size_t n = weight_elems(cfg, (kvs_weight_kind)k, shape, &ndim);
        ck->total_bytes += n * esize * (k >= KVS_W_ATTN_NORM ? (size_t)cfg->n_layers : 1);
    }
    *out = ck;
    return KVS_OK;
}

/* Fills n elements with a seeded, approximately normal(mean, std) sequence.
 * Each chunk has its own seed, so the result does not depend on thread count.
 * The normal is Irwin-Hall: the sum of four 16-bit uniforms, standardized. */
static void dummy_fill(void *dst, kvs_dtype dtype, size_t n, uint64_t seed, float mean, float std) {
    const float scale = kvs_dummy_scale(std);
    long long n_chunks = (long long)((n + KVS_DUMMY_CHUNK - 1) / KVS_DUMMY_CHUNK);
#pragma omp parallel for schedule(static)
    for (long long c = 0; c < n_chunks; c++) {
        uint64_t state = kvs_dummy_chunk_state(seed, (uint64_t)c);
        size_t lo = (size_t)c * KVS_DUMMY_CHUNK, hi = lo + KVS_DUMMY_CHUNK < n ? lo + KVS_DUMMY_CHUNK : n;
        for (size_t i = lo; i < hi; i++) {
            state += KVS_DUMMY_GOLDEN; /* splitmix64 */
            float x = mean + (float)kvs_dummy_int_of_state(state) * scale;
            if (dtype == KVS_BF16) ((uint16_t *)dst)[i] = kvs_f32_to_bf16(x);
            else if (dtype == KVS_F16) ((uint16_t *)dst)[i] = kvs_f32_to_f16(x);
            else ((float *)dst)[i] = x;
        }
    }
}

static bool dummy_is_norm(kvs_weight_kind kind) {
    return kind == KVS_W_ATTN_NORM || kind == KVS_W_MLP_NORM || kind == KVS_W_FINAL_NORM || kind == KVS_W_Q_NORM ||
           kind == KVS_W_K_NORM;
}

static kvs_status dummy_read(kvs_checkpoint *ck, kvs_weight_kind kind, int layer, const int64_t shape[2], int ndim,
                             kvs_host_tensor *out) {
    size_t n = (size_t)(ndim == 2 ? shape[0] * shape[1] : shape[0]);
    size_t bytes = n * kvs_dtype_size(ck->cfg.dtype);
    if (bytes > ck->scratch_size) { /* grows to the largest weight read so far */
        free(ck->scratch);
        ck->scratch_size = 0;
        ck->scratch = kvs_aligned_alloc(bytes);
        if (!ck->scratch) return kvs_fail(KVS_ERR_NOMEM, "dummy weights: out of memory for a %zu-byte scratch buffer", bytes);
        ck->scratch_size = bytes;
    }
    bool norm = dummy_is_norm(kind);
    uint64_t seed = kvs_dummy_seed(ck->seed, (int)kind, layer);
    dummy_fill(ck->scratch, ck->cfg.dtype, n, seed, norm ? 1.0f : 0.0f, norm ? 0.01f : 0.02f);
    out->dtype = ck->cfg.dtype;
    out->data = ck->scratch;
    out->nbytes = bytes;
    return KVS_OK;
}

kvs_status kvs_checkpoint_read(kvs_checkpoint *ck, kvs_weight_kind kind, int layer, kvs_host_tensor *out) {
    if (!ck || !out) return kvs_fail(KVS_ERR_INVALID, "kvs_checkpoint_read: no checkpoint");
    if ((unsigned)kind >= KVS_W_KIND_COUNT)
        return kvs_fail(KVS_ERR_INVALID, "kvs_checkpoint_read: bad weight kind %d", (int)kind);
    bool global = kind < KVS_W_ATTN_NORM;
    if (global) layer = -1;
    else if (layer < 0 || layer >= ck->cfg.n_layers)
        return kvs_fail(KVS_ERR_INVALID, "kvs_checkpoint_read: layer %d out of range (model has %d layers)", layer,
                        ck->cfg.n_layers);
    char name[160];
    kvs_weight_name(kind, layer, name, sizeof name);
    int64_t shape[2];
    int ndim;
    if (!kvs_weight_expected(&ck->cfg, kind, shape, &ndim))
        return kvs_fail(KVS_ERR_NOT_FOUND, "the model has no weight '%s' (%s)", name,
                        kind == KVS_W_LM_HEAD ? "tie_word_embeddings" : "no attention_bias");
    memset(out, 0, sizeof *out);
    out->ndim = ndim;
    out->shape[0] = shape[0];
    out->shape[1] = ndim == 2 ? shape[1] : 0;
    if (ck->dummy) return dummy_read(ck, kind, layer, shape, ndim, out);
    if (ck->gguf) return kvs_gguf_weights_read(ck->gguf, kind, layer, out);
    const ck_tensor *t = find_tensor(ck, name);
    if (!t) return kvs_fail(KVS_ERR_INTERNAL, "checkpoint: tensor '%s' vanished after the check", name);
    out->dtype = t->dtype;
    out->data = t->data;
    out->nbytes = t->nbytes;
    return KVS_OK;
}

bool kvs_checkpoint_dummy_weight(const kvs_checkpoint *ck, kvs_weight_kind kind, int layer, kvs_dummy_weight *out) {
    if (!ck || !ck->dummy || (unsigned)kind >= KVS_W_KIND_COUNT || dummy_is_norm(kind)) return false;
    if (kind < KVS_W_ATTN_NORM) layer = -1;
    else if (layer < 0 || layer >= ck->cfg.n_layers) return false;
    int64_t shape[2];
    int ndim;
    if (!kvs_weight_expected(&ck->cfg, kind, shape, &ndim)) return false;
    out->seed = kvs_dummy_seed(ck->seed, (int)kind, layer);
    out->scale = kvs_dummy_scale(0.02f);
    out->dtype = ck->cfg.dtype;
    out->rows = shape[0];
    out->cols = ndim == 2 ? shape[1] : 1;
    return true;
}

size_t kvs_checkpoint_total_bytes(const kvs_checkpoint *ck) { return ck ? ck->total_bytes : 0; }

/* A weight's table entry (NULL for dummy checkpoints and absent weights). */
static const ck_tensor *stored(const kvs_checkpoint *ck, kvs_weight_kind kind, int layer) {
    if (!ck || ck->dummy || (unsigned)kind >= KVS_W_KIND_COUNT) return NULL;
    char name[160];
    kvs_weight_name(kind, kind < KVS_W_ATTN_NORM ? -1 : layer, name, sizeof name);
    return find_tensor(ck, name);
}

kvs_dtype kvs_checkpoint_dtype(const kvs_checkpoint *ck, kvs_weight_kind kind, int layer) {
    if (ck && ck->gguf && (unsigned)kind < KVS_W_KIND_COUNT)
        return kvs_gguf_weights_dtype(ck->gguf, kind, kind < KVS_W_ATTN_NORM ? -1 : layer);
    const ck_tensor *t = stored(ck, kind, layer);
    return t ? t->dtype : ck ? ck->cfg.dtype : KVS_BF16;
}

bool kvs_checkpoint_quantized(const kvs_checkpoint *ck, kvs_weight_kind kind, int layer, uint32_t *type) {
    if (!ck || !ck->gguf || (unsigned)kind >= KVS_W_KIND_COUNT) return false;
    int64_t shape[2];
    int ndim;
    if (!kvs_weight_expected(&ck->cfg, kind, shape, &ndim)) return false;
    uint32_t t = kvs_gguf_weights_type(ck->gguf, kind, kind < KVS_W_ATTN_NORM ? -1 : layer);
    if (t == KVS_GGML_F32 || t == KVS_GGML_F16 || t == KVS_GGML_BF16) return false;
    if (type) *type = t;
    return true;
}

bool kvs_checkpoint_has_quantized(const kvs_checkpoint *ck) {
    for (int l = 0; ck && ck->gguf && l < ck->cfg.n_layers; l++)
        for (int k = KVS_W_ATTN_NORM; k < KVS_W_KIND_COUNT; k++)
            if (kvs_weight_is_linear((kvs_weight_kind)k) && kvs_checkpoint_quantized(ck, (kvs_weight_kind)k, l, NULL))
                return true;
    return false;
}

kvs_status kvs_checkpoint_read_blocks(kvs_checkpoint *ck, kvs_weight_kind kind, int layer, kvs_ggml_rows *out) {
    if (!kvs_checkpoint_quantized(ck, kind, layer, NULL))
        return kvs_fail(KVS_ERR_INTERNAL, "checkpoint: weight %d of layer %d is not stored in ggml blocks", (int)kind,
                        layer);
    return kvs_gguf_weights_read_blocks(ck->gguf, kind, kind < KVS_W_ATTN_NORM ? -1 : layer, out);
}

kvs_status kvs_checkpoint_read_scales(kvs_checkpoint *ck, kvs_weight_kind kind, int layer, int64_t r0, int64_t nr,
                                      float *out) {
    const ck_tensor *t = stored(ck, kind, layer);
    char name[160], scale_name[192];
    kvs_weight_name(kind, layer, name, sizeof name);
    if (!t || t->dtype != KVS_F8_E4M3)
        return kvs_fail(KVS_ERR_INVALID, "checkpoint: '%s' is not an FP8 weight: it has no weight_scale", name);
    sibling_name(name, "weight_scale", scale_name, sizeof scale_name);
    const ck_tensor *s = find_tensor(ck, scale_name);
    if (!s || r0 < 0 || nr < 0 || r0 + nr > t->shape[0])
        return kvs_fail(KVS_ERR_INVALID, "checkpoint: '%s' has no scales for rows %lld+%lld", name, (long long)r0,
                        (long long)nr);
    bool per_tensor = elem_count(s) == 1;
    for (int64_t r = 0; r < nr; r++) out[r] = scale_at(s, per_tensor ? 0 : r0 + r);
    return KVS_OK;
}
