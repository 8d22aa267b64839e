/* kvsparse serve: the OpenAI-compatible HTTP server over one engine.
 * SIGTERM / SIGINT drain: stop accepting, let what is in flight finish for up
 * to --drain-timeout seconds, abort the rest, exit 0 (a second signal exits
 * at once). A failed engine (kvs_engine_failed) drains the same way, its
 * requests already ended with the error, and exits 1 so that a supervisor
 * (systemd, Kubernetes) restarts the server. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <sys/resource.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "cli/cli_common.h"
#include "engine/engine.h"
#include "events/kv_events.h"
#include "server/server.h"

/* Signal handling only: the self-pipe the main thread sleeps on, and a count. */
static int g_signal_pipe[2] = {-1, -1};
static volatile sig_atomic_t g_signals;

static void on_signal(int sig) {
    if (g_signals++ > 0) {
        static const char msg[] = "[kvsparse warn] a second signal: exiting at once\n";
        if (write(2, msg, sizeof msg - 1) < 0) { /* nothing to do */
        }
        _exit(128 + sig);
    }
    int saved = errno;
    char c = 1;
    if (write(g_signal_pipe[1], &c, 1) < 0) { /* nothing to do */
    }
    errno = saved;
}

typedef struct {
    kvs_load_options load;
    kvs_engine_config ecfg;
    kvs_server_config scfg;
    kvs_cli_memory mem;
    int drain_timeout_s;
    const char *api_key_file;
    bool generation_none;          /* --generation-config none */
    kvs_generation_config gen;     /* the model's generation_config.json (auto) */
    kvs_sampling_params sampling;  /* a request's defaults: OpenAI's under gen */
    kvs_kv_events_config kv_events; /* --kv-events-config */
} serve_options;

static void usage(FILE *f) {
    fprintf(f, "usage: kvsparse serve -m MODEL_DIR [options]\n"
               "  --host H                  address to listen on (default 127.0.0.1)\n"
               "  --port P                  port (default 8000; 0 picks a free one and prints it)\n"
               "  --api-key KEY             require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on /v1/*\n"
               "                            (visible in ps: prefer --api-key-file or KVSPARSE_API_KEY)\n"
               "  --api-key-file FILE       read the key from FILE (surrounding whitespace trimmed)\n"
               "                            precedence: --api-key, then --api-key-file, then $KVSPARSE_API_KEY\n"
               "  --served-model-name NAME  the model name clients use (default: the model folder's name)\n"
               "  --max-num-seqs N          running requests at most (default 64)\n"
               "  --max-num-batched-tokens N  tokens per engine step (default 2048)\n"
               "  --max-model-len N         context limit (default: the model's)\n"
               "  --max-waiting N           queued requests at most; more get 429 (default 1024)\n"
               "  --kv-events-config JSON   publish the prefix cache's KV events over ZeroMQ as vLLM does, e.g.\n"
               "                            '{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:5557\",\n"
               "                            \"replay_endpoint\":\"tcp://*:5558\",\"topic\":\"kv\"}' (docs/SERVING.md)\n"
               "  --enable-prefix-caching   reuse the cached KV of prompt prefixes across requests (default;\n"
               "                            requests share them only with an equal cache_salt)\n"
               "  --no-enable-prefix-caching  prefill every prompt in full, cache nothing\n"
               "  --max-body-bytes N        request body limit (default 4 MiB; more gets 413)\n"
               "  --max-tokens-default N    a request without max_tokens generates at most N tokens (default: the\n"
               "                            model's max_new_tokens, else completions 16, chat the rest of the context)\n"
               "  --http-timeout S          close a connection that makes no progress for S seconds: an idle or\n"
               "                            slow client, or one that stops reading its response (default 60)\n"
               "  --max-connections-per-ip N  open connections one client address may hold; more are refused\n"
               "                            (default 256; behind a proxy, which is one address, or for a\n"
               "                            benchmark at a higher concurrency, raise it up to --max-connections)\n"
               "  --drain-timeout S         on SIGTERM/SIGINT, wait up to S seconds for running requests, then\n"
               "                            abort them and exit 0 (default 30)\n"
               "  --max-connections N       open connections at most (default 1024)\n"
               "  --max-pending-connections N  connections not yet a request in flight (sending one, or idle\n"
               "                            between requests) at most; when full, a newcomer from an address\n"
               "                            below its fair share displaces the busiest address's oldest one\n"
               "                            (default: max-connections / 4)\n"
               "  --max-preparing N         requests parsed, tokenized and compiled at once, by as many worker\n"
               "                            threads; one waiting more than 5 s for them gets 429 (default 8)\n"
               "  --header-timeout S        a request's line and headers must arrive within S seconds (10)\n"
               "  --body-timeout S          its body within S seconds, plus one per --body-min-rate bytes (10)\n"
               "  --body-min-rate B         bytes a second (4096)\n"
               "  --grammar-max-values N    response_format / forced tool call schemas: JSON values (100000)\n"
               "  --grammar-max-states N    automaton states of one compiled (32768)\n"
               "  --grammar-max-transitions N  transitions built compiling one (1000000)\n"
               "  --grammar-max-memory MIB  memory compiling one (64)\n"
               "  --grammar-compile-timeout S  time compiling one (0.5)\n"
               "  --grammar-max-mask-work N  matcher steps of one token mask (8000000); past it the request fails\n"
               "  --grammar-cache-memory MIB  compiled grammars kept (256)\n"
               "  --tool-call-parser NAME   how outputs of requests with tools are read for calls: llama3_json,\n"
               "                            hermes, none, or auto (default: from the chat template)\n"
               "  --no-web-ui               no chat page at GET / (default: served; it asks for the API key)\n"
               "  --no-vllm-metrics         /metrics without vLLM's names of its values (default: both; routers\n"
               "                            such as llm-d's endpoint picker scrape vllm:num_requests_waiting, ...)\n"
               KVS_CLI_MEMORY_HELP KVS_CLI_GENERATION_HELP KVS_CLI_LOAD_HELP KVS_CLI_DEVICE_HELP KVS_CLI_TP_HELP KVS_CLI_POLICY_HELP
               "The API is described in docs/SERVING.md.\n");
}

static bool parse_int(const char *s, int lo, int *out) {
    char *end;
    long v = strtol(s, &end, 10);
    if (end == s || *end || v < lo || v > (1L << 30)) return false;
    *out = (int)v;
    return true;
}

static bool parse_seconds(const char *s, double *out) {
    char *end;
    double v = strtod(s, &end);
    if (end == s || *end || !(v > 0 && v <= 86400)) return false;
    *out = v;
    return true;
}

/* The connection and grammar bounds (docs/SERVING.md); 1 taken, 0 not one of them, -1 bad. */
static int limit_option(serve_options *o, int argc, char **argv, int *i) {
    const char *a = argv[*i], *v = *i + 1 < argc ? argv[*i + 1] : NULL;
    kvs_server_config *c = &o->scfg;
    int n;
    double d;
    if (!v || strncmp(a, "--", 2)) return 0;
    if (!strcmp(a, "--max-connections")) { if (!parse_int(v, 1, &n)) return -1; c->connection_limit = (unsigned)n; }
    else if (!strcmp(a, "--max-pending-connections")) { if (!parse_int(v, 1, &n)) return -1; c->max_pending = (unsigned)n; }
    else if (!strcmp(a, "--max-preparing")) { if (!parse_int(v, 1, &c->max_preparing)) return -1; }
    else if (!strcmp(a, "--header-timeout")) { if (!parse_seconds(v, &c->header_timeout_s)) return -1; }
    else if (!strcmp(a, "--body-timeout")) { if (!parse_seconds(v, &c->body_timeout_s)) return -1; }
    else if (!strcmp(a, "--body-min-rate")) { if (!parse_int(v, 1, &n)) return -1; c->body_min_rate = n; }
    else if (!strcmp(a, "--grammar-max-values")) { if (!parse_int(v, 1, &c->grammar_limits.max_values)) return -1; }
    else if (!strcmp(a, "--grammar-max-states")) { if (!parse_int(v, 1, &c->grammar_limits.max_states)) return -1; }
    else if (!strcmp(a, "--grammar-max-transitions")) { if (!parse_int(v, 1, &c->grammar_limits.max_transitions)) return -1; }
    else if (!strcmp(a, "--grammar-max-memory")) { if (!parse_int(v, 1, &n)) return -1; c->grammar_limits.max_bytes = (size_t)n << 20; }
    else if (!strcmp(a, "--grammar-compile-timeout")) { if (!parse_seconds(v, &d)) return -1; c->grammar_limits.max_seconds = d; }
    else if (!strcmp(a, "--grammar-max-mask-work")) { if (!parse_int(v, 1, &n)) return -1; c->grammar_limits.max_mask_work = (uint64_t)n; }
    else if (!strcmp(a, "--grammar-cache-memory")) { if (!parse_int(v, 1, &n)) return -1; c->grammar_cache_bytes = (size_t)n << 20; }
    else return 0;
    ++*i;
    return 1;
}

static int parse_args(int argc, char **argv, serve_options *o) {
    memset(o, 0, sizeof *o);
    o->ecfg = kvs_engine_config_default();
    o->load.allow_tp = true;
    o->scfg.host = "127.0.0.1";
    o->scfg.port = 8000;
    o->drain_timeout_s = 30;
    o->mem = kvs_cli_memory_default();
    o->kv_events = kvs_kv_events_config_default();
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int r = kvs_cli_load_option(&o->load, argc, argv, &i);
        if (r == 0) r = kvs_cli_policy_option(&o->ecfg.default_policy, &o->load.kv_profile, argc, argv, &i);
        if (r == 0) r = kvs_cli_prefix_caching_option(&o->ecfg.enable_prefix_caching, a);
        if (r == 0) r = kvs_cli_memory_option(&o->mem, argc, argv, &i);
        if (r == 0) r = kvs_cli_generation_option(&o->generation_none, argc, argv, &i);
        if (r == 0) r = limit_option(o, argc, argv, &i);
        if (r < 0) goto bad;
        if (r > 0) continue;
        bool v = i + 1 < argc;
        int n;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { usage(stdout); return 0; }
        else if (!strcmp(a, "--host") && v) o->scfg.host = argv[++i];
        else if (!strcmp(a, "--port") && v) { if (!parse_int(argv[++i], 0, &n) || n > 65535) goto bad; o->scfg.port = n; }
        else if (!strcmp(a, "--api-key") && v) o->scfg.api_key = argv[++i];
        else if (!strcmp(a, "--api-key-file") && v) o->api_key_file = argv[++i];
        else if (!strcmp(a, "--no-web-ui")) o->scfg.no_web_ui = true;
        else if (!strcmp(a, "--no-vllm-metrics")) o->scfg.no_vllm_metrics = true;
        else if (!strcmp(a, "--max-tokens-default") && v) { if (!parse_int(argv[++i], 1, &n)) goto bad; o->scfg.max_tokens_default = n; }
        else if (!strcmp(a, "--http-timeout") && v) { if (!parse_int(argv[++i], 1, &n)) goto bad; o->scfg.http_timeout_s = (unsigned)n; }
        else if (!strcmp(a, "--max-connections-per-ip") && v) { if (!parse_int(argv[++i], 1, &n)) goto bad; o->scfg.max_connections_per_ip = (unsigned)n; }
        else if (!strcmp(a, "--drain-timeout") && v) { if (!parse_int(argv[++i], 0, &o->drain_timeout_s)) goto bad; }
        else if (!strcmp(a, "--served-model-name") && v) o->scfg.served_model_name = argv[++i];
        else if (!strcmp(a, "--tool-call-parser") && v) o->scfg.tool_call_parser = argv[++i];
        else if (!strcmp(a, "--max-num-seqs") && v) { if (!parse_int(argv[++i], 1, &o->ecfg.max_num_seqs)) goto bad; }
        else if (!strcmp(a, "--max-num-batched-tokens") && v) { if (!parse_int(argv[++i], 1, &o->ecfg.max_num_batched_tokens)) goto bad; }
        else if (!strcmp(a, "--max-model-len") && v) { if (!parse_int(argv[++i], 1, &o->ecfg.max_model_len)) goto bad; }
        else if (!strcmp(a, "--max-waiting") && v) { if (!parse_int(argv[++i], 1, &o->ecfg.max_waiting)) goto bad; }
        else if (!strcmp(a, "--max-body-bytes") && v) { if (!parse_int(argv[++i], 1024, &n)) goto bad; o->scfg.max_body_bytes = (size_t)n; }
        else if (!strcmp(a, "--kv-events-config") && v) {
            if (kvs_kv_events_config_parse(argv[++i], &o->kv_events) != KVS_OK) {
                fprintf(stderr, "kvsparse serve: %s\n", kvs_last_error());
                return 2;
            }
        }
        else goto bad;
        continue;
    bad:
        fprintf(stderr, "kvsparse serve: bad or incomplete option '%s'\n", a);
        usage(stderr);
        return 2;
    }
    if (kvs_cli_memory_check(&o->mem) != KVS_OK) {
        fprintf(stderr, "kvsparse serve: %s\n", kvs_last_error());
        return 2;
    }
    if (!o->load.model_dir && !o->load.config_path) {
        fprintf(stderr, "kvsparse serve: -m MODEL_DIR is required\n");
        return 2;
    }
    return -1;
}

/* Trims surrounding whitespace in place; false if what is left is empty or
 * holds a control character (no HTTP header could carry it). */
static bool clean_key(char *k, const char *what) {
    size_t n = strlen(k), a = 0;
    while (n > 0 && strchr(" \t\r\n", k[n - 1])) k[--n] = 0;
    while (a < n && strchr(" \t\r\n", k[a])) a++;
    memmove(k, k + a, n - a + 1);
    if (!*k) {
        fprintf(stderr, "kvsparse serve: %s is empty\n", what);
        return false;
    }
    for (const char *p = k; *p; p++)
        if ((unsigned char)*p < 0x20 || *p == 0x7f) {
            fprintf(stderr, "kvsparse serve: %s holds a line break or another control character\n", what);
            return false;
        }
    return true;
}

/* The API key: --api-key, else --api-key-file, else $KVSPARSE_API_KEY, else
 * none. *owned (malloc'ed) backs it when it came from the file or the
 * environment. False after printing what is wrong. */
static bool resolve_api_key(serve_options *o, char **owned) {
    *owned = NULL;
    if (o->scfg.api_key) return true;
    char what[600];
    if (o->api_key_file) {
        snprintf(what, sizeof what, "--api-key-file %s", o->api_key_file);
        FILE *f = fopen(o->api_key_file, "rb");
        if (!f) {
            fprintf(stderr, "kvsparse serve: %s: %s\n", what, strerror(errno));
            return false;
        }
        char *k = calloc(1, 4097);
        size_t n = k ? fread(k, 1, 4097, f) : 0;
        bool bad = !k || ferror(f);
        fclose(f);
        if (bad || n > 4096) {
            fprintf(stderr, "kvsparse serve: %s: %s\n", what, bad ? "could not be read" : "longer than 4096 bytes");
            free(k);
            return false;
        }
        if (memchr(k, 0, n)) fprintf(stderr, "kvsparse serve: %s holds a NUL byte\n", what);
        if (memchr(k, 0, n) || !clean_key(k, what)) {
            free(k);
            return false;
        }
        o->scfg.api_key = *owned = k;
        kvs_log(KVS_LOG_INFO, "API key read from %s", o->api_key_file);
        return true;
    }
    const char *env = getenv("KVSPARSE_API_KEY");
    if (!env) return true;
    char *k = strdup(env);
    if (!k || !clean_key(k, "KVSPARSE_API_KEY (unset it to serve without a key)")) {
        free(k);
        return false;
    }
    o->scfg.api_key = *owned = k;
    kvs_log(KVS_LOG_INFO, "API key taken from $KVSPARSE_API_KEY");
    return true;
}

/* A request's defaults: OpenAI's, with the model's generation_config.json
 * over them (--generation-config auto); --max-tokens-default over its
 * max_new_tokens. What a request sets wins over all. */
static kvs_status request_defaults(serve_options *o) {
    KVS_TRY(kvs_cli_generation_config(&o->load, o->generation_none, &o->gen));
    o->sampling = kvs_api_sampling_default();
    int max_tokens = 0;
    kvs_sampling_apply(&o->gen, &o->sampling, &max_tokens);
    if (!o->scfg.max_tokens_default) o->scfg.max_tokens_default = max_tokens;
    o->scfg.sampling_defaults = &o->sampling;
    return KVS_OK;
}

static void log_request_defaults(const serve_options *o) {
    char sampling[192], max_tokens[80];
    kvs_sampling_describe(&o->sampling, sampling, sizeof sampling);
    if (o->scfg.max_tokens_default) snprintf(max_tokens, sizeof max_tokens, "%d", o->scfg.max_tokens_default);
    else snprintf(max_tokens, sizeof max_tokens, "16 (completions) or the rest of the context (chat)");
    const char *from = kvs_generation_config_any(&o->gen)
                           ? "from the model's generation_config.json; --generation-config none for the built-in ones"
                           : o->generation_none ? "built-in: --generation-config none" : "built-in";
    kvs_log(KVS_LOG_INFO, "request defaults: %s, max_tokens %s (%s)", sampling, max_tokens, from);
}

/* Room for every connection: the soft limit on open files raised toward the
 * hard one (a default soft limit of 1024 would fail accepts near
 * --max-connections). */
static void raise_fd_limit(unsigned connections) {
    struct rlimit r;
    rlim_t want = (rlim_t)connections + 256;
    if (getrlimit(RLIMIT_NOFILE, &r) != 0 || r.rlim_cur >= want) return;
    r.rlim_cur = r.rlim_max != RLIM_INFINITY && r.rlim_max < want ? r.rlim_max : want;
    if (setrlimit(RLIMIT_NOFILE, &r) != 0 || r.rlim_cur < want)
        kvs_log(KVS_LOG_WARN, "open files are limited to %llu: fewer than --max-connections %u can be served",
                (unsigned long long)r.rlim_cur, connections);
}

/* Sleeps until a signal arrives or the engine fails (then its reason in failure). */
static void wait_for_stop(kvs_engine *e, char *failure, size_t cap) {
    for (;;) {
        struct pollfd p = {.fd = g_signal_pipe[0], .events = POLLIN};
        int n = poll(&p, 1, 200);
        if (n > 0 || (n < 0 && errno != EINTR)) return;
        const char *why;
        if (kvs_engine_failed(e, &why)) {
            snprintf(failure, cap, "%s", why);
            return;
        }
    }
}

int kvs_cmd_serve(int argc, char **argv) {
    serve_options o;
    int rc = parse_args(argc, argv, &o);
    if (rc >= 0) return rc;
    char *key = NULL;
    if (!resolve_api_key(&o, &key)) return 2;
    if (request_defaults(&o) != KVS_OK) {
        free(key);
        return kvs_cli_error();
    }
    kvs_loaded l;
    o.load.limits = (kvs_step_limits){o.ecfg.max_num_batched_tokens, o.ecfg.max_num_seqs, o.ecfg.max_model_len, 0};
    if (kvs_cli_load(&o.load, &l) != KVS_OK) {
        free(key);
        return kvs_cli_error();
    }
    o.ecfg.default_policy.profile = l.kv_profile; /* the server gives it to every request's kv_policy too */
    o.scfg.no_prefix_caching = !o.ecfg.enable_prefix_caching; /* /metrics' kvsparse_kv_admit_tokens */
    if (kvs_cli_kv_bytes(&l, &o.mem, &o.ecfg.default_policy, &o.ecfg.kv_memory_bytes) != KVS_OK) {
        kvs_cli_unload(&l);
        free(key);
        return kvs_cli_error();
    }
    if (!l.tok) kvs_log(KVS_LOG_WARN, "the model has no tokenizer.json: only token-id prompts will work");
    char namebuf[512];
    if (!o.scfg.served_model_name) o.scfg.served_model_name = kvs_cli_last_name(o.load.model_dir, namebuf, sizeof namebuf);
    kvs_engine *e = NULL;
    kvs_server *srv = NULL;
    kvs_kv_event_publisher *events = NULL;
    kvs_status st = KVS_OK;
    if (o.kv_events.enable) {
        bool gpu = o.load.device && !strncmp(o.load.device, "cuda", 4);
        st = kvs_kv_event_publisher_create(&o.kv_events, gpu ? "GPU" : "CPU", &events);
        o.ecfg.on_kv_events = kvs_kv_event_publisher_publish, o.ecfg.kv_events_user = events;
    }
    if (st == KVS_OK) st = kvs_cli_engine(&l, &o.ecfg, &e); /* the server asks it for its limits */
    if (st == KVS_OK) st = kvs_engine_start(e);
    if (st == KVS_OK && (pipe(g_signal_pipe) != 0 || fcntl(g_signal_pipe[1], F_SETFL, O_NONBLOCK) != 0))
        st = kvs_fail(KVS_ERR_IO, "pipe: %s", strerror(errno));
    if (st == KVS_OK) {
        signal(SIGPIPE, SIG_IGN);
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_signal;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGTERM, &sa, NULL);
        sigaction(SIGINT, &sa, NULL);
        raise_fd_limit(o.scfg.connection_limit ? o.scfg.connection_limit : 1024);
        st = kvs_server_start(&o.scfg, e, l.tok, &srv);
    }
    if (st != KVS_OK) {
        kvs_engine_destroy(e);
        kvs_kv_event_publisher_destroy(events);
        kvs_cli_unload(&l);
        free(key);
        return kvs_cli_error();
    }
    kvs_cli_log_capacity(&l, &o.ecfg, kvs_engine_get_limits(e).max_model_len);
    log_request_defaults(&o);
    const char *host = o.scfg.host;
    bool v6 = strchr(host, ':') != NULL;
    printf("kvsparse: serving '%s' at http://%s%s%s:%d/v1 (port %d)\n", o.scfg.served_model_name, v6 ? "[" : "", host,
           v6 ? "]" : "", kvs_server_port(srv), kvs_server_port(srv));
    fflush(stdout);
    if (!o.scfg.no_web_ui)
        kvs_log(KVS_LOG_INFO, "chat page: http://%s%s%s:%d/", v6 ? "[" : "", host, v6 ? "]" : "", kvs_server_port(srv));
    char failure[600] = "";
    wait_for_stop(e, failure, sizeof failure);
    if (failure[0])
        kvs_log(KVS_LOG_ERROR, "the engine failed (%s): draining, then exiting with status 1 for a restart", failure);
    else
        kvs_log(KVS_LOG_INFO, "signal received: draining requests in flight for up to %d s (a second signal exits at once)",
                o.drain_timeout_s);
    int aborted = kvs_server_drain(srv, o.drain_timeout_s);
    if (aborted)
        kvs_log(KVS_LOG_WARN, "%d request%s still running after --drain-timeout %d s: aborted", aborted,
                aborted == 1 ? "" : "s", o.drain_timeout_s);
    kvs_engine_stop(e, true);
    kvs_server_stop(srv);
    kvs_engine_destroy(e);
    kvs_kv_event_publisher_destroy(events); /* after the engine: its thread published */
    kvs_cli_unload(&l);
    close(g_signal_pipe[0]);
    close(g_signal_pipe[1]);
    free(key);
    if (failure[0]) {
        kvs_log(KVS_LOG_ERROR, "stopped after an engine failure: %s", failure);
        return 1;
    }
    kvs_log(KVS_LOG_INFO, "stopped");
    return 0;
}
