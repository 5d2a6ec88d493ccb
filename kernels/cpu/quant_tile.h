/* The exact (fp32) product of T > 1 activation rows with Q4_0, Q4_1 and Q8_0 rows (the default
 * model's types), and Q4_K and Q6_K rows (a Q4_K_M file's), for the avx512 and avx2 levels:
 * quant.c's path for small batches of them. Included by quant.c after quant_t1_b32.h, whose
 * scheme (and quant_t1.h's for the K-quants) it extends to a tile of rows:
 *   - each activation row is prepared once per call as the batch-1 paths prepare one (values
 *     in the order the weights' bytes unpack to, times 2^(s - e); per block or sub-block the
 *     sum of x that multiplies the offset or the min), here in quads of 128 values with 8 term
 *     slots after them (a K-quant super-block is two quads), the T rows of a quad side by side;
 *   - per weight row and 8 weights, the quants are and-ed in place and converted (q 2^e) and
 *     multiplied by the block's (sub-block's) scale (exact: q has at most 8 bits and the scale
 *     11, or 6 + 6 + 11 for the K-quants), then that vector meets every activation row of the
 *     tile with one FMA each, so the conversion and the scale are paid once per tile of rows,
 *     and no dequantized copy goes through memory;
 *   - per quad, one FMA adds the blocks' terms (d and m, or the mins or scales, against the
 *     slots) to each sum.
 * The weights are the same numbers as the dequantized ones (d q + m rounded once); only the
 * order and grouping of the sums differs: x @ W^T up to fp32 summation error. */
#ifndef PDSERVE_QUANT_TILE_H
#define PDSERVE_QUANT_TILE_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "quant_t1_b32.h"

#define TB_QUAD (16 * 8 + 8) /* floats of one activation row's quad: 16 vectors, 8 term slots */
/* Weight rows x activation rows whose sums stay in registers (TB_NR x TB_TT of them, with the
 * NR weight vectors and one activation vector beside): AVX2 has 16 vector registers, AVX-512
 * 32 (these are 256-bit ones, for the reason quant_t1_b32.h gives). The sizes below are the
 * ones measured fastest (docs/kernels.md); -D on the compiler's line tries others. */
#ifndef TB_NR
#ifdef __AVX512F__
#define TB_NR 2
#else
#define TB_NR 1
#endif
#endif
#ifndef TB_TT
#define TB_TT 8
#endif
#define TB_MAX_TT 8
#define TB_MAX_T 16 /* activation rows quant.c sends here (Q4_0, Q4_1, Q8_0; K-quants below TB_TT) */
/* Activation bytes a span of quads may take (tb_rows): at avx2 a tile of 1 weight row loads
 * every activation vector once per FMA, which L1 serves and L2 does not; at avx512 a tile of 2
 * rows halves those loads, and spans measured slower there (the weights' stream is broken up). */
#ifndef TB_SPAN_BYTES
#ifdef __AVX512F__
#define TB_SPAN_BYTES (1 << 30)
#else
#define TB_SPAN_BYTES (24 << 10)
#endif
#endif
#ifndef TB_ROWS
#define TB_ROWS 16 /* weight rows per block (a multiple of TB_NR) */
#endif
_Static_assert(TB_TT >= 1 && TB_TT <= TB_MAX_TT && TB_ROWS % TB_NR == 0, "tile sizes out of range");

#define TB_TYPE(type) (B32_TYPE(type) || (type) == Q4_K || (type) == Q6_K)
#define TB_KQUANT(type) ((type) == Q4_K || (type) == Q6_K) /* a super-block is two quads */
static inline int tb_slot(int type) { return type == Q4_0 ? 0 : type == Q4_1 ? 1 : type == Q8_0 ? 2 : type == Q4_K ? 3 : 4; }

/* The value within a quad of lane d of vector i, and the exponent that vector's quants come
 * with. Q4: two 2-block vectors of 8; Q8_0: four 1-block vectors of 4; Q4_K: a 32-byte load
 * of 64 values (low nibbles, then high) per 8; Q6_K: 32 bytes merged with their high bits per
 * 4, two per load of low nibbles (AVX2's top nibble is shifted down, never converted as a
 * negative lane). */
static inline int tb_value(int type, int i, int d) {
    if (TB_KQUANT(type)) return 64 * (i / 8) + 32 * (i / 4 % 2) + 4 * d + i % 4;
    return type == Q8_0 ? 32 * (i / 4) + b32_value(type, i % 4, d) : 64 * (i / 8) + b32_value(type, i % 8, d);
}
static inline int tb_exponent(int type, int i) {
    if (type == Q4_K) return i % 8 == 7 ? 0 : 8 * (i % 4) + 4 * (i / 4 % 2);
    if (type == Q6_K) return 8 * (i % 4);
    return b32_exponent(type, type == Q8_0 ? i % 4 : i % 8);
}

/* Per type (tb_slot): the value within a quad of each slot of the prepared activations, and
 * the exponent of each of its vectors; filled when the library loads. */
static uint8_t tb_index[5][128];
static int8_t tb_exp[5][16];
static void __attribute__((constructor)) tb_tables(void) {
    static const int types[5] = {Q4_0, Q4_1, Q8_0, Q4_K, Q6_K};
    for (int t = 0; t < 5; t++)
        for (int i = 0; i < 16; i++) {
            tb_exp[t][i] = (int8_t)tb_exponent(types[t], i);
            for (int d = 0; d < 8; d++) tb_index[t][8 * i + d] = (uint8_t)tb_value(types[t], i, d);
        }
}

/* X [nq][T][TB_QUAD] from x [T, K] (row stride xs, K a multiple of 32, the last quad
 * zero-padded), each row times its own 2^s as in t1_prep; unscale[t] = 2^-s. Term slots:
 * Q4_0 / Q4_1 / Q8_0: 2b multiplies block b's d, 2b + 1 Q4_1's m; Q4_K: its 32-value run b
 * (of 4) in slot b of an even quad, 4 + b of an odd one, against the super-block's 8 mins;
 * Q6_K: its 16-value run b (of 8) in slot b, against 8 of the super-block's 16 scales. */
static void tb_prep(int type, const float *x, int64_t xs, int64_t T, int64_t K, float *X, float *unscale) {
    const int64_t nq = (K + 127) / 128;
    const int ti = tb_slot(type), run = type == Q6_K ? 16 : 32;
    const uint8_t *index = tb_index[ti];
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * xs;
        const int s = b32_shift(xr, K);
        unscale[t] = ldexpf(1.0f, -s);
        float pow2[16];
        for (int i = 0; i < 16; i++) pow2[i] = ldexpf(1.0f, s - tb_exp[ti][i]);
        const float term = ldexpf(type == Q4_0 ? -8.0f : type == Q8_0 ? -128.0f : type == Q6_K ? -32.0f
                                  : type == Q4_K ? -1.0f : 1.0f, s);
        for (int64_t q = 0; q < nq; q++) {
            float *o = X + (q * T + t) * TB_QUAD;
            const int n = (int)(K - 128 * q < 128 ? K - 128 * q : 128);
            float xq[128] = {0}; /* the quad's values, zero past K */
            memcpy(xq, xr + 128 * q, sizeof(float) * (size_t)n);
            for (int i = 0; i < 16; i++)
                for (int d = 0; d < 8; d++) o[8 * i + d] = xq[index[8 * i + d]] * pow2[i];
            memset(o + 128, 0, 8 * sizeof(float));
            for (int b = 0; b < 128 / run; b++) {
                v8 sum = load8(xq + run * b) + load8(xq + run * b + 8);
                if (run == 32) sum += load8(xq + run * b + 16) + load8(xq + run * b + 24);
                const int slot = type == Q4_K ? 4 * (int)(q % 2) + b : type == Q6_K ? b : 2 * b + (type == Q4_1);
                o[128 + slot] = hsum(sum) * term;
            }
        }
    }
}

/* Independent sums per (weight row, activation row) so that about 8 FMA chains are in flight
 * (4 cycles of latency, 2 FMAs a cycle): 1 for big tiles, more for few activation rows. */
static inline int tb_sets(int nr, int tt) { return nr * tt >= 8 ? 1 : 8 / (nr * tt); }

/* acc[j][t + tt s] + quad (4 blocks at p[j]) of weight row j times activation row t of xq
 * (the quad's first row of the tile; rows TB_QUAD floats apart), vector k going to set
 * s = k mod tb_sets. */
static inline __attribute__((always_inline)) void tb_quad(int type, int nr, int tt, int nvec, const uint8_t *const p[],
                                                          const float *xq, __m256 acc[][TB_MAX_TT]) {
    const int B = BLOCK_BYTES[type], qs = type == Q4_1 ? 4 : 2;
    __m256 dm[TB_NR]; /* d0 m0 d1 m1 d2 m2 d3 m3 (m = 0 but for Q4_1) */
    #pragma GCC unroll 16
    for (int j = 0; j < nr; j++) {
        dm[j] = _mm256_cvtph_ps(_mm_setr_epi32(b32_word(p[j], type), b32_word(p[j] + B, type),
                                               b32_word(p[j] + 2 * B, type), b32_word(p[j] + 3 * B, type)));
        #pragma GCC unroll 16
        for (int t = 0; t < tt; t++) acc[j][t] = _mm256_fmadd_ps(dm[j], _mm256_loadu_ps(xq + t * TB_QUAD + 128), acc[j][t]);
    }
    const int per = type == Q8_0 ? 4 : 8; /* vectors per 256-bit load of quants */
    #pragma GCC unroll 16
    for (int v = 0; v < nvec; v++) {
        __m256i raw[TB_NR];
        __m256 d[TB_NR];
        #pragma GCC unroll 16
        for (int j = 0; j < nr; j++) {
            if (type == Q8_0) {
                raw[j] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p[j] + v * B + 2)), _mm256_set1_epi8((char)0x80));
                d[j] = _mm256_permutevar8x32_ps(dm[j], _mm256_set1_epi32(2 * v));
            } else {
                raw[j] = _mm256_loadu2_m128i((const __m128i *)(p[j] + (2 * v + 1) * B + qs), (const __m128i *)(p[j] + 2 * v * B + qs));
                d[j] = _mm256_permutevar8x32_ps(dm[j], _mm256_setr_epi32(4 * v, 4 * v, 4 * v, 4 * v, 4 * v + 2, 4 * v + 2, 4 * v + 2, 4 * v + 2));
            }
        }
        #pragma GCC unroll 16
        for (int k = 0; k < per; k++) {
            const int e = type == Q8_0 ? 8 * k : 8 * (k % 4) + 4 * (k / 4), bits = type == Q8_0 ? 255 : 15;
            __m256 wv[TB_NR];
            #pragma GCC unroll 16
            for (int j = 0; j < nr; j++) {
                const __m256i q = e == 32 - (type == Q8_0 ? 8 : 4) ? _mm256_srli_epi32(raw[j], e)
                                                                   : _mm256_and_si256(raw[j], _mm256_set1_epi32(bits << e));
                wv[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(q), d[j]);
            }
            const float *xv = xq + 8 * (per * v + k);
            #pragma GCC unroll 16
            for (int t = 0; t < tt; t++) {
                const __m256 a = _mm256_loadu_ps(xv + t * TB_QUAD);
                const int c = t + tt * (k % tb_sets(nr, tt));
                #pragma GCC unroll 16
                for (int j = 0; j < nr; j++) acc[j][c] = _mm256_fmadd_ps(wv[j], a, acc[j][c]);
            }
        }
    }
}

/* acc + a Q4_K or Q6_K super-block (at p[j]) of weight row j times the tile's activation rows
 * (quads xa and xb: values 0..127 and 128..255), as tb_quad does for a quad. */
static inline __attribute__((always_inline)) void tb_superblock(int type, int nr, int tt, const uint8_t *const p[],
                                                                const float *xa, const float *xb,
                                                                __m256 acc[][TB_MAX_TT]) {
    const int sets = tb_sets(nr, tt);
    __m256 sc[TB_NR][2]; /* Q4_K: scales 0..7, mins 0..7; Q6_K: scales 0..7, 8..15 */
#pragma GCC unroll 16
    for (int j = 0; j < nr; j++) {
        if (type == Q4_K) {
            const __m128i b = (__m128i)k_scale_bytes(p[j] + 4);
            sc[j][0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), _mm256_set1_ps(_cvtsh_ss(ldh(p[j]))));
            sc[j][1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))),
                                     _mm256_set1_ps(_cvtsh_ss(ldh(p[j] + 2))));
        } else {
            const __m128i b = _mm_loadu_si128((const __m128i *)(p[j] + 192));
            const __m256 d = _mm256_set1_ps(_cvtsh_ss(ldh(p[j] + 208)));
            sc[j][0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), d);
            sc[j][1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))), d);
        }
        const __m256 ta = type == Q4_K ? sc[j][1] : sc[j][0], tb = sc[j][1];
#pragma GCC unroll 16
        for (int t = 0; t < tt; t++)
            acc[j][t] = _mm256_fmadd_ps(ta, _mm256_loadu_ps(xa + t * TB_QUAD + 128),
                                        _mm256_fmadd_ps(tb, _mm256_loadu_ps(xb + t * TB_QUAD + 128), acc[j][t]));
    }
#pragma GCC unroll 16
    for (int g = 0; g < 8; g++) { /* 4 vectors of 8 weights sharing a scale pattern */
        const float *xv = (g < 4 ? xa : xb) + 32 * (g % 4);
        __m256i q[TB_NR];
        __m256 scale[TB_NR];
#pragma GCC unroll 16
        for (int j = 0; j < nr; j++) {
            if (type == Q4_K) { /* 32 bytes (g / 2): run g / 2 * 2 low nibbles, + 1 high */
                q[j] = _mm256_loadu_si256((const __m256i *)(p[j] + 16 + 32 * (g / 2)));
                scale[j] = _mm256_permutevar8x32_ps(sc[j][0], _mm256_set1_epi32(g));
            } else { /* r = g / 4, h = g / 2 % 2, e = g % 2: 16-value runs 8 r + 4 h + 2 e (+ 1) */
                const int r = g / 4, h = g / 2 % 2, e = g % 2, sh = 4 - 2 * (2 * h + e), l = 4 * h + 2 * e;
                const __m256i ql = _mm256_loadu_si256((const __m256i *)(p[j] + 64 * r + 32 * e));
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(p[j] + 128 + 32 * r));
                const __m256i hi = sh > 0 ? _mm256_slli_epi16(qh, sh) : sh < 0 ? _mm256_srli_epi16(qh, -sh) : qh;
                q[j] = _mm256_or_si256(_mm256_and_si256(h ? _mm256_srli_epi16(ql, 4) : ql, _mm256_set1_epi8(15)),
                                       _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
                scale[j] = _mm256_permutevar8x32_ps(sc[j][r], _mm256_setr_epi32(l, l, l, l, l + 1, l + 1, l + 1, l + 1));
            }
        }
#pragma GCC unroll 16
        for (int k = 0; k < 4; k++) {
            const int i = 4 * (g % 4) + k, e = tb_exponent(type, 16 * (g / 4) + i);
            __m256 wv[TB_NR];
#pragma GCC unroll 16
            for (int j = 0; j < nr; j++) {
                const __m256i m = type == Q4_K && e == 0 && k == 3 ? _mm256_srli_epi32(q[j], 28)
                                  : _mm256_and_si256(q[j], _mm256_set1_epi32((type == Q4_K ? 15 : 63) << e));
                wv[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(m), scale[j]);
            }
#pragma GCC unroll 16
            for (int t = 0; t < tt; t++) {
                const __m256 a = _mm256_loadu_ps(xv + 8 * k + t * TB_QUAD);
                const int c = t + tt * (k % sets);
#pragma GCC unroll 16
                for (int j = 0; j < nr; j++) acc[j][c] = _mm256_fmadd_ps(wv[j], a, acc[j][c]);
            }
        }
    }
}

/* Quads [q0, q1) of weight rows n .. n + TB_NR - 1 (rows from n1 on repeat row n1 - 1 and are
 * not written) times activation rows t0 .. t0 + tt - 1, added to the sums in part (zero where
 * q0 = 0); the last span writes y[t0 + t, n + j] instead. Rows of K / 32 blocks, rb bytes
 * apart; X from tb_prep (T rows). A row's last quad, when it is not whole, is read from a
 * zeroed copy (scales 0), so nothing past the row is read. */
static inline __attribute__((always_inline)) void tb_tile(int type, int tt, const uint8_t *w, int64_t rb, int64_t n,
                                                          int64_t n1, int64_t K, int64_t q0, int64_t q1, const float *X,
                                                          int64_t T, int64_t t0, __m256 *part, const float *unscale,
                                                          float *y, int64_t ys) {
    const int B = BLOCK_BYTES[type];
    const int64_t blocks = K / 32, full = blocks / 4, rest = TB_KQUANT(type) ? 0 : blocks % 4, nq = (K + 127) / 128;
    const uint8_t *p[TB_NR];
    for (int j = 0; j < TB_NR; j++) p[j] = w + (n + j < n1 ? n + j : n1 - 1) * rb;
    __m256 acc[TB_NR][TB_MAX_TT];
#pragma GCC unroll 16
    for (int j = 0; j < TB_NR; j++)
#pragma GCC unroll 16
        for (int c = 0; c < tt * tb_sets(TB_NR, tt); c++) acc[j][c] = q0 && c < tt ? part[j * tt + c] : _mm256_setzero_ps();
    if (TB_KQUANT(type)) /* K a multiple of 256: whole super-blocks, two quads each (q0 even) */
        for (int64_t q = q0; q < q1 && q < nq; q += 2) {
            const uint8_t *pq[TB_NR];
            for (int j = 0; j < TB_NR; j++) {
                pq[j] = p[j] + q / 2 * B;
                T1_PREFETCH(pq[j], B);
            }
            tb_superblock(type, TB_NR, tt, pq, X + (q * T + t0) * TB_QUAD, X + ((q + 1) * T + t0) * TB_QUAD, acc);
        }
    else for (int64_t q = q0; q < q1 && q < full; q++) {
        const uint8_t *pq[TB_NR];
        for (int j = 0; j < TB_NR; j++) {
            pq[j] = p[j] + q * 4 * B;
            T1_PREFETCH(pq[j], 4 * B);
        }
        tb_quad(type, TB_NR, tt, type == Q8_0 ? 4 : 2, pq, X + (q * T + t0) * TB_QUAD, acc);
    }
    if (rest && q1 > full) {
        uint8_t tail[TB_NR][4 * 34];
        const uint8_t *pq[TB_NR];
        for (int j = 0; j < TB_NR; j++) {
            memset(tail[j], 0, sizeof(tail[j]));
            memcpy(tail[j], p[j] + full * 4 * B, (size_t)(rest * B));
            pq[j] = tail[j];
        }
        /* only the 256-bit loads that hold blocks (the rest of the zeroed copy adds 0) */
        const float *xq = X + (full * T + t0) * TB_QUAD;
        const int64_t loads = type == Q8_0 ? rest : (rest + 1) / 2;
        if (loads == 1) tb_quad(type, TB_NR, tt, 1, pq, xq, acc);
        else if (loads == 2) tb_quad(type, TB_NR, tt, 2, pq, xq, acc);
        else tb_quad(type, TB_NR, tt, 3, pq, xq, acc);
    }
#pragma GCC unroll 16
    for (int j = 0; j < TB_NR; j++)
#pragma GCC unroll 16
        for (int c = tt; c < tt * tb_sets(TB_NR, tt); c++) acc[j][c % tt] = _mm256_add_ps(acc[j][c % tt], acc[j][c]);
    if (q1 < nq) {
#pragma GCC unroll 16
        for (int j = 0; j < TB_NR; j++)
#pragma GCC unroll 16
            for (int t = 0; t < tt; t++) part[j * tt + t] = acc[j][t];
        return;
    }
#pragma GCC unroll 16
    for (int j = 0; j < TB_NR; j++)
#pragma GCC unroll 16
        for (int t = 0; t < tt; t++)
            if (n + j < n1) y[(t0 + t) * ys + n + j] = hsum((v8)acc[j][t]) * unscale[t0 + t];
}

#define TB_TILES(TYPE, TT)                                                                                           \
    static void tb_tiles_##TYPE##_##TT(const uint8_t *w, int64_t rb, int64_t n, int64_t n1, int64_t K, int64_t q0,   \
                                       int64_t q1, const float *X, int64_t T, int64_t t0, __m256 *part,               \
                                       const float *unscale, float *y, int64_t ys) {                                  \
        tb_tile(TYPE, TT, w, rb, n, n1, K, q0, q1, X, T, t0, part, unscale, y, ys);                                   \
    }
typedef void (*tb_fn)(const uint8_t *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const float *, int64_t,
                      int64_t, __m256 *, const float *, float *, int64_t);
/* One function per tile height: the sums of a tile stay in registers only where their count is
 * known when compiling. Heights above TB_TT are never called. */
#define TB_TYPE_FUNCTIONS(TYPE)                                                                                      \
    TB_TILES(TYPE, 1) TB_TILES(TYPE, 2) TB_TILES(TYPE, 3) TB_TILES(TYPE, 4) TB_TILES(TYPE, 5) TB_TILES(TYPE, 6)          \
    TB_TILES(TYPE, 7) TB_TILES(TYPE, 8)                                                                              \
    static const tb_fn tb_##TYPE[TB_MAX_TT + 1] = {0, tb_tiles_##TYPE##_1, tb_tiles_##TYPE##_2, tb_tiles_##TYPE##_3,   \
                                                   tb_tiles_##TYPE##_4, tb_tiles_##TYPE##_5, tb_tiles_##TYPE##_6,      \
                                                   tb_tiles_##TYPE##_7, tb_tiles_##TYPE##_8};
TB_TYPE_FUNCTIONS(Q4_0) TB_TYPE_FUNCTIONS(Q4_1) TB_TYPE_FUNCTIONS(Q8_0) TB_TYPE_FUNCTIONS(Q4_K) TB_TYPE_FUNCTIONS(Q6_K)

/* y[t, n] for t < T, n in [n0, n1) (n0 a multiple of TB_NR). Blocks of TB_ROWS weight rows
 * meet tiles of TB_TT activation rows a span of quads at a time, the tiles' sums kept between
 * spans in part: a span's activations (at most TB_SPAN_BYTES) and weights stay in L1 however
 * long the rows are. */
static void tb_rows(int type, const uint8_t *w, int64_t rb, int64_t n0, int64_t n1, int64_t K, const float *X, int64_t T,
                    const float *unscale, float *y, int64_t ys) {
    const tb_fn *f = type == Q4_0 ? tb_Q4_0 : type == Q4_1 ? tb_Q4_1 : type == Q8_0 ? tb_Q8_0 : type == Q4_K ? tb_Q4_K : tb_Q6_K;
    const int64_t nq = (K + 127) / 128, fit = TB_SPAN_BYTES / (int64_t)(sizeof(float) * TB_QUAD * (T < TB_TT ? T : TB_TT));
    const int64_t span = fit >= nq ? nq : TB_KQUANT(type) ? (fit < 2 ? 2 : fit / 2 * 2) : (fit < 1 ? 1 : fit); /* K-quants: whole super-blocks */
    __m256 part[TB_ROWS * TB_MAX_TT];
    for (int64_t nb = n0; nb < n1; nb += TB_ROWS)
        for (int64_t t0 = 0; t0 < T; t0 += TB_TT) {
            const int64_t tt = T - t0 < TB_TT ? T - t0 : TB_TT, nend = n1 - nb < TB_ROWS ? n1 : nb + TB_ROWS;
            for (int64_t q0 = 0; q0 < nq; q0 += span)
                for (int64_t n = nb; n < nend; n += TB_NR)
                    f[tt](w, rb, n, nend, K, q0, q0 + span, X, T, t0, part + (n - nb) * tt, unscale, y, ys);
        }
}
#endif
