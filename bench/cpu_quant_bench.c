/* The CPU backend's matmul_q (issue 42) on a Llama-3.2-1B-sized weight set:
 * per layer a 2048 -> 8192 and an 8192 -> 2048 matrix, LAYERS layers of each
 * format resident at once (several times the L3), random blocks.
 *   decode: n = 1 over every layer's two matrices, GB/s counting the format's
 *           bytes, against the read bandwidth (kvs_cpu_read_bandwidth: the
 *           kernel set's `sum` loop) measured in the same rounds;
 *   prefill: n = PREFILL_N through one layer's pair, GFLOP/s (2 n in out / t).
 * Rounds interleave the formats; medians over rounds. Threads: OMP_NUM_THREADS.
 * Usage: OMP_NUM_THREADS=2 OMP_WAIT_POLICY=passive kvs_bench_cpu_quant [LAYERS (6)] [ROUNDS (7)]
 *        [PREFILL_N (512)]   (passive: spinning OpenMP threads would take the
 *        cores from the decode pool's threads after each prefill) */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/core.h"
#include "gguf/gguf.h"

enum { D = 2048, F = 8192 };
static const uint32_t TYPES[] = {KVS_GGML_Q4_0, KVS_GGML_Q4_1, KVS_GGML_Q5_0, KVS_GGML_Q5_1, KVS_GGML_Q8_0,
                                 KVS_GGML_Q4_K, KVS_GGML_Q5_K, KVS_GGML_Q6_K, KVS_GGML_BF16};
enum { NT = sizeof TYPES / sizeof TYPES[0] };

static uint64_t st = 0x9E3779B97F4A7C15ull;
static uint64_t next(void) { return st ^= st << 13, st ^= st >> 7, st ^= st << 17; }

/* rows x dim of type: random codes, finite fp16 scales in every block */
static void *weights(kvs_backend *b, uint32_t type, int rows, int dim) {
    kvs_ggml_layout lay;
    kvs_ggml_type_layout(type, &lay);
    size_t bytes = (size_t)rows * (dim / lay.block) * lay.block_bytes;
    uint8_t *w = b->alloc_weights(b, bytes);
    if (!w) exit(1);
    for (size_t i = 0; i + 8 <= bytes; i += 8) {
        uint64_t r = next();
        memcpy(w + i, &r, 8);
    }
    if (type == KVS_GGML_BF16) { /* normals-ish: a small exponent on every value */
        for (size_t i = 0; i < bytes; i += 2) w[i + 1] = (uint8_t)(0x3C | (w[i + 1] & 0x80));
        return w;
    }
    int offs[2] = {type == KVS_GGML_Q6_K ? 208 : 0, type == KVS_GGML_Q4_1 || type == KVS_GGML_Q5_1 ||
                                                            type == KVS_GGML_Q4_K || type == KVS_GGML_Q5_K ? 2 : -1};
    uint16_t h = kvs_f32_to_f16(0.01f);
    for (size_t o = 0; o < bytes; o += lay.block_bytes)
        for (int k = 0; k < 2; k++)
            if (offs[k] >= 0) memcpy(w + o + offs[k], &h, 2);
    return w;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
static double median(double *v, int n) {
    qsort(v, n, sizeof *v, cmp);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

int main(int argc, char **argv) {
    int layers = argc > 1 ? atoi(argv[1]) : 6, rounds = argc > 2 ? atoi(argv[2]) : 7;
    int pn = argc > 3 ? atoi(argv[3]) : 512;
    kvs_backend *b;
    if (kvs_backend_cpu_create(0, &b) != KVS_OK) return 1;
    void *up[NT][64], *down[NT][64];
    double bytes[NT] = {0};
    for (int t = 0; t < NT; t++) {
        kvs_ggml_layout lay;
        kvs_ggml_type_layout(TYPES[t], &lay);
        for (int l = 0; l < layers; l++) {
            up[t][l] = weights(b, TYPES[t], F, D);
            down[t][l] = weights(b, TYPES[t], D, F);
        }
        bytes[t] = 2.0 * layers * D * F / lay.block * lay.block_bytes;
    }
    float *x = malloc(sizeof(float) * (size_t)pn * F), *y = malloc(sizeof(float) * (size_t)pn * F);
    for (size_t i = 0; i < (size_t)pn * F; i++) x[i] = (float)((int)(next() % 2001) - 1000) * 1e-3f;
    double *dec = calloc((size_t)NT * rounds, sizeof(double)), *pre = calloc((size_t)NT * rounds, sizeof(double));
    double *bw = calloc(rounds, sizeof(double));
    for (int t = 0; t < NT; t++) /* warm: scratch, pages, the pool */
        b->matmul_q(b, y, F, x, up[t][0], TYPES[t], NULL, 1, D, F);
    for (int r = 0; r < rounds; r++) {
        bw[r] = kvs_cpu_read_bandwidth(b, (size_t)256 << 20, 3);
        for (int t = 0; t < NT; t++) {
            double t0 = kvs_now();
            for (int l = 0; l < layers; l++) {
                b->matmul_q(b, y, F, x, up[t][l], TYPES[t], NULL, 1, D, F);
                b->matmul_q(b, y, D, x, down[t][l], TYPES[t], NULL, 1, F, D);
            }
            dec[t * rounds + r] = bytes[t] / (kvs_now() - t0) / 1e9;
        }
        for (int t = 0; t < NT; t++) {
            double t0 = kvs_now();
            b->matmul_q(b, y, F, x, up[t][r % layers], TYPES[t], NULL, pn, D, F);
            b->matmul_q(b, y, D, x, down[t][r % layers], TYPES[t], NULL, pn, F, D);
            pre[t * rounds + r] = 2.0 * 2 * pn * (double)D * F / (kvs_now() - t0) / 1e9;
        }
    }
    if (b->check(b) != KVS_OK) {
        fprintf(stderr, "%s\n", kvs_last_error());
        return 1;
    }
    double mbw = median(bw, rounds), bf16_pre = median(pre + (NT - 1) * rounds, rounds);
    printf("cpu matmul_q, %d threads, %d layers of %dx%d + %dx%d, %d rounds (medians)\n", omp_get_max_threads(), layers, F, D,
           D, F, rounds);
    printf("read bandwidth (sum kernel): %.1f GB/s\n", mbw);
    printf("%-5s %9s %9s %8s %7s %14s %8s\n", "type", "bits/w", "MB", "decode", "% read", "prefill n=" , "vs bf16");
    for (int t = 0; t < NT; t++) {
        kvs_ggml_layout lay;
        kvs_ggml_type_layout(TYPES[t], &lay);
        double g = median(dec + t * rounds, rounds), p = median(pre + t * rounds, rounds);
        printf("%-5s %9.4f %9.1f %6.1f GB/s %5.0f%% %8.1f GFLOP/s %6.2fx\n", lay.name, 8.0 * lay.block_bytes / lay.block,
               bytes[t] / 1e6, g, 100 * g / mbw, p, p / bf16_pre);
    }
    printf("(prefill n = %d)\n", pn);
    b->destroy(b);
    return 0;
}
