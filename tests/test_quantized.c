/* Weights kept in llama.cpp's block formats on the CPU (model/ggml_weights.c,
 * the backend's matmul_q / embedding_q): a GGUF file's own blocks against the
 * same file dequantized at load, --quantization q8_0 / q4_k against the bf16
 * weights, and what is refused. The kernels themselves are checked against the
 * dequantizers in test_cpu_quant; llama.cpp's outputs in test_gguf. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

#define TINY "models/tiny-needle-llama"

static const char *fixture(const char *file) {
    static char path[4][1024];
    static int k;
    snprintf(path[k], sizeof path[k], "%s", shared_path("fixtures/gguf/"));
    strncat(path[k], file, sizeof path[k] - strlen(path[k]) - 1);
    return path[k++ % 4];
}

/* A prompt the model knows: the first public retrieval prompt's ids, as llama.cpp ran it. */
static int32_t *a_prompt(int *n) {
    json_t *lines = load_jsonl(shared_path("fixtures/gguf/llamacpp_greedy_public.jsonl"));
    int32_t *ids = json_ids(json_object_get(json_array_get(lines, 0), "prompt_ids"), n);
    json_decref(lines);
    return ids;
}

/* The last position's logits of the prompt and then greedy tokens, on rig r. */
static void run(rig *r, const int32_t *ids, int n, float *logits, int32_t *greedy, int n_greedy) {
    int seq = kvs_kv_seq_create(r->kv);
    cr_assert_geq(seq, 0);
    for (int off = 0; off < n; off += 512) rig_run(r, seq, ids + off, n - off < 512 ? n - off : 512, off, logits);
    float *step = malloc(sizeof(float) * (size_t)r->cfg.vocab_size);
    memcpy(step, logits, sizeof(float) * (size_t)r->cfg.vocab_size);
    for (int t = 0; t < n_greedy; t++) {
        greedy[t] = argmax_f(step, r->cfg.vocab_size);
        rig_run(r, seq, &greedy[t], 1, n + t, step);
    }
    free(step);
    kvs_kv_free(r->kv, seq);
}

static double max_diff(const float *a, const float *b, int n) {
    double d = 0;
    for (int i = 0; i < n; i++) d = fmax(d, fabs((double)a[i] - b[i]));
    return d;
}

/* The prompt and 8 greedy tokens on a and on b: their last-position logits
 * within tol (logged as what), and the same top token. */
static void expect_close(rig *a, rig *b, const char *what, double tol) {
    int n;
    int32_t *ids = a_prompt(&n);
    int v = a->cfg.vocab_size;
    float *la = malloc(sizeof(float) * v), *lb = malloc(sizeof(float) * v);
    int32_t ga[8], gb[8];
    run(a, ids, n, la, ga, 8);
    run(b, ids, n, lb, gb, 8);
    double d = max_diff(la, lb, v);
    cr_log_info("%s: last-position logits within %.4f; greedy %s", what, d,
                memcmp(ga, gb, sizeof ga) ? "differs" : "equal (8 tokens)");
    cr_expect(d <= tol, "%s: logits %.4f apart (tolerance %.2f)", what, d, tol);
    cr_expect_eq(argmax_f(la, v), argmax_f(lb, v), "%s: top token", what);
    free(la), free(lb), free(ids);
}

/* A CPU backend without the block kernels, as the CUDA backend is: the same
 * file then loads dequantized (the reference for the kept blocks). */
static kvs_backend *cpu_without_blocks(kvs_backend **owner) {
    cr_assert_eq(kvs_backend_cpu_create_typed(0, KVS_F32, KVS_F32, owner), KVS_OK);
    kvs_backend *b = malloc(sizeof *b);
    *b = **owner;
    b->matmul_q = NULL;
    b->embedding_q = NULL;
    return b;
}

/* Tolerance: decode's int8 activations (llama.cpp's scheme) move logits of
 * about 10-20 by 0.081 (Q8_0) and 0.156 (Q4_K_M: its activations scaled per 256)
 * here, the same in every kernel set; measured and logged. */
static void kept_against_dequantized(const char *file, double tol) {
    rig kept, deq;
    kvs_backend *owner, *plain = cpu_without_blocks(&owner);
    rig_open(&kept, fixture(file), NULL, RIG_BLOCKS(1200, 1), 1);
    rig_open(&deq, fixture(file), plain, RIG_BLOCKS(1200, 1), 1);
    cr_assert(kvs_quantization_is_ggml(kvs_model_config(kept.m)->quantization), "%s: blocks not kept", file);
    cr_assert_eq(kvs_model_config(deq.m)->quantization, KVS_QUANT_NONE);
    char what[96];
    snprintf(what, sizeof what, "%s: kept blocks vs dequantized at load", file);
    expect_close(&kept, &deq, what, tol);
    rig_close(&kept), rig_close(&deq);
    free(plain), owner->destroy(owner);
}

Test(quantized, a_q8_0_files_blocks_give_its_dequantized_logits) { kept_against_dequantized("tiny-q8_0.gguf", 0.2); }
Test(quantized, a_q4_k_m_files_blocks_give_its_dequantized_logits) {
    kept_against_dequantized("tiny-q4_k_m.gguf", 0.2);
}

/* --quantization on the safetensors: the bf16 model's answer, logits within the format's error. */
static void quantized_against_bf16(kvs_quantization q, double tol) {
    rig full, quant;
    rig_open(&full, shared_path(TINY), NULL, RIG_BLOCKS(1200, 1), 1);
    rig_open_quantized(&quant, shared_path(TINY), NULL, RIG_BLOCKS(1200, 1), 1, q);
    char what[96];
    snprintf(what, sizeof what, "--quantization %s vs bf16", kvs_quantization_name(q));
    expect_close(&full, &quant, what, tol);
    rig_close(&full), rig_close(&quant);
}

Test(quantized, q8_0_at_load_keeps_the_bf16_answer) { quantized_against_bf16(KVS_QUANT_Q8_0, 0.5); }
Test(quantized, q4_k_at_load_keeps_the_bf16_answer) { quantized_against_bf16(KVS_QUANT_Q4_K, 1.5); }

Test(quantized, the_methods_parse_and_others_are_named) {
    kvs_quantization q;
    cr_expect_eq(kvs_quantization_parse("q8_0", &q), KVS_OK);
    cr_expect_eq(q, KVS_QUANT_Q8_0);
    cr_expect_eq(kvs_quantization_parse("q4_k", &q), KVS_OK);
    cr_expect_eq(q, KVS_QUANT_Q4_K);
    cr_expect_eq(kvs_quantization_parse("q4_k_m", &q), KVS_ERR_INVALID);
    cr_expect(strstr(kvs_last_error(), "q4_k_m") && strstr(kvs_last_error(), "q8_0"), "%s", kvs_last_error());
}

/* A backend without the block kernels refuses --quantization q8_0 by name. */
Test(quantized, a_backend_without_block_kernels_refuses_q8_0) {
    kvs_backend *owner, *plain = cpu_without_blocks(&owner);
    kvs_config cfg;
    kvs_checkpoint *ck;
    cr_assert_eq(kvs_config_load(shared_path(TINY), &cfg), KVS_OK);
    cr_assert_eq(kvs_checkpoint_open(shared_path(TINY), &cfg, &ck), KVS_OK);
    cfg.quantization = KVS_QUANT_Q8_0;
    kvs_model *m = NULL;
    cr_expect_eq(kvs_model_create(&cfg, ck, plain, &m), KVS_ERR_UNSUPPORTED);
    cr_expect_null(m);
    cr_expect(strstr(kvs_last_error(), "q8_0") && strstr(kvs_last_error(), "block formats"), "%s", kvs_last_error());
    kvs_checkpoint_destroy(ck);
    free(plain), owner->destroy(owner);
}

/* Tensor parallelism: --quantization q4_k is refused by name; a quantized GGUF
 * file loads dequantized on every rank and answers as on one. */
Test(quantized, tensor_parallelism_refuses_q4_k_and_dequantizes_a_gguf_file) {
    kvs_config cfg;
    kvs_checkpoint *ck;
    cr_assert_eq(kvs_config_load(shared_path(TINY), &cfg), KVS_OK);
    cr_assert_eq(kvs_checkpoint_open(shared_path(TINY), &cfg, &ck), KVS_OK);
    cfg.quantization = KVS_QUANT_Q4_K;
    kvs_runner *r = NULL;
    cr_expect_eq(kvs_runner_create_cpu(&cfg, ck, 2, 1, KVS_F32, KVS_F32, NULL, &r), KVS_ERR_UNSUPPORTED);
    cr_expect(strstr(kvs_last_error(), "q4_k") && strstr(kvs_last_error(), "--tensor-parallel-size 2"), "%s",
              kvs_last_error());
    kvs_checkpoint_destroy(ck);
    cr_assert_eq(kvs_config_load(fixture("tiny-q8_0.gguf"), &cfg), KVS_OK);
    cr_assert_eq(kvs_checkpoint_open(fixture("tiny-q8_0.gguf"), &cfg, &ck), KVS_OK);
    cr_expect_eq(kvs_runner_create_cpu(&cfg, ck, 2, 1, KVS_F32, KVS_F32, NULL, &r), KVS_OK, "%s", kvs_last_error());
    kvs_runner_destroy(r);
    kvs_checkpoint_destroy(ck);
}
