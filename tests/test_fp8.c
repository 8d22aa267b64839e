/* FP8 E4M3 on the CPU (the oracle of the CUDA FP8 ops, docs/CUDA.md "FP8"):
 * the rounding (every code, ties to even, saturation, NaN, random floats
 * against a nearest-value search in double), the quantize_fp8 and
 * matmul_fp8 ops against plain references, the --quantization value check,
 * and the tiny model quantized against itself unquantized. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/core.h"
#include "model/model.h"
#include "testutil.h"

static bool is_nan_code(int c) { return (c & 0x7f) == 0x7f; }

Test(fp8, every_code_round_trips) {
    for (int c = 0; c < 256; c++) {
        float v = kvs_e4m3_to_f32((uint8_t)c);
        if (is_nan_code(c)) {
            cr_expect(isnan(v), "code 0x%02x decodes to %g, not NaN", c, v);
            cr_expect_eq(kvs_f32_to_e4m3(v), 0x7f, "NaN (code 0x%02x) encodes to 0x%02x", c, kvs_f32_to_e4m3(v));
            continue;
        }
        cr_expect_eq(kvs_f32_to_e4m3(v), c, "code 0x%02x = %g encodes back to 0x%02x", c, v, kvs_f32_to_e4m3(v));
        cr_expect_eq(signbit(v) != 0, (c & 0x80) != 0, "code 0x%02x: sign of %g", c, v);
    }
    /* the landmarks: the smallest subnormal, the smallest normal, one, the largest */
    cr_expect_eq(kvs_e4m3_to_f32(0x01), ldexpf(1, -9));
    cr_expect_eq(kvs_e4m3_to_f32(0x07), 7 * ldexpf(1, -9));
    cr_expect_eq(kvs_e4m3_to_f32(0x08), ldexpf(1, -6));
    cr_expect_eq(kvs_e4m3_to_f32(0x38), 1.0f);
    cr_expect_eq(kvs_e4m3_to_f32(0x7e), 448.0f);
    cr_expect_eq(kvs_e4m3_to_f32(0xfe), -448.0f);
    for (int c = 1; c < 0x7f; c++) /* increasing over the positive codes */
        cr_expect_lt(kvs_e4m3_to_f32((uint8_t)(c - 1)), kvs_e4m3_to_f32((uint8_t)c), "code 0x%02x", c);
}

Test(fp8, ties_go_to_the_even_code) {
    for (int c = 0; c + 1 < 0x7f; c++) {
        float lo = kvs_e4m3_to_f32((uint8_t)c), hi = kvs_e4m3_to_f32((uint8_t)(c + 1));
        float mid = (lo + hi) / 2; /* exact: the two differ in few bits */
        cr_assert_eq((double)mid, ((double)lo + hi) / 2, "midpoint of 0x%02x", c);
        int even = c % 2 == 0 ? c : c + 1;
        for (int s = 0; s < 2; s++) {
            float sign = s ? -1.0f : 1.0f;
            int sb = s ? 0x80 : 0;
            cr_expect_eq(kvs_f32_to_e4m3(sign * mid), sb | even, "tie %g between 0x%02x and 0x%02x -> 0x%02x",
                         sign * mid, c, c + 1, kvs_f32_to_e4m3(sign * mid));
            cr_expect_eq(kvs_f32_to_e4m3(sign * nextafterf(mid, INFINITY)), sb | (c + 1), "just above %g", mid);
            cr_expect_eq(kvs_f32_to_e4m3(sign * nextafterf(mid, 0)), sb | c, "just below %g", mid);
        }
    }
}

Test(fp8, saturates_and_keeps_nan) {
    const float big[] = {448.0f, nextafterf(448.0f, INFINITY), 464.0f, 480.0f, 1e6f, 3e38f, INFINITY};
    for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) {
        cr_expect_eq(kvs_f32_to_e4m3(big[i]), 0x7e, "%g -> 0x%02x", big[i], kvs_f32_to_e4m3(big[i]));
        cr_expect_eq(kvs_f32_to_e4m3(-big[i]), 0xfe, "%g -> 0x%02x", -big[i], kvs_f32_to_e4m3(-big[i]));
    }
    cr_expect_eq(kvs_f32_to_e4m3(NAN), 0x7f);
    cr_expect_eq(kvs_f32_to_e4m3(-NAN), 0x7f);
    /* below half the smallest subnormal: a signed zero; exactly half: the even code, zero */
    cr_expect_eq(kvs_f32_to_e4m3(ldexpf(1, -10)), 0x00);
    cr_expect_eq(kvs_f32_to_e4m3(-ldexpf(1, -10)), 0x80);
    cr_expect_eq(kvs_f32_to_e4m3(nextafterf(ldexpf(1, -10), 1)), 0x01);
    cr_expect_eq(kvs_f32_to_e4m3(1e-30f), 0x00);
    cr_expect_eq(kvs_f32_to_e4m3(-0.0f), 0x80);
}

/* The code nearest x by search (ties to the even code), saturating. */
static int nearest_code(float x) {
    if (isnan(x)) return 0x7f;
    double a = fabs((double)x);
    int best = 0;
    double best_err = INFINITY;
    for (int c = 0; c < 0x7f; c++) {
        double e = fabs(a - kvs_e4m3_to_f32((uint8_t)c));
        if (e < best_err || (e == best_err && c % 2 == 0)) best = c, best_err = e;
    }
    return (signbit(x) ? 0x80 : 0) | best;
}

Test(fp8, random_floats_round_to_the_nearest_code) {
    kvs_rng rng;
    kvs_rng_seed(&rng, kvs_test_seed());
    int n = 200000;
    for (int i = 0; i < n; i++) {
        /* magnitudes from 2^-12 to 2^10: subnormals, normals and past the largest */
        float x = ldexpf(1.0f + kvs_rng_uniform(&rng), (int)(kvs_rng_uniform(&rng) * 23) - 12);
        if (kvs_rng_uniform(&rng) < 0.5f) x = -x;
        int want = nearest_code(x), got = kvs_f32_to_e4m3(x);
        cr_assert_eq(got, want, "%.9g -> 0x%02x, the nearest code is 0x%02x", x, got, want);
    }
}

/* n values of N(0, scale^2) */
static float *normals(kvs_rng *rng, size_t n, float scale) {
    float *x = malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) x[i] = kvs_rng_normal(rng) * scale;
    return x;
}

Test(fp8, quantize_rows_with_a_scale_each) {
    kvs_backend *be;
    cr_assert_eq(kvs_backend_cpu_create(2, &be), KVS_OK);
    kvs_rng rng;
    kvs_rng_seed(&rng, kvs_test_seed());
    int rows = 9, cols = 333;
    float *x = normals(&rng, (size_t)rows * cols, 3.0f);
    for (int c = 0; c < cols; c++) x[4 * cols + c] = 0; /* a row of zeros: scale 1 */
    x[2 * cols + 7] = -1e-3f * 448; /* a row whose amax is negative and tiny */
    for (int c = 0; c < cols; c++) x[2 * cols + c] = c == 7 ? x[2 * cols + c] : x[2 * cols + c] * 1e-4f;
    uint8_t *q = malloc((size_t)rows * cols);
    float scale[9];
    be->quantize_fp8(be, q, scale, x, KVS_F32, rows, cols);
    for (int r = 0; r < rows; r++) {
        float amax = 0;
        for (int c = 0; c < cols; c++) amax = fmaxf(amax, fabsf(x[r * cols + c]));
        float want = amax > 0 ? amax / 448.0f : 1.0f;
        cr_expect_eq(scale[r], want, "row %d: scale %g, want %g", r, scale[r], want);
        int at_max = 0;
        for (int c = 0; c < cols; c++) {
            uint8_t w = kvs_f32_to_e4m3(x[r * cols + c] / want);
            cr_expect_eq(q[r * cols + c], w, "row %d col %d: 0x%02x want 0x%02x", r, c, q[r * cols + c], w);
            at_max += (q[r * cols + c] & 0x7f) == 0x7e;
        }
        if (amax > 0) cr_expect_geq(at_max, 1, "row %d: its amax quantizes to +-448", r);
    }
    /* bf16 input: the same codes as its f32 values */
    uint16_t *h = malloc(2 * (size_t)rows * cols);
    for (size_t i = 0; i < (size_t)rows * cols; i++) h[i] = kvs_f32_to_bf16(x[i]), x[i] = kvs_bf16_to_f32(h[i]);
    uint8_t *q16 = malloc((size_t)rows * cols), *q32 = malloc((size_t)rows * cols);
    float s16[9], s32[9];
    be->quantize_fp8(be, q16, s16, h, KVS_BF16, rows, cols);
    be->quantize_fp8(be, q32, s32, x, KVS_F32, rows, cols);
    cr_expect(!memcmp(q16, q32, (size_t)rows * cols) && !memcmp(s16, s32, sizeof s16), "bf16 input: other codes");
    cr_expect_eq(be->check(be), KVS_OK);
    free(x), free(q), free(h), free(q16), free(q32);
    be->destroy(be);
}

/* matmul_fp8 against a double-precision sum of the decoded products, scaled
 * after the sum: |got - ref| <= 1e-5 sum |products| * scales (f32 sums of up
 * to 4096 exact products in any order). */
Test(fp8, matmul_matches_the_decoded_reference) {
    kvs_backend *be;
    cr_assert_eq(kvs_backend_cpu_create(2, &be), KVS_OK);
    kvs_rng rng;
    kvs_rng_seed(&rng, kvs_test_seed());
    const int shapes[][4] = {{1, 64, 48, 0}, {5, 256, 80, 1}, {33, 4096, 96, 1}};
    for (int k = 0; k < 3; k++) {
        int n = shapes[k][0], in = shapes[k][1], out = shapes[k][2];
        float *x = normals(&rng, (size_t)n * in, 1.0f), *w = normals(&rng, (size_t)out * in, 0.05f);
        float *bias = shapes[k][3] ? normals(&rng, out, 1.0f) : NULL;
        uint8_t *xq = malloc((size_t)n * in), *wq = malloc((size_t)out * in);
        float *xs = malloc(sizeof(float) * n), *ws = malloc(sizeof(float) * out), *o = malloc(sizeof(float) * n * out);
        be->quantize_fp8(be, xq, xs, x, KVS_F32, n, in);
        be->quantize_fp8(be, wq, ws, w, KVS_F32, out, in);
        be->matmul_fp8(be, o, xq, xs, wq, ws, bias, n, in, out);
        double worst = 0;
        for (int i = 0; i < n; i++)
            for (int j = 0; j < out; j++) {
                double sum = 0, mag = 0;
                for (int c = 0; c < in; c++) {
                    double p = (double)kvs_e4m3_to_f32(xq[i * in + c]) * kvs_e4m3_to_f32(wq[j * in + c]);
                    sum += p, mag += fabs(p);
                }
                double s = (double)xs[i] * ws[j], ref = sum * s + (bias ? bias[j] : 0);
                double err = fabs(o[i * out + j] - ref), tol = 1e-5 * mag * s + 1e-6 * fabs(ref) + 1e-30;
                worst = err > worst ? err : worst;
                cr_expect_leq(err, tol, "%dx%dx%d [%d][%d]: %g want %g", n, in, out, i, j, o[i * out + j], ref);
            }
        cr_log_info("matmul_fp8 %dx%d @ %dx%d^T%s: max abs err %.3g", n, in, out, in, bias ? " + bias" : "", worst);
        free(x), free(w), free(bias), free(xq), free(wq), free(xs), free(ws), free(o);
    }
    cr_expect_eq(be->check(be), KVS_OK);
    be->destroy(be);
}

Test(fp8, quantization_names_the_value_it_refuses) {
    kvs_quantization q = KVS_QUANT_NONE;
    cr_expect_eq(kvs_quantization_parse("fp8", &q), KVS_OK);
    cr_expect_eq(q, KVS_QUANT_FP8);
    const char *bad[] = {"int8", "FP8", "awq", ""};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cr_expect_eq(kvs_quantization_parse(bad[i], &q), KVS_ERR_INVALID, "%s accepted", bad[i]);
        char want[64];
        snprintf(want, sizeof want, "--quantization %s:", bad[i]);
        cr_expect(strstr(kvs_last_error(), want), "message '%s' does not name '%s'", kvs_last_error(), bad[i]);
    }
}

/* The tiny model with fp8 weights and activations against itself in f32
 * (both on the CPU): the quantization's own error, as the KL divergence of the
 * next-token distributions (llama.cpp's measure of a quantization), and the
 * same argmax unless the f32 top-2 gap is below the largest logit difference.
 * Bound: 0.05 nats; measured 0.0029-0.0187 over seeds 1-40 and 3026578111
 * (2026-12-03). The earlier bound, max |logit diff| <= 10% of the largest
 * |logit|, was set from six seeds (3.1-5.8%) and failed seed 3026578111 at
 * 10.2% (a low peak, 11.4, not a larger error: 1.16, as seeds 5 and 16): the
 * peak of one position is no stable scale. */
#define KL_BOUND 0.05
Test(fp8, tiny_model_quantized_stays_near_f32, .timeout = 300) {
    const char *dir = src_path("models/tiny-needle-llama");
    rig r32, r8;
    rig_open(&r32, dir, NULL, RIG_BLOCKS(256, 1), 1);
    rig_open_quantized(&r8, dir, NULL, RIG_BLOCKS(256, 1), 1, KVS_QUANT_FP8);
    int V = r32.cfg.vocab_size, n = 200;
    int32_t *ids = malloc(sizeof(int32_t) * n);
    kvs_rng rng;
    kvs_rng_seed(&rng, kvs_test_seed());
    for (int i = 0; i < n; i++) ids[i] = (int32_t)(kvs_rng_uniform(&rng) * (V - 16));
    float *l32 = malloc(sizeof(float) * V), *l8 = malloc(sizeof(float) * V);
    int s32 = kvs_kv_seq_create(r32.kv), s8 = kvs_kv_seq_create(r8.kv);
    rig_run(&r32, s32, ids, n, 0, l32);
    rig_run(&r8, s8, ids, n, 0, l8);
    expect_logits_near("tiny model fp8 vs f32", l32, l8, V, KL_BOUND);
    free(ids), free(l32), free(l8);
    rig_close(&r32);
    rig_close(&r8);
}

/* A backend without the FP8 ops (the CUDA backend below compute capability
 * 8.9) refuses --quantization fp8 when the model is created, saying why. */
Test(fp8, a_backend_without_fp8_refuses_it) {
    expect_refused_without_fp8(src_path("models/tiny-needle-llama"), KVS_QUANT_FP8, "--quantization fp8");
}
