/* What the CPU attention kernels share: float32 and bfloat16 rows of the cache, and the
 * floating-point mode they run in. */
#ifndef SPANSERVE_COMMON_H
#define SPANSERVE_COMMON_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

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

/* Vectors of LANES float32s, written once with GCC vector extensions: the compiler maps them to
 * the CPU's registers. 16 lanes with AVX-512 (one register); 8 elsewhere (one AVX2 register, two
 * NEON ones): 16-lane vectors in 16 AVX2 registers spilled the kernels' sums to the stack.
 * SPANSERVE_LANES sets it for a test build (kernels/variants.py): 16-lane code lowered to pairs
 * of 8-lane registers runs on any CPU, so its indexing, tiling and tails are tested everywhere.
 * Intrinsics below are keyed on both the instruction set and LANES. */
#if !defined(SPANSERVE_LANES)
#if defined(__AVX512F__)
#define SPANSERVE_LANES 16
#else
#define SPANSERVE_LANES 8
#endif
#endif
#if SPANSERVE_LANES != 8 && SPANSERVE_LANES != 16
#error "SPANSERVE_LANES must be 8 or 16"
#endif
#define LANES SPANSERVE_LANES
typedef float vf __attribute__((vector_size(4 * LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LANES)));

/* Finite stand-ins for minus infinity (fast math assumes no infinities): a running max before any
 * key, and the score of a key a row does not see, so far below it that its weight is 0 even
 * for a row that has seen no key. */
#define NO_MAX (-1e20f)
#define MASKED (-1e30f)

/* Lazy rescaling of an online softmax: scores are taken relative to a reference this far above
 * the largest score seen when it last moved, so the scores after stay below it (weights at most
 * 1, vexp's domain) until one passes it; only then are the sums so far rescaled. The reference
 * cancels in the softmax; weights under e^-87 of it, e^-79 of the largest, round to 0. */
#define RESCALE_SLACK 8.0f

#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif

static inline vf splat(float x) { return (vf){0} + x; }
static inline vi splat_int(int32_t x) { return (vi){0} + x; }

static inline vf vmax(vf a, vf b) {
    vi a_wins = a > b;
    return (vf)((a_wins & (vi)a) | (~a_wins & (vi)b));
}

static inline vf pick(vi mask, vf a, vf b) { return (vf)((mask & (vi)a) | (~mask & (vi)b)); }

/* e^x for x <= 0 (scores minus their running max), to float32's precision: x = n ln2 + f with
 * |f| <= ln2 / 2 (ln2 in two parts, so f is exact), e^f by its Taylor polynomial, 2^n by
 * building the exponent. 0 below -87 (e^-87 ~ 1e-38, float32's smallest normal). */
static inline vf vexp(vf x) {
    vi tiny = x < splat(-87.0f);
    x = vmax(x, splat(-87.0f));
    x = -vmax(-x, splat(0.0f));
    vi n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi); /* x <= 0: truncating x log2(e) - 1/2 rounds to nearest */
    vf whole = __builtin_convertvector(n, vf);
    vf f = x - whole * 0.693359375f + whole * 2.12194440e-4f;
    vf p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 + f * (1.0f / 720))))));
    return (vf)(~tiny & (vi)(p * (vf)((n + 127) << 23)));
}

/* Whether any lane of a comparison's result is true: one instruction (a mask test) on x86. */
static inline int any_lane(vi mask) {
#if defined(__AVX512F__) && LANES == 16
    return _mm512_test_epi32_mask((__m512i)mask, (__m512i)mask) != 0;
#elif defined(__AVX2__) && LANES == 8
    return _mm256_movemask_ps((__m256)mask) != 0;
#else
    for (int i = 0; i < LANES; i++)
        if (mask[i]) return 1;
    return 0;
#endif
}

/* LANES floats from p, which need not be aligned. */
static inline vf load_vf(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* A vector the next loop reuses, held in a register. Left to itself GCC reads it from memory
 * again in every multiply-add that uses it (a memory operand looks free to it): on AVX2 prefill
 * attention's inner loops issued 16 loads per 12 multiply-adds, and the AMD EPYC's two 256-bit
 * loads a cycle, not its multiply-adders, set their pace. The empty asm makes the value opaque, so
 * it is not read again. */
static inline __attribute__((always_inline)) vf in_register(vf v) {
#if defined(__AVX2__) && LANES == 8
    __asm__("" : "+x"(v));
#endif
    return v;
}

/* The lanes 0, 1, .., LANES - 1. */
#if LANES == 16
static inline vi lane_ids(void) { return (vi){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; }
#else
static inline vi lane_ids(void) { return (vi){0, 1, 2, 3, 4, 5, 6, 7}; }
#endif

/* The sum and max of v's lanes: halves folded onto each other, log2(LANES) shuffles. */
static inline float hsum(vf v) {
#if LANES == 16
    v += SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += SHUFFLE(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += SHUFFLE(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
#else
    v += SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += SHUFFLE(v, v, 2, 3, 0, 1, 6, 7, 4, 5);
    v += SHUFFLE(v, v, 1, 0, 3, 2, 5, 4, 7, 6);
#endif
    return v[0];
}

static inline float hmax(vf v) {
#if LANES == 16
    v = vmax(v, SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = vmax(v, SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = vmax(v, SHUFFLE(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    v = vmax(v, SHUFFLE(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
#else
    v = vmax(v, SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
    v = vmax(v, SHUFFLE(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
    v = vmax(v, SHUFFLE(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
#endif
    return v[0];
}

/* Lane t of the result: the sum of v[t]'s lanes. A transposing tree: each level adds the two
 * halves of every block of lanes while packing two vectors' blocks into one, so 16 sums take 15
 * adds and 30 shuffles where one reduction each would take about 130 ops. */
static inline vf sum_lanes(const vf v[LANES]) {
#if LANES == 16
    vf halves[8], quarters[4], eighths[2];
    for (int i = 0; i < 8; i++) /* lanes 0-7: v[2i]'s 8 partial sums, 8-15: v[2i + 1]'s */
        halves[i] = SHUFFLE(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                    SHUFFLE(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++) /* blocks of 4 lanes: v[4i] .. v[4i + 3] */
        quarters[i] = SHUFFLE(halves[2 * i], halves[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                      SHUFFLE(halves[2 * i], halves[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++) /* blocks of 2 lanes: v[8i] .. v[8i + 7] */
        eighths[i] = SHUFFLE(quarters[2 * i], quarters[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
                     SHUFFLE(quarters[2 * i], quarters[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUFFLE(eighths[0], eighths[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SHUFFLE(eighths[0], eighths[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
    /* 8 lanes: the two levels within each 128-bit half first (in-lane shuffles, one instruction
     * each), the halves crossed once at the end: crossing shuffles cost several times more on
     * CPUs that run 256-bit vectors as two halves (AMD Zen 1). */
    vf pairs[4], quads[2];
    for (int i = 0; i < 4; i++) /* per half: v[2i]'s 2 sums, v[2i + 1]'s 2 sums */
        pairs[i] = SHUFFLE(v[2 * i], v[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
                   SHUFFLE(v[2 * i], v[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    for (int i = 0; i < 2; i++) /* per half: the sums of v[4i] .. v[4i + 3] */
        quads[i] = SHUFFLE(pairs[2 * i], pairs[2 * i + 1], 0, 2, 8, 10, 4, 6, 12, 14) +
                   SHUFFLE(pairs[2 * i], pairs[2 * i + 1], 1, 3, 9, 11, 5, 7, 13, 15);
    return SHUFFLE(quads[0], quads[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           SHUFFLE(quads[0], quads[1], 4, 5, 6, 7, 12, 13, 14, 15);
#endif
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
