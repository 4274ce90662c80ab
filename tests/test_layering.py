"""The import boundaries of docs/ARCHITECTURE.md ("Import boundaries"), checked by parsing every module's imports."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "cobatch"

CORE = {"cobatch.request", "cobatch.block_manager", "cobatch.scheduler", "cobatch.cost_model",
        "cobatch.slo", "cobatch.spec_decode", "cobatch.wait_ledger"}
CONTRACTS = {"cobatch.config", "cobatch.sampling_params", "cobatch.scheduler_output", "cobatch.outputs",
             "cobatch.wait_reasons"}
# Test scaffolding (DESIGN.md §2): only `serve --enable-fault-injection` wires it into production code.
TESTING = "cobatch.testing"
# The kernels wing (DESIGN.md §2): models and the runner build on it; it imports nothing else of cobatch.
KERNELS = "cobatch.kernels"
WIRES_IN_TESTING = {"cobatch.server.cli", "cobatch.ray.replica"}
# The Ray wing (DESIGN.md §2): its routing core is pure (tested without a cluster, no torch), and no
# module outside it imports Ray (`import cobatch` and the single server stay Ray-free).
RAY_PURE = {"cobatch.ray.prefix_index", "cobatch.ray.inflight", "cobatch.ray.arrivals", "cobatch.ray.scoring",
            "cobatch.ray.routing_state", "cobatch.ray.ticket", "cobatch.ray.wire",
            "cobatch.ray.migration", "cobatch.ray.chunking", "cobatch.ray.app_config",
            "cobatch.ray.router_metrics", "cobatch.ray.dashboard_feed"}

# module (or package prefix) -> imports it must not make (a prefix forbids the whole package)
FORBIDDEN: dict[str, set[str]] = {
    "cobatch.config": {"torch", "cobatch"},
    "cobatch.sampling_params": {"torch", "cobatch"},
    "cobatch.wait_reasons": {"torch", "cobatch"},
    "cobatch.scheduler_output": {"torch", "numpy", "cobatch.scheduler", "cobatch.engine",
                                 "cobatch.runner", "cobatch.models", "cobatch.server"},
    "cobatch.outputs": {"torch", "numpy", *CORE, "cobatch.engine", "cobatch.runner", "cobatch.models",
                        "cobatch.server"},
    **{m: {"torch", "numpy", "cobatch.runner", "cobatch.models", "cobatch.server",
           "cobatch.engine", "cobatch.llm", "cobatch.async_engine"} for m in CORE},
    "cobatch.runner": {"cobatch.scheduler", "cobatch.block_manager", "cobatch.engine",
                       "cobatch.server", "cobatch.request"},
    "cobatch.models": {"cobatch.scheduler", "cobatch.block_manager", "cobatch.engine",
                       "cobatch.server", "cobatch.request"},
    "cobatch.models.llama": {"cobatch.kernels.decoder", "cobatch.runner"},  # the runner picks the layer loop
    "cobatch.engine": {"cobatch.server"},
    "cobatch.llm": {"cobatch.server", "cobatch.request"},
    "cobatch.async_engine": {"cobatch.server"},
    "cobatch.server": {"cobatch.scheduler", "cobatch.runner", "cobatch.block_manager", "cobatch.models",
                       "cobatch.engine", "cobatch.request", "torch", KERNELS},
    # structured outputs: a leaf beside the runner (the engine drives it; the server checks constraints
    # with its grammar_spec, which needs no torch)
    "cobatch.structured_output": {"cobatch.scheduler", "cobatch.block_manager", "cobatch.engine",
                                  "cobatch.server", "cobatch.request", "cobatch.runner", "cobatch.models",
                                  KERNELS},
    "cobatch.structured_output.grammar_spec": {"torch", "cobatch.tokenizer"},
    "cobatch.model_paths": {"torch", "cobatch"},  # locating files: the tokenizer and server use it
    "cobatch.tokenizer_cache": {"torch", "cobatch"},  # the tokenizer's saved copies: no model
    "cobatch.testing": {"cobatch.server"},
    # the live views' records and the traces built from them: the loop side of the engine, no model
    **{m: {"torch", "cobatch.server", "cobatch.engine", "cobatch.runner", "cobatch.models", "cobatch.kernels",
           "cobatch.scheduler"} for m in ("cobatch.step_history", "cobatch.tracing")},
    "cobatch.bench.serve": {"cobatch.engine", "cobatch.scheduler", "cobatch.runner", "torch"},
    "cobatch.config_cli": {"torch", "cobatch.engine", "cobatch.runner", "cobatch.models", "cobatch.server",
                           "cobatch.scheduler", "cobatch.llm"},  # the flags of EngineConfig: no engine
    **{m: {"ray", "torch", "numpy", "cobatch.runner", "cobatch.models"} for m in RAY_PURE},
}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every module named by an import statement, anywhere in the file (lazy imports count)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def rules_for(module: str) -> set[str]:
    rules: set[str] = set()
    for key, forbidden in FORBIDDEN.items():
        if module == key or module.startswith(key + "."):
            rules |= forbidden
    return rules


def violates(name: str, forbidden: str) -> bool:
    return name == forbidden or name.startswith(forbidden + ".")


MODULES = sorted(ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: module_name(p))
def test_import_boundaries(path: Path) -> None:
    module = module_name(path)
    forbidden = rules_for(module)
    # The contract types are everyone's; the core modules may import each other.
    allowed = CONTRACTS | (CORE if module in CORE else set()) | {module}
    bad = sorted({name for name in imports_of(path) for f in forbidden
                  if violates(name, f) and name not in allowed})
    assert not bad, f"{module} imports {bad}, which DESIGN.md §4 forbids"


def test_production_code_does_not_import_the_testing_package() -> None:
    importers = {module_name(p) for p in MODULES if not violates(module_name(p), TESTING)
                 and any(violates(name, TESTING) for name in imports_of(p))}
    assert importers <= WIRES_IN_TESTING, f"{sorted(importers - WIRES_IN_TESTING)} import {TESTING}"


@pytest.mark.parametrize("path", sorted((ROOT / "kernels").rglob("*.py")), ids=lambda p: module_name(p))
def test_kernels_import_nothing_else_of_cobatch(path: Path) -> None:
    outside = sorted(name for name in imports_of(path) if violates(name, "cobatch") and not violates(name, KERNELS))
    assert not outside, f"{module_name(path)} imports {outside}: the kernels wing stands alone"


def _path_of(module: str) -> Path | None:
    """The file of a cobatch module; None for a name imported from a module (a function, a class)."""
    base = ROOT.parent / module.replace(".", "/")
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def test_bench_serve_reaches_nothing_of_the_engine() -> None:
    """bench serve measures any server: it and every cobatch module it imports, transitively, are
    cobatch.bench.* (no config, no engine)."""
    seen: set[str] = set()
    todo = ["cobatch.bench.serve"]
    while todo:
        module = todo.pop()
        path = _path_of(module)
        if module in seen or path is None:
            continue
        seen.add(module)
        todo += [name for name in imports_of(path) if violates(name, "cobatch")]
    outside = sorted(m for m in seen if not violates(m, "cobatch.bench"))
    assert not outside, f"bench serve reaches {outside}"


def test_only_the_ray_wing_imports_ray() -> None:
    importers = {module_name(p) for p in MODULES if not violates(module_name(p), "cobatch.ray")
                 and any(violates(name, "ray") for name in imports_of(p))}
    assert not importers, f"{sorted(importers)} import ray: only cobatch.ray may"


def test_the_pure_ray_modules_are_checked() -> None:
    assert RAY_PURE <= {module_name(p) for p in MODULES}


def test_importing_cobatch_and_its_ray_package_loads_no_ray() -> None:
    """build_app is loaded on first use: `cobatch --help` and one server never pay Ray's import."""
    code = ("import sys, cobatch, cobatch.ray, cobatch.ray.app_config, cobatch.server.cli; "
            "assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT.parent)


def test_the_scheduling_core_is_checked() -> None:
    names = {module_name(p) for p in MODULES}
    assert CORE <= names and "cobatch.engine" in names
