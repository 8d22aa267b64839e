/* Helpers shared by the tests: where things are, fixtures, comparisons. */
#ifndef KVS_TESTUTIL_H
#define KVS_TESTUTIL_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

/* The time bounds hold in the release build; the sanitizer build runs
 * unoptimised, instrumented code several times slower, so there they are this
 * many times wider (what it checks is memory, not time), and RSS, which ASan's
 * quarantine keeps up, is not checked. */
#if defined(__SANITIZE_ADDRESS__)
#define SLOWDOWN 5.0
#else
#define SLOWDOWN 1.0
#endif

/* The seed of a randomised test: $KVS_TEST_SEED when set, else one drawn from
 * the clock and the process id. Prints "suite::test: seed N (set
 * KVS_TEST_SEED=N to repeat)" to stderr, so a failing run shows it; later
 * calls in the same process return the same seed. */
uint64_t kvs_test_seed(void);

/* $KVS_SOURCE_DIR/rel and $KVS_SHARED_DIR/rel (static buffers, 4 of each, rotating) */
const char *src_path(const char *rel);
const char *shared_path(const char *rel);

/* Honest results: a test whose inputs are missing is skipped, never passed.
 * kvs_test_need skips the running test ("needs WHAT (PATH): skipped") when
 * PATH cannot be read; shared_input is shared_path(rel) after that check
 * (../shared is not part of the repository). Every test binary prints each
 * skipped test and its reason, and exits KVS_TEST_SKIPPED when tests were
 * skipped and none passed or failed (CMakeLists.txt: SKIP_RETURN_CODE), so
 * ctest shows it as skipped rather than passed. */
enum { KVS_TEST_SKIPPED = 77 };
void kvs_test_need(const char *path, const char *what);
const char *shared_input(const char *rel);
/* The path of the built kvsparse binary ($KVS_BINARY). */
const char *kvsparse_binary(void);

/* Reads a JSONL file: returns a JSON array of the lines' objects. */
json_t *load_jsonl(const char *path);
json_t *load_json(const char *path);

/* tests/fixtures/arch/<name> (the project's: Qwen3, sliding windows), else
 * shared/fixtures/arch/<name>: its folder's path into dir, and its reference.json (asserted). */
json_t *arch_reference(const char *name, char *dir, size_t cap);

/* Decodes base64 of little-endian float32; returns malloc'ed array, *n floats. */
float *b64_floats(const char *b64, size_t *n);
/* ids from a JSON array of integers; malloc'ed. */
int32_t *json_ids(const json_t *arr, int *n);

/* One QKV GEMM's rows from separate q [n][qd], k and v [n][kd]: row i is q's
 * row i, then k's, then v's (what rope_kv_write takes); malloc'ed. */
float *qkv_rows(const float *q, const float *k, const float *v, int n, size_t qd, size_t kd);

/* A quantized model's next-token logits got [V] against the reference's ref:
 * logs the KL divergence KL(ref || got) of their softmax distributions (nats,
 * llama.cpp's measure of a quantization), the largest logit difference and the
 * argmaxes; expects the KL at most kl_bound and the same argmax unless ref's
 * top-2 gap is below the largest difference. Returns the KL. */
double expect_logits_near(const char *what, const float *ref, const float *got, int V, double kl_bound);

/* max|a-b| / max|b| */
double rel_max_diff(const float *a, const float *b, size_t n);
int argmax_f(const float *x, int n);

/* Writes text into a fresh temporary directory's file; returns the dir path (static buffer). */
const char *make_temp_dir(void);
void write_file(const char *dir, const char *name, const void *data, size_t len);
/* Runs a shell command; captures combined output into *out (malloc'ed); returns exit status. */
int run_capture(const char *cmd, char **out);

/* A model on the CPU backend with a KV cache, for the model-level tests. */
#include "backend/backend.h"
#include "kv/one_device.h"
#include "model/model.h"
#include "runner/runner.h"

typedef struct {
    kvs_config cfg;
    kvs_checkpoint *ck;
    kvs_backend *be;
    bool owns_be;
    kvs_model *m;
    kvs_executor *x; /* m's, for max_seqs sequences a step */
    kvs_kv_cache *kv;
} rig;

/* A whole model's forward on a manager with a device of its own
 * (kvs_kv_create), as the runner's step runs it on each rank: the step plan
 * made (its checks; KVS_ERR_INVALID for a bad batch), the device's tables
 * brought up to date, then kvs_executor_forward / kvs_executor_forward_sample. */
kvs_status rig_forward(kvs_executor *x, const kvs_batch *b, kvs_kv_cache *kv, float *logits);
kvs_status rig_forward_sample(kvs_executor *x, const kvs_batch *b, kvs_kv_cache *kv, const kvs_sample_row *params,
                              const kvs_sample_extras *extras, int32_t *ids, float *logprobs);
/* Every sequence of the batch: its row of the device's tables, read back,
 * against the manager's table (KVS_ERR_INTERNAL naming the first difference). */
kvs_status rig_tables_check(const kvs_batch *b, const kvs_kv_cache *kv);

/* What the runner's step does after the model's forward (src/runner/step.c),
 * for the tests that call rig_forward* with their own cache: commits the
 * batch's new tokens, then compacts what the sequences' KV policies say is due
 * (asserted). */
void kv_keep(kvs_kv_cache *kv, const kvs_batch *b);
/* Reserves and commits n tokens of seq when the pool has the blocks it needs
 * (true); otherwise checks that the reservation fails with KVS_ERR_NOMEM and
 * takes nothing (false). The random-operation tests' append. */
bool kv_try_append(kvs_kv_cache *kv, int seq, int n);

/* Loads dir on be (NULL: a new CPU backend) with a cache of n_blocks blocks and max_seqs sequences
 * (an FP8 cache with the checkpoint's KV scales). */
void rig_open(rig *r, const char *dir, kvs_backend *be, int64_t n_blocks, int max_seqs);
/* ... with the model's weights quantized (--quantization). */
void rig_open_quantized(rig *r, const char *dir, kvs_backend *be, int64_t n_blocks, int max_seqs,
                        kvs_quantization q);
void rig_close(rig *r);
/* The model of dir (its config with quantization q) created on a CPU backend
 * stripped of its FP8 ops, as the CUDA backend is below compute capability
 * 8.9: refused (KVS_ERR_UNSUPPORTED, no model) with a message that holds want
 * and "8.9". */
void expect_refused_without_fp8(const char *dir, kvs_quantization q, const char *want);
/* Room for max_seqs sequences of max_tokens in every layer of a model of up to 8 layers. */
#define RIG_BLOCKS(max_tokens, max_seqs) ((int64_t)(((max_tokens) + 15) / 16 + 1) * 8 * (max_seqs))
/* Reserves and runs ids[0..n) of seq at positions pos0.. in one step; logits of the last token. */
void rig_run(rig *r, int seq, const int32_t *ids, int n, int pos0, float *logits);

/* The decode-step graph scenario (tests of src/model/step_meta.c's padded
 * layout and CUDA graphs): sequences join (prefill steps) and leave between
 * runs of pure-decode steps of 3, 5, 4, 37 and 18 sequences, under SnapKV
 * (budget 24, window 8, first layer full) so sequences are compacted after
 * their prompt and again during decode. Tokens come from seed only (never from
 * the logits), so runs in different modes are comparable row for row. Needs a
 * rig of max_seqs >= 37 and RIG_BLOCKS(128, 40) blocks; frees its sequences. */
enum { SCEN_MAX_STEPS = 32 };
typedef struct {
    int n_steps, n_rows, vocab;
    float *logits;                          /* [n_rows][vocab]: every step's rows, in order */
    int rows[SCEN_MAX_STEPS];               /* logits rows (= sequences) of each step */
    bool decode[SCEN_MAX_STEPS];            /* a pure-decode step */
    kvs_graph_stats after[SCEN_MAX_STEPS];  /* graph stats after each step, counted from the run's start */
    bool compacted;                         /* a sparse layer ended shorter than its sequence */
} scen_run;
void scen_decode_run(rig *r, kvs_graph_mode mode, uint64_t seed, scen_run *out);
void scen_free(scen_run *s);

/* The scenario in lockstep (CPU rigs: reads KV and windows from host memory):
 * every step runs first in shadow_mode on forks of the active sequences, then
 * in mode on the sequences themselves; the forks are compared with the
 * sequences and freed. So both modes start every step from the same KV state
 * (the main run's), and a step's difference is that step's alone: a
 * compaction that keeps other entries at a near-tie of the SnapKV scores in
 * one mode cannot carry into later steps. shadow gets the shadow steps'
 * logits rows (row for row with out) and graph stats. Needs max_seqs >= 80. */
typedef struct {
    double worst_window_q;   /* max over the sequences' window rows after each step: max|q diff| / max|q| */
    double worst_window_lse; /* and max|LSE diff| / max(1, |LSE|) */
    double worst_kv;     /* max over the layers not compacted in the step: |K, V diff| / max|K, V| */
    int compactions;     /* (sequence, layer) compactions in the main steps */
    int compactions_other; /* of those, how many kept other entries in the shadow step (a near-tie) */
} scen_lockstep;
void scen_lockstep_run(rig *r, kvs_graph_mode mode, kvs_graph_mode shadow_mode, uint64_t seed, scen_run *out,
                       scen_run *shadow, scen_lockstep *ls);

#endif
