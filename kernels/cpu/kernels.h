/* The C kernels' entry points (each defined in elementwise.c, paged_attention.c or quant.c,
 * which include this file, so the compiler checks every declaration against its definition):
 * what decode_stack.c calls. Python reaches them through ctypes (build.py's signatures). */
#ifndef PDSERVE_KERNELS_H
#define PDSERVE_KERNELS_H
#include <stdint.h>

void rms_norm_f32(const float *x, int64_t x_stride, const float *residual, int64_t res_stride,
                  const float *weight, float eps, float *out, float *residual_out, int64_t T,
                  int64_t d, int num_threads);
void silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t T, int64_t d, int num_threads);
void rotary_neox_f32(const int64_t *positions, const float *q, int64_t q_st, int64_t q_sh,
                     const float *k, int64_t k_st, int64_t k_sh, const float *cos_sin,
                     int64_t rot, float *q_out, float *k_out, int64_t T, int64_t H, int64_t Hkv,
                     int64_t D, int num_threads);
void reshape_and_cache_f32(const float *key, int64_t k_st, int64_t k_sh, const float *value,
                           int64_t v_st, int64_t v_sh, float *key_cache, float *value_cache,
                           const int64_t *slots, int64_t T, int64_t Hkv, int64_t D);
void paged_attention_rows_f32(const float *q, int64_t q_stride_t, int64_t q_stride_h,
                              const float *key_cache, const float *value_cache,
                              const int32_t *block_table, int64_t bt_stride,
                              const int32_t *query_start, const int32_t *seq_lens,
                              int64_t num_reqs, int64_t max_query_len, int64_t H, int64_t Hkv,
                              int64_t D, int64_t block_size, float scale, int64_t window,
                              float softcap, float *out, int64_t out_stride_t,
                              int64_t out_stride_h, int num_threads);
void quant_matmul_f32(const float *x, int64_t xs, const uint8_t *w, int64_t N, int64_t rb, int type,
                      int64_t K, float *y, int64_t ys, int64_t T, int method, int num_threads);

#endif
