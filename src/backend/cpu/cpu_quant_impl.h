/* The quantized gemv of cpu_simd.h (gemv_q), included by cpu_simd_impl.h for
 * each set: plain C where VL is 1 (the generic set: the reference), 256-bit
 * integer vectors otherwise (AVX2's maddubs; the AVX-512 set's file has VNNI,
 * one vpdpbusd instead of three instructions). 256 bits suit every format: a
 * chunk of 32 weights is what one scale covers (16 for Q6_K, split in lanes).
 *
 * The 32-element formats go a block at a time: its weights as small integers
 * u[32] with scale d and min m, so that the block's dot with an activation
 * block x (scaled per 32) is d * x.d * sum u q + m * x.s. The centred formats
 * (Q4_0: u = nibble - 8, Q5_0, Q8_0) have signed u and no m (|u| times q with
 * u's sign, as llama.cpp does); Q4_1 and Q5_1 have unsigned u. Even and odd
 * blocks sum apart, halving the chains of dependent adds that bound the loop.
 * The K formats (256) go as llama.cpp's: activations scaled per 256 (Q8_K's
 * way: the 8 blocks of 32 share d), each chunk of 32's integer dot times its
 * integer scale(s) summed exactly in i32, the mins (Q4_K, Q5_K) against the
 * blocks' integer sums, one f32 step per 256; Q6_K's codes centred (- 32).
 * A row's sum for one input is the same sequence of operations whatever the
 * other inputs, n or the rows' split: the scalar sums are explicit fmaf, since
 * the compiler's own contraction of a * b + c * d differed with the group size. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/cpu_pool.h"
#include "gguf/gguf.h"

enum { QK_GROUP = 4 }; /* inputs over one decoding of a weight chunk (accumulators in registers) */

ALWAYS_INLINE int q_block(const uint32_t fmt) {
    return fmt == KVS_GGML_Q4_K || fmt == KVS_GGML_Q5_K || fmt == KVS_GGML_Q6_K ? 256 : 32;
}
ALWAYS_INLINE int q_block_bytes(const uint32_t fmt) {
    switch (fmt) {
    case KVS_GGML_Q4_0: return 18;
    case KVS_GGML_Q4_1: return 20;
    case KVS_GGML_Q5_0: return 22;
    case KVS_GGML_Q5_1: return 24;
    case KVS_GGML_Q8_0: return 34;
    case KVS_GGML_Q4_K: return 144;
    case KVS_GGML_Q5_K: return 176;
    default: return 210; /* Q6_K */
    }
}

ALWAYS_INLINE uint16_t q_u16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h;
}

/* Q4_K / Q5_K: sub-block j's 6-bit scale and min (gguf/quant.c's scale_min_k4). */
ALWAYS_INLINE void q_scale_min(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63, *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

ALWAYS_INLINE bool q_centred(const uint32_t fmt) {
    return fmt == KVS_GGML_Q4_0 || fmt == KVS_GGML_Q5_0 || fmt == KVS_GGML_Q6_K || fmt == KVS_GGML_Q8_0;
}

/* A 32-element block's scales {sl, sh, cm} (see the top); h2f converts an fp16. */
#define Q_SCALES(fmt, b, s, h2f)                                                                                   \
    do {                                                                                                           \
        s[0] = s[1] = h2f(q_u16(b));                                                                               \
        s[2] = fmt == KVS_GGML_Q4_1 || fmt == KVS_GGML_Q5_1 ? h2f(q_u16(b + 2)) : 0;                               \
    } while (0)

/* K formats: chunk c's integer scales for elements 0..15 and 16..31, and its
 * min (Q4_K, Q5_K; 0 for Q6_K, whose codes are centred instead). */
ALWAYS_INLINE void q_kscales(const uint8_t *wb, const uint32_t fmt, int c, int *sl, int *sh, int *m) {
    if (fmt == KVS_GGML_Q6_K) {
        const int8_t *sc = (const int8_t *)(wb + 192) + 8 * (c / 4) + 2 * (c % 4);
        *sl = sc[0], *sh = sc[1], *m = 0;
    } else {
        q_scale_min(c, wb + 4, sl, m);
        *sh = *sl;
    }
}

#if VL == 1
/* ---- the reference: plain C ------------------------------------------------------ */
#define Q_ACC float
#define q_acc_zero() 0.0f
#define q_acc_sum(a) (a)

/* Chunk c of block b as integers u[32]. */
ALWAYS_INLINE void q_unpack(const uint8_t *b, const uint32_t fmt, int c, int *u) {
    switch (fmt) {
    case KVS_GGML_Q4_0:
    case KVS_GGML_Q4_1:
    case KVS_GGML_Q5_0:
    case KVS_GGML_Q5_1: {
        bool five = fmt == KVS_GGML_Q5_0 || fmt == KVS_GGML_Q5_1, min = fmt == KVS_GGML_Q4_1 || fmt == KVS_GGML_Q5_1;
        const uint8_t *qh = b + (min ? 4 : 2), *qs = five ? qh + 4 : qh;
        uint32_t h = five ? (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24 : 0;
        for (int l = 0; l < 16; l++) {
            int centre = fmt == KVS_GGML_Q4_0 ? 8 : fmt == KVS_GGML_Q5_0 ? 16 : 0;
            u[l] = ((qs[l] & 0xF) | (int)((h >> l) & 1) << 4) - centre;
            u[l + 16] = ((qs[l] >> 4) | (int)((h >> (l + 16)) & 1) << 4) - centre;
        }
        break;
    }
    case KVS_GGML_Q8_0:
        for (int l = 0; l < 32; l++) u[l] = (int8_t)b[2 + l];
        break;
    case KVS_GGML_Q4_K:
    case KVS_GGML_Q5_K: {
        bool five = fmt == KVS_GGML_Q5_K;
        const uint8_t *qs = b + (five ? 48 : 16) + 32 * (c / 2), *qh = b + 16;
        for (int l = 0; l < 32; l++)
            u[l] = (c % 2 ? qs[l] >> 4 : qs[l] & 0xF) | (five ? ((qh[l] >> c) & 1) << 4 : 0);
        break;
    }
    default: { /* Q6_K */
        int half = c / 4, k = c % 4;
        const uint8_t *ql = b + 64 * half + 32 * (k % 2), *qh = b + 128 + 32 * half;
        for (int l = 0; l < 32; l++) u[l] = ((k < 2 ? ql[l] & 0xF : ql[l] >> 4) | ((qh[l] >> (2 * k)) & 3) << 4) - 32;
    }
    }
}

/* The chunk's dot terms with every input of the group: exact integer sums per
 * 16, then f32. */
ALWAYS_INLINE void q_chunk(const uint8_t *b, const uint32_t fmt, int c, const kvs_cpu_q8 *const *xb, float *acc,
                           float *corr, const int NI) {
    int u[32];
    float s[3];
    q_unpack(b, fmt, c, u);
    Q_SCALES(fmt, b, s, kvs_f16_to_f32);
    for (int i = 0; i < NI; i++) {
        const kvs_cpu_q8 *x = xb[i];
        int lo = 0, hi = 0;
        for (int l = 0; l < 16; l++) lo += u[l] * x->q[l], hi += u[l + 16] * x->q[l + 16];
        acc[i] = fmaf((float)hi, s[1] * x->d, fmaf((float)lo, s[0] * x->d, acc[i]));
        corr[i] = fmaf(s[2], x->s, corr[i]);
    }
}
/* A K block (256) against the group: its 8 chunks' integer dots times their
 * integer scales summed exactly, then one f32 step a block (see q_kblock_scales). */
ALWAYS_INLINE void q_kblock(const uint8_t *wb, const uint32_t fmt, const kvs_cpu_q8 *const *xb, float *acc,
                            float *corr, const int NI) {
    int isum[QK_GROUP] = {0}, msum[QK_GROUP] = {0};
    for (int c = 0; c < 8; c++) {
        int u[32], sl, sh, m;
        q_unpack(wb, fmt, c, u);
        q_kscales(wb, fmt, c, &sl, &sh, &m);
        for (int i = 0; i < NI; i++) {
            const kvs_cpu_q8 *x = xb[i] + c;
            int lo = 0, hi = 0;
            for (int l = 0; l < 16; l++) lo += u[l] * x->q[l], hi += u[l + 16] * x->q[l + 16];
            isum[i] += sl * lo + sh * hi, msum[i] += m * x->isum;
        }
    }
    float d = kvs_f16_to_f32(q_u16(wb + (fmt == KVS_GGML_Q6_K ? 208 : 0)));
    float dmin = fmt == KVS_GGML_Q6_K ? 0 : kvs_f16_to_f32(q_u16(wb + 2));
    for (int i = 0; i < NI; i++) {
        acc[i] = fmaf((float)isum[i], d * xb[i]->d, acc[i]);
        corr[i] = fmaf(-dmin * xb[i]->d, (float)msum[i], corr[i]);
    }
}
#else
/* ---- 256-bit integer vectors ------------------------------------------------------- */
#define Q_ACC __m256
#define q_acc_zero() _mm256_setzero_ps()
ALWAYS_INLINE float q_acc_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* Lane l: the sum of the 4 products u[4l + t] * s[4l + t] (u unsigned, s signed). */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define q_dot(u, s) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (u), (s))
#else /* |u * s| <= 128 * 127: the pairs' int16 sums do not saturate */
#define q_dot(u, s) _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1))
#endif
#define q_h2f(h) _cvtsh_ss(h)

/* 32 bytes, 0x10 where bit j of the 32 bits at p is set (byte j). */
ALWAYS_INLINE __m256i q_bits16(const uint8_t *p) {
    uint32_t x;
    memcpy(&x, p, 4);
#if defined(__AVX512BW__) && defined(__AVX512VL__) /* the bits as a byte mask: one instruction */
    return _mm256_maskz_mov_epi8((__mmask32)x, _mm256_set1_epi8(0x10));
#endif
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    __m256i bytes = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)x), shuf),
                                    _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

ALWAYS_INLINE __m256i q_unpack(const uint8_t *b, const uint32_t fmt, int c) {
    const __m256i lo4 = _mm256_set1_epi8(0xF);
    switch (fmt) {
    case KVS_GGML_Q4_0:
    case KVS_GGML_Q4_1:
    case KVS_GGML_Q5_0:
    case KVS_GGML_Q5_1: {
        bool five = fmt == KVS_GGML_Q5_0 || fmt == KVS_GGML_Q5_1, min = fmt == KVS_GGML_Q4_1 || fmt == KVS_GGML_Q5_1;
        const uint8_t *qh = b + (min ? 4 : 2), *qs = five ? qh + 4 : qh;
        __m128i v = _mm_loadu_si128((const __m128i *)qs);
        __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), lo4);
        if (five) u = _mm256_or_si256(u, q_bits16(qh));
        return fmt == KVS_GGML_Q4_0 ? _mm256_sub_epi8(u, _mm256_set1_epi8(8))
               : fmt == KVS_GGML_Q5_0 ? _mm256_sub_epi8(u, _mm256_set1_epi8(16)) : u;
    }
    case KVS_GGML_Q8_0: return _mm256_loadu_si256((const __m256i *)(b + 2));
    case KVS_GGML_Q4_K:
    case KVS_GGML_Q5_K: {
        bool five = fmt == KVS_GGML_Q5_K;
        __m256i v = _mm256_loadu_si256((const __m256i *)(b + (five ? 48 : 16) + 32 * (c / 2)));
        __m256i u = _mm256_and_si256(c % 2 ? _mm256_srli_epi16(v, 4) : v, lo4);
        if (!five) return u;
        __m256i h = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(b + 16)), c),
                                     _mm256_set1_epi8(1));
        return _mm256_or_si256(u, _mm256_slli_epi16(h, 4));
    }
    default: { /* Q6_K */
        int half = c / 4, k = c % 4;
        __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * half + 32 * (k % 2)));
        __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * half));
        __m256i u = _mm256_and_si256(k < 2 ? ql : _mm256_srli_epi16(ql, 4), lo4);
        __m256i h = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), _mm256_set1_epi8(3));
        return _mm256_sub_epi8(_mm256_or_si256(u, _mm256_slli_epi16(h, 4)), _mm256_set1_epi8(32));
    }
    }
}

ALWAYS_INLINE void q_chunk(const uint8_t *b, const uint32_t fmt, int c, const kvs_cpu_q8 *const *xb, __m256 *acc,
                           float *corr, const int NI) {
    __m256i u = q_unpack(b, fmt, c);
    float s[3];
    Q_SCALES(fmt, b, s, q_h2f);
    const bool sgn = q_centred(fmt);
    __m256i ua = sgn ? _mm256_abs_epi8(u) : u; /* signed weights: |w| times x with w's sign */
    for (int i = 0; i < NI; i++) {
        const kvs_cpu_q8 *x = xb[i];
        __m256i xv = _mm256_loadu_si256((const __m256i *)x->q);
        __m256i dot = q_dot(ua, sgn ? _mm256_sign_epi8(xv, u) : xv);
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(s[0] * x->d), acc[i]);
        if (!sgn) corr[i] = fmaf(s[2], x->s, corr[i]);
    }
}
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define q_madd(acc, p, s) _mm256_dpwssd_epi32((acc), (p), (s))
#else
#define q_madd(acc, p, s) _mm256_add_epi32((acc), _mm256_madd_epi16((p), (s)))
#endif

/* A K block against the group, llama.cpp's way: per chunk the u8 x i8 pairs
 * summed to i16 (|u q| pairs <= 2 * 63 * 127: no saturation), times the chunk's
 * integer scales into i32 lanes; one f32 step a block. */
ALWAYS_INLINE void q_kblock(const uint8_t *wb, const uint32_t fmt, const kvs_cpu_q8 *const *xb, __m256 *acc,
                            float *corr, const int NI) {
    const bool q6 = fmt == KVS_GGML_Q6_K;
    __m256i isum[QK_GROUP];
    int msum[QK_GROUP];
    for (int i = 0; i < NI; i++) isum[i] = _mm256_setzero_si256(), msum[i] = 0;
    UNROLL for (int c = 0; c < 8; c++) {
        int sl, sh, m;
        __m256i u = q_unpack(wb, fmt, c), ua = q6 ? _mm256_abs_epi8(u) : u;
        q_kscales(wb, fmt, c, &sl, &sh, &m);
        __m256i sv = q6 ? _mm256_set_m128i(_mm_set1_epi16((short)sh), _mm_set1_epi16((short)sl))
                        : _mm256_set1_epi16((short)sl);
        for (int i = 0; i < NI; i++) {
            const kvs_cpu_q8 *x = xb[i] + c;
            __m256i xv = _mm256_loadu_si256((const __m256i *)x->q);
            isum[i] = q_madd(isum[i], _mm256_maddubs_epi16(ua, q6 ? _mm256_sign_epi8(xv, u) : xv), sv);
            if (!q6) msum[i] += m * x->isum;
        }
    }
    float d = q_h2f(q_u16(wb + (q6 ? 208 : 0))), dmin = q6 ? 0 : q_h2f(q_u16(wb + 2));
    for (int i = 0; i < NI; i++) {
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_set1_ps(d * xb[i]->d), acc[i]);
        if (!q6) corr[i] = fmaf(-dmin * xb[i]->d, (float)msum[i], corr[i]);
    }
}
/* ---- Q4_K, Q5_K, Q6_K a whole super-block of 256 at a time ------------------------------
 * The inputs' blocks are first repacked per 256 (q_x256) in the order the
 * weights unpack, with their sums of 16 and 32. The codes stay unsigned (Q6_K's
 * - 32 goes against the sums of 16, Q4_K's mins against the sums of 32); the
 * scales decoded once per super-block (in the integer units: the compiler would
 * take vector ones, the loop's bottleneck); one f32 step a super-block, the min
 * term in its own lanes.
 * AVX-512 (VNNI): four 512-bit registers a super-block (Q4_K's 64 code bytes
 * give chunks {0, 2} (low nibbles) and {1, 3} (high), as Q5_K's with their
 * fifth bits by a byte mask; Q6_K's give {0, 1} and {2, 3}), u8 x i8 quads summed to i32 (vpdpbusd), two registers of them
 * packed to i16 and times their scales into i32 (vpdpwssd: see q_dot4x2).
 * AVX2: a chunk a register, u8 x i8 pairs summed to i16 (vpmaddubsw: |pair| <=
 * 2 * 63 * 127) times the chunk's scales into i32 (vpmaddwd), the scales'
 * registers one byte shuffle each. */
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q_K512 1
#endif
typedef struct {
    int8_t q[256];   /* the 8 chunks, in the weights' unpacking order */
    int16_t bs32[8]; /* chunk c's sum (natural order) */
    int16_t bs16[16]; /* the sums of 16 (natural order) */
    float d;
    int32_t pad_[3];
} q_x256;

/* Chunk c's position in q_x256.q, in 32s. */
ALWAYS_INLINE int q_x256_pos(const uint32_t fmt, int c) {
#ifdef Q_K512
    return fmt != KVS_GGML_Q6_K ? (c / 4) * 4 + (c % 2) * 2 + (c % 4) / 2 : c;
#else
    (void)fmt;
    return c;
#endif
}

static void q_repack256(q_x256 *dst, const kvs_cpu_q8 *x, int nsb, const uint32_t fmt) {
    for (int b = 0; b < nsb; b++, dst++, x += 8) {
        for (int c = 0; c < 8; c++) {
            memcpy(dst->q + 32 * q_x256_pos(fmt, c), x[c].q, 32);
            int lo = 0, hi = 0;
            for (int l = 0; l < 16; l++) lo += x[c].q[l], hi += x[c].q[l + 16];
            dst->bs16[2 * c] = (int16_t)lo, dst->bs16[2 * c + 1] = (int16_t)hi, dst->bs32[c] = (int16_t)x[c].isum;
        }
        dst->d = x[0].d;
        memset(dst->pad_, 0, sizeof dst->pad_);
    }
}

/* Q4_K's 6-bit scales (bytes 0-7) and mins (8-15) of the block at wb. */
ALWAYS_INLINE __m128i q4k_scales_mins(const uint8_t *wb) {
    uint32_t a, b, c;
    memcpy(&a, wb + 4, 4), memcpy(&b, wb + 8, 4), memcpy(&c, wb + 12, 4);
    __asm__("" : "+r"(a), "+r"(b), "+r"(c));
    const uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
    uint64_t sc = (a & k6) | (uint64_t)((c & k4) | ((a >> 6) & k2) << 4) << 32;
    uint64_t mn = (b & k6) | (uint64_t)(((c >> 4) & k4) | ((b >> 6) & k2) << 4) << 32;
    __asm__("" : "+r"(sc), "+r"(mn));
    return _mm_insert_epi64(_mm_cvtsi64_si128((long long)sc), (long long)mn, 1);
}

#ifdef Q_K512
#define Q_KACC __m512
#define q_kacc_zero() _mm512_setzero_ps()
#define q_kacc_sum(v) _mm512_reduce_add_ps(v)
/* words w of a 512-bit register: source word lo for w < 16, hi otherwise */
#define Q_IDX2(lo, hi) _mm512_inserti64x4(_mm512_set1_epi16(lo), _mm256_set1_epi16(hi), 1)

/* Two registers of codes (u0, u1) against the activations at x (128 bytes): the
 * sums of 4 products (vpdpbusd: |sum| <= 4 * 63 * 127, an i16) packed to i16,
 * 128-bit block L's words 0-3 from u0's block L, 4-7 from u1's; then one
 * vpdpwssd with the scales takes both. */
ALWAYS_INLINE __m512i q_dot4x2(__m512i u0, __m512i u1, const int8_t *x) {
    __m512i t0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u0, _mm512_loadu_si512(x));
    __m512i t1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u1, _mm512_loadu_si512(x + 64));
    return _mm512_packs_epi32(t0, t1);
}
/* the scale of each word of q_dot4x2's result: Q4_K's registers {0, 2}, {1, 3}
 * (+ 4 for the second pair); Q6_K's scales of 16: {0 1 2 3}, {4 5 6 7} (+ 8) */
static const int16_t q4k_sidx[32] __attribute__((aligned(64))) = {0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1,
                                                                  2, 2, 2, 2, 3, 3, 3, 3, 2, 2, 2, 2, 3, 3, 3, 3};
static const int16_t q6k_sidx[32] __attribute__((aligned(64))) = {0, 0, 0, 0, 4, 4, 4, 4, 1, 1, 1, 1, 5, 5, 5, 5,
                                                                  2, 2, 2, 2, 6, 6, 6, 6, 3, 3, 3, 3, 7, 7, 7, 7};

/* Q4_K, or Q5_K (five: the codes at 48, chunk c's fifth bits bit c of the 32 bytes at 16) */
ALWAYS_INLINE void q4k_sb(const uint8_t *wb, const q_x256 *const *xb, __m512 *acc, __m128 *accm, const bool five,
                          const int NI) {
    uint32_t dd;
    memcpy(&dd, wb, 4);
    __m256i s16 = _mm256_cvtepu8_epi16(q4k_scales_mins(wb)); /* scales, then mins */
    __m512i s512 = _mm512_castsi256_si512(s16);
    const __m512i i01 = _mm512_loadu_si512(q4k_sidx), i23 = _mm512_add_epi16(i01, _mm512_set1_epi16(4));
    __m512i sv01 = _mm512_permutexvar_epi16(i01, s512), sv23 = _mm512_permutexvar_epi16(i23, s512);
    __m128i mins = _mm256_extracti128_si256(s16, 1);
    const __m512i m4 = _mm512_set1_epi8(0xF);
    const uint8_t *qs = wb + (five ? 48 : 16);
    __m512i v0 = _mm512_loadu_si512(qs), v1 = _mm512_loadu_si512(qs + 64);
    __m512i u0 = _mm512_and_si512(v0, m4), u1 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), m4);
    __m512i u2 = _mm512_and_si512(v1, m4), u3 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), m4);
    if (five) { /* register {a, b}: + 16 where bit a (low half) or b (high half) of qh is set */
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(wb + 16)));
        const __m512i s16b = _mm512_set1_epi8(16);
#define Q5_HI(u, a, b) u = _mm512_mask_add_epi8(u, _mm512_test_epi8_mask(qh, Q_IDX2(0x0101 << (a), 0x0101 << (b))), u, s16b)
        Q5_HI(u0, 0, 2); Q5_HI(u1, 1, 3); Q5_HI(u2, 4, 6); Q5_HI(u3, 5, 7);
#undef Q5_HI
    }
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dd)); /* d, dmin */
    UNROLL for (int i = 0; i < NI; i++) {
        const q_x256 *x = xb[i];
        __m512i s = _mm512_dpwssd_epi32(_mm512_setzero_si512(), q_dot4x2(u0, u1, x->q), sv01);
        s = _mm512_dpwssd_epi32(s, q_dot4x2(u2, u3, x->q + 128), sv23);
        __m128i m = _mm_madd_epi16(mins, _mm_loadu_si128((const __m128i *)x->bs32));
        __m128 f = _mm_mul_ps(dm, _mm_set1_ps(x->d));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_broadcastss_ps(f), acc[i]);
        accm[i] = _mm_fnmadd_ps(_mm_cvtepi32_ps(m), _mm_shuffle_ps(f, f, 0x55), accm[i]);
    }
}

ALWAYS_INLINE void q6k_sb(const uint8_t *wb, const q_x256 *const *xb, __m512 *acc, const int NI) {
    __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wb + 192)));
    __m512i s512 = _mm512_castsi256_si512(s16);
    /* register p holds chunks 2p, 2p + 1: its 128-bit lane L the 16 elements of scale 4p + L */
    const __m512i i0 = _mm512_loadu_si512(q6k_sidx), i1 = _mm512_add_epi16(i0, _mm512_set1_epi16(8));
    __m512i sv0 = _mm512_permutexvar_epi16(i0, s512), sv1 = _mm512_permutexvar_epi16(i1, s512);
    const __m512i m4 = _mm512_set1_epi8(0xF), m30 = _mm512_set1_epi8(0x30);
    const __m512i cl = Q_IDX2(4, 2), ch = Q_IDX2(0, 2); /* the high bits to bits 4, 5: chunk k's << 4, 2; >> 0, 2 */
    __m512i u[4];
    for (int h = 0; h < 2; h++) {
        __m512i ql = _mm512_loadu_si512(wb + 64 * h);
        __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(wb + 128 + 32 * h)));
        /* (a & 0xF) | (b & ~0xF): ternary 0xCA, m4 ? a : b */
        u[2 * h] = _mm512_ternarylogic_epi32(m4, ql, _mm512_and_si512(_mm512_sllv_epi16(qh, cl), m30), 0xCA);
        u[2 * h + 1] = _mm512_ternarylogic_epi32(m4, _mm512_srli_epi16(ql, 4),
                                                 _mm512_and_si512(_mm512_srlv_epi16(qh, ch), m30), 0xCA);
    }
    float d = q_h2f(q_u16(wb + 208));
    UNROLL for (int i = 0; i < NI; i++) {
        const q_x256 *x = xb[i];
        __m512i s = _mm512_dpwssd_epi32(_mm512_setzero_si512(), q_dot4x2(u[0], u[1], x->q), sv0);
        s = _mm512_dpwssd_epi32(s, q_dot4x2(u[2], u[3], x->q + 128), sv1);
        __m256i m = _mm256_madd_epi16(s16, _mm256_loadu_si256((const __m256i *)x->bs16)); /* the codes' - 32 */
        s = _mm512_sub_epi32(s, _mm512_zextsi256_si512(_mm256_slli_epi32(m, 5)));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(d * x->d), acc[i]);
    }
}

#else
#define Q_KACC __m256
#define q_kacc_zero() _mm256_setzero_ps()
#define q_kacc_sum(v) q_acc_sum(v)

ALWAYS_INLINE void q4k_sb(const uint8_t *wb, const q_x256 *const *xb, __m256 *acc, __m128 *accm, const bool five,
                          const int NI) {
    uint32_t dd;
    memcpy(&dd, wb, 4);
    __m256i s16 = _mm256_cvtepu8_epi16(q4k_scales_mins(wb)); /* scales, then mins */
    __m256i sb = _mm256_permute2x128_si256(s16, s16, 0x00);   /* the scales in both lanes */
    __m128i mins = _mm256_extracti128_si256(s16, 1);
    const __m256i m4 = _mm256_set1_epi8(0xF);
    __m256i u[8], sv[8];
    UNROLL for (int g = 0; g < 4; g++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(wb + (five ? 48 : 16) + 32 * g));
        u[2 * g] = _mm256_and_si256(v, m4), u[2 * g + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
    if (five) { /* chunk c's fifth bits: bit c of the 32 bytes at 16 */
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(wb + 16)), one = _mm256_set1_epi8(1);
        UNROLL for (int c = 0; c < 8; c++)
            u[c] = _mm256_or_si256(u[c], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, c), one), 4));
    }
    UNROLL for (int c = 0; c < 8; c++) sv[c] = _mm256_shuffle_epi8(sb, _mm256_set1_epi16((short)(0x0100 + 0x0202 * c)));
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dd)); /* d, dmin */
    UNROLL for (int i = 0; i < NI; i++) {
        const q_x256 *x = xb[i];
        __m256i s = _mm256_setzero_si256();
        UNROLL for (int c = 0; c < 8; c++)
            s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(u[c], _mm256_loadu_si256((const __m256i *)(x->q + 32 * c))), sv[c]));
        __m128i m = _mm_madd_epi16(mins, _mm_loadu_si128((const __m128i *)x->bs32));
        __m128 f = _mm_mul_ps(dm, _mm_set1_ps(x->d));
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_broadcastss_ps(f), acc[i]);
        accm[i] = _mm_fnmadd_ps(_mm_cvtepi32_ps(m), _mm_shuffle_ps(f, f, 0x55), accm[i]);
    }
}

ALWAYS_INLINE void q6k_sb(const uint8_t *wb, const q_x256 *const *xb, __m256 *acc, const int NI) {
    __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wb + 192)));
    /* chunk c's register: scale 2c for its words 0-7 (elements 0-15), 2c + 1 for 8-15 */
    __m256i slo = _mm256_permute2x128_si256(s16, s16, 0x00), shi = _mm256_permute2x128_si256(s16, s16, 0x11);
    const __m256i m4 = _mm256_set1_epi8(0xF), m30 = _mm256_set1_epi8(0x30);
    __m256i u[8], sv[8];
    UNROLL for (int c = 0; c < 8; c++) {
        int k = c % 4;
        sv[c] = _mm256_shuffle_epi8(c < 4 ? slo : shi, _mm256_set_m128i(_mm_set1_epi16((short)(0x0302 + 0x0404 * k)),
                                                                       _mm_set1_epi16((short)(0x0100 + 0x0404 * k))));
    }
    UNROLL for (int h = 0; h < 2; h++) { /* the high bits to bits 4, 5: chunk k's << 4, 2; >> 0, 2 */
        __m256i ql0 = _mm256_loadu_si256((const __m256i *)(wb + 64 * h));
        __m256i ql1 = _mm256_loadu_si256((const __m256i *)(wb + 64 * h + 32));
        __m256i qh = _mm256_loadu_si256((const __m256i *)(wb + 128 + 32 * h));
        u[4 * h] = _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
        u[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
        u[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), _mm256_and_si256(qh, m30));
        u[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                       _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
    }
    float d = q_h2f(q_u16(wb + 208));
    UNROLL for (int i = 0; i < NI; i++) {
        const q_x256 *x = xb[i];
        __m256i s = _mm256_setzero_si256();
        UNROLL for (int c = 0; c < 8; c++)
            s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(u[c], _mm256_loadu_si256((const __m256i *)(x->q + 32 * c))), sv[c]));
        __m256i m = _mm256_madd_epi16(s16, _mm256_loadu_si256((const __m256i *)x->bs16)); /* the codes' - 32 */
        s = _mm256_sub_epi32(s, _mm256_slli_epi32(m, 5));
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d * x->d), acc[i]);
    }
}
#endif

ALWAYS_INLINE void q_row_k(float *res, const uint8_t *wr, const q_x256 *const *xs, int nsb, const uint32_t fmt,
                           const int NI) {
    Q_KACC acc[QK_GROUP];
    __m128 accm[QK_GROUP];
    UNROLL for (int i = 0; i < NI; i++) acc[i] = q_kacc_zero(), accm[i] = _mm_setzero_ps();
    const int bb = q_block_bytes(fmt);
    for (int b = 0; b < nsb; b++) {
        const q_x256 *xb[QK_GROUP];
        UNROLL for (int i = 0; i < NI; i++) xb[i] = xs[i] + b;
        if (fmt != KVS_GGML_Q6_K)
            q4k_sb(wr + (size_t)b * bb, xb, acc, accm, fmt == KVS_GGML_Q5_K, NI);
        else
            q6k_sb(wr + (size_t)b * bb, xb, acc, NI);
    }
    for (int i = 0; i < NI; i++) {
        __m128 m = _mm_add_ps(accm[i], _mm_movehl_ps(accm[i], accm[i]));
        m = _mm_add_ss(m, _mm_movehdup_ps(m));
        res[i] = q_kacc_sum(acc[i]) + _mm_cvtss_f32(m);
    }
}

/* The thread's repacked inputs; NULL where there is no memory for them (the
 * caller takes the block path). */
static void *q_xbuf_get(size_t bytes) { return kvs_cpu_thread_scratch(bytes); }

/* false: no memory for the repacked inputs (the caller takes the 256-bit path) */
ALWAYS_INLINE bool gemv_q_k(float *out, int ld_out, const kvs_cpu_q8 *xq, const void *w, size_t row_bytes,
                               const float *bias, int n, int in_dim, int j0, int j1, const uint32_t fmt) {
    const int nsb = in_dim / 256;
    q_x256 *q_x256_buf = q_xbuf_get(sizeof(q_x256) * (size_t)n * nsb);
    if (!q_x256_buf) return false;
    for (int i = 0; i < n; i++) q_repack256(q_x256_buf + (size_t)i * nsb, xq + (size_t)i * (in_dim / 32), nsb, fmt);
    for (int j = j0; j < j1; j++) {
        const uint8_t *wr = (const uint8_t *)w + (size_t)j * row_bytes;
        for (int i0 = 0; i0 < n; i0 += QK_GROUP) {
            const q_x256 *xs[QK_GROUP];
            float r[QK_GROUP];
            int m = n - i0 < QK_GROUP ? n - i0 : QK_GROUP;
            for (int i = 0; i < m; i++) xs[i] = q_x256_buf + (size_t)(i0 + i) * nsb;
            switch (m) {
            case 1: q_row_k(r, wr, xs, nsb, fmt, 1); break;
            case 2: q_row_k(r, wr, xs, nsb, fmt, 2); break;
            case 3: q_row_k(r, wr, xs, nsb, fmt, 3); break;
            default: q_row_k(r, wr, xs, nsb, fmt, 4); break;
            }
            for (int i = 0; i < m; i++) out[(size_t)(i0 + i) * ld_out + j] = r[i] + (bias ? bias[j] : 0.0f);
        }
    }
    return true;
}

#ifdef Q_K512
/* ---- AVX-512 Q4_0: four blocks (128 weights, 72 bytes) a step ------------------------
 * One two-source word permute gathers the four blocks' 16 code bytes, one more
 * their fp16 scales (each four times: a 128-bit lane a block after vpdpbusd's
 * sums of 4); the codes unsigned (0..15, vpdpbusd) and the - 8 against the
 * inputs' block sums, which start the accumulator. The inputs repacked per four
 * blocks (q_x128): their elements 0-15, then 16-31, the - 8 * sums in each
 * block's first lane, the block scales four times. */
typedef struct {
    int8_t lo[64], hi[64];
    int32_t corr[16];
    float d[16];
} q_x128;

static void q_repack128(q_x128 *dst, const kvs_cpu_q8 *x, int nq) {
    for (int g = 0; g < nq; g++, dst++, x += 4) {
        memset(dst->corr, 0, sizeof dst->corr);
        for (int b = 0; b < 4; b++) {
            memcpy(dst->lo + 16 * b, x[b].q, 16), memcpy(dst->hi + 16 * b, x[b].q + 16, 16);
            dst->corr[4 * b] = -8 * x[b].isum;
            for (int l = 0; l < 4; l++) dst->d[4 * b + l] = x[b].d;
        }
    }
}

ALWAYS_INLINE void q_row_40(float *res, const uint8_t *wr, const q_x128 *const *xs, int nq, const int NI) {
    __m512 acc[QK_GROUP];
    UNROLL for (int i = 0; i < NI; i++) acc[i] = _mm512_setzero_ps();
    /* block b's codes: words 9b + 1 .. 9b + 8 of the 72 bytes; its scale: word 9b */
    static const int16_t iq[32] __attribute__((aligned(64))) = {1,  2,  3,  4,  5,  6,  7,  8,  10, 11, 12,
                                                                13, 14, 15, 16, 17, 19, 20, 21, 22, 23, 24,
                                                                25, 26, 28, 29, 30, 31, 32, 33, 34, 35};
    static const int16_t idv[32] __attribute__((aligned(64))) = {0,  0,  0,  0,  9,  9,  9,  9,  18, 18, 18,
                                                                 18, 27, 27, 27, 27};
    const __m512i iqv = _mm512_load_si512(iq), idd = _mm512_load_si512(idv), m4 = _mm512_set1_epi8(0xF);
    for (int g = 0; g < nq; g++) {
        const uint8_t *wb = wr + (size_t)g * 72;
        __m512i w0 = _mm512_loadu_si512(wb), w1 = _mm512_maskz_loadu_epi8(0xFF, wb + 64); /* no read past the 72 */
        __m512i v = _mm512_permutex2var_epi16(w0, iqv, w1);
        __m512 dw = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(idd, w0)));
        __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        UNROLL for (int i = 0; i < NI; i++) {
            const q_x128 *x = xs[i] + g;
            __m512i s = _mm512_dpbusd_epi32(_mm512_load_si512(x->corr), lo, _mm512_load_si512(x->lo));
            s = _mm512_dpbusd_epi32(s, hi, _mm512_load_si512(x->hi));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_load_ps(x->d)), acc[i]);
        }
    }
    for (int i = 0; i < NI; i++) res[i] = _mm512_reduce_add_ps(acc[i]);
}

/* gemv_q_40 below: the inputs in groups of four blocks */
typedef q_x128 q_x40;
enum { Q40_BLOCKS = 4 };
#define q_repack40 q_repack128
#else
/* ---- AVX2 Q4_0: two blocks a step ---------------------------------------------------
 * The codes unsigned (vpmaddubsw, vpmaddwd with ones), the - 8 against the
 * inputs' block sums, the two blocks' sums of 8 side by side (vphaddd) for one
 * f32 step. The inputs repacked per two blocks (q_x64): their codes, the - 8 *
 * sums in each block's first lane, the block scales in each block's lanes. */
typedef struct {
    int8_t q[64];
    int32_t corr[8];
    float d[8];
} q_x64;

static void q_repack64(q_x64 *dst, const kvs_cpu_q8 *x, int np) {
    for (int g = 0; g < np; g++, dst++, x += 2) {
        memset(dst->corr, 0, sizeof dst->corr);
        for (int b = 0; b < 2; b++) {
            memcpy(dst->q + 32 * b, x[b].q, 32);
            dst->corr[2 * b] = -8 * x[b].isum; /* lanes {0, 1, 4, 5}: block 0's, {2, 3, 6, 7}: block 1's */
            dst->d[2 * b] = dst->d[2 * b + 1] = dst->d[2 * b + 4] = dst->d[2 * b + 5] = x[b].d;
        }
    }
}

ALWAYS_INLINE __m256i q40_codes(const uint8_t *wb) {
    __m128i v = _mm_loadu_si128((const __m128i *)(wb + 2));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0xF));
}

ALWAYS_INLINE void q_row_40(float *res, const uint8_t *wr, const q_x64 *const *xs, int np, const int NI) {
    __m256 acc[QK_GROUP];
    UNROLL for (int i = 0; i < NI; i++) acc[i] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int g = 0; g < np; g++) {
        const uint8_t *wb = wr + (size_t)g * 36;
        __m256i u0 = q40_codes(wb), u1 = q40_codes(wb + 18);
        __m128 d2 = _mm_cvtph_ps(_mm_cvtsi32_si128((int)((uint32_t)q_u16(wb) | (uint32_t)q_u16(wb + 18) << 16)));
        d2 = _mm_permute_ps(d2, 0x50); /* d0 d0 d1 d1 */
        __m256 dw = _mm256_set_m128(d2, d2);
        UNROLL for (int i = 0; i < NI; i++) {
            const q_x64 *x = xs[i] + g;
            __m256i t0 = _mm256_madd_epi16(_mm256_maddubs_epi16(u0, _mm256_loadu_si256((const __m256i *)x->q)), ones);
            __m256i t1 = _mm256_madd_epi16(_mm256_maddubs_epi16(u1, _mm256_loadu_si256((const __m256i *)(x->q + 32))), ones);
            __m256i s = _mm256_add_epi32(_mm256_hadd_epi32(t0, t1), _mm256_loadu_si256((const __m256i *)x->corr));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, _mm256_loadu_ps(x->d)), acc[i]);
        }
    }
    for (int i = 0; i < NI; i++) res[i] = q_acc_sum(acc[i]);
}

/* gemv_q_40 below: the inputs in groups of two blocks */
typedef q_x64 q_x40;
enum { Q40_BLOCKS = 2 };
#define q_repack40 q_repack64
#endif
/* false: the blocks are not whole groups of Q40_BLOCKS, or no memory (the caller takes the block path) */
ALWAYS_INLINE bool gemv_q_40(float *out, int ld_out, const kvs_cpu_q8 *xq, const void *w, size_t row_bytes,
                             const float *bias, int n, int in_dim, int j0, int j1) {
    const int nb = in_dim / 32, ng = nb / Q40_BLOCKS;
    if (nb % Q40_BLOCKS) return false;
    q_x40 *buf = q_xbuf_get(sizeof(q_x40) * (size_t)n * ng);
    if (!buf) return false;
    for (int i = 0; i < n; i++) q_repack40(buf + (size_t)i * ng, xq + (size_t)i * nb, ng);
    for (int j = j0; j < j1; j++) {
        const uint8_t *wr = (const uint8_t *)w + (size_t)j * row_bytes;
        for (int i0 = 0; i0 < n; i0 += QK_GROUP) {
            const q_x40 *xs[QK_GROUP];
            float r[QK_GROUP];
            int m = n - i0 < QK_GROUP ? n - i0 : QK_GROUP;
            for (int i = 0; i < m; i++) xs[i] = buf + (size_t)(i0 + i) * ng;
            switch (m) {
            case 1: q_row_40(r, wr, xs, ng, 1); break;
            case 2: q_row_40(r, wr, xs, ng, 2); break;
            case 3: q_row_40(r, wr, xs, ng, 3); break;
            default: q_row_40(r, wr, xs, ng, 4); break;
            }
            for (int i = 0; i < m; i++) out[(size_t)(i0 + i) * ld_out + j] = r[i] + (bias ? bias[j] : 0.0f);
        }
    }
    return true;
}
#endif

/* 32-element block g of the row (at wb) into the sums of parity par (a constant:
 * the sums stay in registers). */
#define Q_BLOCK32(wb, g, par)                                                                                      \
    do {                                                                                                           \
        const kvs_cpu_q8 *xb_[QK_GROUP];                                                                           \
        for (int i_ = 0; i_ < NI; i_++) xb_[i_] = xs[i_] + (g);                                                    \
        q_chunk(wb, fmt, 0, xb_, acc[par], corr[par], NI);                                                         \
    } while (0)

/* One weight row against NI inputs (their blocks xs[i]): res[i]. */
ALWAYS_INLINE void q_row(float *res, const uint8_t *wr, const kvs_cpu_q8 *const *xs, int in_dim, const uint32_t fmt,
                         const int NI) {
    const int blk = q_block(fmt), bb = q_block_bytes(fmt), cpb = blk / 32, nblk = in_dim / blk;
    Q_ACC acc[2][QK_GROUP];
    float corr[2][QK_GROUP];
    for (int p = 0; p < 2; p++)
        for (int i = 0; i < NI; i++) acc[p][i] = q_acc_zero(), corr[p][i] = 0;
    if (cpb == 1) { /* blocks two at a time, even and odd apart */
        int b = 0;
        for (; b + 2 <= nblk; b += 2) {
            Q_BLOCK32(wr + (size_t)b * bb, b, 0);
            Q_BLOCK32(wr + (size_t)(b + 1) * bb, b + 1, 1);
        }
        if (b < nblk) Q_BLOCK32(wr + (size_t)b * bb, b, 0);
    } else { /* K blocks (one f32 step each: one chain suffices); activations scaled per 256 */
        for (int b = 0; b < nblk; b++) {
            const kvs_cpu_q8 *xb[QK_GROUP];
            for (int i = 0; i < NI; i++) xb[i] = xs[i] + 8 * b;
            q_kblock(wr + (size_t)b * bb, fmt, xb, acc[0], corr[0], NI);
        }
    }
    for (int i = 0; i < NI; i++) res[i] = q_acc_sum(acc[0][i] + acc[1][i]) + (corr[0][i] + corr[1][i]);
}

ALWAYS_INLINE void gemv_q_t(float *out, int ld_out, const kvs_cpu_q8 *xq, const void *w, size_t row_bytes,
                            const float *bias, int n, int in_dim, int j0, int j1, const uint32_t fmt) {
    int nb = in_dim / 32;
#if VL > 1
    if ((fmt == KVS_GGML_Q4_K || fmt == KVS_GGML_Q5_K || fmt == KVS_GGML_Q6_K) &&
        gemv_q_k(out, ld_out, xq, w, row_bytes, bias, n, in_dim, j0, j1, fmt))
        return;
#endif
#if VL > 1
    if (fmt == KVS_GGML_Q4_0 && gemv_q_40(out, ld_out, xq, w, row_bytes, bias, n, in_dim, j0, j1)) return;
#endif
    for (int j = j0; j < j1; j++) {
        const uint8_t *wr = (const uint8_t *)w + (size_t)j * row_bytes;
        for (int i0 = 0; i0 < n; i0 += QK_GROUP) {
            const kvs_cpu_q8 *xs[QK_GROUP];
            float r[QK_GROUP];
            int m = n - i0 < QK_GROUP ? n - i0 : QK_GROUP;
            for (int i = 0; i < m; i++) xs[i] = xq + (size_t)(i0 + i) * nb;
            switch (m) { /* the group's size as a constant: its accumulators stay in registers */
            case 1: q_row(r, wr, xs, in_dim, fmt, 1); break;
            case 2: q_row(r, wr, xs, in_dim, fmt, 2); break;
            case 3: q_row(r, wr, xs, in_dim, fmt, 3); break;
            default: q_row(r, wr, xs, in_dim, fmt, 4); break;
            }
            for (int i = 0; i < m; i++) out[(size_t)(i0 + i) * ld_out + j] = r[i] + (bias ? bias[j] : 0.0f);
        }
    }
}

static void gemv_q(float *out, int ld_out, const kvs_cpu_q8 *xq, const void *w, uint32_t type, size_t row_bytes,
                   const float *bias, int n, int in_dim, int j0, int j1) {
    if (n > KVS_CPU_GEMV_MAX_N) n = KVS_CPU_GEMV_MAX_N;
#define GEMV_Q(T) gemv_q_t(out, ld_out, xq, w, row_bytes, bias, n, in_dim, j0, j1, T)
    switch (type) {
    case KVS_GGML_Q4_0: GEMV_Q(KVS_GGML_Q4_0); break;
    case KVS_GGML_Q4_1: GEMV_Q(KVS_GGML_Q4_1); break;
    case KVS_GGML_Q5_0: GEMV_Q(KVS_GGML_Q5_0); break;
    case KVS_GGML_Q5_1: GEMV_Q(KVS_GGML_Q5_1); break;
    case KVS_GGML_Q8_0: GEMV_Q(KVS_GGML_Q8_0); break;
    case KVS_GGML_Q4_K: GEMV_Q(KVS_GGML_Q4_K); break;
    case KVS_GGML_Q5_K: GEMV_Q(KVS_GGML_Q5_K); break;
    case KVS_GGML_Q6_K: GEMV_Q(KVS_GGML_Q6_K); break;
    default: break; /* the op checks the type */
    }
#undef GEMV_Q
}
