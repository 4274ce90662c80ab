"""`cobatch bench roofline`: the roofline arithmetic and the model's weight bytes / FLOPs."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from cobatch.bench.roofline import (Machine, ModelCost, add_arguments, gap_by_step_kind, ideal_schedule_s,
                                   measure_machine, model_cost, roofline_tokens_per_s, run_against_ceiling,
                                   step_ideal_s, step_kind)
from cobatch.engine import StepStats
from cobatch.kernels.linear import is_gate_up_packed, is_packed, native_gemm
from cobatch.models.loader import build_model
from cobatch.models.model_config import ModelConfig
from tests.runner_helpers import runner_for, tiny_hf_model


def test_roofline_is_bandwidth_bound_at_small_batch_and_compute_bound_at_large() -> None:
    cost = ModelCost(weight_bytes=100, flops_per_token=50, lm_head_flops=10)  # 100 B per step, 50 FLOP per row
    machine = Machine(gemm_flops_per_s=1000.0, read_bytes_per_s=100.0)  # 1 s to read the weights
    assert roofline_tokens_per_s(cost, machine, 1) == pytest.approx(1.0)  # bandwidth: 1 row per 1 s
    assert roofline_tokens_per_s(cost, machine, 20) == pytest.approx(20.0)  # the knee: 20 x 50 / 1000 = 1 s
    assert roofline_tokens_per_s(cost, machine, 80) == pytest.approx(20.0)  # compute: 1000 / 50 rows per s


@pytest.mark.parametrize("tied", [True, False])
def test_model_cost_counts_every_matmul_weight_once(tied: bool) -> None:
    runner = runner_for(tiny_hf_model("llama", tie_word_embeddings=tied))
    c = runner.model_config
    per_layer = (c.qkv_size * c.hidden_size + c.hidden_size * c.num_heads * c.head_dim
                 + 3 * c.intermediate_size * c.hidden_size)
    params = c.num_layers * per_layer + c.vocab_size * c.hidden_size  # + lm_head; embedding only if untied
    cost = model_cost(runner.model)
    assert cost.flops_per_token == 2 * params
    assert cost.weight_bytes == 4 * params  # fp32
    assert cost.lm_head_flops == 2 * c.vocab_size * c.hidden_size


@pytest.mark.skipif(native_gemm() is None, reason="no packed GEMM here")
@pytest.mark.parametrize("intermediate_size", [128, 96])  # gate/up packed as 4-D (2 x 128) or 5-D (2 x 96)
def test_packed_bf16_weights_cost_and_measure_like_unpacked_ones(intermediate_size: int) -> None:
    """A bf16 runner packs its weights (4-D tensors; gate/up 5-D where its halves are whole 48-column
    blocks): the cost is unchanged and the machine probe runs."""
    import torch

    hf_model = tiny_hf_model("llama", hidden_size=64, intermediate_size=intermediate_size)
    # built outside a runner, which would pack the weights already
    config = ModelConfig.from_hf_config(hf_model.config.to_dict())
    model = build_model(config, hf_model.state_dict(), torch.bfloat16)
    unpacked = model_cost(model)
    assert model.pack_linear_weights() > 0
    gate_up = model.layers[0].gate_up_proj
    assert is_gate_up_packed(gate_up) if intermediate_size == 96 else is_packed(gate_up)
    packed = model_cost(model)
    assert packed == unpacked
    machine = measure_machine(model, reps=1, m=64, bandwidth_bytes=1 << 20)
    assert machine.gemm_flops_per_s > 0 and machine.read_bytes_per_s > 0


def test_ideal_schedule_prefills_at_peak_then_decodes_the_shrinking_batch() -> None:
    cost = ModelCost(weight_bytes=100, flops_per_token=50, lm_head_flops=10)
    machine = Machine(gemm_flops_per_s=1000.0, read_bytes_per_s=100.0)
    # Prefill: 30 prompt tokens x 40 FLOP + 2 sampled x 10 = 1220 FLOP = 1.22 s. Decode: outputs 1 and 3
    # -> steps 1 and 2 with one request each (the first token comes with the prefill), 1 s each.
    assert ideal_schedule_s(cost, machine, [10, 20], [1, 3]) == pytest.approx(1.22 + 2.0)


def _step(duration_s: float, prefill: int, decode: int, generated: int, padding: int = 0) -> StepStats:
    return StepStats(step=0, start_time=0.0, duration_s=duration_s, schedule_s=0.0, execute_s=duration_s,
                     num_running=decode, num_waiting=0, num_swapped=0, num_rows=decode + padding + (prefill > 0),
                     num_prefill_tokens=prefill, num_decode_tokens=decode, num_padding_rows=padding,
                     num_context_tokens=0, num_kv_blocks_used=0, kv_usage=0.0, num_preempted=0,
                     num_generated_tokens=generated, num_draft_tokens=0, num_accepted_tokens=0, predicted_s=0.0,
                     prefix_cache_hit_rate=0.0, row_request_ids=())


def test_gap_by_step_kind_sets_each_step_against_its_ideal_time() -> None:
    """A prefill step's tokens at the GEMM peak (lm_head for the sampled rows only), a decode step at its
    batch's roofline; kinds by batch size; largest gap first; padding rows are not the batch."""
    cost = ModelCost(weight_bytes=100, flops_per_token=50, lm_head_flops=10)
    machine = Machine(gemm_flops_per_s=1000.0, read_bytes_per_s=100.0)
    # 20 prompt + 2 decode tokens x 40 body FLOP + 3 sampled x 10 = 910 FLOP = 0.91 s
    assert step_ideal_s(cost, machine, 20, 2, 3) == pytest.approx(0.91)
    assert step_ideal_s(cost, machine, 0, 4, 4) == pytest.approx(1.0)  # bandwidth-bound: the weights once
    assert step_ideal_s(cost, machine, 0, 40, 40) == pytest.approx(2.0)  # compute-bound: 40 x 50 / 1000
    assert [step_kind(5, 3), step_kind(0, 1), step_kind(0, 9), step_kind(0, 32), step_kind(0, 33),
            step_kind(0, 65)] == ["prefill", "decode B 1-8", "decode B 9-16", "decode B 17-32",
                                  "decode B 33-64", "decode B > 64"]
    stats = [_step(1.5, 20, 2, 3), _step(1.0, 0, 4, 4), _step(1.5, 0, 4, 4, padding=6), _step(2.5, 0, 40, 40)]
    rows = {r["kind"]: r for r in gap_by_step_kind(stats, cost, machine)}
    assert rows["decode B 1-8"]["steps"] == 2  # 4 rows + 6 padding: still a batch of 4
    assert rows["decode B 1-8"]["ideal_s"] == pytest.approx(2.0) and rows["decode B 1-8"]["gap_s"] == pytest.approx(0.5)
    assert rows["prefill"]["gap_s"] == pytest.approx(0.59)
    assert rows["decode B 33-64"]["gap_share_of_run"] == pytest.approx(0.5 / 6.5)
    assert [r["kind"] for r in gap_by_step_kind(stats, cost, machine)][0] == "prefill"  # largest gap first


def test_workload_runs_report_each_the_best_and_the_median(capsys: pytest.CaptureFixture[str],
                                                          tmp_path: Path) -> None:
    """--runs N: every run printed; the share of the ceiling is the best run's, the median's beside it;
    the best run's steps against the ceiling's rates, by kind and (--plot) step by step."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--workload", "mixed64", "--num-prompts", "3", "--input-len", "4-8",
                              "--output-len", "2-5", "--runs", "3", "--dtype", "float32",
                              "--block-size", "4", "--plot", str(tmp_path / "run.png")])  # runner_for's blocks
    runner = runner_for(tiny_hf_model("llama", vocab_size=30000))  # the workload's token ids: 1000..29999
    cost = ModelCost(weight_bytes=10 ** 6, flops_per_token=10 ** 6, lm_head_flops=10 ** 5)
    out = run_against_ceiling(args, runner, cost, Machine(gemm_flops_per_s=1e12, read_bytes_per_s=1e11))
    rates = out["runs_tokens_per_s"]
    assert len(rates) == 3 and all(r > 0 for r in rates)
    assert out["tokens_per_s"] == max(rates) and out["median_tokens_per_s"] == sorted(rates)[1]
    assert out["share_of_ceiling"] == pytest.approx(max(rates) / out["ceiling_tokens_per_s"])
    printed = capsys.readouterr().out
    assert printed.count("(run ") == 3 and "best of 3 runs" in printed and "speculative" not in out
    assert "ceiling's rates" in printed and sum(r["steps"] for r in out["gap_by_step_kind"]) > 0
    assert (tmp_path / "run.png").stat().st_size > 0
    # with drafts: plain and speculative runs alternate against the same ceiling, reported apart
    args.num_speculative_tokens, args.runs = 2, 2
    out = run_against_ceiling(args, runner, cost, Machine(gemm_flops_per_s=1e12, read_bytes_per_s=1e11))
    assert len(out["runs_tokens_per_s"]) == len(out["speculative"]["runs_tokens_per_s"]) == 2
    assert out["speculative"]["num_speculative_tokens"] == 2
    assert capsys.readouterr().out.count("(run ") == 4
