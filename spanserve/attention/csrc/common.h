/* What the CPU attention kernels share: float32 and bfloat16 rows of the cache, and the
 * floating-point mode they run in. */
#ifndef SPANSERVE_COMMON_H
#define SPANSERVE_COMMON_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* n values from element `index` of a float32 (dtype 0) or bfloat16 (1) array, as float32. */
static inline void load_floats(const void *base, int64_t index, int n, int dtype, float *dst) {
    if (dtype == 0) {
        memcpy(dst, (const float *)base + index, n * sizeof(float));
    } else {
        const uint16_t *src = (const uint16_t *)base + index;
        for (int i = 0; i < n; i++) dst[i] = bf16_to_float(src[i]);
    }
}

/* n float32 values into element `index` of a float32 or bfloat16 array. */
static inline void store_floats(void *base, int64_t index, int n, int dtype, const float *src) {
    if (dtype == 0) {
        memcpy((float *)base + index, src, n * sizeof(float));
    } else {
        uint16_t *dst = (uint16_t *)base + index;
        for (int i = 0; i < n; i++) dst[i] = float_to_bf16(src[i]);
    }
}

/* Keys far below a query's top score get weights that underflow to denormals, and arithmetic on
 * those is 10-100x slower: each kernel thread flushes them to zero while it runs, and only then
 * (the sampler needs denormal temperatures). */
#if defined(__SSE__)
#include <xmmintrin.h>
#define FLUSH_DENORMALS_BEGIN unsigned int saved_csr_ = _mm_getcsr(); _mm_setcsr(saved_csr_ | 0x8040u);
#define FLUSH_DENORMALS_END _mm_setcsr(saved_csr_);
#else
#define FLUSH_DENORMALS_BEGIN
#define FLUSH_DENORMALS_END
#endif

#endif
