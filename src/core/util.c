/* time, logging, progress bar, RNG and allocation helpers */
#include "core/core.h"

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

double kvs_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static _Atomic bool host_clock;
static _Atomic int64_t host_ns[KVS_HOST_PHASES];

void kvs_host_clock_on(bool on) {
    if (on)
        for (int p = 0; p < KVS_HOST_PHASES; p++) atomic_store(&host_ns[p], 0);
    atomic_store(&host_clock, on);
}

double kvs_host_clock_start(void) { return atomic_load_explicit(&host_clock, memory_order_relaxed) ? kvs_now() : 0; }

void kvs_host_clock_stop(kvs_host_phase phase, double start) {
    if (start <= 0 || phase < 0 || phase >= KVS_HOST_PHASES) return;
    atomic_fetch_add(&host_ns[phase], (int64_t)(1e9 * (kvs_now() - start)));
}

void kvs_host_clock_totals(double ms[KVS_HOST_PHASES]) {
    for (int p = 0; p < KVS_HOST_PHASES; p++) ms[p] = 1e-6 * (double)atomic_load(&host_ns[p]);
}

const char *kvs_host_phase_name(kvs_host_phase phase) {
    static const char *const names[KVS_HOST_PHASES] = {
        "scheduling", "step metadata (tables, slots, upload)", "KV policy (commit, sparsify planning)",
        "waiting for the device at a step's end"};
    return phase >= 0 && phase < KVS_HOST_PHASES ? names[phase] : "?";
}

static kvs_log_level min_level = KVS_LOG_INFO; /* process-wide setting, set once by the CLI */

void kvs_log_set_level(kvs_log_level level) { min_level = level; }

void kvs_log(kvs_log_level level, const char *fmt, ...) {
    if (level < min_level) return;
    static const char *tags[] = {"debug", "info", "warn", "error"};
    char line[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "[kvsparse %s] %s\n", tags[level], line);
}

static void progress_draw(kvs_progress *p, bool final) {
    double frac = p->total > 0 ? p->done / p->total : 1.0;
    if (frac > 1) frac = 1;
    int width = 30, fill = (int)(frac * width);
    char bar[64];
    for (int i = 0; i < width; i++) bar[i] = i < fill ? '#' : '.';
    bar[width] = 0;
    double el = kvs_now() - p->start;
    const char *cr = p->tty ? "\r" : "", *nl = final || !p->tty ? "\n" : "";
    if (p->unit)
        fprintf(stderr, "%s%s [%s] %.0f/%.0f %s %.1f s%s", cr, p->label, bar, p->done, p->total, p->unit, el, nl);
    else
        fprintf(stderr, "%s%s [%s] %5.1f%% %.1fs%s", cr, p->label, bar, 100 * frac, el, nl);
    fflush(stderr);
}

void kvs_progress_start(kvs_progress *p, const char *label, double total) {
    p->label = label;
    p->unit = NULL;
    p->total = total;
    p->done = 0;
    p->start = p->last_draw = kvs_now();
    p->tty = isatty(2);
    p->tenths_shown = 0;
}

void kvs_progress_start_counted(kvs_progress *p, const char *label, double total, const char *unit) {
    kvs_progress_start(p, label, total);
    p->unit = unit;
}

void kvs_progress_update(kvs_progress *p, double done) {
    p->done = done;
    double t = kvs_now();
    if (p->tty && t - p->last_draw > 0.1) {
        p->last_draw = t;
        progress_draw(p, false);
    } else if (!p->tty && p->unit && p->total > 0) { /* a log: a line at each tenth passed */
        int tenths = (int)(10 * done / p->total);
        if (tenths > p->tenths_shown) {
            p->tenths_shown = tenths;
            progress_draw(p, false);
        }
    }
}

void kvs_progress_finish(kvs_progress *p) {
    if (!p->unit) p->done = p->total; /* a counted bar shows what was done (all of it, or where it stopped) */
    if (p->tty) progress_draw(p, true);
    else if (p->unit && p->tenths_shown < 10) progress_draw(p, true); /* unless the last tenth's line said it */
}

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void kvs_rng_seed(kvs_rng *r, uint64_t seed) {
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&seed);
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t kvs_rng_u64(kvs_rng *r) {
    uint64_t *s = r->s, result = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

double kvs_rng_uniform(kvs_rng *r) { return (double)(kvs_rng_u64(r) >> 11) * 0x1.0p-53; }

float kvs_rng_normal(kvs_rng *r) {
    double u1 = kvs_rng_uniform(r), u2 = kvs_rng_uniform(r);
    if (u1 < 1e-300) u1 = 1e-300;
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

void *kvs_malloc(size_t n) { return n ? malloc(n) : NULL; }

void *kvs_calloc(size_t n, size_t size) { return (n && size) ? calloc(n, size) : NULL; }

void *kvs_aligned_alloc(size_t n) {
    void *p = NULL;
    if (posix_memalign(&p, 64, n ? n : 64) != 0) return NULL;
    return p;
}
