/* server: chat messages -> prompt token ids, without letting user text become
 * control tokens. The template is rendered with a marker in place of each
 * message's content; the template's own text is then encoded with special
 * tokens parsed (it writes <|start_header_id|> and the like), each content
 * with parse_special = false. The marker is padded with spaces so a template
 * that trims contents (Llama 3's `| trim`) is seen to do so, and the content
 * is trimmed the same way. */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/server.h"

#define MARK_OPEN '\x02'
#define MARK_CLOSE '\x03'

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

/* Content with the surrounding whitespace removed (what Jinja's trim does). */
static void trimmed(const char *s, size_t *start, size_t *len) {
    size_t a = 0, b = strlen(s);
    while (a < b && isspace((unsigned char)s[a])) a++;
    while (b > a && isspace((unsigned char)s[b - 1])) b--;
    *start = a;
    *len = b - a;
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
        snprintf(marks[i], 32, " %cM%d%c ", MARK_OPEN, i, MARK_CLOSE);
        marked[i].role = msgs[i].role;
        marked[i].content = marks[i];
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
        if (*p == MARK_OPEN && sscanf(p + 1, "M%d%n", &idx, &used) == 1 && p[1 + used] == MARK_CLOSE && idx >= 0 &&
            idx < n_msgs) {
            /* padded on both sides: the template kept the content as is */
            bool padded = p > seg && p[-1] == ' ' && p[2 + used] == ' ';
            const char *end = p + 2 + used;
            const char *tpl_end = padded ? p - 1 : p;
            st = append(&b, tok, seg, (size_t)(tpl_end - seg), true);
            const char *c = msgs[idx].content;
            size_t start = 0, len = strlen(c);
            if (!padded) trimmed(c, &start, &len);
            if (st == KVS_OK) st = append(&b, tok, c + start, len, false);
            p = seg = padded ? end + 1 : end;
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
