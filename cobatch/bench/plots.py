"""Matplotlib helpers (Agg backend: files only, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def new_figure(num_rows: int = 1, num_cols: int = 1, width: float = 8.0, height: float = 4.5,
               **kw: object) -> tuple[Figure, object]:
    """A figure and its axes."""
    return plt.subplots(num_rows, num_cols, figsize=(width, height), **kw)


def save(fig: Figure, path: str | Path) -> Path:
    """Write a PNG (creating its folder) and free the figure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def line_plot(path: str | Path, title: str, xlabel: str, ylabel: str,
              series: dict[str, tuple[list[float], list[float]]], hline: float | None = None,
              hline_label: str = "", logx: bool = False) -> Path:
    """Several (x, y) series on one axis, optionally with a horizontal reference line."""
    fig, ax = new_figure()
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=name)
    if hline is not None:
        ax.axhline(hline, color="red", linestyle="--", label=hline_label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    return save(fig, path)


def bar_plot(path: str | Path, title: str, ylabel: str, bars: dict[str, float]) -> Path:
    """One bar per label, value printed on top."""
    fig, ax = new_figure(width=max(5.0, 1.4 * len(bars)))
    names, values = list(bars), list(bars.values())
    drawn = ax.bar(names, values, color=[f"C{i}" for i in range(len(names))])
    ax.bar_label(drawn, fmt="%.1f")
    ax.set(title=title, ylabel=ylabel)
    ax.grid(axis="y", alpha=0.3)
    return save(fig, path)
