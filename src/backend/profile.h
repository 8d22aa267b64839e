/* backend/profile.h: where a step's time goes (bench throughput --profile).
 * A backend wrapper times every op of the forward, the sparsity and the
 * sampling as a region of the enqueued work, between two timing marks
 * (backend.h: CUDA events on the stream; the CPU's clock), and adds the
 * regions up by the op's phase. After each step (its work done: the step's
 * fence waited for, then a synchronize) the caller names the step's kind; the regions are read
 * then, and the step's wall time that no region covers is host time
 * (scheduling, metadata, launches, syncs, copies between host and device).
 *
 * Each op is its own region, so the time between two ops (the host preparing
 * the next one while the device waits) is host time, not the op's; a region
 * holds its op's launch when the device was idle as it was enqueued. The
 * wrapper takes graphs away (graph_begin NULL): a captured op could not be
 * timed (docs/PERFORMANCE.md: profiled runs decode eagerly in the graphs'
 * padded layout). One thread uses the wrapper: the engine's, at world 1. */
#ifndef KVS_PROFILE_H
#define KVS_PROFILE_H

#include "backend/backend.h"

typedef enum {
    KVS_PHASE_GEMM,      /* matmul, matmul_fp8 and quantize_fp8 (its input); the LM head too */
    KVS_PHASE_ATTENTION, /* attention */
    KVS_PHASE_OTHER,     /* embedding, norms, rope + KV write, swiglu (fp8: the last two with their
                            outputs' quantize), add, row gathers, device copies */
    KVS_PHASE_SPARSIFY,  /* window_capture, sparsity_scores, snapkv_select, kv_gather, snapkv_compact_batch */
    KVS_PHASE_SAMPLING,  /* process_logits, sample, sample_shard, top_logprobs */
    KVS_PHASES
} kvs_phase;

/* A step by the tokens in it: decode tokens are those of sequences with one
 * token in the step (the graphs' rule: a pure-decode step is all of them). */
typedef enum { KVS_STEP_PREFILL, KVS_STEP_DECODE, KVS_STEP_MIXED, KVS_STEP_EMPTY, KVS_STEP_KINDS } kvs_step_kind;
kvs_step_kind kvs_step_kind_of(int64_t tokens, int64_t decode_tokens);
const char *kvs_step_kind_name(kvs_step_kind k); /* "prefill", "decode", "mixed", "empty" */

typedef struct {
    double op_ms[KVS_STEP_KINDS][KVS_PHASES]; /* the regions, by step kind and phase */
    double host_ms[KVS_STEP_KINDS];           /* each step's wall minus its regions */
    double read_ms;                           /* the profiler's own: reading the marks after each step */
    double host_phase_ms[KVS_HOST_PHASES];    /* core.h's host clock since kvs_profile_start (its own totals) */
    double wall_ms;                           /* kvs_profile_start to the last kvs_profile_step */
    int64_t steps[KVS_STEP_KINDS], regions;
    int64_t tokens[KVS_STEP_KINDS], decode_tokens[KVS_STEP_KINDS]; /* the steps' tokens, and their decodes */
} kvs_profile_totals;

typedef struct kvs_profile kvs_profile;

/* *out: inner with its ops timed (it shares inner's state; destroying it
 * destroys inner when owns_inner); *profile: its counts, valid as long as
 * *out. Nothing is timed before kvs_profile_start. */
kvs_status kvs_backend_profile_wrap(kvs_backend *inner, bool owns_inner, kvs_backend **out, kvs_profile **profile);
/* Zeroes the totals and starts timing: the wall clock from now (and the
 * host clock, core.h, until the wrapper is destroyed). */
void kvs_profile_start(kvs_profile *p);
/* After a step of `tokens` tokens, `decode_tokens` of them decodes: its
 * regions into the totals under its kind (kvs_step_kind_of), its wall since
 * the previous call (or the start). Fails when marks ran out (out of memory). */
kvs_status kvs_profile_step(kvs_profile *p, int64_t tokens, int64_t decode_tokens);
const kvs_profile_totals *kvs_profile_get(const kvs_profile *p);

#endif
