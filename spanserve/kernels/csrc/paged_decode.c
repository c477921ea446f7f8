/* Decode attention over a paged KV cache on CPU: one query token per sequence attends to its
 * whole context, reading the cache blocks where they are (no gather, no padding).
 *
 * Decode attention is bound by reading the cache from memory, so the work is cut the way the
 * cache is laid out: a task is one chunk of a sequence's blocks with every KV head, reading
 * each block as the contiguous run it is. Its query heads keep an online softmax in float32
 * (running max, sum and weighted values); a second pass merges the chunks of each sequence
 * (flash decoding), so one long sequence still feeds every thread. Tasks run on the OpenMP
 * threads torch uses (the same libgomp).
 *
 * Layouts (contiguous): q, out [B, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D];
 * block_tables [B, max_blocks] int64; context_lens [B] int64. dtype (of q and out) and kv_dtype (of
 * the cache, which may be narrower: bf16 keys for a float32 model): 0 float32, 1 bfloat16.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "fused_kernels.h"
#include "team.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && LANES == 16 /* its sums are 16-lane vf */
#include <immintrin.h>
#define BF16_DOT 1 /* bf16 keys dotted as they are stored: vdpbf16ps, float32 sums */
#endif

#define CHUNK_BLOCKS 16 /* blocks per task */
/* Whether bf16 queries over a bf16 cache take BF16_DOT (else the lanes path, converting each block):
 * set_bf16_dot, from a measurement per CPU (kernels/calibration.py; on an AMD EPYC Zen 4 it chose
 * the lanes path, `spanserve bench step --dtype bfloat16` prints the choice). */
static int bf16_dot_on = 1;
#if defined(BF16_DOT)
#define BF16_PATH(a) (bf16_dot_on && (a)->dtype == 1 && (a)->kv_dtype == 1 && (a)->dim % 32 == 0)
#else
#define BF16_PATH(a) 0
#endif

/* Turn BF16_DOT on or off; whether this build has it (0: the setting changes nothing). */
int set_bf16_dot(int on) {
    bf16_dot_on = on != 0;
#if defined(BF16_DOT)
    return 1;
#else
    return 0;
#endif
}

typedef struct {
    const void *q, *k_cache, *v_cache;
    void *out;
    const int64_t *block_tables, *context_lens;
    int64_t max_blocks;
    int heads, kv_heads, dim, block_size, dtype, kv_dtype; /* of q and out; of the cache */
    float scale;
} Args;

typedef struct { /* one thread's scratch */
    float *query, *key, *value, *weight;
    vf *sums; /* [heads][dim / LANES]: the weighted values of the lanes path */
} Scratch;

/* Keys over LANES (chunk_lanes): dim a multiple of LANES, at most MAX_HEADS query heads, and the
 * cache not read as bf16 by BF16_DOT. */
#define MAX_HEADS 128
#define LANES_PATH(a) ((a)->dim % LANES == 0 && (a)->heads <= MAX_HEADS && !BF16_PATH(a))

/* The next block's keys and values are prefetched a few lines at each step of the block in hand, so
 * that their misses are in flight while the block's sums are computed. A block's prefetches all issued at
 * its start filled the core's miss buffers: the instructions after them waited for memory, the
 * compute and the reads did not overlap, and decode attention read 14.5 GB/s where a plain sum
 * reads 30 (AMD EPYC, 2 cores). Spread over the key groups and value passes, 0.55-0.6x the time
 * (8 sequences of 1,024 keys, 30 layers, float32; 0.54x for one of 2,048). Into L2 rather than L1:
 * with the block being read they are 48 KB of float32 (SmolLM2's 3 KV heads of 64, 16 tokens),
 * past a 32 KB L1, and prefetches into L1 evicted the keys in use. */
typedef struct {
    const char *keys, *values; /* the next block's */
    size_t next, bytes, step;  /* the next line's offset, the block's bytes, bytes a step */
} Prefetch;

/* Start on `block`'s lines, spread over `steps` steps. */
static inline void prefetch_start(const Args *a, Prefetch *p, int64_t block, int steps) {
    p->bytes = (size_t)a->block_size * a->kv_heads * a->dim * (a->kv_dtype == 0 ? 4 : 2);
    p->keys = (const char *)a->k_cache + block * p->bytes;
    p->values = (const char *)a->v_cache + block * p->bytes;
    p->next = 0;
    p->step = ((p->bytes + 63) / 64 + steps - 1) / steps * 64;
}

static inline void prefetch_none(Prefetch *p) { p->next = p->bytes = p->step = 0; }

/* One step's lines of the block's keys and values. */
static inline void prefetch_step(Prefetch *p) {
    size_t end = p->next + p->step < p->bytes ? p->next + p->step : p->bytes;
    for (; p->next < end; p->next += 64) {
        __builtin_prefetch(p->keys + p->next, 0, 2);
        __builtin_prefetch(p->values + p->next, 0, 2);
    }
}

#if defined(BF16_DOT)
/* Scaled scores of query head h (bf16, `query`) against the n <= 16 bf16 keys of one KV head from
 * `keys` (a row of `stride` values per token), into scores[0..n). */
static inline void bf16_scores(const uint16_t *query, const uint16_t *keys, int64_t stride, int n, int dim,
                               float scale, float *scores) {
    vf partial[LANES];
    for (int t = 0; t < LANES; t++) {
        __m512 acc = _mm512_setzero_ps();
        if (t < n)
            for (int d = 0; d < dim; d += 32)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(query + d),
                                       (__m512bh)_mm512_loadu_si512(keys + t * stride + d));
        partial[t] = (vf)acc;
    }
    vf all = sum_lanes(partial) * scale;
    memcpy(scores, &all, n * sizeof(float));
}
#endif

/* Query head h's scaled scores against the n keys of `block` into weight[0..n), and their max.
 * bf16 keys are read as stored where the CPU dots bf16; otherwise from s->key, converted. */
static float head_scores(const Args *a, const Scratch *s, int64_t seq, int64_t block, int h, int n, float *weight) {
    int dim = a->dim, row = a->kv_heads * dim, kv_head = h / (a->heads / a->kv_heads);
#if defined(BF16_DOT)
    if (BF16_PATH(a)) {
        const uint16_t *keys = (const uint16_t *)a->k_cache + block * a->block_size * row + kv_head * dim;
        const uint16_t *query = (const uint16_t *)a->q + (seq * a->heads + h) * dim;
        for (int t = 0; t < n; t += 16)
            bf16_scores(query, keys + (int64_t)t * row, row, n - t < 16 ? n - t : 16, dim, a->scale, weight + t);
    } else
#endif
    {
        const float *query = s->query + h * dim;  /* scaled already */
        for (int t = 0; t < n; t++) {
            const float *key = s->key + t * row + kv_head * dim;
            float score = 0.0f;
#pragma omp simd reduction(+ : score)
            for (int d = 0; d < dim; d++) score += query[d] * key[d];
            weight[t] = score;
        }
    }
    float top = -FLT_MAX;
    for (int t = 0; t < n; t++) top = weight[t] > top ? weight[t] : top;
    return top;
}

/* Keys [start, end) of sequence `seq` (whole blocks but the last), every query head. state:
 * [heads][dim + 2] = weighted values, running max, running sum. */
static void chunk(const Args *a, Scratch *s, int64_t seq, int64_t start, int64_t end, float *state) {
    int heads = a->heads, dim = a->dim, bs = a->block_size, row = a->kv_heads * dim;
    int groups = heads / a->kv_heads, width = dim + 2, converts = !BF16_PATH(a);
    const int64_t *table = a->block_tables + seq * a->max_blocks;
    if (converts) {  /* the queries as scaled float32 rows */
        load_floats(a->q, seq * heads * dim, heads * dim, a->dtype, s->query);
        for (int i = 0; i < heads * dim; i++) s->query[i] *= a->scale;
    }
    for (int h = 0; h < heads; h++) {
        float *st = state + h * width;
        for (int d = 0; d < dim; d++) st[d] = 0.0f;
        st[dim] = -FLT_MAX;
        st[dim + 1] = 0.0f;
    }
    Prefetch ahead;
    for (int64_t first = start; first < end; first += bs) {
        int64_t block = table[first / bs];
        int n = end - first < bs ? (int)(end - first) : bs;
        if (first + bs < end) prefetch_start(a, &ahead, table[first / bs + 1], heads + bs);
        else prefetch_none(&ahead);
        if (converts) load_floats(a->k_cache, block * bs * row, n * row, a->kv_dtype, s->key); /* [n][kv_heads][dim] */
        for (int h = 0; h < heads; h++) {
            prefetch_step(&ahead);
            float *weight = s->weight + h * bs, *st = state + h * width;
            float top = head_scores(a, s, seq, block, h, n, weight);
            if (top > st[dim]) { /* a new maximum: rescale what came before */
                float rescale = expf(st[dim] - top);
                st[dim + 1] *= rescale;
                for (int d = 0; d < dim; d++) st[d] *= rescale;
                st[dim] = top;
            }
            for (int t = 0; t < n; t++) {
                weight[t] = expf(weight[t] - st[dim]);
                st[dim + 1] += weight[t];
            }
        }
        load_floats(a->v_cache, block * bs * row, n * row, a->kv_dtype, s->value);
        for (int t = 0; t < n; t++) {
            prefetch_step(&ahead);
            for (int h = 0; h < heads; h++) {
                const float *value = s->value + t * row + (h / groups) * dim;
                float w = s->weight[h * bs + t], *acc = state + h * width;
                for (int d = 0; d < dim; d++) acc[d] += w * value[d];
            }
        }
    }
}

/* Lazy rescaling (RESCALE_SLACK, common.h): a head's softmax is taken relative to a reference above
 * the largest score it has seen when it last moved, so most blocks skip the max over lanes and the
 * rescale. */

/* Query head h's online softmax over one block: scores of its scaled query `q` (chunks vectors)
 * against n keys (rows `stride` floats apart), LANES at a time, their weights into weight[0 ..
 * n / LANES], and the reference `max`, the sums of the weights (a vector, reduced once at the
 * end) and the weighted values `sums` rescaled where a score passes the reference. Inlined with
 * `chunks` a constant where the head size is a common one, so every loop over it unrolls. */
static inline __attribute__((always_inline)) void block_weights(const vf *q, const float *keys, int64_t stride, int n,
                                                                int chunks, float *max, vf *sum, vf *sums, vf *weight,
                                                                Prefetch *ahead) {
    vf top = splat(MASKED);
    for (int g = 0; g * LANES < n; g++) {
        prefetch_step(ahead);
        const int m = n - g * LANES < LANES ? n - g * LANES : LANES;
        const float *group = keys + (int64_t)g * LANES * stride;
        vf partial[LANES];
#pragma GCC unroll 16
        for (int t = 0; t < LANES; t++) { /* keys past m read the first one again, then are masked */
            const float *key = group + (t < m ? t : 0) * stride;
            vf acc = q[0] * load_vf(key);
            for (int c = 1; c < chunks; c++) acc += q[c] * load_vf(key + c * LANES);
            partial[t] = acc;
        }
        vf scores = sum_lanes(partial);
        if (m < LANES) scores = pick(lane_ids() < m, scores, splat(MASKED));
        weight[g] = scores;
        top = vmax(top, scores);
    }
    if (any_lane(top > splat(*max))) { /* past the reference: a new one, and what came before rescaled */
        float new_max = hmax(top) + RESCALE_SLACK, rescale = expf(*max - new_max);
        *sum *= rescale;
        for (int c = 0; c < chunks; c++) sums[c] *= rescale;
        *max = new_max;
    }
    for (int g = 0; g * LANES < n; g++) {
        weight[g] = vexp(weight[g] - *max);
        *sum += weight[g];
    }
}

/* The weighted values of n keys (value rows `stride` floats apart) added to the sums of `heads`
 * query heads (their weights `wstride` floats apart, their sums `chunks` vectors apart), for the
 * `width` vectors of the head size from c0: each value vector is loaded once for all of them, and
 * their sums stay in registers over the keys, heads x width independent chains. */
static inline __attribute__((always_inline)) void weigh_values(const float *values, int64_t stride, int n, int chunks,
                                                               int c0, int width, int heads, const float *weights,
                                                               int wstride, vf *sums) {
    vf acc[heads][width];
    for (int h = 0; h < heads; h++)
        for (int c = 0; c < width; c++) acc[h][c] = sums[h * chunks + c0 + c];
    for (int t = 0; t < n; t++)
        for (int c = 0; c < width; c++) {
            vf value = in_register(load_vf(values + t * stride + (c0 + c) * LANES));
            for (int h = 0; h < heads; h++) acc[h][c] += weights[h * wstride + t] * value;
        }
    for (int h = 0; h < heads; h++)
        for (int c = 0; c < width; c++) sums[h * chunks + c0 + c] = acc[h][c];
}

/* Sums kept in registers at once: 24 of AVX-512's 32. AVX2 has 16: 3 heads x 8 vectors (a head
 * size of 64) spilled every sum to the stack, and decode attention ran at 6.7 GB/s (B=1, 2,048
 * keys, AMD EPYC); so there the head size is taken 4 vectors at a time. */
#if LANES == 16
#define SUM_WIDTH 8
#else
#define SUM_WIDTH 4
#endif

/* weigh_values for `heads` query heads, SUM_WIDTH vectors of the head size at a time. */
static inline __attribute__((always_inline)) void weigh_heads(const float *values, int64_t stride, int n, int chunks,
                                                              int heads, const float *weights, int wstride, vf *sums,
                                                              Prefetch *ahead) {
    int c0 = 0;
    for (; c0 + SUM_WIDTH <= chunks; c0 += SUM_WIDTH) {
        prefetch_step(ahead);
        weigh_values(values, stride, n, chunks, c0, SUM_WIDTH, heads, weights, wstride, sums);
    }
    if (c0 < chunks) {
        prefetch_step(ahead);
        weigh_values(values, stride, n, chunks, c0, chunks - c0, heads, weights, wstride, sums);
    }
}

/* weigh_heads for the `heads` query heads of one KV head, up to 3 at a time. */
static inline __attribute__((always_inline)) void weigh_group(const float *values, int64_t stride, int n, int chunks,
                                                              int heads, const float *weights, int wstride, vf *sums,
                                                              Prefetch *ahead) {
    int h = 0;
    for (; h + 3 <= heads; h += 3)
        weigh_heads(values, stride, n, chunks, 3, weights + h * wstride, wstride, sums + h * chunks, ahead);
    if (heads - h == 2) weigh_heads(values, stride, n, chunks, 2, weights + h * wstride, wstride, sums + h * chunks, ahead);
    if (heads - h == 1) weigh_heads(values, stride, n, chunks, 1, weights + h * wstride, wstride, sums + h * chunks, ahead);
}

/* The prefetch steps of one block in lanes_path: each head's key groups, then each KV head's
 * passes over the values (weigh_group's calls of weigh_values). */
static int block_steps(const Args *a, int chunks) {
    int groups = a->heads / a->kv_heads, key_groups = (a->block_size + LANES - 1) / LANES;
    int value_passes = (groups + 2) / 3 * ((chunks + SUM_WIDTH - 1) / SUM_WIDTH);
    return a->kv_heads * (groups * key_groups + value_passes);
}

/* chunk() where LANES_PATH holds: a block at a time, its scores as vectors over LANES keys (a
 * lane-sum tree per group), vector exponentials, values weighed a KV head's query heads together
 * with their sums in registers. float32 caches are read in place, bf16 ones converted a block at a
 * time. The next block is prefetched as this one is computed (Prefetch): its pages are elsewhere
 * in memory, where the hardware's prefetcher would start on each only at its first miss. */
static inline __attribute__((always_inline)) void lanes_path(const Args *a, Scratch *s, int64_t seq, int64_t start,
                                                             int64_t end, float *state, int chunks) {
    int heads = a->heads, dim = a->dim, bs = a->block_size, row = a->kv_heads * dim;
    int groups = heads / a->kv_heads, width = dim + 2, in_place = a->kv_dtype == 0;
    const int64_t *table = a->block_tables + seq * a->max_blocks;
    const int per_head = (bs + LANES - 1) / LANES; /* weight vectors of a head in a block */
    vf *q = (vf *)s->query, *sums = s->sums, *weights = (vf *)s->weight, sum[MAX_HEADS];
    float max[MAX_HEADS];
    load_floats(a->q, seq * heads * dim, heads * dim, a->dtype, s->query);
    for (int i = 0; i < heads * chunks; i++) {
        q[i] *= a->scale;
        sums[i] = splat(0.0f);
    }
    for (int h = 0; h < heads; h++) max[h] = NO_MAX, sum[h] = splat(0.0f);
    const int steps = block_steps(a, chunks);
    Prefetch ahead;
    for (int64_t first = start; first < end; first += bs) {
        int64_t block = table[first / bs];
        int n = end - first < bs ? (int)(end - first) : bs;
        if (first + bs < end) prefetch_start(a, &ahead, table[first / bs + 1], steps);
        else prefetch_none(&ahead);
        const float *keys = (const float *)a->k_cache + block * bs * row, *values = (const float *)a->v_cache + block * bs * row;
        if (!in_place) {
            load_floats(a->k_cache, block * bs * row, n * row, a->kv_dtype, s->key);
            load_floats(a->v_cache, block * bs * row, n * row, a->kv_dtype, s->value);
            keys = s->key, values = s->value;
        }
        for (int kv = 0; kv < a->kv_heads; kv++) { /* a whole block: one max and one pass of values */
            for (int h = kv * groups; h < (kv + 1) * groups; h++)
                block_weights(q + h * chunks, keys + kv * dim, row, n, chunks, max + h, sum + h, sums + h * chunks,
                              weights + h * per_head, &ahead);
            weigh_group(values + kv * dim, row, n, chunks, groups, (const float *)(weights + kv * groups * per_head),
                        per_head * LANES, sums + kv * groups * chunks, &ahead);
        }
    }
    for (int h = 0; h < heads; h++) {
        memcpy(state + h * width, sums + h * chunks, dim * sizeof(float));
        state[h * width + dim] = max[h];
        state[h * width + dim + 1] = hsum(sum[h]);
    }
}

/* lanes_path with the head size known to the compiler for the common ones. */
static void chunk_lanes(const Args *a, Scratch *s, int64_t seq, int64_t start, int64_t end, float *state) {
    switch (a->dim) {
    case 64: lanes_path(a, s, seq, start, end, state, 64 / LANES); break;
    case 128: lanes_path(a, s, seq, start, end, state, 128 / LANES); break;
    default: lanes_path(a, s, seq, start, end, state, a->dim / LANES);
    }
}

/* Merge sequence `seq`'s chunk states into its output rows. */
static void merge(const Args *a, int64_t seq, const float *states, int64_t num_chunks) {
    int dim = a->dim, width = dim + 2;
    for (int h = 0; h < a->heads; h++) {
        float top = -FLT_MAX, total = 0.0f, acc[512];
        for (int64_t c = 0; c < num_chunks; c++) {
            float m = states[(c * a->heads + h) * width + dim];
            top = m > top ? m : top;
        }
        for (int d = 0; d < dim; d++) acc[d] = 0.0f;
        for (int64_t c = 0; c < num_chunks; c++) {
            const float *st = states + (c * a->heads + h) * width;
            float factor = expf(st[dim] - top);
            total += st[dim + 1] * factor;
            for (int d = 0; d < dim; d++) acc[d] += st[d] * factor;
        }
        for (int d = 0; d < dim; d++) acc[d] = total > 0.0f ? acc[d] / total : 0.0f;
        store_floats(a->out, (seq * a->heads + h) * dim, dim, a->dtype, acc);
    }
}

/* The first chunk of each sequence and one past the last [num_seqs + 1], NULL with *status -2 for a
 * context length the tables cannot hold, -3 out of memory. */
static int64_t *chunk_starts(const Args *a, int64_t num_seqs, int *status) {
    const int64_t span = (int64_t)CHUNK_BLOCKS * a->block_size;
    int64_t *first_chunk = malloc((num_seqs + 1) * sizeof(int64_t));
    *status = first_chunk == NULL ? -3 : 0;
    if (first_chunk == NULL) return NULL;
    first_chunk[0] = 0;
    for (int64_t b = 0; b < num_seqs; b++) {
        if (a->context_lens[b] <= 0 || a->context_lens[b] > a->max_blocks * a->block_size) {
            free(first_chunk);
            *status = -2;
            return NULL;
        }
        first_chunk[b + 1] = first_chunk[b] + (a->context_lens[b] + span - 1) / span;
    }
    return first_chunk;
}

/* One thread's scratch; 0, or -3 out of memory (what was allocated is freed by scratch_free). */
static int scratch_alloc(const Args *a, Scratch *s) {
    const int row = a->kv_heads * a->dim;
    const size_t vectors = ((size_t)a->heads * a->dim * sizeof(float) + sizeof(vf) - 1) / sizeof(vf) * sizeof(vf);
    const size_t weights = (size_t)a->heads * ((a->block_size + LANES - 1) / LANES) * sizeof(vf); /* [heads][block rounded up] */
    *s = (Scratch){aligned_alloc(sizeof(vf), vectors), malloc(a->block_size * row * sizeof(float)),
                   malloc(a->block_size * row * sizeof(float)), aligned_alloc(sizeof(vf), weights),
                   aligned_alloc(sizeof(vf), vectors)};
    return s->query && s->key && s->value && s->weight && s->sums ? 0 : -3;
}

static void scratch_free(Scratch *s) {
    free(s->query);
    free(s->key);
    free(s->value);
    free(s->weight);
    free(s->sums);
}

/* Chunk c's online softmax into its state; *seq: a sequence near c's, moved to c's. */
static void run_chunk(const Args *a, Scratch *s, const int64_t *first_chunk, float *states, int64_t c, int64_t *seq) {
    const int64_t span = (int64_t)CHUNK_BLOCKS * a->block_size;
    while (first_chunk[*seq + 1] <= c) (*seq)++;
    while (first_chunk[*seq] > c) (*seq)--;
    const int64_t start = (c - first_chunk[*seq]) * span, len = a->context_lens[*seq];
    const int64_t end = start + span < len ? start + span : len;
    (LANES_PATH(a) ? chunk_lanes : chunk)(a, s, *seq, start, end, states + c * a->heads * (a->dim + 2));
}

static int takes(int heads, int kv_heads, int dim, int block_size, int dtype, int kv_dtype) {
    return kv_heads > 0 && heads % kv_heads == 0 && dim > 0 && dim <= 512 && block_size > 0 &&
           (dtype == 0 || dtype == 1) && (kv_dtype == 0 || kv_dtype == 1);
}

int paged_decode(const void *q, const void *k_cache, const void *v_cache, void *out,
                 const int64_t *block_tables, const int64_t *context_lens, int64_t num_seqs,
                 int64_t max_blocks, int heads, int kv_heads, int dim, int block_size, float scale,
                 int dtype, int kv_dtype) {
    if (!takes(heads, kv_heads, dim, block_size, dtype, kv_dtype)) return -1;
    const Args a = {q, k_cache, v_cache, out, block_tables, context_lens, max_blocks,
                    heads, kv_heads, dim, block_size, dtype, kv_dtype, scale};
    int status;
    int64_t *first_chunk = chunk_starts(&a, num_seqs, &status);
    if (first_chunk == NULL) return status;
    const int64_t num_chunks = first_chunk[num_seqs];
    float *states = malloc((size_t)num_chunks * heads * (dim + 2) * sizeof(float));
    int failed = states == NULL; /* out of memory: nothing is computed, the caller raises */
#pragma omp parallel if (!failed)
    {
        FLUSH_DENORMALS_BEGIN
        Scratch s;
        int64_t seq = 0;
        if (scratch_alloc(&a, &s)) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < num_chunks; c++)
            if (!failed) run_chunk(&a, &s, first_chunk, states, c, &seq);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < num_seqs; b++)
            if (!failed) merge(&a, b, states + first_chunk[b] * heads * (dim + 2), first_chunk[b + 1] - first_chunk[b]);
        scratch_free(&s);
        FLUSH_DENORMALS_END
    }
    free(states);
    free(first_chunk);
    return failed ? -3 : 0;
}

typedef struct { /* what part 0 plans for the team (team.h) */
    int64_t *first_chunk;
    float *states;
} Plan;

/* Part `part` of paged_decode for a team (team.h): every part calls it, with the same arguments;
 * each takes its share of the chunks, then of the merges. The same sums as paged_decode, to the
 * bit. Returns the team's status, the same for every part (it waits for the team before it returns). */
int paged_decode_part(const void *q, const void *k_cache, const void *v_cache, void *out,
                      const int64_t *block_tables, const int64_t *context_lens, int64_t num_seqs, int64_t max_blocks,
                      int heads, int kv_heads, int dim, int block_size, float scale, int dtype, int kv_dtype,
                      Team *team, int part) {
    const Args a = {q, k_cache, v_cache, out, block_tables, context_lens, max_blocks,
                    heads, kv_heads, dim, block_size, dtype, kv_dtype, scale};
    Plan plan = {NULL, NULL};
    int status = takes(heads, kv_heads, dim, block_size, dtype, kv_dtype) ? 0 : -1;
    if (part == 0 && !status) {
        plan.first_chunk = chunk_starts(&a, num_seqs, &status);
        if (plan.first_chunk != NULL) {
            plan.states = malloc((size_t)plan.first_chunk[num_seqs] * heads * (dim + 2) * sizeof(float));
            status = plan.states == NULL ? -3 : 0;
        }
        team->shared = &plan;
    }
    status = team_wait(team, status);
    const Plan *shared = team->shared;
    if (!status) {
        FLUSH_DENORMALS_BEGIN
        Scratch s;
        status = scratch_alloc(&a, &s);
        int64_t first, end, seq = 0;
        team_share(shared->first_chunk[num_seqs], part, team_parts(team), &first, &end);
        for (int64_t c = first; c < end && !status; c++) run_chunk(&a, &s, shared->first_chunk, shared->states, c, &seq);
        scratch_free(&s);
        status = team_wait(team, status);
        team_share(num_seqs, part, team_parts(team), &first, &end);
        for (int64_t b = first; b < end && !status; b++)
            merge(&a, b, shared->states + shared->first_chunk[b] * heads * (dim + 2),
                  shared->first_chunk[b + 1] - shared->first_chunk[b]);
        FLUSH_DENORMALS_END
    }
    status = team_wait(team, status);
    if (part == 0) {
        free(plan.states);
        free(plan.first_chunk);
    }
    return status;
}
