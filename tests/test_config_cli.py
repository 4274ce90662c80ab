"""Every command's engine flags are EngineConfig's fields (config_cli): one flag per field, EngineConfig's
default, and parse -> EngineConfig round-trips; SchedulerConfig takes the shared options as they are."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from cobatch.bench.cli import COMMANDS
from cobatch.cli import build_parser
from cobatch.config import EngineConfig, SchedulingOptions
from cobatch.config_cli import engine_config_from_args, flag_name
from cobatch.server.cli import engine_config_from_args as serve_config_from_args

NOT_ENGINE = {"serve"}  # bench serve: the HTTP load generator, no engine of its own

# A value other than the default for every field (a new field must be added here).
NON_DEFAULT: dict[str, object] = {
    "block_size": 32, "max_num_seqs": 7, "enable_chunked_prefill": False, "enable_prefix_caching": False,
    "batching": "static", "scheduling_policy": "priority", "preemption_mode": "swap", "tpot_slo_ms": 55.5,
    "num_speculative_tokens": 3, "ngram_prompt_lookup_min": 3, "ngram_prompt_lookup_max": 5,
    "model": "some/model.gguf", "dtype": "bfloat16", "device": "cpu", "quantization": "q8_0", "num_kv_blocks": 123,
    "kv_cache_memory_gb": 1.5, "swap_space": 0.25, "max_num_batched_tokens": 4096, "max_model_len": 1024,
    "seed": 9, "num_threads": 2, "thread_policy": "fixed",
}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _engine_commands() -> dict[str, argparse.ArgumentParser]:
    """serve, generate, chat and every engine-driving bench sub-command -> its parser."""
    top = _subparsers(build_parser())
    bench = _subparsers(top["bench"])
    return {**{name: top[name] for name in ("serve", "generate", "chat")},
            **{f"bench {name}": bench[name] for name in COMMANDS if name not in NOT_ENGINE}}


PARSERS = _engine_commands()


def _argv(values: dict[str, object]) -> list[str]:
    argv: list[str] = []
    for name, value in values.items():
        if isinstance(value, bool):
            argv.append(flag_name(name) if value else "--no-" + flag_name(name)[2:])
        else:
            argv += [flag_name(name), str(value)]
    return argv


def test_the_non_default_values_cover_every_field() -> None:
    defaults = {f.name: f.default for f in fields(EngineConfig)}
    assert set(NON_DEFAULT) == set(defaults)
    assert all(NON_DEFAULT[name] != default for name, default in defaults.items())


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_every_engine_field_is_a_flag_with_the_same_default(command: str) -> None:
    parser = PARSERS[command]
    actions = {a.dest: a for a in parser._actions}
    for f in fields(EngineConfig):
        assert f.name in actions and flag_name(f.name) in actions[f.name].option_strings, \
            f"{command} has no {flag_name(f.name)}"
        assert parser.get_default(f.name) == f.default, f"{command} {flag_name(f.name)}"
        assert actions[f.name].help, f"{command} {flag_name(f.name)} has no help"


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_parsed_flags_round_trip_to_engine_config(command: str) -> None:
    args = build_parser().parse_args(command.split() + _argv(NON_DEFAULT))
    to_config = serve_config_from_args if command == "serve" else engine_config_from_args
    assert to_config(args) == EngineConfig(**NON_DEFAULT)  # type: ignore[arg-type]
    assert engine_config_from_args(build_parser().parse_args(command.split())) == EngineConfig()


def test_serve_takes_the_model_positionally_too() -> None:
    args = build_parser().parse_args(["serve", "my/model.gguf"])
    assert serve_config_from_args(args).model == "my/model.gguf"


def test_bad_values_fail_in_engine_config() -> None:
    args = build_parser().parse_args(["generate", "--max-num-seqs", "0"])
    with pytest.raises(ValueError, match="max_num_seqs must be positive"):
        engine_config_from_args(args)
    with pytest.raises(SystemExit):  # a Literal field's choices
        build_parser().parse_args(["generate", "--batching", "dynamic"])


def test_scheduler_config_takes_the_shared_options_as_they_are() -> None:
    config = EngineConfig(**{k: v for k, v in NON_DEFAULT.items()  # type: ignore[arg-type]
                             if k != "max_num_batched_tokens"})
    sched = config.scheduler_config(num_kv_blocks=100, num_swap_blocks=5, max_model_len=1024)
    for f in fields(SchedulingOptions):
        assert getattr(sched, f.name) == getattr(config, f.name), f.name
    assert (sched.num_kv_blocks, sched.num_swap_blocks, sched.max_model_len) == (100, 5, 1024)
    assert sched.max_num_batched_tokens == 2048  # the default budget (chunked prefill off, 1024 <= 2048)


def test_a_model_longer_than_the_kv_cache_is_served_at_its_length_unless_asked_for(caplog) -> None:
    kv_cache_tokens = 64 * EngineConfig().block_size
    with caplog.at_level("WARNING", logger="cobatch.config"):
        sched = EngineConfig().scheduler_config(num_kv_blocks=64, num_swap_blocks=0, max_model_len=131072)
    assert sched.max_model_len == kv_cache_tokens and "do not fit the KV cache" in caplog.text
    fits = EngineConfig().scheduler_config(num_kv_blocks=64, num_swap_blocks=0, max_model_len=512)
    assert fits.max_model_len == 512
    asked = EngineConfig(max_model_len=131072)  # an explicit length the cache cannot hold stays an error
    with pytest.raises(ValueError, match="raise the KV cache size or lower max_model_len"):
        asked.scheduler_config(num_kv_blocks=64, num_swap_blocks=0, max_model_len=131072)
