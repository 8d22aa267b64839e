/* server: chat messages -> prompt token ids, without letting user text become
 * control tokens. The template is rendered with a marker in place of each
 * message's content; the template's own text is then encoded with special
 * tokens parsed (it writes <|start_header_id|> and the like), each content
 * with parse_special = false. The marker is padded on each side with a byte
 * that Python's strip() removes but no template writes (0x1f), so a template
 * that trims or strips contents (Llama 3's `| trim`, Llama 2's `.strip()`,
 * a strip of a joined string) is seen to do so, side by side, and the content
 * is stripped the same way. A content that is only whitespace holds no control
 * token text and is passed to the template as it is. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/server.h"

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

kvs_status kvs_api_chat_encode(const kvs_tokenizer *tok, const kvs_chat_template *tpl, const kvs_chat_message *msgs,
                               int n_msgs, int32_t **ids_out, int *n_out) {
    kvs_chat_message *marked = calloc(n_msgs > 0 ? n_msgs : 1, sizeof *marked);
    char (*marks)[32] = calloc(n_msgs > 0 ? n_msgs : 1, 32);
    if (!marked || !marks) {
        free(marked);
        free(marks);
        return kvs_fail(KVS_ERR_NOMEM, "out of memory");
    }
    for (int i = 0; i < n_msgs; i++) {
        size_t start, len;
        kvs_chat_template_strip(msgs[i].content, strlen(msgs[i].content), true, true, &start, &len);
        snprintf(marks[i], 32, "%c%cM%d%c%c", MARK_PAD, MARK_OPEN, i, MARK_CLOSE, MARK_PAD);
        marked[i].role = msgs[i].role;
        /* whitespace (or nothing) is given as it is: a template may test it for
           emptiness, and a strip of a joined string strips through it */
        marked[i].content = len ? marks[i] : msgs[i].content;
    }
    char *text = NULL;
    kvs_status st = kvs_chat_template_render(tpl, marked, n_msgs, true, kvs_tokenizer_bos_token(tok),
                                             kvs_tokenizer_eos_token(tok), &text);
    free(marked);
    free(marks);
    if (st != KVS_OK) return st;
    id_buf b = {0};
    const char *p = text, *seg = text;
    while (st == KVS_OK && *p) {
        int idx = -1, used = 0;
        if (*p == MARK_OPEN && marker_index(p + 1, &idx, &used) && p[1 + used] == MARK_CLOSE && idx < n_msgs) {
            /* a pad that is gone: the template stripped the content on that side */
            bool pad_left = p > seg && p[-1] == MARK_PAD, pad_right = p[2 + used] == MARK_PAD;
            const char *end = p + 2 + used + pad_right;
            st = append(&b, tok, seg, (size_t)(p - pad_left - seg), true);
            const char *c = msgs[idx].content;
            size_t start, len;
            kvs_chat_template_strip(c, strlen(c), !pad_left, !pad_right, &start, &len);
            if (st == KVS_OK) st = append(&b, tok, c + start, len, false);
            p = seg = end;
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
