/* The exact (fp32) product of one activation row with Q4_0, Q4_1 and Q8_0 rows (32-value
 * blocks: the default model's file is Q4_1 with a Q8_0 head) for the avx512 and avx2 levels:
 * quant.c's T = 1 path for them. Included by quant.c after quant_t1.h, whose scheme it follows:
 *   - a block's scale comes out of its sum: sum_i (d q_i + m) x_i = d sum_i q_i x_i + m sum_i x_i
 *     (Q4_0: m = -8 d; Q8_0's signed bytes are made unsigned by an xor, m = -128 d), with
 *     sum_i x_i per block computed once per call;
 *   - a 256-bit vector holds whole blocks (2 blocks of 16 quant bytes, or Q8_0's 32), and the
 *     k-th byte of each 32-bit lane is masked in place and converted (q 2^e, exact), times the
 *     activation it multiplies stored as x 2^-e: an and, a conversion and an FMA per 8
 *     weights, plus the scales once per vector.
 * The weights are the same numbers as the dequantized ones (d q + m rounded once); only the
 * order and grouping of the sums differs: x @ W^T up to fp32 summation error. */
#ifndef PDSERVE_QUANT_T1_B32_H
#define PDSERVE_QUANT_T1_B32_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "quant_t1.h"

#define B32_TYPE(type) ((type) == Q4_0 || (type) == Q4_1 || (type) == Q8_0)
/* 256-bit vectors at both levels: on Zen 4 (AVX-512 ops split in two halves) the 512-bit form
 * of this code, 4 blocks per vector, measured 1.2x slower per core than this one, and two
 * cores of either form are near the memory's bandwidth. */
#define B32_LANES 8
/* Blocks per vector, vectors per vector's worth of blocks (a "group"), and the floats a group
 * of the prepared activations takes (its x, then 8 term slots: [t0, u0, t1, u1, ...], t_b
 * multiplying d_b and u_b multiplying Q4_1's m_b). */
#define B32_BLOCKS(type) ((type) == Q8_0 ? B32_LANES / 8 : B32_LANES / 4)
#define B32_VECS(type) ((type) == Q8_0 ? 4 : 8)
#define B32_GROUP(type) (B32_VECS(type) * B32_LANES + 8)

/* The exponent of vector i's quants (the top byte or nibble is shifted down instead: its 32-bit
 * lane would be negative, and AVX2 converts signed lanes only). */
static inline int b32_exponent(int type, int i) {
    const int k = i % 4, h = i / 4; /* byte k of each lane; Q4's high nibble for h = 1 */
    if (k == 3 && (type == Q8_0 || h == 1)) return 0;
    return 8 * k + 4 * h;
}

/* The value within a group of lane d of vector i. */
static inline int b32_value(int type, int i, int d) {
    const int k = i % 4, h = i / 4;
    return type == Q8_0 ? 32 * (d / 8) + 4 * (d % 8) + k : 32 * (d / 4) + 16 * h + 4 * (d % 4) + k;
}

/* The s of t1_prep for a row of K values (a multiple of 8). */
static int b32_shift(const float *x, int64_t K) {
    v8 m = splat(0.0f);
    for (int64_t i = 0; i < K; i += 8) m = vmax(m, (v8)((v8i)load8(x + i) & 0x7FFFFFFF));
    float amax = 0.0f;
    for (int i = 0; i < 8; i++) amax = fmaxf(amax, m[i]);
    const int s = amax > 0.0f && isfinite(amax) ? -ilogbf(amax) : 0;
    return s < -64 ? -64 : s > 64 ? 64 : s;
}

/* Groups of x (K a multiple of 32, ng groups, the last one zero-padded), times 2^s as in
 * t1_prep; returns 2^-s. */
static float b32_prep(int type, const float *x, int64_t K, int64_t ng, float *out) {
    const int s = b32_shift(x, K);
    const int nb = B32_BLOCKS(type), nv = B32_VECS(type), gs = B32_GROUP(type);
    const int term_slot = type == Q4_1; /* Q4_1's sums multiply m, the others' d */
    const float term = ldexpf(type == Q4_0 ? -8.0f : type == Q8_0 ? -128.0f : 1.0f, s);
    float pow2[8];
    for (int i = 0; i < nv; i++) pow2[i] = ldexpf(1.0f, s - b32_exponent(type, i));
    for (int64_t g = 0; g < ng; g++) {
        float *o = out + g * gs;
        const int64_t v0 = g * nb * 32, nvalues = K - v0 < nb * 32 ? K - v0 : nb * 32;
        const float *xg = x + v0;
        for (int i = 0; i < nv; i++)
            for (int d = 0; d < B32_LANES; d++) {
                const int v = b32_value(type, i, d);
                o[B32_LANES * i + d] = v < nvalues ? xg[v] * pow2[i] : 0.0f;
            }
        float *t = o + nv * B32_LANES;
        memset(t, 0, 8 * sizeof(float));
        for (int b = 0; b < nb && 32 * b < nvalues; b++) {
            const v8 sum = load8(xg + 32 * b) + load8(xg + 32 * b + 8) + load8(xg + 32 * b + 16) + load8(xg + 32 * b + 24);
            t[2 * b + term_slot] = hsum(sum) * term;
        }
    }
    return ldexpf(1.0f, -s);
}

static inline int32_t b32_word(const uint8_t *p, int type) { /* a block's d (and Q4_1's m) */
    int32_t w;
    memcpy(&w, p, 4);
    return type == Q4_1 ? w : w & 0xFFFF; /* the bytes after d are quants: never read as fp16 */
}

typedef __m256 b32v;
#define B32_ZERO _mm256_setzero_ps()
static inline __attribute__((always_inline)) void b32_group(int type, const uint8_t *p, const float *xg, __m256 *acc,
                                                            __m256 *acct) {
    const int B = BLOCK_BYTES[type];
    if (type == Q8_0) {
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(b32_word(p, type)));
        *acct = _mm256_fmadd_ps(_mm256_zextps128_ps256(dm), _mm256_loadu_ps(xg + 4 * 8), *acct);
        const __m256 d = _mm256_broadcastss_ps(dm);
        const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + 2)), _mm256_set1_epi8((char)0x80));
        __m256 a[2] = {B32_ZERO, B32_ZERO};
        for (int k = 0; k < 4; k++) {
            const __m256i q = k < 3 ? _mm256_and_si256(v, _mm256_set1_epi32(255 << (8 * k))) : _mm256_srli_epi32(v, 24);
            a[k / 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_loadu_ps(xg + 8 * k), a[k / 2]);
        }
        *acc = _mm256_fmadd_ps(_mm256_add_ps(a[0], a[1]), d, *acc);
        return;
    }
    const __m128 dm = _mm_cvtph_ps(_mm_setr_epi32(b32_word(p, type), b32_word(p + B, type), 0, 0));
    *acct = _mm256_fmadd_ps(_mm256_zextps128_ps256(dm), _mm256_loadu_ps(xg + 8 * 8), *acct);
    const __m256 d = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(dm), _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2));
    const int qs = type == Q4_1 ? 4 : 2;
    const __m256i v = _mm256_loadu2_m128i((const __m128i *)(p + B + qs), (const __m128i *)(p + qs));
    __m256 a[2] = {B32_ZERO, B32_ZERO};
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 4; k++) {
            const int e = 8 * k + 4 * h;
            const __m256i q = e < 28 ? _mm256_and_si256(v, _mm256_set1_epi32(15 << e)) : _mm256_srli_epi32(v, 28);
            a[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_loadu_ps(xg + 8 * (4 * h + k)), a[h]);
        }
    *acc = _mm256_fmadd_ps(_mm256_add_ps(a[0], a[1]), d, *acc);
}
static inline float b32_sum(__m256 acc, __m256 acct) { return hsum((v8)_mm256_add_ps(acc, acct)); }

/* y[n] for n in [n0, n1): rows of K / 32 blocks, rb bytes apart; X from b32_prep. A row's last
 * group, when it is not whole, is read from a zeroed copy (scales 0), so nothing past the row
 * is read. */
static inline __attribute__((always_inline)) void b32_rows(int type, const uint8_t *w, int64_t rb, int64_t n0, int64_t n1,
                                                           int64_t K, const float *X, float unscale, float *y) {
    const int B = BLOCK_BYTES[type], nb = B32_BLOCKS(type), gs = B32_GROUP(type);
    const int64_t blocks = K / 32, full = blocks / nb, rest = blocks % nb;
    for (int64_t n = n0; n < n1; n++) {
        b32v acc = B32_ZERO;
        __m256 acct = _mm256_setzero_ps();
        const uint8_t *row = w + n * rb;
        for (int64_t g = 0; g < full; g++) {
            T1_PREFETCH(row + g * nb * B, nb * B);
            b32_group(type, row + g * nb * B, X + g * gs, &acc, &acct);
        }
        if (rest) {
            uint8_t tail[4 * 34] = {0};
            memcpy(tail, row + full * nb * B, (size_t)(rest * B));
            b32_group(type, tail, X + full * gs, &acc, &acct);
        }
        y[n] = b32_sum(acc, acct) * unscale;
    }
}
#define B32_ROWS(TYPE)                                                                                    \
    static void b32_rows_##TYPE(const uint8_t *w, int64_t rb, int64_t n0, int64_t n1, int64_t K, const float *X, \
                                float unscale, float *y) {                                                \
        b32_rows(TYPE, w, rb, n0, n1, K, X, unscale, y);                                                  \
    }
B32_ROWS(Q4_0) B32_ROWS(Q4_1) B32_ROWS(Q8_0)
#endif
