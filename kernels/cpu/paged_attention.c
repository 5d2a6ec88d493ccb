/* Paged attention for short query runs on CPU (decode: one token per request), fp32.
 *
 * The torch reference gathers every request's context out of its blocks into a dense copy
 * and then reads that copy again in SDPA; for decode that copy is most of the work. This
 * reads K and V straight from the paged cache, once, with an online softmax per chunk.
 * Contract: kernels.reference.paged_attention (sliding window and softcap included)
 * restricted to the rows with 1 <= q_len <= max_query_len (the others are left to the caller).
 *
 * Layouts (all contiguous in the last dimension):
 *   q, out        [T, H, D] with token / head strides
 *   key/value     [num_blocks, block_size, Hkv, D], contiguous
 *   block_table   [R, bt_stride] int32
 *   query_start   [R + 1] int32, seq_lens [R] int32
 * A work item is one request: it walks its blocks in order, every head of a block at once
 * (one contiguous stretch of memory per block), so the hardware prefetcher sees streams.
 */
#include <math.h>
#include <stdint.h>

#include "kernels.h"
#include "vec.h"

#define CHUNK 32        /* keys per step of the online softmax (multiple of 8) */
#define MAX_HD 16384    /* H * D of the accumulators on the stack; the caller checks */

/* The 8 sums of the lanes of a[0..7], as one vector: a transpose-and-add in three rounds,
 * cheaper than eight separate horizontal sums. */
static inline v8 sum8x8(const v8 a[8]) {
    v8 t[4], u[2];
    for (int i = 0; i < 4; i++)
        t[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; i++)
        u[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(t[2 * i], t[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* Scores of keys k[0..n) (rows token_stride apart, 1 <= n <= 8) against q, times scale,
 * then softcapped to softcap * tanh(s / softcap) when softcap > 0; lanes past n are -inf.
 * Always eight rows (the missing ones repeat the last) so the accumulators stay in
 * registers. */
static inline v8 scores8(const float *q, const float *k, int64_t n, int64_t token_stride,
                         int64_t D, float scale, float softcap) {
    const float *row[8];
    for (int j = 0; j < 8; j++) row[j] = k + (j < n ? j : n - 1) * token_stride;
    v8 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = splat(0.0f);
    for (int64_t d = 0; d < D; d += 8) {
        const v8 qd = load8(q + d);
        for (int j = 0; j < 8; j++) acc[j] += qd * load8(row[j] + d);
    }
    v8 s = sum8x8(acc) * splat(scale);
    if (softcap > 0.0f) s = splat(softcap) * tanh8(s * splat(1.0f / softcap));
    for (int64_t j = n; j < 8; j++) s[j] = -INFINITY;
    return s;
}

static inline float max8(v8 x) {
    float m = x[0];
    for (int j = 1; j < 8; j++) m = x[j] > m ? x[j] : m;
    return m;
}

/* All H heads of one query token over context positions [first, visible). Blocks before
 * `first` are never touched: a sliding window's caller may have freed them. */
static void attend_token(const float *q, int64_t q_stride_h, const float *kc, const float *vc,
                         const int32_t *blocks, int64_t first, int64_t visible, int64_t block_size,
                         int64_t H, int64_t Hkv, int64_t D, float scale, float softcap, float *out,
                         int64_t out_stride_h) {
    const int64_t group = H / Hkv;
    const int64_t token_stride = Hkv * D;
    float acc[MAX_HD];
    float m[MAX_HD / 8], l[MAX_HD / 8];
    v8 p[CHUNK / 8];
    for (int64_t i = 0; i < H * D; i++) acc[i] = 0.0f;
    for (int64_t h = 0; h < H; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    for (int64_t start = first; start < visible;) {
        /* A chunk never crosses a block: its keys are consecutive rows of one block. */
        const int64_t off = start % block_size;
        int64_t n = block_size - off;
        if (n > CHUNK) n = CHUNK;
        if (n > visible - start) n = visible - start;
        const int64_t base = ((int64_t)blocks[start / block_size] * block_size + off) * token_stride;
        const int64_t nvec = (n + 7) / 8;
        if (off == 0 && start + block_size < visible) {
            /* Blocks sit anywhere in the cache: ask for the next one while this one computes. */
            const int64_t next = (int64_t)blocks[start / block_size + 1] * block_size * token_stride;
            for (int64_t i = 0; i < block_size * token_stride; i += 16) {
                __builtin_prefetch(kc + next + i);
                __builtin_prefetch(vc + next + i);
            }
        }
        for (int64_t h = 0; h < H; h++) {
            const int64_t kvh = h / group;
            const float *k = kc + base + kvh * D;
            const float *v = vc + base + kvh * D;
            float *a = acc + h * D;
            float cmax = -INFINITY;
            for (int64_t c = 0; c < nvec; c++) {
                const int64_t rows = n - 8 * c < 8 ? n - 8 * c : 8;
                p[c] = scores8(q + h * q_stride_h, k + 8 * c * token_stride, rows, token_stride, D,
                               scale, softcap);
                const float cm = max8(p[c]);
                cmax = cm > cmax ? cm : cmax;
            }
            if (cmax > m[h]) {
                const float corr = expf(m[h] - cmax);
                l[h] *= corr;
                for (int64_t d = 0; d < D; d += 8) store8(a + d, load8(a + d) * splat(corr));
                m[h] = cmax;
            }
            v8 psum = splat(0.0f);
            for (int64_t c = 0; c < nvec; c++) {
                v8 e = exp8(p[c] - splat(m[h]));
                for (int64_t j = n - 8 * c; j < 8; j++) e[j] = 0.0f; /* past the chunk */
                p[c] = e;
                psum += e;
            }
            l[h] += hsum(psum);
            const float *pj = (const float *)p;
            for (int64_t d = 0; d < D; d += 8) {
                v8 ad = load8(a + d);
                for (int64_t j = 0; j < n; j++) ad += splat(pj[j]) * load8(v + j * token_stride + d);
                store8(a + d, ad);
            }
        }
        start += n;
    }
    for (int64_t h = 0; h < H; h++) {
        const v8 inv = splat(1.0f / l[h]);
        for (int64_t d = 0; d < D; d += 8) store8(out + h * out_stride_h + d, load8(acc + h * D + d) * inv);
    }
}

void paged_attention_rows_f32(const float *q, int64_t q_stride_t, int64_t q_stride_h,
                              const float *key_cache, const float *value_cache,
                              const int32_t *block_table, int64_t bt_stride,
                              const int32_t *query_start, const int32_t *seq_lens,
                              int64_t num_reqs, int64_t max_query_len, int64_t H, int64_t Hkv,
                              int64_t D, int64_t block_size, float scale, int64_t window,
                              float softcap, float *out, int64_t out_stride_t,
                              int64_t out_stride_h, int num_threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t r = 0; r < num_reqs; r++) {
        const int64_t q_first = query_start[r];
        const int64_t q_len = query_start[r + 1] - q_first;
        if (q_len < 1 || q_len > max_query_len) continue;
        const int64_t ctx = seq_lens[r];
        for (int64_t i = 0; i < q_len; i++) {
            const int64_t t = q_first + i;
            /* Causal: query i of q_len sees keys [0, ctx - q_len + i]; a window of W keeps
             * the last W of them, so a decode costs O(W), not O(ctx). */
            const int64_t visible = ctx - q_len + i + 1;
            const int64_t first = window > 0 && visible > window ? visible - window : 0;
            attend_token(q + t * q_stride_t, q_stride_h, key_cache, value_cache,
                         block_table + r * bt_stride, first, visible, block_size, H, Hkv, D,
                         scale, softcap, out + t * out_stride_t, out_stride_h);
        }
    }
}
