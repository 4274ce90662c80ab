"""The offline facade and the generate CLI, on the tiny model with the real tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from cobatch.cli import main
from cobatch.llm import LLM
from cobatch.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=256, max_model_len=256,
               num_threads=1)


def test_generate_strings_and_token_ids_in_input_order(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ids = llm.tokenizer.encode("Hello there")
    outs = llm.generate(["Hello there", {"prompt_token_ids": ids}, "Another prompt"], params,
                        use_tqdm=False)
    assert [o.prompt for o in outs] == ["Hello there", None, "Another prompt"]
    assert outs[0].prompt_token_ids == ids
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids  # same prompt, greedy
    assert all(len(o.outputs[0].token_ids) == 8 and o.outputs[0].finish_reason == "length"
               for o in outs)
    assert outs[0].outputs[0].text == llm.tokenizer.decode(outs[0].outputs[0].token_ids)
    metrics = outs[0].metrics
    assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time \
        <= metrics.finished_time


def test_n_samples_seeds_and_logprobs(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=7, logprobs=2, ignore_eos=True)
    first = llm.generate("Tell me a story", params, use_tqdm=False)[0]
    again = llm.generate(["Tell me a story", "noise in the batch"], params, use_tqdm=False)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1  # distinct derived seeds
    lp = first.outputs[0].logprobs
    assert len(lp) == 6 and all(len(x.top) == 2 and x.logprob <= 0 for x in lp)
    assert [x.token_id for x in lp] == first.outputs[0].token_ids


def test_stop_string_trims_text_and_reports_it(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    full = llm.generate("Once upon", params, use_tqdm=False)[0].outputs[0].text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert stop.strip(), "the tiny model's text should give a usable stop string"
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
    out = llm.generate("Once upon", params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[:full.index(stop)]
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.block_manager.num_used_blocks == 0


def test_chat_applies_the_template(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = llm.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert "tok/s" in llm.summary()


def test_generate_cli_prints_completions(tiny_model_dir: Path, capsys) -> None:
    assert main(["generate", "Hello", "--model", str(tiny_model_dir), "--max-tokens", "5",
                 "--dtype", "float32", "--max-model-len", "128", "--num-kv-blocks", "64"]) == 0
    out = capsys.readouterr().out
    assert "--- 'Hello'" in out and "[length]" in out and "tok/s" in out
