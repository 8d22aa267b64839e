/* A SentencePiece vocabulary (a GGUF file's tokenizer.ggml.model "llama":
 * pieces and their scores, no merges) as byte-pair merges: SentencePiece's
 * BPE joins the adjacent pair whose joined piece scores highest, so every
 * split of a piece into two pieces of the vocabulary is a merge ranked by the
 * piece's score. Ordered as Hugging Face's converter (SentencePieceExtractor)
 * orders them, which its tokenizer.json files hold: score (highest first),
 * then the piece's id, then the ids of its left and right halves. */
#include "gguf/gguf.h"
#include "tokenizer/tokenizer_internal.h"

#include <stdlib.h>
#include <string.h>

/* Longer pieces (none in a real vocabulary: SentencePiece's are at most 16
 * characters by default) are left out of the merges. */
#define SPM_MAX_PIECE 1024

typedef struct {
    float score;
    int32_t piece, left, right;
    uint32_t split; /* bytes of the left half */
} merge;

static int by_rank(const void *a, const void *b) {
    const merge *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    if (x->piece != y->piece) return x->piece < y->piece ? -1 : 1;
    if (x->left != y->left) return x->left < y->left ? -1 : 1;
    return (x->right > y->right) - (x->right < y->right);
}

/* The id of s[0..n) in vocab (-1 when it is none). */
static int32_t id_of(json_t *vocab, const char *s, size_t n, char *buf) {
    memcpy(buf, s, n);
    buf[n] = 0;
    json_t *v = json_object_get(vocab, buf);
    return v ? (int32_t)json_integer_value(v) : -1;
}

static kvs_status nomem(void) { return kvs_fail(KVS_ERR_NOMEM, "tokenizer: out of memory deriving SentencePiece merges"); }

kvs_status tk_gguf_spm_merges(const kvs_gguf *g, const kvs_gguf_kv *tokens, json_t *vocab, json_t *merges) {
    const kvs_gguf_kv *scores;
    KVS_TRY(kvs_gguf_get_array(g, "tokenizer.ggml.scores", KVS_GGUF_F32, false, &scores));
    if (scores && scores->count != tokens->count)
        return kvs_fail(KVS_ERR_FORMAT, "%s: tokenizer.ggml.scores has %llu entries for %llu tokens", g->file_name,
                        (unsigned long long)scores->count, (unsigned long long)tokens->count);
    size_t longest = 0, n = 0, cap = 0;
    for (uint64_t i = 0; i < tokens->count; i++)
        if (tokens->strs[i].len > longest && tokens->strs[i].len <= SPM_MAX_PIECE) longest = tokens->strs[i].len;
    char *buf = malloc(longest + 2); /* a piece and a NUL, or a merge's two halves and their space */
    merge *all = NULL;
    kvs_status s = buf ? KVS_OK : nomem();
    for (uint64_t i = 0; s == KVS_OK && i < tokens->count; i++) {
        kvs_gguf_str p = tokens->strs[i];
        float score = -(float)i; /* no scores: by id, as the converter orders them */
        if (scores) memcpy(&score, scores->data + 4 * i, 4);
        if (p.len > SPM_MAX_PIECE) continue; /* no merge makes it: its splits would cost O(len^2) */
        for (size_t k = 1; k < p.len; k++) {
            if (((uint8_t)p.s[k] & 0xC0) == 0x80) continue; /* split between characters only */
            int32_t l = id_of(vocab, p.s, k, buf), r = l < 0 ? -1 : id_of(vocab, p.s + k, p.len - k, buf);
            if (l < 0 || r < 0) continue;
            if (n == cap) {
                cap = cap ? 2 * cap : 4096;
                merge *grown = realloc(all, cap * sizeof *all);
                if (!grown) {
                    s = nomem();
                    break;
                }
                all = grown;
            }
            all[n++] = (merge){score, (int32_t)i, l, r, (uint32_t)k};
        }
    }
    if (s == KVS_OK && n) qsort(all, n, sizeof *all, by_rank);
    for (size_t i = 0; s == KVS_OK && i < n; i++) { /* "left right" */
        kvs_gguf_str p = tokens->strs[all[i].piece];
        memcpy(buf, p.s, all[i].split);
        buf[all[i].split] = ' ';
        memcpy(buf + all[i].split + 1, p.s + all[i].split, p.len - all[i].split);
        if (json_array_append_new(merges, json_stringn_nocheck(buf, p.len + 1))) s = nomem();
    }
    free(all);
    free(buf);
    return s;
}
