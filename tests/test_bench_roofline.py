"""`cobatch bench roofline`: the roofline arithmetic and the model's weight bytes / FLOPs."""

from __future__ import annotations

import pytest

from cobatch.bench.roofline import Machine, ModelCost, model_cost, roofline_tokens_per_s
from tests.runner_helpers import runner_for, tiny_hf_model


def test_roofline_is_bandwidth_bound_at_small_batch_and_compute_bound_at_large() -> None:
    cost = ModelCost(weight_bytes=100, flops_per_token=50)  # 100 B per step, 50 FLOP per row
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
