/* Prefill attention over a paged KV cache on CPU: the queries of a chunk (a prompt, the part of
 * one after a prefix-cache hit, a session's question) attend to their sequence's cached keys,
 * each query to the keys up to its own position, read from the cache blocks where they are with
 * an online softmax (flash attention): no gathered copy of the context, no score matrix, no mask.
 *
 * A unit is one tile of a sequence's query tokens with one KV head. Its rows are the tile's
 * tokens times that KV head's query heads, so grouped heads share every key they read. Rows are
 * the vector lanes, LANES to a row group (16 with AVX-512, else 8; common.h): queries are
 * transposed once per task into [dim][LANES] columns, and for LANES keys at a time a row group's
 * scores are LANES vectors of FMAs over dim with
 * each key element broadcast, so the softmax's running max, sum and rescale are vector ops over
 * rows and no horizontal sum is ever needed. A unit with few siblings is split into ranges of
 * keys (tasks), merged afterwards as in flash decoding, so a short question over a long context
 * still feeds every thread.
 *
 * The arithmetic is written once with GCC vector extensions (gcc and clang): compiled with
 * -march=native they become AVX-512, AVX2 or NEON code. Scores and sums are float32.
 *
 * A bf16 model over a bf16 cache may instead take bf16 dot products (vdpbf16ps, where the CPU
 * has AVX-512 BF16): queries and keys as bf16 pairs along the head dimension, the softmax's
 * weights rounded to bf16 and paired along keys with the values, float32 sums (the rounding of
 * a flash attention's P on GPUs). Half the multiply-adds: a question over thousands of cached
 * keys is dominated by them. set_prefill_bf16_dot turns it on or off (kernels/calibration.py
 * measures which is faster per CPU).
 *
 * Layouts (contiguous): q, out [T, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D];
 * block_tables [B, max_blocks] int64; query_starts [B + 1] int64 (sequence b owns query rows
 * query_starts[b] .. query_starts[b + 1] - 1); positions [T] int64 (query t sees keys
 * 0 .. positions[t]); context_lens [B] int64. dtype (q, out) and kv_dtype (the cache): 0 float32, 1
 * bfloat16. Optionally rot_starts [B + 1] int64, rot_ids [rot_starts[B]] int32 and rot_cos, rot_sin
 * [angles, D / 2] float32: sequence b's first rot_starts[b + 1] - rot_starts[b] keys move (span keys
 * reused at new positions), key j by the angles of row rot_ids[rot_starts[b] + j], so that shared
 * blocks are never rewritten. The keys of one reused document share a row: where a run of keys
 * does, its queries are moved back once instead of each key forward (move_group).
 */
/* A row's output must not depend on the rows it is computed with: a prompt's last tokens computed
 * after a prefix-cache hit must give the bits that prompt computed whole gives. -ffast-math lets
 * gcc reassociate a sum over the head size differently in each inlined copy of the loops (one per
 * count of row groups), which moved results by 1e-7; so not here, at no cost in
 * speed. Before the includes: the helpers inlined into the kernel must be compiled alike. */
#pragma GCC optimize("no-associative-math")

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "fused_kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && LANES == 16
#define PAIR_DOT 1 /* bf16 pairs dotted with vdpbf16ps */
#endif
static int pair_dot_on = 1;

/* Turn the bf16 dot products on or off; whether this build has them (0: the setting changes nothing). */
int set_prefill_bf16_dot(int on) {
    pair_dot_on = on != 0;
#if defined(PAIR_DOT)
    return 1;
#else
    return 0;
#endif
}

/* A row group is LANES rows (one vector's lanes); a key group, LANES keys. */

#define TILE_ROWS 256  /* rows of a unit (tokens x grouped heads), at least one token */
#define SPLIT_KEYS 256 /* fewest keys in a split task */

typedef struct {
    const void *q, *k_cache, *v_cache;
    void *out;
    const int64_t *block_tables, *query_starts, *positions, *context_lens;
    const int64_t *rot_starts;       /* NULL, or [B + 1]: where sequence b's moved keys' ids start */
    const int32_t *rot_ids;          /* each moved key's row in rot_cos and rot_sin */
    const float *rot_cos, *rot_sin;  /* [angles][dim / 2] */
    int64_t max_blocks;
    int heads, kv_heads, dim, block_size, dtype, kv_dtype, groups, tile_tokens, row_groups;
    float scale;
    int pairs; /* this call takes the bf16 dot products */
} Args;

typedef struct {
    int64_t seq, row0, kend; /* first query row; keys 0 .. kend - 1 are seen by some row */
    int tokens, kv_head, first_task, num_tasks;
} Unit;

typedef struct {
    int unit;
    int64_t kbegin, kend;
    int64_t work; /* keys its rows read (token x keys it sees): threads take the most work first */
} Task;

typedef struct { /* one thread's scratch */
    vf *queries;          /* [row_groups][dim] */
    vf *moved_queries;    /* [row_groups][dim]: queries moved back by the angles of row moved_ids[g] */
    int64_t *moved_ids;   /* [row_groups]: -1 none yet */
    int64_t decided_id;   /* the angle row stored_angle last decided for (-2: none), and what */
    int decided;
    vi *rows_pos;         /* [row_groups] */
    int64_t *min_pos;     /* [row_groups]: the least position of a row group's real rows */
    int64_t *max_pos;     /* [row_groups]: the greatest (in min_pos's allocation) */
    float *keys, *values; /* [LANES][dim]: keys and values converted or rotated */
    uint32_t *query_pairs;  /* the bf16 path's: [row_groups][dim / 2][LANES], bf16 pairs along dim */
    uint32_t *key_pairs;    /* [LANES][dim / 2]: bf16 pairs along dim */
    uint32_t *value_pairs;  /* [LANES / 2][dim]: bf16 pairs of keys 2t, 2t + 1 */
    const float *key_rows[LANES], *value_rows[LANES]; /* where each panel key and value is read */
} Scratch;

/* The cache rows of keys kbegin .. kbegin + n - 1 of sequence `seq`, KV head `kv`, as element
 * indices: one block-table read and one division per block they fall in. A division per key (two,
 * with the prefetch's) cost a warm RAG prompt's calls over 4k moved keys 3-8% (`bench
 * prefill_attention --cases RAG --layers 30`, AMD EPYC Zen 3). */
static inline void key_indices(const Args *a, int64_t seq, int kv, int64_t kbegin, int n, int64_t index[LANES]) {
    const int64_t *blocks = a->block_tables + seq * a->max_blocks, stride = (int64_t)a->kv_heads * a->dim;
    int64_t block = kbegin / a->block_size, slot = kbegin % a->block_size, row = blocks[block] * a->block_size + slot;
    for (int t = 0; t < n; t++, slot++, row++) {
        if (slot == a->block_size) { /* into the next block */
            slot = 0;
            row = blocks[++block] * a->block_size;
        }
        index[t] = row * stride + kv * a->dim;
    }
}

/* Whether key `key` of sequence `seq` moves: span keys cached at the positions they were computed
 * at, attended from others. */
static inline int rotated(const Args *a, int64_t seq, int64_t key) {
    return a->rot_starts != NULL && key < a->rot_starts[seq + 1] - a->rot_starts[seq];
}

/* The row of moved key `key` of sequence `seq` in the angle tables. */
static inline int64_t angle_row(const Args *a, int64_t seq, int64_t key) {
    return a->rot_ids[a->rot_starts[seq] + key];
}

/* Key `key` of sequence `seq` (float32, [dim], from `row`) rotated by its angles into `out` (which
 * may be `row`): RoPE's rotate-half layout, the sine's sign folded in, as KeyRotation stores them. */
static void rotate_key(const Args *a, int64_t seq, int64_t key, const float *row, float *out) {
    int half = a->dim / 2;
    const float *cos = a->rot_cos + angle_row(a, seq, key) * half, *sin = a->rot_sin + angle_row(a, seq, key) * half;
    for (int i = 0; i < half; i++) {
        float x = row[i], y = row[i + half];
        out[i] = x * cos[i] - y * sin[i];
        out[i + half] = y * cos[i] + x * sin[i];
    }
}

/* Keys and values kbegin .. kbegin + n - 1 of one KV head as float32 panels: key_rows and value_rows
 * point at each one's [dim] floats. A float32 cache's rows are read where they are; a bf16 cache's
 * are converted, and keys that move rotated (unless `as_stored`: the queries were moved instead),
 * into the scratch rows. Missing keys read zeros.
 * Copying every float32 row (two memcpy calls a key) took 11% of a warm RAG prompt's samples
 * (perf, AMD EPYC Zen 3); without, its probe's and its relink's calls over 4k moved keys ran 5-9%
 * faster, bit for bit the same. */
static const float zero_row[512];

static void load_panels(const Args *a, Scratch *s, int64_t seq, int kv, int64_t kbegin, int n, int as_stored) {
    int64_t indices[LANES];
    key_indices(a, seq, kv, kbegin, n, indices);
    for (int t = 0; t < LANES; t++) {
        if (t >= n) {
            s->key_rows[t] = s->value_rows[t] = zero_row;
            continue;
        }
        int64_t index = indices[t];
        float *key = s->keys + t * a->dim, *value = s->values + t * a->dim;
        s->value_rows[t] = zero_row; /* unless read: scores alone (paged_scores) read no values */
        if (a->kv_dtype == 0) {
            if (a->v_cache != NULL) s->value_rows[t] = (const float *)a->v_cache + index;
            s->key_rows[t] = (const float *)a->k_cache + index;
        } else {
            if (a->v_cache != NULL) load_floats(a->v_cache, index, a->dim, a->kv_dtype, value);
            load_floats(a->k_cache, index, a->dim, a->kv_dtype, key);
            if (a->v_cache != NULL) s->value_rows[t] = value;
            s->key_rows[t] = key;
        }
        if (!as_stored && rotated(a, seq, kbegin + t)) {
            rotate_key(a, seq, kbegin + t, s->key_rows[t], key);
            s->key_rows[t] = key;
        }
    }
}

/* A unit's queries as scaled float32 columns, lane r of row group g holding row LANES g + r
 * (token r / groups of the tile, query head r % groups of the KV head), with each row's position;
 * padding rows are zeros that see every key (their sums are never read). */
static void load_queries(const Args *a, const Scratch *s, const Unit *u) {
    int dim = a->dim, rows = u->tokens * a->groups;
    float row[512];
    for (int g = 0; g < a->row_groups; g++)
        for (int d = 0; d < dim; d++) s->queries[g * dim + d] = splat(0.0f);
    for (int r = 0; r < rows; r++) {
        int64_t token = u->row0 + r / a->groups;
        int head = u->kv_head * a->groups + r % a->groups;
        load_floats(a->q, (token * a->heads + head) * dim, dim, a->dtype, row);
        vf *column = s->queries + (r / LANES) * dim;
        for (int d = 0; d < dim; d++) column[d][r % LANES] = row[d] * a->scale;
    }
}

/* Each row's position, and each row group's least and greatest (padding rows see every key). */
static void load_positions(const Args *a, const Scratch *s, const Unit *u) {
    for (int g = 0; g < a->row_groups; g++) {
        s->rows_pos[g] = splat_int(INT32_MAX);
        s->min_pos[g] = INT32_MAX;
        s->max_pos[g] = -1;
    }
    for (int r = 0; r < u->tokens * a->groups; r++) {
        int64_t position = a->positions[u->row0 + r / a->groups];
        s->rows_pos[r / LANES][r % LANES] = (int32_t)position;
        s->min_pos[r / LANES] = position < s->min_pos[r / LANES] ? position : s->min_pos[r / LANES];
        s->max_pos[r / LANES] = position > s->max_pos[r / LANES] ? position : s->max_pos[r / LANES];
    }
}

/* The angle row keys kbegin .. kbegin + n - 1 of sequence `seq` all move by, else -1. */
static int64_t panel_angle(const Args *a, int64_t seq, int64_t kbegin, int n) {
    if (!rotated(a, seq, kbegin + n - 1)) return -1; /* moved keys are a prefix: then all of these */
    const int32_t *ids = a->rot_ids + a->rot_starts[seq] + kbegin;
    for (int t = 1; t < n; t++)
        if (ids[t] != ids[0]) return -1;
    return ids[0];
}

/* Whether at least `keys` keys from kbegin (before kend) move by the same angles. */
static int angle_run_reaches(const Args *a, int64_t seq, int64_t kbegin, int64_t kend, int64_t keys) {
    const int32_t *ids = a->rot_ids + a->rot_starts[seq];
    int64_t moved = a->rot_starts[seq + 1] - a->rot_starts[seq], end = kbegin + keys;
    if (end > kend || end > moved) return 0;
    for (int64_t k = kbegin + 1; k < end; k++)
        if (ids[k] != ids[kbegin]) return 0;
    return 1;
}

/* Row group g's query columns moved back by angle row `id`, unless they are already: keys that all
 * move by one rotation R are read as stored by queries moved by its transpose (q . Rk = R^T q . k),
 * so a run of a reused document's keys costs one rotation of each row that reads it instead of one
 * of each key. A warm RAG prompt's probe (54 rows over 4k keys of 16 moved documents) spent a fifth
 * of its attention rotating keys. */
static void move_group(const Args *a, Scratch *s, int g, int64_t id) {
    if (s->moved_ids[g] == id) return;
    int dim = a->dim, half = dim / 2;
    const float *cos = a->rot_cos + id * half, *sin = a->rot_sin + id * half;
    const vf *q = s->queries + g * dim;
    vf *out = s->moved_queries + g * dim;
    for (int i = 0; i < half; i++) {
        vf c = splat(cos[i]), sn = splat(sin[i]);
        out[i] = q[i] * c + q[i + half] * sn;
        out[i + half] = q[i + half] * c - q[i] * sn;
    }
    s->moved_ids[g] = id;
}

/* The angle row by which the unit's moved queries read panel kbegin .. kbegin + n - 1 as stored,
 * or -1: its keys are rotated as they are loaded. Moved queries where the panel's keys all move by
 * one rotation that lasts at least as many keys as there are rows that see its first key (moving
 * a row costs about what moving a key does, and each row group moves once a run, when it first
 * reads one); decided at a run's first panel. */
static int64_t stored_angle(const Args *a, Scratch *s, const Unit *u, int row_groups, int64_t kbegin, int n,
                            int64_t kend) {
    int64_t id = panel_angle(a, u->seq, kbegin, n);
    if (id != s->decided_id) {
        int seeing = 0;
        for (int g = 0; g < row_groups; g++) seeing += s->max_pos[g] >= kbegin;
        s->decided_id = id;
        s->decided = id >= 0 && angle_run_reaches(a, u->seq, kbegin, kend, (int64_t)seeing * LANES);
    }
    return s->decided ? id : -1;
}

/* A task's start: no queries moved yet, nothing decided. */
static void forget_moves(Scratch *s, int row_groups) {
    for (int g = 0; g < row_groups; g++) s->moved_ids[g] = -1;
    s->decided_id = -2;
}

/* Up to MAX_GROUPS row groups are stepped together, so that a key element broadcast once serves
 * each of them and a query column or weight vector loaded once serves several keys. The sums of
 * a product (groups x keys for scores, groups x width for values) must stay in registers, with a
 * register left for the broadcast element: about 16 vectors where there are 32 (AVX-512), 8 to
 * 12 where there are 16 (AVX2; NEON's 32 hold 16 of these 8-lane vectors). On AVX2 the AVX-512
 * blocking (4 groups, 4 x 4 sums) spilled: 3 groups with 12 sums ran 17-20% faster (AMD EPYC,
 * 26 to 2,048 queries over 512 to 7,600 keys). Index: the number of groups. */
#if LANES == 16
#define MAX_GROUPS 4
static const int SCORE_KEYS[MAX_GROUPS + 1] = {0, 16, 8, 4, 4}, VALUE_WIDTH[MAX_GROUPS + 1] = {0, 8, 8, 4, 4};
#else
#define MAX_GROUPS 3
static const int SCORE_KEYS[MAX_GROUPS + 1] = {0, 8, 4, 4}, VALUE_WIDTH[MAX_GROUPS + 1] = {0, 8, 4, 4};
#endif
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Scores of row groups [0, groups) against panel keys k0 .. k0 + keys - 1, into scores[g][key]. */
ALWAYS_INLINE void score_keys(const vf *queries, const float *const *panel, int dim, int groups, int k0, int keys,
                              vf scores[MAX_GROUPS][LANES]) {
    vf sums[MAX_GROUPS][LANES];
#pragma GCC unroll 4
    for (int g = 0; g < groups; g++)
#pragma GCC unroll 16
        for (int j = 0; j < keys; j++) sums[g][j] = splat(0.0f);
    for (int d = 0; d < dim; d++) {
        vf query[MAX_GROUPS];
#pragma GCC unroll 4
        for (int g = 0; g < groups; g++) query[g] = in_register(queries[g * dim + d]);
#pragma GCC unroll 16
        for (int j = 0; j < keys; j++) {
            vf key = splat(panel[k0 + j][d]);
#pragma GCC unroll 4
            for (int g = 0; g < groups; g++) sums[g][j] += query[g] * key;
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < groups; g++)
#pragma GCC unroll 16
        for (int j = 0; j < keys; j++) scores[g][k0 + j] = sums[g][j];
}

/* The online softmax of one row group over LANES keys from `kbegin` (n of them real): scores become
 * weights relative to each row's reference `ref`, and their sum joins `sum`. Lazy rescaling, as in
 * paged_decode.c: a row's reference sits RESCALE_SLACK above the largest score it had seen when
 * it last moved, and moves only when a score passes it, so most key groups skip the rescale of
 * the row's sums. Returns whether some row's reference moved, with the factor that rescales what
 * the sums held before in *rescale. */
ALWAYS_INLINE int softmax_step(vf scores[LANES], vi pos, int64_t min_pos, int64_t kbegin, int n, vf *ref, vf *sum,
                               vf *rescale) {
    if (kbegin + LANES > min_pos || n < LANES) { /* some row does not see some key */
        for (int t = 0; t < LANES; t++)
            scores[t] = pick((pos >= splat_int((int32_t)(kbegin + t))) & splat_int(t < n ? -1 : 0), scores[t],
                             splat(MASKED));
    }
    vf top[LANES / 2]; /* the max over keys, as a tree */
    for (int t = 0; t < LANES / 2; t++) top[t] = vmax(scores[t], scores[t + LANES / 2]);
    for (int w = LANES / 4; w > 0; w /= 2)
        for (int t = 0; t < w; t++) top[t] = vmax(top[t], top[t + w]);
    vi passed = top[0] > *ref;
    int moved = any_lane(passed);
    if (moved) {
        vf moved_ref = pick(passed, top[0] + RESCALE_SLACK, *ref);
        *rescale = vexp(*ref - moved_ref);
        *sum *= *rescale;
        *ref = moved_ref;
    }
    vf total = splat(0.0f);
    for (int t = 0; t < LANES; t++) {
        scores[t] = vexp(scores[t] - *ref);
        total += scores[t];
    }
    *sum += total;
    return moved;
}

/* Dimensions d0 .. d0 + width - 1 of each row group's sum of values: rescaled (if `rescaled`, a
 * constant where inlined), plus the LANES keys' weighted values (each value element broadcast once
 * for every row group). */
ALWAYS_INLINE void weigh_values(const float *const *panel, int dim, int groups, int d0, int width,
                                vf weights[MAX_GROUPS][LANES], int rescaled, const vf *rescale, vf *state,
                                int stride) {
    vf sums[MAX_GROUPS][8];
#pragma GCC unroll 4
    for (int g = 0; g < groups; g++)
#pragma GCC unroll 8
        for (int j = 0; j < width; j++)
            sums[g][j] = rescaled ? state[g * stride + d0 + j] * rescale[g] : state[g * stride + d0 + j];
    for (int t = 0; t < LANES; t++) {
        vf weight[MAX_GROUPS];
#pragma GCC unroll 4
        for (int g = 0; g < groups; g++) weight[g] = in_register(weights[g][t]);
#pragma GCC unroll 8
        for (int j = 0; j < width; j++) {
            vf value = splat(panel[t][d0 + j]);
#pragma GCC unroll 4
            for (int g = 0; g < groups; g++) sums[g][j] += weight[g] * value;
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < groups; g++)
#pragma GCC unroll 8
        for (int j = 0; j < width; j++) state[g * stride + d0 + j] = sums[g][j];
}

ALWAYS_INLINE void weigh_all_values(const float *const *panel, int dim, int groups, int width, vf weights[MAX_GROUPS][LANES],
                                    int rescaled, const vf *rescale, vf *state, int stride) {
    int d = 0;
    for (; d + width <= dim; d += width) weigh_values(panel, dim, groups, d, width, weights, rescaled, rescale, state, stride);
    for (; d < dim; d++) weigh_values(panel, dim, groups, d, 1, weights, rescaled, rescale, state, stride);
}

/* Row groups g0 .. g0 + groups - 1 over the LANES panel keys from `kbegin`, their states (each
 * [dim] sums of values, then the softmax's reference and sum) at state, `stride` vectors apart. */
ALWAYS_INLINE void step_groups(const Scratch *s, const vf *queries, int g0, int groups, int64_t kbegin, int n,
                               vf *state, int dim) {
    int stride = dim + 2, width = VALUE_WIDTH[groups], keys = SCORE_KEYS[groups]; /* keys: a divisor of LANES */
    vf scores[MAX_GROUPS][LANES], rescale[MAX_GROUPS];
    for (int k0 = 0; k0 < LANES; k0 += keys) score_keys(queries + g0 * dim, s->key_rows, dim, groups, k0, keys, scores);
    int moved = 0;
    for (int g = 0; g < groups; g++) {
        rescale[g] = splat(1.0f);
        moved |= softmax_step(scores[g], s->rows_pos[g0 + g], s->min_pos[g0 + g], kbegin, n,
                              state + g * stride + dim, state + g * stride + dim + 1, &rescale[g]);
    }
    if (moved) weigh_all_values(s->value_rows, dim, groups, width, scores, 1, rescale, state, stride);
    else weigh_all_values(s->value_rows, dim, groups, width, scores, 0, rescale, state, stride);
}

/* step_groups compiled for each count of row groups and the common head sizes, whose panels are
 * then read at constant offsets. */
#define STEP_FOR_DIM(groups) \
    case groups: \
        if (dim == 64) step_groups(s, queries, g0, groups, kbegin, n, state, 64); \
        else if (dim == 128) step_groups(s, queries, g0, groups, kbegin, n, state, 128); \
        else step_groups(s, queries, g0, groups, kbegin, n, state, dim); \
        break;

static void step(const Scratch *s, const vf *queries, int g0, int groups, int64_t kbegin, int n, vf *state, int dim) {
    switch (groups) {
        STEP_FOR_DIM(1)
        STEP_FOR_DIM(2)
        STEP_FOR_DIM(3)
#if MAX_GROUPS == 4
        STEP_FOR_DIM(4)
#endif
    }
}

#if defined(PAIR_DOT)
/* The bf16 path. Its layouts hold bf16 pairs in 32-bit words, low half first. */

/* A unit's queries, unscaled, as bf16 pairs along dim: lane r of word d2 of row group g holds
 * elements 2 d2, 2 d2 + 1 of row LANES g + r (padding rows zeros). */
static void load_query_pairs(const Args *a, const Scratch *s, const Unit *u) {
    int half = a->dim / 2, rows = u->tokens * a->groups;
    uint32_t row[256];
    memset(s->query_pairs, 0, (size_t)a->row_groups * half * LANES * sizeof(uint32_t));
    for (int r = 0; r < rows; r++) {
        int64_t token = u->row0 + r / a->groups;
        int head = u->kv_head * a->groups + r % a->groups;
        memcpy(row, (const uint16_t *)a->q + (token * a->heads + head) * a->dim, a->dim * sizeof(uint16_t));
        uint32_t *column = s->query_pairs + (size_t)(r / LANES) * half * LANES + r % LANES;
        for (int d2 = 0; d2 < half; d2++) column[d2 * LANES] = row[d2];
    }
}

/* 16 bf16 pairs from two vectors of 16 bf16s: lane i holds low[i] in its low half, high[i] above. */
static inline __m512i pair_words(__m256i low, __m256i high) {
    return _mm512_or_si512(_mm512_cvtepu16_epi32(low), _mm512_slli_epi32(_mm512_cvtepu16_epi32(high), 16));
}

static inline __m512 widen16(const uint16_t *bf16) { /* 16 bf16s as float32s */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)bf16)), 16));
}

/* A moved key (bf16, dim a multiple of 32) rotated by its angles in float32, then rounded to
 * nearest even as bf16 pairs: in vector registers, since nearly every key of a reused document
 * moves. As rotate_key then float_to_bf16, element by element. */
static void rotated_key_pairs(const uint16_t *key, const float *cos, const float *sin, int dim, uint32_t *out) {
    int half = dim / 2;
    float row[512];
    for (int i = 0; i < half; i += 16) {
        __m512 x = widen16(key + i), y = widen16(key + half + i);
        __m512 c = _mm512_loadu_ps(cos + i), s = _mm512_loadu_ps(sin + i);
        _mm512_storeu_ps(row + i, _mm512_fmsub_ps(x, c, _mm512_mul_ps(y, s)));
        _mm512_storeu_ps(row + half + i, _mm512_fmadd_ps(y, c, _mm512_mul_ps(x, s)));
    }
    for (int d = 0; d < dim; d += 32) /* elements d .. d + 31 in order: pairs d / 2 .. d / 2 + 15 */
        _mm512_storeu_si512(out + d / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + d + 16),
                                                                      _mm512_loadu_ps(row + d)));
}

/* Keys kbegin .. kbegin + n - 1 as bf16 pairs along dim (a rotated key rotated in float32, then
 * rounded to bf16 as the cache stores keys), and values as pairs of keys; missing keys zeros. */
static void load_pair_panels(const Args *a, const Scratch *s, int64_t seq, int kv, int64_t kbegin, int n) {
    static const uint16_t zeros[512];
    int dim = a->dim, half = dim / 2;
    const uint16_t *k_cache = a->k_cache, *v_cache = a->v_cache, *values[LANES];
    float row[512];
    int64_t indices[LANES];
    key_indices(a, seq, kv, kbegin, n, indices);
    for (int t = 0; t < LANES; t++) {
        uint32_t *key = s->key_pairs + t * half;
        if (t >= n) {
            memset(key, 0, half * sizeof(uint32_t));
            values[t] = zeros;
            continue;
        }
        int64_t index = indices[t];
        values[t] = v_cache + index;
        if (!rotated(a, seq, kbegin + t)) {
            memcpy(key, k_cache + index, dim * sizeof(uint16_t));
            continue;
        }
        if (dim % 32 == 0) {
            int64_t angles = angle_row(a, seq, kbegin + t) * half;
            rotated_key_pairs(k_cache + index, a->rot_cos + angles, a->rot_sin + angles, dim, key);
            continue;
        }
        load_floats(k_cache, index, dim, 1, row);
        rotate_key(a, seq, kbegin + t, row, row);
        for (int d2 = 0; d2 < half; d2++)
            key[d2] = float_to_bf16(row[2 * d2]) | (uint32_t)float_to_bf16(row[2 * d2 + 1]) << 16;
    }
    for (int t = 0; t < LANES; t += 2) {
        uint32_t *pair = s->value_pairs + (t / 2) * dim;
        int d = 0;
        for (; d + 16 <= dim; d += 16) {
            _mm512_storeu_si512(pair + d, pair_words(_mm256_loadu_si256((const __m256i *)(values[t] + d)),
                                                     _mm256_loadu_si256((const __m256i *)(values[t + 1] + d))));
        }
        for (; d < dim; d++) pair[d] = values[t][d] | (uint32_t)values[t + 1][d] << 16;
    }
}

/* Scaled scores of row groups [0, groups) against pair-panel keys k0 .. k0 + keys - 1. */
ALWAYS_INLINE void score_pairs(const uint32_t *queries, const uint32_t *panel, int dim, int groups, int k0, int keys,
                               float scale, vf scores[MAX_GROUPS][LANES]) {
    int half = dim / 2;
    __m512 sums[MAX_GROUPS][LANES];
#pragma GCC unroll 4
    for (int g = 0; g < groups; g++)
#pragma GCC unroll 16
        for (int j = 0; j < keys; j++) sums[g][j] = _mm512_setzero_ps();
    for (int d2 = 0; d2 < half; d2++) {
#pragma GCC unroll 16
        for (int j = 0; j < keys; j++) {
            __m512bh key = (__m512bh)_mm512_set1_epi32((int)panel[(k0 + j) * half + d2]);
#pragma GCC unroll 4
            for (int g = 0; g < groups; g++)
                sums[g][j] = _mm512_dpbf16_ps(sums[g][j], (__m512bh)_mm512_load_si512(queries + (g * half + d2) * LANES),
                                              key);
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < groups; g++)
#pragma GCC unroll 16
        for (int j = 0; j < keys; j++) scores[g][k0 + j] = (vf)_mm512_mul_ps(sums[g][j], _mm512_set1_ps(scale));
}

/* The weights of keys 2 t2 and 2 t2 + 1 of each row as a bf16 pair (rounded to nearest even). */
static inline __m512i weight_pair(vf first, vf second) {
    return pair_words((__m256i)_mm512_cvtneps_pbh((__m512)first), (__m256i)_mm512_cvtneps_pbh((__m512)second));
}

/* weigh_values over value pairs: dimensions d0 .. d0 + width - 1 of each row group's sums. */
ALWAYS_INLINE void weigh_pairs(const uint32_t *panel, int dim, int groups, int d0, int width,
                               const __m512i weights[MAX_GROUPS][LANES / 2], int rescaled, const vf *rescale,
                               vf *state, int stride) {
    __m512 sums[MAX_GROUPS][8];
#pragma GCC unroll 4
    for (int g = 0; g < groups; g++)
#pragma GCC unroll 8
        for (int j = 0; j < width; j++)
            sums[g][j] = (__m512)(rescaled ? state[g * stride + d0 + j] * rescale[g] : state[g * stride + d0 + j]);
    for (int t2 = 0; t2 < LANES / 2; t2++) {
#pragma GCC unroll 8
        for (int j = 0; j < width; j++) {
            __m512bh value = (__m512bh)_mm512_set1_epi32((int)panel[t2 * dim + d0 + j]);
#pragma GCC unroll 4
            for (int g = 0; g < groups; g++) sums[g][j] = _mm512_dpbf16_ps(sums[g][j], (__m512bh)weights[g][t2], value);
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < groups; g++)
#pragma GCC unroll 8
        for (int j = 0; j < width; j++) state[g * stride + d0 + j] = (vf)sums[g][j];
}

ALWAYS_INLINE void weigh_all_pairs(const uint32_t *panel, int dim, int groups, int width,
                                   const __m512i weights[MAX_GROUPS][LANES / 2], int rescaled, const vf *rescale,
                                   vf *state, int stride) {
    int d = 0;
    for (; d + width <= dim; d += width) weigh_pairs(panel, dim, groups, d, width, weights, rescaled, rescale, state, stride);
    for (; d < dim; d++) weigh_pairs(panel, dim, groups, d, 1, weights, rescaled, rescale, state, stride);
}

/* step_groups on the pair panels. */
ALWAYS_INLINE void step_pair_groups(const Args *a, const Scratch *s, int g0, int groups, int64_t kbegin, int n,
                                    vf *state, int dim) {
    int stride = dim + 2, width = VALUE_WIDTH[groups], keys = SCORE_KEYS[groups];
    vf scores[MAX_GROUPS][LANES], rescale[MAX_GROUPS];
    __m512i weights[MAX_GROUPS][LANES / 2];
    const uint32_t *queries = s->query_pairs + (size_t)g0 * (dim / 2) * LANES;
    for (int k0 = 0; k0 < LANES; k0 += keys) score_pairs(queries, s->key_pairs, dim, groups, k0, keys, a->scale, scores);
    int moved = 0;
    for (int g = 0; g < groups; g++) {
        rescale[g] = splat(1.0f);
        moved |= softmax_step(scores[g], s->rows_pos[g0 + g], s->min_pos[g0 + g], kbegin, n,
                              state + g * stride + dim, state + g * stride + dim + 1, &rescale[g]);
        for (int t2 = 0; t2 < LANES / 2; t2++) weights[g][t2] = weight_pair(scores[g][2 * t2], scores[g][2 * t2 + 1]);
    }
    if (moved) weigh_all_pairs(s->value_pairs, dim, groups, width, weights, 1, rescale, state, stride);
    else weigh_all_pairs(s->value_pairs, dim, groups, width, weights, 0, rescale, state, stride);
}

#define PAIR_STEP_FOR_DIM(groups) \
    case groups: \
        if (dim == 64) step_pair_groups(a, s, g0, groups, kbegin, n, state, 64); \
        else if (dim == 128) step_pair_groups(a, s, g0, groups, kbegin, n, state, 128); \
        else step_pair_groups(a, s, g0, groups, kbegin, n, state, dim); \
        break;

static void pair_step(const Args *a, const Scratch *s, int g0, int groups, int64_t kbegin, int n, vf *state, int dim) {
    switch (groups) {
        PAIR_STEP_FOR_DIM(1)
        PAIR_STEP_FOR_DIM(2)
        PAIR_STEP_FOR_DIM(3)
        PAIR_STEP_FOR_DIM(4)
    }
}
#endif

/* The next run of at most MAX_GROUPS row groups from *g on that see key k (a row group whose rows
 * all stand before k would only add zeros: a prompt's relinked span tokens among its question's
 * rows see a part of the context); its length, 0 at the end. */
static int seeing_groups(const Scratch *s, int row_groups, int64_t k, int *g) {
    while (*g < row_groups && s->max_pos[*g] < k) (*g)++;
    int run = 0;
    while (*g + run < row_groups && run < MAX_GROUPS && s->max_pos[*g + run] >= k) run++;
    return run;
}

/* Ask for keys and values kbegin .. kbegin + LANES - 1 (before kend) of one KV head to be brought
 * into cache while earlier panels are computed. A relinked prompt's pass reads each layer's span
 * keys once, from memory (a 4k-token prompt's 30 layers: 190 MB in float32). With it, a question
 * over 7.5k keys ran 1-4% faster (`bench prefill_attention --layers 30`). The run task asks for
 * the panel PREFETCH_AHEAD panels on: with one, a warm RAG prompt's probe calls (18 rows over 4k
 * moved keys) still waited on the first read of a key (perf) and ran 1-6% slower than with two;
 * four were no faster (AMD EPYC Zen 3). Into L2, not L1: the probe took 0.92-0.97x the time and the
 * relink 0.93-1.0x, other cases alike (`--layers 30 --baseline REV`, float32 and bf16 caches).
 * Spreading them over the panel's runs of row groups gained nothing more. */
#define PREFETCH_AHEAD 2
static void prefetch_panel(const Args *a, int64_t seq, int kv, int64_t kbegin, int64_t kend) {
    const int64_t size = a->kv_dtype ? 2 : 4, bytes = a->dim * size;
    if (kbegin >= kend) return;
    const int n = kend - kbegin < LANES ? (int)(kend - kbegin) : LANES;
    int64_t indices[LANES];
    key_indices(a, seq, kv, kbegin, n, indices);
    for (int t = 0; t < n; t++) {
        const char *k = (const char *)a->k_cache + indices[t] * size, *v = (const char *)a->v_cache + indices[t] * size;
        for (int64_t line = 0; line < bytes; line += 64) {
            __builtin_prefetch(k + line, 0, 2);
            __builtin_prefetch(v + line, 0, 2);
        }
    }
}

/* Task `task`: its unit's rows over keys [kbegin, kend), into state [row_groups][dim + 2]. */
static void run_task(const Args *a, Scratch *s, const Unit *u, const Task *task, vf *state) {
    int width = a->dim + 2, row_groups = (u->tokens * a->groups + LANES - 1) / LANES;
    load_positions(a, s, u);
#if defined(PAIR_DOT)
    if (a->pairs) load_query_pairs(a, s, u);
    else
#endif
        load_queries(a, s, u);
    forget_moves(s, row_groups);
    for (int g = 0; g < row_groups; g++) {
        vf *st = state + g * width;
        for (int d = 0; d < a->dim; d++) st[d] = splat(0.0f);
        st[a->dim] = splat(NO_MAX);
        st[a->dim + 1] = splat(0.0f);
    }
    for (int64_t k = task->kbegin; k < task->kend; k += LANES) { /* kend: past the unit's last position */
        int n = task->kend - k < LANES ? (int)(task->kend - k) : LANES, g = 0, run;
        prefetch_panel(a, u->seq, u->kv_head, k + PREFETCH_AHEAD * LANES, task->kend);
#if defined(PAIR_DOT)
        if (a->pairs) {
            load_pair_panels(a, s, u->seq, u->kv_head, k, n);
            for (; (run = seeing_groups(s, row_groups, k, &g)) > 0; g += run)
                pair_step(a, s, g, run, k, n, state + g * width, a->dim);
            continue;
        }
#endif
        int64_t stored = stored_angle(a, s, u, row_groups, k, n, task->kend);
        load_panels(a, s, u->seq, u->kv_head, k, n, stored >= 0);
        for (; (run = seeing_groups(s, row_groups, k, &g)) > 0; g += run) {
            for (int j = g; stored >= 0 && j < g + run; j++) move_group(a, s, j, stored);
            step(s, stored >= 0 ? s->moved_queries : s->queries, g, run, k, n, state + g * width, a->dim);
        }
    }
}

/* `size` bytes aligned to 64 (aligned_alloc takes whole multiples of the alignment). */
static void *aligned64(size_t size) {
    return aligned_alloc(64, (size + 63) / 64 * 64);
}

/* A thread's scratch for units of a.row_groups row groups; 0 if out of memory. */
static int scratch_new(const Args *a, Scratch *s) {
    int dim = a->dim;
    *s = (Scratch){
        .queries = aligned64(a->row_groups * dim * sizeof(vf)),
        .moved_queries = aligned64(a->row_groups * dim * sizeof(vf)),
        .moved_ids = malloc(a->row_groups * sizeof(int64_t)),
        .rows_pos = aligned64(a->row_groups * sizeof(vi)),
        .min_pos = malloc(2 * a->row_groups * sizeof(int64_t)),
        .keys = malloc(LANES * dim * sizeof(float)),
        .values = malloc(LANES * dim * sizeof(float)),
        .query_pairs = aligned64((size_t)a->row_groups * (dim / 2 + 1) * LANES * sizeof(uint32_t)),
        .key_pairs = malloc(LANES * (dim / 2 + 1) * sizeof(uint32_t)),
        .value_pairs = malloc(LANES * dim * sizeof(uint32_t)),
    };
    s->max_pos = s->min_pos ? s->min_pos + a->row_groups : NULL;
    return s->queries && s->moved_queries && s->moved_ids && s->rows_pos && s->min_pos && s->keys && s->values &&
           s->query_pairs && s->key_pairs && s->value_pairs;
}

static void scratch_free(Scratch *s) {
    free(s->queries);
    free(s->moved_queries);
    free(s->moved_ids);
    free(s->rows_pos);
    free(s->min_pos);
    free(s->keys);
    free(s->values);
    free(s->query_pairs);
    free(s->key_pairs);
    free(s->value_pairs);
}

/* Unit u's task states merged into its output rows. */
static void merge(const Args *a, const Unit *u, const vf *states, int64_t task_stride) {
    int dim = a->dim, width = dim + 2, rows = u->tokens * a->groups;
    for (int r = 0; r < rows; r++) {
        int g = r / LANES, lane = r % LANES;
        float top = NO_MAX, total = 0.0f, row[512];
        for (int t = 0; t < u->num_tasks; t++) {
            float m = states[(u->first_task + t) * task_stride + g * width + dim][lane];
            top = m > top ? m : top;
        }
        memset(row, 0, dim * sizeof(float));
        for (int t = 0; t < u->num_tasks; t++) {
            const vf *st = states + (u->first_task + t) * task_stride + g * width;
            float factor = expf(st[dim][lane] - top);
            total += st[dim + 1][lane] * factor;
            for (int d = 0; d < dim; d++) row[d] += st[d][lane] * factor;
        }
        for (int d = 0; d < dim; d++) row[d] = total > 0.0f ? row[d] / total : 0.0f;
        int64_t token = u->row0 + r / a->groups;
        int head = u->kv_head * a->groups + r % a->groups;
        store_floats(a->out, (token * a->heads + head) * dim, dim, a->dtype, row);
    }
}

/* The units of every sequence (checked already), and how many tasks each gets. */
static Unit *plan_units(const Args *a, int64_t num_seqs, int64_t *num_units, int64_t *num_tasks) {
    int64_t count = 0;
    for (int64_t b = 0; b < num_seqs; b++)
        count += (a->query_starts[b + 1] - a->query_starts[b] + a->tile_tokens - 1) / a->tile_tokens;
    count *= a->kv_heads;
    Unit *units = malloc((count ? count : 1) * sizeof(Unit));
    if (units == NULL) return NULL;
    int64_t i = 0;
    for (int64_t b = 0; b < num_seqs; b++) {
        for (int64_t row = a->query_starts[b]; row < a->query_starts[b + 1]; row += a->tile_tokens) {
            int64_t end = row + a->tile_tokens < a->query_starts[b + 1] ? row + a->tile_tokens : a->query_starts[b + 1];
            int64_t kend = 0;
            for (int64_t t = row; t < end; t++) kend = a->positions[t] + 1 > kend ? a->positions[t] + 1 : kend;
            for (int kv = 0; kv < a->kv_heads; kv++)
                units[i++] = (Unit){b, row, kend, (int)(end - row), kv, 0, 1};
        }
    }
    /* Few units for the threads: split each into ranges of at least SPLIT_KEYS keys, as many tasks
     * in all as a multiple of the threads (3 units on 2 threads: 12 tasks, not 9). */
    int threads = omp_get_max_threads();
    int64_t want = count >= 4 * threads ? 1 : (4 * threads + count - 1) / (count ? count : 1);
    while (want > 1 && count * want % threads) want++;
    int64_t tasks = 0;
    for (i = 0; i < count; i++) {
        int64_t pieces = (units[i].kend + SPLIT_KEYS - 1) / SPLIT_KEYS;
        units[i].num_tasks = (int)(pieces < want ? (pieces > 0 ? pieces : 1) : want);
        units[i].first_task = (int)tasks;
        tasks += units[i].num_tasks;
    }
    *num_units = count;
    *num_tasks = tasks;
    return units;
}

static int check(const Args *a, int64_t num_seqs, int64_t num_rows, int64_t num_angles) {
    if (a->kv_heads <= 0 || a->heads % a->kv_heads || a->dim <= 0 || a->dim > 512 || a->block_size <= 0 ||
        (a->dtype != 0 && a->dtype != 1) || (a->kv_dtype != 0 && a->kv_dtype != 1))
        return -1;
    if (a->query_starts[0] != 0 || a->query_starts[num_seqs] != num_rows) return -2;
    if (a->rot_starts != NULL && (a->rot_starts[0] != 0 || a->dim % 2)) return -2;
    if (a->rot_starts != NULL)
        for (int64_t i = 0; i < a->rot_starts[num_seqs]; i++)
            if (a->rot_ids[i] < 0 || a->rot_ids[i] >= num_angles) return -2;
    for (int64_t b = 0; b < num_seqs; b++) {
        int64_t ctx = a->context_lens[b];
        if (ctx <= 0 || ctx > a->max_blocks * a->block_size || a->query_starts[b + 1] < a->query_starts[b]) return -2;
        if (a->rot_starts != NULL && a->rot_starts[b + 1] < a->rot_starts[b]) return -2;
        for (int64_t t = a->query_starts[b]; t < a->query_starts[b + 1]; t++)
            if (a->positions[t] < 0 || a->positions[t] >= ctx) return -2;
    }
    return 0;
}

/* Keys [kbegin, kend) that unit u's tokens read: a task's work. */
static int64_t task_work(const Args *a, const Unit *u, int64_t kbegin, int64_t kend) {
    int64_t work = 0;
    for (int64_t t = u->row0; t < u->row0 + u->tokens; t++) {
        int64_t seen = (a->positions[t] + 1 < kend ? a->positions[t] + 1 : kend) - kbegin;
        work += seen > 0 ? seen : 0;
    }
    return work;
}

static int most_work_first(const void *x, const void *y) {
    const Task *a = *(const Task *const *)x, *b = *(const Task *const *)y;
    return (a->work < b->work) - (a->work > b->work);
}

int paged_prefill(const void *q, const void *k_cache, const void *v_cache, void *out, const int64_t *block_tables,
                  const int64_t *query_starts, const int64_t *positions, const int64_t *context_lens,
                  const int64_t *rot_starts, const int32_t *rot_ids, const float *rot_cos, const float *rot_sin,
                  int64_t num_angles, int64_t num_seqs, int64_t num_rows, int64_t max_blocks, int heads, int kv_heads,
                  int dim, int block_size, float scale, int dtype, int kv_dtype) {
    Args a = {q, k_cache, v_cache, out, block_tables, query_starts, positions, context_lens, rot_starts, rot_ids,
              rot_cos, rot_sin, max_blocks, heads, kv_heads, dim, block_size, dtype, kv_dtype, 0, 0, 0, scale, 0};
#if defined(PAIR_DOT)
    a.pairs = pair_dot_on && dtype == 1 && kv_dtype == 1 && dim % 2 == 0;
#endif
    int status = check(&a, num_seqs, num_rows, num_angles);
    if (status != 0) return status;
    a.groups = heads / kv_heads;
    a.tile_tokens = TILE_ROWS / a.groups > 0 ? TILE_ROWS / a.groups : 1;
    a.row_groups = (a.tile_tokens * a.groups + LANES - 1) / LANES;
    int64_t num_units, num_tasks, task_stride = (int64_t)a.row_groups * (dim + 2);
    Unit *units = plan_units(&a, num_seqs, &num_units, &num_tasks);
    Task *tasks = units ? malloc((num_tasks ? num_tasks : 1) * sizeof(Task)) : NULL;
    vf *states = tasks ? aligned64((num_tasks ? num_tasks : 1) * task_stride * sizeof(vf)) : NULL;
    const Task **order = states ? malloc((num_tasks ? num_tasks : 1) * sizeof(Task *)) : NULL;
    int failed = order == NULL; /* out of memory: nothing is computed, the caller raises */
    for (int64_t u = 0; !failed && u < num_units; u++) {
        int64_t piece = (units[u].kend + units[u].num_tasks - 1) / units[u].num_tasks;
        piece = (piece + LANES - 1) / LANES * LANES;
        for (int t = 0; t < units[u].num_tasks; t++) {
            int64_t begin = t * piece, end = begin + piece < units[u].kend ? begin + piece : units[u].kend;
            end = end > begin ? end : begin;
            tasks[units[u].first_task + t] = (Task){(int)u, begin, end, task_work(&a, &units[u], begin, end)};
            order[units[u].first_task + t] = &tasks[units[u].first_task + t];
        }
    }
    if (!failed) qsort(order, num_tasks, sizeof *order, most_work_first);
#pragma omp parallel if (!failed)
    {
        FLUSH_DENORMALS_BEGIN
        Scratch s;
        if (!scratch_new(&a, &s)) failed = 1;
        /* The most work first, so that the threads end together: in a causal prompt the latest
         * tasks; among a relinked prompt's rows, the first keys, which every row reads. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_tasks; i++)
            if (!failed) run_task(&a, &s, &units[order[i]->unit], order[i], states + (order[i] - tasks) * task_stride);
#pragma omp for schedule(dynamic, 4)
        for (int64_t u = 0; u < num_units; u++)
            if (!failed) merge(&a, &units[u], states, task_stride);
        scratch_free(&s);
        FLUSH_DENORMALS_END
    }
    free(order);
    free(states);
    free(tasks);
    free(units);
    return failed ? -3 : 0;
}

/* Scores, not attention: the scaled scores of a few query rows against their sequence's cached
 * keys, before the softmax, for a caller that weighs keys by them (the focus probe's voting
 * heads, engine/runner.py). One sequence: q [T, H, D], block_table [max_blocks], positions [T],
 * keys 0 .. context_len - 1 (moved as paged_prefill moves them); scores [H, T, context_len]
 * float32, -inf where a key stands after a row's position. Rows are read in paged_prefill's
 * layout, a KV head's query heads together; tasks are a KV head's keys in ranges. */
#define SCORE_RANGE 512

static void store_scores(const Args *a, const Unit *u, int g0, int groups, int64_t kbegin, int n,
                         vf scores[MAX_GROUPS][LANES], float *out, int64_t context_len) {
    int rows = u->tokens * a->groups;
    for (int g = 0; g < groups; g++)
        for (int lane = 0; lane < LANES && (g0 + g) * LANES + lane < rows; lane++) {
            int r = (g0 + g) * LANES + lane, token = r / a->groups, head = u->kv_head * a->groups + r % a->groups;
            int64_t position = a->positions[token];
            float *row = out + ((int64_t)head * u->tokens + token) * context_len + kbegin;
            if (kbegin + n - 1 <= position)
                for (int t = 0; t < n; t++) row[t] = scores[g][t][lane];
            else
                for (int t = 0; t < n; t++) row[t] = kbegin + t <= position ? scores[g][t][lane] : -INFINITY;
        }
}

/* The scores of row groups g .. g + groups - 1 against the panel, with constant counts. */
ALWAYS_INLINE void score_panel(const Scratch *s, const vf *queries, int g, int groups, int dim,
                               vf scores[MAX_GROUPS][LANES]) {
    for (int k0 = 0; k0 < LANES; k0 += SCORE_KEYS[groups])
        score_keys(queries + g * dim, s->key_rows, dim, groups, k0, SCORE_KEYS[groups], scores);
}

#define SCORE_FOR_DIM(groups) \
    case groups: \
        if (dim == 64) score_panel(s, queries, g, groups, 64, scores); \
        else if (dim == 128) score_panel(s, queries, g, groups, 128, scores); \
        else score_panel(s, queries, g, groups, dim, scores); \
        break;

static void score_groups(const Scratch *s, const vf *queries, int g, int groups, int dim,
                         vf scores[MAX_GROUPS][LANES]) {
    switch (groups) {
        SCORE_FOR_DIM(1)
        SCORE_FOR_DIM(2)
        SCORE_FOR_DIM(3)
#if MAX_GROUPS == 4
        SCORE_FOR_DIM(4)
#endif
    }
}

static void score_range(const Args *a, Scratch *s, const Unit *u, int64_t kbegin, int64_t kend, float *out,
                        int64_t context_len) {
    int dim = a->dim, row_groups = (u->tokens * a->groups + LANES - 1) / LANES;
    load_queries(a, s, u);
    load_positions(a, s, u);
    forget_moves(s, row_groups);
    for (int64_t k = kbegin; k < kend; k += LANES) {
        int n = kend - k < LANES ? (int)(kend - k) : LANES;
        int64_t stored = stored_angle(a, s, u, row_groups, k, n, kend);
        load_panels(a, s, u->seq, u->kv_head, k, n, stored >= 0);
        for (int g = 0; g < row_groups; g += MAX_GROUPS) {
            int groups = row_groups - g < MAX_GROUPS ? row_groups - g : MAX_GROUPS;
            vf scores[MAX_GROUPS][LANES];
            for (int j = g; stored >= 0 && j < g + groups; j++) move_group(a, s, j, stored);
            score_groups(s, stored >= 0 ? s->moved_queries : s->queries, g, groups, dim, scores);
            store_scores(a, u, g, groups, k, n, scores, out, context_len);
        }
    }
}

int paged_scores(const void *q, const void *k_cache, float *scores, const int64_t *block_table,
                 const int64_t *positions, int64_t context_len, const int64_t *rot_starts, const int32_t *rot_ids,
                 const float *rot_cos, const float *rot_sin, int64_t num_angles, int64_t num_rows, int64_t max_blocks,
                 int heads, int kv_heads, int dim, int block_size, float scale, int dtype, int kv_dtype) {
    const int64_t query_starts[2] = {0, num_rows};
    Args a = {q, k_cache, NULL, NULL, block_table, query_starts, positions, &context_len, rot_starts, rot_ids,
              rot_cos, rot_sin, max_blocks, heads, kv_heads, dim, block_size, dtype, kv_dtype, 0, 0, 0, scale, 0};
    int status = check(&a, 1, num_rows, num_angles);
    if (status != 0) return status;
    a.groups = heads / kv_heads;
    if (num_rows * a.groups > TILE_ROWS) return -2; /* a few rows: one unit a KV head */
    a.row_groups = (int)((num_rows * a.groups + LANES - 1) / LANES);
    int64_t ranges = (context_len + SCORE_RANGE - 1) / SCORE_RANGE;
    int failed = 0;
#pragma omp parallel
    {
        FLUSH_DENORMALS_BEGIN
        Scratch s;
        int ready = scratch_new(&a, &s);
        if (!ready) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < kv_heads * ranges; task++) {
            Unit u = {0, 0, context_len, (int)num_rows, (int)(task / ranges), 0, 1};
            int64_t begin = task % ranges * SCORE_RANGE;
            int64_t end = begin + SCORE_RANGE < context_len ? begin + SCORE_RANGE : context_len;
            if (ready) score_range(&a, &s, &u, begin, end, scores, context_len);
        }
        scratch_free(&s);
        FLUSH_DENORMALS_END
    }
    return failed ? -3 : 0;
}
