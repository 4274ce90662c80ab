"""Tokenizer wrapper, streaming detokenization and stop strings (the default model's tokenizer)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from cobatch import tokenizer_cache
from cobatch.model_paths import resolve_model_path
from cobatch.outputs import RequestDelta
from cobatch.sampling_params import SamplingParams
from cobatch.tokenizer import IncrementalDetokenizer, StopChecker, TextDelta, TextStream, Tokenizer, write_metadata_as

TEXT = "Héllo wörld 🤗🎉 世界! naïve café — ok 👩‍👩‍👧 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.load(None)


def _stream(tok: Tokenizer, ids: list[int], prompt: list[int] = ()) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    return [detok.step([i]) for i in ids] + [detok.flush()]


def test_incremental_equals_full_decode_with_multibyte(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)
    deltas = _stream(tok, ids, prompt=tok.encode("Say:"))
    assert "".join(deltas) == tok.decode(ids) == TEXT
    assert not any("\ufffd" in d for d in deltas)  # never a half character
    assert "" in deltas  # some emoji really were split over tokens and held back


def test_incremental_skips_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("Hi there", add_special_tokens=False) + [tok.eos_token_ids[0]]
    assert "".join(_stream(tok, ids)) == "Hi there"


def test_chat_template_of_default_model(tok: Tokenizer) -> None:
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert ids.count(1) == 3  # <|im_start|> once per turn, not doubled by add_special_tokens
    assert tok.has_chat_template and tok.eos_token_ids == (2,) and tok.vocab_size == 49152
    assert tok.convert_ids_to_tokens(tok.encode("Hello", add_special_tokens=False)) == ["Hello"]


def test_missing_chat_template_is_a_value_error(tok: Tokenizer) -> None:
    bare = Tokenizer(tok.hf)
    saved, tok.hf.chat_template = tok.hf.chat_template, None
    try:
        with pytest.raises(ValueError, match="no chat template"):
            bare.apply_chat_template([{"role": "user", "content": "hi"}])
    finally:
        tok.hf.chat_template = saved


def _feed(checker: StopChecker, pieces: list[str]) -> tuple[str, bool]:
    out, stopped = "", False
    for piece in pieces:
        emitted, stopped = checker.process(piece)
        out += emitted
        if stopped:
            return out, True
    return out + checker.flush(), False


@pytest.mark.parametrize("pieces", [["Hello ST", "OP there"], ["Hello S", "T", "O", "P"], ["Hello STOP"],
                                    ["Hel", "lo", " ", "STOP", "x"]])
def test_stop_string_split_across_tokens_never_leaks(pieces: list[str]) -> None:
    checker = StopChecker(["STOP"])
    emitted: list[str] = []
    for piece in pieces:
        out, stopped = checker.process(piece)
        emitted.append(out)
        if stopped:
            break
    assert stopped and "".join(emitted) == "Hello "
    assert all("S" not in e for e in emitted)  # not even a partial stop string went out


def test_stop_string_included_when_asked() -> None:
    assert _feed(StopChecker(["</s>", "END"], include_stop_str_in_output=True), ["a</", "s>b"]) == ("a</s>", True)


def test_earliest_stop_string_wins() -> None:
    assert _feed(StopChecker(["world", "lo w"]), ["hello world"]) == ("hel", True)


def test_false_partial_match_is_released() -> None:
    checker = StopChecker(["STOP"])
    assert checker.process("go ST") == ("go ", False)
    assert checker.process("ART") == ("START", False)
    assert _feed(StopChecker(["STOP"]), ["end ST"]) == ("end ST", False)  # flushed at the end


def test_no_stop_strings_is_pass_through() -> None:
    assert StopChecker([]).process("anything") == ("anything", False)


def _delta(ids: list[int], finish_reason: str | None = None, stop_reason: int | None = None) -> RequestDelta:
    return RequestDelta("r-0", "r", 0, tuple(ids), (), 1, len(ids), finish_reason, stop_reason)


def test_text_stream_holds_a_stop_string_split_over_tokens(tok: Tokenizer) -> None:
    stream = TextStream(tok, SamplingParams(stop=["STOP"]), tok.encode("Say:"))
    pieces = [stream.add(_delta(tok.encode(t, add_special_tokens=False))) for t in ("Hi S", "TO", "P x")]
    assert "".join(p.text for p in pieces) == "Hi "
    assert [p.finish_reason for p in pieces] == [None, None, "stop"]
    assert pieces[-1].stop_reason == pieces[-1].engine_stop == "STOP"  # the engine must be told
    assert stream.is_finished and stream.add(_delta([5], "length")) == TextDelta("")


def test_text_stream_flushes_at_the_finish(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🤗 ST", add_special_tokens=False)
    stream = TextStream(tok, SamplingParams(stop=["STOP"], include_stop_str_in_output=True), [])
    texts = [stream.add(_delta([i])) for i in ids[:-1]] + [stream.add(_delta(ids[-1:], "stop", 2))]
    assert "".join(t.text for t in texts) == "ok 🤗 ST"  # the partial stop string was plain text
    assert (texts[-1].finish_reason, texts[-1].stop_reason, texts[-1].engine_stop) == ("stop", 2, None)


def test_text_stream_keeps_the_stop_string_when_asked_and_finishing(tok: Tokenizer) -> None:
    stream = TextStream(tok, SamplingParams(stop=["END"], include_stop_str_in_output=True), [])
    text = stream.add(_delta(tok.encode("a END b", add_special_tokens=False), "length"))
    assert text == TextDelta("a END", "stop", "END")  # the engine finished anyway: nothing to stop


# ---- the GGUF tokenizer against the GGUF's own vocabulary ----------------------------------------
# transformers builds the default model's tokenizer from the GGUF file (pyproject.toml's lower bound
# of transformers rests on this): checked against a byte-level BPE written here from the file's own
# tokens and merges, and the chat template rendered from the file's own template string.

GGUF_STRINGS = ["Hello world", "  two  spaces\tand\nnew lines ", "naïve café — ok 🤗 世界",
                "x=3.14159; in 2024 we'll see", "<|im_start|>user\nhi<|im_end|>\n"]
# llama.cpp's "smollm" pre-tokenizer: digits one by one, then GPT-2's split
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_CONTROL = 3  # gguf token_type of a special (control) token


@dataclass(frozen=True)
class GGUFVocab:
    """The tokenizer as the GGUF file spells it."""

    ids: dict[str, int]
    merge_ranks: dict[tuple[str, str], int]
    control_tokens: tuple[str, ...]
    chat_template: str
    eos_token_id: int


@pytest.fixture(scope="module")
def gguf_vocab() -> GGUFVocab:
    import gguf

    fields = gguf.GGUFReader(resolve_model_path(None)).fields
    tokens = list(fields["tokenizer.ggml.tokens"].contents())
    types = list(fields["tokenizer.ggml.token_type"].contents())
    merges = [tuple(m.split(" ")) for m in fields["tokenizer.ggml.merges"].contents()]
    return GGUFVocab({t: i for i, t in enumerate(tokens)}, {m: r for r, m in enumerate(merges)},
                     tuple(t for t, k in zip(tokens, types) if k == _CONTROL),
                     str(fields["tokenizer.chat_template"].contents()),
                     int(fields["tokenizer.ggml.eos_token_id"].contents()))


def _byte_chars() -> dict[int, str]:
    """GPT-2's reversible bytes -> printable characters map (byte-level BPE spells bytes so)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    extra = (b for b in range(256) if b not in printable)
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(extra)}}


def _bpe(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """Merge the adjacent pair of lowest rank, everywhere, until no pair is a merge."""
    parts = list(word)
    while len(parts) > 1:
        pair = min(zip(parts, parts[1:]), key=lambda p: ranks.get(p, len(ranks)))
        if pair not in ranks:
            break
        merged, i = [], 0
        while i < len(parts):
            if i + 1 < len(parts) and (parts[i], parts[i + 1]) == pair:
                merged.append(parts[i] + parts[i + 1])
                i += 2
            else:
                merged.append(parts[i])
                i += 1
        parts = merged
    return parts


def reference_encode(vocab: GGUFVocab, text: str) -> list[int]:
    """Control tokens by name; between them digits one by one, GPT-2's split, byte-level BPE."""
    import regex

    chars = _byte_chars()
    ids: list[int] = []
    specials = "|".join(regex.escape(t) for t in vocab.control_tokens)
    for piece in regex.split(f"({specials})", text):
        if piece in vocab.ids and piece in vocab.control_tokens:
            ids.append(vocab.ids[piece])
            continue
        for chunk in regex.split(r"(\p{N})", piece):
            for word in regex.findall(_GPT2_SPLIT, chunk):
                spelled = "".join(chars[b] for b in word.encode("utf-8"))
                ids += [vocab.ids[p] for p in _bpe(spelled, vocab.merge_ranks)]
    return ids


@pytest.mark.parametrize("text", GGUF_STRINGS)
def test_gguf_tokenizer_ids_match_the_files_vocabulary(tok: Tokenizer, gguf_vocab: GGUFVocab,
                                                       text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == reference_encode(gguf_vocab, text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode(text) == ids  # the file says add_bos_token false: nothing is prepended


def test_gguf_chat_template_and_eos_match_the_file(tok: Tokenizer, gguf_vocab: GGUFVocab) -> None:
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
                {"role": "user", "content": "Thanks 🤗"}]
    expected = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                "Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
                "4.<|im_end|>\n<|im_start|>user\nThanks 🤗<|im_end|>\n<|im_start|>assistant\n")
    assert tok.hf.chat_template == gguf_vocab.chat_template
    assert tok.apply_chat_template(messages) == reference_encode(gguf_vocab, expected)
    assert tok.eos_token_ids == (gguf_vocab.eos_token_id,)


def test_gguf_of_an_architecture_transformers_does_not_read(tok: Tokenizer, tmp_path: Path) -> None:
    """A SmolLM3 GGUF (architecture smollm3, which transformers' GGUF reader refuses) takes its tokenizer
    from its llama-style tokenizer keys: here the default model's metadata under that architecture."""
    path = tmp_path / "smollm3.gguf"
    write_metadata_as(resolve_model_path(None), path, "smollm3")
    smollm3 = Tokenizer.load(path)
    text = "Continuous batching, paged KV: ünïcode & spaces  too."
    assert smollm3.encode(text) == tok.encode(text) and smollm3.vocab_size == tok.vocab_size
    assert smollm3.eos_token_ids == tok.eos_token_ids and smollm3.has_chat_template


def test_a_gguf_tokenizer_is_built_once_then_read_back_the_same(tok: Tokenizer, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"  # the default model's tokenizer, in a file of its own
    write_metadata_as(resolve_model_path(None), path, "llama")
    assert tokenizer_cache.load_cached(path) is None
    built = Tokenizer.load(path)  # built from the file, and saved
    assert tokenizer_cache.load_cached(path) is not None
    again = Tokenizer.load(path)  # read back
    messages = [{"role": "user", "content": TEXT}]
    for t in (built, again):
        assert t.encode(TEXT) == tok.encode(TEXT) and t.decode(tok.encode(TEXT)) == tok.decode(tok.encode(TEXT))
        assert t.apply_chat_template(messages) == tok.apply_chat_template(messages)
        assert (t.eos_token_ids, t.vocab_size) == (tok.eos_token_ids, tok.vocab_size)
    path.touch()  # a changed file is not read from its old copy
    assert tokenizer_cache.load_cached(path) is None


def test_the_tokenizer_cache_keeps_the_most_recently_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(tokenizer_cache, "MAX_ENTRIES", 2)
    paths = [tmp_path / f"model{i}.gguf" for i in range(3)]
    for path in paths:
        write_metadata_as(resolve_model_path(None), path, "llama")
    for path in paths:
        Tokenizer.load(path)
    assert tokenizer_cache.load_cached(paths[0]) is None  # the oldest, evicted
    assert all(tokenizer_cache.load_cached(p) is not None for p in paths[1:])
