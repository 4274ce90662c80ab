"""Benchmark workloads: seeded synthetic length distributions, presets, and JSONL files.

A length spec is one or more inclusive ranges, e.g. "64-256" or "8-32,128-256". With several ranges the
requests are split evenly between them (round-robin, then shuffled), so "8-32,128-256" is exactly half
short and half long: a bimodal, high-variance output distribution. Within a range lengths are uniform.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

# Common short English words: nearly every BPE tokenizer maps each (with its leading space) to one token,
# so a prompt of N words is close to N tokens on any server.
_WORDS = ("the of and to in is it you that he was for on are with as his they be at one have this "
          "from or had by hot word but what some we can out other were all there when up use your how "
          "said an each she which do their time if will way about many then them write would like so "
          "these her long make thing see him two has look more day could go come did number sound no "
          "most people my over know water than call first who may down side been now find").split()


@dataclass(frozen=True, slots=True)
class LengthSpec:
    """Inclusive length ranges; requests are split evenly between them, uniform within each."""

    ranges: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if not self.ranges:
            raise ValueError("a length spec needs at least one range")
        for low, high in self.ranges:
            if not 1 <= low <= high:
                raise ValueError(f"bad length range {low}-{high}: need 1 <= low <= high")

    @classmethod
    def parse(cls, text: str) -> LengthSpec:
        """'128' or '64-256' or '8-32,128-256'."""
        ranges = []
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            ranges.append((int(low), int(high or low)))
        return cls(tuple(ranges))

    def sample(self, num: int, rng: random.Random) -> list[int]:
        """`num` lengths: range i % len(ranges) for request i, then shuffled."""
        lengths = [rng.randint(*self.ranges[i % len(self.ranges)]) for i in range(num)]
        rng.shuffle(lengths)
        return lengths

    @property
    def max_len(self) -> int:
        return max(high for _, high in self.ranges)

    def __str__(self) -> str:
        return ",".join(f"{lo}-{hi}" if lo != hi else str(lo) for lo, hi in self.ranges)


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One benchmark request: token ids (engine, servers that accept them) and/or text, and its output length."""

    max_tokens: int
    prompt_token_ids: tuple[int, ...] | None = None
    prompt: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        """Exact for token ids; the word count (about one token per word) for synthetic text."""
        if self.prompt_token_ids is not None:
            return len(self.prompt_token_ids)
        return len((self.prompt or "").split())


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """A seeded synthetic workload."""

    num_requests: int
    input_len: LengthSpec
    output_len: LengthSpec
    seed: int = 0
    token_id_range: tuple[int, int] = (1000, 30000)  # ordinary vocabulary of common tokenizers

    def with_overrides(self, num_requests: int | None = None, input_len: str | None = None,
                       output_len: str | None = None, seed: int | None = None) -> WorkloadSpec:
        """A copy with the given fields replaced (CLI flags over a preset)."""
        return replace(
            self,
            num_requests=num_requests if num_requests is not None else self.num_requests,
            input_len=LengthSpec.parse(input_len) if input_len else self.input_len,
            output_len=LengthSpec.parse(output_len) if output_len else self.output_len,
            seed=seed if seed is not None else self.seed)


PRESETS: dict[str, WorkloadSpec] = {
    # Wide output spread: what chat traffic looks like; static batching suffers most here.
    "chat": WorkloadSpec(64, LengthSpec(((64, 256),)), LengthSpec(((16, 384),))),
    # Short narrow outputs: a batch's members end nearly together; static batching loses little.
    "classify": WorkloadSpec(64, LengthSpec(((64, 256),)), LengthSpec(((4, 8),))),
    # Issue 5's workload: half short (8-32), half long (128-256) outputs, prompts 64-256.
    "mixed64": WorkloadSpec(64, LengthSpec(((64, 256),)), LengthSpec(((8, 32), (128, 256)))),
}


def preset(name: str) -> WorkloadSpec:
    """A named preset; ValueError lists the names."""
    if name not in PRESETS:
        raise ValueError(f"unknown workload {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def synthesize(spec: WorkloadSpec, as_text: bool = False) -> list[BenchRequest]:
    """The workload's requests: random token ids, or random common words when `as_text`."""
    rng = random.Random(spec.seed)
    inputs = spec.input_len.sample(spec.num_requests, rng)
    outputs = spec.output_len.sample(spec.num_requests, rng)
    requests = []
    for num_in, num_out in zip(inputs, outputs):
        if as_text:
            requests.append(BenchRequest(num_out, prompt=" ".join(rng.choices(_WORDS, k=num_in))))
        else:
            low, high = spec.token_id_range
            ids = tuple(rng.randrange(low, high) for _ in range(num_in))
            requests.append(BenchRequest(num_out, prompt_token_ids=ids))
    return requests


def load_jsonl(path: str | Path, default_max_tokens: int = 128) -> list[BenchRequest]:
    """Lines of {"prompt": str | "prompt_token_ids": [int], "max_tokens": int}."""
    requests = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        item = json.loads(line)
        ids = item.get("prompt_token_ids")
        if ids is None and not isinstance(item.get("prompt"), str):
            raise ValueError(f"{path}:{number}: needs 'prompt' (string) or 'prompt_token_ids'")
        requests.append(BenchRequest(
            int(item.get("max_tokens", default_max_tokens)),
            prompt_token_ids=tuple(int(t) for t in ids) if ids is not None else None,
            prompt=item.get("prompt")))
    return requests


def write_jsonl(requests: list[BenchRequest], path: str | Path) -> None:
    """Save a workload so another tool (or server) can replay exactly the same requests."""
    lines = []
    for r in requests:
        item: dict = {"max_tokens": r.max_tokens}
        if r.prompt_token_ids is not None:
            item["prompt_token_ids"] = list(r.prompt_token_ids)
        if r.prompt is not None:
            item["prompt"] = r.prompt
        lines.append(json.dumps(item))
    Path(path).write_text("\n".join(lines) + "\n")


def output_length_cv(requests: list[BenchRequest]) -> float:
    """Coefficient of variation of the output lengths: the variance the static-vs-continuous gap grows with."""
    lengths = [r.max_tokens for r in requests]
    mean = sum(lengths) / len(lengths)
    var = sum((x - mean) ** 2 for x in lengths) / len(lengths)
    return var ** 0.5 / mean if mean else 0.0
