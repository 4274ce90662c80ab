/* Read bandwidth of randomly placed blocks, the access pattern of decode attention over a paged KV pool
 * (a block of one layer's K or V: 16 tokens x 3 KV heads x 64 x bf16 = 6 KiB), against sequential reads.
 * Two threads each sum `per_thread` blocks of a 1 GiB huge-page pool, optionally prefetching (into L2)
 * the block `ahead` places further in their order. No arithmetic beyond the sum: the floor a kernel
 * reading this pattern cannot beat.
 *
 *     cc -O2 -march=native -fopenmp scripts/random_block_read.c -o /tmp/random_block_read
 *     /tmp/random_block_read BLOCK_BYTES AHEAD SEQUENTIAL     e.g. 6144 1 0, then 6144 0 1
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

enum { HUGE_PAGE = 2 << 20 };
static volatile float keep;  /* the sums land here, so the reads cannot be optimised away */

static char *huge_pool(size_t bytes) {
    char *p = mmap(NULL, bytes + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    p = (char *)(((uintptr_t)p + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
    madvise(p, bytes, MADV_HUGEPAGE);
    memset(p, 1, bytes);
    return p;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s BLOCK_BYTES AHEAD SEQUENTIAL\n", argv[0]);
        return 2;
    }
    const size_t pool = (size_t)1 << 30, blk = strtoul(argv[1], NULL, 10), per_thread = 20000;
    const int ahead = atoi(argv[2]), sequential = atoi(argv[3]);
    char *p = huge_pool(pool);
    size_t n = pool / blk, *order = malloc(sizeof(size_t) * n);
    if (p == NULL || order == NULL || blk % 64 != 0) return 1;
    for (size_t i = 0; i < n; i++) order[i] = i;
    srand(1);
    for (size_t i = n - 1; !sequential && i > 0; i--) {  /* Fisher-Yates */
        size_t j = (size_t)rand() % (i + 1), t = order[i];
        order[i] = order[j], order[j] = t;
    }
    for (int rep = 0; rep < 4; rep++) {
        double start = omp_get_wtime();
        float sink = 0.0f;
#pragma omp parallel num_threads(2) reduction(+ : sink)
        {
            __m512 acc = _mm512_setzero_ps();
            size_t base = (size_t)(2 * rep + omp_get_thread_num()) * per_thread;
            for (size_t b = 0; b < per_thread; b++) {
                const char *block = p + order[(base + b) % n] * blk;
                if (ahead > 0) {
                    const char *next = p + order[(base + b + ahead) % n] * blk;
                    for (size_t o = 0; o < blk; o += 64) _mm_prefetch(next + o, _MM_HINT_T1);
                }
                for (size_t o = 0; o < blk; o += 64) acc = _mm512_add_ps(acc, _mm512_load_ps((const float *)(block + o)));
            }
            sink += _mm512_reduce_add_ps(acc);
        }
        double seconds = omp_get_wtime() - start;
        keep = sink;
        if (rep > 0)  /* the first pass warms the TLB and the threads */
            printf("block %zu B, ahead %d, %s: %.1f GB/s\n", blk, ahead, sequential ? "sequential" : "random",
                   2.0 * per_thread * blk / seconds / 1e9);
    }
    return 0;
}
