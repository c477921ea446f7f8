/* The w8a8 projection on CPU: out = x W^T + bias, W int8 with one scale per output channel, x
 * quantized here to int8 with one scale per row and block of QBLOCK input channels (dynamic, the
 * block's largest magnitude maps to 127), the products summed as int32 within a block and in
 * float32 across blocks. Per-block scales keep an outlier channel from flattening a whole row,
 * which per-token scales do; the int8 weights are a quarter of float32's bytes, what a decode
 * step pays for.
 *
 * Activations are stored as unsigned bytes q + 128, so that one AVX-512 VNNI instruction
 * (vpdpbusd: unsigned by signed bytes, 4 products into each int32 lane) sums them; the offset's
 * share, 128 times the block's sum of weights, is subtracted per block (`comp`, packed with the
 * weights). With AVX2 alone, vpmaddubsw multiplies unsigned by signed bytes into int16 pairs,
 * which saturate for q + 128: that path takes the activations back to signed bytes and multiplies
 * |x| by w carrying x's sign, at most 2 * 127 * 127 per pair. Elsewhere the same integer sums are
 * computed in plain C.
 *
 * Layouts: x, out [M, K] and [M, N] float32 (dtype 0) or bfloat16 (1); packed weights: panels of
 * PANEL output channels, each [K / 4][PANEL][4] bytes (the 4 consecutive input channels of one
 * output channel in one int32 lane); comp [panels][K / QBLOCK][PANEL] int32; scale [N_padded]
 * float32 (0 for padding channels); bias [N] float32 or NULL. N_padded is a multiple of
 * TILE_PANELS * PANEL; K a multiple of QBLOCK.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "common.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define VNNI 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define QBLOCK 64     /* input channels sharing one activation scale */
#define PANEL 16      /* output channels of one packed panel: one vector of int32 sums */
#define TILE_PANELS 4 /* panels a tile computes, sharing each activation broadcast */
#define MAX_ROWS 6    /* rows a tile steps together, sharing each weight vector: 4 x 6 sums in registers */
/* (4 panels rather than 2: 0.88-0.93x the time of Qwen 0.5B's 96 projections at 1, 8 and 34
 * rows) */
/* Multiply-adds worth another thread. With weights cold from memory, as in a forward pass, a
 * second thread pays even for one row: it streams weights too. SmolLM2's 121 projections at one
 * row took 10.0 ms with both threads from 64k multiply-adds, 13.7 ms from 1M and 15.8 ms from 32M
 * (`spanserve bench projections`, threads spinning between calls). Below this, a
 * call is too small for a thread's start. */
#define WORK_PER_THREAD (1 << 18)

typedef struct {
    const uint8_t *xq;    /* [M][K] */
    const float *xs;      /* [M][K / QBLOCK] */
    const int8_t *packed; /* panels */
    const int32_t *comp;  /* [panels][blocks][PANEL] */
    const float *scale, *bias;
    void *out;
    int64_t n, k;
    int dtype;
} Gemm;

/* Row m of x as unsigned bytes and its block scales. */
static void quantize_row(const void *x, int dtype, int64_t m, int64_t k, uint8_t *xq, float *xs) {
    float row[QBLOCK];
    for (int64_t b = 0; b < k / QBLOCK; b++) {
        load_floats(x, m * k + b * QBLOCK, QBLOCK, dtype, row);
        float top = 0.0f;
        for (int i = 0; i < QBLOCK; i++) top = fmaxf(top, fabsf(row[i]));
        float inv = top > 0.0f ? 127.0f / top : 0.0f;
        xs[m * (k / QBLOCK) + b] = top / 127.0f;
        for (int i = 0; i < QBLOCK; i++) {
            float q = nearbyintf(row[i] * inv);
            q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
            xq[m * k + b * QBLOCK + i] = (uint8_t)((int)q + 128);
        }
    }
}

/* Rows m0 .. m0 + rows - 1 of out, channels of panel p .. p + TILE_PANELS - 1, from float sums. */
static void store_tile(const Gemm *g, int64_t m0, int rows, int64_t p, float sums[MAX_ROWS][TILE_PANELS * PANEL]) {
    for (int r = 0; r < rows; r++) {
        float row[TILE_PANELS * PANEL];
        int64_t first = p * PANEL, count = g->n - first < TILE_PANELS * PANEL ? g->n - first : TILE_PANELS * PANEL;
        if (count <= 0) return; /* padding channels only */
        for (int64_t c = 0; c < count; c++)
            row[c] = sums[r][c] * g->scale[first + c] + (g->bias ? g->bias[first + c] : 0.0f);
        store_floats(g->out, (m0 + r) * g->n + first, (int)count, g->dtype, row);
    }
}

#ifdef VNNI
/* One tile: `rows` rows by TILE_PANELS panels, over every block of K. */
static inline __attribute__((always_inline)) void tile(const Gemm *g, int64_t m0, const int rows, int64_t p) {
    const int64_t k = g->k, blocks = k / QBLOCK;
    __m512 acc[MAX_ROWS][TILE_PANELS];
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < TILE_PANELS; t++) acc[r][t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512i sums[MAX_ROWS][TILE_PANELS];
        for (int r = 0; r < rows; r++)
            for (int t = 0; t < TILE_PANELS; t++) sums[r][t] = _mm512_setzero_si512();
#pragma GCC unroll 16
        for (int q = 0; q < QBLOCK / 4; q++) {
            __m512i w[TILE_PANELS];
            for (int t = 0; t < TILE_PANELS; t++)
                w[t] = _mm512_loadu_si512(g->packed + ((p + t) * (k / 4) + b * (QBLOCK / 4) + q) * PANEL * 4);
            for (int r = 0; r < rows; r++) {
                int32_t four;
                memcpy(&four, g->xq + (m0 + r) * k + b * QBLOCK + q * 4, 4);
                __m512i x = _mm512_set1_epi32(four);
                for (int t = 0; t < TILE_PANELS; t++) sums[r][t] = _mm512_dpbusd_epi32(sums[r][t], x, w[t]);
            }
        }
        for (int t = 0; t < TILE_PANELS; t++) {
            __m512i comp = _mm512_loadu_si512(g->comp + ((p + t) * blocks + b) * PANEL);
            for (int r = 0; r < rows; r++) {
                __m512 s = _mm512_set1_ps(g->xs[(m0 + r) * blocks + b]);
                acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sums[r][t], comp)), s, acc[r][t]);
            }
        }
    }
    float out[MAX_ROWS][TILE_PANELS * PANEL];
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < TILE_PANELS; t++) _mm512_storeu_ps(out[r] + t * PANEL, acc[r][t]);
    store_tile(g, m0, rows, p, out);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* The same with AVX2 (see the top): a row at a time, its 8 vectors of int32 sums (TILE_PANELS
 * panels, two halves each) in registers, the tile's block of weights (4 KB) read from L1 again
 * for each row. The signed product needs no offset taken back: comp is unused. */
static inline __attribute__((always_inline)) void tile(const Gemm *g, int64_t m0, const int rows, int64_t p) {
    const int64_t k = g->k, blocks = k / QBLOCK;
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
    float acc[MAX_ROWS][TILE_PANELS * PANEL] = {{0}};
    for (int64_t b = 0; b < blocks; b++)
        for (int r = 0; r < rows; r++) {
            const uint8_t *xr = g->xq + (m0 + r) * k + b * QBLOCK;
            __m256i sums[2 * TILE_PANELS];
            for (int v = 0; v < 2 * TILE_PANELS; v++) sums[v] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int q = 0; q < QBLOCK / 4; q++) {
                int32_t four;
                memcpy(&four, xr + q * 4, 4);
                __m256i x = _mm256_xor_si256(_mm256_set1_epi32(four), flip), magnitude = _mm256_sign_epi8(x, x);
                for (int v = 0; v < 2 * TILE_PANELS; v++) {
                    const int8_t *w = g->packed + ((p + v / 2) * (k / 4) + b * (QBLOCK / 4) + q) * PANEL * 4 + (v % 2) * 32;
                    __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)w), x));
                    sums[v] = _mm256_add_epi32(sums[v], _mm256_madd_epi16(pairs, ones));
                }
            }
            __m256 s = _mm256_set1_ps(g->xs[(m0 + r) * blocks + b]);
            for (int v = 0; v < 2 * TILE_PANELS; v++)
                _mm256_storeu_ps(acc[r] + v * 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[v]), s, _mm256_loadu_ps(acc[r] + v * 8)));
        }
    store_tile(g, m0, rows, p, acc);
}
#else
/* The same sums in plain C, for CPUs with neither. */
static inline void tile(const Gemm *g, int64_t m0, const int rows, int64_t p) {
    const int64_t k = g->k, blocks = k / QBLOCK;
    float acc[MAX_ROWS][TILE_PANELS * PANEL] = {{0}};
    for (int64_t b = 0; b < blocks; b++) {
        for (int r = 0; r < rows; r++) {
            const uint8_t *x = g->xq + (m0 + r) * k + b * QBLOCK;
            float s = g->xs[(m0 + r) * blocks + b];
            for (int c = 0; c < TILE_PANELS * PANEL; c++) {
                int64_t panel = p + c / PANEL, lane = c % PANEL;
                int32_t sum = 0;
                for (int q = 0; q < QBLOCK / 4; q++)
                    for (int j = 0; j < 4; j++)
                        sum += (int32_t)x[q * 4 + j] *
                               g->packed[((panel * (k / 4) + b * (QBLOCK / 4) + q) * PANEL + lane) * 4 + j];
                acc[r][c] = fmaf((float)(sum - g->comp[(panel * blocks + b) * PANEL + lane]), s, acc[r][c]);
            }
        }
    }
    store_tile(g, m0, rows, p, acc);
}
#endif

/* All rows for the panels from p: rows in steps of MAX_ROWS, each count compiled on its own. */
static void panel_column(const Gemm *g, int64_t m, int64_t p) {
    int64_t m0 = 0;
    for (; m0 + MAX_ROWS <= m; m0 += MAX_ROWS) tile(g, m0, MAX_ROWS, p);
    switch (m - m0) {
        case 1: tile(g, m0, 1, p); break;
        case 2: tile(g, m0, 2, p); break;
        case 3: tile(g, m0, 3, p); break;
        case 4: tile(g, m0, 4, p); break;
        case 5: tile(g, m0, 5, p); break;
        default: break;
    }
}

/* out [m, n] = x [m, k] W^T; 0, or -1 for shapes it does not take, -3 out of memory. */
int int8_gemm(const void *x, const int8_t *packed, const int32_t *comp, const float *scale, const float *bias,
              void *out, int64_t m, int64_t n, int64_t n_padded, int64_t k, int dtype) {
    if (m < 0 || n <= 0 || k <= 0 || k % QBLOCK || n_padded < n || n_padded % (TILE_PANELS * PANEL) ||
        (dtype != 0 && dtype != 1))
        return -1;
    if (m == 0) return 0;
    uint8_t *xq = malloc(m * k);
    float *xs = malloc(m * (k / QBLOCK) * sizeof(float));
    if (xq == NULL || xs == NULL) {
        free(xq);
        free(xs);
        return -3;
    }
    Gemm g = {xq, xs, packed, comp, scale, bias, out, n, k, dtype};
    int64_t tiles = n_padded / (TILE_PANELS * PANEL), work = m * n_padded * k / WORK_PER_THREAD + 1;
    int threads = work < omp_get_max_threads() ? (int)work : omp_get_max_threads();
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) quantize_row(x, dtype, r, k, xq, xs);
        /* a tile's weights (k x 32 bytes) stay in cache while every row passes over them */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) panel_column(&g, m, t * TILE_PANELS);
    }
    free(xq);
    free(xs);
    return 0;
}
