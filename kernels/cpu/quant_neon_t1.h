/* The exact (fp32) product of one activation row with Q4_K, Q6_K, Q4_0, Q4_1 and Q8_0 rows on
 * aarch64 with Advanced SIMD: quant.c's T = 1 path for them, with the interface of
 * quant_t1.h and quant_t1_b32.h (x86), whose scheme it follows:
 *   - the scales come out of the inner sums: sum_i (s q_i + m) x_i = s sum_i q_i x_i + m sum_i x_i,
 *     with sum_i x_i per block or sub-block computed once per call (the mins, and the offsets
 *     of Q4_0 (8) and Q6_K (32));
 *   - the quants are not spread one per lane: a 32-bit lane of a 16-byte load holds 4
 *     consecutive values, and the k-th byte's quant (or nibble) is masked in place and
 *     converted as fixed point with 8 k (+ 4 for a high nibble) fraction bits (vcvtq_n), which
 *     gives q itself, exactly: an and, a conversion and an FMA per 4 weights, no widening;
 *   - so lane d of the k-th vector of a run of 16 values is value 4 d + k: the activations are
 *     put in that order once per call (each run of 16 transposed as 4 x 4, vld4q_f32), shared
 *     by every row. Q8_0's signed bytes are widened instead (a signed byte in place is not a
 *     fixed-point number), so its activations stay in natural order.
 * As on x86 the row is scaled by a power of two 2^s that brings max |x| to [1, 2), so that
 * products with tiny scales stay normal; the sums are scaled back by 2^-s.
 * The weights are the same numbers as the dequantized ones (s q + m rounded once); only the
 * order and grouping of the sums differs: x @ W^T up to fp32 summation error. */
#ifndef PDSERVE_QUANT_NEON_T1_H
#define PDSERVE_QUANT_NEON_T1_H
#include <arm_neon.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define T1_TYPE(type) ((type) == Q4_K || (type) == Q6_K)
#define B32_TYPE(type) ((type) == Q4_0 || (type) == Q4_1 || (type) == Q8_0)
/* Blocks per group, and the floats a group of prepared activations takes: its 128 values,
 * then one term per block (Q4_0: -8 sum x, times d; Q4_1: sum x, times m; Q8_0: unused). */
#define B32_BLOCKS(type) 4
#define B32_GROUP(type) (128 + 4)
/* One 256-value chunk of an activation row, in the order above, and per run of 16 values
 * (Q6_K; its term: -32 sum x) or 32 (Q4_K, runs 0..7; -sum x) the term of the offsets. */
typedef struct { float x[256], term[16]; } x_chunk;

#define T1_PREFETCH(p, bytes)                                                               \
    for (int o_ = 0; o_ < (bytes); o_ += 64) __builtin_prefetch((const char *)(p) + PREFETCH + o_)

/* The scale 2^s of a row (see above); returns s. */
static int t1_exponent_of(const float *x, int64_t K) {
    float32x4_t m = vdupq_n_f32(0.0f);
    for (int64_t i = 0; i < K; i += 4) m = vmaxnmq_f32(m, vabsq_f32(vld1q_f32(x + i))); /* NaN skipped */
    const float amax = vmaxnmvq_f32(m);
    const int s = amax > 0.0f && isfinite(amax) ? -ilogbf(amax) : 0;
    return s < -64 ? -64 : s > 64 ? 64 : s;
}

/* n values of x (a multiple of 16) times `scale` into out: transposed per run of 16, or not. */
static void t1_put(const float *x, int n, float scale, int transpose, float *out) {
    for (int r = 0; r < n; r += 16) {
        if (transpose) {
            const float32x4x4_t v = vld4q_f32(x + r); /* v.val[k] lane d: x[r + 4 d + k] */
            for (int k = 0; k < 4; k++) vst1q_f32(out + r + 4 * k, vmulq_n_f32(v.val[k], scale));
        } else {
            for (int k = 0; k < 4; k++) vst1q_f32(out + r + 4 * k, vmulq_n_f32(vld1q_f32(x + r + 4 * k), scale));
        }
    }
}

static float sum_of(const float *x, int n) { /* n a multiple of 16 */
    float32x4_t s = vdupq_n_f32(0.0f);
    for (int i = 0; i < n; i += 4) s = vaddq_f32(s, vld1q_f32(x + i));
    return vaddvq_f32(s);
}

/* The chunks of x (K a multiple of 256), times 2^s; returns 2^-s. */
static float t1_prep(int type, const float *x, int64_t K, x_chunk *out) {
    const int s = t1_exponent_of(x, K), run = type == Q6_K ? 16 : 32;
    const float scale = ldexpf(1.0f, s), term = ldexpf(type == Q6_K ? -32.0f : -1.0f, s);
    for (int64_t c = 0; c < K / 256; c++) {
        t1_put(x + 256 * c, 256, scale, 1, out[c].x);
        memset(out[c].term, 0, sizeof(out[c].term));
        for (int r = 0; r < 256 / run; r++) out[c].term[r] = sum_of(x + 256 * c + run * r, run) * term;
    }
    return ldexpf(1.0f, -s);
}

/* Groups of 4 blocks of x (K a multiple of 32, ng groups, the last one zero-padded), times
 * 2^s; returns 2^-s. */
static float b32_prep(int type, const float *x, int64_t K, int64_t ng, float *out) {
    const int s = t1_exponent_of(x, K);
    const float scale = ldexpf(1.0f, s), term = ldexpf(type == Q4_0 ? -8.0f : 1.0f, s);
    for (int64_t g = 0; g < ng; g++) {
        float *o = out + g * B32_GROUP(type);
        const int n = (int)(K - 128 * g < 128 ? K - 128 * g : 128);
        memset(o, 0, sizeof(float) * B32_GROUP(type));
        t1_put(x + 128 * g, n, scale, type != Q8_0, o);
        for (int b = 0; 32 * b < n; b++) o[128 + b] = sum_of(x + 128 * g + 32 * b, 32) * term;
    }
    return ldexpf(1.0f, -s);
}

/* a + the products of the quants in the bytes of v (low or high nibbles, or 6-bit fields)
 * with x's 16 values in the order above. */
#define FIELD(v, mask, sh) vcvtq_n_f32_u32(vandq_u32(v, vdupq_n_u32((uint32_t)(mask) << (sh))), sh)
static inline float32x4_t low_dot(uint8x16_t b, const float *x, float32x4_t a) {
    const uint32x4_t v = vreinterpretq_u32_u8(b);
    a = vfmaq_f32(a, vcvtq_f32_u32(vandq_u32(v, vdupq_n_u32(15))), vld1q_f32(x));
    a = vfmaq_f32(a, FIELD(v, 15, 8), vld1q_f32(x + 4));
    a = vfmaq_f32(a, FIELD(v, 15, 16), vld1q_f32(x + 8));
    return vfmaq_f32(a, FIELD(v, 15, 24), vld1q_f32(x + 12));
}
static inline float32x4_t high_dot(uint8x16_t b, const float *x, float32x4_t a) {
    const uint32x4_t v = vreinterpretq_u32_u8(b);
    a = vfmaq_f32(a, FIELD(v, 15, 4), vld1q_f32(x));
    a = vfmaq_f32(a, FIELD(v, 15, 12), vld1q_f32(x + 4));
    a = vfmaq_f32(a, FIELD(v, 15, 20), vld1q_f32(x + 8));
    return vfmaq_f32(a, FIELD(v, 15, 28), vld1q_f32(x + 12));
}
static inline float32x4_t six_dot(uint8x16_t b, const float *x, float32x4_t a) {
    const uint32x4_t v = vreinterpretq_u32_u8(b);
    a = vfmaq_f32(a, vcvtq_f32_u32(vandq_u32(v, vdupq_n_u32(63))), vld1q_f32(x));
    a = vfmaq_f32(a, FIELD(v, 63, 8), vld1q_f32(x + 4));
    a = vfmaq_f32(a, FIELD(v, 63, 16), vld1q_f32(x + 8));
    return vfmaq_f32(a, FIELD(v, 63, 24), vld1q_f32(x + 12));
}
/* a + Q8_0's 32 signed quants at p times x's 32 values (natural order). */
static inline float32x4_t s8_dot(const uint8_t *p, const float *x, float32x4_t a) {
    for (int h = 0; h < 2; h++) {
        float32x4_t f[4];
        s8_f32(vld1q_s8((const int8_t *)p + 16 * h), f);
        for (int i = 0; i < 4; i++) a = vfmaq_f32(a, f[i], vld1q_f32(x + 16 * h + 4 * i));
    }
    return a;
}

static inline float32x4_t zero4(void) { return vdupq_n_f32(0.0f); }

/* acc + a Q4_K super-block at p times X. */
static inline __attribute__((always_inline)) void t1_q4_k(const uint8_t *p, const x_chunk *X, float32x4_t acc[2]) {
    const uint8x16_t sm = (uint8x16_t)k_scale_bytes(p + 4); /* scales 0..7, mins 0..7 */
    float32x4_t f[4];
    u8_f32(sm, f);
    const float d = half1(p), dmin = half1(p + 2);
    acc[1] = vfmaq_f32(acc[1], vmulq_n_f32(f[2], dmin), vld1q_f32(X->term));
    acc[1] = vfmaq_f32(acc[1], vmulq_n_f32(f[3], dmin), vld1q_f32(X->term + 4));
    float s[8];
    vst1q_f32(s, vmulq_n_f32(f[0], d)), vst1q_f32(s + 4, vmulq_n_f32(f[1], d));
    for (int j = 0; j < 4; j++) { /* 32 bytes: sub-block 2 j in the low nibbles, 2 j + 1 high */
        const uint8x16_t v0 = vld1q_u8(p + 16 + 32 * j), v1 = vld1q_u8(p + 32 + 32 * j);
        const float *xj = X->x + 64 * j;
        const float32x4_t lo = low_dot(v1, xj + 16, low_dot(v0, xj, zero4()));
        const float32x4_t hi = high_dot(v1, xj + 48, high_dot(v0, xj + 32, zero4()));
        acc[0] = vfmaq_n_f32(acc[0], lo, s[2 * j]);
        acc[1] = vfmaq_n_f32(acc[1], hi, s[2 * j + 1]);
    }
}

/* acc + a Q6_K super-block at p times X. */
static inline __attribute__((always_inline)) void t1_q6_k(const uint8_t *p, const x_chunk *X, float32x4_t acc[2]) {
    float s[16];
    {
        float32x4_t f[4];
        s8_f32(vld1q_s8((const int8_t *)p + 192), f);
        for (int i = 0; i < 4; i++) {
            const float32x4_t sc = vmulq_n_f32(f[i], half1(p + 208));
            acc[1] = vfmaq_f32(acc[1], sc, vld1q_f32(X->term + 4 * i));
            vst1q_f32(s + 4 * i, sc);
        }
    }
    for (int n = 0; n < 2; n++) /* as quant_neon.h's decode: run 8 n + 4 h + 2 e + f */
        for (int f = 0; f < 2; f++) {
            const uint8x16_t qh = vld1q_u8(p + 128 + 32 * n + 16 * f);
            for (int e = 0; e < 2; e++) {
                const uint8x16_t ql = vld1q_u8(p + 64 * n + 32 * e + 16 * f);
                for (int h = 0; h < 2; h++) {
                    const uint8x16_t top = vandq_u8(vshlq_u8(qh, vdupq_n_s8((int8_t)(4 - 2 * (2 * h + e)))), vdupq_n_u8(0x30));
                    const uint8x16_t q = vorrq_u8(h ? vshrq_n_u8(ql, 4) : vandq_u8(ql, vdupq_n_u8(15)), top);
                    const int r = 8 * n + 4 * h + 2 * e + f;
                    acc[e] = vfmaq_n_f32(acc[e], six_dot(q, X->x + 16 * r, zero4()), s[r]);
                }
            }
        }
}

/* y[n] for n in [n0, n1): rows of nch super-blocks, rb bytes apart. */
static inline __attribute__((always_inline)) void t1_rows(int type, const uint8_t *w, int64_t rb, int64_t n0, int64_t n1,
                                                          int64_t nch, const x_chunk *X, float unscale, float *y) {
    const int bytes = BLOCK_BYTES[type];
    for (int64_t n = n0; n < n1; n++) {
        float32x4_t acc[2] = {zero4(), zero4()};
        const uint8_t *row = w + n * rb;
        for (int64_t c = 0; c < nch; c++) {
            T1_PREFETCH(row + c * bytes, bytes);
            if (type == Q4_K) t1_q4_k(row + c * bytes, X + c, acc);
            else t1_q6_k(row + c * bytes, X + c, acc);
        }
        y[n] = vaddvq_f32(vaddq_f32(acc[0], acc[1])) * unscale;
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

/* acc + a group of 4 blocks at p times its prepared activations xg; the blocks' d (or Q4_1's
 * m) times their terms go to acct. */
static inline __attribute__((always_inline)) void b32_group(int type, const uint8_t *p, const float *xg, float32x4_t *acc,
                                                            float32x4_t *acct) {
    const int B = BLOCK_BYTES[type];
    float t[4];
    for (int b = 0; b < 4; b++) {
        const uint8_t *blk = p + b * B;
        const float d = half1(blk);
        float32x4_t a;
        if (type == Q8_0) {
            a = s8_dot(blk + 2, xg + 32 * b, zero4());
            t[b] = 0.0f;
        } else {
            const uint8x16_t v = vld1q_u8(blk + (type == Q4_1 ? 4 : 2));
            a = high_dot(v, xg + 32 * b + 16, low_dot(v, xg + 32 * b, zero4()));
            t[b] = type == Q4_1 ? half1(blk + 2) : d;
        }
        *acc = vfmaq_n_f32(*acc, a, d);
    }
    if (type != Q8_0) *acct = vfmaq_f32(*acct, vld1q_f32(t), vld1q_f32(xg + 128));
}

/* y[n] for n in [n0, n1): rows of K / 32 blocks, rb bytes apart; X from b32_prep. A row's last
 * group, when it is not whole, is read from a zeroed copy (scales 0), so nothing past the row
 * is read. */
static inline __attribute__((always_inline)) void b32_rows(int type, const uint8_t *w, int64_t rb, int64_t n0, int64_t n1,
                                                           int64_t K, const float *X, float unscale, float *y) {
    const int B = BLOCK_BYTES[type];
    const int64_t blocks = K / 32, full = blocks / 4, rest = blocks % 4;
    for (int64_t n = n0; n < n1; n++) {
        float32x4_t acc = zero4(), acct = zero4();
        const uint8_t *row = w + n * rb;
        for (int64_t g = 0; g < full; g++) {
            T1_PREFETCH(row + g * 4 * B, 4 * B);
            b32_group(type, row + g * 4 * B, X + g * B32_GROUP(type), &acc, &acct);
        }
        if (rest) {
            uint8_t tail[4 * 34] = {0};
            memcpy(tail, row + full * 4 * B, (size_t)(rest * B));
            b32_group(type, tail, X + full * B32_GROUP(type), &acc, &acct);
        }
        y[n] = vaddvq_f32(vaddq_f32(acc, acct)) * unscale;
    }
}
#define B32_ROWS(TYPE)                                                                                    \
    static void b32_rows_##TYPE(const uint8_t *w, int64_t rb, int64_t n0, int64_t n1, int64_t K, const float *X, \
                                float unscale, float *y) {                                                \
        b32_rows(TYPE, w, rb, n0, n1, K, X, unscale, y);                                                  \
    }
B32_ROWS(Q4_0) B32_ROWS(Q4_1) B32_ROWS(Q8_0)
#endif
