"""The accuracy figures of the fidelity benchmarks (`fidelity.py`, `recipe_crossover.py`): % of the teacher with
the 95 % goal drawn, one PNG each."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def figure(rows: int, cols: int, size: tuple[float, float]) -> tuple[Any, Any]:
    """A matplotlib figure (Agg, no display) of rows × cols axes (always a 2-D array)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, cols, figsize=size, squeeze=False)


def percent_axis(ax: Any, xlabel: str, ylabel: str) -> None:
    """An axis of % of the teacher (0-105) with the 95 % goal as a dashed line."""
    ax.axhline(95, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, 105)
    ax.grid(alpha=0.3)


def save(fig: Any, axes: Any, path: Path, title: str) -> None:
    """The legend on the first axis, the title, then `path` (PNG, 90 dpi); the figure closed."""
    import matplotlib.pyplot as plt

    axes[0][0].legend(fontsize=8, loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
