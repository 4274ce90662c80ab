/* bf16 GEMM on a packed weight: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), fp32 accumulation, bf16 out.
 *
 * Why: one kernel for every M, decode (M = 1..64, weights streamed from DRAM once per step) and prefill
 * (M in the thousands, compute-bound), at the machine's limit in both. The weight is repacked once at
 * load time (kernels/linear.py, plain torch) into blocks of B panels of 16 output columns whose K pairs
 * interleave:
 *
 *     packed[b][kk][c][t] = W[16 B b + c][2 kk + t]    (b < N/16B, kk < K/2, c < 16 B, t < 2)
 *
 * so one 64-byte line holds one K pair of 16 outputs (panel p = B b + c / 16): exactly the B operand of
 * vdpbf16ps. B = NZ (3) when the panel count allows it, else 1 (block_panels; linear.py has the same
 * rule): then the NZ panels a micro-tile reads sit side by side, and a group is one sequential stream
 * (kk-major) that the hardware prefetcher follows across groups. Measured against B = 1 (three streams
 * 18 KB apart per group) with the weights not in cache: 1.09x at M = 1, 1.23x at M = 8, 1.02-1.04x at
 * M = 16..64 (scripts/linear_microbench.py-style A/B, one process). A micro-tile of
 * MR input rows x NZ panels keeps MR * NZ fp32 vectors of results in registers; per K pair it loads NZ
 * weight lines and broadcasts MR pairs of x, then does MR * NZ dot products (8 x 3: 24 of them for 11
 * loads, no horizontal sums: each lane is one output). Rows are taken 8 at a time against a group of
 * NZ panels, so a group read from DRAM by the first tile is reused from L1/L2 by the others; while a
 * group computes, the group after it is prefetched, spread over its tiles (group_rows says which).
 *
 * Work split: tasks are (panel group, chunk of MC rows), group-major, and each OpenMP thread takes one
 * contiguous run of them, so at decode sizes each thread streams one contiguous part of the weight; a
 * thread done early takes tasks from the back of the others' runs (init_runs, below).
 *
 * Numerics: each output is summed over K pairs in order, in fp32 (vdpbf16ps: denormal inputs and products
 * flush to zero), then rounded once to bf16 (nearest even, NaN kept, as torch does). The order does not
 * depend on M, the tiling or the thread count: a row's bits do not depend on its batch.
 * Built by kernels/build.py (-march=native; without AVX512-BF16 a stub reports itself unavailable).
 */
#include "cobatch_kernels.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#include <omp.h>

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

/* fp32 -> bf16, round to nearest even, NaN stays a (quiet) NaN: torch's c10::BFloat16 conversion.
 * (vcvtneps2bf16 would flush denormals; this keeps them, as torch does.) */
INLINE __m256i round_to_bf16(__m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
}

INLINE __m512 bf16_to_ps(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }

INLINE uint32_t load_pair(const uint16_t *p) { /* x rows need not be 4-byte aligned */
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Where a tile prefetches: lines of the next group, one K pair of each panel every `every` pairs,
 * starting at pair `phase` (so the group's tiles share the sweep). next NULL: no prefetch. */
typedef struct {
    const uint16_t *next;
    int64_t phase, every;
    int to_l2;  /* hint T1 (L2) instead of PF_HINT */
} Prefetch;

/* Where a group's K pair kk of panel z sits, in elements from the group's start: z * zstride + kk *
 * kstride (B = NZ: 32 and 32 NZ; B = 1: 16 K and 32). */
typedef struct { int64_t zstride, kstride; } Strides;

/* y[0..mr, 0..16 nz) = x[0..mr] . panels wp[0..nz) (+ bias); y's rows ldy apart. */
INLINE void tile(const uint16_t *x, int64_t K, const uint16_t *wp, Strides st,
                 const uint16_t *bias, uint16_t *y, int64_t ldy, int mr, int nz, Prefetch pf) {
    __m512 acc[(MR + 1) * NZ];  /* up to MR + 1 rows: see group_rows */
#pragma GCC unroll 8
    for (int m = 0; m < mr; m++)
#pragma GCC unroll 3
        for (int z = 0; z < nz; z++) acc[m * NZ + z] = _mm512_setzero_ps();
    const int64_t pairs = K / 2;
    int64_t countdown = pf.next != NULL ? pf.phase : pairs;
    for (int64_t kk = 0; kk < pairs; kk++) {
        __m512bh w[NZ];
#pragma GCC unroll 3
        for (int z = 0; z < nz; z++) w[z] = (__m512bh)_mm512_loadu_si512(wp + z * st.zstride + kk * st.kstride);
        if (countdown-- == 0) {
#pragma GCC unroll 3
            for (int z = 0; z < nz; z++) {
                const char *line = (const char *)(pf.next + z * st.zstride + kk * st.kstride);
                if (pf.to_l2) _mm_prefetch(line, _MM_HINT_T1);
                else _mm_prefetch(line, PF_HINT);
            }
            countdown = pf.every - 1;
        }
#pragma GCC unroll 8
        for (int m = 0; m < mr; m++) {
            __m512bh xb = (__m512bh)_mm512_set1_epi32((int)load_pair(x + m * K + 2 * kk));
#pragma GCC unroll 3
            for (int z = 0; z < nz; z++) acc[m * NZ + z] = _mm512_dpbf16_ps(acc[m * NZ + z], xb, w[z]);
        }
    }
#pragma GCC unroll 3
    for (int z = 0; z < nz; z++) {
        __m512 b = bias != NULL ? bf16_to_ps(_mm256_loadu_si256((const __m256i *)(bias + z * NR))) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int m = 0; m < mr; m++)
            _mm256_storeu_si256((__m256i *)(y + m * ldy + z * NR), round_to_bf16(_mm512_add_ps(acc[m * NZ + z], b)));
    }
}

/* Each (mr, nz) its own fully unrolled copy: tile sizes must be literals for the registers to work out. */
#define CASE(R, Z) case (R) * 4 + (Z): tile(x, K, wp, st, bias, y, ldy, R, Z, pf); break;
#define CASES(R) CASE(R, 1) CASE(R, 2) CASE(R, 3)
static void tile_any(const uint16_t *x, int64_t K, const uint16_t *wp, Strides st, const uint16_t *bias,
                     uint16_t *y, int64_t ldy, int mr, int nz, Prefetch pf) {
    switch (mr * 4 + nz) {
        CASES(1) CASES(2) CASES(3) CASES(4) CASES(5) CASES(6) CASES(7) CASES(8) CASES(9)
        default: break;
    }
}

/* Panels per packed block (B above): NZ when they divide the panel count, else 1. */
static inline int64_t block_panels(int64_t N) { return (N / NR) % NZ == 0 ? NZ : 1; }

/* `rows` rows of x against panel group g (panels NZ g .. NZ g + nz) into y (the first row's column 16 NZ g,
 * rows ldy apart), prefetching the group after it (next: NULL at the end of this thread's run; into L2
 * with to_l2; spread_rest: this call prefetches). Either layout puts group g at NZ g K NR elements. */
static void group_rows(const uint16_t *x, const uint16_t *wp, const uint16_t *bias, uint16_t *y, int64_t ldy,
                       int64_t rows, int64_t N, int64_t K, int64_t g, const uint16_t *next, int to_l2,
                       int spread_rest) {
    const int64_t panels = N / NR, p0 = g * NZ;
    const int nz = (int)(panels - p0 < NZ ? panels - p0 : NZ);
    const Strides st = block_panels(N) == NZ ? (Strides){2 * NR, 2 * NR * NZ} : (Strides){K * NR, 2 * NR};
    /* Tiles of MR rows and the rest. A short tile would issue its share of the prefetch in a burst, so
     * where the tiles prefetch, a rest under MR / 2 rows is spread over all of them (17 rows: 6 + 6 + 5,
     * 1.07x; 25: 1.04x) and a longer rest takes no share (28 rows: 8 + 8 + 8 + 4, 1.18x). Without
     * prefetch a 1-row rest joins the first tile (9 rows: 27 accumulators, 31 registers in all), as a
     * tile of its own it would wait on its 3 accumulator chains (M = 9: 1.06x; 5 + 4 was 3% slower than
     * 8 + 1). A row's arithmetic does not depend on its tile's height. */
    const int balance = spread_rest && rows % MR != 0 && rows % MR < MR / 2;
    const int absorb = !balance && rows > MR && rows % MR == 1;
    const int64_t tiles = absorb ? rows / MR : (rows + MR - 1) / MR;
    const int64_t sharing = balance || absorb || rows < MR ? tiles : rows / MR;  /* the tiles that prefetch */
    int64_t m = 0;
    for (int64_t t = 0; t < tiles; t++) {
        int mr;
        if (balance) mr = (int)(rows / tiles + (t < rows % tiles));
        else if (absorb && t == 0) mr = MR + 1;
        else mr = (int)(rows - m < MR ? rows - m : MR);
        Prefetch pf = {t < sharing ? next : NULL, t, sharing, to_l2};
        tile_any(x + m * K, K, wp + p0 * K * NR, st, bias != NULL ? bias + p0 * NR : NULL, y + m * ldy, ldy,
                 mr, nz, pf);
        m += mr;
    }
}

int gemm_bf16_available(void) { return 1; }

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

/* x [M, K], packed weight (layout above; N % 16 == 0, K even), bias [N] or NULL, y [M, N]: contiguous
 * bf16 (uint16 bits). num_threads <= 0: the OpenMP default. Returns 0, or -2 on a bad shape. */
int gemm_bf16(const void *x, const void *wp, const void *bias, void *y, int64_t M, int64_t N, int64_t K,
              int num_threads) {
    if (N % NR != 0 || K % 2 != 0 || M <= 0) return -2;
    const int64_t groups = (N / NR + NZ - 1) / NZ, chunks = (M + MC - 1) / MC, tasks = groups * chunks;
    int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
    const int prefetch = PF_AHEAD > 0 && (block_panels(N) == 1 || M >= PF_MIN_M);
    const int to_l2 = block_panels(N) == NZ && M < PF_L1_MIN_M;
    if (threads > tasks) threads = (int)tasks;
    Run runs[threads];
    init_runs(runs, threads, tasks);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int own;
        for (int64_t task; (task = next_task(runs, threads, omp_get_thread_num(), &own)) >= 0;) {
            int64_t g = task / chunks, c = task % chunks;
            int64_t m0 = c * MC, m1 = m0 + MC < M ? m0 + MC : M;
            /* prefetch the next group when this is the last chunk of the group and the next is ours */
            const uint16_t *next = NULL;
            if (prefetch && own && c == chunks - 1 && task + PF_AHEAD < run_end(&runs[omp_get_thread_num()])
                && (g + PF_AHEAD) * NZ < N / NR)
                next = (const uint16_t *)wp + (g + PF_AHEAD) * NZ * K * NR;
            group_rows((const uint16_t *)x + m0 * K, wp, bias, (uint16_t *)y + m0 * N + g * NZ * NR, N, m1 - m0,
                       N, K, g, next, to_l2, prefetch);
        }
    }
    return 0;
}

/* The MLP's gate/up projection with its activation fused: act[M, inter] = silu(x Wg^T) * (x Wu^T), where the
 * packed weight holds gate and up columns in alternating groups (linear.py, pack_gate_up: group 2j = gate
 * columns 16 NZ j.., group 2j + 1 = the same up columns; inter % (16 NZ) == 0). Each task computes one
 * such pair for up to MC rows into two small buffers, rounded to bf16 as gemm_bf16 rounds, and fused_ops.c's
 * silu_mul_rows_bf16 turns them into its slice of act: the same bits as gemm_bf16 then
 * silu_mul. Why: a prefill step's [M, 2 inter] gate/up output (12.5 MB at 2k tokens here) is no longer
 * written out and read back; each slice is consumed from L1/L2 while hot. Returns 0, or -2 on a bad shape. */
int gemm_bf16_silu(const void *x, const void *wp, void *act, int64_t M, int64_t inter, int64_t K, int num_threads) {
    const int64_t N = 2 * inter, width = NZ * NR;
    if (inter % width != 0 || K % 2 != 0 || M <= 0) return -2;
    const int64_t pairs = inter / width, chunks = (M + MC - 1) / MC, tasks = pairs * chunks;
    int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
    const int prefetch = PF_AHEAD > 0 && M >= PF_MIN_M, to_l2 = M < PF_L1_MIN_M;
    if (threads > tasks) threads = (int)tasks;
    Run runs[threads];
    init_runs(runs, threads, tasks);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        uint16_t gate[MC * NZ * NR], up[MC * NZ * NR];
        int own;
        for (int64_t task; (task = next_task(runs, threads, omp_get_thread_num(), &own)) >= 0;) {
            int64_t j = task / chunks, c = task % chunks;
            int64_t m0 = c * MC, rows = (m0 + MC < M ? MC : M - m0);
            /* prefetch the next group this thread has not read yet, as gemm_bf16 does: with one task per
             * pair, the pair's up group, then the next pair's gate (if that task is ours); else, at a
             * pair's last chunk, the next pair's two groups */
            const int next_ours = own && task + 1 < run_end(&runs[omp_get_thread_num()]);
            const uint16_t *next[2] = {NULL, NULL};
            for (int h = 0; h < 2 && prefetch && (chunks == 1 || c == chunks - 1); h++) {
                int64_t g = chunks == 1 ? 2 * j + h + 1 : 2 * j + h + 2;
                if ((chunks == 1 && h == 0) || (next_ours && g < 2 * pairs))
                    next[h] = (const uint16_t *)wp + g * NZ * K * NR;
            }
            const uint16_t *xs = (const uint16_t *)x + m0 * K;
            group_rows(xs, wp, NULL, gate, width, rows, N, K, 2 * j, next[0], to_l2, prefetch);
            group_rows(xs, wp, NULL, up, width, rows, N, K, 2 * j + 1, next[1], to_l2, prefetch);
            silu_mul_rows_bf16(gate, up, (uint16_t *)act + m0 * inter + j * width, rows, width, width, inter);
        }
    }
    return 0;
}

/* Rows ids[0..n) of the weight a packed [N, K] tensor holds, into out [n, K] (a tied embedding table's
 * lookup: each row is K/2 pairs 64 bytes apart in the layout, gathered in C instead of torch's advanced
 * indexing, ~0.1 ms a decode step). Returns 0, or -2 on an id outside [0, N). */
int packed_rows_bf16(const void *wp, const int64_t *ids, int64_t n, int64_t N, int64_t K, void *out) {
    const int64_t c = NR * block_panels(N), pairs = K / 2;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= N) return -2;
    for (int64_t i = 0; i < n; i++) {
        const uint32_t *block = (const uint32_t *)wp + ids[i] / c * pairs * c + ids[i] % c;
        uint32_t *row = (uint32_t *)out + i * pairs;
        for (int64_t kk = 0; kk < pairs; kk++) row[kk] = block[kk * c];
    }
    return 0;
}

#else /* no AVX512-BF16 here: linear.py keeps the stored layout */

int gemm_bf16_available(void) { return 0; }

int gemm_bf16(const void *x, const void *wp, const void *bias, void *y, int64_t M, int64_t N, int64_t K,
              int num_threads) {
    (void)x, (void)wp, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)num_threads;
    return -1;
}

int gemm_bf16_silu(const void *x, const void *wp, void *act, int64_t M, int64_t inter, int64_t K, int num_threads) {
    (void)x, (void)wp, (void)act, (void)M, (void)inter, (void)K, (void)num_threads;
    return -1;
}

int packed_rows_bf16(const void *wp, const int64_t *ids, int64_t n, int64_t N, int64_t K, void *out) {
    (void)wp, (void)ids, (void)n, (void)N, (void)K, (void)out;
    return -1;
}

#endif
