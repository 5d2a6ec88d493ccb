/* The exact (fp32) product of one activation row with Q4_K and Q6_K rows, the two types of a
 * Q4_K_M file, for the avx512 and avx2 levels (quant.c's T = 1 path for them). Included by quant.c.
 *
 * Per 16 (AVX-512) or 8 (AVX2) weights only an and, an int-to-float conversion and one FMA
 * remain (no shuffle; Q6_K merges its high bits into the bytes first, a few ops per 64 values):
 *   - the scales come out of the inner sum: sum_i (s q_i + m) x_i = s sum_i q_i x_i + m sum_i x_i,
 *     with sum_i x_i per sub-block computed once per call (Q4_K's mins, Q6_K's offset 32);
 *   - the quants are not spread one per lane: a 32-bit lane of a load holds 4 bytes, and the
 *     k-th byte's quant is masked in place and converted, giving q 2^e (e = 8 k, + 4 for a high
 *     nibble; q has at most 6 bits, so the float is exact); the activation it multiplies is
 *     stored as x 2^-e, also exact, so lane d of the k-th vector is value 4 d + k of the bytes;
 *   - the activations are put in that order and scaled once per call (t1_prep), shared by
 *     every row.
 * The weights are the same numbers as the dequantized ones (s q + m rounded once); only the
 * order and grouping of the sums differs: x @ W^T up to fp32 summation error. */
#ifndef PDSERVE_QUANT_T1_H
#define PDSERVE_QUANT_T1_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

#define T1_TYPE(type) ((type) == Q4_K || (type) == Q6_K)

#ifdef __AVX512F__
#define T1_LANES 16
typedef __m512 t1v;
#define T1_ZERO _mm512_setzero_ps()
#else
#define T1_LANES 8
typedef __m256 t1v;
#define T1_ZERO _mm256_setzero_ps()
#endif
/* One 256-value chunk of an activation row: its values in the order the chunk's bytes unpack
 * to (T1_LANES at a time), and per sub-block the term that multiplies the weights' offsets:
 * Q4_K lanes 8..15 (AVX2: 0..7) -sum x over its 32 values; Q6_K per 16 values -32 sum x. */
typedef struct { float x[256], term[16]; } x_chunk;

/* The power of two the quant of vector i comes with (AVX2's top nibble is shifted down instead:
 * its 32-bit lane would be negative, and AVX2 converts signed lanes only). */
static inline int t1_exponent(int type, int i) {
    const int k = i % 4;
#ifdef __AVX512F__
    return type == Q4_K ? 8 * k + 4 * (i / 4 % 2) : 8 * k;
#else
    return type == Q4_K ? (i % 8 == 7 ? 0 : 8 * k + 4 * (i / 4 % 2)) : 8 * k;
#endif
}

/* The activation index of lane d of vector i of a chunk. */
static inline int t1_value(int type, int i, int d) {
    const int k = i % 4, b = 4 * d + k;
#ifdef __AVX512F__ /* i = 8 g + 4 h + k: 64 bytes at a time, h the nibble */
    const int g = i / 8, h = i / 4 % 2;
    return type == Q4_K ? 64 * (2 * g + b / 32) + 32 * h + b % 32 : 128 * g + 64 * h + b;
#else /* Q4_K: i = 8 j + 4 h + k (32 bytes, one 64-value run); Q6_K: i = 16 r + 8 h + 4 e + k */
    return type == Q4_K ? 64 * (i / 8) + 32 * (i / 4 % 2) + b : 128 * (i / 16) + 64 * (i / 8 % 2) + 32 * (i / 4 % 2) + b;
#endif
}

/* Per type (0 Q4_K, 1 Q6_K): the activation index of each slot of a chunk, and the exponent
 * of each vector; filled when the library loads. */
static uint8_t t1_index[2][256];
static int8_t t1_exp[2][256 / T1_LANES];
static void __attribute__((constructor)) t1_tables(void) {
    for (int t = 0; t < 2; t++)
        for (int i = 0; i < 256 / T1_LANES; i++) {
            t1_exp[t][i] = (int8_t)t1_exponent(t ? Q6_K : Q4_K, i);
            for (int d = 0; d < T1_LANES; d++) t1_index[t][T1_LANES * i + d] = (uint8_t)t1_value(t ? Q6_K : Q4_K, i, d);
        }
}

/* The chunks of x (K a multiple of 256), times 2^s; returns 2^-s, which the sums are scaled
 * back by. s brings max |x| to [1, 2) (within 2^+-64) so that x 2^(s - e) stays normal for
 * every activation the sums can notice, and nothing overflows; s = 0 for a zero or non-finite
 * row. Multiplying by a power of two rounds only where the result is subnormal. */
static float t1_prep(int type, const float *x, int64_t K, x_chunk *out) {
    v8 m = splat(0.0f); /* max |x| of the lanes, NaN skipped */
    for (int64_t i = 0; i < K; i += 8) m = vmax(m, (v8)((v8i)load8(x + i) & 0x7FFFFFFF));
    float amax = 0.0f;
    for (int i = 0; i < 8; i++) amax = fmaxf(amax, m[i]);
    int s = amax > 0.0f && isfinite(amax) ? -ilogbf(amax) : 0;
    s = s < -64 ? -64 : s > 64 ? 64 : s;
    const int t = type == Q6_K, run = t ? 16 : 32, first = !t && T1_LANES == 16 ? 8 : 0;
    const uint8_t *index = t1_index[t];
    float pow2[256 / T1_LANES];
    for (int i = 0; i < 256 / T1_LANES; i++) pow2[i] = ldexpf(1.0f, s - t1_exp[t][i]);
    const float term = ldexpf(t ? -32.0f : -1.0f, s);
    for (int64_t c = 0; c < K / 256; c++) {
        const float *xc = x + 256 * c;
        x_chunk *o = out + c;
        for (int i = 0; i < 256 / T1_LANES; i++)
            for (int d = 0; d < T1_LANES; d++) o->x[T1_LANES * i + d] = xc[index[T1_LANES * i + d]] * pow2[i];
        memset(o->term, 0, sizeof(o->term));
        for (int r = 0; r < 256 / run; r++) {
            v8 sum = load8(xc + run * r) + load8(xc + run * r + 8);
            if (run == 32) sum += load8(xc + run * r + 16) + load8(xc + run * r + 24);
            o->term[first + r] = hsum(sum) * term;
        }
    }
    return ldexpf(1.0f, -s);
}

#define T1_PREFETCH(p, bytes)                                                               \
    for (int o_ = 0; o_ < (bytes); o_ += 64) __builtin_prefetch((const char *)(p) + PREFETCH + o_)

#ifdef __AVX512F__
static inline __m512 lanes16(__m512 v, int a, int b) { /* v[a] in lanes 0..7, v[b] in 8..15 */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b), v);
}

/* acc + a Q4_K super-block at p times X. */
static inline __attribute__((always_inline)) void t1_q4_k(const uint8_t *p, const x_chunk *X, __m512 acc[2]) {
    uint32_t d2;
    memcpy(&d2, p, 4);
    const v8 dd = half8((u16x8)(uint32_t __attribute__((vector_size(16)))){d2});
    /* scales s (lanes 0..7) and mins (8..15) times d and dmin */
    const __m512 sm = (__m512)(u8_float(k_scale_bytes(p + 4)) *
                               __builtin_shufflevector(dd, dd, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
    acc[1] = _mm512_fmadd_ps(sm, _mm512_loadu_ps(X->term), acc[1]);
    for (int g = 0; g < 2; g++) { /* 64 bytes: runs 2g (lanes 0..7) and 2g + 1 (8..15) */
        const __m512i v = _mm512_loadu_si512(p + 16 + 64 * g);
        for (int h = 0; h < 2; h++) {
            const float *xv = X->x + 16 * (8 * g + 4 * h);
            __m512 a = _mm512_setzero_ps();
            for (int k = 0; k < 4; k++) /* unsigned: the top nibble sets bit 31 */
                a = _mm512_fmadd_ps(_mm512_cvtepu32_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)(15u << (8 * k + 4 * h))))),
                                    _mm512_loadu_ps(xv + 16 * k), a);
            acc[g] = _mm512_fmadd_ps(a, lanes16(sm, 4 * g + h, 4 * g + 2 + h), acc[g]);
        }
    }
}

/* acc + a Q6_K super-block at p times X. */
static inline __attribute__((always_inline)) void t1_q6_k(const uint8_t *p, const x_chunk *X, __m512 acc[2]) {
    const __m512 sc = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 192)))),
                                    _mm512_set1_ps(_cvtsh_ss(ldh(p + 208))));
    acc[1] = _mm512_fmadd_ps(sc, _mm512_loadu_ps(X->term), acc[1]);
    const __m512i low = _mm512_set1_epi8(15), two = _mm512_set1_epi8(0x30);
    for (int r = 0; r < 2; r++) { /* 128 values: ql[64 r ..], qh[32 r ..] (in both halves) */
        const __m512i ql = _mm512_loadu_si512(p + 64 * r);
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p + 128 + 32 * r)));
        for (int h = 0; h < 2; h++) { /* byte b: value 64 h + b, high bits 2 (2 h + b / 32) of qh */
            const __m512i nib = _mm512_and_si512(h ? _mm512_srli_epi16(ql, 4) : ql, low);
            const __m512i hi = h ? _mm512_srlv_epi64(qh, _mm512_setr_epi64(0, 0, 0, 0, 2, 2, 2, 2))
                                 : _mm512_sllv_epi64(qh, _mm512_setr_epi64(4, 4, 4, 4, 2, 2, 2, 2));
            const __m512i q = _mm512_ternarylogic_epi32(nib, hi, two, 0xF8); /* nib | (hi & 0x30) */
            const float *xv = X->x + 16 * (8 * r + 4 * h);
            __m512 a = _mm512_setzero_ps();
            for (int k = 0; k < 4; k++)
                a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(63 << (8 * k)))),
                                    _mm512_loadu_ps(xv + 16 * k), a);
            const int l = 8 * r + 4 * h; /* lane d: sub-block l + d / 4 */
            const __m512 s = _mm512_permutexvar_ps(_mm512_setr_epi32(l, l, l, l, l + 1, l + 1, l + 1, l + 1, l + 2, l + 2,
                                                                     l + 2, l + 2, l + 3, l + 3, l + 3, l + 3), sc);
            acc[r] = _mm512_fmadd_ps(a, s, acc[r]);
        }
    }
}
static inline float t1_sum(const __m512 acc[2]) { return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1])); }
#else
static inline __m256 f8(const float *p) { return _mm256_loadu_ps(p); }

static inline __attribute__((always_inline)) void t1_q4_k(const uint8_t *p, const x_chunk *X, __m256 acc[2]) {
    const __m128i scm = (__m128i)k_scale_bytes(p + 4);
    const __m256 s8 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(scm)), _mm256_set1_ps(_cvtsh_ss(ldh(p))));
    const __m256 m8 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(scm, 8))),
                                    _mm256_set1_ps(_cvtsh_ss(ldh(p + 2))));
    acc[1] = _mm256_fmadd_ps(m8, f8(X->term), acc[1]);
    float sv[8]; /* broadcast from memory: a load, where a permute takes a vector slot */
    _mm256_storeu_ps(sv, s8);
    for (int j = 0; j < 4; j++) { /* 32 bytes: run 2 j in the low nibbles, 2 j + 1 high */
        const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * j));
        for (int h = 0; h < 2; h++) {
            const float *xv = X->x + 8 * (8 * j + 4 * h);
            __m256 a = _mm256_setzero_ps();
            for (int k = 0; k < 4; k++) {
                const int e = 8 * k + 4 * h;
                const __m256i q = e < 28 ? _mm256_and_si256(v, _mm256_set1_epi32(15 << e)) : _mm256_srli_epi32(v, 28);
                a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), f8(xv + 8 * k), a);
            }
            acc[j % 2] = _mm256_fmadd_ps(a, _mm256_broadcast_ss(sv + 2 * j + h), acc[j % 2]);
        }
    }
}

static inline __attribute__((always_inline)) void t1_q6_k(const uint8_t *p, const x_chunk *X, __m256 acc[2]) {
    const __m128i sb = _mm_loadu_si128((const __m128i *)(p + 192));
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(ldh(p + 208)));
    const __m256 sc[2] = {_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sb)), d),
                          _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sb, 8))), d)};
    acc[1] = _mm256_fmadd_ps(sc[0], f8(X->term), _mm256_fmadd_ps(sc[1], f8(X->term + 8), acc[1]));
    const __m256i low = _mm256_set1_epi8(15), two = _mm256_set1_epi8(0x30);
    for (int r = 0; r < 2; r++) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * r));
        for (int e = 0; e < 2; e++) {
            const __m256i ql = _mm256_loadu_si256((const __m256i *)(p + 64 * r + 32 * e));
            for (int h = 0; h < 2; h++) { /* value 64 h + 32 e + b: high bits 2 (2 h + e) of qh[b] */
                const int sh = 4 - 2 * (2 * h + e);
                const __m256i hi = sh > 0 ? _mm256_slli_epi16(qh, sh) : sh < 0 ? _mm256_srli_epi16(qh, -sh) : qh;
                const __m256i q = _mm256_or_si256(_mm256_and_si256(h ? _mm256_srli_epi16(ql, 4) : ql, low),
                                                  _mm256_and_si256(hi, two));
                const float *xv = X->x + 8 * (16 * r + 8 * h + 4 * e);
                __m256 a = _mm256_setzero_ps();
                for (int k = 0; k < 4; k++)
                    a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(63 << (8 * k)))), f8(xv + 8 * k), a);
                const int l = 4 * h + 2 * e; /* lane d: sub-block 8 r + l + d / 4 */
                const __m256 s = _mm256_permutevar8x32_ps(sc[r], _mm256_setr_epi32(l, l, l, l, l + 1, l + 1, l + 1, l + 1));
                acc[e] = _mm256_fmadd_ps(a, s, acc[e]);
            }
        }
    }
}
static inline float t1_sum(const __m256 acc[2]) { return hsum((v8)_mm256_add_ps(acc[0], acc[1])); }
#endif

/* y[n] for n in [n0, n1): rows of nch super-blocks, rb bytes apart. */
static inline __attribute__((always_inline)) void t1_rows(int type, const uint8_t *w, int64_t rb, int64_t n0, int64_t n1,
                                                          int64_t nch, const x_chunk *X, float unscale, float *y) {
    const int bytes = BLOCK_BYTES[type];
    for (int64_t n = n0; n < n1; n++) {
        t1v acc[2] = {T1_ZERO, T1_ZERO};
        const uint8_t *row = w + n * rb;
        for (int64_t c = 0; c < nch; c++) {
            T1_PREFETCH(row + c * bytes, bytes);
            if (type == Q4_K) t1_q4_k(row + c * bytes, X + c, acc);
            else t1_q6_k(row + c * bytes, X + c, acc);
        }
        y[n] = t1_sum(acc) * unscale;
    }
}
static void t1_rows_q4_k(const uint8_t *w, int64_t rb, int64_t n0, int64_t n1, int64_t nch, const x_chunk *X,
                         float unscale, float *y) {
    t1_rows(Q4_K, w, rb, n0, n1, nch, X, unscale, y);
}
static void t1_rows_q6_k(const uint8_t *w, int64_t rb, int64_t n0, int64_t n1, int64_t nch, const x_chunk *X,
                         float unscale, float *y) {
    t1_rows(Q6_K, w, rb, n0, n1, nch, X, unscale, y);
}
#endif
