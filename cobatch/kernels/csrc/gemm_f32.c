/* fp32 GEMM on a packed weight: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), all fp32.
 *
 * Why: on a CPU without AVX512-BF16 the models run in fp32, and there oneDNN's F.linear streams the
 * weights at only ~2 GB/s at M = 4..16 rows (a decode batch), a third of the bandwidth roofline; and an
 * fp32 model without packed weights could not run the C layer loop (decoder.c). The weight is repacked
 * once at load time (kernels/linear.py, pack_weight) into panels of 16 output columns:
 *
 *     packed[p][k][c] = W[16 p + c][k]    (p < N/16, k < K, c < 16)
 *
 * so one 64-byte line holds one K value of 16 outputs, the operand of vfmadd231ps against a broadcast
 * x value, and each panel is one sequential stream: a tile of NZ panels reads NZ streams. Unlike the
 * bf16 kernel (blocks of NZ panels side by side: one stream per group, measured on Zen 4), single
 * panels measured faster here (Intel Xeon, one thread, weights out of cache, per output column: 1.2-1.6x
 * at M = 1..8, 1.0-1.6x at 16..256 but one 0.83x at M = 64, K = 576; one core read 10.5 GB/s from one
 * stream, 12.8 from four): one stream does not keep enough lines in flight. The frame (tiles of
 * MR x NZ = 8 x 3 accumulators, tasks and their split over threads, the prefetch of the next group, the
 * fused SiLU gate/up variant, the rows lookup) is gemm_packed.h's, shared with gemm_bf16.c; this file
 * brings the micro-tile.
 *
 * Numerics: each output is one fp32 sum over k = 0, 1, .., K - 1 in that order (one fused multiply-add
 * per k into one accumulator, from 0), then + bias: the order depends on nothing but K, so a row's bits
 * do not depend on M, the tiling, the thread count or the other rows of its batch. Denormals are kept
 * (no FTZ/DAZ). F.linear sums in another order: equal to it within fp32 summation error, not bit for bit.
 * Without AVX-512F the same tile runs on AVX2 + FMA (two 8-lane halves per panel: the same fused
 * multiply-adds in the same order, so the same bits; gemm_f32_wbf16.c's AVX2 tile on the upcast weight).
 * Built by kernels/build.py (-march=native; without AVX-512F or AVX2 a stub reports itself unavailable
 * and linear.py keeps F.linear).
 */
#include "cobatch_kernels.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include "gemm_packed.h"

#ifndef KC_MAX
#define KC_MAX 1024 /* K values per block at most (gemm_packed.h, k_block; docs/BENCHMARKS.md) */
#endif

#if defined(__AVX512F__)
#define F32_ROWS MR /* rows per micro-tile */

/* y[0..mr, 0..16 nz) (+)= x[0..mr, 0..kc) . panels wp[0..nz) (+ bias); x's rows ldx apart, y's ldy;
 * accumulate: continue the partial sums y holds (a K block after the first: the same sum, stored and
 * reloaded exactly). */
INLINE void tile(const float *x, int64_t ldx, int64_t kc, const float *wp, Strides st, const float *bias,
                 float *y, int64_t ldy, int mr, int nz, Prefetch pf, int accumulate) {
    __m512 acc[(MR + 1) * NZ];  /* up to MR + 1 rows: see gemm_packed.h, group_rows */
    f32_tile_start(acc, y, ldy, mr, nz, accumulate);
    int64_t countdown = pf.next != NULL ? pf.phase : kc;
    for (int64_t k = 0; k < kc; k++) {
        __m512 w[NZ];
#pragma GCC unroll 3
        for (int z = 0; z < nz; z++) w[z] = _mm512_loadu_ps(wp + z * st.zstride + k * st.kstride);
        prefetch_step(&pf, &countdown, st, k, nz, 4);
#pragma GCC unroll 9
        for (int m = 0; m < mr; m++) {
            __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
#pragma GCC unroll 3
            for (int z = 0; z < nz; z++) acc[m * NZ + z] = _mm512_fmadd_ps(xb, w[z], acc[m * NZ + z]);
        }
    }
    f32_tile_store(acc, bias, y, ldy, mr, nz);
}
#else
/* AVX2 (Zen 3, Haswell..): as gemm_f32_wbf16.c's AVX2 tile, a panel's 16 outputs are two halves of 8
 * lanes and the tile takes the group's panels one after another over the same x rows (from L1), so its
 * 2 mr accumulators and a line's two halves fit the 16 ymm registers. */
#define F32_ROWS 4 /* rows per micro-tile */

/* The AVX-512 tile's contract (above), panel by panel. */
INLINE void tile(const float *x, int64_t ldx, int64_t kc, const float *wp, Strides st, const float *bias,
                 float *y, int64_t ldy, int mr, int nz, Prefetch pf, int accumulate) {
    for (int z = 0; z < nz; z++) {
        __m256 acc[MR + 1][2];  /* mr <= F32_ROWS here; the frame's tile cases go to MR + 1 */
        f32_panel_start(acc, y, ldy, mr, z, accumulate);
        /* the next group's panel z while this sweeps panel z (gemm_f32_wbf16.c's AVX2 tile says why) */
        Prefetch one = pf;
        if (one.next != NULL) one.next = mr > 1 ? (const float *)pf.next + z * st.zstride : NULL;
        int64_t countdown = one.next != NULL ? one.phase : kc;
        const float *wz = wp + z * st.zstride;
        for (int64_t k = 0; k < kc; k++) {
            const float *line = wz + k * st.kstride;
            const __m256 w[2] = {_mm256_loadu_ps(line), _mm256_loadu_ps(line + 8)};
            prefetch_step(&one, &countdown, st, k, 1, 4);
#pragma GCC unroll 4
            for (int m = 0; m < mr; m++) {
                const __m256 xb = _mm256_set1_ps(x[m * ldx + k]);
                acc[m][0] = _mm256_fmadd_ps(xb, w[0], acc[m][0]);
                acc[m][1] = _mm256_fmadd_ps(xb, w[1], acc[m][1]);
            }
        }
        f32_panel_store(acc, bias, y, ldy, mr, z);
    }
}
#endif

DEFINE_TILE_ANY(tile_any, tile)

static const PackedKernel F32 = {4, 1, 4, KC_MAX, 0, F32_ROWS, tile_any, silu_mul_rows_f32};

int gemm_f32_available(void) { return 1; }

/* x [M, K], packed weight (layout above; N % 16 == 0), bias [N] or NULL, y [M, N]: contiguous fp32.
 * num_threads <= 0: the OpenMP default. Returns 0, or -2 on a bad shape. */
int gemm_f32(const void *x, const void *wp, const void *bias, void *y, int64_t M, int64_t N, int64_t K,
             int num_threads) {
    if (N % NR != 0 || K <= 0 || M <= 0) return -2;
    GemmArgs a = {&F32, x, wp, bias, y, M, N, K, 0, 0};
    run_gemm(&a, num_threads);
    return 0;
}

/* act [M, inter] = silu(x Wg^T) * (x Wu^T) on a pack_gate_up weight (gemm_packed.h, run_gemm_silu): the
 * same bits as gemm_f32 then silu_mul. Returns 0, or -2 on a bad shape. */
int gemm_f32_silu(const void *x, const void *wp, void *act, int64_t M, int64_t inter, int64_t K, int num_threads) {
    if (inter % (NZ * NR) != 0 || K <= 0 || M <= 0) return -2;
    GemmArgs a = {&F32, x, wp, NULL, act, M, 2 * inter, K, 0, 0};
    run_gemm_silu(&a, num_threads);
    return 0;
}

/* Rows ids[0..n) of the weight a packed [N, K] tensor holds, into out [n, K] (gemm_packed.h, packed_rows:
 * each row is K values 64 bytes apart). Returns 0, or -2 on an id outside [0, N). */
int packed_rows_f32(const void *wp, const int64_t *ids, int64_t n, int64_t N, int64_t K, void *out) {
    return packed_rows(&F32, wp, ids, n, N, out, K);
}

#else /* no AVX-512F or AVX2 here: linear.py keeps the stored layout and F.linear */

int gemm_f32_available(void) { return 0; }

int gemm_f32(const void *x, const void *wp, const void *bias, void *y, int64_t M, int64_t N, int64_t K,
             int num_threads) {
    (void)x, (void)wp, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)num_threads;
    return -1;
}

int gemm_f32_silu(const void *x, const void *wp, void *act, int64_t M, int64_t inter, int64_t K, int num_threads) {
    return gemm_f32(x, wp, NULL, act, M, 2 * inter, K, num_threads);
}

int packed_rows_f32(const void *wp, const int64_t *ids, int64_t n, int64_t N, int64_t K, void *out) {
    return gemm_f32(wp, ids, NULL, out, n, N, K, 0);
}

#endif
