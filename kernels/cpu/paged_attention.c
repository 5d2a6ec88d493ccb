/* Paged attention for short query runs on CPU (decode: one token per request), fp32.
 *
 * The torch reference gathers every request's context out of its blocks into a dense copy
 * and then reads that copy again in SDPA; for decode that copy is most of the work. This
 * reads K and V straight from the paged cache, once, with an online softmax per chunk.
 * Contract: kernels.reference.paged_attention restricted to the rows with
 * 1 <= q_len <= max_query_len (the others are left to the caller).
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

#include "vec.h"

#define CHUNK 32        /* keys per step of the online softmax (multiple of 8) */
#define MAX_HD 16384    /* H * D of the accumulators on the stack; the caller checks */

/* D % 8 == 0; two accumulators so consecutive FMAs do not wait on each other. */
static inline float dot(const float *a, const float *b, int64_t D) {
    v8 s0 = {0}, s1 = {0};
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
        s0 += load8(a + d) * load8(b + d);
        s1 += load8(a + d + 8) * load8(b + d + 8);
    }
    if (d < D) s0 += load8(a + d) * load8(b + d);
    return hsum(s0 + s1);
}

/* All H heads of one query token over its first `visible` context positions. */
static void attend_token(const float *q, int64_t q_stride_h, const float *kc, const float *vc,
                         const int32_t *blocks, int64_t visible, int64_t block_size, int64_t H,
                         int64_t Hkv, int64_t D, float scale, float *out, int64_t out_stride_h) {
    const int64_t group = H / Hkv;
    const int64_t token_stride = Hkv * D;
    float acc[MAX_HD];
    float m[MAX_HD / 8], l[MAX_HD / 8];
    float scores[CHUNK];
    for (int64_t i = 0; i < H * D; i++) acc[i] = 0.0f;
    for (int64_t h = 0; h < H; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    for (int64_t start = 0; start < visible;) {
        /* A chunk never crosses a block: its keys are consecutive rows of one block. */
        const int64_t off = start % block_size;
        int64_t n = block_size - off;
        if (n > CHUNK) n = CHUNK;
        if (n > visible - start) n = visible - start;
        const int64_t base = ((int64_t)blocks[start / block_size] * block_size + off) * token_stride;
        for (int64_t h = 0; h < H; h++) {
            const int64_t kvh = h / group;
            const float *qh = q + h * q_stride_h;
            const float *k = kc + base + kvh * D;
            const float *v = vc + base + kvh * D;
            float *a = acc + h * D;
            float cmax = -INFINITY;
            for (int64_t j = 0; j < n; j++) {
                scores[j] = dot(qh, k + j * token_stride, D) * scale;
                if (scores[j] > cmax) cmax = scores[j];
            }
            if (cmax > m[h]) {
                const float corr = expf(m[h] - cmax);
                l[h] *= corr;
                for (int64_t d = 0; d < D; d += 8) store8(a + d, load8(a + d) * splat(corr));
                m[h] = cmax;
            }
            float psum = 0.0f;
            for (int64_t j = 0; j < n; j += 8) {
                v8 p = exp8(load8(scores + j) - splat(m[h]));
                for (int64_t lane = n - j; lane < 8; lane++) p[lane] = 0.0f; /* past the chunk */
                store8(scores + j, p);
                psum += hsum(p);
            }
            l[h] += psum;
            for (int64_t j = 0; j < n; j++) {
                const v8 pj = splat(scores[j]);
                const float *vj = v + j * token_stride;
                for (int64_t d = 0; d < D; d += 8) store8(a + d, load8(a + d) + pj * load8(vj + d));
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
                              int64_t D, int64_t block_size, float scale, float *out,
                              int64_t out_stride_t, int64_t out_stride_h, int num_threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t r = 0; r < num_reqs; r++) {
        const int64_t q_first = query_start[r];
        const int64_t q_len = query_start[r + 1] - q_first;
        if (q_len < 1 || q_len > max_query_len) continue;
        const int64_t ctx = seq_lens[r];
        for (int64_t i = 0; i < q_len; i++) {
            const int64_t t = q_first + i;
            /* Causal: query i of q_len sees keys [0, ctx - q_len + i]. */
            attend_token(q + t * q_stride_t, q_stride_h, key_cache, value_cache,
                         block_table + r * bt_stride, ctx - q_len + i + 1, block_size, H, Hkv, D,
                         scale, out + t * out_stride_t, out_stride_h);
        }
    }
}
