/* The raw bytes a token id decodes to on its own, for constrained decoding
 * (grammar/): byte-level BPE undoes the byte-to-unicode map; SentencePiece-style
 * vocabularies give U+2581 as a space and <0xNN> as the byte; special tokens
 * and unknown ids give no bytes; other added tokens give their content. No
 * decoder step that depends on a token's place in the text (Strip of a
 * leading space, Metaspace's prepend) is applied. */
#include <string.h>

#include "tokenizer/tokenizer_internal.h"

static bool has_bytelevel(const tk_decoder *d) {
    if (!d) return false;
    if (d->type == TK_DEC_BYTELEVEL) return true;
    for (int i = 0; i < d->n_children; i++)
        if (has_bytelevel(d->children[i])) return true;
    return false;
}

static int hex_digit(char c) {
    const char *digits = "0123456789ABCDEF", *at = c ? strchr(digits, c >= 'a' ? c - 32 : c) : NULL;
    return at ? (int)(at - digits) : -1;
}

/* s[0..n) byte-level: every code point back to its byte; false if one is not in the map. */
static bool unmap_bytelevel(const char *s, size_t n, char *out, size_t *len) {
    size_t o = 0;
    for (size_t k = 0; k < n;) {
        uint32_t cp;
        int cl = tk_utf8_seq_len((const uint8_t *)s + k, n - k);
        if (cl == 0) return false;
        tk_utf8_decode(s + k, &cp);
        int b = tk_byte_map_inverse(cp);
        if (b < 0) return false;
        out[o++] = (char)b;
        k += (size_t)cl;
    }
    *len = o;
    return true;
}

static size_t unmap_sentencepiece(const char *s, size_t n, char *out) {
    int hi, lo;
    if (n == 6 && !memcmp(s, "<0x", 3) && s[5] == '>' && (hi = hex_digit(s[3])) >= 0 && (lo = hex_digit(s[4])) >= 0) {
        out[0] = (char)(hi * 16 + lo);
        return 1;
    }
    size_t o = 0;
    for (size_t k = 0; k < n;) {
        if (n - k >= 3 && !memcmp(s + k, "\xE2\x96\x81", 3)) {
            out[o++] = ' ';
            k += 3;
        } else {
            out[o++] = s[k++];
        }
    }
    return o;
}

kvs_status kvs_tokenizer_token_bytes(const kvs_tokenizer *t, int id, char *buf, size_t cap, size_t *len) {
    *len = 0;
    if (!t) return kvs_fail(KVS_ERR_INVALID, "tokenizer token bytes: NULL tokenizer");
    size_t n;
    const char *s = tk_token_text(t, id, &n);
    if (!s || t->special[id]) return KVS_OK;
    if (cap < n) {
        *len = n;
        return kvs_fail(KVS_ERR_INVALID, "tokenizer token bytes: token %d needs a buffer of %zu bytes, not %zu", id, n, cap);
    }
    if (tk_added_by_id(&t->added, id)) {
        memcpy(buf, s, n);
        *len = n;
    } else if (has_bytelevel(t->decoder)) {
        if (!unmap_bytelevel(s, n, buf, len)) {
            memcpy(buf, s, n);
            *len = n;
        }
    } else {
        *len = unmap_sentencepiece(s, n, buf);
    }
    return KVS_OK;
}
