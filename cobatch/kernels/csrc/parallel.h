/* How the kernels run a parallel region: on a team of `threads`, or inline on the calling thread when
 * that is one. Why: libgomp forks a team even for one thread (a team allocated, and a futex wake at each
 * of its barriers: ~0.6 us a region on this project's Zen 4, against ~0.03 us inline), and a decode step of
 * a small model runs a few hundred regions (4 GEMMs, 2 norms, RoPE, SiLU, the K / V write and attention a
 * layer), one thread being the server's setting on a busy or small machine. A region's body uses orphaned
 * worksharing (`omp for`), which a lone thread outside any team runs whole; omp_get_thread_num() is 0
 * there. */
#ifndef COBATCH_PARALLEL_H
#define COBATCH_PARALLEL_H

#include <omp.h>
#include <stdint.h>

#define RUN_TEAM(threads, body)                                  \
    do {                                                         \
        const int team_threads_ = (threads);                     \
        if (team_threads_ > 1) {                                 \
            _Pragma("omp parallel num_threads(team_threads_)") { \
                body;                                            \
            }                                                    \
        } else {                                                 \
            body;                                                \
        }                                                        \
    } while (0)

/* The team for `tasks` tasks: num_threads (<= 0: OpenMP's default), at most one a task. */
static inline int team_size(int num_threads, int64_t tasks) {
    const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
    return threads > tasks ? (int)tasks : threads;
}

#endif
