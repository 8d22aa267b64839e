/* A self-contained check of every CPU kernel set the machine runs, for a
 * machine without the test dependencies (the GPU host: its CPU has AVX-512,
 * this project's development machine has not). Each set's gemv (f32, bf16, f16
 * weights) and attention qk / pv against double sums on random inputs; exit 1
 * on an error above 1e-5 of the sum of magnitudes. Built statically by
 * scripts/cpu-kernels-check; tests/test_cpu_kernels.c is the CI test. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "backend/cpu/cpu_simd.h"

static uint64_t state = 88172645463325252ull;
static float draw(void) { /* xorshift64, uniform in [-1, 1) */
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return (float)((state >> 40) * (2.0 / 16777216.0) - 1.0);
}

/* n values of dtype t into raw, their f32 values into f */
static void fill(kvs_dtype t, void *raw, float *f, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float v = draw();
        if (t == KVS_F32) ((float *)raw)[i] = f[i] = v;
        if (t == KVS_BF16) f[i] = kvs_bf16_to_f32(((uint16_t *)raw)[i] = kvs_f32_to_bf16(v));
        if (t == KVS_F16) f[i] = kvs_f16_to_f32(((uint16_t *)raw)[i] = kvs_f32_to_f16(v));
    }
}

static double check_set(const kvs_cpu_kernels *k) {
    enum { ROWS = 29, IN = 1037, N = 8, G = 6, CNT = 13, D = 128 };
    static float wf[ROWS * IN], x[N * IN], out[N * ROWS], q[G * D], kf[CNT * D], s[G * CNT], p[G * CNT], o[G * D];
    static float raw[ROWS * IN];
    double worst = 0;
    const kvs_dtype types[] = {KVS_F32, KVS_BF16, KVS_F16};
    for (int ti = 0; ti < 3; ti++) {
        kvs_dtype t = types[ti];
        fill(t, raw, wf, ROWS * IN);
        fill(KVS_F32, x, x, N * IN);
        k->gemv(out, ROWS, x, raw, t, NULL, N, IN, 0, ROWS);
        for (int i = 0; i < N; i++)
            for (int j = 0; j < ROWS; j++) {
                double ref = 0, mag = 0;
                for (int c = 0; c < IN; c++) ref += (double)wf[j * IN + c] * x[i * IN + c], mag += fabs(wf[j * IN + c] * x[i * IN + c]);
                worst = fmax(worst, fabs(out[i * ROWS + j] - ref) / mag);
            }
        fill(t, raw, kf, CNT * D);
        fill(KVS_F32, q, q, G * D);
        k->qk(s, CNT, q, D, G, raw, t, CNT, D, 1.0f);
        fill(KVS_F32, p, p, G * CNT);
        for (int i = 0; i < G * D; i++) o[i] = 0;
        k->pv(o, D, p, CNT, G, raw, t, CNT, D);
        for (int h = 0; h < G; h++) {
            for (int e = 0; e < CNT; e++) { /* scores */
                double ref = 0, mag = 0;
                for (int c = 0; c < D; c++) ref += (double)q[h * D + c] * kf[e * D + c], mag += fabs(q[h * D + c] * kf[e * D + c]);
                worst = fmax(worst, fabs(s[h * CNT + e] - ref) / mag);
            }
            for (int c = 0; c < D; c++) { /* p . v, the same rows as values */
                double ref = 0, mag = 0;
                for (int e = 0; e < CNT; e++) ref += (double)p[h * CNT + e] * kf[e * D + c], mag += fabs(p[h * CNT + e] * kf[e * D + c]);
                worst = fmax(worst, fabs(o[h * D + c] - ref) / mag);
            }
        }
    }
    return worst;
}

int main(void) {
    const kvs_cpu_kernels *sets[] = {&kvs_cpu_kernels_generic, kvs_cpu_kernels_avx2, kvs_cpu_kernels_avx512};
    bool runs[] = {true, kvs_cpu_runs_avx2(), kvs_cpu_runs_avx512()};
    int bad = 0;
    for (int i = 0; i < 3; i++) {
        if (!sets[i] || !runs[i]) {
            printf("cpu kernels %-8s not run here\n", i == 1 ? "avx2" : "avx512");
            continue;
        }
        double w = check_set(sets[i]);
        printf("cpu kernels %-8s worst error / sum|terms| %.2e %s\n", sets[i]->name, w, w <= 1e-5 ? "ok" : "FAILED");
        bad |= w > 1e-5;
    }
    printf("picked: %s\n", kvs_cpu_kernels_pick()->name);
    return bad;
}
