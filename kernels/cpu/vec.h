/* 8-float vectors (GCC vector extensions: AVX with -march=native on x86, pairs of 128-bit
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

#endif
