/* The chunk of quant_chunk.h for AVX2 builds without AVX-512 (the avx2 and avx2_vnni levels).
 * The generic chunk keeps 64-byte vectors in an order that AVX-512 unpacks with few shuffles;
 * on 32-byte registers GCC splits those shuffles into scalar moves (3-6 GB/s per core, the
 * fp32 product under 1 GB/s). Here a chunk is in natural order, one 32-byte register per 32
 * values, which every type unpacks with in-lane byte operations:
 *   q[j]: values 32 j .. 32 j + 31 as bytes (Q8_0: signed, so OFFSET does not apply);
 *   s[h], b[h]: per run r = 8 h + l of 16 values, w = s q + b (b = m, or -OFFSET s).
 * The int8 product is vpmaddubsw + vpmaddwd (or AVX-VNNI's vpdpbusd) per 32 values, scaled in
 * fp32 per run; the fp32 product dequantizes 8 weights at a time with one FMA, exactly (s q is
 * exact, so the FMA rounds once, as the reference's add does). Included by quant_chunk.h. */
#ifndef PDSERVE_QUANT_AVX2_H
#define PDSERVE_QUANT_AVX2_H
#include <immintrin.h>

typedef struct { __m256i q[8]; __m256 s[2], b[2]; } chunk;
typedef v8 accv; /* an accumulator of the product: 8 floats */
#define ACC_WIDTH 8
#define ACC_ROWS 2 /* activation rows per pass of the tile's fp32 loop: 2 x NT sums + loads fit 16 registers */
static inline float acc_sum(accv v) { return hsum(v); }
static inline accv acc_load(const float *p) { return load8(p); }
/* The activations' term per run is dx sum(a) times b (quantize_row), whatever the type. */
#define ACT_FACTOR(type) 1.0f
static inline int run_group(int type, int c, int k) { (void)type; return 4 * c + k; }
static inline int run_lane(int type, int c, int k) { (void)type; return 4 * c + k; }

static inline __m256i nibbles_lo_hi(__m128i x) { /* 16 bytes -> low nibbles, then high nibbles */
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, 4), x), _mm256_set1_epi8(15));
}

/* 16 at byte i where bit i of the 32-bit word at p is set (Q5_0 / Q5_1's fifth bits). */
static inline __m256i bits_16(const uint8_t *p) {
    uint32_t m;
    memcpy(&m, p, 4);
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201u);
    const __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)m), spread), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(b, bit), _mm256_set1_epi8(16));
}

/* Bit `bit` of each byte of h moved to bit 4 (Q5_K's fifth bits). */
static inline __m256i bit_to_16(__m256i h, int bit) {
    const __m256i moved = bit < 4 ? _mm256_slli_epi16(h, 4 - bit) : _mm256_srli_epi16(h, bit - 4);
    return _mm256_and_si256(moved, _mm256_set1_epi8(16));
}

static inline __m256 lanes(__m256 v, int a, int b, int c, int d) { /* v[a] v[a] v[b] v[b] ... */
    return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(a, a, b, b, c, c, d, d));
}
static inline float half1(const uint8_t *p) { return _cvtsh_ss(ldh(p)); }

/* The chunk at p: one super-block, or nb 32-value blocks (1..8). All 8 blocks' headers are
 * read (load_chunk leaves 8 blocks' bytes readable); the missing blocks' q are 0 and their
 * s and b and-ed to 0 (their bytes may read as NaN). */
static inline __attribute__((always_inline)) chunk decode(int type, const uint8_t *p, int nb) {
    const int B = BLOCK_BYTES[type];
    chunk c;
    if (BLOCK_VALUES[type] == 32) {
        const __m256i words = block_words(p, B); /* d_j | m_j << 16 */
        const __m256 f[2] = {_mm256_cvtph_ps(_mm256_castsi256_si128(words)), _mm256_cvtph_ps(_mm256_extracti128_si256(words, 1))};
        const int qs = type == Q8_0 || type == Q4_0 ? 2 : type == Q4_1 ? 4 : type == Q5_0 ? 6 : 8;
        for (int h = 0; h < 2; h++) { /* f[h] = d, m of blocks 4h..4h+3; run 8h + l is block 4h + l / 2 */
            c.s[h] = lanes(f[h], 0, 2, 4, 6);
            c.b[h] = HAS_M(type) ? lanes(f[h], 1, 3, 5, 7) : (__m256)(c.s[h] * splat(-(float)(type == Q8_0 ? 0 : OFFSET[type])));
            if (nb < 8) {
                const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nb - 4 * h),
                                                                           _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)));
                c.s[h] = _mm256_and_ps(c.s[h], keep), c.b[h] = _mm256_and_ps(c.b[h], keep);
            }
        }
        for (int j = 0; j < 8; j++) {
            const uint8_t *blk = p + j * B;
            if (j >= nb) c.q[j] = _mm256_setzero_si256();
            else if (type == Q8_0) c.q[j] = _mm256_loadu_si256((const __m256i *)(blk + qs));
            else {
                c.q[j] = nibbles_lo_hi(_mm_loadu_si128((const __m128i *)(blk + qs)));
                if (type == Q5_0 || type == Q5_1) c.q[j] = _mm256_or_si256(c.q[j], bits_16(blk + qs - 4));
            }
        }
    } else if (type == Q4_K || type == Q5_K) {
        const __m128i sc = (__m128i)k_scale_bytes(p + 4); /* scales 0..7, mins 0..7 */
        const __m256 s8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc)) * splat(half1(p));
        const __m256 m8 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sc, 8))) * splat(-half1(p + 2));
        c.s[0] = lanes(s8, 0, 1, 2, 3), c.s[1] = lanes(s8, 4, 5, 6, 7);
        c.b[0] = lanes(m8, 0, 1, 2, 3), c.b[1] = lanes(m8, 4, 5, 6, 7);
        const __m256i low = _mm256_set1_epi8(15);
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 16));
        for (int i = 0; i < 4; i++) { /* 32 bytes: sub-block 2i in the low nibbles, 2i + 1 high */
            const __m256i z = _mm256_loadu_si256((const __m256i *)(p + (type == Q5_K ? 48 : 16) + 32 * i));
            c.q[2 * i] = _mm256_and_si256(z, low), c.q[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(z, 4), low);
            if (type == Q5_K) {
                c.q[2 * i] = _mm256_or_si256(c.q[2 * i], bit_to_16(qh, 2 * i));
                c.q[2 * i + 1] = _mm256_or_si256(c.q[2 * i + 1], bit_to_16(qh, 2 * i + 1));
            }
        }
    } else { /* Q6_K: low nibbles (2 x 64 bytes) | high 2 bits (2 x 32) | 16 int8 scales | d */
        const __m128i sc = _mm_loadu_si128((const __m128i *)(p + 192));
        const float d = half1(p + 208);
        c.s[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)) * splat(d);
        c.s[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))) * splat(d);
        c.b[0] = c.s[0] * splat(-32.0f), c.b[1] = c.s[1] * splat(-32.0f);
        const __m256i low = _mm256_set1_epi8(15), two = _mm256_set1_epi8(0x30);
        for (int n = 0; n < 2; n++) { /* 128 values: ql[64 n ..] (two 32-byte halves), qh[32 n ..] */
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(p + 64 * n));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(p + 64 * n + 32));
            const __m256i h = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * n));
            c.q[4 * n] = _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_and_si256(_mm256_slli_epi16(h, 4), two));
            c.q[4 * n + 1] = _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_and_si256(_mm256_slli_epi16(h, 2), two));
            c.q[4 * n + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), _mm256_and_si256(h, two));
            c.q[4 * n + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                                             _mm256_and_si256(_mm256_srli_epi16(h, 2), two));
        }
    }
    return c;
}

/* Weights 16 r + 8 i .. 16 r + 8 i + 7, dequantized exactly. */
static inline __attribute__((always_inline)) __m256 weights8(int type, const chunk *ch, int r, int i) {
    const __m256i q = ch->q[r / 2];
    __m128i h = r % 2 ? _mm256_extracti128_si256(q, 1) : _mm256_castsi256_si128(q);
    if (i) h = _mm_srli_si128(h, 8);
    const __m256 f = _mm256_cvtepi32_ps(type == Q8_0 ? _mm256_cvtepi8_epi32(h) : _mm256_cvtepu8_epi32(h));
    const __m256i lane = _mm256_set1_epi32(r % 8);
    return _mm256_fmadd_ps(f, _mm256_permutevar8x32_ps(ch->s[r / 8], lane), _mm256_permutevar8x32_ps(ch->b[r / 8], lane));
}

static inline __attribute__((always_inline)) void dequant(int type, const chunk *ch, int nv, float *out) {
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++)
        if (16 * r < nv)
            for (int i = 0; i < 2; i++) _mm256_storeu_ps(out + 16 * r + 8 * i, weights8(type, ch, r, i));
}

/* acc + the fp32 product of a chunk with x's chunk; four accumulators keep four FMA chains in
 * flight. */
static inline __attribute__((always_inline)) void chunk_fma(int type, const chunk *ch, const float *x, int nv, accv acc[4]) {
#pragma GCC unroll 16
    for (int r = 0; r < 16; r++)
        if (16 * r < nv)
            for (int i = 0; i < 2; i++)
                acc[(2 * r + i) % 4] = (accv)_mm256_fmadd_ps(weights8(type, ch, r, i), _mm256_loadu_ps(x + 16 * r + 8 * i),
                                                             (__m256)acc[(2 * r + i) % 4]);
}

/* The int8 product of a chunk with an activation chunk (act_chunk: natural order, dx and
 * dx sum(a) per run): per 32 values one u8 x s8 dot product into 8 int32 lanes (lanes 0..3
 * one run, 4..7 the next), scaled per run. Q8_0's signed weights move their sign onto a. */
static inline __attribute__((always_inline)) accv chunk_dot(int type, const chunk *w, const act_chunk *a, int nv) {
    const float *dx = (const float *)&a->dx, *dxs = (const float *)&a->dxs;
    const __m256 sd[2] = {w->s[0] * _mm256_loadu_ps(dx), w->s[1] * _mm256_loadu_ps(dx + 8)};
    __m256 acc[2] = {_mm256_fmadd_ps(w->b[0], _mm256_loadu_ps(dxs), w->b[1] * _mm256_loadu_ps(dxs + 8)),
                     _mm256_setzero_ps()};
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        if (32 * j >= nv) break;
        __m256i av = _mm256_loadu_si256((const __m256i *)((const int8_t *)a->a + 32 * j)), qv = w->q[j];
        if (type == Q8_0) av = _mm256_sign_epi8(av, qv), qv = _mm256_abs_epi8(qv);
#ifdef __AVXVNNI__
        const __m256i dot = _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), qv, av);
#else /* no int16 saturation: |q| <= 128 only for Q8_0, whose a is within 127 */
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(qv, av), _mm256_set1_epi16(1));
#endif
        const int l = 2 * (j % 4);
        const __m256 scale = _mm256_permutevar8x32_ps(sd[j / 4], _mm256_setr_epi32(l, l, l, l, l + 1, l + 1, l + 1, l + 1));
        acc[j % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[j % 2]);
    }
    return (accv)(acc[0] + acc[1]);
}
#endif
