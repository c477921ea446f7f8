/* A decoder layer's elementwise ops in one C call each: RMSNorm and SwiGLU's silu(gate) * up.
 *
 * In torch each is a chain of small ops (RMSNorm: square, mean, add, rsqrt, two products), and in
 * a decode step of a few rows each op costs its dispatch, not its arithmetic: 61 RMSNorms took
 * about 4 ms of a 41 ms step of 8 sequences on SmolLM2 (torch profiler). Here a row is one pass.
 *
 * The rounding is the reference's (transformers): the norm in float32, cast to the model dtype,
 * then times the weight in that dtype; silu in float32, cast, then times `up`. dtype: 0 float32,
 * 1 bfloat16 (each product computed in float32 and rounded, as torch's bf16 ops do).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "common.h"
#include "fused_kernels.h"

#define MAX_DIM 65536
#define ROWS_PER_THREAD_WORK (1 << 16) /* elements worth a second thread */

/* Round float32 values as the model dtype stores them (bf16: to nearest even). */
static inline float as_dtype(float x, int dtype) { return dtype == 0 ? x : bf16_to_float(float_to_bf16(x)); }

/* out[r] = weight * dtype(x[r] / rms(x[r])), rms over `dim` with eps, for `rows` rows. */
int rms_norm(const void *x, const void *weight, void *out, int64_t rows, int64_t dim, float eps, int dtype) {
    if (rows < 0 || dim <= 0 || dim > MAX_DIM || (dtype != 0 && dtype != 1)) return -1;
    float *w = malloc(dim * sizeof(float));
    if (w == NULL) return -3;
    load_floats(weight, 0, (int)dim, dtype, w);
    int failed = 0;
#pragma omp parallel for schedule(static) if (rows * dim >= 2 * ROWS_PER_THREAD_WORK)
    for (int64_t r = 0; r < rows; r++) {
        float stack[8192], *row = dim <= 8192 ? stack : malloc(dim * sizeof(float)); /* hidden sizes up to 8k */
        if (row == NULL) {
            failed = 1;
            continue;
        }
        load_floats(x, r * dim, (int)dim, dtype, row);
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < dim; i++) squares += row[i] * row[i];
        float inverse = 1.0f / sqrtf(squares / (float)dim + eps);
        for (int64_t i = 0; i < dim; i++) row[i] = w[i] * as_dtype(row[i] * inverse, dtype);
        store_floats(out, r * dim, (int)dim, dtype, row);
        if (row != stack) free(row);
    }
    free(w);
    return failed ? -3 : 0;
}

/* out[r] = dtype(silu(gate)) * up, where gate_up[r] is [gate (width) | up (width)]. */
int silu_mul(const void *gate_up, void *out, int64_t rows, int64_t width, int dtype) {
    if (rows < 0 || width <= 0 || width > MAX_DIM || (dtype != 0 && dtype != 1)) return -1;
    int failed = 0;
#pragma omp parallel for schedule(static) if (rows * width >= ROWS_PER_THREAD_WORK)
    for (int64_t r = 0; r < rows; r++) {
        float stack[2 * 4096], *both = width <= 4096 ? stack : malloc(2 * width * sizeof(float));
        if (both == NULL) {
            failed = 1;
            continue;
        }
        float *gate = both, *up = both + width;
        load_floats(gate_up, 2 * r * width, (int)(2 * width), dtype, both);
        int64_t i = 0;
        for (; i + LANES <= width; i += LANES) { /* libm's vector expf is 8 lanes wide here */
            vf g = load_vf(gate + i), t = vexp(-vmax(g, -g)); /* e^-|g|, never above 1 */
            vf s = g * pick(g >= splat(0.0f), splat(1.0f), t) / (1.0f + t);
            memcpy(gate + i, &s, sizeof s);
        }
        for (; i < width; i++) gate[i] = gate[i] / (1.0f + expf(fminf(-gate[i], 80.0f))); /* no inf under -ffast-math */
        for (i = 0; i < width; i++) gate[i] = as_dtype(gate[i], dtype) * up[i];
        store_floats(out, r * width, (int)width, dtype, gate);
        if (both != stack) free(both);
    }
    return failed ? -3 : 0;
}

/* One head vector x (dim values from element `index`, dtype) rotated by RoPE at one position (its
 * cos and sin, half a head each), as the reference computes it in the dtype: x * cos +
 * rotate_half(x) * sin, tables and each product rounded to the dtype, then their sum. */
static void rotate_head(const void *x, int64_t index, int dim, int dtype, const float *cos, const float *sin,
                        float *out) {
    float in[1024];
    int half = dim / 2;
    load_floats(x, index, dim, dtype, in);
    for (int i = 0; i < half; i++) {
        float c = as_dtype(cos[i], dtype), s = as_dtype(sin[i], dtype), a = in[i], b = in[i + half];
        out[i] = as_dtype(as_dtype(a * c, dtype) - as_dtype(b * s, dtype), dtype);
        out[i + half] = as_dtype(as_dtype(b * c, dtype) + as_dtype(a * s, dtype), dtype);
    }
}

/* A step's queries and keys rotated to their positions and its keys and values written to their
 * cache slots, in one pass: what RoPE (about 10 torch ops) and the cache store (2) cost a layer.
 * q, k, v: rows q_stride, k_stride and v_stride elements apart (views into one qkv projection
 * row, or not), `heads` / `kv_heads` heads of `dim`; cos, sin: float32 [max_position][dim / 2];
 * q_out [tokens][heads][dim] and k_out [tokens][kv_heads][dim] in dtype; the caches
 * [num_slots][kv_heads][dim] in kv_dtype. */
int rope_store(const void *q, const void *k, const void *v, int64_t q_stride, int64_t k_stride, int64_t v_stride,
               const int64_t *positions, const float *cos, const float *sin, int64_t max_position, void *q_out,
               void *k_out, void *k_cache, void *v_cache, const int64_t *slots, int64_t num_slots, int64_t tokens,
               int heads, int kv_heads, int dim, int dtype, int kv_dtype) {
    if (tokens < 0 || heads <= 0 || kv_heads <= 0 || dim <= 0 || dim > 1024 || dim % 2 || (dtype != 0 && dtype != 1) ||
        (kv_dtype != 0 && kv_dtype != 1))
        return -1;
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= max_position || slots[t] < 0 || slots[t] >= num_slots) return -2;
    int half = dim / 2;
#pragma omp parallel for schedule(static) if (tokens * (heads + 2 * kv_heads) * dim >= 2 * ROWS_PER_THREAD_WORK)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos + positions[t] * half, *s = sin + positions[t] * half;
        float row[1024];
        for (int h = 0; h < heads; h++) {
            rotate_head(q, t * q_stride + h * dim, dim, dtype, c, s, row);
            store_floats(q_out, (t * heads + h) * dim, dim, dtype, row);
        }
        for (int h = 0; h < kv_heads; h++) {
            rotate_head(k, t * k_stride + h * dim, dim, dtype, c, s, row);
            store_floats(k_out, (t * kv_heads + h) * dim, dim, dtype, row);
            store_floats(k_cache, (slots[t] * kv_heads + h) * dim, dim, kv_dtype, row);
            load_floats(v, t * v_stride + h * dim, dim, dtype, row);
            store_floats(v_cache, (slots[t] * kv_heads + h) * dim, dim, kv_dtype, row);
        }
    }
    return 0;
}
