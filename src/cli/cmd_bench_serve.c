/* kvsparse bench serve: a load generator for an OpenAI-compatible server.
 * Each request is a streaming completion whose prompt is input-len random
 * token ids, with ignore_eos so exactly output-len tokens come back. For each
 * concurrency level, num-prompts requests run with that many in flight;
 * reported: requests/s, output tokens/s, TTFT, TPOT and ITL (mean, P50, P99).
 * Shared prefixes and conversations (prefix caching): --shared-prefix-len N
 * puts the same N random ids before every prompt; --turns K makes each of the
 * num-prompts a conversation of K requests, one after the other, turn k+1's
 * prompt = turn k's prompt + its answer (the ids the server returns with
 * vLLM's return_token_ids) + a new input-len question. Then also reported:
 * the TTFT of first and of later turns, and the server's prefix-cache hit
 * rate (its /metrics hits / queries over the level).
 * Open loop (vLLM's --request-rate): each rate of the list is a level whose
 * requests arrive as a Poisson process of that rate (seeded), however many
 * are in flight (--concurrency then caps them, as vLLM's --max-concurrency).
 * Every level also reports its steady state: the requests after a warm-up
 * (by default the first wave of a closed loop, the first tenth of an open
 * one), which a burst of simultaneous long prompts makes wait for each
 * other's prefills whatever the engine does. */
#include <arpa/inet.h>
#include <jansson.h>
#include <math.h>
#include <netdb.h>
#include <pthread.h>
#include <semaphore.h>
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
    int shared_prefix_len, turns; /* 0, 1: neither */
    int conc[32], n_conc;
    double rate[32]; /* --request-rate: requests/s, INFINITY: all at once; n_rate 0: closed loop */
    int n_rate;
    int warmup; /* -1: the default (above) */
    uint64_t seed;
} bench_opts;

typedef struct {
    bool ok;
    int turn;                /* 0: a conversation's first request */
    double ttft, latency;
    int out_tokens;
    double *itl; /* gaps between content chunks */
    int n_itl;
} req_result;

/* A growing list of token ids: a conversation's prompt. */
typedef struct {
    int32_t *ids;
    int n, cap;
} id_list;

typedef struct {
    const bench_opts *o;
    int conc;
    atomic_int next, done;
    req_result *res;
    sem_t slots; /* open loop with --concurrency: the requests in flight */
    bool capped;
} level_state;

static void usage(FILE *f) {
    fprintf(f, "usage: kvsparse bench serve --url URL [options]\n"
               "  --url URL            the server, e.g. http://127.0.0.1:8000 (/v1 is added when missing)\n"
               "  --input-len N        prompt tokens (random ids; default 4000)\n"
               "  --output-len N       generated tokens per request (ignore_eos; default 500)\n"
               "  --concurrency LIST   requests in flight, e.g. 1,10,20 (default 1); with --request-rate, one\n"
               "                       value: the most in flight (default: no limit)\n"
               "  --request-rate LIST  open loop: requests/s of Poisson arrivals, e.g. 2,4,8 or inf (all at\n"
               "                       once), one level each (default: closed loop at --concurrency)\n"
               "  --warmup N           requests left out of the steady-state figures (default: the first\n"
               "                       wave, i.e. the concurrency, or a tenth of an open loop's)\n"
               "  --num-prompts N      requests (conversations with --turns) per level (default: 4 x\n"
               "                       concurrency, at least 8; 8 x rate, at least 16, with --request-rate)\n"
               "  --model NAME         the model to request (default: the first of GET /v1/models)\n"
               "  --api-key KEY        sent as 'Authorization: Bearer KEY'\n"
               "  --id-range LO,HI     random prompt ids in [LO, HI) (default 10,8000)\n"
               "  --shared-prefix-len N  every prompt starts with the same N random ids, then its own\n"
               "                       --input-len ones (default 0)\n"
               "  --turns K            each of --num-prompts is a conversation of K requests in turn: the next\n"
               "                       prompt is the last one + its answer + --input-len new ids (default 1)\n"
               "  --seed S             random prompt ids seed (default 0)\n"
               "  --json-out FILE      write the results as JSON to FILE\n"
               "  --plot FILE.png      plot output tokens/s and median TTFT against concurrency (or rate)\n");
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

/* path: under base (/v1), or from the root when it is "/metrics" */
static bool send_req(int fd, const bench_opts *o, const char *method, const char *path, const char *body) {
    char head[1024];
    char auth[300] = "";
    if (o->api_key) snprintf(auth, sizeof auth, "Authorization: Bearer %s\r\n", o->api_key);
    size_t bl = body ? strlen(body) : 0;
    int n = snprintf(head, sizeof head,
                     "%s %s%s HTTP/1.0\r\nHost: %s\r\n%sContent-Type: application/json\r\nContent-Length: %zu\r\n\r\n",
                     method, strcmp(path, "/metrics") ? o->base : "", path, o->host, auth, bl);
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

/* GET path -> the response (head and body, malloc'ed, 64 KiB at most) or NULL. */
static char *http_get(const bench_opts *o, const char *path) {
    int fd = dial(o);
    if (fd < 0 || !send_req(fd, o, "GET", path, NULL)) {
        if (fd >= 0) close(fd);
        return NULL;
    }
    size_t cap = 65536, n = 0;
    char *buf = malloc(cap);
    ssize_t got;
    while (buf && n < cap - 1 && (got = recv(fd, buf + n, cap - 1 - n, 0)) > 0) n += (size_t)got;
    close(fd);
    if (buf) buf[n] = 0;
    return buf;
}

/* GET /v1/models -> the first model's id (malloc'ed) or NULL. */
static char *first_model(const bench_opts *o) {
    char *buf = http_get(o, "/models");
    char *b = buf ? strstr(buf, "\r\n\r\n") : NULL;
    json_t *j = b ? json_loads(b + 4, 0, NULL) : NULL;
    const char *id = json_string_value(json_object_get(json_array_get(json_object_get(j, "data"), 0), "id"));
    char *r = id ? strdup(id) : NULL;
    json_decref(j);
    free(buf);
    return r;
}

/* kvsparse_prefix_cache_{queries,hits}_total from GET /metrics; false when
 * the server has none (it is not kvsparse, or /metrics is not there). */
static bool prefix_cache_counts(const bench_opts *o, double *queries, double *hits) {
    char *buf = http_get(o, "/metrics");
    const char *names[2] = {"\nkvsparse_prefix_cache_queries_total{", "\nkvsparse_prefix_cache_hits_total{"};
    double *out[2] = {queries, hits};
    bool ok = buf && strstr(buf, " 200 ");
    for (int k = 0; ok && k < 2; k++) {
        const char *at = strstr(buf, names[k]), *end = at ? strchr(at + 1, '}') : NULL;
        ok = end && sscanf(end + 1, "%lf", out[k]) == 1;
    }
    free(buf);
    return ok;
}

/* One streaming request; fills r, and answer with the generated ids when the
 * server sends them (return_token_ids). */
static void run_one(const bench_opts *o, const char *body, req_result *r, id_list *answer) {
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
            size_t k;
            json_t *id;
            json_array_foreach(json_object_get(ch, "token_ids"), k, id) {
                if (answer->n < answer->cap) answer->ids[answer->n++] = (int32_t)json_integer_value(id);
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

/* Room for n more ids; false when out of memory. */
static bool reserve(id_list *l, int n) {
    if (l->n + n <= l->cap) return true;
    int cap = (l->n + n) * 2;
    int32_t *p = realloc(l->ids, sizeof(int32_t) * (size_t)cap);
    if (!p) return false;
    l->ids = p;
    l->cap = cap;
    return true;
}

/* Appends n random ids in [id_lo, id_hi). */
static bool add_random(const bench_opts *o, id_list *l, int n, kvs_rng *rng) {
    if (!reserve(l, n)) return false;
    for (int i = 0; i < n; i++) l->ids[l->n++] = o->id_lo + (int)(kvs_rng_u64(rng) % (uint64_t)(o->id_hi - o->id_lo));
    return true;
}

static char *make_body(const bench_opts *o, const id_list *prompt) {
    size_t cap = (size_t)prompt->n * 12 + 512, n = 0;
    char *b = malloc(cap);
    if (!b) return NULL;
    n += (size_t)snprintf(b, cap, "{\"model\":\"%s\",\"prompt\":[", o->model);
    for (int i = 0; i < prompt->n; i++) n += (size_t)snprintf(b + n, cap - n, "%s%d", i ? "," : "", prompt->ids[i]);
    snprintf(b + n, cap - n,
             "],\"max_tokens\":%d,\"ignore_eos\":true,\"temperature\":0,\"stream\":true,"
             "\"stream_options\":{\"include_usage\":true}%s}",
             o->output_len, o->turns > 1 ? ",\"return_token_ids\":true" : "");
    return b;
}

/* Conversation i: --shared-prefix-len shared ids, then per turn input-len ids
 * of its own (seeded by i), the answer appended before the next turn's. */
static void run_conversation(const bench_opts *o, int i, req_result *res) {
    id_list prompt = {0}, answer = {malloc(sizeof(int32_t) * (size_t)(o->output_len + 8)), 0, o->output_len + 8};
    kvs_rng rng;
    kvs_rng_seed(&rng, o->seed ^ 0x5a17ed9f1e11ull); /* the shared prefix: one seed for all */
    bool ok = answer.ids && add_random(o, &prompt, o->shared_prefix_len, &rng);
    kvs_rng_seed(&rng, o->seed * 1000003u + (uint64_t)i);
    for (int t = 0; t < o->turns; t++) { /* after a failed turn, the rest fail too */
        char *body = ok && add_random(o, &prompt, o->input_len, &rng) ? make_body(o, &prompt) : NULL;
        answer.n = 0;
        if (body) run_one(o, body, &res[t], &answer);
        else memset(&res[t], 0, sizeof res[t]);
        free(body);
        res[t].turn = t;
        ok = res[t].ok;
        if (!ok || t + 1 == o->turns) continue;
        if (answer.n != res[t].out_tokens) {
            kvs_log(KVS_LOG_WARN, "bench serve: %d of %d answer ids came back (return_token_ids): the conversation "
                    "cannot go on", answer.n, res[t].out_tokens);
            ok = false;
        } else if ((ok = reserve(&prompt, answer.n))) { /* the answer, before the next question */
            memcpy(prompt.ids + prompt.n, answer.ids, sizeof(int32_t) * (size_t)answer.n);
            prompt.n += answer.n;
        }
    }
    free(prompt.ids);
    free(answer.ids);
}

static void *worker(void *arg) {
    level_state *L = arg;
    for (;;) {
        int i = atomic_fetch_add(&L->next, 1);
        if (i >= L->o->num_prompts) break;
        run_conversation(L->o, i, &L->res[(size_t)i * L->o->turns]);
        atomic_fetch_add(&L->done, 1);
    }
    return NULL;
}

/* Open loop: one thread per request, started at its arrival. */
typedef struct {
    level_state *L;
    int i;
} arrival;

static void *arrived(void *arg) {
    arrival *a = arg;
    level_state *L = a->L;
    run_conversation(L->o, a->i, &L->res[(size_t)a->i * L->o->turns]);
    if (L->capped) sem_post(&L->slots);
    atomic_fetch_add(&L->done, 1);
    return NULL;
}

/* Sleeps until kvs_now() reaches t. */
static void sleep_until(double t) {
    for (double d; (d = t - kvs_now()) > 0;) usleep(d > 0.2 ? 200000 : (useconds_t)(d * 1e6) + 1);
}

/* ---- statistics and reporting ----------------------------------------------- */
typedef struct {
    double mean, p50, p90, p99;
} dist;

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static dist summarize(double *v, int n) {
    dist d = {0, 0, 0, 0};
    if (n == 0) return d;
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    for (int i = 0; i < n; i++) d.mean += v[i];
    d.mean /= n;
    d.p50 = v[(int)floor(0.50 * (n - 1) + 0.5)];
    d.p90 = v[(int)floor(0.90 * (n - 1) + 0.5)];
    d.p99 = v[(int)floor(0.99 * (n - 1) + 0.5)];
    return d;
}

static json_t *dist_json(dist d) {
    return json_pack("{s:f, s:f, s:f, s:f}", "mean_ms", d.mean * 1e3, "p50_ms", d.p50 * 1e3, "p90_ms", d.p90 * 1e3,
                     "p99_ms", d.p99 * 1e3);
}

typedef struct {
    int conc, ok, failed, n_first, n_later, warmup, n_steady;
    double rate; /* 0: closed loop */
    double duration, req_s, tok_s;
    dist ttft, tpot, itl;
    dist ttft_steady, tpot_steady; /* the requests after the warm-up */
    dist ttft_first, ttft_later; /* of conversations' first turns, of the others */
    bool have_cache;             /* the server's prefix-cache counters were read */
    double cache_queries, cache_hits; /* over the level */
} level_result;

/* One level: a closed loop of conc requests in flight (rate 0), or Poisson
 * arrivals at rate (at most conc in flight when conc > 0). */
static level_result run_level(const bench_opts *o, int conc, double rate) {
    level_state L = {.o = o, .conc = conc, .capped = rate > 0 && conc > 0};
    atomic_init(&L.next, 0);
    atomic_init(&L.done, 0);
    int n_req = o->num_prompts * o->turns;
    L.res = calloc((size_t)n_req, sizeof *L.res);
    double q0 = 0, h0 = 0, q1 = 0, h1 = 0;
    bool have_cache = prefix_cache_counts(o, &q0, &h0);
    int n_threads = rate > 0 ? o->num_prompts : conc;
    pthread_t *th = calloc((size_t)n_threads, sizeof *th);
    bool *live = calloc((size_t)n_threads, 1);
    arrival *arr = calloc((size_t)o->num_prompts, sizeof *arr);
    char label[64];
    if (rate > 0) snprintf(label, sizeof label, "rate %g/s", rate);
    else snprintf(label, sizeof label, "concurrency %d", conc);
    kvs_progress pr;
    kvs_progress_start(&pr, label, o->num_prompts);
    if (L.capped) sem_init(&L.slots, 0, (unsigned)conc);
    double t0 = kvs_now();
    int started = 0;
    if (rate > 0) { /* exponential gaps of mean 1 / rate, seeded */
        kvs_rng rng;
        kvs_rng_seed(&rng, o->seed ^ 0xa221ba15ull);
        double at = t0;
        for (int i = 0; i < o->num_prompts; i++) {
            if (isfinite(rate)) at += -log(1.0 - kvs_rng_uniform(&rng)) / rate;
            sleep_until(at);
            if (L.capped) sem_wait(&L.slots);
            arr[i] = (arrival){&L, i};
            if (pthread_create(&th[i], NULL, arrived, &arr[i]) == 0) {
                live[i] = true, started++;
            } else { /* counted as failed: its result stays zero */
                if (L.capped) sem_post(&L.slots);
                atomic_fetch_add(&L.done, 1);
            }
            kvs_progress_update(&pr, atomic_load(&L.done));
        }
    } else {
        for (int i = 0; i < conc; i++)
            if (pthread_create(&th[i], NULL, worker, &L) == 0) live[i] = true, started++;
    }
    while (atomic_load(&L.done) < o->num_prompts && started > 0) {
        usleep(200000);
        kvs_progress_update(&pr, atomic_load(&L.done));
    }
    for (int i = 0; i < n_threads; i++)
        if (live[i]) pthread_join(th[i], NULL);
    kvs_progress_finish(&pr);
    if (L.capped) sem_destroy(&L.slots);
    level_result R = {.conc = conc, .rate = rate, .duration = kvs_now() - t0};
    /* the warm-up: the first requests in start order (conversation index) */
    R.warmup = o->warmup >= 0 ? o->warmup : rate > 0 ? o->num_prompts / 10 : conc;
    if (R.warmup >= o->num_prompts) R.warmup = o->num_prompts - 1;
    R.have_cache = have_cache && prefix_cache_counts(o, &q1, &h1);
    R.cache_queries = q1 - q0, R.cache_hits = h1 - h0;
    double *ttft = malloc(sizeof(double) * (n_req + 1)), *tpot = malloc(sizeof(double) * (n_req + 1));
    double *first = malloc(sizeof(double) * (n_req + 1)), *later = malloc(sizeof(double) * (n_req + 1));
    double *ttft_s = malloc(sizeof(double) * (n_req + 1)), *tpot_s = malloc(sizeof(double) * (n_req + 1));
    int n_tpot_s = 0;
    size_t n_itl = 0;
    for (int i = 0; i < n_req; i++) n_itl += (size_t)L.res[i].n_itl;
    double *itl = malloc(sizeof(double) * (n_itl + 1));
    int n_tpot = 0;
    long long tokens = 0;
    n_itl = 0;
    for (int i = 0; i < n_req; i++) {
        req_result *r = &L.res[i];
        if (!r->ok) { R.failed++; free(r->itl); continue; }
        ttft[R.ok++] = r->ttft;
        if (r->turn == 0) first[R.n_first++] = r->ttft;
        else later[R.n_later++] = r->ttft;
        tokens += r->out_tokens;
        double per_token = r->out_tokens > 1 ? (r->latency - r->ttft) / (r->out_tokens - 1) : -1;
        bool steady = i / o->turns >= R.warmup;
        if (per_token >= 0) tpot[n_tpot++] = per_token;
        if (steady) ttft_s[R.n_steady++] = r->ttft;
        if (steady && per_token >= 0) tpot_s[n_tpot_s++] = per_token;
        memcpy(itl + n_itl, r->itl, sizeof(double) * r->n_itl);
        n_itl += (size_t)r->n_itl;
        free(r->itl);
    }
    R.req_s = R.ok / R.duration;
    R.tok_s = (double)tokens / R.duration;
    R.ttft = summarize(ttft, R.ok);
    R.tpot = summarize(tpot, n_tpot);
    R.itl = summarize(itl, (int)n_itl);
    R.ttft_first = summarize(first, R.n_first);
    R.ttft_later = summarize(later, R.n_later);
    R.ttft_steady = summarize(ttft_s, R.n_steady);
    R.tpot_steady = summarize(tpot_s, n_tpot_s);
    free(ttft_s);
    free(tpot_s);
    free(live);
    free(arr);
    free(first);
    free(later);
    free(ttft);
    free(tpot);
    free(itl);
    free(L.res);
    free(th);
    return R;
}

static int bench_run_levels(bench_opts *o, char *found_model) {
    level_result R[32];
    printf("bench serve: %s:%s%s model %s, input %d tokens, output %d tokens", o->host, o->port, o->base, o->model,
           o->input_len, o->output_len);
    bool conversations = o->shared_prefix_len > 0 || o->turns > 1;
    if (conversations)
        printf(", a shared prefix of %d tokens, %d turn%s per conversation", o->shared_prefix_len, o->turns,
               o->turns == 1 ? "" : "s");
    printf("\n");
    bool open = o->n_rate > 0;
    if (open && o->n_conc) printf("(open loop: Poisson arrivals, at most %d in flight)\n", o->conc[0]);
    else if (open) printf("(open loop: Poisson arrivals)\n");
    printf("%6s %7s %9s %10s %10s %10s %9s %9s %9s %9s %9s %9s %6s\n", open ? "rate" : "conc", "req/s", "out tok/s", "TTFT mean",
           "TTFT p50", "TTFT p99", "TPOT mean", "TPOT p50", "TPOT p99", "ITL mean", "ITL p50", "ITL p99", "failed");
    json_t *levels = json_array();
    int failed = 0;
    int n_levels = open ? o->n_rate : o->n_conc;
    for (int k = 0; k < n_levels; k++) {
        bench_opts lo = *o;
        int conc = open ? (o->n_conc ? o->conc[0] : 0) : o->conc[k];
        double rate = open ? o->rate[k] : 0;
        if (!lo.num_prompts && open) lo.num_prompts = isfinite(rate) && rate * 8 > 16 ? (int)ceil(rate * 8) : 16;
        else if (!lo.num_prompts) lo.num_prompts = conc * 4 > 8 ? conc * 4 : 8;
        R[k] = run_level(&lo, conc, rate);
        level_result *r = &R[k];
        failed += r->failed;
        char name[16];
        if (open) snprintf(name, sizeof name, isfinite(rate) ? "%g" : "inf", rate);
        else snprintf(name, sizeof name, "%d", conc);
        printf("%6s %7.2f %9.1f %8.1fms %8.1fms %8.1fms %7.2fms %7.2fms %7.2fms %7.2fms %7.2fms %7.2fms %6d\n",
               name, r->req_s, r->tok_s, r->ttft.mean * 1e3, r->ttft.p50 * 1e3, r->ttft.p99 * 1e3,
               r->tpot.mean * 1e3, r->tpot.p50 * 1e3, r->tpot.p99 * 1e3, r->itl.mean * 1e3, r->itl.p50 * 1e3,
               r->itl.p99 * 1e3, r->failed);
        printf("%6s steady state, after the first %d: TTFT p50 %.1fms p99 %.1fms, TPOT p50 %.2fms p99 %.2fms (%d "
               "requests)\n", "", r->warmup, r->ttft_steady.p50 * 1e3, r->ttft_steady.p99 * 1e3, r->tpot_steady.p50 * 1e3,
               r->tpot_steady.p99 * 1e3, r->n_steady);
        if (conversations) {
            printf("%6s first turns TTFT p50 %.1fms p90 %.1fms (%d), later turns TTFT p50 %.1fms p90 %.1fms (%d); "
                   "prefix cache hit rate ", "", r->ttft_first.p50 * 1e3, r->ttft_first.p90 * 1e3, r->n_first,
                   r->ttft_later.p50 * 1e3, r->ttft_later.p90 * 1e3, r->n_later);
            if (r->have_cache) printf("%.1f%% (%.0f of %.0f prompt tokens)\n", r->cache_queries > 0 ? 100 * r->cache_hits / r->cache_queries : 0.0, r->cache_hits, r->cache_queries);
            else printf("unknown (no kvsparse_prefix_cache_* in /metrics)\n");
        }
        fflush(stdout);
        json_t *lj = json_pack("{s:i, s:i, s:i, s:i, s:f, s:f, s:f, s:o, s:o, s:o}", "concurrency",
                                                r->conc, "num_prompts", lo.num_prompts, "completed", r->ok, "failed",
                                                r->failed, "duration_s", r->duration, "requests_per_s", r->req_s,
                                                "output_tokens_per_s", r->tok_s, "ttft", dist_json(r->ttft), "tpot",
                                                dist_json(r->tpot), "itl", dist_json(r->itl));
        json_object_set_new(lj, "request_rate", !open ? json_null() : isfinite(rate) ? json_real(rate) : json_string("inf"));
        json_object_set_new(lj, "max_concurrency", open && !conc ? json_null() : json_integer(conc));
        json_object_set_new(lj, "warmup", json_integer(r->warmup));
        json_object_set_new(lj, "steady_requests", json_integer(r->n_steady));
        json_object_set_new(lj, "ttft_steady", dist_json(r->ttft_steady));
        json_object_set_new(lj, "tpot_steady", dist_json(r->tpot_steady));
        json_object_set_new(lj, "ttft_first_turns", dist_json(r->ttft_first));
        json_object_set_new(lj, "ttft_later_turns", dist_json(r->ttft_later));
        json_object_set_new(lj, "prefix_cache_queries", r->have_cache ? json_real(r->cache_queries) : json_null());
        json_object_set_new(lj, "prefix_cache_hits", r->have_cache ? json_real(r->cache_hits) : json_null());
        json_object_set_new(lj, "prefix_cache_hit_rate",
                            r->have_cache ? json_real(r->cache_queries > 0 ? r->cache_hits / r->cache_queries : 0) : json_null());
        json_array_append_new(levels, lj);
    }
    int rc = 0;
    if (o->json_out) {
        json_t *root = json_pack("{s:s, s:s, s:i, s:i, s:i, s:i, s:I, s:o}", "url", o->host, "model", o->model,
                                 "input_len", o->input_len, "output_len", o->output_len, "shared_prefix_len",
                                 o->shared_prefix_len, "turns", o->turns, "seed", (json_int_t)o->seed, "levels",
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
        for (int k = 0; k < n_levels; k++)
            x[k] = open ? (isfinite(R[k].rate) ? R[k].rate : 0) : R[k].conc, thr[k] = R[k].tok_s, ttft[k] = R[k].ttft.p50 * 1e3;
        kvs_plot_series s[2] = {{"OUTPUT TOK/S", thr}, {"TTFT P50 MS", ttft}};
        if (kvs_plot_png(o->plot, open ? "REQUEST RATE" : "CONCURRENCY", x, n_levels, s, 2) != KVS_OK) {
            fprintf(stderr, "kvsparse bench serve: %s\n", kvs_last_error());
            rc = 1;
        }
    }
    free(found_model);
    if (failed) fprintf(stderr, "kvsparse bench serve: %d requests failed\n", failed);
    return rc ? rc : failed ? 1 : 0;
}

int kvs_cmd_bench_serve(int argc, char **argv) {
    bench_opts o = {.input_len = 4000, .output_len = 500, .num_prompts = 0, .id_lo = 10, .id_hi = 8000, .seed = 0,
                    .turns = 1, .warmup = -1};
    const char *url = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool v = i + 1 < argc;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { usage(stdout); return 0; }
        else if (!strcmp(a, "--url") && v) url = argv[++i];
        else if (!strcmp(a, "--input-len") && v) o.input_len = atoi(argv[++i]);
        else if (!strcmp(a, "--output-len") && v) o.output_len = atoi(argv[++i]);
        else if (!strcmp(a, "--num-prompts") && v) o.num_prompts = atoi(argv[++i]);
        else if (!strcmp(a, "--shared-prefix-len") && v) o.shared_prefix_len = atoi(argv[++i]);
        else if (!strcmp(a, "--turns") && v) o.turns = atoi(argv[++i]);
        else if (!strcmp(a, "--model") && v) o.model = argv[++i];
        else if (!strcmp(a, "--api-key") && v) o.api_key = argv[++i];
        else if (!strcmp(a, "--json-out") && v) o.json_out = argv[++i];
        else if (!strcmp(a, "--plot") && v) o.plot = argv[++i];
        else if (!strcmp(a, "--seed") && v) o.seed = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(a, "--warmup") && v) {
            char *end;
            long w = strtol(argv[++i], &end, 10);
            if (*end || end == argv[i] || w < 0 || w > 1000000) goto bad;
            o.warmup = (int)w;
        } else if (!strcmp(a, "--request-rate") && v) {
            char *s = argv[++i], *end;
            o.n_rate = 0;
            while (*s) {
                if (o.n_rate == 32) goto bad;
                double r = strncmp(s, "inf", 3) ? strtod(s, &end) : INFINITY;
                if (isinf(r)) end = s + 3;
                if (end == s || !(r > 0) || (isfinite(r) && r > 1e6)) goto bad;
                o.rate[o.n_rate++] = r;
                if (*end && *end != ',') goto bad;
                s = *end == ',' ? end + 1 : end;
            }
            if (!o.n_rate) goto bad;
        }
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
    if (!url || !parse_url(url, &o) || o.input_len < 1 || o.output_len < 1 || o.num_prompts < 0 ||
        o.shared_prefix_len < 0 || o.turns < 1 || o.turns > 1000) {
        fprintf(stderr, "kvsparse bench serve: --url http://HOST:PORT is required; lengths must be >= 1 (a shared "
                "prefix >= 0), --turns 1 to 1000\n");
        return 2;
    }
    if (o.n_rate && o.n_conc > 1) {
        fprintf(stderr, "kvsparse bench serve: with --request-rate, --concurrency is one value (the most in flight)\n");
        return 2;
    }
    if (!o.n_conc && !o.n_rate) o.conc[o.n_conc++] = 1;
    char *found = NULL;
    if (!o.model && !(o.model = found = first_model(&o))) {
        fprintf(stderr, "kvsparse bench serve: GET %s/models at %s:%s failed (is the server up?)\n", o.base, o.host,
                o.port);
        return 1;
    }
    return bench_run_levels(&o, found);
}
