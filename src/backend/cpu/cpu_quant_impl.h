/* The quantized gemv of cpu_simd.h (gemv_q), included by cpu_simd_impl.h for
 * each set: plain C where VL is 1 (the generic set: the reference), 256-bit
 * integer vectors otherwise (AVX2's maddubs; the AVX-512 set's file has VNNI,
 * one vpdpbusd instead of three instructions). 256 bits suit every format: a
 * chunk of 32 weights is what one scale covers (16 for Q6_K, split in lanes).
 *
 * Every format goes through one form: weights a chunk of 32 at a time as
 * small integers u[32] with scales sl (elements 0..15), sh (16..31) and offset
 * coefficients cl, ch, so that the chunk's dot with an activation block x is
 *   sl * x.d * sum_{k<16} u[k] q[k] + sh * x.d * sum_{k>=16} u[k] q[k]
 *     + cl * x.s[0] + ch * x.s[1]
 * (Q4_0: u = nibble, cl = ch = -8 d; Q4_1: cl = ch = m; Q4_K: sl = d * sc,
 * cl = -dmin * m; Q6_K: u = the 6-bit code, cl = -32 sl, ...; Q8_0: u the
 * signed codes, no offsets). Chunk c of a row meets activation block c.
 * A row's sum for one input is the same sequence of operations whatever the
 * other inputs, n or the rows' split: the scalar sums are explicit fmaf, since
 * the compiler's own contraction of a * b + c * d differed with the group size. */
#include <math.h>
#include <string.h>

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

/* Chunk c's scales {sl, sh, cl, ch} (see the top); h2f converts an fp16. */
#define Q_SCALES(fmt, b, c, s, h2f)                                                                                \
    do {                                                                                                           \
        float d_;                                                                                                  \
        switch (fmt) {                                                                                             \
        case KVS_GGML_Q4_0: d_ = h2f(q_u16(b)), s[0] = s[1] = d_, s[2] = s[3] = -8 * d_; break;                    \
        case KVS_GGML_Q5_0: d_ = h2f(q_u16(b)), s[0] = s[1] = d_, s[2] = s[3] = -16 * d_; break;                   \
        case KVS_GGML_Q4_1:                                                                                        \
        case KVS_GGML_Q5_1: s[0] = s[1] = h2f(q_u16(b)), s[2] = s[3] = h2f(q_u16(b + 2)); break;                    \
        case KVS_GGML_Q8_0: s[0] = s[1] = h2f(q_u16(b)), s[2] = s[3] = 0; break;                                    \
        case KVS_GGML_Q4_K:                                                                                        \
        case KVS_GGML_Q5_K: {                                                                                      \
            int sc_, m_;                                                                                           \
            q_scale_min(c, b + 4, &sc_, &m_);                                                                      \
            s[0] = s[1] = h2f(q_u16(b)) * (float)sc_, s[2] = s[3] = -h2f(q_u16(b + 2)) * (float)m_;                \
            break;                                                                                                 \
        }                                                                                                          \
        default: { /* Q6_K: chunk c = 4 * half + k takes scales 8 * half + 2k, + 1 */                              \
            const int8_t *sc_ = (const int8_t *)(b + 192) + 8 * ((c) / 4) + 2 * ((c) % 4);                         \
            d_ = h2f(q_u16(b + 208));                                                                              \
            s[0] = d_ * (float)sc_[0], s[1] = d_ * (float)sc_[1], s[2] = -32 * s[0], s[3] = -32 * s[1];             \
        }                                                                                                          \
        }                                                                                                          \
    } while (0)

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
            u[l] = (qs[l] & 0xF) | (int)((h >> l) & 1) << 4;
            u[l + 16] = (qs[l] >> 4) | (int)((h >> (l + 16)) & 1) << 4;
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
        for (int l = 0; l < 32; l++) u[l] = (k < 2 ? ql[l] & 0xF : ql[l] >> 4) | ((qh[l] >> (2 * k)) & 3) << 4;
    }
    }
}

/* The chunk's dot terms with every input of the group: exact integer sums per
 * 16, then f32. */
ALWAYS_INLINE void q_chunk(const uint8_t *b, const uint32_t fmt, int c, const kvs_cpu_q8 *const *xb, float *acc,
                           float *corr, const int NI) {
    int u[32];
    float s[4];
    q_unpack(b, fmt, c, u);
    Q_SCALES(fmt, b, c, s, kvs_f16_to_f32);
    for (int i = 0; i < NI; i++) {
        const kvs_cpu_q8 *x = xb[i];
        int lo = 0, hi = 0;
        for (int l = 0; l < 16; l++) lo += u[l] * x->q[l], hi += u[l + 16] * x->q[l + 16];
        acc[i] = fmaf((float)hi, s[1] * x->d, fmaf((float)lo, s[0] * x->d, acc[i]));
        corr[i] = fmaf(s[3], x->s[1], fmaf(s[2], x->s[0], corr[i]));
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
        return five ? _mm256_or_si256(u, q_bits16(qh)) : u;
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
        return _mm256_or_si256(u, _mm256_slli_epi16(h, 4));
    }
    }
}

ALWAYS_INLINE void q_chunk(const uint8_t *b, const uint32_t fmt, int c, const kvs_cpu_q8 *const *xb, __m256 *acc,
                           float *corr, const int NI) {
    __m256i u = q_unpack(b, fmt, c);
    float s[4];
    Q_SCALES(fmt, b, c, s, q_h2f);
    const bool sgn = fmt == KVS_GGML_Q8_0, split = fmt == KVS_GGML_Q6_K, off = fmt != KVS_GGML_Q8_0;
    __m256i ua = sgn ? _mm256_abs_epi8(u) : u; /* signed weights: |w| times x with w's sign */
    for (int i = 0; i < NI; i++) {
        const kvs_cpu_q8 *x = xb[i];
        __m256i xv = _mm256_loadu_si256((const __m256i *)x->q);
        __m256i dot = q_dot(ua, sgn ? _mm256_sign_epi8(xv, u) : xv);
        __m256 sc = split ? _mm256_set_m128(_mm_set1_ps(s[1] * x->d), _mm_set1_ps(s[0] * x->d))
                          : _mm256_set1_ps(s[0] * x->d);
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sc, acc[i]);
        if (off) corr[i] = fmaf(s[3], x->s[1], fmaf(s[2], x->s[0], corr[i]));
    }
}
#endif

/* One weight row against NI inputs (their blocks xs[i]): res[i]. */
ALWAYS_INLINE void q_row(float *res, const uint8_t *wr, const kvs_cpu_q8 *const *xs, int in_dim, const uint32_t fmt,
                         const int NI) {
    const int blk = q_block(fmt), bb = q_block_bytes(fmt), cpb = blk / 32;
    Q_ACC acc[QK_GROUP];
    float corr[QK_GROUP];
    for (int i = 0; i < NI; i++) acc[i] = q_acc_zero(), corr[i] = 0;
    for (int b = 0; b < in_dim / blk; b++) {
        const uint8_t *wb = wr + (size_t)b * bb;
        UNROLL for (int c = 0; c < cpb; c++) {
            const kvs_cpu_q8 *xb[QK_GROUP];
            for (int i = 0; i < NI; i++) xb[i] = xs[i] + b * cpb + c;
            q_chunk(wb, fmt, c, xb, acc, corr, NI);
        }
    }
    for (int i = 0; i < NI; i++) res[i] = q_acc_sum(acc[i]) + corr[i];
}

ALWAYS_INLINE void gemv_q_t(float *out, int ld_out, const kvs_cpu_q8 *xq, const void *w, size_t row_bytes,
                            const float *bias, int n, int in_dim, int j0, int j1, const uint32_t fmt) {
    int nb = in_dim / 32;
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
