/* tokenizer pre-tokenizers: Sequence, Split (PCRE2 regex or literal, the split
 * behaviours and invert), ByteLevel (prefix space, GPT-2 regex, byte <-> unicode map),
 * Metaspace, Digits, Whitespace, WhitespaceSplit, Punctuation. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tokenizer_internal.h"

static const char gpt2_regex[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
static const char ws_class[] =
    "[\\t-\\r \\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}]+";
static const char punct_class[] = "[\\p{P}!-/:-@\\[-`{-~]";

/* ---- GPT-2 byte map ---------------------------------------------------------------- */
static bool byte_is_self(int b) {
    return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

void tk_byte_map_init(tk_byte_map *m) {
    int n = 0;
    for (int b = 0; b < 256; b++) {
        uint32_t cp = byte_is_self(b) ? (uint32_t)b : 256u + (uint32_t)n++;
        m->len[b] = (uint8_t)tk_utf8_encode(cp, m->utf8[b]);
    }
}

int tk_byte_map_inverse(uint32_t cp) {
    if (cp < 256) return byte_is_self((int)cp) ? (int)cp : -1;
    uint32_t n = cp - 256;
    if (n <= 32) return (int)n;             /* 0x00..0x20 */
    if (n <= 66) return 0x7F + (int)(n - 33); /* 0x7F..0xA0 */
    if (n == 67) return 0xAD;
    return -1;
}

/* ---- parsing --------------------------------------------------------------------------- */
void tk_pretok_free(tk_pretok *p) {
    if (!p) return;
    for (int i = 0; i < p->n_children; i++) tk_pretok_free(p->children[i]);
    free(p->children);
    free(p->bmap);
    if (p->re) pcre2_code_free(p->re);
    free(p);
}

static kvs_status parse_behavior(json_t *j, const char *where, tk_split_behavior dflt,
                                 tk_split_behavior *out) {
    const char *b;
    KVS_TRY(tk_json_string(j, "behavior", where, false, &b, NULL));
    *out = dflt;
    if (!b) return KVS_OK;
    static const char *names[] = {"Removed", "Isolated", "MergedWithPrevious", "MergedWithNext",
                                  "Contiguous"};
    for (int i = 0; i < 5; i++)
        if (!strcmp(b, names[i])) {
            *out = (tk_split_behavior)i;
            return KVS_OK;
        }
    return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s.behavior '%s' is not a split behavior", where, b);
}

static kvs_status parse_split(json_t *j, const char *where, tk_pretok *p) {
    json_t *pat = json_object_get(j, "pattern");
    char w[256];
    if (!json_is_object(pat))
        return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s.pattern must be an object", where);
    json_t *s = json_object_get(pat, "String"), *r = json_object_get(pat, "Regex");
    if (json_is_string(s)) {
        snprintf(w, sizeof w, "%s.pattern.String", where);
        if (json_string_length(s) == 0)
            return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s is empty", w);
        KVS_TRY(tk_regex_compile(json_string_value(s), json_string_length(s), true, w, &p->re));
    } else if (json_is_string(r)) {
        snprintf(w, sizeof w, "%s.pattern.Regex", where);
        KVS_TRY(tk_regex_compile(json_string_value(r), json_string_length(r), false, w, &p->re));
    } else {
        return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s.pattern needs a String or Regex string", where);
    }
    KVS_TRY(parse_behavior(j, where, TK_SPLIT_ISOLATED, &p->behavior));
    return tk_json_bool(j, "invert", where, false, &p->invert);
}

static kvs_status parse_metaspace(json_t *j, const char *where, tk_pretok *p) {
    const char *r, *scheme;
    size_t rl;
    KVS_TRY(tk_json_string(j, "replacement", where, false, &r, &rl));
    if (!r) r = "\xE2\x96\x81", rl = 3;
    if (rl == 0 || rl > 4 || tk_utf8_seq_len((const uint8_t *)r, rl) != (int)rl)
        return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s.replacement must be one character", where);
    memcpy(p->repl, r, rl);
    p->repl_len = rl;
    KVS_TRY(tk_json_bool(j, "split", where, true, &p->split));
    KVS_TRY(tk_json_string(j, "prepend_scheme", where, false, &scheme, NULL));
    bool add_prefix;
    KVS_TRY(tk_json_bool(j, "add_prefix_space", where, true, &add_prefix));
    p->prepend = add_prefix ? TK_PREPEND_ALWAYS : TK_PREPEND_NEVER;
    if (scheme) {
        if (!strcmp(scheme, "always")) p->prepend = TK_PREPEND_ALWAYS;
        else if (!strcmp(scheme, "first")) p->prepend = TK_PREPEND_FIRST;
        else if (!strcmp(scheme, "never")) p->prepend = TK_PREPEND_NEVER;
        else return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s.prepend_scheme '%s' is unknown", where, scheme);
    }
    return tk_regex_compile(p->repl, p->repl_len, true, where, &p->re);
}

kvs_status tk_pretok_parse(json_t *j, const char *where, tk_pretok **out) {
    *out = NULL;
    if (!json_is_object(j)) return kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s must be an object", where);
    const char *type;
    KVS_TRY(tk_json_string(j, "type", where, true, &type, NULL));
    tk_pretok *p = calloc(1, sizeof *p);
    if (!p) return kvs_fail(KVS_ERR_NOMEM, "tokenizer.json: %s: out of memory", where);
    kvs_status st = KVS_OK;
    char w[256];
    if (!strcmp(type, "Sequence")) {
        p->type = TK_PRE_SEQUENCE;
        json_t *arr = json_object_get(j, "pretokenizers");
        if (!json_is_array(arr)) {
            st = kvs_fail(KVS_ERR_FORMAT, "tokenizer.json: %s.pretokenizers must be an array", where);
        } else if (!(p->children = calloc(json_array_size(arr) + 1, sizeof *p->children))) {
            st = kvs_fail(KVS_ERR_NOMEM, "tokenizer.json: %s: out of memory", where);
        } else {
            for (size_t i = 0; st == KVS_OK && i < json_array_size(arr); i++) {
                snprintf(w, sizeof w, "%s.pretokenizers[%zu]", where, i);
                st = tk_pretok_parse(json_array_get(arr, i), w, &p->children[i]);
                if (st == KVS_OK) p->n_children++;
            }
        }
    } else if (!strcmp(type, "Split")) {
        p->type = TK_PRE_SPLIT;
        st = parse_split(j, where, p);
    } else if (!strcmp(type, "ByteLevel")) {
        p->type = TK_PRE_BYTELEVEL;
        st = tk_json_bool(j, "add_prefix_space", where, true, &p->add_prefix_space);
        if (st == KVS_OK) st = tk_json_bool(j, "use_regex", where, true, &p->use_regex);
        if (st == KVS_OK && p->use_regex) st = tk_regex_compile(gpt2_regex, sizeof gpt2_regex - 1, false, where, &p->re);
        if (st == KVS_OK && !(p->bmap = malloc(sizeof *p->bmap)))
            st = kvs_fail(KVS_ERR_NOMEM, "tokenizer.json: %s: out of memory", where);
        if (st == KVS_OK) tk_byte_map_init(p->bmap);
        p->behavior = TK_SPLIT_ISOLATED;
    } else if (!strcmp(type, "Metaspace")) {
        p->type = TK_PRE_METASPACE;
        st = parse_metaspace(j, where, p);
        p->behavior = TK_SPLIT_MERGED_NEXT;
    } else if (!strcmp(type, "Digits")) {
        p->type = TK_PRE_DIGITS;
        bool individual;
        st = tk_json_bool(j, "individual_digits", where, false, &individual);
        if (st == KVS_OK) st = tk_regex_compile(individual ? "\\p{N}" : "\\p{N}+", individual ? 5 : 6, false, where, &p->re);
        p->behavior = TK_SPLIT_ISOLATED;
    } else if (!strcmp(type, "Whitespace")) {
        p->type = TK_PRE_WHITESPACE;
        st = tk_regex_compile("\\w+|[^\\w\\s]+", 13, false, where, &p->re);
        p->behavior = TK_SPLIT_REMOVED;
        p->invert = true;
    } else if (!strcmp(type, "WhitespaceSplit")) {
        p->type = TK_PRE_WHITESPACE_SPLIT;
        st = tk_regex_compile(ws_class, sizeof ws_class - 1, false, where, &p->re);
        p->behavior = TK_SPLIT_REMOVED;
    } else if (!strcmp(type, "Punctuation")) {
        p->type = TK_PRE_PUNCTUATION;
        st = tk_regex_compile(punct_class, sizeof punct_class - 1, false, where, &p->re);
        if (st == KVS_OK) st = parse_behavior(j, where, TK_SPLIT_ISOLATED, &p->behavior);
    } else {
        st = kvs_fail(KVS_ERR_UNSUPPORTED, "tokenizer.json: %s.type '%s' is not a supported pre-tokenizer",
                      where, type);
    }
    if (st != KVS_OK) {
        tk_pretok_free(p);
        return st;
    }
    *out = p;
    return KVS_OK;
}

/* ---- running ------------------------------------------------------------------------------- */
kvs_status tk_pre_chain_build(const tk_pretok *root, tk_pre_chain *out) {
    if (!root) return KVS_OK;
    if (root->type == TK_PRE_SEQUENCE) {
        for (int i = 0; i < root->n_children; i++) KVS_TRY(tk_pre_chain_build(root->children[i], out));
        return KVS_OK;
    }
    if (out->n_stages == TK_MAX_STAGES)
        return kvs_fail(KVS_ERR_UNSUPPORTED, "tokenizer.json: pre_tokenizer has more than %d steps", TK_MAX_STAGES);
    out->stage[out->n_stages++] = root;
    return KVS_OK;
}

static kvs_status run_from(const tk_pre_chain *c, tk_pre_run *r, int k, const char *s, size_t n, bool first);
static kvs_status bytelevel_map_run(const tk_pre_chain *c, tk_pre_run *r, int k, const char *s, size_t n, bool first);

/* Streams the segments of a split through the behaviour, one merged piece at a time.
 * A segment is [a, b) with a match flag; pending holds what may still grow. */
typedef struct {
    const tk_pre_chain *c;
    tk_pre_run *r;
    int k;
    const char *s;
    bool first;
    tk_split_behavior behavior;
    bool map_bytes; /* ByteLevel: map each piece's bytes before the next stage */
    bool has_pending, prev_match;
    size_t pa, pb;
} splitter;

static kvs_status out_piece(splitter *sp, size_t a, size_t b) {
    if (b <= a) return KVS_OK;
    if (sp->map_bytes) return bytelevel_map_run(sp->c, sp->r, sp->k, sp->s + a, b - a, sp->first && a == 0);
    return run_from(sp->c, sp->r, sp->k + 1, sp->s + a, b - a, sp->first && a == 0);
}

static kvs_status flush(splitter *sp) {
    if (!sp->has_pending) return KVS_OK;
    sp->has_pending = false;
    return out_piece(sp, sp->pa, sp->pb);
}

static kvs_status segment(splitter *sp, size_t a, size_t b, bool match) {
    kvs_status st = KVS_OK;
    switch (sp->behavior) {
    case TK_SPLIT_REMOVED:
        if (!match) st = out_piece(sp, a, b);
        break;
    case TK_SPLIT_ISOLATED: st = out_piece(sp, a, b); break;
    case TK_SPLIT_MERGED_PREV: /* a match joins the non-match before it */
        if (match && !sp->prev_match && sp->has_pending) {
            sp->pb = b;
        } else {
            st = flush(sp);
            sp->has_pending = true, sp->pa = a, sp->pb = b;
        }
        break;
    case TK_SPLIT_CONTIGUOUS: /* runs of matches / non-matches */
        if (sp->has_pending && match == sp->prev_match) {
            sp->pb = b;
        } else {
            st = flush(sp);
            sp->has_pending = true, sp->pa = a, sp->pb = b;
        }
        break;
    case TK_SPLIT_MERGED_NEXT: /* a match joins the non-match right after it */
        if (match) {
            st = flush(sp);
            sp->has_pending = true, sp->pa = a, sp->pb = b;
        } else if (sp->has_pending) {
            sp->has_pending = false;
            st = out_piece(sp, sp->pa, b);
        } else {
            st = out_piece(sp, a, b);
        }
        break;
    }
    sp->prev_match = match;
    return st;
}

static kvs_status split_run(const tk_pre_chain *c, tk_pre_run *r, int k, const pcre2_code *re,
                            tk_split_behavior behavior, bool invert, const char *s, size_t n, bool first) {
    splitter sp = {.c = c, .r = r, .k = k, .s = s, .first = first, .behavior = behavior,
                   .map_bytes = c->stage[k]->type == TK_PRE_BYTELEVEL};
    size_t prev = 0, pos = 0, ms, me;
    int found;
    while (pos <= n && (found = tk_regex_next(re, r->md, s, n, pos, &ms, &me)) != 0) {
        if (found < 0) return KVS_ERR_UNSUPPORTED; /* message already set */
        if (ms > prev) KVS_TRY(segment(&sp, prev, ms, invert));
        KVS_TRY(segment(&sp, ms, me, !invert));
        prev = me;
        if (me == ms) { /* empty match: step over one character */
            if (me >= n) break;
            uint32_t cp;
            pos = me + (size_t)tk_utf8_decode(s + me, &cp);
        } else {
            pos = me;
        }
    }
    if (prev < n) KVS_TRY(segment(&sp, prev, n, invert));
    return flush(&sp);
}

static kvs_status oom(void) { return kvs_fail(KVS_ERR_NOMEM, "tokenizer: out of memory pre-tokenizing"); }

static kvs_status bytelevel_map_run(const tk_pre_chain *c, tk_pre_run *r, int k, const char *s, size_t n, bool first) {
    const tk_pretok *pt = c->stage[k];
    tk_buf *b = &r->scratch[k][1];
    b->len = 0;
    if (!tk_buf_reserve(b, n * 2)) return oom();
    char *dst = b->data;
    size_t o = 0;
    for (size_t j = 0; j < n; j++) {
        uint8_t x = (uint8_t)s[j];
        dst[o] = pt->bmap->utf8[x][0];
        dst[o + 1] = pt->bmap->utf8[x][1];
        o += pt->bmap->len[x];
    }
    b->len = o;
    return run_from(c, r, k + 1, b->data, o, first);
}

static kvs_status bytelevel_run(const tk_pre_chain *c, tk_pre_run *r, int k, const char *s, size_t n, bool first) {
    const tk_pretok *pt = c->stage[k];
    if (pt->add_prefix_space && s[0] != ' ') {
        tk_buf *b = &r->scratch[k][0];
        b->len = 0;
        if (!tk_buf_append(b, " ", 1) || !tk_buf_append(b, s, n)) return oom();
        s = b->data;
        n = b->len;
    }
    if (pt->use_regex) return split_run(c, r, k, pt->re, TK_SPLIT_ISOLATED, false, s, n, first);
    return bytelevel_map_run(c, r, k, s, n, first);
}

static kvs_status metaspace_run(const tk_pre_chain *c, tk_pre_run *r, int k, const char *s, size_t n, bool first) {
    const tk_pretok *pt = c->stage[k];
    tk_buf *b = &r->scratch[k][0];
    b->len = 0;
    bool starts = (n >= pt->repl_len && memcmp(s, pt->repl, pt->repl_len) == 0) || (n > 0 && s[0] == ' ');
    if (!starts && (pt->prepend == TK_PREPEND_ALWAYS || (pt->prepend == TK_PREPEND_FIRST && first)))
        if (!tk_buf_append(b, pt->repl, pt->repl_len)) return oom();
    if (!tk_buf_reserve(b, n * pt->repl_len)) return oom();
    for (size_t i = 0; i < n; i++) {
        if (s[i] == ' ') {
            memcpy(b->data + b->len, pt->repl, pt->repl_len);
            b->len += pt->repl_len;
        } else {
            b->data[b->len++] = s[i];
        }
    }
    if (pt->split) return split_run(c, r, k, pt->re, TK_SPLIT_MERGED_NEXT, false, b->data, b->len, first);
    return run_from(c, r, k + 1, b->data, b->len, first);
}

static kvs_status run_from(const tk_pre_chain *c, tk_pre_run *r, int k, const char *s, size_t n, bool first) {
    if (n == 0) return KVS_OK;
    if (k == c->n_stages) return r->sink(r->sink_ctx, s, n);
    const tk_pretok *pt = c->stage[k];
    switch (pt->type) {
    case TK_PRE_BYTELEVEL: return bytelevel_run(c, r, k, s, n, first);
    case TK_PRE_METASPACE: return metaspace_run(c, r, k, s, n, first);
    default: return split_run(c, r, k, pt->re, pt->behavior, pt->invert, s, n, first);
    }
}

kvs_status tk_pretokenize(const tk_pre_chain *chain, tk_pre_run *run, const char *s, size_t n, bool first) {
    return run_from(chain, run, 0, s, n, first);
}
