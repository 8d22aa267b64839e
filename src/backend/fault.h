/* backend: fault injection, for the failure tests (tests/test_faults.c) and
 * for `kvsparse` itself under KVSPARSE_FAULT (the tests drive the real binary).
 *
 * A wrapper backend: every op is the inner backend's, except
 * - embedding, the first op of every forward step: the fail_step-th call
 *   fails as a CUDA kernel fault would (the op runs, the failure is recorded,
 *   the wrapper's check reports it from then on);
 * - sample and sample_shard: the rows sampled with nan_seed (one chosen
 *   request: the client's "seed") get a NaN logit first.
 * The wrapper has no graphs (graph ops NULL), so every step calls embedding. */
#ifndef KVS_BACKEND_FAULT_H
#define KVS_BACKEND_FAULT_H

#include "backend/backend.h"

typedef struct {
    int fail_step;     /* > 0: forward step fail_step (counted from 1) fails; 0: none */
    bool nan;          /* poison the rows sampled with nan_seed */
    uint64_t nan_seed;
} kvs_fault_spec;

/* "step=N", "nan-seed=S" or both, comma-separated (KVSPARSE_FAULT's syntax);
 * errors name the part. */
kvs_status kvs_fault_parse(const char *text, kvs_fault_spec *out);
/* The wrapper over inner. owns_inner: its destroy destroys inner too; else
 * inner must outlive it. */
kvs_status kvs_backend_fault_wrap(kvs_backend *inner, const kvs_fault_spec *f, bool owns_inner, kvs_backend **out);

#endif
