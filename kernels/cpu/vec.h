/* 8-float vectors (GCC vector extensions: AVX at the avx2 and avx512 levels, pairs of 128-bit
 * registers elsewhere) and the helpers the kernels share. */
#ifndef PDSERVE_VEC_H
#define PDSERVE_VEC_H

#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 x;
    memcpy(&x, p, sizeof(x));
    return x;
}

static inline void store8(float *p, v8 x) { memcpy(p, &x, sizeof(x)); }

static inline v8 splat(float s) { return (v8){s, s, s, s, s, s, s, s}; }

static inline v8 vmax(v8 a, v8 b) {
    v8i take_b = a < b;
    return (v8)(((v8i)a & ~take_b) | ((v8i)b & take_b));
}

static inline v8 vmin(v8 a, v8 b) {
    v8i take_b = b < a;
    return (v8)(((v8i)a & ~take_b) | ((v8i)b & take_b));
}

/* e^x to about 1 ulp on [-87, 88] (range reduction by ln 2, Cephes' degree-6 polynomial);
 * inputs outside are clamped, which only matters where the result under- or overflows. */
static inline v8 exp8(v8 x) {
    x = vmin(vmax(x, splat(-87.3f)), splat(88.3f));
    const v8 t = x * splat(1.44269504088896341f);
    /* Round to nearest: add +-0.5 by the sign of t, then truncate. */
    const v8i half = (v8i)splat(0.5f) | ((v8i)t & (v8i){INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN,
                                                         INT32_MIN, INT32_MIN, INT32_MIN, INT32_MIN});
    const v8i n = __builtin_convertvector(t + (v8)half, v8i);
    const v8 nf = __builtin_convertvector(n, v8);
    const v8 r = x - nf * splat(0.693359375f) - nf * splat(-2.12194440e-4f);
    v8 p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * (r * r) + r + splat(1.0f);
    return p * (v8)((n + 127) << 23);
}

/* tanh from one exp8 of -2|x| (in (0, 1], so nothing overflows), sign put back after:
 * absolute error about 1e-7, which softcapping and GELU scale by at most |x|. */
static inline v8 tanh8(v8 x) {
    const v8i sign = (v8i)x & (v8i)splat(-0.0f);
    const v8 e = exp8(splat(-2.0f) * (v8)((v8i)x ^ sign));
    return (v8)((v8i)((splat(1.0f) - e) / (splat(1.0f) + e)) | sign);
}

static inline float hsum(v8 s) {
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

/* 64-byte vectors and byte/fp16 conversions (kernels/cpu/quant.c). Static inline only, so
 * the ABI notes GCC gives for 64-byte vectors without AVX-512 do not apply. */
#include <math.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#pragma GCC diagnostic ignored "-Wpsabi"

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint8_t u8x64 __attribute__((vector_size(64)));
typedef int8_t i8x64 __attribute__((vector_size(64)));
typedef uint8_t u8x32 __attribute__((vector_size(32)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

static inline u8x16 ld16(const uint8_t *p) { u8x16 v; memcpy(&v, p, 16); return v; }
static inline u8x32 ld32(const uint8_t *p) { u8x32 v; memcpy(&v, p, 32); return v; }
static inline u8x64 ld64(const uint8_t *p) { u8x64 v; memcpy(&v, p, 64); return v; }
static inline v16 ldf16(const float *p) { v16 v; memcpy(&v, p, 64); return v; }
static inline uint16_t ldh(const uint8_t *p) { uint16_t h; memcpy(&h, p, 2); return h; }

/* 16 bytes -> floats, unsigned or signed (the intrinsic: GCC 12 scalarizes this conversion). */
static inline v16 bytes_float(u8x16 v, int is_signed) {
#ifdef __AVX512F__
    return (v16)_mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32((__m128i)v) : _mm512_cvtepu8_epi32((__m128i)v));
#else
    v16 r;
    for (int i = 0; i < 16; i++) r[i] = is_signed ? (float)(int8_t)v[i] : (float)v[i];
    return r;
#endif
}
static inline v16 u8_float(u8x16 v) { return bytes_float(v, 0); }

#define I16(o) o, o + 1, o + 2, o + 3, o + 4, o + 5, o + 6, o + 7, o + 8, o + 9, o + 10, o + 11, o + 12, o + 13, o + 14, o + 15
/* Concatenations; without AVX-512 through memory, which GCC keeps in register pairs where a
 * shuffle of the wide type would be scalarized. */
static inline u8x64 cat32(u8x32 a, u8x32 b) {
#ifdef __AVX512F__
    return __builtin_shufflevector(a, b, I16(0), I16(16), I16(32), I16(48));
#else
    u8x64 r;
    memcpy(&r, &a, 32), memcpy((char *)&r + 32, &b, 32);
    return r;
#endif
}
static inline u8x32 cat16(u8x16 a, u8x16 b) {
    u8x32 r;
    memcpy(&r, &a, 16), memcpy((char *)&r + 16, &b, 16);
    return r;
}

/* fp16 bits -> float, exactly. */
static inline v8 half8(u16x8 h) {
#ifdef __F16C__
    return (v8)_mm256_cvtph_ps((__m128i)h);
#else
    v8 r;
    for (int i = 0; i < 8; i++) {
        const uint32_t e = (h[i] >> 10) & 0x1F, m = h[i] & 0x3FF, sign = (uint32_t)(h[i] >> 15) << 31;
        const uint32_t bits = sign | (e == 31 ? 0x7F800000u | m << 13 : (e + 112) << 23 | m << 13);
        float f;
        memcpy(&f, &bits, 4);
        r[i] = e ? f : (sign ? -1.0f : 1.0f) * ldexpf((float)m, -24);
    }
    return r;
#endif
}

static inline float hsum16(v16 v) {
    return hsum(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
}

#if defined(__AVX2__) && defined(__F16C__)
/* The 32-bit words at the start of each of 8 blocks `stride` bytes apart. */
static inline __m256i block_words(const uint8_t *p, int stride) {
    return _mm256_i32gather_epi32((const int *)p, _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                                      _mm256_set1_epi32(stride)), 1);
}
#endif

/* The two fp16 at the start of each of 8 blocks `stride` bytes apart: [d0, m0, d1, m1, ...]. */
static inline v16 block_halves(const uint8_t *p, int stride) {
#ifdef __AVX512F__
    return (v16)_mm512_cvtph_ps(block_words(p, stride));
#else
    u16x8 a, b;
    for (int i = 0; i < 4; i++) {
        a[2 * i] = ldh(p + i * stride), a[2 * i + 1] = ldh(p + i * stride + 2);
        b[2 * i] = ldh(p + (i + 4) * stride), b[2 * i + 1] = ldh(p + (i + 4) * stride + 2);
    }
    const v8 lo = half8(a), hi = half8(b);
    v16 r;
    memcpy(&r, &lo, 32), memcpy((char *)&r + 32, &hi, 32);
    return r;
#endif
}

/* 16 bytes from each of p, p + stride, p + 2 stride, p + 3 stride. */
static inline u8x64 quad16(const uint8_t *p, int stride) {
#ifdef __AVX512F__ /* inserts from memory rather than shuffles */
    const __m256i a = _mm256_loadu2_m128i((const __m128i *)(p + stride), (const __m128i *)p);
    const __m256i b = _mm256_loadu2_m128i((const __m128i *)(p + 3 * stride), (const __m128i *)(p + 2 * stride));
    return cat32((u8x32)a, (u8x32)b);
#else
    return cat32(cat16(ld16(p), ld16(p + stride)), cat16(ld16(p + 2 * stride), ld16(p + 3 * stride)));
#endif
}

/* 16 in byte i where bit i of m is set. */
static inline u8x64 bits16(uint64_t m) {
#ifdef __AVX512BW__
    return (u8x64)_mm512_maskz_mov_epi8(m, _mm512_set1_epi8(16));
#else
    u8x64 r;
    for (int i = 0; i < 64; i++) r[i] = (uint8_t)((m >> i & 1) << 4);
    return r;
#endif
}

/* Of each byte of h, h repeated: bits s.. (first 32 bytes) and t.. (last 32), width wide. */
static inline u8x64 bit_planes(u8x32 h, int s, int t, int width) {
    const u32x16 shift = {s, s, s, s, s, s, s, s, t, t, t, t, t, t, t, t};
    return (u8x64)((u32x16)cat32(h, h) >> shift) & (uint8_t)((1 << width) - 1);
}

#endif
