"""The layer loop in C (kernels/decoder.py, kernels/csrc/decoder.c) against the Python layer loop it replaces:
the same kernels in the same order, so the same bits, on ragged steps mixing decode rows, prefill chunks
over a cached prefix and fresh prompts; and it steps aside wherever it cannot run."""

from __future__ import annotations

import time

import pytest
import torch

from cobatch.kernels.bindings import KERNEL_TIMERS
from cobatch.kernels.decoder import NativeDecoder
from cobatch.kernels.linear import is_gate_up_packed, is_packed, native_gemm
from cobatch.kernels.quant_linear import is_quantized, native_quant_gemm, pack_blocks
from cobatch.models import llama as llama_module
from cobatch.models.loader import build_model
from cobatch.models.model_config import ModelConfig
from cobatch.models.quantization import quantize
from cobatch.runner.layer_loop import native_layer_loop
from cobatch.runner.model_runner import ModelRunner, prepare_batch
from cobatch.scheduler_output import SchedulerOutput
from tests.runner_helpers import BlockAllocator, Seq, step, tiny_hf_model

# The dense dtypes whose packed GEMM is built here (bf16 needs AVX512-BF16, fp32 AVX-512F).
DTYPES = [pytest.param(torch.bfloat16, marks=pytest.mark.skipif(native_gemm(torch.bfloat16) is None,
                                                                reason="no AVX512-BF16 kernels here")),
          pytest.param(torch.float32, marks=pytest.mark.skipif(native_gemm(torch.float32) is None,
                                                               reason="no AVX-512F kernels here"))]
with_dense_kernels = pytest.mark.parametrize("dtype", DTYPES)


def _runner(arch: str, dtype: torch.dtype = torch.bfloat16, **overrides: object) -> ModelRunner:
    hf = tiny_hf_model(arch, **overrides)
    config = ModelConfig.from_hf_config(hf.config.to_dict())
    return ModelRunner.from_model(build_model(config, hf.state_dict(), dtype), config, 64, 4)


def _mixed_step(runner: ModelRunner) -> SchedulerOutput:
    """Two sequences decoding after their prompts, one prompt with 12 tokens cached (a chunk of 10 continues
    it, not to its end), one fresh prompt: the shapes a continuous-batching step mixes."""
    alloc = BlockAllocator(runner.block_size)
    decoding = [alloc.seq(f"d{i}", list(range(5 + i, 18 + 3 * i)), 64) for i in range(2)]
    chunked = alloc.seq("c", list(range(40, 71)), 64)
    fresh = alloc.seq("f", list(range(90, 99)), 64)
    step(runner, [(s, None) for s in decoding] + [(chunked, 12)])
    rows = [s.row() for s in decoding] + [chunked.row(10), fresh.row()]
    return SchedulerOutput(tuple(rows))


def _forward(runner: ModelRunner, out: SchedulerOutput, native: bool,
             sampled_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's last hidden states (every row's, or the sampled rows' as the runner asks for them) and
    the KV cache after it, with the native loop on or off."""
    cache = runner.kv_cache.clone()
    try:
        batch = prepare_batch(out.rows, runner.block_size, runner.device, runner.attention_kernel,
                              runner.scratch_slot)
        keep = (batch.sample_indices, batch.sample_tiles) if sampled_only else (None, None)
        with torch.inference_mode():
            hidden = runner.model(batch.input_ids, batch.positions, batch.meta, runner.kv_caches, False, *keep,
                                  layer_loop=runner.native_decoder if native else None)
        return hidden, runner.kv_cache.clone()
    finally:
        runner.kv_cache.copy_(cache)


@pytest.mark.skipif(native_quant_gemm() is None, reason="the kernels library cannot be built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch, quantization, overrides", [
    ("llama", "q8_0", {}),
    ("qwen2", "q4_0", {}),  # q/k/v biases
    ("qwen3", "q4_0", {}),  # q / k head norms, head_dim 128 > hidden / heads
    ("llama", "q8_0", {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 1}),  # hd 64
])
def test_quantized_weights_same_bits_as_the_python_layer_loop(arch: str, quantization: str, overrides: dict,
                                                               dtype: torch.dtype) -> None:
    """Quantized projections (csrc/gemm_quant.c) in fp32 (this loop's only fp32 case) and bf16."""
    hf = tiny_hf_model(arch, **overrides)
    config = ModelConfig.from_hf_config(hf.config.to_dict())
    runner = ModelRunner.from_model(build_model(config, hf.state_dict(), dtype, quantization=quantization),
                                    config, 64, 4)
    assert is_quantized(runner.model.layers[0].qkv_proj)
    assert runner.native_decoder is not None  # bf16 too without AVX512-BF16: no bf16 GEMM is needed
    out = _mixed_step(runner)
    hidden, cache = _forward(runner, out, native=True)
    ref_hidden, ref_cache = _forward(runner, out, native=False)
    assert hidden.dtype == dtype and torch.isfinite(hidden).all()
    assert torch.equal(hidden, ref_hidden)
    assert torch.equal(cache, ref_cache)
    assert not torch.equal(cache, runner.kv_cache)


@pytest.mark.skipif(native_quant_gemm() is None, reason="the kernels library cannot be built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: the bias split between the two GEMMs
def test_qkv_in_two_formats_same_bits_as_the_python_layer_loop(arch: str, dtype: torch.dtype) -> None:
    """q | k in Q4_0, v apart in Q8_0 (qkv_tail_proj, as the loader keeps llama-quantize's mixes): the C loop's
    two strided GEMMs give the Python loop's bits (which runs them as two GEMMs and a concatenation)."""
    hf = tiny_hf_model(arch)
    config = ModelConfig.from_hf_config(hf.config.to_dict())
    model = build_model(config, hf.state_dict(), dtype, quantization="q4_0")
    v_rows = config.num_kv_heads * config.head_dim
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}.self_attn."
        dense = torch.cat([hf.state_dict()[prefix + f"{x}_proj.weight"] for x in "qkv"]).float()
        layer.qkv_proj.data = pack_blocks(quantize(dense[:-v_rows], "q4_0"))
        layer.qkv_tail_proj = torch.nn.Parameter(pack_blocks(quantize(dense[-v_rows:], "q8_0")), requires_grad=False)
    runner = ModelRunner.from_model(model, config, 64, 4)
    assert runner.native_decoder is not None
    out = _mixed_step(runner)
    hidden, cache = _forward(runner, out, native=True)
    ref_hidden, ref_cache = _forward(runner, out, native=False)
    assert torch.isfinite(hidden).all() and torch.equal(hidden, ref_hidden) and torch.equal(cache, ref_cache)


@with_dense_kernels
@pytest.mark.parametrize("arch, overrides", [
    ("llama", {}),  # head_dim 16: the attention kernel's plain C path
    ("qwen2", {}),  # q/k/v biases
    ("qwen3", {}),  # q / k head norms, head_dim 128 > hidden / heads
    ("smollm3", {}),  # layer 1 without RoPE (NoPE)
    ("llama", {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 1}),  # hd 64: AVX-512
    ("llama", {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4}),  # hd 32, no GQA
    ("llama", {"intermediate_size": 96}),  # gate/up packed: SiLU-multiply fused into the GEMM
])
def test_same_bits_as_the_python_layer_loop(arch: str, overrides: dict, dtype: torch.dtype) -> None:
    runner = _runner(arch, dtype, **overrides)
    assert runner.native_decoder is not None
    out = _mixed_step(runner)
    hidden, cache = _forward(runner, out, native=True)
    ref_hidden, ref_cache = _forward(runner, out, native=False)
    assert hidden.dtype == dtype and torch.isfinite(hidden).all()
    assert torch.equal(hidden, ref_hidden)
    assert torch.equal(cache, ref_cache)  # the new tokens' K/V landed in the same slots
    assert not torch.equal(cache, runner.kv_cache)  # ... and there were some to write


@with_dense_kernels
def test_fused_gate_up_gives_the_same_bits(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """An MLP whose gate/up weight is gate/up packed (its activation inside the GEMM) computes what the
    plain packed GEMM followed by silu_mul does, in both loops, bit for bit."""
    fused = _runner("llama", dtype, intermediate_size=96)
    monkeypatch.setattr(llama_module, "can_pack_gate_up", lambda weight, activations=None: False)
    plain = _runner("llama", dtype, intermediate_size=96)
    assert is_gate_up_packed(fused.model.layers[0].gate_up_proj)
    assert is_packed(plain.model.layers[0].gate_up_proj)
    out = _mixed_step(fused)
    _mixed_step(plain)  # the same steps before: the same cache
    for native in (True, False):
        hidden, cache = _forward(fused, out, native)
        ref_hidden, ref_cache = _forward(plain, out, native)
        assert torch.equal(hidden, ref_hidden) and torch.equal(cache, ref_cache)


@with_dense_kernels
def test_twin_with_kernel_timers_times_every_kernel_and_changes_no_bits(dtype: torch.dtype) -> None:
    """with_timers(): the library built with -DKERNEL_TIMERS sums each kernel's wall time and computes what
    the engine's build does; take_kernel_seconds zeroes the sums; the engine's build has no timers."""
    runner = _runner("llama", dtype, intermediate_size=96)
    out = _mixed_step(runner)
    plain = runner.native_decoder
    timed = plain.with_timers()
    assert timed is not None and plain.take_kernel_seconds() == {}
    timed.take_kernel_seconds()
    runner.native_decoder = timed
    try:
        hidden, cache = _forward(runner, out, native=True)
    finally:
        runner.native_decoder = plain
    ref_hidden, ref_cache = _forward(runner, out, native=True)
    assert torch.equal(hidden, ref_hidden) and torch.equal(cache, ref_cache)
    seconds = timed.take_kernel_seconds()
    assert list(seconds) == list(KERNEL_TIMERS) and all(s > 0 for s in seconds.values())
    assert all(s == 0 for s in timed.take_kernel_seconds().values())


@with_dense_kernels
def test_profile_step_times_the_c_loop_kernels(dtype: torch.dtype) -> None:
    """A runner on the native loop profiles a step with its kernel timers: every part measured, the
    parts adding up to the step, and the engine's own decoder back in place."""
    runner = _runner("llama", dtype, intermediate_size=96)
    decoder = runner.native_decoder
    out = _mixed_step(runner)
    start = time.perf_counter()
    parts = runner.profile_step(out)
    elapsed = time.perf_counter() - start
    assert set(parts) == {"prepare", "norm", "qkv_proj+rope", "attention", "o_proj", "mlp", "lm_head", "other",
                          "sample"}
    assert all(parts[name] > 0 for name in ("norm", "qkv_proj+rope", "attention", "o_proj", "mlp", "lm_head"))
    assert sum(parts.values()) <= elapsed
    assert runner.native_decoder is decoder and not decoder.take_kernel_seconds()


@with_dense_kernels
def test_last_layer_computes_only_the_sampled_rows(dtype: torch.dtype) -> None:
    """The runner asks for the sampled rows only (3 of the step's 21 tokens: the chunk that does not end its
    prompt samples nothing); the native loop then skips the others in the last layer past its K/V write:
    the same values, in the rows' order, and the same cache."""
    runner = _runner("llama", dtype)
    out = _mixed_step(runner)
    hidden, cache = _forward(runner, out, native=True, sampled_only=True)
    full, ref_cache = _forward(runner, out, native=False)
    batch = prepare_batch(out.rows, runner.block_size, runner.device, runner.attention_kernel, runner.scratch_slot)
    assert hidden.shape == (3, full.shape[1]) and len(full) == 1 + 1 + 10 + 9
    assert torch.equal(hidden, full[batch.sample_indices])
    assert torch.equal(cache, ref_cache)


@with_dense_kernels
def test_step_that_samples_no_row_still_writes_its_kv(dtype: torch.dtype) -> None:
    """A step of one prefill chunk that does not end its prompt keeps no row: the loop writes its K/V,
    as the Python loop does, and returns no hidden states (an empty keep is not "keep every row")."""
    runner = _runner("llama", dtype)
    chunk = BlockAllocator(runner.block_size).seq("c", list(range(40, 71)), 64)
    out = SchedulerOutput((chunk.row(10),))
    hidden, cache = _forward(runner, out, native=True, sampled_only=True)
    _, ref_cache = _forward(runner, out, native=False)
    assert hidden.shape == (0, runner.model_config.hidden_size)
    assert torch.equal(cache, ref_cache) and not torch.equal(cache, runner.kv_cache)


@with_dense_kernels
def test_generation_is_the_same_with_and_without_it(dtype: torch.dtype) -> None:
    """Whole steps through the runner, sampling included: decode after decode, same tokens."""
    outputs = []
    for native in (True, False):
        runner = _runner("llama", dtype)
        if not native:
            runner.native_decoder = None
        alloc = BlockAllocator(runner.block_size)
        seqs = [alloc.seq(f"r{i}", list(range(3 + 7 * i, 20 + 9 * i)), 64) for i in range(3)]
        step(runner, [(s, None) for s in seqs])
        for _ in range(6):
            step(runner, [(s, None) for s in seqs])
        outputs.append([s.output for s in seqs])
    assert outputs[0] == outputs[1] and len(outputs[0][0]) == 7


@pytest.mark.parametrize("case", ["unpacked fp32 weight", "unpacked bf16 weight", "torch attention"])
def test_steps_aside_where_it_cannot_run(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A projection the GEMM cannot pack (2 x 100 gate/up columns are not whole 16-column panels), in fp32
    or bf16 (where bf16 has no GEMM, nothing is packed), and a runner without the native attention all run
    the Python loop, correctly."""
    if case.startswith("unpacked"):
        runner = _runner("llama", torch.float32 if "fp32" in case else torch.bfloat16, intermediate_size=100)
    else:
        hf = tiny_hf_model("llama")
        config = ModelConfig.from_hf_config(hf.config.to_dict())
        runner = ModelRunner.from_model(build_model(config, hf.state_dict(), torch.bfloat16), config, 64, 4,
                                        native_attention=False)
    if case != "torch attention":
        assert runner.native_decoder is None
        assert native_layer_loop(runner.model) is None

    def boom(*args: object) -> None:
        raise AssertionError("the native decoder ran without the native attention's metadata")
    monkeypatch.setattr(NativeDecoder, "__call__", boom)
    alloc = BlockAllocator(runner.block_size)
    seq: Seq = alloc.seq("r", list(range(10, 30)), 64)
    for _ in range(3):
        step(runner, [(seq, None)])
    assert len(seq.output) == 3 and all(0 <= t < 256 for t in seq.output)
