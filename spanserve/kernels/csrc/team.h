/* A team of OpenMP threads that stays together through a decode step (fused_layers.c): one
 * parallel region for all of a step's kernels, each thread taking its part of each, with a
 * barrier between kernels that spins. A parallel region per kernel wakes the pool per kernel,
 * some 120 times a step, and under OMP_WAIT_POLICY=PASSIVE every wake is a sleeping thread's
 * (tens of microseconds on a virtual machine); OpenMP's own barriers sleep at once under that
 * policy too. Here a step wakes the pool once, as llama.cpp's graph does, and the threads sleep
 * again when the step ends. A spinning thread yields the core after SPINS_BEFORE_YIELD pauses,
 * for a team with more threads than free cores. */
#ifndef SPANSERVE_TEAM_H
#define SPANSERVE_TEAM_H

#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TEAM_PAUSE() _mm_pause()
#else
#define TEAM_PAUSE() ((void)0)
#endif

#define SPINS_BEFORE_YIELD 4096

typedef struct {
    atomic_int arrived, generation;
    atomic_int failed; /* the first nonzero status any part reported */
    int verdict;       /* `failed` as the last part to arrive saw it: the same for every part */
    atomic_int parts;  /* set by each part, to the same count, before it first waits */
    void *shared;      /* what part 0 hands the others across a barrier */
} Team;

static inline int team_parts(Team *t) { return atomic_load_explicit(&t->parts, memory_order_relaxed); }

/* Wait until every part arrives; the team's status (0, or the first failure any part reported
 * before it arrived): every part gets the same, so all leave a failed step at the same barrier. */
static inline int team_wait(Team *t, int status) {
    if (status) {
        int none = 0;
        atomic_compare_exchange_strong(&t->failed, &none, status);
    }
    const int generation = atomic_load_explicit(&t->generation, memory_order_acquire);
    if (atomic_fetch_add_explicit(&t->arrived, 1, memory_order_acq_rel) == team_parts(t) - 1) {
        t->verdict = atomic_load(&t->failed);
        atomic_store_explicit(&t->arrived, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&t->generation, 1, memory_order_release);
    } else {
        for (int spins = 0; atomic_load_explicit(&t->generation, memory_order_acquire) == generation; spins++) {
            if (spins < SPINS_BEFORE_YIELD) TEAM_PAUSE();
            else sched_yield();
        }
    }
    return t->verdict;
}

/* Part `part` of `parts` of the items 0 .. count - 1: [*first, *end), in order. */
static inline void team_share(int64_t count, int part, int parts, int64_t *first, int64_t *end) {
    *first = count * part / parts;
    *end = count * (part + 1) / parts;
}

#endif
