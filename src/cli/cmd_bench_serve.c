/* kvsparse bench serve: a load generator for an OpenAI-compatible server.
 * Each request is a streaming completion whose prompt is input-len random
 * token ids, with ignore_eos so exactly output-len tokens come back. For each
 * concurrency level, num-prompts requests run with that many in flight;
 * reported: requests/s, output tokens/s, TTFT, TPOT and ITL (mean, P50, P99). */
#include <arpa/inet.h>
#include <jansson.h>
#include <math.h>
#include <netdb.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "cli/cli.h"
#include "core/core.h"
#include "cli/plot_png.h"

typedef struct {
    char host[300], port[16], base[256]; /* base: path prefix, e.g. "/v1" */
    const char *model, *api_key, *json_out, *plot;
    int input_len, output_len, num_prompts, id_lo, id_hi;
    int conc[32], n_conc;
    uint64_t seed;
} bench_opts;

typedef struct {
    bool ok;
    double ttft, latency;
    int out_tokens;
    double *itl; /* gaps between content chunks */
    int n_itl;
} req_result;

typedef struct {
    const bench_opts *o;
    int conc;
    atomic_int next, done;
    req_result *res;
} level_state;

static void usage(FILE *f) {
    fprintf(f, "usage: kvsparse bench serve --url URL [options]\n"
               "  --url URL            the server, e.g. http://127.0.0.1:8000 (/v1 is added when missing)\n"
               "  --input-len N        prompt tokens (random ids; default 4000)\n"
               "  --output-len N       generated tokens per request (ignore_eos; default 500)\n"
               "  --concurrency LIST   requests in flight, e.g. 1,10,20 (default 1)\n"
               "  --num-prompts N      requests per concurrency level (default: 4 x concurrency, at least 8)\n"
               "  --model NAME         the model to request (default: the first of GET /v1/models)\n"
               "  --api-key KEY        sent as 'Authorization: Bearer KEY'\n"
               "  --id-range LO,HI     random prompt ids in [LO, HI) (default 10,8000)\n"
               "  --seed S             random prompt ids seed (default 0)\n"
               "  --json-out FILE      write the results as JSON to FILE\n"
               "  --plot FILE.png      plot output tokens/s and median TTFT against concurrency\n");
}

static bool parse_url(const char *url, bench_opts *o) {
    if (strncmp(url, "http://", 7)) return false;
    const char *h = url + 7, *slash = strchr(h, '/');
    size_t hl = slash ? (size_t)(slash - h) : strlen(h);
    char hostport[300];
    if (hl == 0 || hl >= sizeof hostport) return false;
    memcpy(hostport, h, hl);
    hostport[hl] = 0;
    char *colon = strrchr(hostport, ':');
    snprintf(o->port, sizeof o->port, "%s", colon ? colon + 1 : "80");
    if (colon) *colon = 0;
    snprintf(o->host, sizeof o->host, "%s", hostport);
    snprintf(o->base, sizeof o->base, "%s", slash ? slash : "");
    size_t bl = strlen(o->base);
    while (bl && o->base[bl - 1] == '/') o->base[--bl] = 0;
    if (bl < 3 || strcmp(o->base + bl - 3, "/v1")) strncat(o->base, "/v1", sizeof o->base - bl - 1);
    return true;
}

/* ---- HTTP/1.0 over a socket: the server closes after the response ---------- */
static int dial(const bench_opts *o) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai;
    if (getaddrinfo(o->host, o->port, &hints, &ai) != 0) return -1;
    int fd = socket(ai->ai_family, SOCK_STREAM, 0);
    if (fd >= 0 && connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
        close(fd);
        fd = -1;
    }
    freeaddrinfo(ai);
    return fd;
}

static bool send_req(int fd, const bench_opts *o, const char *method, const char *path, const char *body) {
    char head[1024];
    char auth[300] = "";
    if (o->api_key) snprintf(auth, sizeof auth, "Authorization: Bearer %s\r\n", o->api_key);
    size_t bl = body ? strlen(body) : 0;
    int n = snprintf(head, sizeof head,
                     "%s %s%s HTTP/1.0\r\nHost: %s\r\n%sContent-Type: application/json\r\nContent-Length: %zu\r\n\r\n",
                     method, o->base, path, o->host, auth, bl);
    const char *parts[2] = {head, body};
    size_t lens[2] = {(size_t)n, bl};
    for (int k = 0; k < 2; k++)
        for (size_t off = 0; off < lens[k];) {
            ssize_t w = send(fd, parts[k] + off, lens[k] - off, MSG_NOSIGNAL);
            if (w <= 0) return false;
            off += (size_t)w;
        }
    return true;
}

/* GET /v1/models -> the first model's id (malloc'ed) or NULL. */
static char *first_model(const bench_opts *o) {
    int fd = dial(o);
    if (fd < 0 || !send_req(fd, o, "GET", "/models", NULL)) {
        if (fd >= 0) close(fd);
        return NULL;
    }
    char buf[65536];
    size_t n = 0;
    ssize_t got;
    while (n < sizeof buf - 1 && (got = recv(fd, buf + n, sizeof buf - 1 - n, 0)) > 0) n += (size_t)got;
    close(fd);
    buf[n] = 0;
    char *b = strstr(buf, "\r\n\r\n");
    json_t *j = b ? json_loads(b + 4, 0, NULL) : NULL;
    const char *id = json_string_value(json_object_get(json_array_get(json_object_get(j, "data"), 0), "id"));
    char *r = id ? strdup(id) : NULL;
    json_decref(j);
    return r;
}

/* One streaming request; fills r. */
static void run_one(const bench_opts *o, const char *body, req_result *r) {
    memset(r, 0, sizeof *r);
    r->itl = malloc(sizeof(double) * (o->output_len + 8));
    int fd = dial(o);
    double t0 = kvs_now(), last = 0;
    if (fd < 0 || !send_req(fd, o, "POST", "/completions", body)) {
        if (fd >= 0) close(fd);
        return;
    }
    size_t cap = 1 << 16, len = 0, scan = 0;
    char *buf = malloc(cap);
    bool header_ok = false, seen_header = false, done = false;
    ssize_t got;
    while (!done && (got = recv(fd, buf + len, cap - len - 1, 0)) > 0) {
        double now = kvs_now();
        len += (size_t)got;
        buf[len] = 0;
        if (!seen_header) {
            char *h = strstr(buf, "\r\n\r\n");
            if (!h) goto grow;
            seen_header = true;
            header_ok = strstr(buf, " 200 ") != NULL && (size_t)(strchr(buf, '\n') - buf) > 0;
            scan = (size_t)(h + 4 - buf);
        }
        for (char *ev; (ev = strstr(buf + scan, "\n\n"));) {
            char *line = buf + scan;
            scan = (size_t)(ev + 2 - buf);
            if (strncmp(line, "data: ", 6)) continue;
            if (!strncmp(line + 6, "[DONE]", 6)) { done = true; break; }
            json_t *j = json_loadb(line + 6, (size_t)(ev - line - 6), 0, NULL);
            json_t *ch = json_array_get(json_object_get(j, "choices"), 0);
            /* a token chunk: text (possibly empty: a model without a tokenizer, or
               bytes the detokenizer holds back) before the finish_reason */
            const char *t = json_string_value(json_object_get(ch, "text"));
            if (t && (*t || json_is_null(json_object_get(ch, "finish_reason")))) {
                if (!r->ttft) r->ttft = now - t0;
                else if (r->n_itl < o->output_len + 8) r->itl[r->n_itl++] = now - last;
                last = now;
            }
            json_t *u = json_object_get(j, "usage");
            if (json_is_object(u)) r->out_tokens = (int)json_integer_value(json_object_get(u, "completion_tokens"));
            json_decref(j);
        }
    grow:
        if (cap - len < 8192) {
            char *p = realloc(buf, cap * 2);
            if (!p) break;
            buf = p;
            cap *= 2;
        }
    }
    close(fd);
    free(buf);
    r->latency = kvs_now() - t0;
    r->ok = header_ok && done && r->out_tokens > 0;
}

static char *make_body(const bench_opts *o, uint64_t seed) {
    kvs_rng rng;
    kvs_rng_seed(&rng, seed);
    size_t cap = (size_t)o->input_len * 8 + 512, n = 0;
    char *b = malloc(cap);
    n += (size_t)snprintf(b, cap, "{\"model\":\"%s\",\"prompt\":[", o->model);
    for (int i = 0; i < o->input_len; i++)
        n += (size_t)snprintf(b + n, cap - n, "%s%d", i ? "," : "",
                              o->id_lo + (int)(kvs_rng_u64(&rng) % (uint64_t)(o->id_hi - o->id_lo)));
    snprintf(b + n, cap - n,
             "],\"max_tokens\":%d,\"ignore_eos\":true,\"temperature\":0,\"stream\":true,"
             "\"stream_options\":{\"include_usage\":true}}",
             o->output_len);
    return b;
}

static void *worker(void *arg) {
    level_state *L = arg;
    for (;;) {
        int i = atomic_fetch_add(&L->next, 1);
        if (i >= L->o->num_prompts) break;
        char *body = make_body(L->o, L->o->seed * 1000003u + (uint64_t)i);
        run_one(L->o, body, &L->res[i]);
        free(body);
        atomic_fetch_add(&L->done, 1);
    }
    return NULL;
}

/* ---- statistics and reporting ----------------------------------------------- */
typedef struct {
    double mean, p50, p99;
} dist;

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static dist summarize(double *v, int n) {
    dist d = {0, 0, 0};
    if (n == 0) return d;
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    for (int i = 0; i < n; i++) d.mean += v[i];
    d.mean /= n;
    d.p50 = v[(int)floor(0.50 * (n - 1) + 0.5)];
    d.p99 = v[(int)floor(0.99 * (n - 1) + 0.5)];
    return d;
}

static json_t *dist_json(dist d) {
    return json_pack("{s:f, s:f, s:f}", "mean_ms", d.mean * 1e3, "p50_ms", d.p50 * 1e3, "p99_ms", d.p99 * 1e3);
}

typedef struct {
    int conc, ok, failed;
    double duration, req_s, tok_s;
    dist ttft, tpot, itl;
} level_result;

static level_result run_level(const bench_opts *o, int conc) {
    level_state L = {.o = o, .conc = conc};
    atomic_init(&L.next, 0);
    atomic_init(&L.done, 0);
    L.res = calloc((size_t)o->num_prompts, sizeof *L.res);
    pthread_t *th = calloc((size_t)conc, sizeof *th);
    char label[64];
    snprintf(label, sizeof label, "concurrency %d", conc);
    kvs_progress pr;
    kvs_progress_start(&pr, label, o->num_prompts);
    double t0 = kvs_now();
    int started = 0;
    for (int i = 0; i < conc; i++)
        if (pthread_create(&th[i], NULL, worker, &L) == 0) started++;
    while (atomic_load(&L.done) < o->num_prompts && started > 0) {
        usleep(200000);
        kvs_progress_update(&pr, atomic_load(&L.done));
    }
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
    kvs_progress_finish(&pr);
    level_result R = {.conc = conc, .duration = kvs_now() - t0};
    double *ttft = malloc(sizeof(double) * (o->num_prompts + 1)), *tpot = malloc(sizeof(double) * (o->num_prompts + 1));
    size_t n_itl = 0;
    for (int i = 0; i < o->num_prompts; i++) n_itl += (size_t)L.res[i].n_itl;
    double *itl = malloc(sizeof(double) * (n_itl + 1));
    int n_tpot = 0;
    long long tokens = 0;
    n_itl = 0;
    for (int i = 0; i < o->num_prompts; i++) {
        req_result *r = &L.res[i];
        if (!r->ok) { R.failed++; free(r->itl); continue; }
        ttft[R.ok++] = r->ttft;
        tokens += r->out_tokens;
        if (r->out_tokens > 1) tpot[n_tpot++] = (r->latency - r->ttft) / (r->out_tokens - 1);
        memcpy(itl + n_itl, r->itl, sizeof(double) * r->n_itl);
        n_itl += (size_t)r->n_itl;
        free(r->itl);
    }
    R.req_s = R.ok / R.duration;
    R.tok_s = (double)tokens / R.duration;
    R.ttft = summarize(ttft, R.ok);
    R.tpot = summarize(tpot, n_tpot);
    R.itl = summarize(itl, (int)n_itl);
    free(ttft);
    free(tpot);
    free(itl);
    free(L.res);
    free(th);
    return R;
}

static int bench_run_levels(bench_opts *o, char *found_model) {
    level_result R[32];
    printf("bench serve: %s:%s%s model %s, input %d tokens, output %d tokens\n", o->host, o->port, o->base, o->model,
           o->input_len, o->output_len);
    printf("%6s %7s %9s %10s %10s %10s %9s %9s %9s %9s %9s %9s %6s\n", "conc", "req/s", "out tok/s", "TTFT mean",
           "TTFT p50", "TTFT p99", "TPOT mean", "TPOT p50", "TPOT p99", "ITL mean", "ITL p50", "ITL p99", "failed");
    json_t *levels = json_array();
    int failed = 0;
    for (int k = 0; k < o->n_conc; k++) {
        bench_opts lo = *o;
        if (!lo.num_prompts) lo.num_prompts = o->conc[k] * 4 > 8 ? o->conc[k] * 4 : 8;
        R[k] = run_level(&lo, o->conc[k]);
        level_result *r = &R[k];
        failed += r->failed;
        printf("%6d %7.2f %9.1f %8.1fms %8.1fms %8.1fms %7.2fms %7.2fms %7.2fms %7.2fms %7.2fms %7.2fms %6d\n",
               r->conc, r->req_s, r->tok_s, r->ttft.mean * 1e3, r->ttft.p50 * 1e3, r->ttft.p99 * 1e3,
               r->tpot.mean * 1e3, r->tpot.p50 * 1e3, r->tpot.p99 * 1e3, r->itl.mean * 1e3, r->itl.p50 * 1e3,
               r->itl.p99 * 1e3, r->failed);
        fflush(stdout);
        json_array_append_new(levels, json_pack("{s:i, s:i, s:i, s:i, s:f, s:f, s:f, s:o, s:o, s:o}", "concurrency",
                                                r->conc, "num_prompts", lo.num_prompts, "completed", r->ok, "failed",
                                                r->failed, "duration_s", r->duration, "requests_per_s", r->req_s,
                                                "output_tokens_per_s", r->tok_s, "ttft", dist_json(r->ttft), "tpot",
                                                dist_json(r->tpot), "itl", dist_json(r->itl)));
    }
    int rc = 0;
    if (o->json_out) {
        json_t *root = json_pack("{s:s, s:s, s:i, s:i, s:I, s:o}", "url", o->host, "model", o->model, "input_len",
                                 o->input_len, "output_len", o->output_len, "seed", (json_int_t)o->seed, "levels",
                                 json_incref(levels));
        if (json_dump_file(root, o->json_out, JSON_INDENT(2)) != 0) {
            fprintf(stderr, "kvsparse bench serve: could not write %s\n", o->json_out);
            rc = 1;
        }
        json_decref(root);
    }
    json_decref(levels);
    if (o->plot) {
        double x[32], thr[32], ttft[32];
        for (int k = 0; k < o->n_conc; k++) x[k] = R[k].conc, thr[k] = R[k].tok_s, ttft[k] = R[k].ttft.p50 * 1e3;
        kvs_plot_series s[2] = {{"OUTPUT TOK/S", thr}, {"TTFT P50 MS", ttft}};
        if (kvs_plot_png(o->plot, "CONCURRENCY", x, o->n_conc, s, 2) != KVS_OK) {
            fprintf(stderr, "kvsparse bench serve: %s\n", kvs_last_error());
            rc = 1;
        }
    }
    free(found_model);
    if (failed) fprintf(stderr, "kvsparse bench serve: %d requests failed\n", failed);
    return rc ? rc : failed ? 1 : 0;
}

int kvs_cmd_bench_serve(int argc, char **argv) {
    bench_opts o = {.input_len = 4000, .output_len = 500, .num_prompts = 0, .id_lo = 10, .id_hi = 8000, .seed = 0};
    const char *url = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool v = i + 1 < argc;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { usage(stdout); return 0; }
        else if (!strcmp(a, "--url") && v) url = argv[++i];
        else if (!strcmp(a, "--input-len") && v) o.input_len = atoi(argv[++i]);
        else if (!strcmp(a, "--output-len") && v) o.output_len = atoi(argv[++i]);
        else if (!strcmp(a, "--num-prompts") && v) o.num_prompts = atoi(argv[++i]);
        else if (!strcmp(a, "--model") && v) o.model = argv[++i];
        else if (!strcmp(a, "--api-key") && v) o.api_key = argv[++i];
        else if (!strcmp(a, "--json-out") && v) o.json_out = argv[++i];
        else if (!strcmp(a, "--plot") && v) o.plot = argv[++i];
        else if (!strcmp(a, "--seed") && v) o.seed = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(a, "--id-range") && v) {
            if (sscanf(argv[++i], "%d,%d", &o.id_lo, &o.id_hi) != 2 || o.id_lo < 0 || o.id_hi <= o.id_lo) goto bad;
        } else if (!strcmp(a, "--concurrency") && v) {
            char *s = argv[++i], *end;
            o.n_conc = 0;
            while (*s && o.n_conc < 32) {
                long c = strtol(s, &end, 10);
                if (end == s || c < 1 || c > 4096) goto bad;
                o.conc[o.n_conc++] = (int)c;
                s = *end == ',' ? end + 1 : end;
                if (*end && *end != ',') goto bad;
            }
        } else goto bad;
        continue;
    bad:
        fprintf(stderr, "kvsparse bench serve: bad or incomplete option '%s'\n", a);
        usage(stderr);
        return 2;
    }
    if (!url || !parse_url(url, &o) || o.input_len < 1 || o.output_len < 1 || o.num_prompts < 0) {
        fprintf(stderr, "kvsparse bench serve: --url http://HOST:PORT is required; lengths must be >= 1\n");
        return 2;
    }
    if (!o.n_conc) o.conc[o.n_conc++] = 1;
    char *found = NULL;
    if (!o.model && !(o.model = found = first_model(&o))) {
        fprintf(stderr, "kvsparse bench serve: GET %s/models at %s:%s failed (is the server up?)\n", o.base, o.host,
                o.port);
        return 1;
    }
    return bench_run_levels(&o, found);
}
