/* f32_gemm.c's tiles over weights that another kernel stores its own way and widens to float32,
 * a slice of a panel at a time (block_gemm.c's many rows). */
#ifndef SPANSERVE_F32_GEMM_H
#define SPANSERVE_F32_GEMM_H

#include <stdint.h>

/* Inputs i0 .. i0 + count - 1 of panel p (16 output channels) of `weights` as float32, [count][16]. */
typedef void (*WidenSlice)(const void *weights, int64_t p, int64_t i0, int64_t count, float *dst);

/* out [m, n] = x [m, k] W^T + bias, W's slices widened by `widen`; 0, or -1 for shapes it does not take. */
int f32_gemm_widened(const float *x, WidenSlice widen, const void *weights, const float *bias, float *out, int64_t m,
                     int64_t n, int64_t n_padded, int64_t k);

#endif
