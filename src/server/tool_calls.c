/* server: the streaming tool-call parser (tool_calls.h), a state machine fed
 * one byte at a time, so that where the text is split never matters:
 *   LEAD   white space at the start or after a call, held (through TAG, OPEN
 *          and CALL): dropped before a call, content before anything else
 *   TEXT   content, where the opening tag (or llama3_json's '{') may begin a call
 *   PLAIN  content to the end (format none)
 *   TAG    a partial opening tag, held
 *   OPEN   the opening tag and white space, held until the call's '{'
 *   CALL   the call's JSON object, scanned (call_scan): its name and
 *          arguments events go out as soon as both have begun
 *   CLOSE  hermes: white space and </tool_call> after a call, dropped
 *   PY     llama3_json: <|python_tag|>name.call(k=v, ...), parsed at the end */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/tool_calls.h"

const char *kvs_tool_format_name(kvs_tool_format f) {
    switch (f) {
    case KVS_TOOL_FORMAT_NONE: return "none";
    case KVS_TOOL_FORMAT_LLAMA3_JSON: return "llama3_json";
    case KVS_TOOL_FORMAT_HERMES: return "hermes";
    default: return NULL;
    }
}

bool kvs_tool_format_parse(const char *name, kvs_tool_format *out) {
    if (!name) return false;
    for (int f = KVS_TOOL_FORMAT_NONE; f <= KVS_TOOL_FORMAT_HERMES; f++)
        if (!strcmp(name, kvs_tool_format_name(f))) return *out = f, true;
    if (strcmp(name, "auto")) return false;
    *out = KVS_TOOL_FORMAT_NONE;
    return true;
}

kvs_tool_format kvs_tool_format_for_template(const char *src) {
    if (!src) return KVS_TOOL_FORMAT_HERMES;
    if (strstr(src, "<tool_call>")) return KVS_TOOL_FORMAT_HERMES;
    if (strstr(src, "<|python_tag|>") || strstr(src, "ipython") || strstr(src, "<|start_header_id|>"))
        return KVS_TOOL_FORMAT_LLAMA3_JSON;
    return KVS_TOOL_FORMAT_HERMES; /* ChatML (<|im_start|>) and the default template */
}

/* ---- growing byte strings: s holds *len bytes and a NUL in a block of the
 * power of two above (so appends a byte at a time stay amortized O(1)) ---- */
static size_t block_for(size_t n) {
    size_t b = 32;
    while (b < n) b *= 2;
    return b;
}

static bool append(char **s, size_t *len, const char *t, size_t n) {
    if (!*s || block_for(*len + n + 1) > block_for(*len + 1)) {
        char *p = realloc(*s, block_for(*len + n + 1));
        if (!p) return false;
        *s = p;
    }
    if (n) memcpy(*s + *len, t, n);
    *len += n;
    (*s)[*len] = 0;
    return true;
}

typedef struct {
    char *p;
    size_t n;
} sbuf;

/* ---- events ------------------------------------------------------------------ */
void kvs_tool_events_clear(kvs_tool_events *e) {
    for (int i = 0; i < e->n; i++) {
        free(e->v[i].id);
        free(e->v[i].name);
        free(e->v[i].text);
    }
    e->n = 0;
}

void kvs_tool_events_free(kvs_tool_events *e) {
    kvs_tool_events_clear(e);
    free(e->v);
    memset(e, 0, sizeof *e);
}

/* A copy that append may grow. */
static char *dup_n(const char *s, size_t n) {
    char *d = NULL;
    size_t len = 0;
    return append(&d, &len, s, n) ? d : NULL;
}

/* Appends text to the last event when it continues it (same call, no new id). */
static bool emit(kvs_tool_events *out, int call, const char *id, const char *name, const char *text, size_t n) {
    if (!id && n == 0) return true;
    kvs_tool_event *last = out->n ? &out->v[out->n - 1] : NULL;
    if (!id && last && last->call == call) return append(&last->text, &last->len, text, n);
    if (out->n == out->cap) {
        int cap = out->cap * 2 + 8;
        kvs_tool_event *v = realloc(out->v, sizeof *v * cap);
        if (!v) return false;
        out->v = v;
        out->cap = cap;
    }
    kvs_tool_event ev = {call, id ? strdup(id) : NULL, name ? strdup(name) : NULL, dup_n(text, n), n};
    if (!ev.text || (id && !ev.id) || (name && !ev.name)) {
        free(ev.id), free(ev.name), free(ev.text);
        return false;
    }
    out->v[out->n++] = ev;
    return true;
}

/* ---- one call's JSON object, a byte at a time --------------------------------- */
enum { P_KEY, P_IN_KEY, P_COLON, P_VALUE, P_IN_VALUE, P_AFTER };
enum { K_OTHER, K_NAME, K_ARGS };

typedef struct {
    int depth, phase, key;
    bool in_str, esc, scalar, any_key;
    size_t key_start, val_start;
    size_t name_start, name_end;        /* the name's string literal; name_end 0: none yet */
    bool has_args, args_done, args_str; /* arguments: a string literal (JSON text in a string) */
    size_t args_start, args_end;
    bool done, bad;
} call_scan;

static bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

static void value_ended(call_scan *s, const char *b, size_t end) {
    if (s->key == K_NAME && !s->name_end && b[s->val_start] == '"') {
        s->name_start = s->val_start;
        s->name_end = end;
    }
    if (s->key == K_ARGS && s->has_args && s->args_start == s->val_start && !s->args_done) {
        s->args_end = end;
        s->args_done = true;
    }
    s->phase = P_AFTER;
}

static int key_kind(const char *k, size_t n) {
    if (n == 4 && !memcmp(k, "name", 4)) return K_NAME;
    if ((n == 9 && !memcmp(k, "arguments", 9)) || (n == 10 && !memcmp(k, "parameters", 10))) return K_ARGS;
    return K_OTHER;
}

static void value_begins(call_scan *s, const char *b, size_t i) {
    s->val_start = i;
    s->phase = P_IN_VALUE;
    s->scalar = false;
    if (b[i] == '"') s->in_str = true;
    else if (b[i] == '{' || b[i] == '[') s->depth = 2;
    else s->scalar = true;
    if (s->key == K_ARGS && !s->has_args) {
        s->has_args = true;
        s->args_start = i;
        s->args_str = b[i] == '"';
    }
}

static void scan(call_scan *s, const char *b, size_t i) {
    char ch = b[i];
    if (s->in_str) {
        if (s->esc) s->esc = false;
        else if (ch == '\\') s->esc = true;
        else if (ch == '"') {
            s->in_str = false;
            if (s->depth == 1 && s->phase == P_IN_KEY) {
                s->key = key_kind(b + s->key_start + 1, i - s->key_start - 1);
                s->phase = P_COLON;
            } else if (s->depth == 1) {
                value_ended(s, b, i + 1);
            }
        }
        return;
    }
    if (s->depth == 1 && s->phase == P_IN_VALUE && s->scalar) {
        if (ch != ',' && ch != '}' && !is_ws(ch)) return;
        value_ended(s, b, i);
    }
    if (is_ws(ch)) return;
    if (s->depth == 0) {
        if (ch == '{') s->depth = 1, s->phase = P_KEY;
        else s->bad = true;
        return;
    }
    if (s->depth == 1) {
        if (s->phase == P_KEY && ch == '"') {
            s->in_str = true, s->phase = P_IN_KEY, s->key_start = i, s->any_key = true;
        } else if ((s->phase == P_AFTER || (s->phase == P_KEY && !s->any_key)) && ch == '}') {
            s->depth = 0, s->done = true;
        } else if (s->phase == P_AFTER && ch == ',') {
            s->phase = P_KEY;
        } else if (s->phase == P_COLON && ch == ':') {
            s->phase = P_VALUE;
        } else if (s->phase == P_VALUE) {
            value_begins(s, b, i);
        } else {
            s->bad = true;
        }
        return;
    }
    if (ch == '"') s->in_str = true;
    else if (ch == '{' || ch == '[') s->depth++;
    else if ((ch == '}' || ch == ']') && --s->depth == 1) value_ended(s, b, i + 1);
}

/* ---- the parser ----------------------------------------------------------------- */
enum { S_LEAD, S_TEXT, S_PLAIN, S_TAG, S_OPEN, S_CALL, S_CLOSE, S_PY };

struct kvs_tool_parser {
    kvs_tool_format format;
    uint64_t seed;
    int state, n_calls;
    const char *open_tag, *close_tag; /* close_tag NULL: llama3_json */
    size_t tag_n;                     /* bytes of the tag matched (TAG, CLOSE) */
    sbuf ws;                          /* LEAD / CLOSE: white space held */
    sbuf raw;                         /* OPEN, CALL, PY: the tag and white space before the call */
    sbuf call;                        /* CALL: the object; PY: the call's text */
    call_scan scan;
    bool whole;                       /* a whole output: a call goes out once its JSON is complete and valid */
    bool emitted;                     /* CALL: the call's first event went out */
    size_t args_sent;
    bool nomem;
    kvs_tool_events *out;
};

static bool llama(const kvs_tool_parser *p) { return p->format == KVS_TOOL_FORMAT_LLAMA3_JSON; }

kvs_tool_parser *kvs_tool_parser_create(kvs_tool_format f, uint64_t id_seed) {
    kvs_tool_parser *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->format = f;
    p->seed = id_seed;
    p->state = f == KVS_TOOL_FORMAT_NONE ? S_PLAIN : S_LEAD;
    p->open_tag = f == KVS_TOOL_FORMAT_HERMES ? "<tool_call>" : "<|python_tag|>";
    p->close_tag = f == KVS_TOOL_FORMAT_HERMES ? "</tool_call>" : NULL;
    return p;
}

void kvs_tool_parser_destroy(kvs_tool_parser *p) {
    if (!p) return;
    free(p->ws.p);
    free(p->raw.p);
    free(p->call.p);
    free(p);
}

int kvs_tool_parser_n_calls(const kvs_tool_parser *p) { return p ? p->n_calls : 0; }

static void content(kvs_tool_parser *p, const char *s, size_t n) {
    if (!emit(p->out, -1, NULL, NULL, s, n)) p->nomem = true;
}

static void put(kvs_tool_parser *p, sbuf *b, const char *s, size_t n) {
    if (!append(&b->p, &b->n, s, n)) p->nomem = true;
}

static void call_id(const kvs_tool_parser *p, int index, char id[32]) {
    uint64_t h[2];
    for (int k = 0; k < 2; k++) { /* splitmix64 of the seed, the index and the half */
        uint64_t z = p->seed + 0x9E3779B97F4A7C15ull * (uint64_t)(2 * index + k + 1);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        h[k] = z ^ (z >> 31);
    }
    snprintf(id, 32, "call_%016llx%08llx", (unsigned long long)h[0], (unsigned long long)(h[1] >> 32));
}

/* The call's first event: its id, name and the first arguments text. */
static void call_begins(kvs_tool_parser *p, const char *name, const char *args, size_t n) {
    char id[32];
    call_id(p, p->n_calls, id);
    if (!emit(p->out, p->n_calls, id, name, args, n)) p->nomem = true;
    p->emitted = true;
    p->ws.n = 0; /* white space before a call is dropped */
}

static void step(kvs_tool_parser *p, char ch);

/* Bytes to feed again in the current state. */
static void refeed(kvs_tool_parser *p, const char *s, size_t n) {
    char tmp[32];
    memcpy(tmp, s, n);
    for (size_t i = 0; i < n; i++) step(p, tmp[i]);
}

/* The decoded name (malloc'ed) of the scanned call; NULL when it is not a non-empty string. */
static char *call_name(const kvs_tool_parser *p) {
    const call_scan *s = &p->scan;
    if (!s->name_end) return NULL;
    json_t *j = json_loadb(p->call.p + s->name_start, s->name_end - s->name_start, JSON_DECODE_ANY, NULL);
    char *name = json_is_string(j) && json_string_length(j) > 0 ? strdup(json_string_value(j)) : NULL;
    json_decref(j);
    return name;
}

/* Arguments given as a string hold JSON text: that text is the arguments. */
static void string_args(kvs_tool_parser *p, sbuf *out) {
    const call_scan *s = &p->scan;
    json_t *j = json_loadb(p->call.p + s->args_start, s->args_end - s->args_start, JSON_DECODE_ANY, NULL);
    if (json_is_string(j)) put(p, out, json_string_value(j), json_string_length(j));
    json_decref(j);
}

/* After each byte of a call: its first event once its name is known and its
 * arguments have begun, then each new piece of the arguments. */
static void call_progress(kvs_tool_parser *p) {
    call_scan *s = &p->scan;
    if (p->whole && !s->done) return;
    bool container = s->has_args && !s->args_str && (p->call.p[s->args_start] == '{' || p->call.p[s->args_start] == '[');
    size_t avail = container ? (s->args_done ? s->args_end : p->call.n) : s->args_done ? s->args_end : s->args_start;
    if (!p->emitted) {
        if (!s->name_end || !s->has_args || (!container && !s->args_done)) return;
        char *name = call_name(p);
        if (!name) return;
        if (s->args_str) {
            sbuf a = {0};
            string_args(p, &a);
            call_begins(p, name, a.p ? a.p : "", a.n);
            free(a.p);
        } else {
            call_begins(p, name, p->call.p + s->args_start, avail - s->args_start);
        }
        free(name);
        p->args_sent = avail;
        return;
    }
    if (container && avail > p->args_sent) {
        if (!emit(p->out, p->n_calls, NULL, NULL, p->call.p + p->args_sent, avail - p->args_sent)) p->nomem = true;
        p->args_sent = avail;
    }
}

static void reset_call(kvs_tool_parser *p) {
    p->raw.n = p->call.n = 0;
    memset(&p->scan, 0, sizeof p->scan);
    p->emitted = false;
    p->args_sent = 0;
}

/* Not a call after all: its text is content, and so is what follows (llama3_json). */
static void not_a_call(kvs_tool_parser *p) {
    content(p, p->ws.p, p->ws.n);
    p->ws.n = 0;
    content(p, p->raw.p, p->raw.n);
    content(p, p->call.p, p->call.n);
    reset_call(p);
    p->state = S_TEXT;
}

static void call_ends(kvs_tool_parser *p) {
    if (p->whole && !p->emitted) {
        json_t *j = p->scan.done ? json_loadb(p->call.p, p->call.n, 0, NULL) : NULL;
        if (!j) {
            not_a_call(p);
            return;
        }
        json_decref(j);
    }
    if (!p->emitted && p->scan.done) call_progress(p);
    if (!p->emitted) { /* a call without arguments: {"name": "f"} */
        char *name = p->scan.done && !p->scan.has_args ? call_name(p) : NULL;
        if (!name) { not_a_call(p); return; }
        call_begins(p, name, "{}", 2);
        free(name);
    }
    p->n_calls++;
    reset_call(p);
    p->ws.n = 0;
    p->tag_n = 0;
    p->state = p->close_tag ? S_CLOSE : S_LEAD;
}

static void call_byte(kvs_tool_parser *p, char ch) {
    put(p, &p->call, &ch, 1);
    if (p->nomem) return;
    scan(&p->scan, p->call.p, p->call.n - 1);
    if (p->scan.bad) {
        if (!p->emitted) { not_a_call(p); return; }
        p->call.n--; /* the call as it stands; the byte is read again after it */
        call_ends(p);
        step(p, ch);
        return;
    }
    if (p->scan.done) call_ends(p);
    else call_progress(p);
}

/* A partial opening tag that is not one: its first byte is content, the rest is read again. */
static void tag_mismatch(kvs_tool_parser *p, char ch) {
    char part[32];
    size_t n = p->tag_n;
    memcpy(part, p->open_tag, n);
    content(p, p->ws.p, p->ws.n);
    p->ws.n = 0;
    content(p, part, 1);
    p->tag_n = 0;
    p->state = S_TEXT;
    refeed(p, part + 1, n - 1);
    step(p, ch);
}

/* A byte of text (LEAD's white space held before it): a tag or a call may begin, else content. */
static void text_byte(kvs_tool_parser *p, char ch) {
    if (ch == p->open_tag[0]) {
        p->state = S_TAG;
        p->tag_n = 1;
    } else if (llama(p) && ch == '{') {
        p->state = S_CALL;
        call_byte(p, ch);
    } else {
        content(p, p->ws.p, p->ws.n);
        p->ws.n = 0;
        p->state = S_TEXT;
        content(p, &ch, 1);
    }
}

static void step(kvs_tool_parser *p, char ch) {
    switch (p->state) {
    case S_LEAD:
        if (is_ws(ch) || (ch == ';' && llama(p) && p->n_calls > 0)) put(p, &p->ws, &ch, 1);
        else text_byte(p, ch);
        return;
    case S_TEXT:
        text_byte(p, ch);
        return;
    case S_PLAIN:
        content(p, &ch, 1);
        return;
    case S_TAG:
        if (ch != p->open_tag[p->tag_n]) { tag_mismatch(p, ch); return; }
        if (p->open_tag[++p->tag_n]) return;
        put(p, &p->raw, p->open_tag, p->tag_n);
        p->tag_n = 0;
        p->state = S_OPEN;
        return;
    case S_OPEN:
        if (is_ws(ch)) { put(p, &p->raw, &ch, 1); return; }
        if (ch == '{') {
            p->state = S_CALL;
            call_byte(p, ch);
            return;
        }
        if (llama(p)) {
            p->state = S_PY;
            put(p, &p->call, &ch, 1);
            return;
        }
        content(p, p->ws.p, p->ws.n);
        content(p, p->raw.p, p->raw.n);
        p->ws.n = p->raw.n = 0;
        p->state = S_TEXT;
        step(p, ch);
        return;
    case S_CALL:
        call_byte(p, ch);
        return;
    case S_CLOSE:
        if (p->tag_n == 0 && is_ws(ch)) { put(p, &p->ws, &ch, 1); return; }
        if (ch == p->close_tag[p->tag_n]) {
            if (p->close_tag[++p->tag_n]) return;
            p->tag_n = 0;
            p->ws.n = 0;
            p->state = S_LEAD;
            return;
        } else { /* no closing tag: read it as what follows a call */
            size_t n = p->tag_n;
            p->tag_n = 0;
            p->state = S_LEAD;
            refeed(p, p->close_tag, n);
            step(p, ch);
            return;
        }
    case S_PY:
        put(p, &p->call, &ch, 1);
        return;
    }
}

/* ---- feeding --------------------------------------------------------------------- */
kvs_status kvs_tool_parser_feed(kvs_tool_parser *p, const char *text, size_t n, kvs_tool_events *out) {
    p->out = out;
    for (size_t i = 0; i < n && !p->nomem; i++) step(p, text[i]);
    return p->nomem ? kvs_fail(KVS_ERR_NOMEM, "tool-call parser: out of memory") : KVS_OK;
}

kvs_status kvs_tool_parser_finish(kvs_tool_parser *p, kvs_tool_events *out) {
    p->out = out;
    char *name = NULL, *args = NULL;
    switch (p->state) {
    case S_LEAD:
        if (p->n_calls == 0) content(p, p->ws.p, p->ws.n);
        break;
    case S_TAG:
        content(p, p->ws.p, p->ws.n);
        content(p, p->open_tag, p->tag_n);
        break;
    case S_OPEN:
        content(p, p->ws.p, p->ws.n);
        content(p, p->raw.p, p->raw.n);
        break;
    case S_CALL: /* cut short (max_tokens): a call begun stays; else its text is content */
        if (p->emitted) call_ends(p);
        else not_a_call(p);
        break;
    case S_PY:
        if (kvs_tool_python_call(p->call.p, p->call.n, &name, &args)) {
            call_begins(p, name, args, strlen(args));
            p->n_calls++;
        } else {
            not_a_call(p);
        }
        free(name);
        free(args);
        break;
    default: break;
    }
    reset_call(p);
    p->ws.n = 0;
    p->tag_n = 0;
    p->state = S_PLAIN;
    return p->nomem ? kvs_fail(KVS_ERR_NOMEM, "tool-call parser: out of memory") : KVS_OK;
}

/* ---- whole outputs ----------------------------------------------------------------- */

kvs_status kvs_tool_result_add(kvs_tool_result *r, const kvs_tool_events *e) {
    for (int i = 0; i < e->n; i++) {
        const kvs_tool_event *ev = &e->v[i];
        kvs_tool_events *calls = &r->calls;
        bool ok = ev->call < 0 ? append(&r->content, &r->content_len, ev->text, ev->len)
                  : ev->id || calls->n ? emit(calls, ev->call, ev->id, ev->name, ev->text, ev->len)
                                       : true; /* a fragment of no call: never given */
        if (!ok) return kvs_fail(KVS_ERR_NOMEM, "tool calls: out of memory");
    }
    return KVS_OK;
}

kvs_status kvs_tool_parse_text(kvs_tool_format f, uint64_t id_seed, const char *text, size_t n, kvs_tool_result *r) {
    memset(r, 0, sizeof *r);
    kvs_tool_parser *p = kvs_tool_parser_create(f, id_seed);
    if (!p) return kvs_fail(KVS_ERR_NOMEM, "tool calls: out of memory");
    p->whole = true;
    kvs_tool_events ev = {0};
    kvs_status st = kvs_tool_parser_feed(p, text, n, &ev);
    if (st == KVS_OK) st = kvs_tool_parser_finish(p, &ev);
    if (st == KVS_OK) st = kvs_tool_result_add(r, &ev);
    if (st == KVS_OK && !r->content) st = append(&r->content, &r->content_len, "", 0) ? KVS_OK : KVS_ERR_NOMEM;
    kvs_tool_events_free(&ev);
    kvs_tool_parser_destroy(p);
    if (st != KVS_OK) kvs_tool_result_free(r);
    return st;
}

void kvs_tool_result_free(kvs_tool_result *r) {
    kvs_tool_events_free(&r->calls);
    free(r->content);
    memset(r, 0, sizeof *r);
}
