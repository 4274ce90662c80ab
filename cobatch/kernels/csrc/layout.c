/* The layout of every struct cobatch_kernels.h shares with Python, as this compiler lays it out: sizeof
 * each struct and offsetof / sizeof each field, in declaration order. tests/test_kernel_bindings.py
 * compares them with the ctypes mirrors in kernels/bindings.py, so a field added, moved or retyped on one
 * side only fails a test instead of shifting every field after it. */
#include <stddef.h>

#include "cobatch_kernels.h"

#define STRUCT(T) {#T, NULL, 0, sizeof(T)}
#define FIELD(T, f) {#T, #f, offsetof(T, f), sizeof(((T *)0)->f)}

static const FieldLayout LAYOUTS[] = {
    STRUCT(Shape), FIELD(Shape, hidden), FIELD(Shape, inter), FIELD(Shape, num_heads),
    FIELD(Shape, num_kv_heads), FIELD(Shape, head_dim), FIELD(Shape, block_size), FIELD(Shape, fused_mlp),
    FIELD(Shape, is_bf16), FIELD(Shape, eps), FIELD(Shape, scale),

    STRUCT(Layer), FIELD(Layer, input_norm), FIELD(Layer, qkv), FIELD(Layer, qkv_bias), FIELD(Layer, o),
    FIELD(Layer, o_bias), FIELD(Layer, post_norm), FIELD(Layer, gate_up), FIELD(Layer, down),
    FIELD(Layer, q_norm), FIELD(Layer, k_norm),
    FIELD(Layer, k_cache), FIELD(Layer, v_cache), FIELD(Layer, qkv_type), FIELD(Layer, o_type),
    FIELD(Layer, gate_up_type), FIELD(Layer, down_type), FIELD(Layer, skip_rope), FIELD(Layer, qkv_tail),
    FIELD(Layer, qkv_tail_type), FIELD(Layer, qkv_tail_rows),

    STRUCT(Step), FIELD(Step, num_tokens), FIELD(Step, max_blocks), FIELD(Step, num_tiles),
    FIELD(Step, num_keep), FIELD(Step, num_own_writes), FIELD(Step, positions), FIELD(Step, slot_mapping),
    FIELD(Step, block_tables), FIELD(Step, tiles), FIELD(Step, keep), FIELD(Step, keep_tiles),
    FIELD(Step, cos), FIELD(Step, sin),

    STRUCT(Buffers), FIELD(Buffers, residual), FIELD(Buffers, x), FIELD(Buffers, h), FIELD(Buffers, qkv),
    FIELD(Buffers, attn), FIELD(Buffers, gate_up), FIELD(Buffers, act), FIELD(Buffers, residual_keep),
    FIELD(Buffers, q_keep), FIELD(Buffers, out),

    STRUCT(FieldLayout), FIELD(FieldLayout, type), FIELD(FieldLayout, field), FIELD(FieldLayout, offset),
    FIELD(FieldLayout, size),

    {NULL, NULL, 0, 0},
};

const FieldLayout *cobatch_struct_layouts(void) { return LAYOUTS; }
