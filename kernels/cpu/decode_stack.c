/* A whole decoder stack in one call (contract: kernels/cpu/decode_stack.py): the Llama
 * layer (no biases, no q/k norms, SiLU MLP, neox rotary, full attention) over weights kept
 * in GGUF blocks, for steps whose query runs are short (decode, speculative verification).
 *
 * Why: at batch 1 a 30-layer step is ~300 small kernel calls, and from Python each costs
 * more (argument checks, tensor allocation, ctypes) than the work of a small projection. This
 * file makes the same calls in the same order with the same arguments from C, so its
 * output is bit for bit what CausalLM.forward computes with the C kernels one by one. */
#include <stdint.h>

#include "kernels.h"

#define MAX_SEGMENTS 4

/* The ctypes structures in decode_stack.py mirror these field for field (all 8 bytes wide). */
typedef struct { int64_t start, rows, row_bytes, type; const uint8_t *data; } segment;
typedef struct { int64_t num_segments, in_features, out_features; segment seg[MAX_SEGMENTS]; } projection;
typedef struct {
    const float *input_norm, *post_attention_norm;
    float *key_cache, *value_cache;
    projection qkv, o, gate_up, down;
} layer;
typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, rotary_dim, block_size;
    int64_t max_query_len, method, num_threads;
    double eps, scale;
    const float *cos_sin, *final_norm;
    const layer *layers;
} model;

/* y [T, out_features] = x [T, in_features] @ W^T, segment by segment into its columns. */
static void project(const model *m, const projection *p, const float *x, float *y, int64_t T) {
    for (int64_t s = 0; s < p->num_segments; s++) {
        const segment *g = &p->seg[s];
        quant_matmul_f32(x, p->in_features, g->data, g->rows, g->row_bytes, (int)g->type, p->in_features,
                         y + g->start, p->out_features, T, (int)m->method, (int)m->num_threads);
    }
}

/* Floats of scratch a step of T tokens needs. */
int64_t decode_stack_scratch(const model *m, int64_t T) {
    const int64_t q = m->heads * m->head_dim, kv = m->kv_heads * m->head_dim;
    return T * (3 * m->hidden + (q + 2 * kv) + q + kv + q + 3 * m->intermediate);
}

/* out [T, hidden] = the final norm of the stack's output for embeddings x [T, hidden] (read
 * only: copied as the first residual). Each layer writes its K and V to the paged
 * caches at slot_mapping (-1 skipped) and attends over block_table / seq_lens. */
void decode_stack_f32(const model *m, const float *x, int64_t T, const int64_t *positions,
                      const int64_t *slot_mapping, const int32_t *block_table, int64_t bt_stride,
                      const int32_t *query_start, const int32_t *seq_lens, int64_t num_reqs,
                      float *out, float *scratch) {
    const int64_t Hd = m->hidden, D = m->head_dim, q_w = m->heads * D, kv_w = m->kv_heads * D;
    const int64_t qkv_w = q_w + 2 * kv_w, I = m->intermediate;
    const int nt = (int)m->num_threads;
    const float eps = (float)m->eps;
    float *h = scratch, *res = h + T * Hd, *mlp = res + T * Hd, *qkv = mlp + T * Hd;
    float *q_rot = qkv + T * qkv_w, *k_rot = q_rot + T * q_w, *attn = k_rot + T * kv_w;
    float *gate_up = attn + T * q_w, *act = gate_up + T * 2 * I;
    for (int64_t l = 0; l < m->num_layers; l++) {
        const layer *L = &m->layers[l];
        if (l == 0) {  /* the embeddings are the first residual */
            rms_norm_f32(x, Hd, 0, 0, L->input_norm, eps, h, 0, T, Hd, nt);
            for (int64_t i = 0; i < T * Hd; i++) res[i] = x[i];
        } else {
            rms_norm_f32(mlp, Hd, res, Hd, L->input_norm, eps, h, res, T, Hd, nt);
        }
        project(m, &L->qkv, h, qkv, T);
        rotary_neox_f32(positions, qkv, qkv_w, D, qkv + q_w, qkv_w, D, m->cos_sin, m->rotary_dim, q_rot, k_rot,
                        T, m->heads, m->kv_heads, D, nt);
        reshape_and_cache_f32(k_rot, kv_w, D, qkv + q_w + kv_w, qkv_w, D, L->key_cache, L->value_cache,
                              slot_mapping, T, m->kv_heads, D);
        paged_attention_rows_f32(q_rot, q_w, D, L->key_cache, L->value_cache, block_table, bt_stride,
                                 query_start, seq_lens, num_reqs, m->max_query_len, m->heads, m->kv_heads, D,
                                 m->block_size, (float)m->scale, 0, 0.0f, attn, q_w, D, nt);
        project(m, &L->o, attn, mlp, T);
        rms_norm_f32(mlp, Hd, res, Hd, L->post_attention_norm, eps, h, res, T, Hd, nt);
        project(m, &L->gate_up, h, gate_up, T);
        silu_and_mul_f32(gate_up, 2 * I, act, T, I, nt);
        project(m, &L->down, act, mlp, T);
    }
    rms_norm_f32(mlp, Hd, res, Hd, m->final_norm, eps, out, res, T, Hd, nt);
}
