/* cpu backend: dummy weights made in place (the dummy_fill op). */
#include "backend/cpu/cpu_ops.h"
#include "backend/dummy_values.h"

void kvs_cpu_dummy_fill(kvs_backend *b, void *dst, uint64_t seed, float scale, kvs_dtype src_dtype, int64_t full_cols,
                        int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
    /* dummy values are exact in src_dtype, so a weight dtype that is src_dtype keeps them exactly */
    kvs_dtype wt = b->weight_dtype;
    float *out = dst;
    uint16_t *out16 = dst;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < nr; r++) {
        uint64_t row = (uint64_t)(r0 + r) * (uint64_t)full_cols + (uint64_t)c0;
        for (int64_t c = 0; c < nc; c++) {
            float v = kvs_dummy_value(seed, row + (uint64_t)c, scale, (int)src_dtype);
            if (wt == KVS_F32) out[r * nc + c] = v;
            else out16[r * nc + c] = wt == KVS_BF16 ? kvs_f32_to_bf16(v) : kvs_f32_to_f16(v);
        }
    }
}
