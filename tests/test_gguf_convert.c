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
#include <sys/wait.h>
#include <unistd.h>

#include "gguf/gguf.h"
#include "kvsparse/kvsparse.h"
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
        {KVS_GGML_Q8_0, 0.009}, {KVS_GGML_Q6_K, 0.028}, {KVS_GGML_Q5_K, 0.053}, {KVS_GGML_Q4_K, 0.105}, {KVS_GGML_Q5_0, 0.06}};
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

/* ---- the writer, read back by the parser --------------------------------------------- */
Test(gguf_convert, the_writer_writes_what_the_parser_reads) {
    kvs_gguf_writer *w;
    cr_assert_eq(kvs_gguf_writer_create(&w), KVS_OK);
    const char *strs[] = {"a", "", "héllo"};
    int32_t ints[] = {1, -2, 3};
    float fl[] = {0.5f, -1.25f};
    cr_assert_eq(kvs_gguf_set_u32(w, "k.u32", 7), KVS_OK);
    cr_assert_eq(kvs_gguf_set_i32(w, "k.i32", -7), KVS_OK);
    cr_assert_eq(kvs_gguf_set_f32(w, "k.f32", 1.5f), KVS_OK);
    cr_assert_eq(kvs_gguf_set_bool(w, "k.bool", true), KVS_OK);
    cr_assert_eq(kvs_gguf_set_str(w, "k.str", "xyz", 3), KVS_OK);
    cr_assert_eq(kvs_gguf_set_str_array(w, "k.strs", strs, NULL, 3), KVS_OK);
    cr_assert_eq(kvs_gguf_set_array(w, "k.ints", KVS_GGUF_I32, ints, 3), KVS_OK);
    cr_assert_eq(kvs_gguf_set_array(w, "k.floats", KVS_GGUF_F32, fl, 2), KVS_OK);
    cr_expect_eq(kvs_gguf_set_u32(w, "k.u32", 8), KVS_ERR_INVALID, "a key set twice is refused");
    int64_t ne_a[2] = {64, 3}, ne_b[1] = {5}, ne_bad[2] = {48, 2};
    cr_assert_eq(kvs_gguf_add_tensor(w, "a", KVS_GGML_Q8_0, 2, ne_a), KVS_OK);
    cr_assert_eq(kvs_gguf_add_tensor(w, "b", KVS_GGML_F32, 1, ne_b), KVS_OK);
    cr_expect_eq(kvs_gguf_add_tensor(w, "c", KVS_GGML_Q8_0, 2, ne_bad), KVS_ERR_INVALID);
    cr_expect(strstr(kvs_last_error(), "'c'") && strstr(kvs_last_error(), "Q8_0"), "%s", kvs_last_error());
    float xa[192], xb[5] = {1, 2, 3, 4, 5};
    for (int i = 0; i < 192; i++) xa[i] = (float)(i % 17) - 8;
    uint8_t qa[6 * 34];
    kvs_ggml_quantize_q8_0(xa, qa, 192);
    char path[] = "/tmp/kvs_gguf_write_XXXXXX";
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    FILE *f = fdopen(fd, "wb");
    cr_assert_eq(kvs_gguf_writer_write_header(w, f, path), KVS_OK, "%s", kvs_last_error());
    cr_expect_eq(kvs_gguf_writer_write_data(w, f, path, qa, 10), KVS_ERR_INVALID, "a wrong size is refused");
    cr_assert_eq(kvs_gguf_writer_write_data(w, f, path, qa, sizeof qa), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(kvs_gguf_writer_write_data(w, f, path, xb, sizeof xb), KVS_OK, "%s", kvs_last_error());
    fclose(f);
    kvs_gguf_writer_destroy(w);
    kvs_gguf *g;
    cr_assert_eq(kvs_gguf_open(path, &g), KVS_OK, "%s", kvs_last_error());
    int64_t v;
    double d;
    bool b = false;
    kvs_gguf_str s;
    const kvs_gguf_kv *arr;
    cr_expect(g->version == 3 && g->alignment == 32 && g->n_tensors == 2);
    cr_expect(kvs_gguf_get_int(g, "k.u32", true, &v) == KVS_OK && v == 7);
    cr_expect(kvs_gguf_get_int(g, "k.i32", true, &v) == KVS_OK && v == -7);
    cr_expect(kvs_gguf_get_float(g, "k.f32", true, &d) == KVS_OK && d == 1.5);
    cr_expect(kvs_gguf_get_bool(g, "k.bool", &b) == KVS_OK && b);
    cr_expect(kvs_gguf_get_str(g, "k.str", true, &s) == KVS_OK && s.len == 3 && !memcmp(s.s, "xyz", 3));
    cr_assert_eq(kvs_gguf_get_array(g, "k.strs", KVS_GGUF_STRING, true, &arr), KVS_OK, "%s", kvs_last_error());
    cr_expect(arr->count == 3 && arr->strs[1].len == 0 && arr->strs[2].len == strlen("héllo"));
    cr_assert_eq(kvs_gguf_get_array(g, "k.ints", KVS_GGUF_I32, true, &arr), KVS_OK, "%s", kvs_last_error());
    cr_expect(arr->count == 3 && kvs_gguf_array_int(arr, 1) == -2);
    cr_assert_eq(kvs_gguf_get_array(g, "k.floats", KVS_GGUF_F32, true, &arr), KVS_OK, "%s", kvs_last_error());
    cr_expect(arr->count == 2);
    const kvs_gguf_tensor *ta = kvs_gguf_find_tensor(g, "a"), *tb = kvs_gguf_find_tensor(g, "b");
    cr_assert(ta && tb);
    cr_expect(ta->type == KVS_GGML_Q8_0 && ta->ne[0] == 64 && ta->ne[1] == 3 && !memcmp(ta->data, qa, sizeof qa));
    cr_expect(tb->type == KVS_GGML_F32 && tb->n_dims == 1 && !memcmp(tb->data, xb, sizeof xb));
    kvs_gguf_destroy(g);
    unlink(path);
}

/* ---- kvsparse convert ------------------------------------------------------------------ */
/* Runs `kvsparse convert ARGS` (stderr into *err when err, malloc'ed); the exit status. */
static int convert(const char *args, char **err) {
    char *cmd, errfile[] = "/tmp/kvs_convert_err_XXXXXX";
    int fd = mkstemp(errfile);
    cr_assert(fd >= 0);
    close(fd);
    cr_assert(asprintf(&cmd, "OMP_NUM_THREADS=1 %s convert %s 2>%s", kvsparse_binary(), args, errfile) > 0);
    int rc = system(cmd);
    free(cmd);
    if (err) {
        size_t len;
        cr_assert_eq(kvs_read_file(errfile, err, &len), KVS_OK);
    }
    unlink(errfile);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

/* The bundled model converted to type; the file's path (a static buffer per type). */
static const char *converted(const char *type) {
    static char paths[5][128];
    static int n;
    char *path = paths[n++ % 5], *args;
    snprintf(path, 128, "/tmp/kvs_convert_%d_%s.gguf", (int)getpid(), type);
    cr_assert(asprintf(&args, "-m %s --out %s --type %s", shared_input(TINY), path, type) > 0);
    char *err;
    int rc = convert(args, &err);
    cr_assert_eq(rc, 0, "convert --type %s: exit %d: %s", type, rc, err);
    free(args), free(err);
    return path;
}

static void greedy(const char *model, int32_t *ids, int *n, int *prompt_tokens) {
    kvsparse_options o;
    kvsparse_options_init(&o);
    o.threads = 1, o.quiet = 1, o.kv_memory_gib = 0.05;
    kvsparse_engine *e = NULL;
    cr_assert_eq(kvsparse_create(model, &o, &e), KVSPARSE_OK, "%s", kvsparse_last_error());
    kvsparse_request r;
    kvsparse_request_init(&r);
    r.prompt = "The access code for Marigold is 48213. The sky was grey over the harbour. What is the access code for "
               "Marigold?";
    r.max_tokens = 12, r.temperature = 0, r.ignore_eos = 1;
    kvsparse_stream *s;
    cr_assert_eq(kvsparse_submit_stream(e, &r, &s), KVSPARSE_OK, "%s", kvsparse_last_error());
    kvsparse_output out;
    *n = 0;
    do {
        cr_assert_eq(kvsparse_stream_next(s, &out), KVSPARSE_OK, "%s", kvsparse_last_error());
        for (int i = 0; i < out.n_tokens && *n < 64; i++) ids[(*n)++] = out.token_ids[i];
    } while (out.finish == KVSPARSE_FINISH_NONE);
    *prompt_tokens = out.prompt_tokens;
    kvsparse_stream_close(s);
    kvsparse_destroy(e);
}

Test(gguf_convert, bf16_gives_the_safetensors_greedy_tokens) {
    const char *path = converted("bf16");
    int32_t a[64], b[64];
    int na, nb, pa, pb;
    greedy(shared_input(TINY), a, &na, &pa);
    greedy(path, b, &nb, &pb);
    cr_expect_eq(pa, pb, "prompt tokens: safetensors %d, converted %d (the tokenizer differs)", pa, pb);
    cr_expect(na == 12 && nb == na && !memcmp(a, b, sizeof *a * (size_t)na), "greedy tokens differ");
    /* the weights themselves: every one equal to the safetensors' (the norms widened to f32, as llama.cpp keeps them) */
    kvs_config cs, cg;
    kvs_checkpoint *s, *g;
    cr_assert_eq(kvs_config_load(shared_input(TINY), &cs), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(kvs_config_load(path, &cg), KVS_OK, "%s", kvs_last_error());
    cr_expect(cs.n_layers == cg.n_layers && cs.vocab_size == cg.vocab_size && cs.head_dim == cg.head_dim &&
              cs.rope_theta == cg.rope_theta && cs.rms_norm_eps == cg.rms_norm_eps && cs.bos_token_id == cg.bos_token_id &&
              cs.tie_word_embeddings == cg.tie_word_embeddings && cg.dtype == KVS_BF16);
    cr_expect(cg.n_eos == 2 && cg.eos_token_ids[0] == 8191 && cg.eos_token_ids[1] == 8188, "eos and eot kept");
    cr_assert_eq(kvs_checkpoint_open(shared_input(TINY), &cs, &s), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(kvs_checkpoint_open(path, &cg, &g), KVS_OK, "%s", kvs_last_error());
    int64_t shape[2];
    int nd, n = 0;
    for (int layer = -1, k = -1; kvs_weight_next(&cs, &layer, &k, shape, &nd); n++) {
        kvs_host_tensor hs, hg;
        size_t count = (size_t)(nd == 2 ? shape[0] * shape[1] : shape[0]);
        float *xs = malloc(count * 4), *xg = malloc(count * 4);
        cr_assert_eq(kvs_checkpoint_read(s, (kvs_weight_kind)k, layer, &hs), KVS_OK);
        kvs_to_f32(xs, hs.data, hs.dtype, count);
        cr_assert_eq(kvs_checkpoint_read(g, (kvs_weight_kind)k, layer, &hg), KVS_OK, "%s", kvs_last_error());
        kvs_to_f32(xg, hg.data, hg.dtype, count);
        cr_expect(!memcmp(xs, xg, count * 4), "weight %d of layer %d", k, layer);
        cr_expect(hg.dtype == (nd == 2 ? KVS_BF16 : KVS_F32), "weight %d of layer %d: %s", k, layer,
                  kvs_dtype_name(hg.dtype));
        free(xs), free(xg);
    }
    cr_expect_eq(n, 74);
    kvs_checkpoint_destroy(s), kvs_checkpoint_destroy(g);
    unlink(path);
}

/* Every tensor of file against the fixture's of the same name: the same type
 * (and, with bytes, the same data). Returns the tensors compared. */
static int same_tensors_as(const char *file, const char *fixture_name, bool bytes) {
    kvs_gguf *a, *b;
    cr_assert_eq(kvs_gguf_open(file, &a), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(kvs_gguf_open(fixture(fixture_name), &b), KVS_OK, "%s", kvs_last_error());
    cr_expect_eq(a->n_tensors, b->n_tensors);
    int n = 0, same_bytes = 0;
    for (size_t i = 0; i < b->n_tensors; i++) {
        const kvs_gguf_tensor *tb = &b->tensors[i], *ta = kvs_gguf_find_tensor(a, tb->name);
        cr_expect(ta, "%s: no %s", file, tb->name);
        if (!ta) continue;
        kvs_ggml_layout la, lb;
        kvs_ggml_type_layout(ta->type, &la), kvs_ggml_type_layout(tb->type, &lb);
        cr_expect_eq(ta->type, tb->type, "%s: %s, llama.cpp %s", tb->name, la.name, lb.name);
        cr_expect(ta->ne[0] == tb->ne[0] && ta->ne[1] == tb->ne[1], "%s: shape", tb->name);
        bool eq = ta->nbytes == tb->nbytes && !memcmp(ta->data, tb->data, ta->nbytes);
        if (bytes) cr_expect(eq, "%s (%s): bytes differ from llama.cpp's", tb->name, lb.name);
        same_bytes += eq;
        n++;
    }
    cr_log_info("%s: %d of %d tensors byte-identical to %s", file, same_bytes, n, fixture_name);
    kvs_gguf_destroy(a), kvs_gguf_destroy(b);
    return n;
}

Test(gguf_convert, q8_0_equals_llama_quantizes_file_tensor_for_tensor) {
    const char *path = converted("q8_0");
    cr_expect_eq(same_tensors_as(path, "tiny-q8_0.gguf", true), 74);
    unlink(path);
}

Test(gguf_convert, q4_k_m_chooses_llama_quantizes_types) {
    const char *path = converted("q4_k_m");
    /* the same types per tensor; the quantizers being llama.cpp's, the same bytes too */
    cr_expect_eq(same_tensors_as(path, "tiny-q4_k_m.gguf", true), 74);
    unlink(path);
}

Test(gguf_convert, converting_twice_gives_the_same_bytes) {
    const char *a = converted("q4_k_m"), *b = converted("q4_k_m");
    cr_assert_str_eq(a, b);
    char *da, *db, path2[160];
    size_t la, lb;
    snprintf(path2, sizeof path2, "%s.again", a);
    cr_assert_eq(kvs_read_file(a, &da, &la), KVS_OK);
    char *args;
    cr_assert(asprintf(&args, "-m %s --out %s --type q4_k_m", shared_input(TINY), path2) > 0);
    cr_assert_eq(convert(args, NULL), 0);
    cr_assert_eq(kvs_read_file(path2, &db, &lb), KVS_OK);
    cr_expect(la == lb && !memcmp(da, db, la), "two conversions differ");
    free(da), free(db), free(args);
    unlink(a), unlink(path2);
}

Test(gguf_convert, dummy_weights_without_a_tokenizer_load_for_ids) {
    char path[128], *args, *err;
    snprintf(path, sizeof path, "/tmp/kvs_convert_%d_dummy.gguf", (int)getpid());
    cr_assert(asprintf(&args, "--config %s/config.json --load-format dummy --out %s --type q8_0", shared_input(TINY),
                       path) > 0);
    cr_assert_eq(convert(args, &err), 0, "%s", err);
    kvs_gguf *g;
    cr_assert_eq(kvs_gguf_open(path, &g), KVS_OK, "%s", kvs_last_error());
    cr_expect_null(kvs_gguf_find(g, "tokenizer.ggml.tokens"));
    kvs_gguf_destroy(g);
    kvs_config cfg;
    kvs_checkpoint *ck;
    cr_assert_eq(kvs_config_load(path, &cfg), KVS_OK, "%s", kvs_last_error());
    cr_expect_eq(cfg.vocab_size, 8192);
    cr_assert_eq(kvs_checkpoint_open(path, &cfg, &ck), KVS_OK, "%s", kvs_last_error());
    kvs_checkpoint_destroy(ck);
    free(args), free(err);
    unlink(path);
}

Test(gguf_convert, bad_options_and_paths_are_refused_clearly) {
    char *args, *err;
    cr_assert(asprintf(&args, "-m %s --out /tmp/x.gguf --type q3_k", shared_input(TINY)) > 0);
    cr_expect_eq(convert(args, &err), 2);
    cr_expect(strstr(err, "--type") && strstr(err, "q3_k"), "%s", err);
    free(args), free(err);
    cr_assert(asprintf(&args, "-m %s --out /nonexistent-dir/x.gguf --type q8_0", shared_input(TINY)) > 0);
    cr_expect_eq(convert(args, &err), 1);
    cr_expect(strstr(err, "/nonexistent-dir/x.gguf"), "%s", err);
    free(args), free(err);
    cr_expect_eq(convert("-m /nonexistent-model --out /tmp/x.gguf", &err), 1);
    cr_expect(strstr(err, "nonexistent-model"), "%s", err);
    free(err);
    cr_expect_eq(convert("--out /tmp/x.gguf", &err), 2);
    free(err);
}

/* Other architectures: model dir converted to f32 reads back as the same
 * weights (qwen2's biases and tied embedding, qwen3's q/k norms, a llama
 * architecture's q/k interleave undone) and the same config. */
static void converts_to_the_same_weights(const char *dir) {
    char path[160], *args, *err;
    snprintf(path, sizeof path, "/tmp/kvs_convert_%d_arch.gguf", (int)getpid());
    cr_assert(asprintf(&args, "-m %s --out %s --type f32", dir, path) > 0);
    cr_assert_eq(convert(args, &err), 0, "%s: %s", dir, err);
    kvs_config cs, cg;
    kvs_checkpoint *s, *g;
    cr_assert_eq(kvs_config_load(dir, &cs), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(kvs_config_load(path, &cg), KVS_OK, "%s", kvs_last_error());
    cr_expect(cs.n_layers == cg.n_layers && cs.n_heads == cg.n_heads && cs.n_kv_heads == cg.n_kv_heads &&
              cs.head_dim == cg.head_dim && cs.vocab_size == cg.vocab_size && cs.qk_norm == cg.qk_norm &&
              cs.attention_bias == cg.attention_bias && cs.tie_word_embeddings == cg.tie_word_embeddings &&
              cs.rope_theta == cg.rope_theta && cs.rms_norm_eps == cg.rms_norm_eps, "%s: config", dir);
    cr_assert_eq(kvs_checkpoint_open(dir, &cs, &s), KVS_OK, "%s", kvs_last_error());
    cr_assert_eq(kvs_checkpoint_open(path, &cg, &g), KVS_OK, "%s", kvs_last_error());
    int64_t shape[2];
    int nd;
    for (int layer = -1, k = -1; kvs_weight_next(&cs, &layer, &k, shape, &nd);) {
        kvs_host_tensor hs, hg;
        size_t count = (size_t)(nd == 2 ? shape[0] * shape[1] : shape[0]);
        float *xs = malloc(count * 4), *xg = malloc(count * 4);
        cr_assert_eq(kvs_checkpoint_read(s, (kvs_weight_kind)k, layer, &hs), KVS_OK);
        kvs_to_f32(xs, hs.data, hs.dtype, count);
        cr_assert_eq(kvs_checkpoint_read(g, (kvs_weight_kind)k, layer, &hg), KVS_OK, "%s", kvs_last_error());
        kvs_to_f32(xg, hg.data, hg.dtype, count);
        cr_expect(!memcmp(xs, xg, count * 4), "%s: weight %d of layer %d", dir, k, layer);
        free(xs), free(xg);
    }
    kvs_checkpoint_destroy(s), kvs_checkpoint_destroy(g);
    free(args), free(err);
    unlink(path);
}

Test(gguf_convert, other_architectures_read_back_as_the_same_weights) {
    converts_to_the_same_weights(shared_input("fixtures/arch/mistral"));
    converts_to_the_same_weights(shared_input("fixtures/arch/qwen2-bias-tied"));
    converts_to_the_same_weights(src_path("tests/fixtures/arch/qwen3"));
}

/* Llama 3's RoPE scaling goes into the file as llama.cpp writes it (a divisor
 * per frequency, rope_freqs.weight) and comes back as the same model: the
 * llama3-rope-scaling fixture's logits from its f32 GGUF equal the
 * safetensors' to float rounding (the frequencies are computed another way). */
Test(gguf_convert, llama3_rope_scaling_travels_as_rope_freqs) {
    const char *dir = shared_input("fixtures/arch/llama3-rope-scaling");
    converts_to_the_same_weights(dir);
    char path[160], *args, *err;
    snprintf(path, sizeof path, "/tmp/kvs_convert_%d_rope.gguf", (int)getpid());
    cr_assert(asprintf(&args, "-m %s --out %s --type f32", dir, path) > 0);
    cr_assert_eq(convert(args, &err), 0, "%s", err);
    kvs_config cg;
    cr_assert_eq(kvs_config_load(path, &cg), KVS_OK, "%s", kvs_last_error());
    cr_expect_eq(cg.rope_type, KVS_ROPE_FACTORS);
    int scaled = 0;
    for (int i = 0; i < cg.head_dim / 2; i++) scaled += cg.rope_freq_factors[i] > 1;
    cr_expect_gt(scaled, 0, "no frequency is scaled: the case tests nothing");
    rig a, b;
    rig_open(&a, dir, NULL, RIG_BLOCKS(600, 1), 1);
    rig_open(&b, path, NULL, RIG_BLOCKS(600, 1), 1);
    int v = a.cfg.vocab_size, n = 500;
    int32_t *ids = malloc(sizeof(int32_t) * n);
    for (int i = 0; i < n; i++) ids[i] = (int32_t)((i * 7919u + 13) % (unsigned)v);
    float *la = malloc(sizeof(float) * v), *lb = malloc(sizeof(float) * v);
    int sa = kvs_kv_seq_create(a.kv), sb = kvs_kv_seq_create(b.kv);
    rig_run(&a, sa, ids, n, 0, la);
    rig_run(&b, sb, ids, n, 0, lb);
    double d = 0, peak = 0;
    for (int i = 0; i < v; i++) d = fmax(d, fabs((double)la[i] - lb[i])), peak = fmax(peak, fabs((double)la[i]));
    cr_log_info("llama3-rope-scaling: f32 GGUF (rope_freqs) vs safetensors: logits within %.2e (peak %.2f) at "
                "position %d", d, peak, n - 1);
    cr_expect(d <= 1e-3 * fmax(peak, 1), "logits %.3g apart", d);
    rig_close(&a), rig_close(&b);
    free(ids), free(la), free(lb), free(args), free(err);
    unlink(path);
}
