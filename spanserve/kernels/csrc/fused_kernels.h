/* The kernels fused_layers.c strings together, declared once: their defining files include this
 * too, so a signature that changes there fails to compile rather than misread its arguments. */
#ifndef SPANSERVE_DECODE_KERNELS_H
#define SPANSERVE_DECODE_KERNELS_H

#include <stdint.h>

#include "team.h"

int block_gemm(const float *x, const uint8_t *codes, int bits, int group, const void *scale, const void *offset,
               const float *factors, const float *bias, float *out, int64_t m, int64_t n, int64_t n_padded, int64_t k,
               int int8_x);
int block_gemm_part(const float *x, const uint8_t *codes, int bits, int group, const void *scale, const void *offset,
                    const float *factors, const float *bias, float *out, int64_t ld, int64_t m, int64_t n,
                    int64_t n_padded, int64_t k, int int8_x, int part, int parts);
int rms_norm(const void *x, const void *weight, void *out, int64_t rows, int64_t dim, float eps, int dtype);
int silu_mul(const void *gate_up, void *out, int64_t rows, int64_t width, int dtype);
int rope_store(const void *q, const void *k, const void *v, int64_t q_stride, int64_t k_stride, int64_t v_stride,
               const int64_t *positions, const float *cos, const float *sin, int64_t max_position, void *q_out,
               void *k_out, void *k_cache, void *v_cache, const int64_t *slots, int64_t num_slots, int64_t tokens,
               int heads, int kv_heads, int dim, int dtype, int kv_dtype);
int paged_decode(const void *q, const void *k_cache, const void *v_cache, void *out, const int64_t *block_tables,
                 const int64_t *context_lens, int64_t num_seqs, int64_t max_blocks, int heads, int kv_heads, int dim,
                 int block_size, float scale, int dtype, int kv_dtype);
int paged_decode_part(const void *q, const void *k_cache, const void *v_cache, void *out,
                      const int64_t *block_tables, const int64_t *context_lens, int64_t num_seqs, int64_t max_blocks,
                      int heads, int kv_heads, int dim, int block_size, float scale, int dtype, int kv_dtype,
                      Team *team, int part);
int paged_prefill(const void *q, const void *k_cache, const void *v_cache, void *out, const int64_t *block_tables,
                  const int64_t *query_starts, const int64_t *positions, const int64_t *context_lens,
                  const int64_t *rot_starts, const int32_t *rot_ids, const float *rot_cos, const float *rot_sin,
                  int64_t num_angles, int64_t num_seqs, int64_t num_rows, int64_t max_blocks, int heads, int kv_heads,
                  int dim, int block_size, float scale, int dtype, int kv_dtype);

#endif
