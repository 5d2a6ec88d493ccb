/* Products with GGUF-quantized weights kept in their block format (contract: kernels/cpu/quant.py).
 * A weight row is read in chunks of 256 values (one K-quant super-block, or eight 32-value
 * blocks): `decode` unpacks a chunk into 256 unsigned 8-bit values q and, per run of 16 values,
 * a scale s and a term m: w = s * (q - OFFSET) + m. Then
 *   int8: activation rows are quantized per 32 values to int8 once per call; a chunk's product
 *         is four 64-byte u8 x s8 dot products (AVX-512 VNNI vpdpbusd, or plain C) summed per
 *         run and scaled in fp32 (AVX2 builds: eight 32-byte ones, quant_avx2.h; aarch64:
 *         sixteen 16-byte s8 x s8 ones, vdotq_s32 or widening multiplies, quant_neon.h);
 *   fp32: the chunk is dequantized exactly (as engine/models/gguf_quants.py) and multiplied
 *         with FMA.
 * T = 1 (int8) keeps one row's accumulator in a register; larger T decodes each chunk of NT
 * weight rows once for a tile of TT activation rows, so a batch reads the weights once. OpenMP
 * threads split the output rows. A row end that is not a whole chunk (K = 576: 2 chunks and 2
 * blocks) is read in place, on into the next rows, with the missing blocks' scales and-ed to 0;
 * near the matrix's end from a padded copy, so nothing is read outside the weight. At the avx2
 * and avx512 levels fp32 has faster paths that keep the scales out of the inner sums:
 * quant_t1.h and quant_t1_b32.h at T = 1, quant_tile.h for small batches. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "kernels.h"
#include "vec.h"

#include "quant_chunk.h"
#ifdef __AVX2__
#include "quant_t1.h"
#include "quant_t1_b32.h"
#include "quant_tile.h"
#elif defined(QUANT_NEON)
#include "quant_neon_t1.h"
#endif

#define NT 4                        /* weight rows decoded together (T > 1) */
#define TT 64                       /* activation rows sharing one decode */
#define PARALLEL_MIN_BYTES (1 << 15) /* of weights, to wake a second thread */
#define MIN(a, b) ((a) < (b) ? (a) : (b))

/* Row x (K floats) -> nch int8 chunks in the order of `type`, zero past K (a multiple of 32):
 * per 32 values a = round(x * 127 / max|x|), dx = max|x| / 127, and per run lane dx * sum(a),
 * times -OFFSET for the types without m (chunk_dot then needs one FMA for both terms). */
static void quantize_row(int type, const float *x, int64_t K, act_chunk *out, int64_t nch) {
    const float factor = ACT_FACTOR(type);
    for (int64_t ci = 0; ci < nch; ci++) {
        int8_t q[256], a[256];
        float dx[8], dx16[16] = {0}, dxs16[16] = {0};
        int32_t sum[16];
        for (int g = 0; g < 8; g++) {
            const int64_t k0 = ci * 256 + g * 32;
            float v[32] = {0};
            if (k0 < K) memcpy(v, x + k0, sizeof(v));
            v8 m = splat(0.0f);
            for (int i = 0; i < 4; i++) m = vmax(m, (v8)((v8i)load8(v + 8 * i) & 0x7FFFFFFF));
            m = vmax(m, __builtin_shufflevector(m, m, 4, 5, 6, 7, 0, 1, 2, 3));
            m = vmax(m, __builtin_shufflevector(m, m, 2, 3, 0, 1, 6, 7, 4, 5));
            const float amax = m[0] > m[1] ? m[0] : m[1], id = amax > 0.0f ? 127.0f / amax : 0.0f;
            for (int h = 0; h < 2; h++) { /* x * id rounded to fp32, then to the nearest even */
                v8 s16 = splat(0.0f);
                for (int i = 2 * h; i < 2 * h + 2; i++) {
                    v8 r = load8(v + 8 * i) * splat(id);
#ifdef __AVX__
                    r = (v8)_mm256_round_ps((__m256)r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
                    for (int j = 0; j < 8; j++) r[j] = __builtin_roundevenf(r[j]);
#endif
                    const i8x8 b = __builtin_convertvector(__builtin_convertvector(r, v8i), i8x8);
                    memcpy(q + g * 32 + 8 * i, &b, 8);
                    s16 += r;
                }
                sum[2 * g + h] = (int32_t)hsum(s16);
            }
            dx[g] = amax / 127.0f;
        }
        for (int c = 0; c < 4; c++)
            for (int k = 0; k < 4; k++) {
                const int g = run_group(type, c, k), l = run_lane(type, c, k);
                memcpy(a + 64 * c + 16 * k, q + 16 * g, 16);
                dx16[l] = dx[g / 2];
                dxs16[l] += factor * dx[g / 2] * (float)sum[g];
            }
        memcpy(out[ci].a, a, 256), memcpy(&out[ci].dx, dx16, 64), memcpy(&out[ci].dxs, dxs16, 64);
    }
}

/* acc + chunk c (nv values) of row n times the activations, by either path. */
static inline __attribute__((always_inline)) void t1_chunk(int type, int int8, const uint8_t *w, int64_t rb, int64_t N,
                                                           int64_t n, int64_t c, int nv, const act_chunk *A,
                                                           const float *x, accv acc[4]) {
    const chunk ch = load_chunk(type, w, rb, n, N, c, nv);
    if (int8) acc[0] += chunk_dot(type, &ch, A + c, nv);
    else chunk_fma(type, &ch, x + c * 256, nv, acc);
}

/* y[0, n] for n in [n0, n1), T = 1: the accumulators stay in registers (the short chunk,
 * whose copy may call memcpy, goes first so that no call falls in their life). fp32 takes no
 * tile and no dequantized copy in memory (the tile path's four activation rows would all be
 * the one row). */
static inline __attribute__((always_inline)) void rows_t1(int type, int int8, const uint8_t *w, int64_t rb, int64_t N,
                                                          int64_t n0, int64_t n1, int64_t K, const act_chunk *A,
                                                          const float *x, float *y) {
    for (int64_t n = n0; n < n1; n++) {
        accv acc[4] = {{0}};
        if (K % 256) t1_chunk(type, int8, w, rb, N, n, K / 256, (int)(K % 256), A, x, acc);
        for (int64_t c = 0; c < K / 256; c++) t1_chunk(type, int8, w, rb, N, n, c, 256, A, x, acc);
        y[n] = acc_sum((acc[0] + acc[1]) + (acc[2] + acc[3]));
    }
}

/* y[t, n] for t < T, n in [n0, n0 + NT) (rows past N not written), by either path. */
static inline __attribute__((always_inline)) void row_tile(
    int type, int int8, const uint8_t *w, int64_t rb, int64_t N, int64_t n0, int64_t K,
    const act_chunk *A, const float *x, int64_t xs, int64_t T, float *y, int64_t ys) {
    const int64_t nch = (K + 255) / 256;
    const int nt = (int)MIN(N - n0, NT);
    accv acc[NT * TT];
    for (int64_t t0 = 0; t0 < T; t0 += TT) {
        const int tt = (int)MIN(T - t0, TT);
        for (int i = 0; i < NT * tt; i++) acc[i] = (accv){0};
        for (int64_t c = 0; c < nch; c++) {
            const int nv = (int)MIN(K - c * 256, 256);
            chunk wc[NT];
            for (int j = 0; j < NT; j++) wc[j] = load_chunk(type, w, rb, n0 + (j < nt ? j : 0), N, c, nv);
            if (int8) {
                for (int t = 0; t < tt; t++)
                    for (int j = 0; j < NT; j++) acc[j * tt + t] += chunk_dot(type, &wc[j], A + (t0 + t) * nch + c, nv);
                continue;
            }
            float wf[NT][256];
            for (int j = 0; j < NT; j++) dequant(type, &wc[j], nv, wf[j]);
            for (int t = 0; t < tt; t += ACC_ROWS) { /* ACC_ROWS x NT independent FMA chains */
                const float *xr[ACC_ROWS];
                for (int i = 0; i < ACC_ROWS; i++) xr[i] = x + (t0 + (t + i < tt ? t + i : t)) * xs + c * 256;
                accv sum[ACC_ROWS][NT] = {{{0}}};
                for (int g = 0; g < nv / ACC_WIDTH; g++) {
                    accv xv[ACC_ROWS], wv[NT];
                    for (int i = 0; i < ACC_ROWS; i++) xv[i] = acc_load(xr[i] + ACC_WIDTH * g);
                    for (int j = 0; j < NT; j++) wv[j] = acc_load(wf[j] + ACC_WIDTH * g);
                    for (int i = 0; i < ACC_ROWS; i++)
                        for (int j = 0; j < NT; j++) sum[i][j] += wv[j] * xv[i];
                }
                for (int i = 0; i < ACC_ROWS && t + i < tt; i++)
                    for (int j = 0; j < NT; j++) acc[j * tt + t + i] += sum[i][j];
            }
        }
        for (int t = 0; t < tt; t++)
            for (int j = 0; j < nt; j++) y[(t0 + t) * ys + n0 + j] = acc_sum(acc[j * tt + t]);
    }
}

/* Rows [n0, n1) of y (n0 a multiple of NT), one function per type and path (small functions
 * keep the compile fast where 64-byte vectors are split); and rows ids of the embedding. */
#define TYPE_FUNCTIONS(TYPE)                                                                        \
    static void t1_##TYPE(const uint8_t *w, int64_t rb, int64_t N, int64_t n0, int64_t n1, int64_t K, \
                          const act_chunk *A, float *y) { rows_t1(TYPE, 1, w, rb, N, n0, n1, K, A, 0, y); } \
    static void f1_##TYPE(const uint8_t *w, int64_t rb, int64_t N, int64_t n0, int64_t n1, int64_t K, \
                          const float *x, float *y) { rows_t1(TYPE, 0, w, rb, N, n0, n1, K, 0, x, y); } \
    static void tile_##TYPE(int int8, const uint8_t *w, int64_t rb, int64_t N, int64_t n0, int64_t n1, \
                            int64_t K, const act_chunk *A, const float *x, int64_t xs, int64_t T,   \
                            float *y, int64_t ys) {                                                 \
        for (int64_t n = n0; n < n1; n += NT)                                                       \
            if (int8) row_tile(TYPE, 1, w, rb, N, n, K, A, x, xs, T, y, ys);                       \
            else row_tile(TYPE, 0, w, rb, N, n, K, A, x, xs, T, y, ys);                             \
    }                                                                                               \
    static void emb_##TYPE(const uint8_t *w, int64_t rb, int64_t id, int64_t K, float *out) {       \
        for (int64_t c = 0; c * 256 < K; c++) {                                                     \
            const chunk ch = load_chunk(TYPE, w, rb, id, 0, c, (int)MIN(K - c * 256, 256));         \
            dequant(TYPE, &ch, (int)MIN(K - c * 256, 256), out + c * 256);                         \
        }                                                                                           \
    }
TYPE_FUNCTIONS(Q4_0) TYPE_FUNCTIONS(Q4_1) TYPE_FUNCTIONS(Q5_0) TYPE_FUNCTIONS(Q5_1)
TYPE_FUNCTIONS(Q8_0) TYPE_FUNCTIONS(Q4_K) TYPE_FUNCTIONS(Q5_K) TYPE_FUNCTIONS(Q6_K)
#define TABLE(f) {f##_Q4_0, f##_Q4_1, f##_Q5_0, f##_Q5_1, f##_Q8_0, f##_Q4_K, f##_Q5_K, f##_Q6_K}
static void (*const T1[NTYPES])(const uint8_t *, int64_t, int64_t, int64_t, int64_t, int64_t, const act_chunk *, float *) = TABLE(t1);
static void (*const F1[NTYPES])(const uint8_t *, int64_t, int64_t, int64_t, int64_t, int64_t, const float *, float *) = TABLE(f1);
static void (*const TILE[NTYPES])(int, const uint8_t *, int64_t, int64_t, int64_t, int64_t, int64_t, const act_chunk *,
                                  const float *, int64_t, int64_t, float *, int64_t) = TABLE(tile);
static void (*const EMB[NTYPES])(const uint8_t *, int64_t, int64_t, int64_t, float *) = TABLE(emb);

static void rows(int type, int int8, const uint8_t *w, int64_t rb, int64_t N, int64_t n0, int64_t n1,
                 int64_t K, const act_chunk *A, const float *x, int64_t xs, int64_t T, float *y, int64_t ys) {
    if (int8 && T == 1) T1[type](w, rb, N, n0, n1, K, A, y);
    else if (T == 1) F1[type](w, rb, N, n0, n1, K, x, y);
    else TILE[type](int8, w, rb, N, n0, n1, K, A, x, xs, T, y, ys);
}

/* y [T, N] (row stride ys) = x [T, K] (row stride xs) @ W^T, W [N, K] as N rows of rb bytes of
 * `type` blocks. method 0: int8 activations, 1: fp32. */
void quant_matmul_f32(const float *x, int64_t xs, const uint8_t *w, int64_t N, int64_t rb, int type,
                      int64_t K, float *y, int64_t ys, int64_t T, int method, int num_threads) {
    if (type < 0 || type >= NTYPES || N <= 0 || T <= 0) return;
    const int64_t nch = (K + 255) / 256, tiles = (N + NT - 1) / NT;
    act_chunk small[8], *A = NULL;
    if (method == 0) {
        A = T * nch <= 8 ? small : aligned_alloc(64, sizeof(act_chunk) * (size_t)(T * nch));
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * K >= (1 << 16))
        for (int64_t t = 0; t < T; t++) quantize_row(type, x + t * xs, K, A + t * nch, nch);
    }
    const int nth = (int)MIN(N * rb >= PARALLEL_MIN_BYTES ? num_threads : 1, tiles);
#ifdef T1_TYPE
    if (method == 1 && T == 1 && T1_TYPE(type) && K % 256 == 0) {
        x_chunk small_x[8], *X = nch <= 8 ? small_x : aligned_alloc(64, sizeof(x_chunk) * (size_t)nch);
        const float unscale = t1_prep(type, x, K, X);
        void (*const f)(const uint8_t *, int64_t, int64_t, int64_t, int64_t, const x_chunk *, float, float *) =
            type == Q4_K ? t1_rows_q4_k : t1_rows_q6_k;
#pragma omp parallel num_threads(nth) if (nth > 1)
        {
            const int64_t i = omp_get_thread_num(), n = omp_get_num_threads();
            f(w, rb, tiles * i / n * NT, MIN(tiles * (i + 1) / n * NT, N), nch, X, unscale, y);
        }
        if (X != small_x) free(X);
        return;
    }
    if (method == 1 && T == 1 && B32_TYPE(type) && K % 32 == 0) {
        const int64_t ng = (K / 32 + B32_BLOCKS(type) - 1) / B32_BLOCKS(type);
        float small_x[48 * B32_GROUP(Q4_1)] __attribute__((aligned(64)));
        float *X = ng <= 48 ? small_x : aligned_alloc(64, sizeof(float) * (size_t)(ng * B32_GROUP(type)));
        const float unscale = b32_prep(type, x, K, ng, X);
        void (*const f)(const uint8_t *, int64_t, int64_t, int64_t, int64_t, const float *, float, float *) =
            type == Q4_0 ? b32_rows_Q4_0 : type == Q4_1 ? b32_rows_Q4_1 : b32_rows_Q8_0;
#pragma omp parallel num_threads(nth) if (nth > 1)
        {
            const int64_t i = omp_get_thread_num(), n = omp_get_num_threads();
            f(w, rb, tiles * i / n * NT, MIN(tiles * (i + 1) / n * NT, N), K, X, unscale, y);
        }
        if (X != small_x) free(X);
        return;
    }
#endif
#ifdef TB_TYPE
    /* Up to TB_MAX_T rows (K-quants: below a full tile of TB_TT); with more, the old tile, which
     * spreads a dequantization over 64 rows, measured as fast or faster (docs/kernels.md). */
    if (method == 1 && T > 1 && T <= (TB_KQUANT(type) ? TB_TT - 1 : TB_MAX_T) && TB_TYPE(type) &&
        K % BLOCK_VALUES[type] == 0) {
        const size_t bytes = sizeof(float) * (size_t)((K + 127) / 128 * T * TB_QUAD);
        float *X = aligned_alloc(64, (bytes + 63) / 64 * 64), *unscale = malloc(sizeof(float) * (size_t)T);
        tb_prep(type, x, xs, T, K, X, unscale);
#pragma omp parallel num_threads(nth) if (nth > 1)
        {
            const int64_t i = omp_get_thread_num(), n = omp_get_num_threads();
            tb_rows(type, w, rb, tiles * i / n * NT, MIN(tiles * (i + 1) / n * NT, N), K, X, T, unscale, y, ys);
        }
        free(X), free(unscale);
        return;
    }
#endif
    if (nth <= 1) {
        rows(type, method == 0, w, rb, N, 0, N, K, A, x, xs, T, y, ys);
    } else {
#pragma omp parallel num_threads(nth)
        {
            const int64_t i = omp_get_thread_num(), n = omp_get_num_threads();
            rows(type, method == 0, w, rb, N, tiles * i / n * NT, MIN(tiles * (i + 1) / n * NT, N), K, A, x, xs, T, y, ys);
        }
    }
    if (A != small) free(A);
}

/* out [T, K] = rows ids[t] of W, dequantized exactly. */
void quant_embedding_f32(const int64_t *ids, int64_t T, const uint8_t *w, int64_t rb, int type, int64_t K,
                         float *out, int num_threads) {
    if (type < 0 || type >= NTYPES) return;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (T * K >= (1 << 16))
    for (int64_t t = 0; t < T; t++) EMB[type](w, rb, ids[t], K, out + t * K);
}
