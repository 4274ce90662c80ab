/* Small-M bf16 linear: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), fp32 accumulation, bf16 output.
 *
 * Why: in a decode step M (sequences in the batch) is 1..64 and each weight matrix is read once from
 * DRAM; torch's F.linear (oneDNN) streams bf16 weights at well under the memory bandwidth there. This
 * kernel reads W in its stored row-major layout (no repacked copy) as one sequential stream per thread,
 * software-prefetched into L2 PF_BYTES ahead, and computes with AVX512-BF16 dot products.
 *
 * Scheme: a block of nb consecutive weight rows x mb input rows is held in nb * mb fp32 accumulators
 * (4 x 4 or 8 x 3: all in registers); each 32-element K chunk is one vdpbf16ps per (n, m) pair (K tails:
 * zero-filled masked loads). At the end of K the nb accumulators of each input row are reduced with a
 * transpose-add tree into one vector of nb sums, bias is added in fp32 and the result rounded to bf16
 * (nearest even, NaN kept, like torch). All M rows run against a block while it is in L1, mb at a time.
 * OpenMP splits the blocks statically, so each thread streams one contiguous part of W.
 *
 * Numerics: vdpbf16ps flushes denormals (|v| < 2^-126) to zero, in its inputs and its products; otherwise
 * a result differs from the fp32 reference only by summation order, which is fixed per output: it does
 * not depend on M, the tiling or the thread count (a row's bits do not depend on its batch).
 * Built by native.py (-march=native; without AVX512-BF16 a stub reports itself unavailable); linear.py
 * is the caller.
 */
#include <stdint.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#include <omp.h>

/* Tuned on Zen4 with scripts/linear_microbench.py (weights not in cache, 1 and 2 threads); -D to retune. */
#ifndef PF_BYTES
#define PF_BYTES 16384 /* prefetch distance: 8-32 KiB measured alike, 64 KiB slower */
#endif
#ifndef SMALL_M_MAX
#define SMALL_M_MAX 16 /* up to this M: 4 x 4 tiles (weight reads spread thin), beyond: 8 x 3 */
#endif
#define KC 32 /* bf16 elements per vdpbf16ps (one 64-byte cache line) */
#define INLINE static inline __attribute__((always_inline))

/* Sum pairs of adjacent lanes of a and b within each 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]. */
INLINE __m512 add_pairs_ps(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
}

INLINE __m512 add_pairs_pd(__m512 a, __m512 b) {
    __m512d da = _mm512_castps_pd(a), db = _mm512_castps_pd(b);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(da, db)), _mm512_castpd_ps(_mm512_unpackhi_pd(da, db)));
}

/* Add 128-bit lanes (0+1, 2+3) of a and of b: [a01, a23, b01, b23]. */
INLINE __m512 add_lanes(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* nb (4, 8 or 16) vectors v[i] = acc[i * stride] -> lane i (< nb) holds the sum of v[i]'s 16 lanes.
 * 45 ops for 16 vectors, where 16 _mm512_reduce_add_ps would take ~130 and leave scalars to reassemble. */
INLINE __m512 reduce_rows(const __m512 *acc, int stride, int nb) {
    __m512 p[8], q[4];
#pragma GCC unroll 8
    for (int i = 0; i < nb / 2; i++) p[i] = add_pairs_ps(acc[(2 * i) * stride], acc[(2 * i + 1) * stride]);
#pragma GCC unroll 4
    for (int i = 0; i < nb / 4; i++) q[i] = add_pairs_pd(p[2 * i], p[2 * i + 1]);
    /* q[i], in each 128-bit lane L: rows 4i..4i+3, partial sums over lane L */
    if (nb == 4) { /* lanes 0+1+2+3 into lane 0 */
        __m512 r = add_lanes(q[0], q[0]);
        return add_lanes(r, r);
    }
    __m512 r0 = add_lanes(q[0], q[1]); /* [rows 0-3 (L0+L1), rows 0-3 (L2+L3), rows 4-7 (L0+L1), (L2+L3)] */
    if (nb == 8) return add_lanes(r0, r0);
    return add_lanes(r0, add_lanes(q[2], q[3]));
}

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

/* nb lines of a later block for K chunk `chunk` into L2 (T1: T0 would evict the block in use from L1). */
INLINE void prefetch_chunk(const char *prefetch, int64_t chunk, int nb) {
#pragma GCC unroll 16
    for (int i = 0; i < nb; i++) _mm_prefetch(prefetch + (chunk * nb + i) * 64, _MM_HINT_T1);
}

/* Weight rows w_rows[0..nb) (already clamped to valid rows) . input rows x[0..mb) -> out[m]: mb vectors
 * of nb fp32 sums (low lanes). Also prefetches a later block's lines for K chunks pf_first,
 * pf_first + pf_step, ... (prefetch NULL: none), so that the passes over one block share that sweep. */
INLINE void block_dot(const uint16_t *const *w_rows, const uint16_t *x, int64_t K, int nb, int mb,
                      const char *prefetch, int64_t pf_first, int64_t pf_step, __m512 *out) {
    __m512 acc[32];
#pragma GCC unroll 32
    for (int i = 0; i < nb * mb; i++) acc[i] = _mm512_setzero_ps();
    int64_t k = 0, chunk = 0;
    for (; k + KC <= K; k += KC, chunk++) {
        __m512bh xv[4];
#pragma GCC unroll 4
        for (int m = 0; m < mb; m++) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * K + k);
        if (prefetch != NULL && chunk == pf_first) {
            prefetch_chunk(prefetch, chunk, nb);
            pf_first += pf_step;
        }
#pragma GCC unroll 16
        for (int i = 0; i < nb; i++) {
            __m512bh wv = (__m512bh)_mm512_loadu_si512(w_rows[i] + k);
#pragma GCC unroll 4
            for (int m = 0; m < mb; m++) acc[i * mb + m] = _mm512_dpbf16_ps(acc[i * mb + m], xv[m], wv);
        }
    }
    if (k < K) { /* K tail: zero-filled masked loads add nothing */
        __mmask32 tail = (__mmask32)((1ull << (K - k)) - 1);
        __m512bh xv[4];
#pragma GCC unroll 4
        for (int m = 0; m < mb; m++) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * K + k);
        if (prefetch != NULL && chunk == pf_first) prefetch_chunk(prefetch, chunk, nb); /* last lines */
#pragma GCC unroll 16
        for (int i = 0; i < nb; i++) {
            __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, w_rows[i] + k);
#pragma GCC unroll 4
            for (int m = 0; m < mb; m++) acc[i * mb + m] = _mm512_dpbf16_ps(acc[i * mb + m], xv[m], wv);
        }
    }
#pragma GCC unroll 4
    for (int m = 0; m < mb; m++) out[m] = reduce_rows(acc + m, mb, nb);
}

/* y[m, n0 .. n0 + valid) = bf16(sums[m] + bias) for m < mb; y points at row 0, column 0. */
INLINE void store_block(const __m512 *sums, int mb, const uint16_t *bias, uint16_t *y, int64_t N, int64_t n0,
                        __mmask16 valid) {
    __m512 b = bias != NULL ? bf16_to_ps(_mm256_maskz_loadu_epi16(valid, bias + n0)) : _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int m = 0; m < mb; m++)
        _mm256_mask_storeu_epi16(y + m * N + n0, valid, round_to_bf16(_mm512_add_ps(sums[m], b)));
}

/* One pass: input rows x[0..mb) against the block's weight rows, written to y (row 0 of the pass). */
INLINE void block_pass(const uint16_t *const *rows, const uint16_t *x, const uint16_t *bias, uint16_t *y,
                       int64_t N, int64_t K, int64_t n0, int nb, int mb, __mmask16 valid, const char *prefetch,
                       int64_t pf_first, int64_t pf_step) {
    __m512 sums[4];
    block_dot(rows, x, K, nb, mb, pf_first < pf_step ? prefetch : NULL, pf_first, pf_step, sums);
    store_block(sums, mb, bias, y, N, n0, valid);
}

/* All M input rows against weight rows n0 .. n0 + nb, mb rows per pass (the last pass takes fewer),
 * sweeping the prefetch of the bytes PF_BYTES ahead (while below row n_end): pass p of the first
 * `step` passes takes K chunks p, p + step, ..., so the memory stream is spread over the block's compute
 * instead of bursting in the first pass (measured 10-15% faster from M = 8 on). */
INLINE void row_block(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M,
                      int64_t N, int64_t K, int64_t n0, int64_t n_end, int nb, int mb) {
    const uint16_t *rows[16];
    int64_t valid = N - n0 < nb ? N - n0 : nb;
#pragma GCC unroll 16
    for (int i = 0; i < nb; i++) rows[i] = w + (n0 + (i < valid ? i : valid - 1)) * K;
    __mmask16 mask = (__mmask16)((1u << valid) - 1);
    const char *prefetch = (const char *)(w + n0 * K) + PF_BYTES;
    if (prefetch >= (const char *)(w + n_end * K)) prefetch = NULL;
    int64_t passes = (M + mb - 1) / mb, chunks = (K + KC - 1) / KC;
    int64_t step = passes < chunks ? passes : chunks, p = 0, m = 0;
    for (; m + mb <= M; m += mb, p++)
        block_pass(rows, x + m * K, bias, y + m * N, N, K, n0, nb, mb, mask, prefetch, p, step);
    /* fewer than mb rows left: a constant count per call, so each is its own register-allocated copy */
    if (mb > 3 && M - m == 3) block_pass(rows, x + m * K, bias, y + m * N, N, K, n0, nb, 3, mask, prefetch, p, step);
    if (mb > 2 && M - m == 2) block_pass(rows, x + m * K, bias, y + m * N, N, K, n0, nb, 2, mask, prefetch, p, step);
    if (mb > 1 && M - m == 1) block_pass(rows, x + m * K, bias, y + m * N, N, K, n0, nb, 1, mask, prefetch, p, step);
}

/* This thread's share: a contiguous run of blocks, so its weight reads are one sequential stream. */
INLINE void thread_part(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y, int64_t M,
                        int64_t N, int64_t K, int nb, int mb) {
    int64_t blocks = (N + nb - 1) / nb, threads = omp_get_num_threads(), t = omp_get_thread_num();
    int64_t b0 = blocks * t / threads, b1 = blocks * (t + 1) / threads;
    int64_t n_end = b1 * nb < N ? b1 * nb : N;
    /* the first PF_BYTES: the blocks' own sweeps only prefetch beyond them */
    int64_t warm = (n_end - b0 * nb) * K * 2;
    const char *start = (const char *)(w + b0 * nb * K);
    for (int64_t i = 0; i < (warm < PF_BYTES ? warm : PF_BYTES); i += 64) _mm_prefetch(start + i, _MM_HINT_T1);
    for (int64_t b = b0; b < b1; b++) row_block(x, w, bias, y, M, N, K, b * nb, n_end, nb, mb);
}

int linear_bf16_available(void) { return 1; }

/* x [M, K], w [N, K], bias [N] or NULL, y [M, N]: contiguous bf16 (uint16 bits); num_threads <= 0: the
 * OpenMP default. Returns 0. The tile sizes are literal inside each parallel region: a region is
 * outlined before inlining, so a tile size passed as a variable would not specialise the loops. */
int linear_bf16(const void *x, const void *w, const void *bias, void *y, int64_t M, int64_t N, int64_t K,
                int num_threads) {
    int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
    int parallel = N > 16 && threads > 1;
    if (M <= SMALL_M_MAX) {
#pragma omp parallel num_threads(threads) if (parallel)
        thread_part(x, w, bias, y, M, N, K, 4, 4);
    } else {
#pragma omp parallel num_threads(threads) if (parallel)
        thread_part(x, w, bias, y, M, N, K, 8, 3);
    }
    return 0;
}

#else /* no AVX512-BF16 here: linear.py uses F.linear */

int linear_bf16_available(void) { return 0; }

int linear_bf16(const void *x, const void *w, const void *bias, void *y, int64_t M, int64_t N, int64_t K,
                int num_threads) {
    (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)num_threads;
    return -1;
}

#endif
