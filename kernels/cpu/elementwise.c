/* Fused fp32 CPU kernels for the per-token ops around the GEMMs: each is one pass over its
 * rows where the torch reference makes several (and allocates a temporary per pass).
 * Contracts: kernels.reference.{rms_norm, silu_and_mul, gelu_tanh_and_mul,
 * rotary_embedding (neox), reshape_and_cache}. Rows are parallel over OpenMP threads once
 * there is enough work to pay for waking them. Every row length here is a multiple of 8 (the
 * Python side checks).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "vec.h"

#define PARALLEL_MIN_ELEMS (1 << 15)

/* out = x_normed * weight, x_normed = x / rms(x); with residual: x += residual first and
 * the sum is also written to residual_out. */
void rms_norm_f32(const float *x, int64_t x_stride, const float *residual, int64_t res_stride,
                  const float *weight, float eps, float *out, float *residual_out, int64_t T,
                  int64_t d, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * d >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * x_stride;
        float *o = out + t * d;
        const float *src = xr;
        if (residual != NULL) {
            const float *rr = residual + t * res_stride;
            float *sum = residual_out + t * d;
            for (int64_t j = 0; j < d; j += 8) store8(sum + j, load8(xr + j) + load8(rr + j));
            src = sum;
        }
        v8 s0 = {0}, s1 = {0};
        int64_t j = 0;
        for (; j + 16 <= d; j += 16) {
            const v8 a = load8(src + j), b = load8(src + j + 8);
            s0 += a * a;
            s1 += b * b;
        }
        if (j < d) {
            const v8 a = load8(src + j);
            s0 += a * a;
        }
        const float inv = 1.0f / sqrtf(hsum(s0 + s1) / (float)d + eps);
        for (j = 0; j < d; j += 8) store8(o + j, load8(src + j) * splat(inv) * load8(weight + j));
    }
}

/* out[t, j] = silu(x[t, j]) * x[t, d + j] */
void silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t T, int64_t d,
                      int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * d >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * x_stride;
        const float *u = g + d;
        float *o = out + t * d;
        for (int64_t j = 0; j < d; j += 8) {
            const v8 a = load8(g + j);
            store8(o + j, a / (splat(1.0f) + exp8(-a)) * load8(u + j));
        }
    }
}

/* out[t, j] = gelu_tanh(x[t, j]) * x[t, d + j]. 0.5 a (1 + tanh(y)) = a / (1 + e^(-2y)):
 * one exp8, and no cancellation in 1 + tanh(y) for negative a. */
void gelu_tanh_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t T, int64_t d,
                           int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * d >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * x_stride;
        const float *u = g + d;
        float *o = out + t * d;
        for (int64_t j = 0; j < d; j += 8) {
            const v8 a = load8(g + j);
            const v8 y = splat(0.7978845608028654f) * (a + splat(0.044715f) * a * a * a);
            store8(o + j, a / (splat(1.0f) + exp8(splat(-2.0f) * y)) * load8(u + j));
        }
    }
}

/* neox rotary on one head: pairs (j, j + rot/2) of the first rot dims; the rest copied. */
static inline void rotate_head(const float *x, float *o, const float *cos, const float *sin,
                               int64_t half, int64_t D) {
    for (int64_t j = 0; j < half; j += 8) {
        const v8 x1 = load8(x + j), x2 = load8(x + half + j);
        const v8 c = load8(cos + j), s = load8(sin + j);
        store8(o + j, x1 * c - x2 * s);
        store8(o + half + j, x2 * c + x1 * s);
    }
    if (2 * half < D) memcpy(o + 2 * half, x + 2 * half, (size_t)(D - 2 * half) * sizeof(float));
}

/* q_out [T, H, D], k_out [T, Hkv, D] contiguous; q, k strided by token and head. */
void rotary_neox_f32(const int64_t *positions, const float *q, int64_t q_st, int64_t q_sh,
                     const float *k, int64_t k_st, int64_t k_sh, const float *cos_sin,
                     int64_t rot, float *q_out, float *k_out, int64_t T, int64_t H, int64_t Hkv,
                     int64_t D, int num_threads) {
    const int64_t half = rot / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) \
    if (T * (H + Hkv) * D >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        const float *cos = cos_sin + positions[t] * rot;
        const float *sin = cos + half;
        for (int64_t h = 0; h < H; h++)
            rotate_head(q + t * q_st + h * q_sh, q_out + (t * H + h) * D, cos, sin, half, D);
        for (int64_t h = 0; h < Hkv; h++)
            rotate_head(k + t * k_st + h * k_sh, k_out + (t * Hkv + h) * D, cos, sin, half, D);
    }
}

/* Caches [num_slots, Hkv, D] flat; key/value heads strided; slot -1 is skipped. */
void reshape_and_cache_f32(const float *key, int64_t k_st, int64_t k_sh, const float *value,
                           int64_t v_st, int64_t v_sh, float *key_cache, float *value_cache,
                           const int64_t *slots, int64_t T, int64_t Hkv, int64_t D) {
    const size_t row = (size_t)D * sizeof(float);
    for (int64_t t = 0; t < T; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        for (int64_t h = 0; h < Hkv; h++) {
            memcpy(key_cache + (slot * Hkv + h) * D, key + t * k_st + h * k_sh, row);
            memcpy(value_cache + (slot * Hkv + h) * D, value + t * v_st + h * v_sh, row);
        }
    }
}
