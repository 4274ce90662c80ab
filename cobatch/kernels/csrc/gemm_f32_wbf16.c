/* fp32 GEMM on a packed bf16 weight: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]); x, bias, y fp32.
 *
 * Why: a bf16 checkpoint on a CPU without AVX512-BF16 runs in fp32 (dtype auto), and converting its
 * weights to fp32 doubles the bytes every decode step streams, where one stream is bound by exactly
 * those bytes. A bf16 value is the high half of the fp32 with the same value, so the weight can stay
 * bf16 in memory and become fp32 in registers (what vLLM and llama.cpp call weight-only: stored in one
 * type, computed in another). The layout is gemm_bf16.c's (blocks of B panels, one K pair of 16 outputs
 * per 64-byte line):
 *
 *     packed[b][kk][c][t] = W[16 B b + c][2 kk + t]    (b < N/16B, kk < K/2, c < 16 B, t < 2)
 *
 * with B = 1 always (single panels, as gemm_f32.c measured on this Intel Xeon: one stream per panel).
 * A 32-bit lane of a line holds W[n][2 kk] in its low half and W[n][2 kk + 1] in its high half, so
 * lane << 16 is the even k as fp32 and lane & 0xffff0000 the odd k: two vfmadd231ps per line against
 * broadcast x values, with AVX-512F alone. The frame (tiles of MR x NZ, K blocks, tasks and their
 * split, prefetch, the fused SiLU gate/up variant, the rows lookup) is gemm_packed.h's.
 *
 * Numerics: gemm_f32.c's contract on the upcast weight: each output is one fp32 sum over k = 0, 1, ..,
 * K - 1 in that order (one fused multiply-add per k, from 0), then + bias; K in blocks of <= KC_MAX
 * (rounded to whole pairs), each partial sum stored and reloaded exactly, so where the blocks fall
 * changes no bits: they are gemm_f32's on W.float(). The order depends on nothing but K: a row's bits
 * do not depend on M, the tiling, the thread count or its batch. Denormals kept (no FTZ/DAZ).
 * Without AVX-512F the same tile runs on AVX2 + FMA (two 8-lane halves per panel: the same fused
 * multiply-adds in the same order, so the same bits).
 * Built by kernels/build.py (-march=native; without AVX-512F or AVX2 a stub reports itself unavailable
 * and the loader converts bf16 weights to fp32 as before).
 */
#include "cobatch_kernels.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include "gemm_packed.h"

#ifndef KC_MAX
#define KC_MAX 1024 /* K values per block at most, as gemm_f32.c */
#endif

#if defined(__AVX512F__)
#define WBF16_ROWS MR /* rows per micro-tile */

/* One half of a K pair of NZ weight lines as fp32: the even k (half 0: lane << 16) or the odd (half 1). */
INLINE __m512 pair_half(__m512i line, int half) {
    return _mm512_castsi512_ps(half ? _mm512_and_si512(line, _mm512_set1_epi32((int)0xffff0000u))
                                    : _mm512_slli_epi32(line, 16));
}

/* y[0..mr, 0..16 nz) (+)= x[0..mr, 0..kc) . panels wp[0..nz) (+ bias); x's rows ldx apart, y's ldy; kc
 * even; accumulate: continue the partial sums y holds (a K block after the first). Per K pair, the even
 * k's products go into every accumulator before the odd k's: k order per output. */
INLINE void tile(const float *x, int64_t ldx, int64_t kc, const uint16_t *wp, Strides st, const float *bias,
                 float *y, int64_t ldy, int mr, int nz, Prefetch pf, int accumulate) {
    __m512 acc[(MR + 1) * NZ];  /* up to MR + 1 rows: see gemm_packed.h, group_rows */
    f32_tile_start(acc, y, ldy, mr, nz, accumulate);
    const int64_t pairs = kc / 2;
    int64_t countdown = pf.next != NULL ? pf.phase : pairs;
    for (int64_t kk = 0; kk < pairs; kk++) {
        __m512i line[NZ];
#pragma GCC unroll 3
        for (int z = 0; z < nz; z++) line[z] = _mm512_loadu_si512(wp + z * st.zstride + kk * st.kstride);
        prefetch_step(&pf, &countdown, st, kk, nz, 2);
#pragma GCC unroll 2
        for (int half = 0; half < 2; half++) {
            __m512 w[NZ];
#pragma GCC unroll 3
            for (int z = 0; z < nz; z++) w[z] = pair_half(line[z], half);
#pragma GCC unroll 9
            for (int m = 0; m < mr; m++) {
                __m512 xb = _mm512_set1_ps(x[m * ldx + 2 * kk + half]);
#pragma GCC unroll 3
                for (int z = 0; z < nz; z++) acc[m * NZ + z] = _mm512_fmadd_ps(xb, w[z], acc[m * NZ + z]);
            }
        }
    }
    f32_tile_store(acc, bias, y, ldy, mr, nz);
}
#else
/* AVX2 (Zen 3, Haswell..): a panel's 16 outputs are two halves of 8 lanes, and a tile takes the group's
 * panels one after another over the same x rows (from L1), so its 2 mr accumulators and a line's two
 * halves fit the 16 ymm registers. */
#define WBF16_ROWS 4 /* rows per micro-tile */

INLINE __m256 pair_half8(__m256i line, int half) {
    return _mm256_castsi256_ps(half ? _mm256_and_si256(line, _mm256_set1_epi32((int)0xffff0000u))
                                    : _mm256_slli_epi32(line, 16));
}

/* The AVX-512 tile's contract (above), panel by panel. */
INLINE void tile(const float *x, int64_t ldx, int64_t kc, const uint16_t *wp, Strides st, const float *bias,
                 float *y, int64_t ldy, int mr, int nz, Prefetch pf, int accumulate) {
    const int64_t pairs = kc / 2;
    for (int z = 0; z < nz; z++) {
        __m256 acc[MR + 1][2];  /* mr <= WBF16_ROWS here; the frame's tile cases go to MR + 1 */
        f32_panel_start(acc, y, ldy, mr, z, accumulate);
        /* the next group's panel z while this sweeps panel z, at the AVX-512 tile's cadence (all of the
         * next group during the first sweep would not stay in L1 until it is read); a one-row tile leaves
         * it to the hardware prefetcher (on an AVX-512 Xeon with this build, M = 1: 1.15x without) */
        Prefetch one = pf;
        if (one.next != NULL) one.next = mr > 1 ? (const uint16_t *)pf.next + z * st.zstride : NULL;
        int64_t countdown = one.next != NULL ? one.phase : pairs;
        const uint16_t *wz = wp + z * st.zstride;
        for (int64_t kk = 0; kk < pairs; kk++) {
            const __m256i *at = (const __m256i *)(wz + kk * st.kstride);
            const __m256i line[2] = {_mm256_loadu_si256(at), _mm256_loadu_si256(at + 1)};
            prefetch_step(&one, &countdown, st, kk, 1, 2);
#pragma GCC unroll 2
            for (int half = 0; half < 2; half++) {
                const __m256 w[2] = {pair_half8(line[0], half), pair_half8(line[1], half)};
#pragma GCC unroll 4
                for (int m = 0; m < mr; m++) {
                    const __m256 xb = _mm256_set1_ps(x[m * ldx + 2 * kk + half]);
                    acc[m][0] = _mm256_fmadd_ps(xb, w[0], acc[m][0]);
                    acc[m][1] = _mm256_fmadd_ps(xb, w[1], acc[m][1]);
                }
            }
        }
        f32_panel_store(acc, bias, y, ldy, mr, z);
    }
}
#endif

DEFINE_TILE_ANY(tile_any, tile)

static const PackedKernel WBF16 = {2, 2, 4, KC_MAX, 0, WBF16_ROWS, tile_any, silu_mul_rows_f32};

int gemm_f32_wbf16_available(void) { return 1; }

/* x [M, K] fp32, packed bf16 weight (layout above; N % 16 == 0, K even), bias [N] fp32 or NULL, y [M, N]
 * fp32, contiguous. num_threads <= 0: the OpenMP default. Returns 0, or -2 on a bad shape. */
int gemm_f32_wbf16(const void *x, const void *wp, const void *bias, void *y, int64_t M, int64_t N, int64_t K,
                   int num_threads) {
    if (N % NR != 0 || K % 2 != 0 || K <= 0 || M <= 0) return -2;
    GemmArgs a = {&WBF16, x, wp, bias, y, M, N, K, 0, 0};
    run_gemm(&a, num_threads);
    return 0;
}

/* act [M, inter] fp32 = silu(x Wg^T) * (x Wu^T) on a pack_gate_up bf16 weight (gemm_packed.h,
 * run_gemm_silu): the same bits as gemm_f32_wbf16 then silu_mul. Returns 0, or -2 on a bad shape. */
int gemm_f32_wbf16_silu(const void *x, const void *wp, void *act, int64_t M, int64_t inter, int64_t K,
                        int num_threads) {
    if (inter % (NZ * NR) != 0 || K % 2 != 0 || K <= 0 || M <= 0) return -2;
    GemmArgs a = {&WBF16, x, wp, NULL, act, M, 2 * inter, K, 0, 0};
    run_gemm_silu(&a, num_threads);
    return 0;
}

/* Rows ids[0..n) of the weight a packed bf16 [N, K] tensor holds, as fp32, into out [n, K] (a tied
 * embedding table's lookup): packed_rows' walk (one K pair per 4-byte unit, 16 B units apart), each pair
 * split into its two fp32 values. Returns 0, or -2 on an id outside [0, N). */
int packed_rows_f32_wbf16(const void *wp, const int64_t *ids, int64_t n, int64_t N, int64_t K, void *out) {
    const int64_t c = NR * block_panels(&WBF16, N), pairs = K / 2;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= N) return -2;
    for (int64_t i = 0; i < n; i++) {
        const uint32_t *block = (const uint32_t *)wp + ids[i] / c * pairs * c + ids[i] % c;
        uint32_t *row = (uint32_t *)out + i * K;  /* fp32 bits */
        for (int64_t s = 0; s < pairs; s++) {
            const uint32_t pair = block[s * c];
            row[2 * s] = pair << 16, row[2 * s + 1] = pair & 0xffff0000u;
        }
    }
    return 0;
}

#else /* no AVX-512F or AVX2 here: the loader converts bf16 weights to fp32 */

int gemm_f32_wbf16_available(void) { return 0; }

int gemm_f32_wbf16(const void *x, const void *wp, const void *bias, void *y, int64_t M, int64_t N, int64_t K,
                   int num_threads) {
    (void)x, (void)wp, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)num_threads;
    return -1;
}

int gemm_f32_wbf16_silu(const void *x, const void *wp, void *act, int64_t M, int64_t inter, int64_t K,
                        int num_threads) {
    return gemm_f32_wbf16(x, wp, NULL, act, M, 2 * inter, K, num_threads);
}

int packed_rows_f32_wbf16(const void *wp, const int64_t *ids, int64_t n, int64_t N, int64_t K, void *out) {
    return gemm_f32_wbf16(wp, ids, NULL, out, n, N, K, 0);
}

#endif
