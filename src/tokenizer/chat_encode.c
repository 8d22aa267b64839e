/* tokenizer: chat messages -> prompt token ids, without letting user text become
 * control tokens. The template is rendered with a marker in place of each
 * message's content; the template's own text is then encoded with special
 * tokens parsed (it writes <|start_header_id|> and the like), each content
 * with parse_special = false. The marker is padded on each side with a byte
 * that Python's strip() removes but no template writes (0x1f), so a template
 * that trims or strips contents (Llama 3's `| trim`, Llama 2's `.strip()`,
 * a strip of a joined string) is seen to do so, side by side, and the content
 * is stripped the same way. A template that writes a content with tojson
 * (Llama 3.1's tool results) writes the marker JSON-escaped: the content is
 * then escaped the same way. A content that is only whitespace holds no
 * control token text and is passed to the template as it is. The tools and
 * a message's tool_calls, tool_call_id and name are structured text the
 * template takes apart: they are refused when a string in them holds the
 * text of a special token (it would become that control token). */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tokenizer.h"

#define MARK_OPEN '\x02'
#define MARK_CLOSE '\x03'
#define MARK_PAD '\x1f'

typedef struct {
    int32_t *ids;
    int n, cap;
} id_buf;

static kvs_status append(id_buf *b, const kvs_tokenizer *tok, const char *text, size_t len, bool special) {
    if (len == 0) return KVS_OK;
    int32_t *ids = NULL;
    int n = 0;
    kvs_encode_options eo = {.add_special_tokens = false, .parse_special = special};
    KVS_TRY(kvs_tokenizer_encode(tok, text, len, eo, &ids, &n));
    if (n == 0) { /* text the vocabulary has no tokens for */
        free(ids);
        return KVS_OK;
    }
    if (b->n + n > b->cap) {
        int cap = (b->n + n) * 2 + 64;
        int32_t *p = realloc(b->ids, sizeof(int32_t) * cap);
        if (!p) {
            free(ids);
            return kvs_fail(KVS_ERR_NOMEM, "out of memory");
        }
        b->ids = p;
        b->cap = cap;
    }
    memcpy(b->ids + b->n, ids, sizeof(int32_t) * n);
    b->n += n;
    free(ids);
    return KVS_OK;
}

/* "M<digits>" at p: the message index and the length read. */
static bool marker_index(const char *p, int *idx, int *used) {
    if (p[0] != 'M' || p[1] < '0' || p[1] > '9') return false;
    int v = 0, k = 1;
    for (; p[k] >= '0' && p[k] <= '9'; k++) {
        if (k > 9) return false;
        v = v * 10 + (p[k] - '0');
    }
    *idx = v;
    *used = k;
    return true;
}

typedef struct {
    int idx;                  /* the message */
    const char *begin, *end;  /* the marker and the pads still there */
    bool strip_left, strip_right, json;
} marker;

/* A marker at p, plain or as tojson writes it (control bytes as \u00XX), with its pads. */
static bool match_marker(const char *p, const char *seg, int n_msgs, marker *m) {
    static const char open_j[] = "\\u0002", close_j[] = "\\u0003", pad_j[] = "\\u001f";
    const size_t nj = sizeof open_j - 1;
    int used = 0;
    m->json = *p != MARK_OPEN;
    if (!m->json) {
        if (!marker_index(p + 1, &m->idx, &used) || p[1 + used] != MARK_CLOSE) return false;
    } else if (strncmp(p, open_j, nj) || !marker_index(p + nj, &m->idx, &used) || strncmp(p + nj + used, close_j, nj)) {
        return false;
    }
    if (m->idx >= n_msgs) return false;
    size_t n_open = m->json ? nj : 1, n_pad = m->json ? nj : 1;
    const char *after = p + 2 * n_open + used;
    bool pad_left = m->json ? (size_t)(p - seg) >= nj && !strncmp(p - nj, pad_j, nj) : p > seg && p[-1] == MARK_PAD;
    bool pad_right = m->json ? !strncmp(after, pad_j, nj) : *after == MARK_PAD;
    /* a pad that is gone: the template stripped the content on that side */
    m->strip_left = !pad_left;
    m->strip_right = !pad_right;
    m->begin = pad_left ? p - n_pad : p;
    m->end = pad_right ? after + n_pad : after;
    return true;
}

/* s as the templates' tojson writes a string, without the quotes (json.dumps, ensure_ascii=False). */
static char *json_escaped(const char *s, size_t n, size_t *out_len) {
    char *o = malloc(n * 6 + 1), *q = o;
    if (!o) return NULL;
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        const char *e = ch == '"' ? "\\\"" : ch == '\\' ? "\\\\" : ch == '\n' ? "\\n" : ch == '\r' ? "\\r"
                      : ch == '\t' ? "\\t" : ch == '\b' ? "\\b" : ch == '\f' ? "\\f" : NULL;
        if (e) q += sprintf(q, "%s", e);
        else if (ch < 0x20) q += sprintf(q, "\\u%04x", ch);
        else *q++ = (char)ch;
    }
    *q = 0;
    *out_len = (size_t)(q - o);
    return o;
}

static kvs_status append_content(id_buf *b, const kvs_tokenizer *tok, const char *c, const marker *m) {
    size_t start, len;
    kvs_chat_template_strip(c, strlen(c), m->strip_left, m->strip_right, &start, &len);
    if (!m->json) return append(b, tok, c + start, len, false);
    size_t n;
    char *e = json_escaped(c + start, len, &n);
    if (!e) return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    kvs_status st = append(b, tok, e, n, false);
    free(e);
    return st;
}

/* Fails when text would encode to a special token. */
static kvs_status check_plain(const kvs_tokenizer *tok, const char *text, size_t len, const char *what) {
    int32_t *ids = NULL;
    int n = 0;
    kvs_encode_options eo = {.add_special_tokens = false, .parse_special = true};
    KVS_TRY(kvs_tokenizer_encode(tok, text, len, eo, &ids, &n));
    int bad = -1;
    for (int i = 0; i < n && bad < 0; i++)
        if (kvs_tokenizer_is_special(tok, ids[i])) bad = ids[i];
    free(ids);
    if (bad < 0) return KVS_OK;
    return kvs_fail(KVS_ERR_INVALID, "%s holds the text of the control token %s", what, kvs_tokenizer_token_text(tok, bad));
}

static kvs_status check_json_plain(const kvs_tokenizer *tok, json_t *j, const char *what) {
    if (json_is_string(j)) return check_plain(tok, json_string_value(j), json_string_length(j), what);
    const char *k;
    json_t *v;
    size_t i;
    if (json_is_object(j)) json_object_foreach(j, k, v) {
        KVS_TRY(check_plain(tok, k, strlen(k), what));
        KVS_TRY(check_json_plain(tok, v, what));
    }
    if (json_is_array(j)) json_array_foreach(j, i, v) KVS_TRY(check_json_plain(tok, v, what));
    return KVS_OK;
}

static kvs_status check_structured(const kvs_tokenizer *tok, const char *json, const char *what) {
    if (!json) return KVS_OK;
    json_t *j = json_loads(json, JSON_DECODE_ANY, NULL);
    if (!j) return kvs_fail(KVS_ERR_INVALID, "%s is not valid JSON", what);
    kvs_status st = check_json_plain(tok, j, what);
    json_decref(j);
    return st;
}

static kvs_status check_tool_fields(const kvs_tokenizer *tok, const kvs_chat_message *msgs, int n_msgs,
                                    const char *tools) {
    KVS_TRY(check_structured(tok, tools, "tools"));
    for (int i = 0; i < n_msgs; i++) {
        const kvs_chat_message *m = &msgs[i];
        KVS_TRY(check_structured(tok, m->tool_calls, "a message's tool_calls"));
        if (m->tool_call_id) KVS_TRY(check_plain(tok, m->tool_call_id, strlen(m->tool_call_id), "a message's tool_call_id"));
        if (m->name) KVS_TRY(check_plain(tok, m->name, strlen(m->name), "a message's name"));
    }
    return KVS_OK;
}

kvs_status kvs_tokenizer_encode_chat(const kvs_tokenizer *tok, const kvs_chat_template *tpl,
                                     const kvs_chat_message *msgs, int n_msgs, int32_t **ids_out, int *n_out) {
    return kvs_tokenizer_encode_chat_tools(tok, tpl, msgs, n_msgs, NULL, ids_out, n_out);
}

kvs_status kvs_tokenizer_encode_chat_tools(const kvs_tokenizer *tok, const kvs_chat_template *tpl,
                                           const kvs_chat_message *msgs, int n_msgs, const char *tools,
                                           int32_t **ids_out, int *n_out) {
    KVS_TRY(check_tool_fields(tok, msgs, n_msgs, tools));
    kvs_chat_message *marked = calloc(n_msgs > 0 ? n_msgs : 1, sizeof *marked);
    char (*marks)[32] = calloc(n_msgs > 0 ? n_msgs : 1, 32);
    if (!marked || !marks) {
        free(marked);
        free(marks);
        return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    }
    for (int i = 0; i < n_msgs; i++) {
        size_t start = 0, len = 0;
        if (msgs[i].content)
            kvs_chat_template_strip(msgs[i].content, strlen(msgs[i].content), true, true, &start, &len);
        snprintf(marks[i], 32, "%c%cM%d%c%c", MARK_PAD, MARK_OPEN, i, MARK_CLOSE, MARK_PAD);
        marked[i] = msgs[i];
        /* whitespace (or nothing) is given as it is: a template may test it for
           emptiness, and a strip of a joined string strips through it */
        marked[i].content = len ? marks[i] : msgs[i].content;
    }
    char *text = NULL;
    kvs_status st = kvs_chat_template_render_tools(tpl, marked, n_msgs, tools, true, kvs_tokenizer_bos_token(tok),
                                                   kvs_tokenizer_eos_token(tok), &text);
    free(marked);
    free(marks);
    if (st != KVS_OK) return st;
    id_buf b = {0};
    const char *p = text, *seg = text;
    while (st == KVS_OK && *p) {
        marker m;
        if ((*p == MARK_OPEN || *p == '\\') && match_marker(p, seg, n_msgs, &m) && msgs[m.idx].content) {
            st = append(&b, tok, seg, (size_t)(m.begin - seg), true);
            if (st == KVS_OK) st = append_content(&b, tok, msgs[m.idx].content, &m);
            p = seg = m.end;
        } else {
            p++;
        }
    }
    if (st == KVS_OK) st = append(&b, tok, seg, (size_t)(p - seg), true);
    free(text);
    if (st != KVS_OK) {
        free(b.ids);
        return st;
    }
    *ids_out = b.ids;
    *n_out = b.n;
    return KVS_OK;
}
