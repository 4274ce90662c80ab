/* Paged decode attention on the CPU: one query token per row, K/V read straight from the block cache.
 *
 * Why a kernel: in torch, decode attention must first gather every row's blocks into a dense
 * [rows, ctx, kvh * hd] copy (per layer, for K and for V) and then run small batched matmuls; at 256-token
 * contexts and 64 rows that gather plus the matmuls took half of the step. Here each (row, KV head) pair
 * reads its K and V once, in place, for all query heads of its group (GQA), with fp32 accumulation.
 *
 * Layouts (all contiguous):
 *   q, out        [rows, num_heads, head_dim]
 *   k/v cache     [num_blocks, block_size, num_kv_heads, head_dim]
 *   block_tables  [rows, max_blocks] int64;  seq_lens [rows] int64 (context incl. the new token)
 * Token t of row r lives at slot block_tables[r][t / block_size] * block_size + t % block_size.
 *
 * Built at first use with the system C compiler (see native.py); OpenMP shares torch's runtime
 * (same libgomp soname), so torch.set_num_threads governs it too.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* A cache row (head_dim values) as fp32: a copy for bf16, the row itself for fp32. */
static inline const float *row_f32(const void *cache, int64_t index, int head_dim, int is_bf16,
                                   float *scratch) {
    if (!is_bf16) return (const float *)cache + index * head_dim;
    const uint16_t *src = (const uint16_t *)cache + index * head_dim;
    for (int i = 0; i < head_dim; i++) scratch[i] = bf16_to_f32(src[i]);
    return scratch;
}

static inline float dot(const float *restrict a, const float *restrict b, int n) {
    float sum = 0.0f;
#pragma omp simd reduction(+:sum)
    for (int i = 0; i < n; i++) sum += a[i] * b[i];
    return sum;
}

static inline void axpy(float *restrict y, float a, const float *restrict x, int n) {
#pragma omp simd
    for (int i = 0; i < n; i++) y[i] += a * x[i];
}

static void softmax_inplace(float *s, int64_t n) {
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t t = 0; t < n; t++) mx = s[t] > mx ? s[t] : mx;
    for (int64_t t = 0; t < n; t++) { s[t] = expf(s[t] - mx); sum += s[t]; }
    float inv = 1.0f / sum;
    for (int64_t t = 0; t < n; t++) s[t] *= inv;
}

/* Prefetch the next block's first tokens: blocks sit anywhere in the pool, so the hardware
 * prefetcher (which follows streams within a page) cannot guess them. */
static inline void prefetch_block(const void *cache, int64_t block, int64_t block_bytes, int is_bf16) {
    const char *p = (const char *)cache + block * block_bytes * (is_bf16 ? 2 : 4);
    for (int64_t off = 0; off < block_bytes * (is_bf16 ? 2 : 4); off += 64) __builtin_prefetch(p + off);
}

/* One row, all heads: each token's K (then V) for all KV heads is one contiguous read.
 * qf [nh][hd] fp32, already scaled; scores [nh][len]; acc [nh][hd]; row [hd] scratch. */
static inline __attribute__((always_inline)) void row_attention(const float *qf, const void *k_cache, const void *v_cache,
                          const int64_t *table, int64_t len, int num_heads, int num_kv_heads,
                          int head_dim, int block_size, int is_bf16, float *scores, float *acc,
                          float *row) {
    int group = num_heads / num_kv_heads;
    int64_t token_elems = (int64_t)num_kv_heads * head_dim, block_elems = block_size * token_elems;
    for (int64_t t = 0; t < len; t++) {
        int64_t b = t / block_size, slot = table[b] * block_size + t % block_size;
        if (t % block_size == 0 && t + block_size < len) prefetch_block(k_cache, table[b + 1], block_elems, is_bf16);
        for (int h = 0; h < num_kv_heads; h++) {
            const float *k = row_f32(k_cache, slot * num_kv_heads + h, head_dim, is_bf16, row);
            for (int g = h * group; g < (h + 1) * group; g++)
                scores[g * len + t] = dot(qf + g * head_dim, k, head_dim);
        }
    }
    for (int g = 0; g < num_heads; g++) softmax_inplace(scores + g * len, len);
    memset(acc, 0, sizeof(float) * num_heads * head_dim);
    for (int64_t t = 0; t < len; t++) {
        int64_t b = t / block_size, slot = table[b] * block_size + t % block_size;
        if (t % block_size == 0 && t + block_size < len) prefetch_block(v_cache, table[b + 1], block_elems, is_bf16);
        for (int h = 0; h < num_kv_heads; h++) {
            const float *v = row_f32(v_cache, slot * num_kv_heads + h, head_dim, is_bf16, row);
            for (int g = h * group; g < (h + 1) * group; g++)
                axpy(acc + g * head_dim, scores[g * len + t], v, head_dim);
        }
    }
    (void)token_elems;
}

/* Parallel over rows. Returns 0, or -1 if a scratch buffer could not be allocated. */
static int paged_decode(const void *q, const void *k_cache, const void *v_cache,
                        const int64_t *block_tables, const int64_t *seq_lens, void *out, int num_rows,
                        int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,
                        float scale, int is_bf16) {
    int failed = 0;
    int64_t max_len = 0, row_elems = (int64_t)num_heads * head_dim;
    for (int r = 0; r < num_rows; r++) max_len = seq_lens[r] > max_len ? seq_lens[r] : max_len;
#pragma omp parallel reduction(|:failed)
    {
        /* per thread: qf [nh][hd] | acc [nh][hd] | row [hd] | scores [nh][max_len] */
        float *buf = malloc(sizeof(float) * (2 * row_elems + head_dim + num_heads * max_len));
        failed = buf == NULL;
        float *qf = buf, *acc = qf + row_elems, *row = acc + row_elems, *scores = row + head_dim;
#pragma omp for schedule(dynamic, 1)
        for (int r = 0; r < num_rows; r++) {
            if (buf == NULL) continue;
            for (int g = 0; g < num_heads; g++) {
                const float *qg = row_f32(q, (int64_t)r * num_heads + g, head_dim, is_bf16, row);
                for (int i = 0; i < head_dim; i++) qf[g * head_dim + i] = qg[i] * scale;
            }
            const int64_t *table = block_tables + (int64_t)r * max_blocks;
            if (head_dim == 64)  /* a constant head size lets the compiler unroll dot and axpy */
                row_attention(qf, k_cache, v_cache, table, seq_lens[r], num_heads, num_kv_heads, 64,
                              block_size, is_bf16, scores, acc, row);
            else
                row_attention(qf, k_cache, v_cache, table, seq_lens[r], num_heads, num_kv_heads,
                              head_dim, block_size, is_bf16, scores, acc, row);
            for (int64_t i = 0; i < row_elems; i++) {
                if (is_bf16) ((uint16_t *)out)[r * row_elems + i] = f32_to_bf16(acc[i]);
                else ((float *)out)[r * row_elems + i] = acc[i];
            }
        }
        free(buf);
    }
    return failed ? -1 : 0;
}

int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                     const int64_t *block_tables, const int64_t *seq_lens, float *out, int num_rows,
                     int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,
                     float scale) {
    return paged_decode(q, k_cache, v_cache, block_tables, seq_lens, out, num_rows, num_heads,
                        num_kv_heads, head_dim, block_size, max_blocks, scale, 0);
}

int paged_decode_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                      const int64_t *block_tables, const int64_t *seq_lens, uint16_t *out, int num_rows,
                      int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,
                      float scale) {
    return paged_decode(q, k_cache, v_cache, block_tables, seq_lens, out, num_rows, num_heads,
                        num_kv_heads, head_dim, block_size, max_blocks, scale, 1);
}
