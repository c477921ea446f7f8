/* Projections over weights kept as a GGUF file stores them: 4-, 5- or 8-bit codes with a scale and
 * an offset per output channel and group of 32 inputs, which hold Q4_0, Q4_1 and Q4_K (4-bit
 * codes), Q5_0 and Q5_1 (5-bit) and Q8_0 (8-bit) exactly; or 8-bit codes with a scale per 16
 * inputs and no offset, which hold Q6_K. A model shipped as such a file then computes with its
 * own weights from about a fifth (4-bit) to a quarter (8-bit) of float32's bytes, and a decode
 * step is its weight bytes.
 *
 * A few rows multiply each group's codes as they are, converted to float32 in registers, and
 * scale the group's sums once: out = sum over groups of scale * (codes . x) + offset * sum(x).
 * More rows go to f32_gemm.c's tiles, over the codes widened to float32 slices that stay in L1
 * while every row passes over them (block_widen). With int8_x, a few rows over 4-bit codes are
 * rounded to int8 per 32 inputs and multiplied as bytes (int8_pass), as llama.cpp does; so are
 * Q6_K's codes kept in 6 bits for it (six_bit_pass, layout there).
 *
 * Layouts: x [M, K] and out [M, N] float32; W[c][i] = code * scale + offset per output channel c
 * and group of `group` inputs i (32, or 16 for 8-bit codes without an offset), in panels of 16
 * output channels: 4-bit codes (0..15) [panels][K][8] bytes, channel j's code the low nibble of
 * byte j and channel 8 + j's the high one; 5-bit codes (0..31) their low 4 bits so, then their
 * fifth bits [panels][K / 32][16] uint32, bit i of word j input 32 g + i of channel j (Q5_0's own
 * layout); 8-bit codes (-128..127) [panels][K][16]; scale and offset [panels][K / group][16]
 * float32, offset NULL for none; or, factored (a K-quant's, as its file keeps them), scale and
 * offset int8 [panels][K / group][16] times `factors` [panels][K / SUPER][2][16] float32 (each
 * super-block's factor for the scales, then for the offsets); bias [N] float32 or NULL.
 * N_padded is a multiple of TILE (f32_gemm.c's tile), K of the group.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "common.h"
#include "fused_kernels.h"
#include "f32_gemm.h"
#include "team.h"

#define PANEL 16          /* output channels of a panel */
#define TILE 48           /* f32_gemm.c's tile, the padding unit of N */
#define PASS_ROWS 4       /* rows one pass over a panel's codes multiplies */
#define DIRECT_MAX_ROWS 24 /* up to this many rows the codes are multiplied as they are */
#define WORK_PER_THREAD (1 << 18) /* multiply-adds worth another thread (as in int8_gemm.c) */
#define SUPER 256         /* inputs of a K-quant super-block, whose float factors scale its groups' int8 ones */

typedef struct {
    const uint8_t *codes;
    const uint32_t *high; /* 5-bit codes' fifth bits, else NULL */
    const uint8_t *top;   /* 6-bit codes' top two bits, else NULL */
    const float *scale, *offset; /* float32 per group, or NULL where factored */
    const int8_t *scale_q, *offset_q; /* factored: int8 per group, multiples of their super-block's factors */
    const float *factors;             /* factored: [panels][k / SUPER][2][16], the scales' then the offsets' */
    int64_t k;
    int bits, group; /* group: input channels sharing a scale and an offset */
} BlockWeights;

typedef struct {
    const float *x, *xsum, *bias; /* xsum [M][K / group]: each group's sum of x */
    const int8_t *xq;             /* x rounded to int8 [M][K] (int8_x), or NULL: x as it is */
    const float *xstep;           /* [M][K / 32]: each group's step, max |x| / 127 */
    const int32_t *xqsum;         /* 6-bit codes: [M][K / 16], each group's sum of xq */
    const BlockWeights *b;
    float *out;
    int64_t n, ld; /* ld: out's row stride (n, or more for a piece of wider rows) */
} Direct;

/* The codes of panel p for input i: 16 codes in 16 bytes (8-bit) or 8 (4-bit, and 5-bit's low bits). */
static inline const uint8_t *codes_at(const BlockWeights *b, int64_t p, int64_t i, const int bits) {
    return b->codes + (p * b->k + i) * (bits == 8 ? 16 : 8);
}

/* The fifth bits of panel p's group g: 16 words, one a channel. */
static inline const uint32_t *high_at(const BlockWeights *b, int64_t p, int64_t g) {
    return b->high + (p * (b->k / 32) + g) * PANEL;
}

/* dst[j] = q[j] * f[j] for a panel's 16 channels, in vector stores: the passes load dst right after
 * as vectors, which a store of each float would stall (no store forwarding from narrower stores). */
static inline __attribute__((always_inline)) void times_factors(const int8_t *q, const float *f, float *dst) {
#if defined(__AVX512F__) && LANES == 16
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
    _mm512_storeu_ps(dst, _mm512_mul_ps(v, _mm512_loadu_ps(f)));
#elif defined(__AVX2__)
    for (int h = 0; h < 2; h++) {
        const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * h))));
        _mm256_storeu_ps(dst + 8 * h, _mm256_mul_ps(v, _mm256_loadu_ps(f + 8 * h)));
    }
#else
    for (int j = 0; j < PANEL; j++) dst[j] = (float)q[j] * f[j];
#endif
}

/* Group g's scales for panel p's 16 channels, and in *offset its offsets (NULL for none): the stored
 * float32 ones, or a K-quant's int8 ones times their super-block's factors, formed in `room`. Each
 * product is exact in float32 (11 by 8 bits): the value the file's own decoding forms. */
static inline __attribute__((always_inline)) const float *scales_of(const BlockWeights *b, int64_t p, int64_t g,
                                                                    float room[2][PANEL], const float **offset,
                                                                    const int factored) {
    const int64_t at = (p * (b->k / b->group) + g) * PANEL;
    if (!factored) {
        *offset = b->offset ? b->offset + at : NULL;
        return b->scale + at;
    }
    const float *f = b->factors + (p * (b->k / SUPER) + g * b->group / SUPER) * 2 * PANEL;
    times_factors(b->scale_q + at, f, room[0]);
    if (b->offset_q) times_factors(b->offset_q + at, f + PANEL, room[1]);
    *offset = b->offset_q ? room[1] : NULL;
    return room[0];
}

/* scales_of for blocks factored or not. A direct pass takes its own `factored` as a constant
 * instead: compiled into a pass over unfactored codes, the factored branch left GCC too few
 * registers for the pass's sums, and 4 rows over Q5_0 codes ran at half their speed (Qwen2.5-0.5B's
 * gate/up projections at 4-16 rows). */
static inline const float *group_scales(const BlockWeights *b, int64_t p, int64_t g, float room[2][PANEL],
                                        const float **offset) {
    return scales_of(b, p, g, room, offset, b->factors != NULL);
}

/* Rows r0 .. r0 + rows - 1 of out for panel p, from the panel's sums. */
static void store_rows(const Direct *d, int64_t p, int64_t r0, int rows, float total[PASS_ROWS][PANEL]) {
    const int64_t first = p * PANEL, count = d->n - first < PANEL ? d->n - first : PANEL;
    for (int r = 0; r < rows; r++)
        for (int64_t c = 0; c < count; c++)
            d->out[(r0 + r) * d->ld + first + c] = total[r][c] + (d->bias ? d->bias[first + c] : 0.0f);
}

#if defined(__AVX512F__) && LANES == 16
/* A panel's 16 codes for input i of its group as float32: a 4-bit code's byte is copied to two
 * lanes, the upper 8 of which shift out the low nibble; a 5-bit code adds bit i of its channel's
 * word of `high` as 16. */
static inline __attribute__((always_inline)) __m512 decode(const uint8_t *c, const int bits, __m512i high, int i) {
    if (bits == 8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c)));
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)c);
    const __m512i shift = _mm512_set_epi32(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512i v = _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(bytes, bytes)), shift),
                                 _mm512_set1_epi32(15));
    if (bits == 5) /* bit i to bit 4 */
        v = _mm512_or_si512(v, _mm512_and_si512(_mm512_rolv_epi32(high, _mm512_set1_epi32((36 - i) & 31)),
                                                _mm512_set1_epi32(16)));
    return _mm512_cvtepi32_ps(v);
}

/* One pass of `rows` rows over panel p: per group, the sums of codes times x in two chains (even
 * and odd inputs), then scaled and offset into the totals. */
static inline __attribute__((always_inline)) void direct_pass(const Direct *d, int64_t p, int64_t r0, const int rows,
                                                              const int bits, const int group, const int factored) {
    const BlockWeights *b = d->b;
    const int64_t k = b->k, groups = k / group;
    __m512 total[PASS_ROWS];
    for (int r = 0; r < rows; r++) total[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 acc[2][PASS_ROWS];
        for (int r = 0; r < rows; r++) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
        const float *x = d->x + r0 * k + g * group;
        const __m512i high = bits == 5 ? _mm512_loadu_si512(high_at(b, p, g)) : _mm512_setzero_si512();
#pragma GCC unroll 32
        for (int i = 0; i < group; i++) {
            const __m512 w = decode(codes_at(b, p, g * group + i, bits), bits, high, i);
            for (int r = 0; r < rows; r++) acc[i & 1][r] = _mm512_fmadd_ps(w, _mm512_set1_ps(x[r * k + i]), acc[i & 1][r]);
        }
        float room[2][PANEL];
        const float *offset, *scales = scales_of(b, p, g, room, &offset, factored);
        const __m512 scale = _mm512_loadu_ps(scales);
        for (int r = 0; r < rows; r++) {
            total[r] = _mm512_fmadd_ps(_mm512_add_ps(acc[0][r], acc[1][r]), scale, total[r]);
            if (offset)
                total[r] = _mm512_fmadd_ps(_mm512_loadu_ps(offset), _mm512_set1_ps(d->xsum[(r0 + r) * groups + g]),
                                           total[r]);
        }
    }
    float sums[PASS_ROWS][PANEL];
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(sums[r], total[r]);
    store_rows(d, p, r0, rows, sums);
}

/* f32_gemm.h's WidenSlice for blocks: code * scale + offset. */
static void block_widen(const void *weights, int64_t p, int64_t i0, int64_t count, float *dst) {
    const BlockWeights *b = weights;
    float room[2][PANEL];
    const float *scale = NULL, *offset = NULL;
    for (int64_t i = i0; i < i0 + count; i++) {
        if (i == i0 || i % b->group == 0) scale = group_scales(b, p, i / b->group, room, &offset);
        __m512 w;
        if (b->bits == 5) w = decode(codes_at(b, p, i, 5), 5, _mm512_loadu_si512(high_at(b, p, i / 32)), (int)(i % 32));
        else if (b->bits == 4) w = decode(codes_at(b, p, i, 4), 4, _mm512_setzero_si512(), 0);
        else w = decode(codes_at(b, p, i, 8), 8, _mm512_setzero_si512(), 0);
        w = _mm512_mul_ps(w, _mm512_loadu_ps(scale));
        if (offset) w = _mm512_add_ps(w, _mm512_loadu_ps(offset));
        _mm512_storeu_ps(dst + (i - i0) * PANEL, w);
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
/* Bit i of each word as 16: a shift by a constant where i is one (an unrolled loop's). */
static inline __attribute__((always_inline)) __m256i fifth_bit(__m256i words, int i) {
    const __m256i moved = i >= 4 ? _mm256_srli_epi32(words, i - 4) : _mm256_slli_epi32(words, 4 - i);
    return _mm256_and_si256(moved, _mm256_set1_epi32(16));
}

/* A panel's 16 codes for input i of its group as two vectors of float32, channels 0-7 and 8-15;
 * a 5-bit code's fifth bit from its channel's word of high[0] (channels 0-7) or high[1]. */
static inline __attribute__((always_inline)) void decode(const uint8_t *c, const int bits, const __m256i high[2],
                                                         int i, __m256 *lo, __m256 *hi) {
    if (bits == 8) {
        *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)c)));
        *hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(c + 8))));
        return;
    }
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c));
    __m256i low = _mm256_and_si256(v, _mm256_set1_epi32(15)), upper = _mm256_srli_epi32(v, 4);
    if (bits == 5) {
        low = _mm256_or_si256(low, fifth_bit(high[0], i));
        upper = _mm256_or_si256(upper, fifth_bit(high[1], i));
    }
    *lo = _mm256_cvtepi32_ps(low);
    *hi = _mm256_cvtepi32_ps(upper);
}

/* As the AVX-512 pass, in registers: 2 chains x 2 rows x 2 halves of sums up to two rows, one
 * chain from three (8 sums for four rows). */
static inline __attribute__((always_inline)) void direct_pass(const Direct *d, int64_t p, int64_t r0, const int rows,
                                                              const int bits, const int group, const int factored) {
    const BlockWeights *b = d->b;
    const int64_t k = b->k, groups = k / group;
    const int chains = rows <= 2 ? 2 : 1;
    float total[PASS_ROWS][PANEL] = {{0}};
    for (int64_t g = 0; g < groups; g++) {
        __m256 acc[2][PASS_ROWS][2];
        for (int c = 0; c < chains; c++)
            for (int r = 0; r < rows; r++)
                for (int h = 0; h < 2; h++) acc[c][r][h] = _mm256_setzero_ps();
        const float *x = d->x + r0 * k + g * group;
        __m256i high[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        if (bits == 5)
            for (int h = 0; h < 2; h++) high[h] = _mm256_loadu_si256((const __m256i *)(high_at(b, p, g) + 8 * h));
#pragma GCC unroll 32
        for (int i = 0; i < group; i++) {
            __m256 lo, hi;
            decode(codes_at(b, p, g * group + i, bits), bits, high, i, &lo, &hi);
            const int c = i % chains;
            for (int r = 0; r < rows; r++) {
                const __m256 xb = _mm256_broadcast_ss(x + r * k + i);
                acc[c][r][0] = _mm256_fmadd_ps(lo, xb, acc[c][r][0]);
                acc[c][r][1] = _mm256_fmadd_ps(hi, xb, acc[c][r][1]);
            }
        }
        float room[2][PANEL];
        const float *offset, *scale = scales_of(b, p, g, room, &offset, factored);
        for (int r = 0; r < rows; r++)
            for (int h = 0; h < 2; h++) {
                const __m256 sum = chains == 2 ? _mm256_add_ps(acc[0][r][h], acc[1][r][h]) : acc[0][r][h];
                __m256 t = _mm256_fmadd_ps(sum, _mm256_loadu_ps(scale + 8 * h), _mm256_loadu_ps(total[r] + 8 * h));
                if (offset)
                    t = _mm256_fmadd_ps(_mm256_loadu_ps(offset + 8 * h), _mm256_set1_ps(d->xsum[(r0 + r) * groups + g]),
                                        t);
                _mm256_storeu_ps(total[r] + 8 * h, t);
            }
    }
    store_rows(d, p, r0, rows, total);
}

/* f32_gemm.h's WidenSlice for blocks: code * scale + offset. */
static void block_widen(const void *weights, int64_t p, int64_t i0, int64_t count, float *dst) {
    const BlockWeights *b = weights;
    float room[2][PANEL];
    const float *scale = NULL, *offset = NULL;
    for (int64_t i = i0; i < i0 + count; i++) {
        if (i == i0 || i % b->group == 0) scale = group_scales(b, p, i / b->group, room, &offset);
        __m256 w[2];
        __m256i high[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
        if (b->bits == 5) { /* bit i % 32 to bit 4, by a shift the loop cannot make constant */
            const __m128i right = _mm_cvtsi32_si128((int)(i % 32));
            for (int h = 0; h < 2; h++) {
                const __m256i words = _mm256_loadu_si256((const __m256i *)(high_at(b, p, i / 32) + 8 * h));
                high[h] = _mm256_slli_epi32(_mm256_srl_epi32(words, right), 4);
            }
            decode(codes_at(b, p, i, 5), 5, high, 4, &w[0], &w[1]);
        } else if (b->bits == 4)
            decode(codes_at(b, p, i, 4), 4, high, 0, &w[0], &w[1]);
        else
            decode(codes_at(b, p, i, 8), 8, high, 0, &w[0], &w[1]);
        for (int h = 0; h < 2; h++) {
            __m256 v = _mm256_mul_ps(w[h], _mm256_loadu_ps(scale + 8 * h));
            if (offset) v = _mm256_add_ps(v, _mm256_loadu_ps(offset + 8 * h));
            _mm256_storeu_ps(dst + (i - i0) * PANEL + 8 * h, v);
        }
    }
}
#else
/* The same in plain C, for CPUs with neither. */
static inline void decode(const uint8_t *c, const int bits, const uint32_t *high, int i, float w[PANEL]) {
    for (int j = 0; j < PANEL; j++) {
        int code = bits == 8 ? (int8_t)c[j] : (j < 8 ? c[j] & 15 : c[j - 8] >> 4);
        w[j] = (float)(bits == 5 ? code | (int)((high[j] >> i) & 1) << 4 : code);
    }
}

static inline void direct_pass(const Direct *d, int64_t p, int64_t r0, const int rows, const int bits,
                               const int group, const int factored) {
    const BlockWeights *b = d->b;
    const int64_t k = b->k, groups = k / group;
    float total[PASS_ROWS][PANEL] = {{0}};
    for (int64_t g = 0; g < groups; g++) {
        float acc[2][PASS_ROWS][PANEL] = {{{0}}};
        const float *x = d->x + r0 * k + g * group;
        for (int i = 0; i < group; i++) {
            float w[PANEL];
            decode(codes_at(b, p, g * group + i, bits), bits, bits == 5 ? high_at(b, p, g) : NULL, i, w);
            for (int r = 0; r < rows; r++)
                for (int j = 0; j < PANEL; j++) acc[i & 1][r][j] += w[j] * x[r * k + i];
        }
        float room[2][PANEL];
        const float *offset, *scale = scales_of(b, p, g, room, &offset, factored);
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < PANEL; j++) {
                total[r][j] += (acc[0][r][j] + acc[1][r][j]) * scale[j];
                if (offset) total[r][j] += offset[j] * d->xsum[(r0 + r) * groups + g];
            }
    }
    store_rows(d, p, r0, rows, total);
}

/* f32_gemm.h's WidenSlice for blocks: code * scale + offset. */
static void block_widen(const void *weights, int64_t p, int64_t i0, int64_t count, float *dst) {
    const BlockWeights *b = weights;
    float room[2][PANEL];
    const float *scale = NULL, *offset = NULL;
    for (int64_t i = i0; i < i0 + count; i++) {
        if (i == i0 || i % b->group == 0) scale = group_scales(b, p, i / b->group, room, &offset);
        float w[PANEL];
        decode(codes_at(b, p, i, b->bits), b->bits, b->bits == 5 ? high_at(b, p, i / 32) : NULL, (int)(i % 32), w);
        for (int j = 0; j < PANEL; j++) dst[(i - i0) * PANEL + j] = w[j] * scale[j] + (offset ? offset[j] : 0.0f);
    }
}
#endif

/* 4-bit codes times activations rounded to int8 (`xq`): the integer sums of 32 products per group,
 * scaled by the group's scale times x's step. AVX2 multiplies 32 pairs of bytes per instruction
 * (vpmaddubsw: the unsigned codes by the signed activations, into int16 sums of two) where the
 * float path converts and multiplies 8 codes: a decode step's projections are bound by that
 * arithmetic on a CPU without AVX-512 sooner than by the weights' bytes. */
#if defined(__AVX2__) && defined(__FMA__)
/* The codes of inputs i .. i + 3 (32 bytes: 8 per input) reordered so that each int16 lane pairs
 * one channel's codes for two inputs: i and i + 1 in the low 128 bits, i + 2 and i + 3 in the high;
 * the 8 low nibbles are channels 0-7, the high ones 8-15. */
static inline __attribute__((always_inline)) void pair_codes(const uint8_t *c, __m256i *lo, __m256i *hi) {
    const __m256i order = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                           0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    const __m256i v = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)c), order), nibble = _mm256_set1_epi8(15);
    *lo = _mm256_and_si256(v, nibble);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
}

/* x's int8 values for inputs i .. i + 3 as pair_codes pairs them: (i, i + 1) 8 times, then (i + 2, i + 3). */
static inline __attribute__((always_inline)) __m256i pair_x(const int8_t *x) {
    const __m256i order = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                           2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    int32_t four;
    memcpy(&four, x, sizeof four);
    return _mm256_shuffle_epi8(_mm256_set1_epi32(four), order);
}

/* The int16 sums of both halves (inputs i, i + 1 and i + 2, i + 3) added as int32: 8 channels. */
static inline __attribute__((always_inline)) __m256 halves_sum(__m256i sums) {
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(sums)),
                                               _mm256_cvtepi16_epi32(_mm256_extracti128_si256(sums, 1))));
}

/* As direct_pass for 4-bit codes and int8 x. A group's int16 sums hold: 8 steps of 2 * 15 * 127. */
static inline __attribute__((always_inline)) void int8_pass(const Direct *d, int64_t p, int64_t r0, const int rows) {
    const BlockWeights *b = d->b;
    const int64_t k = b->k, groups = k / 32;
    float total[PASS_ROWS][PANEL] = {{0}};
    for (int64_t g = 0; g < groups; g++) {
        __m256i acc[PASS_ROWS][2];
        for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
        const int8_t *x = d->xq + r0 * k + g * 32;
#pragma GCC unroll 8
        for (int i = 0; i < 32; i += 4) {
            __m256i lo, hi;
            pair_codes(codes_at(b, p, g * 32 + i, 4), &lo, &hi);
            for (int r = 0; r < rows; r++) {
                const __m256i xs = pair_x(x + r * k + i);
                acc[r][0] = _mm256_add_epi16(acc[r][0], _mm256_maddubs_epi16(lo, xs));
                acc[r][1] = _mm256_add_epi16(acc[r][1], _mm256_maddubs_epi16(hi, xs));
            }
        }
        float room[2][PANEL];
        const float *offset, *scale = group_scales(b, p, g, room, &offset);
        for (int r = 0; r < rows; r++) {
            const __m256 step = _mm256_set1_ps(d->xstep[(r0 + r) * groups + g]);
            for (int h = 0; h < 2; h++) {
                __m256 t = _mm256_fmadd_ps(halves_sum(acc[r][h]), _mm256_mul_ps(_mm256_loadu_ps(scale + 8 * h), step),
                                           _mm256_loadu_ps(total[r] + 8 * h));
                if (offset)
                    t = _mm256_fmadd_ps(_mm256_loadu_ps(offset + 8 * h), _mm256_set1_ps(d->xsum[(r0 + r) * groups + g]),
                                        t);
                _mm256_storeu_ps(total[r] + 8 * h, t);
            }
        }
    }
    store_rows(d, p, r0, rows, total);
}
#else
static inline void int8_pass(const Direct *d, int64_t p, int64_t r0, const int rows) {
    const BlockWeights *b = d->b;
    const int64_t k = b->k, groups = k / 32;
    float total[PASS_ROWS][PANEL] = {{0}};
    for (int64_t g = 0; g < groups; g++) {
        int32_t acc[PASS_ROWS][PANEL] = {{0}};
        const int8_t *x = d->xq + r0 * k + g * 32;
        for (int i = 0; i < 32; i++) {
            const uint8_t *c = codes_at(b, p, g * 32 + i, 4);
            for (int r = 0; r < rows; r++)
                for (int j = 0; j < PANEL; j++) acc[r][j] += (j < 8 ? c[j] & 15 : c[j - 8] >> 4) * x[r * k + i];
        }
        float room[2][PANEL];
        const float *offset, *scale = group_scales(b, p, g, room, &offset);
        for (int r = 0; r < rows; r++) {
            const float step = d->xstep[(r0 + r) * groups + g];
            for (int j = 0; j < PANEL; j++) {
                total[r][j] += (float)acc[r][j] * (scale[j] * step);
                if (offset) total[r][j] += offset[j] * d->xsum[(r0 + r) * groups + g];
            }
        }
    }
    store_rows(d, p, r0, rows, total);
}
#endif

/* 6-bit codes (Q6_K's: a code c kept as c + 32, 0..63), multiplied only by x rounded to int8, in a
 * layout of their own (layouts.block_panels, bits 6): per panel and quad of inputs i .. i + 3, 32
 * bytes whose byte 4c + e holds channel c's low 4 bits for input i + e in its low nibble and channel
 * 8 + c's in its high one; after every panel's nibbles, per panel and quad, 16 bytes whose byte
 * 4 (j % 4) + e holds channel j's top 2 bits for input i + e at bit 2 (j / 4). A quad's 4 inputs of
 * a channel then sit in one int32 lane beside x's 4 bytes, and vpmaddubsw and vpmaddwd sum them
 * there: 6.75 bits a weight read, where 8-bit codes read 8.75. */
static inline const uint8_t *quad_low(const BlockWeights *b, int64_t p, int64_t t) {
    return b->codes + (p * (b->k / 4) + t) * 32;
}

static inline const uint8_t *quad_top(const BlockWeights *b, int64_t p, int64_t t) {
    return b->top + (p * (b->k / 4) + t) * 16;
}

/* Channel j's code (0..63) for input i. */
static inline int six_bit_code(const BlockWeights *b, int64_t p, int64_t i, int j) {
    const int e = (int)(i % 4);
    const int low = (quad_low(b, p, i / 4)[4 * (j % 8) + e] >> (j < 8 ? 0 : 4)) & 15;
    return low | ((quad_top(b, p, i / 4)[4 * (j % 4) + e] >> (2 * (j / 4))) & 3) << 4;
}

/* f32_gemm.h's WidenSlice for 6-bit codes: (code - 32) * scale. Only a prefill's rows (past
 * DIRECT_MAX_ROWS) widen these, over which the GEMM's tiles spread this decoding. */
static void six_bit_widen(const void *weights, int64_t p, int64_t i0, int64_t count, float *dst) {
    const BlockWeights *b = weights;
    float room[2][PANEL];
    const float *scale = NULL, *offset = NULL;
    for (int64_t i = i0; i < i0 + count; i++) {
        if (i == i0 || i % b->group == 0) scale = group_scales(b, p, i / b->group, room, &offset);
        for (int j = 0; j < PANEL; j++) dst[(i - i0) * PANEL + j] = (float)(six_bit_code(b, p, i, j) - 32) * scale[j];
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* Quad t's codes of panel p: channels 0-7 in *lo, 8-15 in *hi, int32 lane c holding channel c's
 * 4 codes. The top bits' fields 0 and 1 go to lo's halves, 2 and 3 to hi's, each to bits 4-5. */
static inline __attribute__((always_inline)) void six_bit_quad(const BlockWeights *b, int64_t p, int64_t t,
                                                               __m256i *lo, __m256i *hi) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)quad_low(b, p, t)), nibble = _mm256_set1_epi8(15);
    const __m256i top = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)quad_top(b, p, t)));
    const __m256i bits45 = _mm256_set1_epi8(0x30);
    const __m256i up = _mm256_sllv_epi32(top, _mm256_setr_epi32(4, 4, 4, 4, 2, 2, 2, 2));
    const __m256i down = _mm256_srlv_epi32(top, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2));
    *lo = _mm256_or_si256(_mm256_and_si256(v, nibble), _mm256_and_si256(up, bits45));
    *hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), nibble), _mm256_and_si256(down, bits45));
}

/* As int8_pass for 6-bit codes in groups of 16: per group the int32 sums of codes times q, less
 * 32 times the group's sum of q (the codes' offset), scaled by the group's scale times x's step. */
static inline __attribute__((always_inline)) void six_bit_pass(const Direct *d, int64_t p, int64_t r0, const int rows) {
    const BlockWeights *b = d->b;
    const int64_t k = b->k, groups = k / 16;
    const __m256i ones = _mm256_set1_epi16(1);
    float total[PASS_ROWS][PANEL] = {{0}};
    for (int64_t g = 0; g < groups; g++) {
        __m256i acc[PASS_ROWS][2];
        for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
        const int8_t *x = d->xq + r0 * k + g * 16;
#pragma GCC unroll 4
        for (int i = 0; i < 16; i += 4) {
            __m256i lo, hi;
            six_bit_quad(b, p, (g * 16 + i) / 4, &lo, &hi);
            for (int r = 0; r < rows; r++) {
                int32_t four;
                memcpy(&four, x + r * k + i, sizeof four);
                const __m256i xs = _mm256_set1_epi32(four);
                acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xs), ones));
                acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xs), ones));
            }
        }
        float room[2][PANEL];
        const float *offset, *scale = group_scales(b, p, g, room, &offset);
        for (int r = 0; r < rows; r++) {
            const __m256 step = _mm256_set1_ps(d->xstep[(r0 + r) * (k / 32) + g / 2]);
            const __m256i shift = _mm256_set1_epi32(32 * d->xqsum[(r0 + r) * groups + g]);
            for (int h = 0; h < 2; h++) {
                const __m256 sums = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r][h], shift));
                const __m256 t = _mm256_fmadd_ps(sums, _mm256_mul_ps(_mm256_loadu_ps(scale + 8 * h), step),
                                                 _mm256_loadu_ps(total[r] + 8 * h));
                _mm256_storeu_ps(total[r] + 8 * h, t);
            }
        }
    }
    store_rows(d, p, r0, rows, total);
}
#else
static inline void six_bit_pass(const Direct *d, int64_t p, int64_t r0, const int rows) {
    const BlockWeights *b = d->b;
    const int64_t k = b->k, groups = k / 16;
    float total[PASS_ROWS][PANEL] = {{0}};
    for (int64_t g = 0; g < groups; g++) {
        int32_t acc[PASS_ROWS][PANEL] = {{0}};
        const int8_t *x = d->xq + r0 * k + g * 16;
        for (int i = 0; i < 16; i++)
            for (int j = 0; j < PANEL; j++) {
                const int code = six_bit_code(b, p, g * 16 + i, j);
                for (int r = 0; r < rows; r++) acc[r][j] += code * x[r * k + i];
            }
        float room[2][PANEL];
        const float *offset, *scale = group_scales(b, p, g, room, &offset);
        for (int r = 0; r < rows; r++) {
            const float step = d->xstep[(r0 + r) * (k / 32) + g / 2];
            const int32_t shift = 32 * d->xqsum[(r0 + r) * groups + g];
            for (int j = 0; j < PANEL; j++) total[r][j] += (float)(acc[r][j] - shift) * (scale[j] * step);
        }
    }
    store_rows(d, p, r0, rows, total);
}
#endif

static inline __attribute__((always_inline)) void rows_pass_as(const Direct *d, int64_t p, int64_t r0, int rows,
                                                               const int bits, const int group, const int factored) {
    switch (rows) {
        case 1: direct_pass(d, p, r0, 1, bits, group, factored); break;
        case 2: direct_pass(d, p, r0, 2, bits, group, factored); break;
        case 3: direct_pass(d, p, r0, 3, bits, group, factored); break;
        default: direct_pass(d, p, r0, 4, bits, group, factored); break;
    }
}

/* A pass compiled for factored scales or for stored ones (scales_of). */
static inline __attribute__((always_inline)) void rows_pass(const Direct *d, int64_t p, int64_t r0, int rows,
                                                            const int bits, const int group) {
    if (d->b->factors != NULL)
        rows_pass_as(d, p, r0, rows, bits, group, 1);
    else
        rows_pass_as(d, p, r0, rows, bits, group, 0);
}

/* One pass over x rounded to int8: 6-bit codes' own, else 4-bit codes'. */
static inline __attribute__((always_inline)) void int8_rows_pass(const Direct *d, int64_t p, int64_t r0,
                                                                 const int rows) {
    if (d->b->bits == 6)
        six_bit_pass(d, p, r0, rows);
    else
        int8_pass(d, p, r0, rows);
}

/* Every row of out for panel p, PASS_ROWS at a time, each row count, code width and group compiled
 * on its own. */
static void direct_panel(const Direct *d, int64_t p, int64_t m) {
    for (int64_t r0 = 0; r0 < m; r0 += PASS_ROWS) {
        const int64_t rows = m - r0 < PASS_ROWS ? m - r0 : PASS_ROWS;
        if (d->xq != NULL)
            switch (rows) {
                case 1: int8_rows_pass(d, p, r0, 1); break;
                case 2: int8_rows_pass(d, p, r0, 2); break;
                case 3: int8_rows_pass(d, p, r0, 3); break;
                default: int8_rows_pass(d, p, r0, 4); break;
            }
        else if (d->b->bits == 4)
            rows_pass(d, p, r0, (int)rows, 4, 32);
        else if (d->b->bits == 5)
            rows_pass(d, p, r0, (int)rows, 5, 32);
        else if (d->b->group == 32)
            rows_pass(d, p, r0, (int)rows, 8, 32);
        else
            rows_pass(d, p, r0, (int)rows, 8, 16);
    }
}

/* Whether block_gemm takes these shapes: codes of 4, 5 or 8 bits in groups of 32, or 8-bit ones
 * without an offset in groups of 16; factored scales in super-blocks of SUPER inputs; N_padded and
 * K as the layouts need them. */
static int takes(int bits, int group, const void *offset, const float *factors, int64_t m, int64_t n,
                 int64_t n_padded, int64_t k) {
    const int grouped = bits == 6 ? group == 16 && offset == NULL && factors != NULL
                                  : group == 32 || (group == 16 && bits == 8 && offset == NULL);
    return m >= 0 && n > 0 && k > 0 && grouped && k % group == 0 && n_padded >= n && n_padded % TILE == 0 &&
           (bits == 4 || bits == 5 || bits == 6 || bits == 8) && (factors == NULL || k % SUPER == 0);
}

/* scale and offset: float32 per group, or with `factors` int8 per group (factored). */
static BlockWeights weights(const uint8_t *codes, int bits, int group, const void *scale, const void *offset,
                            const float *factors, int64_t n_padded, int64_t k) {
    const uint32_t *high = bits == 5 ? (const uint32_t *)(codes + n_padded * k / 2) : NULL; /* after the low bits */
    const uint8_t *top = bits == 6 ? codes + n_padded * k / 2 : NULL;
    if (factors == NULL) return (BlockWeights){codes, high, top, scale, offset, NULL, NULL, NULL, k, bits, group};
    return (BlockWeights){codes, high, top, NULL, NULL, scale, offset, factors, k, bits, group};
}

/* What the direct path reads beside x: each group's sum of x [m][k / group] for the offsets'
 * share, and with `int8` x rounded to int8 per row and group of 32, q = round(x * 127 / max |x|),
 * with each group's step max |x| / 127 (torch's twin: layouts.block_int8_twin); over 6-bit codes
 * also each group of 16's sum of q, for the codes' -32. */
typedef struct {
    float *xsum, *xstep;
    int8_t *xq;
    int32_t *xqsum;
} Prepared;

static void release(Prepared *p) {
    free(p->xsum), free(p->xstep), free(p->xq), free(p->xqsum);
}

/* 0, or -3 out of memory (nothing held). */
static int prepare(const float *x, int64_t m, int64_t k, int group, int offsets, int int8, int six, Prepared *p) {
    const int64_t groups = k / group;
    *p = (Prepared){offsets ? malloc(m * groups * sizeof(float)) : NULL, int8 ? malloc(m * (k / 32) * sizeof(float)) : NULL,
                    int8 ? malloc(m * k) : NULL, int8 && six ? malloc(m * (k / 16) * sizeof(int32_t)) : NULL};
    if ((offsets && p->xsum == NULL) || (int8 && (p->xstep == NULL || p->xq == NULL)) || (int8 && six && !p->xqsum)) {
        release(p);
        return -3;
    }
    for (int64_t r = 0; offsets && r < m; r++)
        for (int64_t g = 0; g < groups; g++) {
            float sum = 0.0f;
            for (int i = 0; i < group; i++) sum += x[r * k + g * group + i];
            p->xsum[r * groups + g] = sum;
        }
    for (int64_t r = 0; int8 && r < m; r++)
        for (int64_t g = 0; g < k / 32; g++) {
            const float *v = x + r * k + g * 32;
            float largest = 0.0f;
            for (int i = 0; i < 32; i++) largest = fmaxf(largest, fabsf(v[i]));
            const float inverse = largest > 0.0f ? 127.0f / largest : 0.0f;
            for (int i = 0; i < 32; i++) p->xq[r * k + g * 32 + i] = (int8_t)nearbyintf(v[i] * inverse);
            p->xstep[r * (k / 32) + g] = largest / 127.0f;
        }
    for (int64_t r = 0; int8 && six && r < m; r++)
        for (int64_t g = 0; g < k / 16; g++) {
            int32_t sum = 0;
            for (int i = 0; i < 16; i++) sum += p->xq[r * k + g * 16 + i];
            p->xqsum[r * (k / 16) + g] = sum;
        }
    return 0;
}

/* out [m, n] = x [m, k] W^T + bias, W in blocks (above); with int8_x, up to DIRECT_MAX_ROWS rows over
 * 4- or 6-bit codes take x rounded to int8 (int8_pass, six_bit_pass), else x as it is (6-bit codes
 * then through the widened slices at any row count). 0, -1 for shapes it does not take, -3 out of
 * memory. */
int block_gemm(const float *x, const uint8_t *codes, int bits, int group, const void *scale, const void *offset,
               const float *factors, const float *bias, float *out, int64_t m, int64_t n, int64_t n_padded, int64_t k,
               int int8_x) {
    if (!takes(bits, group, offset, factors, m, n, n_padded, k)) return -1;
    if (m == 0) return 0;
    const BlockWeights b = weights(codes, bits, group, scale, offset, factors, n_padded, k);
    if (m > DIRECT_MAX_ROWS || (bits == 6 && !int8_x))
        return f32_gemm_widened(x, bits == 6 ? six_bit_widen : block_widen, &b, bias, out, m, n, n_padded, k);
    Prepared prepared;
    if (prepare(x, m, k, group, offset != NULL, int8_x && (bits == 4 || bits == 6), bits == 6, &prepared)) return -3;
    const Direct d = {x, prepared.xsum, bias, prepared.xq, prepared.xstep, prepared.xqsum, &b, out, n, n};
    const int64_t panels = (n + PANEL - 1) / PANEL, work = m * n_padded * k / WORK_PER_THREAD + 1;
    const int threads = work < omp_get_max_threads() ? (int)work : omp_get_max_threads();
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) direct_panel(&d, p, m);
    release(&prepared);
    return 0;
}

/* Part `part` of `parts` of block_gemm, for a team (team.h), up to DIRECT_MAX_ROWS rows: its share of
 * the panels, into out's rows of stride `ld` (a piece's columns of a wider output). The same sums
 * as block_gemm, to the bit. 0, -1 for shapes it does not take (6-bit codes without int8_x among
 * them), -3 out of memory. */
int block_gemm_part(const float *x, const uint8_t *codes, int bits, int group, const void *scale, const void *offset,
                    const float *factors, const float *bias, float *out, int64_t ld, int64_t m, int64_t n,
                    int64_t n_padded, int64_t k, int int8_x, int part, int parts) {
    if (!takes(bits, group, offset, factors, m, n, n_padded, k) || m > DIRECT_MAX_ROWS || ld < n || parts < 1 ||
        part < 0 || part >= parts || (bits == 6 && !int8_x))
        return -1;
    const BlockWeights b = weights(codes, bits, group, scale, offset, factors, n_padded, k);
    int64_t first, end;
    team_share((n + PANEL - 1) / PANEL, part, parts, &first, &end);
    if (m == 0 || first == end) return 0;
    Prepared prepared;
    if (prepare(x, m, k, group, offset != NULL, int8_x && (bits == 4 || bits == 6), bits == 6, &prepared)) return -3;
    const Direct d = {x, prepared.xsum, bias, prepared.xq, prepared.xstep, prepared.xqsum, &b, out, n, ld};
    for (int64_t p = first; p < end; p++) direct_panel(&d, p, m);
    release(&prepared);
    return 0;
}
