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
 * group computes, the group after it is prefetched, spread over its tiles (gemm_packed.h, group_rows).
 *
 * Work split: tasks are (panel group, chunk of MC rows), group-major, and each OpenMP thread takes one
 * contiguous run of them, so at decode sizes each thread streams one contiguous part of the weight; a
 * thread done early takes tasks from the back of the others' runs (gemm_packed.h, init_runs). That frame,
 * the prefetch policy and the fused SiLU variant are shared with gemm_f32.c; this file brings the tile.
 *
 * Numerics: each output is summed over K pairs in order, in fp32 (vdpbf16ps: denormal inputs and products
 * flush to zero), then rounded once to bf16 (nearest even, NaN kept, as torch does). The order does not
 * depend on M, the tiling or the thread count: a row's bits do not depend on its batch. The AMX tile (below)
 * sums 32 K per instruction, so its bits can differ from this tile's by an ulp; a process uses one of the
 * two for every M.
 * Built by kernels/build.py (-march=native; without AVX512-BF16 a stub reports itself unavailable).
 */
#define _DEFAULT_SOURCE /* syscall() under -std=c11: AMX's permission request below */
#include "cobatch_kernels.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "gemm_packed.h"

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

/* y[0..mr, 0..16 nz) = x[0..mr] . panels wp[0..nz) (+ bias); x's rows ldx apart, y's ldy. K in one block
 * (max_kc 0): kc = K, and nothing to accumulate. */
INLINE void tile(const uint16_t *x, int64_t ldx, int64_t kc, const uint16_t *wp, Strides st,
                 const uint16_t *bias, uint16_t *y, int64_t ldy, int mr, int nz, Prefetch pf, int accumulate) {
    (void)accumulate;
    __m512 acc[(MR + 1) * NZ];  /* up to MR + 1 rows: see gemm_packed.h, group_rows */
#pragma GCC unroll 8
    for (int m = 0; m < mr; m++)
#pragma GCC unroll 3
        for (int z = 0; z < nz; z++) acc[m * NZ + z] = _mm512_setzero_ps();
    const int64_t pairs = kc / 2;
    int64_t countdown = pf.next != NULL ? pf.phase : pairs;
    for (int64_t kk = 0; kk < pairs; kk++) {
        __m512bh w[NZ];
#pragma GCC unroll 3
        for (int z = 0; z < nz; z++) w[z] = (__m512bh)_mm512_loadu_si512(wp + z * st.zstride + kk * st.kstride);
        prefetch_step(&pf, &countdown, st, kk, nz, 2);
#pragma GCC unroll 8
        for (int m = 0; m < mr; m++) {
            __m512bh xb = (__m512bh)_mm512_set1_epi32((int)load_pair(x + m * ldx + 2 * kk));
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

DEFINE_TILE_ANY(tile_any, tile)

static const PackedKernel BF16 = {2, 2, 2, 0, 1, MR, tile_any, silu_mul_rows_bf16};

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx.h"

/* AMX (Sapphire Rapids and later): the same tile on the tile unit. tdpbf16ps multiplies a tile of up to 16
 * rows x 32 K (A: x) by 32 K x 16 columns in the K-pair layout (B: 16 lines of 64 bytes, exactly one
 * panel's lines), into 16 x 16 fp32 sums: 16 x 16 x 32 products per instruction against vdpbf16ps's 16 x 2.
 * A panel's 16 lines sit `kstride` elements apart in either block size, so B loads straight from the
 * packed weight (tileloadd takes a row stride). One micro-tile keeps a C tile per panel (3), one A and a
 * B per panel: 7 of the 8 tile registers. */
#define AMX_K 32    /* K values per tdpbf16ps: 64 bytes of A per row, 16 pair lines of B */
#define AMX_ROWS 16 /* rows of x per micro-tile: a full A tile */

/* C tiles 0..2 and A tile 3 of mr rows, B tiles 4..6 of 16 pair lines. Loaded by every micro-tile: another
 * AMX user on this thread (oneDNN under torch) may have loaded its own in between. */
INLINE void amx_configure(int mr) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 7; t++) c.rows[t] = (uint8_t)(t < 4 ? mr : 16), c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

/* One K step of 32 (or a zero-padded rest): C_z += A . B_z for the nz panels. */
#define AMX_STEP(A, LDA, B0, LDB, BZ)                                      \
    do {                                                                   \
        _tile_loadd(3, (A), (LDA));                                        \
        _tile_loadd(4, (B0), (LDB));                                       \
        _tile_dpbf16ps(0, 3, 4);                                           \
        if (nz > 1) { _tile_loadd(5, (const char *)(B0) + (BZ), (LDB)); _tile_dpbf16ps(1, 3, 5); } \
        if (nz > 2) { _tile_loadd(6, (const char *)(B0) + 2 * (BZ), (LDB)); _tile_dpbf16ps(2, 3, 6); } \
    } while (0)

/* tile()'s contract on AMX: the sums over K in steps of 32 (a rest padded with zeros, which add nothing),
 * then bias and the one rounding to bf16 as tile() does them. */
static void tile_amx(const void *xv, int64_t ldx, int64_t kc, const void *wv, Strides st, const void *biasv,
                     void *yv, int64_t ldy, int mr, int nz, Prefetch pf, int accumulate) {
    (void)accumulate;
    const uint16_t *x = xv, *wp = wv, *bias = biasv;
    uint16_t *y = yv;
    amx_configure(mr);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    const int64_t pairs = kc / 2, full = pairs / (AMX_K / 2), lda = 2 * ldx, ldb = 2 * st.kstride, bz = 2 * st.zstride;
    int64_t countdown = pf.next != NULL ? pf.phase : pairs;
    for (int64_t s = 0; s < full; s++) {
        const int64_t kk = s * (AMX_K / 2);
        for (int64_t i = 0; i < AMX_K / 2; i++) prefetch_step(&pf, &countdown, st, kk + i, nz, 2);
        AMX_STEP(x + AMX_K * s, lda, wp + kk * st.kstride, ldb, bz);
    }
    const int64_t rest = pairs - full * (AMX_K / 2);
    if (rest > 0) {
        _Alignas(64) uint16_t a[16][AMX_K], b[NZ][AMX_K / 2][NR * 2];
        memset(a, 0, sizeof a), memset(b, 0, sizeof b);
        for (int m = 0; m < mr; m++) memcpy(a[m], x + m * ldx + 2 * full * (AMX_K / 2), (size_t)(4 * rest));
        for (int z = 0; z < nz; z++)
            for (int64_t i = 0; i < rest; i++)
                memcpy(b[z][i], wp + z * st.zstride + (full * (AMX_K / 2) + i) * st.kstride, 64);
        for (int64_t i = 0; i < rest; i++) prefetch_step(&pf, &countdown, st, full * (AMX_K / 2) + i, nz, 2);
        AMX_STEP(a, 2 * AMX_K, b[0], 64, (int64_t)sizeof b[0]);
    }
    _Alignas(64) float sums[NZ][16][NR];
    _tile_stored(0, sums[0], 64);
    if (nz > 1) _tile_stored(1, sums[1], 64);
    if (nz > 2) _tile_stored(2, sums[2], 64);
    _tile_release();
    for (int z = 0; z < nz; z++) {
        __m512 bv = bias != NULL ? bf16_to_ps(_mm256_loadu_si256((const __m256i *)(bias + z * NR))) : _mm512_setzero_ps();
        for (int m = 0; m < mr; m++)
            _mm256_storeu_si256((__m256i *)(y + m * ldy + z * NR), round_to_bf16(_mm512_add_ps(_mm512_load_ps(sums[z][m]), bv)));
    }
}

static const PackedKernel BF16_AMX = {2, 2, 2, 0, 1, AMX_ROWS, tile_amx, silu_mul_rows_bf16};

/* The tile unit where the CPU has it and Linux grants it (on: 1), unless switched off (0: A/B runs). */
static int amx_wanted = 1;

int gemm_bf16_set_amx(int on) {
    amx_wanted = on;
    return on && amx_permitted();
}

static const PackedKernel *bf16_kernel(void) { return amx_wanted && amx_permitted() ? &BF16_AMX : &BF16; }
#else
int gemm_bf16_set_amx(int on) { (void)on; return 0; }

static const PackedKernel *bf16_kernel(void) { return &BF16; }
#endif

int gemm_bf16_available(void) { return 1; }

/* x [M, K], packed weight (layout above; N % 16 == 0, K even), bias [N] or NULL, y [M, N]: contiguous
 * bf16 (uint16 bits). num_threads <= 0: the OpenMP default. Returns 0, or -2 on a bad shape. */
int gemm_bf16(const void *x, const void *wp, const void *bias, void *y, int64_t M, int64_t N, int64_t K,
              int num_threads) {
    if (N % NR != 0 || K % 2 != 0 || M <= 0) return -2;
    GemmArgs a = {bf16_kernel(), x, wp, bias, y, M, N, K, 0, 0};
    run_gemm(&a, num_threads);
    return 0;
}

/* act [M, inter] = silu(x Wg^T) * (x Wu^T) on a pack_gate_up weight (gemm_packed.h, run_gemm_silu), each
 * slice rounded to bf16 as gemm_bf16 rounds, then fused_ops.c's silu_mul_rows_bf16: the same bits as
 * gemm_bf16 then silu_mul. Returns 0, or -2 on a bad shape. */
int gemm_bf16_silu(const void *x, const void *wp, void *act, int64_t M, int64_t inter, int64_t K, int num_threads) {
    if (inter % (NZ * NR) != 0 || K % 2 != 0 || M <= 0) return -2;
    GemmArgs a = {bf16_kernel(), x, wp, NULL, act, M, 2 * inter, K, 0, 0};
    run_gemm_silu(&a, num_threads);
    return 0;
}

/* Rows ids[0..n) of the weight a packed [N, K] tensor holds, into out [n, K] (gemm_packed.h, packed_rows:
 * each row is K / 2 pairs 64 bytes apart). Returns 0, or -2 on an id outside [0, N). */
int packed_rows_bf16(const void *wp, const int64_t *ids, int64_t n, int64_t N, int64_t K, void *out) {
    return packed_rows(&BF16, wp, ids, n, N, out, K);
}

#else /* no AVX512-BF16 here: linear.py keeps the stored layout */

int gemm_bf16_available(void) { return 0; }

int gemm_bf16_set_amx(int on) { (void)on; return 0; }

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
