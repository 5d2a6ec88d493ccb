/* Products with a weight held as 16-bit floats, fp16 or bf16 (contract: kernels/cpu/half.py).
 * Each weight value is widened to fp32 exactly (F16C / AVX-512 vcvtph2ps, a shift for bf16,
 * bit arithmetic in plain C) and multiplied with fp32 FMA, so the result is the product with
 * the fp32 upcast of the weight up to summation order. The weight is the bandwidth: a tile of
 * NR weight rows is widened once for a tile of TR activation rows held in registers, and a
 * tile's rows stay in cache while the other activation rows pass, so a batch reads the weight
 * once. OpenMP threads split the output rows. */
#include <stdint.h>
#include <string.h>
#include <omp.h>

#include "kernels.h"
#include "vec.h"

#define NR 4                          /* weight rows per tile */
#define PARALLEL_MIN_BYTES (1 << 15)  /* of weights, to wake a second thread */
#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* fp16 bits (zero-extended to 32) -> fp32 bits, exactly: normal values rebias the exponent,
 * subnormals are m * 2^-24 (exact in fp32), inf and NaN keep their mantissa. */
ALWAYS_INLINE v8i f16_bits8(v8i u) {
    const v8i sign = (u & 0x8000) << 16, em = u & 0x7FFF;
    const v8i normal = (em << 13) + (112 << 23), special = (em << 13) | 0x7F800000;
    const v8i sub = (v8i)(__builtin_convertvector(em, v8) * splat(0x1p-24f));
    const v8i big = em >= 0x7C00, norm = em >= 0x400;
    return sign | (special & big) | (normal & norm & ~big) | (sub & ~norm);
}

ALWAYS_INLINE float widen1(uint16_t h, int bf16) {
    uint32_t bits;
    if (bf16) {
        bits = (uint32_t)h << 16;
    } else {
        const v8i u = {h};
        bits = (uint32_t)f16_bits8(u)[0];
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#ifdef __AVX512F__
#define VW 16
#define TR 4 /* activation rows per tile: 16 accumulators of 32 registers */
typedef v16 vf;
ALWAYS_INLINE vf loadf(const float *p) { return ldf16(p); }
ALWAYS_INLINE vf widen(const uint16_t *p, int bf16) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)p);
    return bf16 ? (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16) : (vf)_mm512_cvtph_ps(h);
}
ALWAYS_INLINE float vsum(vf v) { return hsum16(v); }
#else
#define VW 8
#define TR 2 /* 8 accumulators of 16 registers */
typedef v8 vf;
ALWAYS_INLINE vf loadf(const float *p) { return load8(p); }
ALWAYS_INLINE vf widen(const uint16_t *p, int bf16) {
#if defined(__AVX2__) && defined(__F16C__)
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return bf16 ? (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16) : (vf)_mm256_cvtph_ps(h);
#else
    u16x8 h;
    memcpy(&h, p, sizeof(h));
    const v8i u = __builtin_convertvector(h, v8i);
    return bf16 ? (vf)(u << 16) : (vf)f16_bits8(u);
#endif
}
ALWAYS_INLINE float vsum(vf v) { return hsum(v); }
#endif

/* y[t, r] (row stride ys) = x[t] . w[r] for nr weight rows (row stride ws) and tr activation
 * rows (row stride xs); nr and tr are constants at every call, so the loops unroll and the
 * accumulators stay in registers. */
ALWAYS_INLINE void tile(const float *x, int64_t xs, int tr, const uint16_t *w, int64_t ws, int nr,
                        int64_t K, int bf16, float *y, int64_t ys) {
    vf acc[NR][TR];
    float tail[NR][TR];
#pragma GCC unroll 4
    for (int r = 0; r < nr; r++)
#pragma GCC unroll 4
        for (int t = 0; t < tr; t++) acc[r][t] = (vf){0}, tail[r][t] = 0.0f;
    const int64_t Kv = K - K % VW;
    for (int64_t k = 0; k < Kv; k += VW) {
        vf xv[TR];
#pragma GCC unroll 4
        for (int t = 0; t < tr; t++) xv[t] = loadf(x + t * xs + k);
#pragma GCC unroll 4
        for (int r = 0; r < nr; r++) {
            const vf wv = widen(w + r * ws + k, bf16);
#pragma GCC unroll 4
            for (int t = 0; t < tr; t++) acc[r][t] += wv * xv[t];
        }
    }
    for (int64_t k = Kv; k < K; k++)
        for (int r = 0; r < nr; r++) {
            const float wk = widen1(w[r * ws + k], bf16);
            for (int t = 0; t < tr; t++) tail[r][t] += wk * x[t * xs + k];
        }
#pragma GCC unroll 4
    for (int r = 0; r < nr; r++)
#pragma GCC unroll 4
        for (int t = 0; t < tr; t++) y[t * ys + r] = vsum(acc[r][t]) + tail[r][t];
}

/* Output rows [n0, n1) for all T activation rows. */
ALWAYS_INLINE void rows(const float *x, int64_t xs, const uint16_t *w, int64_t ws, int64_t n0, int64_t n1,
                        int64_t K, int bf16, float *y, int64_t ys, int64_t T) {
    for (int64_t n = n0; n < n1; n += NR) {
        const uint16_t *wn = w + n * ws;
        const int full = n + NR <= n1;
        int64_t t = 0;
        for (; t + TR <= T; t += TR) {
            if (full) tile(x + t * xs, xs, TR, wn, ws, NR, K, bf16, y + t * ys + n, ys);
            else for (int64_t m = n; m < n1; m++) tile(x + t * xs, xs, TR, wn + (m - n) * ws, ws, 1, K, bf16, y + t * ys + m, ys);
        }
        for (; t < T; t++) {
            if (full) tile(x + t * xs, xs, 1, wn, ws, NR, K, bf16, y + t * ys + n, ys);
            else for (int64_t m = n; m < n1; m++) tile(x + t * xs, xs, 1, wn + (m - n) * ws, ws, 1, K, bf16, y + t * ys + m, ys);
        }
    }
}

static void rows_f16(const float *x, int64_t xs, const uint16_t *w, int64_t ws, int64_t n0, int64_t n1,
                     int64_t K, float *y, int64_t ys, int64_t T) { rows(x, xs, w, ws, n0, n1, K, 0, y, ys, T); }
static void rows_bf16(const float *x, int64_t xs, const uint16_t *w, int64_t ws, int64_t n0, int64_t n1,
                      int64_t K, float *y, int64_t ys, int64_t T) { rows(x, xs, w, ws, n0, n1, K, 1, y, ys, T); }

/* y [T, N] (row stride ys) = x [T, K] (row stride xs) @ W^T, W [N, K] 16-bit floats with row
 * stride ws (elements); kind 0: fp16, 1: bf16. */
void half_matmul_f32(const float *x, int64_t xs, const uint16_t *w, int64_t ws, int64_t N, int64_t K, int kind,
                     float *y, int64_t ys, int64_t T, int num_threads) {
    if (N <= 0 || T <= 0 || (kind != 0 && kind != 1)) return;
    void (*const f)(const float *, int64_t, const uint16_t *, int64_t, int64_t, int64_t, int64_t, float *,
                    int64_t, int64_t) = kind ? rows_bf16 : rows_f16;
    const int64_t tiles = (N + NR - 1) / NR;
    const int nth = (int)MIN(N * K * 2 >= PARALLEL_MIN_BYTES ? num_threads : 1, tiles);
    if (nth <= 1) {
        f(x, xs, w, ws, 0, N, K, y, ys, T);
        return;
    }
#pragma omp parallel num_threads(nth)
    {
        const int64_t i = omp_get_thread_num(), n = omp_get_num_threads();
        f(x, xs, w, ws, tiles * i / n * NR, MIN(tiles * (i + 1) / n * NR, N), K, y, ys, T);
    }
}
