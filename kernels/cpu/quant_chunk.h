/* GGUF weight chunks for kernels/cpu/quant.c: the block types, and a row's 256-value chunk
 * unpacked into bytes q with a scale s and a term m per run of 16 values (w = s (q - OFFSET)
 * + m), read from the file's bytes (`decode`, `load_chunk`) and dequantized (`run_weights`,
 * `dequant`). Included once, by quant.c. */
#ifndef PDSERVE_QUANT_CHUNK_H
#define PDSERVE_QUANT_CHUNK_H
#include <stdint.h>
#include <string.h>

#include "vec.h"

enum { Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, NTYPES }; /* quant.py's codes */
static const int BLOCK_VALUES[NTYPES] = {32, 32, 32, 32, 32, 256, 256, 256};
static const int BLOCK_BYTES[NTYPES] = {18, 20, 22, 24, 34, 144, 176, 210};
static const int OFFSET[NTYPES] = {8, 0, 16, 0, 128, 0, 0, 32};
#define HAS_M(type) ((type) == Q4_1 || (type) == Q5_1 || (type) == Q4_K || (type) == Q5_K)
#ifndef PREFETCH
#define PREFETCH 4096 /* bytes ahead in the weight stream */
#endif

/* An activation row's chunk for the int8 path, in a weight chunk's order: int8 values, and
 * per run lane the row's scale dx and the scaled sum dxs (quantize_row). */
typedef int8_t i8x8 __attribute__((vector_size(8)));
typedef struct { i8x64 a[4]; v16 dx, dxs; } act_chunk;

/* Q4_K/Q5_K's 12 scale bytes (read as 16) -> 6-bit scales 0..7 and mins 0..7: bytes 0..7 hold
 * scales and mins 0..3 in their low 6 bits and the top 2 bits of 4..7, bytes 8..11 the low 4
 * bits of 4..7 (scales in the low nibble, mins in the high). */
static inline u8x16 k_scale_bytes(const uint8_t *p) {
    const u8x16 s = ld16(p);
    const u8x16 x = __builtin_shufflevector(s, s, 0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11);
    const u8x16 y = __builtin_shufflevector(s, s, 0, 0, 0, 0, 0, 1, 2, 3, 0, 0, 0, 0, 4, 5, 6, 7);
    const u8x16 top = {0, 0, 0, 0, 255, 255, 255, 255, 0, 0, 0, 0, 255, 255, 255, 255};
    const u8x16 min_hi = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 255, 255, 255, 255};
    const u8x16 low = ((x & ~min_hi) | ((x >> 4) & min_hi)) & (u8x16)((top & 15) | (~top & 63));
    return low | ((y >> 2) & (top & 0x30));
}

/* aarch64 with Advanced SIMD (not the portable level, which turns it off), little-endian: the
 * NEON code reads the 4 bytes of a 32-bit lane in memory order. */
#if defined(__aarch64__) && defined(__ARM_NEON) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define QUANT_NEON 1
#endif

#if defined(__AVX2__) && !defined(__AVX512F__)
#include "quant_avx2.h"
#elif defined(QUANT_NEON)
#include "quant_neon.h"
#else
/* A weight chunk: 256 values in the order of run_group, s and m per run (run_lane). */
typedef struct { u8x64 q[4]; v16 s, m; } chunk;

typedef v16 accv; /* an accumulator of the product: 16 floats */
#define ACC_WIDTH 16
#define ACC_ROWS 4 /* activation rows per pass of the tile's fp32 loop */
static inline float acc_sum(accv v) { return hsum16(v); }
static inline accv acc_load(const float *p) { return ldf16(p); }
/* The activations' term per run lane is dx sum(a) times this (times m for the types with m). */
#define ACT_FACTOR(type) (HAS_M(type) ? 1.0f : -(float)OFFSET[type])

/* A chunk is unpacked in the order that takes the fewest shuffles: quarter k of q[c] is a run
 * of 16 values, the natural group run_group(c, k) (values 16 g .. 16 g + 15), scaled by lane
 * run_lane(c, k) of s and m. 32-value blocks: q[2h] and q[2h + 1] hold the first and last 16
 * values of blocks 4h..4h+3, scaled in lane 4k + h (lanes 4k + 2, 4k + 3 are 0); otherwise run
 * (c, k) has lane 4k + c, where group_sums leaves its sum. The activations take the same order. */
static inline int run_group(int type, int c, int k) {
    if (BLOCK_VALUES[type] == 32) return 2 * (4 * (c / 2) + k) + c % 2;
    if (type == Q6_K) return 4 * c + k;
    return 2 * (4 * (c / 2) + 2 * (k / 2) + c % 2) + k % 2; /* 64 bytes' low nibbles, then high */
}
static inline int run_lane(int type, int c, int k) { return 4 * k + (BLOCK_VALUES[type] == 32 ? c / 2 : c); }

/* The chunk at p: one super-block, or nb 32-value blocks (1..8; for nb < 8 all 8 blocks'
 * headers and the 4-block half holding block nb - 1 are read, the missing blocks scaled by 0). */
static inline __attribute__((always_inline)) chunk decode(int type, const uint8_t *p, int nb) {
    const int B = BLOCK_BYTES[type];
    chunk c;
    if (BLOCK_VALUES[type] == 32) {
        const v16 f = block_halves(p, B), zero = {0}; /* d_b at 2b, Q4_1 / Q5_1's m_b at 2b + 1 */
        const int qs = type == Q8_0 || type == Q4_0 ? 2 : type == Q4_1 ? 4 : type == Q5_0 ? 6 : 8;
        for (int h = 0; h < 2; h++) {
            if (4 * h >= nb) {
                c.q[2 * h] = c.q[2 * h + 1] = (u8x64){0};
                continue;
            }
            if (type == Q8_0) {
                c.q[2 * h] = quad16(p + 4 * h * B + 2, B) ^ 0x80;
                c.q[2 * h + 1] = quad16(p + 4 * h * B + 18, B) ^ 0x80;
                continue;
            }
            const u8x64 z = quad16(p + 4 * h * B + qs, B);
            c.q[2 * h] = z & 15, c.q[2 * h + 1] = z >> 4;
            if (type == Q5_0 || type == Q5_1) { /* fifth bits: values 0..15 of each block, 16..31 */
                uint64_t lo = 0, hi = 0;
                for (int i = 0; i < 4; i++) {
                    uint32_t m;
                    memcpy(&m, p + (4 * h + i) * B + qs - 4, 4);
                    lo |= (uint64_t)(m & 0xFFFF) << 16 * i, hi |= (uint64_t)(m >> 16) << 16 * i;
                }
                c.q[2 * h] |= bits16(lo), c.q[2 * h + 1] |= bits16(hi);
            }
        }
#define BLOCK_LANES(o) o, 8 + o, 16, 16, 2 + o, 10 + o, 16, 16, 4 + o, 12 + o, 16, 16, 6 + o, 14 + o, 16, 16
        c.s = __builtin_shufflevector(f, zero, BLOCK_LANES(0));
        c.m = HAS_M(type) ? __builtin_shufflevector(f, zero, BLOCK_LANES(1)) : zero;
        if (nb < 8) { /* and-ed, not multiplied: the missing blocks' bytes may read as NaN */
            const i32x16 keep = (i32x16){0, 4, 8, 8, 1, 5, 8, 8, 2, 6, 8, 8, 3, 7, 8, 8} < nb;
            c.s = (v16)((i32x16)c.s & keep), c.m = (v16)((i32x16)c.m & keep);
        }
    } else if (type == Q4_K || type == Q5_K) {
        uint32_t d2;
        memcpy(&d2, p, 4);
        const v8 dd = half8((u16x8)(uint32_t __attribute__((vector_size(16)))){d2});
        const v16 sm = u8_float(k_scale_bytes(p + 4)) * __builtin_shufflevector(dd, dd, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        for (int h = 0; h < 2; h++) {
            const u8x64 z = ld64(p + (type == Q5_K ? 48 : 16) + 64 * h);
            c.q[2 * h] = z & 15, c.q[2 * h + 1] = z >> 4;
            if (type == Q5_K) {
                c.q[2 * h] |= bit_planes(ld32(p + 16), 4 * h, 4 * h + 2, 1) << 4;
                c.q[2 * h + 1] |= bit_planes(ld32(p + 16), 4 * h + 1, 4 * h + 3, 1) << 4;
            }
        }
#define SUB_LANES(o) o, 1 + o, 4 + o, 5 + o, o, 1 + o, 4 + o, 5 + o, 2 + o, 3 + o, 6 + o, 7 + o, 2 + o, 3 + o, 6 + o, 7 + o
        c.s = __builtin_shufflevector(sm, sm, SUB_LANES(0));
        c.m = -__builtin_shufflevector(sm, sm, SUB_LANES(8));
    } else { /* Q6_K: low nibbles (64-byte runs) | high 2 bits (32-byte runs) | int8 scales | d */
        for (int h = 0; h < 2; h++) {
            const u8x64 z = ld64(p + 64 * h);
            c.q[2 * h] = (z & 15) | bit_planes(ld32(p + 128 + 32 * h), 0, 2, 2) << 4;
            c.q[2 * h + 1] = (z >> 4) | bit_planes(ld32(p + 128 + 32 * h), 4, 6, 2) << 4;
        }
        const v16 sc = bytes_float(ld16(p + 192), 1);
        c.s = half8((u16x8){ldh(p + 208)})[0] * __builtin_shufflevector(sc, sc, 0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        c.m = (v16){0};
    }
    return c;
}

/* Bytes 16 k .. 16 k + 15 of v, taken in registers: loading them back from a spilled chunk
 * defeats store forwarding (a 64-byte store, a 16-byte load), which cost the fp32 path 3x. */
static inline __attribute__((always_inline)) u8x16 quarter(u8x64 v, int k) {
#define Q16(o) o, o + 1, o + 2, o + 3, o + 4, o + 5, o + 6, o + 7, o + 8, o + 9, o + 10, o + 11, o + 12, o + 13, o + 14, o + 15
    switch (k) {
    case 0: return __builtin_shufflevector(v, v, Q16(0));
    case 1: return __builtin_shufflevector(v, v, Q16(16));
    case 2: return __builtin_shufflevector(v, v, Q16(32));
    default: return __builtin_shufflevector(v, v, Q16(48));
    }
}

/* The chunk's first nv values as floats in natural order, exactly as gguf_quants computes them
 * (every product is exact in fp32: only the add of m rounds). */
static inline __attribute__((always_inline)) v16 run_weights(int type, const chunk *ch, int c) {
    const int l = run_lane(type, c / 4, c % 4);
    const v16 w = ch->s[l] * (u8_float(quarter(ch->q[c / 4], c % 4)) - (float)OFFSET[type]);
    return HAS_M(type) ? w + ch->m[l] : w;
}
static inline __attribute__((always_inline)) void dequant(int type, const chunk *ch, int nv, float *out) {
#pragma GCC unroll 16
    for (int c = 0; c < 16; c++) {
        const int g = run_group(type, c / 4, c % 4);
        if (16 * g >= nv) continue;
        const v16 w = run_weights(type, ch, c);  /* run c: values 16 g .. 16 g + 15 */
        memcpy(out + 16 * g, &w, 64);
    }
}

/* acc + per 4-byte lane the dot product of unsigned w and signed a (AVX-512 VNNI, or plain C). */
static inline i32x16 dot64(i32x16 acc, u8x64 w, i8x64 a) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return (i32x16)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, (__m512i)a);
#else
    for (int l = 0; l < 16; l++)
        for (int j = 4 * l; j < 4 * l + 4; j++) acc[l] += (int32_t)w[j] * (int32_t)a[j];
    return acc;
#endif
}

#define LO32 0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29
#define HI32 2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31
/* Lane sums r[c] (lane = 4 values of q[c]) -> lane 4k + c: the sum of quarter k of q[c]. */
static inline i32x16 group_sums(const i32x16 r[4]) {
    const i32x16 a = __builtin_shufflevector(r[0], r[1], LO32) + __builtin_shufflevector(r[0], r[1], HI32);
    const i32x16 b = __builtin_shufflevector(r[2], r[3], LO32) + __builtin_shufflevector(r[2], r[3], HI32);
    return __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
}

/* The int8 product of a chunk with an activation chunk. 32-value blocks: the pieces holding a
 * block's two halves accumulate together, and a quarter's lanes fold into one sum per half. */
static inline __attribute__((always_inline)) v16 chunk_dot(int type, const chunk *w, const act_chunk *a, int nv) {
    const i32x16 zero = {0};
    v16 g;
    if (BLOCK_VALUES[type] == 32) {
        const i32x16 r0 = dot64(dot64(zero, w->q[0], a->a[0]), w->q[1], a->a[1]);
        const i32x16 r1 = nv > 128 ? dot64(dot64(zero, w->q[2], a->a[2]), w->q[3], a->a[3]) : zero;
        const i32x16 t = __builtin_shufflevector(r0, r1, LO32) + __builtin_shufflevector(r0, r1, HI32);
        g = __builtin_convertvector(t + __builtin_shufflevector(t, t, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13), v16);
    } else {
        i32x16 r[4];
        for (int i = 0; i < 4; i++) r[i] = dot64(zero, w->q[i], a->a[i]);
        g = __builtin_convertvector(group_sums(r), v16);
    }
    return HAS_M(type) ? g * (w->s * a->dx) + w->m * a->dxs : w->s * (g * a->dx + a->dxs);
}

/* acc + the fp32 product of a chunk with x's chunk: each run of 16 weights dequantized in
 * registers exactly as `dequant` does (s * q is exact, so an FMA with m rounds as the add) and
 * multiplied in; four accumulators keep four FMA chains in flight. */
static inline __attribute__((always_inline)) void chunk_fma(int type, const chunk *ch, const float *x, int nv, v16 acc[4]) {
#pragma GCC unroll 16
    for (int c = 0; c < 16; c++) {
        const int g = run_group(type, c / 4, c % 4);
        if (16 * g < nv) acc[c % 4] += run_weights(type, ch, c) * ldf16(x + 16 * g);
    }
}

#endif

/* Chunk c of row n holding nv values. A short one (nv / 32 blocks) reads on into the next rows
 * where a whole chunk's bytes are left in the matrix, else decodes from a zero-padded copy. */
static inline __attribute__((always_inline)) chunk load_chunk(int type, const uint8_t *w, int64_t rb, int64_t n,
                                                              int64_t N, int64_t c, int nv) {
    const uint8_t *p = w + n * rb + c * (int64_t)(256 / BLOCK_VALUES[type]) * BLOCK_BYTES[type];
    if (nv == 256) { /* the hardware prefetcher alone leaves a core at ~7 of its ~15 GB/s */
        for (int o = 0; o < (256 / BLOCK_VALUES[type]) * BLOCK_BYTES[type]; o += 64) __builtin_prefetch(p + PREFETCH + o);
        return decode(type, p, 8);
    }
    if ((N - n) * rb - c * 8 * BLOCK_BYTES[type] >= 8 * BLOCK_BYTES[type]) return decode(type, p, nv / 32);
    uint8_t buf[8 * 34] = {0};
    memcpy(buf, p, (size_t)(nv / 32 * BLOCK_BYTES[type]));
    return decode(type, buf, nv / 32);
}

#endif
