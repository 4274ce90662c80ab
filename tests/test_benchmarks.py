"""The repository's report generators (benchmarks/): the claims block keeps hand-written text and the
sub-sections a run did not measure; each generator's command line parses and answers --help."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import claims, peers
from benchmarks.claims_report import BEGIN, END, base_command, render_section, rerun_command, write_markdown

REPO = Path(__file__).parents[1]


def _section(key: str, body: str, measured: str = "today") -> dict[str, str]:
    return {key: render_section(key, f"Claim {key}", body, measured, f"python -m benchmarks.claims --only {key}")}


def test_generated_block_is_replaced_and_hand_written_text_survives(tmp_path: Path) -> None:
    path = tmp_path / "BENCHMARKS.md"
    write_markdown(path, _section("a", "| x |", "run 1"))
    text = path.read_text()
    assert text.startswith("# Benchmarks") and BEGIN in text and "run 1" in text
    path.write_text("# Benchmarks\n\nHand-written intro.\n\n" + text.split("# Benchmarks\n\n", 1)[1]
                    + "\nHand-written outro.\n")
    write_markdown(path, _section("a", "| y |", "run 2"))
    text = path.read_text()
    assert "Hand-written intro." in text and "Hand-written outro." in text
    assert "run 2" in text and "run 1" not in text and "| y |" in text and "| x |" not in text
    assert text.count(BEGIN) == 1 and text.count(END) == 1


def test_a_partial_run_keeps_the_other_sections_in_order(tmp_path: Path) -> None:
    path = tmp_path / "BENCHMARKS.md"
    write_markdown(path, {**_section("b", "B1"), **_section("a", "A1"), **_section("peers", "P1")})
    write_markdown(path, _section("b", "B2", "later"))
    text = path.read_text()
    assert "A1" in text and "B2" in text and "P1" in text and "B1" not in text
    assert text.index("(a) Claim a") < text.index("(b) Claim b") < text.index("(peers) Claim peers")
    assert "Measured later. Reproduce: `python -m benchmarks.claims --only b`" in text


def test_each_section_names_the_command_that_reruns_it_alone() -> None:
    base = base_command(["--only", "ab", "--peers", "--dtype", "bfloat16", "--only=c"])
    assert base == "python -m benchmarks.claims --dtype bfloat16"
    assert rerun_command(base, "c") == base + " --only c"
    assert rerun_command(base, "peers") == base + " --only '' --peers"


def test_generator_command_lines_parse() -> None:
    parser = argparse.ArgumentParser()
    claims.add_arguments(parser)
    args = parser.parse_args(["--only", "ab", "--quick"])
    assert args.only == "ab" and args.quick and args.output_json == "docs/bench/claims.json"
    parser = argparse.ArgumentParser()
    peers.add_arguments(parser)
    args = parser.parse_args(["--hf-static-batch-sizes", "32,64"])
    assert args.num_prompts == 16 and args.max_num_seqs == 8 and args.hf_static_batch_sizes == "32,64"


@pytest.mark.parametrize("module", ["benchmarks.claims", "benchmarks.peers", "benchmarks.spec_decode_ab",
                                    "benchmarks.shared_cpu", "benchmarks.preemption",
                                    "benchmarks.llama_cpp"])
def test_generator_help_runs_from_the_repo_root(module: str) -> None:
    done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout


def test_preemption_workloads_share_a_prefix_only_where_the_table_says() -> None:
    from benchmarks.preemption import WORKLOADS, workload_requests

    for name, (num, _, _, num_kv_blocks, prefix_len) in WORKLOADS.items():
        prompts = [r.prompt_token_ids for r in workload_requests(name)]
        assert len(prompts) == num and all(prompts)
        num_common = next((i for i in range(min(map(len, prompts)))
                           if len({p[i] for p in prompts}) > 1), None)
        assert num_common == prefix_len, name  # the rest of each prompt is its own
        assert num_kv_blocks * 16 >= max(map(len, prompts))  # one prompt fits the pool


def test_a_shape_with_a_smaller_vocabulary_gets_the_tokenizer_cut_to_it(tmp_path: Path) -> None:
    """TinyLlama / Llama 2 shapes (32000 ids) carry the default 49152-token tokenizer cut to their size."""
    from tokenizers import Tokenizer

    from benchmarks.shapes import _cut_vocabulary, save_default_tokenizer

    text = "Hello world, the quick brown fox jumps over the lazy dog 12345"
    save_default_tokenizer(tmp_path)
    full = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert max(full.encode(text).ids) >= 1000
    _cut_vocabulary(tmp_path / "tokenizer.json", 1000)
    cut = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ids = cut.encode(text).ids
    assert cut.get_vocab_size() == 1000 and max(ids) < 1000 and len(ids) > len(full.encode(text).ids)
    assert cut.decode(ids) == text


def test_llama_cpp_cells_re_measured_replace_theirs_and_keep_the_others() -> None:
    from benchmarks.llama_cpp import merged

    cells = [{"shape": "a", "format": "bf16", "v": 1}, {"shape": "a", "format": "q8_0", "v": 2}]
    cells = merged(cells, {"shape": "a", "format": "q8_0", "v": 3})
    assert cells == [{"shape": "a", "format": "bf16", "v": 1}, {"shape": "a", "format": "q8_0", "v": 3}]
    assert merged(cells, {"shape": "b", "format": "bf16", "v": 4})[-1]["shape"] == "b"


def test_llama_cpp_warm_up_prompts_differ_from_the_measured_ones_unless_cached_prompts_asked() -> None:
    from benchmarks.llama_cpp import loads

    args = argparse.Namespace(num_single=2, batch_size=16, input_len=32, output_len=32, cached_prompts=False)
    for warm_up, requests, concurrency in loads(args).values():
        assert len(warm_up) == concurrency and {len(r.prompt_token_ids) for r in warm_up + requests} == {32}
        firsts = {r.prompt_token_ids[:16] for r in requests}  # a 16-token KV block: the prefix cache's unit
        assert not firsts & {r.prompt_token_ids[:16] for r in warm_up}
    args.cached_prompts = True
    for warm_up, requests, concurrency in loads(args).values():
        assert warm_up == requests[:concurrency]


def test_a_cells_decode_share_of_the_roofline_is_cobatchs_median_tpot_and_its_table_shows_it() -> None:
    from benchmarks.llama_cpp import decode_of_roofline, markdown

    runs = {"single": {"runs": [{"tok_s": 30.0, "tpot_ms_p50": 20.0}, {"tok_s": 28.0, "tpot_ms_p50": 30.0}],
                       "tok_s": 29.0}, "batch": {"runs": [], "tok_s": 100.0}}
    cell = {"shape": "a", "format": "q4_0", "roofline_tok_s": 50.0, "single_ratio": 1.5, "batch_ratio": 2.0,
            "servers": {"cobatch": runs, "llama-server": {**runs, "single": {"runs": [], "tok_s": 20.0}}},
            "cobatch_single_of_roofline": 0.58, "llama-server_single_of_roofline": 0.4}
    assert decode_of_roofline(cell) == pytest.approx(0.8)  # 1 / 25 ms = 40 tok/s of 50
    row = markdown([cell]).splitlines()[2].split("|")
    assert [c.strip() for c in row[6:8]] == ["40% / 58%", "80%"]


def test_a_batch_ceiling_counts_prompt_and_output_multiply_adds_at_the_formats_peak(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    from benchmarks.cpu_peak import ComputePeaks
    from benchmarks.llama_cpp import batch_ceiling_tok_s, macs_per_output_token

    path = tmp_path / "tied.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((10, 4), dtype=np.float32))  # the lm_head too: tied
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((8, 4), dtype=np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    # 3 prompt + 2 output tokens: 4 pass the body (32 MACs each), 2 the lm_head (40 each), per output token
    macs = macs_per_output_token(path, input_len=3, output_len=2)
    assert macs == (4 * 32 + 2 * 40) / 2
    peaks = ComputePeaks(int8_macs_per_s=208.0, fp32_macs_per_s=52.0)
    assert batch_ceiling_tok_s("q4_0", macs, peaks) == 2.0 and batch_ceiling_tok_s("bf16", macs, peaks) == 0.5
    with_bf16 = ComputePeaks(int8_macs_per_s=208.0, fp32_macs_per_s=52.0, bf16_macs_per_s=104.0)
    assert batch_ceiling_tok_s("bf16", macs, with_bf16) == 1.0 and batch_ceiling_tok_s("f32", macs, with_bf16) == 0.5
    with_amx = ComputePeaks(int8_macs_per_s=208.0, fp32_macs_per_s=52.0, bf16_macs_per_s=104.0,
                            amx_bf16_macs_per_s=832.0)  # the tile unit's rate is the bf16 one where it is
    assert batch_ceiling_tok_s("bf16", macs, with_amx) == 8.0 and batch_ceiling_tok_s("q8_0", macs, with_amx) == 2.0


def test_an_earlier_cell_keeps_the_ceiling_of_its_own_peaks_unless_reported_again(tmp_path: Path) -> None:
    import argparse

    import gguf
    import numpy as np

    from benchmarks.cpu_peak import ComputePeaks
    from benchmarks.llama_cpp import with_batch_ceilings

    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((10, 4), dtype=np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    servers = {s: {"batch": {"tok_s": 1.0}} for s in ("llama-server", "cobatch")}
    earlier = {"file": "m.gguf", "format": "q4_k_m", "servers": servers, "batch_ceiling_tok_s": 99.0}
    new = {"file": "m.gguf", "format": "q4_k_m", "servers": servers}
    args = argparse.Namespace(work_dir=tmp_path, input_len=1, output_len=1)
    peaks = ComputePeaks(int8_macs_per_s=400.0, fp32_macs_per_s=100.0)
    kept, fresh = with_batch_ceilings([earlier, new], peaks, args)
    assert kept["batch_ceiling_tok_s"] == 99.0
    # 40 MACs an output token (the tied lm_head) at the int8 peak: a llama-quantize mix is quantized
    assert fresh["batch_ceiling_tok_s"] == 10.0 and fresh["peaks"]["int8_macs_per_s"] == 400.0
    again, _ = with_batch_ceilings([earlier, new], peaks, args, keep_earlier=False)
    assert again["batch_ceiling_tok_s"] == 10.0
