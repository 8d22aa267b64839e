/* The CPU backend's matmul_q and embedding_q (backend/cpu/cpu_quant.c) on
 * weights in ggml block formats, through every kernel set this CPU runs
 * (KVS_CPU_KERNELS picks the set when the backend is made): fresh random
 * blocks (Q8_0 from its quantizer; the others random codes and finite fp16
 * scales), against double sums over kvs_ggml_dequantize's values.
 *
 * Tolerances. Prefill (n > 8) multiplies by the dequantized weights in f32:
 * |got - ref| <= 1e-5 sum_k |x_k w_k| (as test_cpu_kernels). Decode (n <= 8)
 * multiplies by the inputs quantized to int8 with a scale per group of 32 (per
 * 256 for the K formats; d = amax / 127, |x - d q| <= d / 2 = amax / 254 up to
 * f32 rounding), so its error is bounded by that quantization's, derived per case:
 *   |got - ref| <= 1.001 * sum_groups (amax_g / 254) * sum_{k in g} |w_k|
 *                  + 1e-5 * sum_k |x_k w_k|
 * (for normal inputs the first term is ~1-1.5% of sum |x w|; the error
 * seen is far below it, its terms' signs being random: the log prints it).
 * The sets compute the same integer dots and differ only in the order of f32
 * sums: each within 1e-5 * sum_k |x_k w_k| of the generic set's. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "backend/cpu/cpu_simd.h"
#include "core/core.h"
#include "gguf/gguf.h"
#include "testutil.h"

static const uint32_t TYPES[] = {KVS_GGML_Q8_0, KVS_GGML_Q4_0, KVS_GGML_Q4_1, KVS_GGML_Q5_0, KVS_GGML_Q5_1,
                                 KVS_GGML_Q4_K, KVS_GGML_Q5_K, KVS_GGML_Q6_K, KVS_GGML_F16, KVS_GGML_BF16,
                                 KVS_GGML_F32};
enum { N_TYPES = sizeof TYPES / sizeof TYPES[0] };

static uint16_t f16_in(kvs_rng *rng, float lo, float hi) {
    return kvs_f32_to_f16(lo + (hi - lo) * (float)kvs_rng_uniform(rng));
}
static void put16(uint8_t *p, uint16_t h) { p[0] = (uint8_t)h, p[1] = (uint8_t)(h >> 8); }

/* rows x dim weights of type: random blocks, every fp16 scale finite */
static void *random_weights(kvs_rng *rng, uint32_t type, int rows, int dim, size_t *row_bytes) {
    kvs_ggml_layout lay;
    cr_assert(kvs_ggml_type_layout(type, &lay));
    *row_bytes = (size_t)(dim / lay.block) * lay.block_bytes;
    size_t bytes = *row_bytes * rows, nb = bytes / lay.block_bytes, n = (size_t)rows * dim;
    uint8_t *w = malloc(bytes);
    if (type == KVS_GGML_Q8_0 || type == KVS_GGML_F16 || type == KVS_GGML_BF16 || type == KVS_GGML_F32) {
        float *v = malloc(sizeof(float) * n);
        for (size_t i = 0; i < n; i++) v[i] = kvs_rng_normal(rng);
        if (type == KVS_GGML_Q8_0) kvs_ggml_quantize_q8_0(v, w, (int64_t)n);
        for (size_t i = 0; i < n && type != KVS_GGML_Q8_0; i++) {
            if (type == KVS_GGML_F32) memcpy(w + 4 * i, &v[i], 4);
            else put16(w + 2 * i, type == KVS_GGML_F16 ? kvs_f32_to_f16(v[i]) : kvs_f32_to_bf16(v[i]));
        }
        free(v);
        return w;
    }
    for (size_t i = 0; i < bytes; i++) w[i] = (uint8_t)kvs_rng_u64(rng);
    for (size_t b = 0; b < nb; b++) {
        uint8_t *blk = w + b * lay.block_bytes;
        switch (type) {
        case KVS_GGML_Q4_1: case KVS_GGML_Q5_1: /* d, then a negative min, as quantizers make */
            put16(blk, f16_in(rng, 0.01f, 0.1f)), put16(blk + 2, f16_in(rng, -1.0f, 0.0f)); break;
        case KVS_GGML_Q4_K: case KVS_GGML_Q5_K:
            put16(blk, f16_in(rng, 0.0005f, 0.005f)), put16(blk + 2, f16_in(rng, 0.0f, 0.01f)); break;
        case KVS_GGML_Q6_K: put16(blk + 208, f16_in(rng, 0.0005f, 0.002f)); break;
        default: put16(blk, f16_in(rng, 0.01f, 0.2f)); break; /* Q4_0, Q5_0 */
        }
    }
    return w;
}

static float *normals(kvs_rng *rng, size_t n) {
    float *x = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++) x[i] = kvs_rng_normal(rng);
    return x;
}

static bool runs(const char *set) {
    if (!strcmp(set, "avx2")) return kvs_cpu_kernels_avx2 && kvs_cpu_runs_avx2();
    if (!strcmp(set, "avx512")) return kvs_cpu_kernels_avx512 && kvs_cpu_runs_avx512();
    return true;
}

/* A CPU backend (weights f32: the bias is f32) running kernel set `set`. */
static kvs_backend *backend_of(const char *set) {
    setenv("KVS_CPU_KERNELS", set, 1);
    kvs_backend *b;
    cr_assert_eq(kvs_backend_cpu_create(2, &b), KVS_OK);
    unsetenv("KVS_CPU_KERNELS");
    return b;
}

Test(cpu_quant, matmul_q_matches_the_dequantized_reference_every_set_and_type) {
    kvs_rng rng;
    kvs_rng_seed(&rng, kvs_test_seed());
    const char *sets[] = {"generic", "avx2", "avx512"};
    const int ns[] = {1, 2, 3, 8, 9, 33};
    double worst_rel[N_TYPES] = {0}, worst_of_bound[N_TYPES] = {0};
    for (int ti = 0; ti < N_TYPES; ti++) {
        uint32_t type = TYPES[ti];
        kvs_ggml_layout lay;
        kvs_ggml_type_layout(type, &lay);
        int in_dim = lay.block == 256 ? 768 : 96 + 32 * (int)(kvs_rng_u64(&rng) % 20), out_dim = 37;
        size_t rb;
        void *w = random_weights(&rng, type, out_dim, in_dim, &rb);
        float *wf = malloc(sizeof(float) * out_dim * in_dim), *x = normals(&rng, 33 * (size_t)in_dim);
        float *bias = normals(&rng, out_dim);
        cr_assert_eq(kvs_ggml_dequantize(type, w, wf, (int64_t)out_dim * in_dim, "test"), KVS_OK);
        float *generic = malloc(sizeof(float) * 33 * 40);
        for (int si = 0; si < 3; si++) {
            if (!runs(sets[si])) continue;
            kvs_backend *b = backend_of(sets[si]);
            for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++)
                for (int with_bias = 0; with_bias < 2; with_bias++) {
                    int n = ns[ni], ld = out_dim + 3;
                    float *out = malloc(sizeof(float) * n * ld);
                    for (int i = 0; i < n * ld; i++) out[i] = 12345.0f;
                    b->matmul_q(b, out, ld, x, w, type, with_bias ? bias : NULL, n, in_dim, out_dim);
                    cr_assert_eq(b->check(b), KVS_OK, "%s", kvs_last_error());
                    for (int i = 0; i < n; i++) {
                        const float *xi = x + (size_t)i * in_dim;
                        for (int j = 0; j < out_dim; j++) {
                            double ref = with_bias ? bias[j] : 0, mag = 0, qbound = 0;
                            int group = lay.block == 256 ? 256 : 32; /* the inputs' scale group */
                            for (int k0 = 0; k0 < in_dim; k0 += group) {
                                double amax = 0, wsum = 0;
                                for (int k = k0; k < k0 + group; k++) {
                                    double wk = wf[(size_t)j * in_dim + k];
                                    ref += wk * xi[k], mag += fabs(wk * xi[k]), wsum += fabs(wk);
                                    amax = fmax(amax, fabs(xi[k]));
                                }
                                qbound += 1.001 * amax / 254 * wsum;
                            }
                            double err = fabs(out[(size_t)i * ld + j] - ref);
                            double tol = (n <= 8 && type != KVS_GGML_F16 && type != KVS_GGML_BF16 && type != KVS_GGML_F32
                                              ? qbound : 0) + 1e-5 * mag + 1e-30;
                            cr_assert(err <= tol, "%s %s n %d row %d col %d: %.9g, want %.9g (error %.3g > %.3g)",
                                      sets[si], lay.name, n, i, j, out[(size_t)i * ld + j], ref, err, tol);
                            if (n <= 8) {
                                worst_rel[ti] = fmax(worst_rel[ti], err / mag);
                                if (qbound > 0) worst_of_bound[ti] = fmax(worst_of_bound[ti], err / qbound);
                            }
                            /* every set within f32 reordering of the generic set's */
                            if (n == 8 && with_bias) {
                                float g = si == 0 ? (generic[i * 40 + j] = out[(size_t)i * ld + j]) : generic[i * 40 + j];
                                cr_assert(fabs(out[(size_t)i * ld + j] - g) <= 1e-5 * mag + 1e-30,
                                          "%s %s row %d col %d: %.9g, generic %.9g", sets[si], lay.name, i, j,
                                          out[(size_t)i * ld + j], g);
                            }
                        }
                        for (int j = out_dim; j < ld; j++)
                            cr_assert(out[(size_t)i * ld + j] == 12345.0f, "%s: wrote past out_dim", lay.name);
                    }
                    free(out);
                }
            b->destroy(b);
        }
        free(generic), free(bias), free(x), free(wf), free(w);
    }
    for (int ti = 0; ti < N_TYPES; ti++) {
        kvs_ggml_layout lay;
        kvs_ggml_type_layout(TYPES[ti], &lay);
        cr_log_info("%-5s decode: worst error %.2e of sum|x w|, %.3f of the derived bound", lay.name, worst_rel[ti],
                    worst_of_bound[ti]);
    }
}

/* A row's decode result is the same bits whatever the batch size and the
 * rows' split (the kernel's j0 / j1, the thread count), for every set. */
Test(cpu_quant, gemv_q_row_does_not_depend_on_batch_or_split) {
    kvs_rng rng;
    kvs_rng_seed(&rng, kvs_test_seed());
    const kvs_cpu_kernels *sets[] = {&kvs_cpu_kernels_generic, kvs_cpu_kernels_avx2, kvs_cpu_kernels_avx512};
    bool ok[] = {true, kvs_cpu_runs_avx2(), kvs_cpu_runs_avx512()};
    enum { ROWS = 21, IN = 512, N = 8 };
    float *x = normals(&rng, N * IN), *bias = normals(&rng, ROWS);
    kvs_cpu_q8 *xq = malloc(sizeof(kvs_cpu_q8) * N * IN / 32);
    for (int ti = 0; ti < 8; ti++) {
        kvs_ggml_layout lay;
        kvs_ggml_type_layout(TYPES[ti], &lay);
        kvs_cpu_quantize_q8(xq, x, N, IN, lay.block == 256 ? 256 : 32);
        size_t rb;
        void *w = random_weights(&rng, TYPES[ti], ROWS, IN, &rb);
        for (int s = 0; s < 3; s++) {
            if (!sets[s] || !ok[s]) continue;
            float all[N * ROWS], part[N * ROWS];
            sets[s]->gemv_q(all, ROWS, xq, w, TYPES[ti], rb, bias, N, IN, 0, ROWS);
            for (int n = 1; n <= N; n++) {
                int j0 = (int)(kvs_rng_u64(&rng) % ROWS), j1 = j0 + 1 + (int)(kvs_rng_u64(&rng) % (ROWS - j0));
                int i0 = (int)(kvs_rng_u64(&rng) % (N - n + 1)); /* inputs i0 .. i0 + n - 1 */
                sets[s]->gemv_q(part, ROWS, xq + (size_t)i0 * IN / 32, w, TYPES[ti], rb, bias, n, IN, j0, j1);
                for (int i = 0; i < n; i++)
                    for (int j = j0; j < j1; j++)
                        cr_assert(!memcmp(&part[i * ROWS + j], &all[(i0 + i) * ROWS + j], sizeof(float)),
                                  "%s type %u: row %d of input %d differs with n %d, rows [%d, %d)", sets[s]->name,
                                  TYPES[ti], j, i0 + i, n, j0, j1);
            }
        }
        free(w);
    }
    free(xq), free(bias), free(x);
}

Test(cpu_quant, embedding_q_is_the_dequantized_rows) {
    kvs_rng rng;
    kvs_rng_seed(&rng, kvs_test_seed());
    kvs_backend *b;
    cr_assert_eq(kvs_backend_cpu_create(2, &b), KVS_OK);
    enum { VOCAB = 13, DIM = 512, N = 7 };
    int32_t ids[N] = {0, 12, 5, 5, 3, 11, 7};
    for (int ti = 0; ti < N_TYPES; ti++) {
        size_t rb;
        void *t = random_weights(&rng, TYPES[ti], VOCAB, DIM, &rb);
        float *all = malloc(sizeof(float) * VOCAB * DIM), *out = malloc(sizeof(float) * N * DIM);
        cr_assert_eq(kvs_ggml_dequantize(TYPES[ti], t, all, (int64_t)VOCAB * DIM, "test"), KVS_OK);
        b->embedding_q(b, out, t, TYPES[ti], ids, N, DIM);
        cr_assert_eq(b->check(b), KVS_OK);
        for (int i = 0; i < N; i++)
            cr_assert(!memcmp(out + (size_t)i * DIM, all + (size_t)ids[i] * DIM, sizeof(float) * DIM),
                      "type %u: row %d", TYPES[ti], i);
        free(out), free(all), free(t);
    }
    b->destroy(b);
}

Test(cpu_quant, unsupported_types_and_partial_blocks_are_refused) {
    kvs_backend *b;
    cr_assert_eq(kvs_backend_cpu_create(2, &b), KVS_OK);
    float x[256] = {0}, out[4];
    uint8_t w[4 * 210] = {0};
    b->matmul_q(b, out, 1, x, w, KVS_GGML_Q2_K, NULL, 1, 256, 1);
    cr_assert_eq(b->check(b), KVS_ERR_UNSUPPORTED);
    b->destroy(b);
    cr_assert_eq(kvs_backend_cpu_create(2, &b), KVS_OK);
    b->matmul_q(b, out, 1, x, w, KVS_GGML_Q6_K, NULL, 1, 128, 1);
    cr_assert_eq(b->check(b), KVS_ERR_INVALID);
    b->destroy(b);
}
