/* The float32 projection on CPU: out = x W^T + bias, W packed once into panels of PANEL output
 * channels, [panels][K][PANEL], so that a step over K reads one vector of each panel and every row
 * of x multiplies it by a broadcast. A decode step of a small model is its weight bytes: MKL's
 * GEMM read SmolLM2's float32 weights at 6-10 GB/s for 8 rows (input-major or not), this layout
 * streams them in order, each weight read once for up to MAX_ROWS rows.
 *
 * Its int8-weight variant (f32_gemm_int8w) reads a quarter of those bytes: W ~ q * scale[:, None]
 * with q int8 in the same panels. Each tile's weights are widened to float32, SLICE inputs at a
 * time, into a buffer that stays in L1, and the same float32 tile multiplies them; the scale
 * multiplies the sums once at the end. torch's packed int8 kernel wants bf16 activations, which a
 * CPU without bf16 instructions (AVX2) converts in software: 29.9 ms for SmolLM2's 121 projections
 * of one row against 45.7 for float32 (AMD EPYC, `spanserve bench projections`).
 *
 * Its bf16-weight variant (f32_gemm_bf16w) is a bf16 model's few-row product: half float32's bytes,
 * each weight vector widened in registers as it is loaded (a bf16 is a float32's upper half; a
 * pass through an L1 buffer, as for int8, took 1.6x float32's time at 2-8 rows on an AMD EPYC). oneDNN's bf16 GEMM reads a bf16 weight
 * for one row slower than this kernel reads a float32 one (SmolLM2's 121 projections: 39.9 against
 * 26.5 ms on a 2-core AMX Xeon); past a few dozen rows its AMX tiles win, and keep those rows
 * (models/layout.py picks by rows).
 *
 * Layouts: x [M, K] and out [M, N] float32; packed [N_padded / PANEL][K][PANEL] float32, int8 or
 * bf16 (zeros for the padding channels); scale [N_padded] float32; bias [N] float32 or NULL. N_padded
 * is a multiple of TILE_PANELS * PANEL.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "common.h"
#include "f32_gemm.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define PANEL 16      /* output channels of a panel: one vector */
#define TILE_PANELS 3 /* panels a tile computes, sharing each broadcast of x */
#define MAX_ROWS 8    /* rows a tile steps together, sharing each weight vector: 8 x 3 sums in registers */
/* Rows whose tiles run before the next rows start: their x (ROW_CHUNK x K floats) stays in cache
 * while every tile of weights passes over it. */
#define ROW_CHUNK 192
/* Rows from which the AVX2 tile's weights sit in L1 long enough for tile_quads to win (SmolLM2's
 * projections on an AMD EPYC: 12 rows 0.97x tile_pairs' speed, 18 rows 1.02x, 35 rows 1.07x). */
#define MANY_ROWS 24
#define WORK_PER_THREAD (1 << 18) /* multiply-adds worth another thread (as in int8_gemm.c) */
#define TILE_WIDTH (TILE_PANELS * PANEL)
#define SLICE 128 /* inputs a pass over a tile takes (panel_rows): TILE_WIDTH x SLICE floats, 24 KB */

typedef struct {
    const float *x, *packed, *scale, *bias;
    const int8_t *qpacked; /* the int8 variant's weights (packed is then NULL) */
    const uint16_t *bpacked; /* the bf16 variant's weights (packed is then NULL) */
    const uint32_t *pairs;   /* bf16_pairs_gemm's weights: bf16 pairs along K (packed is then NULL) */
    const uint16_t *xb;      /* and its bf16 rows of x */
    WidenSlice widen_slice;  /* another kernel's weights (f32_gemm.h), widened as int8 ones are (packed is then NULL) */
    const void *weights;
    float *out;
    int64_t n, k;
} Gemm;

/* One tile's weights: TILE_PANELS panels, `stride` weights apart, `k` inputs of x (row stride ldx);
 * float32 weights at w, or bf16 ones at wb. many_rows: the call has at least MANY_ROWS rows (the
 * AVX2 tile then takes them four at a time). */
typedef struct {
    const float *w, *x;
    int64_t stride, k, ldx;
    const uint16_t *wb;
    int many_rows;
} Slice;

static void store_tile(const Gemm *g, int64_t m0, int rows, int64_t p, float sums[MAX_ROWS][TILE_WIDTH]) {
    int64_t first = p * PANEL, count = g->n - first < TILE_WIDTH ? g->n - first : TILE_WIDTH;
    if (count <= 0) return; /* padding channels only */
    for (int r = 0; r < rows; r++) {
        float *out = g->out + (m0 + r) * g->n + first;
        for (int64_t c = 0; c < count; c++)
            out[c] = sums[r][c] * (g->scale ? g->scale[first + c] : 1.0f) + (g->bias ? g->bias[first + c] : 0.0f);
    }
}

#ifdef __AVX512F__
/* One slice of a tile: `rows` rows of x by the slice's weights, added to sums. */
static inline __attribute__((always_inline)) __m512 load_weights(const Slice *s, int64_t at, const int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(s->wb + at))), 16));
    return _mm512_loadu_ps(s->w + at);
}

static inline __attribute__((always_inline)) void tile(const Slice *s, const int rows, float sums[MAX_ROWS][TILE_WIDTH],
                                                       const int bf16) {
    const int64_t k = s->k, ldx = s->ldx, stride = s->stride;
    const float *x = s->x;
    __m512 acc[MAX_ROWS][TILE_PANELS];
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < TILE_PANELS; t++) acc[r][t] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        __m512 w[TILE_PANELS];
        for (int t = 0; t < TILE_PANELS; t++) w[t] = load_weights(s, t * stride + i * PANEL, bf16);
        for (int r = 0; r < rows; r++) {
            __m512 xb = _mm512_set1_ps(x[r * ldx + i]);
            for (int t = 0; t < TILE_PANELS; t++) acc[r][t] = _mm512_fmadd_ps(xb, w[t], acc[r][t]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < TILE_PANELS; t++)
            _mm512_storeu_ps(sums[r] + t * PANEL, _mm512_add_ps(_mm512_loadu_ps(sums[r] + t * PANEL), acc[r][t]));
}
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2: a panel is two 8-float registers, a tile six, and there are 16 registers. The plain C
 * below kept its sums in memory: 8 rows ran at about 12% of the two cores' FMA peak on an AMD
 * EPYC. */
static inline __attribute__((always_inline)) __m256 load_weights(const Slice *s, int64_t at, const int bf16) {
    if (bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s->wb + at))), 16));
    return _mm256_loadu_ps(s->w + at);
}

/* Rows two at a time over the whole tile: 12 sums, the broadcasts and the weights as memory
 * operands (14 loads per 12 multiply-adds). Every pass streams all three panels: the faster
 * blocking while the weights come from memory, as for the few rows of decode. */
static inline __attribute__((always_inline)) void tile_pairs(const Slice *s, const int rows,
                                                             float sums[MAX_ROWS][TILE_WIDTH], const int bf16) {
    const int64_t k = s->k, ldx = s->ldx, stride = s->stride;
    const float *x = s->x;
#pragma GCC unroll 4
    for (int r0 = 0; r0 < rows; r0 += 2) {
        const int pair = rows - r0 < 2 ? 1 : 2;
        __m256 acc[2][2 * TILE_PANELS];
        for (int r = 0; r < pair; r++)
            for (int v = 0; v < 2 * TILE_PANELS; v++) acc[r][v] = _mm256_setzero_ps();
        for (int64_t i = 0; i < k; i++)
            for (int r = 0; r < pair; r++) {
                __m256 xb = _mm256_broadcast_ss(x + (r0 + r) * ldx + i);
                for (int t = 0; t < TILE_PANELS; t++) {
                    const int64_t at = t * stride + i * PANEL;
                    acc[r][2 * t] = _mm256_fmadd_ps(xb, load_weights(s, at, bf16), acc[r][2 * t]);
                    acc[r][2 * t + 1] = _mm256_fmadd_ps(xb, load_weights(s, at + 8, bf16), acc[r][2 * t + 1]);
                }
            }
        for (int r = 0; r < pair; r++)
            for (int v = 0; v < 2 * TILE_PANELS; v++)
                _mm256_storeu_ps(sums[r0 + r] + v * 8, _mm256_add_ps(_mm256_loadu_ps(sums[r0 + r] + v * 8), acc[r][v]));
    }
}

/* common.h's in_register for this 8-float type, whatever LANES a test build sets */
static inline __attribute__((always_inline)) __m256 in_register256(__m256 v) {
    __asm__("" : "+x"(v));
    return v;
}

#define HALF 3 /* weight vectors of half a tile */
#define QUAD 4 /* rows stepped together */

/* Half a tile at a time, rows four at a time: 12 sums, the 3 weights held in registers and a
 * row's broadcast, 16 registers; 7 loads per 12 multiply-adds. Where the slice's weights are in
 * L1 and many rows pass over them, tile_pairs' loads set its pace (the two 256-bit loads a cycle
 * of an AMD EPYC): there SmolLM2's 121 projections ran 1.07x faster than tile_pairs at 35 rows,
 * 1.08-1.11x at 66 and 1.16x at 512, but 0.96x at 8 (weights from memory, two panels streamed
 * at a time rather than three). */
static inline __attribute__((always_inline)) void tile_quads(const Slice *s, const int rows,
                                                             float sums[MAX_ROWS][TILE_WIDTH], const int bf16) {
    const int64_t k = s->k, ldx = s->ldx, stride = s->stride;
    const float *x = s->x;
    for (int h = 0; h < 2 * TILE_PANELS; h += HALF) {
#pragma GCC unroll 2
        for (int r0 = 0; r0 < rows; r0 += QUAD) {
            const int quad = rows - r0 < QUAD ? rows - r0 : QUAD;
            __m256 acc[QUAD][HALF];
            for (int r = 0; r < quad; r++)
                for (int v = 0; v < HALF; v++) acc[r][v] = _mm256_setzero_ps();
            for (int64_t i = 0; i < k; i++) {
                __m256 w[HALF];
                for (int v = 0; v < HALF; v++) /* vector h + v: panel (h + v) / 2, its (h + v) % 2 half */
                    w[v] = in_register256(load_weights(s, (h + v) / 2 * stride + i * PANEL + (h + v) % 2 * 8, bf16));
                for (int r = 0; r < quad; r++) {
                    __m256 xb = _mm256_broadcast_ss(x + (r0 + r) * ldx + i);
                    for (int v = 0; v < HALF; v++) acc[r][v] = _mm256_fmadd_ps(xb, w[v], acc[r][v]);
                }
            }
            for (int r = 0; r < quad; r++)
                for (int v = 0; v < HALF; v++) {
                    float *sum = sums[r0 + r] + (h + v) * 8;
                    _mm256_storeu_ps(sum, _mm256_add_ps(_mm256_loadu_ps(sum), acc[r][v]));
                }
        }
    }
}

static inline __attribute__((always_inline)) void tile(const Slice *s, const int rows, float sums[MAX_ROWS][TILE_WIDTH],
                                                       const int bf16) {
    if (s->many_rows)
        tile_quads(s, rows, sums, bf16);
    else
        tile_pairs(s, rows, sums, bf16);
}
#else
/* The same sums in plain C, for CPUs with neither AVX-512 nor AVX2. */
static inline void tile(const Slice *s, const int rows, float sums[MAX_ROWS][TILE_WIDTH], const int bf16) {
    for (int64_t i = 0; i < s->k; i++)
        for (int r = 0; r < rows; r++)
            for (int t = 0; t < TILE_PANELS; t++)
                for (int c = 0; c < PANEL; c++) {
                    const int64_t at = t * s->stride + i * PANEL + c;
                    sums[r][t * PANEL + c] += s->x[r * s->ldx + i] * (bf16 ? bf16_to_float(s->wb[at]) : s->w[at]);
                }
}
#endif

/* A slice for `rows` rows, each remainder (and each weight type) compiled on its own. */
static inline __attribute__((always_inline)) void tile_rows_of(const Slice *s, int rows, float sums[MAX_ROWS][TILE_WIDTH],
                                                               const int bf16) {
    switch (rows) {
        case 1: tile(s, 1, sums, bf16); break;
        case 2: tile(s, 2, sums, bf16); break;
        case 3: tile(s, 3, sums, bf16); break;
        case 4: tile(s, 4, sums, bf16); break;
        case 5: tile(s, 5, sums, bf16); break;
        case 6: tile(s, 6, sums, bf16); break;
        case 7: tile(s, 7, sums, bf16); break;
        case 8: tile(s, 8, sums, bf16); break;
        default: break;
    }
}

static void tile_rows(const Slice *s, int rows, float sums[MAX_ROWS][TILE_WIDTH]) {
    if (s->wb)
        tile_rows_of(s, rows, sums, 1);
    else
        tile_rows_of(s, rows, sums, 0);
}

/* Inputs i0 .. i0 + count - 1 of the int8 (or another kernel's) tile from panel p, as float32 [TILE_PANELS][SLICE][PANEL].
 * (GCC widens a vector of int8 lane by lane, in scalar code, hence the intrinsics.) */
static void widen(const Gemm *g, int64_t p, int64_t i0, int64_t count, float *buf) {
    if (g->widen_slice) {
        for (int t = 0; t < TILE_PANELS; t++) g->widen_slice(g->weights, p + t, i0, count, buf + t * SLICE * PANEL);
        return;
    }
    for (int t = 0; t < TILE_PANELS; t++) {
        const int8_t *q = g->qpacked + ((p + t) * g->k + i0) * PANEL;
        float *dst = buf + t * SLICE * PANEL;
#if defined(__AVX512F__)
        for (int64_t j = 0; j < count * PANEL; j += 16)
            _mm512_store_ps(dst + j, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + j)))));
#elif defined(__AVX2__) && defined(__FMA__)
        for (int64_t j = 0; j < count * PANEL; j += 8)
            _mm256_store_ps(dst + j, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + j)))));
#else
        for (int64_t j = 0; j < count * PANEL; j++) dst[j] = q[j];
#endif
    }
}

/* Rows m0 .. m1 - 1 (at most ROW_CHUNK) for the panels from p, SLICE inputs at a time: each slice
 * of the tile's weights (TILE_WIDTH x SLICE floats, 24 KB) stays in L1 while every group of
 * MAX_ROWS rows passes over it. Without the slices each group read the whole tile (up to 295 KB for
 * a down projection) from L2 again: 26 rows of SmolLM2 ran at 60% of the FMA peak (AMD EPYC). */
#if defined(__AVX512F__) && defined(__AVX512BF16__) && LANES == 16
#define BF16_PAIRS 1
/* bf16 weights and rows dotted as they are (vdpbf16ps: two products per lane and instruction,
 * float32 sums): each 32-bit lane of a weight vector holds one output channel's weights for two
 * consecutive inputs, and each row's matching pair of inputs is broadcast. Twice float32's
 * multiply-adds per instruction, and no widening: the few-row products of a bf16 model, where
 * the widening GEMM is bound by its arithmetic past a few rows. */
static inline __attribute__((always_inline)) void pair_tile(const uint16_t *x, int64_t ldx, const uint32_t *w,
                                                            int64_t stride, int64_t count, const int rows,
                                                            float sums[MAX_ROWS][TILE_WIDTH]) {
    __m512 acc[MAX_ROWS][TILE_PANELS];
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < TILE_PANELS; t++) acc[r][t] = _mm512_setzero_ps();
    for (int64_t i = 0; i < count; i++) {
        __m512i wv[TILE_PANELS];
        for (int t = 0; t < TILE_PANELS; t++) wv[t] = _mm512_loadu_si512(w + t * stride + i * PANEL);
        for (int r = 0; r < rows; r++) {
            int32_t pair;
            memcpy(&pair, x + r * ldx + 2 * i, sizeof pair);
            __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
            for (int t = 0; t < TILE_PANELS; t++) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], xb, (__m512bh)wv[t]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < TILE_PANELS; t++)
            _mm512_storeu_ps(sums[r] + t * PANEL, _mm512_add_ps(_mm512_loadu_ps(sums[r] + t * PANEL), acc[r][t]));
}

static void pair_tile_rows(const uint16_t *x, int64_t ldx, const uint32_t *w, int64_t stride, int64_t count, int rows,
                           float sums[MAX_ROWS][TILE_WIDTH]) {
    switch (rows) {
        case 1: pair_tile(x, ldx, w, stride, count, 1, sums); break;
        case 2: pair_tile(x, ldx, w, stride, count, 2, sums); break;
        case 3: pair_tile(x, ldx, w, stride, count, 3, sums); break;
        case 4: pair_tile(x, ldx, w, stride, count, 4, sums); break;
        case 5: pair_tile(x, ldx, w, stride, count, 5, sums); break;
        case 6: pair_tile(x, ldx, w, stride, count, 6, sums); break;
        case 7: pair_tile(x, ldx, w, stride, count, 7, sums); break;
        case 8: pair_tile(x, ldx, w, stride, count, 8, sums); break;
        default: break;
    }
}

/* panel_rows for bf16 pairs: SLICE pairs of inputs at a time (the tile's 12 KB of weights stay in L1). */
static void pair_panel_rows(const Gemm *g, int64_t m0, int64_t m1, int64_t p) {
    float sums[ROW_CHUNK][TILE_WIDTH];
    memset(sums, 0, (size_t)(m1 - m0) * sizeof sums[0]);
    const int64_t half = g->k / 2;
    for (int64_t i0 = 0; i0 < half; i0 += SLICE) {
        const int64_t count = half - i0 < SLICE ? half - i0 : SLICE;
        const uint32_t *w = g->pairs + (p * half + i0) * PANEL;
        for (int64_t r = m0; r < m1; r += MAX_ROWS)
            pair_tile_rows(g->xb + r * g->k + 2 * i0, g->k, w, half * PANEL, count,
                           m1 - r < MAX_ROWS ? (int)(m1 - r) : MAX_ROWS, sums + (r - m0));
    }
    for (int64_t r = m0; r < m1; r += MAX_ROWS)
        store_tile(g, r, m1 - r < MAX_ROWS ? (int)(m1 - r) : MAX_ROWS, p, sums + (r - m0));
}
#endif

static void panel_rows(const Gemm *g, int64_t m0, int64_t m1, int64_t p) {
#if defined(BF16_PAIRS)
    if (g->pairs) {
        pair_panel_rows(g, m0, m1, p);
        return;
    }
#endif
    float buf[TILE_PANELS * SLICE * PANEL] __attribute__((aligned(64)));
    float sums[ROW_CHUNK][TILE_WIDTH];
    memset(sums, 0, (size_t)(m1 - m0) * sizeof sums[0]);
    for (int64_t i0 = 0; i0 < g->k; i0 += SLICE) {
        const int64_t count = g->k - i0 < SLICE ? g->k - i0 : SLICE;
        Slice s = {buf, NULL, SLICE * PANEL, count, g->k, NULL, m1 - m0 >= MANY_ROWS}; /* int8 weights: widened into buf */
        if (g->packed)
            s.w = g->packed + (p * g->k + i0) * PANEL, s.stride = g->k * PANEL;
        else if (g->bpacked)
            s.wb = g->bpacked + (p * g->k + i0) * PANEL, s.stride = g->k * PANEL;
        else
            widen(g, p, i0, count, buf);
        for (int64_t r = m0; r < m1; r += MAX_ROWS) {
            s.x = g->x + r * g->k + i0;
            tile_rows(&s, m1 - r < MAX_ROWS ? (int)(m1 - r) : MAX_ROWS, sums + (r - m0));
        }
    }
    for (int64_t r = m0; r < m1; r += MAX_ROWS)
        store_tile(g, r, m1 - r < MAX_ROWS ? (int)(m1 - r) : MAX_ROWS, p, sums + (r - m0));
}

static int run(const Gemm *g, int64_t m, int64_t n_padded) {
    const int64_t n = g->n, k = g->k;
    if (m < 0 || n <= 0 || k <= 0 || n_padded < n || n_padded % TILE_WIDTH) return -1;
    if (m == 0) return 0;
    int64_t tiles = n_padded / TILE_WIDTH, work = m * n_padded * k / WORK_PER_THREAD + 1;
    int threads = work < omp_get_max_threads() ? (int)work : omp_get_max_threads();
#pragma omp parallel num_threads(threads)
    for (int64_t m0 = 0; m0 < m; m0 += ROW_CHUNK) {
        int64_t m1 = m0 + ROW_CHUNK < m ? m0 + ROW_CHUNK : m;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) panel_rows(g, m0, m1, t * TILE_PANELS);
    }
    return 0;
}

/* out [m, n] = x [m, k] W^T + bias; 0, or -1 for shapes it does not take. */
int f32_gemm(const float *x, const float *packed, const float *bias, float *out, int64_t m, int64_t n,
             int64_t n_padded, int64_t k) {
    Gemm g = {.x = x, .packed = packed, .bias = bias, .out = out, .n = n, .k = k};
    return run(&g, m, n_padded);
}

/* The same with int8 weights: out = (x q^T) * scale + bias. */
int f32_gemm_int8w(const float *x, const int8_t *qpacked, const float *scale, const float *bias, float *out,
                   int64_t m, int64_t n, int64_t n_padded, int64_t k) {
    Gemm g = {.x = x, .scale = scale, .bias = bias, .qpacked = qpacked, .out = out, .n = n, .k = k};
    return run(&g, m, n_padded);
}

/* The same with bf16 weights (their bits, uint16): out = x W^T + bias in float32. */
int f32_gemm_bf16w(const float *x, const uint16_t *bpacked, const float *bias, float *out, int64_t m, int64_t n,
                   int64_t n_padded, int64_t k) {
    Gemm g = {.x = x, .bias = bias, .bpacked = bpacked, .out = out, .n = n, .k = k};
    return run(&g, m, n_padded);
}

int f32_gemm_widened(const float *x, WidenSlice widen, const void *weights, const float *bias, float *out, int64_t m,
                     int64_t n, int64_t n_padded, int64_t k) {
    Gemm g = {.x = x, .bias = bias, .widen_slice = widen, .weights = weights, .out = out, .n = n, .k = k};
    return run(&g, m, n_padded);
}

/* out [m, n] = x W^T + bias in float32 from bf16 x [m, k] and W packed in pairs along K,
 * [N_padded / PANEL][k / 2][PANEL] pairs; k even. 0, -1 for shapes it does not take, -2 where
 * this build has no bf16 dot products (then nothing is computed). */
int bf16_pairs_gemm(const uint16_t *x, const uint32_t *pairs, const float *bias, float *out, int64_t m, int64_t n,
                    int64_t n_padded, int64_t k) {
#if defined(BF16_PAIRS)
    if (k % 2) return -1;
    Gemm g = {.bias = bias, .pairs = pairs, .xb = x, .out = out, .n = n, .k = k};
    return run(&g, m, n_padded);
#else
    (void)x, (void)pairs, (void)bias, (void)out, (void)m, (void)n, (void)n_padded, (void)k;
    return -2;
#endif
}
