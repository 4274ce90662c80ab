/* Fused elementwise ops of the decoder layer: residual add + RMSNorm, SiLU-and-multiply, RoPE in place.
 *
 * Why: in eager torch each of these is 4-8 small ops (casts, reductions, temporaries); a decode step at
 * small batch spends more time dispatching them than computing, and a 2k-token prefill streams every
 * intermediate through memory. Here each is one pass.
 *
 * Rounding follows the torch ops they replace step by step (HF's formulas in the model dtype: every
 * bf16 op rounds its result to bf16), so the fused path gives the same bits as the eager one in bf16,
 * but for the fp32 summation order inside the norm, a rare last-bit tie of the exponential and
 * denormal results (AVX-512 path, below).
 *
 * Layouts: row-major, contiguous rows; dtype flag is_bf16 (else fp32). Built by kernels/build.py.
 */
#include <math.h>

#include "cobatch_kernels.h"
#include "parallel.h"

#define ROPE_MAX_HALF 256  /* head_dim <= 512; fused_ops.py falls back to torch beyond */

/* Value i of a row as fp32, and storing one rounded to the row's dtype. */
static inline float load(const void *p, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float v, int is_bf16) {
    if (is_bf16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

/* The model dtype's rounding of an fp32 value (identity for fp32). */
static inline float round_to(float v, int is_bf16) { return is_bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* exp(x) for SiLU, written so the compiler vectorises it (libm's expf is a scalar call here: no
 * -ffast-math, see kernels/build.py): 2^k * 2^f with k = rint(x log2 e), |f| <= 1/2, and a degree-7 Taylor
 * polynomial of 2^f (relative error ~5e-9, below fp32's 6e-8). Inputs are clamped to fp32's range. */
static inline float exp_vec(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float t = x * 1.44269504088896341f;
    float k = __builtin_rintf(t);
    float f = (t - k) * 0.69314718055994531f;  /* e^f, |f| <= ln2 / 2 */
    float p = 1.0f + f * (1.0f + f * (0.5f + f * (1.0f / 6 + f * (1.0f / 24 + f * (1.0f / 120 +
              f * (1.0f / 720 + f * (1.0f / 5040)))))));
    int32_t bits = ((int32_t)k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* ------------------------------------------------------------------ AVX-512 rows of bf16 values
 * The same steps as the row bodies below, 16 values per vector. Why: with -std=c11 the compiler may
 * not contract a * b + c into one fused multiply-add, and its vectorised bf16 conversions cost more
 * than the arithmetic. Measured at 2040 rows, 2 threads (direct C calls, outputs preallocated,
 * alternating builds): SiLU-multiply 1.58 -> 1.05 ms, add + RMSNorm 0.42 -> 0.22 ms, RoPE 0.38 ->
 * 0.18 ms; a 12 x 170 prefill step 1146 -> 1111 ms. Products and sums round where the scalar code
 * rounds; the exponential uses fused multiply-adds, so it can differ from exp_vec in the last bit, and
 * a result from the scalar path by one ulp of bf16 when that bit decides a tie (tests/test_fused_ops.py
 * allows that). */
#if HAVE_AVX512  /* 16-lane rows: these two helpers (and greedy's argmax, below) */
#include <immintrin.h>

/* The lanes of the last, partial vector of a row with `left` values to go. */
static inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

static inline __m512 load_bf16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
#endif

#if HAVE_AVX512 && defined(__AVX512BF16__) && defined(__AVX512VL__)
#define HAVE_AVX512_BF16_ROWS 1

/* fp32 -> bf16 in one instruction: nearest even, NaN kept a quiet NaN, as f32_to_bf16 -- except that
 * vcvtneps2bf16 flushes denormals (|x| < 1.2e-38) to zero where torch keeps them. Activations never
 * get there, and keeping them (a class test and a fallback per vector) cost a third of SiLU's speed. */
static inline __m256i to_bf16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

static inline void store_bf16(uint16_t *p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, to_bf16(v));
}

/* round_to for bf16: the value the stored bf16 would read back as. */
static inline __m512 round_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}

/* exp_vec, 16 lanes: the same range, split and polynomial, evaluated with fused multiply-adds. */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, k), _mm512_set1_ps(0.69314718055994531f));
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, k);
}

static void add_rms_norm_row_avx512(const uint16_t *x, uint16_t *residual, const uint16_t *weight,
                                    uint16_t *out, int64_t hidden, float eps) {
    __m512 sum_sq = _mm512_setzero_ps();
    for (int64_t i = 0; i < hidden; i += 16) {
        __mmask16 m = tail_mask(hidden - i);
        __m512 v = load_bf16(residual + i, m);
        if (x != NULL) {
            v = round_bf16(_mm512_add_ps(v, load_bf16(x + i, m)));
            store_bf16(residual + i, v, m);
        }
        sum_sq = _mm512_fmadd_ps(v, v, sum_sq);  /* masked-off lanes loaded as 0 */
    }
    __m512 inv_rms = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(sum_sq) / (float)hidden + eps));
    for (int64_t i = 0; i < hidden; i += 16) {
        __mmask16 m = tail_mask(hidden - i);
        __m512 normed = round_bf16(_mm512_mul_ps(load_bf16(residual + i, m), inv_rms));
        store_bf16(out + i, _mm512_mul_ps(load_bf16(weight + i, m), normed), m);
    }
}

static void silu_mul_row_avx512(const uint16_t *gate, const uint16_t *up, uint16_t *out, int64_t inter) {
    for (int64_t i = 0; i < inter; i += 16) {
        __mmask16 m = tail_mask(inter - i);
        __m512 g = load_bf16(gate + i, m);
        __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
        __m512 silu = round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));  /* NaN stays NaN */
        store_bf16(out + i, _mm512_mul_ps(silu, load_bf16(up + i, m)), m);
    }
}

/* One head's halves at lo and hi (half % 16 == 0) rotated by cos/sin rows c, s. */
static void rotate_head_avx512(uint16_t *lo, uint16_t *hi, const uint16_t *c, const uint16_t *s, int64_t half) {
    for (int64_t i = 0; i < half; i += 16) {
        __m512 x1 = load_bf16(lo + i, 0xffff), x2 = load_bf16(hi + i, 0xffff);
        __m512 vc = load_bf16(c + i, 0xffff), vs = load_bf16(s + i, 0xffff);
        __m512 a = _mm512_sub_ps(round_bf16(_mm512_mul_ps(x1, vc)), round_bf16(_mm512_mul_ps(x2, vs)));
        __m512 b = _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, vc)), round_bf16(_mm512_mul_ps(x1, vs)));
        store_bf16(lo + i, a, 0xffff);
        store_bf16(hi + i, b, 0xffff);
    }
}
#else
#define HAVE_AVX512_BF16_ROWS 0
#endif

/* Each op is an always-inlined row body with is_bf16 as a parameter; the exported entry point runs its
 * row loop once per dtype with a constant flag, so the compiler specialises (and vectorises) one copy per
 * dtype. (A flag tested inside one OpenMP region would not do: the region is outlined before inlining.) */
#define SPECIALISE static inline __attribute__((always_inline))
/* for r in [0, rows): the statements after `work`, on OpenMP's team when the work (elements) pays for a fork
 * (below 4096 a fork costs more: measured at 512 / 1536 / 4096 / 65536), else inline (parallel.h). */
#define FOR_ROWS(rows, work, ...)                                        \
    do {                                                                 \
        if ((work) >= 4096 && omp_get_max_threads() > 1) {               \
            _Pragma("omp parallel for schedule(static)")                 \
            for (int64_t r = 0; r < (rows); r++) { __VA_ARGS__; }        \
        } else {                                                         \
            for (int64_t r = 0; r < (rows); r++) { __VA_ARGS__; }        \
        }                                                                \
    } while (0)
#define FOR_EACH_DTYPE(rows, work, row_call)          \
    do {                                              \
        if (is_bf16) FOR_ROWS(rows, work, row_call(1)); \
        else FOR_ROWS(rows, work, row_call(0));         \
    } while (0)

/* Row r: residual += x (rounded to the dtype), then out = weight * dtype(residual * rsqrt(mean(sq) + eps)). */
SPECIALISE void add_rms_norm_row(const void *restrict x, void *restrict residual, const void *restrict weight,
                                 void *restrict out, int64_t r, int64_t hidden, float eps, int is_bf16) {
    int64_t base = r * hidden;
    float sum_sq = 0.0f;
    for (int64_t i = 0; i < hidden; i++) {
        float v = load(residual, base + i, is_bf16);
        if (x != NULL) {
            v = round_to(v + load(x, base + i, is_bf16), is_bf16);
            store(residual, base + i, v, is_bf16);
        }
        sum_sq += v * v;
    }
    float inv_rms = 1.0f / sqrtf(sum_sq / (float)hidden + eps);
    for (int64_t i = 0; i < hidden; i++) {
        float normed = round_to(load(residual, base + i, is_bf16) * inv_rms, is_bf16);
        store(out, base + i, load(weight, i, is_bf16) * normed, is_bf16);
    }
}

/* All [rows, hidden], weight [hidden]; x may be NULL: plain RMSNorm of residual. */
void add_rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows, int64_t hidden,
                  float eps, int is_bf16) {
#if HAVE_AVX512_BF16_ROWS
    if (is_bf16) {
        FOR_ROWS(rows, rows * hidden,
                 add_rms_norm_row_avx512(x != NULL ? (const uint16_t *)x + r * hidden : NULL,
                                         (uint16_t *)residual + r * hidden, weight, (uint16_t *)out + r * hidden,
                                         hidden, eps));
        return;
    }
#endif
#define NORM_ROW(bf16) add_rms_norm_row(x, residual, weight, out, r, hidden, eps, bf16)
    FOR_EACH_DTYPE(rows, rows * hidden, NORM_ROW);
}

/* Head h of row r, in place: x = weight * dtype(x * rsqrt(mean(x^2) + eps)), as add_rms_norm's row with no
 * residual add (the same rounding; in place, so no restrict). */
SPECIALISE void head_rms_norm_row(void *x, const void *weight, int64_t base, int64_t head_dim, float eps,
                                  int is_bf16) {
    float sum_sq = 0.0f;
    for (int64_t i = 0; i < head_dim; i++) {
        float v = load(x, base + i, is_bf16);
        sum_sq += v * v;
    }
    float inv_rms = 1.0f / sqrtf(sum_sq / (float)head_dim + eps);
    for (int64_t i = 0; i < head_dim; i++) {
        float normed = round_to(load(x, base + i, is_bf16) * inv_rms, is_bf16);
        store(x, base + i, load(weight, i, is_bf16) * normed, is_bf16);
    }
}

/* RMSNorm over each of the first num_heads heads of each row of x (row_stride apart), in place, with one
 * weight [head_dim] for all: Qwen3's q_norm / k_norm, before RoPE. */
void head_rms_norm(void *x, const void *weight, int64_t rows, int64_t row_stride, int64_t num_heads,
                   int64_t head_dim, float eps, int is_bf16) {
#define HEAD_NORM_ROW(bf16)                                                                        \
    for (int64_t h = 0; h < num_heads; h++)                                                        \
        head_rms_norm_row(x, weight, r * row_stride + h * head_dim, head_dim, eps, bf16)
    FOR_EACH_DTYPE(rows, rows * num_heads * head_dim, HEAD_NORM_ROW);
}

/* dtype(silu(g)): a NaN gate stays NaN. */
static inline float silu_of(float g, int is_bf16) { return round_to(g / (1.0f + exp_vec(-g)), is_bf16); }

/* Row r of gate_up [rows, 2 * inter] (gate | up) -> out [rows, inter] = dtype(silu(gate)) * up. */
SPECIALISE void silu_mul_row(const void *restrict gate_up, void *restrict out, int64_t r, int64_t inter,
                             int is_bf16) {
    int64_t in_base = r * 2 * inter, out_base = r * inter;
    for (int64_t i = 0; i < inter; i++) {
        float silu = silu_of(load(gate_up, in_base + i, is_bf16), is_bf16);
        store(out, out_base + i, silu * load(gate_up, in_base + inter + i, is_bf16), is_bf16);
    }
}

void silu_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int is_bf16) {
#if HAVE_AVX512_BF16_ROWS
    if (is_bf16) {
        FOR_ROWS(rows, rows * inter,
                 const uint16_t *gate = (const uint16_t *)gate_up + r * 2 * inter;
                 silu_mul_row_avx512(gate, gate + inter, (uint16_t *)out + r * inter, inter));
        return;
    }
#endif
#define SILU_ROW(bf16) silu_mul_row(gate_up, out, r, inter, bf16)
    FOR_EACH_DTYPE(rows, rows * inter, SILU_ROW);
}

/* bf16 out[r][0..width) = silu(gate[r]) * up[r] for `rows` rows, each array with its own row stride: the
 * arithmetic of silu_mul on slices, serial. The packed GEMM's gate/up epilogue (gemm_bf16.c,
 * gemm_bf16_silu) applies it to each tile it has just computed, inside its own parallel region. */
void silu_mul_rows_bf16(const void *gate, const void *up, void *out, int64_t rows, int64_t width,
                        int64_t in_stride, int64_t out_stride) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = (const uint16_t *)gate + r * in_stride, *u = (const uint16_t *)up + r * in_stride;
        uint16_t *o = (uint16_t *)out + r * out_stride;
#if HAVE_AVX512_BF16_ROWS
        silu_mul_row_avx512(g, u, o, width);
#else
        for (int64_t i = 0; i < width; i++) o[i] = f32_to_bf16(silu_of(bf16_to_f32(g[i]), 1) * bf16_to_f32(u[i]));
#endif
    }
}

/* The same for fp32 rows (gemm_f32.c's gate/up epilogue): silu_mul's fp32 arithmetic, so the same bits. */
void silu_mul_rows_f32(const void *gate, const void *up, void *out, int64_t rows, int64_t width,
                       int64_t in_stride, int64_t out_stride) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = (const float *)gate + r * in_stride, *u = (const float *)up + r * in_stride;
        float *o = (float *)out + r * out_stride;
        for (int64_t i = 0; i < width; i++) o[i] = silu_of(g[i], 0) * u[i];
    }
}

/* One head's halves x1 = x[lo..lo+half), x2 = x[hi..hi+half) rotated by the table row at `table`.
 * Staged through fp32 arrays: in-place reads and writes of one buffer defeat the vectoriser. */
SPECIALISE void rotate_head(void *restrict x, int64_t lo, int64_t hi, const void *restrict cos_table,
                            const void *restrict sin_table, int64_t table, int64_t half, int is_bf16) {
    float x1[ROPE_MAX_HALF], x2[ROPE_MAX_HALF], a[ROPE_MAX_HALF], b[ROPE_MAX_HALF];
    for (int64_t i = 0; i < half; i++) {
        x1[i] = load(x, lo + i, is_bf16);
        x2[i] = load(x, hi + i, is_bf16);
    }
    for (int64_t i = 0; i < half; i++) {
        float c = load(cos_table, table + i, is_bf16), s = load(sin_table, table + i, is_bf16);
        a[i] = round_to(x1[i] * c, is_bf16) - round_to(x2[i] * s, is_bf16);
        b[i] = round_to(x2[i] * c, is_bf16) + round_to(x1[i] * s, is_bf16);
    }
    for (int64_t i = 0; i < half; i++) {
        store(x, lo + i, a[i], is_bf16);
        store(x, hi + i, b[i], is_bf16);
    }
}

/* Row r: RoPE on its first num_heads heads. */
SPECIALISE void rope_row(void *restrict x, const void *restrict cos_table, const void *restrict sin_table,
                         const int64_t *restrict positions, int64_t r, int64_t row_stride, int64_t num_heads,
                         int64_t head_dim, int is_bf16) {
    int64_t half = head_dim / 2, table = positions[r] * half;
    for (int64_t h = 0; h < num_heads; h++) {
        int64_t base = r * row_stride + h * head_dim;
        rotate_head(x, base, base + half, cos_table, sin_table, table, half, is_bf16);
    }
}

/* Rotate-half RoPE in place on the first num_heads heads of each token's row of x.
 * x: rows of row_stride elements, head h at [h * head_dim, (h + 1) * head_dim); cos/sin tables
 * [max_pos, head_dim / 2] in the same dtype; positions [rows] int64.
 * out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin, each product and sum rounded like torch's ops. */
void rope_inplace(void *x, const void *cos_table, const void *sin_table, const int64_t *positions,
                  int64_t rows, int64_t row_stride, int64_t num_heads, int64_t head_dim, int is_bf16) {
#if HAVE_AVX512_BF16_ROWS
    if (is_bf16 && head_dim % 32 == 0) {
        const int64_t half = head_dim / 2;
        FOR_ROWS(rows, rows * num_heads * head_dim,
                 const uint16_t *c = (const uint16_t *)cos_table + positions[r] * half;
                 const uint16_t *s = (const uint16_t *)sin_table + positions[r] * half;
                 for (int64_t h = 0; h < num_heads; h++) {
                     uint16_t *lo = (uint16_t *)x + r * row_stride + h * head_dim;
                     rotate_head_avx512(lo, lo + half, c, s, half);
                 });
        return;
    }
#endif
#define ROPE_ROW(bf16) rope_row(x, cos_table, sin_table, positions, r, row_stride, num_heads, head_dim, bf16)
    FOR_EACH_DTYPE(rows, rows * num_heads * head_dim, ROPE_ROW);
}

/* Greedy sampling's argmax: for each row of x [rows, cols], the max (NaN if the row has a NaN, as
 * torch.max gives) and the first index holding it (-1 when no value beats -inf). One pass: each lane of
 * ARGMAX_SETS independent vector sets keeps its running max and where it first reached it (independent
 * chains: one set waited on its compare-and-blend latency, 4 sets run ~2x faster at 49k columns); the
 * row's answer is the smallest index among the lanes that hold the row's max. */
#if HAVE_AVX512
enum { ARGMAX_SETS = 4 };

static inline __m512 load16(const void *x, int64_t i, int is_bf16, __mmask16 m) {
    return is_bf16 ? load_bf16((const uint16_t *)x + i, m) : _mm512_maskz_loadu_ps(m, (const float *)x + i);
}

/* Fold the 16 values at column i (lanes `valid`) into the set (mx, at). */
static inline void argmax_step(const void *x, int64_t base, int64_t i, __mmask16 valid, int is_bf16, __m512 *mx,
                               __m512i *at, __mmask16 *nan) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 v = load16(x, base + i, is_bf16, valid);
    *nan |= _mm512_mask_cmp_ps_mask(valid, v, v, _CMP_UNORD_Q);
    __mmask16 gt = _mm512_mask_cmp_ps_mask(valid, v, *mx, _CMP_GT_OQ);
    *mx = _mm512_mask_mov_ps(*mx, gt, v);
    *at = _mm512_mask_mov_epi32(*at, gt, _mm512_add_epi32(lane, _mm512_set1_epi32((int)i)));
}

SPECIALISE void argmax_row(const void *x, int64_t r, int64_t cols, int is_bf16, int64_t *index, float *best) {
    __m512 mx[ARGMAX_SETS];
    __m512i at[ARGMAX_SETS];
    for (int u = 0; u < ARGMAX_SETS; u++) mx[u] = _mm512_set1_ps(-INFINITY), at[u] = _mm512_set1_epi32(-1);
    __mmask16 nan = 0;
    const int64_t base = r * cols;
    int64_t i = 0;  /* indices fit int32: cols < 2^31 (checked by the caller) */
    for (; i + 16 * ARGMAX_SETS <= cols; i += 16 * ARGMAX_SETS)
        for (int u = 0; u < ARGMAX_SETS; u++) argmax_step(x, base, i + 16 * u, 0xffff, is_bf16, &mx[u], &at[u], &nan);
    for (; i < cols; i += 16) argmax_step(x, base, i, tail_mask(cols - i), is_bf16, &mx[0], &at[0], &nan);
    __m512 all = mx[0];
    for (int u = 1; u < ARGMAX_SETS; u++) all = _mm512_max_ps(all, mx[u]);
    float m = _mm512_reduce_max_ps(all);
    int first = -1;
    for (int u = 0; u < ARGMAX_SETS; u++) {
        __mmask16 holders = _mm512_cmp_ps_mask(mx[u], _mm512_set1_ps(m), _CMP_EQ_OQ);
        int at_u = holders ? _mm512_mask_reduce_min_epi32(holders, at[u]) : -1;
        if (at_u >= 0 && (first < 0 || at_u < first)) first = at_u;
    }
    index[r] = m > -INFINITY ? first : -1;
    best[r] = nan ? NAN : m;
}
#else
SPECIALISE void argmax_row(const void *x, int64_t r, int64_t cols, int is_bf16, int64_t *index, float *best) {
    float m = -INFINITY;
    int64_t at = -1;
    int nan = 0;
    for (int64_t i = 0; i < cols; i++) {
        float v = load(x, r * cols + i, is_bf16);
        nan |= v != v;
        if (v > m) m = v, at = i;
    }
    index[r] = at;
    best[r] = nan ? NAN : m;
}
#endif

void argmax_rows(const void *x, int64_t rows, int64_t cols, int is_bf16, int64_t *index, float *best) {
#define ARGMAX_ROW(bf16) argmax_row(x, r, cols, bf16, index, best)
    FOR_EACH_DTYPE(rows, rows * cols, ARGMAX_ROW);
}
