"""The package root in vLLM's shape: `from cobatch import LLM, SamplingParams, ...`, torch loaded lazily."""

from __future__ import annotations

import subprocess
import sys

import cobatch


def test_root_exports_the_offline_api() -> None:
    from cobatch import LLM, CompletionOutput, EngineConfig, RequestOutput, SamplingParams
    from cobatch.config import EngineConfig as ConfigEngineConfig
    from cobatch.llm import LLM as FacadeLLM

    assert LLM is FacadeLLM and EngineConfig is ConfigEngineConfig
    assert SamplingParams(max_tokens=3).max_tokens == 3
    assert {"LLM", "SamplingParams", "RequestOutput", "EngineConfig"} <= set(cobatch.__all__)
    assert RequestOutput.__name__ == "RequestOutput" and CompletionOutput.__name__ == "CompletionOutput"


def test_unknown_name_is_an_attribute_error() -> None:
    try:
        cobatch.NoSuchThing  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_import_and_config_do_not_load_torch() -> None:
    code = ("import sys, cobatch; from cobatch import EngineConfig, SamplingParams; "
            "EngineConfig(); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
