"""Engine flags derived from EngineConfig's fields: every command's engine options have one source.

A field `max_num_seqs: int = 64` with help in its metadata becomes `--max-num-seqs` (type int, default 64);
`X | None` is X with default None, a Literal gives choices, a bool gives `--flag/--no-flag`.
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import Field, fields
from typing import Literal

from cobatch.config import EngineConfig, SchedulingOptions


def flag_name(field_name: str) -> str:
    """`max_num_seqs` -> `--max-num-seqs`."""
    return "--" + field_name.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add one flag per EngineConfig field to `parser`, in an "engine" group."""
    group = parser.add_argument_group("engine", "engine options (EngineConfig's fields)")
    hints = typing.get_type_hints(EngineConfig)
    shared = {f.name for f in fields(SchedulingOptions)}
    for f in sorted(fields(EngineConfig), key=lambda f: f.name in shared):  # model, dtype, ... first
        group.add_argument(flag_name(f.name), dest=f.name, **_argument_options(f, hints[f.name]))


def engine_config_from_args(args: argparse.Namespace, **overrides: object) -> EngineConfig:
    """The EngineConfig the parsed flags describe (ValueError on bad values); `overrides` win."""
    values = {f.name: getattr(args, f.name) for f in fields(EngineConfig)}
    return EngineConfig(**{**values, **overrides})  # type: ignore[arg-type]


def _argument_options(f: Field, annotation: object) -> dict[str, object]:
    """add_argument's keywords for one field: type or choices or boolean action, default, help."""
    help_text = f.metadata["help"].replace("%", "%%")  # argparse %-formats help
    kind = _without_none(annotation)
    if kind is bool:  # BooleanOptionalAction adds "(default: ...)" itself
        return {"action": argparse.BooleanOptionalAction, "default": f.default, "help": help_text}
    if f.default is not None:
        help_text += " (default: %(default)s)"
    options: dict[str, object] = {"default": f.default, "help": help_text}
    if typing.get_origin(kind) is Literal:
        options["choices"] = typing.get_args(kind)
    else:
        assert kind in (int, float, str), f"no flag type for {f.name}: {annotation}"
        options["type"] = kind
    return options


def _without_none(annotation: object) -> object:
    """`int | None` -> int; anything else as it is."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is not Literal and len(args) == 1:
        return args[0]
    return annotation
