/* Paged attention on the CPU for a whole ragged batch (decode rows and prefill chunks alike), K/V read
 * in place from the block cache after this step's K/V were written there.
 *
 * Why one kernel: every query token is a row with its own visible context (a decode row sees seq_len
 * keys; a prefill token at position p sees p + 1: causal), so chunked prefill and prefix-cache hits need
 * no gather and no mask; the context is already in the cache. Consecutive query tokens of one sequence
 * form a tile, so a prefill tile reads each K/V chunk once for all its queries and all query heads of a
 * KV head's group (GQA).
 *
 * Layouts:
 *   q             [tokens, q_stride] rows; token t's head g at q + t * q_stride + g * head_dim
 *   out           [tokens, num_heads, head_dim], contiguous
 *   k/v cache     [num_blocks, block_size, num_kv_heads, head_dim], contiguous
 *   block_tables  [num_seqs, max_blocks] int64
 *   tiles         [num_tiles, 4] int64: (seq, first token, num tokens, context of the first token); the
 *                 tile's token i (row first + i of q and out) sees keys 0 .. context + i - 1.
 * Key position p of sequence s lives at slot block_tables[s][p / block_size] * block_size + p % block_size.
 *
 * Numerics: online softmax over chunks of CHUNK keys aligned to absolute positions, fp32 state. A query's
 * arithmetic depends only on its own q, context and the cache, never on its tile or on the rest of the
 * batch: batch composition cannot change a row's bits (the determinism tests rely on this).
 *   fp32, and bf16 without AVX512-BF16 or head_dim % 32 != 0: plain C (generic_tile), fp32 throughout.
 *   bf16 with AVX512-BF16: QK^T and PV on vdpbf16ps with fp32 accumulation; the probabilities are
 *   rounded to bf16 before PV (as HF's eager bf16 attention casts them before P @ V).
 *
 * Parallel over (tile, KV head) work items, dynamic schedule. Built at first use with the system C
 * compiler (native.py); OpenMP shares torch's runtime (same libgomp), so torch.set_num_threads governs it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_AVX512BF16 1
#else
#define HAVE_AVX512BF16 0
#endif

enum { CHUNK = 16 };  /* keys per softmax step: one fp32 vector of scores on AVX-512 */
enum { MAX_FAST_HEAD_DIM = 256 };
#ifndef PREFETCH_CHUNKS
#define PREFETCH_CHUNKS 1
#endif
#ifndef PREFETCH_HINT
#define PREFETCH_HINT _MM_HINT_T0
#endif

/* The call's arguments, shared by all work items. */
typedef struct {
    const void *q, *k_cache, *v_cache;
    void *out;
    const int64_t *block_tables;
    int64_t q_stride, max_blocks;
    int num_heads, num_kv_heads, head_dim, block_size, group;
    float scale;
} Attn;

typedef struct { int64_t seq, first, num_tokens, context; } Tile;  /* one row of `tiles` */

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, like torch */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

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

/* ------------------------------------------------------------------------------------ generic path */

static inline float dot(const float *restrict x, const float *restrict y, int n) {
    float sum = 0.0f;
#pragma omp simd reduction(+:sum)
    for (int i = 0; i < n; i++) sum += x[i] * y[i];
    return sum;
}

static inline void load_f32(const void *src, int64_t index, int n, int is_bf16, float *restrict dst) {
    if (!is_bf16) { memcpy(dst, (const float *)src + index * n, sizeof(float) * n); return; }
    const uint16_t *s = (const uint16_t *)src + index * n;
    for (int i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
}

/* Online-softmax step of one query head over n keys: scores s, values vc [n][hd]. */
static inline void generic_update(const float *s, int n, const float *vc, int hd, float *mx, float *sum,
                                  float *restrict acc) {
    float cmax = -INFINITY;
    for (int j = 0; j < n; j++) cmax = s[j] > cmax ? s[j] : cmax;
    float mnew = cmax > *mx ? cmax : *mx, corr = expf(*mx - mnew);
    *mx = mnew;
    *sum *= corr;
#pragma omp simd
    for (int d = 0; d < hd; d++) acc[d] *= corr;
    for (int j = 0; j < n; j++) {
        float p = expf(s[j] - mnew);
        *sum += p;
#pragma omp simd
        for (int d = 0; d < hd; d++) acc[d] += p * vc[j * hd + d];
    }
}

/* Scratch floats one thread needs for tiles of up to `max_queries` query heads. */
static int64_t generic_scratch(const Attn *a, int64_t max_queries) {
    return max_queries * (2 * (int64_t)a->head_dim + 2) + 2 * CHUNK * (int64_t)a->head_dim;
}

/* One tile, one KV head, all heads of its group; fp32 state, dtype of q/cache/out per is_bf16. */
static inline __attribute__((always_inline)) void generic_tile(const Attn *a, const Tile *t, int h,
                                                               float *buf, int is_bf16) {
    const int hd = a->head_dim, group = a->group, nq = (int)t->num_tokens * group;
    float *qf = buf, *acc = qf + (int64_t)nq * hd, *mx = acc + (int64_t)nq * hd, *sum = mx + nq;
    float *kc = sum + nq, *vc = kc + CHUNK * hd, s[CHUNK];
    const int64_t *table = a->block_tables + t->seq * a->max_blocks;
    for (int i = 0; i < t->num_tokens; i++)
        for (int g = 0; g < group; g++) {
            int m = i * group + g;
            float *qm = qf + (int64_t)m * hd;
            const char *base = (const char *)a->q + (is_bf16 ? 2 : 4) * ((t->first + i) * a->q_stride);
            load_f32(base, h * group + g, hd, is_bf16, qm);
            for (int d = 0; d < hd; d++) qm[d] *= a->scale;
            mx[m] = -INFINITY, sum[m] = 0.0f;
        }
    memset(acc, 0, sizeof(float) * nq * hd);
    int64_t last = t->context + t->num_tokens - 1;  /* context of the tile's last token */
    for (int64_t c0 = 0; c0 < last; c0 += CHUNK) {
        int n = imin(CHUNK, last - c0);
        int64_t rows[CHUNK];
        chunk_rows(a, table, c0, n, h, rows);
        for (int j = 0; j < n; j++) {
            load_f32(a->k_cache, rows[j], hd, is_bf16, kc + j * hd);
            load_f32(a->v_cache, rows[j], hd, is_bf16, vc + j * hd);
        }
        for (int i = 0; i < t->num_tokens; i++) {
            int64_t ctx = t->context + i;
            if (ctx <= c0) continue;  /* this chunk is in the query's future */
            int valid = imin(n, ctx - c0);
            for (int m = i * group; m < (i + 1) * group; m++) {
                for (int j = 0; j < valid; j++) s[j] = dot(qf + (int64_t)m * hd, kc + j * hd, hd);
                generic_update(s, valid, vc, hd, mx + m, sum + m, acc + (int64_t)m * hd);
            }
        }
    }
    for (int i = 0; i < t->num_tokens; i++)
        for (int g = 0; g < group; g++) {
            int m = i * group + g;
            int64_t o = ((t->first + i) * a->num_heads + h * group + g) * hd;
            float inv = 1.0f / sum[m];
            for (int d = 0; d < hd; d++) {
                float v = acc[(int64_t)m * hd + d] * inv;
                if (is_bf16) ((uint16_t *)a->out)[o + d] = f32_to_bf16(v);
                else ((float *)a->out)[o + d] = v;
            }
        }
}

/* ------------------------------------------------------------------------- AVX512-BF16 path (bf16) */
#if HAVE_AVX512BF16

/* Lanes beyond a chunk's last key read this row: zeros, so garbage past the context never enters. */
static const uint16_t ZERO_ROW[MAX_FAST_HEAD_DIM] __attribute__((aligned(64)));

/* Per-thread scratch of the bf16 path, 64-byte aligned (the vectors are stored with aligned moves). */
typedef struct {
    uint32_t *kt;   /* [hd/2][CHUNK]: K chunk transposed, bf16 pairs (k[2i], k[2i+1]) along key lanes */
    uint32_t *vi;   /* [CHUNK/2][hd]: V chunk, key pairs interleaved: (v[2j][d], v[2j+1][d]) */
    float *acc;     /* [queries][hd] fp32, d permuted within 32-wide blocks (see unpermute) */
    float *lsum;    /* [queries][CHUNK]: softmax denominators, summed across lanes at the end */
    float *mx;      /* [queries]: running max of the raw scores */
} Fast;

static int64_t fast_scratch_bytes(const Attn *a, int64_t max_queries) {
    int64_t hd = a->head_dim;
    return 4 * (hd / 2 * CHUNK + CHUNK / 2 * hd + max_queries * (hd + CHUNK + 16)) + 64 * 5;
}

static Fast fast_scratch(const Attn *a, int64_t max_queries, char *buf) {
    Fast f;
    int64_t hd = a->head_dim;
    uintptr_t p = ((uintptr_t)buf + 63) & ~(uintptr_t)63;
#define TAKE(ptr, type, count) (ptr = (type *)p, p = (p + sizeof(type) * (count) + 63) & ~(uintptr_t)63)
    TAKE(f.kt, uint32_t, hd / 2 * CHUNK);
    TAKE(f.vi, uint32_t, CHUNK / 2 * hd);
    TAKE(f.acc, float, max_queries * hd);
    TAKE(f.lsum, float, max_queries * CHUNK);
    TAKE(f.mx, float, max_queries);
#undef TAKE
    return f;
}

/* 2^x for x <= 0 (softmax weights): 2^n * p(f), n = round(x), |f| <= 1/2, degree-6 Taylor polynomial
 * (relative error ~1e-7); x below -126 gives ~2^-126, which bf16 rounding or the mask then drops. */
static inline __m512 exp2_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Transpose 16 rows x 16 dwords (columns col0 ..) into dst[(col0 + j) * 16 + row]. */
static inline void transpose16(const uint32_t *const rows[CHUNK], int col0, uint32_t *dst) {
    __m512i r[16], t[16];
    for (int k = 0; k < 16; k++) r[k] = _mm512_loadu_si512(rows[k] + col0);
    for (int k = 0; k < 16; k += 2) {  /* lane L: rows k, k+1 interleaved, columns 4L, 4L+1 | 4L+2, 4L+3 */
        t[k] = _mm512_unpacklo_epi32(r[k], r[k + 1]);
        t[k + 1] = _mm512_unpackhi_epi32(r[k], r[k + 1]);
    }
    for (int k = 0; k < 16; k += 4) {  /* r[k + j], lane L: column 4L + j of rows k .. k+3 */
        r[k] = _mm512_unpacklo_epi64(t[k], t[k + 2]);
        r[k + 1] = _mm512_unpackhi_epi64(t[k], t[k + 2]);
        r[k + 2] = _mm512_unpacklo_epi64(t[k + 1], t[k + 3]);
        r[k + 3] = _mm512_unpackhi_epi64(t[k + 1], t[k + 3]);
    }
    for (int j = 0; j < 4; j++) {  /* gather lane L of r[j], r[4+j], r[8+j], r[12+j]: column 4L + j */
        __m512i e0 = _mm512_shuffle_i32x4(r[j], r[4 + j], _MM_SHUFFLE(2, 0, 2, 0));
        __m512i e1 = _mm512_shuffle_i32x4(r[j], r[4 + j], _MM_SHUFFLE(3, 1, 3, 1));
        __m512i e2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], _MM_SHUFFLE(2, 0, 2, 0));
        __m512i e3 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], _MM_SHUFFLE(3, 1, 3, 1));
        _mm512_store_si512(dst + (col0 + j) * 16, _mm512_shuffle_i32x4(e0, e2, _MM_SHUFFLE(2, 0, 2, 0)));
        _mm512_store_si512(dst + (col0 + 8 + j) * 16, _mm512_shuffle_i32x4(e0, e2, _MM_SHUFFLE(3, 1, 3, 1)));
        _mm512_store_si512(dst + (col0 + 4 + j) * 16, _mm512_shuffle_i32x4(e1, e3, _MM_SHUFFLE(2, 0, 2, 0)));
        _mm512_store_si512(dst + (col0 + 12 + j) * 16, _mm512_shuffle_i32x4(e1, e3, _MM_SHUFFLE(3, 1, 3, 1)));
    }
}

/* K rows of a chunk -> kt; V rows -> vi with key pairs interleaved per 16-bit element. Unpack works
 * within 128-bit lanes, so in each 32-wide block of d the "lo" vector holds d = 0-3, 8-11, 16-19,
 * 24-27 and the "hi" vector the rest; the accumulators keep that order until unpermute. */
static inline void stage_chunk(const uint16_t *const krows[CHUNK], const uint16_t *const vrows[CHUNK],
                               int hd, Fast *f) {
    for (int col0 = 0; col0 < hd / 2; col0 += 16)
        transpose16((const uint32_t *const *)krows, col0, f->kt);
    for (int j = 0; j < CHUNK / 2; j++)
        for (int d0 = 0; d0 < hd; d0 += 32) {
            __m512i x = _mm512_loadu_si512(vrows[2 * j] + d0), y = _mm512_loadu_si512(vrows[2 * j + 1] + d0);
            _mm512_store_si512(f->vi + j * hd + d0, _mm512_unpacklo_epi16(x, y));
            _mm512_store_si512(f->vi + j * hd + d0 + 16, _mm512_unpackhi_epi16(x, y));
        }
}

/* Raw scores of one query head against the chunk's 16 keys (lanes): four partial sums hide the
 * latency of the dot-product chain. */
static inline __m512 chunk_scores(const uint32_t *qp, const uint32_t *kt, int hd) {
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int i = 0; i < hd / 2; i += 4) {
        s0 = _mm512_dpbf16_ps(s0, (__m512bh)_mm512_load_si512(kt + i * 16), (__m512bh)_mm512_set1_epi32(qp[i]));
        s1 = _mm512_dpbf16_ps(s1, (__m512bh)_mm512_load_si512(kt + (i + 1) * 16), (__m512bh)_mm512_set1_epi32(qp[i + 1]));
        s2 = _mm512_dpbf16_ps(s2, (__m512bh)_mm512_load_si512(kt + (i + 2) * 16), (__m512bh)_mm512_set1_epi32(qp[i + 2]));
        s3 = _mm512_dpbf16_ps(s3, (__m512bh)_mm512_load_si512(kt + (i + 3) * 16), (__m512bh)_mm512_set1_epi32(qp[i + 3]));
    }
    return _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3));
}

/* Online-softmax step of one query head: fold scores s (lanes past `valid` ignored) into its running
 * max, denominator and accumulator. c = scale * log2(e): weights are 2^(c * (s - max)). */
static inline void chunk_update(__m512 s, __mmask16 valid, float c, const uint32_t *vi, int hd,
                                float *mx, float *lsum, float *acc) {
    s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, s);
    float mnew = fmaxf(*mx, _mm512_reduce_max_ps(s));
    __m512 corr = _mm512_set1_ps(exp2f((*mx - mnew) * c));  /* 0 on the first chunk (max was -inf) */
    *mx = mnew;
    __m512 p = _mm512_maskz_mov_ps(valid, exp2_ps(_mm512_fmsub_ps(s, _mm512_set1_ps(c), _mm512_set1_ps(mnew * c))));
    _mm512_store_ps(lsum, _mm512_fmadd_ps(_mm512_load_ps(lsum), corr, p));
    uint32_t pp[CHUNK / 2];  /* weights rounded to bf16, as (key 2j, key 2j+1) pairs */
    _mm256_storeu_si256((__m256i *)pp, (__m256i)_mm512_cvtneps_pbh(p));
    for (int d0 = 0; d0 < hd; d0 += 64) {  /* 4 accumulators in registers across the 8 key pairs */
        int n = imin(4, (hd - d0) / 16);
        __m512 o[4];
        for (int k = 0; k < n; k++) o[k] = _mm512_mul_ps(_mm512_load_ps(acc + d0 + 16 * k), corr);
        for (int j = 0; j < CHUNK / 2; j++) {
            __m512bh pj = (__m512bh)_mm512_set1_epi32(pp[j]);
            for (int k = 0; k < n; k++)
                o[k] = _mm512_dpbf16_ps(o[k], (__m512bh)_mm512_load_si512(vi + j * hd + d0 + 16 * k), pj);
        }
        for (int k = 0; k < n; k++) _mm512_store_ps(acc + d0 + 16 * k, o[k]);
    }
}

/* acc (permuted d order) times inv, back in d order, rounded to bf16. */
static inline void store_row_bf16(const float *acc, float inv, int hd, uint16_t *out) {
    const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi_idx = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    __m512 s = _mm512_set1_ps(inv);
    for (int d0 = 0; d0 < hd; d0 += 32) {
        __m512 lo = _mm512_load_ps(acc + d0), hi = _mm512_load_ps(acc + d0 + 16);
        __m512 x = _mm512_mul_ps(_mm512_permutex2var_ps(lo, lo_idx, hi), s);
        __m512 y = _mm512_mul_ps(_mm512_permutex2var_ps(lo, hi_idx, hi), s);
        _mm256_storeu_si256((__m256i *)(out + d0), (__m256i)_mm512_cvtneps_pbh(x));
        _mm256_storeu_si256((__m256i *)(out + d0 + 16), (__m256i)_mm512_cvtneps_pbh(y));
    }
}

/* Blocks sit anywhere in the pool, so the hardware prefetcher cannot follow them: fetch the next
 * chunk's K and V rows while this one is computed. */
static inline void prefetch_rows(const uint16_t *kc, const uint16_t *vc, const int64_t *rows, int n, int hd) {
    for (int j = 0; j < n; j++)
        for (int off = 0; off < hd; off += 32) {
            _mm_prefetch((const char *)(kc + rows[j] * hd + off), PREFETCH_HINT);
            _mm_prefetch((const char *)(vc + rows[j] * hd + off), PREFETCH_HINT);
        }
}

static inline const uint32_t *query_pairs(const Attn *a, int64_t token, int head) {
    return (const uint32_t *)((const uint16_t *)a->q + token * a->q_stride + (int64_t)head * a->head_dim);
}

/* One tile, one KV head, all heads of its group, bf16; hd is a constant where inlined for 64 / 128. */
static inline __attribute__((always_inline)) void fast_tile(const Attn *a, const Tile *t, int h, Fast *f,
                                                            const int hd) {
    const int group = a->group, nq = (int)t->num_tokens * group;
    const float c = a->scale * 1.44269504088896341f;  /* log2(e) */
    const uint16_t *kc = a->k_cache, *vc = a->v_cache;
    const int64_t *table = a->block_tables + t->seq * a->max_blocks, last = t->context + t->num_tokens - 1;
    memset(f->acc, 0, sizeof(float) * nq * hd);
    memset(f->lsum, 0, sizeof(float) * nq * CHUNK);
    for (int m = 0; m < nq; m++) f->mx[m] = -INFINITY;
    int64_t rows[CHUNK], ahead[CHUNK];
    for (int64_t c0 = 0; c0 < PREFETCH_CHUNKS * CHUNK && c0 < last; c0 += CHUNK) {
        chunk_rows(a, table, c0, imin(CHUNK, last - c0), h, ahead);
        prefetch_rows(kc, vc, ahead, imin(CHUNK, last - c0), hd);
    }
    const uint16_t *krows[CHUNK], *vrows[CHUNK];
    for (int64_t c0 = 0; c0 < last; c0 += CHUNK) {
        int n = imin(CHUNK, last - c0);
        int64_t cp = c0 + PREFETCH_CHUNKS * CHUNK;
        if (cp < last) {
            chunk_rows(a, table, cp, imin(CHUNK, last - cp), h, ahead);
            prefetch_rows(kc, vc, ahead, imin(CHUNK, last - cp), hd);
        }
        chunk_rows(a, table, c0, n, h, rows);
        for (int j = 0; j < CHUNK; j++) {
            krows[j] = j < n ? kc + rows[j] * hd : ZERO_ROW;
            vrows[j] = j < n ? vc + rows[j] * hd : ZERO_ROW;
        }
        stage_chunk(krows, vrows, hd, f);
        for (int i = 0; i < t->num_tokens; i++) {
            int64_t ctx = t->context + i;
            if (ctx <= c0) continue;  /* this chunk is in the query's future */
            __mmask16 valid = ctx - c0 >= CHUNK ? (__mmask16)0xffff : (__mmask16)((1u << (ctx - c0)) - 1);
            for (int g = 0; g < group; g++) {
                int m = i * group + g;
                __m512 s = chunk_scores(query_pairs(a, t->first + i, h * group + g), f->kt, hd);
                chunk_update(s, valid, c, f->vi, hd, f->mx + m, f->lsum + m * CHUNK, f->acc + (int64_t)m * hd);
            }
        }
    }
    for (int m = 0; m < nq; m++) {
        int64_t token = t->first + m / group, head = h * group + m % group;
        float l = _mm512_reduce_add_ps(_mm512_load_ps(f->lsum + m * CHUNK));
        store_row_bf16(f->acc + (int64_t)m * hd, 1.0f / l, hd,
                       (uint16_t *)a->out + (token * a->num_heads + head) * hd);
    }
}
#endif  /* HAVE_AVX512BF16 */

/* ------------------------------------------------------------------------------------------ driver */

static inline int use_fast_path(const Attn *a, int is_bf16) {
    return HAVE_AVX512BF16 && is_bf16 && a->head_dim % 32 == 0 && a->head_dim <= MAX_FAST_HEAD_DIM;
}

static int64_t scratch_bytes(const Attn *a, int64_t max_queries, int is_bf16) {
#if HAVE_AVX512BF16
    if (use_fast_path(a, is_bf16)) return fast_scratch_bytes(a, max_queries);
#endif
    return sizeof(float) * generic_scratch(a, max_queries);
}

/* One work item: tile t, KV head h. Constant head sizes let the compiler unroll the inner loops. */
static void run_item(const Attn *a, const Tile *t, int h, char *buf, int64_t max_queries, int is_bf16) {
#if HAVE_AVX512BF16
    if (use_fast_path(a, is_bf16)) {
        Fast f = fast_scratch(a, max_queries, buf);
        if (a->head_dim == 64) fast_tile(a, t, h, &f, 64);
        else if (a->head_dim == 128) fast_tile(a, t, h, &f, 128);
        else fast_tile(a, t, h, &f, a->head_dim);
        return;
    }
#endif
    (void)max_queries;
    if (is_bf16) generic_tile(a, t, h, (float *)buf, 1);
    else generic_tile(a, t, h, (float *)buf, 0);
}

/* Parallel over (tile, KV head), biggest last tiles first (tiles are in sequence order, and a
 * sequence's later tiles see more context). Returns 0, or -1 if scratch could not be allocated. */
static int run(const Attn *a, const int64_t *tiles, int num_tiles, int is_bf16) {
    int64_t max_tokens = 0;
    for (int i = 0; i < num_tiles; i++) max_tokens = tiles[4 * i + 2] > max_tokens ? tiles[4 * i + 2] : max_tokens;
    int64_t max_queries = max_tokens * a->group, bytes = scratch_bytes(a, max_queries, is_bf16);
    int64_t num_items = (int64_t)num_tiles * a->num_kv_heads;
    int failed = 0;
#pragma omp parallel reduction(|:failed)
    {
        char *buf = malloc(bytes);
        failed = buf == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = num_items - 1; item >= 0; item--) {
            if (buf == NULL) continue;
            const Tile *t = (const Tile *)(tiles + 4 * (item / a->num_kv_heads));
            run_item(a, t, (int)(item % a->num_kv_heads), buf, max_queries, is_bf16);
        }
        free(buf);
    }
    return failed ? -1 : 0;
}

static int attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                     const int64_t *block_tables, int64_t max_blocks, const int64_t *tiles, int num_tiles,
                     void *out, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                     int is_bf16) {
    Attn a = {q, k_cache, v_cache, out, block_tables, q_stride, max_blocks, num_heads, num_kv_heads,
              head_dim, block_size, num_heads / num_kv_heads, scale};
    return run(&a, tiles, num_tiles, is_bf16);
}

int paged_attention_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                        const int64_t *block_tables, int64_t max_blocks, const int64_t *tiles, int num_tiles,
                        float *out, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale) {
    return attention(q, q_stride, k_cache, v_cache, block_tables, max_blocks, tiles, num_tiles, out,
                     num_heads, num_kv_heads, head_dim, block_size, scale, 0);
}

int paged_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                         const int64_t *block_tables, int64_t max_blocks, const int64_t *tiles, int num_tiles,
                         uint16_t *out, int num_heads, int num_kv_heads, int head_dim, int block_size,
                         float scale) {
    return attention(q, q_stride, k_cache, v_cache, block_tables, max_blocks, tiles, num_tiles, out,
                     num_heads, num_kv_heads, head_dim, block_size, scale, 1);
}

/* 1 when bf16 at this head_dim runs on AVX512-BF16 (tests and benchmarks report the path). */
int paged_attention_bf16_is_fast(int head_dim) {
    Attn a = {0};
    a.head_dim = head_dim;
    return use_fast_path(&a, 1);
}
