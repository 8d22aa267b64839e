/* kvsparse.h: the embedding API of libkvsparse (the one public header that
 * `make install` installs; pkg-config name kvsparse).
 *
 *   kvsparse_options o;
 *   kvsparse_options_init(&o);
 *   kvsparse_engine *e;
 *   if (kvsparse_create("models/tiny-needle-llama", &o, &e) != KVSPARSE_OK)
 *       fprintf(stderr, "%s\n", kvsparse_last_error());
 *   kvsparse_request r;
 *   kvsparse_request_init(&r);
 *   r.prompt = "...";
 *   kvsparse_stream *s;
 *   kvsparse_submit_stream(e, &r, &s);
 *   kvsparse_output out;
 *   while (kvsparse_stream_next(s, &out) == KVSPARSE_OK) {
 *       fwrite(out.text, 1, out.text_len, stdout);
 *       if (out.finish != KVSPARSE_FINISH_NONE) break;
 *   }
 *   kvsparse_stream_close(s);
 *   kvsparse_destroy(e);
 *
 * An engine runs its own thread (continuous batching: requests submitted from
 * any thread run together). Every function that can fail returns a status;
 * the message of the calling thread's last failure is kvsparse_last_error().
 * C11 and C++17 compile this header alone (tests/test_kvsparse_header.sh). */
#ifndef KVSPARSE_H
#define KVSPARSE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVSPARSE_VERSION_MAJOR 0
#define KVSPARSE_VERSION_MINOR 1
#define KVSPARSE_VERSION_PATCH 0
const char *kvsparse_version(void); /* "0.1.0" */

typedef enum {
    KVSPARSE_OK = 0,
    KVSPARSE_ERR_IO,          /* a file could not be opened or read */
    KVSPARSE_ERR_FORMAT,      /* malformed input (config.json, safetensors, tokenizer.json, ...) */
    KVSPARSE_ERR_UNSUPPORTED, /* well-formed but not supported (an architecture, a device) */
    KVSPARSE_ERR_INVALID,     /* a bad argument (the message names it) */
    KVSPARSE_ERR_NOMEM,       /* out of memory */
    KVSPARSE_ERR_NOT_FOUND,
    KVSPARSE_ERR_INTERNAL,    /* the engine failed (a device error): destroy it */
    KVSPARSE_ERR_BUSY,        /* the queue is full: try again later */
    KVSPARSE_ERR_CLOSED       /* kvsparse_stream_next: the request has ended, nothing more comes */
} kvsparse_status;

/* The calling thread's last failure, one line naming what is wrong ("" when none). */
const char *kvsparse_last_error(void);
const char *kvsparse_status_name(kvsparse_status s); /* "ok", "invalid", ... */

/* ---- the engine ------------------------------------------------------------ */
typedef struct {
    const char *device;        /* "cpu" (default), "cuda" or "cuda:N" (a build with CUDA) */
    int threads;               /* CPU threads (0: one per core, or $OMP_NUM_THREADS) */
    double kv_memory_gib;      /* the KV pool (0: 1 GiB) */
    int max_num_seqs;          /* requests running at once (0: 64) */
    int max_model_len;         /* context limit (0: the model's) */
    /* the KV policy of every request: "full" (default), "snapkv", "pyramidkv",
       "streamingllm"; a budget "10%", "0.1" or "256" (NULL: 10%); the first
       kv_full_layers layers stay full (docs/SPARSITY.md) */
    const char *kv_policy;
    const char *kv_budget;
    int kv_full_layers;
    int quiet;                 /* nonzero: log warnings and errors only (default: info too, on stderr) */
} kvsparse_options;

void kvsparse_options_init(kvsparse_options *o);

typedef struct kvsparse_engine kvsparse_engine;

/* Loads a Hugging Face model folder (config.json, safetensors, tokenizer.json)
 * or a GGUF file (a path ending in .gguf, with its tokenizer in the metadata)
 * and starts the engine's thread. o NULL: the defaults. */
kvsparse_status kvsparse_create(const char *model_dir, const kvsparse_options *o, kvsparse_engine **out);
/* Aborts what still runs, stops the thread, frees everything. NULL is a no-op.
 * Streams still open must be closed before. */
void kvsparse_destroy(kvsparse_engine *e);

/* ---- requests ---------------------------------------------------------------
 * max_tokens, temperature, top_p and top_k left at KVSPARSE_MODEL_DEFAULT (what
 * kvsparse_request_init sets; any negative value) take the model's default: the
 * field of its generation_config.json (do_sample false: temperature 0, greedy;
 * max_new_tokens for max_tokens), else the built-in one in brackets below. The
 * file's min_p and repetition_penalty, when it sets them, apply to every
 * request. serve and generate read the file the same way (docs/SERVING.md
 * "Request defaults"). */
#define KVSPARSE_MODEL_DEFAULT (-1)
typedef struct {
    const char *prompt;        /* UTF-8 text (copied) */
    int chat;                  /* nonzero: prompt is a user message, rendered with the model's chat template */
    const char *system;        /* chat: a system message before it (NULL: none) */
    int max_tokens;            /* tokens to generate at most, >= 1 (64; the default is capped by the context) */
    float temperature;         /* 0: greedy (0) */
    float top_p;               /* in (0, 1] (1: off) */
    int top_k;                 /* 0: off (0) */
    uint64_t seed;             /* the sampling seed (default 0) */
    int ignore_eos;            /* nonzero: generate exactly max_tokens tokens */
} kvsparse_request;

void kvsparse_request_init(kvsparse_request *r);

typedef enum {
    KVSPARSE_FINISH_NONE = 0, /* more follows */
    KVSPARSE_FINISH_STOP,     /* the model ended (EOS) */
    KVSPARSE_FINISH_LENGTH,   /* max_tokens or the context limit */
    KVSPARSE_FINISH_ABORT,    /* kvsparse_abort, or the engine was destroyed */
    KVSPARSE_FINISH_ERROR     /* error says why */
} kvsparse_finish;

/* One delivery: the request's new tokens and their text. The pointers are
 * valid during the callback, or until the next kvsparse_stream_next. */
typedef struct {
    uint64_t request_id;
    const char *text;          /* new UTF-8 text (complete characters), not NUL-terminated */
    size_t text_len;
    const int32_t *token_ids;  /* the new tokens */
    int n_tokens;
    kvsparse_finish finish;    /* != NONE on the request's last delivery */
    const char *error;         /* finish == ERROR: the message */
    int prompt_tokens, completion_tokens;
    double compression_ratio;  /* KV entries a full cache would hold / entries kept after the prompt (1: none dropped) */
} kvsparse_output;

/* Push: fn is called on the engine's thread for every delivery, the last
 * with finish != NONE; it must return quickly and may call kvsparse_abort
 * only. *request_id may be NULL. */
typedef void (*kvsparse_callback)(void *user, const kvsparse_output *out);
kvsparse_status kvsparse_submit(kvsparse_engine *e, const kvsparse_request *r, kvsparse_callback fn, void *user,
                                uint64_t *request_id);
/* Ends a request (its last delivery has finish ABORT). Unknown or finished ids are ignored. */
void kvsparse_abort(kvsparse_engine *e, uint64_t request_id);

/* Pull: deliveries are queued on a stream, read on the caller's thread. */
typedef struct kvsparse_stream kvsparse_stream;
kvsparse_status kvsparse_submit_stream(kvsparse_engine *e, const kvsparse_request *r, kvsparse_stream **out);
uint64_t kvsparse_stream_id(const kvsparse_stream *s);
/* Waits for the next delivery (merged: all that came since the last call);
 * KVSPARSE_ERR_CLOSED once the last one (finish != NONE) was read. */
kvsparse_status kvsparse_stream_next(kvsparse_stream *s, kvsparse_output *out);
/* Aborts the request if it still runs and frees the stream. */
void kvsparse_stream_close(kvsparse_stream *s);

#ifdef __cplusplus
}
#endif

#endif
