/* The chunk of quant_chunk.h for aarch64 with Advanced SIMD (the neon and neon_dotprod levels).
 * The generic chunk's 64-byte vectors and cross-lane shuffles split into scalar moves on
 * 16-byte registers, so here, as in quant_avx2.h, a chunk is in natural order, one register
 * per run of 16 values:
 *   q[r]: values 16 r .. 16 r + 15 as signed bytes, OFFSET already taken off (Q4_0 -8..7,
 *         Q5_0 -16..15, Q6_K -32..31, Q8_0 as stored; the types with m keep 0..31);
 *   s[r], b[r]: w = s q + b, b = m for the types with m and 0 for the rest.
 * int8: 16 s8 x s8 products per run summed into four int32 lanes (vdotq_s32 where the CPU has
 * the dot product, else vmull_s8 + vpadalq_s16: |q a| <= 128 * 127 fits int16), four runs'
 * lanes folded into one vector by pairwise adds and scaled per run in fp32.
 * fp32: a run's bytes widened to fp32 and dequantized with one FMA (s q is exact, so it rounds
 * once, as the reference's add or multiply does). Included by quant_chunk.h. */
#ifndef PDSERVE_QUANT_NEON_H
#define PDSERVE_QUANT_NEON_H
#include <arm_neon.h>

typedef struct { int8x16_t q[16]; float s[16], b[16]; } chunk;
typedef float32x4_t accv; /* an accumulator of the product: 4 floats */
#define ACC_WIDTH 4
#define ACC_ROWS 4 /* activation rows per pass of the tile's fp32 loop: 4 x NT sums + 8 loads of 32 registers */
static inline float acc_sum(accv v) { return vaddvq_f32(v); }
static inline accv acc_load(const float *p) { return vld1q_f32(p); }
/* The activations' term per run is dx sum(a) times b (quantize_row), whatever the type. */
#define ACT_FACTOR(type) 1.0f
static inline int run_group(int type, int c, int k) { (void)type; return 4 * c + k; }
static inline int run_lane(int type, int c, int k) { (void)type; return 4 * c + k; }

static inline float half1(const uint8_t *p) {
    __fp16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

/* 16 bytes -> 16 floats, unsigned or signed. */
static inline void u8_f32(uint8x16_t v, float32x4_t f[4]) {
    const uint16x8_t lo = vmovl_u8(vget_low_u8(v)), hi = vmovl_high_u8(v);
    f[0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo))), f[1] = vcvtq_f32_u32(vmovl_high_u16(lo));
    f[2] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi))), f[3] = vcvtq_f32_u32(vmovl_high_u16(hi));
}
static inline void s8_f32(int8x16_t v, float32x4_t f[4]) {
    const int16x8_t lo = vmovl_s8(vget_low_s8(v)), hi = vmovl_high_s8(v);
    f[0] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), f[1] = vcvtq_f32_s32(vmovl_high_s16(lo));
    f[2] = vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), f[3] = vcvtq_f32_s32(vmovl_high_s16(hi));
}

/* 16 at byte i where bit i of the 16-bit word at p is set (Q5_0 / Q5_1's fifth bits). */
static inline uint8x16_t fifth_bits(const uint8_t *p) {
    const uint8x16_t bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    return vandq_u8(vtstq_u8(vcombine_u8(vdup_n_u8(p[0]), vdup_n_u8(p[1])), bit), vdupq_n_u8(16));
}
/* 16 where bit `bit` of each byte of h is set (Q5_K's fifth bits). */
static inline uint8x16_t plane_bits(uint8x16_t h, int bit) {
    return vandq_u8(vtstq_u8(h, vdupq_n_u8((uint8_t)(1 << bit))), vdupq_n_u8(16));
}
static inline int8x16_t minus(uint8x16_t q, int offset) {
    return vsubq_s8(vreinterpretq_s8_u8(q), vdupq_n_s8((int8_t)offset));
}

/* The chunk at p: one super-block, or nb 32-value blocks (1..8; the missing blocks' q, s and b
 * are 0 and their bytes are not read). */
static inline __attribute__((always_inline)) chunk decode(int type, const uint8_t *p, int nb) {
    const int B = BLOCK_BYTES[type];
    chunk c;
    if (BLOCK_VALUES[type] == 32) {
        const int qs = type == Q8_0 || type == Q4_0 ? 2 : type == Q4_1 ? 4 : type == Q5_0 ? 6 : 8;
        const int offset = type == Q8_0 ? 0 : OFFSET[type]; /* Q8_0's bytes are signed already */
        for (int j = 0; j < 8; j++) { /* block j: runs 2 j (values 0..15) and 2 j + 1 */
            const uint8_t *blk = p + j * B;
            if (j >= nb) {
                c.q[2 * j] = c.q[2 * j + 1] = vdupq_n_s8(0);
                c.s[2 * j] = c.s[2 * j + 1] = c.b[2 * j] = c.b[2 * j + 1] = 0.0f;
                continue;
            }
            c.s[2 * j] = c.s[2 * j + 1] = half1(blk);
            c.b[2 * j] = c.b[2 * j + 1] = HAS_M(type) ? half1(blk + 2) : 0.0f;
            if (type == Q8_0) {
                c.q[2 * j] = vld1q_s8((const int8_t *)blk + 2), c.q[2 * j + 1] = vld1q_s8((const int8_t *)blk + 18);
                continue;
            }
            const uint8x16_t z = vld1q_u8(blk + qs);
            uint8x16_t lo = vandq_u8(z, vdupq_n_u8(15)), hi = vshrq_n_u8(z, 4);
            if (type == Q5_0 || type == Q5_1) lo = vorrq_u8(lo, fifth_bits(blk + qs - 4)), hi = vorrq_u8(hi, fifth_bits(blk + qs - 2));
            c.q[2 * j] = minus(lo, offset), c.q[2 * j + 1] = minus(hi, offset);
        }
    } else if (type == Q4_K || type == Q5_K) {
        /* k_scale_bytes: scales 0..7, mins 0..7; sub-block i (32 values) is runs 2 i, 2 i + 1 */
        const uint8x16_t sm = (uint8x16_t)k_scale_bytes(p + 4);
        float32x4_t f[4];
        u8_f32(vzip1q_u8(sm, sm), f); /* each scale twice */
        for (int i = 0; i < 4; i++) vst1q_f32(c.s + 4 * i, vmulq_n_f32(f[i], half1(p)));
        u8_f32(vzip2q_u8(sm, sm), f);
        for (int i = 0; i < 4; i++) vst1q_f32(c.b + 4 * i, vmulq_n_f32(f[i], -half1(p + 2)));
        const uint8_t *qs = p + (type == Q5_K ? 48 : 16);
        const uint8x16_t qh[2] = {vld1q_u8(p + 16), vld1q_u8(p + 32)};
        for (int j = 0; j < 4; j++) /* 32 bytes: values 64 j + b in the low nibbles, + 32 high */
            for (int e = 0; e < 2; e++) {
                const uint8x16_t z = vld1q_u8(qs + 32 * j + 16 * e);
                uint8x16_t lo = vandq_u8(z, vdupq_n_u8(15)), hi = vshrq_n_u8(z, 4);
                if (type == Q5_K) lo = vorrq_u8(lo, plane_bits(qh[e], 2 * j)), hi = vorrq_u8(hi, plane_bits(qh[e], 2 * j + 1));
                c.q[4 * j + e] = vreinterpretq_s8_u8(lo), c.q[4 * j + 2 + e] = vreinterpretq_s8_u8(hi);
            }
    } else { /* Q6_K: low nibbles (2 x 64 bytes) | high 2 bits (2 x 32) | 16 int8 scales | d */
        const int8x16_t sc = vld1q_s8((const int8_t *)p + 192);
        const int16x8_t lo = vmovl_s8(vget_low_s8(sc)), hi = vmovl_high_s8(sc);
        const float32x4_t f[4] = {vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), vcvtq_f32_s32(vmovl_high_s16(lo)),
                                  vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), vcvtq_f32_s32(vmovl_high_s16(hi))};
        for (int i = 0; i < 4; i++) vst1q_f32(c.s + 4 * i, vmulq_n_f32(f[i], half1(p + 208))), vst1q_f32(c.b + 4 * i, vdupq_n_f32(0));
        for (int n = 0; n < 2; n++) /* value 128 n + 64 h + 32 e + 16 f + i: nibble h of ql[64 n + 32 e + 16 f + i], */
            for (int f2 = 0; f2 < 2; f2++) { /* high bits 2 (2 h + e) of qh[32 n + 16 f + i] */
                const uint8x16_t qh = vld1q_u8(p + 128 + 32 * n + 16 * f2);
                for (int e = 0; e < 2; e++) {
                    const uint8x16_t ql = vld1q_u8(p + 64 * n + 32 * e + 16 * f2);
                    for (int h = 0; h < 2; h++) {
                        const uint8x16_t top = vandq_u8(vshlq_u8(qh, vdupq_n_s8((int8_t)(4 - 2 * (2 * h + e)))), vdupq_n_u8(0x30));
                        const uint8x16_t low = h ? vshrq_n_u8(ql, 4) : vandq_u8(ql, vdupq_n_u8(15));
                        c.q[8 * n + 4 * h + 2 * e + f2] = minus(vorrq_u8(low, top), 32);
                    }
                }
            }
    }
    return c;
}

/* Weights 16 r .. 16 r + 15, dequantized exactly. */
static inline __attribute__((always_inline)) void run_weights(const chunk *ch, int r, float32x4_t w[4]) {
    float32x4_t f[4];
    s8_f32(ch->q[r], f);
    const float32x4_t s = vdupq_n_f32(ch->s[r]), b = vdupq_n_f32(ch->b[r]);
    for (int i = 0; i < 4; i++) w[i] = vfmaq_f32(b, f[i], s);
}

static inline __attribute__((always_inline)) void dequant(int type, const chunk *ch, int nv, float *out) {
    (void)type;
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) {
        if (16 * r >= nv) break;
        float32x4_t w[4];
        run_weights(ch, r, w);
        for (int i = 0; i < 4; i++) vst1q_f32(out + 16 * r + 4 * i, w[i]);
    }
}

/* acc + the fp32 product of a chunk with x's chunk; four accumulators keep four FMA chains in
 * flight. */
static inline __attribute__((always_inline)) void chunk_fma(int type, const chunk *ch, const float *x, int nv, accv acc[4]) {
    (void)type;
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++) {
        if (16 * r >= nv) break;
        float32x4_t w[4];
        run_weights(ch, r, w);
        for (int i = 0; i < 4; i++) acc[i] = vfmaq_f32(acc[i], w[i], vld1q_f32(x + 16 * r + 4 * i));
    }
}

/* Per 4-byte lane the dot product of signed q and a. */
static inline int32x4_t dot16(int8x16_t q, int8x16_t a) {
#ifdef __ARM_FEATURE_DOTPROD
    return vdotq_s32(vdupq_n_s32(0), q, a);
#else
    return vpadalq_s16(vpaddlq_s16(vmull_s8(vget_low_s8(q), vget_low_s8(a))), vmull_high_s8(q, a));
#endif
}

/* The int8 product of a chunk with an activation chunk (act_chunk: natural order, dx and
 * dx sum(a) per run). */
static inline __attribute__((always_inline)) accv chunk_dot(int type, const chunk *w, const act_chunk *a, int nv) {
    const int8_t *av = (const int8_t *)a->a;
    const float *dx = (const float *)&a->dx, *dxs = (const float *)&a->dxs;
    float32x4_t acc[2] = {vdupq_n_f32(0), vdupq_n_f32(0)};
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) { /* runs 4 i .. 4 i + 3 */
        if (64 * i >= nv) break;
        int32x4_t d[4];
        for (int k = 0; k < 4; k++) d[k] = dot16(w->q[4 * i + k], vld1q_s8(av + 64 * i + 16 * k));
        const int32x4_t g = vpaddq_s32(vpaddq_s32(d[0], d[1]), vpaddq_s32(d[2], d[3])); /* lane k: run 4 i + k */
        const float32x4_t s = vmulq_f32(vld1q_f32(w->s + 4 * i), vld1q_f32(dx + 4 * i));
        acc[i % 2] = vfmaq_f32(acc[i % 2], vcvtq_f32_s32(g), s);
        if (HAS_M(type)) acc[i % 2] = vfmaq_f32(acc[i % 2], vld1q_f32(w->b + 4 * i), vld1q_f32(dxs + 4 * i));
    }
    return vaddq_f32(acc[0], acc[1]);
}
#endif
