/* Writing GGUF (src/gguf/quant_k.c, gguf_write.c, src/cli/cmd_convert.c): the
 * K quantizers against llama-quantize's blocks of the bundled model
 * (../shared/fixtures/gguf) and on random input, the writer read back by the
 * parser, and `kvsparse convert` end to end: bf16 gives the safetensors'
 * greedy tokens, q8_0 llama.cpp's bytes, q4_k_m llama.cpp's type choices. */
#define _GNU_SOURCE /* asprintf */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gguf/gguf.h"
#include "model/model.h"
#include "testutil.h"

#define FIX "fixtures/gguf/"
#define TINY "models/tiny-needle-llama"

static const char *fixture(const char *file) {
    char rel[128];
    snprintf(rel, sizeof rel, FIX "%s", file);
    return shared_input(rel);
}

/* ---- the K quantizers against llama-quantize's blocks ------------------------------ */
/* The largest |a - b| of two dequantized blocks in units of the block's step:
 * Q4_K's d * sub-block scale, Q6_K's d * scale, the larger over the block. */
static double block_step(uint32_t type, const uint8_t *b) {
    if (type == KVS_GGML_Q6_K) {
        float d = kvs_f16_to_f32((uint16_t)(b[208] | b[209] << 8));
        int amax = 0;
        for (int g = 0; g < 16; g++) amax = abs((int8_t)b[192 + g]) > amax ? abs((int8_t)b[192 + g]) : amax;
        return fabs(d) * amax;
    }
    float d = kvs_f16_to_f32((uint16_t)(b[0] | b[1] << 8));
    int amax = 0;
    for (int j = 0; j < 8; j++) {
        int sc = j < 4 ? b[4 + j] & 63 : (b[4 + j + 4] & 0xF) | (b[4 + j - 4] >> 6) << 4;
        amax = sc > amax ? sc : amax;
    }
    return fabs(d) * amax;
}

Test(gguf_convert, the_k_quantizers_reproduce_llama_quantizes_blocks) {
    kvs_gguf *bf, *q4;
    cr_assert_eq(kvs_gguf_open(fixture("tiny-bf16.gguf"), &bf), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(kvs_gguf_open(fixture("tiny-q4_k_m.gguf"), &q4), KVS_OK, "%s", kvs_last_error());
    for (uint32_t type = KVS_GGML_Q4_K; type <= KVS_GGML_Q6_K; type += 2) { /* Q4_K, Q6_K */
        kvs_ggml_layout lay;
        kvs_ggml_type_layout(type, &lay);
        long long blocks = 0, equal = 0;
        double worst = 0;
        int tensors = 0;
        for (size_t i = 0; i < q4->n_tensors; i++) {
            const kvs_gguf_tensor *t = &q4->tensors[i];
            if (t->type != type) continue;
            const kvs_gguf_tensor *src = kvs_gguf_find_tensor(bf, t->name);
            cr_assert(src && src->type == KVS_GGML_BF16, "%s", t->name);
            int64_t n = src->ne[0] * src->ne[1], nb = n / 256;
            float *x = malloc((size_t)n * 4), *ya = malloc(256 * 4), *yb = malloc(256 * 4);
            uint8_t *q = malloc((size_t)nb * lay.block_bytes);
            cr_assert_eq(kvs_ggml_dequantize(src->type, src->data, x, n, t->name), KVS_OK);
            cr_assert_eq(kvs_ggml_quantize(type, x, q, n), KVS_OK, "%s", kvs_last_error());
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *mine = q + b * lay.block_bytes, *theirs = t->data + b * lay.block_bytes;
                if (!memcmp(mine, theirs, (size_t)lay.block_bytes)) {
                    equal++;
                    continue;
                }
                kvs_ggml_dequantize(type, mine, ya, 256, "mine");
                kvs_ggml_dequantize(type, theirs, yb, 256, "theirs");
                double step = block_step(type, theirs), d = 0;
                for (int k = 0; k < 256; k++) d = fmax(d, fabs((double)ya[k] - yb[k]));
                worst = fmax(worst, step > 0 ? d / step : d);
            }
            blocks += nb;
            tensors++;
            free(x), free(ya), free(yb), free(q);
        }
        cr_log_info("%s quantizer: %lld of %lld blocks of %d tensors bit-identical to tiny-q4_k_m.gguf's; the others "
                    "within %.3g of the block's largest step", lay.name, equal, blocks, tensors, worst);
        cr_expect(blocks > 0);
        /* the same float operations in the same order (no FMA contraction on either side): every block */
        cr_expect_eq(equal, blocks, "%s: %lld of %lld", lay.name, equal, blocks);
        cr_expect_leq(worst, 1.0, "%s: a block differs by %.3g steps", lay.name, worst);
    }
    kvs_gguf_destroy(bf);
    kvs_gguf_destroy(q4);
}

/* ---- round trips on random input ---------------------------------------------------- */
static uint64_t rng_state;
static double uniform(void) { /* splitmix64 to [0, 1) */
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return (double)((z ^ (z >> 31)) >> 11) / 9007199254740992.0;
}
static float gaussian(void) { return (float)(sqrt(-2 * log(1 - uniform())) * cos(6.283185307179586 * uniform())); }

Test(gguf_convert, random_rows_round_trip_within_each_types_bounds) {
    rng_state = kvs_test_seed();
    /* relative RMS error bounds for Gaussian rows with a few 8-sigma outliers:
       about 1.35x what was measured (0.0067, 0.021, 0.039, 0.077); each bit
       less per value about doubles the error */
    const struct { uint32_t type; double rel_rms; } cases[] = {
        {KVS_GGML_Q8_0, 0.009}, {KVS_GGML_Q6_K, 0.028}, {KVS_GGML_Q5_K, 0.053}, {KVS_GGML_Q4_K, 0.105}};
    const int64_t n = 256 * 64;
    float *x = malloc(n * 4), *y = malloc(n * 4);
    uint8_t *q = malloc(n * 2), *q2 = malloc(n * 2);
    for (int64_t i = 0; i < n; i++) x[i] = 0.02f * gaussian() * (uniform() < 0.002 ? 8.f : 1.f);
    for (int64_t i = 0; i < 256; i++) x[i] = 0; /* an all-zero block: zeros back */
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        kvs_ggml_layout lay;
        kvs_ggml_type_layout(cases[c].type, &lay);
        cr_assert(kvs_ggml_can_quantize(cases[c].type));
        cr_assert_eq(kvs_ggml_quantize(cases[c].type, x, q, n), KVS_OK, "%s", kvs_last_error());
        cr_assert_eq(kvs_ggml_quantize(cases[c].type, x, q2, n), KVS_OK);
        cr_expect(!memcmp(q, q2, (size_t)(n / lay.block * lay.block_bytes)), "%s is not deterministic", lay.name);
        cr_assert_eq(kvs_ggml_dequantize(cases[c].type, q, y, n, lay.name), KVS_OK, "%s", kvs_last_error());
        double se = 0, sx = 0;
        for (int64_t i = 0; i < n; i++) se += ((double)y[i] - x[i]) * ((double)y[i] - x[i]), sx += (double)x[i] * x[i];
        for (int64_t i = 0; i < 256; i++) cr_expect_eq(y[i], 0.0f, "%s: zero block element %lld", lay.name, (long long)i);
        double rel = sqrt(se / sx);
        cr_log_info("%s: relative RMS error %.4f (bound %.3f)", lay.name, rel, cases[c].rel_rms);
        cr_expect_lt(rel, cases[c].rel_rms, "%s: relative RMS error %g", lay.name, rel);
    }
    free(x), free(y), free(q), free(q2);
}

Test(gguf_convert, unsupported_quantizer_types_and_lengths_are_refused) {
    float x[256] = {0};
    uint8_t q[512];
    cr_expect(!kvs_ggml_can_quantize(KVS_GGML_Q4_0));
    cr_expect_eq(kvs_ggml_quantize(KVS_GGML_Q4_0, x, q, 32), KVS_ERR_UNSUPPORTED);
    cr_expect(strstr(kvs_last_error(), "Q4_0"), "%s", kvs_last_error());
    cr_expect_eq(kvs_ggml_quantize(KVS_GGML_Q4_K, x, q, 128), KVS_ERR_INVALID);
    cr_expect(strstr(kvs_last_error(), "Q4_K") && strstr(kvs_last_error(), "128"), "%s", kvs_last_error());
    cr_expect_eq(kvs_ggml_quantize(999, x, q, 256), KVS_ERR_UNSUPPORTED);
}
