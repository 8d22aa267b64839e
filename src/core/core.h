/* core: status codes and error messages, dtypes and conversions, files,
 * timers, logging, a progress bar and a seeded RNG. Uses libc only. */
#ifndef KVS_CORE_H
#define KVS_CORE_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- status and error messages ------------------------------------------
 * Functions return kvs_status; on failure they record a one-line message that
 * names the file, tensor, field or parameter at fault (kvs_last_error()).
 * The message lives in thread-local storage, like errno. */
typedef enum {
    KVS_OK = 0,
    KVS_ERR_IO,          /* a file could not be opened / read */
    KVS_ERR_FORMAT,      /* malformed input (JSON, safetensors, ...) */
    KVS_ERR_UNSUPPORTED, /* well-formed but not supported */
    KVS_ERR_INVALID,     /* a bad argument or parameter */
    KVS_ERR_NOMEM,       /* out of memory / out of KV blocks */
    KVS_ERR_NOT_FOUND,
    KVS_ERR_INTERNAL,
    KVS_ERR_BUSY,        /* a queue is full: try again later */
} kvs_status;

kvs_status kvs_fail(kvs_status code, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
const char *kvs_last_error(void);
const char *kvs_status_name(kvs_status s);

#define KVS_TRY(expr)                      \
    do {                                   \
        kvs_status kvs_try_s_ = (expr);    \
        if (kvs_try_s_ != KVS_OK) return kvs_try_s_; \
    } while (0)

/* The capacity of a buffer grown to hold need entries: cap (first when 0)
 * doubled until it does; cap itself when it already does. */
static inline int kvs_grown_capacity(int cap, int need, int first) {
    if (need <= cap) return cap;
    int c = cap ? cap : first;
    while (c < need) c *= 2;
    return c;
}

/* ---- dtypes --------------------------------------------------------------- */
/* KVS_F8_E4M3: FP8 E4M3 codes, as a checkpoint stores them (safetensors
 * F8_E4M3) and as an FP8 KV cache holds its entries (--kv-cache-dtype fp8). */
typedef enum { KVS_F32, KVS_F16, KVS_BF16, KVS_I32, KVS_I64, KVS_U8, KVS_F8_E4M3, KVS_DTYPE_COUNT } kvs_dtype;

size_t kvs_dtype_size(kvs_dtype t);
const char *kvs_dtype_name(kvs_dtype t);

static inline float kvs_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = { (uint32_t)h << 16 };
    return v.f;
}
uint16_t kvs_f32_to_bf16(float f); /* round to nearest even, NaN kept */
float kvs_f16_to_f32(uint16_t h);
uint16_t kvs_f32_to_f16(float f);
/* FP8 E4M3 (OCP "E4M3FN", torch.float8_e4m3fn) codes: 1 sign, 4 exponent
 * (bias 7) and 3 mantissa bits, no infinities, NaN = S.1111.111, the largest
 * finite value 448. kvs_f32_to_e4m3 rounds to nearest even and saturates to
 * +-448 (infinities too), NaN -> 0x7f: CUDA's __nv_cvt_float_to_fp8(f,
 * __NV_SATFINITE, __NV_E4M3) bit for bit. kvs_e4m3_to_f32 is exact. */
#define KVS_E4M3_MAX 448.0f
uint8_t kvs_f32_to_e4m3(float f);
float kvs_e4m3_to_f32(uint8_t q);
extern const float kvs_e4m3_values[256]; /* kvs_e4m3_to_f32 of every code */
/* dst[i] = (float)src[i] for a src of dtype F32, F16, BF16 or F8_E4M3 (exact). */
void kvs_to_f32(float *dst, const void *src, kvs_dtype src_type, size_t n);

/* ---- files ------------------------------------------------------------------ */
typedef struct {
    const uint8_t *data;
    size_t size;
} kvs_mapped_file;

kvs_status kvs_map_file(const char *path, kvs_mapped_file *out);
void kvs_unmap_file(kvs_mapped_file *f);
/* Reads a whole file, NUL-terminated; *out is malloc'ed. */
kvs_status kvs_read_file(const char *path, char **out, size_t *len);
bool kvs_file_exists(const char *path);
/* dst = dir + "/" + name; fails if it does not fit. */
kvs_status kvs_path_join(char *dst, size_t cap, const char *dir, const char *name);

/* ---- time, logging, progress ------------------------------------------------ */
double kvs_now(void); /* seconds, monotonic */

/* Host work by phase (bench throughput --profile): process-wide totals of the
 * wall time the host spends in the engine's scheduling, the model's step
 * metadata, the runner's KV policy (commits, the sparsify batch's planning and
 * enqueue) and the waits for the device at a step's end, timed where they
 * happen while the clock is on. Whether the device was busy meanwhile is not
 * theirs to say (the profile's host row is the device's idle time). Every
 * thread adds to the same totals. */
typedef enum { KVS_HOST_SCHEDULE, KVS_HOST_METADATA, KVS_HOST_KV_POLICY, KVS_HOST_WAIT, KVS_HOST_PHASES } kvs_host_phase;
void kvs_host_clock_on(bool on);   /* turning it on zeroes the totals */
double kvs_host_clock_start(void); /* kvs_now(), or 0 when the clock is off */
void kvs_host_clock_stop(kvs_host_phase phase, double start); /* adds now - start (nothing when off) */
void kvs_host_clock_totals(double ms[KVS_HOST_PHASES]);
const char *kvs_host_phase_name(kvs_host_phase phase);

typedef enum { KVS_LOG_DEBUG, KVS_LOG_INFO, KVS_LOG_WARN, KVS_LOG_ERROR } kvs_log_level;
void kvs_log(kvs_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void kvs_log_set_level(kvs_log_level level);

/* A progress bar on stderr, drawn only when stderr is a TTY. A counted one
 * (kvs_progress_start_counted) reads "LABEL [#####.....] 23/50 UNIT 4.1 s",
 * redrawn in place on a TTY and otherwise a line at every tenth of the total. */
typedef struct {
    const char *label, *unit; /* unit: NULL for the percentage bar */
    double total, done, start, last_draw;
    bool tty;
    int tenths_shown; /* counted, not a TTY: the lines printed so far */
} kvs_progress;
void kvs_progress_start(kvs_progress *p, const char *label, double total);
void kvs_progress_start_counted(kvs_progress *p, const char *label, double total, const char *unit);
void kvs_progress_update(kvs_progress *p, double done);
void kvs_progress_finish(kvs_progress *p);

/* ---- random numbers (xoshiro256**, seeded with splitmix64) ------------------- */
typedef struct { uint64_t s[4]; } kvs_rng;
void kvs_rng_seed(kvs_rng *r, uint64_t seed);
uint64_t kvs_rng_u64(kvs_rng *r);
double kvs_rng_uniform(kvs_rng *r); /* [0, 1) */
float kvs_rng_normal(kvs_rng *r);   /* N(0, 1) */

/* ---- memory ----------------------------------------------------------------- */
void *kvs_malloc(size_t n);                /* NULL on failure or n == 0 overflow */
void *kvs_calloc(size_t n, size_t size);
void *kvs_aligned_alloc(size_t n);         /* 64-byte aligned; free with free() */

#endif
