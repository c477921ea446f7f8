/* A step's decoder layers in one call, for a float32 model whose projections compute from a GGUF's
 * blocks: per layer the same kernels, in the same order and on the same buffers, as the model's
 * Python code calls them one by one (models/fused_layers.py), so the result is the same to the
 * bit. A decode step of a small model is some 300 such calls, and through Python each cost more
 * than its arithmetic: SmolLM2's batch-1 step spent about 7 of its 17 ms between kernels (an AMD
 * EPYC, 2 threads). A prefill step of a few rows pays the same per call: a warm RAG prompt's
 * relinked tokens and question, and its focus probe.
 *
 * Per layer: h = rms_norm(x); qkv = h Wqkv; q, k rotated and k, v stored (rope_store); attention
 * over the cache (paged_decode, or paged_prefill for a prefill step); x += attn Wo;
 * h = rms_norm(x); x += silu_mul(h Wgate_up) Wdown.
 *
 * A decode step of up to TEAM_MAX_ROWS rows is one parallel region (team.h): each thread takes its
 * share of every projection and of attention, the small row-wise kernels run on one, and the
 * threads wait for each other between kernels, so a step wakes sleeping threads once rather than
 * at each of its some 120 kernels (`spanserve bench throughput`'s batch-1 decode: docs/cpu.md).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fused_kernels.h"
#include "team.h"

/* Up to this many rows a decode step runs as one team (block_gemm_part's direct path): past it, the
 * kernels' own parallel regions (the projections' widened tiles). */
#define TEAM_MAX_ROWS 24

typedef struct Projection { /* one projection's blocks, as block_gemm takes them */
    const uint8_t *codes;
    const void *scale, *offset; /* float32 per group, or int8 where factored */
    const float *factors, *bias;
    int64_t n, n_padded, k;
    int64_t bits, group, int8_x; /* int8_x: x rounded to int8 over 4-bit codes (block_gemm) */
    const struct Projection *next; /* the next output channels, in another width or group; NULL for none */
} Projection;

typedef struct {
    const float *input_norm, *post_norm; /* RMSNorm weights, float32 */
    Projection qkv, o, gate_up, down;
    void *k_cache, *v_cache; /* [num_slots][kv_heads][dim] each, in kv_dtype */
} Layer;

typedef struct {
    int64_t hidden, heads, kv_heads, dim, num_slots, block_size, max_blocks, max_position;
    float eps, scale;
    int64_t kv_dtype;
} Shape;

/* A prefill step's sequences, as paged_prefill takes them: sequence b owns rows query_starts[b] ..
 * query_starts[b + 1] - 1, and its first keys move by the rotation table (rot_*; NULL: none do). */
typedef struct {
    const int64_t *query_starts;
    int64_t num_seqs;
    const int64_t *rot_starts;
    const int32_t *rot_ids;
    const float *rot_cos, *rot_sin;
    int64_t num_angles;
} Chunks;

/* Output channels of a projection, over all its pieces. */
static int64_t width(const Projection *p) {
    int64_t n = 0;
    for (; p != NULL; p = p->next) n += p->n;
    return n;
}

static int piece_gemm(const Projection *p, const float *x, float *out, int64_t rows) {
    return block_gemm(x, p->codes, (int)p->bits, (int)p->group, p->scale, p->offset, p->factors, p->bias, out, rows,
                      p->n, p->n_padded, p->k, (int)p->int8_x);
}

/* out [rows][width(p)] = x p: block_gemm writes whole rows, so a projection of several pieces
 * (BlockLinear's) computes each into `part` and copies it into its columns. */
static int project(const Projection *p, const float *x, float *out, int64_t rows, float *part) {
    if (p->next == NULL) return piece_gemm(p, x, out, rows);
    const int64_t n = width(p);
    int64_t first = 0;
    for (; p != NULL; first += p->n, p = p->next) {
        int status = piece_gemm(p, x, part, rows);
        if (status) return status;
        for (int64_t r = 0; r < rows; r++) memcpy(out + r * n + first, part + r * p->n, p->n * sizeof(float));
    }
    return 0;
}

/* Part `part` of project for a team: its share of each piece's panels, straight into the piece's
 * columns (block_gemm_part's row stride). */
static int project_part(const Projection *p, const float *x, float *out, int64_t rows, int part, int parts) {
    const int64_t n = width(p);
    int status = 0;
    for (int64_t first = 0; p != NULL && !status; first += p->n, p = p->next)
        status = block_gemm_part(x, p->codes, (int)p->bits, (int)p->group, p->scale, p->offset, p->factors, p->bias,
                                 out + first, n, rows, p->n, p->n_padded, p->k, (int)p->int8_x, part, parts);
    return status;
}

static void add_into(float *x, const float *y, int64_t count) {
    for (int64_t i = 0; i < count; i++) x[i] = x[i] + y[i];
}

/* What a step's rows read besides the weights: each row's position (its RoPE angle and, in a
 * prefill chunk, its index among its sequence's keys), the rotary tables, the cache slots its keys
 * and values go to, the sequences' block tables and context lengths, and a prefill step's chunks
 * (NULL: one decoding row per sequence, row r of sequence r). */
typedef struct {
    const int64_t *positions;
    const float *cos, *sin;
    const int64_t *slots, *tables, *lens;
    const Chunks *chunks;
} Step;

/* A kernel's status as the team sees it after a barrier; without a team (NULL), its own. */
static int sync(Team *team, int status) { return team != NULL ? team_wait(team, status) : status; }

/* out = x p: this part's share of its output channels, or all of them without a team (`piece`:
 * project()'s scratch). */
static int projection(const Projection *p, const float *x, float *out, int64_t rows, float *piece, Team *team,
                      int part) {
    return team != NULL ? project_part(p, x, out, rows, part, team_parts(team)) : project(p, x, out, rows, piece);
}

/* Attention of the rows' queries q over the cache into `attended`: a team's part of a decode step's
 * (the kernel's barriers are the team's), or the whole of a decode or prefill step's. */
static int attention(const Shape *s, const Layer *l, const float *q, float *attended, int64_t rows,
                     const Step *step, Team *team, int part) {
    const Chunks *c = step->chunks;
    if (team != NULL)
        return paged_decode_part(q, l->k_cache, l->v_cache, attended, step->tables, step->lens, rows, s->max_blocks,
                                 (int)s->heads, (int)s->kv_heads, (int)s->dim, (int)s->block_size, s->scale, 0,
                                 (int)s->kv_dtype, team, part);
    if (c == NULL)
        return paged_decode(q, l->k_cache, l->v_cache, attended, step->tables, step->lens, rows, s->max_blocks,
                            (int)s->heads, (int)s->kv_heads, (int)s->dim, (int)s->block_size, s->scale, 0,
                            (int)s->kv_dtype);
    return paged_prefill(q, l->k_cache, l->v_cache, attended, step->tables, c->query_starts, step->positions,
                         step->lens, c->rot_starts, c->rot_ids, c->rot_cos, c->rot_sin, c->num_angles, c->num_seqs,
                         rows, s->max_blocks, (int)s->heads, (int)s->kv_heads, (int)s->dim, (int)s->block_size,
                         s->scale, 0, (int)s->kv_dtype);
}

/* One layer over x [rows][hidden] in place; work: row_scratch floats a row. With a team (a decode
 * step, team.h), part `part` of it: its share of the projections and of attention, the small
 * row-wise kernels on part 0 while the others wait, a barrier after each kernel; every part returns
 * the team's status. Without one (NULL), each kernel whole, on its own threads. The same kernels'
 * sums either way, to the bit. */
static int layer(const Layer *l, const Shape *s, float *x, int64_t rows, const Step *step, float *work, Team *team,
                 int part) {
    const int64_t q_size = s->heads * s->dim, kv_size = s->kv_heads * s->dim, qkv_width = q_size + 2 * kv_size;
    float *h = work, *qkv = h + rows * s->hidden, *q = qkv + rows * qkv_width, *k = q + rows * q_size;
    const int64_t wide_width = width(&l->gate_up);
    float *attended = k + rows * kv_size, *wide = attended + rows * q_size, *act = wide + rows * wide_width;
    float *piece = act + rows * (wide_width / 2); /* a piece's output, for projections of several */
    const int first = part == 0;
    int status = sync(team, first ? rms_norm(x, l->input_norm, h, rows, s->hidden, s->eps, 0) : 0);
    if (!status) status = sync(team, projection(&l->qkv, h, qkv, rows, piece, team, part));
    if (!status)
        status = sync(team, !first ? 0 : rope_store(qkv, qkv + q_size, qkv + q_size + kv_size, qkv_width, qkv_width,
                                                    qkv_width, step->positions, step->cos, step->sin,
                                                    s->max_position, q, k, l->k_cache, l->v_cache, step->slots,
                                                    s->num_slots, rows, (int)s->heads, (int)s->kv_heads,
                                                    (int)s->dim, 0, (int)s->kv_dtype));
    if (!status) status = attention(s, l, q, attended, rows, step, team, part);
    if (!status) status = sync(team, projection(&l->o, attended, h, rows, piece, team, part));
    if (!status) {
        int mine = 0;
        if (first) {
            add_into(x, h, rows * s->hidden);
            mine = rms_norm(x, l->post_norm, h, rows, s->hidden, s->eps, 0);
        }
        status = sync(team, mine);
    }
    if (!status) status = sync(team, projection(&l->gate_up, h, wide, rows, piece, team, part));
    if (!status) status = sync(team, first ? silu_mul(wide, act, rows, wide_width / 2, 0) : 0);
    if (!status) status = sync(team, projection(&l->down, act, h, rows, piece, team, part));
    if (!status && first) add_into(x, h, rows * s->hidden); /* a team's next reader is part 0, before a barrier */
    return status;
}

/* The floats of layer()'s scratch per row, for the widest of `layers`. */
static int64_t row_scratch(const Layer *layers, int64_t count, const Shape *s) {
    const int64_t qkv_width = (s->heads + 2 * s->kv_heads) * s->dim;
    int64_t widest = 0, largest = qkv_width > s->hidden ? qkv_width : s->hidden; /* gate/up's; any projection's */
    for (int64_t i = 0; i < count; i++) {
        const int64_t wide_width = width(&layers[i].gate_up);
        widest = wide_width > widest ? wide_width : widest;
    }
    largest = widest > largest ? widest : largest;
    return s->hidden + qkv_width + 2 * s->heads * s->dim + s->kv_heads * s->dim + widest + widest / 2 + largest;
}

/* Layers 0 .. count - 1 over x [rows][hidden] in place: 0, or the first failing kernel's status
 * (-1 shapes, -2 positions or slots, -3 out of memory). A decode step of up to TEAM_MAX_ROWS rows
 * runs as one team (one parallel region for the step); others, each kernel on its own threads. */
static int run_layers(const Layer *layers, int64_t count, const Shape *s, float *x, int64_t rows, const Step *step) {
    if (count < 0 || rows < 0) return -1;
    if (rows == 0 || count == 0) return 0;
    float *work = malloc(rows * row_scratch(layers, count, s) * sizeof(float));
    if (work == NULL) return -3;
    int status = 0;
    if (step->chunks == NULL && rows <= TEAM_MAX_ROWS) {
        Team team = {0};
#pragma omp parallel
        {
            atomic_store_explicit(&team.parts, omp_get_num_threads(), memory_order_relaxed); /* each the same */
            const int part = omp_get_thread_num();
            int failed = 0;
            for (int64_t i = 0; i < count && !failed; i++) failed = layer(&layers[i], s, x, rows, step, work, &team, part);
            if (part == 0) status = failed;
        }
    } else {
        for (int64_t i = 0; i < count && !status; i++) status = layer(&layers[i], s, x, rows, step, work, NULL, 0);
    }
    free(work);
    return status;
}

/* A decode step's layers: one decoding token per sequence, row r of sequence r. */
int decode_layers(const Layer *layers, int64_t count, const Shape *s, float *x, int64_t rows, const int64_t *positions,
                  const float *cos, const float *sin, const int64_t *slots, const int64_t *tables,
                  const int64_t *lens) {
    const Step step = {positions, cos, sin, slots, tables, lens, NULL};
    return run_layers(layers, count, s, x, rows, &step);
}

/* A prefill step's layers (`chunks`: its sequences and their moved keys). */
int prefill_layers(const Layer *layers, int64_t count, const Shape *s, float *x, int64_t rows,
                   const int64_t *positions, const float *cos, const float *sin, const int64_t *slots,
                   const int64_t *tables, const int64_t *lens, const Chunks *chunks) {
    if (chunks == NULL) return -1;
    const Step step = {positions, cos, sin, slots, tables, lens, chunks};
    return run_layers(layers, count, s, x, rows, &step);
}
