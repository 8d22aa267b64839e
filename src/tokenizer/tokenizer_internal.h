/* tokenizer internals shared by tokenizer.c, added_tokens.c, bpe.c, normalize.c,
 * pretokenize.c, decode.c, detokenizer.c and tok_util.c. Not a public header. */
#ifndef KVS_TOKENIZER_INTERNAL_H
#define KVS_TOKENIZER_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <jansson.h>
#include <pcre2.h>
#include <pthread.h>

#include "tokenizer/tokenizer.h"

/* Token ids in tokenizer.json must be below this (bounds the id tables). */
#define TK_MAX_ID (1 << 22)

/* ---- growable byte buffer (tok_util.c) --------------------------------------- */
typedef struct {
    char *data;
    size_t len, cap;
} tk_buf;
/* A NUL-terminated copy of s[0..n) (malloc'ed; NULL when out of memory). */
char *tk_strndup(const char *s, size_t n);
bool tk_buf_reserve(tk_buf *b, size_t extra);
bool tk_buf_append(tk_buf *b, const void *p, size_t n);
void tk_buf_free(tk_buf *b);

/* ---- string -> int32 hash map (open addressing; keys are not copied) --------- */
typedef struct {
    const char *key;
    uint32_t len;
    int32_t value;
} tk_strmap_slot;
typedef struct {
    tk_strmap_slot *slots;
    size_t cap, n; /* cap is a power of two */
} tk_strmap;
uint64_t tk_hash(const void *p, size_t n);
bool tk_strmap_init(tk_strmap *m, size_t expected);
bool tk_strmap_put(tk_strmap *m, const char *key, size_t len, int32_t value); /* overwrites */
int32_t tk_strmap_get(const tk_strmap *m, const char *key, size_t len);       /* -1 if none */
void tk_strmap_free(tk_strmap *m);

/* ---- (id, id) -> (rank, merged id) hash map ---------------------------------- */
typedef struct {
    uint64_t key; /* (a << 32 | b) + 1; 0 = empty */
    int32_t rank, merged;
} tk_pair_slot;
typedef struct {
    tk_pair_slot *slots;
    size_t cap, n;
} tk_pairmap;
bool tk_pairmap_init(tk_pairmap *m, size_t expected);
bool tk_pairmap_put(tk_pairmap *m, int32_t a, int32_t b, int32_t rank, int32_t merged); /* keeps first */
const tk_pair_slot *tk_pairmap_get(const tk_pairmap *m, int32_t a, int32_t b);
void tk_pairmap_free(tk_pairmap *m);

/* ---- UTF-8 -------------------------------------------------------------------- */
/* Length of the valid UTF-8 sequence at p (1..4), 0 if invalid or truncated. */
int tk_utf8_seq_len(const uint8_t *p, size_t n);
/* Byte offset of the first invalid sequence, or n if all valid. */
size_t tk_utf8_validate(const char *s, size_t n);
/* Decodes one valid sequence; returns its length. */
int tk_utf8_decode(const char *s, uint32_t *cp);
int tk_utf8_encode(uint32_t cp, char *out);
/* Appends s to out, replacing invalid sequences with U+FFFD like Rust's
 * String::from_utf8_lossy (one per maximal invalid subpart). */
bool tk_buf_append_lossy(tk_buf *out, const char *s, size_t n);
bool tk_is_whitespace(uint32_t cp); /* Rust char::is_whitespace */

/* ---- JSON helpers: errors name the field -------------------------------------- */
kvs_status tk_json_string(json_t *obj, const char *key, const char *where, bool required,
                          const char **out, size_t *len);
kvs_status tk_json_bool(json_t *obj, const char *key, const char *where, bool dflt, bool *out);

/* ---- regex (pcre2, UTF + UCP, JIT) --------------------------------------------- */
kvs_status tk_regex_compile(const char *pattern, size_t len, bool literal, const char *where,
                            pcre2_code **out);
/* Next match in s[0..n) at or after start: 1 and *ms, *me = its bounds; 0 if none;
 * -1 if the matcher failed (error message set). */
int tk_regex_next(const pcre2_code *re, pcre2_match_data *md, const char *s, size_t n,
                  size_t start, size_t *ms, size_t *me);

/* ---- normalizers (normalize.c) ------------------------------------------------- */
typedef enum {
    TK_NORM_SEQUENCE, TK_NORM_PREPEND, TK_NORM_REPLACE, TK_NORM_NFC, TK_NORM_NFD, TK_NORM_NFKC,
    TK_NORM_NFKD, TK_NORM_LOWERCASE, TK_NORM_STRIP,
} tk_norm_type;
typedef struct tk_normalizer {
    tk_norm_type type;
    char *a, *b; /* Prepend: a; Replace: pattern a (literal) or re, content b */
    size_t a_len, b_len;
    pcre2_code *re;
    bool left, right; /* Strip */
    struct tk_normalizer **children;
    int n_children;
} tk_normalizer;
kvs_status tk_normalizer_parse(json_t *j, const char *where, tk_normalizer **out);
void tk_normalizer_free(tk_normalizer *n);
/* out is cleared and filled with the normalized text. */
kvs_status tk_normalize(const tk_normalizer *n, pcre2_match_data *md, const char *s, size_t len,
                        tk_buf *out);

/* ---- pre-tokenizers (pretokenize.c) ------------------------------------------- */
typedef enum {
    TK_SPLIT_REMOVED, TK_SPLIT_ISOLATED, TK_SPLIT_MERGED_PREV, TK_SPLIT_MERGED_NEXT,
    TK_SPLIT_CONTIGUOUS,
} tk_split_behavior;
typedef enum {
    TK_PRE_SEQUENCE, TK_PRE_SPLIT, TK_PRE_BYTELEVEL, TK_PRE_METASPACE, TK_PRE_DIGITS,
    TK_PRE_WHITESPACE, TK_PRE_WHITESPACE_SPLIT, TK_PRE_PUNCTUATION,
} tk_pre_type;
typedef enum { TK_PREPEND_ALWAYS, TK_PREPEND_FIRST, TK_PREPEND_NEVER } tk_prepend_scheme;
typedef struct tk_pretok {
    tk_pre_type type;
    pcre2_code *re;
    tk_split_behavior behavior;
    bool invert;
    bool add_prefix_space, use_regex; /* ByteLevel */
    char repl[8];                     /* Metaspace replacement (UTF-8) */
    size_t repl_len;
    tk_prepend_scheme prepend;
    bool split;
    struct tk_byte_map *bmap; /* ByteLevel */
    struct tk_pretok **children;
    int n_children;
} tk_pretok;
kvs_status tk_pretok_parse(json_t *j, const char *where, tk_pretok **out);
void tk_pretok_free(tk_pretok *p);
/* The pre-tokenizer as a flat list of stages (Sequence flattened), run depth-first:
 * each piece a stage produces goes straight through the next stages to the sink. */
#define TK_MAX_STAGES 16
typedef kvs_status (*tk_piece_fn)(void *ctx, const char *s, size_t n);
typedef struct {
    const tk_pretok *stage[TK_MAX_STAGES];
    int n_stages;
} tk_pre_chain;
kvs_status tk_pre_chain_build(const tk_pretok *root, tk_pre_chain *out);
typedef struct {
    pcre2_match_data *md;
    tk_buf scratch[TK_MAX_STAGES][2]; /* per-stage rewritten text (prefix/replace, byte map) */
    tk_piece_fn sink;
    void *sink_ctx;
} tk_pre_run;
kvs_status tk_pretokenize(const tk_pre_chain *chain, tk_pre_run *run, const char *s, size_t n, bool first);
/* GPT-2 byte <-> unicode map: the UTF-8 of byte b's code point. */
typedef struct tk_byte_map {
    char utf8[256][3];
    uint8_t len[256];
} tk_byte_map;
void tk_byte_map_init(tk_byte_map *m);
/* Inverse: byte for code point cp, -1 if cp is not in the map. */
int tk_byte_map_inverse(uint32_t cp);

/* ---- BPE model (bpe.c) ---------------------------------------------------------- */
#define TK_CACHE_SLOTS 8192
#define TK_CACHE_MAX_WORD 48
#define TK_CACHE_MAX_IDS 16
typedef struct {
    tk_strmap vocab;
    char *arena;   /* all token strings, NUL-separated */
    char **tokens; /* id -> token text (NUL-terminated) or NULL */
    uint32_t *token_len;
    int n_tokens;  /* max id + 1 */
    tk_pairmap merges;
    int unk_id;
    bool fuse_unk, byte_fallback, ignore_merges;
    bool sp_split; /* no token has U+2581 after another character: words may be cut before it */
    char *prefix, *suffix; /* continuing_subword_prefix, end_of_word_suffix (NULL = none) */
    size_t prefix_len, suffix_len;
    int32_t byte_ids[256]; /* <0xXX> tokens for byte_fallback, -1 if absent */
    struct tk_bpe_cache *cache; /* mutable, behind its own lock; NULL = no cache */
} tk_bpe;
kvs_status tk_bpe_parse(json_t *model, tk_bpe *out);
void tk_bpe_free(tk_bpe *m);
/* Appends the ids of one pre-tokenized word. */
kvs_status tk_bpe_encode_word(const tk_bpe *m, const char *w, size_t n, int32_t **ids, int *n_ids,
                              int *cap);

/* ---- decoders (decode.c) --------------------------------------------------------- */
typedef enum {
    TK_DEC_SEQUENCE, TK_DEC_BYTELEVEL, TK_DEC_METASPACE, TK_DEC_BYTEFALLBACK, TK_DEC_FUSE,
    TK_DEC_STRIP, TK_DEC_REPLACE,
} tk_dec_type;
typedef struct tk_decoder {
    tk_dec_type type;
    char *a, *b; /* Replace: pattern, content; Metaspace: replacement in a */
    size_t a_len, b_len;
    uint32_t content; /* Strip */
    int start, stop;
    tk_prepend_scheme prepend;
    struct tk_decoder **children;
    int n_children;
} tk_decoder;
/* A list of owned strings: the tokens flowing through the decoder chain. */
typedef struct {
    char **s;
    size_t *len;
    int n, cap;
} tk_strs;
bool tk_strs_push(tk_strs *l, const char *s, size_t len);
void tk_strs_free(tk_strs *l);
kvs_status tk_decoder_parse(json_t *j, const char *where, tk_decoder **out);
void tk_decoder_free(tk_decoder *d);
/* Runs the chain; tokens is replaced by the result. */
kvs_status tk_decode_chain(const tk_decoder *d, tk_strs *tokens);

/* ---- added tokens (added_tokens.c) ------------------------------------------------ */
typedef struct {
    int32_t id;
    char *content;
    size_t len;
    bool special, lstrip, rstrip, normalized, single_word;
} tk_added;
typedef struct {
    tk_added *tokens; /* sorted by length, longest first */
    int n, n_normalized;
    /* for each first byte: indices into tokens (longest first), for raw and normalized sets */
    int *by_byte[2][256];
    int n_by_byte[2][256];
} tk_added_set;
kvs_status tk_added_parse(json_t *arr, tk_added_set *out);

/* ---- a GGUF file's tokenizer (gguf_vocab.c) ----------------------------------- */
struct kvs_gguf;
/* tokenizer.ggml.* as the tokenizer.json root and tokenizer_config.json root
 * they stand for (both new references). */
kvs_status tk_gguf_json(const struct kvs_gguf *g, json_t **tokenizer_json, json_t **config_json);
/* A SentencePiece vocabulary's merges (gguf_spm.c): every split of a piece
 * into two pieces of vocab, ordered by the piece's tokenizer.ggml.scores
 * (highest first; without scores, by id), then by the ids of the piece and its
 * halves, as Hugging Face's converter orders them; appended to merges. */
kvs_status tk_gguf_spm_merges(const struct kvs_gguf *g, const struct kvs_gguf_kv *tokens, json_t *vocab, json_t *merges);
void tk_added_free(tk_added_set *s);
const tk_added *tk_added_by_id(const tk_added_set *s, int32_t id);
/* Splits s into text pieces and added-token matches of the given set
 * (normalized = false: tokens with normalized == false). Calls emit for each
 * piece in order: id >= 0 for a token, -1 for text. */
typedef kvs_status (*tk_emit_fn)(void *ctx, const char *s, size_t len, int32_t id, bool first);
kvs_status tk_added_split(const tk_added_set *set, bool normalized, bool parse_special,
                          const char *s, size_t len, bool first, tk_emit_fn emit, void *ctx);

/* ---- post-processor --------------------------------------------------------------- */
typedef struct {
    int32_t *prefix, *suffix; /* ids added before / after the sequence */
    int n_prefix, n_suffix;
} tk_post;

/* ---- the tokenizer ---------------------------------------------------------------- */
struct kvs_tokenizer {
    tk_bpe bpe;
    tk_added_set added;
    tk_normalizer *normalizer;
    tk_pretok *pretok;
    tk_pre_chain pre_chain;
    tk_decoder *decoder;
    tk_post post;
    int vocab_size;
    const char **text;  /* [vocab_size] token text (added content wins), NULL if none */
    uint32_t *text_len; /* [vocab_size] */
    uint8_t *special;   /* [vocab_size] 1 if a special added token */
    char *chat_template, *bos_token, *eos_token;
    int bos_id, eos_id;
};
/* Token text for decoding: added token content or model token. */
const char *tk_token_text(const kvs_tokenizer *t, int id, size_t *len);
/* Whether id adds to a decode: a known id, and not a special one when they are skipped. */
bool tk_token_visible(const kvs_tokenizer *t, int id, bool skip_special);

#endif
