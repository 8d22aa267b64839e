/* cpu backend: dummy weights made in place (the dummy_fill op). */
#include "backend/cpu/cpu_ops.h"
#include "backend/dummy_values.h"

void kvs_cpu_dummy_fill(kvs_backend *b, void *dst, uint64_t seed, float scale, kvs_dtype src_dtype, int64_t full_cols,
                        int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
    float *out = dst;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < nr; r++) {
        uint64_t row = (uint64_t)(r0 + r) * (uint64_t)full_cols + (uint64_t)c0;
        for (int64_t c = 0; c < nc; c++)
            out[r * nc + c] = kvs_dummy_value(seed, row + (uint64_t)c, scale, (int)src_dtype);
    }
}
