/* Paged attention on the CPU for a whole ragged batch (decode rows and prefill chunks alike), K/V read
 * in place from the block cache after this step's K/V were written there.
 *
 * Why one kernel: every query token is a row with its own visible context (a decode row sees seq_len
 * keys; a prefill token at position p sees p + 1: causal), so chunked prefill and prefix-cache hits need
 * no gather and no mask: the context is already in the cache. Consecutive query tokens of one sequence
 * form a tile, so a prefill tile reads each K/V chunk once for all its queries and all query heads of a
 * KV head's group (GQA).
 *
 * Layouts:
 *   q             [tokens, q_stride] rows; token t's head g at q + t * q_stride + g * head_dim
 *   out           [tokens, num_heads, head_dim], contiguous
 *   block_tables  [num_seqs, max_blocks] int64
 *   tiles         [num_tiles, 4] int64: (seq, first token, num tokens, context of the first token); the
 *                 tile's token i (row first + i of q and out) sees keys 0 .. context + i - 1.
 *   k/v cache     plain C path: [num_blocks, block_size, num_kv_heads, head_dim]. AVX-512 path (the
 *                 kernel layout): head-major blocks of quads, [num_blocks][num_kv_heads][block_size / 4]
 *                 [quad], a quad holding 4 consecutive keys (r = key % 4) pre-arranged for the arithmetic,
 *                 so nothing is transposed or interleaved at read time (that staging took ~20-25% of
 *                 decode attention's time with K/V in cache, 2-12% from DRAM, measured in one process):
 *       K quad    [cb][j][L][r][p]: one 64-byte vector per (cb, j), whose 128-bit lane L holds column
 *                 c = 16 cb + 4L + j of the 4 keys; a column is 32 bits (e elements: bf16 pair, e = 2,
 *                 d = 2c + p; fp32, e = 1, d = c);
 *       V quad    bf16 [r / 2][head_dim][r % 2]: key pairs interleaved per element, the B operand of a
 *                 bf16 dot product; fp32 [r][head_dim], rows as they are.
 *                 write_key is the only writer: paged_write_kv_* (the engine's K/V writes and the C layer
 *                 loop's) and the decode rows' own writes inside the kernel (write_own_key); whole blocks
 *                 can still be copied, swapped and shared as they are.
 * Key position p of sequence s lives at block block_tables[s][p / block_size], key p % block_size there.
 * Only keys inside some query's context are read (past the tile's last one: zeros, or masked lanes
 * whose V is never read).
 *
 * Numerics: online softmax over chunks of CHUNK keys aligned to absolute positions, fp32 state (lazily
 * rescaled on the AVX-512 path: softmax_step). A query's arithmetic depends only on its own q, context
 * and the cache, never on its tile, its work item or the rest of the batch: batch composition cannot
 * change a row's bits (the determinism tests rely on this).
 *   AVX-512 (fast_item; head_dim <= 256; fp32: % 16 == 0; bf16: with AVX512-BF16 and % 32 == 0;
 *   block_size % 4 == 0): scores with the keys along the vector lanes (no horizontal sum per key), fp32
 *   accumulation; bf16 runs QK^T and PV on vdpbf16ps with the probabilities rounded to bf16 before PV,
 *   as HF's eager bf16 attention casts them before P @ V.
 *   Otherwise generic_item on the natural layout, fp32 math: 8 keys' scores at once (a tree of horizontal
 *   adds), softmax weights and P V 8 lanes wide where the CPU has AVX2 + FMA, plain C else; the next chunk's
 *   K/V prefetched as on the AVX-512 path.
 *
 * Work items (make_items): a decode row over all KV heads (it streams each block front to back), a
 * longer tile per KV head; dynamic schedule, longest first. Decode is memory-bound: the next chunk's
 * K/V are prefetched into L2 a few lines per compute step. Built at first use with the system C
 * compiler (kernels/build.py); OpenMP shares torch's runtime (same libgomp), so torch.set_num_threads governs it.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "cobatch_kernels.h"
#include "parallel.h"

#if HAVE_AVX512
#include <immintrin.h>
#endif
/* The plain C path's scores, softmax weights and P V on 8 lanes where the CPU has AVX2 + FMA (AVX-512 CPUs
 * too, for the shapes and dtypes their fast path does not take). */
#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2 1
#include <immintrin.h>
#else
#define HAVE_AVX2 0
#endif
#if HAVE_AVX512 && defined(__AVX512BF16__)
#define HAVE_AVX512BF16 1
#else
#define HAVE_AVX512BF16 0
#endif

enum { CHUNK = 16 };  /* keys per softmax step: one fp32 vector of scores on AVX-512 */
/* 2^f for |f| <= 1/2, Horner's coefficients from the highest degree (exp2_ps, exp2_avx2) */
static const float EXP2_TAYLOR[8] = {1.525273380e-5f, 1.540353039e-4f, 1.333355815e-3f, 9.618129108e-3f,
                                     5.550410866e-2f, 2.402265070e-1f, 6.931471806e-1f, 1.0f};
enum { MAX_FAST_HEAD_DIM = 256 };
#define LAZY_RESCALE_LOG2 8.0f /* see softmax_step */
/* Software prefetch of K/V one chunk ahead, into L2 (T1): measured at decode B=64 ctx 256, 2 threads,
 * T1 beat T0 (~16-19 vs ~22-25 ms per 30 layers; T0 evicts the chunk in use from L1) and farther
 * distances were no better (the plain path on Zen 3 alike). -D override for such A/B builds. */
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 2  /* __builtin_prefetch's: T1 */
#endif

/* The call's arguments, shared by all work items. */
typedef struct {
    const void *q, *k_cache, *v_cache;
    void *out;
    const int64_t *block_tables;
    int64_t q_stride, max_blocks;
    int num_heads, num_kv_heads, head_dim, block_size, group;
    float scale;
    int64_t num_own_writes;  /* tiles [0, n) store their own new K/V first: write_own_key */
} Attn;

typedef struct { int64_t seq, first, num_tokens, context; } Tile;  /* one row of `tiles` */

/* Cache row indices (slot * num_kv_heads + h) of keys c0 .. c0 + n - 1: one division per chunk, not
 * one per key. */
static inline void chunk_rows(const Attn *a, const int64_t *table, int64_t c0, int n, int h,
                              int64_t rows[CHUNK]) {
    int64_t b = c0 / a->block_size, off = c0 % a->block_size;
    for (int j = 0; j < n; j++) {
        rows[j] = (table[b] * a->block_size + off) * a->num_kv_heads + h;
        if (++off == a->block_size) { off = 0; b++; }
    }
}

static inline int imin(int64_t x, int64_t y) { return (int)(x < y ? x : y); }

/* fmaxf inlined: a NaN argument yields the other one. (Without -ffinite-math-only, which the build does
 * not use, fmaxf is a libm call: perf put it at ~1% of decode attention, once per query head and chunk.) */
static inline float max_of(float a, float b) { return a > b || b != b ? a : b; }

#if HAVE_AVX512
static inline void write_key(const Attn *a, const char *krow, const char *vrow, void *k_cache, void *v_cache,
                             int64_t b, int h, int t, int is_bf16);  /* the K/V write section, below */
#endif

/* One token's K and V rows (krow, vrow: its KV head 0; heads head_dim apart) of heads h0 .. h1-1 into cache
 * slot `slot`: the kernel layout (write_key) where `fast` (use_fast_path) holds, else rows as they are. */
static inline void write_slot(const Attn *a, const char *krow, const char *vrow, void *k_cache, void *v_cache,
                              int64_t slot, int h0, int h1, int fast, int is_bf16) {
    const int64_t hd = a->head_dim, elem = is_bf16 ? 2 : 4;
#if HAVE_AVX512
    if (fast) {
        for (int h = h0; h < h1; h++)
            write_key(a, krow + h * hd * elem, vrow + h * hd * elem, k_cache, v_cache, slot / a->block_size, h,
                      (int)(slot % a->block_size), is_bf16);
        return;
    }
#endif
    (void)fast;
    const int64_t at = (slot * a->num_kv_heads + h0) * hd * elem, bytes = (h1 - h0) * hd * elem;
    memcpy((char *)k_cache + at, krow + h0 * hd * elem, bytes);
    memcpy((char *)v_cache + at, vrow + h0 * hd * elem, bytes);
}

/* Own writes: the first num_own_writes tiles are one-token rows (decode) whose new K/V sit in their q rows
 * right after the query heads (the C layer loop's qkv rows); the kernel stores them into the cache itself,
 * heads h0 .. h1-1 of the item, in the layout it reads (fast: the kernel layout), at the row's position
 * (context - 1). The fast path does it just before it reads that position's chunk, whose lines are then
 * on their way for the read anyway; a separate write beforehand stalled on them (decode B=32: ~0.4 ms of
 * writes against ~0.07 ms more attention when skipped, timers in the C loop). The caches' memory is the
 * caller's to write (const here for the readers). */
static void write_own_key(const Attn *a, const Tile *t, int h0, int h1, int fast, int is_bf16) {
    const int64_t hd = a->head_dim, elem = is_bf16 ? 2 : 4, p = t->context - 1;
    const int64_t slot = a->block_tables[t->seq * a->max_blocks + p / a->block_size] * a->block_size
                         + p % a->block_size;
    const char *krow = (const char *)a->q + (t->first * a->q_stride + (int64_t)a->num_heads * hd) * elem;
    write_slot(a, krow, krow + (int64_t)a->num_kv_heads * hd * elem, (void *)a->k_cache, (void *)a->v_cache, slot,
               h0, h1, fast, is_bf16);
}

/* ------------------------------------------------------------------------------------ generic path */

/* 16 fp32 lanes as one value (GCC/clang vector extension): dot's accumulator. */
typedef float Lanes __attribute__((vector_size(64)));

/* x . y in 16 fixed lanes, then a fixed-order sum: the same bits wherever x and y sit. The lanes are one
 * explicit vector: written as 16 scalar sums, -fassociative-math let the compiler vectorize across
 * iterations, peeling them by alignment, and the scratch rows' alignment depends on the tile (a row's bits
 * changed with the tiling at head_dim 40, 80, 128). */
static inline float dot(const float *restrict x, const float *restrict y, int n) {
    Lanes acc = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        Lanes xv, yv;
        memcpy(&xv, x + i, sizeof xv);
        memcpy(&yv, y + i, sizeof yv);
        acc += xv * yv;
    }
    float part[16], half[8];
    memcpy(part, &acc, sizeof part);
    for (; i < n; i++) part[i % 16] += x[i] * y[i];
    /* a fixed tree, 16 -> 8 -> 4 -> 2 -> 1: vector adds, where it was a chain of 16 scalar ones */
    for (int l = 0; l < 8; l++) half[l] = part[l] + part[l + 8];
    for (int l = 0; l < 4; l++) half[l] += half[l + 4];
    return (half[0] + half[2]) + (half[1] + half[3]);
}

#if HAVE_AVX2
/* q . k[j] of 8 keys: 8 lane-wise sums over head_dim, then one tree of horizontal adds gives the 8 scores in
 * one vector (a horizontal sum per key cost ~6 instructions each). Fixed order per key, wherever it sits. */
static inline __m256 scores8(const float *restrict q, const float *const *k, int hd) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (int d = 0; d < hd; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j] + d), a[j]);
    }
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* 2^x on 8 lanes for x <= 0: the AVX-512 path's exp2_ps (its polynomial; 2^n built as an exponent field) */
static inline __m256 exp2_avx2(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-126.0f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm256_sub_ps(x, n);
    __m256 p = _mm256_set1_ps(EXP2_TAYLOR[0]);
    for (int i = 1; i < 8; i++) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_TAYLOR[i]));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}
#endif

/* p[j] = e^(s[j] - mnew) for j < n (s holds CHUNK values): 8 at a time on AVX2, where it was a libm call per
 * key; else expf. */
static inline void softmax_weights(const float *s, int n, float mnew, float p[CHUNK]) {
#if HAVE_AVX2
    const __m256 m = _mm256_set1_ps(mnew), log2e = _mm256_set1_ps(1.44269504089f);
    for (int j = 0; j < n; j += 8)
        _mm256_storeu_ps(p + j, exp2_avx2(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), m), log2e)));
#else
    for (int j = 0; j < n; j++) p[j] = expf(s[j] - mnew);
#endif
}

/* s[j] = q . k[j] for j < n (key rows k, hd each); s holds CHUNK values, those past n are left undefined. */
static inline void chunk_scores(const float *q, const float *const *k, int n, int hd, float s[CHUNK]) {
#if HAVE_AVX2
    if (hd % 8 == 0) {
        for (int j0 = 0; j0 < n; j0 += 8) {
            const float *rows[8];
            for (int j = 0; j < 8; j++) rows[j] = k[j0 + j < n ? j0 + j : j0];  /* a valid row past n */
            _mm256_storeu_ps(s + j0, scores8(q, rows, hd));
        }
        return;
    }
#endif
    for (int j = 0; j < n; j++) s[j] = dot(q, k[j], hd);
}

/* acc = corr acc + sum_j p[j] v[j] over n value rows of hd: on AVX2, 64 columns of acc at a time kept in
 * registers over the chunk's keys (one load and store of acc per chunk instead of per key). */
static inline void chunk_pv(const float *p, int n, const float *const *v, int hd, float corr, float *restrict acc) {
#if HAVE_AVX2
    if (hd % 8 == 0) {
        const __m256 c = _mm256_set1_ps(corr);
        for (int d0 = 0; d0 < hd; d0 += 64) {
            const int w = hd - d0 >= 64 ? 8 : (hd - d0) / 8;
            __m256 r[8];
            for (int i = 0; i < w; i++) r[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + d0 + 8 * i), c);
            for (int j = 0; j < n; j++) {
                const __m256 pj = _mm256_set1_ps(p[j]);
                for (int i = 0; i < w; i++) r[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v[j] + d0 + 8 * i), r[i]);
            }
            for (int i = 0; i < w; i++) _mm256_storeu_ps(acc + d0 + 8 * i, r[i]);
        }
        return;
    }
#endif
#pragma omp simd
    for (int d = 0; d < hd; d++) acc[d] *= corr;
    for (int j = 0; j < n; j++) {
        const float *restrict vj = v[j];
#pragma omp simd
        for (int d = 0; d < hd; d++) acc[d] += p[j] * vj[d];
    }
}

/* Online-softmax step of one query head over n keys: scores s (CHUNK values, the first n valid), value
 * rows v[j] (hd each). */
static inline void generic_update(const float *s, int n, const float *const *v, int hd, float *mx,
                                  float *sum, float *restrict acc) {
    float cmax = -INFINITY, p[CHUNK];
    for (int j = 0; j < n; j++) cmax = s[j] > cmax ? s[j] : cmax;
    float mnew = cmax > *mx ? cmax : *mx, corr = expf(*mx - mnew);
    *mx = mnew;
    *sum *= corr;
    softmax_weights(s, n, mnew, p);
    for (int j = 0; j < n; j++) *sum += p[j];
    chunk_pv(p, n, v, hd, corr, acc);
}

/* Scratch floats one thread needs for items of up to `max_queries` query heads. */
static int64_t generic_scratch(const Attn *a, int64_t max_queries) {
    return max_queries * (2 * (int64_t)a->head_dim + 2) + 2 * CHUNK * (int64_t)a->head_dim;
}

/* out[0..n) = bf16 x[0..n) as fp32 (exact): 8 at a time on AVX2. */
static inline void widen_bf16(const uint16_t *x, float *out, int n) {
    int d = 0;
#if HAVE_AVX2
    for (; d + 8 <= n; d += 8)
        _mm256_storeu_ps(out + d, _mm256_castsi256_ps(_mm256_slli_epi32(
                                      _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(x + d))), 16)));
#endif
    for (; d < n; d++) out[d] = bf16_to_f32(x[d]);
}

/* Rows of the chunk's keys for KV head h as fp32: the cache rows themselves (fp32), or converted into
 * kc / vc (bf16). */
static inline void generic_rows(const Attn *a, const int64_t *table, int64_t c0, int n, int h, int hd,
                                int is_bf16, float *kc, float *vc, const float *k[CHUNK], const float *v[CHUNK]) {
    int64_t rows[CHUNK];
    chunk_rows(a, table, c0, n, h, rows);
    for (int j = 0; j < n; j++) {
        if (!is_bf16) {
            k[j] = (const float *)a->k_cache + rows[j] * hd, v[j] = (const float *)a->v_cache + rows[j] * hd;
            continue;
        }
        const uint16_t *ks = (const uint16_t *)a->k_cache + rows[j] * hd, *vs = (const uint16_t *)a->v_cache + rows[j] * hd;
        widen_bf16(ks, kc + j * hd, hd), widen_bf16(vs, vc + j * hd, hd);
        k[j] = kc + j * hd, v[j] = vc + j * hd;
    }
}

/* Software prefetch of a later chunk's K and V, a few lines at each step of the compute. Blocks sit
 * anywhere in the pool, so the hardware prefetcher cannot run ahead; and a burst of prefetches would
 * wait for free miss buffers and stall the core as demand loads do, so they are spread over the chunk's
 * arithmetic instead. The rows (quads on the AVX-512 path) are merged into contiguous ranges (with 16-token
 * blocks a decode row's chunk is two: its block's K and V for all heads). */
enum { MAX_RANGES = 64 };  /* more (many KV heads on small blocks) are left to the hardware */
typedef struct {
    const char *start[MAX_RANGES], *end[MAX_RANGES];  /* line-aligned ranges, K then V */
    int num_ranges, per_step;                         /* lines per call of prefetch_step */
    int range;                                        /* cursor: the range and the line in it */
    const char *at;
} Prefetch;

static inline void prefetch_step(Prefetch *p) {
    for (int k = 0; k < p->per_step && p->range < p->num_ranges; k++) {
        __builtin_prefetch(p->at, 0, PREFETCH_LOCALITY);
        p->at += 64;
        if (p->at >= p->end[p->range] && ++p->range < p->num_ranges) p->at = p->start[p->range];
    }
}

/* Append [start, start + bytes), extending the last range when it continues it. */
static inline void add_range(Prefetch *p, const char *start, int64_t bytes) {
    const char *line = (const char *)((uintptr_t)start & ~(uintptr_t)63);
    const int last = p->num_ranges - 1;
    if (last >= 0 && line >= p->start[last] && line <= p->end[last]) {
        if (start + bytes > p->end[last]) p->end[last] = start + bytes;
        return;
    }
    if (p->num_ranges == MAX_RANGES) return;
    p->start[p->num_ranges] = line, p->end[p->num_ranges++] = start + bytes;
}

/* The ranges' lines spread over `steps` calls of prefetch_step, from the first. */
static inline void prefetch_spread(Prefetch *p, int steps) {
    int64_t lines = 0;
    for (int r = 0; r < p->num_ranges; r++) lines += (p->end[r] - p->start[r] + 63) / 64;
    p->per_step = (int)((lines + steps - 1) / (steps > 0 ? steps : 1));
    p->range = 0, p->at = p->num_ranges > 0 ? p->start[0] : NULL;
}

static inline void prefetch_rest(Prefetch *p) {
    p->per_step = 1 << 30;
    prefetch_step(p);
}

/* Aim at the K and V rows of keys c0 .. c0 + CHUNK - 1 (those before `last`) of KV heads h0 .. h1-1 in the
 * natural layout, spread over `steps` calls: a decode row's item (all heads) reads whole blocks, one range each
 * for K and V. Once the plain path's arithmetic ran 8 lanes wide, the V rows' misses were a decode step's hot
 * spots (perf, Zen 3); prefetched a chunk ahead, SmolLM2's decode attention at batch 16 ran 1.3x at context 64
 * and 1.4x at 256. */
static inline void chunk_prefetch_start(Prefetch *p, const Attn *a, const int64_t *table, int64_t c0, int64_t last,
                                        int h0, int h1, int steps, int64_t elem_bytes) {
    const int n = c0 < last ? imin(CHUNK, last - c0) : 0;
    const int64_t row_bytes = a->head_dim * elem_bytes;
    int64_t rows[CHUNK];
    chunk_rows(a, table, c0, n, h0, rows);
    p->num_ranges = 0;
    for (int kv = 0; kv < 2; kv++)
        for (int j = 0; j < n; j++)
            add_range(p, (const char *)(kv ? a->v_cache : a->k_cache) + rows[j] * row_bytes, (h1 - h0) * row_bytes);
    prefetch_spread(p, steps);
}

/* One work item in plain C: tile t, KV heads h0 .. h1-1 with all heads of their groups; fp32 state,
 * dtype of q/cache/out per is_bf16. Chunks outer, KV heads inner (a decode row streams each block front
 * to back). Query head m of the item: m = ((h - h0) * tokens + i) * group + g. */
static inline __attribute__((always_inline)) void generic_item(const Attn *a, const Tile *t, int h0, int h1,
                                                               float *buf, const int hd, const int is_bf16) {
    const int group = a->group, nt = (int)t->num_tokens, per_head = nt * group, nq = (h1 - h0) * per_head;
    float *qf = buf, *acc = qf + (int64_t)nq * hd, *mx = acc + (int64_t)nq * hd, *sum = mx + nq;
    float *kc = sum + nq, *vc = kc + CHUNK * hd, s[CHUNK] = {0};  /* all CHUNK read: softmax_weights */
    const int64_t *table = a->block_tables + t->seq * a->max_blocks, last = t->context + nt - 1;
    for (int m = 0; m < nq; m++) {
        int64_t token = t->first + m / group % nt, head = (h0 + m / per_head) * group + m % group;
        float *qm = qf + (int64_t)m * hd;
        for (int d = 0; d < hd; d++) {
            int64_t i = token * a->q_stride + head * hd + d;
            qm[d] = a->scale * (is_bf16 ? bf16_to_f32(((const uint16_t *)a->q)[i]) : ((const float *)a->q)[i]);
        }
        mx[m] = -INFINITY, sum[m] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * nq * hd);
    for (int64_t c0 = 0; c0 < last; c0 += CHUNK) {
        int n = imin(CHUNK, last - c0);
        int first_token = c0 >= t->context ? (int)(c0 - t->context + 1) : 0;  /* causal */
        Prefetch pf;
        if (c0 == 0) {  /* the first chunk: nothing to hide it behind */
            chunk_prefetch_start(&pf, a, table, c0, last, h0, h1, 1, is_bf16 ? 2 : 4);
            prefetch_rest(&pf);
        }
        chunk_prefetch_start(&pf, a, table, c0 + CHUNK, last, h0, h1, (h1 - h0) * (nt - first_token) * group,
                             is_bf16 ? 2 : 4);
        for (int h = h0; h < h1; h++) {
            const float *k[CHUNK], *v[CHUNK];
            generic_rows(a, table, c0, n, h, hd, is_bf16, kc, vc, k, v);
            for (int i = first_token; i < nt; i++) {
                int valid = imin(n, t->context + i - c0);
                for (int m = ((h - h0) * nt + i) * group, g = 0; g < group; g++, m++) {
                    prefetch_step(&pf);
                    chunk_scores(qf + (int64_t)m * hd, k, valid, hd, s);
                    generic_update(s, valid, v, hd, mx + m, sum + m, acc + (int64_t)m * hd);
                }
            }
        }
    }
    for (int m = 0; m < nq; m++) {
        int64_t token = t->first + m / group % nt, head = (h0 + m / per_head) * group + m % group;
        int64_t o = (token * a->num_heads + head) * hd;
        float inv = 1.0f / sum[m];
        for (int d = 0; d < hd; d++) {
            float x = acc[(int64_t)m * hd + d] * inv;
            if (is_bf16) ((uint16_t *)a->out)[o + d] = f32_to_bf16(x);
            else ((float *)a->out)[o + d] = x;
        }
    }
}

/* ------------------------------------------------------------------------- AVX-512 path (fp32, bf16) */
#if HAVE_AVX512

/* Quads past a chunk's last key point here: zeros (their V is never read, their K lanes are masked). */
static const float ZERO_QUAD[4 * MAX_FAST_HEAD_DIM] __attribute__((aligned(64)));

/* Per-thread scratch, 64-byte aligned (stored with aligned moves). */
typedef struct {
    float *acc;     /* [queries][hd] fp32 */
    float *lsum;    /* [queries][CHUNK]: softmax denominators, summed across lanes at the end */
    float *mx;      /* [queries]: the raw score the weights are taken against (softmax_step) */
} Fast;

static int64_t fast_scratch_bytes(const Attn *a, int64_t max_queries) {
    return 4 * max_queries * (a->head_dim + CHUNK + 1) + 64 * 4;
}

static Fast fast_scratch(const Attn *a, int64_t max_queries, char *buf) {
    Fast f;
    uintptr_t p = ((uintptr_t)buf + 63) & ~(uintptr_t)63;
#define TAKE(ptr, type, bytes) (ptr = (type *)p, p = (p + (bytes) + 63) & ~(uintptr_t)63)
    TAKE(f.acc, float, 4 * max_queries * a->head_dim);
    TAKE(f.lsum, float, 4 * max_queries * CHUNK);
    TAKE(f.mx, float, 4 * max_queries);
#undef TAKE
    return f;
}

/* Where key t (t < block_size) of KV head h in block b starts its quad, in elements (kernel layout). */
static inline int64_t quad_start(const Attn *a, int64_t b, int h, int t) {
    return ((b * a->num_kv_heads + h) * a->block_size + t / 4 * 4) * a->head_dim;
}

/* A chunk's four quads for KV head 0 (head h's: + h * head_bytes), K and V: quads holding none of its
 * n keys point at ZERO_QUAD (and stay there for every head, see quad_of_head). One division per chunk. */
typedef struct { const char *k[4], *v[4]; int live; int64_t head_bytes; } Quads;

static inline Quads chunk_quads(const Attn *a, const int64_t *table, int64_t c0, int n, int elem_bytes) {
    int64_t b = c0 / a->block_size, off = c0 % a->block_size;
    Quads qs;
    qs.live = (n + 3) / 4, qs.head_bytes = (int64_t)a->block_size * a->head_dim * elem_bytes;
    for (int i = 0; i < 4; i++, off += 4) {
        if (off == a->block_size) b++, off = 0;
        if (i >= qs.live) {
            qs.k[i] = qs.v[i] = (const char *)ZERO_QUAD;
            continue;
        }
        const int64_t at = quad_start(a, table[b], 0, (int)off) * elem_bytes;
        qs.k[i] = (const char *)a->k_cache + at, qs.v[i] = (const char *)a->v_cache + at;
    }
    return qs;
}

/* Aim at the live quads of qs for KV heads h0 .. h1-1, spread over `steps` calls. */
static inline void prefetch_start(Prefetch *p, const Attn *a, const Quads *qs, int h0, int h1, int steps,
                                  int elem_bytes) {
    const int64_t quad_bytes = 4 * (int64_t)a->head_dim * elem_bytes;
    p->num_ranges = 0;
    for (int kv = 0; kv < 2; kv++)
        for (int h = h0; h < h1; h++)
            for (int i = 0; i < qs->live; i++) add_range(p, (kv ? qs->v[i] : qs->k[i]) + h * qs->head_bytes, quad_bytes);
    prefetch_spread(p, steps);
}

/* 2^x for x <= 0 (softmax weights): 2^n * p(f), n = round(x), |f| <= 1/2, degree-7 Taylor polynomial
 * (relative error ~1e-8, under fp32 rounding); x below -126 gives ~2^-126, which the mask or the
 * sum of the larger weights then drops. */
static inline __m512 exp2_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(EXP2_TAYLOR[0]);
    for (int i = 1; i < 8; i++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_TAYLOR[i]));
    return _mm512_scalef_ps(p, n);
}

/* quad i's vector of keys 4i .. 4i+3 (dword r: key 4i + r) holds in 128-bit lane L the column
 * 16 cb + 4L + j (the K quad of the file header): acc[q][i] lane L sums q's columns 4L + j
 * against it; sum_lanes adds the four lanes at the end: a transposed read without a transpose. */
static inline __m512 sum_lanes(const __m512 acc[4]) {
    __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(acc[0], acc[1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(acc[0], acc[1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2], acc[3], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(acc[2], acc[3], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* acc += k . x per lane: one bf16-pair dot product (bf16) or one fused multiply-add (fp32). */
static inline __attribute__((always_inline)) __m512 madd(__m512 acc, __m512i k, __m512i x, const int bf16) {
#if HAVE_AVX512BF16
    if (bf16) return _mm512_dpbf16_ps(acc, (__m512bh)k, (__m512bh)x);
#endif
    (void)bf16;
    return _mm512_fmadd_ps(_mm512_castsi512_ps(k), _mm512_castsi512_ps(x), acc);
}

/* The staged chunk of one KV head: its four K and V quads. */
typedef struct { const __m512i *k[4]; const char *v[4]; } Chunk;

/* One column j of a 16-column block cb: acc[q][i] += K quad i's vector (cb, j) . (q's column 4L + j in
 * every dword of lane L). j must be a constant (shuffle immediate). */
static inline __attribute__((always_inline)) void scores_column(__m512 acc[4][4], const __m512i qv[4],
                                                                const Chunk *ch, int cb, const int nb,
                                                                const int j, const int bf16) {
    __m512i qj[4];
    for (int q = 0; q < nb; q++) qj[q] = _mm512_shuffle_epi32(qv[q], (_MM_PERM_ENUM)(j * 0x55));
    for (int i = 0; i < 4; i++) {
        __m512i k = _mm512_loadu_si512(ch->k[i] + 4 * cb + j);
        for (int q = 0; q < nb; q++) acc[q][i] = madd(acc[q][i], k, qj[q], bf16);
    }
}

/* Raw scores of nb (<= 4, a constant where inlined) query heads against the chunk's 16 keys: each K
 * load serves all nb heads; 4 nb independent accumulators keep the multiply units busy. */
static inline __attribute__((always_inline)) void block_scores(const uint32_t *const qp[4], const Chunk *ch,
                                                               int columns, const int nb, __m512 s[4],
                                                               Prefetch *pf, const int bf16) {
    __m512 acc[4][4];
    for (int q = 0; q < nb; q++)
        for (int i = 0; i < 4; i++) acc[q][i] = _mm512_setzero_ps();
    for (int cb = 0; cb < columns / 16; cb++) {
        __m512i qv[4];
        for (int q = 0; q < nb; q++) qv[q] = _mm512_loadu_si512(qp[q] + cb * 16);
        prefetch_step(pf);
        scores_column(acc, qv, ch, cb, nb, 0, bf16);
        scores_column(acc, qv, ch, cb, nb, 1, bf16);
        prefetch_step(pf);
        scores_column(acc, qv, ch, cb, nb, 2, bf16);
        scores_column(acc, qv, ch, cb, nb, 3, bf16);
    }
    for (int q = 0; q < nb; q++) s[q] = sum_lanes(acc[q]);
}

/* Online-softmax step of one query head: fold scores s (lanes outside `valid` ignored) into its running
 * denominator; returns the factor its accumulator must be scaled by, and the weights in w: bf16, rounded
 * as (key 2j, key 2j+1) pairs (w[0..7]); fp32, as they are. c = scale * log2(e): weights are
 * 2^(c * (s - ref)), ref = *mx.
 *
 * Lazy rescaling (as FlashAttention-4 does): ref starts as the first chunk's max and is raised to the
 * running max (the accumulator rescaled) only when a score passes it by more than LAZY_RESCALE_LOG2 / c,
 * so weights stay <= 2^LAZY_RESCALE_LOG2, far from fp32's range, and rounding them to bf16 keeps the
 * same relative precision. After the first chunks a query's max rarely moves that much (the first
 * tokens take most of the attention), so most steps skip the horizontal max and the correction's
 * exponential: prefill attention 10-12% faster (12 x 170 tokens and a 2k prompt, alternating builds);
 * decode, bound by its K/V reads, unchanged. The same softmax: all weights and the denominator share ref. */
static inline __attribute__((always_inline)) __m512 softmax_step(__m512 s, __mmask16 valid, float c, float *mx,
                                                                 float *lsum, uint32_t w[CHUNK], const int bf16) {
    s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, s);
    __m512 vc = _mm512_set1_ps(c), corr = _mm512_set1_ps(1.0f);
    /* the first chunk always passes: ref is -inf, and each query sees key 0 there */
    if (_mm512_cmp_ps_mask(s, _mm512_set1_ps(*mx + LAZY_RESCALE_LOG2 / c), _CMP_GT_OQ)) {
        float mnew = max_of(*mx, _mm512_reduce_max_ps(s));
        /* 0 on the first chunk (ref was -inf; accumulator and denominator are 0 then) */
        corr = exp2_ps(_mm512_fmsub_ps(_mm512_set1_ps(*mx), vc, _mm512_set1_ps(mnew * c)));
        *mx = mnew;
    }
    __m512 p = _mm512_maskz_mov_ps(valid, exp2_ps(_mm512_fmsub_ps(s, vc, _mm512_set1_ps(*mx * c))));
    _mm512_store_ps(lsum, _mm512_fmadd_ps(_mm512_load_ps(lsum), corr, p));
#if HAVE_AVX512BF16
    if (bf16) {
        _mm256_storeu_si256((__m256i *)w, (__m256i)_mm512_cvtneps_pbh(p));
        return corr;
    }
#endif
    (void)bf16;
    _mm512_storeu_ps(w, p);
    return corr;
}

/* V of step j (bf16: key pair j, keys 2j and 2j+1 interleaved per element; fp32: key j), columns
 * d0 .. d0+15. A pair whose second key lies past the chunk's last (odd_tail) has that key's halves
 * zeroed: the slot may hold anything, and 0 * NaN would poison the sum. */
static inline __attribute__((always_inline)) __m512i value_vector(const Chunk *ch, int j, int d0, int hd,
                                                                  int odd_tail, const int bf16) {
    if (bf16) {
        __m512i v = _mm512_loadu_si512((const uint32_t *)ch->v[j >> 1] + (j & 1) * hd + d0);
        return odd_tail ? _mm512_maskz_mov_epi16(0x55555555u, v) : v;
    }
    return _mm512_loadu_si512((const float *)ch->v[j >> 2] + (j & 3) * hd + d0);
}

/* acc = acc * corr + P V for nb (<= 4) query heads over `steps` key pairs (bf16) or keys (fp32), 64
 * values of d at a time: each V load serves all nb heads. Steps past the chunk's last key are not
 * taken (their slots hold anything); odd_tail: see value_vector. */
static inline __attribute__((always_inline)) void block_pv(const uint32_t w[4][CHUNK], const __m512 corr[4],
                                                           const Chunk *ch, float *const acc[4], int hd,
                                                           const int nb, const int steps, const int odd_tail,
                                                           Prefetch *pf, const int bf16) {
    for (int d0 = 0; d0 < hd; d0 += 64) {
        const int n = imin(4, (hd - d0) / 16);
        __m512 o[4][4];
        for (int q = 0; q < nb; q++)
            for (int k = 0; k < n; k++) o[q][k] = _mm512_mul_ps(_mm512_load_ps(acc[q] + d0 + 16 * k), corr[q]);
        for (int j = 0; j < steps; j++) {
            prefetch_step(pf);
            __m512i wj[4];
            for (int q = 0; q < nb; q++) wj[q] = _mm512_set1_epi32((int)w[q][j]);
            for (int k = 0; k < n; k++) {
                __m512i v = value_vector(ch, j, d0 + 16 * k, hd, odd_tail && j == steps - 1, bf16);
                for (int q = 0; q < nb; q++) o[q][k] = madd(o[q][k], v, wj[q], bf16);
            }
        }
        for (int q = 0; q < nb; q++)
            for (int k = 0; k < n; k++) _mm512_store_ps(acc[q] + d0 + 16 * k, o[q][k]);
    }
}

/* The 32-bit columns of query head `head` of a token. */
static inline const uint32_t *query_columns(const Attn *a, int64_t token, int head, int elem_bytes) {
    return (const uint32_t *)((const char *)a->q + (token * a->q_stride + (int64_t)head * a->head_dim) * elem_bytes);
}

/* One chunk (n keys) for nb consecutive query heads of the item, all of KV head h: index m0 + q = (h - h0,
 * token i, head g in the group) (see fast_item), starting at token i0, head g0 and counted up from there
 * (no divisions: they showed in perf); `valid` masks per head. */
static inline __attribute__((always_inline)) void chunk_block(const Attn *a, const Tile *t, int h, int m0, int i0,
                                                              int g0, const int nb, int64_t c0, int n,
                                                              const Chunk *ch, Fast *f, int hd, Prefetch *pf,
                                                              const int bf16) {
    const int group = a->group;
    const uint32_t *qp[4];
    __mmask16 valid[4];
    for (int q = 0, i = i0, g = g0; q < nb; q++) {
        int64_t seen = t->context + i - c0;  /* keys of this chunk the token sees */
        valid[q] = seen >= CHUNK ? (__mmask16)0xffff : (__mmask16)((1u << seen) - 1);
        qp[q] = query_columns(a, t->first + i, h * group + g, bf16 ? 2 : 4);
        if (++g == group) g = 0, i++;
    }
    __m512 s[4], corr[4];
    uint32_t w[4][CHUNK];
    float *acc[4];
    block_scores(qp, ch, bf16 ? hd / 2 : hd, nb, s, pf, bf16);
    const float c = a->scale * 1.44269504088896341f;  /* log2(e) */
    for (int q = 0; q < nb; q++) {
        int m = m0 + q;
        corr[q] = softmax_step(s[q], valid[q], c, f->mx + m, f->lsum + m * CHUNK, w[q], bf16);
        acc[q] = f->acc + (int64_t)m * hd;
    }
    if (n == CHUNK) block_pv(w, corr, ch, acc, hd, nb, bf16 ? CHUNK / 2 : CHUNK, 0, pf, bf16);  /* unrolled */
    else if (bf16) block_pv(w, corr, ch, acc, hd, nb, (n + 1) / 2, n & 1, pf, bf16);
    else block_pv(w, corr, ch, acc, hd, nb, n, 0, pf, bf16);
}

/* acc times inv into an output row, rounded to bf16 or as is. */
static inline __attribute__((always_inline)) void store_row(const float *acc, float inv, int hd, void *out,
                                                            const int bf16) {
    __m512 s = _mm512_set1_ps(inv);
#if HAVE_AVX512BF16
    if (bf16) {
        for (int d0 = 0; d0 < hd; d0 += 16) {
            __m512 x = _mm512_mul_ps(_mm512_load_ps(acc + d0), s);
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + d0), (__m256i)_mm512_cvtneps_pbh(x));
        }
        return;
    }
#endif
    (void)bf16;
    for (int d0 = 0; d0 < hd; d0 += 16)
        _mm512_storeu_ps((float *)out + d0, _mm512_mul_ps(_mm512_load_ps(acc + d0), s));
}

/* One chunk of one KV head for the item's query heads from token first_token on, in blocks of 4. */
static inline __attribute__((always_inline)) void chunk_head(const Attn *a, const Tile *t, int h0, int h, int nt,
                                                             int first_token, int64_t c0, int n, const Chunk *ch,
                                                             Fast *f, int hd, Prefetch *pf, const int bf16) {
    const int group = a->group, per_head = nt * group;
    int m = (h - h0) * per_head + first_token * group, end = (h - h0 + 1) * per_head;
    int i = first_token, g = 0;  /* token and head in group of query m, advanced 4 heads at a time */
    for (; m + 4 <= end; m += 4) {
        chunk_block(a, t, h, m, i, g, 4, c0, n, ch, f, hd, pf, bf16);
        for (int k = 0; k < 4; k++)
            if (++g == group) g = 0, i++;
    }
    switch (end - m) {
        case 3: chunk_block(a, t, h, m, i, g, 3, c0, n, ch, f, hd, pf, bf16); break;
        case 2: chunk_block(a, t, h, m, i, g, 2, c0, n, ch, f, hd, pf, bf16); break;
        case 1: chunk_block(a, t, h, m, i, g, 1, c0, n, ch, f, hd, pf, bf16); break;
        default: break;
    }
}

/* KV head h's quads of a chunk (qs: head 0's). */
static inline Chunk quad_of_head(const Quads *qs, int h) {
    Chunk ch;
    for (int i = 0; i < 4; i++) {
        const int64_t at = i < qs->live ? h * qs->head_bytes : 0;  /* ZERO_QUAD stays put */
        ch.k[i] = (const __m512i *)(qs->k[i] + at), ch.v[i] = qs->v[i] + at;
    }
    return ch;
}

/* One work item: tile t, KV heads h0 .. h1-1 with all heads of their groups; hd and bf16 are constants
 * where inlined. Chunks outer, KV heads inner, so a decode row streams each block once, front to back.
 * Query head m of the item: m = ((h - h0) * tokens + i) * group + g. */
static inline __attribute__((always_inline)) void fast_item(const Attn *a, const Tile *t, int h0, int h1,
                                                            int own_write, Fast *f, const int hd, const int bf16) {
    const int group = a->group, nt = (int)t->num_tokens, nq = (h1 - h0) * nt * group;
    const int elem_bytes = bf16 ? 2 : 4, columns = bf16 ? hd / 2 : hd;
    const int64_t *table = a->block_tables + t->seq * a->max_blocks, last = t->context + nt - 1;
    /* prefetch steps per block of query heads: see block_scores and block_pv */
    const int block_steps = columns / 16 * 2 + (hd + 63) / 64 * (bf16 ? CHUNK / 2 : CHUNK);
    memset(f->acc, 0, sizeof(float) * nq * hd);
    memset(f->lsum, 0, sizeof(float) * nq * CHUNK);
    for (int m = 0; m < nq; m++) f->mx[m] = -INFINITY;
    /* this chunk's quads and the next one's (prefetched meanwhile) */
    Quads qs[2];
    int cur = 0;
    Prefetch pf;
    qs[cur] = chunk_quads(a, table, 0, imin(CHUNK, last), elem_bytes);
    prefetch_start(&pf, a, &qs[cur], h0, h1, 1, elem_bytes);
    prefetch_rest(&pf);  /* the first chunk: nothing to hide it behind */
    for (int64_t c0 = 0; c0 < last; c0 += CHUNK, cur ^= 1) {
        int n = imin(CHUNK, last - c0);
        int first_token = c0 >= t->context ? (int)(c0 - t->context + 1) : 0;  /* causal */
        pf.num_ranges = 0;
        if (c0 + CHUNK < last) {
            qs[cur ^ 1] = chunk_quads(a, table, c0 + CHUNK, imin(CHUNK, last - c0 - CHUNK), elem_bytes);
            prefetch_start(&pf, a, &qs[cur ^ 1], h0, h1,
                           (h1 - h0) * (((nt - first_token) * group + 3) / 4) * block_steps, elem_bytes);
        }
        if (own_write && c0 + CHUNK >= last) write_own_key(a, t, h0, h1, 1, bf16);  /* its chunk is this one */
        for (int h = h0; h < h1; h++) {
            Chunk ch = quad_of_head(&qs[cur], h);
            chunk_head(a, t, h0, h, nt, first_token, c0, n, &ch, f, hd, &pf, bf16);
        }
        prefetch_rest(&pf);
    }
    for (int m = 0; m < nq; m++) {
        int64_t token = t->first + m / group % nt, head = (h0 + m / (nt * group)) * group + m % group;
        float l = _mm512_reduce_add_ps(_mm512_load_ps(f->lsum + m * CHUNK));
        store_row(f->acc + (int64_t)m * hd, 1.0f / l, hd,
                  (char *)a->out + (token * a->num_heads + head) * hd * elem_bytes, bf16);
    }
}
#endif  /* HAVE_AVX512 */

/* ------------------------------------------------------------------------------------------ driver */

/* The AVX-512 path: fp32 with AVX-512F/BW, bf16 with AVX512-BF16 too; whole 16-column blocks, whole
 * quads in a block. It reads the kernel layout, which paged_write_kv writes under the same test. */
static inline int use_fast_path(const Attn *a, int is_bf16) {
    if (a->head_dim > MAX_FAST_HEAD_DIM || a->block_size % 4 != 0) return 0;
    if (is_bf16) return HAVE_AVX512BF16 && a->head_dim % 32 == 0;
    return HAVE_AVX512 && a->head_dim % 16 == 0;
}

static int64_t scratch_bytes(const Attn *a, int64_t max_queries, int is_bf16) {
#if HAVE_AVX512
    if (use_fast_path(a, is_bf16)) return fast_scratch_bytes(a, max_queries);
#endif
    (void)is_bf16;
    return sizeof(float) * generic_scratch(a, max_queries);
}

/* One work item: tile t, KV heads h0 .. h1-1 (own_write: the tile writes its new K/V first). Constant
 * head sizes let the compiler unroll the loops. */
static void run_item(const Attn *a, const Tile *t, int h0, int h1, int own_write, char *buf,
                     int64_t max_queries, int is_bf16) {
#if HAVE_AVX512
    if (use_fast_path(a, is_bf16)) {
        Fast f = fast_scratch(a, max_queries, buf);
        if (is_bf16 && a->head_dim == 64) fast_item(a, t, h0, h1, own_write, &f, 64, 1);
        else if (is_bf16 && a->head_dim == 128) fast_item(a, t, h0, h1, own_write, &f, 128, 1);
        else if (is_bf16) fast_item(a, t, h0, h1, own_write, &f, a->head_dim, 1);
        else if (a->head_dim == 64) fast_item(a, t, h0, h1, own_write, &f, 64, 0);
        else if (a->head_dim == 128) fast_item(a, t, h0, h1, own_write, &f, 128, 0);
        else fast_item(a, t, h0, h1, own_write, &f, a->head_dim, 0);
        return;
    }
#endif
    (void)max_queries;
    if (own_write) write_own_key(a, t, h0, h1, 0, is_bf16);
    if (a->head_dim == 64 && is_bf16) generic_item(a, t, h0, h1, (float *)buf, 64, 1);
    else if (a->head_dim == 64) generic_item(a, t, h0, h1, (float *)buf, 64, 0);
    else if (a->head_dim == 128 && is_bf16) generic_item(a, t, h0, h1, (float *)buf, 128, 1);
    else if (a->head_dim == 128) generic_item(a, t, h0, h1, (float *)buf, 128, 0);
    else if (is_bf16) generic_item(a, t, h0, h1, (float *)buf, a->head_dim, 1);
    else generic_item(a, t, h0, h1, (float *)buf, a->head_dim, 0);
}

/* Work items: a one-token tile (decode row) is one item over all KV heads, so it reads each block
 * front to back in one go, unless there are too few rows to keep the threads busy (one thread always
 * takes whole rows: one stream's decode attention on Zen 3, split per head, ran 1.2-1.6x slower); a longer tile is
 * one item per KV head (its K/V are reused by many queries, and the finer items balance the threads).
 * The split changes no result: each KV head's queries are computed the same way in any item. Last
 * tiles first: within a sequence, later tiles see more context, so the longest items start first.
 * item[k] = (tile, h0, h1); returns the count. */
static int64_t make_items(const Attn *a, const int64_t *tiles, int num_tiles, int64_t (*items)[3],
                          int64_t *max_queries) {
    int64_t n = 0, threads = omp_get_max_threads(), whole_rows = threads == 1 || num_tiles >= 2 * threads;
    *max_queries = 0;
    for (int i = num_tiles - 1; i >= 0; i--) {
        int64_t tokens = tiles[4 * i + 2], step = tokens == 1 && whole_rows ? a->num_kv_heads : 1;
        for (int h = 0; h < a->num_kv_heads; h += (int)step) {
            items[n][0] = i, items[n][1] = h, items[n][2] = h + step, n++;
        }
        int64_t queries = tokens * step * a->group;
        *max_queries = queries > *max_queries ? queries : *max_queries;
    }
    return n;
}

/* A thread's share of the work items (dynamic schedule), with its own scratch of `bytes`; *failed = 1 if
 * that could not be allocated. */
static void run_items(const Attn *a, const int64_t *tiles, const int64_t (*items)[3], int64_t num_items,
                      int64_t max_queries, int64_t bytes, int is_bf16, int *failed) {
    char *buf = aligned_alloc(64, (bytes + 63) & ~(int64_t)63);
    if (buf == NULL) {
#pragma omp atomic write
        *failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t k = 0; k < num_items; k++) {
        if (buf == NULL) continue;
        const Tile *t = (const Tile *)(tiles + 4 * items[k][0]);
        const int own_write = items[k][0] < a->num_own_writes && t->num_tokens == 1;
        run_item(a, t, (int)items[k][1], (int)items[k][2], own_write, buf, max_queries, is_bf16);
    }
    free(buf);
}

/* Parallel over work items, dynamic schedule. Returns 0, or -1 if scratch could not be allocated. */
static int run(const Attn *a, const int64_t *tiles, int num_tiles, int is_bf16) {
    int64_t (*items)[3] = malloc(sizeof(*items) * ((size_t)num_tiles * a->num_kv_heads + 1));
    if (items == NULL) return -1;
    int64_t max_queries, num_items = make_items(a, tiles, num_tiles, items, &max_queries);
    int64_t bytes = scratch_bytes(a, max_queries, is_bf16);
    int failed = 0;
    RUN_TEAM(team_size(0, num_items), run_items(a, tiles, (const int64_t (*)[3])items, num_items, max_queries,
                                                bytes, is_bf16, &failed));
    free(items);
    return failed ? -1 : 0;
}

static int attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                     const int64_t *block_tables, int64_t max_blocks, const int64_t *tiles, int num_tiles,
                     void *out, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                     int64_t num_own_writes, int is_bf16) {
    Attn a = {q, k_cache, v_cache, out, block_tables, q_stride, max_blocks, num_heads, num_kv_heads,
              head_dim, block_size, num_heads / num_kv_heads, scale, num_own_writes};
    return run(&a, tiles, num_tiles, is_bf16);
}

/* num_own_writes: see write_own_key (0: every K/V was written before the call). */
int paged_attention_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                        const int64_t *block_tables, int64_t max_blocks, const int64_t *tiles, int num_tiles,
                        float *out, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                        int64_t num_own_writes) {
    return attention(q, q_stride, k_cache, v_cache, block_tables, max_blocks, tiles, num_tiles, out,
                     num_heads, num_kv_heads, head_dim, block_size, scale, num_own_writes, 0);
}

int paged_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                         const int64_t *block_tables, int64_t max_blocks, const int64_t *tiles, int num_tiles,
                         uint16_t *out, int num_heads, int num_kv_heads, int head_dim, int block_size,
                         float scale, int64_t num_own_writes) {
    return attention(q, q_stride, k_cache, v_cache, block_tables, max_blocks, tiles, num_tiles, out,
                     num_heads, num_kv_heads, head_dim, block_size, scale, num_own_writes, 1);
}

/* 1 when this dtype (bf16 or fp32), head_dim and block_size run the AVX-512 path, on the kernel layout
 * (tests report the path; 0: the plain C path on the natural layout). */
int paged_attention_is_fast(int is_bf16, int head_dim, int block_size) {
    Attn a = {0};
    a.head_dim = head_dim, a.block_size = block_size;
    return use_fast_path(&a, is_bf16);
}

/* ---------------------------------------------------------------------------------------- K/V write */

#if HAVE_AVX512
/* One key's K and V rows of one KV head into its quads (kernel layout, file header): K column c (a
 * 32-bit element) to dword ((c / 16 * 4 + c % 4) * 4 + c % 16 / 4) * 4 + r of the quad, r = t % 4, a
 * column block's 16 dwords as 4 in-lane broadcasts and masked stores; bf16 V element d to (r / 2 *
 * head_dim + d) * 2 + r % 2 (widened, shifted into place, masked store); fp32 V row r as it is. (Scalar
 * stores, one per element, made the write 2x slower at decode B=32.) */
static inline void write_key(const Attn *a, const char *krow, const char *vrow, void *k_cache, void *v_cache,
                             int64_t b, int h, int t, int is_bf16) {
    const int hd = a->head_dim, r = t % 4, columns = is_bf16 ? hd / 2 : hd;
    const int64_t q = quad_start(a, b, h, t);
    uint32_t *kq = (uint32_t *)((char *)k_cache + q * (is_bf16 ? 2 : 4));
    const __mmask16 lanes = (__mmask16)(0x1111u << r);
    for (int cb = 0; cb < columns / 16; cb++) {
        __m512i x = _mm512_loadu_si512(krow + 64 * cb);
        _mm512_mask_storeu_epi32(kq + (cb * 4 + 0) * 16, lanes, _mm512_shuffle_epi32(x, (_MM_PERM_ENUM)0x00));
        _mm512_mask_storeu_epi32(kq + (cb * 4 + 1) * 16, lanes, _mm512_shuffle_epi32(x, (_MM_PERM_ENUM)0x55));
        _mm512_mask_storeu_epi32(kq + (cb * 4 + 2) * 16, lanes, _mm512_shuffle_epi32(x, (_MM_PERM_ENUM)0xaa));
        _mm512_mask_storeu_epi32(kq + (cb * 4 + 3) * 16, lanes, _mm512_shuffle_epi32(x, (_MM_PERM_ENUM)0xff));
    }
    if (is_bf16) {
        uint16_t *vq = (uint16_t *)v_cache + q + (r / 2) * hd * 2;
        const __mmask32 half = r % 2 ? 0xaaaaaaaau : 0x55555555u;
        for (int d0 = 0; d0 < hd; d0 += 16) {
            __m512i y = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vrow + 2 * d0)));
            _mm512_mask_storeu_epi16(vq + 2 * d0, half, r % 2 ? _mm512_slli_epi32(y, 16) : y);
        }
        return;
    }
    memcpy((float *)v_cache + q + r * hd, vrow, sizeof(float) * hd);
}
#endif

/* k, v rows [num_tokens] (token i's head h at i * stride + h * head_dim elements) into the cache slots
 * slot_mapping[i]: the kernel layout where use_fast_path holds, else [blocks, block_size, kv heads,
 * head_dim]. Every write to a cache this kernel reads goes through here or write_own_key (the same
 * write_key), so writer and reader agree. */
/* write_kv's rows, a thread's share of them (orphaned worksharing: a team runs it, or one thread alone). */
static void write_rows(const Attn *a, const char *k, int64_t k_bytes, const char *v, int64_t v_bytes, void *k_cache,
                       void *v_cache, const int64_t *slot_mapping, int64_t num_tokens, int fast, int is_bf16) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < num_tokens; i++)
        write_slot(a, k + i * k_bytes, v + i * v_bytes, k_cache, v_cache, slot_mapping[i], 0, a->num_kv_heads, fast,
                   is_bf16);
}

static void write_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *k_cache,
                     void *v_cache, const int64_t *slot_mapping, int64_t num_tokens, int num_kv_heads,
                     int head_dim, int block_size, int is_bf16) {
    Attn a = {0};
    a.num_kv_heads = num_kv_heads, a.head_dim = head_dim, a.block_size = block_size;
    const int fast = use_fast_path(&a, is_bf16), size = is_bf16 ? 2 : 4;
    RUN_TEAM(num_tokens >= 256 ? team_size(0, num_tokens) : 1,
             write_rows(&a, k, k_stride * size, v, v_stride * size, k_cache, v_cache, slot_mapping, num_tokens, fast,
                        is_bf16));
}

void paged_write_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride, float *k_cache,
                        float *v_cache, const int64_t *slot_mapping, int64_t num_tokens, int num_kv_heads,
                        int head_dim, int block_size) {
    write_kv(k, k_stride, v, v_stride, k_cache, v_cache, slot_mapping, num_tokens, num_kv_heads, head_dim,
             block_size, 0);
}

void paged_write_kv_bf16(const uint16_t *k, int64_t k_stride, const uint16_t *v, int64_t v_stride,
                         uint16_t *k_cache, uint16_t *v_cache, const int64_t *slot_mapping, int64_t num_tokens,
                         int num_kv_heads, int head_dim, int block_size) {
    write_kv(k, k_stride, v, v_stride, k_cache, v_cache, slot_mapping, num_tokens, num_kv_heads, head_dim,
             block_size, 1);
}
