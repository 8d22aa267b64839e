/* server: a request's framing and the header fields the server reads,
 * against RFC 9112 and 9110, from the header list libmicrohttpd parsed (see
 * route.h). libmicrohttpd itself refuses a Content-Length that is not a
 * decimal number before the server sees the request; what it lets through is
 * checked here: repeated or conflicting length fields, Content-Length with
 * Transfer-Encoding, transfer codings other than chunked, Transfer-Encoding
 * in HTTP/1.0, a missing or repeated Host, the Authorization field (its
 * scheme case-insensitive, no NUL) and Anthropic's x-api-key (once, no NUL),
 * the absolute form of the request target. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "server/route.h"

static bool name_is(const kvs_http_header *h, const char *name) {
    return h->name_len == strlen(name) && !strncasecmp(h->name, name, h->name_len);
}

/* the answer (and the connection closed after it: the framing cannot be trusted); false */
static bool refuse(kvs_http_answer *a, int status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bool refuse(kvs_http_answer *a, int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    kvs_http_answer_verrorf(a, status, NULL, fmt, ap);
    va_end(ap);
    a->close = true;
    return false;
}

/* a token of the list value [p, end) after *p (commas and white space skipped); false when none is left */
static bool next_item(const char **p, const char *end, const char **item, size_t *len) {
    while (*p < end && (**p == ',' || **p == ' ' || **p == '\t')) (*p)++;
    if (*p == end) return false;
    *item = *p;
    while (*p < end && **p != ',' && **p != ' ' && **p != '\t') (*p)++;
    *len = (size_t)(*p - *item);
    return true;
}

/* Transfer-Encoding's codings: only chunked, once, last. */
static bool check_codings(const char *v, size_t n, kvs_http_answer *a) {
    const char *p = v, *end = v + n, *item;
    size_t len;
    int chunked = 0, items = 0;
    bool chunked_last = false;
    while (next_item(&p, end, &item, &len)) {
        items++;
        chunked_last = len == 7 && !strncasecmp(item, "chunked", 7);
        chunked += chunked_last;
        if (!chunked_last)
            return refuse(a, 501, "the transfer coding '%.*s' is not implemented (only chunked is)",
                          (int)(len > 40 ? 40 : len), item);
    }
    if (!items || chunked != 1 || !chunked_last)
        return refuse(a, 400, "Transfer-Encoding must be 'chunked', once");
    return true;
}

/* A decimal Content-Length (libmicrohttpd refused any other before us); one
 * past 2^64 - 1 as UINT64_MAX (too large for any limit). */
static bool parse_length(const char *v, size_t n, uint64_t *out) {
    uint64_t x = 0;
    if (!n) return false;
    for (size_t i = 0; i < n; i++) {
        if (v[i] < '0' || v[i] > '9') return false;
        unsigned d = (unsigned)(v[i] - '0');
        x = x > (UINT64_MAX - d) / 10 ? UINT64_MAX : x * 10 + d;
    }
    *out = x;
    return true;
}

bool kvs_http_check_head(const char *version, const kvs_http_header *h, int n, kvs_http_head_fields *f,
                         kvs_http_answer *a) {
    memset(f, 0, sizeof *f);
    memset(a, 0, sizeof *a);
    bool http10 = version && !strcmp(version, "HTTP/1.0");
    const kvs_http_header *length = NULL, *coding = NULL, *host = NULL, *auth = NULL, *key = NULL;
    static const char *const single[] = {"Content-Length", "Transfer-Encoding", "Host", "Authorization", "x-api-key"};
    for (int i = 0; i < n; i++) {
        const kvs_http_header **slot[] = {&length, &coding, &host, &auth, &key};
        for (int k = 0; k < 5; k++) {
            if (!name_is(&h[i], single[k])) continue;
            if (*slot[k]) return refuse(a, 400, "the request has more than one %s field", single[k]);
            if (h[i].cut || memchr(h[i].value, 0, h[i].value_len))
                return refuse(a, 400, "the %s field holds a NUL byte", single[k]);
            *slot[k] = &h[i];
        }
    }
    if (coding) {
        if (http10) return refuse(a, 400, "an HTTP/1.0 request cannot use Transfer-Encoding");
        if (length) return refuse(a, 400, "the request has both Content-Length and Transfer-Encoding");
        if (!check_codings(coding->value, coding->value_len, a)) return false;
        f->chunked = true;
    }
    if (length) {
        if (!parse_length(length->value, length->value_len, &f->content_length))
            return refuse(a, 400, "Content-Length must be one decimal number");
        f->has_length = true;
    }
    if (!host && !http10) return refuse(a, 400, "an HTTP/1.1 request needs a Host field");
    if (auth) {
        f->authorization = auth->value;
        f->authorization_len = auth->value_len;
    }
    if (key) {
        f->x_api_key = key->value;
        f->x_api_key_len = key->value_len;
    }
    return true;
}

bool kvs_http_bearer(const char *v, size_t n, const char **token, size_t *len) {
    /* RFC 9110 11.4: auth-scheme (case-insensitive) 1*SP token68 */
    if (!v || n < 7 || strncasecmp(v, "Bearer", 6) || v[6] != ' ') return false;
    size_t i = 7;
    while (i < n && v[i] == ' ') i++;
    *token = v + i;
    *len = n - i;
    return *len > 0;
}

const char *kvs_http_origin_path(const char *url) {
    /* RFC 9112 3.2.2: a server accepts the absolute form; its path is what routes */
    const char *p = NULL;
    if (!strncasecmp(url, "http://", 7)) p = url + 7;
    else if (!strncasecmp(url, "https://", 8)) p = url + 8;
    if (!p) return url;
    const char *slash = strchr(p, '/');
    return slash ? slash : "/";
}
