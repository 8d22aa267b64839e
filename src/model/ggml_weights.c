/* Weights kept in ggml's block formats (--quantization q8_0 / q4_k, or a GGUF
 * file's own quantized blocks): which type each weight is kept in, their
 * sizes, and their upload. A weight's rows are whole blocks, so a row moves as
 * bytes: a GGUF file's blocks are copied as they are (llama's q / k rows put
 * back in HF order by the checkpoint), anything else is read as f32 and
 * quantized at load, deterministically. The forward runs them through the
 * backend's matmul_q and embedding_q (the CPU's). */
#include <stdlib.h>
#include <string.h>

#include "model/model_internal.h"

bool kvs_quantization_is_ggml(kvs_quantization q) {
    return q == KVS_QUANT_Q8_0 || q == KVS_QUANT_Q4_K || q == KVS_QUANT_GGUF;
}

const char *kvs_quantization_name(kvs_quantization q) {
    switch (q) {
    case KVS_QUANT_FP8: return "fp8";
    case KVS_QUANT_Q8_0: return "q8_0";
    case KVS_QUANT_Q4_K: return "q4_k";
    case KVS_QUANT_GGUF: return "the GGUF file's blocks";
    default: return "none";
    }
}

kvs_status kvs_quantization_parse(const char *v, kvs_quantization *q) {
    static const struct {
        const char *name;
        kvs_quantization q;
    } known[] = {{"fp8", KVS_QUANT_FP8}, {"q8_0", KVS_QUANT_Q8_0}, {"q4_k", KVS_QUANT_Q4_K}};
    for (size_t i = 0; v && i < sizeof known / sizeof known[0]; i++)
        if (!strcmp(v, known[i].name)) return *q = known[i].q, KVS_OK;
    return kvs_fail(KVS_ERR_INVALID, "--quantization %s: unknown method; supported: fp8 (FP8 E4M3 weights with a "
                    "scale per output channel, activations per token; GPU), q8_0 and q4_k (llama.cpp's block "
                    "formats; CPU)", v ? v : "(none)");
}

size_t kvs_ggml_row_bytes(uint32_t type, int64_t cols) {
    kvs_ggml_layout lay;
    if (!kvs_ggml_type_layout(type, &lay) || cols % lay.block) return 0;
    return (size_t)(cols / lay.block) * (size_t)lay.block_bytes;
}

static uint32_t ggml_of_dtype(kvs_dtype d) {
    return d == KVS_F16 ? KVS_GGML_F16 : d == KVS_BF16 ? KVS_GGML_BF16 : KVS_GGML_F32;
}

/* The type weight (kind, layer) is kept in, false when it stays dense: with
 * q8_0 / q4_k the linear weights (Q4_K where the row is whole super-blocks,
 * else Q8_0); with GGUF every weight the file quantized, and the other linear
 * weights in their own dtype as a ggml type (one matmul path for a layer). */
static kvs_status kept_type(const kvs_model *m, kvs_checkpoint *ck, kvs_weight_kind kind, int layer, int64_t cols,
                            uint32_t *type, bool *kept) {
    kvs_quantization q = m->cfg.quantization;
    bool linear = kvs_weight_is_linear(kind);
    *kept = false;
    if (q == KVS_QUANT_GGUF) {
        if (kvs_checkpoint_quantized(ck, kind, layer, type)) *kept = true;
        else if (linear) *type = ggml_of_dtype(kvs_checkpoint_dtype(ck, kind, layer)), *kept = true;
    } else if (linear && (q == KVS_QUANT_Q8_0 || q == KVS_QUANT_Q4_K)) {
        *type = q == KVS_QUANT_Q4_K && cols % 256 == 0 ? KVS_GGML_Q4_K : KVS_GGML_Q8_0;
        *kept = true;
    }
    if (*kept && !kvs_ggml_row_bytes(*type, cols)) {
        char name[160];
        kvs_weight_name(kind, layer, name, sizeof name);
        kvs_ggml_layout lay = {"?", 1, 1};
        kvs_ggml_type_layout(*type, &lay);
        return kvs_fail(KVS_ERR_UNSUPPORTED, "--quantization %s: %s has rows of %lld, not a multiple of %s's %d",
                        kvs_quantization_name(q), name, (long long)cols, lay.name, lay.block);
    }
    return KVS_OK;
}

kvs_status kvs_ggml_weight_plan(const kvs_model *m, kvs_checkpoint *ck, const kvs_weight_kind *kinds, int n_kinds,
                                int layer, const int64_t *rows, int64_t cols, kvs_ggml_weight *out) {
    memset(out, 0, sizeof *out);
    for (int p = 0; p < n_kinds; p++) {
        bool kept;
        KVS_TRY(kept_type(m, ck, kinds[p], layer, cols, &out->type[p], &kept));
        if (!kept) {
            if (p) return kvs_fail(KVS_ERR_UNSUPPORTED, "model: a GGUF file with weights %d and %d of layer %d one "
                                   "quantized, one not", (int)kinds[0], (int)kinds[p], layer);
            return KVS_OK; /* dense */
        }
        out->rows[p] = rows[p];
        out->bytes[p] = (size_t)rows[p] * kvs_ggml_row_bytes(out->type[p], cols);
        out->n_parts = p + 1;
    }
    return KVS_OK;
}

size_t kvs_ggml_weight_bytes(const kvs_ggml_weight *g) {
    size_t total = 0;
    for (int p = 0; p < g->n_parts; p++) total += g->bytes[p];
    return total;
}

/* Rows [r0, r0 + nr) of (kind, layer) as f32 on the host, the whole width. */
static kvs_status read_f32_rows(kvs_checkpoint *ck, kvs_weight_kind kind, int layer, int64_t r0, int64_t nr,
                                int64_t cols, float *out) {
    kvs_host_tensor t;
    KVS_TRY(kvs_checkpoint_read(ck, kind, layer, &t));
    size_t es = kvs_dtype_size(t.dtype);
    kvs_to_f32(out, (const char *)t.data + (size_t)r0 * (size_t)cols * es, t.dtype, (size_t)(nr * cols));
    return KVS_OK;
}

kvs_status kvs_ggml_weight_upload(kvs_model *m, kvs_checkpoint *ck, kvs_weight_kind kind, int layer, int64_t r0,
                                  int64_t nr, int64_t cols, const kvs_ggml_weight *g, int part, void *base) {
    uint32_t type = g->type[part], stored;
    size_t row_bytes = kvs_ggml_row_bytes(type, cols), offset = 0;
    for (int p = 0; p < part; p++) offset += g->bytes[p];
    void *dst = (char *)base + offset;
    if (kvs_checkpoint_quantized(ck, kind, layer, &stored) && stored == type) { /* the file's blocks as they are */
        kvs_ggml_rows b;
        KVS_TRY(kvs_checkpoint_read_blocks(ck, kind, layer, &b));
        if (b.row_bytes != row_bytes || r0 + nr > b.rows)
            return kvs_fail(KVS_ERR_INTERNAL, "model: weight %d of layer %d: stored rows do not match", (int)kind,
                            layer);
        m->be->to_device(m->be, dst, (const char *)b.data + (size_t)r0 * row_bytes, (size_t)nr * row_bytes);
        return KVS_OK;
    }
    if (type == KVS_GGML_F32 || type == KVS_GGML_F16 || type == KVS_GGML_BF16) { /* a dense part, as stored */
        kvs_host_tensor t;
        KVS_TRY(kvs_checkpoint_read(ck, kind, layer, &t));
        if (ggml_of_dtype(t.dtype) != type)
            return kvs_fail(KVS_ERR_INTERNAL, "model: weight %d of layer %d is not stored as planned", (int)kind, layer);
        m->be->to_device(m->be, dst, (const char *)t.data + (size_t)r0 * row_bytes, (size_t)nr * row_bytes);
        return KVS_OK;
    }
    float *f = malloc(sizeof(float) * (size_t)(nr * cols));
    uint8_t *q = malloc((size_t)nr * row_bytes);
    kvs_status st = f && q ? KVS_OK : kvs_fail(KVS_ERR_NOMEM, "model: out of host memory quantizing weights");
    if (st == KVS_OK) st = read_f32_rows(ck, kind, layer, r0, nr, cols, f);
    if (st == KVS_OK) st = kvs_ggml_quantize(type, f, q, nr * cols);
    if (st == KVS_OK) m->be->to_device(m->be, dst, q, (size_t)nr * row_bytes);
    free(f);
    free(q);
    return st;
}
