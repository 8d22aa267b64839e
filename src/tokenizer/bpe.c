/* tokenizer BPE model: vocab and merges in hash tables, merging by rank with a heap
 * (as `tokenizers` does), ignore_merges, byte_fallback, unk/fuse_unk, subword
 * prefix/suffix, and a small word cache. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tokenizer_internal.h"

typedef struct {
    uint64_t hash;
    uint8_t word_len, n_ids;
    char word[TK_CACHE_MAX_WORD];
    int32_t ids[TK_CACHE_MAX_IDS];
} cache_slot;

struct tk_bpe_cache {
    pthread_mutex_t lock;
    cache_slot slots[TK_CACHE_SLOTS];
};

void tk_bpe_free(tk_bpe *m) {
    tk_strmap_free(&m->vocab);
    tk_pairmap_free(&m->merges);
    free(m->arena);
    free(m->tokens);
    free(m->token_len);
    free(m->prefix);
    free(m->suffix);
    if (m->cache) {
        pthread_mutex_destroy(&m->cache->lock);
        free(m->cache);
    }
    memset(m, 0, sizeof *m);
}

static char *dup_opt(const char *s, size_t n) {
    char *d = malloc(n + 1);
    if (d) {
        memcpy(d, s, n);
        d[n] = 0;
    }
    return d;
}

static kvs_status parse_vocab(json_t *vocab, tk_bpe *m) {
    if (!json_is_object(vocab)) return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: model.vocab must be an object");
    size_t total = 0;
    int max_id = -1;
    const char *key;
    json_t *v;
    json_object_foreach(vocab, key, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= TK_MAX_ID)
            return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: model.vocab[\"%.64s\"] must be an id in [0, %d)",
                            key, TK_MAX_ID);
        total += strlen(key) + 1;
        if (json_integer_value(v) > max_id) max_id = (int)json_integer_value(v);
    }
    m->n_tokens = max_id + 1;
    m->arena = malloc(total + 1);
    m->tokens = calloc((size_t)m->n_tokens + 1, sizeof *m->tokens);
    m->token_len = calloc((size_t)m->n_tokens + 1, sizeof *m->token_len);
    if (!m->arena || !m->tokens || !m->token_len || !tk_strmap_init(&m->vocab, json_object_size(vocab)))
        return kvs_fail(KVS_ERR_NOMEM, "tokenizer.json: out of memory for model.vocab");
    size_t off = 0;
    json_object_foreach(vocab, key, v) {
        size_t n = strlen(key); /* jansson object keys cannot hold NUL */
        char *s = m->arena + off;
        memcpy(s, key, n + 1);
        off += n + 1;
        int id = (int)json_integer_value(v);
        m->tokens[id] = s;
        m->token_len[id] = (uint32_t)n;
        if (!tk_strmap_put(&m->vocab, s, n, id))
            return kvs_fail(KVS_ERR_NOMEM, "tokenizer.json: out of memory for model.vocab");
    }
    return KVS_OK;
}

static kvs_status parse_merges(json_t *merges, tk_bpe *m) {
    if (!merges || json_is_null(merges)) merges = NULL;
    else if (!json_is_array(merges)) return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: model.merges must be an array");
    size_t n = merges ? json_array_size(merges) : 0;
    if (!tk_pairmap_init(&m->merges, n)) return kvs_fail(KVS_ERR_NOMEM, "tokenizer.json: out of memory for model.merges");
    tk_buf tmp = {0};
    kvs_status st = KVS_OK;
    for (size_t i = 0; i < n && st == KVS_OK; i++) {
        json_t *e = json_array_get(merges, i);
        const char *a, *b;
        size_t al, bl;
        if (json_is_string(e)) {
            a = json_string_value(e);
            const char *sp = memchr(a, ' ', json_string_length(e));
            if (!sp || memchr(sp + 1, ' ', json_string_length(e) - (size_t)(sp + 1 - a))) {
                st = kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: model.merges[%zu] must be \"a b\" with one space", i);
                break;
            }
            al = (size_t)(sp - a);
            b = sp + 1;
            bl = json_string_length(e) - al - 1;
        } else if (json_is_array(e) && json_array_size(e) == 2 && json_is_string(json_array_get(e, 0)) &&
                   json_is_string(json_array_get(e, 1))) {
            a = json_string_value(json_array_get(e, 0));
            al = json_string_length(json_array_get(e, 0));
            b = json_string_value(json_array_get(e, 1));
            bl = json_string_length(json_array_get(e, 1));
        } else {
            st = kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: model.merges[%zu] must be a string or a pair of strings", i);
            break;
        }
        int32_t ia = tk_strmap_get(&m->vocab, a, al), ib = tk_strmap_get(&m->vocab, b, bl);
        size_t skip = m->prefix && bl >= m->prefix_len && !memcmp(b, m->prefix, m->prefix_len) ? m->prefix_len : 0;
        tmp.len = 0;
        if (!tk_buf_append(&tmp, a, al) || !tk_buf_append(&tmp, b + skip, bl - skip)) {
            st = kvs_fail(KVS_ERR_NOMEM, "tokenizer.json: out of memory for model.merges");
            break;
        }
        int32_t im = tk_strmap_get(&m->vocab, tmp.data, tmp.len);
        if (ia < 0 || ib < 0 || im < 0) {
            st = kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: model.merges[%zu]: token \"%.64s\" is not in model.vocab",
                          i, ia < 0 ? a : ib < 0 ? b : tmp.data);
            break;
        }
        if (!tk_pairmap_put(&m->merges, ia, ib, (int32_t)i, im))
            st = kvs_fail(KVS_ERR_NOMEM, "tokenizer.json: out of memory for model.merges");
    }
    tk_buf_free(&tmp);
    return st;
}

#define SP_SPACE "\xE2\x96\x81"

/* SentencePiece-style vocabularies (no pre-tokenizer: the whole text is one word) are
 * merged much faster cut into words before each U+2581 that follows another character.
 * That gives the same tokens when no token could span such a cut: U+2581 is a token and
 * no token has U+2581 right after a different character. */
static bool check_sp_split(const tk_bpe *m) {
    if (m->prefix || m->suffix || tk_strmap_get(&m->vocab, SP_SPACE, 3) < 0) return false;
    for (int id = 0; id < m->n_tokens; id++) {
        const char *s = m->tokens[id];
        if (!s) continue;
        for (const char *p = strstr(s, SP_SPACE); p; p = strstr(p + 3, SP_SPACE))
            if (p > s && !(p - s >= 3 && !memcmp(p - 3, SP_SPACE, 3))) return false;
    }
    return true;
}

kvs_status tk_bpe_parse(json_t *model, tk_bpe *m) {
    memset(m, 0, sizeof *m);
    m->unk_id = -1;
    if (!json_is_object(model)) return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: model must be an object");
    const char *type, *unk, *prefix, *suffix;
    size_t prefix_len, suffix_len;
    KVS_TRY(tk_json_string(model, "type", "model", false, &type, NULL));
    if (!type && !json_object_get(model, "merges"))
        return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: model.type is missing");
    if (type && strcmp(type, "BPE"))
        return kvs_fail(KVS_ERR_UNSUPPORTED, "tokenizer.json: model.type '%s' is not supported (only BPE)", type);
    KVS_TRY(tk_json_string(model, "unk_token", "model", false, &unk, NULL));
    KVS_TRY(tk_json_string(model, "continuing_subword_prefix", "model", false, &prefix, &prefix_len));
    KVS_TRY(tk_json_string(model, "end_of_word_suffix", "model", false, &suffix, &suffix_len));
    KVS_TRY(tk_json_bool(model, "fuse_unk", "model", false, &m->fuse_unk));
    KVS_TRY(tk_json_bool(model, "byte_fallback", "model", false, &m->byte_fallback));
    KVS_TRY(tk_json_bool(model, "ignore_merges", "model", false, &m->ignore_merges));
    json_t *dropout = json_object_get(model, "dropout");
    if (dropout && !json_is_null(dropout) && !json_is_number(dropout))
        return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: model.dropout must be a number or null");
    if (prefix && prefix_len) {
        m->prefix = dup_opt(prefix, prefix_len);
        m->prefix_len = prefix_len;
    }
    if (suffix && suffix_len) {
        m->suffix = dup_opt(suffix, suffix_len);
        m->suffix_len = suffix_len;
    }
    if ((prefix_len && !m->prefix) || (suffix_len && !m->suffix))
        return kvs_fail(KVS_ERR_NOMEM, "tokenizer.json: out of memory");
    KVS_TRY(parse_vocab(json_object_get(model, "vocab"), m));
    KVS_TRY(parse_merges(json_object_get(model, "merges"), m));
    if (unk) {
        m->unk_id = tk_strmap_get(&m->vocab, unk, strlen(unk));
        if (m->unk_id < 0)
            return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: model.unk_token \"%.64s\" is not in model.vocab", unk);
    }
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b);
        m->byte_ids[b] = tk_strmap_get(&m->vocab, name, 6);
    }
    m->sp_split = check_sp_split(m);
    m->cache = calloc(1, sizeof *m->cache);
    if (!m->cache) return kvs_fail(KVS_ERR_NOMEM, "tokenizer.json: out of memory for the BPE cache");
    if (pthread_mutex_init(&m->cache->lock, NULL) != 0) {
        free(m->cache);
        m->cache = NULL;
    }
    return KVS_OK;
}

/* ---- encoding one word ------------------------------------------------------------- */
typedef struct {
    int32_t id;
    int prev, next;
    bool dead;
} symbol;
typedef struct {
    int32_t rank, pos, merged;
} merge_item;

static bool item_less(merge_item x, merge_item y) {
    return x.rank != y.rank ? x.rank < y.rank : x.pos < y.pos;
}

static void heap_push(merge_item *h, int *n, merge_item it) {
    int i = (*n)++;
    while (i > 0) {
        int p = (i - 1) / 2;
        if (!item_less(it, h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = it;
}

static merge_item heap_pop(merge_item *h, int *n) {
    merge_item top = h[0], last = h[--(*n)];
    int i = 0;
    for (;;) {
        int c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && item_less(h[c + 1], h[c])) c++;
        if (!item_less(h[c], last)) break;
        h[i] = h[c];
        i = c;
    }
    if (*n > 0) h[i] = last;
    return top;
}

static bool push_id(int32_t **ids, int *n, int *cap, int32_t id) {
    if (*n == *cap) {
        int c = *cap ? *cap * 2 : 64;
        int32_t *v = realloc(*ids, (size_t)c * sizeof *v);
        if (!v) return false;
        *ids = v;
        *cap = c;
    }
    (*ids)[(*n)++] = id;
    return true;
}

static void try_pair(const tk_bpe *m, const symbol *sym, int pos, merge_item *heap, int *nh) {
    int nx = sym[pos].next;
    if (nx < 0) return;
    const tk_pair_slot *p = tk_pairmap_get(&m->merges, sym[pos].id, sym[nx].id);
    if (p) heap_push(heap, nh, (merge_item){p->rank, pos, p->merged});
}

/* Builds the initial symbols (characters; byte fallback; unk) and merges them. */
static kvs_status merge_word(const tk_bpe *m, const char *w, size_t n, int32_t **ids, int *n_ids, int *cap) {
    /* symbols: one per byte (byte fallback, prefix/suffix bytes included) plus a pending unk;
     * the heap gets the initial pairs plus two per merge */
    size_t max_sym = n * (1 + m->prefix_len) + m->suffix_len + 2;
    symbol local_sym[64];
    merge_item local_heap[192];
    symbol *sym = max_sym <= 64 ? local_sym : malloc(max_sym * sizeof *sym);
    merge_item *heap = max_sym <= 64 ? local_heap : malloc(3 * max_sym * sizeof *heap);
    char local_tmp[256];
    char *tmp = local_tmp;
    size_t tmp_cap = sizeof local_tmp;
    kvs_status st = KVS_OK;
    if (!sym || !heap) goto nomem;
    int ns = 0, nh = 0;
    int32_t unk_pending = -1;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t cl = (size_t)tk_utf8_decode(w + i, &cp);
        if (i + cl > n) cl = n - i;
        size_t need = cl + m->prefix_len + m->suffix_len, tl = 0;
        if (need > tmp_cap) {
            char *t = malloc(need);
            if (!t) goto nomem;
            if (tmp != local_tmp) free(tmp);
            tmp = t;
            tmp_cap = need;
        }
        if (i > 0 && m->prefix) memcpy(tmp, m->prefix, m->prefix_len), tl = m->prefix_len;
        memcpy(tmp + tl, w + i, cl), tl += cl;
        if (i + cl == n && m->suffix) memcpy(tmp + tl, m->suffix, m->suffix_len), tl += m->suffix_len;
        int32_t id = tk_strmap_get(&m->vocab, tmp, tl);
        if (id >= 0) {
            if (unk_pending >= 0) sym[ns++] = (symbol){unk_pending, 0, 0, false}, unk_pending = -1;
            sym[ns++] = (symbol){id, 0, 0, false};
        } else {
            bool done = false;
            if (m->byte_fallback) {
                bool all = true;
                for (size_t k = 0; k < tl; k++) all = all && m->byte_ids[(uint8_t)tmp[k]] >= 0;
                if (all) {
                    for (size_t k = 0; k < tl; k++) sym[ns++] = (symbol){m->byte_ids[(uint8_t)tmp[k]], 0, 0, false};
                    done = true;
                }
            }
            if (!done && m->unk_id >= 0) {
                if (unk_pending >= 0 && !m->fuse_unk) sym[ns++] = (symbol){unk_pending, 0, 0, false};
                unk_pending = m->unk_id;
            }
        }
        i += cl;
    }
    if (unk_pending >= 0) sym[ns++] = (symbol){unk_pending, 0, 0, false};
    for (int i = 0; i < ns; i++) {
        sym[i].prev = i - 1;
        sym[i].next = i + 1 < ns ? i + 1 : -1;
    }
    for (int i = 0; i + 1 < ns; i++) try_pair(m, sym, i, heap, &nh);
    while (nh > 0) {
        merge_item top = heap_pop(heap, &nh);
        symbol *s = &sym[top.pos];
        if (s->dead || s->next < 0) continue;
        const tk_pair_slot *p = tk_pairmap_get(&m->merges, s->id, sym[s->next].id);
        if (!p || p->merged != top.merged) continue;
        symbol *r = &sym[s->next];
        s->id = top.merged;
        r->dead = true;
        s->next = r->next;
        if (r->next >= 0) sym[r->next].prev = top.pos;
        if (s->prev >= 0) try_pair(m, sym, s->prev, heap, &nh);
        try_pair(m, sym, top.pos, heap, &nh);
    }
    for (int i = 0; i < ns; i++)
        if (!sym[i].dead && !push_id(ids, n_ids, cap, sym[i].id)) goto nomem;
    goto done;
nomem:
    st = kvs_fail(KVS_ERR_NOMEM, "tokenizer: out of memory in BPE");
done:
    if (sym != local_sym) free(sym);
    if (heap != local_heap) free(heap);
    if (tmp != local_tmp) free(tmp);
    return st;
}

static kvs_status encode_one(const tk_bpe *m, const char *w, size_t n, int32_t **ids, int *n_ids, int *cap);

kvs_status tk_bpe_encode_word(const tk_bpe *m, const char *w, size_t n, int32_t **ids, int *n_ids,
                              int *cap) {
    if (!m->sp_split || n <= 3) return encode_one(m, w, n, ids, n_ids, cap);
    size_t start = 0;
    for (size_t i = 3; i + 3 <= n; i++) {
        if (memcmp(w + i, SP_SPACE, 3) || !memcmp(w + i - 3, SP_SPACE, 3)) continue;
        KVS_TRY(encode_one(m, w + start, i - start, ids, n_ids, cap));
        start = i;
    }
    return encode_one(m, w + start, n - start, ids, n_ids, cap);
}

static kvs_status encode_one(const tk_bpe *m, const char *w, size_t n, int32_t **ids, int *n_ids, int *cap) {
    if (n == 0) return KVS_OK;
    if (m->ignore_merges) {
        int32_t id = tk_strmap_get(&m->vocab, w, n);
        if (id >= 0) {
            if (!push_id(ids, n_ids, cap, id)) return kvs_fail(KVS_ERR_NOMEM, "tokenizer: out of memory in BPE");
            return KVS_OK;
        }
    }
    struct tk_bpe_cache *c = n <= TK_CACHE_MAX_WORD ? m->cache : NULL;
    uint64_t h = 0;
    cache_slot *slot = NULL;
    if (c) {
        h = tk_hash(w, n);
        slot = &c->slots[h & (TK_CACHE_SLOTS - 1)];
        int32_t found[TK_CACHE_MAX_IDS];
        int nf = -1;
        pthread_mutex_lock(&c->lock);
        if (slot->hash == h && slot->word_len == n && slot->n_ids > 0 && !memcmp(slot->word, w, n)) {
            nf = slot->n_ids;
            memcpy(found, slot->ids, (size_t)nf * sizeof *found);
        }
        pthread_mutex_unlock(&c->lock);
        for (int i = 0; i < nf; i++)
            if (!push_id(ids, n_ids, cap, found[i])) return kvs_fail(KVS_ERR_NOMEM, "tokenizer: out of memory in BPE");
        if (nf >= 0) return KVS_OK;
    }
    int start = *n_ids;
    KVS_TRY(merge_word(m, w, n, ids, n_ids, cap));
    int got = *n_ids - start;
    if (c && got > 0 && got <= TK_CACHE_MAX_IDS) {
        pthread_mutex_lock(&c->lock);
        slot->hash = h;
        slot->word_len = (uint8_t)n;
        slot->n_ids = (uint8_t)got;
        memcpy(slot->word, w, n);
        memcpy(slot->ids, *ids + start, (size_t)got * sizeof *slot->ids);
        pthread_mutex_unlock(&c->lock);
    }
    return KVS_OK;
}
