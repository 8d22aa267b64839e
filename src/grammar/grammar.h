/* grammar: constrained decoding for structured output. A JSON schema (or "any
 * JSON object") is compiled to a pushdown automaton over bytes: rules, each a
 * small DFA whose edges are bytes or calls of other rules (nesting, $ref and
 * recursion go through the stack). A matcher is one sequence's position: a set
 * of stacks. Its mask (the tokens that keep the output a valid prefix) is
 * computed by walking the vocabulary's byte trie from that state, pruning a
 * subtree as soon as its prefix is rejected. Two caches, shared by every
 * matcher of a grammar (and its first vocabulary): masks by state (the whole
 * stack set, hashed), and per node what it decides alone (xgrammar's
 * context-independent tokens: a full trie walk once per node, then a state's
 * mask is those tables OR'ed plus a walk of the few tokens that leave the
 * node's rule). So a grammar's first masks cost milliseconds and later ones
 * tens of microseconds (llama3's 128k vocabulary: tests/test_grammar.c's
 * mask_cost prints them): keep compiled grammars (by schema text) and reuse
 * them across requests.
 *
 * The output is JSON written one way:
 *  - whitespace: none, except at most one space after ':' and after ',';
 *  - objects of a schema: exactly the listed properties in the listed order,
 *    the required ones always, optional ones may be left out (strict mode;
 *    additionalProperties is not needed and never adds properties); an object
 *    schema without properties (and without additionalProperties: false) and
 *    json_object take any JSON object;
 *  - strings: any valid UTF-8, escapes included (\uXXXX: no \u0000, surrogates
 *    only as a pair, as jansson accepts them); minLength/maxLength count code
 *    points;
 *  - a string with a pattern (regex.c): its content (the code points between
 *    the quotes) matches the pattern as ECMA-262 reads it: unanchored unless ^
 *    / $ say otherwise, '.' any code point but \n \r U+2028 U+2029, \d \w \s
 *    as ECMA's. Supported: literals, escapes (\d \D \w \W \s \S \t \n \v \f
 *    \r \0 \cX \xHH \uXXXX \u{X...}, \ before punctuation), '.', classes with
 *    ranges and negation, ( ) and (?: ) groups, |, * + ? {n} {n,} {n,m} (lazy
 *    forms too; counts up to 1000, the pattern multiplied out up to 4096
 *    positions), ^ and $ anywhere. Refused naming the construct and its
 *    offset: lookahead and lookbehind, backreferences, named groups, \b \B,
 *    \p{..}, possessive quantifiers, (?flags), other letter escapes. Its code
 *    points are written raw, but '"' and '\' (\" \\), control characters (\b \f
 *    \n \r \t or \u00XX) and '/' (raw or \/). With minLength/maxLength too
 *    the two are intersected (refused past 32768 code-point states); a
 *    pattern that no string (of those lengths) matches is refused;
 *  - format (strings only): date, time, date-time (RFC 3339: T or t, Z or z,
 *    seconds up to 60, days 01-31 whatever the month), uuid, email (dot-atoms
 *    of atext, '@', two or more labels), ipv4 and hostname are enforced as
 *    patterns; any other format is an annotation (ignored), and so is a
 *    format beside a pattern (the pattern is enforced);
 *  - numbers: at most 18 digits before the point (integers fit an int64), 15
 *    after it and an exponent of 2 digits, so that they parse as JSON numbers
 *    everywhere; minimum, maximum, exclusiveMinimum and exclusiveMaximum are
 *    accepted and NOT enforced;
 *  - oneOf is taken as anyOf.
 * Supported keywords: type (a name or an array of names), properties, required,
 * additionalProperties, items, minItems, maxItems (up to 256), enum, const,
 * minLength, maxLength (up to 256), pattern, format, anyOf, oneOf, $ref (any
 * JSON pointer into the schema: "#", "#/$defs/NAME", "#/properties/a/items",
 * with ~0 ~1 and percent-encoding; a pointer that resolves to nothing is
 * refused naming it; other documents and plain-name fragments are not
 * supported), $defs, definitions; description, title, default,
 * examples, $schema, $id, $comment, deprecated, readOnly, writeOnly, strict
 * are ignored. Any other keyword is refused, naming it. Nesting deeper than
 * KVS_GRAMMAR_MAX_DEPTH rule calls is cut off (its continuations masked out). */
#ifndef KVS_GRAMMAR_H
#define KVS_GRAMMAR_H

#include <jansson.h>
#include <stdatomic.h>

#include "core/core.h"
#include "tokenizer/tokenizer.h"

#define KVS_GRAMMAR_MAX_DEPTH 128

typedef struct kvs_grammar kvs_grammar;             /* compiled, immutable (but its mask cache), refcounted */
typedef struct kvs_grammar_vocab kvs_grammar_vocab; /* the model's tokens as bytes, a trie; built once per model */
typedef struct kvs_grammar_matcher kvs_grammar_matcher; /* one sequence's position in a grammar */

/* Bounds on what one grammar may cost (0 in a field: no bound), for a server
 * that compiles schemas from untrusted requests. A compile past a bound stops
 * there and fails with KVS_ERR_UNSUPPORTED, its message naming the bound; a
 * compile whose cancel flag another thread sets stops with KVS_ERR_BUSY
 * ("cancelled"). max_mask_work bounds every mask computed later for the
 * grammar (kvs_grammar_matcher_mask), in steps of the matcher (a stack moved
 * or expanded by a byte, and each stack it is compared with; a few ns each). */
typedef struct {
    int max_values;          /* JSON values in the schema (checked first, before any automaton) */
    int max_states;          /* states (nodes) of the compiled automaton */
    int max_transitions;     /* transitions built on the way: byte ranges, empty moves, rule calls */
    size_t max_bytes;        /* memory of the automaton, its construction included */
    double max_seconds;      /* compile time */
    uint64_t max_mask_work;  /* matcher steps one token mask may take */
    const atomic_bool *cancel;
} kvs_grammar_limits;
/* What `kvsparse serve` applies unless told otherwise (docs/SERVING.md): each
 * bound well above what the schemas agents send need (tens to a few thousand
 * states, tens of thousands of transitions, milliseconds), and each reached by
 * the schemas that cost minutes and gigabytes within about 100-300 ms. */
#define KVS_GRAMMAR_MAX_VALUES 100000
#define KVS_GRAMMAR_MAX_STATES 32768
#define KVS_GRAMMAR_MAX_TRANSITIONS 1000000
#define KVS_GRAMMAR_MAX_BYTES ((size_t)64 << 20)
#define KVS_GRAMMAR_MAX_SECONDS 0.5
#define KVS_GRAMMAR_MAX_MASK_WORK 8000000
kvs_grammar_limits kvs_grammar_limits_default(void);

/* JSON schema text -> grammar (refcount 1). Errors name the unsupported keyword
 * or bad field by its path from the schema's root, written "schema", e.g.
 * "schema.properties.age: 'format' is not supported" (a server prefixes its own
 * field: "response_format.json_schema."). prefix / suffix (may be NULL): literal
 * text the output must start / end with around the JSON value (tool calls:
 * "<tool_call>\n" ... "\n</tool_call>"). */
kvs_status kvs_grammar_from_json_schema(const char *schema, size_t len, const char *prefix, const char *suffix,
                                        kvs_grammar **out);
/* The same within lim (NULL: no bounds). */
kvs_status kvs_grammar_compile(const char *schema, size_t len, const char *prefix, const char *suffix,
                               const kvs_grammar_limits *lim, kvs_grammar **out);
/* Whether schema holds at most lim->max_values JSON values (KVS_ERR_UNSUPPORTED,
 * naming the bound, otherwise): the first check of a compile, cheap enough to
 * make before anything else is done with a schema. */
kvs_status kvs_grammar_check_values(json_t *schema, const kvs_grammar_limits *lim);
/* The same from the parsed schema (not changed), for a caller that has it. */
kvs_status kvs_grammar_compile_value(json_t *schema, const char *prefix, const char *suffix,
                                     const kvs_grammar_limits *lim, kvs_grammar **out);
/* response_format json_object: any JSON object. */
kvs_status kvs_grammar_json_object(kvs_grammar **out);
kvs_grammar *kvs_grammar_ref(kvs_grammar *g);
/* The memory g holds: its automaton and what its masks cached so far. */
size_t kvs_grammar_bytes(kvs_grammar *g);
/* Computes g's first mask for v ahead of its first request (a server does
 * this off the engine's thread), bounded by the grammar's max_mask_work:
 * KVS_ERR_UNSUPPORTED, naming the bound, when it passes it or when more
 * alternatives are open at once than a state holds (they would be cut). */
kvs_status kvs_grammar_warm(kvs_grammar *g, const kvs_grammar_vocab *v);
/* Drops the masks cached by state (keeping what each node decides alone): for
 * benchmarks, or to give memory back. */
void kvs_grammar_forget_masks(kvs_grammar *g);
void kvs_grammar_unref(kvs_grammar *g);

/* tokens[i] / lens[i]: the bytes token i decodes to (lens 0: a token that can
 * never be produced, e.g. special tokens); end_ids: the ids that end the output
 * (EOS / eot), allowed only once the output is complete. The arrays are copied. */
kvs_status kvs_grammar_vocab_create(const char *const *tokens, const size_t *lens, int n_tokens,
                                    const int32_t *end_ids, int n_end, kvs_grammar_vocab **out);
/* The vocabulary of a tokenizer (kvs_tokenizer_token_bytes of every id); end ids as above. */
kvs_status kvs_grammar_vocab_from_tokenizer(const kvs_tokenizer *t, const int32_t *end_ids, int n_end,
                                            kvs_grammar_vocab **out);
int kvs_grammar_vocab_size(const kvs_grammar_vocab *v);
void kvs_grammar_vocab_destroy(kvs_grammar_vocab *v);

/* The matcher holds a reference to g; v must outlive it. */
kvs_status kvs_grammar_matcher_create(kvs_grammar *g, const kvs_grammar_vocab *v, kvs_grammar_matcher **out);
/* bits[(n_tokens + 31) / 32]: bit i set = token i keeps the output a valid
 * prefix (or, an end id, ends a complete one). After an end id: only end ids.
 * All zero only where nesting went past KVS_GRAMMAR_MAX_DEPTH (nothing can
 * follow): the caller ends the request. A grammar may serve matchers on
 * several threads (its caches take a lock); a matcher is one thread's.
 * KVS_ERR_UNSUPPORTED (naming the bound) when the mask would take more than
 * the grammar's max_mask_work; KVS_ERR_NOMEM: out of memory. bits is then not
 * a mask: the caller ends the request. */
kvs_status kvs_grammar_matcher_mask(kvs_grammar_matcher *m, uint32_t *bits);
/* Advances by one token; KVS_ERR_INVALID (naming the token) when the mask
 * forbids it, the matcher unchanged. */
kvs_status kvs_grammar_matcher_accept(kvs_grammar_matcher *m, int32_t id);
bool kvs_grammar_matcher_complete(const kvs_grammar_matcher *m); /* the output so far is a whole value (+ suffix) */
bool kvs_grammar_matcher_ended(const kvs_grammar_matcher *m);    /* an end id was accepted */
void kvs_grammar_matcher_destroy(kvs_grammar_matcher *m);

/* Closing the output in time (near the end of a token budget): the fewest bytes
 * that complete the output from here, suffix included (0 when complete, -1 when
 * it cannot complete: nothing can follow, e.g. nesting cut off). Memoised per
 * grammar (the fewest bytes from each node to its rule's return, by the depth
 * of calls left below it). */
int kvs_grammar_matcher_bytes_to_complete(const kvs_grammar_matcher *m);
/* bits as kvs_grammar_matcher_mask's: the tokens of the mask that lie on a
 * shortest completion (bytes_to_complete after the token + its length <=
 * bytes_to_complete now), only the end ids once complete; where no token does
 * (the vocabulary cannot spell a shortest completion), the tokens of the mask
 * that leave the fewest bytes to complete. The matcher is unchanged. Slower
 * than the mask, not cached: for the last tokens of a budget. */
kvs_status kvs_grammar_matcher_closing_mask(kvs_grammar_matcher *m, uint32_t *bits); /* failures as the mask's */

/* The bytes accepted so far, without the matcher's tokens: true when bytes[0..n)
 * keeps the output a valid prefix (for tests and tool-call parsing). */
bool kvs_grammar_accepts_prefix(const kvs_grammar *g, const char *bytes, size_t n, bool *complete);

#endif
