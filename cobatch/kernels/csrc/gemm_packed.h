/* The frame the packed-weight GEMMs share (gemm_bf16.c, gemm_f32.c): the tile geometry, the packed
 * block rule, the work split over threads, the prefetch policy and the drivers that tie them together.
 * Each GEMM file brings only its micro-tile (a PackedKernel: its element size, the K values one panel
 * line holds, its tile function and the SiLU-multiply epilogue of its dtype).
 *
 * The packed layouts differ only in what one 64-byte panel line holds: 16 outputs' K pair (bf16,
 * vdpbf16ps) or 16 outputs' single K value (fp32, vfmadd231ps). With `step` K values per line and
 * B panels per block (block_panels):
 *
 *     packed[b][s][c][t] = W[16 B b + c][step s + t]    (s < K / step, c < 16 B, t < step)
 *
 * so a panel group (NZ panels) sits at NZ g K 16 elements from the start in either block size: with
 * B = NZ a group is one sequential stream, with B = 1 it is NZ streams (one per panel). Which one is
 * faster depends on the CPU's prefetchers, so each kernel says (PackedKernel.sequential): gemm_bf16.c's
 * header has the Zen 4 measurements behind B = NZ, gemm_f32.c's the Intel ones behind B = 1.
 */
#ifndef COBATCH_GEMM_PACKED_H
#define COBATCH_GEMM_PACKED_H

#include <immintrin.h>
#include <omp.h>

#include "cobatch_kernels.h"
#include "parallel.h"

#define NR 16  /* output columns per panel (one zmm of fp32) */
#define MR 8   /* input rows per micro-tile */
#define NZ 3   /* panels per micro-tile: MR * NZ = 24 accumulators + NZ weights + 1 broadcast <= 32 zmm */
#ifndef MC
#define MC 256 /* input rows per task at prefill sizes (64..512 measured alike at M = 512 and 2048) */
#endif
/* Prefetch of the next panel group (Zen4, scripts/linear_microbench.py, weights not in cache): into L1
 * (T0) beats L2 (T1) by 7% at M = 32 and is even at M = 1..8; none is 5-7% slower; 2 or 3 groups ahead
 * no better. With sequential groups (B = NZ) the hardware prefetcher does better alone below PF_MIN_M
 * rows (1.1-1.2x at M = 1..12); from there to PF_L1_MIN_M a prefetch into L2 pays (1.09x at M = 16,
 * 1.33x at 20, where T0 was slower than none), and into L1 from 24 rows on (1.03-1.08x). -D to retune. */
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T0
#endif
#ifndef PF_MIN_M
#define PF_MIN_M 16 /* with B = NZ: software prefetch from this many rows on */
#endif
#ifndef PF_L1_MIN_M
#define PF_L1_MIN_M 24 /* with B = NZ: into L1 (PF_HINT) from this many rows on, into L2 below */
#endif
#ifndef PF_AHEAD
#define PF_AHEAD 1 /* groups ahead (0: no software prefetch) */
#endif
#define INLINE static inline __attribute__((always_inline))

/* Where a tile prefetches: lines of the next group, one line of each panel every `every` K steps,
 * starting at step `phase` (so the group's tiles share the sweep). next NULL: no prefetch. */
typedef struct {
    const void *next;
    int64_t phase, every;
    int to_l2;  /* hint T1 (L2) instead of PF_HINT */
} Prefetch;

/* Where a group's K step s of panel z sits, in elements from the group's start: z * zstride + s * kstride. */
typedef struct { int64_t zstride, kstride; } Strides;

/* One issue of a tile's share of the prefetch, at K step s: each panel's line of the next group, when
 * the countdown (started at pf->phase) reaches it. esize: bytes per element. */
INLINE void prefetch_step(const Prefetch *pf, int64_t *countdown, Strides st, int64_t s, int nz, int64_t esize) {
    if ((*countdown)-- != 0) return;
#pragma GCC unroll 3
    for (int z = 0; z < nz; z++) {
        const char *line = (const char *)pf->next + esize * (z * st.zstride + s * st.kstride);
        if (pf->to_l2) _mm_prefetch(line, _MM_HINT_T1);
        else _mm_prefetch(line, PF_HINT);
    }
    *countdown = pf->every - 1;
}

/* A micro-tile over kc K values: y[0..mr, 0..16 nz) (+)= x[0..mr, 0..kc) . panels wp[0..nz) (+ bias);
 * x's rows ldx apart, y's ldy; accumulate: add to the fp32 partial sums y holds (a K block after the
 * first: gemm_f32 only). */
typedef void (*TileFn)(const void *x, int64_t ldx, int64_t kc, const void *wp, Strides st, const void *bias,
                       void *y, int64_t ldy, int mr, int nz, Prefetch pf, int accumulate);
/* A TileFn over a tile function taking literal sizes: each (mr, nz) its own fully unrolled copy (tile
 * sizes must be literals for the registers to work out). */
#define TILE_CASE(TILE, R, Z) case (R) * 4 + (Z): TILE(x, ldx, kc, wp, st, bias, y, ldy, R, Z, pf, accumulate); break;
#define TILE_CASES(TILE, R) TILE_CASE(TILE, R, 1) TILE_CASE(TILE, R, 2) TILE_CASE(TILE, R, 3)
#define DEFINE_TILE_ANY(NAME, TILE)                                                                       \
    static void NAME(const void *x, int64_t ldx, int64_t kc, const void *wp, Strides st, const void *bias,  \
                     void *y, int64_t ldy, int mr, int nz, Prefetch pf, int accumulate) {                   \
        switch (mr * 4 + nz) {                                                                              \
            TILE_CASES(TILE, 1) TILE_CASES(TILE, 2) TILE_CASES(TILE, 3) TILE_CASES(TILE, 4)                \
            TILE_CASES(TILE, 5) TILE_CASES(TILE, 6) TILE_CASES(TILE, 7) TILE_CASES(TILE, 8)                \
            TILE_CASES(TILE, 9)                                                                             \
            default: break;                                                                                 \
        }                                                                                                   \
    }
#if defined(__AVX512F__)
/* A tile's fp32 accumulators (gemm_f32.c, gemm_f32_wbf16.c): the partial sums y holds (accumulate: a K block
 * after the first, reloaded exactly) or zeros. */
INLINE void f32_tile_start(__m512 *acc, const float *y, int64_t ldy, int mr, int nz, int accumulate) {
#pragma GCC unroll 9
    for (int m = 0; m < mr; m++)
#pragma GCC unroll 3
        for (int z = 0; z < nz; z++)
            acc[m * NZ + z] = accumulate ? _mm512_loadu_ps(y + m * ldy + z * NR) : _mm512_setzero_ps();
}

/* A tile's fp32 accumulators (+ bias, NULL: none) into y. */
INLINE void f32_tile_store(const __m512 *acc, const float *bias, float *y, int64_t ldy, int mr, int nz) {
#pragma GCC unroll 3
    for (int z = 0; z < nz; z++) {
        __m512 b = bias != NULL ? _mm512_loadu_ps(bias + z * NR) : _mm512_setzero_ps();
#pragma GCC unroll 9
        for (int m = 0; m < mr; m++) _mm512_storeu_ps(y + m * ldy + z * NR, _mm512_add_ps(acc[m * NZ + z], b));
    }
}
#elif defined(__AVX2__)
/* An AVX2 tile's accumulators for panel z (two 8-lane halves per row; gemm_f32.c, gemm_f32_wbf16.c): the
 * partial sums y holds (accumulate) or zeros. */
INLINE void f32_panel_start(__m256 acc[][2], const float *y, int64_t ldy, int mr, int z, int accumulate) {
    for (int m = 0; m < mr; m++)
        for (int h = 0; h < 2; h++)
            acc[m][h] = accumulate ? _mm256_loadu_ps(y + m * ldy + z * NR + 8 * h) : _mm256_setzero_ps();
}

/* Panel z's accumulators (+ bias, NULL: none) into y. */
INLINE void f32_panel_store(__m256 acc[][2], const float *bias, float *y, int64_t ldy, int mr, int z) {
    for (int h = 0; h < 2; h++) {
        const __m256 b = bias != NULL ? _mm256_loadu_ps(bias + z * NR + 8 * h) : _mm256_setzero_ps();
        for (int m = 0; m < mr; m++) _mm256_storeu_ps(y + m * ldy + z * NR + 8 * h, _mm256_add_ps(acc[m][h], b));
    }
}
#endif

/* The SiLU-multiply epilogue of a dtype (fused_ops.c: silu_mul_rows_bf16 / silu_mul_rows_f32). */
typedef void (*SiluRowsFn)(const void *gate, const void *up, void *out, int64_t rows, int64_t width,
                           int64_t in_stride, int64_t out_stride);

/* What a GEMM file brings to the frame. */
typedef struct {
    int64_t esize, step;  /* bytes per weight element; K values per panel line (bf16: 2, fp32: 1) */
    int64_t xsize;        /* bytes per element of x, bias and y (gemm_f32_wbf16.c: fp32 on bf16 weights) */
    int64_t max_kc;       /* K values per block at most (0: K in one block; blocks need fp32 outputs) */
    int sequential;       /* blocks of NZ panels where N allows (one stream per group), else always 1 */
    int rows;             /* input rows per micro-tile: MR (an AVX-512 tile, which takes one more), 4 (AVX2), 16 (AMX) */
    TileFn tile;
    SiluRowsFn silu_rows;
} PackedKernel;

/* Panels per packed block (B above): NZ when the kernel wants sequential groups and they divide the
 * panel count, else 1 (linear.py's block_columns: both sides must agree). */
static inline int64_t block_panels(const PackedKernel *kn, int64_t N) {
    return kn->sequential && (N / NR) % NZ == 0 ? NZ : 1;
}

/* A group's strides for `steps` K steps of `line` elements (one panel's 16 outputs at one step). */
static inline Strides group_strides(const PackedKernel *kn, int64_t N, int64_t steps, int64_t line) {
    return block_panels(kn, N) == NZ ? (Strides){line, line * NZ} : (Strides){steps * line, line};
}

/* K values per block: K in the fewest blocks of at most max_kc, evened out and rounded up to whole panel
 * lines of `step` values (a function of K alone, so the summation order is too). */
static inline int64_t k_block(int64_t K, int64_t max_kc, int64_t step) {
    if (max_kc <= 0 || K <= max_kc) return K;
    const int64_t blocks = (K + max_kc - 1) / max_kc, kc = (K + blocks - 1) / blocks;
    return (kc + step - 1) / step * step;
}

/* One call's operands (wp's elements of esize bytes, the others' of xsize) and the prefetch policy
 * (prefetch_policy). */
typedef struct {
    const PackedKernel *kernel;
    const void *x, *wp, *bias;
    void *y;
    int64_t M, N, K;
    int prefetch, to_l2;
} GemmArgs;

/* `rows` rows of x (from row m0) against panel group g (panels NZ g .. NZ g + nz) into y (the first
 * row's column 16 NZ g, rows ldy apart), prefetching next (NULL: none; the group after it, at the end
 * of this thread's run). With K in blocks (k_block) every tile runs one block before the next begins,
 * so the group's block stays in L2 and each tile's x rows in L1 across the tiles (a large K otherwise
 * streamed a 1.5 MB group from L3 once per tile); the last block adds the bias and prefetches the next
 * group's first block. A short tile would issue its share of the prefetch in a burst, so where the
 * tiles prefetch, a rest under MR / 2 rows is spread over all of them (17 rows: 6 + 6 + 5, 1.07x; 25:
 * 1.04x) and a longer rest takes no share (28 rows: 8 + 8 + 8 + 4, 1.18x). Without prefetch a 1-row
 * rest joins the first tile (9 rows: 27 accumulators, 31 registers in all), as a tile of its own it
 * would wait on its 3 accumulator chains (M = 9: 1.06x; 5 + 4 was 3% slower than 8 + 1). A row's
 * arithmetic does not depend on its tile's height. */
static void group_rows(const GemmArgs *a, int64_t m0, int64_t rows, int64_t g, void *y, int64_t ldy,
                       const void *next) {
    const PackedKernel *kn = a->kernel;
    const int64_t panels = a->N / NR, p0 = g * NZ, K = a->K, es = kn->esize, xs = kn->xsize;
    const int nz = (int)(panels - p0 < NZ ? panels - p0 : NZ), R = kn->rows;
    const Strides st = group_strides(kn, a->N, K / kn->step, NR * kn->step);
    const int balance = a->prefetch && rows % R != 0 && rows % R < R / 2;
    const int absorb = !balance && R == MR && rows > R && rows % R == 1;
    const int64_t tiles = absorb ? rows / R : (rows + R - 1) / R;
    const int64_t sharing = balance || absorb || rows < R ? tiles : rows / R;  /* the tiles that prefetch */
    const char *wp = (const char *)a->wp + es * p0 * K * NR;
    const char *bias = a->bias != NULL ? (const char *)a->bias + xs * p0 * NR : NULL;
    const int64_t kc = k_block(K, kn->max_kc, kn->step);
    for (int64_t k0 = 0; k0 < K; k0 += kc) {
        const int64_t len = K - k0 < kc ? K - k0 : kc;
        const int last = k0 + len == K;
        int64_t m = 0;
        for (int64_t t = 0; t < tiles; t++) {
            int mr;
            if (balance) mr = (int)(rows / tiles + (t < rows % tiles));
            else if (absorb && t == 0) mr = R + 1;
            else mr = (int)(rows - m < R ? rows - m : R);
            Prefetch pf = {last && t < sharing ? next : NULL, t, sharing, a->to_l2};
            kn->tile((const char *)a->x + xs * ((m0 + m) * K + k0), K, len, wp + es * (k0 / kn->step) * st.kstride,
                     st, last ? bias : NULL, (char *)y + xs * m * ldy, ldy, mr, nz, pf, k0 > 0);
            m += mr;
        }
    }
}

/* Work split: thread i owns the contiguous run of tasks [n i / nt, n (i + 1) / nt) and takes it front to
 * back (at decode sizes: its part of the weight, streamed in order); once done, it takes tasks from the
 * back of the other runs, one at a time. Why: on this shared machine one core is often slower than the
 * other for a while, and with the static split alone the faster one waited 2-5% of the GEMM time of a
 * decode step (up to ~10% in noisy moments; measured at B = 35). Which thread computes a task changes
 * no bits. A run's bounds share one atomic word, so a task is taken exactly once. */
typedef struct { _Alignas(64) uint64_t bounds; } Run;  /* next task (low 32 bits), end (high 32 bits) */

static inline uint64_t run_bounds(int64_t next, int64_t end) { return (uint64_t)next | (uint64_t)end << 32; }

static inline int64_t run_end(Run *r) { return (int64_t)(__atomic_load_n(&r->bounds, __ATOMIC_RELAXED) >> 32); }

static void init_runs(Run *runs, int threads, int64_t tasks) {
    for (int i = 0; i < threads; i++) runs[i].bounds = run_bounds(tasks * i / threads, tasks * (i + 1) / threads);
}

/* Run r's first task (from_back: its last), or -1 when it has none left. */
static inline int64_t take(Run *r, int from_back) {
    uint64_t cur = __atomic_load_n(&r->bounds, __ATOMIC_RELAXED);
    for (;;) {
        int64_t next = (int64_t)(cur & 0xffffffffu), end = (int64_t)(cur >> 32);
        if (next >= end) return -1;
        uint64_t want = from_back ? run_bounds(next, end - 1) : run_bounds(next + 1, end);
        if (__atomic_compare_exchange_n(&r->bounds, &cur, want, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return from_back ? end - 1 : next;
    }
}

/* Thread me's next task: the front of its own run (*own = 1), else the back of another's; -1 when all are
 * done. Runs without an owner (a team smaller than asked for) are taken from the back too. */
static inline int64_t next_task(Run *runs, int threads, int me, int *own) {
    int64_t task = me < threads ? take(&runs[me], 0) : -1;
    *own = task >= 0;
    for (int k = 1; task < 0 && k <= threads; k++) task = take(&runs[(me + k) % threads], 1);
    return task;
}


/* Software prefetch of the next group: with single panels always (their NZ streams); with sequential
 * groups from PF_MIN_M rows on, into L2 below PF_L1_MIN_M (see the constants). */
static inline void prefetch_policy(GemmArgs *a) {
    const int sequential = block_panels(a->kernel, a->N) == NZ;
    a->prefetch = PF_AHEAD > 0 && (!sequential || a->M >= PF_MIN_M);
    a->to_l2 = sequential && a->M < PF_L1_MIN_M;
}

/* A thread's tasks of run_gemm (next_task): each group's rows, with the group PF_AHEAD ahead prefetched. */
static void gemm_tasks(GemmArgs *a, Run *runs, int threads) {
    const int64_t M = a->M, N = a->N, K = a->K, esize = a->kernel->esize, chunks = (M + MC - 1) / MC;
    int own, me = omp_get_thread_num();
    for (int64_t task; (task = next_task(runs, threads, me, &own)) >= 0;) {
        int64_t g = task / chunks, c = task % chunks;
        int64_t m0 = c * MC, m1 = m0 + MC < M ? m0 + MC : M;
        /* prefetch the next group when this is the last chunk of the group and the next is ours */
        const void *next = NULL;
        if (a->prefetch && own && c == chunks - 1 && task + PF_AHEAD < run_end(&runs[me])
            && (g + PF_AHEAD) * NZ < N / NR)
            next = (const char *)a->wp + esize * (g + PF_AHEAD) * NZ * K * NR;
        group_rows(a, m0, m1 - m0, g, (char *)a->y + a->kernel->xsize * (m0 * N + g * NZ * NR), N, next);
    }
}

/* y [M, N] = x [M, K] W^T (+ bias): tasks are (panel group, chunk of MC rows), group-major. */
static void run_gemm(GemmArgs *a, int num_threads) {
    const int64_t groups = (a->N / NR + NZ - 1) / NZ, chunks = (a->M + MC - 1) / MC, tasks = groups * chunks;
    prefetch_policy(a);
    const int threads = team_size(num_threads, tasks);
    Run runs[threads];
    init_runs(runs, threads, tasks);
    RUN_TEAM(threads, gemm_tasks(a, runs, threads));
}

/* A thread's tasks of run_gemm_silu (next_task). */
static void gemm_silu_tasks(GemmArgs *a, Run *runs, int threads) {
    const int64_t M = a->M, inter = a->N / 2, width = NZ * NR, K = a->K, esize = a->kernel->esize;
    const int64_t pairs = inter / width, chunks = (M + MC - 1) / MC;
    _Alignas(64) float gate[MC * NZ * NR], up[MC * NZ * NR];  /* fp32-sized: either dtype fits */
    int own, me = omp_get_thread_num();
    for (int64_t task; (task = next_task(runs, threads, me, &own)) >= 0;) {
        int64_t j = task / chunks, c = task % chunks;
        int64_t m0 = c * MC, rows = (m0 + MC < M ? MC : M - m0);
        /* prefetch the next group this thread has not read yet, as run_gemm does: with one task per
         * pair, the pair's up group, then the next pair's gate (if that task is ours); else, at a
         * pair's last chunk, the next pair's two groups */
        const int next_ours = own && task + 1 < run_end(&runs[me]);
        const void *next[2] = {NULL, NULL};
        for (int h = 0; h < 2 && a->prefetch && (chunks == 1 || c == chunks - 1); h++) {
            int64_t g = chunks == 1 ? 2 * j + h + 1 : 2 * j + h + 2;
            if ((chunks == 1 && h == 0) || (next_ours && g < 2 * pairs))
                next[h] = (const char *)a->wp + esize * g * NZ * K * NR;
        }
        group_rows(a, m0, rows, 2 * j, gate, width, next[0]);
        group_rows(a, m0, rows, 2 * j + 1, up, width, next[1]);
        a->kernel->silu_rows(gate, up, (char *)a->y + a->kernel->xsize * (m0 * inter + j * width), rows, width,
                             width, inter);
    }
}

/* The MLP's gate/up projection with its activation fused: act[M, inter] = silu(x Wg^T) * (x Wu^T), where the
 * packed weight holds gate and up columns in alternating groups (linear.py, pack_gate_up: group 2j = gate
 * columns 16 NZ j.., group 2j + 1 = the same up columns; inter % (16 NZ) == 0). Each task computes one
 * such pair for up to MC rows into two small buffers, as run_gemm computes them, and the kernel's
 * silu_rows turns them into its slice of act: the same bits as the GEMM then silu_mul. Why: a prefill
 * step's [M, 2 inter] gate/up output (12.5 MB at 2k tokens here, bf16) is no longer written out and read
 * back; each slice is consumed from L1/L2 while hot. a->N = 2 inter; a->y = act. */
static void run_gemm_silu(GemmArgs *a, int num_threads) {
    const int64_t tasks = a->N / 2 / (NZ * NR) * ((a->M + MC - 1) / MC);
    prefetch_policy(a);
    const int threads = team_size(num_threads, tasks);
    Run runs[threads];
    init_runs(runs, threads, tasks);
    RUN_TEAM(threads, gemm_silu_tasks(a, runs, threads));
}

/* Rows ids[0..n) of the weight a packed [N, K] tensor holds, into out [n, K] (a tied embedding table's
 * lookup): each row is K / step units of 4 bytes (a bf16 K pair or one fp32 value), 16 B of them apart
 * in the layout; gathered in C instead of torch's advanced indexing (~0.1 ms a decode step). Returns 0,
 * or -2 on an id outside [0, N). */
static inline int packed_rows(const PackedKernel *kn, const void *wp, const int64_t *ids, int64_t n, int64_t N,
                       void *out, int64_t K) {
    const int64_t c = NR * block_panels(kn, N), units = K / kn->step;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= N) return -2;
    for (int64_t i = 0; i < n; i++) {
        const uint32_t *block = (const uint32_t *)wp + ids[i] / c * units * c + ids[i] % c;
        uint32_t *row = (uint32_t *)out + i * units;
        for (int64_t s = 0; s < units; s++) row[s] = block[s * c];
    }
    return 0;
}

#endif /* COBATCH_GEMM_PACKED_H */
