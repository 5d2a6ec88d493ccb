/* Paged attention for short query runs on CPU (decode: one token per request), fp32.
 *
 * The torch reference gathers every request's context out of its blocks into a dense copy
 * and then reads that copy again in SDPA; for decode that copy is most of the work. This
 * reads K and V straight from the paged cache, once, with an online softmax per block.
 * Contract: kernels.reference.paged_attention restricted to the rows passed in `rows`.
 *
 * Layouts (all contiguous in the last dimension):
 *   q, out        [T, H, D] with row strides q_stride_t / q_stride_h (out: out_stride_t/_h)
 *   key/value     [num_blocks, block_size, Hkv, D], contiguous
 *   block_table   [R, bt_stride] int32
 *   query_start   [R + 1] int32, seq_lens [R] int32
 * Work items are (request, kv head) pairs; each walks its context once per query head of
 * its group, so the group's second pass reads the context from cache, not memory.
 */
#include <math.h>
#include <stdint.h>

#define CHUNK 32   /* scores kept per step of the online softmax */
#define MAX_D 512  /* the caller checks head_dim against this */

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 x;
    __builtin_memcpy(&x, p, sizeof(x));
    return x;
}

static inline void store8(float *p, v8 x) { __builtin_memcpy(p, &x, sizeof(x)); }

/* D % 8 == 0; two accumulators so consecutive FMAs do not wait on each other. */
static inline float dot(const float *a, const float *b, int64_t D) {
    v8 s0 = {0}, s1 = {0};
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
        s0 += load8(a + d) * load8(b + d);
        s1 += load8(a + d + 8) * load8(b + d + 8);
    }
    if (d < D) s0 += load8(a + d) * load8(b + d);
    s0 += s1;
    return ((s0[0] + s0[1]) + (s0[2] + s0[3])) + ((s0[4] + s0[5]) + (s0[6] + s0[7]));
}

/* One query vector over its first `visible` context positions: out = softmax(q.K^T * scale) V. */
static void attend_one(const float *q, const float *kc, const float *vc, const int32_t *blocks,
                       int64_t visible, int64_t block_size, int64_t token_stride, int64_t D,
                       float scale, float *out) {
    float acc[MAX_D];
    float scores[CHUNK];
    float m = -INFINITY, l = 0.0f;
    for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
    for (int64_t start = 0; start < visible;) {
        /* A chunk never crosses a block: its keys are consecutive rows of one block. */
        const int64_t blk = blocks[start / block_size];
        const int64_t off = start % block_size;
        int64_t n = block_size - off;
        if (n > CHUNK) n = CHUNK;
        if (n > visible - start) n = visible - start;
        const int64_t base = (blk * block_size + off) * token_stride;
        float cmax = -INFINITY;
        for (int64_t j = 0; j < n; j++) {
            scores[j] = dot(q, kc + base + j * token_stride, D) * scale;
            if (scores[j] > cmax) cmax = scores[j];
        }
        if (cmax > m) {
            const float corr = expf(m - cmax);
            l *= corr;
            for (int64_t d = 0; d < D; d++) acc[d] *= corr;
            m = cmax;
        }
        for (int64_t j = 0; j < n; j++) {
            const float p = expf(scores[j] - m);
            const float *v = vc + base + j * token_stride;
            const v8 pv = {p, p, p, p, p, p, p, p};
            l += p;
            for (int64_t d = 0; d < D; d += 8) store8(acc + d, load8(acc + d) + pv * load8(v + d));
        }
        start += n;
    }
    const float inv = 1.0f / l;
    for (int64_t d = 0; d < D; d++) out[d] = acc[d] * inv;
}

void paged_attention_rows_f32(const float *q, int64_t q_stride_t, int64_t q_stride_h,
                              const float *key_cache, const float *value_cache,
                              const int32_t *block_table, int64_t bt_stride,
                              const int32_t *query_start, const int32_t *seq_lens,
                              const int64_t *rows, int64_t num_rows, int64_t H, int64_t Hkv,
                              int64_t D, int64_t block_size, float scale, float *out,
                              int64_t out_stride_t, int64_t out_stride_h, int num_threads) {
    const int64_t group = H / Hkv;
    const int64_t token_stride = Hkv * D;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t item = 0; item < num_rows * Hkv; item++) {
        const int64_t r = rows[item / Hkv];
        const int64_t kvh = item % Hkv;
        const int64_t q_first = query_start[r];
        const int64_t q_len = query_start[r + 1] - q_first;
        const int64_t ctx = seq_lens[r];
        const int32_t *blocks = block_table + r * bt_stride;
        for (int64_t i = 0; i < q_len; i++) {
            const int64_t t = q_first + i;
            for (int64_t g = 0; g < group; g++) {
                const int64_t h = kvh * group + g;
                /* Causal: query i of q_len sees keys [0, ctx - q_len + i]. */
                attend_one(q + t * q_stride_t + h * q_stride_h, key_cache + kvh * D,
                           value_cache + kvh * D, blocks, ctx - q_len + i + 1, block_size,
                           token_stride, D, scale, out + t * out_stride_t + h * out_stride_h);
            }
        }
    }
}
