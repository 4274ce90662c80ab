"""The runner's pick of the layer loop: the C one (kernels/decoder.py) over the model's own weights where it
can run them (bf16 or fp32 weights packed for the native GEMM, or quantized ones; every kernel
built), else None: the model's Python loop."""

from __future__ import annotations

from cobatch.kernels.decoder import DecoderWeights, LayerWeights, NativeDecoder
from cobatch.models.llama import LlamaForCausalLM


def decoder_weights(model: LlamaForCausalLM) -> DecoderWeights:
    """The model's tensors and shape as the C loop reads them (the model keeps owning them)."""
    c = model.config
    layers = tuple(LayerWeights(layer.input_norm, layer.qkv_proj, layer.qkv_bias, layer.o_proj, layer.o_bias,
                                layer.post_attention_norm, layer.gate_up_proj, layer.down_proj, layer.q_norm,
                                layer.k_norm, layer.use_rope, layer.qkv_tail_proj)
                   for layer in model.layers)
    return DecoderWeights(layers, model.norm, model.rope_cos, model.rope_sin, c.hidden_size, c.intermediate_size,
                          c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps)


def native_layer_loop(model: LlamaForCausalLM) -> NativeDecoder | None:
    """The C layer loop over `model`'s weights, or None where it cannot run them. Build it after the
    weights are packed (LlamaForCausalLM.pack_linear_weights): it keeps their addresses."""
    return NativeDecoder.build(decoder_weights(model))
