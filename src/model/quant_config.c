/* config.json's quantization_config: the FP8 layouts kvsparse loads as
 * published (docs/CUDA.md "FP8 checkpoints"), every other one refused with a
 * message naming what it found.
 * - quant_method "fp8" (transformers / vLLM): F8_E4M3 weights, weight_scale
 *   per tensor or per channel, activation_scheme dynamic or static; block-wise
 *   (weight_block_size) is refused: one scale per output row cannot hold it.
 * - quant_method "compressed-tensors" (llm-compressor), format float-quantized
 *   or naive-quantized: every config group FP8 (num_bits 8, type float,
 *   symmetric) with strategy channel or tensor; input activations FP8 per
 *   token or per tensor, dynamic or static, or none. */
#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "model/model_internal.h"

#define QC "quantization_config"

/* A string field (NULL when absent or null); fails when it is another type. */
static kvs_status get_string(const json_t *obj, const char *key, const char *where, const char *name,
                             const char **out) {
    const json_t *v = json_object_get(obj, key);
    *out = NULL;
    if (!v || json_is_null(v)) return KVS_OK;
    if (!json_is_string(v)) return kvs_fail(KVS_ERR_FORMAT, "%s: field '%s.%s' must be a string", name, where, key);
    *out = json_string_value(v);
    return KVS_OK;
}

/* A list of strings or null (layer names to skip, targets): checked, not used:
 * the dtype of each stored weight says whether it is FP8. */
static kvs_status check_names(const json_t *obj, const char *key, const char *where, const char *name) {
    const json_t *v = json_object_get(obj, key);
    if (!v || json_is_null(v)) return KVS_OK;
    bool ok = json_is_array(v);
    for (size_t i = 0; ok && i < json_array_size(v); i++) ok = json_is_string(json_array_get(v, i));
    if (!ok) return kvs_fail(KVS_ERR_FORMAT, "%s: field '%s.%s' must be a list of strings", name, where, key);
    return KVS_OK;
}

/* "[128, 128]" (or the JSON type) into buf, for messages. */
static void describe(const json_t *v, char *buf, size_t cap) {
    if (json_is_array(v)) {
        size_t n = (size_t)snprintf(buf, cap, "[");
        for (size_t i = 0; i < json_array_size(v) && i < 4 && n < cap; i++) {
            const json_t *e = json_array_get(v, i);
            if (json_is_integer(e)) n += (size_t)snprintf(buf + n, cap - n, "%s%lld", i ? ", " : "", json_integer_value(e));
            else n += (size_t)snprintf(buf + n, cap - n, "%s...", i ? ", " : "");
        }
        if (n < cap) snprintf(buf + n, cap - n, "%s]", json_array_size(v) > 4 ? ", ..." : "");
    } else if (json_is_integer(v)) {
        snprintf(buf, cap, "%lld", json_integer_value(v));
    } else if (json_is_string(v)) {
        snprintf(buf, cap, "'%.40s'", json_string_value(v));
    } else {
        snprintf(buf, cap, "a %s", json_is_object(v) ? "object" : json_is_boolean(v) ? "boolean" : "number");
    }
}

/* quant_method "fp8" */
static kvs_status parse_fp8(const json_t *q, const char *name, kvs_ckpt_quant *out) {
    const json_t *block = json_object_get(q, "weight_block_size");
    if (block && !json_is_null(block)) {
        char got[64];
        describe(block, got, sizeof got);
        return kvs_fail(KVS_ERR_UNSUPPORTED,
                        "%s: field '" QC ".weight_block_size' is %s: block-wise FP8 (a scale per block of "
                        "weights, e.g. DeepSeek's [128, 128]) is unsupported; kvsparse keeps one scale per output "
                        "channel (supported: weight_scale per tensor or per channel)", name, got);
    }
    const char *scheme, *fmt;
    KVS_TRY(get_string(q, "activation_scheme", QC, name, &scheme));
    if (scheme && strcmp(scheme, "dynamic") && strcmp(scheme, "static"))
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: field '" QC ".activation_scheme' '%.40s' is unsupported "
                        "(supported: dynamic, static)", name, scheme);
    out->static_input = scheme && !strcmp(scheme, "static");
    KVS_TRY(get_string(q, "fmt", QC, name, &fmt));
    if (fmt && strcmp(fmt, "e4m3"))
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: field '" QC ".fmt' '%.40s' is unsupported (supported: e4m3)", name,
                        fmt);
    KVS_TRY(check_names(q, "ignored_layers", QC, name));
    KVS_TRY(check_names(q, "modules_to_not_convert", QC, name));
    out->fp8 = true;
    return KVS_OK;
}

/* An optional integer field that must equal want when present. */
static kvs_status want_int(const json_t *args, const char *key, long long want, const char *where, const char *name,
                           long long *got) {
    const json_t *v = json_object_get(args, key);
    *got = want;
    if (!v || json_is_null(v)) return KVS_OK;
    if (!json_is_integer(v)) return kvs_fail(KVS_ERR_FORMAT, "%s: field '%s.%s' must be an integer", name, where, key);
    *got = json_integer_value(v);
    return KVS_OK;
}

/* One quantization args object of a compressed-tensors group: FP8
 * (num_bits 8, type float, symmetric) with a strategy from the given list. */
static kvs_status parse_args(const json_t *args, const char *where, const char *const *strategies, int n_strategies,
                             const char *name, bool *dynamic) {
    if (!json_is_object(args)) return kvs_fail(KVS_ERR_FORMAT, "%s: field '%s' must be an object or null", name, where);
    long long bits;
    const char *type, *strategy;
    KVS_TRY(want_int(args, "num_bits", 8, where, name, &bits));
    KVS_TRY(get_string(args, "type", where, name, &type));
    if (bits != 8 || !type || strcmp(type, "float"))
    {
        char kind[32] = "";
        if (type && (!strcmp(type, "int") || !strcmp(type, "float")))
            snprintf(kind, sizeof kind, " (%s%lld)", !strcmp(type, "int") ? "int" : "fp", bits);
        return kvs_fail(KVS_ERR_UNSUPPORTED,
                        "%s: field '%s': num_bits %lld, type '%.20s'%s is unsupported (supported: FP8, num_bits 8 "
                        "and type 'float')", name, where, bits, type ? type : "(none)", kind);
    }
    KVS_TRY(get_string(args, "strategy", where, name, &strategy));
    bool known = false;
    for (int i = 0; strategy && i < n_strategies; i++) known |= !strcmp(strategy, strategies[i]);
    if (!known)
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: field '%s.strategy' '%.40s' is unsupported (supported: %s%s%s)",
                        name, where, strategy ? strategy : "(none)", strategies[0], n_strategies > 1 ? ", " : "",
                        n_strategies > 1 ? strategies[1] : "");
    const json_t *sym = json_object_get(args, "symmetric");
    if (sym && !json_is_null(sym) && !json_is_true(sym))
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: field '%s.symmetric' must be true (asymmetric FP8 with zero points "
                        "is unsupported)", name, where);
    const json_t *gs = json_object_get(args, "group_size"), *bs = json_object_get(args, "block_structure");
    if ((gs && !json_is_null(gs)) || (bs && !json_is_null(bs)))
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: field '%s': group_size / block_structure are unsupported (one scale "
                        "per channel or per tensor)", name, where);
    const json_t *dyn = json_object_get(args, "dynamic");
    if (dyn && !json_is_null(dyn) && !json_is_boolean(dyn)) {
        char got[64];
        describe(dyn, got, sizeof got);
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: field '%s.dynamic' %s is unsupported (supported: true, false)", name,
                        where, got);
    }
    *dynamic = dyn && json_is_true(dyn);
    return KVS_OK;
}

static kvs_status parse_group(const char *group, const json_t *g, const char *name, kvs_ckpt_quant *out) {
    char where[160];
    snprintf(where, sizeof where, QC ".config_groups.%.64s", group);
    if (!json_is_object(g)) return kvs_fail(KVS_ERR_FORMAT, "%s: field '%s' must be an object", name, where);
    KVS_TRY(check_names(g, "targets", where, name));
    const char *fmt;
    KVS_TRY(get_string(g, "format", where, name, &fmt));
    if (fmt && strcmp(fmt, "float-quantized") && strcmp(fmt, "naive-quantized"))
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: field '%s.format' '%.40s' is unsupported (supported: "
                        "float-quantized, naive-quantized)", name, where, fmt);
    const json_t *w = json_object_get(g, "weights"), *in = json_object_get(g, "input_activations");
    const json_t *o = json_object_get(g, "output_activations");
    char at[200];
    if (!w || json_is_null(w))
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: field '%s.weights' is missing: only quantized weights are supported",
                        name, where);
    static const char *const weight_strategies[] = {"channel", "tensor"}, *const input_strategies[] = {"token", "tensor"};
    bool dynamic;
    snprintf(at, sizeof at, "%s.weights", where);
    KVS_TRY(parse_args(w, at, weight_strategies, 2, name, &dynamic));
    if (dynamic) return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: field '%s.dynamic' true is unsupported for weights", name, at);
    if (in && !json_is_null(in)) {
        snprintf(at, sizeof at, "%s.input_activations", where);
        KVS_TRY(parse_args(in, at, input_strategies, 2, name, &dynamic));
        if (!dynamic) out->static_input = true;
    }
    if (o && !json_is_null(o))
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: field '%s.output_activations' is unsupported", name, where);
    return KVS_OK;
}

/* A field that must be null or absent (a feature kvsparse does not have). */
static kvs_status refuse_present(const json_t *q, const char *key, const char *what, const char *name) {
    const json_t *v = json_object_get(q, key);
    if (!v || json_is_null(v)) return KVS_OK;
    return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: field '" QC ".%s' is set: %s is unsupported", name, key, what);
}

/* quant_method "compressed-tensors" */
static kvs_status parse_compressed(const json_t *q, const char *name, kvs_ckpt_quant *out) {
    const char *fmt, *status;
    KVS_TRY(get_string(q, "format", QC, name, &fmt));
    if (fmt && strcmp(fmt, "float-quantized") && strcmp(fmt, "naive-quantized"))
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: field '" QC ".format' '%.40s' is unsupported (supported: "
                        "float-quantized, naive-quantized: FP8 weights)", name, fmt);
    KVS_TRY(get_string(q, "quantization_status", QC, name, &status));
    if (status && strcmp(status, "compressed"))
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: field '" QC ".quantization_status' '%.40s' is unsupported "
                        "(supported: compressed)", name, status);
    const json_t *sp = json_object_get(q, "sparsity_config");
    if (sp && !json_is_null(sp) && !(json_is_object(sp) && json_object_size(sp) == 0)) {
        const char *sfmt = NULL;
        if (json_is_object(sp)) KVS_TRY(get_string(sp, "format", QC ".sparsity_config", name, &sfmt));
        if (!sfmt || strcmp(sfmt, "dense"))
            return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: field '" QC ".sparsity_config' (format '%.40s') is unsupported: "
                            "sparse compressed weights", name, sfmt ? sfmt : "(none)");
    }
    KVS_TRY(refuse_present(q, "transform_config", "a weight transform (rotations)", name));
    KVS_TRY(check_names(q, "ignore", QC, name));
    const json_t *kv = json_object_get(q, "kv_cache_scheme");
    if (kv && !json_is_null(kv))
        kvs_log(KVS_LOG_WARN, "%s: " QC ".kv_cache_scheme is ignored: the KV cache follows --kv-cache-dtype", name);
    const json_t *groups = json_object_get(q, "config_groups");
    if (!json_is_object(groups) || json_object_size(groups) == 0)
        return kvs_fail(KVS_ERR_FORMAT, "%s: field '" QC ".config_groups' must be a non-empty object", name);
    const char *key;
    json_t *g;
    json_object_foreach((json_t *)groups, key, g) KVS_TRY(parse_group(key, g, name, out));
    out->fp8 = true;
    return KVS_OK;
}

kvs_status kvs_quant_config_parse(const json_t *root, const char *name, kvs_ckpt_quant *out) {
    memset(out, 0, sizeof *out);
    const json_t *q = json_object_get(root, QC);
    if (!q || json_is_null(q)) return KVS_OK;
    if (!json_is_object(q)) return kvs_fail(KVS_ERR_FORMAT, "%s: field '" QC "' must be an object or null", name);
    const char *method;
    KVS_TRY(get_string(q, "quant_method", QC, name, &method));
    if (!method)
        return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: field '" QC ".quant_method' is missing (supported: fp8, "
                        "compressed-tensors with FP8 weights)", name);
    snprintf(out->method, sizeof out->method, "%.23s", method);
    if (!strcmp(method, "fp8")) return parse_fp8(q, name, out);
    if (!strcmp(method, "compressed-tensors")) return parse_compressed(q, name, out);
    return kvs_fail(KVS_ERR_UNSUPPORTED, "%s: " QC " quant_method '%.40s' is unsupported (supported: fp8, "
                    "compressed-tensors with FP8 weights)", name, method);
}
