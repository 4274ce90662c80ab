"""ModelRunner: owns the model and the paged KV cache; turns a SchedulerOutput into sampled tokens.

One step: swap-out copies, swap-in copies, device block copies, then one forward over the ragged batch (decode
rows first, then prefill rows; see models/attention.py) ending in the final norm of the sampled rows only, their
lm_head, then the sampler.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Sequence

import torch

from cobatch.config import EngineConfig
from cobatch.kernels.attention import load_attention_kernel
from cobatch.kernels.cpu import cpu_flags
from cobatch.kernels.decoder import NativeDecoder
from cobatch.kernels.hugepages import huge_page_zeros
from cobatch.kernels.quant_linear import is_quantized, tune_single_stream, tune_wide_tiles
from cobatch.models.attention import AttentionKernel, AttentionMetadata, PrefillSpan, make_tiles
from cobatch.models.llama import LlamaForCausalLM, scope
from cobatch.models.loader import load_model, release_freed_heap, resolve_model_path
from cobatch.models.model_config import ModelConfig
from cobatch.runner.layer_loop import native_layer_loop
from cobatch.runner.prompt_logprobs import prompt_logprobs as compute_prompt_logprobs
from cobatch.runner.sampler import Sampler
from cobatch.runner.thread_policy import ThreadGovernor
from cobatch.scheduler_output import RunnerOutput, ScheduledRow, SchedulerOutput
from cobatch.structured_output.bitmask import GrammarBitmask

_GIB = 1 << 30
_DEFAULT_KV_CACHE_GIB = 2.0  # 93k bf16 tokens of SmolLM2: 64 sequences of ~1.4k tokens
_DEFAULT_KV_CACHE_SHARE = 0.3  # of the memory available at start-up
# The profiler labels of a step (models/llama.py and execute), in step order.
PROFILE_SCOPES = ("embed+rope_tables", "norm", "qkv_proj+rope", "attention", "o_proj", "mlp", "lm_head")


class ModelRunner:
    """Owns the model, the device KV cache and the host swap pool; executes one scheduled step."""

    def __init__(self, model: LlamaForCausalLM, model_config: ModelConfig, *, num_kv_blocks: int,
                 block_size: int, num_swap_blocks: int = 0, max_model_len: int | None = None,
                 seed: int = 0, native_attention: bool = True,
                 thread_governor: ThreadGovernor | None = None) -> None:
        param = model.norm  # the model's dtype (a quantized embedding table is uint8 blocks)
        if param.device.type == "cpu" and model.pack_linear_weights():  # bf16 and fp32 (kernels/linear.py)
            release_freed_heap()  # the unpacked copies (the native GEMM's layout: kernels/linear.py)
        quantized = [p for p in model.parameters() if is_quantized(p)]
        tune_single_stream(quantized)  # this CPU's faster modes for one stream (per format) and for a batch
        tune_wide_tiles(quantized)
        self.model, self.model_config = model, model_config
        # The layer loop in C where it can run (packed or quantized weights); profiled steps keep the Python loop.
        self.native_decoder: NativeDecoder | None = native_layer_loop(model)
        self.dtype, self.device = param.dtype, param.device
        self.block_size = block_size
        self.num_kv_blocks, self.num_swap_blocks = num_kv_blocks, num_swap_blocks
        self.max_model_len = max_model_len or model_config.max_position_embeddings
        if self.max_model_len > model_config.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={model_config.max_position_embeddings}")
        self.kv_bytes_per_token = kv_bytes_per_token(model_config, self.dtype)
        self.eos_token_ids: tuple[int, ...] = model_config.eos_token_ids
        # One tensor for all layers, so a swap is a single indexed copy: [L, 2 (K/V), blocks, bs, kvh, hd]
        # (inside a block, the attention kernel's element order: models/attention.py).
        # One block more than the scheduler knows of: the sink where padding rows' K/V writes go.
        self.kv_cache = self._allocate_cache(num_kv_blocks + 1, self.device)
        self.scratch_slot = num_kv_blocks * block_size
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(model_config.num_layers)]
        self.swap_cache = self._allocate_cache(num_swap_blocks, torch.device("cpu"))
        self.sampler = Sampler(seed, self.device)
        self.attention_kernel = _attention_kernel(self.dtype, self.device) if native_attention else None
        self.last_timings: dict[str, float] = {}
        self._profiling = False  # set only inside profile_step
        self._timed_decoder: NativeDecoder | None = None  # profile_step's twin of the C layer loop
        self.thread_governor = thread_governor  # the adaptive thread policy (None: threads fixed)

    @classmethod
    def load(cls, config: EngineConfig) -> ModelRunner:
        """Resolve and load the model, pick dtype and threads, size the KV cache and swap pool."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        device = pick_device(config.device)
        dtype = pick_dtype(config.dtype, device)
        model, model_config = load_model(resolve_model_path(config.model), dtype, device, config.quantization)
        bytes_per_block = kv_bytes_per_token(model_config, dtype) * config.block_size
        num_kv_blocks = config.num_kv_blocks or max(1, int(_kv_cache_bytes(config, device) // bytes_per_block))
        num_swap_blocks = int(config.swap_space * _GIB // bytes_per_block)
        governor = (ThreadGovernor.for_this_process(torch.get_num_threads(), torch.set_num_threads)
                    if config.thread_policy == "adaptive" and device.type == "cpu" else None)
        return cls(model, model_config, num_kv_blocks=num_kv_blocks, block_size=config.block_size,
                   num_swap_blocks=num_swap_blocks, max_model_len=config.max_model_len, seed=config.seed,
                   thread_governor=governor)

    @classmethod
    def from_model(cls, model: LlamaForCausalLM, model_config: ModelConfig, num_kv_blocks: int,
                   block_size: int, *, num_swap_blocks: int = 0, max_model_len: int | None = None,
                   seed: int = 0, native_attention: bool = True) -> ModelRunner:
        """A runner around an in-memory model (tests: tiny random models, no files)."""
        return cls(model, model_config, num_kv_blocks=num_kv_blocks, block_size=block_size,
                   num_swap_blocks=num_swap_blocks, max_model_len=max_model_len, seed=seed,
                   native_attention=native_attention)

    def prefault_kv_cache(self) -> None:
        """Touch every page of the KV pool now, so a server's resident memory is model + KV from the start.

        The pool is allocated lazily (pages become resident on first write); a long-running server would
        otherwise grow its RSS for hours as the LRU free list walks the pool. Call before serving only:
        it overwrites the cache.
        """
        for layer in self.kv_cache:  # one layer at a time keeps the memset cache-friendly
            layer.zero_()

    def on_idle(self) -> None:
        """The engine has had nothing to run for a while: the thread policy looks at the machine now,
        so that a neighbour that left while nothing ran does not cost the next requests a thread."""
        if self.thread_governor is not None:
            self.thread_governor.before_step()

    def _allocate_cache(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        c = self.model_config
        shape = (c.num_layers, 2, num_blocks, self.block_size, c.num_kv_heads, c.head_dim)
        # Zeros, not empty: masked-out slots must hold finite values (see models/attention.py).
        if device.type == "cpu" and self.device.type == "cpu":
            return huge_page_zeros(shape, self.dtype)  # lazily zero, on huge pages
        pin = device.type == "cpu"  # host swap pool of a GPU cache: pinned for fast copies
        return torch.zeros(shape, dtype=self.dtype, device=device, pin_memory=pin)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None) -> RunnerOutput:
        """Swap out, swap in, copy blocks, one forward over `out.rows`, sample the rows with needs_sample (their
        logits masked first by `grammar_bitmask`, the constrained rows' structured outputs)."""
        if self.thread_governor is not None:
            self.thread_governor.before_step()  # here: on the thread that runs the step
        copies = {"num_copied_blocks": len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in),
                  "copy_s": self._swap(out.blocks_to_swap_out, out.blocks_to_swap_in)}
        if out.blocks_to_copy:  # after the swaps: a source may be a block swapped in this step
            src, dst = _pair_indices(out.blocks_to_copy)
            self.kv_cache[:, :, dst.to(self.device)] = self.kv_cache[:, :, src.to(self.device)]
        self.last_timings = {"prepare_s": 0.0, "forward_s": 0.0, "lm_head_s": 0.0, "sample_s": 0.0}
        if not out.rows:
            return RunnerOutput((), (), **copies)
        t0 = time.perf_counter()
        batch = prepare_batch(out.rows, self.block_size, self.device, self.attention_kernel, self.scratch_slot)
        t1 = time.perf_counter()
        layer_loop = self.native_decoder if batch.meta.kernel is not None and not self._profiling else None
        hidden = self.model(batch.input_ids, batch.positions, batch.meta, self.kv_caches, self._profiling,
                            *batch.keep(), layer_loop=layer_loop)  # [R + Q, H]: samples, then prompt positions
        num_sampled = hidden.shape[0] - batch.num_prompt_positions
        t2 = time.perf_counter()
        with scope("lm_head", self._profiling):
            logits = self.model.compute_logits(hidden[:num_sampled])  # [R, V] model dtype
        if grammar_bitmask is not None:
            grammar_bitmask.apply(logits)  # one batched op over every constrained row
        t3 = time.perf_counter()
        sampled_rows = [row for row in out.rows for _ in range(row.num_samples)]  # [R]: logits' rows
        result = self.sampler(logits, sampled_rows, self.eos_token_ids) if sampled_rows else None
        prompt_logprobs = (compute_prompt_logprobs(hidden[num_sampled:], out.rows, self.model.compute_logits)
                           if batch.num_prompt_positions else {})
        t4 = time.perf_counter()
        # Disjoint parts of the step (bench offline --profile sums them over a run).
        self.last_timings = {"prepare_s": t1 - t0, "forward_s": t2 - t1, "lm_head_s": t3 - t2,
                             "sample_s": t4 - t3}
        if result is None:
            return RunnerOutput((), (), prompt_logprobs=prompt_logprobs, **copies)
        return RunnerOutput(tuple(result.token_ids), tuple(result.logprobs), prompt_logprobs=prompt_logprobs,
                            **copies)

    def profile_step(self, out: SchedulerOutput) -> dict[str, float]:
        """Execute `out` once, timed by part: seconds per part of the step, summed over layers.

        Parts: prepare (inputs + metadata), norm, qkv_proj+rope, attention (with the K/V write), o_proj,
        mlp, lm_head, sample, and "other" (the forward's time outside those: embedding, Python glue).
        Where the layer loop runs in C (bf16 on the native kernels) its kernels are timed there, by a
        -DKERNEL_TIMERS build of the same code; elsewhere the torch profiler times the labelled parts of
        the Python layer loop (models/llama.py scopes, "embed+rope_tables" too), whose own overhead
        inflates the many small ops.
        """
        decoder = self.native_decoder
        if decoder is not None:
            if self._timed_decoder is None:
                self._timed_decoder = decoder.with_timers()
            if self._timed_decoder is not None:
                return self._profile_native(out, decoder, self._timed_decoder)
        from torch.profiler import ProfilerActivity, profile

        self._profiling = True
        try:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                self.execute(out)
        finally:
            self._profiling = False
        parts = {"prepare": self.last_timings["prepare_s"]}
        labelled = {e.key: e.cpu_time_total / 1e6 for e in prof.key_averages() if e.key in PROFILE_SCOPES}
        parts.update({name: labelled.get(name, 0.0) for name in PROFILE_SCOPES})
        forward_s = self.last_timings["forward_s"] + self.last_timings["lm_head_s"]  # lm_head is labelled too
        parts["other"] = max(0.0, forward_s - sum(labelled.values()))
        parts["sample"] = self.last_timings["sample_s"]
        return parts

    def _profile_native(self, out: SchedulerOutput, decoder: NativeDecoder,
                        timed: NativeDecoder) -> dict[str, float]:
        """profile_step with the C layer loop's kernel timers (timed: decoder's twin with timers)."""
        timed.take_kernel_seconds()  # from zero
        self.native_decoder = timed
        try:
            self.execute(out)
        finally:
            self.native_decoder = decoder
        k, t = timed.take_kernel_seconds(), self.last_timings
        loop = {"norm": k["norm"] + k["post_norm"], "qkv_proj+rope": k["qkv"] + k["rope"],
                "attention": k["write_kv"] + k["attention"], "o_proj": k["o_proj"],
                "mlp": k["gate_up+silu"] + k["down"]}
        other = max(0.0, t["forward_s"] - sum(loop.values()))
        return {"prepare": t["prepare_s"], **loop, "lm_head": t["lm_head_s"], "other": other,
                "sample": t["sample_s"]}

    def _swap(self, swap_out: Sequence[tuple[int, int]], swap_in: Sequence[tuple[int, int]]) -> float:
        """The step's block copies; the seconds they took (preemption_mode auto weighs them)."""
        if not swap_out and not swap_in:
            return 0.0
        start = time.perf_counter()
        # Out first: this step's swap-ins and rows may reuse the device blocks just freed.
        if swap_out:
            dev, host = _pair_indices(swap_out)
            self.swap_cache[:, :, host] = self.kv_cache[:, :, dev.to(self.device)].to("cpu")
        if swap_in:
            host, dev = _pair_indices(swap_in)
            self.kv_cache[:, :, dev.to(self.device)] = self.swap_cache[:, :, host].to(self.device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the copies' time, not their launch
        return time.perf_counter() - start


def _pair_indices(pairs: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    both = torch.tensor(pairs, dtype=torch.int64)  # [N, 2]
    return both[:, 0], both[:, 1]


# ---------------------------------------------------------------------------------------- inputs

class Batch:
    """Flat step inputs: token ids and positions [T], attention metadata, positions to sample [R]."""

    __slots__ = ("input_ids", "positions", "meta", "sample_indices", "sample_tiles", "samples_all_in_order",
                 "num_prompt_positions")

    def __init__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 sample_indices: torch.Tensor, sample_tiles: torch.Tensor | None = None,
                 samples_all_in_order: bool = False, num_prompt_positions: int = 0) -> None:
        self.input_ids, self.positions, self.meta = input_ids, positions, meta
        # [R]: the flat token of each sample, in `rows` order (a row's last num_samples tokens), then
        # the last num_prompt_positions: the tokens whose logits give prompt logprobs
        self.sample_indices = sample_indices
        self.num_prompt_positions = num_prompt_positions
        # [R, 4] (native attention only): each sampled token alone as an attention tile over its row's
        # blocks (row, its index in sample_indices, 1, context): the last layer attends for just these.
        self.sample_tiles = sample_tiles
        # sample_indices is 0 .. T-1 (a plain decode step): the model's output needs no gather
        self.samples_all_in_order = samples_all_in_order

    def keep(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """What the model is asked for (keep, keep_tiles): the sampled rows, or None for all rows in
        order. Why: after the forward every small torch op runs with cold caches, and a
        plain decode step samples every row in order, so its gather would copy the output as it is."""
        return (None, None) if self.samples_all_in_order else (self.sample_indices, self.sample_tiles)


def prepare_batch(rows: Sequence[ScheduledRow], block_size: int, device: torch.device,
                  attention_kernel: AttentionKernel | None = None, scratch_slot: int | None = None) -> Batch:
    """Flatten the rows (decode rows first) and build all attention metadata once for every layer.

    Padding rows (static batching) recompute a position already in the cache, maybe in a prefix-cached
    block other requests share; in bf16 the recomputed K/V can differ in the low bits, so their writes
    go to `scratch_slot` (a block the scheduler never hands out) instead.
    """
    if attention_kernel is not None and all(  # one known token per row (and its drafts): decode
            r.num_new_tokens == 1 + len(r.spec_token_ids) <= attention_kernel.tile_tokens and not r.is_padding
            and r.prompt_logprobs_from is None for r in rows):
        return _prepare_decode(rows, block_size, device, attention_kernel)
    return _prepare_any(rows, block_size, device, attention_kernel, scratch_slot)


def _prepare_any(rows: Sequence[ScheduledRow], block_size: int, device: torch.device,
                 attention_kernel: AttentionKernel | None, scratch_slot: int | None) -> Batch:
    """prepare_batch for any mix of rows, with vectorized torch ops (a prefill step's thousands of tokens)."""
    order = sorted(range(len(rows)), key=lambda i: rows[i].num_new_tokens != 1)  # stable: decode first
    ordered = [rows[i] for i in order]
    num_decode = sum(1 for r in ordered if r.num_new_tokens == 1)
    token_ids: list[int] = []
    for r in ordered:
        assert r.num_new_tokens > 0, f"row {r.request_id} schedules no tokens"
        num_known = r.num_new_tokens - len(r.spec_token_ids)
        token_ids.extend(r.token_ids[r.num_computed_tokens:r.num_computed_tokens + num_known])
        token_ids.extend(r.spec_token_ids)  # speculative drafts follow the known tokens
    starts = torch.tensor([r.num_computed_tokens for r in ordered])  # [R]
    counts = torch.tensor([r.num_new_tokens for r in ordered])  # [R]
    ends = torch.cumsum(counts, 0)  # [R]: one past each row's last token in the flat batch
    row_of_token = torch.repeat_interleave(torch.arange(len(ordered)), counts)  # [T]
    positions = starts[row_of_token] + torch.arange(len(token_ids)) - (ends - counts)[row_of_token]  # [T]
    block_tables = _padded_block_tables(ordered, block_size)  # [R, max_blocks]
    slot_mapping = block_tables[row_of_token, positions // block_size] * block_size + positions % block_size
    is_padding = torch.tensor([r.is_padding for r in ordered])  # [R]
    if scratch_slot is not None and bool(is_padding.any()):
        slot_mapping = slot_mapping.masked_fill(is_padding[row_of_token], scratch_slot)  # [T]
    has_padding = any(r.is_padding for r in ordered)  # their K/V go to the scratch slot: written apart
    meta = AttentionMetadata(slot_mapping=slot_mapping.to(device), num_decode_tokens=num_decode,
                             num_own_writes=0 if has_padding else num_decode)
    if attention_kernel is not None:
        meta.kernel = attention_kernel
        meta.block_tables = block_tables.to(device)
        meta.tiles = make_tiles(starts, counts, attention_kernel.tile_tokens).to(device)  # [N, 4]
    else:
        _add_torch_metadata(meta, block_tables, starts, counts, ends, block_size, device)
    # One entry per sampled position, in `rows` order: a row samples its last num_samples tokens (one,
    # or its last known token and each draft of a speculative row); then, in `rows` order too, the
    # positions whose logits give prompt logprobs (runner/prompt_logprobs.py).
    position_in_order = {row_index: k for k, row_index in enumerate(order)}
    sampled = [position_in_order[i] for i, r in enumerate(rows) for _ in range(r.num_samples)]
    positions_kept = [r.num_computed_tokens + r.num_new_tokens - r.num_samples + j
                      for r in rows for j in range(r.num_samples)]
    num_prompt = 0
    for i, r in enumerate(rows):
        scored = r.prompt_logprob_positions
        sampled += [position_in_order[i]] * len(scored)
        positions_kept += scored
        num_prompt += len(scored)
    kept_row = torch.tensor(sampled, dtype=torch.int64)  # [S + Q]: the ordered row of each kept token
    context = torch.tensor(positions_kept, dtype=torch.int64) + 1  # [S + Q]: its position + 1
    sample_tiles = None
    if attention_kernel is not None:
        sample_tiles = torch.stack([kept_row, torch.arange(len(sampled)), torch.ones_like(kept_row), context],
                                   dim=1).to(device)
    flat = ends[kept_row] - counts[kept_row] + context - 1 - starts[kept_row]  # [S + Q]
    return Batch(torch.tensor(token_ids, device=device), positions.to(device), meta, flat.to(device),
                 sample_tiles, num_prompt_positions=num_prompt)


def _prepare_decode(rows: Sequence[ScheduledRow], block_size: int, device: torch.device,
                    attention_kernel: AttentionKernel) -> Batch:
    """prepare_batch for a step of decode rows only (no padding; each maybe with speculative drafts),
    native attention: the same tensors as _prepare_any, built from Python lists in one pass. Why: the
    general path's ~20 small torch ops, each on cold caches after the forward, cost more than the lists
    on every decode step."""
    order = sorted(range(len(rows)), key=lambda i: rows[i].num_new_tokens != 1)  # as _prepare_any orders
    ordered_row = {i: k for k, i in enumerate(order)}
    token_ids, positions, slots, tables, tiles, flat_start = [], [], [], [], [], {}
    width = max((r.num_computed_tokens + r.num_new_tokens - 1) // block_size + 1 for r in rows)
    for k, i in enumerate(order):
        r = rows[i]
        first, last = r.num_computed_tokens, r.num_computed_tokens + r.num_new_tokens - 1  # positions fed
        assert len(r.block_table) > last // block_size, f"row {r.request_id}: block table shorter than its tokens"
        flat_start[i] = len(token_ids)
        tiles.append((k, len(token_ids), r.num_new_tokens, first + 1))
        token_ids.append(r.token_ids[first])
        token_ids.extend(r.spec_token_ids)
        for position in range(first, last + 1):
            positions.append(position)
            slots.append(r.block_table[position // block_size] * block_size + position % block_size)
        tables.append(r.block_table[:last // block_size + 1] + [0] * (width - last // block_size - 1))
    sampled, sample_tiles = [], []
    for i, r in enumerate(rows):  # samples in `rows` order: a row's last num_samples positions
        end = flat_start[i] + r.num_new_tokens
        for flat in range(end - r.num_samples, end):
            sample_tiles.append((ordered_row[i], len(sampled), 1, positions[flat] + 1))
            sampled.append(flat)
    meta = AttentionMetadata(slot_mapping=_ints(slots, device),
                             num_decode_tokens=sum(1 for r in rows if r.num_new_tokens == 1))
    meta.num_own_writes = meta.num_decode_tokens  # the one-token rows, first (no padding here)
    meta.kernel = attention_kernel
    meta.block_tables, meta.tiles = _ints(tables, device), _ints(tiles, device)
    return Batch(_ints(token_ids, device), _ints(positions, device), meta, _ints(sampled, device),
                 _ints(sample_tiles, device).view(-1, 4), samples_all_in_order=sampled == list(range(len(token_ids))))


def _ints(values: list, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _padded_block_tables(rows: Sequence[ScheduledRow], block_size: int) -> torch.Tensor:
    """Each row's blocks up to its last new token, padded with block 0 (masked out): [R, max_blocks]."""
    needed = [-(-(r.num_computed_tokens + r.num_new_tokens) // block_size) for r in rows]
    width = max(needed)
    tables = []
    for r, n in zip(rows, needed):
        assert len(r.block_table) >= n, f"row {r.request_id}: block table shorter than its tokens"
        tables.append(r.block_table[:n] + [0] * (width - n))
    return torch.tensor(tables, dtype=torch.int64)


def _add_torch_metadata(meta: AttentionMetadata, block_tables: torch.Tensor, starts: torch.Tensor,
                        counts: torch.Tensor, ends: torch.Tensor, block_size: int, device: torch.device) -> None:
    """The torch path's metadata: batched decode rows, then one span per prefill row."""
    num_decode = meta.num_decode_tokens
    if num_decode:
        _add_decode_metadata(meta, block_tables[:num_decode], starts[:num_decode] + 1, block_size, device)
    for j in range(num_decode, len(counts)):
        meta.prefills.append(_prefill_span(block_tables[j], int(starts[j]), int(counts[j]), int(ends[j]),
                                           block_size, device))


def _add_decode_metadata(meta: AttentionMetadata, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                         block_size: int, device: torch.device) -> None:
    num_blocks = -(-int(seq_lens.max()) // block_size)
    meta.decode_block_tables = block_tables[:, :num_blocks].contiguous().to(device)  # [D, nb]
    slots = torch.arange(num_blocks * block_size)
    beyond = slots[None, :] >= seq_lens[:, None]  # [D, ctx]
    mask = torch.zeros(beyond.shape).masked_fill_(beyond, float("-inf"))
    meta.decode_mask = mask.unsqueeze(1).to(device)  # [D, 1, ctx] fp32 additive


def _prefill_span(block_table: torch.Tensor, num_computed: int, num_new: int, end: int, block_size: int,
                  device: torch.device) -> PrefillSpan:
    span = PrefillSpan(start=end - num_new, end=end)
    if num_computed == 0:
        return span  # fresh prompt: plain causal attention over its own new K/V
    context = torch.arange(num_computed + num_new)  # [ctx]
    span.context_slots = (block_table[context // block_size] * block_size + context % block_size).to(device)
    query_pos = torch.arange(num_computed, num_computed + num_new)  # [n]
    span.mask = (context[None, :] <= query_pos[:, None])[None, None].to(device)  # [1, 1, n, ctx]
    return span


# ---------------------------------------------------------------------------------- device, dtype

def _attention_kernel(dtype: torch.dtype, device: torch.device) -> AttentionKernel | None:
    """The native paged-attention kernel where it is built and handles this dtype and device."""
    kernel = load_attention_kernel()
    return kernel if kernel is not None and kernel.supports(dtype, device) else None


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """KV cache bytes one token takes across all layers (K and V)."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize


def pick_device(name: str) -> torch.device:
    """'auto' -> CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' -> bf16 on CUDA or on a CPU with native bf16 matmuls (AVX512-BF16 / AMX), else fp32."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda" or cpu_has_fast_bf16():
        return torch.bfloat16
    return torch.float32


def cpu_has_fast_bf16() -> bool:
    """True when oneDNN can run bf16 matmuls natively on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    if "AVX512" not in torch.backends.cpu.get_cpu_capability():
        return False
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _kv_cache_bytes(config: EngineConfig, device: torch.device) -> float:
    """Explicit kv_cache_memory_gb, else min(2 GiB, 30% of the memory available now)."""
    if config.kv_cache_memory_gb is not None:
        return config.kv_cache_memory_gb * _GIB
    return min(_DEFAULT_KV_CACHE_GIB * _GIB, _DEFAULT_KV_CACHE_SHARE * _available_bytes(device))


def _available_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
