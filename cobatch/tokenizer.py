"""Tokenizer wrapper (HF folder or GGUF file), streaming detokenization, and stop strings.

Imports transformers but no torch-heavy part of cobatch, so the server can use it directly.
`TextStream` is the one place a sequence's tokens become text, for the offline facade and the server.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from cobatch import tokenizer_cache
from cobatch.model_paths import is_gguf, resolve_model_path
from cobatch.outputs import RequestDelta
from cobatch.sampling_params import SamplingParams

_DETOKENIZE_CONTEXT = 5  # prompt tokens kept as context so the first outputs get their spaces right
# GGUF architectures whose tokenizer transformers refuses to read ("not supported yet"), and the one whose
# reading theirs is: their tokenizer.ggml.* keys are llama's (SentencePiece, or GPT-2 BPE as in Llama 3).
_GGUF_TOKENIZER_ALIASES = {"smollm3": "llama"}


class Tokenizer:
    """An HF tokenizer plus the model's EOS ids and chat template, loaded from a folder or a GGUF file."""

    def __init__(self, hf_tokenizer: object, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.hf = hf_tokenizer
        own_eos = getattr(hf_tokenizer, "eos_token_id", None)
        ids = ([] if own_eos is None else [int(own_eos)]) + list(eos_token_ids)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))

    @classmethod
    def load(cls, model: str | Path | None = None) -> Tokenizer:
        """Load the tokenizer of `model` (None: the default model); a GGUF file's takes seconds the first time
        (tokenizer_cache)."""
        from transformers import AutoTokenizer

        path = resolve_model_path(None if model is None else str(model))
        if not is_gguf(path):
            return cls(AutoTokenizer.from_pretrained(path), _generation_eos(path))
        hf = tokenizer_cache.load_cached(path)
        if hf is None:
            hf = _gguf_hf_tokenizer(path)
            if not getattr(hf, "chat_template", None):
                hf.chat_template = _gguf_chat_template(path)
            tokenizer_cache.keep(path, hf)
        return cls(hf)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return len(self.hf)  # type: ignore[arg-type]

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> token ids (with BOS when the tokenizer adds one and add_special_tokens)."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))  # type: ignore[attr-defined]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Token ids -> text."""
        return str(self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens))  # type: ignore[attr-defined]

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """Token ids -> their vocabulary strings (for logprob display)."""
        return list(self.hf.convert_ids_to_tokens(list(ids)))  # type: ignore[attr-defined]

    def apply_chat_template(self, messages: Sequence[Mapping[str, object]],
                            add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, object]] | None = None) -> list[int]:
        """Chat messages (and the tools the model may call) -> prompt token ids, through the model's
        own template (a template that ignores `tools` renders none: see server/tool_format.py)."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template: use a plain completion prompt")
        text = self.hf.apply_chat_template(  # type: ignore[attr-defined]
            [dict(m) for m in messages], add_generation_prompt=add_generation_prompt, tokenize=False,
            tools=None if tools is None else [dict(t) for t in tools])
        # The template writes its own special tokens (BOS, <|im_start|>, ...): don't add them twice.
        return self.encode(str(text), add_special_tokens=False)


def _generation_eos(path: Path) -> tuple[int, ...]:
    gen = path / "generation_config.json"
    if not gen.exists():
        return ()
    eos = json.loads(gen.read_text()).get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


def _gguf_hf_tokenizer(path: Path) -> object:
    """transformers' tokenizer of a GGUF file; for an architecture it does not read (_GGUF_TOKENIZER_ALIASES),
    read from a copy of the file's metadata (no tensors) under the alias's architecture. transformers is
    asked first: gguf-py's reader takes seconds on a large vocabulary (~4.5 s at 128k tokens here), so the
    file's architecture is read only when transformers refuses it."""
    import gguf
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except ValueError as exc:
        if "is not supported" not in str(exc):
            raise
        refused = exc
    reader = gguf.GGUFReader(path)
    alias = _GGUF_TOKENIZER_ALIASES.get(str(reader.fields["general.architecture"].contents()))
    if alias is None:
        raise refused
    with tempfile.TemporaryDirectory() as tmp:
        _write_metadata_as(reader, Path(tmp) / "metadata.gguf", alias)
        return AutoTokenizer.from_pretrained(tmp, gguf_file="metadata.gguf")


def write_metadata_as(path: Path, out: Path, architecture: str) -> None:
    """A GGUF file holding `path`'s metadata and no tensors, its architecture (and the keys named after it)
    renamed to `architecture`."""
    import gguf

    _write_metadata_as(gguf.GGUFReader(path), out, architecture)


def _write_metadata_as(reader: object, out: Path, architecture: str) -> None:
    """write_metadata_as from a gguf.GGUFReader already open."""
    import gguf

    fields = reader.fields  # type: ignore[attr-defined]
    old = str(fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(out), architecture)
    for key, field in fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the header's own, and what the writer was given
        name = architecture + key[len(old):] if key.startswith(old + ".") else key
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def _gguf_chat_template(path: Path) -> str | None:
    import gguf

    field = gguf.GGUFReader(path).fields.get("tokenizer.chat_template")
    return None if field is None else str(field.contents())


class IncrementalDetokenizer:
    """Streams text from token ids; multi-byte characters split over tokens are held until complete.

    The prefix/read offset technique: decode a short window ending at the new tokens, and emit what it
    adds beyond the window's already-emitted part, unless it ends in an incomplete character ("\\ufffd").

        ids:  [ ... | prefix_offset ... read_offset | new tokens ]
                      decoded for context, emitted    decoded and emitted now
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-_DETOKENIZE_CONTEXT:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.text = ""  # everything emitted so far

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add generated tokens; return the newly completed text (possibly empty)."""
        self.ids.extend(new_token_ids)
        delta = self._pending_text()
        if not delta or delta.endswith("\ufffd"):
            return ""  # nothing new, or a character whose remaining bytes are still to come
        return self._emit(delta)

    def flush(self) -> str:
        """At the end of the stream: emit whatever is held back, even an incomplete character."""
        return self._emit(self._pending_text())

    def _pending_text(self) -> str:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        return full[len(prefix):] if len(full) > len(prefix) else ""

    def _emit(self, delta: str) -> str:
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


class StopChecker:
    """Finds stop strings in streamed text; holds back a tail that could be the start of one.

    `process(delta)` returns (text safe to emit, stopped). On a hit the text ends just before the stop
    string (or just after it with include_stop_str_in_output) and nothing more is emitted.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = tuple(s for s in stop if s)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.held = ""  # the text's tail that might grow into a stop string
        self.stopped = False
        self.hit: str | None = None  # the stop string found (the OpenAI/vLLM stop_reason)

    def process(self, delta: str) -> tuple[str, bool]:
        """Feed newly detokenized text; returns (emit, stopped)."""
        if self.stopped:
            return "", True
        if not self.stop:
            return delta, False
        text = self.held + delta
        hit = self._first_hit(text)
        if hit is not None:
            index, stop = hit
            self.held, self.stopped, self.hit = "", True, stop
            return text[:index + len(stop) if self.include_stop_str_in_output else index], True
        keep = self._partial_tail_length(text)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """At the end of the stream without a hit: the held-back tail is plain text after all."""
        held, self.held = self.held, ""
        return "" if self.stopped else held

    def _first_hit(self, text: str) -> tuple[int, str] | None:
        hits = [(i, s) for s in self.stop if (i := text.find(s)) >= 0]
        return min(hits, key=lambda h: (h[0], -len(h[1]))) if hits else None

    def _partial_tail_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best


@dataclass(frozen=True, slots=True)
class TextDelta:
    """What one engine delta adds to a sequence's text, and how the sequence ended (if it did)."""

    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # The stop string that ended the text while the engine still generates: the caller stops it.
    engine_stop: str | None = None


class TextStream:
    """One sequence's text: incremental detokenization, then stop strings (partial matches held).

    A stop string found in the text finishes the sequence with finish_reason "stop" and the string as
    stop_reason; text held back (an incomplete character, a partial stop string) is flushed at the end.
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams,
                 prompt_token_ids: Sequence[int]) -> None:
        # The prompt's tail is decoding context: the first token's leading space comes out right.
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                                  params.skip_special_tokens)
        self.stop_checker = StopChecker(params.stop, params.include_stop_str_in_output)
        self.is_finished = False

    def add(self, delta: RequestDelta) -> TextDelta:
        """Fold one delta in; after the finish (or a stop string) later deltas add nothing."""
        if self.is_finished:
            return TextDelta("")  # tokens the engine made before our stop reached it: dropped
        text = self.detokenizer.step(delta.new_token_ids)
        if delta.finished:
            text += self.detokenizer.flush()
        emit, stopped = self.stop_checker.process(text)
        if stopped:
            self.is_finished = True
            hit = self.stop_checker.hit
            return TextDelta(emit, "stop", hit, engine_stop=None if delta.finished else hit)
        if not delta.finished:
            return TextDelta(emit)
        self.is_finished = True
        return TextDelta(emit + self.stop_checker.flush(), delta.finish_reason, delta.stop_reason)
