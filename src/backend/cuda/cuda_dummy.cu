/* cuda backend: dummy weights made in place on the GPU (the dummy_fill op),
 * so a 70B model's --load-format dummy needs no host random numbers. Each
 * element is computed on its own from its global index (backend/dummy_values.h):
 * the same bits as the host generator, then the upload_weight conversion
 * (the checkpoint dtype's rounding, then bf16). */
#include "backend/cuda/cuda_internal.h"
#include "backend/dummy_values.h"

__global__ void kvs_dummy_fill_kernel(uint16_t *out, uint64_t seed, float scale, int src_dtype, int64_t full_cols,
                                      int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
    int64_t n = nr * nc;
    for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = k / nc, c = k - r * nc;
        uint64_t i = (uint64_t)(r0 + r) * (uint64_t)full_cols + (uint64_t)(c0 + c);
        float v = kvs_dummy_value(seed, i, scale, src_dtype);
        out[k] = kvs_dummy_to_bf16(v); /* exact for bf16 sources: v is a bf16 value already */
    }
}

void kvs_cuda_dummy_fill(kvs_backend *b, void *dst, uint64_t seed, float scale, kvs_dtype src_dtype, int64_t full_cols,
                         int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
    int64_t n = nr * nc;
    if (n <= 0) return;
    kvs_cuda *c = kvs_cuda_of(b);
    unsigned threads = 256;
    size_t want = kvs_cuda_blocks((size_t)n, threads), cap = (size_t)(c->n_sms > 0 ? c->n_sms : 132) * 32;
    unsigned blocks = (unsigned)(want < cap ? want : cap);
    kvs_dummy_fill_kernel<<<blocks, threads, 0, c->stream>>>((uint16_t *)dst, seed, scale, (int)src_dtype, full_cols,
                                                             r0, nr, c0, nc);
    KVS_CUDA_LAUNCHED(b, "dummy_fill");
}
