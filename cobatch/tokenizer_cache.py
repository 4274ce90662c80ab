"""GGUF tokenizers kept on disk once built (torch-free, as the tokenizer).

transformers builds a GGUF file's tokenizer from its vocabulary and merges each time it is asked: ~8 s for
Llama 3's 128k tokens on this project's Zen 4, ~2.5 s for the default model, at every start of a server
and every `LLM()`. The copy it saves (tokenizer.json, its config, the chat template) reads back in ~0.3 s.
A copy is found by the file's resolved path, size and modification time and the tokenizer libraries'
versions, so a changed file or library builds anew; the MAX_ENTRIES most recently used are kept.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

MAX_ENTRIES = 8


def cache_root() -> Path:
    """$XDG_CACHE_HOME/cobatch/tokenizers (default ~/.cache/cobatch/tokenizers)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cobatch" / "tokenizers"


def load_cached(path: Path) -> object | None:
    """The saved tokenizer of the GGUF file `path`, or None (none saved, or it cannot be read)."""
    from transformers import AutoTokenizer

    entry = cache_root() / _key(path)
    if not entry.is_dir():
        return None
    try:
        hf = AutoTokenizer.from_pretrained(entry)
    except (OSError, ValueError):  # a copy left incomplete or from elsewhere: built anew
        return None
    os.utime(entry)  # recently used
    return hf


def keep(path: Path, hf_tokenizer: object) -> None:
    """Save the tokenizer built from `path`; a cache that cannot be written is skipped (built next time)."""
    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=root, prefix=".staging-"))
    except OSError:
        return
    try:
        hf_tokenizer.save_pretrained(staging)  # type: ignore[attr-defined]
        os.replace(staging, root / _key(path))  # atomic; another process's copy of the same file may win
    except OSError:
        pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _evict(root)


def _key(path: Path) -> str:
    import tokenizers
    import transformers

    stat = path.stat()
    identity = (f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{transformers.__version__}\0"
                f"{tokenizers.__version__}")
    return hashlib.sha256(identity.encode()).hexdigest()[:24]


def _evict(root: Path) -> None:
    """Remove all but the MAX_ENTRIES most recently used copies."""
    try:
        entries = sorted((p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")),
                         key=lambda p: p.stat().st_mtime, reverse=True)
    except OSError:  # another process evicting at the same time
        return
    for old in entries[MAX_ENTRIES:]:
        shutil.rmtree(old, ignore_errors=True)
