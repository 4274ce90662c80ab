/* The native kernels' one header: every entry point of the library (cobatch/kernels/bindings.py declares
 * each to ctypes, in the same order), the structs Python passes in (bindings.py mirrors them; layout.c
 * exports their layout, which tests/test_kernel_bindings.py compares), and the bf16 helpers the kernels
 * share. All the .c files of this folder build into one library (kernels/build.py), so they call each
 * other directly through these declarations.
 *
 * Conventions: tensors are row-major and contiguous unless a stride says otherwise; bf16 values are their
 * uint16 bits; is_bf16 picks bf16 (else fp32) where an entry point takes both; `threads` <= 0: OpenMP's
 * default. Statuses: 0 ok, -1 out of memory (attention scratch) or kernel not built (gemm stubs), -2 bad
 * shape or index.
 */
#ifndef COBATCH_KERNELS_H
#define COBATCH_KERNELS_H

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define HAVE_AVX512 1 /* 16-lane fp32 rows (fused_ops.c, paged_attention.c) */
#else
#define HAVE_AVX512 0
#endif

/* ------------------------------------------------------------------------------- bf16 <-> fp32 */

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, NaN kept a (quiet) NaN: torch's c10::BFloat16 conversion. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* ------------------------------------------------------ fused_ops.c: elementwise ops of a layer */

/* residual += x (x may be NULL), out = RMSNorm(residual) * weight; all [rows, hidden], weight [hidden]. */
void add_rms_norm(const void *x, void *residual, const void *weight, void *out, int64_t rows, int64_t hidden,
                  float eps, int is_bf16);
/* In place: RMSNorm of each of the first num_heads heads of each row of x (rows row_stride apart) times
 * weight [head_dim] (Qwen3's q_norm / k_norm). */
void head_rms_norm(void *x, const void *weight, int64_t rows, int64_t row_stride, int64_t num_heads,
                   int64_t head_dim, float eps, int is_bf16);
/* gate_up [rows, 2 inter] (gate | up) -> out [rows, inter] = silu(gate) * up. */
void silu_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int is_bf16);
/* silu_mul's arithmetic on bf16 slices with their own row strides, serial (gemm_bf16_silu's epilogue). */
void silu_mul_rows_bf16(const void *gate, const void *up, void *out, int64_t rows, int64_t width,
                        int64_t in_stride, int64_t out_stride);
/* The same on fp32 slices (gemm_f32_silu's epilogue). */
void silu_mul_rows_f32(const void *gate, const void *up, void *out, int64_t rows, int64_t width,
                       int64_t in_stride, int64_t out_stride);
/* Rotate-half RoPE in place on the first num_heads heads of each row of x; tables [max_pos, head_dim / 2]. */
void rope_inplace(void *x, const void *cos_table, const void *sin_table, const int64_t *positions, int64_t rows,
                  int64_t row_stride, int64_t num_heads, int64_t head_dim, int is_bf16);
/* Greedy's argmax: per row of x [rows, cols], the max (fp32) and the first index holding it. */
void argmax_rows(const void *x, int64_t rows, int64_t cols, int is_bf16, int64_t *index, float *best);

/* ------------------------------------------------------- gemm_bf16.c: bf16 GEMM on packed weights */

/* 1 when built with AVX512-BF16 (else the GEMM entry points are stubs that return -1). */
int gemm_bf16_available(void);
/* Whether gemm_bf16 runs on AMX's tile unit: on (1, the default) where the CPU has AMX-BF16 and Linux grants
 * it, else the AVX512-BF16 tile (0: off, for A/B runs). Returns whether AMX is now in use. */
int gemm_bf16_set_amx(int on);
/* y [M, N] = x [M, K] @ W^T (+ bias [N] or NULL), W packed (layout: gemm_bf16.c). */
int gemm_bf16(const void *x, const void *wp, const void *bias, void *y, int64_t M, int64_t N, int64_t K,
              int num_threads);
/* act [M, inter] = silu(x Wg^T) * (x Wu^T), gate/up packed together (pack_gate_up). */
int gemm_bf16_silu(const void *x, const void *wp, void *act, int64_t M, int64_t inter, int64_t K,
                   int num_threads);
/* Rows ids [n] of the [N, K] weight a packed tensor holds, into out [n, K] (an embedding lookup). */
int packed_rows_bf16(const void *wp, const int64_t *ids, int64_t n, int64_t N, int64_t K, void *out);

/* -------------------------------------------------------- gemm_f32.c: fp32 GEMM on packed weights */

/* 1 when built with AVX-512F (else the GEMM entry points are stubs that return -1). */
int gemm_f32_available(void);
/* y [M, N] = x [M, K] @ W^T (+ bias [N] or NULL), all fp32, W packed (layout: gemm_f32.c). */
int gemm_f32(const void *x, const void *wp, const void *bias, void *y, int64_t M, int64_t N, int64_t K,
             int num_threads);
/* act [M, inter] = silu(x Wg^T) * (x Wu^T), gate/up packed together (pack_gate_up). */
int gemm_f32_silu(const void *x, const void *wp, void *act, int64_t M, int64_t inter, int64_t K,
                  int num_threads);
/* Rows ids [n] of the [N, K] weight a packed fp32 tensor holds, into out [n, K] (an embedding lookup). */
int packed_rows_f32(const void *wp, const int64_t *ids, int64_t n, int64_t N, int64_t K, void *out);

/* ------------------------------- gemm_f32_wbf16.c: fp32 GEMM on packed bf16 weights (weight-only bf16) */

/* 1 when built with AVX-512F (else the GEMM entry points are stubs that return -1). */
int gemm_f32_wbf16_available(void);
/* y [M, N] = x [M, K] @ W^T (+ bias [N] or NULL): x, bias, y fp32, W bf16 packed (layout: gemm_f32_wbf16.c). */
int gemm_f32_wbf16(const void *x, const void *wp, const void *bias, void *y, int64_t M, int64_t N, int64_t K,
                   int num_threads);
/* act [M, inter] = silu(x Wg^T) * (x Wu^T), fp32, gate/up bf16 packed together (pack_gate_up). */
int gemm_f32_wbf16_silu(const void *x, const void *wp, void *act, int64_t M, int64_t inter, int64_t K,
                        int num_threads);
/* Rows ids [n] of the [N, K] weight a packed bf16 tensor holds, as fp32, into out [n, K]. */
int packed_rows_f32_wbf16(const void *wp, const int64_t *ids, int64_t n, int64_t N, int64_t K, void *out);

/* --------------------------------------------- paged_attention.c: attention over the paged KV cache */

/* q rows q_stride apart, caches [blocks, block_size, kv heads, head_dim] (kernel layout on the AVX-512
 * path), block_tables [seqs, max_blocks], tiles [num_tiles, 4] -> out [tokens, num_heads, head_dim]. The
 * first num_own_writes tiles write their own new K/V first (they follow the q heads in q's rows). */
int paged_attention_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                        const int64_t *block_tables, int64_t max_blocks, const int64_t *tiles, int num_tiles,
                        float *out, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                        int64_t num_own_writes);
int paged_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                         const int64_t *block_tables, int64_t max_blocks, const int64_t *tiles, int num_tiles,
                         uint16_t *out, int num_heads, int num_kv_heads, int head_dim, int block_size,
                         float scale, int64_t num_own_writes);
/* 1 when this dtype, head_dim and block_size run the AVX-512 path (on the kernel layout). */
int paged_attention_is_fast(int is_bf16, int head_dim, int block_size);
/* k, v rows [num_tokens] (strides in elements) into the cache slots slot_mapping[i], in the layout the
 * attention kernel reads. */
void paged_write_kv_f32(const float *k, int64_t k_stride, const float *v, int64_t v_stride, float *k_cache,
                        float *v_cache, const int64_t *slot_mapping, int64_t num_tokens, int num_kv_heads,
                        int head_dim, int block_size);
void paged_write_kv_bf16(const uint16_t *k, int64_t k_stride, const uint16_t *v, int64_t v_stride,
                         uint16_t *k_cache, uint16_t *v_cache, const int64_t *slot_mapping, int64_t num_tokens,
                         int num_kv_heads, int head_dim, int block_size);

/* ------------------------------------------------------ decoder.c: all layers of a step in one call */

/* Model shape; activations, norms, biases and KV bf16 (is_bf16) or fp32; gate/up packed for
 * gemm_bf16_silu / gemm_f32_silu when fused_mlp. */
typedef struct {
    int64_t hidden, inter, num_heads, num_kv_heads, head_dim, block_size, fused_mlp, is_bf16;
    float eps, scale;
} Shape;

/* Each projection packed for the activations' dense GEMM (its *_type PACKED_DENSE: gemm_bf16 or gemm_f32),
 * packed bf16 under fp32 activations (PACKED_F32_WBF16: gemm_f32_wbf16) or quantized for gemm_quant
 * (QUANT_*). A fused gate/up (Shape.fused_mlp) says which of the first two it is too. */
enum { PACKED_DENSE = -1, PACKED_F32_WBF16 = -2 };
typedef struct {
    const void *input_norm, *qkv, *qkv_bias, *o, *o_bias, *post_norm, *gate_up, *down; /* biases may be NULL */
    const void *q_norm, *k_norm; /* Qwen3's per-head RMSNorm weights [head_dim] on q and k before RoPE, or NULL */
    void *k_cache, *v_cache; /* [blocks, block_size, kv heads, head_dim], laid out as the kernel reads */
    int64_t qkv_type, o_type, gate_up_type, down_type;
    int64_t skip_rope; /* 1: no RoPE on this layer's q and k (SmolLM3's NoPE layers) */
    /* qkv's last qkv_tail_rows rows in a second quantized format (qkv_tail_type), packed apart; qkv holds the
     * rows before them (NULL, 0: qkv holds all) */
    const void *qkv_tail;
    int64_t qkv_tail_type, qkv_tail_rows;
} Layer;

/* This step's batch: the attention metadata of models/attention.py, and the rows whose output is wanted
 * (the sampled ones). With keep == NULL every row's is; else the last layer computes only those rows past
 * its K/V write, since nothing else reads the others' outputs (llama.cpp does the same): a prefill step
 * of 2k tokens that samples a dozen saves nearly a layer's worth of work. keep_tiles: one tile per kept
 * row (its row of block_tables, its index in keep, 1 token, its context). num_own_writes: the leading
 * one-token rows (tiles and tokens alike) whose K/V the attention kernel writes itself. */
typedef struct {
    int64_t num_tokens, max_blocks, num_tiles, num_keep, num_own_writes;
    const int64_t *positions, *slot_mapping, *block_tables, *tiles, *keep, *keep_tiles;
    const void *cos, *sin; /* RoPE tables [max_pos, head_dim / 2] */
} Step;

/* Activations, bf16 rows: residual (in: the embeddings), x, h [hidden], qkv [(heads + 2 kv heads) head_dim],
 * attn [heads head_dim], gate_up [2 inter], act [inter], num_tokens rows each; with keep, residual_keep
 * [num_keep, hidden] and q_keep [num_keep, qkv width] hold the kept rows. out [num_tokens, hidden] (with
 * keep: [num_keep, hidden]): the final hidden states, after the final norm. */
typedef struct {
    void *residual, *x, *h, *qkv, *attn, *gate_up, *act, *residual_keep, *q_keep, *out;
} Buffers;

/* All layers, then the final norm (weight final_norm) into b->out. Returns 0 or the first failing
 * kernel's status. */
int decoder_forward(const Shape *s, const Layer *layers, int num_layers, const void *final_norm, const Step *st,
                    const Buffers *b, int threads);

/* ----------------------------- gemm_quant.c: GEMM on GGUF-quantized weights (Q8_0, Q4_*, Q5_*, Q6_K) */

/* qtype of the quantized entry points; the packed layouts are gemm_quant.c's (kernels/quant_linear.py). */
enum { QUANT_Q8_0 = 0, QUANT_Q4_0 = 1, QUANT_Q4_K = 2, QUANT_Q5_0 = 3, QUANT_Q6_K = 4, QUANT_Q5_K = 5, QUANT_Q4_1 = 6,
       QUANT_Q5_1 = 7, QUANT_IQ4_XS = 8, QUANT_IQ4_NL = 9, QUANT_Q3_K = 10,
       QUANT_Q2_K = 11, QUANT_IQ4_TAB = 12, QUANT_IQ4_TAB16 = 13, QUANT_IQ2_GRID = 14, QUANT_IQ1_TRIT = 15,
       QUANT_IQ3_TAB16 = 16, QUANT_TQ2_0 = 17, QUANT_NUM_TYPES = 18 };

/* The path built: 2 AVX-512 VNNI, 1 AVX2, 0 plain C on vectors (the same arithmetic on the same layout). */
int gemm_quant_path(void);
/* Whether IQ2_GRID's codes come from AVX-512 VBMI's byte lookups (1; else one at a time: correct, slow). */
int gemm_quant_byte_lookups(void);
/* Calls of at most max_rows rows stream one panel per task (0: never; a speed choice), in every format or
 * in one (_for). */
void gemm_quant_set_single_stream(int max_rows);
void gemm_quant_set_single_stream_for(int qtype, int max_rows);
/* VNNI path: single-stream mode prefetches its stream ahead into L1 (1, the default) or into L2 (2), or
 * leaves it to the hardware prefetcher (0); a speed choice, in every format or in one (_for). */
void gemm_quant_set_single_prefetch(int level);
void gemm_quant_set_single_prefetch_for(int qtype, int level);
/* VNNI path: micro-tiles of 8 rows instead of 4 for Q8_0 / Q4_0 / Q5_0 (1: on, 0: off; a speed choice). */
void gemm_quant_set_wide_tiles(int on);
/* VNNI path: a call's full 16-row groups on AMX's tile unit (AMX-INT8; 1: on, the default where the CPU has it
 * and Linux grants it; 0: off, for A/B runs). The bits are the same either way. Returns whether it is in use. */
int gemm_quant_set_amx(int on);
/* y [M, N] = x [M, K] @ W^T (+ bias [N] or NULL), W packed from GGUF blocks; x, bias, y fp32 or bf16. */
int gemm_quant(const void *x, const void *wq, int qtype, const void *bias, void *y, int64_t M, int64_t N,
               int64_t K, int is_bf16, int num_threads);
/* The same into columns of a wider y: row m at y + m ldy (ldy >= N; a fused projection's rows in two formats). */
int gemm_quant_strided(const void *x, const void *wq, int qtype, const void *bias, void *y, int64_t ldy, int64_t M,
                       int64_t N, int64_t K, int is_bf16, int num_threads);
/* GGUF blocks [N, K / block, block bytes] -> the packed layout, out of the same size. */
int quant_pack(const void *blocks, int qtype, int64_t N, int64_t K, void *out, int num_threads);
/* Rows ids [n] of the packed [N, K] weight, dequantized into out [n, K] (an embedding lookup). */
int quant_rows(const void *wq, int qtype, const int64_t *ids, int64_t n, int64_t N, int64_t K, void *out,
               int is_bf16);

/* ------------------------------------------------------ layout.c: the structs' layout, for the test */

/* One struct (field NULL: then size is sizeof the struct) or one of its fields (offset, size). */
typedef struct {
    const char *type, *field;
    int64_t offset, size;
} FieldLayout;

/* Every struct above (and FieldLayout itself): the struct's row, then its fields' in order; the table
 * ends with a row whose type is NULL. */
const FieldLayout *cobatch_struct_layouts(void);

#endif /* COBATCH_KERNELS_H */
