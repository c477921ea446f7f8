/* The float32 projection on CPU: out = x W^T + bias, W packed once into panels of PANEL output
 * channels, [panels][K][PANEL], so that a step over K reads one vector of each panel and every row
 * of x multiplies it by a broadcast. A decode step of a small model is its weight bytes: MKL's
 * GEMM read SmolLM2's float32 weights at 6-10 GB/s for 8 rows (input-major or not), this layout
 * streams them in order, each weight read once for up to MAX_ROWS rows.
 *
 * Layouts: x [M, K] and out [M, N] float32; packed [N_padded / PANEL][K][PANEL] float32 (zeros for
 * the padding channels); bias [N] float32 or NULL. N_padded is a multiple of TILE_PANELS * PANEL.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define PANEL 16      /* output channels of a panel: one vector */
#define TILE_PANELS 3 /* panels a tile computes, sharing each broadcast of x */
#define MAX_ROWS 8    /* rows a tile steps together, sharing each weight vector: 8 x 3 sums in registers */
/* Rows whose tiles run before the next rows start: their x (ROW_CHUNK x K floats) stays in cache
 * while every tile of weights passes over it. */
#define ROW_CHUNK 192
#define WORK_PER_THREAD (1 << 18) /* multiply-adds worth another thread (as in int8_gemm.c) */

typedef struct {
    const float *x, *packed, *bias;
    float *out;
    int64_t n, k;
} Gemm;

static void store_tile(const Gemm *g, int64_t m0, int rows, int64_t p, float sums[MAX_ROWS][TILE_PANELS * PANEL]) {
    int64_t first = p * PANEL, count = g->n - first < TILE_PANELS * PANEL ? g->n - first : TILE_PANELS * PANEL;
    if (count <= 0) return; /* padding channels only */
    for (int r = 0; r < rows; r++) {
        float *out = g->out + (m0 + r) * g->n + first;
        for (int64_t c = 0; c < count; c++) out[c] = sums[r][c] + (g->bias ? g->bias[first + c] : 0.0f);
    }
}

#ifdef __AVX512F__
/* One tile: `rows` rows from m0 by the TILE_PANELS panels from p, over all of K. */
static inline __attribute__((always_inline)) void tile(const Gemm *g, int64_t m0, const int rows, int64_t p) {
    const int64_t k = g->k;
    const float *w0 = g->packed + p * k * PANEL, *x = g->x + m0 * k;
    __m512 acc[MAX_ROWS][TILE_PANELS];
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < TILE_PANELS; t++) acc[r][t] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i++) {
        __m512 w[TILE_PANELS];
        for (int t = 0; t < TILE_PANELS; t++) w[t] = _mm512_loadu_ps(w0 + (t * k + i) * PANEL);
        for (int r = 0; r < rows; r++) {
            __m512 xb = _mm512_set1_ps(x[r * k + i]);
            for (int t = 0; t < TILE_PANELS; t++) acc[r][t] = _mm512_fmadd_ps(xb, w[t], acc[r][t]);
        }
    }
    float sums[MAX_ROWS][TILE_PANELS * PANEL];
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < TILE_PANELS; t++) _mm512_storeu_ps(sums[r] + t * PANEL, acc[r][t]);
    store_tile(g, m0, rows, p, sums);
}
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2: a panel is two 8-float registers, so one row's sums take 6 of the 16; rows go two at a
 * time (12 sums, the broadcasts and the weights as memory operands), each pair passing over the
 * tile's weights again, from cache. The plain C below kept its sums in memory: 8 rows ran at
 * about 12% of the two cores' FMA peak on an AMD EPYC. */
static inline __attribute__((always_inline)) void tile(const Gemm *g, int64_t m0, const int rows, int64_t p) {
    const int64_t k = g->k;
    const float *w0 = g->packed + p * k * PANEL, *x = g->x + m0 * k;
    float sums[MAX_ROWS][TILE_PANELS * PANEL];
#pragma GCC unroll 4
    for (int r0 = 0; r0 < rows; r0 += 2) {
        const int pair = rows - r0 < 2 ? 1 : 2;
        __m256 acc[2][2 * TILE_PANELS];
        for (int r = 0; r < pair; r++)
            for (int v = 0; v < 2 * TILE_PANELS; v++) acc[r][v] = _mm256_setzero_ps();
        for (int64_t i = 0; i < k; i++)
            for (int r = 0; r < pair; r++) {
                __m256 xb = _mm256_broadcast_ss(x + (r0 + r) * k + i);
                for (int t = 0; t < TILE_PANELS; t++) {
                    const float *w = w0 + (t * k + i) * PANEL;
                    acc[r][2 * t] = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w), acc[r][2 * t]);
                    acc[r][2 * t + 1] = _mm256_fmadd_ps(xb, _mm256_loadu_ps(w + 8), acc[r][2 * t + 1]);
                }
            }
        for (int r = 0; r < pair; r++)
            for (int v = 0; v < 2 * TILE_PANELS; v++) _mm256_storeu_ps(sums[r0 + r] + v * 8, acc[r][v]);
    }
    store_tile(g, m0, rows, p, sums);
}
#else
/* The same sums in plain C, for CPUs with neither AVX-512 nor AVX2. */
static inline void tile(const Gemm *g, int64_t m0, const int rows, int64_t p) {
    const int64_t k = g->k;
    const float *w0 = g->packed + p * k * PANEL, *x = g->x + m0 * k;
    float sums[MAX_ROWS][TILE_PANELS * PANEL];
    memset(sums, 0, sizeof(sums));
    for (int64_t i = 0; i < k; i++)
        for (int r = 0; r < rows; r++)
            for (int t = 0; t < TILE_PANELS; t++)
                for (int c = 0; c < PANEL; c++) sums[r][t * PANEL + c] += x[r * k + i] * w0[(t * k + i) * PANEL + c];
    store_tile(g, m0, rows, p, sums);
}
#endif

/* Rows m0 .. m1 - 1 for the panels from p: MAX_ROWS at a time, each remainder compiled on its own. */
static void panel_rows(const Gemm *g, int64_t m0, int64_t m1, int64_t p) {
    for (; m0 + MAX_ROWS <= m1; m0 += MAX_ROWS) tile(g, m0, MAX_ROWS, p);
    switch (m1 - m0) {
        case 1: tile(g, m0, 1, p); break;
        case 2: tile(g, m0, 2, p); break;
        case 3: tile(g, m0, 3, p); break;
        case 4: tile(g, m0, 4, p); break;
        case 5: tile(g, m0, 5, p); break;
        case 6: tile(g, m0, 6, p); break;
        case 7: tile(g, m0, 7, p); break;
        default: break;
    }
}

/* out [m, n] = x [m, k] W^T + bias; 0, or -1 for shapes it does not take. */
int f32_gemm(const float *x, const float *packed, const float *bias, float *out, int64_t m, int64_t n,
             int64_t n_padded, int64_t k) {
    if (m < 0 || n <= 0 || k <= 0 || n_padded < n || n_padded % (TILE_PANELS * PANEL)) return -1;
    if (m == 0) return 0;
    Gemm g = {x, packed, bias, out, n, k};
    int64_t tiles = n_padded / (TILE_PANELS * PANEL), work = m * n_padded * k / WORK_PER_THREAD + 1;
    int threads = work < omp_get_max_threads() ? (int)work : omp_get_max_threads();
#pragma omp parallel num_threads(threads)
    for (int64_t m0 = 0; m0 < m; m0 += ROW_CHUNK) {
        int64_t m1 = m0 + ROW_CHUNK < m ? m0 + ROW_CHUNK : m;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) panel_rows(&g, m0, m1, t * TILE_PANELS);
    }
    return 0;
}
