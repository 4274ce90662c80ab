/* The decoder layers of one step in one native call: the same kernels, in the same order, with the same
 * arguments as models/llama.py's layer-by-layer path (which stays: unpacked weights, the profiler's labelled
 * parts, other devices), so the two give the same bits. Activations bf16 or fp32, on projections packed
 * in the same dtype (gemm_bf16.c, gemm_f32.c), bf16 ones under fp32 activations (gemm_f32_wbf16.c) or
 * quantized (gemm_quant.c); Layer's *_type says which.
 *
 * Why: a decode step's kernels are small: at batch 1 the layer loop made ~15 Python/torch calls per layer
 * (wrappers, views, output allocations, the K/V index copies), ~3-4 ms per step against ~8 ms of weight
 * streaming (measured: B=1 10.8 -> 8.1 ms). Here the loop is C; the activations live in buffers the caller
 * keeps across steps.
 *
 * The kernels are the library's own (gemm_bf16.c, gemm_f32.c, gemm_quant.c, fused_ops.c,
 * paged_attention.c), called through cobatch_kernels.h, which also declares the structs below (Shape,
 * Layer, Step, Buffers).
 *
 * Per layer, with x the previous layer's MLP output and residual the running sum (layer 0: residual holds
 * the embeddings and there is no x):
 *   h = add_rms_norm(x, residual += x, input_norm)      qkv = h @ Wqkv (+ b)    RoPE on q, k in place
 *   (Qwen3: each q and k head RMS-normed first, head_rms_norm; SmolLM3's NoPE layers: no RoPE)
 *   K/V of the new tokens -> cache slots                 attn = paged_attention(q; cache)
 *   x = attn @ Wo (+ b)                                  h = add_rms_norm(x, residual += x, post_norm)
 *   gate_up = h @ Wgu                                    act = silu(gate) * up        x = act @ Wdown
 * (with a gate/up-packed Wgu, fused_mlp: act straight from h in one kernel, gemm_*_silu, same bits).
 * After the last layer: residual += x and the final norm, one fused op, into `out` (the model's final hidden
 * states, which lm_head reads): in C, right after the loop, rather than as a torch op after the call, where
 * every small op ran with cold caches (~0.1 ms a decode step).
 */
#include "cobatch_kernels.h"

/* Wall time per kernel, summed over layers and calls, when built with -DKERNEL_TIMERS (NativeDecoder.
 * with_timers does, for `bench steps --profile` and scripts/kernel_timers.py: the torch profiler would
 * see only the Python layer loop). Compiled out otherwise. kernel_seconds: norm, qkv, rope (with Qwen3's
 * q/k head norms), write_kv, attention (with the last layer's gather of the kept rows), o_proj,
 * post-attention norm, gate/up (with SiLU), down: kernels/decoder.py's KERNEL_TIMERS. */
#ifdef KERNEL_TIMERS
#include <omp.h>
double kernel_seconds[9];
static double timer_last;
#define TIMER_START() (timer_last = omp_get_wtime())
#define TIMER(i)                                                   \
    do {                                                           \
        double now_ = omp_get_wtime();                             \
        kernel_seconds[i] += now_ - timer_last, timer_last = now_; \
    } while (0)
#else
#define TIMER_START() ((void)0)
#define TIMER(i) ((void)0)
#endif

/* dst[i] = src[rows[i]] for n rows of `width` values of esize bytes. */
static void gather_rows(void *dst, const void *src, const int64_t *rows, int64_t n, int64_t width, size_t esize) {
    for (int64_t i = 0; i < n; i++)
        memcpy((char *)dst + esize * i * width, (const char *)src + esize * rows[i] * width, esize * width);
}

/* y = x W^T (+ bias): W packed for the activations' dense GEMM (PACKED_DENSE: gemm_bf16 or gemm_f32),
 * bf16 under fp32 x (PACKED_F32_WBF16) or quantized (gemm_quant, fp32 or bf16 x). */
static int linear(const Shape *s, int64_t qtype, const void *x, const void *w, const void *bias, void *y,
                  int64_t M, int64_t N, int64_t K, int threads) {
    if (qtype >= 0) return gemm_quant(x, w, (int)qtype, bias, y, M, N, K, (int)s->is_bf16, threads);
    if (qtype == PACKED_F32_WBF16) return gemm_f32_wbf16(x, w, bias, y, M, N, K, threads);
    if (s->is_bf16) return gemm_bf16(x, w, bias, y, M, N, K, threads);
    return gemm_f32(x, w, bias, y, M, N, K, threads);
}

/* qkv = x Wqkv^T (+ b): one GEMM, or two where its last rows are in another quantized format (Layer.qkv_tail),
 * each into its columns of qkv (and its part of the bias). */
static int qkv_linear(const Shape *s, const Layer *l, const void *x, void *qkv, int64_t M, int64_t width,
                      int threads) {
    if (l->qkv_tail == NULL) return linear(s, l->qkv_type, x, l->qkv, l->qkv_bias, qkv, M, width, s->hidden, threads);
    const int64_t head = width - l->qkv_tail_rows;
    const size_t esize = s->is_bf16 ? 2 : 4;
    const char *tail_bias = l->qkv_bias == NULL ? NULL : (const char *)l->qkv_bias + esize * head;
    const int status = gemm_quant_strided(x, l->qkv, (int)l->qkv_type, l->qkv_bias, qkv, width, M, head,
                                          s->hidden, (int)s->is_bf16, threads);
    if (status) return status;
    return gemm_quant_strided(x, l->qkv_tail, (int)l->qkv_tail_type, tail_bias, (char *)qkv + esize * head, width,
                              M, l->qkv_tail_rows, s->hidden, (int)s->is_bf16, threads);
}

/* act = silu(x Wg^T) * (x Wu^T) on a gate/up-packed W of the given type (PACKED_DENSE or PACKED_F32_WBF16). */
static int linear_silu(const Shape *s, int64_t type, const void *x, const void *w, void *act, int64_t M,
                       int threads) {
    if (type == PACKED_F32_WBF16) return gemm_f32_wbf16_silu(x, w, act, M, s->inter, s->hidden, threads);
    if (s->is_bf16) return gemm_bf16_silu(x, w, act, M, s->inter, s->hidden, threads);
    return gemm_f32_silu(x, w, act, M, s->inter, s->hidden, threads);
}

/* The new tokens' K/V into the cache, in the activations' dtype. */
static void write_kv(const Shape *s, const Layer *l, const void *k, const void *v, int64_t stride,
                     const int64_t *slots, int64_t n) {
    const int kvh = (int)s->num_kv_heads, hd = (int)s->head_dim, bs = (int)s->block_size;
    if (s->is_bf16) paged_write_kv_bf16(k, stride, v, stride, l->k_cache, l->v_cache, slots, n, kvh, hd, bs);
    else paged_write_kv_f32(k, stride, v, stride, l->k_cache, l->v_cache, slots, n, kvh, hd, bs);
}

/* One layer; returns 0 or the failing kernel's status. `last` with st->keep: only the kept rows past the
 * K/V write (their q and residual gathered first). */
static int layer_forward(const Shape *s, const Layer *l, const Step *st, const Buffers *b, int first, int last,
                         int threads) {
    const int64_t H = s->hidden, nh = s->num_heads, kvh = s->num_kv_heads, hd = s->head_dim;
    const int64_t qkv_width = (nh + 2 * kvh) * hd;
    const int bf16 = (int)s->is_bf16;
    const size_t esize = bf16 ? 2 : 4;
    int64_t T = st->num_tokens;
    int status;
    add_rms_norm(first ? NULL : b->x, b->residual, l->input_norm, b->h, T, H, s->eps, bf16);
    TIMER(0);
    status = qkv_linear(s, l, b->h, b->qkv, T, qkv_width, threads);
    if (status) return status;
    TIMER(1);
    const int64_t q_width = nh * hd;  /* K and V: the columns of qkv after q */
    if (l->q_norm != NULL) {  /* Qwen3: each q and k head RMS-normed before RoPE */
        head_rms_norm(b->qkv, l->q_norm, T, qkv_width, nh, hd, s->eps, bf16);
        head_rms_norm((char *)b->qkv + esize * q_width, l->k_norm, T, qkv_width, kvh, hd, s->eps, bf16);
    }
    if (!l->skip_rope) rope_inplace(b->qkv, st->cos, st->sin, st->positions, T, qkv_width, nh + kvh, hd, bf16);
    TIMER(2);
    /* The first num_own_writes tokens (one-token rows: decode) have the attention kernel write their K/V
     * just before it reads them (paged_attention.c, write_own_key); the others are written here. Not in
     * the last layer's kept-rows call, whose tiles and q rows are the kept ones. */
    const int64_t own = last && st->keep != NULL ? 0 : st->num_own_writes;
    const char *k_rows = (const char *)b->qkv + esize * (own * qkv_width + q_width);
    write_kv(s, l, k_rows, k_rows + esize * kvh * hd, qkv_width, st->slot_mapping + own, T - own);
    TIMER(3);
    const void *q = b->qkv;
    const int64_t *tiles = st->tiles;
    int64_t num_tiles = st->num_tiles;
    void *residual = b->residual;
    if (last && st->keep != NULL) {
        T = st->num_keep;
        if (T == 0) return 0;
        gather_rows(b->q_keep, b->qkv, st->keep, T, qkv_width, esize);
        gather_rows(b->residual_keep, b->residual, st->keep, T, H, esize);
        q = b->q_keep, tiles = st->keep_tiles, num_tiles = T, residual = b->residual_keep;
    }
    status = bf16 ? paged_attention_bf16(q, qkv_width, l->k_cache, l->v_cache, st->block_tables, st->max_blocks,
                                         tiles, (int)num_tiles, b->attn, (int)nh, (int)kvh, (int)hd,
                                         (int)s->block_size, s->scale, own)
                  : paged_attention_f32(q, qkv_width, l->k_cache, l->v_cache, st->block_tables, st->max_blocks,
                                        tiles, (int)num_tiles, b->attn, (int)nh, (int)kvh, (int)hd,
                                        (int)s->block_size, s->scale, own);
    if (status) return status;
    TIMER(4);
    if ((status = linear(s, l->o_type, b->attn, l->o, l->o_bias, b->x, T, H, nh * hd, threads))) return status;
    TIMER(5);
    add_rms_norm(b->x, residual, l->post_norm, b->h, T, H, s->eps, bf16);
    TIMER(6);
    if (s->fused_mlp) {
        if ((status = linear_silu(s, l->gate_up_type, b->h, l->gate_up, b->act, T, threads))) return status;
    } else {
        status = linear(s, l->gate_up_type, b->h, l->gate_up, NULL, b->gate_up, T, 2 * s->inter, H, threads);
        if (status) return status;
        silu_mul(b->gate_up, b->act, T, s->inter, bf16);
    }
    TIMER(7);
    status = linear(s, l->down_type, b->act, l->down, NULL, b->x, T, H, s->inter, threads);
    TIMER(8);
    return status;
}

/* All layers of one step (bf16 or fp32 activations), then the final norm (its weight: final_norm) into
 * b->out. Returns 0, or the status of the first failing kernel (paged attention or gemm_quant: -1 out of
 * memory for their scratch; the GEMMs: -2 bad shape, which packed weights rule out). */
int decoder_forward(const Shape *s, const Layer *layers, int num_layers, const void *final_norm,
                    const Step *st, const Buffers *b, int threads) {
    if (st->num_tokens <= 0) return 0;
    TIMER_START();
    for (int i = 0; i < num_layers; i++) {
        int status = layer_forward(s, &layers[i], st, b, i == 0, i == num_layers - 1, threads);
        if (status) return status;
    }
    const int keep = st->keep != NULL;
    add_rms_norm(num_layers > 0 ? b->x : NULL, keep ? b->residual_keep : b->residual, final_norm, b->out,
                 keep ? st->num_keep : st->num_tokens, s->hidden, s->eps, (int)s->is_bf16);
    TIMER(0);  /* with the layers' input norms */
    return 0;
}
