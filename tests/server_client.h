/* Helpers of the server tests (test_server.c, test_server_http.c): start the
 * real binary (`kvsparse serve --port 0`) on the bundled tiny model and talk
 * HTTP to it over loopback with a small raw-socket client. */
#ifndef KVS_TEST_SERVER_CLIENT_H
#define KVS_TEST_SERVER_CLIENT_H

#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <jansson.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"

/* ---- the server process ---------------------------------------------------- */
typedef struct {
    pid_t pid;
    int port;
} server_proc;

/* Starts `kvsparse serve` on model_dir (NULL: the bundled tiny model) on a
 * free port with extra options; env ("K=V" or NULL) is set in its environment. */
static inline server_proc start_server_on(const char *model_dir, const char *extra, const char *env) {
    int fds[2];
    cr_assert_eq(pipe(fds), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) {
        dup2(fds[1], 1);
        close(fds[0]);
        close(fds[1]);
        char cmd[2048];
        snprintf(cmd, sizeof cmd, "exec '%s' serve -m '%s' --port 0 --threads 2 %s 2>>/tmp/kvs_test_server.log",
                 kvsparse_binary(), model_dir ? model_dir : src_path("models/tiny-needle-llama"), extra ? extra : "");
        setenv("OMP_WAIT_POLICY", "passive", 1);
        if (env) putenv((char *)env);
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    close(fds[1]);
    FILE *f = fdopen(fds[0], "r");
    char line[512];
    server_proc s = {pid, 0};
    while (fgets(line, sizeof line, f)) {
        const char *p = strstr(line, "(port ");
        if (p) {
            s.port = atoi(p + 6);
            break;
        }
    }
    fclose(f);
    cr_assert_gt(s.port, 0, "the server did not print its port");
    return s;
}

static inline server_proc start_server_env(const char *extra, const char *env) { return start_server_on(NULL, extra, env); }
static inline server_proc start_server(const char *extra) { return start_server_on(NULL, extra, NULL); }

static inline int stop_server(server_proc *s) {
    kill(s->pid, SIGTERM);
    int status = 0;
    for (int i = 0; i < 600; i++) {
        if (waitpid(s->pid, &status, WNOHANG) == s->pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        usleep(100000);
    }
    kill(s->pid, SIGKILL);
    waitpid(s->pid, &status, 0);
    return -2;
}

/* Sends SIGTERM and waits up to max_s seconds for the exit (then SIGKILL);
 * whether it exited by itself, its wait status and the seconds it took. */
static inline bool term_and_wait(pid_t pid, double max_s, int *status, double *took) {
    double t0 = kvs_now();
    kill(pid, SIGTERM);
    bool exited = false;
    while (!exited && kvs_now() - t0 < max_s) {
        exited = waitpid(pid, status, WNOHANG) == pid;
        if (!exited) usleep(50000);
    }
    *took = kvs_now() - t0;
    if (!exited) {
        kill(pid, SIGKILL);
        waitpid(pid, status, 0);
    }
    return exited;
}

/* ---- a tiny HTTP/1.0 client (the server closes after each response) ------- */
typedef struct {
    int status;
    char *body;
    size_t len;
    int interim; /* 1xx responses before it */
} http_resp;

static inline int connect_to(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static inline bool send_all(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w <= 0) return false;
        p += w;
        n -= (size_t)w;
    }
    return true;
}

/* version: "1.0" or "1.1" */
static inline bool send_request_v(int fd, const char *version, const char *method, const char *path,
                                  const char *headers, const char *body, size_t len) {
    char head[1024];
    int n = snprintf(head, sizeof head, "%s %s HTTP/%s\r\nHost: localhost\r\n%sContent-Length: %zu\r\n\r\n", method,
                     path, version, headers ? headers : "", body ? len : 0);
    return send_all(fd, head, (size_t)n) && (!body || send_all(fd, body, len));
}

static inline bool send_request(int fd, const char *method, const char *path, const char *headers, const char *body,
                                size_t len) {
    return send_request_v(fd, "1.0", method, path, headers, body, len);
}

/* Reads until the server closes; 1xx interim responses are skipped (counted). */
static inline http_resp read_response(int fd) {
    http_resp r = {0};
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    ssize_t got;
    while ((got = recv(fd, buf + n, cap - n - 1, 0)) > 0) {
        n += (size_t)got;
        if (cap - n < 4096) buf = realloc(buf, cap *= 2);
    }
    buf[n] = 0;
    char *p = buf;
    while (!strncmp(p, "HTTP/1.1 1", 10) && strstr(p, "\r\n\r\n")) {
        p = strstr(p, "\r\n\r\n") + 4;
        r.interim++;
    }
    sscanf(p, "HTTP/%*s %d", &r.status);
    char *b = strstr(p, "\r\n\r\n");
    r.body = strdup(b ? b + 4 : "");
    r.len = strlen(r.body);
    free(buf);
    return r;
}

static inline http_resp http(int port, const char *method, const char *path, const char *headers, const char *body) {
    http_resp r = {0};
    int fd = connect_to(port);
    if (fd < 0) return r;
    /* the server may answer (413) and close before the whole body is sent: read anyway */
    send_request(fd, method, path, headers, body, body ? strlen(body) : 0);
    r = read_response(fd);
    close(fd);
    if (!r.body) r.body = strdup("");
    return r;
}

static inline json_t *post_json(int port, const char *path, const char *body, int want_status) {
    http_resp r = http(port, "POST", path, NULL, body);
    cr_assert_eq(r.status, want_status, "POST %s %s -> %d %s", path, body, r.status, r.body);
    json_t *j = json_loads(r.body, 0, NULL);
    cr_assert(j, "not JSON: %s", r.body);
    free(r.body);
    return j;
}

/* Joins a stream's text; *finish gets the last finish_reason; usage when present. */
typedef struct {
    char text[8192];
    char finish[16];
    int n_chunks, prompt_tokens, completion_tokens;
    bool done, usage;
} stream_result;

static inline void parse_stream(const char *body, bool chat, stream_result *out) {
    memset(out, 0, sizeof *out);
    for (const char *p = body; (p = strstr(p, "data: ")); ) {
        p += 6;
        const char *end = strstr(p, "\n\n");
        if (!end) break;
        if (!strncmp(p, "[DONE]", 6)) { out->done = true; break; }
        json_t *j = json_loadb(p, (size_t)(end - p), 0, NULL);
        cr_assert(j, "bad chunk: %.*s", (int)(end - p), p);
        json_t *ch = json_array_get(json_object_get(j, "choices"), 0);
        if (ch) {
            json_t *t = chat ? json_object_get(json_object_get(ch, "delta"), "content") : json_object_get(ch, "text");
            if (json_is_string(t)) strncat(out->text, json_string_value(t), sizeof out->text - strlen(out->text) - 1);
            json_t *f = json_object_get(ch, "finish_reason");
            if (json_is_string(f)) snprintf(out->finish, sizeof out->finish, "%s", json_string_value(f));
            out->n_chunks++;
        }
        json_t *u = json_object_get(j, "usage");
        if (json_is_object(u)) {
            out->usage = true;
            out->prompt_tokens = (int)json_integer_value(json_object_get(u, "prompt_tokens"));
            out->completion_tokens = (int)json_integer_value(json_object_get(u, "completion_tokens"));
        }
        json_decref(j);
        p = end;
    }
}

static inline const char *choice_text(json_t *j, bool chat) {
    json_t *ch = json_array_get(json_object_get(j, "choices"), 0);
    json_t *t = chat ? json_object_get(json_object_get(ch, "message"), "content") : json_object_get(ch, "text");
    return json_string_value(t);
}

static inline int usage_of(json_t *j, const char *k) { return (int)json_integer_value(json_object_get(json_object_get(j, "usage"), k)); }

static inline json_t *metrics_value(int port, const char *name, double *v) {
    http_resp r = http(port, "GET", "/metrics", NULL, NULL);
    cr_assert_eq(r.status, 200);
    char *p = strstr(r.body, name);
    while (p && p > r.body && p[-1] != '\n') p = strstr(p + 1, name);
    cr_assert(p, "metric %s missing", name);
    p = strchr(p, ' ');
    *v = atof(p + 1);
    free(r.body);
    return NULL;
}

/* Waits (up to 10 s) until at least n requests run; false if they never do. */
static inline bool wait_running(int port, int n) {
    double running = 0;
    for (int i = 0; i < 200; i++) {
        metrics_value(port, "kvsparse_num_requests_running{", &running);
        if (running >= n) return true;
        usleep(50000);
    }
    return false;
}

/* Waits until no request runs, then checks that no KV block is in use. */
static inline void expect_no_blocks(int port) {
    double running = 1, used = 1;
    for (int i = 0; i < 100 && (running > 0 || used > 0); i++) {
        metrics_value(port, "kvsparse_num_requests_running{", &running);
        metrics_value(port, "kvsparse_kv_blocks_used{", &used);
        if (running > 0 || used > 0) usleep(100000);
    }
    cr_expect_eq(running, 0);
    cr_expect_eq(used, 0, "KV blocks still in use after every request ended");
}
static inline long rss_kb(pid_t pid) {
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    long kb = -1;
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, "VmRSS:", 6)) kb = atol(line + 6);
    if (f) fclose(f);
    return kb;
}


#endif
