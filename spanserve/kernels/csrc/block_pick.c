/* Block top-k's picks in one call per layer (sparse/builtins.py, BlockTopK): each block's score is
 * its centroid (mean key, per KV head) against the sum of the step's queries of that KV head,
 * summed over KV heads; the `sinks` first blocks, the `recent` last and the best-scoring blocks
 * between them are picked, `slots` in all at most, in order (flow.py's select). In torch the
 * same is a gather of the centroids, a matrix-vector product, a top-k and a sort (about 0.5 ms a
 * layer of Python and small ops); here the centroids are read in place, one block after another,
 * and the picks go straight into the sequence's narrowed block table.
 *
 * Layouts: centroids [pool_blocks][width] float32 (dtype 0) or bfloat16 (1), one layer's, width =
 * KV heads x head dim; block_ids [num_blocks] int64 rows of it; own [num_own] int64; q the step's
 * query rows as the model computes them, [rows][q_row_stride] with [heads][dim] at each row's
 * start (q_dtype 0 or 1), query head h reading KV head h / (heads / kv_heads); table [num_blocks
 * + num_own] int64. Returns how many ids it wrote to table (the picked block ids, then own), or -1
 * for bad sizes or no memory.
 */
#include <stdint.h>
#include <stdlib.h>

#include "common.h"

typedef struct {
    float score;
    int64_t index;
} Scored;

/* The min-heap of the best `size` scores so far: its root is the worst of them. */
static void sift_down(Scored *heap, int64_t size, int64_t i) {
    for (;;) {
        int64_t least = i, left = 2 * i + 1, right = left + 1;
        if (left < size && heap[left].score < heap[least].score) least = left;
        if (right < size && heap[right].score < heap[least].score) least = right;
        if (least == i) return;
        Scored swap = heap[i];
        heap[i] = heap[least];
        heap[least] = swap;
        i = least;
    }
}

static int by_index(const void *a, const void *b) {
    int64_t x = ((const Scored *)a)->index, y = ((const Scored *)b)->index;
    return (x > y) - (x < y);
}

static float score(const void *centroids, int dtype, int64_t row, const float *q_sum, int64_t width) {
    float sum = 0.0f;
    if (dtype == 0) { /* float32: read in place */
        const float *values = (const float *)centroids + row * width;
        for (int64_t d = 0; d < width; d++) sum += values[d] * q_sum[d];
        return sum;
    }
    float values[512];
    for (int64_t d0 = 0; d0 < width; d0 += 512) {
        int n = width - d0 < 512 ? (int)(width - d0) : 512;
        load_floats(centroids, row * width + d0, n, dtype, values);
        for (int d = 0; d < n; d++) sum += values[d] * q_sum[d0 + d];
    }
    return sum;
}

/* The sum of each KV head's queries over the rows and the query heads reading it, [kv_heads][dim]
 * as float32. */
static float *query_sum(const void *q, int q_dtype, int64_t rows, int64_t heads, int64_t kv_heads, int64_t dim,
                        int64_t q_row_stride) {
    float *sum = calloc(kv_heads * dim, sizeof(float)), head[512];
    if (sum == NULL) return NULL;
    int64_t group = heads / kv_heads;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            load_floats(q, r * q_row_stride + h * dim, (int)dim, q_dtype, head);
            float *into = sum + (h / group) * dim;
            for (int64_t d = 0; d < dim; d++) into[d] += head[d];
        }
    return sum;
}

int64_t centroid_topk(const void *centroids, int dtype, const int64_t *block_ids, int64_t num_blocks,
                      const int64_t *own, int64_t num_own, const void *q, int q_dtype, int64_t rows, int64_t heads,
                      int64_t kv_heads, int64_t dim, int64_t q_row_stride, int64_t sinks, int64_t recent,
                      int64_t slots, int64_t *table) {
    int64_t width = kv_heads * dim;
    if (num_blocks < 0 || num_own < 0 || kv_heads <= 0 || heads % kv_heads || rows < 0 || dim <= 0 || dim > 512 ||
        q_row_stride < heads * dim || sinks < 0 || recent < 0 || (dtype != 0 && dtype != 1) ||
        (q_dtype != 0 && q_dtype != 1))
        return -1;
    int64_t first = sinks < num_blocks ? sinks : num_blocks;                    /* the middle's first block */
    int64_t last = num_blocks - recent > first ? num_blocks - recent : first;  /* the window's first block */
    int64_t room = slots - first - (num_blocks - last), take = room < last - first ? room : last - first;
    if (take < 0) take = 0;
    Scored *heap = malloc((take ? take : 1) * sizeof(Scored));
    float *q_sum = query_sum(q, q_dtype, rows, heads, kv_heads, dim, q_row_stride);
    if (heap == NULL || q_sum == NULL) {
        free(heap);
        free(q_sum);
        return -1;
    }
    int64_t size = 0;
    for (int64_t i = first; i < last && take > 0; i++) {
        if (i + 4 < last) { /* the rows are scattered over the pool: fetch ahead */
            const char *row = (const char *)centroids + block_ids[i + 4] * width * (dtype ? 2 : 4);
            for (int64_t line = 0; line < width * (dtype ? 2 : 4); line += 64) __builtin_prefetch(row + line);
        }
        Scored s = {score(centroids, dtype, block_ids[i], q_sum, width), i};
        if (size < take) {
            heap[size++] = s;
            if (size == take)
                for (int64_t j = take / 2 - 1; j >= 0; j--) sift_down(heap, take, j);
        } else if (s.score > heap[0].score) {
            heap[0] = s;
            sift_down(heap, take, 0);
        }
    }
    qsort(heap, size, sizeof(Scored), by_index);
    int64_t n = 0;
    for (int64_t i = 0; i < first; i++) table[n++] = block_ids[i];
    for (int64_t i = 0; i < size; i++) table[n++] = block_ids[heap[i].index];
    for (int64_t i = last; i < num_blocks; i++) table[n++] = block_ids[i];
    for (int64_t i = 0; i < num_own; i++) table[n++] = own[i];
    free(heap);
    free(q_sum);
    return n;
}
