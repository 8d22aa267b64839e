/* tokenizer helpers: byte buffers, hash maps, UTF-8, JSON field access, regex. */
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tokenizer_internal.h"

/* ---- buffers ---------------------------------------------------------------------- */
char *tk_strndup(const char *s, size_t n) {
    char *d = malloc(n + 1);
    if (d) {
        memcpy(d, s, n);
        d[n] = 0;
    }
    return d;
}

bool tk_buf_reserve(tk_buf *b, size_t extra) {
    if (b->len + extra + 1 <= b->cap) return true;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < b->len + extra + 1) cap *= 2;
    char *d = realloc(b->data, cap);
    if (!d) return false;
    b->data = d;
    b->cap = cap;
    return true;
}

bool tk_buf_append(tk_buf *b, const void *p, size_t n) {
    if (!tk_buf_reserve(b, n)) return false;
    if (n) memcpy(b->data + b->len, p, n);
    b->len += n;
    b->data[b->len] = 0;
    return true;
}

void tk_buf_free(tk_buf *b) {
    free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
}

/* ---- hashing ---------------------------------------------------------------------- */
uint64_t tk_hash(const void *p, size_t n) {
    const uint8_t *s = p;
    uint64_t h = 0x9e3779b97f4a7c15ull ^ (n * 0xff51afd7ed558ccdull);
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, s, 8);
        h = (h ^ (w * 0xc4ceb9fe1a85ec53ull)) * 0x100000001b3ull;
        h ^= h >> 29;
        s += 8;
        n -= 8;
    }
    uint64_t w = 0;
    for (size_t i = 0; i < n; i++) w |= (uint64_t)s[i] << (8 * i);
    h = (h ^ (w * 0xc4ceb9fe1a85ec53ull)) * 0x100000001b3ull;
    h ^= h >> 32;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return h;
}

static size_t pow2_for(size_t expected) {
    size_t cap = 16;
    while (cap < expected * 2 + 2) cap *= 2;
    return cap;
}

bool tk_strmap_init(tk_strmap *m, size_t expected) {
    m->cap = pow2_for(expected);
    m->n = 0;
    m->slots = calloc(m->cap, sizeof *m->slots);
    return m->slots != NULL;
}

static bool strmap_grow(tk_strmap *m) {
    tk_strmap bigger;
    if (!tk_strmap_init(&bigger, m->cap)) return false;
    for (size_t i = 0; i < m->cap; i++)
        if (m->slots[i].key) tk_strmap_put(&bigger, m->slots[i].key, m->slots[i].len, m->slots[i].value);
    free(m->slots);
    *m = bigger;
    return true;
}

bool tk_strmap_put(tk_strmap *m, const char *key, size_t len, int32_t value) {
    if ((m->n + 1) * 2 > m->cap && !strmap_grow(m)) return false;
    size_t mask = m->cap - 1, i = tk_hash(key, len) & mask;
    for (;; i = (i + 1) & mask) {
        tk_strmap_slot *s = &m->slots[i];
        if (!s->key) {
            s->key = key;
            s->len = (uint32_t)len;
            s->value = value;
            m->n++;
            return true;
        }
        if (s->len == len && memcmp(s->key, key, len) == 0) {
            s->value = value;
            return true;
        }
    }
}

int32_t tk_strmap_get(const tk_strmap *m, const char *key, size_t len) {
    if (!m->slots) return -1;
    size_t mask = m->cap - 1, i = tk_hash(key, len) & mask;
    for (;; i = (i + 1) & mask) {
        const tk_strmap_slot *s = &m->slots[i];
        if (!s->key) return -1;
        if (s->len == len && memcmp(s->key, key, len) == 0) return s->value;
    }
}

void tk_strmap_free(tk_strmap *m) {
    free(m->slots);
    memset(m, 0, sizeof *m);
}

static size_t pair_hash(uint64_t k) { /* murmur3 fmix64 */
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ull;
    k ^= k >> 33;
    return (size_t)k;
}

bool tk_pairmap_init(tk_pairmap *m, size_t expected) {
    m->cap = pow2_for(expected);
    m->n = 0;
    m->slots = calloc(m->cap, sizeof *m->slots);
    return m->slots != NULL;
}

bool tk_pairmap_put(tk_pairmap *m, int32_t a, int32_t b, int32_t rank, int32_t merged) {
    if ((m->n + 1) * 2 > m->cap) {
        tk_pairmap bigger;
        if (!tk_pairmap_init(&bigger, m->cap)) return false;
        for (size_t i = 0; i < m->cap; i++) {
            tk_pair_slot *s = &m->slots[i];
            if (s->key) {
                uint64_t k = s->key - 1;
                tk_pairmap_put(&bigger, (int32_t)(k >> 32), (int32_t)(uint32_t)k, s->rank, s->merged);
            }
        }
        free(m->slots);
        *m = bigger;
    }
    uint64_t key = (((uint64_t)(uint32_t)a << 32) | (uint32_t)b) + 1;
    size_t mask = m->cap - 1, i = pair_hash(key) & mask;
    for (;; i = (i + 1) & mask) {
        tk_pair_slot *s = &m->slots[i];
        if (!s->key) {
            s->key = key;
            s->rank = rank;
            s->merged = merged;
            m->n++;
            return true;
        }
        if (s->key == key) return true; /* keep the first (lowest) rank */
    }
}

const tk_pair_slot *tk_pairmap_get(const tk_pairmap *m, int32_t a, int32_t b) {
    if (!m->slots) return NULL;
    uint64_t key = (((uint64_t)(uint32_t)a << 32) | (uint32_t)b) + 1;
    size_t mask = m->cap - 1, i = pair_hash(key) & mask;
    for (;; i = (i + 1) & mask) {
        const tk_pair_slot *s = &m->slots[i];
        if (!s->key) return NULL;
        if (s->key == key) return s;
    }
}

void tk_pairmap_free(tk_pairmap *m) {
    free(m->slots);
    memset(m, 0, sizeof *m);
}

/* ---- UTF-8 -------------------------------------------------------------------------- */
/* Number of bytes of a (possibly truncated) valid prefix at p: for lossy decoding.
 * Returns the full length if valid, or -k where k >= 1 is the maximal invalid subpart. */
static int utf8_check(const uint8_t *p, size_t n) {
    uint8_t c = p[0];
    if (c < 0x80) return 1;
    int need;
    uint8_t lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) need = 1;
    else if (c == 0xE0) need = 2, lo = 0xA0;
    else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) need = 2;
    else if (c == 0xED) need = 2, hi = 0x9F;
    else if (c == 0xF0) need = 3, lo = 0x90;
    else if (c >= 0xF1 && c <= 0xF3) need = 3;
    else if (c == 0xF4) need = 3, hi = 0x8F;
    else return -1;
    for (int i = 1; i <= need; i++) {
        if ((size_t)i >= n) return -i;
        uint8_t b = p[i];
        if (b < lo || b > hi) return -i;
        lo = 0x80, hi = 0xBF;
    }
    return need + 1;
}

int tk_utf8_seq_len(const uint8_t *p, size_t n) {
    if (n == 0) return 0;
    int k = utf8_check(p, n);
    return k > 0 ? k : 0;
}

size_t tk_utf8_validate(const char *s, size_t n) {
    const uint8_t *p = (const uint8_t *)s;
    size_t i = 0;
    while (i < n) {
        if (p[i] < 0x80) {
            i++;
            continue;
        }
        int k = utf8_check(p + i, n - i);
        if (k <= 0) return i;
        i += (size_t)k;
    }
    return n;
}

int tk_utf8_decode(const char *s, uint32_t *cp) {
    const uint8_t *p = (const uint8_t *)s;
    if (p[0] < 0x80) { *cp = p[0]; return 1; }
    if (p[0] < 0xE0) { *cp = ((uint32_t)(p[0] & 0x1F) << 6) | (p[1] & 0x3F); return 2; }
    if (p[0] < 0xF0) {
        *cp = ((uint32_t)(p[0] & 0x0F) << 12) | ((uint32_t)(p[1] & 0x3F) << 6) | (p[2] & 0x3F);
        return 3;
    }
    *cp = ((uint32_t)(p[0] & 0x07) << 18) | ((uint32_t)(p[1] & 0x3F) << 12) |
          ((uint32_t)(p[2] & 0x3F) << 6) | (p[3] & 0x3F);
    return 4;
}

int tk_utf8_encode(uint32_t cp, char *out) {
    uint8_t *o = (uint8_t *)out;
    if (cp < 0x80) { o[0] = (uint8_t)cp; return 1; }
    if (cp < 0x800) { o[0] = (uint8_t)(0xC0 | (cp >> 6)); o[1] = (uint8_t)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        o[0] = (uint8_t)(0xE0 | (cp >> 12));
        o[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (uint8_t)(0xF0 | (cp >> 18));
    o[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

bool tk_buf_append_lossy(tk_buf *out, const char *s, size_t n) {
    const uint8_t *p = (const uint8_t *)s;
    size_t i = 0, run = 0;
    if (!tk_buf_reserve(out, n)) return false;
    while (i < n) {
        int k = p[i] < 0x80 ? 1 : utf8_check(p + i, n - i);
        if (k > 0) {
            i += (size_t)k;
            continue;
        }
        if (!tk_buf_append(out, s + run, i - run) || !tk_buf_append(out, "\xEF\xBF\xBD", 3)) return false;
        i += (size_t)(-k);
        run = i;
    }
    return tk_buf_append(out, s + run, n - run);
}

bool tk_is_whitespace(uint32_t c) {
    return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
           c == 0x205F || c == 0x3000;
}

/* ---- JSON ---------------------------------------------------------------------------- */
kvs_status tk_json_string(json_t *obj, const char *key, const char *where, bool required,
                          const char **out, size_t *len) {
    json_t *v = json_object_get(obj, key);
    *out = NULL;
    if (len) *len = 0;
    if (!v || json_is_null(v)) {
        if (required) return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s.%s is missing", where, key);
        return KVS_OK;
    }
    if (!json_is_string(v))
        return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s.%s must be a string", where, key);
    *out = json_string_value(v);
    if (len) *len = json_string_length(v);
    return KVS_OK;
}

kvs_status tk_json_bool(json_t *obj, const char *key, const char *where, bool dflt, bool *out) {
    json_t *v = json_object_get(obj, key);
    *out = dflt;
    if (!v || json_is_null(v)) return KVS_OK;
    if (!json_is_boolean(v))
        return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s.%s must be a boolean", where, key);
    *out = json_is_true(v);
    return KVS_OK;
}

/* ---- regex ------------------------------------------------------------------------------ */
kvs_status tk_regex_compile(const char *pattern, size_t len, bool literal, const char *where,
                            pcre2_code **out) {
    int err;
    PCRE2_SIZE off;
    uint32_t flags = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, len, flags, &err, &off, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s: bad regex at offset %zu: %s", where,
                        (size_t)off, (const char *)msg);
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* falls back to the interpreter on failure */
    *out = re;
    return KVS_OK;
}

int tk_regex_next(const pcre2_code *re, pcre2_match_data *md, const char *s, size_t n,
                  size_t start, size_t *ms, size_t *me) {
    if (start > n) return 0;
    int rc = pcre2_match(re, (PCRE2_SPTR)s, n, start, PCRE2_NO_UTF_CHECK, md, NULL);
    if (rc == PCRE2_ERROR_NOMATCH) return 0;
    if (rc < 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof msg);
        kvs_fail(KVS_ERR_UNSUPPORTED, "tokenizer: regex failed on a %zu-byte piece: %s", n, (const char *)msg);
        return -1;
    }
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
    *ms = ov[0];
    *me = ov[1];
    return 1;
}
